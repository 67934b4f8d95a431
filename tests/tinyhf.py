"""Build tiny, real Hugging Face model directories for tests (no downloads, well under 2 s).

    path = make_tiny_llama_dir(tmp_path / "m", layers=2, shard=True)
    AutoModelForCausalLM.from_pretrained(path)  # works: config.json, safetensors, tokenizer
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from cli.builtin import build_tokenizer, tiny_llama_config


def make_tiny_llama_dir(path, *, vocab_size: int = 384, hidden: int = 64, layers: int = 2,
                        tie: bool = False, seed: int = 0, shard: bool = False,
                        dtype: torch.dtype = torch.float32) -> Path:
    """Write config.json, model.safetensors (or 2+ shards + index when `shard`), tokenizer
    files and generation_config.json of a seeded random LlamaForCausalLM into `path`."""
    from transformers import LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size=vocab_size)
    config = tiny_llama_config(vocab_size=vocab_size, hidden=hidden, layers=layers, tie=tie,
                               tokenizer=tokenizer)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype)
    # A shard size below the model's size forces a multi-file checkpoint with an index.
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    max_shard = max(total // 3, 1 << 12) if shard else "5GB"
    model.save_pretrained(path, max_shard_size=max_shard, safe_serialization=True)
    tokenizer.save_pretrained(path)
    if shard:
        assert (path / "model.safetensors.index.json").exists(), "expected a sharded save"
    return path


def write_jsonl(path, rows) -> Path:
    """Write `rows` (dicts, or raw strings written verbatim) one per line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(row if isinstance(row, str) else json.dumps(row))
            f.write("\n")
    return path


class _Ledger:
    def __init__(self, model):
        self._bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    def peaks(self) -> dict:
        return {"gpu": self._bytes, "host": 3 * self._bytes}

    def usage(self) -> dict:
        return {"gpu": {"params": self._bytes}, "host": {"master": self._bytes,
                                                         "optim": 2 * self._bytes}}


def _materialize_meta_params(model) -> None:
    """Give every meta parameter CPU storage (tied parameters stay tied); buffers untouched."""
    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_meta:
                if id(p) not in made:
                    made[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype),
                                                     requires_grad=p.requires_grad)
                setattr(module, name, made[id(p)])


class StandInEngine:
    """Tests only: the offload.Engine API over a plain model and torch AdamW (no offload).

    `step` splits the batch into `grad_accum` micro-batches along dim 0, averages their
    gradients, clips and updates once.
    """

    def __init__(self, model, *, optimizer="adamw", lr=1e-4, weight_decay=0.0,
                 betas=(0.9, 0.999), grad_clip=None, **_ignored):
        _materialize_meta_params(model)
        self.model, self.grad_clip = model, grad_clip
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas,
                                     weight_decay=weight_decay)
        self.ledger = _Ledger(model)
        self.timeline: list[dict] = []
        self.phase_times: dict = {}
        self.closed = False
        self.steps = 0

    def load_weights(self, named) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, t in named:
                if name in params:
                    params[name].copy_(t)

    def init_weights_(self, *, seed: int = 0, std: float = 0.02) -> None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if p.dim() >= 2:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
                else:
                    p.fill_(1.0 if "norm" in name else 0.0)

    def set_lr(self, lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr

    def step(self, batch: dict, grad_accum: int = 1) -> float:
        self.model.train()
        total = 0.0
        for micro in zip(*(batch[k].chunk(grad_accum) for k in
                           ("input_ids", "labels", "attention_mask"))):
            out = self.model(input_ids=micro[0], labels=micro[1], attention_mask=micro[2])
            (out.loss / grad_accum).backward()
            total += float(out.loss.detach()) / grad_accum
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.steps += 1
        gpu = self.ledger.peaks()["gpu"]
        self.timeline = [{"moment": i, "phase": ph, "bytes": {"gpu": gpu * (1 + i % 3),
                                                              "host": gpu * 3}}
                         for i, ph in enumerate(["forward"] * 4 + ["backward"] * 4 + ["update"] * 2)]
        return total

    @torch.no_grad()
    def eval_loss(self, batch: dict) -> float:
        self.model.eval()
        return float(self.model(input_ids=batch["input_ids"], labels=batch["labels"],
                                attention_mask=batch["attention_mask"]).loss)

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                "step": self.steps}

    def load_state_dict(self, sd: dict) -> None:
        self.model.load_state_dict(sd["model"])
        self.opt.load_state_dict(sd["optimizer"])
        self.steps = sd["step"]

    def named_parameters_fp32(self):
        for name, p in self.model.named_parameters():
            yield name, p.detach().float()

    def close(self) -> None:
        self.closed = True
