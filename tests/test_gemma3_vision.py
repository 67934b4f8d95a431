"""Gemma-3 4B and up (Gemma3ForConditionalGeneration: the text model beside a SigLIP vision
tower that training on text never runs), where a text-only model's assumptions would break:
the config's text fields live in text_config, the tower is never fetched, gets no gradient and
cannot be the only thing LoRA adapts. (Its training against plain PyTorch and PEFT, packing and
the tiled loss are in the families' tests, as tests/tinyhf.FAMILIES' "gemma3-vl".)"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
from tinyhf import error_line, family_config, make_tiny_family_dir, write_jsonl  # noqa: E402

from tierwise.cli import train as cli_train  # noqa: E402
from tierwise.cli.builtin import sample_rows  # noqa: E402
from tierwise.cli.config import ConfigError, TrainConfig  # noqa: E402
from tierwise.cli.data import DataError, check_vocab  # noqa: E402
from tierwise.cli.launch import RankInfo  # noqa: E402
from tierwise.cli.loading import resolve_model  # noqa: E402
from tierwise.cli.main import app  # noqa: E402
from tierwise.cli.planning import _rotary, max_positions  # noqa: E402
from tierwise.offload.core.errors import UnsupportedModel  # noqa: E402
from tierwise.offload.tools.verify import verify  # noqa: E402
from tierwise.profiles.model import ModelProfile  # noqa: E402
from tierwise.profiles.schema import FieldValueError  # noqa: E402
from tests.test_plan_families import GEMMA3_VL  # noqa: E402

#: A tower big enough that its chunks matter beside the text model's (64 wide, 64 patches).
TOWER = dataclasses.replace(GEMMA3_VL, vision_hidden_size=64, vision_intermediate_size=128, image_size=112)


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    root = tmp_path_factory.mktemp("g3vl")
    return make_tiny_family_dir(root / "model", "gemma3-vl"), write_jsonl(root / "train.jsonl", sample_rows(8))


def test_the_text_configs_fields_are_read(vl):
    """The vocabulary and positions are text_config's: a token past the vocabulary is refused
    (it passed unchecked), and the positions are rotary and as many as the text model's."""
    src = resolve_model(str(vl[0]))
    text = src.config.get_text_config()
    assert max_positions(src.config) == text.max_position_embeddings and _rotary(src.config)
    ids = torch.tensor([1, 2, text.vocab_size])
    with pytest.raises(DataError, match="vocab_size is 288"):
        check_vocab([(ids, ids)], src)
    check_vocab([(ids[:2], ids[:2])], src)


@pytest.mark.parametrize("precision, gpu", [("fp32", "1M"), ("bf16", "600K"), ("bf16", "2M")])
def test_the_towers_chunks_are_planned_as_never_fetched(precision, gpu):
    """The engine never fetches the tower's chunks: the plan's cache at the device's peak holds
    none of them (it counted every streamed chunk: +10% on the device), and the tower's position
    ids are a device buffer (the engine's minimum budget was 32 KiB above the planner's at 4B)."""
    report = verify(model=TOWER, gpu_mem=gpu, cpu_mem="64M", optimizer="adamw", precision=precision, batch_size=2,
                    seq_len=32, chunk_bytes="16K", steps=3)
    assert report.passed, report.render()
    assert report.plan.peak["host"] == report.measured["host"]
    minimum = report.plan.gpu_minimum
    at_least = verify(model=TOWER, gpu_mem=minimum, cpu_mem="64M", optimizer="adamw", precision=precision,
                      batch_size=2, seq_len=32, chunk_bytes="16K", steps=2)  # (the engine takes the plan's minimum)
    assert at_least.measured["gpu"] <= minimum


def test_a_tower_as_deep_as_the_text_model_is_refused():
    """The engine's blocks are the longest list of layers (the first on a tie): a tower as deep
    as the decoder would be taken for it, so the planner refuses that config."""
    with pytest.raises(FieldValueError, match="vision_layers"):
        dataclasses.replace(GEMMA3_VL, vision_layers=2)
    config = family_config("gemma3-vl")
    config.vision_config.num_hidden_layers = 2
    with pytest.raises(FieldValueError, match="vision_layers"):
        ModelProfile.from_hf_config(config)


def test_lora_only_on_the_tower_is_refused(vl, tmp_path):
    """--lora-targets fc1 adapts only the tower's MLPs: nothing would train (the run died in
    backward with autograd's own error); the plan refuses it, and so does the engine."""
    import peft
    from transformers import AutoModelForCausalLM

    from tierwise.offload import Activations, Budget, Engine, Optim

    line = error_line(CliRunner().invoke(app, ["--model", str(vl[0]), "--data", str(vl[1]), "--lora-rank", "4",
                                               "--lora-targets", "fc1", "--output", str(tmp_path / "run")]))
    assert "in the vision tower" in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    model = AutoModelForCausalLM.from_config(family_config("gemma3-vl"))
    eng = Engine(model, budget=Budget(chunk=16 << 10), optim=Optim("adamw"), activations=Activations(recompute=False),
                 lora=peft.LoraConfig(r=4, target_modules=["fc1"]))  # (kept: no block's input asks a gradient)
    x = torch.randint(0, 280, (2, 16))
    with pytest.raises(UnsupportedModel, match="depends on no trainable parameter"):
        eng.step({"input_ids": x, "labels": x})
    eng.close()


def test_mezo_takes_the_text_models_vocabulary():
    from transformers import AutoModelForCausalLM

    from tierwise.offload import Budget, Engine, flat_options

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config("gemma3-vl"))
    eng = Engine(model, budget=Budget(chunk=16 << 10), **flat_options(optimizer="mezo", lr=1e-3))
    x = torch.randint(0, 280, (2, 16))
    assert torch.isfinite(torch.as_tensor(eng.step({"input_ids": x, "labels": x})))
    eng.close()


def test_weight_decay_on_several_ranks_and_mezo_are_refused(vl, tmp_path):
    """Several ranks update a parameter without a gradient as with a zero one (torch skips it):
    weight decay would shrink the tower; MeZO moves every trainable parameter along its random
    direction (it moved the tower by up to 111% of its norm in 200 steps). Refused before
    anything is written, by --dry-run too."""
    cfg = TrainConfig(model=str(vl[0]), data=str(vl[1]), output=str(tmp_path / "run"), weight_decay=0.1)
    with pytest.raises(ConfigError, match="would shrink .* vision tower"):
        cli_train._checked_inputs(cfg, console=None, ranks=RankInfo(world=2, local_world=2))
    cli_train._checked_inputs(dataclasses.replace(cfg, weight_decay=0.0), console=None,
                              ranks=RankInfo(world=2, local_world=2))
    line = error_line(CliRunner().invoke(app, ["--model", str(vl[0]), "--data", str(vl[1]), "--optimizer", "mezo",
                                               "--output", str(tmp_path / "mezo")]))
    assert "would move its vision tower" in line and not (tmp_path / "mezo" / "metrics.jsonl").exists()
    for flags in (["--optimizer", "mezo"], ["--nproc-per-node", "2", "--weight-decay", "0.1"]):
        assert "vision tower" in error_line(CliRunner().invoke(app, ["--model", str(vl[0]), "--data", str(vl[1]),
                                                                     *flags, "--dry-run"]))


@pytest.mark.parametrize("targets", ["fc1", "patch_embedding", "position_embedding"])
def test_lora_targets_only_in_the_tower_are_refused_by_name(vl, tmp_path, targets):
    """Not only the tower's linears: its convolution and position embedding (PEFT adapts them)
    trained nothing and the run passed."""
    line = error_line(CliRunner().invoke(app, ["--model", str(vl[0]), "--data", str(vl[1]), "--lora-rank", "4",
                                               "--lora-targets", targets, "--output", str(tmp_path / "run")]))
    assert "every one is in the vision tower" in line
