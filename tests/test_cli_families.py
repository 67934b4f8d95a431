"""`finetune` on a saved tiny model of every causal-LM family, against plain PyTorch.

Each checkpoint is written by transformers' own `save_pretrained` (which writes the original
hub layout: Pythia's `embed_out`, Mixtral's `block_sparse_moe.experts.N.w1/w2/w3`, Qwen-MoE's
per-expert `gate_proj/up_proj/down_proj`), or with `save_original_format=False` (the module
names, fused 3-D experts), and is loaded by `from_pretrained` for the reference, so every
layout tested is one transformers loads. For each: the run's first loss equals the
from_pretrained model's loss on the same batch, every loss equals a plain-PyTorch replay (the
CLI's batches and lr schedule, fused AdamW), and the export is what save_pretrained writes for
the replayed model (same names, bit-identical tensors, the source's config.json), ties included.
All in fp32, so "equal" means bit for bit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
from tinyhf import FAMILIES, logits_engine, make_tiny_family_dir, train_as_the_cli, write_jsonl  # noqa: E402

from tierwise.cli import train  # noqa: E402
from tierwise.cli.builtin import sample_rows  # noqa: E402
from tierwise.cli.config import TrainConfig  # noqa: E402
from tierwise.cli.data import eval_batches, isolates, load_blocks  # noqa: E402
from tierwise.cli.packing import use_segments  # noqa: E402
from tierwise.cli.layout import ModelLayout, iter_checkpoint  # noqa: E402
from tierwise.cli.loading import ModelError, build_meta_model  # noqa: E402
from tierwise.cli.main import app  # noqa: E402
from tierwise.cli.metrics import read_metrics  # noqa: E402

OPTIONS = dict(seq_len=16, batch_size=2, steps=3, lr=1e-2, warmup_steps=1, chunk_size="16K",
               recompute=True)  # recompute: the engine turns use_cache off, the export must not


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    return (write_jsonl(root / "train.jsonl", sample_rows(24)),
            write_jsonl(root / "eval.jsonl", sample_rows(3)))


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _from_pretrained(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def _finetune(model_dir: Path, data, out: Path, monkeypatch) -> dict:
    """Run the real CLI in-process; returns the engine's logits of the last eval batch."""
    seen = {}
    monkeypatch.setattr(train, "engine_class", lambda: logits_engine(seen))
    args = ["--model", str(model_dir), "--data", str(data[0]), "--eval-data", str(data[1]),
            "--output", str(out)]
    for k, v in OPTIONS.items():
        flag = "--" + k.replace("_", "-")
        args += [flag] if v is True else [flag, str(v)]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "120"})
    assert result.exit_code == 0, (result.output, result.exception)
    return seen


def _replay(model_dir: Path, data) -> tuple[list[float], torch.nn.Module, dict]:
    """The CLI's run in plain PyTorch: same blocks, batches, lr schedule; fused AdamW."""
    from transformers import AutoTokenizer

    cfg = TrainConfig(model=str(model_dir), data=str(data[0]), **OPTIONS)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = _from_pretrained(model_dir).train()
    losses = train_as_the_cli(model, cfg, tok)
    evals = eval_batches(load_blocks(str(data[1]), tok, seq_len=cfg.seq_len, pack=cfg.pack,
                                     isolate=isolates(model.config, pack=cfg.pack)),
                         batch_size=cfg.batch_size)
    return losses, model.eval(), evals[-1]


def _check_run(src: Path, data, tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "run"
    engine = _finetune(src, data, out, monkeypatch)
    losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]
    ref_losses, ref, eval_batch = _replay(src, data)
    assert losses[0] == ref_losses[0]  # the from_pretrained model's loss: the same weights
    assert losses == ref_losses

    exported = out / "model"
    ref.save_pretrained(tmp_path / "saved")  # what transformers writes for the trained model
    mine, theirs = _weights(exported), _weights(tmp_path / "saved")
    assert sorted(mine) == sorted(theirs)
    assert all(torch.equal(mine[k], theirs[k]) for k in mine), \
        [k for k in mine if not torch.equal(mine[k], theirs[k])]
    assert json.loads((exported / "config.json").read_text()) == \
        json.loads((src / "config.json").read_text())

    model = _from_pretrained(exported).eval()
    use_segments(model)  # attending to packed rows as the run did
    with torch.no_grad():
        logits = model(**eval_batch).logits
    assert torch.equal(logits, engine["logits"])  # the engine's final logits, from the export
    tied = [m.get_output_embeddings().weight is m.get_input_embeddings().weight
            for m in (model, ref)]
    assert tied[0] == tied[1] == bool(model.config.tie_word_embeddings)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_trains_like_pytorch_and_exports_like_save_pretrained(family, data, tmp_path,
                                                                     monkeypatch):
    src = make_tiny_family_dir(tmp_path / "src", family)
    _check_run(src, data, tmp_path, monkeypatch)


def test_meta_model_ties_what_transformers_ties_on_its_own_config():
    from transformers import AutoModelForCausalLM

    from tierwise.cli.builtin import build_tokenizer
    from tinyhf import family_config

    tokenizer = build_tokenizer(vocab_size=288)
    for family in FAMILIES:
        cfg = family_config(family, tokenizer=tokenizer)
        model, built = build_meta_model(cfg), AutoModelForCausalLM.from_config(cfg)
        tied = [m.get_output_embeddings().weight is m.get_input_embeddings().weight
                for m in (model, built)]
        assert tied[0] == tied[1], family
        assert model.config is not cfg  # the engine may change the model's config, not this one


#: Checkpoints whose names on disk are not the module names (save_pretrained writes them so).
LEGACY = {"gpt-neox": "embed_out.weight",
          "mixtral": "model.layers.0.block_sparse_moe.experts.3.w3.weight",
          "qwen2-moe": "model.layers.1.mlp.experts.2.gate_proj.weight"}


@pytest.mark.parametrize("family", sorted(LEGACY))
def test_legacy_layouts_are_real_and_fused_layouts_load_too(family, data, tmp_path, monkeypatch):
    legacy = make_tiny_family_dir(tmp_path / "legacy", family, max_shard_size="24KB")
    assert LEGACY[family] in _weights(legacy)  # the hub layout, sharded: experts span files
    assert len(list(legacy.glob("*.safetensors"))) > 1
    fused = make_tiny_family_dir(tmp_path / "fused", family, save_original_format=False)
    assert LEGACY[family] not in _weights(fused)
    for src in (legacy, fused):
        model = build_meta_model(_from_pretrained(src).config)
        layout = ModelLayout.of(model)
        loaded = dict(iter_checkpoint(model, layout, src))
        ref = _from_pretrained(src)
        assert sorted(loaded) == sorted(n for n, _ in ref.named_parameters())
        assert all(torch.equal(loaded[n], p) for n, p in ref.named_parameters())
    _check_run(fused, data, tmp_path, monkeypatch)  # and the export keeps the fused layout


def test_pythia_checkpoint_with_old_buffers_loads(tmp_path):
    """Real Pythia files also hold per-layer `attention.bias`/`masked_bias`/`rotary_emb.inv_freq`
    buffers that the module no longer has: skipped, as transformers skips them."""
    src = make_tiny_family_dir(tmp_path / "src", "gpt-neox")
    tensors = _weights(src)
    for i in range(2):
        p = f"gpt_neox.layers.{i}.attention."
        tensors[p + "bias"] = torch.ones(1, 1, 64, 64, dtype=torch.bool).tril()
        tensors[p + "masked_bias"] = torch.tensor(-1e9)
        tensors[p + "rotary_emb.inv_freq"] = torch.ones(4)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    ref = _from_pretrained(src)
    model = build_meta_model(ref.config)
    loaded = dict(iter_checkpoint(model, ModelLayout.of(model), src))
    assert all(torch.equal(loaded[n], p) for n, p in ref.named_parameters())


def _tied_with_duplicate(tmp_path, *, head_delta: float) -> Path:
    src = make_tiny_family_dir(tmp_path / "src", "llama-tied")
    tensors = _weights(src)
    assert "lm_head.weight" not in tensors  # save_pretrained writes a tied weight once
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + head_delta
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    return src


def test_tied_checkpoint_storing_the_duplicate_trains_and_exports_once(data, tmp_path,
                                                                       monkeypatch):
    src = _tied_with_duplicate(tmp_path, head_delta=0.0)
    ref = _from_pretrained(src)
    assert ref.lm_head.weight is ref.model.embed_tokens.weight  # transformers ties it too
    _check_run(src, data, tmp_path, monkeypatch)
    assert "lm_head.weight" not in _weights(tmp_path / "run" / "model")


def test_tied_checkpoint_with_a_different_duplicate_is_refused(tmp_path):
    src = _tied_with_duplicate(tmp_path, head_delta=1.0)
    model = build_meta_model(_from_pretrained(src).config)
    with pytest.raises(ModelError, match="differs from .*, which this model ties it to") as e:
        list(iter_checkpoint(model, ModelLayout.of(model), src))
    assert "lm_head.weight" in str(e.value) and "model.embed_tokens.weight" in str(e.value)


def _edited(tmp_path, edit) -> Path:
    src = make_tiny_family_dir(tmp_path / "src", "llama")
    tensors = _weights(src)
    edit(tensors)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    return src


def _error_line(src: Path, data, tmp_path) -> str:
    result = CliRunner().invoke(app, ["--model", str(src), "--data", str(data[0]), "--steps", "1",
                                      "--output", str(tmp_path / "out")])
    assert result.exit_code == 2, (result.output, result.exception)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_a_key_that_maps_to_nothing_is_a_one_line_error(data, tmp_path):
    src = _edited(tmp_path, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.ones(2)}))
    line = _error_line(src, data, tmp_path)
    assert "model.safetensors: tensor 'model.layers.0.mlp.extra.weight' maps to no parameter" \
        in line


def test_a_parameter_the_checkpoint_lacks_is_a_one_line_error(data, tmp_path):
    src = _edited(tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    line = _error_line(src, data, tmp_path)
    assert "no tensor for parameter 'model.layers.1.mlp.up_proj.weight'" in line


def test_a_tensor_of_the_wrong_shape_is_a_one_line_error(data, tmp_path):
    src = _edited(tmp_path, lambda t: t.update({"model.norm.weight": torch.ones(31)}))
    line = _error_line(src, data, tmp_path)
    assert "'model.norm.weight' has shape (31,)" in line


def test_loading_fused_experts_holds_one_target_at_a_time(tmp_path, monkeypatch):
    """Between two tensors handed to the engine, the loader reads at most the sources of one
    target (e.g. 2 x 4 expert matrices for one gate_up_proj), never a whole shard or file."""
    import tierwise.cli.layout as layout_mod

    src = make_tiny_family_dir(tmp_path / "src", "mixtral", max_shard_size="24KB")
    reads = []
    real = layout_mod.read_tensor
    monkeypatch.setattr(layout_mod, "read_tensor", lambda *a: reads.append(a[1]) or real(*a))
    model = build_meta_model(_from_pretrained(src).config)
    most = 0
    for _ in iter_checkpoint(model, ModelLayout.of(model), src):
        most = max(most, len(reads))
        reads.clear()
    assert most == 2 * 4  # w1 and w3 of the 4 experts of one layer make one gate_up_proj


def test_fused_qkv_on_disk_splits_into_the_engine_and_back(tmp_path):
    """A layout whose converter splits one tensor into several (Sarvam-MoE: `query_key_value`
    -> q/k/v sized by the model's parameters, `word_embeddings`, per-expert tensors), loaded
    into an Engine (whose parameters are placeholders by then) and exported back unchanged."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tierwise.cli.layout import iter_export
    from tierwise.offload import Budget, Engine

    cfg = AutoConfig.for_model("sarvam_moe", vocab_size=288, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=8, moe_intermediate_size=16, n_routed_experts=4,
                               num_experts_per_tok=2, first_k_dense_replace=1)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "src")
    disk = _weights(tmp_path / "src")
    assert "model.layers.0.attention.query_key_value.weight" in disk
    ref = _from_pretrained(tmp_path / "src")
    model = build_meta_model(ref.config)
    layout = ModelLayout.of(model)
    engine = Engine(model, budget=Budget(chunk=16 << 10))
    try:
        engine.load_weights(iter_checkpoint(model, layout, tmp_path / "src"))
        mine = dict(engine.named_parameters_fp32())
        assert all(torch.equal(mine[n], p) for n, p in ref.named_parameters())
        exported = dict(iter_export(model, layout, mine.items()))
    finally:
        engine.close()
    assert sorted(exported) == sorted(disk)
    assert all(torch.equal(exported[k], disk[k]) for k in disk)


def test_two_keys_for_one_parameter_is_a_one_line_error(data, tmp_path):
    """`embed_tokens.weight` (a base-model checkpoint's name) also maps to
    model.embed_tokens.weight, as in transformers: two sources for one parameter."""
    src = _edited(tmp_path, lambda t: t.update(
        {"embed_tokens.weight": t["model.embed_tokens.weight"].clone()}))
    line = _error_line(src, data, tmp_path)
    assert "'embed_tokens.weight' and 'model.embed_tokens.weight' both map to " \
           "model.embed_tokens.weight" in line or \
           "'model.embed_tokens.weight' and 'embed_tokens.weight' both map to " \
           "model.embed_tokens.weight" in line, line


@pytest.mark.parametrize("original", [True, False], ids=["legacy", "fused"])
def test_resumed_run_exports_the_layout_it_was_loaded_from(original, data, tmp_path):
    """--resume reads the weights from its own checkpoint, not the source: the source's names
    are still read, so the export keeps the source's layout (e.g. fused) as a full run does."""
    src = make_tiny_family_dir(tmp_path / "src", "mixtral", save_original_format=original)
    out = tmp_path / "run"
    args = ["--model", str(src), "--data", str(data[0]), "--seq-len", "16", "--batch-size", "2",
            "--output", str(out)]
    for extra in (["--steps", "1"], ["--steps", "2", "--resume"]):
        result = CliRunner().invoke(app, args + extra)
        assert result.exit_code == 0, (result.output, result.exception)
    assert sorted(_weights(out / "model")) == sorted(_weights(src))


def test_bf16_saved_gemma2_trains_in_fp32_like_from_pretrained(data, tmp_path, monkeypatch):
    """A bf16 checkpoint trained in fp32 equals from_pretrained(dtype=float32) trained in plain
    PyTorch. Gemma-2 makes a buffer in __init__ (embed_scale = sqrt(hidden)): built from the
    bf16 config it was bf16 (5.65625 for sqrt(32)), so every gradient into the embedding was off."""
    from transformers import AutoTokenizer

    fp32 = make_tiny_family_dir(tmp_path / "fp32", "gemma2")
    src = tmp_path / "bf16"
    _from_pretrained(fp32).to(torch.bfloat16).save_pretrained(src)
    AutoTokenizer.from_pretrained(fp32).save_pretrained(src)
    assert json.loads((src / "config.json").read_text())["dtype"] == "bfloat16"
    out = tmp_path / "run"
    _finetune(src, data, out, monkeypatch)
    losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]
    ref_losses, ref, _ = _replay(src, data)
    assert losses == ref_losses
    mine, theirs = _weights(out / "model"), ref.state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine), \
        [k for k in mine if not torch.equal(mine[k], theirs[k])]
