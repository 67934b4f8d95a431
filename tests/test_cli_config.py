"""Flags and TOML keys come from one place (TrainConfig's fields and their `option`
metadata), and the CLI's engine contract is a Protocol the real Engine satisfies."""

import dataclasses
import math
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from tierwise.cli import train as cli_train
from tierwise.cli.config import TOML_KEYS, TrainConfig, option_fields
from tierwise.cli.main import app
from tierwise.offload.update.table import NAMES

sys.path.insert(0, str(Path(__file__).parent))
from tinyhf import StandInEngine  # noqa: E402


def _params(command_name=None) -> dict:
    group = typer.main.get_command(app)
    cmd = group if command_name is None else group.commands[command_name]
    return {p.name: p for p in cmd.params}


def _choices(p) -> tuple[str, ...]:
    return tuple(m.value for m in p.type_descriptor.annotation)


def test_every_option_field_has_its_flag_default_and_toml_key():
    train, plan = _params(), _params("plan")
    fields = option_fields()
    assert [f.name for f in fields] == list(TOML_KEYS)
    assert {f.name for f in dataclasses.fields(TrainConfig) if f.init} == set(TOML_KEYS)  # no field left out
    for f in fields:
        meta = f.metadata["cli"]
        for params, wanted in ((train, True), (plan, meta["plan"])):
            assert (f.name in params) == wanted, f.name
            if not wanted:
                continue
            p = params[f.name]
            default = int(p.default) if f.name == "seq_len" else p.default  # (text: `plan --seq-len max`)
            assert default == f.default, (f.name, p.default, f.default)
            assert f"--{f.name.replace('_', '-')}" in p.opts, (f.name, p.opts)
            if meta["choices"]:
                assert _choices(p) == meta["choices"], f.name
    assert _choices(_params()["optimizer"]) == NAMES  # the optimizer table's names
    # the commands' own options are not config keys
    assert set(train) - set(TOML_KEYS) == {"config"}
    assert set(plan) - set(TOML_KEYS) == {"config", "json_out", "verify", "verify_steps"}


def test_every_toml_key_sets_its_field(tmp_path, monkeypatch):
    """A file holding every key (non-default values) reaches TrainConfig as the flags would."""
    seen = {}
    monkeypatch.setattr(cli_train, "run", lambda cfg, console: seen.setdefault("cfg", cfg) and 0)
    values = {"model": "tiny", "data": "d.jsonl", "eval_data": "e.jsonl", "seq_len": 64, "batch_size": 2,
              "grad_accum": 3, "pack": False, "gpu_mem": "1G", "cpu_mem": "2G", "cxl_mem": "3G", "cxl_node": 1,
              "nvme_path": "/tmp/x", "nvme_mem": "2T", "nvme_checksum": False, "offload_activations": True, "recompute": True, "recompute_layers": 2, "chunk_size": "16M",
              "optimizer": "galore", "lr": 0.5, "weight_decay": 0.1, "grad_clip": 1.0, "precision": "bf16",
              "steps": 7, "epochs": None, "warmup_steps": 2, "schedule": "linear", "eval_every": 3,
              "checkpoint_every": 4, "log_every": 3, "keep_checkpoints": 5, "report_to": "tensorboard", "seed": 9, "output": "o", "resume": True,
              "overwrite": False, "export_dtype": "fp16", "hardware": "h100", "dry_run": True,
              "trust_remote_code": True, "skip_nonfinite": 2, "reset_optimizer": True,
              "nproc_per_node": 2, "nnodes": 2, "grad_reduce": "step",  # with --dry-run: no torchrun started
              "lora_rank": 8, "lora_alpha": 12.0, "lora_dropout": 0.05, "lora_targets": "q_proj,v_proj",
              "base_dtype": "nf4", "qlora": True}
    assert set(values) == set(TOML_KEYS)
    lines = [f"{k.replace('_', '-')} = {_toml(v)}" for k, v in values.items() if v is not None]
    (tmp_path / "all.toml").write_text("\n".join(lines) + "\n")
    r = CliRunner().invoke(app, ["--config", str(tmp_path / "all.toml")])
    assert r.exit_code == 0, (r.output, r.exception)
    cfg = seen["cfg"]
    parsed = {"cxl_node": (1,)}  # a node list is parsed to its ids
    assert {k: getattr(cfg, k) for k in values} == {**values, **parsed}


def _toml(v) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else f'"{v}"' if isinstance(v, str) else str(v)


@pytest.mark.parametrize("command", [[], ["plan"]])
def test_unknown_toml_key_is_one_line_and_exit_2(tmp_path, command):
    toml = tmp_path / "run.toml"
    toml.write_text('gpu-mem = "24G"\nrank = 8\n')
    r = CliRunner().invoke(app, [*command, "--config", str(toml)])
    assert r.exit_code == 2, (r.output, r.exception)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "unknown key 'rank'" in lines[0], r.stderr


def test_unknown_flag_is_exit_2():
    r = CliRunner().invoke(app, ["--rank", "8"])
    assert r.exit_code == 2 and "No such option" in r.output


def test_engines_satisfy_the_cli_protocol():
    from tests.models import tiny_llama
    from tierwise.offload import Budget, Engine

    model = tiny_llama(layers=2, hidden=32)
    engine = Engine(model, budget=Budget(chunk=16 << 10))
    try:
        assert isinstance(engine, cli_train.TrainingEngine)
    finally:
        engine.close()
    assert isinstance(StandInEngine(tiny_llama(layers=2, hidden=32)), cli_train.TrainingEngine)
    assert not isinstance(object(), cli_train.TrainingEngine)


def test_make_engine_refuses_an_option_the_engine_does_not_take(monkeypatch):
    """No option is dropped with a warning: an engine without one is a TypeError. A group left
    at its default is not passed."""
    from tests.models import tiny_llama

    class OneRank(StandInEngine):
        def __init__(self, model, *, optim=None, budget=None, precision=None, activations=None):
            super().__init__(model, optim=optim)

    monkeypatch.setattr(cli_train, "engine_class", lambda: OneRank)
    model = tiny_llama(layers=2, hidden=32)
    cli_train.make_engine(model, TrainConfig(grad_clip=1.0, model="x", precision="fp32", lr=1e-4))
    with pytest.raises(TypeError, match="distributed"):
        cli_train.make_engine(model, TrainConfig(grad_reduce="step", model="x", precision="fp32", lr=1e-4))


@pytest.mark.parametrize("name", ["tiny", "100m", "llama-7b", "qwen2.5-7b", "mistral-7b", "llama-8b", "gemma-3-4b"])
def test_profile_params_are_the_built_modules(name):
    """`finetune plan --model PROFILE` reads the parameters off the profile (no torch); they
    are the ones of the module training builds from it (vocabulary grown to the built-in
    tokenizer's, a tied head once), so the torch-free plan is the plan."""
    from tierwise.cli import planning
    from tierwise.cli.loading import resolve_model
    from tierwise.cli.profilemodel import profile_params

    built = planning.engine_params(resolve_model(name))
    # (and which are embeddings: an 8-bit optimizer keeps their moments in fp32)
    assert [(s.name, s.shape, s.embedding) for s in profile_params(name)] == [(s.name, s.shape, s.embedding)
                                                                              for s in built]
    assert all(s.stride in (None, tuple(math.prod(s.shape[i + 1:]) for i in range(len(s.shape)))) for s in built)


@pytest.mark.parametrize("command", [[], ["plan", "--model", "llama-1b", "--gpu-mem", "4G", "--cpu-mem", "12G"]],
                         ids=["train", "plan"])
def test_nvme_path_that_is_a_file_is_one_line_and_exit_2(tmp_path, command):
    """`plan` priced a file given as --nvme-path (and said it fits); the run then failed creating
    its swap directory there. Both refuse it now, one line, and the file is left as it was."""
    f = tmp_path / "notadir"
    f.write_text("mine")
    out = [] if command else ["--output", str(tmp_path / "o")]
    r = CliRunner().invoke(app, [*command, "--nvme-path", str(f), *out])
    assert r.exit_code == 2, (r.output, r.exception)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "is a file, not a directory" in lines[0], r.stderr
    assert f.read_text() == "mine"


def test_command_line_flags_win_over_the_file_even_to_turn_its_values_off(tmp_path, monkeypatch):
    """--epochs over a file's steps (and the reverse), --lora-rank 0 and --no-qlora over a
    file's LoRA: the command line wins, as --help says (were: "not both", or no way to say it)."""
    seen = []
    monkeypatch.setattr(cli_train, "run", lambda cfg, console: seen.append(cfg) and 0)
    (tmp_path / "a.toml").write_text('steps = 4\nlora-rank = 4\nqlora = true\n')
    (tmp_path / "b.toml").write_text('epochs = 2\n')
    for args in (["--config", str(tmp_path / "a.toml"), "--epochs", "1", "--lora-rank", "0", "--no-qlora"],
                 ["--config", str(tmp_path / "b.toml"), "--steps", "3"]):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 0, (r.output, r.exception)
    (a, b) = seen
    assert (a.steps, a.epochs, a.lora_rank, a.qlora, a.base_dtype) == (None, 1, None, False, None)
    assert (b.steps, b.epochs) == (3, None)
    r = CliRunner().invoke(app, ["--config", str(tmp_path / "b.toml"), "--steps", "3", "--epochs", "1"])
    assert r.exit_code == 2 and "not both" in r.stderr  # both on the command line: still refused
    # the file's LoRA-only values go with its LoRA (were: "--lora-alpha applies to LoRA runs")
    (tmp_path / "c.toml").write_text('lora-rank = 8\nlora-alpha = 16\nlora-targets = "q_proj,v_proj"\n')
    (tmp_path / "d.toml").write_text('qlora = true\nlora-targets = "q_proj,v_proj"\n')
    seen.clear()
    for args in (["--config", str(tmp_path / "c.toml"), "--lora-rank", "0"],
                 ["--config", str(tmp_path / "d.toml"), "--no-qlora"]):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 0, (r.output, r.exception)
    assert all((c.lora_rank, c.lora_alpha, c.lora_targets, c.base_dtype) == (None, None, "all-linear", None)
               for c in seen)
    r = CliRunner().invoke(app, ["--config", str(tmp_path / "c.toml"), "--lora-rank", "0", "--lora-alpha", "3"])
    assert r.exit_code == 2 and "--lora-alpha applies to LoRA runs" in r.stderr  # given on the command line
