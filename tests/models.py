"""Tiny models for tests, built from a transformers config with a fixed seed."""

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(*, layers: int = 4, hidden: int = 64, vocab: int = 128, tie: bool = False,
               seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, tie_word_embeddings=tie)
    return LlamaForCausalLM(cfg)


def batches(n: int, *, batch: int = 4, seq: int = 16, vocab: int = 128, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, vocab, (batch, seq), generator=g)
        out.append({"input_ids": x, "labels": x.clone()})
    return out


def train_reference(model, data, *, lr=1e-3, weight_decay=0.0, grad_accum=1, clip=None,
                    optimizer="adamw", momentum=0.0):
    """Plain PyTorch training on a deep copy of `model`: (losses, final model)."""
    ref = copy.deepcopy(model)
    if optimizer == "adamw":
        opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=weight_decay, fused=True)
    else:
        opt = torch.optim.SGD(ref.parameters(), lr=lr, weight_decay=weight_decay, momentum=momentum)
    losses = []
    for b in data:
        micro = [{k: v.chunk(grad_accum)[i] for k, v in b.items()} for i in range(grad_accum)]
        total = 0.0
        for mb in micro:
            loss = ref(**mb).loss
            (loss / grad_accum if grad_accum > 1 else loss).backward()
            total += loss.item()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(total / grad_accum)
    return losses, ref
