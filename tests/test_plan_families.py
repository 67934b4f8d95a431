"""Qwen3, Phi-3 and Gemma (the first, and Gemma-3's text models) in the planner. Qwen3's
per-head q/k RMSNorms' saved activations equal what the engine's ledger counts (full fine-tune
and LoRA, with and without recompute, padding and dropout); Phi-3's fused projections (partial
rotary too) and Gemma's fp32 norms, Gemma-3's four norms a layer and its local and global
layers equal it as well, full fine-tune and LoRA; a LoRA step's access trace is the one the
engine records (so its base reads are the measured ones). A config whose biases, dropout or
soft-capping the formulas do not price is refused, not mispriced."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from tierwise.offload import Activations, Budget, Engine
from tierwise.offload.plan import planner
from tierwise.offload.plan.lora import parse_targets, profile_linears
from tierwise.offload.plan.perfmodel import activation_bytes
from tierwise.offload.runtime import trace
from tierwise.offload.tools.verify import verify
from tierwise.profiles.model import ModelProfile
from tierwise.profiles.schema import FieldValueError

from tests.tinyhf import activation_peak

QWEN3 = ModelProfile(name="t", family="qwen3", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=64, max_position_embeddings=128,
                     rope_theta=1e4, rms_norm_eps=1e-5, head_dim=16)  # (q 64 wide, twice the hidden size)


PHI3 = dataclasses.replace(QWEN3, family="phi3", head_dim=None)  # (head 8 wide, kv heads 2 of 4)
SLIDES = dict(sliding_window=8, sliding_window_pattern=2)  # (a local layer, then a global one)


def assert_lora_planned_exactly(profile, precision, checkpointing, targets, padded, dropout):
    """The engine's activation peak of a LoRA step (r 4 on `targets`, PEFT's config) equals the
    planner's (the CPU's dropout keeps its scaled noise: e bytes)."""
    from peft import LoraConfig

    wanted = parse_targets(targets, profile_linears(profile.param_specs()))
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout,
                        target_modules=targets if targets == "all-linear" else sorted(wanted))
    e = 4 if precision == "fp32" else 2
    act = (wanted, 4, e) if dropout else (wanted, 4)
    assert activation_peak(profile, precision=precision, checkpointing=checkpointing, lora=config, padded=padded) == \
        activation_bytes(model=profile, batch_size=2, seq_len=20, precision=precision, checkpointing=checkpointing,
                         padded=padded, lora=act)


@pytest.mark.parametrize("padded", [False, True], ids=["", "padded"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("checkpointing", [True, False, 1], ids=["recompute", "keep", "first-of-two"])
def test_qwen3_activations_are_planned_exactly(precision, checkpointing, padded):
    assert ModelProfile.from_hf_config(QWEN3.to_hf_config(), name="t") == QWEN3
    assert activation_peak(QWEN3, precision=precision, checkpointing=checkpointing, padded=padded) == activation_bytes(
        model=QWEN3, batch_size=2, seq_len=20, precision=precision, checkpointing=checkpointing, padded=padded)


@pytest.mark.parametrize("padded", [False, True], ids=["", "padded"])
@pytest.mark.parametrize("checkpointing", [True, False, 1], ids=["recompute", "keep", "first-of-two"])
@pytest.mark.parametrize("profile", [PHI3, dataclasses.replace(PHI3, num_key_value_heads=4, partial_rotary_factor=0.5)],
                         ids=["grouped", "mha-partial-rotary"])
def test_phi3_activations_are_planned_exactly(profile, checkpointing, padded):
    """o_proj's input is a copy of SDPA's output; with a layer recomputed (no KV cache) v is a
    view of the fused qkv output, which SDPA then keeps whole, unless a mask repeats grouped
    heads; the rotary's cos/sin are the rotary share of a head wide."""
    assert ModelProfile.from_hf_config(profile.to_hf_config(), name="t") == profile
    for precision in ("fp32", "bf16"):
        assert activation_peak(profile, precision=precision, checkpointing=checkpointing, padded=padded) == activation_bytes(
            model=profile, batch_size=2, seq_len=20, precision=precision, checkpointing=checkpointing,
            padded=padded), precision


@pytest.mark.parametrize("checkpointing", [False, 1], ids=["keep", "first-of-two"])
def test_phi3_packed_rows_are_planned_exactly(checkpointing):
    """Packed rows (per-row position ids, no cache): a kept layer's v is the fused qkv output's
    view too (the engine runs without a KV cache whatever the config's use_cache)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(PHI3.to_hf_config())
    engine = Engine(model, budget=Budget(chunk=16 << 10), activations=Activations(recompute=checkpointing))
    x = torch.randint(0, PHI3.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    try:
        engine.step({"input_ids": x, "labels": x, "position_ids": torch.arange(20).repeat(2, 1), "use_cache": False})
        measured = engine.ledger.kind_peak("gpu", "activation")
    finally:
        engine.close()
    assert model.config.use_cache is True  # (given back as it was)
    assert measured == activation_bytes(model=PHI3, batch_size=2, seq_len=20, precision="fp32",
                                        checkpointing=checkpointing, row_positions=True)


def test_phi_4_is_planned():
    """A full fine-tune on one H100, and QLoRA on a 24 GB card (14.7B: Phi-4's model card)."""
    plan = planner.make_plan(model="phi-4", hardware="h100", gpu_mem="80G", cpu_mem="512G", optimizer="adamw8bit",
                             precision="bf16", batch_size=1, seq_len=2048)
    assert plan.num_params == 14_659_507_200 and plan.tokens_per_s > 0
    qlora = planner.make_plan(model="phi-4", hardware="rtx4090", gpu_mem="24G", cpu_mem="64G", optimizer="adamw",
                              precision="bf16", batch_size=1, seq_len=2048, lora_rank=16, base_dtype="nf4",
                              double_quant=True)
    # one adapter per fused projection: qkv_proj, o_proj, gate_up_proj, down_proj in each of 40 layers
    r, h, i, q, kv = 16, 5120, 17920, 5120, 1280
    assert qlora.trainable_params == 40 * r * ((h + q + 2 * kv) + (q + h) + (h + 2 * i) + (i + h))


@pytest.mark.parametrize("profile", [PHI3, dataclasses.replace(PHI3, num_key_value_heads=4, partial_rotary_factor=0.5)],
                         ids=["grouped", "mha-partial-rotary"])
@pytest.mark.parametrize("precision, checkpointing, targets, padded, dropout", [
    ("fp32", None, "all-linear", False, 0.0), ("bf16", None, "qkv_proj", True, 0.1),
    ("fp32", False, "o_proj,gate_up_proj", True, 0.1), ("bf16", False, "all-linear", False, 0.1),
    ("fp32", False, "gate_up_proj", False, 0.0), ("bf16", False, "o_proj", False, 0.1),
    ("fp32", 1, "down_proj", True, 0.0), ("bf16", 1, "o_proj,gate_up_proj", False, 0.0),
    ("fp32", True, "qkv_proj,down_proj", False, 0.1)], ids=lambda v: str(v))
def test_phi3_lora_activations_are_planned_exactly(profile, precision, checkpointing, targets, padded, dropout):
    """One adapter per fused projection; o_proj's input copy is saved by its own adapter only
    (with dropout not even there: the dropped copy is)."""
    assert_lora_planned_exactly(profile, precision, checkpointing, targets, padded, dropout)


@pytest.mark.parametrize("precision, checkpointing, targets, padded, dropout", [
    ("fp32", None, "all-linear", False, 0.0), ("bf16", None, "q_proj,v_proj", True, 0.1),
    ("fp32", False, "o_proj,up_proj", True, 0.0), ("bf16", False, "all-linear", False, 0.1),
    ("fp32", False, "k_proj", False, 0.0), ("bf16", False, "q_proj", False, 0.1),
    ("bf16", False, "v_proj,o_proj", False, 0.0), ("fp32", 1, "k_proj,down_proj", True, 0.1)],
    ids=lambda v: str(v))
def test_qwen3_lora_activations_are_planned_exactly(precision, checkpointing, targets, padded, dropout):
    """A frozen norm's weight needs no normalised input; in layer 0 without recompute, the norm
    over a projection without an adapter saves nothing (its input needs no gradient)."""
    assert_lora_planned_exactly(QWEN3, precision, checkpointing, targets, padded, dropout)


GEMMA = dataclasses.replace(QWEN3, family="gemma")
GEMMA3 = dataclasses.replace(QWEN3, family="gemma3_text", **SLIDES)
#: Gemma-3 at rows of 20 tokens: a local layer whose window (8) is shorter, then a global one; all
#: local with a window as long as the row (it takes a mask: transformers' SDPA skips one only for
#: a longer window); every layer global.
GEMMA3_KINDS = [GEMMA3, dataclasses.replace(GEMMA3, sliding_window=20, sliding_window_pattern=6),
                dataclasses.replace(GEMMA3, sliding_window_pattern=1)]
GEMMA3_MQA = dataclasses.replace(GEMMA3, num_key_value_heads=1)  # (one key/value head: repeated as a view)
#: Gemma-3 4B and up: the same text model inside Gemma3ForConditionalGeneration, beside a vision tower.
VISION = dict(vision_hidden_size=16, vision_intermediate_size=32, vision_layers=1, image_size=28, patch_size=14)
GEMMA3_VL = dataclasses.replace(GEMMA3, family="gemma3", **VISION)


MISTRAL_WINDOW = dataclasses.replace(QWEN3, family="mistral", sliding_window=8)  # (every layer slides)


@pytest.mark.parametrize("padded", [False, True], ids=["", "padded"])
@pytest.mark.parametrize("checkpointing", [True, False, 1], ids=["recompute", "keep", "first-of-two"])
@pytest.mark.parametrize("profile", [GEMMA, *GEMMA3_KINDS, GEMMA3_MQA, MISTRAL_WINDOW, GEMMA3_VL],
                         ids=["gemma", "gemma3", "gemma3-local", "gemma3-global", "gemma3-mqa", "mistral-window",
                              "gemma3-vl"])
def test_gemma_activations_are_planned_exactly(profile, checkpointing, padded):
    """A Gemma norm computes in fp32 and saves its 1 + weight; Gemma-3 normalises the attention's
    and the MLP's outputs too, and its local layers take a mask where the window is no longer
    than the row (one row's without padding), each kind of layer with its own cos/sin, freed
    after the lowest layer of its kind."""
    assert ModelProfile.from_hf_config(profile.to_hf_config(), name="t") == profile
    for precision in ("fp32", "bf16"):
        assert activation_peak(profile, precision=precision, checkpointing=checkpointing, padded=padded) == \
            activation_bytes(model=profile, batch_size=2, seq_len=20, precision=precision, checkpointing=checkpointing,
                             padded=padded), precision


@pytest.mark.parametrize("profile", [GEMMA, *GEMMA3_KINDS[:2], GEMMA3_VL], ids=["gemma", "gemma3", "gemma3-local",
                                                                           "gemma3-vl"])
@pytest.mark.parametrize("precision, checkpointing, targets, padded, dropout", [
    ("fp32", None, "all-linear", False, 0.0), ("bf16", None, "q_proj,v_proj", True, 0.1),
    ("fp32", False, "o_proj,up_proj", True, 0.0), ("bf16", False, "all-linear", False, 0.1),
    ("fp32", False, "k_proj", False, 0.0), ("bf16", False, "v_proj,o_proj", False, 0.0),
    ("fp32", False, "gate_proj", False, 0.1), ("fp32", 1, "k_proj,down_proj", True, 0.1),
    ("fp32", 1, "o_proj", False, 0.0), ("bf16", True, "up_proj,down_proj", False, 0.1)], ids=lambda v: str(v))
def test_gemma_lora_activations_are_planned_exactly(profile, precision, checkpointing, targets, padded, dropout):
    """A frozen Gemma norm saves its 1 + weight, not its normalised input; layer 0 (its input
    needs no gradient), kept or recomputed, saves nothing before its first adapter, nor cos/sin
    where its q and k need none (Gemma-3's lone local layer: no other layer keeps them)."""
    assert_lora_planned_exactly(profile, precision, checkpointing, targets, padded, dropout)


@pytest.mark.parametrize("checkpointing", [True, False, 1], ids=["recompute", "keep", "first-of-two"])
@pytest.mark.parametrize("profile", [GEMMA3, dataclasses.replace(GEMMA3, num_key_value_heads=4),
                                     dataclasses.replace(GEMMA3, sliding_window=5, sliding_window_pattern=6),
                                     dataclasses.replace(MISTRAL_WINDOW, sliding_window=5), GEMMA3_MQA,
                                     dataclasses.replace(PHI3, sliding_window=5), GEMMA3_VL],
                         ids=["grouped", "mha", "all-local", "mistral", "mqa", "phi3", "gemma3-vl"])
def test_windows_in_blocks_are_planned_exactly(monkeypatch, profile, checkpointing):
    """finetune's attention (offload.engine.segments) takes a long row's window in blocks: each
    block's band mask and, with grouped heads, its keys and values repeated; their outputs
    joined. No S x S mask. Rows a multiple of the window and not, and as long as it (no mask)."""
    from peft import LoraConfig

    from tierwise.offload.plan import perfmodel

    monkeypatch.setattr(perfmodel, "SEGMENTS_FROM", 4)
    for precision, seq, lora in (("fp32", 20, None), ("bf16", 23, None), ("fp32", 8, None),
                                 ("bf16", 20, "all-linear"), ("fp32", 23, "v_proj,down_proj")):
        if lora and profile.fused:
            lora = lora.replace("v_proj", "qkv_proj")  # (Phi-3's fused projection)
        wanted = parse_targets(lora, profile_linears(profile.param_specs())) if lora else None
        config = LoraConfig(r=4, lora_alpha=8, target_modules=lora if lora == "all-linear" else sorted(wanted)) \
            if lora else None
        assert activation_peak(profile, precision=precision, checkpointing=checkpointing, seq=seq, lora=config,
                               windows=True) == \
            activation_bytes(model=profile, batch_size=2, seq_len=seq, precision=precision,
                             checkpointing=checkpointing, windows=True, lora=(wanted, 4) if lora else None), (precision, seq)


@pytest.mark.parametrize("checkpointing", [True, False])
@pytest.mark.parametrize("profile", [GEMMA3, GEMMA3_MQA], ids=["grouped", "mqa"])
def test_packed_documents_in_windows_stay_within_the_plan(monkeypatch, profile, checkpointing):
    """Packed rows (the planner cannot know their documents): a document no longer than the window
    runs whole, saving views of the whole k/v, one longer in blocks; whatever the cuts, the
    engine's peak is at most the plan's."""
    import transformers

    from tierwise.offload.engine.segments import use_segments
    from tierwise.offload.plan import perfmodel

    monkeypatch.setattr(perfmodel, "SEGMENTS_FROM", 4)
    planned = activation_bytes(model=profile, batch_size=2, seq_len=32, precision="fp32", checkpointing=checkpointing,
                               windows=True, row_positions=True)
    for cuts in ([], [3], [10], [5, 12], [9, 18, 27], [2, 4, 6, 30]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(profile.to_hf_config())
        assert use_segments(model)
        engine = Engine(model, budget=Budget(chunk=16 << 10), activations=Activations(recompute=checkpointing))
        x = torch.randint(0, profile.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
        pos = torch.cat([torch.arange(b - a) for a, b in zip([0, *cuts], [*cuts, 32])])
        try:
            engine.step({"input_ids": x, "labels": x, "position_ids": pos.repeat(2, 1), "use_cache": False})
            assert engine.ledger.kind_peak("gpu", "activation") <= planned, cuts
        finally:
            engine.close()


@pytest.mark.parametrize("lora", [None, "v_proj", "o_proj,down_proj"])
def test_a_recomputed_layer_finds_only_its_offloaded_inputs_held(lora):
    """Offloaded inputs: layer n's recompute finds its own and the one fetched ahead (a LoRA run's
    first too): Gemma-3's lone local layer 0, the peak here, finds one, not two."""
    from peft import LoraConfig

    wanted = parse_targets(lora) if lora else None
    config = LoraConfig(r=4, lora_alpha=8, target_modules=sorted(wanted)) if lora else None
    for profile in (GEMMA3, dataclasses.replace(GEMMA3, num_hidden_layers=3, sliding_window_pattern=3)):
        for precision in ("fp32", "bf16"):
            assert activation_peak(profile, precision=precision, checkpointing=True, lora=config, seq=64,
                                   offload=True) == \
                activation_bytes(model=profile, batch_size=2, seq_len=64, precision=precision, checkpointing=True,
                                 offload=True, lora=(wanted, 4) if lora else None), (profile.num_hidden_layers, precision)


def test_gemma_3_is_planned():
    """Gemma-3 1B and 270M, 4B, 12B and 27B (with their vision towers), and Gemma 7B (the model
    cards' counts; the plan adds the adapters), QLoRA on a 24 GB card at 8K tokens."""
    for name, params in (("gemma-3-1b", 999_885_952), ("gemma-3-270m", 268_098_176), ("gemma-7b", 8_537_680_896),
                         ("gemma-3-4b", 4_300_079_472), ("gemma-3-12b", 12_187_325_040),
                         ("gemma-3-27b", 27_432_406_640)):
        plan = planner.make_plan(model=name, hardware="rtx4090", gpu_mem="24G", cpu_mem="64G", optimizer="adamw",
                                 precision="bf16", batch_size=1, seq_len=8192, lora_rank=16, base_dtype="nf4",
                                 double_quant=True)
        assert plan.num_params - plan.trainable_params == params and plan.feasible and plan.tokens_per_s > 0, name


@pytest.mark.parametrize("family, targets, gpu_mem, accum", [
    ("llama", "all-linear", "950K", 1), ("llama", "all-linear", "900K", 2), ("llama", "k_proj,v_proj", "800K", 2),
    ("qwen3", "all-linear", "950K", 1), ("qwen3", "all-linear", "900K", 2), ("qwen3", "k_proj,v_proj", "800K", 2),
    ("qwen3", "q_proj,down_proj", "1M", 1), ("phi3", "all-linear", "900K", 2), ("phi3", "o_proj,down_proj", "900K", 2),
    ("phi3", "gate_up_proj", "1M", 1), ("gemma", "all-linear", "900K", 2), ("gemma3_text", "all-linear", "950K", 1),
    ("gemma3_text", "all-linear", "900K", 2), ("gemma3_text", "v_proj,down_proj", "800K", 2),
    ("gemma3", "all-linear", "950K", 1), ("gemma3", "o_proj,up_proj", "800K", 2)])
def test_the_planned_lora_trace_is_the_engines(monkeypatch, family, targets, gpu_mem, accum):
    """The planner's trace of a LoRA step (lora.step_trace) against the one the engine records,
    event for event over the streamed chunks: in layer 0, the adapters of linears whose input
    needs no gradient still read their lora_B in backward (the plan left them out: its base
    reads were a chunk off at some cache limits with gradient accumulation)."""
    import peft

    profile = dataclasses.replace(QWEN3, family=family, hidden_size=64, intermediate_size=176, num_hidden_layers=3,
                                  vocab_size=512, head_dim=32 if family in ("qwen3", "gemma3_text", "gemma3") else None,
                                  **SLIDES if family.startswith("gemma3") else {}, **VISION if family == "gemma3" else {})
    recorded, planned = [], []
    end_step, schedule = trace.TraceFollower.end_step, planner.plan_schedule

    def record(self):
        if self._recording:
            recorded.append(list(self._recording))
        end_step(self)

    def plan(events, **kw):
        planned.append(list(events))
        return schedule(events, **kw)

    monkeypatch.setattr(trace.TraceFollower, "end_step", record)
    monkeypatch.setattr(planner, "plan_schedule", plan)
    lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules=targets if targets == "all-linear" else targets.split(","))
    report = verify(model=profile, gpu_mem=gpu_mem, cpu_mem="64M", optimizer="adamw", precision="fp32", batch_size=2,
                    seq_len=32, chunk_bytes="16K", lora=lora, base_dtype="nf4", double_quant=True, steps=4,
                    grad_accum=accum)
    assert report.passed, report.render()
    streamed = {c for _, c in planned[-1]}
    assert [e for e in recorded[-1] if e[1] in streamed] == planned[-1]
    assert report.base_read["host"] == report.plan.base_read["host"] > 0


@pytest.mark.parametrize("family, given, words", [("llama", dict(attention_bias=True), "attention_bias=True"),
                                                  ("qwen3", dict(mlp_bias=True), "mlp_bias=True"),
                                                  ("qwen2_moe", dict(qkv_bias=False), "qkv_bias=False"),
                                                  ("phi3", dict(resid_pdrop=0.1), "resid_pdrop=0.1"),
                                                  ("llama", dict(attention_dropout=0.1), "attention_dropout=0.1")])
def test_biases_the_formulas_do_not_price_are_refused(family, given, words):
    """Llama's and Qwen3's attention_bias also biases o_proj, mlp_bias every MLP linear,
    Qwen2-MoE's qkv_bias=False drops the q/k/v biases the family otherwise has, and dropout saves
    its masks."""
    profile = dataclasses.replace(QWEN3, family=family, head_dim=None) if family != "qwen2_moe" else dataclasses.replace(
        QWEN3, family=family, head_dim=None, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=32)
    config = profile.to_hf_config()
    assert ModelProfile.from_hf_config(config, name="t").family == family
    for key, value in given.items():
        setattr(config, key, value)
    with pytest.raises(FieldValueError, match=f"not with {words}: `plan` and `--dry-run` cannot price"):
        ModelProfile.from_hf_config(config, name="t")


@pytest.mark.parametrize("given, words", [(dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0"),
                                          (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),
                                          (dict(layer_types=["full_attention", "sliding_attention"]),
                                           "layer_types that are not every n-th layer global")])
def test_gemma_3_configs_the_formulas_do_not_price_are_refused(given, words):
    """Soft-capped logits or attention (Gemma-2's, eager attention) and local and global layers
    in another arrangement than Gemma-3's every n-th layer global."""
    config = GEMMA3.to_hf_config()
    assert config.layer_types == ["sliding_attention", "full_attention"]
    config.layer_types = ["full_attention"] * 2  # (every layer global: n = 1, whatever the config's old pattern)
    assert ModelProfile.from_hf_config(config, name="t") == dataclasses.replace(GEMMA3, sliding_window_pattern=1)
    config = GEMMA3.to_hf_config()
    for key, value in given.items():
        setattr(config, key, value)
    with pytest.raises(FieldValueError, match=f"not with {words}: `plan` and `--dry-run` cannot price"):
        ModelProfile.from_hf_config(config, name="t")


def test_qwen2_windows_on_some_layers_only_are_refused():
    """Qwen2's use_sliding_window slides the layers from max_window_layers on: priced where every
    layer slides or none does, refused where some do (Qwen2-MoE's, every other layer)."""
    import transformers

    common = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=64, use_sliding_window=True, sliding_window=8)
    every = ModelProfile.from_hf_config(transformers.Qwen2Config(**common, max_window_layers=0), name="t")
    assert every.sliding_window == 8 and every.slides(0) and every.slides(1)
    assert ModelProfile.from_hf_config(every.to_hf_config(), name="t") == every
    with pytest.raises(FieldValueError, match="not with a sliding window on some layers only .max_window_layers=1."):
        ModelProfile.from_hf_config(transformers.Qwen2Config(**common, max_window_layers=1), name="t")
    none = ModelProfile.from_hf_config(transformers.Qwen2Config(**common, max_window_layers=2), name="t")
    assert none.sliding_window is None  # (from max_window_layers on: none here)
    moe = dict(common, moe_intermediate_size=16, shared_expert_intermediate_size=32, num_experts=4,
               num_experts_per_tok=2)  # (Qwen2-MoE slides every other layer: refused)
    with pytest.raises(FieldValueError, match="not with a sliding window on some layers only"):
        ModelProfile.from_hf_config(transformers.Qwen2MoeConfig(**moe, max_window_layers=2), name="t")
