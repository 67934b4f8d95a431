"""Errors a user can cause. Each carries a one-line message; the CLI prints it and exits 2."""


class TierwiseError(Exception):
    """Base class: a problem with the user's input or machine, not a bug."""


class SizeError(TierwiseError, ValueError):
    """A size string such as '24G' could not be parsed."""


class BudgetExceeded(TierwiseError, MemoryError):
    """An allocation would exceed a tier's hard budget."""

    def __init__(self, *, tier: str, budget: int, used: int, asked: int, kind: str):
        from offload.sizes import format_size

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


class NvmeError(TierwiseError, OSError):
    """Swap I/O failed: full disk, short read/write, checksum mismatch, bad directory."""


class UnsupportedModel(TierwiseError, ValueError):
    """The model does something the engine cannot run exactly; the message names the
    parameter and the module."""
