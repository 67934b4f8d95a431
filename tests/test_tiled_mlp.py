"""The MLP of a recomputed block in sequence tiles (offload.engine.tiled): the same outputs and
gradients as untiled, and the same training as plain PyTorch, for a full fine-tune and LoRA."""

import copy

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaMLP

from tierwise.offload import Activations, Budget, Engine, Optim
from tierwise.offload.engine import tiled as tiled_mod
from tierwise.offload.plan import perfmodel

from tests.models import batches, tiny_llama, train_reference


def _mlp(hidden=32, width=96, seed=0):
    torch.manual_seed(seed)
    cfg = tiny_llama(layers=1, hidden=hidden).config
    cfg.intermediate_size = width
    return LlamaMLP(cfg)


@pytest.mark.parametrize("rows, tokens", [(1, 37), (3, 64)])
def test_tiles_give_the_untiled_outputs_and_gradients(rows, tokens):
    mlp = _mlp()
    ref = copy.deepcopy(mlp)
    x = torch.randn(rows, tokens, 32)
    size = perfmodel.mlp_tile_tokens(96, 4, rows, tile_bytes=3 * 96 * 4 * rows * 10)  # 10 tokens a tile
    assert size == 10
    run = tiled_mod.tiled(mlp.forward, mlp, width=96, tile_bytes=3 * 96 * 4 * rows * 10)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, want = run(xa), ref(xb)
    assert torch.allclose(out, want, rtol=1e-6, atol=1e-7)
    g = torch.randn_like(out)
    out.backward(g)
    want.backward(g)
    assert torch.allclose(xa.grad, xb.grad, rtol=1e-5, atol=1e-7)
    for (n, p), q in zip(mlp.named_parameters(), ref.parameters()):  # the same sums in tiles: to rounding
        assert ((p.grad - q.grad).norm() / q.grad.norm()).item() < 1e-6, n
    with torch.no_grad():  # (a forward without gradients: tiles too, nothing saved)
        assert torch.allclose(run(x), ref(x), rtol=1e-6, atol=1e-7)


def test_one_tile_and_dropout_run_untiled():
    mlp = _mlp()
    calls = []
    run = tiled_mod.tiled(lambda x: calls.append(x.shape[1]) or mlp(x), mlp, width=96,
                          tile_bytes=3 * 96 * 4 * 64)
    run(torch.randn(1, 64, 32))  # 64 tokens fit one tile
    assert calls == [64]
    mlp.drop = torch.nn.Dropout(0.1)
    run(torch.randn(1, 200, 32))
    assert calls == [64, 200]


def _engine_run(model, data, monkeypatch, *, tile_bytes, lora=None):
    monkeypatch.setattr(perfmodel, "MLP_TILE_BYTES", tile_bytes)
    eng = Engine(model, budget=Budget(gpu="2M", chunk=16 << 10), optim=Optim("sgd", lr=1e-2), lora=lora,
                 activations=Activations(recompute=True))  # (every block: an SDPA family may keep some)
    try:
        return [eng.step(b) for b in data], dict(eng.named_parameters_fp32(trainable_only=True))
    finally:
        eng.close()


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3-vl"])
def test_an_engine_with_tiled_mlps_trains_as_plain_pytorch(monkeypatch, family):
    """Sequences of 64 tokens in tiles of 16 (4 per MLP, every block recomputed): the losses
    and weights of plain PyTorch (fp32, SGD: the weights' gradients are summed per tile, so they
    agree to rounding, which Adam's normalisation would magnify in the near-zero ones). Llama's
    recompute skips the MLP's output (only the residual add reads it); gemma2's, whose
    post-feedforward norm saves it, computes it."""
    if family == "llama":
        model = tiny_llama(layers=3, hidden=64, vocab=128)
    else:
        from transformers import AutoModelForCausalLM

        from tests.tinyhf import family_config

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(family_config(family, vocab_size=128))
    data = batches(3, batch=2, seq=64)
    ref_losses, ref = train_reference(model, data, lr=1e-2, optimizer="sgd")
    calls = []
    real = tiled_mod._TiledMLP.apply

    def counting(*a):
        calls.append(len(a[1][0]))
        assert a[1][2] == (family != "llama")  # whether the recompute computes the MLP's output
        return real(*a)

    monkeypatch.setattr(tiled_mod._TiledMLP, "apply", counting)
    width = model.get_decoder().layers[0].mlp.up_proj.out_features
    losses, weights = _engine_run(model, data, monkeypatch, tile_bytes=3 * width * 4 * 2 * 16)
    assert calls and set(calls) == {4}  # every recompute ran its MLP in 4 tiles
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for n, p in ref.named_parameters():
        assert torch.allclose(weights[n], p.detach(), rtol=1e-4, atol=1e-6), n


def test_lora_adapters_in_a_tiled_mlp_train_as_peft(monkeypatch):
    import peft

    model = tiny_llama(layers=2, hidden=64, vocab=128)
    data = batches(3, batch=2, seq=64)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj", "q_proj"])
    torch.manual_seed(3)
    ref_model = peft.get_peft_model(copy.deepcopy(model), cfg)
    torch.manual_seed(3)
    mine = peft.get_peft_model(copy.deepcopy(model), cfg)
    ref_losses, ref = train_reference(ref_model, data, lr=1e-2, optimizer="sgd")
    losses, weights = _engine_run(mine, data, monkeypatch, tile_bytes=3 * 128 * 4 * 2 * 16)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for n, p in ref.named_parameters():
        if p.requires_grad:
            assert torch.allclose(weights[n], p.detach(), rtol=1e-4, atol=1e-6), n


@pytest.mark.parametrize("precision, lora", [("fp32", False), ("bf16", False), ("fp32", True)])
def test_planned_activations_with_tiled_mlps_are_what_the_engine_measures(monkeypatch, precision, lora):
    """4,096 tokens through a wide MLP (intermediate 2048) in tiles of 4 MiB: the planner's
    activation bytes are within 10% of the engine's measured peak, which is a fraction of the
    untiled one."""
    import transformers
    from peft import LoraConfig

    from tierwise.offload import Activations, Precision
    from tierwise.profiles import ModelProfile

    seq = 4096
    profile = ModelProfile(name="wide", family="llama", hidden_size=64, intermediate_size=2048, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                           max_position_embeddings=seq, rope_theta=10000.0, rms_norm_eps=1e-5)
    targets = frozenset({"q_proj", "up_proj", "down_proj"})
    x = torch.randint(0, profile.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))

    def measure(tile_bytes):
        monkeypatch.setattr(perfmodel, "MLP_TILE_BYTES", tile_bytes)
        planned = perfmodel.activation_bytes(model=profile, batch_size=1, seq_len=seq, precision=precision,
                                             checkpointing=True, lora=(targets, 4) if lora else None)
        torch.manual_seed(0)  # (placed up front for the plan's activations, as finetune does: the blocks
        # are the units, and so the MLPs tile, from the first step)
        eng = Engine(transformers.LlamaForCausalLM(profile.to_hf_config()), budget=Budget(chunk=4 << 20),
                     precision=Precision(precision), activations=Activations(recompute=True, expected=planned),
                     lora=LoraConfig(r=4, lora_alpha=8, target_modules=sorted(targets)) if lora else None)
        try:
            assert eng.units_are_blocks
            eng.step({"input_ids": x, "labels": x})
            measured = eng.ledger.kind_peak("gpu", "activation")
        finally:
            eng.close()
        return measured, planned

    measured, planned = measure(4 << 20)
    assert measured == pytest.approx(planned, rel=0.10)
    untiled, planned_untiled = measure(1 << 40)
    assert untiled == pytest.approx(planned_untiled, rel=0.10)
    assert measured < 0.6 * untiled
