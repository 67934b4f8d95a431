"""Every bad input is one `error:` line and exit 2, never a traceback, a prompt or silence.
On the old code each case below was a traceback, a MemoryError, an interactive
"run the custom code? [y/N]" prompt, or accepted silently (NaN learning rate, `steps = true`,
chat rows whose loss then fell on every token, /dev/zero read until the OOM killer)."""

from __future__ import annotations

import json
import struct
import sys
import tracemalloc
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
from tinyhf import StandInEngine, make_tiny_llama_dir, write_jsonl, error_line as _error_line  # noqa: E402

import tierwise.cli.data  # noqa: E402
import tierwise.cli.train  # noqa: E402
from tierwise.cli.data import DataError, read_rows  # noqa: E402
from tierwise.cli.main import app  # noqa: E402


@pytest.fixture
def runner(monkeypatch):
    monkeypatch.setattr(tierwise.cli.train, "engine_class", lambda: StandInEngine)
    return CliRunner()




@pytest.mark.parametrize("args,expected", [
    (["--seed", "-1"], "--seed must be in 0..4294967295"),
    (["--seed", str(2**32)], "--seed must be in 0..4294967295"),
    (["--lr", "nan"], "--lr must be a positive number, got nan"),
    (["--lr", "inf"], "--lr must be a positive number, got inf"),
    (["--grad-clip", "nan"], "--grad-clip must be a positive number"),
    (["--grad-clip", "-1"], "--grad-clip must be a positive number"),
    (["--weight-decay", "nan"], "--weight-decay must be 0 or a positive number"),
    (["--weight-decay", "-0.1"], "--weight-decay must be 0 or a positive number"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_numbers_are_refused(runner, tmp_path, args, expected):
    assert expected in _error_line(runner.invoke(app, [*args, "--output", str(tmp_path / "o")]))


@pytest.mark.parametrize("text,expected", [
    ("steps = true\n", "steps = true: expected a whole number"),
    ('lr = "big"\n', 'lr = "big": expected a number'),
    ("gpu-mem = 24\n", 'gpu-mem = 24: expected a size in quotes, e.g. "24G"'),
    ("recompute = 1\n", "recompute = 1: expected true or false"),
])
def test_toml_values_of_the_wrong_type_are_refused(runner, tmp_path, text, expected):
    toml = tmp_path / "run.toml"
    toml.write_text(text)
    assert expected in _error_line(runner.invoke(app, ["--config", str(toml), "--output", str(tmp_path / "o")]))


def test_a_binary_config_file_is_refused(runner, tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_bytes(b"\x7fELF\x02\x01\x01\x00\x00\x00\xff\xfe\x00")
    assert "not a TOML text file" in _error_line(runner.invoke(app, ["--config", str(toml)]))


# -- model directories --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_llama_dir(tmp_path_factory.mktemp("m") / "tiny", hidden=32)


def _copy(tiny: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(tiny, dst)
    return dst


def _set_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **changes}))


@pytest.mark.parametrize("case,expected", [
    ("empty", "config.json: empty file"),
    ("not-json", "config.json: not valid JSON"),
    ("unknown-type", "unknown model_type 'llamaX'"),
    ("custom-code", "ships its own Python code"),
    ("header-length", "corrupt safetensors header (it claims 1099511627776 bytes"),
])
def test_bad_model_directories_are_one_line(runner, tiny, tmp_path, case, expected):
    d = _copy(tiny, tmp_path / case)
    if case == "empty":
        (d / "config.json").write_text("")
    elif case == "not-json":
        (d / "config.json").write_text("{oops")
    elif case == "unknown-type":
        _set_config(d, model_type="llamaX")
    elif case == "custom-code":
        _set_config(d, auto_map={"AutoConfig": "configuration_x.XConfig",
                                 "AutoModelForCausalLM": "modeling_x.XForCausalLM"})
        (d / "configuration_x.py").write_text("raise SystemExit('custom code ran')\n")
    else:
        p = d / "model.safetensors"
        raw = bytearray(p.read_bytes())
        raw[:8] = struct.pack("<Q", 1 << 40)
        p.write_bytes(bytes(raw))
    r = runner.invoke(app, ["--model", str(d), "--output", str(tmp_path / "o")], input="y\n")
    assert expected in _error_line(r)
    assert "run the custom code" not in r.output


# -- data ------------------------------------------------------------------------------------

def test_invalid_utf8_names_the_line(runner, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    assert f"{data}:2: not UTF-8 text" in _error_line(runner.invoke(app, ["--data", str(data)]))


@pytest.mark.parametrize("messages,expected", [
    ([{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}], ":2: unknown chat role 'bot'"),
    ([{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}], ":2: no 'assistant' turn"),
], ids=["unknown-role", "no-assistant"])
def test_chat_rows_that_would_train_on_every_token_are_refused(runner, tmp_path, messages, expected):
    ok = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    data = write_jsonl(tmp_path / "chat.jsonl", [ok, {"messages": messages}])
    line = _error_line(runner.invoke(app, ["--data", str(data), "--output", str(tmp_path / "o")]))
    assert f"{data}{expected}" in line


def test_a_line_longer_than_the_cap_is_refused_with_its_number(runner, tmp_path, monkeypatch):
    monkeypatch.setattr(tierwise.cli.data, "MAX_ROW_BYTES", 1 << 10)
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "short"}, {"text": "x" * 5000}])
    assert f"{data}:2: line longer than" in _error_line(runner.invoke(app, ["--data", str(data)]))


def test_dev_zero_is_refused_within_a_memory_bound():
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match="/dev/zero:1: line longer than 64 MiB"):
            read_rows("/dev/zero")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * tierwise.cli.data.MAX_ROW_BYTES, peak


def _custom_code_model(tiny: Path, d: Path) -> Path:
    """`tiny` with its own (Llama-derived) config and model classes, named in auto_map."""
    _copy(tiny, d)
    _set_config(d, model_type="xllama", auto_map={"AutoConfig": "configuration_x.XConfig",
                                                  "AutoModelForCausalLM": "modeling_x.XForCausalLM"})
    (d / "configuration_x.py").write_text(
        "from transformers import LlamaConfig\n\n\n"
        "class XConfig(LlamaConfig):\n    model_type = 'xllama'\n")
    (d / "modeling_x.py").write_text(
        "from transformers import LlamaForCausalLM\n\nfrom .configuration_x import XConfig\n\n\n"
        "class XForCausalLM(LlamaForCausalLM):\n    config_class = XConfig\n    ran = True\n")
    return d


def test_trust_remote_code_runs_the_models_own_code(runner, tiny, tmp_path, monkeypatch):
    import transformers.dynamic_module_utils as dyn

    monkeypatch.setattr(dyn, "HF_MODULES_CACHE", str(tmp_path / "modules"))  # not ~/.cache
    d = _custom_code_model(tiny, tmp_path / "custom")
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "hello world"}] * 8)
    args = ["--model", str(d), "--data", str(data), "--steps", "1", "--seq-len", "16"]
    refused = _error_line(runner.invoke(app, [*args, "--output", str(tmp_path / "o1")], input="y\n"))
    assert "add --trust-remote-code" in refused
    built = []
    real = tierwise.cli.train.build_meta_model
    monkeypatch.setattr(tierwise.cli.train, "build_meta_model",
                        lambda config: built.append(real(config)) or built[-1])
    r = runner.invoke(app, [*args, "--trust-remote-code", "--output", str(tmp_path / "o2")])
    assert r.exit_code == 0, (r.output, r.exception)
    assert type(built[0]).__name__ == "XForCausalLM" and built[0].ran  # the model's own class
    assert "run the custom code" not in r.output


def _transient_bytes(path: Path, tok) -> int:
    """Python memory load_blocks held at its peak beyond what its result keeps."""
    tracemalloc.start()
    try:
        blocks = tierwise.cli.data.load_blocks(path, tok, seq_len=32)
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert blocks
    return peak - current


def test_data_is_read_and_tokenized_as_a_stream(tmp_path):
    """The memory reading and tokenizing takes besides the blocks does not grow with the file:
    a 4x longer file, the same bound (the old reader held every row and its tokens: 4x)."""
    from tierwise.cli.builtin import build_tokenizer

    tok = build_tokenizer()
    sizes = {}
    for n in (150, 600):
        rows = [{"text": f"row {i}: the tiny model streams chunk {i % 7}"} for i in range(n)]
        sizes[n] = _transient_bytes(write_jsonl(tmp_path / f"d{n}.jsonl", rows), tok)
    assert sizes[600] < 64 << 10 and sizes[600] < 1.5 * sizes[150] + (8 << 10), sizes
