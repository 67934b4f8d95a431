"""Planner (pure): the home tier of every chunk kind, predicted peaks per tier and step time,
or InfeasibleBudget naming the minimum budget that would work.

The planner mirrors the engine byte for byte on the simulated device, by construction:
- chunking: `pack_chunks` over the parameters of the module the run trains (`params`, as
  `finetune` passes them; else the profile's, HF registration order = first-use order) with
  the same chunk size; optimizer state bytes from the optimizer table
  (`offload.update.table.state_bytes`, the engine's updater allocation in closed form: no torch);
- the gpu side: the same `DeviceNeeds` (module buffers; the streaming window = the widest
  module's chunks + the largest chunk; the gradient reserve = the largest parameter, for MeZO
  the perturbed copies of the widest module; the activations, here computed in closed form by
  `perfmodel.activation_bytes`, which matches what the engine measures for a batch without
  or, with `padded`, with a dense S x S attention mask: the run's worst step)
  handed to the engine's own `placement.plan_device`, which picks the gpu-home chunks (a
  suffix of first-use order) and the cache size for streamed compute copies; on a CUDA
  device (a profile's or `cuda`) around the workspace margin the engine leaves the allocator (`needs.workspace_margin`,
  1/16 of the budget; what its warm-up measures beside the ledger cannot be known here);
- the host side: the kinds placed by the engine's own `homes.assign_homes` (DRAM, then CXL,
  then NVMe) over the chunks the engine keeps host-side when it is built (`up_front`), and a
  refusal where the engine would not fit (e.g. the CXL allocator's page rounding).
Verified against the engine by tests/test_plan_vs_engine.py and tests/test_budget_matrix.py.
What is left to a model is time: `perfmodel.predict_step`.
Several ranks (`nproc_per_node`, `nnodes`): `_plan_ranks` and offload/plan/ranks.py (bytes per
rank and per node, the frozen base once per node, collective bytes: tests/test_plan_ranks.py).
Over 600 lines: `make_plan`'s one pass mirrors the engine's construction step by step (chunks,
device needs, homes, transients, the rank split), and cutting it apart would split the one
sequence the tests hold byte for byte against the engine; its pieces live in needs, homes,
placement, perfmodel, lora and ranks.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from ..core.chunks import DEFAULT_CHUNK_BYTES, ChunkPlan, ParamSpec, pack_chunks
from ..core.encoding import is_expert
from ..core.errors import InfeasibleBudget, TierwiseError, UnsupportedModel
from ..core.options import recomputed_blocks
from ..core.vocab import GRAD_REDUCE, TIERS
from .homes import Homes, assign_homes, beside_reserved, minimum_host
from .perfmodel import (KINDS, LoraAct, StepLoad, activation_bytes, activation_parts, buffer_bytes, model_blocks,
                               compute_bytes, model_flops,
                               ops_per_forward, param_update_flops, predict_step)
from ..update.table import LOW_RANK, MOE_ZEROTH, optimizer_spec, projected_params, state_bytes
from .lora import LoraModel, base_dtype_of, frozen_chunk_bytes, lora_specs, step_trace
from .schedule import kept_over_end, plan_schedule
from .needs import (BLOCK_SHARE, MARGIN_SHARE, block_of, device_needs, gathering, grad_staging_bytes,
                    minimum_with_margin, module_of, units_are_blocks, workspace_margin, zo_workspace)
from .placement import DeviceNeeds, DevicePlan, plan_device
from . import ranks as multi
from .ranks import Collectives, RankPlan
from ..core.units import format_size
from ..core.sizes import parse_size
from ...profiles import HardwareProfile, ModelProfile, load_hardware_profile, load_model_profile

MASKED = " (S x S mask)"
"""How a plan's batch line says it was planned for a batch with a dense attention mask (`padded`)."""

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ChunkHome:
    """Where the kinds of one chunk live (None: the kind does not exist) and who updates it."""

    index: int
    params: int
    update: str
    """"gpu" or "cpu" ("none": a frozen chunk)."""
    compute: str | None
    """Tier the compute copy streams from (in fp32 runs: the master's tier; "gpu" when gpu-home)."""
    grad: str | None
    master: str | None
    state: str | None


#: The process beside its budgets, as the OS counts it: Python, torch, transformers, matplotlib,
#: the model's skeleton, the tokenizer and the data. Measured on CPU when the engine is built
#: (bench/host_rss.py, a 0.6B Llama: 321-329 MiB) plus 32 MiB for what the first step brings in.
#: A CUDA context adds host memory of its own that no CPU run measures (gpu_check records it).
PROCESS_BYTES = 360 << 20
#: What importing PEFT adds for a LoRA/QLoRA run (measured: 51 MiB, peft 0.21; 387-392 MiB of
#: anonymous RSS when the engine is built, against 323 MiB for a full fine-tune of the same model).
PEFT_BYTES = 64 << 20


def process_bytes(*, lora: bool) -> int:
    """The process beside its budgets, as the OS counts it (PROCESS_BYTES, PEFT_BYTES)."""
    return PROCESS_BYTES + (PEFT_BYTES if lora else 0)


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
    """bytes[tier][kind] of chunk home storage ("compute", "grad", "master", "state"), as the
    engine's ledger names them: fp32 runs have no separate compute copy (the master is streamed)."""
    reserve: dict[str, dict[str, int]]
    """Non-chunk bytes: gpu "buffers", "stream cache" (streamed compute copies, at most the cache
    limit), "grad in flight" (MeZO: "workspace", its perturbed parameter copies), "activations";
    host "nvme bounce"."""
    peak: dict[str, int]
    """Predicted peak bytes per tier in steady state (after the warm-up step), as the engine's
    ledger books them (the gpu `workspace_margin` is left free beside them)."""
    gpu_minimum: int
    """The smallest gpu budget the engine accepts for this run (its `minimum_gpu_bytes`; on
    CUDA the smallest budget that holds it beside its own workspace margin)."""
    host_minimum: int
    """The smallest host budget the engine accepts with these cxl/nvme tiers (`homes.minimum_host`
    over the chunks it places host-side when built -- see `make_plan(up_front=...)` -- raised
    where the engine's real NVMe bounce buffers would not fit)."""
    cache_limit: int
    """Bytes the engine's resident cache may use for streamed compute copies."""
    chunk_homes: tuple[ChunkHome, ...] = field(repr=False)
    gpu_update_params: int
    cpu_update_params: int
    phases: dict[str, float]
    """Predicted seconds per phase."""
    step_s: float
    bottleneck: str
    tokens_per_s: float
    bounds: dict[str, str] = field(default_factory=dict)
    """The resource that bounds each phase (perfmodel.StepPrediction.bounds)."""
    active_params: int | None = None
    """A mixture of experts: the parameters one token's forward uses (with LoRA, its adapters too)."""
    checkpointing: int = 0
    """Decoder blocks backward recomputes (activation checkpointing): the first ones; 0 none."""
    layers: int = 0
    """The model's decoder blocks."""
    host_rss: int = 0
    """What the OS will count for the process (per node with several ranks): the host peak, the
    process itself (`process_bytes` each) and, on the simulated device, its gpu peak (host RAM).
    Anonymous memory: RSS as `top` shows it adds the pages of torch's libraries the process has
    read (130-330 MiB measured), which are shared and which the OS drops under pressure."""
    process_bytes: int = PROCESS_BYTES
    """Of host_rss, each process's own (process_bytes)."""
    padded: bool = False
    """Planned for a batch whose attention takes a dense S x S mask (perfmodel.activation_parts):
    the run's worst step when some batch does (cli.planning.data_padded)."""
    row_positions: bool = False
    """Batches carry position ids per row (packed rows kept apart: cli.data)."""
    windows: bool = False
    """A sliding window shorter than a long row is attended in blocks (offload.engine.segments)."""
    offload: bool = False
    """Recomputed blocks' inputs wait in host memory (reserve host "activations")."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (tokens per step = batch x seq_len x grad_accum)."""
    feasible: bool = True
    lora_rank: int | None = None
    """A LoRA run's adapter rank (None: every parameter trains)."""
    lora_targets: str | None = None
    base_dtype: str | None = None
    """How a LoRA run's frozen base is stored (codecs: fp32 / bf16 / fp16 / int8 / nf4)."""
    trainable_params: int = 0
    checkpoint_bytes: int = 0
    """A checkpoint's tensors (all ranks' together): every trainable chunk's fp32 master and optimizer
    state, the bytes the engine's state_dict holds (cli.diskspace, which checks the run's exactly)."""
    base_read: dict[str, int] = field(default_factory=dict)
    """Bytes of the frozen base read per step from each host-side tier (the link carries them)."""
    base_written: int = 0
    """Bytes of the frozen base written per step: none, it is never written back."""
    base_fetches_per_chunk: float = 0.0
    """Average fetches of a streamed base chunk per micro-batch: forward, and backward (a recomputed
    block's recompute and backward share one fetch), less what the cache keeps across the turn."""
    dequant_s: float = 0.0
    """Seconds per step decoding the base on the device (memory-bound: encoded in, decoded out)."""
    base_decoded: bool = False
    """The encoded base is decoded once on the gpu and kept so (the budget holds it decoded)."""
    suggestion: str | None = None
    """For LoRA runs: the micro-batch x grad-accum that makes the step compute-bound."""
    workspace_margin: int = 0
    """On a CUDA device (`make_plan(cuda=...)`): gpu bytes the engine leaves free for the
    allocator beside its ledger (offload.plan.needs.workspace_margin: 1/16 of the budget; the engine adds what its warm-up
    measures the allocator holding beside the ledger). Placed around, not in the gpu peak (the
    ledger's bytes). 0 on the simulated device, which has no allocator."""
    ranks: RankPlan | None = None
    """Several ranks (--nproc-per-node / --nnodes): then the gpu row, reserve and update split are
    rank 0's, the host / cxl / nvme rows the node's (its ranks' own bytes and the base once), the
    step time the slowest rank's and tokens/s the whole step's (plan.ranks)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def render_table(self) -> str:
        """Bytes per tier and kind, the update split, predicted step time and bottleneck."""
        kinds = list(KINDS) + (["base"] if self.lora_rank is not None else [])
        cols = kinds[:-1] + [f"base {self.base_dtype}"] if self.lora_rank is not None else list(kinds)
        cols += ["reserve", "peak", "budget"]
        rows = [["tier"] + cols]
        for tier in TIERS:
            budget = self.budgets.get(tier)
            if not self.peak.get(tier) and not budget:
                continue
            cells = [format_size(self.bytes[tier].get(k, 0)) if self.bytes[tier].get(k) else "-" for k in kinds]
            res = sum(self.reserve.get(tier, {}).values())
            cells += [format_size(res) if res else "-", format_size(self.peak[tier]),
                      "unlimited" if budget is None else format_size(budget)]
            rows.append([tier] + cells)
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [f"{self.model} on {self.hardware}: {self.optimizer}, {self.precision}, "
                 f"batch {self.batch_size} x {self.seq_len}{MASKED if self.padded else ''}, "
                 f"grad-accum {self.grad_accum}, {_count(self.num_params)} params"
                 f"{f' ({_count(self.active_params)} active a token)' if self.active_params else ''}, "
                 f"{self.num_chunks} chunk{'s' * (self.num_chunks != 1)} of {format_size(self.chunk_bytes)}, "
                 f"recompute {recompute_text(self.checkpointing, self.layers)}"]
        if self.lora_rank is not None:
            lines.append(f"LoRA rank {self.lora_rank} on {self.lora_targets}: {_count(self.trainable_params)} "
                         f"trainable params; the base ({_count(self.num_params - self.trainable_params)}) frozen, "
                         f"stored {self.base_dtype}")
        if self.ranks is not None:
            lines.append(f"gpu: per rank (rank 0 shown); host, cxl, nvme: per node ({self.ranks.nproc_per_node} "
                         f"ranks' own bytes{' and the frozen base once' if self.lora_rank is not None else ''})")
        lines += ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                  for r in rows]
        total = max(self.trainable_params or self.num_params, 1)
        lines.append(f"update: GPU {_count(self.gpu_update_params)} params "
                     f"({100 * self.gpu_update_params / total:.1f}%), CPU {_count(self.cpu_update_params)}")
        lines.append("phases: " + ", ".join(f"{k} {v:.3f} s" + (f" ({self.bounds[k]}-bound)" if k in self.bounds else "")
                                            for k, v in self.phases.items()))
        lines.append(f"step {self.step_s:.3f} s, {_rate(self.tokens_per_s)} tokens/s, bottleneck: {self.bottleneck}")
        if self.lora_rank is not None:
            hosted = any(self.bytes[t].get("base") for t in ("host", "cxl", "nvme"))
            read = (", ".join(f"{t} {format_size(b)}" for t, b in self.base_read.items() if b)
                    or ("none (the device's cache holds it from step to step)" if hosted else "none (on the gpu)"))
            how = ("" if not any(self.base_read.values()) else
                   f" ({self.base_fetches_per_chunk:.2f} fetches per "
                   f"streamed base chunk and micro-batch: forward, then backward, where a recomputed layer's "
                   f"recompute and backward share one fetch when the cache holds the layer till then"
                   + ("; what it holds of the next step's start at the step's end stays"
                      if self.ranks is None and optimizer_spec(self.optimizer).needs_grad else "") + ")")
            lines.append(f"base traffic per step: read {read}{how}, "
                         f"written {format_size(self.base_written)}; "
                         + ("decoded once on the gpu after the warm-up and kept so (the budget holds it "
                            "decoded): no decoding per step" if self.base_decoded else
                            f"decoding {self.dequant_s:.3f} s"))
        if self.ranks is not None:
            lines += self.ranks.lines(format_size)
        if self.suggestion:
            lines.append(self.suggestion)
        lines.append("reserve (bytes besides the chunks): " + "; ".join(
            f"{tier} " + ", ".join(f"{k} {format_size(v)}" for k, v in parts.items() if v)
            for tier, parts in self.reserve.items() if any(parts.values())))
        if self.workspace_margin:
            lines.append(f"gpu workspace margin {format_size(self.workspace_margin)}: left free beside the peak "
                         f"for the CUDA allocator (1/{MARGIN_SHARE} of the budget, as the engine leaves it)")
        if self.host_rss:
            procs = self.ranks.nproc_per_node if self.ranks is not None else 1
            sim = self.host_rss > self.peak.get("host", 0) + self.process_bytes * procs
            peft = ", PEFT" if self.process_bytes > PROCESS_BYTES else ""
            lines.append(f"host RSS to expect: {format_size(self.host_rss)} (host peak + about "
                         f"{format_size(self.process_bytes)} a process for Python, torch{peft} and the data"
                         f"{' + the simulated device, which is host RAM' if sim else ''})")
        lines.append(f"times modelled from hardware profile '{self.hardware}', not measured "
                     "(--verify runs real steps here; `finetune profile` measures this machine)")
        tight = max((self.peak[t] / b, t) for t, b in self.budgets.items() if b and self.peak.get(t))
        lines.append(f"verdict: fits: every tier's peak is within its budget (fullest: {tight[1]} "
                     f"at {100 * tight[0]:.0f}%)")
        return "\n".join(lines)


def _rate(x: float) -> str:
    """Tokens per second with sensible precision: 14,933 / 41.6 / 1.45 / 0.30."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def _count(n: int) -> str:
    """A parameter count for people: 1.52B, 101.9M, 234.0K."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.{2 if unit == 'B' else 1}f}{unit}"
    return str(n)


class _Chunks:
    """The engine's chunking of `model` and the bytes of every kind of every chunk.

    Optimizer state bytes come from the optimizer table (`offload.update.table.state_bytes`),
    which counts 8-bit blocks, 64-byte slot alignment and low-rank projectors exactly as the
    engine's updater allocates them (tests/test_optimizer_table.py)."""

    def __init__(self, *, model: ModelProfile, optimizer: str, precision: str, chunk_bytes: int,
                 rank: int | None, optimizer_kwargs: dict[str, Any] | None = None,
                 params: "Sequence[ParamSpec] | None" = None, lora: "LoraModel | None" = None,
                 base_dtype: str | None = None, double_quant: bool = False, cuda: bool = False) -> None:
        #: the engine's device is CUDA (make_plan's `cuda`): a staging buffer, the allocator's
        #: margin, gradients in flight on the copy stream; else the simulated device
        self.cuda = cuda
        self.cost = optimizer_spec(optimizer)
        self.ce = compute_bytes(precision)
        self.bf16 = precision == "bf16"
        specs = list(lora.specs) if lora is not None else list(params) if params is not None else model.param_specs()
        frozen = lora.frozen if lora is not None else frozenset()
        if frozen and not self.cost.needs_grad:
            raise TierwiseError(f"{optimizer} perturbs every parameter of a module; a frozen base (LoRA) "
                                f"is not supported with it")
        if not self.cost.needs_grad and any(is_expert(s.name) for s in specs):  # (as the engine: model_info.is_moe)
            raise UnsupportedModel(MOE_ZEROTH)
        self.num_params = sum(s.numel for s in specs)
        self.trainable_params = sum(s.numel for s in specs if s.name not in frozen)
        by_name = {s.name: s for s in specs}
        self.plan: ChunkPlan = pack_chunks(specs, chunk_bytes=chunk_bytes, element_size=4, frozen=frozen)
        self.n = len(self.plan.chunks)
        self.frozen = self.plan.frozen
        rank, momentum = _state_options(optimizer, rank=rank, optimizer_kwargs=optimizer_kwargs)
        blobs = state_bytes(self.plan.trainable(), self.cost.name, rank=rank, momentum=momentum)
        proj = projected_params({s.name: tuple(s.shape) for s in specs if s.name not in frozen}) \
            if self.cost.low_rank else set()
        self.needs_grad = self.cost.needs_grad
        self.kinds: list[dict[str, int]] = []  # per chunk, as the engine's store.kind_bytes / frozen_kind_bytes
        self.params: list[int] = []
        self.fp32_params: list[int] = []  # of those, updated at the fp32 rate (fp32_embeddings)
        self.flops: list[float] = []
        self.encoded: set[int] = set()  # frozen chunks stored in another dtype (decoded per use, home or not)
        self.layers, self.tied = (model.num_hidden_layers, model.tie_word_embeddings) if lora is not None else (0, False)
        self.qk_norm, self.fused, self.post_norms, self.gemma = (
            (model.qk_norm, model.fused, model.post_norms, model.gemma) if model is not None else (False,) * 4)
        self.num_layers = model.num_hidden_layers if model is not None else 0  # (the decoder blocks)
        self.top = model.prefix if model is not None else "model."  # (the text model's names)
        idle = model.idle if model is not None else ()
        #: chunks a step never uses (all their parameters a vision tower's, which text never runs)
        self.idle = frozenset(c.index for c in self.plan.chunks if idle and all(n.startswith(idle) for n in c.params))
        self.grad_staging = 0  # host bytes gradients land in first on CUDA (make_plan)
        self.targets = lora.targets if lora is not None else frozenset()
        plain = "bf16" if self.bf16 else "fp32"
        self.fetches_last: dict[int, float] = {}
        adapters = sum(1 for sp in specs if ".lora_A." in sp.name)
        decoded = len(lora.quantizable) if lora is not None and base_dtype not in (None, plain) else 0
        # (None: the engine's own needs, no step to price)
        self.ops = ops_per_forward(model, adapters=adapters, decoded=decoded) if model is not None else 0
        # with the base decoded for good (placement.DevicePlan.decoded_home), no decode op per use
        self.ops_decoded = ops_per_forward(model, adapters=adapters) if model is not None else 0
        for c in self.plan.chunks:
            ps = [by_name[n] for n in c.params]
            if c.index in self.frozen:  # one kind: the (maybe encoded) compute copy; never updated
                assert lora is not None  # (only a LoRA run has frozen chunks)
                nbytes = frozen_chunk_bytes(self.plan, c.index, base_dtype=base_dtype, plain=plain,
                                            element_size=self.ce, quantizable=lora.quantizable,
                                            double_quant=double_quant)
                if _is_encoded(self.plan, c.index, base_dtype, plain, lora):
                    self.encoded.add(c.index)
                self.kinds.append({"compute": nbytes})
                self.params.append(0)
                self.fp32_params.append(0)
                self.flops.append(0.0)
                continue
            k = {"grad": 4 * c.numel if self.needs_grad else 0, "state": blobs[c.index],
                 "master": 4 * c.numel}
            if self.bf16:
                k["compute"] = self.ce * c.numel
            self.kinds.append({kind: b for kind, b in k.items() if b})
            self.params.append(sum(p.numel for p in ps))
            self.fp32_params.append(sum(p.numel for p in ps if self.cost.fp32_embeddings and p.embedding))
            self.flops.append(sum(param_update_flops(p, cost=self.cost, rank=rank, projected=p.name in proj)
                                  for p in ps))
        self.compute = [self.ce * c.numel for c in self.plan.chunks]
        modules: dict[str, set[int]] = defaultdict(set)  # each module -> its chunks
        owned: dict[str, int] = defaultdict(int)
        for name, slot in self.plan.slots.items():
            modules[module_of(name)].add(slot.chunk)
            owned[module_of(name)] += slot.numel
        self.plain_modules = modules  # (`modules` becomes the blocks' where they are the units)
        self.block_units = False  # the blocks are the units of residency (choose_blocks)
        self.gpu_minimum: int | None = None  # the smallest gpu budget, with either units (make_plan)
        self.block_sets: dict[str, set[int]] | None = None
        if self.needs_grad:  # (MeZO perturbs each module in its own forward: its units are the modules)
            blocks = block_of(list(self.plan.slots))
            if any(b != module_of(n) for n, b in blocks.items()):
                self.block_sets = defaultdict(set)
                for name, slot in self.plan.slots.items():
                    self.block_sets[blocks[name]].add(slot.chunk)
        self.largest_param = max((s.numel for s in self.plan.slots.values() if s.chunk not in self.frozen),
                                 default=0)  # frozen parameters send no gradient
        gathers = gathering([c.params for c in self.plan.chunks])
        #: the chunks whose gradients gather on the device in one buffer (the others send each alone)
        self.gathers = {c.index for c, g in zip(self.plan.chunks, gathers) if g and c.index not in self.frozen}
        self.gathered = [c.numel for c in self.plan.chunks if c.index in self.gathers]
        self.modules, self.owned = modules, owned
        self.widest = self._widest()
        self.zo_workspace = zo_workspace(owned.values(), self.ce)
        widest = max(owned, key=owned.__getitem__, default="")
        tied_head = widest == self.top + "embed_tokens" and "lm_head.weight" not in self.plan.slots
        self.zo_module = "lm_head" if tied_head else widest  # a tied head runs last, on the embedding's chunk
        self.zo_chunks = sorted(modules.get(widest, ()))

    def fetches(self, device: DevicePlan, streamed: list[int], *, recompute: int,
                micro_batches: int = 1, keeps: bool = False) -> dict[int, float]:
        """Times each chunk of `streamed` (those through the cache: `cached`) is fetched, or for a
        gpu-home encoded one decoded, in one micro-batch of a LoRA step: the schedule
        (`plan.schedule.plan_schedule`, Belady + in-order prefetch, as the engine runs it) over
        the trace the engine records (`lora.step_trace`), within the cache limit. A recomputed
        block's chunks are fetched once for its recompute and backward when the cache holds
        them until then; the smallest cache fetches some twice. `micro_batches`: the step's, whose
        traces the engine schedules as one (each count is their mean). `keeps`: in the steady
        state a frozen chunk the step begins and ends holding stays over the step's end
        (`kept_over_end`; offload.engine.residency): fetched once less per step (not with several
        ranks)."""
        keep = set(streamed)
        events = [(k, c) for k, c in step_trace({m: set(c) for m, c in self.plain_modules.items()},
                                                 layers=self.layers, targets=self.targets, tied=self.tied,
                                                 recompute=recompute, blocks=self.block_units,
                                                 qk_norm=self.qk_norm, fused=self.fused, post_norms=self.post_norms,
                                                 reads_norms=not self.gemma, prefix=self.top) if c in keep]
        if not events:
            return {}
        sizes = {c: self.compute[c] for c in keep}
        counts: dict[int, float] = dict.fromkeys(streamed, 0)
        # the engine records one trace for the step, its micro-batches one after another
        events *= micro_batches
        actions = plan_schedule(events, sizes=sizes, capacity=max(device.cache_limit, 1))
        for a in actions:
            for c in a.fetch + a.prefetch:
                counts[c] += 1 / micro_batches
        if keeps and self.needs_grad:
            for c in kept_over_end(events, actions):
                if c in self.frozen:
                    counts[c] -= 1 / micro_batches
        self.fetches_last = counts
        return counts

    def checkpoint_bytes(self) -> int:
        """Every trainable chunk's master and optimizer state: what a checkpoint's tensors hold."""
        return sum(k.get("master", 0) + k.get("state", 0) for k in self.kinds)

    def home_order(self) -> list[int]:
        """The engine's `_home_order`: trainable chunks, then frozen ones, last first."""
        trainable = [c for c in reversed(range(self.n)) if c not in self.frozen]
        return trainable + [c for c in reversed(range(self.n)) if c in self.frozen]

    def cached(self, device: DevicePlan) -> list[int]:
        """Chunks whose uses go through the engine's cache: the streamed ones, and the encoded
        ones that are gpu-home (decoded into a cache buffer per use, nothing on the link) but not
        decoded for good (`decoded_home`)."""
        return [c for c in range(self.n)
                if c not in device.gpu_home or (c in self.encoded and c not in device.decoded_home)]

    def staging(self) -> int:
        """CUDA's device buffer the encoded chunks land in to be decoded (Engine._place); none on
        the simulated device, which decodes in place."""
        return max((self.kinds[c]["compute"] for c in self.encoded), default=0) if self.cuda else 0

    def choose_blocks(self, *, buffers: int, activations: int, gpu_budget: int | None, margin: int) -> bool:
        """The engine's choice of units (offload.plan.needs.units_are_blocks) for these activations
        and budget: when the blocks are, they become `modules` (the needs and the trace follow)."""
        if self.block_sets is None or self.block_units:
            return self.block_units
        needs = self.block_needs(buffers=buffers, activations=activations + margin)
        if needs is None or not units_are_blocks(needs, gpu_budget):
            return False
        self.modules, self.block_units = self.block_sets, True
        self.widest = self._widest()
        return True

    def block_needs(self, *, buffers: int, activations: int) -> "DeviceNeeds | None":
        """The needs with the blocks as the units (None: no blocks, or MeZO)."""
        if self.block_sets is None:
            return None
        return self.device_needs(buffers=buffers, activations=activations, units=self.block_sets)

    def _widest(self) -> int:
        """The compute bytes of the widest unit's chunks."""
        return max((sum(self.compute[c] for c in cids) for cids in self.modules.values()), default=0)

    def device_needs(self, *, buffers: int, activations: int, units: "dict[str, set[int]] | None" = None
                     ) -> DeviceNeeds:
        """`needs.device_needs` for this model, as the engine's `_device_needs` calls it (`units`:
        these units of residency instead of `modules`)."""
        units = self.modules if units is None else units
        return device_needs(compute=self.compute, home=[sum(k.values()) for k in self.kinds],
                            module_chunks=units.values(), module_numels=self.owned.values(),
                            largest_param=self.largest_param, gathered=self.gathered, element_size=self.ce,
                            needs_grad=self.needs_grad, buffers=buffers, activations=activations)


def _minimum(ch: _Chunks, needs: DeviceNeeds, margin: int) -> int:
    """The smallest gpu budget of this run (with the modules as the units, or the blocks where
    their tiled MLPs make it smaller: make_plan)."""
    if ch.gpu_minimum is not None:
        return ch.gpu_minimum
    return minimum_with_margin(needs.minimum) if margin else needs.minimum


def _is_encoded(plan: ChunkPlan, cid: int, base_dtype: str | None, plain: str, lora: LoraModel) -> bool:
    """Whether some parameter of frozen chunk `cid` is stored in another dtype than `plain`."""
    return any(base_dtype_of(n, base_dtype=base_dtype, plain=plain, quantizable=lora.quantizable) != plain
               for n in plan.chunks[cid].params)


#: Engine optimizer options that do not change any byte the planner counts.
_NO_BYTES = ("update_proj_gap", "scale", "seed", "eps")


def _state_options(optimizer: str, *, rank: int | None, optimizer_kwargs: dict[str, Any] | None) -> tuple[int | None, float]:
    """(rank, momentum) out of the Engine's `optimizer_kwargs`; any other option the planner
    does not know is refused (it might change the state bytes)."""
    kwargs = dict(optimizer_kwargs or {})
    if rank is not None and optimizer in LOW_RANK:
        kwargs.setdefault("rank", rank)
    rank, momentum = kwargs.pop("rank", None), kwargs.pop("momentum", 0.0)
    unknown = sorted(k for k in kwargs if k not in _NO_BYTES)
    if unknown:
        raise TierwiseError(f"optimizer {optimizer!r}: the planner does not know the option(s) {', '.join(unknown)}")
    return rank, momentum


def _resolve_model(model: Any) -> ModelProfile:
    if isinstance(model, (str, Path)):
        return load_model_profile(model)
    if isinstance(model, ModelProfile):
        return model
    return ModelProfile.from_hf_config(model)


#: the profile a plan without --hardware prices on
DEFAULT_HARDWARE = "cpu-sim"


def recompute_text(recomputed: int, layers: int) -> str:
    """How a plan says which decoder blocks backward recomputes."""
    if not recomputed:
        return "off"
    return "on" if recomputed >= layers else f"the first {recomputed} of {layers} layers"


def choose_recompute(plan_at: Callable[[int | None], "Plan | None"], *, keep_when_fits: bool) -> int | None:
    """The decoder layers to recompute, as `finetune` chooses them: none where that plans and
    `keep_when_fits` (a full fine-tune: less compute); else the fastest of none (where it plans),
    the fewest first layers that plan (the more recomputed, the fewer activations kept) and all
    (a tie: the more recomputed); all where nothing plans. `plan_at(n)`: the plan recomputing the
    first n layers (None: all; the caller caches), None where none fits. Returns n, or None: all."""
    none = plan_at(0)
    if none is not None and keep_when_fits:
        return 0
    every = plan_at(None)
    if every is None:
        return None if none is None else 0
    fewest = 0
    if none is None:
        lo, hi = 0, every.layers
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if plan_at(mid) is not None else (mid, hi)
        fewest = hi
    best: tuple[int | None, float] = (None, every.tokens_per_s)
    share = plan_at(fewest) if fewest < every.layers else None
    if share is not None and share.tokens_per_s > best[1]:
        best = (fewest, share.tokens_per_s)
    return best[0]


def make_plan(*, model: ModelProfile | str | Any, hardware: HardwareProfile | str | None, gpu_mem: int | str | None,
              cpu_mem: int | str | None, cxl_mem: int | str | None = None, nvme_path: str | None = None,
              nvme_mem: int | str | None = None, optimizer: str, precision: str, batch_size: int, seq_len: int,
              chunk_bytes: int | str = DEFAULT_CHUNK_BYTES, rank: int | None = None,
              optimizer_kwargs: dict[str, Any] | None = None, grad_accum: int = 1, up_front: bool = True,
              checkpointing: bool | int | None = None, padded: bool = False, row_positions: bool = False,
              windows: bool = False, offload_activations: bool = False,
              params: "Sequence[ParamSpec] | None" = None, device_mem: int | None = None,
              lora_rank: int | None = None, lora_targets: str = "all-linear", base_dtype: str | None = None,
              double_quant: bool = False, lora_dropout: float = 0.0, linears: "dict[str, str] | None" = None,
              suggest: bool = True, nproc_per_node: int = 1, nnodes: int = 1, grad_reduce: str = "micro",
              cuda: bool | None = None) -> Plan:
    """Plan a run; budgets are bytes or size strings (None: the profile's size, else unlimited;
    the gpu's at most `device_mem`, what the device of this machine has).

    `model`: a profile, a profile name/path, or a transformers model/config (its shapes are read).
    `hardware`: a profile or name/path; None means DEFAULT_HARDWARE ("cpu-sim"). `batch_size` is the micro-batch
    (the engine splits a batch into `grad_accum` of them; activations follow the micro-batch).
    `optimizer_kwargs` as the Engine takes them (e.g. {"rank": 8} for GaLore/APOLLO; `rank`
    is a shorthand for it): they decide the optimizer state bytes.
    `up_front`: the engine is given the planned activations (`Activations(expected=...)`, as
    `finetune` does) and places every chunk before the first step; False: it measures them in
    its warm-up step, with every chunk host-side until then (homes chosen for all chunks, the
    gpu-home ones leaving theirs when promoted) -- the host-side bytes can differ.
    `checkpointing` as the Engine takes it (None: recompute blocks when there are several).
    `params`: the parameters the engine will chunk, in its order (`chunks.specs_of(
    model.named_parameters())` of the module the run trains: a tied head counted once, as
    that module ties it); default: the profile's `param_specs()`.
    `padded`: some batch of the run takes a dense S x S attention mask: the activations are
    then those of such a batch, the run's worst step (perfmodel.activation_parts).
    `row_positions`: the batches carry position ids per row (packed rows kept apart: cli.data).
    `windows`: the model's attention is offload.engine.segments' (finetune's, for the families whose
    packed rows it keeps apart): a sliding window shorter than a long row attends it in blocks.
    `offload_activations`: recomputed blocks' inputs wait in host memory between forward and
    backward (`Activations(offload=True)`): the device holds two, the host the rest, beside the
    chunks' homes (reserve "activations"; perfmodel.activation_parts).
    `lora_rank`: a LoRA run (`Engine(lora=LoraConfig(r=lora_rank, target_modules=lora_targets))`):
    adapters on `lora_targets` ("all-linear" or e.g. "q_proj,v_proj") are the trainable
    parameters, everything else a frozen base (one read-only kind per chunk, streamed, never
    written back), stored as `base_dtype` (None: the compute dtype; bf16/fp16: every frozen
    parameter; int8/nf4: the linear weights but the head; `double_quant`: NF4's absmax in 8 bits),
    exactly as the engine lays it out. A base dtype without `lora_rank` is refused. `lora_dropout`:
    PEFT's dropout on the adapters' input, priced in the activations (perfmodel.activation_parts).
    `linears`: the modules of `params` LoRA can adapt, {name: kind} (`lora.lora_specs`; None: a
    Llama-family profile's).
    `suggest`: for a LoRA run, also find the micro-batch x grad-accum that makes it compute-bound
    (`Plan.suggestion`; see `suggest_micro_batch`).
    `nproc_per_node` / `nnodes`: several ranks (offload.plan.ranks): the host, CXL and NVMe budgets
    are the node's, the gpu budget each rank's, `grad_accum` the micro-batches of each rank
    (`_plan_ranks`); `grad_reduce` ("micro" | "step"): the Engine's, how several ranks hold and
    reduce gradients (offload.plan.ranks).
    `cuda`: the engine's device is CUDA, whose allocator it leaves `workspace_margin` beside the
    ledger (None: a profile's that is not the simulated device; True for a run on this machine's
    GPU priced on "cpu-sim", as `finetune` and --verify price it without --hardware).
    Raises InfeasibleBudget naming the minimum gpu / host / nvme bytes when they cannot fit."""
    args = dict(locals())
    model = _resolve_model(model)
    hw = hardware if isinstance(hardware, HardwareProfile) else load_hardware_profile(hardware or DEFAULT_HARDWARE)
    if batch_size <= 0 or seq_len <= 0 or grad_accum <= 0:
        raise TierwiseError(f"batch size, sequence length and grad_accum must be positive, got "
                            f"{batch_size} x {seq_len} (x {grad_accum})")
    gpu = parse_size(gpu_mem, what="--gpu-mem")
    gpu = min(hw.gpu.memory, device_mem or hw.gpu.memory) if gpu is None else gpu
    host = parse_size(cpu_mem, what="--cpu-mem")
    host = hw.host.memory if host is None else host
    cxl = parse_size(cxl_mem, what="--cxl-mem")
    cxl = (hw.cxl.memory if hw.cxl else 0) if cxl is None else cxl
    if cxl and hw.cxl is None:
        raise TierwiseError(f"a CXL budget was given but hardware profile '{hw.name}' has no [cxl] table")
    if nvme_path is not None and hw.nvme is None:
        raise TierwiseError(f"--nvme-path was given but hardware profile '{hw.name}' has no [nvme] table")
    nvme_cap = parse_size(nvme_mem, what="--nvme-mem")
    nvme_cap = (hw.nvme.capacity if hw.nvme else None) if nvme_cap is None else nvme_cap
    use_nvme = nvme_path is not None
    chunk_size = parse_size(chunk_bytes, what="chunk size")
    if chunk_size is None:
        raise TierwiseError("give a chunk size (e.g. 64M)")

    if not 0 <= lora_dropout < 1:
        raise TierwiseError(f"--lora-dropout must be in [0, 1), got {lora_dropout}")
    if base_dtype is not None and lora_rank is None:
        raise TierwiseError(f"--base-dtype {base_dtype} stores a frozen base: give --lora-rank (or --qlora)")
    lora = None
    if lora_rank is not None:
        family = getattr(model, "family", None) or getattr(getattr(model, "config", model), "model_type", None)
        lora = lora_specs(list(params) if params is not None else model.param_specs(), rank=lora_rank,
                          targets=lora_targets, linears=linears, family=family)
        idle = getattr(model, "idle", ())
        if idle and all(s.name.startswith(idle) for s in lora.specs if ".lora_" in s.name):
            raise TierwiseError(f"--lora-targets {lora_targets}: every adapter is in the vision tower, which training "
                                f"on text never runs: none would train (name the text model's linears, e.g. q_proj)")
    ch = _Chunks(model=model, optimizer=optimizer, precision=precision, chunk_bytes=chunk_size, rank=rank,
                 optimizer_kwargs=optimizer_kwargs, params=params, lora=lora, base_dtype=base_dtype,
                 double_quant=double_quant, cuda=not hw.simulated if cuda is None else cuda)
    # resolved, as the engine does: blocks recomputed (a count past the model's is refused)
    repeated = model_blocks(model)
    if ch.needs_grad and checkpointing is not None and not isinstance(checkpointing, bool) and checkpointing > repeated:
        raise TierwiseError(f"--recompute-layers {checkpointing}: the model has {repeated} decoder layers "
                            "to recompute" + (" (a single layer is never recomputed)" if repeated == 0 else ""))
    checkpointing = recomputed_blocks(checkpointing, repeated) if ch.needs_grad else 0
    # CUDA: gradients land in registered host memory first, the largest copy's bytes or a slice
    # of it (offload.engine.gradients), as the engine books it; the chunks' homes get the rest
    if ch.cuda and ch.needs_grad and len(ch.frozen) < ch.n:
        ch.grad_staging = grad_staging_bytes(ch.device_needs(buffers=0, activations=0))
    lora_act: LoraAct = None
    if lora is not None:  # dropout's saved mask: CPU dropout keeps its noise in the compute dtype, CUDA a bool
        lora_act = ((lora.targets, lora.rank, 1 if ch.cuda else compute_bytes(precision)) if lora_dropout
                    else (lora.targets, lora.rank))
    def act_at(tiles: bool) -> int:  # (the blocks as the units: the MLPs in tiles; the modules: untiled)
        return activation_bytes(model=model, batch_size=batch_size, seq_len=seq_len, precision=precision,
                                backward=ch.needs_grad, checkpointing=checkpointing, padded=padded, lora=lora_act,
                                row_positions=row_positions, offload=offload_activations, tiles=tiles,
                                windows=windows)

    act, tiled_act = act_at(False), act_at(True)
    offload_parts = activation_parts(model=model, batch_size=batch_size, seq_len=seq_len, precision=precision,
                                     checkpointing=checkpointing, padded=padded, lora=lora_act,
                                     row_positions=row_positions, offload=offload_activations, windows=windows)
    host_act = offload_parts["host_inputs"] if ch.needs_grad else 0
    staging = offload_parts["host_staging"] if ch.needs_grad else 0
    # where the offloaded inputs may live, tried in this order once the chunks' homes are known:
    # (tier, what the homes may use of the host, of CXL): host RAM, else (one rank) CXL memory,
    # else (one rank) the NVMe swap directory, through two host buffers
    single = nproc_per_node * nnodes == 1
    room = None if host is None else host - ch.grad_staging
    places: list[tuple[str, int | None, int]] = [("host", room, cxl)]
    if host is not None and room is not None and host_act:
        places = []
        if host_act <= room:
            places.append(("host", room - host_act, cxl))
        if single and host_act <= cxl:
            places.append(("cxl", room, cxl - host_act))
        if single and use_nvme and staging <= room:
            places.append(("nvme", room - staging, cxl))
        if not places:
            other = [f for f, given in (("--cxl-mem", cxl), ("--nvme-path", use_nvme)) if single and not given]
            need = staging if single and use_nvme else host_act  # (on NVMe: what they pass through)
            beside = f" beside {format_size(ch.grad_staging)} staging gradients" if ch.grad_staging else ""
            raise InfeasibleBudget(f"host budget {format_size(host)} cannot hold the offloaded activations "
                                   f"({format_size(need)}{' on their way to NVMe' if need < host_act else ''}"
                                   f"{beside}); raise --cpu-mem" + (f", or give {' or '.join(other)}" if other else ""),
                                   minimum={"host": need + ch.grad_staging})
    buffers = buffer_bytes(model) + ch.staging()
    # CUDA: the engine leaves the allocator a margin of the budget beside its ledger (placed as
    # activations: offload.engine.workspace); the simulated device has no allocator
    margin = workspace_margin(gpu) if ch.cuda else 0
    needs = ch.device_needs(buffers=buffers, activations=act)
    minimum = minimum_with_margin(needs.minimum) if margin else needs.minimum
    blocks = ch.block_needs(buffers=buffers, activations=tiled_act)
    if blocks is not None:  # the smallest budget that takes the blocks, if smaller
        least = max(minimum_with_margin(blocks.minimum) if margin else blocks.minimum,
                    BLOCK_SHARE * blocks.stream_window)
        if least < minimum:
            needs, act, minimum = blocks, tiled_act, least
    # every chunk gpu-home may take less than streaming them (plan_device's whole case)
    whole = (minimum_with_margin(needs.resident) if margin else needs.resident) if single and not ch.encoded else None
    if whole is not None and whole < minimum:
        minimum = whole
    ch.gpu_minimum = minimum
    if gpu < minimum:
        beside = (f", workspace margin {format_size(minimum - (needs.resident if minimum == whole else needs.minimum))}"
                  if margin else "")
        where = (f"every chunk on the device {format_size(sum(needs.home_bytes))}" if minimum == whole
                 else f"streaming window {format_size(needs.stream_window)}")
        raise InfeasibleBudget(
            f"--gpu-mem {format_size(gpu)} is too small: needs at least {format_size(minimum)} "
            f"({minimum} B: buffers {format_size(needs.buffers)}, {where}, gradient reserve "
            f"{format_size(needs.grad_reserve)}, activations {format_size(act)} at batch {batch_size} x "
            f"{seq_len}{MASKED if padded else ''}{beside})",
            minimum={"gpu": minimum})
    if ch.choose_blocks(buffers=buffers, activations=tiled_act, gpu_budget=gpu, margin=margin):
        act = tiled_act
        needs = ch.device_needs(buffers=buffers, activations=act)
    else:
        needs = ch.device_needs(buffers=buffers, activations=act)
    placed = dataclasses.replace(needs, activations=needs.activations + margin)  # what plan_device leaves
    if nproc_per_node * nnodes > 1:
        multi.check_layout(hw, nproc_per_node=nproc_per_node, nnodes=nnodes, cost=ch.cost)
        node_act = nproc_per_node * host_act  # each rank offloads its own micro-batch's block inputs
        if host is not None and node_act > host:
            raise InfeasibleBudget(f"host budget {format_size(host)} cannot hold the offloaded activations of "
                                   f"{nproc_per_node} ranks ({format_size(node_act)}); raise --cpu-mem",
                                   minimum={"host": node_act})
        try:
            ranked = _plan_ranks(ch, model=model, hw=hw, needs=needs, placed=placed, gpu=gpu,
                                 host=None if host is None else host - node_act, cxl=cxl, use_nvme=use_nvme,
                                 nvme_cap=nvme_cap, nproc=nproc_per_node, nnodes=nnodes, checkpointing=checkpointing,
                                 precision=precision, lora_act=lora_act, single=args, grad_reduce=grad_reduce,
                                 offloaded=host_act,
                                 meta=dict(batch_size=batch_size, seq_len=seq_len, chunk_bytes=chunk_size,
                                           optimizer=optimizer, checkpointing=checkpointing, padded=padded,
                                           layers=model.num_hidden_layers,
                                           row_positions=row_positions, windows=windows,
                                           offload=offload_activations,
                                           grad_accum=grad_accum, lora_rank=lora_rank,
                                           lora_targets=lora_targets if lora_rank is not None else None,
                                           base_dtype=(base_dtype or precision) if lora_rank is not None else None,
                                           trainable_params=ch.trainable_params,
                                           checkpoint_bytes=ch.checkpoint_bytes()))
        except InfeasibleBudget as e:  # (its budget was the node's less the offloaded inputs)
            raise beside_reserved(e, room=None if host is None else host - node_act, reserved=node_act,
                                  what=f"{nproc_per_node} ranks' offloaded activations") from None
        if not node_act:
            return ranked
        reserve = {**ranked.reserve, "host": {**ranked.reserve.get("host", {}), "activations": node_act}}
        peak = {**ranked.peak, "host": ranked.peak.get("host", 0) + node_act}
        return dataclasses.replace(ranked, reserve=reserve, peak=peak, host_rss=ranked.host_rss + node_act,
                                   budgets={**ranked.budgets, "host": host})
    # MeZO too may keep chunks on the device: its perturbed weights are temporaries.
    device = plan_device(placed, gpu, allow_gpu_home=True, prefer=ch.home_order(), decoded=frozenset(ch.encoded),
                         up_front=up_front)
    streamed = [c for c in range(ch.n) if c not in device.gpu_home]
    # The chunks the engine places host-side when it is built: the streamed ones when placed up
    # front, else every chunk (gpu-home chunks leave their homes when promoted after the warm-up).
    hosted = streamed if up_front else list(range(ch.n))
    first: InfeasibleBudget | None = None
    for act_tier, homes_host, homes_cxl in places:
        try:
            homes_built = _engine_homes(ch, hosted, host=homes_host, cxl=homes_cxl, nvme=use_nvme)
            break
        except InfeasibleBudget as e:
            first = first or beside_reserved(e, room=homes_host, reserved=ch.grad_staging, what="staging gradients")
    else:
        assert first is not None
        if not host_act or places[0][0] != "host":
            raise first
        raise InfeasibleBudget(f"{str(first).removesuffix('; raise --cpu-mem')}, beside {format_size(host_act)} of "
                               "offloaded activations; raise --cpu-mem",
                               minimum={"host": first.minimum["host"] + host_act}) from None
    homes = _streamed_homes(ch, homes_built, streamed)
    host_min = _host_minimum(ch, hosted, cxl=homes_cxl, nvme=use_nvme)
    # the engine's preflight, when built: the homes and the offloaded inputs written there
    on_nvme = sum(homes_built.bytes.get("nvme", {}).values()) + (host_act if act_tier == "nvme" else 0)
    if nvme_cap is not None and on_nvme > nvme_cap:
        raise InfeasibleBudget(f"--nvme-path has {format_size(nvme_cap)} of space: needs at least "
                               f"{format_size(on_nvme)}; raise --cpu-mem / --cxl-mem or free disk space",
                               minimum={"nvme": on_nvme})
    flops_fwd = model_flops(model=model, batch_size=batch_size, seq_len=seq_len, windows=windows and not padded)
    ops = ch.ops_decoded if ch.encoded and ch.encoded <= device.decoded_home else ch.ops
    load = _load(ch, device=device, homes=homes, streamed=streamed, flops_fwd=flops_fwd, ops=ops,
                 recompute=checkpointing, offloaded={act_tier: host_act} if host_act else {},
                 micro_batches=grad_accum, keeps=True)
    pred = predict_step(hardware=hw, precision=precision, cost=ch.cost, tokens=batch_size * seq_len * grad_accum,
                        load=load, micro_batches=grad_accum)
    base = _base_traffic(ch, load=load, homes=homes, streamed=streamed, micro_batches=grad_accum, hw=hw)
    plan = _build(ch, model=model, hw=hw, needs=needs, margin=margin, device=device, homes=homes, pred=pred,
                  precision=precision,
                  budgets={"gpu": gpu, "host": host, "cxl": cxl, "nvme": nvme_cap if use_nvme else 0},
                  batch_size=batch_size, seq_len=seq_len, chunk_bytes=chunk_size, optimizer=optimizer,
                  host_minimum=host_min + ch.grad_staging + {"host": host_act, "nvme": staging}.get(act_tier, 0),
                  act_tier=act_tier,
                  checkpointing=checkpointing, padded=padded, layers=model.num_hidden_layers,
                  row_positions=row_positions, windows=windows, offload=offload_activations,
                  grad_accum=grad_accum,
                  lora_rank=lora_rank, lora_targets=lora_targets if lora_rank is not None else None,
                  base_dtype=(base_dtype or precision) if lora_rank is not None else None,
                  trainable_params=ch.trainable_params, checkpoint_bytes=ch.checkpoint_bytes(), lora_act=lora_act,
                  base_decoded=bool(device.decoded_home), **base)
    if suggest and lora_rank is not None:
        plan = dataclasses.replace(plan, suggestion=suggest_micro_batch(plan, **(args | {"model": model,
                                                                                           "hardware": hw})))
    return plan


def better_micro_batch(plan: Plan, **kwargs: Any) -> "Plan | None":
    """The plan of the smallest longer micro-batch (MICRO_BATCHES; grad-accum keeping the rows per
    step where it divides them) that is compute-bound, else of the fastest one that fits; None
    when no longer one fits. `kwargs`: make_plan's for `plan`."""
    rows = plan.batch_size * plan.grad_accum
    best = None
    for b in MICRO_BATCHES:
        if b <= plan.batch_size:
            continue
        accum = max(1, -(-rows // b))
        try:
            p = make_plan(**(kwargs | {"batch_size": b, "grad_accum": accum, "suggest": False}))
        except (InfeasibleBudget, TierwiseError):
            break  # larger micro-batches need more activations still
        if best is None or p.tokens_per_s > best.tokens_per_s:
            best = p
        if _compute_bound(p):
            break
    return best


def _passes(plan: Plan) -> dict[str, str]:
    """The bound of each pass over the model (forward, backward; not the update after them)."""
    return {k: b for k, b in (plan.bounds or {"step": plan.bottleneck}).items() if k != "update"}


def _compute_bound(plan: Plan) -> bool:
    """Whether gpu compute bounds every pass of the step (not only the longest)."""
    return all(b == "gpu compute" for b in _passes(plan).values())


def _bound(plan: Plan) -> str:
    """'compute-bound', or each pass's bound ('forward pcie h2d-bound, backward ...')."""
    if _compute_bound(plan):
        return "compute-bound"
    return ", ".join(f"{phase} {b}-bound" for phase, b in _passes(plan).items())


#: Micro-batches `suggest_micro_batch` tries.
MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)


def suggest_micro_batch(plan: Plan, **kwargs: Any) -> str:
    """A LoRA step streams the whole base for every micro-batch (forward and backward) whatever
    the gradient accumulation, so only a longer micro-batch amortises it: the smallest
    micro-batch (of MICRO_BATCHES, at the same rows per step where it divides them) whose step
    is bound by gpu compute in every phase, as a line for the plan. `kwargs`: make_plan's for `plan`."""
    if _compute_bound(plan):
        return (f"LoRA: compute-bound at micro-batch {plan.batch_size} x grad-accum {plan.grad_accum} "
                f"({_rate(plan.tokens_per_s)} tokens/s)")
    best = better_micro_batch(plan, **kwargs)
    if best is None:
        return (f"LoRA: {_bound(plan)}; no larger micro-batch fits (the base streams once per "
                f"micro-batch: longer ones amortise it)")
    bound = "compute-bound" if _compute_bound(best) else f"still {_bound(best)}"
    return (f"LoRA suggestion: --batch-size {best.batch_size} --grad-accum {best.grad_accum} is {bound}: "
            f"{_rate(best.tokens_per_s)} tokens/s (this plan: {_rate(plan.tokens_per_s)}, {_bound(plan)}; "
            f"the base streams once per micro-batch, so only a longer one amortises it)")


def _construction_bytes(ch: _Chunks, homes: Homes) -> tuple[int, int]:
    """(host, cxl) bytes the engine's ledger takes when built with `homes`: host = the kinds
    there + the NVMe bounce buffers; cxl = the kinds there (the ledger is the one budget)."""
    host = sum(homes.bytes.get("host", {}).values()) + homes.bounce
    cxl = sum(homes.bytes.get("cxl", {}).values())
    return host, cxl


def _engine_homes(ch: _Chunks, hosted: list[int], *, host: int | None, cxl: int, nvme: bool) -> Homes:
    """homes.assign_homes over the chunks `hosted`, as the engine calls it; InfeasibleBudget
    (naming the smallest budget that works) also where the engine would fail later, at its
    bounce buffers."""
    kinds = {c: ch.kinds[c] for c in hosted}
    homes = assign_homes(kinds=kinds, host=host, cxl=cxl or None, nvme=nvme)
    used_host, _ = _construction_bytes(ch, homes)
    if host is not None and used_host > host:
        need = _host_minimum(ch, hosted, cxl=cxl, nvme=nvme)
        raise InfeasibleBudget(
            f"host budget {format_size(host)} cannot hold the streamed chunks and the NVMe bounce buffers "
            f"({format_size(used_host)}); at least {format_size(need)} ({need} B) needed; raise --cpu-mem",
            minimum={"host": need})
    return homes


def _grow(used: Any, start: int, *, cap: int) -> int:
    """The smallest budget b >= start, found by fixpoint iteration, with used(b) <= b (else cap)."""
    b = start
    for _ in range(64):
        try:
            u = used(b)
        except InfeasibleBudget:
            return cap
        if u <= b:
            return b
        b = u
    return cap


def _host_minimum(ch: _Chunks, hosted: list[int], *, cxl: int, nvme: bool) -> int:
    """The smallest host budget the engine accepts: homes.minimum_host over the chunks it places
    host-side, raised where the bounce buffers do not fit in it; never more than all their
    kinds (then nothing goes to NVMe, and no bounce buffers are needed)."""
    kinds = {c: ch.kinds[c] for c in hosted}
    everything = sum(sum(k.values()) for k in kinds.values())
    start = minimum_host(kinds, cxl=cxl or None, nvme=nvme)
    if not nvme:
        return start
    if start >= everything:
        return everything
    return min(everything, _grow(lambda b: _construction_bytes(
        ch, assign_homes(kinds=kinds, host=b, cxl=cxl or None, nvme=nvme))[0], start, cap=everything))


def _streamed_homes(ch: _Chunks, homes: Homes, streamed: list[int]) -> Homes:
    """The homes of the streamed chunks only (what stays host-side in steady state); the bounce
    buffers are the engine's, sized when it is built."""
    tiers = {c: homes.tiers[c] for c in streamed}
    totals: dict[str, dict[str, int]] = {}
    for c, d in tiers.items():
        for kind, tier in d.items():
            totals.setdefault(tier, {}).setdefault(kind, 0)
            totals[tier][kind] += ch.kinds[c][kind]
    return Homes(tiers=tiers, bytes=totals, bounce=homes.bounce)


def _load(ch: _Chunks, *, device: DevicePlan, homes: Homes, streamed: list[int], flops_fwd: float,
          ops: int, recompute: int, remote: frozenset[int] = frozenset(),
          offloaded: "dict[str, int] | None" = None, micro_batches: int = 1, keeps: bool = False) -> StepLoad:
    """What one step moves and computes with this placement (input of the performance model).
    A frozen chunk's one kind is booked "base" in `placed` (never written back, never updated);
    it crosses the link as stored (encoded) and is decoded on the device; a gpu-home encoded one
    is decoded there per use (dequantization, no link, no base read). `remote`: trainable
    chunks another rank owns (several ranks): their compute copies arrive by broadcast, not over
    this rank's link, and this rank does not update them (only their gradients are its).
    `micro_batches`, `keeps`: a LoRA step's fetches are the mean over the step's micro-batches,
    less, with `keeps`, the chunks kept over its end (`_Chunks.fetches`)."""
    source = "compute" if ch.bf16 else "master"
    stream = dict.fromkeys(("host", "cxl", "nvme"), 0)
    placed: dict[str, dict[str, int]] = {t: {} for t in ("host", "cxl", "nvme")}
    for c in streamed:
        for kind, tier in homes.tiers[c].items():
            name = "base" if c in ch.frozen else kind
            placed[tier][name] = placed[tier].get(name, 0) + ch.kinds[c][kind]
        src = "compute" if c in ch.frozen else source
        if c not in remote:
            stream[homes.tiers[c][src]] += ch.kinds[c][src]
    streamed_compute = sum(ch.compute[c] for c in streamed)
    trainable = [c for c in streamed if c not in ch.frozen and c not in remote]
    home = sorted(device.gpu_home)
    # Belady over a forward and a backward pass: the cache keeps what fits across the turn
    used = sum(ch.compute[c] for c in streamed if c not in ch.idle)  # (a vision tower's: never fetched)
    fetched = max(0, 2 * used - max(0, device.cache_limit - ch.widest)) if streamed else 0
    # a gpu-home encoded chunk is decoded into the cache: it competes for it, off the link
    fetches = (ch.fetches(device, ch.cached(device), recompute=recompute, micro_batches=micro_batches,
                          keeps=keeps) if ch.frozen else {})
    if fetches:  # a LoRA step: the engine's own schedule over the step's trace, chunk by chunk
        fetched = round(sum(n * ch.compute[c] for c, n in fetches.items() if c not in device.gpu_home))
    link = round(sum(fetches.get(c, 0) * (ch.kinds[c]["compute"] if c in ch.frozen else ch.compute[c])
                     for c in streamed if c not in remote))
    if remote and not ch.frozen:  # this rank's link carries only its own chunks' fetches
        own = streamed_compute - sum(ch.compute[c] for c in remote)
        link = round(fetched * own / streamed_compute) if streamed_compute else 0
    largest = max(trainable, key=lambda c: ch.params[c], default=None)
    return StepLoad(
        tokens_flops_fwd=flops_fwd, placed=placed, stream_bytes=stream, fetched_bytes=fetched,
        link_bytes=link if ch.frozen or remote else None,
        dequant_bytes=round(sum(fetches.get(c, 0) * (ch.kinds[c]["compute"] + ch.compute[c]) for c in ch.encoded)),
        grad_d2h_bytes=sum(ch.compute[c] for c in streamed if c not in ch.frozen and c not in ch.idle)
        if ch.needs_grad else 0,
        cpu_params=sum(ch.params[c] for c in streamed), cpu_fp32_params=sum(ch.fp32_params[c] for c in streamed),
        cpu_flops=sum(ch.flops[c] for c in streamed),
        cpu_update_bytes=sum(_update_bytes(ch, c) for c in trainable),
        gpu_params=sum(ch.params[c] for c in home), gpu_fp32_params=sum(ch.fp32_params[c] for c in home),
        gpu_update_bytes=sum(_update_bytes(ch, c) for c in home if c not in ch.frozen),
        gpu_update_flops=sum(ch.flops[c] for c in home),
        chunk_compute_bytes=max((ch.compute[c] for c in streamed), default=0),
        chunk_params=ch.params[largest] if largest is not None else 0,
        chunk_fp32_params=ch.fp32_params[largest] if largest is not None else 0,
        num_chunks=ch.n - len(ch.frozen), streamed_chunks=len(streamed), ops_per_forward=ops,
        recompute=recompute / max(1, ch.num_layers),
        offloaded=offloaded or {}, grad_staged=bool(ch.grad_staging),
        weight_grads=not ch.frozen)


def _base_traffic(ch: _Chunks, *, load: StepLoad, homes: Homes, streamed: list[int], micro_batches: int,
                  hw: HardwareProfile) -> dict[str, Any]:
    """The frozen base's traffic per step: bytes read from each tier (every streamed frozen chunk
    is fetched in forward and again for backward -- once for a recomputed block's recompute and
    backward together -- less what the cache keeps across the turn; each micro-batch again; once
    less per step for the chunks kept over the step's end), bytes written (none: frozen chunks
    are never written back) and seconds of decoding."""
    if not ch.frozen:
        return {}
    frozen = [c for c in streamed if c in ch.frozen]
    fetches = ch.fetches_last
    share = sum(fetches.get(c, 0) for c in frozen) / len(frozen) if frozen else 0.0
    read = dict.fromkeys(("host", "cxl", "nvme"), 0)
    for c in frozen:
        read[homes.tiers[c]["compute"]] += round(fetches.get(c, 0) * micro_batches * ch.kinds[c]["compute"])
    bandwidth = (hw.host.dram_bandwidth_gbps if hw.simulated else hw.gpu.memory_bandwidth_gbps) * 1e9
    return {"base_read": read,
            "base_written": 0, "base_fetches_per_chunk": share,
            "dequant_s": load.dequant_bytes * micro_batches / bandwidth}


def _update_bytes(ch: _Chunks, c: int) -> int:
    """Memory traffic of one chunk's update: read+write master and state, read grad, write compute."""
    k = ch.kinds[c]
    return 2 * (k.get("master", 0) + k.get("state", 0)) + k.get("grad", 0) + k.get("compute", 0)


def _resident_at_peak(ch: _Chunks, device: DevicePlan) -> int:
    """Streamed (or decoded) compute copies resident when the gpu peaks (the end of forward, or just after
    it in backward). The schedule keeps the chunks needed soonest: lm_head's chunk (in use),
    then the others in backward (reverse first-use) order, as many as fit in the cache limit;
    a chunk that does not fit is left out (Belady evicts it: e.g. a big embedding, needed
    last). MeZO (no backward) peaks while its widest module runs (its perturbed copies): then
    that module's chunks, the ones after it and the ones before it are resident, in that order
    of preference (the cache is emptied after every step)."""
    streamed = [c for c in ch.cached(device) if c not in ch.idle]  # (the engine never fetches those)
    if ch.needs_grad or ch.zo_module == "lm_head":
        head = ch.plan.slots.get("lm_head.weight") or ch.plan.slots.get(ch.top + "embed_tokens.weight")
        first = [head.chunk] if head is not None and head.chunk in streamed else []
        order = first + [c for c in reversed(streamed) if c not in first]
    else:  # MeZO peaks while its widest module runs: then the chunks after it (prefetched), then
        # those before it, most recently used first
        first = [c for c in ch.zo_chunks if c in streamed]
        last = max(first, default=-1)
        order = first + [c for c in streamed if c > last] + [c for c in reversed(streamed) if c < last
                                                              and c not in first]
    resident = 0
    for c in order:
        if resident + ch.compute[c] <= device.cache_limit:
            resident += ch.compute[c]
    return resident


def _gpu_transient(ch: _Chunks, *, model: ModelProfile, hw: HardwareProfile, needs: DeviceNeeds,
                   device: DevicePlan, batch_size: int, seq_len: int, precision: str,
                   checkpointing: int, padded: bool = False, lora: LoraAct = None,
                   row_positions: bool = False, windows: bool = False, offload: bool = False) -> int:
    """Activations + gradients in flight at the gpu's busiest moment. Candidates: the end of
    forward (all activations); a block's recompute in backward;
    lm_head's gradient on its way to the host while the final norm's activations are still
    saved; the embedding's gradient at the very end. A streamed gradient is gathered with its
    chunk's (offload.engine.gradients: a buffer of the chunk's size) where the chunk gathers
    (`needs.gathering`), else sent alone, booked until its copy to
    the host lands: the simulated device's copy thread lands each at once; on CUDA up to the
    gradient reserve may be in flight at any time."""
    if not ch.needs_grad:  # MeZO: the perturbed copies of the module computing (dual_forward)
        return needs.activations + ch.zo_workspace
    p = activation_parts(model=model, batch_size=batch_size, seq_len=seq_len, precision=precision,
                         checkpointing=checkpointing, padded=padded, lora=lora, row_positions=row_positions,
                         windows=windows, offload=offload, tiles=ch.block_units)
    held = p["fixed"] + p["inputs_end"] + p["layers"]  # the kept layers' activations too, till their backward
    gathered = {name: ch.ce * (ch.plan.chunks[s.chunk].numel if s.chunk in ch.gathers else s.numel)
                for name, s in ch.plan.slots.items()
                if s.chunk not in device.gpu_home and s.chunk not in ch.frozen}  # frozen: no gradient
    inflight = (needs.grad_reserve if ch.cuda else 0) if gathered else 0
    head = gathered.get("lm_head.weight", 0)
    # (a recompute comes after the kept layers' backward: the recomputed layers are the first)
    return max(held + p["head"], p["fixed"] + p["inputs"] + p["block"] + inflight,
               held + p["final_norm"] + p["loss_tail"] + max(head, inflight),
               p["fixed"] + max(gathered.get(ch.top + "embed_tokens.weight", 0), inflight))


def _build(ch: _Chunks, *, model: ModelProfile, hw: HardwareProfile, needs: DeviceNeeds, device: DevicePlan,
           homes: Homes, pred: Any, precision: str, budgets: dict[str, Any], lora_act: LoraAct = None, margin: int = 0,
           act_tier: str = "host", **meta: Any) -> Plan:
    act_args = dict(batch_size=meta["batch_size"], seq_len=meta["seq_len"], precision=precision,
                    checkpointing=meta["checkpointing"], padded=meta["padded"], lora=lora_act,
                    row_positions=meta["row_positions"], windows=meta["windows"], offload=meta["offload"])
    by_tier = {t: dict.fromkeys(KINDS + (("base",) if ch.frozen else ()), 0) for t in TIERS}
    for c in range(ch.n):  # a frozen chunk's one kind (the ledger's "compute") is shown as "base"
        if c in device.decoded_home:  # decoded once, for good: its compute copy is its home
            by_tier["gpu"]["base"] += ch.compute[c]
            continue
        tiers = dict.fromkeys(ch.kinds[c], "gpu") if c in device.gpu_home else homes.tiers[c]
        for kind, b in ch.kinds[c].items():
            by_tier[tiers[kind]]["base" if c in ch.frozen else kind] += b
    cache = _resident_at_peak(ch, device)
    transient = _gpu_transient(ch, model=model, hw=hw, needs=needs, device=device, **act_args)
    in_flight = "grad in flight" if ch.needs_grad else "workspace"
    reserve = {"gpu": {"buffers": needs.buffers, "stream cache": cache, "activations": needs.activations,
                       in_flight: transient - needs.activations},
               "host": {"nvme bounce": homes.bounce} | ({"grad staging": ch.grad_staging} if ch.grad_staging else {})}
    offload_parts = activation_parts(model=model, **act_args)
    offloaded = offload_parts["host_inputs"] if ch.needs_grad else 0
    if offloaded:  # (host RAM, or CXL memory or NVMe where the host could not hold them: make_plan)
        reserve.setdefault(act_tier, {})["activations"] = offloaded
        if act_tier == "nvme":  # the host buffers they pass through
            reserve["host"]["activations"] = offload_parts["host_staging"]
    peak = {t: sum(by_tier[t].values()) + sum(reserve.get(t, {}).values()) for t in TIERS}
    chunk_homes = []
    for j in range(ch.n):
        if j in device.gpu_home:
            tiers = {kind: "gpu" for kind in ch.kinds[j]}
        else:
            tiers = homes.tiers[j]
        chunk_homes.append(ChunkHome(index=j, params=ch.params[j],
                                     update="none" if j in ch.frozen else "gpu" if j in device.gpu_home else "cpu",
                                     compute=tiers.get("compute", tiers.get("master")), grad=tiers.get("grad"),
                                     master=tiers.get("master"), state=tiers.get("state")))
    log.info("plan %s on %s: %d of %d chunks gpu-home, step %.3f s (%s)", model.name, hw.name,
             len(device.gpu_home), ch.n, pred.step_s, pred.bottleneck)
    gpu_params = sum(ch.params[c] for c in device.gpu_home)
    process = process_bytes(lora=bool(ch.frozen))
    return Plan(model=model.name, hardware=hw.name, precision=precision, budgets=budgets,
                num_params=ch.num_params, num_chunks=ch.n, bytes=by_tier, reserve=reserve, peak=peak,
                active_params=(model.active_params + ch.num_params - model.num_params) if model.moe else None,
                gpu_minimum=_minimum(ch, needs, margin),
                workspace_margin=margin, cache_limit=device.cache_limit, chunk_homes=tuple(chunk_homes),
                gpu_update_params=gpu_params, cpu_update_params=ch.trainable_params - gpu_params,
                phases=pred.phases, step_s=pred.step_s, bottleneck=pred.bottleneck,
                tokens_per_s=pred.tokens_per_s, bounds=pred.bounds,
                host_rss=peak.get("host", 0) + process + (0 if ch.cuda else peak.get("gpu", 0)),
                process_bytes=process, **meta)


def _rank_view(ch: _Chunks, remote: frozenset[int], owned_grads: bool) -> _Chunks:
    """`ch` as one rank of several holds it (Engine._kinds): a remote trainable chunk is nothing
    with owned-only gradients (its transient gradient lies in the window), else its gradient
    ({"grad": 4 * numel}); never updated here."""
    view = copy.copy(ch)
    view.kinds = [multi.remote_kinds(ch.plan.chunks[c].numel, owned_grads=owned_grads) if c in remote else k
                  for c, k in enumerate(ch.kinds)]
    view.params = [0 if c in remote else p for c, p in enumerate(ch.params)]
    view.flops = [0.0 if c in remote else f for c, f in enumerate(ch.flops)]
    return view


def _plan_ranks(ch: _Chunks, *, model: ModelProfile, hw: HardwareProfile, needs: DeviceNeeds, placed: DeviceNeeds,
                gpu: int, host: int | None,
                cxl: int, use_nvme: bool, nvme_cap: int | None, nproc: int, nnodes: int, checkpointing: int,
                precision: str, lora_act: LoraAct, single: dict[str, Any], meta: dict[str, Any],
                grad_reduce: str = "micro", offloaded: int = 0) -> Plan:
    """make_plan for `nproc` ranks per node on `nnodes` nodes (offload.plan.ranks). Every rank
    streams every chunk (the engine allows no gpu-home chunk with several ranks). The homes of
    a node: the frozen base once (`assign_homes` within what the ranks' minimums leave of the
    node's host budget), then each of its L ranks `assign_homes` over its own kinds (its owned
    chunks, and its gradient chunks of the others) within 1/L of the rest (cli.launch.node_share),
    each with its own NVMe bounce buffers; node 0 (ranks 0..L-1, the largest shares) is the one
    planned. Each rank is priced on its share of the node (`rank_share`) with its collectives;
    the step lasts as long as the slowest rank. `offloaded`: each rank's offloaded block inputs
    (host RAM), over its link both ways."""
    if grad_reduce not in GRAD_REDUCE:
        raise TierwiseError(f"--grad-reduce must be one of {', '.join(GRAD_REDUCE)}, got {grad_reduce!r}")
    world, L = nproc * nnodes, nproc
    trainable = [c for c in range(ch.n) if c not in ch.frozen]
    owner = multi.owners(trainable, world)
    remotes = [frozenset(c for c in trainable if owner[c] != r) for r in range(L)]
    owned_grads = grad_reduce == "micro" and ch.needs_grad
    window = multi.window_bytes(ch.plan, trainable) if owned_grads else 0
    keep = window + ch.grad_staging  # each rank keeps it free (and its gradient staging: make_plan)
    views = [_rank_view(ch, rem, owned_grads) for rem in remotes]
    device = plan_device(placed, gpu, allow_gpu_home=False)
    margin = placed.activations - needs.activations
    streamed = list(range(ch.n))
    # the frozen base once per node, first (every rank reads it every micro-batch): in the host
    # RAM the ranks' minimums leave, then CXL, then NVMe; each rank then gets 1/L of the rest
    # (cli.launch.node_share) for its own kinds: its owned chunks and its gradients of the others
    own = [{c: views[r].kinds[c] for c in trainable} for r in range(L)]
    mins = [_host_minimum(views[r], trainable, cxl=0, nvme=use_nvme) for r in range(L)]
    # One node: its ranks' shares follow their minimums (the owner of an embedding needs more
    # than the others: cli.train takes `RankPlan.host_shares`); several nodes: even shares of
    # each node's budget, so the fullest rank decides (ownership differs from node to node).
    uneven = nnodes == 1
    if not uneven:
        mins = [max(mins)] * L
    base_kinds = {c: ch.kinds[c] for c in ch.frozen}
    room = None if host is None else host - sum(mins) - L * keep
    try:
        if room is not None and room < 0:
            raise InfeasibleBudget("", minimum={"host": 0})
        base_homes = assign_homes(kinds=base_kinds, host=room, cxl=cxl or None, nvme=use_nvme) if base_kinds \
            else Homes(tiers={}, bytes={}, bounce=0)
    except InfeasibleBudget as exc:  # the base's own minimum (0 when the ranks' alone exceed the budget)
        others = "a window for the others' gradients" if owned_grads else "fp32 gradients of all the others"
        need = sum(mins) + L * keep + exc.minimum.get("host", 0)
        raise InfeasibleBudget(f"node host budget {format_size(host or 0)} cannot hold "
                               f"{'the frozen base once and ' if base_kinds else ''}{L} ranks' own chunks (each its "
                               f"owned chunks and {others}): at least {format_size(need)} ({need} B) needed; raise --cpu-mem"
                               f"{'' if use_nvme else ' or give --nvme-path'}{_uneven(owner, world)}",
                               minimum={"host": need}) from None
    base = {t: sum(base_homes.bytes.get(t, {}).values()) for t in ("host", "cxl", "nvme")}
    base_bounce = L * base_homes.bounce  # each rank stages its own NVMe reads of the base
    base_part = -(-base["host"] // L)  # what each rank's ledger books of the base (SharedBase.part)
    spare = None if host is None else (host - L * (base_part + base_homes.bounce + keep) - sum(mins)) // L
    per_host = [None if spare is None else max(mins[r] + spare, 0) for r in range(L)]
    per_cxl = (cxl - base["cxl"]) // L if cxl else 0
    rank_homes = []
    for r in range(L):
        try:
            rank_homes.append(assign_homes(kinds=own[r], host=per_host[r], cxl=per_cxl or None, nvme=use_nvme))
        except InfeasibleBudget as exc:
            need = L * (base_part + base_homes.bounce + keep) + sum(mins) - mins[r] + exc.minimum.get("host", 0)
            raise InfeasibleBudget(f"node host budget {format_size(host or 0)}: after the frozen base "
                                   f"({format_size(base['host'])} in host RAM) rank {r} of {L} gets "
                                   f"{format_size(per_host[r] or 0)}, too little for its own chunks: at least "
                                   f"{format_size(need)} ({need} B) needed; raise --cpu-mem{_uneven(owner, world)}",
                                   minimum={"host": need}) from None
    node_bytes = {t: base[t] + sum(sum(h.bytes.get(t, {}).values()) for h in rank_homes) for t in ("host", "cxl", "nvme")}
    bounces = base_bounce + sum(h.bounce for h in rank_homes)
    node_bytes["host"] += bounces + L * keep
    if nvme_cap is not None and node_bytes["nvme"] > nvme_cap:
        raise InfeasibleBudget(f"--nvme-path has {format_size(nvme_cap)} of space: the node needs at least "
                               f"{format_size(node_bytes['nvme'])}; raise --cpu-mem / --cxl-mem or free disk space",
                               minimum={"nvme": node_bytes["nvme"]})
    gbps, link_words = multi.link(hw, nnodes)
    node = hw.node
    assert node is not None  # (multi.link refuses a profile without one)
    share = multi.rank_share(hw, L)
    flops_fwd = model_flops(model=model, batch_size=meta["batch_size"], seq_len=meta["seq_len"],
                            windows=meta["windows"] and not meta["padded"])
    accum, tokens = meta["grad_accum"], meta["batch_size"] * meta["seq_len"] * meta["grad_accum"] * world
    preds, loads, homes_of, step_loads = [], [], [], []
    for r in range(L):
        tiers = base_homes.tiers | rank_homes[r].tiers
        homes_r = Homes(tiers=tiers, bytes={}, bounce=rank_homes[r].bounce + base_homes.bounce)
        load = _load(views[r], device=device, homes=homes_r, streamed=streamed, flops_fwd=flops_fwd,
                     ops=ch.ops, recompute=checkpointing, remote=remotes[r],
                     offloaded={"host": offloaded} if offloaded else {}, micro_batches=accum)
        if ch.frozen:  # the adapters: as the LoRA schedule fetches them, every micro-batch
            gather = round(accum * sum(views[r].fetches_last.get(c, 0) * ch.compute[c] for c in trainable))
        else:
            gather = multi.gather_bytes(trainable_compute=sum(ch.compute[c] for c in trainable),
                                        streamed_compute=sum(ch.compute[c] for c in streamed),
                                        cache_limit=device.cache_limit, widest=ch.widest, micro_batches=accum)
        reduce = sum(4 * ch.plan.chunks[c].numel for c in trainable) if ch.needs_grad else 0
        reduce *= accum if owned_grads else 1  # owned-only gradients: a reduce per micro-batch
        coll = Collectives(gather_bytes=gather / accum, reduce_bytes=reduce, gbps=gbps, via=node.gpu_link)
        preds.append(predict_step(hardware=share, precision=precision, cost=ch.cost, tokens=tokens, load=load,
                                  micro_batches=accum, collectives=coll))
        loads.append((gather, reduce))
        step_loads.append(load)
        homes_of.append(homes_r)
    slowest = max(range(L), key=lambda r: preds[r].step_s)
    gather, reduce = loads[0]
    homes0 = _streamed_homes(views[0], homes_of[0], streamed)
    plan = _build(views[0], model=model, hw=hw, needs=needs, margin=margin, device=device, homes=homes0,
                  pred=preds[slowest],
                  precision=precision, budgets={"gpu": gpu, "host": host, "cxl": cxl, "nvme": nvme_cap if use_nvme else 0},
                  host_minimum=sum(mins) + L * keep + (minimum_host(base_kinds, cxl=cxl or None, nvme=use_nvme)
                                                         if base_kinds else 0), lora_act=lora_act,
                  **_base_traffic(views[0], load=step_loads[0], homes=homes0, streamed=streamed,
                                  micro_batches=accum, hw=hw), **meta)
    gpu_peaks = []
    for r in range(L):
        p_r = plan if r == 0 else _build(views[r], model=model, hw=hw, needs=needs, margin=margin, device=device,
                                         homes=_streamed_homes(views[r], homes_of[r], streamed), pred=preds[r],
                                         precision=precision, budgets=plan.budgets, host_minimum=0,
                                         lora_act=lora_act, **meta)
        gpu_peaks.append(p_r.peak["gpu"])
    by_tier = {t: dict(plan.bytes[t]) for t in TIERS}
    for t in ("host", "cxl", "nvme"):  # the node's rows: its ranks' own kinds and the base once
        by_tier[t] = {k: 0 for k in by_tier[t]}
    for c, d in base_homes.tiers.items():
        by_tier[d["compute"]]["base"] = by_tier[d["compute"]].get("base", 0) + ch.kinds[c]["compute"]
    for r, h in enumerate(rank_homes):  # the ranks' own kinds
        for c, d in h.tiers.items():
            for kind, tier in d.items():
                by_tier[tier][kind] = by_tier[tier].get(kind, 0) + own[r][c][kind]
    reserve = dict(plan.reserve) | {"host": {"nvme bounce": bounces} | ({"grad window": L * window} if window else {})
                                    | ({"grad staging": L * ch.grad_staging} if ch.grad_staging else {})}
    peak = dict(plan.peak) | {t: node_bytes[t] for t in ("host", "cxl", "nvme")}
    private = [sum(h.bytes.get("host", {}).values()) + h.bounce + base_homes.bounce + keep for h in rank_homes]
    all_grads = sum(4 * ch.plan.chunks[c].numel for c in trainable) if ch.needs_grad else 0
    grad_bytes = [(sum(4 * ch.plan.chunks[c].numel for c in trainable if owner[c] == r) + window) if owned_grads
                  else all_grads for r in range(L)]
    owned = [sum(ch.params[c] for c in trainable if owner[c] == r) for r in range(L)]
    single_tps = None
    try:
        single_tps = make_plan(**(single | {"nproc_per_node": 1, "nnodes": 1, "suggest": False, "model": model,
                                            "hardware": hw})).tokens_per_s
    except (InfeasibleBudget, TierwiseError):
        pass
    coll_s = (gather + reduce) / (gbps * 1e9)
    ranks = RankPlan(nproc_per_node=nproc, nnodes=nnodes, gpu_peak=gpu_peaks, private_host=private,
                     owned_params=owned, base=base, node=node_bytes,
                     node_budgets={"host": host, "cxl": cxl or None, "nvme": nvme_cap if use_nvme else None},
                     gather_bytes=gather, reduce_bytes=reduce, collective_s=coll_s, link=link_words,
                     grad_bytes=grad_bytes, grad_reduce=grad_reduce if ch.needs_grad else "step",
                     single_tokens_per_s=single_tps,
                     host_shares=None if host is None or not uneven else
                     [(per_host[r] or 0) + keep + base_part + base_homes.bounce for r in range(L)])
    rss = node_bytes["host"] + L * plan.process_bytes + (0 if ch.cuda else sum(gpu_peaks))
    return dataclasses.replace(plan, bytes=by_tier, reserve=reserve, peak=peak, ranks=ranks, host_rss=rss,
                               gpu_update_params=0, cpu_update_params=owned[0])


def _uneven(owner: dict[int, int], world: int) -> str:
    """A refusal's hint where whole-chunk ownership is uneven (the node's budget is split evenly,
    so the rank owning most decides it): empty when the ranks own about the same."""
    counts = [0] * world
    for r in owner.values():
        counts[r] += 1
    if not counts or (min(counts) > 0 and max(counts) < 2 * min(counts)):
        return ""
    return (f" (chunks are owned whole: {len(owner)} trainable chunk{'s' if len(owner) != 1 else ''} on {world} ranks, "
            f"{'/'.join(map(str, counts))} per rank; a smaller --chunk-size evens them out)")
