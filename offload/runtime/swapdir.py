"""A swap store's private directory under the user's `--nvme-path`: made fresh
(`tierwise-swap-<pid>-<random>`, mode 0700, created exclusively by mkdtemp), locked for the
store's life (offload.runtime.runlock), removed when it closes if nothing else is inside; and
the cleanup of the directories that runs which died (SIGKILL) left behind."""

from __future__ import annotations

import os
import re
import stat
import tempfile

from . import runlock
from ..core.units import format_size

#: A store's private directory under the user's one: tierwise-swap-<pid>-<mkdtemp suffix>.
PRIVATE_PREFIX = "tierwise-swap-"
_PRIVATE = re.compile(re.escape(PRIVATE_PREFIX) + r"(\d+)-[A-Za-z0-9_]+")
_LOCK = ".lock"


class PrivateDir:
    """A fresh, locked directory under `root`; `fd` is its directory fd (files are created
    relative to it, never through a path that could be swapped for a symlink)."""

    def __init__(self, root: str):
        self.path = tempfile.mkdtemp(prefix=f"{PRIVATE_PREFIX}{os.getpid()}-", dir=root)
        self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        self._lock_fd = runlock.acquire(_LOCK, dir_fd=self.fd, what=self.path)

    def close(self) -> None:
        """Release the lock and remove the directory (left alone if files not ours are inside)."""
        try:
            os.unlink(_LOCK, dir_fd=self.fd)
        except FileNotFoundError:
            pass
        runlock.release(self._lock_fd)
        os.close(self.fd)
        try:
            os.rmdir(self.path)
        except OSError:
            pass


def remove_stale(root: str) -> list[str]:
    """Remove the private swap directories under `root` whose run is dead (their lock is free,
    or, without a lock file, their pid is gone); only `*.swp` files and the lock file inside
    are deleted, only in directories of this user. Returns one notice per directory removed."""
    notices = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return notices
    for entry in entries:
        m = _PRIVATE.fullmatch(entry.name)
        if m is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            dfd = os.open(entry.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            names = os.listdir(dfd)
            dead = runlock.is_stale(_LOCK, dir_fd=dfd) if _LOCK in names else not _alive(int(m.group(1)))
            if not dead:
                continue
            freed = 0
            for name in names:
                if name == _LOCK or name.endswith(".swp"):
                    fst = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                    if stat.S_ISREG(fst.st_mode) or stat.S_ISLNK(fst.st_mode):
                        freed += fst.st_size if name != _LOCK and stat.S_ISREG(fst.st_mode) else 0
                        os.unlink(name, dir_fd=dfd)
        except OSError:
            continue
        finally:
            os.close(dfd)
        try:
            os.rmdir(entry.path)
        except OSError:
            pass  # someone else's files are inside: left alone
        notices.append(f"removed stale swap directory {entry.path} of a run that is no longer "
                       f"running (pid {m.group(1)}, {format_size(freed)} freed)")
    return notices


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
