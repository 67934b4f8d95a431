"""Parameters of any shape and layout in the engine, against plain PyTorch bit for bit:
a 0-dim parameter, non-contiguous parameters (their strides kept), odd element counts (1, 3,
4097). Each at a roomy budget, at 1.2x the engine's minimum gpu budget with state on NVMe,
and with grad_accum=2; losses, final weights and AdamW's moments with torch.equal against
torch.optim.AdamW(fused=True) on the same seed and data."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tierwise.offload import Engine, flat_options
from tierwise.offload.core.errors import InfeasibleBudget, ParamLayoutError, UnsupportedModel
from tierwise.offload.plan.homes import minimum_host
from tierwise.offload.update.updaters import drop_in_groups
from tierwise.optim import AdamW8bit, ApolloAdamW, GaLoreAdamW
from tests.param_models import D, HP, KINDS, Zoo, train_zoo_reference, zoo_data, zoo_loss

CHUNK = 4 << 10
STEPS = 4


def engine(model: nn.Module, **kw) -> Engine:
    return Engine(model, **flat_options(loss_fn=zoo_loss, chunk_bytes=CHUNK, **(HP | kw)))


def tight_budgets(kinds: tuple[str, ...], tmp_path) -> dict:
    """1.2x the engine's measured minimum gpu budget; the least host budget with NVMe."""
    probe = engine(Zoo(kinds))
    probe.step(zoo_data(1)[0])
    gpu, host = int(1.2 * probe.minimum_gpu_bytes), minimum_host(probe.kinds, cxl=None, nvme=True)
    probe.close()
    for _ in range(4):
        try:  # the host minimum of the placement at this gpu budget
            engine(Zoo(kinds), gpu_mem=gpu, cpu_mem=host, nvme_path=str(tmp_path / "probe")).close()
            break
        except InfeasibleBudget as exc:
            host = exc.minimum["host"]
    return dict(gpu_mem=gpu, cpu_mem=host, nvme_path=str(tmp_path / "swap"))


def adam_moments(eng: Engine, ref: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{name: (exp_avg, exp_avg_sq)} from the engine's AdamW blobs (a slot holds its parameter
    in memory order: laid out here as `ref`'s parameter of that name)."""
    chunks = eng.state_dict()["chunks"]
    out = {}
    for name, p in ref.named_parameters():
        s = eng.plan.slots[name]
        blob, n = chunks[s.chunk]["state"], eng.plan.chunks[s.chunk].numel
        m, v = blob[: 4 * n].view(torch.float32), blob[4 * n: 8 * n].view(torch.float32)
        out[name] = tuple(t[s.offset: s.offset + s.numel].as_strided(p.shape, p.stride()) for t in (m, v))
    return out


def assert_equal_to_reference(eng: Engine, losses, ref_losses, ref: nn.Module, opt_state=None) -> None:
    assert losses == ref_losses
    mine = dict(eng.named_parameters_fp32())
    for n, p in ref.named_parameters():
        assert mine[n].shape == p.shape and torch.equal(mine[n], p.detach()), n
    if opt_state is not None:
        moments = adam_moments(eng, ref)
        for n, p in ref.named_parameters():
            st = opt_state[p]
            assert torch.equal(moments[n][0], st["exp_avg"]) and torch.equal(moments[n][1], st["exp_avg_sq"]), n


def reference(kinds, data, *, grad_accum: int = 1):
    opts = []

    def make(m):
        opts.append(torch.optim.AdamW(m.parameters(), fused=True, **HP))
        return opts[0]

    losses, ref = train_zoo_reference(Zoo(kinds), data, make_opt=make, grad_accum=grad_accum)
    return losses, ref, opts[0].state


@pytest.mark.parametrize("setting", ["roomy", "min-nvme", "accum2-nvme"])
@pytest.mark.parametrize("kind", KINDS)
def test_parameter_kind_equals_pytorch(kind, setting, tmp_path):
    kinds = (kind,)
    accum = 2 if setting.startswith("accum2") else 1
    data = zoo_data(STEPS)
    ref_losses, ref, ref_state = reference(kinds, data, grad_accum=accum)
    budgets = tight_budgets(kinds, tmp_path) if setting.endswith("nvme") else {}
    eng = engine(Zoo(kinds), **budgets)
    try:
        if budgets:
            assert eng.homes.bytes.get("nvme"), eng.homes.bytes  # state went to disk
        losses = [eng.step(b, grad_accum=accum) for b in data]
        assert_equal_to_reference(eng, losses, ref_losses, ref, ref_state)
        for tier, peak in eng.ledger.peaks().items():
            limit = eng.ledger.budgets[tier]
            assert limit is None or peak <= limit, tier
        if kind == "strided":  # the user's strides, whenever the module computed
            want = {(ref.blocks[0].mix.w.stride(), ref.blocks[0].mix.u.stride())}
            assert want == {((1, 2 * D), (1, 4 * D, D))}
            assert all(b.mix.strides_seen == want for b in eng.model.blocks)
        if kind == "scalar":
            assert dict(eng.named_parameters_fp32())["blocks.0.mix.temp"].shape == ()
    finally:
        eng.close()


def test_scalar_and_strided_survive_a_checkpoint(tmp_path):
    """state_dict / load_state_dict mid-run (state on NVMe) continues exactly."""
    kinds = ("scalar", "strided", "odd")
    data = zoo_data(STEPS)
    ref_losses, ref, ref_state = reference(kinds, data)
    budgets = tight_budgets(kinds, tmp_path)
    first = engine(Zoo(kinds), **budgets)
    losses = [first.step(b) for b in data[:2]]
    sd = first.state_dict()
    first.close()
    second = engine(Zoo(kinds, seed=5), **budgets)  # other weights: all come from the checkpoint
    second.load_state_dict(sd)
    losses += [second.step(b) for b in data[2:]]
    assert_equal_to_reference(second, losses, ref_losses, ref, ref_state)
    second.close()


def test_gradient_clipping_with_every_kind(tmp_path):
    """Per-parameter norms taken on the gradients as the parameters lay them out."""
    kinds = ("scalar", "strided", "odd")
    data = zoo_data(3)
    ref_losses, ref = train_zoo_reference(Zoo(kinds), data, clip=0.05)
    eng = engine(Zoo(kinds), grad_clip=0.05, **tight_budgets(kinds, tmp_path))
    losses = [eng.step(b) for b in data]
    assert_equal_to_reference(eng, losses, ref_losses, ref)
    eng.close()


def test_meta_model_loads_scalar_and_strided_weights():
    """A model built on the meta device keeps its parameters' strides; load_weights fills the
    slots from ordinary (name, tensor) pairs."""
    kinds = ("scalar", "strided")
    data = zoo_data(3)
    ref_losses, ref, ref_state = reference(kinds, data)
    with torch.device("meta"):
        meta = Zoo(kinds)
    eng = engine(meta, gpu_mem="1G")
    eng.load_weights((n, p.detach()) for n, p in Zoo(kinds).named_parameters())
    losses = [eng.step(b) for b in data]
    assert_equal_to_reference(eng, losses, ref_losses, ref, ref_state)
    assert all(b.mix.strides_seen == {((1, 2 * D), (1, 4 * D, D))} for b in eng.model.blocks)
    eng.close()


@pytest.mark.parametrize("make_param", [
    lambda: torch.zeros(1, D).expand(3, D),  # overlapping
    lambda: torch.randn(D, 2 * D)[:, :D],  # gaps
], ids=["expanded", "sliced"])
def test_overlapping_or_gapped_parameter_is_refused(make_param):
    model = Zoo(())
    model.blocks[1].mix.bad = nn.Parameter(make_param())
    with pytest.raises(ParamLayoutError, match=r"'blocks\.1\.mix\.bad'"):
        engine(model)


OPTIMIZERS = {
    "adamw8bit": (lambda m: AdamW8bit(m.parameters(), **HP), {}),
    "galore": (lambda m: GaLoreAdamW(drop_in_groups(m, rank=4, update_proj_gap=2), **HP),
               {"rank": 4, "update_proj_gap": 2}),
    "apollo": (lambda m: ApolloAdamW(drop_in_groups(m, rank=4, update_proj_gap=2), **HP),
               {"rank": 4, "update_proj_gap": 2}),
    "sgd": (lambda m: torch.optim.SGD(m.parameters(), lr=HP["lr"], momentum=0.9, weight_decay=HP["weight_decay"]),
            {}),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_other_optimizers_equal_drop_in_on_every_kind(name):
    make_opt, kwargs = OPTIMIZERS[name]
    kinds = ("scalar", "strided", "odd")
    data = zoo_data(3)
    ref_losses, ref = train_zoo_reference(Zoo(kinds), data, make_opt=make_opt)
    extra = {"momentum": 0.9} if name == "sgd" else {}
    eng = engine(Zoo(kinds), optimizer=name, optimizer_kwargs=kwargs, **extra)
    losses = [eng.step(b) for b in data]
    assert_equal_to_reference(eng, losses, ref_losses, ref)
    eng.close()


def test_adamw_chunks_equal_fused_adamw_for_every_element_count():
    """The chunk updater alone, many sizes (tails of every length), a few steps: parameters and
    both moments equal torch.optim.AdamW(fused=True)'s."""
    from tierwise.offload.core.chunks import ParamSpec, pack_chunks
    from tierwise.offload.update.update import AdamWChunks, Hyper

    shapes = [(n,) for n in range(1, 41)] + [(), (4097,), (4104,), (7, 3), (16, 16)]
    plan = pack_chunks([ParamSpec(name=f"p{i}", shape=s) for i, s in enumerate(shapes)], chunk_bytes=32 << 10)
    g = torch.Generator().manual_seed(0)
    ref = [nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    opt = torch.optim.AdamW(ref, fused=True, **HP)
    up = AdamWChunks(plan)
    kinds = [{k: torch.zeros(c.numel) for k in ("master", "grad")} | {"state": torch.zeros(8 * c.numel, dtype=torch.uint8),
                                                                      "step": torch.zeros(())} for c in plan.chunks]
    for i, p in enumerate(ref):
        s = plan.slots[f"p{i}"]
        s.view(kinds[s.chunk]["master"]).copy_(p.detach())
    for _ in range(5):
        for i, p in enumerate(ref):
            p.grad = torch.randn(p.shape, generator=g)
            s = plan.slots[f"p{i}"]
            s.view(kinds[s.chunk]["grad"]).copy_(p.grad)
        opt.step()
        for c, k in zip(plan.chunks, kinds):
            up.step(k["master"], k["grad"], k["state"], c.index, k["step"], Hyper(**HP))
    for i, p in enumerate(ref):
        s = plan.slots[f"p{i}"]
        k, n = kinds[s.chunk], plan.chunks[s.chunk].numel
        m, v = k["state"][: 4 * n].view(torch.float32), k["state"][4 * n:].view(torch.float32)
        assert torch.equal(s.view(k["master"]), p.detach()), shapes[i]
        assert torch.equal(s.view(m), opt.state[p]["exp_avg"]) and torch.equal(s.view(v), opt.state[p]["exp_avg_sq"]), shapes[i]


def test_a_meta_model_without_values_is_refused_not_trained_as_zeros():
    """A closed engine's model (its parameters meta) or one built on the meta device, given to a
    new engine without weights: every step trained an all-zero model at the loss ln(vocab)."""
    from tierwise.offload import Engine, flat_options
    from tierwise.offload.core.errors import UnsupportedModel
    from tests.models import batches, tiny_llama

    model, data = tiny_llama(), batches(2)
    first = Engine(model, **flat_options(lr=1e-3))
    first.step(data[0])
    first.close()  # the model's parameters are meta now
    again = Engine(model, **flat_options(lr=1e-3))
    for run in (lambda: again.step(data[1]), lambda: again.eval_loss(data[1])):
        with pytest.raises(UnsupportedModel, match="on the meta device with no values"):
            run()
    again.init_weights_(seed=0)
    assert again.step(data[1]) > 0
    again.close()


def test_an_update_without_gradients_changes_nothing():
    """torch.optim skips a parameter whose .grad is None: with no gradient at all
    (optimizer_step before any backward) the engine updates nothing, and a parameter the
    forward never used keeps its value under weight decay (tests/test_engine_unused.py
    compares whole runs with plain PyTorch)."""
    from tests.models import batches, tiny_llama

    model, data = tiny_llama(), batches(3)
    model.unused = nn.Linear(4, 4)  # never called in forward
    eng = Engine(model, **flat_options(lr=1e-2, weight_decay=0.1))
    before = {n: t.clone() for n, t in eng.named_parameters_fp32()}
    eng.optimizer_step()  # no backward: no gradient anywhere
    assert all(torch.equal(before[n], t) for n, t in eng.named_parameters_fp32())
    eng.step(data[0])
    eng.step(data[1])
    after = dict(eng.named_parameters_fp32())
    assert torch.equal(after["unused.weight"], before["unused.weight"])
    assert not torch.equal(after["lm_head.weight"], before["lm_head.weight"])
    eng.optimizer_step()  # no backward since the last step's update: nothing (was: a second update)
    assert all(torch.equal(after[n], t) for n, t in eng.named_parameters_fp32())
    eng.close()


def test_a_batch_without_labels_and_a_closed_engines_backward_say_what_is_wrong():
    from tests.models import batches, tiny_llama

    eng = Engine(tiny_llama(), **flat_options(lr=1e-3))
    b = batches(1)[0]
    with pytest.raises(ValueError, match="returned no loss for a batch with keys .*give it 'labels'"):
        eng.step({"input_ids": b["input_ids"]})  # (was: 'NoneType' object has no attribute 'backward')
    with pytest.raises(TypeError, match="give a dict batch"):
        eng.step(b["input_ids"])
    loss = eng.forward(b)
    eng.close()
    with pytest.raises(RuntimeError, match="this Engine is closed"):
        eng.backward(loss)


@pytest.mark.parametrize("bad,error,says", [
    (dict(lr="1e-4"), TypeError, "Optim lr must be a number, got '1e-4'"),
    (dict(grad_clip="1.0"), TypeError, "Optim grad_clip must be a number"),
    (dict(betas=(0.9,)), ValueError, r"Optim betas must be two numbers in \[0, 1\)"),
    (dict(betas=(1.5, 0.999)), ValueError, r"Optim betas must be two numbers in \[0, 1\)"),
])
def test_optim_options_of_the_wrong_kind_are_one_clear_error(bad, error, says):
    # (were: "must be real number, not str" from deep in a step; an IndexError; a silent 1.5)
    from tierwise.offload import Optim

    with pytest.raises(error, match=says):
        Optim(**bad)


def test_options_that_would_be_ignored_are_refused():
    from tierwise.offload import Precision, Streaming

    with pytest.raises(ValueError, match="prefetch takes a number of chunks >= 0, got -1"):
        Streaming(prefetch=-1)
    with pytest.raises(ValueError, match="h2d_bandwidth takes bytes/s > 0"):
        Streaming(h2d_bandwidth=0)
    with pytest.raises(ValueError, match="double_quant quantizes NF4's absmax: it needs base='nf4'"):
        Precision(base="int8", double_quant=True)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))  # every parameter trains: nothing to encode
    with pytest.raises(UnsupportedModel, match="base='nf4' sets how a frozen base is stored"):
        Engine(model, precision=Precision(base="nf4"), loss_fn=lambda m, x: m(x).sum())
    model[0].requires_grad_(False)  # a frozen part: it is encoded
    eng = Engine(model, precision=Precision(base="nf4"), loss_fn=lambda m, x: m(x).sum())
    assert eng.frozen_layouts
    eng.close()


def test_a_model_engines_cannot_take_is_one_clear_error():
    """A loss_fn that returns a number, a model another engine holds (its parameters are that
    engine's views), a torch.compile wrapper: each a sentence naming the fix, not an error from
    inside torch."""
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))

    x = torch.randn(4, 8)
    eng = Engine(model(), loss_fn=lambda m, b: float(m(b).sum()))
    with pytest.raises(TypeError, match="loss_fn returned a float: it must return the loss as a one-element tensor"):
        eng.step(x)  # (was: 'float' object has no attribute 'backward')
    eng.close()
    eng = Engine(model(), loss_fn=lambda m, b: m(b))
    with pytest.raises(TypeError, match=r"loss_fn returned a tensor of shape \(4, 2\)"):
        eng.step(x)
    eng.close()
    eng = Engine(model(), **flat_options(precision="bf16"), loss_fn=lambda m, b: m(b).float().sum())
    with pytest.raises(RuntimeError, match="same dtype") as caught:  # fp32 features into bf16 weights
        eng.step(x)
    assert "the engine casts no inputs" in "".join(getattr(caught.value, "__notes__", []))
    assert eng.step(x.bfloat16()) is not None  # (the engine dropped the failed step)
    eng.close()
    held = model()
    first = Engine(held, loss_fn=lambda m, b: m(b).sum())
    with pytest.raises(UnsupportedModel, match="another Engine holds this model"):
        Engine(held, loss_fn=lambda m, b: m(b).sum())  # (was: a ParamLayoutError on stride (0, 0))
    assert first.step(x) is not None  # the refusal left the first engine as it was
    first.close()
    with pytest.raises(UnsupportedModel, match="torch.compile wrapper: give the Engine the model itself"):
        Engine(torch.compile(model()), loss_fn=lambda m, b: m(b).sum())
