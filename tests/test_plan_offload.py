"""Offloaded activations, planned and measured: recomputed blocks' inputs in host memory
(Activations(offload=True)); the planner's device activations and host reserve are the engine's
measured peaks within 10%, and the host budget keeps room for them beside the chunks' homes."""

from __future__ import annotations

import pytest
import torch
import transformers

from tierwise.offload import Activations, Budget, Engine, Optim, Precision
from tierwise.offload.plan.perfmodel import activation_bytes, activation_parts
from tierwise.offload.plan.planner import make_plan
from tierwise.profiles import ModelProfile

PROFILE = ModelProfile(name="deep", family="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=512,
                       rope_theta=10000.0, rms_norm_eps=1e-5)
CHUNK = 64 << 10


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute", [True, 3], ids=["all", "first-3-of-6"])
def test_offloaded_inputs_are_planned_as_measured(precision, recompute):
    """Every layer recomputed, or the first 3 of 6 (only their inputs are offloaded)."""
    batch, seq = 2, 256
    plan = make_plan(model=PROFILE, hardware="cpu-sim", gpu_mem="64G", cpu_mem="64G", optimizer="adamw",
                     precision=precision, batch_size=batch, seq_len=seq, chunk_bytes=CHUNK, checkpointing=recompute,
                     offload_activations=True)
    parts = activation_parts(model=PROFILE, batch_size=batch, seq_len=seq, precision=precision,
                             checkpointing=recompute, offload=True)
    kept = activation_bytes(model=PROFILE, batch_size=batch, seq_len=seq, precision=precision,
                            checkpointing=recompute)
    assert parts["host_inputs"] > 0 and plan.reserve["host"]["activations"] == parts["host_inputs"]
    assert plan.reserve["gpu"]["activations"] < kept  # the device holds less than without offload
    torch.manual_seed(0)
    eng = Engine(transformers.LlamaForCausalLM(PROFILE.to_hf_config()), budget=Budget(chunk=CHUNK),
                 optim=Optim(lr=1e-4), precision=Precision(precision),
                 activations=Activations(recompute=recompute, offload=True))
    x = torch.randint(0, PROFILE.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    eng.step({"input_ids": x, "labels": x})
    gpu, host = eng.ledger.kind_peak("gpu", "activation"), eng.ledger.kind_peak("host", "activation")
    eng.close()
    assert host == pytest.approx(parts["host_inputs"], rel=0.10)
    # never more than the plan books (the placement spends the rest: more would fail the step);
    # fp32 to the byte (the recompute's first norm saves the fetched input itself: booked once)
    assert gpu <= plan.reserve["gpu"]["activations"] and gpu == pytest.approx(plan.reserve["gpu"]["activations"], rel=0.10)
    if precision == "fp32":
        assert gpu == plan.reserve["gpu"]["activations"]


def test_the_host_budget_keeps_room_for_them():
    """A host budget that holds the chunks but not them too is refused by the plan, naming both;
    the engine given the plan's reserve trains inside a budget that holds both."""
    common = dict(model=PROFILE, hardware="cpu-sim", gpu_mem="64G", optimizer="adamw", precision="fp32",
                  batch_size=2, seq_len=256, chunk_bytes=CHUNK, checkpointing=True)
    roomy = make_plan(cpu_mem="64G", offload_activations=True, **common)
    need = roomy.reserve["host"]["activations"]
    chunks = make_plan(cpu_mem="64G", **common).host_minimum
    from tierwise.offload.core.errors import InfeasibleBudget

    with pytest.raises(InfeasibleBudget, match="offloaded activations"):
        make_plan(cpu_mem=chunks + need // 2, offload_activations=True, **common)
    fits = make_plan(cpu_mem=chunks + need + (64 << 10), offload_activations=True, **common)
    torch.manual_seed(0)
    eng = Engine(transformers.LlamaForCausalLM(PROFILE.to_hf_config()),
                 budget=Budget(chunk=CHUNK, cpu=fits.budgets["host"]), optim=Optim(lr=1e-4),
                 activations=Activations(recompute=True, offload=True, host=need,
                                         expected=fits.reserve["gpu"]["activations"]))
    x = torch.randint(0, PROFILE.vocab_size, (2, 256), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        eng.step({"input_ids": x, "labels": x})
    assert eng.ledger.peaks()["host"] <= fits.budgets["host"]
    eng.close()


def test_a_host_too_small_for_them_puts_them_in_cxl_memory():
    """The same host budget (chunks + half the inputs), now with a CXL tier: the plan puts the
    offloaded inputs in CXL memory (the cxl reserve, beside the chunks' homes there); the engine
    given that reserve trains inside every budget, its CXL activations the planned bytes, its
    losses and weights those of the run that offloads to host RAM."""
    common = dict(model=PROFILE, hardware="h200-cxl", cuda=False, gpu_mem="64G", optimizer="adamw",
                  precision="fp32", batch_size=2, seq_len=256, chunk_bytes=CHUNK, checkpointing=True)
    need = make_plan(cpu_mem="64G", offload_activations=True, **common).reserve["host"]["activations"]
    chunks = make_plan(cpu_mem="64G", **common).host_minimum
    plan = make_plan(cpu_mem=chunks + need // 2, cxl_mem=need + (256 << 10), offload_activations=True, **common)
    assert plan.reserve["cxl"]["activations"] == need and "activations" not in plan.reserve["host"]
    x = torch.randint(0, PROFILE.vocab_size, (2, 256), generator=torch.Generator().manual_seed(0))
    runs = []
    for where in ("cxl", "host"):
        torch.manual_seed(0)
        budget = (Budget(chunk=CHUNK, cpu=plan.budgets["host"], cxl=plan.budgets["cxl"]) if where == "cxl" else
                  Budget(chunk=CHUNK))
        eng = Engine(transformers.LlamaForCausalLM(PROFILE.to_hf_config()), budget=budget, optim=Optim(lr=1e-4),
                     activations=Activations(recompute=True, offload=True, expected=plan.reserve["gpu"]["activations"],
                                             **({"cxl": need} if where == "cxl" else {"host": need})))
        losses = [eng.step({"input_ids": x, "labels": x}) for _ in range(2)]
        if where == "cxl":
            peaks = eng.ledger.peaks()
            assert peaks["host"] <= plan.budgets["host"] and peaks["cxl"] <= plan.budgets["cxl"]
            assert eng.ledger.kind_peak("cxl", "activation") == need
            assert eng.ledger.kind_peak("host", "activation") == 0
        runs.append((losses, {n: p.detach().clone() for n, p in eng.named_parameters_fp32()}))
        eng.close()
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][n], w) for n, w in runs[1][1].items())


def test_a_host_too_small_for_them_writes_them_to_nvme(tmp_path):
    """The same host budget (chunks + half the inputs), no CXL, an NVMe swap directory: the plan
    writes the offloaded inputs there (the nvme reserve), through two host buffers (the host
    reserve); the engine given those reserves trains inside the host budget, its NVMe and host
    activations the planned bytes, its losses and weights those of the run that offloads to host
    RAM; and the swap files are gone once it closes."""
    common = dict(model=PROFILE, hardware="cpu-sim", gpu_mem="64G", optimizer="adamw",
                  precision="fp32", batch_size=2, seq_len=256, chunk_bytes=CHUNK, checkpointing=True)
    need = make_plan(cpu_mem="64G", offload_activations=True, **common).reserve["host"]["activations"]
    chunks = make_plan(cpu_mem="64G", **common).host_minimum
    swap = tmp_path / "swap"
    plan = make_plan(cpu_mem=chunks + need // 2, nvme_path=str(swap), offload_activations=True, **common)
    staging = 2 * 2 * 256 * PROFILE.hidden_size * 4  # two block inputs, fp32
    assert plan.reserve["nvme"]["activations"] == need and plan.reserve["host"]["activations"] == staging
    assert plan.host_minimum <= plan.budgets["host"]
    x = torch.randint(0, PROFILE.vocab_size, (2, 256), generator=torch.Generator().manual_seed(0))
    runs = []
    for where in ("nvme", "host"):
        torch.manual_seed(0)
        budget = (Budget(chunk=CHUNK, cpu=plan.budgets["host"], nvme=str(swap)) if where == "nvme" else
                  Budget(chunk=CHUNK))
        eng = Engine(transformers.LlamaForCausalLM(PROFILE.to_hf_config()), budget=budget, optim=Optim(lr=1e-4),
                     activations=Activations(recompute=True, offload=True, expected=plan.reserve["gpu"]["activations"],
                                             **({"nvme": need, "host": staging} if where == "nvme" else {"host": need})))
        losses = [eng.step({"input_ids": x, "labels": x}) for _ in range(3)]
        if where == "nvme":
            assert eng.ledger.peaks()["host"] <= plan.budgets["host"]
            assert eng.ledger.kind_peak("nvme", "activation") == need
            assert eng.ledger.kind_peak("host", "activation") == staging
            assert not eng.ledger.usage()["nvme"].get("activation")  # every input read back and dropped
        runs.append((losses, {n: p.detach().clone() for n, p in eng.named_parameters_fp32()}))
        eng.close()
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][n], w) for n, w in runs[1][1].items())
    assert not swap.exists() or not any(swap.rglob("*.swp"))


def test_without_room_anywhere_the_refusal_names_every_tier():
    common = dict(model=PROFILE, hardware="cpu-sim", gpu_mem="64G", optimizer="adamw",
                  precision="fp32", batch_size=2, seq_len=256, chunk_bytes=CHUNK, checkpointing=True)
    from tierwise.offload.core.errors import InfeasibleBudget

    with pytest.raises(InfeasibleBudget, match="raise --cpu-mem, or give --cxl-mem or --nvme-path"):
        make_plan(cpu_mem="64K", offload_activations=True, **common)


def test_several_ranks_book_each_ranks_offloaded_inputs_on_the_node():
    common = dict(model=PROFILE, hardware="2x-rtx4090-128g", gpu_mem="64G", cpu_mem="64G", optimizer="adamw",
                  precision="bf16", batch_size=2, seq_len=256, chunk_bytes=CHUNK, checkpointing=True)
    one = make_plan(offload_activations=True, **common)
    two = make_plan(offload_activations=True, nproc_per_node=2, **common)
    assert two.reserve["host"]["activations"] == 2 * one.reserve["host"]["activations"] > 0
    assert two.budgets["host"] == one.budgets["host"]
    assert two.peak["host"] >= two.reserve["host"]["activations"]
