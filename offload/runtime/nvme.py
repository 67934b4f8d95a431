"""The NVMe tier's IO engine: chunk-sized swap files, O_DIRECT, aligned bounce buffers.

One `NvmeStore` owns one private directory (offload.runtime.swapdir: made fresh under the
directory the user names, `--nvme-path`, mode 0700, exclusive, locked for the store's life, so
runs sharing `--nvme-path` never touch each other's files) and one swap file per key (a chunk
kind, e.g. "c12.state"). Each swap file is created O_CREAT|O_EXCL|O_NOFOLLOW relative to that directory's fd at
its first write and kept open by fd until removed: the store never opens, truncates or deletes
a file it did not create, and never follows a symlink planted under its name. Private
directories of dead runs (their lock is free) are removed when a store opens, with a notice.
This module is one cohesive thing, the I/O engine (the store, its two lanes of threads, the
blocking of requests, the checked syscalls), hence its ~550 lines.
Each request (read or write of one whole key) is cut into `block_size` blocks; the blocks go
to a queue served by `threads` Python threads (os.preadv/os.pwritev release the GIL). Reads
and writes have SEPARATE queues and threads, so the next chunk's read is not stuck behind the
last chunk's write-back. Operations on the same key run in submission order. A request marked
`urgent` (a fetch the compute thread waits for) has its blocks served before the queued blocks
of other requests (the optimizer's reads of master and state during backward): each lane's
queue is ordered by (urgency, submission), so an urgent read waits only for the blocks already
in the threads' hands.

Every O_DIRECT request has its buffer address, file offset and length checked for 4096-byte
alignment, and every byte count is checked: DeepSpeed's O_DIRECT read into a buffer slice
at an offset not a multiple of 512 "succeeded" and read nothing, silently. A block of an
aligned tensor is read/written in place; a tail that is not a multiple of 4096 bytes and a
misaligned tensor go through aligned (pinned where possible) bounce buffers. Files are padded
to 4096 bytes and preallocated with posix_fallocate at the first write of a key. Measured
here (1 GiB, 64 MiB chunks): first write of new files 2.0-2.1 GB/s without preallocation,
2.1-2.3 with it; rewriting existing swap files 3.1-3.7 GB/s, which is the steady state
(every step rewrites the same keys) - the ~2x is overwrite vs new extents, not fallocate.

Defaults, measured on this machine (virtual disk /dev/vda, ext4, 2 cores, shared with three
other jobs, so every figure drifts +-30%; 1-2 GiB of 64 MiB chunks, 4 chunks in flight):
  threads=4 per direction, block_size=8 MiB (32 MiB in flight per direction, like fio's
  bs=1M iodepth=32). Read 1.0-2.1 GB/s and write 2.3-3.8 GB/s for every setting from
  2x4 MiB to 16x2 MiB: the device, not the engine, sets the pace; 1 thread or 16+ MiB
  blocks were slower; several ranks of a node divide the 4 (`threads_per_rank`). Aligned
  tensors are read/written in place: through bounce buffers
  the same run gave write 2.0-2.3 vs 3.2-3.6 GB/s and read 0.9-1.0 vs 1.35-1.4 GB/s, so
  allocate chunk buffers with `aligned_empty`. Against fio (libaio, direct, 1M, iodepth
  32), 4 GiB, interleaved: write 1.37-1.38x fio, read 0.91-1.32x (two runs of
  bench/nvme_vs_fio.py; fio's reads swing 0.8-2.3 GB/s on this shared disk, ours 1.1-1.7).

Swap files (and the private directory) are removed by `close()`, by the context manager, and
at interpreter exit (atexit), which also runs after an uncaught Ctrl-C (KeyboardInterrupt). No
signal handler is installed; a SIGKILLed run's directory is removed by the next store under the
same `--nvme-path`.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import itertools
import logging
import os
import queue
import re
import threading
import time
import weakref
import zlib
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

import torch

from .aligned import DIRECT_ALIGN, aligned_empty, is_aligned, round_up
from ..core.errors import NvmeError
from ..core.units import format_size
from .swapdir import PRIVATE_PREFIX, PrivateDir, remove_stale  # noqa: F401 (PRIVATE_PREFIX: the name users see)

log = logging.getLogger(__name__)

DEFAULT_THREADS = 4
DEFAULT_BLOCK_SIZE = 8 << 20


def threads_per_rank(local_world: int) -> int:
    """I/O threads per direction of each store of `local_world` ranks on one node: 4 / L rounded
    up. One store measured best with 4 threads x 8 MiB blocks per direction (above: the drive
    sets the pace, 1 thread alone was slower); divided, the node keeps at least those 4 in
    flight (rounded down, 3 ranks would keep 3) and at most L + 3 (8 ranks: 8, not 32), and each
    rank's bounce buffers (one block per thread) shrink alike. Measured (bench/nvme_ranks.py, 1 GiB
    in 64 MiB chunks, here): node GB/s divided / undivided, 2 ranks write 1.02x read 1.12x, 4
    ranks write 1.00x read 1.04x."""
    return -(-DEFAULT_THREADS // max(1, local_world))
_GIB = float(1 << 30)
_KEY = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")

# Cleanup on exit needs to know the open stores; this is the module's only mutable state.
_OPEN_STORES: "weakref.WeakSet[NvmeStore]" = weakref.WeakSet()


@atexit.register
def _close_open_stores() -> None:
    for store in list(_OPEN_STORES):
        if store.owner_pid == os.getpid():  # a forked child must not delete its parent's files
            store.close()


@dataclass(kw_only=True)
class NvmeStats:
    """I/O counters of one store. `*_seconds`: wall time with at least one request in flight."""

    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0

    @property
    def read_gbps(self) -> float:
        return self.bytes_read / self.read_seconds / 1e9 if self.read_seconds else 0.0

    @property
    def write_gbps(self) -> float:
        return self.bytes_written / self.write_seconds / 1e9 if self.write_seconds else 0.0


@dataclass(kw_only=True)
class _SwapFile:
    path: str
    fd: int = -1  # open from the first write (or zeros) until remove/close
    direct: bool = False  # fd has O_DIRECT
    nbytes: int = 0
    allocated: int = 0  # bytes preallocated on disk (multiple of 4096)
    crcs: list | None = None  # per-block crc32, when checksums are on
    valid: bool = False  # False until a write completed (or after a failed one)
    foreign: bool = False  # another store's file, read here (`attach`): never written or deleted


@dataclass(kw_only=True, eq=False)
class _Request:
    """One read or write of one whole key, cut into blocks."""

    write: bool
    key: str
    swap: _SwapFile
    data: torch.Tensor  # [nbytes] uint8 view of the caller's tensor
    future: Future
    urgent: bool = False
    fd: int = -1
    direct: bool = False
    remaining: int = 0
    error: BaseException | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


def _byte_view(t: torch.Tensor, what: str) -> torch.Tensor:
    """[nbytes] uint8 view of a contiguous CPU tensor of any dtype (shares its memory)."""
    if t.device.type != "cpu":
        raise NvmeError(f"{what} must be a CPU tensor, got one on {t.device}")
    if not t.is_contiguous():
        raise NvmeError(f"{what} must be contiguous")
    flat = t.detach().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


class _Lane:
    """One direction: a block queue, its worker threads, bounce buffers, busy-time clock."""

    def __init__(self, name: str, *, threads: int, block_size: int, depth: int, run) -> None:
        self.blocks: queue.PriorityQueue = queue.PriorityQueue()  # (rank, seq, (req, index)); None-items stop
        self._seq = itertools.count()
        self.free: queue.Queue = queue.Queue()
        self._made, self._depth, self._block_size = 0, depth, block_size
        self._lock = threading.Lock()
        self._inflight, self._since, self.busy = 0, 0.0, 0.0
        self.threads = [
            threading.Thread(target=self._serve, args=(run,), name=f"nvme-{name}-{i}", daemon=True)
            for i in range(threads)
        ]
        for t in self.threads:
            t.start()

    def put(self, req: "_Request", index: int) -> None:
        self.blocks.put((0 if req.urgent else 1, next(self._seq), (req, index)))

    def _serve(self, run) -> None:
        while (item := self.blocks.get()[2]) is not None:
            try:
                run(*item)
            except Exception:  # run() reports through futures; this is a bug, keep serving
                log.exception("NVMe I/O thread: unexpected error")

    def bounce(self) -> torch.Tensor:
        with self._lock:
            if self.free.empty() and self._made < self._depth:
                self._made += 1
                return aligned_empty(self._block_size)
        return self.free.get()

    def begin(self) -> None:
        with self._lock:
            if self._inflight == 0:
                self._since = time.perf_counter()
            self._inflight += 1

    def end(self) -> None:
        with self._lock:
            self._inflight -= 1
            if self._inflight == 0:
                self.busy += time.perf_counter() - self._since

    def stop(self) -> None:
        for _ in self.threads:
            self.blocks.put((2, next(self._seq), None))  # after every queued block
        for t in self.threads:
            t.join(timeout=30)

    def busy_seconds(self) -> float:
        with self._lock:
            return self.busy + (time.perf_counter() - self._since if self._inflight else 0.0)


def _missing_dirs(path: str) -> list[str]:
    """`path` and those of its parents that do not exist yet, deepest first."""
    missing = []
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        missing.append(path)
        path = os.path.dirname(path)
    return missing


class NvmeStore:
    """Swap files under one directory, read and written asynchronously (O_DIRECT when allowed).

    threads: I/O threads per direction (reads and writes each get their own).
    block_size: bytes per I/O request; a multiple of 4096.
    queue_depth: bounce buffers per direction (block_size each); default `threads`.
    checksum: crc32 per block, computed on write and verified on read.
    odirect: try O_DIRECT; falls back to buffered I/O (one warning) where refused.
    """

    def __init__(self, directory: "str | os.PathLike[str]", *, threads: int = DEFAULT_THREADS,
                 block_size: int = DEFAULT_BLOCK_SIZE, queue_depth: int | None = None,
                 checksum: bool = False, odirect: bool = True) -> None:
        if threads < 1 or (queue_depth is not None and queue_depth < 1):
            raise NvmeError(f"threads and queue_depth must be >= 1: {threads}, {queue_depth}")
        if block_size <= 0 or not is_aligned(block_size):
            raise NvmeError(f"block_size must be a positive multiple of {DIRECT_ALIGN}: "
                            f"{block_size}")
        self.root = os.path.abspath(os.fspath(directory))
        self._created = _missing_dirs(self.root)  # removed again on close, deepest first
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            raise NvmeError(f"cannot create swap directory {self.root}: "
                            f"{exc.strerror}") from exc
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise NvmeError(f"swap directory {self.root} is not writable")
        self.notices = remove_stale(self.root)
        for note in self.notices:  # the CLI prints them; a library user finds them here
            log.info("%s", note)
        self._private = PrivateDir(self.root)
        self.directory, self._dir_fd = self._private.path, self._private.fd
        self.block_size, self.checksum, self._odirect = block_size, checksum, odirect
        self.owner_pid = os.getpid()
        self._files: dict[str, _SwapFile] = {}
        self._last: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._moved = {False: 0, True: 0}
        self.expected = 0  # the bytes preflight was asked for
        depth = queue_depth or threads
        self._lanes = {
            write: _Lane("write" if write else "read", threads=threads, block_size=block_size,
                         depth=depth, run=self._run_block)
            for write in (False, True)
        }
        _OPEN_STORES.add(self)

    # ---- public API -------------------------------------------------------------------
    def write_async(self, key: str, src: torch.Tensor) -> Future:
        """Write all bytes of `src` (contiguous CPU tensor, any dtype) as `key`."""
        return self._submit(key, _byte_view(src, "src"), write=True)

    def read_async(self, key: str, dst: torch.Tensor, *, urgent: bool = False) -> Future:
        """Read `key` into `dst` (contiguous CPU tensor of exactly the written byte size).
        `urgent`: served before the queued blocks of requests that are not."""
        return self._submit(key, _byte_view(dst, "dst"), write=False, urgent=urgent)

    def write(self, key: str, src: torch.Tensor) -> None:
        self.write_async(key, src).result()

    def read(self, key: str, dst: torch.Tensor, *, urgent: bool = False) -> None:
        self.read_async(key, dst, urgent=urgent).result()

    def zeros(self, key: str, nbytes: int) -> None:
        """Make `key` hold `nbytes` zero bytes without writing them: the file is preallocated
        (the filesystem returns zeros for it), so no buffer of that size is ever needed."""
        path = self.path(key)
        with self._lock:
            if self._closed:
                raise NvmeError(f"NVMe store at {self.directory} is closed")
            swap, last = self._files.get(key), self._last.pop(key, None)
        if last is not None:
            wait([last])
        padded = round_up(nbytes)
        swap = swap or _SwapFile(path=path)
        try:
            if swap.fd < 0:
                self._create(swap)
            os.ftruncate(swap.fd, 0)  # drop the old bytes: the preallocated range reads as zeros
            try:
                os.posix_fallocate(swap.fd, 0, padded)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                os.ftruncate(swap.fd, padded)
        except OSError as exc:
            raise self._os_error(exc, "preallocate", path, padded) from exc
        swap.nbytes, swap.allocated, swap.valid = nbytes, padded, True
        if self.checksum:
            bs = self.block_size
            swap.crcs = [zlib.crc32(bytes(min(bs, nbytes - i * bs))) for i in range(-(-nbytes // bs))]
        with self._lock:
            self._files[key] = swap

    def attach(self, key: str, path: str, nbytes: int) -> None:
        """Read `key` from another store's file `path` (the node's leader's copy of a shared
        frozen base chunk, offload.engine.sharedbase), read-only: never written, never deleted."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise self._os_error(exc, "open", path, 0) from exc
        direct = False
        if self._odirect:
            try:
                _enable_direct(fd)
                direct = True
            except OSError:
                pass  # buffered reads then
        with self._lock:
            self._files[key] = _SwapFile(path=path, fd=fd, direct=direct, nbytes=nbytes,
                                         allocated=round_up(nbytes), valid=True, foreign=True)

    def path(self, key: str) -> str:
        """The swap file of `key`."""
        if not _KEY.fullmatch(key):
            raise NvmeError(f"bad swap key {key!r}: use letters, digits, '.', '_' and '-'")
        return os.path.join(self.directory, key + ".swp")

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._files)

    def remove(self, key: str) -> None:
        """Delete `key`'s swap file once the operations already submitted on it are done."""
        with self._lock:
            swap, last = self._files.pop(key, None), self._last.pop(key, None)
        if last is not None:
            wait([last])
        if swap is not None:
            self._delete(swap)

    def free_bytes(self) -> int:
        st = os.statvfs(self.directory)
        return st.f_bavail * st.f_frsize

    def preflight(self, nbytes_needed: int) -> None:
        """Refuse (NvmeError) when the directory's filesystem has less than `nbytes_needed` free."""
        self.expected = nbytes_needed
        free = self.free_bytes()
        if free < nbytes_needed:
            raise NvmeError(
                f"not enough space at {self.directory}: need {nbytes_needed / _GIB:.2f} GiB, "
                f"free {free / _GIB:.2f} GiB, missing {(nbytes_needed - free) / _GIB:.2f} GiB"
            )

    def pending_bytes(self) -> int:
        """Of the bytes preflight was asked for, those not yet allocated on disk (the swap
        files grow at their first write)."""
        held = 0
        for entry in os.scandir(self.directory):
            try:
                held += entry.stat(follow_symlinks=False).st_blocks * 512
            except OSError:
                continue
        return max(0, self.expected - held)

    @property
    def stats(self) -> NvmeStats:
        with self._lock:
            moved = dict(self._moved)
        return NvmeStats(bytes_read=moved[False], bytes_written=moved[True],
                         read_seconds=self._lanes[False].busy_seconds(),
                         write_seconds=self._lanes[True].busy_seconds())

    def close(self) -> None:
        """Finish submitted operations, stop the threads, delete every swap file."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            pending = list(self._last.values())
        wait(pending, timeout=120)
        for lane in self._lanes.values():
            lane.stop()
        with self._lock:
            swaps, self._files = list(self._files.values()), {}
        for swap in swaps:
            self._delete(swap)
        self._private.close()  # its lock, then the directory if empty
        for made in self._created:
            try:
                os.rmdir(made)
            except OSError:
                break  # not empty: files that are not this store's are left alone
        _OPEN_STORES.discard(self)

    def __enter__(self) -> "NvmeStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- request lifecycle ------------------------------------------------------------
    def _submit(self, key: str, data: torch.Tensor, *, write: bool, urgent: bool = False) -> Future:
        path = self.path(key)
        fut: Future = Future()
        with self._lock:
            if self._closed:
                raise NvmeError(f"NVMe store at {self.directory} is closed")
            swap = self._files.get(key)
            if swap is None and not write:
                raise NvmeError(f"no swap file for key {key!r} in {self.directory}")
            if swap is None:
                swap = self._files[key] = _SwapFile(path=path)
            if write and swap.foreign:
                raise NvmeError(f"{key!r} is another store's file ({swap.path}): read-only here")
            req = _Request(write=write, key=key, swap=swap, data=data, future=fut, urgent=urgent)
            prev, self._last[key] = self._last.get(key), fut
        if prev is None:
            self._start(req)
        else:  # same key: keep submission order (runs at once if prev is done)
            prev.add_done_callback(lambda _f: self._start(req))
        return fut

    def _start(self, req: _Request) -> None:
        lane = self._lanes[req.write]
        lane.begin()
        nblocks = -(-req.data.numel() // self.block_size)
        try:
            self._prepare_write(req) if req.write else self._prepare_read(req)
        except BaseException as exc:  # reported through the future
            req.error, nblocks = exc, 0
        if nblocks == 0:
            self._finish(req)
            return
        req.remaining = nblocks
        for i in range(nblocks):
            lane.put(req, i)

    def _prepare_write(self, req: _Request) -> None:
        swap, nbytes = req.swap, req.data.numel()
        swap.valid = False
        if swap.fd < 0:
            self._create(swap)
        req.fd, req.direct = swap.fd, swap.direct
        padded = round_up(nbytes)
        if padded > swap.allocated:
            try:
                os.posix_fallocate(req.fd, 0, padded)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
                    raise self._os_error(exc, "preallocate", swap.path, padded) from exc
                os.ftruncate(req.fd, padded)
        elif padded < swap.allocated:
            os.ftruncate(req.fd, padded)
        swap.allocated, swap.nbytes = padded, nbytes
        nblocks = -(-nbytes // self.block_size)
        swap.crcs = [0] * nblocks if self.checksum else None

    def _prepare_read(self, req: _Request) -> None:
        swap, nbytes = req.swap, req.data.numel()
        if not swap.valid:
            raise NvmeError(f"swap file {swap.path} holds no valid data: its last write failed")
        if nbytes != swap.nbytes:
            raise NvmeError(f"reading {swap.path} into {nbytes} bytes, but it holds {swap.nbytes}")
        req.fd, req.direct = swap.fd, swap.direct
        self._check_size(req, done=0, length=0, offset=0)

    def _run_block(self, req: _Request, index: int) -> None:
        if req.error is None:
            try:
                self._do_block(req, index)
            except BaseException as exc:
                with req.lock:
                    req.error = req.error or exc
        with req.lock:
            req.remaining -= 1
            last = req.remaining == 0
        if last:
            self._finish(req)

    def _finish(self, req: _Request) -> None:
        self._lanes[req.write].end()
        if req.error is None:
            req.swap.valid = req.swap.valid or req.write
            with self._lock:
                self._moved[req.write] += req.data.numel()
            req.future.set_result(None)
        else:
            req.swap.valid = req.swap.valid and not req.write
            req.future.set_exception(req.error)
        req.data = None  # drop the caller's tensor

    # ---- one block ----------------------------------------------------------------------
    def _do_block(self, req: _Request, index: int) -> None:
        offset = index * self.block_size
        part = req.data[offset : offset + self.block_size]
        n = part.numel()
        in_place = not req.direct or (is_aligned(part.data_ptr()) and is_aligned(n))
        lane = self._lanes[req.write]
        bounce = None if in_place else lane.bounce()
        buf = part if bounce is None else bounce[: round_up(n)]
        try:
            if req.write:
                if not in_place:
                    buf[:n].copy_(part)
                if req.swap.crcs is not None:
                    req.swap.crcs[index] = zlib.crc32(buf[:n].numpy())
                self._io(req, buf, offset)
            else:
                self._io(req, buf, offset)
                crcs = req.swap.crcs
                if crcs is not None and zlib.crc32(buf[:n].numpy()) != crcs[index]:
                    raise NvmeError(f"checksum mismatch in {req.swap.path} "
                                    f"(block {index}, bytes {offset}..{offset + n})")
                if not in_place:
                    part.copy_(buf[:n])
        finally:
            if bounce is not None:
                lane.free.put(bounce)

    def _io(self, req: _Request, buf: torch.Tensor, offset: int) -> None:
        """One pwritev/preadv of all of `buf` at `offset`, every byte count checked."""
        length = buf.numel()
        aligned = is_aligned(buf.data_ptr()) and is_aligned(offset) and is_aligned(length)
        if req.direct and not aligned:
            raise NvmeError(f"misaligned O_DIRECT request on {req.swap.path}: address "
                            f"{buf.data_ptr():#x}, offset {offset}, length {length} must be "
                            f"multiples of {DIRECT_ALIGN}")
        call = os.pwritev if req.write else os.preadv
        try:
            done = call(req.fd, [buf.numpy()], offset)
        except OSError as exc:
            op = "write to" if req.write else "read from"
            raise self._os_error(exc, op, req.swap.path, length) from exc
        if done != length:
            self._check_size(req, done=done, length=length, offset=offset)

    def _check_size(self, req: _Request, *, done: int, length: int, offset: int) -> None:
        """Explain a short transfer (truncated file, full disk); called on every short count."""
        expected = round_up(req.swap.nbytes)
        size = os.fstat(req.fd).st_size
        if size < expected and not req.write:
            raise NvmeError(f"swap file {req.swap.path} is truncated: {size} of {expected} bytes")
        if done == length:
            return
        what = "write to" if req.write else "read from"
        hint = f" (free at {self.directory}: {format_size(self.free_bytes())})" if req.write else ""
        raise NvmeError(f"short {what} {req.swap.path}: {done} of {length} bytes at offset "
                        f"{offset}{hint}")

    def _create(self, swap: _SwapFile) -> None:
        """Create `swap`'s file: exclusively (never an existing file, never through a symlink),
        relative to the private directory's fd, kept open; O_DIRECT where the filesystem
        allows it (else buffered I/O, with one warning)."""
        name = os.path.basename(swap.path)
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600, dir_fd=self._dir_fd)
        except OSError as exc:
            raise self._os_error(exc, "create", swap.path, 0) from exc
        direct = False
        if self._odirect:
            try:
                _enable_direct(fd)
                direct = True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    os.close(fd)
                    raise self._os_error(exc, "open", swap.path, 0) from exc
                self._odirect = False
                log.warning("%s refuses O_DIRECT (%s); using buffered I/O", self.root, exc.strerror)
        swap.fd, swap.direct = fd, direct

    def _delete(self, swap: _SwapFile) -> None:
        """Close and delete a swap file this store created."""
        if swap.fd >= 0:
            try:
                os.close(swap.fd)
            except OSError:
                pass
            swap.fd = -1
            if swap.foreign:
                return
            try:
                os.unlink(os.path.basename(swap.path), dir_fd=self._dir_fd)
            except FileNotFoundError:
                pass

    def _os_error(self, exc: OSError, op: str, path: str, needed: int) -> NvmeError:
        if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            return NvmeError(f"disk full at {self.directory}: needed {format_size(needed)}, "
                             f"free {format_size(self.free_bytes())} ({exc.strerror} on {path})")
        if exc.errno == errno.EIO:
            return NvmeError(f"I/O error (EIO) on {path} during {op}: "
                             "the device reported a failure")
        if exc.errno == errno.ENOENT:
            return NvmeError(f"swap file {path} is missing (deleted while in use?)")
        return NvmeError(f"{op} {path} failed: {exc.strerror} (errno {exc.errno})")


def _enable_direct(fd: int) -> None:
    """Turn O_DIRECT on for an open fd (OSError EINVAL where the filesystem refuses it)."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
