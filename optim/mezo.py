"""MeZO (Malladi et al. 2023): zeroth-order SGD by SPSA, no gradients, no optimizer state.

The direction z ~ N(0, I) is never stored: it is regenerated from (seed, tensor index), so any
subset of tensors (e.g. one chunk at a time in the engine) can be perturbed independently and
identically. Note: +eps z, -2 eps z, +eps z restores a param only up to its own rounding (a
stateless x -> fl(x + d) is not injective for |x| << |d|, so no float scheme can undo it
exactly): fp32's; a bf16 or fp16 param drifts far more (warned). The engine perturbs
temporaries (its compute copies stay as they were) and applies this same arithmetic to its fp32
masters, so it gives this class's fp32 numbers step for step (offload.update.zeroth).
"""
from __future__ import annotations

import warnings
from typing import Any, Callable

import torch

from .base import TierwiseOptimizer
from .costs import OptimizerCost


def tensor_seed(seed: int, index: int) -> int:
    """Seed of tensor `index` under step seed `seed` (a fixed mixing, stable across runs)."""
    return (seed * 0x9E3779B1 + index * 0x85EBCA77 + 0x27D4EB2F) % (2**63 - 1)


def direction(tensor: torch.Tensor, *, seed: int, index: int = 0) -> torch.Tensor:  # -> like tensor
    """z ~ N(0, I) shaped like `tensor`, regenerated from (seed, index); generated in fp32 on CPU
    so the same z comes back on any device."""
    gen = torch.Generator(device="cpu").manual_seed(tensor_seed(seed, index))
    z = torch.randn(tensor.shape, generator=gen, dtype=torch.float32)
    return z.to(device=tensor.device, dtype=tensor.dtype)


def perturb_(tensor: torch.Tensor, *, seed: int, scale: float, index: int = 0) -> None:
    """tensor += scale * z(seed, index), in place."""
    tensor.add_(direction(tensor, seed=seed, index=index), alpha=scale)


def mezo_update_(
    tensor: torch.Tensor,  # (...) param, updated in place
    *,
    seed: int,
    projected_grad: float,
    lr: float,
    weight_decay: float,
    index: int = 0,
) -> None:
    """p -= lr * (projected_grad * z + weight_decay * p), z regenerated from (seed, index)."""
    z = direction(tensor, seed=seed, index=index)
    if weight_decay != 0.0:
        tensor.mul_(1.0 - lr * weight_decay)
    tensor.add_(z, alpha=-lr * projected_grad)


class MeZO(TierwiseOptimizer):
    """ZO-SGD: `loss = opt.step(closure)`; closure runs a forward pass (no grad) and returns the loss."""

    fp32_math = False  # (perturbs and updates in the parameter's own dtype)
    state_family = "MeZO"

    def __init__(self, params: Any, lr: float = 1e-6, eps: float = 1e-3, weight_decay: float = 0.0, *,
                 seed: int = 0) -> None:
        super().__init__(params, dict(lr=lr, eps=eps, weight_decay=weight_decay))
        self.state["mezo"] = {"seed": seed, "step": 0, "projected_grad": 0.0}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        # every group (the constructor's too), as torch.optim.SGD checks them
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
        first = self.param_groups[0]["eps"]
        why = (f"eps must be > 0, got {eps}" if not eps > 0 else
               f"lr and weight_decay must be >= 0, got {lr}, {decay}" if not (lr >= 0 and decay >= 0) else
               f"MeZO perturbs every group by one eps: this group's is {eps}, the first's {first}" if eps != first
               else None)
        if why is not None:
            self.param_groups.pop()  # a refused group leaves the optimizer as it was
            raise ValueError(why)
        low = [p for p in group["params"] if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16)]
        if low:
            warnings.warn(f"MeZO perturbs {low[0].dtype} parameters in place: +eps z, -2 eps z, +eps z does "
                          "not round back to them (about 1e-2 of a weight over 20 steps in bf16, even at lr 0); "
                          "keep the trained parameters in fp32, or train with the engine (--optimizer mezo: "
                          "fp32 masters)", stacklevel=3)

    @classmethod
    def cost(cls) -> OptimizerCost:
        # perturb +, -2, +, update: four read-modify-write passes, each regenerating z
        return OptimizerCost(state_bytes_per_param=0.0, read_bytes_per_param=16.0,
                             write_bytes_per_param=16.0, flops_per_param=4 * 12.0, needs_grad=False,
                             note="plus two forward passes per step, no backward")

    def _perturb_all(self, seed: int, factor: float) -> None:
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                index += 1
                if p.requires_grad:
                    perturb_(p.data, seed=seed, scale=factor * group["eps"], index=index)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        if closure is None:
            raise ValueError("MeZO.step needs a closure returning the loss of a forward pass")
        meta = self.state["mezo"]
        meta["step"] += 1
        seed = tensor_seed(meta["seed"], meta["step"])
        eps = {group["eps"] for group in self.param_groups}
        if len(eps) != 1:
            raise ValueError("MeZO needs one eps for all param groups")
        self._perturb_all(seed, 1.0)
        loss_pos = float(closure())
        self._perturb_all(seed, -2.0)
        loss_neg = float(closure())
        self._perturb_all(seed, 1.0)
        projected_grad = (loss_pos - loss_neg) / (2.0 * eps.pop())
        meta["projected_grad"] = projected_grad
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                index += 1
                if p.requires_grad:
                    mezo_update_(p.data, seed=seed, projected_grad=projected_grad, lr=group["lr"],
                                 weight_decay=group["weight_decay"], index=index)
        return torch.tensor(loss_pos)
