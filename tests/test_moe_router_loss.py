"""A MoE model whose own loss adds its router's load-balancing loss: the engine's block recompute
would give that loss no gradient (the first forward runs without a graph), so recompute is
refused for it; without recompute the engine equals plain PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM

from tierwise.offload import Activations, Engine, flat_options
from tierwise.offload.core.errors import UnsupportedModel
from tests.models import batches


def tiny_mixtral(aux: float) -> MixtralForCausalLM:
    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        output_router_logits=True, router_aux_loss_coef=aux))


def test_recompute_is_refused_and_without_it_the_router_loss_trains_as_plain_pytorch():
    with pytest.raises(UnsupportedModel, match="adds its router's load-balancing loss .*--no-recompute"):
        Engine(tiny_mixtral(0.5), **flat_options(lr=1e-3))
    Engine(tiny_mixtral(0.0), **flat_options(lr=1e-3)).close()  # no such loss: recomputed as any model
    data = batches(3, batch=2, seq=12)
    model = tiny_mixtral(0.5)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0, fused=True)
    eng = Engine(model, activations=Activations(recompute=False), **flat_options(lr=1e-3))
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
