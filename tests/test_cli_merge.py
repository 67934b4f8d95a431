"""`finetune export --merge` against PEFT: the streamed merge of a LoRA adapter into its base
checkpoint equals `PeftModel.from_pretrained(base, adapter).merge_and_unload()` (state dict and
logits, bit for bit), for tied and untied Llama, Qwen2 and GPT-2 (Conv1D, fan_in_fan_out), and
stays within --cpu-mem for a checkpoint several times larger."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tests.tinyhf import error_line, make_tiny_family_dir, make_tiny_llama_dir
from tierwise.cli.main import app
from tierwise.cli.merge import merge

IDS = torch.tensor([[1, 5, 9, 33, 200, 7]])


def _adapter(base_dir, out, seed=1, **lora):
    """A PEFT adapter with random (non-zero) A and B, saved by PEFT itself."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    lora.setdefault("r", 4)
    lora.setdefault("lora_alpha", 8)
    get_peft_model(model, __import__("peft").LoraConfig(init_lora_weights=False, **lora)
                   ).save_pretrained(out)
    return Path(out)


def _peft_merged(base_dir, adapter_dir, dtype=torch.float32):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype)
    return PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()


def _check_equal(ref, out_dir, dtype=torch.float32, logits=True):
    from transformers import AutoModelForCausalLM

    got = AutoModelForCausalLM.from_pretrained(out_dir, dtype=dtype)
    rs, gs = ref.state_dict(), got.state_dict()
    assert set(rs) == set(gs)
    diff = [k for k in rs if not torch.equal(rs[k], gs[k])]
    assert not diff, diff
    with torch.no_grad():
        if not logits:
            return got
        assert torch.equal(ref(IDS).logits, got(IDS).logits)
    return got


@pytest.mark.parametrize("family,targets", [
    ("llama", ["q_proj", "v_proj", "gate_proj", "lm_head"]),
    ("llama-tied", ["q_proj", "o_proj", "lm_head", "embed_tokens"]),
    ("qwen2", "all-linear"),
    ("gpt2", ["c_attn", "c_fc"]),
])
def test_merge_equals_peft_merge_and_unload(tmp_path, family, targets):
    base = make_tiny_family_dir(tmp_path / "base", family)
    adapter = _adapter(base, tmp_path / "adapter", target_modules=targets)
    out = tmp_path / "merged"
    result = CliRunner().invoke(app, ["export", "--merge", "--adapter", str(adapter), "--base",
                                      str(base), "--output", str(out), "--shard-size", "20K"])
    assert result.exit_code == 0, (result.output, result.exception)
    assert len(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]) > 1
    assert (out / "tokenizer.json").exists() and (out / "config.json").exists()
    ref = _peft_merged(base, adapter)
    got = _check_equal(ref, out)
    base_model = __import__("transformers").AutoModelForCausalLM.from_pretrained(base)
    changed = [k for k, v in base_model.state_dict().items() if not torch.equal(v, got.state_dict()[k])]
    assert changed  # the adapter did change the weights (a no-op merge would pass too easily)


def test_merge_tied_llama_sharded_checkpoint_lm_head_target(tmp_path):
    base = make_tiny_llama_dir(tmp_path / "base", tie=True, shard=True)
    adapter = _adapter(base, tmp_path / "adapter", target_modules=["lm_head", "k_proj"])
    out = merge(adapter, base, tmp_path / "merged", progress=False)
    assert (out / "model.safetensors").exists()
    _check_equal(_peft_merged(base, adapter), out)


def test_merge_rslora_and_patterns(tmp_path):
    base = make_tiny_llama_dir(tmp_path / "base")
    rs = _adapter(base, tmp_path / "rs", target_modules=["q_proj", "down_proj"], use_rslora=True,
                  r=8, lora_alpha=4)
    _check_equal(_peft_merged(base, rs), merge(rs, base, tmp_path / "m1", progress=False))
    pat = _adapter(base, tmp_path / "pat", target_modules=["q_proj", "down_proj"],
                   rank_pattern={"down_proj": 2}, alpha_pattern={"q_proj": 32})
    _check_equal(_peft_merged(base, pat), merge(pat, base, tmp_path / "m2", progress=False))


def test_merge_bf16_base_and_output_dtype(tmp_path):
    base = make_tiny_llama_dir(tmp_path / "base", dtype=torch.bfloat16)
    adapter = _adapter(base, tmp_path / "adapter", target_modules=["q_proj", "up_proj"])
    ref = _peft_merged(base, adapter, dtype=torch.bfloat16)
    _check_equal(ref, merge(adapter, base, tmp_path / "m", progress=False), dtype=torch.bfloat16)
    # fp32 base, bf16 output: PEFT's fp32 merge, then cast
    base32 = make_tiny_llama_dir(tmp_path / "base32")
    ad32 = _adapter(base32, tmp_path / "ad32", target_modules=["q_proj"])
    out = merge(ad32, base32, tmp_path / "m16", dtype="bf16", progress=False)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    ref = _peft_merged(base32, ad32).to(torch.bfloat16)  # casts the rotary buffer too: no logits
    _check_equal(ref, out, dtype=torch.bfloat16, logits=False)


def test_merge_in_row_blocks_equals_whole(tmp_path):
    """A tensor bigger than --cpu-mem's working share is merged in blocks of rows."""
    base = make_tiny_llama_dir(tmp_path / "base", hidden=64)
    adapter = _adapter(base, tmp_path / "adapter", target_modules=["q_proj", "lm_head",
                                                                    "gate_proj", "down_proj"])
    import tierwise.cli.merge as m

    calls = []
    real = m._delta_rows
    m_delta = lambda *a, **k: (calls.append(k["whole"]), real(*a, **k))[1]  # noqa: E731
    try:
        m._delta_rows = m_delta
        out = merge(adapter, base, tmp_path / "m", cpu_mem="64K", progress=False)
    finally:
        m._delta_rows = real
    assert False in calls  # blocks were used
    ref = _peft_merged(base, adapter)
    from transformers import AutoModelForCausalLM

    got = AutoModelForCausalLM.from_pretrained(out).state_dict()
    for k, v in ref.state_dict().items():
        # a block's matmul may sum in another order than the whole one: within rounding
        torch.testing.assert_close(got[k], v, rtol=1e-6, atol=1e-7)


def _make_fixture(tmp_path):
    base = make_tiny_llama_dir(tmp_path / "base")
    adapter = _adapter(base, tmp_path / "adapter", target_modules=["q_proj"])
    return base, adapter


def _run(*args):
    return CliRunner().invoke(app, ["export", *map(str, args)])


def test_merge_refusals(tmp_path):
    from peft import IA3Config, LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base, adapter = _make_fixture(tmp_path)
    common = ["--merge", "--adapter", adapter, "--base", base]
    assert "is the --base directory" in error_line(_run(*common, "--output", base))
    assert "--adapter directory" in error_line(_run(*common, "--output", adapter))
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    assert "not empty" in error_line(_run(*common, "--output", full))
    assert "export needs --output" in error_line(_run(*common))
    assert error_line(_run("--adapter", tmp_path / "nope", "--output", tmp_path / "o")) == \
        f"error: --adapter {tmp_path / 'nope'}: not a directory"  # (not: "needs --base")
    # the base its adapter_config.json names, where that directory is here; --adapter a run's output
    assert "export needs --output" in error_line(_run("--adapter", adapter))
    run = tmp_path / "run"
    run.mkdir()
    adapter.rename(run / "adapter")
    merged = tmp_path / "merged"
    assert _run("--adapter", run, "--output", merged).exit_code == 0 and (merged / "config.json").exists()
    (run / "adapter").rename(adapter)

    model = AutoModelForCausalLM.from_pretrained(base)
    get_peft_model(model, IA3Config(target_modules=["q_proj", "down_proj"],
                                    feedforward_modules=["down_proj"])).save_pretrained(tmp_path / "ia3")
    assert "only LoRA adapters" in error_line(_run("--merge", "--adapter", tmp_path / "ia3",
                                                   "--base", base, "--output", tmp_path / "o"))
    model = AutoModelForCausalLM.from_pretrained(base)
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], use_dora=True)
                   ).save_pretrained(tmp_path / "dora")
    assert "DoRA" in error_line(_run("--merge", "--adapter", tmp_path / "dora", "--base", base,
                                     "--output", tmp_path / "o"))

    # an adapter trained on a deeper model: layer 3 does not exist in the base
    deep = make_tiny_llama_dir(tmp_path / "deep", layers=4)
    deep_ad = _adapter(deep, tmp_path / "deep_ad", target_modules=["q_proj"])
    assert "has no such module" in error_line(_run("--merge", "--adapter", deep_ad, "--base", base,
                                                   "--output", tmp_path / "o"))
    # an adapter trained on a wider model: shapes do not fit
    wide = make_tiny_llama_dir(tmp_path / "wide", hidden=128)
    wide_ad = _adapter(wide, tmp_path / "wide_ad", target_modules=["q_proj"])
    assert "has shape" in error_line(_run("--merge", "--adapter", wide_ad, "--base", base,
                                          "--output", tmp_path / "o"))
    # the base checkpoint lacks the targeted tensor
    from safetensors.torch import load_file, save_file

    cut = tmp_path / "cut"
    cut.mkdir()
    for p in base.iterdir():
        (cut / p.name).write_bytes(p.read_bytes())
    tensors = load_file(cut / "model.safetensors")
    tensors.pop("model.layers.0.self_attn.q_proj.weight")
    save_file(tensors, cut / "model.safetensors", metadata={"format": "pt"})
    line = error_line(_run("--merge", "--adapter", adapter, "--base", cut, "--output", tmp_path / "o"))
    assert "q_proj" in line
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").glob("*.safetensors"))


def test_merge_overwrite_replaces_model_files(tmp_path):
    base, adapter = _make_fixture(tmp_path)
    out = tmp_path / "o"
    merge(adapter, base, out, max_shard_size="20K", progress=False)
    assert (out / "model.safetensors.index.json").exists()
    (out / "model_backup.safetensors").write_text("a user's file")
    merge(adapter, base, out, overwrite=True, progress=False)  # one file now: no stale shards
    assert (out / "model_backup.safetensors").read_text() == "a user's file"  # it was deleted
    (out / "model_backup.safetensors").unlink()
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert not (out / "model.safetensors.index.json").exists()
    _check_equal(_peft_merged(base, adapter), out)


CPU_MEM = 6 << 20
SLACK = 2 << 20  # the allocator's: freed blocks below mmap's threshold stay in the heap (measured 3.1-6.0 MB)

RSS_SCRIPT = textwrap.dedent("""
    import json, sys, threading, time
    import psutil, torch
    from tierwise.cli.merge import merge

    adapter, base_dir, out, cpu_mem, tiny = sys.argv[1:6]
    # warm-up on a one-layer model: imports, transformers' lazy set-up, torch's thread pools
    merge(tiny + "/adapter", tiny + "/base", tiny + "/out", progress=False)
    proc = psutil.Process()
    peak, done, started = [0], threading.Event(), threading.Event()

    def watch():
        started.set()
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.001)

    t = threading.Thread(target=watch); t.start(); started.wait()  # its stack is not the merge's
    time.sleep(0.05)
    base = proc.memory_info().rss
    peak[0] = base
    merge(adapter, base_dir, out, cpu_mem=int(cpu_mem), max_shard_size="4M", progress=False)
    done.set(); t.join()
    print(json.dumps({"growth": max(peak[0], proc.memory_info().rss) - base}))
""")


def test_merge_of_a_checkpoint_bigger_than_cpu_mem_stays_within_it(tmp_path):
    base = make_tiny_llama_dir(tmp_path / "base", vocab_size=512, hidden=256, layers=8,
                               shard=True, tie=True)
    weights = sum(f.stat().st_size for f in base.glob("*.safetensors"))
    assert weights > 3 * CPU_MEM  # several times larger than the budget
    adapter = _adapter(base, tmp_path / "adapter", target_modules="all-linear", r=8)
    tiny = make_tiny_llama_dir(tmp_path / "tiny" / "base", layers=1, hidden=32)
    _adapter(tiny, tmp_path / "tiny" / "adapter", target_modules="all-linear")
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(adapter), str(base),
                          str(tmp_path / "merged"), str(CPU_MEM), str(tmp_path / "tiny")],
                         capture_output=True, text=True, timeout=300,
                         cwd=str(Path(__file__).parents[1]))
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["growth"] <= CPU_MEM + SLACK, res  # the whole checkpoint would be > 3x CPU_MEM
    index = json.loads((tmp_path / "merged" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 4  # streamed into several shards
    # (bit-exactness against PEFT: the tests above; this one is about memory)


@pytest.mark.parametrize("family,lora,original", [
    ("mixtral", dict(target_modules="all-linear"), True),  # PEFT: experts + router as parameters
    ("mixtral", dict(target_modules="all-linear"), False),  # the base stores the fused experts
    ("qwen2-moe", dict(target_modules=["q_proj"],
                       target_parameters=["experts.gate_up_proj", "experts.down_proj"]), True),
])
def test_merge_of_adapters_on_fused_experts_equals_peft(tmp_path, family, lora, original):
    """target_parameters (PEFT's ParamWrapper over the fused 3-D experts, and Mixtral's router):
    the merge equals PeftModel.merge_and_unload bit for bit, state dict and logits, whether the
    base stores one tensor per expert (converted, merged, converted back into the same keys) or
    the fused tensors as the model holds them."""
    base = make_tiny_family_dir(tmp_path / "base", family, save_original_format=original)
    keys = set(json.loads(Path(base / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
        Path(base / "model.safetensors").read_bytes()[:8], "little")])) - {"__metadata__"}
    assert any(".experts.0." in k for k in keys) == original
    adapter = _adapter(base, tmp_path / "adapter", **lora)
    wrapped = json.loads((adapter / "adapter_config.json").read_text())["target_parameters"]
    assert {"gate_up_proj", "down_proj"} <= {t.rpartition(".")[2] for t in wrapped}
    out = tmp_path / "merged"
    result = CliRunner().invoke(app, ["export", "--merge", "--adapter", str(adapter), "--base",
                                      str(base), "--output", str(out), "--shard-size", "20K"])
    assert result.exit_code == 0, (result.output, result.exception)
    from safetensors import safe_open

    written = set()
    for f in out.glob("*.safetensors"):
        with safe_open(f, "pt") as h:
            written |= set(h.keys())
    assert written == keys  # the base's key layout
    ref = _peft_merged(base, adapter)
    got = _check_equal(ref, out)
    base_model = __import__("transformers").AutoModelForCausalLM.from_pretrained(base)
    changed = {k for k, v in base_model.state_dict().items() if not torch.equal(v, got.state_dict()[k])}
    assert any("experts.gate_up_proj" in k for k in changed) and any("experts.down_proj" in k for k in changed)


def test_merge_of_converted_experts_over_cpu_mem_is_refused(tmp_path):
    """One layer's per-expert tensors are converted into the fused one at once: a --cpu-mem
    below that is refused in one line, before anything is written."""
    base = make_tiny_family_dir(tmp_path / "base", "mixtral")
    adapter = _adapter(base, tmp_path / "adapter", target_modules=["q_proj"],
                       target_parameters=["experts.gate_up_proj"])
    line = error_line(_run("--merge", "--adapter", adapter, "--base", base, "--output", tmp_path / "o",
                           "--cpu-mem", "40K"))
    assert "per expert" in line and "gate_up_proj" in line, line
    assert not (tmp_path / "o").exists()


def test_merge_of_fused_experts_in_blocks_of_experts(tmp_path):
    """Fused experts stored as the model holds them, over --cpu-mem's working share: merged in
    blocks of experts (each block's einsum), equal to PEFT's whole-tensor merge within rounding."""
    base = make_tiny_family_dir(tmp_path / "base", "mixtral", save_original_format=False)
    adapter = _adapter(base, tmp_path / "adapter", target_modules=["q_proj"],
                       target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    import tierwise.cli.merge as m

    calls = []
    real = m._delta_rows
    try:
        m._delta_rows = lambda d, *a, **k: (calls.append((d.kind, k["whole"])), real(d, *a, **k))[1]
        out = merge(adapter, base, tmp_path / "m", cpu_mem="48K", progress=False)
    finally:
        m._delta_rows = real
    assert ("param", False) in calls  # blocks of experts were used
    from transformers import AutoModelForCausalLM

    got = AutoModelForCausalLM.from_pretrained(out).state_dict()
    ref = _peft_merged(base, adapter).state_dict()
    assert set(got) == set(ref)
    for k, v in ref.items():
        torch.testing.assert_close(got[k], v, rtol=1e-6, atol=1e-7)
