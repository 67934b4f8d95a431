"""8-bit AdamW: both moments block-wise quantized (the bitsandbytes algorithm), ~2.03 B/param.

`adamw8bit_step_` is the whole step as one pure function on tensors; it runs a C kernel on
CPU (see _cpu_kernel), bitsandbytes' kernel on CUDA, and a plain torch path otherwise.
Tensors under MIN_8BIT_NUMEL elements keep fp32 moments, as bitsandbytes does.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import math
from typing import Any, Optional

import torch

from . import _cpu_kernel
from .base import TierwiseOptimizer, write_back_
from .costs import OptimizerCost
from .quant import BLOCK, dequantize_blockwise, dynamic_map, num_blocks, decade_table, quantize_blockwise

logger = logging.getLogger(__name__)

MIN_8BIT_NUMEL = 4096


def init_adamw8bit_state(param: torch.Tensor, *, fp32: bool = False) -> dict[str, torch.Tensor]:
    """Zero state for one tensor: uint8 codes + fp32 absmax per 256-block, or fp32 moments (a
    tensor under MIN_8BIT_NUMEL elements, or `fp32`: bitsandbytes' optim_bits=32)."""
    n, dev = param.numel(), param.device
    if n < MIN_8BIT_NUMEL or fp32:
        return {"exp_avg": torch.zeros(n, dtype=torch.float32, device=dev),
                "exp_avg_sq": torch.zeros(n, dtype=torch.float32, device=dev)}
    blocks = num_blocks(n)
    return {"state1": torch.zeros(n, dtype=torch.uint8, device=dev),
            "state2": torch.zeros(n, dtype=torch.uint8, device=dev),
            "absmax1": torch.zeros(blocks, dtype=torch.float32, device=dev),
            "absmax2": torch.zeros(blocks, dtype=torch.float32, device=dev)}


def adamw8bit_step_(
    param: torch.Tensor,  # (...) fp32, updated in place (e.g. a flat fp32 master chunk)
    grad: torch.Tensor,  # (...) same numel as param, any float dtype
    state: dict[str, torch.Tensor],  # from init_adamw8bit_state(param), updated in place
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,  # 1-based count of this step (for bias correction)
) -> None:
    """One AdamW step, moments in blockwise 8-bit; math and order as bitsandbytes'."""
    if param.dtype != torch.float32 or not param.is_contiguous():
        raise ValueError("adamw8bit_step_ needs a contiguous fp32 param; use the optimizer "
                         "class (it keeps an fp32 copy) for other dtypes")
    if grad.numel() != param.numel():
        raise ValueError(f"grad has {grad.numel()} elements, param {param.numel()}")
    g = grad.reshape(-1).to(torch.float32).contiguous()
    p = param.view(-1)
    if "exp_avg" in state:
        _adam32_step(p, g, state, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                     weight_decay=weight_decay, step=step)
    elif p.is_cuda:
        _cuda_step(p, g, state, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                   weight_decay=weight_decay, step=step)
    elif p.device.type == "cpu" and _cpu_kernel.load() is not None:
        _c_step(p, g, state, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                weight_decay=weight_decay, step=step)
    else:
        adamw8bit_step_reference_(p, g, state, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                  weight_decay=weight_decay, step=step)


def _adam32_step(p: torch.Tensor, g: torch.Tensor, state: dict[str, torch.Tensor], *, lr: float,
                 beta1: float, beta2: float, eps: float, weight_decay: float, step: int) -> None:
    # bitsandbytes' 32-bit path (used for its small tensors): eps scaled by sqrt(bc2)
    m, v = state["exp_avg"], state["exp_avg_sq"]
    m.mul_(beta1).add_(g, alpha=1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    bc1, bc2_sqrt = 1.0 - beta1**step, math.sqrt(1.0 - beta2**step)
    if weight_decay > 0.0:
        p.mul_(1.0 - lr * weight_decay)
    p.add_(m / (v.sqrt() + eps * bc2_sqrt), alpha=-lr * bc2_sqrt / bc1)


def adamw8bit_step_reference_(
    p: torch.Tensor,  # (n,) fp32
    g: torch.Tensor,  # (n,) fp32
    state: dict[str, torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
) -> None:
    """Plain-torch 8-bit step (any device); the fallback when the C kernel is unavailable."""
    m = dequantize_blockwise(state["state1"], state["absmax1"], signed=True)
    v = dequantize_blockwise(state["state2"], state["absmax2"], signed=False)
    m.mul_(beta1).add_(g, alpha=1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    bc1, bc2_sqrt = 1.0 - beta1**step, math.sqrt(1.0 - beta2**step)
    denom = (v.sqrt() / bc2_sqrt).add_(eps)
    if weight_decay > 0.0:
        p.mul_(1.0 - lr * weight_decay)
    p.addcdiv_(m, denom, value=-lr / bc1)
    quantize_blockwise(m, signed=True, out=state["state1"], absmax_out=state["absmax1"])
    quantize_blockwise(v, signed=False, out=state["state2"], absmax_out=state["absmax2"], nonzero=True)


@functools.lru_cache(maxsize=1)
def _kernel_tables() -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
    """The constant inputs of the C kernel (both maps and their decade tables) and their data
    pointers; built once per process."""
    tables = (dynamic_map(signed=True), dynamic_map(signed=False),
              decade_table(signed=True).packed, decade_table(signed=False).packed)
    return tables, tuple(t.data_ptr() for t in tables)


def _c_step(p: torch.Tensor, g: torch.Tensor, state: dict[str, torch.Tensor], *, lr: float,
            beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
            isa: Optional[int] = None) -> int:
    """The C kernel on (n,) fp32 p and g; isa: the most capable path allowed (2 AVX-512,
    1 AVX2, 0 portable scalar; default $TIERWISE_CPU_ISA, see _cpu_kernel.isa_limit),
    lowered to what the CPU has; all give identical results.

    Scalars are computed in double here and rounded once; the kernel folds absmax * beta and
    multiplies by 1/sqrt(1 - beta2^t) (the torch reference path divides by its root), so the
    two paths differ by a rounding. Returns the isa that ran.
    """
    lib = _cpu_kernel.load()
    assert lib is not None
    if isa is None:
        isa = _cpu_kernel.isa_limit()
    code1, code2, qt1, qt2 = _kernel_tables()[1]
    tensors = (p, g, state["state1"], state["state2"], state["absmax1"], state["absmax2"])
    for t in tensors:
        assert t.is_contiguous() and t.device.type == "cpu"
    decay = 1.0 - lr * weight_decay if weight_decay > 0.0 else 1.0
    hyper = (ctypes.c_float * 8)(beta1, beta2, 1.0 - beta1, 1.0 - beta2, eps,
                                 1.0 / math.sqrt(1.0 - beta2**step), decay, -lr / (1.0 - beta1**step))
    used = lib.tw_adam8bit_step(*(t.data_ptr() for t in tensors), code1, code2, qt1, qt2,
                                ctypes.addressof(hyper), p.numel(), torch.get_num_threads(), isa)
    if used < 0:  # the default maps always qualify; a changed quant.py might not
        raise RuntimeError("8-bit C kernel: the decade tables of the dynamic maps are not of the "
                           "form its quantizer needs (optim/_cpu_kernel.py prep_qtab)")
    return used


def _cuda_step(p: torch.Tensor, g: torch.Tensor, state: dict[str, torch.Tensor], *, lr: float,
               beta1: float, beta2: float, eps: float, weight_decay: float, step: int) -> None:
    # bitsandbytes' fused CUDA kernel; its maps are the same as ours (asserted in tests). Its
    # nearest code makes a small positive v 0: coded 1 after it instead (quantize_blockwise's
    # `nonzero`), where v is positive: it was before, or the gradient is not 0
    import bitsandbytes.functional as bnbf

    was = state["state2"] != 0
    bnbf.optimizer_update_8bit_blockwise(
        "adam", g, p, state["state1"], state["state2"], beta1, beta2, 0.0, 0.0, eps, step, lr,
        dynamic_map(signed=True, device=p.device), dynamic_map(signed=False, device=p.device),
        state["absmax1"], state["absmax2"], weight_decay, gnorm_scale=1.0, skip_zeros=False)
    state["state2"].masked_fill_((state["state2"] == 0) & (was | (g != 0)), 1)


def state_bytes_8bit(shape: tuple[int, ...], rank: Optional[int] = None) -> float:
    """Exact bytes init_adamw8bit_state allocates for a tensor of this shape."""
    n = math.prod(shape)
    if n < MIN_8BIT_NUMEL:
        return 8.0 * n
    return 2.0 * n + 8.0 * num_blocks(n)


def embedding_names(model: torch.nn.Module) -> frozenset[str]:
    """The names (as named_parameters gives them: a tied weight once) of nn.Embedding weights:
    AdamW8bit keeps their moments in fp32, in the engine (offload.update.table's
    fp32_embeddings) as transformers' Trainer has bitsandbytes do."""
    ids = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    return frozenset(n for n, p in model.named_parameters() if id(p) in ids)


def eight_bit_groups(model: torch.nn.Module, **extra: Any) -> list[dict]:
    """Param groups giving AdamW8bit the engine's rule (and transformers' Trainer's with
    bitsandbytes): nn.Embedding weights keep fp32 moments (optim_bits=32), in model order; a
    model without embeddings gets one group."""
    full = embedding_names(model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if n in full], "optim_bits": 32, **extra},
              {"params": [p for n, p in named if n not in full], **extra}]
    return [g for g in groups if g["params"]]


class AdamW8bit(TierwiseOptimizer):
    """Drop-in AdamW with 8-bit moments. A non-fp32 param (bf16, fp16) keeps an fp32 master in
    its state (4 more bytes per param) that the update runs on, copied into the param rounded
    to nearest: an update below the param's precision (1e-4 at 1.0 in bf16) accumulates there.
    `stochastic_rounding=True` (bf16) is the lean option, bitsandbytes' behaviour plus rounding:
    no master, a transient fp32 copy written back with stochastic rounding, so small updates move
    the param in expectation. `master_weights=False` without it: bitsandbytes' exactly (updates
    below the precision are lost). A group with `optim_bits=32` keeps fp32 moments, as
    bitsandbytes' override does: transformers' Trainer gives it to every nn.Embedding's weight,
    and so does the engine. A positive second moment never codes 0 (docs/optimizers.md: a row
    no token reached, a ReLU unit that died, made steps of thousands of lr with bitsandbytes'
    rounding). A float64 param is refused (the step computes in fp32)."""

    state_family = "AdamW8bit"  # (Adam8bit's state is the same)
    signature_keys = frozenset({"stochastic_rounding"})

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *,
                 stochastic_rounding: bool = False, master_weights: Optional[bool] = None) -> None:
        if master_weights is None:
            master_weights = not stochastic_rounding
        defaults = dict(lr=lr, betas=tuple(betas) if isinstance(betas, list) else betas, eps=eps, weight_decay=weight_decay,
                        stochastic_rounding=stochastic_rounding, master_weights=master_weights)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        bits = param_group.get("optim_bits", 8)
        if bits not in (8, 32):
            raise ValueError(f"optim_bits takes 8 or 32 (fp32 moments), got {bits!r}")
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group["stochastic_rounding"] and not group["master_weights"] \
                and any(p.dtype == torch.float16 and p.requires_grad for p in group["params"]):
            self.param_groups.pop()  # (it would round fp16 to nearest, without a master: updates lost)
            raise ValueError("stochastic_rounding rounds bf16 parameters; an fp16 one needs its fp32 master: "
                             "give fp16 parameters a group with master_weights=True")

    @classmethod
    def cost(cls) -> OptimizerCost:
        return OptimizerCost(state_bytes_per_param=2.0 + 8.0 / BLOCK, read_bytes_per_param=10.0 + 8 / BLOCK,
                             write_bytes_per_param=6.0 + 8 / BLOCK, flops_per_param=30.0,
                             state_bytes=state_bytes_8bit, note="fp32 state below 4096 elements")

    def _update(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any], index: int) -> None:
        exact = p.dtype == torch.float32 and p.is_contiguous()
        if not state:
            state["step"] = 0
            state.update(init_adamw8bit_state(p, fp32=group.get("optim_bits", 8) == 32))
            if not exact and group.get("master_weights", False):
                state["master"] = p.data.float().contiguous()
        state["step"] += 1
        master = p.data if exact else state.get("master")
        if master is None:
            master = p.data.float().contiguous()
        elif not exact:  # an element changed outside since the last step (a loaded state dict, a
            # reverted or averaged weight) starts from its new value, not from the master
            weight = p.data.reshape(master.shape)
            torch.where(weight != master.to(p.dtype), weight, master, out=master)
        beta1, beta2 = group["betas"]
        adamw8bit_step_(master, p.grad, state, lr=group["lr"], beta1=beta1, beta2=beta2,
                        eps=group["eps"], weight_decay=group["weight_decay"], step=state["step"])
        if not exact:  # (p.data is a new tensor object at each access: never `is` the master)
            write_back_(p, master, stochastic=group["stochastic_rounding"] and "master" not in state,
                        seed=state["step"] * 1_000_003 + index)


class Adam8bit(AdamW8bit):
    """bitsandbytes' Adam8bit: the same step (its weight decay is decoupled too), default wd 0."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *,
                 stochastic_rounding: bool = False, master_weights: Optional[bool] = None) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, stochastic_rounding=stochastic_rounding,
                         master_weights=master_weights)
