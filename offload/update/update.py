"""The optimizer step on chunks: each optimizer's pure step function run on chunk storage.

Optimizer state lives in one flat byte *blob* per chunk (ledger kind "state"), so it can be
placed, swapped to NVMe and promoted to the device like any other kind. An updater says how
big the blob of a chunk is and how to step a chunk given its master, grad and blob:
- chunk-wise (AdamWChunks, SGDChunks): one kernel call per chunk. AdamW: torch's fused
  kernel, which works in 64-byte units from each tensor's start and computes a tensor's last
  numel % 8 (AVX2; % 16 with AVX-512) elements on a scalar path that rounds differently from
  its vector body. So a parameter whose numel is not a multiple of ALIGN (16) is passed as a
  tensor of its own, exactly as torch.optim.AdamW(fused=True) sees it; runs of consecutive
  parameters that are multiples of 16 (no tail, no padding between them) go as one tensor,
  every element on the vector path as in the per-tensor call (`fused_ranges`). Bit-exact for
  every element count wherever the kernel's vector width divides 16 floats (x86 AVX2 and
  AVX-512, ARM NEON). SGD's elementwise ops round the same on both paths: whole chunks,
  bit-exact with torch.optim.SGD.
- slot-wise (SlotUpdater): the optim/ pure function per parameter slot, with that slot's state
  carved out of the blob, so the engine equals the drop-in optimizer step for step (8-bit
  blocks, small-tensor fallbacks and low-rank projections all follow the parameter).

A parameter that got no gradient in a step (an unused branch, an expert no token reached) sits
that update out, as torch.optim skips a parameter whose .grad is None (`Skips`): its moments do
not decay, no weight decay applies, and its own step count falls behind its chunk's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..core.chunks import ALIGN, ChunkPlan, ChunkSpec
from .table import ALIGN_BYTES


def check_lr(lr: float) -> None:
    """A NaN or infinite lr would turn every weight into NaN at the next update."""
    if not (math.isfinite(lr) and lr >= 0):
        raise ValueError(f"lr must be finite and >= 0, got {lr}")


@dataclass(kw_only=True)
class Hyper:
    """Hyper-parameters shared by the chunk updaters (lr may change every step)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0

    def __post_init__(self) -> None:
        check_lr(self.lr)
        if not all(math.isfinite(x) and x >= 0 for x in (self.eps, self.weight_decay, self.momentum)):
            raise ValueError(f"eps, weight_decay and momentum must be finite and >= 0, got "
                             f"{self.eps}, {self.weight_decay}, {self.momentum}")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must be in [0, 1): {self.betas}")


def _align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def fused_ranges(plan: ChunkPlan, chunk: ChunkSpec) -> list[tuple[int, int]]:
    """(offset, numel) of the tensors the fused kernel gets for `chunk`: each slot whose numel
    is not a multiple of ALIGN alone, consecutive slots that are multiples of ALIGN merged."""
    return [(a, b - a) for a, b, _ in spans(plan, chunk.params, _fuses)]


def spans(plan: ChunkPlan, names: "tuple[str, ...]", joins: Callable[[Any, Any], bool], *,
          absent: "list[str] | tuple[()]" = (), missed: "dict[str, int] | None" = None
          ) -> list[tuple[int, int, int]]:
    """[start, end) element spans of the parameters `names` (in chunk order) not in `absent`,
    each with its `missed` count: neighbours with the same count are one span where
    `joins(previous slot, slot)`."""
    out: list[list[int]] = []
    prev = None
    for name in names:
        if name in absent:
            prev = None
            continue
        s, k = plan.slots[name], (missed or {}).get(name, 0)
        if prev is not None and out[-1][2] == k and joins(prev, s):
            out[-1][1] = s.offset + s.numel
        else:
            out.append([s.offset, s.offset + s.numel, k])
        prev = s
    return [(a, b, k) for a, b, k in out]


def _fuses(a: Any, b: Any) -> bool:
    """Slots `a` then `b` go to the fused kernel as one tensor: both multiples of ALIGN, `b`
    right after `a`."""
    return a.numel % ALIGN == 0 and b.numel % ALIGN == 0 and a.offset + a.numel == b.offset


class Skips:
    """Which parameters sit a chunk's update out. `unseen(cid)`, set by the engine for an update
    where some parameter got no gradient (None: every parameter takes it), lists the parameters of
    chunk `cid` without one; `missed` counts the updates each parameter sat out (checkpointed),
    so its own step count is its chunk's minus that."""

    def __init__(self, plan: ChunkPlan):
        self.plan = plan
        self.unseen: Callable[[int], list[str]] | None = None
        self.missed: dict[str, int] = {}

    def absent(self, cid: int) -> list[str]:
        """The parameters of chunk `cid` without a gradient this step; called once per update
        of the chunk (it counts them as missed)."""
        if self.unseen is None:
            return []
        names = self.unseen(cid)
        for n in names:
            self.missed[n] = self.missed.get(n, 0) + 1
        return names

    def runs(self, cid: int, absent: list[str], joins: Callable[[Any, Any], bool]) -> list[tuple[int, int, int]]:
        """`spans` of the parameters of `cid` taking this update, with their missed counts."""
        return spans(self.plan, self.plan.chunks[cid].params, joins, absent=absent, missed=self.missed)

    def whole(self, cid: int, absent: list[str]) -> bool:
        """Every parameter of the chunk takes this update at the chunk's own step count."""
        return not absent and not (self.missed and any(n in self.missed for n in self.plan.chunks[cid].params))


class AdamWChunks(Skips):
    """Decoupled-weight-decay Adam (AdamW) on fp32 chunks: torch's fused kernel, each
    parameter seen as torch.optim.AdamW(fused=True) sees it (see the module docstring)."""

    name = "adamw"
    needs_grad = True

    def __init__(self, plan: ChunkPlan):
        super().__init__(plan)
        self.ranges = {c.index: fused_ranges(plan, c) for c in plan.chunks}

    def state_bytes(self, cid: int) -> int:
        return 8 * self.plan.chunks[cid].numel

    def step(self, master: torch.Tensor, grad: torch.Tensor, blob: torch.Tensor, cid: int,
             step: torch.Tensor, hp: Hyper) -> None:
        """master, grad: [numel] fp32; blob: [8 numel] uint8 (exp_avg, exp_avg_sq); step: [] fp32."""
        n = master.numel()
        m, v = blob[: 4 * n].view(torch.float32), blob[4 * n: 8 * n].view(torch.float32)
        step += 1
        absent = self.absent(cid) if self.unseen is not None else []
        if not self.missed and not absent or self.whole(cid, absent):  # (the first test: no call)
            ranges, steps = self.ranges[cid], [step] * len(self.ranges[cid])
        else:  # the parameters taking this update, merged as fused_ranges does where their counts agree
            spans = self.runs(cid, absent, _fuses)
            if not spans:
                return
            ranges = [(a, b - a) for a, b, _ in spans]
            steps = [step - k if k else step for _, _, k in spans]

        def slots(t: torch.Tensor) -> list[torch.Tensor]:  # [numel] views of the chunk
            return [t[o: o + k] for o, k in ranges]

        torch._fused_adamw_(
            slots(master), slots(grad), slots(m), slots(v), [], steps,
            amsgrad=False, lr=hp.lr, beta1=hp.betas[0], beta2=hp.betas[1],
            weight_decay=hp.weight_decay, eps=hp.eps, maximize=False,
        )

    def meta_state(self) -> dict:
        return {}

    def load_meta_state(self, meta: dict) -> None:
        pass


class SGDChunks(AdamWChunks):
    """SGD with optional momentum and L2 weight decay, as torch.optim.SGD computes it."""

    name = "sgd"

    def __init__(self, plan: ChunkPlan, momentum: float = 0.0):
        super().__init__(plan)
        self.momentum = momentum

    def state_bytes(self, cid: int) -> int:
        return 4 * self.plan.chunks[cid].numel if self.momentum else 0

    def step(self, master: torch.Tensor, grad: torch.Tensor, blob: torch.Tensor, cid: int,
             step: torch.Tensor, hp: Hyper) -> None:
        """master, grad: [numel] fp32; blob: [4 numel] uint8 momentum buffer or empty."""
        absent = self.absent(cid) if self.unseen is not None else []
        buf = blob.view(torch.float32) if self.momentum else None
        if not self.missed and not absent or self.whole(cid, absent):
            self._sgd(master, grad, buf, first=step.item() == 0, hp=hp)
        else:  # spans of neighbours with the same count (elementwise: a span rounds as the whole chunk)
            done = int(step.item())
            for start, end, k in self.runs(cid, absent, lambda a, b: True):  # (padding: zeros, stays zero)
                self._sgd(master[start:end], grad[start:end], None if buf is None else buf[start:end],
                          first=done == k, hp=hp)
        step += 1

    def _sgd(self, p: torch.Tensor, g: torch.Tensor, buf: "torch.Tensor | None", *, first: bool,
             hp: Hyper) -> None:
        d_p = g if hp.weight_decay == 0 else g.add(p, alpha=hp.weight_decay)
        if buf is not None:
            if first:
                buf.copy_(d_p)
            else:
                buf.mul_(self.momentum).add_(d_p)
            d_p = buf
        p.add_(d_p, alpha=-hp.lr)


@dataclass(kw_only=True)
class _Entry:
    key: str
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(kw_only=True)
class _SlotLayout:
    name: str
    index: int  # 1-based position in the drop-in optimizer's parameter order
    projected: bool
    entries: list[_Entry] = field(default_factory=list)


class SlotUpdater(Skips):
    """A drop-in optimizer's pure step function, run per parameter slot on chunk storage.

    `init(meta_param, projected) -> state dict` and `run(param, grad, state, step, index,
    projected, hp)` adapt one optim/ algorithm. Tensor state lives in the chunk's blob;
    non-tensor state (e.g. which projection is in force) lives in `meta`.
    """

    needs_grad = True

    def __init__(self, name: str, plan: ChunkPlan, *, order: list[str], projected: set[str],
                 init: Callable[[torch.Tensor, bool], dict], run: Callable[..., None]):
        super().__init__(plan)
        self.name, self.init, self.run = name, init, run
        index = {n: i + 1 for i, n in enumerate(order)}
        self.layouts: dict[int, list[_SlotLayout]] = {}
        self.nbytes: dict[int, int] = {}
        self.meta: dict[str, dict[str, Any]] = {}
        for c in plan.chunks:
            off, slots = 0, []
            for name in c.params:
                s = plan.slots[name]
                lay = _SlotLayout(name=name, index=index[name], projected=name in projected)
                proto = init(torch.empty(s.shape, device="meta"), lay.projected)
                for key, val in proto.items():
                    if isinstance(val, torch.Tensor):
                        lay.entries.append(_Entry(key=key, offset=off, shape=tuple(val.shape), dtype=val.dtype))
                        off += _align(val.numel() * val.element_size())
                    else:
                        self.meta.setdefault(name, {})[key] = val
                slots.append(lay)
            self.layouts[c.index], self.nbytes[c.index] = slots, off

    def state_bytes(self, cid: int) -> int:
        return self.nbytes[cid]

    def step(self, master: torch.Tensor, grad: torch.Tensor, blob: torch.Tensor, cid: int,
             step: torch.Tensor, hp: Hyper) -> None:
        """master, grad: [numel] fp32 chunk tensors; blob: [state_bytes(cid)] uint8."""
        step += 1
        k = int(step.item())
        absent = self.absent(cid) if self.unseen is not None else []
        for lay in self.layouts[cid]:
            if lay.name in absent:
                continue
            s = self.plan.slots[lay.name]
            views = {e.key: blob[e.offset: e.offset + math.prod(e.shape) * e.dtype.itemsize]
                     .view(e.dtype).view(e.shape) for e in lay.entries}
            state = dict(views) | self.meta.get(lay.name, {})
            p, g = s.view(master), s.view(grad)  # the parameter as the drop-in sees it
            self.run(p, g, state, step=k - self.missed.get(lay.name, 0), index=lay.index, projected=lay.projected, hp=hp)
            for key, val in state.items():
                if key in views:
                    if val is not views[key]:  # the step replaced a tensor (e.g. a new projector)
                        views[key].copy_(val)
                else:
                    self.meta.setdefault(lay.name, {})[key] = val

    def meta_state(self) -> dict:
        """Non-tensor state (checkpointed beside the blobs)."""
        return {n: {k: v for k, v in d.items() if not isinstance(v, torch.Tensor)} for n, d in self.meta.items()}

    def load_meta_state(self, meta: dict) -> None:
        for n, d in meta.items():
            self.meta.setdefault(n, {}).update(d)
