"""Host memory that the local ranks of a node share: one file in /dev/shm, mapped by each.

The node's leader `create`s `tierwise-base-<pid>-<random>` (O_CREAT|O_EXCL|O_NOFOLLOW, mode
0600) and maps it read-write; the other local ranks `attach` it read-only (a stray write faults
rather than changing what the others read); once every rank has mapped it the leader
`unlink`s the name, so the memory lives exactly as long as the last mapping, a crash included.
A run killed between create and unlink leaves the file behind: every rank holds a shared
`flock` on it while it lives, so `remove_stale` (run by each `create`) deletes only the
files of this user that nobody holds (their runs are dead) -- never a live run's.
With CUDA each rank `pin`s its mapping (cudaHostRegister; read-only where it maps read-only),
so the copies to its device are DMA from the shared pages, as from any pinned host tier; where
the driver refuses (a memlock limit, no read-only registration), the region stays pageable and
one warning says so. The register runs in a thread of its own, on the rank's device: a refusal
is also the calling thread's pending CUDA error, which torch's next kernel launch check
(cudaGetLastError) would raise as that kernel's; and a thread's current device is where the
runtime registers (device 0's, a context of its own there, unless set).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
import warnings

import torch

from ..core.errors import TierwiseError
from ..core.units import format_size
from .pinned import host_register

log = logging.getLogger(__name__)
SHM_DIR = "/dev/shm"
_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly (CUDA >= 11.1): a read-only mapping's pages
PREFIX = "tierwise-base-"
_NAME = re.compile(re.escape(PREFIX) + r"(\d+)-[0-9a-f]+")


class SharedMemoryError(TierwiseError):
    """The shared memory of a node's ranks could not be made or mapped."""


class SharedRegion:
    """`nbytes` of memory in a /dev/shm file, mapped (`tensor`: uint8 over all of it)."""

    def __init__(self, path: str, fd: int, nbytes: int, *, writable: bool):
        self.path, self.nbytes, self.writable = path, nbytes, writable
        self._fd = fd
        self.pinned, self._device = False, None  # pinned: for copies to CUDA device `_device`
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self._map = mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED, prot=prot)
        with warnings.catch_warnings():  # a read-only mapping: torch warns that it is not writable
            warnings.simplefilter("ignore", UserWarning)
            self.tensor = torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes) if nbytes else \
                torch.empty(0, dtype=torch.uint8)

    @classmethod
    def create(cls, nbytes: int, *, directory: str = SHM_DIR) -> "SharedRegion":
        """A new file of `nbytes` (zero-filled, pages taken as they are written), mapped read-write."""
        remove_stale(directory)
        path = os.path.join(directory, f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise SharedMemoryError(f"cannot create the shared base {path}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            # reserve the pages now: a tmpfs too small for the base (a container's /dev/shm is
            # 64 MiB by default) then fails here, in one line, not with SIGBUS while loading
            if nbytes:
                os.posix_fallocate(fd, 0, nbytes)
            return cls(path, fd, nbytes, writable=True)
        except BaseException as exc:
            os.close(fd)
            os.unlink(path)
            if isinstance(exc, OSError):
                free = _free(directory)
                raise SharedMemoryError(f"cannot size the shared base {path} to {format_size(nbytes)}: "
                                        f"{exc.strerror} ({directory} has {format_size(free)} free; in a "
                                        "container raise it, e.g. docker --shm-size, or pass "
                                        "Distributed(share_base=False) to give every rank its own copy)") from None
            raise

    @classmethod
    def attach(cls, path: str, nbytes: int) -> "SharedRegion":
        """The leader's file, mapped read-only; it must be this user's, a plain file of `nbytes`."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise SharedMemoryError(f"cannot open the shared base {path}: {exc.strerror}") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size != nbytes:
            os.close(fd)
            raise SharedMemoryError(f"{path} is not the shared base of this run (a {st.st_size} B file of uid "
                                    f"{st.st_uid}; expected {nbytes} B of uid {os.getuid()})")
        fcntl.flock(fd, fcntl.LOCK_SH)
        return cls(path, fd, nbytes, writable=False)

    def pin(self, device: "torch.device | int | None" = None) -> bool:
        """Page-lock the mapping for CUDA copies to `device` (None: the current one) with
        cudaHostRegister; False where CUDA is absent or refuses (the region then stays pageable:
        slower copies, the same bytes)."""
        if self.pinned or not self.nbytes or not torch.cuda.is_available():
            return self.pinned
        index = torch.device("cuda", device).index if isinstance(device, int) else getattr(device, "index", None)
        if index is None:
            index = torch.cuda.current_device()
        flags = 0 if self.writable else _REGISTER_READ_ONLY
        err = host_register(self.tensor.data_ptr(), self.nbytes, flags, index)
        if err != 0:
            log.warning("the shared base (%s) could not be pinned for CUDA copies (cudaHostRegister: %s): it "
                        "stays pageable, copies from it are slower", format_size(self.nbytes), _error_name(err))
            return False
        self.pinned, self._device = True, index
        return True

    def unlink(self) -> None:
        """Remove the name (every rank has mapped it): the memory goes with the last mapping."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Drop this process's mapping (tensors viewing it must be gone: their storage is it)."""
        if self.pinned:
            torch.cuda.synchronize(self._device)  # no copy may still be reading the pages
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        self.tensor = None
        try:
            self._map.close()
        except BufferError:  # a view still exported: the mapping goes when the process ends
            pass
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _error_name(err: int) -> str:
    """CUDA's name of runtime error `err` (e.g. 'out of memory': a memlock limit, ulimit -l)."""
    try:
        cudart = torch.cuda.cudart()
        return f"{cudart.cudaGetErrorString(cudart.cudaError(err))} ({err})"  # (the binding takes the enum)
    except Exception:  # noqa: BLE001 - no name: the number
        return f"error {err}"


def _free(directory: str) -> int:
    try:
        st = os.statvfs(directory)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def remove_stale(directory: str = SHM_DIR) -> list[str]:
    """Delete the shared-base files in `directory` of this user that no process holds (a run
    killed before it unlinked its file). Returns the paths removed."""
    removed = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        if _NAME.fullmatch(entry.name) is None:
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live run holds it
            os.unlink(entry.path)
            removed.append(entry.path)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed
