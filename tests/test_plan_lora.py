"""The planner's LoRA/QLoRA model against the engine (tests/test_budget_matrix.py runs whole
LoRA steps: peaks per tier, base traffic): here its parts, each against what the engine
builds or measures -- the parameters PEFT injects, the frozen chunks' encoded bytes, the
activations autograd saves -- and the plan a user reads."""

import copy

import pytest
import torch

peft = pytest.importorskip("peft")

from tierwise.offload import Activations, Budget, Engine, Precision  # noqa: E402
from tierwise.offload.core.chunks import specs_of  # noqa: E402
from tierwise.offload.engine.model_info import model_specs  # noqa: E402
from tierwise.offload.core.errors import UnsupportedModel  # noqa: E402
from tierwise.offload.engine.frozen_base import quantizable  # noqa: E402
from tierwise.offload.plan.lora import lora_specs, parse_targets  # noqa: E402
from tierwise.offload.plan.perfmodel import activation_bytes  # noqa: E402
from tierwise.offload.plan.planner import _Chunks, make_plan  # noqa: E402
from tests.test_budget_matrix import MODELS, data, fresh_model  # noqa: E402

CHUNK = 16 << 10


def config(targets: str, rank: int = 4, dropout: float = 0.0):
    return peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=dropout,
                           target_modules=targets if targets == "all-linear" else targets.split(","))


@pytest.mark.parametrize("targets", ["all-linear", "q_proj,v_proj", "down_proj"])
@pytest.mark.parametrize("model", ["dense", "tied"])
def test_lora_specs_are_what_peft_injects(model, targets):
    m = peft.inject_adapter_in_model(config(targets), fresh_model(model))
    mine = lora_specs(MODELS[model].param_specs(), rank=4, targets=targets)
    assert [(s.name, tuple(s.shape)) for s in mine.specs] == [(s.name, tuple(s.shape)) for s in specs_of(
        m.named_parameters())]
    assert mine.frozen == {n for n, p in m.named_parameters() if not p.requires_grad}
    assert mine.quantizable == quantizable(m) & mine.frozen


#: Per family of tests/tinyhf.FAMILIES, target names beside all-linear: fused projections (Phi-3's
#: qkv_proj/gate_up_proj, GPT-NeoX/Falcon's query_key_value), GPT-2's Conv1D, names that match
#: several modules (GPT-2's c_proj: attention and MLP), a MoE's shared expert (Qwen2-MoE's down_proj).
FAMILY_TARGETS = {"llama": "q_proj,v_proj", "llama-tied": "o_proj,down_proj", "gpt2": "c_attn,c_proj",
                  "gpt-neox": "query_key_value,dense_4h_to_h", "qwen2": "q_proj,k_proj", "qwen3": "k_proj,down_proj",
                  "mistral": "v_proj,up_proj",
                  "phi3": "qkv_proj,gate_up_proj", "gemma2": "q_proj,gate_proj", "gemma3": "k_proj,up_proj", "gemma3-vl": "q_proj,o_proj", "gemma": "v_proj,down_proj", "opt": "q_proj,fc2",
                  "falcon": "query_key_value", "qwen2-moe": "q_proj,down_proj", "mixtral": "q_proj,v_proj"}
FUSED_EXPERTS = ("qwen2-moe", "mixtral")  # 3-D expert parameters: all-linear is refused


def family_model(family):
    from tests.tinyhf import family_config
    from transformers import AutoModelForCausalLM

    from tierwise.cli.builtin import build_tokenizer

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(family_config(family, tokenizer=build_tokenizer(vocab_size=288)))


@pytest.mark.parametrize("targets", ["all-linear", "family"])
@pytest.mark.parametrize("family", list(FAMILY_TARGETS))
def test_lora_specs_are_what_peft_makes_for_every_family(family, targets):
    """The planner's adapters (names, shapes, order), frozen base and encodable weights for each
    family the CLI trains equal those of peft.get_peft_model on the same model (the reference)."""
    from tierwise.offload.engine.frozen_base import linear_modules

    targets = FAMILY_TARGETS[family] if targets == "family" else targets
    model = family_model(family)
    specs, linears = model_specs(model), linear_modules(model)
    ref = peft.get_peft_model(copy.deepcopy(model), config(targets))
    theirs = [(n.removeprefix("base_model.model."), tuple(p.shape)) for n, p in ref.named_parameters()]
    kind = model.config.model_type
    # where this PEFT adapts the experts and the router as parameters (Mixtral's all-linear; from
    # PEFT 0.22 Qwen2-MoE's too, and its names gate_proj/up_proj/down_proj): refused, not priced
    if any((".experts." in n or ".mlp.gate.lora_" in n) and "lora_A" in n for n, _ in theirs):
        assert family in FUSED_EXPERTS
        with pytest.raises(UnsupportedModel, match="fused MoE experts"):
            lora_specs(specs, rank=4, targets=targets, linears=linears, family=kind)
        return
    mine = lora_specs(specs, rank=4, targets=targets, linears=linears, family=kind)
    assert [(s.name, tuple(s.shape)) for s in mine.specs] == theirs
    trainable = [n for n, p in ref.named_parameters() if p.requires_grad]
    assert sum(s.numel for s in mine.specs if s.name not in mine.frozen) == \
        sum(p.numel() for p in ref.parameters() if p.requires_grad) > 0
    assert mine.frozen == {n for n, _ in theirs} - {n.removeprefix("base_model.model.") for n in trainable}
    assert mine.quantizable == quantizable(ref.base_model.model) & mine.frozen


@pytest.mark.parametrize("base, double_quant", [("nf4", True), ("nf4", False), ("int8", False), ("bf16", False),
                                                (None, False)])
def test_frozen_chunk_bytes_are_the_engines(base, double_quant):
    model, targets = "dense", "q_proj,v_proj"
    eng = Engine(fresh_model(model), budget=Budget(chunk=CHUNK),
                 precision=Precision(base=base, double_quant=double_quant), lora=config(targets))
    kinds = dict(eng.kinds)
    eng.close()
    ch = _Chunks(model=MODELS[model], optimizer="adamw", precision="fp32", chunk_bytes=CHUNK, rank=None,
                 lora=lora_specs(MODELS[model].param_specs(), rank=4, targets=targets), base_dtype=base,
                 double_quant=double_quant)
    assert dict(enumerate(ch.kinds)) == kinds


ACTIVATION_CASES = [("fp32", None, "all-linear", False), ("bf16", None, "q_proj,v_proj", True),
                    ("fp32", False, "o_proj,up_proj", True), ("bf16", False, "all-linear", False),
                    ("fp32", False, "gate_proj", False), ("bf16", False, "down_proj", True),
                    ("fp32", 1, "all-linear", False), ("bf16", 1, "q_proj,v_proj", True),
                    ("bf16", 1, "o_proj,up_proj", False), ("fp32", 1, "down_proj", True)]
DROPOUT_CASES = ACTIVATION_CASES + [("fp32", False, "q_proj,k_proj,down_proj", True), ("bf16", None, "o_proj", False),
                                    ("fp32", None, "gate_proj,up_proj,down_proj", True)]


def measured_activations(prec, checkpointing, targets, padded, dropout=0.0):
    eng = Engine(fresh_model("dense"), budget=Budget(chunk=CHUNK), precision=Precision(prec),
                 activations=Activations(recompute=checkpointing), lora=config(targets, dropout=dropout))
    b = data("dense")[0]
    if padded:
        b = dict(b, attention_mask=torch.ones_like(b["input_ids"]))
        b["attention_mask"][0, -3:] = 0
    eng.step(b)
    measured = eng.ledger.kind_peak("gpu", "activation")
    eng.close()
    return measured


@pytest.mark.parametrize("prec, checkpointing, targets, padded", ACTIVATION_CASES)
def test_lora_activations_are_what_the_engine_measures(prec, checkpointing, targets, padded):
    planned = activation_bytes(model=MODELS["dense"], batch_size=2, seq_len=16, precision=prec,
                               checkpointing=checkpointing, padded=padded, lora=(parse_targets(targets), 4))
    assert planned == measured_activations(prec, checkpointing, targets, padded)


@pytest.mark.parametrize("prec, checkpointing, targets, padded", DROPOUT_CASES)
def test_lora_dropout_activations_are_what_the_engine_measures(prec, checkpointing, targets, padded):
    """LoRA dropout 0.05: each targeted linear's dropped input copy and, where its input needs a
    gradient, dropout's saved noise (compute dtype on the CPU), as the engine measures them;
    and the plan of the run books them (its gpu activations)."""
    mask = 4 if prec == "fp32" else 2
    planned = activation_bytes(model=MODELS["dense"], batch_size=2, seq_len=16, precision=prec,
                               checkpointing=checkpointing, padded=padded, lora=(parse_targets(targets), 4, mask))
    measured = measured_activations(prec, checkpointing, targets, padded, dropout=0.05)
    assert planned == measured
    without = activation_bytes(model=MODELS["dense"], batch_size=2, seq_len=16, precision=prec,
                               checkpointing=checkpointing, padded=padded, lora=(parse_targets(targets), 4))
    # dropout saves more, where the peak is not the loss's moment (the end of forward)
    assert measured - measured_activations(prec, checkpointing, targets, padded) == planned - without
    assert planned > without or checkpointing is None
    plan = make_plan(model=MODELS["dense"], hardware="cpu-sim", gpu_mem="1G", cpu_mem="1G", optimizer="adamw",
                     precision=prec, batch_size=2, seq_len=16, lora_rank=4, lora_targets=targets, lora_dropout=0.05,
                     checkpointing=checkpointing, padded=padded, suggest=False)
    assert plan.reserve["gpu"]["activations"] == measured


def test_70b_qlora_on_a_24g_gpu_and_64g_host(tmp_path):
    """The issue's goals, in the planner's numbers (rtx4090 profile): 70B QLoRA fits 24 GB + 64 GB
    and is compute-bound at >= 150 tokens/s at the micro-batch it suggests; 405B fits with NVMe."""
    from typer.testing import CliRunner

    from tierwise.cli.main import app

    r = CliRunner().invoke(app, ["plan", "--model", "70b", "--qlora", "--gpu-mem", "24G", "--cpu-mem", "64G", "--hardware",
                   "rtx4090", "--precision", "bf16", "--seq-len", "512", "--batch-size", "1"])
    out = r.output
    assert r.exit_code == 0, out
    # 14.1 GiB of the NF4 base is gpu-home (the rest streams from the host): micro-batch 1's
    # forward is bound by the link, its backward by compute; micro-batch 2 is compute-bound in both
    assert "base nf4" in out and "written 0 B" in out and "(pcie h2d-bound)" in out, out
    assert "LoRA suggestion: --batch-size 2 --grad-accum 1 is compute-bound" in out, out
    plan = make_plan(model="70b", hardware="rtx4090", gpu_mem="24G", cpu_mem="64G", optimizer="adamw",
                     precision="bf16", batch_size=2, seq_len=512, lora_rank=16, base_dtype="nf4", double_quant=True)
    assert set(plan.bounds.values()) == {"gpu compute"} and plan.tokens_per_s >= 150
    assert plan.base_written == 0 and plan.peak["gpu"] <= 24 << 30 and plan.peak["host"] <= 64 << 30
    assert plan.bytes["gpu"]["base"] > 10 << 30 and plan.bytes["host"]["base"] > 0  # a partial home
    big = make_plan(model="405b", hardware="rtx4090", gpu_mem="24G", cpu_mem="64G", nvme_path=str(tmp_path),
                    optimizer="adamw", precision="bf16", batch_size=1, seq_len=512, lora_rank=16, base_dtype="nf4",
                    double_quant=True, suggest=False)
    assert big.bytes["nvme"]["base"] > 0 and big.base_read["nvme"] > 0


def test_8b_qlora_base_is_gpu_home_on_12g_and_decoded_once_on_24g():
    """An 8B NF4 base (~4.5 GiB encoded, ~15 GiB decoded in bf16): on a 12 GB card the planner
    keeps the encoded bytes on the device, as the engine does (decoded per use, priced); on a
    24 GB card the decoded base fits: decoded once, booked at its decoded size, no decoding per
    step. Either way the base reads 0 bytes per step from any host-side tier."""
    plans = {gpu: make_plan(model="8b", hardware="rtx4090", gpu_mem=gpu, cpu_mem="64G", optimizer="adamw",
                            precision="bf16", batch_size=1, seq_len=512, lora_rank=16, base_dtype="nf4",
                            double_quant=True, suggest=False) for gpu in ("12G", "24G")}
    for gpu, plan in plans.items():
        assert plan.bytes["gpu"]["base"] > 4 << 30 and all(plan.bytes[t]["base"] == 0 for t in ("host", "cxl", "nvme"))
        assert plan.base_read == {"host": 0, "cxl": 0, "nvme": 0} and plan.base_written == 0
        assert plan.peak["gpu"] <= int(gpu[:-1]) << 30
    assert plans["12G"].dequant_s > 0 and plans["12G"].bytes["gpu"]["base"] < 6 << 30
    assert plans["24G"].dequant_s == 0 and plans["24G"].bytes["gpu"]["base"] > 14 << 30
    assert plans["24G"].step_s < plans["12G"].step_s
