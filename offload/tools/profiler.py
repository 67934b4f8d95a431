"""Profiler: measure this machine into a hardware profile TOML that `load_hardware_profile` reads.

What is measured (each a short timed loop; `quick=True` shrinks every size for tests):
- host <-> device copies, both ways, pinned and pageable (CUDA); on the simulated device the
  memcpy bandwidth stands for the link;
- NVMe read/write through the engine's own IO path (`offload.runtime.nvme.NvmeStore`, O_DIRECT);
- DRAM bandwidth (a large copy: read + write bytes);
- each CXL node (`offload.runtime.cxl.detect_cxl_nodes`): copies into a buffer bound to it;
- CPU optimizer throughput: torch fused AdamW and `optim.adamw8bit.adamw8bit_step_`;
- matmul throughput on the device (bf16 and fp32) and on the CPU (fp32);
- the host's cost per op: on the simulated device a hooked small op's dispatch; on CUDA a tiny
  Llama streamed through the engine, whose step is all launching thread (Python, hooks,
  autograd, kernel launches), divided by the ops the model counts for it;
- CUDA: the device's own memory bandwidth, and a calibration of "gpu compute" (plain PyTorch's
  forward + backward of a bf16 proxy Llama against its matmuls at the GEMM rate);
- the simulated device: calibrations fitted to proxy Llamas run through the engine (a narrow
  one for the per-op dispatch, a wider one in fp32 and bf16 for the rest: `calibrations`).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..core.options import Activations, Budget, Optim, Precision, Streaming
from ..core.units import format_size

log = logging.getLogger(__name__)
GB = 1e9


@dataclass(frozen=True, kw_only=True)
class Sizes:
    """Bytes / elements of each measurement."""

    copy_bytes: int
    nvme_bytes: int
    optim_numel: int
    gemm_n: int
    repeats: int


FULL = Sizes(copy_bytes=256 << 20, nvme_bytes=512 << 20, optim_numel=16 << 20, gemm_n=1024, repeats=3)
# NVMe at 64 MiB even when quick: a 16 MiB read keeps 2 of the store's 4 threads busy (8 MiB
# blocks) and measured 15-20% under the engine's reads (bench/plan_vs_measured.py --labels nvme)
QUICK = Sizes(copy_bytes=8 << 20, nvme_bytes=64 << 20, optim_numel=1 << 20, gemm_n=256, repeats=2)


def _best(fn: Callable[[], None], repeats: int, sync: Callable[[], None] = lambda: None) -> float:
    """Fastest of `repeats` timed runs (after one warm-up), in seconds."""
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return max(best, 1e-9)


def _cuda_sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bandwidths(sz: Sizes) -> dict[str, float]:
    """GB/s of h2d/d2h, pinned and pageable; on the simulated device a memcpy (all four alike)."""
    n = sz.copy_bytes
    if not torch.cuda.is_available():
        src, dst = torch.empty(n, dtype=torch.uint8).fill_(1), torch.empty(n, dtype=torch.uint8)
        bw = n / _best(lambda: dst.copy_(src), sz.repeats) / GB
        return {"h2d_pinned": bw, "d2h_pinned": bw, "h2d_pageable": bw, "d2h_pageable": bw}
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    out = {}
    for kind, pin in (("pinned", True), ("pageable", False)):
        host = torch.empty(n, dtype=torch.uint8, pin_memory=pin).fill_(1)
        out[f"h2d_{kind}"] = n / _best(lambda: dev.copy_(host, non_blocking=pin), sz.repeats, _cuda_sync) / GB
        out[f"d2h_{kind}"] = n / _best(lambda: host.copy_(dev, non_blocking=pin), sz.repeats, _cuda_sync) / GB
    return out


def dram_bandwidth(sz: Sizes) -> float:
    """GB/s of a large CPU copy, counting the bytes read and written."""
    src = torch.empty(sz.copy_bytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    return 2 * sz.copy_bytes / _best(lambda: dst.copy_(src), sz.repeats) / GB


def nvme_bandwidth(sz: Sizes, path: str | None) -> tuple[float, float]:
    """(read, write) GB/s through NvmeStore under `path` (default: a temporary directory)."""
    from ..runtime.nvme import NvmeStore

    with tempfile.TemporaryDirectory(dir=path) as tmp:
        store = NvmeStore(Path(tmp) / "profile")
        try:
            n = sz.nvme_bytes
            buf = torch.empty(n, dtype=torch.uint8).fill_(7)
            back = torch.empty_like(buf)
            write = n / _best(lambda: store.write("probe", buf), sz.repeats)
            read = n / _best(lambda: store.read("probe", back), sz.repeats)
            if not torch.equal(buf[:4096], back[:4096]):
                raise RuntimeError("NVMe probe read back different bytes")
            store.remove("probe")
        finally:
            store.close()
    return read / GB, write / GB


def cxl_bandwidths(sz: Sizes) -> dict[int, float]:
    """GB/s of a copy into a buffer bound to each CXL node (empty when there is none)."""
    from ..runtime.cxl import CxlAllocator, detect_cxl_nodes

    out = {}
    for node in detect_cxl_nodes():
        try:
            alloc = CxlAllocator(nodes=[node.id], budget_bytes=2 * sz.copy_bytes)
            dst = alloc.allocate(sz.copy_bytes)
            src = torch.empty(sz.copy_bytes, dtype=torch.uint8).fill_(1)
            out[node.id] = sz.copy_bytes / _best(lambda: dst.copy_(src), sz.repeats) / GB
            alloc.free(dst)
        except Exception as exc:  # a node we cannot bind to is reported, not fatal
            log.warning("CXL node %d: not measured (%s)", node.id, exc)
    return out


def cxl_node_lines(bandwidths: dict[int, float]) -> list[str]:
    """One line per CXL node: size, distance, why it is CXL, and the measured copy-in GB/s
    (under emulation, e.g. QEMU, that figure says nothing about real CXL hardware)."""
    from ..runtime.cxl import describe_cxl_nodes, detect_cxl_nodes

    nodes = detect_cxl_nodes()
    return [f"CXL {text}: " + (f"{bandwidths[n.id]:.3g} GB/s copy in" if n.id in bandwidths
                               else "not measured")
            for n, text in zip(nodes, describe_cxl_nodes(nodes))]


def optimizer_rates(sz: Sizes) -> dict[str, float]:
    """Parameters per second of one CPU step of fused AdamW and of 8-bit AdamW."""
    n = sz.optim_numel
    p, g = torch.randn(n), torch.randn(n) * 1e-3
    m, v, step = torch.zeros(n), torch.zeros(n), torch.zeros(())

    def adamw():
        step.add_(1)
        torch._fused_adamw_([p], [g], [m], [v], [], [step], amsgrad=False, lr=1e-4, beta1=0.9, beta2=0.999,
                            weight_decay=0.0, eps=1e-8, maximize=False)

    out = {"adamw": n / _best(adamw, sz.repeats)}
    try:
        from ...optim.adamw8bit import adamw8bit_step_, init_adamw8bit_state

        state = init_adamw8bit_state(p)
        count = [0]

        def adamw8bit():
            count[0] += 1
            adamw8bit_step_(p, g, state, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                            step=count[0])

        out["adamw8bit"] = n / _best(adamw8bit, sz.repeats)
    except ImportError:
        out["adamw8bit"] = out["adamw"] / 10
    return out


def gemm_tflops(sz: Sizes, *, device: str, dtype: torch.dtype) -> float:
    """Achieved TFLOPS of an n x n x n matmul (8x larger on CUDA: a small one measures launches)."""
    n = sz.gemm_n * (8 if device == "cuda" else 1)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    sync = _cuda_sync if device == "cuda" else (lambda: None)
    return 2 * n**3 / _best(lambda: torch.mm(a, b), sz.repeats, sync) / 1e12


def op_overhead_us(sz: Sizes) -> float:
    """Microseconds per small op + module hook: a hooked tiny Linear's forward and backward."""
    lin = torch.nn.Linear(16, 16)
    lin.register_forward_pre_hook(lambda mod, args: None)
    lin.register_forward_hook(lambda mod, args, out: None)
    x = torch.randn(4, 16, requires_grad=True)
    calls = 200 if sz is QUICK else 1000

    def run():
        for _ in range(calls):
            lin(x).sum().backward()

    return _best(run, sz.repeats) / calls / 4 * 1e6  # ~4 ops each: linear, sum, their backwards


def _proxy_llama(width: int, layers: int, vocab: int):
    """A Llama of `layers` decoder layers of hidden size `width` (a ~1B model's layer at 2048)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=width * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=max(1, width // 128),
                      num_key_value_heads=max(1, width // 128), max_position_embeddings=4096,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    return cfg, LlamaForCausalLM(cfg)


def engine_op_overhead_us(quick: bool, device: str = "cuda") -> float:
    """Microseconds of the launching thread per op the performance model counts
    (`perfmodel.ops_per_forward`; a forward plus a recomputing backward: 4 forwards' worth), from
    a Llama too small for the device or the CPU update to matter, every chunk streamed: its step
    is all launching thread (Python, hooks, autograd, kernel launches). On the H200 host: 44.8 us
    per op, which prices the QLoRA step there to 1.00 and the full ones within 25% (bench/README.md)."""
    from ..engine.engine import Engine
    from ..plan.perfmodel import ops_per_forward
    from ...profiles import ModelProfile

    cfg, model = _proxy_llama(64, 4 if quick else 8, vocab=512)
    eng = Engine(model, budget=Budget(chunk=256 << 10), optim=Optim(lr=1e-4), precision=Precision("bf16"),
                 activations=Activations(recompute=True), streaming=Streaming(allow_gpu_home=False), device=device)  # about one chunk per layer
    x = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    try:
        times = []
        for i in range(3 if quick else 6):
            t = time.perf_counter()
            eng.step({"input_ids": x, "labels": x})
            if device == "cuda":
                torch.cuda.synchronize()
            if i:  # the first is the warm-up (trace, placement)
                times.append(time.perf_counter() - t)
    finally:
        eng.close()
    step = sorted(times)[len(times) // 2]
    return step / (4 * ops_per_forward(ModelProfile.from_hf_config(cfg))) * 1e6


def device_bandwidth(sz: Sizes) -> float:
    """CUDA: GB/s of a device-to-device copy, counting the bytes read and written."""
    src = torch.empty(4 * sz.copy_bytes, dtype=torch.uint8, device="cuda").fill_(1)
    dst = torch.empty_like(src)
    return 2 * src.numel() / _best(lambda: dst.copy_(src), sz.repeats, _cuda_sync) / GB


def cuda_step_calibration(quick: bool, *, tflops: float, device: str = "cuda") -> float:
    """Measured / modelled time of plain PyTorch's forward + backward of a bf16 proxy Llama,
    everything on the device, the model's time being its matmul flops at `tflops` (the GEMM just
    measured): what attention, norms and elementwise kernels add; scales "gpu compute"."""
    from ..plan.perfmodel import model_flops
    from ...profiles import ModelProfile

    width, layers, batch, seq = (256, 2, 1, 256) if quick else (2048, 2, 4, 1024)
    cfg, model = _proxy_llama(width, layers, vocab=8192)
    model = model.to(device, torch.bfloat16)
    x = torch.randint(0, 8192, (batch, seq), device=device, generator=torch.Generator(device).manual_seed(0))

    def step():
        model(input_ids=x, labels=x).loss.backward()

    measured = _best(step, 2 if quick else 4, _cuda_sync)
    modelled = 3 * model_flops(model=ModelProfile.from_hf_config(cfg), batch_size=batch, seq_len=seq) / (tflops * 1e12)
    model = None  # its device memory back before the next measurement (the closure holds the name)
    if device == "cuda":
        torch.cuda.empty_cache()
    return measured / modelled


def measure(*, hardware: str | None = None, output: str | None = None, nvme_path: str | None = None,
            quick: bool = False, progress: Callable[[str], None] | None = None) -> str:
    """Measure this machine; write (and return) a hardware profile TOML named `hardware`."""
    sz = QUICK if quick else FULL
    say = progress or (lambda msg: log.info("%s", msg))
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    results: dict[str, object] = {}
    steps: list[tuple[str, Callable[[], object]]] = [
        ("host <-> device copies", lambda: copy_bandwidths(sz)),
        ("DRAM bandwidth", lambda: dram_bandwidth(sz)),
        ("NVMe read/write", lambda: nvme_bandwidth(sz, nvme_path)),
        ("CXL nodes", lambda: cxl_bandwidths(sz)),
        ("CPU optimizer steps", lambda: optimizer_rates(sz)),
        ("device matmul bf16", lambda: gemm_tflops(sz, device=device, dtype=torch.bfloat16)),
        ("device matmul fp32", lambda: gemm_tflops(sz, device=device, dtype=torch.float32)),
        ("CPU matmul fp32", lambda: gemm_tflops(sz, device="cpu", dtype=torch.float32)),
        ("op dispatch overhead", lambda: engine_op_overhead_us(quick) if cuda else op_overhead_us(sz)),
    ]
    if cuda:
        steps.insert(1, ("device memory", lambda: device_bandwidth(sz)))
    for i, (name, fn) in enumerate(steps, 1):
        t = time.perf_counter()
        results[name] = fn()
        say(f"[{i}/{len(steps)}] {name}: {_show(results[name], UNITS[name])} "
            f"({time.perf_counter() - t:.1f} s)")
        if name == "CXL nodes":
            for line in cxl_node_lines(results[name]):
                say(f"      {line}")
    text = to_toml(results, name=hardware or ("measured-cuda" if cuda else "measured-cpu-sim"), cuda=cuda)
    t = time.perf_counter()
    if cuda:
        scale = cuda_step_calibration(quick, tflops=results["device matmul bf16"])
        say(f"[calibration] proxy model forward + backward on the device, measured / its matmuls at the "
            f"GEMM rate: {scale:.3g} ({time.perf_counter() - t:.1f} s)")
        line = f"step_calibration = {scale:.6g}"
    else:
        cal = calibrations(text, quick=quick)
        say(f"[calibration] proxy models measured / modelled: matmuls fp32 {cal['step_calibration']:.3g}, "
            f"bf16 {cal['step_calibration_bf16']:.3g}; dispatch fp32 {cal['dispatch_calibration']:.3g}, "
            f"bf16 {cal['dispatch_calibration_bf16']:.3g} "
            f"({time.perf_counter() - t:.1f} s)")
        line = "\n".join(f"{k} = {v:.6g}" for k, v in cal.items())
    text = text.replace("\n[nvme]", f"{line}\n\n[nvme]", 1)
    if output:
        Path(output).write_text(text)
        say(f"wrote {output}")
    return text


def calibrations(profile_text: str, *, quick: bool) -> dict[str, float]:
    """Run small Llamas through the engine (everything resident) and fit the performance model's
    compute to their step times, on the profile just measured. Two factors: one on the matmul
    time at the GEMM rate (with the rest the model prices per byte), one on the per-op dispatch
    cost; a narrow proxy's step is mostly dispatch, a wider one's mostly matmuls, and the two
    fix both (one factor for both priced a 100M model 1.2-1.3x slow where it priced a tiny one
    0.7-0.85x fast). Both proxies again in bf16 give bf16's two factors (its ops dispatch slower:
    with fp32's dispatch factor a tiny bf16 model ran 1.35-1.6x its plan). Returns the profile's
    `step_calibration`, `step_calibration_bf16`, `dispatch_calibration` and
    `dispatch_calibration_bf16`; where a fit is degenerate (a factor out of range) one factor for
    everything (bf16: its matmul factor alone, on fp32's dispatch factor)."""
    def proxies(precision: str) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
        return (_proxy_step(profile_text, hidden=64, layers=4, vocab=512, steps=7 if quick else 11,
                            precision=precision),
                _proxy_step(profile_text, hidden=768, layers=2, vocab=4096, steps=3 if quick else 5,
                            precision=precision))

    def fits(x: float) -> bool:
        return 0.05 < x < 50

    narrow, wide = proxies("fp32")
    a, b = _fit(narrow, wide)
    if not (fits(a) and fits(b)):
        a = b = _one_factor(wide)
        if not fits(a):  # (a proxy timed wrong, e.g. a machine under load): uncalibrated
            a = b = 1.0
    narrow16, wide16 = proxies("bf16")
    a16, b16 = _fit(narrow16, wide16)
    if not (fits(a16) and fits(b16)):  # bf16's matmul factor alone, on fp32's dispatch
        m16, f16, d16 = wide16
        a16, b16 = ((m16 - b * d16) / f16 if f16 else 0.0), b
        if not fits(a16):
            one = _one_factor(wide16)
            a16 = one if fits(one) else a
    return {"step_calibration": a, "step_calibration_bf16": a16, "dispatch_calibration": b,
            "dispatch_calibration_bf16": b16}


def _fit(narrow: tuple[float, float, float], wide: tuple[float, float, float]) -> tuple[float, float]:
    """The two factors (matmul-rate work, dispatch) that make both proxies' modelled seconds their
    measured ones: (measured, modelled work, modelled dispatch) each; (0, 0) when degenerate."""
    (mn, fn, dn), (mw, fw, dw) = narrow, wide
    det = fn * dw - fw * dn
    if not det:
        return 0.0, 0.0
    return (mn * dw - mw * dn) / det, (fn * mw - fw * mn) / det


def _one_factor(proxy: tuple[float, float, float]) -> float:
    m, f, d = proxy
    return m / (f + d) if f + d else 0.0


def _proxy_step(profile_text: str, *, hidden: int, layers: int, vocab: int, steps: int,
                precision: str = "fp32") -> tuple[float, float, float]:
    """A proxy Llama's forward + backward through the engine, everything resident: (measured
    seconds, less the update the model prices apart; the model's seconds of all but dispatch;
    the model's dispatch seconds), uncalibrated. Measured: the median of `steps` steps."""
    import dataclasses
    import tempfile

    from transformers import LlamaConfig, LlamaForCausalLM

    from ..engine.engine import Engine
    from ..plan.planner import make_plan
    from ...profiles import ModelProfile, load_hardware_profile

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    eng = Engine(LlamaForCausalLM(cfg), budget=Budget(chunk=16 << 20), optim=Optim(lr=1e-4),
                 precision=Precision(precision))
    g = torch.Generator().manual_seed(0)
    batch, seq = 2, 64
    x = torch.randint(0, vocab, (batch, seq), generator=g)
    eng.step({"input_ids": x, "labels": x})  # warm-up: trace, placement
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        eng.step({"input_ids": x, "labels": x})
        times.append(time.perf_counter() - t)
    eng.close()
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(profile_text)
    hw = load_hardware_profile(f.name)
    os.unlink(f.name)
    no_ops = dataclasses.replace(hw, host=dataclasses.replace(hw.host, op_overhead_us=None))  # (None: free)
    plans = [make_plan(model=ModelProfile.from_hf_config(cfg), hardware=h, gpu_mem=None, cpu_mem=None,
                       optimizer="adamw", precision=precision, batch_size=batch, seq_len=seq,
                       chunk_bytes=16 << 20) for h in (hw, no_ops)]
    fwd_bwd = [p.phases["forward"] + p.phases.get("backward", 0.0) for p in plans]
    measured = sorted(times)[len(times) // 2] - plans[0].phases.get("update", 0.0)
    return measured, fwd_bwd[1], fwd_bwd[0] - fwd_bwd[1]


#: The unit of each measurement of `measure`, printed on its progress line.
UNITS = {"host <-> device copies": "GB/s", "DRAM bandwidth": "GB/s", "NVMe read/write": "GB/s",
         "CXL nodes": "GB/s", "CPU optimizer steps": "params/s", "device matmul bf16": "TFLOPS",
         "device matmul fp32": "TFLOPS", "CPU matmul fp32": "TFLOPS", "op dispatch overhead": "µs/op",
         "device memory": "GB/s"}


def _show(v: object, unit: str = "") -> str:
    u = f" {unit}" if unit else ""
    if isinstance(v, float):
        return f"{v:.3g}{u}"
    if isinstance(v, tuple):  # NVMe: (read, write)
        return ", ".join(f"{k} {x:.3g}{u}" for k, x in zip(("read", "write"), v))
    if isinstance(v, dict):
        return ", ".join(f"{k} {x:.3g}{u}" for k, x in v.items()) or "none"
    return str(v)


def to_toml(r: dict, *, name: str, cuda: bool) -> str:
    """The hardware profile TOML of the measurements `r` (keys as in `measure`)."""
    copies = r["host <-> device copies"]
    read, write = r["NVMe read/write"]
    opt = r["CPU optimizer steps"]
    cxl = r["CXL nodes"]
    if cuda:
        props = torch.cuda.get_device_properties(0)
        gpu_mem, gpu_bw, desc = props.total_memory, r["device memory"], f"measured: {props.name}"
    else:
        gpu_mem, gpu_bw, desc = 8 << 30, r["DRAM bandwidth"], "measured: simulated device on this CPU"
    lines = [f'name = "{name}"', f'description = "{desc}"', "", "[gpu]", f"memory = {gpu_mem}",
             f"bf16_tflops = {r['device matmul bf16']:.6g}", f"fp32_tflops = {r['device matmul fp32']:.6g}",
             f"memory_bandwidth_gbps = {gpu_bw:.6g}", f"simulated = {'false' if cuda else 'true'}", "", "[pcie]",
             f"gen = {4 if cuda else 0}"]
    lines += [f"{k}_gbps = {v:.6g}" for k, v in copies.items()]
    host_mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    lines += ["", "[host]", f"memory = {host_mem}", f"dram_bandwidth_gbps = {r['DRAM bandwidth']:.6g}",
              f"cpu_cores = {torch.get_num_threads()}", f"cpu_fp32_tflops = {r['CPU matmul fp32']:.6g}",
              f"adamw_params_per_s = {opt['adamw']:.6g}", f"adamw8bit_params_per_s = {opt['adamw8bit']:.6g}",
              f"op_overhead_us = {r['op dispatch overhead']:.6g}", "", "[nvme]", f"read_gbps = {read:.6g}",
              f"write_gbps = {write:.6g}"]
    if cxl:
        from ..runtime.cxl import detect_cxl_nodes

        total = sum(n.mem_total for n in detect_cxl_nodes() if n.id in cxl)
        lines += ["", "[cxl]"] + [f"# {line}" for line in cxl_node_lines(cxl)]
        lines += [f"memory = {total}", f"bandwidth_gbps = {sum(cxl.values()):.6g}", "latency_ns = 250"]
    return "\n".join(lines) + "\n"


__all__ = ["measure", "to_toml", "format_size"]
