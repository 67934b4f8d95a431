"""The launching thread's work per step, counted on the simulated device (Engine.counters, the
step's metrics): module hook calls, gradient copies to a home tier, host waits on device
progress inside forward and backward. Each count comes from a run whose losses equal plain
PyTorch's, with the blocks as the units of residency and with the modules."""

import pytest
import torch

from tierwise.offload import Budget, Engine
from tierwise.offload.engine.model_info import find_blocks, modules_with_params

from tests.models import batches, tiny_llama, train_reference

CHUNK = 16 << 10


def run(budget: str, steps: int = 4, grad_accum: int = 1):
    model = tiny_llama(layers=4, hidden=64, vocab=128)
    data = batches(steps, batch=4, seq=16)
    ref_losses, _ = train_reference(model, data, grad_accum=grad_accum)
    eng = Engine(model, budget=Budget(gpu=budget, chunk=CHUNK))
    try:
        losses = [eng.step(b, grad_accum=grad_accum) for b in data]
        streamed = {s.chunk: 0 for s in eng.plan.slots.values()  # streamed trainable chunk -> its parameters
                    if not eng.plan.is_frozen(s.chunk) and not eng.store.is_gpu_home(s.chunk)}
        for s in eng.plan.slots.values():
            if s.chunk in streamed:
                streamed[s.chunk] += 1
        return model, eng, losses, ref_losses, dict(eng.counters), streamed
    finally:
        eng.close()


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_blocks_are_the_units_where_the_budget_has_room(grad_accum):
    model, eng, losses, ref, counts, streamed = run("1200K", grad_accum=grad_accum)
    assert losses == ref
    assert eng.units_are_blocks
    blocks = find_blocks(model)
    inside = {id(m) for b in blocks for m in b.modules()}
    outside = [m for m in modules_with_params(model) if id(m) not in inside]
    # one pre and one post hook per block, per module outside the blocks and for the model itself,
    # in each micro-batch's forward; a recompute holds its block's chunks without hooks
    assert counts["hook_calls"] == 2 * (len(blocks) + len(outside) + 1) * grad_accum
    # one copy per streamed trainable chunk (its parameters' sums gathered on the device), not per parameter
    assert counts["grad_copies"] == len(streamed) * grad_accum
    assert 0 < len(streamed) < sum(streamed.values())
    assert counts["host_waits_forward"] == 0  # fetches from host homes: the compute waits, not the host


def test_modules_are_the_units_under_a_tight_budget():
    model, eng, losses, ref, counts, _ = run("480K")
    assert losses == ref
    assert not eng.units_are_blocks
    blocks = find_blocks(model)
    inside = [m for b in blocks for m in b.modules() if m is not b]
    # every module in the forward (a read outside its owner is held for the innermost one), and
    # again those inside a block in its recompute (the block's own forward is called directly)
    called = [m for m in model.modules() if not isinstance(m, torch.nn.ModuleList)]  # (a list is never called)
    assert counts["hook_calls"] == 2 * len(called) + 2 * len(inside)
    assert counts["host_waits_forward"] == 0


def test_the_minimum_is_the_modules_whatever_the_units():
    """Blocks widen the window only where the budget has room: the minimum a refusal names is
    the one with the modules as the units."""
    _, small, *_ = run("480K", steps=1)
    _, roomy, *_ = run("1200K", steps=1)
    assert roomy.units_are_blocks and not small.units_are_blocks
    assert roomy.minimum_gpu_bytes == small.minimum_gpu_bytes


def test_counters_are_in_the_steps_metrics(tmp_path):
    import json

    from typer.testing import CliRunner

    from tierwise.cli.main import app

    r = CliRunner().invoke(app, ["--steps", "3", "--gpu-mem", "4M", "--chunk-size", "64K", "--output",
                                 str(tmp_path / "run")])
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [row for row in rows if row.get("kind") == "train"]
    assert train[-1]["counters"]["hook_calls"] > 0 and "host_waits_forward" in train[-1]["counters"]
