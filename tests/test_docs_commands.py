"""Every code block in README.md and docs/ marked `bash runnable` runs as written, in a fresh
directory, on the built-in tiny model: `finetune ...` lines through the CLI, `python examples/...`
as a script, each exiting 0. The docs cannot drift."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tierwise.cli.main import app

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def runnable() -> list[tuple[str, list[str]]]:
    out = []
    for page in PAGES:
        for block in re.findall(r"```bash runnable\n(.*?)```", page.read_text(), re.S):
            lines = [ln.split("  #")[0].strip() for ln in block.replace("\\\n", " ").splitlines()]
            out.append((page.name, [ln for ln in lines if ln and not ln.startswith("#")]))
    return out


def test_the_docs_have_runnable_blocks():
    assert {name for name, _ in runnable()} >= {"cli.md", "lora.md", "planning.md", "trainer.md"}


@pytest.mark.parametrize("page, lines", runnable(), ids=[f"{n}-{i}" for i, (n, _) in enumerate(runnable())])
def test_runnable_block_runs(page, lines, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for line in lines:
        argv = shlex.split(line)
        if argv[0] == "python":
            r = subprocess.run([sys.executable, str(ROOT / argv[1]), *argv[2:]], capture_output=True, text=True,
                               timeout=600)
            assert r.returncode == 0, (page, line, r.stderr[-2000:])
            continue
        assert argv[0] == "finetune", (page, line)
        r = CliRunner().invoke(app, argv[1:], env={"COLUMNS": "200"})
        assert r.exit_code == 0, (page, line, r.output[-2000:], r.stderr[-2000:] if r.stderr_bytes else "")
