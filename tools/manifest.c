#include "tools/manifest.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void manifest_doc_free(manifest_doc *d) {
    free(d->ids);
    free(d->instr);
    for (int i = 0; i < d->n_probes; i++)
        free((void *)d->probes[i].ids);
    free(d->probes);
    char name[sizeof d->name];
    memcpy(name, d->name, sizeof name);
    memset(d, 0, sizeof *d);
    memcpy(d->name, name, sizeof name);
}

int manifest_parse_line(doc_text *t, const char *line, manifest_doc *d, char *err, size_t err_len) {
    memset(d, 0, sizeof *d);
    json_error_t jerr;
    json_t *o = json_loads(line, 0, &jerr);
    if (!o) {
        snprintf(err, err_len, "not JSON: %s (column %d)", jerr.text, jerr.column);
        return -1;
    }
    int rc = -1;
    char sub[400];
    json_t *id = json_object_get(o, "id"), *ids = json_object_get(o, "ids"), *text = json_object_get(o, "text");
    if (!json_is_object(o)) {
        snprintf(err, err_len, "not a JSON object");
        goto out;
    }
    if (json_is_string(id))
        snprintf(d->name, sizeof d->name, "%s", json_string_value(id));
    else if (json_is_integer(id))
        snprintf(d->name, sizeof d->name, "%lld", (long long)json_integer_value(id));
    if (ids) {
        if (!json_is_array(ids)) {
            snprintf(err, err_len, "\"ids\" must be a list of token ids");
            goto out;
        }
        if (json_array_size(ids) == 0) {
            snprintf(err, err_len, "empty document (\"ids\" is [])");
            goto out;
        }
        if (doc_json_prompt(t, ids, &d->ids, &d->n, sub, sizeof sub) || doc_as_document(t, &d->ids, &d->n, sub, sizeof sub)) {
            snprintf(err, err_len, "\"ids\": %s", sub);
            goto out;
        }
    } else if (json_is_string(text)) {
        if (json_string_length(text) == 0) {
            snprintf(err, err_len, "empty document (\"text\" is \"\")");
            goto out;
        }
        if (doc_tokenize(t, json_string_value(text), json_string_length(text), 1, &d->ids, &d->n, sub, sizeof sub)) {
            snprintf(err, err_len, "\"text\": %s", sub);
            goto out;
        }
    } else {
        snprintf(err, err_len, "needs \"ids\" (token ids) or \"text\"");
        goto out;
    }
    json_t *ri = json_object_get(o, "repeat_instruction_ids");
    if (!ri)
        ri = json_object_get(o, "repeat_instruction");
    if (ri && doc_json_prompt(t, ri, &d->instr, &d->n_instr, sub, sizeof sub)) {
        snprintf(err, err_len, "repeat instruction: %s", sub);
        goto out;
    }
    json_t *pr = json_object_get(o, "probes");
    if (pr) {
        if (!json_is_array(pr)) {
            snprintf(err, err_len, "\"probes\" must be a list");
            goto out;
        }
        d->probes = calloc(json_array_size(pr) + 1, sizeof *d->probes);
        size_t i;
        json_t *v;
        json_array_foreach(pr, i, v) {
            int32_t *p;
            int n;
            if (!d->probes || doc_json_prompt(t, v, &p, &n, sub, sizeof sub)) {
                snprintf(err, err_len, "probe %zu: %s", i, d->probes ? sub : "out of memory");
                goto out;
            }
            d->probes[d->n_probes++] = (kf_prompt){p, n};
        }
    }
    rc = 0;
out:
    json_decref(o);
    if (rc)
        manifest_doc_free(d);
    return rc;
}

/* Room for one more byte (and the NUL) in *buf, never beyond max + 1 bytes; -1 when out of memory. */
static int grow(char **buf, size_t *cap, size_t need, size_t max) {
    if (need <= *cap)
        return 0;
    size_t c = *cap < 4096 ? 4096 : *cap * 2;
    c = c > max + 1 ? max + 1 : c;
    char *g = realloc(*buf, c);
    if (!g)
        return -1;
    *buf = g;
    *cap = c;
    return 0;
}

int manifest_read_line(FILE *f, size_t max, char **buf, size_t *cap, size_t *len) {
    int why = LINE_OK, c, any = 0;
    size_t n = 0, seen = 0;
    if (grow(buf, cap, 1, max)) /* an empty line still gets its NUL */
        why = LINE_NOMEM;
    while ((c = getc_unlocked(f)) != EOF) {
        any = 1;
        if (c == '\n')
            break;
        seen++;
        if (why != LINE_OK) /* the rest of a refused line */
            continue;
        if (c == 0)
            why = LINE_NUL;
        else if (n >= max)
            why = LINE_TOO_LONG;
        else if (grow(buf, cap, n + 2, max))
            why = LINE_NOMEM;
        else
            (*buf)[n++] = (char)c;
    }
    if (!any)
        return LINE_EOF;
    if (*buf)
        (*buf)[n] = 0;
    *len = why == LINE_NUL ? n : why == LINE_OK ? n : seen;
    return why;
}

void manifest_line_error(int why, size_t len, size_t max, char *err, size_t err_len) {
    if (why == LINE_TOO_LONG)
        snprintf(err, err_len, "line of %zu bytes is longer than --max-line-bytes %zu: skipped", len, max);
    else if (why == LINE_NUL)
        snprintf(err, err_len, "holds a NUL byte at byte %zu: not a JSON line", len);
    else
        snprintf(err, err_len, "out of memory for a line of %zu bytes: skipped", len);
}
