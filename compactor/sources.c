/* sources.c — the reference sources (docs/decisions/layer-by-layer-sources.md): the repeat's spans,
 * the probes and the document's own rows, planned; the context's prefill; the sources run layer by
 * layer on forks of the context in a one-layer arena of their own, with AM's targets fused into
 * their forwards where the backend can. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "compactor/compact_internal.h"
int kf_repeat_spans(const kf_compact_params *p, int n_doc, int *off, int *len) {
    if (p->no_repeat || p->repeat_instruction.n <= 0 || n_doc <= 0)
        return 0;
    const double F = p->repeat_fraction;
    if (!(F > 0 && F < 1)) { /* 0 (unset), 1, or out of range: the whole document */
        off[0] = 0, len[0] = n_doc;
        return 1;
    }
    int K = p->repeat_spans > 0 ? p->repeat_spans : KF_REPEAT_SPANS_DEFAULT;
    K = K > KF_REPEAT_SPANS_MAX ? KF_REPEAT_SPANS_MAX : K;
    K = K > n_doc ? n_doc : K;
    for (int k = 0; k < K; k++) {
        const int b0 = (int)((int64_t)k * n_doc / K), seg = (int)((int64_t)(k + 1) * n_doc / K) - b0;
        int n = (int)llround(F * seg);
        n = n < 1 ? 1 : (n > seg ? seg : n);
        off[k] = b0 + (int)(span_mix(p->solver.seed ^ span_mix((uint64_t)k + 0x5ba5)) % (uint64_t)(seg - n + 1));
        len[k] = n;
    }
    return K;
}

/* src [n_sources]: the document's own queries, the repeat's spans (instruction + span, owned; the
 * whole document by default), the probes; *n_cand their total length. */
kf_status kf_sources_plan(const kf_compact_prep *x, const kf_prompt *doc, source *src, int64_t *n_cand,
                          kf_error *err) {
    const kf_compact_params *p = &x->p;
    const int I = p->repeat_instruction.n;
    int off[KF_REPEAT_SPANS_MAX], len[KF_REPEAT_SPANS_MAX];
    if (p->use_context_queries)
        src[0] = (source){doc->ids, x->n_doc, KF_REFQ_CONTEXT, NULL, 0, 0};
    const int n_spans = kf_repeat_spans(p, x->n_doc, off, len);
    for (int k = 0; k < n_spans; k++) {
        const int n = I + len[k];
        int32_t *ids = malloc(sizeof(int32_t) * (size_t)n);
        if (!ids)
            return kf_fail(err, KF_ERR_NOMEM, "compact: out of memory");
        memcpy(ids, p->repeat_instruction.ids, sizeof(int32_t) * I);
        memcpy(ids + I, doc->ids + off[k], sizeof(int32_t) * len[k]);
        src[1 + k] = (source){ids, n, KF_REFQ_REPEAT, ids, off[k], off[k]};
    }
    for (int i = 0; i < p->n_probes; i++)
        src[1 + x->n_rep + i] = (source){p->probes[i].ids, p->probes[i].n, KF_REFQ_PROBE, NULL, 0, 0};
    *n_cand = 0;
    for (int i = 0; i < x->n_sources; i++)
        *n_cand += src[i].n;
    if (*n_cand == 0)
        return kf_fail(err, KF_ERR_INVALID,
                       "compact: no reference queries: give a repeat instruction, probes or context queries");
    return KF_OK;
}

/* Where the forward pass captures the rows of sampled positions first .. of one source: straight
 * into the pool (kf_refq_capture_dst), qdst [L] for an fp32 pool or qdst_h [L] for a bf16 one. */
typedef struct {
    float **q;
    uint16_t **qh;
} capture_to;

static void capture_dst(const kf_refq *rq, int64_t first, capture_to *dst) {
    for (int l = 0; l < rq->n_layers; l++) {
        if (rq->q)
            dst->q[l] = kf_refq_capture_dst(rq, l, first);
        else
            dst->qh[l] = kf_refq_capture_dst_bf16(rq, l, first);
    }
}

/* fa's capture of n_rows rows into dst at rq's strides. */
static void capture_args(const kf_refq *rq, kf_forward_args *fa, int n_rows, const capture_to *dst) {
    fa->queries = n_rows && rq->q ? dst->q : NULL;
    fa->queries_bf16 = n_rows && rq->qh ? dst->qh : NULL;
    fa->queries_row_stride = (size_t)rq->head_dim;
    fa->queries_head_stride = kf_refq_head_stride(rq);
}

/* Layer l of the context's own rows (x->ctxq, captured by the prefill) into the pool's positions
 * 0 .. n - 1, which are theirs (source 0 comes first), before the layer is solved. */
void kf_context_rows_load(kf_compact_prep *x, int l) {
    const kf_refq *c = &x->ctxq;
    const size_t elem = x->rq.q ? sizeof(float) : sizeof(uint16_t), n = (size_t)c->n_pos * x->d;
    char *dst = x->rq.q ? (char *)kf_refq_capture_dst(&x->rq, l, 0) : (char *)kf_refq_capture_dst_bf16(&x->rq, l, 0);
    const char *src = c->q ? (const char *)kf_refq_capture_dst(c, l, 0) : (const char *)kf_refq_capture_dst_bf16(c, l, 0);
    for (int h = 0; h < x->nh; h++) /* [n_heads, n_pos, d] both, n_pos differing */
        memcpy(dst + (size_t)h * kf_refq_head_stride(&x->rq) * elem, src + (size_t)h * n * elem, n * elem);
}

/* Every source's capture rows (x->rows, x->first) from the sorted sample [n_pos], and the pool's
 * source kinds. */
void kf_sources_rows(kf_compact_prep *x, const int64_t *sample, int64_t n_pos) {
    int64_t base = 0, k = 0;
    for (int i = 0; i < x->n_sources; i++) {
        x->first[i] = k;
        for (; k < n_pos && sample[k] < base + x->src[i].n; k++) /* the context's rows: after its prefix */
            x->rows[k] = (int32_t)(sample[k] - base) + (i == 0 ? x->n_pre : 0);
        memset(x->rq.source + x->first[i], x->src[i].kind, (size_t)(k - x->first[i]));
        base += x->src[i].n;
    }
    x->first[x->n_sources] = k;
}

/* Prefill the context (from `shared` on, forking reuse->parent), capturing the document's sampled
 * rows (source 0) into x->ctxq, all layers (the pool holds one). */
kf_status kf_context_prefill(kf_compact_prep *x, const kf_compact_reuse *reuse, int64_t shared,
                             const int32_t *ctx_ids, kf_error *err) {
    const double t0 = now_s();
    const int n_rows = (int)(x->first[1] - x->first[0]);
    capture_to qdst = {malloc(sizeof(float *) * (size_t)x->L), malloc(sizeof(uint16_t *) * (size_t)x->L)}; /* [L] */
    kf_status rc = !qdst.q || !qdst.qh ? kf_fail(err, KF_ERR_NOMEM, "compact: out of memory") : KF_OK;
    kf_forward_args fa = {.ids = ctx_ids + shared, .n_tokens = (int)(x->D - shared), .chunk = x->p.run.chunk,
                          .capture_rows = x->rows, .n_capture_rows = n_rows, .quoka = x->p.run.quoka};
    if (rc == KF_OK) {
        capture_dst(&x->ctxq, 0, &qdst);
        capture_args(&x->ctxq, &fa, n_rows, &qdst);
    }
    if (x->pg.fn)
        fa.progress = kf_progress_on_prefill, fa.progress_ctx = &x->pg;
    if (rc == KF_OK && shared > 0)
        rc = kf_seq_fork(x->ar, reuse->parent, shared, &x->seq, err);
    if (rc == KF_OK)
        rc = kf_model_forward(x->m, x->ar, &x->seq, &fa, err);
    free(qdst.q), free(qdst.qh);
    x->prefill_s = now_s() - t0;
    return rc;
}

/* ---- stage 2: the sources layer by layer, each layer solved (kf_compact_solve) ---- */

/* Where the attention is to be AM's targets of source i's captured rows (*fa is complete, quoka
 * included; it sees the whole document block): into the pool x->tg at the source's sampled
 * positions, which are then marked fused, with the held-out rows' attention over the source's own
 * tokens (from D on in its fork) where the pool keeps them; nothing when the model cannot. */
static void source_targets(kf_compact_prep *x, int i, kf_forward_args *fa, kf_forward_targets *ft) {
    const int64_t first = x->first[i], n_rows = x->first[i + 1] - first;
    if (!kf_source_fused(x, i)) /* the pool exists: the model makes targets of a dense forward */
        return;
    kf_refq_targets_capture(&x->tg, first, x->n_pre, (int)x->D, &x->tdst[i], ft);
    fa->targets = ft;
    memset(x->tg.fused + first, 1, (size_t)n_rows);
    for (int64_t p = first; x->tg.am && p < first + n_rows; p++)
        x->tg.own_done[p] = x->tg.own_slot[p] >= 0;
}

/* 1 when source i is one of the repeat's spans. */
static int is_repeat(const kf_compact_prep *x, int i) {
    return i >= 1 && i <= x->n_rep;
}

int kf_source_fused(const kf_compact_prep *x, int i) {
    const kf_compact_params *p = &x->p;
    const int quoka_repeat = p->run.quoka && p->run.quoka_repeat && p->run.quoka->mode == KF_PREFILL_QUOKA;
    return x->tg.m && i >= 1 && x->first[i + 1] > x->first[i] && !(is_repeat(x, i) && quoka_repeat);
}

/* The forward arguments of source i >= 1 (QUOKA window for the repeat), capturing into dst and,
 * where the model can, AM's targets through *ft. */
static void source_args(kf_compact_prep *x, int i, capture_to *dst, kf_quoka_params *qk, kf_forward_args *fa,
                        kf_forward_targets *ft) {
    const kf_compact_params *p = &x->p;
    const int n_rows = (int)(x->first[i + 1] - x->first[i]);
    *fa = (kf_forward_args){.ids = x->src[i].ids, .n_tokens = x->src[i].n, .chunk = p->run.chunk,
                            .capture_rows = x->rows + x->first[i], .n_capture_rows = n_rows,
                            .pos_offset = x->src[i].pos_offset};
    capture_dst(&x->rq, x->first[i], dst);
    capture_args(&x->rq, fa, n_rows, dst);
    if (is_repeat(x, i) && p->run.quoka && p->run.quoka_repeat) {
        /* the copy token at sequence index D + I + j reads document token o + j at n_pre + o + j
         * (o: the span's first document token, 0 for the whole repeat) */
        *qk = *p->run.quoka;
        if (p->run.quoka_margin >= 0) {
            qk->align_start = x->D + p->repeat_instruction.n;
            qk->align_shift = x->D + p->repeat_instruction.n - x->n_pre - x->src[i].doc_off;
            qk->align_margin = p->run.quoka_margin;
        }
        fa->quoka = qk;
    }
    source_targets(x, i, fa, ft);
}

/* Pages a source of n tokens run on a fork of the D-token context takes: its own pages past the
 * context's full ones (a partly filled last context page is copied on write). */
static int64_t fork_pages(int64_t D, int64_t n) {
    return kf_pages_for(D + n) - D / KF_PAGE_TOKENS;
}

/* The sources' own arena: pages of one layer (kf_arena_init_held), holding the context's layer
 * being run (x->src_ctx) and every source's fork of it; the sources never write the context's arena. */
static kf_status sources_arena(kf_compact_prep *x, kf_error *err) {
    int64_t pages = kf_pages_for(x->D);
    for (int i = 1; i < x->n_sources; i++)
        pages += x->src[i].n > 0 ? fork_pages(x->D, x->src[i].n) : 0;
    KF_TRY(kf_arena_init_held(&x->src_ar, kf_model_backend(x->m), x->L, 1, x->kvh, x->d, (int)pages, x->ar->dtype,
                              err)); /* the context's dtype: its pages are copied in byte for byte */
    KF_TRY(kf_seq_reserve(&x->src_ar, &x->src_ctx, x->D, err));
    x->src_ctx.len = x->D;
    return KF_OK;
}

void kf_sources_arena_free(kf_compact_prep *x) {
    for (int i = 0; x->forks && i < x->n_sources; i++)
        kf_seq_release(&x->src_ar, &x->forks[i]);
    if (x->src_ar.storage) {
        kf_seq_release(&x->src_ar, &x->src_ctx);
        kf_arena_free(&x->src_ar);
    }
}

/* K and V of page sp, layer slot of src, to page dp of dst (16 tokens: n elements of elem bytes each;
 * src and dst of the same dtype). */
static void copy_page_layer(kf_backend *b, const kf_paged_kv *src, int32_t sp, const kf_paged_kv *dst, int32_t dp,
                            size_t n, size_t elem) {
    const size_t so = (size_t)sp * src->page_stride * elem, dof = (size_t)dp * dst->page_stride * elem;
    b->copy(b, (char *)dst->k + dof, (const char *)src->k + so, elem * n);
    b->copy(b, (char *)dst->v + dof, (const char *)src->v + so, elem * n);
}

/* Before the sources' layer l: the context's layer l into the sources' arena, its pages and each
 * fork's own copy of the context's partly filled last page (whose other slots the source rewrites
 * in layer l before reading them: they still hold layer l - 1). */
static void context_layer_copy(kf_compact_prep *x, int l) {
    kf_backend *b = kf_model_backend(x->m);
    const kf_paged_kv src = kf_arena_layer(x->ar, l), dst = kf_arena_layer(&x->src_ar, l);
    const int np = kf_pages_for(x->D);
    for (int i = 0; i < np; i++)
        copy_page_layer(b, &src, x->seq.pages[i], &dst, x->src_ctx.pages[i], x->ar->block, x->ar->elem);
    for (int i = 1; x->D % KF_PAGE_TOKENS && i < x->n_sources; i++)
        if (x->forks[i].n_pages >= np && x->forks[i].pages[np - 1] != x->src_ctx.pages[np - 1])
            copy_page_layer(b, &src, x->seq.pages[np - 1], &dst, x->forks[i].pages[np - 1], x->ar->block,
                            x->ar->elem);
}

/* kf_model_forward_layers' hook for the sources: the context's layer copied in before, the
 * caller's on_layer after. */
typedef struct {
    kf_compact_prep *x;
    const kf_layer_hook *inner;
} sources_hook;

static kf_status sources_before(void *ctx, int l, kf_error *err) {
    (void)err;
    const sources_hook *h = ctx;
    context_layer_copy(h->x, l);
    if (h->x->tg.m) /* the attention adds layer l's score sums into the held slot */
        kf_refq_targets_layer_reset(&h->x->tg, l);
    return KF_OK;
}

static kf_status sources_after(void *ctx, int l, kf_error *err) {
    const sources_hook *h = ctx;
    return h->inner->on_layer ? h->inner->on_layer(h->inner->ctx, l, err) : KF_OK;
}

/* Every source i >= 1 on its own fork of the context in the sources' one-layer arena (KV rewind:
 * the context's pages are never written), layer-major through kf_model_forward_layers, hook's
 * on_layer after each layer (the per-layer solve); the sources' arena is made at the first call and
 * kept for the next (freed with the prep), the forks' pages released after each.
 * x->refq_s: the sources' forward seconds summed over the layers. */
kf_status kf_sources_run(kf_compact_prep *x, const kf_layer_hook *hook, kf_error *err) {
    const int n = x->n_sources, L = x->L;
    kf_forward_pass *passes = calloc((size_t)n, sizeof *passes);
    kf_forward_args *fa = calloc((size_t)n, sizeof *fa);
    capture_to *dst = calloc((size_t)n, sizeof *dst);
    float **qp = calloc((size_t)n * L, sizeof *qp);    /* [n, L] */
    uint16_t **hp = calloc((size_t)n * L, sizeof *hp); /* [n, L] */
    double *pass_s = calloc((size_t)n, sizeof *pass_s);
    kf_forward_targets *ft = calloc((size_t)n, sizeof *ft);
    kf_progress_pass *pp = calloc((size_t)n, sizeof *pp); /* [n] each pass's progress context */
    kf_quoka_params qk;
    kf_status rc = !passes || !fa || !dst || !qp || !hp || !pass_s || !ft || !pp
                       ? kf_fail(err, KF_ERR_NOMEM, "compact: out of memory")
                       : KF_OK;
    if (rc == KF_OK && !x->src_ar.storage) /* once per prep: every kf_compact_solve reuses it */
        rc = sources_arena(x, err);
    int np = 0;
    int64_t before = 0; /* the sources' tokens before source i in a layer */
    for (int i = 1; i < n && rc == KF_OK; i++) {
        if (x->src[i].n == 0)
            continue;
        dst[i] = (capture_to){qp + (size_t)i * L, hp + (size_t)i * L};
        source_args(x, i, &dst[i], &qk, &fa[i], &ft[i]);
        pp[i] = (kf_progress_pass){&x->pg, before};
        before += x->src[i].n;
        if (x->pg.fn)
            fa[i].progress = kf_progress_on_source, fa[i].progress_ctx = &pp[i];
        rc = kf_seq_fork(&x->src_ar, &x->src_ctx, x->D, &x->forks[i], err);
        passes[np++] = (kf_forward_pass){&x->forks[i], &fa[i]};
    }
    sources_hook sh = {x, hook};
    const kf_layer_hook h = {.before_layer = sources_before, .on_layer = sources_after, .ctx = &sh, .pass_s = pass_s};
    if (rc == KF_OK)
        rc = kf_model_forward_layers(x->m, &x->src_ar, passes, np, &h, err);
    x->refq_s = 0;
    for (int i = 0; pass_s && i < np; i++)
        x->refq_s += pass_s[i];
    for (int i = 0; i < n; i++) /* the forks' pages back; the context's layer stays for the next solve */
        kf_seq_release(&x->src_ar, &x->forks[i]);
    free(passes), free(fa), free(dst), free(qp), free(hp), free(pass_s), free(ft), free(pp);
    return rc;
}

/* The pool of fused targets (x->tg, one layer held like x->rq) when a source past the context can
 * have them: the repeat (unless QUOKA runs it) or a probe, on a backend whose attention makes them. */
kf_status kf_sources_targets_init(kf_compact_prep *x, kf_error *err) {
    const kf_compact_params *p = &x->p;
    const kf_forward_args dense = {0};
    const int quoka_repeat = p->run.quoka && p->run.quoka_repeat && p->run.quoka->mode == KF_PREFILL_QUOKA;
    int any = 0;
    for (int i = 1; i < x->n_sources; i++)
        any |= x->src[i].n > 0 && !(is_repeat(x, i) && quoka_repeat);
    if (!any || !kf_model_targets_supported(x->m, &dense))
        return KF_OK;
    KF_TRY(kf_refq_targets_init(&x->tg, &x->rq, x->n_doc, p->solver.score == KF_SCORE_RMS, err));
    if (!(x->tdst = calloc((size_t)x->n_sources, sizeof *x->tdst)))
        return kf_fail(err, KF_ERR_NOMEM, "compact: out of memory");
    for (int i = 1; i < x->n_sources; i++)
        KF_TRY(kf_refq_targets_dst_init(&x->tdst[i], x->L, err));
    return KF_OK;
}
