"""The engine's inputs to placement: its tiers (budgets, ledger, allocators) and its device needs."""

from __future__ import annotations

from typing import Any

import torch

from ..core.chunks import ChunkPlan
from ..core.sizes import parse_size
from ..plan.needs import device_needs as plan_device_needs, gathering
from ..plan.placement import DeviceNeeds
from ..runtime.cxl import CxlAllocator, detect_cxl_nodes
from ..runtime.ledger import Ledger
from ..runtime.nvme import NvmeStore
from ..runtime.tiers import Tiers
from .model_info import modules_with_params


def open_tiers(*, device: torch.device, gpu_mem: Any, cpu_mem: Any, cxl_mem: Any, cxl_node: Any,
               cxl_bandwidth: Any, nvme_path: Any,
               nvme_checksum: bool, nvme_threads: int) -> tuple[Ledger, Tiers, CxlAllocator | None, NvmeStore | None]:
    """Budgets, the ledger and the allocators of every tier in use. `nvme_threads`: I/O threads
    per direction (offload.runtime.nvme.threads_per_rank: divided among a node's ranks)."""
    budgets = {"gpu": parse_size(gpu_mem, what="--gpu-mem"), "host": parse_size(cpu_mem, what="--cpu-mem")}
    cxl_bytes = parse_size(cxl_mem, what="--cxl-mem")
    cxl = None
    if cxl_bytes:
        budgets["cxl"] = cxl_bytes
        # the ledger enforces --cxl-mem (one budget, exact bytes); the allocator's own page-
        # rounded count would refuse a tight budget the ledger accepts
        cxl = CxlAllocator(nodes=detect_cxl_nodes(), budget_bytes=1 << 62, emulate_bandwidth=cxl_bandwidth,
                           node=cxl_node)
        cxl.check_fits(cxl_bytes)  # a budget over the CXL nodes: refused with their sizes
    nvme = None
    if nvme_path is not None:
        budgets["nvme"] = None  # bounded by the disk: checked by preflight in Engine._place
        nvme = NvmeStore(nvme_path, checksum=nvme_checksum, threads=nvme_threads)
    ledger = Ledger(budgets)
    return ledger, Tiers(ledger=ledger, device=device, cxl=cxl), cxl, nvme


def module_chunks(model: torch.nn.Module, plan: ChunkPlan, param_names: dict[torch.nn.Parameter, str],
                  blocks: "list[torch.nn.Module] | tuple" = ()) -> dict[torch.nn.Module, list[int]]:
    """The units whose forward makes chunks resident -> their chunks: each of `blocks` (the
    repeated layers) with every parameter inside it, and each module outside them that owns
    parameters, with its own. Without blocks, every module that owns parameters."""
    out = {}
    inside = {id(m) for b in blocks for m in b.modules()}
    units = [(b, b.parameters()) for b in blocks] + [
        (m, m._parameters.values()) for m in modules_with_params(model) if id(m) not in inside]
    for mod, params in units:
        cids = sorted({plan.slots[param_names[p]].chunk for p in params if p is not None and p in param_names})
        if cids:
            out[mod] = cids
    return out


def device_needs(plan: ChunkPlan, chunks_of: dict[torch.nn.Module, list[int]],
                 param_names: dict[torch.nn.Parameter, str], *, kinds: dict[int, dict[str, int]], buffers: int,
                 itemsize: int, needs_grad: bool, activations: int, pinned: int = 0) -> DeviceNeeds:
    """This model's inputs to THE formula (offload.plan.needs.device_needs, which the planner
    calls too). `pinned`: the most chunk bytes pinned at once so far (nested modules, parameters
    read outside their owner): the window is at least that, and at least the widest module."""
    owned = [sum(plan.slots[param_names[p]].numel for p in m._parameters.values() if p is not None)
             for m in chunks_of]
    return plan_device_needs(compute=[c.numel * itemsize for c in plan.chunks],
                             home=[sum(kinds[c.index].values()) for c in plan.chunks],
                             module_chunks=chunks_of.values(), module_numels=owned,
                             largest_param=max((s.numel for s in plan.slots.values() if not plan.is_frozen(s.chunk)),
                                               default=0),  # frozen parameters send no gradient
                             gathered=[c.numel for c, g in zip(plan.chunks, gathering([c.params for c in plan.chunks]))
                                       if g and not plan.is_frozen(c.index)],
                             element_size=itemsize, needs_grad=needs_grad, buffers=buffers,
                             activations=activations, pinned=pinned)
