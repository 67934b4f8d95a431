"""Recomputing the first n decoder blocks and keeping the others' activations.

The engine against plain PyTorch (same losses and weights), its measured activation peak
against the planner's formula byte for byte, and the CLI's automatic choice: no recompute
where the budget holds every layer's activations, else the fewest first layers that fit or
all of them, whichever the plan finds faster.
"""

import re

import pytest
import torch
from typer.testing import CliRunner

from tierwise.cli.config import TrainConfig
from tierwise.cli.main import app
from tierwise.cli.planning import make_plan as plan_of, resolve_recompute
from tierwise.offload import Activations, Budget, Engine, InfeasibleBudget, Optim, Precision, flat_options
from tierwise.offload.core.errors import TierwiseError
from tierwise.offload.engine import tiled as tiled_mod
from tierwise.offload.plan import perfmodel
from tierwise.offload.plan.planner import make_plan
from tierwise.profiles import ModelProfile
from tests.models import batches, tiny_llama, train_reference
from tests.tinyhf import error_line

CHUNK = 16 << 10


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("gpu", [None, "1200K"], ids=["roomy", "streamed"])
def test_the_first_blocks_recomputed_train_as_plain_pytorch(n, gpu):
    data = batches(4)
    ref_losses, ref = train_reference(tiny_llama(), data)
    eng = Engine(tiny_llama(), **flat_options(lr=1e-3, gpu_mem=gpu, chunk_bytes=CHUNK, checkpointing=n))
    try:
        losses = [eng.step(b) for b in data]
        assert eng.recomputed == n
        assert losses == ref_losses
        mine = dict(eng.named_parameters_fp32())
        for name, p in ref.named_parameters():
            assert torch.equal(mine[name], p.detach()), name
    finally:
        eng.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_each_share_saves_what_the_plan_books(precision):
    """0 to 4 of 4 layers recomputed: the ledger's activation peak is perfmodel's figure to the
    byte, and so is the plan's gpu activation reserve; every layer recomputed more saves less."""
    profile = ModelProfile.from_hf_config(tiny_llama().config)
    measured = []
    for n in range(5):
        eng = Engine(tiny_llama(), budget=Budget(chunk=CHUNK), precision=Precision(precision),
                     activations=Activations(recompute=n))
        try:
            eng.step(batches(1, batch=2, seq=24)[0])
            measured.append(eng.ledger.kind_peak("gpu", "activation"))
        finally:
            eng.close()
        planned = perfmodel.activation_bytes(model=profile, batch_size=2, seq_len=24, precision=precision,
                                             checkpointing=n)
        assert measured[-1] == planned, n
        plan = make_plan(model=profile, hardware="cpu-sim", gpu_mem="1G", cpu_mem="1G", optimizer="adamw",
                         precision=precision, batch_size=2, seq_len=24, chunk_bytes=CHUNK, checkpointing=n)
        assert plan.reserve["gpu"]["activations"] == measured[-1] and plan.checkpointing == n
    assert measured == sorted(measured, reverse=True) and len(set(measured)) == 5


def test_only_the_recomputed_blocks_mlps_run_in_tiles(monkeypatch):
    """2 of 3 layers recomputed, 64 tokens in tiles of 16: the two recomputed MLPs run in 4 tiles
    each (forward and recompute), the kept one whole; the losses and weights are plain PyTorch's
    (SGD, fp32: the tiles' sums agree to rounding)."""
    model = tiny_llama(layers=3)
    data = batches(2, batch=2, seq=64)
    ref_losses, ref = train_reference(model, data, lr=1e-2, optimizer="sgd")
    width = model.model.layers[0].mlp.up_proj.out_features
    monkeypatch.setattr(perfmodel, "MLP_TILE_BYTES", 3 * width * 4 * 2 * 16)
    calls = []
    real = tiled_mod._TiledMLP.apply
    monkeypatch.setattr(tiled_mod._TiledMLP, "apply", lambda *a: calls.append(len(a[1][0])) or real(*a))
    eng = Engine(model, budget=Budget(gpu="2M", chunk=CHUNK), optim=Optim("sgd", lr=1e-2),
                 activations=Activations(recompute=2))
    try:
        losses = [eng.step(b) for b in data]
        weights = dict(eng.named_parameters_fp32())
    finally:
        eng.close()
    assert calls and set(calls) == {4} and len(calls) == 2 * (len(data) - 1)  # (the warm-up streams: untiled)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for name, p in ref.named_parameters():
        assert torch.allclose(weights[name], p.detach(), rtol=1e-4, atol=1e-6), name


def test_a_share_past_the_model_or_below_zero_is_refused():
    with pytest.raises(ValueError, match="recompute 5 blocks, but the model has 4 to recompute"):
        Engine(tiny_llama(), **flat_options(checkpointing=5, chunk_bytes=CHUNK))
    with pytest.raises(ValueError, match="number of blocks >= 0"):
        Activations(recompute=-1)


BASE = dict(batch_size=4, seq_len=128)  # (no model: the built-in one)


def test_auto_recomputes_the_fewest_first_layers_that_fit():
    """The built-in 2-layer model: 9M holds every layer's activations (no recompute), 7M holds
    one layer's beside the other's recompute (the first recomputed: faster than both), 5M only
    the recompute of both."""
    picks = {g: resolve_recompute(TrainConfig(**BASE, gpu_mem=g)) for g in ("9M", "7M", "5M")}
    assert (picks["9M"].recompute, picks["9M"].recompute_layers) == (False, None)
    assert (picks["7M"].recompute, picks["7M"].recompute_layers) == (True, 1)
    assert (picks["5M"].recompute, picks["5M"].recompute_layers) == (True, None)
    with pytest.raises(InfeasibleBudget, match="too small"):  # 7M without the share
        plan_of(TrainConfig(**BASE, gpu_mem="7M", recompute=False))


def test_a_full_fine_tunes_default_fp32_on_a_gpu_says_what_bf16_plans():
    runner = CliRunner()
    args = ["plan", "--model", "llama-1b", "--hardware", "h100", "--gpu-mem", "80G", "--cpu-mem", "16G",
            "--seq-len", "1024"]
    note = [ln for ln in runner.invoke(app, args).output.splitlines() if ln.startswith("precision:")]
    assert len(note) == 1 and "unless --precision bf16" in note[0], note
    bf16, fp32 = (float(n.replace(",", "")) for n in re.search(r"bf16 plans ([\d,]+) tokens/s against ([\d,]+)",
                                                                 note[0]).groups())
    assert bf16 > fp32 > 0  # (the card's bf16 rate)
    assert "precision:" not in runner.invoke(app, [*args, "--precision", "fp32"]).output
    # --dry-run says it too (of this machine's budgets), and a run says the default it took
    dry = ["--model", "100m", "--hardware", "h100", "--gpu-mem", "2G", "--cpu-mem", "4G", "--seq-len", "64", "--dry-run"]
    said = runner.invoke(app, dry)
    assert said.exit_code == 0, said.output
    assert [ln for ln in said.output.splitlines() if ln.startswith("precision:") and "bf16 plans" in ln], said.output
    assert "precision:" not in runner.invoke(app, [*dry, "--precision", "fp32"]).output


def test_a_lora_run_says_the_precision_it_took(tmp_path):
    result = CliRunner().invoke(app, ["--lora-rank", "4", "--steps", "1", "--output", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    assert "precision: LoRA computes in fp32 on the simulated device" in result.output


def test_the_flag_plans_trains_and_refuses(tmp_path):
    runner = CliRunner()
    plan = runner.invoke(app, ["plan", "--gpu-mem", "7M", "--recompute-layers", "1"])
    assert plan.exit_code == 0, plan.output
    assert "recompute the first 1 of 2 layers" in plan.output
    auto = runner.invoke(app, ["plan", "--gpu-mem", "7M"])
    assert auto.exit_code == 0 and "recompute: the first 1 of 2 layers, the fastest plan that fits" in auto.output
    run = runner.invoke(app, ["--gpu-mem", "7M", "--steps", "2", "--output", str(tmp_path / "run")])
    assert run.exit_code == 0, run.output
    assert "the first 1 of 2 decoder layers recomputed" in run.output
    for args, words in ((["--recompute-layers", "3"], "--recompute-layers 3: the model has 2 decoder layers"),
                        (["--recompute-layers", "1", "--no-recompute"], "drop --no-recompute"),
                        (["--recompute-layers", "-1"], "at least 0")):
        bad = runner.invoke(app, ["plan", "--gpu-mem", "8M", *args])
        assert bad.exit_code == 2 and words in error_line(bad), (args, bad.output)


def test_a_single_layer_is_never_recomputed_and_the_plan_agrees():
    """One decoder layer is no repeated block: the engine recomputes nothing even when asked for
    all, and the planner books the same bytes; asking for that layer by count is refused."""
    model = tiny_llama(layers=1)
    profile = ModelProfile.from_hf_config(model.config)
    eng = Engine(model, budget=Budget(chunk=CHUNK), activations=Activations(recompute=True))
    try:
        eng.step(batches(1, batch=2, seq=24)[0])
        assert eng.recomputed == 0
        assert eng.ledger.kind_peak("gpu", "activation") == perfmodel.activation_bytes(
            model=profile, batch_size=2, seq_len=24, precision="fp32", checkpointing=True)
    finally:
        eng.close()
    with pytest.raises(TierwiseError, match="a single layer is never recomputed"):
        make_plan(model=profile, hardware="cpu-sim", gpu_mem="1G", cpu_mem="1G", optimizer="adamw",
                  precision="fp32", batch_size=2, seq_len=24, chunk_bytes=CHUNK, checkpointing=1)


def test_recompute_none_by_count_and_the_advice_for_a_share():
    """--recompute with --recompute-layers 0 contradicts itself (one-line error); a share that
    does not fit is advised, among what fits, to recompute all (which 5M holds)."""
    runner = CliRunner()
    bad = runner.invoke(app, ["plan", "--recompute", "--recompute-layers", "0"])
    assert bad.exit_code == 2 and "drop --recompute" in error_line(bad)
    tight = runner.invoke(app, ["plan", "--gpu-mem", "5M", "--recompute-layers", "1"], env={"COLUMNS": "200"})
    assert tight.exit_code == 2, tight.output
    assert any(line.startswith("  --recompute ") for line in tight.output.splitlines()), tight.output
