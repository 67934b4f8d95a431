"""Atomic, resumable training checkpoints.

Layout of `output_dir`:

    ckpt-000120/          one complete checkpoint (never modified after its rename)
        engine.safetensors + engine.json     engine.state_dict(): tensors + JSON skeleton
        trainer.safetensors + trainer.json   step, RNG states, data position, schedule, config
        manifest.json                        size and crc32s of each file (cli.manifest)
    latest                text file naming the newest complete checkpoint ("ckpt-000120")

Writing: everything goes into `ckpt-XXXXXX.tmp/`; every file and the directory are fsynced;
the directory is renamed into place; `latest` is replaced atomically (temp file + os.replace);
only then are older checkpoints beyond `keep` removed. Loading verifies the manifest first (a
changed byte, dtype, shape or key is refused naming the file), and `latest` can only name a
checkpoint directly inside the output directory. A crash at any point leaves the
previous checkpoint and a valid `latest`; leftover `.tmp` directories are removed by the next
save (and at once when the save fails with an exception, e.g. a full disk). Several ranks:
cli.shards writes one shard per rank into the same directory, with the same steps. Nested state (optimizer state with int keys, tuples, dtypes) is stored as a JSON
skeleton whose tensor leaves point into the safetensors file, so loading never unpickles.
"""

from __future__ import annotations

import json
import os
import random
import re
import resource
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import manifest, tensorfile
from ..offload.core.errors import TierwiseError
from ..offload.runtime.lazy import Deferred

LATEST = "latest"
_NAME = re.compile(r"^ckpt-(\d+)$")

#: Test hook, never set in normal use: "STEP:ACTION" makes the save of checkpoint STEP
#: misbehave. ACTION is "sleep" (sleep 60 s after writing the files, before the rename, so a
#: test can SIGKILL the process mid-save), "abort" (os._exit(3) at that point) or "fsize"
#: (limit this process's file size to 64 KiB before writing, so the write fails as on a full
#: disk; SIGXFSZ is ignored by Python, the write returns EFBIG).
FAULT_ENV = "TIERWISE_TEST_CHECKPOINT_FAULT"


class CheckpointError(TierwiseError):
    """A checkpoint cannot be found or read."""


# -- nested state <-> (JSON skeleton, flat tensors) -------------------------------------------

def flatten(obj: Any, tensors: dict[str, torch.Tensor], path: str = "t") -> Any:
    """JSON-able skeleton of `obj`; its tensors are moved into `tensors` under unique keys."""
    if isinstance(obj, torch.Tensor):
        key = f"{path}#{len(tensors)}"
        tensors[key] = obj
        return {"__tensor__": key}
    if isinstance(obj, Deferred):  # written when its turn comes, read back lazily
        key = f"{path}#{len(tensors)}"
        tensors[key] = obj
        return {"__tensor__": key, "streamed": True}
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": flatten(torch.from_numpy(obj.copy()), tensors, path)}
    if isinstance(obj, dict):
        return {"__dict__": [[flatten(k, tensors, path), flatten(v, tensors, f"{path}.{k}")]
                             for k, v in obj.items()]}
    if isinstance(obj, torch.Size):  # before tuple: Size is a tuple subclass
        return {"__size__": list(obj)}
    if isinstance(obj, (list, tuple)):
        items = [flatten(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]
        return {"__tuple__": items} if isinstance(obj, tuple) else items
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).removeprefix("torch.")}
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot checkpoint a {type(obj).__name__} at {path}")


def unflatten(skel: Any, tensors: "dict[str, Any]") -> Any:
    """Inverse of `flatten` (a streamed tensor comes back as it is in `tensors`: in memory, or a
    cli.tensorfile.Stored still to be read)."""
    if isinstance(skel, list):
        return [unflatten(v, tensors) for v in skel]
    if not isinstance(skel, dict):
        return skel
    if "__tensor__" in skel:
        return tensors[skel["__tensor__"]]
    if "__ndarray__" in skel:
        return unflatten(skel["__ndarray__"], tensors).numpy()
    if "__dict__" in skel:
        return {unflatten(k, tensors): unflatten(v, tensors) for k, v in skel["__dict__"]}
    if "__tuple__" in skel:
        return tuple(unflatten(v, tensors) for v in skel["__tuple__"])
    if "__dtype__" in skel:
        return getattr(torch, skel["__dtype__"])
    if "__size__" in skel:
        return torch.Size(skel["__size__"])
    raise CheckpointError(f"unknown entry in checkpoint skeleton: {sorted(skel)}")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fault(step: int, moment: str) -> None:
    """The FAULT_ENV test hook (see above); a no-op unless it names this step."""
    spec = os.environ.get(FAULT_ENV, "")
    at, _, action = spec.partition(":")
    if not at.strip().isdigit() or int(at) != step:
        return
    if moment == "before_write" and action == "fsize":
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.getrlimit(
            resource.RLIMIT_FSIZE)[1]))
    elif moment == "before_rename" and action == "sleep":
        time.sleep(60)
    elif moment == "before_rename" and action == "abort":
        os._exit(3)


class NonFiniteState(CheckpointError):
    """A floating tensor of the state to checkpoint holds NaN or inf (its path is `where`)."""

    def __init__(self, where: str):
        super().__init__(f"{where} holds NaN or inf")
        self.where = where


def _finite(key: str, t: torch.Tensor) -> None:
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise NonFiniteState(key.partition("#")[0].replace("t.", "state.", 1))


def save_tree(directory: Path, name: str, obj: Any) -> None:
    """Write `name.safetensors` + `name.json` into `directory`, fsynced. Deferred tensors (an
    offloaded run's chunks) are brought into memory one at a time, while they are written.
    Raises NonFiniteState, before the file is complete, if a floating tensor holds NaN or inf."""
    tensors: dict[str, Any] = {}
    skeleton = flatten(obj, tensors)
    tensorfile.write(directory / f"{name}.safetensors", tensors, check=_finite)
    with open(directory / f"{name}.json", "w") as f:
        json.dump(skeleton, f)
        f.flush()
        os.fsync(f.fileno())


def load_tree(directory: Path, name: str, *, lazy: bool = False) -> Any:
    """The object `save_tree` wrote. `lazy`: its streamed tensors (the chunks) come back as
    cli.tensorfile.Stored, to be read one at a time into where they belong."""
    with open(directory / f"{name}.json") as f:
        skeleton = json.load(f)
    stored = tensorfile.index(directory / f"{name}.safetensors")
    streamed = _streamed_keys(skeleton) if lazy else set()
    return unflatten(skeleton, {k: v if k in streamed else v.load() for k, v in stored.items()})


def _streamed_keys(skel: Any) -> set[str]:
    if isinstance(skel, list):
        return set().union(*map(_streamed_keys, skel)) if skel else set()
    if not isinstance(skel, dict):
        return set()
    if "__tensor__" in skel:
        return {skel["__tensor__"]} if skel.get("streamed") else set()
    return set().union(*map(_streamed_keys, skel.values())) if skel else set()


# -- RNG ---------------------------------------------------------------------------------------

def capture_rng() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
             "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -- save / load -------------------------------------------------------------------------------

def ckpt_name(step: int) -> str:
    return f"ckpt-{step:06d}"


def list_checkpoints(output_dir: "str | Path") -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first."""
    out = []
    output_dir = Path(output_dir)
    if output_dir.is_dir():
        for p in output_dir.iterdir():
            m = _NAME.match(p.name)
            if m and p.is_dir() and not p.is_symlink() and (p / "trainer.json").exists():
                out.append((int(m.group(1)), p))
    return sorted(out)


def clean_stale(output_dir: Path) -> None:
    """Remove leftovers of interrupted saves (`*.tmp` and `*.old` checkpoint dirs)."""
    for p in output_dir.glob("ckpt-*"):
        if p.is_dir() and p.suffix in (".tmp", ".old"):
            shutil.rmtree(p, ignore_errors=True)


def save_checkpoint(output_dir: "str | Path", *, step: int, engine_state: Any,
                    trainer_state: dict, keep: int = 2) -> Path:
    """Write checkpoint `step` atomically and point `latest` at it; returns its path."""
    output_dir = Path(output_dir)
    tmp = start_save(output_dir, step)
    try:
        _fault(step, "before_write")
        save_tree(tmp, "engine", engine_state)
        save_tree(tmp, "trainer", {**trainer_state, "step": step})  # trainer.json marks complete
        manifest.write(tmp, [f"{n}.{e}" for n in ("engine", "trainer") for e in ("safetensors", "json")])
        _fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # free the space a full disk needs back
        raise
    return publish(output_dir, tmp, step=step, keep=keep)


def start_save(output_dir: Path, step: int) -> Path:
    """A fresh `ckpt-XXXXXX.tmp` directory for checkpoint `step` (leftovers of interrupted
    saves removed first)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    clean_stale(output_dir)
    tmp = output_dir / (ckpt_name(step) + ".tmp")
    tmp.mkdir()
    return tmp


def publish(output_dir: Path, tmp: Path, *, step: int, keep: int) -> Path:
    """Rename the complete `tmp` into place, point `latest` at it, prune beyond `keep`."""
    final = output_dir / ckpt_name(step)
    _fault(step, "before_rename")
    if final.exists():  # re-saving the same step (e.g. right after a resume)
        old = output_dir / (final.name + ".old")
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(output_dir)
    pointer = output_dir / (LATEST + ".tmp")
    with open(pointer, "w") as f:
        f.write(final.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, output_dir / LATEST)
    _fsync_dir(output_dir)
    for _, old in list_checkpoints(output_dir)[:-keep] if keep > 0 else []:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(output_dir: "str | Path") -> Path | None:
    """The checkpoint `latest` names, or the newest complete one if `latest` is stale."""
    output_dir = Path(output_dir)
    pointer = output_dir / LATEST
    if pointer.is_file() and not pointer.is_symlink():
        name = pointer.read_text(errors="replace").strip()
        candidate = output_dir / name
        # only a checkpoint directly in output_dir: never "../elsewhere/ckpt-1" or a symlink
        if _NAME.fullmatch(name) and candidate.is_dir() and not candidate.is_symlink() \
                and (candidate / "trainer.json").exists():
            return candidate
    found = list_checkpoints(output_dir)
    return found[-1][1] if found else None


def named_latest(output_dir: "str | Path") -> str | None:
    """What `latest` says (None: no such file), to tell a resume that fell back from it."""
    pointer = Path(output_dir) / LATEST
    if not pointer.is_file() or pointer.is_symlink():
        return None
    return pointer.read_text(errors="replace").strip()[:64]


def load_checkpoint(path: "str | Path") -> tuple[Any, dict]:
    """(engine_state, trainer_state) of one checkpoint directory, its manifest verified. The
    engine state's chunks are not read yet (cli.tensorfile.Stored): Engine.load_state_dict reads
    each into its home tier."""
    path = Path(path)
    manifest.verify(path)
    try:
        return load_tree(path, "engine", lazy=True), load_tree(path, "trainer")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def load_trainer(path: "str | Path") -> dict:
    """The trainer state of one checkpoint (small: its options, step, RNG), unverified: to
    compare a resumed run's options before the engine is built."""
    try:
        return load_tree(Path(path), "trainer")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def load_latest(output_dir: "str | Path") -> tuple[Any, dict] | None:
    """(engine_state, trainer_state) of the newest complete checkpoint, or None."""
    path = latest_checkpoint(output_dir)
    return None if path is None else load_checkpoint(path)
