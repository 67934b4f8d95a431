"""Planner and performance model: hand-computed placements, minimum budgets, monotonicity."""

from __future__ import annotations

import json
import time

import pytest

from tierwise.offload.core.errors import InfeasibleBudget, TierwiseError
from tierwise.offload.plan.perfmodel import activation_bytes, activation_parts, model_flops
from tierwise.offload.update.table import optimizer_spec
from tierwise.offload.plan.planner import make_plan
from tierwise.profiles import load_model_profile

GiB, MiB = 1 << 30, 1 << 20
N7B = 6_738_415_616


def plan7b(**kw):
    args = dict(model="7b", hardware="rtx4090", gpu_mem="24G", cpu_mem="64G", optimizer="adamw8bit",
                precision="bf16", batch_size=1, seq_len=512)
    return make_plan(**{**args, **kw})


def test_7b_adamw_24g_gpu_128g_host_by_hand():
    plan = plan7b(optimizer="adamw", cpu_mem="128G")
    # every 7B matrix is larger than a 64 MiB chunk, so each parameter is a chunk of its own
    emb = 32000 * 4096  # 131,072,000: the largest parameter (embedding and lm_head)
    act = activation_bytes(model=load_model_profile("7b"), batch_size=1, seq_len=512, precision="bf16")
    minimum = 2 * 64 * 4 + 2 * emb * 2 + emb * 2 + act  # rotary inv_freq x2, window (2 chunks), grad reserve
    assert plan.reserve["gpu"]["activations"] == act
    # a CUDA profile: the engine leaves 1/16 of the budget free for the allocator (offload.engine.workspace)
    assert plan.workspace_margin == 24 * GiB // 16
    # the smallest budget B holding the minimum beside its own margin, B / 16
    b = plan.gpu_minimum
    assert b - b // 16 >= minimum > (b - 1) - (b - 1) // 16
    # a gpu-home parameter costs bf16 2 + grad 4 + master 4 + AdamW state 8 = 18 B
    free = 24 * GiB - minimum - 24 * GiB // 16
    assert free / 18 - emb <= plan.gpu_update_params <= free / 18   # within one chunk
    assert plan.gpu_update_params + plan.cpu_update_params == N7B
    assert plan.peak["gpu"] <= 24 * GiB
    # host-home: every kind of the streamed chunks stays in DRAM
    host = plan.bytes["host"]
    cpu = plan.cpu_update_params
    assert host["compute"] == 2 * cpu and host["grad"] == host["master"] == 4 * cpu and host["state"] == 8 * cpu
    # and on CUDA the buffer gradients land in first: the largest copy (the embedding's, 250 MiB
    # in bf16) crosses in slices of 64 MiB
    assert plan.reserve["host"]["grad staging"] == 64 << 20 < emb * 2
    assert plan.peak["host"] == sum(host.values()) + (64 << 20) < 128 * GiB
    assert not any(plan.bytes["nvme"].values()) and not any(plan.bytes["cxl"].values())


def test_a_cuda_plan_leaves_the_engines_workspace_margin_free():
    """On CUDA the engine places chunks around 1/16 of the gpu budget kept free for the allocator
    (offload.engine.workspace): a budget that would hold all of 7B gpu-home beside the minimum
    streams part of it, as the engine would; the simulated device keeps no margin."""
    act = activation_bytes(model=load_model_profile("7b"), batch_size=1, seq_len=512, precision="bf16")
    emb = 32000 * 4096
    minimum = 2 * 64 * 4 + 2 * emb * 2 + emb * 2 + act  # as test_7b_adamw_24g_gpu_128g_host_by_hand
    gpu = minimum + 18 * N7B  # every parameter gpu-home (18 B each) with no margin
    plan = plan7b(hardware="h200", optimizer="adamw", gpu_mem=gpu, cpu_mem="256G")
    assert plan.workspace_margin == gpu // 16
    free = gpu - minimum - gpu // 16
    assert free / 18 - emb <= plan.gpu_update_params <= free / 18 < N7B  # within one chunk
    assert plan.peak["gpu"] + plan.workspace_margin <= gpu
    assert "gpu workspace margin" in plan.render_table()
    sim = make_plan(model="tiny", hardware="cpu-sim", gpu_mem=None, cpu_mem=None, optimizer="adamw",
                    precision="fp32", batch_size=1, seq_len=16)
    assert sim.workspace_margin == 0 and "workspace margin" not in sim.render_table()


def test_a_run_on_this_machine_s_gpu_without_hardware_is_priced_with_the_engine_s_margin(monkeypatch):
    """`finetune` (its pre-flight) and `plan` without --hardware price this machine's device (the
    simulated one, or on CUDA the profile its name matches); on CUDA the engine leaves its workspace margin (and a staging buffer for
    an encoded base): the plan prices that device, not the simulated one, else the pre-flight
    passes budgets the engine then refuses, and --verify compares a placement the engine does
    not make. A named profile decides for itself."""
    import dataclasses

    from tierwise.cli import machine
    from tierwise.cli.config import TrainConfig
    from tierwise.cli.planning import make_plan as cli_plan
    from tierwise.offload.plan.needs import workspace_margin

    cfg = TrainConfig(model="tiny", gpu_mem="64M", cpu_mem="1G", seq_len=16, batch_size=2, chunk_size="16K")
    monkeypatch.setattr(machine, "has_cuda", lambda: True)
    monkeypatch.setattr(machine, "cuda_device", lambda: ("NVIDIA H100 80GB HBM3", 80 << 30, 1))
    on_gpu = cli_plan(cfg)
    assert on_gpu.hardware == "h100" and on_gpu.workspace_margin == workspace_margin(64 << 20) > 0
    monkeypatch.setattr(machine, "has_cuda", lambda: False)
    assert cli_plan(cfg).workspace_margin == 0  # the simulated device: no allocator
    named = cli_plan(dataclasses.replace(cfg, hardware="rtx4090"))
    assert named.workspace_margin == workspace_margin(64 << 20)  # the profile's device, wherever planned
    qlora = dict(lora_rank=8, base_dtype="nf4", double_quant=True)
    sim, cuda = (make_plan(model="tiny", hardware="cpu-sim", gpu_mem="64M", cpu_mem="1G", optimizer="adamw",
                           precision="bf16", batch_size=2, seq_len=16, chunk_bytes=16 << 10, cuda=c, **qlora)
                 for c in (None, True))
    assert cuda.reserve["gpu"]["buffers"] > sim.reserve["gpu"]["buffers"]  # CUDA's staging buffer


def test_7b_less_host_spills_masters_to_nvme_with_bounce_buffers():
    plan = plan7b(optimizer="adamw", cpu_mem="32G", nvme_path="/tmp/swap")
    cpu = plan.cpu_update_params
    host, nvme = plan.bytes["host"], plan.bytes["nvme"]
    # assign_homes: grads stay in DRAM, then states, then masters; the rest goes to disk
    assert host["grad"] == 4 * cpu and nvme["grad"] == 0
    assert host["master"] + nvme["master"] == 4 * cpu and nvme["master"] > 0
    assert plan.reserve["host"]["nvme bounce"] > 0
    assert plan.peak["host"] <= 32 * GiB
    homes = {(h.master, h.update) for h in plan.chunk_homes}
    assert ("nvme", "cpu") in homes and ("gpu", "gpu") in homes


def test_7b_without_nvme_names_minimum_host():
    with pytest.raises(InfeasibleBudget) as info:
        plan7b(cpu_mem="32G")
    assert "--cpu-mem" in str(info.value) and "--nvme-path" in str(info.value)
    need = info.value.minimum["host"]
    assert plan7b(cpu_mem=need).peak["host"] <= need
    with pytest.raises(InfeasibleBudget):
        plan7b(cpu_mem=need - 1)


def test_gpu_minimum_is_exact():
    with pytest.raises(InfeasibleBudget) as info:
        plan7b(gpu_mem="1G", cpu_mem="1T", batch_size=4, seq_len=1024)
    need = info.value.minimum["gpu"]
    assert "--gpu-mem 1.00 GiB is too small: needs at least" in str(info.value)
    assert 1 * GiB < need < 4 * GiB
    plan = plan7b(gpu_mem=need, cpu_mem="1T", batch_size=4, seq_len=1024)
    assert plan.gpu_update_params == 0 and plan.peak["gpu"] <= need and plan.gpu_minimum == need
    with pytest.raises(InfeasibleBudget):
        plan7b(gpu_mem=need - MiB, cpu_mem="1T", batch_size=4, seq_len=1024)


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit", "galore"])
def test_more_budget_is_never_slower(optimizer):
    gpus, hosts = [6, 10, 16, 24, 40], [24, 40, 64, 96, 160]
    grid = {}
    for g in gpus:
        for h in hosts:
            try:
                grid[g, h] = plan7b(optimizer=optimizer, gpu_mem=g * GiB, cpu_mem=h * GiB, nvme_path="/x",
                                    hardware="rtx4090-256g-nvme").step_s
            except InfeasibleBudget:
                grid[g, h] = float("inf")
    for (g, h), t in grid.items():
        for g2, h2 in ((g, h) for g in gpus for h in hosts):
            if g2 >= g and h2 >= h:
                assert grid[g2, h2] <= t * (1 + 1e-9), (g, h, g2, h2)
    assert any(t < float("inf") for t in grid.values())


def test_405b_plans_in_seconds():
    # a guard against a planner gone quadratic, not a speed figure (about 0.6 s quiet on 2 cores;
    # 1.04 s once under CI's load, so the bound has room)
    start = time.perf_counter()
    plan = make_plan(model="405b", hardware="h200", gpu_mem=None, cpu_mem="2T", nvme_path="/x",
                     optimizer="adamw", precision="bf16", batch_size=1, seq_len=2048)
    assert time.perf_counter() - start < 3.0
    assert plan.gpu_update_params + plan.cpu_update_params == plan.num_params
    assert sum(plan.bytes["nvme"].values()) > 0


def test_fp32_streams_the_master_and_mezo_has_no_grads():
    fp32 = plan7b(precision="fp32", cpu_mem="1T", optimizer="adamw")
    assert all(fp32.bytes[t]["compute"] == 0 for t in fp32.bytes)  # the master is the compute copy
    assert fp32.bytes["host"]["master"] == 4 * fp32.cpu_update_params
    assert all(h.compute == h.master for h in fp32.chunk_homes)
    mezo = plan7b(optimizer="mezo", cpu_mem="1T")
    assert all(mezo.bytes[t]["grad"] == 0 and mezo.bytes[t]["state"] == 0 for t in mezo.bytes)
    assert set(mezo.phases) == {"forward", "update"}
    # no saved activations: the loss's transients (both halves' bf16 logits, one half's fp32 copy and
    # log_softmax; bench/loss_workspace.py measures them)
    assert mezo.reserve["gpu"]["activations"] == 512 * 32000 * (2 * 2 + 4 + 4)


def test_chunk_homes_add_up_to_bytes_and_json_round_trips():
    plan = plan7b(cpu_mem="40G", nvme_path="/x", optimizer="galore")
    sizes = {"compute": 2, "grad": 4, "master": 4}  # per element of a chunk (padding included)
    for tier in ("gpu", "host", "nvme"):
        for kind, b in sizes.items():
            homed = sum(h.params for h in plan.chunk_homes if getattr(h, kind) == tier)
            assert abs(plan.bytes[tier][kind] - b * homed) <= b * 16 * len(plan.chunk_homes), (tier, kind)
    data = json.loads(plan.to_json())
    assert data["bytes"]["host"]["state"] == plan.bytes["host"]["state"] and len(data["chunk_homes"]) == plan.num_chunks
    text = plan.render_table()
    assert "bottleneck:" in text and "tokens/s" in text and "nvme" in text


def test_perfmodel_pieces():
    m = load_model_profile("7b")
    assert model_flops(model=m, batch_size=1, seq_len=1) == pytest.approx(
        2 * (N7B - 32000 * 4096 - 65 * 4096) + 4 * 4096 * 32)  # matmuls + attention scores (S=1)
    assert activation_bytes(model=m, batch_size=2, seq_len=8, precision="fp32") > \
        activation_bytes(model=m, batch_size=2, seq_len=8, precision="bf16")
    parts = activation_parts(model=m, batch_size=2, seq_len=8, precision="bf16")
    assert activation_bytes(model=m, batch_size=2, seq_len=8, precision="bf16") == \
        parts["fixed"] + parts["inputs"] + max(parts["head"], parts["block"])
    assert parts["inputs"] == 32 * 2 * 16 * 4096  # one bf16 block input per layer
    assert optimizer_spec("AdamW").dense_state_per_param == 8
    with pytest.raises(TierwiseError, match="unknown optimizer 'lion'"):
        optimizer_spec("lion")
    with pytest.raises(TierwiseError, match="unknown precision 'fp8'"):
        plan7b(precision="fp8")
    with pytest.raises(TierwiseError, match="no \\[cxl\\] table"):
        plan7b(cxl_mem="64G")


def test_accepts_a_transformers_meta_model_and_default_hardware():
    import torch
    import transformers

    profile = load_model_profile("100m")
    with torch.device("meta"):
        module = transformers.LlamaForCausalLM(profile.to_hf_config())
    a = make_plan(model=module, hardware=None, gpu_mem="1G", cpu_mem="4G", optimizer="adamw",
                  precision="fp32", batch_size=4, seq_len=128)
    b = make_plan(model="100m", hardware="cpu-sim", gpu_mem="1G", cpu_mem="4G", optimizer="adamw",
                  precision="fp32", batch_size=4, seq_len=128)
    assert a.num_params == b.num_params == 101_924_480 and a.bytes == b.bytes and a.step_s == b.step_s


def test_step_calibration_scales_the_simulated_compute_phases():
    import dataclasses

    from tierwise.offload.plan.planner import make_plan
    from tierwise.profiles import load_hardware_profile

    hw = load_hardware_profile("cpu-sim")
    doubled = dataclasses.replace(hw, host=dataclasses.replace(hw.host, step_calibration=2.0))
    kw = dict(model="tiny", gpu_mem=None, cpu_mem=None, optimizer="adamw", precision="fp32",
              batch_size=2, seq_len=32)
    base, cal = make_plan(hardware=hw, **kw), make_plan(hardware=doubled, **kw)
    assert cal.phases["forward"] == pytest.approx(2 * base.phases["forward"])
    assert cal.phases["backward"] == pytest.approx(2 * base.phases["backward"])
    assert cal.phases["update"] == pytest.approx(base.phases["update"])
    # a bf16 run takes the bf16 proxy's factor where the profile has one, else the fp32 one's
    both = dataclasses.replace(hw, host=dataclasses.replace(hw.host, step_calibration=2.0, step_calibration_bf16=3.0))
    bf = dict(kw, precision="bf16")
    base, fp32_only, own = (make_plan(hardware=h, **bf) for h in (hw, doubled, both))
    assert fp32_only.phases["forward"] == pytest.approx(2 * base.phases["forward"])
    assert own.phases["forward"] == pytest.approx(3 * base.phases["forward"])
    assert make_plan(hardware=both, **kw).phases["forward"] == pytest.approx(cal.phases["forward"])
    # dispatch_calibration: its own factor on the per-op dispatch, step_calibration on the rest
    host = dataclasses.replace(hw.host, op_overhead_us=10.0, step_calibration=2.0)
    ops_free = dataclasses.replace(hw, host=dataclasses.replace(host, op_overhead_us=None))
    one = dataclasses.replace(hw, host=dataclasses.replace(host, step_calibration=1.0))
    split = dataclasses.replace(hw, host=dataclasses.replace(host, dispatch_calibration=5.0))
    rest, dispatch = (make_plan(hardware=ops_free, **kw).phases["forward"] / 2,
                      make_plan(hardware=one, **kw).phases["forward"])
    dispatch -= rest
    assert dispatch > 0 and make_plan(hardware=split, **kw).phases["forward"] == pytest.approx(2 * rest + 5 * dispatch)
    # bf16 takes dispatch_calibration_bf16 where the profile has one; fp32 never does
    split16 = dataclasses.replace(hw, host=dataclasses.replace(host, dispatch_calibration=5.0,
                                                               dispatch_calibration_bf16=7.0))
    assert make_plan(hardware=split16, **kw).phases["forward"] == pytest.approx(2 * rest + 5 * dispatch)
    rest16 = make_plan(hardware=ops_free, **bf).phases["forward"] / 2
    dispatch16 = make_plan(hardware=one, **bf).phases["forward"] - rest16
    assert make_plan(hardware=split16, **bf).phases["forward"] == pytest.approx(2 * rest16 + 7 * dispatch16)
    assert make_plan(hardware=split, **bf).phases["forward"] == pytest.approx(2 * rest16 + 5 * dispatch16)
    # the bottleneck is the busiest resource once calibrated: with dispatch calibrated to almost
    # nothing, that of the plan whose ops are free
    assert make_plan(hardware=one, **kw).bottleneck == "dispatch"
    nearly_free = dataclasses.replace(hw, host=dataclasses.replace(host, dispatch_calibration=1e-6))
    assert make_plan(hardware=nearly_free, **kw).bottleneck == make_plan(hardware=ops_free, **kw).bottleneck != "dispatch"


def test_a_gpu_step_is_bound_by_the_launching_thread_when_ops_cost_more_than_the_device():
    """On a GPU the host thread that launches the kernels is a resource of each phase: 100 us per
    op makes a 1B model's small step last the forward's and the recomputing backward's dispatches
    (ops_per_forward, hand-counted per layer); without the figure it is priced as before."""
    import dataclasses

    from tierwise.offload.plan.perfmodel import ops_per_forward
    from tierwise.profiles import load_hardware_profile

    hw = load_hardware_profile("h200")
    kw = dict(model="1b", gpu_mem="6G", cpu_mem="64G", optimizer="adamw", precision="bf16",
              batch_size=1, seq_len=128)
    unmeasured = make_plan(hardware=dataclasses.replace(hw, host=dataclasses.replace(hw.host, op_overhead_us=None)), **kw)
    slow = make_plan(hardware=dataclasses.replace(hw, host=dataclasses.replace(hw.host, op_overhead_us=100.0)), **kw)
    ops = ops_per_forward(load_model_profile("1b"))
    assert ops == 48 * load_model_profile("1b").num_hidden_layers + 24
    slower = make_plan(hardware=dataclasses.replace(hw, host=dataclasses.replace(hw.host, op_overhead_us=200.0)), **kw)
    # a launch-bound phase lasts its dispatches plus one chunk's startup (the same in both plans)
    assert slower.phases["forward"] - slow.phases["forward"] == pytest.approx(ops * 100e-6)
    # backward: the recompute's forward and twice the forward's dispatches for its own ops
    assert slower.phases["backward"] - slow.phases["backward"] == pytest.approx(3 * ops * 100e-6)
    assert slow.bottleneck == "host launch"
    assert unmeasured.step_s < slow.step_s and unmeasured.bottleneck != "host launch"


@pytest.mark.parametrize("case,measured", [
    (dict(gpu_mem="6G", seq_len=1024), 0.361),
    (dict(gpu_mem="12G", seq_len=4096), 0.449),
    (dict(gpu_mem="6G", seq_len=1024, optimizer="adamw8bit"), 0.294),
    (dict(gpu_mem="3G", seq_len=1024, lora_rank=16, base_dtype="nf4", double_quant=True), 0.262),
])
def test_the_h200_profile_prices_the_steps_measured_on_an_h200(case, measured):
    """The engine's steps measured on a lent H200 (bench/gpu_check.sh, 2026-12-04: a 0.85B Llama,
    batch 4, bf16, chunks of 64 MiB, recompute) against the h200 profile's plan: within 35% (the
    launching thread, the update sharing its cores and the compute calibration priced; without
    them the plans were 0.12-0.48x the measured steps)."""
    from transformers import LlamaConfig

    from tierwise.profiles import ModelProfile

    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                      num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=8192,
                      tie_word_embeddings=False)
    plan = make_plan(**{**dict(model=ModelProfile.from_hf_config(cfg), hardware="h200", cpu_mem=None,
                               optimizer="adamw", precision="bf16", batch_size=4, chunk_bytes=64 << 20,
                               checkpointing=True, cuda=True), **case})
    assert 0.65 <= plan.step_s / measured <= 1.35


def test_the_step_s_last_write_backs_overlap_the_next_forward_s_idle_disk(tmp_path):
    """Simulated device, masters and state on NVMe (the e2e setup): the update's last write-backs
    are left in flight when the step returns (update_all defer=True), so the disk-bound backward
    is priced less what the forward leaves the disk idle, up to one chunk's write-backs."""
    import dataclasses

    from tierwise.offload.plan import perfmodel
    from tierwise.profiles import load_hardware_profile

    hw = load_hardware_profile("cpu-sim")
    slow = dataclasses.replace(hw, nvme=dataclasses.replace(hw.nvme, read_gbps=4.0, write_gbps=0.5))
    kw = dict(model="100m", gpu_mem="300M", cpu_mem="1000M", nvme_path=str(tmp_path), optimizer="adamw",
              precision="fp32", batch_size=2, seq_len=64, chunk_bytes=64 << 20)
    seen = []
    real = perfmodel._simulated_nvme
    perfmodel._simulated_nvme = lambda *a, **k: seen.append(real(*a, **k)) or seen[-1]
    try:
        plan = make_plan(hardware=slow, **kw)
    finally:
        perfmodel._simulated_nvme = real
    disk = seen[-1]
    idle = plan.phases["forward"] - disk["forward"]
    assert plan.bottleneck == "nvme" and 0 < idle
    assert 0 < disk["deferred"] < disk["backward"] / 4  # one chunk's write-backs of six
    assert plan.phases["backward"] == pytest.approx(disk["backward"] - min(idle, disk["deferred"]))
    assert plan.phases["backward"] < disk["backward"] * 0.99


def test_adamw8bit_prices_its_fp32_embeddings_at_the_fp32_rate():
    """An 8-bit optimizer keeps an embedding's moments in fp32 (table.fp32_embeddings): the
    planner prices its update at the fp32 AdamW rate, the rest at the 8-bit one."""
    import dataclasses

    from tierwise.profiles import load_hardware_profile

    hw = load_hardware_profile("cpu-sim")
    fast8 = dataclasses.replace(hw, host=dataclasses.replace(hw.host, adamw8bit_params_per_s=1e30))
    slow32 = dataclasses.replace(fast8, host=dataclasses.replace(fast8.host, adamw_params_per_s=hw.host.adamw_params_per_s / 2))
    kw = dict(model="tiny", gpu_mem=None, cpu_mem=None, optimizer="adamw8bit", precision="fp32", batch_size=2, seq_len=32)
    tiny = load_model_profile("tiny")
    emb = sum(s.numel for s in tiny.param_specs() if s.embedding)
    assert 0 < emb < tiny.num_params
    extra = make_plan(hardware=slow32, **kw).phases["update"] - make_plan(hardware=fast8, **kw).phases["update"]
    assert extra == pytest.approx(emb / hw.host.adamw_params_per_s, rel=1e-6)
