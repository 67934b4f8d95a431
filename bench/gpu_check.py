"""The CUDA figures a lent GPU is for, in one short run (bench/gpu_check.sh calls this).

Measures, each on its own and printed as one JSON line plus a readable summary:
  link      pinned host <-> device copy bandwidth (GB/s), 1 GiB each way
  plain     a ~1B random Llama (hidden 2048, 16 layers, vocab 32000) in plain PyTorch on
            the GPU: bf16 autocast over fp32 weights, fused AdamW; tokens/s and MFU
  engine    the same model and data through the Engine (bf16 compute copies, fp32 master
            and AdamW state on the host), streamed under --gpu-mem; tokens/s, MFU, the
            ledger's gpu peak and the CUDA allocator's peak, losses next to plain's
MFU = 6 * params * tokens/s / peak bf16 FLOP/s (--peak-tflops, 989 for an H200 SXM).

    python bench/gpu_check.py [--layers 16] [--steps 6] [--gpu-mem 6G] [--peak-tflops 989]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def link_bandwidth(nbytes: int = 1 << 30) -> dict:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, dst, src in (("h2d_gbs", dev, host), ("d2h_gbs", host, dev)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out[name] = 3 * nbytes / (time.perf_counter() - t0) / 1e9
    return out


def build(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                      num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4,
                      max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def timed(step, data: list) -> tuple[list[float], float]:
    losses, times = [], []
    for i, x in enumerate(data):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(float(step(x)))
        torch.cuda.synchronize()
        if i >= 2:  # two warm-up steps (the engine traces and places in its first)
            times.append(time.perf_counter() - t0)
    return losses, statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--gpu-mem", default="6G")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    a = ap.parse_args()
    res: dict = {"device": torch.cuda.get_device_name(), "link": link_bandwidth()}
    print(json.dumps(res), flush=True)

    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 32000, (a.batch, a.seq), generator=g) for _ in range(a.steps + 2)]
    tokens = a.batch * a.seq
    model = build(a.layers)
    n = sum(p.numel() for p in model.parameters())
    res["params"] = n

    ref = build(a.layers).cuda()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-5, fused=True)

    def plain_step(x):
        x = x.cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = ref(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    torch.cuda.reset_peak_memory_stats()
    losses, t = timed(plain_step, data)
    res["plain"] = {"step_s": t, "tokens_per_s": tokens / t, "mfu": 6 * n * tokens / t / (a.peak_tflops * 1e12),
                    "cuda_peak_gib": torch.cuda.max_memory_allocated() / 2**30, "losses": losses}
    print(json.dumps(res["plain"]), flush=True)
    del ref, opt
    torch.cuda.empty_cache()

    from tierwise.offload import Engine

    eng = Engine(model, lr=1e-5, precision="bf16", gpu_mem=a.gpu_mem, device="cuda",
                 chunk_bytes="64M", checkpointing=True)
    torch.cuda.reset_peak_memory_stats()
    try:
        losses, t = timed(lambda x: eng.step({"input_ids": x, "labels": x}), data)
        res["engine"] = {"step_s": t, "tokens_per_s": tokens / t,
                         "mfu": 6 * n * tokens / t / (a.peak_tflops * 1e12),
                         "gpu_budget": a.gpu_mem, "ledger_gpu_peak_gib": eng.ledger.peaks()["gpu"] / 2**30,
                         "cuda_peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                         "fetched_gib_per_step": eng.cache.fetched_bytes / 2**30 / len(data),
                         "losses": losses}
    finally:
        eng.close()
    print(json.dumps(res["engine"]), flush=True)
    p, e = res["plain"], res["engine"]
    print(f"\n{res['device']}: {n / 1e9:.2f}B params, batch {a.batch} x {a.seq}")
    print(f"link  h2d {res['link']['h2d_gbs']:.1f} GB/s  d2h {res['link']['d2h_gbs']:.1f} GB/s")
    print(f"plain  {p['tokens_per_s']:,.0f} tok/s  MFU {p['mfu']:.1%}  cuda peak {p['cuda_peak_gib']:.1f} GiB")
    print(f"engine {e['tokens_per_s']:,.0f} tok/s  MFU {e['mfu']:.1%}  ledger peak {e['ledger_gpu_peak_gib']:.2f} GiB "
          f"(budget {a.gpu_mem}), cuda peak {e['cuda_peak_gib']:.2f} GiB, {e['fetched_gib_per_step']:.1f} GiB streamed/step")
    print(f"engine/plain step time = {e['step_s'] / p['step_s']:.2f}")
    print(f"first losses plain {p['losses'][:3]}  engine {e['losses'][:3]}")


if __name__ == "__main__":
    main()
