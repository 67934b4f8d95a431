"""Chunk storage: the home copies of every chunk kind, in their home tiers.

For chunk c (all flat tensors of plan.chunks[c].numel elements, sharing the slot layout):
- master  fp32, the truth the optimizer updates (in fp32 runs it is also the compute copy
          that is streamed to the device);
- compute bf16 copy for streaming (bf16 runs only), refreshed after every update;
- grad    fp32 accumulator;
- state   the optimizer's tensors (e.g. exp_avg, exp_avg_sq), and a step counter.
A chunk starts host-home; `promote` moves all of it into the gpu tier (gpu-home), where its
compute copy stays and its update runs on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch

from offload.chunks import ChunkPlan, Slot
from offload.tiers import Tiers


@dataclass(kw_only=True)
class _Chunk:
    tier: str
    master: torch.Tensor
    grad: torch.Tensor
    state: dict[str, torch.Tensor]
    step: torch.Tensor
    compute: torch.Tensor | None = None  # bf16 runs only
    names: tuple[str, ...] = field(default=())


class ChunkStore:
    """Home copies of all chunks, with ledger-accounted allocation in their tiers."""

    def __init__(self, *, plan: ChunkPlan, tiers: Tiers, compute_dtype: torch.dtype,
                 state_spec: tuple[tuple[str, torch.dtype], ...]):
        self.plan, self.tiers, self.compute_dtype, self.state_spec = plan, tiers, compute_dtype, state_spec
        self.bf16 = compute_dtype != torch.float32
        self.chunks = [self._allocate(c.index, "host") for c in plan.chunks]

    # -- allocation -------------------------------------------------------------------------
    def _allocate(self, cid: int, tier: str) -> _Chunk:
        n = self.plan.chunks[cid].numel
        t = self.tiers
        return _Chunk(
            tier=tier,
            master=t.zeros(tier, "master", n, torch.float32),
            grad=t.zeros(tier, "grad", n, torch.float32),
            state={k: t.zeros(tier, "state", n, dt) for k, dt in self.state_spec},
            step=torch.zeros((), dtype=torch.float32,
                             device=self.tiers.device if tier == "gpu" else "cpu"),
            compute=t.zeros(tier, "compute", n, self.compute_dtype) if self.bf16 else None,
            names=self.plan.chunks[cid].params,
        )

    def _free(self, ch: _Chunk) -> None:
        t = self.tiers
        t.free(ch.tier, "master", ch.master)
        t.free(ch.tier, "grad", ch.grad)
        for v in ch.state.values():
            t.free(ch.tier, "state", v)
        if ch.compute is not None:
            t.free(ch.tier, "compute", ch.compute)

    def home_bytes(self, cid: int) -> int:
        """Bytes of every kind of chunk `cid` (what it costs to keep it gpu-home)."""
        n = self.plan.chunks[cid].numel
        per = 8 + sum(dt.itemsize for _, dt in self.state_spec) + (self.compute_dtype.itemsize if self.bf16 else 0)
        return n * per

    def promote(self, cid: int, params: dict[str, torch.nn.Parameter]) -> None:
        """Move every kind of chunk `cid` into the gpu tier; its params point there for good."""
        old = self.chunks[cid]
        new = self._allocate(cid, "gpu")
        new.master.copy_(old.master)
        new.grad.copy_(old.grad)
        for k in new.state:
            new.state[k].copy_(old.state[k])
        new.step.copy_(old.step)
        if new.compute is not None:
            new.compute.copy_(old.compute)
        self._free(old)
        self.chunks[cid] = new
        self.point_params(cid, self.compute_source(cid), params)

    # -- views --------------------------------------------------------------------------------
    def is_gpu_home(self, cid: int) -> bool:
        return self.chunks[cid].tier == "gpu"

    def compute_source(self, cid: int) -> torch.Tensor:
        """The home compute copy of chunk `cid` ([numel], compute dtype)."""
        ch = self.chunks[cid]
        return ch.compute if ch.compute is not None else ch.master

    def grad_view(self, slot: Slot) -> torch.Tensor:
        return self.chunks[slot.chunk].grad[slot.offset: slot.offset + slot.numel]

    def point_params(self, cid: int, buf: torch.Tensor, params: dict[str, torch.nn.Parameter]) -> None:
        """Make the parameters of chunk `cid` views into `buf` ([numel] compute dtype)."""
        for name in self.chunks[cid].names:
            s = self.plan.slots[name]
            params[name].data = buf[s.offset: s.offset + s.numel].view(s.shape)

    def unpoint_params(self, cid: int, params: dict[str, torch.nn.Parameter], *, device: torch.device) -> None:
        """Chunk `cid` left the device: its parameters hold no bytes until it comes back.

        The placeholder keeps the parameter's shape (autograd checks it when a gradient
        lands) over one NaN element, so a use of an absent parameter poisons the loss
        instead of silently computing with stale numbers.
        """
        nan = torch.full((1,), float("nan"), dtype=self.compute_dtype, device=device)
        for name in self.chunks[cid].names:
            params[name].data = nan.expand(self.plan.slots[name].shape)

    # -- data ---------------------------------------------------------------------------------
    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]], params: dict[str, Any]) -> None:
        touched = set()
        for name, tensor in named_tensors:
            s = self.plan.slots.get(name)
            if s is None:
                raise KeyError(f"no parameter named {name!r} in this model")
            if tuple(tensor.shape) != s.shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match the model's {s.shape}")
            ch = self.chunks[s.chunk]
            ch.master[s.offset: s.offset + s.numel].copy_(tensor.reshape(-1))
            touched.add(s.chunk)
        for cid in touched:
            self._refresh_compute(cid)

    def _refresh_compute(self, cid: int) -> None:
        ch = self.chunks[cid]
        if ch.compute is not None:
            ch.compute.copy_(ch.master)

    def zero_grads(self) -> None:
        for ch in self.chunks:
            ch.grad.zero_()

    def zero_unseen_grads(self, seen: set, params: dict[str, torch.nn.Parameter],
                          names: dict[torch.nn.Parameter, str]) -> None:
        """Parameters that got no gradient this cycle must not keep the previous cycle's."""
        for name, p in params.items():
            if p not in seen:
                self.grad_view(self.plan.slots[name]).zero_()

    def clip_grads_(self, max_norm: float, names: list[str]) -> torch.Tensor:
        """Global-norm clipping, computed as torch.nn.utils.clip_grad_norm_ does.

        The norm is taken per parameter (same reduction order as the reference), the scaling
        runs on whole chunks (padding is zero, so scaling it changes nothing).
        """
        views = [self.grad_view(self.plan.slots[n]) for n in names]
        total = torch.nn.utils.get_total_norm(views)
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        for ch in self.chunks:
            ch.grad.mul_(coef.to(ch.grad.device))
        return total

    def update(self, updater: Any, hyper: Any) -> None:
        """One optimizer step on every chunk, where its master lives."""
        for cid, ch in enumerate(self.chunks):
            updater.step(ch.master, ch.grad, ch.state, ch.step, hyper)
            self._refresh_compute(cid)

    def named_master(self, params: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
        for name in params:
            s = self.plan.slots[name]
            m = self.chunks[s.chunk].master[s.offset: s.offset + s.numel]
            yield name, m.view(s.shape).to("cpu", copy=True)

    def state_dict(self, params: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"chunk_numel": [c.numel for c in self.plan.chunks], "chunks": []}
        for ch in self.chunks:
            out["chunks"].append({
                "master": ch.master.cpu().clone(), "step": ch.step.cpu().clone(),
                "state": {k: v.cpu().clone() for k, v in ch.state.items()},
            })
        return out

    def load_state_dict(self, sd: dict[str, Any], params: dict[str, Any]) -> None:
        if list(sd["chunk_numel"]) != [c.numel for c in self.plan.chunks]:
            raise ValueError("checkpoint was written with another chunk layout (model or --chunk-size differ)")
        for cid, (ch, saved) in enumerate(zip(self.chunks, sd["chunks"])):
            ch.master.copy_(saved["master"])
            ch.step.copy_(saved["step"])
            for k, v in ch.state.items():
                v.copy_(saved["state"][k])
            self._refresh_compute(cid)
