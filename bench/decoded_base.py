"""An encoded base kept on the device: decoded at every use vs decoded once (its home).

On the simulated device, a QLoRA (NF4 or int8 base, LoRA on all linear layers) of the 100M
Llama shape, two engines side by side in one process, stepped in turn (who goes first rotates
each round), after warm-up steps:
  per_use   a gpu budget that holds the encoded base but not the decoded one: the blobs are
            gpu-home and each use (forward, and the recompute or backward) decodes them into a
            cache buffer
  decoded   a gpu budget that holds the decoded base: decoded once after the warm-up, the
            decoded copy is the home (placement.DevicePlan.decoded_home)
Both are bit-equal (tests/test_lora_home.py). Prints the median step of each, their ratio
(decoded / per_use), the decodes per step and the gpu bytes the base takes in each.

    PYTHONPATH=tests/devtree python bench/decoded_base.py [--base nf4] [--layers 6] [--steps 6]
        [--warmup 2] [--batch 4 --seq 128] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from recompute_share import save_json, step_in_turn


def build(layers: int, vocab: int):
    from transformers import LlamaForCausalLM

    from tierwise.profiles import load_model_profile

    cfg = load_model_profile("100m").to_hf_config()
    cfg.num_hidden_layers, cfg.vocab_size = layers, vocab
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def make(a, gpu_mem):
    from peft import LoraConfig

    from tierwise.offload import Engine, flat_options

    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
    torch.manual_seed(1)
    return Engine(build(a.layers, a.vocab), **flat_options(lr=1e-4, chunk_bytes=8 << 20, lora=lora, base_dtype=a.base,
                                                           gpu_mem=gpu_mem))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="nf4", choices=["nf4", "int8"])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(2)
    batches = [{"input_ids": (ids := torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)), "labels": ids}
               for _ in range(a.warmup + a.steps)]

    decoded = make(a, None)
    decoded.step(batches[0])
    enc = [c for c, layout in decoded.frozen_layouts.items() if layout is not None]
    blobs = sum(decoded.kinds[c]["compute"] for c in enc)
    plain = sum(decoded.needs.home_bytes[c] for c in range(len(decoded.plan.chunks)) if c not in enc)
    per_use = make(a, decoded.minimum_gpu_bytes + plain + blobs + (1 << 20))
    per_use.step(batches[0])
    assert decoded.device_plan.decoded_home and not per_use.device_plan.decoded_home
    engines = {"per_use": per_use, "decoded": decoded}
    decodes: dict[str, int] = {}
    times, losses = step_in_turn(engines, batches[1:], a.warmup - 1,
                                 at_warmup=lambda k, e: decodes.__setitem__(k, e.cache.decodes))
    assert losses["per_use"] == losses["decoded"], losses
    out = {"base": a.base, "layers": a.layers, "batch": a.batch, "seq": a.seq}
    for k, eng in engines.items():
        out[f"{k}_step_s"] = statistics.median(times[k])
        out[f"{k}_decodes_per_step"] = (eng.cache.decodes - decodes[k]) / len(times[k])
        out[f"{k}_base_gpu_mib"] = sum(eng.store.chunks[c].compute.nbytes for c in enc) / 2**20
        eng.close()
    out["ratio"] = out["decoded_step_s"] / out["per_use_step_s"]
    for k in engines:
        print(f"{k:8s} step {out[f'{k}_step_s']:.3f} s (median of {len(times[k])}), "
              f"{out[f'{k}_decodes_per_step']:.0f} decodes a step, base on the gpu {out[f'{k}_base_gpu_mib']:.1f} MiB")
    print(f"decoded / per_use: {out['ratio']:.3f} (losses equal)")
    save_json(a.json, out)


if __name__ == "__main__":
    main()
