"""What the OS counts stays within the budgets, in every phase of a run: bench/host_rss.py runs
`finetune` (load, steps, a checkpoint each step, the export) and `finetune --resume` on a Llama
whose training state on NVMe is several times --cpu-mem, sampling the process's RSS by phase.

Peak anonymous RSS must stay within --gpu-mem (the simulated device lives in host RAM) +
--cpu-mem + the process allowance (its RSS when the engine is about to be built, plus the
bench's SLACK). A checkpoint or resume that held the whole state at once would exceed it by the
state's size (about 9x --cpu-mem here)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.mark.slow
def test_peak_rss_stays_within_budgets_in_every_phase(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "host_rss.py"), "--hidden", "256", "--layers", "8",
           "--vocab", "512", "--gpu-mem", "6M", "--cpu-mem", "8M", "--chunk-size", "512K",
           "--seq-len", "64", "--workdir", str(tmp_path), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["checkpoint_bytes"] >= 4 * (8 << 20)  # the state is several times the host budget
    phases = res["phases"]
    for name in ("load", "steps", "checkpoint", "export", "resume", "checkpoint (resumed run)"):
        assert name in phases, sorted(phases)
    over = {k: round(v["ratio"], 3) for k, v in phases.items() if v["ratio"] > 1.0}
    assert not over, (over, phases)


def test_mmap_threshold_is_fixed_unless_the_user_set_it(monkeypatch):
    import platform

    from tierwise.cli.main import fix_mmap_threshold

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert fix_mmap_threshold() is False  # the user's setting wins
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    assert fix_mmap_threshold() is (platform.libc_ver()[0] == "glibc")
