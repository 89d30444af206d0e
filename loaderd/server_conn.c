/* loaderd control server: connections (internals: loaderd/server_priv.h, protocol:
 * proto/PROTOCOL.md §1). Accept with max_clients, max_clients_per_uid and the SO_PEERCRED /
 * SO_PEERGROUPS check against allowed_users / allowed_groups (operators — root, loaderd's own
 * uid, operator_groups — have OPERATOR_RESERVE more connections past both limits, so `status`
 * and `drain` always get through),
 * line framing with the max_request_bytes limit, client_timeout_s for connections without a
 * complete valid request (blank lines and malformed requests are not activity) and for
 * half-sent lines, backpressure on unread replies. Pure transport: each complete request line
 * goes up through s->hooks.request (server.c's command table), a closing connection through
 * s->hooks.closing; no op is named here. Every refusal is written to the peer before the close.
 * Loop thread only. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "loaderd/server_priv.h"
#include "proto/client.h"

const char *const ld_refuse_name[REFUSE_N] = {"max_clients", "permission", "timeout", "too_long",
                                              "max_clients_per_uid"};

/* ------------------------------------------------------------------ replies */

typedef struct {
    uv_write_t w;
    char *data;
} write_req;

static void on_written(uv_write_t *w, int status) {
    write_req *r = (write_req *)w;
    conn *c = (conn *)w->handle;
    free(r->data);
    free(r);
    if (c->paused && !c->closing && uv_stream_get_write_queue_size((uv_stream_t *)&c->h) < WRITE_HIGH_WATER / 4) {
        c->paused = 0;
        ld_conn_process(c);
    }
}

void ld_conn_write(conn *c, char *data, size_t n) {
    if (c->handle_closed || uv_is_closing((uv_handle_t *)&c->h)) {
        free(data);
        return;
    }
    write_req *r = bt_xcalloc(1, sizeof *r);
    r->data = data;
    uv_buf_t b = uv_buf_init(data, (unsigned)n);
    if (uv_write(&r->w, (uv_stream_t *)&c->h, &b, 1, on_written) != 0) {
        free(data);
        free(r);
        ld_conn_finish(c);
    }
}

void ld_conn_send(conn *c, json_t *msg) {
    json_object_set_new(msg, "v", json_integer(BT_PROTO_VERSION));
    char *text = json_dumps(msg, JSON_COMPACT | JSON_ENSURE_ASCII);
    json_decref(msg);
    if (!text) return;
    size_t n = strlen(text);
    text = bt_xrealloc(text, n + 2);
    text[n] = '\n';
    text[n + 1] = 0;
    ld_conn_write(c, text, n + 1);
}

int ld_conn_reply_error(conn *c, const char *op, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    /* messages quote paths (file names found on disk may hold any byte) and end on the client's
     * terminal: every control character and invalid UTF-8 byte is made visible (bt_escape_text;
     * json_pack would also refuse invalid UTF-8, and a message cut inside a multi-byte
     * character by the fixed-size buffers on the way here is one) */
    char safe[2048];
    bt_escape_text(safe, sizeof safe, msg, strlen(msg));
    json_t *r = json_pack("{s:b, s:s}", "ok", 0, "error", safe);
    if (op) json_object_set_new(r, "op", json_string(op));
    ld_conn_send(c, r);
    return 0;
}

/* ------------------------------------------------------------------ lifetime */

void ld_conn_maybe_free(conn *c) {
    if (!c->handle_closed || c->pending) return;
    free(c->buf);
    free(c);
}

static void on_conn_closed(uv_handle_t *h) {
    conn *c = (conn *)h;
    server *s = c->s;
    if (c->prev) c->prev->next = c->next;
    else s->conns = c->next;
    if (c->next) c->next->prev = c->prev;
    s->n_clients--;
    c->handle_closed = 1;
    ld_conn_maybe_free(c);
}

void ld_conn_close_now(conn *c) {
    if (!c->closing) c->closing = 1;
    c->s->hooks.closing(c); /* the peer on this connection is gone: what it owns goes too */
    if (!uv_is_closing((uv_handle_t *)&c->h)) uv_close((uv_handle_t *)&c->h, on_conn_closed);
}

static void on_shutdown(uv_shutdown_t *req, int status) { ld_conn_close_now((conn *)req->handle); }

void ld_conn_finish(conn *c) {
    if (c->closing) return;
    c->closing = 1;
    uv_read_stop((uv_stream_t *)&c->h);
    if (uv_shutdown(&c->sreq, (uv_stream_t *)&c->h, on_shutdown) != 0) ld_conn_close_now(c);
}

/* ------------------------------------------------------------------ reading */

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *b) {
    conn *c = (conn *)h;
    if (c->start > 0 && c->start == c->len) c->start = c->len = 0;
    if (c->cap - c->len < READ_CHUNK) {
        if (c->start > 0) { /* compact before growing */
            memmove(c->buf, c->buf + c->start, c->len - c->start);
            c->len -= c->start;
            c->start = 0;
        }
        if (c->cap - c->len < READ_CHUNK) {
            c->cap = c->len + READ_CHUNK;
            c->buf = bt_xrealloc(c->buf, c->cap);
        }
    }
    *b = uv_buf_init(c->buf + c->len, READ_CHUNK);
}

static void on_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *b) {
    conn *c = (conn *)st;
    if (nread < 0) {
        ld_conn_close_now(c); /* EOF or error: a half-sent request dies with the connection */
        return;
    }
    c->len += (size_t)nread;
    ld_conn_process(c);
}

static void handle_line(conn *c, char *line, size_t n) {
    while (n && (line[n - 1] == '\r' || line[n - 1] == ' ' || line[n - 1] == '\t')) n--;
    if (n) c->s->hooks.request(c, line, n);
}

static void refuse_too_long(conn *c) {
    server *s = c->s;
    s->bad_requests_total++;
    s->refused[REFUSE_TOO_LONG]++;
    bt_log(BT_LOG_WARN, LOGC, "closing client pid %d uid %u: request line longer than %zu bytes", (int)c->cred.pid,
           (unsigned)c->cred.uid, s->cfg->c.max_request_bytes);
    ld_conn_reply_error(c, NULL, "request line longer than %zu bytes: closing", s->cfg->c.max_request_bytes);
    ld_conn_finish(c);
}

void ld_conn_process(conn *c) {
    server *s = c->s;
    while (!c->busy && !c->closing && !c->paused) {
        char *p = c->buf + c->start;
        size_t avail = c->len - c->start;
        char *nl = avail ? memchr(p, '\n', avail) : NULL;
        if (!nl) {
            if (avail > s->cfg->c.max_request_bytes) {
                refuse_too_long(c);
                return;
            }
            /* a partial line starts the client_timeout_s clock; a complete one resets it */
            if (avail == 0) c->t_partial = 0;
            else if (c->t_partial == 0) c->t_partial = bt_now();
            break;
        }
        size_t n = (size_t)(nl - p);
        c->start += n + 1;
        c->t_partial = 0;
        if (n > s->cfg->c.max_request_bytes) {
            refuse_too_long(c);
            return;
        }
        handle_line(c, p, n);
        if (uv_stream_get_write_queue_size((uv_stream_t *)&c->h) > WRITE_HIGH_WATER) c->paused = 1;
    }
    if (c->closing) return;
    if (c->busy || c->paused) uv_read_stop((uv_stream_t *)&c->h);
    else uv_read_start((uv_stream_t *)&c->h, on_alloc, on_read);
}

/* ------------------------------------------------------------------ accept, peer check */

#define OPERATOR_RESERVE 8 /* connections operators may open past max_clients / max_clients_per_uid */

/* Supplementary groups of the peer (SO_PEERGROUPS, Linux 4.13). Returns the count (0 when
 * unavailable), at most `cap`. */
static int peer_groups(int fd, gid_t *groups, int cap) {
    socklen_t len = (socklen_t)(cap * (int)sizeof(gid_t));
    if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len) != 0) return 0;
    return (int)(len / sizeof(gid_t));
}

void ld_conn_on_connection(uv_stream_t *ls, int status) {
    server *s = ls->data;
    if (status < 0) {
        bt_log(BT_LOG_WARN, LOGC, "accept: %s", uv_strerror(status));
        return;
    }
    conn *c = bt_xcalloc(1, sizeof *c);
    c->s = s;
    c->t_active = bt_now();
    uv_pipe_init(s->loop, &c->h, 0);
    c->next = s->conns;
    if (s->conns) s->conns->prev = c;
    s->conns = c;
    s->n_clients++;
    s->connections_total++;
    if (uv_accept(ls, (uv_stream_t *)&c->h) != 0) {
        c->closing = 1;
        uv_close((uv_handle_t *)&c->h, on_conn_closed);
        return;
    }
    uv_os_fd_t fd = -1;
    socklen_t len = sizeof c->cred;
    gid_t groups[MAX_PEER_GROUPS];
    int n_groups = 0;
    int have_cred = uv_fileno((uv_handle_t *)&c->h, &fd) == 0 &&
                    getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &c->cred, &len) == 0;
    if (!have_cred) {
        c->cred.pid = -1;
        c->cred.uid = (uid_t)-1;
        c->cred.gid = (gid_t)-1;
    } else {
        n_groups = peer_groups(fd, groups, MAX_PEER_GROUPS);
    }
    const ld_config *cf = &s->cfg->c;
    c->is_operator = have_cred && ld_peer_is_operator(cf, c->cred.uid, c->cred.gid, groups, n_groups, geteuid());
    /* the slots: everyone shares max_clients, and one uid gets at most max_clients_per_uid of
     * them; an operator past either limit gets one of OPERATOR_RESERVE slots of its own */
    uint32_t open = 0, mine = 0, reserved = 0;
    for (conn *o = s->conns; o; o = o->next) {
        if (o == c || o->closing) continue;
        if (o->reserve) {
            reserved++;
            continue;
        }
        open++;
        mine += o->cred.uid == c->cred.uid;
    }
    int full = open >= cf->max_clients, uid_full = mine >= cf->max_clients_per_uid;
    if ((full || uid_full) && c->is_operator && reserved < OPERATOR_RESERVE) {
        c->reserve = 1;
        full = uid_full = 0;
    }
    if (full) {
        s->refused[REFUSE_MAX_CLIENTS]++;
        bt_log(BT_LOG_WARN, LOGC, "refusing client pid %d uid %u: %u clients connected (max_clients %u)",
               (int)c->cred.pid, (unsigned)c->cred.uid, open, cf->max_clients);
        ld_conn_reply_error(c, NULL, "too many clients (max_clients %u): try again later", cf->max_clients);
        ld_conn_finish(c);
        return;
    }
    if (uid_full) {
        s->refused[REFUSE_PER_UID]++;
        bt_log(BT_LOG_WARN, LOGC, "refusing client pid %d uid %u: it has %u connections (max_clients_per_uid %u)",
               (int)c->cred.pid, (unsigned)c->cred.uid, mine, cf->max_clients_per_uid);
        ld_conn_reply_error(c, NULL, "too many connections from uid %u: %u open (max_clients_per_uid %u): close "
                            "some first", (unsigned)c->cred.uid, mine, cf->max_clients_per_uid);
        ld_conn_finish(c);
        return;
    }
    if (!have_cred || (!c->is_operator &&
                       !ld_peer_allowed(cf, c->cred.uid, c->cred.gid, groups, n_groups, geteuid()))) {
        s->refused[REFUSE_PERMISSION]++;
        bt_log(BT_LOG_WARN, LOGC,
               "refusing client pid %d uid %u gid %u: not in allowed_users / allowed_groups (every request refused)",
               (int)c->cred.pid, (unsigned)c->cred.uid, (unsigned)c->cred.gid);
        ld_conn_reply_error(c, NULL, "permission denied: uid %u (gid %u) is not in loaderd's allowed_users or "
                                     "allowed_groups",
                            (unsigned)c->cred.uid, (unsigned)c->cred.gid);
        ld_conn_finish(c);
        return;
    }
    uv_read_start((uv_stream_t *)&c->h, on_alloc, on_read);
}

/* ------------------------------------------------------------------ timeouts */

void ld_conn_check_timeouts(server *s, double now) {
    double lim = s->cfg->c.client_timeout_s;
    if (lim <= 0) return;
    for (conn *c = s->conns, *nx; c; c = nx) {
        nx = c->next;
        if (c->closing || c->busy) continue;
        int has_job = c->n_jobs > 0;
        const char *why = NULL;
        if (c->t_partial > 0 && now - c->t_partial > lim) why = "half a request line";
        else if (!has_job && now - c->t_active > lim) why = "no complete request";
        if (!why) continue;
        s->refused[REFUSE_TIMEOUT]++;
        bt_log(BT_LOG_WARN, LOGC, "closing client pid %d uid %u: %s for more than %.0f s (client_timeout_s)",
               (int)c->cred.pid, (unsigned)c->cred.uid, why, lim);
        ld_conn_reply_error(c, NULL, "timed out: %s for more than %.0f s (client_timeout_s)", why, lim);
        ld_conn_finish(c);
    }
}
