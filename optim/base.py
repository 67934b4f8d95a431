"""Shared plumbing of the tierwise optimizers: the step loop, state_dict dtypes, write-back."""
from __future__ import annotations

import copy
import math
import numbers
from typing import Any, Callable, Optional

import torch

from .costs import OptimizerCost


def check_hyper(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """torch.optim.AdamW's checks (a NaN fails them too): a bad value is refused here, not a NaN
    later; so is one of the wrong kind (a string lr, one beta), not a TypeError in the step."""
    try:
        beta1, beta2 = betas
        ok = bool(lr >= 0 and eps >= 0 and weight_decay >= 0 and 0 <= beta1 < 1 and 0 <= beta2 < 1)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"invalid lr/betas/eps/weight_decay: {lr!r}, {betas!r}, {eps!r}, {weight_decay!r} "
                         f"(want lr, eps, weight_decay >= 0 and betas in [0, 1))")


def check_low_rank(rank: Any, update_proj_gap: Any, scale: Any) -> None:
    """GaLore / APOLLO options (drop-in groups and the engine's): refused here, by name, rather
    than as a shape error, a ZeroDivisionError or NaN weights in a step."""
    # numbers.Integral: numpy's ints too; a gap may be a whole float (it only counts steps)
    if rank is not None and not (isinstance(rank, numbers.Integral) and rank >= 1):
        raise ValueError(f"rank must be an int >= 1, got {rank!r}")
    whole = isinstance(update_proj_gap, numbers.Integral) or (
        isinstance(update_proj_gap, float) and update_proj_gap.is_integer())
    if not (whole and update_proj_gap >= 1):
        raise ValueError(f"update_proj_gap must be an int >= 1, got {update_proj_gap!r}")
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")


class TierwiseOptimizer(torch.optim.Optimizer):
    """A thin loop: for every param with a grad, `_update(p, group, state, index)`.

    Subclasses put the math in a pure function and call it from `_update`.
    """

    #: the step computes in fp32 (a float64 parameter would be rounded to it: refused)
    fp32_math = True
    #: whose state dicts load into this class (Adam8bit's and AdamW8bit's are one; a subclass
    #: inherits its parent's); None: the class's own name
    state_family: str | None = None
    #: param-group keys every version of this optimizer wrote and other optimizers lack: a
    #: state dict without its `tierwise_optimizer` tag and without these is another optimizer's
    signature_keys: frozenset[str] = frozenset()

    @classmethod
    def cost(cls) -> OptimizerCost:
        raise NotImplementedError

    def _update(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any], index: int) -> None:
        raise NotImplementedError

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if "betas" in group:  # every group (the constructor's too): a bad value fails now, by name
            try:
                check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"])
            except ValueError:
                self.param_groups.pop()  # a refused group leaves the optimizer as it was
                raise
        # the steps compute on real float copies: a complex param would lose its imaginary part
        complex_ = [p for p in group["params"] if p.is_complex()]
        if complex_:
            self.param_groups.pop()
            raise ValueError(f"{type(self).__name__} does not support complex parameters (one of shape "
                             f"{tuple(complex_[0].shape)}): keep it as a real (..., 2) parameter and "
                             f"view_as_complex it in forward")
        double = [p for p in group["params"] if p.dtype == torch.float64 and p.requires_grad] if self.fp32_math else []
        if double:
            self.param_groups.pop()
            raise ValueError(f"{type(self).__name__} computes in fp32: a float64 parameter (one of shape "
                             f"{tuple(double[0].shape)}) would be rounded to it; give it to torch.optim.AdamW")

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                self._update(p, group, self.state[p], index)
        return loss

    def _family(self) -> str:
        return self.state_family or type(self).__name__

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "tierwise_optimizer": self._family()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # another optimizer's state (torch's AdamW, bitsandbytes', another of ours) would load
        # as moments of another shape (a crash inside a step) or silently replace these groups
        name, saved_name = self._family(), state_dict.get("tierwise_optimizer")
        groups = state_dict.get("param_groups", [])
        missing = sorted({k for g in groups for k in self.signature_keys - set(g)})
        if (saved_name is not None and saved_name != name) or (saved_name is None and missing):
            what = (f"{saved_name}'s" if saved_name is not None else
                    f"another optimizer's (its param groups lack {', '.join(missing)})")
            raise ValueError(f"{type(self).__name__}.load_state_dict: this is {what} state; load one "
                             f"{type(self).__name__}.state_dict() wrote, or start it afresh")
        # a key a later version added: its default, as torch's __setstate__ fills its own
        defaults = {k: v for k, v in self.defaults.items() if k != "params"}
        state_dict = {**state_dict, "param_groups": [{**defaults, **g} for g in groups]}
        # torch casts floating state to the param dtype (uint8 codes would survive, but an fp32
        # absmax of a bf16 param would not): keep every saved tensor's dtype instead.
        saved = copy.deepcopy(state_dict["state"])
        super().load_state_dict(state_dict)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params):
            if pid in saved:
                self.state[p] = {k: v.to(p.device) if torch.is_tensor(v) else v
                                 for k, v in saved[pid].items()}


class LowRankOptimizer(TierwiseOptimizer):
    """GaLore / APOLLO plumbing: groups with a `rank` project their >= 2-D params through
    `_projected_step`; every other param gets plain AdamW (the papers' choice for embeddings,
    norms and biases), as their reference code has it (optim.adamw.plain_step_). Non-fp32
    params are updated through an fp32 copy. Built with no group
    holding a rank it is refused: it would be plain AdamW with AdamW's state, saying nothing."""

    #: the rank `finetune --optimizer NAME` uses, named in the refusal's hint
    suggested_rank = 128
    signature_keys = frozenset({"rank", "update_proj_gap"})
    #: a parameter not projected takes the reference code's AdamW: GaLore's and APOLLO's own
    #: (optim.adamw.plain_step_); 8-bit GaLore's runs bitsandbytes' AdamW8bit there (adamw_step_'s form)
    plain_reference = True

    def __init__(self, params: Any, defaults: dict[str, Any]) -> None:
        super().__init__(params, defaults)
        if not any(g.get("rank") for g in self.param_groups):
            name, r = type(self).__name__, self.suggested_rank
            raise ValueError(f"{name} got no rank: every parameter would get plain AdamW (its full state); give "
                             f"its groups with tierwise.offload.update.updaters.drop_in_groups(model, rank={r}) "
                             f"(the 2-D weights projected, embeddings and norms plain), or rank={r} for all")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        # every group (the constructor's too) is checked here: a bad rank or gap fails now,
        # with its name, not as a shape error inside the first step
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            check_low_rank(group.get("rank"), group["update_proj_gap"], group["scale"])
        except ValueError:
            self.param_groups.pop()  # a refused group leaves the optimizer as it was
            raise

    def _projected_step(self, p: torch.Tensor, master: torch.Tensor, group: dict[str, Any],
                        state: dict[str, Any], index: int, hyper: dict[str, float]) -> None:
        raise NotImplementedError

    def _update(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any], index: int) -> None:
        from .adamw import adamw_step_, init_adamw_state, plain_step_

        beta1, beta2 = group["betas"]
        hyper = dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                     weight_decay=group["weight_decay"])
        master = p.data if p.dtype == torch.float32 else p.data.float()
        if group.get("rank") and p.dim() >= 2:
            self._projected_step(p, master, group, state, index, hyper)
        else:
            if not state:
                state.update(init_adamw_state(p), step=0)
            state["step"] += 1
            (plain_step_ if self.plain_reference else adamw_step_)(master, p.grad, state, step=state["step"], **hyper)
        if master is not p.data:
            p.data.copy_(master)


def write_back_(
    param: torch.Tensor,  # (...) bf16/fp16 model param
    master: torch.Tensor,  # (...) fp32 updated values
    *,
    stochastic: bool,
    seed: int,
) -> None:
    """Copy fp32 values into a lower-precision param, optionally with stochastic rounding to bf16."""
    if stochastic and param.dtype == torch.bfloat16:
        gen = torch.Generator(device=master.device).manual_seed(seed)
        bits = master.reshape(-1).view(torch.int32)
        noise = torch.randint(0, 1 << 16, bits.shape, generator=gen, device=master.device, dtype=torch.int32)
        # adding uniform noise below the bf16 cut rounds up with probability = discarded fraction
        rounded = ((bits + noise) & -65536).view(torch.float32)
        param.data.copy_(rounded.view(param.shape))
    else:
        param.data.copy_(master.view(param.shape))
