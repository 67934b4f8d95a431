"""A small C kernel for the fused 8-bit Adam step on CPU, built with the system C compiler.

Per block of 256: dequantize, update p and both moments, new absmax, then requantize by
arithmetic (quant.DecadeTable: no search and no gather). The path is chosen at run time:
AVX-512 (F/BW/DQ/VBMI: dequantization by in-register byte permutes), else AVX2 + FMA (scalar
table loads inserted into vectors, the quantizer as one byte shuffle and four 8-lane
permutes), else portable scalar; all three round every operation identically, so they give
the same bytes. $TIERWISE_CPU_ISA (scalar, avx2 or avx512) caps the path, e.g. to measure
the AVX2 path on an AVX-512 host. Plain C + OpenMP loaded with ctypes: no torch headers, so
it builds in about a second and needs no ninja. The library is cached per source hash under
$TIERWISE_CACHE_DIR (default ~/.cache/tierwise). Without a compiler, `load()` returns None
and callers use the torch path. The C source of the three paths is optim/csrc/adam8bit.c
(package data; its hash keys the cache).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)

ISA_NAMES = ("scalar", "avx2", "avx512")  # the kernel's isa argument is the index
ISA_ENV = "TIERWISE_CPU_ISA"

SOURCE_FILE = Path(__file__).with_name("csrc") / "adam8bit.c"  # package data


@functools.lru_cache(maxsize=1)
def _source() -> str:
    return SOURCE_FILE.read_text()


# No -march: the SIMD paths are enabled per function and chosen at run time (tw_best_isa),
# so the cached library runs on any x86-64. -ffp-contract=off keeps every rounding explicit.
_FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-ffp-contract=off",
          "-fno-strict-aliasing"]


def _cache_dir() -> Path:
    root = os.environ.get("TIERWISE_CACHE_DIR") or os.path.join(Path.home(), ".cache", "tierwise")
    return Path(root)


def _build(target: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc/cc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / "adam8bit.c"
        src.write_text(_source())
        out = Path(tmp) / target.name
        subprocess.run([cc, *_FLAGS, str(src), "-o", str(out), "-lm"], check=True,
                       capture_output=True, text=True, timeout=300)
        os.replace(out, target)  # atomic: concurrent builders never see a half-written file


@functools.lru_cache(maxsize=1)
def load() -> Optional[ctypes.CDLL]:
    """The compiled kernel library, or None (logged once) if it cannot be built."""
    if os.environ.get("TIERWISE_NO_C_KERNEL"):
        return None
    if sys.platform == "win32":
        return None
    try:
        text = _source()
    except OSError as exc:
        logger.warning("8-bit Adam C kernel source missing (%s); using the slower torch path", exc)
        return None
    key = hashlib.sha256((text + " ".join(_FLAGS) + os.uname().machine).encode()).hexdigest()[:16]
    target = _cache_dir() / f"adam8bit_{key}.so"
    try:
        if not target.exists():
            logger.info("building the 8-bit Adam CPU kernel into %s", target)
            _build(target)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or ""
        logger.warning("8-bit Adam C kernel unavailable (%s %s); using the slower torch path",
                       exc, detail[-500:])
        return None
    fn = lib.tw_adam8bit_step
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 11 + [ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    lib.tw_quantize.restype = ctypes.c_int
    lib.tw_quantize.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_int64, ctypes.c_int]
    lib.tw_best_isa.restype = ctypes.c_int
    lib.tw_best_isa.argtypes = []
    return lib


def isa_limit() -> int:
    """The most capable path allowed: $TIERWISE_CPU_ISA (scalar, avx2, avx512), else avx512.
    The kernel lowers it further to what the CPU has."""
    value = os.environ.get(ISA_ENV, "").strip().lower()
    if not value:
        return len(ISA_NAMES) - 1
    if value not in ISA_NAMES:
        raise ValueError(f"{ISA_ENV}={value!r}: expected one of {', '.join(ISA_NAMES)}")
    return ISA_NAMES.index(value)


def best_isa() -> int:
    """The most capable path this CPU runs (0 without the compiled kernel)."""
    lib = load()
    return lib.tw_best_isa() if lib is not None else 0


def isa_in_use() -> str:
    """The path the 8-bit step takes on CPU here and now ('torch' without the C kernel)."""
    if load() is None:
        return "torch"
    return ISA_NAMES[min(isa_limit(), best_isa())]
