"""Every optimizer inside the engine equals its drop-in version, step for step."""

import copy

import pytest
import torch

from tierwise.offload import Budget, Engine, Optim, flat_options
from tierwise.offload.update.updaters import drop_in_groups
from tierwise.optim import eight_bit_groups, AdamW8bit, ApolloAdamW, ApolloMini, GaLoreAdamW, GaLoreAdamW8bit
from tests.models import batches, tiny_llama

HP = dict(lr=2e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)

CASES = {
    "adamw8bit": (lambda m: AdamW8bit(eight_bit_groups(m), **HP), {}),  # embeddings: fp32 moments
    "galore": (lambda m: GaLoreAdamW(drop_in_groups(m, rank=8, update_proj_gap=2), **HP),
               {"rank": 8, "update_proj_gap": 2}),
    "galore8bit": (lambda m: GaLoreAdamW8bit(drop_in_groups(m, rank=8, update_proj_gap=2), **HP),
                   {"rank": 8, "update_proj_gap": 2}),
    "apollo": (lambda m: ApolloAdamW(drop_in_groups(m, rank=8, update_proj_gap=2), **HP),
               {"rank": 8, "update_proj_gap": 2}),
    "apollo-mini": (lambda m: ApolloMini(drop_in_groups(m, rank=1, update_proj_gap=2), **HP),
                    {"update_proj_gap": 2}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_engine_equals_drop_in_optimizer(name, tmp_path):
    make_opt, kwargs = CASES[name]
    data = batches(4)
    ref = tiny_llama(hidden=128)
    eng_model = copy.deepcopy(ref)
    opt = make_opt(ref)
    ref_losses = []
    for b in data:
        loss = ref(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    # state on NVMe too: the blob round-trips through swap files every step
    eng = Engine(eng_model, **flat_options(optimizer=name, optimizer_kwargs=kwargs, gpu_mem="2M", cpu_mem="3M",
                 chunk_bytes=64 << 10, nvme_path=str(tmp_path), **HP))
    assert eng.homes.bytes.get("nvme", {}).get("state", 0) > 0
    losses = [eng.step(b) for b in data]
    assert losses == ref_losses
    mine = dict(eng.named_parameters_fp32())
    for n, p in ref.named_parameters():
        assert torch.equal(mine[n], p.detach()), n
    eng.close()


def test_8bit_state_is_about_2_bytes_per_parameter():
    model = tiny_llama(hidden=256, layers=2)
    eng = Engine(model, budget=Budget(chunk=1 << 20), optim=Optim("adamw8bit"))
    n = sum(p.numel() for p in model.parameters())
    state = sum(eng.ledger.usage()["host"].get("state", 0) for _ in [0])
    small = sum(p.numel() for p in model.parameters() if p.numel() < 4096)  # fp32 fallback: 8 B each
    assert state <= 2.2 * (n - small) + 8 * small + 64 * 40
    assert state >= 2.0 * (n - small)


@pytest.mark.parametrize("name, kw", [
    ("adamw", dict(optimizer_kwargs={"amsgrad": True})),  # torch's option: the engine's AdamW has none
    ("adamw", dict(optimizer_kwargs={"rank": 8})),
    ("adamw8bit", dict(optimizer_kwargs={"rank": 8})),
    ("sgd", dict(optimizer_kwargs={"nesterov": True})),
    ("galore", dict(optimizer_kwargs={"seed": 1})),  # APOLLO's option, not GaLore's
    ("mezo", dict(optimizer_kwargs={"rank": 8})),
    ("adamw", dict(momentum=0.9)),  # SGD's
])
def test_an_option_the_optimizer_does_not_take_is_refused_not_ignored(name, kw):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    with pytest.raises(ValueError, match="does not (take|use)"):
        Engine(model, **flat_options(optimizer=name, **kw))
    eng = Engine(model, optim=Optim("sgd", momentum=0.9), loss_fn=lambda m, b: m(b).sum())  # SGD's own
    eng.close()


@pytest.mark.parametrize("saved, loaded", [
    (dict(optimizer="adamw"), dict(optimizer="adamw8bit")),  # small tensors: 8-bit keeps fp32 moments, 8 B each
    (dict(optimizer="adamw"), dict(optimizer="sgd")),  # no state to put the moments in
    (dict(optimizer="sgd", momentum=0.9), dict(optimizer="sgd")),
])
def test_the_state_of_another_optimizer_is_refused(saved, loaded):
    """A state blob of the same size (or one the engine keeps none of) loaded silently before."""
    def make(kw):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        return Engine(model, **flat_options(loss_fn=lambda m, b: m(b).square().mean(), **kw))

    eng = make(saved)
    eng.step(torch.randn(4, 8))
    sd = eng.state_dict()
    eng.close()
    other = make(loaded)
    try:
        with pytest.raises(ValueError, match="state of optimizer 'adamw'|keeps none of"):
            other.load_state_dict(sd)
    finally:
        other.close()
    same = make(saved)
    same.load_state_dict(sd)  # its own optimizer's state loads
    same.close()


def test_a_closed_engine_says_so():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    eng = Engine(model, loss_fn=lambda m, b: m(b).square().mean())
    eng.step(torch.randn(4, 8))
    eng.close()
    eng.close()  # twice: nothing
    for call in (lambda: eng.step(torch.randn(4, 8)), lambda: eng.eval_loss(torch.randn(4, 8)),
                 lambda: dict(eng.named_parameters_fp32()), eng.state_dict):
        with pytest.raises(RuntimeError, match="this Engine is closed"):
            call()


@pytest.mark.parametrize("kw", [dict(lr=float("nan")), dict(lr=float("inf")), dict(grad_clip=-1.0),
                                dict(grad_clip=0.0), dict(optimizer="sgd", momentum=-0.5)],
                         ids=["lr-nan", "lr-inf", "clip-negative", "clip-0", "momentum-negative"])
def test_a_hyper_parameter_that_cannot_work_is_refused(kw):
    """NaN/inf lr made every weight NaN after the first update; a negative or zero clip and a
    negative momentum (torch.optim.SGD refuses it) ran."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    with pytest.raises(ValueError, match="lr must be|grad_clip must be|momentum must be"):
        Engine(model, **flat_options(loss_fn=lambda m, b: m(b).square().mean(), **kw))


def test_set_lr_and_grad_accum_are_checked():
    eng = Engine(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)),
                 optim=Optim(grad_clip=float("inf")), loss_fn=lambda m, b: m(b).square().mean())  # inf: measure the norm only
    try:
        with pytest.raises(ValueError, match="lr must be"):
            eng.set_lr(float("nan"))
        for bad in (0, -1, 2.0):
            with pytest.raises(ValueError, match="grad_accum must be"):
                eng.step(torch.randn(4, 8), grad_accum=bad)
        eng.step(torch.randn(4, 8), grad_accum=2)
        assert all(torch.isfinite(w).all() for _, w in eng.named_parameters_fp32())
    finally:
        eng.close()


@pytest.mark.parametrize("name", ["galore", "galore8bit", "apollo"])
@pytest.mark.parametrize("bad", [{"rank": 0}, {"rank": 2.5}, {"update_proj_gap": 0}, {"scale": float("nan")}],
                         ids=["rank0", "rank2.5", "gap0", "scale-nan"])
def test_a_low_rank_option_that_cannot_work_is_refused(name, bad):
    """rank 0 trained the matrices not at all, silently; the others failed in a step (a shape
    error, a ZeroDivisionError) or made the weights NaN."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 2))
    with pytest.raises(ValueError, match="rank must be|update_proj_gap must be|scale must be"):
        Engine(model, optim=Optim(name, kwargs=bad))
