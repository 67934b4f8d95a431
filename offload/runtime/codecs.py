"""Encoded storage of frozen weights: bf16, fp16, int8 and NF4 (bitsandbytes-compatible).

A frozen parameter never changes, so its home copy (and what crosses the link) can be smaller
than the compute copy; the device decodes it into the compute buffer right before use.

NF4 is the format of bitsandbytes' `quantize_4bit(quant_type="nf4")`: the flat tensor is cut
into blocks of 64 elements; each block keeps its absmax (fp32) and each element the index of
the nearest of the 16 NF4 levels to x / absmax (x times the reciprocal, as bitsandbytes
computes it), two indices per byte, the first in the high nibble. With double quantization
(`compress_statistics=True`), the absmax minus its mean (`offset`) is quantized again block-
wise (blocks of 256) against bitsandbytes' signed dynamic 8-bit map, with an fp32 absmax per
block; that second quantization calls bitsandbytes' quantize_blockwise (see nf4_quantize). `tests/test_codecs.py` checks our bytes against `quantize_4bit` and our decoded weights
against `dequantize_4bit`, bit for bit. Decoding calls bitsandbytes' kernel (C++ on CPU, CUDA
on the GPU) where it applies (an even element count); otherwise, or without bitsandbytes, a
torch path: a table look-up per byte (both nibbles at once) and one multiply per element.

int8 is ours (no compatibility claim): symmetric, block-wise absmax over blocks of 64,
q = round(x / absmax * 127), x' = q * (absmax / 127).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..core.encoding import BASE_DTYPES, BLOCK, NESTED_BLOCK, _blocks, encoded_nbytes  # noqa: F401 - THE sizes

#: The 16 NF4 levels (QLoRA, appendix E), as bitsandbytes stores them (fp32).
NF4_LEVELS = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)


def _settled(t: torch.Tensor) -> torch.Tensor:
    """A cached table, made on whichever stream its first user ran (a copy stream, say): on a
    GPU, finished before any stream reads it (once: the cache keeps it)."""
    if t.is_cuda:
        torch.cuda.synchronize(t.device)
    return t


@lru_cache(maxsize=None)
def _nf4_code(device: str) -> torch.Tensor:
    return _settled(torch.tensor(NF4_LEVELS, dtype=torch.float32, device=device))


@lru_cache(maxsize=None)
def _nf4_pairs(device: str) -> torch.Tensor:
    """[256, 2]: the two levels a packed byte stands for (high nibble first)."""
    code = _nf4_code(device)
    b = torch.arange(256, device=device)
    return _settled(torch.stack([code[b >> 4], code[b & 15]], dim=1).contiguous())


@lru_cache(maxsize=None)
def _dynamic_map(device: str) -> torch.Tensor:
    """bitsandbytes' signed dynamic 8-bit map (the code of the double-quantized absmax)."""
    from bitsandbytes.functional import create_dynamic_map
    return _settled(create_dynamic_map(signed=True).to(device))


def _block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    n = x.numel()
    full = n - n % block
    parts = [x[:full].view(-1, block).abs().amax(dim=1)] if full else []
    if n % block:
        parts.append(x[full:].abs().amax().reshape(1))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _per_element(scale: torch.Tensor, n: int, block: int) -> torch.Tensor:
    return scale.repeat_interleave(block)[:n]


def _nearest(scaled: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """Index of the nearest level of the sorted `code` (a tie goes to the upper level)."""
    bounds = (code[:-1] + code[1:]) / 2
    return torch.bucketize(scaled, bounds, out_int32=True)


@dataclass(frozen=True)
class NF4:
    """One tensor in NF4: `packed` (ceil(n/2) bytes), per-block absmax (fp32 [blocks]) or, with
    double quantization, `qabsmax` (uint8 [blocks]) + `absmax2` (fp32) + `offset` (fp32 [])."""

    packed: torch.Tensor
    shape: tuple[int, ...]
    absmax: torch.Tensor | None = None
    qabsmax: torch.Tensor | None = None
    absmax2: torch.Tensor | None = None
    offset: torch.Tensor | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def block_absmax(self) -> torch.Tensor:
        """The fp32 absmax of every block (decoded first when double-quantized)."""
        if self.qabsmax is None:
            return self.absmax
        code = _dynamic_map(str(self.qabsmax.device))
        n = self.qabsmax.numel()
        return code[self.qabsmax.long()] * _per_element(self.absmax2, n, NESTED_BLOCK) + self.offset


@lru_cache(maxsize=None)
def _bnb_dequantize_4bit(out: bool = False):
    """bitsandbytes' dequantize_4bit op (`out`: its variant that writes into a given tensor), or
    None without bitsandbytes (our torch path then)."""
    try:
        import bitsandbytes  # noqa: F401 - registers torch.ops.bitsandbytes
        op = torch.ops.bitsandbytes.dequantize_4bit
        return op.out if out else op.default
    except (ImportError, AttributeError, RuntimeError):
        return None


def nf4_quantize(t: torch.Tensor, *, double_quant: bool = False) -> NF4:
    """`t` (any float dtype) in NF4, byte for byte what bitsandbytes' quantize_4bit gives."""
    x = t.detach().reshape(-1).float()
    n = x.numel()
    absmax = _block_absmax(x, BLOCK)
    recip = 1.0 / absmax.clamp(min=1e-38)
    scaled = (x * _per_element(recip, n, BLOCK)).clamp_(-1, 1)
    q = _nearest(scaled, _nf4_code(str(x.device))).to(torch.uint8)
    if n % 2:
        q = torch.cat([q, q.new_full((1,), 7)])  # bitsandbytes pads an odd count with the level of 0.0
    packed = (q[0::2] << 4) | q[1::2]
    if not double_quant:
        return NF4(packed=packed, shape=tuple(t.shape), absmax=absmax)
    # the absmax's own 8-bit quantization is bitsandbytes' (quantize_blockwise, once at load): its
    # kernels pick the code by a binary search that, in about one block in a hundred, is not the
    # nearest level (bnb's CPU and CUDA kernels may differ there too): only calling it matches
    from bitsandbytes.functional import quantize_blockwise

    offset = absmax.mean()
    qabsmax, nested = quantize_blockwise(absmax - offset, blocksize=NESTED_BLOCK)
    absmax2 = nested.absmax
    return NF4(packed=packed, shape=tuple(t.shape), qabsmax=qabsmax, absmax2=absmax2, offset=offset)


def nf4_dequantize(q: NF4, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode into `out` (flat, numel elements, any float dtype; allocated when None).
    Computed in fp32 (level × absmax) and then cast, as bitsandbytes does."""
    n = q.numel
    if out is None:
        out = torch.empty(n, dtype=torch.float32, device=q.packed.device)
    op = _bnb_dequantize_4bit()
    if op is not None and n % 2 == 0 and out.dtype in (torch.float32, torch.bfloat16, torch.float16):
        # bitsandbytes' kernel (C++ on CPU, CUDA on the GPU): the library's, and ~10x our torch path;
        # on CUDA straight into a contiguous `out` (its out variant: no second pass through a
        # temporary; bitsandbytes has none on the CPU)
        into = _bnb_dequantize_4bit(out=True) if out.is_cuda and out.is_contiguous() else None
        if into is not None:
            into(q.packed.reshape(-1, 1), q.block_absmax(), BLOCK, "nf4", [n], out.dtype, out=out.view(n))
        else:
            out.copy_(op(q.packed.reshape(-1, 1), q.block_absmax(), BLOCK, "nf4", [n], out.dtype).reshape(-1))
        return out
    pairs = _nf4_pairs(str(q.packed.device))
    vals = pairs[q.packed.reshape(-1).long()].reshape(-1)[:n]
    absmax = q.block_absmax()
    full = n - n % BLOCK
    if full:
        out[:full].view(-1, BLOCK).copy_(vals[:full].view(-1, BLOCK) * absmax[: full // BLOCK, None])
    if n % BLOCK:
        out[full:].copy_(vals[full:] * absmax[-1])
    return out


def nf4_from_bnb(weight: torch.Tensor, quant_state) -> NF4:
    """Our NF4 of a bitsandbytes-quantized weight (Params4bit data + its QuantState), as is."""
    if quant_state.quant_type != "nf4" or quant_state.blocksize != BLOCK:
        raise ValueError(f"only NF4 with block size {BLOCK} is read, got {quant_state.quant_type} "
                         f"with block size {quant_state.blocksize}")
    packed = weight.reshape(-1).view(torch.uint8)
    shape = tuple(quant_state.shape)
    if quant_state.nested:
        s2 = quant_state.state2
        if s2.blocksize != NESTED_BLOCK or not torch.equal(s2.code.cpu(), _dynamic_map("cpu")):
            raise ValueError("double-quantized absmax with another block size or code than bitsandbytes' default")
        return NF4(packed=packed, shape=shape, qabsmax=quant_state.absmax, absmax2=s2.absmax,
                   offset=quant_state.offset)
    return NF4(packed=packed, shape=shape, absmax=quant_state.absmax)


# -- codecs over a flat run of elements (a parameter's slot in a frozen chunk; sizes: core.encoding)
def encode(base_dtype: str, x: torch.Tensor, *, double_quant: bool = False) -> torch.Tensor:
    """The flat tensor `x` as `encoded_nbytes` bytes (uint8): fp32 scales first, then codes."""
    x = x.detach().reshape(-1)
    if base_dtype in ("fp32", "bf16", "fp16"):
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[base_dtype]
        return x.to(dtype).contiguous().view(torch.uint8)
    if base_dtype == "int8":
        x = x.float()
        absmax = _block_absmax(x, BLOCK)
        scale = absmax / 127.0
        q = torch.round(x / _per_element(scale.clamp(min=1e-38), x.numel(), BLOCK)).clamp_(-127, 127)
        return torch.cat([scale.view(torch.uint8), q.to(torch.int8).view(torch.uint8)])
    if base_dtype == "nf4":
        q = nf4_quantize(x, double_quant=double_quant)
        if double_quant:
            parts = [q.absmax2.view(torch.uint8), q.offset.reshape(1).view(torch.uint8), q.qabsmax, q.packed]
        else:
            parts = [q.absmax.view(torch.uint8), q.packed]
        return torch.cat(parts)
    raise ValueError(f"base dtype must be one of {BASE_DTYPES}, got {base_dtype!r}")


def nf4_of_bytes(blob: torch.Tensor, numel: int, *, double_quant: bool = False) -> NF4:
    """The NF4 parts of an `encode("nf4", ...)` blob, as views (no copy). The fp32 parts come
    first, so a blob that starts 4-byte aligned views them in place."""
    blocks = _blocks(numel, BLOCK)
    if not double_quant:
        return NF4(packed=blob[4 * blocks:], shape=(numel,), absmax=blob[: 4 * blocks].view(torch.float32))
    at = 4 * _blocks(blocks, NESTED_BLOCK)
    return NF4(packed=blob[at + 4 + blocks:], shape=(numel,), absmax2=blob[:at].view(torch.float32),
               offset=blob[at: at + 4].view(torch.float32)[0], qabsmax=blob[at + 4: at + 4 + blocks])


def decode(base_dtype: str, blob: torch.Tensor, out: torch.Tensor, *, double_quant: bool = False) -> None:
    """Decode an `encode` blob into `out` (flat, the compute dtype), on blob's device."""
    n = out.numel()
    if base_dtype in ("fp32", "bf16", "fp16"):
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[base_dtype]
        out.copy_(blob.view(dtype))
    elif base_dtype == "int8":
        at = 4 * _blocks(n, BLOCK)
        scale, q = blob[:at].view(torch.float32), blob[at:].view(torch.int8)
        out.copy_(q.float() * _per_element(scale, n, BLOCK))
    elif base_dtype == "nf4":
        nf4_dequantize(nf4_of_bytes(blob, n, double_quant=double_quant), out)
    else:
        raise ValueError(f"base dtype must be one of {BASE_DTYPES}, got {base_dtype!r}")
