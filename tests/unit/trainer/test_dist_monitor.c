/* Tests for trainer/parallel/dist_monitor.c, the data-parallel watchdog: real processes (this one is rank
 * 0, fork()ed children the other ranks) meet at the authenticated rendezvous (trainer/parallel/dist.h) and
 * watch each other. A rank that is killed, or stopped with SIGSTOP, is named on every other rank
 * (directly on rank 0, by rank 0's relay on the others); a stop request and an error message
 * reach every rank; a clean finish reports nothing; a rank that never reaches a collective that
 * another rank waits in is named. Every wait is for an event, with a generous deadline. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "trainer/parallel/dist.h"
#include "trainer/parallel/dist_monitor.h"

#define WAIT_S 60.0 /* the longest any event may take on a loaded machine */

static int free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    socklen_t sl = sizeof a;
    assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &sl), 0);
    close(fd);
    return ntohs(a.sin_port);
}

/* Rendezvous as `rank` of `world`, then start a monitor. NULL on failure (message printed). */
static bt_dist_monitor *join(int port, int rank, int world, double hb_s, double coll_s, const atomic_int *stop) {
    uint8_t d[32], key[32], blob[16] = {0};
    memset(key, 0x42, sizeof key);
    bt_dist_digest("job", 3, d);
    bt_dist_link *link = NULL;
    if (bt_dist_rendezvous("127.0.0.1", port, rank, world, d, key, blob, sizeof blob, 20, &link)) {
        fprintf(stderr, "rank %d: %s\n", rank, bt_last_error());
        return NULL;
    }
    bt_dist_monitor *m = NULL;
    bt_dist_monitor_opts o = {hb_s, coll_s, stop};
    if (bt_dist_monitor_start(&m, link, &o)) {
        fprintf(stderr, "rank %d: %s\n", rank, bt_last_error());
        return NULL;
    }
    return m;
}

/* Until check() reports something (or WAIT_S): its code; bt_last_error holds the message. */
static int wait_report(bt_dist_monitor *m) {
    for (double end = bt_now() + WAIT_S; bt_now() < end;) {
        int rc = bt_dist_monitor_check(m);
        if (rc) return rc;
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    return 0;
}

static int child_exit(pid_t pid) {
    int st = 0;
    while (waitpid(pid, &st, 0) < 0)
        if (errno != EINTR) return -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* What a child rank does with its monitor; its result is the child's exit status (0 = ok). */
typedef int (*rank_body)(bt_dist_monitor *m, int rank, const void *arg);

/* Fork a child that joins as `rank` of `world` (heartbeat timeout hb_s; its stop flag, set by the
 * body, is relayed), runs body, frees the monitor and exits with body's result. */
static atomic_int g_child_stop;
static pid_t spawn_rank(int port, int rank, int world, double hb_s, rank_body body, const void *arg) {
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid) return pid;
    bt_dist_monitor *m = join(port, rank, world, hb_s, 0, &g_child_stop);
    if (!m) _exit(2);
    int rc = body(m, rank, arg);
    bt_dist_monitor_free(m);
    _exit(rc);
}

typedef struct {
    int rc;
    const char *w1, *w2;
} want;

/* Wait for a report with code w->rc whose message holds w->w1 and w->w2, then end as the
 * trainer does (finish: waits for rank 0 unless it is lost). */
static int watch(bt_dist_monitor *m, int rank, const void *arg) {
    const want *w = arg;
    int rc = wait_report(m);
    int ok = rc == w->rc && (!w->w1 || strstr(bt_last_error(), w->w1)) && (!w->w2 || strstr(bt_last_error(), w->w2));
    if (!ok) fprintf(stderr, "rank %d: got %d (want %d): %s\n", rank, rc, w->rc, bt_last_error());
    (void)bt_dist_monitor_finish(m);
    return ok ? 0 : 1;
}

static int idle(bt_dist_monitor *m, int rank, const void *arg) { /* until killed */
    (void)m, (void)rank, (void)arg;
    for (;;) pause();
    return 0;
}

static int stop_then_finish(bt_dist_monitor *m, int rank, const void *arg) {
    (void)rank, (void)arg;
    atomic_store(&g_child_stop, SIGTERM);
    return bt_dist_monitor_finish(m) == 0 ? 0 : 1; /* rank 0's goodbye ends the wait */
}

static int fail_with(bt_dist_monitor *m, int rank, const void *arg) {
    (void)rank;
    bt_dist_monitor_fail(m, arg);
    return 0;
}

static int finish_clean(bt_dist_monitor *m, int rank, const void *arg) {
    (void)rank, (void)arg;
    int rc = bt_dist_monitor_finish(m); /* returns once rank 0 said goodbye */
    return rc == 0 && bt_dist_monitor_check(m) == 0 ? 0 : 1;
}

static pid_t spawn_watcher(int port, int rank, int world, double hb_s, int want_rc, const char *w1, const char *w2) {
    static want w[8];
    static int n;
    w[n % 8] = (want){want_rc, w1, w2};
    return spawn_rank(port, rank, world, hb_s, watch, &w[n++ % 8]);
}

/* rank 1 killed: rank 0 names it at once ("died"), rank 2 hears it from rank 0 */
static void test_killed_rank(void **st) {
    (void)st;
    int port = free_port();
    pid_t victim = spawn_rank(port, 1, 3, 30, idle, NULL);
    pid_t w2 = spawn_watcher(port, 2, 3, 30, BT_ERR_IO, "rank 1 (pid", "died");
    bt_dist_monitor *m = join(port, 0, 3, 30, 0, NULL);
    assert_non_null(m);
    assert_int_equal(bt_dist_monitor_check(m), 0);
    kill(victim, SIGKILL);
    assert_int_equal(child_exit(victim), 128 + SIGKILL);
    assert_int_equal(wait_report(m), BT_ERR_CLOSED);
    char pid[32];
    snprintf(pid, sizeof pid, "rank 1 (pid %d on ", (int)victim);
    assert_non_null(strstr(bt_last_error(), pid));
    assert_non_null(strstr(bt_last_error(), "died"));
    assert_int_equal(child_exit(w2), 0);
    bt_dist_monitor_free(m);
}

/* rank 1 stopped (SIGSTOP): named after the heartbeat timeout on ranks 0 and 2 */
static void test_stopped_rank(void **st) {
    (void)st;
    int port = free_port();
    pid_t victim = spawn_rank(port, 1, 3, 1.0, idle, NULL);
    pid_t w2 = spawn_watcher(port, 2, 3, 1.0, BT_ERR_IO, "rank 1 (pid", "stopped responding");
    bt_dist_monitor *m = join(port, 0, 3, 1.0, 0, NULL);
    assert_non_null(m);
    kill(victim, SIGSTOP);
    assert_int_equal(wait_report(m), BT_ERR_TIMEOUT);
    assert_non_null(strstr(bt_last_error(), "rank 1 (pid"));
    assert_non_null(strstr(bt_last_error(), "stopped responding"));
    assert_int_equal(child_exit(w2), 0);
    kill(victim, SIGKILL);
    kill(victim, SIGCONT);
    child_exit(victim);
    bt_dist_monitor_free(m);
}

/* rank 0 killed: the others name rank 0 */
static void test_rank0_lost(void **st) {
    (void)st;
    int port = free_port();
    pid_t r0 = spawn_rank(port, 0, 2, 30, idle, NULL);
    bt_dist_monitor *m = join(port, 1, 2, 30, 0, NULL);
    assert_non_null(m);
    kill(r0, SIGKILL);
    child_exit(r0);
    assert_int_equal(wait_report(m), BT_ERR_CLOSED);
    assert_non_null(strstr(bt_last_error(), "rank 0 (pid"));
    assert_non_null(strstr(bt_last_error(), "died"));
    /* finish() after a loss returns the loss, at once */
    assert_int_equal(bt_dist_monitor_finish(m), BT_ERR_CLOSED);
    bt_dist_monitor_free(m);
}

/* rank 2 asked to stop (its signal flag): every rank gets BT_ERR_CANCELLED naming rank 2 */
static void test_stop_relayed(void **st) {
    (void)st;
    int port = free_port();
    pid_t w1 = spawn_watcher(port, 1, 3, 30, BT_ERR_CANCELLED, "rank 2 (pid", "SIGTERM");
    pid_t r2 = spawn_rank(port, 2, 3, 30, stop_then_finish, NULL);
    bt_dist_monitor *m = join(port, 0, 3, 30, 0, NULL);
    assert_non_null(m);
    assert_int_equal(wait_report(m), BT_ERR_CANCELLED);
    assert_non_null(strstr(bt_last_error(), "rank 2 (pid"));
    assert_non_null(strstr(bt_last_error(), "was interrupted (SIGTERM)"));
    assert_int_equal(bt_dist_monitor_finish(m), 0); /* rank 0's goodbye lets the others end */
    assert_int_equal(child_exit(w1), 0);
    assert_int_equal(child_exit(r2), 0);
    bt_dist_monitor_free(m);
}

/* rank 1 fails with a message: rank 0 and rank 2 report it with rank 1's name */
static void test_failure_message(void **st) {
    (void)st;
    int port = free_port();
    pid_t w2 = spawn_watcher(port, 2, 3, 30, BT_ERR_IO, "rank 1 (pid", "failed: cuda: out of memory");
    pid_t r1 = spawn_rank(port, 1, 3, 30, fail_with, "cuda: out of memory");
    bt_dist_monitor *m = join(port, 0, 3, 30, 0, NULL);
    assert_non_null(m);
    assert_int_equal(wait_report(m), BT_ERR_IO);
    assert_non_null(strstr(bt_last_error(), "failed: cuda: out of memory"));
    assert_int_equal(child_exit(r1), 0);
    assert_int_equal(child_exit(w2), 0);
    bt_dist_monitor_free(m);
}

/* A clean end: the others wait for rank 0's goodbye; nobody reports anything. */
static void test_clean_finish(void **st) {
    (void)st;
    int port = free_port();
    pid_t r1 = spawn_rank(port, 1, 2, 30, finish_clean, NULL);
    bt_dist_monitor *m = join(port, 0, 2, 30, 0, NULL);
    assert_non_null(m);
    assert_int_equal(bt_dist_monitor_finish(m), 0);
    assert_int_equal(child_exit(r1), 0);
    assert_int_equal(bt_dist_monitor_check(m), 0); /* rank 1 closing after its goodbye: no loss */
    bt_dist_monitor_free(m);
}

/* rank 0 waits in collective #1; rank 1 never enters it: after collective_timeout_s rank 0 names
 * rank 1 (and rank 1 hears it) */
static void test_straggler(void **st) {
    (void)st;
    int port = free_port();
    pid_t r1 = spawn_watcher(port, 1, 2, 30, BT_ERR_IO, "rank 1 (pid", "has not reached collective #1");
    fflush(NULL);
    bt_dist_monitor *m = join(port, 0, 2, 30, 1.0, NULL);
    assert_non_null(m);
    bt_dist_monitor_collective(m, 1);
    assert_int_equal(wait_report(m), BT_ERR_TIMEOUT);
    assert_non_null(strstr(bt_last_error(), "rank 1 (pid"));
    assert_non_null(strstr(bt_last_error(), "which rank 0 (pid"));
    assert_int_equal(child_exit(r1), 0);
    bt_dist_monitor_free(m);
}

int main(void) {
    signal(SIGPIPE, SIG_DFL); /* the module must not need SIGPIPE ignored */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_killed_rank),   cmocka_unit_test(test_stopped_rank),
        cmocka_unit_test(test_rank0_lost),    cmocka_unit_test(test_stop_relayed),
        cmocka_unit_test(test_failure_message), cmocka_unit_test(test_clean_finish),
        cmocka_unit_test(test_straggler),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
