/* Tests for proto/client.c against a fake loaderd (a thread that answers one attach with a ring
 * memfd): the END_OF_DATA batch is checked for its job id like any batch, a report made while
 * bt_client_next is reconnecting fails at once instead of waiting out the reconnect window, a
 * reconnect that finds no loaderd gives up, and a stream loaderd failed ends with loaderd's own
 * reason, asked before the client detaches (issue 21 §9). Ordered by events (the fake holds the
 * reconnect's attach; it answers the `jobs` request the failed stream makes), never by sleeps or
 * timings. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "common/bt_common.h"
#include "proto/batch.h"
#include "proto/client.h"
#include "proto/ring.h"
#include "tests/unit/util/test_util.h"

#define JOB_ID 7u
#define FB 1u
#define FT 8u

static char g_dir[64];

typedef struct {
    char path[96];
    int lfd, cfd;
    bt_ring ring;
} fake;

static int setup_dir(void **s) {
    (void)s;
    return tu_make_tmpdir(g_dir, sizeof g_dir, "client");
}

static int teardown_dir(void **s) {
    (void)s;
    return tu_remove_dir(g_dir);
}

static void fake_listen(fake *f) {
    memset(f, 0, sizeof *f);
    f->cfd = -1;
    f->ring.fd = -1;
    snprintf(f->path, sizeof f->path, "%s/ld.sock", g_dir);
    f->lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    assert_true(f->lfd >= 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", f->path);
    assert_int_equal(bind(f->lfd, (struct sockaddr *)&sa, sizeof sa), 0);
    assert_int_equal(listen(f->lfd, 4), 0);
}

/* Take one attach: accept the connection and read its request line. 0, or -1. */
static int fake_accept(fake *f) {
    f->cfd = accept(f->lfd, NULL, NULL);
    if (f->cfd < 0) return -1;
    char c;
    while (recv(f->cfd, &c, 1, 0) == 1 && c != '\n') {}
    return 0;
}

/* Answer the attach taken by fake_accept with a new ring's fd. */
static void fake_reply(fake *f) {
    if (bt_ring_create(&f->ring, 4, FB, FT)) return;
    char rep[256];
    int n = snprintf(rep, sizeof rep,
                     "{\"v\":%d,\"ok\":true,\"op\":\"attach\",\"job_id\":%u,\"B\":%u,\"T\":%u,\"slots\":4,"
                     "\"vocab\":100}\n",
                     BT_PROTO_VERSION, JOB_ID, FB, FT);
    union {
        struct cmsghdr h;
        char b[CMSG_SPACE(sizeof(int))];
    } u;
    memset(&u, 0, sizeof u);
    struct iovec iov = {.iov_base = rep, .iov_len = (size_t)n};
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.b, .msg_controllen = sizeof u.b};
    struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cm), &f->ring.fd, sizeof(int));
    (void)sendmsg(f->cfd, &m, MSG_NOSIGNAL);
}

/* Serve one attach: read the request line, reply with the ring fd. */
static void *fake_serve(void *arg) {
    fake *f = arg;
    if (fake_accept(f) == 0) fake_reply(f);
    return NULL;
}

static bt_client *fake_attach(fake *f) {
    fake_listen(f);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, fake_serve, f), 0);
    bt_client *c = NULL;
    int rc = bt_client_attach(&c, f->path, "{\"name\":\"t\"}", 0, 1, NULL);
    pthread_join(th, NULL);
    assert_int_equal(rc, BT_OK);
    assert_int_equal(bt_client_job_id(c), JOB_ID);
    return c;
}

static void fake_close(fake *f) {
    if (f->cfd >= 0) close(f->cfd);
    if (f->lfd >= 0) close(f->lfd);
    f->cfd = f->lfd = -1;
    unlink(f->path);
    if (f->ring.hdr) bt_ring_close(&f->ring);
}

static void put_end_of_data(fake *f, uint32_t job_id, uint64_t step) {
    void *slot = bt_ring_producer_acquire(&f->ring, 1000);
    assert_non_null(slot);
    memset(slot, 0, f->ring.slot_bytes);
    bt_batch_view v;
    bt_batch_view_init(&v, slot, FB, FT);
    v.hdr->magic = BT_BATCH_MAGIC;
    v.hdr->layout_version = BT_BATCH_LAYOUT_VERSION;
    v.hdr->job_id = job_id;
    v.hdr->step = step;
    v.hdr->B = FB;
    v.hdr->T = FT;
    v.hdr->flags = BT_BATCH_F_END_OF_DATA;
    bt_ring_producer_commit(&f->ring);
}

static void test_end_of_data_checks_job_id(void **s) {
    (void)s;
    fake f;
    bt_client *c = fake_attach(&f);
    put_end_of_data(&f, JOB_ID + 1, 0);
    bt_batch_view v;
    assert_int_equal(bt_client_next(c, &v, 1000), BT_ERR_FORMAT);
    assert_non_null(strstr(bt_last_error(), "job id"));
    bt_client_close(c);
    fake_close(&f);

    c = fake_attach(&f); /* the right job id ends the stream */
    put_end_of_data(&f, JOB_ID, 0);
    assert_int_equal(bt_client_next(c, &v, 1000), 1);
    assert_int_equal(bt_client_next(c, &v, 1000), 1);
    bt_client_close(c);
    fake_close(&f);
}

typedef struct {
    bt_client *c;
    int rc;
    char err[512]; /* bt_last_error is per thread */
} next_arg;

static void *next_main(void *arg) {
    next_arg *a = arg;
    bt_batch_view v;
    a->rc = bt_client_next(a->c, &v, -1);
    snprintf(a->err, sizeof a->err, "%s", bt_last_error());
    return NULL;
}

static void *report_main(void *arg) {
    next_arg *a = arg;
    a->rc = bt_client_report(a->c, 1, 2.0, 3.0);
    snprintf(a->err, sizeof a->err, "%s", bt_last_error());
    return NULL;
}

/* A report made while bt_client_next reconnects fails at once: ordered by events, not timed.
 * loaderd drops the job; the client's reconnect connects and sends its attach, which the fake
 * holds unanswered (the reconnect window is 600 s: it cannot end by itself meanwhile). The report
 * must come back BT_ERR_CLOSED while that attach is still pending; a report that waited for the
 * reconnect would wait for the answer the fake only gives after it (the 60 s join limit only
 * turns that deadlock into a failure). Then the answer lets the stream go on. */
static void test_report_fails_fast_while_reconnecting(void **s) {
    (void)s;
    setenv("LOADERD_RECONNECT_S", "600", 1);
    fake f;
    bt_client *c = fake_attach(&f);
    unsetenv("LOADERD_RECONNECT_S");
    next_arg a = {.c = c, .rc = 0, .err = ""}, r = {.c = c, .rc = 0, .err = ""};
    pthread_t th, rth;
    assert_int_equal(pthread_create(&th, NULL, next_main, &a), 0);
    bt_ring_producer_close(&f.ring);
    bt_ring_close(&f.ring);
    close(f.cfd);
    assert_int_equal(fake_accept(&f), 0); /* the reconnect's attach: the client is reconnecting */
    assert_int_equal(pthread_create(&rth, NULL, report_main, &r), 0);
    struct timespec lim;
    clock_gettime(CLOCK_REALTIME, &lim);
    lim.tv_sec += 60;
    if (pthread_timedjoin_np(rth, NULL, &lim) != 0) fail_msg("bt_client_report waited for the reconnect");
    assert_int_equal(r.rc, BT_ERR_CLOSED);
    assert_non_null(strstr(r.err, "reconnecting"));
    fake_reply(&f); /* loaderd is back: the stream goes on, to its end */
    put_end_of_data(&f, JOB_ID, 0);
    pthread_join(th, NULL);
    assert_int_equal(a.rc, 1);
    assert_int_equal(bt_client_reconnects(c), 1);
    bt_client_close(c);
    fake_close(&f);
}

/* loaderd goes away and does not come back: bt_client_next gives up after the reconnect window
 * and says so. */
static void test_reconnect_gives_up(void **s) {
    (void)s;
    setenv("LOADERD_RECONNECT_S", "1", 1);
    fake f;
    bt_client *c = fake_attach(&f);
    unsetenv("LOADERD_RECONNECT_S");
    bt_ring_producer_close(&f.ring);
    fake_close(&f);
    bt_batch_view v;
    assert_true(bt_client_next(c, &v, -1) < 0);
    assert_non_null(strstr(bt_last_error(), "did not come back"));
    assert_int_equal(bt_client_report(c, 1, 2.0, 3.0) < 0, 1); /* no connection any more: refused, not hung */
    bt_client_close(c);
}

/* Answer one `jobs` request on a new connection: job JOB_ID failed with `why`. */
typedef struct {
    fake *f;
    const char *why;
    char request[256];
} jobs_arg;

static void *jobs_serve(void *arg) {
    jobs_arg *a = arg;
    int fd = accept(a->f->lfd, NULL, NULL);
    if (fd < 0) return NULL;
    size_t n = 0;
    char c;
    while (n + 1 < sizeof a->request && recv(fd, &c, 1, 0) == 1 && c != '\n') a->request[n++] = c;
    a->request[n] = 0;
    char rep[512];
    int k = snprintf(rep, sizeof rep,
                     "{\"v\":%d,\"ok\":true,\"op\":\"jobs\",\"jobs\":[{\"job_id\":3,\"state\":\"running\"},"
                     "{\"job_id\":%u,\"name\":\"t\",\"state\":\"failed\",\"error\":\"%s\"}]}\n",
                     BT_PROTO_VERSION, JOB_ID, a->why);
    (void)send(fd, rep, (size_t)k, MSG_NOSIGNAL);
    close(fd);
    return NULL;
}

/* loaderd fails the job (closes the ring, keeps the connection): the client's error carries the
 * job's error from loaderd's `jobs` list, which it asks while still attached (after a detach the
 * job is gone from the list and the reason would be lost). Bound by events: bt_client_next waits
 * for the close with no timeout, and the `jobs` request is read back once it returned (a client
 * that never asked cannot hang the test: the fake stops listening then, so its accept ends). */
static void test_failed_job_reason(void **s) {
    (void)s;
    fake f;
    bt_client *c = fake_attach(&f);
    jobs_arg a = {&f, "every record is empty at seq_len 16 (4 records read)", ""};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, jobs_serve, &a), 0);
    bt_ring_producer_close(&f.ring);
    bt_batch_view v;
    assert_int_equal(bt_client_next(c, &v, -1), BT_ERR_CLOSED);
    shutdown(f.lfd, SHUT_RDWR); /* the request, if any, was answered: bt_client_next read the reply */
    pthread_join(th, NULL);
    assert_non_null(strstr(a.request, "\"op\":\"jobs\""));
    assert_non_null(strstr(bt_last_error(), "loaderd closed the stream of job 7 before its end: job failed: every "
                                            "record is empty at seq_len 16 (4 records read)"));
    bt_client_close(c);
    fake_close(&f);
}

/* The fake's side of ref_put: read n_req request lines on the attach connection, keep the count
 * of "values" of each, answer with replies[i] ("%zu" in it: that count, or a literal reply). */
typedef struct {
    fake *f;
    int n_req;
    const char *replies[4];
    size_t counts[4];
    char base[4][32];
} put_arg;

static void *put_serve(void *arg) {
    put_arg *a = arg;
    for (int i = 0; i < a->n_req; i++) {
        size_t cap = 1 << 20, n = 0;
        char *line = malloc(cap);
        char ch;
        while (n + 1 < cap && recv(a->f->cfd, &ch, 1, 0) == 1 && ch != '\n') line[n++] = ch;
        line[n] = 0;
        json_t *j = json_loads(line, 0, NULL);
        free(line);
        const char *op = json_string_value(json_object_get(j, "op")), *b = json_string_value(json_object_get(j, "base"));
        a->counts[i] = op && !strcmp(op, "ref_put") ? json_array_size(json_object_get(j, "values")) : 0;
        snprintf(a->base[i], sizeof a->base[i], "%s", b ? b : "");
        json_decref(j);
        char rep[512];
        int k = strstr(a->replies[i], "%zu") ? snprintf(rep, sizeof rep, a->replies[i], a->counts[i])
                                              : snprintf(rep, sizeof rep, "%s", a->replies[i]);
        (void)send(a->f->cfd, rep, (size_t)k, MSG_NOSIGNAL);
    }
    return NULL;
}

/* bt_client_ref_put: requests of at most BT_REF_PUT_MAX values, the counts summed over the
 * replies, a refused value is not an error (its reason in bt_last_error), a refused request is
 * BT_ERR_INVALID with loaderd's reason, a reply that does not account for the values sent is
 * BT_ERR_FORMAT. */
static void test_ref_put(void **s) {
    (void)s;
    fake f;
    bt_client *c = fake_attach(&f);
    size_t n = BT_REF_PUT_MAX + 5, acc = 99, rej = 99;
    bt_ref_value *v = calloc(n, sizeof *v);
    for (size_t i = 0; i < n; i++) v[i] = (bt_ref_value){0, (int32_t)i + 1, (int32_t)(i & 1), -1.0 - (double)i};
    assert_int_equal(bt_client_ref_put(c, "b", v, 0, &acc, &rej), BT_OK); /* nothing to send: no request */
    assert_true(acc == 0 && rej == 0);
    put_arg a = {.f = &f, .n_req = 2, .replies = {"{\"v\":1,\"ok\":true,\"op\":\"ref_put\",\"accepted\":%zu,\"rejected\":0,\"errors\":[]}\n",
                         "{\"v\":1,\"ok\":true,\"op\":\"ref_put\",\"accepted\":4,\"rejected\":1,\"errors\":"
                         "[\"values[3]: line 4 side 1 already has -2 (conflict: first value kept)\"]}\n"}};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, put_serve, &a), 0);
    assert_int_equal(bt_client_ref_put(c, "sha256-x", v, n, &acc, &rej), BT_OK);
    pthread_join(th, NULL);
    assert_true(a.counts[0] == BT_REF_PUT_MAX && a.counts[1] == 5);
    assert_string_equal(a.base[0], "sha256-x");
    assert_true(acc == BT_REF_PUT_MAX + 4 && rej == 1);
    assert_non_null(strstr(bt_last_error(), "refused 1 of 5 values, first: values[3]: line 4 side 1 already has"));
    /* a refused request: loaderd's reason */
    put_arg b = {.f = &f, .n_req = 1, .replies = {"{\"v\":1,\"ok\":false,\"op\":\"ref_put\",\"error\":\"\\\"base\\\" \\\"x\\\" does not match "
                         "job 7's ref_base\"}\n"}};
    assert_int_equal(pthread_create(&th, NULL, put_serve, &b), 0);
    assert_int_equal(bt_client_ref_put(c, "x", v, 3, &acc, &rej), BT_ERR_INVALID);
    pthread_join(th, NULL);
    assert_non_null(strstr(bt_last_error(), "does not match job 7's ref_base"));
    /* a reply that loses values */
    put_arg d = {.f = &f, .n_req = 1, .replies = {"{\"v\":1,\"ok\":true,\"op\":\"ref_put\",\"accepted\":1,\"rejected\":0}\n"}};
    assert_int_equal(pthread_create(&th, NULL, put_serve, &d), 0);
    assert_int_equal(bt_client_ref_put(c, "x", v, 3, &acc, &rej), BT_ERR_FORMAT);
    pthread_join(th, NULL);
    free(v);
    bt_client_close(c);
    fake_close(&f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_end_of_data_checks_job_id, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_report_fails_fast_while_reconnecting, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_reconnect_gives_up, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_failed_job_reason, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_ref_put, setup_dir, teardown_dir),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
