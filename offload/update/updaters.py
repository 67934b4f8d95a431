"""Chunk updaters by optimizer name: how the engine runs each optim/ algorithm.

Names, default ranks and the projection rule come from the optimizer table (`.table`).
Projection rule of the low-rank optimizers (GaLore, APOLLO): parameters with two or more
dimensions are projected, except embeddings and the output head (vocabulary-sized rows that
the papers keep in full AdamW); norms and biases are 1-D and stay AdamW. The drop-in
equivalent is two param groups, [projected (rank=r), the rest], in model order — which is
also the order `SlotUpdater` numbers parameters in.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ..core.chunks import ChunkPlan
from .table import LOW_RANK, NAMES, OPTIMIZERS, projected_params
from .update import AdamWChunks, Hyper, SGDChunks, SlotUpdater
from ...optim.adamw import adamw_step_, init_adamw_state, plain_step_
from ...optim.adamw8bit import adamw8bit_step_, init_adamw8bit_state
from ...optim.apollo import apollo_step_, init_apollo_state
from ...optim.base import check_low_rank
from ...optim.galore import as_matrix, galore_step_, init_galore_state, svd_projector

__all__ = ["LOW_RANK", "NAMES", "drop_in_groups", "make_updater", "projected_params"]


def drop_in_groups(model: torch.nn.Module, *, rank: int, **extra: Any) -> list[dict]:
    """Param groups giving the drop-in optimizer the engine's projection rule."""
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    proj = projected_params(shapes)
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n in proj], "rank": rank, **extra},
            {"params": [p for n, p in named if n not in proj]}]


def _hyper(hp: Hyper) -> dict:
    return dict(lr=hp.lr, beta1=hp.betas[0], beta2=hp.betas[1], eps=hp.eps, weight_decay=hp.weight_decay)


def _adam8(plan: ChunkPlan, order: list[str], proj: set[str]) -> SlotUpdater:
    # (the slots SlotUpdater calls "projected" are here the embeddings: fp32 moments, table.fp32_embeddings)
    full = {n for n, s in plan.slots.items() if s.embedding}

    def run(p: Any, g: Any, state: dict, *, step: int, index: int, projected: bool, hp: Hyper) -> None:
        work = p if p.is_contiguous() else p.contiguous()  # as AdamW8bit does: blocks in logical order
        adamw8bit_step_(work, g, state, step=step, **_hyper(hp))
        if work is not p:
            p.copy_(work)

    return SlotUpdater("adamw8bit", plan, order=order, projected=full,
                       init=lambda meta, fp32: init_adamw8bit_state(meta, fp32=fp32), run=run)


def _galore(plan: ChunkPlan, order: list[str], proj: set[str], *, eight_bit: bool, rank: int,
            update_proj_gap: int = 200, scale: float = 0.25) -> SlotUpdater:
    def init(meta: torch.Tensor, projected: bool) -> dict:
        if not projected:
            return init_adamw_state(meta)
        st = init_galore_state(meta, rank=rank, eight_bit=eight_bit)
        st["proj"] = svd_projector(as_matrix(meta), min(rank, *as_matrix(meta).shape))  # room for it
        return st

    plain = adamw_step_ if eight_bit else plain_step_  # (the reference's, as the drop-in's)

    def run(p: Any, g: Any, state: dict, *, step: int, index: int, projected: bool, hp: Hyper) -> None:
        if projected:
            galore_step_(p, g, state, step=step, rank=rank, update_proj_gap=update_proj_gap, scale=scale,
                         eight_bit=eight_bit, **_hyper(hp))
        else:
            plain(p, g, state, step=step, **_hyper(hp))

    return SlotUpdater("galore8bit" if eight_bit else "galore", plan, order=order, projected=proj, init=init, run=run)


def _apollo(plan: ChunkPlan, order: list[str], proj: set[str], *, mini: bool, rank: int,
            update_proj_gap: int = 200, scale: float = 1.0, seed: int = 0) -> SlotUpdater:
    r = 1 if mini else rank  # defaults as the drop-in ApolloAdamW / ApolloMini

    def init(meta: torch.Tensor, projected: bool) -> dict:
        if not projected:
            return init_adamw_state(meta)
        st = init_apollo_state(meta, rank=r)
        rows, cols = as_matrix(meta).shape
        k = min(r, rows, cols)
        st["proj"] = torch.empty(_apollo_proj_shape(rows, cols, k), device="meta")
        return st

    def run(p: Any, g: Any, state: dict, *, step: int, index: int, projected: bool, hp: Hyper) -> None:
        if projected:
            apollo_step_(p, g, state, step=step, rank=rank, update_proj_gap=update_proj_gap, scale=scale,
                         mini=mini, seed=seed * 7919 + index, **_hyper(hp))
        else:  # (not projected: the reference's AdamW, as the drop-in's)
            plain_step_(p, g, state, step=step, **_hyper(hp))

    return SlotUpdater("apollo-mini" if mini else "apollo", plan, order=order, projected=proj, init=init, run=run)


def _apollo_proj_shape(rows: int, cols: int, k: int) -> tuple[int, int]:
    from ...optim.apollo import random_projector

    return tuple(random_projector((rows, cols), k, seed=0, device="meta").shape)


def _options(builder: Any, fixed: tuple[str, ...]) -> set[str]:
    """The optimizer_kwargs a builder takes: its keyword-only arguments but those make_updater sets."""
    params = inspect.signature(builder).parameters.values()
    return {p.name for p in params if p.kind is p.KEYWORD_ONLY and p.name not in fixed}


def options(name: str) -> set[str]:
    """The optimizer_kwargs the updater of `name` takes (none for adamw, sgd, adamw8bit)."""
    if name in ("galore", "galore8bit"):
        return _options(_galore, ("eight_bit",))
    if name in ("apollo", "apollo-mini"):
        return _options(_apollo, ("mini",))
    if name == "mezo":
        from .zeroth import MeZOChunks

        return _options(MeZOChunks, ("order",))
    return set()


def make_updater(name: str, plan: ChunkPlan, *, shapes: dict[str, tuple[int, ...]], momentum: float = 0.0,
                 **kwargs: Any):
    """The chunk updater for optimizer `name` (kwargs: rank, update_proj_gap, scale, seed);
    a low-rank optimizer without `rank` takes the table's default_rank (as the planner does)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(NAMES)}")
    # an option the updater does not take would be silently ignored: refuse it, naming the ones it takes
    takes = options(name)
    unknown = sorted(set(kwargs) - takes)
    if unknown:
        raise ValueError(f"optimizer {name!r} does not take the option(s) {', '.join(unknown)}; it takes "
                         f"{', '.join(sorted(takes)) or 'none'}")
    if momentum and name != "sgd":
        raise ValueError(f"momentum={momentum} is an SGD option; optimizer {name!r} does not use it")
    if name in LOW_RANK and kwargs.get("rank") is None:
        kwargs["rank"] = OPTIMIZERS[name].default_rank
    if name in LOW_RANK:
        builder = _galore if name.startswith("galore") else _apollo
        defaults = {k: p.default for k, p in inspect.signature(builder).parameters.items()}
        check_low_rank(kwargs["rank"], kwargs.get("update_proj_gap", defaults["update_proj_gap"]),
                       kwargs.get("scale", defaults["scale"]))
    proj = projected_params(shapes) if name in LOW_RANK else set()
    order = [n for n in shapes if n in proj] + [n for n in shapes if n not in proj]
    if name == "adamw":
        return AdamWChunks(plan)
    if name == "sgd":
        return SGDChunks(plan, momentum)
    if name == "adamw8bit":
        return _adam8(plan, order, proj)
    if name in ("galore", "galore8bit"):
        return _galore(plan, order, proj, eight_bit=name == "galore8bit", **kwargs)
    if name in ("apollo", "apollo-mini"):
        return _apollo(plan, order, proj, mini=name == "apollo-mini", **kwargs)
    if name == "mezo":
        from .zeroth import MeZOChunks

        return MeZOChunks(plan, order=list(shapes), **kwargs)
    raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(NAMES)}")
