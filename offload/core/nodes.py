"""NUMA node and CPU lists as Linux writes them ('0-3,8') and as the CLI takes them: pure
parsing, no torch, so the config and the planner can check --cxl-node without the runtime."""

from __future__ import annotations

from typing import Sequence

from .errors import TierwiseError


def parse_cpulist(text: str) -> tuple[int, ...]:
    """'0-3,8,10-11' -> (0, 1, 2, 3, 8, 10, 11); '' -> ()."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(cpus)



def parse_node_list(value: "int | str | Sequence[int] | None", *, what: str = "--cxl-node"
                    ) -> tuple[int, ...] | None:
    """1, "1", "1,2", "1-2", "[1, 2]" (a TOML list through the CLI) or [1, 2] -> (sorted,
    unique ids); None -> None."""
    if value is None:
        return None
    try:
        if isinstance(value, int):
            ids = [value]
        elif isinstance(value, str):
            ids = list(parse_cpulist(value.replace(" ", "").strip("[]")))
        else:
            ids = [int(v) for v in value]
    except (TypeError, ValueError):
        ids = []
    if not ids or min(ids) < 0 or isinstance(value, bool):
        raise TierwiseError(f"{what} {value!r}: give NUMA node ids >= 0, e.g. 1 or 1,2")
    return tuple(sorted(set(ids)))
