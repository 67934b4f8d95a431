"""The run directory (--output): claimed by one run at a time, and only ever emptied if ours.

A run creates `.tierwise-run` in its --output and holds an advisory lock on it
(offload.runtime.runlock) until it ends: a second run on the same --output is refused with the pid of
the first. The file also marks the directory as made by tierwise: `--overwrite` empties only
such a directory, of what a run writes there (RUN_ENTRIES), and refuses where it holds anything
else (a user's notes, their data): never a file someone else put there.
"""

from __future__ import annotations

import contextlib
import re
import shutil
from pathlib import Path

from . import checkpoint as ckpt
from .config import ConfigError
from ..offload.runtime import runlock
from ..offload.runtime.swapdir import PRIVATE_PREFIX

MARKER = ".tierwise-run"
#: what a run writes at the top of its --output (cli.checkpoint, cli.train, cli.metrics, cli.lora)
RUN_ENTRIES = re.compile(r"ckpt-\d+(\.tmp|\.old)?|latest(\.tmp)?|metrics\.jsonl(\.tmp)?|loss\.png"
                         r"|memory_timeline\.png|model|adapter|tensorboard|wandb")


class RunDir:
    """A claimed --output: `path`, and the lock held until `release()`."""

    def __init__(self, path: Path, fd: int):
        self.path, self._fd = path, fd

    def release(self) -> None:
        runlock.release(self._fd)
        self._fd = None


def claim(output: str, *, resume: bool, overwrite: bool, inputs: dict | None = None,
          swap: "str | None" = None) -> RunDir:
    """Create or reuse `output` for a run. Refused: a file; a non-empty directory without
    --resume / --overwrite; --overwrite of a directory tierwise did not make, or one holding an
    input of this run (`inputs`: flag -> path, e.g. a previous run's export as --model: it
    would be deleted under the run); --resume without a checkpoint; a directory another live
    run holds. `swap` (--nvme-path) inside `output`: --overwrite leaves what holds it (the NVMe
    store removes its own swap files, a dead run's too)."""
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--output {out} exists and is not a directory")
    marker = out / MARKER
    foreign = out.is_dir() and not marker.exists() and any(out.iterdir())
    if foreign and not (resume and ckpt.latest_checkpoint(out) is not None):
        if overwrite:
            raise ConfigError(f"--overwrite: {out} was not made by a finetune run (no {MARKER} "
                              "file in it): refusing to delete its files; choose another --output")
        _refuse(out, resume)
    made = _missing(out)
    out.mkdir(parents=True, exist_ok=True)
    fd = runlock.acquire(marker, what=f"--output {out}")
    try:
        left = _left_before_a_step(out)
        entries = [p for p in out.iterdir() if p.name != MARKER and not _holds_swap(out, p, swap)
                   and p.name not in left]
        if resume and ckpt.latest_checkpoint(out) is None or entries and not (resume or overwrite):
            _refuse(out, resume)
        if overwrite:
            _refuse_inputs_inside(out, inputs or {})
            others = sorted(p.name for p in entries if not RUN_ENTRIES.fullmatch(p.name))
            if others:
                raise ConfigError(f"--overwrite: {out} holds what no run writes ({', '.join(others[:5])}"
                                  f"{', ...' if len(others) > 5 else ''}): refusing to delete it; move it out "
                                  "or choose another --output")
            for p in entries:
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()
    except BaseException:
        if made:  # a refused run leaves no directory behind (the marker goes while the lock is held)
            marker.unlink(missing_ok=True)
        runlock.release(fd)
        for d in made:
            with contextlib.suppress(OSError):  # (another run may have begun there since)
                d.rmdir()
        raise
    return RunDir(out, fd)


def _left_before_a_step(out: Path) -> set[str]:
    """What a run that failed before its first step leaves (its retry starts over there): an
    empty metrics.jsonl and its reporters' directories, where no checkpoint exists."""
    metrics = out / "metrics.jsonl"
    if ckpt.latest_checkpoint(out) is not None or metrics.exists() and (not metrics.is_file()
                                                                         or metrics.stat().st_size):
        return set()
    return {"metrics.jsonl", "tensorboard", "wandb"}


def _missing(out: Path) -> list[Path]:
    """`out` and its ancestors that do not exist yet, deepest first."""
    made = []
    while not out.exists() and out != out.parent:
        made.append(out)
        out = out.parent
    return made


def _holds_swap(out: Path, entry: Path, swap: "str | None") -> bool:
    """`entry` of `out` is --nvme-path, holds it, or is a swap directory where --nvme-path is `out`."""
    if swap is None:
        return False
    where, root = Path(swap).expanduser().resolve(), out.resolve()
    if where == root:
        return entry.name.startswith(PRIVATE_PREFIX)
    return where.is_relative_to(root) and where.relative_to(root).parts[0] == entry.name


def _refuse_inputs_inside(out: Path, inputs: dict) -> None:
    root = out.resolve()
    for flag, path in inputs.items():
        if path and Path(path).exists() and Path(path).resolve().is_relative_to(root):
            raise ConfigError(f"--overwrite would delete {flag} {path}: it is inside --output {out}; "
                              "move it out or choose another --output")


def _refuse(out: Path, resume: bool):
    if resume:
        raise ConfigError(f"--resume: no checkpoint in {out}")
    raise ConfigError(f"output directory {out} is not empty: pass --resume to continue "
                      "its run or --overwrite to replace it")
