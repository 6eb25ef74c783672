/* model.h — a Qwen3 / Llama 3 decoder: weights from a Hugging Face directory and a chunked
 * forward pass that writes K/V into the paged arena.
 *
 * Loading: config.json (formats/hfconfig) and model.safetensors or its sharded index
 * (formats/safetensors). Every expected tensor must be present with the shape the config
 * implies and a dtype of BF16, F16 or F32; weights are converted once into the weight dtype
 * (kf_weights below): on the CPU bf16 for a bf16 checkpoint (2 bytes per parameter, widened to
 * fp32 tile by tile in the GEMMs: exact, the activations stay fp32), else fp32 (4 bytes).
 *
 * The forward pass appends tokens to a document (kf_seq) in chunks (default 512 tokens).
 * Token i of the call has RoPE position seq->len + i + pos_offset (pos_offset != 0 places
 * tokens in the AM frame on top of a compacted cache). It returns, on request:
 *   - logits of chosen rows,
 *   - each layer's queries at chosen rows: after q_norm (Qwen3) and RoPE, unscaled,
 *   - hidden states at chosen rows, as transformers reports them: hidden[0] the embeddings,
 *     hidden[i] the output of layer i (1 <= i < n_layers), hidden[n_layers] after the final norm.
 * An optional additive per-key attention bias (AM's beta) can be given per layer for the first
 * key_bias_len keys of the document.
 */
#ifndef KF_MODEL_H
#define KF_MODEL_H

#include <stdint.h>

#include "compactor/arena.h"
#include "compactor/quoka.h"
#include "kernels/base/error.h"
#include "formats/hfconfig.h"
#include "kernels/backend.h"
#include "compactor/weights.h"

#define KF_DEFAULT_CHUNK 512

typedef struct kf_model kf_model;

/* An execution plan for the forward pass: its scratch memory, allocated once and reused by every
 * kf_model_forward that runs with it. A call that needs more (a longer chunk, more logit rows)
 * grows it once; nothing else is allocated per call or per chunk (with dense attention; QUOKA
 * keeps a selection index of 4 * kv_heads * context bytes per call, and the CPU backend's
 * attention keeps its own work tiles, grown to the largest tile it has run).
 * A forward without a plan uses the model's own (made at its first forward, grown likewise,
 * freed with the model); greedy decoding (compactor/engine) brings its own, so every generated
 * token runs without an allocation. Calls sharing a plan, or a model's plan, must not overlap.
 *
 * Memory, in backend memory, for chunks of C tokens and lm_head batches of R rows
 * (R = min(logit rows of a call, KF_PLAN_LOGIT_ROWS)), with H hidden, I intermediate,
 * QD = n_heads * head_dim, KD = kv_heads * head_dim, V vocab (kf_forward_plan_bytes):
 *     4 C (2 H + 2 QD + 2 KD + 2 I) + 4 R (H + V) + 8 C bytes
 * e.g. Qwen3-0.6B (H 1024, I 3072, QD 2048, KD 1024, V 151936) at C = 512, R = 32:
 *     29.4 MB + 19.6 MB = 49 MB; at C = 1, R = 1 (a decoding step): 0.67 MB.
 * Beside it, the CPU backend's attention keeps one work tile per pool thread (its queries, output
 * and one block of keys, values and logits: 1.3 MB at 512 rows and head_dim 128) whatever the
 * context's length, and with AM's targets the tile's kept block logits (compactor/compact.h). */
typedef struct kf_forward_plan kf_forward_plan;

#define KF_PLAN_LOGIT_ROWS 32 /* lm_head rows per batch, at most */

/* AM's targets of the captured rows (kf_attn_targets in kernels/backend.h), made by the attention
 * itself: for every layer l, capture row r and query head h (query head h reads KV head
 * h / (n_heads / kv_heads)), over the keys [blk0, blk1) of the sequence (the document block; all of
 * them before the call's first token, blk1 <= seq->len), without bias:
 *   m[l][r * row_stride + h * head_stride]  the row max of the block's scaled logits (fp32 queries:
 *                                           with queries_bf16 the targets still come from fp32)
 *   y[l][same]                              sum of exp(logit - m) over the block
 *   Y[l] + (same) * head_dim                the block's normalized attention output [head_dim]
 *   score[l][g * score_stride + j - blk0]   += the rows' probabilities (score_rms: squared) of
 *                                           key j, summed over every captured row and query head of
 *                                           KV head g, in fp64, in an order fixed by the arguments
 * and, where app0 > 0, the same m, y, Y of capture row r over its own prompt, the keys [app0, its
 * own position] (app0 at or after blk1, at most seq->len: the validation's appended block), for
 * the rows with app_slot[r] >= 0, into am/ay/aY[l] at app_slot[r] * row_stride + h * app_head_stride
 * (app_slot NULL: none, the output's sums in the same order).
 * Only where kf_model_targets_supported says so (the CPU backend, dense attention, no key bias);
 * capture_rows must then be ascending. */
typedef struct {
    int blk0, blk1;
    float **m, **y, **Y;           /* [n_layers] each */
    size_t row_stride, head_stride;
    double **score;                /* [n_layers]: [kv_heads, score_stride] */
    size_t score_stride;
    int score_rms;
    int app0;                      /* 0: no own prompts */
    const int32_t *app_slot;       /* [n_capture_rows] or NULL */
    float **am, **ay, **aY;        /* [n_layers] each */
    size_t app_head_stride;
} kf_forward_targets;

typedef struct {
    const int32_t *ids;            /* [n_tokens] tokens to append */
    int n_tokens;
    int64_t pos_offset;            /* RoPE position = seq->len + i + pos_offset */
    int chunk;                     /* tokens per chunk; 0 = KF_DEFAULT_CHUNK */

    const int32_t *logit_rows;     /* [n_logit_rows] indices into ids */
    int n_logit_rows;
    float *logits;                 /* [n_logit_rows, vocab] */

    const int32_t *capture_rows;   /* [n_capture_rows] indices into ids */
    int n_capture_rows;
    float **queries;               /* NULL or [n_layers] (entries may be NULL): capture row r, query head h at
                                      queries[l] + r * queries_row_stride + h * queries_head_stride,
                                      head_dim floats each (by default [n_capture_rows, n_heads, head_dim]) */
    size_t queries_row_stride;     /* floats between captured rows; 0: n_heads * head_dim */
    size_t queries_head_stride;    /* floats between the heads of a row; 0: head_dim (a row is one copy; any
                                      other stride copies head by head: one download each on a GPU) */
    uint16_t **queries_bf16;       /* NULL, or instead of queries: the same rows rounded to bf16 (nearest
                                      even), at the same strides counted in elements */
    float **hidden;                /* NULL or [n_layers + 1] (entries may be NULL): [n_capture_rows, hidden] */
    const kf_forward_targets *targets; /* NULL, or AM's targets of the captured rows (above) */

    const float *const *key_bias;  /* NULL or [n_layers] (entries may be NULL): [kv_heads, key_bias_len] */
    int key_bias_len;

    const kf_quoka_params *quoka;  /* NULL (or mode dense): dense attention; else QUOKA sparse attention */

    void (*progress)(void *ctx, int64_t done, int64_t total); /* called after each chunk: tokens done of
                                                                 n_tokens (layer-major: see below) */
    void *progress_ctx;

    kf_forward_plan *plan;         /* NULL: the model's own plan */
} kf_forward_args;

/* How the weights are stored (kf_model_opts.weights):
 *   AUTO  bf16 when every tensor of the checkpoint is BF16 (widening back to fp32 is then exact:
 *         the GEMMs compute on the checkpoint's own values), else fp32; a backend whose weight
 *         dtype is fixed (CUDA: bf16) keeps its own
 *   F32   fp32, 4 bytes per parameter (bf16 and f16 widened exactly)
 *   BF16  bf16, 2 bytes per parameter (fp32 and f16 tensors rounded to nearest even)
 * F32 or BF16 on a backend that cannot store it is an error (KF_ERR_UNSUPPORTED). */

typedef struct {
    kf_weights weights;
} kf_model_opts;


/* kf_model_load_opts with the default options (AUTO). */
kf_status kf_model_load(kf_model **out, const char *dir, kf_backend *backend, kf_error *err);
/* Loads the model on backend, whose weight dtype it sets (set_weight_dtype) as o->weights says
 * (o NULL: the defaults). */
kf_status kf_model_load_opts(kf_model **out, const char *dir, kf_backend *backend, const kf_model_opts *o,
                             kf_error *err);
void kf_model_free(kf_model *m);
/* The dtype the weights are stored in, and the bytes of backend memory they take (every weight
 * buffer: parameters times the dtype's size; a tied lm_head counted once). */
kf_dtype kf_model_weight_dtype(const kf_model *m);
int64_t kf_model_weight_bytes(const kf_model *m);

const kf_hfconfig *kf_model_config(const kf_model *m);
const char *kf_model_dir(const kf_model *m);
int64_t kf_model_n_params(const kf_model *m);
/* Digest of config.json, the tensor index and every weight byte (XXH3-128, 32 hex digits). */
const char *kf_model_fingerprint(kf_model *m);

/* The backend the model was loaded on. */
kf_backend *kf_model_backend(const kf_model *m);

/* RoPE inverse frequencies [head_dim / 2] of this model. */
const double *kf_model_inv_freq(const kf_model *m);

/* An fp32 arena shaped for this model with room for n_tokens tokens. */
kf_status kf_model_arena(const kf_model *m, kf_arena *a, int64_t n_tokens, kf_error *err);
/* The same of dtype KF_DTYPE_F32 or KF_DTYPE_BF16 (kf_arena_init: bf16 where the backend has kv_bf16,
 * else KF_ERR_UNSUPPORTED). */
kf_status kf_model_arena_dtype(const kf_model *m, kf_arena *a, int64_t n_tokens, kf_dtype dtype, kf_error *err);

kf_status kf_model_forward(kf_model *m, kf_arena *a, kf_seq *seq, const kf_forward_args *args, kf_error *err);

/* The layer-major forward (bounded memory): several passes, each a document and what to
 * append to it, run layer by layer: layer l on every chunk of pass 0, then of pass 1, ..., then the
 * hook's on_layer(ctx, l), then layer l + 1. Each pass's chunks are exactly the ones
 * kf_model_forward runs with its args (the same boundaries, kernels and keys visible), so its K/V,
 * captures and logits are bit-identical to kf_model_forward's; between layers each pass keeps its
 * residual stream, [n_tokens, hidden] fp32 in backend memory, and nothing else that grows with its
 * tokens (QUOKA's index aside). The passes must not write each other's pages (forks of one document
 * are fine: each reserves its own copy of a shared partial page) and share one plan (the first
 * pass's args->plan, NULL: the model's own). In on_layer(l), every pass's layers <= l are in the
 * arena (read them with kf_seq_read_kv; seq->len advances only when the whole call succeeds), and
 * its queries of layer l are captured: a capture buffer may be reused from one layer to the next
 * (targets too: their score sums are added to, so zero a reused one in before_layer);
 * before_layer(l) runs before any pass's layer l (an arena of fewer layers, kf_arena_init_held,
 * can be given the keys its passes read there). A status other than KF_OK from either stops the
 * forward and is returned. args->progress is
 * called after each chunk of each layer with (n_tokens l + the layer's tokens done, n_tokens n_layers).
 * Why: docs/decisions/layer-by-layer-sources.md. */
typedef struct {
    kf_seq *seq;
    const kf_forward_args *args;
} kf_forward_pass;

typedef struct {
    kf_status (*before_layer)(void *ctx, int layer, kf_error *err); /* NULL, or called before layer l runs */
    kf_status (*on_layer)(void *ctx, int layer, kf_error *err); /* NULL: none */
    void *ctx;
    double *pass_s; /* NULL or [n passes]: each pass's forward seconds are added to it */
} kf_layer_hook;

kf_status kf_model_forward_layers(kf_model *m, kf_arena *a, const kf_forward_pass *passes, int n,
                                  const kf_layer_hook *hook, kf_error *err);

/* 1 when a forward with args (its quoka and key_bias; targets ignored) can fill args->targets:
 * the backend's attention makes them (kf_backend.attn_targets), dense attention, no key bias.
 * 0: the caller computes the targets itself (kf_am_targets_compute). */
int kf_model_targets_supported(const kf_model *m, const kf_forward_args *args);

/* A plan for model m with room for chunks of `chunk` tokens and `logit_rows` logit rows per call
 * (0, 0: empty, grown by the first forward). */
kf_status kf_forward_plan_create(kf_forward_plan **out, kf_model *m, int chunk, int logit_rows, kf_error *err);
void kf_forward_plan_free(kf_forward_plan *p);
/* The memory formula above, in bytes. */
size_t kf_forward_plan_bytes(const kf_hfconfig *c, int chunk, int logit_rows);
/* The bytes plan p holds now, and how many times its buffers were (re)allocated. */
size_t kf_forward_plan_size(const kf_forward_plan *p, const kf_model *m);
int64_t kf_forward_plan_allocs(const kf_forward_plan *p);
/* The model's own plan: NULL until a forward without a plan has run. */
const kf_forward_plan *kf_model_plan(const kf_model *m);

#endif
