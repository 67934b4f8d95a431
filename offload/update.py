"""The optimizer step on whole chunks.

An updater owns the math of one optimizer applied to flat chunk tensors: `state_spec` says
which state tensors a chunk needs (so the engine can place and account them), `step` runs
one update in place. fp32 AdamW uses torch's fused kernel (on the CPU for host-resident
chunks, on the device for device-resident ones); a flat chunk whose slots are 64-byte aligned
gives bit-for-bit the result of the per-tensor fused kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(kw_only=True)
class Hyper:
    """Hyper-parameters shared by the chunk updaters (lr may change every step)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0

    def __post_init__(self) -> None:
        if self.lr < 0 or self.eps < 0 or self.weight_decay < 0:
            raise ValueError("lr, eps and weight_decay must be >= 0")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must be in [0, 1): {self.betas}")


class AdamWChunks:
    """Decoupled-weight-decay Adam (AdamW) on flat fp32 chunks."""

    name = "adamw"
    state_spec = (("exp_avg", torch.float32), ("exp_avg_sq", torch.float32))

    def step(self, master: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
             step: torch.Tensor, hp: Hyper) -> None:
        """master, grad, state tensors: [numel] fp32 on one device; step: [] fp32 counter."""
        step += 1
        torch._fused_adamw_(
            [master], [grad], [state["exp_avg"]], [state["exp_avg_sq"]], [], [step],
            amsgrad=False, lr=hp.lr, beta1=hp.betas[0], beta2=hp.betas[1],
            weight_decay=hp.weight_decay, eps=hp.eps, maximize=False,
        )


class SGDChunks:
    """SGD with optional momentum and L2 weight decay, as torch.optim.SGD computes it."""

    name = "sgd"

    def __init__(self, momentum: float = 0.0):
        self.momentum = momentum
        self.state_spec = (("momentum_buffer", torch.float32),) if momentum else ()

    def step(self, master: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
             step: torch.Tensor, hp: Hyper) -> None:
        """master, grad, state tensors: [numel] fp32 on one device; step: [] fp32 counter."""
        d_p = grad if hp.weight_decay == 0 else grad.add(master, alpha=hp.weight_decay)
        if self.momentum:
            buf = state["momentum_buffer"]
            if step.item() == 0:
                buf.copy_(d_p)
            else:
                buf.mul_(self.momentum).add_(d_p)
            d_p = buf
        master.add_(d_p, alpha=-hp.lr)
        step += 1


def make_updater(name: str, *, momentum: float = 0.0):
    """The chunk updater for an optimizer name."""
    if name == "adamw":
        return AdamWChunks()
    if name == "sgd":
        return SGDChunks(momentum)
    raise ValueError(f"optimizer {name!r} has no chunk updater (known: adamw, sgd)")
