"""What fits where: tierwise plans for 7B-175B on an RTX 4090 + 256 GB + NVMe and on an H200,
beside DeepSpeed ZeRO-3's own model-states memory estimate; with --lora, LoRA and QLoRA plans
for 8B/70B/405B on a 24 GB RTX 4090 with 64 or 128 GB host RAM (+ NVMe for what does not fit),
beside what PEFT + bitsandbytes would need on the GPU; with --multi, several GPUs per node (70B
QLoRA and full on 2x RTX 4090, 405B QLoRA on 8x RTX 4090 + NVMe, 70B full on 8x A100-80G).

    python bench/plan_table.py [--batch 1] [--seq 2048] [--precision bf16]
    python bench/plan_table.py --lora [--seq 512]
    python bench/plan_table.py --multi [--seq 2048] [--batch 1]

DeepSpeed's estimate: `deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs_all_cold`
when deepspeed is importable; otherwise the same formula re-derived here (one node, one GPU,
additional_buffer_factor 1.5): offload_param=cpu + offload_optimizer=cpu needs
GPU 4 B x largest_layer_params and CPU 18 B x total_params x 1.5 (zero_init=1); with parameters
kept on the GPU, GPU 4 B x largest layer + 2 B x total and CPU 16 B x total x 1.5. The "largest
layer" is the module with most parameters of its own (here the embedding or lm_head).
It counts model states only, no activations, and has no NVMe variant.
"""

from __future__ import annotations

import argparse

from tierwise.offload.core.errors import InfeasibleBudget
from tierwise.offload.plan.planner import make_plan
from tierwise.offload.core.units import format_size
from tierwise.profiles import ModelProfile, load_hardware_profile, load_model_profile

MODELS = ("7b", "13b", "70b", "175b")
OPTIMIZERS = ("adamw", "adamw8bit", "galore", "mezo")
HARDWARE = ("rtx4090-256g-nvme", "h200")


def largest_layer_params(model: ModelProfile) -> int:
    """Most parameters owned directly by one module (DeepSpeed's model_to_params)."""
    h = model.hidden_size
    return max(model.vocab_size * h, model.intermediate_size * h, model.q_dim * h + model.q_dim)


def deepspeed_zero3_cold(*, total: int, largest: int, factor: float = 1.5) -> dict[str, tuple[int, int]]:
    """(cpu bytes, gpu bytes) per option, one GPU on one node; deepspeed's own when importable."""
    try:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs  # type: ignore
    except ImportError:
        ll = 4 * largest
        return {"offload param+optim=cpu": (int(total * 18 * factor), ll),
                "offload optim=cpu": (int(total * 16 * factor), ll + 2 * total),
                "no offload": (int(largest * 4 * factor), ll + 18 * total)}
    out = {}
    for label, opt, par in (("offload param+optim=cpu", True, True), ("offload optim=cpu", True, False),
                            ("no offload", False, False)):
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            total_params=total, largest_layer_params=largest, num_gpus_per_node=1, num_nodes=1,
            cpu_offload=opt, cpu_offload_params=par, zero_init=True, additional_buffer_factor=factor)
        out[label] = (cpu, gpu)
    return out


def _row(cells: list[str], widths: list[int]) -> str:
    return "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))


LORA_MODELS = ("8b", "70b", "405b")
LORA_RUNS = (("--qlora", dict(lora_rank=16, base_dtype="nf4", double_quant=True)),
             ("--lora-rank 16 --base-dtype bf16", dict(lora_rank=16, base_dtype="bf16")))
HOSTS = ("64G", "128G")


def peft_gpu_bytes(model: ModelProfile, *, run: dict, batch: int, seq: int) -> dict[str, int]:
    """What PEFT + bitsandbytes (QLoRA) or PEFT over a bf16 base needs on the GPU: the whole
    base as stored (NF4 + absmax for the linear weights, bf16 for the rest; or all bf16), the
    adapters with fp32 weights, gradients and AdamW moments (16 B/param), and the activations
    with gradient checkpointing (our LoRA activation formula for the same micro-batch)."""
    from tierwise.offload.core.encoding import encoded_nbytes
    from tierwise.offload.plan.lora import base_dtype_of, lora_specs
    from tierwise.offload.plan.perfmodel import activation_bytes

    lora = lora_specs(model.param_specs(), rank=run["lora_rank"], targets="all-linear")
    base = 0
    for spec in lora.specs:
        if spec.name in lora.frozen:
            kind = base_dtype_of(spec.name, base_dtype=run["base_dtype"], plain="bf16", quantizable=lora.quantizable)
            base += encoded_nbytes(kind, spec.numel, double_quant=run.get("double_quant", False))
    adapters = 16 * sum(s.numel for s in lora.specs if s.name not in lora.frozen)
    act = activation_bytes(model=model, batch_size=batch, seq_len=seq, precision="bf16", checkpointing=True,
                           lora=(lora.targets, lora.rank))
    return {"base": base, "adapters": adapters, "activations": act, "total": base + adapters + act}


def lora_table(seq: int) -> None:
    """LoRA/QLoRA on a 24 GB RTX 4090 with 64 / 128 GB host (+ NVMe): each row at the smallest
    micro-batch that makes the step compute-bound (else the fastest that fits), from 1 up."""
    from tierwise.offload.plan.planner import better_micro_batch

    hw = load_hardware_profile("rtx4090")
    head = ["model", "run", "host", "fits", "micro-batch", "gpu", "host", "nvme", "base on", "tokens/s",
            "bottleneck", "PEFT+bnb GPU"]
    rows = [head]
    for m in LORA_MODELS:
        prof = load_model_profile(m)
        for label, run in LORA_RUNS:
            peft_need = peft_gpu_bytes(prof, run=run, batch=1, seq=seq)
            for host in HOSTS:
                kw = dict(model=prof, hardware=hw, gpu_mem="24G", cpu_mem=host, nvme_path="/nvme",
                          optimizer="adamw", precision="bf16", batch_size=1, seq_len=seq, **run)
                try:
                    p = make_plan(**kw, suggest=False)
                except InfeasibleBudget as exc:
                    need = ", ".join(f"{t} >= {format_size(b)}" for t, b in exc.minimum.items())
                    rows.append([m, label, host, "no", need] + [""] * 6 + [format_size(peft_need["total"])])
                    continue
                if p.bottleneck != "gpu compute":
                    p = better_micro_batch(p, **kw) or p
                base = ", ".join(f"{t} {format_size(p.bytes[t]['base'])}" for t in ("gpu", "host", "nvme")
                                 if p.bytes[t].get("base"))
                rows.append([m, label, host, "yes", f"{p.batch_size} x {p.seq_len}", format_size(p.peak["gpu"]),
                             format_size(p.peak["host"]), format_size(p.peak["nvme"]) if p.peak["nvme"] else "-",
                             base, f"{p.tokens_per_s:,.0f}", p.bottleneck, format_size(peft_need["total"])])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    print(f"tierwise LoRA/QLoRA plans on rtx4090 (24 GiB GPU), bf16 compute, rank 16 on all-linear, "
          f"seq {seq}, recompute, 64 MiB chunks, host RAM as given + NVMe; PEFT+bnb GPU = whole stored base "
          f"+ adapters (16 B/param) + activations at micro-batch 1 (its GPU must hold all of it)")
    for r in rows:
        print(_row(r, widths))
    print("\nPEFT + bitsandbytes on the GPU, by part (micro-batch 1):")
    for m in LORA_MODELS:
        prof = load_model_profile(m)
        for label, run in LORA_RUNS:
            need = peft_gpu_bytes(prof, run=run, batch=1, seq=seq)
            print(f"  {m:5s} {label:33s} " + ", ".join(f"{k} {format_size(v)}" for k, v in need.items())
                  + f"  -> {'fits' if need['total'] <= hw.gpu.memory else 'does not fit'} in 24 GiB")


#: (setup, hardware profile, model, run label, planner keywords, host budgets per node)
MULTI = (
    ("2x RTX 4090", "2x-rtx4090-128g", "70b", "QLoRA", dict(lora_rank=16, base_dtype="nf4", double_quant=True),
     ("128G", "64G")),
    ("2x RTX 4090", "2x-rtx4090-128g", "70b", "full", {}, ("128G", "64G")),
    ("8x RTX 4090", "8x-rtx4090-nvme", "405b", "QLoRA", dict(lora_rank=16, base_dtype="nf4", double_quant=True),
     ("256G",)),
    ("8x A100-80G", "8x-a100-80g-1t-nvme", "70b", "full", {}, ("1T",)),
)


def multi_table(seq: int, batch: int) -> None:
    """Several GPUs per node (plan.ranks): bytes per rank and per node, collective traffic,
    predicted tokens/s against one GPU of the same node, and the frozen base per node by GPU count."""
    head = ["setup", "model", "run", "host/node", "GPUs", "fits", "gpu/rank", "own host/rank", "host/node",
            "nvme/node", "base/node", "coll/rank/step", "coll s", "step s", "tokens/s", "1 GPU", "ratio",
            "bottleneck"]
    rows = [head]
    for setup, hw_name, m, label, run, hosts in MULTI:
        hw = load_hardware_profile(hw_name)
        for host in hosts:
            kw = dict(model=m, hardware=hw, gpu_mem=None, cpu_mem=host, nvme_path="/nvme", optimizer="adamw",
                      precision="bf16", batch_size=batch, seq_len=seq, suggest=False, **run)
            try:
                p = make_plan(**kw, nproc_per_node=hw.gpus_per_node)
            except InfeasibleBudget as exc:
                need = ", ".join(f"{t} >= {format_size(b)}" for t, b in exc.minimum.items())
                rows.append([setup, m, label, host, str(hw.gpus_per_node), "no", need] + [""] * 11)
                continue
            r = p.ranks
            single = r.single_tokens_per_s
            rows.append([setup, m, label, host, str(r.world), "yes", format_size(max(r.gpu_peak)),
                         format_size(max(r.private_host)), format_size(r.node["host"]),
                         format_size(r.node["nvme"]) if r.node["nvme"] else "-",
                         format_size(sum(r.base.values())) if any(r.base.values()) else "-",
                         format_size(r.gather_bytes + r.reduce_bytes), f"{r.collective_s:.2f}", f"{p.step_s:.2f}",
                         f"{p.tokens_per_s:,.0f}", f"{single:,.0f}" if single else "-",
                         f"{p.tokens_per_s / single:.2f}" if single else "-", p.bottleneck])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    print(f"tierwise multi-GPU plans (MODELLED: bytes follow the engine's layout; times from the hardware "
          f"profiles): bf16, micro-batch {batch} x {seq} per rank, grad-accum 1 per rank, AdamW, recompute, "
          f"64 MiB chunks, NVMe for what the node's host RAM does not hold; QLoRA = rank 16 on all-linear over "
          f"an NF4 base; '1 GPU' = one rank on the same node with its whole budgets")
    for r in rows:
        print("  ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    print("\nthe frozen base's bytes per node by GPU count (held once per node, read by every local rank):")
    for hw_name, m, host, counts in (("2x-rtx4090-128g", "70b", "64G", (1, 2)),
                                     ("8x-rtx4090-nvme", "405b", "256G", (1, 2, 4, 8))):
        cells = []
        for n in counts:
            p = make_plan(model=m, hardware=hw_name, gpu_mem=None, cpu_mem=host, nvme_path="/nvme", optimizer="adamw",
                          precision="bf16", batch_size=batch, seq_len=seq, suggest=False, nproc_per_node=n,
                          lora_rank=16, base_dtype="nf4", double_quant=True)
            base = p.ranks.base if p.ranks else {t: p.bytes[t].get("base", 0) for t in ("gpu", "host", "cxl", "nvme")}
            cells.append(f"{n} GPU{'s' if n > 1 else ''}: " + " + ".join(
                f"{t} {format_size(b)}" for t, b in base.items() if b))
        print(f"  {m} QLoRA on {hw_name}, host {host}: " + "; ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--lora", action="store_true", help="the LoRA/QLoRA table instead")
    ap.add_argument("--multi", action="store_true", help="the multi-GPU table instead")
    args = ap.parse_args()
    if args.lora:
        lora_table(args.seq)
        return
    if args.multi:
        multi_table(args.seq, args.batch)
        return
    try:
        import deepspeed  # type: ignore # noqa: F401
        ds_note = "deepspeed's estimate_zero3_model_states_mem_needs"
    except ImportError:
        ds_note = "re-derived formula (deepspeed not installed)"

    head = ["hardware", "model", "optimizer", "fits", "gpu", "host", "nvme", "GPU upd", "step s",
            "tokens/s", "bottleneck"]
    rows = [head]
    for hw_name in HARDWARE:
        hw = load_hardware_profile(hw_name)
        for m in MODELS:
            for opt in OPTIMIZERS:
                try:
                    p = make_plan(model=m, hardware=hw, gpu_mem=None, cpu_mem=None, nvme_path="/nvme",
                                  optimizer=opt, precision=args.precision, batch_size=args.batch, seq_len=args.seq)
                except InfeasibleBudget as exc:
                    need = ", ".join(f"{t} >= {format_size(b)}" for t, b in exc.minimum.items())
                    rows.append([hw_name, m, opt, "no", need, "", "", "", "", "", ""])
                    continue
                rows.append([hw_name, m, opt, "yes", format_size(p.peak["gpu"]), format_size(p.peak["host"]),
                             format_size(p.peak["nvme"]) if p.peak["nvme"] else "-",
                             f"{100 * p.gpu_update_params / p.num_params:.1f}%", f"{p.step_s:.2f}",
                             f"{p.tokens_per_s:,.0f}", p.bottleneck])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    print(f"tierwise plans: {args.precision}, batch {args.batch} x {args.seq}, activation checkpointing, "
          "64 MiB chunks, profile budgets (gpu, host) + NVMe")
    for r in rows:
        print(_row(r, widths))

    print(f"\nDeepSpeed ZeRO-3 model-states estimate, 1 GPU ({ds_note}); fits = within the "
          "rtx4090-256g-nvme / h200 budgets")
    budgets = {n: (load_hardware_profile(n).host.memory, load_hardware_profile(n).gpu.memory) for n in HARDWARE}
    head = ["model", "params", "largest", "option", "per CPU", "per GPU", "fits 4090+256G", "fits h200"]
    rows = [head]
    for m in MODELS:
        prof = load_model_profile(m)
        largest = largest_layer_params(prof)
        for label, (cpu, gpu) in deepspeed_zero3_cold(total=prof.num_params, largest=largest).items():
            fits = ["yes" if cpu <= budgets[n][0] and gpu <= budgets[n][1] else "no" for n in HARDWARE]
            rows.append([m, f"{prof.num_params / 1e9:.1f}B", f"{largest / 1e6:.0f}M", label,
                         format_size(cpu), format_size(gpu), *fits])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


if __name__ == "__main__":
    main()
