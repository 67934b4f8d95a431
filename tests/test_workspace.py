"""The CUDA workspace (offload.engine.workspace) on the simulated device, the allocator faked:
bytes the allocator held beside the ledger in the warm-up are kept free by the placement."""

import torch

from tierwise.offload import Budget, Engine, Optim
from tierwise.offload.plan.needs import MARGIN_MIN, MARGIN_SHARE
from tests.models import batches, tiny_llama

MISSED = 1 << 20  # what the fake allocator held beyond the ledger at its peak


def run(monkeypatch, *, fake: bool, measured: "int | None" = None):
    """`measured`: Engine.measure() on a larger batch first, the allocator then holding that
    many bytes beside the ledger (MISSED in the steps)."""
    data = batches(3)
    eng = Engine(tiny_llama(hidden=128), budget=Budget(gpu="8M", chunk=16 << 10), optim=Optim(lr=1e-3), device="cpu")
    missed = [MISSED if measured is None else measured]
    if fake:
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda device=None: None)
        monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: eng.ledger.used("gpu") + 5)
        monkeypatch.setattr(cuda, "max_memory_allocated",
                            lambda device=None: eng.ledger.peak_since_mark("gpu") + 5 + missed[0])
        eng.workspace.cuda = True
    if measured is not None:
        eng.measure(batches(1, batch=8)[0])
        missed[0] = MISSED
    losses = [eng.step(b) for b in data]
    return eng, losses


def test_the_placement_leaves_the_measured_workspace_free(monkeypatch):
    plain, plain_losses = run(monkeypatch, fake=False)
    eng, losses = run(monkeypatch, fake=True)
    budget = 8 << 20
    margin = max(MARGIN_MIN, budget // MARGIN_SHARE)
    assert eng.workspace.bytes == MISSED + margin
    assert plain.workspace.bytes == 0
    # without the workspace the cache fills the budget; with it the ledger stays below by that much
    assert plain.ledger.peaks()["gpu"] > budget - eng.workspace.bytes
    assert eng.ledger.peaks()["gpu"] + eng.workspace.bytes <= budget
    assert eng.minimum_gpu_bytes == plain.minimum_gpu_bytes + eng.workspace.bytes
    assert losses == plain_losses  # where bytes live never changes the numbers


def test_a_measured_worst_batch_counts_beside_the_warm_up(monkeypatch):
    """Engine.measure() (the CLI's worst batch) missed more than the warm-up step: the larger counts."""
    eng, _ = run(monkeypatch, fake=True, measured=2 * MISSED)
    budget = 8 << 20
    assert eng.workspace.bytes == 2 * MISSED + max(MARGIN_MIN, budget // MARGIN_SHARE)
    assert eng.ledger.peaks()["gpu"] + eng.workspace.bytes <= budget
