"""Planner (pure): the home tier of every chunk kind, the CPU/GPU update split, predicted
peaks and step time, or InfeasibleBudget naming the minimum budget that would work.

Policy (mirrors the engine):
(a) the GPU holds a streaming reserve: 2 x the largest chunk in the compute dtype (current +
    prefetch), the largest parameter's gradient in the compute dtype, and the activations;
(b) spare GPU bytes hold whole "gpu-home" chunks (compute + grad + master + state, updated on
    the GPU), taken from the end of first-use order (their grads arrive first in backward). Of
    the suffixes that fit, the planner keeps the one the performance model predicts fastest
    (usually all of them; fewer only when the GPU update would lengthen a compute-bound step);
(c) the other chunks are host-home, updated on the CPU. Their kinds fill DRAM in priority
    order (state, master, grad, then compute copies; in fp32 the compute copy is the master),
    chunk by chunk; what does not fit overflows, compute copies first, to CXL, then NVMe.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
from dataclasses import asdict, dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Any

from offload.chunks import DEFAULT_CHUNK_BYTES, pack_chunks
from offload.errors import InfeasibleBudget, TierwiseError
from offload.perfmodel import (KINDS, StepLoad, activation_bytes, compute_bytes, model_flops, optimizer_cost,
                               param_state_bytes, param_update_flops, predict_step)
from offload.sizes import format_size, parse_size
from profiles import HardwareProfile, ModelProfile, load_hardware_profile, load_model_profile

log = logging.getLogger(__name__)
UNLIMITED = 1 << 62


@dataclass(frozen=True, kw_only=True)
class ChunkHome:
    """Where the kinds of one chunk live (None: the kind does not exist) and who updates it."""

    index: int
    params: int
    update: str
    """"gpu" or "cpu"."""
    compute: str
    grad: str | None
    master: str | None
    state: str | None


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A feasible placement and its predicted cost."""

    model: str
    hardware: str
    optimizer: str
    precision: str
    batch_size: int
    seq_len: int
    chunk_bytes: int
    budgets: dict[str, int | None]
    """Budget per tier in bytes (None: unlimited; 0: tier absent)."""
    num_params: int
    num_chunks: int
    bytes: dict[str, dict[str, int]]
    """bytes[tier][kind] of chunk storage ("compute", "grad", "master", "state")."""
    reserve: dict[str, dict[str, int]]
    """Non-chunk bytes: gpu "stream buffers" and "activations", host "nvme bounce"."""
    peak: dict[str, int]
    """Predicted peak bytes per tier."""
    chunk_homes: tuple[ChunkHome, ...] = field(repr=False)
    gpu_update_params: int
    cpu_update_params: int
    phases: dict[str, float]
    """Predicted seconds per phase."""
    step_s: float
    bottleneck: str
    tokens_per_s: float
    feasible: bool = True

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def render_table(self) -> str:
        """Bytes per tier and kind, the update split, predicted step time and bottleneck."""
        cols = list(KINDS) + ["reserve", "peak", "budget"]
        rows = [["tier"] + cols]
        for tier in ("gpu", "host", "cxl", "nvme"):
            budget = self.budgets.get(tier)
            if not self.peak.get(tier) and not budget:
                continue
            cells = [format_size(self.bytes[tier][k]) if self.bytes[tier][k] else "-" for k in KINDS]
            res = sum(self.reserve.get(tier, {}).values())
            cells += [format_size(res) if res else "-", format_size(self.peak[tier]),
                      "unlimited" if budget is None else format_size(budget)]
            rows.append([tier] + cells)
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [f"{self.model} on {self.hardware}: {self.optimizer}, {self.precision}, "
                 f"batch {self.batch_size} x {self.seq_len}, {self.num_params / 1e9:.2f}B params, "
                 f"{self.num_chunks} chunks of {format_size(self.chunk_bytes)}"]
        lines += ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                  for r in rows]
        total = max(self.num_params, 1)
        lines.append(f"update: GPU {self.gpu_update_params / 1e9:.3f}B params "
                     f"({100 * self.gpu_update_params / total:.1f}%), CPU {self.cpu_update_params / 1e9:.3f}B")
        lines.append("phases: " + ", ".join(f"{k} {v:.3f} s" for k, v in self.phases.items()))
        lines.append(f"step {self.step_s:.3f} s, {self.tokens_per_s:,.0f} tokens/s, bottleneck: {self.bottleneck}")
        return "\n".join(lines)


class _Chunks:
    """Per-chunk byte counts of each kind, with prefix sums for O(log n) placement queries."""

    def __init__(self, *, model: ModelProfile, optimizer: str, precision: str, chunk_bytes: int,
                 rank: int | None) -> None:
        self.cost = optimizer_cost(optimizer)
        ce = compute_bytes(precision)
        specs = model.param_specs()
        by_name = {s.name: s for s in specs}
        self.plan = pack_chunks(specs, chunk_bytes=chunk_bytes, element_size=4)
        self.kinds = {k: [] for k in KINDS}
        self.params, self.flops, self.upd = [], [], []
        for c in self.plan.chunks:
            ps = [by_name[n] for n in c.params]
            self.kinds["compute"].append(c.numel * ce)
            self.kinds["grad"].append(c.numel * 4 if self.cost.needs_grad else 0)
            self.kinds["master"].append(c.numel * 4 if precision == "bf16" else 0)
            self.kinds["state"].append(math.ceil(sum(param_state_bytes(p, cost=self.cost, rank=rank) for p in ps)))
            self.params.append(sum(p.numel for p in ps))
            self.flops.append(sum(param_update_flops(p, cost=self.cost, rank=rank) for p in ps))
        fp32 = precision == "fp32"
        m = self.kinds["compute"] if fp32 else self.kinds["master"]
        self.upd = [2 * (a + s) + g + (0 if fp32 else c) for a, s, g, c in
                    zip(m, self.kinds["state"], self.kinds["grad"], self.kinds["compute"])]
        self.n = len(self.plan.chunks)
        self.total = [sum(t) for t in zip(*self.kinds.values())]
        self.pre = {k: [0, *accumulate(v)] for k, v in self.kinds.items()}
        for name, arr in (("total", self.total), ("params", self.params), ("flops", self.flops), ("upd", self.upd)):
            self.pre[name] = [0, *accumulate(arr)]
        # DRAM priority: the optimizer's working set first; overflow takes the reverse order.
        self.priority = ("state", "compute", "grad") if fp32 else ("state", "master", "grad", "compute")

    def span(self, key: str, a: int, b: int) -> int:
        return self.pre[key][b] - self.pre[key][a]

    def fill(self, segments: list[tuple[str, int, int]], capacity: int) -> tuple[dict[str, int], list, int]:
        """Place segments (kind, first, end) in order until one chunk does not fit.
        Returns (bytes per kind placed, segments left over, bytes used)."""
        placed, used = dict.fromkeys(KINDS, 0), 0
        for i, (kind, a, b) in enumerate(segments):
            pre = self.pre[kind]
            fits = bisect.bisect_right(pre, pre[a] + capacity - used, lo=a, hi=b + 1) - 1
            placed[kind] += pre[fits] - pre[a]
            used += pre[fits] - pre[a]
            if fits < b:
                return placed, [(kind, fits, b)] + segments[i + 1:], used
        return placed, [], used


def _place(ch: _Chunks, *, k: int, host: int, cxl: int, nvme: bool, nvme_cap: int) -> dict[str, dict[str, int]] | None:
    """Bytes per tier per kind of the host-home chunks [0, n-k); None if they do not fit."""
    n = ch.n - k
    segs = [(kind, 0, n) for kind in ch.priority]
    in_host, rest, _ = ch.fill(segs, host)
    out = {"host": in_host, "cxl": dict.fromkeys(KINDS, 0), "nvme": dict.fromkeys(KINDS, 0)}
    if rest and nvme:  # nvme needs bounce buffers in DRAM: refill with less host room
        if host < _bounce(ch):
            return None
        in_host, rest, _ = ch.fill(segs, host - _bounce(ch))
        out["host"] = in_host
    rest = rest[::-1]  # latency-tolerant compute copies and cold data overflow first
    if rest:
        out["cxl"], rest, _ = ch.fill(rest, cxl)
    if rest and nvme:
        out["nvme"], rest, _ = ch.fill(rest, nvme_cap)
    return None if rest else out


def _bounce(ch: _Chunks) -> int:
    return 2 * max(ch.total, default=0)


def _load(ch: _Chunks, placed: dict, *, k: int, flops_fwd: float) -> StepLoad:
    n = ch.n - k
    return StepLoad(
        tokens_flops_fwd=flops_fwd, placed=placed, grad_d2h_bytes=ch.span("compute", 0, n) if ch.cost.needs_grad else 0, cpu_params=ch.span("params", 0, n), cpu_flops=ch.span("flops", 0, n),
        gpu_update_bytes=ch.span("upd", n, ch.n), gpu_update_flops=ch.span("flops", n, ch.n),
        chunk_compute_bytes=max(ch.kinds["compute"][:n], default=0), chunk_params=max(ch.params[:n], default=0))


def make_plan(*, model: ModelProfile | str | Any, hardware: HardwareProfile | str, gpu_mem: int | str | None,
              cpu_mem: int | str | None, cxl_mem: int | str | None = None, nvme_path: str | None = None,
              nvme_mem: int | str | None = None, optimizer: str, precision: str, batch_size: int, seq_len: int,
              chunk_bytes: int = DEFAULT_CHUNK_BYTES, rank: int | None = None) -> Plan:
    """Plan a run; budgets are bytes or size strings (None: the profile's size, else unlimited).

    `model`: a profile, a profile name/path, or a transformers model/config (its shapes are read).
    `hardware`: a profile or name/path; None means "cpu-sim". Raises InfeasibleBudget naming the
    minimum gpu / host / nvme bytes when they cannot fit."""
    if isinstance(model, (str, Path)):
        model = load_model_profile(model)
    elif not isinstance(model, ModelProfile):
        model = ModelProfile.from_hf_config(model)
    hw = hardware if isinstance(hardware, HardwareProfile) else load_hardware_profile(hardware or "cpu-sim")
    if batch_size <= 0 or seq_len <= 0:
        raise TierwiseError(f"batch size and sequence length must be positive, got {batch_size} x {seq_len}")
    gpu = parse_size(gpu_mem, what="--gpu-mem")
    gpu = hw.gpu.memory if gpu is None else gpu
    host = parse_size(cpu_mem, what="--cpu-mem")
    host = (hw.host.memory or UNLIMITED) if host is None else host
    cxl = parse_size(cxl_mem, what="--cxl-mem")
    cxl = (hw.cxl.memory if hw.cxl else 0) if cxl is None else cxl
    if cxl and hw.cxl is None:
        raise TierwiseError(f"a CXL budget was given but hardware profile '{hw.name}' has no [cxl] table")
    if nvme_path is not None and hw.nvme is None:
        raise TierwiseError(f"--nvme-path was given but hardware profile '{hw.name}' has no [nvme] table")
    nvme_cap = parse_size(nvme_mem, what="--nvme-mem")
    nvme_cap = (hw.nvme.capacity if hw.nvme and hw.nvme.capacity else UNLIMITED) if nvme_cap is None else nvme_cap
    use_nvme = nvme_path is not None

    ch = _Chunks(model=model, optimizer=optimizer, precision=precision, chunk_bytes=chunk_bytes, rank=rank)
    ce = compute_bytes(precision)
    act = activation_bytes(model=model, batch_size=batch_size, seq_len=seq_len, precision=precision,
                           backward=ch.cost.needs_grad)
    stream = 2 * ch.plan.max_chunk_numel() * ce
    grad_tmp = model.largest_param_numel() * ce if ch.cost.needs_grad else 0
    gpu_reserve = stream + grad_tmp + act
    if gpu < gpu_reserve:
        raise InfeasibleBudget(
            f"--gpu-mem {format_size(gpu)} is too small: needs at least {format_size(gpu_reserve)} "
            f"(2 streamed chunks {format_size(stream)} + largest gradient {format_size(grad_tmp)} + "
            f"activations {format_size(act)} at batch {batch_size} x {seq_len})", minimum={"gpu": gpu_reserve})

    free = gpu - gpu_reserve
    k_max = 0  # longest suffix of whole chunks that fits in the spare GPU bytes
    while k_max < ch.n and ch.span("total", ch.n - k_max - 1, ch.n) <= free:
        k_max += 1
    flops_fwd = model_flops(model=model, batch_size=batch_size, seq_len=seq_len)
    best = None
    for k in range(k_max, -1, -1):
        placed = _place(ch, k=k, host=host, cxl=cxl, nvme=use_nvme, nvme_cap=nvme_cap)
        if placed is None:
            break  # fewer gpu-home chunks only need more host room
        pred = predict_step(hardware=hw, precision=precision, cost=ch.cost, tokens=batch_size * seq_len,
                            load=_load(ch, placed, k=k, flops_fwd=flops_fwd))
        if best is None or pred.step_s < best[2].step_s * (1 - 1e-9):
            best = (k, placed, pred)
    if best is None:
        _refuse_host(ch, k=k_max, host=host, cxl=cxl, nvme=use_nvme, nvme_cap=nvme_cap)
    k, placed, pred = best
    return _build(ch, model=model, hw=hw, k=k, placed=placed, pred=pred, precision=precision,
                  budgets={"gpu": gpu, "host": None if host == UNLIMITED else host, "cxl": cxl,
                           "nvme": (None if nvme_cap == UNLIMITED else nvme_cap) if use_nvme else 0},
                  reserve={"gpu": {"stream buffers": stream + grad_tmp, "activations": act}},
                  batch_size=batch_size, seq_len=seq_len, chunk_bytes=chunk_bytes, optimizer=optimizer)


def _refuse_host(ch: _Chunks, *, k: int, host: int, cxl: int, nvme: bool, nvme_cap: int) -> None:
    lo, hi = host, UNLIMITED >> 1  # smallest host budget that fits, by bisection (placement is monotone)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _place(ch, k=k, host=mid, cxl=cxl, nvme=nvme, nvme_cap=nvme_cap) else (mid, hi)
    hint = (f" with {format_size(nvme_cap)} of NVMe space (more NVMe space would also help)" if nvme
            else "; or give --nvme-path to spill to disk")
    raise InfeasibleBudget(f"--cpu-mem {format_size(host)} is too small: needs at least {format_size(hi)}"
                           f" for the chunks the GPU cannot hold{hint}", minimum={"host": hi})


def _build(ch: _Chunks, *, model: ModelProfile, hw: HardwareProfile, k: int, placed: dict, pred, precision: str,
           budgets: dict, reserve: dict, **meta) -> Plan:
    n = ch.n - k
    by_tier = {"gpu": {kind: ch.span(kind, n, ch.n) for kind in KINDS}, **placed}
    homes: dict[str, list[str | None]] = {kind: [None] * ch.n for kind in KINDS}
    for kind in KINDS:  # materialise the placement chunk by chunk: the same order as _place
        for j in range(n, ch.n):
            homes[kind][j] = "gpu" if ch.kinds[kind][j] else None
    left = {t: dict(placed[t]) for t in ("host", "cxl", "nvme")}
    for tier, order in (("host", ch.priority), ("cxl", ch.priority[::-1]), ("nvme", ch.priority[::-1])):
        for kind in order:
            for j in range(n):
                b = ch.kinds[kind][j]
                if homes[kind][j] is None and b and left[tier][kind] >= b:
                    homes[kind][j], left[tier][kind] = tier, left[tier][kind] - b
    if any(b and homes[kind][j] is None for kind in KINDS for j, b in enumerate(ch.kinds[kind])):
        raise AssertionError("placement left a chunk kind without a home")
    if precision == "fp32":  # the compute copy is the master
        homes["master"] = [None] * ch.n
    bounce = _bounce(ch) if any(placed["nvme"].values()) else 0
    reserve = {**reserve, "host": {"nvme bounce": bounce}}
    peak = {t: sum(by_tier[t].values()) + sum(reserve.get(t, {}).values()) for t in by_tier}
    chunk_homes = tuple(ChunkHome(index=j, params=ch.params[j], update="gpu" if j >= n else "cpu",
                                  compute=homes["compute"][j], grad=homes["grad"][j], master=homes["master"][j],
                                  state=homes["state"][j]) for j in range(ch.n))
    log.info("plan %s on %s: %d of %d chunks gpu-home, step %.3f s (%s)", model.name, hw.name, k, ch.n,
             pred.step_s, pred.bottleneck)
    return Plan(model=model.name, hardware=hw.name, precision=precision, budgets=budgets,
                num_params=model.num_params, num_chunks=ch.n, bytes=by_tier, reserve=reserve, peak=peak,
                chunk_homes=chunk_homes, gpu_update_params=ch.span("params", n, ch.n),
                cpu_update_params=ch.span("params", 0, n), phases=pred.phases, step_s=pred.step_s,
                bottleneck=pred.bottleneck, tokens_per_s=pred.tokens_per_s, **meta)
