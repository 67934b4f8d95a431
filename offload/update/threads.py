"""How many CPU threads the optimizer update runs on.

With a GPU, the update (torch's fused AdamW, our 8-bit kernel: memory-bound OpenMP loops) runs
during backward, beside the threads that launch the backward's kernels and drive the copies.
Given every core, it starves them: on a 16-core host with an H200 the compute stream sat idle
while the launching thread waited for a core. So on CUDA the update leaves RESERVE cores to
them (a memory-bound loop loses little with two threads fewer). On the simulated device the
compute is the CPU's own work, on the threads the process was given: nothing changes there.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

RESERVE = 2  # cores left to the kernel-launching thread and the copy threads (bench switch)


@contextlib.contextmanager
def update_threads(device: torch.device) -> Iterator[None]:
    """Around an update on `device`'s host: torch's thread count lowered by RESERVE on CUDA
    (at least one thread, and only where four or more are given), restored after."""
    n = torch.get_num_threads()
    want = max(1, n - RESERVE) if device.type == "cuda" and n >= 4 else n
    if want == n:
        yield
        return
    torch.set_num_threads(want)
    try:
        yield
    finally:
        torch.set_num_threads(n)
