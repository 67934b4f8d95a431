"""The CXL tier: detect CXL NUMA nodes, bind buffers to them, place kinds CXL-aware.

CXL memory expanders appear to Linux as NUMA nodes that have memory but no CPUs. Having no
CPUs is not proof (HBM and a GPU's coherent memory look the same), so `detect_cxl_nodes` asks
sysfs: a node whose memory lies in a region of the CXL bus (/sys/bus/cxl/devices/regionN) is
CXL; where the kernel shows no CXL regions, a node in a slower memory tier than the CPUs'
(/sys/devices/virtual/memory_tiering), or any CPU-less node when the bus shows CXL memory
devices or there is no CXL bus in sysfs to ask (each node's `cxl` note says which). Buffers are bound to such
nodes with the `mbind` syscall (through ctypes; MPOL_BIND for one node, MPOL_INTERLEAVE to
stripe pages across several). Where no CXL node exists (or the kernel
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
import mmap
import os
import platform
import re
from dataclasses import dataclass
from typing import Sequence

import torch

from .aligned import aligned_empty
from ..core.errors import BudgetExceeded, TierwiseError
from .link import Link
from ..core.nodes import parse_cpulist, parse_node_list  # noqa: F401 (the planner's and CLI's parsing)
from ..core.units import format_size

log = logging.getLogger(__name__)

SYSFS_NODES = "/sys/devices/system/node"
SYSFS_CXL = "/sys/bus/cxl/devices"
SYSFS_TIERS = "/sys/devices/virtual/memory_tiering"
SYSFS_MEMORY = "/sys/devices/system/memory"
_SYS_MBIND = {"x86_64": 237, "aarch64": 235}
_SYS_MOVE_PAGES = {"x86_64": 279, "aarch64": 239}
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
    distance: tuple[int, ...] = ()  # nodeN/distance: to node 0, 1, ... (10 = local)
    cxl: str = ""  # why this node is taken as CXL memory ("" for one that is not)

    @property
    def cpu_less(self) -> bool:
        return not self.cpus

    def describe(self, cpu_nodes: Sequence["NumaNode"] = ()) -> str:
        """'node 1: 384 MiB, distance 20 (CXL region0 ...)': for the planner and the profile.
        The distance is from the nearest of `cpu_nodes` (its own row's smallest entry to
        another node without them)."""
        near = [self.distance[c.id] for c in cpu_nodes if c.id < len(self.distance)]
        near = near or [d for i, d in enumerate(self.distance) if i != self.id]
        dist = f", distance {min(near)}" if near else ""
        return f"node {self.id}: {format_size(self.mem_total)}{dist} ({self.cxl or 'not CXL'})"


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
                              cpus=parse_cpulist(_read(f"{d}/cpulist")),
                              distance=tuple(int(x) for x in _read(f"{d}/distance").split())))
    return sorted(nodes, key=lambda n: n.id)


@dataclass(frozen=True)
class CxlRegion:
    """One region of the CXL bus: host physical range [start, start + size) and its targets
    (endpoint decoders, one per interleaved device)."""

    name: str
    start: int
    size: int
    targets: tuple[str, ...]


def _int(text: str) -> int | None:
    try:
        return int(text.strip(), 0)
    except ValueError:
        return None


def cxl_regions(cxl_root: str = SYSFS_CXL) -> list[CxlRegion]:
    """The committed regions under `cxl_root` that have a host physical range; [] when none."""
    try:
        names = sorted(n for n in os.listdir(cxl_root) if re.fullmatch(r"region\d+", n))
    except FileNotFoundError:
        return []
    regions = []
    for name in names:
        d = os.path.join(cxl_root, name)
        start, size = _int(_read(f"{d}/resource")), _int(_read(f"{d}/size"))
        if start is None or not size:
            continue  # not (yet) configured: no memory behind it
        ways = _int(_read(f"{d}/interleave_ways")) or 0
        targets = tuple(_read(f"{d}/target{i}").strip() for i in range(ways))
        regions.append(CxlRegion(name=name, start=start, size=size, targets=targets))
    return regions


def _node_ranges(node_dir: str, block_bytes: int) -> list[tuple[int, int]]:
    """Physical ranges of the memory blocks sysfs links into `node_dir` (memoryN entries)."""
    try:
        names = os.listdir(node_dir)
    except FileNotFoundError:
        return []
    blocks = [int(m.group(1)) for n in names if (m := re.fullmatch(r"memory(\d+)", n))]
    return [(b * block_bytes, (b + 1) * block_bytes) for b in blocks]


def memory_tiers(tiers_root: str = SYSFS_TIERS) -> dict[int, int]:
    """node id -> memory tier number (a higher number is a slower tier); {} without the tree."""
    try:
        names = os.listdir(tiers_root)
    except FileNotFoundError:
        return {}
    tiers = {}
    for name in names:
        if m := re.fullmatch(r"memory_tier(\d+)", name):
            for node in parse_cpulist(_read(os.path.join(tiers_root, name, "nodelist"))):
                tiers[node] = int(m.group(1))
    return tiers


def detect_cxl_nodes(sysfs_root: str = SYSFS_NODES, *, cxl_root: str = SYSFS_CXL,
                     tiers_root: str = SYSFS_TIERS, memory_root: str = SYSFS_MEMORY) -> list[NumaNode]:
    """The CXL memory nodes, each with its evidence in `cxl`.

    A CPU-less node with memory is CXL when (in this order of trust):
    1. a memory block of it lies in a region of the CXL bus (`cxl_root`): "CXL region0 ...";
       when the bus shows regions, a CPU-less node outside all of them is not CXL (HBM, a
       GPU's memory);
    2. it sits in a slower memory tier than every CPU node's (kmem-onlined memory);
    3. the CXL bus shows memory devices but no regions (memory the firmware set up, on a
       kernel that does not show its regions);
    4. there is no CXL bus in sysfs at all (no cxl_core, a container): it has no CPUs.
    A CXL bus without memory devices says there is no CXL memory: such a node is not CXL.
    """
    nodes = detect_numa_nodes(sysfs_root)
    candidates = [n for n in nodes if n.mem_total > 0 and n.cpu_less]
    if not candidates:
        return []
    regions = cxl_regions(cxl_root)
    memdevs = _memdevs(cxl_root)
    tiers = memory_tiers(tiers_root)
    cpu_tier = max((tiers[n.id] for n in nodes if n.cpus and n.id in tiers), default=None)
    block = _int("0x" + _read(f"{memory_root}/block_size_bytes").strip())  # hex, no 0x
    found = []
    for node in candidates:
        why = ""
        if regions:
            ranges = _node_ranges(os.path.join(sysfs_root, f"node{node.id}"), block) if block else []
            hits = [r for r in regions if any(lo < r.start + r.size and r.start < hi for lo, hi in ranges)]
            why = "CXL " + ", ".join(f"{r.name} ({format_size(r.size)}, {len(r.targets)}-way: "
                                     f"{' '.join(r.targets)})" for r in hits) if hits else ""
        elif cpu_tier is not None and tiers.get(node.id, cpu_tier) > cpu_tier:
            why = f"memory tier {tiers[node.id]}, below the CPUs' tier {cpu_tier}"
        elif memdevs:
            why = f"CPU-less; the CXL bus shows memory devices ({' '.join(memdevs)}) but no regions"
        elif not os.path.isdir(cxl_root):
            why = "CPU-less (no CXL bus in sysfs to confirm)"
        if why:
            found.append(NumaNode(id=node.id, mem_total=node.mem_total, cpus=node.cpus,
                                  distance=node.distance, cxl=why))
        else:
            log.info("NUMA node %d has no CPUs but is not CXL memory (%s); name it with "
                     "--cxl-node to use it anyway", node.id,
                     "in no CXL region" if regions else "the CXL bus shows no memory devices")
    return found


def _memdevs(cxl_root: str) -> list[str]:
    try:
        return sorted((n for n in os.listdir(cxl_root) if re.fullmatch(r"mem\d+", n)),
                      key=lambda n: int(n[3:]))
    except FileNotFoundError:
        return []


def describe_cxl_nodes(nodes: Sequence[NumaNode] | None = None) -> list[str]:
    """One line per CXL node (size, distance from the nearest CPU node, evidence)."""
    nodes = detect_cxl_nodes() if nodes is None else nodes
    cpu_nodes = [n for n in detect_numa_nodes() if n.cpus]
    return [n.describe(cpu_nodes) for n in nodes]


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


def page_nodes(tensor: torch.Tensor) -> list[int]:
    """The NUMA node of each page of `tensor` (move_pages in query mode: nothing moves);
    a negative entry is -errno (-2, ENOENT: not faulted in yet). For checking placement."""
    nr = _SYS_MOVE_PAGES.get(platform.machine())
    if nr is None:
        raise TierwiseError(f"move_pages is not supported on {platform.machine()}")
    page = os.sysconf("SC_PAGE_SIZE")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return []
    first = tensor.data_ptr() // page
    count = (tensor.data_ptr() + nbytes - 1) // page - first + 1
    pages = (ctypes.c_void_p * count)(*[(first + i) * page for i in range(count)])
    status = (ctypes.c_int * count)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    res = libc.syscall(ctypes.c_long(nr), 0, ctypes.c_ulong(count), pages, None, status, 0)
    if res != 0:
        err = ctypes.get_errno()
        raise TierwiseError(f"move_pages (query) failed: errno {err}, {os.strerror(err)}")
    return list(status)


class CxlAllocator:
    """Chunk buffers on CXL node(s), within a hard byte budget.

    nodes: CXL node ids (or NumaNode) to stripe across (MPOL_INTERLEAVE: page i on node
        i mod len(nodes)); [] -> an emulated node: host memory behind links of
        `emulate_bandwidth` bytes/s each way (None: unthrottled).
    node: force node(s) (the CLI's --cxl-node 1 or 1,2); overrides `nodes`.
    """

    def __init__(self, *, nodes: Sequence["int | NumaNode"], budget_bytes: int,
                 emulate_bandwidth: float | None = None,
                 node: "int | Sequence[int] | None" = None) -> None:
        forced = parse_node_list(node)
        ids = list(forced) if forced is not None else [getattr(n, "id", n) for n in nodes]
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

    def check_fits(self, budget_bytes: int, *, what: str = "--cxl-mem") -> None:
        """Refuse a budget larger than the memory of the node(s), naming their sizes: the
        kernel would otherwise fall back or fail deep into a run (MPOL_BIND: OOM kill)."""
        if self.emulated:
            return
        known = {n.id: n for n in detect_numa_nodes()}
        if not known:
            return  # no sysfs tree: nothing to check against
        total = sum(known[i].mem_total for i in self.nodes)
        if budget_bytes > total:
            each = ", ".join(f"node {i}: {format_size(known[i].mem_total)}" for i in self.nodes)
            raise TierwiseError(f"{what} {format_size(budget_bytes)} is more than the CXL "
                                f"memory there is ({format_size(total)}; {each})")

    def allocate(self, nbytes: int, *, kind: str = "chunk") -> torch.Tensor:
        """[nbytes] uint8, page-aligned, bound to the CXL node(s); charged to the budget.

        On a real node each buffer is its own anonymous mapping, bound before its first
        touch: its pages fault in on the node(s), the policy covers no other allocation, and
        the pages go back to the kernel when the buffer is freed (not to malloc's heap, where
        the node binding would stay on memory reused for something else)."""
        charged = -(-nbytes // self._page) * self._page
        if self.used + charged > self.budget_bytes:
            raise BudgetExceeded(tier="cxl", budget=self.budget_bytes, used=self.used,
                                 asked=charged, kind=kind)
        if self.emulated:
            buf = aligned_empty(charged, alignment=self._page, pin=False)
        else:
            mapping = mmap.mmap(-1, max(charged, self._page),
                                flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            buf = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive
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
