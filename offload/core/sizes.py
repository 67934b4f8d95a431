"""Parse byte sizes: '24G', '24GiB', '512M', '1.5T', '4096' (formatting: core/units.py).

Decision: K/M/G/T and KiB/MiB/GiB/TiB are all powers of 1024 (memory is sold in GiB and
users type '24G' meaning the card's 24 GiB). 'KB/MB/GB/TB' are powers of 1000.
"""

import re

from .errors import SizeError

_UNITS = {
    "": 1, "B": 1,
    "K": 1 << 10, "KIB": 1 << 10, "KB": 10**3,
    "M": 1 << 20, "MIB": 1 << 20, "MB": 10**6,
    "G": 1 << 30, "GIB": 1 << 30, "GB": 10**9,
    "T": 1 << 40, "TIB": 1 << 40, "TB": 10**12,
}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: "str | int | None", *, what: str = "size") -> "int | None":
    """'24G' -> 25769803776. None stays None; an int is returned as is (bytes); a string without
    a unit is refused ("24B" for bytes)."""
    if text is None or isinstance(text, int):
        if isinstance(text, int) and text < 0:
            raise SizeError(f"{what} must not be negative: {text}")
        return text
    m = _PATTERN.match(str(text))
    unit = m.group(2).upper() if m else None
    if m and not unit:  # ("24" is 24 bytes nowhere a user means it)
        if float(m.group(1)) == 0:
            raise SizeError(f"{what} must be positive, got {text}")
        raise SizeError(f"{what} {str(text).strip()} has no unit: write {str(text).strip()}G for GiB "
                        f"(or M, K, T; {str(text).strip()}B for bytes)")
    if not m or unit not in _UNITS:
        raise SizeError(
            f"bad {what} {text!r}: use a number with a unit, like 24G (24 GiB), 512M or 1.5T; 24GB is 24 x 10^9 bytes"
        )
    return int(float(m.group(1)) * _UNITS[unit])
