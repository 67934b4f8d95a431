"""cli.data: row schemas, loss masks, error messages with line numbers, resumable batches."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tinyhf import write_jsonl  # noqa: E402

from tierwise.cli.builtin import build_tokenizer  # noqa: E402
from tierwise.cli.data import (IGNORE, Batches, DataError, DataPosition, Row, encode_row,  # noqa: E402
                      load_blocks, make_blocks, read_rows)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _loss_text(tok, ids, labels):
    return tok.decode([i for i, lab in zip(ids, labels) if lab != IGNORE])


def test_text_row_has_loss_on_every_token(tok):
    ids, labels = encode_row(Row(data={"text": "the cat sees the moon"}, where="x:1"), tok)
    assert ids == labels and ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id


def test_prompt_completion_masks_the_prompt(tok):
    row = Row(data={"prompt": "the cat sees", "completion": " the moon"}, where="x:1")
    ids, labels = encode_row(row, tok)
    n_prompt = len(tok("the cat sees")["input_ids"])
    assert labels[:n_prompt] == [IGNORE] * n_prompt
    assert labels[n_prompt:] == ids[n_prompt:]
    assert _loss_text(tok, ids, labels) == " the moon</s>"


def test_chat_loss_only_on_assistant_turns(tok):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi cat"},
            {"role": "assistant", "content": "the dog"}, {"role": "user", "content": "more"},
            {"role": "assistant", "content": "a red bird"}]
    ids, labels = encode_row(Row(data={"messages": msgs}, where="x:1"), tok)
    text = _loss_text(tok, ids, labels)
    assert "the dog</s>" in text and "a red bird</s>" in text
    assert "hi cat" not in text and "be brief" not in text and "<|assistant|>" not in text


#: Qwen3's way: only the last assistant turn gets the (empty) thinking block, so a turn renders
#: otherwise once later turns follow; and a template that rewrites earlier turns' text.
LAST_THINKS = ("{%- for m in messages %}{%- if m.role == 'assistant' and loop.last %}"
               "{{ '<|assistant|>\\n<think>\\n\\n</think>\\n\\n' + m.content + eos_token }}"
               "{%- else %}{{ '<|' + m.role + '|>\\n' + m.content + eos_token }}{%- endif %}{%- endfor %}"
               "{%- if add_generation_prompt %}{{ '<|assistant|>\\n<think>\\n\\n</think>\\n\\n' }}{%- endif %}")
REWRITES = ("{%- for m in messages %}{%- if m.role == 'assistant' and not loop.last %}"
            "{{ '<|assistant|>\\n' + m.content[:3] + eos_token }}"
            "{%- else %}{{ '<|' + m.role + '|>\\n' + m.content + eos_token }}{%- endif %}{%- endfor %}"
            "{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}{%- endif %}")


def test_chat_turns_a_template_renders_otherwise_later_are_found_by_their_text(tok, caplog):
    """Both assistant turns train under a Qwen3-style template (they fell back to the last one
    silently); a template that rewrites earlier turns' text falls back, and says so once."""
    msgs = [{"role": "user", "content": "hi cat"}, {"role": "assistant", "content": "the dog"},
            {"role": "user", "content": "more"}, {"role": "assistant", "content": "a red bird"}]
    tok.chat_template = LAST_THINKS
    ids, labels = encode_row(Row(data={"messages": msgs}, where="x:1"), tok)
    assert _loss_text(tok, ids, labels) == "the dog</s>a red bird</s>"
    tok.chat_template = REWRITES
    with caplog.at_level("WARNING", logger="tierwise.cli.data"):
        blocks = make_blocks([Row(data={"messages": msgs}, where="x:1"), Row(data={"text": "a cat"}, where="x:2")],
                             tok, seq_len=64, pack=False)
    assert _loss_text(tok, blocks[0][0].tolist(), blocks[0][1].tolist()) == "a red bird</s>"
    assert "chat loss: 1 of 1 conversations (e.g. x:1) train only on what follows their last user turn" \
        in caplog.text
    tok.chat_template = LAST_THINKS  # an empty turn (a tool call's) trains nothing; the rest is found
    calls = [msgs[0], {"role": "assistant", "content": ""}, {"role": "tool", "content": "the moon"}, msgs[3]]
    ids, labels = encode_row(Row(data={"messages": calls}, where="x:3"), tok)
    assert _loss_text(tok, ids, labels) == "a red bird</s>"


@pytest.mark.parametrize("line, message", [
    ('{"text": "ok"}\n{"text": "broken"', "(at the end of the line, near '{\"text\": \"broken\"')"),
    ('[{"text": "a"},\n{"text": "b"}]', ": a JSON array; the data is JSONL"),
    ('{"text": "ok"}\n\n{"foo": 1}', ":3: unknown schema with keys ['foo']"),
    ('[1, 2]', ":1: expected a JSON object"),
    ('{"prompt": "only a prompt"}', ":1: 'prompt' and 'completion' must both be strings"),
    ('{"messages": [{"role": "user"}]}',
     """:1: 'messages' must be a non-empty list of {"role": str, "content": str} objects"""),
    ('{"text": 3}', ":1: 'text' must be a string"),
], ids=["bad-json", "json-array", "unknown-schema", "not-object", "prompt-only", "bad-messages", "text-int"])
def test_errors_name_file_and_line(tmp_path, tok, line, message):
    path = tmp_path / "d.jsonl"
    path.write_text(line)
    with pytest.raises(DataError) as e:
        load_blocks(path, tok, seq_len=16)
    assert str(e.value).startswith(str(path)) and message in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_and_empty_files(tmp_path, tok):
    with pytest.raises(DataError, match="data file not found"):
        read_rows(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="no examples"):
        read_rows(tmp_path / "empty.jsonl")


def test_dataset_dir_without_datasets_says_how_to_install(tmp_path, tok, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails even if installed
    with pytest.raises(DataError, match="pip install datasets"):
        read_rows(tmp_path)


def test_packing_and_truncation(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "the cat sees the moon " * 3}] * 5)
    packed = load_blocks(path, tok, seq_len=16)
    assert all(b[0].shape == (16,) for b in packed)
    assert int(sum(b[2].sum() for b in packed)) == 5 * len(encode_row(
        Row(data={"text": "the cat sees the moon " * 3}, where=""), tok)[0])
    single = load_blocks(path, tok, seq_len=8, pack=False)
    assert len(single) == 5 and all(int(b[2].sum()) == 8 for b in single)
    short = make_blocks([Row(data={"text": "hi"}, where="")], tok, seq_len=16, pack=False)[0]
    assert (short[1][short[2] == 0] == IGNORE).all()


def test_blocks_without_a_target_token_are_left_out(tmp_path, tok):
    """Packed chat rows cut blocks that are all prompt; a step of only such blocks has no
    loss (HF's mean over 0 tokens is nan). Every block kept has a target after the shift, and
    together they keep every target token of the data."""
    chat = [{"messages": [{"role": "user", "content": f"what is {i} and the cat"},
                          {"role": "assistant", "content": "a moon"}]} for i in range(24)]
    path = write_jsonl(tmp_path / "chat.jsonl", chat)
    blocks = load_blocks(path, tok, seq_len=8)
    assert all(int((b[1][1:] != IGNORE).sum()) > 0 for b in blocks)
    rows = [encode_row(Row(data=r, where=""), tok)[1] for r in chat]
    stream = [lab for labels in rows for lab in labels]
    kept = sum(int((b[1] != IGNORE).sum()) for b in blocks)
    dropped_first = sum(1 for i in range(0, len(stream), 8)  # a block's only target at 0: left out
                        if stream[i] != IGNORE and all(x == IGNORE for x in stream[i + 1:i + 8]))
    assert kept == sum(lab != IGNORE for lab in stream) - dropped_first
    long_prompt = {"prompt": "the cat sees the moon " * 4, "completion": " hi"}
    with pytest.raises(DataError, match="no target token"):
        Batches(make_blocks([Row(data=long_prompt, where="")], tok, seq_len=8, pack=False), batch_size=1, seed=0)
    from typer.testing import CliRunner
    from tinyhf import error_line
    from tierwise.cli.main import app

    only_prompts = write_jsonl(tmp_path / "prompts.jsonl", [long_prompt])
    result = CliRunner().invoke(app, ["--data", str(only_prompts), "--seq-len", "8", "--no-pack",
                                      "--output", str(tmp_path / "o")])
    assert error_line(result).startswith("error: no training blocks:"), result.stderr


def test_batches_are_deterministic_and_resume_exactly(tok):
    blocks = load_blocks(None, tok, seq_len=32)
    a = Batches(blocks, batch_size=4, seed=7)
    first = [a.next()["input_ids"] for _ in range(a.batches_per_epoch + 3)]  # crosses an epoch
    assert a.position.epoch == 1
    b = Batches(blocks, batch_size=4, seed=7)
    for _ in range(5):
        b.next()
    resumed = Batches(blocks, batch_size=4, seed=7,
                      position=DataPosition.from_dict(b.position.to_dict()))
    rest = [resumed.next()["input_ids"] for _ in range(len(first) - 5)]
    assert all(torch.equal(x, y) for x, y in zip(first[5:], rest))
    other = Batches(blocks, batch_size=4, seed=8).next()["input_ids"]
    assert not torch.equal(first[0], other)


def test_fewer_blocks_than_batch_size_wraps(tok):
    blocks = make_blocks([Row(data={"text": "the cat"}, where="")], tok, seq_len=8)
    batch = Batches(blocks, batch_size=3, seed=0).next()
    assert batch["input_ids"].shape == (3, 8)


@pytest.mark.parametrize("data, message", [
    ({"text": "the cat sees the moon"}, ":1: the model's tokenizer has no eos_token"),
    ({"prompt": "the cat", "completion": " sees"}, ":1: the model's tokenizer has no eos_token"),
], ids=["text", "prompt"])
def test_tokenizer_without_eos_or_pad_is_one_line(tmp_path, data, message):
    """A model directory whose tokenizer_config.json names no eos_token and no pad_token: every
    text row ends with eos and short blocks pad with pad (else eos), so the run is refused in
    one line (exit 2), as transformers loads that tokenizer (eos_token_id None); was a TypeError
    traceback from torch.tensor([..., None])."""
    import json

    from typer.testing import CliRunner

    from tinyhf import error_line, make_tiny_llama_dir
    from tierwise.cli.main import app
    from transformers import AutoTokenizer

    model = make_tiny_llama_dir(tmp_path / "m", hidden=32)
    config = json.loads((model / "tokenizer_config.json").read_text())
    del config["eos_token"], config["pad_token"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = AutoTokenizer.from_pretrained(model)
    assert loaded.eos_token_id is None and loaded.pad_token_id is None
    train = write_jsonl(tmp_path / "d.jsonl", [data] * 4)
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["--model", str(model), "--data", str(train), "--seq-len", "16",
                                      "--batch-size", "2", "--steps", "1", "--output", str(out)])
    assert error_line(result) == f"error: {train}{message}, which ends every " \
        f"{'text' if 'text' in data else 'prompt/completion'} row: set eos_token in its tokenizer_config.json"
    assert not out.exists() or not any(out.iterdir())


def test_short_block_without_pad_or_eos_token_is_refused(tmp_path):
    """Chat rows need no eos (a template may end turns its own way), but a short block still
    pads: refused in one line rather than a TypeError."""
    import json

    from tinyhf import make_tiny_llama_dir
    from transformers import AutoTokenizer

    model = make_tiny_llama_dir(tmp_path / "m", hidden=32)
    config = json.loads((model / "tokenizer_config.json").read_text())
    del config["eos_token"], config["pad_token"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    rows = [Row(data={"messages": [{"role": "user", "content": "hi"},
                                   {"role": "assistant", "content": "the cat"}]}, where="x:1")]
    with pytest.raises(DataError, match="neither a pad_token nor an eos_token"):
        make_blocks(rows, tok, seq_len=64)


def test_eval_data_with_no_target_token_is_one_line(tmp_path):
    """--eval-data whose every block is a masked prompt (prompts longer than --seq-len, not
    packed): the eval set is empty, as it is for transformers' loss (no label but -100), so the
    run is refused in one line instead of training without any eval and saying nothing."""
    from typer.testing import CliRunner

    from tinyhf import error_line, make_tiny_llama_dir
    from tierwise.cli.data import eval_batches
    from tierwise.cli.main import app
    from transformers import AutoTokenizer

    model = make_tiny_llama_dir(tmp_path / "m", hidden=32)
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": "the cat sees the moon"}] * 8)
    ev = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "the cat sees the moon " * 20,
                                                "completion": " yes"}] * 3)
    tok = AutoTokenizer.from_pretrained(model)
    ids = tok("the cat sees the moon " * 20)["input_ids"]
    assert len(ids) > 16  # every block of 16 tokens is all prompt: no label to score
    assert eval_batches(load_blocks(ev, tok, seq_len=16, pack=False), batch_size=2) == []
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["--model", str(model), "--data", str(train), "--eval-data", str(ev),
                                      "--no-pack", "--seq-len", "16", "--batch-size", "2", "--steps", "1",
                                      "--output", str(out)])
    assert error_line(result).startswith(f"error: --eval-data {ev}: no block with a target token")


def test_a_byte_order_mark_opening_the_file_is_not_data(tmp_path):
    """A JSONL file saved with a UTF-8 BOM (Windows editors) reads as the same rows as without
    it, compared with json.loads of the text without the mark; a BOM inside the file, on a later
    line, stays an error (it is no JSON there)."""
    rows = [{"text": "one"}, {"prompt": "a", "completion": "b"}]
    body = "\n".join(json.dumps(r) for r in rows) + "\n"
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + body.encode())
    assert [r.data for r in read_rows(tmp_path / "bom.jsonl")] == [json.loads(line) for line in body.splitlines()]
    (tmp_path / "late.jsonl").write_bytes(body.encode() + b"\xef\xbb\xbf" + json.dumps(rows[0]).encode() + b"\n")
    with pytest.raises(DataError, match="late.jsonl:3: bad JSON"):
        read_rows(tmp_path / "late.jsonl")


def test_a_long_document_does_not_warn_of_the_tokenizers_length(monkeypatch):
    """A document longer than the tokenizer's model_max_length is cut into blocks here: the
    tokenizer's warning that its ids would overflow the model misled (printed per tokenizer)."""
    from transformers import tokenization_utils_base as base

    said = []
    monkeypatch.setattr(base.logger, "warning", lambda msg, *a, **k: said.append(str(msg)))
    tok = build_tokenizer()
    tok.model_max_length = 16
    ids, _ = encode_row(Row(data={"text": "word " * 200}, where="<0>"), tok)
    assert len(ids) > 16 and not [m for m in said if "Token indices sequence length" in m]
    tok.deprecation_warnings.clear()  # the test can fail: the tokenizer itself warns
    tok("word " * 200)
    assert [m for m in said if "Token indices sequence length" in m]
