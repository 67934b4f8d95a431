"""What a step that outgrew the gpu budget needed, as StepOverBudget errors with the numbers."""

from __future__ import annotations

from ..core.errors import BudgetExceeded, StepOverBudget
from ..core.units import format_size


def warmup_over_budget(exc: BudgetExceeded, act: int, minimum: int, *, intact: bool,
                       phase: str = "") -> StepOverBudget:
    """In the first step (or measure: nothing placed yet, every chunk streams): the engine's
    minimum with the activations so far (`act`), at least what the failed reservation asked. A
    step stopped in forward has not saved all it will: that minimum is a floor, not the need."""
    need = max(exc.used + exc.asked, minimum)
    floor = ("; it stopped in forward, so the whole step needs more (its remaining layers save too): "
             "a budget well above this, or `finetune plan` for the model's estimate" if phase == "forward" else "")
    return StepOverBudget(
        f"gpu budget {format_size(exc.budget)} ({exc.budget} B) is below the engine's minimum for this "
        f"batch: at least {format_size(need)} ({need} B), with activations so far {format_size(act)} "
        f"(the first step streams every chunk through the smallest window{floor}); raise the gpu budget "
        f"(--gpu-mem, Budget(gpu=...), offload={{'gpu_mem': ...}}) or lower the batch size / sequence length",
        minimum={"gpu": need}, weights_intact=intact)


def step_over_budget(exc: BudgetExceeded, act: int, placed_for: int, *, intact: bool) -> StepOverBudget:
    """After placement: what the step needed with it (in use + asked, above the budget by
    construction) and the activations the chunks had been placed for."""
    need = exc.used + exc.asked
    return StepOverBudget(
        f"gpu budget {format_size(exc.budget)} ({exc.budget} B) cannot hold this step: it needed at least "
        f"{format_size(need)} ({need} B): {format_size(exc.used)} in use + {format_size(exc.asked)} more for "
        f"{exc.kind}, with activations at {format_size(act)} where the chunks were placed for "
        f"{format_size(placed_for)}; measure the largest batch before the first step "
        f"(Engine.measure), or raise --gpu-mem or lower the batch size / sequence length",
        minimum={"gpu": need}, weights_intact=intact)


def estimate_over_budget(budget: int, act: int, over: int, *, need: int) -> StepOverBudget:
    """Chunks placed up front for an estimate of `act - over` bytes of activations; the warm-up
    saved `act` and the stream cache cannot give way enough: raised after a completed step."""
    return StepOverBudget(
        f"gpu budget {format_size(budget)} ({budget} B) cannot hold the next steps: the chunks were placed "
        f"for {format_size(act - over)} of activations, the warm-up step saved {format_size(act)}; with "
        f"this placement at least {format_size(need)} ({need} B) is needed; raise --gpu-mem or lower "
        f"the batch size / sequence length", minimum={"gpu": need}, step_done=True)
