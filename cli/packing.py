"""Which model families keep packed rows apart (pure, no torch): cli.data packs for them with
per-row position ids (see its docstring); the planner prices those batches (row_positions)."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

#: Model types whose attention isolates packed rows given per-row position_ids (and no attention
#: mask or KV cache); each is tested against its rows run alone (tests/test_cli_packing.py).
ISOLATING = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text", "gemma3",
                       "gpt2", "gpt_neox", "falcon"})


def isolates(config: Any, *, pack: bool = True) -> bool:
    """Whether packed rows of this model are isolated (ISOLATING); says once when they are not."""
    kind = getattr(config, "model_type", None)
    if kind in ISOLATING or not pack:
        return pack
    if kind not in _told:
        _told.add(kind)
        log.warning("packed documents attend to the ones before them in their block: model type %r is not one "
                    "whose attention isolates them (--no-pack trains each document alone)", kind)
    return False


_told: set = set()


def use_segments(model: Any) -> bool:
    """Attend packed rows per segment (offload.engine.segments: no B x S x S mask) where the
    family keeps them apart and its attention is SDPA; the ISOLATING families pass position
    ids to their attention, which that needs."""
    if getattr(getattr(model, "config", None), "model_type", None) not in ISOLATING:
        return False
    from ..offload.engine.segments import use_segments as install

    return install(model)


def keeps_mask(config: Any) -> bool:
    """Whether batches keep their padding mask (cli.data.batch_of): the model reads it beyond
    attention. A MoE router's auxiliary loss averages over the tokens the mask marks real."""
    return bool(getattr(config, "output_router_logits", False))
