"""Activation offload: block inputs kept for backward move to host memory (or CXL memory, where
the plan puts them there) during forward and come back, one block ahead, during backward — so
long sequences fit in the device budget.

Only the tensors a checkpointed block keeps that need a gradient (its hidden-state input) are
offloaded: everything else saved in forward is small and shared (rotary tables, masks) or
needed at the very start of backward. Bytes: a block input is
counted as a device activation until its copy to the host lands, then as a host activation;
its device copy in backward is a device activation again until autograd drops it.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch

from ..runtime.executor import Executor
from ..runtime.ledger import Ledger
from ..runtime.storage import storage_key
from ..runtime.tiers import Tiers
from ..runtime.trace import Phase


IN_FLIGHT = 1  # block inputs whose copy to the host may still be under way


class Offloaded:
    """One activation living in host memory between forward and backward."""

    def __init__(self, io: "Offloader", t: torch.Tensor):  # t: contiguous, on the device
        self.io, self.shape, self.nbytes = io, tuple(t.shape), t.numel() * t.element_size()
        io.ledger.reserve("gpu", "activation", self.nbytes)
        self.host = io.tiers.empty(io.tier, "activation", t.numel(), t.dtype)
        self.device_ref: torch.Tensor | None = t  # until the copy out has landed
        self.ticket = io.executor.copy("d2h", self.host, t.detach().reshape(-1))  # (no graph: a copy for later)
        self.back: torch.Tensor | None = None
        self.back_ticket = None

    def settle(self, *, wait: bool = False) -> None:
        """Once the copy to the host has landed, the device bytes are free."""
        if self.device_ref is not None and (wait or self.ticket.done()):
            self.io.executor.wait(self.ticket)
            self.device_ref = None
            self.io.ledger.release("gpu", "activation", self.nbytes)

    def fetch(self) -> None:
        """Start bringing it back to the device (idempotent)."""
        if self.back is not None:
            return
        if self.host is None:
            raise RuntimeError("an offloaded activation of an abandoned step was read")
        self.settle(wait=True)
        self.io.ledger.reserve("gpu", "activation", self.nbytes)
        self.back = torch.empty(self.host.numel(), dtype=self.host.dtype, device=self.io.device)
        self.io.fetched[storage_key(self.back)] = weakref.ref(self)
        self.back_ticket = self.io.executor.copy("h2d", self.back, self.host)

    def get(self) -> torch.Tensor:
        self.fetch()
        self.io.executor.wait(self.back_ticket)
        return self.back.view(self.shape)

    def drop(self) -> None:
        """Give back its bytes, device and host, once (a later get() fails: see Offloader.abandon)."""
        if self.host is None:
            return
        self.settle(wait=True)
        if self.back is not None:
            self.back_ticket.wait()
            self.io.ledger.release("gpu", "activation", self.nbytes)
            self.back = None
        self.io.tiers.free(self.io.tier, "activation", self.host)
        self.host = None

    def __del__(self) -> None:
        try:
            self.drop()
        except Exception:  # interpreter shutdown: nothing left to account
            pass


class Offloader:
    """Offloads block inputs in forward; prefetches the previous block's input in backward."""

    """Gets the ledger, the tiers (host memory), the executor, the device and the current
    phase (block inputs are offloaded in forward only)."""

    def __init__(self, *, ledger: Ledger, tiers: Tiers, executor: Executor, device: torch.device,
                 phase: Callable[[], Phase], min_bytes: int = 0, tier: str = "host"):
        self.ledger, self.tiers, self.executor, self.device = ledger, tiers, executor, device
        self.tier = tier  # where the inputs wait: host RAM, or CXL memory
        self.phase, self.min_bytes = phase, min_bytes
        self.stack: list[weakref.ref] = []  # in pack order
        self.by_storage: dict[int, weakref.ref] = {}
        self.fetched: dict[int, weakref.ref] = {}  # device copies made in backward, by storage
        self.active = False  # True while a checkpointed block saves its inputs in forward

    def wants(self, t: torch.Tensor) -> bool:
        return (self.active and self.phase() == Phase.FORWARD and t.device == self.device
                and t.requires_grad and t.is_contiguous() and t.storage_offset() == 0
                and t.untyped_storage().nbytes() == t.numel() * t.element_size()
                and t.numel() * t.element_size() >= self.min_bytes)

    def pack(self, t: torch.Tensor) -> Offloaded:
        key = storage_key(t)
        known = self.by_storage.get(key)
        item = known() if known is not None else None
        if item is None or item.device_ref is None:  # once settled, the storage (and so its key)
            # may have been freed and reused by another tensor: never match on it again
            item = Offloaded(self, t)
            self.by_storage[key] = weakref.ref(item)
            self.stack.append(weakref.ref(item))
        for ref in self.stack[:-IN_FLIGHT]:  # at most IN_FLIGHT copies out at once: the device
            if (x := ref()) is not None:  # bytes then do not depend on timing (the warm-up's
                x.settle(wait=True)  # measured peak must hold for every later step)
        return item

    def fetched_as(self, key: int) -> Offloaded | None:
        """The offloaded input whose device copy (booked already) has this storage, if alive."""
        ref = self.fetched.get(key)
        item = ref() if ref is not None else None
        return item if item is not None and item.back is not None else None

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

    def abandon(self) -> None:
        """A step failed: drop every offloaded input still alive (its graph may be a reference
        cycle that would keep the bytes booked for the rest of the run)."""
        for ref in self.stack:
            if (x := ref()) is not None:
                x.drop()
        self.stack, self.by_storage, self.fetched = [], {}, {}

    def end_forward(self) -> None:
        for ref in self.stack:
            if (x := ref()) is not None:
                x.settle(wait=True)
        self.by_storage.clear()
        self.fetched = {k: r for k, r in self.fetched.items() if r() is not None}
        self.stack = [r for r in self.stack if r() is not None]
