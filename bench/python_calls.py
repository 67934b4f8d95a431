"""The engine's Python work on the launching thread, against the model's own, per step.

Runs `finetune` in this process on the built-in tiny Llama (4 layers), streamed at a small
--gpu-mem, and counts, for the steps after the warm-up, every Python function call on the
launching thread (sys.setprofile) by where its code lives:
  engine  tierwise's own files (offload/, optim/, cli/)
  model   the model's code: transformers' modeling files and torch.nn's modules/functional
  torch   the rest of torch (autograd, utils, overrides) that the calls above go through
  other   everything else (the standard library, ...)
The figure is engine / model (asked: <= 1), by the code itself and with each torch or
library call counted for the innermost engine or model frame that led to it. (By where the code
lives, torch.nn code the engine calls, such as Module.modules(), counts as the model's; the
second figure counts it as the engine's.) It also prints the engine's own counters of the last
step (module hook calls, gradient copies, host waits, saved-tensor hook calls).

    python bench/python_calls.py [--steps 6] [--gpu-mem 4M] [--chunk-size 64K] [--json out.json] [-- finetune options]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])


def where(filename: str) -> str:
    if filename.startswith(ROOT) and "/tests/" not in filename and "/bench/" not in filename:
        return "engine"
    if "/transformers/" in filename and ("/models/" in filename or "modeling_" in filename
                                          or "/integrations/" in filename):
        return "model"
    if "/torch/nn/modules/" in filename or "/torch/nn/functional" in filename:
        return "model"
    if "/torch/" in filename:
        return "torch"
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--gpu-mem", default="4M")
    ap.add_argument("--chunk-size", default="64K")
    ap.add_argument("--json", default=None)
    ap.add_argument("rest", nargs="*", help="more finetune options (after --)")
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "tests", "devtree"))
    import torch

    from tierwise.cli import train
    from tierwise.cli.main import app
    from tierwise.offload import Engine

    torch.set_num_threads(1)
    counts: collections.Counter = collections.Counter()
    files: collections.Counter = collections.Counter()
    owners: collections.Counter = collections.Counter()
    borrowed: collections.Counter = collections.Counter()  # library calls made for the engine  # by the innermost engine or model frame
    state = {"step": 0, "counters": None}
    cache: dict = {}

    def prof(frame, event, arg):
        if event == "call":
            fn = frame.f_code.co_filename
            kind = cache.get(fn)
            if kind is None:
                kind = cache[fn] = where(fn)
            counts[kind] += 1
            owner, f = kind, frame.f_back
            while owner not in ("engine", "model") and f is not None:
                owner = cache.get(f.f_code.co_filename) or where(f.f_code.co_filename)
                f = f.f_back
            owners[owner if owner in ("engine", "model") else "neither"] += 1
            if owner == "engine" and kind != "engine":
                borrowed[f"{fn.split('site-packages/')[-1]}:{frame.f_code.co_name}"] += 1
            if kind == "engine":
                files[f"{os.path.relpath(fn, ROOT)}:{frame.f_code.co_name}"] += 1

    class Counted(Engine):
        def step(self, *a, **k):
            state["step"] += 1
            if state["step"] <= 2:  # warm-up: the trace, the placement
                return super().step(*a, **k)
            sys.setprofile(prof)
            try:
                return super().step(*a, **k)
            finally:
                sys.setprofile(None)
                state["counters"] = dict(getattr(self, "counters", {}) or {})

    train.engine_class = lambda: Counted
    with tempfile.TemporaryDirectory() as out:
        argv = ["--steps", str(args.steps), "--gpu-mem", args.gpu_mem, "--chunk-size", args.chunk_size, "--output", out, "--overwrite",
                "--precision", "fp32", *args.rest]
        try:
            app(argv, standalone_mode=False)
        except SystemExit as e:
            if e.code:
                raise
    if state["step"] <= 2:
        raise SystemExit("finetune did not reach a counted step (see its error above)")
    timed = state["step"] - 2
    per_step = {k: round(v / timed) for k, v in counts.items()}
    ratio = counts["engine"] / max(1, counts["model"])
    attributed = {k: round(v / timed) for k, v in owners.items()}
    ratio_attr = owners["engine"] / max(1, owners["model"])
    print(f"steps counted: {timed} (after 2 warm-up), finetune {' '.join(argv)}")
    for k in ("engine", "model", "torch", "other"):
        print(f"  {k:6s} {per_step.get(k, 0):8d} Python calls per step")
    print(f"engine / model: {ratio:.2f} (own code); with the torch and library calls each makes: "
          f"engine {attributed.get('engine', 0)}, model {attributed.get('model', 0)}, "
          f"neither {attributed.get('neither', 0)}: {ratio_attr:.2f}")
    print("engine calls by function, per step (top 40):")
    for name, n in files.most_common(40):
        print(f"  {n / timed:8.0f}  {name}")
    by_file: collections.Counter = collections.Counter()
    for name, n in files.items():
        by_file[name.split(":")[0]] += n
    print("engine calls by file, per step:", ", ".join(f"{f} {n / timed:.0f}" for f, n in by_file.most_common(12)))
    print("library calls made for the engine, per step (top 10):")
    for name, n in borrowed.most_common(10):
        print(f"  {n / timed:8.0f}  {name}")
    if state["counters"]:
        print("engine counters (last step):", state["counters"])
    if args.json:
        Path(args.json).write_text(json.dumps({"per_step": per_step, "engine_over_model": round(ratio, 3),
                                               "attributed": attributed, "attributed_ratio": round(ratio_attr, 3),
                                               "counters": state["counters"],
                                               "by_function": {k: round(n / timed, 2) for k, n in files.most_common()}},
                                              indent=1))


if __name__ == "__main__":
    main()
