"""bench/e2e_common.py's LoRA model builder: every side of bench/e2e_vs_deepspeed.py --lora
(ours, DeepSpeed, plain PyTorch) builds its model with it and must start from the same weights."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import e2e_common as common  # noqa: E402

HF = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
      "intermediate_size": 64, "vocab_size": 128, "tie_word_embeddings": False}


def spec(targets="all-linear", **kw):
    return {"hf_config": HF, "seed": 0, "lora": {"r": 4, "alpha": 8, "targets": targets, "seed": 2, **kw}}


def test_parse_lora_targets():
    assert common.parse_lora_targets("all-linear") == "all-linear"
    assert common.parse_lora_targets(" q_proj, v_proj ,") == ["q_proj", "v_proj"]
    with pytest.raises(ValueError, match="no module names"):
        common.parse_lora_targets(" , ")
    with pytest.raises(ValueError, match="all-linear"):
        common.lora_config({"r": 4, "alpha": 8, "targets": []})


@pytest.mark.parametrize("targets,per_layer", [("all-linear", 7), (["q_proj", "k_proj", "v_proj", "o_proj"], 4)])
def test_build_lora_is_reproducible_and_trains_adapters_only(targets, per_layer):
    a, b = common.build(spec(targets)), common.build(spec(targets))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    trainable = {n: p for n, p in a.named_parameters() if p.requires_grad}
    assert len(trainable) == 2 * per_layer * HF["num_hidden_layers"]
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert all(p.abs().sum() > 0 if ".lora_A." in n else not p.any() for n, p in trainable.items())  # PEFT's init
    # the base under the adapters is the plain model's, and the adapter seed is the spec's
    base = common.build_model(HF, seed=0).state_dict()
    wrapped = {k.replace("base_model.model.", "").replace(".base_layer.", "."): v for k, v in sa.items()
               if ".lora_" not in k}
    assert wrapped.keys() == base.keys() and all(torch.equal(base[k], wrapped[k]) for k in base)
    other = common.build(spec(targets, seed=3)).state_dict()
    assert any(not torch.equal(sa[k], other[k]) for k in sa if ".lora_A." in k)


def test_build_without_lora_is_the_plain_model():
    m = common.build({"hf_config": HF, "seed": 0, "lora": None})
    assert common.weights_checksum(m) == common.weights_checksum(common.build_model(HF, seed=0))
    assert all(p.requires_grad for p in m.parameters())
