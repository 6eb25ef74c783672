/* The solve's backend operations (kernels/backend.h) against naive fp64 references: transposes,
 * strides, alpha/beta, the upper triangles, Cholesky failures, ragged softmax rows; the rule
 * that picks the backend; the operations called concurrently from parallel_for items. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"
#include "kernels/base/convert.h"
#include "kernels/cpu/solve_ops.h"
#include "test_util.h"

static void fill_d(double *x, size_t n, uint64_t seed) {
    float *f = malloc(sizeof(float) * n);
    kf_test_fill_uniform(f, n, seed, -1.0f, 1.0f);
    for (size_t i = 0; i < n; i++)
        x[i] = f[i];
    free(f);
}

/* element (i, j) of op(X) for X row-major with stride ld */
static double at_f(const float *X, size_t ld, kf_trans t, int i, int j) {
    return t == KF_TRANS ? X[(size_t)j * ld + i] : X[(size_t)i * ld + j];
}
static double at_d(const double *X, size_t ld, kf_trans t, int i, int j) {
    return t == KF_TRANS ? X[(size_t)j * ld + i] : X[(size_t)i * ld + j];
}

/* sgemm and dgemm, every transpose pair, padded strides, alpha and beta; beta = 0 with NaN in C. */
static void test_gemm(void) {
    const kf_backend *be = kf_solve_backend(NULL);
    enum { M = 5, N = 4, K = 7, LD = 11 };
    float A[LD * LD], B[LD * LD], C[M * 6], C0[M * 6];
    double Ad[LD * LD], Bd[LD * LD], Cd[M * 6], Cd0[M * 6];
    kf_test_fill_uniform(A, LD * LD, 1, -1, 1);
    kf_test_fill_uniform(B, LD * LD, 2, -1, 1);
    kf_test_fill_uniform(C0, M * 6, 3, -1, 1);
    fill_d(Ad, LD * LD, 4), fill_d(Bd, LD * LD, 5), fill_d(Cd0, M * 6, 6);
    for (int c = 0; c < 4; c++) {
        const kf_trans ta = c & 1 ? KF_TRANS : KF_NO_TRANS, tb = c & 2 ? KF_TRANS : KF_NO_TRANS;
        for (int zero = 0; zero < 2; zero++) {
            const float beta = zero ? 0.0f : 0.3f;
            memcpy(C, C0, sizeof C), memcpy(Cd, Cd0, sizeof Cd);
            if (zero)
                for (int k = 0; k < M * 6; k++)
                    C[k] = Cd[k] = NAN;
            kf_solve_sgemm(be, ta, tb, M, N, K, 0.7f, A, 9, B, 10, beta, C, 6);
            kf_solve_dgemm(be, ta, tb, M, N, K, 0.7, Ad, 9, Bd, 10, zero ? 0.0 : 0.3, Cd, 6);
            double es = 0, ed = 0;
            for (int i = 0; i < M; i++)
                for (int j = 0; j < N; j++) {
                    double rs = zero ? 0 : 0.3 * C0[i * 6 + j], rd = zero ? 0 : 0.3 * Cd0[i * 6 + j];
                    for (int k = 0; k < K; k++) {
                        rs += 0.7 * at_f(A, 9, ta, i, k) * at_f(B, 10, tb, k, j);
                        rd += 0.7 * at_d(Ad, 9, ta, i, k) * at_d(Bd, 10, tb, k, j);
                    }
                    es = fmax(es, fabs(C[i * 6 + j] - rs)), ed = fmax(ed, fabs(Cd[i * 6 + j] - rd));
                }
            CU_ASSERT(es < 1e-5);
            CU_ASSERT(ed < 1e-13);
            for (int i = 0; i < M; i++) /* the padding column of C is left alone */
                CU_ASSERT(zero ? isnan(Cd[i * 6 + 5]) : Cd[i * 6 + 5] == Cd0[i * 6 + 5]);
        }
    }
}

/* dgemv both ways with a padded stride; dsymv reads only the upper triangle. */
static void test_gemv_symv(void) {
    const kf_backend *be = kf_solve_backend(NULL);
    enum { R = 6, C = 4, LD = 7 };
    double A[R * LD], x[R], y[R], y0[R];
    fill_d(A, R * LD, 7), fill_d(x, R, 8), fill_d(y0, R, 9);
    for (int t = 0; t < 2; t++) {
        const kf_trans ta = t ? KF_TRANS : KF_NO_TRANS;
        const int ny = t ? C : R, nx = t ? R : C;
        memcpy(y, y0, sizeof y);
        kf_solve_dgemv(be, ta, R, C, 1.5, A, LD, x, -0.5, y);
        double e = 0;
        for (int i = 0; i < ny; i++) {
            double r = -0.5 * y0[i];
            for (int k = 0; k < nx; k++)
                r += 1.5 * (t ? A[k * LD + i] : A[i * LD + k]) * x[k];
            e = fmax(e, fabs(y[i] - r));
        }
        CU_ASSERT(e < 1e-13);
    }
    enum { n = 5 };
    double S[n * 6], v[n], w[n];
    fill_d(S, n * 6, 10), fill_d(v, n, 11);
    for (int i = 0; i < n; i++)
        for (int j = 0; j < i; j++)
            S[i * 6 + j] = 1e300; /* the lower triangle must not be read */
    for (int i = 0; i < n; i++)
        w[i] = NAN; /* beta = 0: y not read */
    kf_solve_dsymv(be, n, 2.0, S, 6, v, 0.0, w);
    double e = 0;
    for (int i = 0; i < n; i++) {
        double r = 0;
        for (int k = 0; k < n; k++)
            r += 2.0 * (k >= i ? S[i * 6 + k] : S[k * 6 + i]) * v[k];
        e = fmax(e, fabs(w[i] - r));
    }
    CU_ASSERT(e < 1e-13);
}

enum { SY_N = 5, SY_K = 8, SY_LD = 9, SY_LC = 6 };

/* The largest error of Cm = 0.25 op(A) op(A)^T + 2 C0 (t: op = transpose) on the upper triangle
 * against fp64 sums; *lower_kept: every cell off it left as C0 had it. */
static double syrk_err(int t, const double *A, const double *C0, const double *Cm, int *lower_kept) {
    double e = 0;
    *lower_kept = 1;
    for (int i = 0; i < SY_N; i++)
        for (int j = 0; j < SY_LC; j++) {
            if (j < i || j >= SY_N) {
                *lower_kept &= Cm[i * SY_LC + j] == C0[i * SY_LC + j];
                continue;
            }
            double r = 2.0 * C0[i * SY_LC + j];
            for (int k = 0; k < SY_K; k++) /* TRANS: A [K, N]; NO_TRANS: A [N, K] */
                r += 0.25 * (t ? A[k * SY_LD + i] * A[k * SY_LD + j] : A[i * SY_LD + k] * A[j * SY_LD + k]);
            e = fmax(e, fabs(Cm[i * SY_LC + j] - r));
        }
    return e;
}

/* dsyrk: C = alpha op(A) + beta C on the upper triangle only, both ways, padded strides; ssyrk the
 * same in fp32 against the fp64 sums of the same (fp32) inputs. */
static void test_syrk(void) {
    const kf_backend *be = kf_solve_backend(NULL);
    double A[SY_K * SY_LD], Cm[SY_N * SY_LC], C0[SY_N * SY_LC];
    float Af[SY_K * SY_LD], Cf[SY_N * SY_LC], Cf0[SY_N * SY_LC];
    double Ar[SY_K * SY_LD], Cr0[SY_N * SY_LC], Cr[SY_N * SY_LC]; /* the fp32 ones, exactly in fp64 */
    fill_d(A, SY_K * SY_LD, 12), fill_d(C0, SY_N * SY_LC, 13);
    for (int k = 0; k < SY_K * SY_LD; k++)
        Ar[k] = Af[k] = (float)A[k];
    for (int k = 0; k < SY_N * SY_LC; k++)
        Cr0[k] = Cf0[k] = (float)C0[k];
    for (int t = 0; t < 2; t++) {
        const kf_trans ta = t ? KF_TRANS : KF_NO_TRANS;
        int lower_kept;
        memcpy(Cm, C0, sizeof Cm);
        kf_solve_dsyrk(be, ta, SY_N, SY_K, 0.25, A, SY_LD, 2.0, Cm, SY_LC);
        CU_ASSERT(syrk_err(t, A, C0, Cm, &lower_kept) < 1e-13);
        CU_ASSERT(lower_kept);
        memcpy(Cf, Cf0, sizeof Cf);
        kf_solve_ssyrk(be, ta, SY_N, SY_K, 0.25f, Af, SY_LD, 2.0f, Cf, SY_LC);
        for (int k = 0; k < SY_N * SY_LC; k++)
            Cr[k] = Cf[k];
        CU_ASSERT(syrk_err(t, Ar, Cr0, Cr, &lower_kept) < 1e-5);
        CU_ASSERT(lower_kept);
    }
}

/* |got - ref| / sum of |terms| of one entry (an entry never written stays NaN: infinitely wrong). */
static double sum_err(double got, double ref, double abs_sum) {
    const double e = fabs(got - ref) / fmax(abs_sum, 1e-30);
    return isnan(e) ? INFINITY : e;
}

/* B [t, d] (row stride d + 1) against X0^T Y0 [n, t], [n, d] in fp64; its padding column left at
 * -7. Returns the worst sum_err; *kept &= the padding. */
static double cross_err(const float *X0, const float *Y0, int n, int t, int d, const double *B, int *kept) {
    double worst = 0;
    for (int i = 0; i < t; i++) {
        for (int c = 0; c < d; c++) {
            double ref = 0, abs_sum = 0;
            for (int r = 0; r < n; r++) {
                const double p = (double)X0[(size_t)r * t + i] * Y0[(size_t)r * d + c];
                ref += 2 * p, abs_sum += 2 * fabs(p);
            }
            worst = fmax(worst, sum_err(B[(size_t)i * (d + 1) + c], ref, abs_sum));
        }
        *kept &= B[(size_t)i * (d + 1) + d] == -7.0;
    }
    return worst;
}

/* x [n] from seed with magnitudes over 2^-12 .. 2 (attention weights span such ranges). */
static void fill_spread(float *x, size_t n, uint64_t seed) {
    kf_test_fill_uniform(x, n, seed, -1, 1);
    for (size_t k = 0; k < n; k++)
        x[k] = ldexpf(x[k], -(int)(k * 2654435761u >> 28) % 13);
}

/* gram_bf16 on X [n, t] and Y [n, d] (d 0: B NULL) from seed, both paths (first, then
 * accumulating onto the first's G and B): every upper entry of G and every entry of B against fp64
 * sums of the bf16-rounded inputs, within 2e-6 of its sum of |terms| (the products are exact; each
 * tile's fp32 sum of n products rounds by a few ulps of it); the strict lower triangle and the
 * padding columns left alone, nothing written past kf_gram_bf16_work's scratch; X left holding the
 * rounded values, Y untouched. Returns the worst
 * ratio. */
static double gram_bf16_case(int n, int t, int d, uint64_t seed, int portable) {
    const size_t nt = (size_t)n * t, nd = (size_t)n * (d ? d : 1), ldg = (size_t)t + 1;
    float *X0 = malloc(sizeof(float) * nt), *X = malloc(sizeof(float) * nt);
    float *Y0 = malloc(sizeof(float) * nd), *Y = malloc(sizeof(float) * nd);
    enum { CANARY = 64 }; /* floats past the declared scratch, which gram_bf16 must not touch */
    const size_t nw = kf_gram_bf16_work(n, t, d);
    float *work = malloc(sizeof(float) * (nw + CANARY));
    for (int k = 0; k < CANARY; k++)
        work[nw + k] = -3.0f;
    double *G = malloc(sizeof(double) * t * ldg), *B = malloc(sizeof(double) * t * (d + 1));
    double *ref = calloc((size_t)t * t, sizeof(double)), *abs = calloc((size_t)t * t, sizeof(double));
    fill_spread(X0, nt, seed);
    fill_spread(Y0, nd, seed + 1);
    memcpy(Y, Y0, sizeof(float) * nd);
    for (int i = 0; i < t; i++) {
        for (size_t j = 0; j < ldg; j++)
            G[i * ldg + j] = (int)j < i || (int)j == t ? -7.0 : NAN; /* first: the upper NaNs are not read */
        for (int c = 0; c <= d; c++)
            B[(size_t)i * (d + 1) + c] = c == d ? -7.0 : NAN;
    }
    kf_cpu_gram_bf16_force_portable(portable);
    const kf_backend *be = kf_solve_backend(NULL);
    for (int pass = 0; pass < 2; pass++) {
        memcpy(X, X0, sizeof(float) * nt);
        kf_solve_gram_bf16(be, X, n, t, Y, d, work, G, ldg, d ? B : NULL, (size_t)d + 1, pass == 0);
    }
    kf_cpu_gram_bf16_force_portable(0);
    int rounded = 1, kept = 1;
    for (int k = 0; k < CANARY; k++)
        kept &= work[nw + k] == -3.0f;
    for (size_t k = 0; k < nt; k++) {
        rounded &= X[k] == kf_bf16_to_f32(kf_f32_to_bf16(X0[k]));
        X0[k] = X[k];
    }
    for (size_t k = 0; k < nd; k++) {
        kept &= Y[k] == Y0[k];
        Y0[k] = kf_bf16_to_f32(kf_f32_to_bf16(Y0[k]));
    }
    for (int r = 0; r < n; r++)
        for (int i = 0; i < t; i++)
            for (int j = i; j < t; j++) {
                const double p = (double)X0[(size_t)r * t + i] * X0[(size_t)r * t + j];
                ref[i * t + j] += 2 * p, abs[i * t + j] += 2 * fabs(p);
            }
    double worst = d ? cross_err(X0, Y0, n, t, d, B, &kept) : 0;
    for (int i = 0; i < t; i++)
        for (int j = 0; j <= t; j++) {
            if (j < i || j == t)
                kept &= G[i * ldg + j] == -7.0;
            else
                worst = fmax(worst, sum_err(G[i * ldg + j], ref[i * t + j], abs[i * t + j]));
        }
    CU_ASSERT(rounded);
    CU_ASSERT(kept);
    free(X0), free(X), free(Y0), free(Y), free(work), free(G), free(B), free(ref), free(abs);
    return worst;
}

/* gram_bf16: ragged row blocks and columns (of X and of Y), odd rows (a zero pair row), two column
 * panels, a whole tile of 512 rows, the Gram alone (d 0), fewer keys than Y's columns; the AVX-512
 * BF16 path (where the CPU has it) and the portable one. */
static void test_gram_bf16(void) {
    const int shapes[][3] = {{1, 1, 1},       {2, 5, 3},       {7, 33, 40}, {64, 12, 0},
                             {511, 300, 128}, {512, 140, 17}, {512, 100, 128}};
    printf("\n    gram_bf16 (%s path on this CPU), worst error of each entry's sum of |terms|:",
           kf_cpu_gram_bf16_fast() ? "AVX-512 BF16" : "portable");
    for (size_t c = 0; c < sizeof shapes / sizeof shapes[0]; c++)
        for (int portable = 0; portable < 2; portable++) {
            const int *sh = shapes[c];
            const double e = gram_bf16_case(sh[0], sh[1], sh[2], 900 + c, portable);
            printf(" %dx%dx%d%s %.1e", sh[0], sh[1], sh[2], portable ? "p" : "", e);
            CU_ASSERT(e < 2e-6);
        }
    printf("\n");
}

/* naive Gaussian elimination with partial pivoting: x = A^-1 b for one column (n <= 8) */
static void naive_solve(const double *A, int n, const double *b, double *x) {
    double M[8][9];
    for (int i = 0; i < n; i++) {
        for (int j = 0; j < n; j++)
            M[i][j] = A[i * n + j];
        M[i][n] = b[i];
    }
    for (int c = 0; c < n; c++) {
        int p = c;
        for (int r = c + 1; r < n; r++)
            p = fabs(M[r][c]) > fabs(M[p][c]) ? r : p;
        for (int j = 0; j <= n; j++) {
            const double tmp = M[c][j];
            M[c][j] = M[p][j], M[p][j] = tmp;
        }
        for (int r = c + 1; r < n; r++) {
            const double f = M[r][c] / M[c][c];
            for (int j = c; j <= n; j++)
                M[r][j] -= f * M[c][j];
        }
    }
    for (int i = n - 1; i >= 0; i--) {
        double s = M[i][n];
        for (int j = i + 1; j < n; j++)
            s -= M[i][j] * x[j];
        x[i] = s / M[i][i];
    }
}

/* an SPD matrix A = G^T G + n I [n, n], whole */
static void spd(double *A, int n, uint64_t seed) {
    double G[64];
    fill_d(G, (size_t)n * n, seed);
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) {
            double s = i == j ? n : 0;
            for (int k = 0; k < n; k++)
                s += G[k * n + i] * G[k * n + j];
            A[i * n + j] = s;
        }
}

/* spotrf + spotrs, fp32, one and several right-hand sides (padded ldb, the columns past nrhs left
 * alone), against elimination in fp64: within 1e-5 of the solution (A's condition is about 10);
 * an indefinite matrix refused. */
static void test_cholesky_f32(void) {
    const kf_backend *be = kf_solve_backend(NULL);
    enum { n = 7, NR = 3, LB = 5 };
    double A[n * n], Bd[n * LB], col[n], ref[n];
    float F[n * n], B[n * LB], x[n];
    spd(A, n, 24);
    fill_d(Bd, n * LB, 25);
    for (int k = 0; k < n * n; k++)
        F[k] = (float)A[k];
    for (int k = 0; k < n * LB; k++)
        B[k] = (float)Bd[k], Bd[k] = B[k]; /* the fp32 inputs, exactly */
    CU_ASSERT_EQUAL_FATAL(kf_solve_spotrf(be, F, n, n), 0);
    double e = 0;
    for (int i = 0; i < n; i++)
        x[i] = B[i * LB], col[i] = Bd[i * LB];
    CU_ASSERT_EQUAL(kf_solve_spotrs(be, F, n, n, x, 1, 1), 0);
    naive_solve(A, n, col, ref);
    for (int i = 0; i < n; i++)
        e = fmax(e, fabs(x[i] - ref[i]) / fmax(1, fabs(ref[i])));
    CU_ASSERT_EQUAL(kf_solve_spotrs(be, F, n, n, B, LB, NR), 0);
    for (int c = 0; c < NR; c++) {
        for (int i = 0; i < n; i++)
            col[i] = Bd[i * LB + c];
        naive_solve(A, n, col, ref);
        for (int i = 0; i < n; i++)
            e = fmax(e, fabs(B[i * LB + c] - ref[i]) / fmax(1, fabs(ref[i])));
    }
    printf(" (worst %.1e)", e);
    CU_ASSERT(e < 1e-5);
    for (int i = 0; i < n; i++) /* columns past nrhs untouched */
        CU_ASSERT(B[i * LB + 3] == (float)Bd[i * LB + 3] && B[i * LB + 4] == (float)Bd[i * LB + 4]);
    float I2[4] = {1, 2, 2, 1}; /* eigenvalues 3 and -1 */
    CU_ASSERT_NOT_EQUAL(kf_solve_spotrf(be, I2, 2, 2), 0);
}

/* dpotrf + dpotrs for one and for several right-hand sides (padded ldb), against elimination;
 * kf_solve_spd; failures reported for an indefinite matrix and for NaN. */
static void test_cholesky(void) {
    const kf_backend *be = kf_solve_backend(NULL);
    enum { n = 7, NR = 3, LB = 5 };
    double A[n * n], F[n * n], b[n], x[n], ref[n], B[n * LB], col[n];
    spd(A, n, 14);
    fill_d(b, n, 15), fill_d(B, n * LB, 16);
    memcpy(F, A, sizeof F);
    CU_ASSERT_EQUAL_FATAL(kf_solve_dpotrf(be, F, n, n), 0);
    memcpy(x, b, sizeof x);
    CU_ASSERT_EQUAL(kf_solve_dpotrs(be, F, n, n, x, 1, 1), 0);
    naive_solve(A, n, b, ref);
    double e = 0;
    for (int i = 0; i < n; i++)
        e = fmax(e, fabs(x[i] - ref[i]));
    CU_ASSERT(e < 1e-12);
    double Bx[n * LB];
    memcpy(Bx, B, sizeof Bx);
    CU_ASSERT_EQUAL(kf_solve_dpotrs(be, F, n, n, Bx, LB, NR), 0);
    e = 0;
    for (int c = 0; c < NR; c++) {
        for (int i = 0; i < n; i++)
            col[i] = B[i * LB + c];
        naive_solve(A, n, col, ref);
        for (int i = 0; i < n; i++)
            e = fmax(e, fabs(Bx[i * LB + c] - ref[i]));
    }
    CU_ASSERT(e < 1e-12);
    for (int i = 0; i < n; i++) /* columns past nrhs untouched */
        CU_ASSERT(Bx[i * LB + 3] == B[i * LB + 3] && Bx[i * LB + 4] == B[i * LB + 4]);
    /* kf_solve_spd: (S + lambda I) x = b with S = A - 2 I, lambda = 2 */
    double S[n * n];
    memcpy(S, A, sizeof S);
    for (int i = 0; i < n; i++)
        S[i * n + i] -= 2.0;
    CU_ASSERT_EQUAL(kf_solve_spd(be, S, n, 2.0, b, x, NULL), 0);
    naive_solve(A, n, b, ref);
    e = 0;
    for (int i = 0; i < n; i++)
        e = fmax(e, fabs(x[i] - ref[i]));
    CU_ASSERT(e < 1e-12);
    /* indefinite: eigenvalues 3 and -1 */
    double I2[4] = {1, 2, 2, 1};
    CU_ASSERT_NOT_EQUAL(kf_solve_dpotrf(be, I2, 2, 2), 0);
    double I2b[4] = {1, 2, 2, 1}, r2[2] = {1, 1}, x2[2];
    CU_ASSERT_EQUAL(kf_solve_spd(be, I2b, 2, 0.0, r2, x2, NULL), 1);
    CU_ASSERT_EQUAL(kf_solve_spd(be, I2b, 2, 1.5, r2, x2, NULL), 0); /* shifted: eigenvalues 4.5, 0.5 */
    CU_ASSERT(fabs(x2[0] - 1 / 4.5) < 1e-14 && fabs(x2[1] - 1 / 4.5) < 1e-14);
    /* singular PSD (rank 1) and NaN */
    double P[4] = {1, 1, 1, 1};
    CU_ASSERT_NOT_EQUAL(kf_solve_dpotrf(be, P, 2, 2), 0);
    memcpy(F, A, sizeof F);
    F[1 * n + 3] = F[3 * n + 1] = NAN;
    CU_ASSERT_NOT_EQUAL(kf_solve_dpotrf(be, F, n, n), 0);
}

/* lstsq: an overdetermined full-rank problem takes the QR path and matches the normal equations. */
static void test_lstsq(void) {
    const kf_backend *be = kf_solve_backend(NULL);
    enum { m = 12, n = 4, r = 2 };
    float A[m * n], B[m * r], X[n * r];
    kf_test_fill_uniform(A, m * n, 17, -1, 1);
    kf_test_fill_uniform(B, m * r, 18, -1, 1);
    CU_ASSERT_EQUAL(kf_solve_lstsq(be, A, m, n, B, r, X), KF_LSTSQ_QR);
    double G[n * n], g[n], x[n];
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) {
            G[i * n + j] = 0;
            for (int k = 0; k < m; k++)
                G[i * n + j] += (double)A[k * n + i] * A[k * n + j];
        }
    double e = 0;
    for (int c = 0; c < r; c++) {
        for (int i = 0; i < n; i++) {
            g[i] = 0;
            for (int k = 0; k < m; k++)
                g[i] += (double)A[k * n + i] * B[k * r + c];
        }
        naive_solve(G, n, g, x);
        for (int i = 0; i < n; i++)
            e = fmax(e, fabs(X[i * r + c] - x[i]));
    }
    CU_ASSERT(e < 1e-4);
}

/* softmax_rows: bias, ragged lengths, max/sum/lse, padded rows; exp_rows. */
static void test_rows(void) {
    const kf_backend *be = kf_solve_backend(NULL);
    enum { R = 3, N = 6, LD = 8 };
    float x[R * LD], x0[R * LD], bias[N], mx[R];
    double sum[R], lse[R];
    const int len[R] = {6, 3, 1};
    kf_test_fill_uniform(x0, R * LD, 19, -4, 4);
    kf_test_fill_uniform(bias, N, 20, -1, 1);
    x0[1 * LD + 1] = -INFINITY; /* gets weight 0 */
    memcpy(x, x0, sizeof x);
    kf_solve_softmax_rows(be, &(kf_softmax_rows_args){.x = x,
                                                      .ldx = LD,
                                                      .rows = R,
                                                      .n = N,
                                                      .bias = bias,
                                                      .len = len,
                                                      .max_out = mx,
                                                      .sum_out = sum,
                                                      .lse_out = lse});
    double e = 0;
    for (int i = 0; i < R; i++) {
        double z[N], m = -INFINITY, s = 0;
        for (int j = 0; j < len[i]; j++)
            m = fmax(m, z[j] = (double)x0[i * LD + j] + bias[j]);
        for (int j = 0; j < len[i]; j++)
            s += exp(z[j] - m);
        CU_ASSERT(fabs(mx[i] - m) < 1e-6);
        CU_ASSERT(fabs(sum[i] - s) < 1e-6 * s);
        CU_ASSERT(fabs(lse[i] - (m + log(s))) < 1e-6);
        for (int j = 0; j < len[i]; j++)
            e = fmax(e, fabs(x[i * LD + j] - exp(z[j] - m) / s));
        for (int j = len[i]; j < N; j++)
            CU_ASSERT(x[i * LD + j] == 0.0f);
        CU_ASSERT(x[i * LD + 6] == x0[i * LD + 6] && x[i * LD + 7] == x0[i * LD + 7]);
    }
    CU_ASSERT(e < 1e-6);
    CU_ASSERT(x[1 * LD + 1] == 0.0f);
    /* exp_rows */
    const float shift[R] = {0.5f, -1.0f, 3.0f};
    memcpy(x, x0, sizeof x);
    kf_solve_exp_rows(be, x, LD, R, N, shift);
    e = 0;
    for (int i = 0; i < R; i++) {
        for (int j = 0; j < N; j++) {
            const double ref = exp((double)x0[i * LD + j] - shift[i]);
            e = fmax(e, fabs(x[i * LD + j] - ref) / (ref > 1e-30 ? ref : 1));
        }
        CU_ASSERT(x[i * LD + 6] == x0[i * LD + 6]);
    }
    CU_ASSERT(e < 1e-6);
}

/* softmax_rows on full rows (no len) takes them eight at a time with the fp64 sums interleaved
 * (kernels/cpu/softmax.c): every row, outputs included, must be bit for bit what one row at a
 * time gives (the solve's results keep their bits), for the groups and the rows after them. */
static void test_rows_grouped(void) {
    const kf_backend *be = kf_solve_backend(NULL);
    enum { R = 19, N = 203, LD = 205 };
    float *x = malloc(sizeof(float) * R * LD), *y = malloc(sizeof(float) * R * LD), bias[N], mx[R], my[R];
    double sx[R], sy[R], lx[R], ly[R];
    kf_test_fill_uniform(x, R * LD, 31, -70, 6); /* weights over 2^-110 .. 1: an fp64 sum that rounds */
    kf_test_fill_uniform(bias, N, 32, -2, 2);
    for (int i = 0; i < R; i++)
        x[i * LD + (i * 7) % N] = -INFINITY; /* a no-weight slot in every row */
    memcpy(y, x, sizeof(float) * R * LD);
    kf_solve_softmax_rows(be, &(kf_softmax_rows_args){.x = x, .ldx = LD, .rows = R, .n = N, .bias = bias,
                                                      .max_out = mx, .sum_out = sx, .lse_out = lx});
    for (int i = 0; i < R; i++) /* one row per call: the single-row path */
        kf_solve_softmax_rows(be, &(kf_softmax_rows_args){.x = y + (size_t)i * LD, .ldx = LD, .rows = 1, .n = N,
                                                          .bias = bias, .max_out = my + i, .sum_out = sy + i,
                                                          .lse_out = ly + i});
    int same = 1;
    for (int i = 0; i < R; i++) {
        same &= mx[i] == my[i] && sx[i] == sy[i] && lx[i] == ly[i];
        same &= memcmp(x + (size_t)i * LD, y + (size_t)i * LD, sizeof(float) * LD) == 0;
    }
    CU_ASSERT(same); /* (test_rows checks the single-row path against fp64) */
    free(x), free(y);
}

/* The rule: the CPU backend runs its own; NULL and a backend without the ops get the CPU's. */
static void test_rule(void) {
    const kf_backend *cs = kf_backend_cpu_solve();
    CU_ASSERT_PTR_NOT_NULL_FATAL(cs);
    CU_ASSERT_PTR_EQUAL(kf_solve_backend(NULL), cs);
    kf_backend stub = {0}; /* the CUDA backend sets none of them */
    CU_ASSERT_PTR_EQUAL(kf_solve_backend(&stub), cs);
    CU_ASSERT(cs->matmul == NULL && cs->attention == NULL && cs->parallel_for == NULL);
    kf_backend *cpu = kf_backend_cpu_create_threads(1);
    CU_ASSERT_PTR_NOT_NULL_FATAL(cpu);
    CU_ASSERT_PTR_EQUAL(kf_solve_backend(cpu), cpu);
    CU_ASSERT(cpu->sgemm == cs->sgemm && cpu->dgemm == cs->dgemm && cpu->dgemv == cs->dgemv &&
              cpu->dsyrk == cs->dsyrk && cpu->ssyrk == cs->ssyrk && cpu->dsymv == cs->dsymv && cpu->dpotrf == cs->dpotrf &&
              cpu->dpotrs == cs->dpotrs && cpu->spotrf == cs->spotrf && cpu->spotrs == cs->spotrs && cs->spotrf && cpu->lstsq == cs->lstsq && cpu->softmax_rows == cs->softmax_rows &&
              cpu->exp_rows == cs->exp_rows && cpu->gram_bf16 == cs->gram_bf16 && cs->gram_bf16);
    cpu->destroy(cpu);
}

/* Reentrant: items of a 3-thread parallel_for calling the operations give the bytes of a
 * sequential run. Each item: a Gram of its own rows, its Cholesky solve, a softmax of a GEMM. */
enum { ITEMS = 8, IR = 40, ID = 16 };
typedef struct {
    const kf_backend *be;
    float q[ITEMS][IR * ID], z[ITEMS][IR * IR];
    double g[ITEMS][ID * ID], x[ITEMS][ID];
    int rc[ITEMS];
} reent;

static void reent_item(void *ctx, int i, int thread) {
    (void)thread;
    reent *r = ctx;
    double qd[IR * ID], rhs[ID];
    for (int k = 0; k < IR * ID; k++)
        qd[k] = r->q[i][k];
    for (int k = 0; k < ID; k++)
        rhs[k] = 1.0 + k;
    memset(r->g[i], 0, sizeof r->g[i]);
    kf_solve_dsyrk(r->be, KF_TRANS, ID, IR, 1.0, qd, ID, 0.0, r->g[i], ID);
    for (int a = 0; a < ID; a++)
        for (int c = 0; c < a; c++)
            r->g[i][a * ID + c] = r->g[i][c * ID + a];
    r->rc[i] = kf_solve_spd(r->be, r->g[i], ID, 1e-3, rhs, r->x[i], NULL);
    kf_solve_sgemm(r->be, KF_NO_TRANS, KF_TRANS, IR, IR, ID, 0.25f, r->q[i], ID, r->q[i], ID, 0.0f, r->z[i], IR);
    kf_solve_softmax_rows(r->be, &(kf_softmax_rows_args){.x = r->z[i], .ldx = IR, .rows = IR, .n = IR});
}

static void test_reentrant(void) {
    reent *seq = calloc(1, sizeof *seq), *par = calloc(1, sizeof *par);
    kf_backend *cpu = kf_backend_cpu_create_threads(3);
    CU_ASSERT_PTR_NOT_NULL_FATAL(seq && par && cpu);
    for (int i = 0; i < ITEMS; i++)
        kf_test_fill_uniform(seq->q[i], IR * ID, 30 + (uint64_t)i, -1, 1);
    memcpy(par->q, seq->q, sizeof seq->q);
    seq->be = NULL, par->be = cpu;
    for (int i = 0; i < ITEMS; i++)
        reent_item(seq, i, 0);
    kf_backend_parallel_for(cpu, ITEMS, reent_item, par);
    CU_ASSERT(memcmp(seq->x, par->x, sizeof seq->x) == 0);
    CU_ASSERT(memcmp(seq->z, par->z, sizeof seq->z) == 0);
    for (int i = 0; i < ITEMS; i++)
        CU_ASSERT(seq->rc[i] == 0 && par->rc[i] == 0);
    cpu->destroy(cpu);
    free(seq), free(par);
}

static CU_TestInfo tests[] = {
    {"sgemm, dgemm: transposes, strides, alpha, beta", test_gemm},
    {"dgemv both ways; dsymv reads the upper triangle", test_gemv_symv},
    {"dsyrk, ssyrk: upper triangle only, both ways", test_syrk},
    {"gram_bf16: bf16 inputs, fp32 tile sums into fp64, G's upper triangle and B", test_gram_bf16},
    {"Cholesky: solves, kf_solve_spd, not positive definite, NaN", test_cholesky},
    {"Cholesky in fp32: solves against fp64 elimination, indefinite refused", test_cholesky_f32},
    {"lstsq: QR path against the normal equations", test_lstsq},
    {"softmax_rows (bias, ragged, max/sum/lse) and exp_rows", test_rows},
    {"softmax_rows: eight rows at a time == one at a time, bit for bit", test_rows_grouped},
    {"kf_solve_backend: the CPU's unless the backend has the ops", test_rule},
    {"ops from parallel_for items == sequential", test_reentrant},
    CU_TEST_INFO_NULL,
};

static CU_SuiteInfo suites[] = {
    {"solve ops", NULL, NULL, NULL, NULL, tests},
    CU_SUITE_INFO_NULL,
};

int main(void) {
    return kf_test_main(suites);
}
