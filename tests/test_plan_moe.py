"""The planner prices the mixtures of experts it has formulas for (Mixtral, Qwen2-MoE): their
activations equal what the engine's ledger counts (full fine-tune; a LoRA run's are at most
the full fine-tune's), and `finetune plan` places Mixtral 8x7B."""

from __future__ import annotations

import pytest
import torch
import transformers

from tierwise.offload import Engine
from tierwise.offload.core.errors import UnsupportedModel
from tierwise.offload.plan.lora import adapts_experts, lora_specs
from tierwise.offload.plan.perfmodel import activation_bytes
from tierwise.offload.plan.planner import make_plan
from tierwise.profiles import load_model_profile
from tierwise.profiles.model import ModelProfile

from tests.tinyhf import activation_peak

MOE = {"mixtral": dict(num_experts=4, num_experts_per_tok=2),
       "qwen2_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=40,
                         shared_expert_intermediate_size=56)}


def tiny(family: str, *, router_loss: bool = False) -> ModelProfile:
    return ModelProfile(name="t", family=family, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=64, max_position_embeddings=128,
                        rope_theta=1e4, rms_norm_eps=1e-5, router_loss=router_loss, **MOE[family])


@pytest.mark.parametrize("router_loss", [False, True], ids=["", "router-loss"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("checkpointing", [True, False, 1], ids=["recompute", "keep", "first-of-two"])
@pytest.mark.parametrize("family", list(MOE))
def test_moe_activations_are_planned_exactly(family, precision, checkpointing, router_loss):
    """(The router loss keeps every layer's router logits, joined, and their softmax until its
    backward: a part of the end of forward's peak.)"""
    profile = tiny(family, router_loss=router_loss)
    assert ModelProfile.from_hf_config(profile.to_hf_config(), name="t") == profile
    assert activation_peak(profile, precision=precision, checkpointing=checkpointing) == activation_bytes(
        model=profile, batch_size=2, seq_len=20, precision=precision, checkpointing=checkpointing)


QWEN_ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "shared_expert_gate")
QWEN_DENSE = ("q_proj", "k_proj", "v_proj", "o_proj", "shared_expert_gate")  # (no name PEFT 0.22 maps onto experts)


@pytest.mark.parametrize("checkpointing", [True, False, 1], ids=["recompute", "keep", "first-of-two"])
@pytest.mark.parametrize("family, targets, dropout", [
    ("mixtral", ("q_proj", "v_proj"), 0.0), ("qwen2_moe", ("q_proj", "v_proj"), 0.0), ("qwen2_moe", QWEN_ALL, 0.0),
    ("qwen2_moe", ("shared_expert_gate", "q_proj"), 0.0), ("qwen2_moe", ("down_proj",), 0.0),
    ("qwen2_moe", ("shared_expert_gate",), 0.0), ("qwen2_moe", QWEN_ALL, 0.1),
    ("qwen2_moe", ("shared_expert_gate", "down_proj"), 0.1), ("qwen2_moe", QWEN_DENSE, 0.1)],
    ids=["mixtral-qv", "qwen-qv", "qwen-all-linear", "qwen-shared-gate", "qwen-down", "qwen-gate-only",
         "qwen-all-dropout", "qwen-gate-down-dropout", "qwen-dense-dropout"])
def test_moe_lora_activations_are_planned_exactly(family, targets, dropout, checkpointing):
    """Frozen experts save less (no gathered input, no product; nothing in layer 0 without
    recompute when no attention linear is a target); Qwen2-MoE's shared expert is a dense MLP
    whose linears (and gate) may be targets, with LoRA dropout too. From PEFT 0.22 the names
    gate_proj/up_proj/down_proj adapt Qwen2-MoE's fused experts as well: the planner refuses."""
    from peft import LoraConfig

    import peft

    profile = tiny(family)
    model = transformers.AutoModelForCausalLM.from_config(profile.to_hf_config())
    adapted = [n for n, _ in peft.get_peft_model(model, LoraConfig(r=4, target_modules=list(targets))).named_parameters()
               if "lora_A" in n and (".experts." in n or ".mlp.gate." in n)]
    if adapted:  # (what this PEFT adapts, the reference: the planner refuses, not misprices)
        with pytest.raises(UnsupportedModel, match="fused MoE experts"):
            lora_specs(profile.param_specs(), rank=4, targets=",".join(targets), family=family)
        return
    assert not set(targets) & adapts_experts(family)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), lora_dropout=dropout)
    for precision in ("fp32", "bf16"):
        e = 4 if precision == "fp32" else 2  # (the CPU's dropout keeps its scaled noise, e bytes)
        act = (frozenset(targets), 4, e) if dropout else (frozenset(targets), 4)
        got = activation_peak(profile, precision=precision, checkpointing=checkpointing, lora=lora)
        assert got == activation_bytes(model=profile, batch_size=2, seq_len=20, precision=precision,
                                       checkpointing=checkpointing, lora=act), precision


def test_mixtral_8x7b_is_planned():
    """QLoRA on the attention of Mixtral 8x7B on one 24 GB card and 64 GB of host memory."""
    plan = make_plan(model="mixtral-8x7b", hardware="rtx4090", gpu_mem="24G", cpu_mem="64G",
                     optimizer="adamw", precision="bf16", batch_size=1, seq_len=2048, lora_rank=16,
                     lora_targets="q_proj,k_proj,v_proj,o_proj", base_dtype="nf4")
    prof = load_model_profile("mixtral-8x7b")
    assert plan.num_params == prof.num_params + plan.trainable_params
    assert prof.active_params == 12_879_925_248  # (published: 12.9B)
    assert plan.active_params == prof.active_params + plan.trainable_params and "12.89B active a token" in plan.render_table()
    # the largest parameter is one layer's fused gate_up experts: 8 x 28672 x 4096
    assert max(s.numel for s in prof.param_specs()) == prof.largest_param_numel() == 8 * 2 * 14336 * 4096
    assert plan.step_s > 0 and plan.tokens_per_s > 0


def test_mezo_on_a_moe_is_refused_by_the_plan_and_the_engine():
    """MeZO runs each module over half of a doubled batch; a MoE's router and experts see
    flattened tokens (was: a TypeError deep in the dual forward, and a plan that "fits")."""
    from tierwise.offload import flat_options
    from tierwise.offload.core.errors import UnsupportedModel

    with pytest.raises(UnsupportedModel, match="mixture of experts"):
        make_plan(model="mixtral-8x7b", hardware="h100", gpu_mem="80G", cpu_mem="512G", optimizer="mezo",
                  precision="bf16", batch_size=1, seq_len=512)
    model = transformers.AutoModelForCausalLM.from_config(tiny("mixtral").to_hf_config())
    with pytest.raises(UnsupportedModel, match="mixture of experts"):
        Engine(model, **flat_options(optimizer="mezo", lr=1e-3))


def test_a_dense_model_whose_config_names_experts_is_no_moe():
    """Nemotron-H's config names 8 experts by default, also without MoE layers: the parameters
    decide (MeZO trains it)."""
    from tierwise.offload.engine.model_info import is_moe

    moe = transformers.AutoModelForCausalLM.from_config(tiny("mixtral").to_hf_config())
    assert is_moe(moe)
    plain = torch.nn.Linear(2, 2)
    plain.config = transformers.MixtralConfig(num_local_experts=8)
    assert not is_moe(plain)
