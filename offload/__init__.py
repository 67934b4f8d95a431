"""tierwise's heterogeneous memory manager: chunks, tiers, ledger, executor, engine."""

from offload.engine import Engine
from offload.errors import BudgetExceeded, InfeasibleBudget, SizeError, TierwiseError
from offload.sizes import format_size, parse_size

__all__ = ["Engine", "BudgetExceeded", "InfeasibleBudget", "SizeError", "TierwiseError",
           "format_size", "parse_size"]
