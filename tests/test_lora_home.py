"""An encoded (int8 / NF4) frozen base kept on the device when the gpu budget holds it.

Where the whole model fits with the base decoded, the base is decoded once after the warm-up
and that copy is its home: no step decodes it again, nothing crosses the link. Where only the
encoded bytes fit, they are gpu-home (booked in the gpu tier at their encoded size) and every
use decodes them there. The numbers are those of PEFT over bitsandbytes' Linear4bit (NF4), and of
the same run with the base streamed from the host (int8, our own codec: no outside reference),
bit for bit.
"""

import copy

import pytest
import torch

peft = pytest.importorskip("peft")

from tierwise.offload import Engine, flat_options  # noqa: E402
from tests.models import batches, tiny_llama  # noqa: E402
from tests.test_lora import CHUNK, adapters, linear4bit_model, lora_config, peft_reference  # noqa: E402

STREAMED = dict(gpu_mem="600K", chunk_bytes=CHUNK, allow_gpu_home=False)  # every chunk streams
ROOMY = dict(gpu_mem="64M", chunk_bytes=CHUNK)


def run(model, base_dtype, data, **kw):
    """(losses, adapters, engine, link bytes and cache fetches per step after the warm-up)."""
    torch.manual_seed(7)
    eng = Engine(copy.deepcopy(model), **flat_options(lora=lora_config(), lr=1e-2, base_dtype=base_dtype, **kw))
    losses = [eng.step(data[0])]
    link, fetched = eng.executor.lanes["h2d"].link.bytes_moved, eng.cache.fetched_bytes
    losses += [eng.step(b) for b in data[1:]]
    steps = max(len(data) - 1, 1)
    per_step = ((eng.executor.lanes["h2d"].link.bytes_moved - link) / steps,
                (eng.cache.fetched_bytes - fetched) / steps)
    return losses, adapters(eng.named_parameters_fp32()), eng, per_step


def encoded(eng):
    """The frozen chunks loaded encoded (a decoded home is plain afterwards)."""
    return [c for c, layout in eng.frozen_layouts.items() if layout is not None]


def in_gpu(eng, c):
    return eng.store.chunks[c].tiers["compute"] == "gpu"


def blob_bytes(eng, cids):
    return sum(eng.kinds[c]["compute"] for c in cids)


def encoded_fits(model, base_dtype, **kw):
    """A gpu budget that holds every chunk with the base encoded, not with it decoded."""
    _, _, roomy, _ = run(model, base_dtype, batches(1), **ROOMY, **kw)
    enc = encoded(roomy)
    plain = sum(roomy.needs.home_bytes[c] for c in range(len(roomy.plan.chunks)) if c not in enc)
    budget = roomy.minimum_gpu_bytes + plain + blob_bytes(roomy, enc) + (16 << 10)
    decoded = sum(roomy.needs.compute_bytes[c] for c in enc)
    assert budget < roomy.minimum_gpu_bytes + plain + decoded
    roomy.close()
    return budget


@pytest.mark.parametrize("base_dtype", ["nf4", "int8"])
def test_encoded_base_is_gpu_home_with_room(base_dtype):
    model, data = tiny_llama(layers=4), batches(3)
    tight_losses, tight_adapters, tight, (tight_link, _) = run(model, base_dtype, data, **STREAMED)
    assert tight_link > 0 and not any(in_gpu(tight, c) for c in encoded(tight))
    tight.close()
    losses, mine, eng, (link, fetched) = run(model, base_dtype, data, gpu_mem=encoded_fits(model, base_dtype),
                                             chunk_bytes=CHUNK)
    enc = encoded(eng)
    assert all(eng.store.is_encoded(c) for c in enc)
    assert enc and all(in_gpu(eng, c) for c in enc)
    assert link == 0 and fetched == 0  # after the warm-up: no byte of the base crosses the link
    assert eng.cache.decoded_bytes > 0  # each use decodes on the device, into a cache buffer
        # the ledger books the encoded bytes (not the decoded ones) in the gpu tier
    frozen_home = blob_bytes(eng, [c for c in eng.plan.frozen if in_gpu(eng, c)])  # encoded or not
    assert eng.ledger.usage()["gpu"]["compute"] == frozen_home + eng.cache.bytes  # + decoded copies
    assert eng.ledger.peaks()["gpu"] >= blob_bytes(eng, enc)
    decoded = sum(eng.plan.chunks[c].numel * 4 for c in enc)
    assert blob_bytes(eng, enc) < decoded / 2
    assert eng.ledger.peaks()["gpu"] <= eng.ledger.budgets["gpu"]
    assert losses == tight_losses
    assert mine.keys() == tight_adapters.keys()
    for n, t in tight_adapters.items():
        assert torch.equal(mine[n], t), n
    eng.close()


@pytest.mark.parametrize("base_dtype", ["nf4", "int8"])
def test_a_base_that_fits_decoded_is_decoded_once(base_dtype):
    """With room for the decoded base, the steps after the warm-up decode nothing: the decoded
    copies are the homes (booked in the gpu tier at their decoded size), the blobs let go."""
    model, data = tiny_llama(layers=4), batches(4)
    tight_losses, tight_adapters, tight, _ = run(model, base_dtype, data, **STREAMED)
    tight.close()
    torch.manual_seed(7)
    eng = Engine(copy.deepcopy(model), **flat_options(lora=lora_config(), lr=1e-2, base_dtype=base_dtype, **ROOMY))
    losses = [eng.step(data[0])]
    decodes, link = eng.cache.decodes, eng.executor.lanes["h2d"].link.bytes_moved
    losses += [eng.step(b) for b in data[1:]]
    assert eng.cache.decodes == decodes and eng.executor.lanes["h2d"].link.bytes_moved == link
    enc = encoded(eng)
    assert enc and all(in_gpu(eng, c) and eng.store.is_gpu_home(c) and not eng.store.is_encoded(c) for c in enc)
    assert eng.device_plan.decoded_home == frozenset(enc)
    frozen_home = sum(eng.store.chunks[c].compute.nbytes for c in eng.plan.frozen)
    assert frozen_home == sum(eng.needs.compute_bytes[c] for c in eng.plan.frozen)  # decoded size
    assert eng.ledger.usage()["gpu"]["compute"] == frozen_home + eng.cache.bytes
    assert eng.ledger.peaks()["gpu"] <= eng.ledger.budgets["gpu"]
    assert losses == tight_losses
    mine = adapters(eng.named_parameters_fp32())
    for n, t in tight_adapters.items():
        assert torch.equal(mine[n], t), n
    eng.close()


def test_gpu_home_nf4_base_equals_peft_over_linear4bit():
    """Reference: PEFT over bitsandbytes' Linear4bit (CPU, exact: tests/test_lora.py), with the
    base decoded once (room for it) and with it decoded per use (room for the encoded bytes)."""
    pytest.importorskip("bitsandbytes")
    model, data = tiny_llama(layers=4), batches(3)
    ref_losses, ref = peft_reference(linear4bit_model(model, double_quant=True), lora_config(), data)
    theirs = adapters(ref.named_parameters())
    for budget in (ROOMY["gpu_mem"], encoded_fits(model, "nf4")):
        torch.manual_seed(7)
        eng = Engine(copy.deepcopy(model), **flat_options(lora=lora_config(), lr=1e-2, base_dtype="nf4",
                                                          double_quant=True, gpu_mem=budget, chunk_bytes=CHUNK))
        assert [eng.step(b) for b in data] == ref_losses
        assert all(in_gpu(eng, c) for c in encoded(eng))
        mine = adapters(eng.named_parameters_fp32())
        for n, t in theirs.items():
            assert torch.equal(mine[n], t), n
        eng.close()


def test_partial_home_between_fits_and_not():
    """A budget that holds part of the encoded base: that part is home, the rest streams."""
    model, data = tiny_llama(layers=4), batches(3)
    _, _, roomy, _ = run(model, "nf4", data[:1], **ROOMY)
    enc = encoded(roomy)
    # everything but about half the encoded blobs; the measured minimum is the same for any budget
    plain = sum(roomy.needs.home_bytes[c] for c in range(len(roomy.plan.chunks)) if c not in enc)
    budget = roomy.minimum_gpu_bytes + plain + blob_bytes(roomy, enc) // 2
    roomy.close()
    tight_losses, tight_adapters, tight, (_, tight_fetched) = run(model, "nf4", data, **STREAMED)
    tight.close()
    losses, mine, eng, (link, fetched) = run(model, "nf4", data, gpu_mem=budget, chunk_bytes=CHUNK)
    home = [c for c in enc if in_gpu(eng, c)]
    assert 0 < len(home) < len(enc)
    assert 0 < link and 0 < fetched < tight_fetched
    assert eng.ledger.peaks()["gpu"] <= budget
    assert losses == tight_losses
    for n, t in tight_adapters.items():
        assert torch.equal(mine[n], t), n
    eng.close()


def test_encoded_base_placed_up_front():
    """Placed before the first step (`activations` given): the blobs are allocated in the gpu tier
    and the weights encoded straight into them; the run is the streamed one, bit for bit."""
    model, data = tiny_llama(layers=4), batches(3)
    tight_losses, tight_adapters, tight, _ = run(model, "int8", data, **STREAMED)
    tight.close()
    losses, mine, eng, (link, fetched) = run(model, "int8", data, activations=1 << 20, **ROOMY)
    enc = encoded(eng)
    assert enc and all(in_gpu(eng, c) for c in enc) and link == 0 and fetched == 0
    assert eng.ledger.peaks()["host"] < blob_bytes(eng, enc)  # the base never had a host home
    assert losses == tight_losses
    for n, t in tight_adapters.items():
        assert torch.equal(mine[n], t), n
    eng.close()


@pytest.mark.parametrize("late", [False, True], ids=["placed-up-front", "after-the-warm-up"])
def test_weights_loaded_into_a_base_decoded_once_are_what_their_encoding_decodes_to(late):
    """Weights loaded after an up-front placement (as `finetune` loads them), or after the base
    was decoded for good: the run is the one whose base was loaded encoded, bit for bit."""
    model, data = tiny_llama(layers=4), batches(3)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref_losses, ref_adapters, ref, _ = run(model, "nf4", data, **STREAMED)
    ref.close()
    torch.manual_seed(7)
    eng = Engine(copy.deepcopy(model), **flat_options(lora=lora_config(), lr=1e-2, base_dtype="nf4",
                                                      activations=1 << 20, **ROOMY))
    try:
        frozen = {n for n, s in eng.plan.slots.items() if eng.plan.is_frozen(s.chunk) and n in weights}
        losses = []
        if late:
            losses.append(eng.step(data[0]))
            assert all(not eng.store.is_encoded(c) for c in encoded(eng))  # decoded for good now
        eng.load_weights((n, weights[n]) for n in frozen)
        losses += [eng.step(b) for b in data[len(losses):]]
        assert eng.device_plan.decoded_home == frozenset(encoded(eng))
        assert losses == ref_losses
        mine = adapters(eng.named_parameters_fp32())
        for n, t in ref_adapters.items():
            assert torch.equal(mine[n], t), n
    finally:
        eng.close()


def test_the_base_exports_as_computed_whichever_the_placement():
    """bf16 compute over an NF4 base: the frozen weights `named_parameters_fp32` gives are the ones
    the model computes with (decoded in bf16), whether the base is decoded at each use or once."""
    model, data = tiny_llama(layers=4), batches(1)
    values = []
    for budget in (encoded_fits(model, "nf4", precision="bf16"), ROOMY["gpu_mem"]):
        eng = Engine(copy.deepcopy(model), **flat_options(lora=lora_config(), lr=1e-2, base_dtype="nf4",
                                                          precision="bf16", gpu_mem=budget, chunk_bytes=CHUNK))
        try:
            eng.step(data[0])
            frozen = {n for n, s in eng.plan.slots.items() if eng.plan.is_frozen(s.chunk)}
            values.append({n: t for n, t in eng.named_parameters_fp32() if n in frozen})
            decoded = bool(eng.device_plan.decoded_home)
        finally:
            eng.close()
        assert decoded == (budget == ROOMY["gpu_mem"])
    assert values[0].keys() == values[1].keys()
    for n, t in values[0].items():
        assert torch.equal(t, values[1][n]), n
        assert torch.equal(t, t.bfloat16().float()), n  # bf16 values


def test_an_estimate_short_of_the_activations_keeps_the_base_encoded():
    """Placed up front for an estimate that left room for the base decoded; the warm-up saved more
    activations than that: the base stays encoded (decoded per use), where decoding it would leave
    no room for them, and the run goes on bit for bit instead of stopping over budget."""
    model, data = tiny_llama(layers=4), batches(3, batch=8, seq=64)
    _, _, roomy, _ = run(model, "nf4", data[:1], **ROOMY)
    enc = encoded(roomy)
    plain = sum(roomy.needs.home_bytes[c] for c in range(len(roomy.plan.chunks)) if c not in enc)
    decoded = sum(roomy.needs.compute_bytes[c] for c in enc)
    budget = roomy.minimum_gpu_bytes + plain + (blob_bytes(roomy, enc) + decoded) // 2
    roomy.close()
    placed_late, _, late, _ = run(model, "nf4", data, gpu_mem=budget, chunk_bytes=CHUNK)  # placed for what it measured
    assert not late.device_plan.decoded_home
    late.close()
    losses, _, eng, _ = run(model, "nf4", data, gpu_mem=budget, chunk_bytes=CHUNK, activations=64 << 10)
    try:
        assert not eng.device_plan.decoded_home and all(eng.store.is_encoded(c) and in_gpu(eng, c) for c in enc)
        assert losses == placed_late
        assert eng.ledger.peaks()["gpu"] <= budget
    finally:
        eng.close()



def test_placed_up_front_the_base_is_decoded_for_good_only_where_the_first_step_fits_too():
    """The first step of an up-front placement runs with the encoded base on the device, each use
    decoded through the streaming window; its decoded copy replaces it only after that step. At
    the least budget that holds the decoded base in place of the window (so decoded for good when
    placed after the warm-up), the encoded base beside the window does not fit: placed up front it
    stays encoded (the planner says the same: plan_device is its placement too), the step stays
    within the budget, and the run is the streamed one, bit for bit."""
    from tierwise.offload.plan.placement import plan_device

    model, data = tiny_llama(layers=4), batches(3)
    # bf16 and the base in one chunk: the adapters' homes outweigh what decoding adds
    opts = dict(lora=lora_config(r=16), lr=1e-2, base_dtype="nf4", precision="bf16", chunk_bytes="4M",
                checkpointing=True)

    def losses_of(**kw):
        torch.manual_seed(7)
        eng = Engine(copy.deepcopy(model), **flat_options(**opts, **kw))
        try:
            return [eng.step(b) for b in data], eng.device_plan.decoded_home, eng.ledger.peaks()["gpu"]
        finally:
            eng.close()

    streamed, _, _ = losses_of(gpu_mem="64M", allow_gpu_home=False)
    probe = Engine(copy.deepcopy(model), **flat_options(**opts, gpu_mem="64M"))
    probe.step(data[0])
    act = probe.ledger.kind_peak("gpu", "activation")
    probe.close()
    up = Engine(copy.deepcopy(model), **flat_options(**opts, gpu_mem="64M", activations=act))
    needs = up.needs
    up.close()
    chunks = range(len(needs.home_bytes))
    enc = frozenset(c for c in chunks if needs.compute_bytes[c] > needs.home_bytes[c])
    home_decoded = sum(needs.compute_bytes[c] if c in enc else needs.home_bytes[c] for c in chunks)
    budget = needs.minimum + max(0, home_decoded - needs.stream_window)
    assert enc and plan_device(needs, budget, decoded=enc).decoded_home == enc
    assert not plan_device(needs, budget, decoded=enc, up_front=True).decoded_home
    losses, decoded, peak = losses_of(gpu_mem=budget, activations=act)
    assert not decoded and peak <= budget
    assert losses == streamed


def test_a_step_that_records_a_new_trace_keeps_its_first_frozen_chunks_too():
    """The frozen chunks a step's schedule holds after its first event stay cached over the
    step's end. A step that recorded a new trace (the units changed, or the control flow did)
    schedules it before its end, so it keeps them too: the next step does not read them again.
    The numbers are those of the run that never traced again."""
    model, data = tiny_llama(layers=4), batches(4)
    ref_losses, _, ref, _ = run(model, "nf4", data, **STREAMED)
    ref.close()
    torch.manual_seed(7)
    eng = Engine(copy.deepcopy(model), **flat_options(lora=lora_config(), lr=1e-2, base_dtype="nf4", **STREAMED))
    try:
        losses = [eng.step(data[0])]
        eng.residency.follower.reset()  # (as a change of the units of residency does)
        kept = eng.residency.kept
        losses.append(eng.step(data[1]))  # records the trace again
        assert eng.residency.kept > kept
        losses += [eng.step(b) for b in data[2:]]
        assert losses == ref_losses
    finally:
        eng.close()
