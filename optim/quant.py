"""Block-wise dynamic 8-bit quantization (the bitsandbytes scheme), in plain torch.

A block of 256 values is stored as 256 uint8 codes plus one fp32 absmax; a code indexes a
sorted 256-entry "dynamic map" (exponent + shrinking fraction, Dettmers 2015). Quantizing
picks the nearest map entry of x / absmax (ties go to the lower entry).
"""
from __future__ import annotations

import functools
import math

import torch

BLOCK = 256


def create_dynamic_map(*, signed: bool, max_exponent_bits: int = 7, total_bits: int = 8) -> torch.Tensor:
    """The sorted dynamic quantization map, equal to bnb.functional.create_dynamic_map."""
    values: list[float] = []
    non_sign_bits = total_bits - 1
    extra = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        n_frac = 2 ** (i + non_sign_bits - max_exponent_bits + (0 if signed else 1)) + 1
        edges = torch.linspace(0.1, 1, n_frac, dtype=torch.float32)
        means = (edges[:-1] + edges[1:]) / 2.0
        magnitude = 10 ** (-(max_exponent_bits - 1) + i)
        values += (magnitude * means).tolist()  # fp32 product, as the reference rounds it
        if signed:
            values += (-magnitude * means).tolist()
    if extra > 0:  # only for non-default bit splits; mirrors the reference's last exponent
        edges = torch.linspace(0.1, 1, extra + 1, dtype=torch.float32)
        means = (edges[:-1] + edges[1:]) / 2.0
        magnitude = 10 ** (-(max_exponent_bits - 1) + max_exponent_bits - 1)
        values += (magnitude * means).tolist()
        if signed:
            values += (-magnitude * means).tolist()
    values += [0.0, 1.0]
    if len(values) != 2**total_bits:
        raise ValueError(f"dynamic map has {len(values)} entries, expected {2**total_bits}")
    values += [0.0] * (256 - len(values))
    values.sort()
    return torch.tensor(values, dtype=torch.float32)


@functools.lru_cache(maxsize=None)
def _maps_cpu(signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    code = create_dynamic_map(signed=signed)
    # midpoints between neighbours; the last is +inf so "x > mid[255]" is never true
    mid = torch.cat([(code[:-1] + code[1:]) / 2, torch.tensor([math.inf])])
    return code, mid


def dynamic_map(*, signed: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 256-entry map (fp32, sorted) on `device`."""
    return _maps_cpu(signed)[0].to(device)


def midpoints(*, signed: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """Decision boundaries of the map: mid[i] = (code[i] + code[i+1]) / 2, mid[255] = inf."""
    return _maps_cpu(signed)[1].to(device)


def num_blocks(n: int, block: int = BLOCK) -> int:
    return -(-n // block)


def _blocked(x: torch.Tensor, block: int) -> torch.Tensor:
    """x: (n,) -> (blocks, block), zero-padded (zeros never raise an absmax)."""
    n = x.numel()
    pad = num_blocks(n, block) * block - n
    flat = x.reshape(-1)
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, block)


def quantize_blockwise(
    x: torch.Tensor,  # (...) float
    *,
    signed: bool,
    block: int = BLOCK,
    out: torch.Tensor | None = None,  # (...) uint8, same numel as x
    absmax_out: torch.Tensor | None = None,  # (blocks,) fp32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest-code quantization of x; returns (codes uint8 shaped like x, absmax (blocks,))."""
    n = x.numel()
    xb = _blocked(x.float(), block)
    absmax = xb.abs().amax(dim=1)
    inv = torch.where(absmax > 0, 1.0 / absmax, torch.zeros_like(absmax))
    scaled = (xb * inv[:, None]).clamp_(-1.0, 1.0).reshape(-1)[:n]
    # bucketize(right=False) counts midpoints strictly below x: a tie goes to the lower code
    idx = torch.bucketize(scaled, midpoints(signed=signed, device=x.device)[:-1])
    codes = idx.to(torch.uint8).view(x.shape)
    if out is not None:
        out.copy_(codes.view(out.shape))
        codes = out
    if absmax_out is not None:
        absmax_out.copy_(absmax)
        absmax = absmax_out
    return codes, absmax


def dequantize_blockwise(
    codes: torch.Tensor,  # (...) uint8
    absmax: torch.Tensor,  # (blocks,) fp32
    *,
    signed: bool,
    block: int = BLOCK,
) -> torch.Tensor:
    """code[q] * absmax[block of q], fp32, shaped like codes."""
    n = codes.numel()
    values = dynamic_map(signed=signed, device=codes.device)[codes.reshape(-1).long()]
    values = _blocked(values, block) * absmax[:, None]
    return values.reshape(-1)[:n].view(codes.shape)


def quant_lut(*, signed: bool) -> torch.Tensor:
    """Lookup table for fast nearest-code search, keyed by the top 16 bits of an fp32 in [-1, 1].

    key = min((bits >> 16) & 0x7fff, 0x3f80) | (0x4000 if negative): 0x8000 entries. Entry =
    nearest code of the bucket's lowest value; one comparison with the next midpoint then
    gives the exact nearest code (checked here: no bucket holds two midpoints).
    """
    keys = torch.arange(0x8000, dtype=torch.int64)
    mag_hi = keys & 0x3FFF
    neg = (keys & 0x4000) != 0
    hi = torch.minimum(mag_hi, torch.tensor(0x3F80))
    low_bits = torch.where(neg, (hi << 16) | 0xFFFF, hi << 16)  # lowest value of the bucket
    high_bits = torch.where(neg, hi << 16, (hi << 16) | 0xFFFF)
    signs = torch.where(neg, -1.0, 1.0)

    def as_float(bits: torch.Tensor) -> torch.Tensor:
        return bits.to(torch.int32).view(torch.float32).abs().clamp(max=1.0) * signs

    mids = midpoints(signed=signed)[:-1]
    lo = torch.bucketize(as_float(low_bits), mids)
    hi_idx = torch.bucketize(as_float(high_bits), mids)
    if int((hi_idx - lo).max()) > 1:
        raise AssertionError("dynamic map too fine for a 16-bit lookup table")
    return lo.to(torch.int32)
