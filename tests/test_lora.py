"""LoRA over a streamed frozen base, and frozen parameters in general, against plain PyTorch.

The reference is PEFT itself (get_peft_model, trained with torch.optim.AdamW) and, for
QLoRA, PEFT over bitsandbytes' Linear4bit. LoRA's init draws random numbers: both sides seed
the same generator right before the adapters are made.
"""

import copy

import pytest
import torch

peft = pytest.importorskip("peft")

from tierwise.offload import Activations, Budget, Engine, Optim, Precision, flat_options  # noqa: E402
from tierwise.optim import AdamW8bit  # noqa: E402
from tests.models import batches, tiny_llama, train_reference  # noqa: E402

CHUNK = 16 << 10
TARGETS = ["q_proj", "v_proj", "down_proj"]


def lora_config(**kw):
    return peft.LoraConfig(**({"r": 4, "lora_alpha": 8, "target_modules": TARGETS, "lora_dropout": 0.0} | kw))


def peft_reference(model, cfg, data, *, lr=1e-2, make_opt=None, seed=7):
    """(losses, the trained PeftModel) in plain PyTorch; `seed` draws the adapters' init."""
    torch.manual_seed(seed)
    ref = peft.get_peft_model(copy.deepcopy(model), cfg)
    params = [p for p in ref.parameters() if p.requires_grad]
    opt = make_opt(params) if make_opt else torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True)
    losses = []
    for b in data:
        loss = ref(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, ref


def adapters(named):
    return {n.removeprefix("base_model.model."): t.detach() for n, t in named if "lora_" in n}


def base_on_nvme(tmp_path, **kw):
    """Tight gpu, host with room for the bounce buffers only: the base lives on NVMe."""
    return dict(gpu_mem="600K", cpu_mem="160K", chunk_bytes=CHUNK, nvme_path=str(tmp_path)) | kw


def test_lora_equals_peft_base_on_nvme(tmp_path):
    model, data, cfg = tiny_llama(layers=4), batches(3), lora_config()
    ref_losses, ref = peft_reference(model, cfg, data)
    torch.manual_seed(7)
    eng = Engine(copy.deepcopy(model), **flat_options(lora=cfg, lr=1e-2, **base_on_nvme(tmp_path)))
    frozen = [c for c in range(len(eng.plan.chunks)) if eng.plan.is_frozen(c)]
    on_nvme = [c for c in frozen if eng.store.chunks[c].tiers["compute"] == "nvme"]
    assert len(on_nvme) >= len(frozen) // 2, "the base should mostly live on NVMe"
    losses = [eng.step(b) for b in data]
    assert losses == ref_losses
    mine, theirs = adapters(eng.named_parameters_fp32()), adapters(ref.named_parameters())
    assert mine.keys() == theirs.keys() and len(mine) == 2 * 4 * len(TARGETS)
    for n, t in theirs.items():
        assert torch.equal(mine[n], t), n
    assert eng.ledger.peaks()["gpu"] <= eng.ledger.budgets["gpu"]
    eng.close()


def test_no_base_bytes_written_to_nvme_over_a_step(tmp_path):
    model, data = tiny_llama(layers=4), batches(3)
    torch.manual_seed(7)
    # adapters on NVMe too (no room on the gpu for them): their master/state may be written, the base never
    eng = Engine(model, **flat_options(lora=lora_config(), lr=1e-2, allow_gpu_home=False, **base_on_nvme(tmp_path)))
    eng.step(data[0])  # warm-up
    written: list[str] = []
    for name in ("write_async", "zeros"):
        orig = getattr(eng.nvme, name)
        setattr(eng.nvme, name, lambda key, *a, _o=orig, **k: (written.append(key), _o(key, *a, **k))[1])
    before = eng.nvme.stats.bytes_read
    eng.step(data[1])
    base_keys = {f"c{c}.compute" for c in eng.plan.frozen}
    assert written, "adapter kinds on NVMe: something is written"
    assert not base_keys & set(written)
    read = eng.nvme.stats.bytes_read - before
    base = sum(eng.store.chunks[c].compute.nbytes for c in eng.plan.frozen
               if eng.store.chunks[c].tiers["compute"] == "nvme")
    assert read >= base  # each NVMe-resident base chunk is read at least once per step
    eng.close()


def test_peft_wrapped_model_taken_as_is(tmp_path):
    model, data, cfg = tiny_llama(layers=4), batches(3), lora_config()
    ref_losses, ref = peft_reference(model, cfg, data)
    torch.manual_seed(7)
    wrapped = peft.get_peft_model(copy.deepcopy(model), cfg)
    with pytest.raises(ValueError, match="already has PEFT adapters"):
        Engine(wrapped, lora=cfg)
    eng = Engine(wrapped, **flat_options(lr=1e-2, **base_on_nvme(tmp_path)))
    assert [eng.step(b) for b in data] == ref_losses
    mine, theirs = adapters(eng.named_parameters_fp32()), adapters(ref.named_parameters())
    for n, t in theirs.items():
        assert torch.equal(mine[n], t), n
    eng.close()


@pytest.mark.parametrize("which", ["embeddings", "blocks"])
def test_frozen_subsets_equal_plain_pytorch(which):
    model, data = tiny_llama(layers=4), batches(3)
    for n, p in model.named_parameters():
        if (which == "embeddings" and "embed_tokens" in n) or (which == "blocks" and ("layers.1." in n or "layers.2." in n)):
            p.requires_grad_(False)
    ref_losses, ref = train_reference(model, data)
    eng = Engine(copy.deepcopy(model), budget=Budget(gpu="600K", chunk=CHUNK), optim=Optim(lr=1e-3))
    assert [eng.step(b) for b in data] == ref_losses
    mine = dict(eng.named_parameters_fp32())
    for n, p in ref.named_parameters():
        assert torch.equal(mine[n], p.detach()), n
    eng.close()


def test_adamw8bit_on_adapters(tmp_path):
    model, data, cfg = tiny_llama(layers=4), batches(3), lora_config()
    hp = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    ref_losses, ref = peft_reference(model, cfg, data, make_opt=lambda ps: AdamW8bit(ps, **hp))
    torch.manual_seed(7)
    eng = Engine(copy.deepcopy(model), **flat_options(lora=cfg, optimizer="adamw8bit", **hp, **base_on_nvme(tmp_path)))
    assert [eng.step(b) for b in data] == ref_losses
    mine, theirs = adapters(eng.named_parameters_fp32()), adapters(ref.named_parameters())
    for n, t in theirs.items():
        assert torch.equal(mine[n], t), n
    eng.close()


def test_mezo_with_frozen_parameters_is_refused():
    from tierwise.offload.core.errors import UnsupportedModel

    with pytest.raises(UnsupportedModel, match="frozen"):
        Engine(tiny_llama(layers=2), optim=Optim("mezo"), lora=lora_config())


def linear4bit_model(model, *, double_quant):
    """`model` with every nn.Linear but the output head replaced by bitsandbytes' Linear4bit
    (NF4, block 64, fp32 compute), as transformers' BitsAndBytesConfig(load_in_4bit) does."""
    import bitsandbytes as bnb

    model = copy.deepcopy(model)
    head = model.get_output_embeddings()
    for mod in list(model.modules()):
        for cname, child in list(mod.named_children()):
            if type(child) is torch.nn.Linear and child is not head:
                q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                      compute_dtype=torch.float32, quant_type="nf4", compress_statistics=double_quant)
                q.weight = bnb.nn.Params4bit(child.weight.data.clone(), requires_grad=False, quant_type="nf4",
                                             compress_statistics=double_quant)
                setattr(mod, cname, q.to("cpu"))  # quantized here
    return model


@pytest.mark.parametrize("double_quant", [False, True])
def test_qlora_equals_peft_over_bitsandbytes_linear4bit(tmp_path, double_quant):
    """Stated tolerance: none. On CPU Linear4bit computes F.linear with dequantize_4bit's weight
    and ours is that weight bit for bit (tests/test_codecs.py), so losses and adapters are equal;
    NF4 bytes on NVMe, decoded per use."""
    pytest.importorskip("bitsandbytes")
    model, data, cfg = tiny_llama(layers=4), batches(3), lora_config()
    ref_losses, ref = peft_reference(linear4bit_model(model, double_quant=double_quant), cfg, data)
    torch.manual_seed(7)
    eng = Engine(copy.deepcopy(model), **flat_options(lora=cfg, lr=1e-2, base_dtype="nf4", double_quant=double_quant,
                 **base_on_nvme(tmp_path)))
    encoded = [c for c in eng.plan.frozen if eng.store.is_encoded(c)]
    assert encoded and any(eng.store.chunks[c].tiers["compute"] == "nvme" for c in encoded)
    assert [eng.step(b) for b in data] == ref_losses
    mine, theirs = adapters(eng.named_parameters_fp32()), adapters(ref.named_parameters())
    for n, t in theirs.items():
        assert torch.equal(mine[n], t), n
    eng.close()


def test_bf16_base_equals_plain_pytorch_on_rounded_weights():
    """base_dtype='bf16' under fp32 compute: the frozen weights are the bf16-rounded ones."""
    model, data = tiny_llama(layers=4), batches(2)
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in rounded.named_parameters():
            p.copy_(p.bfloat16().float())
    ref_losses, ref = peft_reference(rounded, lora_config(), data)
    torch.manual_seed(7)
    eng = Engine(copy.deepcopy(model), budget=Budget(gpu="600K", chunk=CHUNK), optim=Optim(lr=1e-2),
                 precision=Precision(base="bf16"), lora=lora_config())
    base = sum(eng.store.chunks[c].compute.nbytes for c in eng.plan.frozen)
    frozen = [s for s in eng.plan.slots.values() if eng.plan.is_frozen(s.chunk)]
    assert 2 * sum(s.numel for s in frozen) <= base <= 2 * sum(s.numel for s in frozen) + 16 * len(frozen)
    assert [eng.step(b) for b in data] == ref_losses
    mine, theirs = adapters(eng.named_parameters_fp32()), adapters(ref.named_parameters())
    for n, t in theirs.items():
        assert torch.equal(mine[n], t), n
    eng.close()


def test_lora_dropout_equals_peft():
    """Dropout inside recomputed blocks draws the same masks as PEFT's single forward."""
    model, data, cfg = tiny_llama(layers=4), batches(2), lora_config(lora_dropout=0.1)
    ref_losses, ref = peft_reference(model, cfg, data)
    torch.manual_seed(7)
    eng = Engine(copy.deepcopy(model), budget=Budget(gpu="600K", chunk=CHUNK), optim=Optim(lr=1e-2), lora=cfg)
    assert [eng.step(b) for b in data] == ref_losses
    mine, theirs = adapters(eng.named_parameters_fp32()), adapters(ref.named_parameters())
    for n, t in theirs.items():
        assert torch.equal(mine[n], t), n
    eng.close()


def test_meta_adapters_are_refused():
    with torch.device("meta"):
        model = tiny_llama(layers=2)
    with pytest.raises(ValueError, match="meta device"):
        Engine(model, lora=lora_config())


def test_mixtral_all_linear_adapts_the_fused_experts_as_peft_does():
    """PEFT (transformers 5) adapts Mixtral's fused 3-D experts and its router as parameters
    (target_parameters) under all-linear: the engine trains those adapters too, equal to PEFT.
    (The planner refuses to price them: tests/test_plan_lora.py.)"""
    from tests.test_plan_lora import family_model

    model, cfg = family_model("mixtral"), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    x = torch.randint(0, 288, (2, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": x, "labels": x, "attention_mask": torch.ones_like(x)}] * 2
    ref_losses, ref = peft_reference(model, cfg, data)
    torch.manual_seed(7)
    eng = Engine(copy.deepcopy(model), budget=Budget(gpu="2M", chunk=CHUNK), optim=Optim(lr=1e-2), lora=cfg)
    assert [eng.step(b) for b in data] == ref_losses
    mine, theirs = adapters(eng.named_parameters_fp32()), adapters(ref.named_parameters())
    assert mine.keys() == theirs.keys() and any(".experts." in n for n in mine)
    for n, t in theirs.items():
        assert torch.equal(mine[n], t), n
    eng.close()


def test_activations_above_the_estimate_use_the_free_budget():
    """Every chunk fits gpu-home with room to spare, the up-front activation estimate is low
    (here given far too low, as a caller's own estimate may be): the warm-up's
    larger activations fit in the unused budget, the run goes on as PEFT's."""
    model, data, cfg = tiny_llama(layers=2), batches(3), lora_config(target_modules="all-linear", lora_dropout=0.1)
    ref_losses, ref = peft_reference(model, cfg, data)
    torch.manual_seed(7)
    eng = Engine(copy.deepcopy(model), budget=Budget(gpu="64M", chunk=CHUNK), optim=Optim(lr=1e-2),
                 activations=Activations(expected=1024), lora=cfg)
    losses = [eng.step(b) for b in data]
    assert losses == ref_losses
    mine = adapters(eng.named_parameters_fp32())
    assert all(torch.equal(mine[k], v) for k, v in adapters(ref.named_parameters()).items())
    eng.close()
