"""LoRA over a streamed frozen base vs the same LoRA step fully resident (benchmark 1).

On the simulated device, one model, per base dtype (bf16, nf4) three engines side by side in
one process, stepped in turn (who goes first rotates each round), after warm-up steps:
  resident  unlimited gpu budget: every chunk (base and adapters) gpu-home, no transfer
  host      the base lives in host memory and streams over the host->device link, throttled
            to the link bandwidth (a DMA engine: the copy sleeps out nbytes / bandwidth)
  nvme      the base lives on NVMe (--nvme-path, a real O_DIRECT swap file) behind the same
            link; NVMe reads are throttled too, to --nvme-bandwidth (a shared drive: reads
            queue behind each other)
ratio = median step(streamed) / median step(resident); goal <= 1.15.

Links are scaled to this CPU: a CPU computes ~100-1000x slower than a GPU, so a real PCIe
figure would make every run transfer-bound for the wrong reason. By default (--link-factor 1)
the host->device bandwidth is *balanced*: the bf16 host run's base bytes per step move in
exactly the resident step's time (transfer-only == compute-only, the hardest case for
overlap); --link-factor 2 makes the link twice that. NVMe reads are balanced the same way
(--nvme-bandwidth defaults to the link's bandwidth): on real hardware a drive is ~3.5x slower
than PCIe 4 x16 (7 vs 25 GB/s), so a base on NVMe needs ~3.5x the compute per step (a larger
micro-batch x grad-accum) to be balanced; the figure here is that balanced case.

    PYTHONPATH=tests/devtree python bench/lora_stream.py [--layers 6] [--steps 5] [--warmup 2]
        [--batch 4 --seq 128] [--rank 16] [--link-factor 1] [--nvme-path /tmp]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time

import torch


def build(layers: int, vocab: int, seed: int = 0):
    from transformers import LlamaForCausalLM

    from tierwise.profiles import load_model_profile

    cfg = load_model_profile("100m").to_hf_config()
    cfg.num_hidden_layers, cfg.vocab_size = layers, vocab
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


class DriveThrottle:
    """One drive's read bandwidth shared by the store's I/O threads: each block read books
    nbytes / bandwidth of drive time after the bookings before it and sleeps until its end."""

    def __init__(self, bandwidth: float):
        self.bandwidth, self.lock, self.free = bandwidth, threading.Lock(), 0.0

    def install(self, store) -> None:
        real = store._io

        def io(req, buf, offset):
            start = time.perf_counter()
            real(req, buf, offset)
            if not req.write and self.bandwidth:
                with self.lock:
                    begin = max(start, self.free)
                    self.free = end = begin + buf.numel() / self.bandwidth
                left = end - time.perf_counter()
                if left > 0:
                    time.sleep(left)

        store._io = io


def make_at_minimum(kind: str, base_dtype: str, a, swap: str, first: dict):
    """The engine with (about) the smallest gpu budget its warm-up step accepts (streamed runs),
    times --budget-factor, warmed up: each refusal names a minimum (InfeasibleBudget.minimum),
    the activations counted so far in it; the next try asks for it, or 1.2x the last."""
    from tierwise.offload.core.errors import InfeasibleBudget
    from tierwise.offload.core.sizes import parse_size

    if kind == "resident":
        eng = make(kind, base_dtype, a, None, swap)
        eng.step(first)
        return eng
    a.gpu_mem = getattr(a, "gpu_mem", None) or 1 << 20  # the last run's, else 1 MiB
    for _ in range(20):  # each refusal names a larger minimum, until one step fits
        eng = None
        try:
            eng = make(kind, base_dtype, a, None, swap)
            eng.step(first)
            return eng
        except InfeasibleBudget as e:
            if eng is not None:
                eng.close()
            last = e
            if "host" in e.minimum:  # the NVMe run's host budget: at least its bounce buffers
                a.cpu_mem = max(e.minimum["host"], parse_size(a.cpu_mem))
            if "gpu" in e.minimum or "host" not in e.minimum:
                a.gpu_mem = max(int(e.minimum.get("gpu", 0) * a.budget_factor), int(a.gpu_mem * 1.2))
    raise RuntimeError(f"no budget found: {last}")


def make(kind: str, base_dtype: str, a, nvme_bw: float | None, swap: str):
    from peft import LoraConfig

    from tierwise.offload import Engine, flat_options

    lora = LoraConfig(r=a.rank, lora_alpha=2 * a.rank, target_modules="all-linear")
    kw = dict(lr=1e-4, chunk_bytes=a.chunk_mib << 20, lora=lora, base_dtype=base_dtype,
              checkpointing=False)
    if kind == "resident":
        eng = Engine(build(a.layers, a.vocab), **flat_options(gpu_mem=None, **kw))
    elif kind == "host":
        eng = Engine(build(a.layers, a.vocab), **flat_options(gpu_mem=a.gpu_mem, **kw))
    else:
        eng = Engine(build(a.layers, a.vocab), **flat_options(gpu_mem=a.gpu_mem, cpu_mem=a.cpu_mem,
                     nvme_path=swap, **kw))
        eng.throttle = DriveThrottle(nvme_bw)
        eng.throttle.install(eng.nvme)
    return eng


def where(eng) -> str:
    """Base (frozen) bytes per tier, and how many chunks are gpu-home."""
    tiers: dict[str, int] = {}
    for c in eng.plan.frozen:
        ch = eng.store.chunks[c]
        tier = "gpu" if c in eng.device_plan.gpu_home else ch.tiers["compute"]
        tiers[tier] = tiers.get(tier, 0) + ch.compute.nbytes
    return ", ".join(f"{t} {b / 2**20:.0f} MiB" for t, b in sorted(tiers.items()))


def link_bytes(eng) -> int:
    return eng.executor.lanes["h2d"].link.bytes_moved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--chunk-mib", type=int, default=4)
    ap.add_argument("--budget-factor", type=float, default=1.0,
                    help="gpu budget of the streamed runs: this times the engine's minimum")
    ap.add_argument("--cpu-mem", default="12M", help="host budget of the NVMe runs (bounce buffers; the base does not fit)")
    ap.add_argument("--link-factor", type=float, default=1.0)
    ap.add_argument("--bandwidth", type=float, default=None, help="h2d bytes/s (overrides auto)")
    ap.add_argument("--nvme-bandwidth", type=float, default=None)
    ap.add_argument("--nvme-path", default=None)
    ap.add_argument("--dtypes", default="bf16,nf4")
    a = ap.parse_args()
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": (x := torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)),
             "labels": x} for _ in range(a.warmup + a.steps)]
    swap = tempfile.mkdtemp(prefix="lora-stream-", dir=a.nvme_path)
    results = {}
    for dtype in a.dtypes.split(","):
        engines = {k: make_at_minimum(k, dtype, a, swap, data[0])
                   for k in ("resident", "host", "nvme")}
        for eng in engines.values():  # warm-up unthrottled: trace, placement, page cache
            for x in data[1: a.warmup]:
                eng.step(x)
        if dtype == a.dtypes.split(",")[0] or a.bandwidth:  # calibrate once, on the first dtype
            if a.bandwidth:
                bw = a.bandwidth
            else:
                t0, b0 = time.perf_counter(), link_bytes(engines["host"])
                engines["host"].step(data[0])
                moved = link_bytes(engines["host"]) - b0
                t0 = time.perf_counter()
                engines["resident"].step(data[0])
                bw = a.link_factor * moved / (time.perf_counter() - t0)
            nvme_bw = a.nvme_bandwidth or bw
        engines["nvme"].throttle.bandwidth = nvme_bw
        for kind in ("host", "nvme"):
            lanes = engines[kind].executor.lanes
            lanes["h2d"].link.bandwidth = lanes["d2h"].link.bandwidth = bw
        times = {k: [] for k in engines}
        moved = {k: 0 for k in engines}
        order = list(engines)
        load0 = os.getloadavg()[0]
        for i, x in enumerate(data[a.warmup:]):
            for k in order[i % 3:] + order[: i % 3]:
                b0 = link_bytes(engines[k])
                t0 = time.perf_counter()
                engines[k].step(x)
                times[k].append(time.perf_counter() - t0)
                moved[k] += link_bytes(engines[k]) - b0
        load1 = os.getloadavg()[0]
        med = {k: statistics.median(v) for k, v in times.items()}
        results[dtype] = med
        print(f"\nbase {dtype}: link {bw / 1e6:.0f} MB/s each way, NVMe reads {nvme_bw / 1e6:.0f} MB/s; "
              f"load average {load0:.1f} -> {load1:.1f}")
        for k, eng in engines.items():
            print(f"  {k:9s} step {med[k]:.3f} s (min {min(times[k]):.3f}, max {max(times[k]):.3f})"
                  f"  h2d {moved[k] / len(times[k]) / 2**20:6.1f} MiB/step  base: {where(eng)}"
                  f"  gpu peak {eng.ledger.peaks()['gpu'] / 2**20:.0f} MiB"
                  + (f" of {eng.ledger.budgets['gpu'] / 2**20:.0f} MiB" if k != "resident" else ""))
        for k in ("host", "nvme"):
            print(f"  ratio {k}/resident = {med[k] / med['resident']:.3f}  (goal <= 1.15)")
        for eng in engines.values():
            eng.close()
    params = sum(p.numel() for p in build(a.layers, a.vocab).parameters())
    print(f"\nmodel: 100m-profile Llama, {a.layers} layers, vocab {a.vocab}: {params / 1e6:.1f}M base "
          f"params; LoRA r={a.rank} all-linear; batch {a.batch} x {a.seq}; fp32 compute; "
          f"{a.steps} timed steps after {a.warmup} warm-up, engines interleaved; 2 threads")


if __name__ == "__main__":
    main()
