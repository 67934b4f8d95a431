"""APOLLO (Zhu et al. 2024): low-rank Adam state only to estimate a gradient scaling.

A Gaussian random projection (regenerated from a seed every `update_proj_gap` steps: kept in
the state as a cache, saved with it, never updated) maps the gradient to rank r; Adam moments there give R~ = m / (sqrt(v) + eps).
The raw gradient is scaled channel-wise by ||R~_c|| / ||R_c|| (APOLLO) or tensor-wise
(APOLLO-Mini, rank 1), times sqrt(scale), passed through the Fira norm-growth limiter, and
applied with Adam's bias-corrected step size. Groups without `rank` are plain AdamW.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from .base import LowRankOptimizer
from .costs import OptimizerCost
from .adamw import adam_direction_
from .galore import as_matrix, low_rank_shape, project, project_right

LIMITER_GAMMA = 1.01


def random_projector(shape: tuple[int, int], rank: int, *, seed: int, device: torch.device | str = "cpu"
                     ) -> torch.Tensor:
    """N(0, 1/r) projector from a seed: (r, cols) if rows >= cols else (rows, r)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    if project_right(shape):
        p = torch.randn(rank, shape[1], generator=gen)
    else:
        p = torch.randn(shape[0], rank, generator=gen)
    return (p / math.sqrt(rank)).to(device)


def projection_seed(seed: int, step: int, update_proj_gap: int) -> int:
    """Seed of the projection in force at 1-based `step`: changes every update_proj_gap steps."""
    return (seed * 1_000_003 + (step - 1) // update_proj_gap) % (2**63)


def init_apollo_state(param: torch.Tensor, *, rank: int) -> dict[str, Any]:
    rows, cols = as_matrix(param).shape
    low = low_rank_shape((rows, cols), min(rank, rows, cols))
    return {"exp_avg": torch.zeros(low, device=param.device),
            "exp_avg_sq": torch.zeros(low, device=param.device),
            "scaled_grad_norm": torch.zeros((), device=param.device),
            "proj": None, "proj_seed": None}  # proj: a cache, always re-derivable from proj_seed


def apollo_step_(
    param: torch.Tensor,  # (rows, ...) fp32, updated in place
    grad: torch.Tensor,  # same shape
    state: dict[str, Any],  # from init_apollo_state
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,  # 1-based
    rank: int,
    update_proj_gap: int,
    scale: float,
    mini: bool,
    seed: int,
) -> None:
    """One APOLLO (or APOLLO-Mini) step."""
    g = as_matrix(grad).float()
    shape = (g.shape[0], g.shape[1])
    r = 1 if mini else min(rank, *shape)
    pseed = projection_seed(seed, step, update_proj_gap)
    if state.get("proj_seed") != pseed:  # regenerated (not updated) when the window changes
        state["proj"] = random_projector(shape, r, seed=pseed, device=g.device)
        state["proj_seed"] = pseed
    proj = state["proj"]
    low = project(g, proj)
    norm_low = adam_direction_(state, low, beta1=beta1, beta2=beta2, eps=eps)
    if mini:
        factor = norm_low.norm() / (low.norm() + 1e-8)
    else:
        dim = 1 if project_right(shape) else 0  # norm over the rank dimension: one per channel
        factor = norm_low.norm(dim=dim, keepdim=True) / (low.norm(dim=dim, keepdim=True) + 1e-8)
    scaled = g * factor
    norm = scaled.norm()
    prev = state["scaled_grad_norm"]
    if step > 1:  # norm-growth limiter (Fira): growth per step capped at LIMITER_GAMMA
        limiter = torch.clamp(norm / (prev + 1e-8), min=LIMITER_GAMMA) / LIMITER_GAMMA
        scaled = scaled / limiter
        norm = norm / limiter
    prev.copy_(norm)
    step_size = lr * math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)
    param.add_((scaled * math.sqrt(scale)).view(param.shape), alpha=-step_size)
    if weight_decay > 0.0:
        param.add_(param, alpha=-lr * weight_decay)


def apollo_state_bytes(shape: tuple[int, ...], rank: Optional[int], *, mini: bool = False) -> float:
    if rank is None or len(shape) < 2:
        return 8.0 * math.prod(shape)
    rows, cols = shape[0], math.prod(shape[1:])
    r = 1 if mini else min(rank, rows, cols)
    # moments, the scaled-gradient norm, the projector (offload.update.table counts the same)
    return 8.0 * math.prod(low_rank_shape((rows, cols), r)) + 4.0 + 4.0 * r * (cols if rows >= cols else rows)


class ApolloAdamW(LowRankOptimizer):
    """APOLLO; `mini=True` (or ApolloMini) is rank-1 tensor-wise scaling. `rank` per group."""

    _mini_default = False
    state_family = "ApolloAdamW"  # (ApolloMini's too: `mini` is a group key)
    suggested_rank = 256

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, *, rank: Optional[int] = None,
                 update_proj_gap: int = 200, scale: float = 1.0, mini: Optional[bool] = None,
                 seed: int = 0) -> None:
        mini = self._mini_default if mini is None else mini
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      rank=rank, update_proj_gap=update_proj_gap, scale=scale,
                                      mini=mini, seed=seed))

    @classmethod
    def cost(cls) -> OptimizerCost:
        mini = cls._mini_default
        return OptimizerCost(
            state_bytes_per_param=8.0, read_bytes_per_param=8.0, write_bytes_per_param=4.0,
            flops_per_param=4.0 * (1 if mini else 128) + 10,
            note="state scales with rank: use state_bytes(shape, rank); per-param figures are the "
            "AdamW fallback", state_bytes=lambda shape, rank: apollo_state_bytes(shape, rank, mini=mini))

    def _projected_step(self, p: torch.Tensor, master: torch.Tensor, group: dict[str, Any],
                        state: dict[str, Any], index: int, hyper: dict[str, float]) -> None:
        if not state:
            state.update(init_apollo_state(p, rank=1 if group["mini"] else group["rank"]), step=0)
        state["step"] += 1
        apollo_step_(master, p.grad, state, step=state["step"], rank=group["rank"],
                     update_proj_gap=group["update_proj_gap"], scale=group["scale"],
                     mini=group["mini"], seed=group["seed"] * 7919 + index, **hyper)


class ApolloMini(ApolloAdamW):
    """APOLLO-Mini: rank-1 projection, tensor-wise scaling (the paper uses scale=128)."""

    suggested_rank = 1

    _mini_default = True
