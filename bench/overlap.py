"""Overlap of transfers with compute, on the simulated device with throttled links.

One model, three measurements in one run (interleaved, medians):
  compute-only   every chunk resident on the device: no transfer at all
  streamed       a gpu budget of --budget-frac of the model's fp32 bytes; host<->device links
                 throttled to --bandwidth bytes/s each way (full duplex, like PCIe)
  transfer-only  the streamed run's bytes over the links at that bandwidth: max(h2d, d2h) / bw
ratio = streamed / max(compute-only, transfer-only): 1.0 is perfect overlap (goal <= 1.10).
By default the bandwidth is set so that transfer-only equals compute-only (the balanced case,
the hardest one); a CPU computes ~100x slower than a GPU, so scaling the link to the compute
is what makes the figure mean what it would on a real GPU + PCIe.

    python bench/overlap.py [--layers 6] [--steps 3] [--bandwidth auto|BYTES_PER_S] [--link-factor 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def build(layers: int, seed: int = 0):
    from transformers import LlamaForCausalLM

    from tierwise.profiles import load_model_profile

    cfg = load_model_profile("100m").to_hf_config()
    cfg.num_hidden_layers = layers
    cfg.vocab_size = 8192
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def run(*, layers: int, steps: int, gpu: int | None, bandwidth: float | None, data: list) -> dict:
    from tierwise.offload import Budget, Engine, Optim, Streaming

    eng = Engine(build(layers), budget=Budget(gpu=gpu, chunk=16 << 20), optim=Optim(lr=1e-4),
                 streaming=Streaming(h2d_bandwidth=bandwidth, d2h_bandwidth=bandwidth))
    eng.step(data[0])  # warm-up: trace, placement
    h2d0, d2h0 = (eng.executor.lanes[k].link.bytes_moved for k in ("h2d", "d2h"))
    wait0 = eng.executor.wait_seconds
    times = []
    for x in data[1: steps + 1]:
        t0 = time.perf_counter()
        eng.step(x)
        times.append(time.perf_counter() - t0)
    h2d, d2h = (eng.executor.lanes[k].link.bytes_moved for k in ("h2d", "d2h"))
    out = {"step": statistics.median(times), "h2d": (h2d - h2d0) / steps, "d2h": (d2h - d2h0) / steps,
           "wait": (eng.executor.wait_seconds - wait0) / steps, "gpu_home": len(eng.device_plan.gpu_home),
           "chunks": len(eng.plan.chunks), "peak": eng.ledger.peaks()["gpu"]}
    eng.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--budget-frac", type=float, default=0.75)
    ap.add_argument("--bandwidth", default="auto")
    ap.add_argument("--link-factor", type=float, default=1.0,
                    help="with --bandwidth auto: links this many times faster than balanced")
    a = ap.parse_args()
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": (x := torch.randint(0, 8192, (4, 128), generator=g)), "labels": x}
            for _ in range(a.steps + 1)]
    model_bytes = sum(p.numel() for p in build(a.layers).parameters()) * 4
    gpu = int(model_bytes * a.budget_frac)
    compute, streamed, bw = [], [], None
    for r in range(a.rounds):
        compute.append(run(layers=a.layers, steps=a.steps, gpu=None, bandwidth=None, data=data))
        if bw is None:  # calibrate: an unthrottled streamed run gives the bytes per step
            probe = run(layers=a.layers, steps=1, gpu=gpu, bandwidth=None, data=data)
            bw = (a.link_factor * max(probe["h2d"], probe["d2h"]) / compute[-1]["step"]
                  if a.bandwidth == "auto" else float(a.bandwidth))
        streamed.append(run(layers=a.layers, steps=a.steps, gpu=gpu, bandwidth=bw, data=data))
        print(f"round {r}: compute-only {compute[-1]['step']:.3f} s, streamed {streamed[-1]['step']:.3f} s",
              flush=True)
    c = statistics.median(x["step"] for x in compute)
    s = statistics.median(x["step"] for x in streamed)
    last = streamed[-1]
    t = max(last["h2d"], last["d2h"]) / bw
    print(f"\nmodel {model_bytes / 2**20:.0f} MiB fp32, gpu budget {gpu / 2**20:.0f} MiB "
          f"({a.budget_frac:.0%}), {last['gpu_home']}/{last['chunks']} chunks gpu-home, peak {last['peak'] / 2**20:.0f} MiB")
    print(f"links {bw / 1e9:.3f} GB/s each way; per step h2d {last['h2d'] / 2**20:.0f} MiB, "
          f"d2h {last['d2h'] / 2**20:.0f} MiB; compute thread waited {last['wait']:.3f} s/step")
    print(f"compute-only {c:.3f} s, transfer-only {t:.3f} s, streamed {s:.3f} s")
    print(f"ratio streamed / max(compute, transfer) = {s / max(c, t):.3f}  (goal <= 1.10)")


if __name__ == "__main__":
    main()
