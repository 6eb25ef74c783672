/* progress.c — a compaction's progress calls (progress.h). */
#include "compactor/progress.h"

#include "compactor/compact_flops.h"

const char *kf_stage_name(kf_stage s) {
    switch (s) {
    case KF_STAGE_PREFILL: return "prefill";
    case KF_STAGE_REPEAT: return "repeat";
    case KF_STAGE_SOLVE: return "solve";
    }
    return "?";
}

void kf_progress_sink_init(kf_progress_sink *s, const struct kf_compact_params *p, const kf_hfconfig *c, int64_t n_pre,
                           int64_t n_doc, int64_t n_suf, int64_t shared, int64_t src_tokens, int attn_targets) {
    *s = (kf_progress_sink){.fn = p->progress, .user = p->progress_user, .cfg = c, .shared = shared,
                            .computed = n_pre + n_doc + n_suf - shared, .src_tokens = src_tokens};
    if (!s->fn)
        return;
    kf_compact_flops f;
    kf_compact_flops_count(c, p, n_pre, n_doc, n_suf, attn_targets, &f);
    kf_flops pre = {0, 0, 0};
    kf_forward_flops(c, s->computed, shared, KF_LAST_QKV, 0, &pre);
    s->fl_prefill = kf_flops_total(&pre);
    s->fl_sources = kf_flops_total(&f.repeat);
}

static void emit(const kf_progress_sink *s, kf_stage st, int layer, int64_t done, int64_t total, double fwd) {
    const kf_progress pg = {.stage = st, .layer = layer, .n_layers = s->cfg->n_layers, .done = done,
                            .total = total, .fwd_done = fwd, .fwd_total = s->fl_prefill + s->fl_sources,
                            .fwd_sources = s->fl_sources};
    s->fn(s->user, &pg);
}

void kf_progress_on_prefill(void *ctx, int64_t done, int64_t total) {
    const kf_progress_sink *s = ctx;
    (void)total; /* the forward's own tokens: s->computed */
    if (!s->fn)
        return;
    kf_flops f = {0, 0, 0};
    kf_forward_flops(s->cfg, done, s->shared, KF_LAST_QKV, 0, &f);
    emit(s, KF_STAGE_PREFILL, -1, done, s->computed, kf_flops_total(&f));
}

void kf_progress_on_source(void *ctx, int64_t done, int64_t total) {
    const kf_progress_pass *pp = ctx;
    const kf_progress_sink *s = pp->s;
    const int L = s->cfg->n_layers;
    const int64_t n = total / L; /* the pass's tokens */
    if (!s->fn || n <= 0 || done <= 0)
        return;
    const int layer = (int)((done - 1) / n);
    const int64_t in_layer = pp->before + done - (int64_t)layer * n;
    const double frac = s->src_tokens > 0 ? (double)in_layer / (double)s->src_tokens : 1;
    emit(s, KF_STAGE_REPEAT, layer, in_layer, s->src_tokens, s->fl_prefill + s->fl_sources * (layer + frac) / L);
}

void kf_progress_solve(const kf_progress_sink *s, int layer, int done, int total) {
    if (s->fn)
        emit(s, KF_STAGE_SOLVE, layer, done, total, s->fl_prefill + s->fl_sources * (layer + 1) / s->cfg->n_layers);
}
