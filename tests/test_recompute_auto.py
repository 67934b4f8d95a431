"""Recompute left to the engine (Activations(recompute=None), the default; the Trainer's
gradient_checkpointing): the warm-up recomputes every block, then the last blocks keep their
activations where the whole model stays on the device beside them; where chunks stream, every
block stays recomputed. Against plain PyTorch (the same losses and weights), the measured
activation peak against the planner's formula for the share the engine chose, and the Trainer
against plain transformers.Trainer with gradient checkpointing."""

from __future__ import annotations

import pytest
import torch

from tierwise.offload import Activations, Engine, Precision, flat_options
from tierwise.offload.plan import perfmodel
from tierwise.profiles import ModelProfile
from tests.models import batches, tiny_llama, train_reference

CHUNK = 16 << 10


@pytest.mark.parametrize(("gpu", "recomputed"), [(None, 0), ("4M", 0), ("3600K", 2), ("3200K", 3), ("2M", 4)],
                         ids=["unbounded", "roomy", "half", "one-kept", "streamed"])
def test_the_engine_keeps_what_fits_beside_the_whole_model(gpu, recomputed):
    """4 layers, fp32, 4 x 16 tokens. Every chunk fits the device at 3.2M and up, with 1, 2 or all
    4 layers' activations kept beside it as the budget grows; at 2M chunks stream, and all 4 stay
    recomputed. The losses and weights are plain PyTorch's; after the warm-up the activation
    peak is the planner's figure for that share, to the byte, and within what was placed."""
    data = batches(4)
    ref_losses, ref = train_reference(tiny_llama(), data)
    eng = Engine(tiny_llama(), **flat_options(lr=1e-3, gpu_mem=gpu, chunk_bytes=CHUNK))
    try:
        losses = [eng.step(b) for b in data]
        assert eng.recomputed == recomputed
        every = len(eng.device_plan.gpu_home) == len(eng.plan.chunks)
        assert every == (recomputed < 4 or gpu == "3M")
        assert losses == ref_losses
        mine = dict(eng.named_parameters_fp32())
        for name, p in ref.named_parameters():
            assert torch.equal(mine[name], p.detach()), name
        rows, seq = data[0]["input_ids"].shape
        planned = perfmodel.activation_bytes(model=ModelProfile.from_hf_config(tiny_llama().config),
                                             batch_size=rows, seq_len=seq, precision="fp32", checkpointing=recomputed)
        measured = eng.ledger.kind_peak("gpu", "activation")  # (the warm-up, all recomputed, saved less)
        assert measured == planned <= eng.needs.activations
        kept = 4 - recomputed
        assert eng.needs.activations == perfmodel.activation_bytes(
            model=ModelProfile.from_hf_config(tiny_llama().config), batch_size=rows, seq_len=seq,
            precision="fp32", checkpointing=True) + kept * eng.tracker.block_bytes[0]
    finally:
        eng.close()


def test_asked_for_every_block_it_recomputes_every_block():
    eng = Engine(tiny_llama(), activations=Activations(recompute=True), **flat_options(chunk_bytes=CHUNK))
    try:
        for b in batches(2):
            eng.step(b)
        assert eng.recomputed == 4
    finally:
        eng.close()


def test_the_trainer_leaves_it_to_the_engine_where_the_longest_batch_is_known(tmp_path):
    """TRL's SFTTrainer (gradient checkpointing on, its default) with max_length and a device that
    holds everything: the engine keeps both layers' activations, with the losses of plain
    SFTTrainer; asked through offload={'checkpointing': True} it recomputes both, with the same
    losses. A Trainer without max_length (its first batch need not be its longest) recomputes both."""
    trl = pytest.importorskip("trl")
    pytest.importorskip("peft")
    datasets = pytest.importorskip("datasets")
    from transformers import Trainer, TrainingArguments

    from tests.test_hf_trainer import Rows, args, logs, tiny
    from tierwise.cli.builtin import build_tokenizer, sample_lines
    from tierwise.offload.hf import OffloadTrainer, with_offload

    tok = build_tokenizer()
    data = datasets.Dataset.from_dict({"text": sample_lines()[:24]})

    def sft(cls, out, **kw):
        config = trl.SFTConfig(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                               learning_rate=5e-3, max_steps=4, warmup_steps=1, max_grad_norm=0.5, logging_steps=1,
                               save_strategy="no", report_to=[], seed=0, use_cpu=True, max_length=32,
                               weight_decay=0.0, disable_tqdm=True, bf16=False)
        torch.manual_seed(0)
        trainer = cls(model=tiny(vocab=len(tok)), args=config, train_dataset=data, processing_class=tok, **kw)
        trainer.train()
        return trainer

    plain = sft(trl.SFTTrainer, tmp_path / "plain")
    assert plain.model.model.layers[0].gradient_checkpointing  # (its own recompute ran)
    offload = {"gpu_mem": "8M", "chunk_bytes": 16 << 10}
    auto = sft(with_offload(trl.SFTTrainer), tmp_path / "auto", offload=offload)
    every = sft(with_offload(trl.SFTTrainer), tmp_path / "all", offload={**offload, "checkpointing": True})
    assert auto.engine.recomputed == 0 and every.engine.recomputed == 2
    assert logs(auto) == pytest.approx(logs(plain), rel=1e-5) and logs(every) == pytest.approx(logs(plain), rel=1e-5)

    # (transformers 5 renames it activation_checkpointing; the old name warns)
    on = {"activation_checkpointing" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
          else "gradient_checkpointing": True}
    plain = Trainer(model=tiny(), args=args(tmp_path / "plain2", **on), train_dataset=Rows())
    plain.train()
    ours = OffloadTrainer(model=tiny(), args=args(tmp_path / "ours", **on), train_dataset=Rows(), offload=offload)
    ours.train()
    assert ours.engine.recomputed == 2
    assert logs(ours) == pytest.approx(logs(plain), rel=1e-5)


def test_a_qlora_model_that_fits_keeps_its_layers_with_the_same_numbers():
    """An NF4 base (double-quantized) with LoRA on every linear layer and adapter dropout, bf16:
    left to the engine it keeps all 4 layers where everything fits, with the losses of the same
    run recomputing every layer (dropout's masks included), and holds no more than it placed."""
    peft = pytest.importorskip("peft")
    data = batches(4)
    runs = {}
    for name, recompute in (("all", True), ("auto", None)):
        torch.manual_seed(3)
        eng = Engine(tiny_llama(), lora=peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules="all-linear"),
                     precision=Precision("bf16", base="nf4", double_quant=True),
                     activations=Activations(recompute=recompute), **flat_options(lr=1e-3, gpu_mem="8M", chunk_bytes=CHUNK))
        try:
            runs[name] = [eng.step(b) for b in data[:1]]
            eng.ledger.reset_peaks()
            runs[name] += [eng.step(b) for b in data[1:]]
            if name == "auto":
                assert eng.recomputed == 0
                assert 0 < eng.ledger.kind_peak("gpu", "activation") <= eng.needs.activations
        finally:
            eng.close()
    assert runs["auto"] == runs["all"]
