from tierwise.offload.core.chunks import ALIGN, ParamSpec, pack_chunks


def specs(*shapes):
    return [ParamSpec(name=f"p{i}", shape=s) for i, s in enumerate(shapes)]


def test_packs_in_order_with_aligned_slots():
    plan = pack_chunks(specs((10,), (3, 5), (7,)), chunk_bytes=4 * 64)
    assert [s.chunk for s in plan.slots.values()] == [0, 0, 0]
    assert [s.offset for s in plan.slots.values()] == [0, 16, 32]
    assert all(s.offset % ALIGN == 0 for s in plan.slots.values())
    assert plan.chunks[0].params == ("p0", "p1", "p2")


def test_starts_a_new_chunk_when_full_and_oversized_param_gets_its_own():
    plan = pack_chunks(specs((40,), (40,), (500,), (8,)), chunk_bytes=4 * 64)
    assert [plan.slots[f"p{i}"].chunk for i in range(4)] == [0, 1, 2, 3]
    assert plan.chunks[2].numel == 512 and plan.chunks[2].params == ("p2",)
    assert plan.chunk_bytes(2, 4) == 2048


def test_no_overlap_and_everything_placed():
    plan = pack_chunks(specs(*[(n,) for n in (1, 17, 33, 64, 100, 3)]), chunk_bytes=4 * 128)
    for c in plan.chunks:
        ranges = sorted((plan.slots[n].offset, plan.slots[n].offset + plan.slots[n].numel) for n in c.params)
        assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))
        assert ranges[-1][1] <= c.numel
    assert plan.param_numel == 1 + 17 + 33 + 64 + 100 + 3


def test_dense_layouts_and_slot_views():
    import torch

    from tierwise.offload.core.chunks import contiguous_strides, is_dense

    assert contiguous_strides((2, 3, 4)) == (12, 4, 1) and contiguous_strides(()) == ()
    assert is_dense((3, 4), (1, 3)) and is_dense((), ()) and is_dense((4, 1), (1, 99))  # size-1 dims never matter
    assert not is_dense((3, 4), (0, 1)) and not is_dense((3, 4), (8, 1))  # expanded; sliced (gaps)
    t = torch.randn(2, 3, 4).permute(2, 0, 1)
    plan = pack_chunks([ParamSpec(name="s", shape=()), ParamSpec(name="t", shape=tuple(t.shape), stride=t.stride())])
    flat = torch.zeros(plan.chunks[0].numel)
    s, tt = plan.slots["s"], plan.slots["t"]
    assert tt.offset == ALIGN and tt.stride == t.stride() and s.numel == 1 and s.stride == ()
    tt.view(flat).copy_(t)
    assert tt.view(flat).stride() == t.stride() and torch.equal(tt.view(flat), t)
    assert torch.equal(tt.flat(flat), t.permute(1, 2, 0).reshape(-1))  # memory order
    assert s.view(flat).shape == ()


def test_overlapping_parameter_is_refused():
    import pytest

    from tierwise.offload.core.errors import ParamLayoutError

    with pytest.raises(ParamLayoutError, match="'w'"):
        pack_chunks([ParamSpec(name="w", shape=(3, 4), stride=(0, 1))])


def test_fused_ranges_merge_aligned_slots_and_isolate_odd_ones():
    from tierwise.offload.update.update import fused_ranges

    plan = pack_chunks(specs((16,), (32,), (3,), (16,), (16,), (5,)))
    assert fused_ranges(plan, plan.chunks[0]) == [(0, 48), (48, 3), (64, 32), (96, 5)]
