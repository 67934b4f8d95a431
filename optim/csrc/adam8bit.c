#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TW_X86 1
#endif

/* One AdamW step on fp32 params with both moments in blockwise 8-bit (256 values + one fp32
   absmax per block); the torch reference path's math, with two roundings moved to save a
   multiply and a division per element (divisions are the slowest vector op):
     m = fma(g, 1-b1, code1[q1] * (absmax1 * b1))      v = fma((1-b2) * g, g, code2[q2] * (absmax2 * b2))
     p = p * decay + (step_size * m) / fma(sqrt(v), 1 / bc2_sqrt, eps)
   then each block is requantized to the nearest map entry of x / new_absmax by arithmetic
   (see optim/quant.py DecadeTable; packed tables qt: A[16] B[16] K[16] L[32] D[32] as floats). Built with -ffp-contract=off: the
   scalar and AVX2 paths round every operation identically, so results do not depend on the ISA.
   NONZERO_V: a positive v below half the map's smallest positive entry (times absmax) codes 1,
   not 0 (the zero-point problem of low-bit second moments: the next step would divide m by
   eps alone, a step of hundreds of lr where g is then 0); quant.py's quantize_blockwise
   (nonzero=True) and the CUDA path (optim/adamw8bit.py) do the same. */

/* The quantizer of the scalar and AVX2 paths: DecadeTable's arithmetic with its lookups
   regrouped so that AVX2 needs one byte shuffle and four 8-lane permutes per 8 values (no
   32-entry lookups). For y = |x|, bucket = a pair of binades (bits(y) >> 24, at least 52,
   i.e. 2^-23): no pair holds two group boundaries and none lies below 2^-23, so
   group = D[bucket] + (y > bnd[D[bucket]]) counts the boundaries below y, as DecadeTable's
   D[E] + (y > L[E]) does. Groups 0 (the zero code) and 8 (the code 1.0) share lane 0: with
   A = 256 there, r stays below zero+1 in group 0 and above K in group 8. NaN counts as above
   every boundary (as DecadeTable, code 255 before the signed mirror). Equal to DecadeTable
   for every |x| < 2, inf and NaN (checked on all 2^32 floats); the kernel only quantizes
   |x| <= 1 up to rounding. */
typedef struct {
    uint8_t dtab[32];  /* D per binade pair (index bucket & 15), once per 128-bit lane */
    float bnd[8], a[8], b[8], k[8];  /* group boundaries; A, B, K per group, lane 0 shared */
} qtab_t;

typedef struct {
    const float *code1, *code2;
    const float *qt1, *qt2;  /* packed DecadeTables (the AVX-512 path) */
    const qtab_t *t1, *t2;   /* the same, regrouped (scalar and AVX2 paths) */
    float b1, b2, omb1, omb2, eps, inv_bc2, decay, step_size;
} ctx_t;

/* qtab from a packed DecadeTable; -1 if the table is not of the form the regrouping needs */
static int prep_qtab(const float *qt, qtab_t *o) {
    const float *A = qt, *B = qt + 16, *K = qt + 32, *L = qt + 48, *D = qt + 80;
    memset(o, 0, sizeof *o);
    int nb = 0;
    for (int e = 96; e < 128; ++e) {
        if (L[e & 31] == 4.0f) continue;
        if (e < 104 || nb >= 8 || (int)D[e & 31] != nb) return -1;
        o->bnd[nb++] = L[e & 31];
    }
    if (nb != 8) return -1;
    for (int bucket = 52; bucket < 64; ++bucket) {
        const int e0 = 2 * bucket, e1 = e0 + 1;
        if (L[e0 & 31] != 4.0f && L[e1 & 31] != 4.0f) return -1;
        o->dtab[bucket & 15] = o->dtab[16 + (bucket & 15)] = (uint8_t)D[e0 & 31];
    }
    if (A[0] != 0.0f || A[8] != 0.0f) return -1;
    for (int g = 0; g < 8; ++g) {
        o->a[g] = A[g];
        o->b[g] = B[g];
        o->k[g] = K[g];
    }
    o->a[0] = 256.0f;
    o->k[0] = K[8];
    if (!(fmaf(o->bnd[0], 256.0f, -B[0]) < -B[0] + 0.5f) || !(fmaf(o->bnd[7], 256.0f, -B[0]) > K[8])) return -1;
    return 0;
}

/* 1 / a block's absmax: finite (an absmax below 2^-128 would make it inf, and inf * 0 = NaN,
   while the quantizer needs |x| <= 1 up to rounding), 0 for an all-zero block */
static inline float inverse(float n) {
    const float inv = n > 0.0f ? 1.0f / n : 0.0f;
    return inv < 3.4028234663852886e38f ? inv : 3.4028234663852886e38f;
}

/* a signed map's code for a negative value: the mirror of its magnitude's code */
static inline int mirror(int code) { return code > 254 ? 0 : 254 - code; }

/* nearest code of x (|x| <= 1 up to rounding), before the signed mirror when is_signed is 0;
   the AVX2 form is quantize8 + store32 */
static inline int quantize_one(float x, const qtab_t *t, int is_signed) {
    uint32_t bx;
    memcpy(&bx, &x, 4);
    const uint32_t by = bx & 0x7fffffffu;
    float y;
    memcpy(&y, &by, 4);
    uint32_t bucket = by >> 24;
    bucket = bucket < 52u ? 52u : bucket;
    const int d = t->dtab[bucket & 15];
    const int grp = (d + (!(y <= t->bnd[d & 7]) ? 1 : 0)) & 7;  /* NaN: above */
    float r = fmaf(y, t->a[grp], -t->b[grp]);
    r = r < t->k[grp] ? r : t->k[grp];  /* as min_ps: the second operand unless r < it */
    int code = (int)r;
    return is_signed && (bx >> 31) ? mirror(code) : code;
}

static void block_scalar(const ctx_t *c, float *p, const float *g, uint8_t *q1, uint8_t *q2,
                         float *absmax1, float *absmax2, int len) {
    float m[256], v[256];
    const float a1 = *absmax1 * c->b1, a2 = *absmax2 * c->b2;
    float n1 = 0.0f, n2 = 0.0f;
    for (int j = 0; j < len; ++j) {
        const float gj = g[j];
        const float mj = fmaf(gj, c->omb1, c->code1[q1[j]] * a1);
        const float vj = fmaf(c->omb2 * gj, gj, c->code2[q2[j]] * a2);
        const float den = fmaf(sqrtf(vj), c->inv_bc2, c->eps);
        p[j] = p[j] * c->decay + (c->step_size * mj) / den;
        m[j] = mj;
        v[j] = vj;
        const float amj = fabsf(mj);
        n1 = amj > n1 ? amj : n1;
        n2 = vj > n2 ? vj : n2;
    }
    const float inv1 = inverse(n1), inv2 = inverse(n2);
    for (int j = 0; j < len; ++j) {
        /* the mirror follows m's sign: m * inv's, but for inf * 0 (a negative NaN) */
        const int k1 = quantize_one(m[j] * inv1, c->t1, 0);
        q1[j] = (uint8_t)(signbit(m[j]) ? mirror(k1) : k1);
        const int k2 = quantize_one(v[j] * inv2, c->t2, 0);
        q2[j] = (uint8_t)(k2 == 0 && v[j] > 0.0f ? 1 : k2);  /* NONZERO_V: see the file's head */
    }
    *absmax1 = n1;
    *absmax2 = n2;
}

static void range_scalar(const ctx_t *c, float *p, const float *g, uint8_t *q1, uint8_t *q2,
                         float *absmax1, float *absmax2, int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
        block_scalar(c, p + b * 256, g + b * 256, q1 + b * 256, q2 + b * 256, absmax1 + b, absmax2 + b, 256);
}

#ifdef TW_X86
#define TW_AVX2 __attribute__((target("avx2,fma")))

/* The AVX2 path. Measured on Zen 4 (AVX2 only): gathers cost ~1-2 cycles per decoded value
   and the 32-entry permute lookups of the former quantizer ~16 cycles per 8 values; here the
   codes are decoded by scalar table loads inserted into vectors (integer ALUs and load ports,
   little used by the float math), and the quantizer is the regrouped one (quantize_one). An
   arithmetic decode (exact with a 2-bit ulp correction table) and software pipelining of
   block b's update with block b-1's requantization measured slower (Zen 3, and on Sapphire
   Rapids from DRAM). Software prefetch 2 blocks ahead: no gain on Zen 3, 1.2x faster from DRAM
   on Sapphire Rapids (bench/README.md); prefetches past the end are harmless (no faults). */
#define PREFETCH 2
typedef struct { __m256i dtab; __m256 bnd, a, b, k; } qreg_t;

TW_AVX2 static inline void load_qreg(qreg_t *r, const qtab_t *t) {
    r->dtab = _mm256_loadu_si256((const __m256i *)t->dtab);
    r->bnd = _mm256_loadu_ps(t->bnd);
    r->a = _mm256_loadu_ps(t->a);
    r->b = _mm256_loadu_ps(t->b);
    r->k = _mm256_loadu_ps(t->k);
}

/* code[c[0..7]] as one vector: scalar loads inserted into lanes; the codes come from two
   32-bit words by byte moves and one shift each (fewer integer ops than one shift per code) */
TW_AVX2 static inline __m256 decode8(const float *code, const uint8_t *c) {
    const int *t = (const int *)code;
    uint32_t a, b;
    memcpy(&a, c, 4);
    memcpy(&b, c + 4, 4);
    __m128i lo = _mm_cvtsi32_si128(t[a & 255]);
    lo = _mm_insert_epi32(lo, t[(a >> 8) & 255], 1);
    a >>= 16;
    lo = _mm_insert_epi32(lo, t[a & 255], 2);
    lo = _mm_insert_epi32(lo, t[a >> 8], 3);
    __m128i hi = _mm_cvtsi32_si128(t[b & 255]);
    hi = _mm_insert_epi32(hi, t[(b >> 8) & 255], 1);
    b >>= 16;
    hi = _mm_insert_epi32(hi, t[b & 255], 2);
    hi = _mm_insert_epi32(hi, t[b >> 8], 3);
    return _mm256_castsi256_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
}

/* quantize_one on 8 values, before the signed mirror (store32 does that) */
TW_AVX2 static inline __m256i quantize8(__m256 x, const qreg_t *t) {
    const __m256 y = _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
    __m256i bucket = _mm256_srli_epi32(_mm256_castps_si256(y), 24);
    bucket = _mm256_max_epi32(bucket, _mm256_set1_epi32(52));
    const __m256i d = _mm256_shuffle_epi8(t->dtab, bucket);  /* bucket <= 127: no zeroing */
    const __m256 above = _mm256_cmp_ps(y, _mm256_permutevar8x32_ps(t->bnd, d), _CMP_NLE_UQ);
    const __m256i grp = _mm256_sub_epi32(d, _mm256_castps_si256(above));  /* permutes use bits 0-2 */
    const __m256 r = _mm256_fmsub_ps(y, _mm256_permutevar8x32_ps(t->a, grp), _mm256_permutevar8x32_ps(t->b, grp));
    return _mm256_cvttps_epi32(_mm256_min_ps(r, _mm256_permutevar8x32_ps(t->k, grp)));
}

/* 32 codes (0..255) to bytes in order; a signed map mirrors those of negative x (sign bits
   packed alongside): max(254 - code, 0) */
TW_AVX2 static inline void store32(uint8_t *dst, const __m256i *c, const __m256 *x, int is_signed) {
    __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
    if (is_signed) {
        const __m256i s01 = _mm256_packs_epi32(_mm256_castps_si256(x[0]), _mm256_castps_si256(x[1]));
        const __m256i s23 = _mm256_packs_epi32(_mm256_castps_si256(x[2]), _mm256_castps_si256(x[3]));
        const __m256i mirrored = _mm256_subs_epu8(_mm256_set1_epi8((char)254), bytes);
        bytes = _mm256_blendv_epi8(bytes, mirrored, _mm256_packs_epi16(s01, s23));
    }
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    _mm256_storeu_si256((__m256i *)dst, _mm256_permutevar8x32_epi32(bytes, order));
}

/* codes of x[0..n) * scale for n a multiple of 32 (a signed map mirrors by the sign of x;
   nonzero: NONZERO_V) */
TW_AVX2 static void quantize_run8(const float *x, float scale, uint8_t *q, const qtab_t *t, int is_signed,
                                  int nonzero, int64_t n) {
    qreg_t r;
    load_qreg(&r, t);
    const __m256 s = _mm256_set1_ps(scale);
    for (int64_t i = 0; i < n; i += 32) {
        __m256 v[4];
        __m256i k[4];
        for (int u = 0; u < 4; ++u) {
            v[u] = _mm256_loadu_ps(x + i + 8 * u);
            k[u] = quantize8(_mm256_mul_ps(v[u], s), &r);
            if (nonzero)  /* a positive v codes at least 1 (all-ones >> 31 = 1) */
                k[u] = _mm256_max_epi32(k[u], _mm256_srli_epi32(
                    _mm256_castps_si256(_mm256_cmp_ps(v[u], _mm256_setzero_ps(), _CMP_GT_OQ)), 31));
        }
        store32(q + i, k, v, is_signed);
    }
}

TW_AVX2 static inline float hmax8(__m256 x) {
    __m128 y = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    y = _mm_max_ps(y, _mm_movehl_ps(y, y));
    y = _mm_max_ss(y, _mm_shuffle_ps(y, y, 1));
    return _mm_cvtss_f32(y);
}

TW_AVX2 static void range_avx2(const ctx_t *c, float *p, const float *g, uint8_t *q1, uint8_t *q2,
                               float *absmax1, float *absmax2, int64_t b0, int64_t b1) {
    float m[256] __attribute__((aligned(32))), v[256] __attribute__((aligned(32)));
    const __m256 omb1 = _mm256_set1_ps(c->omb1), omb2 = _mm256_set1_ps(c->omb2);
    const __m256 eps = _mm256_set1_ps(c->eps), inv_bc2 = _mm256_set1_ps(c->inv_bc2);
    const __m256 decay = _mm256_set1_ps(c->decay), step = _mm256_set1_ps(c->step_size);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const float *code1 = c->code1, *code2 = c->code2;  /* locals: not reloaded after each store */
    for (int64_t b = b0; b < b1; ++b) {
        float *pb = p + b * 256;
        const float *gb = g + b * 256;
        uint8_t *c1 = q1 + b * 256, *c2 = q2 + b * 256;
        const __m256 a1 = _mm256_set1_ps(absmax1[b] * c->b1), a2 = _mm256_set1_ps(absmax2[b] * c->b2);
        __m256 mx1 = _mm256_setzero_ps(), mx2 = _mm256_setzero_ps();
        for (int j = 0; j < 256; j += 8) {
            if ((j & 15) == 0) {  /* PREFETCH blocks ahead: one line of p and g per 16 values */
                _mm_prefetch((const char *)(pb + PREFETCH * 256 + j), _MM_HINT_T0);
                _mm_prefetch((const char *)(gb + PREFETCH * 256 + j), _MM_HINT_T0);
                if ((j & 63) == 0) {
                    _mm_prefetch((const char *)(c1 + PREFETCH * 256 + j), _MM_HINT_T0);
                    _mm_prefetch((const char *)(c2 + PREFETCH * 256 + j), _MM_HINT_T0);
                }
            }
            const __m256 d1 = decode8(code1, c1 + j), d2 = decode8(code2, c2 + j);
            const __m256 gj = _mm256_loadu_ps(gb + j);
            const __m256 mj = _mm256_fmadd_ps(gj, omb1, _mm256_mul_ps(d1, a1));
            const __m256 vj = _mm256_fmadd_ps(_mm256_mul_ps(omb2, gj), gj, _mm256_mul_ps(d2, a2));
            const __m256 den = _mm256_fmadd_ps(_mm256_sqrt_ps(vj), inv_bc2, eps);
            const __m256 pj = _mm256_mul_ps(_mm256_loadu_ps(pb + j), decay);
            _mm256_storeu_ps(pb + j, _mm256_add_ps(pj, _mm256_div_ps(_mm256_mul_ps(step, mj), den)));
            _mm256_store_ps(m + j, mj);
            _mm256_store_ps(v + j, vj);
            /* max_ps(a, b) = a > b ? a : b, as block_scalar's: a NaN moment never becomes the absmax */
            mx1 = _mm256_max_ps(_mm256_and_ps(mj, absmask), mx1);
            mx2 = _mm256_max_ps(vj, mx2);
        }
        const float n1 = hmax8(mx1), n2 = hmax8(mx2);
        quantize_run8(m, inverse(n1), c1, c->t1, 1, 0, 256);  /* one map at a time: fewer live registers */
        quantize_run8(v, inverse(n2), c2, c->t2, 0, 1, 256);
        absmax1[b] = n1;
        absmax2[b] = n2;
    }
}
#define TW_AVX512 __attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vbmi")))

/* 256-entry fp32 lookup for 64 byte indices without a gather: each byte of the fp32 result is a
   vpermt2b lookup in a 256-byte plane (two 128-entry halves chosen by bit 7), then the four
   planes are interleaved back into 4 x 16 floats. The indices are pre-permuted (PERM) so the
   lane-wise unpacks yield elements in order. planes: 4 planes x 4 zmm. */
/* Four byte planes of 64 looked-up floats (plane k: byte k of each) back into 64 floats, in the
   order the lanes' unpacks give (the callers' layout) */
TW_AVX512 static inline void planes_to_floats(const __m512i b[4], __m512 out[4]) {
    const __m512i a01 = _mm512_unpacklo_epi8(b[0], b[1]), b01 = _mm512_unpackhi_epi8(b[0], b[1]);
    const __m512i a23 = _mm512_unpacklo_epi8(b[2], b[3]), b23 = _mm512_unpackhi_epi8(b[2], b[3]);
    out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(a01, a23));
    out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(a01, a23));
    out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(b01, b23));
    out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(b01, b23));
}

TW_AVX512 static inline void lookup64(const __m512i *planes, __m512i q, __m512i perm, __m512 out[4]) {
    const __m512i qp = _mm512_permutexvar_epi8(perm, q);
    const __mmask64 hi = _mm512_movepi8_mask(qp);
    __m512i b[4];
    for (int k = 0; k < 4; ++k) {
        const __m512i lo_k = _mm512_permutex2var_epi8(planes[4 * k], qp, planes[4 * k + 1]);
        const __m512i hi_k = _mm512_permutex2var_epi8(planes[4 * k + 2], qp, planes[4 * k + 3]);
        b[k] = _mm512_mask_blend_epi8(hi, lo_k, hi_k);
    }
    planes_to_floats(b, out);
}

/* lookup64 for a map symmetric about code 127 (code[q] = -code[254 - q], code[127] = +0, as the
   signed dynamic map): one 128-entry lookup of the magnitude (codes 128..255) per byte plane
   instead of two and a blend; the sign is added to the top byte */
TW_AVX512 static inline void lookup64s(const __m512i *planes, __m512i q, __m512i perm, __m512 out[4]) {
    const __m512i qp = _mm512_permutexvar_epi8(perm, q);
    const __mmask64 nz = _mm512_cmpneq_epi8_mask(qp, _mm512_set1_epi8(127));
    const __mmask64 neg = _kandn_mask64(_mm512_movepi8_mask(qp), nz);  /* q < 127 */
    const __m512i idx = _mm512_mask_sub_epi8(qp, neg, _mm512_set1_epi8((char)254), qp);
    __m512i b[4];
    for (int k = 0; k < 4; ++k)
        b[k] = _mm512_maskz_permutex2var_epi8(nz, planes[4 * k + 2], idx, planes[4 * k + 3]);
    b[3] = _mm512_mask_add_epi8(b[3], neg, b[3], _mm512_set1_epi8((char)0x80));
    planes_to_floats(b, out);
}

/* The AVX-512 quantizer: DecadeTable's group D[E] + (y > L[E]) by one 16-entry lookup and an
   integer add. For x = bits(y) in a pair of binades P = x >> 24 (48..63: x >= 2^-31, smaller y
   share pair 48's group 0; no pair holds two group boundaries, see prep_qtab),
   T[P] = (D[P] << 24) + 2^24 - 1 - bits(L) (L the pair's boundary, else the pair's top): x and
   L differ by less than 2^24, so bits 24..27 of T[P] + x are D[P] plus the carry of x > L
   (positive floats order as their bits). NaN and inf (P = 127, read as pair 63, which holds no
   boundary) give group 8, as DecadeTable. Both indices come from byte 3 by a rotate: port 0,
   where a byte shuffle would take port 5 from the permutes (2-3% faster step). Equal to DecadeTable for every |x| < 2, inf and NaN (checked on
   all 2^32 floats against quantize_one). Replaces two 32-entry lookups and a compare. */
typedef struct { __m512 a, b, k; __m512i t; } qt16_t;

TW_AVX512 static inline void load_qt16(qt16_t *q, const float *qt) {
    q->a = _mm512_loadu_ps(qt);
    q->b = _mm512_loadu_ps(qt + 16);
    q->k = _mm512_loadu_ps(qt + 32);
    uint32_t t[16];
    for (int i = 0; i < 16; ++i) {
        const uint32_t pair = 48 + i, e0 = 2 * pair, d = (uint32_t)qt[80 + (e0 & 31)];
        uint32_t lim = (pair << 24) | 0xffffffu;  /* no boundary in this pair: never exceeded */
        for (uint32_t e = e0; e <= e0 + 1; ++e)
            if (qt[48 + (e & 31)] != 4.0f) memcpy(&lim, qt + 48 + (e & 31), 4);
        t[i] = (d << 24) + (1u << 24) - 1u - lim;
    }
    q->t = _mm512_loadu_si512((const void *)t);
}

/* byte 3 of each 32-bit lane into its low byte: a permute index (the permutes read bits 0-3) */
TW_AVX512 static inline __m512i byte3(__m512i v) {
    return _mm512_rol_epi32(v, 8);
}

/* codes of y = |x| (sign bit clear; before the signed mirror): 16, one per 32-bit lane */
TW_AVX512 static inline __m512i quantize16(__m512 y, const qt16_t *q) {
    const __m512i x = _mm512_castps_si512(_mm512_max_ps(_mm512_set1_ps(0x1p-31f), y));  /* NaN: y */
    const __m512i grp = byte3(_mm512_add_epi32(_mm512_permutexvar_epi32(byte3(x), q->t), x));
    const __m512 r = _mm512_fmsub_ps(y, _mm512_permutexvar_ps(grp, q->a), _mm512_permutexvar_ps(grp, q->b));
    return _mm512_cvttps_epi32(_mm512_min_ps(r, _mm512_permutexvar_ps(grp, q->k)));
}

/* 64 codes (0..255, lane i of c[u] is value 16u + i) to bytes in order: shifts and one
   ternary-logic merge put four codes in each 32-bit lane, one byte permute orders them (a
   vpermt2b takes two cycles of port 5 here); a signed map then mirrors the codes of negative
   x (mask neg): max(254 - code, 0), one saturating subtract per 64 */
TW_AVX512 static inline __m512i pack64(const __m512i *c, __m512i idx, int is_signed, __mmask64 neg) {
    const __m512i w = _mm512_ternarylogic_epi32(c[0], _mm512_slli_epi32(c[1], 8), _mm512_slli_epi32(c[2], 16), 0xfe);
    const __m512i bytes = _mm512_permutexvar_epi8(idx, _mm512_or_si512(w, _mm512_slli_epi32(c[3], 24)));
    return is_signed ? _mm512_mask_subs_epu8(bytes, neg, _mm512_set1_epi8((char)254), bytes) : bytes;
}

/* pack64's byte permute: value 16u + i sits in byte u of lane i */
TW_AVX512 static inline __m512i pack_index(void) {
    uint8_t b[64];
    for (int i = 0; i < 64; ++i) b[i] = (uint8_t)(4 * (i & 15) + (i >> 4));
    return _mm512_loadu_si512((const void *)b);
}

/* Block b's update runs in the same loop as block b-1's requantization (its absmax is known
   by then), 16 values of each in turn, so the divider (sqrt, div) and the quantizer's permutes
   overlap instead of taking turns; |m|, v and the signs of m (one bit per value, for the
   signed mirror on bytes) of the two blocks alternate between two buffers. */
TW_AVX512 static void range_avx512(const ctx_t *c, float *p, const float *g, uint8_t *q1, uint8_t *q2,
                                   float *absmax1, float *absmax2, int64_t b0, int64_t b1) {
    float m[2][256] __attribute__((aligned(64))), v[2][256] __attribute__((aligned(64)));
    uint8_t pl[2][4][256] __attribute__((aligned(64))), permb[64] __attribute__((aligned(64)));
    uint16_t sg[2][16] __attribute__((aligned(64)));
    for (int i = 0; i < 256; ++i) {
        uint32_t w1, w2;
        memcpy(&w1, c->code1 + i, 4);
        memcpy(&w2, c->code2 + i, 4);
        for (int k = 0; k < 4; ++k) {
            pl[0][k][i] = (uint8_t)(w1 >> (8 * k));
            pl[1][k][i] = (uint8_t)(w2 >> (8 * k));
        }
    }
    for (int lane = 0; lane < 4; ++lane)
        for (int s = 0; s < 4; ++s)
            for (int i = 0; i < 4; ++i) permb[lane * 16 + 4 * s + i] = (uint8_t)(16 * s + 4 * lane + i);
    __m512i planes1[16], planes2[16];
    for (int k = 0; k < 16; ++k) {
        planes1[k] = _mm512_load_si512((const void *)(&pl[0][0][0] + 64 * k));
        planes2[k] = _mm512_load_si512((const void *)(&pl[1][0][0] + 64 * k));
    }
    const __m512i perm = _mm512_load_si512((const void *)permb);
    int sym = c->code1[127] == 0.0f && !signbit(c->code1[127]);  /* map 1 symmetric: lookup64s */
    for (int i = 0; i < 127; ++i) sym &= c->code1[i] == -c->code1[254 - i];
    const __m512i pack = pack_index();
    const __m512 omb1 = _mm512_set1_ps(c->omb1), omb2 = _mm512_set1_ps(c->omb2);
    const __m512 eps = _mm512_set1_ps(c->eps), inv_bc2 = _mm512_set1_ps(c->inv_bc2);
    const __m512 decay = _mm512_set1_ps(c->decay), step = _mm512_set1_ps(c->step_size);
    qt16_t qt1, qt2;
    load_qt16(&qt1, c->qt1);
    load_qt16(&qt2, c->qt2);
    __m512 inv1 = _mm512_setzero_ps(), inv2 = _mm512_setzero_ps();  /* of block b-1 */
    for (int64_t b = b0; b <= b1; ++b) {  /* b1: only the requantization of b1-1 */
        const int cur = (int)(b & 1), prev = cur ^ 1, update = b < b1, requant = b > b0;
        float *pb = p + b * 256;
        const float *gb = g + b * 256;
        uint8_t *c1 = q1 + b * 256, *c2 = q2 + b * 256;
        __m512 a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps();
        if (update) {
            a1 = _mm512_set1_ps(absmax1[b] * c->b1);
            a2 = _mm512_set1_ps(absmax2[b] * c->b2);
        }
        __m512 mx1 = _mm512_setzero_ps(), mx2 = _mm512_setzero_ps();
        for (int j = 0; j < 256; j += 64) {
            __m512 d1[4], d2[4];
            if (update) {
                for (int u = 0; u < 4; ++u) {  /* PREFETCH blocks ahead (past the end: harmless) */
                    _mm_prefetch((const char *)(pb + PREFETCH * 256 + j + 16 * u), _MM_HINT_T0);
                    _mm_prefetch((const char *)(gb + PREFETCH * 256 + j + 16 * u), _MM_HINT_T0);
                }
                _mm_prefetch((const char *)(c1 + PREFETCH * 256 + j), _MM_HINT_T0);
                _mm_prefetch((const char *)(c2 + PREFETCH * 256 + j), _MM_HINT_T0);
                if (sym)
                    lookup64s(planes1, _mm512_loadu_si512((const void *)(c1 + j)), perm, d1);
                else
                    lookup64(planes1, _mm512_loadu_si512((const void *)(c1 + j)), perm, d1);
                lookup64(planes2, _mm512_loadu_si512((const void *)(c2 + j)), perm, d2);
            }
            __m512i k1[4], k2[4];
            for (int u = 0; u < 4; ++u) {
                if (update) {
                    const int o = j + 16 * u;
                    const __m512 gj = _mm512_loadu_ps(gb + o);
                    const __m512 mj = _mm512_fmadd_ps(gj, omb1, _mm512_mul_ps(d1[u], a1));
                    const __m512 vj = _mm512_fmadd_ps(_mm512_mul_ps(omb2, gj), gj, _mm512_mul_ps(d2[u], a2));
                    const __m512 den = _mm512_fmadd_ps(_mm512_sqrt_ps(vj), inv_bc2, eps);
                    const __m512 pj = _mm512_mul_ps(_mm512_loadu_ps(pb + o), decay);
                    _mm512_storeu_ps(pb + o, _mm512_add_ps(pj, _mm512_div_ps(_mm512_mul_ps(step, mj), den)));
                    const __m512 am = _mm512_abs_ps(mj);
                    _mm512_store_ps(m[cur] + o, am);
                    _mm512_store_ps(v[cur] + o, vj);
                    sg[cur][o / 16] = _mm512_movepi32_mask(_mm512_castps_si512(mj));
                    mx1 = _mm512_max_ps(am, mx1);  /* as block_scalar's (NaN) */
                    mx2 = _mm512_max_ps(vj, mx2);
                }
                /* |m| * inv = |m * inv| (inv >= 0; the mirror follows m's sign, as the other
                   paths'). v * inv is +0..1, +inf or a NaN of either sign:
                   no abs needed (a negative NaN reads as pair 63, group 8, as quantize_one's |x|;
                   checked on all such floats) */
                if (requant) {
                    k1[u] = quantize16(_mm512_mul_ps(_mm512_load_ps(m[prev] + j + 16 * u), inv1), &qt1);
                    const __m512 vv = _mm512_load_ps(v[prev] + j + 16 * u);
                    /* NONZERO_V: min(bits(v), 1) is 1 for a positive v, 0 for +0 (no compare:
                       the quantizer's permutes already load port 5) */
                    k2[u] = _mm512_max_epi32(quantize16(_mm512_mul_ps(vv, inv2), &qt2),
                                             _mm512_min_epu32(_mm512_castps_si512(vv), _mm512_set1_epi32(1)));
                }
            }
            if (requant) {
                const __mmask64 neg = _load_mask64((__mmask64 *)&sg[prev][j / 16]);
                _mm512_storeu_si512((void *)(c1 - 256 + j), pack64(k1, pack, 1, neg));
                _mm512_storeu_si512((void *)(c2 - 256 + j), pack64(k2, pack, 0, 0));
            }
        }
        if (update) {
            const float n1 = _mm512_reduce_max_ps(mx1), n2 = _mm512_reduce_max_ps(mx2);
            inv1 = _mm512_set1_ps(inverse(n1));
            inv2 = _mm512_set1_ps(inverse(n2));
            absmax1[b] = n1;
            absmax2[b] = n2;
        }
    }
}

/* tw_quantize's SIMD part: codes of the leading whole vectors; returns how many were done */
TW_AVX512 static int64_t quantize_avx512(const float *x, uint8_t *q, const float *qt, int is_signed, int64_t n) {
    qt16_t t;
    load_qt16(&t, qt);
    const __m512i pack = pack_index();
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m512i k[4];
        __mmask64 neg = 0;
        for (int u = 0; u < 4; ++u) {
            const __m512 xu = _mm512_loadu_ps(x + i + 16 * u);
            k[u] = quantize16(_mm512_abs_ps(xu), &t);
            neg |= (__mmask64)_mm512_movepi32_mask(_mm512_castps_si512(xu)) << (16 * u);
        }
        _mm512_storeu_si512((void *)(q + i), pack64(k, pack, is_signed, neg));
    }
    return i;
}

TW_AVX2 static int64_t quantize_avx2(const float *x, uint8_t *q, const qtab_t *t, int is_signed, int64_t n) {
    const int64_t whole = n / 32 * 32;
    quantize_run8(x, 1.0f, q, t, is_signed, 0, whole);
    return whole;
}
#endif

/* the best path this CPU can run: 2 AVX-512 (F, BW, DQ, VBMI), 1 AVX2 + FMA, 0 portable scalar */
int tw_best_isa(void) {
#ifdef TW_X86
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return 0;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vbmi")) return 2;
    return 1;
#else
    return 0;
#endif
}

/* qt1, qt2: the packed DecadeTables of map 1 (signed) and map 2 (unsigned);
   hyper: beta1, beta2, 1-beta1, 1-beta2, eps, 1/sqrt(1-beta2^t), 1-lr*wd, -lr/(1-beta1^t);
   isa: the most capable path to use (2 AVX-512, 1 AVX2, 0 scalar), lowered to what the CPU
   has. Returns the isa used, or -1 (nothing written) if a table is not a DecadeTable of the
   default maps' form. */
int tw_adam8bit_step(float *p, const float *g, uint8_t *q1, uint8_t *q2, float *absmax1,
                     float *absmax2, const float *code1, const float *code2, const float *qt1,
                     const float *qt2, const float *hyper, int64_t n, int nthreads, int isa) {
    qtab_t t1, t2;
    if (prep_qtab(qt1, &t1) || prep_qtab(qt2, &t2)) return -1;
    const ctx_t c = {code1, code2, qt1, qt2, &t1, &t2, hyper[0], hyper[1], hyper[2], hyper[3],
                     hyper[4], hyper[5], hyper[6], hyper[7]};
    const int best = tw_best_isa();
    if (isa > best) isa = best;
    if (isa < 0) isa = 0;
    const int64_t full = n / 256;
    const int tail = (int)(n - full * 256);
    if (nthreads < 1) nthreads = 1;
    if (full < nthreads) nthreads = full > 0 ? (int)full : 1;
    #pragma omp parallel num_threads(nthreads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t b0 = full * t / nt, b1 = full * (t + 1) / nt;
#ifdef TW_X86
        if (isa == 2)
            range_avx512(&c, p, g, q1, q2, absmax1, absmax2, b0, b1);
        else if (isa == 1)
            range_avx2(&c, p, g, q1, q2, absmax1, absmax2, b0, b1);
        else
#endif
            range_scalar(&c, p, g, q1, q2, absmax1, absmax2, b0, b1);
    }
    if (tail)
        block_scalar(&c, p + full * 256, g + full * 256, q1 + full * 256, q2 + full * 256,
                     absmax1 + full, absmax2 + full, tail);
    return isa;
}

/* codes of n already-scaled values (for tests): the path `isa` (lowered to what the CPU has)
   on whole vectors (64 values for AVX-512, 32 for AVX2), the scalar form on the rest.
   Returns the isa used, or -1 as tw_adam8bit_step. */
int tw_quantize(const float *x, uint8_t *q, const float *qt, int is_signed, int64_t n, int isa) {
    qtab_t t;
    if (prep_qtab(qt, &t)) return -1;
    const int best = tw_best_isa();
    if (isa > best) isa = best;
    if (isa < 0) isa = 0;
    int64_t i = 0;
#ifdef TW_X86
    if (isa == 2)
        i = quantize_avx512(x, q, qt, is_signed, n);
    else if (isa == 1)
        i = quantize_avx2(x, q, &t, is_signed, n);
#endif
    for (; i < n; ++i) q[i] = (uint8_t)quantize_one(x[i], &t, is_signed);
    return isa;
}
