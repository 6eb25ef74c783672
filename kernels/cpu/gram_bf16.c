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
 * half (a zero row past an odd n), the layout VDPBF16PS multiplies pairwise. The words are stored
 * in the order the blocks read them: X's by strips of 32 columns and again by groups of 12, Y's by
 * strips. A block of 12 rows i of the result by 32 columns j then takes, per pair, two loads of 16
 * words (a strip's: X's for G, Y's for B) and 12 broadcasts (X's group) into 24 accumulators: the
 * row segments come out whole and go into G's upper triangle, or B, with masked fp64 stores. Each
 * output is the same fp32 sum over the pairs in order, whatever the layout.
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
/* 12 rows i of a block: 24 accumulators, 2 loads and a broadcast in 32 registers */
#define BLOCK_ROWS KF_GRAM_BF16_GROUP
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))

/* 16 values of a row rounded to bf16, returned in the low halves of 32-bit lanes; written back
 * widened into out unless it is NULL. */
static inline BF16_TARGET __m512i round_16(const float *x, float *out) {
    const __m512i h = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x)));
    if (out)
        _mm512_storeu_si512(out, _mm512_slli_epi32(h, 16));
    return h;
}

/* The pair words of a block's operands, laid out so that each block reads them in order: X's
 * pairs by strips of STRIP columns (strip s: [np, STRIP] words, the result's columns j) and again
 * by groups of BLOCK_ROWS columns (group b: [np, BLOCK_ROWS], the result's rows i), Y's by strips;
 * zero words pad the last strip and group (their products are never stored). Contiguous operands
 * stream from L2 with no split loads, where rows of t words (t * 4 bytes apart) made each pair's
 * loads miss L1. */
#define STRIP KF_GRAM_BF16_STRIP /* 32 columns j of a block: two vectors of 16 */
static int round_up(int n, int m) {
    return (n + m - 1) / m * m;
}
static size_t strip_words(int np, int n) {
    return (size_t)np * (size_t)round_up(n, STRIP);
}
static size_t group_words(int np, int n) {
    return (size_t)np * (size_t)round_up(n, BLOCK_ROWS);
}

/* Pair p's words (bf16 of row 2p in the low halves, of row 2p + 1, or zero past an odd n, in the
 * high halves) into row [n]; the rounded values also written into Xr's two rows (NULL: nowhere). */
static BF16_TARGET void pair_row(const float *X, int n, int t, int p, uint32_t *row, float *Xr) {
    const size_t at = (size_t)(2 * p) * t;
    const float *r0 = X + at, *r1 = 2 * p + 1 < n ? r0 + t : NULL;
    float *w0 = Xr ? Xr + at : NULL, *w1 = Xr && r1 ? w0 + t : NULL;
    int j = 0;
    for (; r1 && j + 16 <= t; j += 16) {
        const __m512i lo = round_16(r0 + j, w0 ? w0 + j : NULL), hi = round_16(r1 + j, w1 ? w1 + j : NULL);
        _mm512_storeu_si512(row + j, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
    for (; j < t; j++) {
        const uint32_t lo = kf_f32_to_bf16(r0[j]), hi = r1 ? kf_f32_to_bf16(r1[j]) : 0;
        if (w0)
            w0[j] = kf_bf16_to_f32((uint16_t)lo);
        if (w1)
            w1[j] = kf_bf16_to_f32((uint16_t)hi);
        row[j] = lo | hi << 16;
    }
}

/* X [n, t] rounded to pairs into strips S (strip_words) and, unless G is NULL, groups G
 * (group_words); row [t padded] is scratch. The rounded values also go into Xr (X, or NULL). */
static BF16_TARGET void pack_pairs(const float *X, int n, int t, uint32_t *S, uint32_t *G, uint32_t *row, float *Xr) {
    const int np = (n + 1) / 2, ts = round_up(t, STRIP), tg = round_up(t, BLOCK_ROWS);
    const int padded = G && tg > ts ? tg : ts; /* the row's words that are read: no groups without G */
    memset(row + t, 0, sizeof(uint32_t) * (size_t)(padded - t));
    for (int p = 0; p < np; p++) {
        pair_row(X, n, t, p, row, Xr);
        for (int j = 0; j < ts; j += STRIP)
            memcpy(S + ((size_t)(j / STRIP) * np + p) * STRIP, row + j, sizeof(uint32_t) * STRIP);
        for (int j = 0; G && j < tg; j += BLOCK_ROWS)
            memcpy(G + ((size_t)(j / BLOCK_ROWS) * np + p) * BLOCK_ROWS, row + j, sizeof(uint32_t) * BLOCK_ROWS);
    }
}

/* Rows [i0, i0 + nr) by columns [j0, j0 + STRIP) of A^T C over np pairs: A's group rg [np,
 * BLOCK_ROWS] (its columns are the result's rows) and C's strip cs [np, STRIP] (nc columns in
 * all). Row segments are added into the fp64 result R (row stride ldr) where j < nc and, when
 * upper, j >= i; rows past nr (zero padding) are not stored. */
static inline __attribute__((always_inline)) BF16_TARGET void block(const uint32_t *rg, const uint32_t *cs, int nc,
                                                                    int np, int i0, int nr, int j0, double *R,
                                                                    size_t ldr, int first, int upper) {
    __m512 c[BLOCK_ROWS][2]; /* in registers: every loop over r is unrolled */
#pragma GCC unroll 12
    for (int r = 0; r < BLOCK_ROWS; r++)
        c[r][0] = c[r][1] = _mm512_setzero_ps();
    for (int p = 0; p < np; p++) {
        const uint32_t *pp = rg + (size_t)p * BLOCK_ROWS, *qq = cs + (size_t)p * STRIP;
        const __m512bh a0 = (__m512bh)_mm512_loadu_si512(qq), a1 = (__m512bh)_mm512_loadu_si512(qq + 16);
#pragma GCC unroll 12
        for (int r = 0; r < BLOCK_ROWS; r++) {
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int)pp[r]);
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

/* Row group i0's blocks against strips [s0, s1) of C (strips cs, nc columns), into R. */
static inline __attribute__((always_inline)) BF16_TARGET void group_row(const uint32_t *Gx, const uint32_t *cs, int nc,
                                                                        int np, int i0, int nr, int s0, int s1,
                                                                        double *R, size_t ldr, int first, int upper) {
    const uint32_t *rg = Gx + (size_t)(i0 / BLOCK_ROWS) * np * BLOCK_ROWS;
    for (int s = s0; s < s1; s++) {
        const uint32_t *st = cs + (size_t)s * np * STRIP;
        if (nr == BLOCK_ROWS)
            block(rg, st, nc, np, i0, BLOCK_ROWS, s * STRIP, R, ldr, first, upper);
        else
            block(rg, st, nc, np, i0, nr, s * STRIP, R, ldr, first, upper);
    }
}

/* Strips in panels of PANEL columns (a panel's strips, np x PANEL x 4 bytes, stay in the core's L2
 * while every row group above the diagonal runs over them); a row group's words (np x 12 x 4
 * bytes) stay in L1 while it serves each strip of the panel in turn. */
#define PANEL 256
static BF16_TARGET void gram_dot(const uint32_t *S, const uint32_t *Gx, int np, int t, double *G, size_t ldg,
                                 int first) {
    for (int J0 = 0; J0 < t; J0 += PANEL) {
        const int J1 = t - J0 < PANEL ? t : J0 + PANEL;
        for (int i0 = 0; i0 < J1; i0 += BLOCK_ROWS) {
            const int nr = t - i0 < BLOCK_ROWS ? t - i0 : BLOCK_ROWS,
                      jd = i0 / STRIP * STRIP; /* reaches the diagonal */
            const int s0 = (jd > J0 ? jd : J0) / STRIP, s1 = round_up(J1, STRIP) / STRIP;
            group_row(Gx, S, t, np, i0, nr, s0, s1, G, ldg, first, 1);
        }
    }
}

/* B [t, d] += X^T Y from X's groups Gx and Y's strips Sy (np x d words, 128 KiB at d = 128: they
 * stay in the core's L2 while every row group runs over them). */
static BF16_TARGET void cross_dot(const uint32_t *Gx, const uint32_t *Sy, int np, int t, int d, double *B, size_t ldb,
                                  int first) {
    for (int i0 = 0; i0 < t; i0 += BLOCK_ROWS) {
        const int nr = t - i0 < BLOCK_ROWS ? t - i0 : BLOCK_ROWS;
        group_row(Gx, Sy, d, np, i0, nr, 0, round_up(d, STRIP) / STRIP, B, ldb, first, 0);
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
        uint32_t *S = (uint32_t *)work, *Gx = S + strip_words(np, t);           /* X's strips, groups */
        uint32_t *Sy = Gx + group_words(np, t), *row = Sy + strip_words(np, d); /* Y's strips, a pair row */
        pack_pairs(X, n, t, S, Gx, row, X);
        gram_dot(S, Gx, np, t, G, ldg, first);
        if (B) {
            pack_pairs(Y, n, d, Sy, NULL, row, NULL);
            cross_dot(Gx, Sy, np, t, d, B, ldb, first);
        }
        return;
    }
#endif
    gram_portable(X, n, t, Y, d, work, G, ldg, B, ldb, first);
}
