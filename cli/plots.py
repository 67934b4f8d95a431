"""PNG plots: one step's memory timeline per tier, and the loss curve (matplotlib Agg)."""

from __future__ import annotations

from pathlib import Path

_PHASE_COLORS = {"forward": "#dbe9f6", "backward": "#fde2cf", "update": "#dcefd9"}


def preload() -> None:
    """Import matplotlib now: a run calls this before its engine takes the budgets, so the
    library's ~20 MiB are part of the process (its allowance), not a transient over the budgets
    at the end of the run."""
    _pyplot()


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def plot_timeline(timeline: list[dict], path: "str | Path", *, title: str = "") -> Path | None:
    """Bytes per tier over the moments of one step, phases shaded and labelled.

    `timeline`: [{"moment": int, "phase": str, "bytes": {tier: int}}]. Returns None if empty.
    """
    if not timeline:
        return None
    plt = _pyplot()
    rows = sorted(timeline, key=lambda r: r["moment"])
    moments = [r["moment"] for r in rows]
    tiers = sorted({t for r in rows for t in r["bytes"]})
    fig, ax = plt.subplots(figsize=(9, 4))
    start = 0
    for i in range(1, len(rows) + 1):  # shade each run of equal phase
        if i == len(rows) or rows[i]["phase"] != rows[start]["phase"]:
            phase = rows[start]["phase"]
            x0, x1 = moments[start] - 0.5, moments[i - 1] + 0.5
            ax.axvspan(x0, x1, color=_PHASE_COLORS.get(phase, "#eeeeee"), zorder=0)
            ax.text((x0 + x1) / 2, 1.0, phase, transform=ax.get_xaxis_transform(),
                    ha="center", va="bottom", fontsize=9)
            start = i
    for tier in tiers:
        ax.step(moments, [r["bytes"].get(tier, 0) / 2**20 for r in rows], where="mid",
                label=tier, linewidth=1.5)
    ax.set_xlabel("moment")
    ax.set_ylabel("MiB")
    ax.set_title(title or "memory per tier over one step", pad=16)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_loss(records: list[dict], path: "str | Path", *, title: str = "loss") -> Path | None:
    """Train (and eval, if present) loss against step, from metrics records."""
    train = [(r["step"], r["loss"]) for r in records if r.get("kind") == "train"]
    evals = [(r["step"], r["loss"]) for r in records if r.get("kind") == "eval"]
    if not train and not evals:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train", linewidth=1.2)
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval", linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
