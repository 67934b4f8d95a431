"""Parameter reads the module hooks do not see.

Module hooks make a module's *own* parameters resident around its forward. Some modules read
parameters they do not own: nn.MultiheadAttention reads `out_proj.weight` through
F.multi_head_attention_forward (out_proj's forward never runs), a head tied through
F.linear(h, emb.weight) reads the embedding's weight in its parent's forward. An absent
parameter's placeholder must never reach such a computation.

ReadGuard is a TorchFunctionMode, active while the engine runs a forward (the step's,
a block's recompute, evaluation): it sees every torch call with its arguments. A parameter
argument whose chunk is not pinned is handed to `on_read`, which makes the chunk resident for
the innermost module whose forward is running (released when that forward ends, like the
module's own chunks), or refuses with an error naming the parameter and the module.
Metadata queries (shape, dtype, ...) read no values and pass.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch.overrides import TorchFunctionMode

_PROPERTIES = ("shape", "dtype", "device", "ndim", "requires_grad", "is_leaf", "grad", "grad_fn", "layout",
               "is_cuda", "is_meta", "is_sparse", "is_quantized", "_version", "nbytes", "itemsize")
_METHODS = ("size", "dim", "numel", "nelement", "stride", "element_size", "is_floating_point", "is_complex",
            "is_contiguous", "storage_offset", "__len__", "requires_grad_", "get_device")
NO_READ = frozenset([getattr(torch.Tensor, n).__get__ for n in _PROPERTIES]
                    + [getattr(torch.Tensor, n) for n in _METHODS])


class ReadGuard(TorchFunctionMode):
    """`on_read(p)` for every watched parameter a torch call receives (directly, or in a list or
    tuple argument such as an RNN's weights), unless `paused` (the engine's own bookkeeping) or
    the call reads no values. `on_read` does nothing when p is resident. `watch(params)` names
    the parameters (by identity: a Parameter's own hash and isinstance check are Python calls,
    and this runs for every torch call of a forward)."""

    def __init__(self, on_read: Callable[[torch.nn.Parameter], None]):
        super().__init__()
        self.on_read = on_read
        self.paused = 0
        self.ids: set[int] = set()

    def watch(self, params: Iterable[torch.nn.Parameter]) -> None:
        self.ids = {id(p) for p in params}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if kwargs is None:
            kwargs = {}
        if not self.paused and func not in NO_READ:
            ids = self.ids
            for a in (*args, *kwargs.values()) if kwargs else args:
                if id(a) in ids:
                    self.on_read(a)
                elif isinstance(a, (list, tuple)):  # (a C check for builtin types; namedtuples too)
                    for b in a:
                        if id(b) in ids:
                            self.on_read(b)
        return func(*args, **kwargs)


class Paused:
    """Context: the guard ignores torch calls (the engine moving its own bytes)."""

    def __init__(self, guard: ReadGuard):
        self.guard = guard

    def __enter__(self) -> None:
        self.guard.paused += 1

    def __exit__(self, *exc: object) -> None:
        self.guard.paused -= 1
