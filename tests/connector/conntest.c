/* conntest.c — test-only helpers for the connector's pytest suite, loaded with ctypes: compaction
 * of a document into a kvf file (until `kvfold compact` exists) and question logits computed by
 * kvfold's own paged engine on top of a cache given as K/V arrays. Return 0 or a kf_status with
 * the message in err. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compactor/compact.h"
#include "formats/kvf.h"
#include "kernels/base/convert.h"

typedef struct {
    kf_backend *b;
    kf_model *m;
} kfct_model;

static int fail(const kf_error *e, kf_status st, char *err, int errlen) {
    snprintf(err, (size_t)errlen, "%s", e->msg);
    return (int)st;
}

void *kfct_model_load(const char *dir, char *err, int errlen) {
    kfct_model *h = calloc(1, sizeof *h);
    kf_error e = {0};
    if (!h)
        return NULL;
    h->b = kf_backend_cpu_create();
    if (kf_model_load(&h->m, dir, h->b, &e) != KF_OK) {
        snprintf(err, (size_t)errlen, "%s", e.msg);
        h->b->destroy(h->b);
        free(h);
        return NULL;
    }
    return h;
}

void kfct_model_free(void *p) {
    kfct_model *h = p;
    if (!h)
        return;
    kf_model_free(h->m);
    h->b->destroy(h->b);
    free(h);
}

/* out: n_layers, kv_heads, head_dim, vocab */
void kfct_model_shape(void *p, int *out) {
    const kf_hfconfig *c = kf_model_config(((kfct_model *)p)->m);
    out[0] = c->n_layers;
    out[1] = c->n_kv_heads;
    out[2] = c->head_dim;
    out[3] = c->vocab_size;
}

const char *kfct_model_fingerprint(void *p) {
    return kf_model_fingerprint(((kfct_model *)p)->m);
}

/* kf_compact of doc (no prefix or suffix) with the repeat instruction; the result stays in memory. */
void *kfct_compact(void *p, const int32_t *doc, int n_doc, const int32_t *instr, int n_instr, const char *method,
                   double budget, int64_t *C_out, char *err, int errlen) {
    kfct_model *h = p;
    kf_compact_params cp = kf_compact_params_default();
    if (kf_method_parse(method, &cp.method) != 0) {
        snprintf(err, (size_t)errlen, "unknown method %s", method);
        return NULL;
    }
    cp.budget = budget;
    cp.repeat_instruction = (kf_prompt){instr, n_instr};
    cp.solver.max_queries = 2000;
    kf_compacted *c = calloc(1, sizeof *c);
    kf_prompt d = {doc, n_doc};
    kf_error e = {0};
    if (!c || kf_compact(h->m, NULL, &d, NULL, &cp, c, &e) != KF_OK) {
        snprintf(err, (size_t)errlen, "%s", e.msg);
        free(c);
        return NULL;
    }
    *C_out = c->C;
    return c;
}

void kfct_compacted_free(void *p) {
    if (p)
        kf_compacted_free(p);
    free(p);
}

/* Writes the cache as a kvf file in dtype ("bfloat16", "float16", "float32"). */
int kfct_compacted_write(void *pm, void *pc, const int32_t *doc, int n_doc, const char *dtype, const char *path,
                         char *err, int errlen) {
    kfct_model *h = pm;
    const kf_compacted *c = pc;
    kvf_cache k = {0};
    kf_error e = {0};
    kvf_header_init(&k.hdr);
    snprintf(k.hdr.model_fingerprint, sizeof k.hdr.model_fingerprint, "%s", kf_model_fingerprint(h->m));
    kvf_document_digest(doc, n_doc, k.hdr.document_digest);
    k.hdr.n_doc_tokens = c->D;
    k.hdr.n_tokens = c->C;
    k.hdr.method = (kf_method)c->method; /* same order: keep, drop, am, fold */
    k.hdr.budget = c->budget;
    k.hdr.lambda = c->method == KF_METHOD_FOLD ? c->lambda_rel : 0;
    k.hdr.rope_frame = c->rotated ? KVF_FRAME_COMPACTED : KVF_FRAME_ORIGINAL;
    if (kvf_dtype_parse(dtype, &k.hdr.dtype) != 0) {
        snprintf(err, (size_t)errlen, "unknown dtype %s", dtype);
        return KF_ERR_INVALID;
    }
    k.hdr.n_layers = c->n_layers;
    k.hdr.kv_heads = c->kv_heads;
    k.hdr.head_dim = c->head_dim;
    k.keys = c->keys;
    k.values = c->values;
    k.beta = c->beta;
    k.u = c->u;
    k.positions = c->positions;
    kf_status st = kvf_write(path, &k, &e);
    return st == KF_OK ? 0 : fail(&e, st, err, errlen);
}

/* Logits [nq, vocab] of question q at positions C, C+1, ... on top of a cache of C slots. */
static int question_logits(kfct_model *h, const kf_compacted *c, const int32_t *q, int nq, float *logits, char *err,
                           int errlen) {
    kf_arena a;
    kf_seq seq;
    kf_error e = {0};
    kf_status st = kf_model_arena(h->m, &a, c->C + nq, &e);
    if (st != KF_OK)
        return fail(&e, st, err, errlen);
    if ((st = kf_compacted_attach(c, &a, &seq, &e)) != KF_OK) {
        kf_arena_free(&a);
        return fail(&e, st, err, errlen);
    }
    int32_t *rows = malloc(sizeof(int32_t) * (size_t)nq);
    for (int i = 0; i < nq; i++)
        rows[i] = i;
    kf_forward_args fa = {.ids = q, .n_tokens = nq, .logit_rows = rows, .n_logit_rows = nq, .logits = logits};
    st = kf_model_forward(h->m, &a, &seq, &fa, &e);
    free(rows);
    kf_seq_release(&a, &seq);
    kf_arena_free(&a);
    return st == KF_OK ? 0 : fail(&e, st, err, errlen);
}

/* The compactor's own evaluation: the in-memory cache, its K/V first rounded to round_dtype
 * ("float32": as is) as a KV cache of that dtype would hold them. */
int kfct_compacted_logits(void *pm, void *pc, const char *round_dtype, const int32_t *q, int nq, float *logits,
                          char *err, int errlen) {
    const kf_compacted *c = pc;
    kf_dtype d;
    if (kvf_dtype_parse(round_dtype, &d) != 0) {
        snprintf(err, (size_t)errlen, "unknown dtype %s", round_dtype);
        return KF_ERR_INVALID;
    }
    const size_t n = (size_t)c->n_layers * c->C * c->kv_heads * c->head_dim;
    kf_compacted r = *c;
    r.keys = malloc(n * sizeof(float));
    r.values = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) {
        float k = c->keys[i], v = c->values[i];
        if (d == KF_DTYPE_BF16) {
            k = kf_bf16_to_f32(kf_f32_to_bf16(k));
            v = kf_bf16_to_f32(kf_f32_to_bf16(v));
        } else if (d == KF_DTYPE_F16) {
            k = kf_f16_to_f32(kf_f32_to_f16(k));
            v = kf_f16_to_f32(kf_f32_to_f16(v));
        }
        r.keys[i] = k;
        r.values[i] = v;
    }
    int rc = question_logits(pm, &r, q, nq, logits, err, errlen);
    free(r.keys);
    free(r.values);
    return rc;
}

/* kvfold's engine on a cache given as arrays keys, values [n_layers, C, kv_heads, head_dim] fp32
 * (gathered back from paged blocks), in the compacted frame. */
int kfct_kv_logits(void *pm, const float *keys, const float *values, int64_t C, const int32_t *q, int nq,
                   float *logits, char *err, int errlen) {
    const kf_hfconfig *cfg = kf_model_config(((kfct_model *)pm)->m);
    kf_compacted c = {.n_layers = cfg->n_layers, .kv_heads = cfg->n_kv_heads, .head_dim = cfg->head_dim, .D = C,
                      .C = C, .method = KF_METHOD_FOLD, .rotated = 1, .keys = (float *)keys,
                      .values = (float *)values};
    return question_logits(pm, &c, q, nq, logits, err, errlen);
}
