"""Tensors of a checkpoint that are written or read one at a time.

An offloaded run's state (every chunk's fp32 master and optimizer state) is larger than its host
budget, so a checkpoint never holds it whole:
- `Deferred` names a tensor to write: its dtype, its shape, and `open()`, a context manager that
  brings its bytes into memory (a CPU tensor) only while the writer copies them out: the home
  tensor itself when it is in host memory, one chunk's scratch buffer when it is on NVMe;
- a stored tensor (cli.tensorfile.Stored) is the reverse, read into its destination by
  `read_into` (or whole by `load`); `fill` takes either it or a tensor.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class Deferred:
    """A tensor whose bytes are produced when a writer asks for them."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    open: Callable[[], AbstractContextManager[torch.Tensor]]

    def materialize(self) -> torch.Tensor:
        """A CPU copy of its own."""
        with self.open() as t:
            return t.to("cpu", copy=True)


def materialize(obj: Any) -> Any:
    """`obj` (nested dicts and lists) with every Deferred replaced by a CPU copy."""
    if isinstance(obj, Deferred):
        return obj.materialize()
    if isinstance(obj, dict):
        return {k: materialize(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [materialize(v) for v in obj]
    return obj


def fill(dst: torch.Tensor, src: Any) -> None:
    """Copy `src` (a tensor, or a stored one with `read_into`/`load`) into `dst`, reading a
    stored one straight into a contiguous CPU `dst`."""
    if isinstance(src, torch.Tensor):
        dst.copy_(src)
    elif dst.device.type == "cpu" and dst.is_contiguous():
        src.read_into(dst)
    else:
        dst.copy_(src.load())


def load(src: Any) -> torch.Tensor:
    """`src` as a tensor in memory (a stored one read whole)."""
    return src if isinstance(src, torch.Tensor) else src.load()
