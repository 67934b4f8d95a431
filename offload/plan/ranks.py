"""Several ranks (pure): what the planner needs to price `--nproc-per-node N --nnodes M`.

The engine's layout (offload.engine.ranks): the k-th trainable chunk belongs to rank k mod
world, which alone stores its master and optimizer state and updates it; gradients are owned
too (`grad_reduce="micro"`, the default): a rank holds a gradient buffer of a chunk it does not
own only while the current micro-batch produces it (at most `window_bytes` at once) and reduces
it onto the owner after every micro-batch; with "step" every rank keeps a gradient chunk of
every trainable chunk, sums its own micro-batches there and reduces once per step; before use the owner broadcasts the chunk's compute copy to all
ranks ("gather"); nothing trainable is gpu-home. A frozen base is planned ONCE per node (held in
memory the node's ranks share), each rank reading it through its own PCIe link.

Per rank, the payload of its collectives per step (the unit of ZeRO's communication volume; what
`Ranks.bytes` measures, bench/collective_bytes.py):
  gather  every fetch of a trainable chunk's compute copy: a fetch per forward and one for
          recompute + backward, less what the cache keeps across each turn (forward -> backward,
          backward -> the next micro-batch's forward), at least once per step (the update
          invalidates every copy): max(S, 2 M S - (2 M - 1) R), S = the trainable compute bytes,
          R = what the cache keeps (its limit less the widest module), M = micro-batches per rank;
  reduce  4 bytes per trainable parameter (fp32 gradients), once per micro-batch ("micro") or
          once per step ("step").
Gradient bytes per rank: the fp32 gradients of the chunks it owns plus the window ("micro"), or
of every trainable chunk ("step"): `grad_bytes`.
The node's host DRAM, CXL and NVMe bandwidth and its CPU cores are shared by its local ranks,
each doing the same work at once: each rank is priced on 1/L of them (`rank_share`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from ..core.chunks import ChunkPlan
from ..core.errors import TierwiseError
from ..update.table import OptimizerSpec
from ...profiles.hardware import HardwareProfile


@dataclass(frozen=True, kw_only=True)
class Collectives:
    """A rank's collective traffic, for perfmodel.predict_step."""

    gather_bytes: float
    """Broadcast payload per micro-batch (the step's, over its micro-batches)."""
    reduce_bytes: int
    """Gradient reduce payload per step."""
    gbps: float
    """The slowest link the collectives cross: the GPU link, or the network between nodes."""
    via: str
    """How the node's GPUs reach each other (profiles.hardware.GPU_LINKS)."""


@dataclass(frozen=True, kw_only=True)
class RankPlan:
    """The multi-rank figures of a Plan (Plan.ranks)."""

    nproc_per_node: int
    nnodes: int
    gpu_peak: list[int]
    """Device peak of each rank of the fullest node (node 0: ranks 0..L-1)."""
    private_host: list[int]
    """Host bytes of each of those ranks alone: its kinds there and its NVMe bounce buffers."""
    owned_params: list[int]
    """Trainable parameters each of those ranks stores and updates."""
    base: dict[str, int]
    """The frozen base per node, by tier (held once, read by every local rank)."""
    node: dict[str, int]
    """Bytes per node by tier (host, cxl, nvme): its ranks' own and the base once."""
    node_budgets: dict[str, int | None]
    gather_bytes: int
    """Broadcast payload per rank per step (see the module docstring)."""
    reduce_bytes: int
    """Gradient reduce payload per rank per step."""
    grad_bytes: list[int]
    """fp32 gradient bytes each of those ranks holds at most (host, CXL, NVMe): see the module docstring."""
    grad_reduce: str
    """"micro" (owned-only gradients, a reduce per micro-batch) or "step"."""
    collective_s: float
    """Seconds of those collectives per step on `link` (they overlap compute: see phases)."""
    link: str
    """The link they are priced on, in words."""
    single_tokens_per_s: float | None = None
    """The same run on one rank of this node (its whole budgets), for the ratio."""
    host_shares: list[int] | None = None
    """One node: each local rank's --cpu-mem share (its minimum and an even part of the rest;
    they add up to the node's budget at most); None: even shares (cli.launch.node_share)."""

    @property
    def world(self) -> int:
        return self.nproc_per_node * self.nnodes

    def lines(self, fmt: Callable[[int], str]) -> list[str]:
        """The plan's multi-rank block; `fmt`: a byte formatter."""
        L = self.nproc_per_node
        out = [f"ranks: {self.world} ({L} per node x {self.nnodes} node{'s' if self.nnodes > 1 else ''}); "
               f"micro-batch i of a step on rank i mod {self.world}; trainable chunk k stored and updated by "
               f"rank k mod {self.world}",
               "  per rank (node 0): gpu peak " + ", ".join(fmt(b) for b in self.gpu_peak)
               + "; own host " + ", ".join(fmt(b) for b in self.private_host)
               + "; params updated " + ", ".join(f"{p / 1e9:.2f}B" if p >= 1e9 else f"{p / 1e6:.1f}M"
                                                 for p in self.owned_params),
               "  per node: " + ", ".join(f"{t} {fmt(b)}" + (f" of {fmt(nb)}" if (nb := self.node_budgets.get(t)) else "")
                                          for t, b in self.node.items() if b)
               + (("; the frozen base once per node: " + ", ".join(f"{t} {fmt(b)}" for t, b in self.base.items() if b))
                  if any(self.base.values()) else ""),
               f"  collectives per rank per step: gather {fmt(self.gather_bytes)} (compute copies broadcast "
               f"from their owners), reduce {fmt(self.reduce_bytes)} (fp32 gradients onto their owners); "
               f"{self.collective_s:.3f} s on {self.link}; the frozen base is not communicated",
               "  gradients held per rank: " + ", ".join(fmt(b) for b in self.grad_bytes)
               + (" (the chunks it owns, and others' one micro-batch at a time: reduced after every micro-batch)"
                  if self.grad_reduce == "micro" else
                  " (every trainable chunk's: each rank sums its micro-batches, reduced once per step)")]
        if self.single_tokens_per_s:
            out.append(f"  one rank of this node (its whole budgets): {self.single_tokens_per_s:,.1f} tokens/s")
        out.append("  modelled, not measured: bytes follow the engine's layout (collective bytes checked against "
                   "2 gloo ranks by tests/test_plan_ranks.py); link times, the shared host DRAM/NVMe/cores and "
                   "the step time come from the hardware profile")
        return out


def check_layout(hw: HardwareProfile, *, nproc_per_node: int, nnodes: int, cost: OptimizerSpec) -> None:
    """Refuse what the profile or the engine cannot do with several ranks (one line each)."""
    if nproc_per_node < 1 or nnodes < 1:
        raise TierwiseError(f"--nproc-per-node and --nnodes must be at least 1, got {nproc_per_node} and {nnodes}")
    if nproc_per_node > hw.gpus_per_node:
        raise TierwiseError(f"--nproc-per-node {nproc_per_node}: hardware profile '{hw.name}' has "
                            f"{hw.gpus_per_node} GPU{'s' if hw.gpus_per_node > 1 else ''} per node; use a profile "
                            f"with a [node] table (e.g. 2x-rtx4090-128g, 8x-a100-80g-1t-nvme)")
    if nnodes > 1 and (hw.node is None or hw.node.network_gbps is None):
        raise TierwiseError(f"--nnodes {nnodes}: hardware profile '{hw.name}' states no network between nodes "
                            f"([node] network_gbps)")
    if cost.low_rank:
        raise TierwiseError(f"--optimizer {cost.name} is not supported with several ranks yet (the engine refuses "
                            f"it: its projections are not sharded); use adamw, adamw8bit, sgd or mezo")




def window_bytes(plan: "ChunkPlan", trainable: list[int]) -> int:
    """Host bytes a rank keeps free for the transient gradients of chunks it does not own
    ("micro"; offload.engine.transient): the largest trainable chunk and one more, in fp32 (one
    filling while the last one is reduced). The second is at most a packed chunk's size: a
    parameter larger than a chunk (an embedding, an untied LM head) has one of its own, and
    two of those are not produced at once (their gradients come at the two ends of backward)."""
    numels = sorted((plan.chunks[c].numel for c in trainable), reverse=True)
    if not numels:
        return 0
    return 4 * (numels[0] + min(numels[1] if len(numels) > 1 else 0, plan.chunk_numel))


def remote_kinds(numel: int, *, owned_grads: bool) -> dict[str, int]:
    """A trainable chunk another rank owns, as this rank holds it between steps: nothing with
    owned-only gradients (its transient gradient lies in the window), else its fp32 gradient.
    The engine's (Engine._kinds) and the planner's (_rank_view) one fact."""
    return {} if owned_grads else {"grad": 4 * numel}


def owners(trainable: list[int], world: int) -> dict[int, int]:
    """Chunk -> its owner rank (offload.engine.ranks.Ranks.owner: k mod world)."""
    return {cid: k % world for k, cid in enumerate(trainable)}


def gather_bytes(*, trainable_compute: int, streamed_compute: int, cache_limit: int, widest: int,
                 micro_batches: int) -> int:
    """Broadcast payload per rank per step of the trainable chunks (see the module docstring)."""
    if trainable_compute == 0:
        return 0
    kept = min(streamed_compute, max(0, cache_limit - widest))
    m = micro_batches
    every = max(streamed_compute, 2 * m * streamed_compute - (2 * m - 1) * kept)
    return round(every * trainable_compute / streamed_compute)


def link(hw: HardwareProfile, nnodes: int) -> tuple[float, str]:
    """(GB/s, words) of the slowest link a collective crosses."""
    node = hw.node
    if node is None:
        raise TierwiseError(f"hardware profile '{hw.name}' has no [node] table (one GPU)")
    if nnodes > 1:
        if node.network_gbps is None:
            raise TierwiseError(f"hardware profile '{hw.name}' states no network between nodes ([node] network_gbps)")
        gbps = min(node.gpu_link_gbps, node.network_gbps)
        return gbps, f"the network between nodes ({node.network_gbps:g} GB/s; GPU link {node.gpu_link_gbps:g} GB/s)"
    return node.gpu_link_gbps, f"the GPU link ({node.gpu_link}, {node.gpu_link_gbps:g} GB/s)"


def rank_share(hw: HardwareProfile, local: int) -> HardwareProfile:
    """The profile one of `local` ranks sees: the node's host DRAM, CXL and NVMe bandwidth, CPU
    cores and CPU update rates divided among them (each rank does the same work at once). On the
    simulated device the "GPU" and its copies are the same CPU cores: shared too."""
    if local == 1:
        return hw
    h = hw.host
    host = dataclasses.replace(h, dram_bandwidth_gbps=h.dram_bandwidth_gbps / local,
                               cpu_cores=max(1, h.cpu_cores // local), cpu_fp32_tflops=h.cpu_fp32_tflops / local,
                               adamw_params_per_s=h.adamw_params_per_s / local,
                               adamw8bit_params_per_s=(h.adamw8bit_params_per_s or h.adamw_params_per_s) / local)
    nvme = hw.nvme and dataclasses.replace(hw.nvme, read_gbps=hw.nvme.read_gbps / local,
                                           write_gbps=hw.nvme.write_gbps / local)
    cxl = hw.cxl and dataclasses.replace(hw.cxl, bandwidth_gbps=hw.cxl.bandwidth_gbps / local)
    gpu, pcie = hw.gpu, hw.pcie
    if hw.simulated:
        gpu = dataclasses.replace(gpu, bf16_tflops=gpu.bf16_tflops / local, fp32_tflops=gpu.fp32_tflops / local)
        pcie = dataclasses.replace(pcie, h2d_pinned_gbps=pcie.h2d_pinned_gbps / local,
                                   d2h_pinned_gbps=pcie.d2h_pinned_gbps / local)
    return dataclasses.replace(hw, host=host, nvme=nvme, cxl=cxl, gpu=gpu, pcie=pcie)
