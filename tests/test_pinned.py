"""Pinned host memory in exact bytes: with CUDA faked (the register calls recorded), what an
engine registers is its ledger's host bytes, page by page, where `pin_memory()`'s caching
allocator rounds each block up to a power of two. Exactness against plain PyTorch is unchanged."""

from __future__ import annotations


import tierwise.offload.engine.needs as needs
from tierwise.offload import Budget, Engine, Optim
from tierwise.offload.runtime.pinned import PAGE, HostPinner
from tierwise.offload.runtime.tiers import Tiers
from tests.models import batches, tiny_llama, train_reference


class FakeCuda:
    """cudaHostRegister / cudaHostUnregister as calls recorded: {ptr: bytes} registered now."""

    def __init__(self):
        self.live: dict[int, int] = {}
        self.peak = 0

    def register(self, ptr: int, nbytes: int) -> int:
        assert ptr % PAGE == 0 and nbytes % PAGE == 0 and ptr not in self.live
        self.live[ptr] = nbytes
        self.peak = max(self.peak, sum(self.live.values()))
        return 0

    def unregister(self, ptr: int) -> int:
        assert ptr in self.live, "unregistering what was not registered"
        del self.live[ptr]
        return 0


def test_pinner_registers_exact_pages_and_unregisters():
    cuda = FakeCuda()
    pin = HostPinner(register=cuda.register, unregister=cuda.unregister)
    a, b = pin.empty(132 << 20), pin.empty(5000)
    assert a.numel() == 132 << 20 and b.numel() == 5000
    assert sum(cuda.live.values()) == (132 << 20) + 2 * PAGE == pin.registered  # not 256 MiB + 8 KiB
    pin.free(a)
    assert sum(cuda.live.values()) == 2 * PAGE
    pin.close()
    assert not cuda.live


def test_a_refused_register_leaves_pageable_memory_and_says_so(caplog):
    pin = HostPinner(register=lambda p, n: 1, unregister=lambda p: 0)
    t = pin.empty(100)
    assert t.numel() == 100 and pin.failed and pin.registered == 0
    assert "cudaHostRegister" in caplog.text


def test_cudas_register_runs_on_a_thread_of_its_own(monkeypatch):
    # a refused register is also the calling thread's pending CUDA error: on the launching
    # thread, torch's next kernel launch check would raise it as that kernel's
    import threading

    import torch

    threads = []

    class Runtime:
        def cudaHostRegister(self, ptr, n, flags):
            threads.append(threading.current_thread())
            return 2  # refused (out of lockable memory)

        def cudaHostUnregister(self, ptr):
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Runtime())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    pin = HostPinner()
    assert pin.empty(100).numel() == 100 and pin.failed
    assert threads and threads[0] is not threading.current_thread()


def test_engine_registers_its_ledgers_host_bytes(tmp_path, monkeypatch):
    cuda = FakeCuda()

    class PinnedTiers(Tiers):  # the simulated device, with host memory registered as on a GPU
        def __init__(self, **kw):
            super().__init__(**kw, pinner=HostPinner(register=cuda.register, unregister=cuda.unregister))

    monkeypatch.setattr(needs, "Tiers", PinnedTiers)
    data = batches(3)
    ref_losses, _ = train_reference(tiny_llama(), data)
    eng = Engine(tiny_llama(), budget=Budget(gpu="500K", cpu="1M", chunk=16 << 10, nvme=str(tmp_path / "swap")),
                 optim=Optim(lr=1e-3))
    assert eng.homes.bytes["nvme"]  # host chunks and NVMe bounce buffers both live in the host tier
    assert [eng.step(b) for b in data] == ref_losses
    host = eng.ledger.used("host")
    registered = sum(cuda.live.values())
    allocations = len(cuda.live)
    assert host <= registered <= host + allocations * (PAGE - 1), (host, registered, allocations)
    assert cuda.peak <= eng.ledger.budgets["host"] + allocations * (PAGE - 1)
    eng.close()
    assert not cuda.live  # nothing stays registered past the engine


def test_offloaded_activations_reuse_their_registered_buffers(monkeypatch):
    """Block inputs offloaded to host memory: their buffers are registered once, then reused
    step after step (registering takes milliseconds and serialises the device's streams),
    booked as activations all along: what is registered is still the ledger's host bytes. A
    shorter batch takes the first bytes of a longer one's buffers; a longer one frees the
    spares too small for it."""
    from tierwise.offload import Activations

    cuda = FakeCuda()
    calls = []

    def register(ptr, n):
        calls.append(n)
        return cuda.register(ptr, n)

    class PinnedTiers(Tiers):
        def __init__(self, **kw):
            super().__init__(**kw, pinner=HostPinner(register=register, unregister=cuda.unregister))

    monkeypatch.setattr(needs, "Tiers", PinnedTiers)
    full = batches(6)
    short = [{k: v[:, : v.shape[1] // 2] for k, v in b.items()} for b in full]
    data = [short[0], short[1], short[2], full[3], full[4], short[5]]
    ref_losses, _ = train_reference(tiny_llama(), data)
    eng = Engine(tiny_llama(), budget=Budget(gpu="600K", cpu="4M", chunk=16 << 10), optim=Optim(lr=1e-3),
                 activations=Activations(recompute=True, offload=True, host=64 << 10))
    eng.measure(full[0])  # (placed for the longest batch)
    seen = []  # per step: (registrations so far, spare bytes, the ledger's host activations)

    def booked():
        assert eng.ledger.used("host") <= sum(cuda.live.values()) <= eng.ledger.used("host") + len(cuda.live) * (PAGE - 1)
        return len(calls), eng.tracker.offloader.spare_bytes, eng.ledger.usage()["host"]["activation"]

    losses = []
    for b in data:
        losses.append(eng.step(b))
        seen.append(booked())
    assert losses == ref_losses
    assert all(spares > 0 and spares == act for _, spares, act in seen)
    assert len({n for n, *_ in seen}) == 1  # nothing registered after the first step, short batch or long
    off = eng.tracker.offloader
    (key, spares), = off._spare.items()
    longest = max(b.numel() for b in spares)
    more = off.host_empty(key[0], longest + 1, key[1])  # longer than any: the spares are freed, a new one made
    assert off.spare_bytes == 0 and eng.ledger.usage()["host"]["activation"] == more.numel() * more.element_size()
    assert len(calls) == seen[-1][0] + 1
    off.spare(key[0], more)
    assert off.spare_bytes == eng.ledger.usage()["host"]["activation"]
    eng.close()
    assert not cuda.live
