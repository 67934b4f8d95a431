"""README's commands print what README shows: the quickstart run, the `plan`
examples and `profile --nvme-path`. Figures that depend on the machine (times, rates, the
progress bar's width) are masked on both sides; everything else must match line for line.
The 70B plan sample is checked whole in test_safety_plan.py."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.tinyhf import fast_profiler
from tierwise.cli.main import app

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
#: A time, a rate or a clock: machine-dependent.
_VARIES = re.compile(r"\d[\d.,]*(?: ?(?:ms|µs|s/step|s|tok/s))(?![\w/])|\d+:\d\d:\d\d")


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # a terminal's cursor and style codes


#: said only when the warm-up ran over twice the plan's time (a loaded machine)
_SLOW_NOTE = re.compile(r"; times of a steady step: [^)]*")


def _masked(line: str) -> str:
    line = _VARIES.sub("#", _SLOW_NOTE.sub("", _ANSI.sub("", line)))
    return " ".join(re.sub("━+", "━", line).split())


def _blocks() -> list[str]:
    """The code blocks of README.md and docs/*.md."""
    return [b for page in (README, *DOCS) for b in re.findall(r"```[a-z ]*\n(.*?)```", page.read_text(), re.S)]


def _invoke(args: list[str]):
    return CliRunner().invoke(app, args, env={"COLUMNS": "200"})


def _in_order(expected: list[str], printed: list[str]) -> None:
    """Every expected line appears among the printed ones, in order (README trims)."""
    at = 0
    for want in expected:
        for i in range(at, len(printed)):
            if re.fullmatch(want, printed[i]):
                at = i + 1
                break
        else:
            raise AssertionError(f"README line not printed: {want!r}\nprinted:\n" + "\n".join(printed))


def test_quickstart_prints_the_readme_sample(tmp_path, monkeypatch):
    install = next(b for b in _blocks() if "finetune --output" in b)
    command = re.search(r"&& (finetune --output [^\n]+)", install).group(1)
    sample = next(b for b in _blocks() if b.startswith("no --model: training the built-in tiny model"))
    monkeypatch.chdir(tmp_path)  # the run's relative --output, as in the README
    # as on a terminal (the README shows the bar; a log file gets plain lines), without colours
    r = CliRunner().invoke(app, shlex.split(command)[1:], env={"COLUMNS": "200", "TTY_COMPATIBLE": "1",
                                                               "NO_COLOR": "1"})
    assert r.exit_code == 0, r.output
    _in_order([re.escape(_masked(ln)) for ln in sample.splitlines() if ln.strip()],
              [_masked(ln) for ln in r.output.splitlines()])
    assert (tmp_path / "runs" / "quickstart" / "model" / "config.json").exists()


def _plan_samples() -> list[tuple[str, str]]:
    """($ finetune plan ... command, its printed lines) of README blocks that show a plan."""
    out = []
    for block in _blocks():
        m = re.match(r"\$ (finetune plan [^\n]*(?:\\\n[^\n]*)*)\n(.*)", block, re.S)
        if m:
            out.append((m.group(1).replace("\\\n", " "), m.group(2)))
    return out


def test_readme_has_plan_samples():
    assert len(_plan_samples()) >= 2


@pytest.mark.parametrize("command,sample", [s for s in _plan_samples() if "--model 70b" not in s[0]],
                         ids=lambda v: v[:40] if isinstance(v, str) else None)
def test_plan_samples_print_what_readme_shows(command, sample):
    r = _invoke(shlex.split(command)[1:])
    refused = any(ln.startswith("error: ") for ln in sample.splitlines())
    assert r.exit_code == (2 if refused else 0), r.output
    # "(...)" in README elides a detail of the line
    expected = [re.escape(_masked(ln)).replace(re.escape("(...)"), ".*")
                for ln in sample.splitlines() if ln.strip()]
    _in_order(expected, [_masked(ln) for ln in r.output.splitlines()])


def _three_ways(prefix: str) -> list[str]:
    block = next(b for b in _blocks() if "finetune profile --nvme-path" in b)
    return [ln.split("#")[0].strip() for ln in block.splitlines() if ln.startswith(prefix)]


def test_the_plan_for_another_machine_runs_as_written():
    (command,) = [c for c in _three_ways("finetune plan") if "--hardware" in c]
    r = _invoke(shlex.split(command)[1:])
    assert r.exit_code == 0, r.output
    assert "verdict: fits" in r.output


def test_profile_runs_as_written(tmp_path, monkeypatch):
    """`finetune profile --nvme-path DIR --output FILE` as README writes it, DIR and FILE moved
    into tmp_path (the measurements shortened: the full profile takes a minute)."""
    (command,) = _three_ways("finetune profile")
    args = shlex.split(command)[1:]
    nvme, out = Path(args[args.index("--nvme-path") + 1]), args[args.index("--output") + 1]
    args[args.index("--nvme-path") + 1] = str(tmp_path / nvme.name)
    (tmp_path / nvme.name).mkdir()
    monkeypatch.chdir(tmp_path)
    seen = fast_profiler(monkeypatch)
    r = _invoke(args)
    assert r.exit_code == 0, r.output
    assert seen and all(str(tmp_path / nvme.name) in str(p) for p in seen), seen
    assert (tmp_path / out).exists() and f"use it with --hardware {out}" in r.output
