"""THE optimizer table (pure, no torch): every fact about an optimizer that more than one part
of tierwise needs, in one place. Read by the CLI (`--optimizer` choices), the performance
model (CPU rate, forwards, low-rank flops), the planner (state bytes per chunk, torch-free)
and the engine (`updaters.make_updater`: default rank, which parameters are projected).

State bytes: `state_bytes(plan, name, rank=..., momentum=...)` is the size of each chunk's
state blob exactly as the engine's updater allocates it (tests/test_optimizer_table.py checks
it against `make_updater(...).state_bytes` for every entry): chunk-wise updaters (AdamW, SGD)
keep one flat block per chunk; slot-wise ones (`SlotUpdater`) lay out each parameter's state
tensors one after another, each rounded up to ALIGN_BYTES. The drop-in classes in optim/
(which import nothing of offload) keep their own `cost()`; the same test compares the two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from ..core.chunks import ChunkPlan
from ..core.errors import TierwiseError

ALIGN_BYTES = 64
"""Alignment of each state tensor inside a slot-wise chunk blob (update.SlotUpdater)."""
BLOCK = 256  # optim.quant.BLOCK: elements per 8-bit quantization block (one fp32 absmax each)
MIN_8BIT_NUMEL = 4096  # optim.adamw8bit.MIN_8BIT_NUMEL: smaller tensors keep fp32 moments
_SKIP = ("embed", "lm_head", "wte", "wpe", "output")


def projected_params(shapes: dict[str, tuple[int, ...]]) -> set[str]:
    """Names the low-rank optimizers project: >= 2-D parameters except embeddings and the
    output head (vocabulary-sized rows the papers keep in full AdamW)."""
    return {n for n, s in shapes.items() if len(s) >= 2 and not any(k in n for k in _SKIP)}


def _matrix(shape: tuple[int, ...]) -> tuple[int, int]:  # optim.galore.as_matrix
    return shape[0], math.prod(shape[1:])


def _low(rows: int, cols: int, r: int) -> int:
    """Elements of the projected gradient (optim.galore.low_rank_shape)."""
    return rows * r if rows >= cols else r * cols


def _adam(n: int) -> list[int]:
    return [4 * n, 4 * n]


def _adam8(n: int) -> list[int]:
    if n < MIN_8BIT_NUMEL:
        return [4 * n, 4 * n]
    blocks = -(-n // BLOCK)
    return [n, n, 4 * blocks, 4 * blocks]


def _galore(eight_bit: bool) -> Callable[[tuple[int, ...], bool, int], list[int]]:
    def tensors(shape: tuple[int, ...], projected: bool, rank: int) -> list[int]:
        if not projected:
            return _adam(math.prod(shape))
        rows, cols = _matrix(shape)
        r = min(rank, rows, cols)
        moments = _adam8(_low(rows, cols, r)) if eight_bit else _adam(_low(rows, cols, r))
        return moments + [4 * r * (cols if rows >= cols else rows)]  # the SVD projector
    return tensors


def _apollo(mini: bool) -> Callable[[tuple[int, ...], bool, int], list[int]]:
    def tensors(shape: tuple[int, ...], projected: bool, rank: int) -> list[int]:
        if not projected:
            return _adam(math.prod(shape))
        rows, cols = _matrix(shape)
        k = min(1 if mini else rank, rows, cols)
        # moments, the scaled-gradient norm (a 0-dim fp32), the random projector (kept in the blob)
        return _adam(_low(rows, cols, k)) + [4, 4 * k * (cols if rows >= cols else rows)]
    return tensors


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """One row of the table."""

    name: str
    slot_state: Callable[[tuple[int, ...], bool, int], list[int]] | None = None
    """Slot-wise updaters: bytes of each state tensor of one parameter (shape, projected, rank);
    None: chunk-wise, `chunk_state_per_param` bytes per element of the chunk."""
    chunk_state_per_param: int = 0
    """Chunk-wise updaters: state bytes per element (AdamW 8; SGD 4 with momentum, else 0)."""
    lowrank: str | None = None
    """None, "galore" (SVD projector) or "apollo" (random projector)."""
    default_rank: int = 0
    """Rank of the projection when none is given (engine and planner alike)."""
    needs_grad: bool = True
    """False for zeroth-order optimizers: no gradient chunks, no backward."""
    forwards: int = 1
    """Forward passes per step (MeZO: 2, folded into one duplicated batch in the engine)."""
    cpu_rate: str = "adamw"
    """Host throughput that applies (HostSpec.<cpu_rate>_params_per_s): "adamw" or "adamw8bit"."""
    cpu_rate_scale: float = 1.0
    """Multiplier on that throughput (a cheaper update runs faster)."""
    dense_state_per_param: float = 8.0
    """State bytes per element of a large non-projected parameter (for people: README, tables)."""
    fp32_embeddings: bool = False
    """nn.Embedding weights keep fp32 moments (8 B/element), as transformers' Trainer has
    bitsandbytes' 8-bit optimizers do (a row no token reached keeps a zero gradient, which 8-bit
    moments turn into steps of many times lr)."""

    @property
    def low_rank(self) -> bool:
        return self.lowrank is not None


#: A zeroth-order optimizer over a mixture of experts, refused by the planner and the engine alike.
MOE_ZEROTH = ("a zeroth-order optimizer (mezo) perturbs each module in its own forward over half of a "
              "doubled batch, and a mixture of experts routes flattened tokens between its modules: not "
              "supported; train it with adamw, adamw8bit, galore or apollo")

OPTIMIZERS: dict[str, OptimizerSpec] = {s.name: s for s in (
    OptimizerSpec(name="adamw", chunk_state_per_param=8),
    # bitsandbytes-style block-wise 8-bit: 2 B of moments + 2 fp32 absmax per 256-element block
    OptimizerSpec(name="adamw8bit", slot_state=lambda shape, projected, rank: _adam8(math.prod(shape)),
                  cpu_rate="adamw8bit", dense_state_per_param=2.0 + 8 / BLOCK, fp32_embeddings=True),
    OptimizerSpec(name="galore", slot_state=_galore(False), lowrank="galore", default_rank=128),
    OptimizerSpec(name="galore8bit", slot_state=_galore(True), lowrank="galore", default_rank=128,
                  cpu_rate="adamw8bit", dense_state_per_param=8.0),
    OptimizerSpec(name="apollo", slot_state=_apollo(False), lowrank="apollo", default_rank=256),
    OptimizerSpec(name="apollo-mini", slot_state=_apollo(True), lowrank="apollo", default_rank=1),
    OptimizerSpec(name="mezo", needs_grad=False, forwards=2, cpu_rate_scale=2.0, dense_state_per_param=0.0),
    # SGD (the engine's momentum-free default): one multiply-add per element, ~2x an AdamW pass
    OptimizerSpec(name="sgd", cpu_rate_scale=2.0, dense_state_per_param=0.0),
)}
NAMES = tuple(OPTIMIZERS)
LOW_RANK = tuple(n for n, s in OPTIMIZERS.items() if s.low_rank)


def optimizer_spec(name: str) -> OptimizerSpec:
    """The table's row for `name` (case-insensitive); TierwiseError listing the known ones."""
    try:
        return OPTIMIZERS[name.lower()]
    except KeyError:
        raise TierwiseError(f"unknown optimizer '{name}' (known: {', '.join(NAMES)})") from None


def _align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def state_bytes(plan: ChunkPlan, name: str, *, rank: int | None = None, momentum: float = 0.0) -> list[int]:
    """Bytes of every chunk's state blob, as the engine's updater for `name` allocates them."""
    spec = optimizer_spec(name)
    if spec.slot_state is None:
        per = 4 if name == "sgd" and momentum else spec.chunk_state_per_param
        return [per * c.numel for c in plan.chunks]
    shapes = {n: tuple(s.shape) for n, s in plan.slots.items()}
    proj = projected_params(shapes) if spec.low_rank else set()
    r = spec.default_rank if rank is None else rank

    def tensors(n: str) -> list[int]:
        if spec.fp32_embeddings and plan.slots[n].embedding:
            return _adam(math.prod(shapes[n]))
        return spec.slot_state(shapes[n], n in proj, r)

    return [sum(_align(b) for n in c.params for b in tensors(n)) for c in plan.chunks]
