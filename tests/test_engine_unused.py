"""A trainable parameter without a gradient in a step (an unused branch, an expert no token
reached) sits the update out, as torch.optim skips a parameter whose .grad is None: the engine
equals plain PyTorch and the drop-in optimizers bit for bit over steps where blocks come and go."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tierwise.offload import Engine, flat_options
from tierwise.offload.update.updaters import drop_in_groups
from tierwise.optim import AdamW8bit, GaLoreAdamW
from tests.param_models import HP, Zoo, zoo_data, zoo_loss

CHUNK = 4 << 10
# what each step's forward leaves out: a block (its index), or a block's bias ("bias<i>": the
# chunk holding it holds parameters that do train); block 2 first trains at step 3
SKIPPED = [{2}, {1, 2, "bias0"}, {2}, {"bias3"}, {1, 3}, {"bias0"}, {0, 1, 2, 3}]
KINDS = ("scalar", "odd")  # 0-dim and odd-sized parameters (the fused kernel's scalar tails)


class Skipping(Zoo):
    """A Zoo whose forward leaves out what `skip` names (see SKIPPED)."""

    skip: set = set()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for i, block in enumerate(self.blocks):
            if f"bias{i}" in self.skip:
                h = torch.tanh(block.mix(F.linear(h, block.lin.weight)))
            elif i not in self.skip:
                h = block(h)
        return F.mse_loss(self.head(h), y)


OPTIMIZERS = {
    "adamw": (lambda m: torch.optim.AdamW(m.parameters(), fused=True, **HP), {}),
    "sgd": (lambda m: torch.optim.SGD(m.parameters(), lr=HP["lr"], momentum=0.9, weight_decay=0.1),
            dict(optimizer="sgd", momentum=0.9, weight_decay=0.1)),
    "adamw8bit": (lambda m: AdamW8bit(m.parameters(), **HP), dict(optimizer="adamw8bit")),
    "galore": (lambda m: GaLoreAdamW(drop_in_groups(m, rank=4, update_proj_gap=2), **HP),
               dict(optimizer="galore", optimizer_kwargs={"rank": 4, "update_proj_gap": 2})),
}


def _reference(make_opt, data, grad_accum):
    """Plain PyTorch over the SKIPPED schedule: (losses, model, optimizer)."""
    model, losses = Skipping(KINDS), []
    opt = make_opt(model)
    for skip, b in zip(SKIPPED, data):
        model.skip, total = skip, 0.0
        for i in range(grad_accum):
            loss = zoo_loss(model, {k: v.chunk(grad_accum)[i] for k, v in b.items()})
            (loss / grad_accum if grad_accum > 1 else loss).backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total / grad_accum)
    return losses, model, opt


@pytest.mark.parametrize("setting", ["roomy", "streamed-nvme", "accum2"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_parameter_without_gradient_sits_the_update_out(name, setting, tmp_path):
    make_opt, kw = OPTIMIZERS[name]
    accum = 2 if setting == "accum2" else 1
    data = zoo_data(len(SKIPPED), batch=4)
    ref_losses, ref, _ = _reference(make_opt, data, accum)
    budget = {} if setting == "roomy" else dict(gpu_mem=64 << 10, cpu_mem=224 << 10, nvme_path=str(tmp_path))
    model = Skipping(KINDS)
    eng = Engine(model, **flat_options(loss_fn=zoo_loss, chunk_bytes=CHUNK, **(HP | kw | budget)))
    if budget:  # (placed for every block's activations: the first step leaves one out)
        assert eng.measure(data[0]) > 0 and eng.homes.bytes["nvme"]
    losses = []
    for skip, b in zip(SKIPPED, data):
        model.skip = skip
        losses.append(eng.step(b, grad_accum=accum))
    assert losses == ref_losses
    mine = dict(eng.named_parameters_fp32())
    for n, p in ref.named_parameters():
        assert torch.equal(mine[n], p.detach()), n
    eng.close()


def test_what_a_parameter_sat_out_survives_a_checkpoint():
    """The count of updates a parameter missed is part of the engine's state: a resumed run
    goes on as the uninterrupted one (AdamW's bias correction depends on it)."""
    data = zoo_data(len(SKIPPED))
    _, ref, _ = _reference(OPTIMIZERS["adamw"][0], data, 1)
    model = Skipping(KINDS)
    eng = Engine(model, **flat_options(loss_fn=zoo_loss, chunk_bytes=CHUNK, **HP))
    for skip, b in zip(SKIPPED[:3], data):
        model.skip = skip
        eng.step(b)
    saved = eng.state_dict()
    assert saved["missed"]  # block 2 has sat out three updates
    eng.close()
    again_model = Skipping(KINDS)
    again = Engine(again_model, **flat_options(loss_fn=zoo_loss, chunk_bytes=CHUNK, **HP))
    again.load_state_dict(saved)
    for skip, b in zip(SKIPPED[3:], data[3:]):
        again_model.skip = skip
        again.step(b)
    mine = dict(again.named_parameters_fp32())
    for n, p in ref.named_parameters():
        assert torch.equal(mine[n], p.detach()), n
    again.close()


def test_clipping_leaves_out_a_parameter_without_gradient():
    """torch.nn.utils.clip_grad_norm_ takes the norm over the gradients there are: a zero in
    the list of norms in place of a None can change its rounding, hence the clip coefficient."""
    differ = 0
    for b in zoo_data(6):
        ref = Skipping(KINDS)
        ref.skip = {1, 2, "bias0"}
        opt = torch.optim.AdamW(ref.parameters(), fused=True, **HP)
        zoo_loss(ref, b).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        with_zeros = torch.nn.utils.get_total_norm([p.grad if p.grad is not None else torch.zeros_like(p)
                                                    for p in ref.parameters()])
        differ += not torch.equal(norm, with_zeros)
        opt.step()
        model = Skipping(KINDS)
        model.skip = {1, 2, "bias0"}
        eng = Engine(model, **flat_options(loss_fn=zoo_loss, chunk_bytes=CHUNK, grad_clip=0.05, **HP))
        eng.step(b)
        assert torch.equal(eng.last_grad_norm, norm)
        mine = dict(eng.named_parameters_fp32())
        for n, p in ref.named_parameters():
            assert torch.equal(mine[n], p.detach()), n
        eng.close()
    assert differ  # (the case the test is for: with zeros the norm would round otherwise)
