"""Host RSS of a `finetune` run, phase by phase, against what its budgets promise.

A user sets --cpu-mem to stay clear of the OOM killer, so the promise is about what the OS
counts. This runs the CLI in child processes on a random Llama whose training state (fp32
master + AdamW moments on NVMe) is several times --cpu-mem:
  run 1  load, steps, a checkpoint every --checkpoint-every steps, the export at the end;
  run 2  --resume from the last checkpoint, then two more steps and their checkpoint.
Each child samples its own RSS every millisecond (a thread reading /proc/self/status) and
labels the sample with the phase the CLI is in: load, steps, checkpoint, export, resume.

The bound of each phase is the budgets (on CPU the simulated device lives in host RAM, so
--gpu-mem counts) plus the process allowance: the RSS the process holds when the engine is
about to be built (Python, torch, the meta model, the tokenizer and data), plus SLACK for what
the first step brings in (allocator arenas, kernels' workspaces). The figure printed per phase
is peak RSS / bound, for anonymous memory (what the process holds) and for all of RSS (with the
file-backed pages of torch's libraries it touches); the goal is <= 1.0 for anonymous memory.

    python bench/host_rss.py                      # 0.6B Llama, --gpu-mem 1G --cpu-mem 1600M (~10 min)
    python bench/host_rss.py --hidden 256 --layers 8 --vocab 512 --gpu-mem 6M --cpu-mem 6M \\
        --chunk-size 512K --seq-len 64            # the tiny case tests/test_host_rss.py runs
    python bench/host_rss.py --json               # one JSON line instead of the table
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SLACK = 32 << 20  # measured: the first step's code paths and the C allocator's kept free blocks (16-28 MiB)


def _rss() -> tuple[int, int]:
    """(anonymous, total) resident bytes of this process."""
    with open("/proc/self/status") as f:
        kb = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f if line.startswith("Rss"))}
    return kb["RssAnon"] << 10, (kb["RssAnon"] + kb["RssFile"] + kb.get("RssShmem", 0)) << 10


def child(argv: list[str]) -> dict:
    """Run `finetune argv` in this process, sampling RSS by phase; returns the peaks."""
    import tierwise.cli.train as train
    from tierwise.cli.main import main

    phase = ["start"]
    peaks: dict[str, list[int]] = {}
    allowance: list[int] = []
    done = threading.Event()

    def sample() -> None:
        anon, total = _rss()
        p = peaks.setdefault(phase[0], [0, 0])
        p[0], p[1] = max(p[0], anon), max(p[1], total)

    def watch() -> None:
        while not done.is_set():
            sample()
            time.sleep(0.001)

    def during(name: str, fn):
        def wrapped(*a, **k):
            sample()
            before, phase[0] = phase[0], name
            try:
                return fn(*a, **k)
            finally:
                sample()
                phase[0] = "steps" if before in ("load", "resume") else before
        return wrapped

    real_class = train.engine_class()

    def make_engine(*a, **k):
        allowance.append(_rss()[0])  # the process before the engine: torch, model skeleton, data
        phase[0] = "load"
        return real_class(*a, **k)

    train.engine_class = lambda: make_engine
    real_initial = train._initial_state

    def initial(engine, cfg, *a, **k):
        phase[0] = "resume" if cfg.resume else "load"
        return during(phase[0], real_initial)(engine, cfg, *a, **k)

    train._initial_state = initial
    train.save = during("checkpoint", train.save)
    train._finish = during("finish", train._finish)  # export, plots, the closing lines
    train.export_hf = during("export", train.export_hf)
    t = threading.Thread(target=watch, daemon=True)
    t.start()
    sys.argv = ["finetune", *argv]
    try:
        main()
    except SystemExit as e:
        if e.code:
            raise
    finally:
        done.set()
        t.join()
    return {"allowance": allowance[0] if allowance else None,
            "peaks": {k: {"anon": v[0], "total": v[1]} for k, v in peaks.items()}}


def make_model(path: Path, *, hidden: int, layers: int, vocab: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                      num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                      num_key_value_heads=max(1, hidden // 64), max_position_embeddings=4096,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu")
    model.tie_weights()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.save_pretrained(path, max_shard_size="256MB")
    words = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            pad_token="</s>").save_pretrained(path)


def write_data(path: Path, *, vocab: int, rows: int = 64, words: int = 200) -> None:
    with open(path, "w") as f:
        for r in range(rows):
            f.write(json.dumps({"text": " ".join(f"w{(r * 7 + i) % (vocab - 3) + 3}" for i in range(words))}) + "\n")


def run_child(args: list[str]) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", "--", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"finetune {' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    from tierwise.offload.core.sizes import parse_size
    from tierwise.offload.core.units import format_size

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--gpu-mem", default="1G")
    ap.add_argument("--cpu-mem", default="1600M")
    ap.add_argument("--chunk-size", default="32M")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--workdir", help="where the model, data, swap and runs go (default: a temp dir)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("rest", nargs="*")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.rest)))
        return
    work = Path(a.workdir or tempfile.mkdtemp(prefix="host_rss-"))
    work.mkdir(parents=True, exist_ok=True)
    model, data = work / "model", work / "data.jsonl"
    if not (model / "config.json").exists():
        make_model(model, hidden=a.hidden, layers=a.layers, vocab=a.vocab)
    write_data(data, vocab=a.vocab)
    common = ["--model", str(model), "--data", str(data), "--gpu-mem", a.gpu_mem, "--cpu-mem", a.cpu_mem,
              "--nvme-path", str(work / "swap"), "--chunk-size", a.chunk_size, "--seq-len", str(a.seq_len),
              "--batch-size", "1", "--checkpoint-every", "1", "--keep-checkpoints", "1",
              "--output", str(work / "run"), "--overwrite"]
    first = run_child(common + ["--steps", str(a.steps)])
    second = run_child([c for c in common if c != "--overwrite"] + ["--steps", str(a.steps + 1), "--resume"])
    budgets = parse_size(a.gpu_mem) + parse_size(a.cpu_mem)
    out = {"budgets": budgets, "slack": SLACK, "phases": {}}
    for res in (first, second):
        bound = budgets + res["allowance"] + SLACK
        for name, p in res["peaks"].items():
            if name == "start":
                continue
            key = name if name not in out["phases"] else f"{name} (resumed run)"
            out["phases"][key] = {"anon": p["anon"], "total": p["total"], "allowance": res["allowance"],
                                  "bound": bound, "ratio": p["anon"] / bound,
                                  "ratio_total": p["total"] / (bound + (p["total"] - p["anon"]))}
    state = sum(f.stat().st_size for f in (work / "run").glob("ckpt-*/engine.safetensors"))
    out["checkpoint_bytes"] = state
    if a.json:
        print(json.dumps(out))
        return
    print(f"budgets {format_size(budgets)} (--gpu-mem {a.gpu_mem} + --cpu-mem {a.cpu_mem}), checkpoint "
          f"{format_size(state)} ({state / parse_size(a.cpu_mem):.1f}x --cpu-mem)")
    print(f"{'phase':24} {'peak anon':>11} {'allowance':>11} {'bound':>11} {'anon/bound':>10}")
    for name, p in out["phases"].items():
        print(f"{name:24} {format_size(p['anon']):>11} {format_size(p['allowance']):>11} "
              f"{format_size(p['bound']):>11} {p['ratio']:>10.3f}")


if __name__ == "__main__":
    main()
