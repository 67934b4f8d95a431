"""What `finetune` prints besides the progress bar: measured vs planned after the warm-up step,
and the closing summary. Pure formatting; the numbers come from the engine and the planner."""

from __future__ import annotations

from ..offload.core.units import format_size
from ..offload.core.vocab import TIERS

PHASES = ("forward", "backward", "update")


def phase_delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Seconds per phase spent between two snapshots of engine.phase_times (cumulative)."""
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


def _seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


def warmup_report(*, measured_times: dict[str, float], measured_peaks: dict[str, int],
                  plan=None, plan_error: str | None = None,
                  budgets: dict[str, int | None] | None = None) -> list[str]:
    """A header and two rows: the warm-up step's phase times and peak bytes per tier as
    measured, then as the planner predicted (`plan`: an offload.plan.planner.Plan) or why there
    is no prediction.

    measured_times: {"forward": s, "backward": s, "update": s} of the warm-up step;
    measured_peaks: engine.ledger.peaks(), {tier: bytes}.
    """
    planned_peaks = dict(plan.peak) if plan is not None else {}
    tiers = [t for t in TIERS
             if measured_peaks.get(t) or planned_peaks.get(t)]
    header = ["warm-up step", *PHASES, *(f"peak {t}" for t in tiers)]

    def cells(name: str, times: dict, peaks: dict) -> list[str]:
        return [name, *(_seconds(times.get(ph)) for ph in PHASES),
                *(format_size(peaks[t]) if peaks.get(t) else "-" for t in tiers)]

    rows = [header, cells("  measured", measured_times, measured_peaks)]
    if plan is not None:
        rows.append(cells("  planned", dict(plan.phases), planned_peaks))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [r[0].ljust(widths[0]) + "".join(c.rjust(w + 3) for c, w in zip(r[1:], widths[1:]))
             for r in rows]
    gpu_budget = (budgets or {}).get("gpu")
    if gpu_budget:
        lines[1] += f"   (--gpu-mem {format_size(gpu_budget)})"
    if plan is not None:
        worst = ", for a batch with an S x S mask" if plan.padded else ""  # the run's worst step
        slow = sum(measured_times.get(ph, 0.0) for ph in PHASES) > 2 * sum(plan.phases.get(ph, 0.0) for ph in PHASES)
        once = "; times of a steady step: the warm-up's include one-time work, the step lines show the rate" \
            if slow else ""
        lines[2] += f"   ({plan.hardware} profile{worst}{once})"
    else:
        lines.append(f"{'  planned'.ljust(widths[0])}   no prediction"
                     + (f": {plan_error}" if plan_error else ""))
    return lines


def summary(losses: list[float | None], *, first_step: int, seconds: float,
            step_seconds: float | None = None) -> str:
    """'steps 1-13 in 4.1 s (0.32 s/step), loss 5.9784 -> 4.1022 (mean of first/last 3 steps)'.

    losses: the train losses of the steps run by this process, from step `first_step` on; None
    for a step skipped for a non-finite loss or gradient norm (--skip-nonfinite), counted.
    step_seconds: the steps' own time, which s/step is (the run's time also holds its evaluations
    and checkpoints)."""
    if not losses:
        return "no steps run"
    last_step = first_step + len(losses) - 1
    skipped = sum(x is None for x in losses)
    note = f"; {skipped} step{'s' if skipped != 1 else ''} skipped (non-finite loss or gradient norm)" \
        if skipped else ""
    seconds_per_step = (seconds if step_seconds is None else step_seconds) / len(losses)
    losses = [x for x in losses if x is not None]
    if not losses:
        return f"steps {first_step}-{last_step} in {seconds:.1f} s{note}"
    k = max(1, min(3, len(losses) // 3))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    avg = f" (mean of first/last {k} steps)" if k > 1 else ""
    return (f"steps {first_step}-{last_step} in {seconds:.1f} s ({seconds_per_step:.2f} "
            f"s/step), loss {first:.4f} -> {last:.4f}{avg}{note}")
