"""Bytes of encoded frozen weights (pure, no torch): THE sizes of each base dtype's encoding.

`runtime.codecs` lays the encodings out exactly so (and imports these numbers); the planner
prices frozen chunks with them. NF4 and int8 keep one absmax per block of BLOCK elements; NF4
with double quantization stores that absmax as one byte per block plus, per NESTED_BLOCK
blocks, an fp32 absmax, and one fp32 offset (bitsandbytes' layout). A parameter's encoding
starts at an ALIGN_BYTES-aligned offset in its chunk's blob (`runtime.frozen`).
"""

from __future__ import annotations

from typing import Sequence

from .vocab import BASE_DTYPES as BASE_DTYPES, QUANTIZED as QUANTIZED  # the words; the sizes are here

BLOCK = 64  # elements per absmax block (NF4 and int8); bitsandbytes' default for 4-bit
NESTED_BLOCK = 256  # bitsandbytes' block for the double-quantized absmax
ALIGN_BYTES = 16  # each parameter's encoding starts 16-byte aligned in a frozen chunk's blob


def is_expert(name: str) -> bool:
    """Whether parameter `name` belongs to a MoE's experts (fused 3-D, or one module each)."""
    return ".experts." in f".{name}"


def fused_experts(name: str, shape: Sequence[int]) -> bool:
    """Whether parameter `name` of `shape` is a fused MoE expert stack: a 3-D parameter of a
    module named `experts` (transformers 5's Mixtral, Qwen-MoE, ...: `mlp.experts.gate_up_proj`
    [experts, 2 x ffn, hidden]; PEFT's target_parameters wrappers insert `base_layer`s). An
    int8/NF4 base encodes it as one flat tensor (what bitsandbytes' quantize_4bit does with it)."""
    parts = [p for p in name.split(".")[:-1] if p != "base_layer"]
    return len(shape) == 3 and bool(parts) and parts[-1] == "experts" and "lora_" not in name


def _blocks(n: int, block: int) -> int:
    return (n + block - 1) // block


def encoded_nbytes(base_dtype: str, numel: int, *, double_quant: bool = False) -> int:
    """Bytes of `numel` elements stored as `base_dtype` (what the home tier and the link carry)."""
    if base_dtype == "fp32":
        return 4 * numel
    if base_dtype in ("bf16", "fp16"):
        return 2 * numel
    blocks = _blocks(numel, BLOCK)
    if base_dtype == "int8":
        return numel + 4 * blocks
    if base_dtype == "nf4":
        if double_quant:
            return (numel + 1) // 2 + blocks + 4 * _blocks(blocks, NESTED_BLOCK) + 4
        return (numel + 1) // 2 + 4 * blocks
    raise ValueError(f"base dtype must be one of {BASE_DTYPES}, got {base_dtype!r}")


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to ALIGN_BYTES (a parameter's share of a frozen chunk's blob)."""
    return (nbytes + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES
