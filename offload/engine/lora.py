"""LoRA adapters over a frozen base, injected by PEFT itself.

`Engine(model, lora=LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"]))`
injects adapters with `peft.inject_adapter_in_model` (PEFT's layers, initialisation and
forward; the model keeps its class) and freezes everything else, as `peft.get_peft_model`
does. A model the user already wrapped with `get_peft_model` (or that already carries LoRA
layers) is taken as is. The adapters are then ordinary trainable parameters and the base
ordinary frozen ones (the engine streams frozen chunks read-only, offload.runtime.frozen).
"""

from __future__ import annotations

import contextlib

from typing import Any, Iterator

import torch

ADAPTER = "default"  # PEFT's adapter name inside the model

# peft (bitsandbytes under it) is imported in the functions, by a LoRA run only: a module-level
# import cost every process, torchrun's ranks of a full fine-tune included, seconds at start.


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


def inject_meta(model: torch.nn.Module, config: Any, *, seed: int, values: bool = True) -> dict[str, str]:
    """Inject `config`'s adapters into the meta-device `model` in place, initialised by PEFT as
    after `torch.manual_seed(seed)`; returns {parameter name before: its name now}
    (`...q_proj.weight` -> `...q_proj.base_layer.weight`). Base parameters stay meta, frozen.
    `values=False`: the adapters stay meta too (to count them: --dry-run of a 70B model).
    Raises ValueError when PEFT refuses the config or left an adapter without values."""
    from peft import inject_adapter_in_model

    if not values:
        inject_adapter_in_model(config, model, adapter_name=ADAPTER, low_cpu_mem_usage=True)
        return {}
    before = {id(p): n for n, p in model.named_parameters()}
    with meta_stand_ins(model):
        torch.manual_seed(seed)
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    return adapter_renames(model, before)


@contextlib.contextmanager
def meta_stand_ins(model: torch.nn.Module) -> Iterator[None]:
    """PEFT initialises a LoRA layer's adapters on the device of its base layer: over a meta
    base they would stay meta, without values. Inside, every meta parameter of `model` is a
    zero-byte CPU stand-in (a 0-d zero expanded to its shape); after, the meta ones are back."""
    originals: dict[tuple[torch.nn.Module, str], torch.nn.Parameter] = {}
    stand_ins: dict[int, torch.nn.Parameter] = {}  # tied parameters share one stand-in
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and p.is_meta:
                originals[(mod, name)] = p
                if id(p) not in stand_ins:
                    stand_ins[id(p)] = torch.nn.Parameter(torch.zeros((), dtype=p.dtype).expand(p.shape),
                                                          requires_grad=p.requires_grad)
                mod._parameters[name] = stand_ins[id(p)]
    try:
        yield
    finally:
        for (mod, name), p in originals.items():
            p.requires_grad_(stand_ins[id(p)].requires_grad)  # PEFT froze the stand-in
            mod._parameters[name] = p


def adapter_renames(model: torch.nn.Module, before: dict[int, str]) -> dict[str, str]:
    """{name before: name now} of `model`'s parameters that existed before (`before`: id -> name);
    ValueError for a new one without values."""
    renames = {}
    for now, p in model.named_parameters():
        if id(p) in before:
            renames[before[id(p)]] = now
        elif p.is_meta or not p.requires_grad:
            raise ValueError(f"PEFT made {now!r} without values")  # never train a placeholder
    return renames
