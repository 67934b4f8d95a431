"""The CUDA figures a lent GPU is for, in one short run (bench/gpu_check.sh calls this).

Each section runs on its own (a failing one prints its traceback and the next goes on) and
prints one JSON line; a summary follows. Sections:
  link        pinned host <-> device copy bandwidth (GB/s), 1 GiB each way
  plain       a ~1B random Llama (hidden 2048, 16 layers, vocab 32000) in plain PyTorch on the
              GPU: bf16 autocast over fp32 weights, fused AdamW; tokens/s and MFU
  engine      the same model and data through the Engine (bf16 compute copies, fp32 master and
              AdamW state on the host, update on the CPU), streamed under --gpu-mem
  engine_sequential  `engine` with overlap_update=False: backward alone, then the whole update
  engine_noguard  `engine` without its read guard (what the guard's per-call Python costs)
  plain_big, engine_big  `plain` and `engine` at --big-seq tokens per row (the CPU's per-op
              overheads weigh less against the GPU's work), the engine under --big-gpu-mem
  capped      `engine` with the CUDA allocator itself capped at --gpu-mem (an OOM = bytes the
              ledger misses)
  resident    the Engine with a budget the whole model fits, no recompute (what the engine
              costs by itself)
  adamw8bit   `engine` with AdamW8bit (8-bit state on the host, our C kernel)
  qlora_peft  PEFT LoRA (r 16, all linear layers of the blocks) over bitsandbytes Linear4bit
              (NF4, double quant, bf16 compute), the whole 4-bit base on the GPU
  qlora       the same adapters through the Engine: NF4 base on the host, streamed under
              --lora-gpu-mem, decoded on the GPU
  qlora_resident  `qlora` with a budget the whole base fits (streamed / resident)
  limits      what bounds the streamed step on this host: DRAM copy bandwidth, torch's fused
              CPU AdamW and our AdamW8bit kernel over all the model's parameters (one update)
  profile     one streamed `engine` step (and one `qlora` step) under torch.profiler: the
              top ops by CPU and by device time, the device's busy time (kernels, copies) vs
              the step's wall time; a Chrome trace per run lands in --trace-dir
MFU = 6 * params * tokens/s / peak bf16 FLOP/s (--peak-tflops, 989 for an H200 SXM); for LoRA
4 * params (no weight gradient of the base), reported as `mfu`.

    python bench/gpu_check.py [--layers 16] [--steps 6] [--gpu-mem 6G] [--deadline 300]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import time
import traceback

import torch

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"  # cpu: a smoke test of this script on a tiny model (--layers 2)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def link_bandwidth(nbytes: int = 1 << 30) -> dict:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, dst, src in (("h2d_gbs", dev, host), ("d2h_gbs", host, dev)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out[name] = 3 * nbytes / (time.perf_counter() - t0) / 1e9
    return out


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def build(layers: int, hidden: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4,
                      max_position_embeddings=8192, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def timed(step, data: list, on_warm=None) -> tuple[list[float], float]:
    losses, times = [], []
    for i, x in enumerate(data):
        if i == 2 and on_warm is not None:
            on_warm()
        sync()
        t0 = time.perf_counter()
        losses.append(float(step(x)))
        sync()
        if i >= 2:  # two warm-up steps (the engine traces and places in its first)
            times.append(time.perf_counter() - t0)
    return losses, statistics.median(times)


BASE = [0]  # bytes the CUDA allocator held when the section began (freed before it, in theory)


def figures(t: float, tokens: int, flops_per_token: float, peak_tflops: float, losses: list) -> dict:
    peak = (torch.cuda.max_memory_allocated() - BASE[0]) / 2**30 if CUDA else 0.0
    return {"step_s": t, "tokens_per_s": tokens / t, "mfu": flops_per_token * tokens / t / (peak_tflops * 1e12),
            "cuda_peak_gib": peak, "losses": losses}


def autocast_step(ref, opt):
    """One plain PyTorch step of `ref` on token ids x (bf16 autocast): the loss."""
    def step(x):
        x = x.to(DEV)
        with torch.autocast(DEV, dtype=torch.bfloat16):
            loss = ref(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def plain(a, model, data, tokens: int = 0) -> dict:
    ref = copy.deepcopy(model).to(DEV)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-5, fused=True)

    losses, t = timed(autocast_step(ref, opt), data)
    return figures(t, tokens or a.batch * a.seq, 6 * a.n, a.peak_tflops, losses)


def without_read_guard(run):
    """`run()` with the engine's read guard (a TorchFunctionMode over every torch call of the
    forward and the recompute) not entered: what the guard costs. Only for models whose
    parameters are read by their own modules alone (this Llama: untied head)."""
    from tierwise.offload.engine.reads import ReadGuard

    enter, exit_ = ReadGuard.__enter__, ReadGuard.__exit__
    ReadGuard.__enter__, ReadGuard.__exit__ = lambda self: self, lambda self, *exc: None
    try:
        return run()
    finally:
        ReadGuard.__enter__, ReadGuard.__exit__ = enter, exit_


def big_data(a) -> list:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, 32000, (a.batch, a.big_seq), generator=g) for _ in range(a.steps + 2)]


def engine(a, model, data, *, gpu_mem: str, cap: bool = False, tokens: int = 0, **kw) -> dict:
    """`cap`: the CUDA allocator itself is limited to the gpu budget (on top of what it already
    held), so any byte the ledger does not count but the run needs shows as an OOM."""
    from tierwise.offload import Engine, flat_options
    from tierwise.offload.core.sizes import parse_size

    if cap and CUDA:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, (BASE[0] + parse_size(gpu_mem)) / total))
    kw = {"checkpointing": True} | kw
    t0 = time.perf_counter()
    eng = Engine(copy.deepcopy(model), **flat_options(lr=1e-5, precision="bf16", gpu_mem=gpu_mem, device=DEV,
                 chunk_bytes=a.chunk, **kw))
    setup = time.perf_counter() - t0
    warm = {}

    def on_warm():  # phase times, waits, fetches of the timed steps only (the warm-ups trace and place)
        warm.update(phase=dict(eng.phase_times), wait=eng.executor.wait_seconds, fetched=eng.cache.fetched_bytes)

    try:
        losses, t = timed(lambda x: eng.step({"input_ids": x, "labels": x}), data, on_warm)
        flops = (4 if kw.get("lora") is not None else 6) * a.n
        out = figures(t, tokens or a.batch * a.seq, flops, a.peak_tflops, losses)
        peaks = eng.ledger.peaks()
        if a.profile:  # the planner's step on this machine's measured profile, beside the measurement
            out["plan"] = planned(a, model, gpu_mem=gpu_mem, seq=data[0].shape[1], **kw)
            out["plan_over_measured"] = out["plan"]["step_s"] / out["step_s"]
        out.update(setup_s=setup, gpu_budget=gpu_mem, ledger_peaks_gib={k: v / 2**30 for k, v in peaks.items()},
                   copy_wait_s=eng.executor.wait_seconds, phase_s=dict(eng.phase_times),
                   per_step_phase_s={k: (v - warm["phase"][k]) / (len(data) - 2) for k, v in eng.phase_times.items()},
                   per_step_wait_s=(eng.executor.wait_seconds - warm["wait"]) / (len(data) - 2),
                   timed_fetched_gib_per_step=(eng.cache.fetched_bytes - warm["fetched"]) / 2**30 / (len(data) - 2),
                   workspace_gib=eng.workspace.bytes / 2**30,
                   # host memory registered for the copies against the ledger's host bytes (equal to the page)
                   pinned_gib=(eng.tiers.pinner.registered if eng.tiers.pinner else 0) / 2**30,
                   ledger_host_gib=eng.ledger.used("host") / 2**30)
        return out
    finally:
        eng.close()
        if cap and CUDA:
            torch.cuda.set_per_process_memory_fraction(1.0)


def planned(a, model, *, gpu_mem: str, seq: int, **kw) -> dict:
    """`finetune plan` of an `engine` section's run on the profile at --profile."""
    from tierwise.offload.plan.planner import make_plan
    from tierwise.profiles import ModelProfile

    lora = kw.get("lora")
    plan = make_plan(model=ModelProfile.from_hf_config(model.config), hardware=a.profile, gpu_mem=gpu_mem,
                     cpu_mem=None, optimizer=kw.get("optimizer", "adamw"), precision="bf16", batch_size=a.batch,
                     seq_len=seq, chunk_bytes=a.chunk, checkpointing=kw.get("checkpointing", True),
                     lora_rank=lora.r if lora is not None else None, base_dtype=kw.get("base_dtype"),
                     double_quant=kw.get("double_quant", False), cuda=CUDA)
    return {"step_s": plan.step_s, "bottleneck": plan.bottleneck, "phases": plan.phases}


def qlora_peft(a, model, data) -> dict:
    import bitsandbytes as bnb
    import peft

    m = copy.deepcopy(model)
    head = m.get_output_embeddings()
    for mod in list(m.modules()):
        for name, child in list(mod.named_children()):
            if type(child) is torch.nn.Linear and child is not head:
                q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                      compute_dtype=torch.bfloat16, quant_type="nf4", compress_statistics=True)
                q.weight = bnb.nn.Params4bit(child.weight.data.clone(), requires_grad=False, quant_type="nf4",
                                             compress_statistics=True)
                setattr(mod, name, q)
    for p in m.parameters():
        p.requires_grad_(False)
    torch.manual_seed(7)
    ref = peft.get_peft_model(m, lora_config()).to(DEV)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-4, fused=True)

    losses, t = timed(autocast_step(ref, opt), data)
    return figures(t, a.batch * a.seq, 4 * a.n, a.peak_tflops, losses)


def limits(a) -> dict:
    """What bounds a streamed step with the update on the CPU: one update of all `a.n` parameters
    at the measured CPU optimizer rates (tierwise.offload.tools.profiler), and DRAM bandwidth."""
    from tierwise.offload.tools.profiler import Sizes, dram_bandwidth, optimizer_rates

    sz = Sizes(copy_bytes=1 << 30, nvme_bytes=0, optim_numel=(64 << 20) if CUDA else (1 << 20), gemm_n=0,
               repeats=3)
    rates = optimizer_rates(sz)
    return {"dram_gbs": dram_bandwidth(sz), "threads": torch.get_num_threads(),
            "adamw_update_s": a.n / rates["adamw"], "adamw8bit_update_s": a.n / rates["adamw8bit"]}


def profiled(a, model, data, *, name: str, gpu_mem: str, **kw) -> dict:
    """One engine step under torch.profiler (after two warm-ups): top ops, device busy time."""
    from torch.profiler import ProfilerActivity, profile

    from tierwise.offload import Engine, flat_options

    eng = Engine(copy.deepcopy(model), **flat_options(lr=1e-5, precision="bf16", gpu_mem=gpu_mem, device=DEV,
                 chunk_bytes=a.chunk, **({"checkpointing": True} | kw)))
    try:
        for x in data[:2]:
            eng.step({"input_ids": x, "labels": x})
        sync()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            eng.step({"input_ids": data[2], "labels": data[2]})
            sync()
            wall = time.perf_counter() - t0
    finally:
        eng.close()
    ka = prof.key_averages()
    print(f"--- profile {name}: top by self CPU time (threads the profiler records)")
    print(ka.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
    out = {"wall_s": wall}
    if CUDA:
        print(f"--- profile {name}: top by self device time")
        print(ka.table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=60))
        dev = [(e.key, e.self_device_time_total / 1e6) for e in ka if e.self_device_time_total > 0]
        out["device_copy_s"] = sum(t for k, t in dev if "memcpy" in k.lower() or "memset" in k.lower())
        out["device_kernel_s"] = sum(t for k, t in dev) - out["device_copy_s"]
    if a.trace_dir:
        prof.export_chrome_trace(f"{a.trace_dir}/trace_{name}.json")
    return out


def lora_config():
    import peft

    return peft.LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, lora_dropout=0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--gpu-mem", default="6G")
    ap.add_argument("--lora-gpu-mem", default="3G")
    ap.add_argument("--big-seq", type=int, default=4096)
    ap.add_argument("--big-gpu-mem", default="12G")
    ap.add_argument("--chunk", default="64M")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--deadline", type=float, default=300.0, help="seconds; later sections are skipped")
    ap.add_argument("--only", default="", help="comma-separated sections (default: all)")
    ap.add_argument("--json", default="", help="write the figures here too")
    ap.add_argument("--trace-dir", default="", help="profile: write Chrome traces here")
    ap.add_argument("--profile", default="", help="a hardware profile TOML of this machine (finetune profile): "
                    "each engine section prints the planner's step beside the measured one")
    a = ap.parse_args()
    start = time.perf_counter()
    res: dict = {"device": torch.cuda.get_device_name() if CUDA else "cpu (smoke test)"}
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 32000, (a.batch, a.seq), generator=g) for _ in range(a.steps + 2)]
    model = build(a.layers, a.hidden)
    a.n = sum(p.numel() for p in model.parameters())
    res["params"] = a.n
    print(json.dumps(res), flush=True)
    sections = {
        "link": lambda: link_bandwidth() if CUDA else {"skipped": "no CUDA"},
        "plain": lambda: plain(a, model, data),
        "engine": lambda: engine(a, model, data, gpu_mem=a.gpu_mem),
        "engine_sequential": lambda: engine(a, model, data, gpu_mem=a.gpu_mem, overlap_update=False),
        "engine_noguard": lambda: without_read_guard(lambda: engine(a, model, data, gpu_mem=a.gpu_mem)),
        "plain_big": lambda: plain(a, model, big_data(a), tokens=a.batch * a.big_seq),
        "engine_big": lambda: engine(a, model, big_data(a), gpu_mem=a.big_gpu_mem, tokens=a.batch * a.big_seq),
        "qlora_peft": lambda: qlora_peft(a, model, data),
        "qlora": lambda: engine(a, model, data, gpu_mem=a.lora_gpu_mem, lora=lora_config(),
                                base_dtype="nf4", double_quant=True),
        "qlora_resident": lambda: engine(a, model, data, gpu_mem="100G", lora=lora_config(),
                                         base_dtype="nf4", double_quant=True),
        "capped": lambda: engine(a, model, data, gpu_mem=a.gpu_mem, cap=True),
        "resident": lambda: engine(a, model, data, gpu_mem="100G", checkpointing=False),
        "adamw8bit": lambda: engine(a, model, data, gpu_mem=a.gpu_mem, optimizer="adamw8bit"),
        "limits": lambda: limits(a),
        "profile": lambda: {"engine": profiled(a, model, data, name="engine", gpu_mem=a.gpu_mem),
                            "qlora": profiled(a, model, data, name="qlora", gpu_mem=a.lora_gpu_mem,
                                              lora=lora_config(), base_dtype="nf4", double_quant=True)},
    }
    only = [s for s in a.only.split(",") if s] or list(sections)
    for name in only:
        if time.perf_counter() - start > a.deadline:
            res[name] = {"skipped": "deadline"}
            print(name, "skipped: deadline", flush=True)
            continue
        gc.collect()  # an engine of the section before is freed here, not at some later collection
        if CUDA:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            BASE[0] = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        try:
            res[name] = sections[name]()
        except Exception as exc:  # one broken section must not hide the others' figures
            traceback.print_exc()
            res[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        res[name]["section_s"] = time.perf_counter() - t0
        res[name]["cuda_base_gib"] = BASE[0] / 2**30
        print(name, json.dumps(res[name]), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
    summary(a, res)


def summary(a, res: dict) -> None:
    print(f"\n{res['device']}: {a.n / 1e9:.2f}B params, batch {a.batch} x {a.seq}")
    if "h2d_gbs" in res.get("link", {}):
        print(f"link  h2d {res['link']['h2d_gbs']:.1f} GB/s  d2h {res['link']['d2h_gbs']:.1f} GB/s")
    for name in ("plain", "engine", "engine_sequential", "engine_noguard", "plain_big", "engine_big", "capped", "resident", "adamw8bit", "qlora_peft", "qlora", "qlora_resident"):
        r = res.get(name, {})
        if "tokens_per_s" not in r:
            print(f"{name:10s} {r.get('error') or r.get('skipped') or 'not run'}")
            continue
        extra = ""
        if "ledger_peaks_gib" in r:
            extra = (f"  ledger gpu peak {r['ledger_peaks_gib'].get('gpu', 0):.2f} GiB (budget {r['gpu_budget']}),"
                     f" {r['timed_fetched_gib_per_step']:.2f} GiB streamed per timed step, setup {r['setup_s']:.0f} s")
        print(f"{name:10s} {r['tokens_per_s']:9,.0f} tok/s  MFU {r['mfu']:6.1%}  step {r['step_s']:.3f} s"
              f"  cuda peak {r['cuda_peak_gib']:.2f} GiB{extra}  losses {[round(x, 4) for x in r['losses'][:3]]}")
        if "per_step_phase_s" in r:
            print(" " * 11 + "per timed step, host wall: " + ", ".join(
                f"{k} {v:.3f} s" for k, v in r["per_step_phase_s"].items()) + f", waiting on copies {r['per_step_wait_s']:.3f} s")
        if "plan" in r:
            print(" " * 11 + f"planned {r['plan']['step_s']:.3f} s ({r['plan']['bottleneck']}-bound): "
                  f"plan / measured {r['plan_over_measured']:.2f} (goal 0.75-1.25)")
    if "dram_gbs" in res.get("limits", {}):
        li = res["limits"]
        print(f"limits     DRAM copy {li['dram_gbs']:.1f} GB/s ({li['threads']} threads); one CPU update of all"
              f" {a.n / 1e9:.2f}B params: fused AdamW {li['adamw_update_s']:.3f} s, AdamW8bit {li['adamw8bit_update_s']:.3f} s")
    for name, r in res.get("profile", {}).items():
        if isinstance(r, dict) and "device_kernel_s" in r:
            print(f"profile {name}: step {r['wall_s']:.3f} s, device kernels {r['device_kernel_s']:.3f} s,"
                  f" copies {r['device_copy_s']:.3f} s (busy {r['device_kernel_s'] / r['wall_s']:.0%} of the step)")
    for x, y in (("engine", "plain"), ("engine_big", "plain_big"), ("engine_noguard", "engine"), ("engine_sequential", "engine"), ("resident", "plain"), ("adamw8bit", "plain"), ("qlora", "qlora_peft"),
                 ("qlora", "qlora_resident")):
        if "step_s" in res.get(x, {}) and "step_s" in res.get(y, {}):
            print(f"{x}/{y} step time = {res[x]['step_s'] / res[y]['step_s']:.2f}")


if __name__ == "__main__":
    main()
