"""`finetune --lora-rank / --qlora` end to end, against PEFT in plain PyTorch.

The reference is what a PEFT user writes: `from_pretrained`, `torch.manual_seed(seed)`,
`peft.get_peft_model(model, LoraConfig(...))`, fused torch AdamW on the adapters, the CLI's
batches and lr schedule. fp32 everywhere, so "equal" is bit for bit. QLoRA's reference is PEFT
over bitsandbytes' Linear4bit (tests/test_lora.py's linear4bit_model). The exported adapter
directory is loaded back with `peft.PeftModel.from_pretrained`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

peft = pytest.importorskip("peft")

sys.path.insert(0, str(Path(__file__).parent))
from tinyhf import (error_line, logits_engine, make_tiny_family_dir, make_tiny_llama_dir, train_as_the_cli,  # noqa: E402
                    write_jsonl)

from tierwise.cli import checkpoint as ckpt  # noqa: E402
from tierwise.cli import train  # noqa: E402
from tierwise.cli.builtin import sample_rows  # noqa: E402
from tierwise.cli.config import TrainConfig  # noqa: E402
from tierwise.cli.data import eval_batches, isolates, load_blocks  # noqa: E402
from tierwise.cli.main import app  # noqa: E402
from tierwise.cli.metrics import read_metrics  # noqa: E402
from tierwise.cli.packing import use_segments  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
OPTIONS = dict(seq_len=16, batch_size=2, steps=3, lr=1e-2, warmup_steps=1, chunk_size="16K")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {"untied": make_tiny_llama_dir(root / "untied", vocab_size=288, hidden=32, layers=2),
            "tied": make_tiny_llama_dir(root / "tied", vocab_size=288, hidden=32, layers=2, tie=True),
            "gemma3-vl": make_tiny_family_dir(root / "gemma3-vl", "gemma3-vl"),
            "train": write_jsonl(root / "train.jsonl", sample_rows(24)),
            "eval": write_jsonl(root / "eval.jsonl", sample_rows(3))}


def _args(model_dir, assets, out, *extra, **options) -> list[str]:
    args = ["--model", str(model_dir), "--data", str(assets["train"]), "--output", str(out)]
    for k, v in (OPTIONS | options).items():
        args += ["--" + k.replace("_", "-"), str(v)]
    return args + list(extra)


def _finetune(args, monkeypatch) -> dict:
    """The real CLI in-process; returns the logits of the engine's last eval batch."""
    seen = {}
    monkeypatch.setattr(train, "engine_class", lambda: logits_engine(seen))
    result = CliRunner().invoke(app, args, env={"COLUMNS": "120"})
    assert result.exit_code == 0, (result.output, result.exception)
    seen["output"] = result.output
    return seen


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]


def _from_pretrained(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def _replay(model_dir, assets, lora: dict, *, make_base=None, seed: int = 0):
    """The CLI's run in plain PyTorch with PEFT: (losses, trained PeftModel, last eval batch)."""
    from transformers import AutoTokenizer

    cfg = TrainConfig(model=str(model_dir), data=str(assets["train"]), **OPTIONS)
    tok = AutoTokenizer.from_pretrained(model_dir)
    base = _from_pretrained(model_dir)
    base = make_base(base) if make_base else base
    torch.manual_seed(seed)
    model = peft.get_peft_model(base, peft.LoraConfig(**lora)).train()
    losses = train_as_the_cli(model, cfg, tok)
    evals = eval_batches(load_blocks(str(assets["eval"]), tok, seq_len=cfg.seq_len, pack=cfg.pack,
                                     isolate=isolates(model.config, pack=cfg.pack)),
                         batch_size=cfg.batch_size)
    return losses, model.eval(), evals[-1]


def _adapters(named) -> dict[str, torch.Tensor]:
    return {n.removeprefix("base_model.model.").replace(".default", ""): t.detach()
            for n, t in named if "lora_" in n}


@pytest.mark.parametrize("which,flags,lora", [
    ("untied", ["--lora-rank", "4"], dict(r=4, lora_alpha=8, target_modules="all-linear")),
    ("tied", ["--lora-rank", "2", "--lora-alpha", "5", "--lora-dropout", "0.1", "--lora-targets", "q_proj,v_proj"],
     dict(r=2, lora_alpha=5, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])),
    # dropout on every linear saves more for backward than the planner's estimate (which the
    # engine had placed every chunk for, leaving the rest of the budget unused)
    ("untied", ["--lora-rank", "4", "--lora-dropout", "0.05"],
     dict(r=4, lora_alpha=8, lora_dropout=0.05, target_modules="all-linear")),
    # Gemma-3 4B and up: all-linear adapts the vision tower too (PEFT's all-linear), which text never runs
    ("gemma3-vl", ["--lora-rank", "4"], dict(r=4, lora_alpha=8, target_modules="all-linear")),
], ids=["untied-all-linear", "tied-qv-dropout", "untied-all-linear-dropout", "gemma3-vl-all-linear"])
def test_lora_run_equals_peft_and_exports_a_peft_adapter(assets, tmp_path, monkeypatch, which, flags, lora):
    out = tmp_path / "run"
    seen = _finetune(_args(assets[which], assets, out, *flags, "--eval-data", str(assets["eval"])), monkeypatch)
    ref_losses, ref, eval_batch = _replay(assets[which], assets, lora)
    assert _losses(out) == ref_losses
    assert "trainable of" in seen["output"] and "PEFT adapter exported to" in seen["output"]

    adapter = out / "adapter"
    names = {p.name for p in adapter.iterdir()}  # the adapter, and the tokenizer it loads with
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert not names - {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json",
                        "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"}, names
    assert not (out / "model").exists()  # the base is unchanged: no copy of it
    with safe_open(adapter / "adapter_model.safetensors", "pt") as f:
        mine = {k: f.get_tensor(k) for k in f.keys()}
    ref.save_pretrained(tmp_path / "peft")  # what PEFT writes for the trained adapters
    with safe_open(tmp_path / "peft" / "adapter_model.safetensors", "pt") as f:
        theirs = {k: f.get_tensor(k) for k in f.keys()}
    assert sorted(mine) == sorted(theirs)
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (lora["r"], lora["lora_alpha"],
                                                                          lora.get("lora_dropout", 0.0))

    loaded = peft.PeftModel.from_pretrained(_from_pretrained(assets[which]), adapter).eval()
    use_segments(loaded.get_base_model())  # attending to packed rows as the run did
    with torch.no_grad():
        logits = loaded(**eval_batch).logits
    assert torch.equal(logits, seen["logits"])  # the engine's last eval logits, from the adapter
    umask = os.umask(0)
    os.umask(umask)
    assert (adapter / "adapter_model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask  # others may read it
    assert config["task_type"] == "CAUSAL_LM"  # so the auto class loads it, base and all
    auto = peft.AutoPeftModelForCausalLM.from_pretrained(adapter).eval()
    use_segments(auto.get_base_model())
    with torch.no_grad():
        assert torch.equal(auto(**eval_batch).logits, seen["logits"])


def test_qlora_run_equals_peft_over_bitsandbytes_linear4bit(assets, tmp_path, monkeypatch):
    """Stated tolerance: none. On CPU bitsandbytes' Linear4bit computes with dequantize_4bit's
    weight, which the engine's NF4 decode equals bit for bit (tests/test_codecs.py). Hidden 64:
    bitsandbytes 0.50's CPU dequantize_4bit misplaces the absmax of a weight whose rows are not
    a whole number of blocks (in_features 32 or 48: tests/test_moe_base.py), the reference then
    being wrong, not the engine."""
    pytest.importorskip("bitsandbytes")
    from tests.test_lora import linear4bit_model

    out = tmp_path / "run"
    model = make_tiny_llama_dir(tmp_path / "llama64", vocab_size=288, hidden=64, layers=2)
    seen = _finetune(_args(model, assets, out, "--qlora", "--lora-rank", "4"), monkeypatch)
    assert "base nf4 (double quant)" in seen["output"]
    losses = _losses(out)
    assert all(torch.isfinite(torch.tensor(losses)))
    ref_losses, _, _ = _replay(model, assets, dict(r=4, lora_alpha=8, target_modules="all-linear"),
                               make_base=lambda m: linear4bit_model(m, double_quant=True))
    assert losses == ref_losses
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8


# -- checkpoints: adapters and their state only; SIGKILL then --resume is bit-exact ---------

def _subprocess(args, **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tierwise.cli.main", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "120", **env})


def test_checkpoint_holds_no_base_and_sigkill_resume_is_bit_exact(assets, tmp_path, monkeypatch):
    flags = ["--lora-rank", "2", "--lora-targets", "q_proj,v_proj", "--base-dtype", "bf16",
             "--checkpoint-every", "2"]
    reference = tmp_path / "ref"
    _finetune(_args(assets["untied"], assets, reference, *flags, steps=5), monkeypatch)

    out = tmp_path / "run"  # the save of step 4 sleeps before its rename: killed mid-run, mid-save
    proc = _subprocess(_args(assets["untied"], assets, out, *flags, steps=5), **{ckpt.FAULT_ENV: "4:sleep"})
    deadline = time.monotonic() + 120
    while not (out / "ckpt-000004.tmp" / "trainer.json").exists():
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert ckpt.latest_checkpoint(out).name == "ckpt-000002"

    # the checkpoint: adapters' masters and AdamW moments, no base tensor
    ref = peft.get_peft_model(_from_pretrained(assets["untied"]), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    trainable, base_numel = ref.get_nb_trainable_parameters()
    with safe_open(ckpt.latest_checkpoint(out) / "engine.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    masters = [t for k, t in tensors.items() if ".master" in k]
    assert sum(t.numel() for t in masters) == trainable  # the adapters (their chunk has no padding here)
    steps = [k for k in tensors if ".step" in k]  # a step counter per chunk, frozen ones included
    # every byte: fp32 masters + AdamW's two fp32 moments + the step counters; nothing of the base
    assert sum(t.numel() * t.element_size() for t in tensors.values()) == 12 * trainable + 4 * len(steps)
    assert 12 * trainable < 4 * (base_numel - trainable) // 8

    result = CliRunner().invoke(app, _args(assets["untied"], assets, out, *flags, "--resume", steps=5),
                                env={"COLUMNS": "120"})
    assert result.exit_code == 0, (result.output, result.exception)
    assert _losses(out) == _losses(reference)
    assert (out / "adapter" / "adapter_model.safetensors").read_bytes() == \
        (reference / "adapter" / "adapter_model.safetensors").read_bytes()
    from tierwise.cli.rundir import MARKER, RUN_ENTRIES  # what --overwrite may delete: all a run writes

    assert all(RUN_ENTRIES.fullmatch(p.name) for p in out.iterdir() if p.name != MARKER), os.listdir(out)


def test_resume_with_other_lora_flags_is_one_line(assets, tmp_path, monkeypatch):
    out = tmp_path / "run"
    _finetune(_args(assets["untied"], assets, out, "--lora-rank", "2", steps=1), monkeypatch)
    result = CliRunner().invoke(app, _args(assets["untied"], assets, out, "--lora-rank", "4", "--resume", steps=2))
    line = error_line(result)
    assert "--lora-rank" in line and "--lora-alpha" in line and "it used --lora-rank 2" in line
    line = error_line(CliRunner().invoke(app, _args(assets["untied"], assets, out, "--resume", steps=2)))
    assert "--lora-rank" in line  # a full fine-tune cannot continue a LoRA checkpoint
    full = tmp_path / "full"
    _finetune(_args(assets["untied"], assets, full, steps=1), monkeypatch)
    line = error_line(CliRunner().invoke(app, _args(assets["untied"], assets, full, "--lora-rank", "4", "--resume",
                                                    steps=2)))
    assert "it used no --lora-rank: a full fine-tune, no --lora-alpha" in line and "None" not in line


def test_resume_over_a_changed_base_is_refused(assets, tmp_path, monkeypatch):
    """A LoRA checkpoint holds the adapters only: its --resume loads the base again, and one
    whose weights changed (same shapes) would continue silently on another model."""
    base = make_tiny_llama_dir(tmp_path / "base", vocab_size=288, hidden=32, layers=2)
    out = tmp_path / "run"
    _finetune(_args(base, assets, out, "--lora-rank", "2", steps=1), monkeypatch)
    make_tiny_llama_dir(base, vocab_size=288, hidden=32, layers=2, shard=True)  # the same weights, in shards
    _finetune(_args(base, assets, out, "--lora-rank", "2", "--resume", steps=2), monkeypatch)
    make_tiny_llama_dir(base, vocab_size=288, hidden=32, layers=2, seed=1, shard=True)
    for extra in ([], ["--dry-run"]):
        line = error_line(CliRunner().invoke(app, _args(base, assets, out, "--lora-rank", "2", "--resume", *extra,
                                                        steps=3)))
        assert "the base model's weights" in line and "adapters only" in line
    assert len(_losses(out)) == 2  # nothing of the refused run written


def test_checkpoint_from_before_the_lora_options_resumes(assets, tmp_path, monkeypatch):
    """A full fine-tune's checkpoint whose config has no LoRA keys (written before they existed)."""
    out = tmp_path / "run"
    real = TrainConfig.to_dict
    monkeypatch.setattr(TrainConfig, "to_dict", lambda self: {k: v for k, v in real(self).items()
                                                              if k not in TrainConfig.LORA_KEYS})
    _finetune(_args(assets["untied"], assets, out, steps=1), monkeypatch)
    assert "lora_rank" not in ckpt.load_trainer(ckpt.latest_checkpoint(out))["config"]
    monkeypatch.setattr(TrainConfig, "to_dict", real)
    _finetune(_args(assets["untied"], assets, out, "--resume", steps=2), monkeypatch)
    assert len(_losses(out)) == 2


# -- user errors: one line, exit 2 ------------------------------------------------------------

@pytest.mark.parametrize("flags,expect", [
    (["--lora-rank", "-1"], "--lora-rank must be at least 1"),  # (0: a full fine-tune)
    (["--lora-rank", "4", "--lora-dropout", "1"], "--lora-dropout must be in [0, 1)"),
    (["--lora-rank", "4", "--lora-alpha", "-1"], "--lora-alpha must be a positive number"),
    (["--base-dtype", "nf4"], "--base-dtype applies to LoRA runs"),
    (["--lora-targets", "q_proj"], "--lora-targets applies to LoRA runs"),
    (["--qlora", "--base-dtype", "int8"], "--qlora stores the base in nf4"),
    (["--lora-rank", "4", "--base-dtype", "fp32", "--precision", "bf16"], "--base-dtype fp32 with --precision bf16"),
    (["--lora-rank", "4", "--optimizer", "mezo"], "mezo"),
    (["--lora-rank", "4", "--lora-targets", "q_proj,qproj"], "no module of LlamaForCausalLM is named 'qproj'"),
    (["--lora-rank", "4", "--lora-targets", "mlp"], "--lora-targets mlp"),
])
def test_bad_lora_options_are_one_line_errors(assets, tmp_path, flags, expect):
    out = tmp_path / "run"
    line = error_line(CliRunner().invoke(app, _args(assets["untied"], assets, out, *flags)))
    assert expect in line, line
    assert not any(out.glob("ckpt-*"))


def test_dry_run_and_plan_know_about_lora(assets, tmp_path):
    result = CliRunner().invoke(app, _args(assets["untied"], assets, tmp_path / "o", "--qlora", "--dry-run"),
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, (result.output, result.exception)
    assert "LoRA r=16 alpha=32" in result.output and "base nf4 (double quant)" in result.output
    assert "% " in result.output or "%)" in result.output
    assert "base nf4" in result.output  # the plan table's column of the encoded base
    planned = CliRunner().invoke(app, ["plan", "--model", str(assets["untied"]), "--lora-rank", "8"],
                                 env={"COLUMNS": "200"})
    assert planned.exit_code == 0 and "base fp32" in planned.output, planned.output


def test_lora_with_dropout_runs_at_the_plans_minimum_gpu_budget(tmp_path, monkeypatch):
    """The engine places chunks up front for the pre-flight plan's activations, LoRA's and its
    dropout's included: at the gpu budget `plan` calls the minimum the run goes through (before,
    the CLI's own estimate left out LoRA, placed chunks for 3.21 MiB of activations where the
    warm-up saved 3.75 MiB, and stopped after step 1 asking for 5.66 MiB)."""
    from tierwise.cli.planning import make_plan, resolve_model

    made = []
    real = train.make_engine
    monkeypatch.setattr(train, "make_engine", lambda *a, **kw: made.append(real(*a, **kw)) or made[-1])
    flags = ["--lora-rank", "16", "--lora-dropout", "0.1"]
    plan = make_plan(TrainConfig(lora_rank=16, lora_dropout=0.1), src=resolve_model(None))
    result = CliRunner().invoke(app, [*flags, "--gpu-mem", f"{plan.gpu_minimum}B", "--steps", "3",
                                      "--output", str(tmp_path / "run")])
    assert result.exit_code == 0, (result.output, result.stderr)
    assert made[0].needs.activations >= plan.reserve["gpu"]["activations"]
    # the built-in model is a random initialisation: the adapter fits no base on disk, said so
    assert "fits no model on disk" in result.output + result.stderr


def test_lora_on_a_bf16_saved_checkpoint_equals_peft_on_the_fp32_loaded_model(assets, tmp_path, monkeypatch):
    """Most hub checkpoints are saved in bf16. An fp32 LoRA run over one equals PEFT on
    from_pretrained(dtype=float32): the adapters are initialised in fp32 (the meta model was
    built in the config's bf16, so lora_A's Kaiming init was rounded to bf16)."""
    src = make_tiny_llama_dir(tmp_path / "bf16", vocab_size=288, hidden=32, layers=2, dtype=torch.bfloat16)
    assert json.loads((src / "config.json").read_text())["dtype"] == "bfloat16"
    out = tmp_path / "run"
    _finetune(_args(src, assets, out, "--lora-rank", "4"), monkeypatch)
    ref_losses, ref, _ = _replay(src, assets, dict(r=4, lora_alpha=8, target_modules="all-linear"))
    assert _losses(out) == ref_losses
    with safe_open(out / "adapter" / "adapter_model.safetensors", "pt") as f:
        mine = {k: f.get_tensor(k) for k in f.keys()}
    theirs = _adapters(ref.named_parameters())
    assert sorted(k.replace(".weight", "") for k in mine) == sorted(
        "base_model.model." + k.replace(".weight", "") for k in theirs)
    assert all(torch.equal(mine["base_model.model." + k], t) for k, t in theirs.items())
