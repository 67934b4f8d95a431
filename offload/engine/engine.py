"""The Engine: train a PyTorch model inside hard per-tier memory budgets.

    engine = offload.Engine(model, optimizer="adamw", lr=1e-4, gpu_mem="2G", cpu_mem="16G")
    loss = engine.step(batch)                      # forward, backward, update
    # or: loss = engine.forward(batch); engine.backward(loss); engine.optimizer_step()

Where the bytes live (every one of them reserved in `engine.ledger`):
- gpu:  module buffers; compute copies of gpu-home chunks with their grad, master and state;
        compute copies of streamed chunks while cached; gradients in flight to the host;
        activations saved for backward (MeZO: its perturbed copies of one module's weights).
- host / cxl / nvme (offload.plan.homes): grad, optimizer state (one byte blob per chunk) and fp32
        master of streamed chunks (in fp32 runs the master is also the streamed compute
        copy; bf16 runs keep a bf16 copy too); NVMe bounce buffers in host memory.
Placement happens at construction when `activations` (the planner's estimate) is given, else
after the first step, which streams every chunk through the smallest window while measuring
the activation peak. Steps differ (a padded batch saves an attention mask a full one does
not): `engine.measure(batch)` before the first step runs the largest batch without an update,
so the placement holds it; a step that still does not fit raises StepOverBudget. The first step also records the access trace; later steps follow the
schedule made from it (offload.plan.schedule: Belady eviction, look-ahead prefetch). In the last
micro-batch, chunks whose gradients are final are updated during backward (offload.engine.early).

Any nn.Module, with plain PyTorch's numbers:
- Residency: a module's own parameters are resident around its forward (offload.engine.hooks); a
  parameter read elsewhere (nn.MultiheadAttention's out_proj.weight, a head tied through
  F.linear) is seen by a TorchFunctionMode and made resident for the innermost running module
  (offload.engine.reads), or refused with an error naming parameter and module (MeZO).
- Recompute: blocks (model_info.find_blocks) are checkpointed by default when there are
  several. Buffers a block's forward changes (BatchNorm) are recomputed from copies taken
  before the forward, then set back to the forward's results (hooks.BufferGuard): each
  forward updates them once, as without recompute.
- Gradients: the first backward counts each parameter's contributions (one per graph using
  it: per recomputed block for a shared weight); later backwards sum them in p.grad in
  PyTorch's order and hand each chunk one sum per parameter; a chunk is updated early only
  when all of its parameters' sums are in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections import deque
from typing import Any, Callable, Iterable, Iterator

import torch

from ..core.chunks import DEFAULT_CHUNK_BYTES, pack_chunks, specs_of
from ..core.errors import BudgetExceeded, StepOverBudget, UnsupportedModel
from ..core.sizes import parse_size
from ..core.units import format_size
from ..plan.homes import assign_homes
from ..plan.placement import DeviceNeeds, DevicePlan, check_minimum, plan_device
from ..plan.schedule import ACQUIRE, RELEASE
from ..runtime.cache import ResidentCache
from ..runtime.cxl import CxlAllocator, detect_cxl_nodes
from ..runtime.executor import Executor, Ticket
from ..runtime.ledger import Ledger
from ..runtime.nvme import NvmeStore
from ..runtime.store import ChunkStore, SwapKind, in_slot_order, kind_bytes
from ..runtime.swapping import Bounce, update_all
from ..runtime.tiers import Tiers, pick_device
from ..runtime.trace import TraceFollower
from ..update.update import Hyper
from ..update.updaters import make_updater
from ..update.zeroth import dual_forward, hf_split_losses
from .actoffload import Offloader
from .early import EarlyUpdater
from .gradspill import GradSpill
from .hooks import ActivationTracker, BufferGuard, checkpointed, install_module_hooks
from .model_info import find_blocks, modules_with_params
from .reads import Paused, ReadGuard

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def default_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Hugging Face convention: the model computes the loss from `labels`."""
    return model(**batch).loss


class Engine:
    """Chunked, budgeted training of `model`. See the module docstring."""

    def __init__(self, model: torch.nn.Module, *, optimizer: str = "adamw", lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, momentum: float = 0.0,
                 optimizer_kwargs: dict | None = None,
                 gpu_mem: "str | int | None" = None, cpu_mem: "str | int | None" = None,
                 cxl_mem: "str | int | None" = None, nvme_path: "str | None" = None,
                 precision: str = "fp32", chunk_bytes: "str | int" = DEFAULT_CHUNK_BYTES,
                 grad_clip: float | None = None, checkpointing: bool | None = None,
                 activations: int | None = None,
                 cxl_node: "int | str | Iterable[int] | None" = None, cxl_bandwidth: float | None = None,
                 nvme_checksum: bool = False,
                 device: "str | torch.device | None" = None,
                 loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] = default_loss,
                 prefetch_depth: int = 16, h2d_bandwidth: float | None = None,
                 d2h_bandwidth: float | None = None, allow_gpu_home: bool = True,
                 offload_activations: bool = False, overlap_update: bool = True):
        """`activations`: the expected peak of saved activations (e.g. the planner's estimate).
        Given, chunks are placed in their final tiers now; otherwise after the warm-up step,
        which measures it (until then every chunk lives host-side).
        `checkpointing`: recompute each block in backward (True), keep every block's
        activations (False: about a quarter less compute, perfmodel.activation_bytes says how
        much more device memory), or None: recompute when the model has several blocks.
        `offload_activations`: keep checkpointed blocks' inputs in host memory between forward
        and backward (offload.engine.actoffload), for sequences whose activations outgrow the device.
        `overlap_update`: update a chunk as soon as its gradients are final, during backward
        (offload.engine.early); `engine.step` only, and not with clipping."""
        if precision not in DTYPES:
            raise ValueError(f"precision must be one of {sorted(DTYPES)}, got {precision!r}")
        self.model, self.loss_fn = model, loss_fn
        self.device = pick_device(device)
        self.compute_dtype = DTYPES[precision]
        self.precision = precision
        self.grad_clip = grad_clip
        self.prefetch_depth = prefetch_depth
        self.allow_gpu_home = allow_gpu_home
        self.offload_activations = offload_activations
        self.overlap_update = overlap_update
        self.hyper = Hyper(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, momentum=momentum)
        self._setup_tiers(gpu_mem=gpu_mem, cpu_mem=cpu_mem, cxl_mem=cxl_mem, cxl_node=cxl_node,
                          cxl_bandwidth=cxl_bandwidth, nvme_path=nvme_path, nvme_checksum=nvme_checksum)
        self.executor = Executor(device=self.device, h2d_bandwidth=h2d_bandwidth, d2h_bandwidth=d2h_bandwidth)

        named = self._trainable(model)
        self.plan = pack_chunks(specs_of(named), chunk_bytes=parse_size(chunk_bytes, what="chunk size"))
        self.optimizer_name = optimizer
        self.updater = make_updater(optimizer, self.plan, shapes={n: tuple(p.shape) for n, p in named},
                                    momentum=momentum, **(optimizer_kwargs or {}))
        weights = [(n, p) for n, p in named if p.device.type != "meta"]
        named = self._materialize_meta(model, named)
        self.params = dict(named)
        self.param_names = {p: n for n, p in named}
        self.buffer_bytes = self._move_buffers(model)
        self.module_chunks = self._module_chunks(model)
        self.blocks = find_blocks(model)
        self.zo_batch: int | None = None  # MeZO: rows of the +εz half while a dual forward runs
        if not self.updater.needs_grad:
            checkpointing = False  # no backward, nothing to recompute
        self._place(activations)
        self.store.load(weights, self.params)  # copy the weights in; the originals go when repointed
        del weights
        self._install_hooks(model, checkpointing)

        self.cache = ResidentCache(tiers=self.tiers, executor=self.executor,
                                   limit=self.device_plan.cache_limit if self.device_plan else self.needs.stream_window,
                                   dtype=self.compute_dtype, numel=lambda c: self.plan.chunks[c].numel,
                                   fetch=self._fetch, on_resident=self._on_resident, on_evict=self._on_evict)
        self.minimum_gpu_bytes: int | None = None
        self.steps = 0
        self.phase = "idle"
        self._seen: set[torch.nn.Parameter] = set()
        self._in_cycle = False
        self._inflight: deque = deque()
        self._inflight_bytes = 0
        self.timeline: list[dict] = []
        self._recording_timeline = False
        self.last_grad_norm: torch.Tensor | None = None
        #: Set True to leave the weights and optimizer state as they were when a step's loss (or,
        #: with grad_clip, its gradient norm) is NaN/inf; `skipped_last` then says it was skipped.
        self.skip_nonfinite = False
        self.skipped_last = False
        self.phase_times = {"forward": 0.0, "backward": 0.0, "update": 0.0}
        for cid in range(len(self.plan.chunks)):
            if self.store.is_gpu_home(cid):
                self.home_storage.add(self.store.compute_source(cid).untyped_storage()._cdata)
                self.store.point_params(cid, self.store.compute_source(cid), self.params)
            else:
                self._on_evict(cid)

    # -- setup helpers -------------------------------------------------------------------
    def _setup_tiers(self, *, gpu_mem: Any, cpu_mem: Any, cxl_mem: Any, cxl_node: Any, cxl_bandwidth: Any,
                     nvme_path: Any, nvme_checksum: bool) -> None:
        """Budgets, the ledger and the allocators of every tier in use."""
        budgets = {"gpu": parse_size(gpu_mem, what="--gpu-mem"), "host": parse_size(cpu_mem, what="--cpu-mem")}
        cxl_bytes = parse_size(cxl_mem, what="--cxl-mem")
        self.cxl = None
        if cxl_bytes:
            budgets["cxl"] = cxl_bytes
            # the ledger enforces --cxl-mem (one budget, exact bytes); the allocator's own page-
            # rounded count would refuse a tight budget the ledger accepts
            self.cxl = CxlAllocator(nodes=detect_cxl_nodes(), budget_bytes=1 << 62,
                                    emulate_bandwidth=cxl_bandwidth, node=cxl_node)
            self.cxl.check_fits(cxl_bytes)
        self.nvme = None
        if nvme_path is not None:
            budgets["nvme"] = None  # bounded by the disk: checked by preflight in _place
            self.nvme = NvmeStore(nvme_path, checksum=nvme_checksum)
        self.ledger = Ledger(budgets)
        self.tiers = Tiers(ledger=self.ledger, device=self.device, cxl=self.cxl)

    def _place(self, activations: int | None) -> None:
        """Decide every chunk kind's tier and allocate the chunk store there."""
        self.kinds = {c.index: kind_bytes(c.numel, state_bytes=self.updater.state_bytes(c.index),
                                          compute_dtype=self.compute_dtype, needs_grad=self.updater.needs_grad)
                      for c in self.plan.chunks}
        budgets = self.ledger.budgets
        self.needs = self._device_needs(activations=activations or 0)
        check_minimum(self.needs, budgets["gpu"], measured=False)
        self.device_plan: DevicePlan | None = None
        gpu_home: frozenset[int] = frozenset()
        if activations is not None:
            self.device_plan = plan_device(self.needs, budgets["gpu"], allow_gpu_home=self.allow_gpu_home)
            gpu_home = self.device_plan.gpu_home
        streamed = {c: k for c, k in self.kinds.items() if c not in gpu_home}
        self.homes = assign_homes(kinds=streamed, host=budgets["host"], cxl=budgets.get("cxl"),
                                  nvme=self.nvme is not None)
        if self.nvme is not None:
            self.nvme.preflight(sum(self.homes.bytes.get("nvme", {}).values()))
        tiers = dict(self.homes.tiers) | {c: dict.fromkeys(self.kinds[c], "gpu") for c in gpu_home}
        self.store = ChunkStore(plan=self.plan, tiers=self.tiers, compute_dtype=self.compute_dtype,
                                state_bytes=self.updater.state_bytes, needs_grad=self.updater.needs_grad,
                                homes=tiers, nvme=self.nvme)
        self.bounce = Bounce(self.store, pin=self.device.type == "cuda") if self.homes.bounce else None
        self.store.bounce = self.bounce
        self.spill = GradSpill(self)
        self.streamed_storage: dict[int, int] = {}
        self.home_storage: set[int] = set()

    def _install_hooks(self, model: torch.nn.Module, checkpointing: bool | None) -> None:
        """Module hooks, gradient hooks, block checkpointing (or MeZO's dual forward); what it
        patches on the model, close() puts back."""
        self._patched: list[tuple[torch.nn.Module, Any]] = []  # (module, its own forward attribute)
        self._use_cache_flipped = False
        if not self.updater.needs_grad:
            for mod in self.module_chunks:
                self._patch_forward(mod, lambda f, m=mod: dual_forward(f, m, self))
        if checkpointing is None:
            checkpointing = len(self.blocks) > 1
        if self.offload_activations and not checkpointing and self.updater.needs_grad:
            raise ValueError("offload_activations moves the inputs of recomputed blocks: it needs "
                             "checkpointing (a model with several blocks, checkpointing not False)")
        if checkpointing and getattr(getattr(model, "config", None), "use_cache", False):
            model.config.use_cache = False  # a KV cache would see each block twice (recompute)
            self._use_cache_flipped = True
        if checkpointing:
            guard = dict(reserve=lambda n: self.ledger.reserve("gpu", "activation", n),
                         release=lambda n: self.ledger.release("gpu", "activation", n))
            for block in self.blocks:
                self._patch_forward(block, lambda f, b=block: checkpointed(
                    f, context=lambda: self._recompute(b), saving=lambda: self.tracker.saving_block_inputs(),
                    buffers=BufferGuard(b, **guard)))
        self.checkpointing = checkpointing
        self.guard = ReadGuard(self._on_read)
        # per running module (None: the loss function), the chunks read there that it does not own
        self._frames: list[tuple[torch.nn.Module | None, list[int]]] = []
        self._handles = install_module_hooks(self, model)
        for p in self.params.values():
            self._handles.append(p.register_post_accumulate_grad_hook(self._grad_ready))
        self.early = EarlyUpdater(self) if self.overlap_update and self.updater.needs_grad else None
        self._early_on = False
        self._uses: dict[str, int] | None = None  # gradients per backward, per parameter (traced)
        self._expected: dict[int, int] = {}  # per chunk, when every parameter in it gets some
        self._counts: dict[str, int] = {}
        self._arrived: dict[int, int] = {}
        self._chunk_tickets: dict[int, list] = {}
        self._submitted: set[int] = set()
        self._held_back: set[int] = set()
        self._gathered: dict[torch.nn.Parameter, int] = {}  # p.grad kept for more contributions: bytes
        self._gather_bytes = 0
        self._flushing = False
        self.tracker = ActivationTracker(self)
        if self.offload_activations:
            self.tracker.offloader = Offloader(self)
        self.follower = TraceFollower()

    def _patch_forward(self, mod: torch.nn.Module, wrap: Callable[[Callable], Callable]) -> None:
        self._patched.append((mod, mod.__dict__.get("forward")))
        mod.forward = wrap(mod.forward)

    @contextlib.contextmanager
    def _recompute(self, block: torch.nn.Module) -> Iterator[None]:
        """What a checkpointed block's recompute runs under: the saved-tensor hooks, the read
        guard, and the block's own frame (its forward hooks do not run for a recompute)."""
        with self.tracker.hooks(), self.guard:
            self._push(block)
            try:
                yield
            finally:
                self.exit_module(block)

    @staticmethod
    def _trainable(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
        frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
        if frozen:
            raise ValueError(f"frozen parameters are not supported yet: {frozen[:3]}...")
        return list(model.named_parameters())

    def _materialize_meta(self, model: torch.nn.Module,
                          named: list[tuple[str, torch.nn.Parameter]]) -> list[tuple[str, torch.nn.Parameter]]:
        """Swap meta-device parameters for real (empty) ones; weights come via load_weights."""
        swap = {}
        for name, p in named:
            if p.device.type == "meta":
                swap[p] = torch.nn.Parameter(torch.empty(0, dtype=self.compute_dtype, device=self.device))
        if not swap:
            return named
        for mod in model.modules():
            for key, p in list(mod._parameters.items()):
                if p in swap:
                    mod._parameters[key] = swap[p]
        return [(n, swap.get(p, p)) for n, p in named]

    def _move_buffers(self, model: torch.nn.Module) -> int:
        total = 0
        for mod in model.modules():
            for name, buf in list(mod._buffers.items()):
                if buf is None:
                    continue
                if buf.device != self.device and buf.device.type != "meta":
                    mod._buffers[name] = buf = buf.to(self.device)
                total += buf.numel() * buf.element_size()
        self.ledger.reserve("gpu", "buffer", total)
        return total

    def _module_chunks(self, model: torch.nn.Module) -> dict[torch.nn.Module, list[int]]:
        out = {}
        for mod in modules_with_params(model):
            cids = sorted({self.plan.slots[self.param_names[p]].chunk for p in mod._parameters.values()
                           if p is not None and p in self.param_names})
            if cids:
                out[mod] = cids
        return out

    def _device_needs(self, *, activations: int, pinned: int = 0) -> DeviceNeeds:
        """`pinned`: the most chunk bytes pinned at once so far (nested modules, parameters read
        outside their owner): the window is at least that, and at least the widest module."""
        csize = self.compute_dtype.itemsize
        compute = tuple(c.numel * csize for c in self.plan.chunks)
        widest = max((sum(compute[c] for c in cids) for cids in self.module_chunks.values()), default=0)
        widest = max(widest, pinned)
        largest_param = max((s.numel for s in self.plan.slots.values()), default=0) * csize
        return DeviceNeeds(
            buffers=self.buffer_bytes,
            stream_window=widest + max(compute, default=0),
            grad_reserve=largest_param if self.updater.needs_grad else self._zo_workspace(),
            activations=activations,
            home_bytes=tuple(sum(self.kinds[c].values()) for c in range(len(compute))),
            compute_bytes=compute,
        )

    def _zo_workspace(self) -> int:
        """MeZO's perturbed copies of the widest module's parameters (+εz and -εz)."""
        csize = self.compute_dtype.itemsize
        return max((2 * csize * sum(self.plan.slots[self.param_names[p]].numel
                                    for p in m._parameters.values() if p is not None)
                    for m in self.module_chunks), default=0)

    # -- residency callbacks (compute thread) --------------------------------------------
    def _fetch(self, cid: int, buf: torch.Tensor) -> Ticket:
        """Start copying chunk `cid`'s compute copy from its home tier into device `buf`."""
        src = self.store.compute_source(cid)
        links = (self.cxl.link_out,) if self.cxl is not None and self.store.compute_tier(cid) == "cxl" else ()
        if isinstance(src, SwapKind):
            staging = self.bounce.staging_for(src)

            def fn(stream: Any) -> None:
                self.nvme.read(src.key, staging)
                buf.copy_(staging, non_blocking=stream is not None)
        else:
            def fn(stream: Any) -> None:
                buf.copy_(src, non_blocking=stream is not None)
        return self.executor.job("h2d", fn, nbytes=buf.numel() * buf.element_size(), links=links)

    def _on_resident(self, cid: int, buf: torch.Tensor) -> None:
        self.streamed_storage[buf.untyped_storage()._cdata] = cid
        self.store.point_params(cid, buf, self.params)

    def _on_evict(self, cid: int) -> None:
        self.streamed_storage = {k: v for k, v in self.streamed_storage.items() if v != cid}
        self.store.unpoint_params(cid, self.params, device=self.device)

    def enter_module(self, mod: torch.nn.Module) -> None:
        """A module's forward starts: a new frame; its own chunks become resident."""
        if not self._frames:
            raise UnsupportedModel(
                f"{self._module_name(mod)} ran outside engine.step / forward / eval_loss: the engine "
                f"makes parameters resident only there (read trained weights with named_parameters_fp32)")
        self._push(mod)

    def _push(self, mod: torch.nn.Module) -> None:
        with Paused(self.guard):
            self._frames.append((mod, []))
            if mod in self.module_chunks:
                self.acquire_module(mod)

    def exit_module(self, mod: torch.nn.Module) -> None:
        """A module's forward ended: release its own chunks and those read in its frame."""
        with Paused(self.guard):
            if mod in self.module_chunks:
                self.release_module(mod)
            if self._frames:
                for cid in self._frames.pop()[1]:
                    self._release(cid)

    def _on_read(self, p: torch.nn.Parameter) -> None:
        """A torch call reads `p` (offload.engine.reads): make its chunk resident for the innermost
        running module if no running module holds it already."""
        name = self.param_names.get(p)
        if name is None:
            return  # not a parameter of this model
        cid = self.plan.slots[name].chunk
        if self.store.is_gpu_home(cid) or self.cache.pinned(cid):
            return
        if not self._frames:
            raise UnsupportedModel(f"parameter {name!r} is read outside the forward and the loss function; "
                                   f"the engine cannot make it resident there")
        mod, borrowed = self._frames[-1]
        if not self.updater.needs_grad:
            raise UnsupportedModel(
                f"parameter {name!r} is read by {self._module_name(mod)} outside the forward of the module "
                f"that owns it; {self.optimizer_name} perturbs a parameter in its owner's forward only, so "
                f"this read would see it unperturbed")
        self._acquire(cid)
        borrowed.append(cid)
        self._record_moment()

    def _module_name(self, mod: "torch.nn.Module | None") -> str:
        if mod is None:
            return "the loss function"
        name = next((n for n, m in self.model.named_modules() if m is mod), None)
        return f"module {name!r} ({type(mod).__name__})" if name else f"the model ({type(mod).__name__})"

    def acquire_module(self, mod: torch.nn.Module) -> None:
        for cid in self.module_chunks[mod]:
            if not self.store.is_gpu_home(cid):
                self._acquire(cid)
        self._record_moment()

    def release_module(self, mod: torch.nn.Module) -> None:
        for cid in self.module_chunks[mod]:
            if not self.store.is_gpu_home(cid):
                self._release(cid)

    def touch_chunk(self, cid: int) -> torch.Tensor:
        """A saved view of chunk `cid` is needed in backward: make it resident now."""
        buf = self._acquire(cid)
        self._release(cid)
        return buf

    def _acquire(self, cid: int) -> torch.Tensor:
        """Carry out the schedule's actions for this acquisition, then pin the chunk."""
        if self.phase == "eval":  # off the trace: evaluation is not part of a step
            return self.cache.acquire(cid)
        actions = self.follower.event(ACQUIRE, cid, self.phase)
        if actions is not None and not self.cache.apply(actions.evict, ()):
            self.follower.drop()
            actions = None
        buf = self.cache.acquire(cid)
        if actions is not None and not self.cache.apply(actions.prefetch_evict, actions.prefetch):
            self.follower.drop()
        return buf

    def _release(self, cid: int) -> None:
        if self.phase != "eval":
            self.follower.event(RELEASE, cid, self.phase)
        self.cache.release(cid)

    # -- gradients ----------------------------------------------------------------------
    def _grad_ready(self, p: torch.nn.Parameter) -> None:
        if self._gathering(p):
            return
        g = p.grad
        p.grad = None
        slot = self.plan.slots[self.param_names[p]]
        first = p not in self._seen
        self._seen.add(p)
        src = in_slot_order(g, slot)  # a transposed parameter's gradient lands in its memory order
        spilled = isinstance(self.store.chunks[slot.chunk].grad, SwapKind)
        if spilled:
            dst = self.spill.target(slot.chunk)[slot.offset: slot.offset + slot.numel]
        else:
            dst = self.store.grad_view(slot)
        if self.store.is_gpu_home(slot.chunk):
            dst.copy_(src) if first else dst.add_(src)
            self._arrived_grad(slot, None)
            return
        nbytes = src.numel() * src.element_size()
        self._reserve_grad(nbytes)
        staging = None
        if self.executor.cuda and not first:
            staging = torch.empty(src.numel(), dtype=src.dtype, pin_memory=True)
        ticket = self.executor.copy("d2h", dst, src, accumulate=not first, staging=staging)
        self._inflight.append((ticket, nbytes, src))
        if spilled:
            self.spill.landed(slot.chunk, ticket)
        self._arrived_grad(slot, ticket)

    def _gathering(self, p: torch.nn.Parameter) -> bool:
        """Count `p`'s gradient contributions of this backward: its post-accumulate hook runs
        once per graph that uses it (a weight used twice in one graph: once; in two recomputed
        blocks: twice). While more are due (as many as the first backward counted), leave the
        sum in p.grad for autograd to add the next one to, in plain PyTorch's order: the grad
        chunk then gets one sum per backward, as p.grad does across micro-batches. The held
        p.grad is device memory of this backward only, booked as an activation."""
        name = self.param_names[p]
        n = self._counts[name] = self._counts.get(name, 0) + 1
        if not self._flushing and self._uses is not None and n < self._uses.get(name, 0):
            if p not in self._gathered:
                nbytes = p.grad.numel() * p.grad.element_size()
                self.ledger.reserve("gpu", "activation", nbytes)  # first: _abort_cycle releases what is here
                self._gathered[p] = nbytes
            return True
        if p in self._gathered:
            self.ledger.release("gpu", "activation", self._gathered.pop(p))
        return False

    def _flush_gathered(self) -> None:
        """After backward: sums still waiting for contributions that did not come this time."""
        self._flushing = True
        try:
            for p in list(self._gathered):
                self._grad_ready(p)
        finally:
            self._flushing = False

    def _arrived_grad(self, slot: Any, ticket: Any) -> None:
        """A parameter's gradient sum reached its grad chunk. Once every parameter of a chunk has
        sent its sum (last micro-batch, no clipping), the chunk's update starts while backward
        goes on (offload.engine.early)."""
        if not self._early_on:
            return
        cid = slot.chunk
        n, traced = self._counts[slot.name], self._uses.get(slot.name, 0)
        if n > traced:  # a contribution more than the first backward had: the control flow changed
            if cid in self._submitted:
                raise UnsupportedModel(
                    f"parameter {slot.name!r} got gradient contribution {n} in this backward (the first "
                    f"backward had {traced}) after its chunk was updated early; use overlap_update=False "
                    f"for a model whose backward changes from step to step")
            self._held_back.add(cid)  # updated at the end of the step instead
        if ticket is not None:
            self._chunk_tickets.setdefault(cid, []).append(ticket)
        self._arrived[cid] = self._arrived.get(cid, 0) + 1
        if cid not in self._held_back and self._arrived[cid] == self._expected.get(cid):
            self._submitted.add(cid)
            self.early.submit(cid, self._chunk_tickets.pop(cid, []))

    def _learn_uses(self) -> None:
        """After the first backward: the contributions each parameter gets per backward (the
        trace of gradients). A chunk expects one sum per parameter; one with a parameter that
        got none is not updated early (that slot is zeroed at the end of the step)."""
        self._uses = dict(self._counts)
        self._expected = {c.index: len(c.params) for c in self.plan.chunks
                          if all(self._uses.get(name, 0) for name in c.params)}
        # the sums later backwards hold in p.grad (at most all at once): the warm-up held none
        self._gather_bytes = sum(self.plan.slots[n].numel for n, k in self._uses.items() if k > 1) \
            * self.compute_dtype.itemsize

    def _reserve_grad(self, nbytes: int) -> None:
        limit = max(self.needs.grad_reserve, nbytes)
        while self._inflight and (self._inflight[0][0].done() or self._inflight_bytes + nbytes > limit):
            self._retire_oldest()
        self.ledger.reserve("gpu", "grad", nbytes)
        self._inflight_bytes += nbytes

    def _retire_oldest(self) -> None:
        ticket, nbytes, _src = self._inflight.popleft()
        self.executor.wait(ticket)
        self._inflight_bytes -= nbytes
        self.ledger.release("gpu", "grad", nbytes)

    def _drain_grads(self) -> None:
        while self._inflight:
            self._retire_oldest()

    # -- the step -----------------------------------------------------------------------
    def _begin_cycle(self) -> None:
        if not self._in_cycle:
            self._in_cycle = True
            self._seen = set()
            self.spill.begin_cycle()
            self.follower.start_step()
            self._recording_timeline = self.steps == 1 or (self.steps == 0 and not self.timeline)
            if self._recording_timeline:
                self.timeline = []

    def _to_device(self, batch: Any) -> Any:
        if isinstance(batch, torch.Tensor):
            return batch.to(self.device)
        if isinstance(batch, dict):
            return {k: self._to_device(v) for k, v in batch.items()}
        if isinstance(batch, (list, tuple)):
            return type(batch)(self._to_device(v) for v in batch)
        return batch

    def forward(self, batch: Any) -> torch.Tensor:
        """Run the loss function on `batch`; returns the loss tensor (graph kept for backward)."""
        self._begin_cycle()
        self.phase = "forward"
        t0 = time.perf_counter()
        try:
            with self.tracker.hooks(), self._reading():
                loss = self.loss_fn(self.model, self._to_device(batch))
            if self.tracker.offloader is not None:
                self.tracker.offloader.end_forward()
        except BudgetExceeded as exc:
            raise self._budget_error(exc, intact=self._abort_cycle()) from exc
        self.phase_times["forward"] += time.perf_counter() - t0
        return loss

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate `loss`; gradients accumulate (fp32) in their grad chunks."""
        self.phase = "backward"
        self._record_moment()  # without recompute no module hook fires in backward: mark it
        t0 = time.perf_counter()
        try:
            self._arrived, self._chunk_tickets, self._counts = {}, {}, {}
            self._submitted, self._held_back = set(), set()
            loss.backward()
            self._record_moment()  # every gradient accumulated, before the drain
            self._flush_gathered()
            if self._uses is None:
                self._learn_uses()
            self._drain_grads()
            self.spill.end_backward()
            if self._early_on:
                self.early.wait()
        except BudgetExceeded as exc:
            raise self._budget_error(exc, intact=self._abort_cycle()) from exc
        self.phase_times["backward"] += time.perf_counter() - t0

    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        """Around the loss function: the read guard, and the loss function's own frame."""
        self._frames = [(None, [])]
        try:
            with self.guard:
                yield
        finally:
            frames, self._frames = self._frames, []
            for _, borrowed in reversed(frames):
                for cid in borrowed:
                    self._release(cid)

    def _abort_cycle(self) -> bool:
        """Drop a failed step's gradients; True when its early updates (offload.engine.early) had not
        reached any chunk, so the weights are those of the last completed step."""
        intact = True
        for p, nbytes in self._gathered.items():
            p.grad = None
            self.ledger.release("gpu", "activation", nbytes)
        self._gathered = {}
        self._drain_grads()
        if self.early is not None:
            try:
                self.early.wait()  # never leave the worker writing while the caller saves
            except BaseException:  # noqa: BLE001 - the budget error is the one to report
                log.exception("an early update failed while a step was aborted")
            intact = not self.early.done
            self.early.done.clear()
        self.spill.finish_cycle()
        self.spill = GradSpill(self)
        self._in_cycle = False
        self.store.zero_grads()
        return intact

    def _budget_error(self, exc: BudgetExceeded, *, intact: bool) -> Exception:
        """A gpu reservation failed mid-step: what the step needed with this placement (in use +
        asked, above the budget by construction) and the activations it had been placed for; in
        the first step (nothing placed yet), the engine's minimum with the activations so far."""
        if exc.tier != "gpu":
            return exc
        need = exc.used + exc.asked
        act = self.ledger.usage()["gpu"].get("activation", 0) + (exc.asked if exc.kind == "activation" else 0)
        if self.minimum_gpu_bytes is None:  # the warm-up (or measure): nothing placed yet, every chunk streams
            need = max(need, self._device_needs(activations=act, pinned=self.cache.pinned_peak).minimum)
            return StepOverBudget(
                f"gpu budget {format_size(exc.budget)} ({exc.budget} B) is below the engine's minimum for this "
                f"batch: at least {format_size(need)} ({need} B), with activations so far {format_size(act)} "
                f"(the first step streams every chunk through the smallest window); raise --gpu-mem or lower "
                f"the batch size / sequence length", minimum={"gpu": need}, weights_intact=intact)
        return StepOverBudget(
            f"gpu budget {format_size(exc.budget)} ({exc.budget} B) cannot hold this step: it needed at least "
            f"{format_size(need)} ({need} B): {format_size(exc.used)} in use + {format_size(exc.asked)} more for "
            f"{exc.kind}, with activations at {format_size(act)} where the chunks were placed for "
            f"{format_size(self.needs.activations)}; measure the largest batch before the first step "
            f"(Engine.measure), or raise --gpu-mem or lower the batch size / sequence length",
            minimum={"gpu": need}, weights_intact=intact)

    def step(self, batch: Any, *, grad_accum: int = 1) -> float:
        """Forward, backward and update on `batch`, split into `grad_accum` micro-batches."""
        if not self.updater.needs_grad:
            return self._zo_step(batch)
        losses = []
        finite = True
        micro = split_batch(batch, grad_accum)
        for i, mb in enumerate(micro):
            loss = self.forward(mb)
            if self.skip_nonfinite:  # known before backward: no chunk may update early then
                finite = finite and bool(torch.isfinite(loss.detach()).all())
            # the last micro-batch's gradients are final: chunks may update as they complete
            # (once the first backward has counted each chunk's gradients)
            self._early_on = (self.early is not None and self.grad_clip is None and i == len(micro) - 1
                              and self._uses is not None and finite)
            try:
                self.backward(loss / grad_accum if grad_accum > 1 else loss)
            finally:
                self._early_on = False
            losses.append(loss.detach().float().item())
        self.optimizer_step(skip=not finite)
        return sum(losses) / len(losses)

    def _zo_step(self, batch: Any) -> float:
        """MeZO: one forward over the doubled batch gives both losses; then the update."""
        self._begin_cycle()
        self.phase = "forward"
        t0 = time.perf_counter()
        self.updater.begin_step()
        batch = self._to_device(batch)
        half = next(v for v in batch.values() if isinstance(v, torch.Tensor)).shape[0]
        self.zo_batch = half
        try:
            with torch.no_grad(), self._reading():
                loss_pos, loss_neg = hf_split_losses(self.model, batch, half)
        finally:
            self.zo_batch = None
        self.updater.projected_grad = (loss_pos - loss_neg) / (2.0 * self.updater.eps)
        self.phase_times["forward"] += time.perf_counter() - t0
        finite = bool(torch.isfinite(torch.as_tensor([float(loss_pos), float(loss_neg)])).all())
        self.optimizer_step(skip=self.skip_nonfinite and not finite)
        return loss_pos

    def optimizer_step(self, *, skip: bool = False) -> None:
        """Clip (optionally) and update every chunk; then the device copies are stale. `skip`
        (or, with skip_nonfinite, a NaN/inf gradient norm): no chunk is updated; the gradients
        of this cycle are overwritten by the next one's."""
        self.phase = "update"
        t0 = time.perf_counter()
        self._drain_grads()
        if self.updater.needs_grad:
            self.store.zero_unseen_grads(self._seen, self.params)
        self.spill.finish_cycle()
        if self.grad_clip is not None:
            self.last_grad_norm = self.store.clip_grads_(self.grad_clip)
            skip = skip or (self.skip_nonfinite and not bool(torch.isfinite(self.last_grad_norm)))
        early = self.early.done if self.early is not None else set()
        self.skipped_last = skip
        if not skip:
            update_all(self.store, self.updater, self.hyper, self.bounce,
                       chunks=[c for c in range(len(self.plan.chunks)) if c not in early])
        early.clear()
        self.store.grad_scale = None
        self.cache.evict_all()
        self._record_moment()
        self.follower.end_step()
        self._in_cycle = False
        self.steps += 1
        self.phase = "idle"
        self.phase_times["update"] += time.perf_counter() - t0
        if self.minimum_gpu_bytes is None:
            self._after_warmup()
        self._schedule()

    def measure(self, batch: Any) -> int:
        """Forward and backward on `batch` with no update, before the first step, so that the
        placement covers it: the warm-up step places chunks for the largest activations seen
        so far (or checks the up-front `activations` against them). Give it the largest batch
        the run will see, e.g. a padded one (transformers then saves an attention mask that a
        full batch does without). Returns that activation peak in bytes (0 without backward).
        The model's buffers (BatchNorm's running statistics) and the RNG are left as they were:
        the run's numbers are those of a run without measure()."""
        if self.minimum_gpu_bytes is not None:
            raise ValueError("Engine.measure() comes before the first step: the chunks are placed after it")
        if self.updater.needs_grad:
            found = [(m, n, b, b.detach().to("cpu", copy=True)) for m in self.model.modules()
                     for n, b in m._buffers.items() if b is not None]
            cuda = [self.device] if self.device.type == "cuda" else []
            with torch.random.fork_rng(devices=cuda):  # dropout draws as if measure had not run
                try:
                    self.backward(self.forward(batch))
                finally:
                    self._abort_cycle()
                    self.cache.evict_all()
                    self.phase, self.timeline = "idle", []
                    with torch.no_grad():
                        for m, n, b, value in found:
                            m._buffers[n] = b
                            b.copy_(value)
        return self.ledger.kind_peak("gpu", "activation")

    def _after_warmup(self) -> None:
        """Activations are known now: place chunks on the device as the budget allows."""
        act = self.ledger.kind_peak("gpu", "activation") + self._gather_bytes
        measured = self._device_needs(activations=act, pinned=self.cache.pinned_peak)
        self.minimum_gpu_bytes = measured.minimum
        if self.device_plan is not None:  # placed up front from an estimate: keep it if it holds
            self._hold_estimate(act)
            return
        self.needs = measured
        self.device_plan = plan_device(self.needs, self.ledger.budgets["gpu"], allow_gpu_home=self.allow_gpu_home)
        for cid in sorted(self.device_plan.gpu_home):
            self.store.promote(cid, self.params)
            self.home_storage.add(self.store.compute_source(cid).untyped_storage()._cdata)
        self.cache.limit = self.device_plan.cache_limit

    def _hold_estimate(self, act: int) -> None:
        """Chunks were placed for the estimated activations; more were measured: the cache of
        streamed chunks gives way to them, or (when it cannot) StepOverBudget now, after a
        completed step, rather than in the middle of a later one."""
        over = act - self.needs.activations
        if over <= 0:
            return
        budget = self.ledger.budgets["gpu"]
        self.needs = dataclasses.replace(self.needs, activations=act)
        if budget is None:
            return
        limit = self.cache.limit - over
        if limit < self.needs.stream_window:
            need = budget + self.needs.stream_window - limit
            raise StepOverBudget(
                f"gpu budget {format_size(budget)} ({budget} B) cannot hold the next steps: the chunks were placed "
                f"for {format_size(act - over)} of activations, the warm-up step saved {format_size(act)}; with "
                f"this placement at least {format_size(need)} ({need} B) is needed; raise --gpu-mem or lower "
                f"the batch size / sequence length", minimum={"gpu": need}, step_done=True)
        log.info("activations %s above the estimate: the stream cache shrinks to %s", format_size(over),
                 format_size(limit))
        self.cache.limit = limit
        self.device_plan = dataclasses.replace(self.device_plan, cache_limit=limit)

    def _schedule(self) -> None:
        """A trace was just recorded (or the placement changed): plan fetches and evictions."""
        if self.follower.following or self.follower.events is None:
            return
        csize = self.compute_dtype.itemsize
        sizes = {c.index: c.numel * csize for c in self.plan.chunks}
        self.follower.reschedule(keep=lambda c: not self.store.is_gpu_home(c), sizes=sizes,
                                 capacity=self.cache.limit, lookahead=self.prefetch_depth)

    def _record_moment(self) -> None:
        if self._recording_timeline:
            self.timeline.append({"moment": len(self.timeline), "phase": self.phase,
                                  "bytes": self.ledger.totals()})

    # -- weights in and out ----------------------------------------------------------------
    def set_lr(self, lr: float) -> None:
        self.hyper.lr = lr

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (name, tensor) pairs into their slots, one at a time (meta-device models)."""
        self.store.load(named_tensors, self.params)

    def init_weights_(self, *, seed: int = 0, std: float = 0.02) -> None:
        """Random initialisation in place, chunk by chunk: N(0, std) for matrices, ones for
        norm weights, zeros for biases (the Llama convention). For benchmarking and demos."""
        g = torch.Generator().manual_seed(seed)

        def tensors():
            for name, slot in self.plan.slots.items():
                if len(slot.shape) >= 2:
                    yield name, torch.empty(slot.shape).normal_(0.0, std, generator=g)
                elif "norm" in name:
                    yield name, torch.ones(slot.shape)
                else:
                    yield name, torch.zeros(slot.shape)

        self.store.load(tensors(), self.params)

    @torch.no_grad()
    def eval_loss(self, batch: Any) -> float:
        """The loss on `batch` without gradients (no update, nothing kept for backward)."""
        phase = self.phase
        self.phase = "eval"
        try:
            with self._reading():
                return float(self.loss_fn(self.model, self._to_device(batch)).float().item())
        finally:
            self.phase = phase
            self.cache.evict_all()  # the schedule of the next step starts from an empty cache

    def named_parameters_fp32(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, fp32 CPU tensor) for every parameter, from the master copies."""
        yield from self.store.named_master(self.params)

    def state_dict(self) -> dict[str, Any]:
        """Weights, optimizer state, step count and the model's persistent buffers (BatchNorm's
        running statistics change in training too)."""
        buffers = {n: b.to("cpu", copy=True) for n, b in self._persistent_buffers().items()}
        return self.store.state_dict() | {"steps": self.steps, "optimizer_meta": self.updater.meta_state(),
                                          "buffers": buffers}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        own = self._persistent_buffers()
        unknown = sorted(set(sd.get("buffers", {})) - set(own))
        if unknown:
            raise ValueError(f"checkpoint has buffers this model lacks: {unknown[:3]}")
        self.cache.evict_all()
        self.store.load_state_dict(sd)
        self.updater.load_meta_state(sd.get("optimizer_meta", {}))
        self.steps = int(sd["steps"])
        with torch.no_grad():
            for name, value in sd.get("buffers", {}).items():
                own[name].copy_(value)

    def _persistent_buffers(self) -> dict[str, torch.Tensor]:
        return {f"{prefix}.{n}" if prefix else n: b for prefix, m in self.model.named_modules()
                for n, b in m._buffers.items() if b is not None and n not in m._non_persistent_buffers_set}

    def close(self) -> None:
        """Stop the copy threads, remove the swap files, the hooks and the patched forwards.
        The model's parameters become meta tensors (shared ones stay shared): read the trained
        weights with named_parameters_fp32 before closing, and load_state_dict(..., assign=True)
        to use the model again."""
        self.executor.drain()
        self.executor.close()
        if self.early is not None:
            self.early.close()
        if self.nvme is not None:
            self.nvme.close()
        for h in self._handles:
            h.remove()
        self._handles = []
        for mod, own in reversed(self._patched):
            if own is None:
                del mod.forward  # the class's forward again
            else:
                mod.forward = own
        self._patched = []
        if self._use_cache_flipped:
            self.model.config.use_cache = True
            self._use_cache_flipped = False
        # no placeholder values left: a use of the closed model fails loudly (meta tensors)
        meta = {p: torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"))
                for p in self.params.values()}
        for mod in self.model.modules():
            for key, p in list(mod._parameters.items()):
                if p in meta:
                    setattr(mod, key, meta[p])


def split_batch(batch: Any, n: int) -> list[Any]:
    """Split a dict/tensor batch along dim 0 into `n` equal micro-batches."""
    if n == 1:
        return [batch]
    if isinstance(batch, torch.Tensor):
        if batch.shape[0] % n:
            raise ValueError(f"batch of {batch.shape[0]} does not split into {n} micro-batches")
        return list(batch.chunk(n))
    if isinstance(batch, dict):
        parts = {k: split_batch(v, n) for k, v in batch.items()}
        return [{k: parts[k][i] for k in batch} for i in range(n)]
    raise TypeError(f"cannot split a batch of type {type(batch).__name__}")
