"""Format byte counts for people: 25769803776 -> '24.00 GiB' (pure: errors.py uses it, so it
imports nothing of ours; parsing is sizes.py)."""


def format_size(n: "int | float") -> str:
    """25769803776 -> '24.00 GiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
