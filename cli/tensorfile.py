"""safetensors files written and read one tensor at a time.

safetensors' `save_file` takes every tensor at once, and `load_file` returns them all: for an
offloaded run's state that is more than its host budget. The format lets a writer lay out the
header first, from the dtypes and shapes alone (an 8-byte little-endian header length, the JSON
header padded with spaces to 8 bytes, then each tensor's bytes at its `data_offsets`), so here
a tensor's bytes are produced (offload.runtime.lazy.Deferred) only while they are written, and
read straight into where they belong. The files are plain safetensors: safetensors' own
readers read them, and this reader reads theirs.
"""

from __future__ import annotations

import json
import math
import os
import struct
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..offload.runtime.lazy import Deferred

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 << 20  # safetensors' own limit


def _bytes_of(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def header(entries: "list[tuple[str, torch.dtype, tuple[int, ...]]]", *,
           metadata: "dict[str, str] | None" = None) -> bytes:
    """The 8-byte length and the JSON header of a file holding (key, dtype, shape) in this order."""
    head: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for key, dtype, shape in entries:
        nbytes = math.prod(shape) * dtype.itemsize
        head[key] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data section starts 8-aligned
    return struct.pack("<Q", len(text)) + text


def write(path: "str | Path", tensors: "dict[str, torch.Tensor | Deferred]", *,
          metadata: "dict[str, str] | None" = None,
          check: "Callable[[str, torch.Tensor], None] | None" = None) -> None:
    """Write `tensors` to a new safetensors file at `path`, in their order, fsynced. A Deferred's
    bytes are in memory only while it is written; `check(key, tensor)` sees each tensor first
    (it may raise to stop the write). OSError (a full disk) propagates as it is."""
    for key, t in tensors.items():
        if t.dtype not in NAMES:
            raise TypeError(f"cannot write a {t.dtype} tensor ({key}) to safetensors")
    head = header([(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()], metadata=metadata)
    with open(path, "wb") as f:
        f.write(head)
        for key, t in tensors.items():
            with (t.open() if isinstance(t, Deferred) else nullcontext(t)) as value:
                if value.dtype != t.dtype or tuple(value.shape) != tuple(t.shape):
                    raise AssertionError(f"{key}: produced {value.dtype} {tuple(value.shape)}, "
                                         f"declared {t.dtype} {tuple(t.shape)}")
                if check is not None:
                    check(key, value)
                if value.numel():
                    f.write(_bytes_of(value))
        f.flush()
        os.fsync(f.fileno())


class Appender:
    """A safetensors file whose tensors arrive one at a time and are not known in advance: each
    is appended to a side file at once (nothing is held), and `finish` writes the header, then
    copies the side file's bytes behind it in the kernel (copy_file_range: no user-space buffer,
    a reflink where the filesystem has them). Costs one more sequential write of the data."""

    def __init__(self, path: "str | Path"):
        self.path = Path(path)
        self.data_path = self.path.with_name(self.path.name + ".data")
        self._data = open(self.data_path, "wb")
        self.entries: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        self.nbytes = 0

    def add(self, key: str, t: torch.Tensor) -> None:
        if t.dtype not in NAMES:
            raise TypeError(f"cannot write a {t.dtype} tensor ({key}) to safetensors")
        self.entries.append((key, t.dtype, tuple(t.shape)))
        if t.numel():
            self._data.write(_bytes_of(t))
        self.nbytes += t.numel() * t.dtype.itemsize

    def finish(self, *, metadata: "dict[str, str] | None" = None) -> None:
        """Write the file at `path` (fsynced) and remove the side file."""
        self._data.close()
        try:
            with open(self.path, "wb") as out, open(self.data_path, "rb") as src:
                out.write(header(self.entries, metadata=metadata))
                out.flush()
                left = self.nbytes
                while left:
                    n = os.copy_file_range(src.fileno(), out.fileno(), left)
                    if n <= 0:
                        raise OSError(f"{self.data_path} ended {left} bytes early")
                    left -= n
                out.flush()
                os.fsync(out.fileno())
        finally:
            self.discard()

    def discard(self) -> None:
        self._data.close()
        self.data_path.unlink(missing_ok=True)


@dataclass(frozen=True)
class Stored:
    """One tensor of a safetensors file, read when asked."""

    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # from the file's start
    nbytes: int

    def read_into(self, dst: torch.Tensor) -> None:
        """Read the tensor into contiguous CPU `dst` of its dtype and number of elements."""
        if dst.dtype != self.dtype or dst.numel() != math.prod(self.shape) or not dst.is_contiguous() \
                or dst.device.type != "cpu":
            raise ValueError(f"cannot read a {self.dtype} {self.shape} tensor into a {dst.dtype} "
                             f"{tuple(dst.shape)} one on {dst.device}")
        if not self.nbytes:
            return
        view = memoryview(dst.reshape(-1).view(torch.uint8).numpy())
        with open(self.path, "rb", buffering=0) as f:
            done = 0
            while done < self.nbytes:
                got = os.preadv(f.fileno(), [view[done:]], self.offset + done)
                if got <= 0:
                    raise ValueError(f"{self.path} ends inside a tensor (truncated)")
                done += got

    def load(self) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.dtype)
        self.read_into(out)
        return out


def index(path: "str | Path") -> dict[str, Stored]:
    """Every tensor of the safetensors file at `path`, unread. ValueError if its header is not
    a valid one for the file's size."""
    path = str(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER or 8 + n > size:
            raise ValueError(f"{path} is not a safetensors file (header length {n})")
        header = json.loads(f.read(n))
    start, out, end = 8 + n, {}, 0
    for key, e in header.items():
        if key == "__metadata__":
            continue
        dtype, shape = DTYPES[e["dtype"]], tuple(int(d) for d in e["shape"])
        begin, stop = (int(x) for x in e["data_offsets"])
        if stop - begin != math.prod(shape) * dtype.itemsize or begin < 0 or start + stop > size:
            raise ValueError(f"{path}: tensor {key}'s offsets do not fit its shape or the file")
        out[key] = Stored(path, dtype, shape, start + begin, stop - begin)
        end = max(end, stop)
    if start + end != size:
        raise ValueError(f"{path} has {size - start - end} bytes after its last tensor")
    return out
