"""Verify a plan by measurement: a few real steps with the plan's settings, on this machine.

    report = verify(model="tiny", gpu_mem="2M", cpu_mem="64M", optimizer="adamw",
                    precision="fp32", batch_size=2, seq_len=32, chunk_bytes="16K")
    print(report.render()); sys.exit(0 if report.passed else 1)

The engine trains the plan's model (random weights: the bytes do not depend on their values)
for `steps` steps on random tokens of the plan's batch shape, padded as the worst step of a
run whose data has padding (or on the given batches), placed up front from the planned
activations as `finetune` runs it. The first step is the warm-up
(it records the access trace); the ledger's peaks are then reset, so the measured peaks are
the steady state the planner predicts. The verdict passes when every tier's peak, warm-up
included, stays within its budget (on CUDA also the allocator's `max_memory_allocated`), the
planned steady-state peak of every tier is within `tolerance` of the measured one, and no
tier's warm-up peak is above the plan by more than `tolerance` (the plan is for the worst step,
and the warm-up's batch may be the data's worst).

On a machine without CUDA the `gpu` tier is the simulated device, planned with the
`--hardware` profile when it is a simulated device's (`finetune profile` run on such a machine),
else with the built-in `cpu-sim` one; budgets left unset come from the `--hardware` profile, as
in `finetune plan`. A CXL budget without a CXL node runs on an emulated node.

A LoRA run (`lora=peft.LoraConfig(...)`, `base_dtype`, `double_quant`) is built as training
builds it: PEFT's adapters injected into the meta-device model (offload.engine.lora.inject_meta,
same targets, rank and dropout), the base frozen, stored as `base_dtype` in the homes the
plan gives it. Its verdict also compares the base's traffic per steady step (from the third
step on, so at least 3: the second starts with an empty cache, later ones with the chunks the
step before kept over its end): the bytes read from each host-side tier (every fetch of a frozen
chunk, at its stored size) within `tolerance` of the plan's `base_read`, and the base's bytes
written to NVMe over those steps, which must be 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from ..core.chunks import DEFAULT_CHUNK_BYTES
from ..core.errors import TierwiseError
from ..engine.frozen_base import linear_modules
from ..engine.lora import inject_meta
from ..engine.model_info import hf_meta_model, model_specs
from ..runtime.store import SwapKind
from ..core.vocab import TIERS
from ..plan.planner import MASKED, Plan, make_plan, recompute_text
from ..core.units import format_size
from ...profiles import HardwareProfile, ModelProfile, load_hardware_profile
from ...profiles.model import text_config
from ...profiles.hardware import unmeasured_cxl

log = logging.getLogger(__name__)

#: Used when a CXL budget is given and the hardware profile has no [cxl] table (emulated node).
EMULATED_CXL = unmeasured_cxl(1 << 40)


@dataclass(frozen=True, kw_only=True)
class VerifyReport:
    """Planned against measured bytes per tier and step time, and the verdict."""

    plan: Plan
    """The plan the run was compared with (for the device the engine ran on)."""
    budgets: dict[str, int | None]
    """Budget per tier the engine ran under (None: unlimited)."""
    measured: dict[str, int]
    """Steady-state ledger peak per tier (after the warm-up step)."""
    warmup: dict[str, int]
    """Ledger peak per tier during the warm-up step."""
    device_peak: int | None
    """CUDA only: the caching allocator's peak allocated bytes during the run (else None)."""
    step_s: float
    """Measured seconds per steady-state step (mean)."""
    losses: tuple[float, ...]
    device: str
    """Where the `gpu` tier was: "cuda" or "simulated (cpu)"."""
    tolerance: float
    failures: tuple[str, ...]
    """One line per failed check; empty when the run passed."""
    base_read: dict[str, int] = dataclasses.field(default_factory=dict)
    """LoRA runs: bytes of the frozen base read per steady step from each host-side tier (mean)."""
    base_written: int = 0
    """LoRA runs: bytes of the frozen base written to NVMe over the steady steps (must be 0)."""

    @property
    def passed(self) -> bool:
        return not self.failures

    def render(self) -> str:
        p = self.plan
        lora = f"LoRA r{p.lora_rank}{' over ' + p.base_dtype if p.base_dtype else ''}, " if p.lora_rank is not None else ""
        lines = [f"verify {p.model}: {lora}{p.optimizer}, {p.precision}, batch {p.batch_size} x {p.seq_len}"
                 f"{MASKED if p.padded else ''}, "
                 f"recompute {recompute_text(p.checkpointing, p.layers)}, "
                 f"{len(self.losses)} steps (1 warm-up) on the {self.device} device"]
        rows = [("tier", "planned", "measured", "diff", "warm-up", "budget")]
        for tier in TIERS:
            budget = self.budgets.get(tier, 0)
            planned, measured = p.peak.get(tier, 0), self.measured.get(tier, 0)
            if tier not in self.budgets and not planned:
                continue
            rows.append((tier, format_size(planned), format_size(measured), _diff(planned, measured),
                         format_size(self.warmup.get(tier, 0)), "unlimited" if budget is None else format_size(budget)))
        if self.device_peak is not None:
            rows.append(("cuda alloc", "-", format_size(self.device_peak), "-", "-", format_size(self.budgets["gpu"])))
        if p.lora_rank is not None:
            for tier in ("host", "cxl", "nvme"):
                planned, measured = p.base_read.get(tier, 0), self.base_read.get(tier, 0)
                if planned or measured:
                    rows.append((f"base read {tier}", format_size(planned), format_size(measured),
                                 _diff(planned, measured), "-", "per step"))
            rows.append(("base written", format_size(p.base_written), format_size(self.base_written),
                         _diff(p.base_written, self.base_written), "-", "nvme"))
        rows.append(("step", f"{p.step_s:.3f} s", f"{self.step_s:.3f} s", _diff(p.step_s, self.step_s), "-", "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines += ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
        lines.append("losses: " + " ".join(f"{x:.4f}" for x in self.losses))
        pct = f"{100 * self.tolerance:.0f}%"
        if self.passed:
            base = "; the base's reads per tier too, and nothing of it written" if p.lora_rank is not None else ""
            lines.append(f"PASS: every tier within its budget; planned peaks within ±{pct} of measured{base} "
                         "(step time is informative, not checked)")
        else:
            lines.append(f"FAIL: {'; '.join(self.failures)}")
        return "\n".join(lines)


def _diff(planned: float, measured: float) -> str:
    if not measured:
        return "-" if not planned else "+inf"
    return f"{100 * (planned - measured) / measured:+.1f}%"


def verify(*, model: Any, hardware: "HardwareProfile | str | None" = None, gpu_mem: "int | str | None" = None,
           cpu_mem: "int | str | None" = None, cxl_mem: "int | str | None" = None, nvme_path: str | None = None,
           optimizer: str = "adamw", precision: str = "fp32", batch_size: int = 4, seq_len: int = 128,
           grad_accum: int = 1, chunk_bytes: "int | str" = DEFAULT_CHUNK_BYTES,
           optimizer_kwargs: dict | None = None, lr: float = 1e-4, steps: int = 3,
           batches: Iterable[dict[str, torch.Tensor]] | None = None, seed: int = 0,
           tolerance: float = 0.10, name: str | None = None, checkpointing: bool | None = None,
           padded: bool = True, build: Callable[[Any], torch.nn.Module] | None = None,
           lora: Any = None, base_dtype: str | None = None, double_quant: bool = False,
           row_positions: bool = False, windows: bool = False) -> VerifyReport:
    """Plan, then run `steps` real steps (the first is the warm-up) and compare; see the module
    docstring. `model`: a profile, a profile name, or a transformers config/model (its shapes).
    `batches`: batches of `batch_size * grad_accum` rows (default: random tokens). `name`: how
    the report names a model given as a transformers config. `checkpointing` as the Engine takes it.
    `build`: makes the meta-device module the engine trains from the config (the default ties
    tied weights as `from_pretrained` does); the plan chunks that module's parameters.
    `row_positions`: the given batches carry position ids per row (planner.make_plan's);
    `windows`: `build` gives the model offload.engine.segments' attention (planner.make_plan's).
    `padded`: plan for padded batches, the worst step of a run whose data has padding (as
    `finetune` plans a run); the random batches are then padded too (the tail of one row).
    `lora`: a peft.LoraConfig: a LoRA run over a frozen base stored as `base_dtype`
    (`double_quant`: NF4's absmax quantized too), as Engine(lora=..., precision=Precision(base=...)) trains it.
    Raises TierwiseError (InfeasibleBudget included) for settings that cannot run."""
    if steps < 2:
        raise TierwiseError(f"--verify needs at least 2 steps (a warm-up and a measured one), got {steps}")
    if lora is not None and steps < 3:
        raise TierwiseError(f"--verify of a LoRA run needs at least 3 steps (a warm-up, one that starts with an "
                            f"empty cache, then the steady ones whose base reads it compares), got {steps}")
    profile, config = _shapes(model, name=name)
    module = (build or hf_meta_model)(config)
    params = model_specs(module)  # the base's: the planner injects the adapters itself
    linears = linear_modules(module) if lora is not None else None
    if lora is not None:
        try:
            inject_meta(module, lora, seed=seed)
        except ValueError as e:
            raise TierwiseError(f"LoRA: {(str(e).splitlines() or [type(e).__name__])[0]}") from None
    user_hw = hardware if isinstance(hardware, HardwareProfile) else load_hardware_profile(hardware or "cpu-sim")
    args = dict(model=profile, nvme_path=nvme_path, optimizer=optimizer, precision=precision, batch_size=batch_size,
                seq_len=seq_len, grad_accum=grad_accum, chunk_bytes=chunk_bytes, optimizer_kwargs=optimizer_kwargs,
                checkpointing=checkpointing, padded=padded, params=params, row_positions=row_positions, windows=windows,
                **_lora_options(lora, base_dtype, double_quant, linears))
    # Budgets as `finetune plan` resolves them (unset: the --hardware profile's sizes) ...
    asked = make_plan(hardware=_with_cxl(user_hw, cxl_mem), gpu_mem=gpu_mem, cpu_mem=cpu_mem, cxl_mem=cxl_mem,
                      **args).budgets
    # ... then the plan of the device the engine runs on here: the given profile where it is of
    # that kind (a GPU's on CUDA; without one, a simulated device's, e.g. `finetune profile`
    # measured on this machine), else the built-in cpu-sim.
    cuda = torch.cuda.is_available()
    local = user_hw if user_hw.simulated != cuda else load_hardware_profile("cpu-sim")
    plan = make_plan(hardware=_with_cxl(local, asked["cxl"]), gpu_mem=asked["gpu"], cpu_mem=asked["host"],
                     cxl_mem=asked["cxl"], cuda=cuda, **args)  # (cpu-sim on a GPU: its workspace margin)
    _check_memory(plan, cuda=cuda)
    budgets = {"gpu": asked["gpu"], "host": asked["host"]}
    if asked["cxl"]:
        budgets["cxl"] = asked["cxl"]
    engine = _engine(module, config, plan=plan, budgets=budgets, nvme_path=nvme_path, lr=lr, seed=seed,
                     cxl_bandwidth=(user_hw.cxl or EMULATED_CXL).bandwidth_gbps * 1e9,
                     optimizer_kwargs=optimizer_kwargs, base_dtype=base_dtype, double_quant=double_quant)
    data = _batches(batches, rows=batch_size * grad_accum, seq_len=seq_len, vocab=text_config(config).vocab_size, seed=seed,
                    padded=padded)
    try:
        with cuda_peak(asked["gpu"]) as device:
            losses = [engine.step(next(data), grad_accum=grad_accum)]
            warmup = engine.ledger.peaks()
            engine.ledger.reset_peaks()  # steady state from here: what the planner predicts
            # the first step after the warm-up starts with an empty cache; from the next one a step
            # begins with what the last one kept (offload.engine.residency): the base's reads are
            # counted from there, the steady state the planner predicts
            settle = 1 if lora is not None else 0
            t0 = time.perf_counter()
            losses += [engine.step(next(data), grad_accum=grad_accum) for _ in range(settle)]
            with _base_traffic(engine) as traffic:
                losses += [engine.step(next(data), grad_accum=grad_accum) for _ in range(steps - 1 - settle)]
            step_s = (time.perf_counter() - t0) / (steps - 1)
        measured = engine.ledger.peaks()
        limits = dict(engine.ledger.budgets)
    finally:
        engine.close()
    base_read = {t: b // (steps - 1 - settle) for t, b in traffic["read"].items()}
    failures = _check(plan, limits=limits, warmup=warmup, measured=measured, device_peak=device["peak"],
                      gpu_budget=asked["gpu"], tolerance=tolerance)
    if plan.lora_rank is not None:
        failures += _check_base(plan, read=base_read, written=traffic["written"], tolerance=tolerance)
    return VerifyReport(plan=plan, budgets=limits, measured=measured, warmup=warmup, device_peak=device["peak"],
                        step_s=step_s, losses=tuple(losses), device="cuda" if cuda else "simulated (cpu)",
                        tolerance=tolerance, failures=tuple(failures), base_read=base_read,
                        base_written=traffic["written"])


def _lora_options(lora: Any, base_dtype: str | None, double_quant: bool, linears: dict | None) -> dict:
    """make_plan's LoRA keywords for a peft.LoraConfig (None: a full fine-tuning run)."""
    if lora is None:
        if base_dtype is not None:
            raise TierwiseError(f"base_dtype {base_dtype} stores a frozen base: give lora=LoraConfig(...)")
        return {}
    targets = lora.target_modules
    targets = targets if isinstance(targets, str) else ",".join(sorted(targets))
    return dict(lora_rank=lora.r, lora_targets=targets, lora_dropout=lora.lora_dropout, base_dtype=base_dtype,
                double_quant=double_quant, linears=linears)


@contextlib.contextmanager
def _base_traffic(engine: Any) -> Iterator[dict]:
    """Count the frozen base's traffic while in the block: box["read"] = {tier: bytes fetched
    from there} (every fetch of a frozen chunk into the device, at its stored size: what
    crosses the link) and box["written"] = bytes of it written to NVMe."""
    box: dict[str, Any] = {"read": {}, "written": 0}
    frozen = set(engine.plan.frozen)
    if not frozen:
        yield box
        return
    store, cache, nvme = engine.store, engine.residency.cache, engine.nvme
    sources = {c: store.compute_source(c) for c in frozen}
    nbytes = {c: s.nbytes if isinstance(s, SwapKind) else s.numel() * s.element_size() for c, s in sources.items()}
    swapped = {s.key: c for c, s in sources.items() if isinstance(s, SwapKind)}
    fetch = cache.fetch

    def counting_fetch(cid: int, buf: torch.Tensor) -> Any:
        if cid in frozen:
            tier = store.compute_tier(cid)
            box["read"][tier] = box["read"].get(tier, 0) + nbytes[cid]
        return fetch(cid, buf)

    writes = {}
    if nvme is not None:
        for name in ("write_async", "zeros"):
            orig = writes[name] = getattr(nvme, name)

            def counting(key, *a, _orig=orig, **k):
                if key in swapped:
                    box["written"] += nbytes[swapped[key]]
                return _orig(key, *a, **k)

            setattr(nvme, name, counting)
    cache.fetch = counting_fetch
    try:
        yield box
    finally:
        cache.fetch = fetch
        for name, orig in writes.items():
            setattr(nvme, name, orig)


def _check_base(plan: Plan, *, read: dict[str, int], written: int, tolerance: float) -> list[str]:
    """A LoRA run's base traffic per step against the plan: reads per tier, nothing written."""
    out = []
    for tier in ("host", "cxl", "nvme"):
        planned, got = plan.base_read.get(tier, 0), read.get(tier, 0)
        if abs(planned - got) > tolerance * got:
            out.append(f"base read from {tier} planned {format_size(planned)} ({planned} B) per step vs measured "
                       f"{format_size(got)} ({got} B): {_diff(planned, got)}, allowed ±{100 * tolerance:.0f}%")
    if written:
        out.append(f"{format_size(written)} of the frozen base written to NVMe: it must never be written back")
    return out


def _check(plan: Plan, *, limits: dict, warmup: dict, measured: dict, device_peak: int | None,
           gpu_budget: int, tolerance: float) -> list[str]:
    out = []
    for tier, limit in limits.items():
        peak = max(warmup.get(tier, 0), measured.get(tier, 0))
        if limit is not None and peak > limit:
            out.append(f"{tier} peak {format_size(peak)} exceeds its budget {format_size(limit)}")
    if device_peak is not None and device_peak > gpu_budget:
        out.append(f"cuda allocator peak {format_size(device_peak)} exceeds the gpu budget {format_size(gpu_budget)}")
    for tier in TIERS:
        planned, got = plan.peak.get(tier, 0), measured.get(tier, 0)
        if abs(planned - got) > tolerance * got:
            out.append(f"{tier} planned {format_size(planned)} ({planned} B) vs measured {format_size(got)} "
                       f"({got} B): {_diff(planned, got)}, allowed ±{100 * tolerance:.0f}%")
        first = warmup.get(tier, 0)  # (the plan is for the worst step: the warm-up's batch may be it)
        if first > planned * (1 + tolerance):
            out.append(f"{tier} warm-up peak {format_size(first)} ({first} B) is above the planned "
                       f"{format_size(planned)} ({planned} B) by more than {100 * tolerance:.0f}%: a batch the plan "
                       f"does not cover")
    return out


def _shapes(model: Any, *, name: str | None = None) -> tuple[ModelProfile, Any]:
    """(profile the planner plans, transformers config the engine builds): the same shapes."""
    if isinstance(model, str):
        from ...profiles import load_model_profile

        model = load_model_profile(model)
    if isinstance(model, ModelProfile):
        return model, model.to_hf_config()
    config = getattr(model, "config", model)
    return ModelProfile.from_hf_config(config, name=name), config


def _with_cxl(hw: HardwareProfile, cxl_mem: Any) -> HardwareProfile:
    """A CXL budget on a profile without a [cxl] table: an emulated node (no real one here)."""
    if cxl_mem and hw.cxl is None:
        return dataclasses.replace(hw, cxl=EMULATED_CXL)
    return hw


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _check_memory(plan: Plan, *, cuda: bool) -> None:
    """Refuse a run this machine's memory cannot hold (the gpu tier is host memory here)."""
    tiers = ("host", "cxl") if cuda else ("gpu", "host", "cxl")
    chunks = sum(sum(plan.bytes[t].values()) for t in ("gpu", "host", "cxl"))  # all start host-side
    need = max(sum(plan.peak[t] for t in tiers), chunks) + (0 if cuda else plan.peak["gpu"])
    avail = _available_memory()
    if avail is not None and need > 0.8 * avail:
        raise TierwiseError(f"--verify would need about {format_size(need)} of memory on this machine, "
                            f"{format_size(avail)} is available: verify a smaller model or on the target machine")


def _engine(model: torch.nn.Module, config: Any, *, plan: Plan, budgets: dict, nvme_path: str | None, lr: float, seed: int,
            cxl_bandwidth: float, optimizer_kwargs: dict | None, base_dtype: str | None = None,
            double_quant: bool = False) -> Any:
    from ..engine.engine import Engine
    from ..core.options import Activations, Budget, Optim, Precision

    try:
        # placed up front from the planned activations, as `finetune` runs (cli.train.make_engine)
        engine = Engine(model, budget=Budget(chunk=plan.chunk_bytes, gpu=budgets["gpu"], cpu=budgets["host"], cxl=budgets.get("cxl"), nvme=nvme_path, cxl_bandwidth=cxl_bandwidth),
                        optim=Optim(plan.optimizer, kwargs=optimizer_kwargs, lr=lr),
                        precision=Precision(plan.precision, base=base_dtype, double_quant=double_quant),
                        activations=Activations(expected=plan.reserve["gpu"]["activations"], recompute=plan.checkpointing))
    except ValueError as exc:
        if isinstance(exc, TierwiseError):
            raise
        raise TierwiseError(f"the engine cannot run with these options: {exc}") from None
    # a LoRA run's adapters keep PEFT's init (lora_B zeros), as training starts them
    engine.init_weights_(seed=seed, std=getattr(config, "initializer_range", 0.02),
                         frozen_only=plan.lora_rank is not None)
    return engine


def _batches(batches: Iterable[dict] | None, *, rows: int, seq_len: int, vocab: int,
             seed: int, padded: bool) -> Iterator[dict[str, torch.Tensor]]:
    if batches is not None:
        yield from batches
        raise TierwiseError("--verify ran out of batches")
    g = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randint(0, vocab, (rows, seq_len), generator=g)
        mask = torch.ones_like(x)
        if padded:  # the second half of the last row is padding, as in a short last block
            mask[-1, seq_len // 2:] = 0
        labels = x.masked_fill(mask == 0, -100)
        # (as finetune's batches: a mask only where there is padding; an all-ones one still makes
        # a sliding window's mask per row)
        yield {"input_ids": x, "labels": labels, **({"attention_mask": mask} if padded else {})}


@contextlib.contextmanager
def cuda_peak(budget: int) -> Iterator[dict]:
    """On CUDA: cap the caching allocator at `budget` beyond what is allocated now
    (set_per_process_memory_fraction), and give its peak allocated bytes beyond that in
    box["peak"]. Without CUDA box["peak"] stays None."""
    box: dict[str, int | None] = {"peak": None}
    if not torch.cuda.is_available():
        yield box
        return
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, (base + budget) / total))
    torch.cuda.reset_peak_memory_stats()
    try:
        yield box
    finally:
        torch.cuda.synchronize()
        box["peak"] = torch.cuda.max_memory_allocated() - base
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
