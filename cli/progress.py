"""The training progress bar: step, loss, tokens/s, ETA and per-tier memory (rich)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)

from ..offload.core.units import format_size


def format_usage(usage: dict | None) -> str:
    """{tier: {kind: bytes}} -> 'gpu 1.20 GiB · host 3.00 GiB'."""
    if not usage:
        return ""
    return " · ".join(f"{tier} {format_size(sum(kinds.values()))}"
                      for tier, kinds in usage.items() if sum(kinds.values()))


class TrainProgress:
    """A rich progress bar for the loop; `note()` prints a line above it."""

    def __init__(self, *, console: Console, total: int, start: int = 0, label: str = ""):
        """`label`: shown before the step count (e.g. "LoRA r=16 nf4")."""
        self.console = console
        self._progress = Progress(
            TextColumn(f"[bold]{label + ' ' if label else ''}step"), MofNCompleteColumn(), BarColumn(),
            TextColumn("loss [cyan]{task.fields[loss]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TextColumn("{task.fields[mem]}"),
            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
            console=console, transient=False,
        )
        self._task = self._progress.add_task("train", total=total, completed=start,
                                             loss="-", tps="-", mem="")

    def __enter__(self) -> "TrainProgress":
        self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.stop()

    def update(self, *, step: int, loss: float, tokens_per_s: float, usage: dict | None) -> None:
        self._progress.update(self._task, completed=step, loss=f"{loss:.4f}",
                              tps=f"{tokens_per_s:,.0f}", mem=format_usage(usage))

    def note(self, text: str) -> None:
        self._progress.console.print(text, highlight=False, soft_wrap=True)
