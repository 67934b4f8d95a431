"""Checkpoint names <-> the model's parameters, with transformers' own rules, streamed.

A checkpoint on disk need not use the model's module names: real Pythia checkpoints store the
head as `embed_out`, Mixtral and Qwen-MoE store one 2-D tensor per expert where transformers'
modules hold fused 3-D expert tensors, and a tied checkpoint stores a tied weight once (or, from
older tools, twice). transformers converts them when it loads (`conversion_mapping`,
`core_model_loading`) and converts back when it saves; this module applies those same
transforms, one target tensor at a time, so a checkpoint never sits in memory whole:

- loading (`iter_checkpoint`): every checkpoint key is renamed by transformers'
  `rename_source_key`; keys that feed one converter (e.g. the experts of one layer) are read
  together and converted by the converter's own `convert`. A key that maps to nothing (and that
  transformers does not ignore either) and a parameter that nothing fills are ModelErrors, so no
  parameter ever trains from its placeholder.
- tied weights are what the model ties (parameters that are one object after `tie_weights()`),
  not what one config key says. A checkpoint that stores the tied duplicate too loads when the
  two copies are bit-identical (checked) and is refused otherwise: transformers would untie
  them, but the model here is built tied, and training one of two different heads would be a
  silent wrong result (set `tie_word_embeddings: false` in config.json to train both).
- export (`iter_export`): the names save_pretrained writes (tied duplicates dropped by
  transformers' `remove_tied_weights_from_state_dict`, then `revert_weight_conversion`, which
  writes the layout the checkpoint was loaded from, or the original layout for a new model).
"""

from __future__ import annotations

import hashlib
import logging
from copy import deepcopy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from .loading import ModelError, read_safetensors_index, read_tensor

log = logging.getLogger(__name__)


@dataclass
class ModelLayout:
    """Names and shapes of a model built on the meta device (computed before the engine swaps
    its parameters for chunk views): the facts loading and export need."""

    canonical: dict[str, str]       # state-dict name -> the parameter's first name (the engine's)
    meta: dict[str, torch.Tensor]   # state-dict name -> meta tensor (params, persistent buffers)
    buffers: set[str]               # persistent buffers (in checkpoints, not trained)
    save_names: list[str]           # what save_pretrained writes, before reverting conversions

    @classmethod
    def of(cls, model: torch.nn.Module) -> "ModelLayout":
        from transformers.modeling_utils import remove_tied_weights_from_state_dict

        first: dict[int, str] = {}
        canonical = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            canonical[name] = first.setdefault(id(p), name)
        state = model.state_dict()
        buffers = set(state) - set(canonical)
        kept = remove_tied_weights_from_state_dict(dict(state), model)
        ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
        meta = {k: torch.empty_like(v, device="meta") for k, v in state.items()}
        return cls(canonical=canonical, meta=meta, buffers=buffers,
                   save_names=[k for k in kept if k not in ignored])

    @property
    def ties(self) -> dict[str, list[str]]:
        """{parameter name: its other names} for every tied parameter."""
        out: dict[str, list[str]] = {}
        for name, canon in self.canonical.items():
            if name != canon:
                out.setdefault(canon, []).append(name)
        return out


# -- loading --------------------------------------------------------------------------------

@dataclass
class _Target:
    """One unit of reading: the checkpoint keys that make one (or, split, several) tensors."""

    name: str                                     # the first state-dict name it makes
    sources: list[tuple[str, str]] = field(default_factory=list)  # (key, converter pattern)
    converter: Any = None                         # a transformers WeightConverter, or None


@dataclass
class CheckpointPlan:
    model_dir: Path
    files: dict[str, tuple[Path, int, dict]]      # key -> (file, data offset, header entry)
    targets: list[_Target]

    def where(self, key: str) -> str:
        return self.files[key][0].name


def plan_checkpoint(model: torch.nn.Module, layout: ModelLayout, model_dir: "str | Path"
                    ) -> CheckpointPlan:
    """Map every tensor of the safetensors checkpoint in `model_dir` to the model (headers
    only, no tensor read). Records the transforms used on `model._weight_conversions`, as
    from_pretrained does, so the export writes the same layout back. ModelError: a key that maps
    to nothing, a parameter that nothing fills, a tensor of the wrong shape."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (WeightConverter, dot_natural_key,
                                                 rename_source_key)

    model_dir = Path(model_dir)
    files = read_safetensors_index(model_dir)
    mapping = get_model_conversion_mapping(model)
    renamings = [t for t in mapping if not isinstance(t, WeightConverter)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    prefix, known = model.base_model_prefix, layout.meta
    targets: dict[str, _Target] = {}
    unexpected = []
    for key in sorted(files, key=dot_natural_key):  # transformers' order: experts 0, 1, .. 10
        name, pattern = rename_source_key(key, renamings, converters, prefix, known)
        if name not in known and key in known:  # as transformers: the key was right as it was
            name, pattern = rename_source_key(key, [], [], prefix, known)
        if name not in known:
            unexpected.append(key)
            continue
        target = targets.setdefault(name, _Target(name))
        if target.sources and (pattern is None or target.converter is None):
            raise ModelError(f"{files[key][0]}: tensors {target.sources[0][0]!r} and {key!r} "
                             f"both map to {name}")
        if pattern is not None and target.converter is None:
            target.converter = deepcopy(by_pattern[pattern])
        target.sources.append((key, pattern))
    _refuse_unexpected(model, unexpected, files)
    model._weight_conversions = [t for t in mapping if t.was_used()]

    filled = {layout.canonical[n] for t in targets.values() for n in _made_names(t)
              if n in layout.canonical}
    missing = [n for n in dict.fromkeys(layout.canonical.values()) if n not in filled]
    if missing:
        raise ModelError(f"{model_dir}: the checkpoint has no tensor for parameter {missing[0]!r}"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    for t in targets.values():
        if t.converter is None:
            (key, _), = t.sources
            shape, want = tuple(files[key][2]["shape"]), tuple(known[t.name].shape)
            if shape != want:
                raise ModelError(f"{files[key][0]}: tensor {key!r} has shape {shape}, the "
                                 f"model's {t.name} {want}")
    order = sorted(targets.values(), key=lambda t: min(
        (str(files[k][0]), files[k][2]["data_offsets"][0]) for k, _ in t.sources))
    return CheckpointPlan(model_dir=model_dir, files=files, targets=order)


def _made_names(t: _Target) -> list[str]:
    """The state-dict names a target makes (a converter may split one key into several)."""
    if t.converter is None:
        return [t.name]
    first = t.converter.target_patterns[0]
    return [t.name.replace(first, p) for p in t.converter.target_patterns]


def _refuse_unexpected(model, keys: list[str], files: dict) -> None:
    """Keys no parameter takes: skipped where transformers' own rules skip them (e.g. Pythia's
    `attention.masked_bias`, old `rotary_emb.inv_freq`), else a ModelError naming the first."""
    if not keys:
        return
    from transformers.utils.loading_report import LoadStateDictInfo

    info = LoadStateDictInfo(missing_keys=set(), unexpected_keys=set(keys), mismatched_keys=set(),
                             error_msgs=[], conversion_errors={}, skipped_pp_keys=set())
    model._adjust_missing_and_unexpected_keys(info)
    left = [k for k in keys if k in info.unexpected_keys]
    if left:
        raise ModelError(f"{files[left[0]][0]}: tensor {left[0]!r} maps to no parameter of "
                         f"{type(model).__name__}" + (f" (and {len(left) - 1} more keys)"
                                                      if len(left) > 1 else ""))
    log.info("skipped %d checkpoint tensors transformers ignores too (e.g. %s)", len(keys), keys[0])


def iter_checkpoint(model: torch.nn.Module, layout: ModelLayout, model_dir: "str | Path"
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """(parameter name, tensor) for every parameter of `model`, converted from the checkpoint
    in `model_dir` one target at a time (at most the sources of one target are in memory:
    e.g. one layer's experts). Persistent buffers found in the checkpoint are copied into the
    model's buffers. Tied duplicates are checked equal to what was loaded, then skipped."""
    plan = plan_checkpoint(model, layout, model_dir)
    shaped = _AsBuilt(model, layout)
    handles: dict[Path, Any] = {}
    loaded: dict[str, tuple] = {}  # tied parameter -> (digest, name) of what filled it
    ties = layout.ties
    done: set[str] = set()
    try:
        for target in plan.targets:
            for name, tensor in _convert(target, plan, shaped, handles).items():
                where = plan.where(target.sources[0][0])
                want = tuple(layout.meta[name].shape) if name in layout.meta else None
                if tuple(tensor.shape) != want:
                    raise ModelError(f"{plan.model_dir / where}: {target.sources[0][0]!r} converts "
                                     f"to {name} of shape {tuple(tensor.shape)}, the model's is "
                                     f"{want}")
                if name in layout.buffers:
                    with torch.no_grad():
                        model.get_buffer(name).copy_(tensor)
                    continue
                canon = layout.canonical[name]
                if canon in ties:  # one object with several names: load once, check the rest
                    digest = _digest(tensor)
                    if canon in loaded:
                        first_digest, first = loaded[canon]
                        if digest != first_digest:
                            raise ModelError(
                                f"{plan.model_dir / where}: {name} differs from {first}, which "
                                "this model ties it to; set tie_word_embeddings false in "
                                "config.json to train two tensors")
                        continue
                    loaded[canon] = (digest, name)
                done.add(canon)
                yield canon, tensor
    finally:
        for f in handles.values():
            f.close()
    missing = [n for n in dict.fromkeys(layout.canonical.values()) if n not in done]
    if missing:  # plan_checkpoint predicted otherwise: never train a placeholder
        raise ModelError(f"{plan.model_dir}: nothing in the checkpoint filled parameter "
                         f"{missing[0]!r}")


class _AsBuilt:
    """The model as converters see it: its parameters as built (meta tensors of the right shape
    and dtype; some ops size their output by them), since the engine has replaced them by the
    time the weights stream in. Everything else is the model's."""

    def __init__(self, model, layout: ModelLayout):
        self._model, self._meta = model, layout.meta

    def get_parameter(self, name: str) -> torch.Tensor:
        return self._meta[name]

    get_parameter_or_buffer = get_parameter

    def __getattr__(self, name: str):
        return getattr(self._model, name)


def _digest(t: torch.Tensor) -> str:
    t = t.detach().to(torch.float32).contiguous()
    return hashlib.sha256(t.view(torch.uint8).numpy().data).hexdigest()


def _convert(target: _Target, plan: CheckpointPlan, model, handles) -> dict[str, torch.Tensor]:
    """{state-dict name: tensor} of one target, read from disk now."""
    def reader(key):
        path, base, entry = plan.files[key]
        if path not in handles:
            handles[path] = open(path, "rb")
        return lambda: read_tensor(handles[path], base, key, entry, path)

    if target.converter is None:
        (key, _), = target.sources
        return {target.name: reader(key)()}
    conv = target.converter
    for key, pattern in target.sources:
        conv.add_tensor(target.name, key, pattern, reader(key))
    try:
        out = conv.convert(target.name, model=model, config=model.config)  # model: _AsBuilt
    except Exception as e:
        key = target.sources[0][0]
        raise ModelError(f"{plan.files[key][0]}: cannot convert {key!r} and the other "
                         f"{len(target.sources) - 1} tensors of {target.name} "
                         f"({type(e).__name__}: {e})") from None
    return {k: (v[0] if isinstance(v, list) else v) for k, v in out.items()}


# -- export ---------------------------------------------------------------------------------

def iter_export(model: torch.nn.Module, layout: ModelLayout,
                named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) as save_pretrained would write them for `model` holding the tensors of
    `named` (parameter names; a tied parameter under any of its names, once): tied duplicates
    dropped, persistent buffers from `model`, conversions reverted by transformers'
    `revert_weight_conversion`, one group of tensors at a time (a group: what one reverse
    converter needs, e.g. one layer's fused experts -> its per-expert tensors)."""
    from transformers.core_model_loading import revert_weight_conversion

    shaped = _AsBuilt(model, layout)
    saved = {layout.canonical.get(n, n): n for n in layout.save_names}
    group_of = _export_groups(model, layout.save_names)
    members: dict[tuple, list[str]] = {}
    for n, g in group_of.items():
        members.setdefault(g, []).append(n)
    pending: dict[tuple, dict[str, torch.Tensor]] = {}

    def add(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        g = group_of[name]
        got = pending.setdefault(g, {})
        got[name] = tensor
        if len(got) == len(members[g]):
            yield from revert_weight_conversion(shaped, pending.pop(g)).items()

    seen = set()
    for name, tensor in named:
        canon = layout.canonical.get(name)
        if canon is None:
            raise ModelError(f"export: {name!r} is no parameter of {type(model).__name__}")
        if canon in seen:
            continue  # a tied parameter given under a second name
        seen.add(canon)
        yield from add(saved[canon], tensor)
    for name in layout.save_names:
        if name in layout.buffers:
            yield from add(name, model.get_buffer(name).detach().to("cpu", copy=True))
    for g, got in pending.items():
        left = sorted(set(members[g]) - set(got))
        raise ModelError(f"export: no tensor was given for {left[0]!r}")


def _first_converter(name: str, converters: list) -> tuple[str, "str | None"]:
    """`name` renamed by the first converter that matches it, and that converter's pattern
    (None: none matched). transformers >= 5.2x has this as `apply_converters`; 5.17 (seen on a
    CUDA machine) lacks it, while every 5.x converter has `rename_source_key`."""
    for converter in converters:
        renamed, pattern = converter.rename_source_key(name)
        if pattern is not None:
            return renamed, pattern
    return name, None


def _export_groups(model, names: list[str]) -> dict[str, tuple]:
    """{saved name: group}: names that one reverse converter turns into tensors together share
    a group (the key that converter renames them to); every other name is its own group."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, WeightConverter

    transforms = getattr(model, "_weight_conversions", None)
    if transforms is None:  # a new model: the transforms save_pretrained reverts for it
        transforms = [t for t in get_model_conversion_mapping(model, add_legacy=False)
                      if not isinstance(t, PrefixChange)]
    reverse = [t.reverse_transform() for t in transforms[::-1]]
    converters = [t for t in reverse if isinstance(t, WeightConverter)]
    out = {}
    for n in names:
        renamed, pattern = _first_converter(n, converters)
        out[n] = ("converted", renamed) if pattern is not None else ("single", n)
    return out
