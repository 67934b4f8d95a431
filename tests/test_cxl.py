"""CXL tier: sysfs detection on a fake tree, mbind on the real node, emulated node, placement."""

from __future__ import annotations

import os
import time

import pytest
import torch

from tierwise.offload.runtime.aligned import aligned_empty
from tierwise.offload.runtime.cxl import (CxlAllocator, NumaNode, bind_to_nodes, cxl_aware_kinds, cxl_regions,
                         describe_cxl_nodes, detect_cxl_nodes, detect_numa_nodes, memory_tiers,
                         nodemask, page_nodes, parse_cpulist, parse_node_list, place_kinds)
from tierwise.offload.core.errors import BudgetExceeded, TierwiseError
from tierwise.offload.core.units import format_size

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
    none = dict(cxl_root=str(tmp_path / "no-cxl"), tiers_root=str(tmp_path / "no-tiers"))
    assert [n.id for n in detect_cxl_nodes(root, **none)] == [1]
    assert detect_cxl_nodes(root, **none)[0].mem_total == 64 * GIB
    assert "CPU-less" in detect_cxl_nodes(root, **none)[0].cxl  # the weakest evidence, said so
    assert detect_numa_nodes(str(tmp_path / "missing")) == []


# What Debian's 6.1 kernel showed in the QEMU guest (tests/cxl_vm) with two CXL devices:
# 128 MiB memory blocks; region0 at 0x590000000 (512 MiB) holds blocks 179-181 of node 1.
BLOCK = 0x8000000


def _fake_sys(tmp_path, *, regions: bool, tiers: bool, memdevs: bool = True):
    """A /sys with node 0 (CPUs), nodes 1 and 2 (CXL, in regions 0 and 1), node 3 (CPU-less,
    memory outside every CXL region: HBM or a GPU's memory)."""
    sys = tmp_path / "sys"
    nodes = sys / "devices/system/node"
    layout = {0: ("0-1", range(0, 16), "10 20 20 20"), 1: ("", range(179, 182), "20 10 20 20"),
              2: ("", range(211, 214), "20 20 10 20"), 3: ("", range(240, 244), "20 20 20 10")}
    for nid, (cpus, blocks, dist) in layout.items():
        d = nodes / f"node{nid}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
        (d / "distance").write_text(dist + "\n")
        (d / "meminfo").write_text(f"Node {nid} MemTotal: {len(blocks) * BLOCK // 1024} kB\n")
        for b in blocks:
            (d / f"memory{b}").mkdir()
    (sys / "devices/system/memory").mkdir(parents=True)
    (sys / "devices/system/memory/block_size_bytes").write_text(f"{BLOCK:x}\n")
    cxl = sys / "bus/cxl/devices"
    cxl.mkdir(parents=True)
    for name in ("root0", "decoder0.0") + (("mem0", "mem1") if memdevs else ()):
        (cxl / name).mkdir()
    if regions:
        for i, (start, target) in enumerate([(0x590000000, "decoder4.0"), (0x690000000, "decoder3.0")]):
            r = cxl / f"region{i}"
            r.mkdir()
            for f, v in {"resource": hex(start), "size": "0x20000000", "interleave_ways": "1",
                         "target0": target, "commit": "1"}.items():
                (r / f).write_text(v + "\n")
        (cxl / "region2").mkdir()  # created, never configured: no resource, size 0
        (cxl / "region2/size").write_text("0x0\n")
        (cxl / "region2/resource").write_text("18446744073709551615\n")
    if tiers:
        for tier, nodelist in ((4, "0,3"), (22, "1-2")):
            t = sys / f"devices/virtual/memory_tiering/memory_tier{tier}"
            t.mkdir(parents=True)
            (t / "nodelist").write_text(nodelist + "\n")
    return dict(sysfs_root=str(nodes), cxl_root=str(cxl),
                tiers_root=str(sys / "devices/virtual/memory_tiering"),
                memory_root=str(sys / "devices/system/memory"))


@pytest.mark.parametrize("tiers", [True, False], ids=["with-tiers", "no-tiers"])
def test_detect_trusts_cxl_regions_over_being_cpu_less(tmp_path, tiers):
    roots = _fake_sys(tmp_path, regions=True, tiers=tiers)
    assert [r.name for r in cxl_regions(roots["cxl_root"])] == ["region0", "region1"]
    found = detect_cxl_nodes(roots.pop("sysfs_root"), **roots)
    assert [n.id for n in found] == [1, 2]  # node 3 has no CPUs but is in no CXL region
    assert found[0].cxl == "CXL region0 (512.00 MiB, 1-way: decoder4.0)"
    assert found[1].cxl.startswith("CXL region1") and found[1].mem_total == 3 * BLOCK
    cpu = NumaNode(id=0, mem_total=16 * BLOCK, cpus=(0, 1), distance=(10, 20, 20, 20))
    assert found[0].describe([cpu]) == ("node 1: 384.00 MiB, distance 20 "
                                        "(CXL region0 (512.00 MiB, 1-way: decoder4.0))")


@pytest.mark.parametrize("memdevs", [True, False], ids=["memdevs", "no-memdevs"])
def test_detect_by_memory_tier_without_cxl_regions(tmp_path, memdevs):
    roots = _fake_sys(tmp_path, regions=False, tiers=True, memdevs=memdevs)
    assert memory_tiers(roots["tiers_root"]) == {0: 4, 3: 4, 1: 22, 2: 22}
    found = detect_cxl_nodes(roots.pop("sysfs_root"), **roots)
    tier = "memory tier 22, below the CPUs' tier 4"
    # node 3 shares the CPUs' tier: CXL only because the bus shows memory devices
    assert [(n.id, n.cxl) for n in found] == [(1, tier), (2, tier)] + (
        [(3, "CPU-less; the CXL bus shows memory devices (mem0 mem1) but no regions")] if memdevs else [])


def test_detect_a_cxl_bus_without_memory_devices_means_no_cxl(tmp_path):
    roots = _fake_sys(tmp_path, regions=False, tiers=False, memdevs=False)
    assert detect_cxl_nodes(roots.pop("sysfs_root"), **roots) == []


def test_detect_falls_back_to_cpu_less_without_a_cxl_bus(tmp_path):
    roots = _fake_sys(tmp_path, regions=False, tiers=False)
    roots["cxl_root"] = str(tmp_path / "no-cxl-bus")
    found = detect_cxl_nodes(roots.pop("sysfs_root"), **roots)
    assert [(n.id, n.cxl) for n in found] == [(i, "CPU-less (no CXL bus in sysfs to confirm)")
                                             for i in (1, 2, 3)]


def test_describe_real_machine_lists_only_cxl_nodes():
    assert len(describe_cxl_nodes()) == len(detect_cxl_nodes())


@pytest.mark.parametrize("value,ids", [(1, (1,)), ("1", (1,)), ("2,1", (1, 2)), ("1-3", (1, 2, 3)), ("[1, 2]", (1, 2)),
                                       ([2, 1, 2], (1, 2)), (None, None)], ids=repr)
def test_parse_node_list(value, ids):
    assert parse_node_list(value) == ids


@pytest.mark.parametrize("value", ["", "a", "1,x", -1, [], [-2], True], ids=repr)
def test_parse_node_list_refuses(value):
    with pytest.raises(TierwiseError, match="--cxl-node"):
        parse_node_list(value)


def test_cli_cxl_node_takes_several_nodes():
    from tierwise.cli.config import ConfigError, TrainConfig

    assert TrainConfig(cxl_mem="1M", cxl_node="1,2").cxl_node == (1, 2)
    assert TrainConfig(cxl_mem="1M", cxl_node=3).cxl_node == (3,)
    with pytest.raises(ConfigError, match="--cxl-node 'x'"):
        TrainConfig(cxl_mem="1M", cxl_node="x")


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


def test_allocator_buffers_are_their_own_mappings_on_the_node():
    alloc = CxlAllocator(nodes=[], node="0", budget_bytes=8 << 20)
    try:
        bufs = [alloc.allocate(n) for n in (5000, 3 << 20, 1)]
    except TierwiseError as exc:
        if "blocked" in str(exc):
            pytest.skip(f"mbind unavailable here: {exc}")
        raise
    for buf in bufs:
        assert buf.data_ptr() % os.sysconf("SC_PAGE_SIZE") == 0
        assert set(page_nodes(buf)) == {-2}  # bound, not yet touched: no page faulted in
        buf.fill_(7)
        assert set(page_nodes(buf)) == {0}
    assert len(page_nodes(bufs[0])) == 2 and alloc.used == (2 + 768 + 1) * 4096


def test_budget_over_the_nodes_is_refused_with_their_size():
    if not detect_numa_nodes():
        pytest.skip("no NUMA sysfs tree on this machine")
    node0 = detect_numa_nodes()[0]
    alloc = CxlAllocator(nodes=[], node=[0], budget_bytes=1 << 62)
    alloc.check_fits(node0.mem_total)
    with pytest.raises(TierwiseError, match=rf"--cxl-mem .* more than the CXL memory there is "
                                            rf"\(.*node 0: {format_size(node0.mem_total)}\)"):
        alloc.check_fits(node0.mem_total + 1)
    from tierwise.offload import Budget, Engine

    with pytest.raises(TierwiseError, match=f"node 0: {format_size(node0.mem_total)}"):
        Engine(torch.nn.Linear(4, 4), budget=Budget(cxl=node0.mem_total + (1 << 30), cxl_node=0),
               loss_fn=lambda m, b: m(b).sum())


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


def test_plan_and_profile_list_each_cxl_node(monkeypatch):
    import tierwise.offload.runtime.cxl as cxl
    from tierwise.cli.planning import cxl_lines
    from tierwise.offload.tools.profiler import cxl_node_lines

    cpu = NumaNode(id=0, mem_total=16 * BLOCK, cpus=(0, 1), distance=(10, 20, 20))
    found = [NumaNode(id=i, mem_total=3 * BLOCK, cpus=(), distance=d, cxl=f"CXL region{i - 1}")
             for i, d in ((1, (20, 10, 20)), (2, (21, 20, 10)))]
    monkeypatch.setattr(cxl, "detect_numa_nodes", lambda *a, **k: [cpu] + found)
    monkeypatch.setattr(cxl, "detect_cxl_nodes", lambda *a, **k: found)
    assert cxl_lines() == ["CXL nodes here (pages interleave across those used):",
                           "  node 1: 384.00 MiB, distance 20 (CXL region0)",
                           "  node 2: 384.00 MiB, distance 21 (CXL region1)"]
    assert cxl_node_lines({1: 0.0213}) == [
        "CXL node 1: 384.00 MiB, distance 20 (CXL region0): 0.0213 GB/s copy in",
        "CXL node 2: 384.00 MiB, distance 21 (CXL region1): not measured"]
    monkeypatch.setattr(cxl, "detect_cxl_nodes", lambda *a, **k: [])
    assert cxl_lines() == ["CXL nodes here: none (the engine emulates one in host memory)"]


def test_cxl_vm_shares_an_interpreter_the_guests_tmpfs_would_hide():
    """A venv under /tmp: the guest mounts a tmpfs over /tmp, so its prefix is shared at its
    host path; a prefix elsewhere (seen through the root) or inside the checkout is not."""
    from tests.cxl_vm.harness import REPO, hidden_prefixes

    assert hidden_prefixes(("/tmp/venv", "/usr")) == ["/tmp/venv"]
    assert hidden_prefixes(("/run/user/0/env", "/tmp/venv", "/tmp/venv")) == ["/run/user/0/env", "/tmp/venv"]
    assert hidden_prefixes(("/tmpfoo", "/opt/py")) == []
    assert hidden_prefixes((str(REPO / ".venv"),)) == []  # inside the checkout: shared with it
