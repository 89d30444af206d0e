/* Tests for common/atomic_io.c and common/out_dir.c: atomic file commit/abort (no torn or leftover
 * files), directory replacement (fresh rename and RENAME_EXCHANGE over an existing directory),
 * fsync helpers, bt_rm_tree, the errors (with the caller's component prefix) for unwritable
 * places, and the ownership rule of output directories (issue 21 §1, §2): a directory holding
 * anything BarqTrain did not write is never replaced, written into or cleaned up. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/atomic_io.h"
#include "common/bt_common.h"
#include "common/out_dir.h"
#include "tests/unit/util/test_util.h"

static char g_dir[64];

/* Fault injection for bt_replace_dir's fallback: these definitions interpose libc's for the
 * whole test binary. g_no_exchange makes renameat2 fail as on a filesystem without
 * RENAME_EXCHANGE; a rename whose source is g_fail_rename_from fails with EIO. */
static int g_no_exchange;
static const char *g_fail_rename_from;

int renameat2(int olddirfd, const char *oldpath, int newdirfd, const char *newpath, unsigned int flags) {
    if (g_no_exchange && (flags & RENAME_EXCHANGE)) {
        errno = EINVAL;
        return -1;
    }
    return (int)syscall(SYS_renameat2, olddirfd, oldpath, newdirfd, newpath, flags);
}

int rename(const char *oldpath, const char *newpath) {
    if (g_fail_rename_from && strcmp(oldpath, g_fail_rename_from) == 0) {
        errno = EIO;
        return -1;
    }
    return (int)syscall(SYS_renameat2, AT_FDCWD, oldpath, AT_FDCWD, newpath, 0);
}

static int setup_dir(void **s) {
    (void)s;
    return tu_make_tmpdir(g_dir, sizeof g_dir, "aio");
}

static int teardown_dir(void **s) {
    (void)s;
    return tu_remove_dir(g_dir);
}

static void path_of(char *out, size_t n, const char *name) { snprintf(out, n, "%s/%s", g_dir, name); }

/* The output kind of these tests: its writer leaves a.txt, b.txt, c.txt, adapter_model.safetensors;
 * g_legacy says whether a marker-less directory of those is "an earlier version's". */
static int g_legacy;
static int owns_test(const char *name) {
    return !strcmp(name, "a.txt") || !strcmp(name, "b.txt") || !strcmp(name, "c.txt") ||
           !strcmp(name, "adapter_model.safetensors");
}
static int legacy_test(const char *dir) {
    (void)dir;
    return g_legacy;
}
static const bt_out_kind k_test = {"test output", owns_test, legacy_test, 1, NULL};
static const bt_out_kind k_inplace = {"test output", owns_test, NULL, 0, NULL};

/* number of entries in dir (without "." and "..") */
static int n_entries(const char *dir) {
    DIR *d = opendir(dir);
    assert_non_null(d);
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        n += strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0;
    closedir(d);
    return n;
}

static void spit(const char *path, const char *text) { tu_write_file(NULL, path, text, strlen(text)); }

static void assert_file_text(const char *path, const char *want) {
    size_t n;
    char *got = (char *)tu_slurp(path, &n);
    got[n] = 0;
    assert_string_equal(got, want);
    free(got);
}

static void assert_error_prefix(const char *prefix) {
    assert_true(strncmp(bt_last_error(), prefix, strlen(prefix)) == 0);
}

static void test_commit(void **s) {
    (void)s;
    char path[128];
    path_of(path, sizeof path, "out.bin");
    for (int round = 0; round < 2; round++) { /* create, then replace an existing file */
        const char *text = round ? "second version" : "first";
        bt_atomic_file af;
        assert_int_equal(bt_atomic_open(&af, path, "test"), BT_OK);
        assert_non_null(strstr(af.tmp, ".tmp."));
        assert_int_equal(n_entries(g_dir), round + 1); /* tmp (+ the previous file) */
        assert_int_equal(bt_atomic_write(&af, text, 3), BT_OK);
        assert_int_equal(bt_atomic_write(&af, text + 3, strlen(text) - 3), BT_OK);
        assert_int_equal(bt_atomic_write(&af, "", 0), BT_OK);
        if (round) assert_file_text(path, "first"); /* untouched until commit */
        assert_int_equal(bt_atomic_commit(&af), BT_OK);
        assert_null(af.tmp);
        assert_int_equal(af.fd, -1);
        assert_file_text(path, text);
        assert_int_equal(n_entries(g_dir), 1); /* no tmp left */
    }
    struct stat st;
    assert_int_equal(stat(path, &st), 0);
    mode_t mask = umask(0);
    umask(mask);
    assert_int_equal(st.st_mode & 0777, 0644 & ~mask);
}

static void test_abort(void **s) {
    (void)s;
    char path[128];
    path_of(path, sizeof path, "new.bin");
    bt_atomic_file af;
    assert_int_equal(bt_atomic_open(&af, path, "test"), BT_OK);
    assert_int_equal(bt_atomic_write(&af, "junk", 4), BT_OK);
    bt_atomic_abort(&af);
    bt_atomic_abort(&af); /* released handle: no-op */
    assert_int_equal(access(path, F_OK), -1);
    assert_int_equal(n_entries(g_dir), 0);

    path_of(path, sizeof path, "old.bin");
    spit(path, "keep me");
    assert_int_equal(bt_atomic_open(&af, path, "test"), BT_OK);
    assert_int_equal(bt_atomic_write(&af, "junk", 4), BT_OK);
    bt_atomic_abort(&af);
    assert_file_text(path, "keep me");
    assert_int_equal(n_entries(g_dir), 1);
}

static void test_open_errors(void **s) {
    (void)s;
    char path[160], file[128];
    bt_atomic_file af;
    path_of(path, sizeof path, "missing/out.bin"); /* no such directory */
    assert_int_equal(bt_atomic_open(&af, path, "gguf writer"), BT_ERR_IO);
    assert_error_prefix("gguf writer: ");
    assert_non_null(strstr(bt_last_error(), "missing/out.bin.tmp."));
    assert_int_equal(af.fd, -1);
    bt_atomic_abort(&af); /* empty handle: no-op */

    path_of(file, sizeof file, "plain");
    spit(file, "x");
    snprintf(path, sizeof path, "%s/out.bin", file); /* parent is a regular file */
    assert_int_equal(bt_atomic_open(&af, path, "safetensors writer"), BT_ERR_IO);
    assert_error_prefix("safetensors writer: ");

    if (geteuid() != 0) { /* root may write anywhere */
        char ro[128];
        path_of(ro, sizeof ro, "ro");
        assert_int_equal(mkdir(ro, 0555), 0);
        snprintf(path, sizeof path, "%s/out.bin", ro);
        assert_int_equal(bt_atomic_open(&af, path, "test"), BT_ERR_IO);
        assert_int_equal(n_entries(ro), 0);
    }
}

/* A directory as a writer builds it: BarqTrain's marker, then its file. */
static void make_dir_with(const char *dir, const char *name, const char *text) {
    char p[192];
    assert_int_equal(mkdir(dir, 0755), 0);
    assert_int_equal(bt_out_dir_mark(dir, &k_test, "test"), BT_OK);
    snprintf(p, sizeof p, "%s/%s", dir, name);
    spit(p, text);
}

static void test_replace_dir(void **s) {
    (void)s;
    char tmp[128], dst[128], p[192];
    path_of(tmp, sizeof tmp, "run.tmp-1");
    path_of(dst, sizeof dst, "run");

    /* destination missing: plain rename */
    make_dir_with(tmp, "a.txt", "one");
    assert_int_equal(bt_replace_dir(tmp, dst, &k_test, "adapter"), BT_OK);
    snprintf(p, sizeof p, "%s/a.txt", dst);
    assert_file_text(p, "one");
    assert_int_equal(access(tmp, F_OK), -1);
    assert_int_equal(bt_fsync_parent(dst, "adapter"), BT_OK);

    /* destination exists: exchanged, the previous contents removed, nothing else left */
    make_dir_with(tmp, "b.txt", "two");
    assert_int_equal(bt_replace_dir(tmp, dst, &k_test, "checkpoint"), BT_OK);
    snprintf(p, sizeof p, "%s/b.txt", dst);
    assert_file_text(p, "two");
    snprintf(p, sizeof p, "%s/a.txt", dst);
    assert_int_equal(access(p, F_OK), -1);
    assert_int_equal(n_entries(g_dir), 1);
    assert_int_equal(n_entries(dst), 2); /* b.txt and the marker */
    assert_true(bt_out_dir_marked(dst));

    /* destination is a file: error, tmp left for the caller */
    char file[128];
    path_of(file, sizeof file, "afile");
    spit(file, "x");
    make_dir_with(tmp, "c.txt", "three");
    assert_int_equal(bt_replace_dir(tmp, file, &k_test, "checkpoint"), BT_ERR_IO);
    assert_error_prefix("checkpoint: ");
    assert_non_null(strstr(bt_last_error(), "is not a directory"));
    assert_int_equal(access(tmp, F_OK), 0);
    assert_file_text(file, "x");

    /* rename into a missing parent: error */
    path_of(p, sizeof p, "no/such/run");
    assert_int_equal(bt_replace_dir(tmp, p, &k_test, "adapter"), BT_ERR_IO);
    assert_error_prefix("adapter: rename ");
    assert_int_equal(access(tmp, F_OK), 0);
}

/* No RENAME_EXCHANGE: two renames. When the second fails, the previous contents go back in
 * place and the error is reported; nothing else is left behind. */
static void test_replace_dir_fallback(void **s) {
    (void)s;
    char tmp[128], dst[128], p[192];
    path_of(tmp, sizeof tmp, "run.tmp-1");
    path_of(dst, sizeof dst, "run");
    make_dir_with(dst, "a.txt", "one");
    g_no_exchange = 1;

    /* fallback succeeds */
    make_dir_with(tmp, "b.txt", "two");
    assert_int_equal(bt_replace_dir(tmp, dst, &k_test, "checkpoint"), BT_OK);
    snprintf(p, sizeof p, "%s/b.txt", dst);
    assert_file_text(p, "two");
    assert_int_equal(n_entries(g_dir), 1);

    /* second rename fails: destination restored, tmp left for the caller, error reported */
    make_dir_with(tmp, "c.txt", "three");
    g_fail_rename_from = tmp;
    assert_int_equal(bt_replace_dir(tmp, dst, &k_test, "checkpoint"), BT_ERR_IO);
    g_fail_rename_from = NULL;
    assert_error_prefix("checkpoint: replace ");
    snprintf(p, sizeof p, "%s/b.txt", dst);
    assert_file_text(p, "two");
    assert_int_equal(n_entries(dst), 2);
    assert_int_equal(access(tmp, F_OK), 0);
    assert_int_equal(n_entries(g_dir), 2); /* run and run.tmp-1: no run.old-<pid> */

    /* first rename fails: nothing moved */
    g_fail_rename_from = dst;
    assert_int_equal(bt_replace_dir(tmp, dst, &k_test, "checkpoint"), BT_ERR_IO);
    g_fail_rename_from = NULL;
    assert_file_text(p, "two");
    assert_int_equal(access(tmp, F_OK), 0);
    assert_int_equal(n_entries(g_dir), 2);
    g_no_exchange = 0;
}

static void test_fsync_and_rm_tree(void **s) {
    (void)s;
    char p[128], q[192];
    assert_int_equal(bt_fsync_path(g_dir, 1, "test"), BT_OK);
    path_of(p, sizeof p, "f");
    spit(p, "x");
    assert_int_equal(bt_fsync_path(p, 0, "test"), BT_OK);
    assert_int_equal(bt_fsync_path(p, 1, "test"), BT_ERR_IO); /* not a directory */
    assert_error_prefix("test: open ");
    path_of(p, sizeof p, "gone");
    assert_int_equal(bt_fsync_path(p, 0, "checkpoint"), BT_ERR_IO);
    assert_error_prefix("checkpoint: open ");
    assert_int_equal(bt_fsync_parent("bare-name", "test"), BT_OK); /* "." */
    assert_int_equal(bt_fsync_parent("/bt-root-entry", "test"), BT_OK); /* "/" */
    path_of(p, sizeof p, "no/such/x");
    assert_int_equal(bt_fsync_parent(p, "test"), BT_ERR_IO);

    path_of(p, sizeof p, "tree");
    snprintf(q, sizeof q, "%s/sub", p);
    assert_int_equal(mkdir(p, 0755), 0);
    assert_int_equal(mkdir(q, 0755), 0);
    snprintf(q, sizeof q, "%s/sub/leaf", p);
    spit(q, "x");
    bt_rm_tree(p);
    assert_int_equal(access(p, F_OK), -1);
    bt_rm_tree(p); /* missing: fine */
}

/* A pid that is not running: a child that has exited and been reaped. */
static long dead_pid(void) {
    pid_t p = fork();
    assert_true(p >= 0);
    if (p == 0) _exit(0);
    assert_int_equal(waitpid(p, NULL, 0), p);
    return (long)p;
}

static int exists(const char *p) {
    struct stat st;
    return lstat(p, &st) == 0;
}

/* Leftovers of saves killed mid-write (issue 10 §7): our own temporary names are removed when no
 * live save holds them; nothing else is ever touched. */
static void test_clean_stale_temps(void **s) {
    (void)s;
    long dead = dead_pid(), dead2 = dead_pid(), me = (long)getpid(), live = (long)getppid();
    char out[128], p[300];
    path_of(out, sizeof out, "out");
    assert_int_equal(mkdir(out, 0755), 0);
    struct {
        const char *fmt;
        long pid;
        int is_dir, gone;
    } e[] = {
        {"out.tmp-%ld", dead + 4000000, 3, 0}, /* our pattern, but no marker: not a save of ours */
        {"out.tmp-%ld", dead, 1, 1},          /* an adapter / checkpoint directory */
        {"out.tmp-%ld.tmp-%ld", dead2, 1, 1}, /* the adapter inside a checkpoint's */
        {"out.old-%ld", dead2, 1, 1},         /* bt_replace_dir's fallback */
        {"out.tmp.%ld.7", dead, 0, 1},        /* an atomic file */
        {"out.tmp.%ld", dead, 0, 1},          /* the export's config.json temp */
        {"out.tmp-%ld", me, 1, 1},            /* our own pid: a dead process that had it */
        {"out.tmp-%ld", live, 1, 0},          /* a live process may be saving right now */
        {"out.tmp-abc%ld", dead, 1, 0},       /* not our pattern: */
        {"out.tmpx-%ld", dead, 1, 0},
        {"outx.tmp-%ld", dead, 1, 0},
        {"out.tmp-%ld.txt", dead, 0, 0},
        {"out.tmp-%ld-", dead, 0, 0},
        {"out.bak%ld", dead, 0, 0},
        {"%ld.tmp-1", dead, 0, 0},
    };
    size_t ne = sizeof e / sizeof e[0];
    for (size_t i = 0; i < ne; i++) {
        snprintf(p, sizeof p, "%s/", g_dir);
        size_t k = strlen(p);
        snprintf(p + k, sizeof p - k, e[i].fmt, e[i].pid, e[i].pid);
        if (e[i].is_dir) { /* as a save leaves it: the marker first (3: a user's, unmarked) */
            assert_int_equal(mkdir(p, 0755), 0);
            if (e[i].is_dir == 1) assert_int_equal(bt_out_dir_mark(p, &k_test, "test"), BT_OK);
            char q[360];
            snprintf(q, sizeof q, "%s/adapter_model.safetensors", p);
            spit(q, "partial");
        } else {
            spit(p, "partial");
        }
    }
    /* a live save holds its lock: kept even with a dead-looking pid */
    char locked[200];
    snprintf(locked, sizeof locked, "%s/out.tmp-%ld", g_dir, dead + 1000000);
    int lk = bt_tmpdir_create(locked, "test");
    assert_true(lk >= 0);
    /* a symlink with our name pattern: never followed, never removed */
    char target[200], link[200];
    path_of(target, sizeof target, "keep-me");
    assert_int_equal(mkdir(target, 0755), 0);
    snprintf(link, sizeof link, "%s/out.tmp-%ld", g_dir, dead + 2000000);
    assert_int_equal(symlink(target, link), 0);
    /* inside the destination (exports write there): temporaries of dead pids only */
    char in1[200], in2[200], in3[200];
    snprintf(in1, sizeof in1, "%s/model.safetensors.tmp.%ld.3", out, dead);
    snprintf(in2, sizeof in2, "%s/notes.tmp.x", out);
    snprintf(in3, sizeof in3, "%s/a.tmp.%ld.1", out, live);
    spit(in1, "x");
    spit(in2, "x");
    spit(in3, "x");
    /* owned by someone else: kept (only when we can make such a file) */
    char other[200];
    snprintf(other, sizeof other, "%s/out.tmp-%ld", g_dir, dead + 3000000);
    assert_int_equal(mkdir(other, 0755), 0);
    int chowned = geteuid() == 0 && chown(other, 65534, 65534) == 0;

    int removed = bt_clean_stale_temps(out, "test");
    int want = 1; /* in1 */
    for (size_t i = 0; i < ne; i++) {
        snprintf(p, sizeof p, "%s/", g_dir);
        size_t k = strlen(p);
        snprintf(p + k, sizeof p - k, e[i].fmt, e[i].pid, e[i].pid);
        if (exists(p) == e[i].gone) fail_msg("%s: %s", p, e[i].gone ? "left behind" : "removed");
        want += e[i].gone;
    }
    if (!chowned) want++; /* ours after all: removed */
    assert_int_equal(removed, want);
    assert_true(exists(locked) && exists(link) && exists(target) && exists(out));
    assert_true(!exists(in1) && exists(in2) && exists(in3));
    assert_int_equal(exists(other), chowned);
    close(lk);
    /* once its writer is gone (the lock released), it goes too: its pid does not run */
    assert_int_equal(bt_clean_stale_temps(out, "test"), 1);
    assert_false(exists(locked));
    /* an old leftover of a pid that runs now (another host on a shared filesystem) */
    snprintf(p, sizeof p, "%s/out.tmp-%ld", g_dir, live);
    struct timespec old[2] = {{time(NULL) - 7200, 0}, {time(NULL) - 7200, 0}};
    assert_int_equal(utimensat(AT_FDCWD, p, old, AT_SYMLINK_NOFOLLOW), 0);
    assert_int_equal(bt_clean_stale_temps(out, "test"), 1);
    assert_false(exists(p));
    /* a file destination and a bare name work too; a missing parent is fine */
    char f[200];
    path_of(f, sizeof f, "model.gguf.tmp.%ld.1");
    snprintf(f, sizeof f, "%s/model.gguf.tmp.%ld.1", g_dir, dead);
    spit(f, "x");
    path_of(p, sizeof p, "model.gguf");
    assert_int_equal(bt_clean_stale_temps(p, "test"), 1);
    assert_int_equal(bt_clean_stale_temps("/nonexistent-dir/x", "test"), 0);
    if (chowned) bt_rm_tree(other);
}

/* A directory holding anything BarqTrain did not write is never replaced (issue 21 §1): foreign
 * files, a subdirectory, a link, a forged marker, or our file names without the marker (unless
 * the kind recognises an earlier version's); empty and our own directories are. */
static void test_replace_dir_refuses_foreign(void **s) {
    (void)s;
    char tmp[128], dst[128], p[192], target[128];
    path_of(tmp, sizeof tmp, "run.tmp-1");
    path_of(dst, sizeof dst, "run");
    for (g_no_exchange = 0; g_no_exchange < 2; g_no_exchange++) { /* both ways of replacing */
        make_dir_with(dst, "a.txt", "ours");
        snprintf(p, sizeof p, "%s/notes.txt", dst);
        spit(p, "the user's");
        make_dir_with(tmp, "b.txt", "new");
        assert_int_equal(bt_replace_dir(tmp, dst, &k_test, "adapter"), BT_ERR_INVALID);
        assert_error_prefix("adapter: ");
        assert_non_null(strstr(bt_last_error(), "holds 1 entry that BarqTrain did not write (\"notes.txt\")"));
        assert_non_null(strstr(bt_last_error(), "refusing to replace it"));
        assert_file_text(p, "the user's");
        assert_int_equal(n_entries(dst), 3);
        assert_int_equal(access(tmp, F_OK), 0); /* left for the caller */
        bt_rm_tree(tmp);
        bt_rm_tree(dst);
    }
    g_no_exchange = 0;
    /* a subdirectory */
    make_dir_with(dst, "a.txt", "ours");
    snprintf(p, sizeof p, "%s/photos", dst);
    assert_int_equal(mkdir(p, 0755), 0);
    make_dir_with(tmp, "b.txt", "new");
    assert_int_equal(bt_replace_dir(tmp, dst, &k_test, "adapter"), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "\"photos (not a regular file)\""));
    assert_int_equal(access(p, F_OK), 0);
    bt_rm_tree(dst);
    /* a link to a directory: refused, the target untouched */
    path_of(target, sizeof target, "elsewhere");
    make_dir_with(target, "a.txt", "ours");
    assert_int_equal(symlink(target, dst), 0);
    assert_int_equal(bt_replace_dir(tmp, dst, &k_test, "adapter"), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "is a symbolic link"));
    unlink(dst);
    /* our names without the marker: an earlier version's only if the kind recognises them */
    assert_int_equal(mkdir(dst, 0755), 0);
    snprintf(p, sizeof p, "%s/a.txt", dst);
    spit(p, "old");
    g_legacy = 0;
    assert_int_equal(bt_replace_dir(tmp, dst, &k_test, "adapter"), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "no .barqtrain marker"));
    assert_file_text(p, "old");
    g_legacy = 1;
    assert_int_equal(bt_replace_dir(tmp, dst, &k_test, "adapter"), BT_OK);
    g_legacy = 0;
    assert_int_equal(access(p, F_OK), -1);
    assert_int_equal(n_entries(g_dir), 2); /* run, elsewhere */
    /* a marker that is not ours */
    snprintf(p, sizeof p, "%s/" BT_OUT_MARKER, dst);
    spit(p, "{\"mine\": true}");
    make_dir_with(tmp, "c.txt", "new");
    assert_int_equal(bt_replace_dir(tmp, dst, &k_test, "adapter"), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "not BarqTrain's marker"));
    bt_rm_tree(dst);
    /* empty, and only the marker: replaced */
    assert_int_equal(mkdir(dst, 0755), 0);
    assert_int_equal(bt_replace_dir(tmp, dst, &k_test, "adapter"), BT_OK);
    make_dir_with(tmp, "a.txt", "newer");
    assert_int_equal(bt_replace_dir(tmp, dst, &k_test, "adapter"), BT_OK);
    snprintf(p, sizeof p, "%s/a.txt", dst);
    assert_file_text(p, "newer");
}

/* bt_out_dir_check before any work (issue 21 §2): creatable, writable, a directory. */
static void test_out_dir_check(void **s) {
    (void)s;
    char p[192], f[128];
    path_of(p, sizeof p, "new/deeper/out");
    assert_int_equal(bt_out_dir_check(p, &k_test, "test"), BT_OK); /* created later, parents too */
    assert_int_equal(access(p, F_OK), -1);                          /* the check creates nothing */
    path_of(f, sizeof f, "afile");
    spit(f, "x");
    assert_int_equal(bt_out_dir_check(f, &k_test, "out_dir"), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "exists and is not a directory"));
    snprintf(p, sizeof p, "%s/afile/out", g_dir);
    assert_int_equal(bt_out_dir_check(p, &k_test, "out_dir"), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "cannot be created:"));
    assert_non_null(strstr(bt_last_error(), "afile is not a directory"));
    /* written into in place: the same rule, and our own temporaries inside are ours */
    path_of(p, sizeof p, "inplace");
    make_dir_with(p, "a.txt", "x");
    char q[300];
    snprintf(q, sizeof q, "%s/a.txt.tmp.12345.3", p);
    spit(q, "partial");
    assert_int_equal(bt_out_dir_check(p, &k_inplace, "report"), BT_OK);
    snprintf(q, sizeof q, "%s/mine.csv", p);
    spit(q, "x");
    assert_int_equal(bt_out_dir_check(p, &k_inplace, "report"), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "refusing to write into it"));
    assert_int_equal(bt_out_dir_check(p, &k_inplace, "report"), BT_ERR_INVALID);
    /* a directory that cannot be written (not as root: root writes anyway) */
    if (geteuid() != 0) {
        path_of(p, sizeof p, "ro");
        assert_int_equal(mkdir(p, 0555), 0);
        assert_int_equal(bt_out_dir_check(p, &k_test, "out_dir"), BT_ERR_IO);
        assert_non_null(strstr(bt_last_error(), "Permission denied"));
        chmod(p, 0755);
    }
}

/* The old contents after a swap: only what the kind owns is removed; anything put in meanwhile is
 * kept under <old>.kept-<pid>. */
static void test_remove_old_keeps_foreign(void **s) {
    (void)s;
    char old[128], p[192], kept[192];
    path_of(old, sizeof old, "run.tmp-9");
    make_dir_with(old, "a.txt", "ours");
    bt_out_dir_remove_old(old, &k_test, "test");
    assert_int_equal(n_entries(g_dir), 0);
    make_dir_with(old, "a.txt", "ours");
    snprintf(p, sizeof p, "%s/user.txt", old);
    spit(p, "the user's");
    bt_out_dir_remove_old(old, &k_test, "test");
    snprintf(kept, sizeof kept, "%s.kept-%d/user.txt", old, (int)getpid());
    assert_file_text(kept, "the user's");
    assert_int_equal(n_entries(g_dir), 1);
    snprintf(kept, sizeof kept, "%s.kept-%d", old, (int)getpid());
    assert_int_equal(n_entries(kept), 1);
}

static int g_ours_file;
static int ours_file(const char *path) {
    (void)path;
    return g_ours_file;
}

/* Whole-file writers (GGUF exports): create, or replace only a file recognised as ours. */
static void test_out_file_check(void **s) {
    (void)s;
    char p[192], l[192];
    path_of(p, sizeof p, "model.gguf");
    assert_int_equal(bt_out_file_check(p, ours_file, "export"), BT_OK);
    spit(p, "the user's model");
    g_ours_file = 0;
    assert_int_equal(bt_out_file_check(p, ours_file, "export"), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "exists and was not written by BarqTrain: refusing to overwrite it"));
    assert_int_equal(bt_out_file_check(p, NULL, "export"), BT_ERR_INVALID);
    g_ours_file = 1;
    assert_int_equal(bt_out_file_check(p, ours_file, "export"), BT_OK);
    path_of(l, sizeof l, "link.gguf");
    assert_int_equal(symlink(p, l), 0);
    assert_int_equal(bt_out_file_check(l, ours_file, "export"), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "is a symbolic link"));
    assert_int_equal(bt_out_file_check(g_dir, ours_file, "export"), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "is a directory"));
    path_of(p, sizeof p, "no/such/model.gguf");
    assert_int_equal(bt_out_file_check(p, ours_file, "export"), BT_ERR_IO);
    assert_non_null(strstr(bt_last_error(), "cannot be created"));
    g_ours_file = 0;
}

/* A temporary directory of our name that is not ours (no marker, not empty) is never removed. */
static void test_tmpdir_create_refuses_foreign(void **s) {
    (void)s;
    char tmp[128], p[192];
    path_of(tmp, sizeof tmp, "out.tmp-77");
    assert_int_equal(mkdir(tmp, 0755), 0);
    snprintf(p, sizeof p, "%s/thesis.tex", tmp);
    spit(p, "the user's");
    assert_int_equal(bt_tmpdir_create(tmp, "adapter"), -1);
    assert_non_null(strstr(bt_last_error(), "was not written by BarqTrain"));
    assert_file_text(p, "the user's");
    unlink(p);
    assert_int_equal(bt_out_dir_mark(tmp, &k_test, "test"), BT_OK); /* ours: removed, made anew */
    int fd = bt_tmpdir_create(tmp, "adapter");
    assert_true(fd >= 0);
    close(fd);
    assert_int_equal(n_entries(tmp), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_replace_dir_refuses_foreign, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_out_dir_check, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_remove_old_keeps_foreign, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_out_file_check, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_tmpdir_create_refuses_foreign, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_clean_stale_temps, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_commit, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_abort, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_open_errors, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_replace_dir, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_replace_dir_fallback, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_fsync_and_rm_tree, setup_dir, teardown_dir),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
