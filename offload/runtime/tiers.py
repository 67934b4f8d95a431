"""Tier storage: allocate chunk tensors in a tier, with every byte reserved in the ledger.

`gpu` is CUDA memory, or on a machine without CUDA the *simulated device*: CPU memory with
its own hard budget. `host` is CPU memory registered with CUDA in exact bytes (offload.runtime.
pinned) when the device is a GPU, plain CPU memory otherwise.
"""

from __future__ import annotations

import logging

import torch

from .aligned import aligned_empty
from .cxl import CxlAllocator
from .ledger import Ledger
from .pinned import HostPinner

log = logging.getLogger(__name__)


def pick_device(device: "str | torch.device | None" = None) -> torch.device:
    """CUDA when present (or asked for), else the simulated device on the CPU. A CUDA device
    carries its index: tensors report `cuda:0`, and `torch.device("cuda") != "cuda:0"`, so the
    hooks' test of whether a tensor is on the engine's device would fail for every one."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' asked for but CUDA is not available")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


class Tiers:
    """Allocates tensors in tiers and keeps the ledger in step with them."""

    def __init__(self, *, ledger: Ledger, device: torch.device, cxl: "CxlAllocator | None" = None,
                 pinner: "HostPinner | None" = None):
        """`pinner`: registers host buffers for the GPU's copies (default: CUDA's, on a CUDA device;
        none on the simulated device)."""
        self.ledger = ledger
        self.cxl = cxl
        self.device = device
        self.simulated = device.type != "cuda"
        self.pinner = pinner if pinner is not None else (None if self.simulated else HostPinner())

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """`nbytes` (uint8, page-aligned: O_DIRECT reads into it) of host memory, registered when
        the tier's memory is; the caller has booked it in the ledger."""
        return self.pinner.empty(nbytes) if self.pinner is not None else aligned_empty(nbytes, pin=False)[:nbytes]

    def release_buffer(self, t: torch.Tensor) -> None:
        if self.pinner is not None:
            self.pinner.free(t)

    def close(self) -> None:
        """Unregister what is still registered (the engine is done with its host memory)."""
        if self.pinner is not None:
            self.pinner.close()

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
        if tier == "host":
            self.release_buffer(tensor)

    def _host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self.pinner is None:
            return torch.empty(numel, dtype=dtype)
        nbytes = numel * dtype.itemsize
        return self.pinner.empty(nbytes).view(dtype)[:numel]
