"""Every registered optimizer: drop-in behaviour, schedulers, state_dict round trips, costs."""
import io

import pytest
import torch

from tierwise.optim import OPTIMIZERS, OptimizerCost, get_optimizer

KWARGS = {"galore": dict(rank=4, update_proj_gap=3), "galore8bit": dict(rank=4, update_proj_gap=3),
          "apollo": dict(rank=4, update_proj_gap=3), "apollo-mini": dict(rank=4, update_proj_gap=3),
          "mezo": dict(eps=1e-3), "sgd": dict(momentum=0.9)}


def make(name):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(80, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    extra = dict(KWARGS.get(name, {}))
    rank = extra.pop("rank", None)
    groups = [{"params": [model[0].weight, model[2].weight]}, {"params": [model[0].bias, model[2].bias]}]
    if rank:
        groups[0]["rank"] = rank
    opt = get_optimizer(name)(groups, lr=1e-2, **extra)
    return model, opt


def train(model, opt, steps, start):
    losses = []
    for i in range(start, start + steps):
        gen = torch.Generator().manual_seed(i)
        x, y = torch.randn(32, 80, generator=gen), torch.randn(32, 4, generator=gen)
        closure = lambda: torch.nn.functional.mse_loss(model(x), y)  # noqa: E731
        if type(opt).cost().needs_grad:
            opt.zero_grad()
            loss = closure()
            loss.backward()
            opt.step()
        else:
            with torch.no_grad():
                loss = opt.step(closure)
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_state_dict_round_trip_continues_identically(name):
    model, opt = make(name)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    train(model, opt, 4, 0)
    sched.step()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    tail = train(model, opt, 4, 4)
    model2, opt2 = make(name)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert train(model2, opt2, 4, 4) == tail
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    for key, value in opt.state_dict()["state"].items():
        if isinstance(value, dict):
            for k, v in value.items():
                other = opt2.state_dict()["state"][key][k]
                assert type(v) is type(other) and (not torch.is_tensor(v) or v.dtype == other.dtype)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_cost_is_declared(name):
    cost = get_optimizer(name).cost()
    assert isinstance(cost, OptimizerCost)
    assert cost.master_bytes_per_param == 4.0
    assert cost.needs_grad == (name != "mezo")
    assert cost.tensor_state_bytes((4096, 4096), 128) >= 0


def test_low_rank_state_bytes_scale_with_rank():
    cost = get_optimizer("galore").cost()
    assert cost.tensor_state_bytes((4096, 1024), 64) < cost.tensor_state_bytes((4096, 1024), 256)
    assert cost.tensor_state_bytes((4096, 1024), 64) < 0.2 * 8 * 4096 * 1024


def test_unknown_name_lists_choices():
    with pytest.raises(ValueError, match="adamw8bit"):
        get_optimizer("adam9bit")


@pytest.mark.parametrize("cls, ref, options", [
    ("adamw", torch.optim.AdamW, dict(amsgrad=True, maximize=True, weight_decay=0.1)),
    ("adamw", torch.optim.AdamW, dict(foreach=False)),
    ("sgd", torch.optim.SGD, dict(momentum=0.9, maximize=True, foreach=False)),
])
def test_torch_options_pass_through_with_torchs_numbers(cls, ref, options):
    """A drop-in for torch.optim.AdamW / SGD takes their options; the numbers are torch's
    (fused where we fuse, else the implementation the options pick)."""
    model, _ = make("adamw")
    named = list(model.named_parameters())  # torch takes (name, param) pairs too
    opt = get_optimizer(cls)(named, lr=1e-2, **options)
    ref_model, _ = make("adamw")
    fused = {"fused": True} if cls == "adamw" and "foreach" not in options else {}
    ref_opt = ref(ref_model.named_parameters(), lr=1e-2, **options, **fused)
    for i in range(3):
        x, y = torch.randn(32, 80, generator=torch.Generator().manual_seed(i)), torch.randn(32, 4)
        for m, o in ((model, opt), (ref_model, ref_opt)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)
    assert opt.state_dict()["param_groups"][0]["param_names"] == [n for n, _ in named]


@pytest.mark.parametrize("name", [n for n in OPTIMIZERS if n not in ("adamw", "sgd")])
def test_a_complex_parameter_is_refused(name):
    """torch.optim.AdamW takes complex parameters (as real pairs); our steps compute on real
    float copies, which dropped the imaginary part silently."""
    from tierwise.optim.base import LowRankOptimizer

    w = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.complex64))
    cls = get_optimizer(name)
    kw = {"rank": 2} if issubclass(cls, LowRankOptimizer) else {}  # (refused without one)
    with pytest.raises(ValueError, match="does not support complex parameters"):
        cls([torch.nn.Parameter(torch.randn(8, 8)), w], lr=1e-2, **kw)
    opt = cls([torch.nn.Parameter(torch.randn(8, 8))], lr=1e-2, **kw)
    with pytest.raises(ValueError, match="does not support complex parameters"):
        opt.add_param_group({"params": [w]})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("group", [{"lr": "1e-3"}, {"betas": (0.9,)}, {"eps": -1.0}])
def test_a_bad_param_group_is_refused_when_given(group):
    """Each group's values, the constructor's and add_param_group's: refused by name, not a
    TypeError inside the first step."""
    from tierwise.optim import AdamW8bit, GaLoreAdamW

    model = torch.nn.Linear(64, 64)
    with pytest.raises(ValueError, match="invalid lr/betas/eps/weight_decay"):
        AdamW8bit([{"params": [model.weight], **group}])
    opt = AdamW8bit([model.weight])
    with pytest.raises(ValueError, match="invalid lr/betas/eps/weight_decay"):
        opt.add_param_group({"params": [model.bias], **group})
    assert len(opt.param_groups) == 1
    with pytest.raises(ValueError, match="invalid lr/betas/eps/weight_decay"):
        GaLoreAdamW([{"params": [model.weight], "rank": 4, **group}])


def test_another_optimizers_state_is_refused_not_loaded():
    """A state dict torch's AdamW, bitsandbytes' or another tierwise optimizer wrote is refused
    in one line (it crashed inside the next step, or silently replaced a GaLore optimizer's
    groups with AdamW's); its own loads."""
    from tierwise.optim import AdamW8bit, GaLoreAdamW

    w, b = torch.nn.Parameter(torch.randn(128, 64)), torch.nn.Parameter(torch.randn(64))

    def stepped(opt):
        w.grad, b.grad = torch.randn_like(w), torch.randn_like(b)
        opt.step()
        return opt.state_dict()

    def galore():
        return GaLoreAdamW([{"params": [w], "rank": 4}, {"params": [b]}])

    theirs = stepped(torch.optim.AdamW([w, b]))
    with pytest.raises(ValueError, match="another optimizer.s .*lack stochastic_rounding"):
        AdamW8bit([w, b]).load_state_dict(theirs)
    with pytest.raises(ValueError, match="lack rank"):
        galore().load_state_dict(theirs)
    with pytest.raises(ValueError, match="this is AdamW8bit's state"):
        galore().load_state_dict(stepped(AdamW8bit([w, b])))
    mine = stepped(galore())
    again = galore()
    again.load_state_dict(mine)
    again.load_state_dict(mine)  # (twice, as accelerate's wrapper and the Trainer's resume do)
    assert again.param_groups[0]["rank"] == 4
    # an earlier version's state: no tag, a group key added since (its default fills it)
    from tierwise.optim import Adam8bit

    old = stepped(AdamW8bit([w, b]))
    del old["tierwise_optimizer"]
    for g in old["param_groups"]:
        del g["master_weights"]
    Adam8bit([w, b]).load_state_dict(old)  # (Adam8bit's state is AdamW8bit's)
    with pytest.raises(ValueError, match="this is GaLoreAdamW's state"):
        AdamW8bit([w, b]).load_state_dict(mine)


def test_float64_parameters_are_refused_where_the_step_computes_in_fp32():
    from tierwise.optim import AdamW8bit, GaLoreAdamW, MeZO

    double = torch.nn.Parameter(torch.randn(64, 128, dtype=torch.float64))
    with pytest.raises(ValueError, match="computes in fp32: a float64 parameter"):
        AdamW8bit([double])
    with pytest.raises(ValueError, match="computes in fp32"):
        GaLoreAdamW([{"params": [double], "rank": 4}])
    MeZO([double])  # (its own dtype: taken)


def test_mezo_checks_every_group_and_warns_on_low_precision_parameters():
    from tierwise.optim import MeZO

    opt = MeZO([torch.nn.Parameter(torch.randn(4))], lr=1e-3)
    with pytest.raises(ValueError, match="lr and weight_decay must be >= 0"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(4))], "lr": -1.0})
    with pytest.raises(ValueError, match="one eps: this group's is 0.01, the first's 0.001"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(4))], "eps": 1e-2})
    assert len(opt.param_groups) == 1
    with pytest.warns(UserWarning, match="does not round back"):
        MeZO([torch.nn.Parameter(torch.randn(4, dtype=torch.bfloat16))])


def test_stochastic_rounding_without_a_master_refuses_fp16_parameters():
    """Stochastic rounding is bf16's: an fp16 parameter without its master would round to
    nearest and lose every update below its precision, silently."""
    from tierwise.optim import AdamW8bit

    half = torch.nn.Parameter(torch.ones(8192, dtype=torch.float16))
    with pytest.raises(ValueError, match="fp16 one needs its fp32 master"):
        AdamW8bit([half], stochastic_rounding=True)
    AdamW8bit([half], stochastic_rounding=True, master_weights=True)
    AdamW8bit([torch.nn.Parameter(torch.ones(8192, dtype=torch.bfloat16))], stochastic_rounding=True)
