"""NvmeStore read/write bandwidth against fio (libaio, direct=1, bs=1M, iodepth=32).

Both run in the same directory on the same amount of data, interleaved round by round (even
rounds: ours write, fio write, ours read, fio read; odd rounds: fio first), so drift of a
shared disk hits both alike. Prints GB/s
and the ratio ours/fio per direction (goal: >= 0.95).

    python bench/nvme_vs_fio.py [--dir /tmp/tierwise-bench] [--total 4G] [--chunk 64M]
    python bench/nvme_vs_fio.py --sweep --total 1G      # pick threads / block size

Ours streams chunks through a window of `--window` chunk buffers in flight (what the
executor does), not 4 GiB of RAM. fio: `apt-get update && apt-get install -y fio`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from tierwise.offload.runtime.aligned import aligned_empty
from tierwise.offload.runtime.nvme import DEFAULT_BLOCK_SIZE, DEFAULT_THREADS, NvmeStore
from tierwise.offload.core.units import format_size
from tierwise.offload.core.sizes import parse_size


def run_ours(store: NvmeStore, bufs: list, *, nchunks: int, write: bool) -> float:
    """GB/s of writing (or reading) nchunks chunks, len(bufs) of them in flight."""
    op = store.write_async if write else store.read_async
    inflight: list = []
    start = time.perf_counter()
    for i in range(nchunks):
        if len(inflight) == len(bufs):
            inflight.pop(0).result()
        inflight.append(op(f"c{i}", bufs[i % len(bufs)]))
    for fut in inflight:
        fut.result()
    seconds = time.perf_counter() - start
    return nchunks * bufs[0].numel() / seconds / 1e9


def run_fio(directory: str, *, total: int, write: bool) -> float:
    os.makedirs(directory, exist_ok=True)
    cmd = [
        "fio", "--name=tierwise", f"--directory={directory}", "--filename=fio.dat",
        f"--size={total}", "--bs=1M", "--iodepth=32", "--ioengine=libaio", "--direct=1",
        f"--rw={'write' if write else 'read'}", "--output-format=json",
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    return job["write" if write else "read"]["bw_bytes"] / 1e9


def sweep(args: argparse.Namespace, total: int, chunk: int) -> None:
    nchunks = total // chunk
    print(f"sweep: {format_size(total)} in {format_size(chunk)} chunks, window {args.window}")
    print(f"{'threads':>7} {'block':>9} {'write GB/s':>10} {'read GB/s':>9}")
    for threads in (1, 2, 4, 8):
        for block in (1 << 20, 4 << 20, 8 << 20, 16 << 20):
            with NvmeStore(args.dir, threads=threads, block_size=block) as store:
                bufs = [aligned_empty(chunk).fill_(7) for _ in range(args.window)]
                run_ours(store, bufs, nchunks=nchunks, write=True)  # preallocate + warm
                w = run_ours(store, bufs, nchunks=nchunks, write=True)
                r = run_ours(store, bufs, nchunks=nchunks, write=False)
            print(f"{threads:>7} {format_size(block):>9} {w:>10.2f} {r:>9.2f}", flush=True)


def compare(args: argparse.Namespace, total: int, chunk: int) -> None:
    nchunks = total // chunk
    results: dict[str, list[float]] = {k: [] for k in ("ours_w", "fio_w", "ours_r", "fio_r")}
    with NvmeStore(args.dir, threads=args.threads, block_size=args.block_size) as store:
        bufs = [aligned_empty(chunk).fill_(7) for _ in range(args.window)]
        run_ours(store, bufs, nchunks=nchunks, write=True)  # first write: preallocates
        for rnd in range(args.rounds):
            who_first = ("ours", "fio") if rnd % 2 == 0 else ("fio", "ours")  # ABBA order
            for d, write in (("w", True), ("r", False)):
                for who in who_first:
                    gbps = (run_ours(store, bufs, nchunks=nchunks, write=write) if who == "ours"
                            else run_fio(args.dir, total=total, write=write))
                    results[f"{who}_{d}"].append(gbps)
            print(f"round {rnd}: " + "  ".join(f"{k} {v[-1]:.2f}" for k, v in results.items()),
                  flush=True)
        stats = store.stats
    os.unlink(os.path.join(args.dir, "fio.dat"))
    try:
        os.rmdir(args.dir)
    except OSError:
        pass  # not empty: not only ours
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"\n{format_size(total)} in {format_size(chunk)} chunks, threads={args.threads}, "
          f"block={format_size(args.block_size)}, window={args.window}, rounds={args.rounds} "
          f"(medians; the disk is shared, expect drift)")
    for d, name in (("w", "write"), ("r", "read")):
        ours, fio = med[f"ours_{d}"], med[f"fio_{d}"]
        paired = statistics.median(o / f for o, f in zip(results[f"ours_{d}"], results[f"fio_{d}"]))
        print(f"{name:>5}: ours {ours:5.2f} GB/s   fio {fio:5.2f} GB/s   ours/fio {ours / fio:.2f}"
              f"   (median of per-round ratios {paired:.2f})")
    print(f"engine stats: {stats.bytes_written / 1e9:.1f} GB written at {stats.write_gbps:.2f} "
          f"GB/s busy, {stats.bytes_read / 1e9:.1f} GB read at {stats.read_gbps:.2f} GB/s busy")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/tmp/tierwise-bench")
    p.add_argument("--total", default="4G")
    p.add_argument("--chunk", default="64M")
    p.add_argument("--window", type=int, default=4, help="chunks in flight")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    p.add_argument("--block-size", type=parse_size, default=DEFAULT_BLOCK_SIZE)
    p.add_argument("--sweep", action="store_true", help="measure threads x block size, no fio")
    args = p.parse_args()
    total, chunk = parse_size(args.total), parse_size(args.chunk)
    if args.sweep:
        sweep(args, total, chunk)
        return
    if shutil.which("fio") is None:
        sys.exit("fio not found: install it with `apt-get update && apt-get install -y fio`")
    compare(args, total, chunk)


if __name__ == "__main__":
    main()
