"""The Engine's collaborators and helpers, each built without an Engine (offload.engine:
residency, gradients, timeline, surgery, early, actoffload, hooks) and runtime.storage_key."""

import copy
import re

import pytest
import torch
from torch import nn

from tierwise.offload import Activations, Budget, Engine, Optim
from tierwise.offload.core.chunks import pack_chunks, specs_of
from tierwise.offload.core.errors import UnsupportedModel
from tierwise.offload.engine.actoffload import Offloader
from tierwise.offload.engine.early import EarlyUpdater
from tierwise.offload.engine.gradients import GradientRouter
from tierwise.offload.engine.gradspill import GradSpill
from tierwise.offload.engine.hooks import ActivationTracker, install_module_hooks
from tierwise.offload.engine.ranks import RankFailure
from tierwise.offload.engine.residency import Residency
from tierwise.offload.engine.surgery import ModelSurgery
from tierwise.offload.engine.timeline import Timeline
from tierwise.offload.engine.transient import TransientGrads
from tierwise.offload.runtime.cache import ResidentCache
from tierwise.offload.runtime.executor import Executor
from tierwise.offload.runtime.ledger import Ledger
from tierwise.offload.runtime.storage import storage_key
from tierwise.offload.runtime.store import ChunkStore
from tierwise.offload.runtime.tiers import Tiers
from tierwise.offload.runtime.trace import Phase

CPU = torch.device("cpu")


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.b(self.a(x))


def parts(model, *, chunk_bytes=8 * 8 * 4 + 8 * 4):
    """A real store (host homes), ledger, tiers and executor for `model`'s parameters."""
    named = list(model.named_parameters())
    plan = pack_chunks(specs_of(named), chunk_bytes=chunk_bytes)
    ledger = Ledger({"gpu": None, "host": None})
    tiers = Tiers(ledger=ledger, device=CPU)
    store = ChunkStore(plan=plan, tiers=tiers, compute_dtype=torch.float32, state_bytes=lambda c: 0,
                       needs_grad=True, homes={c.index: {"master": "host"} for c in plan.chunks})
    ex = Executor(device=CPU)
    return named, plan, ledger, tiers, store, ex


# -- storage_key ---------------------------------------------------------------------------
def test_storage_key_tells_empty_storages_apart_and_views_together():
    a, b = torch.empty(0), torch.empty(0)
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # why not data_ptr
    assert storage_key(a) != storage_key(b)
    t = torch.zeros(6)
    assert storage_key(t[2:]) == storage_key(t.view(2, 3)) == storage_key(t.untyped_storage())


# -- timeline ------------------------------------------------------------------------------
def test_timeline_records_one_step_and_times_phases_that_end():
    ledger = Ledger({"gpu": None, "host": None})
    tl = Timeline(ledger)
    tl.begin_step(0)
    with tl.timed(Phase.FORWARD):
        ledger.reserve("gpu", "activation", 100)
        tl.moment()
    assert tl.rows == [{"moment": 0, "phase": "forward", "bytes": {"gpu": 100, "host": 0}}]
    tl.begin_step(0)  # the warm-up recorded already: a measure()d step is not recorded twice
    assert not tl.recording and len(tl.rows) == 1
    tl.begin_step(2)
    tl.moment()
    assert len(tl.rows) == 1
    spent = tl.phase_times["backward"]
    with pytest.raises(RuntimeError), tl.timed(Phase.BACKWARD):
        raise RuntimeError
    assert tl.phase_times["backward"] == spent and tl.phase_times["forward"] > 0


# -- gradient router -----------------------------------------------------------------------
def router(store, ex, ledger, names, *, reserve=0, early=None):
    return GradientRouter(store=store, executor=ex, ledger=ledger, param_names=names,
                          grad_reserve=lambda: reserve, early=early, compute_itemsize=4,
                          new_spill=lambda: GradSpill(store, None, None, ex))


def test_router_accumulates_like_pytorch_and_gives_the_bytes_back():
    torch.manual_seed(0)
    model = Two()
    ref = copy.deepcopy(model)
    named, plan, ledger, _, store, ex = parts(model)
    r = router(store, ex, ledger, {p: n for n, p in named})
    hooks = [p.register_post_accumulate_grad_hook(r.grad_ready) for _, p in named]
    xs = [torch.randn(3, 8) for _ in range(2)]
    r.begin_step()
    for x in xs:
        r.begin_backward()
        model(x).square().sum().backward()
        r.end_backward()
        ref(x).square().sum().backward()
    r.finish_step(dict(named), zero_unseen=True)
    for name, p in ref.named_parameters():
        assert torch.equal(plan.slots[name].view(store.chunks[plan.slots[name].chunk].grad), p.grad), name
        assert dict(named)[name].grad is None  # handed over, not kept on the device
    # the second backward gathers each chunk's gradients in one buffer, sent at once (the simulated
    # device): one chunk's at most; the first, per parameter, one parameter's
    assert ledger.usage()["gpu"].get("grad", 0) == 0 and ledger.peaks()["gpu"] <= 4 * max(c.numel for c in plan.chunks)
    assert r.uses == {n: 1 for n, _ in named}
    for h in hooks:
        h.remove()
    ex.close()


def test_a_gathered_chunk_whose_copy_fails_gives_its_bytes_back():
    """A chunk's gathered gradients whose copy to the host cannot start (here: the copy raises)
    leave nothing booked on the device, once the failed step is aborted as Engine.step does."""
    torch.manual_seed(0)
    model = Two()
    named, plan, ledger, _, store, ex = parts(model)
    ex.lanes["d2h"].link.bandwidth = 1e15  # an emulated link: sends go through the executor
    r = router(store, ex, ledger, {p: n for n, p in named}, reserve=1 << 20)
    hooks = [p.register_post_accumulate_grad_hook(r.grad_ready) for _, p in named]
    x = torch.randn(3, 8)
    r.begin_step()
    r.begin_backward()
    model(x).sum().backward()  # the first backward counts the uses, per parameter
    r.end_backward()
    assert r.gather_from  # the next backward gathers

    def fails(*a, **k):
        raise RuntimeError("copy refused")

    real, ex.copy = ex.copy, fails
    r.begin_backward()
    with pytest.raises(RuntimeError, match="copy refused"):
        model(x).sum().backward()
    ex.copy = real
    r.abort()
    assert ledger.usage()["gpu"].get("grad", 0) == 0
    for h in hooks:
        h.remove()
    ex.close()


def test_router_submits_a_chunk_early_once_all_its_sums_are_in():
    torch.manual_seed(0)
    model = Two()
    named, plan, ledger, _, store, ex = parts(model)
    submitted = []

    class Early:
        done: set = set()

        def submit(self, cid, tickets, handed=None, final=True):
            submitted.append((cid, len(tickets)))

        def wait(self):
            pass

    r = router(store, ex, ledger, {p: n for n, p in named}, early=Early())
    hooks = [p.register_post_accumulate_grad_hook(r.grad_ready) for _, p in named]
    x = torch.randn(3, 8)
    for early_on in (False, True):  # the first backward only counts
        r.begin_step()
        r.early_on = early_on
        r.begin_backward()
        model(x).sum().backward()
        r.end_backward()
    # once each, with nothing to wait for: the chunk's gradients gathered, then sent at once (the
    # simulated device without an emulated link copies on the launching thread)
    assert len(plan.chunks) == 2 and sorted(submitted) == [(0, 0), (1, 0)]
    for h in hooks:
        h.remove()
    ex.close()


def test_router_refusal_names_the_setting_that_helps():
    """A contribution more than traced after the chunk went early: one rank (or grad_reduce="step")
    says overlap_update=False; owned-only gradients reduce early whatever the overlap: "step"."""
    model = Two()
    named, plan, ledger, _, store, ex = parts(model)
    slot = plan.slots["a.weight"]
    for transient, fix in ((None, "overlap_update=False"), (object(), 'grad_reduce="step"')):
        r = router(store, ex, ledger, {p: n for n, p in named})
        r.transient, r.reduce_on, r.early_on = transient, transient is not None, transient is None
        r._learn_uses({n: 1 for n, _ in named})
        r._counts, r._submitted = {"a.weight": 2}, {slot.chunk}
        with pytest.raises(UnsupportedModel, match=f"contribution 2 .*use {re.escape(fix)} for"):
            r._arrived_grad(slot.chunk, ("a.weight",), None)
    ex.close()


# -- residency -----------------------------------------------------------------------------
def residency(model, **kw):
    named, plan, ledger, tiers, store, ex = parts(model)
    params = dict(named)
    store.load([(n, p.detach().clone()) for n, p in named], params)
    names = {p: n for n, p in named}
    chunks = {m: sorted({plan.slots[names[p]].chunk for p in m._parameters.values()})
              for m in (model.a, model.b)}
    res = Residency(store=store, tiers=tiers, executor=ex, limit=1 << 20, params=params, param_names=names,
                    module_chunks=chunks, timeline=Timeline(ledger), name_of=lambda m: f"<{type(m).__name__}>", **kw)
    return res, ex


def test_residency_points_parameters_while_their_module_runs():
    torch.manual_seed(0)
    model = Two()
    want = model.a.weight.detach().clone()
    res, ex = residency(model)
    assert torch.isnan(model.a.weight).all()  # not resident: a NaN placeholder
    with pytest.raises(UnsupportedModel, match="<Linear> ran outside"):
        res.enter_module(model.a)
    with res.reading():
        res.enter_module(model.a)
        assert torch.equal(model.a.weight, want) and res.cache.pinned(0)
        assert storage_key(model.a.weight) in res.streamed_storage
        res.exit_module(model.a)
        assert not res.cache.pinned(0)
    ex.close()


def test_residency_lends_a_parameter_read_elsewhere_to_the_running_frame():
    torch.manual_seed(0)
    model = Two()
    res, ex = residency(model)
    with res.reading(), res.guard:
        res.enter_module(model.a)
        torch.nn.functional.linear(torch.ones(1, 8), model.b.weight)  # b's weight, read in a's frame
        assert res.cache.pinned(1)
        res.exit_module(model.a)
        assert not res.cache.pinned(1)
    ex.close()
    res, ex = residency(model, borrow_refusal="mezo")
    with pytest.raises(UnsupportedModel, match="'b.weight' is read by <Linear>.*mezo"):
        with res.reading(), res.guard:
            res.enter_module(model.a)
            torch.nn.functional.linear(torch.ones(1, 8), model.b.weight)
    ex.close()


def test_cache_reuses_evicted_buffers_within_its_limit_on_the_simulated_device():
    """An evicted buffer is kept as a spare and the next fetch reuses the smallest that holds it;
    the ledger counts each chunk's own bytes, the real bytes (live + spares) stay within the
    limit, and every fetched copy holds its chunk's values."""
    k = 1024  # elements per 4096 bytes: the simulated device's buffers are rounded up to that
    sizes = {0: 100 * k, 1: 60 * k, 2: 80 * k, 3: 120 * k}
    src = {c: torch.arange(n, dtype=torch.float32) + 1000 * c for c, n in sizes.items()}
    ledger = Ledger({"gpu": None})
    ex = Executor(device=CPU)
    cache = ResidentCache(tiers=Tiers(ledger=ledger, device=CPU), executor=ex, limit=190 * k * 4, dtype=torch.float32,
                          numel=sizes.__getitem__, fetch=lambda c, buf: ex.copy("h2d", buf, src[c]),
                          on_resident=lambda c, buf: None, on_evict=lambda c: None)
    storages = {}

    def use(cid):
        buf = cache.acquire(cid)
        assert torch.equal(buf, src[cid]) and buf.numel() == sizes[cid]
        assert buf.data_ptr() % 4096 == 0 and buf.storage_offset() == 0  # (NVMe reads in place; hooks)
        storages[cid] = buf.untyped_storage().data_ptr()
        cache.release(cid)
        assert ledger.usage()["gpu"]["compute"] == cache.bytes == sum(4 * sizes[c] for c in cache.entries)
        assert cache.real_bytes + sum(4 * t.numel() for t in cache.spares) <= cache.limit

    use(0)  # (sizes in the comments: in k elements)
    use(1)  # 160 elements live
    first_of_1 = storages[1]
    cache.apply((0,), ())  # 0 becomes a spare (100 elements: 160 in all, within 190)
    assert [t.numel() for t in cache.spares] == [100 * k]
    use(2)  # 80 elements: in 0's buffer
    assert storages[2] == storages[0] and not cache.spares
    cache.evict_all()  # 1 and 0's buffer: 160 elements of spares
    assert sorted(t.numel() for t in cache.spares) == [60 * k, 100 * k]
    use(1)  # the smallest spare that holds 60 elements: its own
    assert storages[1] == first_of_1 and [t.numel() for t in cache.spares] == [100 * k]
    use(3)  # 120 elements: no spare holds it, and 60 + 100 + 120 would pass 190: the spare goes
    assert not cache.spares and cache.real_bytes == 4 * k * (60 + 120)
    cache.limit = 150 * k * 4  # lowered: what is evicted now is not kept
    cache.evict_all()
    assert cache.real_bytes == 0 and sum(t.numel() for t in cache.spares) <= 150 * k
    cache.keep_spares = False  # (CUDA: its allocator reuses blocks)
    cache.spares.clear()
    use(0)
    cache.evict_all()
    assert not cache.spares
    ex.close()


def test_cache_lends_a_filled_buffer_and_eviction_waits_for_it():
    """`lent`: a resident chunk's buffer once an acquisition waited for its fetch (None while a
    prefetch fills it, or when absent); evicting it waits until the borrower is done."""
    import threading

    sizes = {0: 64, 1: 64}
    src = {c: torch.full((n,), float(c + 1)) for c, n in sizes.items()}
    ex = Executor(device=CPU)
    cache = ResidentCache(tiers=Tiers(ledger=Ledger({"gpu": None}), device=CPU), executor=ex, limit=1 << 20,
                          dtype=torch.float32, numel=sizes.__getitem__, fetch=lambda c, buf: ex.copy("h2d", buf, src[c]),
                          on_resident=lambda c, buf: None, on_evict=lambda c: None)
    with cache.lent(0) as buf:
        assert buf is None  # absent
    cache.apply((), (1,))  # prefetched, no acquisition yet
    with cache.lent(1) as buf:
        assert buf is None
    cache.acquire(0)
    cache.release(0)
    inside, leave, evicted = threading.Event(), threading.Event(), threading.Event()
    seen = []

    def borrower():
        with cache.lent(0) as buf:
            seen.append(buf.clone())
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=borrower)
    t.start()
    inside.wait(10)
    e = threading.Thread(target=lambda: (cache.apply((0,), ()), evicted.set()))
    e.start()
    assert not evicted.wait(0.2)  # held while lent
    leave.set()
    assert evicted.wait(10)
    t.join(), e.join()
    assert torch.equal(seen[0], src[0]) and not cache.resident(0)
    ex.close()


def test_evicting_a_chunk_whose_fetch_failed_waits_for_it_and_does_not_raise():
    """The fetch's error goes to whoever uses the bytes (an acquisition); evicting the unused
    buffer (a prefetch, or close() dropping what the failed step left) only waits for the copy."""
    sizes = {0: 64, 1: 64}
    ex = Executor(device=CPU)

    def fetch(c, buf):
        def fn(stream):
            raise OSError(f"chunk {c}: checksum mismatch")
        return ex.job("h2d", fn, nbytes=0)

    ledger = Ledger({"gpu": None})
    cache = ResidentCache(tiers=Tiers(ledger=ledger, device=CPU), executor=ex, limit=1 << 20,
                          dtype=torch.float32, numel=sizes.__getitem__, fetch=fetch,
                          on_resident=lambda c, buf: None, on_evict=lambda c: None)
    cache.apply((), (0, 1))
    with pytest.raises(OSError, match="chunk 0: checksum mismatch"):
        cache.acquire(0)
    cache.release(0)
    cache.evict_all()
    assert not cache.entries and ledger.usage()["gpu"].get("compute", 0) == 0
    ex.close()


# -- surgery -------------------------------------------------------------------------------
def hook_state(model):
    return [(type(m).__name__, "forward" in m.__dict__, len(m._forward_pre_hooks), len(m._forward_hooks),
             len(m._forward_hooks_always_called)) for m in model.modules()]


def test_surgery_undoes_every_change():
    model = Two()
    model.register_buffer("scale", torch.ones(2))
    model.config = type("Config", (), {"use_cache": True})()
    before = hook_state(model)
    s = ModelSurgery(model)
    s.patch_forward(model.a, lambda f: lambda x: f(x) * 0)
    s.patch_forward(model.a, lambda f: lambda x: f(x) + 1)
    s.keep(install_module_hooks(list(model.modules()), lambda m, args: None, lambda m, args, out: None))
    s.disable_kv_cache()
    assert model.config.use_cache is False and hook_state(model) != before
    assert torch.equal(model.a(torch.ones(1, 8)), torch.ones(1, 8))
    s.close()
    assert hook_state(model) == before and model.config.use_cache is True
    s.close()  # once
    assert model.config.use_cache is True


def test_engine_close_gives_the_model_back_unpatched():
    """After close() the modules have their own forward and no hooks, and with the trained
    weights loaded back the model computes what an untouched copy does."""
    from tests.models import batches, tiny_llama

    torch.manual_seed(0)
    model = tiny_llama(layers=2, hidden=32)
    twin = copy.deepcopy(model)
    before = hook_state(model)
    eng = Engine(model, budget=Budget(gpu=None, cpu=None), optim=Optim(lr=1e-2),
                 activations=Activations(recompute=True))
    data = batches(1)
    eng.step(data[0])
    weights = dict(eng.named_parameters_fp32())
    eng.close()
    assert hook_state(model) == before and model.config.use_cache == twin.config.use_cache
    model.load_state_dict(weights, strict=False, assign=True)
    twin.load_state_dict(weights, strict=False)
    model.eval(), twin.eval()
    with torch.no_grad():
        assert torch.equal(model(**data[0]).logits, twin(**data[0]).logits)


def test_a_backward_that_raises_drops_the_steps_gradients():
    """Any error in backward (here a hook's; a rank's timeout, UnsupportedModel), not only a
    budget: the cycle ends, the gradients of the failed step are gone and nothing stays booked."""
    from tests.models import batches, tiny_llama

    torch.manual_seed(0)
    eng = Engine(tiny_llama(layers=2, hidden=32), budget=Budget(gpu=None, cpu=None), optim=Optim(lr=1e-2))
    data = batches(2)
    eng.step(data[0])
    between = eng.ledger.usage()  # between steps
    loss = eng.forward(data[1])
    p = next(q for q in eng.params.values() if q.requires_grad)

    def fail(grad):
        raise RuntimeError("a peer stopped")

    handle = p.register_hook(fail)
    with pytest.raises(RuntimeError, match="a peer stopped"):
        eng.backward(loss)
    handle.remove()
    assert not eng._in_cycle
    assert all(not c.grad.any() for c in eng.store.chunks if isinstance(c.grad, torch.Tensor))
    assert eng.ledger.usage() == between
    eng.close()


# -- helpers -------------------------------------------------------------------------------
def test_early_updater_runs_the_given_update_and_reraises_its_error():
    seen = []
    early = EarlyUpdater(lambda chunks, handed, final: seen.extend(chunks))
    early.submit(3, [])
    early.wait()
    assert seen == [3] and early.done == {3}
    early.update = lambda chunks, handed, final: 1 / 0
    early.submit(4, [])
    with pytest.raises(ZeroDivisionError):
        early.wait()
    early.close()


def test_transient_grads_wake_a_full_window_when_the_reduce_worker_fails():
    """A peer dies in the worker's reduce: the compute thread waiting for a window slot that
    only that reduce would free raises instead of waiting for ever; the worker reduces nothing
    more (a collective out of step), and an abort (free_all) leaves the window empty."""
    import threading

    named = [(f"w{i}", torch.zeros(8, 8)) for i in range(4)]
    plan = pack_chunks(specs_of(named), chunk_bytes=8 * 8 * 4)  # one chunk per weight
    ledger = Ledger({"gpu": None, "host": None})
    tg = TransientGrads(plan, Tiers(ledger=ledger, device=CPU), window=2 * 8 * 8 * 4)
    reduced, entered, go = [], threading.Event(), threading.Event()

    def reduce(chunks, handed, final=True):  # a gloo reduce whose peer is gone
        entered.set()
        go.wait()
        reduced.extend(chunks)
        raise RuntimeError("Connection closed by peer")

    early = EarlyUpdater(reduce, on_error=tg.fail)
    tg.target(0), tg.target(1)
    tg.queue(0)
    early.submit(0, [], final=False)
    assert entered.wait(timeout=30)
    early.submit(1, [], final=False)  # behind the failing one: skipped
    raised = []

    def compute():
        try:
            tg.target(2)  # the window is full: waits for chunk 0's reduce
        except RankFailure as exc:
            raised.append(exc)

    t = threading.Thread(target=compute, daemon=True)
    t.start()
    go.set()
    t.join(timeout=30)
    assert not t.is_alive(), "target() still waits after the worker failed"
    assert len(raised) == 1 and "Connection closed by peer" in str(raised[0])
    with pytest.raises(RuntimeError, match="Connection closed"):
        early.wait()
    assert reduced == [0]  # chunk 1's reduce never ran
    tg.free_all()
    assert tg.bufs == {} and tg.queued == set() and tg.bytes == 0
    assert ledger.usage()["host"].get("grad", 0) == 0
    assert tg.target(2).numel() == 64  # usable again after the abort
    early.close()


def test_offloader_moves_block_inputs_to_host_in_forward_only():
    ledger = Ledger({"gpu": None, "host": None})
    ex = Executor(device=CPU)
    phase = [Phase.FORWARD]
    off = Offloader(ledger=ledger, tiers=Tiers(ledger=ledger, device=CPU), executor=ex, device=CPU,
                    phase=lambda: phase[0])
    t = torch.arange(16.0).requires_grad_()
    assert not off.wants(t)  # not inside a checkpointed block's save
    off.active = True
    assert off.wants(t)
    item = off.pack(t)
    off.end_forward()
    assert ledger.usage()["gpu"].get("activation", 0) == 0 and ledger.usage()["host"]["activation"] == 64
    assert torch.equal(off.unpack(item), t.detach())
    phase[0] = Phase.BACKWARD
    assert not off.wants(t)
    del item
    ex.close()


class _Unlanded:
    """A copy to the device that reports itself not landed until `landed()` (CUDA's enqueued
    copy, which the simulated device never shows: its copies are over when enqueued)."""

    def __init__(self, ticket):
        self.ticket, self.has_landed = ticket, False

    def wait(self):
        self.ticket.wait()

    def done(self):
        return self.has_landed

    def landed(self):
        self.ticket.landed()
        self.has_landed = True


class _CopiesLandLate:
    def __init__(self, ex):
        self.ex, self.h2d = ex, []

    def copy(self, lane, dst, src, **kw):
        ticket = self.ex.copy(lane, dst, src, **kw)
        if lane == "h2d":
            self.h2d.append(ticket := _Unlanded(ticket))
        return ticket

    def wait(self, ticket):
        ticket.wait()


def test_an_offloaded_inputs_host_buffer_outlives_its_copy_back():
    ledger = Ledger({"gpu": None, "host": None})
    ex = Executor(device=CPU)
    late = _CopiesLandLate(ex)
    off = Offloader(ledger=ledger, tiers=Tiers(ledger=ledger, device=CPU), executor=late, device=CPU,
                    phase=lambda: Phase.FORWARD)
    off.active = True
    t = torch.arange(16.0).requires_grad_()
    item = off.pack(t)
    off.end_forward()
    assert torch.equal(off.unpack(item), t.detach())
    del item  # autograd drops the saved input: its copy back may still be reading the host buffer
    assert ledger.usage()["host"]["activation"] == 64 and len(off.parked) == 1
    assert not late.h2d[0].has_landed
    off.end_backward()
    assert late.h2d[0].has_landed and off.parked == []
    assert off.spare_bytes == 64  # (kept for the next step's inputs, booked until trimmed)
    off.trim()
    assert ledger.usage()["host"].get("activation", 0) == 0
    ex.close()


def test_activation_tracker_books_activations_and_refers_to_chunks():
    ledger = Ledger({"gpu": None, "host": None})
    chunk = torch.zeros(8)

    class Res:
        streamed_storage = {storage_key(chunk): 5}
        home_storage: dict = {}
        touched: list = []

        def touch_chunk(self, cid):
            self.touched.append(cid)
            return chunk

        def holds(self, cid):
            return False

    res = Res()
    tr = ActivationTracker(res, ledger, CPU)
    ref = tr.pack(chunk[2:4])
    assert torch.equal(tr.unpack(ref), chunk[2:4]) and res.touched == [5]
    act = torch.ones(4)
    held = [tr.pack(act), tr.pack(act[1:])]  # one storage, booked once
    assert ledger.usage()["gpu"]["activation"] == 16
    del held
    assert ledger.usage()["gpu"].get("activation", 0) == 0


def test_the_engines_cuda_device_carries_its_index(monkeypatch):
    # tensors report cuda:0, and torch.device("cuda") != torch.device("cuda:0"): without the
    # index no activation would be on the engine's device
    from tierwise.offload.runtime.tiers import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert pick_device() == torch.device("cuda", 1)
    assert pick_device("cuda") == torch.device("cuda", 1)
    assert pick_device("cuda:0") == torch.device("cuda", 0)
    assert pick_device("cpu") == torch.device("cpu")
