"""The profiler: quick measurements, a TOML the hardware loader accepts, planning with it."""

from __future__ import annotations

from tierwise.offload.plan.planner import make_plan
from tierwise.offload.tools.profiler import measure
from tierwise.profiles import load_hardware_profile


def test_quick_profile_writes_a_loadable_hardware_profile(tmp_path):
    out = tmp_path / "me.toml"
    lines = []
    text = measure(hardware="me", output=str(out), nvme_path=str(tmp_path), quick=True, progress=lines.append)
    assert out.read_text() == text and len(lines) == 11 and lines[-1].startswith("wrote")
    assert lines[-2].startswith("[calibration] proxy models measured / modelled: matmuls fp32")
    hw = load_hardware_profile(out)
    assert hw.name == "me" and hw.simulated
    assert hw.pcie.h2d_pinned_gbps > 0 and hw.nvme.read_gbps > 0 and hw.host.adamw_params_per_s > 0
    assert hw.gpu.fp32_tflops > 0 and hw.host.op_overhead_us > 0
    assert 0.05 < hw.host.step_calibration < 50  # the fit accepts (0.05, 50): profiler.calibrations
    assert 0.05 < hw.host.step_calibration_bf16 < 50  # the wider proxy in bf16
    assert 0.05 < hw.host.dispatch_calibration < 50  # per-op dispatch, fitted with a narrow proxy
    assert 0.05 < hw.host.dispatch_calibration_bf16 < 50  # both proxies again in bf16
    plan = make_plan(model="100m", hardware=out, gpu_mem="1G", cpu_mem="8G", optimizer="adamw",
                     precision="fp32", batch_size=1, seq_len=64)
    assert plan.hardware == "me" and plan.step_s > 0
