"""The Engine's options, one frozen dataclass per concern (pure, no torch).

    Engine(model, budget=Budget(gpu="24G", cpu="64G", nvme="/mnt/nvme"),
           optim=Optim("adamw", lr=1e-4), precision=Precision("bf16", base="nf4", double_quant=True))

The CLI builds them from its flags (cli.config.TrainConfig.engine_options), the planner
prices the same fields, and `flat_options` takes the plain keyword names a dict or a config
file spells (gpu_mem, lr, base_dtype, ...: FLAT lists them) and groups them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

from .chunks import DEFAULT_CHUNK_BYTES
from .errors import DIST_TIMEOUT_S
from .sizes import parse_size
from .vocab import BASE_DTYPES, COMPUTE_DTYPES, GRAD_REDUCE, BaseDtype, ComputeDtype, GradReduce, check

LOOKAHEAD = 16
"""Chunks the schedule looks ahead to prefetch: the engine's streaming depth and the planner's
simulation of it (offload.plan.schedule)."""

@dataclass(frozen=True, kw_only=True)
class Budget:
    """What each tier may hold: bytes or size strings ("24G"); None: the device's free memory
    (gpu), unlimited (cpu), no tier (cxl). `nvme`: a directory for swap files (None: no NVMe
    tier); `chunk`: bytes of fp32 weights per chunk, the unit that moves between tiers.
    `cxl_node`: the CXL NUMA node(s) (None: every CXL node); `cxl_bandwidth`: GB/s to price it
    with (None: measured); `nvme_checksum`: crc32 every swap block, checked on read."""

    gpu: int | str | None = None
    cpu: int | str | None = None
    cxl: int | str | None = None
    nvme: str | None = None
    chunk: int | str = DEFAULT_CHUNK_BYTES
    cxl_node: int | str | Iterable[int] | None = None
    cxl_bandwidth: float | None = None
    nvme_checksum: bool = False

    def __post_init__(self) -> None:  # a malformed size is refused where it is given
        for key in ("gpu", "cpu", "cxl", "chunk"):
            parse_size(getattr(self, key), what=f"Budget {key}")


@dataclass(frozen=True)
class Optim:
    """The optimizer (offload.update.table's names: adamw, adamw8bit, sgd, galore, apollo, mezo...)
    and its hyperparameters; `kwargs`: the optimizer's own (e.g. {"rank": 8} for GaLore).
    `grad_clip`: clip the global gradient norm (None: no clipping). `overlap_update`: update a
    chunk during backward as soon as its gradients are final (`Engine.step` only, not with clipping)."""

    name: str = "adamw"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    grad_clip: float | None = None
    overlap_update: bool = True

    def __post_init__(self) -> None:
        if self.kwargs is None:  # (a flat dict's "none given")
            object.__setattr__(self, "kwargs", {})
        for key in ("lr", "eps", "weight_decay", "momentum") + (("grad_clip",) if self.grad_clip is not None else ()):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"Optim {key} must be a number, got {value!r}")
        if not (isinstance(self.betas, (tuple, list)) and len(self.betas) == 2
                and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in self.betas)):
            raise ValueError(f"Optim betas must be two numbers in [0, 1), got {self.betas!r}")
        if self.grad_clip is not None and not self.grad_clip > 0:  # (inf: the norm is measured, nothing clipped)
            raise ValueError(f"grad_clip must be a positive number (None: no clipping), got {self.grad_clip}")


@dataclass(frozen=True)
class Precision:
    """`compute`: the dtype forward and backward run in (masters stay fp32). `base` (LoRA runs):
    how the frozen base is stored and streamed (None: the compute dtype); `double_quant`: NF4's
    absmax quantized too (the QLoRA recipe)."""

    compute: ComputeDtype = "fp32"
    base: BaseDtype | None = None
    double_quant: bool = False

    def __post_init__(self) -> None:
        check(self.compute, COMPUTE_DTYPES, "precision")
        if self.base is not None:
            check(self.base, BASE_DTYPES, "base dtype")
        if self.double_quant and self.base != "nf4":
            raise ValueError(f"double_quant quantizes NF4's absmax: it needs base='nf4', got base={self.base!r}")


@dataclass(frozen=True, kw_only=True)
class Activations:
    """`recompute`: recompute each block in backward (True), keep every block's activations
    (False), recompute the first n blocks and keep the rest's (an int n: recomputed_blocks), or
    None: the engine's choice (every block in the warm-up where the model has several; then the
    last ones kept where the whole model stays on the device beside them; every one with
    `expected`, the estimate's). `offload`: keep recomputed
    blocks' inputs in host memory between forward and backward. `expected`: the peak bytes of
    saved activations (the planner's estimate): given, chunks are placed now; None: after the
    warm-up step, which measures it. `host`: bytes of host memory the offloaded inputs need
    (the planner's "activations" host reserve), kept free of chunk homes. `cxl`: instead, bytes
    of CXL memory they take there (the planner's cxl reserve, where host RAM cannot hold them;
    needs a cxl budget), kept free of chunk homes too. `nvme`: instead, bytes of them written to
    the NVMe swap directory (the planner's nvme reserve; needs budget.nvme); `host` is then the
    host buffers they pass through."""

    recompute: bool | int | None = None
    offload: bool = False
    expected: int | None = None
    host: int = 0
    cxl: int = 0
    nvme: int = 0

    def __post_init__(self) -> None:
        r = self.recompute
        if not (r is None or isinstance(r, bool) or isinstance(r, int) and r >= 0):
            raise ValueError(f"activations: recompute takes True, False, None or a number of blocks >= 0, got {r!r}")
        if self.cxl and self.nvme:
            raise ValueError("activations: offloaded inputs go to one tier, CXL or NVMe, not both")


def recomputed_blocks(recompute: bool | int | None, blocks: int) -> int:
    """How many of a model's `blocks` are recomputed in backward: the first ones, all (True), none
    (False), the first n (an int; more than the model has is a ValueError) or, None, all when there
    are several. The first ones, because backward reaches them last: by then the kept blocks'
    activations are freed, so a recompute never adds to them."""
    if recompute is None:
        return blocks if blocks > 1 else 0
    if isinstance(recompute, bool):
        return blocks if recompute else 0
    if recompute > blocks:
        raise ValueError(f"activations: recompute {recompute} blocks, but the model has {blocks} to recompute")
    return int(recompute)


@dataclass(frozen=True, kw_only=True)
class Distributed:
    """Several ranks (torch.distributed). `group`: the process group (None: the default group
    when it has more than one rank); `timeout`: seconds a collective waits before this rank fails
    naming it; `share_base`: a node's ranks hold one copy of a frozen base; `grad_reduce`:
    "micro" (reduce after every micro-batch, owned gradients only held) or "step"."""

    group: Any = None
    timeout: float = DIST_TIMEOUT_S
    share_base: bool = True
    grad_reduce: GradReduce = "micro"

    def __post_init__(self) -> None:
        check(self.grad_reduce, GRAD_REDUCE, "grad_reduce")


@dataclass(frozen=True, kw_only=True)
class Streaming:
    """How chunks stream. `prefetch`: chunks the schedule looks ahead; `h2d_bandwidth` /
    `d2h_bandwidth`: emulate a link of these bytes/s (tests, benches); `allow_gpu_home`: chunks
    may live on the device for the whole run where the budget allows."""

    prefetch: int = LOOKAHEAD
    h2d_bandwidth: float | None = None
    d2h_bandwidth: float | None = None
    allow_gpu_home: bool = True

    def __post_init__(self) -> None:
        p = self.prefetch
        if isinstance(p, bool) or not isinstance(p, int) or p < 0:
            raise ValueError(f"streaming: prefetch takes a number of chunks >= 0, got {p!r}")
        for key in ("h2d_bandwidth", "d2h_bandwidth"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0 < value < float("inf")):
                raise ValueError(f"streaming: {key} takes bytes/s > 0 (None: the real link), got {value!r}")


GROUPS: dict[str, type] = {"budget": Budget, "optim": Optim, "precision": Precision, "activations": Activations,
                           "distributed": Distributed, "streaming": Streaming}

FLAT: dict[str, tuple[str, str]] = {
    "gpu_mem": ("budget", "gpu"), "cpu_mem": ("budget", "cpu"), "cxl_mem": ("budget", "cxl"),
    "nvme_path": ("budget", "nvme"), "chunk_bytes": ("budget", "chunk"), "cxl_node": ("budget", "cxl_node"),
    "cxl_bandwidth": ("budget", "cxl_bandwidth"), "nvme_checksum": ("budget", "nvme_checksum"),
    "optimizer": ("optim", "name"), "lr": ("optim", "lr"), "betas": ("optim", "betas"), "eps": ("optim", "eps"),
    "weight_decay": ("optim", "weight_decay"), "momentum": ("optim", "momentum"),
    "optimizer_kwargs": ("optim", "kwargs"), "grad_clip": ("optim", "grad_clip"),
    "overlap_update": ("optim", "overlap_update"),
    "precision": ("precision", "compute"), "base_dtype": ("precision", "base"),
    "double_quant": ("precision", "double_quant"),
    "checkpointing": ("activations", "recompute"), "offload_activations": ("activations", "offload"),
    "activations": ("activations", "expected"),
    "process_group": ("distributed", "group"), "dist_timeout": ("distributed", "timeout"),
    "share_base": ("distributed", "share_base"), "grad_reduce": ("distributed", "grad_reduce"),
    "prefetch_depth": ("streaming", "prefetch"), "h2d_bandwidth": ("streaming", "h2d_bandwidth"),
    "d2h_bandwidth": ("streaming", "d2h_bandwidth"), "allow_gpu_home": ("streaming", "allow_gpu_home"),
}
"""The plain keyword name of each option field: what a flat dict or config file spells."""

PASSED = ("lora", "device", "loss_fn")
"""Engine keywords that are not grouped (a peft.LoraConfig, the device, the loss function)."""


def flat_options(**flat: Any) -> dict[str, Any]:
    """The Engine's keyword arguments from flat names (FLAT's keys, PASSED, or a group itself):
    `Engine(model, **flat_options(gpu_mem="2G", lr=1e-4))`. A name it does not know is a
    TypeError naming it. A None value is "not given": the field keeps its default."""
    grouped: dict[str, dict[str, Any]] = {}
    out: dict[str, Any] = {}
    for name, value in flat.items():
        if name in GROUPS and isinstance(value, GROUPS[name]):  # (a group itself, e.g. "activations")
            out[name] = value
        elif name in FLAT:
            group, key = FLAT[name]
            grouped.setdefault(group, {})[key] = value
        elif name in PASSED or name in GROUPS:
            out[name] = value
        else:
            raise TypeError(f"unknown engine option {name!r}; known: {', '.join(dict.fromkeys([*FLAT, *PASSED, *GROUPS]))}")
    for group, values in grouped.items():
        kept = {k: v for k, v in values.items() if v is not None}
        base = out.get(group)
        out[group] = replace(base, **kept) if base is not None else GROUPS[group](**kept)
    return out
