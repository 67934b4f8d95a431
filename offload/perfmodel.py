"""Performance model (pure): bytes and seconds of one training step, phase by phase.

No torch, no allocation: arithmetic on a model profile, a hardware profile and the byte counts
the planner places on each tier. A phase lasts as long as its busiest resource (GPU compute,
PCIe each way, NVMe, CXL, host DRAM bandwidth, CPU update) since transfers on independent
links overlap compute, plus a non-overlappable startup of one chunk. CPU cores that run the
optimizer also drive NVMe I/O; host DRAM bandwidth is shared by the CPU update and all DMA.

Per-optimizer numbers live in OPTIMIZERS below. TODO(optim): once `optim/costs.py` lands, read
them from each optimizer's `cost()` (OptimizerCost) instead of this table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from offload.chunks import ParamSpec
from offload.errors import TierwiseError
from profiles.hardware import HardwareProfile
from profiles.model import ModelProfile

GB = 1e9
PRECISIONS = {"fp32": 4, "bf16": 2}
KINDS = ("compute", "grad", "master", "state")
TIERS = ("gpu", "host", "cxl", "nvme")


@dataclass(frozen=True, kw_only=True)
class OptimizerCost:
    """What an optimizer costs per parameter (dense part) and how it runs."""

    name: str
    state_bytes_per_param: float
    """Optimizer state of a dense (non-projected) parameter, bytes per parameter."""
    cpu_rate: str = "adamw"
    """Which host throughput applies: "adamw" or "adamw8bit" (HostSpec.<rate>_params_per_s)."""
    cpu_rate_scale: float = 1.0
    """Multiplier on that throughput (a cheaper update runs faster)."""
    lowrank: str | None = None
    """None, "galore" (stores an SVD projector) or "apollo" (random projector, regenerated)."""
    default_rank: int = 0
    """Rank of the projection for low-rank optimizers."""
    needs_grad: bool = True
    """False for zeroth-order optimizers: no gradient chunks, no backward."""
    forwards: int = 1
    """Forward passes per step (MeZO: 2, with +eps and -eps perturbations)."""


OPTIMIZERS: dict[str, OptimizerCost] = {c.name: c for c in (
    OptimizerCost(name="adamw", state_bytes_per_param=8.0),
    # bitsandbytes blockwise 8-bit: 2 B of moments + 2 fp32 absmax per 256-element block.
    OptimizerCost(name="adamw8bit", state_bytes_per_param=2.0 + 8 / 256, cpu_rate="adamw8bit"),
    OptimizerCost(name="galore", state_bytes_per_param=8.0, lowrank="galore", default_rank=256),
    OptimizerCost(name="apollo", state_bytes_per_param=8.0, lowrank="apollo", default_rank=256),
    OptimizerCost(name="apollo-mini", state_bytes_per_param=8.0, lowrank="apollo", default_rank=1),
    OptimizerCost(name="mezo", state_bytes_per_param=0.0, cpu_rate_scale=2.0, needs_grad=False, forwards=2),
)}


def optimizer_cost(name: str) -> OptimizerCost:
    try:
        return OPTIMIZERS[name.lower()]
    except KeyError:
        raise TierwiseError(f"unknown optimizer '{name}' (known: {', '.join(OPTIMIZERS)})") from None


def compute_bytes(precision: str) -> int:
    """Bytes per element of the compute copy."""
    try:
        return PRECISIONS[precision]
    except KeyError:
        raise TierwiseError(f"unknown precision '{precision}' (use fp32 or bf16)") from None


def _projected(spec: ParamSpec, cost: OptimizerCost) -> bool:
    return cost.lowrank is not None and len(spec.shape) == 2 and ".layers." in spec.name


def param_state_bytes(spec: ParamSpec, *, cost: OptimizerCost, rank: int | None = None) -> float:
    """Optimizer state bytes of one parameter.

    Low-rank (GaLore/APOLLO) on a layer matrix m x n (r = rank): Adam moments of the r x max(m,n)
    projected gradient, 2 * 4 * r * max(m,n); GaLore also keeps its fp32 projector min(m,n) x r.
    Everything else (norms, embedding, lm_head) keeps dense state.
    """
    if not _projected(spec, cost):
        return spec.numel * cost.state_bytes_per_param
    m, n = spec.shape
    r = min(rank or cost.default_rank, m, n)
    moments = 8.0 * r * max(m, n)
    return moments + (4.0 * r * min(m, n) if cost.lowrank == "galore" else 0.0)


def param_update_flops(spec: ParamSpec, *, cost: OptimizerCost, rank: int | None = None) -> float:
    """Matmul flops of the update beyond elementwise work: project the gradient down and the
    update back up, 2 * 2*m*n*r (GaLore's periodic SVD is amortised away)."""
    if not _projected(spec, cost):
        return 0.0
    m, n = spec.shape
    return 4.0 * m * n * min(rank or cost.default_rank, m, n)


def model_flops(*, model: ModelProfile, batch_size: int, seq_len: int) -> float:
    """Forward flops of one step: 2 per matmul parameter per token, plus attention scores."""
    tokens = batch_size * seq_len
    attention = 4.0 * batch_size * seq_len**2 * model.q_dim * model.num_hidden_layers
    return 2.0 * model.matmul_params * tokens + attention


def activation_parts(*, model: ModelProfile, batch_size: int, seq_len: int, precision: str) -> dict[str, int]:
    """Bytes autograd saves for backward, by part, as the engine counts them (per saved tensor
    storage, deduplicated) for a Hugging Face Llama-family model with SDPA attention, no padding
    mask and every decoder layer checkpointed. e = compute bytes, T = batch * seq tokens:

    fixed   token ids (int64, the embedding) + rotary cos/sin (S x head_dim, e each, shared by
            all layers) + position ids (int64, S)
    inputs  one saved block input per layer, e*T*h (the last block's output is the final norm's)
    norm    an RMSNorm: its fp32 input (a new fp32 copy in bf16 runs; in fp32 the input itself,
            which for a block's first norm is the already-counted block input), rsqrt (fp32, T),
            the normalised and the weighted output (e*T*h each)
    block   one layer's internals while it is recomputed: 2 norms, q/k/v after rotary and the
            attention output (e*T*(2 q_dim + 2 kv_dim)), the logsumexp (fp32, B*heads*S), the
            MLP's gate, up, silu and product (4 e*T*i)
    head    the final norm + log_softmax's fp32 output (4*T*V) + int64 targets + a scalar
    The peak is fixed + inputs + the larger of block (in backward) and head (end of forward).
    """
    e = compute_bytes(precision)
    t, s, h, i = batch_size * seq_len, seq_len, model.hidden_size, model.intermediate_size
    fp32_copy = 4 * t * h
    norm = 4 * t + 2 * e * t * h + fp32_copy
    first_norm = norm - (fp32_copy if e == 4 else 0)
    attention = e * t * (2 * model.q_dim + 2 * model.kv_dim) + 4 * batch_size * model.num_attention_heads * s
    return {
        "fixed": 8 * t + 2 * s * model.dim_per_head * e + 8 * s,
        "inputs": model.num_hidden_layers * e * t * h,
        "block": first_norm + attention + norm + 4 * e * t * i,
        "head": norm + 4 * t * model.vocab_size + 8 * t + 4,
    }


def activation_bytes(*, model: ModelProfile, batch_size: int, seq_len: int, precision: str,
                     backward: bool = True) -> int:
    """Peak bytes of saved activations in one step (see activation_parts). Without backward
    (zeroth-order optimizers) autograd saves nothing: 0."""
    if not backward:
        return 0
    p = activation_parts(model=model, batch_size=batch_size, seq_len=seq_len, precision=precision)
    return p["fixed"] + p["inputs"] + max(p["block"], p["head"])


def buffer_bytes(model: ModelProfile) -> int:
    """Module buffers: the rotary embedding's inv_freq and original_inv_freq (fp32, head_dim/2)."""
    return 2 * 4 * (model.dim_per_head // 2)


@dataclass(frozen=True, kw_only=True)
class StepLoad:
    """What one step moves and computes, as placed by the planner."""

    tokens_flops_fwd: float
    """Forward flops of the model over the batch."""
    placed: dict[str, dict[str, int]]
    """Bytes per tier per kind of the chunks updated on CPU (tiers host/cxl/nvme)."""
    grad_d2h_bytes: int
    """Gradient bytes sent device -> host per step (compute dtype, CPU-updated params)."""
    cpu_params: int
    """Parameters updated on the CPU."""
    cpu_flops: float
    """Matmul flops of the CPU update (low-rank projections)."""
    gpu_update_bytes: int
    """Device-memory bytes read and written by the GPU update."""
    gpu_update_flops: float
    """Matmul flops of the GPU update."""
    chunk_compute_bytes: int
    """Compute-copy bytes of the largest streamed chunk (startup of a pass)."""
    chunk_params: int
    """Parameters of the largest CPU-updated chunk (the update tail after backward)."""


@dataclass(frozen=True, kw_only=True)
class StepPrediction:
    """Predicted seconds of a step, phase by phase and resource by resource."""

    phases: dict[str, float]
    """Seconds of each phase ("forward", "backward", "update"); they run one after another."""
    resources: dict[str, dict[str, float]] = field(hash=False)
    """Busy seconds of each resource in each phase."""
    step_s: float
    bottleneck: str
    """Resource that bounds the most step time."""
    tokens_per_s: float


def _phase(busy: dict[str, float], startup: float) -> tuple[float, str]:
    busy = {k: v for k, v in busy.items() if v > 0}
    top = max(busy, key=busy.__getitem__, default="gpu compute")
    return busy.get(top, 0.0) + startup, top


def predict_step(*, hardware: HardwareProfile, precision: str, cost: OptimizerCost, load: StepLoad,
                 tokens: int) -> StepPrediction:
    """Price one step of `load` on `hardware` (see the module docstring for the model)."""
    hw, pl = hardware, load.placed
    get = lambda tier, kind: pl.get(tier, {}).get(kind, 0)  # noqa: E731
    gpu_rate = hw.gpu_tflops(precision) * 1e12
    h2d, d2h = hw.pcie.h2d_pinned_gbps * GB, hw.pcie.d2h_pinned_gbps * GB
    dram = hw.host.dram_bandwidth_gbps * GB
    nv_r = hw.nvme.read_gbps * GB if hw.nvme else 1.0
    nv_w = hw.nvme.write_gbps * GB if hw.nvme else 1.0
    cxl = hw.cxl.bandwidth_gbps * GB if hw.cxl else 1.0
    stream = sum(get(t, "compute") for t in ("host", "cxl", "nvme"))
    fp32 = precision == "fp32"

    # forward: stream every CPU-homed compute copy in; nvme copies pass a DRAM bounce buffer.
    fwd_busy = {
        "gpu compute": load.tokens_flops_fwd / gpu_rate,
        "pcie h2d": stream / h2d,
        "nvme read": get("nvme", "compute") / nv_r,
        "cxl": get("cxl", "compute") / cxl,
        "host dram": (get("host", "compute") + 2 * get("nvme", "compute")) / dram,
    }
    startup = load.chunk_compute_bytes / h2d + (load.chunk_compute_bytes / nv_r if get("nvme", "compute") else 0)
    phases, resources, tops = {}, {}, {}
    t, top = _phase(fwd_busy, startup if stream else 0.0)
    phases["forward"], resources["forward"], tops["forward"] = t * cost.forwards, fwd_busy, top

    # update working set: read master (fp32: the compute copy), grad, state; write master, state, compute.
    def rw(tier: str) -> float:
        master = get(tier, "compute") if fp32 else get(tier, "master")
        extra_compute = 0 if fp32 else get(tier, "compute")
        return 2 * (master + get(tier, "state")) + get(tier, "grad") + extra_compute

    nv_read = get("nvme", "compute") * (1 + fp32) + get("nvme", "master") + get("nvme", "state") + get("nvme", "grad")
    nv_write = sum(get("nvme", k) for k in KINDS)
    nv_update = nv_read / nv_r + nv_write / nv_w
    io_cores = 1 if nv_update > 0 and hw.host.cpu_cores > 1 else 0
    rate = getattr(hw.host, f"{cost.cpu_rate}_params_per_s") * cost.cpu_rate_scale
    rate *= (hw.host.cpu_cores - io_cores) / hw.host.cpu_cores
    cpu_update = max(load.cpu_params / rate, rw("host") / dram, rw("cxl") / cxl,
                     load.cpu_flops / (hw.host.cpu_fp32_tflops * 1e12))
    gpu_update = load.gpu_update_bytes / (hw.gpu.memory_bandwidth_gbps * GB) \
        + load.gpu_update_flops / (hw.gpu.fp32_tflops * 1e12)
    tail = load.chunk_params / rate if load.cpu_params else 0.0

    if cost.needs_grad:  # backward with recompute; CPU updates overlap it, group by group
        bwd_busy = {
            "gpu compute": 3 * load.tokens_flops_fwd / gpu_rate + gpu_update,
            "pcie h2d": stream / h2d,
            "pcie d2h": load.grad_d2h_bytes / d2h,
            "nvme": nv_update,
            "cxl": (get("cxl", "compute") + rw("cxl")) / cxl,
            "cpu update": cpu_update,
            "host dram": (get("host", "compute") + load.grad_d2h_bytes + rw("host")
                          + 2 * (nv_read + nv_write)) / dram,
        }
        t, top = _phase(bwd_busy, (startup if stream else 0.0) + tail)
        phases["backward"], resources["backward"], tops["backward"] = t, bwd_busy, top
    else:  # zeroth order: the update follows the second forward
        upd_busy = {"cpu update": cpu_update, "gpu compute": gpu_update, "nvme": nv_update,
                    "cxl": rw("cxl") / cxl, "host dram": (rw("host") + 2 * (nv_read + nv_write)) / dram}
        t, top = _phase(upd_busy, 0.0)
        phases["update"], resources["update"], tops["update"] = t, upd_busy, top

    step = sum(phases.values())
    share: dict[str, float] = {}
    for name, seconds in phases.items():
        share[tops[name]] = share.get(tops[name], 0.0) + seconds
    bottleneck = max(share, key=share.__getitem__)
    return StepPrediction(phases=phases, resources=resources, step_s=step, bottleneck=bottleneck,
                          tokens_per_s=tokens / step if step > 0 else float("inf"))
