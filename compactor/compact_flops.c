/* compact_flops.c — the matmul FLOPs of a compaction's forward passes (compact_flops.h). */
#include "compactor/compact_flops.h"

double kf_flops_total(const kf_flops *f) {
    return f->proj + f->attn + f->head;
}

void kf_forward_flops(const kf_hfconfig *c, int64_t n, int64_t n_before, kf_last_layer last, int64_t logit_rows,
                      kf_flops *f) {
    const double H = c->hidden_size, I = c->intermediate_size, L = c->n_layers;
    const double QD = (double)c->n_heads * c->head_dim, KD = (double)c->n_kv_heads * c->head_dim;
    const double qkv = 2 * H * (QD + 2 * KD), rest = 2 * QD * H + 6 * H * I; /* per token and layer */
    const double full = L - 1 + (last == KF_LAST_FULL), attn_layers = L - 1 + (last != KF_LAST_QKV);
    const double pairs = (double)n * (double)n_before + (double)n * (double)(n + 1) / 2;
    f->proj += (double)n * (L * qkv + full * rest);
    f->attn += pairs * 4.0 * c->head_dim * c->n_heads * attn_layers;
    f->head += 2 * H * c->vocab_size * (double)logit_rows;
}

void kf_compact_flops_count(const kf_hfconfig *c, const kf_compact_params *p, int64_t n_pre, int64_t n_doc,
                            int64_t n_suf, int attn_targets, kf_compact_flops *out) {
    const int64_t D = n_pre + n_doc + n_suf;
    const int quoka_repeat = p->run.quoka && p->run.quoka_repeat && p->run.quoka->mode == KF_PREFILL_QUOKA;
    int off[KF_REPEAT_SPANS_MAX], len[KF_REPEAT_SPANS_MAX];
    *out = (kf_compact_flops){{0, 0, 0}, {0, 0, 0}};
    kf_forward_flops(c, D, 0, KF_LAST_QKV, 0, &out->prefill);
    const int n_spans = kf_repeat_spans(p, (int)n_doc, off, len);
    for (int k = 0; k < n_spans; k++)
        kf_forward_flops(c, p->repeat_instruction.n + len[k], D,
                         attn_targets && !quoka_repeat ? KF_LAST_ATTN : KF_LAST_QKV, 0, &out->repeat);
    for (int i = 0; i < p->n_probes; i++)
        kf_forward_flops(c, p->probes[i].n, D, attn_targets ? KF_LAST_ATTN : KF_LAST_QKV, 0, &out->repeat);
}
