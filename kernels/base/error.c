#include "kernels/base/error.h"

#include <stdio.h>
#include <string.h>

kf_status kf_fail(kf_error *err, kf_status code, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        err->code = code;
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
    }
    return code;
}

kf_status kf_error_prefix(kf_error *err, const char *fmt, ...) {
    if (!err)
        return KF_OK;
    char prefix[KF_ERROR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    char old[KF_ERROR_MSG_MAX];
    memcpy(old, err->msg, sizeof old);
    size_t n = strlen(prefix);
    if (n > sizeof err->msg - 3)
        n = sizeof err->msg - 3;
    memcpy(err->msg, prefix, n);
    memcpy(err->msg + n, ": ", 2);
    size_t room = sizeof err->msg - n - 3;
    size_t m = strnlen(old, room);
    memcpy(err->msg + n + 2, old, m);
    err->msg[n + 2 + m] = 0;
    return err->code;
}

const char *kf_status_name(kf_status s) {
    switch (s) {
    case KF_OK: return "ok";
    case KF_ERR_IO: return "io error";
    case KF_ERR_FORMAT: return "bad format";
    case KF_ERR_INVALID: return "invalid argument";
    case KF_ERR_UNSUPPORTED: return "unsupported";
    case KF_ERR_NOMEM: return "out of memory";
    case KF_ERR_NOSPACE: return "out of space";
    case KF_ERR_NOTFOUND: return "not found";
    case KF_ERR_MISMATCH: return "mismatch";
    }
    return "unknown status";
}
