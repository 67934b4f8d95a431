"""The simulated device computes from fp32 masters in host DRAM in place (offload.engine.residency
`_borrow`): no copy into a cache buffer of the same bytes, the same numbers as plain PyTorch."""

import pytest
import torch

from tierwise.offload import Budget, Engine, Optim, flat_options
from tierwise.offload.runtime.cache import ResidentCache
from tierwise.offload.runtime.executor import Executor
from tierwise.offload.runtime.ledger import Ledger
from tierwise.offload.runtime.tiers import Tiers
from tests.models import batches, tiny_llama, train_reference

CHUNK = 16 << 10


def _reads_masters(eng):
    """Forward pre-hooks noting, per call, whether every parameter the module holds resident lies
    in its chunk's host master (True) or elsewhere (False). (A tied head's weight is made
    resident only when it is read: offload.engine.reads.)"""
    seen = []

    def pre(mod, args):
        for p in mod.parameters(recurse=False):
            full = eng.param_names[p]
            cid = eng.plan.slots[full].chunk
            if not (eng.residency.cache.pinned(cid) or eng.store.is_gpu_home(cid)):
                continue
            m = eng.store.chunks[cid].master  # (a chunk promoted after the warm-up has a new one)
            seen.append(isinstance(m, torch.Tensor) and p.untyped_storage().data_ptr() == m.untyped_storage().data_ptr())

    hooks = [m.register_forward_pre_hook(pre) for m in eng.model.modules() if list(m.parameters(recurse=False))]
    return seen, hooks


@pytest.mark.parametrize("tie,grad_accum,clip", [(False, 1, None), (True, 1, None), (True, 2, 1.0)])
def test_host_masters_are_computed_from_in_place_bit_exact(tie, grad_accum, clip):
    """Every streamed chunk's parameters point into its master while its module runs (no buffer
    was filled), the device's bytes are still booked, and the run equals plain PyTorch, with
    early updates during backward (untied; tied: the embedding is read at both ends), and with
    accumulation and clipping (updates after backward)."""
    data = batches(5)
    ref_losses, ref = train_reference(tiny_llama(tie=tie), data, grad_accum=grad_accum, clip=clip)
    eng = Engine(tiny_llama(tie=tie), budget=Budget(gpu="500K", chunk=CHUNK), optim=Optim(lr=1e-3, grad_clip=clip))
    assert not eng.device_plan or len(eng.device_plan.gpu_home) < len(eng.plan.chunks)
    seen, hooks = _reads_masters(eng)
    gpu_compute = []
    eng.residency.cache.on_resident = (lambda c, b, orig=eng.residency.cache.on_resident:
                                       (gpu_compute.append(eng.ledger.usage()["gpu"]["compute"]), orig(c, b)))
    losses = [eng.step(b, grad_accum=grad_accum) for b in data]
    for h in hooks:
        h.remove()
    cache = eng.residency.cache
    assert losses == ref_losses
    mine = dict(eng.named_parameters_fp32())
    assert all(torch.equal(mine[n], p.detach()) for n, p in ref.named_parameters())
    assert seen and all(seen)  # (gpu-home chunks too: theirs are their own masters)
    assert cache.borrowed_bytes == cache.fetched_bytes > 0 and cache.real_bytes == 0 and not cache.spares
    assert min(gpu_compute) > 0  # booked as the device's
    assert eng.early.updated > 0 or clip is not None
    assert eng.residency.kept > 0  # the next forward's first chunks kept over the steps' ends
    peak, budget = eng.ledger.peaks()["gpu"], eng.ledger.budgets["gpu"]
    assert peak <= budget
    eng.close()
    assert eng.ledger.usage()["gpu"].get("compute", 0) == 0


def test_copies_where_the_bytes_must_move_or_must_not_be_touched(tmp_path):
    """Copied, not borrowed: with an emulated link (the copies are what it measures), for MeZO
    (its forward perturbs the compute copies in place), and for masters on NVMe."""
    runs = {
        "link": dict(h2d_bandwidth=50e9, d2h_bandwidth=50e9),
        "mezo": dict(optimizer="mezo"),
        "nvme": dict(cpu_mem="1M", nvme_path=str(tmp_path / "swap")),
    }
    for name, kw in runs.items():
        eng = Engine(tiny_llama(), **flat_options(lr=1e-3, gpu_mem="500K", chunk_bytes=CHUNK, **kw))
        for b in batches(2):
            eng.step(b)
        cache = eng.residency.cache
        if name == "nvme":  # (the masters that fit stay in DRAM: those are borrowed)
            on_nvme = sum(eng.plan.chunks[c].numel * 4 for c in range(len(eng.plan.chunks))
                          if eng.store.compute_tier(c) == "nvme")
            assert on_nvme > 0 and cache.borrowed_bytes <= cache.fetched_bytes - on_nvme
        else:
            assert cache.fetched_bytes > 0 and cache.borrowed_bytes == 0, name
        eng.close()


def test_cache_borrows_a_home_tensor_without_a_buffer():
    """A borrowed chunk is its home tensor: its bytes are booked as the device's while resident,
    nothing is copied, and its eviction keeps no spare and leaves the tensor alone."""
    cpu = torch.device("cpu")
    home = torch.arange(4096, dtype=torch.float32)
    ledger = Ledger({"gpu": None})
    ex = Executor(device=cpu)
    fetched = []
    cache = ResidentCache(tiers=Tiers(ledger=ledger, device=cpu), executor=ex, limit=1 << 20, dtype=torch.float32,
                          numel=lambda c: home.numel(), fetch=lambda c, buf: fetched.append(c),
                          on_resident=lambda c, buf: None, on_evict=lambda c: None,
                          borrow=lambda c: home if c == 0 else None)
    buf = cache.acquire(0)
    assert buf is home and not fetched and ledger.usage()["gpu"]["compute"] == home.nbytes
    cache.release(0)
    cache.evict_all()
    assert ledger.usage()["gpu"].get("compute", 0) == 0 and not cache.spares and cache.real_bytes == 0
    assert torch.equal(home, torch.arange(4096, dtype=torch.float32))
    assert cache.fetched_bytes == cache.borrowed_bytes == home.nbytes
    ex.close()
