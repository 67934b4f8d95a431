"""Recomputing only the first layers vs all of them, at a budget that holds some layers' activations.

On the simulated device, a Llama of the 100M shape (`--layers` decoder layers, fp32, full
fine-tune, batch x seq tokens): the gpu budget is the planner's minimum with half the layers
recomputed and a few chunks more, so keeping every layer's activations does not fit. The planner's choice at that
budget (offload.plan.planner.choose_recompute, as `finetune` picks: the fewest first layers that fit, or all,
whichever it finds faster) against recomputing all; two engines side by side in one process,
stepped in turn (who goes first rotates each round), after warm-up steps. Both are bit-equal
to plain PyTorch (tests/test_recompute_share.py). Prints the median step of each, their ratio
(share / all), the measured activation peaks against the plan's, and the planner's predicted
ratio.

    PYTHONPATH=tests/devtree python bench/recompute_share.py [--layers 8] [--steps 6] [--warmup 2]
        [--batch 2 --seq 256] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch


def build(a: argparse.Namespace):
    from transformers import LlamaForCausalLM

    from tierwise.profiles import load_model_profile

    cfg = load_model_profile("100m").to_hf_config()
    cfg.num_hidden_layers, cfg.vocab_size = a.layers, a.vocab
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def plan(a: argparse.Namespace, profile, gpu: int | None, recompute: "int | bool"):
    from tierwise.offload.plan.planner import make_plan

    return make_plan(model=profile, hardware="cpu-sim", gpu_mem=gpu or "64G", cpu_mem=None, optimizer="adamw",
                     precision="fp32", batch_size=a.batch, seq_len=a.seq, chunk_bytes=a.chunk, checkpointing=recompute)


def choose(a: argparse.Namespace, profile, gpu: int) -> int:
    """The layers `finetune` recomputes at `gpu` (planner.choose_recompute): here a share or all."""
    from tierwise.offload import InfeasibleBudget
    from tierwise.offload.plan.planner import choose_recompute

    def plan_or_none(n):
        try:
            return plan(a, profile, gpu, a.layers if n is None else n)
        except InfeasibleBudget:
            return None

    n = choose_recompute(functools.cache(plan_or_none), keep_when_fits=True)
    assert n != 0, "no recompute fits: raise the share the budget is taken at"
    return a.layers if n is None else n


def step_in_turn(engines: dict, batches: list, warmup: int, *, at_warmup=None) -> tuple[dict, dict]:
    """Step every engine on each batch in turn (who goes first alternates); ({name: the step
    times after `warmup`}, {name: every loss}). `at_warmup(name, engine)` runs as the timed
    steps begin (to reset a ledger's peaks, or note a counter)."""
    times: dict[str, list[float]] = {k: [] for k in engines}
    losses: dict[str, list[float]] = {k: [] for k in engines}
    for i, b in enumerate(batches):
        for k in (list(engines) if i % 2 == 0 else list(reversed(engines))):
            if at_warmup is not None and i == warmup:
                at_warmup(k, engines[k])
            t = time.perf_counter()
            losses[k].append(engines[k].step(b))
            if i >= warmup:
                times[k].append(time.perf_counter() - t)
    return times, losses


def engine_figures(out: dict, k: str, eng, times: list[float]) -> None:
    """An engine's figures in a side-by-side run: its median step, activation and gpu peaks."""
    out[f"{k}_step_s"] = statistics.median(times)
    out[f"{k}_activations_measured"] = eng.ledger.kind_peak("gpu", "activation")
    out[f"{k}_gpu_peak"] = eng.ledger.peaks()["gpu"]


def print_row(out: dict, k: str, steps: int, against: str) -> None:
    """One engine's line: its step, activations measured against `out[k_activations_<against>]`."""
    print(f"{k:5s} step {out[f'{k}_step_s']:.3f} s (median of {steps}), activations "
          f"{out[f'{k}_activations_measured'] / 2**20:.2f} MiB measured / "
          f"{out[f'{k}_activations_{against}'] / 2**20:.2f} {against}, gpu peak {out[f'{k}_gpu_peak'] / 2**20:.1f} MiB")


def save_json(path: "str | None", out: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


def main() -> None:
    from tierwise.offload import Engine, flat_options
    from tierwise.profiles import ModelProfile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=8 << 20)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    profile = ModelProfile.from_hf_config(build(a).config)
    gpu = plan(a, profile, None, a.layers // 2).gpu_minimum + 4 * a.chunk  # (a few chunks of room)
    share = choose(a, profile, gpu)
    plans = {"all": plan(a, profile, gpu, a.layers), "share": plan(a, profile, gpu, share)}
    g = torch.Generator().manual_seed(2)
    batches = [{"input_ids": (ids := torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)), "labels": ids}
               for _ in range(a.warmup + a.steps)]
    engines = {k: Engine(build(a), **flat_options(lr=1e-4, chunk_bytes=a.chunk, gpu_mem=gpu, checkpointing=r,
                                                  activations=plans[k].reserve["gpu"]["activations"]))
               for k, r in (("all", a.layers), ("share", share))}
    times, losses = step_in_turn(engines, batches, a.warmup)
    assert losses["all"] == losses["share"], losses
    out = {"layers": a.layers, "batch": a.batch, "seq": a.seq, "gpu_budget": gpu, "recomputed": share}
    for k, eng in engines.items():
        engine_figures(out, k, eng, times[k])
        out[f"{k}_activations_planned"] = plans[k].reserve["gpu"]["activations"]
        out[f"{k}_planned_step_s"] = plans[k].step_s
        eng.close()
    out["ratio"] = out["share_step_s"] / out["all_step_s"]
    out["planned_ratio"] = out["share_planned_step_s"] / out["all_planned_step_s"]
    print(f"budget {gpu / 2**20:.1f} MiB: every layer's activations do not fit; the planner recomputes the first "
          f"{share} of {a.layers}")
    for k in engines:
        print_row(out, k, len(times[k]), "planned")
    print(f"share / all: {out['ratio']:.3f} measured, {out['planned_ratio']:.3f} planned (losses equal)")
    save_json(a.json, out)


if __name__ == "__main__":
    main()
