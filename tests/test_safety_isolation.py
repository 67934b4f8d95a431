"""Runs that share a machine: private swap directories, locks, --overwrite, signals.

Each test reproduces what the issue saw on the old code: swap files written straight into
--nvme-path under fixed names (a user's file there overwritten then deleted, a planted symlink
followed), two runs on one --output both exiting 0 with interleaved metrics, --overwrite
emptying any directory, SIGTERM leaving no checkpoint and the swap files behind.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
from tinyhf import StandInEngine, tiny_run_assets, error_line as _error_line  # noqa: E402

import tierwise.cli.train  # noqa: E402
from tierwise.cli import checkpoint as ckpt  # noqa: E402
from tierwise.cli.main import app  # noqa: E402
from tierwise.cli.rundir import MARKER  # noqa: E402
from tierwise.offload.runtime import runlock  # noqa: E402
from tierwise.offload.runtime.nvme import PRIVATE_PREFIX, NvmeStore  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# seq 32 x batch 2, 64 KiB chunks: the host budget holds only the minimum, the rest is on NVMe
SWAPPING = ["--seq-len", "32", "--batch-size", "2", "--chunk-size", "64K", "--gpu-mem", "700K",
            "--cpu-mem", "1100K"]
KINDS = ("master", "grad", "state")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_run_assets(tmp_path_factory.mktemp("assets"))


def _env() -> dict:
    return {**os.environ, "COLUMNS": "120"}




def _plant(nvme: Path, outside: Path) -> dict[Path, bytes]:
    """A user's files under the old fixed swap names, and a symlink to a file outside."""
    nvme.mkdir(parents=True, exist_ok=True)
    planted = {}
    for i in range(8):
        for kind in KINDS:
            p = nvme / f"c{i}.{kind}.swp"
            planted[p] = f"user data {i} {kind}\n".encode()
            p.write_bytes(planted[p])
    victim = outside / "victim.txt"
    victim.write_bytes(b"precious\n")
    (nvme / "c0.master.swp").unlink()
    (nvme / "c0.master.swp").symlink_to(victim)
    planted.pop(nvme / "c0.master.swp")
    planted[victim] = b"precious\n"
    return planted


def _untouched(nvme: Path, planted: dict[Path, bytes]) -> None:
    for p, data in planted.items():
        assert p.read_bytes() == data, p
    assert (nvme / "c0.master.swp").is_symlink()
    assert not [p for p in nvme.iterdir() if p.name.startswith(PRIVATE_PREFIX)]


# -- the swap store -----------------------------------------------------------------------------

def test_swap_lives_in_a_private_locked_directory(tmp_path):
    planted = _plant(tmp_path / "nvme", tmp_path)
    with NvmeStore(tmp_path / "nvme") as s:
        private = Path(s.directory)
        assert private.parent == tmp_path / "nvme" and private.name.startswith(PRIVATE_PREFIX)
        assert stat.S_IMODE(private.stat().st_mode) == 0o700
        for i in range(8):
            for kind in KINDS:
                s.write(f"c{i}.{kind}", torch.full((1000,), float(i)))
        s.zeros("c1.state", 5000)
        assert runlock.is_stale(private / ".lock") is False  # held while the store is open
        back = torch.empty(1000)
        s.read("c3.grad", back)
        assert torch.equal(back, torch.full((1000,), 3.0))
    _untouched(tmp_path / "nvme", planted)


def test_two_stores_on_one_nvme_path_do_not_share_files(tmp_path):
    with NvmeStore(tmp_path) as a, NvmeStore(tmp_path) as b:
        a.write("c0.master", torch.zeros(3000))
        b.write("c0.master", torch.ones(3000))
        got = torch.empty(3000)
        a.read("c0.master", got)
        assert torch.equal(got, torch.zeros(3000))
        b.read("c0.master", got)
        assert torch.equal(got, torch.ones(3000))
    assert os.listdir(tmp_path) == []


def test_stale_swap_dir_of_a_dead_run_is_removed_with_a_notice(tmp_path):
    dead = tmp_path / f"{PRIVATE_PREFIX}999999-abc123"
    dead.mkdir(mode=0o700)
    (dead / ".lock").write_text("999999\n")  # nobody holds it: the run is gone
    (dead / "c0.master.swp").write_bytes(b"\0" * 8192)
    live = tmp_path / f"{PRIVATE_PREFIX}{os.getpid()}-live"
    live.mkdir(mode=0o700)
    fd = runlock.acquire(live / ".lock", what="live")
    (live / "c0.master.swp").write_bytes(b"x")
    mine = tmp_path / "tierwise-swap-notes"  # not a store's name: never touched
    mine.mkdir()
    try:
        with NvmeStore(tmp_path) as s:
            assert len(s.notices) == 1 and str(dead) in s.notices[0] and "8.00 KiB" in s.notices[0]
        assert not dead.exists() and (live / "c0.master.swp").exists() and mine.exists()
    finally:
        runlock.release(fd)


# -- the CLI ----------------------------------------------------------------------------------

def test_run_leaves_a_decoy_and_a_symlink_in_nvme_path_alone(assets, tmp_path):
    model, data = assets
    nvme = tmp_path / "nvme"
    planted = _plant(nvme, tmp_path)
    stale = nvme / f"{PRIVATE_PREFIX}999999-old"
    stale.mkdir()
    (stale / ".lock").write_text("999999\n")
    r = CliRunner().invoke(app, ["--model", str(model), "--data", str(data), *SWAPPING, "--steps", "2",
                                 "--nvme-path", str(nvme), "--output", str(tmp_path / "run")],
                           env={"COLUMNS": "200"})
    assert r.exit_code == 0, (r.output, r.exception)
    assert "removed stale swap directory" in r.output and not stale.exists()
    assert ckpt.latest_checkpoint(tmp_path / "run") is not None
    _untouched(nvme, planted)


def test_a_second_run_on_the_same_output_is_refused_naming_the_pid(tmp_path, monkeypatch):
    monkeypatch.setattr(tierwise.cli.train, "engine_class", lambda: StandInEngine)
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from tierwise.offload.runtime import runlock; "
         "runlock.acquire(sys.argv[1], what='x'); print('READY', flush=True); time.sleep(60)",
         str(out / MARKER)], env=_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "READY"
        for extra in ([], ["--resume"], ["--overwrite"]):
            line = _error_line(CliRunner().invoke(app, ["--seq-len", "32", "--batch-size", "2",
                                                        "--steps", "1", "--output", str(out), *extra]))
            assert f"in use by another finetune run (pid {holder.pid})" in line, line
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert os.listdir(out) == [MARKER]  # nothing was written next to the holder's run


def test_overwrite_only_empties_a_directory_a_run_made(tmp_path, monkeypatch):
    monkeypatch.setattr(tierwise.cli.train, "engine_class", lambda: StandInEngine)
    fast = ["--seq-len", "32", "--batch-size", "2", "--steps", "1"]
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("years of work")
    line = _error_line(CliRunner().invoke(app, [*fast, "--output", str(home), "--overwrite"]))
    assert "not made by a finetune run" in line
    assert (home / "thesis.tex").read_text() == "years of work"
    run = tmp_path / "run"
    r = CliRunner().invoke(app, [*fast, "--output", str(run)])
    assert r.exit_code == 0, (r.output, r.exception)
    assert (run / MARKER).exists()
    made = sorted(p.name for p in run.iterdir())
    (run / "NOTES.md").write_text("what I tried")  # the user's own, in the run's directory
    (run / "mydata").mkdir()
    line = _error_line(CliRunner().invoke(app, [*fast, "--output", str(run), "--overwrite"]))
    assert "holds what no run writes (NOTES.md, mydata)" in line, line
    assert (run / "NOTES.md").read_text() == "what I tried" and (run / "mydata").is_dir()
    (run / "NOTES.md").unlink()
    (run / "mydata").rmdir()
    r = CliRunner().invoke(app, [*fast, "--output", str(run), "--overwrite"])  # what a run made: replaced
    assert r.exit_code == 0, (r.output, r.exception)
    assert sorted(p.name for p in run.iterdir()) == made


def test_overwrite_refuses_to_delete_the_runs_own_inputs(tmp_path, monkeypatch):
    """A previous run's export (or a data file) inside --output, given as this run's input:
    --overwrite deleted it, then the run died reading the model it had just deleted."""
    monkeypatch.setattr(tierwise.cli.train, "engine_class", lambda: StandInEngine)
    model, data = tiny_run_assets(tmp_path)
    fast = ["--seq-len", "32", "--batch-size", "2", "--steps", "1"]
    run = tmp_path / "run"
    r = CliRunner().invoke(app, [*fast, "--model", str(model), "--data", str(data), "--output", str(run)])
    assert r.exit_code == 0, (r.output, r.exception)
    inside = run / "notes" / "train.jsonl"
    inside.parent.mkdir()
    inside.write_bytes(data.read_bytes())
    (run / "model").rename(run / "prev")
    for flag, path in (("--model", run / "prev"), ("--data", inside), ("--eval-data", inside)):
        args = {"--model": str(model), "--data": str(data), flag: str(path)}
        line = _error_line(CliRunner().invoke(app, [*fast, *sum(args.items(), ()), "--output", str(run),
                                                    "--overwrite"]))
        assert f"--overwrite would delete {flag}" in line, line
        assert (run / "prev" / "config.json").exists() and inside.exists()


@pytest.mark.parametrize("where", ["/", "~"])
def test_nvme_path_root_or_home_is_refused(where, tmp_path):
    line = _error_line(CliRunner().invoke(app, ["--nvme-path", where, "--output", str(tmp_path / "o")]))
    assert "--nvme-path" in line and ("home" in line or "is /" in line)


class _SignalAtStep2(StandInEngine):
    signum = signal.SIGTERM

    def step(self, batch, grad_accum=1):
        loss = super().step(batch, grad_accum)
        if self.steps == 2:
            os.kill(os.getpid(), self.signum)  # as a scheduler / a closed terminal would
        return loss


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["TERM", "HUP"])
def test_sigterm_and_sighup_checkpoint_like_ctrl_c(signum, tmp_path, monkeypatch):
    engine = type("Engine", (_SignalAtStep2,), {"signum": signum})
    monkeypatch.setattr(tierwise.cli.train, "engine_class", lambda: engine)
    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["--seq-len", "32", "--batch-size", "2", "--steps", "5",
                                 "--output", str(out)])
    assert r.exit_code == 128 + signum, (r.exit_code, r.output, r.exception)
    assert (out / "latest").read_text().strip() == "ckpt-000002"
    assert signal.Signals(signum).name in r.output


def test_sigterm_mid_run_checkpoints_and_removes_the_swap(assets, tmp_path):
    """A real run swapping to NVMe, SIGTERMed from outside: checkpoint, swap gone, decoys intact."""
    model, data = assets
    nvme, out = tmp_path / "nvme", tmp_path / "run"
    planted = _plant(nvme, tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "tierwise.cli.main", "--model", str(model), "--data", str(data),
                             *SWAPPING, "--steps", "100000", "--nvme-path", str(nvme),
                             "--output", str(out)], cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().count("\n") >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        assert [p for p in nvme.iterdir() if p.name.startswith(PRIVATE_PREFIX)]  # it does swap
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, (stdout, stderr)
    assert "interrupted (SIGTERM)" in stdout and "Traceback" not in stderr
    assert ckpt.latest_checkpoint(out) is not None
    _untouched(nvme, planted)


def test_a_refused_engine_leaves_no_threads_swap_files_or_hooks(tmp_path):
    """A library caller whose Engine is refused after its tiers exist (a device budget below the
    minimum, priced with the activations given) gets the error and nothing else: no copy
    threads left running, no private swap directory under --nvme-path, the model's forward and
    hooks as they were (before: two worker threads and the swap directory stayed)."""
    import threading

    from tierwise.offload import Activations, Budget, Engine
    from tierwise.offload.core.errors import InfeasibleBudget
    from models import tiny_llama

    model = tiny_llama()
    forwards = {name: m.forward for name, m in model.named_modules()}
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(InfeasibleBudget):
        Engine(model, budget=Budget(gpu="64K", cpu="64K", nvme=str(tmp_path), chunk="64K"),
               activations=Activations(expected=1 << 20))
    deadline = time.monotonic() + 10
    while {t.name for t in threading.enumerate() if t.name.startswith(("tierwise", "nvme-"))} - before:
        assert time.monotonic() < deadline, "copy threads still running"
        time.sleep(0.05)
    assert [p.name for p in tmp_path.iterdir()] == []
    assert {name: m.forward for name, m in model.named_modules()} == forwards
    assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) == hooks


def test_a_second_signal_inside_a_finalizer_aborts_without_a_traceback(capsys):
    """The second Ctrl-C aborts; raised while a finalizer runs (a tensor freed mid-step), Python
    printed it with a traceback and dropped it, and the run went on."""
    class Freed:
        def __del__(self):
            raise KeyboardInterrupt  # what the handler raises when the signal lands here

    before = sys.unraisablehook
    with tierwise.cli.train._StopFlag() as stop:
        os.kill(os.getpid(), signal.SIGINT)  # the first: finish the step, checkpoint
        deadline = time.monotonic() + 5
        while not stop.set and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(KeyboardInterrupt):
            Freed()
            while time.monotonic() < deadline:
                time.sleep(0.01)
    assert "Exception ignored" not in capsys.readouterr().err
    assert sys.unraisablehook is before


def test_overwrite_leaves_the_nvme_path_inside_output_to_the_store(tmp_path):
    from tierwise.cli import rundir
    from tierwise.cli.config import ConfigError

    out = tmp_path / "run"
    (out / "swap" / "tierwise-swap-1-ab").mkdir(parents=True)  # --nvme-path run/swap
    (out / "ckpt-000001").mkdir()
    (out / MARKER).write_text("")
    with pytest.raises(ConfigError, match=r"holds what no run writes \(swap\)"):
        rundir.claim(str(out), resume=False, overwrite=True)
    rundir.claim(str(out), resume=False, overwrite=True, swap=str(out / "swap")).release()
    assert (out / "swap" / "tierwise-swap-1-ab").is_dir() and not (out / "ckpt-000001").exists()
    (out / "swap" / "tierwise-swap-1-ab").rmdir()
    (out / "swap").rmdir()
    (out / "tierwise-swap-7-cd").mkdir()  # --nvme-path run: a killed run's swap directory
    rundir.claim(str(out), resume=False, overwrite=True, swap=str(out)).release()
    assert (out / "tierwise-swap-7-cd").is_dir()
    deep = tmp_path / "a" / "b" / "c"  # a refused run removes every directory it made
    with pytest.raises(ConfigError, match="no checkpoint"):
        rundir.claim(str(deep), resume=True, overwrite=False)
    assert not (tmp_path / "a").exists()


def test_an_output_left_by_a_run_that_failed_before_its_first_step_is_reused(tmp_path):
    """Its marker and an empty metrics.jsonl: nothing to resume or keep, so a retry with the same
    --output starts (was: "not empty: pass --resume", and --resume then "no checkpoint")."""
    from tierwise.cli import rundir
    from tierwise.offload.core.errors import TierwiseError

    out = tmp_path / "run"
    out.mkdir()
    (out / MARKER).write_text("")
    (out / "metrics.jsonl").write_text("")
    (out / "tensorboard").mkdir()  # (--report-to tensorboard: its writer starts before the first step)
    rundir.claim(str(out), resume=False, overwrite=False).release()
    (out / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')  # a run that trained: kept
    with pytest.raises(TierwiseError, match="not empty"):
        rundir.claim(str(out), resume=False, overwrite=False)
