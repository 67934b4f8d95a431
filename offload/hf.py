"""The engine inside a Hugging Face Trainer script: `OffloadTrainer` and `with_offload`.

    from tierwise.offload.hf import OffloadTrainer, with_offload
    trainer = OffloadTrainer(model=model, args=args, train_dataset=ds,
                             offload={"gpu_mem": "24G", "cpu_mem": "64G", "nvme_path": "/mnt/nvme"})
    SFTOffload = with_offload(trl.SFTTrainer)        # the same for any Trainer subclass

The Trainer keeps its loop, data, logging, evaluation, lr schedule and callbacks; the engine
does forward, backward and the update. What maps where:

- `offload=`: the Engine's options, as a dict of its flat keyword names (offload.core.options.
  FLAT: gpu_mem, cpu_mem, nvme_path, chunk_bytes, precision, base_dtype, optimizer, ...) or of
  its option groups (budget=Budget(...), ...). The optimizer's hyperparameters come from the
  TrainingArguments (learning_rate, adam_beta1/2, adam_epsilon; `optimizer` in `offload`
  names another engine optimizer, e.g. adamw8bit); `bf16=True` computes in bf16.
- The lr scheduler: its rate goes to `engine.set_lr` before every update.
- `gradient_accumulation_steps`: the Trainer's micro-batches, each `engine.forward` +
  `engine.backward` of the loss as the Trainer scales it; the update at its sync step.
- `max_grad_norm`: the engine clips (Optim.grad_clip); the logged grad_norm is the engine's.
- Logs (and `report_to`): each tier's peak beside the loss (`gpu_peak_gib`, `host_peak_gib`, ...);
  TRL's SFTTrainer's token metrics (entropy, mean_token_accuracy, num_tokens, a MoE's aux_loss,
  and their eval_ forms), counted by the engine's loss in its tiles.
- Evaluation: the loss through `engine.eval_loss` (no logits: `compute_metrics` and `predict()` are refused).
- `save_model` / checkpoints: what Trainer writes, from the engine's fp32 masters in the
  model's dtypes, streamed one tensor at a time as `finetune export` writes them (a PEFT model:
  its adapter, through PEFT's save_pretrained); a checkpoint also holds the engine's state
  (`ENGINE_STATE`), and `resume_from_checkpoint` restores it, as `load_best_model_at_end` does
  the best checkpoint's.
- A PEFT model (`peft_config=` to SFTTrainer, or `get_peft_model`) is taken as it is: its
  frozen base streamed, its adapters trained. A QLoRA model loaded with BitsAndBytesConfig
  (NF4) is taken too: its 4-bit layers become the engine's NF4 base, the same codes, wherever
  bitsandbytes had loaded them.
- Batches of several lengths: the engine is placed for the longest one before the first step,
  its length the train dataset's longest `input_ids` (a datasets.Dataset's, read from its Arrow
  column, or a list's) within TRL's `max_length`, padded as the collator pads; TRL's
  `max_length` where the dataset cannot tell. Neither known (another dataset, transformers'
  Trainer): placed for the first batch, and a longer one later raises StepOverBudget.
- `gradient_checkpointing` (True is TRL's default): the model's own checkpointing is turned off
  and, with the longest batch known, the engine decides (Activations(recompute=None)): the
  warm-up step recomputes every block, then the last blocks keep their activations where the
  whole model stays on the device beside them, placed for the longest batch. Not known, every
  block is recomputed (a later, longer batch needs the slack). `offload={"checkpointing": True}`
  recomputes every block, False none, an int n the first n.

A model bigger than the device (or the host): `from_pretrained(name_or_path)` builds it on the
meta device, as `finetune` does; the engine loads its checkpoint shard by shard into its tiers
when training starts (with `offload={"base_dtype": "nf4", "double_quant": True}`: a QLoRA base,
encoded as it streams in). It takes `peft_config=` (SFTTrainer) or this module's
`get_peft_model` (PEFT's, its adapters initialised with values over the meta base).

`trainer.engine` is the Engine that trained (None before training starts). Refused, one line
each: weight decay (the Trainer decays all but biases and norms; the engine decays all alike),
several processes, `compute_metrics`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator

import torch

from .core.errors import InfeasibleBudget, TierwiseError
from .core.options import FLAT, GROUPS, PASSED, Activations, Optim, Precision, flat_options
from .update.table import optimizer_spec

log = logging.getLogger(__name__)

ENGINE_STATE = "tierwise_engine.safetensors"
"""The engine's state (masters, optimizer state, step) inside a Trainer checkpoint directory,
beside its layout (`tierwise_engine.json`): written and read one chunk at a time, as `finetune`
checkpoints are (cli.checkpoint's save_tree), so the host holds no whole copy of it."""
_ENGINE_TREE = ENGINE_STATE.removesuffix(".safetensors")
_ENGINE_PICKLE = "tierwise_engine.pt"  # (what checkpoints held before: still read)


def _has_engine_state(directory: str) -> bool:
    return any(os.path.isfile(os.path.join(directory, f)) for f in (ENGINE_STATE, _ENGINE_PICKLE))

_CACHE: dict[type, type] = {}
_OPTIMS = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw", "adamw_8bit": "adamw8bit",
           "adamw_bnb_8bit": "adamw8bit", "paged_adamw_8bit": "adamw8bit", "sgd": "sgd"}
"""TrainingArguments.optim -> the engine's optimizer (offload={"optimizer": ...} wins); another is refused."""
_SOURCE = "_tierwise_source"  # on a from_pretrained model: (its ModelSource, its ModelLayout)
_SAVE_DTYPE = "_tierwise_save_dtype"  # on a from_pretrained model given dtype=: what its weights save as


def _own_checkpointing_off(model: Any) -> None:
    """transformers' own recompute off (the engine recomputes what its budget forces), by the
    names transformers 5 gives it, or the older ones."""
    new = hasattr(type(model), "is_activation_checkpointing")
    if getattr(model, "is_activation_checkpointing" if new else "is_gradient_checkpointing", False):
        (model.activation_checkpointing_disable if new else model.gradient_checkpointing_disable)()


def from_pretrained(name_or_path: str, *, dtype: Any = None, torch_dtype: Any = None,
                    trust_remote_code: bool = False, attn_implementation: str | None = None,
                    revision: str | None = None, token: Any = None, **unused: Any) -> torch.nn.Module:
    """A Hugging Face causal LM (a directory or a Hub id, the local cache first) built on the
    meta device: no weight is read now. OffloadTrainer's engine loads them into its tiers.
    `dtype` (or `torch_dtype`): the dtype the trained weights are saved in, "auto" the
    checkpoint's own (transformers' default); None: fp32. The engine keeps fp32 masters either
    way and computes in the Trainer's precision (bf16=True or not). `attn_implementation`,
    `revision`, `token`: as transformers' (the last two for a Hub id)."""
    from ..cli.layout import ModelLayout
    from ..cli.loading import build_meta_model, resolve_model

    if unused:
        placing = {"device_map", "quantization_config", "load_in_4bit", "load_in_8bit", "low_cpu_mem_usage",
                   "max_memory", "offload_folder"}
        why = ("the engine places and encodes the weights (offload={'base_dtype': 'nf4'} for a QLoRA base)"
               if placing & set(unused) else "they are not supported here")
        raise TypeError(f"tierwise from_pretrained takes dtype (or torch_dtype), attn_implementation, revision, "
                        f"token and trust_remote_code, not {', '.join(sorted(unused))}: {why}")
    hub = {k: v for k, v in (("revision", revision), ("token", token)) if v is not None}
    src = resolve_model(name_or_path, trust_remote_code=trust_remote_code, tokenizer=False, hub=hub)
    if not src.has_weights:
        raise TierwiseError(f"{name_or_path} has no weights to load (a profile builds a random model: "
                            "use transformers' from_config)")
    if attn_implementation is not None:
        src.config._attn_implementation = attn_implementation
    model = build_meta_model(src.config)
    setattr(model, _SOURCE, (src, ModelLayout.of(model)))
    saved = _save_dtype(dtype if dtype is not None else torch_dtype, src.config)
    if saved is not None:
        setattr(model, _SAVE_DTYPE, saved)
    return model


def _save_dtype(given: Any, config: Any) -> "torch.dtype | None":
    if given is None:
        return None
    if given == "auto":
        given = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(given, str):
        given = getattr(torch, given.removeprefix("torch."), None)
    if not isinstance(given, torch.dtype) or not given.is_floating_point:
        raise TypeError(f"dtype must be a floating torch dtype or 'auto', got {given!r}")
    return given


def get_peft_model(model: torch.nn.Module, config: Any, **kwargs: Any) -> torch.nn.Module:
    """peft.get_peft_model; over a from_pretrained (meta) model its adapters get values, drawn
    as PEFT draws them (the global RNG), instead of staying meta."""
    import peft

    from .engine.lora import meta_stand_ins

    with meta_stand_ins(model):
        return peft.get_peft_model(model, config, **kwargs)


def with_offload(trainer_class: type) -> type:
    """`trainer_class` (transformers.Trainer or a subclass, e.g. trl.SFTTrainer) with the engine
    doing forward, backward and the update; it takes `offload=` (see the module docstring)."""
    from transformers import Trainer

    if not (isinstance(trainer_class, type) and issubclass(trainer_class, Trainer)):
        raise TypeError(f"with_offload takes a transformers.Trainer class, got {trainer_class!r}")
    if trainer_class not in _CACHE:
        _CACHE[trainer_class] = type(f"Offload{trainer_class.__name__}", (_Offload, trainer_class),
                                     {"__doc__": f"{trainer_class.__name__} with tierwise's engine (tierwise.offload.hf)."})
    return _CACHE[trainer_class]


def _no_sums() -> dict[str, Any]:
    return {"entropy": 0.0, "mean_token_accuracy": 0.0, "aux_loss": 0.0, "n": 0, "n_aux": 0}


def _ratio(total: Any, count: Any) -> Any:
    """total / count, 0 where count is 0 (TRL's), without reading a device count back."""
    if isinstance(count, torch.Tensor):  # (in float64, as TRL sums its Python floats)
        return torch.where(count > 0, total / count.clamp(min=1), 0.0).double()
    if isinstance(total, torch.Tensor):
        return total.double() / count if count > 0 else 0.0
    return total / count if count > 0 else 0.0


def _sft_class(c: type) -> bool:
    """`c` is TRL's SFTTrainer itself."""
    return c.__module__.startswith("trl.") and c.__name__ == "SFTTrainer"


def _sft(trainer: Any) -> bool:
    """`trainer` is TRL's SFTTrainer (or a subclass of it)."""
    return any(map(_sft_class, type(trainer).__mro__))


def _check_own_loss(cls: type) -> None:
    """Refuse a Trainer class with a compute_loss or training_step of its own: the engine
    computes the model's own loss in its own step and never calls them (a subclass's custom
    loss, DPO's, a reward model's, ...). TRL's SFTTrainer computes the model's causal LM loss
    (its other losses are refused by loss_type)."""
    mro = cls.__mro__
    below = mro[mro.index(_Offload) + 1:] if _Offload in mro else mro
    # (a compute_loss is never called; a training_step only where _Offload's overrides it: a
    # subclass of the offloaded class wraps the engine's step, and runs)
    for method, classes in (("compute_loss", mro), ("training_step", below)):
        for c in classes:
            if c is _Offload or method not in c.__dict__:
                continue
            if c.__module__.startswith("transformers.") or _sft_class(c):
                break
            what = (f"TRL's {c.__name__} trains its own objective" if c.__module__.startswith("trl.")
                    else f"{c.__name__}.{method} is not called")
            raise TierwiseError(f"{what}: the engine trains a causal LM on the model's own loss in its own step "
                                "(transformers' Trainer or TRL's SFTTrainer); train this one without offload")


def _adapters_over_meta(cls: type, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The Trainer's arguments, with a from_pretrained (meta) model and `peft_config` (a
    Trainer class that takes one: SFTTrainer, or a subclass passing it on) made into the PEFT
    model here, its adapters given values (PEFT's own call would leave them meta). They are
    drawn after set_seed(args.seed), as SFTTrainer draws them."""
    import inspect

    from transformers import TrainingArguments, set_seed

    init = cls.__mro__[cls.__mro__.index(_Offload) + 1].__init__
    try:
        sig = inspect.signature(init)
        bound = sig.bind_partial(None, *args, **kwargs)  # (None: self)
    except (TypeError, ValueError):
        return args, kwargs  # the Trainer's own call says what is wrong
    given = bound.arguments
    kinds = {p.kind: p.name for p in sig.parameters.values()}
    extra = given.get(kinds.get(inspect.Parameter.VAR_KEYWORD, ""), {})  # a subclass's **kwargs
    rest = given.get(kinds.get(inspect.Parameter.VAR_POSITIONAL, ""), ())  # its *args (model first)
    holder = given if "peft_config" in given else extra
    model = given.get("model", extra.get("model", rest[0] if rest and "model" not in sig.parameters else None))
    if holder.get("peft_config") is None or _source(model) is None:
        return args, kwargs
    named = "args" in sig.parameters and sig.parameters["args"].kind is not inspect.Parameter.VAR_POSITIONAL
    training = given.get("args") if named else extra.get("args", rest[1] if len(rest) > 1 else None)
    seed = getattr(training, "seed", TrainingArguments.seed)
    set_seed(seed)
    peft_model = get_peft_model(model, holder.pop("peft_config"))  # with values, not meta
    if "model" in given:
        given["model"] = peft_model
    elif "model" in extra:
        extra["model"] = peft_model
    else:
        given[kinds[inspect.Parameter.VAR_POSITIONAL]] = (peft_model, *rest[1:])
    return bound.args[1:], bound.kwargs


def _check_ram(budget: Any, *, device: Any, model: Any, lora: bool) -> None:
    """Refuse host budgets this machine cannot give, as `finetune` does: cpu_mem, with the
    simulated device's gpu_mem (host RAM where the engine runs on the CPU) and the process
    beside them, against the RAM available now and what the model's own weights in host
    memory hold (the engine takes them over)."""
    from ..cli.machine import has_cuda, ram_over
    from .core.sizes import parse_size
    from .core.units import format_size
    from .plan.planner import process_bytes

    if budget is None:
        return
    tensors = list(model.parameters()) + list(model.buffers()) if isinstance(model, torch.nn.Module) else []
    weights = sum({t.data_ptr(): t.nbytes for t in tensors if t.device.type == "cpu"}.values())
    cpu = parse_size(budget.cpu)
    simulated = str(device) == "cpu" if device is not None else not has_cuda()
    gpu = (parse_size(budget.gpu) or 0) if simulated else 0
    if cpu is None and not gpu:
        return
    asked = ({f"cpu_mem {format_size(cpu)}": cpu} if cpu is not None else {}) | (
        {f"gpu_mem {format_size(gpu)} (the simulated device: host RAM)": gpu} if gpu else {})
    over = ram_over(asked, process_bytes(lora=lora), beside=weights)
    if over:
        raise TierwiseError(f"offload {over}: lower {next(iter(asked)).split()[0]}")


def _offload_options(given: Any) -> dict[str, Any]:
    """offload= as the Engine's option groups (offload.core.options.flat_options), refusing what
    the Trainer sets itself (the optimizer's hyperparameters come from TrainingArguments)."""
    given = given or {}
    if not isinstance(given, dict):
        raise TypeError(f"offload= takes a dict of engine options, got {type(given).__name__}")
    known = [k for k in dict.fromkeys([*FLAT, "device", *GROUPS]) if k not in _TRAINER_SETS]
    unknown = [k for k in given if k not in FLAT and k not in PASSED and k not in GROUPS]
    if unknown:
        raise TypeError(f"unknown offload= option {unknown[0]!r}; known: {', '.join(known)}")
    opts = flat_options(**given)
    optim = opts.get("optim")
    if optim is not None:  # what TrainingArguments sets would silently replace these
        optimizer_spec(optim.name)  # (an unknown name: refused here, not when training starts)
        default = Optim(optim.name)
        given_here = [k for k in _TRAINER_SETS
                      if given.get(k) is not None or getattr(optim, k) != getattr(default, k)]
        if given_here:
            raise TierwiseError("offload= " + ", ".join(f"{k} (set it with TrainingArguments' {_TRAINER_SETS[k]})"
                                                         for k in given_here) + ": the Trainer sets these itself")
    return opts


#: The optimizer options the Trainer sets itself (TrainingArguments' names), refused in offload=.
_TRAINER_SETS = {"lr": "learning_rate", "betas": "adam_beta1 and adam_beta2", "eps": "adam_epsilon",
                 "weight_decay": "weight_decay (which the engine refuses)", "grad_clip": "max_grad_norm",
                 "overlap_update": "nothing: the Trainer's update is applied in order"}


class _Offload:
    """The overrides with_offload mixes into a Trainer class."""

    engine: Any = None

    def __init__(self, *args: Any, offload: Any = None, **kwargs: Any):
        self._offload = offload
        self.engine = None
        self._stat_sums = {"train": _no_sums(), "eval": _no_sums()}  # TRL's token metrics, until logged
        self._save_layout: Any = None  # what save_pretrained writes of the model (_layout)
        self._pending_tokens: Any = 0
        _check_own_loss(type(self))
        args, kwargs = _adapters_over_meta(type(self), args, kwargs)
        # offload= refused before the Trainer's own __init__ (SFTTrainer tokenizes the dataset there)
        model = kwargs.get("model", args[0] if args else None)
        opts = _offload_options(offload)
        _check_ram(opts.get("budget"), device=opts.get("device"), model=model,
                   lora=hasattr(model, "peft_config") or kwargs.get("peft_config") is not None)
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        trainer: Any = self
        trainer.accelerator.device_placement = False  # the engine places the weights, not .to(device)
        if trainer.args.world_size > 1:
            raise TierwiseError("OffloadTrainer runs one process; several GPUs go through `finetune --nproc-per-node`")
        if trainer.args.weight_decay:
            raise TierwiseError(f"weight_decay={trainer.args.weight_decay}: the Trainer decays all but biases and norms, "
                                "the engine would decay every weight alike; train with weight_decay=0")
        if trainer.optimizer is not None:
            raise TierwiseError("optimizers=: the engine updates the weights; name its optimizer in offload= "
                                "(e.g. {'optimizer': 'adamw8bit'})")
        if trainer.compute_metrics is not None:
            raise TierwiseError("compute_metrics needs the model's logits; OffloadTrainer evaluates the loss only")
        args = trainer.args
        if args.fp16:
            raise TierwiseError("fp16=True: the engine computes in bf16 or fp32 (bf16=True, or neither)")
        # the engine computes the model's own loss: a Trainer that changes it would train something else
        if args.label_smoothing_factor:
            raise TierwiseError(f"label_smoothing_factor={args.label_smoothing_factor}: the engine computes the "
                                "model's own loss; train without it")
        if getattr(trainer, "compute_loss_func", None) is not None:
            raise TierwiseError("compute_loss_func: the engine computes the model's own loss")
        if getattr(args, "loss_type", None) not in (None, "nll"):  # TRL's SFTConfig
            raise TierwiseError(f"loss_type={args.loss_type!r}: the engine computes the model's own loss (nll)")
        # TRL adds a MoE router's loss over the accumulation steps' mean, the model's own loss (the
        # engine's) weighs it by each micro-batch's target tokens: the same without accumulation
        if getattr(trainer, "aux_loss_enabled", False) and args.gradient_accumulation_steps > 1:
            raise TierwiseError("the router's auxiliary loss with gradient_accumulation_steps > 1: TRL divides it "
                                "by the steps, the model's own loss (the engine's) adds it whole in every "
                                "micro-batch; train with gradient_accumulation_steps=1 or "
                                "SFTConfig(router_aux_loss_coef=0.0)")
        if getattr(args, "torch_compile", False):  # (the same numbers: a warning, not a refusal)
            log.warning("torch_compile=True is not applied: the engine runs the model eagerly, through its hooks")
        if args.load_best_model_at_end and args.save_only_model:  # (found out only when training ends)
            raise TierwiseError("load_best_model_at_end with save_only_model=True: the best step's weights come "
                                f"back from the engine's state ({ENGINE_STATE}), which save_only_model does not save; "
                                "train without save_only_model")
        given = self._offload if isinstance(self._offload, dict) else {}
        if given.get("precision") == "fp32" and args.bf16:
            raise TierwiseError("bf16=True with offload precision fp32: choose one")
        self._engine_options()  # (TrainingArguments' optim, here rather than in train())

    # -- the engine takes the model ------------------------------------------------------
    def _move_model_to_device(self, model: Any, device: Any) -> None:
        """The engine places the model's weights in its tiers, never the whole model on the device."""

    def _engine_options(self) -> dict[str, Any]:
        args: Any = self.args  # type: ignore[attr-defined]
        opts = _offload_options(self._offload)
        optim = opts.get("optim")
        if optim is None:
            name = str(getattr(args.optim, "value", args.optim))
            if name not in _OPTIMS:
                raise TierwiseError(f"optim={name!r}: the engine's optimizers are named in offload= "
                                    "(e.g. {'optimizer': 'adamw8bit'}); TrainingArguments' optim may be one of "
                                    + ", ".join(sorted(_OPTIMS)))
            optim = Optim(_OPTIMS[name])
        opts["optim"] = Optim(optim.name, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                              eps=args.adam_epsilon, weight_decay=0.0, momentum=optim.momentum, kwargs=optim.kwargs,
                              # (max_grad_norm 0: no clipping, but the Trainer still logs the norm)
                              grad_clip=args.max_grad_norm or float("inf"), overlap_update=False)
        if "precision" not in opts and args.bf16:
            opts["precision"] = Precision("bf16")
        unknown = set(opts) - set(GROUPS) - {"lora", "device"}
        if unknown:
            raise TierwiseError(f"offload= options the Trainer sets itself: {sorted(unknown)}")
        return opts

    def create_optimizer(self, model: Any = None) -> Any:
        trainer: Any = self
        if trainer.optimizer is None:
            from .engine.engine import Engine

            model = trainer.model
            self._dtypes = {n: p.dtype for n, p in model.named_parameters()}
            saved = _saved_dtype(model)
            if saved is not None:  # (a PEFT adapter keeps fp32, as PEFT casts adapters by default)
                self._dtypes = {n: saved if d.is_floating_point and ".lora_" not in n else d
                                for n, d in self._dtypes.items()}
            options = self._engine_options()
            self._save_layout = _layout(model)  # (before the engine takes the parameters)
            if _source(model) is not None and any(".modules_to_save." in n for n, _ in model.named_parameters()):
                raise TierwiseError("modules_to_save over a from_pretrained model is not supported yet: load the "
                                    "model with transformers, or train without modules_to_save")
            quantized = _take_linear4bit(model)
            if quantized:  # the QLoRA base bitsandbytes loaded: the engine's own NF4 base, the same codes
                nested = {t[2] for t in quantized}
                compute = options.get("precision", Precision("bf16" if quantized[0][3] == torch.bfloat16 else "fp32"))
                options["precision"] = Precision(compute.compute, base="nf4", double_quant=nested == {True})
            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            _own_checkpointing_off(base)  # (gradient_checkpointing=True, TRL's default)
            if "activations" not in options and self._longest() is None:
                # the first batch need not be the longest: every block recomputed keeps the slack
                # a longer one needs (the engine keeps activations only for a known longest batch)
                options["activations"] = Activations(recompute=True)
            self.engine = Engine(model, **options)
            try:
                if _source(base) is not None:
                    self._load_checkpoint(model, base)
                if quantized:
                    self.engine.load_weights((name, _dequantized(w)) for name, w, *_ in quantized)
                self._measure_longest()
            except BaseException as exc:  # the engine goes (its threads, its memory), and the model with it
                self.engine.close()
                self.engine = None
                exc.add_note("tierwise: the engine that held the model was closed: build the model and the "
                             "trainer again to retry")
                raise
            trainer.optimizer = _EngineOptimizer(self.engine, trainer.args.learning_rate)
        return trainer.optimizer

    def _load_checkpoint(self, model: Any, base: Any) -> None:
        """The from_pretrained model's weights, read shard by shard into the engine's chunks
        under the names they have now (a PEFT model: `base_model.model.` and `.base_layer.`)."""
        from ..cli.layout import iter_checkpoint

        src, layout = _source(base)
        prefix = "base_model.model." if model is not base else ""
        names = {n.removeprefix(prefix).replace(".base_layer.", "."): n for n, _ in model.named_parameters()}
        self.engine.load_weights((names.get(n, n), t) for n, t in iter_checkpoint(base, layout, src.model_dir))

    def _longest(self) -> int | None:
        """The longest row a batch can have, or None where it is not known: the train dataset's
        longest `input_ids` (where it reads cheaply: a datasets.Dataset's Arrow column, a list),
        within TRL's `max_length`, rounded up as the collator pads (`pad_to_multiple_of`);
        TRL's `max_length` alone where the dataset cannot tell."""
        trainer: Any = self
        given = getattr(trainer.args, "max_length", None)
        given = given if isinstance(given, int) and given >= 2 else None
        row = _longest_row(getattr(trainer, "train_dataset", None))
        if row is None or row < 2:
            return given
        row = row if given is None else min(row, given)
        collator = getattr(trainer, "data_collator", None)
        multiple = getattr(collator, "pad_to_multiple_of", None)
        if isinstance(multiple, int) and multiple > 1:
            row = -(-row // multiple) * multiple
        if getattr(collator, "padding", None) == "max_length" and isinstance(getattr(collator, "max_length", None), int):
            row = max(row, collator.max_length)  # type: ignore[union-attr]
        return row

    def _measure_longest(self) -> None:
        """Batches vary in length (a collator pads each to its longest row): where the longest
        is known (`_longest`), the engine is placed for the longest batch there can be, padded
        (the mask materialised), before the first step. Otherwise for the first batch; a
        longer one later raises StepOverBudget (train() adds what to give)."""
        length = self._longest()
        if length is None:
            return
        args: Any = self.args  # type: ignore[attr-defined]
        rows = args.per_device_train_batch_size
        ids = torch.zeros(rows, length, dtype=torch.long)
        mask = torch.ones_like(ids)
        mask[0, -1] = 0
        self.engine.measure({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            out = super().train(*args, **kwargs)  # type: ignore[misc]
        except InfeasibleBudget as exc:  # (its message speaks the CLI's and the Engine's words)
            if exc.args and isinstance(exc.args[0], str):  # in the message itself: a log of str(e) keeps it
                exc.args = (f"{exc.args[0]}. {self._budget_note()}", *exc.args[1:])
            else:
                exc.add_note(self._budget_note())
            raise
        self._save_through_engine()
        return out

    def _budget_note(self) -> str:
        longest = self._longest()
        rows = self.args.per_device_train_batch_size  # type: ignore[attr-defined]
        placed = (f"for batches of {rows} x {longest} tokens, the longest it found" if longest is not None else
                  "for the first batch (it found no longest: give TRL's max_length, or a datasets.Dataset with "
                  "input_ids, whose longest row it reads)")
        return (f"OffloadTrainer: the budgets are offload={{'gpu_mem': ..., 'cpu_mem': ...}}; the engine was placed "
                f"{placed}; a smaller per_device_train_batch_size or max_length needs less")

    def _save_through_engine(self) -> None:
        """The model's weights live in the engine (its parameters hold placeholders): the
        model's own save_pretrained (and push_to_hub, which calls it) writes the engine's, as
        save_model does. (A PEFT model's adapters are its own: its save_pretrained keeps them.)"""
        model: Any = getattr(self, "model", None)
        if self.engine is None or model is None or hasattr(model, "peft_config") \
                or not hasattr(model, "save_pretrained"):
            return
        own = vars(model).get("save_pretrained")
        own = getattr(own, "_tierwise_own", own) or type(model).save_pretrained.__get__(model)
        # the engine (which the model's hooks keep alive anyway) and what saving needs, not the
        # trainer: a script may drop the trainer and save the model
        engine, dtypes, saved, layout = self.engine, self._dtypes, _saved_dtype(model), self._save_layout

        def save_pretrained(save_directory: Any, *args: Any, state_dict: Any = None, **kwargs: Any) -> Any:
            if state_dict is None and not engine.closed and not args and set(kwargs) <= {"max_shard_size"} \
                    and _stream_save(engine, model, dtypes, save_directory, layout, **kwargs):
                return None  # (push_to_hub gives max_shard_size)
            if state_dict is None and not engine.closed:  # (closed: the weights were given back)
                state_dict = _engine_weights(engine, dtypes)
            out = own(save_directory, *args, state_dict=state_dict, **kwargs)
            _write_dtype(save_directory, saved)
            return out

        save_pretrained._tierwise_own = own  # type: ignore[attr-defined]
        model.save_pretrained = save_pretrained

    # -- a step ---------------------------------------------------------------------------
    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        trainer: Any = self
        model.train()  # (evaluation left it in eval mode: dropout would be off)
        inputs = trainer._prepare_inputs(inputs)
        scaled_by_model = trainer.model_accepts_loss_kwargs and num_items_in_batch is not None
        if scaled_by_model:
            inputs = {**inputs, "num_items_in_batch": num_items_in_batch}
        with self._token_stats("train", inputs):
            loss = self.engine.forward(inputs)
        if not scaled_by_model:
            loss = loss / trainer.current_gradient_accumulation_steps
        self.engine.backward(loss)
        return loss.detach()

    def _clip_grad_norm(self, model: Any) -> None:
        return None  # the engine clips in its update (Optim.grad_clip)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> None:
        return None  # known after the update: _maybe_log_save_evaluate reads the engine's

    def _maybe_log_save_evaluate(self, tr_loss: Any, grad_norm: Any, *args: Any, **kwargs: Any) -> Any:
        norm = self.engine.last_grad_norm if self.engine is not None else None
        grad_norm = norm.detach() if norm is not None else grad_norm  # (read back only when logged)
        return super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)  # type: ignore[misc]

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's logs (and so its report_to: TensorBoard, W&B) with each tier's peak."""
        if self.engine is not None and "loss" in logs:
            for tier, b in self.engine.ledger.peaks().items():
                logs[f"{tier}_peak_gib"] = round(b / 2**30, 4)
        self._resolve_token_stats()
        super().log(logs, *args, **kwargs)  # type: ignore[misc]

    def prediction_step(self, model: Any, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: Any = None) -> tuple[Any, None, None]:
        trainer: Any = self
        if not prediction_loss_only:  # predict(), or evaluate() with compute_metrics: logits wanted
            raise TierwiseError("OffloadTrainer evaluates the loss only (the engine never holds every token's "
                                "logits): predict() is not supported; evaluate() gives eval_loss")
        if self.engine is None:  # evaluated before training: the engine takes the model now
            self.create_optimizer()
        inputs = trainer._prepare_inputs(inputs)
        if "labels" not in inputs:
            return None, None, None
        with self._token_stats("eval", inputs):
            loss = self.engine.eval_loss(inputs)
        from .engine.batches import target_tokens

        if loss != loss and _sft(self) and target_tokens(inputs) == 0:
            loss = 0.0  # TRL's SFTTrainer: a batch without target tokens evaluates to 0 (its count clamped to 1)
        return torch.tensor(loss), None, None

    @contextlib.contextmanager
    def _token_stats(self, mode: str, inputs: dict[str, Any]) -> Iterator[None]:
        """A TRL trainer's token metrics (entropy, mean_token_accuracy, num_tokens, aux_loss), from
        the engine's loss: kept on the device until `log` (no read-back during a step)."""
        if not isinstance(getattr(self, "_metrics", None), dict):  # (transformers' Trainer logs none)
            yield
            return
        from .engine.headloss import collecting

        with collecting() as stats:
            yield
        if not stats.counted:  # (the model's own loss gave no logits to count from: nothing logged)
            return
        sums = self._stat_sums[mode]  # (sums on the device, one per metric: nothing grows with the steps)
        sums["entropy"] = sums["entropy"] + _ratio(stats.entropy, stats.tokens)
        sums["mean_token_accuracy"] = sums["mean_token_accuracy"] + _ratio(stats.top1, stats.tokens)
        sums["n"] += 1
        if stats.aux_loss is not None:
            sums["aux_loss"] = sums["aux_loss"] + stats.aux_loss
            sums["n_aux"] += 1
        if mode == "train":
            mask, ids = inputs.get("attention_mask"), inputs.get("position_ids")
            self._pending_tokens = self._pending_tokens + (
                mask.sum() if isinstance(mask, torch.Tensor) else ids.size(1) if isinstance(ids, torch.Tensor) else 0)

    def _resolve_token_stats(self) -> None:
        """The token metrics of the mode being logged into the TRL trainer's `_metrics`, as its
        compute_loss and log have them: the mean over the micro-batches of each one's ratio."""
        trainer: Any = self
        if not isinstance(getattr(trainer, "_metrics", None), dict):
            return
        trainer._total_train_tokens += int(self._pending_tokens)
        self._pending_tokens = 0
        mode = "train" if trainer.model.training else "eval"  # (as TRL's log decides)
        sums = self._stat_sums[mode]
        if not sums["n"]:
            return
        metrics = trainer._metrics[mode]
        metrics["entropy"].append(float(sums["entropy"]) / sums["n"])
        metrics["mean_token_accuracy"].append(float(sums["mean_token_accuracy"]) / sums["n"])
        metrics["num_tokens"] = [trainer._total_train_tokens]
        if getattr(trainer, "aux_loss_enabled", False) and sums["n_aux"]:
            metrics["aux_loss"].append(float(sums["aux_loss"]) / sums["n_aux"])
        self._stat_sums[mode] = _no_sums()

    # -- what is saved ----------------------------------------------------------------------
    def _save(self, output_dir: str | None = None, state_dict: Any = None) -> None:
        trainer: Any = self
        out = output_dir if output_dir is not None else trainer.args.output_dir
        if self.engine is not None and state_dict is None and trainer.args.should_save \
                and _stream_save(self.engine, trainer.model, self._dtypes, out, self._save_layout):
            # the rest of what Trainer._save writes beside the weights
            tokenizer = trainer.processing_class or getattr(trainer.data_collator, "tokenizer", None)
            if tokenizer is not None:
                tokenizer.save_pretrained(out)
            torch.save(trainer.args, os.path.join(out, "training_args.bin"))
            return
        if self.engine is not None and state_dict is None:
            state_dict = self._weights()
        super()._save(output_dir, state_dict=state_dict)  # type: ignore[misc]
        _write_dtype(out, _saved_dtype(getattr(self, "model", None)))

    def _weights(self) -> dict[str, torch.Tensor]:
        return _engine_weights(self.engine, self._dtypes)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)  # type: ignore[misc]
        if self.engine is not None:
            from ..cli.checkpoint import NonFiniteState, save_tree

            try:
                save_tree(Path(output_dir), _ENGINE_TREE, self.engine.state_dict(deferred=True))
            except NonFiniteState as exc:
                raise TierwiseError(f"the engine's state holds NaN or inf ({exc.where}): the checkpoint in "
                                    f"{output_dir} is incomplete (training diverged: lower the learning rate, or "
                                    "give max_grad_norm)") from None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if not _has_engine_state(resume_from_checkpoint):
            raise TierwiseError(f"{resume_from_checkpoint} holds no {ENGINE_STATE}, the engine's state: saved with "
                                "save_only_model=True, or by a plain Trainer; resume from a checkpoint an offloaded run "
                                "saved without save_only_model, or start from its weights: load the checkpoint "
                                "directory as the model")
        # the weights come back with the engine's state (_load_optimizer_and_scheduler)

    def _load_best_model(self) -> None:
        """load_best_model_at_end: the best checkpoint's weights (and optimizer state) into the
        engine, which holds the model's weights, not the model's placeholders."""
        trainer: Any = self
        best = trainer.state.best_model_checkpoint
        if self.engine is None:
            return super()._load_best_model()  # type: ignore[misc]
        if not _has_engine_state(best):
            raise TierwiseError(f"load_best_model_at_end: {best} holds no {ENGINE_STATE}, the weights of the best step; "
                                "load that checkpoint directory as the model yourself")
        self._load_engine_state(best)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
        if checkpoint is not None and self.engine is not None:
            self._load_engine_state(checkpoint)

    def _load_engine_state(self, directory: str) -> None:
        """The engine's state from a checkpoint directory, each chunk read into its home tier."""
        from ..cli.checkpoint import load_tree

        if os.path.isfile(os.path.join(directory, ENGINE_STATE)):
            state = load_tree(Path(directory), _ENGINE_TREE, lazy=True)
        else:  # an older checkpoint's pickle: mapped, not read whole
            state = torch.load(os.path.join(directory, _ENGINE_PICKLE), map_location="cpu", mmap=True,
                               weights_only=False)
        self.engine.load_state_dict(state)


def _longest_row(dataset: Any) -> int | None:
    """The longest `input_ids` of a dataset whose rows read cheaply (a datasets.Dataset: its
    Arrow column's list lengths, of the rows a filter() or shuffle() kept; a list or tuple of
    mappings), or None (another dataset: reading each row may be costly; not a list of ids)."""
    if isinstance(dataset, (list, tuple)):
        if not dataset or not all(isinstance(r, Mapping) and "input_ids" in r for r in dataset):
            return None
        ids = [r["input_ids"] for r in dataset]
        if any(isinstance(i, torch.Tensor) and i.dim() != 1 for i in ids):
            return None
        return max(len(i) for i in ids)
    try:
        import datasets
        import pyarrow as pa
        import pyarrow.compute as pc
    except ImportError:
        return None
    if not isinstance(dataset, datasets.Dataset) or "input_ids" not in (dataset.column_names or ()):
        return None
    column = dataset.data.column("input_ids")
    kind = column.type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_integer(kind.value_type):
        return None
    indices = getattr(dataset, "_indices", None)  # (the rows it keeps, where it keeps fewer than its table)
    if indices is not None:
        if getattr(indices, "num_columns", None) != 1:  # (datasets' Table wraps a pyarrow one)
            return None
        lengths = pc.list_value_length(column).take(indices.column(0))
        longest = pc.max(lengths).as_py() if len(lengths) else None
    else:  # chunk by chunk: no array of every row's length at once
        longest = max((pc.max(pc.list_value_length(c)).as_py() or 0 for c in column.chunks), default=None)
    return int(longest) if longest else None


def _take_linear4bit(model: torch.nn.Module) -> list[tuple[str, Any, bool, torch.dtype]]:
    """Every bitsandbytes Linear4bit of `model` (a QLoRA model loaded with BitsAndBytesConfig)
    replaced by a frozen nn.Linear on the meta device, its bias kept; returns (weight name, the
    Params4bit, double-quantized?, compute dtype) for the engine to load. The engine stores NF4
    as bitsandbytes does (blocks of 64, absmax, double quantization): decoded and encoded again,
    the codes are the same. Only NF4 with blocks of 64 is taken (one line otherwise)."""
    try:
        from bitsandbytes.nn import Linear4bit
    except ImportError:
        return []
    taken = []
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, Linear4bit):
            continue
        state = mod.weight.quant_state
        if state is None or state.quant_type != "nf4" or state.blocksize != 64:
            raise TierwiseError(f"{name}: a 4-bit layer the engine cannot take as it is (quant_type "
                                f"{getattr(state, 'quant_type', None)}, blocks of {getattr(state, 'blocksize', None)}); "
                                "load it in NF4 with bitsandbytes' default blocks of 64")
        linear = torch.nn.Linear(mod.in_features, mod.out_features, bias=False, device="meta", dtype=state.dtype)
        linear.weight.requires_grad_(False)
        if mod.bias is not None:
            linear.bias = mod.bias
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, linear)
        compute = getattr(mod, "compute_dtype", None) or state.dtype
        taken.append((f"{name}.weight", mod.weight, bool(state.nested), compute))
    return taken


def _dequantized(weight: Any) -> torch.Tensor:
    import bitsandbytes.functional as bnbf

    return bnbf.dequantize_4bit(weight.data, weight.quant_state).float().cpu()


def _write_dtype(directory: Any, saved: "torch.dtype | None") -> None:
    """config.json names the dtype the weights were saved in (transformers writes the
    parameters', the engine's fp32 placeholders)."""
    path = os.path.join(str(directory), "config.json")
    if saved is None or not os.path.isfile(path):
        return
    with open(path) as f:
        config = json.load(f)
    config["dtype"] = str(saved).removeprefix("torch.")
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def _layout(model: Any) -> Any:
    """What save_pretrained writes of `model` (cli.layout.ModelLayout: names, ties, buffers),
    taken while its parameters are its own (the engine's placeholders share one storage, which
    would read as ties), or None where the weights are not streamed out (`_stream_save`)."""
    from transformers import PreTrainedModel

    if hasattr(model, "peft_config") or not isinstance(model, PreTrainedModel):
        return None
    source = _source(model)
    if source is not None:
        return source[1]
    from ..cli.layout import ModelLayout

    return ModelLayout.of(model)


def _stream_save(engine: Any, model: Any, dtypes: dict[str, torch.dtype], directory: Any, layout: Any,
                 max_shard_size: Any = "50GB") -> bool:  # (transformers 5's default)
    """A whole model's weights written as its save_pretrained writes them (config, safetensors
    shards and their index, generation config), streamed from the engine one tensor at a time
    (cli.export): the host never holds the whole model. False, nothing written, where it does
    not apply: a PEFT model (its adapters: small), not a transformers PreTrainedModel (no
    `layout`), float weights of several dtypes."""
    floats = {d for d in dtypes.values() if d.is_floating_point}
    if layout is None or len(floats) != 1 or getattr(model, "_auto_class", None) is not None:
        return False  # (remote code: transformers' save_pretrained copies the model's code too)
    from ..cli.export import export_hf

    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]  # (as save_pretrained names it)
    generation = model.generation_config if model.can_generate() and model.generation_config is not None else None
    export_hf(engine.named_parameters_fp32(), directory, config=config, model=model, layout=layout,
              dtype=floats.pop(), generation_config=generation, max_shard_size=max_shard_size)
    return True


def _engine_weights(engine: Any, dtypes: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
    """The model's weights from the engine's masters, each in the dtype the model had (a PEFT
    model: its trainable adapters, what save_pretrained keeps of them)."""
    peft = hasattr(engine.model, "peft_config")
    return {name: t.to(dtypes.get(name, t.dtype)) for name, t in engine.named_parameters_fp32(trainable_only=peft)}


def _base(model: Any) -> Any:
    """A PEFT model's base model, or the model."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _saved_dtype(model: Any) -> "torch.dtype | None":
    """The dtype from_pretrained(dtype=...) asked the trained weights to be saved in, or None."""
    return getattr(_base(model), _SAVE_DTYPE, None)


def _source(model: Any) -> Any:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, _SOURCE, None)


class _EngineOptimizer(torch.optim.Optimizer):
    """What the Trainer steps and schedules: its rate goes to the engine, its step is the
    engine's update. Its one parameter is a placeholder; the engine holds the real ones."""

    def __init__(self, engine: Any, lr: float):
        super().__init__([torch.zeros(1, requires_grad=True)], {"lr": lr})
        self.engine = engine

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise TierwiseError("the engine's update takes no closure")
        self.engine.set_lr(self.param_groups[0]["lr"])
        self.engine.optimizer_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The engine starts each step's gradients afresh."""


def __getattr__(name: str) -> Any:
    if name == "OffloadTrainer":  # built on first use: transformers is imported only then
        from transformers import Trainer

        cls = with_offload(Trainer)
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
