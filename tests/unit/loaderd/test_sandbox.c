/* loaderd's own execve filter (loaderd/sandbox.h): after ld_sandbox_no_exec() no thread of the
 * process can execute anything, a file (execve) or a memfd (fexecve, i.e. execveat), and threads
 * started before the call are covered too (TSYNC). Each case runs in a forked child, since the
 * filter cannot be removed once installed. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "loaderd/sandbox.h"

extern char **environ;

/* exit codes of the children: 0 all refused with EPERM, 10+ which check failed */
/* /bin/false: an exec that goes through exits 1, never the 0 of "refused" */
static int exec_file(void) {
    char *argv[] = {"/bin/false", NULL};
    execve("/bin/false", argv, environ);
    return errno == EPERM ? 0 : 11;
}

static int exec_memfd(void) {
    int in = open("/bin/false", O_RDONLY | O_CLOEXEC), mfd = memfd_create("t", 0);
    if (in < 0 || mfd < 0) return 12;
    char buf[65536];
    ssize_t n;
    while ((n = read(in, buf, sizeof buf)) > 0)
        if (write(mfd, buf, (size_t)n) != n) return 13;
    close(in);
    char *argv[] = {"false", NULL};
    fexecve(mfd, argv, environ);
    return errno == EPERM ? 0 : 14;
}

static atomic_int g_go;
static void *late_exec(void *arg) {
    (void)arg;
    while (!atomic_load(&g_go)) usleep(1000);
    return (void *)(intptr_t)exec_file();
}

static int child_main(int which) {
    pthread_t t;
    if (which == 2 && pthread_create(&t, NULL, late_exec, NULL)) return 15;
    if (ld_sandbox_no_exec() != BT_OK) {
        fprintf(stderr, "ld_sandbox_no_exec: %s\n", bt_last_error());
        return 77; /* the kernel refuses seccomp filters here */
    }
    if (which == 0) return exec_file();
    if (which == 1) return exec_memfd();
    atomic_store(&g_go, 1);
    void *r;
    pthread_join(t, &r);
    return (int)(intptr_t)r;
}

static void run_child(int which) {
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) _exit(child_main(which));
    int st = 0;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFEXITED(st));
    if (WEXITSTATUS(st) == 77) skip();
    assert_int_equal(WEXITSTATUS(st), 0);
}

static void test_execve_refused(void **st) {
    (void)st;
    run_child(0);
}
static void test_memfd_exec_refused(void **st) {
    (void)st;
    run_child(1);
}
static void test_threads_started_before_are_covered(void **st) {
    (void)st;
    run_child(2);
}
/* the parent (no filter) still executes: the filter is per process */
static void test_parent_unaffected(void **st) {
    (void)st;
    run_child(0);
    pid_t pid = fork();
    if (pid == 0) {
        char *argv[] = {"/bin/true", NULL};
        execve("/bin/true", argv, environ);
        _exit(99);
    }
    int s = 0;
    waitpid(pid, &s, 0);
    assert_true(WIFEXITED(s) && WEXITSTATUS(s) == 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_execve_refused),
        cmocka_unit_test(test_memfd_exec_refused),
        cmocka_unit_test(test_threads_started_before_are_covered),
        cmocka_unit_test(test_parent_unaffected),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
