"""The timeline: where a step is (its Phase), the time spent per phase, and, for one step, the
bytes of every tier at each moment a module's chunks become resident (cli/plots draws it).

A moment is recorded where the engine says so (a module acquired its chunks, a parameter was
read outside its owner, the update ended), not at every ledger change: one row per event keeps
the plot readable and its size independent of the number of tensors.

Also the step's counters of the launching thread's work (`counts`, reset when a step begins):
module hook calls, gradient copies to a home tier, and host waits on device progress inside
forward and inside backward (offload.runtime.executor counts those: a copy not yet landed that
the launching thread must wait for). CI checks them on the simulated
device; the step's metrics carry them (`last_counts`, the last complete step's)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

from ..runtime.ledger import Ledger
from ..runtime.trace import Phase


COUNTS = ("hook_calls", "grad_copies", "host_waits_forward", "host_waits_backward", "saved_tensor_hooks")


class Timeline:
    """Gets the ledger (its totals are a moment's bytes)."""

    def __init__(self, ledger: Ledger):
        self.ledger = ledger
        self.phase = Phase.IDLE
        self.rows: list[dict] = []
        self.recording = False
        self.phase_times = {Phase.FORWARD.value: 0.0, Phase.BACKWARD.value: 0.0, Phase.UPDATE.value: 0.0}
        self.counts = dict.fromkeys(COUNTS, 0)
        self.last_counts: dict[str, int] = {}

    def begin_step(self, steps: int) -> None:
        """Record the second step (the first that follows a schedule), or the warm-up while no
        step has been recorded yet."""
        for k in self.counts:  # (in place: the gradient router holds the dict)
            self.counts[k] = 0
        self.recording = steps == 1 or (steps == 0 and not self.rows)
        if self.recording:
            self.rows = []

    def moment(self) -> None:
        if self.recording:
            self.rows.append({"moment": len(self.rows), "phase": self.phase, "bytes": self.ledger.totals()})

    @contextmanager
    def timed(self, phase: Phase) -> Iterator[None]:
        """Enter `phase`; its time counts when the block ends without an error."""
        self.phase = phase
        t0 = time.perf_counter()
        yield
        self.phase_times[phase.value] += time.perf_counter() - t0

    def end_step(self) -> None:
        self.last_counts = dict(self.counts)

    def reset(self) -> None:
        self.phase, self.rows = Phase.IDLE, []
