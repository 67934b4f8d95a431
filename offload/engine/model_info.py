"""What the engine needs to know about a model's structure."""

from __future__ import annotations

import copy
import logging
import sys
from typing import Any

import torch

from ..core.chunks import ParamSpec, specs_of
from ..core.encoding import is_expert
from ..core.errors import UnsupportedModel
from ...optim.adamw8bit import embedding_names
from ..plan.perfmodel import TILED_FAMILIES
from . import segments

log = logging.getLogger(__name__)


def hf_meta_model(config: Any, *, trust_remote_code: bool = False) -> torch.nn.Module:
    """The transformers causal LM of `config` with every parameter on the meta device.

    The model gets its own copy of `config`: the engine may change the model's config (it turns
    `use_cache` off while checkpointing), the caller's stays as loaded, for the export.
    Buffers stay real CPU tensors: non-persistent buffers such as the rotary `inv_freq` are
    computed in __init__ and are in no checkpoint, so they must not become meta (or garbage
    after `to_empty`). Needs accelerate; without it everything is meta and a warning says so.
    Weights the model ties are tied again after construction: accelerate's init_empty_weights
    re-creates each parameter as it is registered, which unties what __init__ tied (the output
    head would be a second, never loaded parameter). `trust_remote_code`: the config's own model
    class (auto_map) may be used; transformers never prompts.
    """
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(config)
    # fp32, whatever dtype the checkpoint was saved in (its config's): buffers made in __init__
    # (Gemma's embed_scale) and PEFT's adapter init would otherwise be in that dtype, where
    # from_pretrained(dtype=float32) makes them fp32; the engine sets the parameters' dtypes
    fp32 = {"dtype": torch.float32}
    try:
        from accelerate import init_empty_weights
    except ImportError:
        log.warning("accelerate is not installed: buffers of the meta model are meta too "
                    "and must be recomputed before use")
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code, **fp32)
    else:
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code, **fp32)
    model.tie_weights()
    return model


def modules_with_params(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules that own parameters directly (their chunks are acquired around their forward)."""
    return [m for m in model.modules() if any(p is not None for p in m._parameters.values())]


def find_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a model: the largest ModuleList of same-class children with parameters.

    These are the units of activation checkpointing (e.g. a Llama's decoder layers). A block
    listed twice (one layer applied twice) is returned once: it is wrapped once.
    """
    best: list[torch.nn.Module] = []
    for mod in model.modules():
        if not isinstance(mod, torch.nn.ModuleList) or len(mod) < 2:
            continue
        kids = list({id(k): k for k in mod}.values())
        if len({type(k) for k in kids}) == 1 and any(True for _ in kids[0].parameters()):
            if len(kids) > len(best):
                best = kids
    return best


def check_dense_grads(model: torch.nn.Module) -> None:
    """Refuse trainable sparse-gradient embeddings: gradients land in dense chunks, so a sparse
    one cannot be accumulated there (it failed deep in backward instead)."""
    sparse = [n for n, m in model.named_modules()
              if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad]
    if sparse:
        raise UnsupportedModel(f"sparse gradients are not supported: {', '.join(sparse[:3])} "
                               f"{'is' if len(sparse) == 1 else 'are'} an embedding with sparse=True; "
                               f"use sparse=False")


def model_specs(model: torch.nn.Module) -> list[ParamSpec]:
    """The ParamSpecs the engine chunks a model by (its named_parameters, embeddings marked);
    the planner takes the same (make_plan's `params`)."""
    return specs_of(model.named_parameters(), embeddings=embedding_names(model))


def is_moe(model: torch.nn.Module) -> bool:
    """A mixture of experts: it has `experts` parameters (fused 3-D, or one module each). (Not
    its config: some configs name experts by default for models without MoE layers.)"""
    return any(is_expert(n) for n, _ in model.named_parameters())


def check_model_given(model: Any) -> None:
    """Refuse what an engine cannot take over: not a module, a module another engine holds
    (its parameters are that engine's views), or a torch.compile wrapper (the engine hooks and
    wraps the modules; compiled code would bypass or re-trace them)."""
    from .surgery import HELD

    dynamo = sys.modules.get("torch._dynamo")  # (imported by torch.compile: not imported here, 1 s)
    if dynamo is not None and isinstance(model, dynamo.eval_frame.OptimizedModule):
        raise UnsupportedModel("the model is a torch.compile wrapper: give the Engine the model itself "
                               "(it hooks the modules and wraps their forwards)")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"the Engine takes a torch.nn.Module, got {type(model).__name__}")
    if model in HELD:
        raise UnsupportedModel("another Engine holds this model (its parameters are that engine's): close "
                               "that one first (its trained weights: named_parameters_fp32), or give a new model")


def check_no_own_checkpointing(model: torch.nn.Module) -> None:
    """Refuse a Hugging Face model with gradient checkpointing on: its recompute runs modules in
    backward outside the engine's frames (the engine checkpoints repeated blocks itself)."""
    # what transformers' is_activation_checkpointing (formerly is_gradient_checkpointing, which
    # now warns) reads: the flag gradient_checkpointing_enable sets on the modules that support it
    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        raise UnsupportedModel("the model has gradient checkpointing enabled (gradient_checkpointing_enable); "
                               "the engine checkpoints repeated blocks itself (Activations(recompute=...)): "
                               "turn it off first (model.activation_checkpointing_disable(), or gradient_checkpointing_disable())")


def check_trainable_dtypes(named: list[tuple[str, torch.nn.Parameter]]) -> None:
    """Refuse trainable parameters the engine cannot hold without losing precision silently: it
    keeps fp32 masters and computes in fp32 or bf16, so a float64 (or complex) one became fp32
    and the model's own float64 inputs then failed in its forward."""
    odd = [(n, p.dtype) for n, p in named
           if p.requires_grad and (p.dtype == torch.float64 or p.is_complex())]
    if odd:
        name, dtype = odd[0]
        raise UnsupportedModel(f"parameter {name!r} is {dtype} ({len(odd)} such): the engine trains fp32 "
                               f"masters and computes in fp32 or bf16; convert the model (model.float()) first")


#: Attention implementations whose saved tensors are sized by the inputs' shapes alone (a
#: packed batch's segments are part of the recompute's key: offload.engine.segments).
_SHAPED_ATTENTION = ("sdpa", "eager", segments.NAME)


def lumped_recompute(model: torch.nn.Module, blocks: list[torch.nn.Module]) -> bool:
    """Whether a block's recompute may run without the saved-tensor hooks once learned
    (ActivationTracker.recomputing): only for the dense decoder families whose blocks save what
    their inputs' shapes decide (the tiled MLP's families, offload.plan.perfmodel), with an
    attention that does too. Not a mixture of experts (its routing sizes what each expert
    saves), not flash-attention's unpadding, not an arbitrary module (a `nonzero` would)."""
    config = getattr(model, "config", None)
    return (getattr(config, "model_type", None) in TILED_FAMILIES
            and getattr(config, "_attn_implementation", None) in _SHAPED_ATTENTION
            and not any(n.rsplit(".", 1)[-1] == "experts" for b in blocks for n, _ in b.named_modules()))
