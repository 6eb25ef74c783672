#include "formats/budgets.h"

#include <float.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

/* One decimal number without sign or leading zeros at *p, below 2^24; -1 when there is none. */
static int number(const char **p) {
    const char *s = *p;
    if (*s < '0' || *s > '9' || (s[0] == '0' && s[1] >= '0' && s[1] <= '9'))
        return -1;
    long v = 0;
    for (; *s >= '0' && *s <= '9'; s++)
        if ((v = v * 10 + (*s - '0')) >= (1L << 24))
            return -1;
    *p = s;
    return (int)v;
}

/* "L<layer>H<head>" in its one spelling (L00H0 and L+0H0 would alias L0H0); 0 or -1. */
static int parse_key(const char *key, int *layer, int *head) {
    const char *p = key;
    if (*p++ != 'L' || (*layer = number(&p)) < 0 || *p++ != 'H' || (*head = number(&p)) < 0 || *p)
        return -1;
    return 0;
}

kf_status kf_head_budgets_load(const char *path, int n_layers, int kv_heads, float *shares, kf_error *err) {
    json_error_t jerr;
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &jerr);
    if (!root && jerr.line <= 0)
        return kf_fail(err, KF_ERR_IO, "%s", jerr.text); /* jansson names the file and the errno */
    if (!root)
        return kf_fail(err, KF_ERR_FORMAT, "%s: not valid JSON (line %d: %s)", path, jerr.line, jerr.text);
    kf_status rc = KF_OK;
    const int n = n_layers * kv_heads;
    char *seen = calloc((size_t)n, 1);
    if (!seen) {
        json_decref(root);
        return kf_fail(err, KF_ERR_NOMEM, "%s: out of memory", path);
    }
    if (!json_is_object(root)) {
        rc = kf_fail(err, KF_ERR_FORMAT, "%s: expected an object of \"L<layer>H<head>\": share", path);
        goto out;
    }
    const char *key;
    json_t *val;
    json_object_foreach(root, key, val) {
        int layer, head;
        if (parse_key(key, &layer, &head)) {
            rc = kf_fail(err, KF_ERR_FORMAT,
                         "%s: key '%s' is not of the form L<layer>H<head> (decimal numbers without sign or leading "
                         "zeros, e.g. L0H3)",
                         path, key);
            goto out;
        }
        if (layer < 0 || layer >= n_layers || head < 0 || head >= kv_heads) {
            rc = kf_fail(err, KF_ERR_MISMATCH, "%s: key '%s' names a head the model does not have (%d layers, %d KV heads)",
                         path, key, n_layers, kv_heads);
            goto out;
        }
        if (seen[layer * kv_heads + head]) { /* in range (above); unreachable with canonical keys */
            rc = kf_fail(err, KF_ERR_FORMAT, "%s: key '%s' names a head given twice", path, key);
            goto out;
        }
        if (!json_is_number(val) || !(json_number_value(val) >= 0 && json_number_value(val) <= FLT_MAX)) {
            rc = kf_fail(err, KF_ERR_FORMAT, "%s: the share of '%s' must be a number from 0 to %g (a float), not %g",
                         path, key, (double)FLT_MAX, json_is_number(val) ? json_number_value(val) : NAN);
            goto out;
        }
        shares[layer * kv_heads + head] = (float)json_number_value(val);
        seen[layer * kv_heads + head] = 1;
    }
    double total = 0;
    for (int i = 0; i < n; i++) {
        if (!seen[i])
            shares[i] = 1.0f / n;
        total += shares[i];
    }
    if (!(total > 0)) {
        rc = kf_fail(err, KF_ERR_FORMAT, "%s: the shares sum to zero", path);
        goto out;
    }
    for (int i = 0; i < n; i++)
        shares[i] = (float)(shares[i] / total);
out:
    free(seen);
    json_decref(root);
    return rc;
}
