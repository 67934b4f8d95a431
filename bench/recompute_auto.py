"""The engine's own recompute choice (Activations(recompute=None), the Trainer's default) vs
recomputing every layer, where the whole model fits the device.

On the simulated device, a Llama of the 100M shape (`--layers` decoder layers, fp32, full
fine-tune, AdamW, batch x seq tokens), gpu budget `--gpu-mem`. Two engines side by side in one
process, stepped in turn (who goes first rotates each round), after warm-up steps: one left to
choose (its warm-up recomputes every layer and measures what each saves; then it keeps the last
layers' activations where every chunk stays on the device beside them), one told to recompute
every layer. Both are bit-equal to plain PyTorch (tests/test_recompute_auto.py). Prints what the
engine chose, the median step of each and their ratio (auto / all), and the activation peak
measured after the warm-up against what the engine placed for.

    PYTHONPATH=tests/devtree python bench/recompute_auto.py [--layers 8] [--gpu-mem 4G] [--steps 6]
        [--warmup 2] [--batch 2 --seq 256] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from recompute_share import build, step_in_turn


def main() -> None:
    from tierwise.offload import Engine, flat_options

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=8 << 20)
    ap.add_argument("--gpu-mem", default="4G")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(2)
    batches = [{"input_ids": (ids := torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)), "labels": ids}
               for _ in range(a.warmup + a.steps)]
    engines = {k: Engine(build(a), **flat_options(lr=1e-4, chunk_bytes=a.chunk, gpu_mem=a.gpu_mem, checkpointing=r))
               for k, r in (("all", True), ("auto", None))}
    times, losses = step_in_turn(engines, batches, a.warmup, reset_peaks=True)
    assert losses["all"] == losses["auto"], losses
    out = {"layers": a.layers, "batch": a.batch, "seq": a.seq, "gpu_budget": a.gpu_mem}
    for k, eng in engines.items():
        out[f"{k}_recomputed"] = eng.recomputed
        out[f"{k}_every_chunk_on_device"] = len(eng.device_plan.gpu_home) == len(eng.plan.chunks)
        out[f"{k}_step_s"] = statistics.median(times[k])
        out[f"{k}_activations_measured"] = eng.ledger.kind_peak("gpu", "activation")
        out[f"{k}_activations_placed"] = eng.needs.activations
        out[f"{k}_gpu_peak"] = eng.ledger.peaks()["gpu"]
        eng.close()
    out["ratio"] = out["auto_step_s"] / out["all_step_s"]
    print(f"--gpu-mem {a.gpu_mem}: every chunk on the device: {out['auto_every_chunk_on_device']}; the engine "
          f"recomputes {out['auto_recomputed']} of {a.layers} layers")
    for k in engines:
        print(f"{k:5s} step {out[f'{k}_step_s']:.3f} s (median of {len(times[k])}), activations "
              f"{out[f'{k}_activations_measured'] / 2**20:.2f} MiB measured / "
              f"{out[f'{k}_activations_placed'] / 2**20:.2f} placed, gpu peak {out[f'{k}_gpu_peak'] / 2**20:.1f} MiB")
    print(f"auto / all: {out['ratio']:.3f} (losses equal)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
