/* matmul.c — y (+)= x w^T on the CPU with the same bits for any thread count and any batch of rows.
 *
 * OpenBLAS's sgemm does not give a row one result:
 *  - the rows of a call past its last whole group of the kernel's row unroll go through edge
 *    kernels that round differently, and with several threads OpenBLAS cuts the rows among them
 *    where it likes (so the edges move with the thread count);
 *  - its AVX-512 kernels (SkylakeX and later) send small calls (KF_SMALL_*) to a "small matrix"
 *    kernel that rounds differently from the blocked one, so that a row's bits would depend on how
 *    many rows and columns shared its call.
 * Here OpenBLAS runs on one thread and every call it sees has a multiple of KF_ROW_GROUP rows: the
 * rows past the last whole group are copied into a zero-padded group of their own. The columns (the
 * weight's rows) are shared among the pool's threads in parts that begin at multiples of
 * KF_COL_GROUP, which moves no bit. A call that would be small gets zero rows enough for it not
 * to be (small jobs only: the padding costs nothing that matters). A row's result is then the same
 * for any thread count, in any chunk and at any place in it: a prefill continued from a shared
 * prefix gives the bytes of a whole one (tests/test_kernels.c checks it against row-by-row calls;
 * test_kernels_cli_blas runs it under the kernels the kvfold command picks).
 */
#include <cblas.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/pool.h"

/* A multiple of the row unroll of every OpenBLAS sgemm kernel (2, 4 or 8: OpenBLAS's
 * SGEMM_DEFAULT_UNROLL_N, the rows being its columns) */
#define KF_ROW_GROUP 8
/* Column parts begin at multiples of this (the kernels' column unrolls divide it) */
#define KF_COL_GROUP 16
/* OpenBLAS 0.3.21's small-matrix sgemm (AVX-512 kernels) takes this call's form (row-major x w^T,
 * its "TN") when the output has at most 1,200 cells, the multiply-adds are at most 100^3 and the
 * inner dimension is at least 32 */
#define KF_SMALL_CELLS 1200
#define KF_SMALL_MACS 1000000.0
#define KF_SMALL_MIN_K 32
/* Below this many multiply-adds the job runs on the calling thread */
#define MM_PAR_MIN ((size_t)1 << 21)

typedef struct {
    float *y;
    const float *x, *w;
    size_t ldy, ldx;
    int M, N, K, accumulate;
    int main_rows;  /* rows in whole groups, straight from x into y */
    int pad_rows;   /* the padded block: a multiple of KF_ROW_GROUP, taller where a call would be small */
    float *xt, *yt; /* the last M - main_rows rows, padded: [pad_rows, K], [pad_rows, N] */
    int parts;
} mm_job;

/* The columns [*n0, *n1) of the job's part i: its share of the groups of KF_COL_GROUP. */
static void part_cols(const mm_job *j, int i, int *n0, int *n1) {
    const int groups = (j->N + KF_COL_GROUP - 1) / KF_COL_GROUP;
    int g0, g1;
    kf_pool_range(groups, j->parts, i, &g0, &g1);
    *n0 = g0 * KF_COL_GROUP;
    *n1 = g1 * KF_COL_GROUP < j->N ? g1 * KF_COL_GROUP : j->N;
}

/* Columns [n0, n1) of every row: the whole groups in place, the padded tail in xt/yt. */
static void mm_item(void *ctx, int item, int thread) {
    (void)thread;
    const mm_job *j = ctx;
    int n0, n1;
    part_cols(j, item, &n0, &n1);
    if (n0 >= n1)
        return;
    const float beta = j->accumulate ? 1.0f : 0.0f, *w = j->w + (size_t)n0 * j->K;
    if (j->main_rows > 0)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, j->main_rows, n1 - n0, j->K, 1.0f, j->x, (int)j->ldx, w,
                    j->K, beta, j->y + n0, (int)j->ldy);
    if (j->main_rows < j->M)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, j->pad_rows, n1 - n0, j->K, 1.0f, j->xt, j->K, w, j->K,
                    beta, j->yt + n0, j->N);
}

/* The tail rows into their padded group (y's too when accumulating), or back out of it. */
static void tail_copy(const mm_job *j, int out) {
    const int t = j->M - j->main_rows;
    for (int r = 0; r < j->pad_rows && !out; r++) {
        float *xr = j->xt + (size_t)r * j->K, *yr = j->yt + (size_t)r * j->N;
        if (r < t)
            memcpy(xr, j->x + (size_t)(j->main_rows + r) * j->ldx, sizeof(float) * j->K);
        else
            memset(xr, 0, sizeof(float) * j->K);
        if (r < t && j->accumulate)
            memcpy(yr, j->y + (size_t)(j->main_rows + r) * j->ldy, sizeof(float) * j->N);
        else
            memset(yr, 0, sizeof(float) * j->N);
    }
    for (int r = 0; r < t && out; r++)
        memcpy(j->y + (size_t)(j->main_rows + r) * j->ldy, j->yt + (size_t)r * j->N, sizeof(float) * j->N);
}

/* The fewest columns any of the job's parts gets. */
static int narrowest_part(const mm_job *j) {
    int least = j->N;
    for (int i = 0; i < j->parts; i++) {
        int n0, n1;
        part_cols(j, i, &n0, &n1);
        if (n1 > n0 && n1 - n0 < least)
            least = n1 - n0;
    }
    return least;
}

/* The fewest rows a call of `cols` columns needs to stay off the small-matrix kernel (1: any). */
static int rows_off_small(int cols, int K) {
    if (K < KF_SMALL_MIN_K)
        return 1;
    const int by_cells = KF_SMALL_CELLS / cols + 1;
    const double by_macs = KF_SMALL_MACS / ((double)cols * K) + 1;
    return by_macs < by_cells ? (int)by_macs : by_cells;
}

/* Where the job's calls go: whole groups in place and the rest in a zero-padded block of
 * KF_ROW_GROUP rows, the block taller where that call would be small; when the whole groups' call
 * would be small too, every row goes in the block. */
static void plan_rows(mm_job *j) {
    const int need = rows_off_small(narrowest_part(j), j->K);
    j->main_rows = j->M / KF_ROW_GROUP * KF_ROW_GROUP;
    if (j->main_rows > 0 && j->main_rows < need)
        j->main_rows = 0;
    const int rows = j->M - j->main_rows, want = rows > need ? rows : need;
    j->pad_rows = (want + KF_ROW_GROUP - 1) / KF_ROW_GROUP * KF_ROW_GROUP;
}

int kf_cpu_matmul_pool(kf_cpu_mm_scratch *s, float *y, size_t ldy, const float *x, size_t ldx, const float *w, int M,
                       int N, int K, int accumulate) {
    if (M <= 0 || N <= 0)
        return 0;
    mm_job j = {.y = y, .x = x, .w = w, .ldy = ldy, .ldx = ldx, .M = M, .N = N, .K = K, .accumulate = accumulate};
    const int threads = kf_pool_threads(s->pool), groups = (N + KF_COL_GROUP - 1) / KF_COL_GROUP;
    const size_t work = (size_t)(M > KF_ROW_GROUP ? M : KF_ROW_GROUP) * N * K;
    j.parts = work < MM_PAR_MIN || threads < 2 ? 1 : (threads < groups ? threads : groups);
    plan_rows(&j);
    if (j.main_rows < M) {
        if (kf_cpu_grow((void **)&s->tail, &s->tail_cap, (size_t)j.pad_rows * ((size_t)K + N), sizeof(float)) != 0)
            return -1;
        j.xt = s->tail;
        j.yt = s->tail + (size_t)j.pad_rows * K;
        tail_copy(&j, 0);
    }
    const int blas_threads = openblas_get_num_threads();
    if (blas_threads > 1)
        openblas_set_num_threads(1);
    kf_pool_run(s->pool, j.parts, mm_item, &j);
    if (blas_threads > 1)
        openblas_set_num_threads(blas_threads);
    if (j.main_rows < M)
        tail_copy(&j, 1);
    return 0;
}

void kf_cpu_mm_scratch_free(kf_cpu_mm_scratch *s) {
    kf_pool *pool = s->pool;
    free(s->tail);
    memset(s, 0, sizeof *s);
    s->pool = pool; /* not owned */
}

int kf_cpu_matmul(float *y, size_t ldy, const float *x, size_t ldx, const float *w, int M, int N, int K,
                  int accumulate) {
    kf_cpu_mm_scratch s = {0};
    const int rc = kf_cpu_matmul_pool(&s, y, ldy, x, ldx, w, M, N, K, accumulate);
    kf_cpu_mm_scratch_free(&s);
    return rc;
}
