"""LoRA / QLoRA as the planner sees it (pure, no torch): which parameters a run trains, which
it freezes and how a frozen chunk is stored.

`lora_specs` turns a model's parameters (as `ModelProfile.param_specs()` lists them, in
`named_parameters()` order) into those of the same model after PEFT's `inject_adapter_in_model`
(what `Engine(model, lora=LoraConfig(...))` trains): each targeted linear `X` becomes
`X.base_layer.weight` (+ `.bias`) then `X.lora_A.default.weight` [r, in] and
`X.lora_B.default.weight` [out, r]; everything but the adapters is frozen. Which modules are
linears comes from the model (`engine.frozen_base.linear_modules`: nn.Linear, GPT-2's Conv1D,
the output head), or for a model profile from its Llama-family names; the targets are PEFT's
(`all-linear`, or names matching a module or its dotted suffix), for every family the CLI
trains (tests/test_plan_lora.py compares with peft.get_peft_model). The activations and the
step's trace below are a Llama-family decoder's (the families the planner has profiles for). `frozen_chunk_bytes`
is the engine's blob size of a frozen chunk (`runtime.frozen.layout_of`, `core.encoding`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..core.chunks import ChunkPlan, ParamSpec
from ..core.encoding import BASE_DTYPES, QUANTIZED, aligned, encoded_nbytes, fused_experts
from ..core.errors import TierwiseError, UnsupportedModel

#: The nn.Linear modules of a Llama-family decoder layer (PEFT's "all-linear" takes them all,
#: never the output head); Phi-3's fused ones in their place.
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_LINEARS = ("qkv_proj", "gate_up_proj")
#: A vision tower's linears beside q/k/v_proj (SigLIP's: Gemma-3 4B and up), which all-linear adapts too.
VISION_LINEARS = ("out_proj", "fc1", "fc2")

#: Kinds of module `lora_specs` can adapt (`linears`): an nn.Linear (weight [out, in]; an int8/NF4
#: base encodes it), a subclass of it (adapted, not encoded: the engine encodes plain nn.Linear
#: only), transformers' Conv1D (GPT-2; weight [in, out], not encoded), and the output head (a
#: linear that "all-linear" leaves out and no base dtype encodes).
KINDS = ("linear", "subclass", "conv1d", "head")


@dataclass(frozen=True)
class LoraModel:
    """The parameters of a LoRA run, in the engine's order, and what the planner needs of them."""

    specs: tuple[ParamSpec, ...]
    frozen: frozenset[str]
    quantizable: frozenset[str]
    """Frozen parameters an int8/NF4 base encodes: nn.Linear weights, not the output head, and
    fused MoE experts (`core.encoding.fused_experts`)."""
    targets: frozenset[str]
    """Short names of the targeted linears (e.g. {"q_proj", "v_proj"})."""
    rank: int


def profile_linears(specs: Sequence[ParamSpec]) -> dict[str, str]:
    """The linears of a Llama-family model profile ({module: kind}): its decoder layers'
    LINEARS (or FUSED_LINEARS), and lm_head, the output head (absent when tied)."""
    out = {}
    for s in specs:
        module, _, leaf = s.name.rpartition(".")
        if leaf == "weight" and module.rpartition(".")[2] in (*LINEARS, *FUSED_LINEARS, "shared_expert_gate", *VISION_LINEARS):
            out[module] = "linear"
        elif s.name == "lm_head.weight":
            out[module] = "head"
    return out


def parse_targets(targets: "str | Sequence[str]", linears: "dict[str, str] | None" = None) -> frozenset[str]:
    """"all-linear" or a comma-separated list of module names (PEFT's target_modules): the short
    names of the linears they take (`linears`: {module: kind} of the model; None: a Llama-family
    profile's)."""
    names = _names(targets)
    if linears is None:
        linears = {f"model.layers.0.x.{n}": "linear" for n in LINEARS}
    body = [m for m, k in linears.items() if k != "head"]  # a head adapter is not priced
    known = sorted({m.rpartition(".")[2] for m in body})
    unknown = sorted(n for n in names if not any(_matches(m, n) for m in body))
    if names != ["all-linear"] and (unknown or not names):
        # not a wrong name (the CLI checks names against the model first): a module the planner
        # does not price (the head, an embedding): the run measures its budgets instead
        raise UnsupportedModel(f"--lora-targets {','.join(names) or '(none)'}: the planner prices LoRA on the "
                               f"linears {', '.join(known)} (or all-linear); not on {', '.join(unknown) or '-'}")
    return frozenset(m.rpartition(".")[2] for m in _targeted(linears, targets))


def _names(targets: "str | Sequence[str]") -> list[str]:
    return [t.strip() for t in (targets.split(",") if isinstance(targets, str) else targets) if t.strip()]


def _matches(module: str, target: str) -> bool:
    """PEFT's rule for a target_modules list entry: the module's name, or its dotted suffix."""
    return module == target or module.endswith("." + target)


def _targeted(linears: dict[str, str], targets: "str | Sequence[str]") -> set[str]:
    """The modules PEFT adapts: every linear but the head for "all-linear", else each linear a
    target name matches (PEFT's `_maybe_include_all_linear_layers`, `check_target_module_exists`)."""
    names = _names(targets)
    body = [m for m, k in linears.items() if k != "head"]
    return set(body) if names == ["all-linear"] else {m for m in body if any(_matches(m, n) for n in names)}


#: Per MoE family, the transformers v4 names PEFT maps onto its fused experts (and, `gate`, its
#: router), adapted as parameters (`target_parameters`: not priced), when a target names them
#: or is all-linear; Qwen2-MoE's after PEFT 0.21.0 (before, all-linear and those names adapted
#: only its dense linears: the shared expert's, which keep the names).
EXPERT_NAMES = {"mixtral": frozenset({"gate", "w1", "w2", "w3"}),
                "qwen2_moe": frozenset({"gate", "gate_proj", "up_proj", "down_proj"})}


def adapts_experts(family: "str | None") -> frozenset[str]:
    """The target names (EXPERT_NAMES, and "all-linear") with which the installed PEFT adapts
    `family`'s fused experts as parameters; empty where it never does."""
    names = EXPERT_NAMES.get(family or "", frozenset())
    if family == "qwen2_moe" and _peft_version() <= (0, 21, 0):  # (a 0.21.1.dev build may map them: refused)
        return frozenset()
    return names | {"all-linear"} if names else names


def _peft_version() -> tuple[int, ...]:
    """The installed PEFT's (major, minor, patch); a development build counts as its release."""
    import re
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version("peft"))
    except PackageNotFoundError:
        found = None
    if found is None:
        return (1 << 30,)  # (no PEFT here, or an odd version: plan as the newest does)
    return tuple(int(x or 0) for x in found.groups())


def lora_specs(specs: Sequence[ParamSpec], *, rank: int, targets: "str | Sequence[str]",
               linears: "dict[str, str] | None" = None, family: str | None = None) -> LoraModel:
    """`specs` after LoRA injection (see the module docstring); `rank` >= 1. `linears`: the
    model's adaptable modules {name: kind (KINDS)}, as `engine.frozen_base.linear_modules` reads
    them off the module (None: a Llama-family profile's, `profile_linears`). A Conv1D's weight is
    [in, out]: its lora_A is [r, in], its lora_B [out, r], as for a linear.

    Refused (UnsupportedModel) rather than guessed: targets with which PEFT adapts a model's
    fused MoE experts (3-D `...experts.*` parameters) and router as parameters
    (`target_parameters`; `family`: the model's type, adapts_experts), a kind of adapter this
    does not model."""
    if rank < 1:
        raise TierwiseError(f"--lora-rank must be at least 1, got {rank}")
    linears = profile_linears(specs) if linears is None else dict(linears)
    wanted = parse_targets(targets, linears)
    fused = [s.name for s in specs if fused_experts(s.name, s.shape)]
    expert_targets = sorted(set(_names(targets)) & adapts_experts(family)) if fused else []
    if expert_targets:
        rest = sorted(wanted - adapts_experts(family))
        instead = f"--lora-targets {','.join(rest)}" if rest else "attention targets (q_proj,k_proj,v_proj,o_proj)"
        router = " and the router" if {"all-linear", "gate"} & set(expert_targets) else ""
        raise UnsupportedModel(f"LoRA {','.join(expert_targets)} on a model with fused MoE experts ({fused[0]}, ...): "
                               f"PEFT adapts them{router} as parameters (target_parameters), which the "
                               f"planner does not price; training runs as given (the engine measures its budgets); "
                               f"a plan without those adapters: {instead}")
    chosen = _targeted(linears, targets)
    out: list[ParamSpec] = []
    frozen: set[str] = set()
    quantizable: set[str] = set()
    adapters: dict[str, list[ParamSpec]] = {}  # module -> its adapters, after its base parameters
    for s in specs:
        module, _, leaf = s.name.rpartition(".")
        kind = linears.get(module)
        if module in chosen:
            name = f"{module}.base_layer.{leaf}"
            if leaf == "weight":
                rows, cols = s.shape[0], s.numel // s.shape[0]
                out_f, in_f = (cols, rows) if kind == "conv1d" else (rows, cols)
                adapters[module] = [ParamSpec(name=f"{module}.lora_A.default.weight", shape=(rank, in_f)),
                                    ParamSpec(name=f"{module}.lora_B.default.weight", shape=(out_f, rank))]
        else:
            name = s.name
        out.append(ParamSpec(name=name, shape=tuple(s.shape)))
        frozen.add(name)
        if (kind == "linear" and leaf == "weight") or fused_experts(name, s.shape):
            quantizable.add(name)
    if not adapters:
        raise UnsupportedModel("LoRA targets none of this model's linears the planner knows ("
                               + ", ".join(sorted({m.rpartition(".")[2] for m in linears})) + ")")
    # a module's adapters come right after its base layer's parameters (PEFT's registration order)
    last = {s.name.rpartition(".base_layer.")[0]: k for k, s in enumerate(out) if ".base_layer." in s.name}
    result: list[ParamSpec] = []
    for k, s in enumerate(out):
        result.append(s)
        module = s.name.rpartition(".base_layer.")[0]
        if ".base_layer." in s.name and last[module] == k:
            result.extend(adapters[module])
    return LoraModel(specs=tuple(result), frozen=frozenset(frozen), quantizable=frozenset(quantizable),
                     targets=wanted, rank=rank)


def base_dtype_of(name: str, *, base_dtype: "str | None", plain: str, quantizable: frozenset[str]) -> str:
    """One frozen parameter's stored dtype (runtime.frozen.base_dtypes, same rule)."""
    if base_dtype is None:
        return plain
    if base_dtype not in BASE_DTYPES:
        raise TierwiseError(f"--base-dtype must be one of {', '.join(BASE_DTYPES)}, got {base_dtype!r}")
    if base_dtype in QUANTIZED:
        return base_dtype if name in quantizable else plain
    return base_dtype


def frozen_chunk_bytes(plan: ChunkPlan, cid: int, *, base_dtype: "str | None", plain: str, element_size: int,
                       quantizable: frozenset[str], double_quant: bool) -> int:
    """Bytes of frozen chunk `cid`'s one kind: its compute copy, or its encoded blob when some
    parameter in it is stored in another dtype (runtime.frozen.layout_of)."""
    names = plan.chunks[cid].params
    base = {n: base_dtype_of(n, base_dtype=base_dtype, plain=plain, quantizable=quantizable) for n in names}
    if all(b == plain for b in base.values()):
        return plan.chunks[cid].numel * element_size
    return sum(aligned(encoded_nbytes(base[n], plan.slots[n].numel, double_quant=double_quant)) for n in names)


_SUB = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
        "q_norm": "self_attn", "k_norm": "self_attn", "qkv_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp",
        "down_proj": "mlp", "gate_up_proj": "mlp"}
#: A decoder layer's parameter-owning modules in forward order (norms by their own names).
_LAYER = ("input_layernorm", "q_proj", "k_proj", "v_proj", "o_proj", "post_attention_layernorm",
          "gate_proj", "up_proj", "down_proj")
#: The same with the q/k norms of profiles.model.QK_NORM_FAMILIES (each right after its projection).
_QK_LAYER = ("input_layernorm", "q_proj", "q_norm", "k_proj", "k_norm", "v_proj", "o_proj",
             "post_attention_layernorm", "gate_proj", "up_proj", "down_proj")
#: The same of profiles.model.FUSED_FAMILIES.
_FUSED_LAYER = ("input_layernorm", "qkv_proj", "o_proj", "post_attention_layernorm", "gate_up_proj", "down_proj")
#: The same of Gemma-3 (profiles.model.POST_NORM_FAMILIES: q/k norms after the three projections,
#: a norm after the attention and one on each side of the MLP).
_POST_NORM_LAYER = ("input_layernorm", "q_proj", "k_proj", "v_proj", "q_norm", "k_norm", "o_proj",
                    "post_attention_layernorm", "pre_feedforward_layernorm", "gate_proj", "up_proj", "down_proj",
                    "post_feedforward_layernorm")


def _modules(layer: int, part: str, targets: frozenset[str], top: str = "model.") -> list[str]:
    """The modules one part of a layer runs, in order: a targeted linear's base layer, then its
    adapters (lora_A, lora_B); `top`: the text model's prefix (profiles.model.ModelProfile.prefix)."""
    p = f"{top}layers.{layer}."
    if part not in _SUB:
        return [p + part]
    name = f"{p}{_SUB[part]}.{part}"
    if part not in targets or part.endswith("_norm"):
        return [name]
    return [name + ".base_layer", name + ".lora_A.default", name + ".lora_B.default"]


def _needs_grad_in(part: str, targets: frozenset[str]) -> bool:
    """Layer 0 (its input, the frozen embedding's output, needs no gradient): whether `part`'s
    input needs one, i.e. whether backward reads its weights."""
    attention = {*LINEARS[:4], "qkv_proj"}
    first_linear = {"q_norm": {"q_proj"}, "k_norm": {"k_proj"},  # (each reads its own projection's output)
                    "o_proj": attention - {"o_proj"}, "post_attention_layernorm": attention,
                    "gate_proj": attention, "up_proj": attention, "gate_up_proj": attention,
                    "down_proj": attention | {"gate_proj", "up_proj", "gate_up_proj"}}
    return bool(targets & first_linear.get(part, set()))


def step_trace(chunks_of: "dict[str, set[int]]", *, layers: int, targets: frozenset[str], tied: bool,
               recompute: int, blocks: bool = False, qk_norm: bool = False,
               fused: bool = False, post_norms: bool = False, reads_norms: bool = True,
               prefix: str = "model.") -> list[tuple[str, int]]:
    """The access trace ((\"acquire\" | \"release\", chunk), ...) the engine records for one LoRA
    step of a Llama-family model (offload.runtime.trace): each module acquires its chunks for its
    forward; backward reads the weights autograd saved (the output head's, the final norm's, and
    per layer, last first, every module whose input needs a gradient, in reverse; in layer 0 the
    others' adapters' lora_B, whose input is lora_A's output), each
    recomputed layer (the first `recompute` layers) running its forward again first. `chunks_of`:
    module -> its chunks.
    `blocks`: the layers are the units of residency (offload.plan.needs.units_are_blocks): a
    layer's chunks are acquired together for its forward, and for its recompute and backward.
    `qk_norm`: the attention normalises queries and keys (profiles.model.QK_NORM_FAMILIES);
    `fused`: one qkv_proj and one gate_up_proj (profiles.model.FUSED_FAMILIES); `post_norms`:
    Gemma-3's layer (profiles.model.POST_NORM_FAMILIES); `reads_norms`: backward reads the norms'
    weights (False for profiles.model.GEMMA_FAMILIES: their norms save 1 + weight, a copy);
    `prefix`: the text model's names' (profiles.model.ModelProfile.prefix; a vision model's
    tower never runs on text: none of its chunks is in the trace)."""
    events: list[tuple[str, int]] = []
    parts = _POST_NORM_LAYER if post_norms else _FUSED_LAYER if fused else _QK_LAYER if qk_norm else _LAYER
    norms = {"input_layernorm", "q_norm", "k_norm", "post_attention_layernorm", "pre_feedforward_layernorm",
             "post_feedforward_layernorm"}
    read_back = tuple(p for p in parts if reads_norms or p not in norms)  # (what backward reads)

    def acquire_release(cids: "set[int]") -> None:
        events.extend(("acquire", c) for c in sorted(cids))
        events.extend(("release", c) for c in sorted(cids))

    def use(module: str) -> None:
        acquire_release(chunks_of.get(module, set()))

    def use_layer(layer: int) -> None:
        start = f"{prefix}layers.{layer}."
        acquire_release({c for m, cs in chunks_of.items() if m.startswith(start) for c in cs})

    head = prefix + "embed_tokens" if tied else "lm_head"
    use(prefix + "embed_tokens")
    for layer in range(layers):
        if blocks:
            use_layer(layer)
            continue
        for part in parts:
            for m in _modules(layer, part, targets, prefix):
                use(m)
    use(prefix + "norm")
    use(head)
    use(head)  # backward: the head's saved weight, then the final norm's
    if reads_norms:
        use(prefix + "norm")
    for layer in reversed(range(layers)):
        if blocks and layer < recompute:
            use_layer(layer)  # held through the recompute and the layer's backward
            continue
        if layer < recompute:
            for part in parts:
                for m in _modules(layer, part, targets, prefix):
                    use(m)
        for part in reversed(read_back):
            modules = _modules(layer, part, targets, prefix)[::-1]
            if layer == 0 and not _needs_grad_in(part, targets):
                # only an adapter's lora_B: its input (lora_A's output) needs a gradient
                modules = [m for m in modules if m.endswith(".lora_B.default")]
            for m in modules:
                use(m)
    return events
