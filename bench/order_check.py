"""The cost of checking the order of per-chunk collectives (offload.engine.ranks: a [world, 3]
int64 all-reduce before each chunk's reduce/broadcast), on 2 gloo ranks (processes on this CPU).

1. One chunk's reduce onto its owner, unchecked (dist.reduce) vs checked (Ranks.reduce_grad),
   interleaved, per chunk size: the median seconds of each and their ratio.
2. The engine's step on a tiny model with small chunks (many collectives for little work: the
   check's worst case), with the check vs without it (patched out), interleaved step by step.

    python bench/order_check.py [--reps 30] [--steps 6]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

SIZES = (16 << 10, 256 << 10, 4 << 20)  # fp32 elements: 64 KiB, 1 MiB, 16 MiB chunks


def _worker(rank: int, world: int, reps: int, steps: int, tmp: str) -> None:
    from tierwise.offload import Budget, Engine, Optim
    from tierwise.offload.engine.ranks import Ranks
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{Path(tmp) / 'rendezvous'}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    out: dict = {"reduce": {}, "engine": {}}
    try:
        ranks = Ranks(dist.group.WORLD, trainable=[0, 1])
        for numel in SIZES:
            buf, times = torch.ones(numel), {"plain": [], "checked": []}
            for _ in range(reps):
                for how in ("plain", "checked"):
                    dist.barrier(group=ranks.grad_group)
                    t0 = time.perf_counter()
                    if how == "plain":
                        dist.reduce(buf, dst=0, group=ranks.grad_group)
                    else:
                        ranks.reduce_grad(0, buf)
                    times[how].append(time.perf_counter() - t0)
            out["reduce"][numel] = {k: statistics.median(v) for k, v in times.items()}
        ranks.close()

        cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        g = torch.Generator().manual_seed(1)
        data = [{"input_ids": (x := torch.randint(0, 256, (2 * world, 16), generator=g)), "labels": x.clone()}
                for _ in range(steps + 1)]
        engines = {}
        for how in ("plain", "checked"):
            torch.manual_seed(0)
            engines[how] = Engine(LlamaForCausalLM(cfg), budget=Budget(chunk=16 << 10), optim=Optim(lr=1e-3))
            engines[how].step(data[0])  # warm-up: trace, placement
        engines["plain"].ranks._check_order = lambda *a, **k: None  # the unchecked engine
        times = {"plain": [], "checked": []}
        for b in data[1:]:
            for how in ("plain", "checked"):
                dist.barrier()
                t0 = time.perf_counter()
                engines[how].step(b)
                times[how].append(time.perf_counter() - t0)
        out["engine"] = {k: statistics.median(v) for k, v in times.items()}
        out["chunks"] = len(engines["checked"].plan.chunks)
        for e in engines.values():
            e.close()
        if rank == 0:
            torch.save(out, Path(tmp) / "results.pt")
    finally:
        dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="tierwise-order-")
    mp.start_processes(_worker, args=(2, args.reps, args.steps, tmp), nprocs=2, start_method="spawn")
    r = torch.load(Path(tmp) / "results.pt")
    print("one chunk's reduce (median s): unchecked, checked, ratio")
    for numel, t in r["reduce"].items():
        print(f"  {4 * numel >> 10:>6} KiB  {t['plain']:.6f}  {t['checked']:.6f}  {t['checked'] / t['plain']:.3f}")
    e = r["engine"]
    print(f"engine step, {r['chunks']} chunks of 16 KiB (median s): unchecked {e['plain']:.4f}, "
          f"checked {e['checked']:.4f}, ratio {e['checked'] / e['plain']:.3f}")


if __name__ == "__main__":
    main()
