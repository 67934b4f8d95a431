"""Parameter reads the module hooks do not see.

Module hooks make a module's *own* parameters resident around its forward. Some modules read
parameters they do not own: nn.MultiheadAttention reads `out_proj.weight` through
F.multi_head_attention_forward (out_proj's forward never runs), a head tied through
F.linear(h, emb.weight) reads the embedding's weight in its parent's forward. An absent
parameter's placeholder must never reach such a computation.

ReadGuard marks absent parameters: while its chunk is off the device, a parameter's class is a
subclass of its own with a `__torch_function__` (`absent_class`; the engine puts the class back
when the chunk returns). A
torch call that receives an absent parameter (directly, or in a list or tuple argument such as
an RNN's weights) hands it to `on_read` while the guard is entered (the engine runs a forward:
the step's, a block's recompute, evaluation) and not `paused` (the engine's own bookkeeping),
unless the call reads no values (shape, dtype, ...). `on_read` makes the chunk resident for the
innermost module whose forward is running (released when that forward ends, like the module's
own chunks), or refuses with an error naming the parameter and the module. A resident
parameter is its plain class: torch calls on it cost no Python call at all (a mode that saw
every torch call of a forward made one for each).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

_PROPERTIES = ("shape", "dtype", "device", "ndim", "requires_grad", "is_leaf", "grad", "grad_fn", "layout",
               "is_cuda", "is_meta", "is_sparse", "is_quantized", "_version", "nbytes", "itemsize")
_METHODS = ("size", "dim", "numel", "nelement", "stride", "element_size", "is_floating_point", "is_complex",
            "is_contiguous", "storage_offset", "__len__", "requires_grad_", "get_device")
NO_READ = frozenset([getattr(torch.Tensor, n).__get__ for n in _PROPERTIES]
                    + [getattr(torch.Tensor, n).__set__ for n in ("data", "grad", "requires_grad")]
                    + [getattr(torch.Tensor, n) for n in _METHODS])


class ReadGuard:
    """`absent_class(p)`: the class p takes while its chunk is off the device (the engine sets
    p.__class__); `on_read(p)` for such a parameter a torch call reads while the guard is entered
    (`with guard:`) and not `paused`."""

    def __init__(self, on_read: Callable[[torch.nn.Parameter], None]):
        self.on_read = on_read
        self.paused = 0
        self.active = 0
        self._classes: dict[type, type] = {}  # a parameter's class -> its absent subclass
        self._plain: dict[type, type] = {}  # and back

    def absent_class(self, p: torch.nn.Parameter) -> type:
        """The class p takes while absent (p.__class__ = it: the engine swaps classes inline, no
        call per parameter)."""
        cls = self._plain.get(type(p), type(p))
        sub = self._classes.get(cls)
        if sub is None:
            sub = self._classes[cls] = type(f"Absent{cls.__name__}", (cls,),
                                            {"__torch_function__": classmethod(_absent_read), "_guard": self})
            self._plain[sub] = cls
        return sub

    def __enter__(self) -> None:
        self.active += 1

    def __exit__(self, *exc: object) -> None:
        self.active -= 1


def _absent_read(cls: type, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
    if kwargs is None:
        kwargs = {}
    guard: ReadGuard = cls._guard  # type: ignore[attr-defined]
    absent = guard._plain
    if guard.active and not guard.paused and func not in NO_READ:
        left = False  # an absent parameter not made resident (not one of this model's chunks)
        for a in (*args, *kwargs.values()) if kwargs else args:
            if type(a) in absent:
                guard.on_read(a)
                left = left or type(a) in absent
            elif isinstance(a, (list, tuple)):
                for b in a:
                    if type(b) in absent:
                        guard.on_read(b)
                        left = left or type(b) in absent
        if not left:  # all resident, their own classes again: dispatched as they would be (a
            return func(*args, **kwargs)  # parameter subclass's own __torch_function__ included)
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


class Paused:
    """Context: the guard ignores torch calls (the engine moving its own bytes)."""

    def __init__(self, guard: ReadGuard):
        self.guard = guard

    def __enter__(self) -> None:
        self.guard.paused += 1

    def __exit__(self, *exc: object) -> None:
        self.guard.paused -= 1
