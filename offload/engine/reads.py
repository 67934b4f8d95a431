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

from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

_PROPERTIES = ("shape", "dtype", "device", "ndim", "requires_grad", "is_leaf", "grad", "grad_fn", "layout",
               "is_cuda", "is_meta", "is_sparse", "is_quantized", "_version", "nbytes", "itemsize")
_METHODS = ("size", "dim", "numel", "nelement", "stride", "element_size", "is_floating_point", "is_complex",
            "is_contiguous", "storage_offset", "__len__", "requires_grad_", "get_device")
NO_READ = frozenset([getattr(torch.Tensor, n).__get__ for n in _PROPERTIES]
                    + [getattr(torch.Tensor, n) for n in _METHODS])


def _params(args: tuple, kwargs: dict) -> Iterator[torch.nn.Parameter]:
    """Parameters among the arguments, and inside list/tuple arguments (e.g. an RNN's weights)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.nn.Parameter):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.nn.Parameter):
                    yield b


class ReadGuard(TorchFunctionMode):
    """`on_read(p)` for every parameter a torch call receives, unless `paused` (the engine's
    own bookkeeping) or the call reads no values. `on_read` does nothing when p is resident."""

    def __init__(self, on_read: Callable[[torch.nn.Parameter], None]):
        super().__init__()
        self.on_read = on_read
        self.paused = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not self.paused and func not in NO_READ:
            for p in _params(args, kwargs):
                self.on_read(p)
        return func(*args, **kwargs)


class Paused:
    """Context: the guard ignores torch calls (the engine moving its own bytes)."""

    def __init__(self, guard: ReadGuard):
        self.guard = guard

    def __enter__(self) -> None:
        self.guard.paused += 1

    def __exit__(self, *exc: object) -> None:
        self.guard.paused -= 1
