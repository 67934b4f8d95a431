"""Train any nn.Module with the tierwise Engine: not only Hugging Face models.

The engine packs the module's parameters into chunks, keeps at most --gpu-mem of them on the
device and streams the rest; `loss_fn(model, batch)` says how a batch becomes a loss. Repeated
blocks (the ModuleList below) get activation checkpointing automatically.

    python examples/custom_module_engine.py
"""

from __future__ import annotations

import torch
from torch import nn

from tierwise.offload import Budget, Engine, Optim


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.ff = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, D]
        return x + self.ff(self.norm(x))


class DeepRegressor(nn.Module):
    def __init__(self, width: int = 128, depth: int = 8):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, D] -> [B]
        for block in self.blocks:
            x = block(x)
        return self.head(x).squeeze(-1)


def mse_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch["x"]), batch["y"])


def main() -> None:
    torch.manual_seed(0)
    model = DeepRegressor()
    target = torch.randn(128)
    # Chunks of 256 KiB and a 2 MiB device budget: most of the model streams every step.
    engine = Engine(model, budget=Budget(gpu="2M", cpu="1G", chunk=256 << 10), optim=Optim("adamw", lr=1e-3),
                    loss_fn=mse_loss)
    xs = torch.randn(8, 64, 128)  # 8 fixed batches of [B=64, D=128]
    try:
        window = []
        for step in range(1, 61):
            x = xs[step % len(xs)]
            window.append(engine.step({"x": x, "y": x @ target / 128 ** 0.5}))
            if step % 20 == 0:
                peaks = {t: f"{b / 2**20:.2f} MiB" for t, b in engine.ledger.peaks().items()}
                print(f"steps {step - 19}-{step}: mean loss {sum(window) / len(window):.4f}  "
                      f"peak bytes per tier {peaks}")
                window = []
        weights = dict(engine.named_parameters_fp32())  # fp32 CPU copies, e.g. to save
        print(f"{len(weights)} tensors, {sum(w.numel() for w in weights.values()):,} parameters")
    finally:
        engine.close()


if __name__ == "__main__":
    main()
