"""Activation offload: block inputs kept for backward move to host memory during forward and
come back, one block ahead, during backward — so long sequences fit in the device budget.

Only the tensors a checkpointed block keeps that need a gradient (its hidden-state input) are
offloaded: everything else saved in forward is small and shared (rotary tables, masks) or
needed at the very start of backward. Bytes: a block input is
counted as a device activation until its copy to the host lands, then as a host activation;
its device copy in backward is a device activation again until autograd drops it.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .engine import Engine


IN_FLIGHT = 1  # block inputs whose copy to the host may still be under way


class Offloaded:
    """One activation living in host memory between forward and backward."""

    def __init__(self, engine: "Engine", t: torch.Tensor):  # t: contiguous, on the device
        self.engine, self.shape, self.nbytes = engine, tuple(t.shape), t.numel() * t.element_size()
        engine.ledger.reserve("gpu", "activation", self.nbytes)
        self.host = engine.tiers.empty("host", "activation", t.numel(), t.dtype)
        self.device_ref: torch.Tensor | None = t  # until the copy out has landed
        self.ticket = engine.executor.copy("d2h", self.host, t.reshape(-1))
        self.back: torch.Tensor | None = None
        self.back_ticket = None

    def settle(self, *, wait: bool = False) -> None:
        """Once the copy to the host has landed, the device bytes are free."""
        if self.device_ref is not None and (wait or self.ticket.done()):
            self.engine.executor.wait(self.ticket)
            self.device_ref = None
            self.engine.ledger.release("gpu", "activation", self.nbytes)

    def fetch(self) -> None:
        """Start bringing it back to the device (idempotent)."""
        if self.back is not None:
            return
        self.settle(wait=True)
        self.engine.ledger.reserve("gpu", "activation", self.nbytes)
        self.back = torch.empty(self.host.numel(), dtype=self.host.dtype, device=self.engine.device)
        self.back_ticket = self.engine.executor.copy("h2d", self.back, self.host)

    def get(self) -> torch.Tensor:
        self.fetch()
        self.engine.executor.wait(self.back_ticket)
        return self.back.view(self.shape)

    def __del__(self) -> None:
        try:
            self.settle(wait=True)
            if self.back is not None:
                self.back_ticket.wait()
                self.engine.ledger.release("gpu", "activation", self.nbytes)
            self.engine.tiers.free("host", "activation", self.host)
        except Exception:  # interpreter shutdown: nothing left to account
            pass


class Offloader:
    """Offloads block inputs in forward; prefetches the previous block's input in backward."""

    def __init__(self, engine: "Engine", *, min_bytes: int = 0):
        self.engine, self.min_bytes = engine, min_bytes
        self.stack: list[weakref.ref] = []  # in pack order
        self.by_storage: dict[int, weakref.ref] = {}
        self.active = False  # True while a checkpointed block saves its inputs in forward

    def wants(self, t: torch.Tensor) -> bool:
        return (self.active and self.engine.phase == "forward" and t.device == self.engine.device
                and t.requires_grad and t.is_contiguous() and t.storage_offset() == 0
                and t.untyped_storage().nbytes() == t.numel() * t.element_size()
                and t.numel() * t.element_size() >= self.min_bytes)

    def pack(self, t: torch.Tensor) -> Offloaded:
        key = t.untyped_storage()._cdata
        known = self.by_storage.get(key)
        item = known() if known is not None else None
        if item is None or item.device_ref is None:  # once settled, the storage (and so its key)
            # may have been freed and reused by another tensor: never match on it again
            item = Offloaded(self.engine, t)
            self.by_storage[key] = weakref.ref(item)
            self.stack.append(weakref.ref(item))
        for ref in self.stack[:-IN_FLIGHT]:  # at most IN_FLIGHT copies out at once: the device
            if (x := ref()) is not None:  # bytes then do not depend on timing (the warm-up's
                x.settle(wait=True)  # measured peak must hold for every later step)
        return item

    def unpack(self, item: Offloaded) -> torch.Tensor:
        out = item.get()
        alive = [r() for r in self.stack]
        idx = next((i for i, x in enumerate(alive) if x is item), None)
        if idx is not None:  # backward runs blocks in reverse: bring the one before back now
            for x in reversed(alive[:idx]):
                if x is not None and x.back is None:
                    x.fetch()
                    break
        return out

    def end_forward(self) -> None:
        for ref in self.stack:
            if (x := ref()) is not None:
                x.settle(wait=True)
        self.by_storage.clear()
        self.stack = [r for r in self.stack if r() is not None]
