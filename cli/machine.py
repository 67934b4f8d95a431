"""What this machine has: physical RAM, device memory and the free space under a directory (for
the preflight)."""

from __future__ import annotations

import os
from pathlib import Path


def physical_ram() -> int | None:
    """Bytes of RAM installed (MemTotal), or None where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def available_ram() -> int | None:
    """Bytes of RAM the OS can give a new process now (MemAvailable: free plus reclaimable
    cache), or None where it does not say."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except (ImportError, OSError, AttributeError):
        return None


def ram_over(asked: dict[str, int], process: int, *, beside: int = 0, processes: int = 1) -> str | None:
    """What budgets in host RAM (`asked`: {"--cpu-mem 8.00 GiB": bytes, ...}) with `process`
    bytes for the process(es) beside them ask of this machine's available RAM, said when it is
    more (`beside`: RAM the run takes over, counted as available: a loaded model's weights);
    else None. `finetune`'s rule and the Trainer's (offload.hf) alike."""
    from ..offload.core.units import format_size

    have = available_ram()
    if have is None or sum(asked.values()) + process <= have + beside:
        return None
    there = " the model's weights there included" if beside else ""
    return (f"{' + '.join(asked)} + about {format_size(process)} for the process{'es' * (processes > 1)} is more "
            f"than this machine has available ({format_size(have + beside)} of "
            f"{format_size(physical_ram() or have + beside)} RAM{',' if there else ''}{there})")


def nearest_existing(path: "str | os.PathLike[str]") -> Path | None:
    """`path`, or its nearest parent that exists (where a run would create it), or None."""
    p = Path(path).expanduser().absolute()
    return next((c for c in (p, *p.parents) if c.exists()), None)


def free_disk(path: "str | os.PathLike[str]") -> int | None:
    """Bytes free for this user on the filesystem that holds `path` (or would: the nearest
    existing parent), or None when none of it exists."""
    where = nearest_existing(path)
    if where is None:
        return None
    try:
        st = os.statvfs(where)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def has_cuda() -> bool:
    """The training device of this machine is a CUDA GPU (False without torch)."""
    try:
        import torch
    except ModuleNotFoundError:
        return False
    return torch.cuda.is_available()


def cuda_device() -> "tuple[str, int, int] | None":
    """(name, total bytes, device count) of the current CUDA device, or None without one."""
    if not has_cuda():
        return None
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return props.name, int(props.total_memory), torch.cuda.device_count()


def device_memory() -> int | None:
    """Bytes the training device can give a run: on CUDA the free memory of the current device
    (torch.cuda.mem_get_info); on the simulated device (CPU memory standing in) the RAM, and
    without torch (`finetune plan` on a laptop) the RAM too."""
    try:
        import torch
    except ModuleNotFoundError:
        return physical_ram()

    if torch.cuda.is_available():
        return int(torch.cuda.mem_get_info()[0])
    return physical_ram()
