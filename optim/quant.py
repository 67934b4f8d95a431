"""Block-wise dynamic 8-bit quantization (the bitsandbytes scheme), in plain torch.

A block of 256 values is stored as 256 uint8 codes plus one fp32 absmax; a code indexes a
sorted 256-entry "dynamic map" (exponent + shrinking fraction, Dettmers 2015). Quantizing
picks the nearest map entry of x / absmax (ties go to the lower entry).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

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


@dataclass(frozen=True)
class QuantTable:
    """O(1) nearest-code lookup for fp32 x in [-1, 1] (the C kernel's quantizer).

    A bucket is every float sharing sign, exponent and top `23 - shift` mantissa bits:
    top = (bits & 0x7fffffff) >> shift, clamped to [tmin, tmax] (below tmin all values share
    one code and no boundary), index = top - tmin (+ nk if negative). entries[index] =
    base | thr << 8: base is the number of midpoints below the bucket, thr the low `shift`
    bits of the one midpoint inside it (oriented so larger means larger value: complemented
    for negatives), or all ones if none. Code = base + (oriented low bits > thr), i.e. the
    number of midpoints strictly below x: the nearest entry, ties to the lower one, exactly
    as bucketize on the midpoints.
    """

    entries: torch.Tensor  # (2 * nk,) int32 for a signed map, (nk,) for an unsigned one
    shift: int
    tmin: int
    tmax: int
    nk: int

    def lookup(self, x: torch.Tensor) -> torch.Tensor:  # x: (...) fp32 in [-1, 1] -> (...) int64
        """The table lookup in torch integer ops (what the C kernel computes), for tests."""
        bits = x.contiguous().view(torch.int32).to(torch.int64)
        if self.entries.numel() == self.nk:  # unsigned map: one sign, -0.0 is 0.0
            bits = bits & 0x7FFFFFFF
        neg = bits < 0
        low_mask = (1 << self.shift) - 1
        top = ((bits & 0x7FFFFFFF) >> self.shift).clamp(self.tmin, self.tmax)
        idx = top - self.tmin + torch.where(neg, self.nk, 0)
        low = torch.where(neg, low_mask - (bits & low_mask), bits & low_mask)
        e = self.entries.to(torch.int64)[idx]
        return (e & 0xFF) + (low > (e >> 8)).to(torch.int64)


def _float_of_bits(bits: torch.Tensor) -> torch.Tensor:  # (k,) int64 -> (k,) fp32
    return bits.to(torch.int32).view(torch.float32)


@functools.lru_cache(maxsize=None)
def quant_table(*, signed: bool) -> QuantTable:
    """The smallest exact QuantTable for the map (raises if none with <= 12 key mantissa bits)."""
    mids = midpoints(signed=signed)[:-1].contiguous()
    mag_bits = mids.abs().view(torch.int32).to(torch.int64)
    if bool((mids == 0).any()):
        raise ValueError("a midpoint at zero: no sign-symmetric lookup table")
    for key_mantissa_bits in range(4, 13):
        shift = 23 - key_mantissa_bits
        low_mask = (1 << shift) - 1
        tmax = 0x3F800000 >> shift  # the bucket of 1.0; scaled values never exceed it
        tmin = int((mag_bits >> shift).min()) - 1  # below it: no boundary, one code
        tops = torch.arange(tmin, tmax + 1, dtype=torch.int64)
        parts, exact = [], True
        for neg in ([False, True] if signed else [False]):
            lo_mag, hi_mag = _float_of_bits(tops << shift), _float_of_bits((tops << shift) | low_mask)
            lowest, highest = (-hi_mag, -lo_mag) if neg else (lo_mag, hi_mag)
            base = torch.bucketize(lowest, mids)  # midpoints strictly below the bucket
            inside = torch.bucketize(highest, mids, right=True) - base
            if int(inside.max()) > 1:
                exact = False
                break
            mid_low = mag_bits[base.clamp(max=mids.numel() - 1)] & low_mask
            thr = torch.where(inside == 1, (low_mask - mid_low) if neg else mid_low, low_mask)
            parts.append(base | (thr << 8))
        if exact:
            entries = torch.cat(parts).to(torch.int32)
            return QuantTable(entries=entries, shift=shift, tmin=tmin, tmax=tmax, nk=tops.numel())
    raise ValueError("dynamic map too fine for a lookup table")
