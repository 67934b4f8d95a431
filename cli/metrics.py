"""Append-only JSON-lines metrics (one object per event) in output/metrics.jsonl."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


class MetricsWriter:
    """`write(kind="train", step=3, loss=2.1)` appends one line, flushed immediately."""

    def __init__(self, path: "str | Path"):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, **record) -> None:
        record.setdefault("time", round(time.time(), 3))
        self._file.write(json.dumps(record, default=float) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(path: "str | Path") -> list[dict]:
    """All records of a metrics.jsonl (a torn last line from a crash is skipped)."""
    out = []
    path = Path(path)
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def truncate_metrics(path: "str | Path", *, after_step: int) -> int:
    """Drop the records of steps after `after_step` (and a torn last line), atomically.

    A resumed run continues from its checkpoint; the steps a killed run logged after that
    checkpoint are run again, so their old records must go. Returns how many were dropped.
    """
    path = Path(path)
    if not path.exists():
        return 0
    records = read_metrics(path)
    keep = [r for r in records if int(r.get("step", 0)) <= after_step]
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in keep:
            f.write(json.dumps(r, default=float) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(records) - len(keep)
