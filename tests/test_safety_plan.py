"""A plan that tells the user what to do, and a README that shows what the program prints.
The old plan had no verdict, an unexplained `reserve`, "1 tokens/s" for 1.45, no
grad-accum in its header, no word that its times are modelled; a refusal did not say what
would fit; `finetune profile --nvme-path` (documented) did not exist and its progress lines
had no units; the memory-timeline plot had no "backward" phase; the README sample had drifted.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.tinyhf import fast_profiler
from tierwise.cli.main import app
from tierwise.offload.plan.planner import _rate

README = Path(__file__).resolve().parents[1] / "docs" / "planning.md"  # (its plan samples)


def _invoke(*args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


def test_plan_has_a_verdict_explains_reserve_and_says_it_is_modelled():
    r = _invoke("plan", "--grad-accum", "2")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert "batch 4 x 128 (S x S mask), grad-accum 2," in lines[0]  # (packed rows this short: the mask)
    assert any(ln.startswith("reserve (bytes besides the chunks): gpu ") and "activations" in ln for ln in lines)
    assert any("modelled from hardware profile 'cpu-sim', not measured" in ln for ln in lines)
    assert lines[-1].startswith("verdict: fits: every tier's peak is within its budget")
    step = next(ln for ln in lines if ln.startswith("step "))
    assert re.search(r", [\d,]+(\.\d+)? tokens/s,", step), step


@pytest.mark.parametrize("rate,text", [(14933.2, "14,933"), (41.62, "41.6"), (1.45, "1.45"), (0.3, "0.30")])
def test_tokens_per_second_keep_their_precision(rate, text):
    assert _rate(rate) == text


def test_a_refused_plan_lists_changes_that_fit_each_checked():
    r = _invoke("plan", "--gpu-mem", "5M", "--no-recompute")
    assert r.exit_code == 2
    out = r.stdout.splitlines()
    assert out[0].startswith("verdict: does not fit: --gpu-mem 5.00 MiB is too small")
    i = out.index("would fit (each checked by the planner; fastest step first):")
    suggestions = [ln.split("   ")[0].strip() for ln in out[i + 1:] if ln.startswith("  ")]
    assert "--recompute" in suggestions, out
    kept = "" if "--recompute" in suggestions[0] else " --no-recompute"  # the change replaces what it names
    assert out[-1] == f"fastest: finetune plan --gpu-mem 5M{kept} {suggestions[0]}"
    errors = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: --gpu-mem 5.00 MiB is too small")
    for flags in suggestions:  # what the advice says fits does fit
        args = ["plan", "--gpu-mem", "5M", *shlex.split(flags.replace("DIR", "."))]
        if "--recompute" not in flags:
            args.append("--no-recompute")
        assert _invoke(*args).exit_code == 0, flags


def test_training_refusal_points_at_plan(tmp_path):
    r = _invoke("--gpu-mem", "4M", "--no-recompute", "--output", str(tmp_path / "out"))
    assert r.exit_code == 2 and "`finetune plan` with the same model, data, batch and budget options lists changes that fit" in r.stderr
    assert not (tmp_path / "out").exists()


def test_plan_takes_offload_activations():
    r = _invoke("plan", "--offload-activations")
    assert r.exit_code == 0 and "recompute on" in r.stdout, r.output


def test_profile_measures_the_nvme_path_given_with_units(tmp_path, monkeypatch):
    seen = fast_profiler(monkeypatch)
    r = _invoke("profile", "--nvme-path", str(tmp_path))
    assert r.exit_code == 0, (r.output, r.exception)
    assert seen == [str(tmp_path)] and list(tmp_path.iterdir()) == []
    progress = [ln.strip() for ln in r.stdout.splitlines() if ln.strip().startswith("[") and "/9]" in ln]
    assert len(progress) == 9
    units = ("GB/s", "params/s", "TFLOPS", "µs/op", "none")
    assert all(any(u in ln for u in units) for ln in progress), progress
    assert re.search(r"NVMe read/write: read [\d.e+]+ GB/s, write [\d.e+]+ GB/s", r.stdout)
    assert "--output FILE.toml" in r.stdout


def test_the_memory_timeline_marks_backward(tmp_path):
    import tierwise.cli.train

    seen = {}
    real = tierwise.cli.train.plot_timeline
    cli_plot = lambda timeline, path: seen.setdefault("phases", [m["phase"] for m in timeline]) and real(timeline, path)  # noqa: E731
    try:
        tierwise.cli.train.plot_timeline = cli_plot
        r = _invoke("--steps", "2", "--output", str(tmp_path / "run"))
    finally:
        tierwise.cli.train.plot_timeline = real
    assert r.exit_code == 0, r.output
    assert {"forward", "backward", "update"} <= set(seen["phases"])


def test_the_docs_plan_sample_is_what_plan_prints():
    text = README.read_text()
    m = re.search(r"```\n\$ (finetune plan --model 70b[^\n]*\\\n[^\n]*)\n(.*?)```", text, re.S)
    assert m, "the README's plan sample"
    command, expected = m.group(1).replace("\\\n", " "), m.group(2)
    r = _invoke(*shlex.split(command)[1:])
    assert r.exit_code == 0, r.output
    assert r.stdout == expected


def test_plan_seq_len_max_names_the_longest_that_fits():
    """`plan --seq-len max`: the length it names fits, and one step (1024 tokens) longer does not,
    with the activations offloaded where that goes further; beyond the model's positions, said."""
    common = ["plan", "--model", "tiny", "--gpu-mem", "64M", "--batch-size", "1"]
    r = _invoke(*common, "--seq-len", "max")
    assert r.exit_code == 0, r.output
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("longest context: "))
    n = int(re.search(r"--seq-len (\d+)", line).group(1))
    flags = ["--offload-activations"] if "--offload-activations" in line else []
    assert n >= 2048 and n % 1024 == 0
    assert _invoke(*common, "--seq-len", str(n), *flags).exit_code == 0
    assert _invoke(*common, "--seq-len", str(n + 1024), *flags).exit_code == 2
    assert "beyond the 512 positions tiny was trained for" in r.stdout
    within = int(re.search(r"within them: --seq-len 512 plans ([\d,]+) tokens/s", r.stdout).group(1).replace(",", ""))
    at = _invoke(*common, "--seq-len", "512")  # (what it names: `plan` at the trained length)
    assert f"{within:,} tokens/s" in at.stdout
    assert _invoke("plan", "--seq-len", "many").exit_code == 2


def test_a_length_that_does_not_fit_is_offered_the_longest_that_does():
    common = ["plan", "--model", "tiny", "--gpu-mem", "64M", "--batch-size", "1"]
    r = _invoke(*common, "--seq-len", "16384")
    assert r.exit_code == 2
    offered = [ln.split("   ")[0].strip() for ln in r.stdout.splitlines() if ln.startswith("  --seq-len ")]
    assert offered, r.stdout
    assert _invoke(*common, *shlex.split(offered[0])).exit_code == 0
    assert "beyond the 512 positions tiny was trained for" in r.output  # (said refused, too)


def test_a_long_batch_that_does_not_fit_is_offered_one_row_a_micro_batch():
    """Halving the micro-batch is not always enough: one row with the accumulation that keeps a
    step's rows is tried too, and the shorter --seq-len (a step of fewer tokens) comes last."""
    common = ["plan", "--model", "tiny", "--gpu-mem", "64M", "--seq-len", "8192"]
    r = _invoke(*common, "--batch-size", "4")
    assert r.exit_code == 2
    offered = [ln.split("   ")[0].strip() for ln in r.stdout.splitlines() if ln.startswith("  --")]
    assert "--batch-size 1 --grad-accum 4" in offered, r.stdout
    assert offered[-1].startswith("--seq-len ") and "a shorter --seq-len last" in r.stdout
    assert _invoke(*common, "--batch-size", "1", "--grad-accum", "4").exit_code == 0
