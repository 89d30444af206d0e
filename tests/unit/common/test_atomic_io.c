/* Tests for common/atomic_io.c: atomic file commit/abort (no torn or leftover files), directory
 * replacement (fresh rename and RENAME_EXCHANGE over an existing directory), fsync helpers,
 * bt_rm_tree, and the errors (with the caller's component prefix) for unwritable places. */
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

static void make_dir_with(const char *dir, const char *name, const char *text) {
    char p[192];
    assert_int_equal(mkdir(dir, 0755), 0);
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
    assert_int_equal(bt_replace_dir(tmp, dst, "adapter"), BT_OK);
    snprintf(p, sizeof p, "%s/a.txt", dst);
    assert_file_text(p, "one");
    assert_int_equal(access(tmp, F_OK), -1);
    assert_int_equal(bt_fsync_parent(dst, "adapter"), BT_OK);

    /* destination exists: exchanged, the previous contents removed, nothing else left */
    make_dir_with(tmp, "b.txt", "two");
    assert_int_equal(bt_replace_dir(tmp, dst, "checkpoint"), BT_OK);
    snprintf(p, sizeof p, "%s/b.txt", dst);
    assert_file_text(p, "two");
    snprintf(p, sizeof p, "%s/a.txt", dst);
    assert_int_equal(access(p, F_OK), -1);
    assert_int_equal(n_entries(g_dir), 1);
    assert_int_equal(n_entries(dst), 1);

    /* destination is a file: error, tmp left for the caller */
    char file[128];
    path_of(file, sizeof file, "afile");
    spit(file, "x");
    make_dir_with(tmp, "c.txt", "three");
    assert_int_equal(bt_replace_dir(tmp, file, "checkpoint"), BT_ERR_IO);
    assert_error_prefix("checkpoint: ");
    assert_non_null(strstr(bt_last_error(), "is not a directory"));
    assert_int_equal(access(tmp, F_OK), 0);
    assert_file_text(file, "x");

    /* rename into a missing parent: error */
    path_of(p, sizeof p, "no/such/run");
    assert_int_equal(bt_replace_dir(tmp, p, "adapter"), BT_ERR_IO);
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
    assert_int_equal(bt_replace_dir(tmp, dst, "checkpoint"), BT_OK);
    snprintf(p, sizeof p, "%s/b.txt", dst);
    assert_file_text(p, "two");
    assert_int_equal(n_entries(g_dir), 1);

    /* second rename fails: destination restored, tmp left for the caller, error reported */
    make_dir_with(tmp, "c.txt", "three");
    g_fail_rename_from = tmp;
    assert_int_equal(bt_replace_dir(tmp, dst, "checkpoint"), BT_ERR_IO);
    g_fail_rename_from = NULL;
    assert_error_prefix("checkpoint: replace ");
    snprintf(p, sizeof p, "%s/b.txt", dst);
    assert_file_text(p, "two");
    assert_int_equal(n_entries(dst), 1);
    assert_int_equal(access(tmp, F_OK), 0);
    assert_int_equal(n_entries(g_dir), 2); /* run and run.tmp-1: no run.old-<pid> */

    /* first rename fails: nothing moved */
    g_fail_rename_from = dst;
    assert_int_equal(bt_replace_dir(tmp, dst, "checkpoint"), BT_ERR_IO);
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
        if (e[i].is_dir) {
            assert_int_equal(mkdir(p, 0755), 0);
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

int main(void) {
    const struct CMUnitTest tests[] = {
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
