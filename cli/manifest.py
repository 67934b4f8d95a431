"""A checkpoint's checksum manifest: every file's size and crc32s, verified before a resume.

`manifest.json` lists each file of the checkpoint directory with its byte count and one crc32
per 64 MiB block. Blocks are checksummed in a thread pool (zlib releases the GIL), so the cost
scales with the cores: crc32 runs at ~2.8 GiB/s per core on this machine (pclmul). Any changed
byte — a flipped exponent, a tensor's dtype or shape edited in a safetensors header, a
truncated file, an edited engine.json — is refused with the file and byte range named.
Several ranks (cli.shards): each rank checksums and verifies its own files, rank 0 writes the
one manifest of them all.
"""

from __future__ import annotations

import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..offload.core.errors import TierwiseError

NAME = "manifest.json"
BLOCK = 64 << 20
PIECE = 1 << 20  # what one thread reads at a time


class IntegrityError(TierwiseError):
    """A checkpoint's files are not what was written."""


def _crcs(path: Path, pool: ThreadPoolExecutor) -> tuple[int, list[int]]:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size

        def one(offset: int) -> int:  # read in pieces: two threads with 64 MiB each showed in RSS
            crc, view = 0, memoryview(bytearray(PIECE))
            at, end = offset, min(offset + BLOCK, size)
            while at < end:
                n = os.preadv(fd, [view[: min(PIECE, end - at)]], at)
                if n <= 0:
                    raise OSError(f"{path} shrank while it was checksummed")
                crc = zlib.crc32(view[:n], crc)
                at += n
            return crc

        return size, list(pool.map(one, range(0, size, BLOCK)))
    finally:
        os.close(fd)


def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1))


def entries(directory: Path, names: list[str]) -> dict[str, dict]:
    """The manifest entries of `names` (paths relative to `directory`): each rank of a sharded
    checkpoint checksums its own files and hands them to rank 0, who writes the manifest."""
    with _pool() as pool:
        files = {}
        for name in names:
            size, crcs = _crcs(directory / name, pool)
            files[name] = {"bytes": size, "crc32": crcs}
    return files


def write(directory: Path, names: list[str], *, files: "dict[str, dict] | None" = None) -> None:
    """Write (and fsync) the manifest of `names` in `directory`, with `files`: entries computed
    elsewhere (other ranks')."""
    files = {**(files or {}), **entries(directory, names)}
    with open(directory / NAME, "w") as f:
        json.dump({"format": 1, "block": BLOCK, "files": files}, f)
        f.flush()
        os.fsync(f.fileno())


def verify(directory: Path, names: "list[str] | None" = None) -> None:
    """Raise IntegrityError unless every file the manifest lists is intact (`names`: only
    these, each of which it must list: one rank's files of a sharded checkpoint)."""
    try:
        manifest = json.loads((directory / NAME).read_text())
        files, block = manifest["files"], int(manifest["block"])
    except FileNotFoundError:
        raise IntegrityError(f"checkpoint {directory} has no {NAME}: it was not written by this "
                             "version of finetune, or it is damaged") from None
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise IntegrityError(f"checkpoint {directory}: {NAME} is damaged") from None
    if block != BLOCK:
        raise IntegrityError(f"checkpoint {directory}: {NAME} uses blocks of {block} bytes, "
                             f"expected {BLOCK}")
    if names is not None:
        unlisted = [n for n in names if n not in files]
        if unlisted:
            raise IntegrityError(f"checkpoint {directory}: {unlisted[0]} is not in its {NAME}")
        files = {n: files[n] for n in names}
    with _pool() as pool:
        for name, entry in files.items():
            path = directory / name
            try:
                size, crcs = _crcs(path, pool)
            except FileNotFoundError:
                raise IntegrityError(f"checkpoint {directory}: {name} is missing") from None
            if size != entry["bytes"]:
                raise IntegrityError(f"checkpoint {directory}: {name} has {size} bytes, "
                                     f"{entry['bytes']} were written (truncated or changed)")
            for i, (got, want) in enumerate(zip(crcs, entry["crc32"])):
                if got != want:
                    end = min(size, (i + 1) * BLOCK)
                    raise IntegrityError(f"checkpoint {directory}: {name} is corrupted (checksum "
                                         f"mismatch in bytes {i * BLOCK}..{end})")
