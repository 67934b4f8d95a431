"""Streaming overhead of the chunk engine on the simulated device.

Trains the ~100M-parameter Llama of PEERS.md (hidden 640, 12 layers, vocab 32000, batch
4 x 128, fp32, AdamW) three ways, each in its own process so peak RSS is its own:
  plain     plain PyTorch + torch AdamW (fused), no engine (context)
  resident  the engine with an unlimited gpu budget (every chunk gpu-home)
  quarter   the engine with a gpu budget of 25% of the model's fp32 bytes (streamed), or the
            engine's minimum (from the planner) if that is more: the 32k-vocab matrices, their
            gradient and the logits alone are ~60% of the parameters at batch 4 x 128
Runs alternate (A/B/A/B...) so machine drift hits all alike. Prints median step time,
the ratio quarter / resident (goal <= 1.2), peak RSS and the ledger's gpu peak.

    python bench/engine_overhead.py [--steps 4] [--rounds 2] [--layers 12] [--vocab 32000]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch


def build(layers: int, vocab: int):
    from transformers import LlamaForCausalLM

    from tierwise.profiles import load_model_profile

    cfg = load_model_profile("100m").to_hf_config()
    cfg.num_hidden_layers = layers
    cfg.vocab_size = vocab
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def child(mode: str, steps: int, layers: int, budget_frac: float, vocab: int) -> dict:
    from tierwise.offload import Activations, Budget, Engine, Optim

    torch.set_num_threads(2)
    model = build(layers, vocab)
    model_bytes = sum(p.numel() for p in model.parameters()) * 4
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, vocab, (4, 128), generator=g) for _ in range(steps + 2)]
    out = {"mode": mode, "model_bytes": model_bytes}
    if mode == "plain":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def step(x):
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.item()
    else:
        from tierwise.offload.plan.perfmodel import activation_bytes
        from tierwise.offload.plan.planner import make_plan
        from tierwise.profiles import ModelProfile

        profile = ModelProfile.from_hf_config(model.config)
        gpu = None
        if mode != "resident":  # the engine's minimum when the asked budget is below it
            plan = make_plan(model=profile, hardware=None, gpu_mem=None, cpu_mem=None, optimizer="adamw",
                             precision="fp32", batch_size=4, seq_len=128, chunk_bytes=16 << 20)
            gpu = max(int(model_bytes * budget_frac), plan.gpu_minimum)
            out["asked_budget"] = int(model_bytes * budget_frac)
        act = activation_bytes(model=profile, batch_size=4, seq_len=128, precision="fp32")
        eng = Engine(model, budget=Budget(gpu=gpu, chunk=16 << 20), optim=Optim(lr=1e-4),
                     activations=Activations(expected=act))

        def step(x):
            return eng.step({"input_ids": x, "labels": x})
    times, losses = [], []
    for i, x in enumerate(data):
        t0 = time.perf_counter()
        losses.append(step(x))
        if i >= 2:  # two warm-up steps (the engine's first records its trace)
            times.append(time.perf_counter() - t0)
    out.update(step_s=statistics.median(times), losses=losses,
               rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
    if mode != "plain":
        out.update(gpu_peak=eng.ledger.peaks()["gpu"], gpu_budget=gpu, minimum=eng.minimum_gpu_bytes,
                   gpu_home=len(eng.device_plan.gpu_home), chunks=len(eng.plan.chunks),
                   fetched_gib_per_step=eng.cache.fetched_bytes / 2**30 / len(data),
                   wait_s=eng.executor.wait_seconds)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--budget-frac", type=float, default=0.25)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.steps, a.layers, a.budget_frac, a.vocab)))
        return
    results: dict[str, list[dict]] = {"plain": [], "resident": [], "quarter": []}
    for r in range(a.rounds):
        for mode in results:
            cmd = [sys.executable, __file__, "--child", mode, "--steps", str(a.steps),
                   "--layers", str(a.layers), "--budget-frac", str(a.budget_frac), "--vocab", str(a.vocab)]
            res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            results[mode].append(res)
            print(f"round {r} {mode:9s} step {res['step_s']:.3f} s  rss {res['rss_gib']:.2f} GiB", flush=True)
    med = {m: statistics.median(x["step_s"] for x in v) for m, v in results.items()}
    q, rs = results["quarter"][-1], results["resident"][-1]
    print(f"\nmodel {q['model_bytes'] / 2**20:.0f} MiB fp32; asked budget {q['asked_budget'] / 2**20:.1f} MiB "
          f"({a.budget_frac:.0%}), ran at {q['gpu_budget'] / 2**20:.1f} MiB = {q['gpu_budget'] / q['model_bytes']:.0%} "
          f"(engine minimum {q['minimum'] / 2**20:.1f} MiB), gpu peak {q['gpu_peak'] / 2**20:.1f} MiB, "
          f"{q['gpu_home']}/{q['chunks']} chunks gpu-home, {q['fetched_gib_per_step']:.2f} GiB streamed/step, "
          f"compute thread waited {q['wait_s']:.2f} s in total")
    print(f"median step: plain {med['plain']:.3f} s, resident {med['resident']:.3f} s, quarter {med['quarter']:.3f} s")
    print(f"ratio quarter/resident = {med['quarter'] / med['resident']:.3f}  (goal <= 1.2)")
    print(f"peak RSS: plain {results['plain'][-1]['rss_gib']:.2f} GiB, resident {rs['rss_gib']:.2f} GiB, "
          f"quarter {q['rss_gib']:.2f} GiB")
    same = all(a == b for a, b in zip(q["losses"], rs["losses"]))
    print(f"losses quarter == resident: {same}")


if __name__ == "__main__":
    main()
