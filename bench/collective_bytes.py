"""Collective bytes per step on 2 ranks (gloo, processes on this CPU), measured, beside the
ZeRO-3 volume for the same model and the planner's figure.

Measured: the payload bytes each rank passes to the engine's chunk collectives in a step
(offload.engine.ranks.Ranks.bytes: "gather" = broadcasts of compute copies from their owners,
"grads" = gradients reduced onto their owners; the scalar all-reduces -- loss, token counts,
finiteness -- are a few bytes and listed apart), averaged over the steps after the warm-up.

ZeRO-3 volume, the same unit (payload per rank per step), for the same trainable parameters P,
compute bytes e, M micro-batches per rank: every micro-batch gathers the parameters for forward
and again for backward (a third time for a recomputed block's recompute: ZeRO-3 releases a
module's parameters after each forward, the recompute's too) and reduce-scatters its gradients
in the compute dtype (DeepSpeed's default communication dtype):
    ZeRO-3 = M * (gathers * P * e + P * e),  gathers = 2, or 3 with recompute.
The engine gathers a chunk when its cache does not hold it (at most forward + one for recompute
and backward, once per step when the cache keeps the model from the first forward to the update)
and reduces fp32 gradients once per step, whatever M.

    python bench/collective_bytes.py [--steps 3]

The planner's collective bytes (`make_plan(nproc_per_node=2)`, Plan.ranks) are printed beside
the measurement: tests/test_plan_ranks.py holds them within 10%.
"""

from __future__ import annotations

import argparse
import datetime
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

MODEL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
CHUNK = 16 << 10
SEQ = 16
ROWS = 2  # per micro-batch


def build():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**MODEL))


def data(steps: int, rows: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        x = torch.randint(0, MODEL["vocab_size"], (rows, SEQ), generator=g)
        out.append({"input_ids": x, "labels": x.clone()})
    return out


def cases() -> list[dict]:
    """Engine settings measured: precision x recompute x micro-batches per rank, a roomy device
    (the cache keeps every chunk through the step) and a tight one (chunks fetched again)."""
    out = []
    for precision in ("fp32", "bf16"):
        for recompute in (True, False):
            out.append(dict(precision=precision, checkpointing=recompute, grad_accum=1, gpu_mem=None))
    out.append(dict(precision="fp32", checkpointing=True, grad_accum=2, gpu_mem=None))
    for precision in ("fp32", "bf16"):
        out.append(dict(precision=precision, checkpointing=True, grad_accum=2, gpu_mem="tight"))
    out.append(dict(precision="bf16", checkpointing=False, grad_accum=1, gpu_mem="tight"))  # the worst case
    return out


def tight_gpu(case: dict) -> int:
    """The smallest device budget the engine takes for this case (the planner's gpu_minimum,
    the engine's own formula: tests/test_plan_vs_engine.py), plus 8 KiB (two ranks agree on the
    larger activation peak of the two)."""
    from tierwise.offload.engine.model_info import model_specs
    from tierwise.offload.plan.planner import make_plan

    model = build()
    p = make_plan(model=model.config, hardware="cpu-sim", params=model_specs(model),
                  gpu_mem=None, cpu_mem=None, optimizer="adamw", precision=case["precision"], batch_size=ROWS,
                  seq_len=SEQ, grad_accum=case["grad_accum"], chunk_bytes=CHUNK, checkpointing=case["checkpointing"])
    return p.gpu_minimum + (8 << 10)


def _worker(rank: int, world: int, todo: list[dict], steps: int, tmp: str) -> None:
    from tierwise.offload import Activations, Budget, Engine, Optim, Precision

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{Path(tmp) / 'rendezvous'}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        out = []
        buf, reps = torch.zeros(1 << 20, dtype=torch.float32), 10  # gloo's bandwidth: 4 MiB broadcasts
        dist.broadcast(buf, src=0)
        t0 = time.perf_counter()
        for _ in range(reps):
            dist.broadcast(buf, src=0)
            dist.reduce(buf, dst=0)
        link_gbps = 2 * reps * buf.numel() * 4 / (time.perf_counter() - t0) / 1e9
        for case in todo:
            accum = case["grad_accum"]
            eng = Engine(build(), budget=Budget(chunk=CHUNK, gpu=case["gpu_mem"]), optim=Optim(lr=1e-3),
                         precision=Precision(case["precision"]),
                         activations=Activations(recompute=case["checkpointing"]))
            batches = data(steps + 1, ROWS * accum * world)
            eng.step(batches[0], grad_accum=accum)  # warm-up: trace, placement
            before = dict(eng.ranks.bytes)
            for b in batches[1:]:
                eng.step(b, grad_accum=accum)
            got = {k: (eng.ranks.bytes[k] - before[k]) / steps for k in before}
            t = torch.tensor([got["gather"], got["grads"], got["main"]], dtype=torch.float64)
            same = t.clone()
            dist.all_reduce(same, op=dist.ReduceOp.MAX)
            out.append(got | {"ranks_agree": bool(torch.equal(t, same)), "cache_limit": eng.device_plan.cache_limit,
                              "link_gbps": link_gbps})
            eng.close()
        if rank == 0:
            torch.save(out, Path(tmp) / "results.pt")
    finally:
        dist.destroy_process_group()


def measure(todo: list[dict], *, steps: int = 2, world: int = 2, start_method: str = "spawn") -> list[dict]:
    """Per case: the payload bytes per rank per step ("gather", "grads", "main"), measured on
    `world` gloo ranks after the warm-up step. A case's gpu_mem "tight" is resolved first.
    `start_method` "fork" saves the ranks' imports (a test's seconds)."""
    import torch.multiprocessing as mp

    todo = [c | {"gpu_mem": tight_gpu(c)} if c["gpu_mem"] == "tight" else c for c in todo]
    tmp = tempfile.mkdtemp(prefix="tierwise-coll-")
    mp.start_processes(_worker, args=(world, todo, steps, tmp), nprocs=world, start_method=start_method)
    return [c | r for c, r in zip(todo, torch.load(Path(tmp) / "results.pt"))]


def zero3_bytes(*, params: int, precision: str, micro_batches: int, recompute: bool) -> int:
    """ZeRO-3's payload per rank per step (see the module docstring)."""
    e = 4 if precision == "fp32" else 2
    return micro_batches * ((3 if recompute else 2) * params * e + params * e)


def planned(case: dict, *, world: int = 2) -> "tuple[int, int]":
    """The planner's (gather, reduce) bytes per rank per step for this case, on cpu-sim."""
    from tierwise.offload.engine.model_info import model_specs
    from tierwise.offload.plan.planner import make_plan

    model = build()
    p = make_plan(model=model.config, hardware="cpu-sim", params=model_specs(model),
                  gpu_mem=case["gpu_mem"], cpu_mem=None, optimizer="adamw", precision=case["precision"],
                  batch_size=ROWS, seq_len=SEQ, grad_accum=case["grad_accum"], chunk_bytes=CHUNK,
                  checkpointing=case["checkpointing"], nproc_per_node=world)
    return p.ranks.gather_bytes, p.ranks.reduce_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3, help="measured steps after the warm-up")
    args = ap.parse_args()
    params = sum(p.numel() for p in build().parameters())
    rows = [["precision", "recompute", "micro/rank", "device", "gather", "reduce", "scalars", "measured",
             "planned", "plan/meas", "ZeRO-3", "meas/ZeRO-3"]]
    results = measure(cases(), steps=args.steps)
    for r in results:
        assert r["ranks_agree"], r
        total = r["gather"] + r["grads"]
        pg, pr = planned(r)
        z = zero3_bytes(params=params, precision=r["precision"], micro_batches=r["grad_accum"],
                        recompute=r["checkpointing"])
        rows.append([r["precision"], "on" if r["checkpointing"] else "off", str(r["grad_accum"]),
                     "roomy" if r["gpu_mem"] is None else f"tight {r['gpu_mem'] >> 10} KiB",
                     f"{r['gather'] / 1e6:.3f} MB", f"{r['grads'] / 1e6:.3f} MB", f"{r['main']:.0f} B",
                     f"{total / 1e6:.3f} MB", f"{(pg + pr) / 1e6:.3f} MB", f"{(pg + pr) / total:.3f}",
                     f"{z / 1e6:.3f} MB", f"{total / z:.3f}"])
    print(f"collective payload per rank per step, 2 gloo ranks, Llama {MODEL['num_hidden_layers']} layers x "
          f"{MODEL['hidden_size']} ({params:,} params, all trainable), {CHUNK >> 10} KiB chunks, micro-batch "
          f"{ROWS} x {SEQ}, AdamW; measured over {args.steps} steps after the warm-up")
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
    print(f"gloo between the 2 processes: {results[0]['link_gbps']:.2f} GB/s per 4 MiB broadcast/reduce "
          f"(profiles/hardware/cpu-sim.toml [node] gpu_link_gbps)")


if __name__ == "__main__":
    main()
