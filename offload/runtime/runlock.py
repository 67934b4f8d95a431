"""Advisory locks that name their holder: one run per --output, one owner per swap directory.

`acquire(path)` opens (creating) `path` and takes an exclusive `flock` without waiting; the
holder's pid is written into the file, so a refused second run can say who holds it. The
kernel drops the lock when the holder's fd closes or the process dies (SIGKILL included),
so a lock file left behind by a dead run is simply free: that is how `is_stale` tells a dead
run's swap directory from a live one.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time

from ..core.errors import TierwiseError


class LockedError(TierwiseError):
    """Another live process holds the lock."""


def _holder(fd: int) -> str:
    """The pid written in a held lock file ('?' if the holder has not written it yet)."""
    for _ in range(20):  # the holder writes its pid right after taking the lock
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        if text.isdigit():
            return text
        time.sleep(0.01)
    return "?"


def acquire(path: "str | os.PathLike[str]", *, what: str, dir_fd: int | None = None) -> int:
    """Lock `path` (created 0600 if missing, never through a symlink); returns the fd that
    holds the lock until `release`. Raises LockedError naming the holder's pid."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        pid = _holder(fd) if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else None
        os.close(fd)
        if pid is None:
            raise
        raise LockedError(f"{what} is in use by another finetune run (pid {pid}); wait for it "
                          "to finish or choose another directory") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def release(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)  # closing drops the flock


def is_stale(path: "str | os.PathLike[str]", *, dir_fd: int | None = None) -> bool:
    """Whether the lock file `path` exists and no live process holds it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
