"""Ordinary nn.Modules in the engine (tests/module_zoo.py), against plain PyTorch on the same
seed and data: losses, final weights and buffers bit for bit, at a roomy budget, at 1.2x the
engine's minimum device budget with everything else on NVMe, and with grad_accum=2."""

from __future__ import annotations

import functools
import gc
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tierwise.offload import Budget, Engine, InfeasibleBudget, Optim, Streaming, flat_options
from tierwise.offload.core.errors import StepOverBudget, UnsupportedModel
from tests import module_zoo as zoo

ONE_CHUNK, SMALL = 64 << 20, 4 << 10  # the default chunk size holds these models whole
STEPS = 3
CASES = [("encoder", ONE_CHUNK), ("encoder", SMALL), ("tied", SMALL), ("batchnorm", SMALL), ("shared", SMALL),
         ("datafed", SMALL), ("routed", SMALL)]
MODES = ("roomy", "nvme-1.2x-min", "accum2")


def engine(kind: str, chunk: int, **kw) -> Engine:
    return Engine(zoo.build(kind), **flat_options(lr=1e-3, chunk_bytes=chunk, loss_fn=zoo.lm_loss, **kw))


def train(eng: Engine, data: list, *, grad_accum: int = 1) -> list[float]:
    torch.manual_seed(2)  # dropout: as the reference seeds it
    return [eng.step(b, grad_accum=grad_accum) for b in data]


@functools.lru_cache(maxsize=None)
def minimum_gpu(kind: str, chunk: int) -> int:
    """The engine's measured minimum device budget (a warm-up step without a budget)."""
    eng = engine(kind, chunk)
    try:
        train(eng, zoo.data(1))
        return eng.minimum_gpu_bytes
    finally:
        eng.close()


def minimum_host(kind: str, chunk: int, gpu: int, nvme: str) -> int:
    with pytest.raises(InfeasibleBudget) as exc:
        engine(kind, chunk, gpu_mem=gpu, cpu_mem=1, nvme_path=nvme)
    return exc.value.minimum["host"]


def assert_same_as_reference(eng: Engine, model: torch.nn.Module, ref: torch.nn.Module) -> None:
    mine = dict(eng.named_parameters_fp32())
    for name, p in ref.named_parameters():
        assert torch.equal(mine[name], p.detach()), name
    for (name, b), (_, rb) in zip(model.named_buffers(), ref.named_buffers()):
        assert torch.equal(b.cpu(), rb), name


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind, chunk", CASES, ids=[f"{k}-{'one' if c == ONE_CHUNK else 'small'}-chunk"
                                                    for k, c in CASES])
def test_module_bit_exact_with_pytorch(kind, chunk, mode, tmp_path):
    data = zoo.data(STEPS)
    accum = 2 if mode == "accum2" else 1
    ref_losses, ref = zoo.reference(zoo.build(kind), data, grad_accum=accum)
    kw: dict = {"gpu_mem": "64M"}
    if mode == "nvme-1.2x-min":
        gpu = int(1.2 * minimum_gpu(kind, chunk))
        nvme = str(tmp_path / "swap")
        kw = dict(gpu_mem=gpu, cpu_mem=minimum_host(kind, chunk, gpu, nvme), nvme_path=nvme)
    eng = engine(kind, chunk, **kw)
    model = eng.model
    try:
        assert train(eng, data, grad_accum=accum) == ref_losses
        assert_same_as_reference(eng, model, ref)
        assert eng.early.updated > 0  # overlap_update (the default) ran, and changed nothing
        for tier, peak in eng.ledger.peaks().items():
            budget = eng.ledger.budgets[tier]
            assert budget is None or peak <= budget, tier
        if mode == "nvme-1.2x-min":
            assert len(eng.device_plan.gpu_home) < len(eng.plan.chunks)  # chunks stream
            if chunk == SMALL:  # (one chunk: its bounce buffers would outweigh keeping it in DRAM)
                assert eng.homes.bytes["nvme"]["state"] > 0
        if kind == "batchnorm":  # the running stats were updated once per forward, as in PyTorch
            assert all(int(m.bn.num_batches_tracked) == STEPS * accum for m in model.blocks)
            model.eval()
            ref.eval()
            with torch.no_grad():
                assert eng.eval_loss(data[0]) == zoo.lm_loss(ref, data[0]).item()
    finally:
        eng.close()


def test_transformer_encoder_reads_out_proj_outside_its_forward():
    """nn.MultiheadAttention reads out_proj.weight itself: its chunk is acquired for the
    attention module, the trace has it, and later steps prefetch it like any other."""
    data = zoo.data(STEPS)
    eng = engine("encoder", SMALL, gpu_mem=int(1.2 * minimum_gpu("encoder", SMALL)))
    try:
        train(eng, data)
        out_proj = eng.plan.slots["encoder.layers.0.self_attn.out_proj.weight"].chunk
        assert ("acquire", out_proj) in eng.follower.events
        assert eng.follower.retraces == 0  # the borrowed reads are the same every step
    finally:
        eng.close()


class ExtraUse(torch.nn.Module):
    """SharedNet whose forward applies the reused block `extra` more times (0, 1, ...) or skips it (-1)."""

    def __init__(self):
        super().__init__()
        self.net = zoo.build("shared")
        self.extra = 0

    def forward(self, x):
        blocks = list(self.net.blocks)
        blocks = blocks[:-1] if self.extra < 0 else blocks + [blocks[1]] * self.extra
        h = self.net.emb(x)
        for b in blocks:
            h = b(h)
        return self.net.head(h)


def test_fewer_gradient_contributions_than_traced_stay_exact():
    """A step whose backward reaches the shared weight fewer times than the first one did:
    the held sums are delivered after backward and the update is still exact."""
    data = zoo.data(4)
    torch.manual_seed(0)
    ref = ExtraUse()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0, fused=True)
    torch.manual_seed(0)
    eng = Engine(ExtraUse(), budget=Budget(chunk=SMALL, gpu="64M"), optim=Optim(lr=1e-3), loss_fn=zoo.lm_loss)
    model = eng.model
    try:
        for i, b in enumerate(data):
            model.extra = ref.extra = -1 if i == 2 else 0
            loss = zoo.lm_loss(ref, b)
            loss.backward()
            opt.step()
            opt.zero_grad()
            assert eng.step(b) == loss.item(), i
        assert_same_as_reference(eng, model, ref)
    finally:
        eng.close()


def test_more_gradient_contributions_than_traced_are_refused_not_applied_early():
    eng = Engine(ExtraUse(), budget=Budget(chunk=SMALL, gpu="64M"), optim=Optim(lr=1e-3), loss_fn=zoo.lm_loss)
    data = zoo.data(3)
    try:
        eng.step(data[0])
        eng.step(data[1])
        eng.model.extra = 1
        # (refused at the extra block's recompute, which reads a chunk updated early, or at the
        # extra contribution, whichever backward meets first)
        more = (r"(parameter 'net\.blocks\.[01]\.\w+\.\w+' got gradient contribution 3 |backward reads chunk "
                r"\d+ \(net\.blocks\.[01]\.).*overlap_update=False")
        with pytest.raises(UnsupportedModel, match=more):
            eng.step(data[2])
    finally:
        eng.close()
    eng = Engine(ExtraUse(), budget=Budget(chunk=SMALL, gpu="64M"), optim=Optim(lr=1e-3, overlap_update=False),
                 loss_fn=zoo.lm_loss)
    try:
        eng.step(data[0])
        eng.model.extra = 1
        assert torch.isfinite(torch.tensor(eng.step(data[1])))
    finally:
        eng.close()


def train_updating_at_once(eng: Engine, data: list, ref_losses: list[float], ref: torch.nn.Module) -> None:
    """Train with every early update done as soon as it is submitted (the worst interleaving:
    the update before backward goes on); losses, weights and buffers as the reference's."""
    early, model = eng.grads.early, eng.model
    submit = early.submit
    early.submit = lambda *a, **kw: (submit(*a, **kw), early.wait())
    assert train(eng, data) == ref_losses
    assert_same_as_reference(eng, model, ref)


class StopGrad(torch.nn.Module):
    """`lin.weight` also read through .detach() before its own use (`stop`): backward reads it,
    for its input's gradient, after lin.weight's own gradient is complete."""

    def __init__(self, d: int = 32):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.lin, self.head = torch.nn.Embedding(zoo.VOCAB, d), torch.nn.Linear(d, d), torch.nn.Linear(d, zoo.VOCAB)
        self.stop = True

    def forward(self, x):
        h = self.emb(x)
        if self.stop:
            h = torch.tanh(F.linear(h, self.lin.weight.detach()))
        return self.head(torch.tanh(self.lin(h)))


@pytest.mark.parametrize("placed", ["streamed", "gpu-home-up-front"])
def test_a_chunk_backward_reads_after_its_last_gradient_is_updated_at_the_steps_end(placed):
    """Updated early, lin.weight's chunk would change under the backward that still reads it:
    streamed, its cached copy rewritten from the new master (offload.engine.residency.refresh_master)
    or fetched anew; device-home (placed before the first step), updated where it lies. The first
    backward notes the late read; that chunk waits for the step's end. Bit-exact with PyTorch
    also when every early update is done at once (the worst interleaving)."""
    data = zoo.data(4)
    ref_losses, ref = zoo.reference(StopGrad(), data)
    where = dict(allow_gpu_home=False) if placed == "streamed" else dict(activations=1 << 20)
    eng = Engine(StopGrad(), **flat_options(lr=1e-3, chunk_bytes=SMALL, gpu_mem="64M", loss_fn=zoo.lm_loss, **where))
    early = eng.grads.early
    try:
        train_updating_at_once(eng, data, ref_losses, ref)
        lin = eng.plan.slots["lin.weight"].chunk
        assert eng.grads.read_late == {lin} and early.updated > 0
        assert (eng.residency.kept > 0) if placed == "streamed" else (lin in eng.device_plan.gpu_home)
    finally:
        eng.close()


class OffsetBlock(torch.nn.Module):
    def __init__(self, d: int, offset: torch.nn.Linear):
        super().__init__()
        self.lin, self.offset = torch.nn.Linear(d, d), [offset]  # (a list: not a submodule)

    def forward(self, h):
        return torch.tanh(self.lin(h)) + self.offset[0].bias.detach()  # (an add saves nothing of it)


class BlockReadsLate(torch.nn.Module):
    """Checkpointed blocks read `offset.bias` (owned outside them) through .detach() in an add:
    backward's recomputes read it after its own gradient (from the head's side) is complete,
    and nothing they save refers to it."""

    def __init__(self, d: int = 32):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.offset = torch.nn.Embedding(zoo.VOCAB, d), torch.nn.Linear(d, d)
        self.blocks = torch.nn.ModuleList(OffsetBlock(d, self.offset) for _ in range(3))
        self.head = torch.nn.Linear(d, zoo.VOCAB)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(self.offset(h))


def test_a_chunk_a_recompute_reads_after_its_last_gradient_is_updated_at_the_steps_end():
    """Device-home from the start: the first backward notes the recomputes' reads of a home chunk
    outside its owner (the guard watches home parameters until then), so that chunk waits for the
    step's end instead of changing under the recomputes that read it."""
    data = zoo.data(4)
    ref_losses, ref = zoo.reference(BlockReadsLate(), data)
    eng = Engine(BlockReadsLate(), **flat_options(lr=1e-3, chunk_bytes=SMALL, gpu_mem="64M", loss_fn=zoo.lm_loss,
                                                  activations=1 << 20))
    early = eng.grads.early
    try:
        train_updating_at_once(eng, data, ref_losses, ref)
        bias = eng.plan.slots["offset.bias"].chunk
        assert bias in eng.grads.read_late and bias in eng.device_plan.gpu_home and early.updated > 0
        assert not eng.residency.watching_homes
    finally:
        eng.close()


def test_a_late_read_the_first_backward_did_not_have_is_refused():
    eng = Engine(StopGrad(), budget=Budget(chunk=SMALL, gpu="64M"), optim=Optim(lr=1e-3),
                 streaming=Streaming(allow_gpu_home=False), loss_fn=zoo.lm_loss)
    data = zoo.data(3)
    try:
        eng.model.stop = False
        eng.step(data[0])
        eng.step(data[1])
        eng.model.stop = True
        with pytest.raises(UnsupportedModel, match=r"backward reads chunk \d+ \(lin\.weight.*overlap_update=False"):
            eng.step(data[2])
    finally:
        eng.close()


class HfLike(torch.nn.Module):
    """Just enough of a Hugging Face causal LM for MeZO's dual forward."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner, self.config = inner, SimpleNamespace(vocab_size=zoo.VOCAB, use_cache=False)

    def forward(self, input_ids, **kw):
        return SimpleNamespace(logits=self.inner(input_ids))

    def loss_function(self, *, logits, labels, vocab_size):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_mezo_refuses_a_read_outside_the_owner_naming_parameter_and_module():
    eng = Engine(HfLike(zoo.build("encoder")), budget=Budget(chunk=SMALL), optim=Optim("mezo"))
    b = zoo.data(1)[0]
    try:
        with pytest.raises(UnsupportedModel, match=r"'inner\.encoder\.layers\.0\.self_attn\.out_proj\.weight' "
                                                   r"is read by module 'inner\.encoder\.layers\.0\.self_attn'"):
            eng.step({"input_ids": b["x"], "labels": b["y"]})
    finally:
        eng.close()


def test_a_module_run_outside_the_engine_is_refused_and_close_undoes_the_patches():
    model = zoo.build("batchnorm")
    x = zoo.data(1)[0]["x"]
    eng = Engine(model, budget=Budget(chunk=SMALL), loss_fn=zoo.lm_loss)
    assert all("forward" in b.__dict__ for b in model.blocks)  # checkpointed
    eng.step(zoo.data(1)[0])
    with pytest.raises(UnsupportedModel, match=r"the model \(BatchNormNet\) ran outside engine.step"):
        model(x)
    weights = dict(eng.named_parameters_fp32())
    eng.close()
    assert all("forward" not in b.__dict__ for b in model.blocks)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    with pytest.raises((RuntimeError, NotImplementedError)):
        model(x)  # meta placeholders: a loud failure, never NaN
    model.load_state_dict(weights, strict=False, assign=True)
    assert torch.isfinite(model(x)).all()


def test_a_step_over_budget_inside_a_block_releases_the_buffer_copies():
    """A BudgetExceeded raised inside a checkpointed BatchNorm block: the copies of its buffers
    (taken for the recompute, booked as activations) are released with the failed step."""
    small, big = zoo.data(2, batch=2), zoo.data(1, batch=16, seed=5)[0]
    probe = engine("batchnorm", SMALL)
    try:
        probe.step(small[0])
        gpu = int(1.05 * probe.minimum_gpu_bytes)
    finally:
        probe.close()
    eng = engine("batchnorm", SMALL, gpu_mem=gpu)
    try:
        eng.step(small[0])
        with pytest.raises(StepOverBudget):
            eng.step(big)
        gc.collect()  # the failed step's graph
        assert eng.ledger.usage()["gpu"].get("activation", 0) == 0
        eng.step(small[1])
        assert eng.ledger.usage()["gpu"].get("activation", 0) == 0
    finally:
        eng.close()


@pytest.mark.parametrize("kind", ["batchnorm", "encoder"])
def test_measure_leaves_buffers_and_rng_as_they_were(kind):
    """Engine.measure() runs a forward and backward without an update; BatchNorm's running
    statistics and the dropout RNG must not see it: the run equals plain PyTorch's."""
    data = zoo.data(STEPS)
    ref_losses, ref = zoo.reference(zoo.build(kind), data)
    eng = engine(kind, SMALL, gpu_mem="64M")
    model = eng.model
    try:
        torch.manual_seed(2)  # as the reference seeds it; measure() must not draw from it
        eng.measure(zoo.data(1, batch=8, seed=7)[0])
        assert [eng.step(b) for b in data] == ref_losses
        assert_same_as_reference(eng, model, ref)
    finally:
        eng.close()


def test_state_dict_resume_keeps_batchnorm_running_stats():
    """Two steps, state_dict, a fresh engine load_state_dict, two more steps: weights and
    BatchNorm's running statistics equal four steps of plain PyTorch."""
    data = zoo.data(4)
    ref_losses, ref = zoo.reference(zoo.build("batchnorm"), data)
    first = engine("batchnorm", SMALL)
    try:
        losses = train(first, data[:2])
        sd = first.state_dict()
    finally:
        first.close()
    eng = engine("batchnorm", SMALL)
    model = eng.model
    try:
        eng.load_state_dict(sd)
        losses += [eng.step(b) for b in data[2:]]
        assert losses == ref_losses
        assert_same_as_reference(eng, model, ref)
    finally:
        eng.close()


def test_a_budget_error_while_holding_a_shared_gradient_sum_keeps_the_ledger_right(monkeypatch):
    """The device cannot hold a shared weight's gradient sum (BudgetExceeded in the gradient
    hook): the step fails with StepOverBudget, and after the next step the ledger holds no
    activation bytes (nothing was released that had not been reserved)."""
    from tierwise.offload.core.errors import BudgetExceeded

    data = zoo.data(3)
    eng = engine("shared", SMALL, gpu_mem="64M")
    try:
        eng.step(data[0])  # counts the contributions: later backwards hold the shared sums
        reserve = eng.ledger.reserve

        def refuse_the_sum(tier, kind, nbytes):
            if kind == "activation" and sys._getframe(1).f_code.co_name == "_holding_sum":
                raise BudgetExceeded(tier=tier, budget=1, used=1, asked=nbytes, kind=kind)
            reserve(tier, kind, nbytes)

        monkeypatch.setattr(eng.ledger, "reserve", refuse_the_sum)
        with pytest.raises(StepOverBudget):
            eng.step(data[1])
        monkeypatch.undo()
        eng.step(data[2])  # (autograd lets go of the failed backward's last saved tensor here)
        gc.collect()
        assert eng.ledger.usage()["gpu"].get("activation", 0) == 0
    finally:
        eng.close()


def test_a_sparse_gradient_embedding_is_refused_at_construction():
    """nn.Embedding(sparse=True) gives sparse gradients, which dense gradient chunks cannot hold;
    MeZO computes no gradient, so it takes the same model."""
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8, sparse=True), torch.nn.Linear(8, 2))
    with pytest.raises(UnsupportedModel, match=r"sparse gradients.*\b0\b.*sparse=False"):
        Engine(model, loss_fn=lambda m, b: m(b).sum())
    Engine(model, optim=Optim("mezo")).close()


def test_mezo_with_a_custom_loss_function_is_refused_not_ignored():
    """The engine's MeZO evaluates a Hugging Face causal LM's own loss (one forward over the
    doubled batch); a loss_fn it would not call is refused at construction (a KeyError on
    'labels' in the first step before, or the wrong loss silently for an HF model)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    with pytest.raises(UnsupportedModel, match="custom loss_fn"):
        Engine(model, optim=Optim("mezo"), loss_fn=lambda m, b: F.mse_loss(m(b["x"]), b["y"]))


def test_a_model_that_checkpoints_itself_is_refused_saying_so():
    """The model's own recompute (torch.utils.checkpoint; transformers' gradient checkpointing)
    runs modules in backward outside the engine's frames: refused naming that, not as a module
    'run outside engine.step' (it was inside one)."""
    from tests.models import tiny_llama

    hf = tiny_llama(layers=2, hidden=32)
    hf.gradient_checkpointing_enable()
    with pytest.raises(UnsupportedModel, match="gradient_checkpointing_disable"):
        Engine(hf)

    class OwnCheckpoint(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)

        def forward(self, x):
            return self.b(torch.utils.checkpoint.checkpoint(self.a, x, use_reentrant=False))

    eng = Engine(OwnCheckpoint(), loss_fn=lambda m, b: m(b).square().mean())
    try:
        with pytest.raises(UnsupportedModel, match="ran again in backward.*torch.utils.checkpoint"):
            eng.step(torch.randn(4, 8))
    finally:
        eng.close()


def test_a_float64_trainable_parameter_is_refused_not_cast():
    """Plain PyTorch trains a float64 model in float64; the engine made its parameters fp32
    silently and the model's float64 inputs then failed in its forward."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).double()
    with pytest.raises(UnsupportedModel, match="'0.weight' is torch.float64.*model.float"):
        Engine(model, loss_fn=lambda m, b: m(b).square().mean())
    model[0].requires_grad_(False)  # frozen: refused for its trainable sibling only
    with pytest.raises(UnsupportedModel, match="'1.weight' is torch.float64"):
        Engine(model, loss_fn=lambda m, b: m(b).square().mean())


def test_on_cuda_every_buffer_copy_is_kept_without_comparing(monkeypatch):
    """On CUDA a checkpointed block's buffer copies are kept whole (comparing them reads back
    from the device): BatchNorm's running statistics, updated in forward, and the weights
    stay those of plain PyTorch, and the copies are booked as activations."""
    from tierwise.offload.engine import hooks

    monkeypatch.setattr(hooks.BufferGuard, "compares", staticmethod(lambda device: False))
    compared, kept = [], []
    real_equal, real_after = torch.equal, hooks.BufferGuard.after
    monkeypatch.setattr(torch, "equal", lambda a, b: compared.append(1) or real_equal(a, b))
    monkeypatch.setattr(hooks.BufferGuard, "after", lambda self, taken: kept.append(len(taken)) or real_after(self, taken))
    data = zoo.data(STEPS)
    ref_losses, ref = zoo.reference(zoo.build("batchnorm"), data)
    eng = engine("batchnorm", SMALL, gpu_mem="64M")
    try:
        assert train(eng, data) == ref_losses
        monkeypatch.setattr(torch, "equal", real_equal)
        assert not compared and kept and all(kept)  # (the blocks were recomputed, with their buffers)
        assert_same_as_reference(eng, eng.model, ref)
        assert all(int(m.bn.num_batches_tracked) == STEPS for m in eng.model.blocks)
        assert eng.ledger.usage()["gpu"].get("activation", 0) == 0  # every copy released after backward
    finally:
        eng.close()
