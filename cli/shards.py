"""Checkpoints of several ranks: each rank writes its shard, one manifest ties them together.

Layout of a checkpoint written by N ranks (one rank: cli.checkpoint's layout):

    ckpt-000120/
        rank-0/shard.safetensors + shard.json   rank 0's engine state (the fp32 master and
        rank-1/...                              optimizer state of the chunks it owns) and RNG
        trainer.safetensors + trainer.json      step, data position, schedule, config, world
        manifest.json                           size and crc32s of every file above

Writing, in three handshakes over the default process group (offload.engine.ranks.gather_objects):
rank 0 makes `ckpt-000120.tmp/`; every rank writes, fsyncs and checksums its shard there (in
parallel) and reports its manifest entries; once all have, rank 0 writes the trainer state and
the manifest, renames the directory into place and moves `latest` (cli.checkpoint.publish),
and says so. So a checkpoint directory is complete or absent, whichever rank dies when: a
failure on any rank fails the save on every rank, naming the rank. --output must be one
directory every rank sees (several nodes: a shared filesystem; a rank that cannot see it says so).

Loading: every rank verifies the trainer state and its own shard against the manifest (in
parallel); a mismatch on any rank stops every rank, naming the file. The world size must be
the checkpoint's: each rank reads back exactly the chunks it owned (ownership is k mod N).
Resharding on load is not built.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any


from . import checkpoint as ckpt
from . import manifest
from ..offload.core.errors import TierwiseError

SHARD = "shard"
EXTS = ("safetensors", "json")
TRAINER = [f"trainer.{e}" for e in EXTS]


def rank_files(rank: int) -> list[str]:
    return [f"rank-{rank}/{SHARD}.{e}" for e in EXTS]


def _gather(obj: Any, what: str) -> list:
    from ..offload.engine.ranks import gather_objects

    return gather_objects(obj, what)


def _say(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


def _agree(payload: Any, err: "BaseException | None", what: str) -> list:
    """Every rank's payload once each has done its part; the first failure raised on every rank
    (the failing rank its own exception, the others one naming it)."""
    got = _gather((payload, None if err is None else _say(err)), what)
    if err is not None:
        raise err
    for r, (_, said) in enumerate(got):
        if said is not None:
            raise ckpt.CheckpointError(f"rank {r}: {said}")
    return [p for p, _ in got]


def save(output_dir: "str | Path", *, step: int, rank: int, shard: dict, trainer_state: dict,
         world: int, keep: int = 2) -> Path:
    """Collective: checkpoint `step` from every rank's `shard` ({"engine", "rng"}) and rank 0's
    `trainer_state`; returns its path on every rank."""
    output_dir = Path(output_dir)
    tmp = output_dir / (ckpt.ckpt_name(step) + ".tmp")
    err: BaseException | None = None
    try:
        if rank == 0:
            try:
                ckpt.start_save(output_dir, step)
            except Exception as e:  # noqa: BLE001
                err = e
        _agree(None, err, f"starting checkpoint {step}")
        try:
            if not tmp.is_dir():
                raise ckpt.CheckpointError(f"{tmp} is not visible on rank {rank}: with several nodes, "
                                           "--output must be on a filesystem every node shares")
            mine = tmp / f"rank-{rank}"
            mine.mkdir()
            ckpt._fault(step, "before_write")
            ckpt.save_tree(mine, SHARD, shard)
            ckpt._fsync_dir(mine)
            files = manifest.entries(tmp, rank_files(rank))
        except Exception as e:  # noqa: BLE001 - every rank learns of it (_agree)
            err, files = e, None
        reported = _agree(files, err, f"writing the shards of checkpoint {step}")
        final = None
        if rank == 0:
            try:
                ckpt.save_tree(tmp, "trainer", {**trainer_state, "step": step, "world": world})
                manifest.write(tmp, TRAINER, files={k: v for part in reported for k, v in part.items()})
                ckpt._fsync_dir(tmp)
                final = ckpt.publish(output_dir, tmp, step=step, keep=keep)
            except Exception as e:  # noqa: BLE001
                err = e
        _agree(None, err, f"completing checkpoint {step}")
        return final or output_dir / ckpt.ckpt_name(step)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # free the space a full disk needs back
        raise


def world_of(trainer: dict) -> int:
    """The number of ranks that wrote a checkpoint (its trainer state)."""
    return int(trainer.get("world", 1)) if isinstance(trainer, dict) else 1


def load(path: "str | Path", *, rank: int) -> tuple[Any, dict, dict]:
    """Collective: (this rank's engine state, the trainer state, this rank's RNG state) of a
    checkpoint of several ranks, each rank's files verified against the manifest first."""
    path = Path(path)
    err = None
    try:
        manifest.verify(path, TRAINER + rank_files(rank))
    except TierwiseError as e:
        err = e
    _agree(None, err, f"verifying checkpoint {path.name}")
    try:
        trainer = ckpt.load_tree(path, "trainer")
        shard = ckpt.load_tree(path / f"rank-{rank}", SHARD, lazy=True)
        return shard["engine"], trainer, shard["rng"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ckpt.CheckpointError(f"cannot read checkpoint {path}: {_say(e)}") from None
