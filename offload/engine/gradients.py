"""The gradient router: a parameter's gradient from autograd's hook to its grad chunk.

- Arrival: each parameter's post-accumulate hook hands its gradient over; a device-home chunk
  takes it in place. A streamed chunk whose gradient home is in memory (host/CXL), once the
  first backward has counted its parameters' uses, gathers them on the device in one flat
  buffer (`_Gather`, zeros where a parameter sends nothing) and crosses to its home in one
  copy when the last of them arrives (or at the end of backward): one copy per chunk, not per
  parameter. Otherwise (the first backward, a gradient on NVMe: a staging buffer,
  offload.engine.gradspill; another rank's chunk) each parameter's gradient gets its own copy.
  Gradients on the device, gathered or in flight, are kept under `grad_reserve()` (the oldest
  copy retires first). On CUDA a copy that is added to its home, or whose home holds another
  dtype (fp32 beside bf16 compute), lands in the staging buffer first (registered host memory,
  the largest copy's bytes up to plan.needs.GRAD_STAGING_CAP, booked; a larger copy in slices):
  it crosses the link in the compute dtype, and the copy worker adds or converts it on the host
  before its next copy (one worker: one buffer does).
- Accumulation: the first backward counts each parameter's contributions (one per graph using
  it: per recomputed block for a shared weight); later backwards sum them in p.grad in
  PyTorch's order and hand each chunk one sum per parameter (copy the first time a parameter is
  seen in a step, add afterwards: the reference's order).
- Early update: in the last micro-batch (`early_on`), a chunk whose parameters have all sent
  their sums is updated while backward goes on (offload.engine.early); a gradient on NVMe goes
  to it in its staging buffer, not through the swap file. Not a chunk the first backward read
  after its last contribution (`read_in_backward`): that one is updated at the step's end.
- Several ranks, owned-only gradients (`transient`, offload.engine.transient): a chunk another
  rank owns accumulates this micro-batch only, in a transient buffer; once complete (`reduce_on`)
  every rank hands it to the worker, which reduces it onto its owner and frees the non-owners'
  buffers; the chunks not complete by the end of backward are reduced then (`reduce_rest`).
  The first backward, before the uses are counted, reduces each contribution as it arrives
  (`_reduce_contribution`): no buffer of another's chunk is held at all.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any, Callable

import torch

from ..core.errors import UnsupportedModel
from ..plan.needs import gathering
from ..runtime.executor import Executor
from ..runtime.ledger import Ledger
from ..runtime.store import ChunkStore, SwapKind, in_slot_order
from .early import EarlyUpdater
from .gradspill import GradSpill

log = logging.getLogger(__name__)

STAGE_ON_SIMULATED = False
"""The engine stages gradients on CUDA only (the simulated device's memory is the host's);
tests set this to run the staging path on the CPU."""


class _Held:
    """Device bytes of a gradient on its way to the host (`buf`): given back to the ledger, and
    the buffer dropped, once its copy has landed (the copy worker calls `release`), or when
    the launching thread retires it, whichever comes first."""

    def __init__(self, ledger: Ledger, nbytes: int, buf: torch.Tensor):
        self.ledger, self.nbytes, self.buf = ledger, nbytes, buf
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            if self.buf is None:
                return
            self.buf = None
        self.ledger.release("gpu", "grad", self.nbytes)


class _Gather:
    """One streamed chunk's gradients of this backward, gathered on the device: `buf` [numel]
    (zeros where nothing arrived), `arrived` the parameters in it so far (ids). (Made without
    __init__: one per chunk and micro-batch, on the launching thread.)"""

    __slots__ = ("buf", "arrived")


class GradientRouter:
    """Gets the chunk store (and its plan), the executor, the ledger, the parameters' names, the
    in-flight byte limit (`grad_reserve`, it changes with the placement), a factory of NVMe
    gradient spills (one per step), the early updater (None: updates wait for the step's end) and
    the host buffer copies land in first (`staging`, uint8; None: into their homes directly)."""

    def __init__(self, *, store: ChunkStore, executor: Executor, ledger: Ledger,
                 param_names: dict[torch.nn.Parameter, str], grad_reserve: Callable[[], int],
                 new_spill: Callable[[], GradSpill], early: EarlyUpdater | None, compute_itemsize: int,
                 ranks: Any = None, transient: Any = None, reduce_rest: Callable[[list[int]], None] | None = None,
                 counts: dict[str, int] | None = None, staging: torch.Tensor | None = None):
        self.store, self.plan = store, store.plan
        self.executor, self.ledger, self.param_names = executor, ledger, param_names
        self.grad_reserve, self.new_spill, self.early = grad_reserve, new_spill, early
        self.compute_itemsize = compute_itemsize
        # a parameter's own copies: at most the largest one's bytes in flight (the first backward)
        self.param_reserve = compute_itemsize * max(
            (s.numel for s in self.plan.slots.values() if not self.plan.is_frozen(s.chunk)), default=0)
        self.ranks, self.transient, self.reduce_rest = ranks, transient, reduce_rest
        self.staging = staging
        self.staged = 0  # copies through it
        self.counts = {"grad_copies": 0} if counts is None else counts  # the step's counters (timeline)
        self.reduce_on = False  # owned-only gradients: complete chunks are reduced during backward
        self.spill = new_spill()
        self.seen: set[int] = set()  # parameters with a gradient in this step (their ids)
        self._slot_of = {id(p): (n, self.plan.slots[n]) for p, n in param_names.items()}
        self.early_on = False
        self.uses: dict[str, int] | None = None  # gradients per backward, per parameter (traced)
        self.expected: dict[int, int] = {}  # per chunk, when every parameter in it gets some
        self.gather_bytes = 0  # the most bytes of sums held in p.grad at once (after the warm-up)
        # first backward: per chunk read in backward, its parameters' contributions so far at its last read
        self._read_at: dict[int, dict[str, int]] = {}
        self.read_late: set[int] = set()  # chunks read in backward after their last contribution
        self._inflight: deque = deque()
        self._inflight_bytes = 0  # sent, not yet retired
        self._open_bytes = 0  # gathers still filling
        self._gathers: dict[int, _Gather] = {}  # chunk -> its gradients gathered on the device
        self.gather_from: dict[int, int] = {}  # chunk -> parameters it gathers per backward (traced)
        self._flushed: set[int] = set()  # chunks whose gathered sums reached their home this step
        self._gathered: dict[int, tuple[torch.nn.Parameter, int]] = {}  # id -> p, bytes its held p.grad has
        self._flushing = False
        self._home_grads: dict[int, torch.Tensor] = {}  # a device-home parameter's id -> its gradient's slot
        self.placement_changed()
        self.begin_backward()

    # -- a step's life --------------------------------------------------------------------
    def begin_step(self) -> None:
        self.seen = set()
        self._flushed = set()
        self.spill.begin_cycle()

    def begin_backward(self) -> None:
        self._got: dict[int, set] = {}  # chunk -> its parameters (ids) gathered so far in this backward
        self._counts: dict[str, int] = {}
        self._arrived: dict[int, int] = {}
        self._chunk_tickets: dict[int, list] = {}
        self._submitted: set[int] = set()
        self._held_back: set[int] = set()
        self._in_backward: set[int] = set()  # arrived in this backward (transient buffers): ids

    def end_backward(self) -> None:
        """After loss.backward(): flush held sums, learn the uses (first backward), let every
        copy land, write spilled chunks out, wait for early updates."""
        self._flush_gathered()
        self.send_open()  # chunks some of whose parameters sent nothing this time
        first = self.uses is None
        if first:
            self._learn_uses()
        self.drain()
        if first:  # a later micro-batch of this step adds its gathered sums to these homes:
            for p, name in self.param_names.items():  # what the parameters sent, zeros elsewhere
                slot = self.plan.slots[name]
                if slot.chunk in self.gather_from and id(p) not in self.seen:
                    self.store.grad_view(slot).zero_()
            self._flushed.update(self.gather_from)
        self.spill.end_backward()
        if self.early_on or self.reduce_on:
            self.early.wait()
        if self.transient is not None and not first:  # (the first backward reduced each contribution)
            self.reduce_rest([c.index for c in self.plan.chunks
                              if not self.plan.is_frozen(c.index) and c.index not in self._submitted])

    def finish_step(self, params: dict[str, torch.nn.Parameter], *, zero_unseen: bool) -> set[int]:
        """Before the update: every gradient in place; returns the chunks already updated early
        (the caller clears the set once the rest are updated)."""
        self.drain()
        if zero_unseen:
            self.store.zero_unseen_grads(self.seen, params)
        self.spill.finish_cycle()
        return self.early.done if self.early is not None else set()

    def abort(self) -> bool:
        """Drop a failed step's gradients; True when its early updates had not reached any
        chunk, so the weights are those of the last completed step."""
        intact = True
        for p, nbytes in self._gathered.values():
            p.grad = None
            self.ledger.release("gpu", "activation", nbytes)
        self._gathered = {}
        for g in self._gathers.values():
            self.ledger.release("gpu", "grad", g.buf.nbytes)
        self._gathers, self._open_bytes = {}, 0
        self.drain()
        if self.early is not None:
            try:
                self.early.wait()  # never leave the worker writing while the caller saves
            except BaseException:  # noqa: BLE001 - the budget error is the one to report
                log.exception("an early update failed while a step was aborted")
            intact = not self.early.done
            self.early.done.clear()
        if self.transient is not None:  # (after the worker: it may still be reducing one)
            self.transient.free_all()
        self.spill.finish_cycle()
        self.spill = self.new_spill()
        self.store.zero_grads()
        return intact

    def read_in_backward(self, cid: int) -> None:
        """Backward reads chunk `cid` (a recompute, a saved weight). The first backward notes
        how many contributions its parameters had by then: a chunk still read after its last
        one (a weight read but not differentiated there, e.g. through .detach()) is never updated
        early, as its update (and the rewrite of its cached copy, offload.engine.residency) would
        change what backward still reads. Later, such a read of a chunk already updated early is
        refused (the backward changed since the first one)."""
        if cid in self.plan.frozen:
            return
        if self.uses is None:
            self._read_at[cid] = {n: self._counts.get(n, 0) for n in self.plan.chunks[cid].params}
        elif self.early_on and cid in self._submitted:
            raise UnsupportedModel(
                f"backward reads chunk {cid} ({', '.join(self.plan.chunks[cid].params[:2])}...) after it "
                f"was updated early, which the first backward did not; use overlap_update=False for a "
                f"model whose backward changes from step to step")

    # -- arrival --------------------------------------------------------------------------
    def grad_ready(self, p: torch.nn.Parameter) -> None:
        """`p`'s post-accumulate-grad hook. (Runs once per parameter per backward: the common
        path, a gathered chunk's parameter, makes two Python calls.)"""
        pid = id(p)
        name, slot = self._slot_of[pid]
        n = self._counts[name] = self._counts.get(name, 0) + 1
        if self.uses is not None:
            more = not self._flushing and n < self.uses.get(name, 0)
            if (more or pid in self._gathered) and self._holding_sum(p, pid, more):
                return
        g = p.grad
        p.grad = None
        first = pid not in self.seen
        self.seen.add(pid)
        # a transposed parameter's gradient lands in its memory order
        src = (g.as_strided((slot.numel,), (1,), g.storage_offset()) if g.stride() == slot.stride
               else in_slot_order(g, slot))
        if slot.chunk in self.gather_from:  # (never another rank's, spilled or gpu-home: _learn_uses)
            self._gather(slot, src, pid)
            return
        home = self._home_grads.get(pid)
        if home is not None:  # a device-home chunk: the gradient lands in place (never with ranks)
            home.copy_(src) if first else home.add_(src)
            if self.early_on or self.reduce_on:
                self._arrived_grad(slot.chunk, (name,), None)
            return
        if self.transient is not None and self.uses is None:
            self._reduce_contribution(slot, src, first)
            return
        spilled = isinstance(self.store.chunks[slot.chunk].grad, SwapKind)
        remote = self.transient is not None and not self.ranks.owns(slot.chunk)
        if remote:  # this micro-batch's sum only: the buffer opens empty in every backward
            first = pid not in self._in_backward
            self._in_backward.add(pid)
            dst = self.transient.target(slot.chunk)[slot.offset: slot.offset + slot.numel]
        elif spilled:
            dst = self.spill.target(slot.chunk)[slot.offset: slot.offset + slot.numel]
        else:
            dst = self.store.grad_view(slot)
        nbytes = src.numel() * src.element_size()
        # in flight: at most the largest parameter's bytes, and no more than the open gathers leave
        self._reserve(nbytes, min(self.param_reserve, self.grad_reserve() - self._open_bytes))
        ticket = self._copy_out(dst, _Held(self.ledger, nbytes, src), first)
        if spilled:
            self.spill.landed(slot.chunk, ticket)
        if self.early_on or self.reduce_on:
            self._arrived_grad(slot.chunk, (name,), ticket)  # an early update may take the spill's buffer
        if spilled and self.spill.complete(slot.chunk):
            self.spill.flush(slot.chunk)

    def _gather(self, slot: Any, src: torch.Tensor, pid: int) -> None:
        """A parameter's sum (`pid`: its id) joins its chunk's gathered gradients; the chunk
        crosses to its home once every parameter the first backward saw send one has (`_send`)."""
        cid = slot.chunk
        g = self._gathers.get(cid)
        if g is None:
            nbytes = self.plan.chunks[cid].numel * src.element_size()
            self._reserve(nbytes, self.grad_reserve() - self._open_bytes)  # (the open gathers beside it)
            try:
                buf = torch.zeros(self.plan.chunks[cid].numel, dtype=src.dtype, device=src.device)
            except BaseException:
                self.ledger.release("gpu", "grad", nbytes)
                raise
            self._open_bytes += nbytes
            g = self._gathers[cid] = _Gather.__new__(_Gather)
            g.buf, g.arrived = buf, set()
        part = g.buf[slot.offset: slot.offset + slot.numel]
        part.add_(src) if pid in g.arrived else part.copy_(src)  # (a contribution more than traced: added)
        g.arrived.add(pid)
        got = self._got.get(cid)
        if got is None:
            got = self._got[cid] = set()
        got.add(pid)
        if len(got) == self.gather_from[cid]:
            self._send(cid)

    def send_open(self) -> None:
        """Send every chunk's gradients gathered so far (a block's recompute starts: none of them
        stays on the device through it); the rest of a chunk follows, added, when it arrives."""
        for cid in list(self._gathers):
            self._send(cid)

    def _send(self, cid: int) -> None:
        """Chunk `cid`'s gathered gradients to its home: copied there the first time in a step
        (zeros for what did not arrive: the home holds this step's sums only), added afterwards.
        On the simulated device without an emulated link, on this thread at once: the device is
        host memory, and its bytes then never linger in flight (a planned peak holds)."""
        g = self._gathers.pop(cid)
        nbytes = g.buf.nbytes
        self._open_bytes -= nbytes
        dst = self.store.chunks[cid].grad
        first = cid not in self._flushed
        self._flushed.add(cid)
        ticket = None
        if not self.executor.cuda and self.executor.lanes["d2h"].link.bandwidth is None:
            try:
                dst.copy_(g.buf) if first else dst.add_(g.buf)
            finally:
                self.ledger.release("gpu", "grad", nbytes)
            self.counts["grad_copies"] += 1
        else:
            ticket = self._copy_out(dst, _Held(self.ledger, nbytes, g.buf), first)
        if self.early_on or self.reduce_on:  # (its parameters arrive with the copy: an early update waits for it)
            names = []
            for pid in g.arrived:  # (a loop: a comprehension is one more Python call)
                names.append(self._slot_of[pid][0])
            self._arrived_grad(cid, names, ticket)

    def _copy_out(self, dst: torch.Tensor, held: _Held, first: bool) -> Any:
        """Copy `held`'s gradients (booked already) to `dst` in host memory (added unless
        `first`), in flight until retired; their booking is given back once they land, or now
        if the copy cannot start."""
        src = held.buf
        try:
            staging = None
            if self.staging is not None and (not first or src.dtype != dst.dtype):
                staging = self.staging[:min(held.nbytes, self.staging.numel())].view(src.dtype)
                self.staged += 1
            ticket = self.executor.copy("d2h", dst, src, accumulate=not first, staging=staging, then=held.release)
        except BaseException:
            held.release()
            raise
        self._inflight_bytes += held.nbytes
        self.counts["grad_copies"] += 1
        self._inflight.append((ticket, held.nbytes, held))
        return ticket

    def _reduce_contribution(self, slot: Any, src: torch.Tensor, first: bool) -> None:
        """The first backward with owned-only gradients: this contribution is reduced onto the
        chunk's owner at once (every rank gets the same hooks in the same order), which adds it
        to its gradient chunk; nobody holds a buffer of another's chunk."""
        cid = slot.chunk
        if not self.ranks.owns(cid):
            host = torch.empty(slot.numel, dtype=torch.float32)
            host.copy_(src.reshape(-1))
            self.ranks.reduce_grad(cid, host, offset=slot.offset)
            return
        spilled = isinstance(self.store.chunks[cid].grad, SwapKind)
        dst = (self.spill.target(cid)[slot.offset: slot.offset + slot.numel] if spilled
               else self.store.grad_view(slot))
        src = src.reshape(-1).to("cpu", torch.float32)
        dst.copy_(src) if first else dst.add_(src)
        self.ranks.reduce_grad(cid, dst, offset=slot.offset)  # (the sum so far + this rank's) + the others': as a chunk's reduce
        if spilled:
            self.spill.landed(cid, None)
            if self.spill.complete(cid):
                self.spill.flush(cid)

    def _holding_sum(self, p: torch.nn.Parameter, pid: int, more: bool) -> bool:
        """Count-driven: p's post-accumulate hook runs once per graph that uses it (a weight used
        twice in one graph: once; in two recomputed blocks: twice). While `more` are due (as many
        as the first backward counted), leave the sum in p.grad for autograd to add the next one
        to, in plain PyTorch's order (True): the grad chunk then gets one sum per backward, as
        p.grad does across micro-batches. The held p.grad is device memory of this backward only,
        booked as an activation."""
        if more:
            if pid not in self._gathered:
                nbytes = p.grad.numel() * p.grad.element_size()
                self.ledger.reserve("gpu", "activation", nbytes)  # first: abort() releases what is here
                self._gathered[pid] = (p, nbytes)
            return True
        self.ledger.release("gpu", "activation", self._gathered.pop(pid)[1])
        return False

    def _flush_gathered(self) -> None:
        """After backward: sums still waiting for contributions that did not come this time."""
        self._flushing = True
        try:
            for p, _ in list(self._gathered.values()):
                self.grad_ready(p)
        finally:
            self._flushing = False

    def _arrived_grad(self, cid: int, names: "tuple[str, ...] | list[str]", ticket: Any) -> None:
        """The gradient sums of parameters `names` reached chunk `cid`'s grad chunk (with `ticket`'s
        copy; called when early updates or reduces are on). Once every parameter of a chunk has
        sent its sum (last micro-batch, no clipping), the chunk's update starts while backward
        goes on (offload.engine.early)."""
        for name in names:
            n, traced = self._counts[name], self.uses.get(name, 0)
            if n > traced:  # a contribution more than the first backward had: the control flow changed
                if cid in self._submitted:
                    # owned-only gradients: every complete chunk is reduced early, whatever the overlap
                    fix = 'grad_reduce="step"' if self.transient is not None else "overlap_update=False"
                    done = "updated" if self.early_on else "reduced"
                    raise UnsupportedModel(
                        f"parameter {name!r} got gradient contribution {n} in this backward (the first "
                        f"backward had {traced}) after its chunk was {done} "
                        f"early; use {fix} for a model whose backward changes from step to step")
                self._held_back.add(cid)  # updated at the end of the step instead
        if ticket is not None:
            self._chunk_tickets.setdefault(cid, []).append(ticket)
        self._arrived[cid] = self._arrived.get(cid, 0) + len(names)
        if cid not in self._held_back and self._arrived[cid] == self.expected.get(cid):
            self._submitted.add(cid)
            # a gradient on NVMe: no round trip through the disk
            handed = self.spill.hand_over(cid) if cid in self.spill.open else None
            if self.transient is not None and cid in self.transient.bufs:
                self.transient.queue(cid)
            self.early.submit(cid, self._chunk_tickets.pop(cid, []), handed, final=self.early_on)

    def _learn_uses(self, uses: dict[str, int] | None = None) -> None:
        """After the first backward: the contributions each parameter gets per backward (the
        trace of gradients). A chunk expects one sum per parameter; one with a parameter that
        got none is not updated early (that slot is zeroed at the end of the step). `uses`:
        those of an earlier run (a resumed one: its first backward then sums as the run did)."""
        self.uses = dict(self._counts if uses is None else uses)
        self.read_late = {c for c, at in self._read_at.items()
                          if all(k >= self.uses.get(n, 0) for n, k in at.items())}
        self.expected = {c.index: len(c.params) for c in self.plan.chunks
                         if all(self.uses.get(name, 0) for name in c.params) and c.index not in self.read_late}
        # streamed chunks with a gradient home in memory gather their parameters' sums on the device
        self.gather_from = {c.index: n for c, g in zip(self.plan.chunks, gathering([c.params for c in self.plan.chunks]))
                            if g and not self.plan.is_frozen(c.index) and not self.store.is_gpu_home(c.index)
                            and isinstance(self.store.chunks[c.index].grad, torch.Tensor)
                            and (self.transient is None or (self.ranks is not None and self.ranks.owns(c.index)))
                            and (n := sum(1 for name in c.params if self.uses.get(name, 0)))}
        # the sums later backwards hold in p.grad (at most all at once): the warm-up held none
        self.gather_bytes = sum(self.plan.slots[n].numel for n, k in self.uses.items() if k > 1) \
            * self.compute_itemsize

    def placement_changed(self) -> None:
        """Chunks were placed on the device: their gradients land in place, not gathered."""
        self.gather_from = {c: n for c, n in self.gather_from.items() if not self.store.is_gpu_home(c)}
        home = {c for c in range(len(self.plan.chunks))
                if self.store.is_gpu_home(c) and isinstance(self.store.chunks[c].grad, torch.Tensor)}
        self._home_grads = {id(p): self.store.grad_view(self.plan.slots[n]) for p, n in self.param_names.items()
                            if self.plan.slots[n].chunk in home}

    # -- device bytes in flight -----------------------------------------------------------
    def _reserve(self, nbytes: int, limit: int) -> None:
        """Book `nbytes` of gradients on the device, first retiring the copies in flight that
        have landed, and the oldest ones while they and these exceed `limit`."""
        limit = max(limit, nbytes)
        while self._inflight and (self._inflight[0][0].done() or self._inflight_bytes + nbytes > limit):
            self._retire_oldest()
        self.ledger.reserve("gpu", "grad", nbytes)

    def _retire_oldest(self) -> None:
        ticket, nbytes, held = self._inflight.popleft()
        try:
            self.executor.wait(ticket)
        finally:
            self._inflight_bytes -= nbytes
            held.release()

    def drain(self) -> None:
        while self._inflight:
            self._retire_oldest()
