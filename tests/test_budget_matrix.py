"""The memory-budget matrix: model x gpu budget x optimizer x tier set x precision.

Every case trains a tiny Llama-family model for a few steps inside the engine -- placed up
front from the planner's activation estimate, as `finetune` runs it (a few cases of the other
mode, placement after a measuring warm-up step, run too) -- and asserts
  (a) the peak bytes of every tier stay within that tier's budget (the ledger's peaks, over
      the whole run; on CUDA also the caching allocator's `max_memory_allocated`, with
      `set_per_process_memory_fraction` making the device refuse anything past the budget);
  (b) the planner's predicted steady-state peak of every tier is within +-10% of the measured
      one (peaks are reset after the warm-up step, which records the access trace and streams
      through the smallest window -- without an activation estimate it also keeps every chunk
      host-side: `make_plan` predicts the steps after it, as in test_plan_vs_engine);
  (c) the losses equal those of the same model, data and optimizer without offloading, bit for
      bit (==): fp32 against the drop-in optimizer (torch `AdamW(fused=True)` for adamw, the
      `optim` classes for the others, with the engine's low-rank parameter groups), bf16 against
      the textbook mixed-precision loop (bf16 compute copy, fp32 master weights and gradients,
      the same drop-in optimizer on the masters) -- the engine runs exactly that arithmetic.
      On CUDA the engine computes on the device and updates streamed chunks on the CPU while
      the reference runs on the CPU: different kernels, so there a relative tolerance applies
      (CUDA_LOSS_RTOL).

The default selection is a pairwise covering design (20 cases: every pair of values of any two
axes appears in some case; `test_default_selection_covers_every_pair` checks it); the other
340 cases are marked `matrix_full` and run with `pytest -m matrix_full`.

Custom nn.Modules with a 0-dim, a non-contiguous or odd-sized parameters (tests/param_models.py)
run the same axes with checks (a) and (c) (`test_budget_matrix_custom_modules`: 3 default
cases, 285 more under `matrix_full`).

Two ranks: the budgeted cases of the shared 2-rank gloo launch
(tests/dist_cases.run_two_ranks) with checks (a) per rank and per node and (b) against
`make_plan(nproc_per_node=2)`; (c) is asserted on the same runs in tests/test_dist*.py.

Ordinary nn.Modules (tests/module_zoo.py: nn.TransformerEncoder, a head tied through F.linear,
BatchNorm, a weight shared across recomputed blocks, data fed straight into a block) form a
second matrix, module x gpu budget x tier set x optimizer: 5 default cases, 55 more under
`matrix_full`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools

import pytest
import torch
import transformers

from tierwise.offload import Engine, flat_options
from tierwise.offload.core.errors import InfeasibleBudget
from tierwise.offload.core.vocab import COMPUTE_DTYPES
from tierwise.offload.runtime.ledger import Ledger
from tierwise.offload.plan.planner import make_plan
from tierwise.offload.update.updaters import drop_in_groups
from tierwise.offload.tools.verify import cuda_peak
from tierwise.optim import eight_bit_groups, AdamW8bit, ApolloAdamW, GaLoreAdamW, MeZO
from tierwise.optim.mezo import direction, tensor_seed
from tierwise.profiles import ModelProfile, load_hardware_profile
from tierwise.profiles.hardware import CxlSpec
from tests import module_zoo as zoo

TOL = 0.10  # planned vs measured steady-state peak, relative to the measured
CUDA = torch.cuda.is_available()
CUDA_LOSS_RTOL = {"fp32": 1e-4, "bf16": 2e-2}
BATCH, SEQ, STEPS = 2, 16, 3  # 1 warm-up step + 2 steady-state steps
CHUNK = 16 << 10
HP = dict(lr=2e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
MEZO_EPS = 1e-3
OPT_KWARGS = {"galore": {"rank": 8, "update_proj_gap": 2}, "apollo": {"rank": 8, "update_proj_gap": 2},
              "mezo": {"eps": MEZO_EPS}}


def llama(name: str, *, h: int, i: int, layers: int, heads: int, kv: int, vocab: int,
          tie: bool = False) -> ModelProfile:
    return ModelProfile(name=name, family="llama", hidden_size=h, intermediate_size=i, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                        tie_word_embeddings=tie, max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-5)


MODELS = {
    "dense": llama("dense", h=64, i=176, layers=3, heads=4, kv=2, vocab=256),
    "tied": llama("tied", h=64, i=128, layers=2, heads=4, kv=2, vocab=256, tie=True),
    "vocab": llama("vocab", h=32, i=64, layers=1, heads=2, kv=1, vocab=4096),  # embedding + head dominate
}
BUDGETS = ("roomy", "mid", "min")
OPTIMIZERS = ("adamw", "adamw8bit", "galore", "apollo", "mezo")
TIER_SETS = ("host", "host+nvme", "cxl+nvme", "hostmin+nvme")
"""host: gpu + a roomy host; host+nvme: a host budget halfway between the planner's minimum with
NVMe and everything, so part spills to disk; cxl+nvme: the minimum host, an emulated CXL node
holding about half of what is left, the rest on NVMe; hostmin+nvme: the planner's minimum host
(`Plan.host_minimum`, homes.minimum_host), what DRAM cannot hold beside the bounce buffers on NVMe."""
PRECISIONS = COMPUTE_DTYPES
AXES = (tuple(MODELS), BUDGETS, OPTIMIZERS, TIER_SETS, PRECISIONS)


def case_id(case: tuple[str, ...]) -> str:
    return "-".join(case)


def pairwise_design() -> list[tuple[str, ...]]:
    """20 cases, one per (optimizer, tier set), the other axes by modular arithmetic: every pair
    of values of any two axes occurs at least once (checked by a test below)."""
    models, budgets, _, _, precs = AXES
    return [(models[(o + t) % 3], budgets[(o + 2 * t) % 3], opt, tiers, precs[(o + t) % 2])
            for o, opt in enumerate(OPTIMIZERS) for t, tiers in enumerate(TIER_SETS)]


DEFAULT = pairwise_design()
ALL = list(itertools.product(*AXES))
MATRIX = [pytest.param(*c, id=case_id(c)) if c in DEFAULT
          else pytest.param(*c, id=case_id(c), marks=pytest.mark.matrix_full) for c in ALL]


def test_default_selection_covers_every_pair():
    assert len(set(DEFAULT)) == len(DEFAULT) == 20 and len(ALL) == 360
    for (i, a), (j, b) in itertools.combinations(enumerate(AXES), 2):
        seen = {(c[i], c[j]) for c in DEFAULT}
        assert seen == set(itertools.product(a, b)), (i, j)


# -- budgets -----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def hardware(cxl: bool):
    """The planner's view of the device the engine runs on (cpu-sim without CUDA); with an
    (emulated) CXL node when the tier set has one."""
    hw = load_hardware_profile("h200" if CUDA else "cpu-sim")
    return dataclasses.replace(hw, cxl=CxlSpec(memory=1 << 40, bandwidth_gbps=20.0, latency_ns=300.0)) if cxl else hw


def plan(model: str, opt: str, prec: str, *, gpu: int, host: int, cxl: int = 0, nvme: bool = False,
         up_front: bool = True, checkpointing: bool | None = None):
    return make_plan(model=MODELS[model], hardware=hardware(bool(cxl)), gpu_mem=gpu, cpu_mem=host, cxl_mem=cxl,
                     nvme_path="/unused" if nvme else None, optimizer=opt, precision=prec, batch_size=BATCH,
                     seq_len=SEQ, chunk_bytes=CHUNK, optimizer_kwargs=OPT_KWARGS.get(opt), up_front=up_front,
                     checkpointing=checkpointing)


@functools.lru_cache(maxsize=None)
def budgets(model: str, budget: str, opt: str, tiers: str, prec: str, up_front: bool = True,
            checkpointing: bool | None = None) -> dict[str, int]:
    """{"gpu", "host", "cxl"} bytes of a case, derived from the planner's minimums."""
    roomy_host = 1 << 30
    plan = functools.partial(_plan, checkpointing=checkpointing)
    base = plan(model, opt, prec, gpu=1 << 30, host=roomy_host)
    chunks = sum(sum(base.bytes[t].values()) for t in base.bytes)
    gpu = {"roomy": 2 * (base.gpu_minimum + chunks), "mid": base.gpu_minimum + chunks // 2,
           "min": base.gpu_minimum}[budget]
    at = plan(model, opt, prec, gpu=gpu, host=roomy_host, up_front=up_front)
    everything = at.host_minimum  # without NVMe: every kind of the host-side chunks in DRAM
    grads = sum(at.bytes[t]["grad"] for t in ("host", "cxl", "nvme"))
    nvme = tiers.endswith("nvme")
    least = plan(model, opt, prec, gpu=gpu, host=roomy_host, nvme=True, up_front=up_front).host_minimum
    host, cxl = {"host": (2 * everything + (1 << 20), 0),
                 "host+nvme": (max(least, (least + everything) // 2), 0),
                 "cxl+nvme": (least, (everything - grads) // 2),
                 "hostmin+nvme": (least, 0)}[tiers]
    for _ in range(8):  # the planner names a larger budget where the engine would not fit
        try:
            plan(model, opt, prec, gpu=gpu, host=host, cxl=cxl, nvme=nvme, up_front=up_front)
            break
        except InfeasibleBudget as exc:
            assert set(exc.minimum) <= {"host", "cxl"}, exc
            host, cxl = exc.minimum.get("host", host), exc.minimum.get("cxl", cxl)
    return {"gpu": gpu, "host": host, "cxl": cxl}


_plan = plan


# -- references (plain PyTorch, no offloading), cached per (model, optimizer, precision) ------------
@functools.lru_cache(maxsize=None)
def _initial(model: str) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(MODELS[model].to_hf_config())


def fresh_model(model: str) -> transformers.LlamaForCausalLM:
    return copy.deepcopy(_initial(model))  # an engine takes its model over


def data(model: str) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    xs = [torch.randint(0, MODELS[model].vocab_size, (BATCH, SEQ), generator=g) for _ in range(STEPS)]
    return [{"input_ids": x, "labels": x.clone()} for x in xs]


def drop_in(opt: str, params_of: torch.nn.Module) -> torch.optim.Optimizer:
    """The drop-in optimizer the engine's chunk updater equals (see test_engine_optimizers)."""
    if opt == "adamw":
        return torch.optim.AdamW(params_of.parameters(), fused=True, **HP)
    if opt == "adamw8bit":
        return AdamW8bit(eight_bit_groups(params_of), **HP)  # (embeddings: fp32 moments)
    if opt == "galore":
        return GaLoreAdamW(drop_in_groups(params_of, **OPT_KWARGS["galore"]), **HP)
    if opt == "apollo":
        return ApolloAdamW(drop_in_groups(params_of, **OPT_KWARGS["apollo"]), **HP)
    raise ValueError(opt)


def reference_losses(model: str, opt: str, prec: str) -> list[float]:
    if opt == "mezo":
        return _mezo_reference(model, prec)
    master = fresh_model(model)
    optimizer = drop_in(opt, master)
    work = master
    if prec == "bf16":  # mixed precision: bf16 compute copy, fp32 masters and gradients
        work = copy.deepcopy(master)
        for p in work.parameters():  # parameters only: buffers (rotary frequencies) stay fp32
            p.data = p.data.to(torch.bfloat16)
    losses = []
    for b in data(model):
        loss = work(**b).loss
        loss.backward()
        if work is not master:
            for pm, pw in zip(master.parameters(), work.parameters()):
                pm.grad, pw.grad = pw.grad.float(), None
        optimizer.step()
        optimizer.zero_grad()
        if work is not master:
            with torch.no_grad():
                for pm, pw in zip(master.parameters(), work.parameters()):
                    pw.copy_(pm)
        losses.append(loss.float().item())
    return losses


def _mezo_reference(model: str, prec: str) -> list[float]:
    """fp32: the drop-in MeZO. bf16: MeZO on fp32 masters with the two losses computed on a bf16
    copy perturbed by +eps z and then -2 eps z (z drawn in fp32, rounded to bf16), the
    arithmetic the engine's dual forward runs; the update is the drop-in's on the masters."""
    master = fresh_model(model)
    lr, wd = HP["lr"], HP["weight_decay"]
    if prec == "fp32":
        opt = MeZO(master.parameters(), lr=lr, eps=MEZO_EPS, weight_decay=wd)
        return [float(opt.step(lambda b=b: master(**b).loss)) for b in data(model)]
    work = copy.deepcopy(master)
    for p in work.parameters():
        p.data = p.data.to(torch.bfloat16)
    losses = []
    with torch.no_grad():
        for step, b in enumerate(data(model), start=1):
            seed = tensor_seed(0, step)
            params = list(work.parameters())
            pristine = [p.data for p in params]
            zs = [direction(t, seed=seed, index=i + 1) for i, t in enumerate(pristine)]
            plus = [t.add(z, alpha=MEZO_EPS) for t, z in zip(pristine, zs)]
            for p, t in zip(params, plus):
                p.data = t
            loss_pos = float(work(**b).loss)
            for p, t, z in zip(params, plus, zs):
                p.data = t.add(z, alpha=-2.0 * MEZO_EPS)
            loss_neg = float(work(**b).loss)
            for p, t in zip(params, pristine):
                p.data = t
            g = (loss_pos - loss_neg) / (2.0 * MEZO_EPS)
            for i, p in enumerate(master.parameters()):
                z = direction(p, seed=seed, index=i + 1)
                for factor in (1.0, -2.0, 1.0):
                    p.add_(z, alpha=factor * MEZO_EPS)
                p.mul_(1.0 - lr * wd)
                p.add_(z, alpha=-lr * g)
            for pw, pm in zip(work.parameters(), master.parameters()):
                pw.copy_(pm)
            losses.append(loss_pos)
    return losses


@pytest.fixture(scope="module")
def references():
    """reference(model, optimizer, precision) -> losses, computed once per module."""
    return functools.lru_cache(maxsize=None)(reference_losses)


# -- one case ------------------------------------------------------------------------------------
cuda_budget = cuda_peak  # the same check as `finetune plan --verify` makes


def run_case(model: str, budget: str, opt: str, tiers: str, prec: str, *, tmp_path, reference,
             up_front: bool = True, checkpointing: bool | None = None) -> None:
    """The body of one matrix case (AssertionError when a check fails). `up_front`: the engine
    is given the planned activations and places chunks before the first step, as `finetune`
    does; else it measures them in the warm-up step and places chunks after it.
    `checkpointing` goes to both the planner and the engine (None: their default)."""
    b = budgets(model, budget, opt, tiers, prec, up_front, checkpointing)
    nvme = tiers.endswith("nvme")
    planned = plan(model, opt, prec, gpu=b["gpu"], host=b["host"], cxl=b["cxl"], nvme=nvme, up_front=up_front,
                   checkpointing=checkpointing)
    activations = planned.reserve["gpu"]["activations"] if up_front else None
    eng = Engine(fresh_model(model), **flat_options(optimizer=opt, optimizer_kwargs=OPT_KWARGS.get(opt), precision=prec,
                 chunk_bytes=CHUNK, gpu_mem=b["gpu"], cpu_mem=b["host"], cxl_mem=b["cxl"] or None,
                 nvme_path=str(tmp_path / "swap") if nvme else None, activations=activations,
                 checkpointing=checkpointing, **HP))
    where = f"{case_id((model, budget, opt, tiers, prec))} checkpointing {checkpointing} budgets {b}"
    try:
        batches = data(model)
        with cuda_budget(b["gpu"]) as device:
            losses = [eng.step(batches[0])]
            warmup_peaks = eng.ledger.peaks()
            eng.ledger.reset_peaks()  # steady state from here: what the planner predicts
            losses += [eng.step(x) for x in batches[1:]]
        peaks = eng.ledger.peaks()
        grad_at_peak = eng.ledger.peak_breakdown()["gpu"].get("grad", 0)
        budgets_ = eng.ledger.budgets
    finally:
        eng.close()
    # (a) within budget, warm-up included
    for tier, limit in budgets_.items():
        if limit is not None:
            assert max(warmup_peaks[tier], peaks[tier]) <= limit, (where, tier, warmup_peaks, peaks)
    if device["peak"] is not None:
        assert device["peak"] <= b["gpu"], (where, "cuda max_memory_allocated", device["peak"])
    # (b) planned within +-10% of measured, every tier (a tier the run lacks measures 0)
    for tier in ("gpu", "host", "cxl", "nvme"):
        measured, predicted = peaks.get(tier, 0), planned.peak[tier]
        if tier == "gpu" and not CUDA:  # the simulated device's copy thread drains gradients as they
            # come; on a loaded machine it lags: gradients in flight beyond the plan's are timing
            lag = max(0, grad_at_peak - planned.reserve["gpu"].get("grad in flight", 0))
            measured = max(measured - lag, min(measured, predicted))
        assert abs(predicted - measured) <= TOL * measured, \
            f"{where}: {tier} planned {predicted} B vs measured {measured} B (peaks {peaks}, plan {planned.peak})"
    # (c) the same losses as without offloading
    ref = reference(model, opt, prec)
    if CUDA:
        assert losses == pytest.approx(ref, rel=CUDA_LOSS_RTOL[prec]), where
    else:
        assert losses == ref, where


@pytest.mark.parametrize("model, budget, opt, tiers, prec", MATRIX)
def test_budget_matrix(model, budget, opt, tiers, prec, tmp_path, references):
    run_case(model, budget, opt, tiers, prec, tmp_path=tmp_path, reference=references)


WARMUP_CASES = [("dense", "mid", "adamw", "hostmin+nvme", "fp32"), ("tied", "mid", "galore", "cxl+nvme", "bf16"),
                 ("vocab", "min", "adamw8bit", "host+nvme", "bf16"), ("dense", "min", "mezo", "cxl+nvme", "fp32")]


@pytest.mark.parametrize("case", WARMUP_CASES, ids=[case_id(c) + "-warmup" for c in WARMUP_CASES])
def test_budget_matrix_placed_after_warmup(case, tmp_path, references):
    """The engine's other placement mode (no activation estimate: every chunk host-side until
    the warm-up step has measured them) against `make_plan(up_front=False)`."""
    run_case(*case, tmp_path=tmp_path, reference=references, up_front=False)


NO_RECOMPUTE_CASES = [("dense", "min", "adamw", "host+nvme", "fp32"), ("dense", "mid", "adamw8bit", "hostmin+nvme", "bf16"),
                      ("tied", "min", "galore", "cxl+nvme", "bf16"), ("tied", "roomy", "apollo", "host", "fp32")]


@pytest.mark.parametrize("case", NO_RECOMPUTE_CASES, ids=[case_id(c) + "-norecompute" for c in NO_RECOMPUTE_CASES])
def test_budget_matrix_without_recompute(case, tmp_path, references):
    """checkpointing=False (`finetune --no-recompute`): every layer's activations stay saved;
    the planner's activation formula and minimum must follow, at the smallest budget too."""
    run_case(*case, tmp_path=tmp_path, reference=references, checkpointing=False)


def test_matrix_catches_an_under_counting_ledger(tmp_path, monkeypatch, references):
    """A ledger that books only half of every optimizer state (consistently, so it never trips
    over its own release) must make a matrix case fail: the checks are not vacuous."""
    case = ("dense", "min", "adamw", "host", "fp32")  # every chunk streamed: state is half the host bytes
    reserve, release = Ledger.reserve, Ledger.release

    def half(fn):
        return lambda self, tier, kind, nbytes: fn(self, tier, kind, nbytes // 2 if kind == "state" else nbytes)

    monkeypatch.setattr(Ledger, "reserve", half(reserve))
    monkeypatch.setattr(Ledger, "release", half(release))
    with pytest.raises(AssertionError, match="host planned"):
        run_case(*case, tmp_path=tmp_path, reference=references)


# -- custom nn.Modules: 0-dim, non-contiguous and odd-sized parameters ---------------------------
# tests/param_models.py's Zoo with one kind of unusual parameter. No planner profile describes an
# arbitrary nn.Module, so budgets derive from the engine's own measured minimum (a probe run) and
# its chunk kinds, and the checks are (a) and (c): within every budget, losses (==) and final
# weights (torch.equal) equal to the drop-in optimizer's (fp32) or the mixed-precision loop's (bf16).
PARAM_KINDS = ("scalar", "strided", "odd")
PARAM_OPTIMIZERS = ("adamw", "adamw8bit", "galore", "apollo")
PARAM_CHUNK = 4 << 10
PARAM_AXES = (PARAM_KINDS, BUDGETS, PARAM_OPTIMIZERS, TIER_SETS, PRECISIONS)
PARAM_DEFAULT = [("scalar", "min", "galore", "hostmin+nvme", "fp32"), ("strided", "mid", "adamw8bit", "cxl+nvme", "fp32"),
                  ("odd", "roomy", "adamw", "host+nvme", "fp32")]
PARAM_MATRIX = [pytest.param(*c, id=case_id(c)) if c in PARAM_DEFAULT
                 else pytest.param(*c, id=case_id(c), marks=pytest.mark.matrix_full)
                 for c in itertools.product(*PARAM_AXES)]


def param_engine(kind: str, opt: str, prec: str, **budgets) -> Engine:
    from tests.param_models import Zoo, zoo_loss

    return Engine(Zoo((kind,)), **flat_options(loss_fn=zoo_loss, optimizer=opt, optimizer_kwargs=OPT_KWARGS.get(opt), precision=prec,
                  chunk_bytes=PARAM_CHUNK, **budgets, **HP))


@functools.lru_cache(maxsize=None)
def param_probe(kind: str, opt: str, prec: str) -> tuple[int, dict]:
    """(measured minimum gpu bytes, chunk kinds) of an unbudgeted engine after its warm-up."""
    from tests.param_models import zoo_data

    eng = param_engine(kind, opt, prec)
    try:
        eng.step(zoo_data(1, batch=BATCH)[0])
        return eng.minimum_gpu_bytes, eng.kinds
    finally:
        eng.close()


def module_budgets(kind: str, budget: str, opt: str, tiers: str, prec: str, nvme_dir) -> dict:
    from tierwise.offload.plan.homes import minimum_host

    minimum, kinds = param_probe(kind, opt, prec)
    everything = sum(sum(k.values()) for k in kinds.values())
    gpu = {"roomy": 2 * (minimum + everything), "mid": minimum + everything // 2, "min": minimum}[budget]
    grads = sum(k.get("grad", 0) for k in kinds.values())
    least = minimum_host(kinds, cxl=None, nvme=True)
    host, cxl = {"host": (2 * everything + (1 << 20), 0), "host+nvme": (max(least, (least + everything) // 2), 0),
                 "cxl+nvme": (least, (everything - grads) // 2), "hostmin+nvme": (least, 0)}[tiers]
    nvme = str(nvme_dir) if tiers.endswith("nvme") else None
    for _ in range(8):  # the engine names a larger host (or cxl) budget where it would not fit
        try:
            param_engine(kind, opt, prec, gpu_mem=gpu, cpu_mem=host, cxl_mem=cxl or None, nvme_path=nvme).close()
            break
        except InfeasibleBudget as exc:
            assert set(exc.minimum) <= {"host", "cxl"}, exc
            host, cxl = exc.minimum.get("host", host), exc.minimum.get("cxl", cxl)
    return dict(gpu_mem=gpu, cpu_mem=host, cxl_mem=cxl or None, nvme_path=nvme)


@functools.lru_cache(maxsize=None)
def param_reference(kind: str, opt: str, prec: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """(losses, final fp32 weights) without offloading."""
    from tests.param_models import Zoo, train_zoo_reference, zoo_data

    losses, model = train_zoo_reference(Zoo((kind,)), zoo_data(STEPS, batch=BATCH),
                                        make_opt=functools.partial(drop_in, opt), precision=prec)
    return losses, {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind, budget, opt, tiers, prec", PARAM_MATRIX)
def test_budget_matrix_custom_modules(kind, budget, opt, tiers, prec, tmp_path):
    from tests.param_models import zoo_data

    b = module_budgets(kind, budget, opt, tiers, prec, tmp_path / "swap")
    where = f"{case_id((kind, budget, opt, tiers, prec))} budgets {b}"
    eng = param_engine(kind, opt, prec, **b)
    try:
        with cuda_budget(b["gpu_mem"]) as device:
            losses = [eng.step(x) for x in zoo_data(STEPS, batch=BATCH)]
        peaks, limits = eng.ledger.peaks(), eng.ledger.budgets
        weights = dict(eng.named_parameters_fp32())
    finally:
        eng.close()
    for tier, limit in limits.items():
        if limit is not None:
            assert peaks[tier] <= limit, (where, tier, peaks)
    if device["peak"] is not None:
        assert device["peak"] <= b["gpu_mem"], (where, "cuda max_memory_allocated", device["peak"])
    ref, ref_weights = param_reference(kind, opt, prec)
    if CUDA:
        assert losses == pytest.approx(ref, rel=CUDA_LOSS_RTOL[prec]), where
    else:
        assert losses == ref, where
        for n, w in ref_weights.items():
            assert torch.equal(weights[n], w), (where, n)


# -- ordinary nn.Modules (tests/module_zoo.py) ----------------------------------------------------
MODULE_KINDS = tuple(zoo.BUILDERS)
MODULE_BUDGETS = ("roomy", "mid", "min")
MODULE_TIERS = ("host", "hostmin+nvme")
MODULE_OPTIMIZERS = ("adamw", "adamw8bit")
MODULE_DEFAULT = [("encoder", "min", "hostmin+nvme", "adamw"), ("tied", "mid", "host", "adamw8bit"),
                  ("batchnorm", "min", "host", "adamw"), ("shared", "roomy", "hostmin+nvme", "adamw8bit"),
                  ("datafed", "mid", "hostmin+nvme", "adamw")]
MODULE_MATRIX = [pytest.param(*c, id="module-" + case_id(c),
                              marks=() if c in MODULE_DEFAULT else pytest.mark.matrix_full)
                 for c in itertools.product(MODULE_KINDS, MODULE_BUDGETS, MODULE_TIERS, MODULE_OPTIMIZERS)]
MODULE_CHUNK = 4 << 10  # several chunks even for these tiny models


def module_engine(kind: str, opt: str, **kw) -> Engine:
    return Engine(zoo.build(kind), **flat_options(optimizer=opt, chunk_bytes=MODULE_CHUNK, loss_fn=zoo.lm_loss, **HP, **kw))


@functools.lru_cache(maxsize=None)
def module_minimum(kind: str, opt: str) -> tuple[int, int]:
    """(the engine's measured minimum device budget, all chunk bytes) of a module."""
    eng = module_engine(kind, opt)
    try:
        torch.manual_seed(2)
        eng.step(zoo.data(1, batch=BATCH)[0])
        return eng.minimum_gpu_bytes, sum(sum(k.values()) for k in eng.kinds.values())
    finally:
        eng.close()


@functools.lru_cache(maxsize=None)
def module_reference(kind: str, opt: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and final buffers (BatchNorm's running statistics) of plain PyTorch."""
    model = zoo.build(kind)
    optimizer = drop_in(opt, model)
    torch.manual_seed(2)  # dropout, as the engine run seeds it
    losses = []
    for b in zoo.data(STEPS, batch=BATCH):
        loss = zoo.lm_loss(model, b)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, dict(model.named_buffers())


@pytest.mark.parametrize("kind, budget, tiers, opt", MODULE_MATRIX)
def test_module_budget_matrix(kind, budget, tiers, opt, tmp_path):
    """Modules that read parameters outside their owner's forward, update buffers in forward,
    share weights across recomputed blocks or feed data straight into a block: (a) and (c) as
    above (and the final buffers equal), at budgets from the engine's own measured minimum. (b) does not apply: the planner
    predicts for the model families of `profiles`, not for arbitrary modules."""
    minimum, chunks = module_minimum(kind, opt)
    gpu = {"roomy": 2 * (minimum + chunks), "mid": minimum + chunks // 2, "min": minimum}[budget]
    kw: dict = {}
    if tiers == "hostmin+nvme":
        kw["nvme_path"] = str(tmp_path / "swap")
        with pytest.raises(InfeasibleBudget) as exc:
            module_engine(kind, opt, gpu_mem=gpu, cpu_mem=1, **kw)
        kw["cpu_mem"] = exc.value.minimum["host"]
    eng = module_engine(kind, opt, gpu_mem=gpu, **kw)
    try:
        torch.manual_seed(2)
        losses = [eng.step(b) for b in zoo.data(STEPS, batch=BATCH)]
        peaks, budgets_ = eng.ledger.peaks(), eng.ledger.budgets
        buffers = {n: b.cpu() for n, b in eng.model.named_buffers()}
    finally:
        eng.close()
    for tier, limit in budgets_.items():
        assert limit is None or peaks[tier] <= limit, (tier, peaks)
    ref_losses, ref_buffers = module_reference(kind, opt)
    if CUDA:
        assert losses == pytest.approx(ref_losses, rel=CUDA_LOSS_RTOL["fp32"])
    else:
        assert losses == ref_losses
        assert all(torch.equal(buffers[n], b) for n, b in ref_buffers.items()), kind


# -- LoRA / QLoRA over a streamed frozen base -----------------------------------------------------
# The same checks (a), (b), (c) for LoRA runs: adapters (rank 4) trained over a frozen base stored
# as `base` (None: the compute dtype; nf4 double-quantized), placed by the planner (`make_plan(
# lora_rank=...)`) and run by the engine (`Engine(lora=LoraConfig(...), base_dtype=...)`). The
# reference is PEFT (`get_peft_model`) in plain PyTorch on the base weights as the engine stores
# them (decoded by runtime.codecs, whose bytes tests/test_codecs.py checks against bitsandbytes):
# fp32 with torch's fused AdamW on the adapters, bf16 the mixed-precision loop on them.
LORA_RANK = 4
LORA_CASES = [("dense", "min", "hostmin+nvme", "fp32", "nf4", "all-linear"),
              ("tied", "mid", "host+nvme", "bf16", "nf4", "all-linear"),
              ("dense", "roomy", "host", "fp32", None, "q_proj,v_proj"),
              ("vocab", "min", "cxl+nvme", "fp32", "int8", "all-linear"),
              ("tied", "min", "host", "bf16", "bf16", "q_proj,v_proj"),
              ("dense", "mid", "hostmin+nvme", "bf16", None, "all-linear")]


def lora_config(targets: str):
    import peft

    return peft.LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0,
                           target_modules=targets if targets == "all-linear" else targets.split(","))


def lora_plan(model: str, prec: str, base: str | None, targets: str, *, gpu: int, host: int, cxl: int = 0,
              nvme: bool = False):
    return make_plan(model=MODELS[model], hardware=hardware(bool(cxl)), gpu_mem=gpu, cpu_mem=host, cxl_mem=cxl,
                     nvme_path="/unused" if nvme else None, optimizer="adamw", precision=prec, batch_size=BATCH,
                     seq_len=SEQ, chunk_bytes=CHUNK, lora_rank=LORA_RANK, lora_targets=targets, base_dtype=base,
                     double_quant=base == "nf4", suggest=False)


def lora_budgets(model: str, budget: str, tiers: str, prec: str, base: str | None, targets: str) -> dict[str, int]:
    """As `budgets`, for a LoRA run."""
    plan = functools.partial(lora_plan, model, prec, base, targets)
    first = plan(gpu=1 << 30, host=1 << 30)
    chunks = sum(sum(first.bytes[t].values()) for t in first.bytes)
    gpu = {"roomy": 2 * (first.gpu_minimum + chunks), "mid": first.gpu_minimum + chunks // 2,
           "min": first.gpu_minimum}[budget]
    at = plan(gpu=gpu, host=1 << 30)
    everything = at.host_minimum
    grads = sum(at.bytes[t]["grad"] for t in ("host", "cxl", "nvme"))
    least = plan(gpu=gpu, host=1 << 30, nvme=True).host_minimum
    host, cxl = {"host": (2 * everything + (1 << 20), 0), "host+nvme": (max(least, (least + everything) // 2), 0),
                 "cxl+nvme": (least, (everything - grads) // 2), "hostmin+nvme": (least, 0)}[tiers]
    for _ in range(8):
        try:
            plan(gpu=gpu, host=host, cxl=cxl, nvme=tiers.endswith("nvme"))
            break
        except InfeasibleBudget as exc:
            assert set(exc.minimum) <= {"host", "cxl"}, exc
            host, cxl = exc.minimum.get("host", host), exc.minimum.get("cxl", cxl)
    return {"gpu": gpu, "host": host, "cxl": cxl}


def stored_base(model: torch.nn.Module, base: str | None, dtype: torch.dtype) -> torch.nn.Module:
    """`model` (a copy) with its frozen weights as the engine stores and decodes them."""
    from tierwise.offload.engine.frozen_base import quantizable
    from tierwise.offload.runtime import codecs
    from tierwise.offload.runtime.frozen import base_dtypes

    model = copy.deepcopy(model)
    named = dict(model.named_parameters())
    kinds = base_dtypes(list(named), base_dtype=base, quantizable=quantizable(model), compute_dtype=dtype)
    with torch.no_grad():
        for n, p in named.items():
            out = torch.empty(p.numel(), dtype=dtype)
            codecs.decode(kinds[n], codecs.encode(kinds[n], p.reshape(-1), double_quant=base == "nf4"), out,
                          double_quant=base == "nf4")
            p.data = out.view(p.shape)
    return model


@functools.lru_cache(maxsize=None)
def lora_reference(model: str, prec: str, base: str | None, targets: str) -> list[float]:
    import peft

    dtype = torch.bfloat16 if prec == "bf16" else torch.float32
    start = fresh_model(model)
    torch.manual_seed(7)  # LoRA's init, as before the engine's
    work = peft.get_peft_model(start, lora_config(targets))
    adapters = [p for p in work.parameters() if p.requires_grad]
    masters = [p.detach().clone() for p in adapters]
    work.base_model.model = stored_base(work.base_model.model, base, dtype)  # adapters' values kept
    adapters = [p for p in work.parameters() if p.requires_grad]
    for p in work.parameters():
        if p.requires_grad:
            p.data = p.data.to(dtype)
    masters = [torch.nn.Parameter(m) for m in masters]
    opt = torch.optim.AdamW(masters, fused=True, **HP)
    losses = []
    for b in data(model):
        loss = work(**b).loss
        loss.backward()
        for pm, pw in zip(masters, adapters):
            pm.grad, pw.grad = pw.grad.float(), None
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for pm, pw in zip(masters, adapters):
                pw.copy_(pm)
        losses.append(loss.float().item())
    return losses


@pytest.mark.parametrize("case", LORA_CASES, ids=["lora-" + case_id(tuple(map(str, c))) for c in LORA_CASES])
def test_budget_matrix_lora(case, tmp_path):
    model, budget, tiers, prec, base, targets = case
    b = lora_budgets(*case)
    nvme = tiers.endswith("nvme")
    planned = lora_plan(model, prec, base, targets, gpu=b["gpu"], host=b["host"], cxl=b["cxl"], nvme=nvme)
    start = fresh_model(model)
    torch.manual_seed(7)  # LoRA's init draws random numbers: as the reference's
    eng = Engine(start, **flat_options(lora=lora_config(targets), base_dtype=base, double_quant=base == "nf4",
                 precision=prec, chunk_bytes=CHUNK, gpu_mem=b["gpu"], cpu_mem=b["host"], cxl_mem=b["cxl"] or None,
                 nvme_path=str(tmp_path / "swap") if nvme else None,
                 activations=planned.reserve["gpu"]["activations"], **HP))
    where = f"lora-{case_id(tuple(map(str, case)))} budgets {b}"
    try:
        batches = data(model)
        with cuda_budget(b["gpu"]) as device:
            losses = [eng.step(batches[0])]
            warmup_peaks = eng.ledger.peaks()
            eng.ledger.reset_peaks()
            losses += [eng.step(x) for x in batches[1:]]
        peaks, limits = eng.ledger.peaks(), eng.ledger.budgets
    finally:
        eng.close()
    for tier, limit in limits.items():  # (a)
        if limit is not None:
            assert max(warmup_peaks[tier], peaks[tier]) <= limit, (where, tier, warmup_peaks, peaks)
    if device["peak"] is not None:
        assert device["peak"] <= b["gpu"], (where, "cuda max_memory_allocated", device["peak"])
    for tier in ("gpu", "host", "cxl", "nvme"):  # (b)
        measured, predicted = peaks.get(tier, 0), planned.peak[tier]
        assert abs(predicted - measured) <= TOL * measured, \
            f"{where}: {tier} planned {predicted} B vs measured {measured} B (peaks {peaks}, plan {planned.peak})"
    ref = lora_reference(model, prec, base, targets)  # (c)
    if CUDA:
        assert losses == pytest.approx(ref, rel=CUDA_LOSS_RTOL[prec]), where
    else:
        assert losses == ref, where


@pytest.mark.parametrize("base", ["nf4", None])
def test_lora_base_traffic_matches_plan(base, tmp_path):
    """Over a steady step, the frozen base is never written to NVMe and the bytes read from it
    are the planner's `base_read["nvme"]` within 10%: adapters on the device (whole), the
    base on NVMe behind the smallest stream cache, so it crosses twice per step (forward, and
    backward with each recomputed block's recompute), less what the cache keeps across the turn."""
    model, prec, targets = "dense", "fp32", "all-linear"
    first = lora_plan(model, prec, base, targets, gpu=1 << 30, host=1 << 30)
    adapters = sum(sum(first.bytes["gpu"][k] for k in ("compute", "grad", "master", "state")) for _ in [0])
    gpu = first.gpu_minimum + adapters
    host = lora_plan(model, prec, base, targets, gpu=gpu, host=1 << 30, nvme=True).host_minimum
    planned = lora_plan(model, prec, base, targets, gpu=gpu, host=host, nvme=True)
    assert planned.bytes["nvme"]["base"] and sum(planned.bytes["nvme"].values()) == planned.bytes["nvme"]["base"]
    assert planned.base_written == 0
    start = fresh_model(model)
    torch.manual_seed(7)
    eng = Engine(start, **flat_options(lora=lora_config(targets), base_dtype=base, double_quant=base == "nf4", precision=prec,
                 chunk_bytes=CHUNK, gpu_mem=gpu, cpu_mem=host, nvme_path=str(tmp_path / "swap"),
                 activations=planned.reserve["gpu"]["activations"], **HP))
    try:
        batches = data(model)
        eng.step(batches[0])  # the warm-up records the trace
        eng.step(batches[1])  # the first scheduled step starts from an empty cache (not steady)
        written: list[str] = []
        for name in ("write_async", "zeros"):
            orig = getattr(eng.nvme, name)
            setattr(eng.nvme, name, lambda key, *a, _o=orig, **k: (written.append(key), _o(key, *a, **k))[1])
        eng.executor.drain()  # a step's end starts the next one's first fetches: counted with it
        read0, wrote0 = eng.nvme.stats.bytes_read, eng.nvme.stats.bytes_written
        eng.step(batches[2])
        eng.executor.drain()
        read, wrote = eng.nvme.stats.bytes_read - read0, eng.nvme.stats.bytes_written - wrote0
        on_nvme = sum(eng.store.chunks[c].compute.nbytes for c in eng.plan.frozen
                      if eng.store.chunks[c].tiers["compute"] == "nvme")
    finally:
        eng.close()
    assert on_nvme == planned.bytes["nvme"]["base"]
    assert not written and wrote == 0, written  # the adapters live on the device: nothing is written at all
    assert read > on_nvme  # some chunks cross twice
    assert abs(planned.base_read["nvme"] - read) <= TOL * read, (planned.base_read, read, on_nvme)


@pytest.mark.parametrize("base", ["nf4", "int8"])
def test_lora_partial_gpu_home_base_traffic_matches_plan(base):
    """A gpu budget that holds the adapters and about half the encoded base: the planner and the
    engine keep the same base bytes on the device (encoded), and the bytes the link carries over a
    steady step are the planner's `base_read["host"]` within 10% (a gpu-home chunk reads none)."""
    model, prec, targets = "dense", "fp32", "all-linear"
    roomy = lora_plan(model, prec, base, targets, gpu=1 << 30, host=1 << 30)
    assert roomy.base_read["host"] == 0 and roomy.bytes["gpu"]["base"] > 0 and roomy.bytes["host"]["base"] == 0
    assert roomy.base_decoded  # (room for the base decoded: decoded once, booked at that size)
    adapters = sum(roomy.bytes["gpu"][k] for k in ("compute", "grad", "master", "state"))
    streamed = lora_plan(model, prec, base, targets, gpu=roomy.gpu_minimum + adapters, host=1 << 30)
    encoded = sum(streamed.bytes[t]["base"] for t in ("gpu", "host"))  # the base's encoded bytes
    gpu = roomy.gpu_minimum + adapters + encoded // 2
    planned = lora_plan(model, prec, base, targets, gpu=gpu, host=1 << 30)
    assert not planned.base_decoded
    assert 0 < planned.bytes["gpu"]["base"] < encoded and planned.base_read["host"] > 0
    torch.manual_seed(7)
    eng = Engine(fresh_model(model), **flat_options(lora=lora_config(targets), base_dtype=base, double_quant=base == "nf4",
                 precision=prec, chunk_bytes=CHUNK, gpu_mem=gpu, cpu_mem=1 << 30,
                 activations=planned.reserve["gpu"]["activations"], **HP))
    try:
        batches = data(model)
        eng.step(batches[0])  # the warm-up records the trace
        eng.step(batches[1])  # the first scheduled step starts from an empty cache (not steady)
        link = eng.executor.lanes["h2d"].link
        eng.executor.drain()  # a step's end starts the next one's first fetches: counted with it
        before = link.bytes_moved
        eng.step(batches[2])
        eng.executor.drain()
        read = link.bytes_moved - before
        home = sum(eng.store.chunks[c].compute.nbytes for c in eng.plan.frozen
                   if eng.store.chunks[c].tiers["compute"] == "gpu")
    finally:
        eng.close()
    assert home == planned.bytes["gpu"]["base"]
    assert abs(planned.base_read["host"] - read) <= TOL * read, (planned.base_read, read, home)


@pytest.mark.parametrize("base", ["nf4", "int8"])
def test_lora_base_decoded_once_matches_plan(base):
    """A gpu budget that holds every chunk with the base decoded: planner and engine decode it once
    (the engine after its warm-up) and keep it so, the same bytes on the device; a steady step
    decodes nothing and the link carries nothing, as the plan says (no decoding time)."""
    model, prec, targets = "dense", "fp32", "all-linear"
    planned = lora_plan(model, prec, base, targets, gpu=1 << 30, host=1 << 30)
    assert planned.base_decoded and planned.dequant_s == 0 and planned.base_read["host"] == 0
    torch.manual_seed(7)
    eng = Engine(fresh_model(model), **flat_options(lora=lora_config(targets), base_dtype=base, double_quant=base == "nf4",
                 precision=prec, chunk_bytes=CHUNK, gpu_mem=1 << 30, cpu_mem=1 << 30, **HP))
    try:
        batches = data(model)
        eng.step(batches[0])
        decodes, moved = eng.cache.decodes, eng.executor.lanes["h2d"].link.bytes_moved
        eng.step(batches[1])
        eng.executor.drain()
        assert eng.cache.decodes == decodes and eng.executor.lanes["h2d"].link.bytes_moved == moved
        home = sum(eng.store.chunks[c].compute.nbytes for c in eng.plan.frozen
                   if eng.store.chunks[c].tiers["compute"] == "gpu")
        assert all(not eng.store.is_encoded(c) for c in eng.plan.frozen)
    finally:
        eng.close()
    assert home == planned.bytes["gpu"]["base"]


# -- two ranks -----------------------------------------------------------------
# The cases with budgets of the shared 2-rank gloo launch (tests/dist_cases.run_two_ranks):
# full fine-tunes with master, state and gradients on NVMe at the smallest device budget, two
# micro-batches per rank with the owners' gradients on NVMe, AdamW8bit at the smallest device
# budget, and LoRA with the shared base split between host memory and NVMe. Check (c), the
# results against one rank and DDP, is asserted on these same runs in tests/test_dist.py and
# tests/test_dist_lora.py.
TWO_RANK_CASES = ("tight_nvme", "nvme_accum", "adamw8bit", "shared_nvme")


@pytest.mark.parametrize("name", TWO_RANK_CASES)
def test_budget_matrix_two_ranks(two_ranks, name):
    """(a) on every rank, every tier's ledger peak within that rank's budget, and the node's (the
    two ranks' sum) within the node's (twice a rank's: the CLI divides --cpu-mem among local
    ranks); a budget the run came close to (it binds)."""
    got = two_ranks[name]
    limited = {t: b for t, b in got["budgets"].items() if b is not None}
    assert "gpu" in limited or "host" in limited
    for tier, budget in limited.items():
        peaks = got["tier_peaks"][tier]
        assert len(peaks) == 2 and all(p <= budget for p in peaks), (tier, peaks, budget)
        assert sum(peaks) <= 2 * budget
    assert max(max(got["tier_peaks"][t]) / b for t, b in limited.items() if b) >= 0.5


@pytest.mark.parametrize("name", ["roomy", "tight_nvme", "nvme_accum"])
def test_budget_matrix_two_ranks_planned(two_ranks, name):
    """(b) with two ranks: `make_plan(nproc_per_node=2)` for the same model, budgets (the node's:
    twice a rank's) and micro-batches against the ranks' ledger peaks: each rank's host bytes, the
    node's NVMe bytes and a rank's device peak within 10%."""
    from tests.dist_cases import CHUNK as DIST_CHUNK, TINY as DIST_TINY, case as dist_case

    from tierwise.offload.engine.model_info import model_specs
    from tierwise.offload.core.sizes import parse_size
    from tests.models import tiny_llama

    got, spec = two_ranks[name], {"roomy": dist_case(), "tight_nvme": dist_case(cpu_mem="104K", nvme=True),
                                  "nvme_accum": dist_case(grad_accum=2, cpu_mem="104K", nvme=True)}[name]
    gpu = two_ranks["tight"] if name == "tight_nvme" else None
    cpu = spec["engine"].get("cpu_mem")
    model = tiny_llama(**DIST_TINY)
    plan = make_plan(model=model.config, hardware="cpu-sim", gpu_mem=gpu,
                     cpu_mem=None if cpu is None else 2 * parse_size(cpu),
                     nvme_path="/nvme" if spec["engine"].get("nvme") else None, optimizer="adamw",
                     precision="fp32", batch_size=2, seq_len=12, grad_accum=spec["grad_accum"],
                     chunk_bytes=DIST_CHUNK, params=model_specs(model), nproc_per_node=2,
                     suggest=False)
    peaks = got["tier_peaks"]
    for planned, measured in zip(plan.ranks.private_host, peaks["host"]):
        assert abs(planned - measured) <= TOL * measured, (plan.ranks.private_host, peaks["host"])
    assert abs(plan.peak["nvme"] - sum(peaks["nvme"])) <= TOL * max(sum(peaks["nvme"]), 1)
    assert abs(plan.peak["gpu"] - max(peaks["gpu"])) <= TOL * max(peaks["gpu"])
