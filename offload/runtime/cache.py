"""The resident cache: compute copies of streamed chunks that are in the `gpu` tier now.

The cache holds at most `limit` bytes. A chunk is *pinned* while a module computes with it.
It carries out the schedule's actions (`apply`: evict, fetch ahead); a chunk acquired while
absent is fetched on demand, making room by evicting the least recently used unpinned chunk
(that only happens before a schedule exists, or after the control flow changed). `limit` bounds
what is cached, not what is pinned: chunks pinned at once may exceed it (the ledger's device
budget is the hard limit), and `pinned_peak` records the most bytes ever pinned at once, the
streaming window a step really needs. Compute copies are read-only on the device, so eviction
never writes back: the home copy is the truth. An encoded frozen chunk that is gpu-home passes
through the cache too: its buffer is decoded from the resident blob (counted in `decoded_bytes`,
not `fetched_bytes`: nothing crossed the link).

On the simulated device (CPU memory) an evicted buffer is kept as a *spare* and the next fetch
reuses the smallest spare that holds it (a view of its first bytes), as CUDA's caching
allocator reuses device blocks: a fresh CPU buffer of a chunk's size is mmapped and each of its
pages faults in zeroed on first write (measured: ~0.3 s of kernel CPU per step of the 100M
Llama, bench/README.md "update_phases.py"). The ledger counts each chunk's own bytes; the real
bytes of the live buffers and the spares together never pass `limit` (the cache's share of
the device plan): beyond it a fetch takes a fresh buffer of its exact size, as before. The
simulated device's buffers are page-aligned anonymous mappings (their length rounded up to 4096
bytes), so an NVMe read lands in one in place (offload.engine.residency).
Another thread may read a resident, filled buffer (`lent`: the update copies an fp32 master
from it, offload.engine.residency.copy_master); its eviction waits until that copy is done.

A chunk whose home copy already is its compute copy in device-reachable memory (`borrow`: on
the simulated device, an fp32 master in host DRAM) is made resident as that tensor itself: no
buffer, no copy (the copy is a memcpy on the cores that compute). Its bytes are still booked in
the ledger as the device's, so budgets and the schedule are those of a real device; eviction
books them back and keeps nothing as a spare. Counted in `fetches` (the schedule's fact) and in
`borrowed_bytes` (what crossed no link).
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from .aligned import round_up
from .executor import Executor, Ticket
from .tiers import Tiers


@dataclass(kw_only=True)
class _Entry:
    buf: torch.Tensor  # [numel] compute dtype, in the gpu tier
    ticket: Ticket | None
    pins: int = 0
    last_use: int = 0
    lent: int = 0  # another thread reads it (`lent`): eviction waits
    whole: torch.Tensor | None = None  # the buffer `buf` leads (a spare reused: all of it); None: borrowed


def _over(storage: torch.UntypedStorage, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A new plain tensor (not an autograd view, no history) on `numel` elements of `storage`
    from element `offset`."""
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, (numel,))


class ResidentCache:
    """Chunk id -> device buffer, within `limit` bytes, with pinning, eviction and prefetch."""

    def __init__(self, *, tiers: Tiers, executor: Executor, limit: int, dtype: torch.dtype,
                 numel: Callable[[int], int], fetch: Callable[[int, torch.Tensor], Ticket],
                 on_resident: Callable[[int, torch.Tensor], None],
                 on_evict: Callable[[int], None], local: Callable[[int], bool] = lambda cid: False,
                 borrow: "Callable[[int], torch.Tensor | None]" = lambda cid: None):
        self.tiers, self.executor, self.limit, self.dtype = tiers, executor, limit, dtype
        self.numel, self.fetch = numel, fetch  # fetch(cid, device_buffer) starts the copy in
        self.on_resident, self.on_evict = on_resident, on_evict
        self.local = local  # local(cid): its buffer is filled on the device (a gpu-home blob decoded), no link
        self.borrow = borrow  # borrow(cid): the tensor to compute from in place (no buffer, no copy), or None
        self.entries: dict[int, _Entry] = {}
        self.bytes = 0
        self.clock = 0
        self.fetches = 0
        self.prefetches = 0  # fetches started ahead of use
        self.fetched_bytes = 0  # filled over the link
        self.decodes = 0  # filled on the device (`local`)
        self.decoded_bytes = 0
        self.puts = 0  # filled by `put`, not from the home tier
        self.put_bytes = 0
        self.borrowed_bytes = 0  # of `fetched_bytes`, made resident in place (`borrow`)
        self.pinned_bytes = 0
        self.pinned_peak = 0
        self.keep_spares = tiers.simulated  # CUDA: its caching allocator reuses blocks already
        self.spares: list[torch.Tensor] = []  # evicted buffers (simulated device), not in the ledger
        self.real_bytes = 0  # bytes of the live buffers' storages (a reused spare: all of it)
        self._lending = threading.Condition()
        self._sizes: dict[int, int] = {}  # chunk -> its buffer's bytes (asked at every pin and unpin)

    # -- queries ---------------------------------------------------------------------
    def resident(self, cid: int) -> bool:
        return cid in self.entries

    def pinned(self, cid: int) -> bool:
        entry = self.entries.get(cid)
        return entry is not None and entry.pins > 0

    def _nbytes(self, cid: int) -> int:
        n = self._sizes.get(cid)
        if n is None:
            n = self._sizes[cid] = self.numel(cid) * self.dtype.itemsize
        return n

    @contextlib.contextmanager
    def lent(self, cid: int) -> Iterator["torch.Tensor | None"]:
        """(Any thread.) Chunk `cid`'s buffer while it is resident and filled (its fetch waited
        for by an acquisition), kept from eviction for the `with`; None otherwise."""
        with self._lending:
            entry = self.entries.get(cid)
            if entry is not None and entry.ticket is not None:
                entry = None  # still being filled (a prefetch)
            if entry is not None:
                entry.lent += 1
        try:
            yield None if entry is None else entry.buf
        finally:
            if entry is not None:
                with self._lending:
                    entry.lent -= 1
                    self._lending.notify_all()

    # -- actions ---------------------------------------------------------------------
    def acquire(self, cid: int) -> torch.Tensor:
        """Make `cid` resident (waiting for its bytes) and pin it."""
        self.clock += 1
        entry = self.entries.get(cid)
        if entry is None:
            self._make_room(self._nbytes(cid))
            entry = self._fetch(cid)
        if entry.pins == 0:
            self.pinned_bytes += self._sizes.get(cid) or self._nbytes(cid)
            self.pinned_peak = max(self.pinned_peak, self.pinned_bytes)
        entry.pins += 1
        entry.last_use = self.clock
        if entry.ticket is not None:
            self.executor.wait(entry.ticket)
            entry.ticket = None
        return entry.buf

    def release(self, cid: int) -> int:
        """Unpin `cid` once; returns the pins it still has."""
        entry = self.entries[cid]
        if entry.pins <= 0:
            raise AssertionError(f"chunk {cid} released more often than acquired")
        entry.pins -= 1
        if entry.pins == 0:
            self.pinned_bytes -= self._sizes.get(cid) or self._nbytes(cid)
        return entry.pins

    def apply(self, evict: tuple[int, ...], prefetch: tuple[int, ...]) -> bool:
        """Evict, then start fetching ahead, as the schedule says. False if it cannot (the
        cache does not look as the schedule expects), so the caller drops the schedule."""
        for cid in evict:
            entry = self.entries.get(cid)
            if entry is not None:
                if entry.pins:
                    return False
                self._evict(cid)
        for cid in prefetch:
            if cid in self.entries:
                continue
            if self.bytes + self._nbytes(cid) > self.limit:
                return False
            self._fetch(cid)
            self.prefetches += 1
        return True

    def put(self, cid: int, fill: Callable[[torch.Tensor], Ticket]) -> Ticket:
        """Make absent chunk `cid` resident with bytes `fill(buffer)` starts copying in from
        elsewhere than its home (offload.engine.residency.evict_updated: a new master still in
        an update set); counted apart from fetches (`put_bytes`)."""
        if cid in self.entries:
            raise AssertionError(f"chunk {cid} is already resident")
        self._make_room(self._nbytes(cid))
        buf, whole = self._buffer(self.numel(cid))
        ticket = fill(buf)
        self.entries[cid] = _Entry(buf=buf, ticket=ticket, last_use=self.clock, whole=whole)
        self.bytes += buf.numel() * buf.element_size()
        self.puts += 1
        self.put_bytes += buf.numel() * buf.element_size()
        self.on_resident(cid, buf)
        return ticket

    def drop_spares(self) -> None:
        """Let the spare buffers go (the engine closes)."""
        self.spares = []

    def evict_all(self, keep: "frozenset[int] | set[int]" = frozenset()) -> None:
        """Drop every unpinned chunk but those in `keep` (after an update their compute copies
        are stale, unless rewritten from the new masters: offload.engine.residency.refresh_master)."""
        for cid in [c for c, e in self.entries.items() if e.pins == 0 and c not in keep]:
            self._evict(cid)

    # -- internals -------------------------------------------------------------------
    def _fetch(self, cid: int) -> _Entry:
        home = self.borrow(cid)
        if home is not None:
            self.tiers.ledger.reserve("gpu", "compute", self._nbytes(cid))
            buf, whole, ticket = home, None, None
            self.borrowed_bytes += self._nbytes(cid)
        else:
            buf, whole = self._buffer(self.numel(cid))
            ticket = self.fetch(cid, buf)
        entry = _Entry(buf=buf, ticket=ticket, last_use=self.clock, whole=whole)
        self.entries[cid] = entry
        self.bytes += buf.numel() * buf.element_size()
        if self.local(cid):
            self.decodes += 1
            self.decoded_bytes += buf.numel() * buf.element_size()
        else:
            self.fetches += 1
            self.fetched_bytes += buf.numel() * buf.element_size()
        self.on_resident(cid, buf)
        return entry

    def _evict(self, cid: int) -> None:
        with self._lending:
            entry = self.entries.pop(cid)
            while entry.lent:  # another thread still reads it (`lent`): a few ms
                self._lending.wait()
        if entry.ticket is not None:  # the copy thread may still be writing into it (a failed
            entry.ticket.settle()       # fetch's error is moot: its bytes go unused)
        self.on_evict(cid)
        self.bytes -= entry.buf.numel() * entry.buf.element_size()
        self.tiers.free("gpu", "compute", entry.buf)
        whole = entry.whole
        if whole is None:  # borrowed: the home's tensor, not the cache's
            return
        self.real_bytes -= whole.numel() * whole.element_size()
        if self.keep_spares and self.real_bytes + self._spare_bytes() + whole.numel() * whole.element_size() <= self.limit:
            self.spares.append(whole)

    def _spare_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.spares)

    def _buffer(self, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A buffer of `numel` elements, its bytes reserved in the ledger: the smallest spare
        that holds it while the real bytes stay within `limit`, else a fresh one (spares
        dropped first, so the real bytes stay within max(limit, what the ledger counts))."""
        need = numel * self.dtype.itemsize
        while self.spares and self.real_bytes + self._spare_bytes() > self.limit:  # the limit was lowered
            self.spares.pop(0)
        fits = [t for t in self.spares if t.numel() >= numel
                and self.real_bytes + t.numel() * t.element_size() <= self.limit]
        if fits:
            whole = min(fits, key=lambda t: t.numel())
            self.spares = [t for t in self.spares if t is not whole]
            self.tiers.ledger.reserve("gpu", "compute", need)
            buf = _over(whole.untyped_storage(), whole.storage_offset(), numel, self.dtype)
        else:
            while self.spares and self.real_bytes + self._spare_bytes() + need > self.limit:
                self.spares.pop(0)  # the oldest first
            whole = self._fresh(numel)
            buf = whole if whole.numel() == numel and not self.tiers.simulated else (
                _over(whole.untyped_storage(), whole.storage_offset(), numel, self.dtype))
        self.real_bytes += whole.numel() * whole.element_size()
        return buf, whole

    def _fresh(self, numel: int) -> torch.Tensor:
        """A new buffer, its bytes reserved; on the simulated device 4096-byte aligned, so an
        NVMe read lands in it in place (offload.engine.residency: no staging copy)."""
        if not self.tiers.simulated:
            return self.tiers.empty("gpu", "compute", numel, self.dtype)
        need = numel * self.dtype.itemsize
        self.tiers.ledger.reserve("gpu", "compute", need)
        try:  # an anonymous mapping: page-aligned at storage offset 0 (a saved tensor's offset
            # in its chunk is its storage offset: offload.engine.hooks), its length rounded up
            # to 4096 bytes (all of it serves a later, larger chunk)
            return torch.frombuffer(mmap.mmap(-1, round_up(need)), dtype=torch.uint8).view(self.dtype)
        except BaseException:
            self.tiers.ledger.release("gpu", "compute", need)
            raise

    def _make_room(self, need: int) -> None:
        """Evict least recently used unpinned chunks until `need` bytes fit (or none is left:
        then the pinned chunks outgrow `limit`, within the ledger's budget)."""
        victims = sorted((c for c, e in self.entries.items() if e.pins == 0),
                         key=lambda c: self.entries[c].last_use)
        while self.limit - self.bytes < need and victims:
            self._evict(victims.pop(0))
