"""Model profiles: architecture shapes of decoder-only LMs (no weights), from TOML files.

`param_specs()` lists the parameters analytically, with the names and shapes of the
transformers state dict (LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM), in the
order transformers registers them (`named_parameters()`, the order the engine packs chunks
in): embed, then per layer q/k/v/o, gate/up/down, input_layernorm, post_attention_layernorm,
then the final norm and lm_head (absent when tied). Instant even for 405B.
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
}


@dataclass(frozen=True, kw_only=True)
class ModelProfile:
    """A decoder-only transformer's shapes, as in its Hugging Face config."""

    name: str
    """Canonical name, usually the Hugging Face repo name (e.g. "meta-llama/Llama-2-7b-hf")."""
    family: str = field(metadata={"choices": tuple(FAMILIES)})
    """Architecture family: "llama", "qwen2" or "mistral"; decides biases and the config class."""
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

    def __post_init__(self) -> None:
        validate_fields(self)
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

    def param_specs(self) -> list[ParamSpec]:
        """Every parameter (name, shape), in `named_parameters()` order; tied lm_head is omitted."""
        h, i, bias = self.hidden_size, self.intermediate_size, FAMILIES[self.family][1]
        specs = [ParamSpec(name="model.embed_tokens.weight", shape=(self.vocab_size, h), embedding=True)]
        for layer in range(self.num_hidden_layers):
            p = f"model.layers.{layer}."
            for proj, out in (("q_proj", self.q_dim), ("k_proj", self.kv_dim), ("v_proj", self.kv_dim)):
                specs.append(ParamSpec(name=f"{p}self_attn.{proj}.weight", shape=(out, h)))
                if bias:
                    specs.append(ParamSpec(name=f"{p}self_attn.{proj}.bias", shape=(out,)))
            specs.append(ParamSpec(name=p + "self_attn.o_proj.weight", shape=(h, self.q_dim)))
            specs.append(ParamSpec(name=p + "mlp.gate_proj.weight", shape=(i, h)))
            specs.append(ParamSpec(name=p + "mlp.up_proj.weight", shape=(i, h)))
            specs.append(ParamSpec(name=p + "mlp.down_proj.weight", shape=(h, i)))
            specs.append(ParamSpec(name=p + "input_layernorm.weight", shape=(h,)))
            specs.append(ParamSpec(name=p + "post_attention_layernorm.weight", shape=(h,)))
        specs.append(ParamSpec(name="model.norm.weight", shape=(h,)))
        if not self.tie_word_embeddings:
            specs.append(ParamSpec(name="lm_head.weight", shape=(self.vocab_size, h)))
        return specs

    def layer_params(self) -> int:
        """Parameters of one decoder layer."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h
        if FAMILIES[self.family][1]:
            attn += self.q_dim + 2 * self.kv_dim
        return attn + 3 * h * i + 2 * h

    @property
    def num_params(self) -> int:
        """Total parameters (a tied embedding counted once)."""
        emb = self.vocab_size * self.hidden_size
        return emb * (1 if self.tie_word_embeddings else 2) + self.num_hidden_layers * self.layer_params() \
            + self.hidden_size

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token (all but the embedding lookup and norms)."""
        lm_head = self.vocab_size * self.hidden_size
        return self.num_hidden_layers * (self.layer_params() - 2 * self.hidden_size) + lm_head

    def largest_param_numel(self) -> int:
        return max(math.prod(s.shape) for s in self._largest_candidates())

    def _largest_candidates(self) -> list[ParamSpec]:
        h, i = self.hidden_size, self.intermediate_size
        return [ParamSpec(name="emb", shape=(self.vocab_size, h)), ParamSpec(name="mlp", shape=(i, h)),
                ParamSpec(name="q", shape=(self.q_dim, h))]

    @classmethod
    def from_hf_config(cls, config: Any, *, name: str | None = None) -> "ModelProfile":
        """The profile of a transformers Llama/Qwen2/Mistral config (or a model with `.config`)."""
        config = getattr(config, "config", config)
        family = getattr(config, "model_type", "llama")
        if family not in FAMILIES:
            experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
            # a MoE layer runs top-k of its experts per token (compute), routes tokens (activations) and
            # runs router + experts modules (trace): none of it is the dense formulas' (not priced, not guessed)
            why = (f": a mixture of experts ({config.num_experts_per_tok} of {experts} experts per token), not the "
                   "dense decoder its compute, activation and traffic formulas model"
                   if experts and getattr(config, "num_experts_per_tok", None) else " yet")
            raise FieldValueError(f"the planner prices the {', '.join(FAMILIES)} families, not {family!r}{why}: "
                                  "`plan` and `--dry-run` cannot price this model; training runs (the engine "
                                  "measures its budgets in the warm-up step)",
                                  where=name or type(config).__name__, field="family")
        rope = getattr(config, "rope_parameters", None) or {}
        return cls(
            name=name or getattr(config, "_name_or_path", "") or family, family=family,
            hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads or config.num_attention_heads,
            vocab_size=config.vocab_size, tie_word_embeddings=bool(config.tie_word_embeddings),
            max_position_embeddings=config.max_position_embeddings,
            rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
            rms_norm_eps=float(config.rms_norm_eps),
            head_dim=getattr(config, "head_dim", None))

    def to_hf_config(self) -> Any:
        """A transformers config of this shape (LlamaConfig, Qwen2Config or MistralConfig)."""
        import transformers

        cls = getattr(transformers, FAMILIES[self.family][0])
        kwargs: dict[str, Any] = dict(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, vocab_size=self.vocab_size,
            tie_word_embeddings=self.tie_word_embeddings, max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope_theta, rms_norm_eps=self.rms_norm_eps,
        )
        if self.head_dim is not None:
            kwargs["head_dim"] = self.head_dim
        return cls(**kwargs)
