/* stall.c — an LD_PRELOAD shim for the Slurm test that makes kvfold's cache writes slow or stuck at
 * a chosen point, deterministically (the real writes are far too fast to cancel one mid-file):
 *   KF_STALL_PWRITE=N     the N-th pwrite of the process sleeps KF_STALL_SECONDS (default 120)
 *                         before writing: a writer stuck in the middle of a file; it creates the
 *                         file KF_STALL_MARK (when set) as it starts sleeping
 *   KF_FSYNC_DELAY_MS=M   every fsync sleeps M ms first: files appear spread out in time
 * The sleeps are plain nanosleep in the process, so a signal (scancel's SIGTERM) ends it at once. */
#include <dlfcn.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

typedef ssize_t (*pwrite_fn)(int, const void *, size_t, off_t);
typedef int (*fsync_fn)(int);

static long env_long(const char *name, long dflt) {
    const char *s = getenv(name);
    return s && *s ? strtol(s, NULL, 10) : dflt;
}

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

static void maybe_stall(void) {
    static long calls;
    const long n = env_long("KF_STALL_PWRITE", 0);
    if (n > 0 && ++calls == n) {
        const char *mark = getenv("KF_STALL_MARK");
        const int fd = mark && *mark ? open(mark, O_WRONLY | O_CREAT | O_CLOEXEC, 0644) : -1;
        if (fd >= 0)
            close(fd);
        sleep_ms(1000 * env_long("KF_STALL_SECONDS", 120));
    }
}

ssize_t pwrite(int fd, const void *buf, size_t count, off_t offset) {
    static pwrite_fn real;
    if (!real)
        *(void **)&real = dlsym(RTLD_NEXT, "pwrite");
    maybe_stall();
    return real(fd, buf, count, offset);
}

ssize_t pwrite64(int fd, const void *buf, size_t count, off_t offset) {
    static pwrite_fn real;
    if (!real)
        *(void **)&real = dlsym(RTLD_NEXT, "pwrite64");
    maybe_stall();
    return real(fd, buf, count, offset);
}

int fsync(int fd) {
    static fsync_fn real;
    if (!real)
        *(void **)&real = dlsym(RTLD_NEXT, "fsync");
    const long ms = env_long("KF_FSYNC_DELAY_MS", 0);
    if (ms > 0)
        sleep_ms(ms);
    return real(fd);
}
