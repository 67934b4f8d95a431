"""The CXL tier on a real kernel: Debian's kernel under QEMU with one and two emulated CXL
Type-3 devices (each its own CPU-less NUMA node), measured by tests/cxl_vm/guest.py.

Slow (a VM boot and `import torch` under software emulation: ~1.5-3 min per VM); marked
`cxl_vm`. Skips with the reason when QEMU, the Debian packages or a kernel image are missing.
The numbers each test checked are printed: run with `-rP` to see them.
"""

from __future__ import annotations

import sys
from collections import Counter

import pytest

from tierwise.offload.runtime.cxl import place_kinds
from tierwise.offload.core.units import format_size
from tests.cxl_vm import harness

pytestmark = pytest.mark.cxl_vm
WORKING_SET = ("master", "state", "grad")


# (devices, one region interleaved across them, CXL nodes the guest should see)
# CI boots one VM, the two-device one (it checks each node as the one-device VM does, plus the
# interleave); the others run by hand (`-m cxl_vm_full`), since each VM costs 2-5 minutes here.
SETUPS = [pytest.param((1, False, 1), id="one-device", marks=pytest.mark.cxl_vm_full),
          pytest.param((2, False, 2), id="two-devices"),  # two windows: two nodes, MPOL_INTERLEAVE
          # one 2-way region (hardware interleave): one node
          pytest.param((2, True, 1), id="two-devices-one-region", marks=pytest.mark.cxl_vm_full)]


@pytest.fixture(scope="module", params=SETUPS)
def vm(request) -> dict:
    try:
        harness.check_tools()
        harness.find_kernel()
    except harness.Missing as exc:
        pytest.skip(f"no CXL VM here: {exc}")
    devices, interleave, nodes = request.param
    report = harness.run_guest([sys.executable, "-m", "tests.cxl_vm.guest"], devices=devices,
                               interleave=interleave, timeout=600)
    result = report["result"]
    assert result is not None, (f"the guest wrote no result (rc {report['rc']}, "
                                f"{report['wall_s']} s)\n{report['log']}\n{report['console_tail']}")
    assert "error" not in result, result["error"]
    label = (f"{devices} device{'s' if devices > 1 else ''}, "
             + (f"one {devices}-way region" if interleave else f"{nodes} node{'s' if nodes > 1 else ''}"))
    print(f"[{label}] kernel {report['kernel']}, VM wall {report['wall_s']} s, "
          f"in the guest {result['guest_s']} s")
    return {"devices": devices, "interleave": interleave, "nodes": nodes, "label": label,
            "wall_s": report["wall_s"], **result}


def _cxl_ids(vm: dict) -> list[int]:
    return [n["id"] for n in vm["cxl_nodes"]]


def test_detect_finds_each_device_as_a_cxl_node(vm):
    ids = _cxl_ids(vm)
    cpu_nodes = [n["id"] for n in vm["numa_nodes"] if n["cpus"]]
    print(f"[{vm['label']}] CXL nodes: " + "; ".join(vm["describe"]))
    print(f"[{vm['label']}] plan: " + " | ".join(vm["plan_lines"]))
    assert len(ids) == vm["nodes"]
    assert vm["plan_lines"][1:] == [f"  {x}" for x in vm["describe"]]
    assert [x.split(": ")[0] for x in vm["profile_lines"]] == [f"CXL node {i}" for i in ids]
    assert not set(ids) & set(cpu_nodes)
    for n in vm["cxl_nodes"]:
        ways = vm["devices"] if vm["interleave"] else 1
        assert n["cxl"].startswith("CXL region") and f"{ways}-way" in n["cxl"], n  # sysfs evidence
        assert 64 << 20 <= n["mem_total"] <= ways * harness.DEVICE_MB << 20
        assert f"node {n['id']}: {format_size(n['mem_total'])}, distance " in " ".join(vm["describe"])
        assert min(n["distance"][c] for c in cpu_nodes) > 10


def test_cxl_buffers_on_the_cxl_nodes_working_set_in_dram(vm):
    ids, train = set(_cxl_ids(vm)), vm["train"]
    kinds = {k: v for tier in train["homes"].values() for k, v in tier.items()}
    expected = place_kinds(kinds, dram_free=256 << 20, cxl_free=4 << 20)
    assert {k: t for t, d in train["homes"].items() for k in d} == expected
    assert expected["compute"] == "cxl" and all(expected[k] == "host" for k in WORKING_SET)
    per_node, host_pages = Counter(), Counter()
    for b in train["buffers"]:
        pages = {int(k): v for k, v in b["pages"].items()}
        if b["tier"] == "cxl":
            assert set(pages) <= ids, b  # every page on a CXL node (none missing: no negatives)
            per_node.update(pages)
            if len(ids) == 2:  # MPOL_INTERLEAVE: page by page across the two nodes
                counts = [pages.get(n, 0) for n in sorted(ids)]
                assert max(counts) - min(counts) <= 1, b
        else:
            # host DRAM: the working set; or the simulated device (CPU memory): every kind of
            # the chunks the engine keeps there whole
            assert (b["kind"] in WORKING_SET and b["tier"] == "host") or b["tier"] == "gpu", b
            assert not set(pages) & ids and min(pages) >= 0, b  # local DRAM only
            host_pages.update(pages)
    print(f"[{vm['label']}] CXL-tier buffers after training: pages per node {dict(per_node)}; "
          f"master/state/grad pages per node {dict(host_pages)}")
    assert set(per_node) == ids
    if len(ids) == 2:
        a, b = per_node.values()
        assert abs(a - b) <= train["after_training"]["buffers"]


def test_losses_equal_the_run_without_cxl(vm):
    train = vm["train"]
    print(f"[{vm['label']}] losses with CXL {train['losses']} == without {train['reference_losses']}")
    assert train["losses"] == train["reference_losses"]
    assert train["losses_equal"]


@pytest.mark.parametrize("when", ["at_build", "after_training"])
def test_ledger_equals_what_the_kernel_shows(vm, when):
    snap, page = vm["train"][when], vm["train"]["page"]
    ledger = snap["ledger_peak"] if when == "at_build" else snap["ledger_used"]
    if when == "at_build":
        assert snap["ledger_used"] == snap["ledger_peak"]  # the peak is the built homes
    print(f"[{vm['label']}] {when}: ledger {ledger} B, kernel {snap['bytes_on_nodes']} B on the "
          f"CXL nodes ({snap['pages_per_node']} pages) in {snap['buffers']} buffers; "
          f"MemUsed delta {vm['train']['mem_used_delta']}")
    assert 0 <= snap["bytes_on_nodes"] - ledger < snap["buffers"] * page
    # /proc/self/numa_maps agrees page for page (adjacent buffers of one policy share a VMA)
    assert 1 <= snap["numa_maps"]["mappings"] <= snap["buffers"]
    assert snap["numa_maps"]["pages_per_node"] == snap["pages_per_node"]


def test_budget_larger_than_the_nodes_is_refused(vm):
    r = vm["refusal"]
    print(f"[{vm['label']}] asked {r['asked']} B of {r['nodes_total']} B: {r['message']}")
    assert r["message"] is not None
    assert format_size(r["nodes_total"]) in r["message"]
    for n in vm["cxl_nodes"]:
        assert f"node {n['id']}: {format_size(n['mem_total'])}" in r["message"]


def test_finetune_plans_cxl_mem_on_this_machine(vm):
    """No --hardware: the run's pre-flight (--dry-run) plans this machine, whose CXL nodes give
    the capacity (the default profile has no [cxl] table, which used to refuse the run)."""
    cli = vm["cli"]
    print(f"[{vm['label']}] finetune --cxl-mem 2M --dry-run: exit {cli['exit_code']}, planned CXL "
          f"{format_size(cli['planned_cxl'])}")
    assert cli["exit_code"] == 0 and "verdict: fits" in cli["output_tail"], cli["output_tail"]
    assert cli["planned_cxl"] == sum(n["mem_total"] for n in vm["cxl_nodes"])
