/* tokenizer.c — loading tokenizer.json / tokenizer_config.json, added tokens, encode and decode.
 * The format is described at the top of tokenizer.h. */
#include "tokenizer.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "tokenizer_internal.h"


/* ---- UTF-8 ----------------------------------------------------------------------------------- */

/* Decodes one character. Returns its length, or minus the length of the maximal ill-formed
 * subpart (at least 1) when the bytes at s are not valid UTF-8. */
int kf_tok_utf8_next(const unsigned char *s, size_t n, uint32_t *cp) {
    unsigned char c = s[0];
    if (c < 0x80) {
        *cp = c;
        return 1;
    }
    int len;
    uint32_t v;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) {
        len = 2;
        v = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
        len = 3;
        v = c & 0x0F;
        if (c == 0xE0)
            lo = 0xA0;
        if (c == 0xED)
            hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4;
        v = c & 0x07;
        if (c == 0xF0)
            lo = 0x90;
        if (c == 0xF4)
            hi = 0x8F;
    } else {
        return -1;
    }
    for (int i = 1; i < len; i++) {
        if ((size_t)i >= n)
            return -i;
        unsigned char b = s[i];
        if (b < lo || b > hi)
            return -i;
        lo = 0x80;
        hi = 0xBF;
        v = v << 6 | (b & 0x3F);
    }
    *cp = v;
    return len;
}

size_t kf_utf8_valid_prefix(const char *s, size_t len) {
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    while (i < len) {
        if (u[i] < 0x80) {
            i++;
            continue;
        }
        uint32_t cp;
        int k = kf_tok_utf8_next(u + i, len - i, &cp);
        if (k < 0)
            return i;
        i += (size_t)k;
    }
    return len;
}

/* ---- GPT-2's bytes_to_unicode ---------------------------------------------------------------- */

/* Byte b is shown as itself when printable (33..126, 161..172, 174..255), otherwise as U+0100 + k
 * for the k-th non-printable byte. char_byte[cp] inverts it (-1 for other code points). */
static int16_t char_byte[324];
static bool tables_ready;

static void init_tables(void) {
    if (tables_ready)
        return;
    for (int i = 0; i < 324; i++)
        char_byte[i] = -1;
    int k = 0;
    for (int b = 0; b < 256; b++) {
        bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
        char_byte[printable ? b : 256 + k++] = (int16_t)b;
    }
    tables_ready = true;
}

/* The bytes a token string stands for: every character mapped back through bytes_to_unicode, or,
 * when some character is outside the table, the string's own UTF-8 (what the ByteLevel decoder
 * does). *mapped says which. out must hold len bytes. */
static size_t token_bytes(const char *s, size_t len, char *out, bool *mapped) {
    const unsigned char *u = (const unsigned char *)s;
    size_t n = 0;
    *mapped = true;
    for (size_t i = 0; i < len;) {
        uint32_t cp;
        int k = kf_tok_utf8_next(u + i, len - i, &cp);
        if (k < 0 || cp >= 324 || char_byte[cp] < 0) {
            *mapped = false;
            memcpy(out, s, len);
            return len;
        }
        out[n++] = (char)char_byte[cp];
        i += (size_t)k;
    }
    return n;
}

/* ---- loading --------------------------------------------------------------------------------- */

static char *path_join(const char *dir, const char *name) {
    size_t a = strlen(dir), b = strlen(name);
    char *p = malloc(a + b + 2);
    if (!p)
        return NULL;
    memcpy(p, dir, a);
    p[a] = '/';
    memcpy(p + a + 1, name, b + 1);
    return p;
}

static json_t *load_json(const char *path, size_t flags, kf_error *err) {
    json_error_t je;
    FILE *f = fopen(path, "rb");
    if (!f) {
        kf_fail(err, KF_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
        return NULL;
    }
    json_t *root = json_loadf(f, flags, &je);
    fclose(f);
    if (!root) {
        kf_fail(err, KF_ERR_FORMAT, "%s: invalid JSON at line %d column %d: %s", path, je.line,
                je.column, je.text);
        return NULL;
    }
    if (!json_is_object(root)) {
        json_decref(root);
        kf_fail(err, KF_ERR_FORMAT, "%s: the top level is not a JSON object", path);
        return NULL;
    }
    return root;
}

static bool json_flag(json_t *obj, const char *key, bool dflt) {
    json_t *v = json_object_get(obj, key);
    return json_is_boolean(v) ? json_is_true(v) : dflt;
}

static const char *json_type_str(json_t *obj) {
    json_t *t = json_object_get(obj, "type");
    return json_is_string(t) ? json_string_value(t) : NULL;
}

static kf_status set_token(kf_tokenizer *tok, int32_t id, const char *spelling, size_t len,
                           uint8_t flags, kf_error *err) {
    if (tok->pool_len + len > tok->pool_cap) {
        size_t cap = tok->pool_cap ? tok->pool_cap : 1 << 20;
        while (cap < tok->pool_len + len)
            cap *= 2;
        char *p = realloc(tok->pool, cap);
        if (!p)
            return kf_fail(err, KF_ERR_NOMEM, "%s: out of memory", tok->path);
        tok->pool = p;
        tok->pool_cap = cap;
    }
    bool mapped;
    size_t n = token_bytes(spelling, len, tok->pool + tok->pool_len, &mapped);
    tok->tok_off[id] = (int64_t)tok->pool_len;
    tok->tok_len[id] = (uint32_t)n;
    tok->tok_flags[id] = flags;
    if (!(flags & KF_TF_ADDED) && mapped &&
        !kf_bmap_put(&tok->bpe.vocab, tok->pool + tok->pool_len, n, id))
        return kf_fail(err, KF_ERR_NOMEM, "%s: out of memory", tok->path);
    tok->pool_len += n;
    if (!kf_bmap_put(&tok->spelling, spelling, len, id))
        return kf_fail(err, KF_ERR_NOMEM, "%s: out of memory", tok->path);
    return KF_OK;
}

static kf_status load_model(kf_tokenizer *tok, json_t *root, kf_error *err) {
    const char *path = tok->path;
    json_t *model = json_object_get(root, "model");
    if (!json_is_object(model))
        return kf_fail(err, KF_ERR_FORMAT, "%s: no \"model\" object", path);
    const char *type = json_type_str(model);
    if (!type && json_is_object(json_object_get(model, "merges")))
        type = "BPE";
    if (!type || strcmp(type, "BPE") != 0)
        return kf_fail(err, KF_ERR_UNSUPPORTED, "%s: model type %s is not supported (only BPE)",
                       path, type ? type : "(none)");
    json_t *v = json_object_get(model, "dropout");
    if (v && !json_is_null(v) && json_number_value(v) != 0.0)
        return kf_fail(err, KF_ERR_UNSUPPORTED, "%s: BPE dropout is not supported", path);
    if (json_flag(model, "byte_fallback", false))
        return kf_fail(err, KF_ERR_UNSUPPORTED, "%s: BPE byte_fallback is not supported", path);
    static const char *affixes[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (int i = 0; i < 2; i++) {
        v = json_object_get(model, affixes[i]);
        if (v && !json_is_null(v) && !(json_is_string(v) && json_string_length(v) == 0))
            return kf_fail(err, KF_ERR_UNSUPPORTED, "%s: BPE %s is not supported", path,
                           affixes[i]);
    }
    tok->bpe.ignore_merges = json_flag(model, "ignore_merges", false);

    json_t *vocab = json_object_get(model, "vocab");
    json_t *added = json_object_get(root, "added_tokens");
    if (!json_is_object(vocab))
        return kf_fail(err, KF_ERR_FORMAT, "%s: model.vocab is not an object", path);
    if (added && !json_is_null(added) && !json_is_array(added))
        return kf_fail(err, KF_ERR_FORMAT, "%s: added_tokens is not an array", path);

    /* Ids: the vocabulary, then added tokens (which may reuse vocabulary ids). */
    json_int_t max_id = -1;
    const char *key;
    json_t *val;
    json_object_foreach(vocab, key, val) {
        if (!json_is_integer(val) || json_integer_value(val) < 0 ||
            json_integer_value(val) >= INT32_MAX)
            return kf_fail(err, KF_ERR_FORMAT, "%s: vocab entry \"%s\" has no valid id", path, key);
        if (json_integer_value(val) > max_id)
            max_id = json_integer_value(val);
    }
    size_t n_added = json_is_array(added) ? json_array_size(added) : 0;
    for (size_t i = 0; i < n_added; i++) {
        json_t *a = json_array_get(added, i);
        json_t *id = json_object_get(a, "id"), *content = json_object_get(a, "content");
        if (!json_is_integer(id) || json_integer_value(id) < 0 ||
            json_integer_value(id) >= INT32_MAX || !json_is_string(content) ||
            json_string_length(content) == 0)
            return kf_fail(err, KF_ERR_FORMAT,
                           "%s: added_tokens[%zu] needs an integer id and a non-empty content",
                           path, i);
        if (json_integer_value(id) > max_id)
            max_id = json_integer_value(id);
    }
    tok->n_ids = (int32_t)(max_id + 1);
    tok->tok_off = malloc((size_t)tok->n_ids * sizeof *tok->tok_off + 1);
    tok->tok_len = calloc((size_t)tok->n_ids + 1, sizeof *tok->tok_len);
    tok->tok_flags = calloc((size_t)tok->n_ids + 1, 1);
    if (!tok->tok_off || !tok->tok_len || !tok->tok_flags)
        return kf_fail(err, KF_ERR_NOMEM, "%s: out of memory", path);
    for (int32_t i = 0; i < tok->n_ids; i++)
        tok->tok_off[i] = -1;

    json_object_foreach(vocab, key, val) {
        KF_TRY(set_token(tok, (int32_t)json_integer_value(val), key, strlen(key), 0, err));
    }
    for (int b = 0; b < 256; b++) {
        int32_t id;
        char c = (char)b;
        tok->bpe.byte_id[b] = kf_bmap_get(&tok->bpe.vocab, &c, 1, &id) ? id : -1;
    }
    tok->bpe.unk_id = -1;
    v = json_object_get(model, "unk_token");
    if (json_is_string(v)) {
        int32_t id;
        if (!kf_bmap_get(&tok->spelling, json_string_value(v), json_string_length(v), &id))
            return kf_fail(err, KF_ERR_FORMAT, "%s: unk_token \"%s\" is not in the vocabulary",
                           path, json_string_value(v));
        tok->bpe.unk_id = id;
    }

    /* Merges: rank = position; "a b" (split at the one space) or ["a", "b"]. */
    json_t *merges = json_object_get(model, "merges");
    if (!json_is_array(merges))
        return kf_fail(err, KF_ERR_FORMAT, "%s: model.merges is not an array", path);
    size_t n_merges = json_array_size(merges);
    if (!kf_pmap_reserve(&tok->bpe.merges, n_merges))
        return kf_fail(err, KF_ERR_NOMEM, "%s: out of memory", path);
    char *joined = NULL;
    size_t joined_cap = 0;
    for (size_t r = 0; r < n_merges; r++) {
        json_t *m = json_array_get(merges, r);
        const char *a, *b;
        size_t la, lb;
        if (json_is_string(m)) {
            const char *s = json_string_value(m);
            const char *sp = strchr(s, ' ');
            if (!sp || strchr(sp + 1, ' ')) {
                free(joined);
                return kf_fail(err, KF_ERR_FORMAT, "%s: merges[%zu] \"%s\" is not two tokens "
                               "separated by one space", path, r, s);
            }
            a = s;
            la = (size_t)(sp - s);
            b = sp + 1;
            lb = strlen(b);
        } else if (json_is_array(m) && json_array_size(m) == 2 &&
                   json_is_string(json_array_get(m, 0)) && json_is_string(json_array_get(m, 1))) {
            a = json_string_value(json_array_get(m, 0));
            la = json_string_length(json_array_get(m, 0));
            b = json_string_value(json_array_get(m, 1));
            lb = json_string_length(json_array_get(m, 1));
        } else {
            free(joined);
            return kf_fail(err, KF_ERR_FORMAT, "%s: merges[%zu] is neither \"a b\" nor [\"a\", \"b\"]",
                           path, r);
        }
        if (la + lb + 1 > joined_cap) {
            joined_cap = 2 * (la + lb + 1);
            char *j = realloc(joined, joined_cap);
            if (!j) {
                free(joined);
                return kf_fail(err, KF_ERR_NOMEM, "%s: out of memory", path);
            }
            joined = j;
        }
        memcpy(joined, a, la);
        memcpy(joined + la, b, lb);
        int32_t ia, ib, ij;
        if (!kf_bmap_get(&tok->spelling, a, la, &ia) || !kf_bmap_get(&tok->spelling, b, lb, &ib) ||
            !kf_bmap_get(&tok->spelling, joined, la + lb, &ij)) {
            free(joined);
            return kf_fail(err, KF_ERR_FORMAT,
                           "%s: merges[%zu] (\"%.*s\" + \"%.*s\") uses or makes a token that is "
                           "not in the vocabulary", path, r, (int)la, a, (int)lb, b);
        }
        kf_pmap_put(&tok->bpe.merges, ia, ib, (int32_t)r, ij);
    }
    free(joined);

    /* Added tokens. */
    tok->added = calloc(n_added + 1, sizeof *tok->added);
    if (!tok->added)
        return kf_fail(err, KF_ERR_NOMEM, "%s: out of memory", path);
    for (size_t i = 0; i < n_added; i++) {
        json_t *a = json_array_get(added, i);
        json_t *content = json_object_get(a, "content");
        kf_added *t = &tok->added[tok->n_added++];
        t->id = (int32_t)json_integer_value(json_object_get(a, "id"));
        t->len = json_string_length(content);
        t->content = malloc(t->len + 1);
        if (!t->content)
            return kf_fail(err, KF_ERR_NOMEM, "%s: out of memory", path);
        memcpy(t->content, json_string_value(content), t->len + 1);
        t->special = json_flag(a, "special", false);
        t->lstrip = json_flag(a, "lstrip", false);
        t->rstrip = json_flag(a, "rstrip", false);
        t->single_word = json_flag(a, "single_word", false);
        t->normalized = json_flag(a, "normalized", !t->special);
        if (kf_utf8_valid_prefix(t->content, t->len) != t->len)
            return kf_fail(err, KF_ERR_FORMAT, "%s: added_tokens[%zu] is not valid UTF-8", path, i);
        KF_TRY(set_token(tok, t->id, t->content, t->len,
                         (uint8_t)(KF_TF_ADDED | (t->special ? KF_TF_SPECIAL : 0)), err));
    }
    return KF_OK;
}

static kf_status load_normalizer(kf_tokenizer *tok, json_t *nz, kf_error *err) {
    if (!nz || json_is_null(nz))
        return KF_OK;
    const char *type = json_type_str(nz);
    if (!type)
        return kf_fail(err, KF_ERR_FORMAT, "%s: a normalizer has no type", tok->path);
    if (strcmp(type, "Sequence") == 0) {
        json_t *list = json_object_get(nz, "normalizers");
        if (!json_is_array(list))
            return kf_fail(err, KF_ERR_FORMAT, "%s: Sequence normalizer without a list", tok->path);
        for (size_t i = 0; i < json_array_size(list); i++)
            KF_TRY(load_normalizer(tok, json_array_get(list, i), err));
        return KF_OK;
    }
    kf_norm_kind kind;
    if (strcmp(type, "NFC") == 0)
        kind = KF_NORM_NFC;
    else if (strcmp(type, "NFD") == 0)
        kind = KF_NORM_NFD;
    else if (strcmp(type, "NFKC") == 0)
        kind = KF_NORM_NFKC;
    else if (strcmp(type, "NFKD") == 0)
        kind = KF_NORM_NFKD;
    else
        return kf_fail(err, KF_ERR_UNSUPPORTED, "%s: normalizer %s is not supported", tok->path,
                       type);
    kf_norm_kind *s = realloc(tok->norm.steps, (tok->norm.n + 1) * sizeof *s);
    if (!s)
        return kf_fail(err, KF_ERR_NOMEM, "%s: out of memory", tok->path);
    s[tok->norm.n++] = kind;
    tok->norm.steps = s;
    return KF_OK;
}

/* GPT-2's pattern, which ByteLevel uses when use_regex is true. */
static const char kf_gpt2_pattern[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

static kf_status add_pre_step(kf_tokenizer *tok, kf_pre_step step, kf_error *err) {
    kf_pre_step *s = realloc(tok->pre.steps, (tok->pre.n + 1) * sizeof *s);
    if (!s) {
        pcre2_code_free(step.re);
        return kf_fail(err, KF_ERR_NOMEM, "%s: out of memory", tok->path);
    }
    s[tok->pre.n++] = step;
    tok->pre.steps = s;
    return KF_OK;
}

static kf_status load_pretokenizer(kf_tokenizer *tok, json_t *pt, bool *byte_level,
                                   kf_error *err) {
    if (!pt || json_is_null(pt))
        return KF_OK;
    const char *type = json_type_str(pt);
    char what[600];
    if (!type)
        return kf_fail(err, KF_ERR_FORMAT, "%s: a pre_tokenizer has no type", tok->path);
    if (strcmp(type, "Sequence") == 0) {
        json_t *list = json_object_get(pt, "pretokenizers");
        if (!json_is_array(list))
            return kf_fail(err, KF_ERR_FORMAT, "%s: Sequence pre_tokenizer without a list",
                           tok->path);
        for (size_t i = 0; i < json_array_size(list); i++)
            KF_TRY(load_pretokenizer(tok, json_array_get(list, i), byte_level, err));
        return KF_OK;
    }
    if (strcmp(type, "Split") == 0) {
        json_t *behavior = json_object_get(pt, "behavior");
        if (!json_is_string(behavior) || strcmp(json_string_value(behavior), "Isolated") != 0)
            return kf_fail(err, KF_ERR_UNSUPPORTED,
                           "%s: Split pre_tokenizer behavior %s is not supported (only Isolated)",
                           tok->path, json_is_string(behavior) ? json_string_value(behavior) : "(none)");
        if (json_flag(pt, "invert", false))
            return kf_fail(err, KF_ERR_UNSUPPORTED, "%s: Split pre_tokenizer with invert is not "
                           "supported", tok->path);
        json_t *pat = json_object_get(pt, "pattern");
        json_t *rx = json_object_get(pat, "Regex"), *str = json_object_get(pat, "String");
        if (!json_is_string(rx) && !json_is_string(str))
            return kf_fail(err, KF_ERR_FORMAT, "%s: Split pre_tokenizer without a Regex or String "
                           "pattern", tok->path);
        snprintf(what, sizeof what, "%s: Split pattern", tok->path);
        kf_pre_step step = {.kind = KF_PRE_SPLIT};
        json_t *p = json_is_string(rx) ? rx : str;
        KF_TRY(kf_regex_compile(json_string_value(p), json_string_length(p), !json_is_string(rx),
                                &step.re, what, err));
        return add_pre_step(tok, step, err);
    }
    if (strcmp(type, "ByteLevel") == 0) {
        kf_pre_step step = {.kind = KF_PRE_BYTELEVEL,
                            .add_prefix_space = json_flag(pt, "add_prefix_space", true)};
        if (json_flag(pt, "use_regex", true)) {
            snprintf(what, sizeof what, "%s: ByteLevel pattern", tok->path);
            KF_TRY(kf_regex_compile(kf_gpt2_pattern, sizeof kf_gpt2_pattern - 1, false, &step.re,
                                    what, err));
        }
        *byte_level = true;
        return add_pre_step(tok, step, err);
    }
    return kf_fail(err, KF_ERR_UNSUPPORTED, "%s: pre_tokenizer %s is not supported", tok->path,
                   type);
}

static kf_status push_id(int32_t **list, size_t *n, int32_t id, const char *path, kf_error *err) {
    int32_t *l = realloc(*list, (*n + 1) * sizeof *l);
    if (!l)
        return kf_fail(err, KF_ERR_NOMEM, "%s: out of memory", path);
    l[(*n)++] = id;
    *list = l;
    return KF_OK;
}

static kf_status load_post(kf_tokenizer *tok, json_t *pp, kf_error *err) {
    if (!pp || json_is_null(pp))
        return KF_OK;
    const char *type = json_type_str(pp);
    if (!type)
        return kf_fail(err, KF_ERR_FORMAT, "%s: a post_processor has no type", tok->path);
    if (strcmp(type, "ByteLevel") == 0)
        return KF_OK; /* only adjusts offsets */
    if (strcmp(type, "Sequence") == 0) {
        json_t *list = json_object_get(pp, "processors");
        for (size_t i = 0; i < json_array_size(list); i++)
            KF_TRY(load_post(tok, json_array_get(list, i), err));
        return KF_OK;
    }
    if (strcmp(type, "TemplateProcessing") == 0) {
        json_t *single = json_object_get(pp, "single");
        if (!json_is_array(single))
            return kf_fail(err, KF_ERR_FORMAT, "%s: TemplateProcessing without \"single\"", tok->path);
        bool seen_seq = false;
        for (size_t i = 0; i < json_array_size(single); i++) {
            json_t *item = json_array_get(single, i);
            json_t *sp = json_object_get(item, "SpecialToken");
            if (json_is_object(json_object_get(item, "Sequence"))) {
                seen_seq = true;
                continue;
            }
            json_t *name = json_object_get(sp, "id");
            int32_t id;
            if (!json_is_string(name) ||
                !kf_bmap_get(&tok->spelling, json_string_value(name), json_string_length(name), &id))
                return kf_fail(err, KF_ERR_FORMAT, "%s: TemplateProcessing names an unknown token",
                               tok->path);
            if (seen_seq)
                KF_TRY(push_id(&tok->tpl_suffix, &tok->n_suffix, id, tok->path, err));
            else
                KF_TRY(push_id(&tok->tpl_prefix, &tok->n_prefix, id, tok->path, err));
        }
        return KF_OK;
    }
    return kf_fail(err, KF_ERR_UNSUPPORTED, "%s: post_processor %s is not supported", tok->path,
                   type);
}

static void build_added_set(kf_tokenizer *tok, kf_added_set *set, bool normalized) {
    set->n = 0;
    for (size_t i = 0; i < tok->n_added; i++)
        if (tok->added[i].normalized == normalized)
            set->order[set->n++] = (int32_t)i;
    /* Sort by first byte, then longest first (insertion sort: added tokens are few). */
    for (size_t i = 1; i < set->n; i++) {
        int32_t x = set->order[i];
        const kf_added *a = &tok->added[x];
        size_t j = i;
        while (j > 0) {
            const kf_added *b = &tok->added[set->order[j - 1]];
            unsigned char fa = (unsigned char)a->content[0], fb = (unsigned char)b->content[0];
            if (fb < fa || (fb == fa && b->len >= a->len))
                break;
            set->order[j] = set->order[j - 1];
            j--;
        }
        set->order[j] = x;
    }
    size_t k = 0;
    for (int b = 0; b <= 256; b++) {
        while (k < set->n && (unsigned char)tok->added[set->order[k]].content[0] < b)
            k++;
        set->first[b] = k;
    }
}

static kf_status load_config(kf_tokenizer *tok, const char *dir, kf_error *err) {
    char *path = path_join(dir, "tokenizer_config.json");
    if (!path)
        return kf_fail(err, KF_ERR_NOMEM, "out of memory");
    struct stat st;
    if (stat(path, &st) != 0) {
        free(path);
        return KF_OK; /* optional */
    }
    /* Integers can exceed 64 bits there (model_max_length 1e30): read numbers as reals. */
    json_t *root = load_json(path, JSON_DECODE_INT_AS_REAL, err);
    if (!root) {
        free(path);
        return err ? err->code : KF_ERR_FORMAT;
    }
    static const char *names[2] = {"bos_token", "eos_token"};
    int32_t *ids[2] = {&tok->bos_id, &tok->eos_id};
    kf_status s = KF_OK;
    for (int i = 0; i < 2 && s == KF_OK; i++) {
        json_t *v = json_object_get(root, names[i]);
        if (json_is_object(v))
            v = json_object_get(v, "content");
        if (!json_is_string(v))
            continue;
        if (!kf_bmap_get(&tok->spelling, json_string_value(v), json_string_length(v), ids[i]))
            s = kf_fail(err, KF_ERR_FORMAT, "%s: %s \"%s\" is not a token of tokenizer.json", path,
                        names[i], json_string_value(v));
    }
    json_decref(root);
    free(path);
    return s;
}

kf_status kf_tokenizer_open(kf_tokenizer **out, const char *path, kf_error *err) {
    *out = NULL;
    init_tables();
    struct stat st;
    if (stat(path, &st) != 0)
        return kf_fail(err, KF_ERR_IO, "%s: %s", path, strerror(errno));
    bool is_dir = S_ISDIR(st.st_mode);
    kf_tokenizer *tok = calloc(1, sizeof *tok);
    if (!tok)
        return kf_fail(err, KF_ERR_NOMEM, "out of memory");
    tok->bos_id = tok->eos_id = -1;
    tok->path = is_dir ? path_join(path, "tokenizer.json") : strdup(path);
    if (!tok->path) {
        free(tok);
        return kf_fail(err, KF_ERR_NOMEM, "out of memory");
    }
    kf_status s = KF_OK;
    json_t *root = load_json(tok->path, 0, err);
    if (!root) {
        s = err ? err->code : KF_ERR_FORMAT;
        goto fail;
    }
    if ((s = load_model(tok, root, err)) != KF_OK)
        goto fail;
    if ((s = load_normalizer(tok, json_object_get(root, "normalizer"), err)) != KF_OK)
        goto fail;
    bool byte_level = false;
    if ((s = load_pretokenizer(tok, json_object_get(root, "pre_tokenizer"), &byte_level, err)) !=
        KF_OK)
        goto fail;
    if (!byte_level) {
        s = kf_fail(err, KF_ERR_UNSUPPORTED,
                    "%s: only byte-level BPE is supported (no ByteLevel pre_tokenizer)", tok->path);
        goto fail;
    }
    tok->pre.md = pcre2_match_data_create(4, NULL);
    if (!tok->pre.md) {
        s = kf_fail(err, KF_ERR_NOMEM, "out of memory");
        goto fail;
    }
    if ((s = load_post(tok, json_object_get(root, "post_processor"), err)) != KF_OK)
        goto fail;
    json_t *dec = json_object_get(root, "decoder");
    const char *dtype = json_is_object(dec) ? json_type_str(dec) : NULL;
    if (!dtype || strcmp(dtype, "ByteLevel") != 0) {
        s = kf_fail(err, KF_ERR_UNSUPPORTED, "%s: decoder %s is not supported (only ByteLevel)",
                    tok->path, dtype ? dtype : "(none)");
        goto fail;
    }
    /* Added tokens marked "normalized" are searched in normalized text: normalize their content. */
    for (size_t i = 0; i < tok->n_added; i++) {
        kf_added *a = &tok->added[i];
        if (!a->normalized || tok->norm.n == 0)
            continue;
        char *n;
        size_t nl;
        if ((s = kf_normalize(&tok->norm, a->content, a->len, &n, &nl, err)) != KF_OK)
            goto fail;
        if (nl == 0) {
            free(n);
            continue;
        }
        free(a->content);
        a->content = n;
        a->len = nl;
    }
    tok->raw_set.order = malloc((tok->n_added + 1) * sizeof(int32_t));
    tok->norm_set.order = malloc((tok->n_added + 1) * sizeof(int32_t));
    if (!tok->raw_set.order || !tok->norm_set.order) {
        s = kf_fail(err, KF_ERR_NOMEM, "out of memory");
        goto fail;
    }
    build_added_set(tok, &tok->raw_set, false);
    build_added_set(tok, &tok->norm_set, true);
    json_decref(root);
    root = NULL;
    if (is_dir && (s = load_config(tok, path, err)) != KF_OK)
        goto fail;
    *out = tok;
    return KF_OK;
fail:
    json_decref(root);
    kf_tokenizer_close(tok);
    return s;
}

void kf_tokenizer_close(kf_tokenizer *tok) {
    if (!tok)
        return;
    free(tok->path);
    free(tok->tok_off);
    free(tok->tok_len);
    free(tok->tok_flags);
    free(tok->pool);
    kf_bmap_free(&tok->spelling);
    for (size_t i = 0; i < tok->n_added; i++)
        free(tok->added[i].content);
    free(tok->added);
    free(tok->raw_set.order);
    free(tok->norm_set.order);
    free(tok->norm.steps);
    kf_pretokenizer_free(&tok->pre);
    kf_bpe_free(&tok->bpe);
    free(tok->tpl_prefix);
    free(tok->tpl_suffix);
    kf_pieces_free(&tok->pieces);
    free(tok);
}

/* ---- encoding -------------------------------------------------------------------------------- */
