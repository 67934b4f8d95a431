"""Pinned host memory in exact bytes: page-aligned buffers registered with CUDA.

`tensor.pin_memory()` and `torch.empty(..., pin_memory=True)` go through torch's caching host
allocator, which rounds every block up to a power of two (a 132 MiB chunk pins 256 MiB) and,
for `pin_memory()`, copies from a pageable tensor first (twice the bytes while it lasts). The
host tier's budget is a promise about what the OS pins, so its buffers are plain page-aligned
memory registered in place (cudaHostRegister): what is pinned is the ledger's bytes, each
rounded up to a 4 KiB page. Unregistered before the memory is released.

`register` / `unregister` are CUDA's unless given (tests fake them on a machine without CUDA).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import torch

from .aligned import aligned_empty, round_up

log = logging.getLogger(__name__)

PAGE = 4096


def host_register(ptr: int, nbytes: int, flags: int, device: int) -> int:
    """cudaHostRegister's error code (0: registered; -1 where the call itself raised), called on
    `device` from a thread of its own: a refusal is also the calling thread's pending CUDA
    error, which torch's next kernel launch check (cudaGetLastError) would raise as that
    kernel's; and a thread's current device is where the registration goes."""
    result = [-1]

    def register() -> None:
        try:
            torch.cuda.set_device(device)
            result[0] = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, flags))
        except Exception:  # noqa: BLE001 - a refusal like the driver's: pageable, one warning
            log.debug("cudaHostRegister raised", exc_info=True)

    t = threading.Thread(target=register, name="cuda-host-register")
    t.start()
    t.join()
    return result[0]


def _cuda_register(ptr: int, nbytes: int) -> int:
    return host_register(ptr, nbytes, 0, torch.cuda.current_device())


def _cuda_unregister(ptr: int) -> int:
    return int(torch.cuda.cudart().cudaHostUnregister(ptr))


class HostPinner:
    """Allocates registered host buffers and keeps each one alive until it is freed."""

    def __init__(self, *, register: Callable[[int, int], int] = _cuda_register,
                 unregister: Callable[[int], int] = _cuda_unregister):
        self._register, self._unregister = register, unregister
        self._live: dict[int, tuple[torch.Tensor, int]] = {}  # ptr -> (buffer, registered bytes)
        self.failed = False  # CUDA refused once: plain pageable memory from then on

    @property
    def registered(self) -> int:
        """Bytes registered now."""
        return sum(n for _, n in self._live.values())

    def empty(self, nbytes: int) -> torch.Tensor:
        """`nbytes` (uint8) of page-aligned host memory, registered unless CUDA refused."""
        size = round_up(max(nbytes, 1), PAGE)
        buf = aligned_empty(size, alignment=PAGE, pin=False)
        if self.failed:
            return buf[:nbytes]
        err = self._register(buf.data_ptr(), size)
        if err:
            log.warning("cudaHostRegister of %d bytes failed (error %d): host memory stays pageable "
                        "(copies to the GPU are slower)", size, err)
            self.failed = True
            return buf[:nbytes]
        self._live[buf.data_ptr()] = (buf, size)
        return buf[:nbytes]

    def free(self, t: torch.Tensor) -> None:
        """Unregister the buffer `t` starts (a tensor `empty` returned, or a view from its
        start); the memory goes back when the last reference to it does."""
        got = self._live.pop(t.data_ptr(), None)
        if got is not None:
            self._unregister(t.data_ptr())

    def close(self) -> None:
        for ptr in list(self._live):
            self._unregister(ptr)
        self._live.clear()

    def __del__(self) -> None:  # an engine dropped unclosed: never free registered memory
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: CUDA may be gone already
            pass
