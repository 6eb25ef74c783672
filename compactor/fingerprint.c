/* fingerprint.c — the model fingerprint cache (see fingerprint.h). */
#include "compactor/fingerprint.h"

#include <errno.h>
#include <stdarg.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#define KEY_MAX 65536

typedef struct {
    char *buf;
    size_t len, cap;
    bool ok;
} text;

static void put(text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(text *t, const char *fmt, ...) {
    if (!t->ok)
        return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(t->buf + t->len, t->cap - t->len, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= t->cap - t->len)
        t->ok = false;
    else
        t->len += (size_t)n;
}

/* "file <name> <size> <mtime_ns> <inode> <ctime_ns>"; false when the file cannot be stat'ed. The
 * ctime moves with any change to the file, even one that puts its mtime back; the inode with a
 * file replaced by another. */
static bool put_file(text *t, const char *path, const char *name) {
    struct stat sb;
    if (stat(path, &sb) != 0)
        return false;
    long long mt = (long long)sb.st_mtim.tv_sec * 1000000000LL + sb.st_mtim.tv_nsec;
    long long ct = (long long)sb.st_ctim.tv_sec * 1000000000LL + sb.st_ctim.tv_nsec;
    put(t, "file %s %lld %lld %llu %lld\n", name, (long long)sb.st_size, mt, (unsigned long long)sb.st_ino, ct);
    return true;
}

static bool build_key(const char *real, const char *const *files, int n_files, text *t) {
    char p[PATH_MAX + 64];
    put(t, "kvfold-fingerprint 2\ndir %s\n", real);
    snprintf(p, sizeof p, "%s/config.json", real);
    if (!put_file(t, p, "config.json"))
        return false;
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", real);
    put_file(t, p, "model.safetensors.index.json"); /* only when sharded */
    for (int i = 0; i < n_files; i++) {
        const char *base = strrchr(files[i], '/');
        if (!put_file(t, files[i], base ? base + 1 : files[i]))
            return false;
    }
    return t->ok;
}

/* The cached fingerprint in path when its key matches. */
static bool lookup(const char *path, const text *key, char out[33]) {
    FILE *fp = fopen(path, "rb");
    if (!fp)
        return false;
    char *buf = malloc(KEY_MAX + 64);
    size_t n = buf ? fread(buf, 1, KEY_MAX + 63, fp) : 0;
    fclose(fp);
    bool ok = false;
    if (buf && n > key->len && memcmp(buf, key->buf, key->len) == 0) {
        buf[n] = 0;
        char fp_hex[33];
        const char *rest = buf + key->len;
        if (sscanf(rest, "fingerprint %32[0-9a-f]", fp_hex) == 1 && strlen(fp_hex) == 32 &&
            strcmp(rest + 12 + 32, "\n") == 0) {
            memcpy(out, fp_hex, 33);
            ok = true;
        }
    }
    free(buf);
    return ok;
}

/* Writes text atomically to path; false on any failure (nothing left behind). */
static bool store(const char *path, const char *data, size_t len) {
    uint64_t rnd = 0;
    if (getrandom(&rnd, sizeof rnd, GRND_NONBLOCK) != (ssize_t)sizeof rnd)
        rnd = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
    char tmp[PATH_MAX + 64];
    snprintf(tmp, sizeof tmp, "%s.tmp-%ld-%016llx", path, (long)getpid(), (unsigned long long)rnd);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0)
        return false;
    bool ok = write(fd, data, len) == (ssize_t)len;
    ok = close(fd) == 0 && ok;
    if (ok && rename(tmp, path) == 0)
        return true;
    unlink(tmp);
    return false;
}

static bool user_cache_path(const char *real, char *out, size_t n, bool create) {
    const char *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    char base[PATH_MAX];
    if (xdg && *xdg)
        snprintf(base, sizeof base, "%s/kvfold/fingerprints", xdg);
    else if (home && *home)
        snprintf(base, sizeof base, "%s/.cache/kvfold/fingerprints", home);
    else
        return false;
    if (create) {
        for (char *p = base + 1; *p; p++)
            if (*p == '/') {
                *p = 0;
                mkdir(base, 0755);
                *p = '/';
            }
        if (mkdir(base, 0755) != 0 && errno != EEXIST)
            return false;
    }
    int m = snprintf(out, n, "%s/%016llx", base, (unsigned long long)XXH3_64bits(real, strlen(real)));
    return m > 0 && (size_t)m < n;
}

kf_status kf_fingerprint_cached(const char *dir, const char *const *files, int n_files, kf_fingerprint_fn compute,
                                void *ctx, char out[33], bool *hit, kf_error *err) {
    out[0] = 0;
    if (hit)
        *hit = false;
    char real[PATH_MAX];
    text key = {.cap = KEY_MAX, .ok = true};
    bool keyed = realpath(dir, real) != NULL && (key.buf = malloc(KEY_MAX)) != NULL &&
                 build_key(real, files, n_files, &key);
    char in_dir[PATH_MAX + 64], in_user[PATH_MAX + 64];
    bool have_user = keyed && user_cache_path(real, in_user, sizeof in_user, false);
    if (keyed) {
        snprintf(in_dir, sizeof in_dir, "%s/%s", real, KF_FINGERPRINT_FILE);
        if (lookup(in_dir, &key, out) || (have_user && lookup(in_user, &key, out))) {
            if (hit)
                *hit = true;
            free(key.buf);
            return KF_OK;
        }
    }
    compute(ctx, out);
    if (!out[0]) {
        free(key.buf);
        return kf_fail(err, KF_ERR_NOMEM, "%s: cannot compute the model fingerprint", dir);
    }
    if (keyed) {
        put(&key, "fingerprint %s\n", out);
        if (key.ok && !store(in_dir, key.buf, key.len) &&
            user_cache_path(real, in_user, sizeof in_user, true))
            store(in_user, key.buf, key.len);
    }
    free(key.buf);
    return KF_OK;
}
