"""The CXL tier: detect CPU-less NUMA nodes, bind buffers to them, place kinds CXL-aware.

CXL memory expanders appear to Linux as NUMA nodes that have memory but no CPUs. Buffers are
bound to such nodes with the `mbind` syscall (through ctypes; MPOL_BIND for one node,
MPOL_INTERLEAVE to stripe pages across several). Where no CXL node exists (or the kernel
does not show it), `CxlAllocator` *emulates* one: plain host memory behind a throttled
`Link`, so copies to and from it take the time they would over CXL.

Placement (`place_kinds`): the CPU optimizer's working set (fp32 master, optimizer state,
gradient) stays in local DRAM, since naive placement on CXL slows the optimizer ~4x; latency-
tolerant data (cold chunks, compute copies waiting to be streamed to the GPU) goes to CXL.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import re
from dataclasses import dataclass
from typing import Sequence

import torch

from .aligned import aligned_empty
from ..core.errors import BudgetExceeded, TierwiseError
from .link import Link
from ..core.units import format_size

log = logging.getLogger(__name__)

SYSFS_NODES = "/sys/devices/system/node"
_SYS_MBIND = {"x86_64": 237, "aarch64": 235}
MPOL_BIND, MPOL_INTERLEAVE = 2, 3
_MPOL_MF_STRICT, _MPOL_MF_MOVE = 1 << 0, 1 << 1
_BLOCKED = (errno.EPERM, errno.ENOSYS)  # a syscall filtered out (seccomp) or missing

#: Kinds the CPU optimizer touches every step: they stay in local DRAM.
WORKING_SET = ("master", "state", "grad")


@dataclass(frozen=True, kw_only=True)
class NumaNode:
    """One NUMA node as sysfs shows it."""

    id: int
    mem_total: int  # bytes (nodeN/meminfo MemTotal)
    cpus: tuple[int, ...]  # parsed nodeN/cpulist; empty for a CPU-less (CXL) node

    @property
    def cpu_less(self) -> bool:
        return not self.cpus


def parse_cpulist(text: str) -> tuple[int, ...]:
    """'0-3,8,10-11' -> (0, 1, 2, 3, 8, 10, 11); '' -> ()."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(cpus)


def _mem_total(meminfo: str) -> int:
    m = re.search(r"MemTotal:\s*(\d+)\s*kB", meminfo)
    return int(m.group(1)) * 1024 if m else 0


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return ""


def detect_numa_nodes(sysfs_root: str = SYSFS_NODES) -> list[NumaNode]:
    """All nodes under `sysfs_root` (nodeN directories), by id; [] when there is no such tree."""
    try:
        names = os.listdir(sysfs_root)
    except FileNotFoundError:
        log.info("no NUMA information at %s", sysfs_root)
        return []
    nodes = []
    for name in names:
        m = re.fullmatch(r"node(\d+)", name)
        if m is None:
            continue
        d = os.path.join(sysfs_root, name)
        nodes.append(NumaNode(id=int(m.group(1)), mem_total=_mem_total(_read(f"{d}/meminfo")),
                              cpus=parse_cpulist(_read(f"{d}/cpulist"))))
    return sorted(nodes, key=lambda n: n.id)


def detect_cxl_nodes(sysfs_root: str = SYSFS_NODES) -> list[NumaNode]:
    """Nodes with memory but no CPUs: how CXL memory expanders appear."""
    return [n for n in detect_numa_nodes(sysfs_root) if n.mem_total > 0 and n.cpu_less]


def nodemask(node_ids: Sequence[int]) -> tuple[list[int], int]:
    """(64-bit mask words, maxnode argument) for mbind; pure."""
    if not node_ids or min(node_ids) < 0:
        raise TierwiseError(f"bad NUMA node list {list(node_ids)}: need ids >= 0")
    words = [0] * (max(node_ids) // 64 + 1)
    for n in node_ids:
        words[n // 64] |= 1 << (n % 64)
    return words, len(words) * 64 + 1  # the kernel reads maxnode - 1 bits


def bind_to_nodes(tensor: torch.Tensor, nodes: Sequence[int], *, move: bool = True) -> None:
    """Bind the pages of `tensor` to `nodes` (MPOL_BIND; MPOL_INTERLEAVE across several).

    The range is widened to whole pages: allocate page-aligned buffers (CxlAllocator does)
    so that no neighbouring allocation shares an edge page.
    """
    node_ids = sorted({int(n) for n in nodes})
    nr = _SYS_MBIND.get(platform.machine())
    if nr is None:
        raise TierwiseError(f"binding memory to NUMA nodes is not supported on "
                            f"{platform.machine()}")
    words, maxnode = nodemask(node_ids)
    known = {n.id for n in detect_numa_nodes()}
    if known and not known.issuperset(node_ids):
        missing = ",".join(str(n) for n in node_ids if n not in known)
        here = ",".join(map(str, sorted(known)))
        raise TierwiseError(f"cannot bind memory to NUMA node(s) {missing}: no such node here "
                            f"(nodes: {here}); mbind would fail with errno 22 (EINVAL)")
    page = os.sysconf("SC_PAGE_SIZE")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return
    start = tensor.data_ptr() // page * page
    length = -(-(tensor.data_ptr() + nbytes - start) // page) * page
    mode = MPOL_INTERLEAVE if len(node_ids) > 1 else MPOL_BIND
    mask = (ctypes.c_ulong * len(words))(*words)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    flags = _MPOL_MF_STRICT | _MPOL_MF_MOVE if move else 0
    res = libc.syscall(ctypes.c_long(nr), ctypes.c_void_p(start), ctypes.c_ulong(length),
                       ctypes.c_int(mode), mask, ctypes.c_ulong(maxnode), ctypes.c_uint(flags))
    if res != 0:
        err = ctypes.get_errno()
        why = ("mbind is blocked here (seccomp or no NUMA support)" if err in _BLOCKED else
               "a node that does not exist, has no memory or is outside this process's cpuset"
               if err == 22 else os.strerror(err))
        ids = ",".join(map(str, node_ids))
        raise TierwiseError(f"cannot bind {format_size(nbytes)} to NUMA node(s) {ids}: {why} "
                            f"(errno {err}, {os.strerror(err)})")


class CxlAllocator:
    """Chunk buffers on CXL node(s), within a hard byte budget.

    nodes: CXL node ids (or NumaNode) to stripe across; [] -> an emulated node: host memory
        behind links of `emulate_bandwidth` bytes/s each way (None: unthrottled).
    node: force one node (the CLI's --cxl-node N); overrides `nodes`.
    """

    def __init__(self, *, nodes: Sequence["int | NumaNode"], budget_bytes: int,
                 emulate_bandwidth: float | None = None, node: int | None = None) -> None:
        ids = [node] if node is not None else [getattr(n, "id", n) for n in nodes]
        self.nodes: list[int] = sorted({int(i) for i in ids})
        self._check_nodes()
        self.budget_bytes, self.used = budget_bytes, 0
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._sizes: dict[int, int] = {}  # data_ptr -> bytes charged
        bandwidth = emulate_bandwidth if self.emulated else None
        self.link_in = Link(name="to-cxl", bandwidth=bandwidth)
        self.link_out = Link(name="from-cxl", bandwidth=bandwidth)
        if self.emulated:
            log.info("no CXL node: emulating one in host memory (%s)",
                     f"{emulate_bandwidth / 1e9:.1f} GB/s" if emulate_bandwidth else "unthrottled")

    def _check_nodes(self) -> None:
        known = {n.id: n for n in detect_numa_nodes()}
        if not known:
            return  # no sysfs tree to check against; mbind will tell
        missing = [i for i in self.nodes if i not in known]
        if missing:
            raise TierwiseError(f"CXL node(s) {','.join(map(str, missing))} do not exist here "
                                f"(NUMA nodes: {','.join(map(str, sorted(known)))})")
        for i in self.nodes:
            if known[i].cpus:
                log.warning("NUMA node %d has CPUs: it is local DRAM, not CXL memory", i)

    @property
    def emulated(self) -> bool:
        return not self.nodes

    def allocate(self, nbytes: int, *, kind: str = "chunk") -> torch.Tensor:
        """[nbytes] uint8, page-aligned, bound to the CXL node(s); charged to the budget."""
        charged = -(-nbytes // self._page) * self._page
        if self.used + charged > self.budget_bytes:
            raise BudgetExceeded(tier="cxl", budget=self.budget_bytes, used=self.used,
                                 asked=charged, kind=kind)
        buf = aligned_empty(charged, alignment=self._page, pin=False)
        if not self.emulated:
            bind_to_nodes(buf, self.nodes)
        self.used += charged
        self._sizes[buf.data_ptr()] = charged
        return buf[:nbytes]

    def free(self, buf: torch.Tensor) -> None:
        """Return `buf` (from `allocate`) to the budget; the memory goes when it is unreferenced."""
        charged = self._sizes.pop(buf.data_ptr(), None)
        if charged is None:
            raise TierwiseError("freeing a buffer this CXL allocator did not allocate")
        self.used -= charged

    def copy_in(self, dst_cxl: torch.Tensor, src: torch.Tensor) -> None:
        """dst_cxl <- src over the link into CXL (throttled when emulated)."""
        self.link_in.copy_(dst_cxl, src)

    def copy_out(self, dst: torch.Tensor, src_cxl: torch.Tensor) -> None:
        """dst <- src_cxl over the link out of CXL (throttled when emulated)."""
        self.link_out.copy_(dst, src_cxl)


def cxl_aware_kinds() -> dict[str, str]:
    """The preferred tier of each class of data, and why (documentation as data)."""
    return {
        "host": "optimizer working set (" + ", ".join(WORKING_SET) + "): touched every step",
        "cxl": "latency-tolerant: cold chunks, compute copies waiting to stream to the GPU",
    }


def place_kinds(kinds_bytes: dict[str, int], *, dram_free: int, cxl_free: int) -> dict[str, str]:
    """Tier ('host', 'cxl' or 'nvme') per kind; pure.

    Each kind goes whole to its preferred tier (working set: host, in WORKING_SET order;
    others: cxl, in the order given), so each class gets its preferred tier first; what does
    not fit there then tries the other tier (working-set kinds first), and what fits nowhere
    goes to nvme.
    """
    free = {"host": dram_free, "cxl": cxl_free}
    placed: dict[str, str] = {}

    def fits(kind: str, tier: str) -> bool:
        if kinds_bytes[kind] <= free[tier]:
            free[tier] -= kinds_bytes[kind]
            placed[kind] = tier
            return True
        return False

    working = [k for k in WORKING_SET if k in kinds_bytes]
    tolerant = [k for k in kinds_bytes if k not in WORKING_SET]
    left = [k for k in working if not fits(k, "host")]
    left += [k for k in tolerant if not fits(k, "cxl")]
    for kind in left:
        other = "cxl" if kind in WORKING_SET else "host"
        if not fits(kind, other):
            placed[kind] = "nvme"
    return {k: placed[k] for k in kinds_bytes}
