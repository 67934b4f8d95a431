"""`finetune` on several ranks: `--nproc-per-node 2` starts torchrun (`python -m
torch.distributed.run ... -m tierwise.cli.main`, what a user types by hand) on the quickstart
tiny model; its losses equal one rank's with --grad-accum 2 (the same micro-batches), bit for
bit; rank 0 alone prints. Checkpoints: one shard per rank, one manifest; a rank killed mid-run,
then --resume, continues exactly; another number of ranks is refused in one line. The 2-rank
run is one (killed at step 3, resumed) for all of these: each launch is seconds of imports."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
from tinyhf import error_line  # noqa: E402

from tierwise.cli.launch import FAULT_ENV, RankInfo, drop_option, from_env, node_share  # noqa: E402
from tierwise.cli.main import app  # noqa: E402

STEPS = ["--steps", "4", "--checkpoint-every", "1", "--chunk-size", "64K"]  # several chunks per rank
LAUNCH_TIMEOUT = 300


def train_losses(out: Path) -> list[float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] == "train"]


def weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(out / "model" / "model.safetensors")


def same_weights(a: Path, b: Path) -> bool:
    import torch

    x, y = weights(a), weights(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def launch(out: Path, *args: str, fault: str = "") -> subprocess.CompletedProcess:
    """`finetune --nproc-per-node 2 ...` (torchrun started for us) into `out`."""
    env = dict(os.environ)
    env.pop(FAULT_ENV, None)
    if fault:
        env[FAULT_ENV] = fault
    return subprocess.run([sys.executable, "-m", "tierwise.cli.main", "--nproc-per-node", "2", *STEPS,
                           "--output", str(out), *args], capture_output=True, text=True, cwd=out.parent,
                          timeout=LAUNCH_TIMEOUT, env=env)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """The quickstart model, 4 steps on 2 ranks, a checkpoint after each; rank 1 SIGKILLed at
    the start of step 3 (rank 0 is in it), then --resume runs steps 3-4. One run for every test
    below (a launch is mostly imports): its steps 1-2 are an uninterrupted run's, and the whole
    equals one rank's bit for bit. `killed`: a copy of the output as the kill left it."""
    base = tmp_path_factory.mktemp("dist")
    out, killed = base / "two", base / "killed"
    proc = launch(out, fault="1:3:kill")
    ended = time.time()
    shutil.copytree(out, killed)
    resumed = launch(out, "--resume")
    return {"out": out, "proc": proc, "ended": ended, "killed": killed, "resumed": resumed}


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """The reference: one rank with --grad-accum 2 (the same micro-batches), uninterrupted."""
    one = tmp_path_factory.mktemp("dist") / "one"
    result = CliRunner().invoke(app, ["--grad-accum", "2", *STEPS, "--output", str(one)])
    assert result.exit_code == 0, result.output
    return one


def test_nproc_per_node_2_equals_one_rank_with_grad_accum_2(two, one):
    proc, resumed = two["proc"], two["resumed"]
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert proc.stdout.count("warm-up step") == 1 and "2 ranks" in proc.stdout  # rank 0 only
    assert resumed.stdout.count("done: model exported") == 1
    assert train_losses(two["out"]) == train_losses(one) and len(train_losses(one)) == 4
    assert same_weights(two["out"], one)


def test_metrics_give_every_ranks_peaks_and_the_nodes(two):
    """Rank 0 writes the metrics, with each rank's ledger peaks (not rank 0's alone) and the
    node's: the sum over its ranks of host, CXL and NVMe, the largest gpu peak."""
    rows = [json.loads(x) for x in (two["out"] / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert train
    for r in train:
        ranks, node = r["rank_peak_bytes"], r["node_peak_bytes"]
        assert len(ranks) == 2 and all(ranks[0][tier] == v for tier, v in r["peak_bytes"].items())
        assert ranks[1]["host"] > 0 and node["host"] == ranks[0]["host"] + ranks[1]["host"]
        assert node["gpu"] == max(ranks[0]["gpu"], ranks[1]["gpu"])


def test_a_checkpoint_of_two_ranks_is_one_shard_per_rank_tied_by_one_manifest(two):
    out = two["out"]
    latest = out / (out / "latest").read_text().strip()
    assert latest.name == "ckpt-000004" and sorted(p.name for p in out.glob("ckpt-*")) == ["ckpt-000003", "ckpt-000004"]
    listed = json.loads((latest / "manifest.json").read_text())["files"]
    assert sorted(listed) == ["rank-0/shard.json", "rank-0/shard.safetensors", "rank-1/shard.json",
                              "rank-1/shard.safetensors", "trainer.json", "trainer.safetensors"]
    from safetensors.torch import load_file

    held = [set(load_file(latest / f"rank-{r}" / "shard.safetensors")) for r in (0, 1)]
    masters = [{int(m.group(1)) for k in h for m in [re.search(r"chunks\.(\d+)\.master#", k)] if m} for h in held]
    assert all(masters) and not masters[0] & masters[1]  # each rank the masters of its own chunks


def test_sigkill_of_one_rank_then_resume_continues_exactly(two, one, tmp_path):
    """Rank 1 SIGKILLed at the start of step 3 (rank 0 is in it): rank 0 stops with one error
    line naming rank 1, the launch ends well within the collective timeout; checkpoint 2 is complete; --resume runs steps 3-4
    with the same losses and the same final weights as the uninterrupted one-rank run, bit for bit. A
    corrupted shard of it is named by the manifest check, and a resume on another number of
    ranks is refused in one line."""
    proc, out = two["proc"], two["killed"]
    assert proc.returncode != 0
    killed = float(re.search(r"kills itself at t=([0-9.]+)", proc.stderr).group(1))
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: rank 0: ") and "rank 1 stopped" in errors[0], proc.stderr
    assert two["ended"] - killed < 30.0, two["ended"] - killed  # well within the collective timeout (60 s); measured 7 s
    assert (out / "latest").read_text().strip() == "ckpt-000002" and not list(out.glob("ckpt-*.tmp"))

    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    shard = bad / "ckpt-000002" / "rank-1" / "shard.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x40
    shard.write_bytes(bytes(data))
    refused = launch(bad, "--resume")
    assert refused.returncode == 2, refused.stderr  # every rank a user error: exit 2, no torchrun summary
    assert "FAILED" not in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
    assert "error: rank 1: checkpoint " in refused.stderr and "rank-1/shard.safetensors is corrupted" in refused.stderr

    line = error_line(CliRunner().invoke(app, [*STEPS, "--output", str(out), "--resume"]))
    assert "ckpt-000002" in line and "written by 2 ranks, this run has 1 rank" in line
    line = error_line(CliRunner().invoke(app, ["--nproc-per-node", "3", *STEPS, "--output", str(out), "--resume"]))
    assert "written by 2 ranks, this run has 3 ranks: resharding a checkpoint is not built" in line

    resumed = two["resumed"]
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from ckpt-000002" in resumed.stdout
    assert train_losses(two["out"]) == train_losses(one)
    assert same_weights(two["out"], one)


def test_a_rank_that_raises_stops_the_others_promptly_naming_it_and_its_cause(tmp_path):
    """Rank 1 raises at the start of step 2 (rank 0 waits in it): rank 0 stops too, with one
    error line naming rank 1 and its exception, and the launch ends within 10 s of the raise
    (before: rank 0 named rank 1 but not why, and hung in its teardown until torchrun's SIGTERM,
    11 s on a loaded machine)."""
    proc = launch(tmp_path / "raised", fault="1:2:raise")
    ended = time.time()
    assert proc.returncode != 0
    raised = float(re.search(r"at t=([0-9.]+)\)", proc.stderr).group(1))
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1, proc.stderr
    assert errors[0].startswith("error: rank 1 failed: RuntimeError: injected failure at step 2"), errors
    assert ended - raised < 10.0, ended - raised


def test_a_checkpoint_of_one_rank_is_not_resumed_on_two(tmp_path):
    result = CliRunner().invoke(app, ["--steps", "1", "--output", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    line = error_line(CliRunner().invoke(app, ["--nproc-per-node", "2", "--steps", "2", "--output",
                                              str(tmp_path / "o"), "--resume"]))
    assert "ckpt-000001" in line and "written by 1 rank, this run has 2 ranks" in line


def test_node_budgets_are_divided_among_local_ranks():
    info = from_env({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert info == RankInfo(rank=3, world=4, local_rank=1, local_world=2)
    assert node_share(64 << 30, info) == 32 << 30 and node_share(None, info) is None
    assert from_env({}) == RankInfo()
    assert drop_option(["--steps", "3", "--nproc-per-node", "2", "--nproc-per-node=4", "-x"],
                       "--nproc-per-node") == ["--steps", "3", "-x"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_loopback_equal_one_node_of_two_ranks_and_each_node_loads_its_base(tmp_path):
    """Two torchrun launches with --nnodes 2 --node-rank 0/1 (one rank each, a loopback
    rendezvous), LoRA: the same losses as --nproc-per-node 2 on one node, bit for bit; each node
    has 1 local rank (its --cpu-mem whole) and loads its own base, so rank 0 books the whole base
    in host memory (a node of two books half)."""
    args = ["--steps", "3", "--lora-rank", "4", "--cpu-mem", "64M"]
    port, nodes = free_port(), tmp_path / "nodes"
    env = dict(os.environ, LOGLEVEL="ERROR", OMP_NUM_THREADS="1")
    env.pop(FAULT_ENV, None)
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                               "--node-rank", str(r), "--master-addr", "127.0.0.1", "--master-port", str(port),
                               "-m", "tierwise.cli.main", *args, "--output", str(nodes)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path, env=env)
             for r in (0, 1)]
    outs = [p.communicate(timeout=LAUNCH_TIMEOUT)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "2 ranks (1 on this node)" in outs[0]
    one = tmp_path / "one"
    proc = subprocess.run([sys.executable, "-m", "tierwise.cli.main", "--nproc-per-node", "2", *args, "--output", str(one)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=LAUNCH_TIMEOUT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert train_losses(nodes) == train_losses(one) and len(train_losses(one)) == 3
    host = [json.loads((d / "metrics.jsonl").read_text().splitlines()[0])["peak_bytes"]["host"] for d in (nodes, one)]
    assert host[0] > host[1], host  # measured 626,688 vs 378,880 B: the whole base vs half of it


@pytest.mark.parametrize("case", ["node-budget", "bad-data", "output-not-empty", "nonfinite"])
def test_a_node_budget_too_small_for_its_ranks_is_refused_by_all_in_one_line(tmp_path, case):
    """Two ranks started as torchrun starts them (its variables, one process each, no agent: each
    rank's exit code is its own), with a --cpu-mem one rank alone runs in (its chunks gpu-home)
    but two ranks cannot share: the pre-flight prices the node for both and refuses before
    anything is allocated: one line, on rank 0 only, exit 2 on both, neither left waiting for
    the other (which would take the 60 s collective timeout). An input every rank refuses
    alike (a bad --data line) is the same one line (before: one per rank), and so is a
    non-empty --output, which rank 0 alone claims (before: rank 0 exited, and rank 1 only when
    SIGTERMed), and a nan loss, which every rank sees at the same step (before: two lines)."""
    env = dict(os.environ, WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    env.pop(FAULT_ENV, None)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": broken\n')
    given = {"node-budget": ["--cpu-mem", "1M"], "bad-data": ["--data", str(bad)],
             "nonfinite": ["--steps", "3", "--optimizer", "sgd", "--lr", "1e10"]}.get(case, [])
    if case == "output-not-empty":
        (tmp_path / "o").mkdir()
        (tmp_path / "o" / "notes.txt").write_text("mine")
    args = [sys.executable, "-m", "tierwise.cli.main", "--steps", "1", *given, "--output", str(tmp_path / "o")]
    procs = [subprocess.Popen(args, env=env | {"RANK": str(r), "LOCAL_RANK": str(r)}, cwd=tmp_path, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in (0, 1)]
    ended: dict[int, float] = {}
    deadline = time.time() + LAUNCH_TIMEOUT
    while len(ended) < 2 and time.time() < deadline:
        ended |= {r: time.time() for r, p in enumerate(procs) if r not in ended and p.poll() is not None}
        time.sleep(0.05)
    outs = [p.communicate(timeout=5) if r in ended else (p.kill(), p.communicate())[1] for r, p in enumerate(procs)]
    assert [p.returncode for p in procs] == [2, 2], outs
    assert abs(ended[0] - ended[1]) < 30.0, ended
    errors = [[ln for ln in err.splitlines() if ln.strip()] for _, err in outs]
    assert len(errors[0]) == 1 and errors[1] == [] and outs[1][0] == "", outs
    if case == "nonfinite":  # every rank's summed loss is nan at the same step: one line, not two
        assert errors[0][0].startswith("error: step ") and "nan" in errors[0][0], errors
        return
    if case == "output-not-empty":
        assert errors[0][0] == f"error: rank 0: output directory {tmp_path / 'o'} is not empty: pass --resume to " \
                               "continue its run or --overwrite to replace it", errors
        assert [p.name for p in (tmp_path / "o").iterdir()] == ["notes.txt"]
        return
    assert not (tmp_path / "o").exists()  # refused before --output was claimed
    if case == "bad-data":
        assert errors[0][0] == f"error: {bad}:2: bad JSON: Expecting value (column 10, near '{{\"text\": broken')", \
            errors
        return
    assert errors[0][0].startswith("error: node host budget 1.00 MiB cannot hold 2 ranks' own chunks"), errors
    assert "`finetune plan --nproc-per-node 2` with the same model" in errors[0][0]
    assert not (tmp_path / "o").exists()  # refused before --output was claimed
    # one rank with the same budget runs: the refusal is the node's, shared by two
    assert "verdict: fits" in CliRunner().invoke(app, ["plan", "--cpu-mem", "1M"]).output


def test_a_killed_ranks_scratch_directory_is_removed_by_the_next_run(tmp_path):
    """Ranks other than 0 write into a scratch directory removed at the end; one whose process
    was SIGKILLed is left behind, and the next rank's start removes it (its pid is gone), never
    a live process's or a directory of another name."""
    import subprocess as sp

    from tierwise.cli.launch import SCRATCH_PREFIX, rank_scratch

    dead = sp.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"{SCRATCH_PREFIX}1-p{dead.pid}-abc"
    live = tmp_path / f"{SCRATCH_PREFIX}1-p{os.getpid()}-def"
    other = tmp_path / "tierwise-rank-notes"
    for d in (stale, live, other):
        d.mkdir()
        (d / "metrics.jsonl").write_text("{}")
    with rank_scratch(1, str(tmp_path)) as mine:
        assert mine.is_dir() and mine.name.startswith(f"{SCRATCH_PREFIX}1-p{os.getpid()}-")
        assert not stale.exists() and live.exists() and other.exists()
    assert not mine.exists() and live.exists() and other.exists()
