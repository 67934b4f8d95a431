"""The resident cache: compute copies of streamed chunks that are in the `gpu` tier now.

The cache holds at most `limit` bytes. A chunk is *pinned* while a module computes with it.
When room is needed, the unpinned chunk whose next use lies furthest in the future is evicted
(Belady's policy; the future comes from the access trace of the warm-up step, and before a
trace exists the least recently used chunk goes). Compute copies are read-only on the device,
so eviction never writes back: the home copy is the truth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from offload.executor import Executor, Ticket
from offload.tiers import Tiers


@dataclass(kw_only=True)
class _Entry:
    buf: torch.Tensor  # [numel] compute dtype, in the gpu tier
    ticket: Ticket | None
    pins: int = 0
    last_use: int = 0


class ResidentCache:
    """Chunk id -> device buffer, within `limit` bytes, with pinning, eviction and prefetch."""

    def __init__(self, *, tiers: Tiers, executor: Executor, limit: int, dtype: torch.dtype,
                 numel: Callable[[int], int], fetch: Callable[[int, torch.Tensor], Ticket],
                 on_resident: Callable[[int, torch.Tensor], None],
                 on_evict: Callable[[int], None]):
        self.tiers, self.executor, self.limit, self.dtype = tiers, executor, limit, dtype
        self.numel, self.fetch = numel, fetch  # fetch(cid, device_buffer) starts the copy in
        self.on_resident, self.on_evict = on_resident, on_evict
        self.entries: dict[int, _Entry] = {}
        self.bytes = 0
        self.clock = 0
        self.next_use: Callable[[int], float] | None = None  # set by the schedule when a trace exists
        self.fetches = 0
        self.prefetches = 0  # fetches started ahead of use
        self.fetched_bytes = 0

    # -- queries ---------------------------------------------------------------------
    def resident(self, cid: int) -> bool:
        return cid in self.entries

    def _nbytes(self, cid: int) -> int:
        return self.numel(cid) * self.dtype.itemsize

    def _evict_priority(self, cid: int) -> float:
        if self.next_use is not None:
            return self.next_use(cid)
        return -self.entries[cid].last_use  # LRU before a trace exists

    # -- actions ---------------------------------------------------------------------
    def acquire(self, cid: int) -> torch.Tensor:
        """Make `cid` resident (waiting for its bytes) and pin it."""
        self.clock += 1
        entry = self.entries.get(cid)
        if entry is None:
            self._make_room(self._nbytes(cid), protect=math.inf)
            entry = self._fetch(cid)
        entry.pins += 1
        entry.last_use = self.clock
        if entry.ticket is not None:
            self.executor.wait(entry.ticket)
            entry.ticket = None
        return entry.buf

    def release(self, cid: int) -> None:
        entry = self.entries[cid]
        if entry.pins <= 0:
            raise AssertionError(f"chunk {cid} released more often than acquired")
        entry.pins -= 1

    def prefetch(self, cid: int, *, use_at: float) -> bool:
        """Start fetching `cid`, needed at `use_at`, if that evicts nothing needed sooner."""
        if cid in self.entries:
            return True
        need = self._nbytes(cid)
        if not self._make_room(need, protect=use_at, dry_run=True):
            return False
        self._make_room(need, protect=use_at)
        self._fetch(cid)
        self.prefetches += 1
        return True

    def evict_all(self) -> None:
        """Drop every unpinned chunk (after an update their compute copies are stale)."""
        for cid in [c for c, e in self.entries.items() if e.pins == 0]:
            self._evict(cid)

    # -- internals -------------------------------------------------------------------
    def _fetch(self, cid: int) -> _Entry:
        buf = self.tiers.empty("gpu", "compute", self.numel(cid), self.dtype)
        ticket = self.fetch(cid, buf)
        entry = _Entry(buf=buf, ticket=ticket, last_use=self.clock)
        self.entries[cid] = entry
        self.bytes += buf.numel() * buf.element_size()
        self.fetches += 1
        self.fetched_bytes += buf.numel() * buf.element_size()
        self.on_resident(cid, buf)
        return entry

    def _evict(self, cid: int) -> None:
        entry = self.entries.pop(cid)
        if entry.ticket is not None:  # the copy thread may still be writing into it
            entry.ticket.wait()
        self.on_evict(cid)
        self.bytes -= entry.buf.numel() * entry.buf.element_size()
        self.tiers.free("gpu", "compute", entry.buf)

    def _make_room(self, need: int, *, protect: float, dry_run: bool = False) -> bool:
        """Evict until `need` bytes fit; only chunks whose next use is later than `protect`."""
        free = self.limit - self.bytes
        if free >= need:
            return True
        victims = sorted((c for c, e in self.entries.items() if e.pins == 0),
                         key=self._evict_priority, reverse=True)
        chosen = []
        for cid in victims:
            if free >= need:
                break
            if protect != math.inf and (self.next_use is None or self._evict_priority(cid) <= protect):
                break  # a prefetch never evicts a chunk needed sooner (nor guesses without a trace)
            chosen.append(cid)
            free += self.entries[cid].buf.numel() * self.entries[cid].buf.element_size()
        if free < need:
            if dry_run or protect != math.inf:
                return False
            pinned = sum(e.buf.numel() * e.buf.element_size() for e in self.entries.values() if e.pins)
            raise AssertionError(
                f"resident cache cannot fit {need} B: limit {self.limit}, pinned {pinned}"
            )
        if not dry_run:
            for cid in chosen:
                self._evict(cid)
        return True
