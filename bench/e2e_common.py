"""What both sides of bench/e2e_vs_deepspeed.py share: model, data, the timed loop, disk counters.

Imported by the tierwise child (system python) and by bench/ds_runner.py (inside the
DeepSpeed venv), so it depends on torch and transformers only, never on tierwise.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Callable

import torch


def build_model(hf_config: dict, *, seed: int) -> torch.nn.Module:
    """The Llama of `hf_config` (a LlamaConfig.to_dict()), fp32, weights drawn from `seed`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**hf_config)
    cfg.use_cache = False
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).float()


def lora_config(lora: dict):
    """PEFT's LoraConfig for the spec's `lora` entry: rank `r`, `alpha`, `targets` ("all-linear"
    or a list of module names), no dropout (dropout draws random masks: the sides would differ)."""
    from peft import LoraConfig

    targets = lora["targets"]
    if targets != "all-linear" and (not isinstance(targets, list) or not targets):
        raise ValueError(f"LoRA targets must be 'all-linear' or a non-empty list of module names, got {targets!r}")
    return LoraConfig(r=int(lora["r"]), lora_alpha=int(lora["alpha"]), lora_dropout=0.0, bias="none",
                      target_modules=targets)


def parse_lora_targets(text: str) -> "str | list[str]":
    """`--lora-targets`: 'all-linear' or 'q_proj,k_proj,...' (the list PEFT matches by name)."""
    if text.strip() == "all-linear":
        return "all-linear"
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise ValueError(f"--lora-targets: no module names in {text!r}")
    return names


def build(spec: dict) -> torch.nn.Module:
    """The spec's model: the Llama, and with `spec["lora"]` PEFT's get_peft_model over it, its
    adapters drawn (PEFT's init: lora_A Kaiming-uniform, lora_B zero) from `spec["lora"]["seed"]`.
    Every side builds it with this one function, so all start from the same weights."""
    model = build_model(spec["hf_config"], seed=spec["seed"])
    lora = spec.get("lora")
    if not lora:
        return model
    from peft import get_peft_model

    torch.manual_seed(int(lora["seed"]))
    return get_peft_model(model, lora_config(lora))


def make_batches(*, vocab: int, count: int, batch: int, seq: int, seed: int) -> list[torch.Tensor]:
    """`count` fixed token batches [batch, seq] (int64), the same on every run for `seed`."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(count)]


def weights_checksum(model: torch.nn.Module) -> float:
    """Sum of all parameters in float64: both sides must start from the same weights."""
    with torch.no_grad():
        return float(sum(p.detach().double().sum().item() for p in model.parameters()))


def read_proc_io() -> dict[str, int]:
    """This process's storage I/O (/proc/self/io, summed over all its threads)."""
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key.strip()] = int(value)
    return out


def timed_loop(step: Callable[[torch.Tensor], float], batches: list[torch.Tensor], *, warmup: int,
               sync: Callable[[], None] = lambda: None,
               counters: Callable[[], dict[str, int]] = dict) -> dict:
    """Run `step` on every batch; time and count disk bytes over the batches after `warmup`.

    counters: extra cumulative byte counters (e.g. our NvmeStore's), reported per timed step.
    """
    times, losses = [], []
    io0 = c0 = None
    for i, x in enumerate(batches):
        if i == warmup:
            sync()
            io0, c0 = read_proc_io(), counters()
        sync()
        t0 = time.perf_counter()
        losses.append(float(step(x)))
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    io1, c1 = read_proc_io(), counters()
    n = max(len(times), 1)
    return {
        "counters_per_step": {k: (c1[k] - c0[k]) / n for k in c1} if c0 is not None else {},
        "losses": losses,
        "step_times": times,
        "step_s": statistics.median(times) if times else float("nan"),
        "write_bytes_per_step": (io1["write_bytes"] - io0["write_bytes"]) / n if io0 else 0.0,
        "read_bytes_per_step": (io1["read_bytes"] - io0["read_bytes"]) / n if io0 else 0.0,
        "cancelled_write_bytes_per_step": ((io1["cancelled_write_bytes"] - io0["cancelled_write_bytes"]) / n
                                           if io0 else 0.0),
    }


def load_spec(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def emit(result: dict) -> None:
    """The child's one result line, last on stdout, read by the parent."""
    print("E2E_RESULT " + json.dumps(result), flush=True)


def pin_threads(spec: dict) -> None:
    torch.set_num_threads(int(spec["threads"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(spec["threads"]))
