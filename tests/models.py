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
        losses.append(accumulate(ref, micro))
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return losses, ref


def token_weights(micro: list[dict]) -> list[float]:
    """Each micro-batch's share of the step: its target tokens (shifted labels not -100) over
    the step's, as transformers normalises a gradient-accumulated step."""
    counts = [int((mb["labels"][..., 1:] != -100).sum()) for mb in micro]
    return [c / sum(counts) for c in counts]


def accumulate(model, micro: list[dict]) -> float:
    """Backward of every micro-batch, each loss weighted by its share of the step's target
    tokens; returns the step's loss (the token mean)."""
    total = 0.0
    for mb, w in zip(micro, token_weights(micro)):
        loss = model(**mb).loss
        (loss * w if w != 1.0 else loss).backward()
        total += loss.item() * w
    return total


def masked_batches(n: int, *, batch: int = 4, seq: int = 16, vocab: int = 128, seed: int = 1) -> list[dict]:
    """Batches whose rows have different numbers of target tokens: a prompt masked (-100) and
    right padding (-100), varying per row, so micro-batches weigh differently."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, vocab, (batch, seq), generator=g)
        y = x.clone()
        for r in range(batch):
            prompt = int(torch.randint(0, seq // 2, (1,), generator=g))
            end = int(torch.randint(prompt + 2, seq + 1, (1,), generator=g))
            y[r, :prompt] = -100
            y[r, end:] = -100
        out.append({"input_ids": x, "labels": y})
    return out
