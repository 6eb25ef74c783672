#include "tools/cli.h"

#include "formats/escape.h"

#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef KVFOLD_HAVE_CUDA
#include "kernels/cuda/backend_cuda.h"
#endif

void (*cli_before_message)(void);
/* "kvfold <cmd>: <message>" with the whole message escaped (kf_escape): the ids, paths and file
 * strings a message quotes can neither act on the terminal nor forge a line. */
static void print_message(const char *cmd, const char *fmt, va_list ap) {
    char *msg = NULL;
    if (vasprintf(&msg, fmt, ap) < 0)
        msg = NULL;
    char *esc = msg ? malloc(4 * strlen(msg) + 8) : NULL;
    fprintf(stderr, "kvfold %s: %s\n", cmd, esc ? kf_escape(msg, esc, 4 * strlen(msg) + 8) : "(out of memory)");
    free(esc);
    free(msg);
}

void cli_error(const char *cmd, const char *fmt, ...) {
    va_list ap;
    if (cli_before_message)
        cli_before_message();
    va_start(ap, fmt);
    print_message(cmd, fmt, ap);
    va_end(ap);
}

int cli_usage_error(const char *cmd, const char *fmt, ...) {
    va_list ap;
    if (cli_before_message)
        cli_before_message();
    va_start(ap, fmt);
    print_message(cmd, fmt, ap);
    fprintf(stderr, "Try 'kvfold %s --help'.\n", cmd);
    va_end(ap);
    return KF_EXIT_USAGE;
}

int cli_parse_ids(const char *text, int32_t **ids, int *n, char *err, size_t err_len) {
    *ids = NULL;
    *n = 0;
    int cap = 0;
    const char *p = text;
    for (int comma = 0;;) { /* comma: one seen since the last id */
        while (isspace((unsigned char)*p))
            p++;
        if (*p == ',' || (!*p && comma)) {
            if (*p == ',' && *n > 0 && !comma) {
                comma = 1;
                p++;
                continue;
            }
            snprintf(err, err_len, "token id %d: an empty item (two commas, or a comma at either end)", *n + 1);
            goto fail;
        }
        if (!*p)
            break;
        comma = 0;
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
    return cli_load_model_on(cmd, dir, NULL, backend);
}

/* The CPU backend with KVFOLD_THREADS threads when set (else as many as OpenBLAS would use). */
static kf_backend *cli_cpu_backend(const char *cmd) {
    const char *env = getenv("KVFOLD_THREADS");
    long long n = 0;
    if (env && cli_parse_int(env, 1, 1024, &n) != 0) {
        cli_error(cmd, "KVFOLD_THREADS must be a whole number from 1 to 1024, not '%s'", env);
        return NULL;
    }
    kf_backend *b = kf_backend_cpu_create_threads((int)n);
    if (!b)
        cli_error(cmd, "out of memory");
    return b;
}

static kf_backend *cli_backend(const char *cmd, const char *device) {
    if (!device || strcmp(device, "cpu") == 0)
        return cli_cpu_backend(cmd);
    if (strncmp(device, "cuda", 4) != 0 || (device[4] && device[4] != ':')) {
        cli_error(cmd, "--device must be cpu, cuda or cuda:N, not '%s'", device);
        return NULL;
    }
#ifdef KVFOLD_HAVE_CUDA
    long long n = 0;
    if (device[4] && cli_parse_int(device + 5, 0, 1024, &n)) {
        cli_error(cmd, "--device: bad CUDA device number in '%s'", device);
        return NULL;
    }
    kf_error err = {0};
    kf_backend *b = kf_backend_cuda_create((int)n, &err);
    if (!b)
        cli_error(cmd, "%s", err.msg);
    return b;
#else
    cli_error(cmd, "--device %s: this kvfold was built without the CUDA backend (cmake -DKVFOLD_CUDA=ON)", device);
    return NULL;
#endif
}

static kf_weights g_weights = KF_WEIGHTS_AUTO; /* --weights */

int cli_weights_set(const char *arg) {
    return kf_weights_parse(arg, &g_weights) ? -1 : 0;
}

kf_weights cli_weights(void) {
    return g_weights;
}

kf_model *cli_load_model_on(const char *cmd, const char *dir, const char *device, kf_backend **backend) {
    *backend = cli_backend(cmd, device);
    if (!*backend)
        return NULL;
    kf_model *m = NULL;
    kf_error err = {0};
    const kf_model_opts opts = {.weights = g_weights};
    if (kf_model_load_opts(&m, dir, *backend, &opts, &err) != KF_OK) {
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

kf_quoka_params cli_prefill_defaults(void) {
    kf_quoka_params p = kf_quoka_params_default();
    p.mode = KF_PREFILL_DENSE;
    return p;
}

const kf_quoka_params *cli_prefill_params(const kf_quoka_params *p) {
    return p->mode == KF_PREFILL_QUOKA ? p : NULL;
}

char *cli_read_all(FILE *f, size_t *len) {
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap + 1);
    if (!buf)
        return NULL;
    for (;;) {
        if (n == cap) {
            cap *= 2;
            char *b = realloc(buf, cap + 1);
            if (!b) {
                free(buf);
                return NULL;
            }
            buf = b;
        }
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (got == 0)
            break;
    }
    if (ferror(f)) {
        free(buf);
        return NULL;
    }
    buf[n] = 0;
    *len = n;
    return buf;
}
