/* jinja_render — formats/jinja.h over JSON lines, for tests/jinja_oracle.py.
 *
 *   jinja_render [--tokenizer PATH] < cases.jsonl > results.jsonl
 *
 * Each input line is {"template": "...", "context": {...}}; each output line is {"out": "..."} or
 * {"error": "...", "status": "unsupported" | "bad format" | ...}. A template equal to the previous
 * line's is parsed once. With --tokenizer (a model directory or tokenizer.json) each output also
 * carries "ids": the rendering encoded without the post-processor's template, as Hugging Face's
 * apply_chat_template tokenizes.
 */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats/jinja.h"
#include "formats/tokenizer.h"

static void emit(json_t *o) {
    char *s = json_dumps(o, JSON_COMPACT);
    puts(s);
    free(s);
    json_decref(o);
}

static json_t *failure(const kf_error *err) {
    return json_pack("{s:s, s:s}", "error", err->msg, "status", kf_status_name(err->code));
}

/* {"out": s} plus, with a tokenizer, "ids": [...] */
static json_t *rendered(kf_tokenizer *tok, const char *out, size_t len) {
    json_t *o = json_pack("{s:s%}", "out", out, len);
    if (!tok)
        return o;
    kf_token_ids ids = {0};
    kf_error err = {0};
    if (kf_tokenizer_encode(tok, out, len, 0, &ids, &err) != KF_OK) {
        json_decref(o);
        return failure(&err);
    }
    json_t *arr = json_array();
    for (size_t i = 0; i < ids.n; i++)
        json_array_append_new(arr, json_integer(ids.ids[i]));
    json_object_set_new(o, "ids", arr);
    kf_token_ids_free(&ids);
    return o;
}

int main(int argc, char **argv) {
    kf_tokenizer *tok = NULL;
    if (argc == 3 && strcmp(argv[1], "--tokenizer") == 0) {
        kf_error err = {0};
        if (kf_tokenizer_open(&tok, argv[2], &err) != KF_OK) {
            fprintf(stderr, "jinja_render: %s\n", err.msg);
            return 2;
        }
    } else if (argc != 1) {
        fprintf(stderr, "usage: jinja_render [--tokenizer PATH] < cases.jsonl\n");
        return 2;
    }
    char *line = NULL, *last = NULL;
    size_t cap = 0;
    ssize_t n;
    kf_jinja *t = NULL;
    kf_error perr = {0};
    kf_status pst = KF_OK;
    while ((n = getline(&line, &cap, stdin)) > 0) {
        json_error_t je;
        json_t *in = json_loadb(line, (size_t)n, JSON_ALLOW_NUL, &je);
        json_t *tmpl = json_object_get(in, "template"), *ctx = json_object_get(in, "context");
        if (!in || !json_is_string(tmpl) || !json_is_object(ctx)) {
            fprintf(stderr, "jinja_render: bad input line: %s\n", in ? "needs template and context" : je.text);
            return 2;
        }
        if (!last || strcmp(last, json_string_value(tmpl)) != 0) {
            kf_jinja_free(t);
            t = NULL;
            free(last);
            last = strdup(json_string_value(tmpl));
            memset(&perr, 0, sizeof perr);
            pst = kf_jinja_parse(json_string_value(tmpl), json_string_length(tmpl), &t, &perr);
        }
        if (pst != KF_OK)
            emit(failure(&perr));
        else {
            char *cs = json_dumps(ctx, JSON_COMPACT);
            char *out;
            size_t out_len;
            kf_error err = {0};
            if (kf_jinja_render(t, cs, strlen(cs), NULL, &out, &out_len, &err) == KF_OK) {
                emit(rendered(tok, out, out_len));
                free(out);
            } else
                emit(failure(&err));
            free(cs);
        }
        json_decref(in);
    }
    kf_jinja_free(t);
    kf_tokenizer_close(tok);
    free(last);
    free(line);
    return 0;
}
