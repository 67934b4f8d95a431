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
  plain_ckpt  `plain` with transformers' gradient checkpointing: the same recompute as the
              engine's (the equal-work pair of `engine`)
  plain_lora_ckpt, qlora_peft_ckpt  `qlora_peft` with gradient checkpointing (the pair of `qlora`)
  qlora_fits  `qlora_resident` without recompute (the pair of `qlora_peft`)
  bound       what one streamed `engine` step cannot beat, each measured here: its compute
              (`plain_ckpt`'s forward and backward alone), its link (the bytes it streamed per
              step over the `link` bandwidth), its CPU update (`limits`); the step against their max
  syncs       `engine` and `qlora` steps under torch.cuda.set_sync_debug_mode("warn"): the
              implicit synchronisations inside forward and backward, per step
  headline    a Llama-3-70B-shaped QLoRA (80 layers, hidden 8192, r 16 on all linear layers), bf16,
              1 x 2048 tokens, --headline-gpu-mem + --headline-cpu-mem; its NF4 base generated and
              encoded on the GPU from a seed; 3 timed steps; with --headline-layers < 80 a slice of
              the same shape at the proportional budgets, labelled as such, beside the full plan
  long_context  an 8B-shaped QLoRA (32 layers, hidden 4096, intermediate 14336, vocab 128256) at
              --long-gpu-mem: the longest context that trains (a short search), tokens/s at 32K and
              64K, the allocator's peak
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
import functools
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


LONG_RUN_S = 90  # a long-context run starts only with this much time left (an 8B base made, 3 steps)
BASE = [0]  # bytes the CUDA allocator held when the section began (freed before it, in theory)


def figures(t: float, tokens: int, flops_per_token: float, peak_tflops: float, losses: list) -> dict:
    peak = (torch.cuda.max_memory_allocated() - BASE[0]) / 2**30 if CUDA else 0.0
    return {"step_s": t, "tokens_per_s": tokens / t, "mfu": flops_per_token * tokens / t / (peak_tflops * 1e12),
            "cuda_peak_gib": peak, "losses": losses}


def autocast_step(ref, opt, fwd_bwd: "list | None" = None):
    """One plain PyTorch step of `ref` on token ids x (bf16 autocast): the loss. `fwd_bwd`
    collects the seconds of each step's forward and backward alone (synchronised: for the bound)."""
    def step(x):
        x = x.to(DEV)
        t0 = time.perf_counter()
        with torch.autocast(DEV, dtype=torch.bfloat16):
            loss = ref(input_ids=x, labels=x).loss
        loss.backward()
        if fwd_bwd is not None:
            sync()
            fwd_bwd.append(time.perf_counter() - t0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def plain(a, model, data, tokens: int = 0, ckpt: bool = False) -> dict:
    """`ckpt`: transformers' gradient checkpointing (the recompute the engine does)."""
    ref = copy.deepcopy(model).to(DEV)
    if ckpt:
        ref.config.use_cache = False
        ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-5, fused=True)
    fwd_bwd: list = []
    losses, t = timed(autocast_step(ref, opt, fwd_bwd), data)
    out = figures(t, tokens or a.batch * a.seq, 6 * a.n, a.peak_tflops, losses)
    out["fwd_bwd_s"] = statistics.median(fwd_bwd[2:])
    return out


def without_read_guard(run):
    """`run()` with the engine's read guard (a `__torch_function__` on the parameters whose chunks
    are not pinned) not entered: what the guard costs. Only for models whose parameters are read
    by their own modules alone (this Llama: untied head)."""
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


def qlora_peft(a, model, data, ckpt: bool = False) -> dict:
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
    if ckpt:
        ref.config.use_cache = False
        ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-4, fused=True)

    losses, t = timed(autocast_step(ref, opt), data)
    return figures(t, a.batch * a.seq, 4 * a.n, a.peak_tflops, losses)


def bnb_ready() -> None:
    import bitsandbytes  # noqa: F401  (a missing wheel: one line in the section, not a traceback per case)


def sync_debug(a, model, data) -> dict:
    """Implicit synchronisations the launching thread makes inside forward and backward: engine
    steps with torch.cuda.set_sync_debug_mode("warn") on around the engine's forward and
    backward only (the loss's .item() after backward is the step's one wanted sync)."""
    import threading
    import warnings

    from tierwise.offload import Engine, flat_options

    if not CUDA:
        return {"skipped": "no CUDA"}
    out = {}
    cases = (("engine", a.gpu_mem, {}),
             ("qlora", a.lora_gpu_mem, dict(lora=lora_config(), base_dtype="nf4", double_quant=True)))
    for name, gpu_mem, kw in cases:
        eng = Engine(copy.deepcopy(model), **flat_options(lr=1e-5, precision="bf16", gpu_mem=gpu_mem, device=DEV,
                     chunk_bytes=a.chunk, checkpointing=True, **kw))
        seen: list = []

        def show(message, category, filename, lineno, file=None, line=None):
            seen.append((threading.current_thread().name, str(message).splitlines()[0][:120], f"{filename}:{lineno}"))

        def debugged(fn):
            def run(*args, **kwargs):
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    return fn(*args, **kwargs)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            return run

        try:
            for x in data[:2]:
                eng.step({"input_ids": x, "labels": x})
            eng.forward, eng.backward = debugged(eng.forward), debugged(eng.backward)
            # (what the sync debug mode cannot see: the launching thread waiting on a copy's ticket)
            waits, waited = eng.executor.host_waits, eng.executor.wait_seconds
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = show
                for x in data[2:5]:
                    eng.step({"input_ids": x, "labels": x})
            waits, waited = eng.executor.host_waits - waits, eng.executor.wait_seconds - waited
        finally:
            eng.close()
        main = [w for w in seen if w[0] == "MainThread"]
        out[name] = {"per_step": len(main) / 3, "other_threads_per_step": (len(seen) - len(main)) / 3,
                     "ticket_host_waits_per_step": waits / 3, "ticket_wait_s_per_step": waited / 3,
                     "first": [w[1:] for w in main[:5]]}
    out["implicit_syncs_per_step"] = max(out[n]["per_step"] for n, *_ in cases)
    return out


def scaled(a, shape: dict) -> dict:
    """--smoke N: every width and the vocabulary 1/N (heads 1/N, at least 2), layers 1/8: the
    code path on a CPU, not the figures."""
    if not a.smoke:
        return shape
    n = a.smoke
    out = {k: max(2, v // n) for k, v in shape.items()}
    out["kv"] = max(1, out["heads"] // max(1, shape["heads"] // shape["kv"]))
    if "layers" in shape:
        out["layers"] = max(2, shape["layers"] // 8)
    return out


def llama_meta(*, layers: int, hidden: int, intermediate: int, heads: int, kv: int, vocab: int):
    """A Llama of this shape on the meta device (no bytes: the engine's init fills its chunks)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                      max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=False)
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):  # (the rotary buffers real: they are not chunked)
        return LlamaForCausalLM(cfg)


def rss_gib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**30


def with_adapters(model):
    """PEFT's adapters (r 16, all linear layers of the blocks) on a meta-device model, with values
    (as `finetune --qlora` injects them: offload.engine.lora.inject_meta)."""
    from tierwise.offload.engine.lora import inject_meta

    inject_meta(model, lora_config(), seed=7)
    return model


def qlora_engine(model, *, gpu_mem, cpu_mem, activations=None, **kw):
    """The engine of a generated QLoRA run: r 16 on all linear layers, NF4 + double quant base
    generated and encoded on the GPU from a seed (initialising it on the CPU takes minutes)."""
    from tierwise.offload import Engine, flat_options

    groups = {} if activations is None else {"activations": activations}  # (an Activations group itself)
    eng = Engine(with_adapters(model), **flat_options(lr=1e-4, precision="bf16", gpu_mem=gpu_mem, cpu_mem=cpu_mem,
                 device=DEV, base_dtype="nf4", double_quant=True, **kw), **groups)
    eng.init_weights_(seed=0, frozen_only=True, device=DEV)
    return eng


def headline(a, remaining: float) -> dict:
    """The 70B-shaped QLoRA at --headline-gpu-mem + --headline-cpu-mem, or a slice of it."""
    from tierwise.offload.core.errors import InfeasibleBudget
    from tierwise.offload.core.sizes import parse_size
    from tierwise.offload.core.units import format_size
    from tierwise.offload.plan.planner import choose_recompute, make_plan
    from tierwise.profiles import ModelProfile

    if remaining < 60:  # (a 16-layer slice's setup and steps: about a minute; the run's timeout would cut it)
        return {"skipped": f"{remaining:.0f} s left"}
    full = 80
    layers = a.headline_layers or (full if remaining > 330 else 16)
    shape = scaled(a, dict(hidden=8192, intermediate=28672, heads=64, kv=8, vocab=128256))
    seq = 2048 // a.smoke if a.smoke else 2048
    gpu, cpu = parse_size(a.headline_gpu_mem), parse_size(a.headline_cpu_mem)
    out: dict = {"layers": layers, "slice": layers < full, "seq": seq,
                 "budgets": {"gpu": a.headline_gpu_mem, "cpu": a.headline_cpu_mem}}

    def plan_of(n_layers, g, c, recompute=None):
        m = llama_meta(layers=n_layers, **shape)
        return make_plan(model=ModelProfile.from_hf_config(m.config), hardware=a.profile or "h100", gpu_mem=g,
                         cpu_mem=c, optimizer="adamw", precision="bf16", batch_size=1, seq_len=seq,
                         lora_rank=16, base_dtype="nf4", double_quant=True, cuda=CUDA, checkpointing=recompute)

    plan_full = plan_of(full, gpu, cpu)
    out["plan_full"] = {"step_s": plan_full.step_s, "tokens_per_s": seq / plan_full.step_s,
                        "bottleneck": plan_full.bottleneck, "phases": plan_full.phases}
    if layers < full:  # the slice: the budgets in proportion (raised to the slice's minimum where below it)
        gpu, cpu = gpu * layers // full, cpu * layers // full
        out["budgets"] = {"gpu": format_size(gpu), "cpu": format_size(cpu), "proportional_to": f"{layers}/{full}"}
    try:
        plan = plan_of(layers, gpu, cpu)
    except InfeasibleBudget as exc:
        gpu = max(gpu, exc.minimum.get("gpu", 0) * 5 // 4)
        cpu = max(cpu, exc.minimum.get("host", 0) * 5 // 4)
        out["budgets"] |= {"gpu": format_size(gpu), "cpu": format_size(cpu),
                           "raised": f"proportional budgets below the slice's minimum: {exc}"[:300]}
        plan = plan_of(layers, gpu, cpu)
    # the layers recomputed as `finetune` would choose them (cli.planning.resolve_recompute)
    def plan_or_none(n):
        try:
            return plan_of(layers, gpu, cpu, n)
        except InfeasibleBudget:
            return None

    recompute = choose_recompute(functools.cache(plan_or_none), keep_when_fits=False)
    recompute = layers if recompute is None else recompute
    plan = plan_of(layers, gpu, cpu, recompute)
    out["recomputed"] = recompute
    model = llama_meta(layers=layers, **shape)
    t0 = time.perf_counter()
    eng = qlora_engine(model, gpu_mem=gpu, cpu_mem=cpu, checkpointing=recompute)
    out["setup_s"] = time.perf_counter() - t0
    g = torch.Generator().manual_seed(3)
    data = [torch.randint(0, shape["vocab"], (1, seq), generator=g) for _ in range(5)]
    try:
        fetched = []

        def on_warm():
            fetched.append(eng.cache.fetched_bytes)
            torch.cuda.reset_peak_memory_stats() if CUDA else None

        losses, t = timed(lambda x: eng.step({"input_ids": x, "labels": x}), data, on_warm)
        link_bytes = (eng.cache.fetched_bytes - fetched[0]) / 3
        h2d = a.link_h2d_gbs * 1e9 if a.link_h2d_gbs else None
        n_params = sum(s.numel for s in eng.plan.slots.values())
        compute_s = 8 * n_params * seq / (a.peak_tflops * 1e12 * 0.6)  # recompute: ~8N FLOP per token at 60% of peak
        link_s = link_bytes / h2d if h2d else None
        out.update(tokens_per_s=seq / t, step_s=t, losses=losses,
                   allocator_peak_gib=torch.cuda.max_memory_allocated() / 2**30 if CUDA else 0.0,
                   host_rss_gib=rss_gib(),
                   pinned_gib=(eng.tiers.pinner.registered if eng.tiers.pinner else 0) / 2**30,
                   ledger_host_gib=eng.ledger.used("host") / 2**30,
                   ledger_peaks_gib={k: v / 2**30 for k, v in eng.ledger.peaks().items()},
                   link_gb_per_step=link_bytes / 1e9, plan_step_s=plan.step_s,
                   plan_over_measured=plan.step_s / t, compute_s_at_60pct=compute_s, link_s=link_s,
                   counters=dict(eng.counters))
        out["bound_s"] = max(x for x in (compute_s, link_s or 0.0) if x is not None)
    finally:
        eng.close()
    return out


def long_context(a, remaining: float) -> dict:
    """The 8B-shaped QLoRA at --long-gpu-mem: the longest context that trains (the planner's
    longest first, then down by 1/8 until a step fits), tokens/s at 32K and 64K tokens."""
    from tierwise.offload.plan.planner import make_plan
    from tierwise.profiles import ModelProfile

    shape = scaled(a, dict(layers=32, hidden=4096, intermediate=14336, heads=32, kv=8, vocab=128256))
    out: dict = {"gpu_mem": a.long_gpu_mem, "cpu_mem": a.long_cpu_mem}

    profile = ModelProfile.from_hf_config(llama_meta(**shape).config)
    div = a.smoke or 1

    def plan_at(seq: int):
        return make_plan(model=profile, hardware=a.profile or "h100", gpu_mem=a.long_gpu_mem,
                         cpu_mem=a.long_cpu_mem, optimizer="adamw", precision="bf16", batch_size=1, seq_len=seq,
                         lora_rank=16, base_dtype="nf4", double_quant=True, offload_activations=True, cuda=CUDA)

    def run(seq: int, steps: int = 2) -> dict:
        from tierwise.offload import Activations

        plan = plan_at(seq)
        eng = qlora_engine(llama_meta(**shape), gpu_mem=a.long_gpu_mem, cpu_mem=a.long_cpu_mem,
                           activations=Activations(recompute=True, offload=True,
                                                   expected=plan.reserve["gpu"]["activations"],
                                                   host=plan.reserve["host"].get("activations", 0)))
        try:
            g = torch.Generator().manual_seed(4)
            xs = [torch.randint(0, shape["vocab"], (1, seq), generator=g) for _ in range(steps + 1)]
            if CUDA:
                torch.cuda.reset_peak_memory_stats()
            eng.step({"input_ids": xs[0], "labels": xs[0]})
            times = []
            for x in xs[1:]:
                sync()
                t0 = time.perf_counter()
                eng.step({"input_ids": x, "labels": x})
                sync()
                times.append(time.perf_counter() - t0)
            return {"seq": seq, "tokens_per_s": seq / statistics.median(times),
                    "allocator_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if CUDA else 0.0,
                    "plan_step_s": plan.step_s}
        finally:
            eng.close()
            gc.collect()
            if CUDA:
                torch.cuda.empty_cache()

    def fits(seq: int) -> bool:
        try:
            plan_at(seq)
            return True
        except Exception:  # noqa: BLE001 - InfeasibleBudget: it does not
            return False

    step = 1024 // div  # the planner's longest (as `finetune plan --seq-len max`), to 1024 tokens
    lo, n = 0, 8 * step
    while n <= (1 << 21) // div and fits(n):
        lo, n = n, n * 2
    hi = n
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    top = lo or 8 * step
    t_start = time.perf_counter()
    for seq in (32768, 65536):
        key = f"at_{seq // 1024}k"
        if time.perf_counter() - t_start > remaining - LONG_RUN_S:
            out[key] = {"skipped": "deadline"}
            continue
        try:
            out[key] = run(seq // div)
        except Exception as exc:  # noqa: BLE001 - the figure is the refusal
            out[key] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    out["planned_max_tokens"] = top
    seq, best = top, None
    for _ in range(3):  # a short search: the planned longest, then 7/8 of it, twice
        if time.perf_counter() - t_start > remaining - LONG_RUN_S:
            out.setdefault("refused", []).append({"seq": seq, "error": "not tried: deadline"})
            break
        try:
            best = run(seq, steps=1)
            break
        except Exception as exc:  # noqa: BLE001
            out.setdefault("refused", []).append({"seq": seq, "error": f"{type(exc).__name__}: {exc}"[:200]})
            seq = seq * 7 // 8 // step * step
    out["max_tokens"] = best["seq"] if best else None
    out["max_run"] = best
    out["tokens_per_s_32k"] = out["at_32k"].get("tokens_per_s")
    out["tokens_per_s_64k"] = out["at_64k"].get("tokens_per_s")
    out["allocator_peak_gib"] = max((r.get("allocator_peak_gib", 0) for r in (out["at_32k"], out["at_64k"], best or {})
                                     if isinstance(r, dict)), default=0)
    return out


KEYS = ("equal_work_streamed_ratio", "equal_work_bound_ratio", "cpu_update_s", "resident_ratio", "qlora_ckpt_ratio",
        "qlora_fits_ratio", "implicit_syncs_per_step")


def derive(a, res: dict) -> dict:
    """The issue's keys from the sections' figures (None where a section did not run)."""
    def step(name):
        return res.get(name, {}).get("step_s")

    def ratio(x, y):
        return step(x) / step(y) if step(x) and step(y) else None

    out = dict.fromkeys(KEYS)
    out["equal_work_streamed_ratio"] = ratio("engine", "plain_ckpt")
    out["resident_ratio"] = ratio("resident", "plain")
    out["qlora_ckpt_ratio"] = ratio("qlora", "qlora_peft_ckpt")
    out["qlora_fits_ratio"] = ratio("qlora_fits", "qlora_peft")
    out["cpu_update_s"] = res.get("limits", {}).get("adamw_update_s")
    out["implicit_syncs_per_step"] = res.get("syncs", {}).get("implicit_syncs_per_step")
    compute = res.get("plain_ckpt", {}).get("fwd_bwd_s")
    h2d = res.get("link", {}).get("h2d_gbs")
    fetched = res.get("engine", {}).get("timed_fetched_gib_per_step")
    link = fetched * 2**30 / (h2d * 1e9) if h2d and fetched is not None else None
    parts = {"compute_s": compute, "link_s": link, "cpu_update_s": out["cpu_update_s"]}
    known = [v for v in parts.values() if v is not None]
    if step("engine") and known:
        out["equal_work_bound_ratio"] = step("engine") / max(known)
    out["bound_parts"] = parts
    return out


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
    ap.add_argument("--headline-layers", type=int, default=0,
                    help="80: the full 70B shape; fewer: a slice at proportional budgets; 0: 80 if the time allows")
    ap.add_argument("--headline-gpu-mem", default="24G")
    ap.add_argument("--headline-cpu-mem", default="64G")
    ap.add_argument("--long-gpu-mem", default="24G")
    ap.add_argument("--long-cpu-mem", default="64G")
    ap.add_argument("--smoke", type=int, default=0, help="shrink the headline and long-context shapes N times "
                    "(a CPU check of their code, with --headline-layers, and small budgets)")
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
    a.link_h2d_gbs = None
    sections = {
        "link": lambda: link_bandwidth() if CUDA else {"skipped": "no CUDA"},
        "plain": lambda: plain(a, model, data),
        "plain_ckpt": lambda: plain(a, model, data, ckpt=True),
        "engine": lambda: engine(a, model, data, gpu_mem=a.gpu_mem),
        "resident": lambda: engine(a, model, data, gpu_mem="100G", checkpointing=False),
        "limits": lambda: limits(a),
        "qlora_peft": lambda: (bnb_ready(), qlora_peft(a, model, data))[1],
        "qlora_peft_ckpt": lambda: (bnb_ready(), qlora_peft(a, model, data, ckpt=True))[1],
        "qlora": lambda: engine(a, model, data, gpu_mem=a.lora_gpu_mem, lora=lora_config(),
                                base_dtype="nf4", double_quant=True),
        "qlora_fits": lambda: engine(a, model, data, gpu_mem="100G", lora=lora_config(), base_dtype="nf4",
                                     double_quant=True, checkpointing=False),
        "syncs": lambda: sync_debug(a, model, data),
        "headline": lambda: headline(a, a.deadline - (time.perf_counter() - start)),
        "long_context": lambda: long_context(a, a.deadline - (time.perf_counter() - start)),
        "engine_sequential": lambda: engine(a, model, data, gpu_mem=a.gpu_mem, overlap_update=False),
        "engine_noguard": lambda: without_read_guard(lambda: engine(a, model, data, gpu_mem=a.gpu_mem)),
        "plain_big": lambda: plain(a, model, big_data(a), tokens=a.batch * a.big_seq),
        "engine_big": lambda: engine(a, model, big_data(a), gpu_mem=a.big_gpu_mem, tokens=a.batch * a.big_seq),
        "qlora_resident": lambda: engine(a, model, data, gpu_mem="100G", lora=lora_config(),
                                         base_dtype="nf4", double_quant=True),
        "capped": lambda: engine(a, model, data, gpu_mem=a.gpu_mem, cap=True),
        "adamw8bit": lambda: engine(a, model, data, gpu_mem=a.gpu_mem, optimizer="adamw8bit"),
        "profile": lambda: {"engine": profiled(a, model, data, name="engine", gpu_mem=a.gpu_mem),
                            "qlora": profiled(a, model, data, name="qlora", gpu_mem=a.lora_gpu_mem,
                                              lora=lora_config(), base_dtype="nf4", double_quant=True)},
    }
    only = [s for s in a.only.split(",") if s] or list(sections)
    stopped = False
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
        except KeyboardInterrupt:  # (the shell's timeout, SIGINT): the figures so far are kept and summed up
            res[name] = {"error": "interrupted: the run's time was up"}
            stopped = True
        except Exception as exc:  # one broken section must not hide the others' figures
            traceback.print_exc()
            res[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        res[name]["section_s"] = time.perf_counter() - t0
        res[name]["cuda_base_gib"] = BASE[0] / 2**30
        print(name, json.dumps(res[name]), flush=True)
        if name == "link":
            a.link_h2d_gbs = res[name].get("h2d_gbs")
        res["derived"] = derive(a, res)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({**keyed(res), "sections": res}, f, indent=1)
        if stopped:
            break
    summary(a, res)


def keyed(res: dict) -> dict:
    """The committed JSON's top-level keys (bench/results/gpu_check-DATE-DEVICE.json)."""
    d = res.get("derived", {})
    h = res.get("headline", {})
    lc = res.get("long_context", {})
    return {**{k: d.get(k) for k in KEYS}, "bound_parts": d.get("bound_parts"),
            "headline": {k: h.get(k) for k in ("layers", "slice", "tokens_per_s", "allocator_peak_gib", "host_rss_gib",
                                                "pinned_gib", "ledger_host_gib", "link_gb_per_step", "step_s",
                                                "plan_step_s", "bound_s", "recomputed")},
            "long_context": {k: lc.get(k) for k in ("max_tokens", "tokens_per_s_32k", "tokens_per_s_64k",
                                                    "allocator_peak_gib")}}


def summary(a, res: dict) -> None:
    print(f"\n{res['device']}: {a.n / 1e9:.2f}B params, batch {a.batch} x {a.seq}")
    if "h2d_gbs" in res.get("link", {}):
        print(f"link  h2d {res['link']['h2d_gbs']:.1f} GB/s  d2h {res['link']['d2h_gbs']:.1f} GB/s")
    for name in ("plain", "plain_ckpt", "engine", "qlora_peft_ckpt", "qlora_fits", "engine_sequential", "engine_noguard", "plain_big", "engine_big", "capped", "resident", "adamw8bit", "qlora_peft", "qlora", "qlora_resident"):
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
    print("issue keys:", json.dumps(keyed(res)))
    for x, y in (("engine", "plain_ckpt"), ("qlora", "qlora_peft_ckpt"), ("qlora_fits", "qlora_peft"), ("engine", "plain"), ("engine_big", "plain_big"), ("engine_noguard", "engine"), ("engine_sequential", "engine"), ("resident", "plain"), ("adamw8bit", "plain"), ("qlora", "qlora_peft"),
                 ("qlora", "qlora_resident")):
        if "step_s" in res.get(x, {}) and "step_s" in res.get(y, {}):
            print(f"{x}/{y} step time = {res[x]['step_s'] / res[y]['step_s']:.2f}")


if __name__ == "__main__":
    main()
