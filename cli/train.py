"""The training run behind `finetune`: data, engine, loop, checkpoints, export, plots.

Over 600 lines: one run's whole life (inputs checked, the pre-flight, the engine, resume, the
loop with its refusals, checkpoints and eval, the export) in the order it happens; what each
step needs lives in its own module (data, checkpoint, layout, lora, merge, progress, report)."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Protocol, runtime_checkable

import numpy as np
import torch
from rich.console import Console

from . import checkpoint as ckpt
from . import diskspace, launch, rundir, shards
from . import lora as lora_mod
from .config import DISK_FULL, ConfigError, TrainConfig
from .data import (Batches, DataError, DataPosition, check_vocab, eval_batches, has_padding, isolates, load_blocks,
                   padded_batch)
from .export import export_hf
from .layout import ModelLayout, iter_checkpoint, plan_checkpoint
from .loading import ModelSource, build_meta_model, resolve_model
from .metrics import MetricsWriter, read_metrics, truncate_metrics
from .packing import keeps_mask
from .planning import (AUTO_OFFLOADED, OFFLOADED, attends_segments, check_seq_len, check_tower, checkpointing, gpu_budget,
                       host_budget, preflight,
                       resolve_offload, resolve_recompute)
from .plots import plot_loss, plot_timeline, preload as preload_plots
from .progress import TrainProgress
from .report import phase_delta, summary, warmup_report
from .schedule import LRSchedule
from ..offload.core.encoding import fused_experts
from ..offload.core.errors import InfeasibleBudget, StepOverBudget, TierwiseError
from ..offload.core.options import Activations, Budget, Distributed, Optim, Precision
from ..offload.core.sizes import parse_size
from ..offload.runtime import lazy

log = logging.getLogger(__name__)
EXIT_INTERRUPTED = 130  # 128 + SIGINT; SIGTERM 143, SIGHUP 129


@runtime_checkable
class TrainingEngine(Protocol):
    """What `finetune` needs from an engine: offload.Engine is one (tests substitute a
    stand-in through `engine_class`). Everything here is called unconditionally."""

    ledger: Any  # .peaks() -> {tier: bytes}, .usage()
    phase_times: dict[str, float]  # cumulative seconds per phase
    timeline: list[dict]  # the memory timeline of the last recorded step
    device_plan: Any  # None until chunks are placed for a known activation peak
    skip_nonfinite: bool  # set by the CLI: a NaN/inf step updates nothing
    skipped_last: bool  # the last step was skipped so
    last_grad_norm: Any  # with grad_clip: the last step's global gradient norm, else None
    nvme: Any  # its NvmeStore (.notices: stale swap directories it removed), or None

    def set_lr(self, lr: float) -> None: ...
    def step(self, batch: dict, grad_accum: int = 1) -> float: ...
    def eval_loss(self, batch: dict) -> float: ...
    def measure(self, batch: dict) -> None: ...
    def load_weights(self, named: Iterable) -> None: ...
    def init_weights_(self, *, seed: int = 0, std: float = 0.02, frozen_only: bool = False) -> None: ...
    def state_dict(self, *, deferred: bool = False) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...
    def named_parameters_fp32(self, *, trainable_only: bool = False) -> Iterator: ...
    def close(self) -> None: ...


def engine_class() -> Callable[..., TrainingEngine]:
    """offload.Engine (tests replace this function with a stand-in)."""
    from ..offload import Engine

    return Engine


def make_engine(model: torch.nn.Module, cfg: TrainConfig, *, ranks: "launch.RankInfo | None" = None,
                plan: "Any" = None) -> TrainingEngine:
    """Engine(model, ...) from the config: its options objects (offload.core.options), each
    passed only where it differs from the engine's default.
    `plan`: the pre-flight's plan of this run (cli.planning.preflight, for its worst batch):
    the engine places chunks up front for its activations (LoRA's and its dropout's included);
    None (a family the planner does not price): the engine measures them in its warm-up.

    The engine's own checks of its options (ValueError: an optimizer it has no chunk updater
    for, a chunk size below its minimum, ...) become one-line user errors.
    """
    ranks = ranks or launch.from_env()  # several ranks on a node share its host and CXL budgets
    lora = bool(cfg.lora)  # the model carries its adapters already (cli.lora.inject): the engine takes it as is
    try:
        options = dict(  # --hardware is the planner's (link speeds), not the engine's
            budget=Budget(gpu=gpu_budget(cfg), cpu=_host_share(cfg, ranks, plan),
                          cxl=launch.node_share(cfg.budgets["cxl"], ranks), nvme=cfg.nvme_path,
                          chunk=cfg.budgets["chunk"], cxl_node=cfg.cxl_node,
                          nvme_checksum=cfg.nvme_checksum and cfg.nvme_path is not None),
            optim=Optim(cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip),
            precision=Precision(cfg.precision, base=cfg.base_dtype if lora else None,
                                double_quant=lora and cfg.base_dtype == "nf4"),  # the QLoRA recipe
            activations=Activations(recompute=checkpointing(cfg), offload=bool(cfg.offload_activations),
                                    expected=None if plan is None else plan.reserve["gpu"]["activations"],
                                    host=_host_activations(plan, ranks),
                                    cxl=0 if plan is None else plan.reserve.get("cxl", {}).get("activations", 0),
                                    nvme=0 if plan is None else plan.reserve.get("nvme", {}).get("activations", 0)),
            distributed=Distributed(grad_reduce=cfg.grad_reduce))
    except ValueError as e:
        raise ConfigError(f"the engine cannot run with these options: {e}") from None
    kwargs = {k: v for k, v in options.items() if v != type(v)()}
    try:
        return engine_class()(model, **kwargs)
    except ValueError as e:
        if isinstance(e, TierwiseError):
            raise
        raise ConfigError(f"the engine cannot run with these options: {e}") from None


def _host_share(cfg: TrainConfig, ranks: "launch.RankInfo", plan: Any) -> "int | None":
    """This rank's part of the node's --cpu-mem: as the preflight's plan shares it (by each
    rank's minimum: the owner of an embedding needs more), else an even part."""
    shares = getattr(getattr(plan, "ranks", None), "host_shares", None)
    if ranks.several and shares and len(shares) == ranks.local_world:
        return shares[ranks.local_rank] + _host_activations(plan, ranks)  # (the shares are of the chunks')
    return launch.node_share(host_budget(cfg), ranks)


def _host_activations(plan: Any, ranks: "launch.RankInfo") -> int:
    """This rank's offloaded activations in host memory, as the plan books them for the node."""
    node = 0 if plan is None else plan.reserve["host"].get("activations", 0)
    return node // ranks.local_world if ranks.several else node


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class _StopFlag:
    """The first SIGINT (Ctrl-C), SIGTERM (a scheduler, `docker stop`) or SIGHUP (a closed
    terminal) sets the flag: finish the step, checkpoint, clean up, exit 128 + the signal's
    number. A second one aborts (KeyboardInterrupt: the swap files are still removed)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self):
        self.signum = 0
        self._previous: dict = {}

    @property
    def set(self) -> bool:
        return self.signum != 0

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
            self._hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
        return self

    def _handle(self, signum, frame):
        if self.set:
            raise KeyboardInterrupt
        self.signum = signum

    def _unraisable(self, what) -> None:
        """The abort raised inside a finalizer (a tensor freed mid-step) is printed there with a
        traceback and dropped: say nothing, and raise it again a moment later."""
        if what.exc_type is KeyboardInterrupt and self.set:
            threading.Timer(0.01, os.kill, (os.getpid(), signal.SIGINT)).start()
        else:
            self._hook(what)

    def __exit__(self, *exc):
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        if self._previous:
            sys.unraisablehook = self._hook
        if exc[0] is not None and launch.from_env().several:
            launch.finish_failing()


def warn(console: Console, text: str) -> None:
    console.print(f"[bold yellow]warning:[/] {text}", soft_wrap=True, highlight=False)


def run(cfg: TrainConfig, *, console: Console) -> int:
    """Train as configured; returns the process exit code (0; 130 after Ctrl-C, 143 after
    SIGTERM, 129 after SIGHUP: each checkpointed first)."""
    if cfg.dry_run:
        from .planning import dry_run

        return dry_run(cfg, console=console, resuming=_resumable if cfg.resume else None)
    ranks = launch.from_env()
    if cfg.resume:  # before the ranks meet: the launcher's check, for torchrun started by hand
        check_world(Path(cfg.output), ranks.world)
    if ranks.several:
        launch.init_group(ranks)
        if not ranks.main:
            console = Console(quiet=True)  # rank 0 prints; the others only their errors (stderr)
        try:
            return _run(cfg, console=console, ranks=ranks)
        except Exception as exc:
            from ..offload.engine.ranks import RankFailure

            launch.finish_failing()
            if not isinstance(exc, RankFailure):  # this rank is the cause: say why, for the others
                launch.report_failure(ranks, exc)
                raise
            cause = launch.failure_of_others(ranks)
            if cause is None:
                raise
            raise RankFailure(f"{cause}; {exc}") from exc
        finally:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
    return _run(cfg, console=console, ranks=ranks)


def _run(cfg: TrainConfig, *, console: Console, ranks: "launch.RankInfo") -> int:
    ranks = launch.on_node(ranks)  # the node's ranks as the engine counts them
    auto, auto_offload = cfg.recompute is None and cfg.recompute_layers is None, cfg.offload_activations is None
    chosen = cfg.precision_note  # (a TrainConfig replaced below resolves none: its precision is set)
    refusal = plan = None
    try:  # inputs, then what `plan` refuses, before allocating; several ranks: all together
        src, blocks, eval_data, padded, cfg = _checked_inputs(cfg, console=console, ranks=ranks)
        # several ranks: every rank draws the same whole step (micro-batch i runs on rank i mod N)
        batches = Batches(blocks, batch_size=cfg.batch_size * cfg.grad_accum * ranks.world, seed=cfg.seed,
                          mask=keeps_mask(src.config))
        batches.digest  # one pass over the blocks now, not inside an interrupted run's last save
        plan = preflight(cfg, src=src, padded=padded, ranks=ranks)
    except InfeasibleBudget as e:
        layout = (f" --nproc-per-node {ranks.local_world}" + (f" --nnodes {max(1, ranks.world // ranks.local_world)}"
                                                              if ranks.world > ranks.local_world else "")
                  if ranks.several else "")
        offloaded = AUTO_OFFLOADED if auto_offload and cfg.offload_activations else ""
        refusal = InfeasibleBudget(f"{str(e).splitlines()[0]}{offloaded} (`finetune plan{layout}` with the same "
                                   "model, data, batch and budget options lists changes that fit)", minimum=e.minimum)
    except TierwiseError as e:
        refusal = e
    launch.agree(ranks, refusal, "agreeing on the pre-flight check")
    claimed = _claim_output(cfg, ranks)  # (a refusal of --output before the run's lines)
    if auto and not cfg.recompute and cfg.optimizer != "mezo":
        console.print("activations: kept for backward, no recompute (the GPU budget holds them; "
                      "--recompute saves GPU memory)", highlight=False)
    elif auto and cfg.recompute_layers is not None:
        of = f" of {plan.layers}" if plan is not None else ""
        console.print(f"activations: the first {cfg.recompute_layers}{of} decoder layers recomputed in backward, the "
                      "others' kept (the fastest plan that fits; --recompute recomputes all)", highlight=False)
    if auto_offload and cfg.offload_activations:
        console.print(OFFLOADED, highlight=False)
    if chosen and refusal is None:
        console.print(f"precision: {chosen}", highlight=False, soft_wrap=True)
    if refusal is None and blocks and len(blocks[0]) > 3:
        console.print("packing: each document attends only to itself (position ids from 0 in each; --no-pack: "
                      "a document a block)",
                      highlight=False)
    if cfg.model is None:
        console.print("no --model: training the built-in tiny model"
                      + (" on the built-in sample (a demo)" if cfg.data is None else ""),
                      highlight=False)
    if cfg.data is None:
        if cfg.model is not None:
            warn(console, "no --data: training on the built-in toy sample")
    if ranks.several:
        console.print(f"{ranks.world} ranks ({ranks.local_world} on this node): each step is "
                      f"{cfg.grad_accum * ranks.world} micro-batches, micro-batch i on rank i mod {ranks.world}; "
                      "each rank checkpoints its shard", highlight=False)
        if not ranks.main:  # rank 0 owns --output; the others write into a scratch directory
            with launch.rank_scratch(ranks.rank) as scratch:
                return _train(cfg, src=src, blocks=blocks, batches=batches, eval_data=eval_data,
                              padded=padded, out=scratch, console=console, ranks=ranks, plan=plan)
    try:
        return _train(cfg, src=src, blocks=blocks, batches=batches, eval_data=eval_data,
                      padded=padded, out=claimed.path, console=console, ranks=ranks, plan=plan)
    finally:
        claimed.release()


def _claim_output(cfg: TrainConfig, ranks: "launch.RankInfo") -> "rundir.RunDir | None":
    """Rank 0 claims --output, after every input is validated (--overwrite deletes) and held
    until the run ends; several ranks agree on it, so a refusal (a non-empty --output, one in
    use) stops them all in one line, exit 2 (before: rank 0 alone exited, torchrun SIGTERMed
    the others and printed its failure summary)."""
    claimed = refusal = None
    if ranks.main:
        try:
            claimed = rundir.claim(cfg.output, resume=cfg.resume, overwrite=cfg.overwrite,
                                   inputs={"--model": cfg.model, "--data": cfg.data,
                                           "--eval-data": cfg.eval_data}, swap=cfg.nvme_path)
        except TierwiseError as e:
            refusal = e
    try:
        launch.agree(ranks, refusal, "claiming --output")
    except BaseException:
        if claimed is not None:
            claimed.release()
        raise
    return claimed


def _checked_inputs(cfg: TrainConfig, *, console: Console, ranks: "launch.RankInfo | None" = None) -> tuple:
    """The model, its data and the options checked against them (each a one-line error):
    (src, blocks, eval batches, padded, cfg with recompute resolved)."""
    if cfg.hardware:
        from ..profiles import load_hardware_profile

        load_hardware_profile(cfg.hardware)  # an unknown name is an error naming the known ones
    src = resolve_model(cfg.model, trust_remote_code=cfg.trust_remote_code)
    if src.note:
        warn(console, src.note)
    beyond = check_seq_len(cfg, src)  # (refused here for learned positions)
    if beyond:
        warn(console, beyond.removeprefix("note: "))
    blocks = load_blocks(cfg.data, src.tokenizer, seq_len=cfg.seq_len, pack=cfg.pack,
                         isolate=isolates(src.config, pack=cfg.pack))
    check_vocab(blocks, src)
    check_tower(cfg, src, ranks=ranks)
    eval_data = (eval_batches(load_blocks(cfg.eval_data, src.tokenizer, seq_len=cfg.seq_len,
                                          pack=cfg.pack, isolate=isolates(src.config, pack=cfg.pack)),
                              batch_size=cfg.batch_size, mask=keeps_mask(src.config))
                 if cfg.eval_data else [])
    if cfg.eval_data and not eval_data:  # else no eval at all, and nothing would say so
        raise DataError(f"--eval-data {cfg.eval_data}: no block with a target token (every label masked, "
                        "e.g. prompts longer than --seq-len): nothing to evaluate")
    if cfg.report_to != "none":
        import importlib.util

        from .metrics import REPORT_MODULES

        if importlib.util.find_spec(REPORT_MODULES[cfg.report_to]) is None:
            raise ConfigError(f"--report-to {cfg.report_to} needs the {REPORT_MODULES[cfg.report_to]} package: "
                              f"pip install {REPORT_MODULES[cfg.report_to]}")
    if cfg.lora:  # a --lora-targets name no module has: refused before anything is written
        from .loading import build_meta_model

        meta = build_meta_model(src.config)
        lora_mod.check_targets(meta, cfg.target_list())
        lora_mod.check_base_dtype(meta, cfg)
    # then the worst step is one with a dense attention mask: planned for
    padded = has_padding(blocks, segments=attends_segments(cfg, src), mask=keeps_mask(src.config))
    cfg = resolve_offload(resolve_recompute(cfg, src=src, padded=padded), src=src, padded=padded,
                          ranks=ranks if ranks is not None and ranks.several else False)
    if cfg.resume and ckpt.latest_checkpoint(cfg.output) is not None:  # a changed option or base says so
        check_resumable(cfg, Path(cfg.output), base=lora_base(cfg, src))  # before any budget does
    return src, blocks, eval_data, padded, cfg


def _train(cfg: TrainConfig, *, src: ModelSource, blocks: list, batches: Batches, eval_data: list,
           padded: bool, out: Path, console: Console, ranks: "launch.RankInfo", plan: Any = None) -> int:
    """The run in its claimed --output: engine, loop, export (`plan`: the pre-flight's, or None)."""
    total = cfg.steps or (cfg.epochs or 1) * batches.batches_per_epoch
    schedule = LRSchedule(kind=cfg.schedule, base_lr=cfg.lr, warmup_steps=cfg.warmup_steps,
                          total_steps=total)
    seed_everything(cfg.seed)
    model = build_meta_model(src.config)
    layout = ModelLayout.of(model)  # names, shapes and ties, before the engine takes the model
    renames: dict[str, str] = {}
    if cfg.lora:  # adapters as PEFT makes them after torch.manual_seed(seed); the base stays meta
        renames = lora_mod.inject(model, lora_mod.lora_config(cfg, base=_base_name(src)), seed=cfg.seed)
        console.print(lora_mod.summary(cfg, model), highlight=False, soft_wrap=True)
        if cfg.precision_note:
            console.print(cfg.precision_note, highlight=False, soft_wrap=True)
    preload_plots()
    engine = make_engine(model, cfg, ranks=ranks, plan=plan)
    engine.skip_nonfinite = bool(cfg.skip_nonfinite)
    for note in engine.nvme.notices if engine.nvme is not None else []:
        warn(console, note)
    try:
        _check_output_space(engine, cfg, out, model=model, total=total)
        start = _initial_state(engine, cfg, src, out, batches, console, model=model,
                               layout=layout, renames=renames, schedule=schedule)
        if padded:
            _measure_worst(engine, padded_batch(blocks, batch_size=cfg.batch_size, segments=attends_segments(cfg, src),
                                                mask=keeps_mask(src.config)))
        losses: list[float | None] = []
        times: list[float] = []
        t0 = time.perf_counter()
        code = _loop(engine, cfg, src=src, out=out, batches=batches, schedule=schedule,
                     start=start, total=total, eval_data=eval_data, console=console,
                     losses=losses, times=times, padded=padded,
                     intro=_intro(batches, start=start, total=total, plan=plan, lora=bool(cfg.lora)))
        console.print(summary(losses, first_step=start + 1, seconds=time.perf_counter() - t0, step_seconds=sum(times)),
                      highlight=False, soft_wrap=True)
        if code == 0:
            _finish(engine, cfg, src, out, console, model=model, layout=layout)
        return code
    except OSError as e:
        if e.errno not in DISK_FULL:
            raise
        last = ckpt.latest_checkpoint(out)
        hint = (f"; checkpoint {last.name} is intact: free space, then rerun with --resume"
                if last else "")
        raise DiskFullError(f"disk full ({e.strerror}) while writing {e.filename or out}"
                            f"{hint}") from None
    finally:
        engine.close()


class NonFiniteLoss(TierwiseError):
    """A step's loss or gradient norm is NaN or infinite: the weights can no longer be trusted.
    With several ranks both figures are the step's, summed over the ranks: every rank raises it."""

    every_rank = True


def _nonfinite(engine, loss: float) -> tuple[str, float] | None:
    """("loss" | "gradient norm", value) when the step's loss or gradient norm is NaN/inf."""
    norm = engine.last_grad_norm
    norm = float(norm) if norm is not None else None
    return ("loss", loss) if not math.isfinite(loss) else (
        ("gradient norm", norm) if norm is not None and not math.isfinite(norm) else None)


def _check_finite(engine, loss: float, out: Path, *, step: int, in_a_row: int = 0) -> None:
    """Stop on a NaN/inf loss or gradient norm before anything of that step is saved
    (`in_a_row`: the steps just skipped for it with --skip-nonfinite)."""
    bad = _nonfinite(engine, loss)
    if bad is None:
        return
    last = ckpt.latest_checkpoint(out)
    kept = (f"the last good checkpoint {last.name} is kept: --resume continues from it"
            if last else "no checkpoint was saved before it")
    again = f" after {in_a_row} skipped steps in a row (--skip-nonfinite)" if in_a_row else ""
    raise NonFiniteLoss(f"step {step}: the {bad[0]} is {bad[1]}{again}: training stopped and "
                        f"nothing of this step was saved; {kept} (a lower --lr or --grad-clip may help)")


class DiskFullError(TierwiseError):
    """No room to write a checkpoint, metrics or the exported model."""


def _measure_worst(engine, batch: dict) -> None:
    """An engine that places its chunks after the warm-up step (no activation estimate for
    this model family) first runs the worst batch without updating (Engine.measure), so the
    placement holds for every step. measure() leaves the RNG as it was: --resume replays exactly."""
    if engine.device_plan is not None:
        return  # placed up front for the worst batch already (the pre-flight plan's activations)
    engine.measure(batch)


def _base_name(src: ModelSource) -> str:
    """The base model an adapter belongs to (adapter_config.json's base_model_name_or_path)."""
    return str(Path(src.model_dir).resolve()) if src.has_weights else src.name


def _load_base(engine, cfg: TrainConfig, src: ModelSource, *, model, layout: ModelLayout,
               renames: dict[str, str], frozen_only: bool = False) -> None:
    """The checkpoint's weights (under the adapted model's names: `renames`), or a seeded random
    initialisation of a model without weights (`frozen_only`: the base only, the adapters keep
    PEFT's initialisation). Frozen chunks are encoded as they stream in (--base-dtype)."""
    if src.has_weights:
        engine.load_weights(lora_mod.renamed(iter_checkpoint(model, layout, src.model_dir), renames))
    else:
        std = getattr(src.config, "initializer_range", 0.02)
        if frozen_only:
            engine.init_weights_(seed=cfg.seed, std=std, frozen_only=True)
        else:
            engine.init_weights_(seed=cfg.seed, std=std)


def _check_output_space(engine, cfg: TrainConfig, out: Path, *, model, total: int) -> None:
    """Refuse, before the weights are read, a run whose checkpoints and export would not fit
    where they go (cli.diskspace). Several ranks: every shard goes to the shared --output, so
    their sizes are summed (a collective), and the ranks agree on the outcome."""
    ranks = launch.from_env()
    where = ckpt_dir(cfg, out)
    latest = ckpt.latest_checkpoint(where) if cfg.resume else None
    start = int(latest.name.removeprefix("ckpt-")) if latest is not None else 0  # (its name is its step)
    lora = bool(cfg.lora)
    dtype = _TORCH_DTYPES[cfg.export_dtype or ("fp32" if lora else cfg.precision)]
    nvme = engine.nvme
    tensors = diskspace.state_bytes(engine.state_dict(deferred=True))
    if ranks.several:
        from ..offload.engine.ranks import gather_objects

        tensors = sum(gather_objects(tensors, "summing the checkpoint's shards"))
    refusal = None
    try:
        diskspace.check(where, tensors=tensors, start=start, total=total,
                        every=cfg.checkpoint_every, keep=cfg.keep_checkpoints, lora=lora,
                        export=diskspace.export_bytes(model, dtype=dtype, trainable_only=lora) if ranks.main else 0,
                        nvme_dir=None if nvme is None else nvme.directory,
                        nvme_pending=0 if nvme is None else nvme.pending_bytes())
    except diskspace.OutputSpaceError as e:
        refusal = e
    launch.agree(ranks, refusal, "checking the output's free space")


def _initial_state(engine, cfg: TrainConfig, src: ModelSource, out: Path, batches: Batches,
                   console: Console, *, model, layout: ModelLayout, renames: dict[str, str] | None = None,
                   schedule: LRSchedule | None = None) -> int:
    """Load a checkpoint (--resume) or the weights; returns the first step to run.

    The weights stream from `src`'s checkpoint through transformers' key renaming and tensor
    conversions (cli.layout); with --resume only its names are read, so the export writes the
    same layout as an uninterrupted run. A LoRA checkpoint holds the adapters and their state
    only: the frozen base is loaded from `src` again first."""
    renames = renames or {}
    if cfg.resume:
        path = ckpt.latest_checkpoint(ckpt_dir(cfg, out))
        ranks = launch.from_env()
        if ranks.several:
            engine_state, trainer, rng = shards.load(path, rank=ranks.rank)
        else:
            engine_state, trainer = ckpt.load_checkpoint(path)
            rng = trainer["rng"]
        check_resumable(cfg, ckpt_dir(cfg, out), trainer, digest=batches.digest, base=lora_base(cfg, src))
        if cfg.lora:
            _load_base(engine, cfg, src, model=model, layout=layout, renames=renames, frozen_only=True)
        elif src.has_weights:
            plan_checkpoint(model, layout, src.model_dir)
        try:
            if cfg.reset_optimizer:
                load_weights_only(engine, model, engine_state, path)
                was = trainer.get("config", {}).get("optimizer", "?")
                console.print(f"--reset-optimizer: weights, RNG and data position from {path.name}; "
                              f"{cfg.optimizer} starts from fresh state (the checkpoint's {was} "
                              "state is not used)", highlight=False, soft_wrap=True)
            else:
                engine.load_state_dict(engine_state)
        except (ValueError, KeyError, TypeError, RuntimeError, OSError) as e:  # chunks are read here
            if isinstance(e, TierwiseError):
                raise
            why = (f"its engine state has no {e.args[0]!r}" if isinstance(e, KeyError)
                   else (str(e).splitlines() or [type(e).__name__])[0])
            raise ckpt.CheckpointError(f"checkpoint {path} does not fit this run: {why}") from None
        ckpt.restore_rng(rng)
        batches.position = DataPosition.from_dict(trainer["data"])
        # A killed run may have logged steps after its last checkpoint; they run again now.
        truncate_metrics(out / "metrics.jsonl", after_step=int(trainer["step"]))
        named = ckpt.named_latest(ckpt_dir(cfg, out))
        fell_back = f"; `latest` names {named}, not a complete checkpoint here" if named not in (None, path.name) else ""
        console.print(f"resumed from {path.name} (step {trainer['step']}{fell_back})", highlight=False)
        for note in resume_changes(cfg, trainer, schedule, done=int(trainer["step"])):
            console.print(note, highlight=False, soft_wrap=True)
        return int(trainer["step"])
    _load_base(engine, cfg, src, model=model, layout=layout, renames=renames, frozen_only=cfg.lora)
    return 0


def load_weights_only(engine, model, engine_state: dict, path: Path) -> None:
    """The checkpoint's weights and persistent buffers into `engine`; its optimizer state and
    step counts are left out, so the engine's optimizer starts fresh (--reset-optimizer).

    The checkpoint holds each chunk's flat master buffer: its layout must be this engine's
    (same model, --chunk-size and --precision, checked by check_resumable and here)."""
    chunks = engine_state["chunks"]
    numel = [int(n) for n in engine_state["chunk_numel"]]
    if numel != [c.numel for c in engine.plan.chunks]:
        raise ckpt.CheckpointError(f"checkpoint {path} was written with another chunk layout than "
                                   "this run's: --reset-optimizer cannot map its weights")

    def named():
        for slots, saved in zip(_slots_by_chunk(engine), chunks):
            if "master" not in saved:  # a frozen chunk: the base is loaded from the model
                continue
            master = lazy.load(saved["master"]).float()  # one chunk in memory at a time
            for name, slot in slots:
                yield name, slot.view(master)

    engine.load_weights(named())
    own = dict(model.named_buffers())
    with torch.no_grad():
        for name, value in engine_state.get("buffers", {}).items():
            if name not in own:
                raise ckpt.CheckpointError(f"checkpoint {path} has a buffer this model lacks: {name}")
            own[name].copy_(value)


def _slots_by_chunk(engine) -> list[list]:
    by_chunk: list[list] = [[] for _ in engine.plan.chunks]
    for name, slot in engine.plan.slots.items():
        by_chunk[slot.chunk].append((name, slot))
    return by_chunk


def ckpt_dir(cfg: TrainConfig, out: Path) -> Path:
    """Where the checkpoints are: `out`; with several ranks --output, which every rank shares
    (the others' `out` is a scratch directory)."""
    return Path(cfg.output) if launch.from_env().several else out


def check_world(out: Path, world: int) -> None:
    """Refuse --resume from a checkpoint of another number of ranks (resharding is not built)."""
    path = ckpt.latest_checkpoint(out)
    if path is None:
        return
    saved = shards.world_of(ckpt.load_trainer(path))
    if saved != world:
        def ranks(n: int) -> str:
            return f"{n} rank{'s' if n > 1 else ''}"
        raise ConfigError(f"--resume: {path.name} in {out} was written by {ranks(saved)}, this run has "
                          f"{ranks(world)}: resharding a checkpoint is not built (resume with "
                          f"--nproc-per-node {saved})")


def lora_base(cfg: TrainConfig, src: ModelSource) -> str | None:
    """What a LoRA run's adapters are trained on (its checkpoint holds no base), checked on
    --resume: the weights_digest of --model's weights; None for a full fine-tune or a base
    initialised from the seed."""
    return src.digest if cfg.lora else None


def _resumable(cfg: TrainConfig, src: ModelSource) -> None:
    """--resume --dry-run: what the run would refuse before it trains."""
    if ckpt.latest_checkpoint(cfg.output) is None:
        raise ConfigError(f"--resume: no checkpoint in {cfg.output}")
    check_resumable(cfg, Path(cfg.output), base=lora_base(cfg, src))


def check_resumable(cfg: TrainConfig, out: Path, trainer: dict | None = None, *,
                    digest: str | None = None, base: str | None = None) -> None:
    """Refuse --resume with options that change the batches or the engine state's layout,
    (`digest` given: Batches.digest) with data that tokenizes to other blocks than the
    checkpointed run's, or (`base` given: loading.weights_digest) a LoRA run's base whose
    weights are not those its adapters were trained on."""
    if trainer is None:
        trainer = ckpt.load_trainer(ckpt.latest_checkpoint(out))
    saved = trainer.get("config", {}) if isinstance(trainer, dict) else {}
    # an option a checkpoint does not record (written before it existed) had its default
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.init}
    changed = [k for k in TrainConfig.DATA_KEYS + TrainConfig.STATE_KEYS + TrainConfig.LORA_KEYS
               if not _same_option(k, saved.get(k, defaults[k]), getattr(cfg, k))
               and not (k == "optimizer" and cfg.reset_optimizer)]
    if changed:
        was = ", ".join(_as_given(k, saved.get(k, defaults[k])) for k in changed)
        hint = " (add --reset-optimizer to start the new optimizer from fresh state)" \
            if changed == ["optimizer"] else ""
        raise ConfigError(f"--resume: {', '.join('--' + k.replace('_', '-') for k in changed)}"
                          f" {'differs' if len(changed) == 1 else 'differ'} from the checkpointed run in {out} "
                          f"(it used {was}){hint}")
    was = trainer.get("data_blocks") if isinstance(trainer, dict) else None
    if digest is not None and was is not None and was != digest:
        raise ConfigError(f"--resume: the data ({'--data ' + str(cfg.data) if cfg.data else 'the built-in sample'}) "
                          f"tokenizes to other blocks than the checkpointed run's in {out} ({digest}, it had "
                          f"{was}): the data or the tokenizer changed, so its data position would name other "
                          "batches (restore them, or start a new run)")
    was = trainer.get("base") if isinstance(trainer, dict) else None
    if base is not None and was is not None and was != base:
        raise ConfigError(f"--resume: the base model's weights in {cfg.model} are not those the checkpointed "
                          f"LoRA run in {out} trained its adapters on ({base}, it had {was}): the checkpoint holds "
                          "the adapters only (restore the base, or start a new run)")


def _as_given(key: str, value: Any) -> str:
    """An option as a run was given it: `--lora-rank 2`; an unset one in words, not `None`."""
    flag = "--" + key.replace("_", "-")
    if value is not None:
        return f"{flag} {value}"
    return {"model": "the built-in tiny model, no --model",
            "lora_rank": "no --lora-rank: a full fine-tune"}.get(key, f"no {flag}")


def resume_changes(cfg: TrainConfig, trainer: dict, schedule: LRSchedule | None, *, done: int) -> list[str]:
    """Notices for options a resumed run may change (check_resumable refuses the others) that
    make it differ from the run the checkpoint began: a --steps, --lr, --schedule or
    --warmup-steps that gives one of the `done` steps another lr than it ran at (extending a
    run whose steps so far keep their lr says nothing), a changed --weight-decay or --grad-clip."""
    notes = []
    saved = trainer.get("schedule")
    if schedule is not None and isinstance(saved, dict):
        try:
            old = LRSchedule(**saved)
        except (TypeError, TierwiseError):
            old = None
        first = None if old is None else next((s for s in range(done) if old.lr_at(s) != schedule.lr_at(s)), None)
        if first is not None:
            what = ", ".join(f"{k.replace('_', ' ')} {saved.get(k)} -> {v}" for k, v in schedule.to_dict().items()
                             if saved.get(k) != v)
            notes.append(f"--resume: the lr schedule differs from the checkpointed run's ({what}): steps 1-{done} "
                         f"ran on the old one (step {first + 1} at lr {old.lr_at(first):.4g}, the new one "
                         f"gives {schedule.lr_at(first):.4g}), so this is not the run a fresh start with these "
                         "options makes")
    config = trainer.get("config", {}) if isinstance(trainer.get("config"), dict) else {}
    for key in ("weight_decay", "grad_clip"):
        if key in config and config[key] != getattr(cfg, key):
            notes.append(f"--resume: --{key.replace('_', '-')} {getattr(cfg, key)} from step {done + 1} on "
                         f"(steps 1-{done} ran with {config[key]})")
    return notes


def _same_option(key: str, saved, now) -> bool:
    if key in ("model", "data") and saved != now and isinstance(saved, str) and isinstance(now, str):
        # one file or directory by two spellings (./x, x/, an absolute path) is the same
        # (a relative path saved by a run started elsewhere may name nothing from here: refused)
        return os.path.exists(saved) and os.path.exists(now) and os.path.samefile(saved, now)
    if key == "chunk_size":  # "64M" and "64MiB" are one size
        try:
            return parse_size(saved, what="chunk_size") == parse_size(now, what="chunk_size")
        except TierwiseError:
            return False
    return saved == now


def save(engine, cfg: TrainConfig, out: Path, *, step: int, batches: Batches,
         schedule: LRSchedule, rng: dict | None = None, base: str | None = None) -> Path:
    """Checkpoint `step` (`rng`: the RNG state to record; default: now; `base`: a LoRA base's
    weights_digest). Several ranks: collective, each rank its shard (cli.shards)."""
    trainer = {"data": batches.position.to_dict(), "data_blocks": batches.digest,
               "schedule": schedule.to_dict(), "config": cfg.to_dict()} | ({"base": base} if base else {})
    rng = rng or ckpt.capture_rng()
    state = engine.state_dict(deferred=True)  # each chunk read while it is written
    ranks = launch.from_env()
    try:
        if ranks.several:
            return shards.save(ckpt_dir(cfg, out), step=step, rank=ranks.rank, world=ranks.world,
                               shard={"engine": state, "rng": rng}, trainer_state=trainer,
                               keep=cfg.keep_checkpoints)
        return ckpt.save_checkpoint(out, step=step, engine_state=state,
                                    trainer_state=trainer | {"rng": rng}, keep=cfg.keep_checkpoints)
    except ckpt.NonFiniteState as e:  # never write damaged weights over the last good checkpoint
        last = ckpt.latest_checkpoint(ckpt_dir(cfg, out))
        kept = f"the last good checkpoint {last.name} is kept" if last else "no checkpoint was saved"
        raise NonFiniteLoss(f"step {step}: the engine's state holds NaN or inf ({e.where}): the "
                            f"checkpoint was not written; {kept}") from None


def evaluate(engine, eval_data: list) -> float | None:
    """Token-weighted mean eval loss (engine.eval_loss(batch) -> float); None without data."""
    if not eval_data:
        return None
    total = weight = 0.0
    for batch in eval_data:
        n = float((batch["labels"][:, 1:] != -100).sum())
        total += engine.eval_loss(batch) * n
        weight += n
    return total / max(weight, 1.0)


def _intro(batches: Batches, *, start: int, total: int, plan: Any, lora: bool = False) -> str:
    """'steps 1-200 (50 a epoch), about 3:20 at the plan's 1.0 s a step'."""
    from .progress import clock

    if start >= total:
        return (f"nothing to train: the checkpoint is at step {start}, the run ends at step {total} (a larger "
                f"--steps or --epochs trains on); its {'adapter' if lora else 'model'} is exported")
    line = f"steps {start + 1}-{total} ({batches.batches_per_epoch} an epoch)"
    step_s = getattr(plan, "step_s", None)
    if step_s:
        line += f", about {clock(step_s * (total - start))} at the plan's {step_s:.3g} s a step"
    return line


def _loop(engine, cfg: TrainConfig, *, src, out: Path, batches: Batches,
          schedule: LRSchedule, start: int, total: int, eval_data: list,
          console: Console, losses: list[float | None], padded: bool = True, intro: str | None = None,
          times: "list[float] | None" = None) -> int:
    """Steps start+1..total; appends each train loss to `losses` (None: a step skipped with
    --skip-nonfinite); returns the exit code.
    A step the device budget cannot hold (StepOverBudget) checkpoints the last completed
    step and raises a one-line InfeasibleBudget (exit 2)."""
    step, in_a_row = start, 0
    base = lora_base(cfg, src)  # (each checkpoint holds it: a LoRA --resume checks its base)
    with MetricsWriter(out / "metrics.jsonl", report_to=cfg.report_to if launch.from_env().main else "none",
                       config=dataclasses.asdict(cfg)) as metrics, _StopFlag() as stop, \
            TrainProgress(console=console, total=total, start=start, every=cfg.log_every, intro=intro,
                          label=lora_mod.label(cfg) if cfg.lora else "") as bar:
        while step < total:
            lr = schedule.lr_at(step)
            engine.set_lr(lr)
            position, rng = batches.position, ckpt.capture_rng()
            batch = batches.next()
            before = dict(engine.phase_times)
            t0 = time.perf_counter()
            launch.fault(launch.from_env(), step + 1)
            try:
                loss = float(engine.step(batch, grad_accum=cfg.grad_accum))
            except StepOverBudget as e:
                if not e.step_done:  # the state is the last completed step's (or not at all)
                    batches.position = position
                raise _over_budget(e, engine, cfg, out, step=step, start=start, batches=batches,
                                   schedule=schedule, rng=None if e.step_done else rng, base=base) from None
            dt = time.perf_counter() - t0
            if times is not None:
                times.append(dt)
            bad = _nonfinite(engine, loss)
            if bad and engine.skipped_last and in_a_row < cfg.skip_nonfinite:
                in_a_row += 1  # the engine left weights and optimizer state as they were
                step += 1
                losses.append(None)
                metrics.write(kind="skipped", step=step, lr=lr, reason=f"{bad[0]} {bad[1]}")
                bar.note(f"step {step}: the {bad[0]} is {bad[1]}: update skipped "
                         f"({in_a_row} in a row; --skip-nonfinite {cfg.skip_nonfinite})")
            else:
                _check_finite(engine, loss, out, step=step + 1, in_a_row=in_a_row)
                in_a_row = 0
                step += 1
                losses.append(loss)
                tokens = batches.last_tokens
                record = {"kind": "train", "step": step, "loss": loss, "lr": lr,
                          "tokens": tokens, "tokens_per_s": tokens / max(dt, 1e-9),
                          "step_s": dt, "epoch": batches.position.epoch}
                record["peak_bytes"] = dict(engine.ledger.peaks())
                counters = getattr(engine, "counters", None)  # (the launching thread's work: offload.engine.timeline)
                if counters:
                    record["counters"] = dict(counters)
                record.update(_rank_peaks(engine))
                metrics.write(**record)
                bar.update(step=step, loss=loss, tokens_per_s=record["tokens_per_s"], lr=lr,
                           peaks=record["peak_bytes"])
            if step == start + 1:  # the engine's warm-up step (it traces and plans in it)
                for line in _warmup_lines(engine, cfg, src, before, padded=padded):
                    bar.note(line)
            if cfg.eval_every and step % cfg.eval_every == 0:
                ev = evaluate(engine, eval_data)
                if ev is not None:
                    metrics.write(kind="eval", step=step, loss=ev)
                    bar.note(f"step {step}: eval loss {ev:.4f}")
            path = None
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                path = save(engine, cfg, out, step=step, batches=batches, schedule=schedule, base=base)
                if bar.plain:  # a log says where a run can resume from
                    bar.note(f"step {step}: checkpoint {path.name} saved")
            signum = _agreed_stop(stop.signum)  # (one that came during that save stops here too)
            if signum:
                path = path or save(engine, cfg, out, step=step, batches=batches, schedule=schedule, base=base)
                bar.note(f"interrupted ({signal.Signals(signum).name}): checkpoint {path.name} "
                         "saved; run again with --resume to continue")
                return 128 + signum
        evaluated = cfg.eval_every and step % cfg.eval_every == 0
        ev = evaluate(engine, eval_data) if eval_data and not evaluated else None
        if ev is not None:
            metrics.write(kind="eval", step=step, loss=ev)
            bar.note(f"step {step}: eval loss {ev:.4f}")
        last = ckpt.latest_checkpoint(ckpt_dir(cfg, out))  # every rank reads the same (shared)
        if last is None or last.name != ckpt.ckpt_name(step):
            save(engine, cfg, out, step=step, batches=batches, schedule=schedule, base=base)
    return 0


def _agreed_stop(signum: int) -> int:
    """The signal that stops the run after this step (0: none). Several ranks: any rank's, so
    every rank checkpoints the same step (a signal may reach them a step apart)."""
    if not launch.from_env().several:
        return signum
    from ..offload.engine.ranks import gather_objects

    return max(gather_objects(signum, "agreeing whether to stop"))


def _over_budget(e: StepOverBudget, engine, cfg: TrainConfig, out: Path, *, step: int, start: int,
                 batches: Batches, schedule: LRSchedule, rng: dict | None,
                 base: str | None = None) -> InfeasibleBudget:
    """Checkpoint what the engine holds when it is a completed step's state, and say so."""
    done = step + 1 if e.step_done else step
    if not e.step_done and not e.weights_intact:
        last = ckpt.latest_checkpoint(out)
        saved = (f"step {step + 1} had already updated some weights, so nothing was saved; "
                 + (f"--resume continues from {last.name}" if last else "no checkpoint to resume from"))
    elif done == start:
        saved = "no step completed in this run, nothing new to save"
    else:
        path = save(engine, cfg, out, step=done, batches=batches, schedule=schedule, rng=rng, base=base)
        saved = f"checkpoint {path.name} saved (step {done}): --resume continues from it"
    return InfeasibleBudget(f"step {step + 1}: {str(e).splitlines()[0]}; {saved}", minimum=e.minimum)


def _rank_peaks(engine) -> dict:
    """Several ranks (a collective, on every rank): every rank's peaks by tier, and its node's:
    the sum over the ranks on rank 0's node of their host, CXL and NVMe peaks (an upper bound of
    the node's own peak: the ranks' peaks need not coincide), the largest rank's gpu peak."""
    by_rank = getattr(engine, "rank_peaks", lambda: None)()
    if by_rank is None:
        return {}
    local = engine.ranks.local
    node = {tier: sum(by_rank[r].get(tier, 0) for r in local) for tier in ("host", "cxl", "nvme")}
    node["gpu"] = max(by_rank[r].get("gpu", 0) for r in local)
    return {"rank_peak_bytes": by_rank, "node_peak_bytes": node}


def _warmup_lines(engine, cfg: TrainConfig, src: ModelSource, before: dict, *,
                  padded: bool = True) -> list[str]:
    """Measured phase times / peaks of the warm-up step next to the planner's prediction."""
    from .planning import make_plan

    plan, error = None, None
    try:
        plan = make_plan(cfg, src=src, padded=padded, check=False)  # the engine holds its memory now
    except TierwiseError as e:  # informative only: a model the planner cannot price still trains
        log.debug("no plan", exc_info=True)
        from ..offload.core.errors import UnsupportedModel
        from ..profiles import ProfileError

        # (preflight said why before the run started: not again in full)
        error = "unplanned, as said before the first step" if isinstance(e, (UnsupportedModel, ProfileError)) \
            else (str(e).splitlines() or [type(e).__name__])[0]
    return warmup_report(measured_times=phase_delta(dict(engine.phase_times), before),
                         measured_peaks=dict(engine.ledger.peaks()), plan=plan, plan_error=error,
                         budgets=cfg.budgets)


def _finish(engine, cfg: TrainConfig, src: ModelSource, out: Path, console: Console, *,
            model, layout: ModelLayout) -> None:
    """Export as save_pretrained would for the trained model, with the source's config; a LoRA
    run: its PEFT adapter directory (cli.lora), fp32 unless --export-dtype."""
    if cfg.lora:
        dtype = cfg.export_dtype or "fp32"
        adapter_dir = lora_mod.export_adapter(engine.named_parameters_fp32(trainable_only=True), model,
                                              out / lora_mod.ADAPTER_DIR, dtype=_TORCH_DTYPES[dtype])
        if src.tokenizer is not None:  # the adapter directory loads on its own, chat template included
            src.tokenizer.save_pretrained(adapter_dir)
        trainable, total = lora_mod.counts(model)
        _plots(engine, out, title=f"{lora_mod.label(cfg)}: {trainable:,} trainable parameters "
                                  f"({100 * trainable / max(total, 1):.2f}%)")
        console.print(f"done: {lora_mod.summary(cfg, model)}", highlight=False, soft_wrap=True)
        console.print(f"PEFT adapter exported to {adapter_dir} ({dtype}; load it with "
                      f"peft.PeftModel.from_pretrained(base, \"{adapter_dir}\")); metrics.jsonl, plots and "
                      f"checkpoints in {out}", highlight=False, soft_wrap=True)
        if not src.has_weights:  # adapter_config.json names the profile: no directory holds that base
            warn(console, f"the base was model profile '{src.name}', a random initialisation that is not "
                          "saved: this adapter fits no model on disk (a profile is for trying the pipeline; "
                          "pass a Hugging Face model directory to train a usable adapter)")
        experts = any(fused_experts(n, p.shape) for n, p in model.named_parameters())
        if cfg.base_dtype == "nf4" and experts:  # transformers + bitsandbytes leave fused experts unquantised
            console.print("the adapters were trained over an NF4 base, its fused MoE experts included: "
                          "`finetune generate` runs the trained model; bitsandbytes' loader "
                          "(BitsAndBytesConfig(load_in_4bit=True)) keeps the experts unquantised, so the "
                          "model it gives differs by their quantisation error, as the unquantised base does",
                          highlight=False, soft_wrap=True)
        elif cfg.base_dtype == "nf4":  # the adapters fit the quantised base, not the original
            console.print("the adapters were trained over an NF4 base: load the base as bitsandbytes' NF4 "
                          "(BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4', "
                          "bnb_4bit_use_double_quant=True)) to get the trained model; over the unquantised "
                          "base it differs by the quantisation error", highlight=False, soft_wrap=True)
        elif cfg.base_dtype == "int8":  # tierwise's own int8 (offload/runtime/codecs.py): no loader matches it
            console.print("the adapters were trained over tierwise's int8 base (block-wise absmax, not "
                          "bitsandbytes' LLM.int8): over the unquantised base the model differs by that "
                          "quantisation error", highlight=False, soft_wrap=True)
        return
    dtype = cfg.export_dtype or cfg.precision
    model_dir = export_hf(engine.named_parameters_fp32(), out / "model", config=src.config,
                          model=model, layout=layout,
                          tokenizer=src.tokenizer, dtype=dtype,
                          generation_config=src.generation_config)
    _plots(engine, out)
    console.print(f"done: model exported to {model_dir} ({dtype}); metrics.jsonl, plots and "
                  f"checkpoints in {out}", highlight=False, soft_wrap=True)


_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _plots(engine, out: Path, *, title: str = "") -> None:
    plot_loss(read_metrics(out / "metrics.jsonl"), out / "loss.png", title=f"loss · {title}" if title else "loss")
    if engine.timeline:
        extra = {"title": f"memory per tier over one step · {title}"} if title else {}
        plot_timeline(engine.timeline, out / "memory_timeline.png", **extra)
