"""Residency: which chunks have a compute copy on the device, and when.

A module's own chunks are acquired (made resident and pinned) when its forward starts and
released when it ends (offload.engine.hooks installs the module hooks that call enter_module /
exit_module). Every running module is a frame on a stack; a parameter read elsewhere (a tied
head through F.linear, nn.MultiheadAttention's out_proj.weight) is seen by the read guard
(offload.engine.reads) and made resident for the innermost frame, released when it ends.
The first step records the access trace (offload.runtime.trace); later steps carry out the
schedule made from it (evictions and prefetches around each acquisition). The chunks' bytes
come from their home tier (`fetch`: host, CXL, or NVMe through a bounce buffer; an encoded
chunk whose blob is gpu-home is decoded on the device, nothing crosses the link); with several
ranks (offload.engine.ranks), a trainable chunk's bytes come from its owner's home: the owner
fills the buffer and broadcasts it, on the copy thread, in the same order on every rank.

The update of a swapped chunk takes its fp32 master from the cached compute copy while there is
one (`copy_master`; simulated device). After its update, a chunk the next step's forward starts
with (`keep`: the first chunks the schedule holds) has its cached copy rewritten from the new
master (`refresh_master`) and stays resident over the step's end (`evict_updated`), so the next
forward does not begin by reading back from NVMe what the update has just written there; the
frozen chunks the schedule begins with stay as they are (nothing changed them), taken from the
schedule as it is at the step's end (also one the step has just recorded). One not cached when it was updated
(the embedding: backward does not read it) is put into the cache from the update set that
still holds its new master (`ResidentCache.put`; the set is taken again only once that copy is
done), for the same reason.

On the simulated device, with `borrows` (fp32, one rank, an optimizer that does not perturb
weights, no emulated link), a chunk whose master lives in host DRAM is computed from in place:
the cache takes the master itself as its compute copy (`_borrow`, ResidentCache's `borrow`)
instead of copying it into a buffer of the same bytes in the same memory. The update writes the
master only once backward no longer reads the chunk (offload.engine.gradients), as it does
anyway, and a kept copy is then already the new master.

Also the storage identities the saved-tensor hooks need: `streamed_storage` (a resident copy's
storage -> its chunk) and `home_storage` (a device-home chunk's storage -> the chunk).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from ..core.errors import UnsupportedModel
from ..plan.schedule import ACQUIRE, RELEASE
from ..runtime.aligned import DIRECT_ALIGN
from ..runtime.cache import ResidentCache
from ..runtime.cxl import CxlAllocator
from ..runtime.executor import Executor, Ticket
from ..runtime.nvme import NvmeStore
from ..runtime.storage import storage_key
from ..runtime.store import ChunkStore, SwapKind
from ..runtime.swapping import Bounce
from ..runtime.tiers import Tiers
from ..runtime.trace import Phase, TraceFollower
from .reads import ReadGuard
from .timeline import Timeline


class Residency:
    """Owns the resident cache, the trace follower, the module stack and the read guard.

    Gets the chunk store (homes, parameter pointing), the tiers and the executor (device buffers
    and copies), the sources behind a home (`cxl`, `nvme`, `bounce`; None when unused), the
    parameters by name and their names, each parameter-owning module's chunks, the timeline
    (the phase; a moment per acquisition), `name_of(module)` for errors, and `borrow_refusal`:
    None, or the optimizer that cannot let a parameter be read outside its owner (MeZO)."""

    def __init__(self, *, store: ChunkStore, tiers: Tiers, executor: Executor, limit: int,
                 params: dict[str, torch.nn.Parameter], param_names: dict[torch.nn.Parameter, str],
                 module_chunks: dict[torch.nn.Module, list[int]], timeline: Timeline,
                 name_of: Callable[["torch.nn.Module | None"], str], borrow_refusal: str | None = None,
                 cxl: CxlAllocator | None = None, nvme: NvmeStore | None = None, bounce: Bounce | None = None,
                 ranks: Any = None, borrows: bool = False):
        self.store, self.plan, self.executor = store, store.plan, executor
        self.params, self.param_names, self.module_chunks = params, param_names, module_chunks
        self.timeline, self.name_of, self.borrow_refusal = timeline, name_of, borrow_refusal
        self.cxl, self.nvme, self.bounce = cxl, nvme, bounce
        self.ranks = ranks  # offload.engine.ranks.Ranks, or None on one rank
        self.device = tiers.device
        self.borrows = borrows and tiers.simulated and ranks is None and borrow_refusal is None
        self.streamed_storage: dict[int, int] = {}  # storage_key of a resident copy -> chunk
        self.home_storage: dict[int, int] = {}  # storage_key of a device-home chunk -> the chunk
        self.follower = TraceFollower()
        self.copied_masters = 0  # swapped masters the update took from the cache (copy_master)
        self.keep: tuple[int, ...] = ()  # chunks the next step starts with, in order (keep_next)
        self.keeping = False  # this step may keep chunks over its end (keep_next)
        self.fresh: set[int] = set()  # of those, the ones whose cached copy holds the new master
        self.unfilled: dict[int, torch.Tensor] = {}  # of those, not cached: the new master, where it lies
        self.kept = 0  # chunks kept resident over a step's end, over the run
        # backward reads chunk c (a recompute, a saved weight; streamed or device-home): the gradient
        # router is told, so a chunk still read there is not updated early (offload.engine.gradients)
        self.on_backward_read: Callable[[int], None] | None = None
        self.guard = ReadGuard(self._on_read)
        self._chunk_of = {id(p): (n, self.plan.slots[n].chunk) for n, p in params.items() if n in self.plan.slots}
        # per chunk, its parameters with their own class and their absent one (offload.engine.reads)
        self._classes: dict[int, list[tuple[torch.nn.Parameter, type, type]]] = {}
        for n, p in params.items():
            if n in self.plan.slots:
                self._classes.setdefault(self.plan.slots[n].chunk, []).append((p, type(p), self.guard.absent_class(p)))
        # per running module (None: the loss function), the chunks read there that it does not own
        self._frames: list[tuple[torch.nn.Module | None, list[int]]] = []
        self._holding: set[int] = set()  # chunks of the blocks being recomputed (holding)
        self._splits: dict[torch.nn.Module, tuple[list[int], list[int]]] = {}  # _split's
        # until the first backward ends, reads of device-home parameters go through the guard
        # too (their class is the absent one): one outside its owner is noted (note_read)
        self.watching_homes = True
        self.cache = ResidentCache(tiers=tiers, executor=executor, limit=limit, dtype=store.compute_dtype,
                                   numel=lambda c: self.plan.chunks[c].numel, fetch=self._fetch,
                                   on_resident=self._on_resident, on_evict=self._on_evict,
                                   local=store.decodes_on_device, borrow=self._borrow)
        for cid in range(len(self.plan.chunks)):
            if store.is_gpu_home(cid):
                self.home(cid)
            else:
                self._on_evict(cid)

    def home(self, cid: int) -> None:
        """Chunk `cid` was placed on the device: its parameters point at it for good."""
        self.home_storage[storage_key(self.store.compute_source(cid))] = cid
        self._repoint(cid, lambda: self.store.point_params(cid, self.store.compute_source(cid), self.params))
        if not self.watching_homes:
            self._present(cid)

    def stop_watching_homes(self) -> None:
        """The first backward is over (or there is none): the gradient router knows which chunks
        backward reads late (read_in_backward), so reads of device-home parameters need not be
        seen any more; they take their own class, and a torch call on them no Python call."""
        if self.watching_homes:
            self.watching_homes = False
            for cid in self._classes:
                if self.store.is_gpu_home(cid):
                    self._present(cid)

    def promote(self, cid: int, *, decoded: bool = False) -> None:
        """Move chunk `cid` to the device for good (placement after the warm-up). An encoded
        chunk's blob moves; its uses still go through the cache (decoded there, no link), or
        with `decoded`, it is decoded once and that copy is its home (ChunkStore.decode_home)."""
        if decoded:
            self.store.decode_home(cid, self.params)
        else:
            self.store.promote(cid, self.params)
        if self.store.is_gpu_home(cid) and not self.watching_homes:  # (pointing at the home for good)
            self._present(cid)
        self._splits = {}
        if self.store.is_gpu_home(cid):
            self.home_storage[storage_key(self.store.compute_source(cid))] = cid

    def copy_master(self, cid: int, dst: torch.Tensor) -> bool:
        """(The update's thread.) Chunk `cid`'s fp32 master into host `dst` from its compute copy
        while that is cached and filled (offload.runtime.swapping.update_all: one NVMe read less);
        False when it is not. Only on the simulated device and in fp32 runs, where the compute
        copy is the master's bytes (CUDA: the copy would have to wait for the fill's event)."""
        if not self._master_bytes(cid):
            return False
        with self.cache.lent(cid) as buf:
            if buf is None:
                return False
            dst.copy_(buf)
        self.copied_masters += 1
        return True

    def _master_bytes(self, cid: int) -> bool:
        """Chunk `cid`'s compute copy is its fp32 master's bytes (simulated device, fp32 run)."""
        return (self.device.type != "cuda" and self.store.compute_dtype == torch.float32
                and self.store.chunks[cid].compute is None and not self.store.is_encoded(cid))

    def _borrow(self, cid: int) -> "torch.Tensor | None":
        """Chunk `cid`'s fp32 master in host DRAM when the cache may compute from it in place
        (`borrows`; not CXL: its slower memory is read once, by the copy), else None."""
        if not self.borrows or not self._master_bytes(cid) or self.store.compute_tier(cid) != "host":
            return None
        src = self.store.compute_source(cid)
        return src if isinstance(src, torch.Tensor) else None

    def keep_next(self, allowed: bool) -> None:
        """(A step begins.) Which chunks to keep resident over this step's end: those the
        schedule holds after its first event; none when not `allowed`."""
        self.keep = self.follower.first if allowed else ()
        self.keeping = allowed
        self.fresh, self.unfilled = set(), {}

    def refresh_master(self, cid: int, master: torch.Tensor) -> None:
        """(The update's thread, chunk `cid` just updated.) A chunk in `keep` whose compute copy
        is cached and is its master's bytes takes the new master's bytes (a copy in host memory
        instead of the next forward's NVMe read)."""
        if cid not in self.keep or not self._master_bytes(cid):
            return
        with self.cache.lent(cid) as buf:
            if buf is None:
                self.unfilled[cid] = master
                return
            if buf.data_ptr() != master.data_ptr():  # (borrowed: it is the master)
                buf.copy_(master)
        self.fresh.add(cid)

    def evict_updated(self) -> None:
        """(The update is done.) Evict the stale compute copies; keep the refreshed ones and
        frozen ones the next step starts with, and put in those whose new master an update set
        still holds (no disk read: at the 100M Llama's minimum budgets that removed a 130 ms
        wait at each forward's start). (The others are not fetched here, ahead of the next
        step: measured, that moved a 9 ms wait at most, and it put the next step's bytes into
        this one's, which `finetune plan --verify` compares with the plan.)"""
        keep = {c for c in self.keep if c in self.fresh}
        if self.keeping:  # frozen ones (unchanged) from the schedule as it is now: also a step that
            # recorded a new trace keeps its first chunks (one whose trace broke: those it began with)
            frozen = self.store.frozen
            for c in self.follower.first or self.keep:
                if c in frozen:
                    keep.add(c)
        self.fresh = set()
        self.cache.evict_all(keep=keep)
        for c in keep:  # (a loop: a generator is a Python call per chunk)
            self.kept += bool(self.cache.resident(c))
        unfilled, self.unfilled = self.unfilled, {}
        for cid in self.keep:
            master = unfilled.get(cid)
            slot = None if master is None or self.bounce is None else self.bounce.holding(cid, master)
            if slot is None or self.cache.resident(cid):
                continue

            def fill(buf: torch.Tensor, master: torch.Tensor = master) -> Ticket:
                def fn(stream: Any) -> None:
                    buf.copy_(master, non_blocking=stream is not None)
                return self.executor.job("h2d", fn, nbytes=master.numel() * master.element_size())

            # the set is taken again (Bounce.views) only once this copy is done
            self.bounce.pending[slot].append(self.cache.put(cid, fill).future)
            self.kept += 1

    # -- the cache's callbacks (compute thread) -------------------------------------------
    def _fetch(self, cid: int, buf: torch.Tensor) -> Ticket:
        """Start copying chunk `cid`'s compute copy from its home tier into device `buf` (several
        ranks: the owner's copy, broadcast to every rank)."""
        src = self.store.compute_source(cid)
        if self.store.decodes_on_device(cid):  # a gpu-home blob: decoded where it lies, no link
            def fn(stream: Any) -> None:
                self.store.to_compute(cid, src, buf)

            return self.executor.job("h2d", fn, nbytes=0, reuses_host=False)
        links = (self.cxl.link_out,) if self.cxl is not None and self.store.compute_tier(cid) == "cxl" else ()
        ranks = self.ranks if self.ranks is not None and cid in self.ranks.owner else None
        if src is None:  # a remote chunk: its owner sends it
            def fn(stream: Any) -> None:
                ranks.broadcast_chunk(cid, buf)

            return self.executor.job("h2d", fn, nbytes=buf.numel() * buf.element_size())
        if isinstance(src, SwapKind) and self._in_place(cid, src, buf):
            def fn(stream: Any) -> None:
                self.nvme.read(src.key, buf, urgent=True)  # before the optimizer's reads
        elif isinstance(src, SwapKind):
            staging = self.bounce.staging_for(src)

            def fn(stream: Any) -> None:
                self.nvme.read(src.key, staging, urgent=True)  # before the optimizer's reads
                self.store.to_compute(cid, staging, buf, non_blocking=stream is not None)
        else:
            def fn(stream: Any) -> None:
                self.store.to_compute(cid, src, buf, non_blocking=stream is not None)
        nbytes = src.nbytes if isinstance(src, SwapKind) else src.numel() * src.element_size()  # encoded: less
        if ranks is not None:  # the owner: fill, then send
            fill = fn

            def fn(stream: Any) -> None:
                fill(stream)
                ranks.broadcast_chunk(cid, buf)
        # from the chunk's own home (pinned host or CXL memory, never rewritten while a fetch of it
        # is in flight: its update waits for gradients computed from the fetched copy), nothing
        # is reused: the launching thread waits for the enqueue alone
        reuses = isinstance(src, SwapKind) or ranks is not None
        return self.executor.job("h2d", fn, nbytes=nbytes, links=links, reuses_host=reuses)

    def _in_place(self, cid: int, src: SwapKind, buf: torch.Tensor) -> bool:
        """The simulated device's buffer is host memory: a swapped compute source that needs no
        decoding is read from NVMe straight into it when aligned (the cache's are), not through
        the staging buffer and a copy."""
        return (self.device.type != "cuda" and not self.store.is_encoded(cid) and src.dtype == buf.dtype
                and buf.is_contiguous() and buf.data_ptr() % DIRECT_ALIGN == 0)

    def _on_resident(self, cid: int, buf: torch.Tensor) -> None:
        self.streamed_storage[storage_key(buf)] = cid
        self._repoint(cid, lambda: self.store.point_params(cid, buf, self.params))

    def _on_evict(self, cid: int) -> None:
        self.streamed_storage = {k: v for k, v in self.streamed_storage.items() if v != cid}
        self._repoint(cid, lambda: self.store.unpoint_params(cid, self.params, device=self.device))

    def _repoint(self, cid: int, point: Callable[[], None]) -> None:
        """Set chunk `cid`'s parameters' data with their own class (an absent one's setter would
        go through the guard); they stay absent until the chunk is pinned (its bytes may still be
        on their way)."""
        classes = self._classes.get(cid, ())
        for p, plain, _ in classes:
            p.__class__ = plain
        point()
        for p, _, absent in classes:
            p.__class__ = absent

    def _present(self, cid: int) -> None:
        for p, plain, _ in self._classes.get(cid, ()):
            p.__class__ = plain

    def restore_classes(self) -> None:
        """(Close.) Every parameter back to its own class."""
        for cid in self._classes:
            self._present(cid)

    # -- the module stack -------------------------------------------------------------------
    def enter_module(self, mod: torch.nn.Module, args: Any = None) -> None:
        """A module's forward starts (its pre-hook), or with args HOLD a block's recompute
        (holding): a new frame; its own chunks become resident (the streamed ones acquired, a
        home one's read in backward noted). (One function: it runs twice per unit and pass.)"""
        if args is not HOLD:
            self.timeline.counts["hook_calls"] += 1
            if not self._frames and self.timeline.phase == Phase.BACKWARD:  # a recompute not the engine's
                raise UnsupportedModel(
                    f"{self.name_of(mod)} ran again in backward: the model recomputes it itself "
                    f"(torch.utils.checkpoint); the engine checkpoints repeated blocks on its own "
                    f"(Activations(recompute=...)): take the model's checkpointing out")
            if not self._frames:
                raise UnsupportedModel(
                    f"{self.name_of(mod)} ran outside engine.step / forward / eval_loss: the engine "
                    f"makes parameters resident only there (read trained weights with named_parameters_fp32; "
                    f"to generate, save the model and load it back)")
        self.guard.paused += 1
        try:
            self._frames.append((mod, []))
            if mod in self.module_chunks:
                streamed, home = self._splits.get(mod) or self._split(mod)
                for cid in streamed:
                    self._acquire(cid)
                if home and self.timeline.phase == Phase.BACKWARD:
                    for cid in home:
                        self.note_read(cid)
                if self.timeline.recording:
                    self.timeline.moment()
        finally:
            self.guard.paused -= 1

    def exit_module(self, mod: torch.nn.Module, args: Any = None, out: Any = None) -> None:
        """A module's forward ended (its hook; args HOLD: a block's backward after its
        recompute): release its own chunks and those read in its frame."""
        if args is not HOLD:
            self.timeline.counts["hook_calls"] += 1
        self.guard.paused += 1
        try:
            if mod in self.module_chunks:
                for cid in (self._splits.get(mod) or self._split(mod))[0]:
                    self._release(cid)
            if self._frames:
                for cid in self._frames.pop()[1]:
                    self._release(cid)
        finally:
            self.guard.paused -= 1

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Around the loss function: the read guard, and the loss function's own frame."""
        self._frames = [(None, [])]
        try:
            with self.guard:
                yield
        finally:
            frames, self._frames = self._frames, []
            for _, borrowed in reversed(frames):
                for cid in borrowed:
                    self._release(cid)

    def holding(self, block: torch.nn.Module) -> "_Holding":
        """A checkpointed block's recompute and its backward: the block's own frame (its forward
        hooks do not run for a recompute) holds its chunks through both, so the weights autograd
        saved in the recompute are resident when its backward reads them."""
        return _Holding(self, block)

    def holds(self, cid: int) -> bool:
        """Chunk `cid` belongs to a block whose recompute and backward are running (`holding`):
        resident until that backward ends."""
        return cid in self._holding

    def recompute(self, saved_tensor_hooks: Any) -> Any:
        """What a checkpointed block's recompute (its forward) runs under: the saved-tensor hooks
        and the read guard."""
        return _Both(saved_tensor_hooks, self.guard)

    def _on_read(self, p: torch.nn.Parameter) -> None:
        """A torch call reads `p` (offload.engine.reads): make its chunk resident for the innermost
        running module if no running module holds it already."""
        found = self._chunk_of.get(id(p))
        if found is None:
            return  # not a chunked parameter of this model
        name, cid = found
        if self.store.is_gpu_home(cid):  # (watched until the first backward ends)
            self.note_read(cid)
            return
        if self.cache.pinned(cid):
            return
        if not self._frames:
            raise UnsupportedModel(f"parameter {name!r} is read outside the forward and the loss function; "
                                   f"the engine cannot make it resident there")
        mod, borrowed = self._frames[-1]
        if self.borrow_refusal is not None:
            raise UnsupportedModel(
                f"parameter {name!r} is read by {self.name_of(mod)} outside the forward of the module "
                f"that owns it; {self.borrow_refusal} perturbs a parameter in its owner's forward only, so "
                f"this read would see it unperturbed")
        self._acquire(cid)
        borrowed.append(cid)
        self.timeline.moment()

    # -- chunks ---------------------------------------------------------------------------
    def units_changed(self) -> None:
        """`module_chunks` was changed in place (the blocks became the units)."""
        self._splits = {}

    def _split(self, mod: torch.nn.Module) -> tuple[list[int], list[int]]:
        """`mod`'s chunks: (streamed, gpu-home), remembered in `_splits` until the placement
        changes (the callers look there first)."""
        chunks = self.module_chunks[mod]
        split = self._splits[mod] = ([c for c in chunks if not self.store.is_gpu_home(c)],
                                     [c for c in chunks if self.store.is_gpu_home(c)])
        return split

    def note_read(self, cid: int) -> None:
        """Chunk `cid` is read (acquired, or device-home and read): in backward, the gradient
        router is told (offload.engine.gradients.read_in_backward)."""
        if self.timeline.phase == Phase.BACKWARD and self.on_backward_read is not None:
            self.on_backward_read(cid)

    def touch_chunk(self, cid: int) -> torch.Tensor:
        """A saved view of chunk `cid` is needed in backward: make it resident now."""
        buf = self._acquire(cid)
        self._release(cid)
        return buf

    def _acquire(self, cid: int) -> torch.Tensor:
        """Carry out the schedule's actions for this acquisition, then pin the chunk (its
        parameters take their own class while it is pinned: offload.engine.reads)."""
        phase = self.timeline.phase
        if phase == Phase.EVAL:  # off the trace: evaluation is not part of a step
            buf = self.cache.acquire(cid)
        else:
            if phase == Phase.BACKWARD and self.on_backward_read is not None:  # (note_read, inline)
                self.on_backward_read(cid)
            actions = self.follower.event(ACQUIRE, cid, phase)
            if actions is not None and actions.evict and not self.cache.apply(actions.evict, ()):
                self.follower.drop()
                actions = None
            buf = self.cache.acquire(cid)
            if (actions is not None and (actions.prefetch_evict or actions.prefetch)
                    and not self.cache.apply(actions.prefetch_evict, actions.prefetch)):
                self.follower.drop()
        for p, plain, _ in self._classes.get(cid, ()):  # (inline: no call per parameter)
            p.__class__ = plain
        return buf

    def _release(self, cid: int) -> None:
        if self.timeline.phase != Phase.EVAL:
            self.follower.event(RELEASE, cid, self.timeline.phase)
        if not self.cache.release(cid):  # resident maybe, but not filled for sure: reads go through the guard
            for p, _, absent in self._classes.get(cid, ()):
                p.__class__ = absent

    def schedule(self, lookahead: int) -> None:
        """A trace was just recorded (or the placement changed): plan fetches and evictions."""
        if self.follower.following or self.follower.events is None:
            return
        csize = self.store.compute_dtype.itemsize
        sizes = {c.index: c.numel * csize for c in self.plan.chunks}
        self.follower.reschedule(keep=lambda c: not self.store.is_gpu_home(c), sizes=sizes,
                                 capacity=self.cache.limit, lookahead=lookahead)


HOLD = object()
"""enter_module / exit_module's `args` for a block's recompute and backward (Residency.holding):
no module hook ran, so none is counted."""


class _Holding:
    """Residency.holding's context (a class: a generator context costs several calls a block)."""

    def __init__(self, res: Residency, block: torch.nn.Module):
        self.res, self.block = res, block
        self.held: list[int] = []

    def __enter__(self) -> None:
        res = self.res
        res.enter_module(self.block, HOLD)
        held = self.held = []
        for c in res.module_chunks.get(self.block, ()):  # (a loop: a comprehension is one more call)
            if c not in res._holding:
                held.append(c)
        res._holding.update(held)

    def __exit__(self, *exc: Any) -> None:
        self.res._holding.difference_update(self.held)
        self.res.exit_module(self.block, HOLD)


class _Both:
    """Two context managers entered in order, left in reverse (a class: contextlib's generator
    machinery costs several Python calls, and this runs once per recomputed block)."""

    def __init__(self, a: Any, b: Any):
        self.a, self.b = a, b

    def __enter__(self) -> None:
        self.a.__enter__()
        try:
            self.b.__enter__()
        except BaseException:
            self.a.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            self.b.__exit__(*exc)
        finally:
            self.a.__exit__(*exc)
