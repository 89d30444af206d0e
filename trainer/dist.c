/* Distributed-training bootstrap: environment discovery and the TCP rendezvous (trainer/dist.h). */
#include "trainer/dist.h"

#include <errno.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "common/rng.h"

#define HELLO_SIZE 52 /* magic 8, version 4, rank 4, world 4, digest 32 */
#define REPLY_HDR 16  /* magic 8, status 4, len 4 */
#define MAX_PENDING 64
#define MAX_DROP_WARN 8
static const uint8_t MAGIC[8] = {'B', 'T', 'D', 'I', 'S', 'T', '0', '1'};

static void put32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t get32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

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

/* ---------------------------------------------------------------- socket helpers ------------- */

/* Milliseconds left before deadline, rounded up; 0 once it has passed. */
static int ms_left(double deadline) {
    double r = (deadline - bt_now()) * 1000.0;
    if (r <= 0) return 0;
    return r >= INT_MAX - 1 ? INT_MAX : (int)r + 1;
}

/* Send / receive exactly n bytes on a non-blocking socket before deadline: 0, BT_ERR_TIMEOUT, or
 * BT_ERR_CLOSED (peer closed / reset; errno kept). */
static int xfer_all(int fd, uint8_t *buf, size_t n, double deadline, int sending) {
    while (n) {
        ssize_t k = sending ? send(fd, buf, n, MSG_NOSIGNAL | MSG_DONTWAIT) : recv(fd, buf, n, MSG_DONTWAIT);
        if (k > 0) { buf += k; n -= (size_t)k; continue; }
        if (k < 0 && errno == EINTR) continue;
        if (k == 0) errno = ECONNRESET; /* orderly close before the end */
        if (k == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) return BT_ERR_CLOSED;
        int ms = ms_left(deadline);
        if (!ms) return BT_ERR_TIMEOUT;
        struct pollfd pf = {.fd = fd, .events = sending ? POLLOUT : POLLIN};
        (void)poll(&pf, 1, ms); /* EINTR or readiness: go round */
    }
    return 0;
}

/* One reply {magic, status, len, payload}; 0 or xfer_all's code. */
static int send_reply(int fd, uint32_t status, const void *payload, size_t len, double deadline) {
    uint8_t b[REPLY_HDR + BT_DIST_BLOB_MAX];
    if (len > BT_DIST_BLOB_MAX) len = BT_DIST_BLOB_MAX;
    memcpy(b, MAGIC, 8);
    put32(b + 8, status);
    put32(b + 12, (uint32_t)len);
    if (len) memcpy(b + REPLY_HDR, payload, len);
    return xfer_all(fd, b, REPLY_HDR + len, deadline, 1);
}

static void send_error(int fd, int err, const char *msg) {
    (void)send_reply(fd, (uint32_t)-err, msg, strlen(msg), bt_now() + 0.2);
}

static void hex8(const uint8_t *d, char out[17]) {
    for (int i = 0; i < 8; i++) snprintf(out + 2 * i, 3, "%02x", d[i]);
}

/* ---------------------------------------------------------------- rank 0 --------------------- */

typedef struct { /* a connection that has not said a full hello yet */
    int fd;
    size_t got;
    double since;
    char peer[72];
    uint8_t buf[HELLO_SIZE];
} conn;

typedef struct {
    const char *addr;
    const uint8_t *digest;
    int port, world, lfd, joined, dropped, rejected, npend;
    double deadline;
    int *rfd; /* [world]: the connection of each rank that said hello, -1 if none */
    conn pend[MAX_PENDING];
} server;

static void peer_name(const struct sockaddr *sa, socklen_t sl, char *out, size_t n) {
    char h[NI_MAXHOST], s[NI_MAXSERV];
    if (getnameinfo(sa, sl, h, sizeof h, s, sizeof s, NI_NUMERICHOST | NI_NUMERICSERV))
        snprintf(out, n, "?");
    else
        snprintf(out, n, "%.56s:%.8s", strncmp(h, "::ffff:", 7) ? h : h + 7, s);
}

static void pend_remove(server *s, int i, int close_fd) {
    if (close_fd) close(s->pend[i].fd);
    s->pend[i] = s->pend[--s->npend];
}

static void drop(server *s, int i, const char *why) {
    s->dropped++;
    bt_log(s->dropped <= MAX_DROP_WARN ? BT_LOG_WARN : BT_LOG_DEBUG, "dist",
           "rank 0: dropped a connection from %s: %s", s->pend[i].peer, why);
    pend_remove(s, i, 1);
}

static int listen_on(int port, int *out) {
    int fam[2] = {AF_INET6, AF_INET}, err = 0;
    for (int f = 0; f < 2; f++) {
        int fd = socket(fam[f], SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0), one = 1, zero = 0;
        if (fd < 0) { err = errno; continue; }
        struct sockaddr_in6 a6 = {.sin6_family = AF_INET6, .sin6_port = htons((uint16_t)port)};
        struct sockaddr_in a4 = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
        a6.sin6_addr = in6addr_any; /* and a4 is INADDR_ANY (0) */
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (f == 0) setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero); /* dual stack */
        int rc = f == 0 ? bind(fd, (struct sockaddr *)&a6, sizeof a6) : bind(fd, (struct sockaddr *)&a4, sizeof a4);
        if (rc == 0 && listen(fd, SOMAXCONN) == 0) { *out = fd; return 0; }
        err = errno;
        close(fd);
        if (err == EADDRINUSE || err == EACCES) break; /* IPv4 would fail the same way */
    }
    return bt_fail(BT_ERR_IO, "dist: rank 0 cannot listen on TCP port %d: %s", port, strerror(err));
}

static int accept_some(server *s) {
    for (int n = 0; n < MAX_PENDING; n++) {
        struct sockaddr_storage ss;
        socklen_t sl = sizeof ss;
        int fd = accept4(s->lfd, (struct sockaddr *)&ss, &sl, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO) continue;
            if (errno == EMFILE || errno == ENFILE)
                return bt_fail(BT_ERR_IO,
                               "dist: rank 0: accept: %s (it holds one connection per rank: a world of %d "
                               "needs about %d file descriptors, see ulimit -n)",
                               strerror(errno), s->world, s->world + MAX_PENDING + 8);
            return 0; /* EAGAIN, or a transient error: poll again */
        }
        if (s->npend == MAX_PENDING) { /* drop the oldest silent connection */
            int old = 0;
            for (int i = 1; i < s->npend; i++)
                if (s->pend[i].since < s->pend[old].since) old = i;
            drop(s, old, "too many connections pending; oldest dropped");
        }
        conn *c = &s->pend[s->npend++];
        *c = (conn){.fd = fd, .since = bt_now()};
        peer_name((struct sockaddr *)&ss, sl, c->peer, sizeof c->peer);
    }
    return 0;
}

/* A complete hello in pend[i]: join, reject (duplicate), drop (bad version), or fail the run. */
static int on_hello(server *s, int i) {
    conn *c = &s->pend[i];
    uint32_t ver = get32(c->buf + 8), r = get32(c->buf + 12), w = get32(c->buf + 16);
    char why[200] = "", a[17], b[17];
    if (ver != BT_DIST_VERSION) {
        snprintf(why, sizeof why, "protocol version %u, rank 0 speaks %u", ver, BT_DIST_VERSION);
        drop(s, i, why);
        return 0;
    }
    if (w != (uint32_t)s->world) {
        snprintf(why, sizeof why, "its world size %u differs from rank 0's %d", w, s->world);
    } else if (r == 0 || r >= w) {
        snprintf(why, sizeof why, "its rank is out of range [1, %d)", s->world);
    } else if (memcmp(c->buf + 20, s->digest, 32)) {
        hex8(c->buf + 20, a);
        hex8(s->digest, b);
        snprintf(why, sizeof why, "its config digest %s... differs from rank 0's %s... (a different job)", a, b);
    } else if (s->rfd[r] >= 0) {
        snprintf(why, sizeof why, "rank %u already joined; this second hello is refused", r);
        send_error(c->fd, BT_ERR_INVALID, why);
        s->rejected++;
        bt_log(BT_LOG_WARN, "dist", "rank 0: refused a hello from %s: %s", c->peer, why);
        pend_remove(s, i, 1);
        return 0;
    } else {
        s->rfd[r] = c->fd;
        bt_log(BT_LOG_DEBUG, "dist", "rank 0: rank %u joined from %s", r, c->peer);
        s->joined++;
        pend_remove(s, i, 0);
        return 0;
    }
    send_error(c->fd, BT_ERR_INVALID, why);
    int rc = bt_fail(BT_ERR_INVALID, "dist: rank 0: refused rank %u (from %s): %s", r, c->peer, why);
    pend_remove(s, i, 1);
    return rc;
}

static int on_pending(server *s, int i) {
    conn *c = &s->pend[i];
    ssize_t k = recv(c->fd, c->buf + c->got, HELLO_SIZE - c->got, MSG_DONTWAIT);
    if (k < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
    if (k < 0) { drop(s, i, strerror(errno)); return 0; }
    if (k == 0) { drop(s, i, c->got ? "closed after a partial hello" : "closed without a hello"); return 0; }
    c->got += (size_t)k;
    if (memcmp(c->buf, MAGIC, c->got < 8 ? c->got : 8)) { drop(s, i, "bad magic (not a BarqTrain rank)"); return 0; }
    return c->got == HELLO_SIZE ? on_hello(s, i) : 0;
}

/* A joined rank's connection became readable: it closed (or broke the protocol). Forget it. */
static void on_joined(server *s, int r) {
    uint8_t x;
    ssize_t k = recv(s->rfd[r], &x, 1, MSG_DONTWAIT);
    if (k < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) return;
    bt_log(BT_LOG_WARN, "dist", "rank 0: rank %d %s before the rendezvous completed; waiting for it again", r,
           k > 0 ? "sent unexpected data" : "went away");
    close(s->rfd[r]);
    s->rfd[r] = -1;
    s->joined--;
}

/* "3 of 4 ranks never arrived: 1,3-4" into out (n >= 64), "..." when it does not fit. */
static void missing_ranks(const server *s, char *out, size_t n) {
    size_t len =
        (size_t)snprintf(out, n, "%d of %d ranks never arrived:", s->world - 1 - s->joined, s->world - 1);
    char sep = ' ';
    for (int r = 1; r < s->world; r++) {
        if (s->rfd[r] >= 0) continue;
        int e = r;
        while (e + 1 < s->world && s->rfd[e + 1] < 0) e++;
        if (len + 32 >= n) {
            snprintf(out + len, n - len, "%c...", sep);
            return;
        }
        len += (size_t)(e > r ? snprintf(out + len, n - len, "%c%d-%d", sep, r, e)
                              : snprintf(out + len, n - len, "%c%d", sep, r));
        sep = ',';
        r = e;
    }
}

static int serve(server *s, const uint8_t *blob, size_t blob_len, int timeout_s) {
    struct pollfd *pf = bt_xmalloc(sizeof *pf * (size_t)(1 + MAX_PENDING + s->world));
    int *pr = bt_xmalloc(sizeof *pr * (size_t)s->world); /* pf index -> rank, for joined entries */
    int rc = 0;
    while (s->joined < s->world - 1) {
        int ms = ms_left(s->deadline);
        if (!ms) {
            char m[320];
            missing_ranks(s, m, sizeof m);
            rc = bt_fail(BT_ERR_TIMEOUT,
                         "dist: rank 0: timed out after %d s at %s:%d: %s (%d stray connections dropped)",
                         timeout_s, s->addr, s->port, m, s->dropped);
            break;
        }
        int np = s->npend, n = 0;
        pf[n++] = (struct pollfd){.fd = s->lfd, .events = POLLIN};
        for (int i = 0; i < np; i++) pf[n++] = (struct pollfd){.fd = s->pend[i].fd, .events = POLLIN};
        int nj = 0;
        for (int r = 1; r < s->world; r++)
            if (s->rfd[r] >= 0) {
                pr[nj++] = r;
                pf[n++] = (struct pollfd){.fd = s->rfd[r], .events = POLLIN};
            }
        int k = poll(pf, (nfds_t)n, ms);
        if (k < 0 && errno != EINTR) {
            rc = bt_fail(BT_ERR_IO, "dist: rank 0: poll: %s", strerror(errno));
            break;
        }
        if (k <= 0) continue;
        for (int j = 0; j < nj; j++)
            if (pf[1 + np + j].revents) on_joined(s, pr[j]);
        /* Backwards: pend_remove moves the last entry into the hole, and that one is done. */
        for (int i = np - 1; i >= 0 && !rc; i--)
            if (pf[1 + i].revents) rc = on_pending(s, i);
        if (!rc && (pf[0].revents & POLLIN)) rc = accept_some(s);
        if (rc) break;
    }
    free(pf);
    free(pr);
    /* Success: the blob to every rank. Failure (or a send failing): the reason to every joined rank
     * not yet served, so it fails now rather than at its own deadline. */
    char msg[BT_DIST_BLOB_MAX] = "";
    for (int r = 1; r < s->world; r++) {
        if (s->rfd[r] < 0) continue;
        int e = rc ? 0 : send_reply(s->rfd[r], 0, blob, blob_len, s->deadline);
        if (e)
            rc = bt_fail(e, "dist: rank 0: rank %d went away before it got the blob (%s)", r,
                         e == BT_ERR_TIMEOUT ? "send timed out" : strerror(errno));
        if (!rc) continue;
        if (!msg[0]) snprintf(msg, sizeof msg, "rendezvous failed on rank 0: %s", bt_last_error());
        send_error(s->rfd[r], rc, msg);
    }
    return rc;
}

static int run_rank0(const char *addr, int port, int world, const uint8_t *digest, const uint8_t *blob,
                     size_t blob_len, int timeout_s, double deadline) {
    server s = {
        .addr = addr ? addr : "*", .port = port, .world = world, .digest = digest, .deadline = deadline};
    int rc = listen_on(port, &s.lfd);
    if (rc) return rc;
    s.rfd = bt_xmalloc(sizeof *s.rfd * (size_t)world);
    for (int r = 0; r < world; r++) s.rfd[r] = -1;
    rc = serve(&s, blob, blob_len, timeout_s);
    close(s.lfd);
    for (int i = 0; i < s.npend; i++) close(s.pend[i].fd);
    for (int r = 0; r < world; r++)
        if (s.rfd[r] >= 0) close(s.rfd[r]);
    free(s.rfd);
    if (s.dropped || s.rejected)
        bt_log(BT_LOG_INFO, "dist", "rank 0: %d stray connections dropped, %d duplicate hellos refused",
               s.dropped, s.rejected);
    return rc;
}

/* ---------------------------------------------------------------- other ranks ---------------- */

/* Non-blocking connect to one address, waiting at most 5 s (and never past deadline). */
static int try_connect(const struct addrinfo *ai, double deadline, char *last, size_t n) {
    int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol), err = 0;
    if (fd < 0) { snprintf(last, n, "socket: %s", strerror(errno)); return -1; }
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) return fd;
    err = errno;
    if (err == EINPROGRESS) {
        double until = bt_now() + 5.0 < deadline ? bt_now() + 5.0 : deadline;
        struct pollfd pf = {.fd = fd, .events = POLLOUT};
        int k, ms;
        while ((ms = ms_left(until)) > 0 && (k = poll(&pf, 1, ms)) <= 0)
            if (k < 0 && errno != EINTR) break;
        socklen_t sl = sizeof err;
        if (!(pf.revents & (POLLOUT | POLLERR | POLLHUP)))
            err = ETIMEDOUT;
        else if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &sl))
            err = errno;
        if (!err) return fd;
    }
    snprintf(last, n, "%s", strerror(err));
    close(fd);
    return -1;
}

static int exchange(int fd, const char *addr, int port, int rank, const uint8_t *hello, uint8_t *blob,
                    size_t blob_len, int timeout_s, double deadline) {
    uint8_t h[REPLY_HDR], pay[BT_DIST_BLOB_MAX + 1];
    int rc = xfer_all(fd, (uint8_t *)hello, HELLO_SIZE, deadline, 1);
    if (!rc) rc = xfer_all(fd, h, REPLY_HDR, deadline, 0);
    if (rc == BT_ERR_TIMEOUT)
        return bt_fail(rc,
                       "dist: rank %d: connected to rank 0 at %s:%d, but it did not answer within %d s "
                       "(still waiting for other ranks?)",
                       rank, addr, port, timeout_s);
    if (rc)
        return bt_fail(rc, "dist: rank %d: rank 0 at %s:%d closed the connection before replying (%s)", rank,
                       addr, port, strerror(errno));
    uint32_t status = get32(h + 8), len = get32(h + 12);
    if (memcmp(h, MAGIC, 8) || len > BT_DIST_BLOB_MAX)
        return bt_fail(BT_ERR_FORMAT, "dist: rank %d: malformed reply from %s:%d (not a BarqTrain rank 0?)",
                       rank, addr, port);
    if ((rc = xfer_all(fd, pay, len, deadline, 0)))
        return bt_fail(rc, "dist: rank %d: reply from rank 0 at %s:%d cut short", rank, addr, port);
    if (status == 0 && len != blob_len)
        return bt_fail(BT_ERR_FORMAT, "dist: rank %d: rank 0 sent a %u-byte blob, this rank expects %zu", rank,
                       len, blob_len);
    if (status == 0) { if (len) memcpy(blob, pay, len); return 0; }
    for (uint32_t i = 0; i < len; i++)
        if (pay[i] < 0x20 || pay[i] > 0x7e) pay[i] = '?';
    pay[len] = 0;
    int code = -(int)(status & 0xff);
    if (status > 16 || code == 0) code = BT_ERR_INVALID;
    return bt_fail(code, "dist: rank %d: rank 0 at %s:%d refused it: %s", rank, addr, port, (char *)pay);
}

static int run_peer(const char *addr, int port, int rank, int world, const uint8_t *digest, uint8_t *blob,
                    size_t blob_len, int timeout_s, double deadline) {
    uint8_t hello[HELLO_SIZE];
    memcpy(hello, MAGIC, 8);
    put32(hello + 8, BT_DIST_VERSION);
    put32(hello + 12, (uint32_t)rank);
    put32(hello + 16, (uint32_t)world);
    memcpy(hello + 20, digest, 32);
    char ps[16], last[160] = "no attempt made";
    snprintf(ps, sizeof ps, "%d", port);
    for (int attempt = 0;; attempt++) {
        if (attempt && !ms_left(deadline))
            return bt_fail(BT_ERR_TIMEOUT,
                           "dist: rank %d: could not reach rank 0 at %s:%d within %d s (last error: %s)",
                           rank, addr, port, timeout_s, last);
        struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *ai = NULL;
        int g = getaddrinfo(addr, ps, &hints, &ai), fd = -1;
        if (g == EAI_AGAIN || g == EAI_NONAME) /* DNS not ready yet, or not yet known: retry */
            snprintf(last, sizeof last, "resolving %s: %s", addr, gai_strerror(g));
        else if (g)
            return bt_fail(BT_ERR_INVALID, "dist: rank %d: cannot resolve rank 0's address %s: %s", rank,
                           addr, g == EAI_SYSTEM ? strerror(errno) : gai_strerror(g));
        for (struct addrinfo *p = ai; p && fd < 0; p = p->ai_next)
            fd = try_connect(p, deadline, last, sizeof last);
        if (ai) freeaddrinfo(ai);
        if (fd >= 0) {
            int rc = exchange(fd, addr, port, rank, hello, blob, blob_len, timeout_s, deadline);
            close(fd);
            return rc;
        }
        int ms = 100 + (rank * 37 + attempt * 53) % 101, left = ms_left(deadline); /* 100-200 ms */
        if (left < ms) ms = left;
        struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
        nanosleep(&ts, NULL); /* EINTR: the loop re-checks the deadline */
    }
}

int bt_dist_rendezvous(const char *addr, int port, int rank, int world, const uint8_t digest[32],
                       uint8_t *blob, size_t blob_len, int timeout_s) {
    if (world < 1 || world > BT_DIST_MAX_WORLD)
        return bt_fail(BT_ERR_INVALID, "dist: world size %d out of [1, %d]", world, BT_DIST_MAX_WORLD);
    if (rank < 0 || rank >= world) return bt_fail(BT_ERR_INVALID, "dist: rank %d out of [0, %d)", rank, world);
    if (world == 1) return 0;
    if (!digest || blob_len > BT_DIST_BLOB_MAX || (!blob && blob_len) || port < 1 || port > 65535 ||
        timeout_s < 1 || (rank && (!addr || !*addr)))
        return bt_fail(BT_ERR_INVALID,
                       "dist: bad rendezvous arguments: digest %s, blob %s of %zu bytes (at most %d), port %d "
                       "(1-65535), timeout %d s (>= 1), rank 0's address %s",
                       digest ? "given" : "NULL", blob ? "given" : "NULL", blob_len, BT_DIST_BLOB_MAX, port,
                       timeout_s, addr && *addr ? addr : "missing");
    double t0 = bt_now(), deadline = t0 + timeout_s;
    int rc = rank == 0 ? run_rank0(addr, port, world, digest, blob, blob_len, timeout_s, deadline)
                       : run_peer(addr, port, rank, world, digest, blob, blob_len, timeout_s, deadline);
    if (!rc)
        bt_log(BT_LOG_INFO, "dist", "rendezvous of %d ranks at %s:%d in %.2f s", world, addr ? addr : "*",
               port, bt_now() - t0);
    return rc;
}
