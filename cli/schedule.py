"""Learning-rate schedules: linear warmup, then cosine / linear decay or constant."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..offload.core.errors import TierwiseError

SCHEDULES = ("cosine", "linear", "constant")


@dataclass(frozen=True, kw_only=True)
class LRSchedule:
    kind: str
    """One of SCHEDULES."""
    base_lr: float
    """Peak learning rate, reached at the end of warmup."""
    warmup_steps: int
    """Steps of linear warmup from base_lr / (warmup_steps + 1)."""
    total_steps: int
    """Optimizer steps of the whole run (decay reaches min_ratio * base_lr at the end)."""
    min_ratio: float = 0.1
    """Floor of the decay as a fraction of base_lr."""

    def __post_init__(self):
        if self.kind not in SCHEDULES:
            raise TierwiseError(f"unknown --schedule {self.kind!r}: use one of {SCHEDULES}")
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise TierwiseError("--warmup-steps must be >= 0 and the run at least 1 step")

    def lr_at(self, step: int) -> float:
        """Learning rate for optimizer step `step` (0-based)."""
        if step < self.warmup_steps:
            return self.base_lr * (step + 1) / (self.warmup_steps + 1)
        if self.kind == "constant":
            return self.base_lr
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        if self.kind == "cosine":
            scale = 0.5 * (1 + math.cos(math.pi * progress))
        else:
            scale = 1 - progress
        return self.base_lr * (self.min_ratio + (1 - self.min_ratio) * scale)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "base_lr": self.base_lr, "warmup_steps": self.warmup_steps,
                "total_steps": self.total_steps, "min_ratio": self.min_ratio}
