"""`finetune plan`, `finetune --dry-run` and `finetune profile`: glue to the planner/profiler.

Over 600 lines: the CLI's side of every plan (budgets of this machine, the advice of changes that
fit, recompute resolved, --seq-len max, --verify); the planning itself is offload.plan's."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from rich.console import Console
from rich.table import Table

from .config import ConfigError, TrainConfig, command_flags
from . import machine
from .launch import RankInfo
from .machine import free_disk, physical_ram
from .profilemodel import is_profile, profile_params
from ..offload.core.errors import InfeasibleBudget, TierwiseError, UnsupportedModel
from ..offload.core.units import format_size
from ..offload.plan import planner
from ..offload.plan.planner import Plan
from ..profiles import ProfileError
from ..profiles.model import text_config

if TYPE_CHECKING:
    from .loading import ModelSource
    from ..profiles.hardware import HardwareProfile

log = logging.getLogger(__name__)


def make_plan(cfg: TrainConfig, *, src: "ModelSource | None" = None, padded: bool | None = None,
              ranks: "bool | RankInfo" = False, here: bool = True, check: bool = True) -> Plan:
    """offload.plan.planner.make_plan for this run. `padded`: whether the run's batches can
    hold padding (None: `data_padded`). A model profile (`--model 7b`) plans by name, on a
    machine without torch or transformers too (unless --data must be tokenized); a model
    directory or the built-in model needs them (their parameters are read off the module
    training builds, on the meta device).
    A LoRA run is priced as one: frozen base at its encoded bytes, adapters and their state.
    `ranks`: True: price --nproc-per-node x --nnodes ranks (`plan`, --dry-run; offload.plan.ranks);
    several ranks torchrun started (a RankInfo): price them (`started_ranks`, training's pre-flight);
    else one rank with the budgets given (the feasibility checks of a run).
    `here`: the run happens on this machine (a run, --dry-run): its RAM, drive and device bound the
    budgets (`check_budgets`) whatever --hardware says; False (`plan`): only without --hardware.
    `check` False: no such check (a plan made after the engine took its memory, to compare)."""
    if check:
        check_budgets(cfg, here=here)
    if is_profile(cfg.model):  # the planner reads the profile's extra fields
        model, params = cfg.model, profile_params(cfg.model)
    else:
        src = src or resolve_model(cfg.model, trust_remote_code=cfg.trust_remote_code)
        check_seq_len(cfg, src)
        _priced_attention(src)
        model, params = src.config, engine_params(src)
    if padded is None:
        padded = data_padded(cfg, src)
    hardware, layout = cfg.hardware or this_machine(cfg), {}
    if isinstance(ranks, RankInfo):
        if ranks.several:
            hardware, layout = started_ranks(cfg, ranks)
    elif ranks:
        layout = {"nproc_per_node": cfg.nproc_per_node, "nnodes": cfg.nnodes, "grad_reduce": cfg.grad_reduce}
    return planner.make_plan(
        model=model, hardware=hardware, params=params,
        gpu_mem=cfg.budgets["gpu"], device_mem=None if cfg.hardware else gpu_budget(cfg),
        cpu_mem=host_budget(cfg, planning=True), cxl_mem=cfg.budgets["cxl"],
        nvme_path=cfg.nvme_path, nvme_mem=nvme_budget(cfg, here=here), optimizer=cfg.optimizer,
        precision=cfg.precision, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
        grad_accum=cfg.grad_accum, chunk_bytes=cfg.budgets["chunk"],
        cuda=None if cfg.hardware else machine.has_cuda(),  # this machine's device, whatever the profile
        checkpointing=checkpointing(cfg), padded=padded, row_positions=rows_apart(cfg, src),
        windows=attends_windows(cfg, src),
        offload_activations=bool(cfg.offload_activations),
        **lora_options(cfg, linears=engine_linears(src) if cfg.lora and not is_profile(cfg.model) else None),
        **layout,
    )


def rows_apart(cfg: TrainConfig, src: "ModelSource | None") -> bool:
    """Whether the run's batches carry position ids per row: packed rows kept apart
    (cli.data.isolates; a profile trains a model of its family)."""
    if not cfg.pack:
        return False
    if src is None:
        return _profile_isolates(cfg)
    from .packing import isolates

    return isolates(src.config)


#: a CUDA device's name (lowercase) -> the profile whose rates price it without --hardware
DEVICE_PROFILES = (("h200", "h200"), ("h100", "h100"), ("a100", "a100-80g"), ("l40s", "l40s"),
                   ("4090", "rtx4090"), ("3090", "rtx3090"))


def device_profile() -> "HardwareProfile | None":
    """This machine's CUDA device as a hardware profile (None without one): the rates of the
    profile its name matches (an A100 of 40 GB: a100-40g; a card none matches: the single-GPU
    profile nearest its memory), with the device's own memory and count. The default profile
    would price a GPU run at the simulated device's 8 GiB and a CPU's rates."""
    device = machine.cuda_device()
    if device is None:
        return None
    from ..profiles import known_profiles, load_hardware_profile
    from ..profiles.hardware import NodeSpec

    name, total, count = device
    key = next((p for sub, p in DEVICE_PROFILES if sub in name.lower()), None)
    if key == "a100-80g" and total < 60 << 30:
        key = "a100-40g"
    if key is None:
        single = [hw for hw in map(load_hardware_profile, known_profiles("hardware"))
                  if hw.node is None and not hw.simulated]
        key = min(single, key=lambda hw: abs(hw.gpu.memory - total)).name
    hw = load_hardware_profile(key)
    node = hw.node
    if count > 1:  # --nproc-per-node: its GPUs, reached as the profile says, else by the name: the
        # data-centre cards but their PCIe editions over NVLink (8x-a100-80g-1t-nvme's measured
        # rate), others over PCIe
        nvlink = key in ("h100", "h200", "a100-80g", "a100-40g") and "pcie" not in name.lower()
        node = dataclasses.replace(node or NodeSpec(gpus=count, gpu_link="nvlink" if nvlink else "pcie",
                                                    gpu_link_gbps=200.0 if nvlink else hw.pcie.h2d_pinned_gbps),
                                   gpus=max(count, node.gpus if node else 0))
    return dataclasses.replace(hw, gpu=dataclasses.replace(hw.gpu, memory=total), node=node,
                               nvme=hw.nvme or load_hardware_profile(planner.DEFAULT_HARDWARE).nvme)


def this_machine(cfg: TrainConfig) -> "HardwareProfile | None":
    """Without --hardware: on CUDA the device's profile (`device_profile`), else the default
    profile; with this machine's CXL memory when the run asks for a CXL budget (None: the
    default profile as it is). The CXL nodes `detect_cxl_nodes` finds give the capacity; with
    none the engine emulates one in host memory, as big as --cxl-mem. Not measured, its link is
    priced as `unmeasured_cxl` says: `finetune profile` measures this machine, and `--hardware`
    takes the result."""
    device = device_profile()
    if not cfg.budgets["cxl"]:
        return device
    from ..offload.runtime.cxl import detect_cxl_nodes
    from ..profiles import load_hardware_profile
    from ..profiles.hardware import unmeasured_cxl

    hw = device or load_hardware_profile(planner.DEFAULT_HARDWARE)
    nodes = detect_cxl_nodes()
    if cfg.cxl_node:
        nodes = [n for n in nodes if n.id in cfg.cxl_node]
    return dataclasses.replace(hw, cxl=unmeasured_cxl(sum(n.mem_total for n in nodes) or cfg.budgets["cxl"]))


def started_ranks(cfg: TrainConfig, info: RankInfo) -> tuple["HardwareProfile", dict]:
    """The profile and layout that price the ranks torchrun started: LOCAL_WORLD_SIZE per node,
    WORLD_SIZE // LOCAL_WORLD_SIZE nodes. The profile's [node] table is widened to hold them: the
    pre-flight checks bytes (each rank's device, the node's host, CXL and NVMe), not times, so a
    profile of fewer GPUs or without a network between nodes must not refuse a run that is
    already on this machine."""
    from ..profiles import load_hardware_profile
    from ..profiles.hardware import NodeSpec

    hw = (load_hardware_profile(cfg.hardware) if cfg.hardware
          else device_profile() or load_hardware_profile(planner.DEFAULT_HARDWARE))
    local = info.local_world
    node = hw.node or NodeSpec(gpus=1, gpu_link="pcie", gpu_link_gbps=hw.pcie.h2d_pinned_gbps)
    node = dataclasses.replace(node, gpus=max(node.gpus, local), network_gbps=node.network_gbps or node.gpu_link_gbps)
    # nodes of unequal rank counts: priced as fewer nodes of this one's count (each rank then owns a
    # larger share of the chunks than it will: over-priced, the safe side), never more ranks than run
    layout = {"nproc_per_node": local, "nnodes": max(1, info.world // local), "grad_reduce": cfg.grad_reduce}
    return dataclasses.replace(hw, node=node), layout


def lora_options(cfg: TrainConfig, *, linears: "dict[str, str] | None" = None) -> dict:
    """The planner's LoRA keywords of this run (TrainConfig has resolved --qlora into rank and an
    NF4 base); an NF4 base is double-quantized (the QLoRA recipe). `linears`: the model's
    adaptable modules (`engine_linears`; None: a profile's)."""
    if not cfg.lora:
        return {}
    return {"lora_rank": cfg.lora_rank, "lora_targets": cfg.lora_targets, "base_dtype": cfg.base_dtype,
            "double_quant": cfg.base_dtype == "nf4", "lora_dropout": cfg.lora_dropout, "linears": linears}


def resolve_model(spec: str | None, *, trust_remote_code: bool = False) -> "ModelSource":
    from .loading import resolve_model as resolve  # transformers: only for a directory or the built-in

    return resolve(spec, trust_remote_code=trust_remote_code)


def host_budget(cfg: TrainConfig, *, planning: bool = False) -> int | None:
    """The host RAM budget: --cpu-mem, else this machine's RAM less what else the run keeps
    there: the process itself (planner.process_bytes) and, without CUDA, the simulated device
    (`gpu_budget`, one a rank): the defaults fit the RAM together. A plan for another machine
    (--hardware NAME) uses that profile's host memory instead (None)."""
    if cfg.budgets["cpu"] is not None:
        return cfg.budgets["cpu"]
    if planning and cfg.hardware:
        return None
    ram = physical_ram()
    if ram is None:
        return None
    ranks = local_ranks(cfg)  # (each local rank: a process, and without CUDA a device)
    device = 0 if machine.has_cuda() else (gpu_budget(cfg) or 0) * ranks
    return max(0, ram - device - planner.process_bytes(lora=bool(cfg.lora_rank)) * ranks)


def local_ranks(cfg: TrainConfig) -> int:
    """The ranks of this run on this machine: --nproc-per-node, or those torchrun started here."""
    from .launch import from_env

    return max(1, cfg.nproc_per_node, from_env().local_world)


def gpu_budget(cfg: TrainConfig) -> int | None:
    """The GPU budget of a run on this machine: --gpu-mem, else what the device has (never
    more: cli.machine.device_memory); without CUDA, the simulated device's memory is host RAM:
    the default profile's device memory (8 GiB), or half the RAM (shared by the local ranks)
    where that is less. The planner takes the smaller of it and its hardware profile's device
    memory."""
    if cfg.budgets["gpu"] is not None:
        return cfg.budgets["gpu"]
    have = machine.device_memory()
    if have is None or machine.has_cuda():
        return have
    from ..profiles import load_hardware_profile

    # (each local rank has a simulated device of its own: together they take half the RAM at most)
    return min(load_hardware_profile(planner.DEFAULT_HARDWARE).gpu.memory, have // (2 * local_ranks(cfg)))


def nvme_budget(cfg: TrainConfig, *, here: bool = True) -> int | None:
    """The NVMe capacity a plan may fill. On this machine (`here`, or a plan without --hardware /
    --nvme-mem): the free space at --nvme-path, or at its nearest existing parent (the run
    creates the directory). A plan for another machine: --nvme-mem, else the profile's capacity
    (None)."""
    if cfg.nvme_path is None:
        return None
    if not here and cfg.budgets["nvme"] is not None:
        return cfg.budgets["nvme"]
    if not here and cfg.hardware:
        return None
    return free_disk(cfg.nvme_path)


def check_budgets(cfg: TrainConfig, *, here: bool) -> None:
    """One rule for every budget: more than the hardware has is refused, never priced as fitting.
    The hardware is the --hardware profile's (its GPU), and for a run on this machine (`here`, or
    any plan without --hardware) also this machine's: RAM available now for --cpu-mem, the CUDA
    device's free memory for --gpu-mem (`_ram_over`: the simulated device's is host RAM). NVMe
    space is nvme_budget's."""
    gpu = cfg.budgets["gpu"]
    if cfg.hardware and gpu is not None:
        from ..profiles import load_hardware_profile

        hw = load_hardware_profile(cfg.hardware)
        if not hw.simulated and gpu > hw.gpu.memory:
            raise ConfigError(f"--gpu-mem {format_size(gpu)} is more than the GPU of hardware profile "
                              f"'{hw.name}' has ({format_size(hw.gpu.memory)}): give --gpu-mem "
                              f"{format_size(hw.gpu.memory)} or less")
    if cfg.hardware and not here:  # another machine's plan: this one's RAM and GPU get notes
        return
    over = _ram_over(cfg)
    if over:
        gpu_first = _simulated_ram(cfg) > (cfg.budgets["cpu"] or 0)
        other = (f"a run and --dry-run are of this machine; `finetune plan` plans hardware profile {cfg.hardware}"
                 if cfg.hardware else "to plan another machine: finetune plan --hardware NAME")
        raise ConfigError(f"{over}: lower {'--gpu-mem' if gpu_first else '--cpu-mem'} ({other})")
    if gpu is not None and machine.has_cuda():
        have = machine.device_memory()
        if have is not None and gpu > have:
            raise ConfigError(f"--gpu-mem {format_size(gpu)} is more than this GPU has free "
                              f"({format_size(have)}): lower --gpu-mem")


def _simulated_ram(cfg: TrainConfig) -> int:
    """The host RAM the simulated devices take (--gpu-mem or its default, one a rank); 0 on CUDA."""
    if machine.has_cuda():
        return 0
    return (gpu_budget(cfg) or 0) * local_ranks(cfg)


def _ram_over(cfg: TrainConfig) -> "str | None":
    """What --cpu-mem (and the simulated device's --gpu-mem or its default, which is host RAM)
    with the process beside them asks of this machine's available RAM, said when it is more;
    else None."""
    cpu = cfg.budgets["cpu"]
    ranks, simulated = local_ranks(cfg), _simulated_ram(cfg)
    if cpu is None and (not simulated or cfg.budgets["gpu"] is None):
        return None  # (the default budgets fit the RAM together: host_budget)
    each = f" x {ranks} ranks" if ranks > 1 else ""
    asked = ({f"--cpu-mem {format_size(cpu)}": cpu} if cpu is not None else {}) | (
        {f"--gpu-mem {format_size(gpu_budget(cfg) or 0)}{each} (the simulated device: host RAM)": simulated}
        if simulated else {})
    return machine.ram_over(asked, planner.process_bytes(lora=bool(cfg.lora_rank)) * ranks, processes=ranks)


def local_notes(cfg: TrainConfig, plan: Plan) -> list[str]:
    """For a plan of another machine (--hardware, --nvme-mem): where this machine falls short
    of it, so a run here would be refused."""
    if not (cfg.hardware or cfg.budgets["nvme"] is not None):
        return []
    over = _ram_over(cfg)
    notes = [f"note: {over}: a run here would be refused"] if over else []
    used = plan.peak.get("nvme", 0) if cfg.nvme_path else 0
    free = free_disk(cfg.nvme_path) if cfg.nvme_path else None
    if used and free is not None and used > free:
        notes.append(f"note: --nvme-path here has {format_size(free)} free, the plan swaps "
                     f"{format_size(used)}: a run here would be refused")
    return notes


def max_positions(config) -> int | None:
    """The longest sequence the model's position embeddings (or RoPE setup) were built for."""
    config = text_config(config)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_seq_len(cfg: TrainConfig, src: "ModelSource") -> str | None:
    """A --seq-len beyond the model's positions: refused for learned position embeddings (a
    table of that many rows: GPT-2, OPT); for rotary ones (RoPE) planned and trained, returning
    the note that says so (extending the context, e.g. rope scaling in config.json, is the
    user's choice)."""
    limit = max_positions(src.config)
    if limit is None or cfg.seq_len <= limit:
        return None
    if not _rotary(src.config):
        raise ConfigError(f"--seq-len {cfg.seq_len} is longer than {src.name} was built for "
                          f"({limit} positions): use --seq-len {limit} or less")
    return (f"note: --seq-len {cfg.seq_len:,} is beyond the {limit:,} positions {src.name} was trained for: "
            "planned and trained as asked; extending its context (rope scaling in config.json) is your choice")


def trained_positions(cfg: TrainConfig) -> int | None:
    """The positions the run's model was trained for (a profile's max_position_embeddings)."""
    if is_profile(cfg.model):
        from ..profiles import load_model_profile

        return load_model_profile(cfg.model).max_position_embeddings
    return max_positions(resolve_model(cfg.model, trust_remote_code=cfg.trust_remote_code).config)


def seq_len_note(cfg: TrainConfig) -> str | None:
    """check_seq_len's note for `plan` (a profile: against its max_position_embeddings)."""
    if is_profile(cfg.model):
        limit = trained_positions(cfg)
        if limit is None or cfg.seq_len <= limit:
            return None
        return (f"note: --seq-len {cfg.seq_len:,} is beyond the {limit:,} positions {cfg.model} was trained for: "
                "extending its context (rope scaling) is your choice")
    return check_seq_len(cfg, resolve_model(cfg.model, trust_remote_code=cfg.trust_remote_code))


def _rotary(config: Any) -> bool:
    """Whether the model's positions are rotary (no table to run past), not learned or ALiBi."""
    config = text_config(config)
    if getattr(config, "alibi", False):
        return False
    return any(getattr(config, k, None) is not None for k in ("rope_parameters", "rope_theta", "rope_scaling",
                                                               "rotary_pct", "rotary_emb_base"))


def check_tower(cfg: TrainConfig, src: "ModelSource", *, ranks: "RankInfo | None" = None) -> None:
    """A vision model trained on text (Gemma-3 4B and up) with what would move its tower, which
    text never trains, where torch would leave it: refused in one line."""
    if getattr(src.config, "vision_config", None) is None or cfg.lora:
        return
    if cfg.optimizer == "mezo":  # (MeZO moves every trainable parameter along its random direction)
        raise ConfigError(f"--optimizer mezo on {src.name} would move its vision tower, which text never trains, "
                          "by noise (MeZO updates every trainable parameter): another optimizer, or LoRA")
    world = ranks.world if ranks is not None else cfg.nproc_per_node * cfg.nnodes  # (a dry run: the asked ranks)
    if world > 1 and cfg.weight_decay:
        # (several ranks update a parameter without a gradient as with a zero one: torch skips it)
        raise ConfigError(f"--weight-decay {cfg.weight_decay} on {world} ranks would shrink {src.name}'s vision "
                          "tower, which text never trains (several ranks update parameters without a gradient as "
                          "with a zero one): --weight-decay 0, one rank, or LoRA")


def preflight(cfg: TrainConfig, *, src: "ModelSource", padded: bool,
              ranks: "RankInfo | None" = None) -> "Plan | None":
    """The feasibility checks every path runs before anything is allocated: --seq-len, the
    planner's budgets (gpu, host, NVMe free space; InfeasibleBudget names the minimum). A model
    family the planner cannot price passes (the engine then checks its budgets itself).
    Several ranks (`ranks`, torchrun's): the node's budgets priced for all its local ranks, as
    `plan --nproc-per-node` does (each rank's share after the frozen base once; every rank runs
    it, with its own device; cli.launch.agree makes them refuse together).
    Returns the plan, or None."""
    check_seq_len(cfg, src)
    try:
        return make_plan(cfg, src=src, padded=padded, ranks=ranks or False)
    except (UnsupportedModel, ProfileError) as e:  # e.g. a family the planner has no profile for
        why = str(e).splitlines()[0]
        log.warning("%s%s", why, "" if "warm-up" in why else
                    ": the run goes on without a plan, the engine holding its budgets (measured in its warm-up step)")
        return None


def engine_params(src: "ModelSource") -> list:
    """The parameters the engine will chunk: those of the module training builds
    (cli.loading.build_meta_model), so the plan counts a tied head as the run does.
    Kept on `src`: the advice on a refusal plans the same model many times."""
    from ..offload.engine.model_info import model_specs
    from .loading import build_meta_model

    cached = getattr(src, "_engine_params", None)
    if cached is None:
        cached = model_specs(build_meta_model(src.config))
        src._engine_params = cached
    return cached


def engine_linears(src: "ModelSource") -> dict[str, str]:
    """The modules LoRA can adapt in the module training builds ({name: kind},
    offload.engine.frozen_base.linear_modules), kept on `src` as `engine_params` is."""
    from ..offload.engine.frozen_base import linear_modules
    from .loading import build_meta_model

    cached = getattr(src, "_engine_linears", None)
    if cached is None:
        cached = src._engine_linears = linear_modules(build_meta_model(src.config))
    return cached


def alternatives(cfg: TrainConfig, error: InfeasibleBudget, *, src: "ModelSource | None",
                 padded: bool | None = None, limit: int = 5, ranks: bool = False,
                 here: bool = True) -> list[tuple[str, object, dict]]:
    """Changes to a refused run that the planner itself finds feasible: [(flags, plan, change)],
    fastest predicted step first, at most `limit`. Each is one change (chunk size, recompute,
    half the micro-batch or one row with the accumulation that keeps a step's rows, with its
    activations offloaded too where they do not fit, bf16, 8-bit AdamW, both, QLoRA for a full
    fine-tune, activations offloaded, the host RAM the refusal named), and, for those that do
    not fit in memory, the same with NVMe swap (checked against the free space of the current
    directory); for activations that do not fit, last, the longest --seq-len that does (a step
    of fewer tokens: not ranked with the others)."""
    both = {"precision": "bf16", "optimizer": "adamw8bit"}
    tries: list[tuple[str, dict]] = []
    if cfg.budgets["chunk"] > 16 << 20:
        tries.append(("--chunk-size 16M", {"chunk_size": "16M"}))
    if cfg.recompute is False or cfg.recompute_layers is not None:  # (all of them)
        tries.append(("--recompute", {"recompute": True, "recompute_layers": None}))
    offload: "tuple[str, dict] | None" = None  # blocks' inputs off the GPU
    if not cfg.offload_activations and "activations" in str(error):
        none = checkpointing(cfg) in (False, 0)  # (it moves recomputed layers' inputs: recompute them all)
        offload = ("--offload-activations" + (" --recompute" if none else ""),
                   {"offload_activations": True} | ({"recompute": True, "recompute_layers": None} if none else {}))
        tries.append(offload)
    # a smaller micro-batch, the same rows a step (half of it, and one row), with its blocks'
    # inputs offloaded too where activations are what does not fit
    step_rows = cfg.grad_accum * cfg.batch_size
    for rows in sorted({r for r in (cfg.batch_size // 2, 1) if r and cfg.batch_size % r == 0} - {cfg.batch_size},
                       reverse=True):
        accum = step_rows // rows
        flags, change = f"--batch-size {rows} --grad-accum {accum}", {"batch_size": rows, "grad_accum": accum}
        tries.append((flags, change))
        if offload:
            tries.append((f"{flags} {offload[0]}", change | offload[1]))
    if cfg.precision == "fp32":
        tries.append(("--precision bf16", {"precision": "bf16"}))
    if cfg.optimizer == "adamw":
        tries.append(("--optimizer adamw8bit", {"optimizer": "adamw8bit"}))
    if cfg.precision == "fp32" and cfg.optimizer == "adamw":
        tries.append(("--precision bf16 --optimizer adamw8bit", both))
    if not cfg.lora:  # a full fine-tune that fits nowhere may fit as QLoRA (its own precision default)
        tries.append(("--qlora", {"qlora": True, "precision": None}))
    host = error.minimum.get("host")
    ram = physical_ram()
    if host and (ram is None or host <= ram) and host > (host_budget(cfg, planning=True) or 0):
        unit, shift = next((u, b) for u, b in (("G", 30), ("M", 20), ("K", 10)) if host >= 1 << b or b == 10)
        size = f"{-(-host // (1 << shift))}{unit}"
        tries.append((f"--cpu-mem {size}", {"cpu_mem": size}))
    fits, failed = [], [("", {})]

    def attempt(flags: str, change: dict) -> bool:
        try:
            plan = make_plan(dataclasses.replace(cfg, **change), src=src, padded=padded, ranks=ranks, here=here)
        except (InfeasibleBudget, UnsupportedModel, ProfileError, ConfigError):  # still infeasible, or more than the machine has
            return False
        fits.append((flags, plan, change))
        return True

    failed += [(f, c) for f, c in tries if not attempt(f, c)]
    if cfg.nvme_path is None:  # what does not fit in memory may fit with swap (free space here)
        for flags, change in failed:
            attempt((flags + " " if flags else "") + "--nvme-path DIR", {**change, "nvme_path": str(Path.cwd())})
    fits.sort(key=lambda fp: (fp[1].step_s, len(fp[0])))
    fits = fits[:limit]
    if "activations" in str(error) and cfg.seq_len > SEQ_STEP and cfg.nproc_per_node * cfg.nnodes == 1:  # the longest that fits
        try:
            short, plan = longest(cfg, here=here)
        except (InfeasibleBudget, ConfigError):
            return fits
        if short.seq_len < cfg.seq_len:
            flags = f"--seq-len {short.seq_len}" + (" --offload-activations" if short.offload_activations
                                                     and not cfg.offload_activations else "")
            fits.append((flags, plan, {"seq_len": short.seq_len, "offload_activations": short.offload_activations}))
    return fits


def advise(cfg: TrainConfig, error: InfeasibleBudget, *, console: Console,
           src: "ModelSource | None" = None, padded: bool | None = None, ranks: bool = False,
           here: bool = True, given: "dict | None" = None) -> None:
    """Print the verdict of a refused plan and the cheapest changes that would fit; with `given`
    (the options as the user gave them), the command line of the fastest."""
    if src is None and not is_profile(cfg.model):
        src = resolve_model(cfg.model, trust_remote_code=cfg.trust_remote_code)
    console.out(f"verdict: does not fit: {str(error).splitlines()[0]}", highlight=False)
    fits = alternatives(cfg, error, src=src, padded=padded, ranks=ranks, here=here)
    if not fits:
        console.out("no single change of precision, optimizer, recompute, batch, chunk size, "
                    "host RAM or NVMe swap makes it fit on this machine", highlight=False)
        return
    shorter = ", a shorter --seq-len last" if any("seq_len" in change for _, _, change in fits) else ""
    console.out(f"would fit (each checked by the planner; fastest step first{shorter}):", highlight=False)
    width = max(len(f) for f, _, _ in fits)
    for flags, plan, _ in fits:
        peak = ", ".join(f"{t} {format_size(plan.peak[t])}" for t in ("gpu", "host", "nvme") if plan.peak.get(t))
        console.out(f"  {flags.ljust(width)}   step {plan.step_s:.3f} s, peaks {peak}", highlight=False)
    if given is not None:
        flags, _, change = fits[0]
        line = shlex.join(["finetune", "plan", *command_flags(given, drop=set(change))]) + " " + flags
        console.out(f"fastest: {line}", highlight=False)


def data_padded(cfg: TrainConfig, src: "ModelSource | None" = None) -> bool:
    """Whether some batch of the run makes transformers build a dense attention mask, so the
    plan is for that batch (the run's worst step): every batch where the attention always
    takes one (always_masked), else as cli.data.has_padding reads --data; without --data the
    worst case: packed rows kept apart share a block (no mask where the attention takes them
    per segment: attends_segments) and a short block is padded (no mask unless the model keeps
    it: packing.keeps_mask)."""
    from .packing import keeps_mask

    if always_masked(cfg, src):
        return True
    split = attends_segments(cfg, src)
    keep = src is not None and keeps_mask(src.config)
    if cfg.data is None:
        return (rows_apart(cfg, src) and not split) or keep
    from .data import has_padding, isolates, load_blocks

    src = src or resolve_model(cfg.model, trust_remote_code=cfg.trust_remote_code)
    return has_padding(load_blocks(cfg.data, src.tokenizer, seq_len=cfg.seq_len, pack=cfg.pack,
                                   isolate=isolates(src.config, pack=cfg.pack)), segments=split, mask=keep)


def _attention(src: "ModelSource") -> str:
    """The attention implementation the run's model gets (cli.loading.build_meta_model; kept on `src`)."""
    cached = getattr(src, "_attention", None)
    if cached is None:
        from .loading import build_meta_model

        cached = src._attention = build_meta_model(src.config).config._attn_implementation
    return cached


def _priced_attention(src: "ModelSource") -> None:
    """Refuse to price a family the planner knows whose attention is not SDPA (the formulas'):
    eager attention, e.g., saves every head's S x S scores and softmax, which they do not count."""
    from ..offload.engine.segments import SDPA
    from ..profiles.model import FAMILIES, NOT_PRICED

    kind = getattr(src.config, "model_type", None)
    if kind in FAMILIES and _attention(src) not in SDPA:
        raise UnsupportedModel(f"the planner prices {kind} with SDPA attention (what its formulas count), not "
                               f"{_attention(src)!r}: {NOT_PRICED}")


def always_masked(cfg: TrainConfig, src: "ModelSource | None") -> bool:
    """Whether every batch of the run takes a dense S x S mask: an attention that is not SDPA
    (eager builds one always), ALiBi, or a sliding window shorter than --seq-len in a family the
    planner does not price (it prices each sliding layer's mask, or its blocks). A profile:
    its family's configuration (transformers' SDPA)."""
    if src is None:
        try:
            from ..profiles import load_model_profile

            config = load_model_profile(cfg.model).to_hf_config()
        except ImportError:  # planning by name without transformers: no window known
            return False
    else:
        from ..offload.engine.segments import SDPA

        config = src.config
        if _attention(src) not in SDPA:
            return True
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    from ..profiles.model import FAMILIES

    if getattr(config, "model_type", None) in FAMILIES:
        window = None  # (the planner prices each sliding layer's mask or blocks: perfmodel.activation_parts)
    return bool(getattr(config, "alibi", False)) or (window is not None and window < cfg.seq_len)


def attends_segments(cfg: TrainConfig, src: "ModelSource | None") -> bool:
    """Whether the run's attention takes its packed rows per segment (packing.use_segments, as
    build_meta_model installs it, for rows of perfmodel.SEGMENTS_FROM tokens or more); a profile
    names a family that does, on transformers' SDPA."""
    from ..offload.plan.perfmodel import SEGMENTS_FROM

    if not rows_apart(cfg, src) or cfg.seq_len < SEGMENTS_FROM:
        return False
    if src is None:
        return True
    from ..offload.engine.segments import NAME

    return _attention(src) == NAME


def attends_windows(cfg: TrainConfig, src: "ModelSource | None") -> bool:
    """Whether the run's attention is offload.engine.segments' (build_meta_model installs it
    where packing.use_segments does), which attends a sliding window shorter than a long row in
    blocks; a profile names a family it is installed for (on transformers' SDPA)."""
    if src is not None:
        from ..offload.engine.segments import NAME

        return _attention(src) == NAME
    return _profile_isolates(cfg)


def _profile_isolates(cfg: TrainConfig) -> bool:
    """Whether the profile --model names is of a family whose packed rows finetune keeps apart
    (packing.ISOLATING), on offload.engine.segments' attention."""
    from ..profiles import load_model_profile
    from .packing import ISOLATING

    return load_model_profile(cfg.model).family in ISOLATING


def checkpointing(cfg: TrainConfig) -> bool | int | None:
    """The Engine's / planner's `checkpointing` for --recompute / --recompute-layers: False off;
    the first N layers; True every layer (a model of one decoder layer recomputes none: it has no
    repeated block); None (not resolved yet) the planner's every layer too."""
    if cfg.recompute is False:
        return False
    return cfg.recompute_layers if cfg.recompute_layers is not None else cfg.recompute


def share_note(cfg: TrainConfig, plan: Plan, *, here: bool = True) -> str | None:
    """What `plan` says where resolve_recompute chose a share of the layers: why, and what
    recomputing all of them would plan. None for all, none, or a share the user gave."""
    if not 0 < plan.checkpointing < plan.layers:
        return None
    every = make_plan(_recomputing(cfg, None), ranks=True, here=here)
    return (f"recompute: the first {plan.checkpointing} of {plan.layers} layers, the fastest plan that fits "
            f"(every layer's activations kept do not; all {plan.layers} recomputed: {every.tokens_per_s:,.0f} "
            f"tokens/s against {plan.tokens_per_s:,.0f}); --recompute or --recompute-layers N choose")


def precision_note(cfg: TrainConfig, plan: Plan, *, chosen: str | None, here: bool = True) -> str | None:
    """What `plan` says of a full fine-tune's default fp32 on a device with bf16 (`chosen`, the
    TrainConfig's precision_note as the options resolved it: config.FULL_FP32): what bf16 would
    plan beside it. None otherwise."""
    from .config import FULL_FP32

    if chosen != FULL_FP32:
        return None
    try:
        alt = make_plan(dataclasses.replace(cfg, precision="bf16"), ranks=True, here=here)
    except TierwiseError:  # (bf16 refused: the note alone)
        return f"precision: {FULL_FP32}"
    return f"precision: {FULL_FP32}: bf16 plans {alt.tokens_per_s:,.0f} tokens/s against {plan.tokens_per_s:,.0f}"


def _recomputing(cfg: TrainConfig, n: int | None) -> TrainConfig:
    """`cfg` recomputing the first `n` layers (None: all, 0: none)."""
    return dataclasses.replace(cfg, recompute=n != 0, recompute_layers=n or None)


def resolve_recompute(cfg: TrainConfig, *, src: "ModelSource | None" = None,
                      padded: bool | None = None, here: bool = True) -> TrainConfig:
    """`cfg` with `recompute` (and `recompute_layers`) decided. --recompute-layers N alone: on
    (off for 0). Unset (auto): off when the planner finds a placement that keeps every layer's
    activations within the budgets (less compute); else the fewest first layers whose recompute
    makes it fit, or all of them, whichever the planner finds faster (all where neither plans).
    On with --offload-activations (it offloads recomputed layers' inputs). A run the
    planner cannot price (a model family it does not know, a planner error) recomputes. A LoRA
    run: the fastest of off, those and all, as the planner finds it (keeping activations can
    leave too little room to cache the streamed base). `here`: as make_plan's."""
    if cfg.recompute is not None:
        return cfg
    if cfg.recompute_layers is not None:
        return _recomputing(cfg, cfg.recompute_layers)
    if cfg.offload_activations:
        return dataclasses.replace(cfg, recompute=True)
    plans: dict[int | None, Plan | None] = {}

    def plan_with(n: int | None) -> "Plan | None":
        if n not in plans:
            try:
                plans[n] = make_plan(_recomputing(cfg, n), src=src, padded=padded, here=here)
            except (InfeasibleBudget, UnsupportedModel, ProfileError, ConfigError) as e:  # infeasible, or a
                log.debug("no plan recomputing %s layers: %s", "all" if n is None else n, e)  # family the
                plans[n] = None  # planner cannot price
        return plans[n]

    return _recomputing(cfg, planner.choose_recompute(plan_with, keep_when_fits=not cfg.lora))


def resolve_offload(cfg: TrainConfig, *, src: "ModelSource | None" = None, padded: bool | None = None,
                    here: bool = True, ranks: "bool | RankInfo" = False) -> TrainConfig:
    """`cfg` with `offload_activations` decided. Unset (auto): on where no plan fits without it
    and one fits with it (blocks recomputed: offloading moves their inputs), else off (a run that
    fits neither way is refused as before, the advice listing what fits). Never with
    --no-recompute. Call after resolve_recompute. `here`, `ranks`: as make_plan's (the ranks
    the run's own plan prices: every rank offloads its own inputs)."""
    if cfg.offload_activations is not None:
        return cfg
    off = dataclasses.replace(cfg, offload_activations=False)
    if checkpointing(cfg) in (False, 0):
        return off
    refused: list[tuple[TrainConfig, dict]] = []
    for choice in (off, None):
        if choice is None:  # (built only now: it re-checks the options)
            choice = dataclasses.replace(cfg, offload_activations=True, recompute=True)
        try:
            make_plan(choice, src=src, padded=padded, here=here, ranks=ranks)
        except (InfeasibleBudget, UnsupportedModel, ProfileError) as e:
            log.debug("no plan with offload_activations %s: %s", choice.offload_activations, e)
            refused.append((choice, e.minimum if isinstance(e, InfeasibleBudget) else {}))
            continue
        return choice
    # neither fits: where only the device budget is short either way, the refusal names the
    # smaller minimum, the offloaded one (that budget runs: offloading is chosen there)
    (_, without), (on, with_) = refused
    if set(without) == set(with_) == {"gpu"} and with_["gpu"] < without["gpu"]:
        return on
    return off


OFFLOADED = ("activations: each block's input offloaded between forward and backward, to host RAM (else CXL "
             "memory, else the NVMe swap: the plan's reserves say where) - the GPU budget holds them no other "
             "way; --no-offload-activations refuses instead")
"""What `finetune` and `plan` say when resolve_offload turned offloading on."""
AUTO_OFFLOADED = " with each block's input offloaded (the run's choice where nothing fits without)"
"""What a refusal adds where resolve_offload turned offloading on: its minimum is that plan's."""


SEQ_STEP = 1024
"""The longest context is searched in multiples of this many tokens."""
SEQ_CAP = 1 << 22


def longest(cfg: TrainConfig, *, here: bool = False) -> tuple[TrainConfig, Plan]:
    """`plan --seq-len max`: the longest --seq-len (a multiple of SEQ_STEP, up to SEQ_CAP, within
    the positions of a model directory) whose plan fits at this batch, blocks recomputed: with
    the activations on the device, and, unless --offload-activations was given, also with them
    offloaded to host RAM; the longer wins. (cfg at that length, its plan.) InfeasibleBudget
    when not even SEQ_STEP tokens fit."""
    def plan_at(n: int, offload: bool) -> "Plan | None":
        c = dataclasses.replace(cfg, seq_len=n, offload_activations=offload, recompute=cfg.recompute is not False)
        try:
            return make_plan(c, ranks=True, here=here)
        except (InfeasibleBudget, ConfigError):
            return None

    best: tuple[int, bool, Plan] | None = None
    for offload in {True: [True], False: [False]}.get(cfg.offload_activations, [False, True]):
        if cfg.recompute is False and offload:
            break  # offloading moves recomputed blocks' inputs
        lo, n, found = 0, SEQ_STEP, None
        while n <= SEQ_CAP and (p := plan_at(n, offload)) is not None:
            lo, found, n = n, p, n * 2
        hi = min(n, SEQ_CAP + SEQ_STEP)  # (SEQ_CAP itself fitting: no search past it)
        while hi - lo > SEQ_STEP:
            mid = (lo + hi) // 2 // SEQ_STEP * SEQ_STEP
            if (p := plan_at(mid, offload)) is not None:
                lo, found = mid, p
            else:
                hi = mid
        if found is not None and (best is None or lo > best[0]):
            best = (lo, offload, found)
    if best is None:
        make_plan(dataclasses.replace(cfg, seq_len=SEQ_STEP), ranks=True, here=here)  # raises the refusal
        raise InfeasibleBudget(f"not even --seq-len {SEQ_STEP} fits these budgets")
    n, offload, plan = best
    return dataclasses.replace(cfg, seq_len=n, offload_activations=offload, recompute=cfg.recompute is not False), plan


def longest_line(cfg: TrainConfig, plan: Plan) -> str:
    """What `plan --seq-len max` found, in one line: the length, where the activations live,
    the speed, the command; and a length beyond the model's positions flagged."""
    gpu, host = plan.reserve["gpu"]["activations"], plan.reserve["host"].get("activations", 0)
    cxl = plan.reserve.get("cxl", {}).get("activations", 0)
    nvme = plan.reserve.get("nvme", {}).get("activations", 0)
    where = (f"activations {format_size(gpu)} on the gpu"
             + (f", {format_size(nvme)} on NVMe (through {format_size(host)} of host RAM)" if nvme else
                f", {format_size(host)} in host RAM" if host else "")
             + (f", {format_size(cxl)} in CXL memory" if cxl else ""))
    line = (f"longest context: {cfg.seq_len:,} tokens a row at batch {cfg.batch_size} ({where}), "
            f"{plan.tokens_per_s:,.0f} tokens/s; --seq-len {cfg.seq_len}"
            + (" --offload-activations" if host or cxl or nvme else ""))
    beyond = seq_len_note(cfg)
    if not beyond:
        return line
    limit = trained_positions(cfg)
    try:  # (as `plan --seq-len LIMIT` chooses: the recompute and offload of that length)
        short = dataclasses.replace(cfg, seq_len=limit, recompute=None, recompute_layers=None, offload_activations=None)
        within = make_plan(resolve_offload(resolve_recompute(short, here=False), here=False, ranks=True),
                           ranks=True, here=False) if limit else None
    except TierwiseError:
        within = None
    return line + f"\n{beyond}" + (f"; within them: --seq-len {limit} plans {within.tokens_per_s:,.0f} tokens/s"
                                   if within is not None else "")


def print_plan(plan: Plan, *, console: Console, as_json: bool) -> None:
    if as_json:
        console.out(plan.to_json(), highlight=False)
    else:
        console.out(plan.render_table(), highlight=False)  # pre-formatted: never re-wrap
        if plan.budgets.get("cxl"):
            console.out("\n".join(cxl_lines()), highlight=False)


def cxl_lines() -> list[str]:
    """The CXL nodes of this machine (size, distance, sysfs evidence), for the plan's reader."""
    from ..offload.runtime.cxl import describe_cxl_nodes

    lines = describe_cxl_nodes()
    if not lines:
        return ["CXL nodes here: none (the engine emulates one in host memory)"]
    return ["CXL nodes here (pages interleave across those used):"] + [f"  {x}" for x in lines]


def verify_plan(cfg: TrainConfig, *, steps: int, console: Console) -> int:
    """`finetune plan --verify`: a few real steps with these settings on this machine, planned
    against measured bytes per tier (a LoRA run: also the base's reads per tier and writes);
    returns 0 on PASS, 1 on FAIL (user errors raise)."""
    from ..offload.tools.verify import verify
    from .loading import build_meta_model

    src = resolve_model(cfg.model, trust_remote_code=cfg.trust_remote_code)
    check_seq_len(cfg, src)
    _priced_attention(src)
    lora = {}
    if cfg.lora:  # built as training builds it: PEFT's adapters on the meta model, the base encoded
        from . import lora as lora_mod

        lora_mod.check_targets(build_meta_model(src.config), cfg.target_list())
        options = lora_options(cfg)
        lora = dict(lora=lora_mod.lora_config(cfg), base_dtype=options["base_dtype"],
                    double_quant=options["double_quant"])
    batches, padded = None, data_padded(cfg, src)  # random tokens: the worst case
    if cfg.data is not None:
        from .data import Batches, check_vocab, isolates, load_blocks, padded_batch
        from .packing import keeps_mask

        blocks = load_blocks(cfg.data, src.tokenizer, seq_len=cfg.seq_len, pack=cfg.pack,
                             isolate=isolates(src.config, pack=cfg.pack))
        check_vocab(blocks, src)
        rows, keep = cfg.batch_size * cfg.grad_accum, keeps_mask(src.config)
        batches = iter(Batches(blocks, batch_size=rows, seed=cfg.seed, mask=keep))
        if padded:  # the first measured step (after the warm-up) is the run's worst one
            worst = padded_batch(blocks, batch_size=rows, segments=attends_segments(cfg, src), mask=keep)
            batches = itertools.chain([next(batches), worst], batches)
    with console.status(f"[bold]verifying[/]: {steps} steps of {src.name}"):
        report = verify(model=src.config, name=src.name, hardware=cfg.hardware or this_machine(cfg),
                        gpu_mem=cfg.budgets["gpu"] if cfg.hardware else gpu_budget(cfg),
                        cpu_mem=host_budget(cfg, planning=True), cxl_mem=cfg.budgets["cxl"], nvme_path=cfg.nvme_path,
                        optimizer=cfg.optimizer, precision=cfg.precision, batch_size=cfg.batch_size,
                        seq_len=cfg.seq_len, grad_accum=cfg.grad_accum, chunk_bytes=cfg.budgets["chunk"],
                        lr=cfg.lr, steps=steps, batches=batches, seed=cfg.seed,
                        checkpointing=checkpointing(cfg), padded=padded, build=build_meta_model,
                        row_positions=cfg.data is not None and rows_apart(cfg, src),
                        windows=attends_windows(cfg, src), **lora)
    if src.has_weights:
        console.print("(random weights, not the checkpoint's: the bytes do not depend on their values, the "
                      "losses do)", highlight=False, soft_wrap=True)
    console.out(report.render(), highlight=False)
    return 0 if report.passed else 1


def summary_table(cfg: TrainConfig, *, name: str, params: int, lora: str | None = None) -> Table:
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
        ("recompute", {True: "on" if cfg.recompute_layers is None else f"the first {cfg.recompute_layers} layers",
                       False: "off", None: "auto"}[cfg.recompute]),
    ]
    if lora:
        rows.append(("lora", lora))
    for k, v in rows:
        table.add_row(k, v)
    return table


def dry_run(cfg: TrainConfig, *, console: Console, resuming: "Callable | None" = None) -> int:
    """Resolve the model and budgets, print a summary and the plan; touch nothing on disk.
    `resuming(cfg, src)`: --resume's checks (cli.train), run once the model is resolved."""
    from .diskspace import plan_line
    from .loading import build_meta_model, count_parameters

    src = resolve_model(cfg.model, trust_remote_code=cfg.trust_remote_code)
    if src.note:
        console.print(f"[bold yellow]warning:[/] {src.note}", soft_wrap=True, highlight=False)
    check_tower(cfg, src)
    model = build_meta_model(src.config)
    chosen = cfg.precision_note  # (before the options are replaced: theirs resolve none)
    cfg = resolve_offload(resolve_recompute(cfg, src=src), src=src)
    if resuming is not None:
        resuming(cfg, src)
    total, lora = count_parameters(model), None
    if cfg.lora:  # the adapters as the run makes them (meta device: no values needed to count)
        from . import lora as lora_mod

        lora_mod.check_targets(model, cfg.target_list())
        lora_mod.check_base_dtype(model, cfg)
        lora_mod.inject(model, lora_mod.lora_config(cfg), seed=cfg.seed, values=False)
        lora = lora_mod.summary(cfg, model)
    console.print(summary_table(cfg, name=src.name, params=total, lora=lora))
    plan = make_plan(cfg, src=src, ranks=True)
    print_plan(plan, console=console, as_json=False)
    console.print(plan_line(cfg, plan, free=free_disk(cfg.output)), highlight=False, soft_wrap=True)
    note = precision_note(cfg, plan, chosen=chosen) or (f"precision: {chosen}" if chosen else None)
    if note:
        console.print(note, highlight=False, soft_wrap=True)
    return 0


def profile(*, hardware: str | None, output: str | None, console: Console, nvme_path: str | None = None,
            quick: bool = False) -> int:
    """`finetune profile`: measure this machine's links and compute via offload.tools.profiler.

    Each measurement is printed as it completes; the TOML goes to `output` (then
    `--hardware PATH` uses it), else to the console."""
    from ..offload.tools.profiler import measure

    with console.status("[bold]measuring this machine[/] (under a minute)") as status:
        def progress(msg: str) -> None:
            console.print(f"  {msg}", highlight=False, soft_wrap=True)  # (the terminal wraps: never mid-number)
            status.update(f"[bold]measuring[/] after {msg.split(':')[0]}")

        text = measure(hardware=hardware, output=output, nvme_path=nvme_path, quick=quick, progress=progress)
    if output is None and text:
        console.out(text, highlight=False)
        console.print("save it with --output FILE.toml, then plan and train with --hardware FILE.toml",
                      highlight=False, soft_wrap=True)
    elif output:
        console.print(f"use it with [bold]--hardware {output}[/]")
    return 0
