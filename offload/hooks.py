"""Hooks that tie a model's execution to the engine.

- Module hooks: before a module computes, the chunks holding its own parameters are made
  resident (and pinned); after it, they are released (and may be evicted).
- Saved-tensor hooks: a tensor autograd keeps for backward is either a view of a streamed
  chunk (kept as a small reference, re-fetched on unpack, so the chunk may leave the device
  in between) or an activation (its bytes reserved in the ledger until autograd drops it).
- Block checkpointing: a repeated block runs without keeping its internals; backward
  recomputes it. Its inputs are the only activations kept per block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

if TYPE_CHECKING:
    from offload.engine import Engine


@dataclass(frozen=True)
class _ChunkRef:
    """A saved view of a streamed chunk's device buffer, stored as coordinates."""

    cid: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class _Held:
    """An activation kept for backward; gives its bytes back to the ledger when dropped."""

    __slots__ = ("tensor", "release")

    def __init__(self, tensor: torch.Tensor, release: Callable[[], None]):
        self.tensor, self.release = tensor, release

    def __del__(self) -> None:
        self.release()


class ActivationTracker:
    """saved_tensors_hooks for the engine: chunk views become references, activations are counted."""

    def __init__(self, engine: "Engine"):
        self.engine = engine
        self._live: dict[int, list[int]] = {}  # storage key -> [refcount, nbytes]
        self.offloader = None  # an offload.actoffload.Offloader when activation offload is on

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor) -> Any:
        eng = self.engine
        key = t.untyped_storage()._cdata
        cid = eng.streamed_storage.get(key)
        if cid is not None:
            return _ChunkRef(cid, tuple(t.size()), tuple(t.stride()), t.storage_offset())
        if key in eng.home_storage or t.device != eng.device:
            return t  # permanent device bytes (already counted) or not in the gpu tier
        if self.offloader is not None and self.offloader.wants(t):
            return self.offloader.pack(t)
        nbytes = t.untyped_storage().nbytes()
        live = self._live.get(key)
        if live is None:
            eng.ledger.reserve("gpu", "activation", nbytes)
            self._live[key] = live = [0, nbytes]
        live[0] += 1
        return _Held(t, lambda: self._drop(key))

    def _drop(self, key: int) -> None:
        live = self._live[key]
        live[0] -= 1
        if live[0] == 0:
            del self._live[key]
            self.engine.ledger.release("gpu", "activation", live[1])

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _ChunkRef):
            buf = self.engine.touch_chunk(packed.cid)
            return buf.as_strided(packed.size, packed.stride, packed.offset)
        if isinstance(packed, _Held):
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


def install_module_hooks(engine: "Engine", modules: list[torch.nn.Module]) -> list[Any]:
    """Acquire a module's chunks before its forward, release them after."""
    handles = []
    for m in modules:
        handles.append(m.register_forward_pre_hook(lambda mod, args: engine.acquire_module(mod)))
        handles.append(m.register_forward_hook(lambda mod, args, out: engine.release_module(mod)))
    return handles


class _Checkpoint(torch.autograd.Function):
    """Run a block without saving its internals; recompute it in backward."""

    @staticmethod
    def forward(ctx, run: Callable, spec: Any, n_tensors: int, *flat: Any) -> Any:  # type: ignore[override]
        ctx.run, ctx.spec, ctx.n_tensors = run, spec, n_tensors  # run: (saved-tensor hooks, callable)
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
        with torch.random.fork_rng(devices=[] if ctx.cuda_rng is None else [torch.cuda.current_device()]):
            torch.set_rng_state(ctx.rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng)
            with torch.enable_grad(), ctx.run[0]():
                out = ctx.run[1](*_rebuild(ctx.spec, ctx.n_tensors, flat))
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        del out, outs, pairs
        return (None, None, None) + tuple(
            t.grad if g else None for t, g in zip(inputs, ctx.grad_mask)
        ) + (None,) * len(ctx.others)


def _rebuild(spec: Any, n_tensors: int, flat: Any) -> tuple[tuple, dict]:
    """(args, kwargs) from the flat list: tensors first, then the non-tensor leaves."""
    treespec, is_tensor = spec
    tensors, others = iter(flat[:n_tensors]), iter(flat[n_tensors:])
    return tree_unflatten([next(tensors) if t else next(others) for t in is_tensor], treespec)


def checkpointed(forward: Callable, *, hooks: Callable[[], Any], saving: Callable[[], Any]) -> Callable:
    """Wrap a block's forward so that backward recomputes it instead of keeping its internals.

    `hooks()` gives the saved-tensor hooks the recomputation runs under (the engine's);
    `saving()` wraps the saving of the block's inputs (activation offload picks them there).
    """

    def run(args: tuple, kwargs: dict) -> Any:
        return forward(*args, **kwargs)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        leaves, treespec = tree_flatten((args, kwargs))
        is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
        tensors = [x for x, t in zip(leaves, is_tensor) if t]
        others = [x for x, t in zip(leaves, is_tensor) if not t]
        with saving():  # autograd packs the saved inputs when apply returns: inside this block
            return _Checkpoint.apply((hooks, run), (treespec, is_tensor), len(tensors), *tensors, *others)

    return wrapper
