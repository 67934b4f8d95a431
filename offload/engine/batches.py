"""Batches: the default loss, moving a batch to the device, splitting it into micro-batches,
and the target tokens that weight each micro-batch's loss (`step_weights`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from . import headloss, segments
from .headloss import tiled_loss


def default_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Hugging Face convention: the model's loss from `labels`; a causal LM's with its head in
    tiles (offload.engine.headloss), never holding every token's logits."""
    loss = tiled_loss(model, batch)
    if loss is None:
        if not isinstance(batch, dict):
            raise TypeError(f"the engine's default loss calls model(**batch): give a dict batch (input_ids, labels), "
                            f"or a loss_fn for a {type(batch).__name__}")
        out = model(**batch)
        loss = out.loss
        if loss is None:
            raise ValueError(f"{type(model).__name__} returned no loss for a batch with keys {sorted(batch)}: give "
                             "it 'labels' (a causal LM's loss comes from them), or the engine a loss_fn")
        stats = headloss.collected()
        if stats is not None:
            _own_stats(stats, out, batch)
    return loss


def _own_stats(stats: headloss.TokenStats, out: Any, batch: dict[str, Any]) -> None:
    """A causal LM's token statistics from its own logits (and its router's aux_loss)."""
    aux = getattr(out, "aux_loss", None)
    if isinstance(aux, torch.Tensor):
        stats.aux_loss = aux.detach()
    logits, labels, shifted = getattr(out, "logits", None), batch.get("labels"), batch.get("shift_labels")
    if not (isinstance(logits, torch.Tensor) and logits.dim() == 3 and isinstance(labels, torch.Tensor)):
        stats.counted = False
        return
    if not isinstance(shifted, torch.Tensor) and labels.shape == logits.shape[:2]:
        shifted = headloss.next_tokens(labels)  # (the logits stay a view)
    if isinstance(shifted, torch.Tensor) and shifted.shape == logits.shape[:2]:
        stats.add_logits(logits, shifted)
    else:  # (prompt tuning's virtual tokens, ...: which logit is whose label, unknown)
        stats.counted = False


def to_device(batch: Any, device: torch.device) -> Any:
    """Every tensor of a tensor / dict / list / tuple batch on `device`. To a CUDA device from
    pinned memory, without a wait on the launching thread (a copy from pageable memory waits
    for it); a dict's `position_ids` leave their packed segments, and its `labels` the targets
    the loss keeps, found on the host (offload.engine.segments, .headloss), not read back from
    the device. A mapping (a collator's BatchEncoding) comes back a dict."""
    if isinstance(batch, torch.Tensor):
        if device.type == "cuda" and batch.device.type == "cpu":
            return batch.pin_memory().to(device, non_blocking=True)
        return batch.to(device)
    if isinstance(batch, Mapping):  # (a dict, or a collator's BatchEncoding: a dict from here on)
        out = {k: to_device(v, device) for k, v in batch.items()}
        ids, labels = batch.get("position_ids"), batch.get("labels")
        if isinstance(ids, torch.Tensor) and out["position_ids"] is not ids:
            segments.known(ids, out["position_ids"])
        if isinstance(labels, torch.Tensor) and out["labels"] is not labels:
            headloss.known_labels(labels, out["labels"])
        return out
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def split_batch(batch: Any, n: int, *, inner: bool = False) -> list[Any]:
    """Split a tensor / dict / list / tuple batch along dim 0 into `n` equal micro-batches.
    Inside a dict, list or tuple, a plain value (None, a flag, a number, a string) goes to
    every micro-batch as it is; a list or tuple of plain values only is refused (per-row
    values or settings: a list cannot say which)."""
    if n == 1:
        return [batch]
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            raise ValueError("a 0-dim tensor in the batch has no rows to split into micro-batches")
        if batch.shape[0] % n:
            raise ValueError(f"batch of {batch.shape[0]} does not split into {n} micro-batches")
        return list(batch.chunk(n))
    if isinstance(batch, Mapping):
        parts = {k: split_batch(v, n, inner=True) for k, v in batch.items()}
        return [{k: parts[k][i] for k in batch} for i in range(n)]
    if isinstance(batch, (list, tuple)):  # e.g. (inputs, targets), as to_device takes it
        if not any(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in batch):
            # per-row values (lengths, ids) or settings: which, a list cannot say; copying it to
            # every micro-batch would pair rows with other rows' values
            raise TypeError(f"cannot split a list of plain values ({type(batch).__name__} of {len(batch)}) into "
                            "micro-batches: make per-row values a tensor")
        items = [split_batch(v, n, inner=True) for v in batch]
        parts = [[item[i] for item in items] for i in range(n)]
        return [type(batch)(*p) if hasattr(batch, "_fields") else type(batch)(p) for p in parts]  # namedtuple too
    if inner and (batch is None or isinstance(batch, (bool, int, float, str))):
        return [batch] * n
    raise TypeError(f"cannot split a batch of type {type(batch).__name__}")


def target_tokens(batch: Any) -> int | None:
    """Target tokens of a causal-LM batch: `labels` after the shift (position 0 predicts
    nothing), not -100 -- what transformers' ForCausalLMLoss averages over; 1-D labels (one per
    row, a classifier's) count their rows that are not -100. None when the batch
    has no `labels` tensor (a custom loss function: its micro-batches weigh alike)."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if not isinstance(labels, torch.Tensor):
        return None
    if labels.dim() < 2:  # one label per row (sequence classification): nothing to shift
        return int((labels != -100).sum())
    return int((labels[..., 1:] != -100).sum())


def step_weights(micro: list[Any]) -> list[float]:
    """Each micro-batch's share of the step's loss: its target tokens over those of the whole
    step (transformers' gradient-accumulation fix: a short, masked micro-batch weighs less than
    a long one, so the step's gradient is that of one big batch). Micro-batches without labels
    weigh alike (1/n, as before). The loss function returns a micro-batch's mean; loss * weight
    summed over the step is the token mean of the whole step."""
    counts = list(map(target_tokens, micro))  # (no comprehensions: each is one more Python call a step)
    if None in counts:
        counts = [1] * len(micro)
    total = sum(counts)
    if total == 0:
        raise ValueError("no target tokens in this step's batch (every label is -100)")
    return [c / total for c in counts]
