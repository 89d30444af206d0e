/* Files changed under us while we read them (issue 10 §1): the SIGBUS guard of bt_map_open
 * (a read past a new end reads zeros, never kills the process; bt_map_check says what
 * happened), in-place rewrites and replacement by rename, bt_read_file, and the readers built
 * on them: GGUF (bt_gguf_check), safetensors (bt_st_check), and a tokenizer loaded while its
 * file is cut (through the bt_test_pause_point hook, serviced by a thread, exactly as the
 * process-level tests do with loaderd and the trainer). A SIGBUS on a mapping that is not ours
 * still kills the process (the handler chains). Under ASan+UBSan too. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "common/gguf.h"
#include "common/safetensors.h"
#include "common/tokenizer.h"
#include "tests/unit/util/test_util.h"

static char g_dir[64];

static int setup(void **st) {
    (void)st;
    return tu_make_tmpdir(g_dir, sizeof g_dir, "filechange");
}
static int teardown(void **st) {
    (void)st;
    return tu_remove_dir(g_dir);
}

static void path_of(char *p, size_t n, const char *name) { snprintf(p, n, "%s/%s", g_dir, name); }

static void write_pattern(const char *p, size_t n) {
    uint8_t *b = malloc(n);
    for (size_t i = 0; i < n; i++) b[i] = (uint8_t)(1 + i % 251); /* never 0 */
    tu_write_file(NULL, p, b, n);
    free(b);
}

static void assert_changed(int rc) {
    assert_int_equal(rc, BT_ERR_IO);
    if (!strstr(bt_last_error(), "changed while being read")) fail_msg("message: %s", bt_last_error());
}

/* Truncated under the mapping: every page past the new end reads as zeros, nothing kills us, and
 * the map reports the change with both sizes. */
static void test_truncated_mapping(void **st) {
    (void)st;
    char p[128];
    path_of(p, sizeof p, "cut.bin");
    size_t n = 5 * 4096 + 123;
    write_pattern(p, n);
    bt_map m;
    assert_int_equal(bt_map_open(&m, p), BT_OK);
    assert_int_equal(m.size, n);
    assert_int_equal(bt_map_check(&m, 7), 7); /* unchanged: the caller's result stands */
    assert_int_equal(m.data[100], 1 + 100 % 251); /* a page read before the cut keeps its bytes */
    assert_int_equal(truncate(p, 4096), 0);
    uint64_t sum = 0;
    for (size_t i = 4096; i < n; i++) sum += m.data[i]; /* would be SIGBUS without the guard */
    assert_int_equal(sum, 0);
    assert_changed(bt_map_check(&m, BT_OK));
    assert_non_null(strstr(bt_last_error(), "read past its new end"));
    assert_non_null(strstr(bt_last_error(), "now 4096 bytes"));
    assert_changed(bt_map_check(&m, BT_ERR_FORMAT)); /* the change wins over what zeros led to */
    bt_map_close(&m);
    /* a new mapping of the cut file is a fresh, consistent file */
    assert_int_equal(bt_map_open(&m, p), BT_OK);
    assert_int_equal(m.size, 4096);
    assert_int_equal(bt_map_check(&m, BT_OK), BT_OK);
    bt_map_close(&m);
}

/* Rewritten in place (same size, new content): reported; replaced by rename: not a change (we
 * hold the old file, whole). */
static void test_rewritten_and_replaced(void **st) {
    (void)st;
    char p[128], q[128];
    path_of(p, sizeof p, "rw.bin");
    path_of(q, sizeof q, "rw.new");
    write_pattern(p, 10000);
    bt_map m;
    assert_int_equal(bt_map_open(&m, p), BT_OK);
    struct timespec later[2] = {{0, UTIME_OMIT}, {time(NULL) + 5, 0}};
    int fd = open(p, O_WRONLY);
    assert_true(fd >= 0);
    assert_int_equal(pwrite(fd, "XYZ", 3, 500), 3);
    assert_int_equal(futimens(fd, later), 0); /* mtime moves even on coarse clocks */
    close(fd);
    assert_changed(bt_map_check(&m, BT_OK));
    assert_non_null(strstr(bt_last_error(), "modified in place"));
    bt_map_close(&m);

    assert_int_equal(bt_map_open(&m, p), BT_OK);
    write_pattern(q, 777);
    assert_int_equal(rename(q, p), 0);
    assert_int_equal(bt_map_check(&m, BT_OK), BT_OK);
    assert_int_equal(m.size, 10000);
    bt_map_close(&m);
    bt_map_close(&m); /* twice: fine */
    bt_map zero;
    memset(&zero, 0, sizeof zero); /* an all-zero map owns nothing (fd 0 is not closed) */
    bt_map_close(&zero);
    assert_int_not_equal(fcntl(0, F_GETFD), -1);
}

/* Many mappings cut at once, each read by its own thread: all survive, each reports. */
typedef struct {
    bt_map m;
    uint64_t sum;
} reader_arg;

static void *reader(void *arg) {
    reader_arg *r = arg;
    for (size_t i = 0; i < r->m.size; i += 512) r->sum += r->m.data[i];
    return NULL;
}

static void test_threads(void **st) {
    (void)st;
    enum { N = 8 };
    reader_arg a[N];
    pthread_t th[N];
    char p[128];
    for (int i = 0; i < N; i++) {
        snprintf(p, sizeof p, "%s/t%d.bin", g_dir, i);
        write_pattern(p, 64 * 4096);
        a[i].sum = 0;
        assert_int_equal(bt_map_open(&a[i].m, p), BT_OK);
        assert_int_equal(truncate(p, (off_t)(i * 4096)), 0);
    }
    for (int i = 0; i < N; i++) assert_int_equal(pthread_create(&th[i], NULL, reader, &a[i]), 0);
    for (int i = 0; i < N; i++) {
        pthread_join(th[i], NULL);
        assert_changed(bt_map_check(&a[i].m, BT_OK));
        bt_map_close(&a[i].m);
    }
}

/* A SIGBUS on a mapping that is not a bt_map is not swallowed by the guard: the process dies
 * of it as before (SIG_DFL; under ASan, ASan's report) instead of reading on. */
static void test_foreign_sigbus_still_kills(void **st) {
    (void)st;
    char p[128];
    path_of(p, sizeof p, "foreign.bin");
    write_pattern(p, 3 * 4096);
    bt_map m; /* the guard is installed in this process (and inherited by the child) */
    assert_int_equal(bt_map_open(&m, p), BT_OK);
    bt_map_close(&m);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        /* the disposition of a process without a test framework, then the guard in front of it */
        signal(SIGBUS, SIG_DFL);
        bt_map ours;
        if (bt_map_open(&ours, p) != BT_OK) _exit(3);
        int fd = open(p, O_RDONLY);
        const volatile uint8_t *d = mmap(NULL, 3 * 4096, PROT_READ, MAP_SHARED, fd, 0);
        if (d == MAP_FAILED || truncate(p, 0) != 0) _exit(3);
        uint8_t x = d[2 * 4096];
        _exit(x == 0 ? 4 : 5); /* reached only if the fault was swallowed */
    }
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    if (WIFEXITED(status) && WEXITSTATUS(status) >= 3 && WEXITSTATUS(status) <= 5)
        fail_msg("the child read on after a SIGBUS outside every bt_map (exit %d)", WEXITSTATUS(status));
    assert_true(WIFSIGNALED(status) || WEXITSTATUS(status) != 0);
}

static volatile sig_atomic_t g_prev_handler_ran;
static sigjmp_buf g_jmp;
static void prev_handler(int sig) {
    (void)sig;
    g_prev_handler_ran = 1;
    siglongjmp(g_jmp, 1);
}

/* In a child that installs its own SIGBUS handler before the first bt_map_open of the process
 * (this test runs first, so the guard is not installed yet): a fault outside every bt_map
 * reaches that handler through the guard. */
static void test_chains_to_previous_handler(void **st) {
    (void)st;
    char p[128], q[128];
    path_of(p, sizeof p, "chain.bin");
    path_of(q, sizeof q, "chain-ours.bin");
    write_pattern(p, 3 * 4096);
    write_pattern(q, 4096);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = prev_handler;
        sigaction(SIGBUS, &sa, NULL);
        int fd = open(p, O_RDONLY);
        const volatile uint8_t *d = mmap(NULL, 3 * 4096, PROT_READ, MAP_SHARED, fd, 0);
        if (d == MAP_FAILED) _exit(3);
        bt_map m;
        if (bt_map_open(&m, q) != BT_OK) _exit(3); /* the guard goes in front of prev_handler */
        if (truncate(p, 0) != 0) _exit(3);
        if (sigsetjmp(g_jmp, 1) == 0) {
            uint8_t x = d[4096];
            (void)x;
            _exit(4); /* the read must fault */
        }
        bt_map_close(&m);
        _exit(g_prev_handler_ran ? 0 : 5);
    }
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
}

/* bt_read_file: whole files, limits, non-regular files. */
static void test_read_file(void **st) {
    (void)st;
    char p[128], *buf = NULL;
    size_t n = 0;
    path_of(p, sizeof p, "r.txt");
    tu_write_file(NULL, p, "hello", 5);
    assert_int_equal(bt_read_file(p, 1 << 20, &buf, &n), BT_OK);
    assert_int_equal(n, 5);
    assert_string_equal(buf, "hello");
    free(buf);
    assert_int_equal(bt_read_file(p, 4, &buf, &n), BT_ERR_RANGE);
    assert_null(buf);
    /* no unbounded whole-file read (issue 21 §11): a limit of 0 is the caller's error */
    assert_int_equal(bt_read_file(p, 0, &buf, &n), BT_ERR_INVALID);
    assert_null(buf);
    /* a 3 GiB sparse file: refused by its size before anything is allocated or read */
    path_of(p, sizeof p, "sparse.bin");
    int sfd = open(p, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    assert_true(sfd >= 0);
    assert_int_equal(ftruncate(sfd, (off_t)3 << 30), 0);
    close(sfd);
    assert_int_equal(bt_read_file(p, 64u << 20, &buf, &n), BT_ERR_RANGE);
    assert_non_null(strstr(bt_last_error(), "3221225472 bytes, larger than the 67108864-byte limit"));
    assert_null(buf);
    unlink(p);
    assert_int_equal(bt_read_file(g_dir, 1 << 20, &buf, &n), BT_ERR_IO);
    assert_non_null(strstr(bt_last_error(), "not a regular file"));
    path_of(p, sizeof p, "missing");
    assert_int_equal(bt_read_file(p, 1 << 20, &buf, &n), BT_ERR_IO);
    /* a FIFO where a file was expected: refused at once, not a reader hung in open(2) */
    path_of(p, sizeof p, "fifo");
    assert_int_equal(mkfifo(p, 0600), 0);
    assert_int_equal(bt_read_file(p, 1 << 20, &buf, &n), BT_ERR_IO);
    assert_non_null(strstr(bt_last_error(), "not a regular file"));
    bt_map m;
    assert_int_equal(bt_map_open(&m, p), BT_ERR_IO);
}

/* bt_open_ro with symlinks refused (loaderd): a link anywhere in the path is refused. */
static void test_open_refusing_links(void **st) {
    (void)st;
    char p[128], l[128], d[128], ld[128];
    path_of(p, sizeof p, "real.txt");
    path_of(l, sizeof l, "link.txt");
    path_of(d, sizeof d, "realdir");
    path_of(ld, sizeof ld, "linkdir");
    tu_write_file(NULL, p, "x", 1);
    assert_int_equal(symlink(p, l), 0);
    assert_int_equal(mkdir(d, 0755), 0);
    assert_int_equal(symlink(d, ld), 0);
    char inner[160], via[160];
    snprintf(inner, sizeof inner, "%s/f", d);
    snprintf(via, sizeof via, "%s/f", ld);
    tu_write_file(NULL, inner, "y", 1);
    int fd;
    assert_true((fd = bt_open_ro(l)) >= 0);
    close(fd);
    bt_open_refuse_symlinks(1);
    assert_true((fd = bt_open_ro(p)) >= 0);
    close(fd);
    assert_true((fd = bt_open_ro(inner)) >= 0);
    close(fd);
    errno = 0;
    assert_int_equal(bt_open_ro(l), -1);
    assert_int_equal(errno, ELOOP);
    assert_int_equal(bt_open_ro(via), -1);
    char *buf = NULL;
    size_t n;
    assert_int_equal(bt_read_file(via, 1 << 20, &buf, &n), BT_ERR_IO);
    bt_open_refuse_symlinks(0);
    assert_int_equal(bt_read_file(via, 1 << 20, &buf, &n), BT_OK);
    free(buf);
}

/* The one safe open (issue 21 §3, §5, §11): whatever sits where a file was expected, the open
 * returns at once (a FIFO with no writer would block a plain open(2) forever), and only a
 * regular file on a real filesystem is kept, with the reason in bt_last_error; every reader
 * built on it (bt_read_file, bt_map_open, the tokenizer loader, GGUF) says the same. */
static void test_safe_open_regular_only(void **st) {
    (void)st;
    char fifo[128], dir[128], reg[128], link[128];
    path_of(fifo, sizeof fifo, "safe-fifo");
    path_of(dir, sizeof dir, "safe-dir");
    path_of(reg, sizeof reg, "safe.txt");
    path_of(link, sizeof link, "safe-link");
    assert_int_equal(mkfifo(fifo, 0600), 0);
    assert_int_equal(mkdir(dir, 0700), 0);
    tu_write_file(NULL, reg, "abc", 3);
    assert_int_equal(symlink(reg, link), 0);
    struct stat sb;
    int fd = bt_open_file(reg, 0, &sb);
    assert_true(fd >= 0);
    assert_int_equal(sb.st_size, 3);
    close(fd);
    const struct {
        const char *path, *why;
        int err;
    } bad[] = {
        {fifo, "not a regular file (a FIFO)", ENXIO},
        {dir, "not a regular file (a directory)", EISDIR},
        {"/dev/null", "not a regular file (a character device)", ENXIO},
        {"/proc/self/status", "not a regular file (on procfs, a pseudo filesystem", ENXIO},
        {"/proc/sys/kernel/hostname", "on procfs", ENXIO},
        {"/sys/kernel/mm/transparent_hugepage/enabled", "on sysfs", ENXIO},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        if (access(bad[i].path, F_OK) != 0) continue; /* no /sys in this container */
        errno = 0;
        assert_int_equal(bt_open_file(bad[i].path, 0, NULL), -1);
        assert_int_equal(errno, bad[i].err);
        if (!strstr(bt_last_error(), bad[i].why) || strncmp(bt_last_error(), bad[i].path, strlen(bad[i].path)))
            fail_msg("%s: %s", bad[i].path, bt_last_error());
        char *buf = NULL;
        size_t n;
        assert_int_equal(bt_read_file(bad[i].path, 0, &buf, &n), BT_ERR_IO);
        assert_non_null(strstr(bt_last_error(), bad[i].why));
        bt_map m;
        assert_int_equal(bt_map_open(&m, bad[i].path), BT_ERR_IO);
        assert_non_null(strstr(bt_last_error(), bad[i].why));
    }
    /* the tokenizer loader and the GGUF reader: a FIFO is refused, not waited on */
    bt_tokenizer *t = NULL;
    assert_int_not_equal(bt_tokenizer_load(&t, fifo), BT_OK);
    assert_null(t);
    assert_non_null(strstr(bt_last_error(), "not a regular file (a FIFO)"));
    bt_gguf *g = NULL;
    assert_int_equal(bt_gguf_open(&g, fifo), BT_ERR_IO);
    /* links: followed by default, refused with BT_OPEN_NO_LINKS, followed with BT_OPEN_LINKS_OK
     * even when the process refuses them (loaderd's own --config) */
    assert_true((fd = bt_open_file(link, 0, NULL)) >= 0);
    close(fd);
    errno = 0;
    assert_int_equal(bt_open_file(link, BT_OPEN_NO_LINKS, NULL), -1);
    assert_int_equal(errno, ELOOP);
    assert_non_null(strstr(bt_last_error(), "a symbolic link on the way"));
    bt_open_refuse_symlinks(1);
    assert_int_equal(bt_open_file(link, 0, NULL), -1);
    assert_true((fd = bt_open_file(link, BT_OPEN_LINKS_OK, NULL)) >= 0);
    close(fd);
    bt_open_refuse_symlinks(0);
    /* bt_pseudo_fs names what bt_open_file refuses */
    assert_string_equal(bt_pseudo_fs("/proc/self/status"), "procfs");
    assert_null(bt_pseudo_fs(reg));
}

/* A GGUF cut after it was opened: reading its tensors does not crash, bt_gguf_check reports. */
static void test_gguf_cut(void **st) {
    (void)st;
    char p[128];
    path_of(p, sizeof p, "m.gguf");
    bt_gguf_writer *w = bt_gguf_writer_new();
    assert_int_equal(bt_gguf_w_str(w, "general.name", "cut", 3), 0);
    static float big[64 * 1024];
    for (size_t i = 0; i < sizeof big / sizeof big[0]; i++) big[i] = 1.f;
    uint64_t ne[2] = {1024, 64};
    assert_int_equal(bt_gguf_w_tensor(w, "t", 0, 2, ne, big, sizeof big), 0);
    assert_int_equal(bt_gguf_writer_write(w, p), 0);
    bt_gguf_writer_free(w);
    bt_gguf *g = NULL;
    assert_int_equal(bt_gguf_open(&g, p), BT_OK);
    assert_int_equal(bt_gguf_check(g, 0), 0);
    const bt_gguf_tensor *t = bt_gguf_find_tensor(g, "t");
    assert_non_null(t);
    assert_int_equal(truncate(p, 8192), 0);
    double sum = 0;
    const float *f = t->data;
    for (size_t i = 0; i < 64 * 1024; i++) sum += f[i];
    assert_true(sum < 64 * 1024); /* zeros past the cut */
    assert_changed(bt_gguf_check(g, 0));
    assert_non_null(strstr(bt_last_error(), "gguf: "));
    bt_gguf_close(g);
    /* cut to nothing: refused at open (a parse of zeros is not the error reported) */
    assert_int_equal(truncate(p, 0), 0);
    assert_int_not_equal(bt_gguf_open(&g, p), BT_OK);
    assert_null(g);
}

/* A safetensors file cut after it was opened: bt_st_check reports. */
static void test_safetensors_cut(void **st) {
    (void)st;
    char p[128];
    path_of(p, sizeof p, "w.safetensors");
    bt_st_writer *w = bt_st_writer_new();
    static float v[32 * 1024];
    int64_t shape[1] = {32 * 1024};
    assert_int_equal(bt_st_w_tensor(w, "w", BT_ST_F32, 1, shape, v, sizeof v), 0);
    assert_int_equal(bt_st_writer_write(w, p), 0);
    bt_st_writer_free(w);
    bt_st_file *f = NULL;
    assert_int_equal(bt_st_open(&f, p), BT_OK);
    const bt_st_tensor *t = bt_st_find(f, "w");
    assert_int_equal(truncate(p, 100), 0);
    volatile float x = ((const float *)t->data)[32 * 1024 - 1];
    (void)x;
    assert_changed(bt_st_check(f, BT_OK));
    assert_non_null(strstr(bt_last_error(), "safetensors: "));
    bt_st_close(f);
}

/* The pause hook, serviced by a thread as the process-level tests do: the file is truncated
 * between mapping and reading, and the tokenizer load fails with the change, not a crash. */
typedef struct {
    char dir[128];
    char file[160];
    off_t cut_to;
    int pauses;
} pauser;

static void *service(void *arg) {
    pauser *ps = arg;
    char fifo[200], line[512];
    snprintf(fifo, sizeof fifo, "%s/mapped", ps->dir);
    int fd = open(fifo, O_RDONLY);
    ssize_t n = fd >= 0 ? read(fd, line, sizeof line - 1) : -1;
    if (fd >= 0) close(fd);
    if (n > 0) {
        ps->pauses++;
        if (truncate(ps->file, ps->cut_to) != 0) ps->pauses = -100;
    }
    snprintf(fifo, sizeof fifo, "%s/resume", ps->dir);
    fd = open(fifo, O_WRONLY);
    if (fd >= 0) {
        if (write(fd, "g", 1) != 1) ps->pauses = -100;
        close(fd);
    }
    return NULL;
}

static void test_tokenizer_cut_while_loading(void **st) {
    (void)st;
    pauser ps = {.cut_to = 1 << 20, .pauses = 0};
    snprintf(ps.dir, sizeof ps.dir, "%s/hook", g_dir);
    snprintf(ps.file, sizeof ps.file, "%s/tok.gguf", g_dir);
    assert_int_equal(mkdir(ps.dir, 0755), 0);
    char f1[200], f2[200];
    snprintf(f1, sizeof f1, "%s/mapped", ps.dir);
    snprintf(f2, sizeof f2, "%s/resume", ps.dir);
    assert_int_equal(mkfifo(f1, 0600), 0);
    assert_int_equal(mkfifo(f2, 0600), 0);
    size_t n = 0;
    uint8_t *model = tu_slurp(tu_model_path(), &n);
    tu_write_file(NULL, ps.file, model, n);
    free(model);
    setenv("BT_TEST_MAP_PAUSE_DIR", ps.dir, 1);
    setenv("BT_TEST_MAP_PAUSE_MATCH", "/tok.gguf", 1);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, service, &ps), 0);
    bt_tokenizer *tok = NULL;
    int rc = bt_tokenizer_load(&tok, ps.file);
    pthread_join(th, NULL);
    assert_int_equal(ps.pauses, 1);
    assert_int_equal(rc, BT_ERR_IO);
    assert_null(tok);
    assert_non_null(strstr(bt_last_error(), "changed while being read"));
    assert_non_null(strstr(bt_last_error(), "tok.gguf"));
    /* the process is fine and a complete file loads */
    unsetenv("BT_TEST_MAP_PAUSE_MATCH");
    assert_int_equal(bt_tokenizer_load(&tok, tu_model_path()), BT_OK);
    bt_tokenizer_free(tok);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chains_to_previous_handler), /* first: before any bt_map_open */
        cmocka_unit_test(test_truncated_mapping),
        cmocka_unit_test(test_rewritten_and_replaced),
        cmocka_unit_test(test_threads),
        cmocka_unit_test(test_foreign_sigbus_still_kills),
        cmocka_unit_test(test_read_file),
        cmocka_unit_test(test_open_refusing_links),
        cmocka_unit_test(test_safe_open_regular_only),
        cmocka_unit_test(test_gguf_cut),
        cmocka_unit_test(test_safetensors_cut),
        cmocka_unit_test(test_tokenizer_cut_while_loading),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
