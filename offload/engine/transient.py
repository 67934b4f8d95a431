"""Owned-only gradients (several ranks, grad_reduce="micro"): a rank's gradient buffers of the
chunks other ranks own live only while that chunk's gradient of the current micro-batch is
being produced. The buffer opens (zeros, host memory, booked as a "grad") at the chunk's first
arrival in a backward; once the chunk is complete it is reduced onto its owner and freed
(offload.engine.engine._reduce_grads). The owner keeps its own chunks' gradients across
micro-batches in their homes as one rank does.

The buffers open at once are bounded by `window` bytes (offload.plan.ranks.window_bytes: the
host budget leaves them free, the planner counts them): a chunk that would open past it waits for the reduce of a complete one queued to
the worker; with none queued it opens anyway (the ledger refuses it past the host budget).
A failed worker (`fail`: a peer died mid-reduce) frees nothing more: a waiting chunk raises
instead of waiting for ever.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ..core.chunks import ChunkPlan
from .ranks import RankFailure


class TransientGrads:
    """Gets the chunk plan, the tiers (ledger-booked host tensors) and the window in bytes."""

    def __init__(self, plan: ChunkPlan, tiers: Any, window: int):
        self.plan, self.tiers, self.window = plan, tiers, window
        self.bufs: dict[int, torch.Tensor] = {}
        self.bytes = 0
        self.queued: set[int] = set()  # complete, handed to the worker for their reduce
        self._freed = threading.Condition()
        self.failed: BaseException | None = None  # the worker's error: the queued stay queued

    def target(self, cid: int) -> torch.Tensor:
        """Chunk `cid`'s buffer [numel] fp32 (opened as zeros at its first arrival)."""
        buf = self.bufs.get(cid)
        if buf is not None:
            return buf
        numel = self.plan.chunks[cid].numel
        with self._freed:
            while self.bytes + 4 * numel > self.window and self.queued and self.failed is None:
                self._freed.wait()
            if self.failed is not None:
                exc = self.failed
                if isinstance(exc, RankFailure):  # (its kind too: CollectiveOrderError)
                    raise type(exc)(str(exc)) from exc
                raise RankFailure(f"the reduce of gradients failed: {type(exc).__name__}: {exc}") from exc
            self.bytes += 4 * numel
        try:
            buf = self.tiers.zeros("host", "grad", numel, torch.float32)
        except BaseException:
            with self._freed:
                self.bytes -= 4 * numel
            raise
        self.bufs[cid] = buf
        return buf

    def queue(self, cid: int) -> None:
        with self._freed:
            self.queued.add(cid)

    def free(self, cid: int) -> None:
        """The reduce is done: give the buffer back."""
        with self._freed:
            buf = self.bufs.pop(cid, None)
            self.queued.discard(cid)
            if buf is not None:
                self.bytes -= buf.numel() * 4
                self.tiers.free("host", "grad", buf)
            self._freed.notify_all()

    def fail(self, exc: BaseException) -> None:
        """The worker failed: the chunks it was handed will not be freed; wake the waiting."""
        with self._freed:
            self.failed = exc
            self._freed.notify_all()

    def free_all(self) -> None:
        """A step's end or abort (the worker idle): every buffer back, ready for the next."""
        for cid in list(self.bufs):
            self.free(cid)
        with self._freed:
            self.queued.clear()
            self.failed = None
