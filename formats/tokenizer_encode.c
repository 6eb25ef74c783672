/* tokenizer_encode.c — text to ids (added tokens found first, the rest pre-tokenized and merged by
 * BPE) and ids back to text, on a loaded tokenizer (tokenizer.c). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer.h"
#include "tokenizer_internal.h"

void kf_token_ids_free(kf_token_ids *ids) {
    free(ids->ids);
    memset(ids, 0, sizeof *ids);
}

static kf_status push_out(kf_token_ids *out, int32_t id, kf_error *err) {
    if (out->n == out->cap) {
        size_t cap = out->cap ? out->cap * 2 : 256;
        int32_t *p = realloc(out->ids, cap * sizeof *p);
        if (!p)
            return kf_fail(err, KF_ERR_NOMEM, "tokenizer: out of memory");
        out->ids = p;
        out->cap = cap;
    }
    out->ids[out->n++] = id;
    return KF_OK;
}

/* \w in the tokenizers library's single_word check: alphanumeric or '_'. Approximated with ASCII
 * plus "any non-ASCII letter-or-digit-looking character" (every code point above U+007F that is not
 * white space counts as a word character). */
static bool is_word_cp(uint32_t cp) {
    if (cp < 0x80)
        return (cp >= '0' && cp <= '9') || (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') ||
               cp == '_';
    return !kf_is_white_space(cp);
}

static uint32_t cp_before(const char *s, size_t at) {
    size_t i = at;
    do {
        i--;
    } while (i > 0 && ((unsigned char)s[i] & 0xC0) == 0x80);
    uint32_t cp = 0;
    kf_tok_utf8_next((const unsigned char *)s + i, at - i, &cp);
    return cp;
}

/* Finds the next added token of `set` in s[from..len): leftmost, then longest. Sets the span the
 * token takes (with stripped white space) and its index. */
static bool find_added(const kf_tokenizer *tok, const kf_added_set *set, const char *s, size_t len,
                       size_t from, size_t *ms, size_t *me, int32_t *which) {
    if (set->n == 0)
        return false;
    for (size_t i = from; i < len; i++) {
        unsigned char b = (unsigned char)s[i];
        for (size_t k = set->first[b]; k < set->first[b + 1]; k++) {
            const kf_added *a = &tok->added[set->order[k]];
            if (a->len > len - i || memcmp(s + i, a->content, a->len) != 0)
                continue;
            size_t e = i + a->len;
            if (a->single_word) {
                uint32_t cp;
                bool left_ok = i == 0 || !is_word_cp(cp_before(s, i));
                bool right_ok = e == len ||
                                (kf_tok_utf8_next((const unsigned char *)s + e, len - e, &cp) > 0 &&
                                 !is_word_cp(cp));
                if (!left_ok || !right_ok) {
                    i = e - 1; /* matches do not overlap: continue after this one */
                    break;
                }
            }
            size_t st = i;
            if (a->lstrip) {
                while (st > from && kf_is_white_space(cp_before(s, st))) {
                    size_t j = st;
                    do {
                        j--;
                    } while (j > from && ((unsigned char)s[j] & 0xC0) == 0x80);
                    st = j;
                }
            }
            if (a->rstrip) {
                uint32_t cp;
                int k2;
                while (e < len && (k2 = kf_tok_utf8_next((const unsigned char *)s + e, len - e, &cp)) > 0 &&
                       kf_is_white_space(cp))
                    e += (size_t)k2;
            }
            *ms = st;
            *me = e;
            *which = set->order[k];
            return true;
        }
    }
    return false;
}

static kf_status encode_plain(kf_tokenizer *tok, const char *s, size_t len, kf_token_ids *out,
                              kf_error *err) {
    if (len == 0)
        return KF_OK;
    KF_TRY(kf_pretokenize(&tok->pre, s, len, &tok->pieces, err));
    for (size_t k = 0; k < tok->pieces.n; k++) {
        const kf_piece *p = &tok->pieces.pieces[k];
        KF_TRY(kf_bpe_encode_word(&tok->bpe, tok->pieces.buf + p->off, p->len, out, err));
    }
    return KF_OK;
}

/* Text between raw added tokens: normalize, split on normalized added tokens, encode the rest. */
static kf_status encode_section(kf_tokenizer *tok, const char *s, size_t len, kf_token_ids *out,
                                kf_error *err) {
    if (len == 0)
        return KF_OK;
    char *norm = NULL;
    size_t nlen = len;
    if (tok->norm.n) {
        KF_TRY(kf_normalize(&tok->norm, s, len, &norm, &nlen, err));
        s = norm;
    }
    kf_status st = KF_OK;
    size_t at = 0, ms, me;
    int32_t which;
    while (st == KF_OK && find_added(tok, &tok->norm_set, s, nlen, at, &ms, &me, &which)) {
        st = encode_plain(tok, s + at, ms - at, out, err);
        if (st == KF_OK)
            st = push_out(out, tok->added[which].id, err);
        at = me;
    }
    if (st == KF_OK)
        st = encode_plain(tok, s + at, nlen - at, out, err);
    free(norm);
    return st;
}

kf_status kf_tokenizer_encode(kf_tokenizer *tok, const char *text, size_t len, unsigned flags,
                              kf_token_ids *out, kf_error *err) {
    size_t bad = kf_utf8_valid_prefix(text, len);
    if (bad != len)
        return kf_fail(err, KF_ERR_INVALID, "tokenizer: input is not valid UTF-8 (byte 0x%02x at "
                       "offset %zu)", (unsigned char)text[bad], bad);
    if (flags & KF_TOK_ADD_SPECIAL)
        for (size_t i = 0; i < tok->n_prefix; i++)
            KF_TRY(push_out(out, tok->tpl_prefix[i], err));
    size_t at = 0, ms, me;
    int32_t which;
    while (find_added(tok, &tok->raw_set, text, len, at, &ms, &me, &which)) {
        KF_TRY(encode_section(tok, text + at, ms - at, out, err));
        KF_TRY(push_out(out, tok->added[which].id, err));
        at = me;
    }
    KF_TRY(encode_section(tok, text + at, len - at, out, err));
    if (flags & KF_TOK_ADD_SPECIAL)
        for (size_t i = 0; i < tok->n_suffix; i++)
            KF_TRY(push_out(out, tok->tpl_suffix[i], err));
    return KF_OK;
}

/* ---- decoding -------------------------------------------------------------------------------- */

kf_status kf_tokenizer_decode(const kf_tokenizer *tok, const int32_t *ids, size_t n, unsigned flags,
                              char **text, size_t *len, kf_error *err) {
    *text = NULL;
    *len = 0;
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= tok->n_ids || tok->tok_off[ids[i]] < 0)
            return kf_fail(err, KF_ERR_INVALID, "tokenizer: id %d at position %zu is not in the "
                           "vocabulary of %s", (int)ids[i], i, tok->path);
        total += tok->tok_len[ids[i]];
    }
    char *raw = malloc(total + 1);
    /* Worst case every byte becomes U+FFFD (3 bytes). */
    char *res = malloc(3 * total + 1);
    if (!raw || !res) {
        free(raw);
        free(res);
        return kf_fail(err, KF_ERR_NOMEM, "tokenizer: out of memory");
    }
    size_t r = 0;
    for (size_t i = 0; i < n; i++) {
        if ((flags & KF_TOK_SKIP_SPECIAL) && (tok->tok_flags[ids[i]] & KF_TF_SPECIAL))
            continue;
        memcpy(raw + r, tok->pool + tok->tok_off[ids[i]], tok->tok_len[ids[i]]);
        r += tok->tok_len[ids[i]];
    }
    size_t w = 0;
    for (size_t i = 0; i < r;) {
        uint32_t cp;
        int k = kf_tok_utf8_next((const unsigned char *)raw + i, r - i, &cp);
        if (k > 0) {
            memcpy(res + w, raw + i, (size_t)k);
            w += (size_t)k;
            i += (size_t)k;
        } else {
            memcpy(res + w, "\xEF\xBF\xBD", 3);
            w += 3;
            i += (size_t)-k;
        }
    }
    res[w] = 0;
    free(raw);
    *text = res;
    *len = w;
    return KF_OK;
}

/* ---- queries --------------------------------------------------------------------------------- */

int32_t kf_tokenizer_n_ids(const kf_tokenizer *tok) { return tok->n_ids; }

int32_t kf_tokenizer_token_id(const kf_tokenizer *tok, const char *token) {
    int32_t id;
    return kf_bmap_get(&tok->spelling, token, strlen(token), &id) ? id : -1;
}

int32_t kf_tokenizer_bos_id(const kf_tokenizer *tok) { return tok->bos_id; }
int32_t kf_tokenizer_eos_id(const kf_tokenizer *tok) { return tok->eos_id; }
