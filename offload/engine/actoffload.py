"""Activation offload: block inputs kept for backward move to host memory (or CXL memory, or the
NVMe swap directory, where the plan puts them there) during forward and come back, one block
ahead, during backward — so long sequences fit in the device budget.

Only the tensors a checkpointed block keeps that need a gradient (its hidden-state input) are
offloaded: everything else saved in forward is small and shared (rotary tables, masks) or
needed at the very start of backward. Bytes: a block input is
counted as a device activation until its copy to the host lands, then as a host activation;
its device copy in backward is a device activation again until autograd drops it.

On NVMe, an input passes a host buffer both ways (host kind "activation", at most two at once:
the plan's host reserve): in forward, once its copy out lands it is written to its swap file
(`spill`), and the buffer is freed when the next block's input arrives; in backward, the read
of the block before starts when a block's input is read (`fetch`), its copy to the device
when it is needed (`get`).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

from ..runtime.executor import Executor
from ..runtime.ledger import Ledger
from ..runtime.storage import storage_key
from ..runtime.tiers import Tiers
from ..runtime.trace import Phase


IN_FLIGHT = 1  # block inputs whose copy to the host may still be under way


class Offloaded:
    """One activation living in host memory (or CXL, or a swap file) between forward and backward."""

    def __init__(self, io: "Offloader", t: torch.Tensor):  # t: contiguous, on the device
        self.io, self.shape, self.nbytes = io, tuple(t.shape), t.numel() * t.element_size()
        self.numel, self.dtype = t.numel(), t.dtype
        io.ledger.reserve("gpu", "activation", self.nbytes)
        self.mem = "host" if io.tier == "nvme" else io.tier  # the tier of its buffer in memory
        self.host: torch.Tensor | None = io.host_empty(self.mem, t.numel(), t.dtype)
        self.device_ref: torch.Tensor | None = t  # until the copy out has landed
        self.ticket = io.executor.copy("d2h", self.host, t.detach().reshape(-1))  # (no graph: a copy for later)
        self.back: torch.Tensor | None = None
        self.back_ticket = None
        self.key: str | None = None  # its swap file (NVMe)
        self.io_future: Any = None  # the swap file's write (forward) or read (backward) under way
        self.alive = True

    def settle(self, *, wait: bool = False) -> None:
        """Once the copy to the host has landed, the device bytes are free."""
        if self.device_ref is not None and (wait or self.ticket.done()):
            self.io.executor.wait(self.ticket)
            self.device_ref = None
            self.io.ledger.release("gpu", "activation", self.nbytes)

    def spill(self, *, wait: bool = False) -> None:
        """NVMe: write it out once its copy out has landed (starts the write); `wait`: then
        free its host buffer once the write has landed."""
        if self.io.tier != "nvme" or not self.alive:
            return
        if self.key is None:
            self.settle(wait=True)
            self.key = self.io.take_key()
            self.io.ledger.reserve("nvme", "activation", self.nbytes)
            self.io_future = self.io.nvme.write_async(self.key, self.host)
        if wait and self.host is not None:
            self._free_host()

    def _free_host(self) -> None:
        if self.io_future is not None:
            self.io_future.result()
            self.io_future = None
        host, self.host = self.host, None
        if self.back_ticket is not None and not self.back_ticket.done():
            self.io.park(self.back_ticket, self.mem, host)  # its copy to the device may still read it
        else:
            self.io.spare(self.mem, host)

    def fetch(self) -> None:
        """Start bringing it back to the device (idempotent); from NVMe, start its read."""
        if not self.alive:
            raise RuntimeError("an offloaded activation of an abandoned step was read")
        if self.back is not None:
            return
        if self.key is not None:
            if self.host is None:
                self.io.reap(keep=1)  # (the plan's two host buffers: the newest parked one and this)
                self.host = self.io.host_empty("host", self.numel, self.dtype)
                self.io_future = self.io.nvme.read_async(self.key, self.host, urgent=True)
            return
        self.settle(wait=True)
        self._to_device()

    def _to_device(self) -> None:
        self.io.ledger.reserve("gpu", "activation", self.nbytes)
        self.back = torch.empty(self.numel, dtype=self.dtype, device=self.io.device)
        self.io.fetched[storage_key(self.back)] = weakref.ref(self)
        self.back_ticket = self.io.executor.copy("h2d", self.back, self.host)

    def get(self) -> torch.Tensor:
        self.fetch()
        if self.back is None:  # read from NVMe: on to the device
            self.io_future.result()
            self.io_future = None
            self._to_device()
        self.io.executor.wait(self.back_ticket)
        if self.key is not None and self.host is not None:  # (from NVMe: its host buffer's job is done)
            self._free_host()
        return self.back.view(self.shape)

    def drop(self) -> None:
        """Give back its bytes, device, host and disk, once (a later get() fails: see
        Offloader.abandon)."""
        if not self.alive:
            return
        self.settle(wait=True)
        if self.back is not None:
            self.back_ticket.wait()
            self.io.ledger.release("gpu", "activation", self.nbytes)
            self.back = None
        if self.host is not None:
            self._free_host()
        if self.key is not None:
            self.io.ledger.release("nvme", "activation", self.nbytes)
            self.io.give_key(self.key)
            self.key = None
        self.alive = False

    def __del__(self) -> None:
        try:
            self.drop()
        except Exception:  # interpreter shutdown: nothing left to account
            pass


class Offloader:
    """Offloads block inputs in forward; prefetches the previous block's input in backward.
    Gets the ledger, the tiers (host memory), the executor, the device, the current phase
    (block inputs are offloaded in forward only), the tier the inputs wait in (host, cxl or
    nvme) and, for nvme, the NVMe store."""

    def __init__(self, *, ledger: Ledger, tiers: Tiers, executor: Executor, device: torch.device,
                 phase: Callable[[], Phase], min_bytes: int = 0, tier: str = "host", nvme: Any = None):
        if tier == "nvme" and nvme is None:
            raise ValueError("offloading activations to NVMe needs an NVMe store (budget.nvme)")
        self.ledger, self.tiers, self.executor, self.device = ledger, tiers, executor, device
        self.tier, self.nvme = tier, nvme
        self._keys: list[str] = []  # swap files free for reuse (one per input alive at once)
        self._made = 0
        self.phase, self.min_bytes = phase, min_bytes
        self.stack: list[weakref.ref] = []  # in pack order
        self.by_storage: dict[int, weakref.ref] = {}
        self.fetched: dict[int, weakref.ref] = {}  # device copies made in backward, by storage
        self.active = False  # True while a checkpointed block saves its inputs in forward
        # host buffers given back while a copy to the device may still read them (on CUDA an
        # enqueued copy has not landed): (its ticket, the tier, the buffer), oldest first
        self.parked: list[tuple[Any, str, torch.Tensor]] = []
        self._spare: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}  # freed buffers kept
        self._lent: dict[int, torch.Tensor] = {}  # a buffer in use, by its address: what goes back

    def park(self, ticket: Any, mem: str, host: torch.Tensor) -> None:
        self.parked.append((ticket, mem, host))

    def reap(self, *, keep: int = 0) -> None:
        """Free the parked buffers whose copies have landed; for all but the newest `keep`, wait
        until they have (on CUDA a host wait, which the copy enqueued a block before has
        usually made moot). A failed copy reads nothing more (its error went to whoever used
        the bytes): its buffer is freed too."""
        parked, self.parked = self.parked, []
        for i, (ticket, mem, host) in enumerate(parked):
            if i < len(parked) - keep:
                try:
                    ticket.landed()
                except Exception:  # noqa: BLE001 - raised already where the bytes were waited for
                    pass
            elif not ticket.done():
                self.parked.append((ticket, mem, host))
                continue
            self.spare(mem, host)

    def host_empty(self, mem: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer of `numel` for an input in `mem` (host or CXL): the first elements of the
        smallest spare big enough, or a new one (the spares too small freed first: the pool
        keeps the longest inputs' buffers, within what the plan holds for them)."""
        spares = self._spare.setdefault((mem, dtype), [])
        fits = [b for b in spares if b.numel() >= numel]
        if fits:
            base = min(fits, key=torch.Tensor.numel)
            spares.remove(base)
        else:
            for small in spares:
                self.tiers.free(mem, "activation", small)
            spares.clear()
            base = self.tiers.empty(mem, "activation", numel, dtype)
        self._lent[base.data_ptr()] = base
        return base[:numel]

    def spare(self, mem: str, host: torch.Tensor) -> None:
        """Keep a freed buffer for the next step's inputs, its bytes still booked as activations
        (the plan holds the offloaded inputs' bytes for them throughout): registering host
        memory with CUDA takes milliseconds a buffer and serialises the device's streams."""
        base = self._lent.pop(host.data_ptr())
        self._spare.setdefault((mem, base.dtype), []).append(base)

    @property
    def spare_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for spares in self._spare.values() for b in spares)

    def trim(self) -> None:
        """Free the spare buffers."""
        for (mem, _), spares in self._spare.items():
            for base in spares:
                self.tiers.free(mem, "activation", base)
        self._spare.clear()

    def take_key(self) -> str:
        if self._keys:
            return self._keys.pop()
        self._made += 1
        return f"activation-{self._made}"

    def give_key(self, key: str) -> None:
        self._keys.append(key)

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
            for ref in self.stack[:-1]:  # NVMe: one write under way, and one host buffer
                if (x := ref()) is not None:  # beside the new input's
                    x.spill(wait=True)
            if self.stack and (x := self.stack[-1]()) is not None:
                x.spill()
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
        self.reap(keep=len(self.parked))  # (the copies back that have landed: no wait)
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
        self.reap()

    def end_backward(self) -> None:
        """Every input's copy back has been used: free the host buffers still parked."""
        self.reap()

    def end_forward(self) -> None:
        for ref in self.stack:
            if (x := ref()) is not None:
                x.settle(wait=True)
                x.spill(wait=True)
        self.by_storage.clear()
        self.fetched = {k: r for k, r in self.fetched.items() if r() is not None}
        self.stack = [r for r in self.stack if r() is not None]
