"""Append-only JSON-lines metrics (one object per event) in output/metrics.jsonl, and the same
train and eval numbers to TensorBoard or W&B (`--report-to`)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


class MetricsWriter:
    """`write(kind="train", step=3, loss=2.1)` appends one line, flushed immediately; with
    `report_to` ("tensorboard" | "wandb") the train and eval records also go there."""

    def __init__(self, path: "str | Path", *, report_to: str = "none", config: dict | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        self._sink = None if report_to == "none" else _REPORTERS[report_to](self.path.parent, config or {})

    def write(self, **record) -> None:
        record.setdefault("time", round(time.time(), 3))
        self._file.write(json.dumps(record, default=float) + "\n")
        self._file.flush()
        if self._sink is not None and record.get("kind") in ("train", "eval") and "step" in record:
            self._sink.log(scalars(record), step=int(record["step"]))

    def close(self) -> None:
        self._file.close()
        if self._sink is not None:
            self._sink.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def scalars(record: dict) -> dict[str, float]:
    """A train or eval record as named scalars: train/loss, train/lr, train/tokens_per_s,
    memory/<tier>_peak_gib; eval/loss."""
    kind = record["kind"]
    out = {f"{kind}/{k}": float(record[k]) for k in ("loss", "lr", "tokens_per_s", "grad_norm")
           if record.get(k) is not None}
    for tier, b in (record.get("peak_bytes") or {}).items():
        out[f"memory/{tier}_peak_gib"] = b / 2**30
    return out


class _TensorBoard:
    def __init__(self, run: Path, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run / "tensorboard"))
        self.writer.add_text("config", json.dumps(config, default=str, indent=1))

    def log(self, values: dict[str, float], *, step: int) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, run: Path, config: dict):
        import wandb

        self.run = wandb.init(mode="offline", dir=str(run), project="tierwise", name=run.name, config=config)

    def log(self, values: dict[str, float], *, step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


_REPORTERS = {"tensorboard": _TensorBoard, "wandb": _Wandb}
REPORT_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""The package each --report-to needs."""


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
