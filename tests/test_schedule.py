"""Pure tests of the schedule: Belady's eviction order, budgets, prefetch discipline."""

import math
import random

import pytest

from tierwise.offload.plan.schedule import (ACQUIRE, RELEASE, first_resident, kept_over_end, plan_schedule,
                                            resident_bytes)


def touches(seq):
    """Each chunk acquired and released at once (one module per chunk)."""
    return [e for c in seq for e in ((ACQUIRE, c), (RELEASE, c))]


def evictions(actions):
    return [c for a in actions for c in a.evict + a.prefetch_evict]


def test_textbook_belady_eviction_order():
    # capacity 3 unit chunks, no prefetch. Reference: at each miss evict the page used furthest ahead.
    seq = [1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5]
    acts = plan_schedule(touches(seq), sizes={c: 1 for c in range(1, 6)}, capacity=3, lookahead=0)
    assert evictions(acts)[:2] == [3, 4]  # then 1 and 2 are never used again: either may go
    assert sum(len(a.fetch) for a in acts) == 7  # the optimum for this classic trace


def brute_force_min_fetches(seq, capacity):
    """Fewest fetches over all eviction choices (demand paging, unit sizes)."""
    best = math.inf

    def go(i, cache, fetches):
        nonlocal best
        if fetches >= best:
            return
        if i == len(seq):
            best = fetches
            return
        c = seq[i]
        if c in cache:
            return go(i + 1, cache, fetches)
        if len(cache) < capacity:
            return go(i + 1, cache | {c}, fetches + 1)
        for v in cache:
            go(i + 1, (cache - {v}) | {c}, fetches + 1)

    go(0, frozenset(), 0)
    return best


@pytest.mark.parametrize("seed", range(8))
def test_belady_is_optimal_against_brute_force(seed):
    rng = random.Random(seed)
    seq = [rng.randrange(5) for _ in range(11)]
    acts = plan_schedule(touches(seq), sizes={c: 1 for c in range(5)}, capacity=3, lookahead=0)
    assert sum(len(a.fetch) for a in acts) == brute_force_min_fetches(seq, 3)


def random_trace(rng, n_chunks, length):
    """Modules touching 1-2 chunks at once: acquire both, then release both."""
    events = []
    for _ in range(length):
        group = rng.sample(range(n_chunks), rng.choice([1, 2]))
        events += [(ACQUIRE, c) for c in group] + [(RELEASE, c) for c in group]
    return events


@pytest.mark.parametrize("seed", range(20))
def test_budget_residency_and_prefetch_never_evicts_sooner(seed):
    rng = random.Random(seed)
    sizes = {c: rng.choice([1, 2, 3]) for c in range(8)}
    events = random_trace(rng, 8, 30)
    capacity = 2 * max(sizes.values()) + rng.randrange(6)
    acts = plan_schedule(events, sizes=sizes, capacity=capacity, lookahead=rng.choice([0, 2, 8]))
    assert max(resident_bytes(acts, sizes)) <= capacity
    resident = set()
    acquires = [(t, c) for t, (k, c) in enumerate(events) if k == ACQUIRE]

    def next_use(c, now):
        return next((t for t, x in acquires if x == c and t > now), math.inf)

    for t, ((kind, cid), a) in enumerate(zip(events, acts)):
        if a.prefetch_evict:  # a prefetch never evicts a chunk needed sooner than what it fetches
            first = min(next_use(p, t) for p in a.prefetch)
            assert all(next_use(v, t) > first for v in a.prefetch_evict)
        resident -= set(a.evict + a.prefetch_evict)
        resident |= set(a.fetch) | set(a.prefetch)
        if kind == ACQUIRE:
            assert cid in resident  # never computes with an absent chunk


def test_prefetch_takes_only_victims_needed_later():
    # capacity 2: A, B resident; at A's acquisition the next uses are B (soon), then C (later).
    events = touches(["A", "B", "C", "B"])
    acts = plan_schedule(events, sizes={"A": 1, "B": 1, "C": 1}, capacity=2, lookahead=4)
    # at t=0 (A demand) B is prefetched; C cannot be prefetched without evicting B (needed sooner)
    assert acts[0].fetch == ("A",) and acts[0].prefetch == ("B",)
    # at B's first use, A (never needed again) makes room for C
    assert acts[2].prefetch == ("C",) and acts[2].prefetch_evict == ("A",)
    assert all(not a.fetch for a in acts[1:])  # nothing waits on a demand fetch after the first


def test_an_acquisition_that_cannot_fit_is_an_error():
    with pytest.raises(ValueError, match="cannot fit"):
        plan_schedule([(ACQUIRE, 0), (ACQUIRE, 1)], sizes={0: 2, 1: 2}, capacity=3)


@pytest.mark.parametrize("seed", range(20))
def test_a_step_that_begins_with_the_kept_chunks_fetches_each_once_less(seed):
    """A step's trace (forward over the chunks, backward over them in reverse), its schedule
    carried out twice in a row: the second time the cache begins with what the first kept over
    its end (`kept_over_end`); every acquisition finds its chunk resident, the cache stays within
    its capacity, and each kept chunk is fetched once less, the others as often as the first time."""
    rng = random.Random(seed)
    n = rng.randrange(2, 7)
    sizes = {c: rng.choice([1, 2]) for c in range(n)}
    frozen_first = seed % 2  # (chunk 0 unused in backward, as a frozen embedding is)
    order = list(range(n)) + list(reversed(range(frozen_first, n)))
    events = [e for c in order for e in ((ACQUIRE, c), (RELEASE, c))]
    capacity = 2 * max(sizes.values()) + rng.randrange(2 * n)
    acts = plan_schedule(events, sizes=sizes, capacity=capacity, lookahead=rng.choice([0, 1, 2, 4]))
    kept = kept_over_end(events, acts)
    assert set(kept) <= set(first_resident(events, acts))

    def carry_out(start):
        resident, fetched = set(start), []
        for (kind, cid), a in zip(events, acts):
            resident -= set(a.evict)
            fetched += [c for c in a.fetch if c not in resident]
            resident |= set(a.fetch)
            resident -= set(a.prefetch_evict)
            fetched += [c for c in a.prefetch if c not in resident]
            resident |= set(a.prefetch)
            assert sum(sizes[c] for c in resident) <= capacity
            if kind == ACQUIRE:
                assert cid in resident
        return resident, fetched

    end, first = carry_out(())
    assert set(kept) <= end  # still held when the step ends
    if capacity >= sum(sizes.values()):  # nothing is ever evicted: every first chunk is kept
        assert kept == list(first_resident(events, acts)) != []
    _, second = carry_out(kept)
    assert sorted(second + kept) == sorted(first)


def test_a_first_chunk_backward_does_not_use_is_evicted_not_kept():
    """Forward over chunks 0-3, backward over 3-1 (0: a frozen embedding), room for two: the step
    begins holding 0 and 1 (1 prefetched); 0, never used again, makes room, so only 1 is kept."""
    events = touches([0, 1, 2, 3, 3, 2, 1])
    acts = plan_schedule(events, sizes={c: 1 for c in range(4)}, capacity=2, lookahead=1)
    assert first_resident(events, acts) == (0, 1)
    assert kept_over_end(events, acts) == [1]
