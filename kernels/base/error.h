/* error.h — statuses and error messages shared by every kvfold library.
 *
 * Library code never prints or exits. A function that can fail returns a
 * kf_status and, when given a kf_error, writes one human-readable message
 * that names the file (or object) and the defect. The CLI and the tests
 * decide what to do with it.
 *
 *   kf_error err = {0};
 *   if (kf_st_open_file(&set, path, &err) != KF_OK) { fprintf(stderr, "%s\n", err.msg); ... }
 */
#ifndef KF_ERROR_H
#define KF_ERROR_H

#include <stdarg.h>
#include <stddef.h>

typedef enum {
    KF_OK = 0,
    KF_ERR_IO,          /* open/read/write/mmap failed (errno in the message) */
    KF_ERR_FORMAT,      /* a file is malformed, truncated or inconsistent */
    KF_ERR_INVALID,     /* a caller passed a bad argument */
    KF_ERR_UNSUPPORTED, /* well-formed but not (yet) supported: dtype, model type, rope type */
    KF_ERR_NOMEM,       /* allocation failed */
    KF_ERR_NOSPACE,     /* a fixed-size pool (the KV arena) is exhausted */
    KF_ERR_NOTFOUND,    /* a named item (tensor, file, token) does not exist */
    KF_ERR_MISMATCH,    /* two things that must agree do not (model vs cache file) */
} kf_status;

#define KF_ERROR_MSG_MAX 512

typedef struct {
    kf_status code;
    char msg[KF_ERROR_MSG_MAX];
} kf_error;

/* Records code and a printf-style message in err (err may be NULL) and returns code. */
kf_status kf_fail(kf_error *err, kf_status code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Prepends "context: " to an existing message (for callers that add the file name). */
kf_status kf_error_prefix(kf_error *err, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* A short name for a status: "io error", "bad format", ... */
const char *kf_status_name(kf_status s);

/* Propagate a failing status: KF_TRY(kf_st_open_file(...)); */
#define KF_TRY(expr)                       \
    do {                                   \
        kf_status kf_try_s_ = (expr);      \
        if (kf_try_s_ != KF_OK)            \
            return kf_try_s_;              \
    } while (0)

#endif
