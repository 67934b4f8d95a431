"""Placement (pure): which chunks live in the `gpu` tier whole, which are streamed.

A *gpu-home* chunk keeps every kind (compute copy, grad, master, optimizer state) in device
memory and is updated there: no transfer at all (an encoded frozen chunk keeps its encoded
bytes there and is decoded into a cache buffer per use, or where the whole model fits with it
decoded, is decoded once and kept so). A *streamed* chunk lives in host-side tiers;
its compute copy visits the device when a module needs it, its gradient goes straight back.
The device budget is spent, in this order, on: module buffers, the streaming window (the
chunks of the widest module plus one chunk being prefetched), the in-flight gradient
reserve, the activations measured in the warm-up step, gpu-home chunks (taken from the end
of the first-use order: their gradients arrive first in backward), and the rest on caching
streamed compute copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..core.errors import InfeasibleBudget
from ..core.units import format_size


@dataclass(frozen=True, kw_only=True)
class DeviceNeeds:
    """Bytes the device tier must hold besides chunks, and per-chunk sizes."""

    buffers: int
    stream_window: int  # widest module's chunks + one prefetch chunk (compute dtype)
    grad_reserve: int  # gradients on the device on their way to the host (two neighbouring chunks: offload.plan.needs)
    activations: int  # peak saved activations (measured in the warm-up step; 0 before)
    home_bytes: tuple[int, ...]  # per chunk: all kinds, if the chunk were gpu-home
    compute_bytes: tuple[int, ...]  # per chunk: its compute copy
    grad_copy: int = 0  # the largest gradient copy to the host: a chunk's gathered, or one parameter's

    @property
    def minimum(self) -> int:
        return self.buffers + self.stream_window + self.grad_reserve + self.activations

    @property
    def resident(self) -> int:
        """What a step needs with every chunk gpu-home (plan_device's whole case): no streaming
        window; below `minimum` where the chunks are fewer bytes than the window (a small model
        in large chunks)."""
        return self.buffers + self.grad_reserve + self.activations + sum(self.home_bytes)


@dataclass(frozen=True, kw_only=True)
class DevicePlan:
    gpu_home: frozenset[int]
    cache_limit: int  # bytes for streamed compute copies
    decoded_home: frozenset[int] = frozenset()  # of gpu_home, encoded chunks decoded once (their home)

    def home_cost(self, needs: DeviceNeeds) -> int:
        """Device bytes the gpu-home chunks take (a decoded home: its compute copy)."""
        return sum(needs.compute_bytes[c] if c in self.decoded_home else needs.home_bytes[c] for c in self.gpu_home)


def check_minimum(needs: DeviceNeeds, budget: "int | None", *, measured: bool, whole: bool = False) -> None:
    """Refuse a device budget below what one step needs, naming the minimum. `whole`: every chunk
    may be gpu-home, whose bytes may then be all the budget holds (`DeviceNeeds.resident`)."""
    if budget is None or budget >= needs.minimum or (whole and budget >= needs.resident):
        return
    what = "measured" if measured else ("estimated" if needs.activations else "before activations")
    least, where = needs.minimum, f"streaming window {format_size(needs.stream_window)}"
    if whole and needs.resident < least:
        least, where = needs.resident, f"every chunk on the device {format_size(sum(needs.home_bytes))}"
    raise InfeasibleBudget(
        f"gpu budget {format_size(budget)} ({budget} B) is below the minimum {format_size(least)} ({least} B) "
        f"({what}: buffers {format_size(needs.buffers)}, {where}, gradient reserve "
        f"{format_size(needs.grad_reserve)}, activations {format_size(needs.activations)}); raise --gpu-mem "
        f"or lower the batch size / sequence length",
        minimum={"gpu": least},
    )


def plan_device(needs: DeviceNeeds, budget: "int | None", *, allow_gpu_home: bool = True,
                prefer: "Sequence[int] | None" = None, decoded: "frozenset[int]" = frozenset(),
                up_front: bool = False) -> DevicePlan:
    """Choose gpu-home chunks and the cache size within `budget` (None: everything fits).
    `prefer`: the chunks that may be gpu-home, most wanted first (default: every chunk, last
    first: the first ones backward needs); the engine puts trainable chunks (LoRA adapters)
    before frozen ones. `decoded`: chunks that pass through the cache even when gpu-home (an
    encoded frozen chunk: its encoded bytes are home, each use decodes them into a cache buffer),
    so the streaming window stays reserved while any of them is placed. `up_front`: placed before
    the first step, which runs with the encoded homes on the device, each use decoded through the
    streaming window (the decoded copies replace them after it): decoded for good only where that
    step fits too."""
    n = len(needs.home_bytes)
    order = list(reversed(range(n))) if prefer is None else list(prefer)
    check_minimum(needs, budget, measured=True, whole=allow_gpu_home and len(set(order)) == n and not decoded)
    if budget is None:
        return DevicePlan(gpu_home=frozenset(order) if allow_gpu_home else frozenset(),
                          cache_limit=sum(needs.compute_bytes) + needs.stream_window,
                          decoded_home=decoded if allow_gpu_home and len(set(order)) == n else frozenset())
    spare = budget - needs.minimum
    whole = allow_gpu_home and len(set(order)) == n
    if whole and not decoded and sum(needs.home_bytes) <= spare + needs.stream_window:
        # Everything fits whole: no streaming at all, so no streaming window either.
        return DevicePlan(gpu_home=frozenset(range(n)), cache_limit=needs.stream_window)
    if whole and decoded:  # everything fits whole with the encoded chunks decoded: decoded once, for good
        every = DevicePlan(gpu_home=frozenset(range(n)), cache_limit=needs.stream_window, decoded_home=decoded)
        # the first step, placed up front: every home encoded, the cache holding decoded copies
        passing = min(needs.stream_window, sum(needs.compute_bytes[c] for c in decoded))
        first_step = sum(needs.home_bytes) + passing if up_front else 0
        if every.home_cost(needs) <= spare + needs.stream_window and first_step <= spare + needs.stream_window:
            return every
    home: set[int] = set()
    if allow_gpu_home:
        for cid in order:
            if needs.home_bytes[cid] <= spare:
                home.add(cid)
                spare -= needs.home_bytes[cid]
            else:
                break
    return DevicePlan(gpu_home=frozenset(home), cache_limit=needs.stream_window + spare)
