/* compact_mem.c — the memory formula of a compaction (compact.h, "memory"). */
#include <math.h>

#include "compactor/compact.h"
#include "compactor/fold.h"
#include "compactor/refq_targets.h"
#include "kernels/cpu/cpu_kernels.h"

static int64_t max64(int64_t a, int64_t b) {
    return a > b ? a : b;
}

/* The per-head choice: the normal equations it keeps for the refit (kf_choice_kept_bytes), then its
 * own buffers (beta, u, a candidate's keys and values, the row tiles with logits, the fold
 * candidate's kept logits, the candidates' value normal equations, the fold's covariance) beside
 * its largest step (the covariance's row tiles, beta's fit, a fold direction); its own are given
 * back before the refit. */

static int64_t choice_own_bytes(int t, int d, int64_t Rk) {
    const int64_t bufs = kf_ws_bytes(t, 4) + kf_ws_bytes(d, 4) + 2 * kf_ws_bytes((int64_t)t * d, 4) +
                         kf_gram_tiles_bytes(t, d, 1) + kf_value_gram_bytes(t, d) + kf_kept_logits_bytes((int)Rk, t) +
                         kf_fold_cov_bytes(d);
    int64_t step = kf_fold_cov_compute_bytes(d) - kf_fold_cov_bytes(d);
    step = kf_ws_max(step, kf_am_fit_beta_normal_bytes(t));
    return bufs + kf_ws_max(step, kf_fold_direction_cov_bytes(d));
}

/* The largest step of the final fits: a refit part of beta's or of the values' normal equations,
 * beta's fit with or without the kept normal equations, the fold direction, the values' normal
 * equations. */
static int64_t fit_step_bytes(int t, int d) {
    int64_t most = kf_beta_normal_build_bytes(t);
    most = kf_ws_max(most, kf_am_fit_beta_normal_bytes(t));
    most = kf_ws_max(most, kf_am_fit_beta_bytes(t, d));
    most = kf_ws_max(most, kf_fold_direction_bytes(d));
    return kf_ws_max(most, kf_value_gram_build_bytes(t, d));
}

int64_t kf_compact_head_ws_bytes(const kf_mem_shape *s, int d) {
    const int64_t T = s->T, R = s->R, t = s->t > 0 ? s->t : 1;
    /* held for the head: its rows widened from bf16, its targets (fused: the scores alone, m, y, Y
     * being the pool's), the validation head (candidates of up to t keys) */
    const int64_t head = (s->refq_bf16 ? kf_ws_bytes(R * d, 4) : 0) +
                         (s->fused ? kf_ws_bytes(T, 4) : kf_am_targets_bytes((int)R, (int)T, d)) +
                         (s->choice ? kf_val_head_bytes((int)s->Rs, d, (int)t, (int)s->S) : 0);
    /* while the targets are computed: fused, the score sums and the unfused rows' queries and
     * targets; else the targets' scratch */
    const int64_t targets =
        s->fused ? kf_ws_bytes(T, 8) + (s->Ru > 0 ? kf_ws_bytes(s->Ru * d, 4) +
                                                         kf_am_targets_ws_bytes((int)s->Ru, (int)T, d)
                                                   : 0)
                 : kf_am_targets_ws_bytes((int)R, (int)T, d) - kf_am_targets_bytes((int)R, (int)T, d);
    /* then each variant in turn: the selection, then the choice (what it keeps for the refit, beside
     * its own buffers, then beside the final fits' largest step) or the final fits alone */
    const int tt = (int)t;
    const int64_t fits = s->choice ? kf_choice_kept_bytes(tt, d, s->refit_values) +
                                         kf_ws_max(choice_own_bytes(tt, d, s->Rk), fit_step_bytes(tt, d))
                                   : fit_step_bytes(tt, d);
    const int64_t variant = kf_ws_max(kf_am_select_bytes((int)T), fits);
    return head + kf_ws_max(targets, variant);
}

static int64_t pg(int64_t n) {
    return (n + KF_PAGE_TOKENS - 1) / KF_PAGE_TOKENS;
}

void kf_compact_mem_shape(const kf_hfconfig *c, const kf_compact_params *p, int64_t n_pre, int64_t n_doc,
                          int64_t n_suf, int attn_threads, kf_mem_shape *out) {
    const int G = c->n_heads / c->n_kv_heads;
    int off[KF_REPEAT_SPANS_MAX], len[KF_REPEAT_SPANS_MAX];
    const int n_spans = kf_repeat_spans(p, (int)n_doc, off, len);
    int64_t repeat = 0, S = 0; /* the repeat's tokens (every span), the longest source */
    for (int k = 0; k < n_spans; k++) {
        const int64_t n = p->repeat_instruction.n + len[k];
        repeat += n;
        S = n > S ? n : S;
    }
    const int64_t ctx = p->use_context_queries ? n_doc : 0;
    int64_t probes = 0, n_cand = ctx + repeat;
    for (int i = 0; i < p->n_probes; i++) {
        S = p->probes[i].n > S ? p->probes[i].n : S;
        probes += p->probes[i].n;
        n_cand += p->probes[i].n;
    }
    const int64_t n_pos = n_cand < p->solver.max_queries / G ? n_cand : p->solver.max_queries / G;
    const int choice = kf_head_choice_active(p);
    /* the validation split: val_frac of the sampled positions that are not the context's own */
    const double elig = n_cand > 0 ? (double)n_pos * (double)(n_cand - ctx) / (double)n_cand : 0;
    int64_t t = (int64_t)floor(p->budget * (double)n_doc);
    t = t < 1 ? 1 : (t > n_doc ? n_doc : t);
    if (p->solver.head_budgets) /* the largest head's count, at most max_head_ratio of the block */
        t = (int64_t)(p->solver.max_head_ratio * (double)n_doc) > t ? (int64_t)(p->solver.max_head_ratio * (double)n_doc) : t;
    *out = (kf_mem_shape){.D = n_pre + n_doc + n_suf, .T = n_doc, .S = S, .R = (int64_t)G * n_pos, .t = t,
                          .choice = choice, .refq_bf16 = p->run.refq_bf16, .arena_bf16 = p->run.arena_dtype == KF_DTYPE_BF16,
                          .chunk = p->run.chunk, .attn_threads = attn_threads,
                          .solve_threads = attn_threads, .fold_on_probes = p->solver.fold_queries == KF_FOLD_ON_PROBES,
                          .refit_values = choice && p->choice.refit_all == KF_REFIT_VALUES};
    out->P = repeat + probes - S; /* the other sources, run beside the longest */
    out->n_p = p->n_probes + n_spans > 1 ? p->n_probes + n_spans - 1 : 0;
    out->Rc = n_cand > 0 ? (int64_t)G * (int64_t)llround((double)n_pos * (double)ctx / (double)n_cand) : 0;
    if (choice)
        out->Rv = (int64_t)G * (int64_t)llround(p->choice.val_frac * elig);
    out->Rs = kf_val_score_rows(p, out->Rv, n_doc);
    if (choice && p->method == KF_METHOD_FOLD) /* as solve_pool.c's */
        out->Rk = kf_kept_logits_rows(kf_choice_rows(p, (int)(out->R - out->Rv), (int)t), (int)t);
    out->solve_heads = attn_threads < c->n_kv_heads ? attn_threads : c->n_kv_heads;
    const int quoka_repeat = p->run.quoka && p->run.quoka_repeat && p->run.quoka->mode == KF_PREFILL_QUOKA;
    out->fused = probes > 0 || (repeat > 0 && !quoka_repeat); /* sources.c's kf_sources_targets_init */
    /* the held-out rows' prompts the solve attends itself: those of the sources that fuse no targets */
    out->Sv = !out->fused ? S + out->P : (quoka_repeat ? repeat : 0);
    if (out->fused) /* the rows the solve still computes targets for: the context's, a QUOKA repeat's */
        out->Ru = out->Rc + (quoka_repeat && n_cand > 0
                                 ? (int64_t)G * (int64_t)llround((double)n_pos * (double)repeat / (double)n_cand)
                                 : 0);
    out->head_ws = kf_compact_head_ws_bytes(out, c->head_dim);
}

/* bf16 weights: the GEMMs' tile of widened rows, the largest over the layers' (N, K) shapes (a
 * compaction computes no logits: lm_head never runs). */
static int64_t widen_tile_bytes(const kf_hfconfig *c) {
    const int H = c->hidden_size, I = c->intermediate_size, QD = c->n_heads * c->head_dim,
              KD = c->n_kv_heads * c->head_dim;
    const int N[5] = {QD, KD, H, I, H}, K[5] = {H, H, QD, H, I};
    int64_t most = 0;
    for (int i = 0; i < 5; i++)
        most = max64(most, 4 * (int64_t)kf_cpu_widen_rows(KF_WIDEN_M, N[i], K[i]) * K[i]);
    return most;
}

/* The queries of a tile the attention takes without targets (kernels/cpu/attention.c's
 * tile_queries): smaller while there would be fewer than two items per thread. */
static int64_t plain_tile_queries(const kf_hfconfig *c, const kf_mem_shape *s, int64_t chunk) {
    const int64_t G = c->n_heads / c->n_kv_heads, kvh = c->n_kv_heads;
    int64_t tf = 512 / G < chunk ? (512 / G > 0 ? 512 / G : 1) : chunk;
    while (kvh * ((chunk + tf - 1) / tf) < 2 * s->attn_threads && tf * G > 64 && tf > 1)
        tf = (tf + 1) / 2;
    return tf;
}

static int64_t al16(int64_t floats) { /* the attention's buffers: 64-byte steps */
    return (floats + 15) & ~(int64_t)15;
}

/* The targets term (compact.h): one layer of the pool, the attention's block logits and parts. */
static int64_t targets_bytes(const kf_hfconfig *c, const kf_mem_shape *s, int64_t chunk) {
    if (!s->fused)
        return 0;
    const int64_t G = c->n_heads / c->n_kv_heads, kvh = c->n_kv_heads, T = s->T > 0 ? s->T : 1;
    int64_t r_max = ((int64_t)1 << 21) / T;
    r_max = r_max < 64 ? 64 : (r_max > 512 ? 512 : r_max);
    const int64_t tq = r_max / G < chunk ? (r_max / G > 0 ? r_max / G : 1) : chunk, tf = plain_tile_queries(c, s, chunk);
    const int64_t wider = tq > tf ? G * (tq - tf) * (2 * c->head_dim + 259) : 0;
    /* the block's logits: 8 padding rows, rows of a multiple of 16 floats; the tiles: cut at every
     * multiple of 256 positions too, at most one more tile each */
    const int64_t ld = (s->T + 15) & ~(int64_t)15, tiles = (chunk + tq - 1) / tq + (chunk + 255) / 256;
    /* the tile's own-key state kept aside; with the choice, the held-out rows' own prompts' pool */
    const int64_t own = 4 * s->attn_threads * (al16(G * tq * c->head_dim) + 3 * al16(G * tq)) +
                        (s->choice ? kf_refq_targets_own_bytes(1, kvh, s->Rv, c->head_dim, s->R / G) : 0);
    return kf_refq_targets_bytes(1, kvh, s->R, c->head_dim, s->T) + 4 * s->attn_threads * ((G * tq + 8) * ld + wider) +
           8 * kvh * s->T * tiles + own;
}

int64_t kf_compact_peak_bytes(const kf_hfconfig *c, const kf_mem_shape *s, kf_mem_peak *terms) {
    const int64_t L = c->n_layers, H = c->hidden_size, I = c->intermediate_size, V = c->vocab_size;
    const int64_t d = c->head_dim, kvh = c->n_kv_heads, QD = (int64_t)c->n_heads * d, KD = kvh * d;
    const int64_t N = s->D + s->S, R = s->R, Rv = s->choice ? s->Rv : 0, T = s->T, t = s->t;
    kf_mem_peak m = {0};
    m.weights = (s->weights_bf16 ? 2 : 4) * (V * H * (c->tie_word_embeddings ? 1 : 2) + H +
                     L * (2 * H * QD + 2 * H * KD + 3 * H * I + 2 * H + (c->has_qk_norm ? 2 * d : 0)));
    const int64_t src_pages = pg(s->D) + pg(N) - s->D / KF_PAGE_TOKENS + pg(s->P) + 2 * s->n_p;
    const int64_t page_kv = (s->arena_bf16 ? 2 : 4) * 2 * KF_PAGE_TOKENS; /* K and V bytes of a page per KD */
    m.arena = page_kv * L * KD * pg(s->D) + page_kv * KD * src_pages;
    m.queries = (s->refq_bf16 ? 2 : 4) * (kvh * R * d + L * kvh * s->Rc * d);
    int64_t chunk = s->chunk > 0 ? s->chunk : KF_DEFAULT_CHUNK, longest = s->D > s->S ? s->D : s->S;
    chunk = chunk < longest ? chunk : longest;
    m.targets = targets_bytes(c, s, chunk);
    const int rows = (int)(c->n_heads / c->n_kv_heads * plain_tile_queries(c, s, chunk)); /* a tile's query rows */
    m.forward = (int64_t)kf_forward_plan_bytes(c, (int)chunk, 0) +
                4 * (int64_t)s->attn_threads * (int64_t)kf_cpu_attn_tile_floats(rows, (int)d, 0, 0) + 4 * H * (s->S + s->P);
    if (s->weights_bf16)
        m.forward += widen_tile_bytes(c) + 4 * H;
    const int64_t thread = 8 * t + 16 * t * d + (s->fold_on_probes ? 4 * R * d : 0) +
                           (s->choice ? 8 * R * (d + 1) + Rv * (4 * d + 28) : 0);
    m.solve = 8 * s->D * KD + (s->choice ? 8 * s->Sv * KD + 8 * R : 0) + (int64_t)s->solve_threads * thread +
              (int64_t)s->solve_heads * s->head_ws;
    const int64_t C = s->D - T + t;
    m.output = L * C * (8 * KD + 8 * kvh) + L * kvh * (4 * d + 9);
    m.base = 144 << 20;
    m.total = m.weights + m.arena + m.queries + m.targets + m.forward + m.solve + m.output + m.base;
    if (terms)
        *terms = m;
    return m.total;
}
