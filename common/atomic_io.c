/* Crash-safe file and directory replacement. See atomic_io.h. */
#include "common/atomic_io.h"

#include <errno.h>
#include <stdatomic.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "common/out_dir.h"

static void release(bt_atomic_file *af) {
    free(af->tmp);
    free(af->path);
    af->fd = -1;
    af->tmp = af->path = NULL;
}

int bt_atomic_open(bt_atomic_file *af, const char *path, const char *component) {
    /* A temp name unique to this process and call, created exclusively and never through a
     * symlink: two threads writing the same path do not collide, and a planted link is refused.
     * A leftover from a crashed process that had the same pid is removed and the open retried. */
    static _Atomic unsigned long counter;
    size_t tmp_len = strlen(path) + 48;
    *af = (bt_atomic_file){.fd = -1, .component = component};
    af->tmp = bt_xmalloc(tmp_len);
    snprintf(af->tmp, tmp_len, "%s.tmp.%ld.%lu", path, (long)getpid(), ++counter);
    const int flags = O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC;
    af->fd = open(af->tmp, flags, 0644);
    if (af->fd < 0 && errno == EEXIST && unlink(af->tmp) == 0)
        af->fd = open(af->tmp, flags, 0644);
    if (af->fd < 0) {
        int rc = bt_fail(BT_ERR_IO, "%s: %s: %s", component, af->tmp, strerror(errno));
        release(af);
        return rc;
    }
    flock(af->fd, LOCK_EX | LOCK_NB); /* "a save is writing this" (bt_clean_stale_temps) */
    af->path = bt_xstrdup(path);
    return BT_OK;
}

int bt_atomic_write(bt_atomic_file *af, const void *p, size_t n) {
    const uint8_t *b = p;
    while (n) {
        ssize_t k = write(af->fd, b, n > (1u << 30) ? (1u << 30) : n);
        if (k < 0) {
            if (errno == EINTR) continue;
            return bt_fail(BT_ERR_IO, "%s: %s: write: %s", af->component, af->tmp,
                           strerror(errno));
        }
        b += k;
        n -= (size_t)k;
    }
    return BT_OK;
}

int bt_atomic_commit(bt_atomic_file *af) {
    int rc = BT_OK;
    if (fsync(af->fd) != 0) {
        rc = bt_fail(BT_ERR_IO, "%s: %s: fsync: %s", af->component, af->tmp, strerror(errno));
        goto fail;
    }
    int cr = close(af->fd);
    af->fd = -1;
    if (cr != 0) {
        rc = bt_fail(BT_ERR_IO, "%s: %s: close: %s", af->component, af->tmp, strerror(errno));
        goto fail;
    }
    if (rename(af->tmp, af->path) != 0) {
        rc = bt_fail(BT_ERR_IO, "%s: rename %s -> %s: %s", af->component, af->tmp, af->path,
                     strerror(errno));
        goto fail;
    }
    (void)bt_fsync_parent(af->path, af->component); /* best effort: make the rename durable */
    release(af);
    return BT_OK;
fail:
    bt_atomic_abort(af);
    return rc;
}

void bt_atomic_abort(bt_atomic_file *af) {
    if (af->fd >= 0) close(af->fd);
    if (af->tmp) unlink(af->tmp);
    release(af);
}

int bt_fsync_path(const char *path, int is_dir, const char *component) {
    /* O_NONBLOCK: a FIFO found at `path` must not hang the writer (its fsync answers EINVAL) */
    int fd = open(path, (is_dir ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return bt_fail(BT_ERR_IO, "%s: open %s: %s", component, path, strerror(errno));
    int rc = fsync(fd) != 0 && errno != EINVAL
                 ? bt_fail(BT_ERR_IO, "%s: fsync %s: %s", component, path, strerror(errno))
                 : BT_OK;
    close(fd);
    return rc;
}

int bt_fsync_parent(const char *path, const char *component) {
    char *parent = bt_xstrdup(path);
    char *slash = strrchr(parent, '/');
    if (slash && slash != parent) *slash = 0;
    else if (slash) slash[1] = 0;
    else {
        free(parent);
        parent = bt_xstrdup(".");
    }
    int rc = bt_fsync_path(parent, 1, component);
    free(parent);
    return rc;
}

static int rm_cb(const char *fpath, const struct stat *sb, int typeflag, struct FTW *ftwbuf) {
    (void)sb;
    (void)ftwbuf;
    return (typeflag == FTW_DP ? rmdir(fpath) : unlink(fpath)) != 0 ? -1 : 0;
}

void bt_rm_tree(const char *path) { nftw(path, rm_cb, 16, FTW_DEPTH | FTW_PHYS); }

int bt_replace_dir(const char *tmp_dir, const char *dst_dir, const bt_out_kind *kind, const char *component) {
    struct stat st;
    if (lstat(dst_dir, &st) != 0) {
        if (rename(tmp_dir, dst_dir) != 0)
            return bt_fail(BT_ERR_IO, "%s: rename %s -> %s: %s", component, tmp_dir, dst_dir,
                           strerror(errno));
        return BT_OK;
    }
    if (!S_ISDIR(st.st_mode) && !S_ISLNK(st.st_mode))
        return bt_fail(BT_ERR_IO, "%s: %s exists and is not a directory", component, dst_dir);
    /* never replace what BarqTrain did not write (common/out_dir.h): a link, foreign files */
    int rc = bt_out_dir_check(dst_dir, kind, component);
    if (rc) return rc;
    if (renameat2(AT_FDCWD, tmp_dir, AT_FDCWD, dst_dir, RENAME_EXCHANGE) == 0) {
        bt_out_dir_remove_old(tmp_dir, kind, component); /* now holds the previous contents */
        return BT_OK;
    }
    /* filesystems without RENAME_EXCHANGE: two renames, brief gap */
    char *old = NULL;
    if (asprintf(&old, "%s.old-%d", dst_dir, (int)getpid()) < 0)
        return bt_fail(BT_ERR_NOMEM, "%s: out of memory", component);
    if (lstat(old, &st) == 0 && !bt_tmp_is_ours(old)) {
        rc = bt_fail(BT_ERR_IO, "%s: replace %s: %s exists and was not written by BarqTrain", component, dst_dir, old);
    } else if (bt_rm_tree(old), rename(dst_dir, old) != 0) {
        rc = bt_fail(BT_ERR_IO, "%s: replace %s: rename to %s: %s", component, dst_dir, old, strerror(errno));
    } else if (rename(tmp_dir, dst_dir) != 0) {
        int e = errno;
        /* put the previous contents back: the destination must never be left missing */
        if (rename(old, dst_dir) != 0)
            rc = bt_fail(BT_ERR_IO, "%s: replace %s: %s; restoring it from %s also failed: %s", component, dst_dir,
                         strerror(e), old, strerror(errno));
        else
            rc = bt_fail(BT_ERR_IO, "%s: replace %s: %s (previous contents kept)", component, dst_dir, strerror(e));
    } else {
        bt_out_dir_remove_old(old, kind, component);
    }
    free(old);
    return rc;
}

int bt_tmp_is_ours(const char *path) {
    struct stat st;
    if (lstat(path, &st) != 0) return 0;
    if (S_ISREG(st.st_mode)) return 1; /* a file of ours: "<x>.tmp.<pid>[.<n>]" by name */
    if (!S_ISDIR(st.st_mode)) return 0;
    if (bt_out_dir_marked(path)) return 1;
    DIR *d = opendir(path);
    if (!d) return 0;
    int empty = 1;
    for (struct dirent *e; empty && (e = readdir(d));)
        empty = !strcmp(e->d_name, ".") || !strcmp(e->d_name, "..");
    closedir(d);
    return empty;
}

int bt_mkdir_p(const char *path, const char *component) {
    char *p = bt_xstrdup(path);
    int rc = 0;
    for (char *s = p + 1;; s++) {
        if (*s != '/' && *s) continue;
        char c = *s;
        *s = 0;
        if (mkdir(p, 0755) != 0 && errno != EEXIST) {
            rc = bt_fail(BT_ERR_IO, "%s: mkdir %s: %s", component, p, strerror(errno));
            break;
        }
        if (!c) break;
        *s = c;
    }
    free(p);
    return rc;
}

/* ---------------------------------------------------------------- stale temporaries */

int bt_tmpdir_create(const char *tmp, const char *component) {
    struct stat st;
    if (lstat(tmp, &st) == 0) { /* a leftover of a crashed save by a process with our pid */
        if (!bt_tmp_is_ours(tmp)) {
            bt_fail(BT_ERR_IO, "%s: %s exists and was not written by BarqTrain: refusing to remove it", component,
                    tmp);
            return -1;
        }
        bt_rm_tree(tmp);
    }
    if (mkdir(tmp, 0755) != 0) {
        bt_fail(BT_ERR_IO, "%s: mkdir %s: %s", component, tmp, strerror(errno));
        return -1;
    }
    int fd = bt_tmpdir_lock(tmp);
    if (fd < 0) bt_fail(BT_ERR_IO, "%s: open %s: %s", component, tmp, strerror(errno));
    return fd;
}

int bt_tmpdir_lock(const char *tmp) {
    int fd = open(tmp, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd >= 0) flock(fd, LOCK_EX | LOCK_NB);
    return fd;
}

/* Digits at *p (advanced past them) as a pid; -1 if none. */
static long take_digits(const char **p) {
    const char *s = *p;
    long v = 0;
    while (*s >= '0' && *s <= '9' && v < 100000000) v = v * 10 + (*s++ - '0');
    if (s == *p || (*s >= '0' && *s <= '9')) return -1;
    *p = s;
    return v;
}

/* Whether `name` is base + one or more of ".tmp-N", ".old-N", ".tmp.N[.M]"; *pid = the first N. */
static int is_our_sibling(const char *name, const char *base, long *pid) {
    size_t bl = strlen(base);
    if (strncmp(name, base, bl) != 0) return 0;
    const char *p = name + bl;
    *pid = -1;
    int segs = 0;
    while (*p) {
        long v;
        if (!strncmp(p, ".tmp-", 5) || !strncmp(p, ".old-", 5)) {
            p += 5;
            if ((v = take_digits(&p)) < 0) return 0;
        } else if (!strncmp(p, ".tmp.", 5)) {
            p += 5;
            if ((v = take_digits(&p)) < 0) return 0;
            if (*p == '.' && p[1] >= '0' && p[1] <= '9') { /* the writer's counter */
                p++;
                if (take_digits(&p) < 0) return 0;
            }
        } else {
            return 0;
        }
        if (*pid < 0) *pid = v;
        segs++;
    }
    return segs > 0;
}

/* Whether `name` (inside a destination directory) is "<x>.tmp.N[.M]" with a non-empty x. */
static int is_our_inner_file(const char *name, long *pid) {
    for (const char *t = strstr(name, ".tmp."); t; t = strstr(t + 1, ".tmp.")) {
        if (t == name) continue;
        const char *p = t + 5;
        long v = take_digits(&p);
        if (v < 0) continue;
        if (*p == '.' && p[1] >= '0' && p[1] <= '9') {
            p++;
            if (take_digits(&p) < 0) continue;
        }
        if (*p == 0) {
            *pid = v;
            return 1;
        }
    }
    return 0;
}

int bt_atomic_tmp_name(const char *name) {
    long pid;
    return is_our_inner_file(name, &pid);
}

static int is_stale(const char *path, long pid) {
    struct stat st;
    if (lstat(path, &st) != 0 || st.st_uid != geteuid()) return 0;
    if (!S_ISDIR(st.st_mode) && !S_ISREG(st.st_mode)) return 0; /* symlinks etc.: never ours */
    if (!bt_tmp_is_ours(path)) return 0; /* a directory without our marker: not a save of ours */
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK | (S_ISDIR(st.st_mode) ? O_DIRECTORY : 0));
    if (fd < 0) return 0;
    int busy = flock(fd, LOCK_EX | LOCK_NB) != 0; /* a live save holds it */
    close(fd);
    if (busy) return 0;
    int dead = pid > 0 && (pid == (long)getpid() || (kill((pid_t)pid, 0) != 0 && errno == ESRCH));
    int old = time(NULL) - st.st_mtime > 3600;
    return dead || old;
}

static int clean_in(const char *dir, const char *base, const char *component) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        long pid = -1;
        if (!(base ? is_our_sibling(e->d_name, base, &pid) : is_our_inner_file(e->d_name, &pid))) continue;
        char *p = NULL;
        if (asprintf(&p, "%s/%s", dir, e->d_name) < 0) break;
        if (is_stale(p, pid)) {
            bt_rm_tree(p);
            struct stat st;
            if (lstat(p, &st) != 0) {
                bt_log(BT_LOG_INFO, component, "removed %s: the temporary of a save killed mid-write (process %ld)",
                       p, pid);
                n++;
            }
        }
        free(p);
    }
    closedir(d);
    return n;
}

int bt_clean_stale_temps(const char *dst, const char *component) {
    size_t n = strlen(dst);
    while (n > 1 && dst[n - 1] == '/') n--;
    char *d = strndup(dst, n);
    if (!d) return 0;
    char *slash = strrchr(d, '/');
    const char *base = slash ? slash + 1 : d;
    char *parent = slash ? strndup(d, slash == d ? 1 : (size_t)(slash - d)) : strdup(".");
    int removed = 0;
    if (parent && *base && strcmp(base, ".") && strcmp(base, "..")) removed += clean_in(parent, base, component);
    struct stat st;
    if (lstat(d, &st) == 0 && S_ISDIR(st.st_mode)) removed += clean_in(d, NULL, component);
    free(parent);
    free(d);
    return removed;
}
