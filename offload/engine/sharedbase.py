"""The frozen base held once per node: the local ranks share its host-homed chunks.

Ranks on one node would each hold the whole frozen base -- a LoRA/QLoRA base is most of the
model, and N copies of it make host RAM, not the GPUs, the limit (DeepSpeed #2841). Instead:
- Who shares: the ranks of one node (`Ranks.local`: same host name, boot id and torchrun node
  rank); the node's leader is its lowest rank.
- Placement: the base's homes are the same on every local rank: those of the leader's
  placement (its trainable chunks are known to all from the owner map) with each base chunk
  costing 1/L of its bytes (L local ranks). Each rank then places its own chunks in the host
  share the base leaves it. The base lives in host memory or on NVMe; with a CXL tier the base
  is not shared (each rank its own, as on one rank).
- Memory: the host-homed base chunks lie in one SharedRegion (/dev/shm, offload.runtime.sharedmem)
  that the leader creates and fills (the weights are loaded on the leader only) and the others
  map read-only; its name is unlinked once all have mapped it.
- Budget: each local rank books its 1/L of the region (rounded up) as kind "shared" in its host
  ledger, so the node's host use -- the sum over its ranks, within the --cpu-mem that the CLI
  divides among them -- counts the base once.
- Readiness: the others read the base only once the leader has loaded it: `ready()`, a
  collective run once at the first step, evaluation or export, waits for that.
NVMe-homed base chunks: the leader's swap files (in its private directory under --nvme-path),
which the others open read-only (offload.runtime.nvme.NvmeStore.attach); each rank books 1/L.
On a CUDA device every rank pins its mapping of the region (SharedRegion.pin), so its copies to
the device are DMA as from any pinned host tier.
Not yet: --nvme-checksum verifies the leader's reads of those files, not the others'.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.errors import InfeasibleBudget
from ..core.units import format_size
from ..plan.homes import Homes, assign_homes, bounce_bytes
from ..runtime.sharedmem import SharedRegion

_ALIGN = 4096


def _up(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class SharedBase:
    """The local ranks of this rank's node and, once `place`d and `map`ped, the shared region."""

    def __init__(self, ranks: Any, *, host_budget: "int | None"):
        self.ranks = ranks
        budgets = ranks.all_gather_object(host_budget, "sharing the host budgets of this node")
        self.local = ranks.local  # offload.engine.ranks.node_key
        self.leader = self.local[0]
        self.is_leader = ranks.rank == self.leader
        self.leader_host = budgets[self.leader]
        self.offsets: dict[int, int] = {}  # host-homed base chunk -> byte offset in the region
        self.nvme_chunks: set[int] = set()  # NVMe-homed base chunks: the leader's swap files
        self.nbytes = 0
        self.share = 0  # this rank's booked part of the region
        self.region: SharedRegion | None = None
        self._ready = False

    @property
    def local_world(self) -> int:
        return len(self.local)

    def place(self, *, kinds: dict[int, dict[str, int]], leader_kinds: dict[int, dict[str, int]],
              frozen: set[int], host: "int | None", nvme: bool) -> Homes:
        """Homes of this rank's streamed chunks `kinds`: the base's as the leader's placement
        (`leader_kinds`) puts it at 1/L cost, the rest in what is left of `host`."""
        n = self.local_world
        shared_cost = {c: k if c not in frozen else {"compute": -(-k["compute"] // n)}
                       for c, k in leader_kinds.items()}
        # what the base on NVMe needs in host memory (two update sets and the fetch buffer, at full
        # size) is held back here too, so that each rank's own chunks fit next to it below
        worst = 3 * _up(max(k["compute"] for c, k in leader_kinds.items() if c in frozen)) if nvme else 0
        lead_host = None if self.leader_host is None else max(0, self.leader_host - worst)
        lead = assign_homes(kinds=shared_cost, host=lead_host, nvme=nvme)
        base = {c: lead.tiers[c]["compute"] for c in frozen if c in kinds}
        at = 0
        for c in sorted(c for c, t in base.items() if t == "host"):
            self.offsets[c] = at
            at += _up(kinds[c]["compute"])
        self.nbytes = at
        self.share = self.part(at)
        self.nvme_chunks = {c for c, t in base.items() if t == "nvme"}
        on_nvme = [kinds[c]["compute"] for c in self.nvme_chunks]
        reserve = 3 * _up(max(on_nvme)) if on_nvme else 0
        own = {c: k for c, k in kinds.items() if c not in base}
        left = None if host is None else host - self.share - reserve
        if left is not None and left < 0:
            raise InfeasibleBudget(f"host budget {format_size(host)} per rank cannot hold this rank's share "
                                   f"({format_size(self.share)}) of the base shared by the {n} ranks of the node: "
                                   f"raise --cpu-mem", minimum={"host": self.share + reserve})
        mine = assign_homes(kinds=own, host=left, nvme=nvme)
        tiers = dict(mine.tiers) | {c: {"compute": t} for c, t in base.items()}
        totals = {tier: dict(kb) for tier, kb in mine.bytes.items()}
        for c in self.nvme_chunks:
            totals.setdefault("nvme", {}).setdefault("shared", 0)
            totals["nvme"]["shared"] += self.part(kinds[c]["compute"])
        if self.share:
            totals.setdefault("host", {})["shared"] = self.share
        bounce = bounce_bytes(kinds, tiers)
        if host is not None and sum(totals.get("host", {}).values()) + bounce > host:
            raise InfeasibleBudget(f"host budget {format_size(host)} per rank cannot hold this rank's chunks "
                                   f"next to its share of the shared base: raise --cpu-mem",
                                   minimum={"host": sum(totals.get("host", {}).values()) + bounce})
        return Homes(tiers=tiers, bytes=totals, bounce=bounce)

    def map(self, ledger: Any, *, device: Any = None) -> None:
        """Book this rank's share, make (leader) or map (the others) the region (a CUDA `device`:
        and pin it for the copies to it); then the leader unlinks its name (every local rank
        has it mapped)."""
        # (the collectives run on every rank of the group, whatever its node placed)
        if self.nbytes:
            ledger.reserve("host", "shared", self.share)
        region = SharedRegion.create(self.nbytes) if self.is_leader and self.nbytes else None
        paths = self.ranks.all_gather_object(region.path if region else None, "sharing the base's memory")
        if region is None and self.nbytes:
            region = SharedRegion.attach(paths[self.leader], self.nbytes)
        self.region = region
        if device is not None and device.type == "cuda" and region is not None:
            region.pin(device)
        self.ranks.all_true(True, "mapping the shared base")
        if self.is_leader and region is not None:
            region.unlink()

    def holds(self, cid: int) -> bool:
        """Chunk `cid` lies in the shared host memory."""
        return cid in self.offsets

    def on_nvme(self, cid: int) -> bool:
        """Chunk `cid` lies in the leader's swap file, which every local rank reads."""
        return cid in self.nvme_chunks

    def part(self, nbytes: int) -> int:
        """This rank's part of `nbytes` shared by the local ranks (booked in its ledger)."""
        return -(-nbytes // self.local_world)

    def attach_files(self, store: Any, nvme: Any) -> None:
        """The others open the leader's swap files of the NVMe-homed base (read-only)."""
        keys = {c: store.chunks[c].compute.key for c in sorted(self.nvme_chunks)}
        paths = self.ranks.all_gather_object({k: nvme.path(k) for k in keys.values()} if self.is_leader else None,
                                             "sharing the base's swap files")
        if not self.is_leader:
            for c, key in keys.items():
                nvme.attach(key, paths[self.leader][key], store.chunks[c].compute.nbytes)

    def chunk(self, cid: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """Chunk `cid`'s home copy: `nbytes` of the region, as `dtype`."""
        at = self.offsets[cid]
        return self.region.tensor[at: at + nbytes].view(dtype)

    def ready(self) -> None:
        """Once: wait until the leader has loaded the base (a collective of every rank)."""
        if self._ready:
            return
        self.ranks.all_true(True, f"waiting for rank {self.leader} to load the shared base")
        self._ready = True

    def close(self) -> None:
        if self.region is not None:
            self.region.close()
            self.region = None
