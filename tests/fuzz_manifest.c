/* fuzz_manifest — libFuzzer target for a line of `kvfold compact --manifest` (tools/manifest.c).
 *
 *   cmake --build build-fuzz --target fuzz_manifest    (configured as for fuzz_tokenizer)
 *   tests/fuzz_seeds.py build-fuzz/seeds
 *   build-fuzz/tests/fuzz_manifest -max_total_time=30 -max_len=16384 CORPUS build-fuzz/seeds/manifest
 *
 * Uses tests/data/records-qwen3 (its config for the vocabulary, its tokenizer for "text"). The input
 * is one line (up to its first NUL, as the job reads it). Besides "no crash, no sanitizer report,
 * no leak": a refusal carries a message and leaves nothing allocated; an accepted line gives a
 * non-empty document, every id (document, instruction, probes) inside the vocabulary, and
 * non-empty prompts.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats/hfconfig.h"
#include "tools/manifest.h"

static doc_text g_text;
static int g_vocab;

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    kf_hfconfig cfg;
    kf_error err = {0};
    if (kf_hfconfig_load(&cfg, KF_TEST_DATA "/records-qwen3/config.json", &err) != KF_OK) {
        fprintf(stderr, "fuzz_manifest: %s\n", err.msg);
        abort();
    }
    g_vocab = cfg.vocab_size;
    doc_text_init(&g_text, KF_TEST_DATA "/records-qwen3", g_vocab);
    return 0;
}

static void check_ids(const char *what, const int32_t *ids, int n) {
    if (!ids || n < 1) {
        fprintf(stderr, "fuzz_manifest: accepted an empty %s\n", what);
        abort();
    }
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= g_vocab) {
            fprintf(stderr, "fuzz_manifest: %s id %d outside the vocabulary\n", what, ids[i]);
            abort();
        }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *line = malloc(size + 1);
    memcpy(line, data, size);
    line[size] = 0;
    manifest_doc d;
    char err[1024] = "";
    if (manifest_parse_line(&g_text, line, &d, err, sizeof err) != 0) {
        if (!err[0] || d.ids || d.instr || d.probes || d.n || d.n_instr || d.n_probes) {
            fprintf(stderr, "fuzz_manifest: a refusal without a message or with data left: '%s'\n", err);
            abort();
        }
    } else {
        if (!memchr(d.name, 0, sizeof d.name))
            abort();
        check_ids("document", d.ids, d.n);
        if (d.instr || d.n_instr)
            check_ids("instruction", d.instr, d.n_instr);
        if (d.n_probes < 0 || (d.n_probes > 0 && !d.probes))
            abort();
        for (int i = 0; i < d.n_probes; i++)
            check_ids("probe", d.probes[i].ids, d.probes[i].n);
        manifest_doc_free(&d);
    }
    free(line);
    return 0;
}
