"""Two or more builds of the 8-bit AdamW C kernel, interleaved in one process with torch's fused AdamW.

    python bench/optim_kernel_ab.py [--numel 100000000] [--threads 2] [--rounds 11] SPEC SPEC...

SPEC: a git revision (the kernel source optim/csrc/adam8bit.c at that commit, e.g. d74db20) or
the path of a C file (for timing-only variants). Each build steps its own p and
state (same g), one step per round each, in turn with torch's fused AdamW; medians per
parameter and fused ÷ build. Kernel-to-kernel ratios from one process stay usable when other
jobs share the cores (bench/README.md, "AVX-512 quantizer rework"); ratios to torch's fused
step do not. --isa caps the path (2 AVX-512, 1 AVX2, 0 scalar).
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from tierwise.optim import _cpu_kernel, init_adamw8bit_state
from tierwise.optim.adamw8bit import _kernel_tables


def source(spec: str) -> str:
    """The kernel's C source: a file, or a git revision (optim/csrc/adam8bit.c; before it, the
    string _SOURCE in optim/_cpu_kernel.py)."""
    path = Path(spec)
    if path.exists():
        return path.read_text()
    show = subprocess.run(["git", "show", f"{spec}:optim/csrc/adam8bit.c"], capture_output=True, text=True)
    if show.returncode == 0:
        return show.stdout
    text = subprocess.run(["git", "show", f"{spec}:optim/_cpu_kernel.py"], capture_output=True, text=True,
                          check=True).stdout
    ns: dict = {"__name__": "kernel_variant"}
    exec(compile(text, spec, "exec"), ns)  # that module defined _SOURCE and helpers only
    return ns["_SOURCE"]


def build(src: str, tmp: Path) -> ctypes.CDLL:
    key = hashlib.sha256(src.encode()).hexdigest()[:12]
    c_file, so = tmp / f"k_{key}.c", tmp / f"k_{key}.so"
    c_file.write_text(src)
    subprocess.run(["gcc", *_cpu_kernel._FLAGS, str(c_file), "-o", str(so), "-lm"], check=True)
    lib = ctypes.CDLL(str(so))
    lib.tw_adam8bit_step.restype = ctypes.c_int
    lib.tw_adam8bit_step.argtypes = [ctypes.c_void_p] * 11 + [ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    return lib


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("specs", nargs="+")
    ap.add_argument("--numel", type=int, default=100_000_000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--isa", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n = args.numel
    g = torch.randn(n) * 1e-3
    pf = torch.nn.Parameter(torch.randn(n) * 0.02)
    pf.grad = g
    fused = torch.optim.AdamW([pf], lr=1e-3, fused=True)
    hyper = (ctypes.c_float * 8)(0.9, 0.999, 0.1, 0.001, 1e-8, 1.2, 0.99999, -1e-3)
    code1, code2, qt1, qt2 = _kernel_tables()[1]
    runs = {"torch AdamW fused": fused.step}
    keep = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in dict.fromkeys(args.specs):
            lib = build(source(spec), Path(tmp))
            p = torch.randn(n) * 0.02
            st = init_adamw8bit_state(p)
            keep.append((lib, p, st))
            call = (p.data_ptr(), g.data_ptr(), *(st[k].data_ptr() for k in ("state1", "state2", "absmax1", "absmax2")),
                    code1, code2, qt1, qt2, ctypes.addressof(hyper), n, args.threads, args.isa)
            runs[spec] = lambda lib=lib, call=call: lib.tw_adam8bit_step(*call)
        times: dict[str, list[float]] = {k: [] for k in runs}
        for step in runs.values():
            step()
            step()
        for _ in range(args.rounds):
            for name, step in runs.items():
                t0 = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["torch AdamW fused"])
    print(f"{n / 1e6:.0f}M params, {args.threads} threads, {args.rounds} rounds, isa cap {args.isa}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:30s} {med * 1e9 / n:8.4f} ns/param  fused/this {base / med:.3f}")


if __name__ == "__main__":
    main()
