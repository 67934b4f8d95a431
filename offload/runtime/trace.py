"""The access trace: which chunk is acquired and released at which moment of a step.

The warm-up step records it; `plan_schedule` turns it into fetch/evict actions per event and
later steps carry those out. If the model's control flow changes (another chunk shows up at a
moment than the trace says), the schedule is dropped and the next step records a new trace,
rather than prefetching the wrong chunks or deadlocking.
"""

from __future__ import annotations

import enum
from typing import Callable, Mapping

from ..plan.schedule import ACQUIRE, Actions, first_resident, plan_schedule


class Phase(enum.StrEnum):
    """Where a step is; a str, so a timeline's rows and a trace's phases read as plain names."""

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"
    UPDATE = "update"
    EVAL = "eval"  # off the trace: evaluation is not part of a step


class TraceFollower:
    """Walks a step along a schedule, or records a new trace when there is none (or it broke)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] | None = None  # the trace being followed
        self.phases: list[Phase] = []
        self.actions: list[Actions] | None = None
        self._recording: list[tuple[str, int]] | None = []
        self._rec_phases: list[Phase] = []
        self.pos = -1
        self.retraces = 0
        self.first: tuple[int, ...] = ()  # the chunks the schedule holds right after its first event

    @property
    def following(self) -> bool:
        return self.actions is not None

    def start_step(self) -> None:
        self.pos = -1
        if self.actions is None:
            self._recording, self._rec_phases = [], []

    def event(self, kind: str, cid: int, phase: Phase) -> Actions | None:
        """Note an event; returns the scheduled actions for it (None when not following)."""
        self.pos += 1
        if self.actions is not None:
            if self.pos < len(self.events) and self.events[self.pos] == (kind, cid):
                return self.actions[self.pos]
            self.drop()  # control flow changed: stop following, record next step
            return None
        if self._recording is not None:
            self._recording.append((kind, cid))
            self._rec_phases.append(phase)
        return None

    def drop(self) -> None:
        self.events = self.actions = None
        self.first = ()
        self._recording = None
        self.retraces += 1

    def reset(self) -> None:
        """Forget the trace (the units of residency changed): the next step records a new one."""
        self.events = self.actions = None
        self.first = ()
        self._recording = None

    def end_step(self) -> None:
        if self.actions is not None and self.pos + 1 != len(self.events):
            self.drop()
        elif self.actions is None and self._recording:
            self.events, self.phases = self._recording, self._rec_phases
        self._recording = None

    def reschedule(self, *, keep: Callable[[int], bool], sizes: Mapping[int, int], capacity: int,
                   lookahead: int) -> None:
        """(Re)compute the schedule for the recorded trace, without chunks that no longer stream."""
        if self.events is None:
            return
        kept = [(e, p) for e, p in zip(self.events, self.phases) if keep(e[1])]
        self.events = [e for e, _ in kept]
        self.phases = [p for _, p in kept]
        self.actions = plan_schedule(self.events, sizes=sizes, capacity=capacity, lookahead=lookahead) \
            if any(k == ACQUIRE for k, _ in self.events) else None
        if self.actions is None:
            self.events = None
        # (kept, not recomputed: read at each step's start and end)
        self.first = () if self.actions is None or not self.events else first_resident(self.events, self.actions)
