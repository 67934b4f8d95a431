"""The engine against plain PyTorch: same seed and data, same losses and final weights."""

import copy
import math

import pytest
import torch

from tierwise.offload import Activations, Budget, Engine, InfeasibleBudget, Optim, flat_options
from tierwise.offload.runtime.storage import storage_key
from tests.models import accumulate, batches, masked_batches, tiny_llama, train_reference

CHUNK = 16 << 10  # small chunks so a 4-layer toy model spans ~30 of them


def run_engine(model, data, *, gpu_mem=None, grad_accum=1, **kw):
    eng = Engine(model, **flat_options(lr=1e-3, gpu_mem=gpu_mem, chunk_bytes=CHUNK, **kw))
    losses = [eng.step(b, grad_accum=grad_accum) for b in data]
    return eng, losses


def weights_equal(eng, ref):
    mine = dict(eng.named_parameters_fp32())
    return all(torch.equal(mine[n], p.detach()) for n, p in ref.named_parameters())


@pytest.fixture(scope="module")
def reference():
    data = batches(10)
    losses, ref = train_reference(tiny_llama(), data)
    probe, _ = run_engine(tiny_llama(), data[:1])  # measures the smallest accepted budget
    return data, losses, ref, probe.minimum_gpu_bytes


@pytest.mark.parametrize("budget", ["roomy", "half", "quarter", "minimum"])
def test_bit_exact_with_pytorch_at_every_budget(reference, budget):
    data, ref_losses, ref, minimum = reference
    model_bytes = sum(p.numel() for p in ref.parameters()) * 4
    gpu = {"roomy": 64 * model_bytes, "half": model_bytes // 2 + minimum,
           "quarter": model_bytes // 4 + minimum, "minimum": minimum}[budget]
    eng, losses = run_engine(tiny_llama(), data, gpu_mem=gpu)
    assert losses == ref_losses
    assert weights_equal(eng, ref)
    assert eng.ledger.peaks()["gpu"] <= gpu
    if budget == "roomy":
        assert len(eng.device_plan.gpu_home) == len(eng.plan.chunks) and eng.cache.fetches < 100
    if budget == "minimum":
        assert not eng.device_plan.gpu_home and eng.cache.prefetches > 0


def test_grad_accumulation_and_clipping_bit_exact():
    data = batches(6, batch=8)
    ref_losses, ref = train_reference(tiny_llama(), data, grad_accum=4, clip=0.05)
    probe, _ = run_engine(tiny_llama(), data[:1], grad_accum=4, grad_clip=0.05)
    eng, losses = run_engine(tiny_llama(), data, gpu_mem=probe.minimum_gpu_bytes, grad_accum=4, grad_clip=0.05)
    assert losses == ref_losses
    assert weights_equal(eng, ref)
    assert eng.ledger.peaks()["gpu"] <= probe.minimum_gpu_bytes


def test_masked_micro_batches_weigh_by_their_target_tokens():
    """Prompt-masked, variable-length rows: a step of 2 micro-batches is normalised by the
    step's target tokens (transformers' gradient-accumulation fix), not the mean of the two
    micro-batch means. Bit-exact with the token-weighted reference; and its loss and first
    update equal those of the whole batch in one piece (plain HF loss), to fp32 rounding."""
    data = masked_batches(3, batch=4, seq=12, vocab=64)
    model = tiny_llama(layers=2, hidden=32, vocab=64)
    ref_losses, ref = train_reference(model, data, grad_accum=2)
    eng, losses = run_engine(tiny_llama(layers=2, hidden=32, vocab=64), data, gpu_mem="4M", grad_accum=2)
    assert losses == ref_losses
    assert weights_equal(eng, ref)
    whole = tiny_llama(layers=2, hidden=32, vocab=64)
    assert abs(whole(**data[0]).loss.item() - losses[0]) <= 1e-6 * abs(losses[0])
    halves = [{k: v.chunk(2)[i] for k, v in data[0].items()} for i in range(2)]
    mean_of_means = sum(whole(**h).loss.item() for h in halves) / 2
    assert abs(mean_of_means - losses[0]) > 1e-4  # the data makes the two rules differ


def test_a_micro_batch_without_target_tokens_weighs_nothing():
    """A packed, prompt-masked block can hold no target token; in a step that has some, its
    micro-batch weighs 0 (transformers' loss with num_items_in_batch: its sum, 0). HF's mean
    loss of such a micro-batch is nan (0/0); the step's loss and update must not be, also with
    skip_nonfinite. Bit-exact with plain PyTorch that leaves the empty micro-batch out."""
    data = masked_batches(3, batch=4, seq=12, vocab=64)
    for b in data:
        b["labels"][:2] = -100  # micro-batch 0 of 2 has no target token
    model = tiny_llama(layers=2, hidden=32, vocab=64)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0, fused=True)
    ref_losses = []
    for b in data:
        ref_losses.append(accumulate(ref, [{k: v[2:] for k, v in b.items()}]))
        opt.step()
        opt.zero_grad()
    for skip in (False, True):
        eng = Engine(copy.deepcopy(model), budget=Budget(gpu="4M", chunk=CHUNK), optim=Optim(lr=1e-3))
        eng.skip_nonfinite = skip
        losses = [eng.step(b, grad_accum=2) for b in data]
        assert losses == ref_losses
        assert weights_equal(eng, ref)
    zo = Engine(copy.deepcopy(model), budget=Budget(gpu="4M", chunk=CHUNK), optim=Optim("mezo", lr=1e-3))
    assert all(math.isfinite(zo.step(b, grad_accum=2)) for b in data)


def test_tied_embeddings_and_sgd_momentum_bit_exact():
    data = batches(5)
    ref_losses, ref = train_reference(tiny_llama(tie=True), data, optimizer="sgd", lr=0.05, momentum=0.9)
    eng = Engine(tiny_llama(tie=True), budget=Budget(gpu="600K", chunk=CHUNK),
                 optim=Optim("sgd", lr=0.05, momentum=0.9))
    assert [eng.step(b) for b in data] == ref_losses
    assert weights_equal(eng, ref)


def test_default_torch_adamw_within_1e6_relative():
    data = batches(5)
    ref = tiny_llama()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)  # the for-loop kernel
    for b in data:
        ref(**b).loss.backward()
        opt.step()
        opt.zero_grad()
    eng, _ = run_engine(tiny_llama(), data, gpu_mem="600K", weight_decay=0.01)
    mine = dict(eng.named_parameters_fp32())
    for n, p in ref.named_parameters():
        torch.testing.assert_close(mine[n], p.detach(), rtol=1e-6, atol=1e-7)


def test_budget_below_minimum_is_refused_with_the_minimum(reference):
    data, _, _, minimum = reference
    with pytest.raises(InfeasibleBudget, match=r"below the minimum") as up_front:
        Engine(tiny_llama(), budget=Budget(gpu="8K", chunk=CHUNK))
    assert up_front.value.minimum["gpu"] > 8 << 10
    eng = Engine(tiny_llama(), budget=Budget(gpu=minimum - 1, chunk=CHUNK))
    with pytest.raises(InfeasibleBudget) as measured:
        for b in data[:2]:
            eng.step(b)
    assert measured.value.minimum["gpu"] >= minimum


def test_parameters_are_views_into_chunks_no_byte_twice():
    model = tiny_llama()
    eng = Engine(model, budget=Budget(gpu="2M", chunk=CHUNK))
    eng.step(batches(1)[0])
    chunk_storages = {storage_key(eng.store.compute_source(c)) for c in range(len(eng.plan.chunks))}
    chunk_storages |= set(eng.streamed_storage)
    for name, p in model.named_parameters():
        held = p.untyped_storage()
        assert storage_key(held) in chunk_storages or held.nbytes() <= 4, name
    host = eng.ledger.usage()["host"]
    n = eng.plan.total_numel
    assert host.get("master", 0) + eng.ledger.usage()["gpu"].get("master", 0) == 4 * n


def test_gradients_leave_the_device_and_ledger_returns_to_rest():
    eng = Engine(tiny_llama(), budget=Budget(gpu="600K", chunk=CHUNK))
    eng.step(batches(1)[0])
    eng.step(batches(1)[0])
    gpu = eng.ledger.usage()["gpu"]
    assert gpu.get("activation", 0) == 0 and gpu.get("grad", 0) == sum(
        eng.store.chunks[c].grad.numel() * 4 for c in eng.device_plan.gpu_home)
    assert eng.ledger.kind_peak("gpu", "grad") > 0


def test_changed_control_flow_retraces_instead_of_deadlocking():
    model = tiny_llama()
    eng = Engine(model, budget=Budget(gpu="500K", chunk=CHUNK))
    short, long = batches(1, seq=8)[0], batches(1, seq=16)[0]
    eng.step(long)
    eng.step(long)
    skip = model.model.layers[1]
    real = skip.forward
    skip.forward = lambda hidden_states, *a, **k: hidden_states  # the model now skips a block
    eng.step(short)
    skip.forward = real
    eng.step(short)
    assert eng.follower.retraces >= 1
    assert all(torch.isfinite(t).all() for _, t in eng.named_parameters_fp32())


def test_placed_up_front_from_the_planner_estimate():
    from tierwise.offload.plan.perfmodel import activation_bytes
    from tierwise.profiles import ModelProfile

    data = batches(4)
    ref_losses, ref = train_reference(tiny_llama(), data)
    model = tiny_llama()
    est = activation_bytes(model=ModelProfile.from_hf_config(model.config), batch_size=4, seq_len=16,
                           precision="fp32")
    late = Engine(tiny_llama(), budget=Budget(gpu="1500K", chunk=CHUNK), optim=Optim(lr=1e-3))
    late.step(data[0])
    eng = Engine(model, budget=Budget(gpu="1500K", chunk=CHUNK), optim=Optim(lr=1e-3),
                 activations=Activations(expected=est))
    assert eng.device_plan.gpu_home  # chunks start on the device: no promotion after warm-up
    host_at_start = eng.ledger.used("host")
    assert [eng.step(b) for b in data] == ref_losses
    assert weights_equal(eng, ref)
    assert eng.ledger.peaks()["host"] == host_at_start < late.ledger.peaks()["host"]
    assert eng.device_plan.gpu_home == late.device_plan.gpu_home  # the estimate is the measurement
    assert eng.ledger.peaks()["gpu"] <= 1500 << 10
