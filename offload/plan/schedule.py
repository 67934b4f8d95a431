"""The schedule (pure): from an access trace and a byte budget, what to fetch and evict when.

Input: the events of one step as the warm-up recorded them — ("acquire", chunk) when a module
starts needing a chunk, ("release", chunk) when it stops — the bytes of each chunk and the
capacity of the device cache. Output: for every event, the chunks to evict first and the
chunks to fetch (on demand, for the chunk acquired now; ahead, for upcoming acquisitions).

Eviction is Belady's: the unpinned chunk whose next acquisition lies furthest in the future
goes first (optimal for a known sequence). A prefetch looks ahead along the trace and starts
fetching upcoming chunks in order while it can make room without evicting any chunk needed
sooner than the one it fetches; it stops at the first one it cannot fetch, so fetches stay
in use order. After the step's update the cached compute copies are stale, so each step is
planned from an empty cache: a chunk with no later acquisition in the step is never needed
again. (The engine may begin a step with the chunks held after its first event already there,
kept over the last step's end: offload.engine.residency.keep.)
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ..core.options import LOOKAHEAD

ACQUIRE, RELEASE = "acquire", "release"


@dataclass(frozen=True)
class Actions:
    """What to do at one event, in this order: evict, fetch (the chunk acquired now, if
    absent), then make room for prefetches (prefetch_evict) and start them (prefetch)."""

    evict: tuple[int, ...] = ()
    fetch: tuple[int, ...] = ()
    prefetch_evict: tuple[int, ...] = ()
    prefetch: tuple[int, ...] = ()


@dataclass
class _Sim:
    sizes: Mapping[int, int]
    capacity: int
    uses: dict[int, list[int]]
    resident: dict[int, int] = field(default_factory=dict)  # chunk -> pin count
    used: int = 0

    def next_use(self, cid: int, now: int) -> float:
        pos = self.uses.get(cid, [])
        i = bisect.bisect_right(pos, now)
        return pos[i] if i < len(pos) else math.inf

    def victims(self, need: int, now: int, *, sooner_than: float) -> list[int] | None:
        """Unpinned chunks to evict (furthest next use first) so that `need` bytes fit."""
        free = self.capacity - self.used
        if free >= need:
            return []
        chosen = []
        for cid in sorted((c for c, pins in self.resident.items() if pins == 0),
                          key=lambda c: (self.next_use(c, now), c), reverse=True):
            if self.next_use(cid, now) <= sooner_than:
                break
            chosen.append(cid)
            free += self.sizes[cid]
            if free >= need:
                return chosen
        return None

    def load(self, cid: int) -> None:
        self.resident[cid] = 0
        self.used += self.sizes[cid]

    def drop(self, cid: int) -> None:
        del self.resident[cid]
        self.used -= self.sizes[cid]


def plan_schedule(events: Sequence[tuple[str, int]], *, sizes: Mapping[int, int], capacity: int,
                  lookahead: int = LOOKAHEAD) -> list[Actions]:
    """One Actions per event. Raises ValueError if a single acquisition cannot fit."""
    uses: dict[int, list[int]] = {}
    for t, (kind, cid) in enumerate(events):
        if kind == ACQUIRE:
            uses.setdefault(cid, []).append(t)
    sim = _Sim(sizes=sizes, capacity=capacity, uses=uses)
    upcoming = [t for t, (kind, _) in enumerate(events) if kind == ACQUIRE]
    out: list[Actions] = []
    for t, (kind, cid) in enumerate(events):
        if kind == RELEASE:
            sim.resident[cid] -= 1
            out.append(Actions())
            continue
        evict: list[int] = []
        fetch: tuple[int, ...] = ()
        if cid not in sim.resident:
            chosen = sim.victims(sizes[cid], t, sooner_than=-math.inf)
            if chosen is None:
                raise ValueError(f"chunk {cid} ({sizes[cid]} B) cannot fit: capacity {capacity} B, "
                                 f"pinned {sim.used} B")
            for v in chosen:
                sim.drop(v)
            evict += chosen
            sim.load(cid)
            fetch = (cid,)
        sim.resident[cid] += 1
        ahead: list[int] = []
        pre = _prefetch(sim, events, upcoming, t, lookahead, ahead)
        out.append(Actions(evict=tuple(evict), fetch=fetch, prefetch_evict=tuple(ahead), prefetch=tuple(pre)))
    return out


def _prefetch(sim: _Sim, events: Sequence[tuple[str, int]], upcoming: list[int], now: int,
              lookahead: int, evict: list[int]) -> list[int]:
    """Fetch the next not-resident chunks of the trace, in order, while room can be made."""
    pre: list[int] = []
    seen: set[int] = set()
    for j in range(bisect.bisect_right(upcoming, now), len(upcoming)):  # (no slice: a copy per event)
        t = upcoming[j]
        cid = events[t][1]
        if cid in seen:
            continue
        seen.add(cid)
        if len(seen) > lookahead:
            break
        if cid in sim.resident:
            continue
        chosen = sim.victims(sim.sizes[cid], now, sooner_than=t)
        if chosen is None:
            break
        for v in chosen:
            sim.drop(v)
        evict += chosen
        sim.load(cid)
        pre.append(cid)
    return pre


def first_resident(events: Sequence[tuple[str, int]], actions: Sequence[Actions]) -> tuple[int, ...]:
    """The chunks the schedule holds right after its first event (the step's first acquisition,
    then the prefetches it starts), in that order: a step may begin with these resident without
    upsetting the schedule's room (offload.engine.residency.keep)."""
    if not actions or not events or events[0][0] != ACQUIRE:
        return ()
    a = actions[0]
    out: dict[int, None] = {}
    for c in (events[0][1], *a.prefetch):  # (a loop: a generator is a Python call per chunk)
        if c not in a.prefetch_evict:
            out[c] = None
    return tuple(out)


def kept_over_end(events: Sequence[tuple[str, int]], actions: Sequence[Actions]) -> list[int]:
    """Of `first_resident`, the chunks the schedule still holds after its last event: a step that
    keeps them over its end (those unchanged by its update: offload.engine.residency) begins the
    next without fetching them."""
    held: set[int] = set()
    for a in actions:
        held.difference_update(a.evict)
        held.update(a.fetch)
        held.difference_update(a.prefetch_evict)
        held.update(a.prefetch)
    return [c for c in first_resident(events, actions) if c in held]


def resident_bytes(actions: Sequence[Actions], sizes: Mapping[int, int]) -> list[int]:
    """Bytes resident after each event if `actions` are carried out (for checks and plots)."""
    used, out = 0, []
    for a in actions:
        used -= sum(sizes[c] for c in a.evict + a.prefetch_evict)
        used += sum(sizes[c] for c in a.fetch + a.prefetch)
        out.append(used)
    return out
