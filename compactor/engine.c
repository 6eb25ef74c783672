#include "compactor/engine.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static kf_status engine_init(kf_engine *e, kf_model *m, int64_t tokens, kf_error *err) {
    memset(e, 0, sizeof *e);
    kf_seq_init(&e->seq);
    e->vocab = kf_model_config(m)->vocab_size;
    e->bias_l = calloc((size_t)kf_model_config(m)->n_layers, sizeof *e->bias_l);
    if (!e->bias_l)
        return kf_fail(err, KF_ERR_NOMEM, "engine: out of memory");
    const int chunk = tokens < KF_DEFAULT_CHUNK ? (int)tokens : KF_DEFAULT_CHUNK;
    KF_TRY(kf_forward_plan_create(&e->plan, m, chunk, 1, err));
    return kf_model_arena(m, &e->arena, tokens + KF_PAGE_TOKENS, err);
}

void kf_engine_free(kf_engine *e) {
    if (e->arena.storage) {
        kf_seq_release(&e->arena, &e->seq);
        kf_arena_free(&e->arena);
    }
    free(e->bias_l);
    kf_forward_plan_free(e->plan);
    memset(e, 0, sizeof *e);
}

kf_status kf_engine_from_compacted(kf_engine *e, kf_model *m, const kf_compacted *c, int64_t room, kf_error *err) {
    const kf_hfconfig *cfg = kf_model_config(m);
    if (c->n_layers != cfg->n_layers || c->kv_heads != cfg->n_kv_heads || c->head_dim != cfg->head_dim)
        return kf_fail(err, KF_ERR_MISMATCH, "engine: a cache of %d layers x %d kv heads x %d does not fit the model's %d x %d x %d",
                       c->n_layers, c->kv_heads, c->head_dim, cfg->n_layers, cfg->n_kv_heads, cfg->head_dim);
    kf_status rc = engine_init(e, m, c->C + room, err);
    if (rc == KF_OK)
        rc = kf_compacted_attach(c, &e->arena, &e->seq, err);
    if (rc != KF_OK) {
        kf_engine_free(e);
        return rc;
    }
    e->len = c->C;
    e->pos_offset = kf_compacted_pos_offset(c);
    e->bias = kf_compacted_bias(c, e->bias_l);
    return KF_OK;
}

kf_status kf_engine_from_document(kf_engine *e, kf_model *m, const kf_prompt *doc, int64_t room, kf_error *err) {
    kf_status rc = engine_init(e, m, doc->n + room, err);
    if (rc == KF_OK) {
        kf_forward_args fa = {.ids = doc->ids, .n_tokens = doc->n, .plan = e->plan};
        rc = kf_model_forward(m, &e->arena, &e->seq, &fa, err);
    }
    if (rc != KF_OK) {
        kf_engine_free(e);
        return rc;
    }
    e->len = doc->n;
    return KF_OK;
}

static int32_t argmax(const float *x, int n) {
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        best = x[i] > x[best] ? i : best;
    return best;
}

kf_status kf_engine_greedy(kf_engine *e, kf_model *m, const kf_prompt *prompt, int max_new, const int32_t *stop_ids,
                           int n_stop, int (*stop)(void *ctx, const int32_t *ids, int n), void *stop_ctx, int32_t *out,
                           int *n_out, kf_error *err) {
    *n_out = 0;
    if (prompt->n < 1)
        return kf_fail(err, KF_ERR_INVALID, "engine: empty prompt");
    float *logits = malloc(sizeof(float) * (size_t)e->vocab); /* [vocab] */
    if (!logits)
        return kf_fail(err, KF_ERR_NOMEM, "engine: out of memory");
    int32_t row = prompt->n - 1, tok = 0;
    kf_forward_args fa = {.ids = prompt->ids, .n_tokens = prompt->n, .pos_offset = e->pos_offset,
                          .logit_rows = &row, .n_logit_rows = 1, .logits = logits, .key_bias = e->bias,
                          .key_bias_len = (int)e->len, .plan = e->plan};
    kf_status rc = KF_OK;
    while (*n_out < max_new) {
        if ((rc = kf_model_forward(m, &e->arena, &e->seq, &fa, err)) != KF_OK)
            break;
        tok = argmax(logits, e->vocab);
        int is_stop = 0;
        for (int i = 0; i < n_stop; i++)
            is_stop |= tok == stop_ids[i];
        if (is_stop)
            break;
        out[(*n_out)++] = tok;
        if (stop && stop(stop_ctx, out, *n_out))
            break;
        row = 0;
        fa.ids = &tok;
        fa.n_tokens = 1;
    }
    free(logits);
    kf_status rc2 = kf_seq_truncate(&e->arena, &e->seq, e->len, err); /* KV rewind */
    return rc != KF_OK ? rc : rc2;
}

kf_status kf_engine_logprobs(kf_engine *e, kf_model *m, const kf_prompt *prompt, const kf_prompt *answer, float *logp,
                             kf_error *err) {
    if (prompt->n < 1 || answer->n < 1)
        return kf_fail(err, KF_ERR_INVALID, "engine: empty prompt or answer");
    const int n = prompt->n + answer->n;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)n);     /* [n] */
    int32_t *rows = malloc(sizeof(int32_t) * (size_t)answer->n); /* [answer.n] */
    if (!ids || !rows) {
        free(ids);
        free(rows);
        return kf_fail(err, KF_ERR_NOMEM, "engine: out of memory");
    }
    memcpy(ids, prompt->ids, sizeof(int32_t) * prompt->n);
    memcpy(ids + prompt->n, answer->ids, sizeof(int32_t) * answer->n);
    for (int i = 0; i < answer->n; i++)
        rows[i] = prompt->n - 1 + i;
    kf_forward_args fa = {.ids = ids, .n_tokens = n, .pos_offset = e->pos_offset, .logit_rows = rows,
                          .n_logit_rows = answer->n, .logits = logp, .key_bias = e->bias, .key_bias_len = (int)e->len,
                          .plan = e->plan};
    kf_status rc = kf_model_forward(m, &e->arena, &e->seq, &fa, err);
    free(ids);
    free(rows);
    for (int r = 0; rc == KF_OK && r < answer->n; r++) { /* log-softmax in fp64 */
        float *x = logp + (size_t)r * e->vocab;
        double mx = -INFINITY, sum = 0;
        for (int i = 0; i < e->vocab; i++)
            mx = x[i] > mx ? x[i] : mx;
        for (int i = 0; i < e->vocab; i++)
            sum += exp(x[i] - mx);
        const float lse = (float)(mx + log(sum));
        for (int i = 0; i < e->vocab; i++)
            x[i] -= lse;
    }
    kf_status rc2 = kf_seq_truncate(&e->arena, &e->seq, e->len, err);
    return rc != KF_OK ? rc : rc2;
}

double kf_mean_kl(const float *logp, const float *logq, int rows, int vocab) {
    double total = 0;
    for (int r = 0; r < rows; r++) {
        const float *p = logp + (size_t)r * vocab, *q = logq + (size_t)r * vocab;
        double kl = 0;
        for (int i = 0; i < vocab; i++)
            if (p[i] > -INFINITY) /* 0 log 0 = 0 */
                kl += exp(p[i]) * ((double)p[i] - q[i]);
        total += kl;
    }
    return rows ? total / rows : 0;
}
