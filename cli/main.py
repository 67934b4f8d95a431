"""`finetune`: fine-tune a model bigger than the GPU by streaming it across memory tiers.

    finetune                                  # built-in tiny model + sample: a 1-minute demo
    finetune --model ./llama --data train.jsonl --gpu-mem 24G --cpu-mem 256G
    finetune --config examples/70b_24g.toml --dry-run
    finetune plan --model llama-70b --gpu-mem 24G --cpu-mem 256G
    finetune export --merge --adapter run/adapter --base ./llama --output ./llama-merged

User errors print one `error: ...` line on stderr and exit 2; Ctrl-C (SIGTERM, SIGHUP) during
training finishes the step, checkpoints and exits 130 (143, 129).
"""

from __future__ import annotations

import errno
import functools
import inspect
import os
import sys
import traceback
import typing
from enum import Enum
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

from .config import (DISK_FULL, OUTPUT, PANELS, TrainConfig, config_callback, flags_win, option_fields,
                     raise_config_error)
from .launch import USER_ERROR as EXIT_USER_ERROR
from ..offload.core.errors import InfeasibleBudget, TierwiseError

#: errno values of a path the user gave that cannot be used.
PATH_ERRORS = (errno.EACCES, errno.EPERM, errno.ENOENT, errno.EISDIR, errno.ENOTDIR,
               errno.EROFS, errno.ENAMETOOLONG)

#: Below this many columns `--help` is click's plain list (a flag, its help beside it), its
#: panels as sections: rich's panels squeeze the help to ~20 characters a line at 80 and cut flags.
NARROW_HELP = 100


class _FlagHelp:
    """`-h, --help` shown as the flag it is (typer shows `<bool>` after its own help option);
    on a narrow terminal (or a pipe) the plain layout (NARROW_HELP)."""

    def get_help_option(self, ctx: Any) -> Any:
        opt = super().get_help_option(ctx)  # type: ignore[misc]
        if opt is not None:
            opt.metavar = ""
        return opt

    def format_help(self, ctx: Any, formatter: Any) -> None:
        import shutil

        if shutil.get_terminal_size().columns >= NARROW_HELP:
            return super().format_help(ctx, formatter)  # type: ignore[misc]
        rich, self.rich_markup_mode = self.rich_markup_mode, None  # type: ignore[has-type]
        try:
            return super().format_help(ctx, formatter)  # type: ignore[misc]
        finally:
            self.rich_markup_mode = rich

    def format_help_text(self, ctx: Any, formatter: Any) -> None:
        from rich.text import Text

        text = Text.from_markup(self.help or "").plain  # type: ignore[attr-defined]
        if text:
            formatter.write_paragraph()
            formatter.write("\n\n".join(_wrap(p, formatter.width, formatter.current_indent + 2)
                                         for p in text.split("\n\n")) + "\n")

    def format_options(self, ctx: Any, formatter: Any) -> None:
        panels: dict[str, list] = {}
        for param in self.get_params(ctx):  # type: ignore[attr-defined]
            record = param.get_help_record(ctx)
            if record is not None:
                panels.setdefault(getattr(param, "rich_help_panel", None) or "Options", []).append(record)
        for name, records in panels.items():
            with formatter.section(name):
                _write_dl(formatter, records)
        if hasattr(self, "format_commands"):  # a group: its commands too
            self.format_commands(ctx, formatter)


def _wrap(text: str, width: int, indent: int) -> str:
    """`text` wrapped at `width`, never inside a flag (click's wrapper breaks at hyphens: --cpu-|mem)."""
    import textwrap

    pad = " " * indent
    return textwrap.fill(" ".join(text.split()), max(width, indent + 20), initial_indent=pad, subsequent_indent=pad,
                         break_on_hyphens=False, break_long_words=False)


def _write_dl(formatter: Any, rows: list[tuple[str, str]]) -> None:
    """click's definition list (a flag, its help beside it), wrapped by `_wrap`."""
    indent = formatter.current_indent
    first = min(max(len(a) for a, _ in rows), 30) + 2
    for name, text in rows:
        wrapped = _wrap(text, formatter.width, indent + first).lstrip() if text else ""
        if len(name) <= first - 2:
            formatter.write(f"{'':>{indent}}{name:<{first}}{wrapped}\n")
        else:
            formatter.write(f"{'':>{indent}}{name}\n{'':>{indent + first}}{wrapped}\n")


class _Command(_FlagHelp, typer.core.TyperCommand):
    pass


class _Group(_FlagHelp, typer.core.TyperGroup):
    pass


app = typer.Typer(
    name="finetune", add_completion=False, pretty_exceptions_enable=False, cls=_Group,
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


def _fail(message: str, *, every_rank: bool = False) -> None:
    from .launch import from_env

    info = from_env()  # several ranks: say which one failed (unless all did alike)
    where = f"rank {info.rank}: " if info.several and not every_rank and not message.startswith("rank ") else ""
    sys.stderr.write(f"error: {where}{message}\n")  # one line, never wrapped by rich
    sys.stderr.flush()
    raise typer.Exit(EXIT_USER_ERROR)


def user_errors(fn):
    """Turn user-caused errors into `error: ...` + exit 2 (never a traceback)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except TierwiseError as e:
            from .launch import from_env

            if e.every_rank and not from_env().main:  # every rank has it: rank 0 alone says so
                raise typer.Exit(EXIT_USER_ERROR)
            _fail(str(e).splitlines()[0] if str(e) else type(e).__name__, every_rank=e.every_rank)
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


def Opt(default: typing.Any, *decls: str, **kw: typing.Any) -> typing.Any:
    """typer.Option with its default shown; a flag (a bool default, or --x/--no-x) shows no
    <bool> value."""
    if (isinstance(default, bool) or any("/" in d for d in decls)) and kw.get("metavar") is None:
        kw["metavar"] = ""
    kw.setdefault("show_default", True)
    return typer.Option(default, *decls, **kw)


def config_options(*, plan: bool = False):
    """Give the decorated command one typer option per TrainConfig option field (all of them,
    or with `plan` those marked for `finetune plan`), grouped by panel, between its first
    parameter (the context) and its own options: each with the field's default, help, panel,
    flag and choices. The command receives them as plain keywords (choices as strings)."""
    hints = typing.get_type_hints(TrainConfig)

    def decorate(fn):
        own = list(inspect.signature(fn).parameters.values())
        extra = []
        for f in sorted(option_fields(), key=lambda f: PANELS.index(f.metadata["cli"]["panel"])):
            meta = f.metadata["cli"]
            if plan and not meta["plan"]:
                continue
            kind = hints[f.name]
            args = [a for a in typing.get_args(kind) if a is not type(None)]
            if meta["choices"]:  # typer shows an Enum's values as the choices
                args = [Enum(f.name, {c: c for c in meta["choices"]}, type=str)]
            annotation = Optional[args[0]] if args else kind
            decls = [meta["flag"]] if meta["flag"] else []
            info = Opt(f.default, *decls, help=meta["help"], rich_help_panel=meta["panel"],
                       metavar="" if bool in (kind, *args) else None)  # (a None default: a flag too)
            if f.name == "seq_len":  # text: `plan --seq-len max` is the longest that fits; training says so
                annotation = str
                info = Opt(str(f.default), *decls, help=meta["help"] + (" `max`: the longest that fits the budgets."
                                                                         if plan else ""),
                           rich_help_panel=meta["panel"], metavar="<int|max>" if plan else "<int>")
            extra.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=info,
                                           annotation=annotation))

        @functools.wraps(fn)
        def command(*args, **kwargs):
            plain = {k: v.value if isinstance(v, Enum) else v for k, v in kwargs.items()}
            return fn(*args, **plain)

        own = [p for p in own if p.kind is not p.VAR_KEYWORD]
        params = own[:1] + extra + [p.replace(kind=p.KEYWORD_ONLY) for p in own[1:]]  # ctx, the options, its own
        command.__signature__ = inspect.Signature(params)
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return decorate


PLAN_PANEL = "Plan output"

CONFIG_OPTION = Opt(None, "--config", help="TOML file holding any of these options "
                    "(e.g. gpu-mem = \"24G\"); command-line flags win; unknown keys are errors.",
                    is_eager=True, callback=config_callback, rich_help_panel=OUTPUT,
                    dir_okay=False)


@app.callback(invoke_without_command=True)
@user_errors
@config_options()
def train(ctx: typer.Context, config: Optional[Path] = CONFIG_OPTION, **options) -> None:
    """Fine-tune a model (the default command). See the panels below; `finetune plan --help`."""
    if ctx.invoked_subcommand is not None:
        return
    raise_config_error(ctx)
    flags_win(ctx, options)
    if str(options.get("seq_len")) == "max":
        raise TierwiseError("--seq-len max is `finetune plan`'s search for the longest length that fits: run "
                            "`finetune plan --seq-len max` with these options, then train at the length it finds")
    options["seq_len"] = _whole(options.get("seq_len"), "--seq-len")
    cfg = TrainConfig(**options)
    from .launch import from_env, relaunch

    if cfg.nnodes > 1 and not cfg.dry_run:  # the planner prices nodes; torchrun starts them
        raise TierwiseError(f"--nnodes {cfg.nnodes} plans several nodes (`finetune plan`, --dry-run); to train across "
                          f"nodes start `torchrun --nnodes {cfg.nnodes} --node-rank I ... -m tierwise.cli.main ...` "
                          f"on each node")
    if cfg.nproc_per_node > 1 and not cfg.dry_run and not from_env().several:  # torchrun starts the ranks
        if cfg.resume:  # one line and exit 2 here, not one per rank under torchrun
            from .train import check_world

            check_world(Path(cfg.output), cfg.nproc_per_node)
        code = relaunch(cfg.nproc_per_node, sys.argv[1:])
        if code:
            raise typer.Exit(code)
        return
    from .train import run

    console = Console()
    if not console.is_terminal:  # a log file: lines whole, never folded at 80 columns
        console.soft_wrap = True
    code = run(cfg, console=console)
    if code:
        raise typer.Exit(code)


@app.command(cls=_Command)
@user_errors
@config_options(plan=True)
def plan(
    ctx: typer.Context,
    json_out: bool = Opt(False, "--json", help="Print the plan as JSON.", rich_help_panel=PLAN_PANEL),
    verify: bool = Opt(False, "--verify", help="Also run a few real steps with these settings "
                       "on this machine (simulated device without CUDA) and print planned vs "
                       "measured bytes per tier; exit 0 on PASS, 1 on FAIL.", rich_help_panel=PLAN_PANEL),
    verify_steps: int = Opt(3, "--verify-steps", help="Steps --verify runs (the first is the "
                            "warm-up; a LoRA run's base reads are compared from the third: at least 3).",
                            rich_help_panel=PLAN_PANEL),
    config: Optional[Path] = Opt(None, "--config", is_eager=True, callback=config_callback,
                                 dir_okay=False, help="TOML file of options (train keys that "
                                 "plan does not use are ignored).", rich_help_panel=PLAN_PANEL),
    **options,
) -> None:
    """Show where every chunk would live, the predicted peaks per tier and the step time.

    Example: finetune plan --model llama-8b --qlora --gpu-mem 24G --cpu-mem 64G --seq-len max

    --seq-len max: the longest context that fits. --hardware rtx4090: plan that machine from this one.

    --verify: run 3 real steps here and compare them with the plan."""
    raise_config_error(ctx)
    flags_win(ctx, options)
    from .diskspace import plan_line as disk_line
    from .planning import (AUTO_OFFLOADED, OFFLOADED, SEQ_STEP, advise, check_budgets, local_notes, longest,
                           longest_line, make_plan, precision_note, print_plan, resolve_offload, resolve_recompute,
                           seq_len_note, share_note, verify_plan)

    search = str(options.get("seq_len")) == "max"
    if search and verify:
        raise TierwiseError("--verify runs one length: give --seq-len N (`--seq-len max` first finds it)")
    options["seq_len"] = SEQ_STEP if search else _whole(options.get("seq_len"), "--seq-len")
    cfg = TrainConfig(**options)
    chosen = cfg.precision_note  # (a TrainConfig replaced later resolves none: its precision is set)
    if search:
        cfg, result = longest(cfg, here=False)
        print_plan(result, console=Console(), as_json=json_out)
        if not json_out:
            Console().print(longest_line(cfg, result), highlight=False, soft_wrap=True)
        return

    auto = cfg.offload_activations is None
    auto_share = cfg.recompute is None and cfg.recompute_layers is None
    cfg = resolve_offload(resolve_recompute(cfg, here=bool(verify)), here=bool(verify), ranks=not verify)
    if verify:
        if json_out:
            raise TierwiseError("--verify prints a table: drop --json")
        if auto and cfg.offload_activations:
            Console(stderr=True).print(OFFLOADED, highlight=False, soft_wrap=True)
        if cfg.nproc_per_node * cfg.nnodes > 1:
            raise TierwiseError("--verify runs one rank on this machine: drop --nproc-per-node / --nnodes")
        check_budgets(cfg, here=True)  # --verify trains here, whatever resolve_recompute priced
        code = verify_plan(cfg, steps=verify_steps, console=Console())
        if code:
            raise typer.Exit(code)
        return
    try:
        result = make_plan(cfg, ranks=True, here=False)
    except InfeasibleBudget as e:
        if auto and cfg.offload_activations:  # (its minimum is the offloaded plan's)
            e = InfeasibleBudget(str(e).splitlines()[0] + AUTO_OFFLOADED, minimum=e.minimum)
        if not json_out:
            advise(cfg, e, console=Console(), ranks=True, here=False, given=options)
            beyond = seq_len_note(cfg)  # (a length beyond the model's positions is worth saying refused too)
            if beyond:
                Console(stderr=True).print(beyond, highlight=False, soft_wrap=True)
        raise e from None
    if auto and cfg.offload_activations and not json_out:
        Console(stderr=True).print(OFFLOADED, highlight=False, soft_wrap=True)
    print_plan(result, console=Console(), as_json=json_out)
    if not json_out:
        Console(stderr=True).print(disk_line(cfg, result), highlight=False, soft_wrap=True)
    if cfg.pack and not json_out:
        how = ("the S x S mask this takes is in the plan" if result.padded else
               "attended one document at a time: no S x S mask")
        Console(stderr=True).print("packing: " + (f"each document attends only to itself (position ids from 0 in "
                                                  f"each; {how})" if result.row_positions else
                                                  "documents attend to the ones before them in their block"),
                                   highlight=False, soft_wrap=True)
    beyond = seq_len_note(cfg)
    share = share_note(cfg, result, here=False) if auto_share else None
    bf16 = precision_note(cfg, result, chosen=chosen, here=False)
    for note in local_notes(cfg, result) + [n for n in (share, bf16, beyond) if n]:  # stderr, also with --json
        Console(stderr=True).print(note, highlight=False, soft_wrap=True)


def _whole(value: object, flag: str) -> int:
    """A whole number given as text, else a one-line error."""
    try:
        return int(str(value))
    except ValueError:
        raise TierwiseError(f"{flag} takes a whole number (or, for `plan`, max), got {value!r}") from None


@app.command(cls=_Command)
@user_errors
def profile(
    hardware: Optional[str] = Opt(None, help="Name to save the measured hardware profile as."),
    output: Optional[str] = Opt(None, help="Write the profile TOML here."),
    nvme_path: Optional[str] = Opt(None, help="Directory on the NVMe drive to measure (the one "
                                   "--nvme-path will name; default: the system's temp directory)."),
) -> None:
    """Measure this machine's link bandwidths and compute speed into a hardware profile.

    Example: finetune profile --output me.toml, then finetune plan --hardware me.toml ..."""
    from .planning import profile as run_profile

    if nvme_path is not None:
        TrainConfig(nvme_path=nvme_path)  # the same checks as training's --nvme-path
    run_profile(hardware=hardware, output=output, nvme_path=nvme_path, console=Console())


@app.command(cls=_Command)
@user_errors
def generate(
    run: Path = typer.Argument(..., help="A finished run's --output (its model/ or adapter/)."),
    prompt: str = Opt(..., "--prompt", help="What to answer."),
    max_new_tokens: int = Opt(64, "--max-new-tokens", help="Tokens to generate at most."),
    chat: Optional[bool] = Opt(None, "--chat/--no-chat", help="Through the tokenizer's chat template "
                               "(default: when it has one).", show_default=False),
    temperature: float = Opt(0.0, "--temperature", help="0: greedy; above: sampling."),
    trust_remote_code: bool = Opt(False, "--trust-remote-code", help="Allow a model that ships its "
                                  "own Python code."),
) -> None:
    """Answer a prompt with the model a run trained: a LoRA run's adapter over its base as it
    trained (an NF4 or int8 base decoded from the same encoding).

    Example: finetune generate run --prompt "The capital of France is" --max-new-tokens 16"""
    if max_new_tokens < 1:
        raise TierwiseError("--max-new-tokens must be at least 1")
    if not temperature >= 0:
        raise TierwiseError(f"--temperature must be 0 or more, got {temperature}")
    from .generate import generate as answer, load_trained

    model, tokenizer = load_trained(run, trust_remote_code=trust_remote_code)
    print(answer(model, tokenizer, prompt, max_new_tokens=max_new_tokens, chat=chat, temperature=temperature))


@app.command(cls=_Command)
@user_errors
def export(
    merge: bool = Opt(False, "--merge", help="Merge a LoRA adapter into its base model: the "
                      "only export, done with or without this flag."),
    adapter: Optional[Path] = Opt(None, "--adapter", help="PEFT adapter directory "
                                  "(adapter_config.json + adapter_model.safetensors), or the run's "
                                  "--output holding it."),
    base: Optional[Path] = Opt(None, "--base", help="The base model directory the adapter was "
                               "trained on (safetensors; default: the one its adapter_config.json "
                               "names, where that directory is here). For a QLoRA run: the original, "
                               "unquantised checkpoint; the delta goes onto its weights, so the "
                               "NF4 rounding is not baked into the merged model."),
    output: Optional[Path] = Opt(None, "--output", help="Directory to write the merged Hugging "
                                 "Face model to (empty or new)."),
    dtype: Optional[str] = Opt(None, "--dtype", help="fp32 | bf16 | fp16 for the written "
                               "weights (default: each tensor's dtype in the base)."),
    cpu_mem: str = Opt("2G", "--cpu-mem", help="Host memory the merge may use besides the "
                       "program itself; larger tensors are processed in blocks of rows."),
    shard_size: str = Opt("5G", "--shard-size", help="Largest safetensors shard written."),
    overwrite: bool = Opt(False, "--overwrite", help="Replace the model files in a non-empty "
                          "--output."),
    trust_remote_code: bool = Opt(False, "--trust-remote-code", help="Allow a base model that "
                                  "ships its own Python code."),
) -> None:
    """Merge a LoRA adapter into its base: an ordinary Hugging Face model directory.

    Streamed shard by shard (never the whole model in memory).

    Example: finetune export --adapter run/adapter --base ./llama --output ./llama-merged"""
    del merge  # (the only export: accepted, not required)
    if adapter is not None and not adapter.is_dir():  # (before the base it would name is looked for)
        raise TierwiseError(f"--adapter {adapter}: not a directory")
    if adapter is not None and not (adapter / "adapter_config.json").exists():
        if (adapter / "adapter" / "adapter_config.json").exists():
            adapter = adapter / "adapter"  # a run's --output, as `finetune generate` takes it
        elif (adapter / "model" / "config.json").exists():
            raise TierwiseError(f"--adapter {adapter} is a full fine-tune's output: its model is already "
                                f"{adapter / 'model'} (no adapter to merge)")
    if base is None and adapter is not None:
        base = _adapter_base(adapter)
    for flag, value in (("--adapter", adapter), ("--base", base), ("--output", output)):
        if value is None:
            raise TierwiseError(f"export needs {flag} (the adapter, the base it was trained on, where to write)")
    from .merge import merge as run_merge

    out = run_merge(adapter, base, output, dtype=dtype, cpu_mem=cpu_mem,
                    max_shard_size=shard_size, overwrite=overwrite,
                    trust_remote_code=trust_remote_code)
    Console().print(f"merged {adapter} into {base}: {out}", highlight=False)


def _adapter_base(adapter: Path) -> Optional[Path]:
    """The base an adapter's config names, where that is a directory here (else None)."""
    import json

    try:
        named = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError):
        return None
    return Path(named) if isinstance(named, str) and named and Path(named).is_dir() else None


def _run_app() -> None:
    """The app, with click's usage errors (a bad flag value, an unknown flag or choice) as one
    `error:` line and exit 2, as every other bad input: click would print a usage box."""
    # click's UsageError: typer's BadParameter derives from it (typer >= 0.2x vendors its own click)
    usage_error = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")
    try:
        code = app(standalone_mode=False)  # returns the exit code of typer.Exit / --help instead of exiting
    except usage_error as e:
        where = e.ctx.command_path if e.ctx is not None else "finetune"  # e.g. "finetune plan"
        print(f"error: {e.format_message()} ({where} -h for help)", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    except typer.Abort:  # Ctrl-C outside a run (a run handles its own)
        print("Aborted!", file=sys.stderr)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) and not isinstance(code, bool) else 0)  # typer.Exit's code; commands return None


#: glibc's mallopt parameter and its default start value (bytes): an allocation this large or
#: larger gets pages of its own, which go back to the OS when it is freed.
M_MMAP_THRESHOLD, MMAP_THRESHOLD = -3, 128 << 10


def fix_mmap_threshold() -> bool:
    """Keep glibc's mmap threshold at its start value. glibc raises it (up to 32 MiB) each time a
    large buffer is freed, after which buffers of chunk size come from its heaps, where freed
    ones stay resident: a 0.6B run's RSS grew by 0.6 GiB over its budgets from its second step
    on (bench/host_rss.py), and by none with the threshold fixed, at the same step time. A
    user's MALLOC_MMAP_THRESHOLD_ wins; not glibc: nothing to do. True when it was set."""
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc" or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        return bool(ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False


def main() -> None:
    """Console-script entry point. One of several ranks ends with os._exit once its output is
    flushed: the interpreter's teardown can wait seconds on the process groups' threads after a
    peer failed (measured 5 s), while the launcher waits for every rank."""
    from .launch import from_env

    # CUDA's caching allocator grows segments instead of carving fixed ones: a capped 6 GiB
    # budget on an H200 lost 295 MiB to fragmentation without it. Read at CUDA's first
    # allocation, so set before any; a user's own setting wins.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    fix_mmap_threshold()
    if not from_env().several:
        _run_app()
        return
    code = 1
    try:
        _run_app()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - printed as Python would, then the same quick exit
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    main()
