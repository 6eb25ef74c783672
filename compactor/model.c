#include "compactor/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "compactor/fingerprint.h"
#include "compactor/weights.h"
#include "kernels/cpu/cpu_kernels.h"
#include "formats/safetensors.h"

typedef struct {
    void *attn_norm;  /* [hidden] */
    void *wq;         /* [n_heads * head_dim, hidden] */
    void *wk;         /* [kv_heads * head_dim, hidden] */
    void *wv;         /* [kv_heads * head_dim, hidden] */
    void *wo;         /* [hidden, n_heads * head_dim] */
    void *q_norm;     /* [head_dim] (qwen3) */
    void *k_norm;     /* [head_dim] (qwen3) */
    void *mlp_norm;   /* [hidden] */
    void *w_gate;     /* [intermediate, hidden] */
    void *w_up;       /* [intermediate, hidden] */
    void *w_down;     /* [hidden, intermediate] */
} layer_weights;

struct kf_model {
    char *dir;
    kf_hfconfig cfg;
    kf_backend *b;
    kf_st_set st;
    void *embed;       /* [vocab, hidden] */
    void *final_norm;  /* [hidden] */
    void *lm_head;     /* [vocab, hidden]; == embed when tied */
    layer_weights *layers;
    void **allocs;     /* every weight buffer, for kf_model_free */
    int n_allocs;
    int64_t n_params;
    int64_t weight_bytes; /* backend memory of the weight buffers */
    kf_dtype weight_dtype; /* their storage (the backend's at load) */
    double *inv_freq;  /* [head_dim / 2] */
    char fingerprint[33];
    kf_forward_plan *plan; /* the forward's scratch when the caller brings none; grown, freed with the model */
};

static kf_status load_tensor(kf_model *m, const char *name, int64_t d0, int64_t d1, void **out, kf_error *err) {
    const kf_st_tensor *t = kf_st_find(&m->st, name);
    if (!t)
        return kf_fail(err, KF_ERR_FORMAT, "%s: tensor '%s' is missing from the checkpoint", m->dir, name);
    int ndim = d1 ? 2 : 1;
    if (t->ndim != ndim || t->shape[0] != d0 || (ndim == 2 && t->shape[1] != d1)) {
        char got[96] = "";
        size_t o = 0;
        for (int i = 0; i < t->ndim && o < sizeof got - 24; i++)
            o += (size_t)snprintf(got + o, sizeof got - o, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
        if (ndim == 2)
            return kf_fail(err, KF_ERR_FORMAT, "%s: tensor '%s' has shape [%s], config.json implies [%lld, %lld]",
                           m->dir, name, got, (long long)d0, (long long)d1);
        return kf_fail(err, KF_ERR_FORMAT, "%s: tensor '%s' has shape [%s], config.json implies [%lld]", m->dir, name,
                       got, (long long)d0);
    }
    const kf_dtype dt = t->dtype;
    if (dt != KF_DTYPE_BF16 && dt != KF_DTYPE_F16 && dt != KF_DTYPE_F32)
        return kf_fail(err, KF_ERR_UNSUPPORTED, "%s: tensor '%s' has dtype %s (supported: BF16, F16, F32)", m->dir,
                       name, kf_st_dtype_name(dt));
    int is_nan = 0;
    const int64_t bad = kf_st_first_nonfinite(t, &is_nan);
    if (bad >= 0)
        return kf_fail(err, KF_ERR_FORMAT, "%s: tensor '%s' holds %s at element %lld of %lld: the checkpoint is corrupt",
                       m->dir, name, is_nan ? "NaN" : "an infinity", (long long)bad, (long long)t->numel);
    const size_t n = (size_t)t->numel, bytes = n * kf_dtype_size(m->b->weight_dtype);
    void *buf = m->b->alloc(m->b, bytes);
    if (!buf)
        return kf_fail(err, KF_ERR_NOMEM, "%s: out of memory for tensor '%s' (%zu values)", m->dir, name, n);
    m->allocs[m->n_allocs++] = buf;
    m->b->upload_weight(m->b, buf, t->data, dt, n);
    kf_st_release_pages(&m->st, t); /* converted: the file's copy need not stay resident */
    m->n_params += (int64_t)n;
    m->weight_bytes += (int64_t)bytes;
    *out = buf;
    return KF_OK;
}

static kf_status load_weights(kf_model *m, kf_error *err) {
    const kf_hfconfig *c = &m->cfg;
    const int64_t H = c->hidden_size, I = c->intermediate_size, hd = c->head_dim;
    m->layers = calloc((size_t)c->n_layers, sizeof *m->layers);
    m->allocs = calloc((size_t)c->n_layers * 11 + 3, sizeof *m->allocs);
    if (!m->layers || !m->allocs)
        return kf_fail(err, KF_ERR_NOMEM, "%s: out of memory", m->dir);
    KF_TRY(load_tensor(m, "model.embed_tokens.weight", c->vocab_size, H, &m->embed, err));
    KF_TRY(load_tensor(m, "model.norm.weight", H, 0, &m->final_norm, err));
    if (c->tie_word_embeddings)
        m->lm_head = m->embed;
    else
        KF_TRY(load_tensor(m, "lm_head.weight", c->vocab_size, H, &m->lm_head, err));
    char name[128];
    for (int l = 0; l < c->n_layers; l++) {
        layer_weights *w = &m->layers[l];
#define LOAD(field, suffix, d0, d1)                                              \
    do {                                                                         \
        snprintf(name, sizeof name, "model.layers.%d.%s", l, suffix);            \
        KF_TRY(load_tensor(m, name, d0, d1, &w->field, err));                    \
    } while (0)
        LOAD(attn_norm, "input_layernorm.weight", H, 0);
        LOAD(wq, "self_attn.q_proj.weight", c->n_heads * hd, H);
        LOAD(wk, "self_attn.k_proj.weight", c->n_kv_heads * hd, H);
        LOAD(wv, "self_attn.v_proj.weight", c->n_kv_heads * hd, H);
        LOAD(wo, "self_attn.o_proj.weight", H, c->n_heads * hd);
        if (c->has_qk_norm) {
            LOAD(q_norm, "self_attn.q_norm.weight", hd, 0);
            LOAD(k_norm, "self_attn.k_norm.weight", hd, 0);
        }
        LOAD(mlp_norm, "post_attention_layernorm.weight", H, 0);
        LOAD(w_gate, "mlp.gate_proj.weight", I, H);
        LOAD(w_up, "mlp.up_proj.weight", I, H);
        LOAD(w_down, "mlp.down_proj.weight", H, I);
#undef LOAD
    }
    return KF_OK;
}

kf_status kf_model_load(kf_model **out, const char *dir, kf_backend *backend, kf_error *err) {
    return kf_model_load_opts(out, dir, backend, NULL, err);
}

kf_status kf_model_load_opts(kf_model **out, const char *dir, kf_backend *backend, const kf_model_opts *o,
                             kf_error *err) {
    *out = NULL;
    kf_model *m = calloc(1, sizeof *m);
    if (!m)
        return kf_fail(err, KF_ERR_NOMEM, "out of memory");
    m->b = backend;
    m->dir = strdup(dir);
    char *cfg_path = kf_st_dir_file(dir, "config.json");
    kf_status rc = (!m->dir || !cfg_path) ? kf_fail(err, KF_ERR_NOMEM, "out of memory") : KF_OK;
    if (rc == KF_OK)
        rc = kf_hfconfig_load(&m->cfg, cfg_path, err);
    free(cfg_path);
    if (rc == KF_OK && m->cfg.head_dim > KF_MAX_HEAD_DIM)
        rc = kf_fail(err, KF_ERR_UNSUPPORTED, "%s: head_dim %d exceeds the supported %d", dir, m->cfg.head_dim,
                     KF_MAX_HEAD_DIM);
    if (rc == KF_OK)
        rc = kf_st_open_dir(&m->st, dir, err);
    if (rc == KF_OK)
        rc = kf_weights_apply(m->b, &m->st, m->dir, o ? o->weights : KF_WEIGHTS_AUTO, err);
    if (rc == KF_OK) {
        m->weight_dtype = backend->weight_dtype;
        rc = load_weights(m, err);
    }
    if (rc == KF_OK) /* after the shapes: a config of another model is named by its first mismatch */
        rc = kf_checkpoint_check_layers(&m->st, m->cfg.n_layers, m->dir, err);
    if (rc == KF_OK) {
        m->inv_freq = malloc(sizeof(double) * (size_t)(m->cfg.head_dim / 2));
        if (!m->inv_freq) {
            rc = kf_fail(err, KF_ERR_NOMEM, "out of memory");
        } else {
            kf_rope_spec spec = {
                .kind = (kf_rope_kind)m->cfg.rope.type,
                .theta = m->cfg.rope.theta,
                .factor = m->cfg.rope.factor,
                .low_freq_factor = m->cfg.rope.low_freq_factor,
                .high_freq_factor = m->cfg.rope.high_freq_factor,
                .original_max_pos = m->cfg.rope.original_max_position,
            };
            kf_rope_inv_freq(&spec, m->cfg.head_dim, m->inv_freq);
        }
    }
    if (rc != KF_OK) {
        kf_model_free(m);
        return rc;
    }
    *out = m;
    return KF_OK;
}

void kf_model_free(kf_model *m) {
    if (!m)
        return;
    for (int i = 0; i < m->n_allocs; i++)
        m->b->free(m->b, m->allocs[i]);
    free(m->allocs);
    free(m->layers);
    free(m->inv_freq);
    kf_forward_plan_free(m->plan);
    kf_st_close(&m->st);
    free(m->dir);
    free(m);
}

const kf_hfconfig *kf_model_config(const kf_model *m) {
    return &m->cfg;
}

const char *kf_model_dir(const kf_model *m) {
    return m->dir;
}

kf_backend *kf_model_backend(const kf_model *m) {
    return m->b;
}

const double *kf_model_inv_freq(const kf_model *m) {
    return m->inv_freq;
}

int64_t kf_model_n_params(const kf_model *m) {
    return m->n_params;
}

kf_dtype kf_model_weight_dtype(const kf_model *m) {
    return m->weight_dtype;
}

int64_t kf_model_weight_bytes(const kf_model *m) {
    return m->weight_bytes;
}

static void fingerprint_compute(void *ctx, char out[33]) {
    kf_model *m = ctx;
    kf_weights_digest(&m->cfg, &m->st, out);
}

/* Hashing every weight is slow: compactor/fingerprint caches the result per directory. */
const char *kf_model_fingerprint(kf_model *m) {
    if (m->fingerprint[0])
        return m->fingerprint;
    const char **files = malloc(sizeof(char *) * (size_t)(m->st.n_files + 1)); /* [n_files] */
    if (!files) {
        fingerprint_compute(m, m->fingerprint);
        return m->fingerprint;
    }
    for (int i = 0; i < m->st.n_files; i++)
        files[i] = m->st.files[i].path;
    kf_fingerprint_cached(m->dir, files, m->st.n_files, fingerprint_compute, m, m->fingerprint, NULL, NULL);
    free(files);
    return m->fingerprint;
}

kf_status kf_model_arena(const kf_model *m, kf_arena *a, int64_t n_tokens, kf_error *err) {
    return kf_model_arena_dtype(m, a, n_tokens, KF_DTYPE_F32, err);
}

kf_status kf_model_arena_dtype(const kf_model *m, kf_arena *a, int64_t n_tokens, kf_dtype dtype, kf_error *err) {
    return kf_arena_init(a, m->b, m->cfg.n_layers, m->cfg.n_kv_heads, m->cfg.head_dim, kf_pages_for(n_tokens) + 1,
                         dtype, err);
}

/* ---- forward plan --------------------------------------------------------- */

struct kf_forward_plan {
    const kf_model *m; /* the model whose shapes the buffers have */
    kf_backend *b;
    int chunk;        /* tokens per chunk the buffers hold */
    int logit_rows;   /* rows per lm_head batch */
    int64_t allocs;   /* how many times the buffers were (re)allocated */
    float *x;         /* [chunk, hidden] residual stream */
    float *xn;        /* [chunk, hidden] normed */
    float *q;         /* [chunk, n_heads * head_dim] */
    float *k;         /* [chunk, kv_heads * head_dim] */
    float *v;         /* [chunk, kv_heads * head_dim] */
    float *att;       /* [chunk, n_heads * head_dim] */
    float *gate;      /* [chunk, intermediate] */
    float *up;        /* [chunk, intermediate] */
    float *rows;      /* [logit_rows, hidden] gathered final-norm rows */
    float *lbuf;      /* [logit_rows, vocab] */
    int64_t *pos;     /* [chunk] host: RoPE positions of the chunk */
};

size_t kf_forward_plan_bytes(const kf_hfconfig *c, int chunk, int logit_rows) {
    logit_rows = logit_rows < KF_PLAN_LOGIT_ROWS ? logit_rows : KF_PLAN_LOGIT_ROWS;
    const size_t QD = (size_t)c->n_heads * c->head_dim, KD = (size_t)c->n_kv_heads * c->head_dim;
    const size_t per_tok = 2 * (size_t)c->hidden_size + 2 * QD + 2 * KD + 2 * (size_t)c->intermediate_size;
    return sizeof(float) * ((size_t)chunk * per_tok + (size_t)logit_rows * ((size_t)c->hidden_size + c->vocab_size)) +
           sizeof(int64_t) * (size_t)chunk;
}

static void plan_free_bufs(kf_backend *b, float **const *bufs, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (*bufs[i]) {
            b->free(b, *bufs[i]);
            *bufs[i] = NULL;
        }
}

static void plan_release(kf_forward_plan *p) {
    float **const chunk_bufs[] = {&p->x, &p->xn, &p->q, &p->k, &p->v, &p->att, &p->gate, &p->up};
    float **const logit_bufs[] = {&p->rows, &p->lbuf};
    plan_free_bufs(p->b, chunk_bufs, 8);
    plan_free_bufs(p->b, logit_bufs, 2);
    free(p->pos);
    p->pos = NULL;
    p->chunk = p->logit_rows = 0;
}

/* Room for chunks of `chunk` tokens: reallocated only when it grows. */
static kf_status plan_reserve_chunk(kf_forward_plan *p, const kf_hfconfig *c, int chunk, kf_error *err) {
    if (chunk <= p->chunk)
        return KF_OK;
    kf_backend *b = p->b;
    float **const bufs[] = {&p->x, &p->xn, &p->q, &p->k, &p->v, &p->att, &p->gate, &p->up};
    plan_free_bufs(b, bufs, 8);
    free(p->pos);
    p->chunk = 0;
    const size_t C = (size_t)chunk;
    const size_t QD = (size_t)c->n_heads * c->head_dim, KD = (size_t)c->n_kv_heads * c->head_dim;
    const size_t width[8] = {c->hidden_size, c->hidden_size, QD, KD, KD, QD, c->intermediate_size,
                             c->intermediate_size};
    int ok = (p->pos = malloc(sizeof(int64_t) * C)) != NULL;
    for (int i = 0; i < 8; i++)
        ok &= (*bufs[i] = b->alloc(b, C * width[i] * sizeof(float))) != NULL;
    p->allocs++;
    if (!ok) {
        plan_release(p);
        return kf_fail(err, KF_ERR_NOMEM, "out of memory for the forward plan (chunk %d: %zu bytes)", chunk,
                       kf_forward_plan_bytes(c, chunk, 0));
    }
    p->chunk = chunk;
    return KF_OK;
}

/* Room for lm_head batches of `rows` rows: reallocated only when it grows. */
static kf_status plan_reserve_logits(kf_forward_plan *p, const kf_hfconfig *c, int rows, kf_error *err) {
    if (rows <= p->logit_rows)
        return KF_OK;
    kf_backend *b = p->b;
    float **const bufs[] = {&p->rows, &p->lbuf};
    plan_free_bufs(b, bufs, 2);
    p->logit_rows = 0;
    p->rows = b->alloc(b, (size_t)rows * c->hidden_size * sizeof(float));
    p->lbuf = b->alloc(b, (size_t)rows * c->vocab_size * sizeof(float));
    p->allocs++;
    if (!p->rows || !p->lbuf) {
        plan_release(p);
        return kf_fail(err, KF_ERR_NOMEM, "out of memory for the forward plan (%d logit rows of %d)", rows,
                       c->vocab_size);
    }
    p->logit_rows = rows;
    return KF_OK;
}

static kf_status plan_reserve(kf_forward_plan *p, const kf_hfconfig *c, int chunk, int logit_rows, kf_error *err) {
    KF_TRY(plan_reserve_chunk(p, c, chunk, err));
    return plan_reserve_logits(p, c, logit_rows < KF_PLAN_LOGIT_ROWS ? logit_rows : KF_PLAN_LOGIT_ROWS, err);
}

kf_status kf_forward_plan_create(kf_forward_plan **out, kf_model *m, int chunk, int logit_rows, kf_error *err) {
    *out = NULL;
    if (chunk < 0 || logit_rows < 0)
        return kf_fail(err, KF_ERR_INVALID, "forward plan: negative chunk (%d) or logit rows (%d)", chunk, logit_rows);
    kf_forward_plan *p = calloc(1, sizeof *p);
    if (!p)
        return kf_fail(err, KF_ERR_NOMEM, "out of memory");
    p->m = m;
    p->b = m->b;
    kf_status rc = plan_reserve(p, &m->cfg, chunk, logit_rows, err);
    if (rc != KF_OK) {
        free(p);
        return rc;
    }
    *out = p;
    return KF_OK;
}

void kf_forward_plan_free(kf_forward_plan *p) {
    if (!p)
        return;
    plan_release(p);
    free(p);
}

size_t kf_forward_plan_size(const kf_forward_plan *p, const kf_model *m) {
    return p && p->chunk ? kf_forward_plan_bytes(&m->cfg, p->chunk, p->logit_rows) : 0;
}

int64_t kf_forward_plan_allocs(const kf_forward_plan *p) {
    return p ? p->allocs : 0;
}

const kf_forward_plan *kf_model_plan(const kf_model *m) {
    return m->plan;
}

/* ---- forward ------------------------------------------------------------- */

/* Download rows of src ([chunk, width]) that fall in [c0, c0 + n) into dst[capture index]. */
static void capture(kf_backend *b, float *dst, const float *src, int width, const int32_t *rows, int n_rows, int c0,
                    int n) {
    if (!dst)
        return;
    for (int r = 0; r < n_rows; r++)
        if (rows[r] >= c0 && rows[r] < c0 + n)
            b->download(b, dst + (size_t)r * width, src + (size_t)(rows[r] - c0) * width, sizeof(float) * width);
}

/* Layer l's queries q [chunk, nh * hd] of the capture rows in [c0, c0 + n), at the caller's strides. */
static void capture_queries(kf_backend *b, const kf_forward_args *args, int l, const float *q, int nh, int hd, int c0,
                            int n) {
    float *dst = args->queries ? args->queries[l] : NULL;
    uint16_t *dsth = args->queries_bf16 ? args->queries_bf16[l] : NULL;
    const size_t hs = args->queries_head_stride ? args->queries_head_stride : (size_t)hd;
    const size_t rs = args->queries_row_stride ? args->queries_row_stride : (size_t)nh * hd;
    if (!dst && !dsth)
        return;
    float tmp[256];
    for (int r = 0; r < args->n_capture_rows; r++) {
        const int row = args->capture_rows[r];
        if (row < c0 || row >= c0 + n)
            continue;
        const float *src = q + (size_t)(row - c0) * nh * hd;
        if (dsth) { /* through a host buffer, 256 values at a time */
            for (int h = 0; h < nh; h++)
                for (int e0 = 0; e0 < hd; e0 += 256) {
                    const int k = hd - e0 < 256 ? hd - e0 : 256;
                    b->download(b, tmp, src + (size_t)h * hd + e0, sizeof(float) * k);
                    for (int e = 0; e < k; e++)
                        dsth[(size_t)r * rs + (size_t)h * hs + e0 + e] = kf_f32_to_bf16(tmp[e]);
                }
            continue;
        }
        if (hs == (size_t)hd) {
            b->download(b, dst + (size_t)r * rs, src, sizeof(float) * nh * hd);
            continue;
        }
        for (int h = 0; h < nh; h++)
            b->download(b, dst + (size_t)r * rs + (size_t)h * hs, src + (size_t)h * hd, sizeof(float) * hd);
    }
}

int kf_model_targets_supported(const kf_model *m, const kf_forward_args *args) {
    const int quoka = args->quoka && args->quoka->mode == KF_PREFILL_QUOKA;
    return m->b->attn_targets && !quoka && !args->key_bias;
}

static kf_status check_targets(const kf_model *m, const kf_seq *seq, const kf_forward_args *args, kf_error *err) {
    const kf_forward_targets *t = args->targets;
    if (!kf_model_targets_supported(m, args))
        return kf_fail(err, KF_ERR_UNSUPPORTED,
                       "forward: the %s backend cannot give AM's targets with these arguments (QUOKA or key bias)",
                       m->b->name);
    if (t->blk0 < 0 || t->blk1 <= t->blk0 || t->blk1 > seq->len)
        return kf_fail(err, KF_ERR_INVALID,
                       "forward: the targets' block [%d, %d) is not within the %lld keys before the call", t->blk0,
                       t->blk1, (long long)seq->len);
    if (!t->m || !t->y || !t->Y || !t->score)
        return kf_fail(err, KF_ERR_INVALID, "forward: targets requested without their buffers");
    if (t->app0 > 0 && (t->app0 < t->blk1 || t->app0 > seq->len || (t->app_slot && (!t->am || !t->ay || !t->aY))))
        return kf_fail(err, KF_ERR_INVALID, "forward: own prompts from key %d need buffers, and to start after "
                       "the block's end %d, within the %lld keys before the call", t->app0, t->blk1, (long long)seq->len);
    for (int i = 1; i < args->n_capture_rows; i++)
        if (args->capture_rows[i] <= args->capture_rows[i - 1])
            return kf_fail(err, KF_ERR_INVALID, "forward: targets need ascending capture rows (row %d)", i);
    return KF_OK;
}

/* Layer l's targets of the captured rows in the chunk's tokens [c0, c0 + n), into *t; NULL when
 * the call asks for none. */
static const kf_attn_targets *chunk_targets(const kf_forward_args *args, int l, int c0, int n, int hd,
                                           kf_attn_targets *t) {
    const kf_forward_targets *ft = args->targets;
    if (!ft)
        return NULL;
    int k0 = 0, k1;
    while (k0 < args->n_capture_rows && args->capture_rows[k0] < c0)
        k0++;
    for (k1 = k0; k1 < args->n_capture_rows && args->capture_rows[k1] < c0 + n;)
        k1++;
    const size_t at = (size_t)k0 * ft->row_stride;
    *t = (kf_attn_targets){.blk0 = ft->blk0, .blk1 = ft->blk1, .rows = args->capture_rows + k0, .n_rows = k1 - k0,
                           .row_base = c0, .m = ft->m[l] + at, .y = ft->y[l] + at, .Y = ft->Y[l] + at * hd,
                           .row_stride = ft->row_stride, .head_stride = ft->head_stride, .score = ft->score[l],
                           .score_stride = ft->score_stride, .score_rms = ft->score_rms};
    if (ft->app0 > 0)
        t->app0 = ft->app0, t->app_slot = ft->app_slot ? ft->app_slot + k0 : NULL, t->am = ft->am ? ft->am[l] : NULL,
        t->ay = ft->ay ? ft->ay[l] : NULL, t->aY = ft->aY ? ft->aY[l] : NULL, t->app_head_stride = ft->app_head_stride;
    return t;
}

static kf_status check_args(const kf_model *m, const kf_arena *a, const kf_seq *seq, const kf_forward_args *args,
                            kf_error *err) {
    const kf_hfconfig *c = &m->cfg;
    if (a->n_layers != c->n_layers || a->kv_heads != c->n_kv_heads || a->head_dim != c->head_dim)
        return kf_fail(err, KF_ERR_INVALID, "forward: the KV arena is shaped for another model");
    if (args->n_tokens < 0 || (args->n_tokens > 0 && !args->ids))
        return kf_fail(err, KF_ERR_INVALID, "forward: no tokens given");
    for (int i = 0; i < args->n_tokens; i++)
        if (args->ids[i] < 0 || args->ids[i] >= c->vocab_size)
            return kf_fail(err, KF_ERR_INVALID, "forward: token %d has id %d, outside the vocabulary [0, %d)", i,
                           args->ids[i], c->vocab_size);
    if (seq->len + args->pos_offset < 0)
        return kf_fail(err, KF_ERR_INVALID, "forward: negative RoPE position");
    for (int i = 0; i < args->n_logit_rows; i++)
        if (args->logit_rows[i] < 0 || args->logit_rows[i] >= args->n_tokens)
            return kf_fail(err, KF_ERR_INVALID, "forward: logit row %d outside the %d input tokens",
                           args->logit_rows[i], args->n_tokens);
    for (int i = 0; i < args->n_capture_rows; i++)
        if (args->capture_rows[i] < 0 || args->capture_rows[i] >= args->n_tokens)
            return kf_fail(err, KF_ERR_INVALID, "forward: capture row %d outside the %d input tokens",
                           args->capture_rows[i], args->n_tokens);
    if (args->n_logit_rows > 0 && !args->logits)
        return kf_fail(err, KF_ERR_INVALID, "forward: logit rows requested without an output buffer");
    if (args->chunk < 0)
        return kf_fail(err, KF_ERR_INVALID, "forward: negative chunk size");
    if (args->quoka)
        KF_TRY(kf_quoka_params_check(args->quoka, err));
    if (args->targets)
        KF_TRY(check_targets(m, seq, args, err));
    return KF_OK;
}

/* Final norm + lm_head for the requested rows that fall in this chunk, p->logit_rows at a time. */
static void chunk_logits(kf_model *m, kf_forward_plan *p, const kf_forward_args *args, int c0, int n) {
    kf_backend *b = m->b;
    const kf_hfconfig *c = &m->cfg;
    const int H = c->hidden_size, V = c->vocab_size;
    int idx[KF_PLAN_LOGIT_ROWS];
    int k = 0;
    for (int r = 0; r <= args->n_logit_rows; r++) {
        const int last = r == args->n_logit_rows;
        if (!last && args->logit_rows[r] >= c0 && args->logit_rows[r] < c0 + n) {
            b->rmsnorm(b, p->rows + (size_t)k * H, H, p->x + (size_t)(args->logit_rows[r] - c0) * H, H, m->final_norm,
                       1, H, (float)c->rms_eps);
            idx[k++] = r;
        }
        if (k == p->logit_rows || (last && k > 0)) {
            b->matmul(b, p->lbuf, V, p->rows, H, m->lm_head, k, V, H, 0);
            for (int i = 0; i < k; i++)
                b->download(b, args->logits + (size_t)idx[i] * V, p->lbuf + (size_t)i * V, sizeof(float) * V);
            k = 0;
        }
    }
}

/* Where one chunk sits: tokens [c0, c0 + n) of the call, keys before it `start`. */
typedef struct {
    int c0, n;
    int64_t start;
} chunk_span;

/* 1 when layer l's output (the residual stream after it) is read: by a later layer, the final
 * hidden capture or the logits. Else only its queries, K/V and attention targets are (the
 * sources of reference queries, a prefill that returns no logits). */
static int layer_output_read(const kf_model *m, const kf_forward_args *args, int l) {
    const int L = m->cfg.n_layers;
    return l + 1 < L || (args->hidden && args->hidden[L]) || args->n_logit_rows > 0;
}

/* One decoder layer on the chunk in p->x (residual stream, updated in place; left as it was when
 * the layer's output is never read: no attention output, o_proj or MLP then, only the queries'
 * capture, the K/V store and, when asked, the attention's targets). */
static void layer_forward(kf_model *m, kf_forward_plan *p, kf_arena *a, const kf_seq *seq, const kf_forward_args *args,
                          kf_quoka_ws *qws, int l, chunk_span cs) {
    kf_backend *b = m->b;
    const kf_hfconfig *c = &m->cfg;
    const int H = c->hidden_size, I = c->intermediate_size, hd = c->head_dim;
    const int nh = c->n_heads, kvh = c->n_kv_heads, QD = nh * hd, KD = kvh * hd, n = cs.n;
    const float eps = (float)c->rms_eps;
    const layer_weights *w = &m->layers[l];
    b->rmsnorm(b, p->xn, H, p->x, H, w->attn_norm, n, H, eps);
    b->matmul(b, p->q, QD, p->xn, H, w->wq, n, QD, H, 0);
    b->matmul(b, p->k, KD, p->xn, H, w->wk, n, KD, H, 0);
    b->matmul(b, p->v, KD, p->xn, H, w->wv, n, KD, H, 0);
    if (c->has_qk_norm) {
        b->rmsnorm(b, p->q, hd, p->q, hd, w->q_norm, n * nh, hd, eps);
        b->rmsnorm(b, p->k, hd, p->k, hd, w->k_norm, n * kvh, hd, eps);
    }
    b->rope(b, p->q, QD, n, nh, hd, p->pos, m->inv_freq);
    b->rope(b, p->k, KD, n, kvh, hd, p->pos, m->inv_freq);
    if (args->queries || args->queries_bf16)
        capture_queries(b, args, l, p->q, nh, hd, cs.c0, n);

    const kf_paged_kv kv = kf_arena_layer(a, l);
    b->kv_store(b, &kv, seq->pages, cs.start, n, p->k, p->v);
    kf_attn_args at = {
        .q = p->q, .q_stride = QD, .out = p->att, .out_stride = QD,
        .n_q = n, .n_heads = nh, .n_keys = (int)(cs.start + n),
        .pages = seq->pages, .kv = kv, .scale = 1.0f / sqrtf((float)hd),
        .bias = args->key_bias ? args->key_bias[l] : NULL,
        .bias_stride = (size_t)args->key_bias_len, .bias_len = args->key_bias_len,
    };
    kf_attn_targets tg;
    at.targets = chunk_targets(args, l, cs.c0, n, hd, &tg);
    const int out_read = layer_output_read(m, args, l);
    if (!out_read && !at.targets)
        return;
    if (qws->idx)
        kf_quoka_attention(qws, &at);
    else
        b->attention(b, &at);
    if (!out_read)
        return;
    b->matmul(b, p->x, H, p->att, QD, w->wo, n, H, QD, 1); /* x += att Wo^T */

    b->rmsnorm(b, p->xn, H, p->x, H, w->mlp_norm, n, H, eps);
    b->matmul(b, p->gate, I, p->xn, H, w->w_gate, n, I, H, 0);
    b->matmul(b, p->up, I, p->xn, H, w->w_up, n, I, H, 0);
    b->silu_mul(b, p->gate, p->up, n, I);
    b->matmul(b, p->x, H, p->gate, I, w->w_down, n, H, I, 1); /* x += mlp */
}

/* After the last layer, the chunk's residual stream in p->x: the final-norm hidden capture and logits. */
static void chunk_finish(kf_model *m, kf_forward_plan *p, const kf_forward_args *args, chunk_span cs) {
    kf_backend *b = m->b;
    const kf_hfconfig *c = &m->cfg;
    const int H = c->hidden_size, L = c->n_layers;
    if (args->hidden && args->hidden[L]) {
        b->rmsnorm(b, p->xn, H, p->x, H, m->final_norm, cs.n, H, (float)c->rms_eps);
        capture(b, args->hidden[L], p->xn, H, args->capture_rows, args->n_capture_rows, cs.c0, cs.n);
    }
    if (args->n_logit_rows > 0)
        chunk_logits(m, p, args, cs.c0, cs.n);
}

/* One chunk through every layer, its captures and logits. */
static void chunk_forward(kf_model *m, kf_forward_plan *p, kf_arena *a, const kf_seq *seq,
                          const kf_forward_args *args, kf_quoka_ws *qws, chunk_span cs) {
    kf_backend *b = m->b;
    const kf_hfconfig *c = &m->cfg;
    const int H = c->hidden_size, L = c->n_layers, nc = args->n_capture_rows;
    const int32_t *cr = args->capture_rows;
    for (int i = 0; i < cs.n; i++)
        p->pos[i] = cs.start + i + args->pos_offset;
    b->embed(b, p->x, m->embed, args->ids + cs.c0, cs.n, H);
    if (args->hidden)
        capture(b, args->hidden[0], p->x, H, cr, nc, cs.c0, cs.n);
    for (int l = 0; l < L; l++) {
        layer_forward(m, p, a, seq, args, qws, l, cs);
        if (args->hidden && l + 1 < L)
            capture(b, args->hidden[l + 1], p->x, H, cr, nc, cs.c0, cs.n);
    }
    chunk_finish(m, p, args, cs);
}

/* The plan a forward runs with: the caller's, else the model's own (made at its first use). */
static kf_status forward_plan(kf_model *m, kf_forward_plan *given, kf_forward_plan **out, kf_error *err) {
    if (!given && !m->plan)
        KF_TRY(kf_forward_plan_create(&m->plan, m, 0, 0, err));
    *out = given ? given : m->plan;
    if ((*out)->m != m)
        return kf_fail(err, KF_ERR_INVALID, "forward: the plan was made for another model");
    return KF_OK;
}

/* Tokens per chunk of a call. */
static int forward_chunk(const kf_forward_args *args) {
    const int want = args->chunk > 0 ? args->chunk : KF_DEFAULT_CHUNK;
    return want < args->n_tokens ? want : args->n_tokens;
}

kf_status kf_model_forward(kf_model *m, kf_arena *a, kf_seq *seq, const kf_forward_args *args, kf_error *err) {
    KF_TRY(check_args(m, a, seq, args, err));
    if (args->n_tokens == 0)
        return KF_OK;
    kf_backend *b = m->b;
    const int chunk = forward_chunk(args);
    kf_forward_plan *p;
    KF_TRY(forward_plan(m, args->plan, &p, err));
    KF_TRY(plan_reserve(p, &m->cfg, chunk, args->n_logit_rows, err));
    KF_TRY(kf_seq_reserve(a, seq, args->n_tokens, err));
    kf_quoka_ws qws;
    KF_TRY(kf_quoka_ws_init(&qws, b, args->quoka, m->cfg.n_kv_heads, seq->len + args->n_tokens, err));
    kf_status rc = KF_OK;
    for (int c0 = 0; c0 < args->n_tokens; c0 += chunk) {
        const chunk_span cs = {.c0 = c0, .n = args->n_tokens - c0 < chunk ? args->n_tokens - c0 : chunk,
                               .start = seq->len};
        chunk_forward(m, p, a, seq, args, &qws, cs);
        if (b->take_error(b)) {
            rc = kf_fail(err, KF_ERR_NOMEM, "forward: the %s backend ran out of memory at tokens [%lld, %lld)", b->name,
                         (long long)cs.start, (long long)(cs.start + cs.n));
            break;
        }
        seq->len = cs.start + cs.n;
        if (args->progress)
            args->progress(args->progress_ctx, c0 + cs.n, args->n_tokens);
    }
    kf_quoka_ws_free(&qws);
    return rc;
}

/* ---- layer-major forward (kf_model_forward_layers) ----------------------- */

/* One pass's state between layers. */
typedef struct {
    float *x;          /* [n_tokens, hidden] backend memory: the pass's residual stream after the last layer run */
    kf_quoka_ws qws;
    int chunk;
    int64_t start;     /* seq->len before the call */
    int ready;         /* qws initialised */
} pass_state;

static void pass_state_free(kf_backend *b, pass_state *st) {
    if (st->x)
        b->free(b, st->x);
    if (st->ready)
        kf_quoka_ws_free(&st->qws);
    memset(st, 0, sizeof *st);
}

/* Pages, residual stream (the embeddings, hidden[0] captured) and QUOKA workspace of one pass. */
static kf_status pass_init(kf_model *m, kf_arena *a, const kf_forward_pass *ps, pass_state *st, kf_error *err) {
    kf_backend *b = m->b;
    const kf_forward_args *args = ps->args;
    const int H = m->cfg.hidden_size;
    st->chunk = forward_chunk(args);
    st->start = ps->seq->len;
    KF_TRY(kf_seq_reserve(a, ps->seq, args->n_tokens, err));
    KF_TRY(kf_quoka_ws_init(&st->qws, b, args->quoka, m->cfg.n_kv_heads, st->start + args->n_tokens, err));
    st->ready = 1;
    if (!(st->x = b->alloc(b, sizeof(float) * (size_t)args->n_tokens * H)))
        return kf_fail(err, KF_ERR_NOMEM, "forward: out of memory for the residual stream of %d tokens",
                       args->n_tokens);
    b->embed(b, st->x, m->embed, args->ids, args->n_tokens, H);
    if (args->hidden)
        capture(b, args->hidden[0], st->x, H, args->capture_rows, args->n_capture_rows, 0, args->n_tokens);
    return KF_OK;
}

/* Layer l on every chunk of one pass, exactly the chunks kf_model_forward runs: each chunk's rows of
 * the residual stream through the plan's p->x, its captures, after the last layer its logits. */
static void pass_layer(kf_model *m, kf_forward_plan *p, kf_arena *a, const kf_forward_pass *ps, pass_state *st,
                       int l) {
    kf_backend *b = m->b;
    const kf_forward_args *args = ps->args;
    const int H = m->cfg.hidden_size, L = m->cfg.n_layers;
    for (int c0 = 0; c0 < args->n_tokens; c0 += st->chunk) {
        const chunk_span cs = {.c0 = c0, .n = args->n_tokens - c0 < st->chunk ? args->n_tokens - c0 : st->chunk,
                               .start = st->start + c0};
        float *xs = st->x + (size_t)c0 * H; /* [cs.n, H] */
        for (int i = 0; i < cs.n; i++)
            p->pos[i] = cs.start + i + args->pos_offset;
        b->copy(b, p->x, xs, sizeof(float) * (size_t)cs.n * H);
        layer_forward(m, p, a, ps->seq, args, &st->qws, l, cs);
        if (args->hidden && l + 1 < L)
            capture(b, args->hidden[l + 1], p->x, H, args->capture_rows, args->n_capture_rows, cs.c0, cs.n);
        if (l + 1 == L)
            chunk_finish(m, p, args, cs);
        else
            b->copy(b, xs, p->x, sizeof(float) * (size_t)cs.n * H);
        if (args->progress) /* the pass's tokens through the layers so far */
            args->progress(args->progress_ctx, (int64_t)args->n_tokens * l + c0 + cs.n, (int64_t)args->n_tokens * L);
    }
}

static double wall_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Layer l of every pass in turn, then the caller's hook. */
static kf_status run_layer(kf_model *m, kf_forward_plan *p, kf_arena *a, const kf_forward_pass *passes, int n,
                           pass_state *st, int l, const kf_layer_hook *hook, kf_error *err) {
    kf_backend *b = m->b;
    if (hook && hook->before_layer)
        KF_TRY(hook->before_layer(hook->ctx, l, err));
    for (int i = 0; i < n; i++) {
        const kf_forward_args *args = passes[i].args;
        if (args->n_tokens == 0)
            continue;
        const double t0 = wall_s();
        pass_layer(m, p, a, &passes[i], &st[i], l);
        if (b->take_error(b))
            return kf_fail(err, KF_ERR_NOMEM, "forward: the %s backend ran out of memory at layer %d of pass %d",
                           b->name, l, i);
        if (hook && hook->pass_s)
            hook->pass_s[i] += wall_s() - t0;
    }
    return hook && hook->on_layer ? hook->on_layer(hook->ctx, l, err) : KF_OK;
}

kf_status kf_model_forward_layers(kf_model *m, kf_arena *a, const kf_forward_pass *passes, int n,
                                  const kf_layer_hook *hook, kf_error *err) {
    int chunk = 0, logit_rows = 0;
    for (int i = 0; i < n; i++) {
        KF_TRY(check_args(m, a, passes[i].seq, passes[i].args, err));
        if (passes[i].args->plan != passes[0].args->plan)
            return kf_fail(err, KF_ERR_INVALID, "forward: the passes of a layer-major forward share one plan");
        chunk = forward_chunk(passes[i].args) > chunk ? forward_chunk(passes[i].args) : chunk;
        logit_rows = passes[i].args->n_logit_rows > logit_rows ? passes[i].args->n_logit_rows : logit_rows;
    }
    kf_forward_plan *p;
    KF_TRY(forward_plan(m, n > 0 ? passes[0].args->plan : NULL, &p, err));
    KF_TRY(plan_reserve(p, &m->cfg, chunk, logit_rows, err));
    pass_state *st = calloc((size_t)(n ? n : 1), sizeof *st);
    kf_status rc = st ? KF_OK : kf_fail(err, KF_ERR_NOMEM, "forward: out of memory");
    for (int i = 0; i < n && rc == KF_OK; i++)
        if (passes[i].args->n_tokens > 0)
            rc = pass_init(m, a, &passes[i], &st[i], err);
    for (int l = 0; l < m->cfg.n_layers && rc == KF_OK; l++)
        rc = run_layer(m, p, a, passes, n, st, l, hook, err);
    for (int i = 0; i < n && st; i++) {
        if (rc == KF_OK)
            passes[i].seq->len += passes[i].args->n_tokens;
        pass_state_free(m->b, &st[i]);
    }
    free(st);
    return rc;
}
