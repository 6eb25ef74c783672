/* fuzz_tokenizer — libFuzzer target for the tokenizer's encoder (and decoder).
 *
 *   cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DKVFOLD_FUZZ=ON -DKVFOLD_CUDA=OFF
 *   cmake --build build-fuzz --target fuzz_tokenizer
 *   build-fuzz/tests/fuzz_tokenizer -max_total_time=60 -max_len=4096
 *
 * Uses tests/data/records-qwen3 (Qwen's NFC + regex + byte-level BPE + an added token), or the
 * tokenizer directory in $KF_FUZZ_TOKENIZER. Checks, besides "no crash, no sanitizer report":
 * valid UTF-8 encodes, invalid UTF-8 is refused with KF_ERR_INVALID, and decoding the ids gives
 * NFC(input) back whenever every byte of it has a token.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "formats/tokenizer.h"

static kf_tokenizer *tok;
static bool every_byte; /* all 256 single-byte tokens exist: round trips are exact */

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    const char *dir = getenv("KF_FUZZ_TOKENIZER");
    if (!dir)
        dir = KF_TEST_DATA "/records-qwen3";
    kf_error err = {0};
    if (kf_tokenizer_open(&tok, dir, &err) != KF_OK) {
        fprintf(stderr, "fuzz_tokenizer: %s\n", err.msg);
        abort();
    }
    /* Probe: does every ASCII byte have a token? (Small fixture vocabularies may lack some.) */
    every_byte = true;
    for (int b = 0; b < 128 && every_byte; b++) {
        char c = (char)b;
        kf_token_ids ids = {0};
        every_byte = kf_tokenizer_encode(tok, &c, 1, 0, &ids, NULL) == KF_OK && ids.n == 1;
        kf_token_ids_free(&ids);
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *text = (const char *)data;
    bool valid = kf_utf8_valid_prefix(text, size) == size;
    kf_token_ids ids = {0};
    kf_error err = {0};
    kf_status s = kf_tokenizer_encode(tok, text, size, 0, &ids, &err);
    if (!valid) {
        if (s != KF_ERR_INVALID || !strstr(err.msg, "UTF-8"))
            abort();
        kf_token_ids_free(&ids);
        return 0;
    }
    if (s != KF_OK) {
        fprintf(stderr, "encode failed on valid UTF-8: %s\n", err.msg);
        abort();
    }
    char *back = NULL;
    size_t back_len = 0;
    if (kf_tokenizer_decode(tok, ids.ids, ids.n, 0, &back, &back_len, &err) != KF_OK) {
        fprintf(stderr, "decode failed: %s\n", err.msg);
        abort();
    }
    if (every_byte && size > 0) {
        utf8proc_uint8_t *nfc = NULL;
        utf8proc_ssize_t n = utf8proc_map(data, (utf8proc_ssize_t)size, &nfc,
                                          UTF8PROC_STABLE | UTF8PROC_COMPOSE);
        bool ascii = true;
        for (size_t i = 0; i < size; i++)
            ascii = ascii && data[i] < 0x80;
        /* Non-ASCII bytes may lack tokens in small fixtures; compare pure ASCII exactly. */
        if (n >= 0 && ascii && ((size_t)n != back_len || memcmp(nfc, back, back_len) != 0)) {
            fprintf(stderr, "decode(encode(s)) != NFC(s)\n");
            abort();
        }
        free(nfc);
    }
    free(back);
    kf_token_ids_free(&ids);
    return 0;
}
