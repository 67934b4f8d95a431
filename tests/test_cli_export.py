"""cli.export and cli.loading against real transformers checkpoints of a tiny Llama."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tinyhf import make_tiny_llama_dir  # noqa: E402

from tierwise.cli.export import export_hf  # noqa: E402
from tierwise.cli.loading import (ModelError, build_meta_model, iter_safetensors,  # noqa: E402
                         resolve_model)


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory):
    return make_tiny_llama_dir(tmp_path_factory.mktemp("m") / "sharded", shard=True, seed=1)


def _logits(model_dir, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(ids).logits, model


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_export_loads_in_transformers_with_identical_logits(tmp_path, tie):
    src = make_tiny_llama_dir(tmp_path / "src", tie=tie)
    ids = torch.tensor([[1, 5, 9, 33, 200]])
    ref, model = _logits(src, ids)
    out = export_hf(((n, p.float()) for n, p in model.state_dict().items()), tmp_path / "out",
                    config=model.config, tokenizer=resolve_model(str(src)).tokenizer,
                    dtype="fp32", max_shard_size="48K",
                    generation_config=src / "generation_config.json")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    assert ("lm_head.weight" in index["weight_map"]) is not tie
    assert (out / "tokenizer.json").exists() and (out / "generation_config.json").exists()
    got, _ = _logits(out, ids)
    assert torch.equal(ref, got)


def test_export_bf16_single_file(tmp_path):
    src = make_tiny_llama_dir(tmp_path / "src")
    _, model = _logits(src, torch.tensor([[1]]))
    out = export_hf(model.state_dict().items(), tmp_path / "out", config=model.config,
                    dtype="bf16")
    assert (out / "model.safetensors").exists()
    assert not (out / "model.safetensors.index.json").exists()
    tensors = dict(iter_safetensors(out))
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())


def test_iter_safetensors_sharded_and_ordered(sharded_dir):
    meta = build_meta_model(resolve_model(str(sharded_dir)).config)
    assert all(p.is_meta for p in meta.parameters())
    names = [n for n, _ in meta.named_parameters()]
    streamed = dict(iter_safetensors(sharded_dir))
    assert set(streamed) == set(names)
    ordered = [n for n, _ in iter_safetensors(sharded_dir, order=names[::-1])]
    assert ordered == names[::-1]
    with pytest.raises(ModelError, match="no tensor named"):
        list(iter_safetensors(sharded_dir, order=["nope.weight"]))


def test_resolve_model_errors(tmp_path):
    with pytest.raises(ModelError, match="no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ModelError, match="not a Hugging Face model directory"):
        resolve_model(str(tmp_path / "missing" / "dir"))
    builtin = resolve_model(None)
    assert builtin.name == "builtin-tiny" and not builtin.has_weights
