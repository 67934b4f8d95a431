"""Batches: the default loss, moving a batch to the device, splitting it into micro-batches."""

from __future__ import annotations

from typing import Any

import torch


def default_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Hugging Face convention: the model computes the loss from `labels`."""
    return model(**batch).loss


def to_device(batch: Any, device: torch.device) -> Any:
    """Every tensor of a tensor / dict / list / tuple batch on `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def split_batch(batch: Any, n: int) -> list[Any]:
    """Split a dict/tensor batch along dim 0 into `n` equal micro-batches."""
    if n == 1:
        return [batch]
    if isinstance(batch, torch.Tensor):
        if batch.shape[0] % n:
            raise ValueError(f"batch of {batch.shape[0]} does not split into {n} micro-batches")
        return list(batch.chunk(n))
    if isinstance(batch, dict):
        parts = {k: split_batch(v, n) for k, v in batch.items()}
        return [{k: parts[k][i] for k in batch} for i in range(n)]
    raise TypeError(f"cannot split a batch of type {type(batch).__name__}")
