"""Bounce buffers and the pipelined update of chunks whose kinds live on NVMe.

Host DRAM holds two *update sets* (each big enough for the largest chunk's swapped kinds)
and one *fetch staging* buffer (the largest compute source), all 4096-byte aligned so the
NVMe engine reads and writes them in place with O_DIRECT. The update of swapped chunk i runs
in one set while chunk i+1 is read into the other and chunk i-1's write-back drains: with
separate read and write queues the disk and the CPU optimizer overlap.
A swapped master whose compute copy is still on the device (an fp32 run: the same bytes) is
copied from there instead of read from NVMe (`resident`): in an fp32 run the backward has just
computed with the compute copy of the chunk it completes, so it is often still cached when that
chunk's early update starts. Between the early update's calls (offload.engine.early: one per
batch of chunks whose gradients completed) the free set holds a *read-ahead*: the master and
state of the chunk expected to complete next (the last step's order), read while its gradient
is still being computed, so its update does not start with a wait on the disk. The set an
update has just written from is taken too: the state of the chunk expected after the next one
is read into it as soon as those write-backs land (`chained_read`, on the thread that finishes
the last of them), so the disk goes from one chunk's writes to a later chunk's reads instead of
waiting for the next gradient to complete (measured at the 100M Llama's minimum host budget:
bench/README.md, "Reads chained behind write-backs").
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..plan.homes import BounceSizes
from .aligned import round_up
from .store import ChunkStore, SwapKind


class Bounce:
    """Two update sets, a fetch staging buffer and two gradient staging buffers in host DRAM
    (ledger kind 'buffer'), of the sizes `offload.plan.homes.bounce_sizes` counts (the planner
    counts the same)."""

    def __init__(self, store: ChunkStore, sizes: BounceSizes):
        self.store = store
        self.nbytes = sizes.total
        store.tiers.ledger.reserve("host", "buffer", self.nbytes)
        buffer = store.tiers.host_buffer  # registered in exact bytes on a GPU
        self.sets = [buffer(sizes.update_set) for _ in range(2)]
        self.staging = buffer(sizes.fetch)
        self.grad_staging = [buffer(sizes.grad) for _ in range(2 if sizes.grad else 0)]
        # per update set, the NVMe requests still using it: an update's write-back may outlive
        # its update_all (`defer`); whoever takes the set next waits for them (views)
        self.pending: dict[int, list[Future]] = {0: [], 1: []}
        self.last = 1  # the set of the latest write-back: the other one is free first
        self.holder: list[int | None] = [None, None]  # per set, the chunk its views were last carved for

    def settle(self, slot: int | None = None) -> None:
        """Wait for the requests still using update set `slot` (None: both); re-raises their
        first error (the key's swap file is then marked invalid: offload.runtime.nvme)."""
        for s in ((0, 1) if slot is None else (slot,)):
            futures, self.pending[s] = self.pending[s], []
            for f in futures:
                f.result()

    def views(self, slot: int, cid: int, *, settle: bool = True) -> dict[str, torch.Tensor]:
        """Tensors for chunk `cid`'s swapped kinds, carved from update set `slot` (once the
        requests still using that set are done; `settle` False: the caller orders its use after
        them, as `chained_read` does)."""
        if settle:
            self.settle(slot)
        self.holder[slot] = cid
        out, off = {}, 0
        for _, name, d in self.store.chunks[cid].kinds():
            if isinstance(d, SwapKind):
                out[name] = self.sets[slot][off: off + d.nbytes].view(d.dtype)
                off += round_up(d.nbytes)
        return out

    def holding(self, cid: int, t: torch.Tensor) -> int | None:
        """The update set `t` lies in while that set still holds chunk `cid`'s views (nothing
        carved another chunk's since), else None."""
        for slot, s in enumerate(self.sets):
            start = s.data_ptr()
            if start <= t.data_ptr() < start + s.numel() and self.holder[slot] == cid:
                return slot
        return None

    def staging_for(self, swap: SwapKind) -> torch.Tensor:
        return self.staging[: swap.nbytes].view(swap.dtype)

    def release(self) -> None:
        for t in (*self.sets, self.staging, *self.grad_staging):
            self.store.tiers.release_buffer(t)
        self.store.tiers.ledger.release("host", "buffer", self.nbytes)


def _swapped(store: ChunkStore, cid: int) -> list[tuple[str, SwapKind]]:
    return [(name, d) for _, name, d in store.chunks[cid].kinds() if isinstance(d, SwapKind)]


@dataclass
class ReadAhead:
    """Master and state of chunk `cid`, read (or being read) into update set `slot` ahead of
    its update: the chunk expected to complete next in backward, read while the disk would
    otherwise wait for its gradient. `reads` lands them."""

    cid: int
    slot: int
    views: dict[str, torch.Tensor]
    reads: list[Future]
    master: bool = True  # False: its swapped master is not among `reads` (chained_read)


def drop_ahead(carry: dict) -> None:
    """Forget the read-aheads nobody used (their sets are free once their reads landed). A
    failed one raises nothing here (its bytes go unused; a failed write-back it waited for
    stays among its set's pending requests, which raise it to whoever takes the set next)."""
    for name in ("ahead", "after"):
        ahead = carry.pop(name, None)
        if ahead is not None:
            wait(ahead.reads)


def _when_all(futures: list[Future], fn: Callable[[], None]) -> None:
    """Call `fn()` once every one of `futures` is done (at once if they are), on the thread that
    finished the last."""
    left = [len(futures) + 1]
    lock = threading.Lock()

    def one_done(_f: "Future | None" = None) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        fn()

    for f in futures:
        f.add_done_callback(one_done)
    one_done()


def _after(futures: list[Future], then: Callable[[], list[Future]]) -> Future:
    """A future done when `then()` (called once every one of `futures` is done, on the thread
    that finished the last) has started requests and they are all done; it carries the first
    error of either. Nothing blocks meanwhile."""
    out: Future = Future()

    def failed(done: list[Future]) -> bool:
        """Pass the first error of `done` on to `out`; True if there was one."""
        errors = [f.exception() for f in done if f.exception() is not None]
        if errors:
            out.set_exception(errors[0])
        return bool(errors)

    def start() -> None:
        if failed(futures):
            return
        try:
            inner = then()
        except BaseException as exc:  # e.g. the store closed meanwhile
            out.set_exception(exc)
            return
        _when_all(inner, lambda: failed(inner) or out.set_result(None))

    _when_all(futures, start)
    return out


def chained_read(store: ChunkStore, bounce: Bounce, carry: dict, cid: int, slot: int) -> ReadAhead:
    """Read chunk `cid`'s state into update set `slot` as soon as the requests still using that
    set (its last chunk's write-backs) are done, without waiting for them here: the disk goes on
    from those writes to this read while no gradient is complete yet. Its master too, unless
    the last time it was needed it came from the device cache (carry["copied"],
    `_read_master`): backward has then most likely just fetched it there again when the
    update starts. Counted in carry["issued"] when it reads anything."""
    before = bounce.pending[slot]
    views = bounce.views(slot, cid, settle=False)
    master = cid not in carry.get("copied", ())
    kinds = [(n, d) for n, d in _swapped(store, cid) if n not in ("compute", "grad") and (master or n != "master")]
    if kinds:
        carry["issued"] = carry.get("issued", 0) + 1
    done = _after(before, lambda: [store.nvme.read_async(d.key, views[n]) for n, d in kinds])
    bounce.pending[slot] = [*before, done]
    return ReadAhead(cid, slot, views, [done], master=master)


def update_all(store: ChunkStore, updater: Any, hyper: Any, bounce: Bounce | None, *,
               chunks: list[int] | None = None, handed: "dict[int, tuple[torch.Tensor, Any]] | None" = None,
               resident: "Callable[[int, torch.Tensor], bool] | None" = None,
               carry: "dict | None" = None, expect: int | None = None,
               refresh: "Callable[[int, torch.Tensor], None] | None" = None, defer: bool = False,
               expect_after: int | None = None) -> None:
    """One optimizer step on `chunks` (default: every chunk): in-memory ones in place, swapped
    ones pipelined through the two bounce sets. `handed`: {chunk: (gradient, give_back)} for
    chunks whose NVMe gradient is still in a host buffer: used from there (not read back), and
    `give_back()` is called (and the entry popped) as soon as that chunk is updated.
    `resident(chunk, dst)`: copies a swapped master into `dst` from a device copy of the same
    bytes and returns True, or returns False (then it is read from NVMe).
    `carry` (a dict kept between calls that never overlap): while the last chunk is updated, the
    master and state of swapped chunk `expect` are read ahead into the free set and left in
    carry["ahead"] (a ReadAhead); a later call whose first swapped chunk it is starts from them
    (counted in carry["issued"] and carry["used"]). `expect_after`: the chunk expected after
    `expect`; its state (and master, see there) is read into the set of this call's last update
    as soon as that set's write-backs land (`chained_read`, kept in carry["after"]); the next call, if it
    updates just `expect`, takes that read as its own read-ahead instead of starting one.
    `refresh(chunk, master)`: called with each chunk's new master right after its update.
    `defer`: return without waiting for the last write-backs (they stay in `bounce.pending`,
    waited for by whoever takes their set next, or by `bounce.settle()`): the next early update,
    or the next step's forward, starts while they drain; a read of the same key waits for them
    (offload.runtime.nvme keeps one key's requests in order)."""
    handed = {} if handed is None else handed
    todo = [c for c in (range(len(store.chunks)) if chunks is None else chunks) if not store.is_frozen(c)]
    swapped = [c for c in todo if _swapped(store, c)]
    writes = bounce.pending if bounce is not None else {0: [], 1: []}
    held = carry.pop("ahead", None) if carry is not None else None
    after = carry.pop("after", None) if carry is not None else None
    # set of the i-th swapped chunk: (base + i) % 2, the first one not the latest written
    base = held.slot if held is not None else 1 - bounce.last if bounce is not None else 0
    if held is not None and (not swapped or swapped[0] != held.cid):
        writes[held.slot] = writes[held.slot] + held.reads  # not the chunk read ahead: free once those land
        held = None
    if after is not None and not (held is not None and len(swapped) == 1 and after.cid == expect
                                  and after.slot != held.slot):
        after = None  # (its read is among its set's pending requests: whoever takes the set waits)

    def read(cid: int, slot: int, *, grad: bool) -> tuple[dict[str, torch.Tensor], list[Future]]:
        return _read(store, bounce, cid, slot, grad=grad, resident=resident, carry=carry)

    def start(i: int) -> tuple[dict[str, torch.Tensor], list[Future]]:
        cid = swapped[i]
        if i == 0 and held is not None:  # master and state were read ahead
            carry["used"] = carry.get("used", 0) + 1
            views, reads = held.views, list(held.reads)
            started.extend(reads)  # (waited for if what follows raises)
            if not held.master:  # (its set is free once the state has landed)
                wait(reads)
                reads += _read_master(store, cid, views, resident, carry)
            grad = dict(_swapped(store, cid)).get("grad")
            if grad is not None and cid not in handed:
                reads.append(store.nvme.read_async(grad.key, views["grad"]))
        else:
            views, reads = read(cid, (base + i) % 2, grad=cid not in handed)
        if cid in handed:
            views["grad"] = handed[cid][0]
        started.extend(reads)
        return views, reads

    ahead = carry is not None and expect is not None and expect not in todo and bool(_swapped(store, expect))
    started: list[Future] = []  # reads into the sets: waited for before an error leaves
    try:
        pending = start(0) if swapped else None
        for cid in todo:  # while the first read is in flight
            if cid not in swapped:
                _step(store.chunks[cid], cid, updater, hyper, {})
                if refresh is not None and store.chunks[cid].master is not None:
                    refresh(cid, store.chunks[cid].master)
        for i, cid in enumerate(swapped):
            views, reads = pending
            if i + 1 < len(swapped):
                pending = start(i + 1)
            elif ahead and after is not None:  # (in the other set: see above)
                carry["ahead"] = after
                started.extend(after.reads)
            elif ahead:
                slot = (base + i + 1) % 2
                carry["ahead"] = ReadAhead(expect, slot, *read(expect, slot, grad=False))
                started.extend(carry["ahead"].reads)
                carry["issued"] = carry.get("issued", 0) + 1
            for f in reads:
                f.result()
            ch = store.chunks[cid]
            if "grad" in views and store.grad_scale is not None:
                views["grad"].mul_(store.grad_scale)
            _step(ch, cid, updater, hyper, views)
            if refresh is not None:  # (its master may be in memory, its state on NVMe)
                refresh(cid, views.get("master", ch.master))
            if cid in handed:
                handed.pop(cid)[1]()
            writes[(base + i) % 2] = [store.nvme.write_async(d.key, views[n]) for n, d in _swapped(store, cid)
                                      if n != "grad"]  # the next cycle overwrites the gradient anyway
            bounce.last = (base + i) % 2
        if (ahead and swapped and expect_after is not None and expect_after != expect
                and expect_after not in todo and _swapped(store, expect_after)
                and not store.is_frozen(expect_after)):
            carry["after"] = chained_read(store, bounce, carry, expect_after, bounce.last)
            started.extend(carry["after"].reads)
    except BaseException:
        wait(started)  # (their sets are taken next by whoever reads into them)
        raise
    if bounce is not None and not defer:
        bounce.settle()


def _read(store: ChunkStore, bounce: Bounce, cid: int, slot: int, *, grad: bool,
          resident: "Callable[[int, torch.Tensor], bool] | None",
          carry: "dict | None" = None) -> tuple[dict[str, torch.Tensor], list[Future]]:
    """Start reading chunk `cid`'s swapped master and state (and gradient if `grad`) into update
    set `slot`, once the requests still using that set are done; its master from a cached
    compute copy where `resident` can."""
    views = bounce.views(slot, cid)
    kinds = [(n, d) for n, d in _swapped(store, cid)
             if n != "compute"  # the compute copy is rewritten from the master
             and (n != "grad" or grad)]
    reads = [store.nvme.read_async(d.key, views[n]) for n, d in kinds if n != "master"]
    return views, reads + _read_master(store, cid, views, resident, carry)  # (while those read)


def _read_master(store: ChunkStore, cid: int, views: dict[str, torch.Tensor],
                 resident: "Callable[[int, torch.Tensor], bool] | None", carry: "dict | None") -> list[Future]:
    """Chunk `cid`'s swapped master into views["master"]: copied from a cached compute copy
    where `resident` can, else read (its future); which of the two it was is noted in
    carry["copied"] for `chained_read`."""
    master = dict(_swapped(store, cid)).get("master")
    if master is None:
        return []
    copied = resident is not None and resident(cid, views["master"])
    if carry is not None:
        noted = carry.setdefault("copied", set())
        if copied:
            noted.add(cid)
        else:
            noted.discard(cid)
    return [] if copied else [store.nvme.read_async(master.key, views["master"])]


def read_ahead(store: ChunkStore, bounce: Bounce | None, carry: dict, cid: int, *,
               resident: "Callable[[int, torch.Tensor], bool] | None" = None,
               then: int | None = None) -> None:
    """Before backward: start reading the master and state of swapped chunk `cid` (the first to
    complete in the last step) into the set written least recently, for update_all to start
    from (carry["ahead"], as its own read-ahead): the first update of a backward then does not
    begin with a wait on the disk; and those of chunk `then` (the second) into the other set
    once its write-backs land (carry["after"]). Nothing when a read-ahead is held or `cid` is
    not swapped."""
    if bounce is None or "ahead" in carry or not _swapped(store, cid) or store.is_frozen(cid):
        return
    slot = 1 - bounce.last
    carry["ahead"] = ReadAhead(cid, slot, *_read(store, bounce, cid, slot, grad=False, resident=resident, carry=carry))
    carry["issued"] = carry.get("issued", 0) + 1
    if then is not None and then != cid and _swapped(store, then) and not store.is_frozen(then):
        carry["after"] = chained_read(store, bounce, carry, then, bounce.last)


def _step(ch: Any, cid: int, updater: Any, hyper: Any, views: dict[str, torch.Tensor]) -> None:
    master = views.get("master", ch.master)
    blob = views.get("state", ch.state)
    updater.step(master, views.get("grad", ch.grad), blob, cid, ch.step, hyper)
    if ch.compute is not None:
        views.get("compute", ch.compute).copy_(master)
