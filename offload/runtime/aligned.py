"""Aligned (and, where possible, pinned) host buffers.

O_DIRECT I/O needs the buffer address, the file offset and the length to be multiples of the
device's logical block size (512 or 4096 bytes; we always use 4096). `torch.empty` only
promises 64-byte alignment, so `aligned_empty` over-allocates by one alignment unit and
returns the aligned slice; the slice keeps its base alive.

Pinning (page-locking for DMA to an accelerator) needs a CUDA/accelerator runtime; on a
CPU-only build `pin_memory=True` raises. The probe runs once per process and its answer is
cached, so the failure is neither retried nor logged more than once.
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger(__name__)

#: The alignment O_DIRECT needs on every device we target (4096 covers 512-byte devices too).
DIRECT_ALIGN = 4096


def round_up(n: int, alignment: int = DIRECT_ALIGN) -> int:
    """Smallest multiple of `alignment` that is >= n."""
    return -(-n // alignment) * alignment


def is_aligned(value: int, alignment: int = DIRECT_ALIGN) -> bool:
    """True when `value` (an address, offset or length) is a multiple of `alignment`."""
    return value % alignment == 0


@functools.lru_cache(maxsize=1)
def pinning_available() -> bool:
    """Whether page-locked host memory can be allocated here (probed once, then cached)."""
    try:
        torch.empty(1, dtype=torch.uint8, pin_memory=True)
    except (RuntimeError, AssertionError) as exc:  # no accelerator runtime in this build
        reason = str(exc).splitlines()[0]
        log.info("pinned memory unavailable (%s); using plain host memory", reason)
        return False
    return True


def aligned_empty(nbytes: int, *, alignment: int = DIRECT_ALIGN, pin: bool = True) -> torch.Tensor:
    """An uninitialised uint8 tensor whose data_ptr is a multiple of `alignment`.

    Its length is `nbytes` rounded up to `alignment`. Pinned when `pin` and pinning works.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must not be negative: {nbytes}")
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two: {alignment}")
    length = round_up(nbytes, alignment)
    pinned = pin and pinning_available()
    raw = torch.empty(length + alignment, dtype=torch.uint8, pin_memory=pinned)
    skip = (-raw.data_ptr()) % alignment
    out = raw[skip : skip + length]
    assert is_aligned(out.data_ptr(), alignment)  # internal invariant
    return out
