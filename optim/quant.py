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


def _decade_sizes(*, signed: bool, max_exponent_bits: int = 7, total_bits: int = 8) -> list[int]:
    """Positive codes per decade of the dynamic map, smallest decade first."""
    shift = total_bits - 1 - max_exponent_bits + (0 if signed else 1)
    return [2 ** (i + shift) for i in range(max_exponent_bits)]


def create_dynamic_map(*, signed: bool, max_exponent_bits: int = 7, total_bits: int = 8) -> torch.Tensor:
    """The sorted dynamic quantization map, equal to bnb.functional.create_dynamic_map."""
    values: list[float] = []
    extra = 2 ** (total_bits - 1 - max_exponent_bits) - 1
    sizes = _decade_sizes(signed=signed, max_exponent_bits=max_exponent_bits, total_bits=total_bits)
    for i, size in enumerate(sizes):
        edges = torch.linspace(0.1, 1, size + 1, dtype=torch.float32)
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


@functools.lru_cache(maxsize=None)
def _maps_on(signed: bool, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The maps copied to `device` once (each copy from pageable memory would wait for it)."""
    return tuple(t.to(device) for t in _maps_cpu(signed))  # type: ignore[return-value]


def _key(device: torch.device | str) -> str:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:  # one entry per card, not per current device
        dev = torch.device("cuda", torch.cuda.current_device())
    return str(dev)


def dynamic_map(*, signed: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 256-entry map (fp32, sorted) on `device` (shared: read it, never write it)."""
    return _maps_on(signed, _key(device))[0]


def midpoints(*, signed: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """Decision boundaries of the map: mid[i] = (code[i] + code[i+1]) / 2, mid[255] = inf."""
    return _maps_on(signed, _key(device))[1]


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
    nonzero: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest-code quantization of x; returns (codes uint8 shaped like x, absmax (blocks,)).
    `nonzero` (an unsigned map: Adam's second moment): a positive x codes at least 1, the
    smallest positive entry, never 0 (divided into its first moment, a v read back as 0 makes
    a step of m / eps: the zero-point problem of low-bit optimizer states)."""
    n = x.numel()
    xf = x.float()
    xb = _blocked(xf, block)
    absmax = xb.abs().amax(dim=1)
    inv = torch.where(absmax > 0, 1.0 / absmax, torch.zeros_like(absmax))
    scaled = (xb * inv[:, None]).clamp_(-1.0, 1.0).reshape(-1)[:n]
    # bucketize(right=False) counts midpoints strictly below x: a tie goes to the lower code
    idx = torch.bucketize(scaled, midpoints(signed=signed, device=x.device)[:-1])
    if nonzero:
        idx = torch.where((idx == 0) & (xf.reshape(-1)[:n] > 0), 1, idx)
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
class DecadeTable:
    """Nearest-code quantization by arithmetic, the C kernel's quantizer (no table gather).

    Within a decade the map's codes are evenly spaced, so for y = |x| the nearest code is
    base + floor((y - first) / spacing + 1/2). Groups: 0 the zero code, 1..7 the decades,
    8 the code 1.0. The group of y comes from its binary exponent E (a binade holds at most
    one group boundary): group = D[E] + (y > L[E]). Then, all in fp32,
        code = trunc(min(fma(y, A[group], -B[group]), K[group]))
    (B folds the first code, the 1/2 and the base index; K the last index of the group).
    A signed map mirrors negative x: code = max(254 - code, 0). This equals the nearest code
    (bucketize on the midpoints) except within ~3e-5 of a code spacing from a midpoint (the
    fp32 codes sit a few ulps off an exact progression), where either neighbour may be chosen;
    every kernel path rounds the same way, so they agree exactly. Inputs must satisfy |x| <= 1
    up to rounding (the kernel scales by a finite 1/absmax); groups 9..15 repeat group 8.
    packed: (128,) fp32 = A[0:16] B[16:32] K[32:48] L[48:80] D[80:112] (indexed by E & 31,
    E clamped to >= 96: every group boundary lies above 2^-30).
    """

    packed: torch.Tensor

    def lookup(self, x: torch.Tensor, *, signed: bool) -> torch.Tensor:  # (...) fp32 -> (...) int64
        """The kernel's arithmetic in torch (fma emulated in float64), for tests."""
        t = self.packed
        a, b, k, lim, dec = t[0:16], t[16:32], t[32:48], t[48:80], t[80:112].long()
        y = x.abs() if signed else x
        e = ((y.contiguous().view(torch.int32) >> 23).clamp(min=96) & 31).long()
        group = dec[e] + (y > lim[e]).long()
        r = (y.double() * a[group].double() - b[group].double()).float()
        code = torch.minimum(r, k[group]).trunc().long()
        if signed:
            code = torch.where(x.view(torch.int32) < 0, (254 - code).clamp(min=0), code)
        return code


@functools.lru_cache(maxsize=None)
def decade_table(*, signed: bool) -> DecadeTable:
    """The DecadeTable of the default dynamic map (raises if the map is not of that form)."""
    code = dynamic_map(signed=signed).double()
    mid = midpoints(signed=signed)[:-1].double()
    zero = int((code == 0).nonzero()[0])
    groups, first = [(zero, 1)], zero + 1
    for size in _decade_sizes(signed=signed):
        groups.append((first, size))
        first += size
    if first != 255 or float(code[255]) != 1.0:
        raise ValueError("not the default dynamic map: no decade table")
    groups.append((255, 1))
    a, b, k, bounds = [], [], [], []
    for g, (first, size) in enumerate(groups):
        inv = 0.0 if size == 1 else (size - 1) / float(code[first + size - 1] - code[first])
        a.append(inv)
        b.append(float(code[first]) * inv - 0.5 - first)
        k.append(first + size - 1 + 0.5)
        if g:
            bounds.append(float(mid[first - 1]))
    bnd = torch.tensor(bounds, dtype=torch.float32)
    if float(bnd.min()) <= 2.0**-30:
        raise ValueError("a group boundary below 2^-30: no decade table")
    packed = torch.zeros(128, dtype=torch.float32)
    packed[0:9], packed[16:25], packed[32:41] = torch.tensor(a), torch.tensor(b), torch.tensor(k)
    for base in (0, 16, 32):  # defensive: an out-of-range group reads the top group, not zeros
        packed[base + 9:base + 16] = packed[base + 8]
    for e in range(96, 128):
        lo, hi = 2.0 ** (e - 127), 2.0 ** (e - 126)
        inside = [t for t in bnd.tolist() if lo <= t < hi]
        if len(inside) > 1:
            raise ValueError("two group boundaries in one binade: no decade table")
        packed[48 + (e & 31)] = inside[0] if inside else 4.0  # 4.0: never exceeded
        packed[80 + (e & 31)] = float((bnd < lo).sum()) if e > 96 else 0.0
    return DecadeTable(packed=packed)
