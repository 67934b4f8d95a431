"""Ordinary PyTorch modules (not Hugging Face) that stress how the engine finds parameter reads,
recomputes blocks and counts gradients; with their data, loss and a plain-PyTorch reference.

- encoder:   nn.TransformerEncoder (its nn.MultiheadAttention reads `out_proj.weight` through
             F.multi_head_attention_forward: out_proj's own forward never runs)
- tied:      an output head tied to the embedding through F.linear(h, emb.weight)
- batchnorm: blocks with BatchNorm1d (forward updates running stats and num_batches_tracked)
- shared:    one Linear shared by every (checkpointed) block, plus a block reused twice
- datafed:   the first checkpointed block takes the data itself (no input needs grad); the
             blocks own a parameter directly (read in the block's recompute too)
- routed:    blocks that send each token through an MLP or not by the sign of a feature (a
             router's choice): what a block saves for backward is sized by the data
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ = 64, 8


class Encoder(nn.Module):
    def __init__(self, d: int = 32, layers: int = 2, dropout: float = 0.1):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=2 * d, dropout=dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, T] -> [B, T, V]
        return self.head(self.encoder(self.emb(x)))


class Mlp(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(h)))


class TiedHead(nn.Module):
    def __init__(self, d: int = 32, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(Mlp(d) for _ in range(layers))
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return F.linear(self.norm(h), self.emb.weight)  # the head is the embedding


class BnBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.lin, self.bn = nn.Linear(d, d), nn.BatchNorm1d(d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # h: [N, D]
        return h + torch.relu(self.bn(self.lin(h)))


class BatchNormNet(nn.Module):
    def __init__(self, d: int = 32, layers: int = 3):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(BnBlock(d) for _ in range(layers))
        self.head = nn.Linear(d, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x).flatten(0, 1)
        for b in self.blocks:
            h = b(h)
        return self.head(h).view(*x.shape, VOCAB)


class SharedBlock(nn.Module):
    def __init__(self, d: int, shared: nn.Linear):
        super().__init__()
        self.shared, self.own = shared, nn.Linear(d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.own(self.shared(h)))


class SharedNet(nn.Module):
    """blocks.0.shared is every block's `shared`; blocks[3] is blocks[1] again (run twice)."""

    def __init__(self, d: int = 32, layers: int = 3):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        shared = nn.Linear(d, d)
        own = [SharedBlock(d, shared) for _ in range(layers)]
        self.blocks = nn.ModuleList(own + [own[1]])
        self.head = nn.Linear(d, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


class GainMlp(Mlp):
    """`gain` is the block's own parameter: read in the block's forward (and its recompute)."""

    def __init__(self, d: int):
        super().__init__(d)
        self.gain = nn.Parameter(torch.full((d,), 0.5))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.gain * self.down(F.gelu(self.up(h)))


class DataFed(nn.Module):
    """The first (checkpointed) block is fed the data itself: an input that needs no grad."""

    def __init__(self, d: int = 32, layers: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(GainMlp(d) for _ in range(layers))
        self.head = nn.Linear(d, VOCAB)
        self.d = d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.one_hot(x, VOCAB)[..., :self.d].float()
        for b in self.blocks:
            h = b(h)
        return self.head(h)


class RoutedBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        picked = (h[..., 0] > 0).nonzero(as_tuple=True)  # as many rows as the data sends
        return h.index_put(picked, h[picked] + self.down(torch.tanh(self.up(h[picked]))))


class Routed(nn.Module):
    def __init__(self, d: int = 32, layers: int = 3):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(RoutedBlock(d) for _ in range(layers))
        self.head = nn.Linear(d, VOCAB)

    forward = SharedNet.forward  # (embedding, the blocks in turn, head)


BUILDERS = {"encoder": Encoder, "tied": TiedHead, "batchnorm": BatchNormNet, "shared": SharedNet,
            "datafed": DataFed, "routed": Routed}


def build(kind: str, *, seed: int = 0, **kw) -> nn.Module:
    torch.manual_seed(seed)
    return BUILDERS[kind](**kw)


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["x"])
    return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())


def data(n: int, *, batch: int = 4, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g)
        out.append({"x": x[:, :-1], "y": x[:, 1:]})
    return out


def reference(model: nn.Module, batches: list[dict], *, lr: float = 1e-3, grad_accum: int = 1,
              seed: int = 2) -> tuple[list[float], nn.Module]:
    """Plain PyTorch on a copy of `model` (fused AdamW, as the engine's arithmetic): (losses, model).
    The RNG (dropout) is seeded as the engine run seeds it."""
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.0, fused=True)
    torch.manual_seed(seed)
    losses = []
    for b in batches:
        total = 0.0
        for i in range(grad_accum):
            mb = {k: v.chunk(grad_accum)[i] for k, v in b.items()}
            loss = lm_loss(ref, mb)
            (loss / grad_accum if grad_accum > 1 else loss).backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total / grad_accum)
    return losses, ref


def state_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by name (a shared tensor under its first name)."""
    return {n: t.detach() for n, t in list(module.named_parameters()) + list(module.named_buffers())}
