"""One device-needs formula (offload.plan.needs) and one set of NVMe bounce-buffer sizes
(offload.plan.homes.bounce_sizes): the engine and the planner, fed the same model, chunking,
optimizer and activations, compute the same DeviceNeeds and the same bounce bytes."""

import pytest

from tierwise.offload import Activations, Budget, Engine, Optim, Precision
from tierwise.offload.engine.model_info import model_specs
from tierwise.offload.plan import needs, planner
from tierwise.offload.plan.homes import bounce_sizes
from tierwise.offload.plan.placement import DeviceNeeds

from tests.models import tiny_llama


@pytest.mark.parametrize("optimizer, precision, tie", [("adamw", "fp32", False), ("galore", "bf16", True),
                                                       ("mezo", "bf16", False), ("adamw8bit", "fp32", True)])
def test_engine_and_planner_call_one_formula(optimizer, precision, tie):
    model = tiny_llama(layers=2, hidden=32, vocab=128, tie=tie)
    specs = model_specs(model)
    eng = Engine(model, budget=Budget(chunk=8 << 10), optim=Optim(optimizer), precision=Precision(precision),
                 activations=Activations(expected=12345))
    try:
        ch = planner._Chunks(model=None, optimizer=optimizer, precision=precision, chunk_bytes=8 << 10,
                             rank=None, params=specs)
        assert ch.kinds == [{k: v for k, v in eng.kinds[c].items() if v} for c in range(ch.n)]
        # both choose their units of residency by one rule (the blocks here: no gpu limit; MeZO: modules)
        blocks = ch.choose_blocks(buffers=eng.buffer_bytes, activations=12345, gpu_budget=None, margin=0)
        assert blocks == eng.units_are_blocks == (optimizer != "mezo")
        planned = ch.device_needs(buffers=eng.buffer_bytes, activations=12345)
        assert isinstance(planned, DeviceNeeds) and planned == eng.needs
    finally:
        eng.close()


def test_formula_pieces():
    got = needs.device_needs(compute=[10, 30, 20], home=[40, 90, 60], module_chunks=[[0], [0, 1], [2]],
                             module_numels=[3, 7], largest_param=5, element_size=2, needs_grad=True,
                             buffers=1, activations=100)
    assert (got.stream_window, got.grad_reserve, got.minimum) == (40 + 30, 10, 1 + 70 + 10 + 100)
    zo = needs.device_needs(compute=[10], home=[40], module_chunks=[[0]], module_numels=[3, 7], largest_param=5,
                            element_size=2, needs_grad=False, buffers=0, activations=0, pinned=99)
    assert (zo.stream_window, zo.grad_reserve) == (99 + 10, 2 * 2 * 7)


def test_bounce_buffers_are_the_planned_ones(tmp_path):
    """The engine allocates exactly the bounce bytes the planner reserves (everything on NVMe)."""
    model = tiny_llama(layers=2, hidden=32, vocab=128)
    specs = model_specs(model)
    eng = Engine(model, budget=Budget(gpu="96K", cpu="256K", nvme=str(tmp_path), chunk=8 << 10), optim=Optim("adamw"),
                 activations=Activations(expected=0))
    try:
        assert eng.bounce is not None
        ch = planner._Chunks(model=None, optimizer="adamw", precision="fp32", chunk_bytes=8 << 10, rank=None,
                             params=specs)
        hosted = [c for c in range(ch.n) if c not in eng.device_plan.gpu_home]
        homes = planner._engine_homes(ch, hosted, host=256 << 10, cxl=0, nvme=True)
        assert eng.bounce.nbytes == homes.bounce > 0
        sizes = bounce_sizes({c: ch.kinds[c] for c in hosted}, homes.tiers)
        assert [b.numel() for b in eng.bounce.sets] == [sizes.update_set] * 2
        assert eng.bounce.staging.numel() == sizes.fetch
    finally:
        eng.close()
