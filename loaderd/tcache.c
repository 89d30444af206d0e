/* loaderd token cache: directory, keys, locks, eviction, building an entry, acquire (contract:
 * loaderd/tcache.h; the entry format's reader and writer: tcache_entry.c). */
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <limits.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "common/bt_vec.h"
#include "loaderd/chunkq.h"
#include "loaderd/source.h"
#include "loaderd/tcache_priv.h"

#define ADD(field, n) atomic_fetch_add_explicit(&c->st.field, (uint64_t)(n), memory_order_relaxed)
#define MEMO_BUCKETS 1024
#define TMP_GRACE_S 2 /* a temporary file younger than this may be one whose writer is about to lock it */

typedef struct keynode {
    uint8_t key[32];
    int refs;
    struct keynode *next;
} keynode;

typedef struct memo {
    dev_t dev;
    ino_t ino;
    off_t size;
    struct timespec mtime, ctime;
    uint8_t sha[32];
    struct memo *next;
} memo;

struct ld_tcache {
    char *dir;  /* the configured directory */
    char *vdir; /* <dir>/v1 */
    uint64_t max_bytes;
    uint32_t wait_s;
    pthread_mutex_t mu;
    pthread_cond_t cv;     /* a build in this process finished */
    keynode *building;     /* keys being built by this process */
    keynode *inuse;        /* keys being read by this process (refs) */
    memo *memo[MEMO_BUCKETS];
    char distrust[512];    /* the last reason the tree failed its check ("" while trusted; under mu) */
    char distrust_path[4096]; /* the level that failed */
    ld_tcache_stats st;
};

ld_tcache_stats *ld_tcache_stats_of(ld_tcache *c) { return &c->st; }
const char *ld_tcache_dir(const ld_tcache *c) { return c->dir; }
uint64_t ld_tcache_max_bytes(const ld_tcache *c) { return c->max_bytes; }

/* ------------------------------------------------------------------ key sets */

static keynode *keys_find(keynode *l, const uint8_t key[32]) {
    while (l && memcmp(l->key, key, 32)) l = l->next;
    return l;
}

static void keys_add(keynode **l, const uint8_t key[32]) {
    keynode *k = keys_find(*l, key);
    if (k) {
        k->refs++;
        return;
    }
    k = bt_xcalloc(1, sizeof *k);
    memcpy(k->key, key, 32);
    k->refs = 1;
    k->next = *l;
    *l = k;
}

static void keys_del(keynode **l, const uint8_t key[32]) {
    for (keynode **pp = l; *pp; pp = &(*pp)->next)
        if (!memcmp((*pp)->key, key, 32)) {
            keynode *k = *pp;
            if (--k->refs == 0) {
                *pp = k->next;
                free(k);
            }
            return;
        }
}

static void keys_free(keynode *l) {
    while (l) {
        keynode *n = l->next;
        free(l);
        l = n;
    }
}

void tc_inuse_add(ld_tcache *c, const uint8_t key[32]) {
    pthread_mutex_lock(&c->mu);
    keys_add(&c->inuse, key);
    pthread_mutex_unlock(&c->mu);
}

void tc_inuse_del(ld_tcache *c, const uint8_t key[32]) {
    pthread_mutex_lock(&c->mu);
    keys_del(&c->inuse, key);
    pthread_mutex_unlock(&c->mu);
}

/* ------------------------------------------------------------------ paths */

static void hex(const uint8_t *k, size_t n, char *out) {
    static const char d[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = d[k[i] >> 4];
        out[2 * i + 1] = d[k[i] & 15];
    }
    out[2 * n] = 0;
}

char *tc_path(const ld_tcache *c, const uint8_t key[32], const char *suffix, int mkdirs) {
    char k[33];
    hex(key, 16, k);
    size_t n = strlen(c->vdir) + 4 + 32 + strlen(suffix) + 2;
    char *p = bt_xmalloc(n);
    snprintf(p, n, "%s/%.2s", c->vdir, k);
    if (mkdirs && mkdir(p, 0750) != 0 && errno != EEXIST)
        bt_log(BT_LOG_WARN, "loaderd", "token cache: mkdir %s: %s", p, strerror(errno));
    snprintf(p, n, "%s/%.2s/%s%s", c->vdir, k, k, suffix);
    return p;
}

/* ------------------------------------------------------------------ trust
 *
 * Anyone who can write a directory of the cache can plant an entry whose checksums are valid:
 * loaderd would serve it as the training data. So every level loaderd creates or reads must be
 * writable by loaderd's user only: the directory itself, v1/ and each <k0k1>/ are real
 * directories (not symbolic links) owned by our effective uid with neither the group nor the
 * other write bit (a sticky bit does not make them safe: anyone may still add files); each
 * ancestor of the directory is owned by root or by us and, when others may write it, sticky (so
 * nobody else can rename our directory away and put theirs in its place). Checked at start
 * (ld_tcache_open refuses) and before every use (the cache is bypassed while it fails). */

/* One level: BT_OK, or BT_ERR_INVALID with the reason (bt_fail). ancestor: the looser rule. */
static int level_ok(const char *path, int ancestor) {
    struct stat st;
    uid_t me = geteuid();
    if (lstat(path, &st) != 0)
        return bt_fail(BT_ERR_INVALID, "%s: %s", path, strerror(errno));
    if (S_ISLNK(st.st_mode))
        return bt_fail(BT_ERR_INVALID, "%s is a symbolic link (the cache tree must be real directories)", path);
    if (!S_ISDIR(st.st_mode)) return bt_fail(BT_ERR_INVALID, "%s is not a directory", path);
    if (ancestor) {
        if (st.st_uid != 0 && st.st_uid != me)
            return bt_fail(BT_ERR_INVALID, "%s (a parent of the cache) is owned by uid %u, not by root or loaderd's "
                           "user (uid %u): its owner could swap the cache for another", path, (unsigned)st.st_uid,
                           (unsigned)me);
        if ((st.st_mode & (S_IWGRP | S_IWOTH)) && !(st.st_mode & S_ISVTX))
            return bt_fail(BT_ERR_INVALID, "%s (a parent of the cache) is %s-writable and not sticky (mode %04o): "
                           "anyone there could swap the cache for another", path,
                           (st.st_mode & S_IWOTH) ? "world" : "group", (unsigned)(st.st_mode & 07777));
        return BT_OK;
    }
    if (st.st_uid != me)
        return bt_fail(BT_ERR_INVALID, "%s is owned by uid %u, not by loaderd's user (uid %u): its owner could plant "
                       "entries (chown it to loaderd's user)", path, (unsigned)st.st_uid, (unsigned)me);
    if (st.st_mode & (S_IWGRP | S_IWOTH))
        return bt_fail(BT_ERR_INVALID, "%s is %s-writable (mode %04o%s): others could plant entries (chmod go-w it; "
                       "0750 or 0700)", path, (st.st_mode & S_IWOTH) ? "world" : "group",
                       (unsigned)(st.st_mode & 07777), (st.st_mode & S_ISVTX) ? ", sticky bit or not" : "");
    return BT_OK;
}

/* The chain from / to the cache directory, the directory, v1/ and, when sub is not NULL, the
 * entry directory v1/<sub>/ (when it exists: a missing one is created 0750 by loaderd).
 * BT_OK, or BT_ERR_INVALID with the reason. */
static int tree_ok(const ld_tcache *c, const char *sub, char *bad, size_t bad_n) {
    char path[PATH_MAX];
    size_t n = strlen(c->dir);
    if (n >= sizeof path) return bt_fail(BT_ERR_INVALID, "token cache: directory path too long");
    snprintf(path, sizeof path, "/");
    int rc = level_ok(path, 1);
    for (size_t i = 1; rc == BT_OK && i < n; i++)
        if (c->dir[i] == '/') {
            memcpy(path, c->dir, i);
            path[i] = 0;
            rc = level_ok(path, 1);
        }
    for (int lv = 0; lv < 2 && rc == BT_OK; lv++) { /* the directory, then v1/ */
        snprintf(path, sizeof path, "%s", lv ? c->vdir : c->dir);
        rc = level_ok(path, 0);
    }
    if (rc == BT_OK && sub) {
        snprintf(path, sizeof path, "%s/%s", c->vdir, sub);
        struct stat st;
        if (lstat(path, &st) == 0 || errno != ENOENT) rc = level_ok(path, 0);
    }
    if (rc != BT_OK && bad) snprintf(bad, bad_n, "%s", path);
    return rc;
}

/* Before a use of the entries of `key`: 1 when the tree passes (tree_ok), else 0 after counting
 * the lookup as untrusted and logging the reason (once, until that level passes again). */
static int trusted_for(ld_tcache *c, const uint8_t key[32]) {
    char k[33], bad[PATH_MAX];
    hex(key, 1, k);
    int ok = tree_ok(c, k, bad, sizeof bad) == BT_OK;
    char was[PATH_MAX] = "";
    int log_bad = 0;
    pthread_mutex_lock(&c->mu);
    if (!ok) {
        log_bad = strcmp(c->distrust, bt_last_error()) != 0;
        snprintf(c->distrust, sizeof c->distrust, "%s", bt_last_error());
        snprintf(c->distrust_path, sizeof c->distrust_path, "%s", bad);
    } else if (c->distrust[0] && level_ok(c->distrust_path, strlen(c->distrust_path) < strlen(c->dir)) == BT_OK) {
        snprintf(was, sizeof was, "%s", c->distrust_path);
        c->distrust[0] = c->distrust_path[0] = 0;
    }
    pthread_mutex_unlock(&c->mu);
    if (!ok) {
        atomic_fetch_add_explicit(&c->st.untrusted, 1, memory_order_relaxed);
        if (log_bad)
            bt_log(BT_LOG_WARN, "loaderd", "token cache: not used while its directory fails the check: %s",
                   c->distrust);
    } else if (was[0]) {
        bt_log(BT_LOG_INFO, "loaderd", "token cache: %s passes the ownership check again: in use", was);
    }
    return ok;
}

/* ------------------------------------------------------------------ open / free */

static int mkdir_p(const char *path) {
    char *p = bt_xstrdup(path);
    for (char *s = p + 1; *s; s++) {
        if (*s != '/') continue;
        *s = 0;
        if (mkdir(p, 0750) != 0 && errno != EEXIST) {
            free(p);
            return -1;
        }
        *s = '/';
    }
    int rc = mkdir(p, 0750) != 0 && errno != EEXIST ? -1 : 0;
    free(p);
    return rc;
}

static uint64_t scan(ld_tcache *c, const uint8_t *keep, int evict);

int ld_tcache_open(ld_tcache **out, const char *dir, uint64_t max_bytes, uint32_t wait_s) {
    *out = NULL;
    if (!dir || dir[0] != '/')
        return bt_fail(BT_ERR_INVALID, "token cache: \"token_cache_dir\" must be an absolute directory path");
    ld_tcache *c = bt_xcalloc(1, sizeof *c);
    c->max_bytes = max_bytes;
    c->wait_s = wait_s;
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    int rc = BT_OK;
    size_t n = strlen(dir) + 4;
    char *v = bt_xmalloc(n);
    snprintf(v, n, "%s/v1", dir);
    if (mkdir_p(v) != 0)
        rc = bt_fail(BT_ERR_IO, "token cache: cannot create %s: %s (create it, owned by loaderd's user, or fix "
                     "\"token_cache_dir\"; a systemd unit needs it in ReadWritePaths=)", v, strerror(errno));
    free(v);
    /* from here on the real path: every level of it is checked, and files in it are opened with
     * symbolic links refused */
    if (rc == BT_OK && !(c->dir = realpath(dir, NULL)))
        rc = bt_fail(BT_ERR_IO, "token cache: %s: %s", dir, strerror(errno));
    if (rc == BT_OK) {
        n = strlen(c->dir) + 4;
        c->vdir = bt_xmalloc(n);
        snprintf(c->vdir, n, "%s/v1", c->dir);
        if (tree_ok(c, NULL, NULL, 0) != BT_OK)
            rc = bt_fail(BT_ERR_INVALID, "token cache: %s", bt_last_error());
    }
    if (rc == BT_OK) { /* every entry directory there now */
        DIR *top = opendir(c->vdir);
        struct dirent *d;
        while (top && rc == BT_OK && (d = readdir(top)))
            if (d->d_name[0] != '.' && tree_ok(c, d->d_name, NULL, 0) != BT_OK)
                rc = bt_fail(BT_ERR_INVALID, "token cache: %s", bt_last_error());
        if (top) closedir(top);
    }
    if (rc == BT_OK) {
        char probe[64];
        snprintf(probe, sizeof probe, "/.probe.%d", (int)getpid());
        size_t pn = strlen(c->vdir) + sizeof probe;
        char *pp = bt_xmalloc(pn);
        snprintf(pp, pn, "%s%s", c->vdir, probe);
        int fd = open(pp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0640);
        if (fd < 0)
            rc = bt_fail(BT_ERR_IO, "token cache: %s is not writable: %s (give loaderd's user write access; a "
                         "systemd unit needs it in ReadWritePaths=)", c->vdir, strerror(errno));
        else {
            close(fd);
            unlink(pp);
        }
        free(pp);
    }
    if (rc != BT_OK) {
        ld_tcache_free(c);
        return rc;
    }
    atomic_store(&c->st.bytes, scan(c, NULL, 0));
    uint64_t tmps = atomic_load(&c->st.temps_removed);
    char removed[96] = "";
    if (tmps)
        snprintf(removed, sizeof removed, ", %llu stale temporary file(s) of killed builders removed",
                 (unsigned long long)tmps);
    bt_log(BT_LOG_INFO, "loaderd", "token cache: %s, %.1f MiB of entries (max %.1f MiB)%s", c->dir,
           (double)atomic_load(&c->st.bytes) / 1048576.0, (double)max_bytes / 1048576.0, removed);
    *out = c;
    return BT_OK;
}

void ld_tcache_free(ld_tcache *c) {
    if (!c) return;
    keys_free(c->building);
    keys_free(c->inuse);
    for (int b = 0; b < MEMO_BUCKETS; b++)
        for (memo *m = c->memo[b]; m;) {
            memo *n = m->next;
            free(m);
            m = n;
        }
    pthread_cond_destroy(&c->cv);
    pthread_mutex_destroy(&c->mu);
    free(c->dir);
    free(c->vdir);
    free(c);
}

/* ------------------------------------------------------------------ keys */

static void digest_cb(void *ctx, const void *p, size_t n) { tc_sha_update(ctx, p, n); }

void ld_tcache_tokenizer_sha256(const bt_tokenizer *tok, uint8_t out[32]) {
    tc_sha s;
    if (tc_sha_init(&s) != BT_OK) {
        memset(out, 0, 32);
        return;
    }
    bt_tokenizer_digest(tok, digest_cb, &s);
    tc_sha_final(&s, out);
}

static int same_stat(const memo *m, const struct stat *st) {
    return m->dev == st->st_dev && m->ino == st->st_ino && m->size == st->st_size &&
           m->mtime.tv_sec == st->st_mtim.tv_sec && m->mtime.tv_nsec == st->st_mtim.tv_nsec &&
           m->ctime.tv_sec == st->st_ctim.tv_sec && m->ctime.tv_nsec == st->st_ctim.tv_nsec;
}

/* SHA-256 and size of the shard's bytes, remembered per (dev, inode, size, mtime, ctime).
 * BT_OK, or BT_ERR_IO (unreadable, not a regular file, or changed while being hashed). */
static int shard_hash(ld_tcache *c, const char *path, uint8_t sha[32], uint64_t *size) {
    struct stat st, st2;
    /* the one safe open: the shard may have been replaced since the attach checked it (by a
     * link leading out of the roots, a FIFO that would block this thread forever, ...) */
    int fd = bt_open_file(path, 0, &st);
    if (fd < 0) return BT_ERR_IO; /* bt_last_error names the path and why */
    size_t b = (size_t)((uint64_t)st.st_ino * 0x9E3779B97F4A7C15ull >> 54) % MEMO_BUCKETS;
    pthread_mutex_lock(&c->mu);
    for (memo *m = c->memo[b]; m; m = m->next)
        if (same_stat(m, &st)) {
            memcpy(sha, m->sha, 32);
            pthread_mutex_unlock(&c->mu);
            close(fd);
            *size = (uint64_t)st.st_size;
            return BT_OK;
        }
    pthread_mutex_unlock(&c->mu);
    tc_sha s;
    int rc = tc_sha_init(&s);
    size_t cap = (size_t)1 << 20;
    char *buf = rc == BT_OK ? malloc(cap) : NULL;
    if (rc == BT_OK && !buf) rc = bt_fail(BT_ERR_NOMEM, "token cache: out of memory");
    uint64_t total = 0;
    while (rc == BT_OK && total < (uint64_t)st.st_size) {
        ssize_t r = read(fd, buf, cap);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            rc = bt_fail(BT_ERR_IO, "%s: %s while hashing", path, r < 0 ? strerror(errno) : "shrank");
            break;
        }
        size_t k = (uint64_t)r > (uint64_t)st.st_size - total ? (size_t)((uint64_t)st.st_size - total) : (size_t)r;
        tc_sha_update(&s, buf, k);
        total += k;
    }
    free(buf);
    if (rc == BT_OK && (fstat(fd, &st2) != 0 || st2.st_size != st.st_size || st2.st_mtim.tv_sec != st.st_mtim.tv_sec ||
                        st2.st_mtim.tv_nsec != st.st_mtim.tv_nsec))
        rc = bt_fail(BT_ERR_IO, "%s: changed while being hashed", path);
    close(fd);
    if (rc != BT_OK) {
        if (s.md) tc_sha_free(&s);
        return rc;
    }
    tc_sha_final(&s, sha);
    atomic_fetch_add_explicit(&c->st.hashed_bytes, total, memory_order_relaxed);
    memo *m = bt_xcalloc(1, sizeof *m);
    m->dev = st.st_dev;
    m->ino = st.st_ino;
    m->size = st.st_size;
    m->mtime = st.st_mtim;
    m->ctime = st.st_ctim;
    memcpy(m->sha, sha, 32);
    pthread_mutex_lock(&c->mu);
    m->next = c->memo[b];
    c->memo[b] = m;
    pthread_mutex_unlock(&c->mu);
    *size = (uint64_t)st.st_size;
    return BT_OK;
}

static int shard_key(ld_tcache *c, const ld_tc_shard *sh, uint8_t key[32], uint8_t content[32], uint64_t *size) {
    int rc = shard_hash(c, sh->path, content, size);
    if (rc != BT_OK) return rc;
    const ld_format_cfg *f = sh->fcfg;
    tc_sha s;
    if ((rc = tc_sha_init(&s)) != BT_OK) return rc;
    static const char tag[] = "barqtrain-tcache-key-v1";
    const char *tf = f->format == LD_FMT_TEXT ? (f->text_field ? f->text_field : "text") : "";
    uint64_t v[6] = {*size, (uint64_t)f->format, f->format == LD_FMT_TEXT ? 0 : (uint64_t)f->tpl, (uint64_t)!!f->add_bos,
                     LD_TC_FORMAT_VERSION, strlen(tf)};
    tc_sha_update(&s, tag, sizeof tag);
    tc_sha_update(&s, content, 32);
    tc_sha_update(&s, sh->tok_sha256, 32);
    tc_sha_update(&s, v, sizeof v);
    tc_sha_update(&s, tf, strlen(tf));
    tc_sha_final(&s, key);
    return BT_OK;
}

/* ------------------------------------------------------------------ locks */

/* Exclusive flock on "<k>.lock": 1 held (*fd), 0 held by someone else, <0 cannot lock. */
static int lock_try(ld_tcache *c, const uint8_t key[32], int *fd) {
    char *p = tc_path(c, key, ".lock", 1);
    *fd = open(p, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0640);
    if (*fd < 0) {
        int rc = bt_fail(BT_ERR_IO, "token cache: %s: %s", p, strerror(errno));
        free(p);
        return rc;
    }
    free(p);
    if (flock(*fd, LOCK_EX | LOCK_NB) == 0) return 1;
    int e = errno;
    close(*fd);
    *fd = -1;
    if (e == EWOULDBLOCK || e == EINTR) return 0;
    return bt_fail(BT_ERR_IO, "token cache: flock: %s (the filesystem of \"token_cache_dir\" needs working locks)",
                   strerror(e));
}

static void unlock(int fd) {
    if (fd >= 0) close(fd); /* releases the flock */
}

/* ------------------------------------------------------------------ eviction */

typedef struct {
    char *path;
    uint64_t size;
    struct timespec mtime;
    uint8_t key16[16];
} entry_info;

static int cmp_mtime(const void *a, const void *b) {
    const entry_info *x = a, *y = b;
    if (x->mtime.tv_sec != y->mtime.tv_sec) return x->mtime.tv_sec < y->mtime.tv_sec ? -1 : 1;
    return (x->mtime.tv_nsec > y->mtime.tv_nsec) - (x->mtime.tv_nsec < y->mtime.tv_nsec);
}

static int unhex16(const char *s, uint8_t out[16]) {
    for (int i = 0; i < 16; i++) {
        int v = 0;
        for (int k = 0; k < 2; k++) {
            char ch = s[2 * i + k];
            int d = ch >= '0' && ch <= '9' ? ch - '0' : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10 : -1;
            if (d < 0) return -1;
            v = v * 16 + d;
        }
        out[i] = (uint8_t)v;
    }
    return 0;
}

/* Whether the temporary file at path (lstat: st) was left by a builder that died, and if so
 * remove it: its writer (common/atomic_io.h bt_atomic_open) holds an exclusive flock on it
 * until it is renamed into place, and the kernel releases that lock when the writer dies (on
 * NFS, Lustre and GPFS with locking enabled too, whichever node it ran on). A file nobody
 * locks, older than TMP_GRACE_S (the moment between its creation and its lock), is stale. */
static int tmp_stale(const char *path, const struct stat *st, time_t now) {
    if (now - st->st_mtim.tv_sec < TMP_GRACE_S) return 0;
    /* opened for writing: an exclusive lock on NFS (flock emulated with fcntl locks) needs it */
    int fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) return 0;
    struct stat fst;
    int stale = fstat(fd, &fst) == 0 && fst.st_dev == st->st_dev && fst.st_ino == st->st_ino &&
                flock(fd, LOCK_EX | LOCK_NB) == 0 && unlink(path) == 0;
    close(fd);
    return stale;
}

/* What a v1/<k0k1>/ directory holds (k: an entry key's first 32 hex digits): the entries
 * "<k>.btc", the reference log-prob sidecars "<k>-<r>.ref" and part files "<k>-<r>.ref.part-<h>"
 * of loaderd/refstore.h (r: 32 hex digits of the reference key), and the temporary files
 * "<name>.tmp.<pid>.<n>" of their writers (bt_atomic_open's names). */
enum { TC_F_OTHER, TC_F_ENTRY, TC_F_REF, TC_F_TMP };
static int tc_classify(const char *name) {
    size_t len = strlen(name);
    if (len < 36) return TC_F_OTHER;
    for (int i = 0; i < 32; i++)
        if (!isxdigit((unsigned char)name[i])) return TC_F_OTHER;
    if (len == 36 && !strcmp(name + 32, ".btc")) return TC_F_ENTRY;
    if (!strncmp(name + 32, ".btc.tmp.", 9)) return TC_F_TMP;
    if (len < 69 || name[32] != '-' || strncmp(name + 65, ".ref", 4)) return TC_F_OTHER;
    for (int i = 33; i < 65; i++)
        if (!isxdigit((unsigned char)name[i])) return TC_F_OTHER;
    if (strstr(name + 69, ".tmp.")) return TC_F_TMP;
    return name[69] == 0 || !strncmp(name + 69, ".part-", 6) ? TC_F_REF : TC_F_OTHER;
}

/* Size of the entries, of their reference log-prob sidecars and part files, and of the temporary
 * files of live writers (they all count against max_bytes while they exist); temporary files of
 * writers that died are removed (tmp_stale, counted in temps_removed). With evict, remove the
 * least recently used entries and sidecars (never those of entry `keep` nor of one in use here)
 * until the total fits in 90% of max_bytes. */
static uint64_t scan(ld_tcache *c, const uint8_t *keep, int evict) {
    entry_info *v = NULL;
    size_t n = 0, cap = 0;
    uint64_t total = 0;
    DIR *top = opendir(c->vdir);
    if (!top) return 0;
    struct dirent *d;
    time_t now = time(NULL);
    while ((d = readdir(top))) {
        if (strlen(d->d_name) != 2 || d->d_name[0] == '.') continue;
        size_t sn = strlen(c->vdir) + 4;
        char *sub = bt_xmalloc(sn);
        snprintf(sub, sn, "%s/%s", c->vdir, d->d_name);
        DIR *dd = opendir(sub);
        struct dirent *e;
        while (dd && (e = readdir(dd))) {
            size_t len = strlen(e->d_name);
            int kind = tc_classify(e->d_name);
            int is_tmp = kind == TC_F_TMP;
            if (kind == TC_F_OTHER) continue;
            size_t pn = sn + len + 2;
            char *path = bt_xmalloc(pn);
            snprintf(path, pn, "%s/%s", sub, e->d_name);
            struct stat st;
            if (lstat(path, &st) != 0 || !S_ISREG(st.st_mode)) {
                free(path);
                continue;
            }
            if (is_tmp) { /* removed when nobody writes it any more, else counted as it is */
                if (tmp_stale(path, &st, now)) {
                    ADD(temps_removed, 1);
                    bt_log(BT_LOG_INFO, "loaderd", "token cache: removed %s (%.1f MiB): temporary file of a writer "
                           "that was killed", path, (double)st.st_size / 1048576.0);
                } else {
                    total += (uint64_t)st.st_size;
                }
                free(path);
                continue;
            }
            v = bt_vec_xgrow(v, &cap, n + 1, sizeof *v);
            v[n] = (entry_info){path, (uint64_t)st.st_size, st.st_mtim, {0}};
            if (unhex16(e->d_name, v[n].key16) != 0) memset(v[n].key16, 0xFF, 16);
            total += (uint64_t)st.st_size;
            n++;
        }
        if (dd) closedir(dd);
        free(sub);
    }
    closedir(top);
    if (evict && total > c->max_bytes) {
        qsort(v, n, sizeof *v, cmp_mtime);
        uint64_t target = c->max_bytes / 10 * 9;
        for (size_t i = 0; i < n && total > target; i++) {
            if (keep && !memcmp(v[i].key16, keep, 16)) continue;
            pthread_mutex_lock(&c->mu);
            int busy = 0;
            for (keynode *k = c->inuse; k && !busy; k = k->next) busy = !memcmp(k->key, v[i].key16, 16);
            pthread_mutex_unlock(&c->mu);
            if (busy || unlink(v[i].path) != 0) continue;
            total -= v[i].size;
            ADD(evicted, 1);
            bt_log(BT_LOG_INFO, "loaderd", "token cache: evicted %s (%.1f MiB, least recently used)", v[i].path,
                   (double)v[i].size / 1048576.0);
        }
    }
    for (size_t i = 0; i < n; i++) free(v[i].path);
    free(v);
    return total;
}

void ld_tcache_grew(ld_tcache *c, const uint8_t keep[32], uint64_t bytes) {
    if (!c) return;
    uint64_t now = atomic_fetch_add(&c->st.bytes, bytes) + bytes;
    if (now > c->max_bytes) atomic_store(&c->st.bytes, scan(c, keep, 1));
}

/* ------------------------------------------------------------------ building an entry
 *
 * A feeder thread reads the shard's lines into chunks (loaderd/chunkq.h), n workers render them
 * (ld_format_render), the calling thread writes the results in line order. The raw bytes read
 * are hashed on the way and must equal the content the key was made from. */

typedef struct {
    const ld_tc_shard *sh;
    ld_source *src;
    ld_chunkq *q;
    tc_sha sha;
    uint64_t n_lines, n_blank;
    int io_failed; /* the shard could not be read to its end */
    char io_msg[320];
} build_t;

static int render_item(void *ctx, ld_item *it, const char *line) {
    const build_t *b = ctx;
    int reason = -1;
    int rc;
    if (b->sh->fcfg->format == LD_FMT_PREFERENCE || b->sh->fcfg->format == LD_FMT_KTO) {
        ld_pref_rec rec;
        rc = ld_format_pref_render(b->sh->fcfg, line, it->len, &it->ids, &it->mask, &rec, &reason);
        if (rc == 0) {
            it->pref_n = rec.n_docs;
            it->pref_len0 = rec.len[0];
            it->pref_label = rec.label;
            it->pref_prompt = rec.prompt_len;
        }
    } else {
        rc = ld_format_render(b->sh->fcfg, line, it->len, &it->ids, &it->mask, &reason);
    }
    if (rc < 0) return rc;
    it->bad = rc == 1 ? reason : -1;
    if (rc == 1) snprintf(it->msg, sizeof it->msg, "%s", bt_last_error()); /* this worker's, made just now */
    return BT_OK;
}

static int is_blank(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (s[i] != ' ' && s[i] != '\t' && s[i] != '\r' && s[i] != '\f' && s[i] != '\v') return 0;
    return 1;
}

/* Feeder: the shard's lines -> chunks. Blank lines are only counted (as the stream does). */
static void *feed_main(void *arg) {
    build_t *b = arg;
    ld_chunk *c = ld_chunkq_claim(b->q);
    while (c) {
        const char *line = NULL;
        size_t len = 0;
        uint64_t no = 0;
        int rc = ld_source_next(b->src, &line, &len, &no);
        if (rc < 0) {
            ld_chunkq_fail(b->q, rc, bt_last_error());
            return NULL;
        }
        if (rc == LD_SRC_END) break;
        if (rc == LD_SRC_IO) {
            b->io_failed = 1;
            snprintf(b->io_msg, sizeof b->io_msg, "%s", bt_last_error());
            ld_chunkq_fail(b->q, BT_ERR_IO, b->io_msg);
            return NULL;
        }
        if (rc == LD_SRC_ZSTD) { /* deterministic for this content: the entry records it */
            b->n_lines++;
            ld_item *it = ld_chunk_add(c, NULL, 0);
            it->line_no = no;
            it->ready = 1;
            it->bad = it->pre_bad = LD_BAD_ZSTD;
            snprintf(it->msg, sizeof it->msg, "%s", bt_last_error());
            break;
        }
        b->n_lines++;
        if (rc == LD_SRC_LINE && is_blank(line, len)) {
            b->n_blank++;
            continue;
        }
        ld_item *it = ld_chunk_add(c, line, rc == LD_SRC_TOO_LONG ? 0 : len);
        it->line_no = no;
        if (rc == LD_SRC_TOO_LONG) {
            it->ready = 1;
            it->bad = it->pre_bad = LD_BAD_TOO_LONG;
            snprintf(it->msg, sizeof it->msg, "line longer than %zu bytes", LD_SOURCE_MAX_LINE);
        }
        if (c->n >= LD_CHUNK_LINES || c->tlen >= LD_CHUNK_BYTES) {
            ld_chunkq_publish(b->q, c);
            c = ld_chunkq_claim(b->q);
        }
    }
    if (c) ld_chunkq_publish(b->q, c);
    ld_chunkq_finish(b->q);
    return NULL;
}

/* Hash the bytes of path from `from` to `to` (what the source did not read after a zstd error). */
static int hash_rest(tc_sha *s, const char *path, uint64_t from, uint64_t to) {
    if (from >= to) return BT_OK;
    int fd = bt_open_ro(path); /* the one safe open (see shard_hash) */
    if (fd < 0) return BT_ERR_IO;
    char buf[65536];
    int rc = BT_OK;
    while (from < to) {
        size_t want = to - from > sizeof buf ? sizeof buf : (size_t)(to - from);
        ssize_t r = pread(fd, buf, want, (off_t)from);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            rc = bt_fail(BT_ERR_IO, "%s: shrank while being tokenized", path);
            break;
        }
        tc_sha_update(s, buf, (size_t)r);
        from += (uint64_t)r;
    }
    close(fd);
    return rc;
}

/* Take the chunks in order and write their records; BT_OK, or the error. */
static int write_records(build_t *b, tc_writer *w, const _Atomic int *stop, uint64_t *tokens) {
    for (;;) {
        if (atomic_load(stop)) return bt_fail(BT_ERR_TIMEOUT, "token cache: stopped");
        ld_chunk *c = NULL;
        int rc = ld_chunkq_take(b->q, &c);
        if (rc == 1) return BT_OK;
        if (rc < 0) return rc;
        for (size_t i = 0; i < c->n && rc == BT_OK; i++) {
            const ld_item *it = &c->items[i];
            if (it->bad == LD_BAD_MEMORY) /* this process's limit, not the shard's content: no entry */
                rc = bt_fail(BT_ERR_NOMEM, "token cache: out of memory at line %llu (%s): not cached",
                             (unsigned long long)it->line_no, it->msg);
            else if (it->bad == LD_BAD_ZSTD) rc = tc_writer_bad(w, TC_SHARD_ERROR, it->line_no, it->bad, it->msg);
            else if (it->bad >= 0) rc = tc_writer_bad(w, TC_BAD, it->line_no, it->bad, it->msg);
            else if (it->pref_n) {
                ld_pref_rec rec = {it->pref_n, {it->pref_len0, (uint32_t)it->ids.n - it->pref_len0}, it->pref_prompt,
                                   it->pref_label, 0};
                rc = tc_writer_pref(w, it->line_no, &rec, it->ids.v, it->mask.v);
                *tokens += it->ids.n;
            } else {
                rc = tc_writer_doc(w, it->line_no, it->ids.v, it->mask.v, it->ids.n);
                *tokens += it->ids.n;
            }
        }
        ld_chunkq_release(b->q, c);
        if (rc != BT_OK) return rc;
    }
}

int tc_build(ld_tcache *c, const ld_tc_shard *sh, const char *path, const uint8_t key[32],
             const uint8_t content[32], uint64_t size, uint32_t n_threads, const _Atomic int *stop) {
    build_t b = {.sh = sh};
    if (ld_source_open(&b.src, sh->path, 0) != BT_OK) {
        bt_log(BT_LOG_WARN, "loaderd", "token cache: %s", bt_last_error_in("token cache"));
        return LD_TC_BYPASS;
    }
    int rc = tc_sha_init(&b.sha);
    if (rc != BT_OK) {
        ld_source_close(b.src);
        return rc;
    }
    ld_source_observe(b.src, tc_sha_cb, &b.sha);
    tc_writer w;
    if (tc_writer_open(&w, path, key, size) != BT_OK) {
        bt_log(BT_LOG_WARN, "loaderd", "token cache: cannot write an entry (%s): reading %s raw",
               bt_last_error_in("token cache"),
               sh->path);
        tc_sha_free(&b.sha);
        ld_source_close(b.src);
        return LD_TC_BYPASS;
    }
    pthread_t feeder;
    int feeding = 0;
    rc = ld_chunkq_new(&b.q, n_threads, render_item, &b);
    if (rc == BT_OK) {
        if (pthread_create(&feeder, NULL, feed_main, &b) == 0) feeding = 1;
        else rc = bt_fail(BT_ERR_NOMEM, "token cache: cannot start a reader thread");
    }
    uint64_t tokens = 0;
    if (rc == BT_OK) rc = write_records(&b, &w, stop, &tokens);
    if (b.q) ld_chunkq_stop(b.q); /* a feeder blocked on a full queue returns */
    if (feeding) pthread_join(feeder, NULL);
    ld_chunkq_free(b.q);
    if (rc == BT_ERR_TIMEOUT || rc == BT_ERR_NOMEM) { /* stopped, or out of memory: no entry */
        tc_sha_free(&b.sha);
        tc_writer_abort(&w);
        ld_source_close(b.src);
        return rc;
    }
    int bypass = 0;
    if (rc != BT_OK) { /* the shard could not be read to its end, or the entry not written */
        bt_log(BT_LOG_WARN, "loaderd", "token cache: %s: %s not cached, read raw",
               b.io_failed ? b.io_msg : bt_last_error_in("token cache"),
               sh->path);
        bypass = 1;
        tc_sha_free(&b.sha);
    } else {
        uint8_t got[32];
        rc = hash_rest(&b.sha, sh->path, ld_source_bytes_read(b.src), ld_source_size(b.src));
        tc_sha_final(&b.sha, got);
        if (rc != BT_OK || ld_source_size(b.src) != size || memcmp(got, content, 32) != 0) {
            atomic_fetch_add_explicit(&ld_tcache_stats_of(c)->stale, 1, memory_order_relaxed);
            bt_log(BT_LOG_WARN, "loaderd", "token cache: %s changed while being tokenized: not cached, read raw",
                   sh->path);
            bypass = 1;
        }
    }
    if (!bypass) {
        if (tc_writer_commit(&w, b.n_lines, b.n_blank) == BT_OK)
            atomic_fetch_add_explicit(&ld_tcache_stats_of(c)->build_tokens, tokens, memory_order_relaxed);
        else {
            bt_log(BT_LOG_WARN, "loaderd", "token cache: %s: reading %s raw", bt_last_error_in("token cache"),
                   sh->path);
            bypass = 1;
        }
    } else {
        tc_writer_abort(&w);
    }
    ld_source_close(b.src);
    return bypass ? LD_TC_BYPASS : BT_OK;
}

/* ------------------------------------------------------------------ acquire */

static int open_entry(ld_tcache *c, const ld_tc_shard *sh, const uint8_t key[32], ld_tc_reader **out) {
    char *p = tc_path(c, key, ".btc", 0);
    tc_inuse_add(c, key); /* before opening: eviction elsewhere in this process keeps off it */
    int rc = tc_reader_open(c, p, key, bt_tokenizer_vocab_size(sh->fcfg->tok), out);
    if (rc == TC_OPEN_OK) {
        int fd = open(p, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
        if (fd >= 0) { /* least recently used = oldest mtime */
            futimens(fd, NULL);
            close(fd);
        }
    } else {
        tc_inuse_del(c, key);
    }
    free(p);
    return rc;
}

static int build_locked(ld_tcache *c, const ld_tc_shard *sh, const uint8_t key[32], const uint8_t content[32],
                        uint64_t size, uint32_t n_threads, const _Atomic int *stop) {
    char *p = tc_path(c, key, ".btc", 1);
    double t0 = bt_now();
    int rc = tc_build(c, sh, p, key, content, size, n_threads, stop);
    if (rc == BT_OK) {
        struct stat st;
        ADD(built, 1);
        ADD(build_bytes, size);
        if (stat(p, &st) == 0) ADD(bytes, (uint64_t)st.st_size);
        bt_log(BT_LOG_INFO, "loaderd", "token cache: tokenized %s (%.1f MiB) in %.2f s", sh->path,
               (double)size / 1048576.0, bt_now() - t0);
        if (atomic_load(&c->st.bytes) > c->max_bytes) atomic_store(&c->st.bytes, scan(c, key, 1));
    }
    free(p);
    return rc;
}

/* While someone else builds `waiting`: build the first other missing entry nobody builds.
 * 1 if one was built (or tried), 0 if there was nothing to do. */
static int build_other(ld_tcache *c, const uint8_t waiting[32], const ld_tc_shard *others, size_t n_others,
                       uint32_t n_threads, const _Atomic int *stop) {
    for (size_t i = 0; i < n_others && !atomic_load(stop); i++) {
        uint8_t key[32], content[32];
        uint64_t size;
        if (shard_key(c, &others[i], key, content, &size) != BT_OK || !memcmp(key, waiting, 32)) continue;
        if (!trusted_for(c, key)) return 0;
        char *p = tc_path(c, key, ".btc", 0);
        int exists = access(p, F_OK) == 0;
        free(p);
        if (exists) continue;
        pthread_mutex_lock(&c->mu);
        int busy = keys_find(c->building, key) != NULL;
        if (!busy) keys_add(&c->building, key);
        pthread_mutex_unlock(&c->mu);
        if (busy) continue;
        int fd = -1, lk = lock_try(c, key, &fd);
        if (lk == 1) {
            p = tc_path(c, key, ".btc", 0);
            if (access(p, F_OK) != 0) build_locked(c, &others[i], key, content, size, n_threads, stop);
            free(p);
            unlock(fd);
        }
        pthread_mutex_lock(&c->mu);
        keys_del(&c->building, key);
        pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->mu);
        if (lk == 1) return 1;
    }
    return 0;
}

/* Sleep up to ms milliseconds or until a build in this process finishes. */
static void wait_a_bit(ld_tcache *c, unsigned ms) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += (long)(ms % 1000) * 1000000L;
    ts.tv_sec += ms / 1000 + ts.tv_nsec / 1000000000L;
    ts.tv_nsec %= 1000000000L;
    pthread_mutex_lock(&c->mu);
    pthread_cond_timedwait(&c->cv, &c->mu, &ts);
    pthread_mutex_unlock(&c->mu);
}

int ld_tcache_acquire(ld_tcache *c, const ld_tc_shard *sh, const ld_tc_shard *others, size_t n_others,
                      uint32_t n_threads, const _Atomic int *stop, ld_tc_reader **out) {
    *out = NULL;
    uint8_t key[32], content[32];
    uint64_t size;
    if (shard_key(c, sh, key, content, &size) != BT_OK) {
        bt_log(BT_LOG_WARN, "loaderd", "token cache: %s: read raw", bt_last_error_in("token cache"));
        ADD(bypassed, 1);
        return LD_TC_BYPASS;
    }
    double t0 = bt_now();
    int missed = 0, waited = 0;
    unsigned pause = 20;
    for (;;) {
        if (atomic_load(stop)) return bt_fail(BT_ERR_TIMEOUT, "token cache: stopped");
        if (!trusted_for(c, key)) { /* before every use: logged once per reason */
            ADD(bypassed, 1);
            return LD_TC_BYPASS;
        }
        if (open_entry(c, sh, key, out) == TC_OPEN_OK) {
            ADD(hits, 1);
            return BT_OK;
        }
        if (!missed++) ADD(misses, 1);
        pthread_mutex_lock(&c->mu);
        int busy = keys_find(c->building, key) != NULL;
        if (!busy) keys_add(&c->building, key);
        pthread_mutex_unlock(&c->mu);
        int fd = -1, lk = busy ? 0 : lock_try(c, key, &fd), rc = 0;
        if (lk == 1) {
            if (open_entry(c, sh, key, out) == TC_OPEN_OK) { /* finished by someone before we locked */
                ADD(hits, 1);
                rc = BT_OK;
            } else {
                rc = build_locked(c, sh, key, content, size, n_threads, stop);
                if (rc == BT_OK) rc = open_entry(c, sh, key, out) == TC_OPEN_OK ? BT_OK : LD_TC_BYPASS;
            }
            unlock(fd);
        }
        if (!busy) {
            pthread_mutex_lock(&c->mu);
            keys_del(&c->building, key);
            pthread_cond_broadcast(&c->cv);
            pthread_mutex_unlock(&c->mu);
        }
        if (lk == 1 || lk < 0) {
            if (lk < 0) bt_log(BT_LOG_WARN, "loaderd", "%s: %s read raw", bt_last_error(), sh->path);
            if (lk < 0 || rc == LD_TC_BYPASS) ADD(bypassed, 1);
            return lk < 0 ? LD_TC_BYPASS : rc;
        }
        /* someone else builds it */
        if (!waited++) {
            ADD(waited, 1);
            bt_log(BT_LOG_INFO, "loaderd", "token cache: %s is being tokenized by another process or job: waiting",
                   sh->path);
        }
        if (bt_now() - t0 > (double)c->wait_s) {
            bt_log(BT_LOG_WARN, "loaderd", "token cache: waited %u s for %s (token_cache_wait_s): tokenizing it here "
                   "without the cache", c->wait_s, sh->path);
            ADD(bypassed, 1);
            return LD_TC_BYPASS;
        }
        if (build_other(c, key, others, n_others, n_threads, stop)) {
            pause = 20;
            continue;
        }
        wait_a_bit(c, pause);
        if (pause < 250) pause *= 2;
    }
}
