"""The run configuration: one validated dataclass, and TOML files as option defaults.

`--config FILE.toml` holds any option of `finetune` (dashes or underscores, e.g.
`gpu-mem = "24G"`); options given on the command line win; an unknown key is an error.
Flags and TOML keys come from one place: the fields of TrainConfig and their `option`
metadata (cli.main builds the typer options from them).
Mechanism: the eager `--config` callback loads the file into click's `default_map`, so file
values go through exactly the same type conversion as command-line values.
"""

from __future__ import annotations

import errno
import json
import math
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..offload.core.chunks import ALIGN
from ..offload.core.errors import TierwiseError
from ..offload.core.sizes import parse_size
from ..offload.core.nodes import parse_node_list
from ..offload.update.table import NAMES as OPTIMIZERS
from ..offload.core.vocab import BASE_DTYPES, COMPUTE_DTYPES as PRECISIONS, GRAD_REDUCE
_META_ERROR = "tierwise.config_error"


class ConfigError(TierwiseError):
    """A --config file or an option value is invalid."""


#: errno values that mean "no room to write": a full disk, a quota, a file size limit.
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def load_toml(path: "str | Path") -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: bad TOML: {str(e).splitlines()[0]}") from None
    except UnicodeDecodeError as e:  # a binary file: not TOML at all
        raise ConfigError(f"{path}: not a TOML text file (invalid UTF-8 at byte {e.start})") from None
    nested = [k for k, v in data.items() if isinstance(v, dict)]
    if nested:
        raise ConfigError(f"{path}: tables are not supported ([{nested[0]}]); "
                          "put every option at the top level")
    return {k.replace("-", "_"): v for k, v in data.items()}


def config_callback(ctx, param, value):
    """Eager `--config` callback: file values become this command's defaults.

    Errors are parked in ctx.meta and raised by `raise_config_error` inside the command, so
    they reach the CLI's one-line error path instead of click's usage box.
    """
    if not value:
        return value
    known = set(TOML_KEYS)
    mine = {p.name for p in ctx.command.params}
    try:
        data = load_toml(value)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{value}: unknown key '{unknown[0].replace('_', '-')}' "
                              f"(known: {', '.join(sorted(k.replace('_', '-') for k in known))})")
        for key, v in data.items():
            if key in mine:
                check_toml_type(value, key, v)
    except ConfigError as e:
        ctx.meta[_META_ERROR] = str(e)
        return value
    ctx.default_map = {**(ctx.default_map or {}), **{k: v for k, v in data.items() if k in mine}}
    return value


def check_toml_type(path, key: str, value) -> None:
    """A TOML value must have its TrainConfig field's type: `steps = true` is not a step count,
    and `gpu-mem = 24` not a size (click would turn both into something)."""
    f = {f.name: f for f in fields(TrainConfig) if f.init}.get(key)
    if f is None:
        return
    kinds = set(str(f.type).replace(" ", "").split("|")) - {"None"}
    if kinds == {"bool"}:
        ok, want = isinstance(value, bool), "true or false"
    elif kinds == {"int"}:
        ok, want = isinstance(value, int) and not isinstance(value, bool), "a whole number"
    elif kinds == {"float"}:
        ok, want = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
    elif key == "cxl_node":  # 1, "1,2" or [1, 2]
        ok, want = isinstance(value, (int, str, list)) and not isinstance(value, bool), "a node id or a list"
    elif key in ("gpu_mem", "cpu_mem", "cxl_mem", "nvme_mem", "chunk_size"):
        ok, want = isinstance(value, str), 'a size in quotes, e.g. "24G"'
    else:
        ok, want = isinstance(value, str), "a string in quotes"
    if not ok:
        raise ConfigError(f"{path}: {key.replace('_', '-')} = {json.dumps(value)}: expected {want}")


def option_fields() -> list:
    """TrainConfig's fields that are options (flags and TOML keys), in declaration order."""
    return [f for f in fields(TrainConfig) if "cli" in f.metadata]


def command_flags(options: dict, *, drop: "set[str]" = frozenset()) -> list[str]:
    """The command-line flags that give `options` (field name -> value, as a command received
    them): those that differ from their defaults, but the fields in `drop`."""
    out: list[str] = []
    for f in option_fields():
        value = options.get(f.name, f.default)
        if f.name in drop or value == f.default or value is None:
            continue
        flag = f.metadata["cli"]["flag"]
        if isinstance(value, bool):
            on, _, off = (flag or "--" + f.name.replace("_", "-")).partition("/")
            out.append(on if value else off)
        else:
            out += ["--" + f.name.replace("_", "-"), str(value)]
    return out


def raise_config_error(ctx) -> None:
    if _META_ERROR in ctx.meta:
        raise ConfigError(ctx.meta[_META_ERROR])


#: Options that exclude each other: one given on the command line drops the other's value from
#: the --config file (command-line flags win).
EXCLUSIVE = (("steps", "epochs"),)


#: Options that mean something in a LoRA run only.
LORA_ONLY = ("lora_alpha", "lora_dropout", "lora_targets", "base_dtype")


def flags_win(ctx, options: dict) -> None:
    """Drop a --config value that a command-line flag excludes (see EXCLUSIVE), and the file's
    LoRA-only values when the command line turns its LoRA off (--lora-rank 0, --no-qlora)."""
    from_file = set((ctx.default_map or {}))

    def on_command_line(name: str) -> bool:
        source = ctx.get_parameter_source(name)
        return source is not None and source.name == "COMMANDLINE"

    for a, b in EXCLUSIVE:
        for given, other in ((a, b), (b, a)):
            if on_command_line(given) and other in from_file and not on_command_line(other):
                options[other] = None
    no_rank = options.get("lora_rank") in (None, 0)
    if (on_command_line("lora_rank") and options.get("lora_rank") == 0
            or on_command_line("qlora") and not options.get("qlora") and no_rank):
        defaults = {f.name: f.default for f in fields(TrainConfig)}
        for key in LORA_ONLY:
            if key in from_file and not on_command_line(key):
                options[key] = defaults[key]


# Panels of `finetune --help`.
PANELS = MODEL, LORA, MEMORY, OPTIM, SCHED, OUTPUT, HW = (
    "Model & data", "LoRA / QLoRA", "Memory budget", "Optimizer", "Schedule", "Output & resume", "Hardware & plan")
PRECISIONS_EXPORT = ("bf16", "fp16", "fp32")
SCHEDULES = ("cosine", "linear", "constant")
REPORTERS = ("none", "tensorboard", "wandb")
QLORA_RANK = 16  # --qlora's rank unless --lora-rank is given


def option(help: str, *, panel: str, flag: str | None = None, choices: tuple[str, ...] | None = None,
           plan: bool = False) -> dict:
    """A TrainConfig field's command-line option (dataclass field metadata): cli.main builds
    the typer options from these, and --config's TOML keys are the same field names, so a flag,
    its default and its TOML key cannot drift apart. `flag`: click's declaration when not the
    plain `--field-name` (e.g. "--recompute/--no-recompute"); `choices`: the allowed values;
    `plan`: `finetune plan` takes it too."""
    return {"cli": {"help": help, "panel": panel, "flag": flag, "choices": choices, "plan": plan}}


def _f(default, help: str, **kw):
    return field(default=default, metadata=option(help, **kw))


@dataclass(kw_only=True)
class TrainConfig:
    """Everything one `finetune` run needs; built from the merged options. Each field with
    `option` metadata is a command-line flag and a --config TOML key (see `option`)."""

    model: str | None = _f(None, "Hugging Face model directory, Hub id (ORG/NAME: the local cache first), or a "
                           "model profile name (random init). "
                           "Default: the built-in tiny model.", panel=MODEL, plan=True)
    """HF model dir or model profile name; None = the built-in tiny model."""
    data: str | None = _f(None, "JSONL ({\"text\"} | {\"prompt\",\"completion\"} | {\"messages\"}) or a "
                          "`datasets` directory. Default: built-in sample. (`plan`: the plan is for its "
                          "worst batch, padded or not; without it, padded; --verify runs on it.)",
                          panel=MODEL, plan=True)
    trust_remote_code: bool = _f(False, "Run the Python code a model directory ships (auto_map in config.json); "
                                 "read it first. Without it such a model is refused.", panel=MODEL,
                                 flag="--trust-remote-code", plan=True)
    """Run the Python code a model directory ships (auto_map in config.json); without it such a
    model is refused (never transformers' interactive prompt)."""
    """JSONL file or `datasets` directory; None = the built-in sample."""
    eval_data: str | None = _f(None, "Held-out data in the same formats (default: none, no eval loss).", panel=MODEL)
    seq_len: int = _f(128, "Tokens per sequence (rows are packed to this length).", panel=MODEL, plan=True)
    batch_size: int = _f(4, "Sequences per micro-batch.", panel=MODEL, plan=True)
    """Micro-batch size; one optimizer step sees batch_size * grad_accum sequences."""
    grad_accum: int = _f(1, "Micro-batches per optimizer step.", panel=OPTIM, plan=True)
    pack: bool = _f(True, "Pack rows into full sequences (else truncate/pad each row).", panel=MODEL, plan=True)
    lora_rank: int | None = _f(None, "Train LoRA adapters of this rank over a frozen base instead of every "
                               "weight (PEFT's LoRA; the export is a PEFT adapter directory, OUTPUT/adapter). "
                               "Default (or 0): full fine-tuning.", panel=LORA, plan=True)
    """LoRA rank; None: full fine-tuning (with --qlora: QLORA_RANK)."""
    lora_alpha: float | None = _f(None, "LoRA scaling numerator (the update is alpha/rank * B A). Default: "
                                  "2 x rank.", panel=LORA, plan=True)
    """Decision: 2 x rank when not given (the common choice, e.g. r=16 alpha=32), resolved here."""
    lora_dropout: float = _f(0.0, "Dropout on the adapters' input, in [0, 1).", panel=LORA, plan=True)
    lora_targets: str = _f("all-linear", "Modules that get adapters: comma-separated names (q_proj,v_proj) or "
                           "all-linear (every linear layer but the output head; on Gemma-3 4B+ the vision "
                           "tower's too, as PEFT's, and a name matches its layers too: text never trains them).",
                           panel=LORA, plan=True)
    base_dtype: str | None = _f(None, "How the frozen base is stored and streamed: fp32 bf16 fp16 int8 nf4 "
                                "(int8/nf4: the linear layers' weights, bitsandbytes' formats; nf4 with its absmax "
                                "double-quantized, the QLoRA recipe). Default: "
                                "--precision. LoRA runs only.", panel=LORA, choices=BASE_DTYPES, plan=True)
    qlora: bool = _f(False, f"QLoRA: LoRA (rank {QLORA_RANK} unless --lora-rank) over an NF4 base with double "
                     "quantization.", panel=LORA, flag="--qlora/--no-qlora", plan=True)
    """Shorthand for --lora-rank 16 --base-dtype nf4 (an NF4 base is always double-quantized)."""
    gpu_mem: str | None = _f(None, "GPU memory to use, e.g. 24G (default: the GPU's free memory; without CUDA "
                             "the simulated device, in host RAM: 8 GiB or half the RAM, whichever is less). Sizes: "
                             "K/M/G/T and KiB..TiB are powers of 1024, KB/MB/GB/TB of 1000 (24GB is 22.35 GiB).",
                             panel=MEMORY, plan=True)
    cpu_mem: str | None = _f(None, "Host RAM to use, e.g. 256G (default: this machine's RAM less the process's "
                             "own ~0.4 GiB and, without CUDA, the simulated device's --gpu-mem).", panel=MEMORY,
                             plan=True)
    cxl_mem: str | None = _f(None, "CXL memory to use, e.g. 512G (default: none, no CXL tier).", panel=MEMORY, plan=True)
    cxl_node: "str | int | tuple[int, ...] | None" = _f(
        None, "NUMA node(s) of the CXL memory, e.g. 1 or 1,2 (pages interleave across several; default: every "
        "CXL node).", panel=MEMORY, plan=True)
    """CXL NUMA node(s): 1, "1,2" or [1, 2]; parsed to a tuple of ids (None: every CXL node)."""
    nvme_path: str | None = _f(None, "Directory on an NVMe drive for swap files.", panel=MEMORY, plan=True)
    nvme_mem: str | None = _f(None, "NVMe capacity to plan with, e.g. 2T: the drive of the machine --hardware "
                              "names (a run here always uses --nvme-path's free space).", panel=MEMORY, plan=True)
    """A what-if plan's drive (`plan --hardware NAME --nvme-path DIR --nvme-mem 2T`); without it such a
    plan takes the profile's capacity. Never used for a run on this machine."""
    nvme_checksum: bool = _f(True, "Checksum every swap block and verify it on read (a corrupted swap file "
                             "stops the run).", panel=MEMORY, flag="--nvme-checksum/--no-nvme-checksum")
    """crc32 of every swap block, checked on read: a corrupted swap file stops the run instead
    of training on garbage (cost measured in the README's "Runs that share a machine, and damaged files")."""
    offload_activations: bool | None = _f(None, "Keep each block's input off the GPU between forward and backward: in "
                                          "host RAM, else CXL memory (--cxl-mem), else the NVMe swap (--nvme-path), "
                                          "as the plan places it; less GPU memory for long sequences. Default: only "
                                          "when the plan needs "
                                          "it (the GPU budget holds the activations no other way), as `finetune "
                                          "plan` shows.", panel=MEMORY,
                                          flag="--offload-activations/--no-offload-activations", plan=True)
    """Keep checkpointed blocks' inputs off the device between forward and backward; None (auto):
    on where no plan fits without it and one fits with it (cli.planning.resolve_offload)."""
    recompute: bool | None = _f(None, "Recompute each decoder layer's activations in backward (activation "
                                "checkpointing: the smallest GPU budget), or keep them all (about 25% less "
                                "compute). Default: keep them when the GPU budget holds them, else recompute the "
                                "first layers that make it fit (--recompute-layers) or all, whichever the plan "
                                "finds faster, as `finetune plan` shows (on CUDA only with --gpu-mem given).", panel=MEMORY,
                                flag="--recompute/--no-recompute", plan=True)
    """Activation checkpointing of the decoder layers; False keeps every layer's activations;
    None (auto): off when the planner finds that the GPU budget holds them, else the first
    layers or all, whichever the planner finds faster; on with --offload-activations
    (cli.planning.resolve_recompute)."""
    recompute_layers: int | None = _f(None, "Recompute only the first N decoder layers and keep the others' "
                                      "activations: between --no-recompute's speed and --recompute's memory. "
                                      "Default: all of them with --recompute; auto picks N where keeping every "
                                      "layer does not fit.", panel=MEMORY, plan=True)
    """Recompute the first N decoder layers (core.options.recomputed_blocks); None: as --recompute
    says. Set by cli.planning.resolve_recompute where auto picks a share."""
    chunk_size: str = _f("64M", "Bytes of fp32 weights per chunk.", panel=HW, plan=True)
    optimizer: str = _f("adamw", "Optimizer, and its state per trainable parameter: adamw 8 B; adamw8bit about "
                        "2 B (embeddings 8); galore, galore8bit, apollo, apollo-mini: low-rank moments (a "
                        "fraction of AdamW's); sgd none; mezo none, and no gradients "
                        "(zeroth order). docs/optimizers.md compares them.", panel=OPTIM, choices=OPTIMIZERS,
                        plan=True)
    lr: float | None = _f(None, "Peak learning rate (default: 1e-4; 2e-4 with --lora/--qlora, as the QLoRA "
                          "recipe; 1e-3 for the built-in demo).", panel=OPTIM)
    """Peak learning rate; None: DEFAULT_LR, LORA_LR for a LoRA run, or DEMO_LR for the built-in demo."""
    weight_decay: float = _f(0.0, "Decoupled weight decay.", panel=OPTIM)
    grad_clip: float | None = _f(None, "Clip the global grad norm to this value (default: no clipping).", panel=OPTIM)
    skip_nonfinite: int = _f(0, "Skip the update of a step whose loss (or, with --grad-clip, gradient norm) is "
                             "NaN/inf, up to N steps in a row; 0: stop the run at the first.", panel=OPTIM)
    """Skip (no update) a step whose loss, or with --grad-clip gradient norm, is NaN/inf, up to
    this many in a row; the next one stops the run. 0: stop at the first."""
    precision: str | None = _f(None, "Compute precision (default: bf16 for --lora/--qlora on a GPU, as QLoRA "
                               "trains; fp32 otherwise).", panel=HW, choices=PRECISIONS, plan=True)
    """None: resolved by `default_precision` (after --qlora); `precision_note` says why when it chose."""
    steps: int | None = _f(None, "Optimizer steps (default: one epoch; three epochs for the built-in demo).",
                           panel=SCHED)
    epochs: int | None = _f(None, "Epochs over --data (instead of --steps).", panel=SCHED)
    warmup_steps: int = _f(0, "Linear warmup steps: N steps rising from lr/(N+1) to --lr.", panel=SCHED)
    schedule: str = _f("cosine", "LR decay after warmup: cosine or linear toward 10% of --lr, reached just "
                       "after the last step (a floor, unlike transformers' schedules, which end at 0); "
                       "constant: none.",
                       panel=SCHED, choices=SCHEDULES)
    eval_every: int = _f(0, "Evaluate on --eval-data every N steps (0: at the end only).", panel=SCHED)
    checkpoint_every: int = _f(0, "Checkpoint every N steps (0: only at the end; always on Ctrl-C).", panel=OUTPUT,
                               plan=True)
    log_every: int = _f(0, "With output not a terminal (nohup, a scheduler, > log): a progress line every N steps "
                        "(0: about 100 lines a run).", panel=OUTPUT)
    keep_checkpoints: int = _f(2, "Complete checkpoints to keep (0: all).", panel=OUTPUT, plan=True)
    report_to: str = _f("none", "Also log loss, lr, tokens/s and each tier's peak to TensorBoard (OUTPUT/tensorboard) "
                        "or to W&B in offline mode (OUTPUT/wandb; `wandb sync` uploads it). Needs that package.",
                        panel=OUTPUT, choices=REPORTERS)
    seed: int = _f(0, "Seed for init, data order and sampling.", panel=SCHED)
    output: str = _f("output", "Run directory: checkpoints, metrics, plots, model/.", panel=OUTPUT)
    resume: bool = _f(False, "Continue the run in --output from its latest checkpoint, on exactly the next "
                      "batch.", panel=OUTPUT, flag="--resume")
    reset_optimizer: bool = _f(False, "With --resume: continue the weights, RNG and data position, but start "
                               "--optimizer (it may differ) from fresh state.", panel=OUTPUT,
                               flag="--reset-optimizer")
    """With --resume: keep the checkpoint's weights, RNG and data position, start the optimizer
    (--optimizer, possibly another one) from fresh state. Without it a changed --optimizer is
    refused."""
    overwrite: bool = _f(False, "Empty --output first: only a directory an earlier finetune run made, holding only what a run writes (anything else there is refused, never deleted).",
                         panel=OUTPUT, flag="--overwrite/--no-overwrite")
    export_dtype: str | None = _f(None, "Dtype of the exported model (default: --precision).", panel=OUTPUT,
                                  choices=PRECISIONS_EXPORT, plan=True)
    hardware: str | None = _f(None, "Hardware profile name or TOML file (default: this machine: on CUDA the profile its GPU's name matches, with its memory; else cpu-sim).", panel=HW, plan=True)
    dry_run: bool = _f(False, "Resolve model and budgets, print the plan, train nothing.", panel=HW,
                       flag="--dry-run")
    nproc_per_node: int = _f(1, "Processes (one per GPU) on this node: training starts torchrun for you (or run "
                             "`torchrun --nproc-per-node N -m tierwise.cli.main ...`). --cpu-mem and --cxl-mem "
                             "are the node's, divided among them (--cpu-mem by each rank's needs); --gpu-mem is per GPU. `plan` and --dry-run "
                             "price that many ranks.", panel=HW, plan=True)
    """Ranks on this node (cli.launch). Under torchrun its variables say the ranks instead."""
    nnodes: int = _f(1, "Nodes the run spans, for `plan` and --dry-run (to train across nodes, start "
                     "`torchrun --nnodes M --node-rank I ... -m tierwise.cli.main ...` on each).", panel=HW, plan=True)
    """Nodes priced by the planner (offload.plan.ranks); training learns them from torchrun."""
    grad_reduce: str = _f("micro", "Several ranks: 'micro' reduces each chunk's gradient onto its owner after every "
                          "micro-batch (a rank holds only its own chunks' gradients); 'step' keeps every chunk's "
                          "gradient on every rank and reduces once per step (less traffic with --grad-accum > 1).",
                          panel=HW, plan=True, choices=GRAD_REDUCE)
    """Distributed(grad_reduce=...) and the planner's (offload.plan.ranks)."""
    budgets: dict = field(init=False)
    precision_note: "str | None" = field(init=False, default=None)
    """Why a LoRA run computes in fp32 when no --precision was given (a device without bf16)."""
    """Parsed bytes: {"gpu": int|None, "cpu": ..., "cxl": ..., "nvme": ..., "chunk": int}."""

    #: Learning rate when --lr is not given; the built-in demo (no --model, no --data) uses a
    #: larger one and 3 epochs so that its loss visibly falls within seconds.
    DEFAULT_LR, LORA_LR, DEMO_LR, DEMO_EPOCHS = 1e-4, 2e-4, 1e-3, 3

    @property
    def is_demo(self) -> bool:
        return self.model is None and self.data is None

    def __post_init__(self):
        if self.lora_rank == 0:  # (turns a --config file's LoRA off)
            if self.qlora:
                raise ConfigError("--lora-rank 0 is a full fine-tune, --qlora a LoRA run: give one (--no-qlora "
                                  "turns a --config file's qlora off)")
            self.lora_rank = None
        lora = self.lora_rank is not None or self.qlora
        if self.lr is None:
            self.lr = self.DEMO_LR if self.is_demo else self.LORA_LR if lora else self.DEFAULT_LR
        if self.precision is None:
            self.precision, self.precision_note = default_precision(lora=lora, hardware=self.hardware)
            if self.base_dtype == "fp32" and self.precision != "fp32":  # the user's fp32 base: computed in fp32
                self.precision, self.precision_note = "fp32", None
        if self.is_demo and self.steps is None and self.epochs is None:
            self.epochs = self.DEMO_EPOCHS
        # a number (a TOML value too) is text without a unit here, refused as parse_size refuses it
        size = lambda v, flag: parse_size(str(v) if isinstance(v, (int, float)) else v, what=flag)  # noqa: E731
        self.budgets = {
            "gpu": size(self.gpu_mem, "--gpu-mem"),
            "cpu": size(self.cpu_mem, "--cpu-mem"),
            "cxl": size(self.cxl_mem, "--cxl-mem"),
            "nvme": size(self.nvme_mem, "--nvme-mem"),
            "chunk": size(self.chunk_size, "--chunk-size"),
        }
        if not self.budgets["chunk"]:
            raise ConfigError(f"--chunk-size must be positive, got {self.chunk_size!r}")
        if self.budgets["chunk"] < ALIGN * 4:  # the engine's chunks hold at least ALIGN fp32 values
            raise ConfigError(f"--chunk-size {self.chunk_size} is below the smallest chunk, {ALIGN * 4}B")
        if self.nvme_mem is not None and self.nvme_path is None:
            raise ConfigError("--nvme-mem is the capacity of --nvme-path's drive: give --nvme-path too")
        for name in ("gpu", "cpu", "cxl", "nvme"):
            if self.budgets[name] == 0:
                raise ConfigError(f"--{name}-mem must be positive, got 0")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"unknown --optimizer {self.optimizer!r}: use one of {OPTIMIZERS}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"unknown --precision {self.precision!r}: use one of {', '.join(PRECISIONS)}")
        if self.steps is not None and self.epochs is not None:
            raise ConfigError("give --steps or --epochs, not both")
        if self.recompute_layers is not None:
            if self.recompute_layers < 0:
                raise ConfigError(f"--recompute-layers must be at least 0, got {self.recompute_layers}")
            if self.recompute is False:
                raise ConfigError("--recompute-layers recomputes some layers: drop --no-recompute")
            if self.recompute is True and self.recompute_layers == 0:
                raise ConfigError("--recompute-layers 0 recomputes none: drop --recompute (or say --no-recompute)")
        if self.offload_activations and (self.recompute is False or self.recompute_layers == 0):
            raise ConfigError("--offload-activations moves the inputs of recomputed layers: it needs "
                              "recompute (drop --no-recompute / --recompute-layers 0)")
        for name in ("seq_len", "batch_size", "grad_accum", "nproc_per_node", "nnodes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        for name in ("eval_every", "checkpoint_every", "warmup_steps", "keep_checkpoints",
                     "skip_nonfinite", "log_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be 0 or more")
        for name in ("steps", "epochs"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be at least 1")
        if self.reset_optimizer and not self.resume:
            raise ConfigError("--reset-optimizer applies to --resume only")
        if self.eval_every and not self.eval_data:  # else it evaluates nothing, saying nothing
            raise ConfigError("--eval-every applies with --eval-data only: give the held-out data")
        if self.resume and self.overwrite:
            raise ConfigError("give --resume or --overwrite, not both")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"--lr must be a positive number, got {self.lr}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ConfigError(f"--weight-decay must be 0 or a positive number, got {self.weight_decay}")
        if self.grad_clip is not None and not (math.isfinite(self.grad_clip) and self.grad_clip > 0):
            raise ConfigError(f"--grad-clip must be a positive number, got {self.grad_clip}")
        if not 0 <= self.seed < 2**32:
            raise ConfigError(f"--seed must be in 0..{2**32 - 1} (numpy's range), got {self.seed}")
        if self.nvme_path is not None:
            where = Path(self.nvme_path).expanduser().resolve()
            if where in (Path("/"), Path.home().resolve()):
                raise ConfigError(f"--nvme-path {self.nvme_path} is {'/' if where == Path('/') else 'your home directory'}: "
                                  "give a directory for swap files, e.g. /mnt/nvme/tierwise-swap")
            if where.exists() and not where.is_dir():  # else `plan` priced it and the run failed creating it
                raise ConfigError(f"--nvme-path {self.nvme_path} is a file, not a directory: give a directory "
                                  "for swap files (it is created if missing)")
        try:
            self.cxl_node = parse_node_list(self.cxl_node)
        except TierwiseError as exc:
            raise ConfigError(str(exc)) from None
        if self.cxl_node is not None and self.cxl_mem is None:
            raise ConfigError("--cxl-node needs --cxl-mem (how much of that node to use)")
        self._check_lora()

    def _check_lora(self) -> None:
        """Resolve --qlora and the LoRA defaults; refuse combinations that mean nothing."""
        if self.qlora:
            if self.base_dtype not in (None, "nf4"):
                raise ConfigError(f"--qlora stores the base in nf4: drop --base-dtype {self.base_dtype} "
                                  "(or use --lora-rank with --base-dtype)")
            self.lora_rank = QLORA_RANK if self.lora_rank is None else self.lora_rank
            self.base_dtype = "nf4"
        if self.lora_rank is None:
            given = [f for f, v in (("--lora-alpha", self.lora_alpha is not None),
                                    ("--lora-dropout", self.lora_dropout != 0.0),
                                    ("--lora-targets", self.lora_targets != "all-linear"),
                                    ("--base-dtype", self.base_dtype is not None)) if v]
            if given:
                raise ConfigError(f"{given[0]} applies to LoRA runs: add --lora-rank N (or --qlora)")
            return
        if self.lora_rank < 1:
            raise ConfigError(f"--lora-rank must be at least 1 (0: a full fine-tune), got {self.lora_rank}")
        if self.optimizer == "mezo":
            raise ConfigError("--optimizer mezo perturbs every weight: it does not train LoRA adapters")
        if self.lora_alpha is None:
            self.lora_alpha = 2.0 * self.lora_rank
        if not (math.isfinite(self.lora_alpha) and self.lora_alpha > 0):
            raise ConfigError(f"--lora-alpha must be a positive number, got {self.lora_alpha}")
        if not (math.isfinite(self.lora_dropout) and 0 <= self.lora_dropout < 1):
            raise ConfigError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        if self.base_dtype is not None and self.base_dtype not in BASE_DTYPES:
            raise ConfigError(f"unknown --base-dtype {self.base_dtype!r}: use one of {', '.join(BASE_DTYPES)}")
        if self.base_dtype == "fp32" and self.precision != "fp32":
            raise ConfigError(f"--base-dtype fp32 with --precision {self.precision}: the base is computed in "
                              f"{self.precision}; store it in {self.precision}, int8 or nf4")
        if not self.target_list():
            raise ConfigError("--lora-targets is empty: give module names (q_proj,v_proj) or all-linear")

    @property
    def lora(self) -> bool:
        return self.lora_rank is not None

    def target_list(self) -> "list[str] | str":
        """--lora-targets as PEFT's target_modules: "all-linear" or a list of names."""
        if self.lora_targets.strip() == "all-linear":
            return "all-linear"
        return [t.strip() for t in self.lora_targets.split(",") if t.strip()]

    #: Options that change which batch comes next; a resumed run must keep them.
    DATA_KEYS = ("model", "data", "seq_len", "batch_size", "grad_accum", "pack", "seed")
    #: Options that shape the checkpointed engine state (optimizer moments, chunk layout,
    #: master dtype): a resumed run must keep them too.
    STATE_KEYS = ("optimizer", "chunk_size", "precision")
    #: LoRA options (resolved): a resumed run's adapters and base must be the checkpoint's.
    LORA_KEYS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "base_dtype", "qlora")

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("budgets")
        d.pop("precision_note")
        return d


def default_precision(*, lora: bool, hardware: "str | None") -> "tuple[str, str | None]":
    """(precision, note): a LoRA/QLoRA run computes in bf16 where its device has it, as QLoRA
    does: the --hardware profile's GPU, else this machine's CUDA device; fp32 on the simulated
    device (CPU), with a note saying so. A full fine-tune: fp32 (bf16 is a choice: --precision),
    with a note where the device has bf16."""
    if not lora:
        return "fp32", (FULL_FP32 if _gpu_bf16(hardware) else None)
    if _gpu_bf16(hardware):
        return "bf16", None
    if not hardware:
        from .machine import has_cuda

        if has_cuda():
            return "fp32", "this GPU has no bf16: the LoRA run computes in fp32"
    return "fp32", ("LoRA computes in fp32 on the simulated device (CPU); on a GPU it defaults to bf16, "
                    "as QLoRA trains")


#: What a full fine-tune's default precision says on a device with bf16.
FULL_FP32 = ("a full fine-tune computes in fp32 unless --precision bf16 is given (its masters and optimizer "
             "state stay fp32 either way; bf16 halves the activations and the device's copies of the weights)")


def _gpu_bf16(hardware: "str | None") -> bool:
    """Whether the run's device computes in bf16: the --hardware profile's GPU, else this
    machine's CUDA device."""
    if hardware:
        try:
            from ..profiles import load_hardware_profile

            simulated = load_hardware_profile(hardware).simulated
        except Exception:  # noqa: BLE001 - an unknown profile is refused where it is loaded, naming the known ones
            simulated = True
        return not simulated
    from .machine import has_cuda

    if not has_cuda():
        return False
    import torch

    return bool(torch.cuda.is_bf16_supported())


#: --config's keys: every option field (a file may hold train keys `plan` does not use).
TOML_KEYS = tuple(f.name for f in option_fields())
