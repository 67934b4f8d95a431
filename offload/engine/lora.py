"""LoRA adapters over a frozen base, injected by PEFT itself.

`Engine(model, lora=LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"]))`
injects adapters with `peft.inject_adapter_in_model` (PEFT's layers, initialisation and
forward; the model keeps its class) and freezes everything else, as `peft.get_peft_model`
does. A model the user already wrapped with `get_peft_model` (or that already carries LoRA
layers) is taken as is. The adapters are then ordinary trainable parameters and the base
ordinary frozen ones (the engine streams frozen chunks read-only, offload.runtime.frozen).
"""

from __future__ import annotations

from typing import Any

import torch

try:  # re-exported: Engine(model, lora=LoraConfig(...))
    from peft import LoraConfig
except ImportError:  # pragma: no cover - peft is a dependency
    LoraConfig = None  # type: ignore[assignment,misc]


def has_adapters(model: torch.nn.Module) -> bool:
    """True when `model` is a PeftModel or carries PEFT tuner layers already."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # pragma: no cover
        return False
    return any(isinstance(m, BaseTunerLayer) for m in model.modules())


def apply_lora(model: torch.nn.Module, config: Any) -> torch.nn.Module:
    """Inject `config`'s adapters into `model` in place (PEFT) and freeze the rest; returns it."""
    from peft import inject_adapter_in_model

    if has_adapters(model):
        raise ValueError("the model already has PEFT adapters (get_peft_model): pass it without lora=")
    if getattr(config, "modules_to_save", None):  # trainable copies of whole modules: PeftModel's job
        raise ValueError("LoraConfig.modules_to_save needs peft.get_peft_model: wrap the model with it and "
                         "pass the wrapped model without lora=")
    model = inject_adapter_in_model(config, model)  # freezes all but the adapters, as get_peft_model
    check_adapters_initialised(model)
    return model


def check_adapters_initialised(model: torch.nn.Module) -> None:
    """Adapters on the meta device have lost PEFT's init (lora_A random, lora_B zero): loaded
    as zeros they would never train. Refuse, naming one."""
    meta = [n for n, p in model.named_parameters() if p.requires_grad and p.device.type == "meta"]
    if meta:
        raise ValueError(f"trainable parameters on the meta device ({meta[0]!r}, {len(meta)} in all) have no "
                         f"values: build the model's trainable part on a real device (PEFT initialises the "
                         f"adapters there), or load their weights with Engine.load_weights")
