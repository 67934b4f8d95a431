"""A MoE model whose own loss adds its router's auxiliary loss: the engine's block recompute
would give that loss no gradient (the first forward runs without a graph). The engine's own
choice keeps every block's activations for it, an explicit recompute is refused, and the run
equals plain PyTorch."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM

from tierwise.offload import Activations, Engine, flat_options
from tierwise.offload.core.errors import UnsupportedModel
from tierwise.offload.plan.perfmodel import adds_router_loss
from tests.models import batches


def tiny_mixtral(aux: float, *, logits: bool = True) -> MixtralForCausalLM:
    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        output_router_logits=logits, router_aux_loss_coef=aux))


def test_the_router_loss_trains_as_plain_pytorch_and_recompute_is_refused():
    with pytest.raises(UnsupportedModel, match="adds its router's auxiliary loss .*--no-recompute"):
        Engine(tiny_mixtral(0.5), activations=Activations(recompute=True), **flat_options(lr=1e-3))
    Engine(tiny_mixtral(0.0), activations=Activations(recompute=True), **flat_options(lr=1e-3)).close()
    data = batches(3, batch=2, seq=12)
    model = tiny_mixtral(0.5)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0, fused=True)
    eng = Engine(model, **flat_options(lr=1e-3))  # the engine's choice: no block recomputed
    assert eng.recomputed == 0
    for b in data:
        loss = ref(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert eng.step(b) == loss.item()
    mine = dict(eng.named_parameters_fp32())
    for n, p in ref.named_parameters():
        assert torch.equal(mine[n], p.detach()), n
    eng.close()


def test_a_batch_asking_for_the_router_loss_is_refused_under_recompute():
    eng = Engine(tiny_mixtral(0.5, logits=False), **flat_options(lr=1e-3))
    assert eng.recomputed
    b = batches(1, batch=2, seq=12)[0]
    with pytest.raises(UnsupportedModel, match="adds its router's auxiliary loss"):
        eng.step({**b, "output_router_logits": True})
    eng.close()


@pytest.mark.parametrize("config, adds", [
    (SimpleNamespace(output_router_logits=True, router_aux_loss_coef=0.02), True),
    (SimpleNamespace(output_router_logits=False, router_aux_loss_coef=0.02), False),
    (SimpleNamespace(output_router_logits=True, router_aux_loss_coef=0.0), False),
    (SimpleNamespace(output_router_logits=True), True),  # no weight named: assumed added
    (SimpleNamespace(output_router_logits=True, aux_loss_coef=0.0), False),  # JetMoE
    (SimpleNamespace(output_router_logits=True, ffn_config=SimpleNamespace(moe_loss_weight=0.0)), False),  # DBRX
    (SimpleNamespace(text_config=SimpleNamespace(output_router_logits=True, router_aux_loss_coef=0.5)), True),
], ids=["mixtral", "off", "zero", "unnamed", "jetmoe-zero", "dbrx-zero", "vision-language"])
def test_which_configs_add_the_router_loss(config, adds):
    assert adds_router_loss(config) is adds


def test_an_activations_group_passes_flat_options_by_its_name():
    # (was: a TypeError, "activations" is also the flat name of Activations.expected)
    opts = flat_options(activations=Activations(recompute=False), offload_activations=False, lr=1e-3)
    assert opts["activations"] == Activations(recompute=False)


def test_offload_trainer_trains_the_router_loss_as_the_trainer(tmp_path):
    from transformers import Trainer, TrainingArguments

    from tierwise.offload.hf import OffloadTrainer

    data = [{"input_ids": b["input_ids"][0], "labels": b["labels"][0]} for b in batches(8, batch=1, seq=12)]

    def args(out):
        return TrainingArguments(output_dir=str(out), per_device_train_batch_size=2, max_steps=3,
                                 learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
                                 use_cpu=True, weight_decay=0.0, disable_tqdm=True, seed=0)

    plain = Trainer(model=tiny_mixtral(0.5), args=args(tmp_path / "p"), train_dataset=data)
    plain.train()
    ours = OffloadTrainer(model=tiny_mixtral(0.5), args=args(tmp_path / "o"), train_dataset=data)
    ours.train()
    assert ours.engine.recomputed == 0

    def losses(t):
        return [r["loss"] for r in t.state.log_history if "loss" in r]
    assert losses(ours) == pytest.approx(losses(plain), rel=1e-5)

