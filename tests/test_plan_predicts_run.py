"""`finetune`'s plan predicts its run within ±10% (the README's promise) for the optimizers
and data the run takes, on a tiny TIED Llama (the head is a quarter of its parameters, as in
small real models: SmolLM2, Llama 3.2 1B, Qwen2.5 <= 3B).

The plan chunks the module training builds (cli.loading.build_meta_model), so it counts the
tied head exactly as the run does; each case runs the CLI's own engine construction on the
run's worst batch and compares the ledger's peaks with the plan's: a padded one, without a
mask as the CLI makes it and, for the chat data, with its padding mask (the model then builds
a dense B x S x S one: the plan's `padded`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tinyhf import make_tiny_llama_dir, write_jsonl  # noqa: E402

from tierwise.cli.config import TrainConfig  # noqa: E402
from tierwise.cli.data import has_padding, isolates, load_blocks, padded_batch  # noqa: E402
from tierwise.cli.loading import build_meta_model, iter_safetensors, resolve_model  # noqa: E402
from tierwise.cli.planning import make_plan  # noqa: E402
from tierwise.cli.train import make_engine  # noqa: E402

TOL = 0.10


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tied") / "m", layers=2, tie=True)


def _chat(path: Path) -> Path:
    rows = [{"messages": [{"role": "user", "content": "hi " * (1 + i % 3)},
                          {"role": "assistant", "content": "ok " * (1 + i % 2)}]} for i in range(6)]
    return write_jsonl(path, rows)


CASES = [  # (optimizer, precision, extra config, tiers compared)
    pytest.param("galore", "fp32", {}, ("gpu",), id="galore"),
    pytest.param("apollo-mini", "fp32", {}, ("gpu",), id="apollo-mini"),
    pytest.param("mezo", "fp32", {}, ("gpu",), id="mezo"),
    pytest.param("adamw", "fp32", {"chat": True}, ("gpu",), id="adamw-chat-data"),
    pytest.param("adamw8bit", "bf16", {"gpu_mem": "500K", "chunk_size": "16K"}, ("gpu", "host"),
                 id="adamw8bit-bf16-streamed"),
]


@pytest.mark.parametrize("optimizer, precision, extra, tiers", CASES)
def test_plan_predicts_the_runs_peaks(tied_dir, tmp_path, optimizer, precision, extra, tiers):
    data = str(_chat(tmp_path / "chat.jsonl")) if extra.get("chat") else None
    cfg = TrainConfig(model=str(tied_dir), data=data, pack=not extra.get("chat"), optimizer=optimizer,
                      precision=precision, seq_len=32, batch_size=2, recompute=True,
                      gpu_mem=extra.get("gpu_mem"), chunk_size=extra.get("chunk_size", "64M"))
    src = resolve_model(cfg.model)
    blocks = load_blocks(cfg.data, src.tokenizer, seq_len=cfg.seq_len, pack=cfg.pack,
                         isolate=isolates(src.config, pack=cfg.pack))
    mask = bool(extra.get("chat"))
    assert not has_padding(blocks, segments=True) and has_padding(blocks, mask=True)
    plan = make_plan(cfg, src=src, padded=True if mask else None)
    engine = make_engine(build_meta_model(src.config), cfg, plan=plan)  # placed as finetune places it
    try:
        engine.load_weights(iter_safetensors(src.model_dir))
        torch.manual_seed(0)
        worst = padded_batch(blocks, batch_size=cfg.batch_size, mask=True)  # holds the padded block
        if not mask:
            worst.pop("attention_mask", None)  # as the CLI batches it
        engine.step(worst)
        measured = engine.ledger.peaks()
    finally:
        engine.close()
    for tier in tiers:
        got, want = measured[tier], plan.peak[tier]
        assert abs(want - got) <= TOL * got, (tier, want, got)
