"""Encoded frozen weights (offload.runtime.codecs) against bitsandbytes, bit for bit (CPU)."""

import pytest
import torch

bnbf = pytest.importorskip("bitsandbytes.functional")

from tierwise.offload.runtime import codecs  # noqa: E402

SHAPES = [(64, 128), (7, 9), (1000, 3)]  # whole blocks, partial last block, odd numel


def _weights(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.05
    w.view(-1)[::17] *= 30  # outliers: blocks with very different absmax
    return w.to(dtype)


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_nf4_quantize_equals_bitsandbytes_bytes(shape, double_quant):
    w = _weights(shape)
    ref, st = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=double_quant)
    ours = codecs.nf4_quantize(w, double_quant=double_quant)
    assert torch.equal(ours.packed, ref.reshape(-1))
    if double_quant:
        assert torch.equal(ours.qabsmax, st.absmax)
        assert torch.equal(ours.absmax2, st.state2.absmax)
        assert torch.equal(ours.offset, st.offset)
    else:
        assert torch.equal(ours.absmax, st.absmax)


@pytest.mark.parametrize("out_dtype,double_quant", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, True)])
@pytest.mark.parametrize("shape", SHAPES)
def test_nf4_dequantize_equals_bitsandbytes(shape, double_quant, out_dtype):
    """A weight quantized by bitsandbytes, read as is: our decode equals dequantize_4bit."""
    w = _weights(shape, seed=1)
    q, st = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=double_quant)
    ref = bnbf.dequantize_4bit(q, st).reshape(-1).to(out_dtype)
    ours = torch.empty(w.numel(), dtype=out_dtype)
    codecs.nf4_dequantize(codecs.nf4_from_bnb(q, st), ours)
    assert torch.equal(ours, ref)


def test_nf4_blob_roundtrip_is_what_bitsandbytes_decodes():
    """encode/decode over a flat slot (what a frozen chunk stores) = bitsandbytes' result."""
    w = _weights((48, 64), seed=2)
    for dq in (False, True):
        blob = codecs.encode("nf4", w, double_quant=dq)
        assert blob.numel() == codecs.encoded_nbytes("nf4", w.numel(), double_quant=dq)
        out = torch.empty(w.numel())
        codecs.decode("nf4", blob, out, double_quant=dq)
        q, st = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=dq)
        assert torch.equal(out, bnbf.dequantize_4bit(q, st).reshape(-1))


@pytest.mark.parametrize("base", ["fp32", "bf16", "fp16", "int8"])
def test_other_codecs(base):
    w = _weights((33, 70), seed=3)
    blob = codecs.encode(base, w)
    assert blob.dtype == torch.uint8 and blob.numel() == codecs.encoded_nbytes(base, w.numel())
    out = torch.empty(w.numel())
    codecs.decode(base, blob, out)
    if base == "int8":
        scale = codecs._block_absmax(w.reshape(-1), 64) / 127
        assert (out - w.reshape(-1)).abs().max() <= scale.max() / 2 + 1e-7
    else:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[base]
        assert torch.equal(out, w.reshape(-1).to(dtype).float())


def test_unknown_base_dtype_is_refused():
    with pytest.raises(ValueError, match="base dtype"):
        codecs.encode("nf3", torch.zeros(4))


def test_reads_a_bitsandbytes_checkpoint():
    """A Linear4bit's saved state dict (double-quantized NF4), read back as is."""
    import bitsandbytes as bnb
    from safetensors.torch import load, save

    torch.manual_seed(0)
    lin = bnb.nn.Linear4bit(64, 32, bias=False, quant_type="nf4", compress_statistics=True,
                            compute_dtype=torch.float32)
    lin.weight = bnb.nn.Params4bit(torch.randn(32, 64) * 0.1, requires_grad=False, quant_type="nf4",
                                   compress_statistics=True)
    lin = lin.to("cpu")
    sd = load(save(lin.state_dict()))  # through the file format bitsandbytes checkpoints use
    stats = {k[len("weight."):]: v for k, v in sd.items() if k.startswith("weight.")}
    state = bnbf.QuantState.from_dict(stats, device="cpu")
    ours = codecs.nf4_dequantize(codecs.nf4_from_bnb(sd["weight"], state))
    assert torch.equal(ours, bnbf.dequantize_4bit(lin.weight.data, lin.weight.quant_state).reshape(-1))


def test_double_quant_matches_where_the_nested_code_is_not_the_nearest_level():
    """tiny_llama's up_proj (seed 0): bitsandbytes' nested absmax code of block 43 is the second-
    nearest level of its dynamic map (a binary search); a nearest-level quantizer differs there."""
    from tests.models import tiny_llama

    w = dict(tiny_llama(layers=1).named_parameters())["model.layers.0.mlp.up_proj.weight"].detach()
    q, st = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    ours = codecs.nf4_quantize(w, double_quant=True)
    assert torch.equal(ours.qabsmax, st.absmax) and torch.equal(ours.packed, q.reshape(-1))


def test_torch_path_equals_bitsandbytes_kernel(monkeypatch):
    """The fallback (odd counts, no bitsandbytes) decodes what the kernel decodes."""
    w = _weights((96, 40), seed=4)
    q = codecs.nf4_quantize(w, double_quant=True)
    fast = codecs.nf4_dequantize(q)
    monkeypatch.setattr(codecs, "_bnb_dequantize_4bit", lambda: None)
    assert torch.equal(codecs.nf4_dequantize(q), fast)
