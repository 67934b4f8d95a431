"""CPU optimizer-step throughput and state bytes/param, side by side with peers.

    python bench/optim_bench.py [--numel 100000000] [--lowrank-shape 2048 1280] [--threads 2]

Warm-up step first, repeats interleaved across optimizers (DeepSpeedCPUAdam too, when
importable: run it in bench/.ds-venv), medians reported with the ratio to
torch's fused AdamW, in wall time and in process CPU time (the latter is what to compare on a
shared, oversubscribed host). Low-rank optimizers run on one matrix (SVD of 100M params per refresh is
not a step-time question); their projector refresh is timed separately.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from tierwise.optim import AdamW, AdamW8bit, ApolloAdamW, ApolloMini, GaLoreAdamW, GaLoreAdamW8bit, perturb_
from tierwise.optim.mezo import mezo_update_


def state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for s in opt.state.values() if isinstance(s, dict)
               for v in s.values() if torch.is_tensor(v))


def make(kind: str, shape: tuple[int, ...], cls, **kw):
    p = torch.nn.Parameter(torch.randn(shape) * 0.02)
    p.grad = torch.randn(shape) * 1e-3
    group = {"params": [p]}
    if kind == "lowrank":
        group["rank"] = kw.pop("rank")
    opt = cls([group], **kw)
    return p, opt


class MeZOSteps:
    """The parameter passes of one MeZO step (perturb +, -2, +, update); forwards not included."""

    def __init__(self, groups: list[dict]) -> None:
        self.p, self.state = groups[0]["params"][0], {}

    def step(self) -> None:
        for scale in (1e-3, -2e-3, 1e-3):
            perturb_(self.p.data, seed=1, scale=scale)
        mezo_update_(self.p.data, seed=1, projected_grad=0.1, lr=1e-6, weight_decay=0.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=100_000_000)
    ap.add_argument("--lowrank-shape", type=int, nargs=2, default=(2048, 1280))
    ap.add_argument("--rank", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--core", action="store_true",
                    help="only the flat-tensor AdamWs (torch fused, ours fp32 and 8-bit, DeepSpeedCPUAdam)")
    ap.add_argument("--processes", type=int, default=0,
                    help="then repeat the core set in this many fresh processes and print the median of "
                         "their ratios (memory placement, hence bandwidth, differs from process to process)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n, lr_shape = args.numel, tuple(args.lowrank_shape)
    print(f"torch {torch.__version__}, {args.threads} threads, flat tensor {n / 1e6:.0f}M, "
          f"low-rank matrix {lr_shape} rank {args.rank}")

    runs = {}  # name -> (numel, step callable, optimizer or None)
    p, o = make("flat", (n,), torch.optim.AdamW, lr=1e-3, fused=True)
    runs["torch AdamW fused"] = (n, o.step, o)
    p, o = make("flat", (n,), AdamW, lr=1e-3)
    runs["tierwise AdamW (fp32)"] = (n, o.step, o)
    p, o = make("flat", (n,), AdamW8bit, lr=1e-3)
    runs["tierwise AdamW8bit"] = (n, o.step, o)
    try:  # interleaved with the rest: both are memory-bound, and bandwidth drifts over minutes
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        p, o = make("flat", (n,), DeepSpeedCPUAdam, lr=1e-3)
        runs["DeepSpeedCPUAdam"] = (n, o.step, o)
    except Exception as exc:  # not a dependency: any import/build failure just skips it
        print(f"  DeepSpeedCPUAdam skipped: {type(exc).__name__}: {str(exc)[:80]}")
    if not args.core:
        p, o = make("flat", (n,), MeZOSteps)
        runs["tierwise MeZO (4 passes)"] = (n, o.step, None)
    m = lr_shape[0] * lr_shape[1]
    for name, cls in [] if args.core else [("GaLoreAdamW", GaLoreAdamW), ("GaLoreAdamW8bit", GaLoreAdamW8bit),
                      ("ApolloAdamW", ApolloAdamW), ("ApolloMini", ApolloMini)]:
        p, o = make("lowrank", lr_shape, cls, lr=1e-3, rank=args.rank, update_proj_gap=10**9)
        t0 = time.perf_counter()
        o.step()  # first step includes the projector (SVD / random) build
        print(f"  {name}: first step incl. projector {time.perf_counter() - t0:.3f} s")
        runs[f"tierwise {name} (matrix)"] = (m, o.step, o)
    if not args.core:
        p, o = make("flat", lr_shape, torch.optim.AdamW, lr=1e-3, fused=True)
        runs["torch AdamW fused (matrix)"] = (m, o.step, o)

    times: dict[str, list[float]] = {k: [] for k in runs}
    cpu: dict[str, list[float]] = {k: [] for k in runs}  # process CPU time: robust to a busy host
    for _, step, _ in runs.values():
        step()  # warm-up
    for _ in range(args.repeats):
        for name, (_, step, _) in runs.items():
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)

    extra = {}
    try:
        if args.core:
            raise ImportError
        import bitsandbytes as bnb

        p, o = make("flat", (n,), bnb.optim.AdamW8bit, lr=1e-3)
        o.step()
        t0, c0 = time.perf_counter(), time.process_time()
        o.step()
        extra["bitsandbytes AdamW8bit (CPU, 1 step)"] = (n, [time.perf_counter() - t0], o)
        cpu["bitsandbytes AdamW8bit (CPU, 1 step)"] = [time.process_time() - c0]
        del p, o
    except ImportError:
        print("  bitsandbytes not importable: skipped")

    base = statistics.median(times["torch AdamW fused"]) / n
    base_m = statistics.median(times.get("torch AdamW fused (matrix)", [1.0])) / m
    cbase = statistics.median(cpu["torch AdamW fused"]) / n
    cbase_m = statistics.median(cpu.get("torch AdamW fused (matrix)", [1.0])) / m
    print(f"\n{'optimizer':42s} {'median s':>9s} {'Mparam/s':>9s} {'vs fused':>9s} {'cpu s':>8s} "
          f"{'cpu vs fused':>12s} {'state B/param':>14s}")
    rows = [(k, runs[k][0], times[k], runs[k][2]) for k in runs] + [(k, *v) for k, v in extra.items()]
    for name, numel, ts, opt in rows:
        med, cmed = statistics.median(ts), statistics.median(cpu[name])
        ref, cref = (base_m, cbase_m) if "(matrix)" in name else (base, cbase)
        sb = f"{state_bytes(opt) / numel:.3f}" if opt is not None else "0"
        print(f"{name:42s} {med:9.4f} {numel / med / 1e6:9.0f} {ref * numel / med:8.2f}x {cmed:8.4f} "
              f"{cref * numel / cmed:11.2f}x {sb:>14s}")

    med = {name: statistics.median(ts) for name, _, ts, _ in rows}
    print("\ngoals (speed ratios, higher is faster):")
    if "DeepSpeedCPUAdam" in med:
        print(f"  tierwise AdamW (fp32) vs DeepSpeedCPUAdam: "
              f"{med['DeepSpeedCPUAdam'] / med['tierwise AdamW (fp32)']:.2f}x (goal >= 1.0)")
    print(f"  tierwise AdamW8bit vs torch AdamW fused:   "
          f"{med['torch AdamW fused'] / med['tierwise AdamW8bit']:.2f}x (goal >= 1.0)")
    bnb_name = "bitsandbytes AdamW8bit (CPU, 1 step)"
    if bnb_name in med:
        print(f"  tierwise AdamW8bit vs bitsandbytes CPU:    "
              f"{med[bnb_name] / med['tierwise AdamW8bit']:.1f}x (goal >= 20)")
    goals = {"8bit_vs_fused": med["torch AdamW fused"] / med["tierwise AdamW8bit"]}
    if "DeepSpeedCPUAdam" in med:
        goals["fp32_vs_deepspeed"] = med["DeepSpeedCPUAdam"] / med["tierwise AdamW (fp32)"]
    print("GOALS " + json.dumps(goals), flush=True)
    if args.processes:
        across_processes(args)


def across_processes(args: argparse.Namespace) -> None:
    """The core set in fresh processes, one after another; the median of their ratios."""
    cmd = [sys.executable, __file__, "--core", "--numel", str(args.numel), "--threads", str(args.threads),
           "--repeats", str(args.repeats)]
    seen: dict[str, list[float]] = {}
    for i in range(args.processes):
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        goals = json.loads(next(line for line in out.splitlines() if line.startswith("GOALS "))[6:])
        print(f"  process {i + 1}: " + ", ".join(f"{k} {v:.2f}x" for k, v in goals.items()), flush=True)
        for k, v in goals.items():
            seen.setdefault(k, []).append(v)
    print(f"across {args.processes} processes (median, range):")
    for k, vs in seen.items():
        print(f"  {k}: {statistics.median(vs):.2f}x ({min(vs):.2f}-{max(vs):.2f}) (goal >= 1.0)")


if __name__ == "__main__":
    main()
