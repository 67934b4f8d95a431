"""Chunking (pure): pack parameters, in first-use order, into flat chunks.

A chunk is a flat buffer of `numel` elements. Every parameter gets a slot: a contiguous
range [offset, offset + numel) of one chunk, holding the parameter's elements in its *memory
order*: a parameter with strides (a transposed weight) keeps them, its slot is the dense
block such a tensor occupies, and `Slot.view` gives it back with the user's shape and strides.
A 0-dim parameter is a 1-element slot. Overlapping (expanded) or gapped parameters have no
dense block and are refused (ParamLayoutError). Each chunk then exists in several parallel
*kinds* (compute copy, gradient, fp32 master, optimizer state) that share this layout, so a
slot indexes every kind of its chunk the same way.

Slots start at multiples of ALIGN elements (64 bytes in fp32) so that a flat, vectorised
kernel over a chunk sees each parameter on the same vector boundaries as a per-tensor kernel
(a parameter's tail, numel % ALIGN elements, may still round differently: offload.update.update
passes such parameters to the fused AdamW kernel as tensors of their own).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from .errors import ParamLayoutError

ALIGN = 16  # elements; 64 bytes of fp32

#: Default chunk size, in bytes of fp32 master weights.
DEFAULT_CHUNK_BYTES = 64 << 20


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, step = [], 1
    for size in reversed(shape):
        out.append(step)
        step *= max(size, 1)
    return tuple(reversed(out))


def is_dense(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """True when a tensor of this shape and stride fills exactly numel consecutive elements
    (a permutation of a contiguous layout): no overlap, no gaps. Size-1 dims never matter."""
    if 0 in shape:
        return True
    expected = 1
    for st, size in sorted((st, size) for size, st in zip(shape, stride) if size != 1):
        if st != expected:
            return False
        expected *= size
    return True


def same_layout(shape: Sequence[int], a: Sequence[int], b: Sequence[int]) -> bool:
    """Strides `a` and `b` place every element of `shape` at the same position."""
    if a == b:
        return True
    return all(x == y for size, x, y in zip(shape, a, b) if size != 1)


@dataclass(frozen=True, kw_only=True)
class ParamSpec:
    """One parameter as the chunker sees it: a name, a shape and its strides (no data).
    stride None: contiguous."""

    name: str
    shape: tuple[int, ...]
    stride: tuple[int, ...] | None = None
    embedding: bool = False  # an nn.Embedding's weight (AdamW8bit keeps its moments in fp32)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, kw_only=True)
class Slot:
    """Where one parameter lives: elements [offset, offset + numel) of chunk `chunk`, in the
    memory order of a tensor of `shape` and `stride` (the parameter's own; None: contiguous)."""

    name: str
    chunk: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...] | None = None
    embedding: bool = False  # ParamSpec.embedding

    def __post_init__(self) -> None:
        if self.stride is None:
            object.__setattr__(self, "stride", contiguous_strides(self.shape))

    @functools.cached_property
    def numel(self) -> int:  # (cached: read for every gradient a step hands over)
        return math.prod(self.shape)

    def flat(self, kind: Any) -> Any:
        """This slot of `kind` (a [numel] chunk tensor): [numel] in memory order."""
        return kind[self.offset: self.offset + self.numel]

    def view(self, kind: Any) -> Any:
        """This slot of `kind` as the parameter: its shape and strides."""
        return kind.as_strided(self.shape, self.stride, kind.storage_offset() + self.offset)


@dataclass(frozen=True, kw_only=True)
class ChunkSpec:
    """A chunk: its index, its length in elements and the parameters in it, in order."""

    index: int
    numel: int
    params: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class ChunkPlan:
    """The result of packing: chunks in first-use order and a slot per parameter."""

    chunks: tuple[ChunkSpec, ...]
    slots: dict[str, Slot] = field(hash=False)
    chunk_numel: int
    frozen: frozenset[int] = frozenset()  # chunks of frozen parameters: always after the trainable ones

    def is_frozen(self, index: int) -> bool:
        return index in self.frozen

    def trainable(self) -> "ChunkPlan":
        """The plan of the trainable chunks alone (same indices: they come first)."""
        if not self.frozen:
            return self
        chunks = tuple(c for c in self.chunks if c.index not in self.frozen)
        names = {n for c in chunks for n in c.params}
        return ChunkPlan(chunks=chunks, slots={n: s for n, s in self.slots.items() if n in names},
                         chunk_numel=self.chunk_numel)

    @property
    def total_numel(self) -> int:
        """Elements over all chunks, padding included."""
        return sum(c.numel for c in self.chunks)

    @property
    def param_numel(self) -> int:
        return sum(s.numel for s in self.slots.values())

    def chunk_bytes(self, index: int, element_size: int) -> int:
        return self.chunks[index].numel * element_size

    def max_chunk_numel(self) -> int:
        return max((c.numel for c in self.chunks), default=0)


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


def pack_chunks(params: Sequence[ParamSpec], *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                element_size: int = 4, frozen: "set[str] | frozenset[str]" = frozenset()) -> ChunkPlan:
    """Pack `params` (already in first-use order) greedily into chunks of `chunk_bytes`.

    A parameter that does not fit in the space left starts a new chunk; one larger than a
    chunk gets a chunk of its own, sized to it. Chunks are trimmed to what they hold.
    Parameters named in `frozen` (requires_grad=False) are packed apart, after the trainable
    ones: a chunk is either frozen (a compute copy only) or trainable (every kind), and the
    trainable chunks keep indices 0..n-1 (the optimizer's plan, ChunkPlan.trainable).
    """
    if frozen:
        first = pack_chunks([p for p in params if p.name not in frozen], chunk_bytes=chunk_bytes,
                            element_size=element_size)
        rest = pack_chunks([p for p in params if p.name in frozen], chunk_bytes=chunk_bytes,
                           element_size=element_size)
        k = len(first.chunks)
        moved = tuple(ChunkSpec(index=c.index + k, numel=c.numel, params=c.params) for c in rest.chunks)
        joined = dict(first.slots) | {n: dataclasses.replace(s, chunk=s.chunk + k) for n, s in rest.slots.items()}
        return ChunkPlan(chunks=first.chunks + moved, slots=joined, chunk_numel=first.chunk_numel,
                         frozen=frozenset(c.index for c in moved))
    if chunk_bytes < ALIGN * element_size:
        raise ValueError(f"chunk size {chunk_bytes} B is too small (minimum {ALIGN * element_size} B)")
    capacity = chunk_bytes // element_size
    names = [p.name for p in params]
    if len(set(names)) != len(names):
        raise ValueError("parameter names must be unique (pass tied parameters once)")

    chunks: list[ChunkSpec] = []
    slots: dict[str, Slot] = {}
    current: list[str] = []
    used = 0

    def close() -> None:
        nonlocal current, used
        if current:
            chunks.append(ChunkSpec(index=len(chunks), numel=_round_up(used, ALIGN), params=tuple(current)))
        current, used = [], 0

    for p in params:
        if p.stride is not None and not is_dense(p.shape, p.stride):
            raise ParamLayoutError(
                f"parameter {p.name!r} (shape {tuple(p.shape)}, stride {tuple(p.stride)}) overlaps itself "
                f"or has gaps (an expanded or sliced tensor); give the module a dense parameter, e.g. "
                f"nn.Parameter(t.detach().clone())")
        n = p.numel
        start = _round_up(used, ALIGN)
        if current and start + n > capacity:
            close()
            start = 0
        slots[p.name] = Slot(name=p.name, chunk=len(chunks), offset=start, shape=tuple(p.shape),
                             stride=None if p.stride is None else tuple(p.stride), embedding=p.embedding)
        current.append(p.name)
        used = start + n
        if used >= capacity:  # full, or an oversized parameter alone in its chunk
            close()
    close()
    return ChunkPlan(chunks=tuple(chunks), slots=slots, chunk_numel=capacity)


def specs_of(named_params: Iterable[tuple[str, Any]], *, embeddings: "frozenset[str] | set[str]" = frozenset()
             ) -> list[ParamSpec]:
    """ParamSpecs from (name, tensor) pairs (meta tensors too: shape and strides only);
    `embeddings`: the names that are nn.Embedding weights (model_info.embedding_names)."""
    return [ParamSpec(name=n, shape=tuple(t.shape), stride=tuple(t.stride()), embedding=n in embeddings)
            for n, t in named_params]
