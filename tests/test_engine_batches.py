"""How the engine splits a step's batch and weighs its micro-batches, against plain PyTorch."""

import collections
import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tierwise.offload import Engine, Optim
from tierwise.offload.engine.batches import split_batch


class Classifier(torch.nn.Module):
    """A Hugging Face style sequence classifier: one label per row, `.loss` the rows' mean."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, input_ids, labels):
        logits = self.head(self.embed(input_ids).mean(1))
        return SimpleNamespace(loss=F.cross_entropy(logits, labels), logits=logits)


def reference_steps(model, batches, grad_accum, loss_of):
    """Plain PyTorch: each micro-batch backpropagates loss / grad_accum (equal rows)."""
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0, fused=True)
    losses = []
    for batch in batches:
        total = 0.0
        for i in range(grad_accum):
            loss = loss_of(ref, [part.chunk(grad_accum)[i] for part in batch])
            (loss * (1.0 / grad_accum)).backward()
            total += loss.item() * (1.0 / grad_accum)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, ref


def assert_weights_equal(eng, ref):
    mine = dict(eng.named_parameters_fp32())
    for name, p in ref.named_parameters():
        assert torch.equal(mine[name], p.detach()), name


def test_one_label_per_row_micro_batches_of_one_row_weigh_alike():
    """1-D labels (a classifier's) have nothing to shift: a micro-batch of one row has one
    target, not 0 (which refused the step as 'every label is -100')."""
    torch.manual_seed(0)
    model = Classifier()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 32, (4, 6), generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(3)]
    ref_losses, ref = reference_steps(model, data, 4, lambda m, b: m(input_ids=b[0], labels=b[1]).loss)
    eng = Engine(copy.deepcopy(model), optim=Optim(lr=1e-2))
    try:
        losses = [eng.step({"input_ids": x, "labels": y}, grad_accum=4) for x, y in data]
        assert losses == ref_losses
        assert_weights_equal(eng, ref)
    finally:
        eng.close()


def test_a_tuple_batch_splits_into_micro_batches():
    """(inputs, targets), the plain PyTorch batch a custom loss_fn takes, splits like a dict."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(6, 8, generator=g), torch.randn(6, 2, generator=g)) for _ in range(3)]

    def loss_fn(m, batch):
        x, y = batch
        return F.mse_loss(m(x), y)

    ref_losses, ref = reference_steps(model, data, 2, loss_fn)
    eng = Engine(copy.deepcopy(model), optim=Optim(lr=1e-2), loss_fn=loss_fn)
    try:
        assert [eng.step(b, grad_accum=2) for b in data] == ref_losses
        assert_weights_equal(eng, ref)
    finally:
        eng.close()


def test_plain_values_in_a_batch_go_to_every_micro_batch():
    """None (an HF attention_mask left out), flags and numbers have no rows: each micro-batch
    gets them as they are (a TypeError before)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)) for _ in range(2)]

    def loss_fn(m, batch):
        assert batch["mask"] is None and batch["scale"] == 2.0
        return F.mse_loss(m(batch["x"]) * batch["scale"], batch["y"])

    ref_losses, ref = reference_steps(model, data, 2, lambda m, b: F.mse_loss(m(b[0]) * 2.0, b[1]))
    eng = Engine(copy.deepcopy(model), optim=Optim(lr=1e-2), loss_fn=loss_fn)
    try:
        losses = [eng.step({"x": x, "y": y, "mask": None, "scale": 2.0}, grad_accum=2) for x, y in data]
        assert losses == ref_losses
        assert_weights_equal(eng, ref)
    finally:
        eng.close()


def test_a_list_of_plain_values_is_refused_not_copied():
    """A list of plain values (per-row lengths, say) cannot be told from a setting: copied to
    every micro-batch it would pair rows with other rows' values, so it is refused by name; a
    namedtuple batch splits into namedtuples."""
    batch = {"x": torch.arange(4), "lengths": [5, 7, 3, 9]}
    with pytest.raises(TypeError, match="list of plain values"):
        split_batch(batch, 2)
    pair = collections.namedtuple("Pair", "x y")(torch.arange(4), torch.arange(4) * 2)
    parts = split_batch(pair, 2)
    assert [type(p) for p in parts] == [type(pair)] * 2
    assert torch.equal(parts[1].y, torch.tensor([4, 6]))
