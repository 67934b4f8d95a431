"""cli.tensorfile against safetensors itself: files written a tensor at a time are what
safetensors reads, files safetensors writes are what this reader reads, and a deferred tensor is
in memory only while it is written."""

from __future__ import annotations

import contextlib

import pytest
import torch
from safetensors.torch import load_file, save_file

from tierwise.cli import tensorfile
from tierwise.offload.runtime.lazy import Deferred, fill


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "fp32": torch.randn(3, 5, generator=g),
        "bf16": torch.randn(7, generator=g).bfloat16(),
        "fp16": torch.randn(2, 2, generator=g).half(),
        "int64": torch.arange(5),
        "uint8": torch.randint(0, 255, (9,), dtype=torch.uint8, generator=g),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "strided": torch.randn(4, 6, generator=g).t(),  # written as its contiguous copy
    }


def test_written_file_is_what_safetensors_reads(tmp_path):
    want = _tensors()
    tensorfile.write(tmp_path / "a.safetensors", want, metadata={"format": "pt"})
    got = load_file(tmp_path / "a.safetensors")
    assert set(got) == set(want)
    for k, t in want.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k


def test_safetensors_file_is_what_this_reader_reads(tmp_path):
    want = {k: v.contiguous() for k, v in _tensors().items()}
    save_file(want, str(tmp_path / "b.safetensors"))
    index = tensorfile.index(tmp_path / "b.safetensors")
    assert set(index) == set(want)
    for k, t in want.items():
        assert torch.equal(index[k].load(), t), k
        dst = torch.full_like(t, 0)
        fill(dst, index[k])
        assert torch.equal(dst, t), k


def test_deferred_tensors_are_in_memory_one_at_a_time(tmp_path):
    opened, now = [], [0]

    def source(i: int):
        @contextlib.contextmanager
        def open_():
            now[0] += 1
            opened.append(now[0])
            yield torch.full((1000,), float(i))
            now[0] -= 1
        return open_

    tensors = {f"c{i}": Deferred(torch.float32, (1000,), source(i)) for i in range(5)}
    tensorfile.write(tmp_path / "c.safetensors", tensors)
    assert opened == [1] * 5  # each once, never two at a time
    got = load_file(tmp_path / "c.safetensors")
    assert all(torch.equal(got[f"c{i}"], torch.full((1000,), float(i))) for i in range(5))


def test_deferred_that_differs_from_its_declaration_is_refused(tmp_path):
    wrong = Deferred(torch.float32, (4,), lambda: contextlib.nullcontext(torch.zeros(5)))
    with pytest.raises(AssertionError, match="declared"):
        tensorfile.write(tmp_path / "d.safetensors", {"w": wrong})


def test_check_stops_the_write(tmp_path):
    def no_nan(key, t):
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(key)

    with pytest.raises(ValueError, match="bad"):
        tensorfile.write(tmp_path / "e.safetensors", {"ok": torch.ones(2), "bad": torch.tensor([float("nan")])},
                         check=no_nan)


def test_appender_writes_what_safetensors_reads(tmp_path):
    want = _tensors()
    out = tensorfile.Appender(tmp_path / "f.safetensors")
    for k, t in want.items():
        out.add(k, t)
    out.finish(metadata={"format": "pt"})
    assert not out.data_path.exists()
    got = load_file(tmp_path / "f.safetensors")
    assert all(torch.equal(got[k], t) for k, t in want.items())


@pytest.mark.parametrize("damage", ["truncated", "header-length", "trailing"])
def test_damaged_files_are_refused(tmp_path, damage):
    p = tmp_path / "g.safetensors"
    tensorfile.write(p, {"w": torch.ones(64)})
    raw = bytearray(p.read_bytes())
    if damage == "truncated":
        raw = raw[:-10]
    elif damage == "header-length":
        raw[:8] = (1 << 40).to_bytes(8, "little")
    else:
        raw += b"\0" * 4
    p.write_bytes(bytes(raw))
    with pytest.raises(ValueError):
        tensorfile.index(p)
