"""`finetune generate RUN --prompt ...`: answer with the model a run trained.

A full fine-tune's RUN/model loads as it is. A LoRA run's RUN/adapter goes onto its base as the
run trained over it: a base stored as int8 or NF4 (--qlora) has each weight the engine encoded
round-tripped through the same codec (offload.runtime.codecs, byte for byte bitsandbytes' NF4),
a bf16/fp16 base is rounded to that dtype; never the unquantised weights, which differ from the
trained model by the quantisation error. Everything runs in fp32 on the CPU (or the run's
device), greedy decoding unless --temperature."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch

from . import checkpoint as ckpt
from .config import ConfigError


def run_config(run: Path) -> dict:
    """The options the run in `run` trained with (its newest checkpoint's), or {} without one."""
    latest = ckpt.latest_checkpoint(run)
    if latest is None:
        return {}
    return dict(ckpt.load_trainer(latest).get("config", {}))


def load_trained(run: "str | Path", *, trust_remote_code: bool = False) -> tuple[Any, Any]:
    """(model in eval mode, tokenizer) of the finished run in `run`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a few small loads: their bars are noise before the answer

    run = Path(run)
    if (run / "model" / "config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(run / "model", dtype=torch.float32,
                                                     trust_remote_code=trust_remote_code)
        return model.eval(), AutoTokenizer.from_pretrained(run / "model", trust_remote_code=trust_remote_code)
    adapter = run / "adapter"
    if not (adapter / "adapter_config.json").exists():
        raise ConfigError(f"{run}: no model/ or adapter/ in it: not the --output of a finished finetune run")
    from peft import PeftModel

    from .loading import resolve_model

    cfg = run_config(run)
    base_name = cfg.get("model") or json.loads((adapter / "adapter_config.json").read_text()).get(
        "base_model_name_or_path")
    src = resolve_model(base_name, trust_remote_code=trust_remote_code)
    if not src.has_weights:
        raise ConfigError(f"{run}: its adapter was trained over model profile {base_name!r}, a random base "
                          "that was not saved: there is no model to answer with")
    base = AutoModelForCausalLM.from_pretrained(src.model_dir, dtype=torch.float32,
                                                trust_remote_code=trust_remote_code)
    as_trained(base, base_dtype=cfg.get("base_dtype"))
    tokenizer = (AutoTokenizer.from_pretrained(adapter) if (adapter / "tokenizer_config.json").exists()
                 else src.tokenizer)
    with warnings.catch_warnings():  # (PEFT asks transformers a deprecated question: not the user's to fix)
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        return PeftModel.from_pretrained(base, adapter).eval(), tokenizer


@torch.no_grad()
def as_trained(base: torch.nn.Module, *, base_dtype: "str | None") -> None:
    """Give `base`'s weights the values the run computed with: int8/NF4-encoded ones decoded from
    their encoding (the weights the engine encodes), a bf16/fp16 base rounded to that dtype."""
    if base_dtype in (None, "fp32"):
        return
    if base_dtype in ("bf16", "fp16"):
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[base_dtype]
        for p in base.parameters():
            p.copy_(p.to(dtype))
        return
    from ..offload.engine.frozen_base import quantizable
    from ..offload.runtime import codecs

    encoded = quantizable(base)
    double = base_dtype == "nf4"  # the CLI's NF4 base is always double-quantised (QLoRA's recipe)
    for name, p in base.named_parameters():
        if name in encoded:
            blob = codecs.encode(base_dtype, p.detach().reshape(-1).float(), double_quant=double)
            out = torch.empty(p.numel(), dtype=torch.float32)
            codecs.decode(base_dtype, blob, out, double_quant=double)
            p.copy_(out.view_as(p))


def generate(model: Any, tokenizer: Any, prompt: str, *, max_new_tokens: int = 64, chat: "bool | None" = None,
             temperature: float = 0.0) -> str:
    """The model's continuation of `prompt` (through the chat template when `chat`, or when None
    and the tokenizer has one)."""
    if chat is None:
        chat = bool(getattr(tokenizer, "chat_template", None))
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("--chat: this tokenizer has no chat template")
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
    else:
        text = prompt
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=not chat)
    sample = temperature > 0
    out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=sample,
                         temperature=temperature if sample else None, top_p=None, top_k=None,
                         pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                         else tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
