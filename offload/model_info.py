"""What the engine needs to know about a model's structure."""

from __future__ import annotations

import torch


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
