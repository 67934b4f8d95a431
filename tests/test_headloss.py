"""The tiled head loss (offload.engine.headloss) against plain PyTorch: the model's own
`model(**batch).loss` and its gradients, on every family the tests build, with label masks,
tied and frozen heads, soft-capping, num_items_in_batch, bf16, and through the Engine."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tinyhf import FAMILIES, family_config  # noqa: E402

from tierwise.offload import Budget, Engine, Optim, Precision  # noqa: E402
from tierwise.offload.engine import headloss  # noqa: E402
from tierwise.offload.core.sizes import parse_size  # noqa: E402
from tierwise.offload.plan import perfmodel  # noqa: E402
from tierwise.offload.engine.batches import default_loss  # noqa: E402

VOCAB = 288


def family_model(family: str, seed: int = 0, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    from tierwise.cli.builtin import build_tokenizer

    torch.manual_seed(seed)
    cfg = family_config(family, vocab_size=VOCAB, tokenizer=build_tokenizer(vocab_size=VOCAB))
    cfg.use_cache = False
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype).train()


def masked_batch(rows=3, seq=20, seed=1):
    """Labels with prompt masking and a padded tail on one row."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, seq), generator=g)
    labels = ids.clone()
    labels[:, :5] = -100  # prompts
    mask = torch.ones_like(ids)
    mask[-1, -4:] = 0  # padding
    labels[-1, -4:] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def run(model, batch, tiled: bool, monkeypatch, weight: float = 1.0):
    model.zero_grad(set_to_none=True)
    # a tile of 7 tokens (so a batch spans several), or one bigger than the batch (the model's own loss)
    monkeypatch.setattr(perfmodel, "HEAD_TILE_BYTES", 4 * VOCAB * 7 if tiled else 1 << 40)
    loss = default_loss(model, batch)
    (loss * weight).backward()
    return loss.detach(), grads(model)


def assert_close(a: dict, b: dict, rtol=1e-5, atol=1e-6):
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=rtol, atol=atol, msg=n)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tiled_loss_is_the_models_own(family, monkeypatch):
    model = family_model(family)
    batch = masked_batch()
    ref_loss, ref = run(model, batch, tiled=False, monkeypatch=monkeypatch, weight=0.37)
    assert ref_loss == model(**batch).loss  # one tile: the model's own loss, bit for bit
    calls = []
    monkeypatch.setattr(headloss.HeadLoss, "apply", _counting(headloss.HeadLoss.apply, calls))
    loss, got = run(model, batch, tiled=True, monkeypatch=monkeypatch, weight=0.37)
    assert calls, "the tiled path did not run"
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert_close(got, ref)


def _counting(fn, calls):
    def wrapped(*args):
        calls.append(1)
        return fn(*args)
    return wrapped


def test_gemma2_soft_capping_is_applied(monkeypatch):
    model = family_model("gemma2")
    batch = masked_batch()
    model.config.final_logit_softcapping = None  # without it the numbers differ: the test can fail
    plain, _ = run(model, batch, tiled=False, monkeypatch=monkeypatch)
    model.config.final_logit_softcapping = 0.02  # (a cap the tiny model's logits reach)
    ref_loss, ref = run(model, batch, tiled=False, monkeypatch=monkeypatch)
    assert abs(float(plain) - float(ref_loss)) > 1e-3
    loss, got = run(model, batch, tiled=True, monkeypatch=monkeypatch)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert_close(got, ref)


def test_frozen_head_and_num_items(monkeypatch):
    model = family_model("llama")
    model.lm_head.weight.requires_grad_(False)
    batch = dict(masked_batch(), num_items_in_batch=torch.tensor(50))
    ref_loss, ref = run(model, batch, tiled=False, monkeypatch=monkeypatch)
    loss, got = run(model, batch, tiled=True, monkeypatch=monkeypatch)
    assert "lm_head.weight" not in got
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert_close(got, ref)


def test_a_head_with_bias_against_linear_and_cross_entropy():
    torch.manual_seed(0)
    hidden = torch.randn(2, 9, 16, requires_grad=True)
    weight = torch.randn(40, 16, requires_grad=True)
    bias = torch.randn(40, requires_grad=True)
    targets = torch.randint(0, 40, (18,))
    targets[::4] = -100
    ref = torch.nn.functional.cross_entropy(torch.nn.functional.linear(hidden, weight, bias).reshape(-1, 40),
                                            targets, ignore_index=-100)
    want = torch.autograd.grad(ref * 3, (hidden, weight, bias))
    loss = headloss.HeadLoss.apply(hidden, weight, bias, targets, None, None)
    got = torch.autograd.grad(loss * 3, (hidden, weight, bias))
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bf16_is_plain_pytorchs_bf16_to_rounding(monkeypatch):
    model = family_model("llama", dtype=torch.bfloat16)
    batch = masked_batch()
    ref_loss, ref = run(model, batch, tiled=False, monkeypatch=monkeypatch)
    loss, got = run(model, batch, tiled=True, monkeypatch=monkeypatch)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=0)
    assert_close(got, ref, rtol=2e-2, atol=2e-3)


def test_unknown_family_runs_its_own_loss(monkeypatch, caplog):
    model = family_model("llama")
    monkeypatch.setattr(headloss, "FAMILIES", frozenset())
    monkeypatch.setattr(perfmodel, "HEAD_TILE_BYTES", 4 * VOCAB * 7)
    monkeypatch.setattr(headloss.HeadLoss, "apply", lambda *a: pytest.fail("tiled an unknown family"))
    with caplog.at_level("INFO", logger=headloss.__name__):
        loss = default_loss(model, masked_batch())
    assert loss == model(**masked_batch()).loss
    assert "is not one whose head and loss are known" in caplog.text


def test_the_engine_trains_with_the_tiled_loss_as_plain_pytorch(monkeypatch):
    """Three streamed steps of two micro-batches (token-weighted) against torch AdamW on the
    model's own loss."""
    monkeypatch.setattr(perfmodel, "HEAD_TILE_BYTES", 4 * VOCAB * 7)
    model = family_model("llama-tied")
    ref = copy.deepcopy(model)
    batches = [masked_batch(rows=4, seed=s) for s in range(3)]
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0)
    eng = Engine(model, budget=Budget(chunk=16 << 10, gpu="3M"), optim=Optim("adamw", lr=1e-3),
                 precision=Precision("fp32"))
    for b in batches:
        loss = eng.step(b, grad_accum=2)
        halves = [{k: v[i:i + 2] for k, v in b.items()} for i in (0, 2)]
        counts = [int((h["labels"][:, 1:] != -100).sum()) for h in halves]
        ref_loss = 0.0
        for h, c in zip(halves, counts):
            part = ref(**h).loss * (c / sum(counts))
            part.backward()
            ref_loss += float(part.detach())
        opt.step()
        opt.zero_grad()
        assert loss == pytest.approx(ref_loss, rel=1e-5)
    got = dict(eng.named_parameters_fp32())
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[n], p.detach(), rtol=1e-4, atol=1e-5, msg=n)
    eng.close()


@pytest.mark.parametrize("tiled", [False, True], ids=["own", "tiled"])
def test_eval_books_the_no_grad_losss_transients_while_it_runs(tiled, monkeypatch):
    """Engine.eval_loss on the simulated device: the ledger holds the no-grad loss's transients
    (headloss.workspace, which bench/loss_workspace.py measures against RSS) while the head
    runs, nothing after; the loss is plain PyTorch's."""
    monkeypatch.setattr(perfmodel, "HEAD_TILE_BYTES", 4 * VOCAB * 7 if tiled else 1 << 40)
    model = family_model("llama")
    ref = copy.deepcopy(model).eval()
    batch = masked_batch(rows=4)
    eng = Engine(model, budget=Budget(chunk=16 << 10, gpu="3M"), optim=Optim("adamw", lr=1e-3),
                 precision=Precision("fp32"))
    seen = []
    head = model.get_output_embeddings().register_forward_pre_hook(
        lambda *_: seen.append(eng.ledger.usage()["gpu"].get("activation", 0)))
    loss = eng.eval_loss(batch)
    head.remove()
    expected = headloss.workspace(model, batch, False)[0]
    assert seen == [expected] and expected > 0
    assert eng.ledger.usage()["gpu"].get("activation", 0) == 0
    with torch.no_grad():
        assert loss == pytest.approx(ref(**batch).loss.item(), rel=1e-6)
    eng.close()


@pytest.mark.parametrize("gpu,parts", [("3M", 1), ("1500K", 2), ("1M", 3)])
def test_an_eval_batch_larger_than_the_placement_holds_runs_in_parts(gpu, parts):
    """Trained on micro-batches of 2 rows, evaluated on 24: where the 24 rows' loss does not fit
    beside the placement, eval runs the fewest parts that do, token-weighted: the loss is the
    whole batch's in plain PyTorch, and the device budget holds."""
    model = family_model("llama")
    eng = Engine(model, budget=Budget(chunk=16 << 10, gpu=gpu), optim=Optim("adamw", lr=1e-3),
                 precision=Precision("fp32"))
    eng.step(masked_batch(rows=2))
    ref = family_model("llama").eval()
    ref.load_state_dict(dict(eng.named_parameters_fp32()), strict=False)
    calls = []
    hook = model.get_output_embeddings().register_forward_pre_hook(lambda *_: calls.append(1))
    big = masked_batch(rows=24, seed=3)
    loss = eng.eval_loss(big)
    hook.remove()
    with torch.no_grad():
        assert loss == pytest.approx(ref(**big).loss.item(), rel=1e-6)
    assert len(calls) == parts
    assert eng.ledger.peaks()["gpu"] <= parse_size(gpu)
    eng.close()


LONG = dict(h=64, i=128, layers=2, heads=4, kv=2, vocab=49152)  # a large vocabulary, a tiny body


@pytest.mark.slow
@pytest.mark.parametrize("seq, precision, lora", [(4096, "fp32", False), (8192, "bf16", False),
                                                  (4096, "fp32", True)])
def test_planned_activations_at_long_sequences_are_what_the_engine_measures(seq, precision, lora):
    """4K-8K tokens at a 49K vocabulary: the tiled loss runs (logits 0.8-1.6 GB in fp32); the
    planner's activation bytes are within 10% of the engine's measured peak, and far below what
    the full logits alone would take."""
    import transformers
    from peft import LoraConfig

    from tierwise.offload import Activations
    from tierwise.offload.plan.perfmodel import activation_bytes
    from tierwise.profiles import ModelProfile

    profile = ModelProfile(name="long", family="llama", hidden_size=LONG["h"], intermediate_size=LONG["i"],
                           num_hidden_layers=LONG["layers"], num_attention_heads=LONG["heads"],
                           num_key_value_heads=LONG["kv"], vocab_size=LONG["vocab"], max_position_embeddings=seq,
                           rope_theta=10000.0, rms_norm_eps=1e-5)
    assert 4 * seq * profile.vocab_size > perfmodel.HEAD_TILE_BYTES
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(profile.to_hf_config())
    targets = frozenset({"q_proj", "v_proj"})
    eng = Engine(model, budget=Budget(chunk=4 << 20), optim=Optim(lr=1e-4), precision=Precision(precision),
                 activations=Activations(recompute=True),
                 lora=LoraConfig(r=4, lora_alpha=8, target_modules=sorted(targets)) if lora else None)
    x = torch.randint(0, profile.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    eng.step({"input_ids": x, "labels": x})
    measured = eng.ledger.kind_peak("gpu", "activation")
    eng.close()
    planned = activation_bytes(model=profile, batch_size=1, seq_len=seq, precision=precision, checkpointing=True,
                               lora=(targets, 4) if lora else None)
    assert measured == pytest.approx(planned, rel=0.10)
    assert measured < 4 * seq * profile.vocab_size / 2


def test_without_grad_no_gradient_is_made_and_shift_labels_are_taken(monkeypatch):
    """Evaluation (no_grad) computes the loss only; a batch that brings its own shift_labels
    (transformers' loss takes them over labels) gets them."""
    model = family_model("llama")
    batch = masked_batch()
    monkeypatch.setattr(perfmodel, "HEAD_TILE_BYTES", 4 * VOCAB * 7)
    seen = []
    real = headloss.HeadLoss.apply
    monkeypatch.setattr(headloss.HeadLoss, "apply", lambda *a: seen.append(a[6]) or real(*a))  # (its `grads`)
    with torch.no_grad():
        loss = default_loss(model, batch)
    assert seen == [False]
    torch.testing.assert_close(loss, model(**batch).loss, rtol=1e-6, atol=0)
    shifted = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    shifted[0, :8] = -100  # different from what labels would give: the test can fail
    odd = dict(batch, shift_labels=shifted)
    with torch.no_grad():
        torch.testing.assert_close(default_loss(model, odd), model(**odd).loss, rtol=1e-6, atol=0)
        assert not torch.allclose(model(**odd).loss, model(**batch).loss)


def test_kept_targets_found_on_the_host_are_the_ones_the_device_would_find(monkeypatch):
    """The engine's to_device leaves the labels' host copy, keyed by their device copy: on CUDA
    the loss finds the targets it keeps there (no wait for the device to count them). Given
    those, the loss and gradients are the ones it finds itself, bit for bit."""
    from tierwise.offload.engine import batches

    torch.manual_seed(0)
    hidden = torch.randn(2, 9, 16, requires_grad=True)
    weight = torch.randn(40, 16, requires_grad=True)
    targets = torch.randint(0, 40, (18,))
    targets[::4] = -100
    found = headloss.HeadLoss.apply(hidden, weight, None, targets, None, None, True, None)
    given = headloss.HeadLoss.apply(hidden, weight, None, targets, None, None, True,
                                    (targets != -100).nonzero().squeeze(1))
    assert torch.equal(found, given)
    for a, b in zip(torch.autograd.grad(found, (hidden, weight)), torch.autograd.grad(given, (hidden, weight))):
        assert torch.equal(a, b)
    host = torch.tensor([[1, 2, -100, 3]])
    device = host.clone()  # stands in for the device copy
    monkeypatch.setattr(torch.Tensor, "to", lambda t, *a, **k: device if t is host else t.clone())
    moved = batches.to_device({"input_ids": host.clone(), "labels": host}, torch.device("cpu"))
    monkeypatch.undo()
    assert moved["labels"] is device and headloss._host.of(device) is host


def reference_stats(model, batch):
    """What TRL's SFTTrainer logs of a batch, from the model's own full logits: the mean over
    the target tokens of the next-token entropy, and of whether the label is the argmax."""
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[:, :-1].float()
    labels = batch["labels"][:, 1:]
    keep = labels != -100
    logp = torch.log_softmax(logits[keep], dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    top1 = logits[keep].argmax(-1) == labels[keep]
    return entropy.mean().item(), top1.float().mean().item(), int(keep.sum())


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("grad", [False, True])
def test_token_stats_are_trls_and_change_no_number(family, tiled, grad, monkeypatch):
    """Inside collecting() the loss also counts the target tokens' entropy and argmax hits, as
    the full logits give them (gemma2: after its soft-capping), on the tiled path and the
    model's own; the loss and gradients are the same bit for bit as without."""
    model = family_model(family)
    batch = masked_batch()
    with torch.no_grad():  # some labels the model's argmax: the accuracy is not 0
        batch["labels"][0, 6:12] = model(batch["input_ids"]).logits[0, 5:11].argmax(-1)
    entropy, top1, tokens = reference_stats(model, batch)
    assert 0 < top1 < 1
    calls = []
    monkeypatch.setattr(headloss.HeadLoss, "apply", _counting(headloss.HeadLoss.apply, calls))
    monkeypatch.setattr(perfmodel, "HEAD_TILE_BYTES", 4 * VOCAB * 7 if tiled else 1 << 40)
    with torch.set_grad_enabled(grad):
        plain_loss, plain = run(model, batch, tiled, monkeypatch) if grad else (default_loss(model, batch), {})
        with headloss.collecting() as stats:
            loss, got = run(model, batch, tiled, monkeypatch) if grad else (default_loss(model, batch), {})
    assert bool(calls) == tiled
    assert torch.equal(loss, plain_loss)
    assert got.keys() == plain.keys() and all(torch.equal(got[n], plain[n]) for n in got)
    assert int(stats.tokens) == tokens
    assert float(stats.entropy) / tokens == pytest.approx(entropy, rel=1e-5)
    assert float(stats.top1) / tokens == pytest.approx(top1, abs=1e-6)
    assert headloss.collected() is None


def test_the_loss_transients_measured_stay_within_what_is_booked():
    """bench/loss_workspace.py: peak RSS of the loss's forward and backward (the model's own and
    the tiled loss; fp32/bf16, no grad, soft-capping, token statistics, a trained head) against
    what the ledger books for it: loss_bytes as saved + perfmodel.loss_workspace. Within it, and
    near it (a model that books too much shrinks what a budget can train)."""
    import json
    import subprocess

    bench = Path(__file__).parents[1] / "bench" / "loss_workspace.py"
    proc = subprocess.run([sys.executable, str(bench), "--tile", "32M", "--tokens", "64", "--tiled-tokens", "1024",
                           "--json"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rows) == 15
    for r in rows:
        booked = r["saved"] + r["workspace"]
        assert r["peak"] <= booked + (2 << 20), r  # (2 MiB: the allocator's small blocks)
        # a trained head's saved gradient comes after its fp32 sum is gone: booked beside it
        assert r["peak"] >= (0.7 if "head" in r["case"] else 0.85) * booked, r
