/* tokenizer.h — Hugging Face tokenizer.json (byte-level BPE): encode text to ids and back.
 *
 * The format (the `tokenizers` library's serialization, version "1.0"), as far as kvfold reads it:
 *
 *   {
 *     "added_tokens": [ {"id": 151643, "content": "<|endoftext|>", "special": true,
 *                        "lstrip": false, "rstrip": false, "single_word": false,
 *                        "normalized": false}, ... ],
 *     "normalizer":    null | {"type": "NFC"} | {"type": "NFD"|"NFKC"|"NFKD"}
 *                      | {"type": "Sequence", "normalizers": [ ... ]},
 *     "pre_tokenizer": null
 *                      | {"type": "Split", "pattern": {"Regex": "..."} | {"String": "..."},
 *                         "behavior": "Isolated", "invert": false}
 *                      | {"type": "ByteLevel", "add_prefix_space": bool, "use_regex": bool}
 *                      | {"type": "Sequence", "pretokenizers": [ ... ]},
 *     "model": {"type": "BPE", "vocab": {"Ġthe": 279, ...},
 *               "merges": ["Ġ t", ...] | [["Ġ", "t"], ...],     (rank = position in the list)
 *               "ignore_merges": bool, "unk_token": null | "...", "byte_fallback": false,
 *               "dropout": null, "continuing_subword_prefix": ""|null, "end_of_word_suffix": ""|null},
 *     "post_processor": null | {"type": "ByteLevel"} | {"type": "TemplateProcessing",
 *                       "single": [{"SpecialToken": {"id": "<|begin_of_text|>"}}, {"Sequence": {"id": "A"}}]}
 *                      | {"type": "Sequence", "processors": [ ... ]},
 *     "decoder": {"type": "ByteLevel"}
 *   }
 *
 * and, beside it, `tokenizer_config.json` (optional): "bos_token" / "eos_token" as a string or as
 * {"content": "..."} (null when absent).
 *
 * Encoding, as the `tokenizers` library does it:
 *   1. added tokens are found in the raw text, leftmost then longest (tokens with
 *      "normalized": true are searched after normalization instead); lstrip/rstrip swallow the
 *      white space beside the token, single_word requires non-word characters (or the text's ends)
 *      on both sides;
 *   2. each stretch of text between added tokens is normalized, pre-tokenized (regex splits; the
 *      ByteLevel step maps every byte to a printable character, GPT-2's bytes_to_unicode) and
 *   3. each pre-token is merged by BPE: start from single bytes, repeatedly merge the adjacent
 *      pair with the lowest merge rank (leftmost among equals). With ignore_merges a pre-token that
 *      is itself in the vocabulary is emitted whole.
 * kvfold works on the raw bytes throughout: a vocabulary entry is stored as the bytes its
 * characters stand for, so BPE never builds the mapped strings.
 *
 * Regular expressions run in PCRE2 (UTF + UCP). `\s` and `\S` are rewritten to Unicode's
 * White_Space property, which is what the `tokenizers` library (Oniguruma) matches; note that
 * JavaScript's `\s` differs on U+0085 (not space there) and U+FEFF (space there).
 *
 * Input text must be valid UTF-8: anything else is refused with KF_ERR_INVALID naming the byte
 * offset. Decoding maps ids back to bytes and replaces invalid UTF-8 sequences (a token can hold
 * part of a character) by U+FFFD, as the reference does.
 *
 * A kf_tokenizer is not safe to use from two threads at once (the encoder keeps a cache); open one
 * per thread.
 */
#ifndef KF_TOKENIZER_H
#define KF_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/base/error.h"

typedef struct kf_tokenizer kf_tokenizer;

/* A growable list of token ids. Zero-initialize; free with kf_token_ids_free. */
typedef struct {
    int32_t *ids; /* [n] */
    size_t n;
    size_t cap;
} kf_token_ids;

void kf_token_ids_free(kf_token_ids *ids);

/* Opens `path`: either a model directory holding tokenizer.json (and optionally
 * tokenizer_config.json) or a tokenizer.json file itself. */
kf_status kf_tokenizer_open(kf_tokenizer **out, const char *path, kf_error *err);
void kf_tokenizer_close(kf_tokenizer *tok);

enum {
    KF_TOK_ADD_SPECIAL = 1u << 0, /* apply the post-processor's template (e.g. Llama 3.1's BOS) */
};

/* Encodes `len` bytes of UTF-8 and appends the ids to `out`. */
kf_status kf_tokenizer_encode(kf_tokenizer *tok, const char *text, size_t len, unsigned flags,
                              kf_token_ids *out, kf_error *err);

enum {
    KF_TOK_SKIP_SPECIAL = 1u << 0, /* leave out added tokens marked "special" */
};

/* Decodes ids into a malloc'ed, NUL-terminated UTF-8 string (*text, *len bytes without the NUL).
 * An id outside the vocabulary is KF_ERR_INVALID. */
kf_status kf_tokenizer_decode(const kf_tokenizer *tok, const int32_t *ids, size_t n, unsigned flags,
                              char **text, size_t *len, kf_error *err);

/* One past the largest id (vocabulary plus added tokens). */
int32_t kf_tokenizer_n_ids(const kf_tokenizer *tok);

/* The id of a vocabulary entry or added token given by its tokenizer.json spelling, or -1. */
int32_t kf_tokenizer_token_id(const kf_tokenizer *tok, const char *token);

/* BOS / EOS ids from tokenizer_config.json, -1 where it names none. */
int32_t kf_tokenizer_bos_id(const kf_tokenizer *tok);
int32_t kf_tokenizer_eos_id(const kf_tokenizer *tok);

/* Checks that `len` bytes are valid UTF-8 (no overlongs, surrogates or values above U+10FFFF).
 * Returns len when valid, otherwise the offset of the first bad byte. */
size_t kf_utf8_valid_prefix(const char *s, size_t len);

#endif
