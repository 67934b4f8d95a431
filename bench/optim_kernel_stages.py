"""Where the 8-bit AdamW kernel's AVX2 path spends its time: ns/param per stage, one thread.

    python bench/optim_kernel_stages.py [--numel 16384 16777216] [--reps 200]

Compiles the kernel source (optim/_cpu_kernel.py) with a small C harness around its own AVX2
helpers and times, in thread CPU time (robust to a busy host), per parameter (two 8-bit values):
  decode    both moments' codes -> fp32 (decode8), stored to a buffer
  update    the update math on decoded moments (2 muls, 3 fmas, sqrt, div; p, m, v stores)
  sqrt+div  vsqrtps + vdivps alone: the divider's floor under the update
  encode    both moments requantized (quantize_run8, the absmax already known)
  whole     the kernel's range_avx2 (and range_scalar, the portable path; range_avx512 where
            the CPU has AVX-512 VBMI, nan elsewhere)
  whole-no-decode / whole-no-encode
            range_avx2's loop (mirrored here) with the moments loaded as fp32 instead of decoded,
            or without the requantization: the marginal cost of each stage in place ("update"
            is that loop with neither)
The first --numel is L2-resident (compute only), the second streams from DRAM. Best of 5.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path


from tierwise.optim import _cpu_kernel
from tierwise.optim.quant import decade_table, dynamic_map

HARNESS = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static float code1[256], code2[256], qt1[128], qt2[128];
static float *P, *G, *MF, *VF, *A1, *A2;
static uint8_t *Q1, *Q2;
static qtab_t T1, T2;
static ctx_t C;
volatile float sink;

TW_AVX2 static void st_decode(int64_t n) {
    for (int64_t i = 0; i < n; i += 8) {
        _mm256_store_ps(MF + i, decode8(code1, Q1 + i));
        _mm256_store_ps(VF + i, decode8(code2, Q2 + i));
    }
}
TW_AVX2 static void st_encode(int64_t n) {
    for (int64_t b = 0; b < n / 256; ++b) {
        quantize_run8(MF + b * 256, 0.5f, Q1 + b * 256, C.t1, 1, 256);
        quantize_run8(VF + b * 256, 0.5f, Q2 + b * 256, C.t2, 0, 256);
    }
}
TW_AVX2 static void st_sqrtdiv(int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8)
        acc = _mm256_add_ps(acc, _mm256_div_ps(_mm256_load_ps(MF + i), _mm256_sqrt_ps(_mm256_load_ps(VF + i))));
    sink += hmax8(acc);
}
#define FLOAD1(code, c) _mm256_load_ps(MF + ((c) - Q1))
#define FLOAD2(code, c) _mm256_load_ps(VF + ((c) - Q2))
/* range_avx2's loop with the decode and the requantization swappable */
#define LOOP(NAME, DEC1, DEC2, ENC) \
TW_AVX2 static void NAME(int64_t n) { \
    const ctx_t *c = &C; float m[256] __attribute__((aligned(32))), v[256] __attribute__((aligned(32))); \
    const __m256 omb1 = _mm256_set1_ps(c->omb1), omb2 = _mm256_set1_ps(c->omb2); \
    const __m256 eps = _mm256_set1_ps(c->eps), inv_bc2 = _mm256_set1_ps(c->inv_bc2); \
    const __m256 decay = _mm256_set1_ps(c->decay), step = _mm256_set1_ps(c->step_size); \
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)); \
    const float *code1 = c->code1, *code2 = c->code2; \
    for (int64_t b = 0; b < n / 256; ++b) { \
        float *pb = P + b * 256; const float *gb = G + b * 256; uint8_t *c1 = Q1 + b * 256, *c2 = Q2 + b * 256; \
        const __m256 a1 = _mm256_set1_ps(A1[b] * c->b1), a2 = _mm256_set1_ps(A2[b] * c->b2); \
        __m256 mx1 = _mm256_setzero_ps(), mx2 = _mm256_setzero_ps(); \
        for (int j = 0; j < 256; j += 8) { \
            const __m256 d1 = DEC1(code1, c1 + j), d2 = DEC2(code2, c2 + j); \
            const __m256 gj = _mm256_loadu_ps(gb + j); \
            const __m256 mj = _mm256_fmadd_ps(gj, omb1, _mm256_mul_ps(d1, a1)); \
            const __m256 vj = _mm256_fmadd_ps(_mm256_mul_ps(omb2, gj), gj, _mm256_mul_ps(d2, a2)); \
            const __m256 den = _mm256_fmadd_ps(_mm256_sqrt_ps(vj), inv_bc2, eps); \
            const __m256 pj = _mm256_mul_ps(_mm256_loadu_ps(pb + j), decay); \
            _mm256_storeu_ps(pb + j, _mm256_add_ps(pj, _mm256_div_ps(_mm256_mul_ps(step, mj), den))); \
            _mm256_store_ps(m + j, mj); _mm256_store_ps(v + j, vj); \
            mx1 = _mm256_max_ps(_mm256_and_ps(mj, absmask), mx1); mx2 = _mm256_max_ps(vj, mx2); \
        } \
        const float n1 = hmax8(mx1), n2 = hmax8(mx2); \
        if (ENC) { quantize_run8(m, inverse(n1), c1, c->t1, 1, 256); quantize_run8(v, inverse(n2), c2, c->t2, 0, 256); } \
        else sink += n1 + n2; \
    } }
LOOP(st_update, FLOAD1, FLOAD2, 0)
LOOP(st_nodecode, FLOAD1, FLOAD2, 1)
LOOP(st_noencode, decode8, decode8, 0)
static void st_whole(int64_t n) { range_avx2(&C, P, G, Q1, Q2, A1, A2, 0, n / 256); }
static void st_scalar(int64_t n) { range_scalar(&C, P, G, Q1, Q2, A1, A2, 0, n / 256); }
static void st_avx512(int64_t n) { range_avx512(&C, P, G, Q1, Q2, A1, A2, 0, n / 256); }

static void reset(int64_t n) {
    uint32_t s = 1;
    for (int64_t i = 0; i < n; ++i) {
        s = s * 1664525u + 1013904223u; P[i] = ((s >> 8) / 16777216.0f - 0.5f) * 0.04f;
        s = s * 1664525u + 1013904223u; G[i] = ((s >> 8) / 16777216.0f - 0.5f) * 1e-3f;
        s = s * 1664525u + 1013904223u; Q1[i] = s >> 24; Q2[i] = (s >> 16) & 255;
        MF[i] = code1[Q1[i]]; VF[i] = code2[Q2[i]];
    }
    for (int64_t b = 0; b < n / 256; ++b) { A1[b] = 1e-3f; A2[b] = 1e-6f; }
}
static void rd(const char *f, float *x, int k) { FILE *fp = fopen(f, "rb"); if (!fp || fread(x, 4, k, fp) != (size_t)k) exit(3); fclose(fp); }
int main(int argc, char **argv) {
    const int64_t n = atoll(argv[1]) / 256 * 256; const int reps = atoi(argv[2]);
    rd(argv[3], code1, 256); rd(argv[4], code2, 256); rd(argv[5], qt1, 128); rd(argv[6], qt2, 128);
    if (prep_qtab(qt1, &T1) || prep_qtab(qt2, &T2)) return 4;
    C = (ctx_t){code1, code2, qt1, qt2, &T1, &T2, 0.9f, 0.999f, 0.1f, 0.001f, 1e-8f, 1.2f, 0.99999f, -1e-3f};
    P = aligned_alloc(64, n * 4); G = aligned_alloc(64, n * 4); MF = aligned_alloc(64, n * 4); VF = aligned_alloc(64, n * 4);
    Q1 = aligned_alloc(64, n); Q2 = aligned_alloc(64, n); A1 = aligned_alloc(64, n + 64); A2 = aligned_alloc(64, n + 64);
    const char *names[] = {"decode", "update", "sqrt+div", "encode", "whole (avx2)", "whole-no-decode",
                           "whole-no-encode", "whole (scalar)", "whole (avx512)"};
    void (*fns[])(int64_t) = {st_decode, st_update, st_sqrtdiv, st_encode, st_whole, st_nodecode, st_noencode,
                              st_scalar, st_avx512};
    const int nf = sizeof fns / sizeof fns[0];
    double best[16];
    for (int k = 0; k < nf; ++k) best[k] = 1e30;
    reset(n);
    for (int r = 0; r < 5; ++r)
        for (int k = 0; k < nf; ++k) {
            if (k == nf - 1 && tw_best_isa() < 2) continue;
            const int rk = k == nf - 2 ? (reps + 9) / 10 : reps;  /* the scalar path is ~15x slower */
            reset(n);
            const double t0 = now();
            for (int i = 0; i < rk; ++i) fns[k](n);
            const double t = (now() - t0) / rk / n * 1e9;
            if (t < best[k]) best[k] = t;
        }
    for (int k = 0; k < nf; ++k)  /* the AVX-512 row only where the CPU runs that path */
        printf("%-20s %8.3f\n", names[k], k == nf - 1 && tw_best_isa() < 2 ? 0.0 / 0.0 : best[k]);
    return 0;
}
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, nargs="+", default=[16384, 16 * 2**20])
    ap.add_argument("--reps", type=int, default=200, help="repetitions at the first size (scaled down for larger)")
    args = ap.parse_args()
    cc = "gcc"
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "stages.c").write_text(_cpu_kernel.SOURCE_FILE.read_text() + HARNESS)
        tables = [dynamic_map(signed=True), dynamic_map(signed=False),
                  decade_table(signed=True).packed, decade_table(signed=False).packed]
        paths = []
        for i, t in enumerate(tables):
            paths.append(str(d / f"t{i}.bin"))
            t.numpy().astype("float32").tofile(paths[-1])
        flags = [f for f in _cpu_kernel._FLAGS if f not in ("-shared", "-fPIC")]
        subprocess.run([cc, *flags, str(d / "stages.c"), "-o", str(d / "stages"), "-lm"], check=True)
        cols = {}
        for n in args.numel:
            reps = max(2, args.reps * args.numel[0] // n)
            out = subprocess.run([str(d / "stages"), str(n), str(reps), *paths], check=True,
                                 capture_output=True, text=True).stdout
            cols[n] = [line.rsplit(None, 1) for line in out.splitlines()]
    print(f"ns/param (2 values), one thread, thread CPU time, best of 5; host's best path: "
          f"{_cpu_kernel.ISA_NAMES[_cpu_kernel.best_isa()]}")
    print(f"{'stage':20s}" + "".join(f"{f'n={n}':>14s}" for n in args.numel))
    for i, (name, _) in enumerate(cols[args.numel[0]]):
        print(f"{name:20s}" + "".join(f"{float(cols[n][i][1]):14.3f}" for n in args.numel))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
