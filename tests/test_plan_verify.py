"""`finetune plan --verify` and offload.tools.verify: a few real steps, planned vs measured per tier."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from tierwise.cli.main import app
from tierwise.offload.core.errors import InfeasibleBudget, TierwiseError
from tierwise.offload.runtime.ledger import Ledger
from tierwise.offload.tools.verify import verify
from tierwise.profiles import ModelProfile

TINY = ModelProfile(name="tiny-verify", family="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=128,
                    rope_theta=10000.0, rms_norm_eps=1e-5)
RUN = dict(model=TINY, gpu_mem="1M", cpu_mem="64M", optimizer="adamw", precision="fp32", batch_size=2,
           seq_len=32, chunk_bytes="16K")
CLI = ["plan", "--model", "tiny", "--gpu-mem", "2M", "--cpu-mem", "64M", "--batch-size", "2",
       "--seq-len", "32", "--chunk-size", "16K", "--verify"]


def under_count_state(monkeypatch) -> None:
    """A broken ledger: every optimizer state books half its bytes (consistently)."""
    reserve, release = Ledger.reserve, Ledger.release

    def half(fn):
        return lambda self, tier, kind, nbytes: fn(self, tier, kind, nbytes // 2 if kind == "state" else nbytes)

    monkeypatch.setattr(Ledger, "reserve", half(reserve))
    monkeypatch.setattr(Ledger, "release", half(release))


def test_verify_passes_and_reports_every_tier(tmp_path):
    # a CXL budget that holds part of this model: host, CXL and NVMe are all in use
    report = verify(**{**RUN, "cpu_mem": "2M", "cxl_mem": "1108K"}, nvme_path=str(tmp_path / "swap"), steps=3)
    assert report.passed, report.render()
    assert len(report.losses) == 3 and report.step_s > 0 and report.device_peak is None
    assert report.measured["nvme"] > 0 and report.measured["cxl"] > 0  # the run spilled as planned
    for tier in ("gpu", "host", "cxl", "nvme"):
        assert report.measured[tier] == pytest.approx(report.plan.peak[tier], rel=0.10)
        limit = report.budgets[tier]
        assert limit is None or max(report.warmup[tier], report.measured[tier]) <= limit
    text = report.render()
    assert text.splitlines()[-1].startswith("PASS")
    assert all(t in text for t in ("gpu", "host", "cxl", "nvme", "step", "planned", "measured"))


def test_verify_fails_on_an_under_counting_ledger(monkeypatch):
    under_count_state(monkeypatch)
    report = verify(**RUN, steps=2)
    assert not report.passed
    assert any(f.startswith("host planned") for f in report.failures), report.failures
    assert report.render().splitlines()[-1].startswith("FAIL: host planned")


def test_verify_fails_when_the_warm_up_batch_is_one_the_plan_does_not_cover():
    """The plan is for the data's worst step, which may be the warm-up's: a first batch the plan
    does not cover (twice the planned tokens) fails the verdict, though the steady steps after it
    are as planned (the report passed before)."""
    def batch(seq):
        ids = torch.randint(0, 512, (2, seq))
        return {"input_ids": ids, "labels": ids.clone()}

    torch.manual_seed(0)
    run = {**RUN, "gpu_mem": "8M", "seq_len": 64}
    steady = verify(**run, steps=3, batches=iter([batch(64) for _ in range(3)]), padded=False)
    assert steady.passed, steady.render()
    report = verify(**run, steps=3, batches=iter([batch(128), batch(64), batch(64)]), padded=False)
    assert any("warm-up peak" in f and "a batch the plan does not cover" in f for f in report.failures), \
        report.render()
    assert not any("vs measured" in f for f in report.failures)  # (the steady steps are as planned)


def test_verify_user_errors():
    with pytest.raises(TierwiseError, match="at least 2 steps"):
        verify(**RUN, steps=1)
    with pytest.raises(InfeasibleBudget, match="too small"):
        verify(**{**RUN, "gpu_mem": "64K"})


def test_cli_plan_verify_exit_codes(monkeypatch):
    runner = CliRunner()
    ok = runner.invoke(app, CLI)
    assert ok.exit_code == 0, (ok.output, ok.exception)
    assert "PASS" in ok.output and "measured" in ok.output
    bad_steps = runner.invoke(app, CLI + ["--verify-steps", "1"])
    assert bad_steps.exit_code == 2 and "at least 2 steps" in bad_steps.stderr
    under_count_state(monkeypatch)
    failed = runner.invoke(app, CLI + ["--verify-steps", "2"])
    assert failed.exit_code == 1, (failed.output, failed.exception)
    assert "FAIL:" in failed.output and "host planned" in failed.output


def test_cli_plan_without_recompute_needs_more_gpu_and_verifies():
    """--no-recompute: every layer's activations stay saved; plan says so, refuses the budget
    that suffices with recompute, and --verify passes at a budget that holds them."""
    runner = CliRunner()
    base = ["plan", "--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--chunk-size", "16K",
            "--cpu-mem", "64M"]
    on = runner.invoke(app, base + ["--gpu-mem", "1M", "--recompute"])  # minimum about 0.55 MiB with recompute
    assert on.exit_code == 0 and "recompute on" in on.output, on.output
    # auto: 1200K holds 1 of the 4 layers' activations beside the others' recompute, and a run agrees
    share = runner.invoke(app, base + ["--gpu-mem", "1200K", "--verify"])
    assert share.exit_code == 0 and "PASS" in share.output, (share.output, share.exception)
    assert "recompute the first 3 of 4 layers" in share.output
    off = runner.invoke(app, base + ["--gpu-mem", "1200K", "--no-recompute"])  # about 2 MiB without
    assert off.exit_code == 2 and "too small" in off.stderr, (off.output, off.stderr)
    ok = runner.invoke(app, base + ["--gpu-mem", "2M", "--no-recompute", "--verify"])
    assert ok.exit_code == 0 and "PASS" in ok.output and "recompute off" in ok.output, (ok.output, ok.exception)


def lora_run(tmp_path, *, base: str, rank: int, nvme: bool) -> dict:
    """A LoRA verify run at a tight budget: the base streams from host (or, with `nvme`, mostly
    from NVMe behind a host budget of a few chunks)."""
    import peft

    cfg = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear")
    run = dict(RUN, lora=cfg, base_dtype=base, double_quant=base == "nf4", gpu_mem="900K", steps=3)
    return run | (dict(cpu_mem="256K", nvme_path=str(tmp_path / "swap")) if nvme else {})


@pytest.mark.parametrize("base, rank, nvme", [("nf4", 16, False), ("bf16", 8, True)])
def test_verify_lora_passes_and_counts_the_base_traffic(tmp_path, base, rank, nvme):
    report = verify(**lora_run(tmp_path, base=base, rank=rank, nvme=nvme))
    assert report.passed, report.render()
    tier = "nvme" if nvme else "host"
    assert report.plan.lora_rank == rank and report.plan.base_dtype == base
    assert report.base_read[tier] > 0 and report.base_written == 0
    assert report.base_read[tier] == pytest.approx(report.plan.base_read[tier], rel=0.10)
    if nvme:
        assert report.measured["nvme"] > 0 and report.plan.bytes["nvme"]["base"] > 0
    text = report.render()
    assert f"base read {tier}" in text and "base written" in text and text.splitlines()[-1].startswith("PASS")


def test_verify_lora_catches_a_mispriced_plan(tmp_path, monkeypatch):
    """The planner's LoRA pricing off (its frozen chunks' stored bytes, or the base reads per
    step, halved): verify reports the mismatch."""
    from tierwise.offload.plan import planner

    real_bytes, real_traffic = planner.frozen_chunk_bytes, planner._base_traffic
    monkeypatch.setattr(planner, "frozen_chunk_bytes", lambda *a, **k: real_bytes(*a, **k) // 2)
    report = verify(**lora_run(tmp_path, base="nf4", rank=16, nvme=False))
    assert not report.passed and any(f.startswith("host planned") for f in report.failures), report.failures
    monkeypatch.setattr(planner, "frozen_chunk_bytes", real_bytes)

    def half_reads(*a, **k):
        out = real_traffic(*a, **k)
        return out | {"base_read": {t: b // 2 for t, b in out["base_read"].items()}}

    monkeypatch.setattr(planner, "_base_traffic", half_reads)
    report = verify(**lora_run(tmp_path, base="bf16", rank=8, nvme=True))
    assert report.failures and all(f.startswith("base read from") for f in report.failures), report.failures
    assert any(f.startswith("base read from nvme planned") for f in report.failures)
    assert report.render().splitlines()[-1].startswith("FAIL: base read from")


def test_cli_plan_verify_qlora(tmp_path):
    """`finetune plan --qlora --verify` on a tiny Llama checkpoint: the run is built as training
    builds it (PEFT's adapters, an NF4 base) and passes."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from tinyhf import make_tiny_llama_dir

    model = make_tiny_llama_dir(tmp_path / "tiny", layers=4)
    args = ["plan", "--model", str(model), "--qlora", "--batch-size", "2", "--seq-len", "32",
            "--chunk-size", "16K", "--gpu-mem", "1M", "--cpu-mem", "64M", "--verify", "--verify-steps"]
    r = CliRunner().invoke(app, args + ["3"])
    assert r.exit_code == 0, (r.output, r.exception)
    assert "base read host" in r.output and "PASS" in r.output, r.output
    # the base reads are compared in the steady state: from the third step (the second starts empty)
    r = CliRunner().invoke(app, args + ["2"])
    assert r.exit_code == 2 and "needs at least 3 steps" in r.output, r.output


def test_verify_lora_on_qwen2_with_dropout(tmp_path):
    """A non-Llama family (Qwen2: biased q/k/v, their adapters over base_layer.bias too) with LoRA
    dropout, base on NVMe: planned peaks and base reads equal to the measured ones within 10%."""
    import dataclasses

    import peft

    qwen = dataclasses.replace(TINY, name="tiny-qwen2", family="qwen2")
    cfg = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules="q_proj,k_proj,v_proj,down_proj".split(","))
    report = verify(**lora_run(tmp_path, base="bf16", rank=8, nvme=True) | {"model": qwen, "lora": cfg})
    assert report.passed, report.render()
    assert report.plan.bytes["nvme"]["base"] > 0 and report.base_read["nvme"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine without CUDA's pricing")
def test_verify_without_cuda_prices_the_step_with_a_simulated_profile_given(tmp_path):
    """A profile `finetune profile` measured on a machine without a GPU (simulated) is the one the
    plan's step time comes from; a GPU's profile is not this device's: then cpu-sim's."""
    import dataclasses

    from tierwise.profiles import load_hardware_profile

    sim = load_hardware_profile("cpu-sim")
    slow = dataclasses.replace(sim, name="measured-here", host=dataclasses.replace(sim.host, step_calibration=7.0))
    base = verify(**RUN, hardware=sim, steps=2)
    mine = verify(**RUN, hardware=slow, steps=2)
    assert mine.plan.phases["forward"] == pytest.approx(7 * base.plan.phases["forward"] / (sim.host.step_calibration or 1))
    gpu = verify(**{**RUN, "gpu_mem": "8M"}, hardware="rtx4090", steps=2)
    assert gpu.plan.hardware == "cpu-sim" and mine.plan.hardware == slow.name


def test_verify_lora_base_reads_in_the_steady_state_as_planned():
    """From the third step a step begins with the frozen chunks the one before kept over its end
    (the first ones its schedule holds): the planner counts them fetched once less per step, so
    its base reads are the measured ones to the byte, with one micro-batch or several; where the
    cache holds the whole base
    (`finetune plan --qlora --gpu-mem 4M`, the built-in tiny model), nothing is read at all."""
    import peft

    cfg = peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
    for accum in (1, 3):  # (the engine schedules a step's micro-batches as one trace)
        report = verify(**dict(RUN, lora=cfg, base_dtype="nf4", double_quant=True, gpu_mem="950K", steps=4,
                               grad_accum=accum))
        assert report.passed, report.render()
        assert report.plan.bytes["host"]["base"] > 0 and report.base_read["host"] == report.plan.base_read["host"] > 0
    r = CliRunner().invoke(app, ["plan", "--qlora", "--gpu-mem", "4M", "--verify"])
    assert r.exit_code == 0 and "PASS" in r.output, r.output
    r = CliRunner().invoke(app, ["plan", "--qlora", "--gpu-mem", "4M"])
    assert "read none (the device's cache holds it from step to step)" in r.output, r.output


def test_verify_a_model_of_one_chunk():
    """A model smaller than one chunk (the default 64M: what a user tries first) sends each
    parameter's gradient alone (a chunk across many blocks does not gather): the plan booked
    the whole chunk's gradient at the head's backward, 31% above the measured peak."""
    import dataclasses

    model = dataclasses.replace(TINY, hidden_size=256, intermediate_size=768, num_hidden_layers=4, vocab_size=768)
    report = verify(model=model, gpu_mem="64M", cpu_mem="1G", batch_size=4, seq_len=64, chunk_bytes="64M",
                    checkpointing=False, steps=2)
    assert report.passed, report.render()
    assert report.plan.peak["gpu"] == report.measured["gpu"]


def test_a_model_whose_chunks_take_less_than_the_streaming_window_fits_whole():
    """A LoRA run over a small model in 64M chunks: every chunk on the device takes less than
    streaming them would (a window of two chunks); the planner and the engine both placed the
    whole model at a budget the streaming minimum refused (plan fitted, --verify refused)."""
    import dataclasses

    import peft

    model = dataclasses.replace(TINY, hidden_size=256, intermediate_size=768, num_hidden_layers=4, vocab_size=768)
    run = dict(model=model, cpu_mem="1G", batch_size=2, seq_len=32, chunk_bytes="64M",
               lora=peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    report = verify(**run, gpu_mem="20M", steps=3)
    assert report.passed, report.render()
    assert report.plan.peak["gpu"] == report.measured["gpu"] and report.base_read == {}
    with pytest.raises(InfeasibleBudget, match=r"needs at least 17\.39 MiB .*every chunk on the device 15\.88 MiB"):
        verify(**run, gpu_mem="16M", steps=3)
    # the engine's own refusal names that minimum too (it named the streaming one, 28.45 MiB)
    import transformers

    from tierwise.offload import Budget, Engine

    engine = Engine(transformers.AutoModelForCausalLM.from_config(model.to_hf_config()),
                    budget=Budget(gpu="17M", cpu="1G", chunk="64M"), lora=run["lora"])
    x = torch.randint(0, 768, (2, 32), generator=torch.Generator().manual_seed(0))
    try:
        with pytest.raises(InfeasibleBudget, match=r"below the minimum 17\.31 MiB .*every chunk on the device 15\.88"):
            engine.step({"input_ids": x, "labels": x})
    finally:
        engine.close()
