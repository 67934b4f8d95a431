"""Packed rows kept apart, on CPU: transformers' block-causal mask against per-segment attention.

A tiny Llama (hidden 64, 2 layers, vocabulary 1,024) runs forward and backward in plain
PyTorch on one row of S tokens packed from documents of `--doc` tokens, each with position
ids from 0 (as `finetune` packs them). Two ways, on the same model, data and seed:

- mask: transformers' SDPA path, which builds a B x 1 x S x S block-causal mask from the
  position ids;
- segments: offload.engine.segments (what `finetune` installs), causal SDPA per document, no mask.

For each S it prints, measured in one run: the peak bytes of saved tensors per token (per
storage, by saved-tensor hooks; every layer's tensors held, no recompute), the step time
(median of `--repeat`, interleaved after a warm-up), and the largest difference in the loss and
in any gradient between the two.

    python bench/packed_attention.py [--seqs 2048,4096,8192] [--doc 512] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "devtree"))

from tierwise.offload.engine.segments import use_segments  # noqa: E402
from tierwise.offload.plan import perfmodel  # noqa: E402

perfmodel.SEGMENTS_FROM = 1  # per segment at every length here (finetune: from 4,096 tokens a row)

VOCAB, HIDDEN, LAYERS = 1024, 64, 2


def model(seq: int, segments: bool):
    import transformers

    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq, use_cache=False)).train()
    if segments:
        assert use_segments(m)
    return m


def batch(seq: int, doc: int) -> dict:
    x = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(0))
    pos = (torch.arange(seq) % doc)[None]
    labels = x.clone()
    labels[pos == 0] = -100  # a document's first token: the one before it is another's
    return {"input_ids": x, "labels": labels, "position_ids": pos}


def saved_peak(m, b: dict) -> int:
    live: set[int] = set()
    state = {"now": 0, "peak": 0}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in live:
            live.add(s.data_ptr())
            state["now"] += s.nbytes()
            state["peak"] = max(state["peak"], state["now"])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = m(**b).loss
    loss.backward()
    m.zero_grad(set_to_none=True)
    return state["peak"]


def step(m, b: dict) -> tuple[float, torch.Tensor, dict]:
    m.zero_grad(set_to_none=True)
    t = time.perf_counter()
    loss = m(**b).loss
    loss.backward()
    return time.perf_counter() - t, loss.detach(), {n: p.grad for n, p in m.named_parameters()}


def run(seqs: list[int], doc: int, repeat: int) -> list[dict]:
    rows = []
    for seq in seqs:
        b = batch(seq, doc)
        models = {k: model(seq, k == "segments") for k in ("mask", "segments")}
        peaks = {k: saved_peak(m, b) for k, m in models.items()}
        times: dict[str, list[float]] = {k: [] for k in models}
        out = {}
        for _ in range(repeat + 1):  # the first round warms up
            for k, m in models.items():
                dt, loss, grads = step(m, b)
                times[k].append(dt)
                out[k] = (loss, grads)
        loss_diff = float((out["mask"][0] - out["segments"][0]).abs())
        grad_diff = max(float((out["mask"][1][n] - g).abs().max()) for n, g in out["segments"][1].items())
        row = {"seq": seq, "doc": doc, "saved_bytes_per_token": {k: v / seq for k, v in peaks.items()},
               "step_s": {k: statistics.median(v[1:]) for k, v in times.items()},
               "max_loss_diff": loss_diff, "max_grad_diff": grad_diff}
        row["segments_over_mask_bytes"] = peaks["segments"] / peaks["mask"]
        row["segments_over_mask_time"] = row["step_s"]["segments"] / row["step_s"]["mask"]
        rows.append(row)
        print(f"seq {seq:>6} ({seq // doc} documents): saved bytes/token mask {peaks['mask'] / seq:,.0f}, segments "
              f"{peaks['segments'] / seq:,.0f} (x{row['segments_over_mask_bytes']:.3f}); step mask "
              f"{row['step_s']['mask']:.3f} s, segments {row['step_s']['segments']:.3f} s "
              f"(x{row['segments_over_mask_time']:.3f}); |loss diff| {loss_diff:.1e}, max |grad diff| {grad_diff:.1e}",
              flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", default="2048,4096,8192")
    ap.add_argument("--doc", type=int, default=512, help="tokens a packed document")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args()
    rows = run([int(s) for s in a.seqs.split(",")], a.doc, a.repeat)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
