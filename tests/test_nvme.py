"""NvmeStore: round trips at unaligned offsets, queue overlap, and every failure made clear."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from tierwise.offload.runtime import nvme
from tierwise.offload.runtime.aligned import aligned_empty, is_aligned
from tierwise.offload.core.errors import NvmeError
from tierwise.offload.runtime.nvme import NvmeStore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = 16 << 10  # small blocks so a few KiB already take the multi-block path


@pytest.fixture
def store(tmp_path):
    with NvmeStore(tmp_path / "swap", threads=2, block_size=BLOCK, checksum=True) as s:
        yield s


def _data(n: int, dtype: torch.dtype, *, offset: int = 0, seed: int = 0) -> torch.Tensor:
    """[n] tensor of `dtype` starting `offset` elements into its storage."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(-100, 100, (n + offset,), generator=g).to(dtype)
    return base[offset:]


def test_aligned_empty_is_aligned_and_rounded():
    t = aligned_empty(1000)
    assert t.dtype == torch.uint8 and t.numel() == 4096 and is_aligned(t.data_ptr())
    assert aligned_empty(0).numel() == 0
    assert is_aligned(aligned_empty(5, alignment=512).data_ptr(), 512)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float64,
                                   torch.bool], ids=str)
@pytest.mark.parametrize("n,src_off,dst_off", [
    (1000, 1, 3),           # DeepSpeed's case: slice at an odd element offset
    (1, 0, 0),
    (0, 0, 0),
    (BLOCK, 0, 0),          # aligned, exactly one block
    (3 * BLOCK + 7, 5, 0),  # several blocks and an unaligned tail
], ids=lambda v: str(v))
def test_round_trip(store, dtype, n, src_off, dst_off):
    src = _data(n, dtype, offset=src_off)
    store.write("c0.state", src)
    dst = torch.zeros(n + dst_off, dtype=dtype)[dst_off:]
    store.read("c0.state", dst)
    assert torch.equal(dst, src)


def test_round_trip_aligned_in_place_and_shapes(store):
    src = aligned_empty(5 * BLOCK).view(torch.float32).view(4, -1).normal_()
    store.write("c1.master", src)
    dst = aligned_empty(5 * BLOCK).view(torch.float32).view(4, -1)
    store.read("c1.master", dst)
    assert torch.equal(dst, src)
    assert store.stats.bytes_read == store.stats.bytes_written == src.numel() * 4


def test_buffered_fallback_when_odirect_refused(tmp_path, monkeypatch, caplog):
    def refuse(fd):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(nvme, "_enable_direct", refuse)
    with NvmeStore(tmp_path, block_size=BLOCK) as s:
        for key in ("a", "b"):
            src = _data(3001, torch.float32, offset=1)
            s.write(key, src)
            dst = torch.empty_like(src)
            s.read(key, dst)
            assert torch.equal(dst, src)
    assert sum("refuses O_DIRECT" in r.message for r in caplog.records) == 1


def test_read_overlaps_blocked_write(store, monkeypatch):
    """A read completes while a write is stuck: the queues are separate."""
    b = _data(50_000, torch.float32, seed=1)
    store.write("b", b)
    release, real = threading.Event(), os.pwritev

    def slow_pwritev(fd, bufs, offset):
        release.wait(10)
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "pwritev", slow_pwritev)
    a = _data(50_000, torch.float32, seed=2)
    wfut = store.write_async("a", a)
    dst = torch.empty_like(b)
    store.read_async("b", dst).result(timeout=5)
    assert torch.equal(dst, b) and not wfut.done()
    release.set()
    wfut.result(timeout=10)
    out = torch.empty_like(a)
    store.read("a", out)
    assert torch.equal(out, a)


def test_urgent_read_is_served_before_queued_blocks(store, monkeypatch):
    """A fetch the compute thread waits for overtakes the queued blocks of an optimizer read:
    only the blocks already in the I/O threads' hands go first."""
    big, small = _data(40 * BLOCK // 4, torch.float32, seed=1), _data(BLOCK // 4, torch.float32, seed=2)
    store.write("big", big)
    store.write("small", small)
    release, started, real = threading.Event(), threading.Semaphore(0), os.preadv
    order = []

    def gated_preadv(fd, bufs, offset):
        order.append(fd)
        started.release()
        release.wait(10)
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "preadv", gated_preadv)
    big_dst, small_dst = torch.empty_like(big), torch.empty_like(small)
    slow = store.read_async("big", big_dst)
    for _ in range(2):  # both read threads hold a block of the big read
        assert started.acquire(timeout=10)
    fast = store.read_async("small", small_dst, urgent=True)
    release.set()
    fast.result(timeout=10)
    slow.result(timeout=10)
    assert order[2] != order[0] and order.count(order[2]) == 1, "the urgent read waited behind queued blocks"
    assert torch.equal(small_dst, small) and torch.equal(big_dst, big)


def test_same_key_operations_run_in_order(store):
    v1, v2 = _data(20_000, torch.int8, seed=1), _data(20_000, torch.int8, seed=2)
    first, second = torch.empty_like(v1), torch.empty_like(v1)
    futs = [store.write_async("k", v1), store.read_async("k", first),
            store.write_async("k", v2), store.read_async("k", second)]
    for f in futs:
        f.result(timeout=10)
    assert torch.equal(first, v1) and torch.equal(second, v2)


def test_disk_full_enospc_keeps_other_keys(store, monkeypatch):
    good = _data(5000, torch.float32)
    store.write("good", good)

    def full(fd, bufs, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full)
    with pytest.raises(NvmeError, match=r"disk full at .*: needed .*, free "):
        store.write("bad", _data(5000, torch.float32))
    monkeypatch.undo()
    with pytest.raises(NvmeError, match="holds no valid data"):
        store.read("bad", torch.empty(5000))
    out = torch.empty(5000)
    store.read("good", out)
    assert torch.equal(out, good)


def test_short_write_and_eio_are_errors(store, monkeypatch):
    real_w = os.pwritev
    monkeypatch.setattr(os, "pwritev", lambda fd, bufs, off: real_w(fd, bufs, off) - 4096)
    with pytest.raises(NvmeError, match=r"short write to .*: \d+ of \d+ bytes at offset 0"):
        store.write("s", torch.zeros(BLOCK // 4))
    monkeypatch.undo()
    store.write("s", torch.zeros(BLOCK // 4))

    def eio(fd, bufs, offset):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "preadv", eio)
    with pytest.raises(NvmeError, match=r"I/O error \(EIO\) on .*s\.swp"):
        store.read("s", torch.empty(BLOCK // 4))


def test_disk_full_from_file_size_limit(tmp_path):
    """A real full disk, without root: RLIMIT_FSIZE makes writes past 1 MiB fail (EFBIG)."""
    script = textwrap.dedent(f"""
        import resource, signal, torch
        from tierwise.offload.runtime.nvme import NvmeStore
        from tierwise.offload.core.errors import NvmeError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        with NvmeStore({str(tmp_path)!r}, block_size=65536) as s:
            a = torch.arange(100_000, dtype=torch.float32)
            s.write("a", a)
            try:
                s.write("b", torch.ones(1 << 20))
            except NvmeError as e:
                print("ERR", e)
            out = torch.empty_like(a); s.read("a", out)
            print("INTACT", bool(torch.equal(out, a)))
    """)
    res = _python(script)
    assert "ERR disk full at" in res.stdout and "INTACT True" in res.stdout, res.stderr


def test_truncated_swap_file(store):
    store.write("t", torch.ones(10_000))
    os.truncate(store.path("t"), 4096)
    with pytest.raises(NvmeError, match=r"swap file .*t\.swp is truncated: 4096 of 40960 bytes"):
        store.read("t", torch.empty(10_000))


def test_flipped_byte_detected_by_checksum(store):
    other = _data(8000, torch.float32, seed=3)
    store.write("other", other)
    store.write("x", _data(8000, torch.float32, seed=4))
    with open(store.path("x"), "r+b") as f:
        f.seek(20_000)
        byte = f.read(1)
        f.seek(20_000)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(NvmeError, match=r"checksum mismatch in .*x\.swp"):
        store.read("x", torch.empty(8000))
    out = torch.empty(8000)
    store.read("other", out)
    assert torch.equal(out, other)


def test_misaligned_direct_request_is_refused(store):
    store.write("m", torch.zeros(4096))
    swap = store._files["m"]
    req = nvme._Request(write=False, key="m", swap=swap, data=None, future=None,
                        fd=swap.fd, direct=True)
    with pytest.raises(NvmeError, match="misaligned O_DIRECT request"):
        store._io(req, aligned_empty(8192)[512:4608], 0)


def test_bad_requests(store):
    with pytest.raises(NvmeError, match="no swap file for key 'nope'"):
        store.read("nope", torch.empty(4))
    store.write("k", torch.zeros(10))
    with pytest.raises(NvmeError, match="into 36 bytes, but it holds 40"):
        store.read("k", torch.empty(9))
    with pytest.raises(NvmeError, match="contiguous"):
        store.write("k", torch.zeros(4, 4).t())
    with pytest.raises(NvmeError, match="bad swap key"):
        store.write("../evil", torch.zeros(1))


def test_preflight(store):
    store.preflight(1 << 20)
    with pytest.raises(NvmeError, match=r"not enough space at .*: need .* GiB, free .* GiB, "
                                        r"missing .* GiB"):
        store.preflight(1 << 60)


def test_close_removes_files_and_created_dir(tmp_path):
    keep = tmp_path / "existing"
    keep.mkdir()
    for directory in (tmp_path / "new", keep):
        s = NvmeStore(directory)
        s.write("a", torch.zeros(100))
        s.write("b", torch.zeros(100))
        s.remove("a")
        assert os.listdir(directory) == [os.path.basename(s.directory)]
        assert sorted(os.listdir(s.directory)) == [".lock", "b.swp"]
        s.close()
    assert not (tmp_path / "new").exists() and keep.exists() and os.listdir(keep) == []
    with pytest.raises(NvmeError, match="closed"):
        s.write("c", torch.zeros(1))


def test_close_removes_the_parents_it_created_and_nothing_else(tmp_path):
    """A swap path several levels deep that does not exist (a mistyped mount point): the
    directories made for it go again on close, down to one holding something not the store's."""
    s = NvmeStore(tmp_path / "a" / "b" / "c")
    s.write("x", torch.zeros(10))
    s.close()
    assert os.listdir(tmp_path) == []
    s = NvmeStore(tmp_path / "a" / "b" / "c")
    (tmp_path / "a" / "theirs").write_text("keep")
    s.close()
    assert sorted(os.listdir(tmp_path / "a")) == ["theirs"]


@pytest.mark.parametrize("use_with", [True, False], ids=["context", "atexit"])
def test_ctrl_c_removes_swap_files(tmp_path, use_with):
    directory = tmp_path / "swap"
    opening = (f"with NvmeStore({str(directory)!r}) as s:" if use_with
               else f"s = NvmeStore({str(directory)!r})\nif True:")
    script = f"""
import time, torch
from tierwise.offload.runtime.nvme import NvmeStore
{opening}
    s.write('a', torch.zeros(10000))
    s.write('b', torch.ones(10000))
    print('READY', flush=True)
    time.sleep(30)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], env=_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().strip() == "READY", proc.stderr.read()
    (private,) = os.listdir(directory)
    assert sorted(os.listdir(directory / private)) == [".lock", "a.swp", "b.swp"]
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert "KeyboardInterrupt" in err
    assert not directory.exists()


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([os.environ["PYTHONPATH"], ROOT])}  # conftest binds tierwise


def _python(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script], env=_env(), text=True,
                          capture_output=True, timeout=60)
