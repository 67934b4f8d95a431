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
  values the forward saw (BufferGuard).
- Module stack: every module's forward is a frame on the residency's stack (`enter_module`,
  `exit_module`); a parameter read outside its owner's forward is made resident for the
  innermost frame (offload.engine.reads).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..runtime.ledger import Ledger
from ..runtime.storage import storage_key

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

    def __init__(self, residency: "Residency", ledger: Ledger, device: torch.device):
        self.residency, self.ledger, self.device = residency, ledger, device
        self._live: dict[int, list[int]] = {}  # storage key -> [refcount, nbytes]
        self._held: list[weakref.ref] = []  # this step's activations (abandon drops those alive)
        self.offloader = None  # an offload.engine.actoffload.Offloader when activation offload is on

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor) -> Any:
        res = self.residency
        storage = t.untyped_storage()
        key = storage_key(storage)
        cid = res.streamed_storage.get(key)
        if cid is not None:
            if res.holds(cid):
                pinned = _Pinned.__new__(_Pinned)
                pinned.tensor, pinned.cid = t, cid
                return pinned
            return _ChunkRef(cid, tuple(t.size()), tuple(t.stride()), t.storage_offset())
        home = res.home_storage.get(key)
        if home is not None:
            return _HomeRef(t, home)
        if t.device != self.device:
            return t  # not in the gpu tier
        if self.offloader is not None:
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
        self._held = [r for r in self._held if r() is not None]

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

    def saving_block_inputs(self) -> Any:
        """Context for a checkpointed block's save_for_backward: its inputs may be offloaded."""
        return _Flag(self.offloader)


class _Flag:
    def __init__(self, offloader: Any):
        self.offloader = offloader

    def __enter__(self) -> None:
        if self.offloader is not None:
            self.offloader.active = True

    def __exit__(self, *exc: object) -> None:
        if self.offloader is not None:
            self.offloader.active = False


def install_module_hooks(units: Iterable[torch.nn.Module], enter: Callable[[torch.nn.Module], None],
                         exit: Callable[[torch.nn.Module], None]) -> list[Any]:
    """Each unit's forward (a block, or a module outside the blocks that owns parameters:
    offload.engine.needs.module_chunks) is a frame of the module stack (offload.engine.residency):
    `enter` before it (acquires the unit's chunks), `exit` after it, also when it raises. The
    modules inside a block get no hooks: the block's frame holds all their chunks. Returns the
    hooks' handles (remove() undoes each)."""
    handles = []
    for m in units:
        handles.append(m.register_forward_pre_hook(lambda mod, args: enter(mod)))
        handles.append(m.register_forward_hook(lambda mod, args, out: exit(mod), always_call=True))
    return handles


class BufferGuard:
    """A checkpointed block's buffers, as its forward found them, for its recompute.

    Before each forward that backward will recompute, every buffer of the block is copied;
    after it, the copies of buffers the forward left unchanged (same object, equal values)
    are dropped. The recompute then runs on the kept copies, and the block's buffers are set
    back to the forward's results: one update per forward, as without recompute. The copies
    are device bytes, reserved as activations (`reserve(n)` / `release(n)`).
    (Version counters cannot tell: batch_norm updates running stats without bumping them.)
    """

    def __init__(self, block: torch.nn.Module, *, reserve: Callable[[int], None], release: Callable[[int], None]):
        self.block, self.reserve, self.release = block, reserve, release

    def before(self) -> list[tuple[torch.nn.Module, str, torch.Tensor, torch.Tensor]]:
        taken = [(m, n, b, b.clone()) for m in self.block.modules() for n, b in m._buffers.items()
                 if b is not None]
        self.reserve(sum(_nbytes(c) for *_, c in taken))
        return taken

    def after(self, taken: list) -> "_Snapshot":
        changed = [(m, n, copy) for m, n, b, copy in taken
                   if m._buffers[n] is not b or not torch.equal(b, copy)]
        kept = sum(_nbytes(c) for *_, c in changed)
        self.release(sum(_nbytes(c) for *_, c in taken) - kept)
        return _Snapshot(changed, lambda: self.release(kept))

    def drop(self, taken: list) -> None:
        """The forward raised: no recompute will need the copies."""
        self.release(sum(_nbytes(c) for *_, c in taken))


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
    def forward(ctx, run: Any, spec: Any, n_tensors: int, anchor: torch.Tensor,  # type: ignore[override]
                *flat: Any) -> Any:
        ctx.run, ctx.spec, ctx.n_tensors = run, spec, n_tensors  # run: (context, callable, [snapshot], hold)
        tensors = flat[:n_tensors]
        ctx.others = flat[n_tensors:]
        ctx.grad_mask = [isinstance(t, torch.Tensor) and t.requires_grad for t in tensors]
        ctx.save_for_backward(*tensors)
        ctx.rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        with torch.no_grad():
            return run[1](*_rebuild(spec, n_tensors, flat))

    @staticmethod
    def backward(ctx, *grads: Any) -> Any:  # type: ignore[override]
        saved = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(g) for t, g in zip(saved, ctx.grad_mask)]
        flat = list(inputs) + list(ctx.others)
        with ctx.run[3]():  # the block's chunks stay resident through its recompute and backward
            with torch.random.fork_rng(devices=[] if ctx.cuda_rng is None else [torch.cuda.current_device()]):
                torch.set_rng_state(ctx.rng)
                if ctx.cuda_rng is not None:
                    torch.cuda.set_rng_state(ctx.cuda_rng)
                snapshot = ctx.run[2][0]
                with torch.enable_grad(), ctx.run[0](), snapshot.restored():
                    out = ctx.run[1](*_rebuild(ctx.spec, ctx.n_tensors, flat))
            outs = out if isinstance(out, tuple) else (out,)
            pairs = [(o, g) for o, g in zip(outs, grads)
                     if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            del out, outs, pairs
        return (None, None, None, None) + tuple(
            t.grad if g else None for t, g in zip(inputs, ctx.grad_mask)
        ) + (None,) * len(ctx.others)


def _rebuild(spec: Any, n_tensors: int, flat: Any) -> tuple[tuple, dict]:
    """(args, kwargs) from the flat list: tensors first, then the non-tensor leaves."""
    treespec, is_tensor = spec
    tensors, others = iter(flat[:n_tensors]), iter(flat[n_tensors:])
    return tree_unflatten([next(tensors) if t else next(others) for t in is_tensor], treespec)


def checkpointed(forward: Callable, *, context: Callable[[], Any], hold: Callable[[], Any],
                 saving: Callable[[], Any], buffers: BufferGuard) -> Callable:
    """Wrap a block's forward so that backward recomputes it instead of keeping its internals.

    `context()` is what the recomputation runs under (the engine's saved-tensor hooks and read
    guard); `hold()` what the recomputation and the block's backward both run under (the
    block's frame, holding its chunks: its own forward hooks do not run then);
    `saving()` wraps the saving of the block's inputs (activation offload picks them there);
    `buffers` restores the buffers the forward changed for the recompute.
    """
    anchor = torch.empty(0, requires_grad=True)

    def run(args: tuple, kwargs: dict) -> Any:
        return forward(*args, **kwargs)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        leaves, treespec = tree_flatten((args, kwargs))
        is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
        tensors = [x for x, t in zip(leaves, is_tensor) if t]
        others = [x for x, t in zip(leaves, is_tensor) if not t]
        snapshot: list = [None]
        taken = buffers.before()
        try:
            with saving():  # autograd packs the saved inputs when apply returns: inside this block
                out = _Checkpoint.apply((context, run, snapshot, hold), (treespec, is_tensor), len(tensors), anchor,
                                        *tensors, *others)
        except BaseException:  # e.g. BudgetExceeded mid-block: the copies' bytes go back
            buffers.drop(taken)
            raise
        snapshot[0] = buffers.after(taken)
        return out

    return wrapper
