"""Several ranks in processes (gloo on the CPU): what each rank of tests/test_dist.py runs.

`spawn(world, cases, tmp)` starts `world` processes; each joins a gloo group (file rendezvous
under `tmp`), runs every case of `cases` and rank 0 saves the results to `tmp/results.pt`:
per case the step losses, the final weights (gathered) and each rank's device peak. A case
is a dict: `kind` ("engine", "ddp", "resume": `split` steps, a new engine from the
shards, the rest), `data` ("plain" or "masked"), `steps`, `grad_accum`
(per rank), and Engine keywords for "engine" (`nvme`: each rank its own swap directory).
`spawn_then_die(cases, tmp)`: the same on 2 ranks, then collectives in diverged orders, then
rank 1 SIGKILLed mid-step on them;
`run_two_ranks`: every 2-rank case of tests/test_dist.py and tests/test_dist_lora.py that way
(the session fixture `two_ranks`, tests/conftest.py): one launch, as imports are most of one.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import tempfile
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from tierwise.offload.core.options import Budget, Distributed, Optim, Streaming, flat_options
from tierwise.offload.core.vocab import TIERS

from tests.models import batches, masked_batches, tiny_llama, token_weights

TINY = dict(layers=2, hidden=32, vocab=64)
CHUNK = 8 << 10  # ~13 chunks: every rank owns several


def data_for(name: str, steps: int, rows: int) -> list[dict]:
    if name == "masked":
        return masked_batches(steps, batch=rows, seq=12, vocab=64)
    if name == "masked-seed4":  # 4 micro-batches of step 1 whose loss terms sum to another
        return masked_batches(steps, batch=rows, seq=12, vocab=64, seed=4)  # last bit by rank
    return batches(steps, batch=rows, seq=12, vocab=64)


def engine_case(case: dict, rank: int, world: int, tmp: Path) -> dict:
    from tierwise.offload import Engine

    kw = dict(case.get("engine", {}))
    if kw.pop("nvme", False):
        kw["nvme_path"] = str(tmp / f"nvme-{rank}")
        os.makedirs(kw["nvme_path"], exist_ok=True)
    if case.get("lora") is not None:
        kw["lora"] = lora_config(case["lora"])
    accum = case["grad_accum"]
    data = data_for(case["data"], case["steps"], rows=accum * world * 2)
    model = model_for(case)
    before = settled_pss_kib() if case.get("pss") else 0  # with the model built, before the engine
    eng = Engine(model, **flat_options(**({"lr": 1e-2, "chunk_bytes": CHUNK} | kw)))
    del model
    losses = [eng.step(b, grad_accum=accum) for b in data]
    memory = node_memory(eng, before) if case.get("pss") else {}
    weights = dict(eng.named_parameters_fp32(trainable_only=case.get("lora") is not None))
    peaks = [0] * world
    peaks[rank] = eng.ledger.peaks()["gpu"]
    t = torch.tensor(peaks, dtype=torch.int64)
    dist.all_reduce(t)
    owned = sum(1 for c in eng.plan.chunks if eng.ranks is None or eng.ranks.owns(c.index))
    # gradient bytes each rank held at its peak in its host, CXL and NVMe tiers (the ledger), and
    # the fp32 bytes of the trainable chunks it owns
    grad = torch.zeros(2, world, dtype=torch.int64)
    grad[0, rank] = sum(eng.ledger.kind_peak(t, "grad") for t in ("host", "cxl", "nvme"))
    grad[1, rank] = sum(4 * c.numel for c in eng.plan.chunks
                        if not eng.plan.is_frozen(c.index) and (eng.ranks is None or eng.ranks.owns(c.index)))
    dist.all_reduce(grad)
    homes = {tier: sorted(kinds) for tier, kinds in eng.homes.bytes.items() if any(kinds.values())}
    # every rank's ledger peak in every tier (the budget matrix's 2-rank cases) and its budgets
    tier_peaks = torch.zeros(len(TIERS), world, dtype=torch.int64)
    for i, tier in enumerate(TIERS):
        tier_peaks[i, rank] = eng.ledger.peaks().get(tier, 0)
    dist.all_reduce(tier_peaks)
    budgets = {tier: eng.ledger.budgets.get(tier) for tier in TIERS}
    # the node's cores and I/O threads divided among its ranks: live NVMe threads per direction
    io = [sum(t.name.startswith(f"nvme-{d}-") for t in threading.enumerate()) for d in ("read", "write")]
    threads = {"local_world": eng.ranks.local_world if eng.ranks else 1, "nvme": io, "cpu": torch.get_num_threads()}
    eng.close()
    return {"losses": losses, "weights": weights, "gpu_peaks": t.tolist(), "owned_chunks": owned,
            "chunks": len(eng.plan.chunks), "homes": homes, "grad_bytes": grad[0].tolist(),
            "tier_peaks": dict(zip(TIERS, tier_peaks.tolist())), "budgets": budgets,
            "owned_grad_bytes": grad[1].tolist(), "grad_window": eng.grad_window, "threads": threads} | memory


def pss_kib(path: str = "/proc/self/smaps_rollup", match: "str | None" = None,
            fields: tuple = ("Pss:",)) -> int:
    """Proportional set size (KiB) of this process: shared pages split among their mappers.
    `match`: only the mappings whose name contains it (read from /proc/self/smaps); `fields`:
    the smaps lines summed."""
    total, take = 0, match is None
    for line in open(path if match is None else "/proc/self/smaps"):
        head = line.split()
        if match is not None and head and "-" in head[0] and len(head) >= 5:
            take = match in line  # a mapping's header line
        elif take and head and head[0] in fields:
            total += int(head[1])
    return total


def settled_pss_kib() -> int:
    """PSS of the process's anonymous and shared (/dev/shm) memory after garbage collection,
    with the memory that was freed given back to the system. Not the file-backed pages (torch's
    libraries): their share moves with every other process that maps them (other test runs on
    the machine starting or ending), which made an engine's growth negative."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return pss_kib(fields=("Pss_Anon:", "Pss_Shmem:"))


def node_memory(eng, before: int) -> dict:
    """Every rank's PSS (all of it; its growth since `before`, the engine's; its mappings of the
    shared base) and host and NVMe ledger. The cache's spare buffers (freed compute copies kept
    for reuse, as CUDA's allocator keeps blocks; as many as its eviction order left) are let go
    first: they are no base."""
    eng.residency.cache.drop_spares()
    pss = settled_pss_kib()
    mine = {"pss_kib": pss, "growth_kib": pss - before, "shm_pss_kib": pss_kib(match="tierwise-base-"),
            "host_usage": eng.ledger.usage().get("host", {}),
            "shared_nbytes": eng.shared.nbytes if eng.shared is not None else 0,
            "nvme_files": sorted(os.listdir(eng.nvme.directory)) if eng.nvme is not None else [],
            "nvme_usage": eng.ledger.usage().get("nvme", {})}
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return {"ranks_memory": out}


def lora_config(kw: dict):
    import peft

    return peft.LoraConfig(**({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"],
                               "lora_dropout": 0.0} | kw))


def model_for(case: dict) -> torch.nn.Module:
    """The tiny Llama; `frozen`: parameters whose name holds it are frozen (a base, as LoRA's)."""
    model = tiny_llama(**(TINY | case.get("model", {})))
    if case.get("frozen"):
        for name, p in model.named_parameters():
            p.requires_grad_(case["frozen"] not in name)
    return model


def resume_case(case: dict, rank: int, world: int) -> dict:
    """`split` steps, each rank's shard (state_dict) into a new engine, then the other steps:
    the losses and weights of the run, and what a shard holds. "measure": the resumed engine
    measures the next batch first (the CLI's --resume): its peak of gradient bytes then."""
    from tierwise.offload import Engine

    accum = case["grad_accum"]
    data = data_for(case["data"], case["steps"], rows=accum * world * 2)
    eng = Engine(model_for(case), **flat_options(lr=1e-2, chunk_bytes=CHUNK, **case.get("engine", {})))
    losses = [eng.step(b, grad_accum=accum) for b in data[:case["split"]]]
    shard = eng.state_dict()
    eng.close()
    eng = Engine(model_for(case), **flat_options(lr=1e-2, chunk_bytes=CHUNK, **case.get("engine", {})))
    eng.load_state_dict(shard)
    measured = {}
    if case.get("measure"):
        eng.measure(data[case["split"]])
        measured = {"grad_peak": sum(eng.ledger.kind_peak(t, "grad") for t in ("host", "cxl", "nvme")),
                    "owned_grad_bytes": sum(4 * c.numel for c in eng.plan.chunks if eng.ranks.owns(c.index)
                                            and not eng.plan.is_frozen(c.index)),
                    "grad_window": eng.grad_window}
    losses += [eng.step(b, grad_accum=accum) for b in data[case["split"]:]]
    weights = dict(eng.named_parameters_fp32())
    held = [cid for cid, c in enumerate(shard["chunks"]) if "master" in c]
    owned = [c.index for c in eng.plan.chunks if eng.ranks.owns(c.index) and not eng.plan.is_frozen(c.index)]
    eng.close()
    return {"losses": losses, "weights": weights, "held": held, "owned": owned,
            "shard": (shard["rank"], shard["world"])} | measured


def refusals() -> dict:
    """What several ranks refuse, each as its one-line message; and the CLI's agreement on a
    check each rank ran alone (cli.launch.agree: the pre-flight): every rank's outcome, when
    none, all, or some ranks refused."""
    from tierwise.cli.launch import RankInfo, Refused, agree
    from tierwise.offload import Engine, TierwiseError

    out = {}
    for opt in ("galore", "apollo"):
        try:
            Engine(tiny_llama(**TINY), budget=Budget(chunk=CHUNK), optim=Optim(opt))
        except Exception as exc:  # noqa: BLE001 - the message is what is checked
            out[opt] = str(exc)
    rank, world = dist.get_rank(), dist.get_world_size()
    info = RankInfo(rank=rank, world=world, local_world=world)
    for name, refusing in {"none": {}, "all": dict.fromkeys(range(world), "too small"),
                           "some": {1: "too small here", 2: "too small there"}}.items():
        try:
            agree(info, TierwiseError(refusing[rank]) if rank in refusing else None, "a test")
            got = None
        except Refused as exc:
            got = str(exc)
        every: list = [None] * world
        dist.all_gather_object(every, got)
        out[f"agree_{name}"] = every
    return out


def ddp_case(case: dict, rank: int, world: int) -> dict:
    """Plain DistributedDataParallel + torch.optim.AdamW(fused=True) on the same split: micro-batch
    i of a step on rank i mod world, each loss weighted by its share of the step's target
    tokens; DDP's average replaced by a sum (a communication hook), as the engine sums."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    accum = case["grad_accum"]
    data = data_for(case["data"], case["steps"], rows=accum * world * 2)
    model = tiny_llama(**TINY)
    if case.get("lora") is not None:  # PEFT's adapters (the same init: the same generator state as the engine's)
        import peft

        model = peft.get_peft_model(model, lora_config(case["lora"]))
    model = DDP(model)

    def sum_hook(state, bucket):
        return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])

    model.register_comm_hook(None, sum_hook)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0, fused=True)
    losses = []
    for b in data:
        n = accum * world
        micro = [{k: v.chunk(n)[i] for k, v in b.items()} for i in range(n)]
        weights = token_weights(micro)
        mine = [i for i in range(n) if i % world == rank]
        total = 0.0
        for j, i in enumerate(mine):
            ctx = model.no_sync() if j < len(mine) - 1 else _null()
            with ctx:
                loss = model(**micro[i]).loss
                (loss * weights[i] if weights[i] != 1.0 else loss).backward()
            total += loss.item() * weights[i]
        t = torch.tensor([total], dtype=torch.float64)
        dist.all_reduce(t)
        losses.append(float(t[0]))
        opt.step()
        opt.zero_grad()
    named = [(n.removeprefix("base_model.model."), p) for n, p in model.module.named_parameters() if p.requires_grad]
    return {"losses": losses, "weights": {n: p.detach().clone() for n, p in named}}


RANK_THREADS = 1  # each rank computes with one thread (2-3 ranks share 2 cores)


@contextlib.contextmanager
def rank_threads():
    """An in-process one-rank reference computes with the ranks' thread count: a matmul's
    blocking (so its sums' order, seen in bf16's last bit) depends on it."""
    before = torch.get_num_threads()
    torch.set_num_threads(RANK_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _worker(rank: int, world: int, cases: list[dict], tmp: str, die: bool = False) -> None:
    torch.set_num_threads(RANK_THREADS)
    tmp_path = Path(tmp)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    if die:  # the cases, the diverged orders, then rank 1 killed mid-step: the group is not torn down
        _run_cases(rank, world, cases, tmp_path)
        _diverge(rank, tmp_path)
        dist.barrier()  # rank 0 has saved the results
        _die(rank, tmp_path, DIE_TIMEOUT_S)
        return
    try:
        _run_cases(rank, world, cases, tmp_path)
    finally:
        dist.destroy_process_group()


def _run_cases(rank: int, world: int, cases: list[dict], tmp_path: Path) -> None:
    out = []
    for case in cases:
        torch.manual_seed(0)
        if case["kind"] == "refusals":
            out.append(refusals())
        elif case["kind"] == "resume":
            out.append(resume_case(case, rank, world))
        else:
            out.append(ddp_case(case, rank, world) if case["kind"] == "ddp"
                       else engine_case(case, rank, world, tmp_path))
    if rank == 0:
        torch.save(out, tmp_path / "results.pt")


def _forkserver() -> str:
    """"forkserver", its server having imported this module (torch, transformers) once for the
    session: each rank is a fork of it (one thread, nothing run yet), not a fresh interpreter
    importing them again (seconds a rank). Not for cases that measure PSS: pages shared with
    the server and its other children make it move for reasons of their own."""
    import multiprocessing

    multiprocessing.set_forkserver_preload(["tests.dist_cases"])
    return "forkserver"


def spawn(world: int, cases: list[dict], tmp: "Path | None" = None) -> list[dict]:
    """Run `cases` on `world` gloo ranks in processes; rank 0's results."""
    import torch.multiprocessing as mp

    if any(c.get("pss") for c in cases):
        raise ValueError("a case measuring PSS needs fresh processes (spawn_then_die), not the forkserver's")
    tmp = Path(tmp or tempfile.mkdtemp(prefix="tierwise-dist-"))
    mp.start_processes(_worker, args=(world, cases, str(tmp)), nprocs=world, start_method=_forkserver())
    return torch.load(tmp / "results.pt")


DIE_TIMEOUT_S = 20.0  # the dying run's collective timeout


def _diverge(rank: int, tmp_path: Path) -> None:
    """Collectives in a different order on the 2 ranks; each rank saves, per way, how it stopped
    (`diverge-RANK.pt`: the error's type and message, the seconds it took):
    "branch": the engine, rank 1 skipping a layer in step 2 (a data-dependent branch of a model);
    "reduce": a Ranks reducing chunk 0 on rank 0 and chunk 2 on rank 1 (the same size and owner:
    the sum of the two would be a wrong number); "gather": broadcasting chunk 1 on rank 0 and
    chunk 3 on rank 1 (the same size, different owners: a hang)."""
    import time

    from tierwise.offload import Engine
    from tierwise.offload.engine.ranks import Ranks

    def loss_fn(model, batch):
        layers = model.model.layers
        if rank == 1 and eng.steps == 1:
            model.model.layers = torch.nn.ModuleList(list(layers)[1:])
        try:
            return model(**batch).loss
        finally:
            model.model.layers = layers

    def record(fn) -> dict:
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - how it stopped is the result
            return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.perf_counter() - t0}
        return {"error": None, "seconds": time.perf_counter() - t0}

    out = {}
    torch.manual_seed(0)
    eng = Engine(tiny_llama(**TINY), budget=Budget(chunk=CHUNK), optim=Optim(lr=1e-2),
                 distributed=Distributed(timeout=3 * DIE_TIMEOUT_S), loss_fn=loss_fn)
    data = data_for("plain", 2, rows=4)
    eng.step(data[0])
    out["branch"] = record(lambda: eng.step(data[1]))
    eng.close()
    ranks = Ranks(dist.group.WORLD, trainable=list(range(4)), timeout_s=3 * DIE_TIMEOUT_S)
    out["reduce"] = record(lambda: ranks.reduce_grad(2 * rank, torch.ones(64)))
    out["gather"] = record(lambda: ranks.broadcast_chunk(1 + 2 * rank, torch.ones(64)))
    ranks.close()
    torch.save(out, tmp_path / f"diverge-{rank}.pt")


def _die(rank: int, tmp_path: Path, timeout_s: float) -> None:
    """Rank 1 is killed (SIGKILL) in the forward of step 2; rank 0 records how it stopped."""
    import signal
    import sys
    import time

    from tierwise.offload import Engine

    def loss_fn(model, batch):
        if rank == 1 and eng.steps == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return model(**batch).loss

    torch.manual_seed(0)
    eng = Engine(tiny_llama(**TINY), budget=Budget(chunk=CHUNK), optim=Optim(lr=1e-2),
                 distributed=Distributed(timeout=timeout_s), loss_fn=loss_fn)
    data = data_for("plain", 3, rows=4)
    t0 = time.perf_counter()
    try:
        for b in data:
            t0 = time.perf_counter()
            eng.step(b)
    except Exception as exc:  # noqa: BLE001 - what the survivor reports is the result
        torch.save({"error": f"{type(exc).__name__}: {exc}", "seconds": time.perf_counter() - t0},
                   tmp_path / "dying.pt")
        sys.exit(3)


def spawn_then_die(cases: list[dict], tmp: Path) -> tuple[list[dict], dict, list]:
    """`cases` on 2 gloo ranks, then on the same ranks rank 1 killed mid-step (one launch: the
    imports are most of a launch's time): (rank 0's results, rank 0's record of how it stopped,
    the exit codes)."""
    import torch.multiprocessing as mp

    # spawn, not the forkserver: the LoRA cases measure PSS
    ctx = mp.start_processes(_worker, args=(2, cases, str(tmp), True), nprocs=2, start_method="spawn",
                             join=False)
    for p in ctx.processes:
        p.join(timeout=DIE_TIMEOUT_S * 3 + 600)
    codes = [p.exitcode for p in ctx.processes]
    for p in ctx.processes:
        if p.exitcode is None:
            p.kill()
    if not (tmp / "results.pt").exists():
        raise RuntimeError(f"the ranks stopped before their results (exit codes {codes}): see their stderr")
    record = torch.load(tmp / "dying.pt") if (tmp / "dying.pt").exists() else {}
    return torch.load(tmp / "results.pt"), record, codes


STEPS = 3
CPU_TIGHT = "104K"  # per rank: state, master and gradients on NVMe (tests/test_dist.py); 16K of it
# the window of transient gradients (offload.engine.transient.window_bytes: two 8K chunks)
DEEP = dict(layers=8)  # ~40 chunks: the transient window (two chunks) is small beside them
LORA_TIGHT = "90K"  # per rank: the LoRA base partly in the shared host memory, partly on NVMe
BIG = dict(layers=4, hidden=512, vocab=64)  # a ~19 MiB bf16 base: big enough to see in PSS
BIG_KW = dict(base_dtype="bf16", chunk_bytes="2M")


def case(kind="engine", data="plain", grad_accum=1, *, lora=None, model=None, pss=False, **engine) -> dict:
    return {"kind": kind, "data": data, "steps": STEPS, "grad_accum": grad_accum, "engine": engine,
            "lora": lora, "model": model or {}, "pss": pss}


def minimum_gpu() -> int:
    """The engine's smallest device budget for the tiny model (one rank, all chunks streamed)."""
    from tierwise.offload import Engine

    eng = Engine(tiny_llama(**TINY), budget=Budget(chunk=CHUNK), optim=Optim(lr=1e-2),
                 streaming=Streaming(allow_gpu_home=False))
    eng.step(data_for("plain", 1, rows=4)[0], grad_accum=2)
    eng.close()
    return eng.minimum_gpu_bytes


def run_two_ranks(tmp: Path) -> dict:
    """Every 2-rank case of tests/test_dist.py and tests/test_dist_lora.py in one launch, by
    name, then collectives in diverged orders ("diverged": each rank's records), then rank 1
    SIGKILLed mid-step ("dying": rank 0's record and the exit codes); "tight":
    the device budget of the tight cases."""
    tight = minimum_gpu()
    # the LoRA cases first: their PSS is measured in as fresh a process as with a launch of their own
    cases = {  # tests/test_dist_lora.py: LoRA over a frozen base
        "lora": case(lora={}),
        "peft_ddp": case("ddp", lora={}),
        "lora_masked_accum": case(data="masked", grad_accum=2, lora={}, grad_reduce="step"),  # DDP's no_sync sums
        "peft_ddp_masked_accum": case("ddp", data="masked", grad_accum=2, lora={}),
        "unshared": case(lora={}, model=BIG, pss=True, share_base=False, **BIG_KW),
        "shared": case(lora={}, model=BIG, pss=True, **BIG_KW),
        "shared_nvme": case(lora={}, cpu_mem=LORA_TIGHT, nvme=True, pss=True),
    } | {  # tests/test_dist.py
        "roomy": case(),
        "ddp": case("ddp"),
        "masked": case(data="masked"),
        "ddp_masked_accum": case("ddp", data="masked", grad_accum=2),
        "masked_accum": case(data="masked", grad_accum=2, grad_reduce="step"),
        "masked_accum_micro": case(data="masked", grad_accum=2),
        "loss_order": case(data="masked-seed4", grad_accum=2),
        "deep": case(model=DEEP),
        "tight_nvme": case(data="masked", gpu_mem=tight, cpu_mem=CPU_TIGHT, nvme=True, nvme_checksum=True),
        "nvme_accum": case(data="masked", grad_accum=2, cpu_mem=CPU_TIGHT, nvme=True),
        "adamw8bit": case(optimizer="adamw8bit", gpu_mem=tight),
        "clip": case(grad_clip=0.05),
        "mezo": case(data="masked", optimizer="mezo"),
    }
    results, record, codes = spawn_then_die(list(cases.values()), tmp)
    diverged = [torch.load(tmp / f"diverge-{r}.pt") for r in range(2)]
    return dict(zip(cases, results)) | {"tight": tight, "dying": (record, codes), "diverged": diverged}
