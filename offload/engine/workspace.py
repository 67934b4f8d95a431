"""Device bytes the ledger does not book, measured on CUDA in the warm-up step.

The ledger books chunks, gradients in flight, saved activations and buffers. A step also
allocates transient tensors nobody saves: matmul outputs, the logits and their fp32 copy in
the loss, activation gradients in backward, plus the caching allocator's rounding and
fragmentation. On an H200 (0.85B Llama, 4 x 1024 tokens, 32k vocabulary) they were 1.8 GiB on
top of a 6 GiB budget the ledger filled: an allocator capped at the budget ran out of memory.
So the warm-up step streams through the smallest window, reads the allocator's peak, and the
placement then leaves room for what the ledger missed plus a margin (offload.plan.needs.
workspace_margin, which the planner leaves too; a placement made up front from estimated
activations leaves the margin from the start). The simulated device has no allocator to ask:
there the ledger books the loss's transients itself (`book_loss`: perfmodel.loss_workspace, as
measured against RSS), from the loss's start until the gradient of the head's input is made
(the loss's backward done), as activations: their worst moment is the activations' (the end of
forward), and the activations' peak is what the placement leaves room for (the planner adds
them there too: perfmodel.activation_bytes). Resets CUDA's peak memory statistics once, at
the warm-up.
Fragmentation is what the margin covers; the CLI turns on the allocator's expandable segments
(PYTORCH_CUDA_ALLOC_CONF) to keep it small; a library user sets that variable before CUDA starts.
"""

from __future__ import annotations

import threading

import torch

from ..plan.needs import workspace_margin  # (one place for the margin: the planner leaves it too)
from ..runtime.ledger import Ledger



class Workspace:
    def __init__(self, device: torch.device, ledger: Ledger):
        self.cuda = device.type == "cuda"
        self.device, self.ledger = device, ledger
        self.outside = 0  # bytes the process held on the device that are not the engine's
        self.missed = 0  # the most the allocator held beside the ledger, over the measured passes
        self.bytes = 0  # that plus the margin, once measured
        self.loss = 0  # the simulated device: the loss's transients booked now (as "activation")
        self._lock = threading.Lock()  # (released from autograd's thread)

    def book_loss(self, nbytes: int) -> None:
        """The simulated device: `nbytes` of the loss's transients booked now (more or fewer than
        before: the loss's stages, headloss.workspace)."""
        if self.cuda:
            return
        with self._lock:
            if nbytes > self.loss:
                self.ledger.reserve("gpu", "activation", nbytes - self.loss)
            elif nbytes < self.loss:
                self.ledger.release("gpu", "activation", self.loss - nbytes)
            self.loss = nbytes

    def release_loss(self, *_: object) -> None:
        """The loss's transients are gone (a hook on the head input's gradient; the end of backward)."""
        with self._lock:
            if self.loss:
                self.ledger.release("gpu", "activation", self.loss)
                self.loss = 0

    def begin(self) -> None:
        """At the start of a measured pass (Engine.measure, the warm-up step)."""
        if not self.cuda:
            return
        torch.cuda.synchronize(self.device)
        self.outside = torch.cuda.memory_allocated(self.device) - self.ledger.used("gpu")
        torch.cuda.reset_peak_memory_stats(self.device)
        self.ledger.mark()

    def end(self) -> int:
        """After a measured pass: bytes to keep free beside the ledger's (0 off CUDA). The
        largest of the passes counts (measure() may see a larger batch than the warm-up). The
        allocator's peak and the ledger's are read over the same pass but not at the same
        moment, so this is a lower bound of what was missed: the margin covers the rest."""
        if not self.cuda:
            return 0
        torch.cuda.synchronize(self.device)
        missed = (torch.cuda.max_memory_allocated(self.device) - self.outside
                  - self.ledger.peak_since_mark("gpu"))
        self.missed = max(self.missed, missed)
        self.bytes = max(self.missed, 0) + workspace_margin(self.ledger.budgets["gpu"])
        return self.bytes
