"""GaLore and APOLLO against the published algorithms (computed here by hand from the paper)."""
import math

import pytest
import torch

from tierwise.optim import (AdamW8bit, ApolloAdamW, ApolloMini, GaLoreAdamW, GaLoreAdamW8bit, galore_step_,
                            init_galore_state)
from tierwise.optim.apollo import random_projector
from tierwise.optim.galore import project, project_back, svd_projector

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.0)


@pytest.mark.parametrize("shape", [(64, 16), (16, 64)], ids=["tall", "wide"])
def test_svd_projector_is_orthonormal_rank_r_along_smaller_dim(shape):
    torch.manual_seed(0)
    g = torch.randn(shape)
    p = svd_projector(g, 4)
    basis = p if shape[0] >= shape[1] else p.T  # rows are the basis vectors
    assert basis.shape == (4, min(shape))
    assert torch.allclose(basis @ basis.T, torch.eye(4), atol=1e-5)
    low = project(g, p)
    assert min(low.shape) == 4 and max(low.shape) == max(shape)
    # projecting a rank-4 matrix back is lossless
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    g4 = (u[:, :4] * s[:4]) @ vh[:4]
    assert torch.allclose(project_back(project(g4, p), p, shape), g4, atol=1e-4)


def test_galore_first_step_matches_paper_formula_with_scale():
    torch.manual_seed(0)
    p = torch.randn(32, 8)
    g = torch.randn(32, 8)
    state = init_galore_state(p, rank=2)
    expected = p.clone()
    galore_step_(p, g, state, step=1, rank=2, update_proj_gap=10, scale=0.25, **HYPER)
    vh = torch.linalg.svd(g, full_matrices=False)[2][:2]
    r = g @ vh.T
    m, v = 0.1 * r, 0.001 * r * r
    n = m / (v.sqrt() + 1e-6)
    step_size = 1e-2 * math.sqrt(0.001) / 0.1
    expected -= step_size * 0.25 * (n @ vh)
    assert torch.allclose(p, expected, atol=1e-6)


def test_galore_refreshes_projector_every_gap_steps():
    torch.manual_seed(0)
    p = torch.randn(24, 12)
    state = init_galore_state(p, rank=3)
    seen = []
    for step in range(1, 8):
        galore_step_(p, torch.randn(24, 12), state, step=step, rank=3, update_proj_gap=3, scale=1.0, **HYPER)
        seen.append(state["proj"])
    changed = [not torch.equal(a, b) for a, b in zip(seen, seen[1:])]
    assert changed == [False, False, True, False, False, True]  # new SVD at steps 4 and 7


def reference_plain_adamw(p, grads, *, lr, betas, eps, weight_decay):
    """GaLore's and APOLLO's reference AdamW for a parameter they do not project (galore_torch's
    AdamW, transformers' former AdamW), written out: m / (sqrt(v) + eps) at lr * sqrt(bc2) / bc1,
    then p -= lr * wd * p."""
    p, m, v = p.clone(), torch.zeros_like(p), torch.zeros_like(p)
    for step, g in enumerate(grads, start=1):
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        size = lr * math.sqrt(1 - betas[1] ** step) / (1 - betas[0] ** step)
        p = p - size * m / (v.sqrt() + eps)
        p = p - lr * weight_decay * p
    return p


@pytest.mark.parametrize("cls", [GaLoreAdamW, GaLoreAdamW8bit, ApolloAdamW, ApolloMini],
                         ids=["galore", "galore8bit", "apollo", "apollo-mini"])
def test_groups_without_rank_are_the_references_adamw(cls):
    """A parameter not projected (a 1-D bias here) takes the reference code's AdamW: GaLore's
    and APOLLO's own form (eps before the bias correction, decay after), not torch's (at their
    eps 1e-6 and small gradients the two part by most of a step); 8-bit GaLore's reference runs
    bitsandbytes' AdamW8bit there, torch's form."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16, 8))
    b = torch.nn.Parameter(torch.randn(8))
    opt = cls([{"params": [w], "rank": 2}, {"params": [b]}], lr=1e-2, weight_decay=0.1, eps=1e-6)
    b0, grads = b.detach().clone(), []
    for _ in range(3):
        w.grad = torch.randn_like(w)
        b.grad = torch.randn_like(b) * 1e-5  # (small: where eps's place shows)
        grads.append(b.grad.clone())
        opt.step()
    theirs = reference_plain_adamw(b0, grads, lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.1)
    torch_b = torch.nn.Parameter(b0.clone())
    torch_opt = torch.optim.AdamW([torch_b], lr=1e-2, weight_decay=0.1, eps=1e-6)
    for g in grads:
        torch_b.grad = g.clone()
        torch_opt.step()
    assert not torch.allclose(torch_b, theirs, atol=1e-4)  # (the two forms differ: the test can fail)
    want = torch_b.detach() if cls is GaLoreAdamW8bit else theirs
    torch.testing.assert_close(b.detach(), want, rtol=1e-6, atol=1e-7)
    assert opt.state[w]["exp_avg" if "exp_avg" in opt.state[w] else "state1"].numel() <= 2 * 16


def test_apollo_projection_regenerated_from_seed_and_refreshed():
    a = random_projector((64, 16), 4, seed=3)
    assert torch.equal(a, random_projector((64, 16), 4, seed=3))
    assert not torch.equal(a, random_projector((64, 16), 4, seed=4))
    assert a.shape == (4, 16) and abs(a.pow(2).mean().item() * 4 - 1) < 0.3  # N(0, 1/r)


def test_apollo_channel_scaling_and_limiter_match_paper():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(32, 8))
    opt = ApolloAdamW([{"params": [w], "rank": 2}], lr=1e-2, update_proj_gap=100, scale=4.0, seed=5)
    g = torch.randn(32, 8)
    w0 = w.detach().clone()
    w.grad = g.clone()
    opt.step()
    from tierwise.optim.apollo import projection_seed
    proj = random_projector((32, 8), 2, seed=projection_seed(5 * 7919 + 1, 1, 100))
    r = g @ proj.T  # (32, 2): channels are the 32 rows
    n = (0.1 * r) / ((0.001 * r * r).sqrt() + 1e-6)
    s = n.norm(dim=1, keepdim=True) / (r.norm(dim=1, keepdim=True) + 1e-8)
    step_size = 1e-2 * math.sqrt(0.001) / 0.1
    assert torch.allclose(w, w0 - step_size * 2.0 * g * s, atol=1e-5)
    # a 10x larger gradient next step: the limiter caps the norm growth at 1.01x
    prev = opt.state[w]["scaled_grad_norm"].item()
    w.grad = 10 * torch.randn(32, 8)
    opt.step()
    assert opt.state[w]["scaled_grad_norm"].item() <= 1.01 * prev * (1 + 1e-5)


def test_apollo_mini_uses_rank_one_tensor_state():
    w = torch.nn.Parameter(torch.randn(32, 8))
    opt = ApolloMini([{"params": [w], "rank": 4}], lr=1e-3)
    w.grad = torch.randn(32, 8)
    opt.step()
    assert opt.state[w]["exp_avg"].shape == (32, 1)


@pytest.mark.parametrize("cls", [GaLoreAdamW, ApolloAdamW, AdamW8bit])
@pytest.mark.parametrize("bad", [dict(lr=float("nan")), dict(lr=-1.0), dict(betas=(1.0, 0.999)), dict(eps=-1e-8),
                                 dict(weight_decay=-0.1)], ids=lambda d: next(iter(d)))
def test_a_bad_hyper_parameter_is_refused_as_torch_adamw_refuses_it(cls, bad):
    w = torch.nn.Parameter(torch.randn(8, 8))
    with pytest.raises(ValueError):
        torch.optim.AdamW([w], **bad)  # the reference refuses it too
    with pytest.raises(ValueError, match="invalid lr/betas/eps/weight_decay"):
        cls([w], **bad)


@pytest.mark.parametrize("cls", [GaLoreAdamW, ApolloAdamW])
@pytest.mark.parametrize("bad", [dict(rank=0), dict(rank=-1), dict(rank=2.5), dict(rank=4, update_proj_gap=0),
                                 dict(rank=4, scale=float("nan"))],
                         ids=["rank0", "rank-1", "rank2.5", "gap0", "scale-nan"])
def test_a_bad_rank_or_gap_in_a_later_group_is_refused_when_added(cls, bad):
    """A group's own rank / update_proj_gap are checked when the group is added (construction
    or add_param_group), not left to fail as a shape error or ZeroDivisionError in step()."""
    w, v = torch.nn.Parameter(torch.randn(16, 8)), torch.nn.Parameter(torch.randn(16, 8))
    opt = cls([{"params": [w], "rank": 2}])
    with pytest.raises(ValueError, match="rank must be|update_proj_gap must be|scale must be"):
        opt.add_param_group({"params": [v], **bad})
    assert len(opt.param_groups) == 1  # the refused group is not left behind


def test_numpy_ints_and_a_whole_float_gap_are_taken():
    """numpy's ints (numbers.Integral) as rank and gap, and a gap of 200.0, step as the ints do
    (compared with the same optimizer given plain ints)."""
    np = pytest.importorskip("numpy")
    torch.manual_seed(0)
    w0 = torch.randn(16, 8)
    outs = []
    for rank, gap in ((np.int64(2), np.int64(3)), (2, 200.0), (2, 3)):
        w = torch.nn.Parameter(w0.clone())
        opt = GaLoreAdamW([{"params": [w], "rank": rank, "update_proj_gap": gap}], lr=1e-2)
        for step in range(4):
            w.grad = torch.full_like(w, 0.1) * (step + 1)
            opt.step()
        outs.append(w.detach().clone())
    assert torch.equal(outs[0], outs[2])
    assert not torch.equal(outs[1], w0)


@pytest.mark.parametrize("cls, name", [(GaLoreAdamW, "galore"), (ApolloAdamW, "apollo"), (ApolloMini, "apollo-mini")])
def test_drop_in_without_a_rank_is_refused_naming_drop_in_groups(cls, name):
    """model.parameters() with no rank would be plain AdamW with its full state, silently (1026 MiB
    of state for a 135M model instead of ~220): refused, the hint giving the CLI's rank."""
    from tierwise.offload.update.table import OPTIMIZERS as TABLE

    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8))
    rank = TABLE[name].default_rank
    assert cls.suggested_rank == rank  # one fact: the CLI's default rank
    with pytest.raises(ValueError, match=rf"no rank: .*drop_in_groups\(model, rank={rank}\)"):
        cls(model.parameters(), lr=1e-3)
    cls(model.parameters(), lr=1e-3, rank=rank)  # a rank for all: accepted


@pytest.mark.parametrize("cls", [GaLoreAdamW, GaLoreAdamW8bit, ApolloAdamW, ApolloMini],
                         ids=["galore", "galore8bit", "apollo", "apollo-mini"])
@pytest.mark.parametrize("shape", [(256, 512), (512, 256), (300, 40)])
def test_cost_is_the_state_the_optimizer_allocates(cls, shape):
    """cost().tensor_state_bytes: the bytes of every tensor in a projected weight's state after
    a step (APOLLO's projector included: a cache it keeps)."""
    w = torch.nn.Parameter(torch.randn(*shape))
    opt = cls([{"params": [w], "rank": 16}], lr=1e-3)
    w.grad = torch.randn_like(w)
    opt.step()
    held = sum(t.numel() * t.element_size() for t in opt.state[w].values() if torch.is_tensor(t))
    assert held == cls.cost().tensor_state_bytes(shape, 16)
