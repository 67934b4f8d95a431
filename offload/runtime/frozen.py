"""Frozen chunks: the byte layout of a chunk of frozen parameters stored encoded.

A frozen chunk (offload.core.chunks: packed apart from the trainable ones) has one kind, its
compute copy, and it is never written back. When some of its parameters are stored in
another dtype than the compute dtype (`base_dtype`, offload.runtime.codecs), the home copy is
a byte blob: each parameter's encoding (`codecs.encode` of its slot, in memory order) at a
16-byte aligned offset. That blob is what the home tier holds and the link carries; the
device decodes it into the chunk's compute buffer, slot by slot, right before use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.chunks import ChunkPlan
from . import codecs

from ..core.encoding import aligned

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class FrozenLayout:
    """Where each parameter's encoding lies in the chunk's blob, and in which base dtype."""

    base: dict[str, str]  # parameter -> base dtype (codecs.BASE_DTYPES)
    offsets: dict[str, int]  # parameter -> byte offset in the blob
    nbytes: int
    double_quant: bool = False


def layout_of(plan: ChunkPlan, cid: int, base: dict[str, str], *, double_quant: bool = False) -> FrozenLayout:
    """The blob layout of frozen chunk `cid`; `base`: each of its parameters' base dtype."""
    offsets, at = {}, 0
    for name in plan.chunks[cid].params:
        offsets[name] = at
        n = codecs.encoded_nbytes(base[name], plan.slots[name].numel, double_quant=double_quant)
        at += aligned(n)
    return FrozenLayout(base={n: base[n] for n in plan.chunks[cid].params}, offsets=offsets, nbytes=at,
                        double_quant=double_quant)


def _span(layout: FrozenLayout, plan: ChunkPlan, name: str) -> tuple[int, int]:
    n = codecs.encoded_nbytes(layout.base[name], plan.slots[name].numel, double_quant=layout.double_quant)
    return layout.offsets[name], n


def encode_slot(layout: FrozenLayout, plan: ChunkPlan, name: str, blob: torch.Tensor, value: torch.Tensor) -> None:
    """Write parameter `name` (a tensor of its shape) into `blob`, in its slot's memory order."""
    slot = plan.slots[name]
    flat = value.new_empty_strided(slot.shape, slot.stride).copy_(value).as_strided((slot.numel,), (1,))
    off, n = _span(layout, plan, name)
    blob[off: off + n].copy_(codecs.encode(layout.base[name], flat, double_quant=layout.double_quant))


def decode_chunk(layout: FrozenLayout, plan: ChunkPlan, blob: torch.Tensor, out: torch.Tensor) -> None:
    """Decode the whole blob into `out` ([numel] compute dtype, on blob's device)."""
    for name, off in layout.offsets.items():
        _, n = _span(layout, plan, name)
        codecs.decode(layout.base[name], blob[off: off + n], plan.slots[name].flat(out),
                      double_quant=layout.double_quant)


def encode_decode_slot(layout: FrozenLayout, plan: ChunkPlan, name: str, value: torch.Tensor,
                       out: torch.Tensor) -> None:
    """Parameter `name`'s `value` as its encoding decodes, into its slot of `out` ([numel] compute
    dtype, any device): what a chunk decoded for good holds (ChunkStore.decode_home)."""
    slot = plan.slots[name]
    flat = value.new_empty_strided(slot.shape, slot.stride).copy_(value).as_strided((slot.numel,), (1,))
    encoded = codecs.encode(layout.base[name], flat, double_quant=layout.double_quant)
    codecs.decode(layout.base[name], encoded.to(out.device), slot.flat(out), double_quant=layout.double_quant)


def decode_slot(layout: FrozenLayout, plan: ChunkPlan, name: str, blob: torch.Tensor,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Parameter `name` decoded to `dtype` (the compute dtype: the values the model computes
    with), [numel] in memory order."""
    off, n = _span(layout, plan, name)
    out = torch.empty(plan.slots[name].numel, dtype=dtype, device=blob.device)
    codecs.decode(layout.base[name], blob[off: off + n], out, double_quant=layout.double_quant)
    return out


def base_dtypes(names: list[str], *, base_dtype: "str | None", quantizable: set[str],
                compute_dtype: torch.dtype) -> dict[str, str]:
    """Each frozen parameter's base dtype. None: the compute dtype (nothing encoded); bf16/fp16:
    every frozen parameter; int8/nf4: the `quantizable` ones (nn.Linear weights but the output
    head, as bitsandbytes quantizes a model, and fused MoE experts), the rest in the compute dtype."""
    plain = DTYPE_NAMES[compute_dtype]
    if base_dtype is None:
        return dict.fromkeys(names, plain)
    if base_dtype not in codecs.BASE_DTYPES:
        raise ValueError(f"base_dtype must be one of {codecs.BASE_DTYPES}, got {base_dtype!r}")
    if base_dtype in ("int8", "nf4"):
        return {n: base_dtype if n in quantizable else plain for n in names}
    return dict.fromkeys(names, base_dtype)
