"""Per-parameter cost of an optimizer step, for the performance model."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence


@dataclass(frozen=True, kw_only=True)
class OptimizerCost:
    """What one optimizer step costs per parameter (averaged over a large tensor)."""

    state_bytes_per_param: float
    """Bytes of optimizer state kept per parameter (between steps)."""
    master_bytes_per_param: float = 4.0
    """Bytes of the master copy of the parameter (4 for an fp32 master)."""
    read_bytes_per_param: float
    """Bytes read per parameter by one step (param, grad, state)."""
    write_bytes_per_param: float
    """Bytes written per parameter by one step (param, state)."""
    flops_per_param: float
    """Arithmetic operations per parameter per step (rough, for the roofline)."""
    needs_grad: bool = True
    """False for zeroth-order methods: no gradient buffer, two forward passes instead."""
    note: str = ""
    """Free text, e.g. that the state scales with a rank."""
    state_bytes: Optional[Callable[[Sequence[int], Optional[int]], float]] = None
    """Exact state bytes of one tensor: state_bytes(shape, rank); None = numel * per-param."""

    def __post_init__(self) -> None:
        for name in ("state_bytes_per_param", "master_bytes_per_param", "read_bytes_per_param",
                     "write_bytes_per_param", "flops_per_param"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def tensor_state_bytes(self, shape: Sequence[int], rank: Optional[int] = None) -> float:
        """State bytes of one tensor of this shape (uses state_bytes when given)."""
        if self.state_bytes is not None:
            return float(self.state_bytes(tuple(shape), rank))
        n = 1
        for d in shape:
            n *= int(d)
        return n * self.state_bytes_per_param
