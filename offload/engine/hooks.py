"""Hooks that tie a model's execution to the engine.

- Module hooks: before a module computes, the chunks holding its own parameters are made
  resident (and pinned); after it, they are released (and may be evicted).
- Saved-tensor hooks: a tensor autograd keeps for backward is either a view of a streamed
  chunk (kept as a small reference, re-fetched on unpack, so the chunk may leave the device
  in between) or an activation (its bytes reserved in the ledger until autograd drops it).
- Block checkpointing: a repeated block runs without keeping its internals; backward
  recomputes it. Its inputs are the only activations kept per block. Buffers its forward
  changes (BatchNorm's running statistics) are recomputed from copies of their values before
  the forward, so they are updated once, as without recompute, and the recompute sees the
  values the forward saw (BufferGuard). Once a block's recompute has saved the same sizes
  twice, later ones run without the saved-tensor hooks and book those bytes as one sum
  (ActivationTracker.recomputing).
- Module stack: every module's forward is a frame on the residency's stack (`enter_module`,
  `exit_module`); a parameter read outside its owner's forward is made resident for the
  innermost frame (offload.engine.reads).
"""

from __future__ import annotations

import operator
import sys
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..runtime.ledger import Ledger
from ..runtime.storage import key_of
from . import segments

if TYPE_CHECKING:
    from .residency import Residency


@dataclass(frozen=True)
class _ChunkRef:
    """A saved view of a streamed chunk's device buffer, stored as coordinates."""

    cid: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class _HomeRef:
    """A saved view of a device-home chunk: the tensor itself (permanent device bytes, already
    counted); its unpack in backward is a read of that chunk (offload.engine.residency.note_read)."""

    tensor: torch.Tensor
    cid: int


class _Held:
    """An activation kept for backward; gives its bytes back to the ledger when dropped.
    (Made without __init__, and its release inlined in __del__: one is made for every tensor
    autograd saves, so each Python call here is one per saved tensor.)"""

    __slots__ = ("tensor", "key", "tracker", "__weakref__")

    def drop(self) -> None:
        """Give the bytes back once, and let go of the tensor."""
        tracker, self.tracker, self.tensor = self.tracker, None, None
        if tracker is not None:
            live = tracker._live[self.key]
            live[0] -= 1
            if live[0] == 0:
                del tracker._live[self.key]
                tracker.ledger.release("gpu", "activation", live[1])

    __del__ = drop


class _Pinned:
    """A saved view of a chunk the running block holds through its recompute and backward
    (Residency.holding): kept as is; its unpack is a read of that chunk (note_read)."""

    __slots__ = ("tensor", "cid")


class _Back:
    """A saved view of an offloaded block input's device copy in backward (its recompute saves
    it again: an fp32 block's first norm saves its input): booked by the offloader already, and
    kept booked while this reference lives (it holds the offloaded item)."""

    __slots__ = ("tensor", "item", "__weakref__")

    def drop(self) -> None:
        self.tensor = self.item = None


class ActivationTracker:
    """saved_tensors_hooks for the engine: chunk views become references, activations are counted."""

    """Gets the residency (which storages are chunks, and touch_chunk to bring one back), the
    ledger (activations' bytes) and the device."""

    def __init__(self, residency: "Residency", ledger: Ledger, device: torch.device,
                 counts: dict[str, int] | None = None):
        self.residency, self.ledger, self.device = residency, ledger, device
        self.counts = {"saved_tensor_hooks": 0} if counts is None else counts  # the step's counters
        self._live: dict[int, list[int]] = {}  # storage key -> [refcount, nbytes]
        self._held: list[weakref.ref] = []  # this step's activations (abandon drops those alive)
        self.offloader = None  # an offload.engine.actoffload.Offloader when activation offload is on
        # a block recompute's activation bytes, by what decides them (`recomputing`): the sizes
        # its first run saved (a tuple), their sum once a second run saved the same (an int), or
        # None where it needs the hooks (a chunk reference, an offloaded input, sizes that vary)
        self.learned: dict[Any, Any] = {}
        self.recording: _Recording | None = None
        self.lumps = True  # False: every recompute with the hooks (sizes that depend on the data)
        # per block (its index), the most bytes one recompute of it saved: what the block holds
        # from its forward to its backward when it is not recomputed
        self.block_bytes: dict[int, int] = {}

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor) -> Any:
        self.counts["saved_tensor_hooks"] += 1
        res = self.residency
        storage = t.untyped_storage()
        key = key_of(storage)
        cid = res.streamed_storage.get(key)
        if cid is not None:
            if res.holds(cid):
                pinned = _Pinned.__new__(_Pinned)
                pinned.tensor, pinned.cid = t, cid
                return pinned
            if self.recording is not None:
                self.recording.ok = False  # kept as a reference: a recompute without hooks would keep it
            return _ChunkRef(cid, tuple(t.size()), tuple(t.stride()), t.storage_offset())
        home = res.home_storage.get(key)
        if home is not None:
            return _HomeRef(t, home)
        if t.device != self.device:
            return t  # not in the gpu tier
        if self.offloader is not None:
            if self.recording is not None:
                self.recording.ok = False
            if self.offloader.wants(t):
                return self.offloader.pack(t)
            item = self.offloader.fetched_as(key)
            if item is not None:
                back = _Back.__new__(_Back)
                back.tensor, back.item = t, item
                self._held.append(weakref.ref(back))
                return back
        live = self._live.get(key)
        if live is None:
            nbytes = storage.nbytes()
            self.ledger.reserve("gpu", "activation", nbytes)
            self._live[key] = live = [0, nbytes]
            if self.recording is not None:
                self.recording.sizes.append(nbytes)
        live[0] += 1
        held = _Held.__new__(_Held)
        held.tensor, held.key, held.tracker = t, key, self
        self._held.append(weakref.ref(held))
        return held

    def abandon(self) -> None:
        """A step failed before its backward consumed what it saved: drop every activation still
        held. Autograd frees them only with their graph, and a node that saved its own output
        (through a packed object holding that tensor) is a reference cycle Python's collector
        does not see into: without a backward, its bytes would stay booked in the ledger (and
        allocated) for the rest of the run. An abandoned graph's backward then fails (a saved
        value is gone) instead of computing on anything."""
        held, self._held = self._held, []
        for ref in held:
            h = ref()
            if h is not None:
                h.drop()
        if self.offloader is not None:
            self.offloader.abandon()

    def end_step(self) -> None:
        """The step's graphs are gone: forget their (dead) references."""
        alive = []
        for r in self._held:  # (a loop: a comprehension is one more Python call)
            if r() is not None:
                alive.append(r)
        self._held = alive

    def unpack(self, packed: Any) -> torch.Tensor:
        kind = type(packed)
        if kind is _Held:
            return packed.tensor
        if kind is _Pinned:
            self.residency.note_read(packed.cid)
            return packed.tensor
        if kind is _ChunkRef:
            buf = self.residency.touch_chunk(packed.cid)
            return buf.as_strided(packed.size, packed.stride, packed.offset)
        if kind is _HomeRef:
            self.residency.note_read(packed.cid)
            return packed.tensor
        if kind is _Back:
            return packed.tensor
        if self.offloader is not None and not isinstance(packed, torch.Tensor):
            return self.offloader.unpack(packed)
        return packed

    def recomputing(self, key: Any, block: int = -1) -> "_Recompute":
        """What a checkpointed block's recompute runs under, `key` naming what decides its saved
        tensors (the block, its inputs' shapes and dtypes, the segments of a packed batch). A key's
        first two recomputes run with the saved-tensor hooks and note the sizes of what they
        save; where both saved the same sizes, and every tensor saved was an activation or a view
        of a chunk the block holds through its backward (kept as is either way), later ones run
        without the hooks and book the sum as one from the recompute's start to the end of the
        block's backward (`_Recompute.done`): no Python call per saved tensor. Sizes that differ
        between the two (data-dependent: experts' routing) keep the hooks for good, as does a key
        None or `lumps` False. The read guard is entered either way. `block`: the block's index,
        for `block_bytes`."""
        if key is None or not self.lumps or self.offloader is not None:  # (offloaded inputs: hooks)
            return _Recompute(self, None, None, block)
        key = (key, segments.last.key)  # (an attribute: this runs once per block recompute)
        known = self.learned.get(key)
        return _Recompute(self, key, known if type(known) is int else None, block)

    def _learn(self, key: Any, rec: "_Recording") -> None:
        before = self.learned.get(key, _NEW)
        if before is None:
            return
        sizes = tuple(rec.sizes) if rec.ok else None
        if before is _NEW:  # a new key: the table is bounded (packed batches' segments make many)
            if len(self.learned) >= _MAX_LEARNED:
                self.learned = {k: v for k, v in self.learned.items() if type(v) is not tuple}
            if len(self.learned) >= _MAX_LEARNED:
                return  # full of learned sums and refusals: a new key keeps the hooks
            self.learned[key] = sizes
        elif sizes is None or before != sizes:
            self.learned[key] = None
        else:
            self.learned[key] = sum(sizes)

    def forget(self) -> None:
        """The placement changed: learn each recompute again (a chunk's saved views may differ)."""
        self.learned = {}

    def saving_block_inputs(self) -> Any:
        """Context for a checkpointed block's save_for_backward: its inputs may be offloaded.
        None without activation offload (nothing to do around it)."""
        return None if self.offloader is None else _Flag(self.offloader)


_MAX_LEARNED = 4096
_NEW = object()


class _Recording:
    __slots__ = ("sizes", "ok")

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.ok = True


class _Recompute:
    """ActivationTracker.recomputing's context; `done()` once the block's backward has ended."""

    def __init__(self, tracker: ActivationTracker, key: Any, lump: int | None, block: int):
        self.tracker, self.key, self.lump, self.block = tracker, key, lump, block
        self.hooks: Any = None
        self.booked = 0

    def __enter__(self) -> None:
        tracker = self.tracker
        if self.lump is not None:
            tracker.ledger.reserve("gpu", "activation", self.lump)
            self.booked = self.lump  # (the sum its hooked runs noted in block_bytes)
        else:
            self.hooks = tracker.hooks()
            self.hooks.__enter__()
            tracker.recording = _Recording()
        tracker.residency.guard.__enter__()

    def __exit__(self, *exc: Any) -> None:
        tracker = self.tracker
        tracker.residency.guard.__exit__(*exc)
        if self.hooks is None:
            return
        rec, tracker.recording = tracker.recording, None
        self.hooks.__exit__(*exc)
        if exc[0] is None and rec is not None:
            saved = sum(rec.sizes)
            if saved > tracker.block_bytes.get(self.block, 0):
                tracker.block_bytes[self.block] = saved
            if self.key is not None:
                tracker._learn(self.key, rec)

    def done(self) -> None:
        n, self.booked = self.booked, 0
        if n:
            self.tracker.ledger.release("gpu", "activation", n)


class _Flag:
    def __init__(self, offloader: Any):
        self.offloader = offloader

    def __enter__(self) -> None:
        if self.offloader is not None:
            self.offloader.active = True

    def __exit__(self, *exc: object) -> None:
        if self.offloader is not None:
            self.offloader.active = False


def install_module_hooks(units: Iterable[torch.nn.Module], enter: Callable[..., None],
                         exit: Callable[..., None]) -> list[Any]:
    """Each unit's forward (a block, or a module outside the blocks that owns parameters:
    offload.engine.needs.module_chunks) is a frame of the module stack (offload.engine.residency):
    `enter` before it (acquires the unit's chunks), `exit` after it, also when it raises. The
    modules inside a block get no hooks: the block's frame holds all their chunks. Returns the
    hooks' handles (remove() undoes each)."""
    handles = []
    for m in units:  # (called as enter(mod, args) and exit(mod, args, out): no wrapper call)
        handles.append(m.register_forward_pre_hook(enter))
        handles.append(m.register_forward_hook(exit, always_call=True))
    return handles


class BufferGuard:
    """A checkpointed block's buffers, as its forward found them, for its recompute.

    Before each forward that backward will recompute, every buffer of the block is copied;
    after it, the copies of buffers the forward left unchanged (same object, equal values)
    are dropped. The recompute then runs on the kept copies, and the block's buffers are set
    back to the forward's results: one update per forward, as without recompute. The copies
    are device bytes, reserved as activations (`reserve(n)` / `release(n)`).
    (Version counters cannot tell: batch_norm updates running stats without bumping them.)
    On CUDA the values are not compared (a comparison reads back from the device: the host
    would wait for the block's kernels): every copy is kept, restoring an unchanged buffer.
    """

    def __init__(self, block: torch.nn.Module, *, reserve: Callable[[int], None], release: Callable[[int], None],
                 device: torch.device = torch.device("cpu")):
        self.block, self.reserve, self.release = block, reserve, release
        self.modules = list(block.modules())  # (once: the generator costs a call per module, per forward)
        self.compare = self.compares(device)

    @staticmethod
    def compares(device: torch.device) -> bool:
        """Whether the copies of unchanged buffers are dropped after the forward (not on CUDA)."""
        return device.type != "cuda"

    def before(self) -> list[tuple[torch.nn.Module, str, torch.Tensor, torch.Tensor]]:
        taken = []
        for m in self.modules:  # (loops: a comprehension is a Python call, once per block)
            for n, b in m._buffers.items():
                if b is not None:
                    taken.append((m, n, b, b.clone()))
        if taken:
            self.reserve(sum([_nbytes(c) for *_, c in taken]))
        return taken

    def after(self, taken: list) -> "_Snapshot":
        if not taken:
            return _NOTHING
        changed = [(m, n, copy) for m, n, b, copy in taken
                   if not self.compare or m._buffers[n] is not b or not torch.equal(b, copy)]
        kept = sum([_nbytes(c) for *_, c in changed])
        self.release(sum([_nbytes(c) for *_, c in taken]) - kept)
        return _Snapshot(changed, lambda: self.release(kept))

    def drop(self, taken: list) -> None:
        """The forward raised: no recompute will need the copies."""
        if taken:
            self.release(sum([_nbytes(c) for *_, c in taken]))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Snapshot:
    """Buffers as one forward found them; `restored()` runs the recompute on them."""

    def __init__(self, changed: list, release: Callable[[], None]):
        self.changed, self._release = changed, release

    def restored(self) -> Any:
        return _Swap(self.changed)

    def __del__(self) -> None:
        self._release()


_NOTHING = _Snapshot([], lambda: None)  # a block without buffers: nothing to restore


class _Swap:
    def __init__(self, changed: list):
        self.changed, self.current = changed, []

    def __enter__(self) -> None:
        for m, n, copy in self.changed:
            self.current.append(m._buffers[n])
            m._buffers[n] = copy.clone()  # the recompute's updates land in a throw-away copy

    def __exit__(self, *exc: object) -> None:
        for (m, n, _), cur in zip(self.changed, self.current):
            m._buffers[n] = cur


class _Checkpoint(torch.autograd.Function):
    """Run a block without saving its internals; recompute it in backward.

    `anchor` is an empty tensor that requires grad: the outputs require grad even when the
    block's inputs do not (a first block fed by data), so its parameters get gradients."""

    @staticmethod
    def forward(ctx, meta: Any, anchor: torch.Tensor, *tensors: Any) -> Any:  # type: ignore[override]
        # meta: (run, spec, the non-tensor leaves, CUDA's random state kept too, the block's
        # training mode); run: (context, callable, [snapshot], hold). (One argument: autograd
        # makes Python calls per argument.)
        run, spec, others, cuda, training, side = meta
        ctx.run, ctx.spec, ctx.n_tensors, ctx.others = run, spec, len(tensors), others
        ctx.training = training  # (the block's mode: dropout saves masks in training only)
        ctx.grad_mask = list(map(_REQUIRES_GRAD, tensors))
        ctx.save_for_backward(*tensors)
        ctx.rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state() if cuda else None
        ctx.side = None
        with torch.no_grad():
            out = run[1](*_rebuild(spec, len(tensors), [*tensors, *others]))
        if side is None:
            return out
        extra = side.take()
        if not extra:
            return out
        ctx.side = side
        if isinstance(out, torch.Tensor):
            side.single = True
            return (out, *extra)
        if not isinstance(out, tuple):
            raise TypeError(f"a recomputed block whose forward returns a {type(out).__name__} cannot carry the "
                            f"outputs recorded inside it ({', '.join(sorted({f[0] for f in side.found}))}): "
                            "train without recompute")
        return (*out, *extra)

    @staticmethod
    def backward(ctx, *grads: Any) -> Any:  # type: ignore[override]
        # (loops, not comprehensions: each comprehension is a Python call, once per block)
        saved = ctx.saved_tensors
        inputs, layout = [], []
        for t, g in zip(saved, ctx.grad_mask):
            inputs.append(t.detach().requires_grad_(g))
            layout.append((t.shape, t.dtype, t.device))
        others = []
        for o in ctx.others:
            others.append(o if o is None or isinstance(o, (bool, int, float, str)) else type(o))
        own = ctx.spec[0]
        key = None if type(own) is not _Own else (  # (a pytree call: learned never, hooks always)
            ctx.run[1], tuple(layout), tuple(ctx.grad_mask), own.n_args, own.keys, own.shape, tuple(others),
            ctx.training, torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled("cuda"))
        flat = inputs + list(ctx.others)
        side = ctx.side
        if side is not None:  # the recorded outputs' gradients: the last ones
            grads, side_grads = grads[:len(grads) - len(side.found)], grads[len(grads) - len(side.found):]
        with ctx.run[3]():  # the block's chunks stay resident through its recompute and backward
            recompute = ctx.run[0](key)
            token = None if side is None else side.var.set({k: [] for k, _ in side.marks})
            try:
                # the forward's random state for the recompute, this one's back after it (as
                # torch.random.fork_rng does, without its generator's calls)
                rng = torch.get_rng_state()
                cuda_rng = None if ctx.cuda_rng is None else torch.cuda.get_rng_state()
                torch.set_rng_state(ctx.rng)
                if ctx.cuda_rng is not None:
                    torch.cuda.set_rng_state(ctx.cuda_rng)
                try:
                    snapshot = ctx.run[2][0]
                    if snapshot.changed:
                        with torch.enable_grad(), recompute, snapshot.restored():
                            out = ctx.run[1](*_rebuild(ctx.spec, ctx.n_tensors, flat))
                    else:
                        with torch.enable_grad(), recompute:
                            out = ctx.run[1](*_rebuild(ctx.spec, ctx.n_tensors, flat))
                finally:
                    torch.set_rng_state(rng)
                    if cuda_rng is not None:
                        torch.cuda.set_rng_state(cuda_rng)
                outs, gs = [], []
                for o, g in zip(out if isinstance(out, tuple) else (out,), grads):
                    if isinstance(o, torch.Tensor) and o.requires_grad and g is not None:
                        outs.append(o)
                        gs.append(g)
                if side is not None:
                    for o, g in zip(side.again(side.var.get()), side_grads):
                        if o.requires_grad and g is not None:
                            outs.append(o)
                            gs.append(g)
                if outs:
                    torch.autograd.backward(outs, gs)
                del out, outs, gs
            finally:
                if token is not None:
                    side.var.reset(token)
                recompute.done()  # (the recompute's graph is gone: its saved tensors with it)
        result: list = [None, None]
        for t, g in zip(inputs, ctx.grad_mask):
            result.append(t.grad if g else None)
        return tuple(result)


_PLAIN = (torch.Tensor, bool, int, float, str, type(None))
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def _flatten(args: tuple, kwargs: dict) -> tuple[list, Any]:
    """(leaves, spec) of a call's arguments. A decoder layer's usual call (tensors, plain values,
    flat tuples or lists of them) in a form of its own; anything else (a dict, a cache object, a
    nested container) through torch's pytree. (pytree makes some ten Python calls per leaf.)"""
    leaves: list = []
    shape: list = []
    for v in (*args, *kwargs.values()):
        if type(v) is tuple or type(v) is list:
            for x in v:
                if not isinstance(x, _PLAIN):
                    return tree_flatten((args, kwargs))
            leaves.extend(v)
            shape.append((type(v), len(v)))
        elif isinstance(v, _PLAIN):
            leaves.append(v)
            shape.append(None)
        else:
            return tree_flatten((args, kwargs))
    return leaves, _Own(len(args), tuple(kwargs), tuple(shape))


class _Own:
    """_flatten's own spec: how many positional arguments, the keywords, each value's container."""

    __slots__ = ("n_args", "keys", "shape")

    def __init__(self, n_args: int, keys: tuple, shape: tuple):
        self.n_args, self.keys, self.shape = n_args, keys, shape

    def unflatten(self, leaves: list) -> tuple[tuple, dict]:
        values, i = [], 0
        for s in self.shape:
            if s is None:
                values.append(leaves[i])
                i += 1
            else:
                kind, n = s
                values.append(kind(leaves[i:i + n]))
                i += n
        return tuple(values[:self.n_args]), dict(zip(self.keys, values[self.n_args:]))


def _rebuild(spec: Any, n_tensors: int, flat: Any) -> tuple[tuple, dict]:
    """(args, kwargs) from the flat list: tensors first, then the non-tensor leaves."""
    treespec, is_tensor = spec
    leaves, ti, oi = [], 0, n_tensors
    for t in is_tensor:  # (a loop: a comprehension is one more Python call per block)
        if t:
            leaves.append(flat[ti])
            ti += 1
        else:
            leaves.append(flat[oi])
            oi += 1
    if type(treespec) is _Own:
        return treespec.unflatten(leaves)
    return tree_unflatten(leaves, treespec)


class _Side:
    """Tensors the model's own output hooks record inside a recomputed block, into a collector
    its forward set up (transformers 5: a MoE's router logits for its auxiliary loss, inner
    modules' outputs): the block's first forward runs without a graph, so they are made outputs
    of its autograd Function, which replaces them in the collector; its backward recomputes
    them into a fresh collector and adds their gradients."""

    __slots__ = ("var", "collected", "marks", "found", "single")

    def __init__(self, var: Any, collected: dict):
        self.var = var
        self.collected: dict | None = collected
        self.marks = [(k, len(v)) for k, v in collected.items() if type(v) is list]
        self.found: list[tuple[str, int, int]] = []  # (key, from its mark, the mark) of each new one
        self.single = False  # the block returned one tensor, not a tuple

    def take(self) -> list[torch.Tensor]:
        """The tensors recorded since the marks, without a graph."""
        new = []
        assert self.collected is not None  # (taken before put)
        for k, start in self.marks:
            got = self.collected[k]
            for j in range(start, len(got)):
                t = got[j]
                if isinstance(t, torch.Tensor) and not t.requires_grad:
                    self.found.append((k, j - start, start))
                    new.append(t)
        return new

    def put(self, tensors: Iterable[torch.Tensor]) -> None:
        """Replace them in the collector, and let go of it: the Function's context keeps this
        object, and the collector holds the Function's outputs (a cycle torch's autograd
        graph does not free)."""
        collected, self.collected = self.collected, None
        for (k, j, start), t in zip(self.found, tensors):
            collected[k][start + j] = t

    def again(self, fresh: dict) -> list[torch.Tensor]:
        """The same tensors, from the recompute's fresh collector."""
        return [fresh[k][j] for k, j, _ in self.found]


def _collector_var() -> Any:
    """The context variable transformers' output hooks record into, or None (a model that is
    not a transformers one, or a version without it)."""
    if "transformers" not in sys.modules:
        return None
    try:
        from transformers.utils import output_capturing
        return output_capturing._active_collector.context_var
    except (ImportError, AttributeError):
        return None


def checkpointed(forward: Callable, *, context: Callable[[Any], Any], hold: Callable[[], Any],
                 saving: Callable[[], Any], buffers: BufferGuard) -> Callable:
    """Wrap a block's forward so that backward recomputes it instead of keeping its internals.

    `context(key)` is what the recomputation runs under (ActivationTracker.recomputing: the
    engine's saved-tensor hooks or its learned activation bytes, and the read guard), `key`
    naming what decides what it saves; its `done()` runs when the block's backward has ended; `hold()` what the recomputation and the block's backward both run under (the
    block's frame, holding its chunks: its own forward hooks do not run then);
    `saving()` wraps the saving of the block's inputs (activation offload picks them there), or
    is None (nothing to wrap);
    `buffers` restores the buffers the forward changed for the recompute.
    """
    anchor = torch.empty(0, requires_grad=True)
    cuda = torch.cuda.is_available()  # (once: a Python call in torch at every forward otherwise)
    var = _collector_var()

    def run(args: tuple, kwargs: dict) -> Any:
        return forward(*args, **kwargs)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        leaves, treespec = _flatten(args, kwargs)
        tensors, others, kinds = [], [], []
        for x in leaves:  # (a loop: comprehensions are a Python call each, once per block)
            t = isinstance(x, torch.Tensor)
            kinds.append(t)
            (tensors if t else others).append(x)
        is_tensor = tuple(kinds)
        snapshot: list = [None]
        taken = buffers.before()
        collected = None if var is None else var.get()
        side = _Side(var, collected) if collected else None
        meta = ((context, run, snapshot, hold), (treespec, is_tensor), others, cuda, buffers.block.training, side)
        around = saving()
        try:
            if around is None:
                out = _Checkpoint.apply(meta, anchor, *tensors)
            else:
                with around:  # autograd packs the saved inputs when apply returns: inside this block
                    out = _Checkpoint.apply(meta, anchor, *tensors)
        except BaseException:  # e.g. BudgetExceeded mid-block: the copies' bytes go back
            buffers.drop(taken)
            raise
        snapshot[0] = buffers.after(taken)
        if side is not None and side.found:
            n = len(out) - len(side.found)
            side.put(out[n:])
            out = out[0] if side.single else out[:n]
        return out

    return wrapper
