"""The optimizer table (offload.update.table) is the one source of optimizer facts: the
planner's torch-free state bytes equal the engine's updater allocation, both use the same
default rank, and every list of names (CLI, drop-in registry, updaters) is the table's."""

import math

import pytest

from tierwise.offload.core.chunks import ParamSpec, pack_chunks
from tierwise.offload.plan.perfmodel import param_update_flops
from tierwise.offload.update import table
from tierwise.offload.update.updaters import make_updater

# every branch of the formulas: 1-D, 0-dim, small (fp32 8-bit fallback), big, tall and wide
# matrices, a 3-D weight, and an embedding / head that stay dense
# (the embedding is an nn.Embedding's: AdamW8bit keeps its moments in fp32)
SPECS = [ParamSpec(name=n, shape=s, embedding="embed" in n) for n, s in (
    ("model.embed_tokens.weight", (256, 64)), ("model.layers.0.norm.weight", (64,)),
    ("model.layers.0.temp", ()), ("model.layers.0.q.weight", (64, 64)),
    ("model.layers.0.up.weight", (200, 64)), ("model.layers.0.down.weight", (64, 200)),
    ("model.layers.0.conv.weight", (48, 8, 3)), ("model.layers.0.small.weight", (5, 7)),
    ("lm_head.weight", (256, 64)))]


def _plan(chunk_bytes=64 << 10):
    return pack_chunks(SPECS, chunk_bytes=chunk_bytes, element_size=4)


def _engine_bytes(name, plan, **kwargs):
    up = make_updater(name, plan, shapes={s.name: tuple(s.shape) for s in SPECS}, **kwargs)
    return [up.state_bytes(c.index) for c in plan.chunks], up.needs_grad


@pytest.mark.parametrize("name", table.NAMES)
def test_plan_and_engine_state_bytes_and_rank_agree(name):
    """Without a rank (as `finetune` runs) and with one, for every table entry."""
    plan = _plan()
    spec = table.OPTIMIZERS[name]
    engine, needs_grad = _engine_bytes(name, plan)
    assert table.state_bytes(plan, name) == engine  # the default rank is one number for both
    assert spec.needs_grad == needs_grad
    if spec.low_rank:
        engine8, _ = _engine_bytes(name, plan, rank=8)
        assert table.state_bytes(plan, name, rank=8) == engine8
        if name != "apollo-mini":  # its state is rank 1 whatever the rank
            assert engine8 != engine
            # the planner's flops use the rank the engine's state was built with
            m, n = 64, 200
            flops = param_update_flops(ParamSpec(name="x", shape=(m, n)), cost=spec, rank=None, projected=True)
            assert flops == 4.0 * m * n * min(spec.default_rank, m, n)


def test_8bit_embeddings_keep_fp32_moments():
    plan = _plan()
    emb = plan.slots["model.embed_tokens.weight"]
    alone = pack_chunks([ParamSpec(name="e", shape=(256, 64), embedding=flag) for flag in (True,)],
                        chunk_bytes=64 << 10, element_size=4)
    assert table.state_bytes(alone, "adamw8bit") == [8 * 256 * 64]  # (an 8-bit one: ~2.03 B each)
    assert emb.embedding and not plan.slots["lm_head.weight"].embedding


def test_sgd_momentum_state():
    plan = _plan()
    assert table.state_bytes(plan, "sgd", momentum=0.9) == _engine_bytes("sgd", plan, momentum=0.9)[0]
    assert sum(table.state_bytes(plan, "sgd")) == 0


def test_galore_default_rank_is_the_engines():
    """A drift seen live: the engine's GaLore ran at rank 128, the performance model
    planned 256. One number now; a 4096 x 4096 layer shows which."""
    plan = pack_chunks([ParamSpec(name="model.layers.0.q.weight", shape=(4096, 4096))],
                       chunk_bytes=64 << 20, element_size=4)
    assert table.OPTIMIZERS["galore"].default_rank == 128
    want = 2 * 4 * 4096 * 128 + 4 * 128 * 4096  # Adam moments of 4096 x 128 + the projector
    assert table.state_bytes(plan, "galore") == [want]


def test_every_list_of_names_is_the_tables():
    from tierwise.cli.config import OPTIMIZERS as cli_choices
    from tierwise.optim import OPTIMIZERS as drop_ins

    assert tuple(cli_choices) == table.NAMES
    assert set(drop_ins) == set(table.NAMES)  # optim imports none of ours: checked here
    assert table.LOW_RANK == ("galore", "galore8bit", "apollo", "apollo-mini")


def test_drop_in_costs_agree_with_the_table():
    """optim's cost() (the drop-in API) and the table describe the same state: dense bytes per
    parameter, and for a projected matrix the same tensors (APOLLO's projector too: a cache
    both keep)."""
    from tierwise.optim import OPTIMIZERS as drop_ins
    from tierwise.optim.adamw8bit import MIN_8BIT_NUMEL
    from tierwise.optim.quant import BLOCK

    assert (table.BLOCK, table.MIN_8BIT_NUMEL) == (BLOCK, MIN_8BIT_NUMEL)
    for name, spec in table.OPTIMIZERS.items():
        cost = drop_ins[name].cost()
        assert cost.needs_grad == spec.needs_grad, name
        if spec.slot_state is not None and not spec.low_rank:
            for shape in ((64,), (5000,), (300, 70)):
                assert sum(spec.slot_state(shape, False, 0)) == cost.tensor_state_bytes(shape), (name, shape)
        if spec.low_rank:
            shape, r = (300, 70), 16
            assert sum(spec.slot_state(shape, True, r)) == cost.tensor_state_bytes(shape, r), name
    assert math.isclose(table.OPTIMIZERS["adamw8bit"].dense_state_per_param,
                        drop_ins["adamw8bit"].cost().state_bytes_per_param)
