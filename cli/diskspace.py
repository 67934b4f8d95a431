"""What a run will write to --output, checked against the free space there before its first step.

A run checkpoints at the end (and every --checkpoint-every steps), then exports: a disk that
cannot hold those would fail only when the training is done, and a run that checkpoints only at
the end would then have nothing to resume from. The bytes are exact where they can be: a
checkpoint's are the engine's state tensors (their dtypes and shapes, nothing read), the
export's the model's parameters in the export dtype; a fixed allowance covers the rest (JSON,
the tokenizer, metrics and plots).

At its worst moment the directory holds the checkpoints kept (--keep-checkpoints) plus the one
being written (it is renamed into place before the oldest is removed), or, after the last step,
those kept plus the export.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .machine import free_disk, nearest_existing
from ..offload.core.errors import TierwiseError
from ..offload.core.units import format_size
from ..offload.core.vocab import FLOAT_BYTES

if TYPE_CHECKING:  # (`finetune plan` runs without torch)
    import torch

#: per checkpoint, beside its tensors: the JSON skeletons, safetensors headers, the manifest,
#: the trainer's state (RNG states, the data position) and the filesystem's partial blocks
CHECKPOINT_EXTRA = 1 << 20
#: once per run: the exported config and tokenizer, metrics.jsonl, the plots
RUN_EXTRA = 32 << 20


class OutputSpaceError(TierwiseError):
    """--output's filesystem cannot hold what the run will write there."""


def state_bytes(state: Any) -> int:
    """Bytes of the tensors in a nested state as a checkpoint lays it out (cli.checkpoint.flatten;
    Deferred ones by dtype and shape, nothing read)."""
    from . import checkpoint as ckpt  # (torch: not for `finetune plan`)

    tensors: dict[str, Any] = {}
    ckpt.flatten(state, tensors)
    return sum(math.prod(t.shape) * t.dtype.itemsize for t in tensors.values())


def saves_ahead(*, start: int, total: int, every: int) -> int:
    """Checkpoints the steps start+1..total write: every `every`-th step, and the last one."""
    if total <= start:
        return 0
    regular = total // every - start // every if every else 0
    return regular + (0 if every and total % every == 0 else 1)


def held(*, existing: int, saves: int, keep: int) -> tuple[int, int]:
    """(the most checkpoints the directory holds at once, those it holds at the end) over
    `saves` more beside `existing` ones, `keep` kept (0: all)."""
    if not saves:
        return existing, existing
    if keep <= 0:
        return existing + saves, existing + saves
    # before save j (j >= 2) min(existing + j - 1, keep) are kept; each is written beside them
    return max(existing, min(existing + saves - 1, keep)) + 1, min(existing + saves, keep)


def written(*, checkpoint: int, export: int, existing: int, saves: int, keep: int) -> tuple[int, int]:
    """(the bytes a run writes beyond what `existing` checkpoints already hold, at its fullest,
    with RUN_EXTRA; the most checkpoints held at once) for `saves` more of `checkpoint` bytes
    each, `keep` kept (0: all), then the export."""
    peak, end = held(existing=existing, saves=saves, keep=keep)
    return max(0, max(peak * checkpoint, end * checkpoint + export) - existing * checkpoint) + RUN_EXTRA, peak


def export_bytes(model: "torch.nn.Module", *, dtype: "torch.dtype", trainable_only: bool) -> int:
    """The exported weights: every parameter once (a tied one once), or a LoRA run's
    adapters, in `dtype` (meta tensors count as well as real ones)."""
    params = [p for p in model.parameters() if p.requires_grad or not trainable_only]
    n = sum(p.numel() for p in params if p.is_floating_point())
    if not trainable_only:
        n += sum(b.numel() for b in model.buffers() if b.is_floating_point())
    return n * dtype.itemsize


def check(out: Path, *, tensors: int, export: int, start: int, total: int, every: int, keep: int,
          nvme_dir: "str | None" = None, nvme_pending: int = 0, lora: bool = False) -> int:
    """Refuse (OutputSpaceError) when `out`'s filesystem lacks the room this run will write
    there; returns the bytes it needs. `tensors`: a checkpoint's tensor bytes (state_bytes of
    the engine's state_dict(deferred=True), summed over the ranks' shards); `nvme_pending`: swap
    bytes still to be written under `nvme_dir`, counted when it shares `out`'s filesystem.
    Leftovers of an interrupted save (removed by the next save) count as free."""
    from . import checkpoint as ckpt

    checkpoint = tensors + CHECKPOINT_EXTRA
    existing = len(ckpt.list_checkpoints(out))
    needed, peak = written(checkpoint=checkpoint, export=export, existing=existing,
                           saves=saves_ahead(start=start, total=total, every=every), keep=keep)
    free = free_disk(out)
    if free is None:
        return needed
    free += sum(f.stat().st_size for d in out.glob("ckpt-*") if d.is_dir() and d.suffix in (".tmp", ".old")
                for f in d.rglob("*") if f.is_file())
    swap = nvme_pending if nvme_dir is not None and _same_filesystem(out, Path(nvme_dir)) else 0
    free -= swap
    if needed > free:
        fixes = ["free space", "point --output elsewhere"] + (
            [f"lower --keep-checkpoints (now {keep or 'all'})"] if peak > 2 and (keep == 0 or keep > 1) else [])
        raise OutputSpaceError(
            f"{out} has {format_size(max(free, 0))} free{' beside the NVMe swap still to be written' if swap else ''}; "
            f"this run writes up to {format_size(needed)} there ({peak} checkpoint{'s' * (peak > 1)} of "
            f"{format_size(checkpoint)} at once, then the exported {'adapter' if lora else 'model'}, "
            f"{format_size(export)}, and {format_size(RUN_EXTRA)} for metrics, plots and the tokenizer): {', '.join(fixes[:-1])} or {fixes[-1]}")
    return needed


def _same_filesystem(a: Path, b: Path) -> bool:
    where = [nearest_existing(p) for p in (a, b)]
    return None not in where and os.stat(where[0]).st_dev == os.stat(where[1]).st_dev


def plan_line(cfg: Any, plan: Any, *, free: "int | None" = None) -> str:
    """What a run of `plan` writes to --output, from the plan's bytes (`Plan.checkpoint_bytes`,
    its parameter counts): for `finetune plan` and --dry-run (`free`: the space --output has,
    said beside it). A fresh run; the run itself checks the engine's exact bytes first."""
    lora = plan.lora_rank is not None
    dtype = cfg.export_dtype or ("fp32" if lora else cfg.precision)
    export = (plan.trainable_params if lora else plan.num_params) * FLOAT_BYTES[dtype]
    checkpoint = plan.checkpoint_bytes + CHECKPOINT_EXTRA
    every, keep = cfg.checkpoint_every, cfg.keep_checkpoints
    line = (f"disk: each checkpoint {format_size(checkpoint)} (masters and optimizer state), the "
            f"{'adapter' if lora else 'model'} export {format_size(export)} ({dtype})")
    saves = (saves_ahead(start=0, total=cfg.steps, every=every) if cfg.steps else
             1 if not every else None)  # (None: one every `every` steps, how many unknown)
    if saves is None and keep <= 0:
        line += f"; every checkpoint kept (--keep-checkpoints 0): one every {every} steps"
        return line + (f", {format_size(free)} free at --output" if free is not None else "")
    needed, peak = written(checkpoint=checkpoint, export=export, existing=0,
                           saves=keep + 1 if saves is None else saves, keep=keep)
    schedule = (f"a checkpoint every {every} steps, {peak} at once" if every else "a checkpoint at the end")
    line += f"; a run writes up to {format_size(needed)} to --output ({schedule})"
    if free is None:
        return line
    return line + f", {format_size(free)} free there" + ("; too little: the run would be refused" if needed > free else "")
