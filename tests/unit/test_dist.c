/* Tests for trainer/dist.c: rank / world discovery from the environment (torchrun and Slurm
 * conventions, every error case) and the TCP rendezvous, with the other ranks as fork()ed
 * children (each child's exit code says whether it got the expected result and blob): world 3,
 * world 1, a digest mismatch, hostile / stray clients, timeouts on both sides, out-of-range and
 * wrong-world hellos, a duplicate rank. Ports are picked free by binding port 0 first. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "trainer/dist.h"

#define NID 128 /* an NCCL id's size */

/* ---------------------------------------------------------------- environment ---------------- */

static const char *const VARS[] = {"RANK",          "WORLD_SIZE",         "LOCAL_RANK",         "SLURM_PROCID",
                                   "SLURM_NTASKS",  "SLURM_LOCALID",      "MASTER_ADDR",        "MASTER_PORT",
                                   "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST"};
#define NVARS (sizeof VARS / sizeof VARS[0])
static char *g_saved[NVARS];

static int save_env(void **st) {
    (void)st;
    for (size_t i = 0; i < NVARS; i++) {
        const char *v = getenv(VARS[i]);
        g_saved[i] = v ? strdup(v) : NULL;
        unsetenv(VARS[i]);
    }
    return 0;
}

static int restore_env(void **st) {
    (void)st;
    for (size_t i = 0; i < NVARS; i++) {
        if (g_saved[i])
            setenv(VARS[i], g_saved[i], 1);
        else
            unsetenv(VARS[i]);
        free(g_saved[i]);
        g_saved[i] = NULL;
    }
    return 0;
}

static void clear_env(void) {
    for (size_t i = 0; i < NVARS; i++) unsetenv(VARS[i]);
}

static void test_env_single(void **st) {
    (void)st;
    bt_dist_env e;
    memset(&e, 0xab, sizeof e);
    assert_int_equal(bt_dist_env_resolve(&e), 0);
    assert_int_equal(e.rank, 0);
    assert_int_equal(e.world, 1);
    assert_int_equal(e.local_rank, 0);
    assert_string_equal(e.source, "single");
}

static void test_env_torchrun_and_slurm(void **st) {
    (void)st;
    bt_dist_env e;
    setenv("RANK", "5", 1);
    setenv("WORLD_SIZE", "8", 1);
    setenv("LOCAL_RANK", "1", 1);
    setenv("SLURM_PROCID", "2", 1); /* torchrun's variables take precedence */
    setenv("SLURM_NTASKS", "3", 1);
    setenv("SLURM_LOCALID", "2", 1);
    assert_int_equal(bt_dist_env_resolve(&e), 0);
    assert_int_equal(e.rank, 5);
    assert_int_equal(e.world, 8);
    assert_int_equal(e.local_rank, 1);
    assert_string_equal(e.source, "torchrun");
    unsetenv("LOCAL_RANK"); /* default: the rank (one node) */
    assert_int_equal(bt_dist_env_resolve(&e), 0);
    assert_int_equal(e.local_rank, 5);

    unsetenv("RANK");
    unsetenv("WORLD_SIZE");
    assert_int_equal(bt_dist_env_resolve(&e), 0);
    assert_int_equal(e.rank, 2);
    assert_int_equal(e.world, 3);
    assert_int_equal(e.local_rank, 2);
    assert_string_equal(e.source, "slurm");
    unsetenv("SLURM_LOCALID"); /* default 0 */
    assert_int_equal(bt_dist_env_resolve(&e), 0);
    assert_int_equal(e.local_rank, 0);
    setenv("SLURM_NTASKS", "65536", 1); /* the largest world */
    assert_int_equal(bt_dist_env_resolve(&e), 0);
    assert_int_equal(e.world, 65536);
}

static void test_env_errors(void **st) {
    (void)st;
    static const struct {
        const char *kv[3][2];
        const char *want; /* substring of the message */
    } cases[] = {
        {{{"RANK", "1"}}, "RANK=\"1\" is set but WORLD_SIZE is not"},
        {{{"WORLD_SIZE", "2"}}, "WORLD_SIZE=\"2\" is set but RANK is not"},
        {{{"SLURM_PROCID", "0"}}, "SLURM_PROCID=\"0\" is set but SLURM_NTASKS is not"},
        {{{"SLURM_NTASKS", "4"}}, "SLURM_NTASKS=\"4\" is set but SLURM_PROCID is not"},
        {{{"RANK", "0"}, {"WORLD_SIZE", "abc"}}, "WORLD_SIZE=\"abc\" is not a plain decimal integer"},
        {{{"RANK", "0"}, {"WORLD_SIZE", "4x"}}, "WORLD_SIZE=\"4x\" is not a plain decimal integer"},
        {{{"RANK", "0"}, {"WORLD_SIZE", " 4"}}, "WORLD_SIZE=\" 4\" is not a plain decimal integer"},
        {{{"RANK", "0"}, {"WORLD_SIZE", "+4"}}, "WORLD_SIZE=\"+4\" is not a plain decimal integer"},
        {{{"RANK", "0"}, {"WORLD_SIZE", ""}}, "WORLD_SIZE is set but empty"},
        {{{"RANK", "-1"}, {"WORLD_SIZE", "4"}}, "RANK=\"-1\" is negative"},
        {{{"RANK", "0"}, {"WORLD_SIZE", "0"}}, "WORLD_SIZE=\"0\": the world size must be >= 1"},
        {{{"RANK", "0"}, {"WORLD_SIZE", "65537"}}, "WORLD_SIZE=\"65537\" exceeds the largest world size 65536"},
        {{{"RANK", "0"}, {"WORLD_SIZE", "99999999999999999999"}}, "WORLD_SIZE=\"99999999999999999999\" is too large"},
        {{{"RANK", "4"}, {"WORLD_SIZE", "4"}}, "RANK=\"4\" is not below WORLD_SIZE=\"4\""},
        {{{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "-2"}}, "LOCAL_RANK=\"-2\" is negative"},
        {{{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "4"}}, "LOCAL_RANK=\"4\" is not below WORLD_SIZE"},
        {{{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1.0"}}, "LOCAL_RANK=\"1.0\" is not a plain"},
        {{{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "2"}}, "SLURM_PROCID=\"3\" is not below SLURM_NTASKS=\"2\""},
        {{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "x"}}, "SLURM_LOCALID=\"x\""},
        {{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "-2"}}, "SLURM_NTASKS=\"-2\" is negative"},
        /* a stray RANK with SLURM_* set is still an error, not silently ignored */
        {{{"RANK", "1"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}}, "RANK=\"1\" is set but WORLD_SIZE"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        clear_env();
        for (int k = 0; k < 3 && cases[c].kv[k][0]; k++) setenv(cases[c].kv[k][0], cases[c].kv[k][1], 1);
        bt_dist_env e = {.rank = 7, .world = 9, .local_rank = 3, .source = "keep"};
        int rc = bt_dist_env_resolve(&e);
        if (rc != BT_ERR_INVALID || !strstr(bt_last_error(), cases[c].want))
            fail_msg("case %zu: rc %d, message \"%s\", want \"%s\"", c, rc, bt_last_error(), cases[c].want);
        assert_int_equal(e.rank, 7); /* written only on success */
        assert_string_equal(e.source, "keep");
    }
}

static void test_master_and_hostlist(void **st) {
    (void)st;
    char h[64];
    int port = 0;
    assert_int_equal(bt_dist_first_host("gpu[01-04,07],cpu9", h, sizeof h), 0);
    assert_string_equal(h, "gpu01");
    assert_int_equal(bt_dist_first_host("rack[1-2]-n[3,5]", h, sizeof h), 0);
    assert_string_equal(h, "rack1-n3");
    assert_int_equal(bt_dist_first_host("node7,node8", h, sizeof h), 0);
    assert_string_equal(h, "node7");
    assert_int_equal(bt_dist_first_host("solo", h, sizeof h), 0);
    assert_string_equal(h, "solo");
    static const char *const bad[] = {"gpu[01-04", "gpu[]", "a]", ",x", "", "a[1[2]]"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        assert_int_equal(bt_dist_first_host(bad[i], h, sizeof h), BT_ERR_INVALID);
    assert_int_equal(bt_dist_first_host("verylongname", h, 5), BT_ERR_INVALID);

    bt_dist_env single = {0, 1, 0, "single"}, slurm = {1, 4, 1, "slurm"}, tr = {1, 4, 1, "torchrun"};
    assert_int_equal(bt_dist_master_resolve(&single, "10.0.0.1", 1234, h, sizeof h, &port), 0);
    assert_string_equal(h, "10.0.0.1");
    assert_int_equal(port, 1234);
    assert_int_equal(bt_dist_master_resolve(NULL, NULL, 0, h, sizeof h, &port), 0);
    assert_string_equal(h, "127.0.0.1");
    assert_int_equal(port, BT_DIST_DEFAULT_PORT);
    setenv("SLURM_JOB_NODELIST", "gpu[07-08]", 1); /* multi-rank Slurm: the first host of the list */
    assert_int_equal(bt_dist_master_resolve(&slurm, "127.0.0.1", 29500, h, sizeof h, &port), 0);
    assert_string_equal(h, "gpu07");
    assert_int_equal(port, 29500);
    setenv("SLURM_STEP_NODELIST", "gpu08", 1); /* the step's list before the job's */
    assert_int_equal(bt_dist_master_resolve(&slurm, NULL, 0, h, sizeof h, &port), 0);
    assert_string_equal(h, "gpu08");
    assert_int_equal(bt_dist_master_resolve(&tr, "10.0.0.2", 0, h, sizeof h, &port), 0); /* not Slurm */
    assert_string_equal(h, "10.0.0.2");
    setenv("SLURM_STEP_NODELIST", "gpu[08", 1);
    assert_int_equal(bt_dist_master_resolve(&slurm, NULL, 0, h, sizeof h, &port), BT_ERR_INVALID);
    setenv("MASTER_ADDR", "head.example", 1); /* the environment wins */
    setenv("MASTER_PORT", "41000", 1);
    assert_int_equal(bt_dist_master_resolve(&slurm, "127.0.0.1", 29500, h, sizeof h, &port), 0);
    assert_string_equal(h, "head.example");
    assert_int_equal(port, 41000);
    assert_int_equal(bt_dist_master_resolve(&slurm, NULL, 0, h, 8, &port), BT_ERR_INVALID); /* does not fit */
    static const char *const badport[] = {"70000", "0", "29x", "", "-1"};
    for (size_t i = 0; i < sizeof badport / sizeof badport[0]; i++) {
        setenv("MASTER_PORT", badport[i], 1);
        port = 5;
        assert_int_equal(bt_dist_master_resolve(&slurm, NULL, 0, h, sizeof h, &port), BT_ERR_INVALID);
        assert_non_null(strstr(bt_last_error(), "MASTER_PORT"));
        assert_int_equal(port, 5);
    }
}

static void test_digest(void **st) {
    (void)st;
    const char *cfg = "{\"model\": \"smollm2\", \"lora\": {\"r\": 16}}";
    uint8_t a[32], b[32], z[32] = {0};
    bt_dist_digest(cfg, strlen(cfg), a);
    bt_dist_digest(cfg, strlen(cfg), b);
    assert_memory_equal(a, b, 32);
    assert_memory_not_equal(a, z, 32);
    for (int i = 0; i < 4; i++)
        for (int j = i + 1; j < 4; j++) assert_memory_not_equal(a + 8 * i, a + 8 * j, 8); /* distinct lanes */
    char buf[64];
    memcpy(buf, cfg, strlen(cfg) + 1);
    buf[20] ^= 1; /* one bit anywhere changes every lane */
    bt_dist_digest(buf, strlen(cfg), b);
    for (int i = 0; i < 4; i++) assert_memory_not_equal(a + 8 * i, b + 8 * i, 8);
    /* a trailing zero byte (padding of the last word) and every length give different digests */
    uint8_t prev[32];
    bt_dist_digest(NULL, 0, prev);
    memset(buf, 0, sizeof buf);
    for (size_t n = 1; n <= 17; n++) {
        bt_dist_digest(buf, n, b);
        assert_memory_not_equal(prev, b, 32);
        memcpy(prev, b, 32);
    }
}

/* ---------------------------------------------------------------- rendezvous helpers --------- */

/* A port nobody listens on right now (bound to port 0, then released). */
static int free_port(void) {
    int fd = socket(AF_INET6, SOCK_STREAM, 0), zero = 0, port = -1;
    if (fd >= 0) {
        setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
        struct sockaddr_in6 a = {.sin6_family = AF_INET6, .sin6_addr = in6addr_any};
        if (bind(fd, (struct sockaddr *)&a, sizeof a) == 0) {
            socklen_t sl = sizeof a;
            getsockname(fd, (struct sockaddr *)&a, &sl);
            port = ntohs(a.sin6_port);
        }
        close(fd);
    }
    if (port > 0) return port;
    fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_ANY)};
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    socklen_t sl = sizeof a;
    assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &sl), 0);
    close(fd);
    return ntohs(a.sin_port);
}

static void fill_blob(uint8_t *b, size_t n) {
    for (size_t i = 0; i < n; i++) b[i] = (uint8_t)(i * 7 + 3);
}

static void job_digest(const char *cfg, uint8_t d[32]) {
    bt_dist_digest(cfg, strlen(cfg), d);
}

typedef struct {
    const char *addr;
    int port, rank, world, timeout_s;
    const char *cfg;      /* job config text, digested */
    int want_rc;          /* expected result */
    const char *want_msg; /* substring of bt_last_error() when want_rc != 0 */
} peer_spec;

/* Run one rank in a child process; exit 0 iff it returned want_rc (with the right blob on
 * success, or the wanted message on failure). */
static pid_t spawn_peer(peer_spec p) {
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid) return pid;
    uint8_t d[32], blob[NID] = {0}, want[NID];
    job_digest(p.cfg, d);
    fill_blob(want, NID);
    if (p.rank == 0) fill_blob(blob, NID);
    int rc = bt_dist_rendezvous(p.addr, p.port, p.rank, p.world, d, blob, NID, p.timeout_s);
    int ok = rc == p.want_rc && (rc ? !p.want_msg || strstr(bt_last_error(), p.want_msg) : !memcmp(blob, want, NID));
    if (!ok) fprintf(stderr, "child rank %d: rc %d (want %d): %s\n", p.rank, rc, p.want_rc, bt_last_error());
    _exit(ok ? 0 : 1);
}

static int child_exit(pid_t pid) {
    int st = 0;
    while (waitpid(pid, &st, 0) < 0)
        if (errno != EINTR) return -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* Connect to 127.0.0.1:port, retrying refusals for up to 3 s. */
static int raw_connect(int port) {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    for (int i = 0; i < 300; i++) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd < 0) return -1;
        if (connect(fd, (struct sockaddr *)&a, sizeof a) == 0) return fd;
        close(fd);
        usleep(10 * 1000);
    }
    return -1;
}

static void make_hello(uint8_t h[52], uint32_t version, uint32_t rank, uint32_t world, const char *cfg) {
    memcpy(h, "BTDIST01", 8);
    for (int i = 0; i < 4; i++) {
        h[8 + i] = (uint8_t)(version >> (8 * i));
        h[12 + i] = (uint8_t)(rank >> (8 * i));
        h[16 + i] = (uint8_t)(world >> (8 * i));
    }
    job_digest(cfg, h + 20);
}

/* Read a reply header (3 s at most); its status, or -1. */
static int read_status(int fd) {
    struct timeval tv = {.tv_sec = 3};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    uint8_t h[16];
    size_t got = 0;
    while (got < sizeof h) {
        ssize_t k = recv(fd, h + got, sizeof h - got, 0);
        if (k <= 0) return -1;
        got += (size_t)k;
    }
    if (memcmp(h, "BTDIST01", 8)) return -1;
    return (int)(h[8] | h[9] << 8 | h[10] << 16 | (uint32_t)h[11] << 24);
}

/* Child: send one hello, exit 0 iff rank 0 answers with `want_status`. */
static pid_t spawn_raw_hello(int port, uint32_t rank, uint32_t world, int want_status) {
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid) return pid;
    uint8_t h[52];
    make_hello(h, BT_DIST_VERSION, rank, world, "job A");
    int fd = raw_connect(port);
    int ok = fd >= 0 && send(fd, h, sizeof h, MSG_NOSIGNAL) == (ssize_t)sizeof h && read_status(fd) == want_status;
    if (fd >= 0) close(fd);
    _exit(ok ? 0 : 1);
}

/* Open file descriptors of this process (every socket must be closed on every path). */
static int open_fds(void) {
    DIR *d = opendir("/proc/self/fd");
    assert_non_null(d);
    int n = 0;
    while (readdir(d)) n++;
    closedir(d);
    return n;
}

/* Rank 0 in this process; checks that it leaves no descriptor open. */
static int rank0(int port, int world, const char *cfg, int timeout_s, double *elapsed) {
    uint8_t d[32], blob[NID];
    job_digest(cfg, d);
    fill_blob(blob, NID);
    int fds = open_fds();
    double t0 = bt_now();
    int rc = bt_dist_rendezvous("127.0.0.1", port, 0, world, d, blob, NID, timeout_s);
    *elapsed = bt_now() - t0;
    assert_int_equal(open_fds(), fds);
    return rc;
}

/* ---------------------------------------------------------------- rendezvous tests ----------- */

static void test_world1_noop(void **st) {
    (void)st;
    uint8_t d[32] = {0}, blob[4] = {1, 2, 3, 4};
    double t0 = bt_now();
    assert_int_equal(bt_dist_rendezvous(NULL, 0, 0, 1, d, blob, sizeof blob, 0), 0);
    assert_true(bt_now() - t0 < 0.1);
    assert_int_equal(blob[0], 1);
    assert_int_equal(blob[3], 4);
    assert_int_equal(bt_dist_rendezvous("x", 1, 1, 1, d, blob, 4, 1), BT_ERR_INVALID); /* rank >= world */
    assert_int_equal(bt_dist_rendezvous("x", 1, 0, 2, d, blob, 2000, 1), BT_ERR_INVALID); /* blob too big */
    assert_int_equal(bt_dist_rendezvous("x", 0, 1, 2, d, blob, 4, 1), BT_ERR_INVALID);    /* port */
    assert_int_equal(bt_dist_rendezvous("x", 1, 1, 2, d, blob, 4, 0), BT_ERR_INVALID);    /* timeout */
}

static void test_world3(void **st) {
    (void)st;
    int port = free_port();
    /* the peers start first: they retry until rank 0 listens */
    pid_t p1 = spawn_peer((peer_spec){"localhost", port, 1, 3, 5, "job A", 0, NULL});
    pid_t p2 = spawn_peer((peer_spec){"127.0.0.1", port, 2, 3, 5, "job A", 0, NULL});
    usleep(150 * 1000);
    double dt;
    int rc = rank0(port, 3, "job A", 5, &dt);
    assert_int_equal(child_exit(p1), 0);
    assert_int_equal(child_exit(p2), 0);
    if (rc) fail_msg("rank 0: %s", bt_last_error());
    assert_true(dt < 2.0);
}

/* This process as rank 1 (over IPv6 loopback where there is one), rank 0 in a child. */
static void test_parent_is_peer(void **st) {
    (void)st;
    const char *addr = "127.0.0.1";
    int v6 = socket(AF_INET6, SOCK_STREAM, 0);
    struct sockaddr_in6 lo = {.sin6_family = AF_INET6, .sin6_addr = in6addr_loopback};
    if (v6 >= 0 && bind(v6, (struct sockaddr *)&lo, sizeof lo) == 0) addr = "::1";
    if (v6 >= 0) close(v6);
    int port = free_port(), fds = open_fds();
    pid_t r0 = spawn_peer((peer_spec){addr, port, 0, 2, 5, "job A", 0, NULL});
    uint8_t d[32], blob[NID] = {0}, want[NID];
    job_digest("job A", d);
    fill_blob(want, NID);
    int rc = bt_dist_rendezvous(addr, port, 1, 2, d, blob, NID, 5);
    if (rc) fail_msg("rank 1 via %s: %s", addr, bt_last_error());
    assert_memory_equal(blob, want, NID);
    assert_int_equal(child_exit(r0), 0);
    assert_int_equal(open_fds(), fds);

    port = free_port(); /* rank 0 sends 128 bytes, this rank expects 64 */
    r0 = spawn_peer((peer_spec){addr, port, 0, 2, 5, "job A", 0, NULL});
    assert_int_equal(bt_dist_rendezvous(addr, port, 1, 2, d, blob, 64, 5), BT_ERR_FORMAT);
    assert_non_null(strstr(bt_last_error(), "128-byte blob"));
    assert_int_equal(child_exit(r0), 0);
    assert_int_equal(open_fds(), fds);
}

static void test_digest_mismatch(void **st) {
    (void)st;
    int port = free_port();
    pid_t p1 = spawn_peer((peer_spec){"127.0.0.1", port, 1, 2, 5, "job B", BT_ERR_INVALID, "config digest"});
    double dt;
    int rc = rank0(port, 2, "job A", 5, &dt);
    assert_int_equal(rc, BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "rank 1"));
    assert_non_null(strstr(bt_last_error(), "digest"));
    assert_int_equal(child_exit(p1), 0);
    assert_true(dt < 2.0);
}

static void test_out_of_range_and_wrong_world(void **st) {
    (void)st;
    int port = free_port();
    pid_t c = spawn_raw_hello(port, 5, 2, 6); /* status 6 = -BT_ERR_INVALID */
    double dt;
    assert_int_equal(rank0(port, 2, "job A", 5, &dt), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "rank 5"));
    assert_non_null(strstr(bt_last_error(), "out of range"));
    assert_int_equal(child_exit(c), 0);

    port = free_port();
    c = spawn_raw_hello(port, 1, 3, 6);
    assert_int_equal(rank0(port, 2, "job A", 5, &dt), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "rank 1"));
    assert_non_null(strstr(bt_last_error(), "world size 3"));
    assert_int_equal(child_exit(c), 0);

    port = free_port(); /* a hello claiming rank 0 */
    c = spawn_raw_hello(port, 0, 2, 6);
    assert_int_equal(rank0(port, 2, "job A", 5, &dt), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "rank 0 (from"));
    assert_int_equal(child_exit(c), 0);
}

/* Child: stray and hostile connections against rank 0, then it joins as rank 1. */
static pid_t spawn_hostile_then_rank1(int port) {
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid) return pid;
    int fds[80], n = 0, ok = 1;
    uint8_t h[52];
    const char garbage[] = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
    if ((fds[n] = raw_connect(port)) < 0) _exit(2);
    ok &= send(fds[n++], garbage, sizeof garbage - 1, MSG_NOSIGNAL) > 0; /* garbage */
    fds[n++] = raw_connect(port);                                         /* silent */
    make_hello(h, BT_DIST_VERSION, 1, 3, "job A");
    fds[n] = raw_connect(port);
    ok &= send(fds[n++], h, 30, MSG_NOSIGNAL) == 30; /* truncated hello, then silent */
    int t = raw_connect(port);
    ok &= send(t, h, 30, MSG_NOSIGNAL) == 30; /* truncated hello, then closed */
    close(t);
    make_hello(h, 99, 1, 3, "job A");
    fds[n] = raw_connect(port);
    ok &= send(fds[n++], h, sizeof h, MSG_NOSIGNAL) == (ssize_t)sizeof h; /* unknown version */
    while (n < 75) fds[n++] = raw_connect(port); /* more silent ones than rank 0 keeps pending */
    for (int i = 0; i < n; i++) ok &= fds[i] >= 0;
    uint8_t d[32], blob[NID] = {0}, want[NID];
    job_digest("job A", d);
    fill_blob(want, NID);
    int rc = bt_dist_rendezvous("127.0.0.1", port, 1, 3, d, blob, NID, 5);
    if (rc) fprintf(stderr, "hostile child rank 1: %s\n", bt_last_error());
    for (int i = 0; i < n; i++)
        if (fds[i] >= 0) close(fds[i]);
    _exit(ok && rc == 0 && !memcmp(blob, want, NID) ? 0 : 1);
}

static void test_hostile_clients(void **st) {
    (void)st;
    int port = free_port();
    pid_t h = spawn_hostile_then_rank1(port);
    pid_t p2 = spawn_peer((peer_spec){"127.0.0.1", port, 2, 3, 5, "job A", 0, NULL});
    double dt;
    int rc = rank0(port, 3, "job A", 5, &dt);
    if (rc) fail_msg("rank 0: %s", bt_last_error());
    assert_int_equal(child_exit(h), 0);
    assert_int_equal(child_exit(p2), 0);
    assert_true(dt < 2.0);
}

/* Child: says hello as rank 1 over a raw socket, and expects the blob (status 0) at the end. */
static pid_t spawn_fake_rank1(int port) {
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid) return pid;
    uint8_t h[52];
    make_hello(h, BT_DIST_VERSION, 1, 3, "job A");
    int fd = raw_connect(port);
    int ok = fd >= 0 && send(fd, h, sizeof h, MSG_NOSIGNAL) == (ssize_t)sizeof h && read_status(fd) == 0;
    if (fd >= 0) close(fd);
    _exit(ok ? 0 : 1);
}

static void test_duplicate_rank(void **st) {
    (void)st;
    int port = free_port();
    pid_t f = spawn_fake_rank1(port);
    usleep(50 * 1000);
    pid_t p1 = 0, p2 = 0;
    fflush(NULL);
    pid_t starter = fork(); /* the real rank 1 and rank 2 come once the fake rank 1 has joined */
    assert_true(starter >= 0);
    if (!starter) {
        usleep(300 * 1000);
        p1 = spawn_peer((peer_spec){"127.0.0.1", port, 1, 3, 5, "job A", BT_ERR_INVALID, "already joined"});
        int e1 = child_exit(p1);
        p2 = spawn_peer((peer_spec){"127.0.0.1", port, 2, 3, 5, "job A", 0, NULL});
        _exit(e1 == 0 && child_exit(p2) == 0 ? 0 : 1);
    }
    double dt;
    int rc = rank0(port, 3, "job A", 5, &dt);
    if (rc) fail_msg("rank 0: %s", bt_last_error());
    assert_int_equal(child_exit(starter), 0);
    assert_int_equal(child_exit(f), 0);
}

static void test_timeout_rank0(void **st) {
    (void)st;
    int port = free_port();
    double dt;
    assert_int_equal(rank0(port, 2, "job A", 1, &dt), BT_ERR_TIMEOUT);
    assert_non_null(strstr(bt_last_error(), "1 of 1 ranks never arrived: 1 "));
    assert_true(dt >= 0.95 && dt < 1.6);
}

/* World 5, ranks 2 and 3 come, 1 and 4 never do: the joined ranks hear rank 0's reason at once. */
static void test_timeout_rank0_partial(void **st) {
    (void)st;
    int port = free_port();
    double dt;
    pid_t a = spawn_peer((peer_spec){"127.0.0.1", port, 2, 5, 5, "job A", BT_ERR_TIMEOUT, "rank 0: timed out"});
    pid_t b = spawn_peer((peer_spec){"127.0.0.1", port, 3, 5, 5, "job A", BT_ERR_TIMEOUT, "never arrived: 1,4"});
    assert_int_equal(rank0(port, 5, "job A", 1, &dt), BT_ERR_TIMEOUT);
    assert_non_null(strstr(bt_last_error(), "2 of 4 ranks never arrived: 1,4 "));
    assert_int_equal(child_exit(a), 0);
    assert_int_equal(child_exit(b), 0);
}

static void test_timeout_peer(void **st) {
    (void)st;
    int port = free_port();
    uint8_t d[32] = {0}, blob[NID] = {0};
    int fds = open_fds();
    double t0 = bt_now();
    assert_int_equal(bt_dist_rendezvous("127.0.0.1", port, 1, 2, d, blob, NID, 1), BT_ERR_TIMEOUT);
    double dt = bt_now() - t0;
    assert_int_equal(open_fds(), fds);
    char want[64];
    snprintf(want, sizeof want, "could not reach rank 0 at 127.0.0.1:%d", port);
    assert_non_null(strstr(bt_last_error(), want));
    assert_true(dt >= 0.95 && dt < 1.6);
}

/* A listener that accepts and never answers: the peer's wait for the reply is bounded too. */
static void test_timeout_peer_silent_rank0(void **st) {
    (void)st;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(fd, 4), 0);
    socklen_t sl = sizeof a;
    assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &sl), 0);
    uint8_t d[32] = {0}, blob[NID] = {0};
    double t0 = bt_now();
    assert_int_equal(bt_dist_rendezvous("127.0.0.1", ntohs(a.sin_port), 1, 2, d, blob, NID, 1), BT_ERR_TIMEOUT);
    assert_true(bt_now() - t0 < 1.6);
    assert_non_null(strstr(bt_last_error(), "did not answer"));
    close(fd);
}

int main(void) {
    signal(SIGPIPE, SIG_DFL); /* the module must not need SIGPIPE ignored */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_env_single, save_env, restore_env),
        cmocka_unit_test_setup_teardown(test_env_torchrun_and_slurm, save_env, restore_env),
        cmocka_unit_test_setup_teardown(test_env_errors, save_env, restore_env),
        cmocka_unit_test_setup_teardown(test_master_and_hostlist, save_env, restore_env),
        cmocka_unit_test(test_digest),
        cmocka_unit_test(test_world1_noop),
        cmocka_unit_test(test_world3),
        cmocka_unit_test(test_parent_is_peer),
        cmocka_unit_test(test_digest_mismatch),
        cmocka_unit_test(test_out_of_range_and_wrong_world),
        cmocka_unit_test(test_hostile_clients),
        cmocka_unit_test(test_duplicate_rank),
        cmocka_unit_test(test_timeout_rank0),
        cmocka_unit_test(test_timeout_rank0_partial),
        cmocka_unit_test(test_timeout_peer),
        cmocka_unit_test(test_timeout_peer_silent_rank0),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
