"""`finetune export --merge`: a PEFT LoRA adapter added into its base checkpoint, streamed.

The base checkpoint is read tensor by tensor (and a tensor larger than the memory budget in
blocks of rows) straight from its safetensors files; each targeted weight gets the adapter's
delta with PEFT's own arithmetic (`LoraLayer.get_delta_weight`, then `weight += delta`), and
the result is written into safetensors shards whose headers are planned from the base's
headers before any data is read, so no shard is ever held in memory. The output keeps the
base's key layout (transformers converts it on load as it converts the base), its config
(dtype updated with --dtype), tokenizer and generation files.

The delta is added to the checkpoint's original weights. For a QLoRA run that is the
unquantised base, not the NF4 weights the adapters were trained over: the merged model then
differs from the trained one by the base's quantisation error (as PEFT's merge onto an
unquantised base does), where merging into the dequantised NF4 weights would make that error
a permanent part of every weight, targeted or not.

Adapters on parameters (`target_parameters`: PEFT's ParamWrapper, e.g. over Mixtral's fused
3-D experts `experts.gate_up_proj` and its router `gate.weight`) are merged as ParamWrapper.merge
does: which parameter each (nested) wrapper adapts, its experts and scaling are read off PEFT's
own injection of the adapter config into the meta model; the delta is get_delta_weight's (per
expert B @ A, cast to the weight's dtype, then added). A base checkpoint that stores the experts
per expert (what transformers converts into the fused tensor on load) gets them converted with
transformers' converter (cli.layout), the delta added, and converted back
(`revert_weight_conversion`) into the same keys: one layer's fused tensor at a time, refused
when that is over the memory budget.

What is refused (ModelError, one line): an adapter other than LoRA, DoRA, `lora_bias`,
modules_to_save / trainable tokens, an adapter tensor this module cannot place, a target the
base checkpoint lacks (or only makes through a fused conversion, for a module target), a shape
that does not fit, and an output directory that is the base or the adapter, or non-empty
without `overwrite`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from . import tensorfile
from .loading import ModelError, _ST_DTYPES, _safetensors_header, read_safetensors_index
from ..offload.core.sizes import parse_size

ADAPTER_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."                 # PeftModel's prefix of the wrapped model's names
WEIGHT_FILES = ("model.safetensors.index.json",)


@dataclass
class _Delta:
    """One adapted module: where its A and B are, how PEFT computes its delta."""

    module: str
    kind: str                                 # "linear", "conv1d" (fan_in_fan_out), "embedding"
    a_key: str
    b_key: str
    scaling: float
    base_copy: str | None = None              # adapter key of a saved base_layer.weight, if any
    experts: int = 0                          # "param": the experts of a 3-D parameter (0: 2-D)
    swapped: bool = False                     # "param", 3-D: stored [experts, out, in] (else [e, in, out])


@dataclass
class _Group:
    """A parameter the base checkpoint makes by a conversion (e.g. one layer's per-expert
    tensors -> the fused experts): converted, merged and converted back at once, on first use."""

    target: Any                               # cli.layout._Target
    name: str                                 # the model's state-dict name of the parameter
    plan: Any                                 # cli.layout.CheckpointPlan
    model: Any                                # cli.layout._AsBuilt
    deltas: list[_Delta]
    done: dict[str, torch.Tensor] | None = None


@dataclass
class _Out:
    """One output tensor: its checkpoint key, source, output dtype, and deltas (PEFT's order)."""

    key: str
    entry: dict
    path: Path
    base: int
    dtype: torch.dtype
    deltas: list[_Delta] = field(default_factory=list)
    group: _Group | None = None

    @property
    def shape(self) -> list[int]:
        return list(self.entry["shape"])

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * _elem(self.dtype)


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def read_lora_config(adapter_dir: Path):
    """The adapter's LoraConfig through PEFT's own reader; ModelError for anything else."""
    from peft import LoraConfig, PeftConfig

    if not (adapter_dir / "adapter_config.json").exists():
        raise ModelError(f"--adapter {adapter_dir}: no adapter_config.json in this directory")
    if not (adapter_dir / ADAPTER_FILE).exists():
        raise ModelError(f"--adapter {adapter_dir}: no {ADAPTER_FILE} (only safetensors "
                         "adapters are merged)")
    try:
        config = PeftConfig.from_pretrained(str(adapter_dir))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelError(f"--adapter {adapter_dir}: cannot read adapter_config.json "
                         f"({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})"
                         ) from None
    kind = getattr(config.peft_type, "value", config.peft_type)
    if not isinstance(config, LoraConfig) or kind != "LORA":
        raise ModelError(f"--adapter {adapter_dir}: a {kind} adapter; only LoRA adapters are "
                         "merged")
    for flag, what in (("use_dora", "DoRA"), ("lora_bias", "lora_bias"),
                       ("modules_to_save", "modules_to_save"),
                       ("trainable_token_indices", "trainable_token_indices"),
                       ("layer_replication", "layer_replication")):
        if getattr(config, flag, None):
            raise ModelError(f"--adapter {adapter_dir}: {what} adapters are not merged (plain "
                             "LoRA only)")
    return config


def _scaling(config, module: str, r: int) -> float:
    """PEFT's scaling for `module` (LoraModel._create_and_replace + LoraLayer.update_layer)."""
    import math

    from peft.utils.other import get_pattern_key

    r_key = get_pattern_key(config.rank_pattern.keys(), module)
    alpha_key = get_pattern_key(config.alpha_pattern.keys(), module)
    want_r = config.rank_pattern.get(r_key, config.r)
    alpha = config.alpha_pattern.get(alpha_key, config.lora_alpha)
    if want_r != r:
        raise ModelError(f"adapter module {module}: rank {r} in {ADAPTER_FILE}, {want_r} in "
                         "adapter_config.json")
    return alpha / math.sqrt(r) if config.use_rslora else alpha / r


def plan_merge(adapter_dir: Path, base_dir: Path, *, dtype: torch.dtype | None,
               trust_remote_code: bool = False) -> tuple[list[_Out], dict]:
    """Every base tensor as it will be written, with the deltas that go into it; and the
    adapter's header ({key: entry}). Headers only: no tensor is read."""
    from transformers.pytorch_utils import Conv1D

    from .layout import ModelLayout, plan_checkpoint
    from .loading import resolve_model

    lcfg = read_lora_config(adapter_dir)
    source = resolve_model(str(base_dir), trust_remote_code=trust_remote_code)
    from .loading import build_meta_model

    model = build_meta_model(source.config)
    layout = ModelLayout.of(model)
    ckpt = plan_checkpoint(model, layout, base_dir)
    key_of = {t.name: t.sources[0][0] for t in ckpt.targets if t.converter is None}
    fused = {t.name for t in ckpt.targets if t.converter is not None}

    a_base, a_meta = _safetensors_header(adapter_dir / ADAPTER_FILE)
    modules: dict[str, dict[str, str]] = {}
    for key in a_meta:
        if not key.startswith(PREFIX):
            raise ModelError(f"{adapter_dir / ADAPTER_FILE}: tensor {key!r} is not a PEFT model's "
                             f"(expected the prefix {PREFIX!r})")
        rest = key[len(PREFIX):]
        for part in (".lora_A.weight", ".lora_B.weight", ".lora_embedding_A",
                     ".lora_embedding_B", ".base_layer.weight"):
            if rest.endswith(part):
                modules.setdefault(rest[: -len(part)], {})[part] = key
                break
        else:
            raise ModelError(f"{adapter_dir / ADAPTER_FILE}: tensor {key!r} is no LoRA weight "
                             "(only lora_A/lora_B of plain LoRA are merged)")

    outputs: dict[str, _Out] = {}
    for key, (path, base, entry) in read_safetensors_index(base_dir).items():
        stored = _ST_DTYPES.get(entry["dtype"])
        if stored is None:
            raise ModelError(f"{path}: tensor {key!r} has unsupported dtype {entry['dtype']}")
        out_dtype = dtype if dtype is not None and stored.is_floating_point else stored
        outputs[key] = _Out(key, entry, path, base, out_dtype)

    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    wrappers = _param_wrappers(source.config, lcfg)
    groups: dict[str, _Group] = {}
    for module in sorted(modules, key=lambda m: order.get(m, -1)):
        parts = modules[module]
        if module in wrappers:
            _plan_param_delta(module, parts, wrappers[module], a_meta, layout=layout, ckpt=ckpt, model=model,
                              outputs=outputs, key_of=key_of, groups=groups, base_dir=base_dir)
            continue
        if module not in order:
            raise ModelError(f"adapter module {module}: {type(model).__name__} has no such module")
        mod = model.get_submodule(module)
        if isinstance(mod, torch.nn.Embedding):
            kind, a_part, b_part = "embedding", ".lora_embedding_A", ".lora_embedding_B"
        elif isinstance(mod, Conv1D):  # PEFT forces fan_in_fan_out for Conv1D
            kind, a_part, b_part = "conv1d", ".lora_A.weight", ".lora_B.weight"
        elif isinstance(mod, torch.nn.Linear):  # ... and turns it off for Linear
            kind, a_part, b_part = "linear", ".lora_A.weight", ".lora_B.weight"
        else:
            raise ModelError(f"adapter module {module}: a {type(mod).__name__}; only Linear, "
                             "Conv1D and Embedding LoRA layers are merged")
        if a_part not in parts or b_part not in parts or len(set(parts) - {".base_layer.weight"}) != 2:
            raise ModelError(f"adapter module {module}: expected {a_part[1:]} and {b_part[1:]} for "
                             f"a {type(mod).__name__}, found {sorted(p[1:] for p in parts)}")
        a, b = a_meta[parts[a_part]]["shape"], a_meta[parts[b_part]]["shape"]
        if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
            raise ModelError(f"adapter module {module}: lora A {a} and B {b} do not chain")
        param = layout.canonical.get(f"{module}.weight")
        if param is None:
            raise ModelError(f"adapter module {module}: {type(model).__name__} has no {module}.weight")
        if param in fused:
            raise ModelError(f"adapter module {module}: the base checkpoint makes {param} by a "
                             "fused conversion; merging into it is not supported")
        names = [n for n, c in layout.canonical.items() if c == param]
        keys = [key_of[n] for n in names if n in key_of]
        if not keys:
            raise ModelError(f"adapter module {module}: the base checkpoint {base_dir} has no "
                             f"tensor for {module}.weight")
        want = {"linear": [b[0], a[1]], "conv1d": [a[1], b[0]], "embedding": [a[1], b[0]]}[kind]
        delta = _Delta(module, kind, parts[a_part], parts[b_part], _scaling(lcfg, module, a[0]),
                       parts.get(".base_layer.weight"))
        for k in keys:
            if outputs[k].shape != want:
                raise ModelError(f"adapter module {module}: its delta has shape {want}, the base's "
                                 f"{k!r} {outputs[k].shape} (in {outputs[k].path.name})")
            outputs[k].deltas.append(delta)
    files = sorted({o.path for o in outputs.values()})
    ranked = sorted(outputs.values(), key=lambda o: (files.index(o.path), o.entry["data_offsets"][0]))
    return ranked, {"base": a_base, "meta": a_meta, "path": adapter_dir / ADAPTER_FILE}


def _param_wrappers(config, lcfg) -> dict[str, Any]:
    """{module name in the adapter file: PEFT's ParamWrapper} for an adapter on parameters
    (target_parameters), from PEFT's own injection of the adapter config into a meta model:
    which parameter each (nested) wrapper adapts, its experts, layout and scaling."""
    if not getattr(lcfg, "target_parameters", None):
        return {}
    import copy

    from peft import inject_adapter_in_model
    from peft.tuners.lora.layer import ParamWrapper

    from .loading import build_meta_model

    model = build_meta_model(config)
    try:
        inject_adapter_in_model(copy.deepcopy(lcfg), model, adapter_name="default", low_cpu_mem_usage=True)
    except ValueError as e:
        raise ModelError(f"adapter: PEFT cannot apply its config to {type(model).__name__} "
                         f"({(str(e).splitlines() or [type(e).__name__])[0]})") from None
    return {n: m for n, m in model.named_modules() if isinstance(m, ParamWrapper)}


def _plan_param_delta(module: str, parts: dict, wrapper, a_meta: dict, *, layout, ckpt, model,
                      outputs: dict, key_of: dict, groups: dict, base_dir: Path) -> None:
    """Place the delta of one ParamWrapper (an adapter on a parameter: a fused 3-D expert
    stack, or a 2-D weight such as Mixtral's router) on the tensor(s) the base stores it in."""
    from .layout import _AsBuilt

    if set(parts) != {".lora_A.weight", ".lora_B.weight"}:
        raise ModelError(f"adapter module {module}: expected lora_A and lora_B for an adapter on "
                         f"{wrapper.parameter_name}, found {sorted(p[1:] for p in parts)}")
    a, b = a_meta[parts[".lora_A.weight"]]["shape"], a_meta[parts[".lora_B.weight"]]["shape"]
    experts, r = wrapper.num_experts, wrapper.r["default"]
    if len(a) != 2 or len(b) != 2 or a[0] != r * experts or b[1] != r * experts:
        raise ModelError(f"adapter module {module}: lora A {a} and B {b} are not rank {r} over "
                         f"{experts} experts")
    owner = ".".join(p for p in module.split(".") if p != "base_layer")
    name = f"{owner}.{wrapper.parameter_name}"
    param = layout.canonical.get(name)
    if param is None:
        raise ModelError(f"adapter module {module}: {type(model).__name__} has no {name}")
    swapped = bool(wrapper._did_swap_in_out_features)
    if experts > 1:
        want = [experts, b[0], a[1]] if swapped else [experts, a[1], b[0]]
    else:
        want = [b[0], a[1]]
    if list(layout.meta[param].shape) != want:
        raise ModelError(f"adapter module {module}: its delta has shape {want}, {param} "
                         f"{list(layout.meta[param].shape)}")
    delta = _Delta(module, "param", parts[".lora_A.weight"], parts[".lora_B.weight"],
                   float(wrapper.scaling["default"]), experts=experts if experts > 1 else 0, swapped=swapped)
    if param in key_of:  # stored as the model holds it: merged in blocks of rows (experts)
        k = key_of[param]
        if outputs[k].shape != want:
            raise ModelError(f"adapter module {module}: its delta has shape {want}, the base's "
                             f"{k!r} {outputs[k].shape}")
        outputs[k].deltas.append(delta)
        return
    target = next((t for t in ckpt.targets if t.name == param and t.converter is not None), None)
    if target is None:
        raise ModelError(f"adapter module {module}: the base checkpoint {base_dir} has no tensor "
                         f"for {param} (or makes it together with others)")
    if param not in groups:
        groups[param] = _Group(target, param, ckpt, _AsBuilt(model, layout), [])
        for key, _ in target.sources:
            outputs[key].group = groups[param]
    groups[param].deltas.append(delta)


def group_bytes(g: _Group) -> int:
    """Working memory of merging one converted parameter: its sources, the converted tensor,
    the fp32 delta and its product (upper bound), in the stored dtype's size."""
    meta = g.model._meta[g.name]
    return meta.numel() * (2 * meta.element_size() + 8)


def _group_tensor(o: _Out, src: "_Adapter") -> torch.Tensor:
    """Output `o` of a converted parameter: the group converted from the checkpoint, merged
    (ParamWrapper.merge: param += delta cast to its dtype) and converted back, on first use."""
    from transformers.core_model_loading import revert_weight_conversion

    from .layout import _convert

    g = o.group
    if g.done is None:
        handles: dict[Path, Any] = {}
        try:
            made = _convert(g.target, g.plan, g.model, handles)
        finally:
            for h in handles.values():
                h.close()
        if list(made) != [g.name]:
            raise ModelError(f"merge: the checkpoint's conversion of {g.name} makes {sorted(made)}; "
                             "merging into it is not supported")
        w = made[g.name]
        rows = w.shape[0]
        for d in g.deltas:
            w += _delta_rows(d, src.get(d.a_key), src.get(d.b_key), 0, rows, whole=True).to(w.dtype)
        back = revert_weight_conversion(g.model, {g.name: w})
        want = {k for k, _ in g.target.sources}
        if set(back) != want:
            raise ModelError(f"merge: converting {g.name} back gives {sorted(back)[:2]}..., not the base "
                             f"checkpoint's keys {sorted(want)[:2]}...")
        g.done = dict(back)
    t = g.done.pop(o.key)
    if list(t.shape) != o.shape:
        raise ModelError(f"merge: {o.key!r} converts back to shape {list(t.shape)}, the base's is {o.shape}")
    return t


def _read_rows(f, base: int, entry: dict, lo: int, hi: int, what: str) -> torch.Tensor:
    """Rows lo:hi (of the first dimension) of a safetensors tensor, with a plain file read."""
    stored = _ST_DTYPES.get(entry["dtype"])
    if stored is None:
        raise ModelError(f"{what} has unsupported dtype {entry['dtype']}")
    shape = list(entry["shape"])
    row = _elem(stored)
    for s in shape[1:]:
        row *= s
    buf = torch.empty((hi - lo) * row, dtype=torch.uint8)
    f.seek(base + entry["data_offsets"][0] + lo * row)
    if f.readinto(memoryview(buf.numpy())) != buf.numel():
        raise ModelError(f"{what}: truncated")
    return buf.view(stored).reshape([hi - lo] + shape[1:]) if shape else buf.view(stored).reshape(())


class _Adapter:
    """The adapter file, read one tensor at a time (only the current module's A and B)."""

    def __init__(self, info: dict):
        self.info = info
        self.f = open(info["path"], "rb")

    def get(self, key: str, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        entry = self.info["meta"][key]
        hi = (entry["shape"][0] if entry["shape"] else 1) if hi is None else hi
        return _read_rows(self.f, self.info["base"], entry, lo, hi,
                          f"{self.info['path']}: tensor {key!r}")

    def close(self) -> None:
        self.f.close()


def _delta_rows(d: _Delta, a: torch.Tensor, b: torch.Tensor, lo: int, hi: int, whole: bool
                ) -> torch.Tensor:
    """Rows lo:hi of PEFT's get_delta_weight (same ops, same order: B @ A, transposed, times
    scaling). A half-precision adapter is computed in fp32, as PeftModel.from_pretrained's
    default (autocast_adapter_dtype) holds it."""
    if b.dtype in (torch.float16, torch.bfloat16):
        a, b = a.float(), b.float()
    if d.kind == "param" and d.experts:  # ParamWrapper.get_delta_weight over experts lo:hi
        a = a.reshape(d.experts, -1, a.shape[-1])  # experts x rank x in
        b = b.reshape(b.shape[0], -1, d.experts)  # out x rank x experts
        if not whole:
            a, b = a[lo:hi], b[..., lo:hi]
        eq = "o r e, e r i -> e o i" if d.swapped else "o r e, e r i -> e i o"
        return torch.einsum(eq, b, a) * d.scaling
    if d.kind in ("linear", "param"):
        prod = b @ a if whole else b[lo:hi] @ a
    else:  # conv1d (fan_in_fan_out) and embedding: transpose(B @ A)
        prod = (b @ a).T if whole else (b @ a[:, lo:hi]).T
    return prod * d.scaling


def write_merged(outputs: list[_Out], adapter: dict, out_dir: Path, *, block_bytes: int,
                 max_shard_bytes: int, on_tensor: Callable[[str], None] = lambda k: None
                 ) -> dict[str, str]:
    """Write every output tensor into planned shards (headers first, then data, streamed);
    returns the weight map. A tensor whose rows take more than `block_bytes` of working memory
    is processed in blocks of rows."""
    shards: list[list[_Out]] = [[]]
    size = 0
    for o in outputs:  # save_pretrained's rule: a new shard when this tensor would overflow
        if shards[-1] and size + o.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(o)
        size += o.nbytes
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]

    src = _Adapter(adapter)
    handles: dict[Path, Any] = {}
    weight_map = {}
    try:
        for name, shard in zip(names, shards):
            tmp = out_dir / (name + ".tmp")
            with open(tmp, "wb") as f:
                f.write(_header(shard))
                for o in shard:
                    if o.path not in handles:
                        handles[o.path] = open(o.path, "rb")
                    _write_tensor(f, handles[o.path], o, src, block_bytes)
                    weight_map[o.key] = name
                    on_tensor(o.key)
            os.replace(tmp, out_dir / name)
    finally:
        src.close()
        for h in handles.values():
            h.close()
    return weight_map


def _header(shard: list[_Out]) -> bytes:
    return tensorfile.header([(o.key, o.dtype, tuple(o.shape)) for o in shard], metadata={"format": "pt"})


def _write_tensor(f, base_f, o: _Out, src: _Adapter, block_bytes: int) -> None:
    if o.group is not None:
        w = _group_tensor(o, src).to(o.dtype).contiguous()
        f.write(memoryview(w.reshape(-1).view(torch.uint8).numpy()))
        return
    shape = o.shape
    rows = shape[0] if shape else 1
    per_row = 1
    for s in shape[1:]:
        per_row *= s
    # working bytes per element: the stored value, the output's, and with a delta its fp32
    # product and scaled copy
    per_elem = _elem(_ST_DTYPES[o.entry["dtype"]]) + _elem(o.dtype) + (8 if o.deltas else 0)
    step = max(1, min(rows, block_bytes // max(per_row * per_elem, 1)))
    ab = [(d, src.get(d.a_key), src.get(d.b_key)) for d in o.deltas]
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        w = _read_rows(base_f, o.base, o.entry, lo, hi, f"{o.path}: tensor {o.key!r}")
        for d in o.deltas:  # PEFT saves embedding layers' base weights too: they must be ours
            if d.base_copy is not None and not torch.equal(src.get(d.base_copy, lo, hi), w):
                raise ModelError(f"adapter module {d.module}: the adapter stores its own "
                                 f"{d.module}.weight and it differs from the base's {o.key!r}")
        for d, a, b in ab:
            delta = _delta_rows(d, a, b, lo, hi, whole=(lo == 0 and hi == rows))
            # an adapter on a parameter casts its delta to the weight's dtype first (ParamWrapper)
            w += delta.to(w.dtype) if d.kind == "param" else delta
        w = w.to(o.dtype).contiguous()
        f.write(memoryview(w.reshape(-1).view(torch.uint8).numpy()))


def merge(adapter_dir: "str | Path", base_dir: "str | Path", out_dir: "str | Path", *,
          dtype: "str | None" = None, cpu_mem: "str | int" = "2G", max_shard_size: "str | int" = "5G",
          overwrite: bool = False, trust_remote_code: bool = False, progress: bool = True) -> Path:
    """Merge the LoRA adapter in `adapter_dir` into the checkpoint in `base_dir`, streamed, and
    write an ordinary Hugging Face model directory to `out_dir` (see the module docstring)."""
    from .export import DTYPES

    adapter_dir, base_dir, out_dir = Path(adapter_dir), Path(base_dir), Path(out_dir)
    if dtype is not None and dtype not in DTYPES:
        raise ModelError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
    torch_dtype = DTYPES[dtype] if dtype is not None else None
    budget = parse_size(cpu_mem, what="--cpu-mem")
    shard = parse_size(max_shard_size, what="--shard-size")
    for name, d in (("--base", base_dir), ("--adapter", adapter_dir)):
        if not d.is_dir():
            raise ModelError(f"{name} {d}: not a directory")
        if out_dir.exists() and out_dir.resolve() == d.resolve():
            raise ModelError(f"--output {out_dir} is the {name} directory: write the merged "
                             "model elsewhere")
    if out_dir.exists() and not out_dir.is_dir():
        raise ModelError(f"--output {out_dir}: not a directory")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise ModelError(f"--output {out_dir} is not empty (add --overwrite to replace its model "
                         "files)")
    outputs, adapter = plan_merge(adapter_dir, base_dir, dtype=torch_dtype,
                                  trust_remote_code=trust_remote_code)
    meta = adapter["meta"]
    numel = lambda k: meta[k]["shape"][0] * meta[k]["shape"][1]  # noqa: E731
    need = max((4 * (numel(d.a_key) + numel(d.b_key)) for o in outputs for d in o.deltas),
               default=0)  # one module's A and B, in fp32, stay in memory while it is merged
    if need > budget // 2:
        raise ModelError(f"--cpu-mem {cpu_mem}: one adapter module's A and B take {need} bytes; "
                         "give at least twice that")
    groups = {id(o.group): o.group for o in outputs if o.group is not None}
    big = max(groups.values(), key=group_bytes, default=None)
    if big is not None and group_bytes(big) + need > budget:
        raise ModelError(f"--cpu-mem {cpu_mem}: the base stores {big.name} per expert; merging it converts the "
                         f"whole tensor at once ({group_bytes(big) + need} bytes with its adapter): give at least that")
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in _model_files(out_dir):  # --overwrite: stale shards of an earlier merge would be read too
        old.unlink()
    _copy_side_files(base_dir, out_dir, torch_dtype)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("merge"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[key]}"),
                   TimeElapsedColumn(), console=Console(stderr=True), disable=not progress)
    with bar:
        task = bar.add_task("merge", total=len(outputs), key="")
        weight_map = write_merged(outputs, adapter, out_dir, block_bytes=budget // 2,
                                  max_shard_bytes=shard,
                                  on_tensor=lambda k: bar.update(task, advance=1, key=k))
    if len(set(weight_map.values())) > 1:
        total = sum(o.nbytes for o in outputs)
        with open(out_dir / WEIGHT_FILES[0], "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return out_dir


def _model_files(out_dir: Path) -> list[Path]:
    """The weight files save_pretrained names (model.safetensors, model-00001-of-00002.safetensors,
    the index): only these are replaced, never a user's other files (model_backup.safetensors)."""
    shard = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
    return [p for p in out_dir.iterdir() if p.is_file() and (p.name in ("model.safetensors", *WEIGHT_FILES)
                                                             or shard.fullmatch(p.name))]


def _copy_side_files(base_dir: Path, out_dir: Path, dtype: torch.dtype | None) -> None:
    """config.json (dtype updated), tokenizer and generation files: every top-level file of the
    base but its weights."""
    for p in sorted(base_dir.iterdir()):
        if not p.is_file() or p.name.endswith((".safetensors", ".bin", ".pt", ".pth", ".h5",
                                               ".msgpack")) or p.name in WEIGHT_FILES \
                or p.name.endswith(".index.json"):
            continue
        if p.name == "config.json" and dtype is not None:
            raw = json.loads(p.read_text())
            name = str(dtype).removeprefix("torch.")
            raw["dtype" if "torch_dtype" not in raw else "torch_dtype"] = name
            raw["dtype"] = name
            (out_dir / p.name).write_text(json.dumps(raw, indent=2) + "\n")
            continue
        shutil.copyfile(p, out_dir / p.name)
