"""fp32 AdamW as a pure function, and torch's AdamW/SGD wrapped with a cost()."""
from __future__ import annotations

import logging
import math
from typing import Any

import torch

from .costs import OptimizerCost

logger = logging.getLogger(__name__)


def init_adamw_state(param: torch.Tensor) -> dict[str, torch.Tensor]:  # param: (...) any float
    return {"exp_avg": torch.zeros(param.shape, dtype=torch.float32, device=param.device),
            "exp_avg_sq": torch.zeros(param.shape, dtype=torch.float32, device=param.device)}


def adamw_step_(
    param: torch.Tensor,  # (...) fp32, updated in place
    grad: torch.Tensor,  # (...) same shape
    state: dict[str, torch.Tensor],  # from init_adamw_state
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,  # 1-based
) -> None:
    """torch.optim.AdamW's (single-tensor) math, in its order."""
    m, v = state["exp_avg"], state["exp_avg_sq"]
    g = grad.float()
    param.mul_(1.0 - lr * weight_decay)
    m.lerp_(g, 1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    bc1, bc2 = 1.0 - beta1**step, 1.0 - beta2**step
    denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
    param.addcdiv_(m, denom, value=-lr / bc1)


def adam_direction_(state: dict[str, Any], low: torch.Tensor, *, beta1: float, beta2: float,
                    eps: float) -> torch.Tensor:  # low: (r, c) projected gradient -> same shape
    """Update the subspace moments in place and return m / (sqrt(v) + eps), no bias correction
    (GaLore and APOLLO fold that into the step size)."""
    m, v = state["exp_avg"], state["exp_avg_sq"]
    m.mul_(beta1).add_(low, alpha=1.0 - beta1)
    v.mul_(beta2).addcmul_(low, low, value=1.0 - beta2)
    return m / (v.sqrt() + eps)


def plain_step_(
    param: torch.Tensor,  # (...) fp32, updated in place
    grad: torch.Tensor,  # (...) same shape
    state: dict[str, Any],  # from init_adamw_state(param)
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,  # 1-based
) -> None:
    """A parameter GaLore and APOLLO do not project (embeddings, the head, norms, biases): their
    reference code's AdamW, as their projected step has it: m / (sqrt(v) + eps) at the step size
    lr * sqrt(bc2) / bc1, then decoupled weight decay (torch's AdamW puts eps after the bias
    correction and decays first)."""
    d = adam_direction_(state, grad.float(), beta1=beta1, beta2=beta2, eps=eps)
    param.add_(d.view(param.shape), alpha=-lr * math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step))
    if weight_decay > 0.0:
        param.add_(param, alpha=-lr * weight_decay)


def _fused_ok(params: Any) -> tuple[Any, bool]:
    params = list(params)
    tensors = [t for g in params for t in (g["params"] if isinstance(g, dict) else [g])]
    tensors = [t[1] if isinstance(t, tuple) else t for t in tensors]  # named parameters: (name, param)
    ok = all(t.is_floating_point() and t.device.type in ("cpu", "cuda") for t in tensors)
    return params, ok


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW, fused where the params allow, with cost() for the performance model.
    Every other torch.optim.AdamW option (amsgrad, maximize, foreach, ...) is passed through;
    a foreach choice (True or False) or differentiable=True picks torch's implementation instead
    of the fused default."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, fused: bool | None = None,
                 **options: Any) -> None:
        params, ok = _fused_ok(params)
        if fused is None:
            fused = ok and options.get("foreach") is None and not options.get("differentiable")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused, **options)

    @classmethod
    def cost(cls) -> OptimizerCost:
        return OptimizerCost(state_bytes_per_param=8.0, read_bytes_per_param=16.0,
                             write_bytes_per_param=12.0, flops_per_param=15.0)


class SGD(torch.optim.SGD):
    """torch.optim.SGD with cost(); momentum state only when momentum > 0; torch's other options
    (maximize, foreach, ...) are passed through."""

    def __init__(self, params: Any, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, *, nesterov: bool = False, **options: Any) -> None:
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening,
                         weight_decay=weight_decay, nesterov=nesterov, **options)

    @classmethod
    def cost(cls) -> OptimizerCost:
        return OptimizerCost(state_bytes_per_param=0.0, read_bytes_per_param=8.0,
                             write_bytes_per_param=4.0, flops_per_param=3.0,
                             note="+4 B/param state (and +4 read/write) with momentum")
