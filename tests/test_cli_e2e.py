"""`finetune` end to end on the REAL engine (no stand-in): what a user must be shown to work.

A tiny Llama (hidden 64, 2 layers, vocab 384) with a sharded safetensors checkpoint, trained
at seq 32 x batch 2 under `--gpu-mem 700K` with 64 KiB chunks: less than its fp32 weights plus
gradients (~960 KiB), so chunks stream through the simulated device. Runs that must survive a
SIGKILL or a failing disk run in a subprocess; the rest in-process (CliRunner) to save startup.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
from tinyhf import make_tiny_llama_dir, mean_eval_loss, write_jsonl, error_line as _error_line  # noqa: E402

from tierwise.cli import checkpoint as ckpt  # noqa: E402
from tierwise.cli.main import app  # noqa: E402
from tierwise.cli.metrics import read_metrics  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GPU_BUDGET = 700 << 10
STREAM = ["--seq-len", "32", "--batch-size", "2", "--chunk-size", "64K", "--gpu-mem", "700K"]
STEPS = 6


def _env(**extra) -> dict:
    return {**os.environ, "COLUMNS": "120", **extra}  # PYTHONPATH: conftest binds tierwise


def _finetune(*args: str, **popen) -> subprocess.Popen:
    """`finetune ARGS` in a subprocess that imports this checkout."""
    return subprocess.Popen([sys.executable, "-m", "tierwise.cli.main", *args], cwd=popen.pop("cwd", REPO),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=popen.pop("env", _env()), **popen)


def _invoke(*args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "120"})


def _ok(result):
    assert result.exit_code == 0, (result.exit_code, result.output, result.exception)
    return result




def _train_losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """(tiny sharded HF dir, train.jsonl) shared by the module."""
    root = tmp_path_factory.mktemp("assets")
    model = make_tiny_llama_dir(root / "tiny", shard=True)
    rows = [{"text": f"The tiny model streams chunk {i % 7} through the memory tier."}
            for i in range(48)]
    return model, write_jsonl(root / "train.jsonl", rows)


def _run_args(assets, out: Path, *extra: str) -> list[str]:
    model, data = assets
    return ["--model", str(model), "--data", str(data), *STREAM, "--steps", str(STEPS),
            "--lr", "3e-3", "--checkpoint-every", "2", "--output", str(out), *extra]


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory):
    """An uninterrupted run: its output dir (the resume tests compare against its losses)."""
    out = tmp_path_factory.mktemp("ref") / "run"
    _ok(_invoke(*_run_args(assets, out)))
    return out


# -- a. a real HF checkpoint trains, streams, and exports the trained model ------------------

def test_hf_dir_trains_streams_and_exports_the_trained_model(assets, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tierwise.cli.data import eval_batches, isolates, load_blocks

    model_dir, _ = assets
    data = write_jsonl(tmp_path / "eval.jsonl", [{"text": "The tiny model streams chunk 3 "
                                                          "through the memory tier."}] * 4)
    out = tmp_path / "run"
    result = _ok(_invoke(*_run_args(assets, out, "--eval-data", str(data))))
    assert "warm-up step" in result.output and "measured" in result.output

    records = read_metrics(out / "metrics.jsonl")
    losses = _train_losses(out)
    assert len(losses) == STEPS
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.1, losses
    # Streaming for real: the gpu peak stays in a budget below weights + gradients.
    param_bytes = sum(p.numel() * 4 for p in AutoModelForCausalLM.from_pretrained(
        model_dir).parameters())
    assert GPU_BUDGET < 2 * param_bytes
    assert all(0 < r["peak_bytes"]["gpu"] <= GPU_BUDGET for r in records if r["kind"] == "train")
    engine_eval = [r["loss"] for r in records if r["kind"] == "eval"][-1]
    # the end-of-run eval (--eval-every 0) is shown, not only written to metrics.jsonl
    assert f"step {STEPS}: eval loss {engine_eval:.4f}" in result.output

    # output/model is the trained model: plain transformers reproduces the engine's eval loss.
    exported = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    batches = eval_batches(load_blocks(str(data), tokenizer, seq_len=32, isolate=isolates(exported.config)),
                           batch_size=2)
    assert mean_eval_loss(exported, batches) == pytest.approx(engine_eval, rel=1e-5, abs=1e-6)
    initial = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert mean_eval_loss(initial, batches) > engine_eval + 0.1


# -- b. SIGKILL, then --resume: the same losses, bit for bit ---------------------------------

def _wait_for(predicate, proc: subprocess.Popen, *, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"finetune exited early ({proc.returncode}): "
                                 f"{proc.communicate()[1][-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("timed out waiting for the run")
        time.sleep(0.02)


def _kill9(proc: subprocess.Popen) -> None:
    assert proc.poll() is None, "the run finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL


def test_sigkill_mid_run_then_resume_is_bit_exact(assets, reference, tmp_path):
    out = tmp_path / "run"
    proc = _finetune(*_run_args(assets, out))
    _wait_for(lambda: (out / ckpt.LATEST).exists(), proc)  # ckpt-000002 is complete ...
    _kill9(proc)  # ... and later steps are running
    assert not (out / "model").exists()
    killed_at = int(ckpt.latest_checkpoint(out).name.split("-")[1])
    assert killed_at < STEPS

    _ok(_invoke(*_run_args(assets, out, "--resume")))
    assert _train_losses(out) == _train_losses(reference)  # fp32: exact equality
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]
    assert steps == list(range(1, STEPS + 1))
    assert (out / "memory_timeline.png").exists()  # a step of the resumed run's drawn (it drew none)


def test_sigkill_mid_checkpoint_write_keeps_the_previous_one(assets, reference, tmp_path):
    out = tmp_path / "run"
    proc = _finetune(*_run_args(assets, out), env=_env(**{ckpt.FAULT_ENV: "4:sleep"}))
    # The hook sleeps after ckpt-000004.tmp is fully written, before its rename.
    _wait_for(lambda: (out / "ckpt-000004.tmp" / "trainer.json").exists(), proc)
    _kill9(proc)
    assert (out / ckpt.LATEST).read_text().strip() == "ckpt-000002"
    assert not (out / "ckpt-000004").exists()
    engine_state, trainer = ckpt.load_checkpoint(ckpt.latest_checkpoint(out))
    assert trainer["step"] == 2 and engine_state["steps"] == 2

    _ok(_invoke(*_run_args(assets, out, "--resume")))
    assert _train_losses(out) == _train_losses(reference)
    assert not (out / "ckpt-000004.tmp").exists()


# -- c. every user error: one line, exit 2, no traceback --------------------------------------

def test_error_unknown_profile():
    line = _error_line(_invoke("--model", "no-such-model", "--steps", "1"))
    assert "unknown model profile 'no-such-model'" in line and "tiny" in line


def test_error_missing_data_file(tmp_path):
    line = _error_line(_invoke("--data", str(tmp_path / "nope.jsonl"), "--output",
                               str(tmp_path / "o")))
    assert line == f"error: data file not found: {tmp_path / 'nope.jsonl'}"


def test_error_malformed_jsonl_names_the_line(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "fine"}, {"text": "fine"}, '{"text": '])
    line = _error_line(_invoke("--data", str(data), "--output", str(tmp_path / "o")))
    assert f"{data}:3: bad JSON" in line
    data = write_jsonl(tmp_path / "e.jsonl", [{"text": "fine"}, {"txt": "typo"}])
    assert f"{data}:2: unknown schema" in _error_line(
        _invoke("--data", str(data), "--output", str(tmp_path / "o")))


@pytest.mark.parametrize("flag,value", [("--gpu-mem", "24X"), ("--cpu-mem", "lots"),
                                        ("--chunk-size", "0")], ids=["gpu_mem", "cpu_mem", "chunk_size"])
def test_error_bad_size(flag, value, tmp_path):
    line = _error_line(_invoke(flag, value, "--output", str(tmp_path)))
    assert flag in line and value in line


def test_error_infeasible_budget_names_the_minimum(tmp_path):
    line = _error_line(_invoke(*STREAM[:-2], "--gpu-mem", "1K", "--steps", "1",
                               "--output", str(tmp_path / "o")))
    # the preflight (the planner, as `finetune plan`) refuses before the engine is built
    assert "--gpu-mem 1.00 KiB is too small: needs at least" in line


def test_error_budget_too_small_for_activations(tmp_path):
    """Chunks fit but the activations do not: refused before the first step, naming the minimum."""
    line = _error_line(_invoke(*STREAM[:-2], "--gpu-mem", "300K", "--steps", "1", "--no-offload-activations",
                               "--output", str(tmp_path / "o")))
    assert "--gpu-mem 300.00 KiB is too small: needs at least" in line
    # the end of forward: the blocks' inputs, the S x S mask its blocks of several packed rows
    # take at this length (perfmodel.SEGMENTS_FROM), per-row rotary tables and position ids
    # (packed rows kept apart), what the loss saves and the 192 KiB its logits' gradients take
    # in backward (8 x 64 tokens x 384 words: perfmodel.loss_workspace)
    assert "activations 379.75 KiB at batch 2 x 32 (S x S mask))" in line
    # without the flag the run would offload the blocks' inputs: its minimum is that plan's, one
    # block's input (2 x 32 tokens x 64 x 4 B = 16 KiB) fewer on the device
    line = _error_line(_invoke(*STREAM[:-2], "--gpu-mem", "300K", "--steps", "1", "--output", str(tmp_path / "p")))
    assert "activations 363.75 KiB at batch 2 x 32 (S x S mask)) with each block's input offloaded" in line


@pytest.mark.parametrize("name", ["adamw8bit", "galore", "apollo-mini", "mezo"])
def test_every_optimizer_trains_through_the_cli(tmp_path, name):
    _ok(_invoke("--optimizer", name, "--steps", "2", "--output", str(tmp_path / "o")))
    assert (tmp_path / "o" / "model" / "config.json").exists()


def test_error_unknown_optimizer(tmp_path):
    result = _invoke("--optimizer", "lion", "--steps", "1", "--output", str(tmp_path / "o"))
    assert result.exit_code == 2 and "lion" in result.output and "adamw8bit" in result.output


def test_error_unknown_hardware_profile(tmp_path):
    line = _error_line(_invoke("--hardware", "no-such-gpu", "--steps", "1",
                               "--output", str(tmp_path / "o")))
    assert "no-such-gpu" in line


def test_error_non_empty_output(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    line = _error_line(_invoke("--steps", "1", "--output", str(tmp_path)))
    assert "is not empty" in line and "--resume" in line and "--overwrite" in line
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_error_disk_full_in_process_keeps_the_checkpoint(assets, reference, tmp_path,
                                                         monkeypatch):
    """ENOSPC while the 2nd checkpoint's engine file is being streamed out."""
    real, calls = ckpt.tensorfile.write, []

    def full_disk(path, tensors, **kw):
        calls.append(path)
        if "ckpt-000004" in str(path):
            raise OSError(28, os.strerror(28), str(path))
        return real(path, tensors, **kw)

    monkeypatch.setattr(ckpt.tensorfile, "write", full_disk)
    out = tmp_path / "run"
    line = _error_line(_invoke(*_run_args(assets, out)))
    assert line.startswith("error: disk full (No space left on device) while writing ")
    assert "ckpt-000002 is intact" in line and "--resume" in line
    assert ckpt.latest_checkpoint(out).name == "ckpt-000002"
    assert not list(out.glob("*.tmp"))  # the partial save is removed at once
    ckpt.load_checkpoint(out / "ckpt-000002")

    monkeypatch.setattr(ckpt.tensorfile, "write", real)
    _ok(_invoke(*_run_args(assets, out, "--resume")))
    assert _train_losses(out) == _train_losses(reference)


def test_error_disk_full_subprocess_real_write_failure(assets, tmp_path):
    """A real failing write (file size limit -> EFBIG) inside a subprocess: no traceback."""
    out = tmp_path / "run"
    proc = _finetune(*_run_args(assets, out), env=_env(**{ckpt.FAULT_ENV: "4:fsize"}))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err
    assert "Traceback" not in err
    assert err.startswith("error: disk full (File too large) while writing "), err
    assert err.count("\n") == 1 and "ckpt-000002 is intact" in err
    assert ckpt.latest_checkpoint(out).name == "ckpt-000002"
    _, trainer = ckpt.load_checkpoint(out / "ckpt-000002")
    assert trainer["step"] == 2


# -- d. the Quickstart, e. a profile name without weights -------------------------------------

def test_quickstart_demo_under_a_minute(tmp_path):
    exe = shutil.which("finetune")
    cmd = [exe] if exe else [sys.executable, "-m", "tierwise.cli.main"]
    out = tmp_path / "demo"
    out.mkdir()
    (out / ".tierwise-run").write_text("")  # an earlier run's directory:
    (out / "ckpt-000099").mkdir()  # an earlier run's checkpoint: --overwrite replaces it
    t0 = time.monotonic()
    proc = subprocess.run([*cmd, "--output", str(out), "--overwrite"], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr
    assert elapsed < 60, elapsed
    assert proc.stderr == "", proc.stderr
    for text in ("built-in tiny model", "warm-up step", "measured", "loss",
                 f"done: model exported to {out / 'model'}"):
        assert text in proc.stdout, proc.stdout
    losses = _train_losses(out)
    assert losses[-1] < losses[0] - 1.0, losses  # the demo visibly learns
    assert not (out / "ckpt-000099").exists()
    for name in ("model/config.json", "model/model.safetensors", "loss.png", "latest"):
        assert (out / name).exists(), name
    from tierwise.cli.rundir import MARKER, RUN_ENTRIES  # what --overwrite may delete: all a run writes

    assert all(RUN_ENTRIES.fullmatch(p.name) for p in out.iterdir() if p.name != MARKER), os.listdir(out)


def test_profile_name_without_weights_trains_random_init(tmp_path):
    out = tmp_path / "run"
    result = _ok(_invoke("--model", "tiny", "--steps", "3", "--output", str(out)))
    assert "RANDOMLY INITIALISED" in result.output
    assert len(_train_losses(out)) == 3
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["num_hidden_layers"] == 4  # the `tiny` profile's shapes


def test_offload_activations_flag_trains(tmp_path):
    _ok(_invoke("--offload-activations", "--steps", "2", "--output", str(tmp_path / "o")))
    assert (tmp_path / "o" / "model" / "config.json").exists()


def test_recompute_is_automatic_and_can_be_forced(tmp_path, monkeypatch):
    """Unset, --recompute follows the gpu budget (planner): off where every layer's activations
    fit, on where they do not; either flag forces it. The engine gets the decision."""
    from tierwise.cli import train as train_mod
    from tierwise.cli.config import TrainConfig
    from tierwise.cli.planning import resolve_recompute

    base = dict(model="tiny", batch_size=2, seq_len=32, chunk_size="16K", cpu_mem="64M")
    assert resolve_recompute(TrainConfig(**base, gpu_mem="8M")).recompute is False
    assert resolve_recompute(TrainConfig(**base, gpu_mem="1M")).recompute is True
    assert resolve_recompute(TrainConfig(**base, gpu_mem="8M", recompute=True)).recompute is True

    seen = []
    real = train_mod.make_engine
    monkeypatch.setattr(train_mod, "make_engine",
                        lambda model, cfg, **kw: seen.append(cfg.recompute) or real(model, cfg, **kw))
    roomy = _ok(_invoke("--steps", "1", "--output", str(tmp_path / "a")))
    assert "no recompute" in roomy.output
    _ok(_invoke("--steps", "1", "--recompute", "--output", str(tmp_path / "b")))
    tight = _ok(_invoke(*STREAM, "--steps", "1", "--output", str(tmp_path / "c")))  # 700K: ~582K/984K needed
    assert "no recompute" not in tight.output
    assert seen == [False, True, True]


def test_offload_activations_implies_recompute(tmp_path):
    """Activation offload moves the inputs of recomputed layers: auto keeps recompute on for it,
    and asking for both it and --no-recompute is a one-line error."""
    from tierwise.cli.config import TrainConfig
    from tierwise.cli.planning import resolve_recompute

    cfg = TrainConfig(model="tiny", batch_size=2, seq_len=32, gpu_mem="8M", offload_activations=True)
    assert resolve_recompute(cfg).recompute is True
    line = _error_line(_invoke("--offload-activations", "--no-recompute", "--steps", "1",
                               "--output", str(tmp_path / "o")))
    assert "--offload-activations" in line and "--no-recompute" in line


@pytest.mark.parametrize("args,expected", [
    (["--steps", "abc"], "error: Invalid value for '--steps'"),
    (["--bogus"], "error: No such option: --bogus"),
    (["--grad-reduce", "bad"], "error: Invalid value for '--grad-reduce'"),
], ids=["bad-int", "unknown-flag", "bad-choice"])
def test_usage_errors_are_one_line_exit_2(args, expected):
    """A flag value click itself refuses (a type, a choice, an unknown flag) is one `error:` line
    and exit 2, as every other bad input (click printed its usage and a boxed message before);
    `-h` still prints the help and exits 0."""
    proc = _finetune(*args)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, (out, err)
    assert err.count("\n") == 1 and err.startswith(expected), err
    assert out == ""
    proc = _finetune("-h")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "--gpu-mem" in out and err == "", err
