#include "bt_common.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static _Thread_local char g_err[1024];
static int g_level = -1;
static pthread_mutex_t g_log_mu = PTHREAD_MUTEX_INITIALIZER;

const char *bt_strerror(int err) {
    switch (err) {
    case BT_OK: return "ok";
    case BT_ERR_IO: return "io";
    case BT_ERR_FORMAT: return "format";
    case BT_ERR_NOMEM: return "nomem";
    case BT_ERR_RANGE: return "range";
    case BT_ERR_UNSUPPORTED: return "unsupported";
    case BT_ERR_INVALID: return "invalid";
    case BT_ERR_NOTFOUND: return "notfound";
    case BT_ERR_TIMEOUT: return "timeout";
    case BT_ERR_CLOSED: return "closed";
    case BT_ERR_CANCELLED: return "cancelled";
    default: return "unknown";
    }
}

int bt_fail(int err, const char *fmt, ...) {
    /* Format into a local buffer first: callers may pass bt_last_error() as an argument. */
    char tmp[sizeof g_err];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    memcpy(g_err, tmp, sizeof g_err);
    return err;
}

const char *bt_last_error(void) { return g_err; }

void bt_log_set_level(int level) { g_level = level; }

static int log_level(void) {
    if (g_level >= 0) return g_level;
    const char *e = getenv("BT_LOG_LEVEL");
    int l = BT_LOG_INFO;
    if (e) {
        if (!strcasecmp(e, "debug")) l = BT_LOG_DEBUG;
        else if (!strcasecmp(e, "warn")) l = BT_LOG_WARN;
        else if (!strcasecmp(e, "error")) l = BT_LOG_ERROR;
    }
    g_level = l;
    return l;
}

void bt_log(int level, const char *component, const char *fmt, ...) {
    if (level < log_level()) return;
    static const char *names[] = {"debug", "info", "warn", "error"};
    char ts[32];
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    struct tm tm;
    gmtime_r(&now.tv_sec, &tm);
    strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%S", &tm);
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&g_log_mu);
    fprintf(stderr, "%s.%03ldZ %s %s: %s\n", ts, now.tv_nsec / 1000000L,
            names[level < 0 ? 0 : level > 3 ? 3 : level], component, msg);
    pthread_mutex_unlock(&g_log_mu);
}

double bt_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void oom(size_t n) {
    fprintf(stderr, "fatal: out of memory allocating %zu bytes\n", n);
    abort();
}
void *bt_xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) oom(n);
    return p;
}
void *bt_xcalloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) oom(n * size);
    return p;
}
void *bt_xrealloc(void *p, size_t n) {
    void *q = realloc(p, n ? n : 1);
    if (!q) oom(n);
    return q;
}
char *bt_xstrdup(const char *s) {
    char *p = strdup(s);
    if (!p) oom(strlen(s));
    return p;
}
void *bt_aligned_alloc(size_t n) {
    size_t r = (n + 63) & ~(size_t)63;
    void *p = aligned_alloc(64, r ? r : 64);
    if (p) memset(p, 0, r ? r : 64);
    return p;
}

uint64_t bt_fnv1a64(uint64_t h, const void *data, size_t n) {
    const uint8_t *p = data;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 0x100000001b3ULL;
    }
    return h;
}

int bt_map_open(bt_map *m, const char *path) {
    m->data = NULL;
    m->size = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return bt_fail(BT_ERR_IO, "%s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return bt_fail(BT_ERR_IO, "%s: fstat: %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return bt_fail(BT_ERR_IO, "%s: not a regular file", path);
    }
    if (st.st_size > 0) {
        void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) {
            int e = errno;
            close(fd);
            return bt_fail(BT_ERR_IO, "%s: mmap: %s", path, strerror(e));
        }
        m->data = p;
        m->size = (size_t)st.st_size;
    }
    close(fd);
    return BT_OK;
}

void bt_map_close(bt_map *m) {
    if (m->data) munmap((void *)m->data, m->size);
    m->data = NULL;
    m->size = 0;
}
