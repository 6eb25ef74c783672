/* gram_bf16.c — one tile's Gram matrix X^T X from X rounded to bf16, added into fp64 sums.
 *
 * The solve's normal equations are built from tiles of design rows (compactor/am.c): each tile's
 * X^T X in fp32, added into the fp64 G. Here X [n, t] is first rounded to bf16 (nearest even),
 * so that on a CPU with AVX-512 BF16 the products run through VDPBF16PS, twice the multiplies
 * of an fp32 FMA per instruction; a bf16 times a bf16 is exact in fp32, and the products are
 * summed in fp32 over the tile's rows, as before (docs/decisions/bf16-gram.md).
 *
 * X keeps its rounded values (as fp32), so that the caller's X^T Y multiplies the same design.
 * The fast path packs X into `work` by pairs of rows: word j of pair p holds bf16(X[2p][j]) in
 * its low half and bf16(X[2p+1][j]) in its high half (a zero row past an odd n), the layout
 * VDPBF16PS multiplies pairwise. A block of 12 rows i of G by 32 columns j then takes, per pair,
 * two loads of 16 words (the columns) and 12 broadcasts (the rows) into 24 accumulators: G's
 * row segments come out whole and go into G's upper triangle with masked fp64 stores.
 * Elsewhere the portable path takes ssyrk of the rounded X into `work`: the same rounded inputs,
 * summed in another order.
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

static void gram_portable(float *X, int n, int t, float *work, double *G, size_t ldg, int first) {
    round_bf16(X, (size_t)n * t);
    kf_cpu_ssyrk(NULL, KF_TRANS, t, n, 1.0f, X, (size_t)t, 0.0f, work, (size_t)t);
    upper_add(work, t, G, ldg, first);
}

#ifdef KF_HAVE_BF16_DOT
#define BLOCK_ROWS 12 /* rows i of a block: 24 accumulators, 2 loads and a broadcast in 32 registers */
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))

/* 16 values of a row rounded to bf16: written back widened, returned in the low halves of 32-bit
 * lanes. */
static inline BF16_TARGET __m512i round_16(float *x) {
    const __m512i h = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x)));
    _mm512_storeu_si512(x, _mm512_slli_epi32(h, 16));
    return h;
}

/* X [n, t] rounded in place and packed into P [(n + 1) / 2, t] pair words. */
static BF16_TARGET void pack_pairs(float *X, int n, int t, uint32_t *P) {
    for (int p = 0; p < (n + 1) / 2; p++) {
        float *r0 = X + (size_t)(2 * p) * t, *r1 = 2 * p + 1 < n ? r0 + t : NULL;
        uint32_t *out = P + (size_t)p * t;
        int j = 0;
        for (; r1 && j + 16 <= t; j += 16) {
            const __m512i lo = round_16(r0 + j), hi = round_16(r1 + j);
            _mm512_storeu_si512(out + j, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
        for (; j < t; j++) {
            const uint32_t lo = kf_f32_to_bf16(r0[j]), hi = r1 ? kf_f32_to_bf16(r1[j]) : 0;
            r0[j] = kf_bf16_to_f32((uint16_t)lo);
            if (r1)
                r1[j] = kf_bf16_to_f32((uint16_t)hi);
            out[j] = lo | hi << 16;
        }
    }
}

/* Rows [i0, i0 + nr) of G by columns [j0, j0 + 32) from np pairs P [np, t]: row segments added
 * into G where j >= i and j < t. Rows past nr repeat row i0 and are not stored. */
static inline __attribute__((always_inline)) BF16_TARGET void block(const uint32_t *P, int np, int t, int i0, int nr,
                                                                    int j0, double *G, size_t ldg, int first) {
    const __mmask16 m0 = j0 + 16 <= t ? 0xffff : (__mmask16)((1u << (t - j0)) - 1u);
    const __mmask16 m1 = j0 + 32 <= t ? 0xffff : j0 + 16 >= t ? 0 : (__mmask16)((1u << (t - j0 - 16)) - 1u);
    __m512 c[BLOCK_ROWS][2]; /* in registers: every loop over r is unrolled */
#pragma GCC unroll 12
    for (int r = 0; r < BLOCK_ROWS; r++)
        c[r][0] = c[r][1] = _mm512_setzero_ps();
    for (int p = 0; p < np; p++) {
        const uint32_t *pp = P + (size_t)p * t;
        const __m512bh a0 = (__m512bh)_mm512_maskz_loadu_epi32(m0, pp + j0);
        const __m512bh a1 = (__m512bh)_mm512_maskz_loadu_epi32(m1, pp + j0 + 16);
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
        double *g = G + (size_t)i * ldg + j0;
#pragma GCC unroll 4
        for (int q = 0; q < 4; q++) { /* 8 columns j0 + 8q .. each */
            const int jq = j0 + 8 * q, lo = i > jq ? i - jq : 0, hi = t - jq < 8 ? t - jq : 8;
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
static BF16_TARGET void gram_dot(float *X, int n, int t, uint32_t *P, double *G, size_t ldg, int first) {
    pack_pairs(X, n, t, P);
    const int np = (n + 1) / 2;
    for (int J0 = 0; J0 < t; J0 += PANEL) {
        const int J1 = t - J0 < PANEL ? t : J0 + PANEL;
        for (int i0 = 0; i0 < J1; i0 += BLOCK_ROWS) {
            const int nr = t - i0 < BLOCK_ROWS ? t - i0 : BLOCK_ROWS;
            const int jd = i0 / 32 * 32; /* the first 32-column block reaching the diagonal */
            for (int j0 = jd > J0 ? jd : J0; j0 < J1; j0 += 32) {
                if (nr == BLOCK_ROWS)
                    block(P, np, t, i0, BLOCK_ROWS, j0, G, ldg, first);
                else
                    block(P, np, t, i0, nr, j0, G, ldg, first);
            }
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

void kf_cpu_gram_bf16(const kf_backend *b, float *X, int n, int t, float *work, double *G, size_t ldg, int first) {
    (void)b;
    if (t <= 0)
        return;
    if (n <= 0) {
        if (first)
            for (int r = 0; r < t; r++)
                memset(G + (size_t)r * ldg + r, 0, sizeof(double) * (size_t)(t - r));
        return;
    }
#ifdef KF_HAVE_BF16_DOT
    if (kf_cpu_gram_bf16_fast()) {
        gram_dot(X, n, t, (uint32_t *)work, G, ldg, first);
        return;
    }
#endif
    gram_portable(X, n, t, work, G, ldg, first);
}
