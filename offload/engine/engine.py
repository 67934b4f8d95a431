"""The Engine: train a PyTorch model inside hard per-tier memory budgets.

    engine = offload.Engine(model, budget=Budget(gpu="2G", cpu="16G"), optim=Optim("adamw", lr=1e-4))
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

Several ranks (torch.distributed; offload.engine.ranks): `process_group=` or an initialised
default group of more than one rank. Every rank builds the Engine on the same model and calls
`step` with the same whole batch of `grad_accum * world` micro-batches; micro-batch i runs on
rank i mod world, so the math is one rank's with grad_accum * world. Trainable chunks are
sharded whole (rank k mod world owns the k-th): master weights and optimizer state live and
are updated on their owner only; compute copies are broadcast from it into every rank's device
window when used; gradients are reduced onto it per chunk once complete, during backward.
Owned-only gradients (`grad_reduce="micro"`, the default): a rank holds the gradient of a chunk
it does not own only while the current micro-batch produces it (offload.engine.transient), and
reduces it onto the owner after every micro-batch: memory of the owned gradients only, the
reduce traffic times the micro-batches per rank. `grad_reduce="step"`: every rank keeps a
gradient chunk of every trainable chunk, sums its own micro-batches there and reduces once per
step (DDP's no_sync: one reduce per step, the gradients of all chunks on every rank). With one
micro-batch per rank both reduce once; "micro" holds less. `eval_loss`, `measure` and `named_parameters_fp32` are collective:
every rank calls them; `state_dict`/`load_state_dict` are this rank's shard. Not yet with
several ranks: gpu-home trainable chunks (all stream), GaLore/APOLLO. MeZO: the ranks share the
perturbation seed, split each batch's rows and sum only the two losses (`_zo_step`).
Frozen chunks (a LoRA base) are not sharded: the local ranks of a node hold one copy, in shared
memory or the leader's swap files (offload.engine.sharedbase; `share_base`). The node's cores
are divided too: each rank's NVMe I/O threads (offload.runtime.nvme.threads_per_rank) and its
CPU update threads (offload.runtime.cores), by the ranks on its node (`Ranks.local`).

Any nn.Module, with plain PyTorch's numbers. The Engine is a composition; each collaborator
gets the few objects it uses, never the Engine:
- residency (offload.engine.residency): a module's own chunks are resident around its forward;
  a parameter read elsewhere is made resident for the innermost running module (reads.py);
  cache, trace follower and fetch.
- gradients (offload.engine.gradients): arrival, accumulation in PyTorch's order, the NVMe
  gradient spill (gradspill.py), early updates (early.py).
- timeline (offload.engine.timeline): the phase, the time per phase, one step's memory moments.
- surgery (offload.engine.surgery): meta parameters, buffers, hooks, checkpointed blocks
  (hooks.py), MeZO's dual forward; close() undoes every change.
Over 600 lines: what is left here is what needs all of them at once (construction, the step
protocol, placement after the warm-up, state_dict and close), each part a short method.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import numbers
import operator
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
import torch.distributed as dist

from ..core.chunks import pack_chunks
from ..core.errors import BudgetExceeded, InfeasibleBudget, UnsupportedModel
from ..core.options import Activations, Budget, Distributed, Optim, Precision, Streaming, recomputed_blocks
from ..core.sizes import parse_size
from ..core.units import format_size
from ..core.vocab import TIERS
from ..plan.homes import assign_homes, beside_reserved, bounce_sizes
from ..plan.needs import grad_staging_bytes, units_are_blocks, workspace_margin
from ..plan.perfmodel import zo_loss_workspace
from ..plan.placement import DeviceNeeds, DevicePlan, check_minimum, plan_device
from ..runtime.cores import cpu_threads
from ..runtime.executor import Executor
from ..runtime.nvme import threads_per_rank
from ..runtime.store import ChunkStore, SwapKind, frozen_kind_bytes, kind_bytes
from ..runtime.swapping import Bounce, drop_ahead, read_ahead, update_all
from ..runtime.tiers import pick_device
from ..runtime.trace import Phase
from ..update.update import Hyper, check_lr
from ..update.updaters import make_updater
from ..update.table import MOE_ZEROTH
from ..update.zeroth import dual_forward, hf_split_losses
from .actoffload import Offloader
from .batches import default_loss, split_batch, step_weights, to_device
from .early import EarlyUpdater
from . import gradients as gradients_mod
from . import headloss, segments
from .gradients import GradientRouter
from .gradspill import GradSpill
from .frozen_base import frozen_layouts
from .tiled import tiled, tiled_mlps
from .hooks import ActivationTracker, BufferGuard, checkpointed, install_module_hooks
from .lora import apply_lora
from .model_info import (is_moe, check_dense_grads, check_model_given, check_no_own_checkpointing,
                         check_trainable_dtypes, find_blocks, lumped_recompute, model_specs)
from .needs import device_needs, module_chunks, open_tiers
from .ranks import SHARDED_OPTIMIZERS, Ranks, default_group, gather_objects
from .sharedbase import SharedBase
from .overbudget import estimate_over_budget, step_over_budget, warmup_over_budget
from .residency import Residency
from .surgery import ModelSurgery, booked
from .transient import TransientGrads
from .workspace import Workspace
from ..plan.ranks import remote_kinds, window_bytes
from .timeline import Timeline

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Engine:
    """Chunked, budgeted training of `model`. See the module docstring.

    A composition: the Engine keeps construction, the step protocol (forward, backward, step,
    optimizer_step, measure), the placement after the warm-up and state_dict; its collaborators
    own the rest: `residency` (offload.engine.residency: cache, trace follower, fetch, module
    stack), `grads` (offload.engine.gradients: arrival, accumulation, NVMe spill, early update),
    `moments` (offload.engine.timeline: phase, timeline, phase times) and `surgery`
    (offload.engine.surgery: every change to the model, undone by close())."""

    def __init__(self, model: torch.nn.Module, *, budget: Budget = Budget(), optim: Optim = Optim(),
                 precision: Precision = Precision(), lora: Any = None, activations: Activations = Activations(),
                 distributed: Distributed = Distributed(), streaming: Streaming = Streaming(),
                 device: "str | torch.device | None" = None,
                 loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] = default_loss):
        """The options are offload.core.options' dataclasses (a flat dict of keyword names:
        `Engine(model, **flat_options(gpu_mem="2G", lr=1e-4))`).
        `lora`: a peft.LoraConfig whose adapters are injected (offload.engine.lora); a model
        already wrapped by peft.get_peft_model is taken as is. Parameters with
        requires_grad=False (the base) are frozen: a compute copy only, read-only, gpu-home
        where the budget allows (after the trainable chunks), else streamed; stored as
        `precision.base` (offload.runtime.codecs; a gpu-home encoded chunk keeps its encoded
        bytes on the device, decoded per use).
        `activations.offload`: keep checkpointed blocks' inputs in host memory between forward
        and backward (offload.engine.actoffload). `activations.expected` given, chunks are placed
        in their final tiers now; otherwise after the warm-up step, which measures the peak (until
        then every chunk lives host-side). `distributed`: see the module docstring. `device`: CUDA
        where present (default), else the simulated device on the CPU; a CUDA device becomes the
        calling thread's current one (the thread that runs the steps)."""
        for name, value, cls in (("budget", budget, Budget), ("optim", optim, Optim),
                                 ("precision", precision, Precision), ("activations", activations, Activations),
                                 ("distributed", distributed, Distributed), ("streaming", streaming, Streaming)):
            if not isinstance(value, cls):
                raise TypeError(f"{name}= takes a {cls.__name__} (offload.core.options), got {type(value).__name__}; "
                                f"flat keyword names go through flat_options(...)")
        self.options = dict(budget=budget, optim=optim, precision=precision, activations=activations,
                            distributed=distributed, streaming=streaming)
        optimizer = optim.name
        # refusals that do not depend on the adapters come before apply_lora changes the model
        check_model_given(model)
        check_no_own_checkpointing(model)
        if optimizer == "mezo" and loss_fn is not default_loss:
            # its dual forward computes the Hugging Face causal-LM loss from `labels` itself
            # (offload.update.zeroth.hf_split_losses): a loss_fn would be ignored
            raise UnsupportedModel("mezo in the engine computes a Hugging Face causal LM's own loss from the "
                                   "batch's labels; a custom loss_fn is not supported with it (the drop-in "
                                   "tierwise.optim.MeZO takes any loss)")
        if lora is not None:
            model = apply_lora(model, lora)
        self.model, self.loss_fn = model, loss_fn
        self.device = pick_device(device)
        if self.device.type == "cuda":  # streams, events, host registrations and the random state
            torch.cuda.set_device(self.device)  # below are the current device's
        self.compute_dtype = DTYPES[precision.compute]
        self.precision = precision.compute
        self.grad_clip = optim.grad_clip
        self.prefetch_depth = streaming.prefetch
        self.allow_gpu_home = streaming.allow_gpu_home
        self.offload_activations = activations.offload
        self.host_activations = activations.host if activations.offload else 0
        self.cxl_activations = activations.cxl if activations.offload else 0
        if self.cxl_activations and budget.cxl is None:
            raise ValueError("activations.cxl places offloaded inputs in CXL memory: it needs budget.cxl")
        self.activations_tier = ("cxl" if self.cxl_activations else
                                 "nvme" if activations.offload and activations.nvme else "host")
        if self.activations_tier == "nvme" and budget.nvme is None:
            raise ValueError("activations.nvme writes offloaded inputs to NVMe: it needs budget.nvme")
        self.overlap_update = optim.overlap_update
        self.hyper = Hyper(lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps, weight_decay=optim.weight_decay,
                           momentum=optim.momentum)
        named = list(model.named_parameters())
        check_trainable_dtypes(named)
        frozen = {n for n, p in named if not p.requires_grad}
        if precision.base is not None and not frozen:
            raise UnsupportedModel(f"base={precision.base!r} sets how a frozen base is stored, and every parameter "
                                   "of this model trains: give lora=... (a LoraConfig), or freeze the base "
                                   "(requires_grad=False)")
        if frozen and optimizer == "mezo":
            raise UnsupportedModel(f"mezo perturbs every parameter of a module; frozen parameters "
                                   f"({sorted(frozen)[:3]}...) are not supported with it")
        self.plan = pack_chunks(model_specs(model), chunk_bytes=parse_size(budget.chunk, what="chunk size"),
                                frozen=frozen)
        self.frozen_layouts = frozen_layouts(self.plan, model, base_dtype=precision.base,
                                            double_quant=precision.double_quant,
                                             compute_dtype=self.compute_dtype)
        self.optimizer_name = optimizer
        self.ranks = self.shared = self.nvme = self.executor = self.surgery = self.grads = None
        self._head_hook: "torch.utils.hooks.RemovableHandle | None" = None
        self._loss_stages = (0, 0, 0)  # the default loss's transients by stage (headloss.workspace)
        self._closed = False
        try:
            group = distributed.group if distributed.group is not None else default_group()
            self.ranks: Ranks | None = None
            if group is not None and dist.get_world_size(group) > 1:
                if optimizer not in SHARDED_OPTIMIZERS:
                    raise UnsupportedModel(f"--optimizer {optimizer} is not supported with several ranks yet "
                                           f"(sharded: {', '.join(SHARDED_OPTIMIZERS)})")
                self.ranks = Ranks(group, trainable=[c.index for c in self.plan.chunks if not self.plan.is_frozen(c.index)],
                                   timeout_s=distributed.timeout)
                self.allow_gpu_home = False  # every rank must fetch alike: all chunks stream (see ranks.py)
            local = self.ranks.local_world if self.ranks is not None else 1
            self._divide_cores(local)
            self.ledger, self.tiers, self.cxl, self.nvme = open_tiers(
                device=self.device, gpu_mem=budget.gpu, cpu_mem=budget.cpu, cxl_mem=budget.cxl,
                cxl_node=budget.cxl_node, cxl_bandwidth=budget.cxl_bandwidth, nvme_path=budget.nvme,
                nvme_checksum=budget.nvme_checksum,
                nvme_threads=threads_per_rank(local))
            self.executor = Executor(device=self.device, h2d_bandwidth=streaming.h2d_bandwidth,
                                     d2h_bandwidth=streaming.d2h_bandwidth)
            self.workspace = Workspace(self.device, self.ledger)
            self._warm_limit: int | None = None
            self._ahead: dict = {}  # a swapped chunk's master and state read ahead of its update (update_all)
            self._order: list[int] = []  # the chunks the last step updated early, in their order
            self._order_now: list[int] = []  # (this step's, so far)
            self.moments = Timeline(self.ledger)
            self.shared: SharedBase | None = None
            if self.ranks is not None and distributed.share_base and frozen and self.ledger.budgets.get("cxl") is None:
                # on every rank of the group, which all run its collectives (a node of one rank shares with itself)
                self.shared = SharedBase(self.ranks, host_budget=self.ledger.budgets["host"])
            self.updater = make_updater(optimizer, self.plan.trainable(),
                                        shapes={n: tuple(p.shape) for n, p in named if n not in frozen},
                                        momentum=optim.momentum, **optim.kwargs)
            if self.updater.needs_grad:
                check_dense_grads(model)
            #: several ranks with owned-only gradients (offload.engine.transient)
            self.owned_grads = self.ranks is not None and distributed.grad_reduce == "micro" and self.updater.needs_grad
            trainable = [c.index for c in self.plan.chunks if not self.plan.is_frozen(c.index)]
            self.grad_window = window_bytes(self.plan, trainable) if self.owned_grads else 0
            weights = [(n, p) for n, p in named if p.device.type != "meta"]
            #: parameters that came on the meta device and have no values yet (load_weights,
            #: init_weights_ or load_state_dict give them): a step before would train zeros
            self._unset = {n for n, p in named if p.device.type == "meta"}
            self._trainable_count = len({id(p) for n, p in named if n not in frozen})
            self._told_unseen = False
            self.surgery = ModelSurgery(model)
            named = self.surgery.materialize_meta(named, dtype=self.compute_dtype, device=self.device)
            self.params = dict(named)
            self.param_names = {p: n for n, p in named}
            self.buffer_bytes = self.surgery.move_buffers(self.device)
            self.ledger.reserve("gpu", "buffer", self.buffer_bytes)
            self.blocks = find_blocks(model)
            self.module_chunks = module_chunks(model, self.plan, self.param_names)  # (the units: _choose_units)
            self._plain_units = dict(self.module_chunks)
            self._block_units = (module_chunks(model, self.plan, self.param_names, self.blocks)
                                 if self.updater.needs_grad and self.blocks else None)
            self.units_are_blocks = False
            self.zo_batch: int | None = None  # MeZO: rows of the +εz half while a dual forward runs
            checkpointing = activations.recompute if self.updater.needs_grad else False  # (no backward)
            # None: every block recomputed in the warm-up, then kept where the budget allows
            # (_keep_activations); not with offloaded inputs (they are the recomputed blocks')
            self._auto_recompute = checkpointing is None and not self.offload_activations
            self._place(activations.expected)
            self.store.load(weights, self.params)  # copy the weights in; the originals go when repointed
            del weights
            self.residency = Residency(
                store=self.store, tiers=self.tiers, executor=self.executor,
                limit=self.device_plan.cache_limit if self.device_plan else self.needs.stream_window,
                params=self.params, param_names=self.param_names, module_chunks=self.module_chunks,
                timeline=self.moments, name_of=self._module_name, cxl=self.cxl, nvme=self.nvme, bounce=self.bounce,
                borrow_refusal=None if self.updater.needs_grad else self.optimizer_name, ranks=self.ranks,
                borrows=streaming.h2d_bandwidth is None)  # (an emulated link: the copies are what is measured)
            self._install_hooks(model, checkpointing)
            if not self.updater.needs_grad:  # (no backward to learn reads for)
                self.residency.stop_watching_homes()
            self.minimum_gpu_bytes: int | None = None
            self.steps = 0
            self._steps_here = 0  # (this engine's own: `steps` is the run's, a resumed one's too)
            self._in_cycle = False
            self.last_grad_norm: torch.Tensor | None = None
            #: Set True to leave the weights and optimizer state as they were when a step's loss (or,
            #: with grad_clip, its gradient norm) is NaN/inf; `skipped_last` then says it was skipped.
            self.skip_nonfinite = False
            self.skipped_last = False
        except BaseException:
            self._abandon()
            raise

    def _abandon(self) -> None:
        """A construction that failed (e.g. a budget refused once the tiers exist): stop and remove
        what it had made - copy threads, swap files, hooks and patched forwards, the shared base,
        the rank groups - so a library caller's process goes on as before; the error follows."""
        grads = self.grads
        if getattr(self, "residency", None) is not None:
            self.residency.restore_classes()
        for close in (self.executor and self.executor.close,
                      grads is not None and grads.early is not None and grads.early.close,
                      self.nvme and self.nvme.close, self.surgery and self.surgery.close,
                      self.shared and self.shared.close, self.ranks and self.ranks.close):
            if close:
                try:
                    close()
                except Exception:  # noqa: BLE001 - the construction's own error is the one to raise
                    log.debug("cleanup after a failed construction", exc_info=True)

    # -- views of the collaborators' state (tests, cli and bench read them) ----------------
    @property
    def phase(self) -> Phase:
        return self.moments.phase

    @property
    def timeline(self) -> list[dict]:
        """One step's bytes per tier at each moment (offload.engine.timeline)."""
        return self.moments.rows

    @property
    def counters(self) -> dict[str, int]:
        """The last complete step's counters (offload.engine.timeline.COUNTS): module hook calls,
        gradient copies, host waits on device progress inside forward and inside backward, tensors
        the saved-tensor hooks packed."""
        return self.moments.last_counts

    @property
    def phase_times(self) -> dict[str, float]:
        return self.moments.phase_times

    @property
    def cache(self) -> Any:
        return self.residency.cache

    @property
    def follower(self) -> Any:
        return self.residency.follower

    @property
    def streamed_storage(self) -> dict[int, int]:
        return self.residency.streamed_storage

    @property
    def reads_ahead(self) -> int:
        """Updates that found their chunk's master and state already read (update_all's read-ahead)."""
        return self._ahead.get("used", 0)

    @property
    def early(self) -> EarlyUpdater | None:
        return self.grads.early

    # -- setup helpers -------------------------------------------------------------------
    @staticmethod
    def _divide_cores(local: int) -> None:
        """One of `local` ranks on a node: torch's CPU threads (the CPU update) become its share
        of the cores where the process was given no choice (offload.runtime.cores)."""
        threads = cpu_threads(local, current=torch.get_num_threads())
        if threads.count is not None:
            log.info("CPU threads: %d per rank (%d local ranks)", threads.count, local)
            torch.set_num_threads(threads.count)
        if threads.note:  # (a warning: the CLI shows warnings, not info lines)
            log.warning("%s", threads.note)

    def _place(self, activations: int | None) -> None:
        """Decide every chunk kind's tier and allocate the chunk store there."""
        remote = self.ranks.remote() if self.ranks is not None else frozenset()
        self.kinds = self._kinds(remote)
        budgets = self.ledger.budgets
        # CUDA: gradients land in registered host memory first, the largest copy's bytes or a
        # slice of it (offload.engine.gradients; the planner books the same)
        self.grad_staging = (grad_staging_bytes(self._device_needs(activations=0))
                             if self.updater.needs_grad and len(self.plan.frozen) < len(self.plan.chunks)
                             and (self.device.type == "cuda" or gradients_mod.STAGE_ON_SIMULATED) else 0)
        # transient grads, staged grads, and offloaded activations (the planner's estimate)
        host = None if budgets["host"] is None else (budgets["host"] - self.grad_window - self.grad_staging
                                                     - self.host_activations)
        # CUDA: encoded frozen chunks cross the link into one device staging buffer, decoded
        # from there (fetches run in order on the copy stream); the simulated device decodes in place
        staging = max((self.kinds[c]["compute"] for c in self.plan.frozen if self.frozen_layouts[c] is not None),
                      default=0) if self.device.type == "cuda" else 0
        if staging:
            self.ledger.reserve("gpu", "buffer", staging)
            self.buffer_bytes += staging
        # placed up front on CUDA: the allocator's margin is left free from the start, as the
        # planner leaves it (the warm-up then adds what it measures beside the ledger)
        margin = workspace_margin(budgets["gpu"]) if self.workspace.cuda and activations is not None else 0
        self.needs = self._device_needs(activations=(activations or 0) + margin)
        check_minimum(self.needs, budgets["gpu"], measured=False,  # (the modules': the smallest window)
                      whole=self.allow_gpu_home and not self._decoded())
        if activations is not None and self._choose_units(activations + margin):
            self.needs = self._device_needs(activations=activations + margin)
        self.device_plan: DevicePlan | None = None
        gpu_home: frozenset[int] = frozenset()
        if activations is not None:
            self.device_plan = plan_device(self.needs, budgets["gpu"], allow_gpu_home=self.allow_gpu_home,
                                           prefer=self._home_order(), decoded=self._decoded(), up_front=True)
            gpu_home = self.device_plan.gpu_home
        streamed = {c: k for c, k in self.kinds.items() if c not in gpu_home}
        if self.shared is not None:  # the base's homes are the node's (the leader's placement)
            lead = self.shared.leader
            self.homes = self.shared.place(kinds=streamed, leader_kinds=self._kinds(frozenset(
                c for c, r in self.ranks.owner.items() if r != lead)), frozen=set(self.plan.frozen),
                host=host, nvme=self.nvme is not None)
            self.shared.map(self.ledger, device=self.device)
        else:
            cxl = budgets.get("cxl")  # (less what offloaded inputs take there)
            try:
                self.homes = assign_homes(kinds=streamed, host=host, nvme=self.nvme is not None,
                                          cxl=None if cxl is None else cxl - self.cxl_activations)
            except InfeasibleBudget as e:
                kept = {"staging gradients": self.grad_staging, "a window of others' gradients": self.grad_window,
                        "offloaded activations": self.host_activations}
                raise beside_reserved(e, room=host, reserved=sum(kept.values()),
                                      what=" and ".join(k for k, v in kept.items() if v)) from None
        if self.nvme is not None:
            self.nvme.preflight(sum(self.homes.bytes.get("nvme", {}).values())
                                + (self.options["activations"].nvme if self.activations_tier == "nvme" else 0))
        tiers = dict(self.homes.tiers) | {c: dict.fromkeys(self.kinds[c], "gpu") for c in gpu_home}
        self.store = ChunkStore(plan=self.plan, tiers=self.tiers, compute_dtype=self.compute_dtype,
                                state_bytes=self.updater.state_bytes, needs_grad=self.updater.needs_grad,
                                homes=tiers, nvme=self.nvme, frozen=self.frozen_layouts, remote=remote,
                                shared=self.shared, remote_grads=not self.owned_grads)
        if self.shared is not None:
            self.shared.attach_files(self.store, self.nvme)
        if staging:
            self.store.device_staging = torch.empty(staging, dtype=torch.uint8, device=self.device)
        self.bounce = (Bounce(self.store, bounce_sizes(streamed, self.homes.tiers))
                       if self.homes.bounce else None)
        self.store.bounce = self.bounce
        self.staging_buffer = None
        if self.grad_staging:
            self.ledger.reserve("host", "buffer", self.grad_staging)
            self.staging_buffer = self.tiers.host_buffer(self.grad_staging)

    def _kinds(self, remote: frozenset[int]) -> dict[int, dict[str, int]]:
        """{chunk: {kind: bytes}} of a rank for which the chunks `remote` are another's."""
        return {c.index: frozen_kind_bytes(c.numel, layout=self.frozen_layouts[c.index],
                                           compute_dtype=self.compute_dtype)
                if c.index in self.frozen_layouts else
                remote_kinds(c.numel, owned_grads=self.owned_grads) if c.index in remote else
                kind_bytes(c.numel, state_bytes=self.updater.state_bytes(c.index),
                           compute_dtype=self.compute_dtype, needs_grad=self.updater.needs_grad)
                for c in self.plan.chunks}

    def _choose_units(self, activations: int) -> bool:
        """Once the activations are known (the estimate placed up front, or the warm-up's): the
        blocks become the units of residency where the budget has room for them
        (offload.plan.needs.units_are_blocks); the modules stay the units otherwise, and always
        for MeZO (it perturbs each module in its own forward). True when the blocks were chosen
        now (the caller reinstalls the hooks if it had installed them)."""
        if self._block_units is None or self.units_are_blocks:
            return False
        needs = self._device_needs(activations=activations, units=self._block_units)
        if not units_are_blocks(needs, self.ledger.budgets.get("gpu")):
            return False
        self.module_chunks.clear()
        self.module_chunks.update(self._block_units)  # (in place: the residency holds this dict)
        if hasattr(self, "residency"):  # (placed up front, the residency is made after)
            self.residency.units_changed()
        self.units_are_blocks = True
        return True

    def _reinstall_unit_hooks(self) -> None:
        """The units changed (_choose_units): their hooks follow."""
        for h in self._unit_hooks:
            h.remove()
        res = self.residency
        self._unit_hooks = install_module_hooks(self._hooked(), res.enter_module, res.exit_module)
        self.surgery.keep(self._unit_hooks)

    def _hooked(self) -> list[torch.nn.Module]:
        """The modules whose forward is a frame: with the blocks as the units, the model itself
        (a call outside the engine is refused by its name) and the units; with the modules,
        every module (a parameter read outside its owner is held for the innermost one)."""
        if not self.units_are_blocks:
            return list(self.model.modules())
        return [self.model, *(m for m in self.module_chunks if m is not self.model)]

    def _install_hooks(self, model: torch.nn.Module, checkpointing: bool | None) -> None:
        """Module hooks, gradient hooks, block checkpointing (or MeZO's dual forward), each
        change recorded in `surgery` for close() to undo; the gradient router."""
        res, surgery = self.residency, self.surgery
        if not self.updater.needs_grad:
            if is_moe(model):
                raise UnsupportedModel(MOE_ZEROTH)
            for mod in self.module_chunks:
                surgery.patch_forward(mod, lambda f, m=mod: dual_forward(
                    f, m, half=lambda: self.zo_batch, updater=self.updater, names=self.param_names,
                    ledger=self.ledger))
        count = recomputed_blocks(checkpointing, len(self.blocks))
        if self.offload_activations and not count and self.updater.needs_grad:
            raise ValueError("offload_activations moves the inputs of recomputed blocks: it needs "
                             "checkpointing (a model with several blocks, checkpointing not False or 0)")
        recomputed = self.blocks[:count]
        self.tracker = ActivationTracker(res, self.ledger, self.device, counts=self.moments.counts)
        # the simulated device books the default loss's transients till the head's input has its
        # gradient (offload.engine.workspace); CUDA's allocator measures them
        lm = headloss.causal_lm(model) if self.loss_fn is default_loss and not self.workspace.cuda else None
        head = lm.get_output_embeddings() if lm is not None else None
        if isinstance(head, torch.nn.Module):
            self._head_hook = head.register_forward_hook(self._after_head)
            surgery.keep([self._head_hook])  # (removed by close(), or when construction fails)
        # blocks that save what their inputs' shapes decide: a recompute may be lumped, and the
        # warm-up's bytes hold for later batches of its shape (_keep_activations)
        self.tracker.lumps = self._shaped_blocks = lumped_recompute(model, recomputed)
        # a KV cache would see a recomputed block twice, and a training step has no use for one:
        # without it, what autograd saves does not depend on the config's use_cache either
        surgery.disable_kv_cache()
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        self._recompute_undo = [self._recompute_block(i, model_type) for i in range(count)]
        self.recomputed = count
        """Blocks recomputed in backward: the first `recomputed` of `blocks`."""
        self._unit_hooks = install_module_hooks(self._hooked(), res.enter_module, res.exit_module)
        surgery.keep(self._unit_hooks)
        transient = TransientGrads(self.plan, self.tiers, self.grad_window) if self.owned_grads else None
        early = (EarlyUpdater(self._update_chunks, on_error=None if transient is None else transient.fail)
                 if self.updater.needs_grad and (self.overlap_update or self.owned_grads)
                 else None)  # (owned: the reduce worker too)
        self.grads = GradientRouter(
            store=self.store, executor=self.executor, ledger=self.ledger, param_names=self.param_names,
            grad_reserve=functools.partial(operator.attrgetter("needs.grad_reserve"), self), early=early,
            new_spill=lambda: GradSpill(self.store, self.bounce, self.nvme, self.executor),
            compute_itemsize=self.compute_dtype.itemsize, ranks=self.ranks, counts=self.moments.counts,
            transient=transient, staging=self.staging_buffer,
            reduce_rest=self._reduce_rest)
        res.on_backward_read = self.grads.read_in_backward
        surgery.keep(p.register_post_accumulate_grad_hook(self.grads.grad_ready)
                     for p in self.params.values() if p.requires_grad)  # frozen ones get no gradient
        if self.offload_activations:
            self.tracker.offloader = Offloader(ledger=self.ledger, tiers=self.tiers, executor=self.executor,
                                               device=self.device, phase=lambda: self.moments.phase,
                                               tier=self.activations_tier, nvme=self.nvme)

    def _recompute_block(self, i: int, model_type: "str | None") -> list[Any]:
        """Block i recomputed in backward (its MLP in tiles where its family allows): the undos."""
        res, surgery, block = self.residency, self.surgery, self.blocks[i]
        undo = [surgery.patch_forward(mlp, lambda f, m=mlp, w=width, v=values: tiled(
            f, m, width=w, context=lambda: res.recompute(self.tracker.hooks()),
            enabled=functools.partial(getattr, self, "units_are_blocks"), values=v))
            for mlp, width, values in tiled_mlps([block], model_type)]
        undo.append(surgery.patch_forward(block, lambda f: checkpointed(
            f, context=functools.partial(self.tracker.recomputing, block=i),
            hold=functools.partial(self._holding, block), saving=self.tracker.saving_block_inputs,
            buffers=BufferGuard(block, **booked(self.ledger, "gpu", "activation"), device=self.device))))
        return undo

    def _keep_activations(self, act: int, pinned: int) -> int:
        """`recompute` left to the engine (None): the warm-up recomputed every block and measured
        what each one's recompute saved. Where those sizes follow the inputs' shapes (a dense
        decoder family: model_info.lumped_recompute), the last blocks keep their activations instead, as many
        as leave the whole model on the device beside them (fewer recomputes, the same bytes
        over the link: nothing streams). Where a chunk streams anyway every block stays
        recomputed: trading a resident chunk for kept activations takes a time model
        (`finetune plan` weighs it and passes its count). Returns the activation bytes to place
        for: the measured peak plus what the kept blocks hold from forward to backward (an upper
        bound: at any moment the kept blocks add at most that to the warm-up's bytes)."""
        saved, budget = self.tracker.block_bytes, self.ledger.budgets["gpu"]
        if (not self._auto_recompute or not self._shaped_blocks or len(saved) < self.recomputed
                or not self.allow_gpu_home or any(k > 1 for k in (self.grads.uses or {}).values())
                or budget is None and self.device.type == "cuda"  # (no budget: the card's memory is unknown)
                or segments.NAME == getattr(getattr(self.model, "config", None), "_attn_implementation", None)):
            return act  # (sizes that follow the data or a packed row's documents, a shared weight: all recomputed)
        whole = frozenset(range(len(self.plan.chunks)))

        def placed(extra: int) -> "DevicePlan | None":
            try:
                plan = plan_device(self._device_needs(activations=act + extra, pinned=pinned), budget,
                                   prefer=self._home_order(), decoded=self._decoded())
            except InfeasibleBudget:
                return None
            return plan if plan.gpu_home == whole else None

        base = placed(0)
        extra, count = 0, self.recomputed
        while base is not None and count and (plan := placed(extra + saved[count - 1])) is not None \
                and plan.decoded_home == base.decoded_home:  # (not a decoded base given up for it)
            count -= 1
            extra += saved[count]
        if count < self.recomputed:
            for undo in reversed(self._recompute_undo[count:]):
                for u in reversed(undo):
                    u.remove()
            del self._recompute_undo[count:]
            log.info("the whole model stays on the device: %d of %d blocks keep their activations "
                     "(%s) instead of being recomputed", self.recomputed - count, len(self.blocks),
                     format_size(extra))
            self.recomputed = count
            self.residency.follower.reset()  # (backward reads the kept blocks' chunks once)
        return act + extra

    def _holding(self, block: torch.nn.Module) -> Any:
        """A checkpointed block's recompute and backward (Residency.holding), with no gathered
        gradient of a later block left on the device through it."""
        if self.grads is not None:
            self.grads.send_open()
        return self.residency.holding(block)

    def _update_chunks(self, chunks: list[int], handed: dict, final: bool = True) -> None:
        """Update `chunks` (their gradients complete); `handed`: {chunk: (its gradient still in
        host memory, give-back)} for NVMe gradients never written. Several ranks: reduce each onto
        its owner first, in the given order (the same on every rank), and update this rank's own.
        `final` False (owned-only gradients, a micro-batch before the last): reduce only; a handed
        gradient goes to its swap file."""
        if self.ranks is not None:
            self._reduce_grads(chunks, handed)
            chunks = [c for c in chunks if self.ranks.owns(c)]
        if not final:
            for c in chunks:
                if c in handed:
                    self.grads.spill.write_handed(c)
            return
        expect, expect_after = self._expected(chunks)
        update_all(self.store, self.updater, self.hyper, self.bounce, chunks=chunks, handed=handed,
                   resident=self.residency.copy_master, carry=self._ahead, expect=expect,
                   expect_after=expect_after, refresh=self.residency.refresh_master, defer=True)

    def _expected(self, chunks: list[int]) -> tuple[int | None, int | None]:
        """The two chunks the last step updated early after `chunks` (one rank), unless this
        step already updated them: their masters and states are read while their gradients
        complete."""
        self._order_now.extend(chunks)
        if self.ranks is not None or not chunks or chunks[-1] not in self._order:
            return None, None
        k = self._order.index(chunks[-1]) + 1
        nxt = [c if c not in self._order_now else None for c in self._order[k:k + 2]] + [None, None]
        return (nxt[0], nxt[1]) if nxt[0] is not None else (None, None)

    def _reduce_grads(self, chunks: list[int], handed: dict) -> None:
        transient = self.grads.transient
        try:
            for cid in chunks:
                if self.plan.is_frozen(cid):
                    continue
                if cid in handed:  # the sum is in the handed buffer, not in the store
                    self.ranks.reduce_grad(cid, handed[cid][0])
                    continue
                mine = self.ranks.owns(cid)
                if transient is not None and not mine:  # this micro-batch's sum (zeros if none came)
                    self.ranks.reduce_grad(cid, transient.target(cid))
                    transient.free(cid)
                    continue
                with self.store.opened(cid, only=("grad",), write_back=mine) as work:
                    self.ranks.reduce_grad(cid, work["grad"])
        finally:  # a failed reduce too: its buffers and the later ones' go back (nobody waits on them)
            if transient is not None:
                for cid in chunks:
                    if not self.ranks.owns(cid):
                        transient.free(cid)

    def _reduce_rest(self, chunks: list[int]) -> None:
        """Owned-only gradients, at the end of a backward: reduce the chunks not complete during
        it (a parameter without a gradient this time, or a chunk held back), in chunk order on
        every rank. An owned gradient holds the step's sum so far: a parameter this rank has not
        seen yet this step is zeroed first, and counts as seen afterwards (the next micro-batch
        adds to the reduced sum)."""
        spill = self.grads.spill
        spill.settle()
        for cid in chunks:
            if not self.ranks.owns(cid):
                continue
            grad = self.store.chunks[cid].grad
            unseen = [n for n in self.plan.chunks[cid].params if id(self.params[n]) not in self.grads.seen]
            if isinstance(grad, SwapKind):
                if cid not in spill.written:  # its file holds the last step's sum: start from zeros
                    self.nvme.zeros(grad.key, grad.nbytes)
                    spill.written.add(cid)
            else:
                for n in unseen:
                    self.store.grad_view(self.plan.slots[n]).zero_()
            self.grads.seen.update(id(self.params[n]) for n in unseen)
        self._reduce_grads(chunks, {})

    def _home_order(self) -> list[int]:
        """Chunks that may be gpu-home, most wanted first: trainable ones (adapters: small, and
        the whole update stays on the device), then frozen ones; both last-used first. An encoded
        frozen chunk is home as its encoded bytes (decoded into a cache buffer per use)."""
        n = len(self.plan.chunks)
        trainable = [c for c in reversed(range(n)) if not self.plan.is_frozen(c)]
        frozen = [c for c in reversed(range(n)) if self.plan.is_frozen(c)]
        return trainable + frozen

    def _decoded(self) -> frozenset[int]:
        """Encoded frozen chunks: they pass through the cache even when gpu-home (plan_device)."""
        return frozenset(c for c, layout in self.frozen_layouts.items() if layout is not None)

    def _device_needs(self, *, activations: int, pinned: int = 0,
                      units: "dict[torch.nn.Module, list[int]] | None" = None) -> DeviceNeeds:
        """`units`: these units of residency instead of the current ones (`_plain_units`, the
        modules: the smallest window, the minimum budget's)."""
        units = self.module_chunks if units is None else units
        return device_needs(self.plan, units, self.param_names, kinds=self.kinds,
                            buffers=self.buffer_bytes, itemsize=self.compute_dtype.itemsize,
                            needs_grad=self.updater.needs_grad, activations=activations, pinned=pinned)

    def _module_name(self, mod: "torch.nn.Module | None") -> str:
        if mod is None:
            return "the loss function"
        name = next((n for n, m in self.model.named_modules() if m is mod), None)
        return f"module {name!r} ({type(mod).__name__})" if name else f"the model ({type(mod).__name__})"

    # -- the step -----------------------------------------------------------------------
    def _unseen(self, cid: int) -> list[str]:
        """The parameters of chunk `cid` without a gradient this step."""
        return [n for n in self.plan.chunks[cid].params if id(self.params[n]) not in self.grads.seen]

    def _tell_unseen(self) -> None:
        """Once, with several ranks: trainable parameters without a gradient this step are updated
        as with a zero gradient (which got one is known per rank), where torch.optim skips a
        parameter whose .grad is None: their moments decay, weight decay applies, their step
        count advances."""
        names = [n for c in range(len(self.plan.chunks)) if not self.plan.is_frozen(c) for n in self._unseen(c)]
        if names:
            self._told_unseen = True
            log.warning("%d trainable parameters got no gradient this step (%s%s): the engine updates them as "
                        "with a zero gradient, where torch.optim skips them (their optimizer moments decay and "
                        "weight decay applies); freeze what never trains (requires_grad=False)",
                        len(names), ", ".join(names[:3]), ", ..." if len(names) > 3 else "")

    def _check_set(self) -> None:
        if self._unset:
            some = ", ".join(sorted(self._unset)[:2])
            raise UnsupportedModel(f"{len(self._unset)} parameters ({some}, ...) are on the meta device with no values: "
                                   "give them with engine.load_weights(...) or init_weights_() first (a model from "
                                   "tierwise.offload.hf.from_pretrained is loaded by OffloadTrainer)")

    def _begin_cycle(self) -> None:
        if self._unset:
            self._check_set()
        if self.shared is not None:
            self.shared.ready()
        if not self._in_cycle:
            self._in_cycle = True
            if self.minimum_gpu_bytes is None:
                self._begin_warmup()
            self.grads.begin_step()
            self.residency.follower.start_step()
            # (not with several ranks: a remote chunk's fill is a collective; not MeZO: its
            # forward perturbs the compute copies)
            self.residency.keep_next(self.ranks is None and self.minimum_gpu_bytes is not None
                                     and self.updater.needs_grad)
            self.moments.begin_step(self._steps_here)

    def _after_head(self, module: torch.nn.Module, args: tuple, out: Any) -> None:
        """Hooks on the gradients of the head's output (the loss's backward is done: what stays
        through the head's backward is booked) and of its input (the loss's transients are gone)."""
        x = args[0] if args else None
        if not (self.workspace.loss and isinstance(x, torch.Tensor) and x.requires_grad):
            return
        tail = self._loss_stages[2]
        if isinstance(out, torch.Tensor) and out.requires_grad and out.numel():
            out.register_hook(lambda grad: self.workspace.book_loss(tail))
        x.register_hook(self.workspace.release_loss)

    def forward(self, batch: Any) -> torch.Tensor:
        """Run the loss function on `batch`; returns the loss tensor (graph kept for backward)."""
        self._check_open()
        self._begin_cycle()
        try:
            with self.moments.timed(Phase.FORWARD):
                waits = self.executor.host_waits
                if self._head_hook is not None:
                    self._loss_stages = headloss.workspace(self.model, batch, torch.is_grad_enabled())
                    self.workspace.book_loss(self._loss_stages[0])
                with self.tracker.hooks(), self.residency.reading():
                    loss = self.loss_fn(self.model, to_device(batch, self.device))
                if not (isinstance(loss, torch.Tensor) and loss.requires_grad):
                    self.workspace.release_loss()  # (no backward to end them)
                elif self.workspace.loss:
                    self.workspace.book_loss(self._loss_stages[1])
                if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
                    what = (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
                            else f"a {type(loss).__name__}")
                    raise TypeError(f"loss_fn returned {what}: it must return the loss as a one-element tensor "
                                    "(with its graph: no .item() or float())")
                if torch.is_grad_enabled() and self.updater.needs_grad and not loss.requires_grad:
                    raise UnsupportedModel("the loss depends on no trainable parameter (each is frozen, or in a "
                                           "module the forward never runs, e.g. a vision tower's on text): nothing "
                                           "would train")
                self.moments.counts["host_waits_forward"] += self.executor.host_waits - waits
                if self.tracker.offloader is not None:
                    self.tracker.offloader.end_forward()
        except BudgetExceeded as exc:
            raise self._budget_error(exc) from exc
        except BaseException as exc:  # (the loss function raised, or Ctrl-C): the step is dropped
            self._abort_cycle()
            if isinstance(exc, RuntimeError) and "same dtype" in str(exc) and self.compute_dtype != torch.float32:
                exc.add_note(f"tierwise: the weights compute in {self.compute_dtype} and the engine casts no "
                             "inputs: give floating inputs in that dtype (in the batch or in loss_fn)")
            raise
        return loss

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate `loss`; gradients accumulate (fp32) in their grad chunks. A failure
        (a budget, a rank that stopped) drops the step's gradients before it is raised."""
        self._check_open()
        # owned-only gradients: complete chunks are reduced during backward (the window of
        # transient buffers counts on it), in step() as in a caller's own forward/backward
        self.grads.reduce_on = self.owned_grads
        try:
            with self.moments.timed(Phase.BACKWARD):
                self.moments.moment()  # without recompute no module hook fires in backward: mark it
                self.grads.begin_backward()
                waits = self.executor.host_waits
                loss.backward()
                self.moments.counts["host_waits_backward"] += self.executor.host_waits - waits
                if self.tracker.offloader is not None:
                    self.tracker.offloader.end_backward()
                self.moments.moment()  # every gradient accumulated, before the drain
                self.grads.end_backward()
                if self.grads.uses is not None:  # (the first backward has taught the router its reads)
                    self.residency.stop_watching_homes()
        except BudgetExceeded as exc:
            raise self._budget_error(exc) from exc
        except BaseException:
            self._abort_cycle()
            raise
        finally:
            self.grads.reduce_on = False
            self.workspace.release_loss()  # (the head's input had no gradient, or backward failed)

    def _abort_cycle(self) -> bool:
        """Drop a failed step's gradients; True when its early updates (offload.engine.early) had not
        reached any chunk, so the weights are those of the last completed step."""
        intact = self.grads.abort()
        self.tracker.abandon()
        self.workspace.release_loss()
        drop_ahead(self._ahead)  # (after the worker: grads.abort waited for it)
        self._order_now = []
        self._in_cycle = False
        return intact

    def _budget_error(self, exc: BudgetExceeded) -> Exception:
        """A reservation failed mid-step: the step is dropped (_abort_cycle), and for the gpu
        offload.engine.overbudget says what it needed (the activations held when it failed)."""
        act = self.ledger.usage()["gpu"].get("activation", 0) + (exc.asked if exc.kind == "activation" else 0)
        intact = self._abort_cycle()
        if exc.tier != "gpu":
            return exc
        if self.minimum_gpu_bytes is None:  # the warm-up (or measure): nothing placed yet, every chunk streams
            pinned = 0 if self.units_are_blocks else self.residency.cache.pinned_peak  # (a block's, with blocks)
            minimum = self._device_needs(activations=act, pinned=pinned, units=self._plain_units).minimum
            return warmup_over_budget(exc, act, minimum, intact=intact, phase=str(self.moments.phase))
        return step_over_budget(exc, act, self.needs.activations, intact=intact)

    def step(self, batch: Any, *, grad_accum: int = 1) -> float:
        """Forward, backward and update on `batch`, split into `grad_accum` micro-batches.

        The step's loss is normalised by its target tokens (offload.engine.batches.step_weights):
        micro-batch i backpropagates loss_i * n_i / N (n_i its target tokens, N the step's), and
        the returned loss is the step's token mean, sum of loss_i * n_i / N."""
        self._check_open()
        if not (isinstance(grad_accum, numbers.Integral) and grad_accum >= 1):  # numpy's ints too
            raise ValueError(f"grad_accum must be an int >= 1, got {grad_accum!r}")
        if not self.updater.needs_grad:
            return self._zo_step(batch, grad_accum)
        try:
            return self._step(batch, grad_accum)
        except BaseException:
            if self._in_cycle:  # it failed between a forward and its backward (Ctrl-C, say): each
                self._abort_cycle()  # of those drops the step itself when it fails
            raise

    def _step(self, batch: Any, grad_accum: int) -> float:
        finite = True
        world = self.ranks.world if self.ranks is not None else 1
        micro = split_batch(batch, grad_accum * world)
        weights = step_weights(micro)
        terms = [0.0] * len(micro)  # micro-batch i's loss * weight, summed in i's order (_ordered_sums)
        held: list[torch.Tensor | None] = [None] * len(micro)
        mine = [i for i in range(len(micro)) if self.ranks is None or i % world == self.ranks.rank]
        for i in mine:
            mb = micro[i]
            loss = self.forward(mb)
            # weight 0 (no target token): HF's mean loss is nan (0/0) and counts for nothing;
            # its backward still runs (the ranks' collectives pair up) and gives zero gradients
            counted = weights[i] != 0.0
            if self.skip_nonfinite and counted:  # known before backward: no chunk may update early then
                finite = finite and bool(torch.isfinite(loss.detach()).all())
            # the last micro-batch's gradients are final: chunks may update as they complete
            # (once the first backward has counted each chunk's gradients)
            self.grads.early_on = (self.overlap_update and self.grad_clip is None
                                   and i == mine[-1] and self.grads.uses is not None and finite
                                   and not (self.ranks is not None and self.skip_nonfinite))
            if self.grads.early_on and self.ranks is None and self._order and self.bounce is not None:
                first, then = (self._order + [None])[:2]  # (the worker is idle: the last step waited for it)
                self.grads.early.ahead(lambda: read_ahead(self.store, self.bounce, self._ahead, first,
                                                          resident=self.residency.copy_master, then=then))
            try:
                self.backward(loss * weights[i] if weights[i] != 1.0 else loss)
            finally:
                self.grads.early_on = False
            if counted:  # (read after the loop: a read here would drain the device between micro-batches)
                held[i] = loss.detach()
        for i, t in enumerate(held):
            if t is not None:
                terms[i] = float(t) * weights[i]
        if self.ranks is not None:
            finite = self.ranks.all_true(finite, "checking the losses are finite")
        (total,) = self._ordered_sums([terms], "summing the loss")
        self.optimizer_step(skip=not finite)
        return total

    def rank_peaks(self) -> "list[dict[str, int]] | None":
        """Several ranks (a collective: every rank calls it): each rank's ledger peaks by tier,
        indexed by rank; None on one rank."""
        if self.ranks is None:
            return None
        tiers = list(TIERS)
        t = torch.zeros(self.ranks.world, len(tiers), dtype=torch.int64)
        peaks = self.ledger.peaks()
        t[self.ranks.rank] = torch.tensor([peaks.get(k, 0) for k in tiers], dtype=torch.int64)
        t = self.ranks.sum_(t, "gathering every rank's memory peaks")
        return [{k: int(v) for k, v in zip(tiers, row)} for row in t.tolist()]

    def _ordered_sums(self, lists: list[list[float]], what: str) -> list[float]:
        """Each list of per-micro-batch terms summed in micro-batch order, whatever the number
        of ranks: each rank fills its own entries (the others' are 0), the ranks sum the vectors
        in one collective (x + 0 is exact), then sequential float64 sums: N ranks report (and
        MeZO updates with) one rank's figures with grad_accum x N bit for bit (a sum of each
        rank's partial sums was not, from two micro-batches per rank on)."""
        if self.ranks is not None:
            flat = self.ranks.sum_(torch.tensor([t for ts in lists for t in ts], dtype=torch.float64), what).tolist()
            n = len(lists[0])
            lists = [flat[k * n:(k + 1) * n] for k in range(len(lists))]
        sums = []
        for terms in lists:
            total = 0.0
            for t in terms:
                total += t
            sums.append(total)
        return sums

    def _zo_step(self, batch: Any, grad_accum: int = 1) -> float:
        """MeZO: per micro-batch, one forward over the doubled rows gives both losses, all with
        the step's z; the step's two losses are the micro-batches' weighted by their target
        tokens (step_weights); then the update. Several ranks (DistZO2's idea): every rank
        draws the same z (the step seed), evaluates micro-batch i when i mod world is its rank,
        and only the two losses are summed over the ranks; each owner updates its chunks."""
        self._begin_cycle()
        world = self.ranks.world if self.ranks is not None else 1
        micro = split_batch(batch, grad_accum * world)
        weights = step_weights(micro)
        pos, neg = [0.0] * len(micro), [0.0] * len(micro)  # summed in micro-batch order
        with self.moments.timed(Phase.FORWARD):
            self.updater.begin_step()
            for i, mb in enumerate(micro):
                if self.ranks is not None and i % world != self.ranks.rank:
                    continue
                mb = to_device(mb, self.device)
                half = next(v for v in mb.values() if isinstance(v, torch.Tensor)).shape[0]
                self.zo_batch = half
                try:
                    if self._head_hook is not None:  # (the simulated device books the loss's transients)
                        head = headloss.causal_lm(self.model).get_output_embeddings()
                        self.workspace.book_loss(zo_loss_workspace(t=mb["labels"].numel(), vocab=head.out_features,
                                                                   e=head.weight.element_size()))
                    with torch.no_grad(), self.residency.reading():
                        loss_pos, loss_neg = hf_split_losses(self.model, mb, half)
                except BudgetExceeded as exc:  # (nothing updated yet: the step is dropped whole)
                    raise self._budget_error(exc) from exc
                finally:
                    self.zo_batch = None
                    self.workspace.release_loss()
                if weights[i] != 0.0:  # no target token: nan (0/0) that weighs nothing
                    pos[i], neg[i] = loss_pos * weights[i], loss_neg * weights[i]
            pos, neg = self._ordered_sums([pos, neg], "summing the MeZO losses")
            self.updater.projected_grad = (pos - neg) / (2.0 * self.updater.eps)
        finite = bool(torch.isfinite(torch.as_tensor([float(pos), float(neg)])).all())
        self.optimizer_step(skip=self.skip_nonfinite and not finite)
        return pos

    def optimizer_step(self, *, skip: bool = False) -> None:
        """Clip (optionally) and update every chunk; then the device copies are stale. `skip`
        (or, with skip_nonfinite, a NaN/inf gradient norm): no chunk is updated; the gradients
        of this cycle are overwritten by the next one's."""
        self._check_open()
        with self.moments.timed(Phase.UPDATE):
            self._update(skip=skip)
        if self.minimum_gpu_bytes is None:  # (later steps: _update has scheduled)
            self._after_warmup()
            self._schedule()

    def _update(self, *, skip: bool) -> None:
        early = self.grads.finish_step(self.params, zero_unseen=self.updater.needs_grad)
        if self.updater.needs_grad and self.ranks is None:
            skip = skip or not self.grads.seen  # no gradient at all (no backward): torch.optim does nothing
            # some got none: they sit this update out (several ranks: which did is known per rank
            # only; an early update's chunk had every gradient)
            self.updater.unseen = self._unseen if len(self.grads.seen) < self._trainable_count else None
        elif (self.updater.needs_grad and not skip and len(self.grads.seen) < self._trainable_count
              and not self._told_unseen):
            self._tell_unseen()
        rest = [c for c in range(len(self.plan.chunks)) if c not in early]
        if self.ranks is not None:
            if self.updater.needs_grad and not self.owned_grads:  # (owned: reduced in each backward)
                self._reduce_grads(rest, {})
            rest = [c for c in rest if self.ranks.owns(c)]
        if self.grad_clip is not None:
            sum_norms = None if self.ranks is None else (lambda t: self.ranks.sum_(t, "summing gradient norms"))
            self.last_grad_norm = self.store.clip_grads_(self.grad_clip, sum_norms=sum_norms,
                                                         unseen=getattr(self.updater, "unseen", None))
            skip = skip or (self.skip_nonfinite and not bool(torch.isfinite(self.last_grad_norm)))
        self.skipped_last = skip
        try:
            if not skip:
                update_all(self.store, self.updater, self.hyper, self.bounce, chunks=rest,
                           resident=self.residency.copy_master, carry=self._ahead,
                           refresh=self.residency.refresh_master, defer=True)
        finally:
            if hasattr(self.updater, "unseen"):  # (the next step's early updates: every gradient there)
                self.updater.unseen = None
        drop_ahead(self._ahead)
        self._order, self._order_now = self._order_now, []
        early.clear()
        self.grads.seen = set()  # (used: a second optimizer_step without a backward updates nothing)
        self.store.grad_scale = None
        # (a trace this step recorded is scheduled before the eviction: the step keeps the first
        # chunks of its schedule over its end, as any later one does)
        self.residency.follower.end_step()
        if self.minimum_gpu_bytes is not None:
            self._schedule()
        self.residency.evict_updated()
        self.moments.moment()
        self.tracker.end_step()
        self._in_cycle = False
        self.steps += 1
        self._steps_here += 1
        self.moments.end_step()
        self.moments.phase = Phase.IDLE

    def measure(self, batch: Any) -> int:
        """Forward and backward on `batch` with no update, before the first step, so that the
        placement covers it: the warm-up step places chunks for the largest activations seen
        so far (or checks the up-front `activations` against them). Give it the largest batch
        the run will see, e.g. a padded one (transformers then saves an attention mask that a
        full batch does without). Returns that activation peak in bytes (0 without backward).
        The model's buffers (BatchNorm's running statistics) and the RNG are left as they were:
        the run's numbers are those of a run without measure()."""
        self._check_open()
        if self.minimum_gpu_bytes is not None:
            raise ValueError("Engine.measure() comes before the first step: the chunks are placed after it")
        if self.updater.needs_grad:
            found = [(m, n, b, b.detach().to("cpu", copy=True)) for m in self.model.modules()
                     for n, b in m._buffers.items() if b is not None]
            cuda = [self.device] if self.device.type == "cuda" else []
            cache = self.residency.cache
            # placed for an estimate that `batch` may exceed: stream through (a failed CUDA
            # warm-up may have left the cache lowered: its saved limit is the real one)
            limit = cache.limit if self._warm_limit is None else self._warm_limit
            cache.limit = min(limit, self.needs.stream_window)  # the smallest window, so the peak
            with torch.random.fork_rng(devices=cuda):  # is the minimum whatever the timing
                try:
                    self.backward(self.forward(batch))
                finally:
                    self._abort_cycle()
                    cache.evict_all()
                    cache.limit, self._warm_limit = limit, None
                    self.workspace.end()  # the worst batch's allocator peak counts at placement
                    self.moments.reset()
                    with torch.no_grad():
                        for m, n, b, value in found:
                            m._buffers[n] = b
                            b.copy_(value)
        return self.ledger.kind_peak("gpu", "activation")

    def _begin_warmup(self) -> None:
        """CUDA: the warm-up streams through the smallest window (also when placed up front),
        so that the allocator's peak shows what the ledger does not book (offload.engine.workspace)."""
        self.workspace.begin()
        cache = self.residency.cache
        if self.workspace.cuda and self.device_plan is not None and self._warm_limit is None:
            self._warm_limit = cache.limit
            cache.limit = min(cache.limit, self.needs.stream_window)

    def _after_warmup(self) -> None:
        """Activations are known now: place chunks on the device as the budget allows."""
        if self._warm_limit is not None:
            self.residency.cache.limit, self._warm_limit = self._warm_limit, None
        act = self.ledger.kind_peak("gpu", "activation") + self.grads.gather_bytes + self.workspace.end()
        pinned = self.residency.cache.pinned_peak
        if self.ranks is not None:  # every rank places for the largest: the same cache, the same fetches
            act = self.ranks.max_int(act, "agreeing on the activation peak")
            pinned = self.ranks.max_int(pinned, "agreeing on the streaming window")
        # (the least budget with every block recomputed, whatever _keep_activations keeps below)
        self.minimum_gpu_bytes = self._device_needs(activations=act, pinned=0 if self.units_are_blocks else pinned,
                                                    units=self._plain_units).minimum
        if self.device_plan is not None:  # placed up front from an estimate: keep it if it holds
            limit = self._limit_for(act) if self.device_plan.decoded_home else None
            if limit is not None and limit < self.needs.stream_window:  # no room left to decode the base:
                log.info("activations above the estimate: the encoded base stays encoded (decoded per use)")
                self.device_plan = dataclasses.replace(self.device_plan, decoded_home=frozenset())
            self._hold_estimate(act)
            for cid in sorted(self.device_plan.decoded_home):  # (decoded now: the weights are in)
                self.residency.promote(cid, decoded=True)
            return
        act = self._keep_activations(act, pinned)
        if self._choose_units(act):  # the next step traces again, with the blocks as the units
            self._reinstall_unit_hooks()
            self.residency.follower.reset()
        self.needs = self._device_needs(activations=act, pinned=pinned)
        self.device_plan = plan_device(self.needs, self.ledger.budgets["gpu"], allow_gpu_home=self.allow_gpu_home,
                                       prefer=self._home_order(), decoded=self._decoded())
        for cid in sorted(self.device_plan.gpu_home):
            self.residency.promote(cid, decoded=cid in self.device_plan.decoded_home)
        self.tracker.forget()
        self.grads.placement_changed()
        self.residency.cache.limit = self.device_plan.cache_limit

    def _hold_estimate(self, act: int) -> None:
        """Chunks were placed for the estimated activations; more were measured: the cache of
        streamed chunks gives way to them, or (when it cannot) StepOverBudget now, after a
        completed step, rather than in the middle of a later one."""
        limit = self._limit_for(act)
        if limit is None:
            self.needs = dataclasses.replace(self.needs, activations=max(act, self.needs.activations))
            return
        budget = self.ledger.budgets["gpu"]
        assert budget is not None
        self.needs = dataclasses.replace(self.needs, activations=act)
        over = self.residency.cache.limit - limit
        if limit < self.needs.stream_window:
            raise estimate_over_budget(budget, act, over, need=budget + self.needs.stream_window - limit)
        log.info("activations %s above the estimate: the stream cache shrinks to %s", format_size(over),
                 format_size(limit))
        self.residency.cache.limit = limit
        self.device_plan = dataclasses.replace(self.device_plan, cache_limit=limit)

    def _limit_for(self, act: int) -> int | None:
        """The stream cache's limit that leaves room for `act` bytes of activations beside the
        placement (below the streaming window: it cannot); None when no change is needed."""
        over = act - self.needs.activations
        budget = self.ledger.budgets["gpu"]
        if over <= 0 or budget is None:
            return None
        over -= max(budget - self._placed_bytes(), 0)  # e.g. every chunk gpu-home with room to spare
        return None if over <= 0 else self.residency.cache.limit - over

    def _placed_bytes(self) -> int:
        """Device bytes the placement spends: buffers, gradient reserve, activations, gpu-home
        chunks and the stream cache (which holds the streaming window). Equal to the budget
        unless every chunk fits whole, when the rest is left free."""
        n = self.needs
        home = self.device_plan.home_cost(n)
        return n.buffers + n.grad_reserve + n.activations + home + self.residency.cache.limit

    def _schedule(self) -> None:
        """A trace was just recorded (or the placement changed): plan fetches and evictions."""
        self.residency.schedule(self.prefetch_depth)

    # -- weights in and out ----------------------------------------------------------------
    def set_lr(self, lr: float) -> None:
        check_lr(lr)
        self.hyper.lr = lr

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (name, tensor) pairs into their slots, one at a time (meta-device models)."""
        self._check_open()
        self.residency.cache.evict_all()  # a compute copy kept over a step's end would be stale
        self.store.load(self._setting(named_tensors), self.params)

    def _setting(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named_tensors:
            self._unset.discard(name)
            yield name, tensor

    def init_weights_(self, *, seed: int = 0, std: float = 0.02, frozen_only: bool = False,
                      device: "str | torch.device" = "cpu") -> None:
        """Random initialisation in place, chunk by chunk: N(0, std) for matrices, ones for
        norm weights, zeros for biases (the Llama convention). For benchmarking and demos.
        `frozen_only`: the frozen parameters only (a LoRA base; the adapters keep PEFT's init).
        `device`: where each tensor is drawn (and an encoded base encoded) before it is stored:
        "cuda" for a base of tens of billions of parameters (the CPU takes minutes); the
        numbers then come from the device's generator, not the CPU's."""
        self._check_open()
        g = torch.Generator(device=device).manual_seed(seed)

        def tensors():
            for name, slot in self.plan.slots.items():
                if frozen_only and not self.plan.is_frozen(slot.chunk):
                    continue
                if len(slot.shape) >= 2:
                    yield name, torch.empty(slot.shape, device=device).normal_(0.0, std, generator=g)
                elif "norm" in name:
                    yield name, torch.ones(slot.shape, device=device)
                else:
                    yield name, torch.zeros(slot.shape, device=device)

        self.load_weights(tensors())

    @torch.no_grad()
    def eval_loss(self, batch: Any) -> float:
        """The loss on `batch` without gradients (no update, nothing kept for backward), in eval
        mode (no dropout: e.g. LoRA's), as a model evaluated in plain PyTorch. A batch whose
        loss's transients do not fit beside the placement (an eval batch larger than the
        training's micro-batch) runs in parts of equal rows, their losses weighted by their
        target tokens as gradient accumulation weighs them."""
        self._check_open()
        self._check_set()
        phase, training = self.moments.phase, self.model.training
        self.moments.phase = Phase.EVAL
        self.model.eval()
        if self.shared is not None:
            self.shared.ready()
        try:
            try:
                parts = split_batch(batch, self._eval_parts(batch))
            except (TypeError, ValueError):  # (values that do not split by rows: one part)
                parts = [batch]
            if len(parts) == 1:
                return self._eval_one(batch)
            return float(sum(self._eval_one(part) * w for part, w in zip(parts, step_weights(parts)) if w))
        finally:
            self.model.train(training)
            self.moments.phase = phase
            self.residency.cache.evict_all()  # the schedule of the next step starts from an empty cache

    def _eval_one(self, batch: Any) -> float:
        try:
            if self._head_hook is not None:  # (the simulated device books the loss's transients)
                self.workspace.book_loss(headloss.workspace(self.model, batch, False)[0])
            with self.residency.reading():
                return float(self.loss_fn(self.model, to_device(batch, self.device)).float().item())
        finally:
            self.workspace.release_loss()

    def _eval_parts(self, batch: Any) -> int:
        """Into how many parts eval splits `batch`: the fewest whose default loss's transients fit
        the device budget beside what it holds now and the stream cache's room to fill."""
        labels = batch.get("labels") if isinstance(batch, Mapping) else None
        budget = self.ledger.budgets["gpu"]
        if self.loss_fn is not default_loss or budget is None or not isinstance(labels, torch.Tensor) \
                or labels.dim() != 2:
            return 1
        cache = self.residency.cache
        room = budget - self.ledger.used("gpu") - max(0, cache.limit - cache.bytes)
        rows = labels.shape[0]
        k = next(k for k in range(1, rows + 1) if rows % k == 0 and (k == rows or headloss.workspace(
            self.model, {"labels": labels[:rows // k]}, False)[0] <= room))
        if self.ranks is not None:  # (eval is collective: every rank runs as many parts, or one)
            seen = gather_objects((rows, k), "agreeing how to split an eval batch")
            k = max(p for _, p in seen) if len({r for r, _ in seen}) == 1 else 1
        return k

    def named_parameters_fp32(self, *, trainable_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, fp32 CPU tensor) for every parameter, from the master copies (frozen ones
        as the model computes with them: decoded in the compute dtype); `trainable_only`: the trainable ones (e.g. LoRA adapters), no frozen chunk read.
        Several ranks: collective (every rank iterates it all); each chunk comes from its owner."""
        self._check_open()
        if self.ranks is None:
            yield from self.store.named_master(self.params, trainable_only=trainable_only)
            return
        if self.shared is not None:
            self.shared.ready()
        for cid, ch in enumerate(self.store.chunks):
            if cid in self.plan.frozen:
                if not trainable_only:
                    yield from self.store.named_chunk(cid)
                continue
            flat = torch.empty(self.plan.chunks[cid].numel, dtype=torch.float32)
            if self.ranks.owns(cid):
                with self.store.opened(cid, only=("master",)) as work:
                    flat.copy_(work["master"])
            self.ranks.broadcast_from_owner(cid, flat)
            for name in ch.names:
                view = self.plan.slots[name].view(flat)
                yield name, view.to("cpu", copy=True, memory_format=torch.contiguous_format)

    def state_dict(self, *, deferred: bool = False) -> dict[str, Any]:
        """Weights, optimizer state, step count and the model's persistent buffers (BatchNorm's
        running statistics change in training too). Several ranks: this rank's shard (the
        master and optimizer state of the chunks it owns; `rank` and `world` say whose), not
        collective; each rank loads its own shard back with the same world size.
        `deferred`: the chunks' tensors are offload.runtime.lazy.Deferred, read one chunk at a
        time by whoever writes them (a checkpoint never holds the whole state in RAM).
        load_state_dict takes tensors or stored ones (`read_into`), chunk by chunk."""
        self._check_open()
        buffers = {n: b.to("cpu", copy=True) for n, b in self.surgery.persistent_buffers().items()}
        shard = {} if self.ranks is None else {"rank": self.ranks.rank, "world": self.ranks.world}
        if self.owned_grads and self.grads.uses is not None:  # a resumed run reduces as this one does
            shard["grad_uses"] = dict(self.grads.uses)
        return self.store.state_dict(deferred=deferred) | {"steps": self.steps, "optimizer": self.optimizer_name,
                                          "optimizer_meta": self.updater.meta_state(),
                                          "missed": dict(getattr(self.updater, "missed", {})),
                                          "buffers": buffers} | shard

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._check_open()
        mine = (None, None) if self.ranks is None else (self.ranks.rank, self.ranks.world)
        if (sd.get("rank"), sd.get("world")) != mine:  # ValueError: the CLI names the checkpoint
            def who(r, w):
                return "one rank" if w is None else f"rank {r} of {w}"
            raise ValueError(f"it is the state of {who(*[sd.get('rank'), sd.get('world')])}, "
                             f"this engine is {who(*mine)}")
        saved = sd.get("optimizer")  # (absent from checkpoints written before it was recorded)
        if saved is not None and saved != self.optimizer_name:  # a state blob of the same size would load
            raise ValueError(f"it is the state of optimizer {saved!r}, this engine runs {self.optimizer_name!r}")
        own = self.surgery.persistent_buffers()
        unknown = sorted(set(sd.get("buffers", {})) - set(own))
        if unknown:
            raise ValueError(f"checkpoint has buffers this model lacks: {unknown[:3]}")
        self.residency.cache.evict_all()
        self.store.load_state_dict(sd)
        self._unset -= {n for n, slot in self.plan.slots.items() if not self.plan.is_frozen(slot.chunk)}
        self.updater.load_meta_state(sd.get("optimizer_meta", {}))
        if hasattr(self.updater, "missed"):
            self.updater.missed = dict(sd.get("missed", {}))
        self.steps = int(sd["steps"])
        if self.owned_grads and sd.get("grad_uses") is not None:
            # the first backward then reduces whole chunks, as the interrupted run's did: a sum of
            # three ranks is summed in the same order only over the same buffers
            self.grads._learn_uses(sd["grad_uses"])
        with torch.no_grad():
            for name, value in sd.get("buffers", {}).items():
                own[name].copy_(value)

    @property
    def closed(self) -> bool:
        """close() has run: the model's parameters are meta tensors (or what was assigned since)."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:  # (its parameters are meta tensors now: the error would name a device)
            raise RuntimeError("this Engine is closed: build a new one to go on training")

    def close(self) -> None:
        """Stop the copy threads, remove the swap files, the hooks and the patched forwards.
        The model's parameters become meta tensors (shared ones stay shared): read the trained
        weights with named_parameters_fp32 before closing, and load_state_dict(..., assign=True)
        to use the model again. Closing twice does nothing."""
        if self._closed:
            return
        self.executor.drain()
        self.residency.cache.evict_all()  # (the next step's first chunks, kept over the last step's end)
        self.executor.close()
        self.residency.cache.drop_spares()
        if self.grads.early is not None:
            self.grads.early.close()
        if self.grads.transient is not None:
            self.grads.transient.free_all()
        if self.nvme is not None:
            self.nvme.close()
        if self.tracker.offloader is not None:
            self.tracker.offloader.trim()  # (its spare host buffers)
        self.tiers.close()  # host memory stays registered no longer than the engine
        self.surgery.close()
        if self.shared is not None:
            self.shared.close()
        if self.ranks is not None:
            self.ranks.close()
        self.residency.restore_classes()
        # no placeholder values left: a use of the closed model fails loudly (meta tensors)
        self.surgery.to_meta(self.params.values())
        self._closed = True
