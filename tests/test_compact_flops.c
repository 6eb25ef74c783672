/* The FLOP count of a compaction's forwards (compactor/compact_flops.h) against a hand count for a
 * tiny configuration, worked out below independently of the code:
 *   H 8, I 12, 2 layers, 4 heads of 4 dims (QD 16), 2 KV heads (KD 8), vocabulary 50.
 *   per token and layer: q 2*8*16 = 256, k 128, v 128, o 256, MLP 3*2*8*12 = 576:
 *     a whole layer 1344, a last layer with q, k, v only 512 -> 1856 per token of a pass;
 *   attention: 4 * 4 dims * 4 heads = 64 per query-key pair and layer.
 *   prefill of 10 tokens: 18560 projections; 55 causal pairs, first layer only (the last has no
 *     attention: no output read, no targets) -> 3520.
 *   repeat = 3 instruction tokens + the 10 again, on the 10 cached: 13 * 1856 = 24128; pairs
 *     13 * 10 + 13 * 14 / 2 = 221, both layers with targets fused -> 28288 (one layer: 14144).
 *   repeat fraction 0.5 over 2 spans: strata of 5, runs of round(2.5) = 3 -> 2 sources of 6 tokens:
 *     6 * 1856 = 11136 each; pairs 6 * 10 + 21 = 81 each, 2 layers -> 10368 each.
 *   a probe of 4 tokens: 4 * 1856 = 7424; pairs 4 * 10 + 10 = 50, 2 layers -> 6400.
 *   a prefix of 2 and a suffix of 1 token: the context is 13 tokens: prefill 13 * 1856 = 24128,
 *     91 pairs -> 5824; the repeat (13 tokens) on 13 keys: 24128, pairs 169 + 91 = 260 -> 33280.
 *   one whole pass of 5 tokens with 3 logit rows: 5 * 2 * 1344 = 13440; 15 pairs, 2 layers -> 1920;
 *     lm-head 2 * 8 * 50 * 3 = 2400. */
#include <string.h>

#include "compactor/compact_flops.h"
#include "test_util.h"

static kf_hfconfig tiny(void) {
    kf_hfconfig c;
    memset(&c, 0, sizeof c);
    c.hidden_size = 8, c.intermediate_size = 12, c.n_layers = 2, c.n_heads = 4, c.n_kv_heads = 2, c.head_dim = 4;
    c.vocab_size = 50;
    return c;
}

static const int32_t kIds[8] = {1, 2, 3, 4, 5, 6, 7, 8};

static kf_compact_params repeat_params(void) {
    kf_compact_params p = kf_compact_params_default();
    p.repeat_instruction = (kf_prompt){kIds, 3};
    return p;
}

static void test_prefill_and_repeat(void) {
    const kf_hfconfig c = tiny();
    kf_compact_params p = repeat_params();
    kf_compact_flops f;
    kf_compact_flops_count(&c, &p, 0, 10, 0, 1, &f);
    CU_ASSERT_DOUBLE_EQUAL(f.prefill.proj, 18560, 0);
    CU_ASSERT_DOUBLE_EQUAL(f.prefill.attn, 3520, 0);
    CU_ASSERT_DOUBLE_EQUAL(f.prefill.head, 0, 0);
    CU_ASSERT_DOUBLE_EQUAL(f.repeat.proj, 24128, 0);
    CU_ASSERT_DOUBLE_EQUAL(f.repeat.attn, 28288, 0);
    CU_ASSERT_DOUBLE_EQUAL(kf_flops_total(&f.repeat), 24128 + 28288, 0);
    kf_compact_flops_count(&c, &p, 0, 10, 0, 0, &f); /* no fused targets: no last-layer attention */
    CU_ASSERT_DOUBLE_EQUAL(f.repeat.attn, 14144, 0);
    const kf_quoka_params q = {.mode = KF_PREFILL_QUOKA};
    p.run.quoka = &q, p.run.quoka_repeat = 1; /* a QUOKA repeat has no targets either */
    kf_compact_flops_count(&c, &p, 0, 10, 0, 1, &f);
    CU_ASSERT_DOUBLE_EQUAL(f.repeat.attn, 14144, 0);
}

static void test_sources(void) {
    const kf_hfconfig c = tiny();
    kf_compact_params p = repeat_params();
    kf_compact_flops f;
    p.repeat_fraction = 0.5, p.repeat_spans = 2;
    kf_compact_flops_count(&c, &p, 0, 10, 0, 1, &f);
    CU_ASSERT_DOUBLE_EQUAL(f.repeat.proj, 2 * 11136, 0);
    CU_ASSERT_DOUBLE_EQUAL(f.repeat.attn, 2 * 10368, 0);
    CU_ASSERT_DOUBLE_EQUAL(f.prefill.proj, 18560, 0);
    const kf_prompt probe = {kIds, 4};
    p = repeat_params(), p.probes = &probe, p.n_probes = 1;
    kf_compact_flops_count(&c, &p, 0, 10, 0, 1, &f);
    CU_ASSERT_DOUBLE_EQUAL(f.repeat.proj, 24128 + 7424, 0);
    CU_ASSERT_DOUBLE_EQUAL(f.repeat.attn, 28288 + 6400, 0);
    p = repeat_params(), p.no_repeat = 1, p.use_context_queries = 1; /* the prefill's own queries: free */
    kf_compact_flops_count(&c, &p, 0, 10, 0, 1, &f);
    CU_ASSERT_DOUBLE_EQUAL(kf_flops_total(&f.repeat), 0, 0);
    CU_ASSERT_DOUBLE_EQUAL(kf_flops_total(&f.prefill), 18560 + 3520, 0);
    p = repeat_params();
    kf_compact_flops_count(&c, &p, 2, 10, 1, 1, &f);
    CU_ASSERT_DOUBLE_EQUAL(f.prefill.proj, 24128, 0);
    CU_ASSERT_DOUBLE_EQUAL(f.prefill.attn, 5824, 0);
    CU_ASSERT_DOUBLE_EQUAL(f.repeat.proj, 24128, 0);
    CU_ASSERT_DOUBLE_EQUAL(f.repeat.attn, 33280, 0);
}

static void test_whole_pass_with_logits(void) {
    const kf_hfconfig c = tiny();
    kf_flops f = {0};
    kf_forward_flops(&c, 5, 0, KF_LAST_FULL, 3, &f);
    CU_ASSERT_DOUBLE_EQUAL(f.proj, 13440, 0);
    CU_ASSERT_DOUBLE_EQUAL(f.attn, 1920, 0);
    CU_ASSERT_DOUBLE_EQUAL(f.head, 2400, 0);
}

static CU_TestInfo tests[] = {
    {"prefill and repeat by hand (targets fused, not, QUOKA repeat)", test_prefill_and_repeat},
    {"partial repeat, probes, context queries, prefix and suffix by hand", test_sources},
    {"a whole pass with logits by hand", test_whole_pass_with_logits},
    CU_TEST_INFO_NULL,
};
static CU_SuiteInfo suites[] = {
    {"compaction FLOPs", NULL, NULL, NULL, NULL, tests},
    CU_SUITE_INFO_NULL,
};

int main(void) { return kf_test_main(suites); }
