"""MeZO in the engine: one fetch per chunk per step (ZO2's trick, from NVMe too), and the same
parameters as the drop-in optimizer step for step."""

import copy

import pytest
import torch

from tierwise.offload import Budget, Engine, Optim, flat_options
from tierwise.optim import MeZO
from tests.models import batches, tiny_llama


@pytest.mark.parametrize("tie,nvme,gpu", [(True, False, "600K"), (False, True, "600K"), (True, False, None)],
                         ids=["tied-host", "untied-nvme", "all-on-device"])
def test_engine_mezo_equals_drop_in_and_fetches_each_chunk_once(tmp_path, tie, nvme, gpu):
    data = batches(4)
    ref = tiny_llama(tie=tie)
    model = copy.deepcopy(ref)
    opt = MeZO(ref.parameters(), lr=1e-3, eps=1e-3, weight_decay=0.01)
    ref_losses = [float(opt.step(lambda b=b: ref(**b).loss)) for b in data]
    extra = dict(cpu_mem="400K", nvme_path=str(tmp_path)) if nvme else {}
    eng = Engine(model, **flat_options(optimizer="mezo", lr=1e-3, weight_decay=0.01, optimizer_kwargs={"eps": 1e-3},
                 gpu_mem=gpu, chunk_bytes=16 << 10, **extra))
    if nvme:
        assert eng.homes.bytes["nvme"]["master"] > 0
    losses = [eng.step(data[0])]
    after_warmup = eng.cache.fetched_bytes  # the warm-up step streams through the smallest window
    losses += [eng.step(b) for b in data[1:]]
    assert losses == ref_losses
    mine = dict(eng.named_parameters_fp32())
    assert all(torch.equal(mine[n], p.detach()) for n, p in ref.named_parameters())
    streamed = sum(c.numel * 4 for c in eng.plan.chunks if not eng.store.is_gpu_home(c.index))
    # once a step, not twice; a tied embedding is used at both ends of the model, and a small
    # cache may have to fetch it again for the output head
    tied = 128 * 64 * 4 if tie and gpu is not None and not eng.store.is_gpu_home(0) else 0
    per_step = (eng.cache.fetched_bytes - after_warmup) / (len(data) - 1)
    assert streamed <= per_step <= streamed + tied
    if gpu is None:
        assert streamed == 0  # everything stays on the device
    else:
        assert eng.ledger.peaks()["gpu"] <= 600 << 10
    assert eng.ledger.usage()["host"].get("grad", 0) == 0  # no gradients anywhere


def test_engine_mezo_lowers_the_loss():
    torch.manual_seed(0)
    data = batches(1)[0]
    eng = Engine(tiny_llama(), budget=Budget(gpu="600K", chunk=16 << 10),
                 optim=Optim("mezo", lr=1e-3, kwargs={"eps": 1e-3}))
    first = eng.eval_loss(data)
    for _ in range(60):
        eng.step(data)
    assert eng.eval_loss(data) < first - 0.05


@pytest.mark.parametrize("accum", [1, 2])
def test_the_mezo_losss_transients_are_booked_while_it_runs(accum):
    """On the simulated device the ledger holds MeZO's loss transients (perfmodel.
    zo_loss_workspace, measured against RSS by bench/loss_workspace.py) while each micro-batch's
    doubled forward runs its head, nothing after."""
    from tierwise.offload.plan.perfmodel import zo_loss_workspace

    data = batches(2)
    ref = tiny_llama()
    model = copy.deepcopy(ref)
    eng = Engine(model, **flat_options(optimizer="mezo", lr=1e-3, optimizer_kwargs={"eps": 1e-3},
                                       gpu_mem="600K", chunk_bytes=16 << 10))
    seen = []
    hook = model.get_output_embeddings().register_forward_pre_hook(
        lambda *_: seen.append(eng.ledger.usage()["gpu"].get("activation", 0)))
    for b in data:
        eng.step(b, grad_accum=accum)
    hook.remove()
    rows, seq = data[0]["labels"].shape
    vocab = model.get_output_embeddings().out_features
    assert seen == [zo_loss_workspace(t=rows // accum * seq, vocab=vocab, e=4)] * (len(data) * accum)
    assert eng.ledger.usage()["gpu"].get("activation", 0) == 0
    eng.close()
