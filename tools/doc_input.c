#include "tools/doc_input.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>

#include "tools/doc_chat.h"

void doc_text_init(doc_text *t, const char *model_dir, int vocab) {
    memset(t, 0, sizeof *t);
    t->model_dir = model_dir;
    t->vocab = vocab;
}

void doc_text_free(doc_text *t) {
    if (t->tok)
        kf_tokenizer_close(t->tok);
    memset(t, 0, sizeof *t);
}

static char *slurp(const char *path, size_t *len, char *err, size_t err_len) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, err_len, "%s: cannot open: %s", path, strerror(errno));
        return NULL;
    }
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap + 1);
    for (size_t got; buf && (got = fread(buf + n, 1, cap - n, f)) > 0;) {
        n += got;
        if (n == cap) {
            char *g = realloc(buf, cap * 2 + 1);
            if (!g) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = g;
            cap *= 2;
        }
    }
    const int bad = ferror(f);
    fclose(f);
    if (!buf || bad) {
        snprintf(err, err_len, "%s: cannot read%s", path, buf ? "" : " (out of memory)");
        free(buf);
        return NULL;
    }
    buf[n] = 0;
    *len = n;
    return buf;
}

static int open_tokenizer(doc_text *t, char *err, size_t err_len) {
    if (t->tok)
        return 0;
    kf_error e = {0};
    if (kf_tokenizer_open(&t->tok, t->model_dir, &e) != KF_OK) {
        snprintf(err, err_len, "text needs the model's tokenizer: %.200s", e.msg);
        t->tok = NULL;
        return -1;
    }
    char path[4096];
    size_t len = 0;
    snprintf(path, sizeof path, "%s/tokenizer.json", t->model_dir);
    char *bytes = slurp(path, &len, err, err_len);
    if (bytes) { /* identifies the tokenizer in the files it produced */
        XXH128_hash_t h = XXH3_128bits(bytes, len);
        snprintf(t->digest, sizeof t->digest, "%016llx%016llx", (unsigned long long)h.high64,
                 (unsigned long long)h.low64);
        free(bytes);
    }
    return 0;
}

int doc_tokenize(doc_text *t, const char *text, size_t len, int special, int32_t **ids, int *n, char *err,
                 size_t err_len) {
    *ids = NULL;
    *n = 0;
    if (special && t->chat)
        return doc_chat_document(t->chat, t, text, len, ids, n, err, err_len);
    if (open_tokenizer(t, err, err_len))
        return -1;
    kf_token_ids out = {0};
    kf_error e = {0};
    if (kf_tokenizer_encode(t->tok, text, len, special ? KF_TOK_ADD_SPECIAL : 0, &out, &e) != KF_OK) {
        snprintf(err, err_len, "%s", e.msg);
        kf_token_ids_free(&out);
        return -1;
    }
    if (out.n == 0) {
        snprintf(err, err_len, "empty text");
        kf_token_ids_free(&out);
        return -1;
    }
    if (out.n > INT32_MAX / 2) {
        snprintf(err, err_len, "%zu tokens is too long", out.n);
        kf_token_ids_free(&out);
        return -1;
    }
    *ids = out.ids;
    *n = (int)out.n;
    return 0;
}

int doc_json_prompt(doc_text *t, json_t *v, int32_t **ids, int *n, char *err, size_t err_len) {
    *ids = NULL;
    *n = 0;
    if (json_is_string(v))
        return doc_tokenize(t, json_string_value(v), json_string_length(v), 0, ids, n, err, err_len);
    if (!json_is_array(v)) {
        snprintf(err, err_len, "expected a string or a list of token ids");
        return -1;
    }
    const size_t cnt = json_array_size(v);
    if (cnt == 0) {
        snprintf(err, err_len, "empty list of token ids");
        return -1;
    }
    *ids = malloc(sizeof(int32_t) * cnt);
    if (!*ids) {
        snprintf(err, err_len, "out of memory");
        return -1;
    }
    size_t i;
    json_t *x;
    json_array_foreach(v, i, x) {
        const json_int_t id = json_is_integer(x) ? json_integer_value(x) : -1;
        if (!json_is_integer(x) || id < 0 || id >= t->vocab) {
            if (json_is_integer(x))
                snprintf(err, err_len, "token id %lld at position %zu is outside the vocabulary (0..%d)", (long long)id,
                         i, t->vocab - 1);
            else
                snprintf(err, err_len, "token %zu is not an integer id", i);
            free(*ids);
            *ids = NULL;
            return -1;
        }
        (*ids)[i] = (int32_t)id;
    }
    *n = (int)cnt;
    return 0;
}

int doc_as_document(doc_text *t, int32_t **ids, int *n, char *err, size_t err_len) {
    if (!t->chat)
        return 0;
    int32_t *w = NULL;
    int nw = 0;
    if (doc_chat_document_ids(t->chat, *ids, *n, &w, &nw)) {
        snprintf(err, err_len, "out of memory");
        return -1;
    }
    free(*ids);
    *ids = w;
    *n = nw;
    return 0;
}

const char *doc_text_digest(doc_text *t) {
    char err[256];
    char path[4096];
    snprintf(path, sizeof path, "%s/tokenizer.json", t->model_dir);
    if (!t->tok && access(path, F_OK) == 0)
        open_tokenizer(t, err, sizeof err); /* a broken one fails where it is used, with its cause */
    return t->digest;
}

int doc_read_text(doc_text *t, const char *path, int32_t **ids, int *n, char *err, size_t err_len) {
    *ids = NULL;
    *n = 0;
    size_t len = 0;
    char *bytes = slurp(path, &len, err, err_len);
    if (!bytes)
        return -1;
    char sub[400];
    int rc = -1;
    if (strlen(bytes) != len)
        snprintf(sub, sizeof sub, "holds a NUL byte: not text");
    else
        rc = doc_tokenize(t, bytes, len, 1, ids, n, sub, sizeof sub);
    if (rc)
        snprintf(err, err_len, "%s: %s", path, sub);
    free(bytes);
    return rc;
}

int doc_read_file(doc_text *t, const char *path, int32_t **ids, int *n, char *err, size_t err_len) {
    *ids = NULL;
    *n = 0;
    size_t len = 0;
    char *bytes = slurp(path, &len, err, err_len);
    if (!bytes)
        return -1;
    int rc = -1;
    const char *p = bytes + strspn(bytes, " \t\r\n");
    json_t *j = (*p == '[' || *p == '{') ? json_loadb(bytes, len, 0, NULL) : NULL;
    char sub[400];
    if (json_is_array(j)) {
        rc = doc_json_prompt(t, j, ids, n, sub, sizeof sub) || doc_as_document(t, ids, n, sub, sizeof sub) ? -1 : 0;
    } else if (json_is_object(j)) {
        json_t *v = json_object_get(j, "ids");
        if (v)
            rc = doc_json_prompt(t, v, ids, n, sub, sizeof sub) || doc_as_document(t, ids, n, sub, sizeof sub) ? -1 : 0;
        else if (json_is_string(v = json_object_get(j, "text")))
            rc = doc_tokenize(t, json_string_value(v), json_string_length(v), 1, ids, n, sub, sizeof sub);
        else
            snprintf(sub, sizeof sub, "a JSON document needs \"ids\" or \"text\"");
    } else if (strlen(bytes) != len) {
        snprintf(sub, sizeof sub, "holds a NUL byte: not text");
    } else {
        rc = doc_tokenize(t, bytes, len, 1, ids, n, sub, sizeof sub);
    }
    if (rc)
        snprintf(err, err_len, "%s: %s", path, sub);
    json_decref(j);
    free(bytes);
    return rc;
}

char *doc_decode(doc_text *t, const int32_t *ids, int n) {
    char e[256];
    if (open_tokenizer(t, e, sizeof e))
        return NULL;
    char *text = NULL;
    size_t len = 0;
    kf_error err = {0};
    if (kf_tokenizer_decode(t->tok, ids, (size_t)n, 0, &text, &len, &err) != KF_OK)
        return NULL;
    return text;
}

#include "compactor/cache_io.h"
#include "tools/cli.h"

int cache_load(const char *cmd, const char *path, kf_model *m, int verify, kf_compacted *c, kvf_header *hdr) {
    kvf_file *f = NULL;
    kf_error err = {0};
    const kf_hfconfig *cfg = kf_model_config(m);
    kf_status st = kvf_open(path, &f, &err);
    if (st == KF_OK) /* a file under another's content-addressed name is never served */
        st = kvf_check_name(path, kvf_file_header(f), &err);
    if (st == KF_OK && verify)
        st = kvf_verify(f, &err);
    if (st == KF_OK)
        st = kvf_check_model(f, kf_model_fingerprint(m), cfg->n_layers, cfg->n_kv_heads, cfg->head_dim, &err);
    if (st == KF_OK)
        st = kvf_check_positions(f, cfg->max_position_embeddings, &err);
    if (st == KF_OK && hdr)
        *hdr = *kvf_file_header(f);
    if (st == KF_OK && c)
        st = kf_compacted_load(f, c, &err);
    if (f)
        kvf_close(f);
    if (st != KF_OK) {
        cli_error(cmd, "%s", err.msg);
        return -1;
    }
    return 0;
}

int cache_check_tokenizer(const char *cmd, doc_text *t, const char *cache_path, const kvf_header *hdr) {
    const char *mine = doc_text_digest(t);
    if (!hdr->tokenizer_digest[0] || !mine[0] || !strcmp(hdr->tokenizer_digest, mine))
        return 0;
    cli_error(cmd,
              "%s: made with another tokenizer (tokenizer_digest %s) than the model's %s/tokenizer.json (%s): its "
              "token ids mean other text here",
              cache_path, hdr->tokenizer_digest, t->model_dir, mine);
    return -1;
}

int cache_doc_read(const char *cmd, doc_text *t, const char *doc_path, const char *cache_path, const kvf_header *hdr,
                   int32_t **ids, int *n, char digest[KVF_DIGEST_LEN + 1]) {
    char err[1024];
    if (doc_read_file(t, doc_path, ids, n, err, sizeof err)) {
        cli_error(cmd, "%s", err);
        return -1;
    }
    kvf_document_digest(*ids, *n, digest);
    if (strcmp(digest, hdr->document_digest) != 0 || *n != hdr->n_doc_tokens) {
        cli_error(cmd, "%s is not the document of %s (digest %s, %d tokens; the cache's: %s, %lld tokens)", doc_path,
                  cache_path, digest, *n, hdr->document_digest, (long long)hdr->n_doc_tokens);
        return -1;
    }
    return 0;
}

int stop_on_text(void *ctx, const int32_t *ids, int n) {
    stop_text *s = ctx;
    if (!s->stop || !*s->stop)
        return 0;
    char *text = doc_decode(s->text, ids, n);
    const int hit = text && strstr(text, s->stop) != NULL;
    free(text);
    return hit;
}

int model_eos_ids(kf_model *m, doc_text *t, int32_t *out) {
    const kf_hfconfig *cfg = kf_model_config(m);
    int n = 0;
    for (int i = 0; i < cfg->n_eos && n < 7; i++)
        out[n++] = cfg->eos_token_ids[i];
    char e[256];
    if (t && open_tokenizer(t, e, sizeof e) == 0 && kf_tokenizer_eos_id(t->tok) >= 0)
        out[n++] = kf_tokenizer_eos_id(t->tok);
    return n;
}
