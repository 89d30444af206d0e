/* Tests for trainer/parallel/dist.c and trainer/parallel/dist_rdv.c: rank / world discovery from the environment
 * (torchrun and Slurm conventions, every error case), the job secret (environment and file,
 * refused when others can read the file), Slurm's CPU share, and the authenticated TCP
 * rendezvous, with the other ranks as fork()ed children (each child's exit code says whether it
 * got the expected result and blob): world 3, world 1, a digest mismatch, hostile / stray clients,
 * clients without the secret (they can neither end the start-up nor read the NCCL id), a rank
 * with another secret, a fake rank 0, timeouts on both sides, out-of-range and wrong-world hellos,
 * a duplicate rank. The raw clients here speak the wire format of trainer/parallel/dist.h with OpenSSL
 * directly, so the documented format is what is tested. Ports are picked free by binding port 0
 * first. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/stat.h>
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
#include "trainer/parallel/dist.h"

#define NID 128 /* an NCCL id's size */

/* ---------------------------------------------------------------- environment ---------------- */

static const char *const VARS[] = {"RANK",          "WORLD_SIZE",         "LOCAL_RANK",         "SLURM_PROCID",
                                   "SLURM_NTASKS",  "SLURM_LOCALID",      "MASTER_ADDR",        "MASTER_PORT",
                                   "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST", "BT_DIST_SECRET",
                                   "SLURM_JOB_ID", "SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE",
                                   "SLURM_NODEID", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"};
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

/* ---------------------------------------------------------------- job secret, CPU share ----- */

#define SECRET_A "job-A-secret-0123456789abcdef"
#define SECRET_B "job-B-secret-0123456789abcdef"

/* The documented derivation, computed here with OpenSSL: HMAC-SHA256(secret, label). */
static void derive(const char *secret, uint8_t key[32]) {
    static const char label[] = "BarqTrain dist job key v2";
    unsigned len = 32;
    HMAC(EVP_sha256(), secret, (int)strlen(secret), (const uint8_t *)label, sizeof label - 1, key, &len);
}

static void write_file(const char *path, const char *text, mode_t mode) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
    assert_int_equal(chmod(path, mode), 0);
}

static void test_secret(void **st) {
    (void)st;
    clear_env();
    uint8_t key[32], want[32];
    char src[300], dir[] = "/tmp/bt-secret-XXXXXX", path[64];
    assert_int_equal(bt_dist_key_load(NULL, key, src, sizeof src), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "BT_DIST_SECRET"));
    assert_non_null(strstr(bt_last_error(), "dist.secret_file"));
    setenv("BT_DIST_SECRET", "short", 1);
    assert_int_equal(bt_dist_key_load(NULL, key, src, sizeof src), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "5 bytes"));
    setenv("BT_DIST_SECRET", SECRET_A "\n", 1); /* a trailing newline does not count */
    assert_int_equal(bt_dist_key_load("", key, src, sizeof src), 0);
    derive(SECRET_A, want);
    assert_memory_equal(key, want, 32);
    assert_string_equal(src, "BT_DIST_SECRET");
    /* the file wins over the environment; only when nobody else can read it */
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/secret", dir);
    write_file(path, SECRET_B "\n", 0644);
    assert_int_equal(bt_dist_key_load(path, key, src, sizeof src), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "mode 0644"));
    assert_non_null(strstr(bt_last_error(), "chmod 600"));
    assert_int_equal(chmod(path, 0640), 0);
    assert_int_equal(bt_dist_key_load(path, key, src, sizeof src), BT_ERR_INVALID);
    assert_int_equal(chmod(path, 0600), 0);
    assert_int_equal(bt_dist_key_load(path, key, src, sizeof src), 0);
    derive(SECRET_B, want);
    assert_memory_equal(key, want, 32);
    assert_non_null(strstr(src, path));
    write_file(path, "too short\n", 0400);
    assert_int_equal(bt_dist_key_load(path, key, src, sizeof src), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "at least 16"));
    assert_int_equal(bt_dist_key_load(dir, key, src, sizeof src), BT_ERR_INVALID); /* a directory */
    unlink(path);
    assert_int_equal(bt_dist_key_load(path, key, src, sizeof src), BT_ERR_IO);
    rmdir(dir);
}

static void test_slurm_cpus(void **st) {
    (void)st;
    clear_env();
    char how[128];
    assert_int_equal(bt_dist_slurm_cpus(how, sizeof how), 0); /* not under Slurm */
    setenv("SLURM_JOB_ID", "42", 1);
    assert_int_equal(bt_dist_slurm_cpus(how, sizeof how), 0); /* nothing to go by */
    setenv("SLURM_CPUS_ON_NODE", "8", 1);
    setenv("SLURM_STEP_TASKS_PER_NODE", "2(x3),1", 1);
    setenv("SLURM_NODEID", "1", 1);
    assert_int_equal(bt_dist_slurm_cpus(how, sizeof how), 4);
    assert_non_null(strstr(how, "2 task(s)"));
    setenv("SLURM_NODEID", "3", 1);
    assert_int_equal(bt_dist_slurm_cpus(how, sizeof how), 8);
    setenv("SLURM_NODEID", "4", 1); /* past the list */
    assert_int_equal(bt_dist_slurm_cpus(how, sizeof how), 0);
    setenv("SLURM_STEP_TASKS_PER_NODE", "2(y3)", 1); /* malformed */
    setenv("SLURM_NODEID", "0", 1);
    assert_int_equal(bt_dist_slurm_cpus(how, sizeof how), 0);
    unsetenv("SLURM_STEP_TASKS_PER_NODE");
    setenv("SLURM_TASKS_PER_NODE", "16", 1); /* more tasks than CPUs: one each */
    assert_int_equal(bt_dist_slurm_cpus(how, sizeof how), 1);
    setenv("SLURM_CPUS_PER_TASK", "3", 1); /* --cpus-per-task wins */
    assert_int_equal(bt_dist_slurm_cpus(how, sizeof how), 3);
    assert_non_null(strstr(how, "SLURM_CPUS_PER_TASK=3"));
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
    const char *secret;   /* NULL: SECRET_A */
} peer_spec;

/* Run one rank in a child process; exit 0 iff it returned want_rc (with the right blob on
 * success, or the wanted message on failure). */
static pid_t spawn_peer(peer_spec p) {
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid) return pid;
    uint8_t d[32], blob[NID] = {0}, want[NID], key[32];
    job_digest(p.cfg, d);
    derive(p.secret ? p.secret : SECRET_A, key);
    fill_blob(want, NID);
    if (p.rank == 0) fill_blob(blob, NID);
    int rc = bt_dist_rendezvous(p.addr, p.port, p.rank, p.world, d, key, blob, NID, p.timeout_s, NULL);
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

static int recv_all(int fd, uint8_t *b, size_t n) {
    struct timeval tv = {.tv_sec = 3};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    for (size_t got = 0; got < n;) {
        ssize_t k = recv(fd, b + got, n - got, 0);
        if (k <= 0) return -1;
        got += (size_t)k;
    }
    return 0;
}

static void put32le(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

#define HELLO_BODY 152 /* trainer/parallel/dist.h: magic .. nonce1 */

/* A raw client as trainer/parallel/dist.h documents it: read the challenge into n0, build a hello (rank,
 * world, version, the digest of cfg, a fresh nonce1) whose mac is made with `key` (NULL: 32
 * garbage bytes). Returns the socket with the reply pending, or -1. */
static int raw_hello(int port, const uint8_t *key, uint32_t version, uint32_t rank, uint32_t world,
                     const char *cfg, uint8_t n0[32], uint8_t n1[32]) {
    int fd = raw_connect(port);
    uint8_t ch[44], h[HELLO_BODY + 32], msg[14 + 32 + HELLO_BODY];
    if (fd < 0 || recv_all(fd, ch, sizeof ch) || memcmp(ch, "BTDIST02", 8)) {
        if (fd >= 0) close(fd);
        return -1;
    }
    memcpy(n0, ch + 12, 32);
    memset(h, 0, sizeof h);
    memcpy(h, "BTDIST02", 8);
    put32le(h + 8, version);
    put32le(h + 12, rank);
    put32le(h + 16, world);
    put32le(h + 20, 4242);
    snprintf((char *)h + 24, 64, "raw-client");
    job_digest(cfg, h + 88);
    for (int i = 0; i < 32; i++) n1[i] = (uint8_t)(rand() & 0xff);
    memcpy(h + 120, n1, 32);
    if (key) {
        memcpy(msg, "BTDIST02 hello", 14);
        memcpy(msg + 14, n0, 32);
        memcpy(msg + 46, h, HELLO_BODY);
        unsigned len = 32;
        HMAC(EVP_sha256(), key, 32, msg, sizeof msg, h + HELLO_BODY, &len);
    } else {
        memset(h + HELLO_BODY, 0x5a, 32);
    }
    if (send(fd, h, sizeof h, MSG_NOSIGNAL) != (ssize_t)sizeof h) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Read a reply; its status (0x80000000 set: unsealed), or -1. With key, n0, n1: the payload is
 * opened (AES-256-GCM under HMAC(key, "BTDIST02 reply" || n0 || n1)) into pay[*len], and a seal
 * that does not verify gives -1; without: pay gets the plain bytes. */
static long read_reply(int fd, const uint8_t *key, const uint8_t *n0, const uint8_t *n1, uint8_t *pay,
                       size_t *len) {
    uint8_t h[32], ct[2048];
    if (recv_all(fd, h, sizeof h) || memcmp(h, "BTDIST02", 8)) return -1;
    uint32_t status = h[8] | h[9] << 8 | h[10] << 16 | (uint32_t)h[11] << 24;
    uint32_t n = h[12] | h[13] << 8 | h[14] << 16 | (uint32_t)h[15] << 24;
    if (n > sizeof ct || recv_all(fd, ct, n)) return -1;
    *len = n;
    if (!key || (status & 0x80000000u)) {
        memcpy(pay, ct, n);
        return status;
    }
    uint8_t k[32], msg[14 + 64], iv[12] = {0};
    memcpy(msg, "BTDIST02 reply", 14);
    memcpy(msg + 14, n0, 32);
    memcpy(msg + 46, n1, 32);
    unsigned kl = 32;
    HMAC(EVP_sha256(), key, 32, msg, sizeof msg, k, &kl);
    EVP_CIPHER_CTX *c = EVP_CIPHER_CTX_new();
    int out = 0, ok = EVP_DecryptInit_ex(c, EVP_aes_256_gcm(), NULL, k, iv) == 1 &&
                      EVP_DecryptUpdate(c, NULL, &out, h, 16) == 1 &&
                      (n == 0 || EVP_DecryptUpdate(c, pay, &out, ct, (int)n) == 1) &&
                      EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_GCM_SET_TAG, 16, h + 16) == 1 &&
                      EVP_DecryptFinal_ex(c, pay + out, &out) == 1;
    EVP_CIPHER_CTX_free(c);
    return ok ? (long)status : -1;
}

/* Child: one authenticated hello (key of SECRET_A), exit 0 iff rank 0 answers with `want_status`
 * under a seal that verifies. */
static pid_t spawn_raw_hello(int port, uint32_t rank, uint32_t world, int want_status) {
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid) return pid;
    uint8_t key[32], n0[32], n1[32], pay[2048];
    size_t len = 0;
    derive(SECRET_A, key);
    int fd = raw_hello(port, key, BT_DIST_VERSION, rank, world, "job A", n0, n1);
    int ok = fd >= 0 && read_reply(fd, key, n0, n1, pay, &len) == want_status;
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

/* Rank 0 in this process (key of SECRET_A); checks that it leaves no descriptor open. */
static int rank0(int port, int world, const char *cfg, int timeout_s, double *elapsed) {
    uint8_t d[32], blob[NID], key[32];
    job_digest(cfg, d);
    derive(SECRET_A, key);
    fill_blob(blob, NID);
    int fds = open_fds();
    double t0 = bt_now();
    int rc = bt_dist_rendezvous("127.0.0.1", port, 0, world, d, key, blob, NID, timeout_s, NULL);
    *elapsed = bt_now() - t0;
    assert_int_equal(open_fds(), fds);
    return rc;
}

/* ---------------------------------------------------------------- rendezvous tests ----------- */

static void test_world1_noop(void **st) {
    (void)st;
    uint8_t d[32] = {0}, blob[4] = {1, 2, 3, 4}, key[32] = {0};
    bt_dist_link *link = (bt_dist_link *)&d; /* must be reset */
    assert_int_equal(bt_dist_rendezvous(NULL, 0, 0, 1, d, key, blob, sizeof blob, 0, &link), 0);
    assert_null(link);
    assert_int_equal(blob[0], 1);
    assert_int_equal(blob[3], 4);
    assert_int_equal(bt_dist_rendezvous("x", 1, 1, 1, d, key, blob, 4, 1, NULL), BT_ERR_INVALID); /* rank >= world */
    assert_int_equal(bt_dist_rendezvous("x", 1, 0, 2, d, key, blob, 2000, 1, NULL), BT_ERR_INVALID); /* blob */
    assert_int_equal(bt_dist_rendezvous("x", 0, 1, 2, d, key, blob, 4, 1, NULL), BT_ERR_INVALID);    /* port */
    assert_int_equal(bt_dist_rendezvous("x", 1, 1, 2, d, key, blob, 4, 0, NULL), BT_ERR_INVALID);    /* timeout */
    assert_int_equal(bt_dist_rendezvous("x", 1, 1, 2, d, NULL, blob, 4, 1, NULL), BT_ERR_INVALID);   /* key */
}

static void test_world3(void **st) {
    (void)st;
    int port = free_port();
    /* the peers start first: they retry until rank 0 listens */
    pid_t p1 = spawn_peer((peer_spec){"localhost", port, 1, 3, 5, "job A", 0, NULL, NULL});
    pid_t p2 = spawn_peer((peer_spec){"127.0.0.1", port, 2, 3, 5, "job A", 0, NULL, NULL});
    usleep(150 * 1000);
    double dt;
    int rc = rank0(port, 3, "job A", 5, &dt);
    assert_int_equal(child_exit(p1), 0);
    assert_int_equal(child_exit(p2), 0);
    if (rc) fail_msg("rank 0: %s", bt_last_error());
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
    pid_t r0 = spawn_peer((peer_spec){addr, port, 0, 2, 5, "job A", 0, NULL, NULL});
    uint8_t d[32], blob[NID] = {0}, want[NID], key[32];
    job_digest("job A", d);
    derive(SECRET_A, key);
    fill_blob(want, NID);
    bt_dist_link *link = NULL;
    int rc = bt_dist_rendezvous(addr, port, 1, 2, d, key, blob, NID, 5, &link);
    if (rc) fail_msg("rank 1 via %s: %s", addr, bt_last_error());
    assert_memory_equal(blob, want, NID);
    assert_non_null(link); /* the connection to rank 0, kept for the monitor */
    assert_int_equal(open_fds(), fds + 1);
    bt_dist_link_free(link);
    assert_int_equal(child_exit(r0), 0);
    assert_int_equal(open_fds(), fds);

    port = free_port(); /* rank 0 sends 128 bytes, this rank expects 64 */
    r0 = spawn_peer((peer_spec){addr, port, 0, 2, 5, "job A", 0, NULL, NULL});
    assert_int_equal(bt_dist_rendezvous(addr, port, 1, 2, d, key, blob, 64, 5, NULL), BT_ERR_FORMAT);
    assert_non_null(strstr(bt_last_error(), "64-byte blob"));
    assert_int_equal(child_exit(r0), 0);
    assert_int_equal(open_fds(), fds);
}

static void test_digest_mismatch(void **st) {
    (void)st;
    int port = free_port();
    pid_t p1 = spawn_peer((peer_spec){"127.0.0.1", port, 1, 2, 5, "job B", BT_ERR_INVALID, "config digest", NULL});
    double dt;
    int rc = rank0(port, 2, "job A", 5, &dt);
    assert_int_equal(rc, BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "rank 1"));
    assert_non_null(strstr(bt_last_error(), "digest"));
    assert_int_equal(child_exit(p1), 0);
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

/* Child: stray and hostile connections against rank 0 (garbage, silent, truncated, unknown
 * version, and well-formed hellos without the secret claiming rank 1 of another job, another
 * world, rank 0 -- each of which, authenticated, would end the start-up), then it joins as
 * rank 1. None of the impostors may read anything but a plain refusal. */
static pid_t spawn_hostile_then_rank1(int port) {
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid) return pid;
    int fds[80], n = 0, ok = 1;
    uint8_t n0[32], n1[32], pay[2048], wrong[32];
    size_t len = 0;
    const char garbage[] = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
    if ((fds[n] = raw_connect(port)) < 0) _exit(2);
    ok &= send(fds[n++], garbage, sizeof garbage - 1, MSG_NOSIGNAL) > 0; /* garbage */
    fds[n++] = raw_connect(port);                                         /* silent */
    fds[n] = raw_connect(port);
    ok &= send(fds[n++], "BTDIST02\x02\0\0\0\x01", 13, MSG_NOSIGNAL) == 13; /* truncated, then silent */
    int t = raw_connect(port);
    ok &= send(t, "BTDIST02\x02", 9, MSG_NOSIGNAL) == 9; /* truncated hello, then closed */
    close(t);
    fds[n++] = raw_hello(port, NULL, 99, 1, 3, "job A", n0, n1); /* unknown version */
    derive(SECRET_B, wrong);
    const struct { const uint8_t *key; uint32_t rank, world; const char *cfg; } fake[] = {
        {NULL, 1, 3, "job B"},  /* no mac at all: another job's digest */
        {wrong, 1, 3, "job B"}, /* another secret */
        {NULL, 2, 5, "job A"},  /* another world */
        {NULL, 0, 3, "job A"},  /* claims rank 0 */
    };
    for (size_t i = 0; i < sizeof fake / sizeof fake[0]; i++) {
        int fd = raw_hello(port, fake[i].key, BT_DIST_VERSION, fake[i].rank, fake[i].world, fake[i].cfg, n0, n1);
        long status = fd >= 0 ? read_reply(fd, NULL, NULL, NULL, pay, &len) : -1;
        pay[len < sizeof pay ? len : sizeof pay - 1] = 0;
        ok &= status == (long)(0x80000000u | 6u) && strstr((char *)pay, "authentication failed") != NULL;
        if (fd >= 0) close(fd);
    }
    while (n < 75) fds[n++] = raw_connect(port); /* more silent ones than rank 0 keeps pending */
    for (int i = 0; i < n; i++) ok &= fds[i] >= 0;
    uint8_t d[32], blob[NID] = {0}, want[NID], key[32];
    job_digest("job A", d);
    derive(SECRET_A, key);
    fill_blob(want, NID);
    int rc = bt_dist_rendezvous("127.0.0.1", port, 1, 3, d, key, blob, NID, 5, NULL);
    if (rc) fprintf(stderr, "hostile child rank 1: %s\n", bt_last_error());
    for (int i = 0; i < n; i++)
        if (fds[i] >= 0) close(fds[i]);
    _exit(ok && rc == 0 && !memcmp(blob, want, NID) ? 0 : 1);
}

static void test_hostile_clients(void **st) {
    (void)st;
    int port = free_port();
    pid_t h = spawn_hostile_then_rank1(port);
    pid_t p2 = spawn_peer((peer_spec){"127.0.0.1", port, 2, 3, 5, "job A", 0, NULL, NULL});
    double dt;
    int rc = rank0(port, 3, "job A", 5, &dt);
    if (rc) fail_msg("rank 0: %s", bt_last_error());
    assert_int_equal(child_exit(h), 0);
    assert_int_equal(child_exit(p2), 0);
}

/* A rank started with another secret is refused (and says so); it neither ends the start-up nor
 * gets the blob, and the real ranks complete it. */
static void test_other_secret(void **st) {
    (void)st;
    int port = free_port();
    fflush(NULL);
    pid_t seq = fork(); /* the impostor first, then the real rank 1 */
    assert_true(seq >= 0);
    if (!seq) {
        pid_t bad = spawn_peer((peer_spec){"127.0.0.1", port, 1, 2, 5, "job A", BT_ERR_INVALID,
                                           "authentication failed", SECRET_B});
        int eb = child_exit(bad);
        pid_t good = spawn_peer((peer_spec){"127.0.0.1", port, 1, 2, 5, "job A", 0, NULL, NULL});
        _exit(eb == 0 && child_exit(good) == 0 ? 0 : 1);
    }
    double dt;
    int rc = rank0(port, 2, "job A", 5, &dt);
    if (rc) fail_msg("rank 0: %s", bt_last_error());
    assert_int_equal(child_exit(seq), 0);
}

/* A fake rank 0: it sends a proper challenge and then a "success" whose seal it cannot make
 * (it does not hold the secret). The peer must refuse it instead of taking its blob. */
static void test_fake_rank0(void **st) {
    (void)st;
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(lfd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    assert_int_equal(bind(lfd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(lfd, 4), 0);
    socklen_t sl = sizeof a;
    assert_int_equal(getsockname(lfd, (struct sockaddr *)&a, &sl), 0);
    fflush(NULL);
    pid_t srv = fork();
    assert_true(srv >= 0);
    if (!srv) {
        int fd = accept(lfd, NULL, NULL);
        uint8_t ch[44] = "BTDIST02", hello[184], reply[32 + 128 + 68];
        put32le(ch + 8, BT_DIST_VERSION);
        memset(ch + 12, 7, 32);
        int ok = fd >= 0 && send(fd, ch, sizeof ch, 0) == (ssize_t)sizeof ch && !recv_all(fd, hello, sizeof hello);
        memset(reply, 0x33, sizeof reply);
        memcpy(reply, "BTDIST02", 8);
        put32le(reply + 8, 0);
        put32le(reply + 12, 128 + 68);
        ok &= send(fd, reply, sizeof reply, 0) == (ssize_t)sizeof reply;
        usleep(300 * 1000);
        _exit(ok ? 0 : 1);
    }
    close(lfd);
    uint8_t d[32], blob[NID] = {0}, key[32];
    job_digest("job A", d);
    derive(SECRET_A, key);
    assert_int_equal(bt_dist_rendezvous("127.0.0.1", ntohs(a.sin_port), 1, 2, d, key, blob, NID, 5, NULL),
                     BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "failed authentication"));
    assert_non_null(strstr(bt_last_error(), "not this job's rank 0"));
    uint8_t zero[NID] = {0};
    assert_memory_equal(blob, zero, NID);
    assert_int_equal(child_exit(srv), 0);
}

/* Child: an authenticated raw rank 1 that expects the sealed blob (status 0) at the end. */
static pid_t spawn_fake_rank1(int port) {
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid) return pid;
    uint8_t key[32], n0[32], n1[32], pay[2048], want[NID];
    size_t len = 0;
    derive(SECRET_A, key);
    fill_blob(want, NID);
    int fd = raw_hello(port, key, BT_DIST_VERSION, 1, 3, "job A", n0, n1);
    int ok = fd >= 0 && read_reply(fd, key, n0, n1, pay, &len) == 0 && len == NID + 4 + 64 &&
             !memcmp(pay, want, NID); /* the documented layout: blob, pid, host */
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
        p1 = spawn_peer((peer_spec){"127.0.0.1", port, 1, 3, 5, "job A", BT_ERR_INVALID, "already joined", NULL});
        int e1 = child_exit(p1);
        p2 = spawn_peer((peer_spec){"127.0.0.1", port, 2, 3, 5, "job A", 0, NULL, NULL});
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
}

/* World 5, ranks 2 and 3 come, 1 and 4 never do: the joined ranks hear rank 0's reason at once. */
static void test_timeout_rank0_partial(void **st) {
    (void)st;
    int port = free_port();
    double dt;
    pid_t a = spawn_peer((peer_spec){"127.0.0.1", port, 2, 5, 5, "job A", BT_ERR_TIMEOUT, "rank 0: timed out", NULL});
    pid_t b = spawn_peer((peer_spec){"127.0.0.1", port, 3, 5, 5, "job A", BT_ERR_TIMEOUT, "never arrived: 1,4", NULL});
    assert_int_equal(rank0(port, 5, "job A", 1, &dt), BT_ERR_TIMEOUT);
    assert_non_null(strstr(bt_last_error(), "2 of 4 ranks never arrived: 1,4 "));
    assert_int_equal(child_exit(a), 0);
    assert_int_equal(child_exit(b), 0);
}

static void test_timeout_peer(void **st) {
    (void)st;
    int port = free_port();
    uint8_t d[32] = {0}, blob[NID] = {0}, key[32] = {0};
    int fds = open_fds();
    assert_int_equal(bt_dist_rendezvous("127.0.0.1", port, 1, 2, d, key, blob, NID, 1, NULL), BT_ERR_TIMEOUT);
    assert_int_equal(open_fds(), fds);
    char want[64];
    snprintf(want, sizeof want, "could not reach rank 0 at 127.0.0.1:%d", port);
    assert_non_null(strstr(bt_last_error(), want));
}

/* A listener that accepts and never answers: the peer's wait for the challenge is bounded too. */
static void test_timeout_peer_silent_rank0(void **st) {
    (void)st;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(fd, 4), 0);
    socklen_t sl = sizeof a;
    assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &sl), 0);
    uint8_t d[32] = {0}, blob[NID] = {0}, key[32] = {0};
    assert_int_equal(bt_dist_rendezvous("127.0.0.1", ntohs(a.sin_port), 1, 2, d, key, blob, NID, 1, NULL),
                     BT_ERR_TIMEOUT);
    assert_non_null(strstr(bt_last_error(), "sent no challenge"));
    close(fd);
}

int main(void) {
    signal(SIGPIPE, SIG_DFL); /* the module must not need SIGPIPE ignored */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_env_single, save_env, restore_env),
        cmocka_unit_test_setup_teardown(test_env_torchrun_and_slurm, save_env, restore_env),
        cmocka_unit_test_setup_teardown(test_env_errors, save_env, restore_env),
        cmocka_unit_test_setup_teardown(test_master_and_hostlist, save_env, restore_env),
        cmocka_unit_test_setup_teardown(test_secret, save_env, restore_env),
        cmocka_unit_test_setup_teardown(test_slurm_cpus, save_env, restore_env),
        cmocka_unit_test(test_digest),
        cmocka_unit_test(test_world1_noop),
        cmocka_unit_test(test_world3),
        cmocka_unit_test(test_parent_is_peer),
        cmocka_unit_test(test_digest_mismatch),
        cmocka_unit_test(test_out_of_range_and_wrong_world),
        cmocka_unit_test(test_hostile_clients),
        cmocka_unit_test(test_other_secret),
        cmocka_unit_test(test_fake_rank0),
        cmocka_unit_test(test_duplicate_rank),
        cmocka_unit_test(test_timeout_rank0),
        cmocka_unit_test(test_timeout_rank0_partial),
        cmocka_unit_test(test_timeout_peer),
        cmocka_unit_test(test_timeout_peer_silent_rank0),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
