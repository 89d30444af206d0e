/* The authenticated TCP rendezvous of a data-parallel run (trainer/parallel/dist.h bt_dist_rendezvous):
 * rank 0 challenges every connection, only a hello that proves the job secret (HMAC-SHA256, RFC
 * 2104, OpenSSL) counts, and the reply carrying rank 0's blob (the NCCL id) is sealed with
 * AES-256-GCM (NIST SP 800-38D, OpenSSL EVP) under a key fresh to the connection, which also
 * proves rank 0 to the peer. Wire format: trainer/parallel/dist.h. */
#include "trainer/parallel/dist.h"

#include <errno.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "trainer/parallel/dist_wire.h"

#define NONCE 32
#define CHALLENGE_SIZE (8 + 4 + NONCE)                              /* magic, version, nonce0 */
#define HELLO_BODY (8 + 4 + 4 + 4 + 4 + BT_DIST_HOST_MAX + 32 + NONCE) /* up to the MAC */
#define HELLO_SIZE (HELLO_BODY + 32)
#define REPLY_HDR (8 + 4 + 4 + 16) /* magic, status, len, GCM tag */
#define REPLY_MAX (BT_DIST_BLOB_MAX + 4 + BT_DIST_HOST_MAX)
#define UNSEALED 0x80000000u /* status bit: plain-text refusal of an unauthenticated hello */
#define MAX_PENDING 64
#define MAX_DROP_WARN 8
static const uint8_t MAGIC[8] = {'B', 'T', 'D', 'I', 'S', 'T', '0', '2'};

/* ---------------------------------------------------------------- crypto -------------------- */

/* out = HMAC-SHA256(key, label || a || b). */
static void mac3(const uint8_t key[BT_DIST_KEY_BYTES], const char *label, const uint8_t *a, size_t na,
                 const uint8_t *b, size_t nb, uint8_t out[32]) {
    uint8_t buf[64 + NONCE + HELLO_BODY];
    size_t nl = strlen(label), n = 0;
    memcpy(buf, label, nl);
    n += nl;
    memcpy(buf + n, a, na);
    n += na;
    if (nb) memcpy(buf + n, b, nb);
    n += nb;
    unsigned len = 32;
    HMAC(EVP_sha256(), key, BT_DIST_KEY_BYTES, buf, n, out, &len);
}

/* AES-256-GCM with the 32-byte key k and a zero 96-bit IV (every connection has its own key, used
 * for one message), the 16-byte reply header prefix as additional data. seal: ct = E(pt), tag out;
 * open: pt = D(ct) and 0 only when the tag verifies. n <= REPLY_MAX. */
static int gcm(int seal, const uint8_t k[32], const uint8_t *aad, const uint8_t *in, size_t n, uint8_t *out,
               uint8_t tag[16]) {
    static const uint8_t iv[12] = {0};
    EVP_CIPHER_CTX *c = EVP_CIPHER_CTX_new();
    int ok = c != NULL, len = 0;
    ok = ok && (seal ? EVP_EncryptInit_ex(c, EVP_aes_256_gcm(), NULL, k, iv)
                     : EVP_DecryptInit_ex(c, EVP_aes_256_gcm(), NULL, k, iv)) == 1;
    ok = ok && (seal ? EVP_EncryptUpdate(c, NULL, &len, aad, 16) : EVP_DecryptUpdate(c, NULL, &len, aad, 16)) == 1;
    if (ok && n)
        ok = (seal ? EVP_EncryptUpdate(c, out, &len, in, (int)n) : EVP_DecryptUpdate(c, out, &len, in, (int)n)) == 1;
    if (ok && !seal) ok = EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_GCM_SET_TAG, 16, tag) == 1;
    uint8_t fin[16];
    ok = ok && (seal ? EVP_EncryptFinal_ex(c, fin, &len) : EVP_DecryptFinal_ex(c, fin, &len)) == 1;
    if (ok && seal) ok = EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_GCM_GET_TAG, 16, tag) == 1;
    EVP_CIPHER_CTX_free(c);
    return ok ? 0 : -1;
}

/* The per-connection reply key: HMAC(job key, "reply" || nonce0 || nonce1). */
static void reply_key(const uint8_t *key, const uint8_t *n0, const uint8_t *n1, uint8_t out[32]) {
    mac3(key, "BTDIST02 reply", n0, NONCE, n1, NONCE, out);
}

static int fill_random(uint8_t *p, size_t n) {
    while (n) {
        ssize_t k = getrandom(p, n, 0);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return bt_fail(BT_ERR_IO, "dist: getrandom: %s", strerror(errno));
        p += k;
        n -= (size_t)k;
    }
    return 0;
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

/* One reply {magic, status, len, tag, payload}: sealed under k (k != NULL), else plain with
 * status | UNSEALED and a zero tag. 0 or xfer_all's code. */
static int send_reply(int fd, const uint8_t *k, uint32_t status, const void *payload, size_t len,
                      double deadline) {
    uint8_t b[REPLY_HDR + REPLY_MAX];
    if (len > REPLY_MAX) len = REPLY_MAX;
    memcpy(b, MAGIC, 8);
    bt_put32(b + 8, k ? status : status | UNSEALED);
    bt_put32(b + 12, (uint32_t)len);
    memset(b + 16, 0, 16);
    if (k) {
        if (gcm(1, k, b, payload, len, b + REPLY_HDR, b + 16)) return BT_ERR_IO;
    } else if (len) {
        memcpy(b + REPLY_HDR, payload, len);
    }
    return xfer_all(fd, b, REPLY_HDR + len, deadline, 1);
}

static void hex8(const uint8_t *d, char out[17]) {
    for (int i = 0; i < 8; i++) snprintf(out + 2 * i, 3, "%02x", d[i]);
}

static void host_name(char out[BT_DIST_HOST_MAX]) {
    memset(out, 0, BT_DIST_HOST_MAX);
    if (gethostname(out, BT_DIST_HOST_MAX - 1)) snprintf(out, BT_DIST_HOST_MAX, "?");
    out[BT_DIST_HOST_MAX - 1] = 0;
}

/* A name received from a peer, made printable (NUL-terminated, control bytes -> '?'). */
static void clean_name(char *s, size_t n) {
    s[n - 1] = 0;
    for (size_t i = 0; s[i]; i++)
        if ((unsigned char)s[i] < 0x20 || (unsigned char)s[i] > 0x7e) s[i] = '?';
}

static bt_dist_link *link_new(int rank, int world) {
    bt_dist_link *l = bt_xcalloc(1, sizeof *l);
    l->rank = rank;
    l->world = world;
    l->fd = bt_xmalloc(sizeof *l->fd * (size_t)world);
    l->pid = bt_xcalloc((size_t)world, sizeof *l->pid);
    l->host = bt_xcalloc((size_t)world, sizeof *l->host);
    for (int r = 0; r < world; r++) l->fd[r] = -1;
    return l;
}

void bt_dist_link_free(bt_dist_link *l) {
    if (!l) return;
    for (int r = 0; r < l->world; r++)
        if (l->fd[r] >= 0) close(l->fd[r]);
    free(l->fd);
    free(l->pid);
    free(l->host);
    free(l);
}

/* ---------------------------------------------------------------- rank 0 --------------------- */

typedef struct { /* a connection that has not said a full, authenticated hello yet */
    int fd;
    size_t got;
    double since;
    char peer[72];
    uint8_t nonce[NONCE]; /* the challenge sent to it */
    uint8_t buf[HELLO_SIZE];
} conn;

typedef struct {
    const char *addr;
    const uint8_t *digest, *key;
    int port, world, lfd, joined, dropped, refused_auth, rejected, npend;
    double deadline;
    int *rfd;            /* [world]: the connection of each rank that said hello, -1 if none */
    uint8_t (*rkey)[32]; /* [world]: the reply key of each joined rank's connection */
    bt_dist_link *link;  /* pid / host of each joined rank */
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
        if (fam[f] == AF_INET6) setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
        int rc = fam[f] == AF_INET6 ? bind(fd, (struct sockaddr *)&a6, sizeof a6)
                                    : bind(fd, (struct sockaddr *)&a4, sizeof a4);
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
        /* the challenge: 44 bytes always fit a fresh socket's send buffer */
        uint8_t ch[CHALLENGE_SIZE];
        int rc = fill_random(c->nonce, NONCE);
        if (rc) return rc;
        memcpy(ch, MAGIC, 8);
        bt_put32(ch + 8, BT_DIST_VERSION);
        memcpy(ch + 12, c->nonce, NONCE);
        if (send(fd, ch, sizeof ch, MSG_NOSIGNAL | MSG_DONTWAIT) != (ssize_t)sizeof ch)
            drop(s, s->npend - 1, "could not send the challenge");
    }
    return 0;
}

/* pend[i] is authenticated: refuse it (sealed), and fail the run unless `soft`. */
static int refuse(server *s, int i, const uint8_t *k, const char *why, int soft, uint32_t r) {
    conn *c = &s->pend[i];
    (void)send_reply(c->fd, k, (uint32_t)-BT_ERR_INVALID, why, strlen(why), bt_now() + 0.2);
    int rc = soft ? 0 : bt_fail(BT_ERR_INVALID, "dist: rank 0: refused rank %u (from %s): %s", r, c->peer, why);
    if (soft) {
        s->rejected++;
        bt_log(BT_LOG_WARN, "dist", "rank 0: refused a hello from %s: %s", c->peer, why);
    }
    pend_remove(s, i, 1);
    return rc;
}

/* A complete hello in pend[i]: drop (bad version or proof), join, refuse (duplicate), or fail the
 * run (an authenticated rank of a different job). */
static int on_hello(server *s, int i) {
    conn *c = &s->pend[i];
    uint32_t ver = bt_get32(c->buf + 8), r = bt_get32(c->buf + 12), w = bt_get32(c->buf + 16);
    char why[200] = "", a[17], b[17];
    if (ver != BT_DIST_VERSION) {
        snprintf(why, sizeof why, "protocol version %u, rank 0 speaks %u", ver, BT_DIST_VERSION);
        drop(s, i, why);
        return 0;
    }
    uint8_t mac[32], k[32];
    mac3(s->key, "BTDIST02 hello", c->nonce, NONCE, c->buf, HELLO_BODY, mac);
    if (CRYPTO_memcmp(mac, c->buf + HELLO_BODY, 32) != 0) {
        static const char m[] = "authentication failed: this process does not hold the job's secret "
                                "(BT_DIST_SECRET or dist.secret_file must be the same on every rank)";
        (void)send_reply(c->fd, NULL, (uint32_t)-BT_ERR_INVALID, m, sizeof m - 1, bt_now() + 0.2);
        s->refused_auth++;
        drop(s, i, "failed authentication (no proof of the job secret); ignored");
        return 0;
    }
    const uint8_t *digest = c->buf + 24 + BT_DIST_HOST_MAX, *nonce1 = digest + 32;
    reply_key(s->key, c->nonce, nonce1, k);
    if (w != (uint32_t)s->world) {
        snprintf(why, sizeof why, "its world size %u differs from rank 0's %d", w, s->world);
    } else if (r == 0 || r >= w) {
        snprintf(why, sizeof why, "its rank is out of range [1, %d)", s->world);
    } else if (memcmp(digest, s->digest, 32)) {
        hex8(digest, a);
        hex8(s->digest, b);
        snprintf(why, sizeof why, "its config digest %s... differs from rank 0's %s... (a different job)", a, b);
    } else if (s->rfd[r] >= 0) {
        snprintf(why, sizeof why, "rank %u already joined; this second hello is refused", r);
        return refuse(s, i, k, why, 1, r);
    } else {
        s->rfd[r] = c->fd;
        memcpy(s->rkey[r], k, 32);
        s->link->pid[r] = (int32_t)bt_get32(c->buf + 20);
        memcpy(s->link->host[r], c->buf + 24, BT_DIST_HOST_MAX);
        clean_name(s->link->host[r], BT_DIST_HOST_MAX);
        bt_log(BT_LOG_DEBUG, "dist", "rank 0: rank %u (pid %d on %s) joined from %s", r, s->link->pid[r],
               s->link->host[r], c->peer);
        s->joined++;
        pend_remove(s, i, 0);
        return 0;
    }
    return refuse(s, i, k, why, 0, r);
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

/* Until every rank has joined, the deadline passes, or an authenticated rank of another job
 * fails the run. */
static int gather(server *s, int timeout_s) {
    struct pollfd *pf = bt_xmalloc(sizeof *pf * (size_t)(1 + MAX_PENDING + s->world));
    int *pr = bt_xmalloc(sizeof *pr * (size_t)s->world); /* pf index -> rank, for joined entries */
    int rc = 0;
    while (s->joined < s->world - 1) {
        int ms = ms_left(s->deadline);
        if (!ms) {
            char m[320];
            missing_ranks(s, m, sizeof m);
            rc = bt_fail(BT_ERR_TIMEOUT,
                         "dist: rank 0: timed out after %d s at %s:%d: %s (%d stray connections dropped, %d "
                         "of them without the job secret)",
                         timeout_s, s->addr, s->port, m, s->dropped, s->refused_auth);
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
    return rc;
}

/* Success: the sealed blob (+ rank 0's pid and host) to every rank. Failure (or a send failing):
 * the reason to every joined rank not yet served, so it fails now rather than at its deadline. */
static int serve(server *s, int rc, const uint8_t *blob, size_t blob_len) {
    uint8_t pay[REPLY_MAX];
    if (blob_len) memcpy(pay, blob, blob_len);
    bt_put32(pay + blob_len, (uint32_t)getpid());
    host_name((char *)pay + blob_len + 4);
    char msg[BT_DIST_BLOB_MAX] = "";
    for (int r = 1; r < s->world; r++) {
        if (s->rfd[r] < 0) continue;
        int e = rc ? 0 : send_reply(s->rfd[r], s->rkey[r], 0, pay, blob_len + 4 + BT_DIST_HOST_MAX, s->deadline);
        if (e)
            rc = bt_fail(e, "dist: rank 0: rank %d went away before it got the blob (%s)", r,
                         e == BT_ERR_TIMEOUT ? "send timed out" : strerror(errno));
        if (!rc) continue;
        if (!msg[0]) snprintf(msg, sizeof msg, "rendezvous failed on rank 0: %s", bt_last_error());
        (void)send_reply(s->rfd[r], s->rkey[r], (uint32_t)-rc, msg, strlen(msg), bt_now() + 0.2);
    }
    return rc;
}

static int run_rank0(const char *addr, int port, int world, const uint8_t *digest, const uint8_t *key,
                     const uint8_t *blob, size_t blob_len, int timeout_s, double deadline, bt_dist_link **link) {
    server s = {.addr = addr ? addr : "*", .port = port, .world = world, .digest = digest, .key = key,
                .deadline = deadline};
    int rc = listen_on(port, &s.lfd);
    if (rc) return rc;
    s.rfd = bt_xmalloc(sizeof *s.rfd * (size_t)world);
    s.rkey = bt_xcalloc((size_t)world, sizeof *s.rkey);
    s.link = link_new(0, world);
    s.link->pid[0] = (int32_t)getpid();
    host_name(s.link->host[0]);
    for (int r = 0; r < world; r++) s.rfd[r] = -1;
    rc = serve(&s, gather(&s, timeout_s), blob, blob_len);
    close(s.lfd); /* no connection is accepted after the rendezvous */
    for (int i = 0; i < s.npend; i++) close(s.pend[i].fd);
    for (int r = 0; r < world; r++) {
        if (s.rfd[r] < 0) continue;
        if (!rc && link) s.link->fd[r] = s.rfd[r]; /* handed to the monitor */
        else close(s.rfd[r]);
    }
    if (!rc && link) *link = s.link;
    else bt_dist_link_free(s.link);
    OPENSSL_cleanse(s.rkey, sizeof *s.rkey * (size_t)world);
    free(s.rkey);
    free(s.rfd);
    if (s.dropped || s.rejected)
        bt_log(BT_LOG_INFO, "dist", "rank 0: %d stray connections dropped (%d without the job secret), %d "
               "duplicate hellos refused", s.dropped, s.refused_auth, s.rejected);
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

typedef struct {
    const char *addr;
    int port, rank, world, timeout_s;
    const uint8_t *digest, *key;
    uint8_t *blob;
    size_t blob_len;
    double deadline;
    bt_dist_link *link;
} peer;

/* The reply after the hello: rank 0's sealed blob, a sealed refusal, or a plain refusal of our
 * proof. k: the connection's reply key. */
static int read_reply(int fd, const peer *p, const uint8_t *k) {
    uint8_t h[REPLY_HDR], ct[REPLY_MAX], pay[REPLY_MAX + 1];
    int rc = xfer_all(fd, h, REPLY_HDR, p->deadline, 0);
    if (rc == BT_ERR_TIMEOUT)
        return bt_fail(rc,
                       "dist: rank %d: connected to rank 0 at %s:%d, but it did not answer within %d s "
                       "(still waiting for other ranks?)",
                       p->rank, p->addr, p->port, p->timeout_s);
    if (rc)
        return bt_fail(rc, "dist: rank %d: rank 0 at %s:%d closed the connection before replying (%s)", p->rank,
                       p->addr, p->port, strerror(errno));
    uint32_t status = bt_get32(h + 8), len = bt_get32(h + 12);
    if (memcmp(h, MAGIC, 8) || len > REPLY_MAX)
        return bt_fail(BT_ERR_FORMAT, "dist: rank %d: malformed reply from %s:%d (not a BarqTrain rank 0?)",
                       p->rank, p->addr, p->port);
    if ((rc = xfer_all(fd, ct, len, p->deadline, 0)))
        return bt_fail(rc, "dist: rank %d: reply from rank 0 at %s:%d cut short", p->rank, p->addr, p->port);
    if (status & UNSEALED) { /* unauthenticated: only ever a refusal of our proof */
        memcpy(pay, ct, len);
        pay[len] = 0;
        clean_name((char *)pay, len + 1);
        return bt_fail(BT_ERR_INVALID, "dist: rank %d: rank 0 at %s:%d refused it: %s", p->rank, p->addr, p->port,
                       (char *)pay);
    }
    if (gcm(0, k, h, ct, len, pay, h + 16))
        return bt_fail(BT_ERR_INVALID,
                       "dist: rank %d: the reply from %s:%d failed authentication: that process is not this "
                       "job's rank 0 (another job on the port, or a different job secret)",
                       p->rank, p->addr, p->port);
    if (status == 0 && len != p->blob_len + 4 + BT_DIST_HOST_MAX)
        return bt_fail(BT_ERR_FORMAT, "dist: rank %d: rank 0 sent a %u-byte reply, this rank expects a %zu-byte "
                       "blob", p->rank, len, p->blob_len);
    if (status == 0) {
        if (p->blob_len) memcpy(p->blob, pay, p->blob_len);
        p->link->pid[0] = (int32_t)bt_get32(pay + p->blob_len);
        memcpy(p->link->host[0], pay + p->blob_len + 4, BT_DIST_HOST_MAX);
        clean_name(p->link->host[0], BT_DIST_HOST_MAX);
        return 0;
    }
    pay[len] = 0;
    clean_name((char *)pay, len + 1);
    int code = -(int)(status & 0xff);
    if (status > 16 || code == 0) code = BT_ERR_INVALID;
    return bt_fail(code, "dist: rank %d: rank 0 at %s:%d refused it: %s", p->rank, p->addr, p->port, (char *)pay);
}

/* Challenge, proof, reply on a connected socket. */
static int exchange(int fd, const peer *p) {
    uint8_t ch[CHALLENGE_SIZE], hello[HELLO_SIZE], k[32];
    int rc = xfer_all(fd, ch, sizeof ch, p->deadline, 0);
    if (rc == BT_ERR_TIMEOUT)
        return bt_fail(rc, "dist: rank %d: %s:%d accepted the connection but sent no challenge within %d s (not a "
                       "BarqTrain rank 0?)", p->rank, p->addr, p->port, p->timeout_s);
    if (rc) return bt_fail(rc, "dist: rank %d: %s:%d closed the connection before its challenge", p->rank, p->addr,
                           p->port);
    if (memcmp(ch, MAGIC, 8) || bt_get32(ch + 8) != BT_DIST_VERSION)
        return bt_fail(BT_ERR_FORMAT, "dist: rank %d: %s:%d does not speak this rendezvous (protocol version %u "
                       "expected)", p->rank, p->addr, p->port, BT_DIST_VERSION);
    memset(hello, 0, sizeof hello);
    memcpy(hello, MAGIC, 8);
    bt_put32(hello + 8, BT_DIST_VERSION);
    bt_put32(hello + 12, (uint32_t)p->rank);
    bt_put32(hello + 16, (uint32_t)p->world);
    bt_put32(hello + 20, (uint32_t)getpid());
    host_name((char *)hello + 24);
    uint8_t *digest = hello + 24 + BT_DIST_HOST_MAX, *nonce1 = digest + 32;
    memcpy(digest, p->digest, 32);
    if ((rc = fill_random(nonce1, NONCE))) return rc;
    mac3(p->key, "BTDIST02 hello", ch + 12, NONCE, hello, HELLO_BODY, hello + HELLO_BODY);
    if ((rc = xfer_all(fd, hello, sizeof hello, p->deadline, 1)))
        return bt_fail(rc, "dist: rank %d: could not send its hello to %s:%d", p->rank, p->addr, p->port);
    reply_key(p->key, ch + 12, nonce1, k);
    rc = read_reply(fd, p, k);
    OPENSSL_cleanse(k, sizeof k);
    return rc;
}

static int run_peer(peer *p) {
    char ps[16], last[160] = "no attempt made";
    snprintf(ps, sizeof ps, "%d", p->port);
    for (int attempt = 0;; attempt++) {
        if (attempt && !ms_left(p->deadline))
            return bt_fail(BT_ERR_TIMEOUT,
                           "dist: rank %d: could not reach rank 0 at %s:%d within %d s (last error: %s)",
                           p->rank, p->addr, p->port, p->timeout_s, last);
        struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *ai = NULL;
        int g = getaddrinfo(p->addr, ps, &hints, &ai), fd = -1;
        if (g == EAI_AGAIN || g == EAI_NONAME) /* DNS not ready yet, or not yet known: retry */
            snprintf(last, sizeof last, "resolving %s: %s", p->addr, gai_strerror(g));
        else if (g)
            return bt_fail(BT_ERR_INVALID, "dist: rank %d: cannot resolve rank 0's address %s: %s", p->rank,
                           p->addr, g == EAI_SYSTEM ? strerror(errno) : gai_strerror(g));
        for (struct addrinfo *a = ai; a && fd < 0; a = a->ai_next)
            fd = try_connect(a, p->deadline, last, sizeof last);
        if (ai) freeaddrinfo(ai);
        if (fd >= 0) {
            int rc = exchange(fd, p);
            if (!rc && p->link) {
                p->link->fd[0] = fd; /* handed to the monitor */
                return 0;
            }
            close(fd);
            /* the connection closed before rank 0 answered it: a flood of stray connections made
             * rank 0 drop it (the oldest pending go first), or rank 0 is gone: connect again until
             * the deadline */
            if (rc != BT_ERR_CLOSED) return rc;
            snprintf(last, sizeof last, "%s", bt_last_error());
        }
        int ms = 100 + (p->rank * 37 + attempt * 53) % 101, left = ms_left(p->deadline); /* 100-200 ms */
        if (left < ms) ms = left;
        struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
        nanosleep(&ts, NULL); /* EINTR: the loop re-checks the deadline */
    }
}

int bt_dist_rendezvous(const char *addr, int port, int rank, int world, const uint8_t digest[32],
                       const uint8_t key[BT_DIST_KEY_BYTES], uint8_t *blob, size_t blob_len, int timeout_s,
                       bt_dist_link **link) {
    if (link) *link = NULL;
    if (world < 1 || world > BT_DIST_MAX_WORLD)
        return bt_fail(BT_ERR_INVALID, "dist: world size %d out of [1, %d]", world, BT_DIST_MAX_WORLD);
    if (rank < 0 || rank >= world) return bt_fail(BT_ERR_INVALID, "dist: rank %d out of [0, %d)", rank, world);
    if (world == 1) return 0;
    if (!digest || !key || blob_len > BT_DIST_BLOB_MAX || (!blob && blob_len) || port < 1 || port > 65535 ||
        timeout_s < 1 || (rank && (!addr || !*addr)))
        return bt_fail(BT_ERR_INVALID,
                       "dist: bad rendezvous arguments: digest %s, key %s, blob %s of %zu bytes (at most %d), port "
                       "%d (1-65535), timeout %d s (>= 1), rank 0's address %s",
                       digest ? "given" : "NULL", key ? "given" : "NULL", blob ? "given" : "NULL", blob_len,
                       BT_DIST_BLOB_MAX, port, timeout_s, addr && *addr ? addr : "missing");
    double t0 = bt_now(), deadline = t0 + timeout_s;
    int rc;
    if (rank == 0) {
        rc = run_rank0(addr, port, world, digest, key, blob, blob_len, timeout_s, deadline, link);
    } else {
        peer p = {.addr = addr, .port = port, .rank = rank, .world = world, .timeout_s = timeout_s,
                  .digest = digest, .key = key, .blob = blob, .blob_len = blob_len, .deadline = deadline,
                  .link = link_new(rank, world)};
        p.link->pid[rank] = (int32_t)getpid();
        host_name(p.link->host[rank]);
        rc = run_peer(&p);
        if (!rc && link) *link = p.link;
        else bt_dist_link_free(p.link);
    }
    if (!rc)
        bt_log(BT_LOG_INFO, "dist", "rendezvous of %d ranks at %s:%d in %.2f s (authenticated)", world,
               addr ? addr : "*", port, bt_now() - t0);
    return rc;
}
