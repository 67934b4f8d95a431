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

import torch

from recompute_share import build, engine_figures, print_row, save_json, step_in_turn


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
    times, losses = step_in_turn(engines, batches, a.warmup, at_warmup=lambda k, e: e.ledger.reset_peaks())
    assert losses["all"] == losses["auto"], losses
    out = {"layers": a.layers, "batch": a.batch, "seq": a.seq, "gpu_budget": a.gpu_mem}
    for k, eng in engines.items():
        engine_figures(out, k, eng, times[k])
        out[f"{k}_recomputed"] = eng.recomputed
        out[f"{k}_every_chunk_on_device"] = len(eng.device_plan.gpu_home) == len(eng.plan.chunks)
        out[f"{k}_activations_placed"] = eng.needs.activations
        eng.close()
    out["ratio"] = out["auto_step_s"] / out["all_step_s"]
    print(f"--gpu-mem {a.gpu_mem}: every chunk on the device: {out['auto_every_chunk_on_device']}; the engine "
          f"recomputes {out['auto_recomputed']} of {a.layers} layers")
    for k in engines:
        print_row(out, k, len(times[k]), "placed")
    print(f"auto / all: {out['ratio']:.3f} (losses equal)")
    save_json(a.json, out)


if __name__ == "__main__":
    main()
