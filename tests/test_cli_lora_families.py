"""LoRA runs of `finetune` on model families other than Llama: what PEFT and bitsandbytes do
with their layers is the reference (tests/test_cli_lora.py covers Llama end to end)."""

from __future__ import annotations

import json

import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

peft = pytest.importorskip("peft")

sys.path.insert(0, str(Path(__file__).parent))
from tinyhf import error_line, family_config, make_tiny_family_dir, write_jsonl  # noqa: E402

from tierwise.cli.builtin import sample_rows  # noqa: E402
from tierwise.cli.main import app  # noqa: E402
from tierwise.offload import Budget, Engine, Precision  # noqa: E402


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt2")
    return make_tiny_family_dir(root / "gpt2", "gpt2"), write_jsonl(root / "train.jsonl", sample_rows(8))


def _args(assets, out, *flags) -> list[str]:
    model, data = assets
    return ["--model", str(model), "--data", str(data), "--output", str(out), "--seq-len", "16",
            "--batch-size", "2", "--steps", "1", "--chunk-size", "16K", *flags]


@pytest.mark.parametrize("flags,dtype", [(["--qlora"], "nf4"), (["--lora-rank", "4", "--base-dtype", "int8"], "int8")])
def test_quantized_base_of_conv1d_layers_is_refused(gpt2, tmp_path, flags, dtype):
    """GPT-2's linear layers are transformers Conv1D, which bitsandbytes quantizes (transposed)
    and the engine does not: an int8/NF4 base would silently stay fp32. One line, before the
    run directory is touched; --dry-run and the Engine API refuse it too."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    for extra in ([], ["--dry-run"], ["--overwrite"]):
        line = error_line(CliRunner().invoke(app, _args(gpt2, out, *flags, *extra)))
        assert "transformer.h.0.attn.c_attn.weight" in line and "Conv1D" in line and dtype in line, line
    assert [p.name for p in out.iterdir()] == ["keep.txt"]

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(family_config("gpt2"))
    with pytest.raises(ValueError, match=r"c_attn\.base_layer\.weight.*Conv1D"):
        Engine(hf, budget=Budget(chunk=16 << 10), precision=Precision(base=dtype),
               lora=peft.LoraConfig(r=4, target_modules="all-linear"))


def test_unknown_target_names_the_conv1d_layers(gpt2, tmp_path):
    """PEFT adapts GPT-2's Conv1D layers (c_attn, c_fc, c_proj): the hint for a misspelt target
    lists them, not only the output head."""
    line = error_line(CliRunner().invoke(app, _args(gpt2, tmp_path / "run", "--lora-rank", "4",
                                                    "--lora-targets", "q_proj")))
    assert "c_attn" in line and "c_fc" in line and "c_proj" in line, line


def test_an_nf4_base_is_double_quantized_and_says_so(tmp_path):
    """--lora-rank with --base-dtype nf4 is --qlora's recipe (the engine double-quantizes every
    nf4 base): the summary says so as it does for --qlora."""
    from tinyhf import make_tiny_llama_dir

    model = make_tiny_llama_dir(tmp_path / "llama", vocab_size=288, hidden=32, layers=2)
    data = write_jsonl(tmp_path / "train.jsonl", sample_rows(8))
    result = CliRunner().invoke(app, _args((model, data), tmp_path / "run", "--lora-rank", "4", "--base-dtype", "nf4",
                                           "--dry-run"), env={"COLUMNS": "200"})
    assert result.exit_code == 0, (result.output, result.exception)
    assert "base nf4 (double quant)" in result.output, result.output


def test_a_target_the_planner_does_not_price_trains(tmp_path, caplog):
    """PEFT adapts the output head too (--lora-targets lm_head): the planner does not price a
    head adapter, so the run measures its budgets instead of being refused (it was: the
    planner's refusal stopped the run before the engine was built); it says so before it starts."""
    from tinyhf import make_tiny_llama_dir

    model = make_tiny_llama_dir(tmp_path / "llama", vocab_size=288, hidden=32, layers=2)
    data = write_jsonl(tmp_path / "train.jsonl", sample_rows(8))
    result = CliRunner().invoke(app, _args((model, data), tmp_path / "run", "--lora-rank", "4",
                                           "--lora-targets", "q_proj,lm_head"))
    assert result.exit_code == 0, (result.output, result.exception)
    assert (tmp_path / "run" / "adapter" / "adapter_config.json").exists()
    said = [r.getMessage() for r in caplog.records if "not on lm_head" in r.getMessage()]  # (before it starts)
    assert len(said) == 1 and "the run goes on without a plan" in said[0], said
    # the warm-up's report points back to it instead of saying it again
    assert "no prediction: unplanned, as said before the first step" in result.output
    assert "--lora-targets q_proj,lm_head" not in result.output


def test_plan_of_a_family_the_planner_does_not_price_says_training_runs(gpt2, tmp_path):
    """`--dry-run` on GPT-2 (no planner profile): one line that says what is not priced and
    that training runs, not a profile field error."""
    line = error_line(CliRunner().invoke(app, _args(gpt2, tmp_path / "run", "--lora-rank", "4", "--dry-run")))
    assert "'gpt2'" in line and "training runs" in line and "field 'family'" not in line, line


def test_a_priced_family_with_eager_attention_is_refused_a_plan_and_trains(tmp_path):
    """A Llama whose config asks for eager attention saves each head's S x S scores, which the
    formulas (SDPA's) do not count: `plan`, `--verify` and `--dry-run` refuse in one line (they
    planned it ~10% low at 64 tokens); the run trains."""
    model = make_tiny_family_dir(tmp_path / "llama", "llama")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "attn_implementation": "eager"}))
    data = write_jsonl(tmp_path / "train.jsonl", sample_rows(8))
    plan = ["plan", "--model", str(model), "--data", str(data), "--seq-len", "16", "--batch-size", "2"]
    for args in (plan, [*plan, "--verify"], _args((model, data), tmp_path / "run", "--dry-run")):
        line = error_line(CliRunner().invoke(app, args))
        assert "with SDPA attention (what its formulas count), not 'eager'" in line and "training runs" in line, (args, line)
    result = CliRunner().invoke(app, _args((model, data), tmp_path / "run", "--steps", "1"))
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("family", ["mixtral", "qwen2-moe"])
def test_plan_of_a_moe_family(tmp_path, family):
    """Mixtral and Qwen2-MoE are priced (top-k compute, their experts' activations); a mixture
    the formulas do not model (a Qwen2-MoE with dense layers) is not: one line that says so and
    that training runs."""
    model = make_tiny_family_dir(tmp_path / family, family)
    data = write_jsonl(tmp_path / "train.jsonl", sample_rows(8))
    args = _args((model, data), tmp_path / "run", "--qlora", "--lora-targets", "q_proj", "--dry-run")
    out = CliRunner().invoke(app, args, env={"COLUMNS": "300"})
    assert out.exit_code == 0 and "verdict: fits" in out.output and "mixture of experts" not in out.output, out.output
    if family == "qwen2-moe":
        cfg = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**cfg, "mlp_only_layers": [1]}))
        line = error_line(CliRunner().invoke(app, args, env={"COLUMNS": "300"}))
        assert "mixture of experts (2 of 4 experts per token, some layers dense)" in line and "training runs" in line


def test_the_summary_says_how_much_of_an_nf4_base_is_encoded(tmp_path):
    """The summary gives the encoded share of an NF4 base, counted here from the transformers
    model: the nn.Linear weights but the head, and Mixtral's fused 3-D experts (encoded since
    they are linear weights too; before, they stayed bf16: ~3% of Mixtral 8x7B encoded). What
    stays is embeddings, norms, head and routers."""
    from transformers import AutoModelForCausalLM

    model = make_tiny_family_dir(tmp_path / "mixtral", "mixtral")
    data = write_jsonl(tmp_path / "train.jsonl", sample_rows(8))
    result = CliRunner().invoke(app, _args((model, data), tmp_path / "run", "--qlora", "--lora-targets",
                                           "q_proj,v_proj", "--dry-run"), env={"COLUMNS": "300"})
    hf = AutoModelForCausalLM.from_config(family_config("mixtral"))
    head = hf.get_output_embeddings()
    linear = sum(m.weight.numel() for m in hf.modules() if type(m) is torch.nn.Linear and m is not head)
    experts = sum(m.gate_up_proj.numel() + m.down_proj.numel() for m in hf.modules()
                  if type(m).__name__ == "MixtralExperts")
    share = 100 * (linear + experts) / sum(p.numel() for p in hf.parameters())
    assert f"base nf4 (double quant) on {share:.1f}% of it, the rest fp32 (embeddings, norms, head, routers)" \
        in result.output, result.output
    assert experts > linear
    dense = make_tiny_family_dir(tmp_path / "qwen2", "qwen2")  # no routers to name
    result = CliRunner().invoke(app, _args((dense, data), tmp_path / "run2", "--qlora", "--dry-run"),
                                env={"COLUMNS": "300"})
    assert "of it, the rest fp32 (embeddings, norms, head) " in result.output, result.output


def test_mixtral_all_linear_run_exports_and_merges(tmp_path):
    """A Mixtral all-linear LoRA run (PEFT adapts the fused experts and the router as parameters)
    exports an adapter PEFT loads, and `export --merge` of it equals PEFT's merge_and_unload bit
    for bit; its logits equal the unmerged PEFT model's within 1e-5 (merged weights: W + BA
    rounds differently from W x + B A x)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = make_tiny_family_dir(tmp_path / "mixtral", "mixtral")
    data = write_jsonl(tmp_path / "train.jsonl", sample_rows(8))
    run = tmp_path / "run"
    result = CliRunner().invoke(app, _args((model, data), run, "--lora-rank", "4", "--lora-targets", "all-linear",
                                           "--lr", "1e-2", "--steps", "2"))
    assert result.exit_code == 0, (result.output, result.exception)
    merged = tmp_path / "merged"
    result = CliRunner().invoke(app, ["export", "--merge", "--adapter", str(run / "adapter"), "--base", str(model),
                                      "--output", str(merged)])
    assert result.exit_code == 0, (result.output, result.exception)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model), str(run / "adapter"))
    trained = {n: p for n, p in peft_model.named_parameters() if "experts" in n and "lora_B" in n}
    assert trained and all(p.abs().sum() > 0 for p in trained.values())  # the experts' adapters trained
    ids = torch.tensor([[1, 5, 9, 33, 200, 7]])
    got = AutoModelForCausalLM.from_pretrained(merged)
    with torch.no_grad():
        unmerged = peft_model(ids).logits
        ref = peft_model.merge_and_unload()
        rs, gs = ref.state_dict(), got.state_dict()
        assert set(rs) == set(gs) and all(torch.equal(rs[k], gs[k]) for k in rs)
        torch.testing.assert_close(got(ids).logits, unmerged, rtol=0, atol=1e-5)


def test_mixtral_lora_messages_name_what_to_do(tmp_path):
    """A fused expert named as a target is a parameter, not a layer; LoRA dropout on the experts
    PEFT adapts as parameters is refused naming the fix (was PEFT's own line); the plan of
    all-linear says training runs as given."""
    model = make_tiny_family_dir(tmp_path / "mixtral", "mixtral")
    data = write_jsonl(tmp_path / "train.jsonl", sample_rows(8))

    def line(*flags):
        return error_line(CliRunner().invoke(app, _args((model, data), tmp_path / "run", "--lora-rank", "4", *flags),
                                             env={"COLUMNS": "300"}))

    assert "gate_up_proj: a parameter, not a layer" in line("--lora-targets", "gate_up_proj")
    assert "all-linear, gate, w1, w2, w3 adapt this model's fused experts" in line("--lora-targets", "gate_up_proj")
    assert "give --lora-dropout 0" in line("--lora-dropout", "0.1")
    assert "training runs as given" in line("--dry-run")


def test_qwen2_moe_names_that_peft_maps_onto_the_experts(tmp_path):
    """From PEFT 0.22, --lora-targets down_proj on Qwen2-MoE adapts the fused experts as well as
    the shared expert's linear: the plan refuses it (training runs as given), and with LoRA
    dropout the run's refusal names the targets that avoid the experts."""
    from tierwise.offload.plan.lora import adapts_experts

    if not adapts_experts("qwen2_moe"):
        pytest.skip("this PEFT leaves Qwen2-MoE's experts alone")
    model = make_tiny_family_dir(tmp_path / "qwen2-moe", "qwen2-moe", save_original_format=False)
    data = write_jsonl(tmp_path / "train.jsonl", sample_rows(8))

    def line(*flags):
        return error_line(CliRunner().invoke(app, _args((model, data), tmp_path / "run", "--lora-rank", "4", *flags),
                                             env={"COLUMNS": "300"}))

    assert "LoRA down_proj on a model with fused MoE experts" in line("--lora-targets", "down_proj", "--dry-run")
    said = line("--lora-targets", "down_proj", "--lora-dropout", "0.1")
    assert "give --lora-dropout 0" in said and "not all-linear, down_proj, gate, gate_proj, up_proj" in said
    # attention targets are priced, with dropout too
    result = CliRunner().invoke(app, _args((model, data), tmp_path / "run", "--lora-rank", "4", "--lora-dropout", "0.1",
                                           "--lora-targets", "q_proj,v_proj,shared_expert_gate", "--dry-run"))
    assert result.exit_code == 0, result.output
