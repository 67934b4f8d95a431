"""The words the planner, the engine and the CLI share (pure, no torch): one place for each list.

Each is a Literal type for signatures and checkers, and a tuple of the same words for runtime
checks and `--help` choices; `check` turns a word outside its list into one ValueError.
"""

from __future__ import annotations

from typing import Literal, get_args

Tier = Literal["gpu", "host", "cxl", "nvme"]
TIERS: tuple[str, ...] = get_args(Tier)
"""Memory tiers, fastest first: the device, host RAM, CXL memory (a NUMA node), NVMe swap files."""

ComputeDtype = Literal["fp32", "bf16"]
COMPUTE_DTYPES: tuple[ComputeDtype, ...] = get_args(ComputeDtype)
"""The dtype the forward and backward run in (`precision`); masters stay fp32."""

FLOAT_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element of each float dtype a tensor is stored or exported in."""

COMPUTE_BYTES: dict[str, int] = {k: FLOAT_BYTES[k] for k in COMPUTE_DTYPES}
"""Bytes per element of each compute dtype."""

BaseDtype = Literal["fp32", "bf16", "fp16", "int8", "nf4"]
BASE_DTYPES: tuple[BaseDtype, ...] = get_args(BaseDtype)
"""How a frozen (LoRA) base is stored and streamed (offload.core.encoding, offload.runtime.codecs)."""

QUANTIZED: tuple[BaseDtype, ...] = ("int8", "nf4")
"""Base dtypes that encode only the linear weights: nn.Linear's (not the output head), as
bitsandbytes does, and fused MoE experts (`encoding.fused_experts`)."""

GradReduce = Literal["micro", "step"]
GRAD_REDUCE: tuple[GradReduce, ...] = get_args(GradReduce)
"""How several ranks reduce gradients: after every micro-batch (owned chunks only held), or once
per step (every chunk's gradient held); offload.engine.engine's module docstring."""


def check(value: object, words: tuple[str, ...], what: str) -> None:
    """ValueError naming `what` and the words it may be, unless `value` is one of them."""
    if value not in words:
        raise ValueError(f"{what} must be one of {', '.join(words)}; got {value!r}")
