"""Long sequences on CPU: the engine's tiled head loss against full logits, side by side.

A tiny Llama with a large vocabulary (hidden 64, 2 layers, vocabulary 49,152: the head's logits
dominate, as they do at long context in a real model) trains one step per case, fp32, every
decoder layer recomputed. For each sequence length it prints, measured in one run:

- activation bytes per token at the step's peak: the engine with the tiled loss (its ledger's
  count of saved tensors), the engine with the model's own loss (full logits; the same count),
  and plain PyTorch with transformers' gradient checkpointing (the same count, taken by
  saved-tensor hooks around its forward and backward);
- step time, tiled against full (the engine both ways; warm-up step first, then the median of
  `--repeat` steps, interleaved).

    python bench/long_context.py [--seqs 4096,8192,16384] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "devtree"))

from tierwise.offload import Activations, Budget, Engine, Optim  # noqa: E402
from tierwise.offload.engine import headloss  # noqa: E402

VOCAB, HIDDEN, LAYERS = 49152, 64, 2


def config(seq: int):
    import transformers

    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                    num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=seq, use_cache=False)


def batch(seq: int) -> dict:
    x = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": x, "labels": x}


def engine(seq: int, tiled: bool) -> Engine:
    import transformers

    headloss.TILE_BYTES = headloss.HEAD_TILE_BYTES if tiled else 1 << 60
    torch.manual_seed(0)
    return Engine(transformers.LlamaForCausalLM(config(seq)), budget=Budget(chunk=4 << 20),
                  optim=Optim("adamw", lr=1e-4), activations=Activations(recompute=True))


def plain_saved_peak(seq: int) -> int:
    """Peak bytes of saved tensors (per storage) of plain PyTorch + gradient checkpointing."""
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config(seq)).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    live: dict[int, list[int]] = {}
    state = {"now": 0, "peak": 0}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in live:
            live[key] = [0, t.untyped_storage().nbytes()]
            state["now"] += live[key][1]
            state["peak"] = max(state["peak"], state["now"])
        live[key][0] += 1
        return key, t

    def unpack(packed):
        key, t = packed
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        loss = model(**batch(seq)).loss
    loss.backward()
    return state["peak"]


def run(seqs: list[int], repeat: int) -> list[dict]:
    rows = []
    for seq in seqs:
        b = batch(seq)
        peaks, times = {}, {"tiled": [], "full": []}
        engines = {k: engine(seq, k == "tiled") for k in ("tiled", "full")}
        for k, eng in engines.items():
            headloss.TILE_BYTES = headloss.HEAD_TILE_BYTES if k == "tiled" else 1 << 60
            eng.step(b)  # warm-up
        for _ in range(repeat):  # interleaved
            for k, eng in engines.items():
                headloss.TILE_BYTES = headloss.HEAD_TILE_BYTES if k == "tiled" else 1 << 60
                t = time.perf_counter()
                eng.step(b)
                times[k].append(time.perf_counter() - t)
        for k, eng in engines.items():
            peaks[k] = eng.ledger.kind_peak("gpu", "activation")
            eng.close()
        headloss.TILE_BYTES = headloss.HEAD_TILE_BYTES
        plain = plain_saved_peak(seq)
        row = {"seq": seq, "bytes_per_token": {"tiled": peaks["tiled"] / seq, "full": peaks["full"] / seq,
                                                 "plain_hf_checkpointing": plain / seq},
               "step_s": {k: statistics.median(v) for k, v in times.items()}}
        row["tiled_over_full_bytes"] = peaks["tiled"] / peaks["full"]
        row["tiled_over_plain_bytes"] = peaks["tiled"] / plain
        row["tiled_over_full_time"] = row["step_s"]["tiled"] / row["step_s"]["full"]
        rows.append(row)
        print(f"seq {seq:>6}: bytes/token tiled {row['bytes_per_token']['tiled']:,.0f}, full "
              f"{row['bytes_per_token']['full']:,.0f}, plain HF {row['bytes_per_token']['plain_hf_checkpointing']:,.0f}"
              f" (tiled/plain {row['tiled_over_plain_bytes']:.3f}); step tiled {row['step_s']['tiled']:.2f} s, "
              f"full {row['step_s']['full']:.2f} s (tiled/full {row['tiled_over_full_time']:.3f})", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", default="4096,8192,16384")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = run([int(s) for s in a.seqs.split(",")], a.repeat)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
