"""`finetune generate RUN --prompt ...` answers with the model the run trained: a full run's
export as transformers loads it, and a QLoRA run's adapter over its NF4 base decoded as the
engine computed with it (its eval loss is the run's; over the unquantised base it is not)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from tests.tinyhf import make_tiny_llama_dir, mean_eval_loss, write_jsonl
from tierwise.cli.data import eval_batches, isolates, load_blocks
from tierwise.cli.generate import load_trained
from tierwise.cli.main import app


def _run(*args: str):
    r = CliRunner().invoke(app, list(args))
    assert r.exit_code == 0, r.output
    return r


def test_generate_after_a_full_run_is_transformers_greedy(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _run("--output", str(tmp_path / "run"), "--steps", "3")
    r = _run("generate", str(tmp_path / "run"), "--prompt", "The tiny model", "--max-new-tokens", "6", "--no-chat")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model").eval()
    tok = AutoTokenizer.from_pretrained(tmp_path / "run" / "model")
    ids = tok("The tiny model", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.eos_token_id)
    assert r.stdout.strip() == tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()


@pytest.mark.slow
def test_a_qlora_run_answers_over_its_nf4_base(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = make_tiny_llama_dir(tmp_path / "base", hidden=64, layers=2)
    rows = [{"text": f"The tiny model streams chunk {i % 7} through the memory tier."} for i in range(32)]
    data, held = write_jsonl(tmp_path / "d.jsonl", rows[:24]), write_jsonl(tmp_path / "e.jsonl", rows[24:])
    run = tmp_path / "run"
    _run("--model", str(base), "--data", str(data), "--eval-data", str(held), "--qlora", "--lora-rank", "4",
         "--seq-len", "16", "--batch-size", "2", "--steps", "4", "--lr", "5e-3", "--output", str(run))
    logged = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [x["loss"] for x in logged if x.get("kind") == "eval"][-1]

    model, tok = load_trained(run)
    batches = eval_batches(load_blocks(str(held), tok, seq_len=16, isolate=isolates(model.config)), batch_size=2)
    assert mean_eval_loss(model, batches) == pytest.approx(trained, rel=1e-5)
    unquantised = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), run / "adapter").eval()
    assert abs(mean_eval_loss(unquantised, batches) - trained) > 1e-4  # the base it did not train over
    r = _run("generate", str(run), "--prompt", "The tiny model", "--max-new-tokens", "4", "--no-chat")
    assert r.stdout.strip()


def test_generate_refuses_what_is_not_a_finished_run(tmp_path):
    r = CliRunner().invoke(app, ["generate", str(tmp_path), "--prompt", "x"])
    assert r.exit_code == 2 and "not the --output of a finished finetune run" in r.output
