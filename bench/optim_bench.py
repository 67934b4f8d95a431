"""CPU optimizer-step throughput and state bytes/param, side by side with peers.

    python bench/optim_bench.py [--numel 100000000] [--lowrank-shape 2048 1280] [--threads 2]

Warm-up step first, repeats interleaved across optimizers (DeepSpeedCPUAdam too, when
importable: run it in bench/.ds-venv). AdamW8bit runs once per kernel path this CPU has
(AVX-512, AVX2, scalar: $TIERWISE_CPU_ISA set per step; the paths give identical bytes), and
bitsandbytes' CPU AdamW8bit once (slow). Medians reported with the ratio to
torch's fused AdamW, in wall time and in process CPU time (the latter is what to compare on a
shared, oversubscribed host). `--processes N` then reruns the core set in N fresh processes, after
this process has freed its tensors (holding them changed the children's ratios); `--ballast-gib`
holds memory while measuring, to show how placement moves torch's fused step (bench/README.md).
Low-rank optimizers run on one matrix (SVD of 100M params per refresh is
not a step-time question); their projector refresh is timed separately.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import psutil
import torch

from tierwise.optim import AdamW, AdamW8bit, ApolloAdamW, ApolloMini, GaLoreAdamW, GaLoreAdamW8bit, perturb_
from tierwise.optim import _cpu_kernel
from tierwise.optim.mezo import mezo_update_

BEST_8BIT = "tierwise AdamW8bit"  # the row of the path the optimizer takes by default


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


def with_isa(isa: str, step):
    """step() with the 8-bit kernel capped to path `isa` ($TIERWISE_CPU_ISA), restored after."""
    def run() -> None:
        before = os.environ.get(_cpu_kernel.ISA_ENV)
        os.environ[_cpu_kernel.ISA_ENV] = isa
        try:
            step()
        finally:
            if before is None:
                del os.environ[_cpu_kernel.ISA_ENV]
            else:
                os.environ[_cpu_kernel.ISA_ENV] = before
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=100_000_000)
    ap.add_argument("--lowrank-shape", type=int, nargs=2, default=(2048, 1280))
    ap.add_argument("--rank", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--core", action="store_true",
                    help="only the flat-tensor AdamWs (torch fused, ours fp32 and 8-bit, DeepSpeedCPUAdam)")
    ap.add_argument("--no-bnb", action="store_true", help="skip bitsandbytes' CPU AdamW8bit (seconds per step)")
    ap.add_argument("--processes", type=int, default=0,
                    help="then repeat the core set in this many fresh processes and print the median of "
                         "their ratios (memory placement, hence bandwidth, differs from process to process)")
    ap.add_argument("--ballast-gib", type=float, default=0.0,
                    help="hold this many GiB (touched) while measuring: shows how much the fused step's "
                         "time depends on where its memory lands (bench/README.md)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ballast = torch.ones(int(args.ballast_gib * 2**28)) if args.ballast_gib else None  # fp32: 2^28 per GiB
    measure(args)
    del ballast
    if args.processes:  # after measure() returned: its tensors (~5 GB at 100M) are freed. Held,
        # they lowered every child's ratio (1.45x vs 1.54-1.58x alone): torch's fused step ran faster
        gc.collect()
        print(f"  parent RSS before the processes: {psutil.Process().memory_info().rss / 2**30:.2f} GiB")
        across_processes(args)


def measure(args: argparse.Namespace) -> None:
    """The side-by-side run in this process; prints the table and a GOALS line."""
    n, lr_shape = args.numel, tuple(args.lowrank_shape)
    print(f"torch {torch.__version__}, {args.threads} threads, flat tensor {n / 1e6:.0f}M, "
          f"low-rank matrix {lr_shape} rank {args.rank}")
    in_use = _cpu_kernel.isa_in_use()
    host = _cpu_kernel.ISA_NAMES[_cpu_kernel.best_isa()] if in_use != "torch" else "none (no C kernel)"
    print(f"8-bit kernel path in use: {in_use} (host's best: {host}; "
          f"{_cpu_kernel.ISA_ENV}={os.environ.get(_cpu_kernel.ISA_ENV, '')!r})")

    runs = {}  # name -> (numel, step callable, optimizer or None)
    p, o = make("flat", (n,), torch.optim.AdamW, lr=1e-3, fused=True)
    runs["torch AdamW fused"] = (n, o.step, o)
    p, o = make("flat", (n,), AdamW, lr=1e-3)
    runs["tierwise AdamW (fp32)"] = (n, o.step, o)
    p, o = make("flat", (n,), AdamW8bit, lr=1e-3)
    runs[BEST_8BIT] = (n, o.step, o)
    if in_use != "torch":  # the other paths on the same optimizer (same bytes, other speed)
        for isa in reversed(_cpu_kernel.ISA_NAMES[:_cpu_kernel.best_isa() + 1]):
            if isa != in_use:
                runs[f"tierwise AdamW8bit [{isa}]"] = (n, with_isa(isa, o.step), o)
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
        if args.no_bnb:
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
        print("  bitsandbytes skipped (--no-bnb or not importable)")

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
    bnb_name = "bitsandbytes AdamW8bit (CPU, 1 step)"
    goals = {}
    for name in [k for k in med if k.startswith(BEST_8BIT)]:
        isa = in_use if name == BEST_8BIT else name[len(BEST_8BIT) + 2:-1]
        goal = {"avx2": " (goal >= 1.0)", "avx512": " (goal >= 1.5)"}.get(isa, "")
        print(f"  tierwise AdamW8bit [{isa}] vs torch AdamW fused: {med['torch AdamW fused'] / med[name]:.2f}x{goal}"
              + (f", vs bitsandbytes CPU: {med[bnb_name] / med[name]:.1f}x" + (" (goal >= 20)" if goal else "")
                 if bnb_name in med else ""))
        key = "8bit_vs_fused" if name == BEST_8BIT else f"8bit_vs_fused_{isa}"
        goals[key] = med["torch AdamW fused"] / med[name]
    if bnb_name in med:
        goals["8bit_vs_bnb"] = med[bnb_name] / med[BEST_8BIT]
    if "DeepSpeedCPUAdam" in med:
        goals["fp32_vs_deepspeed"] = med["DeepSpeedCPUAdam"] / med["tierwise AdamW (fp32)"]
    print("GOALS " + json.dumps(goals), flush=True)


def across_processes(args: argparse.Namespace) -> None:
    """The core set in fresh processes, one after another; the median of their ratios."""
    cmd = [sys.executable, __file__, "--core", "--no-bnb", "--numel", str(args.numel), "--threads",
           str(args.threads), "--repeats", str(args.repeats), "--ballast-gib", str(args.ballast_gib)]
    seen: dict[str, list[float]] = {}
    for i in range(args.processes):
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        goals = json.loads(next(line for line in out.splitlines() if line.startswith("GOALS "))[6:])
        print(f"  process {i + 1}: " + ", ".join(f"{k} {v:.2f}x" for k, v in goals.items()), flush=True)
        for k, v in goals.items():
            seen.setdefault(k, []).append(v)
    print(f"across {args.processes} processes (median, range):")
    for k, vs in seen.items():
        print(f"  {k}: {statistics.median(vs):.2f}x ({min(vs):.2f}-{max(vs):.2f})")


if __name__ == "__main__":
    main()
