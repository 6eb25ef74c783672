/* gram_bf16.c — one tile's normal equations X^T X and X^T Y from X and Y rounded to bf16, added
 * into fp64 sums.
 *
 * The solve's normal equations are built from tiles of design rows (compactor/am.c): each tile's
 * X^T X and X^T Y in fp32, added into the fp64 G and B. Here X [n, t] and Y [n, d] are first
 * rounded to bf16 (nearest even), so that on a CPU with AVX-512 BF16 the products run through
 * VDPBF16PS, twice the multiplies of an fp32 FMA per instruction; a bf16 times a bf16 is exact in
 * fp32, and the products are summed in fp32 over the tile's rows, as before
 * (docs/decisions/bf16-gram.md).
 *
 * X keeps its rounded values (as fp32); Y is read only. The fast path packs X into `work` by pairs
 * of rows: word j of pair p holds bf16(X[2p][j]) in its low half and bf16(X[2p+1][j]) in its high
 * half (a zero row past an odd n), the layout VDPBF16PS multiplies pairwise; Y's pairs follow.
 * A block of 12 rows i of the result by 32 columns j then takes, per pair, two loads of 16 words
 * (the columns: X's for G, Y's for B) and 12 broadcasts (X's rows i) into 24 accumulators: the
 * row segments come out whole and go into G's upper triangle, or B, with masked fp64 stores.
 * Elsewhere the portable path takes ssyrk and sgemm of the rounded X and Y: the same rounded
 * inputs, summed in another order.
 */
#include <string.h>

#include "kernels/base/convert.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/solve_ops.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define KF_HAVE_BF16_DOT 1
#endif

static int force_portable; /* tests: the portable path on any CPU */

void kf_cpu_gram_bf16_force_portable(int on) {
    force_portable = on;
}

/* G's upper triangle [t, t] (row stride ldg) += (or = when first) Gt's. */
static void upper_add(const float *Gt, int t, double *G, size_t ldg, int first) {
    for (int r = 0; r < t; r++) {
        double *g = G + (size_t)r * ldg;
        const float *gt = Gt + (size_t)r * t;
        for (int c = r; c < t; c++)
            g[c] = (first ? 0.0 : g[c]) + gt[c];
    }
}

/* x [n] rounded to bf16 in place (nearest even), as kf_f32_to_bf16 then back. */
KF_ROW_CLONES static void round_bf16(float *x, size_t n) {
    for (size_t i = 0; i < n; i++) { /* kf_f32_to_bf16 without its branch, so that it vectorizes */
        uint32_t bits;
        memcpy(&bits, x + i, sizeof bits);
        const uint32_t nan = (bits | 0x400000u) & 0xffff0000u,
                       even = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
        bits = (bits & 0x7fffffffu) > 0x7f800000u ? nan : even;
        memcpy(x + i, &bits, sizeof bits);
    }
}

/* X rounded in place; Y's rounded copy, and each product, in work (kf_gram_bf16_work). */
static void gram_portable(float *X, int n, int t, const float *Y, int d, float *work, double *G, size_t ldg, double *B,
                          size_t ldb, int first) {
    round_bf16(X, (size_t)n * t);
    kf_cpu_ssyrk(NULL, KF_TRANS, t, n, 1.0f, X, (size_t)t, 0.0f, work, (size_t)t);
    upper_add(work, t, G, ldg, first);
    if (!B)
        return;
    float *Yr = work + (size_t)t * (t > d ? t : d); /* [n, d] after the products' [t, max(t, d)] */
    memcpy(Yr, Y, sizeof(float) * (size_t)n * d);
    round_bf16(Yr, (size_t)n * d);
    kf_cpu_sgemm(NULL, KF_TRANS, KF_NO_TRANS, t, d, n, 1.0f, X, (size_t)t, Yr, (size_t)d, 0.0f, work, (size_t)d);
    for (int r = 0; r < t; r++)
        for (int c = 0; c < d; c++)
            B[(size_t)r * ldb + c] = (first ? 0.0 : B[(size_t)r * ldb + c]) + work[(size_t)r * d + c];
}

#ifdef KF_HAVE_BF16_DOT
#define BLOCK_ROWS 12 /* rows i of a block: 24 accumulators, 2 loads and a broadcast in 32 registers */
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))

/* 16 values of a row rounded to bf16, returned in the low halves of 32-bit lanes; written back
 * widened into out unless it is NULL. */
static inline BF16_TARGET __m512i round_16(const float *x, float *out) {
    const __m512i h = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x)));
    if (out)
        _mm512_storeu_si512(out, _mm512_slli_epi32(h, 16));
    return h;
}

/* X [n, t] rounded and packed into P [(n + 1) / 2, t] pair words; the rounded values also written
 * into Xr [n, t] (X itself, or NULL: nowhere). */
static BF16_TARGET void pack_pairs(const float *X, int n, int t, uint32_t *P, float *Xr) {
    for (int p = 0; p < (n + 1) / 2; p++) {
        const size_t at = (size_t)(2 * p) * t;
        const float *r0 = X + at, *r1 = 2 * p + 1 < n ? r0 + t : NULL;
        float *w0 = Xr ? Xr + at : NULL, *w1 = Xr && r1 ? w0 + t : NULL;
        uint32_t *out = P + (size_t)p * t;
        int j = 0;
        for (; r1 && j + 16 <= t; j += 16) {
            const __m512i lo = round_16(r0 + j, w0 ? w0 + j : NULL), hi = round_16(r1 + j, w1 ? w1 + j : NULL);
            _mm512_storeu_si512(out + j, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
        for (; j < t; j++) {
            const uint32_t lo = kf_f32_to_bf16(r0[j]), hi = r1 ? kf_f32_to_bf16(r1[j]) : 0;
            if (w0)
                w0[j] = kf_bf16_to_f32((uint16_t)lo);
            if (w1)
                w1[j] = kf_bf16_to_f32((uint16_t)hi);
            out[j] = lo | hi << 16;
        }
    }
}

/* Rows [i0, i0 + nr) by columns [j0, j0 + 32) of A^T C from np pairs: A's P [np, lda] (its
 * columns are the result's rows) and C's Q [np, ldc] (nc columns). Row segments are added into
 * the fp64 result R (row stride ldr) where j < nc and, when upper, j >= i. Rows past nr repeat
 * row i0 and are not stored. */
static inline __attribute__((always_inline)) BF16_TARGET void block(const uint32_t *P, int lda, const uint32_t *Q,
                                                                    int ldc, int nc, int np, int i0, int nr, int j0,
                                                                    double *R, size_t ldr, int first, int upper) {
    const __mmask16 m0 = j0 + 16 <= nc ? 0xffff : (__mmask16)((1u << (nc - j0)) - 1u);
    const __mmask16 m1 = j0 + 32 <= nc ? 0xffff : j0 + 16 >= nc ? 0 : (__mmask16)((1u << (nc - j0 - 16)) - 1u);
    __m512 c[BLOCK_ROWS][2]; /* in registers: every loop over r is unrolled */
#pragma GCC unroll 12
    for (int r = 0; r < BLOCK_ROWS; r++)
        c[r][0] = c[r][1] = _mm512_setzero_ps();
    for (int p = 0; p < np; p++) {
        const uint32_t *pp = P + (size_t)p * lda, *qq = Q + (size_t)p * ldc;
        const __m512bh a0 = (__m512bh)_mm512_maskz_loadu_epi32(m0, qq + j0);
        const __m512bh a1 = (__m512bh)_mm512_maskz_loadu_epi32(m1, qq + j0 + 16);
#pragma GCC unroll 12
        for (int r = 0; r < BLOCK_ROWS; r++) {
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int)pp[i0 + (r < nr ? r : 0)]);
            c[r][0] = _mm512_dpbf16_ps(c[r][0], a0, b);
            c[r][1] = _mm512_dpbf16_ps(c[r][1], a1, b);
        }
    }
#pragma GCC unroll 12
    for (int r = 0; r < nr; r++) {
        const int i = i0 + r;
        double *g = R + (size_t)i * ldr + j0;
#pragma GCC unroll 4
        for (int q = 0; q < 4; q++) { /* 8 columns j0 + 8q .. each */
            const int jq = j0 + 8 * q, lo = upper && i > jq ? i - jq : 0, hi = nc - jq < 8 ? nc - jq : 8;
            if (hi <= lo)
                continue;
            const __mmask8 m = (__mmask8)(((1u << hi) - 1u) & ~((1u << lo) - 1u));
            const __m512d half = _mm512_castps_pd(c[r][q >> 1]);
            const __m256 h = _mm256_castpd_ps(q & 1 ? _mm512_extractf64x4_pd(half, 1) : _mm512_castpd512_pd256(half));
            __m512d v = _mm512_cvtps_pd(h);
            if (!first)
                v = _mm512_add_pd(v, _mm512_maskz_loadu_pd(m, g + 8 * q));
            _mm512_mask_storeu_pd(g + 8 * q, m, v);
        }
    }
}

/* Columns in panels of PANEL (a panel's pair words, np x PANEL x 4 bytes, stay in the core's L2 while
 * every row block above the diagonal runs over them); within a panel a row block's broadcasts (12
 * words of each pair) serve each 32-column block in turn from L1. */
#define PANEL 256
static BF16_TARGET void gram_dot(const uint32_t *P, int np, int t, double *G, size_t ldg, int first) {
    for (int J0 = 0; J0 < t; J0 += PANEL) {
        const int J1 = t - J0 < PANEL ? t : J0 + PANEL;
        for (int i0 = 0; i0 < J1; i0 += BLOCK_ROWS) {
            const int nr = t - i0 < BLOCK_ROWS ? t - i0 : BLOCK_ROWS;
            const int jd = i0 / 32 * 32; /* the first 32-column block reaching the diagonal */
            for (int j0 = jd > J0 ? jd : J0; j0 < J1; j0 += 32) {
                if (nr == BLOCK_ROWS)
                    block(P, t, P, t, t, np, i0, BLOCK_ROWS, j0, G, ldg, first, 1);
                else
                    block(P, t, P, t, t, np, i0, nr, j0, G, ldg, first, 1);
            }
        }
    }
}

/* B [t, d] += X^T Y from X's pairs P [np, t] and Y's Q [np, d] (np x d words, 128 KiB at d = 128:
 * they stay in the core's L2 while every row block's broadcasts run over them). */
static BF16_TARGET void cross_dot(const uint32_t *P, const uint32_t *Q, int np, int t, int d, double *B, size_t ldb,
                                  int first) {
    for (int i0 = 0; i0 < t; i0 += BLOCK_ROWS) {
        const int nr = t - i0 < BLOCK_ROWS ? t - i0 : BLOCK_ROWS;
        for (int j0 = 0; j0 < d; j0 += 32) {
            if (nr == BLOCK_ROWS)
                block(P, t, Q, d, d, np, i0, BLOCK_ROWS, j0, B, ldb, first, 0);
            else
                block(P, t, Q, d, d, np, i0, nr, j0, B, ldb, first, 0);
        }
    }
}

static int have_bf16_dot(void) {
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
}
#endif

int kf_cpu_gram_bf16_fast(void) {
#ifdef KF_HAVE_BF16_DOT
    return !force_portable && have_bf16_dot();
#else
    return 0;
#endif
}

void kf_cpu_gram_bf16(const kf_backend *b, float *X, int n, int t, const float *Y, int d, float *work, double *G,
                      size_t ldg, double *B, size_t ldb, int first) {
    (void)b;
    if (t <= 0)
        return;
    if (n <= 0) {
        for (int r = 0; first && r < t; r++) {
            memset(G + (size_t)r * ldg + r, 0, sizeof(double) * (size_t)(t - r));
            if (B)
                memset(B + (size_t)r * ldb, 0, sizeof(double) * (size_t)d);
        }
        return;
    }
#ifdef KF_HAVE_BF16_DOT
    if (kf_cpu_gram_bf16_fast()) {
        const int np = (n + 1) / 2;
        uint32_t *P = (uint32_t *)work, *Q = P + (size_t)np * t; /* [np, t] X's pairs, [np, d] Y's */
        pack_pairs(X, n, t, P, X);
        gram_dot(P, np, t, G, ldg, first);
        if (B) {
            pack_pairs(Y, n, d, Q, NULL);
            cross_dot(P, Q, np, t, d, B, ldb, first);
        }
        return;
    }
#endif
    gram_portable(X, n, t, Y, d, work, G, ldg, B, ldb, first);
}
