"""A MoE model whose own loss adds its router's auxiliary loss, and any loss on what the model's
output hooks record inside a block (transformers 5 collects router logits, attentions and
hidden states that way): a recomputed block's first forward runs without a graph, so the
engine makes those records outputs of the block's recompute. Every case equals plain PyTorch
bit for bit, under recompute, streamed and with gradient accumulation."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, \
    Qwen2MoeForCausalLM

from tierwise.offload import Activations, Engine, flat_options
from tests.models import batches, train_reference


def tiny_mixtral(aux: float, *, logits: bool = True, layers: int = 2, vocab: int = 128) -> MixtralForCausalLM:
    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        output_router_logits=logits, router_aux_loss_coef=aux))


def tiny_qwen2_moe() -> Qwen2MoeForCausalLM:
    torch.manual_seed(0)
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
        shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=64, output_router_logits=True,
        router_aux_loss_coef=0.5))


def _plain(model: torch.nn.Module, data: list, loss_fn) -> tuple[list[float], torch.nn.Module]:
    """Plain PyTorch (fused AdamW) on `data` with `loss_fn(model, batch)`: (losses, model)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, fused=True)
    losses = []
    for b in data:
        loss = loss_fn(model, b)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


def _equal(eng: Engine, ref: torch.nn.Module) -> None:
    mine = dict(eng.named_parameters_fp32())
    for n, p in ref.named_parameters():
        assert torch.equal(mine[n], p.detach()), n


@pytest.mark.parametrize("setting", ["recompute", "engine-choice", "streamed", "accum2"])
def test_the_router_loss_trains_as_plain_pytorch_under_recompute(setting):
    data = batches(3, batch=4, seq=12)
    accum = 2 if setting == "accum2" else 1
    layers = 4 if setting == "streamed" else 2
    ref_losses, ref = train_reference(tiny_mixtral(0.5, layers=layers), data, grad_accum=accum)
    kw = {} if setting == "engine-choice" else dict(activations=Activations(recompute=True))
    if setting == "streamed":
        kw |= dict(gpu_mem=1200 << 10, chunk_bytes=16 << 10)
    eng = Engine(tiny_mixtral(0.5, layers=layers), **flat_options(lr=1e-3, **kw))
    assert eng.recomputed == layers
    if setting == "streamed":
        assert eng.measure(data[0]) > 0 and eng.residency.cache.limit > 0
    assert [eng.step(b, grad_accum=accum) for b in data] == ref_losses
    if setting == "streamed":
        assert eng.homes.bytes["host"]  # (some chunks streamed)
    _equal(eng, ref)
    eng.close()


@pytest.mark.parametrize("logits,aux", [(True, 0.5), (True, 0.0), (False, 0.5)])
def test_the_plan_prices_the_loss_the_engine_runs(logits, aux):
    """A router-logits model runs the model's own loss (the tiled one does not take the router's),
    whatever the router loss's weight: the planner's profile says the same."""
    from tierwise.offload.engine import headloss
    from tierwise.profiles import ModelProfile

    config = tiny_mixtral(aux, logits=logits).config
    assert ModelProfile.from_hf_config(config).router_loss == isinstance(headloss.transform_of(config), str)


def test_qwen2_moe_and_a_batch_asking_for_the_router_logits():
    data = batches(3, batch=2, seq=12)
    ref_losses, ref = train_reference(tiny_qwen2_moe(), data)
    eng = Engine(tiny_qwen2_moe(), **flat_options(lr=1e-3, activations=Activations(recompute=True)))
    assert [eng.step(b) for b in data] == ref_losses
    _equal(eng, ref)
    eng.close()
    # a config without it, a batch that asks for it
    asked = [{**b, "output_router_logits": True} for b in data]
    ref_losses, ref = _plain(tiny_mixtral(0.5, logits=False), asked, lambda m, b: m(**b).loss)
    assert ref_losses != train_reference(tiny_mixtral(0.5, logits=False), data)[0]  # (it asked: another loss)
    eng = Engine(tiny_mixtral(0.5, logits=False), **flat_options(lr=1e-3, activations=Activations(recompute=True)))
    assert [eng.step(b) for b in asked] == ref_losses
    _equal(eng, ref)
    eng.close()


def test_a_loss_on_attentions_recorded_inside_a_recomputed_block():
    """Not only routers: a loss on the attention weights (recorded by the attention module's
    hook, inside the block) gets its gradient through the recompute. (Hidden states are recorded
    by the blocks' own hooks, outside the recompute: a loss on them has its gradient either way,
    equal to plain PyTorch to rounding, as the gradients reaching a block's input are summed in
    another order.)"""
    def model():
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                                            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=64, attn_implementation="eager"))

    def loss_fn(m, b):
        out = m(**b, output_attentions=True)
        return out.loss + out.attentions[1].square().mean()

    data = batches(3, batch=2, seq=12)
    ref_losses, ref = _plain(model(), data, loss_fn)
    eng = Engine(model(), **flat_options(lr=1e-3, loss_fn=loss_fn, activations=Activations(recompute=True)))
    assert eng.recomputed == 3
    assert [eng.step(b) for b in data] == ref_losses
    _equal(eng, ref)
    eng.close()


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
    assert ours.engine.recomputed == 2

    def losses(t):
        return [r["loss"] for r in t.state.log_history if "loss" in r]
    assert losses(ours) == pytest.approx(losses(plain), rel=1e-5)



def test_the_recorded_outputs_are_freed_after_each_step():
    """The records a recompute makes outputs of its Function die with the step (a context that
    kept the collector kept them, and each block's RNG state, in a cycle autograd never frees)."""
    import gc
    import weakref

    refs = []

    def loss_fn(m, b):
        out = m(**b)
        refs.extend(weakref.ref(t) for t in out.router_logits)
        return out.loss

    eng = Engine(tiny_mixtral(0.5), **flat_options(lr=1e-3, loss_fn=loss_fn, activations=Activations(recompute=True)))
    gc.disable()
    try:
        for b in batches(3, batch=2, seq=12):
            eng.step(b)
        assert len(refs) == 6 and all(r() is None for r in refs)
    finally:
        gc.enable()
        eng.close()


def test_sft_trainer_with_the_router_loss_trains_as_sft_trainer(tmp_path):
    """TRL's SFTTrainer adds a Mixtral's router loss itself (router_aux_loss_coef, on by default
    for it); without gradient accumulation that is the model's own loss, which the engine trains."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from tierwise.cli.builtin import build_tokenizer
    from tierwise.offload.core.errors import TierwiseError
    from tierwise.offload.hf import with_offload

    tok = build_tokenizer()
    rows = batches(8, batch=1, seq=12, vocab=len(tok))
    data = datasets.Dataset.from_dict({"input_ids": [b["input_ids"][0].tolist() for b in rows]})

    def run(cls, out, accum=1, **kw):
        cfg = trl.SFTConfig(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=accum,
                            max_steps=3, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
                            use_cpu=True, weight_decay=0.0, disable_tqdm=True, bf16=False, seed=0,
                            router_aux_loss_coef=0.5)
        trainer = cls(model=tiny_mixtral(0.5, vocab=len(tok)), args=cfg, train_dataset=data, processing_class=tok, **kw)
        assert trainer.aux_loss_enabled
        trainer.train()
        return {k: [r[k] for r in trainer.state.log_history if k in r]
                for k in ("loss", "aux_loss", "entropy", "mean_token_accuracy", "num_tokens")}

    ours, plain = run(with_offload(trl.SFTTrainer), tmp_path / "o"), run(trl.SFTTrainer, tmp_path / "p")
    assert len(plain["aux_loss"]) == 3
    for key in plain:  # (the metrics TRL logs too: the router's loss among them)
        assert ours[key] == pytest.approx(plain[key], rel=1e-5), key
    with pytest.raises(TierwiseError, match="gradient_accumulation_steps=1"):
        run(with_offload(trl.SFTTrainer), tmp_path / "a", accum=2)
