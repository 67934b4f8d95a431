"""A small C kernel for the fused 8-bit Adam step on CPU, built with the system C compiler.

Plain C + OpenMP loaded with ctypes: no torch headers, so it builds in about a second and
needs no ninja. The library is cached per source hash under $TIERWISE_CACHE_DIR (default
~/.cache/tierwise). Without a compiler, `load()` returns None and callers use the torch path.
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

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

/* nearest map entry of s in [-1, 1]: table on the top 16 bits, then one midpoint compare */
/* nearest map entry of every s[j] in [-1, 1] (s is read as fp32 and as its bit pattern):
   a table on the top 16 bits gives the bucket's lowest candidate, one midpoint compare fixes it */
static void nearest_codes(const float *s, int32_t *out, const int32_t *lut, const float *mid, int len) {
    const int32_t *bits = (const int32_t *)s;
    #pragma omp simd
    for (int j = 0; j < len; ++j) {
        int32_t mag = (bits[j] >> 16) & 0x7fff;
        mag = mag < 0x3f80 ? mag : 0x3f80;
        const int32_t idx = lut[mag | ((bits[j] >> 17) & 0x4000)];
        out[j] = idx + (s[j] > mid[idx] ? 1 : 0);
    }
}

static void scale_clamp(float *x, float inv, int len) {
    #pragma omp simd
    for (int j = 0; j < len; ++j) {
        float t = x[j] * inv;  /* ternaries, not fminf: gcc 12 vectorizes these */
        t = t < -1.0f ? -1.0f : t;
        x[j] = t > 1.0f ? 1.0f : t;
    }
}

/* One Adam(W) step on n fp32 values with both moments in blockwise 8-bit (block 256).
   Math and order as bitsandbytes' 8-bit blockwise Adam: dequantize, update moments,
   decoupled weight decay, p -= lr/bc1 * m / (sqrt(v)/bc2 + eps), requantize with new absmax. */
void adam8bit_step(float *p, const float *g, uint8_t *q1, uint8_t *q2, float *absmax1,
                   float *absmax2, const float *code1, const float *code2, const float *mid1,
                   const float *mid2, const int32_t *lut1, const int32_t *lut2, int64_t n,
                   float beta1, float beta2, float eps, float lr, float weight_decay,
                   float bc1, float bc2_sqrt, int nthreads) {
    const int64_t nblocks = (n + 255) / 256;
    const float decay = weight_decay > 0.0f ? 1.0f - lr * weight_decay : 1.0f;  /* x*1 is exact */
    const float neg_step = -lr / bc1;
    const float one_m_b1 = 1.0f - beta1, one_m_b2 = 1.0f - beta2;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < nblocks; ++b) {
        const int64_t start = b * 256;
        const int len = (int)((n - start) < 256 ? (n - start) : 256);
        float m[256], v[256];
        const float am1 = absmax1[b], am2 = absmax2[b];
        float new1 = 0.0f, new2 = 0.0f;
        float *pb = p + start;
        const float *gb = g + start;
        uint8_t *c1 = q1 + start, *c2 = q2 + start;
        #pragma omp simd reduction(max:new1, new2)
        for (int j = 0; j < len; ++j) {
            const float gj = gb[j];
            const float mj = code1[c1[j]] * am1 * beta1 + gj * one_m_b1;
            const float vj = code2[c2[j]] * am2 * beta2 + gj * gj * one_m_b2;
            const float denom = sqrtf(vj) / bc2_sqrt + eps;
            pb[j] = pb[j] * decay + neg_step * (mj / denom);
            m[j] = mj;
            v[j] = vj;
            const float amj = mj < 0.0f ? -mj : mj;  /* ternaries: gcc 12 won't vectorize fmaxf */
            new1 = amj > new1 ? amj : new1;
            new2 = vj > new2 ? vj : new2;
        }
        scale_clamp(m, new1 > 0.0f ? 1.0f / new1 : 0.0f, len);
        scale_clamp(v, new2 > 0.0f ? 1.0f / new2 : 0.0f, len);
        int32_t k1[256], k2[256];
        nearest_codes(m, k1, lut1, mid1, len);
        nearest_codes(v, k2, lut2, mid2, len);
        #pragma omp simd
        for (int j = 0; j < len; ++j) {
            c1[j] = (uint8_t)k1[j];
            c2[j] = (uint8_t)k2[j];
        }
        absmax1[b] = new1;
        absmax2[b] = new2;
    }
}
"""

_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-fno-strict-aliasing"]


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
        src.write_text(_SOURCE)
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
    key = hashlib.sha256((_SOURCE + " ".join(_FLAGS) + os.uname().machine).encode()).hexdigest()[:16]
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
    fn = lib.adam8bit_step
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 12 + [ctypes.c_int64] + [ctypes.c_float] * 7 + [ctypes.c_int]
    return lib
