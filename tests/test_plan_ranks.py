"""The planner with several ranks (offload.plan.ranks) against the engine's layout and against
2 gloo ranks: bytes per rank and per node, the frozen base once per node, the node budget
divided among local ranks, collective bytes per step measured vs planned, and the multi-GPU
hardware profiles' [node] table (bad values: one-line errors, exit 2 from the CLI)."""

import importlib
import sys
from pathlib import Path

import pytest

from tierwise.offload.core.errors import InfeasibleBudget, TierwiseError
from tierwise.offload.plan.planner import make_plan
from tierwise.profiles import FieldValueError, UnknownFieldError, load_hardware_profile

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(model="tiny", hardware="cpu-sim", gpu_mem=None, optimizer="adamw", precision="fp32", batch_size=2,
            seq_len=16, chunk_bytes=16 << 10)
QLORA_70B = dict(model="70b", hardware="2x-rtx4090-128g", gpu_mem="24G", optimizer="adamw", precision="bf16",
                 batch_size=1, seq_len=2048, lora_rank=16, base_dtype="nf4", double_quant=True, suggest=False)


def test_multi_gpu_profiles_load_with_their_node_table():
    two = load_hardware_profile("2x-rtx4090-128g")
    assert (two.gpus_per_node, two.node.gpu_link, two.host.memory, two.node.network_gbps) == (2, "host", 128 << 30, None)
    assert two.gpu.memory == 24 << 30 and two.pcie.gen == 4
    eight = load_hardware_profile("8x-rtx4090-nvme")
    assert eight.gpus_per_node == 8 and eight.nvme is not None and eight.gpu.memory == 24 << 30
    dgx = load_hardware_profile("8x-a100-80g-1t-nvme")
    assert (dgx.gpus_per_node, dgx.node.gpu_link, dgx.host.memory) == (8, "nvlink", 1 << 40)
    assert dgx.node.network_gbps > 0 and dgx.nvme is not None
    assert load_hardware_profile("rtx4090").gpus_per_node == 1


@pytest.mark.parametrize("node, error, message", [
    ('gpus = 2\ngpu_link = "infiniband"\ngpu_link_gbps = 12', FieldValueError,
     "field 'node.gpu_link' must be one of nvlink, pcie, host, got 'infiniband'"),
    ('gpus = 0\ngpu_link = "host"\ngpu_link_gbps = 12', FieldValueError, "field 'node.gpus' must be > 0, got 0"),
    ('gpus = 2\ngpu_link = "host"\ngpu_link_gbps = 12\nnetwork_gbps = -1', FieldValueError,
     "field 'node.network_gbps' must be > 0, got -1.0"),
    ('gpus = 2\ngpu_link = "host"\ngpu_link_gbps = 12\nnvlinks = 4', UnknownFieldError,
     "unknown field 'node.nvlinks'"),
], ids=["link-choice", "zero-gpus", "negative-network", "unknown-key"])
def test_bad_node_table_is_a_one_line_error_and_exit_2(tmp_path, node, error, message):
    path = tmp_path / "hw.toml"
    path.write_text((ROOT / "profiles/hardware/rtx4090.toml").read_text() + f"\n[node]\n{node}\n")
    with pytest.raises(error) as info:
        load_hardware_profile(path)
    assert message in str(info.value) and "\n" not in str(info.value)
    from typer.testing import CliRunner

    from tierwise.cli.main import app

    out = CliRunner().invoke(app, ["plan", "--model", "tiny", "--hardware", str(path), "--nproc-per-node", "2"])
    assert out.exit_code == 2 and message in out.output


def test_layouts_the_profile_or_engine_cannot_run_are_refused():
    with pytest.raises(TierwiseError, match="'rtx4090' has 1 GPU per node"):
        make_plan(**(TINY | {"hardware": "rtx4090"}), cpu_mem=None, nproc_per_node=2)
    with pytest.raises(TierwiseError, match="states no network between nodes"):
        make_plan(**(QLORA_70B | {"cpu_mem": "64G"}), nproc_per_node=2, nnodes=2)
    with pytest.raises(TierwiseError, match="galore is not supported with several ranks"):
        make_plan(**(TINY | {"optimizer": "galore"}), cpu_mem=None, nproc_per_node=2)


def test_bytes_per_rank_and_per_node_follow_the_engines_layout():
    one = make_plan(**TINY, cpu_mem=None)
    two = make_plan(**TINY, cpu_mem=None, nproc_per_node=2)
    trainable = sum(c.params for c in one.chunk_homes)
    r = two.ranks
    assert sum(r.owned_params) == trainable and min(r.owned_params) > 0
    # every chunk's kinds once (its owner's) and each rank's window for the others' gradients,
    # one micro-batch at a time (owned-only gradients, the default)
    kinds = sum(sum(one.bytes[t].values()) for t in ("gpu", "host", "cxl", "nvme"))
    window = r.grad_bytes[0] - 4 * r.owned_params[0]
    assert window == r.grad_bytes[1] - 4 * r.owned_params[1] > 0 and r.grad_reduce == "micro"
    assert r.node["host"] == kinds + 2 * window == sum(r.private_host)
    assert two.peak["host"] == r.node["host"] and two.bytes["gpu"]["master"] == 0  # nothing trainable gpu-home
    assert r.reduce_bytes == 4 * trainable
    # grad_reduce="step": each rank keeps fp32 gradients of the others' chunks too
    step = make_plan(**TINY, cpu_mem=None, nproc_per_node=2, grad_reduce="step").ranks
    others = sum(4 * trainable - 4 * p for p in step.owned_params)
    assert step.node["host"] == kinds + others == sum(step.private_host)
    assert step.grad_bytes == [4 * trainable] * 2 and step.reduce_bytes == 4 * trainable
    # two micro-batches per rank: "micro" reduces twice, "step" once
    assert make_plan(**(TINY | {"grad_accum": 2}), cpu_mem=None, nproc_per_node=2).ranks.reduce_bytes == 8 * trainable
    assert make_plan(**(TINY | {"grad_accum": 2}), cpu_mem=None, nproc_per_node=2,
                     grad_reduce="step").ranks.reduce_bytes == 4 * trainable


def test_the_frozen_base_is_held_once_per_node_whatever_the_gpu_count():
    one = make_plan(**QLORA_70B, cpu_mem="64G")
    two = make_plan(**QLORA_70B, cpu_mem="64G", nproc_per_node=2)
    eight = make_plan(**(QLORA_70B | {"hardware": "8x-rtx4090-nvme"}), cpu_mem="64G", nproc_per_node=8)
    base = sum(one.bytes[t].get("base", 0) for t in ("gpu", "host"))  # one rank keeps a few chunks on the gpu
    assert base > 30 << 30
    assert two.ranks.base["host"] == eight.ranks.base["host"] == base == two.bytes["host"]["base"]
    assert two.ranks.node["host"] == base + sum(two.ranks.private_host) <= 64 << 30


def test_node_budget_is_divided_among_local_ranks_and_the_named_minimum_fits():
    two = make_plan(**TINY, cpu_mem=None, nproc_per_node=2)
    need = two.ranks.node["host"]
    with pytest.raises(InfeasibleBudget, match="node host budget") as info:
        make_plan(**TINY, cpu_mem=need - 1, nproc_per_node=2)
    assert info.value.minimum["host"] == two.host_minimum
    assert make_plan(**TINY, cpu_mem=info.value.minimum["host"], nproc_per_node=2).ranks.node["host"] <= \
        info.value.minimum["host"]
    # with NVMe: each rank's own bytes within its share, the shares within the node's budget
    budget = need * 4 // 5
    nv = make_plan(**TINY, cpu_mem=budget, nvme_path="/nvme", nproc_per_node=2)
    assert nv.ranks.node["nvme"] > 0 and nv.ranks.node["host"] <= budget
    assert all(p <= s for p, s in zip(nv.ranks.private_host, nv.ranks.host_shares))
    assert sum(nv.ranks.host_shares) <= budget


def test_host_resources_are_shared_by_the_local_ranks():
    from tierwise.offload.plan.ranks import rank_share

    hw = load_hardware_profile("8x-a100-80g-1t-nvme")
    share = rank_share(hw, 8)
    assert share.host.dram_bandwidth_gbps == hw.host.dram_bandwidth_gbps / 8
    assert share.nvme.read_gbps == hw.nvme.read_gbps / 8 and share.host.cpu_cores == hw.host.cpu_cores // 8
    assert share.gpu == hw.gpu and share.pcie == hw.pcie  # each rank its own GPU and link


def test_two_gpus_plan_at_least_1_8x_one_for_70b_qlora():
    two = make_plan(**QLORA_70B, cpu_mem="64G", nproc_per_node=2)
    assert two.tokens_per_s >= 1.8 * two.ranks.single_tokens_per_s


@pytest.fixture(scope="module")
def measured():
    """Collective payload per rank per step on 2 gloo ranks (bench/collective_bytes.py): one
    process launch, two cases -- a roomy device (each chunk gathered once a step) and a tight
    one in bf16 with 2 micro-batches per rank (chunks gathered again)."""
    sys.path.insert(0, str(ROOT / "bench"))  # the spawned ranks import it by name too
    try:
        cb = importlib.import_module("collective_bytes")
        cases = [dict(precision="fp32", checkpointing=True, grad_accum=1, gpu_mem=None),
                 dict(precision="bf16", checkpointing=True, grad_accum=2, gpu_mem="tight")]
        yield cb, cb.measure(cases, steps=1, start_method="fork")
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_collective_bytes_planned_within_10_percent_of_measured_and_below_zero3(measured):
    cb, results = measured
    params = sum(p.numel() for p in cb.build().parameters())
    for r in results:
        assert r["ranks_agree"]
        gather, reduce = cb.planned(r)
        assert reduce == r["grads"]  # fp32 gradients, once per step: exact
        total = r["gather"] + r["grads"]
        assert abs((gather + reduce) / total - 1) <= 0.10, (r, gather, reduce)
        zero3 = cb.zero3_bytes(params=params, precision=r["precision"], micro_batches=r["grad_accum"],
                               recompute=r["checkpointing"])
        assert total < zero3, (total, zero3)  # recompute: each layer gathered once for recompute + backward
    roomy = results[0]
    assert roomy["gather"] == 4 * params  # the cache keeps every chunk from the first forward to the update


def test_readme_multi_gpu_plan_sample_is_what_plan_prints():
    import re
    import shlex

    from typer.testing import CliRunner

    from tierwise.cli.main import app

    text = (ROOT / "docs" / "multi-gpu.md").read_text()
    m = re.search(r"```\n\$ (finetune plan [^\n]*--nproc-per-node 2[^\n]*\\\n[^\n]*)\n(.*?)```", text, re.S)
    assert m, "README's multi-GPU plan sample"
    r = CliRunner().invoke(app, shlex.split(m.group(1).replace("\\\n", " "))[1:], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert r.stdout == m.group(2)


def test_dry_run_plans_the_ranks(tmp_path):
    from typer.testing import CliRunner

    from tierwise.cli.main import app

    r = CliRunner().invoke(app, ["--dry-run", "--nproc-per-node", "2", "--output", str(tmp_path / "run")],
                           env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "ranks: 2 (2 per node x 1 node)" in r.output and "collectives per rank per step" in r.output


def test_the_preflight_of_started_ranks_prices_their_node_on_any_profile():
    """Training under torchrun (cli.planning.started_ranks): the ranks it started are priced,
    L per node, on the profile the run names even when its [node] table has fewer GPUs or no
    network: the pre-flight checks bytes; `plan` of the same layout on that profile refuses."""
    import dataclasses

    from tierwise.cli.config import TrainConfig
    from tierwise.cli.launch import RankInfo
    from tierwise.cli.planning import make_plan as cli_plan

    cfg = TrainConfig(model="tiny", hardware="rtx4090", gpu_mem="1G", cpu_mem="64M", seq_len=16, batch_size=2,
                      chunk_size="16K")
    started = RankInfo(rank=0, world=4, local_rank=0, local_world=2)  # 2 nodes of 2 ranks
    with pytest.raises(TierwiseError, match="has 1 GPU per node"):
        cli_plan(dataclasses.replace(cfg, nproc_per_node=2, nnodes=2), ranks=True)
    plan = cli_plan(cfg, ranks=started)
    assert (plan.ranks.nproc_per_node, plan.ranks.nnodes) == (2, 2)
    one_node = cli_plan(cfg, ranks=dataclasses.replace(started, world=2))  # each rank owns more
    assert sum(plan.ranks.owned_params) < sum(one_node.ranks.owned_params)
    need = one_node.ranks.node["host"]
    with pytest.raises(InfeasibleBudget, match="node host budget"):
        cli_plan(dataclasses.replace(cfg, cpu_mem=f"{need // 2}B"), ranks=dataclasses.replace(started, world=2))


def test_a_node_refusal_says_when_uneven_ownership_decides_it():
    """The node's host budget is split evenly among its ranks, but chunks are owned whole (k mod
    N): a model of one chunk at the default size leaves rank 1 nothing, so rank 0's share decides
    the refusal, which says so and that a smaller --chunk-size evens it out; chunks spread evenly
    over the ranks: no such hint."""
    from typer.testing import CliRunner

    from tierwise.cli.main import app

    one = CliRunner().invoke(app, ["plan", "--nproc-per-node", "2", "--cpu-mem", "2500K"])
    assert one.exit_code == 2 and "1 trainable chunk on 2 ranks, 1/0 per rank; a smaller --chunk-size" in one.output
    many = CliRunner().invoke(app, ["plan", "--nproc-per-node", "2", "--cpu-mem", "1K", "--chunk-size", "16K"])
    assert many.exit_code == 2 and "cannot hold" in many.output and "--chunk-size evens" not in many.output


def test_node_host_budget_follows_each_ranks_minimum(tmp_path):
    """A tiny Llama with a 49,152-word vocabulary on 2 ranks with NVMe: the rank that owns the
    embedding needs far more host RAM than the other. The node's minimum is the sum of the ranks'
    minimums (within 2x of one streamed rank's), not twice the larger one; the suggested budget's
    peak reaches that minimum; each rank's share holds what that rank uses, and the shares add up
    to the node's budget at most."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    run = dict(model=cfg, hardware="cpu-sim", optimizer="adamw", precision="fp32", batch_size=4,
               seq_len=128, chunk_bytes=32 << 10, nvme_path=str(tmp_path), padded=True)
    with pytest.raises(InfeasibleBudget) as one:  # one rank, every chunk streamed (its minimum: 145 MiB, the tiled loss's mostly)
        make_plan(**run, gpu_mem="150M", cpu_mem="600K")
    with pytest.raises(InfeasibleBudget) as two:
        make_plan(**run, gpu_mem=None, cpu_mem="600K", nproc_per_node=2)
    single, node = one.value.minimum["host"], two.value.minimum["host"]
    assert node <= 2 * single, (node, single)  # was 2.2x: twice the embedding owner's share
    plan = make_plan(**run, gpu_mem=None, cpu_mem=node, nproc_per_node=2)
    assert plan.peak["host"] >= node * 0.95 and plan.host_minimum == node
    shares = plan.ranks.host_shares
    assert sum(shares) <= node and shares[0] > 4 * shares[1]  # rank 0 owns the embedding
    assert all(s >= used for s, used in zip(shares, plan.ranks.private_host))
    with pytest.raises(InfeasibleBudget):
        make_plan(**run, gpu_mem=None, cpu_mem=node - (1 << 20), nproc_per_node=2)
