"""The access trace: which chunk is used at which moment of a step.

The warm-up step records it; later steps follow it. `next_use` answers "when is chunk c
needed next?" for Belady eviction and for prefetch look-ahead. The trace is cyclic: a chunk
not used again in this step is next used in the next step. If the model's control flow
changes (another chunk shows up at a moment than the trace says), the trace is dropped and
recorded again on the next step, rather than prefetching the wrong chunks or deadlocking.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Callable


@dataclass(kw_only=True)
class AccessTrace:
    """A recorded sequence of chunk accesses with the phase of each moment."""

    chunks: list[int] = field(default_factory=list)
    phases: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._positions: dict[int, list[int]] = {}
        for i, c in enumerate(self.chunks):
            self._positions.setdefault(c, []).append(i)

    def __len__(self) -> int:
        return len(self.chunks)

    def next_use(self, cid: int, after: int) -> float:
        """The first moment > `after` at which `cid` is used (cyclic); inf if never."""
        pos = self._positions.get(cid)
        if not pos:
            return math.inf
        i = bisect.bisect_right(pos, after)
        return pos[i] if i < len(pos) else pos[0] + len(self.chunks)


class TraceFollower:
    """Walks a step along a trace, or records a new one when there is none (or it broke)."""

    def __init__(self) -> None:
        self.trace: AccessTrace | None = None
        self._recording: AccessTrace | None = AccessTrace()
        self.pos = -1
        self.retraces = 0

    @property
    def following(self) -> bool:
        return self.trace is not None

    def start_step(self) -> None:
        self.pos = -1
        if self.trace is None:
            self._recording = AccessTrace()

    def access(self, cid: int, phase: str) -> None:
        self.pos += 1
        if self.trace is not None:
            if self.pos >= len(self.trace) or self.trace.chunks[self.pos] != cid:
                self.trace = None  # control flow changed: stop following, record next step
                self.retraces += 1
                self._recording = None
            return
        if self._recording is not None:
            self._recording.chunks.append(cid)
            self._recording.phases.append(phase)

    def end_step(self) -> None:
        if self.trace is not None and self.pos + 1 != len(self.trace):
            self.trace = None
            self.retraces += 1
        elif self.trace is None and self._recording is not None and self._recording.chunks:
            self.trace = AccessTrace(chunks=self._recording.chunks, phases=self._recording.phases)
        self._recording = None

    def keep_only(self, keep: "Callable[[int], bool]") -> None:
        """Drop accesses of chunks that no longer stream (they became device-resident)."""
        if self.trace is not None:
            kept = [(c, p) for c, p in zip(self.trace.chunks, self.trace.phases) if keep(c)]
            self.trace = AccessTrace(chunks=[c for c, _ in kept], phases=[p for _, p in kept]) if kept else None

    def next_use(self, cid: int) -> float:
        return math.inf if self.trace is None else self.trace.next_use(cid, self.pos)

    def upcoming(self, depth: int) -> list[tuple[int, int]]:
        """The next `depth` (moment, chunk) pairs of the trace after now, wrapping into the next step."""
        if self.trace is None:
            return []
        n = len(self.trace)
        return [((self.pos + k), self.trace.chunks[(self.pos + k) % n]) for k in range(1, min(depth, n) + 1)]
