"""Several ranks over torch.distributed: who owns which chunk, and the collectives on chunks.

Shard layout: whole chunks per rank. The k-th trainable chunk (in chunk order) belongs to rank
k mod N: only its owner stores its fp32 master and optimizer state (in the owner's tiers: host,
CXL, NVMe) and updates it. Before a chunk is used its compute copy is *gathered*: the owner
fills the device buffer from its home, as one rank does, and broadcasts it to the others, into
the same device window (the resident cache) as on one rank. Gradients (owned-only, the default
grad_reduce="micro"): a rank holds a chunk another owns only while the current micro-batch
produces its gradient (offload.engine.transient); once the chunk's gradients of that micro-batch
are complete they are reduced (summed) onto its owner during backward and the buffer is freed;
the owner accumulates across micro-batches and updates it. grad_reduce="step": every rank
accumulates its own micro-batches in a grad chunk of its own and reduces it once per step. Frozen chunks (a LoRA base) are not
sharded: the local ranks of a node share one copy (offload.engine.sharedbase).

Why whole chunks, not a slice of every chunk (ZeRO-3's layout): every updater runs unchanged on
whole chunks -- torch's fused AdamW sees each parameter as one rank does (bit-exact), AdamW8bit
keeps its 256-element blocks (optim/quant.py BLOCK), and a GaLore/APOLLO projection has its whole matrix -- and the
collectives are plain broadcast/reduce. The cost: with few chunks the ranks' shares are uneven
(chunk count / N rounded), and one owner's host link feeds each gather where slices would use
all N links at once (ZeRO-Infinity's bandwidth-centric argument). What should decide: on a
multi-GPU node, the step time and per-rank host-link busy time of both layouts at the same
budget; slices win where the host->device link, not NVLink, is the bottleneck.

Order of collectives. Collectives of one process group must run in the same order on every
rank. Three groups, one per thread that issues them: `gather` (the executor's h2d copy thread:
fetches in the order the residency asks for them, which is the same on every rank because the
trace, the placement and the cache limit are the same: the activation peak that sizes the cache
is the maximum over ranks, and no trainable chunk is gpu-home), `grads` (the update worker during
backward, or the compute thread: the first backward, a backward's end once the worker is idle,
the step's end; never both at once) and `main` (the compute thread:
loss, token counts, gradient norms, exports). Every collective has a timeout (`timeout`): a
rank that died makes the others fail within it, with the rank named.

Checked order. A rank whose control flow diverges (a data-dependent branch in a model) would
pair its collective on one chunk with another rank's on another: a sum of two chunks' gradients
of the same size (a wrong number) or a hang or abort (different sizes). So every per-chunk
collective is preceded by a check on the same group: each rank's (chunk, offset, elements) summed
into a [world, 3] int64 tensor (24 bytes a rank: one tiny all_reduce); a disagreement raises
CollectiveOrderError on every rank at once, before any of the chunk's bytes move. Why a
collective of its own, not one trailing element in the chunk's: the buffers reduced are views of
the gradient chunks (a slot's slice in the first backward) with no room after them, and a check
after the data is too late when the sizes differ. Its cost is one round trip per chunk
collective (bench/order_check.py: 0.3-0.4 ms on gloo here, in the noise from 16 MiB chunks on);
the payload counters (`bytes`) leave it out. On CUDA the
gather group is NCCL: its checks go over a gloo group of their own (host tensors, no stream
sync), issued by the same thread just before each broadcast.
"""

from __future__ import annotations

import datetime
import os
import re
import socket
from typing import Any

import torch
import torch.distributed as dist

from ..core.errors import DIST_TIMEOUT_S, TierwiseError

#: optimizers whose update runs on whole chunks as on one rank (MeZO: with its own step, the
#: seed shared and the two losses summed). GaLore/APOLLO would work on whole chunks too but are
#: not tested sharded yet: refused.
SHARDED_OPTIMIZERS = ("adamw", "adamw8bit", "sgd", "mezo")


class RankFailure(TierwiseError):
    """A collective failed: another rank died, raised or stopped answering."""


class CollectiveOrderError(RankFailure):
    """The ranks were about to run different per-chunk collectives (their control flow diverged)."""


def _cause(exc: BaseException) -> str:
    """The backend's reason in a few words: its first sentence, without the source location."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    text = re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)
    return text.split(". ")[0][:160]


def _others(rank: int, world: int) -> str:
    others = [r for r in range(world) if r != rank]
    return f"rank {others[0]}" if len(others) == 1 else f"one of ranks {', '.join(map(str, others))}"


def gather_objects(obj: Any, what: str) -> list:
    """Every rank's `obj` (picklable, small) over the default group, in rank order: the CLI's
    checkpoint handshakes, on the main thread between steps. A rank that stopped: RankFailure."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out: list = [None] * world
    try:
        dist.all_gather_object(out, obj)
    except (RuntimeError, dist.DistBackendError) as exc:
        raise RankFailure(f"rank {rank}: {what} failed: {_others(rank, world)} stopped "
                          f"({_cause(exc)})") from exc
    return out


def node_key() -> str:
    """What ranks on the same node (one host memory, one set of cores) have in common."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}|{boot}|{os.environ.get('GROUP_RANK', '')}"


def same_node(keys: list[str], rank: int) -> list[int]:
    """The ranks whose `node_key` (in `keys`, by rank) is `rank`'s: its node's, lowest first. The
    one count of a node's ranks: the engine's (`Ranks.local`) and the CLI's (cli.launch.on_node)."""
    return [r for r, key in enumerate(keys) if key == keys[rank]]


def default_group() -> Any:
    """The initialised default process group when it spans several ranks, else None."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


class Ranks:
    """The engine's ranks: `rank`, `world`, the owner of each trainable chunk, three process
    groups over the ranks of `group` and the collectives on chunk storage."""

    def __init__(self, group: Any, *, trainable: list[int], timeout_s: float = DIST_TIMEOUT_S):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        members = dist.get_process_group_ranks(group)
        self.global_rank = members  # group rank -> global rank (collectives name global ranks)
        timeout = datetime.timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        # every rank of the default group takes part in new_group (all ranks build an Engine).
        # `gather` moves device buffers: the default backend (NCCL on CUDA). `grads` and `main`
        # move host tensors (host gradient chunks, scalars, fp32 masters): gloo, which NCCL is not.
        self.gather_group = dist.new_group(ranks=members, timeout=timeout)
        self.grad_group, self.main_group = (
            dist.new_group(ranks=members, timeout=timeout, backend="gloo") for _ in range(2))
        # the gather order's checks: host tensors, so gloo (the same decision on every rank)
        self.gather_check = (self.gather_group if dist.get_backend(self.gather_group) == "gloo"
                             else dist.new_group(ranks=members, timeout=timeout, backend="gloo"))
        self.owner = {cid: k % self.world for k, cid in enumerate(trainable)}
        keys = self.all_gather_object(node_key(), "finding the ranks of this node")
        #: the ranks (of `group`) on this rank's node, lowest first: they share its host memory,
        #: NVMe and cores (offload.engine.sharedbase, offload.runtime.cores)
        self.local = same_node(keys, self.rank)
        #: payload bytes this rank passed to each group's collectives (bench/collective_bytes.py);
        #: one key per group, each written by the one thread that issues that group's collectives
        self.bytes = {"gather": 0, "grads": 0, "main": 0}

    @property
    def local_world(self) -> int:
        return len(self.local)

    def owns(self, cid: int) -> bool:
        """True for a chunk this rank stores and updates (frozen chunks: every rank)."""
        return self.owner.get(cid, self.rank) == self.rank

    def remote(self) -> frozenset[int]:
        """Trainable chunks another rank owns."""
        return frozenset(c for c, r in self.owner.items() if r != self.rank)

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (RuntimeError, dist.DistBackendError) as exc:  # gloo: a peer closed or timed out
            raise RankFailure(f"rank {self.rank}: {what} failed: {_others(self.rank, self.world)} stopped "
                              f"({_cause(exc)})") from exc

    def _check_order(self, group: Any, what: str, doing: str, cid: int, offset: int, numel: int) -> None:
        """Every rank is about to run the collective `what` on the same part of the same chunk,
        else CollectiveOrderError on every rank (see the module's docstring). A peer that stopped
        fails here as in the collective itself (RankFailure naming `what`)."""
        t = torch.zeros(self.world, 3, dtype=torch.int64)
        t[self.rank] = torch.tensor([cid, offset, numel])
        self._call(what, dist.all_reduce, t, op=dist.ReduceOp.SUM, group=group)
        rows = [tuple(r) for r in t.tolist()]
        if len(set(rows)) == 1:
            return

        def part(r: int) -> str:
            c, o, n = rows[r]
            return f"rank {r} chunk {c} [{o}:{o + n}]"

        raise CollectiveOrderError(
            f"rank {self.rank}: collective order diverged ({doing}): {', '.join(map(part, range(self.world)))}; "
            f"every rank must run the same chunks in the same order (control flow that differs "
            f"between ranks is not supported)")

    # -- chunks ---------------------------------------------------------------------------
    def broadcast_chunk(self, cid: int, buf: torch.Tensor) -> None:
        """The owner's device copy of chunk `cid` into `buf` on every rank (byte for byte)."""
        what = f"gathering chunk {cid} from rank {self.owner[cid]}"
        self._check_order(self.gather_check, what, "gathering", cid, 0, buf.numel())
        self.bytes["gather"] += buf.numel() * buf.element_size()
        self._call(what, dist.broadcast,
                   buf.view(torch.uint8), src=self.global_rank[self.owner[cid]], group=self.gather_group)

    def reduce_grad(self, cid: int, grad: torch.Tensor, offset: int = 0) -> None:
        """Sum chunk `cid`'s gradient over the ranks onto its owner (others' `grad` is scratch);
        `offset`: `grad` is the chunk's elements from there on (a slot's slice)."""
        what = f"reducing the gradients of chunk {cid} onto rank {self.owner[cid]}"
        self._check_order(self.grad_group, what, "reducing gradients", cid, offset, grad.numel())
        self.bytes["grads"] += grad.numel() * grad.element_size()
        self._call(what, dist.reduce,
                   grad, dst=self.global_rank[self.owner[cid]], op=dist.ReduceOp.SUM, group=self.grad_group)

    def broadcast_from_owner(self, cid: int, t: torch.Tensor) -> None:
        """`t` from chunk `cid`'s owner to every rank (compute thread: exports)."""
        what = f"reading chunk {cid} from rank {self.owner[cid]}"
        self._check_order(self.main_group, what, "reading", cid, 0, t.numel())
        self.bytes["main"] += t.numel() * t.element_size()
        self._call(what, dist.broadcast,
                   t, src=self.global_rank[self.owner[cid]], group=self.main_group)

    # -- scalars and small vectors (compute thread) ----------------------------------------
    def sum_(self, t: torch.Tensor, what: str) -> torch.Tensor:
        self.bytes["main"] += t.numel() * t.element_size()
        self._call(what, dist.all_reduce, t, op=dist.ReduceOp.SUM, group=self.main_group)
        return t

    def all_gather_object(self, obj: Any, what: str) -> list:
        out: list = [None] * self.world
        self._call(what, dist.all_gather_object, out, obj, group=self.main_group)
        return out

    def max_int(self, value: int, what: str) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        self.bytes["main"] += 8
        self._call(what, dist.all_reduce, t, op=dist.ReduceOp.MAX, group=self.main_group)
        return int(t.item())

    def all_true(self, flag: bool, what: str) -> bool:
        t = torch.tensor([0 if flag else 1], dtype=torch.int64)
        self.bytes["main"] += 8
        self._call(what, dist.all_reduce, t, op=dist.ReduceOp.MAX, group=self.main_group)
        return int(t.item()) == 0

    def close(self) -> None:
        for g in dict.fromkeys((self.gather_group, self.gather_check, self.grad_group, self.main_group)):
            try:
                dist.destroy_process_group(g)
            except Exception:  # noqa: BLE001 - the default group may be gone already
                pass
