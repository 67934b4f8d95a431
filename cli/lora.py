"""LoRA / QLoRA runs of `finetune`: PEFT adapters on the meta-device model, and their export.

The CLI builds the model on the meta device and streams the checkpoint's weights in later
(cli.train); `inject` puts PEFT's adapters on it with values (offload.engine.lora.inject_meta,
which `plan --verify` uses too). PEFT's own code creates and initialises the adapters
(lora_A Kaiming-uniform, lora_B zeros), drawing from the global generator exactly as
`torch.manual_seed(seed); peft.get_peft_model(model, config)` on the loaded model does, so a
run's adapters are reproducible from --seed and equal PEFT's (tests/test_cli_lora.py).
Base weights are ordinary frozen parameters after that: the engine encodes them (--base-dtype)
as they stream in, shard by shard.

The export is a PEFT adapter directory, OUTPUT/adapter (`ADAPTER_DIR`): adapter_config.json and
adapter_model.safetensors, written by PEFT's `get_peft_model_state_dict` and
`LoraConfig.save_pretrained`, loadable with `peft.PeftModel.from_pretrained(base, dir)`; a merge
(`finetune export --merge`) reads it from there.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Iterable, Iterator

import torch

from .config import ConfigError, TrainConfig
from ..offload.engine.lora import ADAPTER, inject_meta  # noqa: F401 (ADAPTER: cli's name too)
from ..profiles.model import routed_experts

ADAPTER_DIR = "adapter"  # OUTPUT/adapter: the PEFT adapter directory of a LoRA run


def lora_config(cfg: TrainConfig, *, base: str | None = None):
    """The peft.LoraConfig of a LoRA run (`base`: recorded as base_model_name_or_path)."""
    from peft import LoraConfig

    return LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=cfg.target_list(), base_model_name_or_path=base,
                      task_type="CAUSAL_LM")  # so AutoPeftModelForCausalLM can load the adapter


def check_targets(model: torch.nn.Module, targets: "list[str] | str") -> None:
    """Every name of --lora-targets must name some module (PEFT only refuses a list of which
    none matches): a typo would silently train fewer adapters."""
    if targets == "all-linear":
        return
    modules = list(model.named_modules())
    leaves = sorted({n.rsplit(".", 1)[-1] for n, m in modules if _adaptable(m)})
    # fused MoE experts are parameters, not layers: PEFT adapts them for all-linear and the names
    # it maps onto them (offload.plan.lora.adapts_experts), where it does
    from ..offload.plan.lora import adapts_experts

    kind = getattr(getattr(model, "config", None), "model_type", None)
    names = sorted(adapts_experts(kind)) if any(p.dim() >= 3 for p in model.parameters()) else []
    fused = f"; {', '.join(names)} adapt this model's fused experts as parameters" if names else ""
    for t in targets:
        if t in names:  # (PEFT maps it onto the experts, and the router for `gate`: its checks follow)
            continue
        matched = [m for n, m in modules if n == t or n.endswith("." + t)]
        if not matched:
            param = any(n == t or n.endswith("." + t) for n, _ in model.named_parameters())
            head = (f"--lora-targets {t}: a parameter, not a layer" if param else
                    f"--lora-targets: no module of {type(model).__name__} is named {t!r}")
            raise ConfigError(f"{head} (the layers LoRA adapts: {', '.join(leaves)}{fused})")
        if not any(_adaptable(m) for m in matched):  # e.g. "mlp": a block, not a layer
            raise ConfigError(f"--lora-targets {t}: {type(matched[0]).__name__} is not a layer LoRA adapts "
                              f"(the layers LoRA adapts: {', '.join(leaves)}{fused})")
    from ..profiles.model import TOWER_PREFIXES  # (a vision model's: text never runs them)

    named = [n for t in targets for n, m in modules if (n == t or n.endswith("." + t)) and _adaptable(m)]
    if named and all(n.startswith(TOWER_PREFIXES) for n in named):
        raise ConfigError(f"--lora-targets {','.join(targets)}: every one is in the vision tower, which training on "
                          "text never runs: none would train (name the text model's layers, e.g. q_proj)")


def _adaptable(m: torch.nn.Module) -> bool:
    """A layer PEFT's LoRA adapts: linear (GPT-2's Conv1D too), embedding, convolution."""
    return isinstance(m, (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)) \
        or type(m).__name__ == "Conv1D"


def check_base_dtype(model: torch.nn.Module, cfg: TrainConfig) -> None:
    """--base-dtype int8/nf4 on a model whose linear layers the engine cannot encode (GPT-2's
    Conv1D): refused before anything is written, as the engine would refuse it."""
    from ..offload.engine.frozen_base import unencodable

    names = unencodable(model, cfg.base_dtype, frozen_only=False)
    if names:
        flag = "--qlora" if cfg.qlora else f"--base-dtype {cfg.base_dtype}"
        raise ConfigError(f"{flag}: {names[0]!r} ({len(names)} in all) is the weight of a transformers Conv1D "
                          f"layer, which is not encoded in {cfg.base_dtype} yet; use --lora-rank with "
                          f"--base-dtype bf16 or fp16 for {type(model).__name__}")


def inject(model: torch.nn.Module, config, *, seed: int, values: bool = True) -> dict[str, str]:
    """offload.engine.lora.inject_meta (PEFT's adapters on the meta-device `model`, initialised as
    after `torch.manual_seed(seed)`; returns {checkpoint name: its name now}), its refusals as
    one-line ConfigErrors."""
    try:
        with warnings.catch_warnings():  # PEFT's own patterns for fused experts, not the user's: noise
            warnings.filterwarnings("ignore", r"The following (rank|alpha)_pattern keys did not match",
                                    RuntimeWarning)
            return inject_meta(model, config, seed=seed, values=values)
    except ValueError as e:  # e.g. a target that is no layer PEFT can adapt
        line = (str(e).splitlines() or [type(e).__name__])[0]
        if "ParamWrapper" in line and "dropout" in line:  # PEFT adapts fused MoE experts as parameters
            from ..offload.plan.lora import adapts_experts

            names = sorted(adapts_experts(getattr(getattr(model, "config", None), "model_type", None)) - {"all-linear"})
            line = ("--lora-dropout: PEFT adapts this model's fused MoE experts (and router) as parameters, "
                    "which take no dropout; give --lora-dropout 0, or targets PEFT does not map onto the experts"
                    + (f" (not all-linear, {', '.join(names)})" if names else "")
                    + ", e.g. --lora-targets q_proj,k_proj,v_proj,o_proj")
        raise ConfigError(f"LoRA: {line}") from None


def renamed(named: Iterable[tuple[str, torch.Tensor]], renames: dict[str, str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint (name, tensor) pairs under the names of the model with adapters."""
    for name, t in named:
        yield renames.get(name, name), t


def counts(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters of `model` (tied ones once; works on meta)."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def summary(cfg: TrainConfig, model: torch.nn.Module) -> str:
    """One line: rank, alpha, targets, trainable parameters and %, base dtype, adapter bytes."""
    trainable, total = counts(model)
    base = cfg.base_dtype or cfg.precision
    quant = " (double quant)" if base == "nf4" else ""  # the engine double-quantizes every nf4 base
    return (f"LoRA r={cfg.lora_rank} alpha={cfg.lora_alpha:g} dropout={cfg.lora_dropout:g} "
            f"targets={cfg.lora_targets}: {trainable:,} trainable of {total:,} parameters "
            f"({100 * trainable / max(total, 1):.3f}%), adapters {_size(4 * trainable)} fp32; "
            f"base {base}{quant}{_unencoded(cfg, model, base, total - trainable)}")


def _unencoded(cfg: TrainConfig, model: torch.nn.Module, base: str, frozen: int) -> str:
    """int8/nf4 encode only the linear weights (frozen_base.quantizable: nn.Linear's, fused MoE
    experts): the share of the base that stays in the compute dtype (embeddings, norms, the
    head, MoE routers), said, so a summary never claims an nf4 base that is mostly bf16."""
    if base not in ("int8", "nf4") or frozen <= 0:
        return ""
    from ..offload.engine.frozen_base import quantizable

    names = quantizable(model)
    encoded = sum(p.numel() for n, p in model.named_parameters() if n in names and not p.requires_grad)
    kept = "embeddings, norms, head" + (", routers" if routed_experts(model.config) else "")
    return f" on {100 * encoded / frozen:.1f}% of it, the rest {cfg.precision} ({kept})"


def label(cfg: TrainConfig) -> str:
    """The progress line's and plots' short name of a LoRA run, e.g. "QLoRA r=16 nf4"."""
    return f"{'QLoRA' if cfg.base_dtype == 'nf4' else 'LoRA'} r={cfg.lora_rank} {cfg.base_dtype or cfg.precision}"


def _size(n: int) -> str:
    from ..offload.core.units import format_size

    return format_size(n)


def export_adapter(named: Iterable[tuple[str, torch.Tensor]], model: torch.nn.Module, out: Path, *,
                   dtype: torch.dtype = torch.float32) -> Path:
    """Write the PEFT adapter directory of `model`'s adapters (`named`: their trained values,
    the engine's fp32 masters) with PEFT's own functions; returns the directory.

    PEFT selects the adapter entries and drops the adapter name; the keys then get PeftModel's
    `base_model.model.` prefix (the model here is the bare one PEFT injected into), as
    PeftModel.save_pretrained writes them and PeftModel.from_pretrained expects."""
    from peft import get_peft_model_state_dict

    from . import tensorfile

    state = {n: t.to(dtype).contiguous() for n, t in named}
    adapters = {f"base_model.model.{k}": v for k, v in
                get_peft_model_state_dict(model, state_dict=state, adapter_name=ADAPTER,
                                          save_embedding_layers=False).items()}
    if not adapters:
        raise ConfigError("LoRA export: the model has no adapters")  # nothing trained: never an empty dir
    out.mkdir(parents=True, exist_ok=True)
    # (safetensors' save_file writes 0600 whatever the umask: others could not read the adapter)
    tensorfile.write(out / "adapter_model.safetensors", adapters, metadata={"format": "pt"})
    config = model.peft_config[ADAPTER]
    config.inference_mode = True  # as PeftModel.save_pretrained writes it
    config.save_pretrained(str(out))
    return out
