"""Tier storage: allocate chunk tensors in a tier, with every byte reserved in the ledger.

`gpu` is CUDA memory, or on a machine without CUDA the *simulated device*: CPU memory with
its own hard budget. `host` is pinned CPU memory where pinning is possible, plain CPU memory
otherwise (pin_memory() raises without an accelerator).
"""

from __future__ import annotations

import logging

import torch

from .cxl import CxlAllocator
from .ledger import Ledger

log = logging.getLogger(__name__)


def pick_device(device: "str | torch.device | None" = None) -> torch.device:
    """CUDA when present (or asked for), else the simulated device on the CPU."""
    if device is not None:
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' asked for but CUDA is not available")
        return dev
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class Tiers:
    """Allocates tensors in tiers and keeps the ledger in step with them."""

    def __init__(self, *, ledger: Ledger, device: torch.device, cxl: "CxlAllocator | None" = None):
        self.ledger = ledger
        self.cxl = cxl
        self.device = device
        self.simulated = device.type != "cuda"
        self._can_pin = torch.cuda.is_available()

    def empty(self, tier: str, kind: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A new tensor of `numel` elements in `tier`, its bytes reserved as `kind`."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        self.ledger.reserve(tier, kind, nbytes)
        try:
            if tier == "gpu":
                return torch.empty(numel, dtype=dtype, device=self.device)
            if tier == "host":
                return self._host_empty(numel, dtype)
            if tier == "cxl" and self.cxl is not None:
                return self.cxl.allocate(nbytes, kind=kind).view(dtype)[:numel]
        except BaseException:
            self.ledger.release(tier, kind, nbytes)
            raise
        self.ledger.release(tier, kind, nbytes)
        raise ValueError(f"tier {tier!r} has no in-memory tensors")

    def zeros(self, tier: str, kind: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.empty(tier, kind, numel, dtype).zero_()

    def free(self, tier: str, kind: str, tensor: torch.Tensor) -> None:
        """Give `tensor`'s bytes back to the ledger (the caller drops its reference)."""
        self.ledger.release(tier, kind, tensor.numel() * tensor.element_size())
        if tier == "cxl" and self.cxl is not None:
            self.cxl.free(tensor)

    def _host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype)
        if self._can_pin:
            try:
                return t.pin_memory()
            except RuntimeError as exc:  # no accelerator after all: plain memory from now on
                log.warning("pinning host memory failed (%s); using pageable memory", exc)
                self._can_pin = False
        return t
