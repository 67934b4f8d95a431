"""A block's recompute without the saved-tensor hooks (offload.engine.hooks.recomputing): once
two recomputes of the same inputs saved the same sizes, later ones book that sum as one. Against
the same run with the hooks on every recompute (`tracker.lumps = False`) and plain PyTorch: the
losses are equal, the ledger's activation peak is equal, and the hooks really ran less; a block
whose saved sizes follow the data keeps the hooks."""

from __future__ import annotations

import torch

from tierwise.offload import Budget, Engine, flat_options
from tests import module_zoo as zoo
from tests.models import batches, tiny_llama, train_reference


LEARNING = 3  # the warm-up, then two steps after the placement: learned from the fourth on


def _llama_run(data: list[dict], *, lumps: bool, learning: int = LEARNING) -> tuple[list[float], int, dict, Engine]:
    """Losses, the activation peak of the steps after `learning`, the last step's counters."""
    model = tiny_llama(layers=4, hidden=64, vocab=128)
    eng = Engine(model, budget=Budget(gpu="1200K", chunk=16 << 10))
    eng.tracker.lumps = lumps
    try:
        losses = [eng.step(b) for b in data[:learning]]
        eng.ledger.reset_peaks()
        losses += [eng.step(b) for b in data[learning:]]
        return losses, eng.ledger.kind_peak("gpu", "activation"), dict(eng.counters), eng
    finally:
        eng.close()


def test_a_learned_recompute_books_the_same_bytes_without_the_hooks():
    data = batches(6, batch=4, seq=16)
    ref, _ = train_reference(tiny_llama(layers=4, hidden=64, vocab=128), data)
    hooked, hooked_peak, hooked_counts, _ = _llama_run(data, lumps=False)
    lumped, lumped_peak, lumped_counts, eng = _llama_run(data, lumps=True)
    assert lumped == hooked == ref
    assert lumped_peak == hooked_peak > 0
    assert eng.ledger.usage()["gpu"].get("activation", 0) == 0  # every lump given back
    # the last step packed only what the blocks' inputs and the modules outside them save
    assert 0 < lumped_counts["saved_tensor_hooks"] < hooked_counts["saved_tensor_hooks"] / 3
    assert [v for v in eng.tracker.learned.values() if type(v) is int]  # learned, not refused


def test_inputs_of_another_shape_are_learned_apart():
    short, long = batches(4, batch=4, seq=16), batches(4, batch=4, seq=24, seed=3)
    data = [b for pair in zip(long, short) for b in pair]  # 24, 16, 24, ... (the warm-up measures the longer)
    ref, _ = train_reference(tiny_llama(layers=4, hidden=64, vocab=128), data)
    # each length is learned in two steps after the placement: steps 7 and 8 book learned sums
    hooked, hooked_peak, _, _ = _llama_run(data, lumps=False, learning=6)
    lumped, lumped_peak, _, eng = _llama_run(data, lumps=True, learning=6)
    assert lumped == hooked == ref
    assert lumped_peak == hooked_peak
    sums = {v for v in eng.tracker.learned.values() if type(v) is int}
    assert len(sums) >= 2  # (a block's sum at 16 tokens is not its sum at 24)


def test_only_known_decoder_families_recompute_without_the_hooks():
    """A module whose blocks the engine knows nothing of keeps the hooks on every recompute (a
    `nonzero` in it would size what it saves by the data)."""
    eng = Engine(zoo.build("routed"), **flat_options(lr=1e-3, chunk_bytes=4 << 10, loss_fn=zoo.lm_loss, gpu_mem="64M"))
    try:
        assert not eng.tracker.lumps
        for b in zoo.data(4):
            eng.step(b)
        assert not eng.tracker.learned
    finally:
        eng.close()
    llama = Engine(tiny_llama(layers=2, hidden=64, vocab=128), budget=Budget(gpu="64M"))
    try:
        assert llama.tracker.lumps
    finally:
        llama.close()


def test_a_block_whose_saved_sizes_follow_the_data_keeps_the_hooks():
    """The second line of defence, where lumps are allowed: two recomputes that saved different
    sizes keep the hooks for good."""
    data = zoo.data(4)
    ref, _ = zoo.reference(zoo.build("routed"), data)
    eng = Engine(zoo.build("routed"), **flat_options(lr=1e-3, chunk_bytes=4 << 10, loss_fn=zoo.lm_loss, gpu_mem="64M"))
    eng.tracker.lumps = True
    try:
        torch.manual_seed(2)
        assert [eng.step(b) for b in data] == ref
        assert eng.tracker.learned and all(v is None for v in eng.tracker.learned.values())
        assert eng.ledger.usage()["gpu"].get("activation", 0) == 0
    finally:
        eng.close()
