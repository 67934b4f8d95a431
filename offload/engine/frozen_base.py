"""The frozen base of a model: which parameters an encoded base stores in which dtype.

Parameters with requires_grad=False are packed into frozen chunks (offload.core.chunks);
this decides, per frozen chunk, its blob layout (offload.runtime.frozen) or None when the
chunk keeps the compute dtype.
"""

from __future__ import annotations

import torch

from ..core.chunks import ChunkPlan
from ..core.encoding import fused_experts
from ..runtime.frozen import DTYPE_NAMES, FrozenLayout, base_dtypes, layout_of


def quantizable(model: torch.nn.Module) -> set[str]:
    """Parameters an int8/NF4 base encodes: the weights of nn.Linear modules (PEFT's base
    layers included) except the output head, which bitsandbytes leaves unquantized too, and
    fused MoE expert stacks (`core.encoding.fused_experts`; not the router, a small gate)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linear = {f"{name}.weight" if name else "weight" for name, mod in model.named_modules()
              if type(mod) is torch.nn.Linear and mod is not head and "lora_" not in name}
    return linear | {n for n, p in model.named_parameters() if fused_experts(n, p.shape)}


def linear_modules(model: torch.nn.Module) -> dict[str, str]:
    """{module name: kind} of the modules PEFT's LoRA adapts as linears (nn.Linear and its
    subclasses, transformers' Conv1D), for the planner (`offload.plan.lora.KINDS`): "head" for
    the output embedding, "linear" for a plain nn.Linear (which an int8/NF4 base encodes: see
    `quantizable`), "subclass", "conv1d"."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is a dependency
        Conv1D = ()  # noqa: N806
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    out = {}
    for name, mod in model.named_modules():
        if mod is head and name:
            out[name] = "head"
        elif type(mod) is torch.nn.Linear:
            out[name] = "linear"
        elif isinstance(mod, torch.nn.Linear):
            out[name] = "subclass"
        elif Conv1D and isinstance(mod, Conv1D):
            out[name] = "conv1d"
    return out


def unencodable(model: torch.nn.Module, base_dtype: "str | None", *, frozen_only: bool = True) -> list[str]:
    """Frozen weights int8/NF4 would silently leave unencoded: those of transformers' Conv1D
    layers (GPT-2's c_attn, c_fc, c_proj: linear layers stored transposed, which bitsandbytes
    quantizes transposed and the engine does not encode yet). Empty for other dtypes.
    `frozen_only=False`: whether frozen or not (a model before LoRA freezes its base)."""
    if base_dtype not in ("int8", "nf4"):
        return []
    return [f"{name}.weight" for name, mod in model.named_modules()
            if type(mod).__name__ == "Conv1D" and isinstance(getattr(mod, "weight", None), torch.Tensor)
            and "lora_" not in name and not (frozen_only and mod.weight.requires_grad)]


def check_encodable(model: torch.nn.Module, base_dtype: "str | None", *, frozen_only: bool = True) -> None:
    """Refuse an int8/NF4 base of which some linear weights would stay unencoded (more memory
    and other numbers than asked for), naming one."""
    names = unencodable(model, base_dtype, frozen_only=frozen_only)
    if names:
        raise ValueError(f"base_dtype {base_dtype}: {names[0]!r} ({len(names)} in all) is the weight of a "
                         f"transformers Conv1D layer, which is not encoded in {base_dtype} yet; use base_dtype "
                         f"bf16 or fp16 for {type(model).__name__}")


def frozen_layouts(plan: ChunkPlan, model: torch.nn.Module, *, base_dtype: "str | None", double_quant: bool,
                   compute_dtype: torch.dtype) -> "dict[int, FrozenLayout | None]":
    """{frozen chunk: its blob layout, or None when nothing in it is encoded}."""
    check_encodable(model, base_dtype)
    names = [n for c in sorted(plan.frozen) for n in plan.chunks[c].params]
    base = base_dtypes(names, base_dtype=base_dtype, quantizable=quantizable(model), compute_dtype=compute_dtype)
    plain = DTYPE_NAMES[compute_dtype]
    out: dict[int, FrozenLayout | None] = {}
    for c in sorted(plan.frozen):
        encoded = any(base[n] != plain for n in plan.chunks[c].params)
        out[c] = layout_of(plan, c, base, double_quant=double_quant) if encoded else None
    return out
