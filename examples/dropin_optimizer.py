"""AdamW8bit as a drop-in torch optimizer: a tiny regression MLP trained on CPU in seconds.

    python examples/dropin_optimizer.py
"""

import torch

from tierwise.optim import AdamW8bit


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1))
    x = torch.randn(1024, 64)
    y = torch.sin(x[:, :1]) + 0.1 * x[:, 1:2]
    opt = AdamW8bit(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=300)
    for step in range(300):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 50 == 0 or step == 299:
            print(f"step {step:3d}  loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
