"""Gradients whose home is NVMe: accumulated in a host staging buffer while they arrive.

In backward, a chunk's parameters get their gradients one after another. For a chunk whose
gradient lives on NVMe, the first arrival of a micro-batch opens a staging buffer (zeros in the
first micro-batch of an optimizer step, else the sum so far, read back from the swap file);
each gradient lands in its slot as it does for a DRAM-resident chunk (copy the first time a
parameter is seen this step, add afterwards: the reference's order), and once every parameter
of the chunk has arrived the buffer is written out. Two staging buffers (host kind "buffer",
counted in the bounce bytes); a third open chunk first flushes the oldest one.
In the last micro-batch a complete chunk that is updated early (offload.engine.early) is not
written at all: its buffer is handed to the update (`hand_over`) and comes back once that chunk
is updated, which saves the gradient's round trip through NVMe (a write and a read of the same
bytes moments apart). Backward waits for a buffer only when both are with the update.
Several ranks (owned-only gradients): in the other micro-batches a complete chunk's buffer is
handed over too, for the reduce onto its owner, and then written out (`write_handed`).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Callable

import torch

from ..runtime.executor import Executor
from ..runtime.nvme import NvmeStore
from ..runtime.store import ChunkStore
from ..runtime.swapping import Bounce


class GradSpill:
    """Gets the chunk store, its bounce buffers (None: no NVMe gradient), the NVMe store and
    the executor (whose copies into the staging buffers it waits for)."""

    def __init__(self, store: ChunkStore, bounce: Bounce | None, nvme: NvmeStore | None, executor: Executor):
        self.store, self.bounce, self.nvme, self.executor = store, bounce, nvme, executor
        self.free = list(range(len(bounce.grad_staging))) if bounce is not None else []
        self.open: dict[int, int] = {}  # chunk -> staging buffer index
        self.arrived: dict[int, int] = {}
        self.tickets: dict[int, list[Any]] = {}
        self.writes: dict[int, tuple[Future, int]] = {}  # staging index -> pending write
        self.written: set[int] = set()  # chunks whose swap file holds this step's sum
        self.consumed: set[int] = set()  # chunks whose sum went to an early update instead
        self.handed: dict[int, int] = {}  # chunk -> staging buffer index, while handed over
        self._returned = threading.Condition()  # guards `free`: buffers come back from the update worker

    def begin_cycle(self) -> None:
        self.written, self.consumed = set(), set()

    def _staging(self, idx: int, cid: int) -> torch.Tensor:
        g = self.store.chunks[cid].grad
        return self.bounce.grad_staging[idx][: g.nbytes].view(torch.float32)

    def target(self, cid: int) -> torch.Tensor:
        """The host buffer [numel] fp32 the gradients of chunk `cid` land in now."""
        idx = self.open.get(cid)
        if idx is None:
            idx = self._free_buffer()
            pending = self.writes.pop(idx, None)
            if pending is not None:
                pending[0].result()  # the buffer is still being written out
            buf = self._staging(idx, cid)
            if cid in self.written:
                self.nvme.read(self.store.chunks[cid].grad.key, buf, urgent=True)  # backward waits for it
            else:
                buf.zero_()
            self.open[cid], self.arrived[cid], self.tickets[cid] = idx, 0, []
        return self._staging(idx, cid)

    def _free_buffer(self) -> int:
        """A staging buffer for a newly opened chunk: a free one, else the oldest open chunk's
        (flushed), else (both are with early updates) the first one the update gives back."""
        with self._returned:
            while not self.free:
                if self.open:
                    self.flush(next(iter(self.open)))
                else:
                    self._returned.wait()
            return self.free.pop(0)

    def landed(self, cid: int, ticket: Any) -> None:
        """One parameter's gradient of chunk `cid` is on its way into its buffer."""
        self.tickets[cid].append(ticket)
        self.arrived[cid] += 1

    def complete(self, cid: int) -> bool:
        """Every parameter of open chunk `cid` has arrived since it was opened (then it is
        flushed, unless handed over)."""
        return cid in self.open and self.arrived[cid] == len(self.store.plan.chunks[cid].params)

    def hand_over(self, cid: int) -> "tuple[torch.Tensor, Callable[[], None]] | None":
        """Open chunk `cid`'s buffer, holding its final sum once the copies into it land (the
        caller waits for their tickets), for an early update instead of a write; and the call
        that gives the buffer back. None when `cid` is not open here (its gradient is in DRAM)."""
        if cid not in self.open:
            return None
        idx = self.open.pop(cid)
        del self.arrived[cid], self.tickets[cid]
        self.consumed.add(cid)
        self.handed[cid] = idx
        given = []

        def give_back() -> None:
            with self._returned:
                if not given:
                    given.append(idx)
                    self.handed.pop(cid, None)
                    self.free.append(idx)
                    self._returned.notify_all()
        return self._staging(idx, cid), give_back

    def write_handed(self, cid: int) -> None:
        """Handed-over chunk `cid`'s buffer (reduced, not updated) goes to its swap file; the
        buffer is reused only once that write has landed (`target` waits for it)."""
        idx = self.handed[cid]
        key = self.store.chunks[cid].grad.key
        with self._returned:
            self.writes[idx] = (self.nvme.write_async(key, self._staging(idx, cid)), cid)
            self.written.add(cid)
            self.consumed.discard(cid)

    def settle(self) -> None:
        """Every open chunk written out and every write landed (the swap files hold the sums)."""
        self.end_backward()
        for fut, _ in list(self.writes.values()):
            fut.result()

    def flush(self, cid: int) -> None:
        idx = self.open.pop(cid)
        for t in self.tickets.pop(cid):
            if t is not None:  # (None: added in place, on this thread)
                self.executor.wait(t)
        del self.arrived[cid]
        key = self.store.chunks[cid].grad.key
        self.writes[idx] = (self.nvme.write_async(key, self._staging(idx, cid)), cid)
        self.written.add(cid)
        with self._returned:
            self.free.append(idx)

    def end_backward(self) -> None:
        """Chunks some of whose parameters got no gradient this micro-batch: write them too."""
        for cid in list(self.open):
            self.flush(cid)

    def finish_cycle(self) -> None:
        """Before the update: every write has landed; unused chunks hold zeros, not old sums."""
        self.end_backward()
        for fut, _ in self.writes.values():
            fut.result()
        self.writes.clear()
        store = self.store
        for cid, ch in enumerate(store.chunks):  # (a consumed chunk's file is never read this cycle)
            if hasattr(ch.grad, "key") and cid not in self.written and cid not in self.consumed:
                self.nvme.zeros(ch.grad.key, ch.grad.nbytes)
