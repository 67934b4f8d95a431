"""Link emulation: a copy that takes as long as it would over a link of given bandwidth.

On the simulated device every tier is host memory, so a copy is a memcpy at ~40 GB/s. To
measure overlap of transfers with compute on a CPU-only machine, a Link sleeps after the copy
until nbytes / bandwidth seconds have passed. The sleep releases the GIL, as a DMA engine
leaves the CPU free.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch


@dataclass(kw_only=True)
class Link:
    """A one-way link. `bandwidth` in bytes/s; None means unthrottled."""

    name: str
    bandwidth: float | None = None
    bytes_moved: int = 0
    busy_seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst.copy_(src), then wait out the link time of src's bytes."""
        start = time.perf_counter()
        dst.copy_(src)
        nbytes = src.numel() * src.element_size()
        self.wait_for(nbytes, start)

    def wait_for(self, nbytes: int, start: float) -> None:
        """Account `nbytes` moved since `start`; sleep out what the bandwidth still owes. (Any
        thread: a lane's worker, or one that copies directly.)"""
        if self.bandwidth:
            left = start + nbytes / self.bandwidth - time.perf_counter()
            if left > 0:
                time.sleep(left)
        with self._lock:
            self.bytes_moved += nbytes
            self.busy_seconds += time.perf_counter() - start
