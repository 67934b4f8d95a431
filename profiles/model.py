"""Model profiles: architecture shapes of decoder-only LMs (no weights), from TOML files.

`param_specs()` lists the parameters analytically, with the names and shapes of the
transformers state dict (LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM /
MistralForCausalLM / GemmaForCausalLM / Gemma3ForCausalLM / Gemma3ForConditionalGeneration (its
vision tower and projector first, the text model under `model.language_model.`), and the mixtures of experts
MixtralForCausalLM / Qwen2MoeForCausalLM), in
the order transformers registers them (`named_parameters()`, the order the engine packs chunks
in): embed, then per layer q/k/v/o (Phi3ForCausalLM: o_proj, then one fused qkv_proj; Qwen3's
and Gemma-3's q_norm/k_norm after them), the MLP (gate/up/down, Phi-3's one gate_up_proj and down; a MoE
layer's router `mlp.gate`, its fused 3-D experts `mlp.experts.gate_up_proj` / `down_proj` and
Qwen2-MoE's shared expert and its gate), input_layernorm, post_attention_layernorm (Gemma-3:
pre_feedforward_layernorm and post_feedforward_layernorm after it), then the
final norm and lm_head (absent when tied).
Instant even for 405B.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..offload.core.chunks import ParamSpec
from .schema import FieldValueError, validate_fields

#: family -> (transformers config class name, whether q/k/v projections carry a bias)
FAMILIES: dict[str, tuple[str, bool]] = {
    "llama": ("LlamaConfig", False),
    "mistral": ("MistralConfig", False),
    "qwen2": ("Qwen2Config", True),
    "qwen3": ("Qwen3Config", False),
    "phi3": ("Phi3Config", False),
    "gemma": ("GemmaConfig", False),
    "gemma3_text": ("Gemma3TextConfig", False),
    "gemma3": ("Gemma3Config", False),
    "mixtral": ("MixtralConfig", False),
    "qwen2_moe": ("Qwen2MoeConfig", True),
}
#: The mixture-of-experts families: every decoder layer's MLP is a router over fused experts.
MOE_FAMILIES = frozenset({"mixtral", "qwen2_moe"})
#: The families whose layers fuse their projections: q/k/v into one `self_attn.qkv_proj`, gate and
#: up into one `mlp.gate_up_proj` (Phi-3, Phi-4).
FUSED_FAMILIES = frozenset({"phi3"})
#: The families whose attention normalises each head's queries and keys (an RMSNorm over
#: head_dim, `self_attn.q_norm` / `k_norm`) before the rotary embedding.
QK_NORM_FAMILIES = frozenset({"qwen3", "gemma3_text", "gemma3"})
#: Gemma's families: each RMSNorm computes in fp32 and scales by 1 + its weight, the embedding's
#: output is scaled by sqrt(hidden_size), the MLP's activation is GELU (tanh).
GEMMA_FAMILIES = frozenset({"gemma", "gemma3_text", "gemma3"})
#: The families whose layers also normalise the attention's and the MLP's outputs (four norms a
#: layer: post_attention_layernorm after o_proj, pre_ and post_feedforward_layernorm around the MLP).
POST_NORM_FAMILIES = frozenset({"gemma3_text", "gemma3"})
#: The families whose layers attend a sliding window, but every `sliding_window_pattern`-th layer
#: the whole row (Gemma-3's local and global layers, each kind with its own rotary embedding).
SLIDING_FAMILIES = frozenset({"gemma3_text", "gemma3"})
#: The families whose checkpoints hold a vision tower beside the text model (Gemma-3 4B and up:
#: Gemma3ForConditionalGeneration, a SigLIP encoder and its projector; the text model's names
#: under `model.language_model.`). Training on text never runs the tower: its weights are stored,
#: never fetched to the device; a full fine-tune keeps their optimizer state.
VISION_FAMILIES = frozenset({"gemma3"})
#: Where a vision model's tower and projector live (the parameters a step on text never uses).
TOWER_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.")
#: The families whose config may give every layer a sliding window (Mistral 7B v0.1's 4,096,
#: Phi-3-mini-4k's 2,047; Qwen's `use_sliding_window` where every layer slides). (Not Qwen2-MoE:
#: it slides every other layer.)
WINDOW_FAMILIES = frozenset({"mistral", "mixtral", "phi3", "qwen2", "qwen3"})


def text_config(config: Any) -> Any:
    """The config of a model's text model: itself, or a vision model's (Gemma-3 4B and up:
    transformers' get_text_config); a config without that method is its own."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def routed_experts(config: Any) -> int:
    """A transformers config's routed experts per layer (Mixtral's num_local_experts, Qwen-MoE's
    num_experts); 0 for a dense model."""
    return getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0


NOT_PRICED = ("`plan` and `--dry-run` cannot price this model; training runs (the engine measures its budgets "
               "in the warm-up step)")


def _unpriced(config: Any, family: str) -> str | None:
    """The biases and dropout a config's layers get that FAMILIES[family] does not price, in
    words (Llama's and Qwen3's attention_bias also biases o_proj; mlp_bias every MLP linear;
    Qwen2-MoE's qkv_bias=False drops its q/k/v biases); None when they are the family's."""
    on = [f"{k}=True" for k in ("attention_bias", "mlp_bias") if getattr(config, k, None)]
    on += [f"{k}={getattr(config, k)}" for k in ("attention_dropout", "resid_pdrop", "embd_pdrop")
           if getattr(config, k, None)]  # (dropout saves its masks)
    if getattr(config, "qkv_bias", True) is False and FAMILIES[family][1]:
        on.append("qkv_bias=False")
    # (soft-capped attention runs eager; a capped or bidirectional Gemma-3 is not its checkpoints)
    on += [f"{k}={getattr(config, k)}" for k in ("attn_logit_softcapping", "final_logit_softcapping",
                                                  "use_bidirectional_attention") if getattr(config, k, None)]
    if family in SLIDING_FAMILIES and _pattern(config) is None:
        on.append("layer_types that are not every n-th layer global")
    if family not in SLIDING_FAMILIES and _window(config) and (family not in WINDOW_FAMILIES or not all(
            t == "sliding_attention" for t in getattr(config, "layer_types", None) or ["sliding_attention"])):
        on.append(f"a sliding window on some layers only (max_window_layers={getattr(config, 'max_window_layers', None)})")
    return " and ".join(on) or None


def _window(config: Any) -> int | None:
    """The sliding window a config's layers attend (Qwen's only with use_sliding_window, and
    where some layer_types slide)."""
    window = (getattr(config, "sliding_window", None) or None) if getattr(config, "use_sliding_window", True) else None
    types = getattr(config, "layer_types", None)
    return None if types is not None and "sliding_attention" not in types else window


def _pattern(config: Any) -> int | None:
    """n where a config's layer_types attend the whole row at every n-th layer only (the window
    elsewhere; n past the last layer: none global); None for another arrangement."""
    kinds = [t == "full_attention" for t in config.layer_types]
    for n in (getattr(config, "_sliding_window_pattern", None), kinds.index(True) + 1 if any(kinds) else len(kinds) + 1):
        if n and kinds == [not (i + 1) % n for i in range(len(kinds))]:
            return n
    return None


@dataclass(frozen=True, kw_only=True)
class ModelProfile:
    """A decoder-only transformer's shapes, as in its Hugging Face config."""

    name: str
    """Canonical name, usually the Hugging Face repo name (e.g. "meta-llama/Llama-2-7b-hf")."""
    family: str = field(metadata={"choices": tuple(FAMILIES)})
    """Architecture family (FAMILIES): decides biases, the q/k norms and the config class."""
    aliases: tuple[str, ...] = ()
    """Other names the profile answers to (matched case-insensitively), e.g. "7b", "llama-2-7b"."""
    description: str = ""
    """One line for listings."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the SwiGLU MLP (gate/up output, down input)."""
    num_hidden_layers: int
    """Number of decoder layers."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """Key/value heads (grouped-query attention when fewer than query heads)."""
    vocab_size: int
    """Rows of the embedding table and of lm_head."""
    tie_word_embeddings: bool = False
    """True when lm_head shares the embedding's weight (then lm_head.weight is not listed)."""
    max_position_embeddings: int
    """Longest sequence the rotary embedding is configured for."""
    rope_theta: float
    """Rotary embedding base."""
    rms_norm_eps: float
    """RMSNorm epsilon."""
    head_dim: int | None = None
    """Per-head width; None means hidden_size // num_attention_heads."""
    partial_rotary_factor: float = field(default=1.0, metadata={"min": 0.0})
    """The share of each head's width the rotary embedding turns (Phi-4-mini's 0.75); 1: all."""
    sliding_window: int | None = field(default=None, metadata={"min": 1})
    """Tokens a sliding layer attends (Gemma-3's 512 or 1,024, Mistral 7B v0.1's 4,096); None: none slides."""
    sliding_window_pattern: int = field(default=0, metadata={"min": 0})
    """Every n-th layer attends the whole row, the others the window (SLIDING_FAMILIES: Gemma-3's
    6); 0: every layer slides (WINDOW_FAMILIES, with a window)."""
    num_experts: int = field(default=0, metadata={"min": 0})
    """A MoE family's routed experts per layer (Mixtral's num_local_experts); 0 for a dense one."""
    num_experts_per_tok: int = field(default=0, metadata={"min": 0})
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int | None = None
    """One routed expert's MLP width; None: intermediate_size (Mixtral's)."""
    shared_expert_intermediate_size: int = field(default=0, metadata={"min": 0})
    """Qwen2-MoE's shared expert's MLP width (every token runs it, scaled by its own gate); 0: none."""
    vision_hidden_size: int = field(default=0, metadata={"min": 0})
    """VISION_FAMILIES: the vision tower's width (SigLIP's 1,152); 0: no tower."""
    vision_intermediate_size: int = field(default=0, metadata={"min": 0})
    """The vision tower's MLP width (4,304)."""
    vision_layers: int = field(default=0, metadata={"min": 0})
    """The vision tower's encoder layers (27)."""
    image_size: int = field(default=0, metadata={"min": 0})
    """Pixels on an image's side (896)."""
    patch_size: int = field(default=0, metadata={"min": 0})
    """Pixels on a patch's side (14): (image_size / patch_size)^2 position embeddings."""
    router_loss: bool = False
    """The model's loss adds its router's load-balancing loss (a MoE config's output_router_logits,
    whatever its weight: a weight of 0 still computes it): it keeps every layer's router logits
    for it, and the loss is the model's own (the tiled one does not take it)."""

    def __post_init__(self) -> None:
        validate_fields(self)
        moe = self.family in MOE_FAMILIES
        if moe:  # (Qwen2-MoE always has its shared expert; Mixtral none)
            bad = not 0 < self.num_experts_per_tok <= self.num_experts or \
                (self.family == "qwen2_moe") != (self.shared_expert_intermediate_size > 0)
        else:
            bad = bool(self.num_experts or self.num_experts_per_tok or self.shared_expert_intermediate_size
                       or self.moe_intermediate_size or self.router_loss)
        if bad:
            raise FieldValueError(
                f"family {self.family!r} {'needs' if moe else 'takes no'} num_experts and num_experts_per_tok "
                f"(got {self.num_experts} and {self.num_experts_per_tok}; top-k at most the experts; a "
                f"shared expert's width for qwen2_moe only)",
                where=self.name, field="num_experts")
        vision = (self.vision_hidden_size, self.vision_intermediate_size, self.vision_layers, self.image_size,
                  self.patch_size)
        if (self.family in VISION_FAMILIES) != all(vision) or (any(vision) and not all(vision)):
            raise FieldValueError(
                f"family {self.family!r} {'needs' if self.family in VISION_FAMILIES else 'takes no'} vision_hidden_size, "
                f"vision_intermediate_size, vision_layers, image_size and patch_size (got {vision})",
                where=self.name, field="vision_hidden_size")
        if 0 < self.vision_layers >= self.num_hidden_layers:
            # the engine's blocks (recomputed, the units of residency) are the longest list of
            # layers, the first on a tie: here the tower's, which text never runs
            raise FieldValueError(
                f"field 'vision_layers' ({self.vision_layers}) must be fewer than num_hidden_layers "
                f"({self.num_hidden_layers}), as in the published checkpoints: the engine would take the vision "
                f"tower's layers for the decoder's blocks", where=self.name, field="vision_layers")
        sliding = self.family in SLIDING_FAMILIES
        if sliding != bool(self.sliding_window and self.sliding_window_pattern) or (
                self.sliding_window and not sliding and self.family not in WINDOW_FAMILIES):
            raise FieldValueError(
                f"family {self.family!r} {'needs' if sliding else 'takes no'} sliding_window_pattern"
                f"{' and a sliding_window' if sliding else ''} (got {self.sliding_window} and "
                f"{self.sliding_window_pattern}; a window for {', '.join(sorted(WINDOW_FAMILIES | SLIDING_FAMILIES))} "
                f"only)", where=self.name, field="sliding_window")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise FieldValueError(
                f"field 'hidden_size' ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads}) when head_dim is not given", where=self.name, field="hidden_size")
        if self.num_attention_heads % self.num_key_value_heads:
            raise FieldValueError(
                f"field 'num_key_value_heads' ({self.num_key_value_heads}) must divide num_attention_heads "
                f"({self.num_attention_heads})", where=self.name, field="num_key_value_heads")

    @property
    def dim_per_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.dim_per_head

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.dim_per_head

    @property
    def fused(self) -> bool:
        return self.family in FUSED_FAMILIES

    @property
    def rotary_dim(self) -> int:
        """Each head's width the rotary embedding turns (its cos/sin's last dimension: two of
        each frequency, an odd share rounded up as transformers' arange(0, d, 2) does)."""
        d = int(self.dim_per_head * self.partial_rotary_factor)
        return d + d % 2

    @property
    def qk_norm(self) -> bool:
        return self.family in QK_NORM_FAMILIES

    @property
    def gemma(self) -> bool:
        return self.family in GEMMA_FAMILIES

    @property
    def post_norms(self) -> bool:
        return self.family in POST_NORM_FAMILIES

    def slides(self, layer: int) -> bool:
        """Whether decoder layer `layer` attends a sliding window (transformers' layer_types)."""
        if not self.sliding_window:
            return False
        return not self.sliding_window_pattern or bool((layer + 1) % self.sliding_window_pattern)

    @property
    def prefix(self) -> str:
        """The text model's module names' prefix: `model.`, or under a vision model's
        `model.language_model.`."""
        return "model.language_model." if self.vision_layers else "model."

    def _vision_specs(self) -> list[ParamSpec]:
        """The vision tower's and its projector's parameters (SigLIP without its pooling head, as
        Gemma-3's checkpoints are), in `named_parameters()` order."""
        (p, projector), v, x = TOWER_PREFIXES, self.vision_hidden_size, self.vision_intermediate_size
        specs = [ParamSpec(name=p + "embeddings.patch_embedding.weight", shape=(v, 3, self.patch_size, self.patch_size)),
                 ParamSpec(name=p + "embeddings.patch_embedding.bias", shape=(v,)),
                 ParamSpec(name=p + "embeddings.position_embedding.weight", shape=(self.patches, v), embedding=True)]
        for layer in range(self.vision_layers):
            q = f"{p}encoder.layers.{layer}."
            shapes = [("layer_norm1", (v,))] + [(f"self_attn.{n}", (v, v)) for n in ("k_proj", "v_proj", "q_proj", "out_proj")]
            shapes += [("layer_norm2", (v,)), ("mlp.fc1", (x, v)), ("mlp.fc2", (v, x))]
            for name, shape in shapes:
                specs += [ParamSpec(name=f"{q}{name}.weight", shape=shape),
                          ParamSpec(name=f"{q}{name}.bias", shape=(shape[0],))]
        specs += [ParamSpec(name=p + "post_layernorm.weight", shape=(v,)),
                  ParamSpec(name=p + "post_layernorm.bias", shape=(v,)),
                  ParamSpec(name=projector + "mm_input_projection_weight", shape=(v, self.hidden_size)),
                  ParamSpec(name=projector + "mm_soft_emb_norm.weight", shape=(v,))]
        return specs

    @property
    def idle(self) -> tuple[str, ...]:
        """Name prefixes of the parameters a step on text never uses (a vision tower's and its
        projector's): never fetched to the device, never given a gradient."""
        return TOWER_PREFIXES if self.vision_layers else ()

    @property
    def patches(self) -> int:
        """An image's patches: the vision tower's positions (0 without a tower)."""
        return (self.image_size // self.patch_size) ** 2 if self.vision_layers else 0

    def vision_params(self) -> int:
        """Parameters of the vision tower and its projector (0 without one)."""
        return sum(s.numel for s in self._vision_specs()) if self.vision_layers else 0

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @property
    def expert_size(self) -> int:
        """One routed expert's MLP width."""
        return self.moe_intermediate_size or self.intermediate_size

    def _mlp_specs(self, p: str) -> list[ParamSpec]:
        h, i = self.hidden_size, self.intermediate_size
        if self.fused:
            return [ParamSpec(name=p + "mlp.gate_up_proj.weight", shape=(2 * i, h)),
                    ParamSpec(name=p + "mlp.down_proj.weight", shape=(h, i))]
        if not self.moe:
            return [ParamSpec(name=p + "mlp.gate_proj.weight", shape=(i, h)),
                    ParamSpec(name=p + "mlp.up_proj.weight", shape=(i, h)),
                    ParamSpec(name=p + "mlp.down_proj.weight", shape=(h, i))]
        n, x, sh = self.num_experts, self.expert_size, self.shared_expert_intermediate_size
        out = [ParamSpec(name=p + "mlp.gate.weight", shape=(n, h)),
               ParamSpec(name=p + "mlp.experts.gate_up_proj", shape=(n, 2 * x, h)),
               ParamSpec(name=p + "mlp.experts.down_proj", shape=(n, h, x))]
        if sh:
            out += [ParamSpec(name=p + "mlp.shared_expert.gate_proj.weight", shape=(sh, h)),
                    ParamSpec(name=p + "mlp.shared_expert.up_proj.weight", shape=(sh, h)),
                    ParamSpec(name=p + "mlp.shared_expert.down_proj.weight", shape=(h, sh)),
                    ParamSpec(name=p + "mlp.shared_expert_gate.weight", shape=(1, h))]
        return out

    def param_specs(self) -> list[ParamSpec]:
        """Every parameter (name, shape), in `named_parameters()` order; tied lm_head is omitted."""
        h, bias, top = self.hidden_size, FAMILIES[self.family][1], self.prefix
        specs = self._vision_specs() if self.vision_layers else []
        specs.append(ParamSpec(name=top + "embed_tokens.weight", shape=(self.vocab_size, h), embedding=True))
        for layer in range(self.num_hidden_layers):
            p = f"{top}layers.{layer}."
            o_proj = ParamSpec(name=p + "self_attn.o_proj.weight", shape=(h, self.q_dim))
            if self.fused:  # (Phi-3 registers o_proj first)
                specs += [o_proj, ParamSpec(name=p + "self_attn.qkv_proj.weight", shape=(self.q_dim + 2 * self.kv_dim, h))]
            else:
                for proj, out in (("q_proj", self.q_dim), ("k_proj", self.kv_dim), ("v_proj", self.kv_dim)):
                    specs.append(ParamSpec(name=f"{p}self_attn.{proj}.weight", shape=(out, h)))
                    if bias:
                        specs.append(ParamSpec(name=f"{p}self_attn.{proj}.bias", shape=(out,)))
                specs.append(o_proj)
            if self.qk_norm:
                specs += [ParamSpec(name=f"{p}self_attn.{n}.weight", shape=(self.dim_per_head,))
                          for n in ("q_norm", "k_norm")]
            specs += self._mlp_specs(p)
            specs.append(ParamSpec(name=p + "input_layernorm.weight", shape=(h,)))
            norms = ("post_attention", "pre_feedforward", "post_feedforward") if self.post_norms else ("post_attention",)
            specs += [ParamSpec(name=f"{p}{n}_layernorm.weight", shape=(h,)) for n in norms]
        specs.append(ParamSpec(name=top + "norm.weight", shape=(h,)))
        if not self.tie_word_embeddings:
            specs.append(ParamSpec(name="lm_head.weight", shape=(self.vocab_size, h)))
        return specs

    def _attention_params(self, *, biases: bool = True) -> int:
        h = self.hidden_size
        attn = h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h
        norms = 2 * self.dim_per_head if biases and self.qk_norm else 0
        return attn + norms + (self.q_dim + 2 * self.kv_dim if biases and FAMILIES[self.family][1] else 0)

    def _mlp_params(self, *, active: bool) -> int:
        """One layer's MLP parameters; `active`: those one token's forward multiplies by (its
        top-k experts, the router, the shared expert and its gate)."""
        h = self.hidden_size
        if not self.moe:
            return 3 * h * self.intermediate_size
        experts = self.num_experts_per_tok if active else self.num_experts
        shared = 3 * h * self.shared_expert_intermediate_size + (h if self.shared_expert_intermediate_size else 0)
        return self.num_experts * h + experts * 3 * h * self.expert_size + shared

    def layer_params(self) -> int:
        """Parameters of one decoder layer."""
        return self._attention_params() + self._mlp_params(active=False) + (4 if self.post_norms else 2) * self.hidden_size

    @property
    def num_params(self) -> int:
        """Total parameters (a tied embedding counted once)."""
        emb = self.vocab_size * self.hidden_size
        return emb * (1 if self.tie_word_embeddings else 2) + self.num_hidden_layers * self.layer_params() \
            + self.hidden_size + self.vision_params()

    @property
    def active_params(self) -> int:
        """Parameters one token's forward uses: all but the experts it is not routed to."""
        idle = (self.num_experts - self.num_experts_per_tok) * 3 * self.hidden_size * self.expert_size
        return self.num_params - self.num_hidden_layers * idle - self.vision_params()

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token (all but the embedding lookup, norms
        and biases; of a MoE layer's experts, the top-k a token is routed to)."""
        lm_head = self.vocab_size * self.hidden_size
        return self.num_hidden_layers * (self._attention_params(biases=False) + self._mlp_params(active=True)) \
            + lm_head

    def largest_param_numel(self) -> int:
        return max(math.prod(s.shape) for s in self._largest_candidates())

    def _largest_candidates(self) -> list[ParamSpec]:
        h = self.hidden_size
        q = self.q_dim + (2 * self.kv_dim if self.fused else 0)
        return [ParamSpec(name="emb", shape=(self.vocab_size, h)), ParamSpec(name="q", shape=(q, h)),
                *self._mlp_specs("")]

    @classmethod
    def from_hf_config(cls, config: Any, *, name: str | None = None) -> "ModelProfile":
        """The profile of a transformers config of a FAMILIES family (or a model with `.config`)."""
        config = getattr(config, "config", config)
        family = getattr(config, "model_type", "llama")
        outer, vision = config, None
        if family in VISION_FAMILIES:  # (the text model's shapes are its text_config's)
            vision, config = config.vision_config, config.get_text_config()
            if getattr(vision, "vision_use_head", False) or getattr(vision, "num_channels", 3) != 3:
                raise FieldValueError(f"the planner prices {family}'s vision tower as its checkpoints are published "
                                      f"(no pooling head, three channels): {NOT_PRICED}",
                                      where=name or type(outer).__name__, field="family")
        experts = routed_experts(config)
        top_k = getattr(config, "num_experts_per_tok", None) or 0
        every_layer = not getattr(config, "mlp_only_layers", None) and getattr(config, "decoder_sparse_step", 1) == 1
        if family not in FAMILIES or (family in MOE_FAMILIES and not every_layer):
            # another MoE's layers (their routers, experts and saved tensors) are not these formulas'
            why = (f": a mixture of experts ({top_k} of {experts} experts per token"
                   f"{'' if every_layer else ', some layers dense'}) the formulas do not model"
                   if experts and top_k else " yet")
            raise FieldValueError(f"the planner prices the {', '.join(FAMILIES)} families, not {family!r}{why}: "
                                  f"{NOT_PRICED}",
                                  where=name or type(config).__name__, field="family")
        unpriced = _unpriced(config, "gemma3_text" if vision is not None else family)
        if unpriced:
            raise FieldValueError(f"the planner prices {family} as its checkpoints are published, not with "
                                  f"{unpriced}: {NOT_PRICED}", where=name or type(config).__name__, field="family")
        extra: dict[str, Any] = {}
        if family in MOE_FAMILIES:
            extra = dict(num_experts=experts, num_experts_per_tok=top_k,
                       moe_intermediate_size=getattr(config, "moe_intermediate_size", None),
                       shared_expert_intermediate_size=getattr(config, "shared_expert_intermediate_size", 0) or 0,
                       router_loss=bool(getattr(config, "output_router_logits", False)))
        rope = getattr(config, "rope_parameters", None) or {}
        if family in SLIDING_FAMILIES:  # (a rotary embedding per kind of layer: the global one's base)
            rope = rope.get("full_attention") or {}
            extra.update(sliding_window=config.sliding_window, sliding_window_pattern=_pattern(config))
        elif family in WINDOW_FAMILIES:
            extra.update(sliding_window=_window(config))
        if vision is not None:
            extra.update(vision_hidden_size=vision.hidden_size, vision_intermediate_size=vision.intermediate_size,
                         vision_layers=vision.num_hidden_layers, image_size=vision.image_size,
                         patch_size=vision.patch_size)
        return cls(
            name=name or getattr(outer, "_name_or_path", "") or family, family=family,
            hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads or config.num_attention_heads,
            vocab_size=config.vocab_size, tie_word_embeddings=bool(outer.tie_word_embeddings),
            max_position_embeddings=config.max_position_embeddings,
            rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
            partial_rotary_factor=float(rope.get("partial_rotary_factor",
                                                 getattr(config, "partial_rotary_factor", None) or 1.0)),
            rms_norm_eps=float(config.rms_norm_eps),
            head_dim=getattr(config, "head_dim", None), **extra)

    def to_hf_config(self) -> Any:
        """A transformers config of this shape (its family's config class)."""
        import transformers

        cls = getattr(transformers, FAMILIES[self.family][0])
        kwargs: dict[str, Any] = dict(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, vocab_size=self.vocab_size,
            tie_word_embeddings=self.tie_word_embeddings, max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope_theta, rms_norm_eps=self.rms_norm_eps,
        )
        if self.partial_rotary_factor != 1.0:
            kwargs["partial_rotary_factor"] = self.partial_rotary_factor
        if self.head_dim is not None or self.qk_norm or self.gemma:  # (Qwen3's and Gemma's defaults: 128, 256)
            kwargs["head_dim"] = self.dim_per_head
        if self.family in SLIDING_FAMILIES:
            kwargs.update(sliding_window=self.sliding_window, sliding_window_pattern=self.sliding_window_pattern)
        elif self.family in WINDOW_FAMILIES:  # (MistralConfig's own default is 4,096; Qwen's every layer slides)
            kwargs.update(sliding_window=self.sliding_window)
            if self.family.startswith("qwen"):
                kwargs.update(use_sliding_window=bool(self.sliding_window), max_window_layers=0)
        if self.router_loss:
            kwargs.update(output_router_logits=True)
        if self.family == "mixtral":
            kwargs.update(num_local_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok)
        elif self.family == "qwen2_moe":
            kwargs.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                          moe_intermediate_size=self.expert_size,
                          shared_expert_intermediate_size=self.shared_expert_intermediate_size)
        if self.fused:  # (shapes only: Phi3Config's default token ids, 32,000, may lie past a small vocabulary)
            kwargs.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)
        if self.vision_layers:
            patches = self.patches
            vision = dict(hidden_size=self.vision_hidden_size, intermediate_size=self.vision_intermediate_size,
                          num_hidden_layers=self.vision_layers, image_size=self.image_size, patch_size=self.patch_size,
                          num_attention_heads=1, vision_use_head=False)
            tie = kwargs.pop("tie_word_embeddings")
            return cls(text_config=kwargs, vision_config=vision, mm_tokens_per_image=min(256, patches),
                       tie_word_embeddings=tie)
        return cls(**kwargs)
