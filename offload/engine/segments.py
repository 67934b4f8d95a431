"""Packed rows without a dense mask: attention run per segment.

A packed batch keeps its rows apart by per-row position ids that restart at 0 (cli.data).
transformers' SDPA path turns that into a B x 1 x S x S mask, which at long lengths outweighs
the model (64K tokens: 4 GiB of bool, and SDPA's additive copy on top). For rows of
perfmodel.SEGMENTS_FROM tokens or more, the attention here reads the segments from the
position ids instead and runs causal SDPA on each, as each row would run alone; nothing
S x S exists. A sliding window shorter than such a row (Gemma-3's local layers, Mistral 7B
v0.1's) is attended in blocks of `window` queries, each over the keys its window reaches (at
most 2 x window - 1) with a band mask of that size: the row's segments each alone too. Every
other case (a padding mask, a cache) is transformers' own SDPA, unchanged.

`use_segments(model)` switches a model whose attention is transformers' "sdpa" to it.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

from ..plan import perfmodel  # SEGMENTS_FROM, the planner's too (read at each call)

NAME = "tierwise_sdpa"
SDPA = ("sdpa", NAME)  # the attention implementations that are SDPA: transformers' and this one
_registered = False


class _Causal:
    """The mask of a causal batch without padding: each packed row sees itself only. The
    attention reads the rows from the position ids; a model that does not pass them to its
    attention is refused there (its rows would see each other)."""

    def __repr__(self) -> str:
        return "<causal per packed row>"


CAUSAL = _Causal()


class Window:
    """The mask of a batch without padding whose attention slides a window shorter than its
    rows: each query sees itself and the `size` - 1 keys before it, in its own packed row."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __repr__(self) -> str:
        return f"<sliding window of {self.size} per packed row>"


def _mask(*, attention_mask=None, use_vmap: bool = False, local_size=None, q_length: int = 0, kv_length: int = 0,
          q_offset: int = 0, kv_offset: int = 0, **kwargs):
    """transformers' SDPA mask, except where the only reason for one can be packing (no padding
    mask, no cache: the queries are the keys, no window shorter than them, no extra mask
    function, causal) and the row is long (perfmodel.SEGMENTS_FROM tokens: a shorter one's
    mask is small, and one SDPA call a layer costs the launching thread less than one per
    segment): CAUSAL."""
    from transformers.masking_utils import sdpa_mask

    if (attention_mask is None and not use_vmap and q_length == kv_length >= perfmodel.SEGMENTS_FROM and not q_offset and not kv_offset
            and "allow_is_bidirectional_skip" not in kwargs):
        return CAUSAL if local_size is None or local_size >= kv_length else Window(local_size)
    return sdpa_mask(attention_mask=attention_mask, use_vmap=use_vmap, local_size=local_size, q_length=q_length,
                     kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset, **kwargs)


def _find(position_ids: torch.Tensor) -> list[list[tuple[int, int]]] | None:
    """Each row's segments [(start, end)] where its position ids step by other than 1; None
    when no row has more than one. Reads the ids on the host (a device's: a wait for it)."""
    step = torch.diff(position_ids, dim=-1) != 1
    if not bool(step.any()):
        return None
    spans = []
    for row in step.cpu().tolist():
        cuts = [0] + [j + 1 for j, cut in enumerate(row) if cut] + [len(row) + 1]
        spans.append(list(zip(cuts, cuts[1:])))
    return spans


class _Spans:
    """The last batch's segments, keyed by its position-ids tensor: every layer (and the
    recompute) reads the same one, and finding them reads the ids on the host once; where the
    engine moved the batch to the device, from the host's copy (`known`), so the launching
    thread never waits for the device to read them."""

    def __init__(self) -> None:
        self.ids: Any = None
        self.spans: list[list[tuple[int, int]]] | None = None
        self.key: Any = None  # the spans as a key (signature)

    def _set(self, ids: torch.Tensor, spans: "list[list[tuple[int, int]]] | None") -> None:
        self.ids, self.spans = weakref.ref(ids), spans
        self.key = None if spans is None else tuple(map(tuple, spans))

    def known(self, host_ids: torch.Tensor, device_ids: torch.Tensor) -> None:
        """`device_ids` is a copy of `host_ids` (a 2-d CPU tensor): its segments, found here."""
        if host_ids.dim() == 2 and host_ids.shape[-1] >= perfmodel.SEGMENTS_FROM:
            self._set(device_ids, _find(host_ids))

    def of(self, position_ids: torch.Tensor, rows: int) -> list[list[tuple[int, int]]] | None:
        if self.ids is None or self.ids() is not position_ids:
            self._set(position_ids, _find(position_ids))
        if self.spans is not None and len(self.spans) == 1 and rows > 1:  # ids broadcast over the rows
            return self.spans * rows
        return self.spans


#: The last packed batch's segments; `last.key` is them as a key (None: it had none): what a
#: recompute saves depends on them (offload.engine.hooks.recomputing).
last = _Spans()
known = last.known


def _attention(module, query, key, value, attention_mask, *, position_ids=None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    spans = None
    window = attention_mask.size if isinstance(attention_mask, Window) else None
    if attention_mask is CAUSAL or window:
        attention_mask = None
        if position_ids is None:
            raise NotImplementedError(f"{type(module).__name__} does not pass position_ids to its attention: "
                                      "packed rows cannot be kept apart without a dense mask")
        if query.shape[2] > 1 and key.shape[2] == query.shape[2]:
            spans = last.of(position_ids, query.shape[0])
    if spans is None and not window:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    rows = []
    for b, row in enumerate(spans or [[(0, query.shape[2])]] * query.shape[0]):
        parts = []
        for a, z in row:
            parts += _windowed(module, query[b:b + 1], key[b:b + 1], value[b:b + 1], a, z, window, **kwargs) \
                if window and z - a > window else \
                [sdpa_attention_forward(module, query[b:b + 1, :, a:z], key[b:b + 1, :, a:z], value[b:b + 1, :, a:z],
                                        None, **kwargs)[0]]
        rows.append(torch.cat(parts, dim=1))
    return torch.cat(rows, dim=0), None


def _windowed(module, query, key, value, a: int, z: int, window: int, **kwargs) -> list:
    """One segment [a, z) of a row attended through a sliding `window`: blocks of `window`
    queries, each over the keys the window reaches from them, with the band mask a query at
    block row r keeps (keys r .. r + window - 1 of the block's, the last being itself)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    band = _band(window, query.device)
    out = []
    for i in range(a, z, window):
        j, k0 = min(i + window, z), max(a, i - window + 1)
        d = k0 - (i - window + 1)  # the keys the segment's start cuts off the band (the first block: causal)
        out.append(sdpa_attention_forward(module, query[:, :, i:j], key[:, :, k0:j], value[:, :, k0:j],
                                          band[None, None, :j - i, d:d + j - k0], **kwargs)[0])
    return out


@functools.lru_cache(maxsize=8)
def _band(window: int, device: torch.device) -> torch.Tensor:
    """The band mask of a block of `window` queries over the 2 x window - 1 keys before and at
    them (made once per window and device: every layer and row takes the same one)."""
    rows = torch.arange(window, device=device)
    cols = torch.arange(2 * window - 1, device=device)
    return (cols[None, :] >= rows[:, None]) & (cols[None, :] < rows[:, None] + window)


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(NAME, _attention)
        AttentionMaskInterface.register(NAME, _mask)
        _registered = True


def uses_sdpa(config: Any) -> bool:
    """Whether transformers runs this config's attention with SDPA (what use_segments replaces)."""
    return getattr(config, "_attn_implementation", None) in SDPA


def use_segments(model: torch.nn.Module) -> bool:
    """Run `model`'s attention per packed segment (see the module docstring) where it is
    transformers' SDPA without a positional bias in its mask (ALiBi: the model adds it to the
    mask it gets); False (unchanged) otherwise."""
    config = getattr(model, "config", None)
    if config is None or not uses_sdpa(config) or getattr(config, "alibi", False):
        return False
    if config._attn_implementation != NAME:
        _register()
        model.set_attn_implementation(NAME)
    return True
