"""CXL tier: sysfs detection on a fake tree, mbind on the real node, emulated node, placement."""

from __future__ import annotations

import os
import time

import pytest
import torch

from tierwise.offload.runtime.aligned import aligned_empty
from tierwise.offload.runtime.cxl import (CxlAllocator, NumaNode, bind_to_nodes, cxl_aware_kinds,
                         detect_cxl_nodes, detect_numa_nodes, nodemask, parse_cpulist,
                         place_kinds)
from tierwise.offload.core.errors import BudgetExceeded, TierwiseError

GIB = 1 << 30


@pytest.mark.parametrize("text,cpus", [
    ("0-3,8,10-11\n", (0, 1, 2, 3, 8, 10, 11)),
    ("5", (5,)),
    ("", ()),
    ("\n", ()),
], ids=repr)
def test_parse_cpulist(text, cpus):
    assert parse_cpulist(text) == cpus


def _fake_sysfs(root, nodes: dict[int, tuple[str, int | None]]) -> str:
    """nodes: id -> (cpulist text, MemTotal in kB or None for no meminfo file)."""
    for nid, (cpulist, kb) in nodes.items():
        d = root / f"node{nid}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpulist)
        if kb is not None:
            (d / "meminfo").write_text(f"Node {nid} MemTotal:       {kb} kB\n"
                                       f"Node {nid} MemFree:        {kb // 2} kB\n")
    (root / "possible").write_text("0-3\n")
    (root / "power").mkdir()
    return str(root)


def test_detect_on_fake_sysfs(tmp_path):
    root = _fake_sysfs(tmp_path / "node", {
        0: ("0-3,8,10-11\n", 16 * 1024 * 1024),
        1: ("\n", 64 * 1024 * 1024),  # CXL expander: memory, no CPUs
        2: ("4-7\n", 16 * 1024 * 1024),
        3: ("", 0),  # neither memory nor CPUs: not a CXL node
        10: ("", None),  # no meminfo at all
    })
    nodes = detect_numa_nodes(root)
    assert [n.id for n in nodes] == [0, 1, 2, 3, 10]
    assert nodes[0] == NumaNode(id=0, mem_total=16 * GIB, cpus=(0, 1, 2, 3, 8, 10, 11))
    assert [n.id for n in detect_cxl_nodes(root)] == [1]
    assert detect_cxl_nodes(root)[0].mem_total == 64 * GIB
    assert detect_numa_nodes(str(tmp_path / "missing")) == []


def test_real_sysfs_has_a_node_with_cpus():
    if not os.path.isdir("/sys/devices/system/node/node0"):
        pytest.skip("no NUMA sysfs tree on this machine")
    nodes = detect_numa_nodes()
    assert nodes[0].id == 0 and nodes[0].mem_total > 0 and nodes[0].cpus


def test_nodemask():
    assert nodemask([0]) == ([1], 65)
    assert nodemask([1, 3]) == ([0b1010], 65)
    assert nodemask([64]) == ([0, 1], 129)
    with pytest.raises(TierwiseError):
        nodemask([])


def _bind_or_skip(buf, nodes):
    try:
        bind_to_nodes(buf, nodes)
    except TierwiseError as exc:
        if "blocked" in str(exc):
            pytest.skip(f"mbind unavailable here: {exc}")
        raise


def test_mbind_real_node0():
    buf = aligned_empty(1 << 20)
    _bind_or_skip(buf, [0])
    buf.fill_(3)  # pages fault in on node 0
    assert int(buf[-1]) == 3


@pytest.mark.parametrize("nodes", [[63], [0, 5], [2000]], ids=str)
def test_mbind_missing_node_is_a_clear_error(nodes):
    buf = aligned_empty(1 << 16)
    with pytest.raises(TierwiseError, match=rf"NUMA node\(s\) .*{nodes[-1]}.*errno 22"):
        bind_to_nodes(buf, nodes)


def test_allocator_on_forced_real_node():
    alloc = CxlAllocator(nodes=[], node=0, budget_bytes=8 << 20)
    assert not alloc.emulated
    try:
        buf = alloc.allocate(3 << 20)
    except TierwiseError as exc:
        if "blocked" in str(exc):
            pytest.skip(f"mbind unavailable here: {exc}")
        raise
    assert buf.numel() == 3 << 20 and alloc.used == 3 << 20


def test_allocator_refuses_a_missing_node():
    if not detect_numa_nodes():
        pytest.skip("no NUMA sysfs tree on this machine")
    with pytest.raises(TierwiseError, match=r"CXL node\(s\) 77 do not exist here"):
        CxlAllocator(nodes=[], node=77, budget_bytes=1 << 20)


def test_emulated_node_copies_take_link_time():
    bandwidth = 0.5e9
    alloc = CxlAllocator(nodes=[], budget_bytes=16 << 20, emulate_bandwidth=bandwidth)
    assert alloc.emulated
    src = torch.randint(0, 255, (4 << 20,), dtype=torch.uint8)
    cxl = alloc.allocate(src.numel())
    start = time.perf_counter()
    alloc.copy_in(cxl, src)
    back = torch.empty_like(src)
    alloc.copy_out(back, cxl)
    elapsed = time.perf_counter() - start
    assert torch.equal(back, src)
    assert elapsed >= 2 * src.numel() / bandwidth
    assert alloc.link_in.bytes_moved == alloc.link_out.bytes_moved == src.numel()


def test_allocator_budget():
    alloc = CxlAllocator(nodes=[], budget_bytes=1 << 20)
    a = alloc.allocate(600 << 10)
    with pytest.raises(BudgetExceeded, match="tier 'cxl'"):
        alloc.allocate(600 << 10, kind="c3.compute")
    alloc.free(a)
    assert alloc.used == 0
    alloc.allocate(600 << 10)
    with pytest.raises(TierwiseError, match="did not allocate"):
        alloc.free(torch.empty(4, dtype=torch.uint8))


KINDS = {"compute": 4, "grad": 4, "master": 8, "state": 16, "cold": 10}


@pytest.mark.parametrize("dram,cxl,expected", [
    (100, 100, dict(compute="cxl", grad="host", master="host", state="host", cold="cxl")),
    # DRAM holds master+state only: grad spills into what CXL has left...
    (24, 20, dict(compute="cxl", grad="cxl", master="host", state="host", cold="cxl")),
    # ...and to NVMe when latency-tolerant data already filled CXL (each class first
    # gets its preferred tier)
    (24, 16, dict(compute="cxl", grad="nvme", master="host", state="host", cold="cxl")),
    # CXL too small for cold data: it falls back to DRAM, then to NVMe
    (40, 4, dict(compute="cxl", grad="host", master="host", state="host", cold="host")),
    (28, 4, dict(compute="cxl", grad="host", master="host", state="host", cold="nvme")),
    # nothing fits anywhere
    (0, 0, dict(compute="nvme", grad="nvme", master="nvme", state="nvme", cold="nvme")),
], ids=["all-fit", "dram-tight", "dram-tight-cxl-full", "cxl-tight", "both-tight", "none"])
def test_place_kinds(dram, cxl, expected):
    assert place_kinds(KINDS, dram_free=dram, cxl_free=cxl) == expected


def test_place_kinds_keeps_working_set_in_dram_first():
    # Only room for 24 B of DRAM and plenty of CXL: the optimizer state stays local.
    out = place_kinds({"cold": 24, "state": 24}, dram_free=24, cxl_free=100)
    assert out == {"cold": "cxl", "state": "host"}
    assert set(cxl_aware_kinds()) == {"host", "cxl"}
