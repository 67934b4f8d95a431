"""Packed rows do not attend across each other: in a packed block, every row's loss (and its
gradient contribution) is the row's loss run alone, on every family cli.data.ISOLATING names;
a family outside it packs as before and says so."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tinyhf import FAMILIES, family_config, make_tiny_family_dir  # noqa: E402

from tierwise.cli.builtin import build_tokenizer  # noqa: E402
from tierwise.cli.data import IGNORE, ISOLATING, Row, batch_of, has_padding, isolates, make_blocks  # noqa: E402
from tierwise.cli.packing import use_segments  # noqa: E402
from tierwise.offload.plan import perfmodel  # noqa: E402

VOCAB = 288
ROWS = ["the cat sat on the mat", "a dog", "streams of chunks move between the tiers of memory",
        "one more row that is cut across two blocks of sixteen tokens each"]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(vocab_size=VOCAB)


def model_of(family, tok):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(family_config(family, vocab_size=VOCAB, tokenizer=tok)).eval()


def token_losses(model, batch) -> torch.Tensor:
    """Per-position loss (the model's logits at t against labels at t+1), 0 where masked."""
    keep = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**keep).logits.float()
    labels = batch["labels"][:, 1:]
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                             labels.clamp(min=0).reshape(-1), reduction="none")
    return (loss * (labels != IGNORE).reshape(-1)).reshape(labels.shape)


class SdpaMasks:
    """Records the attn_mask of every SDPA call."""

    def __init__(self, monkeypatch):
        self.masks: list = []
        self.sdpa = sdpa = torch.nn.functional.scaled_dot_product_attention

        def spy(*args, **kwargs):
            self.masks.append(kwargs.get("attn_mask"))
            return sdpa(*args, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)


@pytest.mark.parametrize("segments", [False, True], ids=["mask", "segments"])
@pytest.mark.parametrize("family", sorted(f for f in FAMILIES if family_config(f).model_type in ISOLATING))
def test_each_packed_row_trains_as_it_would_alone(family, segments, tok, monkeypatch):
    model = model_of(family, tok)
    sdpa = model.config._attn_implementation == "sdpa"
    if segments:
        assert use_segments(model) == sdpa  # (gemma2 attends eagerly: unchanged)
        monkeypatch.setattr(perfmodel, "SEGMENTS_FROM", 2)  # (rows this short take the mask otherwise)
    rows = [Row(data={"text": t}, where=f"<{i}>") for i, t in enumerate(ROWS)]
    packed = make_blocks(rows, tok, seq_len=16, isolate=True)
    assert len(packed) >= 2 and all(len(b) == 4 for b in packed)
    spy = SdpaMasks(monkeypatch)
    with torch.no_grad():
        got = token_losses(model, batch_of(packed))
    if sdpa:  # per segment: no dense mask at all (a window's band at most); else transformers' block-causal one
        dense = [m is not None and m.shape[-1] == 16 for m in spy.masks]
        assert spy.masks and (not any(dense)) == segments
    monkeypatch.undo()
    with torch.no_grad():
        # each row alone: its tokens from the same blocks, one segment at a time
        want = torch.zeros_like(got)
        for i, block in enumerate(packed):
            pos = block[3]
            starts = [0] + [j for j in range(1, len(pos)) if pos[j] != pos[j - 1] + 1] + [len(pos)]
            for a, b in zip(starts, starts[1:]):
                if not bool(block[2][a:b].any()):
                    continue  # the padding segment
                alone = {"input_ids": block[0][None, a:b], "labels": block[1][None, a:b], "use_cache": False}
                if b - a > 1:
                    want[i, a:b - 1] = token_losses(model, alone)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # without isolation the same blocks' losses differ: the test can fail
    joined = make_blocks(rows, tok, seq_len=16)
    with torch.no_grad():
        crossed = token_losses(model, batch_of(joined))
    assert not torch.allclose(crossed[crossed != 0], got[crossed != 0], atol=1e-4)


def test_a_rows_first_token_is_not_a_target_and_positions_restart(tok):
    rows = [Row(data={"text": t}, where="") for t in ROWS[:2]]
    ids, labels, mask, pos = make_blocks(rows, tok, seq_len=32, isolate=True)[0]
    first = len(tok(ROWS[0])["input_ids"]) + 1  # (+ eos)
    assert pos[0] == 0 and pos[first] == 0 and pos[first - 1] == first - 1
    assert labels[first] == IGNORE and labels[first + 1] == ids[first + 1]
    assert has_padding([(ids, labels, mask, pos)])  # several rows: the block needs a mask


def test_a_family_that_does_not_isolate_packs_as_before_and_says_so(caplog, monkeypatch):
    import tierwise.cli.packing

    monkeypatch.setattr(tierwise.cli.packing, "_told", set())  # (said once a process)

    class Config:
        model_type = "opt"

    with caplog.at_level("WARNING"):
        assert not isolates(Config())
    assert "attend to the ones before them" in caplog.text
    assert not isolates(Config(), pack=False)
    assert isolates(family_config("llama"))


def test_the_plan_says_how_rows_are_packed():
    from typer.testing import CliRunner

    from tierwise.cli.main import app

    r = CliRunner().invoke(app, ["plan", "--gpu-mem", "16M"])
    assert r.exit_code == 0, r.output
    assert "packing: each document attends only to itself" in r.stderr
    # a --no-pack run is planned with its own flag: padded rows, no per-row positions
    import json

    plans = [json.loads(CliRunner().invoke(app, ["plan", "--gpu-mem", "16M", "--json", *flag]).stdout)
             for flag in ([], ["--no-pack"])]
    assert plans[0]["row_positions"] and not plans[1]["row_positions"]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("isolate", [False, True], ids=["joined", "isolated"])
def test_padding_needs_no_mask(family, isolate, tok, monkeypatch):
    """A short block is padded on the right: without the mask (batch_of's batch) every real
    token's loss is the masked batch's, and no dense mask is built."""
    model = model_of(family, tok)
    use_segments(model)
    monkeypatch.setattr(perfmodel, "SEGMENTS_FROM", 2)  # (its two rows: per segment, at this length too)
    rows = [Row(data={"text": t}, where=f"<{i}>") for i, t in enumerate(ROWS[:2])]
    blocks = make_blocks(rows, tok, seq_len=32, isolate=isolate)
    assert len(blocks) == 1 and not bool(blocks[0][2].all())
    batch = batch_of(blocks)
    assert "attention_mask" not in batch
    masked = {"input_ids": batch["input_ids"], "labels": batch["labels"], "attention_mask": blocks[0][2][None]}
    if isolate:  # the padding goes on from the last row: not a segment of its own
        n = int(blocks[0][2].sum())
        assert batch["position_ids"][0, n:].tolist() == list(range(blocks[0][3][n - 1] + 1, blocks[0][3][n - 1] + 33 - n))
        masked = {**batch, "attention_mask": None, "position_ids": torch.stack([blocks[0][3]])}  # padding a segment
    spy = SdpaMasks(monkeypatch)
    with torch.no_grad():
        got = token_losses(model, batch)
    assert spy.masks and all(m is None for m in spy.masks)
    monkeypatch.undo()
    with torch.no_grad():
        want = token_losses(model, masked)
    real = batch["labels"][:, 1:] != IGNORE
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)
    # planned as a dense mask only where the CLI would keep it (isolated rows never carry one)
    assert not has_padding(blocks, segments=True) and has_padding(blocks, mask=True, segments=True) == (not isolate)


def test_a_model_that_hides_position_ids_from_its_attention_is_refused():
    from tierwise.offload.engine.segments import CAUSAL, _attention

    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(NotImplementedError, match="position_ids"):
        _attention(torch.nn.Module(), q, q, q, CAUSAL)


def test_with_a_cache_the_attention_is_transformers_own(tok):
    """Tokens fed over a KV cache (a chunked prefill) attend as with transformers' SDPA: the
    per-segment path is for the queries that are the keys only."""
    model = model_of("llama", tok)
    ref = model_of("llama", tok)
    assert use_segments(model)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        outs = []
        for m in (model, ref):
            first = m(input_ids=ids[:, :8], use_cache=True)
            outs.append(m(input_ids=ids[:, 8:], past_key_values=first.past_key_values, use_cache=True).logits)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-6)


@pytest.mark.parametrize("config", [
    dict(model_type="gemma3_text", sliding_window=4, kv=2), dict(model_type="gemma3_text", sliding_window=5, kv=4),
    dict(model_type="mistral", sliding_window=3, kv=1), dict(model_type="mistral", sliding_window=7, kv=2)],
    ids=lambda c: f"{c['model_type']}-w{c['sliding_window']}-kv{c['kv']}")
def test_a_window_is_attended_in_blocks_as_through_its_dense_mask(config, monkeypatch):
    """A sliding window shorter than a long row: blocks of `window` queries over the keys each
    reaches, with a band mask, equal to transformers' SDPA through its S x S mask (fp64:
    logits and every gradient, at row lengths a multiple of the window and not), and packed
    rows each as alone; no SDPA call takes a mask wider than 2 x window - 1."""
    import copy

    import transformers

    kind, window, kv = config["model_type"], config["sliding_window"], config["kv"]
    cls = transformers.Gemma3TextConfig if kind == "gemma3_text" else transformers.MistralConfig
    extra = dict(sliding_window_pattern=2, head_dim=8) if kind == "gemma3_text" else {}
    cfg = cls(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=kv, sliding_window=window, attn_implementation="sdpa", **extra)

    def model():  # (each its own config: use_segments sets the attention on it)
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg)).double()

    ref, mine = model(), model()
    assert use_segments(mine) and ref.config._attn_implementation == "sdpa"
    monkeypatch.setattr(perfmodel, "SEGMENTS_FROM", 2)
    for seq in (4 * window, 4 * window + 3):
        x = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(seq))
        spy = SdpaMasks(monkeypatch)
        got = mine(input_ids=x, labels=x)
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy.sdpa)
        want = ref(input_ids=x, labels=x)
        assert spy.masks and all(m is None or m.shape[-1] < 2 * window for m in spy.masks)
        torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=1e-12)
        mine.zero_grad(), ref.zero_grad()
        got.loss.backward(), want.loss.backward()
        for (name, a), b in zip(mine.named_parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12, msg=name)
    x = torch.randint(0, VOCAB, (1, 6 * window), generator=torch.Generator().manual_seed(0))
    cut = 2 * window + 1  # two documents, each longer than the window
    packed = mine(input_ids=x, position_ids=torch.cat([torch.arange(cut), torch.arange(6 * window - cut)])[None]).logits
    alone = torch.cat([ref(input_ids=x[:, :cut]).logits, ref(input_ids=x[:, cut:]).logits], dim=1)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-12)


def test_alibi_and_short_windows_keep_their_mask(tmp_path, monkeypatch):
    """ALiBi adds its bias to the mask it gets: such a model keeps transformers' SDPA. A sliding
    window shorter than the row is no padded batch: the planner prices each sliding layer's
    mask, or its blocks (perfmodel.activation_parts)."""
    import dataclasses

    from transformers import FalconConfig, FalconForCausalLM

    from tierwise.cli.config import TrainConfig
    from tierwise.cli.loading import resolve_model
    from tierwise.cli.planning import data_padded

    alibi = FalconForCausalLM(FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                           alibi=True, new_decoder_architecture=False, multi_query=True))
    assert not use_segments(alibi) and alibi.config._attn_implementation == "sdpa"
    monkeypatch.setattr(perfmodel, "SEGMENTS_FROM", 2)
    src = resolve_model(str(make_tiny_family_dir(tmp_path / "mistral", "mistral")))
    window = src.config.sliding_window
    cfg = TrainConfig(model=str(tmp_path / "mistral"), batch_size=1, seq_len=window)
    assert not data_padded(cfg, src)  # packed rows per segment, the window as long as the row
    assert not data_padded(dataclasses.replace(cfg, seq_len=window + 1), src)


def test_short_packed_rows_take_the_mask_long_ones_segments(tok, monkeypatch):
    """Below perfmodel.SEGMENTS_FROM tokens a packed row takes transformers' mask (one SDPA call a
    layer); from it on, one call per segment and no mask. The plan follows the same rule."""
    from tierwise.cli.config import TrainConfig
    from tierwise.cli.planning import attends_segments

    model = model_of("llama", tok)
    use_segments(model)
    rows = [Row(data={"text": t}, where=f"<{i}>") for i, t in enumerate(ROWS)]
    batch = batch_of(make_blocks(rows, tok, seq_len=16, isolate=True))
    for threshold, masked in ((17, True), (16, False)):
        monkeypatch.setattr(perfmodel, "SEGMENTS_FROM", threshold)
        spy = SdpaMasks(monkeypatch)
        with torch.no_grad():
            model(**{k: v for k, v in batch.items() if k != "labels"})
        assert spy.masks and all(m is not None for m in spy.masks) == masked
        assert attends_segments(TrainConfig(model="llama-8b", seq_len=16), None) == (not masked)


def test_segments_of_a_batch_moved_to_the_device_come_from_its_host_copy(monkeypatch):
    """The engine's to_device leaves the segments found from the host's position ids, keyed by
    the device copy: the attention never reads them back from the device (on CUDA, a wait for
    it). Stood in for here by a copy whose contents differ: its own segments are never read.
    Ids broadcast over the rows give each row the same segments."""
    from tierwise.offload.engine import batches, segments

    monkeypatch.setattr(perfmodel, "SEGMENTS_FROM", 8)
    host = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0]])
    device = torch.arange(8).view(1, 8)  # one segment, were it read
    monkeypatch.setattr(torch.Tensor, "to", lambda t, *a, **k: device if t is host else t.clone())
    moved = batches.to_device({"input_ids": host.clone(), "position_ids": host}, torch.device("cpu"))
    assert moved["position_ids"] is device
    monkeypatch.undo()
    monkeypatch.setattr(segments, "_find", lambda ids: pytest.fail("segments read from the device"))
    assert segments.last.of(device, 2) == [[(0, 3), (3, 7), (7, 8)]] * 2


@pytest.mark.parametrize("lora", [None, ("q_proj", "v_proj"), ("q_proj", "o_proj")], ids=["full", "qv", "qo"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3"])
def test_long_packed_rows_per_segment_are_planned_as_measured(family, precision, lora):
    """4,096 tokens of eight 512-token rows, attended per segment through the engine (every
    block recomputed): the planner's activation bytes (row_positions, the segments' joined
    output included, which a LoRA run saves only where o_proj is a target) are the engine's
    measured peak, to the byte (Phi-3: its fused qkv_proj for q, k and v)."""
    if family == "phi3" and lora is not None:
        lora = tuple(dict.fromkeys("qkv_proj" if t in ("q_proj", "v_proj") else t for t in lora))
    import transformers

    from tierwise.offload import Activations, Budget, Engine, Optim, Precision
    from tierwise.offload.plan.perfmodel import activation_bytes
    from tierwise.profiles import ModelProfile

    seq = perfmodel.SEGMENTS_FROM
    profile = ModelProfile(name="packed", family=family, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=64, max_position_embeddings=seq,
                           rope_theta=10000.0, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(profile.to_hf_config())
    assert use_segments(model)
    from peft import LoraConfig

    extra = {} if lora is None else {"lora": LoraConfig(r=4, lora_alpha=8, target_modules=list(lora))}
    eng = Engine(model, budget=Budget(chunk=4 << 20), optim=Optim(lr=1e-4), precision=Precision(precision),
                 activations=Activations(recompute=True), **extra)
    x = torch.randint(0, 64, (1, seq), generator=torch.Generator().manual_seed(0))  # (a small head: the
    try:  # peak is a block's recompute)
        eng.step({"input_ids": x, "labels": x, "position_ids": (torch.arange(seq) % 512)[None], "use_cache": False})
        measured = eng.ledger.kind_peak("gpu", "activation")
    finally:
        eng.close()
    assert measured == activation_bytes(model=profile, batch_size=1, seq_len=seq, precision=precision,
                                        checkpointing=True, row_positions=True,
                                        lora=None if lora is None else (frozenset(lora), 4))
