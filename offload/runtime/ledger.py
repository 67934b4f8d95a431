"""The ledger: per-tier, per-kind byte accounting with hard limits and peaks.

Every byte the engine places in a tier is reserved here first; a reservation that would
pass the tier's budget raises BudgetExceeded (it never spills silently). Peaks are what the
budget tests assert, so the ledger is the single source of truth for "how much is where".
Kinds: "compute" (parameters in the compute dtype), "grad", "master", "state",
"activation", "buffer" (module buffers, bounce buffers), "workspace", "shared" (this rank's part
of a frozen base the local ranks share: offload.engine.sharedbase).
"""

from __future__ import annotations

import threading
from collections import defaultdict

from ..core.errors import BudgetExceeded
from ..core.vocab import TIERS



class Ledger:
    """Byte accounting for the tiers in `budgets` ({tier: bytes or None for unlimited})."""

    def __init__(self, budgets: dict[str, "int | None"]):
        unknown = set(budgets) - set(TIERS)
        if unknown:
            raise ValueError(f"unknown tiers {sorted(unknown)}; known: {TIERS}")
        self.budgets = dict(budgets)
        self._used: dict[str, dict[str, int]] = {t: defaultdict(int) for t in budgets}
        self._total = {t: 0 for t in budgets}
        self._peak = {t: 0 for t in budgets}
        self._peak_by_kind: dict[str, dict[str, int]] = {t: {} for t in budgets}
        self._kind_peak: dict[tuple[str, str], int] = defaultdict(int)
        self._since = {t: 0 for t in budgets}  # peak since mark(), beside the run's peak
        self._lock = threading.Lock()
        self.moment_hook = None  # called after every change; the timeline recorder sets it

    def reserve(self, tier: str, kind: str, nbytes: int) -> None:
        """Account `nbytes` of `kind` in `tier`, or raise BudgetExceeded."""
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        with self._lock:
            budget = self.budgets[tier]
            used = self._total[tier]
            if budget is not None and used + nbytes > budget:
                raise BudgetExceeded(tier=tier, budget=budget, used=used, asked=nbytes, kind=kind)
            self._used[tier][kind] += nbytes
            self._total[tier] = used + nbytes
            if self._used[tier][kind] > self._kind_peak[tier, kind]:
                self._kind_peak[tier, kind] = self._used[tier][kind]
            self._since[tier] = max(self._since[tier], self._total[tier])
            if self._total[tier] > self._peak[tier]:
                self._peak[tier] = self._total[tier]
                self._peak_by_kind[tier] = {k: v for k, v in self._used[tier].items() if v}
        if self.moment_hook:
            self.moment_hook()

    def release(self, tier: str, kind: str, nbytes: int) -> None:
        with self._lock:
            have = self._used[tier][kind]
            if nbytes > have:
                raise AssertionError(f"ledger: releasing {nbytes} B of {kind} in {tier}, only {have} held")
            self._used[tier][kind] = have - nbytes
            self._total[tier] -= nbytes
        if self.moment_hook:
            self.moment_hook()

    def free(self, tier: str) -> "int | None":
        """Bytes still available in `tier` (None when unlimited)."""
        b = self.budgets[tier]
        return None if b is None else b - self._total[tier]

    def used(self, tier: str) -> int:
        return self._total[tier]

    def usage(self) -> dict[str, dict[str, int]]:
        """{tier: {kind: bytes}} now, without zero entries."""
        with self._lock:
            return {t: {k: v for k, v in kinds.items() if v} for t, kinds in self._used.items()}

    def totals(self) -> dict[str, int]:
        return dict(self._total)

    def peaks(self) -> dict[str, int]:
        return dict(self._peak)

    def peak_breakdown(self) -> dict[str, dict[str, int]]:
        """{tier: {kind: bytes}} at the moment each tier peaked."""
        return {t: dict(v) for t, v in self._peak_by_kind.items()}

    def kind_peak(self, tier: str, kind: str) -> int:
        """The most bytes of `kind` ever held in `tier` at once."""
        return self._kind_peak[tier, kind]

    def mark(self) -> None:
        """Start a second peak (peak_since_mark), leaving the run's peaks as they are."""
        with self._lock:
            self._since = dict(self._total)

    def peak_since_mark(self, tier: str) -> int:
        return self._since[tier]

    def reset_peaks(self) -> None:
        with self._lock:
            for t in self._peak:
                self._peak[t] = self._total[t]
                self._peak_by_kind[t] = {k: v for k, v in self._used[t].items() if v}
            for tier, kind in self._kind_peak:
                self._kind_peak[tier, kind] = self._used[tier][kind]
