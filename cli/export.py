"""Export trained weights as a Hugging Face model directory, streaming one tensor at a time.

The tensors and their names are what `save_pretrained` writes for the model (cli.layout: tied
duplicates dropped, transformers' conversions reverted, e.g. fused experts back to per-expert
tensors). At most one shard's worth of converted tensors is held in memory. Shards are written
as `model-00001-of-0000N.safetensors` plus `model.safetensors.index.json` when there is more
than one, or a single `model.safetensors` otherwise, exactly as `save_pretrained` does.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Iterable

import torch

from . import tensorfile
from ..offload.core.sizes import parse_size

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def write_shards(named: Iterable[tuple[str, torch.Tensor]], out_dir: Path, *,
                 dtype: torch.dtype, max_shard_bytes: int) -> dict[str, str]:
    """Stream (name, tensor) into safetensors shards; returns the weight map name -> file.
    Floating-point tensors are cast to `dtype`, others (integer buffers) are kept as they are.
    Each tensor is on disk before the next is asked for (cli.tensorfile.Appender): an export
    holds one tensor, not one shard."""
    parts: list[tuple[Path, list[str]]] = []
    current: "tensorfile.Appender | None" = None
    names: list[str] = []

    def flush() -> None:
        nonlocal current, names
        if current is not None:
            current.finish(metadata={"format": "pt"})
            parts.append((current.path, names))
        current, names = None, []

    try:
        for name, tensor in named:
            t = tensor.detach().to(device="cpu", dtype=dtype if tensor.is_floating_point() else None)
            nbytes = t.numel() * t.element_size()
            if current is not None and current.nbytes + nbytes > max_shard_bytes:
                flush()
            if current is None:
                current = tensorfile.Appender(out_dir / f"model-part-{len(parts) + 1:05d}.safetensors.tmp")
            current.add(name, t)
            names.append(name)
        flush()
    finally:
        if current is not None:
            current.discard()

    weight_map = {}
    for i, (path, names) in enumerate(parts, start=1):
        final = "model.safetensors" if len(parts) == 1 else \
            f"model-{i:05d}-of-{len(parts):05d}.safetensors"
        os.replace(path, out_dir / final)
        weight_map.update({n: final for n in names})
    return weight_map


def export_hf(named: Iterable[tuple[str, torch.Tensor]], out_dir: "str | Path", *, config,
              model=None, layout=None, tokenizer=None, dtype: "str | torch.dtype" = "bf16",
              max_shard_size: "str | int" = "5G", generation_config=None) -> Path:
    """Write config.json, safetensors (+ index), tokenizer and generation config to `out_dir`.

    `named` yields the model's parameter names with CPU tensors (e.g.
    engine.named_parameters_fp32(); a tied parameter once, under any of its names). `model`
    (with its `layout`, cli.layout.ModelLayout, taken while it was still on the meta device) is
    the trained module: its ties, the checkpoint layout it was loaded from and its persistent
    buffers decide what is written; without it, a new model of `config` does. `config` is
    written as given, with the export dtype.
    """
    from .layout import ModelLayout, iter_export
    from .loading import build_meta_model

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    if model is None:
        model = build_meta_model(config)
    layout = layout or ModelLayout.of(model)
    weight_map = write_shards(iter_export(model, layout, named), out_dir, dtype=dtype,
                              max_shard_bytes=parse_size(max_shard_size, what="--shard-size"))
    _drop_stale(out_dir, set(weight_map.values()))
    if len(set(weight_map.values())) > 1:
        total = 0
        for f in sorted(set(weight_map.values())):
            with open(out_dir / f, "rb") as fh:  # header-size-free count: sum tensor bytes
                total += os.path.getsize(out_dir / f) - (8 + int.from_bytes(fh.read(8), "little"))
        with open(out_dir / "model.safetensors.index.json", "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config = _with_dtype(config, dtype)
    config.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    if generation_config is not None:
        if isinstance(generation_config, (str, Path)):
            shutil.copyfile(generation_config, out_dir / "generation_config.json")
        else:
            generation_config.save_pretrained(out_dir)
    log.info("exported %d tensors to %s", len(weight_map), out_dir)
    return out_dir


def _drop_stale(out_dir: Path, written: set[str]) -> None:
    """An earlier save's weight files this one did not write (more shards then, or an index
    where one file is written now), removed as save_pretrained removes them: a loader would
    take the stale index, or the stale single file."""
    stale = [f for f in out_dir.glob("model*.safetensors") if f.name not in written]
    if len(written) <= 1:
        stale.append(out_dir / "model.safetensors.index.json")
    for f in stale:
        if f.is_file() and (f.name == "model.safetensors" or f.name.startswith("model-")
                            or f.name == "model.safetensors.index.json"):
            f.unlink()


def _with_dtype(config, dtype: torch.dtype):
    import copy

    config = copy.deepcopy(config)
    config.dtype = dtype
    if "torch_dtype" in vars(config):  # transformers 4.x keeps the field under this name
        config.torch_dtype = dtype
    return config
