"""Host-side homes (pure): which tier holds each kind of each streamed chunk.

Shared by the engine (which allocates accordingly) and the planner (which predicts from it),
so that plan and measurement agree by construction.

Policy, CXL-aware:
1. Gradients come first in host DRAM (every backward accumulates into them); when DRAM is
   short they overflow to CXL, then NVMe, where a chunk's gradients are accumulated in a host
   staging buffer while they arrive and written out once complete.
2. Compute copies (bf16 runs only; in fp32 the master is the compute copy) are
   latency-tolerant: they prefer CXL, then DRAM.
3. The optimizer's working set fills the DRAM that is left, kind by kind: first the masters
   that are also the compute source (fp32 runs: on NVMe such a master is read in forward, read
   again in backward once evicted, and written by the update, and the compute waits for its
   reads), then the states (read and written every step, off the compute's path), then the
   other masters.
4. What does not fit overflows to CXL, then NVMe (when an --nvme-path is given).
When anything lives on NVMe, host DRAM also holds bounce buffers (4096-byte aligned): two
update sets, each the largest chunk's NVMe-resident bytes (the update works on one while the
other is read or written); one fetch staging buffer for the largest NVMe-resident compute
source (compute copy, or master in fp32 runs) streamed to the device; and two gradient staging
buffers when gradients live on NVMe.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.errors import InfeasibleBudget
from ..core.units import format_size

KIND_ORDER = ("grad", "state", "master", "compute")


@dataclass(frozen=True, kw_only=True)
class Homes:
    """tiers[c][kind] for every streamed chunk c; bytes per tier per kind; host bounce bytes."""

    tiers: dict[int, dict[str, str]]
    bytes: dict[str, dict[str, int]]
    bounce: int


def _fill(kinds: dict[int, dict[str, int]], order: list[tuple[int, str]], tier: str,
          free: dict[str, float], out: dict[int, dict[str, str]]) -> list[tuple[int, str]]:
    left = []
    for cid, kind in order:
        n = kinds[cid][kind]
        if n <= free[tier]:
            free[tier] -= n
            out[cid][kind] = tier
        else:
            left.append((cid, kind))
    return left


def assign_homes(*, kinds: dict[int, dict[str, int]], host: "int | None", cxl: "int | None" = None,
                 nvme: bool = False) -> Homes:
    """Place the kinds of the streamed chunks `kinds` ({chunk: {kind: bytes}}).

    host/cxl: byte budgets (None: host unlimited / no cxl tier); nvme: an NVMe tier exists.
    Raises InfeasibleBudget with the smallest host budget that would work.
    """
    out, bounce, fits = _place(kinds, host=host, cxl=cxl, nvme=nvme)
    if not fits:
        _refuse(kinds, host=host, cxl=cxl, nvme=nvme)
    totals: dict[str, dict[str, int]] = {}
    for cid, d in out.items():
        for kind, tier in d.items():
            totals.setdefault(tier, {}).setdefault(kind, 0)
            totals[tier][kind] += kinds[cid][kind]
    return Homes(tiers=out, bytes=totals, bounce=bounce)


def _place(kinds: dict[int, dict[str, int]], *, host: "int | None", cxl: "int | None",
           nvme: bool) -> tuple[dict[int, dict[str, str]], int, bool]:
    """assign_homes' placement: (tiers, bounce bytes, whether it fits)."""
    inf = float("inf")
    upper = bounce_bytes(kinds, {c: dict.fromkeys(k, "nvme") for c, k in kinds.items()})
    reserve = 0
    # Reserve for the bounce buffers what the placement made under the last reserve needs,
    # until that suffices (reserves only grow, up to `upper`: everything on NVMe).
    for attempt in range(6):
        free = {"host": (inf if host is None else host - reserve), "cxl": 0 if cxl is None else cxl,
                "nvme": inf if nvme else 0}
        out: dict[int, dict[str, str]] = {c: {} for c in kinds}
        by_kind = {k: [(c, k) for c in kinds if k in kinds[c]] for k in KIND_ORDER}
        grads_left = _fill(kinds, by_kind["grad"], "host", free, out)
        compute_left = _fill(kinds, by_kind["compute"], "cxl", free, out)
        sources = [(c, k) for c, k in by_kind["master"] if "compute" not in kinds[c]]
        others = [(c, k) for c, k in by_kind["master"] if "compute" in kinds[c]]
        working_left = _fill(kinds, sources + by_kind["state"] + others, "host", free, out)
        compute_left = _fill(kinds, compute_left, "host", free, out)
        rest = _fill(kinds, grads_left + working_left + compute_left, "cxl", free, out)
        rest = _fill(kinds, rest, "nvme", free, out)
        bounce = bounce_bytes(kinds, out)
        if rest or bounce <= reserve:
            break
        reserve = upper if attempt >= 4 else max(bounce, reserve)
    host_used = sum(kinds[c][k] for c, d in out.items() for k, t in d.items() if t == "host")
    return out, bounce, not rest and (host is None or host_used + bounce <= host)


def _up(n: int) -> int:
    return (n + 4095) // 4096 * 4096


@dataclass(frozen=True)
class BounceSizes:
    """Bytes of each NVMe bounce buffer (see the module docstring): THE sizes, counted here for
    the planner and allocated from here by the engine (runtime.swapping.Bounce)."""

    update_set: int  # one of two; the largest chunk's NVMe-resident kinds, each 4096-aligned
    fetch: int  # the largest NVMe-resident compute source (compute copy, or master in fp32)
    grad: int  # one of two (0: no gradient on NVMe)

    @property
    def total(self) -> int:
        return 2 * self.update_set + self.fetch + 2 * self.grad


def bounce_sizes(kinds: dict[int, dict[str, int]], tiers: dict[int, dict[str, str]]) -> BounceSizes:
    """The bounce buffers of this placement ({chunk: {kind: bytes}}, {chunk: {kind: tier}})."""
    def on_nvme(c: int, kind: str) -> bool:
        return tiers.get(c, {}).get(kind) == "nvme"

    def source(c: int) -> str:
        return "compute" if "compute" in kinds[c] else "master"

    return BounceSizes(
        update_set=max((sum(_up(v) for k, v in kinds[c].items() if on_nvme(c, k)) for c in kinds), default=0),
        fetch=max((_up(kinds[c][source(c)]) for c in kinds if on_nvme(c, source(c))), default=0),
        grad=max((_up(kinds[c]["grad"]) for c in kinds if on_nvme(c, "grad")), default=0))


def bounce_bytes(kinds: dict[int, dict[str, int]], tiers: dict[int, dict[str, str]]) -> int:
    """Host bytes of NVMe bounce buffers for this placement (see the module docstring)."""
    return bounce_sizes(kinds, tiers).total


def minimum_host(kinds: dict[int, dict[str, int]], *, cxl: "int | None", nvme: bool) -> int:
    """The smallest host budget with which assign_homes succeeds. With NVMe: searched by
    bisection below the bounce buffers of everything on NVMe (or everything in DRAM, where that
    is less: no NVMe, no bounce buffers), both of which fit; keeping part in DRAM often needs
    less, as the bounce buffers shrink with what is on NVMe."""
    total = sum(sum(kk.values()) for kk in kinds.values())
    if not nvme:
        return max(0, total - (cxl or 0))
    lo, hi = 0, min(total, bounce_bytes(kinds, {c: dict.fromkeys(k, "nvme") for c, k in kinds.items()}))
    while lo < hi:
        mid = (lo + hi) // 2
        if _place(kinds, host=mid, cxl=cxl, nvme=True)[2]:
            hi = mid
        else:
            lo = mid + 1
    return hi


def _refuse(kinds: dict[int, dict[str, int]], *, host: "int | None", cxl: "int | None", nvme: bool) -> None:
    need = minimum_host(kinds, cxl=cxl, nvme=nvme)
    hint = "" if nvme else " or give --nvme-path to spill optimizer state and weights to disk"
    raise InfeasibleBudget(
        f"host budget {format_size(host or 0)} cannot hold the streamed chunks: at least "
        f"{format_size(need)} ({need} B) needed; raise --cpu-mem{hint}",
        minimum={"host": need},
    )


def beside_reserved(e: InfeasibleBudget, *, room: "int | None", reserved: int, what: str) -> InfeasibleBudget:
    """A refusal of the chunks' homes within `room`, the host budget less `reserved` bytes kept
    for `what`: the same, naming the whole budget and the whole budget's minimum."""
    if not reserved or room is None or "host" not in e.minimum:
        return e
    was, need = e.minimum["host"], e.minimum["host"] + reserved
    msg = str(e).replace(f"host budget {format_size(room)}", f"host budget {format_size(room + reserved)} "
                         f"({format_size(reserved)} of it for {what})", 1)
    msg = msg.replace(f"{format_size(was)} ({was} B)", f"{format_size(need)} ({need} B)", 1)
    return InfeasibleBudget(msg, minimum={**e.minimum, "host": need})
