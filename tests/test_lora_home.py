"""An encoded (int8 / NF4) frozen base kept on the device when the gpu budget holds it.

With room, the encoded bytes of the base are gpu-home (booked in the gpu tier at their encoded
size) and every use decodes them there: after the warm-up nothing crosses the link. The numbers
are those of PEFT over bitsandbytes' Linear4bit (NF4), and of the same run with the base streamed
from the host (int8, our own codec: no outside reference), bit for bit.
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
    return [c for c in eng.plan.frozen if eng.store.is_encoded(c)]


def in_gpu(eng, c):
    return eng.store.chunks[c].tiers["compute"] == "gpu"


def blob_bytes(eng, cids):
    return sum(eng.store.chunks[c].compute.nbytes for c in cids)


@pytest.mark.parametrize("base_dtype", ["nf4", "int8"])
def test_encoded_base_is_gpu_home_with_room(base_dtype):
    model, data = tiny_llama(layers=4), batches(3)
    tight_losses, tight_adapters, tight, (tight_link, _) = run(model, base_dtype, data, **STREAMED)
    assert tight_link > 0 and not any(in_gpu(tight, c) for c in encoded(tight))
    tight.close()
    losses, mine, eng, (link, fetched) = run(model, base_dtype, data, **ROOMY)
    enc = encoded(eng)
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


def test_gpu_home_nf4_base_equals_peft_over_linear4bit():
    """Reference: PEFT over bitsandbytes' Linear4bit (CPU, exact: tests/test_lora.py)."""
    pytest.importorskip("bitsandbytes")
    model, data = tiny_llama(layers=4), batches(3)
    ref_losses, ref = peft_reference(linear4bit_model(model, double_quant=True), lora_config(), data)
    torch.manual_seed(7)
    eng = Engine(copy.deepcopy(model), **flat_options(lora=lora_config(), lr=1e-2, base_dtype="nf4", double_quant=True, **ROOMY))
    assert [eng.step(b) for b in data] == ref_losses
    assert all(in_gpu(eng, c) for c in encoded(eng))
    mine, theirs = adapters(eng.named_parameters_fp32()), adapters(ref.named_parameters())
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
