"""GaLore (Zhao et al. 2024): Adam on the gradient projected onto its top-r singular subspace.

The projector P comes from an SVD of the gradient every `update_proj_gap` steps; it projects
along the smaller dimension. Moments live in the r-dimensional space (fp32 or 8-bit); the
normalized update is projected back and multiplied by `scale`. Groups without `rank` (and
1-D params) are plain AdamW, so embeddings and norms can stay full-rank.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from .adamw import adam_direction_, init_adamw_state
from .adamw8bit import adamw8bit_step_, init_adamw8bit_state, state_bytes_8bit
from .base import LowRankOptimizer
from .costs import OptimizerCost


def as_matrix(t: torch.Tensor) -> torch.Tensor:  # (d0, ...) -> (d0, prod(rest))
    return t.reshape(t.shape[0], -1)


def project_right(shape: tuple[int, ...]) -> bool:
    """True when rows >= cols: the projector acts on the columns, G @ P.T is (rows, r)."""
    return shape[0] >= shape[1]


def svd_projector(grad: torch.Tensor, rank: int) -> torch.Tensor:  # grad: (rows, cols)
    """Orthonormal projector of the top-`rank` singular space: (r, cols) if right else (rows, r)."""
    u, _, vh = torch.linalg.svd(grad.float(), full_matrices=False)
    return vh[:rank].contiguous() if project_right(tuple(grad.shape)) else u[:, :rank].contiguous()


def project(grad: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:  # (rows, cols) -> low rank
    return grad @ proj.T if project_right(tuple(grad.shape)) else proj.T @ grad


def project_back(low: torch.Tensor, proj: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    return low @ proj if project_right(shape) else proj @ low


def low_rank_shape(shape: tuple[int, int], rank: int) -> tuple[int, int]:
    return (shape[0], rank) if project_right(shape) else (rank, shape[1])


def init_galore_state(param: torch.Tensor, *, rank: int, eight_bit: bool = False) -> dict[str, Any]:
    rows, cols = as_matrix(param).shape
    r = min(rank, rows, cols)
    low = torch.empty(low_rank_shape((rows, cols), r), device=param.device)
    state: dict[str, Any] = init_adamw8bit_state(low) if eight_bit else init_adamw_state(low)
    state["proj"] = None
    return state


def galore_step_(
    param: torch.Tensor,  # (rows, ...) fp32, updated in place
    grad: torch.Tensor,  # same shape as param
    state: dict[str, Any],  # from init_galore_state
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
    eight_bit: bool = False,
) -> None:
    """One GaLore-AdamW step (order as the reference: update, then decoupled weight decay)."""
    g = as_matrix(grad).float()
    shape = (g.shape[0], g.shape[1])
    if state["proj"] is None or (step - 1) % update_proj_gap == 0:
        state["proj"] = svd_projector(g, min(rank, *shape))
    low = project(g, state["proj"])
    if eight_bit:
        # the 8-bit Adam step on a zero buffer with lr=1 leaves -(Adam direction) in it
        direction = torch.zeros(low.numel(), dtype=torch.float32, device=low.device)
        adamw8bit_step_(direction, low, state, lr=1.0, beta1=beta1, beta2=beta2, eps=eps,
                        weight_decay=0.0, step=step)
        norm_low = direction.view(low.shape).neg_()
        step_size = lr
    else:
        norm_low = adam_direction_(state, low, beta1=beta1, beta2=beta2, eps=eps)
        step_size = lr * math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)
    update = project_back(norm_low, state["proj"], shape) * scale
    param.add_(update.view(param.shape), alpha=-step_size)
    if weight_decay > 0.0:
        param.add_(param, alpha=-lr * weight_decay)


def galore_state_bytes(shape: tuple[int, ...], rank: Optional[int], *, eight_bit: bool = False) -> float:
    """State bytes of one tensor: projector (fp32) + two moments of the low-rank gradient."""
    if rank is None or len(shape) < 2:
        return 8.0 * math.prod(shape)
    rows, cols = shape[0], math.prod(shape[1:])
    r = min(rank, rows, cols)
    low = low_rank_shape((rows, cols), r)
    proj = 4.0 * r * (cols if project_right((rows, cols)) else rows)
    moments = state_bytes_8bit(low) if eight_bit else 8.0 * math.prod(low)
    return proj + moments


class GaLoreAdamW(LowRankOptimizer):
    """GaLore-AdamW. Put `rank` (and optionally update_proj_gap, scale) in a param group."""

    _eight_bit = False
    state_family = "GaLoreAdamW"

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, *, rank: Optional[int] = None,
                 update_proj_gap: int = 200, scale: float = 0.25) -> None:
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      rank=rank, update_proj_gap=update_proj_gap, scale=scale))

    @classmethod
    def cost(cls) -> OptimizerCost:
        eight = cls._eight_bit
        return OptimizerCost(
            state_bytes_per_param=8.0, read_bytes_per_param=8.0, write_bytes_per_param=4.0,
            flops_per_param=4.0 * 128, note="state and flops scale with rank: use state_bytes(shape, rank); "
            "per-param figures are for the full-rank (AdamW) fallback, flops for r=128",
            state_bytes=lambda shape, rank: galore_state_bytes(shape, rank, eight_bit=eight))

    def _projected_step(self, p: torch.Tensor, master: torch.Tensor, group: dict[str, Any],
                        state: dict[str, Any], index: int, hyper: dict[str, float]) -> None:
        if not state:
            state.update(init_galore_state(p, rank=group["rank"], eight_bit=self._eight_bit), step=0)
        state["step"] += 1
        galore_step_(master, p.grad, state, step=state["step"], rank=group["rank"],
                     update_proj_gap=group["update_proj_gap"], scale=group["scale"],
                     eight_bit=self._eight_bit, **hyper)


class GaLoreAdamW8bit(GaLoreAdamW):
    """GaLore with 8-bit blockwise moments in the subspace (the AdamW8bit step)."""

    _eight_bit = True
    state_family = "GaLoreAdamW8bit"
    plain_reference = False  # (its reference runs bitsandbytes' AdamW8bit on what it does not project)
