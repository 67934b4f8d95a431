"""MeZO inside the engine, with ZO2's trick: each chunk crosses the link once per step.

MeZO needs two forward passes per step, at parameters θ+εz and θ-εz. Instead of streaming
the model twice, the engine runs ONE forward over the batch duplicated, [x; x]: every module
that owns parameters computes the first half with its parameters at +εz and the second half
at -εz while its chunk is resident (ops without parameters, e.g. attention, see a batch of
2B whose rows are independent). So each chunk is fetched once per step — from host, CXL or
NVMe alike. The perturbed weights are temporaries built from the resident compute copy, which
stays pristine (a parameter used twice, like tied embeddings, is perturbed afresh each time).

The update then runs where the fp32 masters live, chunk by chunk, with the drop-in MeZO's
arithmetic (+εz, -2εz, +εz, then p -= lr (g z + wd p)), so the engine gives the same
parameters as `optim.MeZO` step for step. z is regenerated from (step seed, parameter index).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from ..core.chunks import ChunkPlan
from ...optim.mezo import direction, tensor_seed
from ...profiles.model import text_config


class MeZOChunks:
    """The MeZO update on chunk masters (no gradient, no state)."""

    name = "mezo"
    needs_grad = False

    def __init__(self, plan: ChunkPlan, *, order: list[str], eps: float = 1e-3, seed: int = 0):
        if eps <= 0:
            raise ValueError(f"MeZO eps must be > 0, got {eps}")
        self.plan, self.eps, self.seed = plan, eps, seed
        self.index = {n: i + 1 for i, n in enumerate(order)}  # as the drop-in numbers parameters
        self.step_seed = 0
        self.projected_grad = 0.0
        self.steps = 0

    def state_bytes(self, cid: int) -> int:
        return 0

    def begin_step(self) -> int:
        self.steps += 1
        self.step_seed = tensor_seed(self.seed, self.steps)
        return self.step_seed

    def z(self, name: str, like: torch.Tensor) -> torch.Tensor:
        return direction(like, seed=self.step_seed, index=self.index[name])

    def step(self, master: torch.Tensor, grad: Any, blob: Any, cid: int, step: torch.Tensor, hp: Any) -> None:
        """master: [numel] fp32 chunk; grad and blob unused."""
        for name in self.plan.chunks[cid].params:
            s = self.plan.slots[name]
            p = s.view(master)  # the parameter's shape and strides, as the drop-in sees it
            z = self.z(name, p)
            for factor in (1.0, -2.0, 1.0):  # the drop-in's perturb / restore, same rounding
                p.add_(z, alpha=factor * self.eps)
            if hp.weight_decay != 0.0:
                p.mul_(1.0 - hp.lr * hp.weight_decay)
            p.add_(z, alpha=-hp.lr * self.projected_grad)
        step += 1

    def meta_state(self) -> dict:
        return {"steps": self.steps}

    def load_meta_state(self, meta: dict) -> None:
        self.steps = int(meta.get("steps", 0))


def dual_forward(forward: Callable, module: torch.nn.Module, *, half: Callable[[], "int | None"],
                 updater: MeZOChunks, names: Mapping[torch.nn.Parameter, str], ledger: Any) -> Callable:
    """Wrap a parameter-owning module: first half of the batch at +εz, second half at -εz.
    `half()`: the rows of the +εz half while a dual forward runs, else None (a plain forward);
    `names`: each parameter's full name (z is drawn per name); `ledger`: books the perturbed
    copies as device workspace."""
    params = {n: p for n, p in module.named_parameters(recurse=False)}

    def wrapper(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        zo = half()
        if zo is None:
            return forward(x, *args, **kwargs)
        up = updater
        pristine = {n: p.data for n, p in params.items()}
        full = {n: names[p] for n, p in params.items()}
        nbytes = 2 * sum(t.numel() * t.element_size() for t in pristine.values())
        ledger.reserve("gpu", "workspace", nbytes)
        try:
            zs = {n: up.z(full[n], t) for n, t in pristine.items()}
            plus = {n: pristine[n].add(zs[n], alpha=up.eps) for n in params}
            for n, p in params.items():
                p.data = plus[n]
            out_pos = forward(x[:zo], *args, **kwargs)
            for n, p in params.items():
                p.data = plus[n].add(zs[n], alpha=-2.0 * up.eps)
            out_neg = forward(x[zo:], *args, **kwargs)
        finally:
            for n, p in params.items():
                p.data = pristine[n]
            ledger.release("gpu", "workspace", nbytes)
        return torch.cat([out_pos, out_neg], dim=0)

    return wrapper


def hf_split_losses(model: torch.nn.Module, batch: dict[str, torch.Tensor], half: int) -> tuple[float, float]:
    """Both MeZO losses of a Hugging Face causal LM from one forward over the doubled batch."""
    labels = batch["labels"]
    inputs = {k: torch.cat([v, v], dim=0) if isinstance(v, torch.Tensor) else v
              for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits
    vocab = text_config(model.config).vocab_size  # (a vision model's: its text model's)
    return tuple(float(model.loss_function(logits=part, labels=labels, vocab_size=vocab))
                 for part in (logits[:half], logits[half:]))
