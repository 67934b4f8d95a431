"""`finetune`: fine-tune a model bigger than the GPU by streaming it across memory tiers.

    finetune                                  # built-in tiny model + sample: a 1-minute demo
    finetune --model ./llama --data train.jsonl --gpu-mem 24G --cpu-mem 256G
    finetune --config examples/70b_24g.toml --dry-run
    finetune plan --model llama-70b --gpu-mem 24G --cpu-mem 256G

User errors print one `error: ...` line on stderr and exit 2; Ctrl-C (SIGTERM, SIGHUP) during
training finishes the step, checkpoints and exits 130 (143, 129).
"""

from __future__ import annotations

import errno
import functools
import sys
from enum import Enum
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from .config import DISK_FULL, TrainConfig, config_callback, raise_config_error
from ..offload.core.errors import InfeasibleBudget, TierwiseError

EXIT_USER_ERROR = 2
#: errno values of a path the user gave that cannot be used.
PATH_ERRORS = (errno.EACCES, errno.EPERM, errno.ENOENT, errno.EISDIR, errno.ENOTDIR,
               errno.EROFS, errno.ENAMETOOLONG)

app = typer.Typer(
    name="finetune", add_completion=False, pretty_exceptions_enable=False,
    rich_markup_mode="rich", context_settings={"help_option_names": ["-h", "--help"]},
    help=("Fine-tune a language model bigger than your GPU: its weights, gradients and "
          "optimizer state stream across GPU, host RAM, CXL memory and NVMe.\n\n"
          "[bold]finetune[/] trains (the default command; with no --model it trains a "
          "built-in tiny model on a built-in sample in under a minute). "
          "[bold]finetune plan[/] shows where every chunk would live and the predicted step "
          "time; add --dry-run to a training command to do the same with its options.\n\n"
          "Example: finetune --model ./llama-8b --data train.jsonl --gpu-mem 24G "
          "--cpu-mem 64G --optimizer adamw8bit --precision bf16 --steps 500"),
)


class Optimizer(str, Enum):
    adamw = "adamw"
    adamw8bit = "adamw8bit"
    galore = "galore"
    galore8bit = "galore8bit"
    apollo = "apollo"
    apollo_mini = "apollo-mini"
    mezo = "mezo"
    sgd = "sgd"


class Precision(str, Enum):
    bf16 = "bf16"
    fp32 = "fp32"


class Schedule(str, Enum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class ExportDtype(str, Enum):
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


def _fail(message: str) -> None:
    sys.stderr.write(f"error: {message}\n")  # one line, never wrapped by rich
    sys.stderr.flush()
    raise typer.Exit(EXIT_USER_ERROR)


def user_errors(fn):
    """Turn user-caused errors into `error: ...` + exit 2 (never a traceback)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except TierwiseError as e:
            _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
        except OSError as e:
            if e.errno in DISK_FULL:
                _fail(f"disk full ({e.strerror}) while writing {e.filename or 'output'}: free "
                      "space or point --output / --nvme-path elsewhere")
            if e.filename and e.errno in PATH_ERRORS:
                _fail(f"{e.filename}: {e.strerror}")
            raise
        except KeyboardInterrupt:
            sys.stderr.write("interrupted\n")
            raise typer.Exit(130)

    return wrapper


# Panels of `finetune --help`.
MODEL, MEMORY, OPTIM, SCHED, OUTPUT, HW = ("Model & data", "Memory budget", "Optimizer",
                                           "Schedule", "Output & resume", "Hardware & plan")
Opt = functools.partial(typer.Option, show_default=True)
CONFIG_OPTION = Opt(None, "--config", help="TOML file holding any of these options "
                    "(e.g. gpu-mem = \"24G\"); command-line flags win; unknown keys are errors.",
                    is_eager=True, callback=config_callback, rich_help_panel=OUTPUT,
                    dir_okay=False)


@app.callback(invoke_without_command=True)
@user_errors
def train(
    ctx: typer.Context,
    model: Optional[str] = Opt(None, help="Hugging Face model directory, or a model profile "
                               "name (random init). Default: the built-in tiny model.",
                               rich_help_panel=MODEL),
    trust_remote_code: bool = Opt(False, "--trust-remote-code", help="Run the Python code a "
                                  "model directory ships (auto_map in config.json); read it "
                                  "first. Without it such a model is refused.",
                                  rich_help_panel=MODEL),
    data: Optional[str] = Opt(None, help="JSONL ({\"text\"} | {\"prompt\",\"completion\"} | "
                              "{\"messages\"}) or a `datasets` directory. Default: built-in sample.",
                              rich_help_panel=MODEL),
    eval_data: Optional[str] = Opt(None, help="Held-out data in the same formats.",
                                   rich_help_panel=MODEL),
    seq_len: int = Opt(128, help="Tokens per sequence (rows are packed to this length).",
                       rich_help_panel=MODEL),
    batch_size: int = Opt(4, help="Sequences per micro-batch.", rich_help_panel=MODEL),
    pack: bool = Opt(True, help="Pack rows into full sequences (else truncate/pad each row).",
                     rich_help_panel=MODEL),
    gpu_mem: Optional[str] = Opt(None, help="GPU memory to use, e.g. 24G (default: engine's).",
                                 rich_help_panel=MEMORY),
    cpu_mem: Optional[str] = Opt(None, help="Host RAM to use, e.g. 256G.", rich_help_panel=MEMORY),
    cxl_mem: Optional[str] = Opt(None, help="CXL memory to use, e.g. 512G.",
                                 rich_help_panel=MEMORY),
    cxl_node: Optional[str] = Opt(None, help="NUMA node(s) of the CXL memory, e.g. 1 or 1,2 "
                                  "(pages interleave across several; default: every CXL node).",
                                  rich_help_panel=MEMORY),
    nvme_path: Optional[str] = Opt(None, help="Directory on an NVMe drive for swap files.",
                                   rich_help_panel=MEMORY),
    nvme_checksum: bool = Opt(True, "--nvme-checksum/--no-nvme-checksum",
                              help="Checksum every swap block and verify it on read (a corrupted "
                              "swap file stops the run).", rich_help_panel=MEMORY),
    offload_activations: bool = Opt(False, "--offload-activations",
                                    help="Keep each block's input in host RAM between forward and "
                                    "backward: less GPU memory for long sequences.",
                                    rich_help_panel=MEMORY),
    recompute: Optional[bool] = Opt(None, "--recompute/--no-recompute",
                                    help="Recompute each decoder layer's activations in backward "
                                    "(activation checkpointing: the smallest GPU budget), or keep "
                                    "them all (about 25% less compute). Default: keep them when "
                                    "the GPU budget holds them, as `finetune plan` shows (on CUDA "
                                    "only with --gpu-mem given).",
                                    rich_help_panel=MEMORY),
    optimizer: Optimizer = Opt(Optimizer.adamw, help="Optimizer.", rich_help_panel=OPTIM),
    lr: Optional[float] = Opt(None, help="Peak learning rate (default: 1e-4; 1e-3 for the "
                              "built-in demo).", rich_help_panel=OPTIM),
    weight_decay: float = Opt(0.0, help="Decoupled weight decay.", rich_help_panel=OPTIM),
    grad_accum: int = Opt(1, help="Micro-batches per optimizer step.", rich_help_panel=OPTIM),
    grad_clip: Optional[float] = Opt(None, help="Clip the global grad norm to this value.",
                                     rich_help_panel=OPTIM),
    skip_nonfinite: int = Opt(0, help="Skip the update of a step whose loss (or, with "
                              "--grad-clip, gradient norm) is NaN/inf, up to N steps in a row; "
                              "0: stop the run at the first.", rich_help_panel=OPTIM),
    steps: Optional[int] = Opt(None, help="Optimizer steps (default: one epoch; three "
                               "epochs for the built-in demo).",
                               rich_help_panel=SCHED),
    epochs: Optional[int] = Opt(None, help="Epochs over --data (instead of --steps).",
                                rich_help_panel=SCHED),
    warmup_steps: int = Opt(0, help="Linear warmup steps.", rich_help_panel=SCHED),
    schedule: Schedule = Opt(Schedule.cosine, help="LR decay after warmup.",
                             rich_help_panel=SCHED),
    eval_every: int = Opt(0, help="Evaluate on --eval-data every N steps (0: at the end only).",
                          rich_help_panel=SCHED),
    seed: int = Opt(0, help="Seed for init, data order and sampling.", rich_help_panel=SCHED),
    output: str = Opt("output", help="Run directory: checkpoints, metrics, plots, model/.",
                      rich_help_panel=OUTPUT),
    resume: bool = Opt(False, "--resume", help="Continue the run in --output from its latest "
                       "checkpoint, on exactly the next batch.", rich_help_panel=OUTPUT),
    reset_optimizer: bool = Opt(False, "--reset-optimizer", help="With --resume: continue the "
                                "weights, RNG and data position, but start --optimizer (it may "
                                "differ) from fresh state.", rich_help_panel=OUTPUT),
    overwrite: bool = Opt(False, "--overwrite", help="Empty --output first (only a directory "
                          "an earlier finetune run made).",
                          rich_help_panel=OUTPUT),
    checkpoint_every: int = Opt(0, help="Checkpoint every N steps (always at the end and on "
                                "Ctrl-C).", rich_help_panel=OUTPUT),
    keep_checkpoints: int = Opt(2, help="Complete checkpoints to keep (0: all).",
                                rich_help_panel=OUTPUT),
    export_dtype: Optional[ExportDtype] = Opt(None, help="Dtype of the exported model "
                                              "(default: --precision).", rich_help_panel=OUTPUT),
    config: Optional[Path] = CONFIG_OPTION,
    precision: Precision = Opt(Precision.fp32, help="Compute precision.", rich_help_panel=HW),
    hardware: Optional[str] = Opt(None, help="Hardware profile name (default: detect).",
                                  rich_help_panel=HW),
    chunk_size: str = Opt("64M", help="Bytes of fp32 weights per chunk.", rich_help_panel=HW),
    dry_run: bool = Opt(False, "--dry-run", help="Resolve model and budgets, print the plan, "
                        "train nothing.", rich_help_panel=HW),
) -> None:
    """Fine-tune a model (the default command). See the panels below; `finetune plan --help`."""
    if ctx.invoked_subcommand is not None:
        return
    raise_config_error(ctx)
    cfg = TrainConfig(
        model=model, trust_remote_code=trust_remote_code, data=data, eval_data=eval_data, seq_len=seq_len, batch_size=batch_size,
        pack=pack, gpu_mem=gpu_mem, cpu_mem=cpu_mem, cxl_mem=cxl_mem, cxl_node=cxl_node,
        nvme_path=nvme_path, nvme_checksum=nvme_checksum, offload_activations=offload_activations,
        recompute=recompute, optimizer=optimizer.value,
        lr=lr, weight_decay=weight_decay, grad_accum=grad_accum, grad_clip=grad_clip,
        skip_nonfinite=skip_nonfinite, steps=steps, epochs=epochs,
        warmup_steps=warmup_steps, schedule=schedule.value, eval_every=eval_every, seed=seed,
        output=output, resume=resume, reset_optimizer=reset_optimizer, overwrite=overwrite, checkpoint_every=checkpoint_every,
        keep_checkpoints=keep_checkpoints,
        export_dtype=export_dtype.value if export_dtype else None, precision=precision.value,
        hardware=hardware, chunk_size=chunk_size, dry_run=dry_run,
    )
    from .train import run

    code = run(cfg, console=Console())
    if code:
        raise typer.Exit(code)


@app.command()
@user_errors
def plan(
    ctx: typer.Context,
    model: Optional[str] = Opt(None, help="HF model directory or model profile name."),
    trust_remote_code: bool = Opt(False, "--trust-remote-code", help="Run the Python code a "
                                  "model directory ships (auto_map in config.json)."),
    gpu_mem: Optional[str] = Opt(None, help="GPU memory to use, e.g. 24G."),
    cpu_mem: Optional[str] = Opt(None, help="Host RAM to use."),
    cxl_mem: Optional[str] = Opt(None, help="CXL memory to use."),
    cxl_node: Optional[str] = Opt(None, help="NUMA node(s) of the CXL memory, e.g. 1 or 1,2."),
    nvme_path: Optional[str] = Opt(None, help="Directory on an NVMe drive for swap files."),
    offload_activations: bool = Opt(False, "--offload-activations",
                                    help="Plan for a run with --offload-activations (it recomputes "
                                    "the decoder layers)."),
    recompute: Optional[bool] = Opt(None, "--recompute/--no-recompute",
                                    help="Plan with or without activation checkpointing (default: "
                                    "as training decides: without when the GPU budget holds every "
                                    "layer's activations; on CUDA only with --gpu-mem given)."),
    optimizer: Optimizer = Opt(Optimizer.adamw, help="Optimizer."),
    precision: Precision = Opt(Precision.fp32, help="Compute precision."),
    batch_size: int = Opt(4, help="Sequences per micro-batch."),
    seq_len: int = Opt(128, help="Tokens per sequence."),
    grad_accum: int = Opt(1, help="Micro-batches per optimizer step."),
    hardware: Optional[str] = Opt(None, help="Hardware profile name (default: detect)."),
    chunk_size: str = Opt("64M", help="Bytes of fp32 weights per chunk."),
    json_out: bool = Opt(False, "--json", help="Print the plan as JSON."),
    verify: bool = Opt(False, "--verify", help="Also run a few real steps with these settings "
                       "on this machine (simulated device without CUDA) and print planned vs "
                       "measured bytes per tier; exit 0 on PASS, 1 on FAIL."),
    verify_steps: int = Opt(3, "--verify-steps", help="Steps --verify runs (the first is the "
                            "warm-up)."),
    data: Optional[str] = Opt(None, help="The run's data (JSONL or a `datasets` directory): "
                              "the plan is for its worst batch (padded or not; without it, "
                              "padded) and --verify runs on it instead of random tokens."),
    config: Optional[Path] = Opt(None, "--config", is_eager=True, callback=config_callback,
                                 dir_okay=False, help="TOML file of options (train keys that "
                                 "plan does not use are ignored)."),
) -> None:
    """Show where every chunk would live, the predicted peaks per tier and the step time."""
    raise_config_error(ctx)
    cfg = TrainConfig(model=model, trust_remote_code=trust_remote_code, data=data, gpu_mem=gpu_mem, cpu_mem=cpu_mem, cxl_mem=cxl_mem,
                      cxl_node=cxl_node, nvme_path=nvme_path, recompute=recompute,
                      offload_activations=offload_activations, optimizer=optimizer.value, precision=precision.value, batch_size=batch_size, seq_len=seq_len,
                      grad_accum=grad_accum, hardware=hardware, chunk_size=chunk_size)
    from .planning import advise, make_plan, print_plan, resolve_recompute, verify_plan

    cfg = resolve_recompute(cfg)
    if verify:
        if json_out:
            raise TierwiseError("--verify prints a table: drop --json")
        code = verify_plan(cfg, steps=verify_steps, console=Console())
        if code:
            raise typer.Exit(code)
        return

    try:
        result = make_plan(cfg)
    except InfeasibleBudget as e:
        if not json_out:
            advise(cfg, e, console=Console())
        raise
    if result is None:
        raise TierwiseError("finetune plan is not yet available in this build "
                            "(offload.plan.planner is missing)")
    print_plan(result, console=Console(), as_json=json_out)


@app.command()
@user_errors
def profile(
    hardware: Optional[str] = Opt(None, help="Name to save the measured hardware profile as."),
    output: Optional[str] = Opt(None, help="Write the profile TOML here."),
    nvme_path: Optional[str] = Opt(None, help="Directory on the NVMe drive to measure (the one "
                                   "--nvme-path will name; default: the system's temp directory)."),
) -> None:
    """Measure this machine's link bandwidths and compute speed into a hardware profile."""
    from .planning import profile as run_profile

    if nvme_path is not None:
        TrainConfig(nvme_path=nvme_path)  # the same checks as training's --nvme-path
    run_profile(hardware=hardware, output=output, nvme_path=nvme_path, console=Console())


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
