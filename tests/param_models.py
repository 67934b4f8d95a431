"""Tiny nn.Modules with unusual parameters, and their plain-PyTorch training.

Kinds of parameter a `Mixer` (in each `Block`, after an nn.Linear) can own:
- "scalar":  a 0-dim learned temperature, nn.Parameter(torch.tensor(0.8));
- "strided": non-contiguous weights: a matrix created transposed (strides (1, 2D)) and a
             permuted 3-D tensor;
- "odd":     element counts 1, 3 and 4097 (not multiples of the fused kernels' vector width),
             of magnitude ~1e-3, so that a rounding difference in the optimizer's arithmetic
             shows in the weights (their ulp is ~1e-10, about an update's rounding error).
Every parameter takes part in the loss. Blocks sit in a ModuleList, so the engine checkpoints
them; a linear stem before them makes their input require grad, as an embedding does in a
language model.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

D = 32
KINDS = ("scalar", "strided", "odd")
HP = dict(lr=2e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)


class Mixer(nn.Module):
    """The unusual parameters, read in their owner's forward."""

    def __init__(self, kinds: tuple[str, ...]):
        super().__init__()
        self.kinds = kinds
        if "scalar" in kinds:
            self.temp = nn.Parameter(torch.tensor(0.8))
        if "strided" in kinds:
            self.w = nn.Parameter((torch.randn(D, 2 * D) / D ** 0.5).t())  # (2D, D), strides (1, 2D)
            self.u = nn.Parameter(torch.randn(2, 4, D).permute(2, 0, 1) / 4)  # (D, 2, 4), permuted
            self.strides_seen: set[tuple] = set()
        if "odd" in kinds:
            self.a = nn.Parameter(torch.randn(1) / 1000)
            self.b = nn.Parameter(torch.randn(3) / 1000)
            self.c = nn.Parameter(torch.randn(4097) / 1000)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # h: (B, D)
        if "scalar" in self.kinds:
            h = h * self.temp
        if "strided" in self.kinds:
            self.strides_seen.add((self.w.stride(), self.u.stride()))
            h = torch.cat([h, h.tanh()], dim=-1) @ self.w + torch.einsum("bd,dij->bij", h, self.u).mean((1, 2))[:, None]
        if "odd" in self.kinds:
            h = h * (1 + self.a) + self.b.sum() - self.b[1] * self.b[2]
            h = h * (1 + self.c[0]) + self.c[1:].view(D, -1).mean(1)
        return h


class Block(nn.Module):
    def __init__(self, kinds: tuple[str, ...]):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.mix = Mixer(kinds)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # h: (B, D)
        return torch.tanh(self.mix(self.lin(h)))


class Zoo(nn.Module):
    """Blocks of the given kinds and a linear head; forward(x, y) -> MSE loss."""

    def __init__(self, kinds: tuple[str, ...], *, layers: int = 4, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.stem = nn.Linear(D, D)
        self.blocks = nn.ModuleList(Block(kinds) for _ in range(layers))
        self.head = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return F.mse_loss(self.head(h), y)


def zoo_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """The engine's loss_fn for a Zoo: inputs in the parameters' dtype (bf16 runs)."""
    dtype = next(model.parameters()).dtype
    return model(**{k: v.to(dtype) for k, v in batch.items()})


def zoo_data(n: int, *, batch: int = 4, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(batch, D, generator=g), "y": torch.randn(batch, D, generator=g)} for _ in range(n)]


def train_zoo_reference(model: nn.Module, data: list[dict], *, make_opt=None, grad_accum: int = 1,
                        precision: str = "fp32", clip: float | None = None) -> tuple[list[float], nn.Module]:
    """Plain PyTorch on a deep copy of `model` (default AdamW(fused=True), HP): (losses, model).
    bf16: the textbook mixed-precision loop (bf16 compute copy, fp32 master weights and grads)."""
    master = copy.deepcopy(model)
    opt = (make_opt or (lambda m: torch.optim.AdamW(m.parameters(), fused=True, **HP)))(master)
    work = master
    if precision == "bf16":
        work = copy.deepcopy(master)
        for p in work.parameters():
            p.data = p.data.to(torch.bfloat16)  # keeps the strides
    losses = []
    for b in data:
        total = 0.0
        for i in range(grad_accum):
            loss = zoo_loss(work, {k: v.chunk(grad_accum)[i] for k, v in b.items()})
            (loss / grad_accum if grad_accum > 1 else loss).backward()
            total += loss.float().item()
        if work is not master:
            for pm, pw in zip(master.parameters(), work.parameters()):
                pm.grad, pw.grad = pw.grad.float(), None
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(master.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if work is not master:
            with torch.no_grad():
                for pm, pw in zip(master.parameters(), work.parameters()):
                    pw.copy_(pm)
        losses.append(total / grad_accum)
    return losses, master
