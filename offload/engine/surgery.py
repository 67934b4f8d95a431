"""Model surgery: every change the engine makes to the user's model, each with its undo.

The engine swaps meta-device parameters for real ones, moves buffers to the device, registers
module and gradient hooks, wraps forwards (block checkpointing, MeZO's dual forward) and turns
off a Hugging Face KV cache under recompute. Each change records an undo handle here;
`close()` runs them newest first, so the model's modules get their own forward and hooks back
(the engine then leaves the parameters as meta tensors: Engine.close says why).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

import torch

from ..runtime.ledger import Ledger


class Undo:
    """One change to the model; `remove()` puts it back (once)."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Callable[[], None]):
        self._fn = fn

    def remove(self) -> None:
        fn, self._fn = self._fn, None
        if fn is not None:
            fn()


HELD: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
"""The models engines hold now (their parameters are the engines'); a copy is not among them."""


class ModelSurgery:
    """Gets the model. Every method that changes it records how to undo the change."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.undo: list[Any] = []  # anything with remove(): Undo, torch's RemovableHandle
        HELD.add(model)

    def keep(self, handles: Iterable[Any]) -> None:
        """Handles made elsewhere (torch's hook handles): close() removes them."""
        self.undo.extend(handles)

    def materialize_meta(self, named: list[tuple[str, torch.nn.Parameter]], *, dtype: torch.dtype,
                         device: torch.device) -> list[tuple[str, torch.nn.Parameter]]:
        """Swap meta-device parameters for real (empty) ones; weights come via load_weights.
        A frozen one stays frozen (a LoRA base built on the meta device)."""
        swap = {p: torch.nn.Parameter(torch.empty(0, dtype=dtype, device=device), requires_grad=p.requires_grad)
                for _, p in named if p.device.type == "meta"}
        if not swap:
            return named
        self._replace_params(swap)
        return [(n, swap.get(p, p)) for n, p in named]

    def move_buffers(self, device: torch.device) -> int:
        """Module buffers live on the device (bytes returned); close() moves them back."""
        total, moved = 0, []
        for mod in self.model.modules():
            for name, buf in list(mod._buffers.items()):
                if buf is None:
                    continue
                if buf.device != device and buf.device.type != "meta":
                    moved.append((mod, name, buf.device))
                    mod._buffers[name] = buf = buf.to(device)
                total += buf.numel() * buf.element_size()

        def back() -> None:
            for mod, name, where in moved:
                if mod._buffers.get(name) is not None:
                    mod._buffers[name] = mod._buffers[name].to(where)
        if moved:
            self.undo.append(Undo(back))
        return total

    def patch_forward(self, mod: torch.nn.Module, wrap: Callable[[Callable], Callable]) -> Undo:
        """mod.forward = wrap(mod.forward); undone to the instance's own forward attribute (or
        none: the class's forward again), at close() or by the Undo returned (the latest patch
        of `mod` first)."""
        own = mod.__dict__.get("forward")
        mod.forward = wrap(mod.forward)

        def back() -> None:
            if own is None:
                mod.__dict__.pop("forward", None)
            else:
                mod.forward = own
        undo = Undo(back)
        self.undo.append(undo)
        return undo

    def disable_kv_cache(self) -> None:
        """A recomputed block would see a KV cache twice: use_cache off while the engine runs, in
        every config the model's modules hold and their text configs (a vision-language model's
        language model reads its own)."""
        configs: dict[int, Any] = {}
        for m in self.model.modules():
            for config in (getattr(m, "config", None), getattr(getattr(m, "config", None), "text_config", None)):
                if config is not None and not isinstance(config, torch.nn.Module):
                    configs.setdefault(id(config), config)
        for config in configs.values():
            if getattr(config, "use_cache", False) is True:
                config.use_cache = False
                self.undo.append(Undo(lambda c=config: setattr(c, "use_cache", True)))

    def close(self) -> None:
        undo, self.undo = self.undo, []
        try:
            for h in reversed(undo):
                h.remove()
        finally:  # (an undo that failed still lets the model go)
            HELD.discard(self.model)

    def to_meta(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Replace `params` in the model by meta tensors of their shape (shared ones stay shared):
        a use of the closed model fails loudly instead of reading placeholder values."""
        self._replace_params({p: torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"))
                              for p in params})

    def persistent_buffers(self) -> dict[str, torch.Tensor]:
        """The model's buffers a state_dict holds, by full name."""
        return {f"{prefix}.{n}" if prefix else n: b for prefix, m in self.model.named_modules()
                for n, b in m._buffers.items() if b is not None and n not in m._non_persistent_buffers_set}

    def _replace_params(self, swap: dict[torch.nn.Parameter, torch.nn.Parameter]) -> None:
        for mod in self.model.modules():
            for key, p in list(mod._parameters.items()):
                if p in swap:
                    mod._parameters[key] = swap[p]


def booked(ledger: Ledger, tier: str, kind: str) -> dict[str, Callable[[int], None]]:
    """reserve(n) / release(n) of one ledger kind, for helpers that get only those two."""
    return dict(reserve=lambda n: ledger.reserve(tier, kind, n), release=lambda n: ledger.release(tier, kind, n))
