"""The measurements inside the CXL guest (run by tests/cxl_vm/harness.py; reported as JSON).

1. detection: every NUMA node and the CXL nodes `detect_cxl_nodes` finds, with its evidence;
2. a bf16 training run of a tiny model with a CXL budget and small chunks: the compute copies
   go to CXL (homes), master/state/grad to host DRAM. Each buffer's pages are located with
   move_pages (query mode); the same run without CXL gives the reference losses;
3. the ledger's CXL peak against the kernel: pages on the CXL nodes (move_pages) and the
   nodes' MemUsed before and after;
4. a CXL budget larger than the nodes: the refusal's message.
The program only measures; tests/cxl_vm/test_cxl_vm.py judges. CXL memory under emulation
moves ~10-30 MB/s: the model is ~130 K parameters and the CXL buffers ~300 KiB.

Off the VM (no CXL node), CXLVM_FORCE_NODES=0 runs the same on node 0 to try the program.
"""

from __future__ import annotations

import json
import os
import platform
import re
import sys
import time
import traceback
from collections import Counter

import torch
from torch import nn

from tierwise.offload import Engine, flat_options
from tierwise.offload.runtime.cxl import (describe_cxl_nodes, detect_cxl_nodes, detect_numa_nodes, page_nodes,
                         parse_node_list)
from tierwise.offload.core.errors import TierwiseError

T0 = time.monotonic()
WIDTH, DEPTH, CHUNK, STEPS = 64, 4, 32 << 10, 3


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.ff = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        return x + self.ff(self.norm(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).squeeze(-1)


def mse(model, batch):
    return nn.functional.mse_loss(model(batch["x"].bfloat16()).float(), batch["y"])


def data():
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(STEPS, 16, WIDTH, generator=g)
    w = torch.randn(WIDTH, generator=g)
    return [{"x": x, "y": x @ w / WIDTH ** 0.5} for x in xs]


def mem_used(node: int) -> int:
    text = open(f"/sys/devices/system/node/node{node}/meminfo").read()
    m = re.search(r"MemUsed:\s*(\d+)\s*kB", text)
    return int(m.group(1)) * 1024


def engine(**cxl) -> Engine:
    torch.manual_seed(0)
    return Engine(Net(), **flat_options(optimizer="adamw", lr=1e-3, precision="bf16", gpu_mem="1M",
                  cpu_mem="256M", chunk_bytes=CHUNK, loss_fn=mse, **cxl))


def home_buffers(eng: Engine) -> list[dict]:
    """Every home buffer of the engine's chunks: chunk, kind, tier, bytes, pages per node."""
    out = []
    for cid, ch in enumerate(eng.store.chunks):
        for kind, _, tensor in ch.kinds():
            if isinstance(tensor, torch.Tensor):
                where = Counter(page_nodes(tensor))
                out.append({"chunk": cid, "kind": kind, "tier": ch.tiers[kind],
                            "bytes": tensor.numel() * tensor.element_size(),
                            "pages": {str(k): v for k, v in sorted(where.items())}})
    return out


def on_cxl(buffers: list[dict], nodes: list[int], page: int) -> dict:
    """What the kernel shows of the CXL-tier buffers: pages per node, bytes on `nodes`."""
    pages = Counter()
    for b in buffers:
        if b["tier"] == "cxl":
            pages.update({int(k): v for k, v in b["pages"].items()})
    return {"buffers": sum(b["tier"] == "cxl" for b in buffers),
            "pages_per_node": {str(k): v for k, v in sorted(pages.items())},
            "bytes_on_nodes": sum(v for k, v in pages.items() if k in nodes) * page}


def numa_maps(nodes: list[int]) -> dict:
    """/proc/self/numa_maps, the kernel's second view: pages per node of the mappings whose
    policy names the CXL nodes (bind:1 or interleave:1-2; only the CXL buffers have one)."""
    wanted = set(nodes)
    pages, mappings = Counter(), 0
    for line in open("/proc/self/numa_maps"):
        fields = line.split()
        policy = fields[1]
        kind, _, nodelist = policy.partition(":")
        if kind in ("bind", "interleave") and set(parse_node_list(nodelist) or ()) == wanted:
            mappings += 1
            for f in fields[2:]:
                if m := re.fullmatch(r"N(\d+)=(\d+)", f):
                    pages[int(m.group(1))] += int(m.group(2))
    return {"mappings": mappings, "pages_per_node": {str(k): v for k, v in sorted(pages.items())}}


def train(nodes: list[int]) -> dict:
    page = os.sysconf("SC_PAGE_SIZE")
    batches = data()
    t = time.monotonic()
    ref = engine()
    ref_losses = [ref.step(b) for b in batches]
    ref.close()
    before = {n: mem_used(n) for n in nodes}
    eng = engine(cxl_mem="4M", cxl_node=",".join(map(str, nodes)))
    # built: every home is allocated and filled, so the ledger's CXL use is at its peak here
    at_build = on_cxl(home_buffers(eng), nodes, page) | {"ledger_used": eng.ledger.used("cxl"),
                                                         "ledger_peak": eng.ledger.peaks()["cxl"],
                                                         "numa_maps": numa_maps(nodes)}
    losses = [eng.step(b) for b in batches]
    after = {n: mem_used(n) for n in nodes}
    buffers = home_buffers(eng)
    out = {
        "losses": losses, "reference_losses": ref_losses,
        "losses_equal": losses == ref_losses,
        "homes": {t: dict(k) for t, k in eng.homes.bytes.items()},
        "buffers": buffers,
        "at_build": at_build,
        "after_training": on_cxl(buffers, nodes, page) | {"ledger_used": eng.ledger.used("cxl"),
                                                          "ledger_peak": eng.ledger.peaks()["cxl"],
                                                          "numa_maps": numa_maps(nodes)},
        "mem_used_delta": {str(n): after[n] - before[n] for n in nodes},
        "page": page,
        "train_s": round(time.monotonic() - t, 1),
    }
    eng.close()
    return out


def refusal(nodes: list[int]) -> dict:
    known = {n.id: n for n in detect_numa_nodes()}
    total = sum(known[n].mem_total for n in nodes)
    try:
        engine(cxl_mem=total + (64 << 20), cxl_node=",".join(map(str, nodes))).close()
    except TierwiseError as exc:
        return {"asked": total + (64 << 20), "nodes_total": total, "message": str(exc)}
    return {"asked": total + (64 << 20), "nodes_total": total, "message": None}


def cli_run(nodes: list[int]) -> dict:
    """`finetune --model tiny --cxl-mem 2M --cxl-node ... --dry-run` as a user runs it here:
    planned on this machine (its CXL nodes' capacity, no --hardware), as the run's pre-flight
    plans it (a step itself under emulation took ~50 s more; train() steps the engine on CXL)."""
    from typer.testing import CliRunner

    from tierwise.cli.config import TrainConfig
    from tierwise.cli.main import app
    from tierwise.cli.planning import this_machine

    node_list = ",".join(map(str, nodes))
    planned = this_machine(TrainConfig(model="tiny", cxl_mem="2M", cxl_node=node_list)).cxl.memory
    r = CliRunner().invoke(app, ["--model", "tiny", "--cxl-mem", "2M", "--cxl-node", node_list, "--steps", "1",
                                 "--output", "/tmp/cxl-cli-run", "--dry-run"])
    return {"exit_code": r.exit_code, "output_tail": r.output[-600:], "planned_cxl": planned}


def main() -> None:
    result: dict = {"kernel": platform.release(), "python_ready_s": round(time.monotonic() - T0, 1)}
    try:
        result["numa_nodes"] = [vars(n) | {"cpus": list(n.cpus), "distance": list(n.distance)}
                                for n in detect_numa_nodes()]
        cxl = detect_cxl_nodes()
        result["cxl_nodes"] = [{"id": n.id, "mem_total": n.mem_total, "cxl": n.cxl,
                                "distance": list(n.distance)} for n in cxl]
        result["describe"] = describe_cxl_nodes(cxl)
        from tierwise.cli.planning import cxl_lines
        from tierwise.offload.tools.profiler import cxl_node_lines

        result["plan_lines"] = cxl_lines()  # what `finetune plan` prints with a CXL budget
        result["profile_lines"] = cxl_node_lines({})  # `finetune profile` (bandwidth not measured)
        forced = parse_node_list(os.environ.get("CXLVM_FORCE_NODES") or None)
        nodes = list(forced) if forced else [n.id for n in cxl]
        if nodes:
            result["train"] = train(nodes)
            result["refusal"] = refusal(nodes)
            result["cli"] = cli_run(nodes)
    except Exception:  # report, do not hide: the host-side test fails on it
        result["error"] = traceback.format_exc()
    result["guest_s"] = round(time.monotonic() - T0, 1)
    text = json.dumps(result, indent=1)
    out = os.environ.get("CXLVM_OUT")
    if out:
        with open(os.path.join(out, "result.json"), "w") as f:
            f.write(text)
    else:
        print(text)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
