"""A recomputed block's MLP in sequence tiles against untiled, on the CPU, side by side.

A tiny Llama whose MLP dominates (hidden 128, intermediate 4096, 2 layers, vocabulary 1024),
fp32, every decoder layer recomputed, one row of `--seq` tokens. Interleaved (A/B/A/B...) so
machine drift hits both alike, it prints for tiles of `--tile-mb` MiB (offload.engine.tiled)
and untiled:
- the activation bytes the step held at its peak (the engine's ledger: every saved tensor),
  per token, and what the planner says (offload.plan.perfmodel.activation_bytes);
- the step time (median of `--repeat` steps after a warm-up) and tiled / untiled (asked: <= 1.05).

    python bench/tiled_mlp.py [--seq 8192] [--tile-mb 32] [--repeat 3] [--json out.json]
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

from tierwise.offload import Activations, Budget, Engine  # noqa: E402
from tierwise.offload.plan import perfmodel  # noqa: E402
from tierwise.profiles import ModelProfile  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--tile-mb", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import transformers

    profile = ModelProfile(name="wide-mlp", family="llama", hidden_size=128, intermediate_size=4096,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                           max_position_embeddings=a.seq, rope_theta=10000.0, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(profile.to_hf_config())
    x = torch.randint(0, profile.vocab_size, (1, a.seq), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": x, "labels": x}
    cases = {"tiled": a.tile_mb << 20, "untiled": 1 << 50}
    engines, out = {}, {}
    import copy

    for name, tile_bytes in cases.items():
        perfmodel.MLP_TILE_BYTES = tile_bytes
        planned = perfmodel.activation_bytes(model=profile, batch_size=1, seq_len=a.seq, precision="fp32",
                                             checkpointing=True)
        # placed up front for the planned activations, as finetune does (the blocks are the units
        # from the first step, so the MLPs tile in it)
        engines[name] = Engine(copy.deepcopy(base), budget=Budget(chunk=4 << 20),
                               activations=Activations(recompute=True, expected=planned))
        engines[name].step(batch)  # warm-up
        out[name] = {"measured_bytes": engines[name].ledger.kind_peak("gpu", "activation"), "planned_bytes": planned,
                     "times": [], "losses": []}
    for _ in range(a.repeat):
        for name, tile_bytes in cases.items():
            perfmodel.MLP_TILE_BYTES = tile_bytes
            t0 = time.perf_counter()
            out[name]["losses"].append(engines[name].step(batch))
            out[name]["times"].append(time.perf_counter() - t0)
    for e in engines.values():
        e.close()
    tile_tokens = perfmodel.mlp_tile_tokens(4096, 4, 1, a.tile_mb << 20)
    print(f"{a.seq} tokens, MLP tiles of {a.tile_mb} MiB = {tile_tokens} tokens "
          f"({-(-a.seq // tile_tokens)} tiles), fp32, 2 layers recomputed")
    for name, r in out.items():
        r["step_s"] = statistics.median(r["times"])
        print(f"  {name:8s} activations {r['measured_bytes'] / a.seq:9,.0f} B/token (planned "
              f"{r['planned_bytes'] / a.seq:9,.0f}), step {r['step_s']:.3f} s, losses {[round(v, 5) for v in r['losses']]}")
    ratio = out["tiled"]["step_s"] / out["untiled"]["step_s"]
    less = out["untiled"]["measured_bytes"] / out["tiled"]["measured_bytes"]
    print(f"tiled / untiled: step {ratio:.3f} (asked <= 1.05), activations 1/{less:.1f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"seq": a.seq, "tile_mb": a.tile_mb, "tile_tokens": tile_tokens, **out,
                                            "step_ratio": ratio, "activation_ratio": less}, indent=1))


if __name__ == "__main__":
    main()
