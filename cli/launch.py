"""Several processes on one node: torchrun's environment, the default process group, the
share of the node's budgets each local rank gets, and `--nproc-per-node N` as a shorthand that
starts torchrun.

`torchrun --nproc-per-node N -m tierwise.cli.main ...` (or `accelerate launch`, which sets the
same variables) runs one `finetune` per rank: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and
the rendezvous (MASTER_ADDR/PORT) come from it. `finetune --nproc-per-node N ...` runs itself
again as `torchrun --standalone --nproc-per-node N` does, torchrun's agent in this process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..offload.core.errors import DIST_TIMEOUT_S, TierwiseError
from ..offload.runtime.cores import cpu_share


@dataclass(frozen=True)
class RankInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1

    @property
    def several(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        """Rank 0: the one that prints, writes --output and exports."""
        return self.rank == 0


def from_env(env: "dict[str, str] | None" = None) -> RankInfo:
    """This process's place among torchrun's ranks (one rank without torchrun's variables)."""
    env = os.environ if env is None else env
    world = int(env.get("WORLD_SIZE", "1"))
    if world <= 1:
        return RankInfo()
    local_world = int(env.get("LOCAL_WORLD_SIZE", str(world)))
    return RankInfo(rank=int(env["RANK"]), world=world, local_rank=int(env.get("LOCAL_RANK", "0")),
                    local_world=local_world)


def init_group(info: RankInfo, *, timeout_s: float = DIST_TIMEOUT_S) -> None:
    """Join the default process group (gloo on the CPU, NCCL with CUDA) from torchrun's
    environment; each rank takes its local GPU."""
    import torch
    import torch.distributed as dist

    if not info.several or dist.is_initialized():
        return
    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(info.local_rank)
        backend = "nccl"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


def on_node(info: RankInfo) -> RankInfo:
    """`info` with `local_world` counted as the engine counts its node's ranks
    (offload.engine.ranks.same_node: host name, boot id, torchrun's node rank), so the budgets
    divided here and the engine's shares agree (LOCAL_WORLD_SIZE is a launcher's word for the
    same). Collective over the default group."""
    if not info.several:
        return info
    from ..offload.engine.ranks import gather_objects, node_key, same_node

    keys = gather_objects(node_key(), "finding the ranks of this node")
    return dataclasses.replace(info, local_world=len(same_node(keys, info.rank)))


#: Test hook, never set in normal use: "RANK:STEP:ACTION" makes rank RANK misbehave at the start
#: of step STEP (the other ranks are already in it): "raise" (a RuntimeError) or "kill" (SIGKILL of
#: its own process, as the OOM killer does), each naming the time.time() it happened at.
FAULT_ENV = "TIERWISE_TEST_RANK_FAULT"


def fault(info: RankInfo, step: int) -> None:
    """The FAULT_ENV test hook; a no-op unless it names this rank and step."""
    parts = os.environ.get(FAULT_ENV, "").split(":")
    if len(parts) != 3 or not (parts[0].isdigit() and parts[1].isdigit()):
        return
    if int(parts[0]) != info.rank or int(parts[1]) != step:
        return
    import time

    if parts[2] == "kill":
        sys.stderr.write(f"{FAULT_ENV}: rank {info.rank} kills itself at t={time.time():.3f}\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    if parts[2] == "raise":
        raise RuntimeError(f"injected failure at step {step} ({FAULT_ENV}, at t={time.time():.3f})")


FAILURE_KEY = "tierwise/failed/"


def _store():
    """The default process group's key-value store (torchrun's rendezvous store): it outlives
    a rank that stops."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def report_failure(info: RankInfo, exc: BaseException) -> None:
    """Leave this rank's cause in the store before it stops, for the others' error (best effort)."""
    text = (str(exc).strip().splitlines() or [""])[0]
    try:
        _store().set(f"{FAILURE_KEY}{info.rank}", f"{type(exc).__name__}: {text}"[:300])
    except Exception:  # noqa: BLE001 - no store, no cause: the others still name the rank
        pass


def failure_of_others(info: RankInfo) -> "str | None":
    """'rank R failed: <cause>' of another rank that reported one (None: none did, e.g. it was
    killed). No wait: a rank reports before its connections close, i.e. before the others fail."""
    try:
        store = _store()
        for r in range(info.world):
            key = f"{FAILURE_KEY}{r}"
            if r != info.rank and store.check([key]):
                return f"rank {r} failed: {store.get(key).decode(errors='replace')}"
    except Exception:  # noqa: BLE001 - the store went with the launcher: no cause to add
        pass
    return None


def finish_failing() -> None:
    """A rank that is failing finishes saying why: torchrun SIGTERMs every rank as soon as one
    exits, which would cut the others' error line short (it SIGKILLs them after its grace
    period all the same)."""
    import threading

    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)


class Refused(TierwiseError):
    """A refusal every rank raises together (`agree`): rank 0 alone prints it, every rank exits 2."""

    every_rank = True


def agree(info: RankInfo, error: "TierwiseError | None", what: str) -> None:
    """After a check every rank runs on its own (the pre-flight): if any refused, every rank
    raises Refused with the first refusal (naming its rank where the ranks differ), so no rank
    goes on into a collective another has left. Collective over the default group."""
    if not info.several:
        if error is not None:
            raise error
        return
    from ..offload.engine.ranks import gather_objects

    line = None if error is None else (str(error).splitlines() or [type(error).__name__])[0]
    lines = gather_objects(line, what)
    refused = [(r, text) for r, text in enumerate(lines) if text is not None]
    if refused:
        rank, text = refused[0]
        raise Refused(text if lines.count(text) == len(lines) else f"rank {rank}: {text}") from error


def node_share(nbytes: "int | None", info: RankInfo) -> "int | None":
    """A node's budget (--cpu-mem, --cxl-mem) divided among its local ranks."""
    return None if nbytes is None else nbytes // info.local_world


#: a rank's exit code for a user error (cli.main: its one `error:` line printed)
USER_ERROR = 2


def relaunch(nproc: int, argv: list[str]) -> int:
    """Run this command again on `nproc` ranks, torchrun's agent in this process; the exit code:
    0, 2 when every rank that failed did so with a user error (rank 0 printed its one line:
    torchrun's summary of the failed ranks is left out), 128 + a signal's number that stopped
    the agent (after the ranks had it), else 1 with that summary."""
    if nproc < 1:
        raise TierwiseError(f"--nproc-per-node must be at least 1, got {nproc}")
    args = drop_option(argv, "--nproc-per-node")
    os.environ.setdefault("OMP_NUM_THREADS", str(cpu_share(nproc)))  # each rank its share of the cores
    if "LOGLEVEL" not in os.environ:  # torchrun's log lines: the ranks (and the summary below) speak
        os.environ["LOGLEVEL"] = "ERROR"
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(["--standalone", f"--nproc-per-node={nproc}", "--tee=0", "-m", "tierwise.cli.main", *args]))
    except ChildFailedError as exc:
        if {f.exitcode for f in exc.failures.values()} == {USER_ERROR}:
            return USER_ERROR
        sys.stderr.write(exc.format_msg() + "\n")
        return 1
    except SignalException as exc:
        return 128 + int(exc.sigval)
    return 0


def drop_option(argv: list[str], flag: str) -> list[str]:
    """`argv` without `flag VALUE` / `flag=VALUE`."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == flag:
            skip = True
            continue
        if a.startswith(flag + "="):
            continue
        out.append(a)
    return out


SCRATCH_PREFIX = "tierwise-rank"


@contextlib.contextmanager
def rank_scratch(rank: int, directory: "str | None" = None) -> Iterator[Path]:
    """A rank other than 0 writes what rank 0 keeps in --output (plots, its metrics) into a
    scratch directory, removed when the run ends. A rank SIGKILLed cannot remove its own: the
    directory names its pid, and the next run's ranks remove those of this user whose process
    is gone."""
    base = Path(directory or tempfile.gettempdir())
    for old in base.glob(f"{SCRATCH_PREFIX}*-p*-*"):
        try:
            pid = int(old.name.split("-p", 1)[1].split("-", 1)[0])
            if old.is_dir() and not old.is_symlink() and old.stat().st_uid == os.getuid() and not _alive(pid):
                shutil.rmtree(old, ignore_errors=True)
        except (ValueError, OSError):
            continue
    path = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{rank}-p{os.getpid()}-", dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True
