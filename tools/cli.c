#include "tools/cli.h"

#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

void cli_error(const char *cmd, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "kvfold %s: ", cmd);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

int cli_usage_error(const char *cmd, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "kvfold %s: ", cmd);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\nTry 'kvfold %s --help'.\n", cmd);
    va_end(ap);
    return KF_EXIT_USAGE;
}

int cli_parse_ids(const char *text, int32_t **ids, int *n, char *err, size_t err_len) {
    *ids = NULL;
    *n = 0;
    int cap = 0;
    const char *p = text;
    for (;;) {
        while (*p == ',' || isspace((unsigned char)*p))
            p++;
        if (!*p)
            break;
        errno = 0;
        char *end;
        long long v = strtoll(p, &end, 10);
        if (end == p || (*end && *end != ',' && !isspace((unsigned char)*end))) {
            snprintf(err, err_len, "token id %d: '%.20s' is not an integer", *n + 1, p);
            goto fail;
        }
        if (errno || v < 0 || v > INT32_MAX) {
            snprintf(err, err_len, "token id %d: %lld is out of range", *n + 1, v);
            goto fail;
        }
        if (*n == cap) {
            cap = cap ? cap * 2 : 64;
            int32_t *grown = realloc(*ids, sizeof(int32_t) * (size_t)cap);
            if (!grown) {
                snprintf(err, err_len, "out of memory");
                goto fail;
            }
            *ids = grown;
        }
        (*ids)[(*n)++] = (int32_t)v;
        p = end;
    }
    if (*n == 0) {
        snprintf(err, err_len, "no token ids given");
        goto fail;
    }
    return 0;
fail:
    free(*ids);
    *ids = NULL;
    *n = 0;
    return -1;
}

int cli_parse_int(const char *text, long long lo, long long hi, long long *out) {
    errno = 0;
    char *end;
    long long v = strtoll(text, &end, 10);
    if (end == text || *end || errno || v < lo || v > hi)
        return -1;
    *out = v;
    return 0;
}

kf_model *cli_load_model(const char *cmd, const char *dir, kf_backend **backend) {
    *backend = kf_backend_cpu_create();
    if (!*backend) {
        cli_error(cmd, "out of memory");
        return NULL;
    }
    kf_model *m = NULL;
    kf_error err = {0};
    if (kf_model_load(&m, dir, *backend, &err) != KF_OK) {
        cli_error(cmd, "cannot load model: %s", err.msg);
        (*backend)->destroy(*backend);
        *backend = NULL;
        return NULL;
    }
    return m;
}

double cli_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}
