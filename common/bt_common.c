#include "bt_common.h"

#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdatomic.h>
#include <linux/openat2.h>
#include <sys/syscall.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <time.h>
#include <unistd.h>

static _Thread_local char g_err[1024];
static int g_level = -1;
static pthread_mutex_t g_log_mu = PTHREAD_MUTEX_INITIALIZER;

/* How many bytes of m to skip so that it does not start with the same "<part>: " twice (a
 * message wrapped by a caller that adds the part its callee already wrote: "token cache: token
 * cache: x" -> "token cache: x"). A part is at most 64 bytes. */
static size_t repeated_lead(const char *m) {
    size_t skip = 0;
    for (;;) {
        const char *s = m + skip, *c = strstr(s, ": ");
        if (!c || c == s || c - s > 64) return skip;
        size_t n = (size_t)(c - s) + 2;
        if (strncmp(s, s + n, n) != 0) return skip;
        skip += n;
    }
}

int bt_fail(int err, const char *fmt, ...) {
    /* Format into a local buffer first: callers may pass bt_last_error() as an argument. */
    char tmp[sizeof g_err];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    size_t k = repeated_lead(tmp);
    memmove(g_err, tmp + k, sizeof g_err - k);
    g_err[sizeof g_err - 1] = 0;
    return err;
}

const char *bt_last_error(void) { return g_err; }

const char *bt_last_error_in(const char *part) {
    size_t n = strlen(part);
    if (strncmp(g_err, part, n) == 0 && g_err[n] == ':' && g_err[n + 1] == ' ') return g_err + n + 2;
    return g_err;
}

/* ---- text that reaches a terminal, a log line or a metric label ---- */

/* One UTF-8 sequence at s[0..n): its code point and length, or -1 (length 1) when invalid
 * (overlong, surrogate, above U+10FFFF, truncated). RFC 3629 §4. */
static int32_t utf8_one(const uint8_t *s, size_t n, size_t *len) {
    uint8_t b = s[0];
    *len = 1;
    if (b < 0x80) return b;
    size_t k = b >= 0xF0 && b <= 0xF4 ? 4 : b >= 0xE0 ? (b <= 0xEF ? 3 : 0) : b >= 0xC2 ? 2 : 0;
    if (!k || k > n) return -1;
    int32_t cp = b & (0x7F >> k);
    for (size_t i = 1; i < k; i++) {
        if ((s[i] & 0xC0) != 0x80) return -1;
        cp = cp << 6 | (s[i] & 0x3F);
    }
    if ((k == 3 && cp < 0x800) || (k == 4 && (cp < 0x10000 || cp > 0x10FFFF)) || (cp >= 0xD800 && cp <= 0xDFFF))
        return -1;
    *len = k;
    return cp;
}

static int unsafe_cp(int32_t cp) {
    return cp < 0x20 || cp == 0x7F || (cp >= 0x80 && cp <= 0x9F) || cp == 0x061C || cp == 0x200E ||
           cp == 0x200F || (cp >= 0x202A && cp <= 0x202E) || (cp >= 0x2066 && cp <= 0x2069);
}

size_t bt_text_unsafe(const char *s, size_t n, int32_t *cp) {
    const uint8_t *p = (const uint8_t *)s;
    for (size_t i = 0; i < n;) {
        size_t len;
        int32_t c = utf8_one(p + i, n - i, &len);
        if (c < 0 || unsafe_cp(c)) {
            if (cp) *cp = c < 0 ? -(int32_t)p[i] - 1 : c;
            return i;
        }
        i += len;
    }
    return n;
}

size_t bt_escape_text(char *dst, size_t cap, const char *src, size_t n) {
    if (!cap) return 0;
    const uint8_t *p = (const uint8_t *)src;
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        size_t len;
        int32_t c = utf8_one(p + i, n - i, &len);
        char esc[16];
        const char *add = (const char *)p + i;
        size_t an = len;
        if (c < 0) {
            an = (size_t)snprintf(esc, sizeof esc, "\\x%02x", p[i]);
            add = esc;
        } else if (unsafe_cp(c)) {
            if (c == '\n') an = (size_t)snprintf(esc, sizeof esc, "\\n");
            else if (c == '\t') an = (size_t)snprintf(esc, sizeof esc, "\\t");
            else if (c == '\r') an = (size_t)snprintf(esc, sizeof esc, "\\r");
            else if (c < 0x80) an = (size_t)snprintf(esc, sizeof esc, "\\x%02x", (unsigned)c);
            else an = (size_t)snprintf(esc, sizeof esc, "\\u%04x", (unsigned)c);
            add = esc;
        }
        if (o + an >= cap) break; /* whole characters and escapes only */
        memcpy(dst + o, add, an);
        o += an;
        i += len;
    }
    dst[o] = 0;
    return o;
}

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

/* 1 when stderr is journald's stream (systemd sets $JOURNAL_STREAM to "DEV:INODE" of the stream it
 * connected, systemd.exec(5)): lines then carry their priority as a "<N>" prefix (sd-daemon(3)'s
 * SD_ERR ... SD_DEBUG, which journald parses) and no timestamp of their own. Decided once. */
static int log_to_journal(void) {
    static int cached = -1;
    if (cached >= 0) return cached;
    int j = 0;
    const char *e = getenv("JOURNAL_STREAM");
    unsigned long long dev, ino;
    struct stat st;
    if (e && sscanf(e, "%llu:%llu", &dev, &ino) == 2 && fstat(STDERR_FILENO, &st) == 0 &&
        (unsigned long long)st.st_dev == dev && (unsigned long long)st.st_ino == ino)
        j = 1;
    cached = j;
    return j;
}

void bt_log(int level, const char *component, const char *fmt, ...) {
    if (level < log_level()) return;
    static const char *names[] = {"debug", "info", "warn", "error"};
    static const int prio[] = {7, 6, 4, 3}; /* SD_DEBUG, SD_INFO, SD_WARNING, SD_ERR */
    const int li = level < 0 ? 0 : level > 3 ? 3 : level;
    char ts[32];
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    struct tm tm;
    gmtime_r(&now.tv_sec, &tm);
    strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%S", &tm);
    char msg[2048], safe[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    /* one event, one line: whatever the message carries (a client's string, a file name, a
     * library's error) cannot end the line, start a forged one or drive the terminal; and it
     * names its part once ("token cache: token cache: x" is a wrapping slip) */
    const char *m = msg + repeated_lead(msg);
    size_t cl = strlen(component);
    if (strncmp(m, component, cl) == 0 && m[cl] == ':' && m[cl + 1] == ' ') m += cl + 2;
    bt_escape_text(safe, sizeof safe, m, strlen(m));
    pthread_mutex_lock(&g_log_mu);
    if (log_to_journal()) fprintf(stderr, "<%d>%s: %s\n", prio[li], component, safe);
    else fprintf(stderr, "%s.%03ldZ %s %s: %s\n", ts, now.tv_nsec / 1000000L, names[li], component, safe);
    pthread_mutex_unlock(&g_log_mu);
}

double bt_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

double bt_cpu_s(void) {
    struct timespec ts;
    if (clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts) != 0) return 0;
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
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

static _Atomic int g_refuse_links;

void bt_open_refuse_symlinks(int on) { atomic_store(&g_refuse_links, on != 0); }

/* Pseudo filesystems: their files are views of kernel state, not data (procfs and sysfs files
 * report size 0 or 4096 whatever they hold; reading some has side effects). Magic numbers:
 * <linux/magic.h>. */
static const struct {
    unsigned long magic;
    const char *name;
} g_pseudo_fs[] = {
    {PROC_SUPER_MAGIC, "procfs"},     {SYSFS_MAGIC, "sysfs"},        {DEBUGFS_MAGIC, "debugfs"},
    {TRACEFS_MAGIC, "tracefs"},       {SECURITYFS_MAGIC, "securityfs"}, {CGROUP_SUPER_MAGIC, "cgroupfs"},
    {CGROUP2_SUPER_MAGIC, "cgroup2"}, {BPF_FS_MAGIC, "bpffs"},       {0x62656570UL, "configfs"},
    {EFIVARFS_MAGIC, "efivarfs"},     {PSTOREFS_MAGIC, "pstore"},    {SELINUX_MAGIC, "selinuxfs"},
    {SMACK_MAGIC, "smackfs"},         {BINFMTFS_MAGIC, "binfmt_misc"}, {0x65735543UL, "fusectl"},
    {NSFS_MAGIC, "nsfs"},             {DEVPTS_SUPER_MAGIC, "devpts"}, {RDTGROUP_SUPER_MAGIC, "resctrl"},
    {AUTOFS_SUPER_MAGIC, "autofs"},   {0x1373UL, "devfs"},            {AAFS_MAGIC, "apparmorfs"},
};

static const char *pseudo_fs_name(const struct statfs *sf) {
    for (size_t i = 0; i < sizeof g_pseudo_fs / sizeof g_pseudo_fs[0]; i++)
        if ((unsigned long)sf->f_type == g_pseudo_fs[i].magic) return g_pseudo_fs[i].name;
    return NULL;
}

const char *bt_pseudo_fs(const char *path) {
    struct statfs sf;
    return statfs(path, &sf) == 0 ? pseudo_fs_name(&sf) : NULL;
}

static const char *kind_of(mode_t m) {
    return S_ISDIR(m) ? "a directory" : S_ISFIFO(m) ? "a FIFO" : S_ISSOCK(m) ? "a socket" : S_ISCHR(m) ? "a character device"
         : S_ISBLK(m) ? "a block device" : "not a plain file";
}

int bt_open_file(const char *path, unsigned flags, struct stat *st_out) {
    /* O_NONBLOCK: a FIFO put where a file was expected must not hang the open (it is refused
     * below); reads of regular files ignore it */
    const int oflags = O_RDONLY | O_CLOEXEC | O_NONBLOCK;
    int refuse = (flags & BT_OPEN_NO_LINKS) || (!(flags & BT_OPEN_LINKS_OK) && atomic_load(&g_refuse_links));
    long fd;
    if (!refuse) {
        fd = open(path, oflags);
    } else {
        struct open_how how;
        memset(&how, 0, sizeof how);
        how.flags = oflags;
        how.resolve = RESOLVE_NO_SYMLINKS;
        fd = syscall(SYS_openat2, AT_FDCWD, path, &how, sizeof how);
        if (fd < 0 && (errno == ENOSYS || errno == EPERM)) /* old kernel, or a seccomp filter */
            fd = open(path, oflags | O_NOFOLLOW);
    }
    if (fd < 0) {
        int e = errno;
        if (e == ELOOP && refuse)
            bt_fail(BT_ERR_IO, "%s: a symbolic link on the way (refused: the path was checked without it)", path);
        else
            bt_fail(BT_ERR_IO, "%s: %s", path, strerror(e));
        errno = e;
        return -1;
    }
    struct stat st;
    struct statfs sf;
    const char *fs = NULL;
    int e = 0;
    if (fstat((int)fd, &st) != 0) {
        e = errno;
        bt_fail(BT_ERR_IO, "%s: fstat: %s", path, strerror(e));
    } else if (!S_ISREG(st.st_mode)) {
        e = S_ISDIR(st.st_mode) ? EISDIR : ENXIO;
        bt_fail(BT_ERR_IO, "%s: not a regular file (%s)", path, kind_of(st.st_mode));
    } else if (fstatfs((int)fd, &sf) == 0 && (fs = pseudo_fs_name(&sf))) {
        e = ENXIO;
        bt_fail(BT_ERR_IO, "%s: not a regular file (on %s, a pseudo filesystem: its files are views of kernel "
                "state, not data)", path, fs);
    }
    if (e) {
        close((int)fd);
        errno = e;
        return -1;
    }
    if (st_out) *st_out = st;
    return (int)fd;
}

int bt_open_ro(const char *path) { return bt_open_file(path, 0, NULL); }

/* ---- SIGBUS guard for file mappings (see bt_common.h) ----
 * A fixed table of [lo, hi) page ranges, one per live bt_map; the signal handler only reads
 * atomics and makes raw system calls (async-signal-safe). A slot is claimed by CAS on `lo`
 * (0 = free, 1 = being set up), `hi` is written before `lo` gets its real value, and `lo` is
 * cleared before munmap. */
#define MAP_GUARD_SLOTS 4096
static struct {
    _Atomic uintptr_t lo, hi;
    _Atomic int faulted;
} g_guard[MAP_GUARD_SLOTS];
static struct sigaction g_old_bus;
static uintptr_t g_page = 4096; /* set before the handler is installed */

static void on_sigbus(int sig, siginfo_t *si, void *uc) {
    uintptr_t a = (uintptr_t)si->si_addr;
    for (int i = 0; i < MAP_GUARD_SLOTS; i++) {
        uintptr_t lo = atomic_load_explicit(&g_guard[i].lo, memory_order_acquire);
        if (lo <= 1 || a < lo) continue;
        uintptr_t hi = atomic_load_explicit(&g_guard[i].hi, memory_order_relaxed);
        if (a >= hi) continue;
        /* a read past the file's new end: the rest of the mapping becomes zero pages (the
         * file's pages past its end are gone anyway), and the mapping is marked changed */
        uintptr_t from = a & ~(g_page - 1);
        atomic_store(&g_guard[i].faulted, 1);
        long r = syscall(SYS_mmap, (void *)from, (size_t)(hi - from), PROT_READ,
                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
        if (r != -1) return; /* the faulting read restarts and sees zeros */
        break;
    }
    /* not ours (or the remap failed): what would have happened without us */
    if ((g_old_bus.sa_flags & SA_SIGINFO) && g_old_bus.sa_sigaction) {
        g_old_bus.sa_sigaction(sig, si, uc);
    } else if (g_old_bus.sa_handler != SIG_DFL && g_old_bus.sa_handler != SIG_IGN) {
        g_old_bus.sa_handler(sig);
    } else {
        struct sigaction dfl;
        memset(&dfl, 0, sizeof dfl);
        dfl.sa_handler = SIG_DFL;
        sigaction(SIGBUS, &dfl, NULL); /* the fault repeats and kills the process as before */
    }
}

static pthread_mutex_t g_guard_mu = PTHREAD_MUTEX_INITIALIZER;

/* Install the handler unless it is the current one: someone may have replaced it since (a
 * test framework does around each test); the disposition found is what we chain to. */
static void guard_install(void) {
    pthread_mutex_lock(&g_guard_mu);
    g_page = (uintptr_t)sysconf(_SC_PAGESIZE);
    struct sigaction cur;
    sigaction(SIGBUS, NULL, &cur);
    if (!((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_sigbus)) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = on_sigbus;
        sa.sa_flags = SA_SIGINFO | SA_RESTART | SA_NODEFER;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGBUS, &sa, &g_old_bus);
    }
    pthread_mutex_unlock(&g_guard_mu);
}

static int guard_add(uintptr_t lo, size_t len) {
    guard_install();
    size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    for (int i = 0; i < MAP_GUARD_SLOTS; i++) {
        uintptr_t z = 0;
        if (!atomic_compare_exchange_strong(&g_guard[i].lo, &z, (uintptr_t)1)) continue;
        atomic_store(&g_guard[i].faulted, 0);
        atomic_store(&g_guard[i].hi, lo + (len + pg - 1) / pg * pg);
        atomic_store_explicit(&g_guard[i].lo, lo, memory_order_release);
        return i + 1;
    }
    return 0;
}

static void guard_remove(int guard) {
    if (guard <= 0) return;
    atomic_store_explicit(&g_guard[guard - 1].lo, (uintptr_t)1, memory_order_release);
    atomic_store(&g_guard[guard - 1].hi, 0);
    atomic_store(&g_guard[guard - 1].faulted, 0);
    atomic_store_explicit(&g_guard[guard - 1].lo, (uintptr_t)0, memory_order_release);
}

static int64_t mtime_ns(const struct stat *st) {
    return (int64_t)st->st_mtim.tv_sec * 1000000000 + st->st_mtim.tv_nsec;
}

void bt_test_pause_point(const char *path) {
    const char *dir = getenv("BT_TEST_MAP_PAUSE_DIR"), *match = getenv("BT_TEST_MAP_PAUSE_MATCH");
    if (!dir || !*dir || !match || !*match || !strstr(path, match)) return;
    char fifo[4096];
    snprintf(fifo, sizeof fifo, "%s/mapped", dir);
    int fd = open(fifo, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return;
    dprintf(fd, "%s\n", path);
    close(fd);
    snprintf(fifo, sizeof fifo, "%s/resume", dir);
    fd = open(fifo, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    char b;
    while (read(fd, &b, 1) < 0 && errno == EINTR) {
    }
    close(fd);
}

int bt_map_open(bt_map *m, const char *path) {
    memset(m, 0, sizeof *m);
    m->fd = -1;
    struct stat st;
    int fd = bt_open_file(path, 0, &st);
    if (fd < 0) return BT_ERR_IO; /* the message names the path and why */
    if (st.st_size > 0) {
        void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) {
            int e = errno;
            close(fd);
            return bt_fail(BT_ERR_IO, "%s: mmap: %s", path, strerror(e));
        }
        m->guard = guard_add((uintptr_t)p, (size_t)st.st_size);
        if (!m->guard) {
            munmap(p, (size_t)st.st_size);
            close(fd);
            return bt_fail(BT_ERR_NOMEM, "%s: more than %d files mapped at once", path, MAP_GUARD_SLOTS);
        }
        m->data = p;
        m->size = (size_t)st.st_size;
    }
    m->fd = fd;
    m->path = bt_xstrdup(path);
    m->mtime_ns = mtime_ns(&st);
    bt_test_pause_point(path);
    return BT_OK;
}

int bt_map_check(const bt_map *m, int rc) {
    if (!m || !m->path || m->fd < 0) return rc;
    int faulted = m->guard > 0 && atomic_load(&g_guard[m->guard - 1].faulted);
    struct stat st;
    int changed = fstat(m->fd, &st) != 0 || (size_t)st.st_size != m->size || mtime_ns(&st) != m->mtime_ns;
    if (!faulted && !changed) return rc;
    char now[64] = "now unreadable";
    if (fstat(m->fd, &st) == 0) snprintf(now, sizeof now, "now %lld bytes", (long long)st.st_size);
    return bt_fail(BT_ERR_IO,
                   "%s: changed while being read (%zu bytes when opened, %s%s): nothing read from it is "
                   "used; retry once the file is complete (replace files by renaming a finished copy over them)",
                   m->path, m->size, now, faulted ? ", read past its new end" : ", modified in place");
}

void bt_map_close(bt_map *m) {
    if (m->path) { /* opened (a zeroed or failed map owns nothing) */
        guard_remove(m->guard);
        if (m->data) munmap((void *)m->data, m->size);
        if (m->fd >= 0) close(m->fd);
        free(m->path);
    }
    memset(m, 0, sizeof *m);
    m->fd = -1;
}

int bt_read_file(const char *path, size_t max_bytes, char **out, size_t *len) {
    *out = NULL;
    if (len) *len = 0;
    int fd = bt_open_ro(path);
    if (fd < 0) return BT_ERR_IO; /* the message names the path and why */
    int rc = bt_read_fd(fd, path, max_bytes, out, len);
    close(fd);
    return rc;
}

int bt_read_fd(int fd, const char *path, size_t max_bytes, char **out, size_t *len) {
    *out = NULL;
    if (len) *len = 0;
    struct stat st, st2;
    int rc = BT_OK;
    char *buf = NULL;
    size_t n = 0;
    if (fstat(fd, &st) != 0) {
        rc = bt_fail(BT_ERR_IO, "%s: fstat: %s", path, strerror(errno));
        goto out;
    }
    if (!S_ISREG(st.st_mode)) {
        rc = bt_fail(BT_ERR_IO, "%s: not a regular file", path);
        goto out;
    }
    if (!max_bytes) { /* every whole-file read names its bound (issue 21 §11) */
        rc = bt_fail(BT_ERR_INVALID, "%s: read whole without a size limit (a caller's error)", path);
        goto out;
    }
    if ((uint64_t)st.st_size > max_bytes) {
        rc = bt_fail(BT_ERR_RANGE, "%s: %lld bytes, larger than the %zu-byte limit for this file", path,
                     (long long)st.st_size, max_bytes);
        goto out;
    }
    size_t want = (size_t)st.st_size;
    buf = malloc(want + 1);
    if (!buf) {
        rc = bt_fail(BT_ERR_NOMEM, "%s: out of memory (%zu bytes)", path, want + 1);
        goto out;
    }
    while (n < want) {
        ssize_t r = read(fd, buf + n, want - n > (1u << 30) ? (1u << 30) : want - n);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            rc = bt_fail(BT_ERR_IO, "%s: read: %s", path, strerror(errno));
            goto out;
        }
        if (r == 0) break;
        n += (size_t)r;
    }
    char extra;
    ssize_t more;
    do more = read(fd, &extra, 1);
    while (more < 0 && errno == EINTR);
    if (n != want || more != 0 || fstat(fd, &st2) != 0 || st2.st_size != st.st_size ||
        mtime_ns(&st2) != mtime_ns(&st)) {
        rc = bt_fail(BT_ERR_IO, "%s: changed while being read (%zu bytes when opened, %zu read%s): retry once "
                     "the file is complete", path, want, n, more > 0 ? ", and it grew" : "");
        goto out;
    }
    buf[n] = 0;
out:
    if (rc) {
        free(buf);
        return rc;
    }
    *out = buf;
    if (len) *len = n;
    return BT_OK;
}

int bt_all_finite_f32(const float *x, size_t n, size_t *first) {
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i])) {
            if (first) *first = i;
            return 0;
        }
    return 1;
}
