/* Trainer-side client of loaderd's control socket (contract: proto/client.h, proto/PROTOCOL.md).
 * Uses jansson for the JSON lines, recvmsg(2) with SCM_RIGHTS (unix(7)) for the ring memfd. */
#include "proto/client.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "common/bt_common.h"

#define CLIENT_MAX_LINE (1u << 20)
#define CLIENT_ATTACH_TIMEOUT_MS 120000 /* loaderd may be loading a large tokenizer */
#define CLIENT_REPLY_TIMEOUT_MS 5000

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
        if (c->cap - c->len < 4096) {
            c->cap = c->cap ? c->cap * 2 : 8192;
            c->buf = bt_xrealloc(c->buf, c->cap);
        }
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
    free(c);
}

int bt_client_attach(bt_client **out, const char *socket_path, const char *job_json, int rank, int world_size,
                     const uint8_t *resume_state) {
    *out = NULL;
    if (!socket_path) socket_path = getenv("LOADERD_SOCKET") ? getenv("LOADERD_SOCKET") : BT_DEFAULT_SOCKET;
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(socket_path) >= sizeof sa.sun_path)
        return bt_fail(BT_ERR_INVALID, "loaderd socket path too long (%zu bytes, max %zu): %s", strlen(socket_path),
                       sizeof sa.sun_path - 1, socket_path);
    strcpy(sa.sun_path, socket_path);
    json_error_t e;
    json_t *job = json_loads(job_json ? job_json : "", JSON_REJECT_DUPLICATES, &e);
    if (!job || !json_is_object(job)) {
        json_decref(job);
        return bt_fail(BT_ERR_INVALID, "attach: job spec is not a JSON object (%s)", e.text);
    }
    absolutize_paths(job);
    bt_client *c = bt_xcalloc(1, sizeof *c);
    c->ring.fd = -1;
    c->sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int rc;
    if (c->sock < 0) {
        rc = bt_fail(BT_ERR_IO, "socket: %s", strerror(errno));
        json_decref(job);
        goto fail;
    }
    if (connect(c->sock, (struct sockaddr *)&sa, sizeof sa) != 0) {
        rc = bt_fail(BT_ERR_IO, "connect %s: %s (is loaderd running?)", socket_path, strerror(errno));
        json_decref(job);
        goto fail;
    }
    json_t *req = json_pack("{s:i, s:s, s:o, s:i, s:i}", "v", BT_PROTO_VERSION, "op", "attach", "job", job,
                            "rank", rank, "world_size", world_size);
    if (resume_state) {
        char hex[2 * BT_RESUME_STATE_BYTES + 1];
        for (unsigned i = 0; i < BT_RESUME_STATE_BYTES; i++) snprintf(hex + 2 * i, 3, "%02x", resume_state[i]);
        json_object_set_new(req, "resume", json_string(hex));
    }
    rc = send_json(c->sock, req);
    json_decref(req);
    if (rc) goto fail;
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
    uint32_t slots = 0;
    if ((rc = get_u32(rep, "job_id", &c->job_id)) || (rc = get_u32(rep, "B", &c->B)) ||
        (rc = get_u32(rep, "T", &c->T)) || (rc = get_u32(rep, "slots", &slots))) {
        json_decref(rep);
        if (fd >= 0) close(fd);
        goto fail;
    }
    json_t *voc = json_object_get(rep, "vocab");
    c->vocab = json_is_integer(voc) && json_integer_value(voc) > 0 && json_integer_value(voc) <= INT32_MAX
                   ? (int32_t)json_integer_value(voc)
                   : 0;
    json_decref(rep);
    if (fd < 0) {
        rc = bt_fail(BT_ERR_FORMAT, "loaderd attach reply carried no ring descriptor");
        goto fail;
    }
    if ((rc = bt_ring_attach(&c->ring, fd))) goto fail; /* fd owned (and closed on error) by attach */
    if (c->ring.B != c->B || c->ring.T != c->T || c->ring.n_slots != slots) {
        rc = bt_fail(BT_ERR_FORMAT, "ring geometry %ux%u x%u differs from the attach reply %ux%u x%u", c->ring.B,
                     c->ring.T, c->ring.n_slots, c->B, c->T, slots);
        goto fail;
    }
    *out = c;
    return BT_OK;
fail:
    client_free(c);
    return rc;
}

int bt_client_next(bt_client *c, bt_batch_view *v, int timeout_ms) {
    if (c->holding) bt_client_release(c);
    if (c->ended) return 1;
    void *slot = bt_ring_consumer_peek(&c->ring, timeout_ms);
    if (!slot) {
        if (c->ring.err == BT_ERR_CLOSED)
            return bt_fail(BT_ERR_CLOSED, "loaderd closed the stream of job %u before its end", c->job_id);
        return c->ring.err ? c->ring.err : BT_ERR_IO;
    }
    c->holding = 1;
    bt_batch_view_init(v, slot, c->B, c->T);
    if (v->hdr->flags & BT_BATCH_F_END_OF_DATA) {
        if (v->hdr->magic != BT_BATCH_MAGIC) return bt_fail(BT_ERR_FORMAT, "end-of-data batch with a bad magic");
        c->ended = 1;
        bt_client_release(c);
        return 1;
    }
    int rc = bt_batch_validate(v, c->B, c->T, c->vocab);
    if (rc) return rc;
    if (c->have_step && v->hdr->step != c->next_step)
        return bt_fail(BT_ERR_FORMAT, "batch step %llu out of order (want %llu)", (unsigned long long)v->hdr->step,
                       (unsigned long long)c->next_step);
    if (v->hdr->job_id != c->job_id)
        return bt_fail(BT_ERR_FORMAT, "batch carries job id %u (want %u)", v->hdr->job_id, c->job_id);
    c->have_step = 1;
    c->next_step = v->hdr->step + 1;
    return 0;
}

void bt_client_release(bt_client *c) {
    if (!c->holding) return;
    c->holding = 0;
    bt_ring_consumer_release(&c->ring);
}

int bt_client_report(bt_client *c, uint64_t step, double loss, double tokens_per_s) {
    /* non-finite values (a diverged loss) travel as null: JSON has no NaN */
    json_t *req = json_pack("{s:i, s:s, s:I, s:I, s:o, s:o}", "v", BT_PROTO_VERSION, "op", "report", "job_id",
                            (json_int_t)c->job_id, "step", (json_int_t)step, "loss",
                            isfinite(loss) ? json_real(loss) : json_null(), "tokens_per_s",
                            isfinite(tokens_per_s) ? json_real(tokens_per_s) : json_null());
    if (!req) return bt_fail(BT_ERR_NOMEM, "report: cannot encode");
    int rc = send_json(c->sock, req);
    json_decref(req);
    if (rc) return rc;
    char *line = NULL;
    if ((rc = read_line(c, CLIENT_REPLY_TIMEOUT_MS, &line, NULL))) return rc;
    json_t *rep = NULL;
    rc = parse_reply(line, &rep);
    free(line);
    json_decref(rep);
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
    if (req) {
        if (send_json(c->sock, req) == BT_OK) {
            char *line = NULL;
            if (read_line(c, 1000, &line, NULL) == BT_OK) free(line); /* best effort */
        }
        json_decref(req);
    }
    client_free(c);
}
