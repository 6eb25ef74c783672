#include "compactor/evaluate.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "compactor/diag.h"

typedef struct {
    float *logp;     /* [answer.n, vocab] full-context log-probabilities */
    float **q;       /* [n_layers] -> [n_tok, n_heads, head_dim] queries of question+answer tokens */
    float **k, **v;  /* [n_layers] -> [n_tok, kv_heads, head_dim] their keys and values */
    int n_tok;
    kf_diag_ref *diag; /* [n_layers * kv_heads] the original block's side of the diagnostics */
} qa_ref;

struct kf_reference {
    int L, nh, kvh, d, V;
    kf_prompt doc;        /* borrowed: the whole context, prefix included */
    kf_prompt body;       /* the document after the prefix: what the repeat copies */
    int n_prefix;         /* context tokens before the document (a chat template's beginning) */
    kf_prompt instruction;
    const kf_qa *qa;      /* borrowed */
    int n_qa;
    float *repeat_logp;   /* [body.n, vocab] */
    float *K, *Vv;        /* [n_layers, doc.n, kv_heads, head_dim] the document's keys and values */
    qa_ref *refs;         /* [n_qa] */
};

static void log_softmax_rows(float *x, int rows, int n) {
    for (int r = 0; r < rows; r++) {
        float *row = x + (size_t)r * n;
        double mx = -INFINITY, sum = 0;
        for (int i = 0; i < n; i++)
            mx = row[i] > mx ? row[i] : mx;
        for (int i = 0; i < n; i++)
            sum += exp(row[i] - mx);
        const float lse = (float)(mx + log(sum));
        for (int i = 0; i < n; i++)
            row[i] -= lse;
    }
}

/* Runs prompt (=[a | b]) on top of seq, returns log-probs of the rows predicting b's tokens, then
 * rewinds seq to its length before. capture (optional) gets queries of all prompt tokens. */
static kf_status teacher_force(kf_model *m, kf_arena *a, kf_seq *seq, const kf_prompt *first, const kf_prompt *second,
                               const float *const *bias, int bias_len, int64_t pos_offset, float *logp, float **queries,
                               kf_error *err) {
    const int n = first->n + second->n, V = kf_model_config(m)->vocab_size;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)n);
    int32_t *rows = malloc(sizeof(int32_t) * (size_t)(second->n + n));
    int32_t *all = rows + second->n;
    if (!ids || !rows) {
        free(ids);
        free(rows);
        return kf_fail(err, KF_ERR_NOMEM, "evaluate: out of memory");
    }
    memcpy(ids, first->ids, sizeof(int32_t) * first->n);
    memcpy(ids + first->n, second->ids, sizeof(int32_t) * second->n);
    for (int i = 0; i < second->n; i++)
        rows[i] = first->n - 1 + i;
    for (int i = 0; i < n; i++)
        all[i] = i;
    const int64_t len0 = seq->len;
    kf_forward_args fa = {.ids = ids, .n_tokens = n, .pos_offset = pos_offset, .logit_rows = rows,
                          .n_logit_rows = second->n, .logits = logp, .capture_rows = all,
                          .n_capture_rows = queries ? n : 0, .queries = queries, .key_bias = bias,
                          .key_bias_len = bias_len};
    kf_status rc = kf_model_forward(m, a, seq, &fa, err);
    free(ids);
    free(rows);
    if (rc == KF_OK)
        log_softmax_rows(logp, second->n, V);
    if (rc == KF_OK && !queries) /* queries: the caller still reads this prompt's K/V */
        rc = kf_seq_truncate(a, seq, len0, err);
    return rc;
}

void kf_reference_free(kf_reference *r) {
    if (!r)
        return;
    free(r->repeat_logp);
    free(r->K);
    free(r->Vv);
    for (int i = 0; r->refs && i < r->n_qa; i++) {
        free(r->refs[i].logp);
        for (int l = 0; l < r->L; l++) {
            if (r->refs[i].q)
                free(r->refs[i].q[l]);
            if (r->refs[i].k)
                free(r->refs[i].k[l]);
            if (r->refs[i].v)
                free(r->refs[i].v[l]);
        }
        free(r->refs[i].q);
        free(r->refs[i].k);
        free(r->refs[i].v);
        for (int h = 0; r->refs[i].diag && h < r->L * r->kvh; h++)
            kf_diag_ref_free(&r->refs[i].diag[h]);
        free(r->refs[i].diag);
    }
    free(r->refs);
    free(r);
}

/* Scratch for one (layer, KV head, question) of the diagnostics. */
typedef struct {
    float *hq;      /* [n_tok * G, d] the group's query heads, token by token */
    float *ak, *av; /* [n_tok, d] the question's own keys and values (the appended block) */
    int *vis;       /* [n_tok * G] appended keys each query row sees (causal) */
} diag_rows;

static void diag_rows_free(diag_rows *w) {
    free(w->hq);
    free(w->ak);
    free(w->av);
    free(w->vis);
}

static int diag_rows_alloc(diag_rows *w, const kf_reference *r) {
    int most = 1;
    for (int i = 0; i < r->n_qa; i++)
        most = r->refs[i].n_tok > most ? r->refs[i].n_tok : most;
    const int G = r->nh / r->kvh;
    w->hq = malloc(sizeof(float) * (size_t)most * G * r->d);
    w->ak = malloc(sizeof(float) * (size_t)most * r->d);
    w->av = malloc(sizeof(float) * (size_t)most * r->d);
    w->vis = malloc(sizeof(int) * (size_t)most * G);
    return w->hq && w->ak && w->av && w->vis ? 0 : -1;
}

/* Fills w for question x at layer l, KV head g; returns the appended block. */
static kf_kv_block diag_rows_fill(const kf_reference *r, const qa_ref *x, int l, int g, diag_rows *w) {
    const int d = r->d, G = r->nh / r->kvh;
    const size_t row = (size_t)r->kvh * d;
    for (int t = 0; t < x->n_tok; t++) {
        memcpy(w->ak + (size_t)t * d, x->k[l] + (size_t)t * row + (size_t)g * d, sizeof(float) * d);
        memcpy(w->av + (size_t)t * d, x->v[l] + (size_t)t * row + (size_t)g * d, sizeof(float) * d);
        for (int j = 0; j < G; j++) {
            memcpy(w->hq + ((size_t)t * G + j) * d, x->q[l] + ((size_t)t * r->nh + g * G + j) * d, sizeof(float) * d);
            w->vis[t * G + j] = t + 1; /* causal within the question */
        }
    }
    return (kf_kv_block){w->ak, w->av, (size_t)d, NULL, x->n_tok};
}

/* The original block's side of every (layer, KV head, question) diagnostic, once per document
 * instead of once per evaluated row. */
static kf_status reference_diag(kf_reference *r, kf_error *err) {
    const int d = r->d, G = r->nh / r->kvh;
    const size_t row = (size_t)r->kvh * d;
    const float scale = 1.0f / sqrtf((float)d);
    diag_rows w = {0};
    kf_status rc = diag_rows_alloc(&w, r) == 0 ? KF_OK : kf_fail(err, KF_ERR_NOMEM, "evaluate: out of memory");
    for (int i = 0; i < r->n_qa && rc == KF_OK; i++) {
        qa_ref *x = &r->refs[i];
        if (!(x->diag = calloc((size_t)r->L * r->kvh, sizeof *x->diag))) {
            rc = kf_fail(err, KF_ERR_NOMEM, "evaluate: out of memory");
            break;
        }
        for (int l = 0; l < r->L && rc == KF_OK; l++)
            for (int g = 0; g < r->kvh && rc == KF_OK; g++) {
                const kf_kv_block app = diag_rows_fill(r, x, l, g, &w);
                const kf_kv_block orig = {r->K + (size_t)l * r->doc.n * row + (size_t)g * d,
                                          r->Vv + (size_t)l * r->doc.n * row + (size_t)g * d, row, NULL, r->doc.n};
                rc = kf_diag_ref_init(&x->diag[l * r->kvh + g], w.hq, x->n_tok * G, d, scale, &orig, &app, w.vis, err);
            }
    }
    diag_rows_free(&w);
    return rc;
}

/* Question i of r on the document's cache in seq: its answer's log-probabilities, its rows' queries
 * and K/V (held for the diagnostics); the cache is truncated back to the document. */
static kf_status reference_question(kf_model *m, kf_arena *a, kf_seq *seq, kf_reference *r, int i, kf_error *err) {
    const kf_qa *qa = &r->qa[i];
    const size_t row = (size_t)r->kvh * r->d;
    qa_ref *x = &r->refs[i];
    x->n_tok = qa->question.n + qa->answer.n;
    x->logp = malloc(sizeof(float) * (size_t)qa->answer.n * r->V);
    x->q = calloc((size_t)r->L, sizeof(float *));
    x->k = calloc((size_t)r->L, sizeof(float *));
    x->v = calloc((size_t)r->L, sizeof(float *));
    if (!x->logp || !x->q || !x->k || !x->v)
        return kf_fail(err, KF_ERR_NOMEM, "evaluate: out of memory");
    kf_status rc = KF_OK;
    for (int l = 0; l < r->L; l++) {
        x->q[l] = malloc(sizeof(float) * (size_t)x->n_tok * r->nh * r->d);
        x->k[l] = malloc(sizeof(float) * (size_t)x->n_tok * row);
        x->v[l] = malloc(sizeof(float) * (size_t)x->n_tok * row);
        if (!x->q[l] || !x->k[l] || !x->v[l])
            rc = kf_fail(err, KF_ERR_NOMEM, "evaluate: out of memory");
    }
    if (rc != KF_OK)
        return rc;
    rc = teacher_force(m, a, seq, &qa->question, &qa->answer, NULL, 0, 0, x->logp, x->q, err);
    for (int l = 0; l < r->L && rc == KF_OK; l++)
        rc = kf_seq_read_kv(a, seq, l, r->doc.n, x->n_tok, x->k[l], x->v[l], err);
    if (rc == KF_OK)
        rc = kf_seq_truncate(a, seq, r->doc.n, err);
    return rc;
}

/* The full context's passes in a: the document (its K/V kept), the repeat, every question. */
static kf_status reference_passes(kf_model *m, kf_arena *a, kf_reference *r, kf_error *err) {
    const kf_prompt *doc = &r->doc;
    const size_t row = (size_t)r->kvh * r->d;
    kf_seq seq;
    kf_seq_init(&seq);
    r->repeat_logp = malloc(sizeof(float) * (size_t)r->body.n * r->V);
    r->K = malloc(sizeof(float) * (size_t)r->L * doc->n * row);
    r->Vv = malloc(sizeof(float) * (size_t)r->L * doc->n * row);
    r->refs = calloc((size_t)(r->n_qa ? r->n_qa : 1), sizeof *r->refs);
    if (!r->repeat_logp || !r->K || !r->Vv || !r->refs)
        return kf_fail(err, KF_ERR_NOMEM, "evaluate: out of memory");
    kf_forward_args fa = {.ids = doc->ids, .n_tokens = doc->n};
    kf_status rc = kf_model_forward(m, a, &seq, &fa, err);
    for (int l = 0; l < r->L && rc == KF_OK; l++)
        rc = kf_seq_read_kv(a, &seq, l, 0, doc->n, r->K + (size_t)l * doc->n * row, r->Vv + (size_t)l * doc->n * row,
                            err);
    if (rc == KF_OK)
        rc = teacher_force(m, a, &seq, &r->instruction, &r->body, NULL, 0, 0, r->repeat_logp, NULL, err);
    for (int i = 0; i < r->n_qa && rc == KF_OK; i++)
        rc = reference_question(m, a, &seq, r, i, err);
    kf_seq_release(a, &seq);
    return rc;
}

kf_status kf_reference_build(kf_model *m, const kf_prompt *doc, const kf_prompt *instruction, const kf_qa *qa,
                             int n_qa, kf_reference **out, kf_error *err) {
    return kf_reference_build_ex(m, doc, 0, instruction, qa, n_qa, out, err);
}

kf_status kf_reference_build_ex(kf_model *m, const kf_prompt *doc, int n_prefix, const kf_prompt *instruction,
                                const kf_qa *qa, int n_qa, kf_reference **out, kf_error *err) {
    *out = NULL;
    if (n_prefix < 0 || n_prefix >= doc->n)
        return kf_fail(err, KF_ERR_INVALID, "evaluate: a prefix of %d tokens leaves no document of %d", n_prefix,
                       doc->n);
    const kf_hfconfig *c = kf_model_config(m);
    kf_reference *r = calloc(1, sizeof *r);
    if (!r)
        return kf_fail(err, KF_ERR_NOMEM, "evaluate: out of memory");
    r->L = c->n_layers, r->nh = c->n_heads, r->kvh = c->n_kv_heads, r->d = c->head_dim, r->V = c->vocab_size;
    r->doc = *doc, r->instruction = *instruction, r->qa = qa, r->n_qa = n_qa, r->n_prefix = n_prefix;
    r->body = (kf_prompt){doc->ids + n_prefix, doc->n - n_prefix};
    int longest = instruction->n + doc->n;
    for (int i = 0; i < n_qa; i++)
        longest = qa[i].question.n + qa[i].answer.n > longest ? qa[i].question.n + qa[i].answer.n : longest;
    kf_arena a = {0};
    kf_status rc = kf_model_arena(m, &a, (int64_t)doc->n + longest + KF_PAGE_TOKENS, err);
    if (rc == KF_OK)
        rc = reference_passes(m, &a, r, err);
    if (rc == KF_OK)
        rc = reference_diag(r, err);
    if (a.storage)
        kf_arena_free(&a);
    if (rc != KF_OK) {
        kf_reference_free(r);
        return rc;
    }
    *out = r;
    return KF_OK;
}

/* mean over rows of KL(p || q) for log-probabilities; argmax hits of q against targets */
static double kl_rows(const float *lp, const float *lq, int rows, int V, const int32_t *targets, int *hits) {
    double total = 0;
    for (int r = 0; r < rows; r++) {
        const float *a = lp + (size_t)r * V, *b = lq + (size_t)r * V;
        double kl = 0;
        int arg = 0;
        for (int i = 0; i < V; i++) {
            kl += exp(a[i]) * ((double)a[i] - b[i]);
            arg = b[i] > b[arg] ? i : arg;
        }
        total += kl;
        if (targets && hits)
            *hits += arg == targets[r];
    }
    return total;
}

/* One compacted cache attached for measuring: its arena and sequence, its key bias, the logits of
 * one teacher-forced pass. */
typedef struct {
    kf_model *m;
    const kf_reference *r;
    kf_compacted *c;
    kf_arena a;
    kf_seq seq;
    const float **bias_l;     /* [L] */
    const float *const *bias; /* kf_compacted_bias */
    int64_t off;              /* kf_compacted_pos_offset */
    float *lq;                /* [lq_rows, vocab] the repeat (doc.n rows) or an answer */
} measure_ctx;

/* Attaches x->c in an arena of its own, large enough for the longest pass. */
static kf_status measure_open(measure_ctx *x, kf_error *err) {
    const kf_reference *r = x->r;
    int longest = r->instruction.n + r->doc.n, lq_rows = r->body.n;
    for (int i = 0; i < r->n_qa; i++) {
        const int n = r->qa[i].question.n + r->qa[i].answer.n;
        longest = n > longest ? n : longest;
        lq_rows = r->qa[i].answer.n > lq_rows ? r->qa[i].answer.n : lq_rows;
    }
    kf_seq_init(&x->seq);
    x->bias_l = calloc((size_t)r->L, sizeof *x->bias_l);
    x->lq = malloc(sizeof(float) * (size_t)lq_rows * r->V);
    kf_status rc = x->bias_l && x->lq ? kf_model_arena(x->m, &x->a, x->c->C + longest + KF_PAGE_TOKENS, err)
                                      : kf_fail(err, KF_ERR_NOMEM, "evaluate: out of memory");
    if (rc == KF_OK)
        rc = kf_compacted_attach(x->c, &x->a, &x->seq, err);
    x->bias = kf_compacted_bias(x->c, x->bias_l);
    x->off = kf_compacted_pos_offset(x->c);
    return rc;
}

static void measure_close(measure_ctx *x) {
    kf_seq_release(&x->a, &x->seq);
    if (x->a.storage)
        kf_arena_free(&x->a);
    free(x->bias_l);
    free(x->lq);
}

/* The repeat teacher-forced on the cache: KL against the full context's, copy accuracy (sums). */
static kf_status measure_repeat(measure_ctx *x, kf_quality *out, kf_error *err) {
    const kf_reference *r = x->r;
    const kf_status rc = teacher_force(x->m, &x->a, &x->seq, &r->instruction, &r->body, x->bias, (int)x->c->C, x->off,
                                       x->lq, NULL, err);
    if (rc == KF_OK) {
        int hits = 0;
        out->kl_repeat = kl_rows(r->repeat_logp, x->lq, r->body.n, r->V, r->body.ids, &hits);
        out->copy_acc = hits;
        out->n_repeat = r->body.n;
    }
    return rc;
}

/* Greedy answer of the gold answer's length, stopped at its first wrong token (exact match is
 * all or nothing: the rest cannot change it); *match 1 when every token matched. */
static kf_status greedy_match(measure_ctx *x, const kf_qa *qa, int *match, kf_error *err) {
    const int V = x->r->V;
    int32_t last = qa->question.n - 1;
    kf_forward_args fa = {.ids = qa->question.ids, .n_tokens = qa->question.n, .pos_offset = x->off,
                          .logit_rows = &last, .n_logit_rows = 1, .logits = x->lq, .key_bias = x->bias,
                          .key_bias_len = (int)x->c->C};
    kf_status rc = KF_OK;
    int32_t tok = 0;
    *match = 1;
    for (int j = 0; j < qa->answer.n && rc == KF_OK && *match; j++) {
        rc = kf_model_forward(x->m, &x->a, &x->seq, &fa, err);
        int32_t arg = 0;
        for (int v = 1; v < V; v++)
            arg = x->lq[v] > x->lq[arg] ? v : arg;
        *match &= arg == qa->answer.ids[j];
        tok = arg;
        last = 0;
        fa.ids = &tok;
        fa.n_tokens = 1;
    }
    return rc;
}

/* Question i on the cache: the answer's KL and fact accuracy teacher-forced, then the greedy
 * answer's exact match (sums); the cache is truncated back to itself. */
static kf_status measure_answer(measure_ctx *x, int i, kf_quality *out, kf_error *err) {
    const kf_reference *r = x->r;
    const kf_qa *qa = &r->qa[i];
    const int V = r->V;
    kf_status rc = teacher_force(x->m, &x->a, &x->seq, &qa->question, &qa->answer, x->bias, (int)x->c->C, x->off,
                                 x->lq, NULL, err);
    if (rc != KF_OK)
        return rc;
    out->kl_answer += kl_rows(r->refs[i].logp, x->lq, qa->answer.n, V, NULL, NULL);
    out->n_answer += qa->answer.n;
    const int fr = kf_qa_fact_row(qa);
    if (fr >= 0) {
        int hit = 0;
        kl_rows(r->refs[i].logp + (size_t)fr * V, x->lq + (size_t)fr * V, 1, V, qa->answer.ids + fr, &hit);
        out->fact_acc += hit;
        out->n_facts++;
    }
    int match = 1;
    rc = greedy_match(x, qa, &match, err);
    out->qa_em += match;
    out->n_questions++;
    if (rc == KF_OK)
        rc = kf_seq_truncate(&x->a, &x->seq, x->c->C, err);
    return rc;
}

/* Per-head diagnostics in AM's frame, on the held-out question/answer queries: the mean over
 * heads of each head's mean over questions (head_lse, head_out [L, kvh] when not NULL). */
static kf_status measure_heads(kf_model *m, const kf_reference *r, kf_compacted *c, kf_quality *out,
                               double *head_lse, double *head_out, kf_error *err) {
    const int L = r->L, kvh = r->kvh, d = r->d;
    const size_t row = (size_t)kvh * d;
    const int was_rotated = c->rotated;
    kf_compacted_set_frame(c, m, 0);
    diag_rows w = {0};
    kf_status rc = diag_rows_alloc(&w, r) == 0 ? KF_OK : kf_fail(err, KF_ERR_NOMEM, "evaluate: out of memory");
    const float scale = 1.0f / sqrtf((float)d);
    for (int l = 0; l < L && rc == KF_OK; l++)
        for (int g = 0; g < kvh && rc == KF_OK; g++) {
            kf_kv_block comp = {c->keys + (size_t)l * c->C * row + (size_t)g * d,
                                c->values + (size_t)l * c->C * row + (size_t)g * d, row,
                                c->method == KF_METHOD_AM ? c->beta + ((size_t)l * kvh + g) * c->C : NULL, (int)c->C};
            double lse = 0, oe = 0;
            for (int i = 0; i < r->n_qa && rc == KF_OK; i++) {
                const qa_ref *x = &r->refs[i];
                const kf_kv_block app = diag_rows_fill(r, x, l, g, &w);
                kf_head_diag hd;
                rc = kf_diag_head_vs(&x->diag[l * kvh + g], w.hq, scale, &comp, &app, w.vis, &hd, err);
                lse += hd.lse_err;
                oe += hd.out_err;
            }
            if (r->n_qa) {
                out->lse_err += lse / r->n_qa;
                out->out_err += oe / r->n_qa;
            }
            if (head_lse)
                head_lse[l * kvh + g] = r->n_qa ? lse / r->n_qa : 0;
            if (head_out)
                head_out[l * kvh + g] = r->n_qa ? oe / r->n_qa : 0;
            out->n_heads++;
        }
    if (out->n_heads) {
        out->lse_err /= (double)out->n_heads;
        out->out_err /= (double)out->n_heads;
    }
    kf_compacted_set_frame(c, m, was_rotated);
    diag_rows_free(&w);
    return rc;
}

/* Sums into means. */
static void quality_means(kf_quality *out) {
    if (out->n_repeat)
        out->kl_repeat /= (double)out->n_repeat, out->copy_acc /= (double)out->n_repeat;
    if (out->n_answer)
        out->kl_answer /= (double)out->n_answer;
    if (out->n_questions)
        out->qa_em /= (double)out->n_questions;
    if (out->n_facts)
        out->fact_acc /= (double)out->n_facts;
}

kf_status kf_quality_measure(kf_model *m, const kf_reference *r, kf_compacted *c, kf_quality *out,
                             double *head_lse, double *head_out, kf_error *err) {
    memset(out, 0, sizeof *out);
    if ((c->n_prefix && c->n_prefix != r->n_prefix) || c->n_suffix || c->D != r->doc.n)
        return kf_fail(err, KF_ERR_INVALID, "evaluate: the cache is not of this document");
    measure_ctx x = {.m = m, .r = r, .c = c};
    kf_status rc = measure_open(&x, err);
    if (rc == KF_OK)
        rc = measure_repeat(&x, out, err);
    for (int i = 0; i < r->n_qa && rc == KF_OK; i++)
        rc = measure_answer(&x, i, out, err);
    if (rc == KF_OK)
        rc = measure_heads(m, r, c, out, head_lse, head_out, err);
    quality_means(out);
    measure_close(&x);
    return rc;
}

int kf_qa_fact_row(const kf_qa *qa) {
    for (int j = 0; j + 1 < qa->answer.n; j++)
        for (int k = 0; k < qa->question.n; k++)
            if (qa->answer.ids[j] == qa->question.ids[k])
                return j + 1;
    return -1;
}

kf_status kf_reference_full_cache(const kf_reference *r, kf_compacted *out, kf_error *err) {
    memset(out, 0, sizeof *out);
    const int64_t D = r->doc.n;
    const size_t row = (size_t)r->kvh * r->d, n = (size_t)r->L * D * row;
    *out = (kf_compacted){.n_layers = r->L, .kv_heads = r->kvh, .head_dim = r->d, .D = D, .C = D, .t = D,
                          .method = KF_METHOD_KEEP, .budget = 1.0, .rotated = 1};
    out->keys = malloc(sizeof(float) * n);                                /* [L, D, kvh, d] */
    out->values = malloc(sizeof(float) * n);                              /* [L, D, kvh, d] */
    out->beta = calloc((size_t)r->L * r->kvh * D, sizeof(float));         /* [L, kvh, D] */
    out->u = calloc((size_t)r->L * r->kvh * r->d, sizeof(float));         /* [L, kvh, d] */
    out->positions = malloc(sizeof(int32_t) * (size_t)r->L * r->kvh * D); /* [L, kvh, D] */
    out->var_gain = calloc((size_t)r->L * r->kvh, sizeof(float));         /* [L, kvh] */
    if (!out->keys || !out->values || !out->beta || !out->u || !out->positions || !out->var_gain) {
        kf_compacted_free(out);
        return kf_fail(err, KF_ERR_NOMEM, "evaluate: out of memory for the full cache");
    }
    memcpy(out->keys, r->K, sizeof(float) * n);
    memcpy(out->values, r->Vv, sizeof(float) * n);
    for (size_t i = 0; i < (size_t)r->L * r->kvh * D; i++)
        out->positions[i] = (int32_t)(i % (size_t)D);
    out->stats.heads_by_method[KF_METHOD_KEEP] = r->L * r->kvh;
    return KF_OK;
}

void kf_compacted_head_counts(const kf_compacted *c, int counts[4]) {
    const int n = c->n_layers * c->kv_heads;
    int filled = 0;
    for (int i = 0; i < 4; i++)
        filled += counts[i] = c->stats.heads_by_method[i];
    if (filled == n)
        return;
    memset(counts, 0, sizeof(int) * 4);
    if (c->head_method) {
        for (int i = 0; i < n; i++)
            counts[c->head_method[i] < 4 ? c->head_method[i] : c->method]++;
        return;
    }
    counts[c->method] = n;
    if (c->method == KF_METHOD_FOLD) {
        counts[KF_METHOD_FOLD] -= c->stats.fold_fallback_heads;
        counts[KF_METHOD_DROP] += c->stats.fold_fallback_heads;
    }
}

void kf_quality_add(kf_quality *s, const kf_quality *x) {
    s->kl_repeat += x->kl_repeat, s->kl_answer += x->kl_answer, s->copy_acc += x->copy_acc;
    s->qa_em += x->qa_em, s->lse_err += x->lse_err, s->out_err += x->out_err, s->fact_acc += x->fact_acc;
    s->n_repeat += x->n_repeat, s->n_answer += x->n_answer, s->n_questions += x->n_questions;
    s->n_heads += x->n_heads, s->n_facts += x->n_facts, s->n_fact_docs += x->n_facts > 0;
}

void kf_quality_mean(kf_quality *s, int n) {
    if (n <= 0)
        return;
    s->kl_repeat /= n, s->kl_answer /= n, s->copy_acc /= n, s->qa_em /= n, s->lse_err /= n, s->out_err /= n;
    s->fact_acc = s->n_fact_docs ? s->fact_acc / (double)s->n_fact_docs : 0;
}
