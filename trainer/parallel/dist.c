/* Distributed-training bootstrap: environment discovery, the job secret, and the Slurm CPU
 * share (trainer/parallel/dist.h). The rendezvous is trainer/parallel/dist_rdv.c, the monitor dist_monitor.c. */
#include "trainer/parallel/dist.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "common/rng.h"

/* ---------------------------------------------------------------- environment ---------------- */

/* Plain decimal integer in [0, INT_MAX]; BT_ERR_INVALID naming the variable otherwise. */
static int parse_int(const char *name, const char *v, int *out) {
    if (!*v) return bt_fail(BT_ERR_INVALID, "dist: %s is set but empty", name);
    if (v[0] == '-' && v[1] >= '0' && v[1] <= '9')
        return bt_fail(BT_ERR_INVALID, "dist: %s=\"%.64s\" is negative", name, v);
    for (const char *p = v; *p; p++)
        if (*p < '0' || *p > '9')
            return bt_fail(BT_ERR_INVALID, "dist: %s=\"%.64s\" is not a plain decimal integer", name, v);
    errno = 0;
    long x = strtol(v, NULL, 10);
    if (errno || x > INT_MAX) return bt_fail(BT_ERR_INVALID, "dist: %s=\"%.64s\" is too large", name, v);
    *out = (int)x;
    return 0;
}

int bt_dist_env_resolve(bt_dist_env *e) {
    static const char *const names[2][3] = {{"RANK", "WORLD_SIZE", "LOCAL_RANK"},
                                            {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"}};
    static const char *const sources[2] = {"torchrun", "slurm"};
    bt_dist_env r = {.rank = 0, .world = 1, .local_rank = 0, .source = "single"};
    for (int s = 0; s < 2; s++) {
        const char *const *n = names[s];
        const char *rv = getenv(n[0]), *wv = getenv(n[1]), *lv = getenv(n[2]);
        if (!rv && !wv) continue;
        if (!wv) return bt_fail(BT_ERR_INVALID, "dist: %s=\"%.64s\" is set but %s is not", n[0], rv, n[1]);
        if (!rv) return bt_fail(BT_ERR_INVALID, "dist: %s=\"%.64s\" is set but %s is not", n[1], wv, n[0]);
        int rc;
        if ((rc = parse_int(n[1], wv, &r.world)) || (rc = parse_int(n[0], rv, &r.rank))) return rc;
        if (r.world < 1)
            return bt_fail(BT_ERR_INVALID, "dist: %s=\"%s\": the world size must be >= 1", n[1], wv);
        if (r.world > BT_DIST_MAX_WORLD)
            return bt_fail(BT_ERR_INVALID, "dist: %s=\"%s\" exceeds the largest world size %d", n[1], wv,
                           BT_DIST_MAX_WORLD);
        if (r.rank >= r.world)
            return bt_fail(BT_ERR_INVALID, "dist: %s=\"%s\" is not below %s=\"%s\"", n[0], rv, n[1], wv);
        r.local_rank = s == 0 ? r.rank : 0;
        if (lv) {
            if ((rc = parse_int(n[2], lv, &r.local_rank))) return rc;
            if (r.local_rank >= r.world)
                return bt_fail(BT_ERR_INVALID, "dist: %s=\"%s\" is not below %s=\"%s\"", n[2], lv, n[1], wv);
        }
        snprintf(r.source, sizeof r.source, "%s", sources[s]);
        break;
    }
    *e = r;
    return 0;
}

int bt_dist_first_host(const char *nodelist, char *out, size_t out_size) {
    char h[256];
    size_t k = 0;
    const char *p = nodelist ? nodelist : "", *why = NULL;
    while (!why && *p && *p != ',' && k < sizeof h - 1) {
        if (*p == ']') { why = "unbalanced ']'"; break; }
        if (*p != '[') { h[k++] = *p++; continue; }
        const char *first = ++p; /* the first element of the range list: up to ',', '-' or ']' */
        while (*p && !strchr(",-[]", *p) && k < sizeof h - 1) h[k++] = *p++;
        if (p == first) why = "empty range";
        while (!why && *p && *p != ']')
            if (*p++ == '[') why = "nested '['";
        if (!why && !*p++) why = "unbalanced '['";
    }
    if (!why && k == 0) why = "no first host";
    if (!why && (k >= sizeof h - 1 || k + 1 > out_size)) why = "host name too long";
    if (why) return bt_fail(BT_ERR_INVALID, "dist: host list \"%.64s\": %s", nodelist ? nodelist : "", why);
    memcpy(out, h, k);
    out[k] = 0;
    return 0;
}

int bt_dist_master_resolve(const bt_dist_env *e, const char *cfg_addr, int cfg_port, char *addr,
                           size_t addr_size, int *port) {
    const char *a = getenv("MASTER_ADDR"), *pv = getenv("MASTER_PORT");
    int rc, p = cfg_port >= 1 && cfg_port <= 65535 ? cfg_port : BT_DIST_DEFAULT_PORT;
    if (pv && (rc = parse_int("MASTER_PORT", pv, &p))) return rc;
    if (p < 1 || p > 65535)
        return bt_fail(BT_ERR_INVALID, "dist: MASTER_PORT=\"%s\" is not a port in [1, 65535]", pv);
    if (!a || !*a) {
        const char *nl = getenv("SLURM_STEP_NODELIST");
        if (!nl) nl = getenv("SLURM_JOB_NODELIST");
        if (e && e->world > 1 && !strcmp(e->source, "slurm") && nl) {
            if (!(rc = bt_dist_first_host(nl, addr, addr_size))) *port = p;
            return rc;
        }
        a = cfg_addr && *cfg_addr ? cfg_addr : "127.0.0.1";
    }
    if (strlen(a) + 1 > addr_size) return bt_fail(BT_ERR_INVALID, "dist: address \"%.64s...\" is too long", a);
    memcpy(addr, a, strlen(a) + 1);
    *port = p;
    return 0;
}

/* ---------------------------------------------------------------- digest --------------------- */

void bt_dist_digest(const void *data, size_t n, uint8_t out[32]) {
    const uint8_t *p = data;
    uint64_t h[4];
    for (int i = 0; i < 4; i++) h[i] = bt_hash64(BT_FNV64_INIT + (uint64_t)i * 0x100000001b3ULL);
    for (size_t off = 0; off < n; off += 8) {
        uint64_t w = 0;
        size_t m = n - off < 8 ? n - off : 8;
        for (size_t j = 0; j < m; j++) w |= (uint64_t)p[off + j] << (8 * j);
        h[0] = bt_hash64(h[0] ^ w);
        for (int i = 1; i < 4; i++) h[i] = bt_hash64(h[i] ^ ((w << (16 * i)) | (w >> (64 - 16 * i))));
    }
    for (int i = 0; i < 4; i++) {
        uint64_t x = bt_hash64(h[i] ^ (uint64_t)n ^ ((uint64_t)i << 62));
        for (int j = 0; j < 8; j++) out[8 * i + j] = (uint8_t)(x >> (8 * j));
    }
}

/* ---------------------------------------------------------------- job secret ----------------- */

/* key = HMAC-SHA256(secret, label): every rank derives the same key from the same secret. */
static int derive(const uint8_t *secret, size_t n, uint8_t key[BT_DIST_KEY_BYTES]) {
    static const char label[] = "BarqTrain dist job key v2";
    unsigned len = BT_DIST_KEY_BYTES;
    if (!HMAC(EVP_sha256(), secret, (int)n, (const uint8_t *)label, sizeof label - 1, key, &len))
        return bt_fail(BT_ERR_IO, "dist: HMAC-SHA256 failed (OpenSSL)");
    return 0;
}

/* The secret's text without trailing whitespace (a file written by echo ends in a newline). */
static size_t trimmed(const char *s, size_t n) {
    while (n && (s[n - 1] == '\n' || s[n - 1] == '\r' || s[n - 1] == ' ' || s[n - 1] == '\t')) n--;
    return n;
}

static int load_file(const char *path, uint8_t key[BT_DIST_KEY_BYTES]) {
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY);
    if (fd < 0)
        return bt_fail(BT_ERR_IO, "dist: dist.secret_file %s: %s", path, strerror(errno));
    struct stat st;
    char buf[BT_DIST_SECRET_MAX + 2];
    int rc = 0;
    ssize_t n = 0;
    if (fstat(fd, &st)) {
        rc = bt_fail(BT_ERR_IO, "dist: dist.secret_file %s: %s", path, strerror(errno));
    } else if (!S_ISREG(st.st_mode)) {
        rc = bt_fail(BT_ERR_INVALID, "dist: dist.secret_file %s is not a regular file", path);
    } else if (st.st_uid != geteuid()) {
        rc = bt_fail(BT_ERR_INVALID, "dist: dist.secret_file %s belongs to uid %u, not to this user (uid %u): "
                     "a job secret must be a file only you control", path, (unsigned)st.st_uid,
                     (unsigned)geteuid());
    } else if (st.st_mode & 077) {
        rc = bt_fail(BT_ERR_INVALID, "dist: dist.secret_file %s is readable or writable by others (mode %04o): "
                     "chmod 600 %s", path, (unsigned)(st.st_mode & 07777), path);
    } else {
        size_t got = 0;
        while (got < sizeof buf && (n = read(fd, buf + got, sizeof buf - got)) > 0) got += (size_t)n;
        if (n < 0) rc = bt_fail(BT_ERR_IO, "dist: dist.secret_file %s: %s", path, strerror(errno));
        else if (got > BT_DIST_SECRET_MAX)
            rc = bt_fail(BT_ERR_INVALID, "dist: dist.secret_file %s is longer than %d bytes", path,
                         BT_DIST_SECRET_MAX);
        else if ((got = trimmed(buf, got)) < BT_DIST_SECRET_MIN)
            rc = bt_fail(BT_ERR_INVALID, "dist: dist.secret_file %s holds %zu bytes, at least %d are needed "
                         "(e.g. head -c 32 /dev/urandom | base64 > %s; chmod 600 %s)", path, got,
                         BT_DIST_SECRET_MIN, path, path);
        else rc = derive((const uint8_t *)buf, got, key);
    }
    OPENSSL_cleanse(buf, sizeof buf);
    close(fd);
    return rc;
}

int bt_dist_key_load(const char *secret_file, uint8_t key[BT_DIST_KEY_BYTES], char *source, size_t source_size) {
    if (secret_file && *secret_file) {
        int rc = load_file(secret_file, key);
        if (!rc && source) snprintf(source, source_size, "dist.secret_file %s", secret_file);
        return rc;
    }
    const char *e = getenv("BT_DIST_SECRET");
    if (!e || !*e)
        return bt_fail(BT_ERR_INVALID,
                       "dist: several ranks need a job secret for their rendezvous: set BT_DIST_SECRET to the "
                       "same random string (>= %d bytes) on every rank (scripts/train.sbatch makes one per job), "
                       "or dist.secret_file to a file only you can read",
                       BT_DIST_SECRET_MIN);
    size_t n = trimmed(e, strlen(e));
    if (n < BT_DIST_SECRET_MIN || n > BT_DIST_SECRET_MAX)
        return bt_fail(BT_ERR_INVALID, "dist: BT_DIST_SECRET has %zu bytes; it needs %d to %d (e.g. export "
                       "BT_DIST_SECRET=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'))", n,
                       BT_DIST_SECRET_MIN, BT_DIST_SECRET_MAX);
    if (source) snprintf(source, source_size, "BT_DIST_SECRET");
    return derive((const uint8_t *)e, n, key);
}

/* ---------------------------------------------------------------- Slurm CPU share ------------ */

/* Tasks on node `node` of a Slurm tasks-per-node list ("2(x3),1": nodes 0-2 run 2, node 3 runs 1);
 * 0 when the list cannot be read or is too short. */
static long tasks_on_node(const char *list, long node) {
    const char *p = list;
    while (*p) {
        char *end;
        long n = strtol(p, &end, 10), rep = 1;
        if (end == p || n < 1) return 0;
        p = end;
        if (*p == '(') {
            if (p[1] != 'x') return 0;
            rep = strtol(p + 2, &end, 10);
            if (end == p + 2 || *end != ')' || rep < 1) return 0;
            p = end + 1;
        }
        if (node < rep) return n;
        node -= rep;
        if (*p == ',') p++;
        else if (*p) return 0;
    }
    return 0;
}

static long env_long(const char *name) {
    const char *v = getenv(name);
    if (!v || !*v) return 0;
    char *end;
    long x = strtol(v, &end, 10);
    return *end || x < 1 || x > 1 << 20 ? 0 : x;
}

int bt_dist_slurm_cpus(char *how, size_t how_size) {
    if (!getenv("SLURM_JOB_ID")) return 0;
    long cpt = env_long("SLURM_CPUS_PER_TASK");
    if (cpt > 0) {
        if (how) snprintf(how, how_size, "SLURM_CPUS_PER_TASK=%ld", cpt);
        return (int)cpt;
    }
    long node_cpus = env_long("SLURM_CPUS_ON_NODE"), node = 0;
    const char *nid = getenv("SLURM_NODEID"), *tpn = getenv("SLURM_STEP_TASKS_PER_NODE");
    if (!tpn) tpn = getenv("SLURM_TASKS_PER_NODE");
    if (nid && *nid) node = strtol(nid, NULL, 10);
    long tasks = tpn ? tasks_on_node(tpn, node) : 1;
    if (node_cpus < 1 || tasks < 1) return 0;
    long share = node_cpus / tasks > 0 ? node_cpus / tasks : 1;
    if (how) snprintf(how, how_size, "SLURM_CPUS_ON_NODE=%ld / %ld task(s) on this node", node_cpus, tasks);
    return (int)share;
}
