"""Offloading activations turns on by itself where the plan needs it: a gpu budget that holds
the run only with each block's input in host RAM trains (and says so) without
--offload-activations; one that holds it either way keeps them on the device;
--no-offload-activations refuses instead; one too small either way is refused naming the
offloaded plan's minimum (the smaller: that budget runs)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
from tinyhf import error_line, make_tiny_llama_dir  # noqa: E402

from tierwise.cli.config import TrainConfig  # noqa: E402
from tierwise.cli.main import app  # noqa: E402
from tierwise.cli.planning import make_plan, resolve_offload, resolve_recompute  # noqa: E402

SHAPE = ["--seq-len", "256", "--batch-size", "2", "--chunk-size", "16K"]


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """Eight layers: their inputs outweigh one block's internals, so offloading them matters."""
    return make_tiny_llama_dir(tmp_path_factory.mktemp("deep") / "m", layers=8, hidden=64)


@pytest.fixture(scope="module")
def budgets(deep):
    """(a gpu budget that holds the run with offloading only, the smallest without). The first is
    10% over the plan's minimum with offloading: the device's offloaded inputs are planned
    within 10% (tests/test_plan_offload.py), not to the byte."""
    base = TrainConfig(model=str(deep), seq_len=256, batch_size=2, chunk_size="16K", recompute=True)
    on = make_plan(dataclasses.replace(base, offload_activations=True)).gpu_minimum * 11 // 10
    off = make_plan(dataclasses.replace(base, offload_activations=False)).gpu_minimum
    assert on < off
    return on, off


def test_resolved_by_the_plan(deep, budgets):
    on, off = budgets

    def resolved(gpu: int, **kw) -> TrainConfig:
        cfg = TrainConfig(model=str(deep), seq_len=256, batch_size=2, chunk_size="16K", gpu_mem=f"{gpu}B", **kw)
        return resolve_offload(resolve_recompute(cfg))

    assert resolved(on).offload_activations is True and resolved(on).recompute is True
    assert resolved(off).offload_activations is False  # it fits without: the faster way
    assert resolved(on, offload_activations=False).offload_activations is False  # forced off
    # fits neither way: refused with the smaller minimum, the offloaded plan's (that budget runs)
    assert resolved(on // 2).offload_activations is True
    assert resolved(on // 2, recompute=False).recompute is False  # offloading needs recompute: not forced


def test_finetune_offloads_when_it_must_and_says_so(deep, budgets, tmp_path):
    on, off = budgets
    args = ["--model", str(deep), *SHAPE, "--gpu-mem", f"{on}B", "--steps", "2"]
    r = CliRunner().invoke(app, [*args, "--output", str(tmp_path / "run")])
    assert r.exit_code == 0, (r.output, r.exception)
    assert "input offloaded between forward and backward, to host RAM" in r.output
    r = CliRunner().invoke(app, [*args, "--no-offload-activations", "--output", str(tmp_path / "refused")])
    assert r.exit_code == 2
    assert "is too small: needs at least" in error_line(r)
    # too small either way: the minimum named is the offloaded plan's, and it says so
    low = ["--model", str(deep), *SHAPE, "--gpu-mem", f"{on // 2}B", "--steps", "2"]
    line = error_line(CliRunner().invoke(app, [*low, "--output", str(tmp_path / "low")], env={"COLUMNS": "400"}))
    minimum = int(line.split("needs at least ")[1].split("(")[1].split(" B")[0])
    assert minimum <= on < off and "with each block's input offloaded" in line, line
