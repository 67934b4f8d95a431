"""The `finetune` app end to end with a stand-in engine: config files, errors, train, resume."""

import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
from tinyhf import StandInEngine, write_jsonl, error_line as _error_line  # noqa: E402

from tierwise.cli import checkpoint as ckpt  # noqa: E402
from tierwise.cli import train as cli_train  # noqa: E402
from tierwise.cli.main import app  # noqa: E402

FAST = ["--seq-len", "32", "--batch-size", "2"]


@pytest.fixture
def runner(monkeypatch):
    monkeypatch.setattr(cli_train, "engine_class", lambda: StandInEngine)
    return CliRunner()




def test_help_groups_options_in_panels(runner):
    result = runner.invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for panel in ("Model & data", "Memory budget", "Optimizer", "Schedule", "Output & resume",
                  "Hardware & plan"):
        assert panel in result.output
    assert "plan" in result.output and "profile" in result.output
    for command in ([], ["plan"], ["export"], ["generate"], ["profile"]):  # (flags show no value type)
        shown = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "200"}).output
        assert "Show this message" in shown and "<bool>" not in shown, command


def test_help_on_a_narrow_terminal_is_the_plain_list_by_panel(runner):
    """At 80 columns rich's panels left ~20 characters of help a line and cut flags short
    ("--no-offload-activa…"): there the plain layout, a section per panel, every flag whole."""
    for command in ([], ["plan"]):
        shown = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "80"}).output
        lines = shown.splitlines()
        assert max(map(len, lines)) <= 80 and "╭" not in shown and "[bold]" not in shown, shown
        for panel in ("Model & data:", "Memory budget:", "Output & resume:" if not command else "Plan output:"):
            assert panel in lines, (panel, shown)
        assert "--offload-activations / --no-offload-activations" in shown
    root = runner.invoke(app, ["--help"], env={"COLUMNS": "80"}).output
    assert "Commands:" in root and "--cpu-mem 64G" in root  # (never wrapped inside a flag: "--cpu-|mem")
    assert "\n\n\n" not in runner.invoke(app, ["profile", "--help"], env={"COLUMNS": "80"}).output


def test_bad_size_is_one_line_exit_2(runner, tmp_path):
    line = _error_line(runner.invoke(app, ["--gpu-mem", "24X", "--output", str(tmp_path)]))
    assert "--gpu-mem" in line and "24X" in line


def test_missing_data_file(runner, tmp_path):
    line = _error_line(runner.invoke(app, ["--data", str(tmp_path / "no.jsonl")]))
    assert "data file not found" in line


def test_malformed_data_names_the_line(runner, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "ok"}, "{oops"])
    assert f"{data}:2: bad JSON" in _error_line(runner.invoke(app, ["--data", str(data)]))


def test_non_empty_output_needs_resume_or_overwrite(runner, tmp_path):
    (tmp_path / "something").write_text("x")
    line = _error_line(runner.invoke(app, ["--output", str(tmp_path), *FAST, "--steps", "1"]))
    assert "is not empty" in line and "--resume" in line and "--overwrite" in line
    assert "no checkpoint" in _error_line(
        runner.invoke(app, ["--output", str(tmp_path), "--resume", *FAST]))
    missing = tmp_path / "missing"
    assert "no checkpoint" in _error_line(runner.invoke(app, ["--output", str(missing), "--resume", *FAST]))
    assert not missing.exists()  # a refused run leaves no directory behind


def test_resume_dry_run_refuses_what_the_resume_would(runner, tmp_path):
    out = tmp_path / "run"
    r = runner.invoke(app, ["--output", str(out), *FAST, "--steps", "1"])
    assert r.exit_code == 0, r.output
    line = _error_line(runner.invoke(app, ["--output", str(out), *FAST, "--steps", "2", "--model", "tiny",
                                           "--resume", "--dry-run"]))
    assert "--model differs from the checkpointed run" in line and "the built-in tiny model" in line
    assert "no checkpoint" in _error_line(runner.invoke(app, ["--output", str(tmp_path / "none"), *FAST,
                                                              "--resume", "--dry-run"]))
    r = runner.invoke(app, ["--output", str(out), *FAST, "--steps", "2", "--resume", "--dry-run"])
    assert r.exit_code == 0 and "verdict: fits" in r.output, r.output


def test_seq_len_max_in_training_points_to_plan(runner, tmp_path):
    line = _error_line(runner.invoke(app, ["--output", str(tmp_path / "o"), "--seq-len", "max", "--steps", "1"]))
    assert "`finetune plan --seq-len max`" in line
    assert "whole number" in _error_line(runner.invoke(app, ["--output", str(tmp_path / "o"), "--seq-len", "1k"]))
    assert not (tmp_path / "o").exists()


def test_config_file_merges_and_cli_wins(runner, tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(cli_train, "run", lambda cfg, console: seen.setdefault("cfg", cfg) and 0)
    toml = tmp_path / "run.toml"
    toml.write_text('gpu-mem = "24G"\nlr = 0.001\nsteps = 7\noptimizer = "adamw8bit"\n'
                    'dry_run = true\nprecision = "bf16"\n')
    result = runner.invoke(app, ["--config", str(toml), "--lr", "0.5"])
    assert result.exit_code == 0, result.output
    cfg = seen["cfg"]
    assert cfg.budgets["gpu"] == 24 << 30 and cfg.steps == 7 and cfg.optimizer == "adamw8bit"
    assert cfg.lr == 0.5 and cfg.dry_run and cfg.precision == "bf16"


def test_config_file_unknown_key_and_bad_value(runner, tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('gpu-mem = "24G"\nlearning-rate = 1\n')
    assert "unknown key 'learning-rate'" in _error_line(runner.invoke(app, ["--config", str(toml)]))
    toml.write_text('cpu-mem = "lots"\n')
    assert "--cpu-mem" in _error_line(runner.invoke(app, ["--config", str(toml)]))


def test_train_resume_export_and_plots(runner, tmp_path):
    """6 steps straight == 3 steps, then --resume to 6 (same losses, same weights)."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": f"the cat sees {i} moons."}
                                              for i in range(40)])
    common = ["--data", str(data), *FAST, "--grad-accum", "2", "--lr", "1e-3",
              "--warmup-steps", "2", "--grad-clip", "1.0"]
    full, part = tmp_path / "full", tmp_path / "part"
    r = runner.invoke(app, [*common, "--steps", "6", "--output", str(full)])
    assert r.exit_code == 0, (r.output, r.exception)
    r = runner.invoke(app, [*common, "--steps", "3", "--output", str(part)])
    assert r.exit_code == 0, (r.output, r.exception)
    r = runner.invoke(app, [*common, "--steps", "6", "--output", str(part), "--resume"])
    assert r.exit_code == 0, (r.output, r.exception)

    def losses(out):
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}

    assert losses(full) == losses(part) and len(losses(full)) == 6
    assert "--resume:" not in r.output  # steps 1-3 ran at the 6-step schedule's lr: nothing to say
    for name in ("loss.png", "memory_timeline.png", "model/config.json", "latest"):
        assert (full / name).exists(), name
    from safetensors.torch import load_file

    a, b = load_file(full / "model/model.safetensors"), load_file(part / "model/model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    changed = _error_line(runner.invoke(app, [*common, "--seq-len", "16", "--steps", "8",
                                              "--output", str(part), "--resume"]))
    assert "--seq-len" in changed


def test_console_script_error_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tierwise.cli.main", "--gpu-mem", "lots"],
                          capture_output=True, text=True, cwd=tmp_path)  # conftest: PYTHONPATH
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: bad --gpu-mem 'lots'") and "Traceback" not in proc.stderr


class _InterruptAtStep2(StandInEngine):
    def step(self, batch, grad_accum=1):
        loss = super().step(batch, grad_accum)
        if self.steps == 2:
            import signal

            os.kill(os.getpid(), signal.SIGINT)  # as if the user pressed Ctrl-C mid-step
        return loss


def test_ctrl_c_checkpoints_and_exits_130(runner, tmp_path, monkeypatch):
    monkeypatch.setattr(cli_train, "engine_class", lambda: _InterruptAtStep2)
    out = tmp_path / "run"
    r = runner.invoke(app, [*FAST, "--steps", "5", "--output", str(out)])
    assert r.exit_code == 130, (r.output, r.exception)
    assert (out / "latest").read_text().strip() == "ckpt-000002"
    assert not (out / "model").exists()
    monkeypatch.setattr(cli_train, "engine_class", lambda: StandInEngine)
    r = runner.invoke(app, [*FAST, "--steps", "4", "--output", str(out), "--resume"])
    assert r.exit_code == 0, (r.output, r.exception)
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_ctrl_c_during_a_checkpoint_stops_at_that_checkpoint(runner, tmp_path, monkeypatch):
    """Ctrl-C while --checkpoint-every writes step 2's checkpoint: the run stops there (that
    checkpoint is the one to resume from), not after one more step and a second save."""
    import signal

    monkeypatch.setattr(cli_train, "engine_class", lambda: StandInEngine)
    real = ckpt._fault

    def fault(step, moment):
        if step == 2 and moment == "before_rename":
            os.kill(os.getpid(), signal.SIGINT)
        real(step, moment)

    monkeypatch.setattr(ckpt, "_fault", fault)
    out = tmp_path / "run"
    r = runner.invoke(app, [*FAST, "--steps", "5", "--checkpoint-every", "2", "--output", str(out)])
    assert r.exit_code == 130, (r.output, r.exception)
    assert [p.name for _, p in ckpt.list_checkpoints(out)] == ["ckpt-000002"]
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    assert "interrupted (SIGINT): checkpoint ckpt-000002 saved" in r.output


def test_resume_that_changes_steps_already_run_says_so(runner, tmp_path):
    """--resume --steps 6 after a 3-step cosine run: steps 1-3 ran on a 3-step schedule, so the
    result is not the straight 6-step run's (its losses differ from step 3 on); a notice says
    so, naming the lr a step ran at. A changed --weight-decay is named too."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": f"the cat sees {i} moons."} for i in range(40)])
    common = ["--data", str(data), *FAST, "--lr", "1e-2"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert runner.invoke(app, [*common, "--steps", "6", "--output", str(full)]).exit_code == 0
    assert runner.invoke(app, [*common, "--steps", "3", "--output", str(part)]).exit_code == 0
    r = runner.invoke(app, [*common, "--steps", "6", "--output", str(part), "--resume",
                            "--weight-decay", "0.1"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, (r.output, r.exception)

    def train_rows(out):
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r for r in rows if r["kind"] == "train"}

    straight, resumed = train_rows(full), train_rows(part)
    assert [straight[s]["loss"] == resumed[s]["loss"] for s in range(1, 7)] == [True] * 2 + [False] * 4
    notes = [ln for ln in r.output.splitlines() if ln.startswith("--resume:")]
    assert len(notes) == 2, r.output
    assert "total steps 3 -> 6" in notes[0] and f"step 2 at lr {resumed[2]['lr']:.4g}" in notes[0]
    assert f"the new one gives {straight[2]['lr']:.4g}" in notes[0]
    assert notes[1] == "--resume: --weight-decay 0.1 from step 4 on (steps 1-3 ran with 0.0)"
    again = runner.invoke(app, [*common, "--steps", "6", "--output", str(part), "--resume", "--weight-decay", "0.1"],
                          env={"COLUMNS": "200"})  # a finished run: says so (it said "steps 7-6")
    assert again.exit_code == 0 and "nothing to train: the checkpoint is at step 6, the run ends at step 6" \
        in again.output, again.output


def test_resume_with_edited_data_is_refused(runner, tmp_path):
    """--data edited between a stop and --resume (rows dropped): the checkpoint's data position
    would name other batches, so the resumed run would not be the straight run. One line
    naming both block counts; with the data restored the resume equals the straight run."""
    rows = [{"text": f"the cat sees {i} moons."} for i in range(40)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    common = ["--data", str(data), *FAST, "--schedule", "constant", "--steps", "6"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert runner.invoke(app, [*common, "--output", str(full)]).exit_code == 0
    assert runner.invoke(app, [*common[:-1], "3", "--output", str(part)]).exit_code == 0
    write_jsonl(data, rows[:20])
    line = _error_line(runner.invoke(app, [*common, "--output", str(part), "--resume"]))
    assert line.startswith(f"error: --resume: the data (--data {data}) tokenizes to other blocks")
    blocks = [int(n) for n in re.findall(r"(\d+) blocks", line)]
    assert blocks[0] < blocks[1], line  # this data's blocks, then the checkpoint's
    # an edit that keeps the block count (the same rows in another order) is caught by the crc32
    write_jsonl(data, rows[1:] + rows[:1])
    line = _error_line(runner.invoke(app, [*common, "--output", str(part), "--resume"]))
    counts = [int(n) for n in re.findall(r"(\d+) blocks", line)]
    assert "tokenizes to other blocks" in line and counts[0] == counts[1], line
    write_jsonl(data, rows)
    r = runner.invoke(app, [*common, "--output", str(part), "--resume"])
    assert r.exit_code == 0, (r.output, r.exception)

    def losses(out):
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}

    assert losses(part) == losses(full)


def test_chunk_size_below_the_engines_minimum_is_one_line(tmp_path):
    """The engine's smallest chunk (ALIGN fp32 values, 64 B) trains; one byte less was a
    ValueError traceback from the chunk packer, after the model and data had loaded."""
    from tinyhf import make_tiny_family_dir
    from tierwise.offload.core.chunks import ALIGN

    model = make_tiny_family_dir(tmp_path / "m", "qwen2")
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": f"the cat sees {i} moons."} for i in range(8)])
    args = ["--model", str(model), "--data", str(data), "--seq-len", "16", "--batch-size", "2", "--steps", "1"]
    runner = CliRunner()
    ok = runner.invoke(app, [*args, "--chunk-size", f"{ALIGN * 4}B", "--output", str(tmp_path / "a")])
    assert ok.exit_code == 0, (ok.output, ok.exception)
    line = _error_line(runner.invoke(app, [*args, "--chunk-size", f"{ALIGN * 4 - 1}B",
                                           "--output", str(tmp_path / "b")]))
    assert line == f"error: --chunk-size {ALIGN * 4 - 1}B is below the smallest chunk, {ALIGN * 4}B"


def test_eval_every_without_eval_data_is_one_line(runner, tmp_path):
    """--eval-every N without --eval-data evaluated nothing and said nothing; refused as
    --reset-optimizer without --resume is. With --eval-data it evaluates every N steps."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": f"the cat sees {i} moons."} for i in range(16)])
    args = ["--data", str(data), *FAST, "--steps", "4", "--eval-every", "2"]
    line = _error_line(runner.invoke(app, [*args, "--output", str(tmp_path / "a")]))
    assert line == "error: --eval-every applies with --eval-data only: give the held-out data"
    r = runner.invoke(app, [*args, "--eval-data", str(data), "--output", str(tmp_path / "b")])
    assert r.exit_code == 0, (r.output, r.exception)
    rows = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [2, 4]


def test_resume_takes_another_spelling_of_the_same_paths(runner, tmp_path, monkeypatch):
    """--data d.jsonl then --resume --data /abs/d.jsonl (or ./d.jsonl) names one file: resumed,
    equal to the straight run; a copy of it elsewhere is another --data, refused as before."""
    from tinyhf import make_tiny_llama_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli_train, "engine_class", lambda: StandInEngine)
    make_tiny_llama_dir(tmp_path / "m", hidden=32)
    write_jsonl(tmp_path / "d.jsonl", [{"text": f"the cat sees {i} moons."} for i in range(40)])
    common = [*FAST, "--schedule", "constant", "--steps", "6"]
    assert runner.invoke(app, ["--model", "m", "--data", "d.jsonl", *common, "--output", "full"]).exit_code == 0
    assert runner.invoke(app, ["--model", "m", "--data", "d.jsonl", *common[:-1], "3", "--output", "part"]).exit_code == 0
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "d.jsonl").write_bytes((tmp_path / "d.jsonl").read_bytes())
    line = _error_line(runner.invoke(app, ["--model", "m", "--data", "copy/d.jsonl", *common, "--output", "part",
                                           "--resume"]))
    assert "--data differs" in line
    r = runner.invoke(app, ["--model", "./m/", "--data", str(tmp_path / "d.jsonl"), *common, "--output", "part",
                            "--resume"])
    assert r.exit_code == 0, (r.output, r.exception)

    def losses(out):
        rows = [json.loads(x) for x in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}

    assert losses("part") == losses("full") and len(losses("full")) == 6
