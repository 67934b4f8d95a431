from offload.chunks import ALIGN, ParamSpec, pack_chunks


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
