/* Trainer-side client of loaderd's control socket (contract: proto/client.h, proto/PROTOCOL.md).
 * Uses jansson for the JSON lines, recvmsg(2) with SCM_RIGHTS (unix(7)) for the ring memfd.
 * Reconnection: while waiting on an empty ring, the socket is polled for a hang-up (POLLRDHUP,
 * non-consuming, so a report on another thread is undisturbed); when loaderd is gone the client
 * attaches again with the resume_state of the last batch it handed out (proto/PROTOCOL.md §2). */
#include "proto/client.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "common/bt_vec.h"
#include "common/bt_json.h"

#define CLIENT_MAX_LINE (1u << 20)
#define CLIENT_ATTACH_TIMEOUT_MS 120000 /* loaderd may be loading a large tokenizer */
#define CLIENT_REPLY_TIMEOUT_MS 5000
#define CLIENT_REFUSAL_WAIT_MS 2000    /* a refusal is already queued when our send fails */
#define CLIENT_PEEK_SLICE_MS 200       /* how often an idle wait looks at the socket */
#define CLIENT_CLOSED_GRACE_MS 3000    /* producer closed: wait this long for the hang-up */
#define CLIENT_RECONNECT_DEFAULT_S 60.0

struct bt_client {
    int sock;
    bt_ring ring;
    uint32_t job_id, B, T;
    int32_t vocab;    /* from the attach reply; <= 0 when loaderd did not say */
    int holding;      /* a peeked slot not yet released */
    int ended;        /* END_OF_DATA seen */
    int have_step;
    uint64_t next_step;
    char *buf;        /* received bytes not yet consumed as lines */
    size_t len, cap;
    /* what a re-attach needs */
    char *sock_path;
    char *job_text;   /* the job spec with absolute paths, as first sent */
    int rank, world;
    char *run;        /* the attach's "run", or NULL */
    int have_resume;  /* resume holds the state to re-attach with (else: from the start) */
    uint8_t resume[BT_RESUME_STATE_BYTES];
    int resume_world; /* the world size resume was written by, until a batch replaces it (0: world) */
    double reconnect_s;
    uint64_t reconnects;
    pthread_mutex_t mu; /* the socket and buf: report vs. reconnect vs. close */
    int reconnecting;   /* under mu: a reconnect owns sock/buf/job_id; report fails fast */
    /* the frozen base, sent with reports once set (bt_client_set_base) */
    int have_base;
    char base_dtype[BT_CLIENT_BASE_DTYPE_MAX + 1], base_types[BT_CLIENT_BASE_TYPES_MAX + 1];
    double base_bpw;
    uint64_t base_bytes;
};

/* Send all of `s` (MSG_NOSIGNAL: a dead loaderd must not SIGPIPE the trainer). */
static int send_all(int fd, const char *s, size_t n) {
    while (n) {
        ssize_t w = send(fd, s, n, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR) continue;
            return bt_fail(BT_ERR_IO, "loaderd socket: send: %s", strerror(errno));
        }
        s += w;
        n -= (size_t)w;
    }
    return BT_OK;
}

static int send_json(int fd, json_t *msg) {
    char *text = json_dumps(msg, JSON_COMPACT);
    if (!text) return bt_fail(BT_ERR_NOMEM, "loaderd socket: cannot encode request");
    size_t n = strlen(text);
    int rc = send_all(fd, text, n);
    if (!rc) rc = send_all(fd, "\n", 1);
    free(text);
    return rc;
}

/* Read one '\n'-terminated line (returned malloc'd, without the newline) within timeout_ms.
 * When fd_out is not NULL, the first descriptor passed with SCM_RIGHTS while reading is stored
 * there (others are closed); *fd_out stays -1 when none came. */
static int read_line(bt_client *c, int timeout_ms, char **line, int *fd_out) {
    double deadline = bt_now() + timeout_ms / 1000.0;
    for (;;) {
        char *nl = c->len ? memchr(c->buf, '\n', c->len) : NULL;
        if (nl) {
            size_t n = (size_t)(nl - c->buf);
            *line = bt_xmalloc(n + 1);
            memcpy(*line, c->buf, n);
            (*line)[n] = 0;
            memmove(c->buf, nl + 1, c->len - n - 1);
            c->len -= n + 1;
            return BT_OK;
        }
        if (c->len >= CLIENT_MAX_LINE) return bt_fail(BT_ERR_FORMAT, "loaderd reply longer than %u bytes", CLIENT_MAX_LINE);
        int left = (int)((deadline - bt_now()) * 1000.0);
        if (left <= 0) return bt_fail(BT_ERR_TIMEOUT, "no reply from loaderd within %d ms", timeout_ms);
        struct pollfd p = {.fd = c->sock, .events = POLLIN};
        int pr = poll(&p, 1, left);
        if (pr < 0 && errno != EINTR) return bt_fail(BT_ERR_IO, "loaderd socket: poll: %s", strerror(errno));
        if (pr <= 0) continue;
        if (c->cap - c->len < 4096) c->buf = bt_vec_xgrow(c->buf, &c->cap, c->len + 8192, 1);
        union {
            struct cmsghdr h;
            char b[CMSG_SPACE(sizeof(int) * 8)];
        } ctl;
        struct iovec iov = {.iov_base = c->buf + c->len, .iov_len = c->cap - c->len};
        struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.b, .msg_controllen = sizeof ctl.b};
        ssize_t r = recvmsg(c->sock, &m, MSG_CMSG_CLOEXEC);
        if (r < 0) {
            if (errno == EINTR || errno == EAGAIN) continue;
            return bt_fail(BT_ERR_IO, "loaderd socket: recvmsg: %s", strerror(errno));
        }
        for (struct cmsghdr *cm = CMSG_FIRSTHDR(&m); cm; cm = CMSG_NXTHDR(&m, cm)) {
            if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) continue;
            size_t nfd = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            int fds[8];
            memcpy(fds, CMSG_DATA(cm), nfd * sizeof(int) > sizeof fds ? sizeof fds : nfd * sizeof(int));
            for (size_t i = 0; i < nfd && i < 8; i++) {
                if (fd_out && *fd_out < 0) *fd_out = fds[i];
                else close(fds[i]);
            }
        }
        if (r == 0) return bt_fail(BT_ERR_CLOSED, "loaderd closed the connection");
        c->len += (size_t)r;
    }
}

/* Parse a reply line: an object with "v" == BT_PROTO_VERSION. ok:false becomes BT_ERR_INVALID
 * with loaderd's message. On success *out is the object (caller decrefs). */
static int parse_reply(const char *line, json_t **out) {
    json_error_t e;
    json_t *j = json_loads(line, JSON_REJECT_DUPLICATES, &e);
    if (!j || !json_is_object(j)) {
        json_decref(j);
        return bt_fail(BT_ERR_FORMAT, "loaderd reply is not a JSON object: %.80s", line);
    }
    json_t *v = json_object_get(j, "v");
    if (!json_is_integer(v) || json_integer_value(v) != BT_PROTO_VERSION) {
        json_decref(j);
        return bt_fail(BT_ERR_FORMAT, "loaderd reply has protocol version other than %d", BT_PROTO_VERSION);
    }
    if (!json_is_true(json_object_get(j, "ok"))) {
        const char *msg = json_string_value(json_object_get(j, "error"));
        int rc = bt_fail(BT_ERR_INVALID, "loaderd refused: %s", msg ? msg : "(no message)");
        json_decref(j);
        return rc;
    }
    *out = j;
    return BT_OK;
}

/* Our request could not be sent (EPIPE / ECONNRESET: loaderd refused this connection — not in
 * allowed_users, too many clients — wrote its reason and closed). Read that reason: the line is
 * already queued on our socket, so the wait ends at once with it or with EOF
 * (CLIENT_REFUSAL_WAIT_MS only bounds a loaderd that is hung). Returns BT_ERR_INVALID with
 * "loaderd refused: <reason>" when there is one, else send_rc with the send error. */
static int read_refusal(bt_client *c, int send_rc) {
    char why[1024];
    snprintf(why, sizeof why, "%s", bt_last_error());
    char *line = NULL;
    if (read_line(c, CLIENT_REFUSAL_WAIT_MS, &line, NULL) == BT_OK) {
        json_t *rep = NULL;
        int rc = parse_reply(line, &rep);
        free(line);
        json_decref(rep);
        if (rc == BT_ERR_INVALID) return rc; /* ok:false with loaderd's reason */
    }
    return bt_fail(send_rc, "%s", why);
}

static int get_u32(json_t *o, const char *key, uint32_t *out) {
    json_t *x = json_object_get(o, key);
    if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) > UINT32_MAX)
        return bt_fail(BT_ERR_FORMAT, "loaderd attach reply: \"%s\" missing or not a u32", key);
    *out = (uint32_t)json_integer_value(x);
    return BT_OK;
}

/* loaderd resolves paths in its own working directory, so relative "shards" patterns and the
 * "tokenizer" path are made absolute against the trainer's cwd before sending. */
static json_t *abs_path(const char *p, const char *cwd) {
    if (!p || p[0] == '/' || !cwd) return NULL;
    size_t n = strlen(cwd) + strlen(p) + 2;
    char *b = bt_xmalloc(n);
    snprintf(b, n, "%s/%s", cwd, p);
    json_t *s = json_string(b);
    free(b);
    return s;
}

static void absolutize_paths(json_t *job) {
    char *cwd = getcwd(NULL, 0);
    json_t *sh = json_object_get(job, "shards"), *x;
    size_t i;
    json_array_foreach(sh, i, x) {
        json_t *a = abs_path(json_string_value(x), cwd);
        if (a) json_array_set_new(sh, i, a);
    }
    json_t *a = abs_path(json_string_value(json_object_get(job, "tokenizer")), cwd);
    if (a) json_object_set_new(job, "tokenizer", a);
    free(cwd);
}

static void client_free(bt_client *c) {
    if (c->ring.hdr) bt_ring_close(&c->ring);
    if (c->sock >= 0) close(c->sock);
    free(c->buf);
    free(c->sock_path);
    free(c->job_text);
    free(c->run);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

/* Connect to c->sock_path, attach c->job_text (resume from c->resume when have_resume) and map
 * the ring. On success c->sock, c->ring, job_id, B, T, vocab are the new ones; on failure
 * c->sock is -1 and c->ring unmapped. Caller holds c->mu (or is the only user). */
static int do_attach(bt_client *c) {
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    strcpy(sa.sun_path, c->sock_path); /* length checked in bt_client_attach */
    c->len = 0;
    c->sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int rc;
    if (c->sock < 0) return bt_fail(BT_ERR_IO, "socket: %s", strerror(errno));
    if (connect(c->sock, (struct sockaddr *)&sa, sizeof sa) != 0) {
        rc = bt_fail(BT_ERR_IO, "connect %s: %s (is loaderd running?)", c->sock_path, strerror(errno));
        goto fail;
    }
    json_error_t e;
    json_t *job = json_loads(c->job_text, 0, &e);
    json_t *req = job ? json_pack("{s:i, s:s, s:o, s:i, s:i}", "v", BT_PROTO_VERSION, "op", "attach", "job", job,
                                  "rank", c->rank, "world_size", c->world)
                      : NULL;
    if (!req) {
        rc = bt_fail(BT_ERR_NOMEM, "attach: cannot encode the request");
        goto fail;
    }
    if (c->run) json_object_set_new(req, "run", json_string(c->run));
    if (c->have_resume) {
        char hex[2 * BT_RESUME_STATE_BYTES + 1];
        for (unsigned i = 0; i < BT_RESUME_STATE_BYTES; i++) snprintf(hex + 2 * i, 3, "%02x", c->resume[i]);
        json_object_set_new(req, "resume", json_string(hex));
        if (c->resume_world && c->resume_world != c->world)
            json_object_set_new(req, "resume_world", json_integer(c->resume_world));
    }
    rc = send_json(c->sock, req);
    json_decref(req);
    if (rc) { /* refused at accept and closed: the reason waits in our receive queue */
        rc = read_refusal(c, rc);
        goto fail;
    }
    char *line = NULL;
    int fd = -1;
    rc = read_line(c, CLIENT_ATTACH_TIMEOUT_MS, &line, &fd);
    if (rc) {
        if (fd >= 0) close(fd);
        goto fail;
    }
    json_t *rep = NULL;
    rc = parse_reply(line, &rep);
    free(line);
    if (rc) {
        if (fd >= 0) close(fd);
        goto fail;
    }
    uint32_t slots = 0, job_id = 0, B = 0, T = 0;
    if ((rc = get_u32(rep, "job_id", &job_id)) || (rc = get_u32(rep, "B", &B)) || (rc = get_u32(rep, "T", &T)) ||
        (rc = get_u32(rep, "slots", &slots))) {
        json_decref(rep);
        if (fd >= 0) close(fd);
        goto fail;
    }
    json_t *voc = json_object_get(rep, "vocab");
    int32_t vocab = json_is_integer(voc) && json_integer_value(voc) > 0 && json_integer_value(voc) <= INT32_MAX
                        ? (int32_t)json_integer_value(voc)
                        : 0;
    json_decref(rep);
    if (fd < 0) {
        rc = bt_fail(BT_ERR_FORMAT, "loaderd attach reply carried no ring descriptor");
        goto fail;
    }
    if (c->B && (B != c->B || T != c->T)) { /* a re-attach must not change the geometry under the caller */
        close(fd);
        rc = bt_fail(BT_ERR_FORMAT, "re-attach got batches of %ux%u, was %ux%u", B, T, c->B, c->T);
        goto fail;
    }
    if ((rc = bt_ring_attach(&c->ring, fd))) goto fail; /* fd owned (and closed on error) by attach */
    if (c->ring.B != B || c->ring.T != T || c->ring.n_slots != slots) {
        rc = bt_fail(BT_ERR_FORMAT, "ring geometry %ux%u x%u differs from the attach reply %ux%u x%u", c->ring.B,
                     c->ring.T, c->ring.n_slots, B, T, slots);
        bt_ring_close(&c->ring);
        memset(&c->ring, 0, sizeof c->ring);
        c->ring.fd = -1;
        goto fail;
    }
    c->job_id = job_id;
    c->B = B;
    c->T = T;
    c->vocab = vocab;
    return BT_OK;
fail:
    if (c->sock >= 0) close(c->sock);
    c->sock = -1;
    return rc;
}

int bt_client_attach(bt_client **out, const char *socket_path, const char *job_json, int rank, int world_size,
                     const uint8_t *resume_state) {
    return bt_client_attach_run(out, socket_path, job_json, rank, world_size, resume_state, NULL);
}

int bt_client_attach_run(bt_client **out, const char *socket_path, const char *job_json, int rank, int world_size,
                         const uint8_t *resume_state, const char *run) {
    return bt_client_attach_from(out, socket_path, job_json, rank, world_size, resume_state, 0, run);
}

int bt_client_attach_from(bt_client **out, const char *socket_path, const char *job_json, int rank, int world_size,
                          const uint8_t *resume_state, int resume_world, const char *run) {
    *out = NULL;
    if (!socket_path) socket_path = getenv("LOADERD_SOCKET") ? getenv("LOADERD_SOCKET") : BT_DEFAULT_SOCKET;
    struct sockaddr_un sa;
    if (strlen(socket_path) >= sizeof sa.sun_path)
        return bt_fail(BT_ERR_INVALID, "loaderd socket path too long (%zu bytes, max %zu): %s", strlen(socket_path),
                       sizeof sa.sun_path - 1, socket_path);
    json_t *job = NULL;
    if (bt_json_loadb(&job, job_json, job_json ? strlen(job_json) : 0, 0, "job spec") || !json_is_object(job)) {
        const char *why = job ? "not an object" : bt_last_error();
        int rc = bt_fail(BT_ERR_INVALID, "attach: job spec is not a JSON object (%s)", why);
        json_decref(job);
        return rc;
    }
    absolutize_paths(job);
    char *text = json_dumps(job, JSON_COMPACT);
    json_decref(job);
    if (!text) return bt_fail(BT_ERR_NOMEM, "attach: cannot encode the job spec");
    bt_client *c = bt_xcalloc(1, sizeof *c);
    pthread_mutex_init(&c->mu, NULL);
    c->ring.fd = -1;
    c->sock = -1;
    c->sock_path = bt_xstrdup(socket_path);
    c->job_text = text;
    c->rank = rank;
    c->world = world_size;
    c->run = run && *run ? bt_xstrdup(run) : NULL;
    if (resume_state) {
        memcpy(c->resume, resume_state, BT_RESUME_STATE_BYTES);
        c->have_resume = 1;
        c->resume_world = resume_world;
    }
    c->reconnect_s = CLIENT_RECONNECT_DEFAULT_S;
    const char *env = getenv("LOADERD_RECONNECT_S");
    if (env && *env) {
        char *end;
        double x = strtod(env, &end);
        if (*end == 0 && x >= 0 && x <= 86400 * 7) c->reconnect_s = x;
        else bt_log(BT_LOG_WARN, "client", "LOADERD_RECONNECT_S=%s is not seconds in [0, 604800]: using %.0f", env,
                    c->reconnect_s);
    }
    int rc = do_attach(c);
    if (rc) {
        client_free(c);
        return rc;
    }
    *out = c;
    return BT_OK;
}

/* Whether loaderd hung up the control socket (checked without consuming anything). */
static int loaderd_gone(bt_client *c, int wait_ms) {
    double deadline = bt_now() + wait_ms / 1000.0;
    for (;;) {
        if (c->sock < 0) return 1;
        struct pollfd p = {.fd = c->sock, .events = POLLRDHUP};
        int left = (int)((deadline - bt_now()) * 1000.0);
        int pr = poll(&p, 1, left > 50 ? 50 : left > 0 ? left : 0);
        if (pr > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL))) return 1;
        if (bt_now() >= deadline) return 0;
        if (pr > 0) { /* readable data only (a reply for the report thread): do not spin */
            struct timespec ts = {0, 20 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
    }
}

/* loaderd went away: drop the old socket and ring, attach again (retrying with backoff for up to
 * reconnect_s) from the state after the last batch handed out. */
static int reconnect(bt_client *c) {
    if (c->reconnect_s <= 0)
        return bt_fail(BT_ERR_CLOSED, "loaderd closed the stream of job %u (reconnecting disabled: "
                                      "LOADERD_RECONNECT_S=0)", c->job_id);
    /* mu is held only to hand sock/buf over: while `reconnecting` is set a report fails at once
     * with BT_ERR_CLOSED instead of waiting out the whole reconnect window under mu */
    pthread_mutex_lock(&c->mu);
    c->reconnecting = 1;
    uint32_t old_id = c->job_id;
    if (c->sock >= 0) close(c->sock);
    c->sock = -1;
    pthread_mutex_unlock(&c->mu);
    bt_log(BT_LOG_WARN, "client", "loaderd went away (job %u, next step %llu): reconnecting to %s for up to %.0f s",
           old_id, (unsigned long long)c->next_step, c->sock_path, c->reconnect_s);
    if (c->ring.hdr) bt_ring_close(&c->ring);
    memset(&c->ring, 0, sizeof c->ring);
    c->ring.fd = -1;
    double deadline = bt_now() + c->reconnect_s, backoff = 0.05;
    int rc;
    for (;;) {
        rc = do_attach(c);
        if (rc == BT_OK) break;
        double left = deadline - bt_now();
        if (left <= 0) break;
        double nap = backoff < left ? backoff : left;
        struct timespec ts = {(time_t)nap, (long)((nap - (double)(time_t)nap) * 1e9)};
        nanosleep(&ts, NULL);
        backoff = backoff * 2 > 1.0 ? 1.0 : backoff * 2;
    }
    if (rc == BT_OK) {
        c->reconnects++;
        bt_log(BT_LOG_INFO, "client", "re-attached to loaderd as job %u (was %u), continuing at step %llu", c->job_id,
               old_id, (unsigned long long)c->next_step);
    } else {
        rc = bt_fail(rc, "loaderd did not come back within %.0f s (LOADERD_RECONNECT_S): %s", c->reconnect_s,
                     bt_last_error());
    }
    pthread_mutex_lock(&c->mu);
    c->reconnecting = 0;
    pthread_mutex_unlock(&c->mu);
    return rc;
}

/* loaderd's account of why job c->job_id's stream stopped early, into buf[n]: "job failed: <its
 * error>" (or "job stopped" ...), from a `jobs` request on a fresh connection, asked while we are
 * still attached (the job leaves loaderd's list once we detach), as the Python client does
 * (python/barq_loaderd/client.py _job_outcome). "loaderd's job list unavailable (...)" or "the
 * job is no longer listed" otherwise. */
static void job_outcome(const bt_client *c, char *buf, size_t n) {
    bt_client q;
    memset(&q, 0, sizeof q);
    q.sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    strcpy(sa.sun_path, c->sock_path); /* length checked in bt_client_attach */
    json_t *req = json_pack("{s:i, s:s}", "v", BT_PROTO_VERSION, "op", "jobs"), *rep = NULL;
    char *line = NULL;
    int rc = q.sock < 0 ? bt_fail(BT_ERR_IO, "socket: %s", strerror(errno))
             : connect(q.sock, (struct sockaddr *)&sa, sizeof sa) != 0
                 ? bt_fail(BT_ERR_IO, "connect %s: %s", c->sock_path, strerror(errno))
                 : !req ? bt_fail(BT_ERR_NOMEM, "out of memory")
                        : send_json(q.sock, req);
    if (!rc) rc = read_line(&q, CLIENT_REPLY_TIMEOUT_MS, &line, NULL);
    if (!rc) rc = parse_reply(line, &rep);
    if (rc) {
        snprintf(buf, n, "loaderd's job list unavailable (%s)", bt_last_error());
    } else {
        snprintf(buf, n, "the job is no longer listed (see loaderd's log)");
        size_t i;
        json_t *j;
        json_array_foreach(json_object_get(rep, "jobs"), i, j) {
            json_t *id = json_object_get(j, "job_id");
            if (!json_is_integer(id) || json_integer_value(id) != (json_int_t)c->job_id) continue;
            const char *st = json_string_value(json_object_get(j, "state"));
            const char *err = json_string_value(json_object_get(j, "error"));
            snprintf(buf, n, "job %s%s%.900s", st ? st : "?", err ? ": " : "", err ? err : "");
            break;
        }
    }
    json_decref(rep);
    json_decref(req);
    free(line);
    free(q.buf);
    if (q.sock >= 0) close(q.sock);
}

int bt_client_next(bt_client *c, bt_batch_view *v, int timeout_ms) {
    if (c->holding) bt_client_release(c);
    if (c->ended) return 1;
    double deadline = timeout_ms >= 0 ? bt_now() + timeout_ms / 1000.0 : 0;
    void *slot;
    for (;;) {
        int slice = CLIENT_PEEK_SLICE_MS;
        if (timeout_ms >= 0) {
            int left = (int)((deadline - bt_now()) * 1000.0);
            if (left < 0) left = 0;
            if (left < slice) slice = left;
        }
        slot = c->ring.hdr ? bt_ring_consumer_peek(&c->ring, slice) : NULL;
        if (slot) break;
        int err = c->ring.hdr ? c->ring.err : BT_ERR_CLOSED;
        if (err == BT_ERR_TIMEOUT) {
            if (loaderd_gone(c, 0)) {
                int rc = reconnect(c);
                if (rc) return rc;
                continue;
            }
            if (timeout_ms >= 0 && bt_now() >= deadline)
                return bt_fail(BT_ERR_TIMEOUT, "no batch from loaderd within %d ms", timeout_ms);
            continue;
        }
        if (err == BT_ERR_CLOSED) {
            /* the producer stopped early: a loaderd that is going away hangs up right after */
            if (loaderd_gone(c, CLIENT_CLOSED_GRACE_MS)) {
                int rc = reconnect(c);
                if (rc) return rc;
                continue;
            }
            char why[1024];
            job_outcome(c, why, sizeof why);
            return bt_fail(BT_ERR_CLOSED, "loaderd closed the stream of job %u before its end: %s", c->job_id, why);
        }
        return err ? err : BT_ERR_IO;
    }
    c->holding = 1;
    bt_batch_view_init(v, slot, c->B, c->T);
    int eod = (v->hdr->flags & BT_BATCH_F_END_OF_DATA) != 0;
    if (eod) {
        if (v->hdr->magic != BT_BATCH_MAGIC) return bt_fail(BT_ERR_FORMAT, "end-of-data batch with a bad magic");
    } else {
        int rc = bt_batch_validate(v, c->B, c->T, c->vocab);
        if (rc) return rc;
    }
    /* END_OF_DATA carries the next step index and the job id like any batch */
    if (c->have_step && v->hdr->step != c->next_step)
        return bt_fail(BT_ERR_FORMAT, "%s step %llu out of order (want %llu)", eod ? "end-of-data batch" : "batch",
                       (unsigned long long)v->hdr->step, (unsigned long long)c->next_step);
    if (v->hdr->job_id != c->job_id)
        return bt_fail(BT_ERR_FORMAT, "%s carries job id %u (want %u)", eod ? "end-of-data batch" : "batch",
                       v->hdr->job_id, c->job_id);
    if (eod) {
        c->ended = 1;
        bt_client_release(c);
        return 1;
    }
    c->have_step = 1;
    c->next_step = v->hdr->step + 1;
    /* the state to re-attach with if loaderd goes away after this batch */
    memcpy(c->resume, v->hdr->resume_state, BT_RESUME_STATE_BYTES);
    c->have_resume = 1;
    c->resume_world = 0; /* a state of this world from now on */
    return 0;
}

void bt_client_release(bt_client *c) {
    if (!c->holding) return;
    c->holding = 0;
    bt_ring_consumer_release(&c->ring);
}

static int report_locked(bt_client *c, uint64_t step, double loss, double tokens_per_s);

int bt_client_report(bt_client *c, uint64_t step, double loss, double tokens_per_s) {
    pthread_mutex_lock(&c->mu);
    int rc = c->reconnecting ? bt_fail(BT_ERR_CLOSED, "report: loaderd went away; reconnecting")
                             : report_locked(c, step, loss, tokens_per_s);
    pthread_mutex_unlock(&c->mu);
    return rc;
}

uint64_t bt_client_reconnects(const bt_client *c) { return c->reconnects; }

/* copy s into dst[cap] (cut to cap-1 bytes), bytes outside [A-Za-z0-9_+.-] become '?' */
static void copy_token(char *dst, size_t cap, const char *s) {
    size_t n = 0;
    for (; s && s[n] && n + 1 < cap; n++) {
        const char ch = s[n];
        const int ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                       (ch >= '0' && ch <= '9') || ch == '_' || ch == '+' || ch == '.' || ch == '-';
        dst[n] = ok ? ch : '?';
    }
    dst[n] = 0;
}

void bt_client_set_base(bt_client *c, const char *dtype, const char *types,
                        double bits_per_weight, uint64_t bytes) {
    if (!c) return;
    copy_token(c->base_dtype, sizeof c->base_dtype, dtype);
    copy_token(c->base_types, sizeof c->base_types, types);
    c->base_bpw = isfinite(bits_per_weight) && bits_per_weight >= 0 && bits_per_weight <= 64
                      ? bits_per_weight : 0;
    c->base_bytes = bytes < (UINT64_C(1) << 53) ? bytes : (UINT64_C(1) << 53) - 1;
    c->have_base = c->base_dtype[0] != 0;
}

static int report_locked(bt_client *c, uint64_t step, double loss, double tokens_per_s) {
    if (c->sock < 0) return bt_fail(BT_ERR_IO, "report: not connected to loaderd");
    /* non-finite values (a diverged loss) travel as null: JSON has no NaN */
    json_t *req = json_pack("{s:i, s:s, s:I, s:I, s:o, s:o}", "v", BT_PROTO_VERSION, "op", "report", "job_id",
                            (json_int_t)c->job_id, "step", (json_int_t)step, "loss",
                            isfinite(loss) ? json_real(loss) : json_null(), "tokens_per_s",
                            isfinite(tokens_per_s) ? json_real(tokens_per_s) : json_null());
    if (!req) return bt_fail(BT_ERR_NOMEM, "report: cannot encode");
    if (c->have_base)
        json_object_set_new(req, "base",
                            json_pack("{s:s, s:s, s:f, s:I}", "dtype", c->base_dtype, "types",
                                      c->base_types[0] ? c->base_types : c->base_dtype,
                                      "bits_per_weight", c->base_bpw, "bytes",
                                      (json_int_t)c->base_bytes));
    int rc = send_json(c->sock, req);
    json_decref(req);
    if (rc) return rc;
    char *line = NULL;
    int fd = -1;
    rc = read_line(c, CLIENT_REPLY_TIMEOUT_MS, &line, &fd);
    if (fd >= 0) close(fd); /* never expected on a report */
    if (rc) return rc;
    json_t *rep = NULL;
    rc = parse_reply(line, &rep);
    free(line);
    json_decref(rep);
    return rc;
}

static int ref_put_locked(bt_client *c, const char *base, const bt_ref_value *v, size_t n, size_t *acc, size_t *rej) {
    if (c->sock < 0) return bt_fail(BT_ERR_IO, "ref_put: not connected to loaderd");
    json_t *vals = json_array();
    for (size_t i = 0; i < n && vals; i++)
        json_array_append_new(vals, json_pack("[i, i, i, f]", (int)v[i].src, (int)v[i].line, (int)v[i].side,
                                              isfinite(v[i].logp) ? v[i].logp : 1.0 /* refused by loaderd */));
    json_t *req = vals ? json_pack("{s:i, s:s, s:I, s:s, s:o}", "v", BT_PROTO_VERSION, "op", "ref_put", "job_id",
                                   (json_int_t)c->job_id, "base", base ? base : "", "values", vals)
                       : NULL;
    if (!req) return bt_fail(BT_ERR_NOMEM, "ref_put: cannot encode");
    int rc = send_json(c->sock, req);
    json_decref(req);
    if (rc) return rc;
    char *line = NULL;
    int fd = -1;
    rc = read_line(c, CLIENT_REPLY_TIMEOUT_MS, &line, &fd);
    if (fd >= 0) close(fd);
    if (rc) return rc;
    json_t *rep = NULL;
    rc = parse_reply(line, &rep);
    free(line);
    if (rc) return rc;
    json_t *a = json_object_get(rep, "accepted"), *r = json_object_get(rep, "rejected");
    if (!json_is_integer(a) || !json_is_integer(r) || json_integer_value(a) < 0 || json_integer_value(r) < 0 ||
        (uint64_t)json_integer_value(a) + (uint64_t)json_integer_value(r) != n) {
        json_decref(rep);
        return bt_fail(BT_ERR_FORMAT, "ref_put: reply does not account for the %zu values sent", n);
    }
    *acc += (size_t)json_integer_value(a);
    *rej += (size_t)json_integer_value(r);
    const char *first = json_string_value(json_array_get(json_object_get(rep, "errors"), 0));
    if (json_integer_value(r) > 0)
        bt_fail(BT_OK, "ref_put: loaderd refused %lld of %zu values, first: %s", (long long)json_integer_value(r), n,
                first ? first : "?");
    json_decref(rep);
    return BT_OK;
}

int bt_client_ref_put(bt_client *c, const char *base, const bt_ref_value *v, size_t n, size_t *accepted,
                      size_t *rejected) {
    size_t acc = 0, rej = 0;
    int rc = BT_OK;
    pthread_mutex_lock(&c->mu);
    for (size_t i = 0; i < n && rc == BT_OK; i += BT_REF_PUT_MAX)
        rc = c->reconnecting ? bt_fail(BT_ERR_CLOSED, "ref_put: loaderd went away; reconnecting")
                             : ref_put_locked(c, base, v + i, n - i < BT_REF_PUT_MAX ? n - i : BT_REF_PUT_MAX, &acc,
                                              &rej);
    pthread_mutex_unlock(&c->mu);
    if (accepted) *accepted = acc;
    if (rejected) *rejected = rej;
    return rc;
}

uint32_t bt_client_job_id(const bt_client *c) { return c->job_id; }
uint32_t bt_client_B(const bt_client *c) { return c->B; }
uint32_t bt_client_T(const bt_client *c) { return c->T; }
int32_t bt_client_vocab(const bt_client *c) { return c->vocab; }

void bt_client_close(bt_client *c) {
    if (!c) return;
    if (c->ring.hdr) bt_ring_consumer_close(&c->ring); /* stops the producer at once */
    json_t *req = json_pack("{s:i, s:s, s:I}", "v", BT_PROTO_VERSION, "op", "detach", "job_id", (json_int_t)c->job_id);
    if (req && c->sock >= 0 && send_json(c->sock, req) == BT_OK) {
        char *line = NULL;
        int fd = -1;
        if (read_line(c, 1000, &line, &fd) == BT_OK) free(line); /* best effort */
        if (fd >= 0) close(fd);
    }
    json_decref(req);
    client_free(c);
}
