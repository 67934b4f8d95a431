"""The planner against the engine on the simulated device: same gpu-home chunks, same host
bytes, peaks per tier and the gpu minimum within 10% of what the engine's ledger measures.

Both sides see the same shapes: the engine trains `profile.to_hf_config()`, the planner plans
the profile. Peaks are compared in steady state: the ledger's peaks are reset after the warm-up
step (in which the engine, not yet knowing the activations, keeps every chunk host-side).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from tierwise.offload import Activations, Budget, Engine, Optim, Precision
from tierwise.offload.core.chunks import pack_chunks
from tierwise.offload.plan.planner import make_plan
from tierwise.profiles import ModelProfile

TOL = 0.10


def llama(name: str, *, h: int, i: int, layers: int, heads: int, kv: int, vocab: int) -> ModelProfile:
    return ModelProfile(name=name, family="llama", hidden_size=h, intermediate_size=i, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                        max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-5)


TINY = llama("tiny", h=64, i=176, layers=3, heads=4, kv=2, vocab=512)
MID = llama("mid-29m", h=512, i=1376, layers=4, heads=8, kv=4, vocab=16000)  # 29.4M parameters
CASES = [  # (profile, precision, batch, seq, chunk bytes)
    pytest.param(TINY, "fp32", 2, 32, 16 << 10, id="tiny-fp32-2x32"),
    pytest.param(TINY, "bf16", 4, 16, 16 << 10, id="tiny-bf16-4x16"),
    pytest.param(MID, "fp32", 1, 64, 4 << 20, id="mid29m-fp32-1x64"),
    pytest.param(MID, "bf16", 2, 32, 4 << 20, id="mid29m-bf16-2x32"),
]


def plan_for(profile, precision, batch, seq, chunk, gpu, optimizer="adamw", optimizer_kwargs=None):
    return make_plan(model=profile, hardware="cpu-sim", gpu_mem=gpu, cpu_mem="64G", optimizer=optimizer,
                     precision=precision, batch_size=batch, seq_len=seq, chunk_bytes=chunk,
                     optimizer_kwargs=optimizer_kwargs)


def run_engine(model, *, precision, batch, seq, chunk, gpu, vocab, optimizer="adamw", optimizer_kwargs=None):
    eng = Engine(model, budget=Budget(gpu=gpu, chunk=chunk), optim=Optim(optimizer, kwargs=optimizer_kwargs),
                 precision=Precision(precision), activations=Activations(recompute=True))  # (as planned)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (batch, seq), generator=g)
    eng.step({"input_ids": x, "labels": x})  # warm-up: measures activations, places chunks
    eng.ledger.reset_peaks()
    eng.step({"input_ids": x, "labels": x})
    eng.close()
    return eng


@pytest.mark.parametrize("optimizer, kwargs", [("sgd", None), ("galore8bit", {"rank": 8})])
def test_planner_knows_every_engine_optimizer(optimizer, kwargs):
    """Every optimizer training accepts, `plan` accepts too, with the engine's bytes."""
    test_planner_predicts_engine_bytes(TINY, "fp32", 2, 32, 16 << 10, optimizer=optimizer, optimizer_kwargs=kwargs)


@pytest.mark.parametrize("profile, precision, batch, seq, chunk", CASES)
def test_planner_predicts_engine_bytes(profile, precision, batch, seq, chunk, optimizer="adamw", optimizer_kwargs=None):
    opt = dict(optimizer=optimizer, optimizer_kwargs=optimizer_kwargs)
    smallest = plan_for(profile, precision, batch, seq, chunk, gpu="64G", **opt)
    minimum = smallest.gpu_minimum
    all_home = sum(smallest.bytes["gpu"].values())
    for label, gpu in (("roomy", 2 * (minimum + all_home)), ("mid", minimum + all_home // 2), ("minimum", minimum)):
        plan = plan_for(profile, precision, batch, seq, chunk, gpu=gpu, **opt)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(profile.to_hf_config())  # an engine takes over its model
        eng = run_engine(model, precision=precision, batch=batch, seq=seq, chunk=chunk, gpu=gpu,
                         vocab=profile.vocab_size, **opt)
        where = f"{label} budget {gpu} B"
        assert [c.params for c in eng.plan.chunks] == [c.params for c in pack(profile, chunk).chunks], where
        assert eng.minimum_gpu_bytes == pytest.approx(plan.gpu_minimum, rel=TOL), where
        home = {h.index for h in plan.chunk_homes if h.update == "gpu"}
        assert set(eng.device_plan.gpu_home) == home, where
        assert eng.ledger.usage().get("host", {}) == {k: v for k, v in plan.bytes["host"].items() if v}, where
        peaks = eng.ledger.peaks()
        for tier in ("gpu", "host"):
            assert peaks[tier] == pytest.approx(plan.peak[tier], rel=TOL, abs=1024), (where, tier, peaks, plan.peak)
        assert peaks["gpu"] <= gpu


@pytest.mark.parametrize("hardware,cuda", [("rtx4090", None), ("cpu-sim", True)])
def test_a_cuda_plan_and_the_engine_placed_up_front_leave_the_same_workspace_margin(monkeypatch, hardware, cuda):
    """On CUDA the engine leaves the allocator a margin of the gpu budget (offload.engine.workspace);
    placed up front from the planned activations (as `finetune` and --verify run), it picks the
    gpu-home chunks and the cache of a CUDA profile's plan, fewer than the simulated device's
    at the same budget; so does a "cpu-sim" plan for a CUDA device (`cuda=True`: a GPU machine
    run without --hardware). The CUDA device is faked at construction: only the placement is read."""
    from tierwise.offload.engine import engine as engine_module
    from tierwise.offload.engine.workspace import Workspace

    class CudaWorkspace(Workspace):
        def __init__(self, device, ledger):
            super().__init__(device, ledger)
            self.cuda = True

    monkeypatch.setattr(engine_module, "Workspace", CudaWorkspace)
    args = dict(model=TINY, cpu_mem="64G", optimizer="adamw", precision="fp32", batch_size=2, seq_len=32,
                chunk_bytes=16 << 10)
    smallest = make_plan(hardware="rtx4090", gpu_mem="64G", **args)
    gpu = smallest.gpu_minimum + sum(smallest.bytes["gpu"].values()) // 2
    plan = make_plan(hardware=hardware, cuda=cuda, gpu_mem=gpu, **args)
    sim = make_plan(hardware="cpu-sim", gpu_mem=gpu, **args)
    home = {h.index for h in plan.chunk_homes if h.update == "gpu"}
    assert plan.workspace_margin > 0 and sim.workspace_margin == 0
    assert 0 < len(home) < len({h.index for h in sim.chunk_homes if h.update == "gpu"})
    torch.manual_seed(0)
    eng = Engine(transformers.LlamaForCausalLM(TINY.to_hf_config()), budget=Budget(gpu=gpu, chunk=16 << 10),
                 precision=Precision("fp32"), activations=Activations(expected=plan.reserve["gpu"]["activations"]))
    try:
        assert set(eng.device_plan.gpu_home) == home
        assert eng.device_plan.cache_limit == plan.cache_limit
    finally:
        eng.close()


def pack(profile, chunk):
    return pack_chunks(profile.param_specs(), chunk_bytes=chunk)
