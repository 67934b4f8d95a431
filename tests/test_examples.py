"""The README's engine example runs as shipped (`python examples/custom_module_engine.py`)."""

from __future__ import annotations

import runpy
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_custom_module_engine_example_runs_within_its_budget(capsys):
    runpy.run_path(str(EXAMPLES / "custom_module_engine.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "steps 41-60" in out and "1,055,873 parameters" in out


def test_offload_trainer_example_runs_within_its_budget(capsys):
    runpy.run_path(str(EXAMPLES / "offload_trainer.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "of a 2 MiB budget" in out
