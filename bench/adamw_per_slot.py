"""Cost of exactness in the engine's fused AdamW: whole chunks vs per-parameter tensors.

torch's fused CPU AdamW rounds a tensor's last numel % 8 (AVX2) elements differently from its
body, so one flat tensor per chunk differs (~1e-8) from torch.optim.AdamW(fused=True) on every
parameter whose numel is not a multiple of 8. The engine (offload.update.update.fused_ranges) passes
such parameters as tensors of their own and merges the others into runs. This times one
optimizer pass over all chunks of a model three ways, alternating so drift hits all alike:
  whole chunk  one tensor per chunk (the engine before: not exact for odd sizes)
  per slot     one tensor per parameter (what torch's fused AdamW itself does)
  engine       fused_ranges: runs of multiple-of-16 parameters, odd ones alone
`--odd` adds one row to every parameter (every numel odd): the worst case for the engine.

    python bench/adamw_per_slot.py [--rounds 9] [--chunk-mib 64] [--threads N] [--odd]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from tierwise.offload.core.chunks import pack_chunks
from tierwise.offload.update.update import fused_ranges
from tierwise.profiles import load_model_profile


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--chunk-mib", type=float, default=64)
    ap.add_argument("--model", default="100m")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--odd", action="store_true", help="one more row in every parameter")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    specs = load_model_profile(args.model).param_specs()
    if args.odd:
        specs = [dataclasses.replace(s, shape=(s.shape[0] + 1,) + s.shape[1:]) for s in specs]
    plan = pack_chunks(specs, chunk_bytes=int(args.chunk_mib * (1 << 20)))
    hp = dict(amsgrad=False, lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, maximize=False)
    chunks = []
    for c in plan.chunks:
        n = c.numel
        kinds = (torch.randn(n), torch.randn(n) * 1e-3, torch.zeros(n), torch.zeros(n))  # master, grad, m, v
        slots = [(plan.slots[p].offset, plan.slots[p].numel) for p in c.params]
        chunks.append({"kinds": kinds, "step": torch.zeros(()), "whole chunk": [(0, n)], "per slot": slots,
                       "engine": fused_ranges(plan, c)})

    def run(mode: str) -> float:
        t0 = time.perf_counter()
        for ch in chunks:
            ch["step"] += 1
            ranges = ch[mode]
            p, g, m, v = ([t[o: o + k] for o, k in ranges] for t in ch["kinds"])
            torch._fused_adamw_(p, g, m, v, [], [ch["step"]] * len(ranges), **hp)
        return time.perf_counter() - t0

    modes = ("whole chunk", "per slot", "engine")
    times: dict[str, list[float]] = {m: [] for m in modes}
    for m in modes:
        run(m)  # warm up
    for _ in range(args.rounds):
        for m in modes:
            times[m].append(run(m))
    med = {m: statistics.median(v) for m, v in times.items()}
    tensors = {m: sum(len(ch[m]) for ch in chunks) for m in modes}
    print(f"{args.model}{' --odd' if args.odd else ''}: {plan.param_numel / 1e6:.1f}M params, {len(plan.slots)} "
          f"parameters in {len(plan.chunks)} chunks of <= {args.chunk_mib:g} MiB, {torch.get_num_threads()} threads")
    for m in modes:
        print(f"  {m:12s} {tensors[m]:4d} tensors  median {med[m] * 1e3:7.1f} ms  "
              f"(min {min(times[m]) * 1e3:.1f}, max {max(times[m]) * 1e3:.1f})  "
              f"{med[m] / med['whole chunk']:.3f}x whole chunk")


if __name__ == "__main__":
    main()
