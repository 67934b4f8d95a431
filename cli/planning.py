"""`finetune plan`, `finetune --dry-run` and `finetune profile`: glue to the planner/profiler."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from .config import TrainConfig
from .profilemodel import is_profile, profile_params
from ..offload.core.errors import InfeasibleBudget, UnsupportedModel
from ..offload.core.units import format_size
from ..offload.plan import planner
from ..offload.plan.planner import Plan
from ..profiles import ProfileError

if TYPE_CHECKING:
    from .loading import ModelSource

log = logging.getLogger(__name__)


def make_plan(cfg: TrainConfig, *, src: "ModelSource | None" = None, padded: bool | None = None) -> Plan:
    """offload.plan.planner.make_plan for this run. `padded`: whether the run's batches can
    hold padding (None: `data_padded`). A model profile (`--model 7b`) plans by name, on a
    machine without torch or transformers too (unless --data must be tokenized); a model
    directory or the built-in model needs them (their parameters are read off the module
    training builds, on the meta device)."""
    if is_profile(cfg.model):  # the planner reads the profile's extra fields
        model, params = cfg.model, profile_params(cfg.model)
    else:
        src = src or resolve_model(cfg.model)
        model, params = src.config, engine_params(src)
    if padded is None:
        padded = data_padded(cfg, src)
    return planner.make_plan(
        model=model, hardware=cfg.hardware, params=params,
        gpu_mem=cfg.budgets["gpu"], cpu_mem=cfg.budgets["cpu"], cxl_mem=cfg.budgets["cxl"],
        nvme_path=cfg.nvme_path, optimizer=cfg.optimizer,
        precision=cfg.precision, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
        grad_accum=cfg.grad_accum, chunk_bytes=cfg.budgets["chunk"],
        checkpointing=checkpointing(cfg), padded=padded,
    )


def resolve_model(spec: str | None) -> "ModelSource":
    from .loading import resolve_model as resolve  # transformers: only for a directory or the built-in

    return resolve(spec)


def engine_params(src: "ModelSource") -> list:
    """The parameters the engine will chunk: those of the module training builds
    (cli.loading.build_meta_model), so the plan counts a tied head as the run does."""
    from ..offload.core.chunks import specs_of
    from .loading import build_meta_model

    return specs_of(build_meta_model(src.config).named_parameters())


def data_padded(cfg: TrainConfig, src: "ModelSource | None" = None) -> bool:
    """Whether some batch of the run holds padding, so the plan is for a padded batch (the
    run's worst step: transformers then materialises the attention mask). Read from --data
    when given; without it True, the worst case (the built-in sample ends in a short block,
    and so does most data)."""
    if cfg.data is None:
        return True
    from .data import has_padding, load_blocks

    src = src or resolve_model(cfg.model)
    return has_padding(load_blocks(cfg.data, src.tokenizer, seq_len=cfg.seq_len, pack=cfg.pack))


def checkpointing(cfg: TrainConfig) -> bool | None:
    """The Engine's / planner's `checkpointing` for --recompute: False off; else None, their
    default (recompute when the model has several decoder layers; one layer is never recomputed)."""
    return False if cfg.recompute is False else None


def _has_cuda() -> bool:
    try:
        import torch
    except ModuleNotFoundError:  # `finetune plan` on a machine without torch: no CUDA either
        return False

    return torch.cuda.is_available()


def resolve_recompute(cfg: TrainConfig, *, src: ModelSource | None = None,
                      padded: bool | None = None) -> TrainConfig:
    """`cfg` with `recompute` decided. Unset (auto): off when the planner finds a placement
    that keeps every layer's activations within the budgets (less compute), else on. On
    with --offload-activations (it offloads recomputed layers' inputs), and on CUDA without
    --gpu-mem (the planner would judge the hardware profile's memory, not this card's). A run
    the planner cannot price (a model family it does not know, a planner error) recomputes."""
    if cfg.recompute is not None:
        return cfg
    if cfg.offload_activations or (cfg.budgets["gpu"] is None and _has_cuda()):
        return dataclasses.replace(cfg, recompute=True)
    try:
        make_plan(dataclasses.replace(cfg, recompute=False), src=src, padded=padded)
        feasible = True
    except (InfeasibleBudget, UnsupportedModel, ProfileError) as e:  # infeasible without recompute,
        log.debug("no plan without recompute: %s", e)  # or a model family the planner cannot price
        feasible = False
    return dataclasses.replace(cfg, recompute=not feasible)


def print_plan(plan: Plan, *, console: Console, as_json: bool) -> None:
    if as_json:
        console.out(plan.to_json(), highlight=False)
    else:
        console.out(plan.render_table(), highlight=False)  # pre-formatted: never re-wrap


def verify_plan(cfg: TrainConfig, *, steps: int, console: Console) -> int:
    """`finetune plan --verify`: a few real steps with these settings on this machine, planned
    against measured bytes per tier; returns 0 on PASS, 1 on FAIL (user errors raise)."""
    from ..offload.tools.verify import verify
    from .loading import build_meta_model

    src = resolve_model(cfg.model)
    batches, padded = None, True  # random tokens: every batch padded, the worst case
    if cfg.data is not None:
        from .data import Batches, check_vocab, has_padding, load_blocks, padded_batch

        blocks = load_blocks(cfg.data, src.tokenizer, seq_len=cfg.seq_len, pack=cfg.pack)
        check_vocab(blocks, src)
        rows = cfg.batch_size * cfg.grad_accum
        batches = iter(Batches(blocks, batch_size=rows, seed=cfg.seed))
        padded = has_padding(blocks)
        if padded:  # the first measured step (after the warm-up) is the run's worst one
            batches = itertools.chain([next(batches), padded_batch(blocks, batch_size=rows)], batches)
    with console.status(f"[bold]verifying[/]: {steps} steps of {src.name}"):
        report = verify(model=src.config, name=src.name, hardware=cfg.hardware, gpu_mem=cfg.budgets["gpu"],
                        cpu_mem=cfg.budgets["cpu"], cxl_mem=cfg.budgets["cxl"], nvme_path=cfg.nvme_path,
                        optimizer=cfg.optimizer, precision=cfg.precision, batch_size=cfg.batch_size,
                        seq_len=cfg.seq_len, grad_accum=cfg.grad_accum, chunk_bytes=cfg.budgets["chunk"],
                        lr=cfg.lr, steps=steps, batches=batches, seed=cfg.seed,
                        checkpointing=checkpointing(cfg), padded=padded, build=build_meta_model)
    if src.has_weights:
        console.print("(random weights: the bytes do not depend on their values)", highlight=False)
    console.out(report.render(), highlight=False)
    return 0 if report.passed else 1


def summary_table(cfg: TrainConfig, *, name: str, params: int) -> Table:
    table = Table(title="finetune (dry run)", show_header=False)
    fmt = lambda b: "auto" if b is None else format_size(b)  # noqa: E731
    rows = [
        ("model", f"{name} ({params / 1e9:.2f} B parameters)" if params >= 1e8
         else f"{name} ({params:,} parameters)"),
        ("data", cfg.data or "built-in sample"),
        ("gpu / cpu / cxl", f"{fmt(cfg.budgets['gpu'])} / {fmt(cfg.budgets['cpu'])} / "
                            f"{fmt(cfg.budgets['cxl'])}"),
        ("nvme", cfg.nvme_path or "-"),
        ("optimizer", f"{cfg.optimizer}, lr {cfg.lr:g}, {cfg.schedule} schedule, "
                      f"warmup {cfg.warmup_steps}"),
        ("precision", cfg.precision),
        ("batch", f"{cfg.batch_size} x {cfg.grad_accum} accum x {cfg.seq_len} tokens"),
        ("recompute", {True: "on", False: "off", None: "auto"}[cfg.recompute]),
    ]
    for k, v in rows:
        table.add_row(k, v)
    return table


def dry_run(cfg: TrainConfig, *, console: Console) -> int:
    """Resolve the model and budgets, print a summary and the plan; touch nothing on disk."""
    from .loading import build_meta_model, count_parameters

    src = resolve_model(cfg.model)
    if src.note:
        console.print(f"[bold yellow]warning:[/] {src.note}", soft_wrap=True, highlight=False)
    model = build_meta_model(src.config)
    cfg = resolve_recompute(cfg, src=src)
    console.print(summary_table(cfg, name=src.name, params=count_parameters(model)))
    print_plan(make_plan(cfg, src=src), console=console, as_json=False)
    return 0


def profile(*, hardware: str | None, output: str | None, console: Console, nvme_path: str | None = None,
            quick: bool = False) -> int:
    """`finetune profile`: measure this machine's links and compute via offload.tools.profiler.

    Each measurement is printed as it completes; the TOML goes to `output` (then
    `--hardware PATH` uses it), else to the console."""
    from ..offload.tools.profiler import measure

    with console.status("[bold]measuring this machine[/] (under a minute)") as status:
        def progress(msg: str) -> None:
            console.print(f"  {msg}", highlight=False)
            status.update(f"[bold]measuring[/] after {msg.split(':')[0]}")

        text = measure(hardware=hardware, output=output, nvme_path=nvme_path, quick=quick, progress=progress)
    if output is None and text:
        console.out(text, highlight=False)
    elif output:
        console.print(f"use it with [bold]--hardware {output}[/]")
    return 0
