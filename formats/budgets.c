#include "formats/budgets.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>

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
        int layer, head, used = 0;
        if (sscanf(key, "L%dH%d%n", &layer, &head, &used) != 2 || key[used] != 0) {
            rc = kf_fail(err, KF_ERR_FORMAT, "%s: key '%s' is not of the form L<layer>H<head>", path, key);
            goto out;
        }
        if (layer < 0 || layer >= n_layers || head < 0 || head >= kv_heads) {
            rc = kf_fail(err, KF_ERR_MISMATCH, "%s: key '%s' names a head the model does not have (%d layers, %d KV heads)",
                         path, key, n_layers, kv_heads);
            goto out;
        }
        if (!json_is_number(val) || json_number_value(val) < 0) {
            rc = kf_fail(err, KF_ERR_FORMAT, "%s: the share of '%s' must be a non-negative number", path, key);
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
