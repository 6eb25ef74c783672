/* solve_pool.c — the solve of a layer's KV heads on the backend's parallel_for
 * (docs/decisions/parallel-solve.md): per-thread buffers allocated once per kf_compact_solve, one
 * job per layer, each head's stats merged in head order so that any thread count gives the same
 * bytes. */
#include <stdlib.h>
#include <string.h>

#include "compactor/compact_internal.h"
/* One thread's scratch for the heads it solves, allocated once per kf_compact_solve. */
struct thread_ws {
    head_split sp;                 /* the head's validation split (when a variant chooses per head) */
    float *qsub;                   /* [R, d] probe rows (fold on probes), else NULL */
    int32_t *sel;                  /* [t_max] shared by the views: a head runs its variants in turn */
    float *beta;                   /* [t_max] */
    float *kfold, *vals, *kc, *vo; /* [t_max, d] each */
    variant_ws *w;                 /* [n] the thread's views of the variants (variant_ws) */
    kf_compacted *out;             /* [n] the views' outputs */
    int t_max;                     /* the most keys a variant keeps */
};

/* What one (head, variant) adds to the variant: its stats, folded and var_sum. */
struct head_add {
    kf_compact_stats st;
    int folded;
    double var_sum;
};

/* Layer l's prefix and suffix, verbatim, with their positions; K, V [D, kvh * d]. */
static void variant_edges(const kf_compact_prep *x, variant_ws *w, int l, const float *K, const float *V) {
    kf_compacted *out = w->out;
    const size_t row = (size_t)x->kvh * x->d;
    const int n_pre = x->n_pre, n_suf = x->n_suf, t = w->t;
    float *ok = out->keys + (size_t)l * out->C * row, *ov = out->values + (size_t)l * out->C * row;
    memcpy(ok, K, sizeof(float) * n_pre * row);
    memcpy(ov, V, sizeof(float) * n_pre * row);
    memcpy(ok + (size_t)(n_pre + t) * row, K + (size_t)(n_pre + x->n_doc) * row, sizeof(float) * n_suf * row);
    memcpy(ov + (size_t)(n_pre + t) * row, V + (size_t)(n_pre + x->n_doc) * row, sizeof(float) * n_suf * row);
    for (int g = 0; g < x->kvh; g++) {
        int32_t *hp = out->positions + ((size_t)l * x->kvh + g) * out->C;
        for (int i = 0; i < n_pre; i++)
            hp[i] = i;
        for (int i = 0; i < n_suf; i++)
            hp[n_pre + t + i] = (int32_t)(n_pre + x->n_doc + i);
    }
}

static void thread_free(thread_ws *t) {
    kf_split_free(&t->sp);
    free(t->qsub), free(t->sel), free(t->beta), free(t->kfold), free(t->vals), free(t->kc), free(t->vo);
    free(t->w), free(t->out);
    memset(t, 0, sizeof *t);
}

/* Thread t's buffers for the largest of the n variants w and its views of them. */
static kf_status thread_init(const kf_compact_prep *x, const variant_ws *w, int n, int any_choice, thread_ws *t,
                             kf_error *err) {
    const int d = x->d;
    int tm = 1;
    for (int i = 0; i < n; i++)
        tm = w[i].t > tm ? w[i].t : tm;
    memset(t, 0, sizeof *t);
    t->t_max = tm;
    t->sel = malloc(sizeof(int32_t) * (size_t)tm);
    t->beta = malloc(sizeof(float) * (size_t)tm);
    t->kfold = malloc(sizeof(float) * (size_t)tm * d);
    t->vals = malloc(sizeof(float) * (size_t)tm * d);
    t->kc = malloc(sizeof(float) * (size_t)tm * d);
    t->vo = malloc(sizeof(float) * (size_t)tm * d);
    t->w = calloc((size_t)n, sizeof *t->w);
    t->out = calloc((size_t)n, sizeof *t->out);
    if (x->p.solver.fold_queries == KF_FOLD_ON_PROBES)
        t->qsub = malloc(sizeof(float) * (size_t)x->rq.R * d);
    if (!t->sel || !t->beta || !t->kfold || !t->vals || !t->kc || !t->vo || !t->w || !t->out ||
        (x->p.solver.fold_queries == KF_FOLD_ON_PROBES && !t->qsub))
        return kf_fail(err, KF_ERR_NOMEM, "compact: out of memory for the solve's per-thread buffers (t %d)", tm);
    if (any_choice) {
        if (kf_split_alloc(&t->sp, x->rq.R, x->n_val_pos * x->G, d, x->n_sources) != 0)
            return kf_fail(err, KF_ERR_NOMEM, "compact: out of memory for the validation split");
        t->sp.n_val = x->n_val_pos * x->G;
        t->sp.n_tr = x->rq.R - t->sp.n_val;
        t->sp.n_score = kf_val_score_rows(&x->p, t->sp.n_val, x->n_doc);
    }
    for (int i = 0; i < n; i++) {
        t->w[i] = w[i];
        t->out[i] = *w[i].out;
        t->w[i].out = &t->out[i];
        t->w[i].sel = t->sel, t->w[i].beta = t->beta, t->w[i].kfold = t->kfold;
        t->w[i].vals = t->vals, t->w[i].kc = t->kc, t->w[i].vo = t->vo;
    }
    return KF_OK;
}

/* A workspace no other head holds: there are as many as heads can run at once (min(threads, kvh)),
 * so one is always free. Which one a head gets does not change its bytes. */
static int ws_acquire(const layer_job *j) {
    for (;;)
        for (int s = 0; s < j->n_ws; s++) {
            int free_ = 0;
            if (atomic_compare_exchange_strong(&j->ws_busy[s], &free_, 1))
                return s;
        }
}

/* Item g of a layer_job: head g's shared work, then every variant on it (the first failing one
 * stops it); its stats go to add[g, :]. */
static void head_item(void *ctx, int g, int thread) {
    const layer_job *j = ctx;
    thread_ws *t = &j->tw[thread];
    for (int i = 0; i < j->n; i++) {
        memset(&t->out[i].stats, 0, sizeof t->out[i].stats);
        t->w[i].folded = 0, t->w[i].var_sum = 0;
    }
    head_shared hs;
    const int s = ws_acquire(j);
    kf_ws *ws = &j->ws[s];
    kf_status rc =
        kf_head_prepare(j->x, j->l, g, j->K, j->V, j->any_choice ? &t->sp : NULL, &hs, ws, t->t_max, &j->err[g]);
    if (rc == KF_OK) {
        for (int i = 0; i < j->n && rc == KF_OK; i++)
            rc = kf_head_variant(j->x, &t->w[i], &hs, t->qsub, ws, &j->err[g]);
        kf_head_release(&hs);
    }
    kf_ws_reset(ws, 0);
    atomic_store(&j->ws_busy[s], 0);
    for (int i = 0; i < j->n; i++)
        j->add[(size_t)g * j->n + i] = (head_add){t->out[i].stats, t->w[i].folded, t->w[i].var_sum};
    j->rc[g] = rc;
    const int done = atomic_fetch_add(j->heads_done, 1) + 1;
    if (thread == 0 && done < j->x->kvh) /* thread 0 is the caller's: the layer's end is reported there */
        kf_progress_solve(&j->x->pg, j->l, done, j->x->kvh);
}

/* The variant's stats += one head's (head order: the sums one thread would make). */
static void head_merge(variant_ws *w, const head_add *a) {
    kf_compact_stats *s = &w->out->stats;
    s->select_s += a->st.select_s, s->beta_s += a->st.beta_s, s->values_s += a->st.values_s;
    s->fold_s += a->st.fold_s, s->choice_s += a->st.choice_s;
    s->fold_fallback_heads += a->st.fold_fallback_heads;
    s->heads_ridged += a->st.heads_ridged;
    for (int k = 0; k < 4; k++)
        s->heads_by_method[k] += a->st.heads_by_method[k];
    s->solver.beta_fallbacks += a->st.solver.beta_fallbacks;
    s->solver.value_fallbacks += a->st.solver.value_fallbacks;
    s->solver.failures += a->st.solver.failures;
    s->solver.beta_restarts += a->st.solver.beta_restarts;
    w->folded += a->folded;
    w->var_sum += a->var_sum;
}

/* Each head's workspace: the memory formula's ws (kf_compact_head_ws_bytes) for this job's shape,
 * t_max kept keys at most; known once the sources' forwards are set up (which rows they fuse
 * targets for). */
static int64_t solve_ws_bytes(const kf_compact_prep *x, int t_max, int any_choice, int fold_choice) {
    kf_mem_shape s = {.T = x->n_doc, .R = x->rq.R, .t = t_max, .choice = any_choice, .refq_bf16 = x->rq.qh != NULL,
                      .fused = x->tg.m != NULL,
                      .refit_values = any_choice && x->p.choice.refit_all == KF_REFIT_VALUES};
    s.Rv = any_choice ? x->n_val_pos * x->G : 0;
    if (fold_choice) /* the fold candidate's kept logits: the choice's rows of the training rows */
        s.Rk = kf_kept_logits_rows(kf_choice_rows(&x->p, (int)(x->rq.R - s.Rv), t_max), t_max);
    s.Rs = kf_val_score_rows(&x->p, s.Rv, x->n_doc);
    for (int i = 0; i < x->n_sources; i++) /* the longest prompt a validation row sees */
        if (x->src[i].kind != KF_REFQ_CONTEXT)
            s.S = x->src[i].n > s.S ? x->src[i].n : s.S;
    for (int64_t p = 0; s.fused && p < x->rq.n_pos; p++)
        s.Ru += x->tg.fused[p] ? 0 : x->G;
    return kf_compact_head_ws_bytes(&s, x->d);
}

/* The heads' workspaces, once per kf_compact_solve (before the first layer's heads). */
static kf_status job_ws_init(layer_job *j, kf_error *err) {
    const int64_t bytes = solve_ws_bytes(j->x, j->tw[0].t_max, j->any_choice, j->fold_choice);
    j->n_ws = j->threads < j->x->kvh ? j->threads : j->x->kvh;
    j->ws = calloc((size_t)j->n_ws, sizeof *j->ws);
    j->ws_busy = calloc((size_t)j->n_ws, sizeof *j->ws_busy);
    for (int s = 0; j->ws && j->ws_busy && s < j->n_ws; s++)
        if (kf_ws_init(&j->ws[s], bytes) != 0)
            return kf_fail(err, KF_ERR_NOMEM, "compact: out of memory for the solve's workspaces (%lld bytes each)",
                           (long long)bytes);
    if (!j->ws || !j->ws_busy)
        return kf_fail(err, KF_ERR_NOMEM, "compact: out of memory");
    j->ws_bytes = bytes;
    return KF_OK;
}

/* Layer l: its K, V [D, kvh * d] read once, then its heads in parallel (each head's shared work,
 * then every variant), then their stats merged in head order; the first failing head's error. */
static kf_status solve_layer(kf_compact_prep *x, variant_ws *w, int n, int l, float *K, float *V, layer_job *j,
                             kf_error *err) {
    if (j->ws_bytes == 0)
        KF_TRY(job_ws_init(j, err));
    KF_TRY(kf_seq_read_kv(x->ar, &x->seq, l, 0, x->D, K, V, err));
    if (j->any_choice)
        KF_TRY(kf_appended_load(&x->src_ar, x->D, &x->ap, l, err));
    kf_progress_solve(&x->pg, l, 0, x->kvh);
    for (int i = 0; i < n; i++)
        variant_edges(x, &w[i], l, K, V);
    atomic_int heads_done = 0;
    j->l = l, j->K = K, j->V = V, j->heads_done = &heads_done;
    kf_backend_parallel_for(kf_model_backend(x->m), x->kvh, head_item, j);
    for (int g = 0; g < x->kvh; g++) {
        if (j->rc[g] != KF_OK) {
            if (err)
                *err = j->err[g];
            return j->rc[g];
        }
        for (int i = 0; i < n; i++)
            head_merge(&w[i], &j->add[(size_t)g * n + i]);
    }
    kf_progress_solve(&x->pg, l, x->kvh, x->kvh);
    return KF_OK;
}

/* kf_model_forward_layers' on_layer: every source's layer l is in the arena and its queries in the
 * pool; solve the layer's heads for every variant. */
kf_status kf_pool_on_layer(void *ctx, int l, kf_error *err) {
    solve_hook *h = ctx;
    if (h->x->ctxq.n_pos > 0)
        kf_context_rows_load(h->x, l);
    return solve_layer(h->x, h->w, h->n, l, h->K, h->V, h->j, err);
}

kf_status kf_pool_init(kf_compact_prep *x, const variant_ws *w, int n, int any_choice, int threads, layer_job *j,
                       kf_error *err) {
    j->x = x, j->n = n, j->any_choice = any_choice, j->threads = threads;
    for (int i = 0; i < n; i++)
        j->fold_choice |= w[i].choice && w[i].p.method == KF_METHOD_FOLD;
    j->tw = calloc((size_t)threads, sizeof *j->tw);
    j->rc = calloc((size_t)x->kvh, sizeof *j->rc);
    j->err = calloc((size_t)x->kvh, sizeof *j->err);
    j->add = calloc((size_t)x->kvh * n, sizeof *j->add);
    if (!j->tw || !j->rc || !j->err || !j->add)
        return kf_fail(err, KF_ERR_NOMEM, "compact: out of memory");
    for (int t = 0; t < threads; t++)
        KF_TRY(thread_init(x, w, n, any_choice, &j->tw[t], err));
    return KF_OK;
}

void kf_pool_free(layer_job *j, int threads) {
    for (int t = 0; j->tw && t < threads; t++)
        thread_free(&j->tw[t]);
    for (int s = 0; j->ws && s < j->n_ws; s++)
        kf_ws_free(&j->ws[s]);
    free(j->tw), free(j->rc), free(j->err), free(j->add), free(j->ws), free((void *)j->ws_busy);
}
