/* doc_chat.c — the chat template's pieces around a document and its questions (doc_chat.h). */
#include "tools/doc_chat.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Contents no text holds: where the template puts them is where the pieces are cut. */
#define S_DOC "kvfoldSentinelDocument7f3a"
#define S_Q "kvfoldSentinelQuestion7f3a"
#define S_I "kvfoldSentinelInstruction7f3a"
#define S_R "kvfoldSentinelRepeat7f3a"

/* Renders the turns (role, content of clen bytes; n of them) into a malloc'ed string. */
static char *render(const doc_chat *c, const char *const *roles, const char *const *contents, const size_t *clen,
                    int n, int gen, size_t *len, char *err, size_t err_len) {
    json_t *msgs = json_array();
    int bad = !msgs;
    for (int i = 0; !bad && i < n; i++) /* json_pack refuses text that is not UTF-8 */
        bad = json_array_append_new(msgs, json_pack("{s:s, s:s#}", "role", roles[i], "content", contents[i], clen[i]));
    char *conv = bad ? NULL : json_dumps(msgs, JSON_COMPACT), *out = NULL;
    json_decref(msgs);
    kf_error e = {0};
    if (!conv)
        snprintf(err, err_len, "%s", bad && msgs ? "the text is not UTF-8" : "out of memory");
    else if (kf_chat_render(c->chat, conv, strlen(conv), gen, &out, len, &e) != KF_OK)
        snprintf(err, err_len, "the chat template: %s", e.msg);
    free(conv);
    return out;
}

static char *dup_n(const char *s, size_t n) {
    char *d = malloc(n + 1);
    if (d) {
        memcpy(d, s, n);
        d[n] = 0;
    }
    return d;
}

/* s cut at its sentinels (each exactly once, in order) into n + 1 malloc'ed pieces. */
static int cut(const char *s, const char *const *sent, int n, char **pieces, char *err, size_t err_len) {
    const char *p = s;
    for (int i = 0; i <= n; i++) {
        const char *q = i < n ? strstr(p, sent[i]) : p + strlen(p);
        if (!q || (i < n && strstr(q + strlen(sent[i]), sent[i]))) {
            snprintf(err, err_len, "the chat template does not write a turn's content exactly once as it is");
            return -1;
        }
        if (!(pieces[i] = dup_n(p, (size_t)(q - p))))
            return snprintf(err, err_len, "out of memory"), -1;
        p = i < n ? q + strlen(sent[i]) : q;
    }
    return 0;
}

/* Text to ids without the tokenizer's template; "" is no ids. */
static int tokenize(doc_text *t, const char *s, int32_t **ids, int *n, char *err, size_t err_len) {
    *ids = NULL;
    *n = 0;
    return *s ? doc_tokenize(t, s, strlen(s), 0, ids, n, err, err_len) : 0;
}

static int cut_question(doc_chat *c, char *err, size_t err_len) {
    static const char *const roles[] = {"user", "user"}, *const contents[] = {S_DOC, S_Q},
                             *const sent[] = {S_DOC, S_Q};
    const size_t clen[] = {strlen(S_DOC), strlen(S_Q)};
    size_t len;
    char *s = render(c, roles, contents, clen, 2, 1, &len, err, err_len), *pieces[3] = {0};
    const int rc = s ? cut(s, sent, 2, pieces, err, err_len) : -1;
    c->a = pieces[0], c->h = pieces[1], c->t = pieces[2];
    free(s);
    return rc;
}

static int cut_instruction(doc_chat *c, char *err, size_t err_len) {
    static const char *const roles[] = {"user", "user", "assistant"}, *const contents[] = {S_DOC, S_I, S_R},
                             *const sent[] = {S_DOC, S_I, S_R};
    const size_t clen[] = {strlen(S_DOC), strlen(S_I), strlen(S_R)};
    size_t len;
    char *s = render(c, roles, contents, clen, 3, 0, &len, err, err_len), *pieces[4] = {0};
    int rc = s ? cut(s, sent, 3, pieces, err, err_len) : -1;
    if (rc == 0 && strcmp(pieces[0], c->a) != 0) {
        snprintf(err, err_len, "the chat template writes another beginning before a repeat than before a question");
        rc = -1;
    }
    c->b1 = pieces[1], c->b2 = pieces[2];
    free(pieces[0]);
    free(pieces[3]);
    free(s);
    return rc;
}

int doc_chat_open(doc_chat *c, doc_text *t, char *err, size_t err_len) {
    memset(c, 0, sizeof *c);
    kf_error e = {0};
    const kf_status st = kf_chat_open(&c->chat, t->model_dir, &e);
    if (st != KF_OK) {
        snprintf(err, err_len, "%s%s", st == KF_ERR_NOTFOUND ? "--chat needs the model's chat template: " : "",
                 e.msg);
        c->chat = NULL;
        return st == KF_ERR_NOTFOUND ? DOC_CHAT_NO_TEMPLATE : -1;
    }
    snprintf(c->digest, sizeof c->digest, "%s", kf_chat_digest(c->chat));
    if (cut_question(c, err, err_len) || cut_instruction(c, err, err_len) ||
        tokenize(t, c->a, &c->prefix, &c->n_prefix, err, err_len) ||
        tokenize(t, c->h, &c->qhead, &c->n_qhead, err, err_len) ||
        tokenize(t, c->t, &c->qtail, &c->n_qtail, err, err_len) ||
        tokenize(t, c->b1, &c->ihead, &c->n_ihead, err, err_len) ||
        tokenize(t, c->b2, &c->itail, &c->n_itail, err, err_len))
        return -1;
    kvf_header h; /* the record must fit the file's attributes */
    if (doc_ids_join(c->prefix, c->n_prefix, h.chat_prefix_ids, sizeof h.chat_prefix_ids) ||
        doc_ids_join(c->qhead, c->n_qhead, h.chat_question_prefix_ids, sizeof h.chat_question_prefix_ids) ||
        doc_ids_join(c->qtail, c->n_qtail, h.chat_question_suffix_ids, sizeof h.chat_question_suffix_ids)) {
        snprintf(err, err_len, "the chat template's pieces are too long for a cache file's record");
        return -1;
    }
    return 0;
}

void doc_chat_free(doc_chat *c) {
    kf_chat_close(c->chat);
    free(c->a), free(c->h), free(c->t), free(c->b1), free(c->b2);
    free(c->prefix), free(c->qhead), free(c->qtail), free(c->ihead), free(c->itail);
    memset(c, 0, sizeof *c);
}

/* head + ids + tail into a new array. */
static int join3(const int32_t *h, int nh, const int32_t *ids, int n, const int32_t *tl, int nt, int32_t **out,
                 int *n_out) {
    *n_out = nh + n + nt;
    if (!(*out = malloc(sizeof(int32_t) * (size_t)(*n_out + 1))))
        return -1;
    if (nh) /* memcpy's pointers must not be NULL, even for 0 bytes */
        memcpy(*out, h, sizeof(int32_t) * (size_t)nh);
    if (n)
        memcpy(*out + nh, ids, sizeof(int32_t) * (size_t)n);
    if (nt)
        memcpy(*out + nh + n, tl, sizeof(int32_t) * (size_t)nt);
    return 0;
}

int doc_chat_document_ids(const doc_chat *c, const int32_t *ids, int n, int32_t **out, int *n_out) {
    return join3(c->prefix, c->n_prefix, ids, n, NULL, 0, out, n_out);
}

int doc_chat_question(const doc_chat *c, const int32_t *ids, int n, int32_t **out, int *n_out) {
    return join3(c->qhead, c->n_qhead, ids, n, c->qtail, c->n_qtail, out, n_out);
}

int doc_chat_instruction(const doc_chat *c, const int32_t *ids, int n, int32_t **out, int *n_out) {
    return join3(c->ihead, c->n_ihead, ids, n, c->itail, c->n_itail, out, n_out);
}

int doc_chat_document(doc_chat *c, doc_text *t, const char *text, size_t len, int32_t **ids, int *n, char *err,
                      size_t err_len) {
    *ids = NULL;
    *n = 0;
    static const char *const roles[] = {"user", "user"};
    const char *contents[] = {text, S_Q};
    const size_t clen[] = {len, strlen(S_Q)};
    size_t rlen;
    char *s = render(c, roles, contents, clen, 2, 1, &rlen, err, err_len);
    if (!s)
        return -1;
    const size_t na = strlen(c->a), nh = strlen(c->h), nt = strlen(c->t), nq = strlen(S_Q);
    const size_t tail = nh + nq + nt;
    int rc = -1;
    if (rlen < na + tail || memcmp(s, c->a, na) != 0 || memcmp(s + rlen - tail, c->h, nh) != 0 ||
        memcmp(s + rlen - nt - nq, S_Q, nq) != 0 || memcmp(s + rlen - nt, c->t, nt) != 0)
        snprintf(err, err_len, "the chat template does not write this document between its usual pieces");
    else if (rlen == na + tail)
        snprintf(err, err_len, "empty document (as the chat template writes it)");
    else {
        s[rlen - tail] = 0; /* X: what the template made of the document */
        int32_t *x = NULL;
        int nx = 0;
        rc = tokenize(t, s + na, &x, &nx, err, err_len);
        if (rc == 0 && doc_chat_document_ids(c, x, nx, ids, n)) {
            snprintf(err, err_len, "out of memory");
            rc = -1;
        }
        free(x);
    }
    free(s);
    return rc;
}

int doc_ids_join(const int32_t *ids, int n, char *out, size_t cap) {
    size_t at = 0;
    out[0] = 0;
    for (int i = 0; i < n; i++) {
        const int w = snprintf(out + at, cap - at, i ? ",%d" : "%d", (int)ids[i]);
        if (w < 0 || (size_t)w >= cap - at)
            return -1;
        at += (size_t)w;
    }
    return 0;
}

void doc_chat_record(const doc_chat *c, kvf_header *h) {
    snprintf(h->chat_template_digest, sizeof h->chat_template_digest, "%s", c->digest);
    doc_ids_join(c->prefix, c->n_prefix, h->chat_prefix_ids, sizeof h->chat_prefix_ids);
    doc_ids_join(c->qhead, c->n_qhead, h->chat_question_prefix_ids, sizeof h->chat_question_prefix_ids);
    doc_ids_join(c->qtail, c->n_qtail, h->chat_question_suffix_ids, sizeof h->chat_question_suffix_ids);
}

/* A recorded id list into *ids [*n] (replacing what was there). */
static int record_ids(const char *s, int32_t **ids, int *n) {
    const int k = kvf_parse_ids(s, NULL, KVF_CHAT_IDS_LEN);
    int32_t *a = k >= 0 ? malloc(sizeof(int32_t) * (size_t)(k + 1)) : NULL;
    if (!a)
        return -1;
    kvf_parse_ids(s, a, k);
    free(*ids);
    *ids = a;
    *n = k;
    return 0;
}

int doc_chat_for_cache(doc_chat *c, doc_text *t, const kvf_header *h, char *err, size_t err_len) {
    const int rc = doc_chat_open(c, t, err, err_len);
    if (rc)
        return rc;
    if (strcmp(c->digest, h->chat_template_digest) != 0) {
        snprintf(err, err_len,
                 "made with another chat template (chat_template_digest %s) than the model's (%s): compact the "
                 "document again with this model's template",
                 h->chat_template_digest, c->digest);
        return -1;
    }
    if (record_ids(h->chat_prefix_ids, &c->prefix, &c->n_prefix) ||
        record_ids(h->chat_question_prefix_ids, &c->qhead, &c->n_qhead) ||
        record_ids(h->chat_question_suffix_ids, &c->qtail, &c->n_qtail)) {
        snprintf(err, err_len, "out of memory");
        return -1;
    }
    return 0;
}
