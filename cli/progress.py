"""Training progress: step, loss, tokens/s, ETA and per-tier memory. On a terminal a rich bar;
otherwise (nohup, a scheduler, `> log`) one plain line every `every` steps, which a log file keeps."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)

from ..offload.core.units import format_size


def format_peaks(peaks: dict | None) -> str:
    """{tier: bytes} -> 'peak gpu 1.20 GiB · host 3.00 GiB' (the run's peaks so far, as the
    log lines and metrics.jsonl have them: between steps what is held is the homes alone)."""
    shown = " · ".join(f"{tier} {format_size(b)}" for tier, b in (peaks or {}).items() if b)
    return f"peak {shown}" if shown else ""


class TrainProgress:
    """The loop's progress; `note()` prints a line above it (or into the log)."""

    def __init__(self, *, console: Console, total: int, start: int = 0, label: str = "",
                 every: int = 0, intro: str | None = None):
        """`label`: shown before the step count (e.g. "LoRA r=16 nf4"). `every`: with output
        not a terminal, a line every that many steps (0: about 100 lines a run, the first and last
        step always). `intro`: a line printed first (steps per epoch, the expected time)."""
        self.console = console
        self.total, self.start, self.label = total, start, label
        self.every = every or max(1, (total - start) // 100)
        self.intro = intro
        self._t0 = time.monotonic()
        self._progress = None
        if console.is_terminal:
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

    @property
    def plain(self) -> bool:
        """Lines for a log file, not a live bar."""
        return self._progress is None

    def __enter__(self) -> "TrainProgress":
        if self.intro:
            self.note(self.intro)
        if self._progress is not None:
            self._progress.start()
        self._t0 = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()

    def update(self, *, step: int, loss: float, tokens_per_s: float, lr: float | None = None,
               peaks: dict | None = None) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step, loss=f"{loss:.4f}",
                                  tps=f"{tokens_per_s:,.0f}", mem=format_peaks(peaks))
            return
        done = step - self.start
        if not (done == 1 or step == self.total or done % self.every == 0):
            return
        elapsed = time.monotonic() - self._t0
        eta = elapsed / done * (self.total - step) if done else 0.0
        parts = [f"{self.label + ' ' if self.label else ''}step {step}/{self.total}", f"loss {loss:.4f}"]
        if lr is not None:
            parts.append(f"lr {lr:.3g}")
        parts.append(f"{tokens_per_s:,.0f} tok/s")
        if format_peaks(peaks):
            parts.append(format_peaks(peaks))
        parts.append(f"elapsed {clock(elapsed)}, ETA {clock(eta)}")
        self.console.print(", ".join(parts), highlight=False, soft_wrap=True)

    def note(self, text: str) -> None:
        (self._progress.console if self._progress is not None else self.console).print(
            text, highlight=False, soft_wrap=True)


def clock(seconds: float) -> str:
    """0:42 / 1:02:03."""
    s = int(round(seconds))
    h, m = divmod(s, 3600)
    m, s = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
