"""Fused MoE experts (transformers 5's 3-D `experts.gate_up_proj` / `experts.down_proj`) in an
int8/NF4 base: encoded like the linear weights, decoded right before use.

The model is a tiny Mixtral / Qwen2-MoE saved by `save_pretrained` (per-expert tensors on disk)
and loaded the way `finetune` loads it (meta model, PEFT's adapters, cli.layout's conversion
into the fused experts, Engine.load_weights). References: bitsandbytes' quantize_4bit /
dequantize_4bit of the same tensor, and PEFT (its target_parameters wrappers over the experts)
trained in plain PyTorch on those dequantized weights.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft")
bnbf = pytest.importorskip("bitsandbytes.functional")

sys.path.insert(0, str(Path(__file__).parent))
from tinyhf import make_tiny_family_dir  # noqa: E402

from tierwise.cli import lora as lora_mod  # noqa: E402
from tierwise.cli.layout import ModelLayout, iter_checkpoint  # noqa: E402
from tierwise.cli.loading import build_meta_model, resolve_model  # noqa: E402
from tierwise.offload import Engine, flat_options  # noqa: E402
from tierwise.offload.plan.lora import adapts_experts  # noqa: E402
from tests.test_lora import peft_reference  # noqa: E402

SEED = 3


@pytest.fixture(scope="module", params=["mixtral", "qwen2-moe"])
def moe_dir(request, tmp_path_factory):
    return request.param, make_tiny_family_dir(tmp_path_factory.mktemp(request.param) / "m", request.param)


def engine_from_dir(path, lora_cfg, **kw) -> Engine:
    """The engine `finetune` builds over the checkpoint in `path` (cli.train._train's steps)."""
    src = resolve_model(str(path))
    model = build_meta_model(src.config)
    layout = ModelLayout.of(model)
    renames = lora_mod.inject(model, lora_cfg, seed=SEED)
    eng = Engine(model, **flat_options(lr=1e-2, chunk_bytes=16 << 10, **kw))
    eng.load_weights(lora_mod.renamed(iter_checkpoint(model, layout, src.model_dir), renames))
    return eng


def bnb_roundtrip(w: torch.Tensor, *, double_quant: bool) -> torch.Tensor:
    """dequantize_4bit(quantize_4bit(w)) with w flattened: quantize_4bit gives the same bytes for
    the 3-D stack (checked), but bitsandbytes 0.50's CPU dequantize_4bit misplaces the absmax of
    a tensor whose last dimension is below the block (64; this tiny model's hidden size is 32),
    so it is given the flat tensor, whose blocks are the ones quantize_4bit made."""
    kw = dict(blocksize=64, quant_type="nf4", compress_statistics=double_quant)
    q, state = bnbf.quantize_4bit(w.reshape(-1), **kw)
    q3, _ = bnbf.quantize_4bit(w.contiguous(), **kw)
    assert torch.equal(q3, q)
    return bnbf.dequantize_4bit(q, state).reshape(w.shape)


def bare(name: str) -> str:
    return name.removeprefix("base_model.model.").replace(".base_layer", "")


def experts_of(named) -> dict[str, torch.Tensor]:
    return {bare(n): t.detach() for n, t in named if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}


@pytest.mark.parametrize("double_quant", [False, True])
def test_decoded_experts_equal_bitsandbytes_dequantize_4bit(moe_dir, tmp_path, double_quant):
    """Every fused expert stack is stored NF4 (bytes as quantize_4bit of the flat tensor) and
    decodes bit for bit to dequantize_4bit of it; with the base on NVMe (the blob crosses it)."""
    from transformers import AutoModelForCausalLM

    _, path = moe_dir
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    eng = engine_from_dir(path, cfg, base_dtype="nf4", double_quant=double_quant, gpu_mem="600K",
                          cpu_mem="200K", nvme_path=str(tmp_path))
    ref = experts_of(AutoModelForCausalLM.from_pretrained(path).named_parameters())
    mine = experts_of(eng.named_parameters_fp32())
    assert mine.keys() == ref.keys() and len(ref) == 4
    for name, w in ref.items():
        theirs = bnb_roundtrip(w, double_quant=double_quant)
        assert not torch.equal(theirs, w), name  # quantized, not passed through
        assert torch.equal(mine[name], theirs), name
    # stored encoded: each stack's chunk is a blob of NF4 bytes, not fp32
    slots = {bare(n): s for n, s in eng.plan.slots.items()}
    for name in ref:
        cid = slots[name].chunk
        assert eng.store.is_encoded(cid) and eng.store.frozen[cid].base[
            next(n for n in eng.plan.chunks[cid].params if bare(n) == name)] == "nf4"
    eng.close()


def test_int8_experts_are_encoded_blockwise(moe_dir):
    """int8 as our int8 codec stores a linear weight: symmetric absmax per block of 64 of the
    flat tensor (the reference computed here in plain torch)."""
    from transformers import AutoModelForCausalLM

    _, path = moe_dir
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])
    eng = engine_from_dir(path, cfg, base_dtype="int8")
    ref = experts_of(AutoModelForCausalLM.from_pretrained(path).named_parameters())
    mine = experts_of(eng.named_parameters_fp32())
    for name, w in ref.items():
        x = w.reshape(-1, 64)  # every stack here is a whole number of blocks
        scale = x.abs().amax(dim=1, keepdim=True) / 127.0
        expect = (torch.round(x / scale).clamp(-127, 127) * scale).reshape(w.shape)
        assert torch.equal(mine[name], expect), name
    eng.close()


def dequantized_reference(path, *, double_quant: bool):
    """The transformers model from `path` with what an NF4 base encodes (nn.Linear weights but
    the head, fused expert stacks) replaced by bitsandbytes' round trip of it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    head = model.get_output_embeddings()
    with torch.no_grad():
        for mod in model.modules():
            if type(mod) is torch.nn.Linear and mod is not head:
                mod.weight.copy_(bnb_roundtrip(mod.weight, double_quant=double_quant))
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.copy_(bnb_roundtrip(p, double_quant=double_quant))
    return model


TARGETS = {"all-linear": dict(target_modules="all-linear"),
           "q_proj,v_proj": dict(target_modules=["q_proj", "v_proj"]),
           "experts": dict(target_modules=["q_proj"], target_parameters=["experts.gate_up_proj", "experts.down_proj"])}


@pytest.mark.parametrize("targets", list(TARGETS))
def test_qlora_over_nf4_experts_equals_peft_on_dequantized_weights(moe_dir, tmp_path, targets):
    """Stated tolerance: none (bit-exact). fp32 compute on the CPU: the engine decodes the NF4
    base into the weights the reference holds, so the arithmetic is the same. PEFT adapts the
    fused experts as parameters (target_parameters: ParamWrapper over the NF4 stacks), itself
    under all-linear for Mixtral (for Qwen2-MoE from PEFT 0.22), or when named."""
    family, path = moe_dir
    cfg = peft.LoraConfig(r=4, lora_alpha=8, **TARGETS[targets])
    x = torch.randint(0, 288, (2, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": x, "labels": x, "attention_mask": torch.ones_like(x)}] * 3

    ref_losses, ref = peft_reference(dequantized_reference(path, double_quant=True), copy.deepcopy(cfg), data,
                                     seed=SEED)

    eng = engine_from_dir(path, copy.deepcopy(cfg), base_dtype="nf4", double_quant=True, gpu_mem="600K",
                          cpu_mem="200K", nvme_path=str(tmp_path))
    assert [eng.step(b) for b in data] == ref_losses
    mine = {bare(n): t for n, t in eng.named_parameters_fp32() if "lora_" in n}
    theirs = {bare(n): t.detach() for n, t in ref.named_parameters() if "lora_" in n}
    assert mine.keys() == theirs.keys()
    by_itself = "all-linear" in adapts_experts(family.replace("-", "_"))  # (this PEFT's)
    assert any(".experts." in n for n in mine) == (targets == "experts" or (targets == "all-linear" and by_itself))
    for n, t in theirs.items():
        assert torch.equal(mine[n], t), n
    eng.close()
