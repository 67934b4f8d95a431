"""End to end against DeepSpeed ZeRO-3 with NVMe offload of parameters and optimizer state.

The same Llama (the `100m` profile: hidden 640, 12 layers, 10 heads, intermediate 1792,
vocab 32000, untied; 101.9M parameters), the same seed, the same synthetic token batches,
batch 4 x seq 128, fp32, AdamW (lr 1e-4, betas 0.9/0.999, eps 1e-8, weight decay 0), trained
  ours  tierwise: tierwise.offload.Engine(model, budget=Budget(gpu=<small>, cpu=<tight>, nvme=<dir>),
        optim=Optim("adamw", lr=1e-4), activations=Activations(recompute=False)); like DeepSpeed here, it keeps
        every layer's activations (--recompute: ours with activation checkpointing, which
        needs a smaller device budget but computes each layer's forward twice)
  ds    DeepSpeed ZeRO-3, offload_param and offload_optimizer to NVMe, configured as in
        shared/PEERS.md (zero.Init without dtype, sub_group_size 1, max_in_cpu 0,
        stage3_max_reuse_distance 0, stage3_prefetch_bucket_size 0, aio intra_op_parallelism)
Each run is its own process; runs alternate (ours, ds, plain, ours, ds, plain, ...) so
machine drift hits all alike. Per run: 2 warm-up steps, then --steps timed steps. Printed:
median step time of each and the ratios ours / DeepSpeed (goal <= 0.40 with --cpu-mem 1300M,
<= 0.50 at the minimum host budget) and ours / plain (goals <= 1.10 and <= 1.30), median
over median with the per-round ratios, peak RSS (ru_maxrss of the child, from wait4), disk
bytes written / read per timed step (/proc/self/io of the child: write_bytes, read_bytes; for
ours also NvmeStore's own count), and whether the losses agree (first step exactly; later steps
within 1e-5 relative), ours vs DeepSpeed and each vs plain PyTorch + torch AdamW without
offload (the reference, run every round; --no-reference skips it).
Budgets of ours: --gpu-mem / --cpu-mem, 'min' by default: a probe process (warm-up steps
only) finds the engine's minimums first, so the timed runs hold no refused attempt. With
NVMe the host minimum is the gradients plus bounce buffers: weights and optimizer state live
on NVMe, as DeepSpeed's do here. It benchmarks the installed tierwise;
PYTHONPATH=<a checkout>/tests/devtree benchmarks that checkout (README, Development).

DeepSpeed lives in its own venv, bench/.ds-venv, made on first use by
`pip install torch==<this torch> deepspeed==0.19.8 transformers==<this transformers>
peft==<this peft>` (one command, so pip takes the local CPU torch; a venv that has all four is kept); its JIT-built ops (cpu_adam, async_io, and on
the CPU accelerator shm comm and pin_memory; ~20 min on a busy 2-core machine) are cached
in bench/.torch-extensions. async_io needs libaio-dev (apt-get install -y libaio-dev).

    python bench/e2e_vs_deepspeed.py                     # full run (~100M model)
    python bench/e2e_vs_deepspeed.py --quick             # small model: checks the harness
    python bench/e2e_vs_deepspeed.py --no-deepspeed      # ours only
    python bench/e2e_vs_deepspeed.py --setup-only        # make the venv and build the ops
    python bench/e2e_vs_deepspeed.py --only-adamw8bit    # the AdamW8bit row only
    python bench/e2e_vs_deepspeed.py --lora              # LoRA r16 all-linear over a frozen base
`--lora`: every side trains peft.get_peft_model(<the same Llama>, LoraConfig(r=16,
alpha=32, dropout 0, all-linear)) built by e2e_common.build, adapters drawn from one seed, so
all start from the same weights (checksummed); the base stays fp32 on every side. Ours gets the
wrapped model as is, its base homed on NVMe at the engine's minimum host budget (--cpu-mem min);
DeepSpeed ZeRO-3 offloads params to NVMe and the adapters' optimizer state to the CPU
(--ds-offload-optimizer); the reference is plain PyTorch + PEFT. Ours' NVMe bytes of the frozen
base are counted per step (goal: 0 written).
`--adamw8bit` adds a row (no DeepSpeed in it): the engine with optimizer="adamw8bit", its 8-bit
state on NVMe, against plain PyTorch + our drop-in tierwise.optim.AdamW8bit without offload,
alternating; `--cpu-mem-8bit` sets its host budget (default 900M: gradients and masters in
DRAM, 80% of the 8-bit state on NVMe, as --cpu-mem 1300M leaves 80% of fp32 AdamW's state there;
800M, the earlier default, puts the masters on NVMe too).
On a machine with CUDA both sides run on the GPU (ours with device cuda, DeepSpeed with its
CUDA accelerator); --device cpu forces the CPU path.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

import e2e_common as common  # noqa: E402

# resolved: a worktree may link these to a shared copy, and the JIT-built ops' build files
# name the venv's path, so a second path to the same venv would rebuild every op
VENV = (BENCH / ".ds-venv").resolve()
EXT_DIR = (BENCH / ".torch-extensions").resolve()
DS_VERSION = "0.19.8"
WARMUP = 2
REL_TOL = 1e-5

QUICK_MODEL = {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 4, "intermediate_size": 688, "vocab_size": 8000}


# -- the DeepSpeed environment -----------------------------------------------------------------
def ds_python() -> Path:
    return VENV / "bin" / "python"


def check_libaio() -> None:
    if not any(Path(p).exists() for p in ("/usr/include/libaio.h", "/usr/local/include/libaio.h")):
        sys.exit("DeepSpeed's async_io (NVMe offload) needs libaio's headers: run "
                 "`apt-get update && apt-get install -y libaio-dev` (as root), then run this again")


def ds_env(*, cuda: bool) -> dict[str, str]:
    """Single-process DeepSpeed environment; the CPU accelerator unless on CUDA."""
    env = dict(os.environ)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=env.get("E2E_MASTER_PORT", "29517"), RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", TORCH_EXTENSIONS_DIR=str(EXT_DIR))
    if cuda:
        env.pop("DS_ACCELERATOR", None)
    else:
        env["DS_ACCELERATOR"] = "cpu"
    return env


def ensure_ds_venv(*, cuda: bool) -> None:
    """Make bench/.ds-venv with DeepSpeed, and torch, transformers and peft matching this
    python's (peft: the --lora runs). A venv that already has all four at those versions is
    kept as is; one that lacks some gets them installed into it (pip keeps what is satisfied)."""
    import peft
    import torch
    import transformers

    torch_version = torch.__version__.split("+")[0]
    want = [DS_VERSION, torch_version, transformers.__version__, peft.__version__]
    probe = [str(ds_python()), "-c", "import deepspeed, torch, transformers, peft; print(deepspeed.__version__, "
             "torch.__version__.split('+')[0], transformers.__version__, peft.__version__)"]
    if ds_python().exists():
        r = subprocess.run(probe, capture_output=True, text=True, env=ds_env(cuda=cuda))
        if r.returncode == 0 and r.stdout.strip().splitlines()[-1:] == [" ".join(want)]:
            return
        print(f"[setup] completing {VENV} (it has: "
              f"{r.stdout.strip().splitlines()[-1:] or 'not all of deepspeed, torch, transformers, peft'})", flush=True)
    else:
        print(f"[setup] creating {VENV} (torch {torch_version}, deepspeed {DS_VERSION}, "
              f"transformers {transformers.__version__}, peft {peft.__version__}); a few minutes", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(ds_python()), "-m", "pip", "install", "-q", f"torch=={torch_version}",
           f"deepspeed=={DS_VERSION}", f"transformers=={transformers.__version__}", f"peft=={peft.__version__}"]
    t0 = time.perf_counter()
    r = subprocess.run(pip, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in r.stdout.splitlines():  # drop pip's notes about absent local index folders
        if "is ignored: it is neither a file nor a directory" not in line:
            print(f"[pip] {line}", flush=True)
    if r.returncode != 0:
        sys.exit(f"installing DeepSpeed into {VENV} failed (see above); command: {' '.join(pip)}")
    print(f"[setup] installed in {time.perf_counter() - t0:.0f} s", flush=True)


def build_ds_ops(*, cuda: bool) -> None:
    """JIT-build (once; cached in bench/.torch-extensions) cpu_adam and async_io."""
    t0 = time.perf_counter()
    r = subprocess.run([str(ds_python()), str(BENCH / "ds_runner.py"), "--build-ops"], env=ds_env(cuda=cuda))
    if r.returncode != 0:
        sys.exit("building DeepSpeed's cpu_adam / async_io failed (see above)")
    print(f"[setup] DeepSpeed ops ready in {time.perf_counter() - t0:.0f} s (cached in {EXT_DIR})", flush=True)


# -- the run specification -----------------------------------------------------------------------
def model_config(quick: bool) -> dict:
    from tierwise.profiles import load_model_profile

    cfg = load_model_profile("100m").to_hf_config()
    cfg.tie_word_embeddings = False
    cfg.use_cache = False
    if quick:
        for k, v in QUICK_MODEL.items():
            setattr(cfg, k, v)
    return cfg.to_dict()


def make_spec(a: argparse.Namespace, *, cuda: bool) -> dict:
    return {
        "gpu_mem_asked": a.gpu_mem, "cpu_mem_asked": a.cpu_mem, "budget_notes": [],
        "hf_config": model_config(a.quick), "seed": a.seed, "data_seed": a.seed + 1,
        "batch": a.batch, "seq": a.seq, "steps": a.steps, "warmup": WARMUP, "lr": a.lr,
        "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "threads": a.threads,
        "device": "cuda" if cuda else "cpu", "gpu_mem": a.gpu_mem, "cpu_mem": a.cpu_mem,
        "nvme": not a.no_nvme, "aio_threads": a.aio_threads, "aio_block_size": a.aio_block_size,
        "ds_buffer_count": a.ds_buffer_count, "chunk_bytes": a.chunk_bytes or ("2M" if a.quick else "64M"),
        "checkpointing": a.recompute,
        "lora": lora_spec(a), "ds_offload_optimizer": a.ds_offload_optimizer or ("cpu" if a.lora else "nvme"),
    }


def lora_spec(a: argparse.Namespace) -> dict | None:
    """The `lora` entry of the spec (e2e_common.build reads it), or None without --lora."""
    if not a.lora:
        return None
    try:
        targets = common.parse_lora_targets(a.lora_targets)
    except ValueError as exc:
        sys.exit(str(exc))
    return {"r": a.lora_rank, "alpha": a.lora_alpha or 2 * a.lora_rank, "targets": targets, "seed": a.seed + 2}


# -- one child process -------------------------------------------------------------------------
def run_child(side: str, spec: dict, *, scratch_root: str, cuda: bool, verbose: bool) -> dict:
    """Run one side in a fresh process; its result plus its peak RSS (wait4's ru_maxrss)."""
    scratch = tempfile.mkdtemp(prefix=f"e2e-{side}-", dir=scratch_root)
    spec = dict(spec, nvme_path=scratch)
    spec_file = Path(scratch) / "spec.json"
    spec_file.write_text(json.dumps(spec))
    if side in ("ours", "plain"):
        spec["side"] = side
        spec_file.write_text(json.dumps(spec))
        cmd, env = [sys.executable, str(Path(__file__).resolve()), "--child", str(spec_file)], dict(os.environ)
    else:
        cmd, env = [str(ds_python()), str(BENCH / "ds_runner.py"), "--spec", str(spec_file)], ds_env(cuda=cuda)
    env["OMP_NUM_THREADS"] = str(spec["threads"])
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if verbose and not line.startswith("E2E_RESULT "):
            print(f"    [{side}] {line.rstrip()}", flush=True)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    shutil.rmtree(scratch, ignore_errors=True)
    results = [json.loads(x[len("E2E_RESULT "):]) for x in lines if x.startswith("E2E_RESULT ")]
    if results and "error" in results[-1]:
        return results[-1]
    if proc.returncode != 0 or not results:
        tail = "".join(lines[-40:])
        raise RuntimeError(f"{side} run failed (exit {proc.returncode}); its last output:\n{tail}")
    res = results[-1]
    res["rss_gib"] = usage.ru_maxrss / 2**20  # KiB on Linux
    res["wall_s"] = time.perf_counter() - t0
    return res


def resolve_min_budgets(spec: dict, *, scratch_root: str, cuda: bool, verbose: bool) -> None:
    """'min' budgets: a probe process (warm-up steps only) finds the engine's minimums, so that
    the timed runs start with their final budgets (no refused attempt inflating peak RSS)."""
    probe = run_child("ours", dict(spec, steps=0), scratch_root=scratch_root, cuda=cuda, verbose=verbose)
    if "error" in probe:
        hint = "  (use --no-nvme until the nvme tier is wired)" if "not wired" in probe["error"] else ""
        sys.exit(f"ours: {probe['kind']}: {probe['error']}{hint}")
    spec["budget_notes"] = probe["budget_raised"]
    spec["gpu_mem"], spec["cpu_mem"] = probe["gpu_mem"], probe["cpu_mem"]
    print(f"engine minimums (probe, {probe['wall_s']:.0f} s): gpu_mem {probe['gpu_mem']} B, "
          f"cpu_mem {probe['cpu_mem']} B", flush=True)


def child_plain(spec: dict) -> None:
    """The reference: plain PyTorch + torch.optim.AdamW (or, for the AdamW8bit row, our drop-in
    tierwise.optim.AdamW8bit), everything in memory, no offload."""
    import torch

    common.pin_threads(spec)
    cuda = spec["device"] == "cuda"
    model = common.build(spec).to(spec["device"])
    checksum = common.weights_checksum(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    batches = common.make_batches(vocab=spec["hf_config"]["vocab_size"], count=spec["warmup"] + spec["steps"],
                                  batch=spec["batch"], seq=spec["seq"], seed=spec["data_seed"])
    if spec.get("optimizer", "adamw") == "adamw8bit":  # our drop-in 8-bit AdamW, no offload
        from tierwise.optim import AdamW8bit

        opt = AdamW8bit(trainable, lr=spec["lr"], betas=tuple(spec["betas"]), eps=spec["eps"],
                        weight_decay=spec["weight_decay"])
    else:
        opt = torch.optim.AdamW(trainable, lr=spec["lr"], betas=tuple(spec["betas"]), eps=spec["eps"],
                                weight_decay=spec["weight_decay"])

    def step(x: torch.Tensor) -> float:
        x = x.to(spec["device"])
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    out = common.timed_loop(step, batches, warmup=spec["warmup"],
                            sync=torch.cuda.synchronize if cuda else (lambda: None))
    out.update(side="plain", checksum=checksum, n_params=sum(p.numel() for p in model.parameters()),
               n_trainable=sum(p.numel() for p in trainable))
    common.emit(out)


def child_ours(spec_file: str) -> None:
    """The tierwise side (system python)."""
    import torch

    from tierwise.offload import Activations, Budget, Engine, InfeasibleBudget, Optim, TierwiseError

    spec = common.load_spec(spec_file)
    if spec.get("side") == "plain":
        child_plain(spec)
        return
    common.pin_threads(spec)
    cuda = spec["device"] == "cuda"
    model = common.build(spec)
    checksum = common.weights_checksum(model)
    n_params = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    batches = common.make_batches(vocab=spec["hf_config"]["vocab_size"], count=spec["warmup"] + spec["steps"],
                                  batch=spec["batch"], seq=spec["seq"], seed=spec["data_seed"])
    # "min": start below any minimum (the device tier must still hold the module buffers)
    gpu_mem = 1 << 20 if spec["gpu_mem"] == "min" else spec["gpu_mem"]
    cpu_mem = 1 if spec["cpu_mem"] == "min" else spec["cpu_mem"]
    nvme_path = spec["nvme_path"] if spec["nvme"] else None
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    raised = []
    # the planner's activation peak, as `finetune` gives it: chunks are placed before the first
    # step and a too-small budget is refused at construction with the exact minimum
    from tierwise.offload.plan.perfmodel import activation_bytes
    from tierwise.profiles import ModelProfile

    activations = activation_bytes(model=ModelProfile.from_hf_config(model.config), batch_size=spec["batch"],
                                   seq_len=spec["seq"], precision="fp32",
                                   checkpointing=spec.get("checkpointing", False))
    for _ in range(5):  # a budget below the engine's minimum is raised to that minimum (and said so)
        eng = None
        try:
            eng = Engine(model, budget=Budget(gpu=gpu_mem, cpu=cpu_mem, nvme=nvme_path, chunk=spec["chunk_bytes"]),
                         optim=Optim(spec.get("optimizer", "adamw"), lr=spec["lr"], betas=tuple(spec["betas"]), eps=spec["eps"], weight_decay=spec["weight_decay"]),
                         activations=Activations(recompute=spec.get("checkpointing", False), expected=activations),
                         device=spec["device"])
            print(f"engine: gpu_mem={gpu_mem} cpu_mem={cpu_mem} nvme_path={nvme_path} device={eng.device} "
                  f"chunks={len(eng.plan.chunks)}", flush=True)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            by_key = _tally_nvme_keys(eng)
            out = common.timed_loop(lambda x: eng.step({"input_ids": x, "labels": x}), batches,
                                    warmup=spec["warmup"], sync=sync, counters=lambda: _nvme_counters(eng, by_key))
            break
        except InfeasibleBudget as exc:  # at construction, or in the warm-up step (measured activations)
            if not exc.minimum:
                raise
            raised.append(str(exc))
            print(f"budget raised: {exc}", flush=True)
            gpu_mem = exc.minimum.get("gpu", gpu_mem)
            cpu_mem = exc.minimum.get("host", cpu_mem)
        except TierwiseError as exc:
            common.emit({"error": str(exc), "kind": type(exc).__name__})
            sys.exit(3)
        if eng is not None:
            eng.close()
        eng = None
        model = common.build(spec)
    else:
        raise SystemExit("the engine kept refusing its budgets: " + " | ".join(raised))
    out.update(side="ours", n_params=n_params, n_trainable=n_trainable, checksum=checksum, base_tiers=_base_tiers(eng), gpu_mem=gpu_mem, cpu_mem=cpu_mem,
               nvme=nvme_path is not None, budget_raised=raised,
               homes={t: dict(k) for t, k in getattr(getattr(eng, "homes", None), "bytes", {}).items()},
               gpu_home=len(eng.device_plan.gpu_home) if eng.device_plan else 0, chunks=len(eng.plan.chunks))
    peaks = eng.ledger.peaks()
    out["ledger_peaks"] = {k: int(v) for k, v in peaks.items()}
    if cuda:
        out["gpu_peak_alloc"] = torch.cuda.max_memory_allocated()
    eng.close()
    common.emit(out)


def _nvme_counters(eng, by_key: dict[str, int]) -> dict[str, int]:
    """NvmeStore's own count of the bytes it moved (cumulative), and of those the frozen base's
    (`by_key`, from _tally_nvme_keys)."""
    if getattr(eng, "nvme", None) is None:
        return {}
    st = eng.nvme.stats
    return {"nvme_bytes_written": st.bytes_written, "nvme_bytes_read": st.bytes_read, **by_key}


def _tally_nvme_keys(eng) -> dict[str, int]:
    """Count the bytes the engine asks its NvmeStore to write / read for frozen (base) chunks:
    their swap keys are `c<chunk>.compute` (a frozen chunk has no other kind). Preallocated
    zeros count as written. The returned dict is updated in place, cumulative."""
    tally = {"nvme_base_bytes_written": 0, "nvme_base_bytes_read": 0}
    nvme = getattr(eng, "nvme", None)
    if nvme is None or not eng.plan.frozen:
        return tally
    base = {f"c{c}.compute" for c in eng.plan.frozen}

    def wrap(name: str, counter: str, size) -> None:
        orig = getattr(nvme, name)

        def counted(key, arg, *rest, **kw):
            if key in base:
                tally[counter] += size(arg)
            return orig(key, arg, *rest, **kw)

        setattr(nvme, name, counted)

    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    wrap("write_async", "nvme_base_bytes_written", nbytes)
    wrap("read_async", "nvme_base_bytes_read", nbytes)
    wrap("zeros", "nvme_base_bytes_written", int)
    return tally


def _base_tiers(eng) -> dict[str, int]:
    """Bytes of the frozen base per home tier ("gpu" for gpu-home chunks)."""
    tiers: dict[str, int] = {}
    gpu_home = eng.device_plan.gpu_home if eng.device_plan else ()
    for c in eng.plan.frozen:
        ch = eng.store.chunks[c]
        tier = "gpu" if c in gpu_home else ch.tiers["compute"]
        tiers[tier] = tiers.get(tier, 0) + ch.compute.nbytes
    return tiers


# -- the report ----------------------------------------------------------------------------------
def agreement(a: list[float], b: list[float]) -> str:
    """Same first-step loss exactly; later steps within REL_TOL relative."""
    first_same = a[0] == b[0]
    rel = [abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a[1:], b[1:])]
    worst = max(rel, default=0.0)
    first = "first-step loss identical" if first_same else f"first-step loss DIFFERS ({a[0]!r} vs {b[0]!r})"
    later = (f"later steps within {REL_TOL:g} relative (worst {worst:.2e})" if worst <= REL_TOL
             else f"later steps NOT within {REL_TOL:g} relative (worst {worst:.2e} at step "
                  f"{rel.index(worst) + 1})")
    return f"{first}; {later}"


def _size(v) -> str:
    return f"{v / 2**20:.0f} MiB" if isinstance(v, int) else str(v)


def report(runs: dict[str, list[dict]], spec: dict, *, cuda: bool) -> None:
    ours = runs["ours"]
    ref = ours[0]
    cfg = spec["hf_config"]
    print(f"\nmodel: Llama hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
          f"{cfg['num_attention_heads']} heads, intermediate {cfg['intermediate_size']}, vocab {cfg['vocab_size']}, "
          f"untied: {ref['n_params'] / 1e6:.1f}M parameters; batch {spec['batch']} x seq {spec['seq']}, fp32, "
          f"AdamW lr {spec['lr']:g} wd {spec['weight_decay']:g}; {WARMUP} warm-up + {spec['steps']} timed steps "
          f"per run; device {spec['device']}; {spec['threads']} threads")
    print(f"ours: gpu_mem {_size(ref['gpu_mem'])} (asked {spec['gpu_mem_asked']}), cpu_mem {_size(ref['cpu_mem'])} "
          f"(asked {spec['cpu_mem_asked']}), NVMe {'on' if ref['nvme'] else 'OFF'}, recompute "
          f"{'on' if spec.get('checkpointing') else 'off'}; {ref['gpu_home']}/{ref['chunks']} "
          f"chunks gpu-home; host-side homes: " + "; ".join(
              f"{t}: " + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in kinds.items())
              for t, kinds in ref["homes"].items()))
    lora = spec.get("lora")
    if lora:
        targets = lora["targets"] if isinstance(lora["targets"], str) else ",".join(lora["targets"])
        print(f"LoRA (peft.get_peft_model on every side, adapters from seed {lora['seed']}): r {lora['r']}, alpha "
              f"{lora['alpha']}, dropout 0, targets {targets}; {ref['n_trainable'] / 1e6:.2f}M trainable of "
              f"{ref['n_params'] / 1e6:.1f}M; base fp32 on every side (frozen); DeepSpeed offload_param nvme, "
              f"offload_optimizer {spec['ds_offload_optimizer']}")
        print("ours: base homes: " + ", ".join(f"{t} {b / 2**20:.0f} MiB" for t, b in sorted(ref["base_tiers"].items())))
    for msg in spec["budget_notes"] + ref["budget_raised"]:
        print(f"      budget raised to the engine's minimum: {msg}")
    if not ref["nvme"]:
        print("      ** ours ran WITHOUT the NVMe tier: its figures are not an NVMe-vs-NVMe comparison **")
    sides = [s for s in ("ours", "ds") if runs[s]]
    med = {s: statistics.median(r["step_s"] for r in runs[s]) for s in sides}
    for s in sides:
        rs = runs[s]
        name = "tierwise " if s == "ours" else "DeepSpeed"
        steps = ", ".join(f"{r['step_s']:.3f}" for r in rs)
        print(f"{name}: median step {med[s]:.3f} s (per-run medians {steps}); peak RSS "
              f"{max(r['rss_gib'] for r in rs):.2f} GiB (runs: {', '.join(format(r['rss_gib'], '.2f') for r in rs)}); "
              f"disk per step: written {statistics.median(r['write_bytes_per_step'] for r in rs) / 1e9:.3f} GB, "
              f"read {statistics.median(r['read_bytes_per_step'] for r in rs) / 1e9:.3f} GB")
        own = [r["counters_per_step"] for r in rs if r.get("counters_per_step")]
        if own:
            print(f"          NvmeStore's own count per step: written "
                  f"{statistics.median(c['nvme_bytes_written'] for c in own) / 1e9:.3f} GB, read "
                  f"{statistics.median(c['nvme_bytes_read'] for c in own) / 1e9:.3f} GB")
            if lora:
                wb = max(c["nvme_base_bytes_written"] for c in own)
                print(f"          of which the frozen base: written {wb:.0f} B (worst run; goal 0), read "
                      f"{statistics.median(c['nvme_base_bytes_read'] for c in own) / 1e9:.3f} GB")
        if cuda and "gpu_peak_alloc" in rs[-1]:
            print(f"          peak GPU memory allocated {rs[-1]['gpu_peak_alloc'] / 2**30:.2f} GiB")
    if "ds" in med:
        goal = "0.40 (host budget with room for the gradients)" if spec["cpu_mem_asked"] != "min" \
            else "0.50 (the engine's minimum host budget)"
        print(f"ratio ours/DeepSpeed = {med['ours'] / med['ds']:.3f}  (goal <= {goal})")
    print(f"ours, run to run: {agreement(ours[-1]['losses'], ours[0]['losses'])}")
    if runs["ds"]:
        ds = runs["ds"]
        same_w = ref["checksum"] == ds[0]["checksum"]
        print(f"initial weights identical on both sides: {same_w} (checksums {ref['checksum']!r} / "
              f"{ds[0]['checksum']!r})")
        print(f"losses ours vs DeepSpeed: {agreement(ours[0]['losses'], ds[0]['losses'])}")
        print(f"DeepSpeed, run to run: {agreement(ds[-1]['losses'], ds[0]['losses'])}")
    plain = runs.get("plain")
    if plain:
        p = plain[0]
        pmed = statistics.median(r["step_s"] for r in plain)
        per_run = ", ".join(f"{r['step_s']:.3f}" for r in plain)
        print(f"plain PyTorch{' + PEFT' if lora else ''} + torch AdamW, no offload (reference): median step "
              f"{pmed:.3f} s (per-run medians {per_run}), peak RSS {max(r['rss_gib'] for r in plain):.2f} GiB")
        goal = "1.10 (host budget with room for the gradients)" if spec["cpu_mem_asked"] != "min" \
            else "1.30 (the engine's minimum host budget)"
        per_round = ", ".join(f"{o['step_s'] / q['step_s']:.3f}" for o, q in zip(ours, plain))
        print(f"ratio ours/plain = {med['ours'] / pmed:.3f}  (goal <= {goal}; per round {per_round})")
        print(f"losses ours vs plain PyTorch: {agreement(ours[0]['losses'], p['losses'])}")
        if runs["ds"]:
            print(f"losses DeepSpeed vs plain PyTorch: {agreement(runs['ds'][0]['losses'], p['losses'])}")
    cols = [("ours", ours[0]["losses"])] + ([("ds", runs["ds"][0]["losses"])] if runs["ds"] else []) \
        + ([("plain", plain[0]["losses"])] if plain else [])
    if len(cols) > 1:
        base_name, base = cols[-1]
        print(f"losses (first run of each; rel diff against {base_name}):")
        for i in range(len(base)):
            tag = "warm-up" if i < WARMUP else "timed"
            cells = "  ".join(f"{n} {v[i]:.9f}" + (f" ({abs(v[i] - base[i]) / abs(base[i]):.1e})" if n != base_name else "")
                              for n, v in cols)
            print(f"  step {i} ({tag:7s}) {cells}")


def report_8bit(runs: dict[str, list[dict]], spec: dict) -> None:
    """The AdamW8bit row: the engine (state on NVMe) vs plain PyTorch + our drop-in AdamW8bit."""
    ours, plain = runs["ours"], runs["plain"]
    ref = ours[0]
    med = {s: statistics.median(r["step_s"] for r in runs[s]) for s in runs}
    print(f"\nAdamW8bit row: ours gpu_mem {_size(ref['gpu_mem'])}, cpu_mem {_size(ref['cpu_mem'])} (asked "
          f"{spec['cpu_mem_asked']}); host-side homes: " + "; ".join(
              f"{t}: " + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in kinds.items())
              for t, kinds in ref["homes"].items()))
    for s, name in (("ours", "tierwise AdamW8bit (NVMe)"), ("plain", "plain PyTorch + AdamW8bit")):
        rs = runs[s]
        per_run = ", ".join(f"{r['step_s']:.3f}" for r in rs)
        print(f"{name:26s}: median step {med[s]:.3f} s (per-run medians {per_run}); "
              f"peak RSS {max(r['rss_gib'] for r in rs):.2f} GiB; disk per step: written "
              f"{statistics.median(r['write_bytes_per_step'] for r in rs) / 1e9:.3f} GB, read "
              f"{statistics.median(r['read_bytes_per_step'] for r in rs) / 1e9:.3f} GB")
    print(f"ratio ours/plain (AdamW8bit) = {med['ours'] / med['plain']:.3f}  (wanted for this row without "
          f"a goal; the fp32 row's at --cpu-mem 1300M is <= 1.10)")
    print(f"losses ours vs plain (AdamW8bit): {agreement(ours[0]['losses'], plain[0]['losses'])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small model (2 layers, hidden 256) to check the harness")
    ap.add_argument("--no-deepspeed", action="store_true", help="run ours only")
    ap.add_argument("--no-nvme", action="store_true", help="ours without the NVMe tier (until it is wired)")
    ap.add_argument("--setup-only", action="store_true", help="make the DeepSpeed venv, build its ops, exit")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per run (default 6; --quick 3)")
    ap.add_argument("--rounds", type=int, default=None, help="runs of each side, alternating (default 2; --quick 1)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gpu-mem", default="min",
                    help="ours: device budget; 'min' or a size below the engine's minimum: that minimum")
    ap.add_argument("--cpu-mem", default="min",
                    help="ours: host budget; 'min' (default) or a size below the engine's minimum: that minimum "
                         "(with NVMe: gradients + bounce buffers; weights and optimizer state go to NVMe)")
    ap.add_argument("--chunk-bytes", default=None, help="ours: chunk size (default 64M; --quick 2M)")
    ap.add_argument("--recompute", action="store_true",
                    help="ours: activation checkpointing (DeepSpeed's run here keeps all activations; by "
                         "default so does ours)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--nvme-dir", default=None, help="where both sides put their swap files (default: a temp dir)")
    ap.add_argument("--aio-threads", type=int, default=2, help="DeepSpeed aio intra_op_parallelism")
    ap.add_argument("--aio-block-size", type=int, default=1 << 20, help="DeepSpeed aio block_size")
    ap.add_argument("--ds-buffer-count", type=int, default=5, help="DeepSpeed offload_param buffer_count")
    ap.add_argument("--ds-offload-optimizer", choices=("nvme", "cpu"), default=None,
                    help="DeepSpeed offload_optimizer device (default nvme; with --lora cpu: the adapters' state is small)")
    ap.add_argument("--lora", action="store_true",
                    help="LoRA on every side: peft.get_peft_model over the Llama (same adapters), the fp32 base "
                         "frozen; ours homes the base on NVMe at its minimum host budget, DeepSpeed offloads "
                         "params to NVMe")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--lora-alpha", type=int, default=None, help="default 2 x rank")
    ap.add_argument("--lora-targets", default="all-linear",
                    help="'all-linear' (PEFT: every Linear but the output layer) or e.g. q_proj,k_proj,v_proj,o_proj")
    ap.add_argument("--no-reference", dest="reference", action="store_false",
                    help="skip the plain-PyTorch run (no offload) whose losses both sides are checked against")
    ap.add_argument("--adamw8bit", action="store_true",
                    help="also the AdamW8bit row: the engine with optimizer adamw8bit (state on NVMe) vs plain "
                         "PyTorch + tierwise.optim.AdamW8bit without offload, alternating, --rounds each")
    ap.add_argument("--only-adamw8bit", action="store_true", help="the AdamW8bit row only")
    ap.add_argument("--cpu-mem-8bit", default=None,
                    help="ours' host budget in the AdamW8bit row (default 900M: the 100M model's gradients and "
                         "masters in DRAM, 80%% of its 8-bit state on NVMe, as --cpu-mem 1300M is for fp32 AdamW; "
                         "--quick: min; 'min': the engine's minimum, gradients on NVMe too)")
    ap.add_argument("--verbose", action="store_true", help="echo the children's output")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child_ours(a.child)
        return
    a.steps = a.steps or (3 if a.quick else 6)
    a.rounds = a.rounds or (1 if a.quick else 2)

    import torch

    cuda = torch.cuda.is_available() if a.device == "auto" else a.device == "cuda"
    use_ds = not a.no_deepspeed and not a.only_adamw8bit
    if a.lora and (a.adamw8bit or a.only_adamw8bit):
        sys.exit("--lora runs the fp32 AdamW comparison only; run the AdamW8bit row without --lora")
    if use_ds or a.setup_only:
        check_libaio()
        ensure_ds_venv(cuda=cuda)
        build_ds_ops(cuda=cuda)
    if a.setup_only:
        return
    spec = make_spec(a, cuda=cuda)
    print(f"load average at start: {_load()}", flush=True)
    scratch_root = a.nvme_dir or tempfile.gettempdir()
    os.makedirs(scratch_root, exist_ok=True)
    if a.only_adamw8bit:
        run_8bit(a, spec, scratch_root=scratch_root, cuda=cuda)
        print(f"load average at end: {_load()}", flush=True)
        return
    if "min" in (spec["gpu_mem"], spec["cpu_mem"]):
        resolve_min_budgets(spec, scratch_root=scratch_root, cuda=cuda, verbose=a.verbose)
    runs: dict[str, list[dict]] = {"ours": [], "ds": [], "plain": []}
    # the reference alternates with the others: one plain process against the median of
    # several of ours decided the ratio before, and processes of the same code vary by 20%
    order = (["ours", "ds"] if use_ds else ["ours"]) + (["plain"] if a.reference else [])
    for r in range(a.rounds):
        for side in order:
            res = run_child(side, spec, scratch_root=scratch_root, cuda=cuda, verbose=a.verbose)
            if "error" in res:
                hint = "  (use --no-nvme until the nvme tier is wired)" if "not wired" in res["error"] else ""
                sys.exit(f"{side}: {res['kind']}: {res['error']}{hint}")
            runs[side].append(res)
            print(_round_line(f"round {r} {side:5s}", res, process=True), flush=True)
    report(runs, spec, cuda=cuda)
    if a.adamw8bit:
        run_8bit(a, spec, scratch_root=scratch_root, cuda=cuda)
    print(f"load average at end: {_load()}", flush=True)


def _round_line(label: str, res: dict, *, process: bool = False) -> str:
    """One timed run of a side: its step, RSS, disk bytes per step, the load now."""
    wall = f"process {res['wall_s']:.0f} s, " if process else ""
    return (f"{label}: step {res['step_s']:.3f} s (steps {', '.join(f'{t:.2f}' for t in res['step_times'])}), "
            f"rss {res['rss_gib']:.2f} GiB, disk/step w {res['write_bytes_per_step'] / 1e9:.3f} GB "
            f"r {res['read_bytes_per_step'] / 1e9:.3f} GB, {wall}load {os.getloadavg()[0]:.1f}")


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" ({os.cpu_count()} CPUs)"


def run_8bit(a: argparse.Namespace, spec: dict, *, scratch_root: str, cuda: bool) -> None:
    """The AdamW8bit row: ours and plain PyTorch + our AdamW8bit, alternating, --rounds each."""
    cpu = a.cpu_mem_8bit or ("min" if a.quick else "900M")
    spec = dict(spec, optimizer="adamw8bit", gpu_mem=a.gpu_mem, cpu_mem=cpu, cpu_mem_asked=cpu, budget_notes=[])
    if "min" in (spec["gpu_mem"], spec["cpu_mem"]):
        resolve_min_budgets(spec, scratch_root=scratch_root, cuda=cuda, verbose=a.verbose)
    runs: dict[str, list[dict]] = {"ours": [], "plain": []}
    for r in range(a.rounds):
        for side in ("ours", "plain"):
            res = run_child(side, spec, scratch_root=scratch_root, cuda=cuda, verbose=a.verbose)
            if "error" in res:
                sys.exit(f"adamw8bit {side}: {res['kind']}: {res['error']}")
            runs[side].append(res)
            print(_round_line(f"round {r} 8bit {side:5s}", res), flush=True)
    report_8bit(runs, spec)


if __name__ == "__main__":
    main()
