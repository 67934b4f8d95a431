"""Chunk storage: the home copies of every chunk kind, each in its home tier.

For chunk c (flat tensors of plan.chunks[c].numel elements, sharing the slot layout):
- master  fp32, the truth the optimizer updates (in fp32 runs also the compute copy that
          is streamed to the device);
- compute bf16 copy for streaming (bf16 runs only), refreshed after every update;
- grad    fp32 accumulator (host DRAM, or the device for gpu-home chunks);
- state   the optimizer's tensors (e.g. exp_avg, exp_avg_sq), and a step counter (host).
A frozen chunk (requires_grad=False parameters, offload.runtime.frozen) has only its compute
copy, in the compute dtype or, encoded, as a byte blob the device decodes; it is loaded once
and never written back (no master, grad or state; the optimizer never sees it).
A frozen chunk in a node's shared base (offload.engine.sharedbase) has its compute copy in
the memory the node's ranks share, or in the leader's swap file that every local rank reads,
loaded by the node's leader only.
A *remote* chunk (several ranks, offload.engine.ranks) is a trainable chunk another rank owns:
only its grad accumulator is here (no master, state or compute copy; its compute copy is
gathered from the owner into the device buffer), or nothing at all with owned-only gradients
(`remote_grads=False`: offload.engine.transient holds its gradient per micro-batch).
A kind lives in `host`, `cxl` (tensors bound to a CXL node), `nvme` (a swap file, see
SwapKind) or, after `promote`, `gpu`. NVMe-resident kinds are brought into bounce buffers
for the update (`offload.update_loop`) and streamed through a staging buffer to the device.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterable, Iterator

import torch

from .aligned import aligned_empty
from ..core.chunks import ChunkPlan, Slot, same_layout
from . import frozen as frozen_mod
from . import lazy
from .lazy import Deferred
from .frozen import FrozenLayout
from .nvme import NvmeStore
from .tiers import Tiers


def kind_bytes(numel: int, *, state_bytes: int, compute_dtype: torch.dtype,
               needs_grad: bool = True) -> dict[str, int]:
    """Bytes of each kind of a chunk of `numel` elements (input of homes.assign_homes)."""
    out = {"grad": 4 * numel} if needs_grad else {}
    out["master"] = 4 * numel
    if state_bytes:
        out["state"] = state_bytes
    if compute_dtype != torch.float32:
        out["compute"] = numel * compute_dtype.itemsize
    return out


def frozen_kind_bytes(numel: int, *, layout: "FrozenLayout | None", compute_dtype: torch.dtype) -> dict[str, int]:
    """Bytes of a frozen chunk's one kind: its compute copy, encoded when `layout` is given."""
    return {"compute": layout.nbytes if layout is not None else numel * compute_dtype.itemsize}


@dataclass(frozen=True)
class SwapKind:
    """A kind that lives in a swap file: its key, length and dtype."""

    key: str
    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


Data = "torch.Tensor | SwapKind"


def in_slot_order(t: torch.Tensor, slot: Slot) -> torch.Tensor:
    """`t` (shaped like the parameter, e.g. its gradient) as [numel] in the slot's memory
    order: a view when `t` is laid out as the slot, else a copy that is."""
    if not same_layout(slot.shape, t.stride(), slot.stride):
        t = t.new_empty_strided(slot.shape, slot.stride).copy_(t)
    return t.as_strided((slot.numel,), (1,), t.storage_offset())


@dataclass(kw_only=True)
class _Chunk:
    tiers: dict[str, str]  # kind -> tier
    master: Any  # None for a frozen chunk
    grad: Any  # None when the optimizer needs no gradient (MeZO); may be a SwapKind
    state: Any  # the optimizer's byte blob (offload.update.update), or None when it keeps none
    step: torch.Tensor
    compute: Any = None  # bf16 runs only
    names: tuple[str, ...] = field(default=())

    def kinds(self) -> Iterator[tuple[str, str, Any]]:
        """(kind, name, data) for master, state, compute and grad (when they exist)."""
        if self.master is not None:
            yield "master", "master", self.master
        if self.grad is not None:
            yield "grad", "grad", self.grad
        if self.state is not None:
            yield "state", "state", self.state
        if self.compute is not None:
            yield "compute", "compute", self.compute


class ChunkStore:
    """Home copies of all chunks, with ledger-accounted allocation in their tiers."""

    def __init__(self, *, plan: ChunkPlan, tiers: Tiers, compute_dtype: torch.dtype,
                 state_bytes: "Callable[[int], int]", needs_grad: bool, homes: dict[int, dict[str, str]],
                 nvme: NvmeStore | None = None, frozen: "dict[int, FrozenLayout | None] | None" = None,
                 remote: frozenset[int] = frozenset(), shared: Any = None, remote_grads: bool = True):
        """`frozen`: per frozen chunk of `plan`, its blob layout when encoded, else None.
        `remote`: trainable chunks another rank owns (only their gradient lives here).
        `shared`: the node's SharedBase (its host-homed frozen chunks live there), or None."""
        self.remote, self.remote_grads = remote, remote_grads
        self.shared = shared
        self.plan, self.tiers, self.compute_dtype = plan, tiers, compute_dtype
        self.frozen = dict(frozen or {})
        self.device_staging: torch.Tensor | None = None  # CUDA: where encoded chunks land to be decoded
        self.state_bytes, self.needs_grad = state_bytes, needs_grad
        self.nvme = nvme
        self.bf16 = compute_dtype != torch.float32
        self.grad_scale: torch.Tensor | None = None  # clipping factor still owed to NVMe gradients
        self.bounce: Any = None  # offload.runtime.swapping.Bounce, set by the engine when NVMe is in use
        self.chunks = [self._allocate(c.index, homes[c.index]) for c in plan.chunks]
        self._gpu_home: dict[int, bool] = {}  # is_gpu_home, remembered (asked for every acquisition)
        self.decoded: dict[int, FrozenLayout] = {}  # chunks decoded for good (decode_home): their encoding

    # -- allocation -----------------------------------------------------------------------
    def _new(self, cid: int, kind: str, name: str, tier: str, dtype: torch.dtype, numel: int | None = None) -> Any:
        n = self.plan.chunks[cid].numel if numel is None else numel
        if tier != "nvme":
            return self.tiers.zeros(tier, kind, n, dtype)
        if self.shared is not None and self.shared.on_nvme(cid):  # the leader's file, read by all
            swap = SwapKind(f"c{cid}.{name}", n, dtype)
            self.tiers.ledger.reserve("nvme", "shared", self.shared.part(swap.nbytes))
            if self.shared.is_leader:
                self.nvme.zeros(swap.key, swap.nbytes)
            return swap
        self.tiers.ledger.reserve("nvme", kind, n * dtype.itemsize)
        swap = SwapKind(f"c{cid}.{name}", n, dtype)
        self.nvme.zeros(swap.key, swap.nbytes)
        return swap

    def _drop(self, tier: str, kind: str, data: Any) -> None:
        if isinstance(data, SwapKind):
            self.nvme.remove(data.key)
            self.tiers.ledger.release("nvme", kind, data.nbytes)
        else:
            self.tiers.free(tier, kind, data)

    def _allocate(self, cid: int, tiers: dict[str, str]) -> _Chunk:
        if cid in self.frozen:
            layout = self.frozen[cid]
            tier = tiers.get("compute", tiers.get("master", "host"))
            nbytes = layout.nbytes if layout is not None else self.plan.chunks[cid].numel * self.compute_dtype.itemsize
            if self.shared is not None and self.shared.holds(cid):  # booked once, by the SharedBase
                return _Chunk(tiers={"compute": "host"}, master=None, grad=None, state=None,
                              compute=self.shared.chunk(cid, nbytes, torch.uint8 if layout else self.compute_dtype),
                              step=torch.zeros((), dtype=torch.float32), names=self.plan.chunks[cid].params)
            compute = (self._new(cid, "compute", "compute", tier, torch.uint8, layout.nbytes) if layout is not None
                       else self._new(cid, "compute", "compute", tier, self.compute_dtype))
            return _Chunk(tiers={"compute": tier}, master=None, grad=None, state=None, compute=compute,
                          step=torch.zeros((), dtype=torch.float32), names=self.plan.chunks[cid].params)
        if cid in self.remote:
            tier = tiers.get("grad", "host")
            return _Chunk(tiers={"grad": tier}, master=None, state=None,
                          grad=self._new(cid, "grad", "grad", tier, torch.float32)
                          if self.needs_grad and self.remote_grads else None,
                          step=torch.zeros((), dtype=torch.float32), names=self.plan.chunks[cid].params)
        tiers = dict(tiers)
        tiers.setdefault("state", tiers.get("master", "host"))
        tiers.setdefault("grad", "host")
        nstate = self.state_bytes(cid)
        return _Chunk(
            tiers=tiers,
            master=self._new(cid, "master", "master", tiers["master"], torch.float32),
            grad=self._new(cid, "grad", "grad", tiers["grad"], torch.float32) if self.needs_grad else None,
            state=self._new(cid, "state", "state", tiers["state"], torch.uint8, nstate) if nstate else None,
            step=torch.zeros((), dtype=torch.float32,
                             device=self.tiers.device if tiers["master"] == "gpu" else "cpu"),
            compute=self._new(cid, "compute", "compute", tiers["compute"], self.compute_dtype) if self.bf16 else None,
            names=self.plan.chunks[cid].params,
        )

    def _free(self, ch: _Chunk) -> None:
        for kind, _, data in ch.kinds():
            self._drop(ch.tiers[kind], kind, data)

    def home_bytes(self, cid: int) -> int:
        """Bytes of every kind of chunk `cid` (what it costs to keep it gpu-home)."""
        if cid in self.frozen:
            return sum(frozen_kind_bytes(self.plan.chunks[cid].numel, layout=self.frozen[cid],
                                         compute_dtype=self.compute_dtype).values())
        return sum(kind_bytes(self.plan.chunks[cid].numel, state_bytes=self.state_bytes(cid),
                              compute_dtype=self.compute_dtype, needs_grad=self.needs_grad).values())

    def promote(self, cid: int, params: dict[str, torch.nn.Parameter]) -> None:
        """Move every kind of chunk `cid` into the gpu tier; its params point there for good
        (an encoded frozen chunk: its blob moves, each use decodes it there, see `to_compute`)."""
        if self.is_shared(cid):
            raise ValueError(f"chunk {cid} lies in the node's shared base: it streams, never gpu-home")
        old = self.chunks[cid]
        new = self._allocate(cid, {k: "gpu" for k in ("master", "grad", "state", "compute")})
        with self.opened(cid) as work:
            for name, t in work.items():
                getattr(new, name).copy_(t)
        new.step.copy_(old.step)
        self._free(old)
        self.chunks[cid] = new
        self._gpu_home.pop(cid, None)
        if not self.is_encoded(cid):  # an encoded chunk's params point at a decoded cache buffer per use
            self.point_params(cid, self.compute_source(cid), params)

    def decode_home(self, cid: int, params: dict[str, torch.nn.Parameter]) -> None:
        """Encoded frozen chunk `cid` decoded once into a device buffer of the compute dtype, its
        home for good (its params point there; no use decodes it again); the encoded bytes are
        let go. The chunk is plain from now on (`is_encoded` False, `is_gpu_home` True)."""
        if self.is_shared(cid) or not self.is_encoded(cid):
            raise ValueError(f"chunk {cid} is not an encoded chunk of this rank's own")
        old = self.chunks[cid]
        buf = self.tiers.empty("gpu", "compute", self.plan.chunks[cid].numel, self.compute_dtype)
        try:
            with self.opened(cid) as work:
                self.to_compute(cid, work["compute"], buf)
        except BaseException:
            self.tiers.free("gpu", "compute", buf)
            raise
        self._free(old)
        self.chunks[cid] = _Chunk(tiers={"compute": "gpu"}, master=None, grad=None, state=None, compute=buf,
                                  step=old.step, names=old.names)
        self.decoded[cid] = self.frozen[cid]  # (weights loaded later go through it: _load_frozen)
        self.frozen[cid] = None
        self._gpu_home.pop(cid, None)
        self.point_params(cid, buf, params)

    # -- in-memory access to possibly swapped kinds ------------------------------------------
    def opened(self, cid: int, *, write_back: bool = False, only: tuple[str, ...] | None = None,
               scratch: dict[str, torch.Tensor] | None = None) -> "_Opened":
        """Context manager: {name: tensor} of chunk `cid`'s kinds in memory (swap files read
        into `scratch` buffers, else temporary ones; written back on exit if `write_back`).
        `only`: just these kinds."""
        return _Opened(self, cid, write_back=write_back, only=only, scratch=scratch)

    # -- views ------------------------------------------------------------------------------
    def in_gpu_tier(self, cid: int) -> bool:
        """Chunk `cid`'s home (its compute copy, or master) is the gpu tier."""
        tiers = self.chunks[cid].tiers
        return (tiers["compute"] if cid in self.frozen else tiers.get("master")) == "gpu"

    def is_gpu_home(self, cid: int) -> bool:
        """The parameters point at the home compute copy for good (never an encoded chunk)."""
        home = self._gpu_home.get(cid)
        if home is None:
            home = self._gpu_home[cid] = self.in_gpu_tier(cid) and self.frozen.get(cid) is None
        return home

    def decodes_on_device(self, cid: int) -> bool:
        """An encoded chunk whose blob lives in the gpu tier: each use decodes it into a cache
        buffer there, nothing crosses the link."""
        return self.in_gpu_tier(cid) and self.is_encoded(cid)

    def is_frozen(self, cid: int) -> bool:
        return cid in self.frozen

    def is_shared(self, cid: int) -> bool:
        return self.shared is not None and (self.shared.holds(cid) or self.shared.on_nvme(cid))

    def is_encoded(self, cid: int) -> bool:
        return self.frozen.get(cid) is not None

    def to_compute(self, cid: int, src: torch.Tensor, buf: torch.Tensor, *, non_blocking: bool = False) -> None:
        """Chunk `cid`'s home compute copy `src` (or its staged bytes) into device `buf`: a copy,
        or for an encoded frozen chunk, the blob to the device and decoded there (a blob already
        on the device, gpu-home or the simulated device's, is decoded from where it lies)."""
        layout = self.frozen.get(cid)
        if layout is None:
            buf.copy_(src, non_blocking=non_blocking)
            return
        blob = src
        if src.device != buf.device:
            blob = self.device_staging[: src.numel()]
            blob.copy_(src, non_blocking=non_blocking)
        frozen_mod.decode_chunk(layout, self.plan, blob, buf)

    def compute_source(self, cid: int) -> Any:
        """The home compute copy of chunk `cid` ([numel] compute dtype), or its SwapKind."""
        ch = self.chunks[cid]
        return ch.compute if ch.compute is not None else ch.master

    def compute_tier(self, cid: int) -> str | None:
        """The home tier of chunk `cid`'s compute copy (None: a remote chunk has none here)."""
        ch = self.chunks[cid]
        return ch.tiers.get("compute" if ch.compute is not None else "master")

    def grad_view(self, slot: Slot) -> torch.Tensor:
        """[numel] in the slot's memory order (see offload.core.chunks)."""
        return slot.flat(self.chunks[slot.chunk].grad)

    def point_params(self, cid: int, buf: torch.Tensor, params: dict[str, torch.nn.Parameter]) -> None:
        """Make the parameters of chunk `cid` views into `buf` ([numel] compute dtype), with
        their own shapes and strides."""
        for name in self.chunks[cid].names:
            params[name].data = self.plan.slots[name].view(buf)

    def unpoint_params(self, cid: int, params: dict[str, torch.nn.Parameter], *, device: torch.device) -> None:
        """Chunk `cid` left the device: its parameters hold no bytes until it comes back.

        The placeholder keeps the parameter's shape (autograd checks it when a gradient
        lands) over one NaN element, so a use of an absent parameter poisons the loss
        instead of silently computing with stale numbers.
        """
        nan = torch.full((), float("nan"), dtype=self.compute_dtype, device=device)
        for name in self.chunks[cid].names:
            params[name].data = nan.expand(self.plan.slots[name].shape)

    # -- data -------------------------------------------------------------------------------
    @torch.no_grad()  # a master copied from a parameter must not join its autograd graph
    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]], params: dict[str, Any]) -> None:
        """Copy (name, tensor) into master slots. Swapped chunks are assembled in memory one
        or two at a time (tensors arrive shard by shard, roughly in chunk order)."""
        open_chunks: dict[int, _Opened] = {}
        free_slots = [0, 1]  # bounce update sets as scratch: no allocation per chunk
        try:
            for name, tensor in named_tensors:
                s = self.plan.slots.get(name)
                if s is not None and s.chunk in self.frozen:
                    self._load_frozen(s, tensor, open_chunks, free_slots)
                    continue
                if s is None:
                    raise KeyError(f"no parameter named {name!r} in this model")
                if tuple(tensor.shape) != s.shape:
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match the model's {s.shape}")
                if s.chunk in self.remote:  # its owner stores it
                    continue
                work = open_chunks.get(s.chunk)
                if work is None:
                    if len(open_chunks) >= 2:  # bound the memory: write back the oldest
                        oldest = next(iter(open_chunks))
                        done = open_chunks.pop(oldest)
                        done.__exit__(None, None, None)
                        free_slots.append(done.slot)
                    slot = free_slots.pop(0)
                    scratch = self.bounce.views(slot, s.chunk) if self.bounce is not None else None
                    work = open_chunks[s.chunk] = self.opened(s.chunk, write_back=True, only=("master", "compute"),
                                                              scratch=scratch)
                    work.slot = slot
                    work.__enter__()
                s.view(work.tensors["master"]).copy_(tensor)
        finally:
            for work in open_chunks.values():
                work.__exit__(None, None, None)

    def _load_frozen(self, s: Slot, tensor: torch.Tensor, open_chunks: dict, free_slots: list) -> None:
        """One frozen parameter into its chunk's compute copy (encoded as its layout says)."""
        if tuple(tensor.shape) != s.shape:
            raise ValueError(f"{s.name}: shape {tuple(tensor.shape)} does not match the model's {s.shape}")
        if self.is_shared(s.chunk) and not self.shared.is_leader:
            return  # the node's leader writes the shared base; this rank maps it read-only
        work = open_chunks.get(s.chunk)
        if work is None:
            if len(open_chunks) >= 2:
                done = open_chunks.pop(next(iter(open_chunks)))
                done.__exit__(None, None, None)
                free_slots.append(done.slot)
            slot = free_slots.pop(0)
            scratch = self.bounce.views(slot, s.chunk) if self.bounce is not None else None
            work = open_chunks[s.chunk] = self.opened(s.chunk, write_back=True, scratch=scratch)
            work.slot = slot
            work.__enter__()
        layout = self.frozen[s.chunk]
        if layout is None and s.chunk in self.decoded:  # decoded for good: the value its encoding decodes to
            frozen_mod.encode_decode_slot(self.decoded[s.chunk], self.plan, s.name, tensor, work.tensors["compute"])
        elif layout is None:
            s.view(work.tensors["compute"]).copy_(tensor)
        else:
            frozen_mod.encode_slot(layout, self.plan, s.name, work.tensors["compute"], tensor)

    def zero_grads(self) -> None:
        for ch in self.chunks:
            if isinstance(ch.grad, SwapKind):
                self.nvme.zeros(ch.grad.key, ch.grad.nbytes)
            elif ch.grad is not None:
                ch.grad.zero_()

    def zero_unseen_grads(self, seen: set[int], params: dict[str, torch.nn.Parameter]) -> None:
        """Parameters that got no gradient this cycle (not in `seen`, by id) must not keep the
        previous cycle's."""
        for name, p in params.items():  # (gradients on NVMe: offload.engine.gradspill handles them)
            grad = self.chunks[self.plan.slots[name].chunk].grad
            if id(p) not in seen and grad is not None and not isinstance(grad, SwapKind):
                self.grad_view(self.plan.slots[name]).zero_()

    def clip_grads_(self, max_norm: float, *, sum_norms: "Callable[[torch.Tensor], torch.Tensor] | None" = None,
                    unseen: "Callable[[int], list[str]] | None" = None) -> torch.Tensor:
        """Global-norm clipping, computed as torch.nn.utils.clip_grad_norm_ does (`max_norm`
        inf: the norm, nothing clipped).

        The norm is taken per parameter with the same kernel and in the same order as the
        reference (chunk by chunk, so gradients on NVMe are read one chunk at a time), then the
        norm of those norms. In-memory gradients are scaled now, whole chunks at once (padding
        is zero); gradients on NVMe get `grad_scale` applied when the update reads them.
        Several ranks: a remote chunk's parameters contribute norms of 0 and `sum_norms` sums
        the vector of per-parameter norms over the ranks (each norm comes from one rank, the
        others add zeros: exact), so every rank takes the reference's norm of all of them.
        `unseen(cid)`: the parameters of chunk `cid` that got no gradient this step, left out of
        the norm as torch leaves out a None .grad (a zero in the list can change the rounding).
        """
        norms: list[torch.Tensor] = []
        for cid, ch in enumerate(self.chunks):
            if cid in self.remote:  # (its gradient is its owner's; none here with owned-only gradients)
                norms.extend(torch.zeros((), dtype=torch.float32) for _ in ch.names)
                continue
            if ch.grad is None:  # frozen
                continue
            with self.opened(cid, only=("grad",)) as work:
                out = () if unseen is None else unseen(cid)
                views = [self.plan.slots[n].view(work["grad"]) for n in ch.names  # as the reference's grads
                         if n not in out]
                if not views:
                    continue
                norms.extend(torch._foreach_norm(views, 2.0))
        if not norms:  # no gradient at all: torch's norm of nothing
            norms = [torch.zeros((), dtype=torch.float32)]
        first = norms[0].device
        stacked = torch.stack([n.to(first) for n in norms])
        if sum_norms is not None:
            stacked = sum_norms(stacked)
        total = torch.linalg.vector_norm(stacked, 2.0)
        if max_norm == float("inf"):  # the norm only (nothing scaled: an inf or nan norm stays the gradients')
            return total
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        for cid, ch in enumerate(self.chunks):
            if ch.grad is not None and not isinstance(ch.grad, SwapKind) and cid not in self.remote:
                ch.grad.mul_(coef.to(ch.grad.device))
        self.grad_scale = coef
        return total

    def named_master(self, params: dict[str, Any], *, trainable_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, fp32 CPU copy) in chunk order, one chunk in memory at a time. The copies are
        contiguous (what an exporter writes), whatever the parameters' strides. `trainable_only`:
        frozen chunks are skipped (not read)."""
        for cid in range(len(self.chunks)):
            if not (trainable_only and cid in self.frozen):
                yield from self.named_chunk(cid)

    def named_chunk(self, cid: int) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, fp32 CPU copy) of the parameters of one chunk this rank stores."""
        ch = self.chunks[cid]
        kind = "compute" if cid in self.frozen else "master"
        with self.opened(cid, only=(kind,)) as work:  # that kind alone: a chunk's state is 2-3x its master
            for name in ch.names:
                if cid in self.frozen:
                    yield name, self._frozen_value(cid, name, work["compute"])
                    continue
                view = self.plan.slots[name].view(work["master"])
                yield name, view.to("cpu", copy=True, memory_format=torch.contiguous_format)

    def _frozen_value(self, cid: int, name: str, data: torch.Tensor) -> torch.Tensor:
        """A frozen parameter as a contiguous fp32 CPU tensor: the values the model computes with
        (an encoded one decoded in the compute dtype, as a chunk decoded for good holds it)."""
        s, layout = self.plan.slots[name], self.frozen[cid]
        flat = (s.flat(data) if layout is None
                else frozen_mod.decode_slot(layout, self.plan, name, data, self.compute_dtype)).float()
        view = flat.as_strided(s.shape, s.stride)
        return view.to("cpu", copy=True, memory_format=torch.contiguous_format)

    def state_dict(self, *, deferred: bool = False) -> dict[str, Any]:
        """Each chunk's master, optimizer state and step; a frozen or remote chunk (the model's
        base; another rank's shard) only its step entry. `deferred`: masters and states are
        offload.runtime.lazy.Deferred, read one chunk at a time while a checkpoint writes them
        (host ones are not copied at all), else CPU copies."""
        out: dict[str, Any] = {"chunk_numel": [c.numel for c in self.plan.chunks], "chunks": []}
        for cid, ch in enumerate(self.chunks):
            entry = {"step": ch.step.cpu().clone()}
            if cid not in self.frozen and cid not in self.remote:
                for kind in ("master", "state"):
                    data = getattr(ch, kind)
                    if data is not None:
                        entry[kind] = Deferred(data.dtype, (data.numel,) if isinstance(data, SwapKind)
                                               else tuple(data.shape), partial(self._kind_in_memory, cid, kind))
            out["chunks"].append(entry)
        return out if deferred else lazy.materialize(out)

    @contextmanager
    def _kind_in_memory(self, cid: int, kind: str) -> Iterator[torch.Tensor]:
        """One kind of chunk `cid` as a CPU tensor while the `with` lasts: its home tensor, or a
        swapped one read into an update set (booked in the ledger; idle between steps)."""
        scratch = None
        if self.bounce is not None and isinstance(getattr(self.chunks[cid], kind), SwapKind):
            scratch = self.bounce.views(0, cid)
        with self.opened(cid, only=(kind,), scratch=scratch) as work:
            t = work[kind]
            yield t if t.device.type == "cpu" else t.to("cpu")

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if list(sd["chunk_numel"]) != [c.numel for c in self.plan.chunks]:
            raise ValueError("checkpoint was written with another chunk layout (model or --chunk-size differ)")
        for cid, (ch, saved) in enumerate(zip(self.chunks, sd["chunks"])):
            if cid in self.frozen or cid in self.remote:  # the base comes from the model; the owner
                continue                                 # loads its chunks
            scratch = self.bounce.views(0, cid) if self.bounce is not None else None
            with self.opened(cid, write_back=True, only=("master", "state", "compute"), scratch=scratch) as work:
                for kind in ("master", "state"):  # copy_ would convert a wrong dtype silently
                    if kind in work and (kind not in saved or saved[kind].dtype != work[kind].dtype
                                         or saved[kind].shape != work[kind].shape):
                        old = ("; or an adamw8bit run of a tierwise before 2026-12-07, whose embeddings kept "
                               "8-bit moments (not resumable)" if kind == "state" else "")
                        raise ValueError(f"checkpoint chunk {cid}'s {kind} is not this engine's "
                                         f"({work[kind].dtype} {tuple(work[kind].shape)}): another "
                                         f"optimizer, precision or --chunk-size wrote it{old}")
                if "state" in saved and "state" not in work:  # it would be dropped (SGD without momentum)
                    raise ValueError(f"checkpoint chunk {cid} has optimizer state this engine keeps none of: "
                                     "another optimizer (or SGD momentum) wrote it")
                lazy.fill(work["master"], saved["master"])  # a stored chunk read straight into its home
                if "state" in work:
                    lazy.fill(work["state"], saved["state"])
                if "compute" in work:
                    work["compute"].copy_(work["master"])
            ch.step.copy_(saved["step"])


class _Opened:
    """The kinds of one chunk as in-memory tensors, for the duration of a `with`."""

    def __init__(self, store: ChunkStore, cid: int, *, write_back: bool, only: tuple[str, ...] | None,
                 scratch: dict[str, torch.Tensor] | None = None):
        self.store, self.cid, self.write_back, self.only = store, cid, write_back, only
        self.scratch = scratch or {}
        self.slot = -1
        self.tensors: dict[str, torch.Tensor] = {}

    def __enter__(self) -> dict[str, torch.Tensor]:
        ch = self.store.chunks[self.cid]
        for _, name, data in ch.kinds():
            if self.only is not None and name not in self.only:
                continue
            if isinstance(data, SwapKind):
                buf = self.scratch.get(name)
                if buf is None:  # aligned, so the NVMe engine reads in place (no bounce buffer)
                    buf = aligned_empty(data.nbytes, pin=False)[: data.nbytes].view(data.dtype)
                self.store.nvme.read(data.key, buf)
                self.tensors[name] = buf
            else:
                self.tensors[name] = data
        return self.tensors

    def __exit__(self, *exc: object) -> None:
        ch = self.store.chunks[self.cid]
        if self.write_back and "compute" in self.tensors and "master" in self.tensors:
            self.tensors["compute"].copy_(self.tensors["master"])
        if self.write_back and not exc[0]:
            for _, name, data in ch.kinds():
                if isinstance(data, SwapKind) and name in self.tensors:
                    self.store.nvme.write(data.key, self.tensors[name])
