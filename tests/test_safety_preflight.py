"""One preflight for every path: training refuses what `plan` refuses, before it
allocates; automatic budgets never exceed the machine; sizes need units; --seq-len is bounded.

On the old code `finetune --model 70b --gpu-mem 24G` started allocating host RAM (8 GiB after
17 s) while `plan` refused; the automatic host budget was the profile's 24 GiB on a 23.5 GiB
machine; `--seq-len 100000` on a 1,024-position model and a bare `--gpu-mem 24` (24 bytes) were
accepted; the plan showed "unlimited" NVMe on a disk with 72 GiB free.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import tierwise.cli.planning  # noqa: E402
from tierwise.cli import machine  # noqa: E402
from tierwise.cli.machine import physical_ram  # noqa: E402
from tierwise.cli.main import app  # noqa: E402
from tierwise.offload.core.units import format_size  # noqa: E402
from tierwise.offload.plan.planner import PROCESS_BYTES  # noqa: E402
from tests.tinyhf import error_line as _error_line  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _invoke(*args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})




def _limit_memory():  # a safety belt: the old code allocated until the OOM killer
    resource.setrlimit(resource.RLIMIT_AS, (12 << 30, 12 << 30))


def test_headline_command_refuses_within_seconds_without_allocating(tmp_path):
    t0 = time.monotonic()
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    proc = subprocess.run([sys.executable, "-m", "tierwise.cli.main", "--model", "70b", "--gpu-mem", "24G",
                           "--output", str(tmp_path / "out")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, preexec_fn=_limit_memory,
                          env={**os.environ})
    elapsed = time.monotonic() - t0
    rss_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1
    if not machine.has_cuda() and (24 << 30) + PROCESS_BYTES > machine.available_ram():
        # no GPU and less RAM than the simulated device would take (CI's 24 GiB machine)
        assert "--gpu-mem 24.00 GiB (the simulated device: host RAM)" in errors[0] and "lower --gpu-mem" in errors[0]
    else:
        assert "cannot hold the streamed chunks" in errors[0] and "--nvme-path" in errors[0]
        host = physical_ram() - PROCESS_BYTES - (0 if machine.has_cuda() else 24 << 30)
        assert f"host budget {format_size(host)}" in errors[0]  # not the profile's 24 GiB
    assert "Traceback" not in proc.stderr
    assert elapsed < 60, elapsed
    if rss_kib > before:  # the largest child so far is this one
        assert rss_kib < 1536 << 10, f"{rss_kib} KiB"
    assert not (tmp_path / "out").exists()  # refused before the output was claimed


def test_the_automatic_host_budget_is_this_machines_ram_not_the_profiles(tmp_path):
    # (a simulated device that fits beside it: the headline's 24G does not on a 24 GiB machine);
    # the RAM less the process's own and the simulated device's
    line = _error_line(_invoke("--model", "70b", "--gpu-mem", "16G", "--output", str(tmp_path / "out")))
    assert "cannot hold the streamed chunks" in line and "--nvme-path" in line
    host = physical_ram() - PROCESS_BYTES - (0 if machine.has_cuda() else 16 << 30)
    assert f"host budget {format_size(host)}" in line  # not the profile's 24 GiB
    assert not (tmp_path / "out").exists()


def test_automatic_host_budget_is_at_most_the_machines_ram():
    r = _invoke("plan", "--json")
    assert r.exit_code == 0, r.output
    ram = physical_ram()
    assert json.loads(r.stdout)["budgets"]["host"] <= ram


@pytest.mark.parametrize("command", [[], ["--dry-run"], ["plan"]], ids=["train", "dry-run", "plan"])
def test_seq_len_beyond_learned_positions_is_refused(command, tmp_path):
    """GPT-2's positions are a table of n_positions rows: a longer --seq-len cannot run."""
    from tests.tinyhf import make_tiny_family_dir

    model = make_tiny_family_dir(tmp_path / "gpt2", "gpt2")  # n_positions 64
    args = [*command, "--model", str(model), "--seq-len", "128"] + (
        [] if command == ["plan"] else ["--output", str(tmp_path / "o")])
    line = _error_line(_invoke(*args))
    assert "--seq-len 128 is longer than" in line and "(64 positions)" in line


def test_seq_len_beyond_rotary_positions_is_planned_trained_and_flagged(tmp_path):
    """The built-in model's positions are rotary (1024 trained): 2048 plans and trains, said."""
    planned = _invoke("plan", "--seq-len", "2048", "--gpu-mem", "256M")
    assert planned.exit_code == 0, planned.output
    assert "beyond the 1,024 positions builtin-tiny was trained for" in planned.stderr
    trained = _invoke("--seq-len", "2048", "--steps", "1", "--output", str(tmp_path / "o"))
    assert trained.exit_code == 0, trained.output
    assert "beyond the 1,024 positions" in trained.output + trained.stderr


@pytest.mark.parametrize("command", [[], ["plan"]], ids=["train", "plan"])
def test_a_size_without_a_unit_is_refused_with_a_hint(command, tmp_path):
    line = _error_line(_invoke(*command, "--gpu-mem", "24"))
    assert "--gpu-mem 24 has no unit: write 24G" in line
    toml = tmp_path / "run.toml"
    toml.write_text('cpu-mem = "64"\n')
    line = _error_line(_invoke(*command, "--config", str(toml)))
    assert "--cpu-mem 64 has no unit" in line


def test_nvme_need_is_checked_against_the_free_space(tmp_path, monkeypatch):
    args = ["plan", "--gpu-mem", "700K", "--cpu-mem", "1100K", "--chunk-size", "64K",
            "--seq-len", "32", "--batch-size", "2", "--nvme-path", str(tmp_path)]
    monkeypatch.setattr(tierwise.cli.planning, "free_disk", lambda path: 1 << 20)
    line = _error_line(_invoke(*args))
    assert "--nvme-path has 1.00 MiB of space: needs at least" in line
    monkeypatch.setattr(tierwise.cli.planning, "free_disk", lambda path: 72 << 30)
    r = _invoke(*args)
    assert r.exit_code == 0, r.output
    nvme_row = next(ln for ln in r.stdout.splitlines() if ln.startswith("nvme"))
    assert "72.00 GiB" in nvme_row and "unlimited" not in nvme_row
