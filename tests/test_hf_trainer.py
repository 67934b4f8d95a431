"""OffloadTrainer against plain transformers.Trainer: the same tiny Llama, seed, data and
arguments (fp32, gradient accumulation, clipping, a warmup + linear schedule), the engine
streaming at a small device budget. Losses, grad norms and the saved weights agree to fp32
rounding (the engine clips and sums in its own order); a PEFT model trains its adapter alike;
a checkpoint resumes to the same losses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tierwise.offload.core.errors import TierwiseError

transformers = pytest.importorskip("transformers")
from transformers import Trainer, TrainingArguments  # noqa: E402

from tierwise.offload.hf import ENGINE_STATE, OffloadTrainer, with_offload  # noqa: E402

VOCAB = 96
OFFLOAD = {"gpu_mem": "160K", "chunk_bytes": 16 << 10}  # several chunks, streamed


def tiny(seed=0, vocab=VOCAB, hidden=32, layers=2):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    return transformers.LlamaForCausalLM(cfg)


class Rows(torch.utils.data.Dataset):
    def __init__(self, n=24, seq=16):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCAB, (n, seq), generator=g)
        self.labels = self.ids.clone()
        self.labels[::3, :6] = -100  # masked prompts: rows weigh differently

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def args(out: Path, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                learning_rate=5e-3, max_steps=6, warmup_steps=2, lr_scheduler_type="linear",
                max_grad_norm=0.5, logging_steps=1, save_strategy="no", report_to=[], seed=0,
                use_cpu=True, optim="adamw_torch", weight_decay=0.0, dataloader_num_workers=0,
                disable_tqdm=True)
    return TrainingArguments(**(base | kw))


def logs(trainer, key="loss"):
    return [r[key] for r in trainer.state.log_history if key in r]


def test_offload_trainer_trains_as_plain_trainer(tmp_path):
    plain = Trainer(model=tiny(), args=args(tmp_path / "plain"), train_dataset=Rows())
    plain.train()
    ours = OffloadTrainer(model=tiny(), args=args(tmp_path / "ours"), train_dataset=Rows(), offload=OFFLOAD)
    ours.train()
    assert len(logs(ours)) == 6
    assert logs(ours) == pytest.approx(logs(plain), rel=1e-5)
    assert logs(ours, "grad_norm") == pytest.approx(logs(plain, "grad_norm"), rel=1e-4)
    assert logs(ours, "learning_rate") == logs(plain, "learning_rate")
    assert logs(ours, "gpu_peak_gib")[-1] == round(ours.engine.ledger.peaks()["gpu"] / 2**30, 4)
    assert ours.engine.ledger.peaks()["gpu"] <= 160 << 10  # it streamed within the budget
    assert ours.engine.streamed_storage, "nothing streamed: the test would not exercise offload"
    ours.save_model(str(tmp_path / "ours-model"))
    plain.save_model(str(tmp_path / "plain-model"))
    a = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ours-model").state_dict()
    b = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "plain-model").state_dict()
    for name in b:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5, msg=name)
    evaluated = ours.evaluate(eval_dataset=Rows(n=6))["eval_loss"]
    assert evaluated == pytest.approx(plain.evaluate(eval_dataset=Rows(n=6))["eval_loss"], rel=1e-5)
    with pytest.raises(TierwiseError, match="evaluates the loss only"):  # (was: predictions None, silently)
        ours.predict(Rows(n=2))


def test_without_clipping_the_grad_norm_is_still_logged(tmp_path):
    """max_grad_norm=0: nothing clipped, and the Trainer still logs the gradient norm."""
    plain = Trainer(model=tiny(), args=args(tmp_path / "plain", max_grad_norm=0.0, max_steps=3), train_dataset=Rows())
    plain.train()
    ours = OffloadTrainer(model=tiny(), args=args(tmp_path / "ours", max_grad_norm=0.0, max_steps=3),
                          train_dataset=Rows(), offload=OFFLOAD)
    ours.train()
    assert len(logs(plain, "grad_norm")) == 3
    assert logs(ours, "grad_norm") == pytest.approx(logs(plain, "grad_norm"), rel=1e-4)
    assert logs(ours) == pytest.approx(logs(plain), rel=1e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_a_whole_models_weights_are_saved_one_tensor_at_a_time(tmp_path, monkeypatch, tied):
    """save_model and the model's own save_pretrained write a whole model's weights streamed
    from the engine (cli.export: never the whole model in host memory), tied embeddings once,
    loading back to plain Trainer's."""
    from tierwise.offload import hf

    def model():
        m = tiny()
        if tied:
            m.config.tie_word_embeddings = True
            m.tie_weights()
        return m

    plain = Trainer(model=model(), args=args(tmp_path / "plain", max_steps=2), train_dataset=Rows())
    plain.train()
    ours = OffloadTrainer(model=model(), args=args(tmp_path / "ours", max_steps=2), train_dataset=Rows(),
                          offload=OFFLOAD)
    ours.train()
    monkeypatch.setattr(hf, "_engine_weights", lambda *a: pytest.fail("the whole model gathered in memory"))
    stale = tmp_path / "ours-model"  # (an earlier save's shards and index: removed, as save_pretrained does)
    stale.mkdir()
    (stale / "model-00001-of-00002.safetensors").write_bytes(b"x")
    (stale / "model.safetensors.index.json").write_text("{}")
    ours.save_model(str(tmp_path / "ours-model"))
    ours.model.save_pretrained(tmp_path / "ours-own", max_shard_size="2KB")  # (as push_to_hub calls it)
    assert len(list((tmp_path / "ours-own").glob("model-*-of-*.safetensors"))) > 1
    plain.save_model(str(tmp_path / "plain-model"))
    b = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "plain-model").state_dict()
    for saved in ("ours-model", "ours-own"):
        a = transformers.LlamaForCausalLM.from_pretrained(tmp_path / saved).state_dict()
        assert a.keys() == b.keys()
        for name in b:
            torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5, msg=name)
    assert (tmp_path / "ours-model" / "training_args.bin").is_file()
    assert sorted(p.name for p in (tmp_path / "ours-model").glob("*.safetensors")) == ["model.safetensors"]
    assert not (tmp_path / "ours-model" / "model.safetensors.index.json").exists()
    for saved in ("ours-model", "ours-own"):  # config.json as save_pretrained writes it
        config = json.loads((tmp_path / saved / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"


def test_a_peft_model_trains_its_adapter_as_peft_does(tmp_path):
    peft = pytest.importorskip("peft")
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    plain = Trainer(model=peft.get_peft_model(tiny(), peft.LoraConfig(**lora)), args=args(tmp_path / "plain"),
                    train_dataset=Rows())
    plain.train()
    torch.manual_seed(0)  # the adapters' init draws the same numbers
    ours = OffloadTrainer(model=peft.get_peft_model(tiny(), peft.LoraConfig(**lora)), args=args(tmp_path / "ours"),
                          train_dataset=Rows(), offload=OFFLOAD)
    torch.manual_seed(0)
    ours.train()
    assert logs(ours) == pytest.approx(logs(plain), rel=1e-5)
    ours.save_model(str(tmp_path / "adapter"))
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["r"] == 4 and (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


def test_a_checkpoint_resumes_to_the_same_losses(tmp_path):
    whole = OffloadTrainer(model=tiny(), args=args(tmp_path / "whole"), train_dataset=Rows(), offload=OFFLOAD)
    whole.train()
    first = OffloadTrainer(model=tiny(), args=args(tmp_path / "cut", save_strategy="steps", save_steps=3),
                           train_dataset=Rows(), offload=OFFLOAD)
    first.train()
    ckpt = tmp_path / "cut" / "checkpoint-3"
    assert (ckpt / ENGINE_STATE).is_file()
    again = OffloadTrainer(model=tiny(seed=5), args=args(tmp_path / "cut"), train_dataset=Rows(), offload=OFFLOAD)
    again.train(resume_from_checkpoint=str(ckpt))
    assert logs(again)[-3:] == pytest.approx(logs(whole)[-3:], rel=1e-6)
    # a checkpoint of an earlier version: the engine's state pickled whole (tierwise_engine.pt)
    import shutil

    from tierwise.cli.checkpoint import load_tree

    old = tmp_path / "old" / "checkpoint-3"
    shutil.copytree(ckpt, old)
    state = load_tree(old, "tierwise_engine")
    (old / ENGINE_STATE).unlink()
    (old / "tierwise_engine.json").unlink()
    torch.save(state, old / "tierwise_engine.pt")
    older = OffloadTrainer(model=tiny(seed=5), args=args(tmp_path / "old"), train_dataset=Rows(), offload=OFFLOAD)
    older.train(resume_from_checkpoint=str(old))
    assert logs(older)[-3:] == pytest.approx(logs(whole)[-3:], rel=1e-6)


@pytest.mark.parametrize("lora", [False, True])
def test_load_best_model_at_end_saves_the_best_checkpoints_weights(tmp_path, lora):
    """load_best_model_at_end: the Trainer loads the best checkpoint's weights into the model,
    whose parameters are the engine's placeholders; the engine takes them from that
    checkpoint, so what is saved after training is the best step's, as plain Trainer's is.
    (greater_is_better on eval_loss makes the best an early step, not the last.)"""
    peft = pytest.importorskip("peft") if lora else None

    def model():
        torch.manual_seed(0)
        m = tiny()
        if lora:
            m = peft.get_peft_model(m, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                       task_type="CAUSAL_LM"))
        return m

    def run(out, cls, **kw):
        a = args(out, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
                 load_best_model_at_end=True, metric_for_best_model="eval_loss", greater_is_better=True)
        trainer = cls(model=model(), args=a, train_dataset=Rows(), eval_dataset=Rows(n=6), **kw)
        torch.manual_seed(0)
        trainer.train()
        trainer.save_model(str(out / "final"))
        return trainer

    plain, ours = run(tmp_path / "plain", Trainer), run(tmp_path / "ours", OffloadTrainer, offload=OFFLOAD)
    assert plain.state.best_model_checkpoint.endswith("checkpoint-2")
    assert ours.state.best_model_checkpoint.endswith("checkpoint-2")
    from safetensors.torch import load_file

    name = "adapter_model.safetensors" if lora else "model.safetensors"
    a, b = load_file(tmp_path / "ours" / "final" / name), load_file(tmp_path / "plain" / "final" / name)
    last = load_file(tmp_path / "plain" / "checkpoint-6" / name)
    assert a.keys() == b.keys()
    for n in b:
        torch.testing.assert_close(a[n], b[n], rtol=1e-4, atol=1e-5, msg=n)
    assert any(not torch.allclose(b[n], last[n]) for n in b)  # the best is not the last: the test can fail
    assert ours.evaluate()["eval_loss"] == pytest.approx(plain.evaluate()["eval_loss"], rel=1e-5)
    if not lora:  # (the engine's state, which holds the best weights, is what save_only_model leaves out)
        with pytest.raises(TierwiseError, match="save_only_model"):
            OffloadTrainer(model=tiny(), args=args(tmp_path / "x", eval_strategy="steps", save_strategy="steps",
                                                   load_best_model_at_end=True, save_only_model=True),
                           train_dataset=Rows(), eval_dataset=Rows(n=6), offload=OFFLOAD)


def test_a_collators_batch_encoding_trains_and_evaluates_as_plain_trainer(tmp_path):
    """transformers' collators (DataCollatorForLanguageModeling, ...WithPadding, ...ForSeq2Seq)
    return a BatchEncoding, a mapping but not a dict: it trains and evaluates as a dict does."""
    from transformers import DataCollatorForLanguageModeling

    from tierwise.cli.builtin import build_tokenizer

    tok = build_tokenizer()
    g = torch.Generator().manual_seed(3)
    rows = [{"input_ids": torch.randint(5, len(tok), (12,), generator=g).tolist()} for _ in range(16)]
    collator = DataCollatorForLanguageModeling(tokenizer=tok, mlm=False)
    assert not isinstance(collator(rows[:2]), dict)  # (the case under test)

    def run(cls, out, **kw):
        trainer = cls(model=tiny(vocab=len(tok)), args=args(out, max_steps=3, eval_strategy="steps", eval_steps=3),
                      train_dataset=rows, eval_dataset=rows[:4], data_collator=collator, **kw)
        trainer.train()
        return trainer

    plain = run(Trainer, tmp_path / "plain")
    ours = run(OffloadTrainer, tmp_path / "ours", offload={**OFFLOAD, "gpu_mem": "400K"})
    assert logs(ours) == pytest.approx(logs(plain), rel=1e-5)
    assert logs(ours, "eval_loss") == pytest.approx(logs(plain, "eval_loss"), rel=1e-5) and logs(ours, "eval_loss")


def test_a_longer_batch_later_is_placed_for_when_the_dataset_tells_its_longest_row(tmp_path):
    """Short batches first, longer ones later (a padding collator, sequential order): the
    engine is placed for the train dataset's longest row (a datasets.Dataset's Arrow column, a
    list) and trains as plain Trainer; a dataset that cannot tell is placed for the first
    batch, and the longer one's error says what to give, in the Trainer's words."""
    datasets = pytest.importorskip("datasets")
    from transformers import DataCollatorForLanguageModeling

    from tierwise.cli.builtin import build_tokenizer
    from tierwise.offload.core.errors import StepOverBudget
    from tierwise.offload.hf import _longest_row

    tok = build_tokenizer()
    g = torch.Generator().manual_seed(4)
    rows = [{"input_ids": torch.randint(5, len(tok), (n,), generator=g).tolist()} for n in [4] * 8 + [28] * 8]
    collator = DataCollatorForLanguageModeling(tokenizer=tok, mlm=False, pad_to_multiple_of=8)

    class Opaque(torch.utils.data.Dataset):  # (reading every row could be costly: not scanned)
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            return rows[i]

    table = datasets.Dataset.from_list(rows)
    assert _longest_row(table) == _longest_row(rows) == 28 and _longest_row(Opaque()) is None
    longer = datasets.Dataset.from_list(rows + [{"input_ids": [5] * 500}])
    assert _longest_row(longer) == 500
    assert _longest_row(longer.filter(lambda r: len(r["input_ids"]) <= 64)) == 28  # (the rows it keeps)
    assert _longest_row(datasets.Dataset.from_dict({"input_ids": [[[1, 2, 3]]]})) is None  # (not a list of ids)

    def run(cls, out, data, **kw):
        a = args(out, max_steps=4, train_sampling_strategy="sequential", gradient_accumulation_steps=1,
                 per_device_train_batch_size=4)
        trainer = cls(model=tiny(vocab=len(tok)), args=a, train_dataset=data, data_collator=collator, **kw)
        trainer.train()
        return trainer

    offload = {**OFFLOAD, "gpu_mem": "900K"}
    plain = run(Trainer, tmp_path / "plain", rows)
    for data in (table, rows):
        ours = run(OffloadTrainer, tmp_path / "ours", data, offload=offload)
        assert logs(ours) == pytest.approx(logs(plain), rel=1e-5)
        assert ours._longest() == 32  # (28, padded to a multiple of 8)
    with pytest.raises(StepOverBudget) as caught:
        run(OffloadTrainer, tmp_path / "opaque", Opaque(), offload=offload)
    said = str(caught.value)  # (in the message, where a script's log of it keeps it)
    assert "OffloadTrainer: the budgets are offload=" in said and "placed for the first batch" in said \
        and "max_length" in said and "\n" not in said


def test_with_offload_builds_a_subclass_and_refuses_what_it_cannot_do(tmp_path):
    class MyTrainer(Trainer):
        pass

    cls = with_offload(MyTrainer)
    assert issubclass(cls, MyTrainer) and with_offload(MyTrainer) is cls
    with pytest.raises(TierwiseError, match="weight_decay"):
        cls(model=tiny(), args=args(tmp_path / "x", weight_decay=0.1), train_dataset=Rows(), offload=OFFLOAD)
    with pytest.raises(TypeError, match="Trainer class"):
        with_offload(int)
    # the Trainer's own values replaced them, silently (lr 1e-3: the engine's default, given all the same)
    for given, theirs in (({"lr": 0.1}, "learning_rate"), ({"lr": 1e-3}, "learning_rate"),
                          ({"grad_clip": 1.0}, "max_grad_norm"), ({"eps": 1.0}, "adam_epsilon")):
        with pytest.raises(TierwiseError, match=f"set it with TrainingArguments' {theirs}"):
            OffloadTrainer(model=tiny(), args=args(tmp_path / "y"), train_dataset=Rows(), offload={**OFFLOAD, **given})


def test_offload_options_are_refused_when_the_trainer_is_built(tmp_path, monkeypatch):
    """A wrong offload= is refused by the constructor (TRL tokenizes the whole dataset in it, before
    train() would say), with the library's names; budgets beyond this machine's RAM as finetune does."""
    from tierwise.cli import machine
    from tierwise.offload.core.errors import SizeError

    build = lambda off: OffloadTrainer(model=tiny(), args=args(tmp_path / "x"), train_dataset=Rows(),  # noqa: E731
                                       offload=off)
    with pytest.raises(SizeError, match="^bad Budget gpu '8Q'"):
        build({"gpu_mem": "8Q"})
    with pytest.raises(TypeError, match="unknown offload= option 'gpu_mme'; known: gpu_mem, cpu_mem") as info:
        build({"gpu_mme": "1G"})
    assert "lr" not in str(info.value).split("known: ")[1].split(", ")  # (the Trainer sets it)
    with pytest.raises(SizeError, match="gpu 48 has no unit: write 48G"):  # (was 48 bytes, refused in train())
        build({"gpu_mem": "48"})
    with pytest.raises(TierwiseError, match="unknown optimizer 'lion'"):  # (was a ValueError in train())
        build({"gpu_mem": "48M", "optimizer": "lion"})
    monkeypatch.setattr(machine, "available_ram", lambda: 4 << 30)
    monkeypatch.setattr(machine, "has_cuda", lambda: False)
    with pytest.raises(TierwiseError, match=r"^offload cpu_mem 6.00 GiB \+ about .* available \(4.00 GiB of .*lower cpu_mem$"):
        build({"cpu_mem": "6G"})
    with pytest.raises(TierwiseError, match=r"gpu_mem 5.00 GiB \(the simulated device: host RAM\)"):
        build({"gpu_mem": "5G"})
    build({"cpu_mem": "2G", "gpu_mem": "1G"})  # with the process: within 4 GiB
    build({"gpu_mem": "6G", "device": "cuda"})  # (a GPU's gpu_mem is not host RAM)
    # the model's own weights in host memory count as available: the engine takes them over
    from tierwise.offload.plan.planner import process_bytes

    held = sum(p.nbytes for p in tiny().parameters())
    monkeypatch.setattr(machine, "available_ram", lambda: process_bytes(lora=False) + (1 << 20))
    build({"cpu_mem": (1 << 20) + held // 2})
    with pytest.raises(TierwiseError, match="the model's weights there included"):
        build({"cpu_mem": (1 << 20) + 2 * held})
    from tierwise.offload.hf import from_pretrained

    peft = pytest.importorskip("peft")
    monkeypatch.setattr(machine, "available_ram", lambda: None)
    tiny().save_pretrained(tmp_path / "model")
    with pytest.raises(TypeError, match="peft_config"):  # transformers' Trainer takes none, whatever the model
        OffloadTrainer(model=from_pretrained(str(tmp_path / "model")), args=args(tmp_path / "x"),
                       train_dataset=Rows(), offload=OFFLOAD, peft_config=peft.LoraConfig(r=2))


@pytest.mark.parametrize("tiled", [False, True])
def test_with_offload_sft_trainer_and_peft_config_trains_as_sft_trainer(tmp_path, tiled, monkeypatch):
    """TRL's SFTTrainer with peft_config, with and without offload: the same losses, and the
    same token metrics it logs (entropy, mean_token_accuracy, num_tokens; in evaluation too),
    from the engine's loss on its tiled path and on the model's own. SFTConfig's default
    max_length (1024) is not what the engine is placed for: the data's longest row is."""
    trl = pytest.importorskip("trl")
    peft = pytest.importorskip("peft")
    datasets = pytest.importorskip("datasets")
    from tierwise.cli.builtin import build_tokenizer, sample_lines
    from tierwise.offload.plan import perfmodel

    tok = build_tokenizer()
    data = datasets.Dataset.from_dict({"text": sample_lines()[:24]})
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")

    def run(cls, out, **kw):
        config = trl.SFTConfig(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                               learning_rate=5e-2, max_steps=6, warmup_steps=2, max_grad_norm=0.5, logging_steps=2,
                               save_strategy="no", report_to=[], seed=0, use_cpu=True,
                               weight_decay=0.0, disable_tqdm=True, bf16=False, eval_strategy="steps", eval_steps=3)
        torch.manual_seed(0)
        trainer = cls(model=tiny(vocab=len(tok)), args=config, train_dataset=data, eval_dataset=data.select(range(6)),
                      processing_class=tok, peft_config=lora, **kw)
        trainer.train()
        return trainer

    plain = run(trl.SFTTrainer, tmp_path / "plain")
    if tiled:  # (a few tokens a tile: every batch spans several)
        monkeypatch.setattr(perfmodel, "HEAD_TILE_BYTES", 4 * len(tok) * 7)
    ours = run(with_offload(trl.SFTTrainer), tmp_path / "ours", offload={**OFFLOAD, "gpu_mem": "400K"})
    assert len(logs(ours)) == 3 and len(logs(ours, "eval_loss")) == 2
    assert ours._longest() < ours.args.max_length == 1024  # (SFTConfig's default: placed for the data's longest)
    for key in ("loss", "entropy", "mean_token_accuracy", "num_tokens", "eval_loss", "eval_entropy",
                "eval_mean_token_accuracy", "eval_num_tokens"):
        assert logs(ours, key) == pytest.approx(logs(plain, key), rel=1e-5), key
    assert any(logs(plain, "mean_token_accuracy"))  # (the model learns a few tokens: not all zero)
    ids = torch.randint(5, len(tok), (2, 12))  # an eval batch without target tokens: TRL's loss says 0
    masked = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.full_like(ids, -100)}
    got = [float(t.prediction_step(t.model, dict(masked), prediction_loss_only=True)[0]) for t in (plain, ours)]
    assert got == [0.0, 0.0]


def test_from_pretrained_loads_a_model_bigger_than_the_device_and_trains_as_one_that_fits(tmp_path):
    """A checkpoint 2.8x the device budget: tierwise's from_pretrained builds it on the meta
    device, the engine reads it into its tiers, and with_offload(SFTTrainer) with peft_config
    gives the losses of the same script on the model loaded by transformers."""
    trl = pytest.importorskip("trl")
    peft = pytest.importorskip("peft")
    datasets = pytest.importorskip("datasets")
    from tierwise.cli.builtin import build_tokenizer, sample_lines
    from tierwise.offload.hf import from_pretrained

    tok = build_tokenizer()
    saved = tmp_path / "model"
    tiny(vocab=len(tok), hidden=96, layers=6).save_pretrained(saved)
    tok.save_pretrained(saved)
    weights = sum(f.stat().st_size for f in saved.glob("*.safetensors"))
    budget = 800 << 10
    assert weights > 2.5 * budget
    data = datasets.Dataset.from_dict({"text": sample_lines()[:24]})
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")

    def run(cls, model, out, **kw):
        config = trl.SFTConfig(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                               learning_rate=5e-3, max_steps=6, warmup_steps=2, max_grad_norm=0.5, logging_steps=1,
                               save_strategy="no", report_to=[], seed=42, use_cpu=True, max_length=32,
                               weight_decay=0.0, disable_tqdm=True, bf16=False)
        torch.manual_seed(7)  # not the run's seed: SFTTrainer draws the adapters after set_seed(42)
        trainer = cls(model=model(), args=config, train_dataset=data, processing_class=tok, peft_config=lora, **kw)
        trainer.train()
        return trainer

    plain = run(trl.SFTTrainer, lambda: transformers.AutoModelForCausalLM.from_pretrained(saved), tmp_path / "plain")
    ours = run(with_offload(trl.SFTTrainer), lambda: from_pretrained(str(saved)), tmp_path / "ours",
               offload={"gpu_mem": budget, "chunk_bytes": 16 << 10})
    assert next(ours.model.get_base_model().parameters()).device.type != "meta"
    assert ours.engine.ledger.peaks()["gpu"] <= budget
    assert logs(ours) == pytest.approx(logs(plain), rel=1e-5)


def test_adamw_8bit_trains_as_the_trainer_with_bitsandbytes(tmp_path):
    """TrainingArguments(optim="adamw_8bit"): transformers gives bitsandbytes' optimizer fp32
    moments for the embeddings, and so does the engine (with 8-bit ones the losses parted by
    2e-3 by step 4). What is left is bitsandbytes' CPU quantizer, a 65,536-bin table where the
    engine takes the nearest code (as bitsandbytes' CUDA kernel does)."""
    bnb = pytest.importorskip("bitsandbytes")
    kw = dict(optim="adamw_8bit", max_steps=6)
    model = lambda: tiny(hidden=64)  # noqa: E731 - an embedding of 6,144 elements: 8-bit-sized
    plain = Trainer(model=model(), args=args(tmp_path / "plain", **kw), train_dataset=Rows())
    try:
        plain.train()
    finally:  # transformers' override stays in bitsandbytes' global manager, keyed by group and
        # parameter index: a later bitsandbytes optimizer in this process would inherit it
        bnb.optim.GlobalOptimManager.get_instance().initialize()
    ours = OffloadTrainer(model=model(), args=args(tmp_path / "ours", **kw), train_dataset=Rows(),
                          offload={"gpu_mem": "400K", "chunk_bytes": 16 << 10})
    ours.train()
    assert ours.engine.optimizer_name == "adamw8bit"
    assert logs(ours) == pytest.approx(logs(plain), rel=1e-4)


def test_from_pretrained_needs_no_tokenizer(tmp_path):
    """A directory of config and weights alone (the data came tokenized), as transformers'
    from_pretrained takes it: the model trains as the one transformers loads."""
    from tierwise.offload.hf import from_pretrained

    tiny().save_pretrained(tmp_path / "model")
    assert not list((tmp_path / "model").glob("tokenizer*"))
    short = dict(max_steps=2, warmup_steps=0)
    plain = Trainer(model=transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model"),
                    args=args(tmp_path / "plain", **short), train_dataset=Rows())
    plain.train()
    ours = OffloadTrainer(model=from_pretrained(str(tmp_path / "model")), args=args(tmp_path / "ours", **short),
                          train_dataset=Rows(), offload=OFFLOAD)
    ours.train()
    assert logs(ours) == pytest.approx(logs(plain), rel=1e-5)


def test_a_bitsandbytes_qlora_model_trains_as_without_offload(tmp_path):
    """The QLoRA script as people write it (BitsAndBytesConfig NF4, double quant; SFTTrainer with
    peft_config) with one changed line: its 4-bit layers become the engine's NF4 base, streamed,
    and the losses are those of the same script without offload."""
    trl = pytest.importorskip("trl")
    peft = pytest.importorskip("peft")
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("bitsandbytes")
    from tierwise.cli.builtin import build_tokenizer, sample_lines

    tok = build_tokenizer()
    saved = tmp_path / "model"
    tiny(vocab=len(tok), hidden=64).save_pretrained(saved)
    tok.save_pretrained(saved)
    quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                            bnb_4bit_compute_dtype=torch.float32)
    data = datasets.Dataset.from_dict({"text": sample_lines()[:24]})
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")

    def run(cls, out, load=None, **kw):
        config = trl.SFTConfig(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                               learning_rate=5e-3, max_steps=6, warmup_steps=2, max_grad_norm=0.5, logging_steps=1,
                               save_strategy="no", report_to=[], seed=0, use_cpu=True, max_length=32,
                               weight_decay=0.0, disable_tqdm=True, bf16=False)
        torch.manual_seed(0)
        model = load() if load else transformers.AutoModelForCausalLM.from_pretrained(
            saved, quantization_config=quant, device_map="cpu")
        trainer = cls(model=model, args=config, train_dataset=data, processing_class=tok, peft_config=lora, **kw)
        trainer.train()
        return trainer

    plain = run(trl.SFTTrainer, tmp_path / "plain")
    offload = {"gpu_mem": "600K", "chunk_bytes": 16 << 10}
    ours = run(with_offload(trl.SFTTrainer), tmp_path / "ours", offload=offload)
    assert ours.engine.options["precision"].base == "nf4" and ours.engine.options["precision"].double_quant
    assert logs(ours) == pytest.approx(logs(plain), rel=1e-4)
    # the same script loading through tierwise (never whole in memory), the engine encoding NF4 itself
    from tierwise.offload.hf import from_pretrained

    loaded = run(with_offload(trl.SFTTrainer), tmp_path / "loaded", load=lambda: from_pretrained(str(saved)),
                 offload={**offload, "base_dtype": "nf4", "double_quant": True})
    assert logs(loaded) == pytest.approx(logs(plain), rel=1e-4)


def test_steps_train_in_train_mode_and_a_changed_loss_is_refused(tmp_path):
    """A model evaluated (or loaded) in eval mode trains with dropout on, as Trainer does; what
    would change the loss the engine computes is refused in one line."""
    model = tiny()
    model.eval()
    modes = []
    model.model.layers[0].register_forward_pre_hook(lambda mod, args: modes.append(mod.training))
    trainer = OffloadTrainer(model=model, args=args(tmp_path / "o", max_steps=2, eval_strategy="steps", eval_steps=1),
                             train_dataset=Rows(), eval_dataset=Rows(n=4), offload=OFFLOAD)
    trainer.train()
    assert True in modes and modes[-1] is False  # trained in train mode, evaluated in eval mode
    for bad in ({"label_smoothing_factor": 0.1}, {"fp16": False, "optim": "adafactor"}):
        with pytest.raises(TierwiseError):
            OffloadTrainer(model=tiny(), args=args(tmp_path / "x", **bad), train_dataset=Rows(),
                           offload=OFFLOAD).train()


def test_a_trainer_with_its_own_compute_loss_is_refused(tmp_path):
    """The engine computes the model's own loss: a Trainer subclass's compute_loss (a custom
    loss) or a TRL trainer with its own objective (DPO, reward) would be skipped, silently."""
    class ZeroLoss(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return model(**inputs).loss * 0.0

    with pytest.raises(TierwiseError, match="ZeroLoss.compute_loss is not called"):
        with_offload(ZeroLoss)(model=tiny(), args=args(tmp_path / "z"), train_dataset=Rows(), offload=OFFLOAD)

    class Logged(ZeroLoss):  # (a subclass of a subclass: the same)
        pass

    with pytest.raises(TierwiseError, match="ZeroLoss.compute_loss"):
        with_offload(Logged)(model=tiny(), args=args(tmp_path / "l"), train_dataset=Rows(), offload=OFFLOAD)
    class Timed(OffloadTrainer):  # wrapping the engine's step (above it): it runs, so it is no refusal
        calls = 0

        def training_step(self, model, inputs, num_items_in_batch=None):
            Timed.calls += 1
            return super().training_step(model, inputs, num_items_in_batch)

    Timed(model=tiny(), args=args(tmp_path / "t", max_steps=2), train_dataset=Rows(), offload=OFFLOAD).train()
    assert Timed.calls == 4  # (2 steps x grad-accum 2)

    class Scaled(Trainer):  # an objective in training_step: skipped as silently
        def training_step(self, model, inputs, num_items_in_batch=None):
            return super().training_step(model, inputs, num_items_in_batch) * 0.0

    with pytest.raises(TierwiseError, match="Scaled.training_step is not called"):
        with_offload(Scaled)(model=tiny(), args=args(tmp_path / "s"), train_dataset=Rows(), offload=OFFLOAD)
    trl = pytest.importorskip("trl")
    for cls in (trl.DPOTrainer, trl.RewardTrainer):
        with pytest.raises(TierwiseError, match=f"TRL's {cls.__name__} trains its own objective"):
            with_offload(cls)(model=tiny(), args=args(tmp_path / "t"))


def test_the_models_own_save_pretrained_after_training_writes_the_trained_weights(tmp_path):
    """trainer.model's parameters hold the engine's placeholders: its save_pretrained (as TRL
    scripts call it) writes the engine's weights, as save_model does (was: a shared-tensors
    error)."""
    trainer = OffloadTrainer(model=tiny(), args=args(tmp_path / "o", max_steps=2), train_dataset=Rows(),
                             offload=OFFLOAD)
    trainer.train()
    trainer.model.save_pretrained(tmp_path / "direct")
    trainer.save_model(str(tmp_path / "saved"))
    direct = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "direct").state_dict()
    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved").state_dict()
    start = tiny().state_dict()
    assert all(torch.equal(direct[k], saved[k]) for k in saved)
    assert any(not torch.equal(direct[k], start[k]) for k in start)
    # the trainer dropped (a script that trains in a function and saves the model it returns)
    def trained(out):
        t = OffloadTrainer(model=tiny(), args=args(out, max_steps=2), train_dataset=Rows(), offload=OFFLOAD)
        t.train()
        t.save_model(str(out / "saved"))
        return t.model

    alone = trained(tmp_path / "alone")
    alone.save_pretrained(tmp_path / "alone" / "direct")
    ours = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "alone" / "direct").state_dict()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "alone" / "saved").state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    # a second trainer over the same model (the first one's engine closed, its weights given back
    # as Engine.close says): the model's save_pretrained writes the second one's
    trainer.engine.close()
    model = trainer.model
    model.load_state_dict(saved, assign=True)
    second = OffloadTrainer(model=model, args=args(tmp_path / "o2", max_steps=3), train_dataset=Rows(),
                            offload=OFFLOAD)
    second.train()
    model.save_pretrained(tmp_path / "again")
    second.save_model(str(tmp_path / "saved2"))
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again").state_dict()
    saved2 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved2").state_dict()
    assert all(torch.equal(again[k], saved2[k]) for k in saved2)
    assert any(not torch.equal(again[k], saved[k]) for k in saved)


def test_from_pretrained_takes_a_dtype_for_what_it_saves(tmp_path):
    """dtype="auto" keeps a bf16 checkpoint's dtype in what save_model writes, as transformers'
    from_pretrained loads it (the default stays fp32); a loader argument the engine has no use
    for is refused in one line."""
    from safetensors import safe_open

    from tierwise.offload.hf import from_pretrained

    saved = tmp_path / "bf16"
    tiny().to(torch.bfloat16).save_pretrained(saved)
    for dtype, want in ((None, torch.float32), ("auto", torch.bfloat16), (torch.bfloat16, torch.bfloat16)):
        trainer = OffloadTrainer(model=from_pretrained(str(saved), dtype=dtype), args=args(tmp_path / "o", max_steps=1),
                                 train_dataset=Rows(), offload=OFFLOAD)
        trainer.train()
        trainer.save_model(str(tmp_path / "out"))
        with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
            assert {f.get_tensor(k).dtype for k in f.keys()} == {want}, dtype
        config = json.loads((tmp_path / "out" / "config.json").read_text())
        assert config["dtype"] == str(want).removeprefix("torch."), dtype  # (reloaded in it by "auto")
        trainer.model.save_pretrained(tmp_path / "direct")
        assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "direct").dtype == want
    with pytest.raises(TypeError, match="not device_map.*places and encodes"):
        from_pretrained(str(saved), device_map="auto")
    eager = from_pretrained(str(saved), attn_implementation="eager")
    assert eager.config._attn_implementation == "eager"


def test_a_drop_in_optimizer_resumes_under_plain_trainer(tmp_path):
    """tierwise's AdamW8bit given to plain transformers.Trainer (optimizers=): a checkpoint
    resumes to the losses of the run that was not cut (accelerate and the resume each load the
    optimizer's state dict: a second load is refused by nothing)."""
    from tierwise.optim import AdamW8bit, eight_bit_groups

    def run(out, **kw):
        model = tiny()
        trainer = Trainer(model=model, args=args(out, **kw), train_dataset=Rows(),
                          optimizers=(AdamW8bit(eight_bit_groups(model), lr=5e-3, weight_decay=0.0), None))
        return trainer

    whole = run(tmp_path / "whole")
    whole.train()
    cut = run(tmp_path / "cut", save_strategy="steps", save_steps=3)
    cut.train()
    again = run(tmp_path / "cut")
    again.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-3"))
    assert logs(again)[-3:] == pytest.approx(logs(whole)[-3:], rel=1e-6)


def test_peft_config_over_a_meta_model_is_taken_however_the_trainer_is_called(tmp_path):
    """SFTTrainer's peft_config over a from_pretrained (meta) model: its adapters drawn after
    set_seed(args.seed) however the arguments come (keywords, positions, a subclass taking
    *args/**kwargs and passing them on)."""
    trl = pytest.importorskip("trl")
    peft = pytest.importorskip("peft")
    from tierwise.offload.hf import _adapters_over_meta, from_pretrained

    tiny().save_pretrained(tmp_path / "model")

    class Plain(trl.SFTTrainer):
        pass

    class Forwards(trl.SFTTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)

    class Some(trl.SFTTrainer):
        def __init__(self, model, args=None, **kwargs):
            super().__init__(model, args, **kwargs)

    def first_a(seed, cls, positional):
        conf = trl.SFTConfig(str(tmp_path / "o"), seed=seed, report_to=[], use_cpu=True, bf16=False)
        model, lora = from_pretrained(str(tmp_path / "model")), peft.LoraConfig(r=2, target_modules=["q_proj"])
        a, kw = (_adapters_over_meta(with_offload(cls), (model, conf), {"peft_config": lora}) if positional else
                 _adapters_over_meta(with_offload(cls), (), {"model": model, "args": conf, "peft_config": lora}))
        made = kw.get("model") or a[0]
        assert "peft_config" not in kw and isinstance(made, peft.PeftModel), (cls, positional)
        return next(p for n, p in made.named_parameters() if "lora_A" in n).detach().clone()

    want = first_a(3, Plain, False)
    for cls in (Plain, Forwards, Some):
        for positional in (False, True):
            assert torch.equal(first_a(3, cls, positional), want), (cls.__name__, positional)
    assert not torch.equal(first_a(4, Forwards, True), want)  # the seed is the args' own
