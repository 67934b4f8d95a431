"""`finetune --report-to tensorboard`: the run's train losses, lr, tokens/s and per-tier peaks in
TensorBoard's event files, the numbers metrics.jsonl holds; a reporter whose package is missing
is one line, exit 2, before anything is written."""

from __future__ import annotations

import importlib.util

import pytest
from typer.testing import CliRunner

from tierwise.cli.main import app
from tierwise.cli.metrics import read_metrics


def test_tensorboard_shows_what_metrics_jsonl_holds(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["--steps", "4", "--report-to", "tensorboard", "--output", str(out)])
    assert r.exit_code == 0, r.output
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    train = [m for m in read_metrics(out / "metrics.jsonl") if m["kind"] == "train"]
    assert [e.step for e in events.Scalars("train/loss")] == [m["step"] for m in train]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([m["loss"] for m in train], rel=1e-6)
    assert [e.value for e in events.Scalars("train/lr")] == pytest.approx([m["lr"] for m in train], rel=1e-6)
    peak = events.Scalars("memory/gpu_peak_gib")[-1].value
    assert peak == pytest.approx(train[-1]["peak_bytes"]["gpu"] / 2**30, rel=1e-6)
    assert "train/tokens_per_s" in events.Tags()["scalars"]


def test_a_missing_reporter_package_is_one_line(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    r = CliRunner().invoke(app, ["--steps", "1", "--report-to", "wandb", "--output", str(tmp_path / "run")])
    assert r.exit_code == 2
    assert "--report-to wandb needs the wandb package: pip install wandb" in r.output + r.stderr
    assert not (tmp_path / "run").exists()
