"""The node's cores divided among its local ranks (no torch here: the launcher uses it too).

L ranks on one node each run the CPU update (torch's intra-op threads: fused AdamW, the 8-bit
kernel); left alone they would start L times one process's threads (their NVMe I/O threads:
offload.runtime.nvme.threads_per_rank). `cpu_threads` decides torch's thread count of a rank:
its share of the cores it may run on, max(1, cores // L) (the planner prices a rank on the same
share: offload.plan.ranks.rank_share), unless the process was given a choice:
- OMP_NUM_THREADS set by the user (or by `finetune --nproc-per-node`, which sets the share):
  kept.
- OMP_NUM_THREADS=1 from torchrun, which sets it when its caller had none (its default, with a
  warning): not a choice. Told apart by the launcher's environment at its start
  (/proc/<parent>/environ, the user's: torchrun adds the variable later, for its workers):
  without OMP_NUM_THREADS there, the share is taken. When that cannot be read, 1 is kept and
  one info line says what to set.
- No OMP_NUM_THREADS (a launcher other than torchrun, mp.spawn): torch would use every core in
  every rank; lowered to the share, never raised (a lower count was someone's choice).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


def cores() -> int:
    """The CPUs this process may run on (its affinity: a cgroup's or taskset's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_share(local_world: int, n_cores: "int | None" = None) -> int:
    """One of `local_world` ranks' share of the cores."""
    return max(1, (cores() if n_cores is None else n_cores) // max(1, local_world))


def launcher_env() -> "dict[str, str] | None":
    """The parent process's environment as it started (None: unreadable)."""
    try:
        with open(f"/proc/{os.getppid()}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


@dataclass(frozen=True)
class Threads:
    """What `cpu_threads` decided: `count` (threads to give torch; None: leave them) and `note`
    (one info line, or None)."""

    count: "int | None"
    note: "str | None" = None


def cpu_threads(local_world: int, *, current: int, env: "dict[str, str] | None" = None,
                n_cores: "int | None" = None, launcher: "dict[str, str] | None | bool" = False) -> Threads:
    """torch's thread count for one of `local_world` ranks (see the module docstring).
    `current`: torch.get_num_threads(); `launcher`: the launcher's starting environment
    (False: read it, `launcher_env`; None: unreadable)."""
    if local_world <= 1:
        return Threads(None)
    env = os.environ if env is None else env
    n_cores = cores() if n_cores is None else n_cores
    share = cpu_share(local_world, n_cores)
    value = env.get("OMP_NUM_THREADS")
    if value is None:  # nobody chose: lower torch's every-core default to the share
        return Threads(share if current > share else None)
    if value.strip() != "1" or "TORCHELASTIC_RUN_ID" not in env or current != 1 or share == 1:
        return Threads(None)  # the user's (or our launcher's) choice, or nothing to gain
    start = launcher_env() if launcher is False else launcher
    if start is None:
        return Threads(None, f"OMP_NUM_THREADS=1 (torchrun's default, or yours): the CPU update runs on one "
                             f"thread per rank; set OMP_NUM_THREADS={share} to give each of the {local_world} "
                             f"local ranks its share of the {n_cores} cores")
    if "OMP_NUM_THREADS" in start:
        return Threads(None)  # the user set 1
    return Threads(share)  # torchrun's default: the share instead
