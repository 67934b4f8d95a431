"""Errors a user can cause. Each carries a one-line message; the CLI prints it and exits 2."""

from .units import format_size

#: seconds a collective waits for the other ranks before this rank fails naming them (a rank that
#: died or hangs): the CLI's default process group and the engine's groups (offload.engine.ranks)
DIST_TIMEOUT_S = 60.0


class TierwiseError(Exception):
    """Base class: a problem with the user's input or machine, not a bug."""

    #: raised by every rank alike, from figures all ranks share (several ranks: rank 0 alone
    #: prints it, the others exit with the same code)
    every_rank = False


class SizeError(TierwiseError, ValueError):
    """A size string such as '24G' could not be parsed."""


class BudgetExceeded(TierwiseError, MemoryError):
    """An allocation would exceed a tier's hard budget."""

    def __init__(self, *, tier: str, budget: int, used: int, asked: int, kind: str):
        self.tier, self.budget, self.used, self.asked, self.kind = tier, budget, used, asked, kind
        super().__init__(
            f"tier '{tier}' budget {format_size(budget)} exceeded: {format_size(used)} in use, "
            f"asked for {format_size(asked)} more ({kind})"
        )


class InfeasibleBudget(TierwiseError):
    """A budget is below the minimum a run needs; the message names the minimum."""

    def __init__(self, message: str, *, minimum: dict[str, int] | None = None):
        self.minimum = minimum or {}
        super().__init__(message)


class StepOverBudget(InfeasibleBudget):
    """A step needed more device memory than the placement made for the run leaves it.

    `step_done`: the step that raised completed (its update ran); `weights_intact`: otherwise,
    whether nothing of the failed step reached the weights (no chunk was updated early), so
    the engine holds the state of its last completed step and a checkpoint of it is exact."""

    def __init__(self, message: str, *, minimum: dict[str, int] | None = None, step_done: bool = False,
                 weights_intact: bool = True):
        super().__init__(message, minimum=minimum)
        self.step_done, self.weights_intact = step_done, weights_intact


class NvmeError(TierwiseError, OSError):
    """Swap I/O failed: full disk, short read/write, checksum mismatch, bad directory."""


class ParamLayoutError(TierwiseError, ValueError):
    """A parameter's memory layout cannot be held in a chunk slot (it overlaps itself or has gaps)."""


class UnsupportedModel(TierwiseError, ValueError):
    """The model does something the engine cannot run exactly; the message names the
    parameter and the module."""
