/* proto/ring.c: SPSC ring over a sealed memfd. Two threads (10k batches in order with
 * checksums), two processes (fd passed with SCM_RIGHTS after fork), timeouts (lower bounds
 * only), closed flags (the waiter is in its wait before the close: ordered by the ring's waiting
 * flags, not by sleeps), lying headers and impossible counters. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/bt_common.h"
#include "proto/batch.h"
#include "proto/ring.h"

#define RB 2
#define RT 16
#define N_BATCHES 10000

/* A batch whose contents are a function of `step`: one segment per row. */
static void make_batch(void *slot, uint64_t step) {
    bt_batch_view v;
    bt_batch_view_init(&v, slot, RB, RT);
    bt_batch_header *h = v.hdr;
    memset(h, 0, sizeof *h);
    h->magic = BT_BATCH_MAGIC;
    h->layout_version = BT_BATCH_LAYOUT_VERSION;
    h->step = step;
    h->B = RB;
    h->T = RT;
    h->job_id = 1;
    uint32_t lab = 0;
    for (int t = 0; t < RB * RT; t++) {
        v.input_ids[t] = (int32_t)((step * 31 + (uint64_t)t) % 1000);
        v.position_ids[t] = t % RT;
        v.labels[t] = t % RT == 0 ? BT_LABEL_IGNORE : v.input_ids[t];
        lab += v.labels[t] != BT_LABEL_IGNORE;
    }
    for (int r = 0; r <= RB; r++) v.cu_seqlens[r] = r * RT;
    for (int r = 0; r < RB; r++) {
        v.seg_kind[r] = BT_SEG_PLAIN, v.seg_pair[r] = -1;
        v.seg_src[r] = v.seg_line[r] = -1, v.seg_ref_ok[r] = 0, v.seg_ref_logp[r] = 0.0;
    }
    h->n_cu = RB + 1;
    h->n_real_tokens = RB * RT;
    h->n_labelled_tokens = lab;
    memcpy(h->resume_state, &step, sizeof step);
    h->checksum = bt_batch_checksum(&v);
}

/* Check a consumed batch: valid and carrying the expected step. 0 if fine. */
static int check_batch(void *slot, uint64_t want_step) {
    bt_batch_view v;
    bt_batch_view_init(&v, slot, RB, RT);
    if (bt_batch_validate(&v, RB, RT, 1000) != BT_OK) return -1;
    if (v.hdr->step != want_step) return -2;
    if (v.input_ids[5] != (int32_t)((want_step * 31 + 5) % 1000)) return -3;
    return 0;
}

static void *producer_thread(void *arg) {
    bt_ring *r = arg;
    for (uint64_t i = 0; i < N_BATCHES; i++) {
        void *slot = bt_ring_producer_acquire(r, 10000);
        if (!slot) return (void *)1;
        make_batch(slot, i);
        bt_ring_producer_commit(r);
    }
    bt_ring_producer_close(r);
    return NULL;
}

static void test_two_threads(void **state) {
    (void)state;
    bt_ring prod, cons;
    assert_int_equal(bt_ring_create(&prod, 4, RB, RT), BT_OK);
    int fd2 = dup(prod.fd);
    assert_true(fd2 >= 0);
    assert_int_equal(bt_ring_attach(&cons, fd2), BT_OK); /* a second, independent mapping */
    assert_int_equal(cons.n_slots, 4);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, producer_thread, &prod), 0);
    uint64_t got = 0;
    int bad = 0;
    for (;;) {
        void *slot = bt_ring_consumer_peek(&cons, 10000);
        if (!slot) {
            assert_int_equal(cons.err, BT_ERR_CLOSED);
            break;
        }
        if (check_batch(slot, got) != 0) bad++;
        got++;
        assert_true(bt_ring_fill(&cons) <= 4);
        bt_ring_consumer_release(&cons);
    }
    void *ret;
    pthread_join(th, &ret);
    assert_null(ret);
    assert_int_equal(bad, 0);
    assert_int_equal(got, N_BATCHES);
    assert_int_equal(bt_ring_fill(&prod), 0);
    bt_ring_close(&cons);
    bt_ring_close(&prod);
}

static int send_fd(int sock, int fd) {
    char b = 'r';
    struct iovec iov = {.iov_base = &b, .iov_len = 1};
    union {
        struct cmsghdr h;
        char buf[CMSG_SPACE(sizeof(int))];
    } u;
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof u.buf};
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
    return sendmsg(sock, &m, 0) == 1 ? 0 : -1;
}

static int recv_fd(int sock) {
    char b;
    struct iovec iov = {.iov_base = &b, .iov_len = 1};
    union {
        struct cmsghdr h;
        char buf[CMSG_SPACE(sizeof(int))];
    } u;
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof u.buf};
    if (recvmsg(sock, &m, 0) != 1) return -1;
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    if (!c || c->cmsg_type != SCM_RIGHTS) return -1;
    int fd;
    memcpy(&fd, CMSG_DATA(c), sizeof fd);
    return fd;
}

/* Child: receive the ring fd, consume until closed, exit 0 when all N_PROC batches arrived
 * in order and intact. */
#define N_PROC 2000
static void child_consumer(int sock) {
    int fd = recv_fd(sock);
    bt_ring r;
    if (fd < 0 || bt_ring_attach(&r, fd) != BT_OK) _exit(10);
    uint64_t got = 0;
    for (;;) {
        void *slot = bt_ring_consumer_peek(&r, 20000);
        if (!slot) break;
        if (check_batch(slot, got) != 0) _exit(11);
        got++;
        bt_ring_consumer_release(&r);
    }
    if (r.err != BT_ERR_CLOSED) _exit(12);
    bt_ring_close(&r);
    _exit(got == N_PROC ? 0 : 13);
}

static void test_two_processes(void **state) {
    (void)state;
    int sv[2];
    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        close(sv[0]);
        child_consumer(sv[1]);
    }
    close(sv[1]);
    bt_ring r;
    assert_int_equal(bt_ring_create(&r, 3, RB, RT), BT_OK); /* created after fork: only the fd links us */
    assert_int_equal(send_fd(sv[0], r.fd), 0);
    for (uint64_t i = 0; i < N_PROC; i++) {
        void *slot = bt_ring_producer_acquire(&r, 20000);
        assert_non_null(slot);
        make_batch(slot, i);
        bt_ring_producer_commit(&r);
    }
    bt_ring_producer_close(&r);
    int st = 0;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
    bt_ring_close(&r);
    close(sv[0]);
}

static void test_timeouts(void **state) {
    (void)state;
    bt_ring r;
    assert_int_equal(bt_ring_create(&r, 2, RB, RT), BT_OK);
    /* a timed wait lasts at least its timeout (a lower bound only: a loaded machine makes it
     * longer, never shorter) */
    double t0 = bt_now();
    assert_null(bt_ring_consumer_peek(&r, 60));
    double dt = bt_now() - t0;
    assert_int_equal(r.err, BT_ERR_TIMEOUT);
    assert_true(dt >= 0.05);
    assert_null(bt_ring_consumer_peek(&r, 0)); /* poll */
    assert_int_equal(r.err, BT_ERR_TIMEOUT);
    /* fill both slots, then the producer must time out */
    for (int i = 0; i < 2; i++) {
        void *s = bt_ring_producer_acquire(&r, 0);
        assert_non_null(s);
        make_batch(s, (uint64_t)i);
        bt_ring_producer_commit(&r);
    }
    assert_int_equal(bt_ring_fill(&r), 2);
    t0 = bt_now();
    assert_null(bt_ring_producer_acquire(&r, 60));
    assert_int_equal(r.err, BT_ERR_TIMEOUT);
    assert_true(bt_now() - t0 >= 0.05);
    assert_null(bt_ring_producer_acquire(&r, 0));
    assert_int_equal(r.err, BT_ERR_TIMEOUT);
    bt_ring_close(&r);
}

typedef struct {
    bt_ring *r;
    int consumer; /* 1: block in peek, 0: block in acquire */
    int err;
    int got_null;
} blocker;

static void *block_thread(void *arg) {
    blocker *b = arg;
    void *p = b->consumer ? bt_ring_consumer_peek(b->r, -1) : bt_ring_producer_acquire(b->r, -1);
    b->got_null = p == NULL;
    b->err = b->r->err;
    return NULL;
}

/* Until another thread raised a ring's waiting flag (set just before it sleeps on the futex; the
 * ring's protocol wakes it from then on): the event the closes below must meet, not a sleep. */
static void wait_flag(_Atomic uint32_t *flag) {
    while (!atomic_load(flag)) sched_yield();
}

static void test_closed_flags(void **state) {
    (void)state;
    bt_ring prod, cons;
    assert_int_equal(bt_ring_create(&prod, 2, RB, RT), BT_OK);
    assert_int_equal(bt_ring_attach(&cons, dup(prod.fd)), BT_OK);
    /* producer closes with one batch queued: the consumer still gets it, then CLOSED */
    void *s = bt_ring_producer_acquire(&prod, 0);
    make_batch(s, 0);
    bt_ring_producer_commit(&prod);
    bt_ring_producer_close(&prod);
    assert_true(bt_ring_producer_closed(&cons));
    s = bt_ring_consumer_peek(&cons, 100);
    assert_non_null(s);
    assert_int_equal(check_batch(s, 0), 0);
    bt_ring_consumer_release(&cons);
    assert_null(bt_ring_consumer_peek(&cons, 100));
    assert_int_equal(cons.err, BT_ERR_CLOSED);
    bt_ring_close(&cons);
    bt_ring_close(&prod);

    /* a consumer blocked forever is woken by the producer's close */
    assert_int_equal(bt_ring_create(&prod, 2, RB, RT), BT_OK);
    assert_int_equal(bt_ring_attach(&cons, dup(prod.fd)), BT_OK);
    blocker b = {.r = &cons, .consumer = 1};
    pthread_t th;
    pthread_create(&th, NULL, block_thread, &b);
    wait_flag(&cons.hdr->consumer_waiting); /* it is in its wait: the close must wake it */
    bt_ring_producer_close(&prod);
    pthread_join(th, NULL);
    assert_true(b.got_null);
    assert_int_equal(b.err, BT_ERR_CLOSED);

    /* a producer blocked on a full ring is woken by the consumer's close */
    for (int i = 0; i < 2; i++) {
        s = bt_ring_producer_acquire(&prod, 0);
        assert_non_null(s);
        bt_ring_producer_commit(&prod);
    }
    blocker p = {.r = &prod, .consumer = 0};
    pthread_create(&th, NULL, block_thread, &p);
    wait_flag(&prod.hdr->producer_waiting);
    bt_ring_consumer_close(&cons);
    pthread_join(th, NULL);
    assert_true(p.got_null);
    assert_int_equal(p.err, BT_ERR_CLOSED);
    assert_true(bt_ring_consumer_closed(&prod));
    assert_null(bt_ring_producer_acquire(&prod, 0));
    assert_int_equal(prod.err, BT_ERR_CLOSED);
    bt_ring_close(&cons);
    bt_ring_close(&prod);
}

/* A sealed memfd of `size` bytes whose first bytes are `hdr` (a copy of a real header). */
static int fake_ring_fd(const bt_ring_header *hdr, size_t size, int seal) {
    int fd = memfd_create("fake-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, (off_t)size), 0);
    size_t n = size < sizeof *hdr ? size : sizeof *hdr;
    assert_int_equal(pwrite(fd, hdr, n, 0), (ssize_t)n);
    if (seal) assert_int_equal(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
    return fd;
}

static void test_lying_header(void **state) {
    (void)state;
    bt_ring real;
    assert_int_equal(bt_ring_create(&real, 4, RB, RT), BT_OK);
    bt_ring_header h;
    memcpy(&h, real.hdr, sizeof h);
    size_t total = real.map_bytes;
    bt_ring r;
    /* fd smaller than the header says */
    assert_int_equal(bt_ring_attach(&r, fake_ring_fd(&h, total - real.slot_bytes, 1)), BT_ERR_FORMAT);
    assert_non_null(strstr(bt_last_error(), "lying header"));
    /* fd smaller than the header itself */
    assert_int_equal(bt_ring_attach(&r, fake_ring_fd(&h, 100, 1)), BT_ERR_FORMAT);
    /* header claims more slots than the fd holds */
    bt_ring_header h2 = h;
    h2.n_slots = 1000;
    assert_int_equal(bt_ring_attach(&r, fake_ring_fd(&h2, total, 1)), BT_ERR_FORMAT);
    /* slot size inconsistent with B x T */
    h2 = h;
    h2.slot_bytes = 64;
    assert_int_equal(bt_ring_attach(&r, fake_ring_fd(&h2, total, 1)), BT_ERR_FORMAT);
    /* absurd geometry */
    h2 = h;
    h2.B = 0xffffffffu;
    assert_int_equal(bt_ring_attach(&r, fake_ring_fd(&h2, total, 1)), BT_ERR_FORMAT);
    h2 = h;
    h2.magic = 0;
    assert_int_equal(bt_ring_attach(&r, fake_ring_fd(&h2, total, 1)), BT_ERR_FORMAT);
    /* correct header but the fd is not sealed against shrinking */
    assert_int_equal(bt_ring_attach(&r, fake_ring_fd(&h, total, 0)), BT_ERR_FORMAT);
    assert_non_null(strstr(bt_last_error(), "sealed"));
    /* not a memfd at all */
    int pfd[2];
    assert_int_equal(pipe(pfd), 0);
    close(pfd[1]);
    assert_true(bt_ring_attach(&r, pfd[0]) < 0);
    assert_int_equal(bt_ring_attach(&r, -1), BT_ERR_INVALID);
    /* the real one is accepted and is sealed: it can be neither shrunk nor grown */
    assert_true(ftruncate(real.fd, 4096) != 0);
    assert_true(ftruncate(real.fd, (off_t)total * 2) != 0);
    assert_int_equal(bt_ring_attach(&r, dup(real.fd)), BT_OK);
    bt_ring_close(&r);
    bt_ring_close(&real);
    /* creation refuses bad geometry */
    assert_int_equal(bt_ring_create(&r, 0, RB, RT), BT_ERR_INVALID);
    assert_int_equal(bt_ring_create(&r, 4, 0, RT), BT_ERR_INVALID);
    assert_int_equal(bt_ring_create(&r, 100000, RB, RT), BT_ERR_INVALID);
}

static void test_impossible_counters(void **state) {
    (void)state;
    bt_ring prod, cons;
    assert_int_equal(bt_ring_create(&prod, 2, RB, RT), BT_OK);
    assert_int_equal(bt_ring_attach(&cons, dup(prod.fd)), BT_OK);
    /* a hostile consumer moves tail past head: the producer refuses instead of overwriting */
    atomic_store(&cons.hdr->tail, 5);
    assert_null(bt_ring_producer_acquire(&prod, 0));
    assert_int_equal(prod.err, BT_ERR_FORMAT);
    assert_int_equal(bt_ring_fill(&prod), 0);
    atomic_store(&cons.hdr->tail, 0);
    /* a hostile producer jumps head far ahead: the consumer refuses */
    atomic_store(&prod.hdr->head, 1000);
    assert_null(bt_ring_consumer_peek(&cons, 0));
    assert_int_equal(cons.err, BT_ERR_FORMAT);
    assert_int_equal(bt_ring_fill(&cons), 2); /* clamped */
    /* geometry in the shared header is not trusted after attach */
    atomic_store(&prod.hdr->head, 0);
    prod.hdr->n_slots = 1u << 30;
    void *s = bt_ring_producer_acquire(&prod, 0);
    assert_ptr_equal(s, prod.slots);
    bt_ring_close(&cons);
    bt_ring_close(&prod);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_two_threads),   cmocka_unit_test(test_two_processes),
        cmocka_unit_test(test_timeouts),      cmocka_unit_test(test_closed_flags),
        cmocka_unit_test(test_lying_header),  cmocka_unit_test(test_impossible_counters),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
