/* Causal GQA attention over the paged KV pool (CPU reference, fp32; a bf16 pool is widened to fp32
 * as its key blocks are gathered), blocked over keys.
 *
 * An item is one KV head g and one tile of tq queries: the rep = n_heads / kv_heads query heads
 * that read g are stacked into one matrix Qp [tq * rep, head_dim] (row i * rep + j: query i,
 * head j of the group), so the keys of g are read once for all of them. The keys visible to the
 * tile go by blocks of KEY_BLOCK, each gathered from its pages into a contiguous per-thread
 * buffer, and the softmax is online (the running max m and sum l of each row):
 *   S = scale * Qp Kb^T                        [rows, kb]     (sgemm)
 *   S += bias; causal mask; m' = max(m, max S); P = exp(S - m'); l = l e^(m - m') + sum P
 *   O = O e^(m - m') + P Vb                    [rows, head_dim] (sgemm, beta 1)
 * and at the end out = O / l. The score block, the gathered keys and values and O stay in the
 * core's cache (about 1.3 MB per thread at tq * rep = 512, head_dim 128), where the former
 * whole-row scores [128, n_keys] and whole-context gathers streamed through memory; the next
 * block's keys and values are prefetched (towards L2) while a block's rows are worked on. Rows
 * whose query sees no key of a block skip it, and the tile's diagonal keys (from its first
 * query's position rounded down to a multiple of KEY_BLOCK on; a query sees only some of them) go
 * by smaller blocks of DIAG_BLOCK, so a causal chunk costs about half of a square one.
 *
 * A row's result has the same bits whatever tile, chunk or thread count it comes in: tiles never
 * cross a multiple of KEY_BLOCK in position, so a row's blocks are fixed by its position alone;
 * a diagonal block is always DIAG_BLOCK keys wide (zero keys past the tile's last), and every
 * sgemm runs on whole groups of ROW_PAD rows (zero padding queries), on one OpenBLAS thread,
 * whose edge kernels would otherwise round a call's last rows differently (matmul.c); every
 * Qp Kb^T is at least QK_COLS keys wide (zero keys past the block's last), since OpenBLAS's AVX-512
 * kernels send a call of this form with at most 1,200 cells to a small-matrix kernel that rounds
 * differently (its P Vb form rounds alike on either path). So a prefill continued from a shared
 * prefix, or run with another thread count, gives the same bytes.
 * A row's step is two sweeps over its scores (bias and max; then exp, store and sum), the exp being
 * kf_expf_nonpos (its argument s - m' is never positive). The sum l is kept in fp64, a block's own
 * sum (at most KEY_BLOCK terms, each at most 1) in fp32. The file is built with
 * -ffp-contract=fast (CMakeLists.txt): the AVX-512 clone of the row loops fuses multiply-adds, so
 * the bits differ between machines by rounding. Against a whole-row softmax the result moves by
 * float rounding only (tests/test_kernels.c holds it to 1e-5 of an fp64 reference).
 *
 * AM's targets (kf_attn_targets, backend.h): the tile's queries first take the whole document block
 * [blk0, blk1) (all of it visible: it lies before the chunk) as one softmax, as kf_am_targets_compute
 * does: the block's logits of every row are kept [rows, n_blk] (at most BLOCK_FLOATS floats, which
 * bounds the tile's rows), a row softmax gives m, y (in fp64 over fp32 sums of KEY_BLOCK keys)
 * and the probabilities p (the target rows' p, or p^2, summed into the item's fp64 part [n_blk] in
 * the sweep that divides by y), Y = p V_blk by
 * sgemm; then O = y Y, l = y and the
 * other keys ([0, blk0), then [blk1, ...)) go on online as above. The parts are added to the
 * caller's score after the job, per KV head in tile order; with targets the tiles' size depends on
 * the arguments only, so the score has the same bits for any thread count. Keeping the logits beats
 * a second QK^T pass for the score (a second sgemm of the same size as the first).
 * With the rows' own prompts asked for too (app0 > 0: the validation's appended blocks, which the
 * solve would otherwise attend again), the tile's own keys [app0, ...) go first, online from a
 * fresh state; that state is emitted for the rows with a slot and kept aside while the block
 * takes the state, then merged into it (max, rescaled sums) before [0, blk0) and [blk1, app0).
 *
 * With a pool in the scratch, the items are spread over its threads, each with its own buffers;
 * OpenBLAS is held to one thread meanwhile (the sgemms of the items run side by side, and on one
 * thread their bits never depend on the thread count; the previous count is restored after).
 */
#include <cblas.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/fast_exp.h"
#include "kernels/cpu/pool.h"

#ifndef TILE_ROWS
#define TILE_ROWS 512 /* query rows (queries x heads of a group) per item, at most */
#endif
#ifndef KEY_BLOCK
#define KEY_BLOCK 256 /* keys per block: a multiple of KF_PAGE_TOKENS */
#endif
#ifndef DIAG_BLOCK
#define DIAG_BLOCK 64 /* keys per block where the tile's queries see some of the keys only */
#endif
#ifndef BLOCK_FLOATS
#define BLOCK_FLOATS ((size_t)1 << 21) /* a tile's kept block logits (targets), at most (8 MB) */
#endif
#define ROW_PAD 8 /* sgemm rows go in whole groups of this many (matmul.c's KF_ROW_GROUP) */
/* Qp Kb^T's fewest keys: ROW_PAD x QK_COLS cells is above OpenBLAS 0.3.21's small-matrix bound for
 * this form (1,200 cells, AVX-512 kernels) */
#define QK_COLS (KEY_BLOCK < 160 ? KEY_BLOCK : 160)

/* Grows a scratch buffer to hold n elements of elem bytes; 0, or -1 when out of memory (the
 * buffer is then unchanged). Shared by the kernels that keep scratch between calls. */
int kf_cpu_grow(void **buf, size_t *cap, size_t n, size_t elem) {
    if (n <= *cap)
        return 0;
    void *nb = realloc(*buf, n * elem);
    if (!nb)
        return -1;
    *buf = nb;
    *cap = n;
    return 0;
}

void kf_cpu_attn_scratch_free(kf_cpu_attn_scratch *s) {
    free(s->work_raw);
    free(s->part);
    free(s->has);
    free(s->tiles);
    kf_pool *pool = s->pool;
    memset(s, 0, sizeof *s);
    s->pool = pool; /* not owned */
}

typedef struct {
    const kf_attn_args *a;
    float *work;         /* [threads, per_thread], 64-byte aligned */
    size_t per_thread;   /* floats */
    int rep, tq, n_tiles;
    const int *tile_q0;  /* [n_tiles + 1] the tiles' first queries, then n_q */
    int n_blk;           /* targets: blk1 - blk0, else 0 */
    int ld_blk;          /* targets: n_blk rounded up to a multiple of 16 (the logits' row stride) */
    double *part;        /* targets: [items, n_blk] */
    uint8_t *has;        /* targets: [items] */
} attn_job;

/* One thread's buffers inside the job's work area, each 64-byte aligned (a row's vector sums
 * then see the same alignment in every tile). The matrices have ROW_PAD more rows than the tile:
 * the sgemms run on whole row groups (ROW_PAD rows), the padding rows' queries zero. */
typedef struct {
    float *qp, *o;  /* [rows + ROW_PAD, hd] stacked queries, output accumulator */
    float *s;       /* [rows + ROW_PAD, KEY_BLOCK] scores, then weights */
    float *kb, *vb; /* [KEY_BLOCK, hd] one block of the group's keys and values */
    float *m;       /* [rows] running max */
    double *l;      /* [rows] running sum */
    float *sb;      /* [rows + ROW_PAD, ld_blk] the block's logits, then probabilities (targets only) */
    float *ko, *km; /* [rows, hd], [rows] the own keys' state kept aside (own prompts asked for only) */
    double *kl;     /* [rows] */
} attn_bufs;

static size_t al16(size_t n) { /* floats, rounded up to 64 bytes */
    return (n + 15) & ~(size_t)15;
}

static size_t bufs_floats(int rows, int hd, int ld_blk, int own) {
    const size_t rp = (size_t)rows + ROW_PAD;
    return al16(2 * (size_t)rows) + 2 * al16(rp * hd) + al16(rp * KEY_BLOCK) + 2 * al16((size_t)KEY_BLOCK * hd) +
           al16((size_t)rows) + al16(rp * ld_blk) + (own ? al16((size_t)rows * hd) + 3 * al16((size_t)rows) : 0);
}

size_t kf_cpu_attn_tile_floats(int rows, int hd, int ld_blk, int own) {
    return al16(bufs_floats(rows, hd, ld_blk, own));
}

static attn_bufs bufs_at(float *w, int rows, int hd, int ld_blk, int own) {
    const size_t rp = (size_t)rows + ROW_PAD;
    attn_bufs b;
    b.l = (double *)w;
    b.qp = w + al16(2 * (size_t)rows);
    b.o = b.qp + al16(rp * hd);
    b.s = b.o + al16(rp * hd);
    b.kb = b.s + al16(rp * KEY_BLOCK);
    b.vb = b.kb + al16((size_t)KEY_BLOCK * hd);
    b.m = b.vb + al16((size_t)KEY_BLOCK * hd);
    b.sb = b.m + al16((size_t)rows);
    b.ko = own ? b.sb + al16(rp * ld_blk) : NULL;
    b.km = own ? b.ko + al16((size_t)rows * hd) : NULL;
    b.kl = own ? (double *)(b.km + al16((size_t)rows)) : NULL;
    return b;
}

/* Rows of an sgemm: n rounded up to a whole number of row groups. */
static int row_groups(int n) {
    return (n + ROW_PAD - 1) / ROW_PAD * ROW_PAD;
}

/* gather_block over a bf16 pool: each row widened as it is gathered (kf_bf16_to_f32, inline: a row
 * is short, a call per row shows), so the sgemms below read fp32 only. */
static void gather_block_bf16(const kf_attn_args *a, int g, int k0, int kb, float *kdst, float *vdst) {
    const int hd = a->kv.head_dim;
    const size_t row = (size_t)a->kv.kv_heads * hd;
    for (int t = k0; t < k0 + kb; t++) {
        const size_t src = (size_t)a->pages[t / KF_PAGE_TOKENS] * a->kv.page_stride +
                           (size_t)(t % KF_PAGE_TOKENS) * row + (size_t)g * hd;
        for (int pass = 0; pass < 2; pass++) {
            float *dst = pass ? vdst : kdst;
            if (!dst)
                continue;
            const uint16_t *h = (const uint16_t *)(pass ? a->kv.v : a->kv.k) + src;
            dst += (size_t)(t - k0) * hd;
            for (int e = 0; e < hd; e++) {
                const uint32_t u = (uint32_t)h[e] << 16;
                memcpy(dst + e, &u, sizeof u);
            }
        }
    }
}

/* Keys [k0, k0 + kb) of KV head g from their pages into kb/vb [kb, hd] (either may be NULL). The
 * fp32 pool's loop is the one it always was (a bf16 pool goes apart). */
static void gather_block(const kf_attn_args *a, int g, int k0, int kb, float *kdst, float *vdst) {
    if (a->kv.dtype == KF_DTYPE_BF16) {
        gather_block_bf16(a, g, k0, kb, kdst, vdst);
        return;
    }
    const int hd = a->kv.head_dim;
    const size_t row = (size_t)a->kv.kv_heads * hd;
    for (int t = k0; t < k0 + kb; t++) {
        const size_t src = (size_t)a->pages[t / KF_PAGE_TOKENS] * a->kv.page_stride +
                           (size_t)(t % KF_PAGE_TOKENS) * row + (size_t)g * hd;
        if (kdst)
            memcpy(kdst + (size_t)(t - k0) * hd, (const float *)a->kv.k + src, sizeof(float) * hd);
        if (vdst)
            memcpy(vdst + (size_t)(t - k0) * hd, (const float *)a->kv.v + src, sizeof(float) * hd);
    }
}

/* One row's online softmax step over a block: s [kb] scores of which the first nv are visible
 * (bias added to the first nb of them); leaves the weights exp(s - m') in s (0 past nv) and
 * returns the factor e^(m - m') that the row's O and l must be scaled by (1: unchanged). Two
 * sweeps: bias and max, then exp, store and sum (the block's sum in fp32, at most KEY_BLOCK
 * terms of at most 1 each, then added to l in fp64). */
KF_ROW_CLONES static float online_row(float *s, int kb, int nv, const float *bias, int nb, float *m, double *l) {
    float mx = -FLT_MAX;
#pragma omp simd reduction(max : mx)
    for (int j = 0; j < nb; j++) {
        s[j] += bias[j];
        mx = s[j] > mx ? s[j] : mx;
    }
#pragma omp simd reduction(max : mx)
    for (int j = nb; j < nv; j++)
        mx = s[j] > mx ? s[j] : mx;
    const float m_new = mx > *m ? mx : *m;
    float sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int j = 0; j < nv; j++) {
        const float e = kf_expf_nonpos(s[j] - m_new); /* s[j] <= m_new */
        s[j] = e;
        sum += e;
    }
    for (int j = nv; j < kb; j++)
        s[j] = 0.0f;
    const float corr = m_new == *m ? 1.0f : kf_expf_nonpos(*m - m_new);
    *m = m_new;
    *l = *l * corr + sum;
    return corr;
}

/* Key t's rows of K (with_k) and V (with_v) of KV head g towards the core's L2 cache (the next
 * block's keys, while this block is worked on, so that its gather reads cache instead of waiting
 * on memory). */
static void prefetch_key(const kf_attn_args *a, int g, int t, int with_k, int with_v) {
    const size_t esz = a->kv.dtype == KF_DTYPE_BF16 ? 2 : 4, bytes = esz * (size_t)a->kv.head_dim;
    const size_t at = ((size_t)a->pages[t / KF_PAGE_TOKENS] * a->kv.page_stride +
                       (size_t)(t % KF_PAGE_TOKENS) * a->kv.kv_heads * a->kv.head_dim + (size_t)g * a->kv.head_dim) *
                      esz;
    const char *k = (const char *)a->kv.k + at, *v = (const char *)a->kv.v + at;
    for (size_t off = 0; off < bytes + 63; off += 64) {
        const size_t o = off < bytes ? off : bytes - 1; /* the row's last line, when it is not aligned */
        if (with_k)
            __builtin_prefetch(k + o, 0, 2);
        if (with_v)
            __builtin_prefetch(v + o, 0, 2);
    }
}

/* Where a tile sits: KV head g, queries [q0, q0 + tq), rows = tq * rep stacked query rows. */
typedef struct {
    int g, q0, tq, rows;
} tile_pos;

/* Keys [k0, k0 + kb) for the tile's rows, online (the header's step), as a block of kw >= kb keys
 * (the rest zero); the next block's n_next keys are prefetched meanwhile. */
static void key_block(const attn_job *j, attn_bufs *b, tile_pos t, int k0, int kb, int kw, int n_next) {
    const kf_attn_args *a = j->a;
    const int hd = a->kv.head_dim, rep = j->rep, n_past = a->n_keys - a->n_q, rows = t.rows;
    const float *bias = a->bias ? a->bias + (size_t)t.g * a->bias_stride : NULL;
    /* rows before r0 belong to queries that see no key of this block */
    const int i0 = k0 - n_past - t.q0 > 0 ? k0 - n_past - t.q0 : 0, r0 = i0 * rep, ra = rows - r0;
    if (ra <= 0)
        return;
    gather_block(a, t.g, k0, kb, b->kb, b->vb);
    const int kq = kw < QK_COLS ? QK_COLS : kw; /* the logits' keys: [kw, kq) zero, never read */
    if (kq > kb)
        memset(b->kb + (size_t)kb * hd, 0, sizeof(float) * (size_t)(kq - kb) * hd);
    if (kw > kb)
        memset(b->vb + (size_t)kb * hd, 0, sizeof(float) * (size_t)(kw - kb) * hd);
    const int rg = row_groups(ra); /* rows [rows, r0 + rg) are padding */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rg, kq, hd, a->scale, b->qp + (size_t)r0 * hd, hd, b->kb, hd,
                0.0f, b->s + (size_t)r0 * KEY_BLOCK, KEY_BLOCK);
    for (int r = r0; r < rows; r++) {
        for (int p = r - r0; p < n_next; p += ra)
            prefetch_key(a, t.g, k0 + kb + p, 1, 1);
        const int valid = n_past + t.q0 + r / rep + 1 - k0; /* keys of the block this row sees */
        const int nv = valid < kb ? valid : kb;
        const int nb = !bias || a->bias_len <= k0 ? 0 : (a->bias_len - k0 < nv ? a->bias_len - k0 : nv);
        const float corr =
            online_row(b->s + (size_t)r * KEY_BLOCK, kw, nv, bias ? bias + k0 : NULL, nb, &b->m[r], &b->l[r]);
        if (corr != 1.0f)
            for (int d = 0; d < hd; d++)
                b->o[(size_t)r * hd + d] *= corr;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rg, hd, kw, 1.0f, b->s + (size_t)r0 * KEY_BLOCK, KEY_BLOCK,
                b->vb, hd, 1.0f, b->o + (size_t)r0 * hd, hd);
}

/* Keys [k0, k1) in blocks of step keys (at most KEY_BLOCK); with pad, the last one as a whole
 * block of step keys too (zeros past k1). */
static void key_range(const attn_job *j, attn_bufs *b, tile_pos t, int k0, int k1, int step, int pad) {
    for (; k0 < k1; k0 += step) {
        const int kb = k1 - k0 < step ? k1 - k0 : step, rest = k1 - k0 - kb;
        key_block(j, b, t, k0, kb, pad ? step : kb, rest < step ? rest : step);
    }
}

/* Keys [k0, kmax) of the tile: those before kal (the tile's first query's position rounded down to
 * a multiple of KEY_BLOCK: every query of the tile sees them) by KEY_BLOCK, the rest by whole
 * blocks of DIAG_BLOCK, so that rows skip the sub-blocks past their query. A row's blocks depend
 * on its position alone (tiles never cross a multiple of KEY_BLOCK), not on its tile. */
static void key_span(const attn_job *j, attn_bufs *b, tile_pos t, int k0, int kal, int kmax) {
    key_range(j, b, t, k0, kal, KEY_BLOCK, 0);
    key_range(j, b, t, k0 > kal ? k0 : kal, kmax, DIAG_BLOCK, 1);
}

/* The first of the target rows (tg->rows) whose query is at or after the tile's first. */
static int first_target(const kf_attn_targets *tg, int q0) {
    int lo = 0, hi = tg->n_rows;
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (tg->rows[mid] - tg->row_base < q0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* One row of the block's logits z [n]: the probabilities p = exp(z - m) / y in place (m the max,
 * y the sum of the exponentials: fp32 over KEY_BLOCK keys at a time, those sums added in fp64),
 * and for a target row (part not NULL) part += p, or p^2 with rms, while the row is in cache. Not
 * kf_cpu_softmax_row: that one sums in index order to keep AM's and the diagnostics' bits; here
 * the sums are vectorized and the score is added in the same sweep as the division (the repeat
 * prefill's hot loop). */
KF_ROW_CLONES static void block_row(float *z, int n, float *m, double *y, double *part, int rms) {
    float mx = -FLT_MAX;
#pragma omp simd reduction(max : mx)
    for (int c = 0; c < n; c++)
        mx = z[c] > mx ? z[c] : mx;
    double sum = 0;
    for (int c0 = 0; c0 < n; c0 += KEY_BLOCK) {
        const int c1 = n - c0 < KEY_BLOCK ? n : c0 + KEY_BLOCK;
        float bsum = 0;
#pragma omp simd reduction(+ : bsum)
        for (int c = c0; c < c1; c++) {
            const float e = kf_expf_nonpos(z[c] - mx);
            z[c] = e;
            bsum += e;
        }
        sum += bsum;
    }
    const float inv = (float)(1.0 / sum);
    if (part && rms) {
#pragma omp simd
        for (int c = 0; c < n; c++) {
            const float p = z[c] * inv;
            z[c] = p;
            part[c] += (double)p * p;
        }
    } else if (part) {
#pragma omp simd
        for (int c = 0; c < n; c++) {
            const float p = z[c] * inv;
            z[c] = p;
            part[c] += p;
        }
    } else {
#pragma omp simd
        for (int c = 0; c < n; c++)
            z[c] *= inv;
    }
    *m = mx;
    *y = sum;
}

/* The tile's rows through block_row, in row order; the target rows' sums into the item's part. */
static void block_rows(const attn_job *j, attn_bufs *b, tile_pos t, int item) {
    const kf_attn_targets *tg = j->a->targets;
    const int nb = j->n_blk;
    double *part = j->part + (size_t)item * nb;
    const size_t ld = (size_t)j->ld_blk;
    j->has[item] = 0;
    for (int r = 0, k = first_target(tg, t.q0); r < t.rows; r++) {
        const int q = t.q0 + r / j->rep;
        while (k < tg->n_rows && tg->rows[k] - tg->row_base < q)
            k++;
        const int target = k < tg->n_rows && tg->rows[k] - tg->row_base == q;
        if (target && !j->has[item]) {
            memset(part, 0, sizeof(double) * nb);
            j->has[item] = 1;
        }
        block_row(b->sb + (size_t)r * ld, nb, &b->m[r], &b->l[r], target ? part : NULL, tg->score_rms);
    }
}

/* m, y and Y (= O, normalized) of the tile's target rows to the caller. */
static void emit_targets(const attn_job *j, const attn_bufs *b, tile_pos t) {
    const kf_attn_targets *tg = j->a->targets;
    const int hd = j->a->kv.head_dim, rep = j->rep;
    for (int k = first_target(tg, t.q0); k < tg->n_rows && tg->rows[k] - tg->row_base < t.q0 + t.tq; k++) {
        const int i = tg->rows[k] - tg->row_base - t.q0;
        for (int jh = 0; jh < rep; jh++) {
            const int r = i * rep + jh;
            const size_t at = (size_t)k * tg->row_stride + (size_t)(t.g * rep + jh) * tg->head_stride;
            tg->m[at] = b->m[r];
            tg->y[at] = (float)b->l[r];
            memcpy(tg->Y + at * hd, b->o + (size_t)r * hd, sizeof(float) * hd);
        }
    }
}

/* Logits of rg rows against the kb keys in b->kb into dst [rg, ld]: a chunk narrower than QK_COLS
 * goes through b->s with zero keys past kb, then its kb columns are copied out. */
static void block_logits(const kf_attn_args *a, attn_bufs *b, int rg, int kb, float *dst, int ld) {
    const int hd = a->kv.head_dim;
    if (kb >= QK_COLS) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rg, kb, hd, a->scale, b->qp, hd, b->kb, hd, 0.0f, dst, ld);
        return;
    }
    memset(b->kb + (size_t)kb * hd, 0, sizeof(float) * (size_t)(QK_COLS - kb) * hd);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rg, QK_COLS, hd, a->scale, b->qp, hd, b->kb, hd, 0.0f, b->s,
                KEY_BLOCK);
    for (int r = 0; r < rg; r++)
        memcpy(dst + (size_t)r * ld, b->s + (size_t)r * KEY_BLOCK, sizeof(float) * kb);
}

/* The whole block [blk0, blk1) as one softmax per row (targets), leaving the online state
 * m = the block's max, l = y, O = y Y for the other keys. */
static void block_first(const attn_job *j, attn_bufs *b, tile_pos t, int item) {
    const kf_attn_args *a = j->a;
    const int hd = a->kv.head_dim, nb = j->n_blk, ld = j->ld_blk, blk0 = a->targets->blk0;
    const int rg = row_groups(t.rows); /* rows [t.rows, rg) are padding */
    for (int c0 = 0; c0 < nb; c0 += KEY_BLOCK) {
        const int kb = nb - c0 < KEY_BLOCK ? nb - c0 : KEY_BLOCK;
        gather_block(a, t.g, blk0 + c0, kb, b->kb, NULL);
        for (int k = c0 + kb; k < nb && k < c0 + kb + KEY_BLOCK; k++) /* the next chunk's keys */
            prefetch_key(a, t.g, blk0 + k, 1, 0);
        block_logits(a, b, rg, kb, b->sb + c0, ld);
    }
    block_rows(j, b, t, item);
    for (int c0 = 0; c0 < nb; c0 += KEY_BLOCK) {
        const int kb = nb - c0 < KEY_BLOCK ? nb - c0 : KEY_BLOCK;
        gather_block(a, t.g, blk0 + c0, kb, NULL, b->vb);
        for (int k = c0 + kb; k < nb && k < c0 + kb + KEY_BLOCK; k++) /* the next chunk's values */
            prefetch_key(a, t.g, blk0 + k, 0, 1);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rg, hd, kb, 1.0f, b->sb + c0, ld, b->vb, hd,
                    c0 ? 1.0f : 0.0f, b->o, hd);
    }
    emit_targets(j, b, t);
    for (int r = 0; r < t.rows; r++) {
        const float y = (float)b->l[r];
        for (int d = 0; d < hd; d++)
            b->o[(size_t)r * hd + d] *= y;
    }
}

/* m, y and Y over the own keys of the tile's target rows that have a slot, to the caller. */
static void emit_own(const attn_job *j, const attn_bufs *b, tile_pos t) {
    const kf_attn_targets *tg = j->a->targets;
    const int hd = j->a->kv.head_dim, rep = j->rep;
    for (int k = first_target(tg, t.q0); tg->app_slot && k < tg->n_rows && tg->rows[k] - tg->row_base < t.q0 + t.tq;
         k++) {
        if (tg->app_slot[k] < 0)
            continue;
        const int i = tg->rows[k] - tg->row_base - t.q0;
        for (int jh = 0; jh < rep; jh++) {
            const int r = i * rep + jh;
            const size_t at = (size_t)tg->app_slot[k] * tg->row_stride + (size_t)(t.g * rep + jh) * tg->app_head_stride;
            const float inv = (float)(1.0 / b->l[r]);
            tg->am[at] = b->m[r];
            tg->ay[at] = (float)b->l[r];
            for (int d = 0; d < hd; d++)
                tg->aY[at * hd + d] = b->o[(size_t)r * hd + d] * inv;
        }
    }
}

/* The tile's own keys [app0, kmax) online from a fresh state, emitted, and kept aside in ko, km,
 * kl for own_merge. */
static void own_first(const attn_job *j, attn_bufs *b, tile_pos t, int kal, int kmax) {
    const int hd = j->a->kv.head_dim;
    memset(b->o, 0, sizeof(float) * (size_t)(t.rows + ROW_PAD) * hd);
    key_span(j, b, t, j->a->targets->app0, kal, kmax);
    emit_own(j, b, t);
    memcpy(b->ko, b->o, sizeof(float) * (size_t)t.rows * hd);
    memcpy(b->km, b->m, sizeof(float) * (size_t)t.rows);
    memcpy(b->kl, b->l, sizeof(double) * (size_t)t.rows);
}

/* The kept own-key state merged into the block's (both hold at least one key per row). */
static void own_merge(attn_bufs *b, int rows, int hd) {
    for (int r = 0; r < rows; r++) {
        const float mx = b->km[r] > b->m[r] ? b->km[r] : b->m[r];
        const float cb = kf_expf_nonpos(b->m[r] - mx), ca = kf_expf_nonpos(b->km[r] - mx);
        float *o = b->o + (size_t)r * hd;
        const float *ko = b->ko + (size_t)r * hd;
        for (int d = 0; d < hd; d++)
            o[d] = o[d] * cb + ko[d] * ca;
        b->l[r] = b->l[r] * cb + b->kl[r] * ca;
        b->m[r] = mx;
    }
}

/* One (KV head, query tile) item. */
static void tile_item(void *ctx, int item, int thread) {
    const attn_job *j = ctx;
    const kf_attn_args *a = j->a;
    const int hd = a->kv.head_dim, rep = j->rep, tile = item % j->n_tiles;
    const int q0 = j->tile_q0[tile], tq = j->tile_q0[tile + 1] - q0;
    const tile_pos t = {.g = item / j->n_tiles, .q0 = q0, .tq = tq, .rows = tq * rep};
    const int first = a->n_keys - a->n_q + q0;               /* the tile's first query's own key */
    const int kal = first / KEY_BLOCK * KEY_BLOCK, kmax = first + tq; /* kmax: keys its last query sees */
    const kf_attn_targets *tg = a->targets;
    const int own = tg && tg->app0 > 0;
    attn_bufs b = bufs_at(j->work + (size_t)thread * j->per_thread, t.rows, hd, j->ld_blk, own);
    for (int i = 0; i < tq; i++) /* the group's heads of query i are adjacent in q */
        memcpy(b.qp + (size_t)i * rep * hd, a->q + (size_t)(q0 + i) * a->q_stride + (size_t)t.g * rep * hd,
               sizeof(float) * rep * hd);
    memset(b.qp + (size_t)t.rows * hd, 0, sizeof(float) * ROW_PAD * hd); /* the padding rows */
    for (int r = 0; r < t.rows; r++) {
        b.m[r] = -INFINITY;
        b.l[r] = 0;
    }
    if (own) {
        own_first(j, &b, t, kal, kmax);
        block_first(j, &b, t, item);
        own_merge(&b, t.rows, hd);
        key_range(j, &b, t, 0, tg->blk0, KEY_BLOCK, 0);
        key_range(j, &b, t, tg->blk1, tg->app0, KEY_BLOCK, 0);
    } else if (tg) {
        block_first(j, &b, t, item);
        key_range(j, &b, t, 0, tg->blk0, KEY_BLOCK, 0);
        key_span(j, &b, t, tg->blk1, kal, kmax);
    } else {
        memset(b.o, 0, sizeof(float) * (size_t)(t.rows + ROW_PAD) * hd);
        key_span(j, &b, t, 0, kal, kmax);
    }
    for (int r = 0; r < t.rows; r++) {
        const float inv = (float)(1.0 / b.l[r]);
        float *dst = a->out + (size_t)(q0 + r / rep) * a->out_stride + (size_t)(t.g * rep + r % rep) * hd;
        for (int d = 0; d < hd; d++)
            dst[d] = b.o[(size_t)r * hd + d] * inv;
    }
}

/* The tiles' size: at most TILE_ROWS rows; without targets smaller while there would be fewer
 * than two items per thread (down to 64 rows: no row's result depends on its tile); with targets
 * fixed by the arguments alone (the block's logits of a tile within BLOCK_FLOATS), so that the
 * score's sums, added tile by tile, never depend on the thread count. */
static int tile_queries(const kf_attn_args *a, int rep, int n_blk, int threads) {
    const int nq = a->n_q;
    int rows = TILE_ROWS;
    if (n_blk > 0 && (size_t)rows * n_blk > BLOCK_FLOATS)
        rows = BLOCK_FLOATS / (size_t)n_blk > 64 ? (int)(BLOCK_FLOATS / (size_t)n_blk) : 64;
    int tq = rows / rep > 0 ? rows / rep : 1;
    tq = tq < nq ? tq : nq;
    while (!n_blk && a->kv.kv_heads * ((nq + tq - 1) / tq) < 2 * threads && tq * rep > 64 && tq > 1)
        tq = (tq + 1) / 2;
    return tq;
}

/* The tiles' first queries into j->tile_q0 [n_tiles + 1] and j->n_tiles: the queries [0, n_q)
 * (positions n_past, n_past + 1, ...) cut where a position is a multiple of KEY_BLOCK, then into
 * tiles of at most tq queries. 0, or -1 when out of memory. */
static int tile_starts(kf_cpu_attn_scratch *s, int n_past, int n_q, int tq, attn_job *j) {
    const size_t most = (size_t)n_q / tq + (size_t)n_q / KEY_BLOCK + 3;
    if (kf_cpu_grow((void **)&s->tiles, &s->tiles_cap, most, sizeof(int)) != 0)
        return -1;
    int n = 0;
    for (int q0 = 0; q0 < n_q;) {
        const int seg_end = ((n_past + q0) / KEY_BLOCK + 1) * KEY_BLOCK - n_past; /* first query of the next cut */
        const int end = seg_end < n_q ? seg_end : n_q;
        for (; q0 < end; q0 = q0 + tq < end ? q0 + tq : end)
            s->tiles[n++] = q0;
    }
    s->tiles[n] = n_q;
    j->tile_q0 = s->tiles;
    j->n_tiles = n;
    return 0;
}

/* The work area grows to n floats from 64 bytes on (the contents are not kept); 0 or -1. */
static int grow_work(kf_cpu_attn_scratch *s, size_t n) {
    if (n <= s->work_cap)
        return 0;
    free(s->work_raw); /* first: the old and the new area never both exist */
    s->work = NULL;
    s->work_cap = 0;
    if (!(s->work_raw = malloc(n * sizeof(float) + 64)))
        return -1;
    s->work = (float *)(((uintptr_t)s->work_raw + 63) & ~(uintptr_t)63);
    s->work_cap = n;
    return 0;
}

/* The targets' argument checks (backend.h) and the per-item parts; 0 or -1. */
static int targets_setup(kf_cpu_attn_scratch *s, const kf_attn_args *a, attn_job *j, int n_items) {
    const kf_attn_targets *t = a->targets;
    if (t->blk0 < 0 || t->blk1 <= t->blk0 || t->blk1 > a->n_keys - a->n_q || a->bias || !t->m || !t->y || !t->Y ||
        !t->score || (t->n_rows > 0 && !t->rows))
        return -1;
    if (t->app0 > 0 && (t->app0 < t->blk1 || t->app0 > a->n_keys - a->n_q ||
                        (t->app_slot && t->n_rows > 0 && (!t->am || !t->ay || !t->aY))))
        return -1;
    for (int k = 0; k < t->n_rows; k++)
        if (t->rows[k] - t->row_base < 0 || t->rows[k] - t->row_base >= a->n_q ||
            (k > 0 && t->rows[k] <= t->rows[k - 1]))
            return -1;
    if (kf_cpu_grow((void **)&s->part, &s->part_cap, (size_t)n_items * j->n_blk, sizeof(double)) != 0 ||
        kf_cpu_grow((void **)&s->has, &s->has_cap, (size_t)n_items, 1) != 0)
        return -1;
    j->part = s->part;
    j->has = s->has;
    return 0;
}

/* The items' score parts into the caller's score, per KV head in tile order. */
static void targets_merge(const kf_attn_args *a, const attn_job *j) {
    const kf_attn_targets *t = a->targets;
    for (int g = 0; g < a->kv.kv_heads; g++) {
        double *dst = t->score + (size_t)g * t->score_stride;
        for (int it = g * j->n_tiles; it < (g + 1) * j->n_tiles; it++) {
            if (!j->has[it])
                continue;
            const double *p = j->part + (size_t)it * j->n_blk;
            for (int c = 0; c < j->n_blk; c++)
                dst[c] += p[c];
        }
    }
}

int kf_cpu_attention(kf_cpu_attn_scratch *s, const kf_attn_args *a) {
    const int nq = a->n_q, hd = a->kv.head_dim, rep = a->n_heads / a->kv.kv_heads;
    if (nq <= 0)
        return 0;
    const int threads = kf_pool_threads(s->pool);
    attn_job j = {.a = a, .rep = rep, .n_blk = a->targets ? a->targets->blk1 - a->targets->blk0 : 0};
    if (a->targets && j.n_blk <= 0)
        return -1;
    j.ld_blk = (int)al16((size_t)j.n_blk);
    j.tq = tile_queries(a, rep, j.n_blk, threads);
    if (tile_starts(s, a->n_keys - nq, nq, j.tq, &j) != 0)
        return -1;
    j.per_thread = kf_cpu_attn_tile_floats(j.tq * rep, hd, j.ld_blk, a->targets && a->targets->app0 > 0);
    /* ^ 64-byte steps between threads */
    if (grow_work(s, (size_t)threads * j.per_thread) != 0)
        return -1;
    j.work = s->work;
    const int n_items = a->kv.kv_heads * j.n_tiles;
    if (a->targets && targets_setup(s, a, &j, n_items) != 0)
        return -1;
    const int blas_threads = openblas_get_num_threads();
    if (blas_threads > 1)
        openblas_set_num_threads(1);
    kf_pool_run(s->pool, n_items, tile_item, &j);
    if (blas_threads > 1)
        openblas_set_num_threads(blas_threads);
    if (a->targets)
        targets_merge(a, &j);
    return 0;
}
