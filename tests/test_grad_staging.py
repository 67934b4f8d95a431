"""Gradients staged through host memory: they cross in the compute dtype and are added or
converted on the host (CUDA's path, run here on the simulated device with an emulated link so
the copies run on the copy worker while backward goes on)."""

import pytest
import torch

from tierwise.offload import Engine, flat_options
from tierwise.offload.plan.planner import make_plan
from tierwise.offload.engine import gradients
from tierwise.offload.plan import needs
from tierwise.profiles import ModelProfile
from tests.models import batches, tiny_llama, train_reference

CHUNK = 16 << 10


def _run(monkeypatch, stage: bool, precision: str, data):
    monkeypatch.setattr(gradients, "STAGE_ON_SIMULATED", stage)
    eng = Engine(tiny_llama(), **flat_options(lr=1e-3, gpu_mem="1M", chunk_bytes=CHUNK, precision=precision,
                                              d2h_bandwidth=2e9))
    try:
        losses = [eng.step(b, grad_accum=4) for b in data]
        return eng, losses, dict(eng.named_parameters_fp32())
    finally:
        eng.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("cap", [None, 8192], ids=["whole", "in-slices"])
def test_staged_gradients_train_as_before(monkeypatch, precision, cap):
    """4 micro-batches a step (every later one added on the host): fp32 as plain PyTorch, bit for
    bit; bf16 (each gradient crossing as bf16, converted on the host) as the engine without
    staging. The buffer is the largest gradient copy's bytes, booked on the host; capped below
    it, each larger copy crosses in slices of the buffer."""
    if cap is not None:
        monkeypatch.setattr(needs, "GRAD_STAGING_CAP", cap)
    data = batches(3, batch=8)
    eng, losses, weights = _run(monkeypatch, True, precision, data)
    assert eng.grads.staged > 0 and eng.staging_buffer.numel() == eng.grad_staging > 0
    assert eng.grad_staging == min(eng.needs.grad_copy, cap or eng.needs.grad_copy)
    assert eng.ledger.kind_peak("host", "buffer") >= eng.grad_staging
    if precision == "fp32":
        ref_losses, ref = train_reference(tiny_llama(), data, grad_accum=4)
        expected = ref_losses, {n: p.detach() for n, p in ref.named_parameters()}
    else:
        plain, plain_losses, plain_weights = _run(monkeypatch, False, precision, data)
        assert plain.staging_buffer is None and plain.grads.staged == 0
        expected = plain_losses, plain_weights
    assert losses == expected[0]
    for name, w in expected[1].items():
        assert torch.equal(weights[name], w), name


def test_the_plan_books_the_staging_the_engine_books(monkeypatch):
    """On CUDA (planned with cuda=True; the engine's staging forced on the simulated device) the
    host reserve "grad staging" is the engine's buffer, in the host peak."""
    monkeypatch.setattr(gradients, "STAGE_ON_SIMULATED", True)
    eng = Engine(tiny_llama(), **flat_options(gpu_mem="1M", chunk_bytes=CHUNK, precision="bf16"))
    staged = eng.grad_staging
    eng.close()
    args = dict(model=ModelProfile.from_hf_config(tiny_llama().config), hardware="cpu-sim", gpu_mem="1G",
                cpu_mem="1G", optimizer="adamw", precision="bf16", batch_size=2, seq_len=16, chunk_bytes=CHUNK)
    on_gpu, simulated = make_plan(**args, cuda=True), make_plan(**args, cuda=False)
    assert on_gpu.reserve["host"]["grad staging"] == staged > 0
    assert "grad staging" not in simulated.reserve["host"]
    assert on_gpu.peak["host"] - simulated.peak["host"] == staged


def test_the_engine_fits_the_planned_host_minimum_with_its_staging(monkeypatch):
    """The plan's host minimum counts the staging buffer as the engine books it: the engine
    trains at exactly that budget, and one byte less is refused naming the same minimum."""
    from tierwise.offload import InfeasibleBudget

    monkeypatch.setattr(gradients, "STAGE_ON_SIMULATED", True)
    profile = ModelProfile.from_hf_config(tiny_llama().config)
    need = make_plan(model=profile, hardware="cpu-sim", gpu_mem="1G", cpu_mem="1G", optimizer="adamw",
                     precision="bf16", batch_size=2, seq_len=16, chunk_bytes=CHUNK, cuda=True, up_front=False).host_minimum
    kw = dict(gpu_mem="300K", chunk_bytes=CHUNK, precision="bf16")
    with pytest.raises(InfeasibleBudget, match="of it for staging gradients") as info:
        Engine(tiny_llama(), **flat_options(cpu_mem=need - 1, **kw))
    assert info.value.minimum["host"] == need
    eng = Engine(tiny_llama(), **flat_options(cpu_mem=need, **kw))
    try:
        eng.step(batches(1, batch=2)[0])
        assert eng.ledger.peaks()["host"] <= need
    finally:
        eng.close()
