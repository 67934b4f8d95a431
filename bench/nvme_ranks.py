"""NVMe I/O threads of L local ranks: divided (threads_per_rank(L) per direction each, the
engine's) vs undivided (each rank one store's 4), node-wide GB/s, interleaved round by round.

L processes start together (a barrier); each writes then reads its 1/L of `--total` through
its own NvmeStore in `--chunk` pieces, `--window` of them in flight (what the executor does).
Node GB/s per direction: all ranks' bytes over the time from the first start to the last end.
Prints each round and the median ratio divided / undivided per direction (goal: >= 0.95, with
fewer threads and bounce buffers).

    python bench/nvme_ranks.py [--ranks 2] [--total 1G] [--chunk 64M] [--rounds 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import tempfile
import time

from tierwise.offload.core.sizes import parse_size
from tierwise.offload.runtime.aligned import aligned_empty
from tierwise.offload.runtime.nvme import DEFAULT_THREADS, NvmeStore, threads_per_rank


def _rank(directory: str, threads: int, nbytes: int, chunk: int, window: int, barrier, out) -> None:
    bufs = [aligned_empty(chunk) for _ in range(window)]
    for b in bufs:
        b.fill_(7)
    with NvmeStore(directory, threads=threads) as store:
        times = []
        for write in (True, False):
            op = store.write_async if write else store.read_async
            barrier.wait()
            start, inflight = time.perf_counter(), []
            for i in range(nbytes // chunk):
                if len(inflight) == window:
                    inflight.pop(0).result()
                inflight.append(op(f"c{i}", bufs[i % window]))
            for f in inflight:
                f.result()
            times.append((start, time.perf_counter()))
        out.put(times)


def node_gbps(ranks: int, threads: int, args, total: int, chunk: int) -> tuple[float, float]:
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(ranks), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(args.dir, threads, total // ranks, chunk, args.window, barrier, out))
             for _ in range(ranks)]
    for p in procs:
        p.start()
    got = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    moved = (total // ranks // chunk) * chunk * ranks
    return tuple(moved / (max(t[d][1] for t in got) - min(t[d][0] for t in got)) / 1e9 for d in (0, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--total", default="1G")
    ap.add_argument("--chunk", default="64M")
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()
    total, chunk = parse_size(args.total), parse_size(args.chunk)
    divided, alone = threads_per_rank(args.ranks), DEFAULT_THREADS
    ratios: dict[str, list[float]] = {"write": [], "read": []}
    for r in range(args.rounds):
        order = [divided, alone] if r % 2 == 0 else [alone, divided]
        res = {t: node_gbps(args.ranks, t, args, total, chunk) for t in order}
        for d, name in enumerate(("write", "read")):
            ratios[name].append(res[divided][d] / res[alone][d])
        print(f"round {r}: {args.ranks} ranks x {divided} threads: write {res[divided][0]:.2f} read "
              f"{res[divided][1]:.2f} GB/s; x {alone} threads: write {res[alone][0]:.2f} read {res[alone][1]:.2f} GB/s",
              flush=True)
    print(f"median ratio divided/undivided: write {statistics.median(ratios['write']):.2f}, "
          f"read {statistics.median(ratios['read']):.2f} ({args.ranks} ranks, {args.total} in {args.chunk} chunks)")


if __name__ == "__main__":
    main()
