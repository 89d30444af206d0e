/* loaderd control server (contract: loaderd/server.h, protocol: proto/PROTOCOL.md).
 *
 * Threads: the libuv loop thread owns every connection, the job list and the configuration;
 * attach preparation (path resolution, tokenizer load, ring and pipeline creation) and job
 * teardown (joining the producer) run on the libuv thread pool; each job has one producer
 * thread that only touches its own pipeline, ring, stats (atomics) and state word.
 * The ring memory is shared with a possibly hostile trainer: the producer builds each batch in
 * private memory and copies it into the slot, so nothing the trainer writes is ever read back. */
#include "loaderd/server.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>
#include <uv.h>

#include "common/bt_common.h"
#include "common/tokenizer.h"
#include "loaderd/config.h"
#include "loaderd/pipeline.h"
#include "proto/batch.h"
#include "proto/client.h"
#include "proto/ring.h"

#define LOGC "loaderd"
#define READ_CHUNK 65536
#define WRITE_HIGH_WATER (4u << 20) /* pause reading a client whose replies pile up */
#define RATE_TAU_S 5.0              /* EWMA time constant of docs/s and tokens/s */
#define STOP_GRACE_MS 3000          /* force-close clients that do not read their last reply */

enum { JOB_RUNNING = 0, JOB_DONE, JOB_STOPPED, JOB_FAILED };
static const char *job_state_name[] = {"running", "done", "stopped", "failed"};

typedef struct cfg_ref {
    ld_config c;
    int refs; /* loop thread only */
} cfg_ref;

typedef struct tok_entry {
    char *path;
    bt_tokenizer *tok;
    int refs;
    struct tok_entry *next;
} tok_entry;

struct server;
struct conn;

typedef struct job {
    struct server *s;
    struct conn *owner; /* NULL once torn down */
    uint32_t id, rank, world, B, T, slots;
    ld_job_spec spec;
    tok_entry *tok;
    bt_ring ring;
    ld_pipeline *pipe;
    ld_stats stats;
    pthread_t thread;
    int thread_started;
    _Atomic int stop;
    _Atomic int state;
    char err[256]; /* written by the producer before state becomes JOB_FAILED */
    struct ucred peer;
    double t_attach;
    int32_t vocab;
    int n_shards;
    /* rates (loop thread) */
    double last_t, docs_rate, tok_rate;
    uint64_t last_docs, last_tokens;
    /* last trainer report */
    int has_report;
    uint64_t rep_step;
    double rep_loss, rep_tps, rep_t;
    struct job *next;
    uv_work_t teardown;
} job;

typedef struct conn {
    uv_pipe_t h; /* first: handle pointers cast back to conn */
    struct server *s;
    char *buf;
    size_t start, len, cap; /* unconsumed bytes are buf[start, len) */
    int busy;               /* an attach is being prepared: requests wait */
    int closing;
    int paused;             /* reading stopped for backpressure */
    int pending;            /* thread-pool requests still pointing at this conn */
    int handle_closed;
    struct ucred cred;
    uv_shutdown_t sreq;
    struct conn *next, *prev;
} conn;

typedef struct server {
    uv_loop_t *loop;
    uv_pipe_t listener;
    uv_signal_t sig_term, sig_int, sig_hup;
    uv_timer_t tick, watchdog, stop_timer;
    cfg_ref *cfg;
    const char *config_path;
    const char *socket_override;
    char *socket_path; /* bound path */
    double t_start;
    int stopping, draining, listening, watchdog_on;
    uint32_t next_job_id;
    uint32_t n_clients, n_attaching, ticks;
    job *jobs;
    conn *conns;
    pthread_mutex_t tok_mu;
    tok_entry *toks;
    uint64_t connections_total, requests_total, bad_requests_total;
} server;

typedef struct {
    uv_work_t w;
    server *s;
    conn *c;
    cfg_ref *cfg;
    json_t *job_obj; /* deep copy, owned by the request */
    uint32_t rank, world;
    int has_resume;
    uint8_t resume[BT_RESUME_STATE_BYTES];
    job *j;  /* result */
    char err[512];
} attach_req;

static void conn_finish(conn *c);
static void server_stop(server *s, const char *why);
static void conn_process(conn *c);

/* ------------------------------------------------------------------ tokenizer cache */

static tok_entry *tok_get(server *s, const char *path, char *err, size_t errlen) {
    pthread_mutex_lock(&s->tok_mu);
    tok_entry *e = s->toks;
    while (e && strcmp(e->path, path)) e = e->next;
    if (!e) {
        bt_tokenizer *t = NULL;
        double t0 = bt_now();
        int rc = bt_tokenizer_load(&t, path);
        if (rc) {
            snprintf(err, errlen, "tokenizer %s: %s", path, bt_last_error());
            pthread_mutex_unlock(&s->tok_mu);
            return NULL;
        }
        bt_log(BT_LOG_INFO, LOGC, "loaded tokenizer %s (vocab %d) in %.2f s", path, bt_tokenizer_vocab_size(t),
               bt_now() - t0);
        e = bt_xcalloc(1, sizeof *e);
        e->path = bt_xstrdup(path);
        e->tok = t;
        e->next = s->toks;
        s->toks = e;
    }
    e->refs++;
    pthread_mutex_unlock(&s->tok_mu);
    return e;
}

static void tok_put(server *s, tok_entry *e) {
    if (!e) return;
    pthread_mutex_lock(&s->tok_mu);
    if (--e->refs == 0) {
        for (tok_entry **pp = &s->toks; *pp; pp = &(*pp)->next)
            if (*pp == e) {
                *pp = e->next;
                break;
            }
        bt_tokenizer_free(e->tok);
        free(e->path);
        free(e);
    }
    pthread_mutex_unlock(&s->tok_mu);
}

static void cfg_put(cfg_ref *r) {
    if (r && --r->refs == 0) {
        ld_config_free(&r->c);
        free(r);
    }
}

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
        conn_process(c);
    }
}

/* Queue `data` (malloc'd, ownership taken) for the client. */
static void conn_write(conn *c, char *data, size_t n) {
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
        conn_finish(c);
    }
}

/* Serialise `msg` (reference stolen) as one line and queue it. */
static void conn_send(conn *c, json_t *msg) {
    json_object_set_new(msg, "v", json_integer(BT_PROTO_VERSION));
    char *text = json_dumps(msg, JSON_COMPACT | JSON_ENSURE_ASCII);
    json_decref(msg);
    if (!text) return;
    size_t n = strlen(text);
    text = bt_xrealloc(text, n + 2);
    text[n] = '\n';
    text[n + 1] = 0;
    conn_write(c, text, n + 1);
}

/* Queue {"ok":false,"error":...}; returns 0 so request handlers can `return reply_error(...)`. */
static int reply_error(conn *c, const char *op, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int reply_error(conn *c, const char *op, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    json_t *r = json_pack("{s:b, s:s}", "ok", 0, "error", msg);
    if (op) json_object_set_new(r, "op", json_string(op));
    conn_send(c, r);
    return 0;
}

/* ------------------------------------------------------------------ connections */

static void conn_maybe_free(conn *c) {
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
    conn_maybe_free(c);
}

static void job_teardown(job *j);

static void conn_close_now(conn *c) {
    if (!c->closing) c->closing = 1;
    /* the trainer on this connection is gone: stop its jobs */
    server *s = c->s;
    for (job *j = s->jobs, *nx; j; j = nx) {
        nx = j->next;
        if (j->owner == c) job_teardown(j);
    }
    if (!uv_is_closing((uv_handle_t *)&c->h)) uv_close((uv_handle_t *)&c->h, on_conn_closed);
}

static void on_shutdown(uv_shutdown_t *req, int status) { conn_close_now((conn *)req->handle); }

/* Stop reading, let queued replies drain, then close. */
static void conn_finish(conn *c) {
    if (c->closing) return;
    c->closing = 1;
    uv_read_stop((uv_stream_t *)&c->h);
    if (uv_shutdown(&c->sreq, (uv_stream_t *)&c->h, on_shutdown) != 0) conn_close_now(c);
}

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
        conn_close_now(c); /* EOF or error: a half-sent request dies with the connection */
        return;
    }
    c->len += (size_t)nread;
    conn_process(c);
}

static void handle_request(conn *c, json_t *req, const char *op);

static void handle_line(conn *c, char *line, size_t n) {
    server *s = c->s;
    while (n && (line[n - 1] == '\r' || line[n - 1] == ' ' || line[n - 1] == '\t')) n--;
    if (n == 0) return;
    s->requests_total++;
    if (!ld_json_depth_ok(line, n, s->cfg->c.max_json_depth)) {
        s->bad_requests_total++;
        reply_error(c, NULL, "request nested deeper than %u levels", s->cfg->c.max_json_depth);
        return;
    }
    json_error_t e;
    json_t *req = json_loadb(line, n, JSON_REJECT_DUPLICATES, &e);
    if (!req || !json_is_object(req)) {
        s->bad_requests_total++;
        if (req) reply_error(c, NULL, "request must be a JSON object");
        else reply_error(c, NULL, "invalid JSON at column %d: %s", e.column, e.text);
        json_decref(req);
        return;
    }
    json_t *v = json_object_get(req, "v");
    const char *op = json_string_value(json_object_get(req, "op"));
    if (!json_is_integer(v) || json_integer_value(v) != BT_PROTO_VERSION) {
        s->bad_requests_total++;
        reply_error(c, op, "unsupported or missing protocol version \"v\" (this loaderd speaks %d)",
                    BT_PROTO_VERSION);
    } else if (!op) {
        s->bad_requests_total++;
        reply_error(c, NULL, "missing \"op\" (attach, detach, report, status, jobs, metrics, drain)");
    } else {
        handle_request(c, req, op);
    }
    json_decref(req);
}

/* Handle every complete line in the buffer unless an attach is pending or reading is paused. */
static void conn_process(conn *c) {
    server *s = c->s;
    while (!c->busy && !c->closing && !c->paused) {
        char *p = c->buf + c->start;
        size_t avail = c->len - c->start;
        char *nl = avail ? memchr(p, '\n', avail) : NULL;
        if (!nl) {
            if (avail > s->cfg->c.max_request_bytes) {
                s->bad_requests_total++;
                reply_error(c, NULL, "request line longer than %zu bytes: closing", s->cfg->c.max_request_bytes);
                conn_finish(c);
                return;
            }
            break;
        }
        size_t n = (size_t)(nl - p);
        c->start += n + 1;
        if (n > s->cfg->c.max_request_bytes) {
            s->bad_requests_total++;
            reply_error(c, NULL, "request line longer than %zu bytes: closing", s->cfg->c.max_request_bytes);
            conn_finish(c);
            return;
        }
        handle_line(c, p, n);
        if (uv_stream_get_write_queue_size((uv_stream_t *)&c->h) > WRITE_HIGH_WATER) c->paused = 1;
    }
    if (c->closing) return;
    if (c->busy || c->paused) uv_read_stop((uv_stream_t *)&c->h);
    else uv_read_start((uv_stream_t *)&c->h, on_alloc, on_read);
}

static void on_connection(uv_stream_t *ls, int status) {
    server *s = ls->data;
    if (status < 0) {
        bt_log(BT_LOG_WARN, LOGC, "accept: %s", uv_strerror(status));
        return;
    }
    conn *c = bt_xcalloc(1, sizeof *c);
    c->s = s;
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
    uv_os_fd_t fd;
    socklen_t len = sizeof c->cred;
    if (uv_fileno((uv_handle_t *)&c->h, &fd) != 0 || getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &c->cred, &len) != 0)
        c->cred.pid = -1;
    if (s->n_clients > s->cfg->c.max_clients) {
        bt_log(BT_LOG_WARN, LOGC, "refusing client pid %d uid %u: %u clients connected (max_clients %u)",
               (int)c->cred.pid, (unsigned)c->cred.uid, s->n_clients - 1, s->cfg->c.max_clients);
        reply_error(c, NULL, "too many clients (max_clients %u)", s->cfg->c.max_clients);
        conn_finish(c);
        return;
    }
    uv_read_start((uv_stream_t *)&c->h, on_alloc, on_read);
}

/* ------------------------------------------------------------------ jobs */

static void *producer_main(void *arg) {
    job *j = arg;
    uint8_t *priv = bt_aligned_alloc(j->ring.slot_bytes);
    int state = JOB_STOPPED;
    if (!priv) {
        snprintf(j->err, sizeof j->err, "out of memory for a %zu-byte batch", j->ring.slot_bytes);
        state = JOB_FAILED;
    }
    bt_batch_view v;
    if (priv) bt_batch_view_init(&v, priv, j->B, j->T);
    int produced = 0, rc = 0; /* produced: priv holds a batch not yet in the ring */
    while (priv && !atomic_load(&j->stop)) {
        if (!produced) {
            rc = ld_pipeline_next(j->pipe, &v, j->id);
            if (rc < 0) {
                snprintf(j->err, sizeof j->err, "pipeline: %s", bt_last_error());
                state = JOB_FAILED;
                break;
            }
            produced = 1;
        }
        void *slot = bt_ring_producer_acquire(&j->ring, 1000);
        if (!slot) {
            if (j->ring.err == BT_ERR_TIMEOUT) continue;
            if (j->ring.err == BT_ERR_FORMAT) {
                snprintf(j->err, sizeof j->err, "%s", bt_last_error());
                state = JOB_FAILED;
            }
            break; /* consumer closed */
        }
        memcpy(slot, priv, j->ring.slot_bytes);
        bt_ring_producer_commit(&j->ring);
        produced = 0;
        if (rc == 1) {
            state = JOB_DONE;
            break;
        }
    }
    bt_ring_producer_close(&j->ring);
    free(priv);
    if (state == JOB_FAILED) bt_log(BT_LOG_ERROR, LOGC, "job %u (%s rank %u): %s", j->id, j->spec.name, j->rank, j->err);
    else if (state == JOB_DONE) bt_log(BT_LOG_INFO, LOGC, "job %u (%s rank %u): end of data", j->id, j->spec.name, j->rank);
    atomic_store(&j->state, state);
    return NULL;
}

/* Free a job whose producer thread has been joined (or never started). Loop thread. */
static void job_free(job *j) {
    if (j->pipe) ld_pipeline_free(j->pipe);
    if (j->ring.hdr) bt_ring_close(&j->ring);
    tok_put(j->s, j->tok);
    ld_job_spec_free(&j->spec);
    free(j);
}

static void teardown_work(uv_work_t *w) {
    job *j = w->data;
    if (j->thread_started) pthread_join(j->thread, NULL);
    if (j->pipe) ld_pipeline_free(j->pipe);
    j->pipe = NULL;
}

static void check_drained(server *s) {
    if (s->draining && !s->stopping && !s->jobs && !s->n_attaching) server_stop(s, "drained: no jobs left");
}

static void teardown_done(uv_work_t *w, int status) {
    job *j = w->data;
    server *s = j->s;
    job_free(j);
    check_drained(s);
}

/* Detach a job: unlink it, wake and stop its producer, join and free it off the loop thread. */
static void job_teardown(job *j) {
    server *s = j->s;
    for (job **pp = &s->jobs; *pp; pp = &(*pp)->next)
        if (*pp == j) {
            *pp = j->next;
            break;
        }
    bt_log(BT_LOG_INFO, LOGC, "job %u (%s rank %u/%u) detached after %.1f s: %llu batches, %llu docs", j->id,
           j->spec.name, j->rank, j->world, bt_now() - j->t_attach, (unsigned long long)atomic_load(&j->stats.batches),
           (unsigned long long)atomic_load(&j->stats.docs));
    j->owner = NULL;
    atomic_store(&j->stop, 1);
    bt_ring_consumer_close(&j->ring); /* wakes a producer blocked on a full ring */
    j->teardown.data = j;
    if (uv_queue_work(s->loop, &j->teardown, teardown_work, teardown_done) != 0) {
        teardown_work(&j->teardown); /* cannot happen with a live loop; stay correct anyway */
        teardown_done(&j->teardown, 0);
    }
}

static int hexval(char ch) {
    if (ch >= '0' && ch <= '9') return ch - '0';
    if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F') return ch - 'A' + 10;
    return -1;
}

/* Thread pool: everything slow about an attach. On failure req->err is set, req->j NULL. */
static void attach_work(uv_work_t *w) {
    attach_req *r = w->data;
    const ld_config *cfg = &r->cfg->c;
    json_t *o = r->job_obj;
    char **files = NULL, **pats = NULL, *tokpath = NULL, *text = NULL;
    int n_files = 0, n_pats = 0;
    job *j = NULL;
    json_t *sh = json_object_get(o, "shards");
    const char *tk = json_string_value(json_object_get(o, "tokenizer"));
    if (!json_is_array(sh) || json_array_size(sh) == 0 || json_array_size(sh) > 100000) {
        snprintf(r->err, sizeof r->err, "job spec: \"shards\": expected a non-empty array of absolute paths/globs");
        goto out;
    }
    n_pats = (int)json_array_size(sh);
    pats = bt_xcalloc((size_t)n_pats, sizeof *pats);
    for (int i = 0; i < n_pats; i++) {
        const char *p = json_string_value(json_array_get(sh, (size_t)i));
        if (!p) {
            snprintf(r->err, sizeof r->err, "job spec: \"shards\"[%d]: expected a string", i);
            goto out;
        }
        pats[i] = bt_xstrdup(p);
    }
    if (!tk) {
        snprintf(r->err, sizeof r->err, "job spec: \"tokenizer\": required (absolute path of a .gguf)");
        goto out;
    }
    if (ld_resolve_shards(cfg, pats, n_pats, &files, &n_files) || ld_resolve_tokenizer(cfg, tk, &tokpath)) {
        snprintf(r->err, sizeof r->err, "%s", bt_last_error());
        goto out;
    }
    /* hand the pipeline only the checked, resolved paths */
    json_t *arr = json_array();
    for (int i = 0; i < n_files; i++) json_array_append_new(arr, json_string(files[i]));
    json_object_set_new(o, "shards", arr);
    json_object_set_new(o, "tokenizer", json_string(tokpath));
    json_t *rs = json_object_get(o, "ring_slots");
    json_t *tt = json_object_get(o, "tokenizer_threads");
    uint32_t slots = cfg->ring_slots;
    if (rs) {
        if (!json_is_integer(rs) || json_integer_value(rs) < 1 || json_integer_value(rs) > 1024) {
            snprintf(r->err, sizeof r->err, "job spec: \"ring_slots\": expected an integer in [1, 1024]");
            goto out;
        }
        slots = (uint32_t)json_integer_value(rs);
    }
    text = json_dumps(o, JSON_COMPACT);
    j = bt_xcalloc(1, sizeof *j);
    j->s = r->s;
    j->ring.fd = -1;
    if (!text || ld_job_spec_parse(&j->spec, text, r->err, sizeof r->err)) {
        if (!text) snprintf(r->err, sizeof r->err, "job spec: cannot re-encode");
        free(j);
        j = NULL;
        goto out;
    }
    j->spec.rank = r->rank;
    j->spec.world_size = r->world;
    if (!json_is_integer(tt) || j->spec.n_threads > cfg->tokenizer_threads) j->spec.n_threads = cfg->tokenizer_threads;
    j->B = j->spec.B;
    j->T = j->spec.T;
    j->rank = r->rank;
    j->world = r->world;
    j->slots = slots;
    j->n_shards = n_files;
    size_t sb = bt_batch_slot_bytes(j->B, j->T);
    if (sb == 0 || (uint64_t)sb * slots > cfg->max_ring_bytes) {
        snprintf(r->err, sizeof r->err, "ring of %u slots x %ux%u tokens (%llu bytes) exceeds max_ring_bytes %llu",
                 slots, j->B, j->T, (unsigned long long)sb * slots, (unsigned long long)cfg->max_ring_bytes);
        goto fail_job;
    }
    if (!(j->tok = tok_get(r->s, j->spec.tokenizer, r->err, sizeof r->err))) goto fail_job;
    j->vocab = bt_tokenizer_vocab_size(j->tok->tok);
    if (bt_ring_create(&j->ring, slots, j->B, j->T)) {
        snprintf(r->err, sizeof r->err, "%s", bt_last_error());
        goto fail_job;
    }
    if (ld_pipeline_new(&j->pipe, &j->spec, j->tok->tok, r->has_resume ? r->resume : NULL, &j->stats)) {
        snprintf(r->err, sizeof r->err, "%s", bt_last_error());
        j->pipe = NULL;
        goto fail_job;
    }
    r->j = j;
    goto out;
fail_job:
    r->j = NULL;
    job_free(j); /* tok_put is thread-safe; nothing else in j is shared yet */
out:
    free(text);
    free(tokpath);
    ld_free_strv(files, n_files);
    ld_free_strv(pats, n_pats);
}

/* Send the attach reply with the ring fd as SCM_RIGHTS on the same bytes. 0 on success. */
static int send_with_fd(conn *c, const char *text, size_t n, int fd) {
    uv_os_fd_t sock;
    if (uv_stream_get_write_queue_size((uv_stream_t *)&c->h) != 0)
        return bt_fail(BT_ERR_IO, "client has unread replies queued");
    if (uv_fileno((uv_handle_t *)&c->h, &sock) != 0) return bt_fail(BT_ERR_IO, "no socket");
    union {
        struct cmsghdr h;
        char b[CMSG_SPACE(sizeof(int))];
    } u;
    memset(&u, 0, sizeof u);
    struct iovec iov = {.iov_base = (void *)text, .iov_len = n};
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.b, .msg_controllen = sizeof u.b};
    struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cm), &fd, sizeof fd);
    ssize_t w;
    do w = sendmsg(sock, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    while (w < 0 && errno == EINTR);
    if (w < 0) return bt_fail(BT_ERR_IO, "sendmsg: %s", strerror(errno));
    if ((size_t)w < n) { /* the fd went with the first bytes; queue the rest in order */
        size_t rest = n - (size_t)w;
        char *copy = bt_xmalloc(rest);
        memcpy(copy, text + w, rest);
        conn_write(c, copy, rest);
    }
    return BT_OK;
}

static void attach_done(uv_work_t *w, int status) {
    attach_req *r = w->data;
    server *s = r->s;
    conn *c = r->c;
    job *j = r->j;
    s->n_attaching--;
    c->pending--;
    c->busy = 0;
    if (!j) {
        bt_log(BT_LOG_WARN, LOGC, "attach refused for pid %d uid %u: %s", (int)c->cred.pid, (unsigned)c->cred.uid,
               r->err);
        if (!c->closing) reply_error(c, "attach", "%s", r->err);
    } else if (c->closing || s->stopping) {
        job_free(j);
    } else {
        j->id = s->next_job_id++;
        j->owner = c;
        j->peer = c->cred;
        j->t_attach = j->last_t = bt_now();
        if (pthread_create(&j->thread, NULL, producer_main, j) != 0) {
            reply_error(c, "attach", "cannot start a producer thread");
            job_free(j);
            j = NULL;
        } else {
            j->thread_started = 1;
            j->next = s->jobs;
            s->jobs = j;
            json_t *rep = json_pack("{s:b, s:s, s:I, s:I, s:I, s:I, s:I, s:s, s:I, s:I}", "ok", 1, "op", "attach",
                                    "job_id", (json_int_t)j->id, "B", (json_int_t)j->B, "T", (json_int_t)j->T,
                                    "slots", (json_int_t)j->slots, "vocab", (json_int_t)j->vocab, "name",
                                    j->spec.name, "slot_bytes", (json_int_t)j->ring.slot_bytes, "shards",
                                    (json_int_t)j->n_shards);
            json_object_set_new(rep, "v", json_integer(BT_PROTO_VERSION));
            char *text = json_dumps(rep, JSON_COMPACT | JSON_ENSURE_ASCII);
            json_decref(rep);
            size_t n = text ? strlen(text) : 0;
            if (text) {
                text = bt_xrealloc(text, n + 2);
                text[n++] = '\n';
                text[n] = 0;
            }
            if (!text || send_with_fd(c, text, n, j->ring.fd)) {
                bt_log(BT_LOG_WARN, LOGC, "attach reply to pid %d failed: %s", (int)c->cred.pid, bt_last_error());
                free(text);
                conn_close_now(c); /* tears the job down */
            } else {
                free(text);
                bt_log(BT_LOG_INFO, LOGC,
                       "job %u attached: \"%s\" rank %u/%u B=%u T=%u slots=%u shards=%d tokenizer=%s peer pid=%d "
                       "uid=%u gid=%u",
                       j->id, j->spec.name, j->rank, j->world, j->B, j->T, j->slots, j->n_shards, j->spec.tokenizer,
                       (int)c->cred.pid, (unsigned)c->cred.uid, (unsigned)c->cred.gid);
            }
        }
    }
    json_decref(r->job_obj);
    cfg_put(r->cfg);
    free(r);
    if (c->handle_closed) conn_maybe_free(c);
    else if (!c->closing) conn_process(c);
    check_drained(s);
}

static int op_attach(conn *c, json_t *req) {
    server *s = c->s;
    if (s->draining || s->stopping) {
        return reply_error(c, "attach", "loaderd is draining: no new attaches");
    }
    json_t *jo = json_object_get(req, "job");
    json_t *rk = json_object_get(req, "rank"), *ws = json_object_get(req, "world_size");
    json_t *rs = json_object_get(req, "resume");
    if (!json_is_object(jo)) return reply_error(c, "attach", "\"job\": expected the job spec object");
    if (rk && (!json_is_integer(rk) || json_integer_value(rk) < 0 || json_integer_value(rk) > 65535))
        return reply_error(c, "attach", "\"rank\": expected an integer in [0, 65535]");
    if (ws && (!json_is_integer(ws) || json_integer_value(ws) < 1 || json_integer_value(ws) > 65536))
        return reply_error(c, "attach", "\"world_size\": expected an integer in [1, 65536]");
    uint32_t rank = rk ? (uint32_t)json_integer_value(rk) : 0, world = ws ? (uint32_t)json_integer_value(ws) : 1;
    if (rank >= world) return reply_error(c, "attach", "\"rank\" %u must be below \"world_size\" %u", rank, world);
    uint8_t resume[BT_RESUME_STATE_BYTES];
    if (rs && !json_is_null(rs)) {
        const char *hx = json_string_value(rs);
        if (!hx || strlen(hx) != 2 * BT_RESUME_STATE_BYTES)
            return reply_error(c, "attach", "\"resume\": expected %u hex digits", 2 * BT_RESUME_STATE_BYTES);
        for (unsigned i = 0; i < BT_RESUME_STATE_BYTES; i++) {
            int hi = hexval(hx[2 * i]), lo = hexval(hx[2 * i + 1]);
            if (hi < 0 || lo < 0) return reply_error(c, "attach", "\"resume\": not a hex string");
            resume[i] = (uint8_t)(hi << 4 | lo);
        }
    }
    uint32_t n_jobs = 0;
    for (job *j = s->jobs; j; j = j->next) n_jobs++;
    if (n_jobs + s->n_attaching >= s->cfg->c.max_jobs)
        return reply_error(c, "attach", "too many jobs (max_jobs %u)", s->cfg->c.max_jobs);
    attach_req *r = bt_xcalloc(1, sizeof *r);
    r->w.data = r;
    r->s = s;
    r->c = c;
    r->cfg = s->cfg;
    s->cfg->refs++;
    r->job_obj = json_deep_copy(jo);
    r->rank = rank;
    r->world = world;
    r->has_resume = rs && !json_is_null(rs);
    memcpy(r->resume, resume, sizeof resume);
    if (!r->job_obj || uv_queue_work(s->loop, &r->w, attach_work, attach_done) != 0) {
        json_decref(r->job_obj);
        cfg_put(r->cfg);
        free(r);
        return reply_error(c, "attach", "cannot queue the attach");
    }
    c->busy = 1;
    c->pending++;
    s->n_attaching++;
    return 0;
}

static job *find_own_job(conn *c, json_t *req, const char *op) {
    json_t *id = json_object_get(req, "job_id");
    for (job *j = c->s->jobs; j; j = j->next) {
        if (j->owner != c) continue;
        if (!id || (json_is_integer(id) && json_integer_value(id) == (json_int_t)j->id)) return j;
    }
    reply_error(c, op, id ? "no job with this \"job_id\" is attached on this connection"
                          : "no job is attached on this connection");
    return NULL;
}

static void op_detach(conn *c, json_t *req) {
    job *j = find_own_job(c, req, "detach");
    if (!j) return;
    uint32_t id = j->id;
    job_teardown(j);
    conn_send(c, json_pack("{s:b, s:s, s:I}", "ok", 1, "op", "detach", "job_id", (json_int_t)id));
}

static int op_report(conn *c, json_t *req) {
    json_t *st = json_object_get(req, "step"), *lo = json_object_get(req, "loss"),
           *tp = json_object_get(req, "tokens_per_s");
    if (!json_is_integer(st) || json_integer_value(st) < 0)
        return reply_error(c, "report", "\"step\": expected a non-negative integer");
    if ((lo && !json_is_number(lo) && !json_is_null(lo)) || (tp && !json_is_number(tp) && !json_is_null(tp)))
        return reply_error(c, "report", "\"loss\" and \"tokens_per_s\": expected numbers (or null)");
    job *j = find_own_job(c, req, "report");
    if (!j) return 0;
    j->has_report = 1;
    j->rep_step = (uint64_t)json_integer_value(st);
    j->rep_loss = json_is_number(lo) ? json_number_value(lo) : NAN;
    j->rep_tps = json_is_number(tp) ? json_number_value(tp) : NAN;
    j->rep_t = bt_now();
    conn_send(c, json_pack("{s:b, s:s}", "ok", 1, "op", "report"));
    return 0;
}

static json_t *num_or_null(double x) { return isfinite(x) ? json_real(x) : json_null(); }

static double packing_eff(job *j) {
    uint64_t slot = atomic_load(&j->stats.slot_tokens);
    return slot ? (double)atomic_load(&j->stats.tokens) / (double)slot : 0.0;
}

static json_t *job_json(job *j, int full) {
    int state = atomic_load(&j->state);
    json_t *o = json_pack("{s:I, s:s, s:I, s:I, s:s}", "job_id", (json_int_t)j->id, "name", j->spec.name, "rank",
                          (json_int_t)j->rank, "world_size", (json_int_t)j->world, "state", job_state_name[state]);
    json_object_set_new(o, "peer_pid", json_integer(j->peer.pid));
    json_object_set_new(o, "batches", json_integer((json_int_t)atomic_load(&j->stats.batches)));
    if (state == JOB_FAILED) json_object_set_new(o, "error", json_string(j->err));
    if (!full) return o;
    ld_stats *st = &j->stats;
    json_t *bad = json_object();
    uint64_t bad_total = 0;
    for (int r = 0; r < LD_BAD_N; r++) {
        uint64_t n = atomic_load(&st->bad[r]);
        bad_total += n;
        json_object_set_new(bad, ld_bad_reason_name(r), json_integer((json_int_t)n));
    }
#define U64(x) ((json_int_t)atomic_load(&(x)))
    json_t *more = json_pack("{s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:f, s:f, s:f, s:I, s:I, s:o, s:I, s:I, s:s, s:f}",
                             "B", (json_int_t)j->B, "T", (json_int_t)j->T, "docs", U64(st->docs), "tokens",
                             U64(st->tokens), "labelled_tokens", U64(st->labelled), "lines", U64(st->lines),
                             "truncated", U64(st->truncated), "epoch", (json_int_t)atomic_load(&st->epoch),
                             "docs_per_s", j->docs_rate, "tokens_per_s", j->tok_rate, "packing_efficiency",
                             packing_eff(j), "ring_fill", (json_int_t)bt_ring_fill(&j->ring), "ring_slots",
                             (json_int_t)j->slots, "bad_lines", bad, "bad_lines_total", (json_int_t)bad_total,
                             "shards", (json_int_t)j->n_shards, "tokenizer", j->spec.tokenizer, "attached_s",
                             bt_now() - j->t_attach);
#undef U64
    json_object_update(o, more);
    json_decref(more);
    json_object_set_new(o, "peer", json_pack("{s:i, s:I, s:I}", "pid", (int)j->peer.pid, "uid", (json_int_t)j->peer.uid,
                                             "gid", (json_int_t)j->peer.gid));
    if (j->has_report)
        json_object_set_new(o, "trainer",
                            json_pack("{s:I, s:o, s:o, s:f}", "step", (json_int_t)j->rep_step, "loss",
                                      num_or_null(j->rep_loss), "tokens_per_s", num_or_null(j->rep_tps), "age_s",
                                      bt_now() - j->rep_t));
    else json_object_set_new(o, "trainer", json_null());
    return o;
}

static void op_status(conn *c, int full) {
    server *s = c->s;
    json_t *arr = json_array();
    for (job *j = s->jobs; j; j = j->next) json_array_append_new(arr, job_json(j, full));
    json_t *r = json_pack("{s:b, s:s, s:o}", "ok", 1, "op", full ? "status" : "jobs", "jobs", arr);
    if (full) {
        int n_tok = 0;
        pthread_mutex_lock(&s->tok_mu);
        for (tok_entry *e = s->toks; e; e = e->next) n_tok++;
        pthread_mutex_unlock(&s->tok_mu);
        json_object_set_new(r, "uptime_s", json_real(bt_now() - s->t_start));
        json_object_set_new(r, "pid", json_integer(getpid()));
        json_object_set_new(r, "socket", json_string(s->socket_path));
        json_object_set_new(r, "draining", json_boolean(s->draining));
        json_object_set_new(r, "clients", json_integer(s->n_clients));
        json_object_set_new(r, "attaching", json_integer(s->n_attaching));
        json_object_set_new(r, "tokenizers_cached", json_integer(n_tok));
        json_object_set_new(r, "requests_total", json_integer((json_int_t)s->requests_total));
        json_object_set_new(r, "bad_requests_total", json_integer((json_int_t)s->bad_requests_total));
        json_object_set_new(r, "max_jobs", json_integer(s->cfg->c.max_jobs));
    }
    conn_send(c, r);
}

/* Prometheus label value escaping (exposition format: backslash, double quote, newline). */
static void prom_label(FILE *f, const char *v) {
    for (; *v; v++) {
        if (*v == '\\') fputs("\\\\", f);
        else if (*v == '"') fputs("\\\"", f);
        else if (*v == '\n') fputs("\\n", f);
        else fputc(*v, f);
    }
}

static void prom_labels(FILE *f, job *j) {
    fputs("{job=\"", f);
    prom_label(f, j->spec.name);
    fprintf(f, "\",job_id=\"%u\",rank=\"%u\"", j->id, j->rank);
}

typedef enum { M_DOCS, M_TOKENS, M_LABELLED, M_BATCHES, M_LINES, M_TRUNC, M_EFF, M_FILL, M_SLOTS, M_DRATE, M_TRATE,
               M_EPOCH, M_STEP, M_LOSS, M_TTPS, M_N } metric_id;
static const struct {
    const char *name, *type, *help;
} metrics[M_N] = {
    {"loaderd_documents_total", "counter", "Documents accepted into packed rows."},
    {"loaderd_tokens_total", "counter", "Real (non-padding) tokens packed."},
    {"loaderd_labelled_tokens_total", "counter", "Tokens carrying a loss label."},
    {"loaderd_batches_total", "counter", "Micro-batches produced."},
    {"loaderd_lines_total", "counter", "Input lines read."},
    {"loaderd_truncated_documents_total", "counter", "Documents truncated to seq_len."},
    {"loaderd_packing_efficiency", "gauge", "Real tokens / slot tokens (1 = no padding)."},
    {"loaderd_ring_fill", "gauge", "Ring slots holding batches not yet consumed."},
    {"loaderd_ring_slots", "gauge", "Ring capacity in slots."},
    {"loaderd_documents_per_second", "gauge", "Documents per second (EWMA, ~5 s)."},
    {"loaderd_tokens_per_second", "gauge", "Tokens per second (EWMA, ~5 s)."},
    {"loaderd_epoch", "gauge", "Current epoch of the job's stream."},
    {"loaderd_trainer_step", "gauge", "Last step reported by the trainer."},
    {"loaderd_trainer_loss", "gauge", "Last loss reported by the trainer."},
    {"loaderd_trainer_tokens_per_second", "gauge", "Last tokens/s reported by the trainer."},
};

static double metric_value(job *j, metric_id m) {
    ld_stats *st = &j->stats;
    switch (m) {
    case M_DOCS: return (double)atomic_load(&st->docs);
    case M_TOKENS: return (double)atomic_load(&st->tokens);
    case M_LABELLED: return (double)atomic_load(&st->labelled);
    case M_BATCHES: return (double)atomic_load(&st->batches);
    case M_LINES: return (double)atomic_load(&st->lines);
    case M_TRUNC: return (double)atomic_load(&st->truncated);
    case M_EFF: return packing_eff(j);
    case M_FILL: return bt_ring_fill(&j->ring);
    case M_SLOTS: return j->slots;
    case M_DRATE: return j->docs_rate;
    case M_TRATE: return j->tok_rate;
    case M_EPOCH: return atomic_load(&st->epoch);
    case M_STEP: return j->has_report ? (double)j->rep_step : NAN;
    case M_LOSS: return j->has_report ? j->rep_loss : NAN;
    case M_TTPS: return j->has_report ? j->rep_tps : NAN;
    default: return NAN;
    }
}

static int op_metrics(conn *c) {
    server *s = c->s;
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f) return reply_error(c, "metrics", "out of memory");
    uint32_t n_jobs = 0;
    for (job *j = s->jobs; j; j = j->next) n_jobs++;
    const struct {
        const char *name, *type, *help;
        double v;
    } glob[] = {
        {"loaderd_uptime_seconds", "gauge", "Seconds since loaderd started.", bt_now() - s->t_start},
        {"loaderd_clients", "gauge", "Connected control-socket clients.", s->n_clients},
        {"loaderd_jobs", "gauge", "Attached jobs.", n_jobs},
        {"loaderd_draining", "gauge", "1 while draining.", s->draining},
        {"loaderd_requests_total", "counter", "Control requests received.", (double)s->requests_total},
        {"loaderd_bad_requests_total", "counter", "Malformed control requests.", (double)s->bad_requests_total},
    };
    for (size_t g = 0; g < sizeof glob / sizeof glob[0]; g++)
        fprintf(f, "# HELP %s %s\n# TYPE %s %s\n%s %.17g\n", glob[g].name, glob[g].help, glob[g].name, glob[g].type,
                glob[g].name, glob[g].v);
    for (int m = 0; m < M_N; m++) {
        fprintf(f, "# HELP %s %s\n# TYPE %s %s\n", metrics[m].name, metrics[m].help, metrics[m].name, metrics[m].type);
        for (job *j = s->jobs; j; j = j->next) {
            double x = metric_value(j, (metric_id)m);
            if (isnan(x) && m >= M_STEP) continue; /* no trainer report yet */
            fputs(metrics[m].name, f);
            prom_labels(f, j);
            if (isnan(x)) fputs("} NaN\n", f);
            else if (isinf(x)) fprintf(f, "} %s\n", x > 0 ? "+Inf" : "-Inf");
            else fprintf(f, "} %.17g\n", x);
        }
    }
    fputs("# HELP loaderd_bad_lines_total Input lines skipped, by reason.\n# TYPE loaderd_bad_lines_total counter\n", f);
    for (job *j = s->jobs; j; j = j->next)
        for (int r = 0; r < LD_BAD_N; r++) {
            fputs("loaderd_bad_lines_total", f);
            prom_labels(f, j);
            fprintf(f, ",reason=\"%s\"} %llu\n", ld_bad_reason_name(r), (unsigned long long)atomic_load(&j->stats.bad[r]));
        }
    fclose(f);
    json_t *r = json_pack("{s:b, s:s, s:s, s:s%}", "ok", 1, "op", "metrics", "format", "prometheus-text-0.0.4",
                          "text", text, len);
    free(text);
    conn_send(c, r);
    return 0;
}

static int op_drain(conn *c) {
    server *s = c->s;
    if (c->cred.pid == -1 || (c->cred.uid != 0 && c->cred.uid != geteuid()))
        return reply_error(c, "drain", "drain is allowed for root and loaderd's own user only");
    uint32_t n = 0;
    for (job *j = s->jobs; j; j = j->next) n++;
    if (!s->draining)
        bt_log(BT_LOG_INFO, LOGC, "drain requested by pid %d uid %u: %u job(s) left", (int)c->cred.pid,
               (unsigned)c->cred.uid, n);
    s->draining = 1;
    sd_notifyf(0, "STATUS=draining: %u job(s) left", n);
    conn_send(c, json_pack("{s:b, s:s, s:I}", "ok", 1, "op", "drain", "jobs", (json_int_t)n));
    check_drained(s);
    return 0;
}

static void handle_request(conn *c, json_t *req, const char *op) {
    if (!strcmp(op, "attach")) op_attach(c, req);
    else if (!strcmp(op, "detach")) op_detach(c, req);
    else if (!strcmp(op, "report")) op_report(c, req);
    else if (!strcmp(op, "status")) op_status(c, 1);
    else if (!strcmp(op, "jobs")) op_status(c, 0);
    else if (!strcmp(op, "metrics")) op_metrics(c);
    else if (!strcmp(op, "drain")) op_drain(c);
    else {
        c->s->bad_requests_total++;
        reply_error(c, op, "unknown op (attach, detach, report, status, jobs, metrics, drain)");
    }
}

/* ------------------------------------------------------------------ timers, signals, lifecycle */

static void on_tick(uv_timer_t *t) {
    server *s = t->data;
    double now = bt_now();
    double tok_total = 0;
    uint32_t n = 0;
    for (job *j = s->jobs; j; j = j->next) {
        double dt = now - j->last_t;
        if (dt <= 0) continue;
        uint64_t d = atomic_load(&j->stats.docs), k = atomic_load(&j->stats.tokens);
        double a = 1.0 - exp(-dt / RATE_TAU_S);
        j->docs_rate += a * ((double)(d - j->last_docs) / dt - j->docs_rate);
        j->tok_rate += a * ((double)(k - j->last_tokens) / dt - j->tok_rate);
        j->last_docs = d;
        j->last_tokens = k;
        j->last_t = now;
        tok_total += j->tok_rate;
        n++;
    }
    if (++s->ticks % 5 == 0)
        sd_notifyf(0, "STATUS=%s%u job(s), %u client(s), %.0f tokens/s", s->draining ? "draining: " : "", n,
                   s->n_clients, tok_total);
}

static void on_watchdog(uv_timer_t *t) { sd_notify(0, "WATCHDOG=1"); }

static void on_stop_timer(uv_timer_t *t) {
    server *s = t->data;
    for (conn *c = s->conns; c; c = c->next) conn_close_now(c); /* clients that never read their reply */
    uv_close((uv_handle_t *)t, NULL);
}

static void close_if_open(uv_handle_t *h) {
    if (h->type != UV_UNKNOWN_HANDLE && !uv_is_closing(h)) uv_close(h, NULL);
}

static void walk_close(uv_handle_t *h, void *arg) { close_if_open(h); }

static void server_stop(server *s, const char *why) {
    if (s->stopping) return;
    s->stopping = 1;
    bt_log(BT_LOG_INFO, LOGC, "stopping: %s", why);
    sd_notifyf(0, "STOPPING=1\nSTATUS=stopping: %s", why);
    if (s->listening) uv_close((uv_handle_t *)&s->listener, NULL);
    s->listening = 0;
    while (s->jobs) job_teardown(s->jobs);
    for (conn *c = s->conns; c; c = c->next) conn_finish(c);
    uv_timer_init(s->loop, &s->stop_timer);
    s->stop_timer.data = s;
    uv_timer_start(&s->stop_timer, on_stop_timer, STOP_GRACE_MS, 0);
    uv_unref((uv_handle_t *)&s->stop_timer); /* does not by itself keep the loop alive */
    close_if_open((uv_handle_t *)&s->tick);
    close_if_open((uv_handle_t *)&s->watchdog);
    close_if_open((uv_handle_t *)&s->sig_term);
    close_if_open((uv_handle_t *)&s->sig_int);
    close_if_open((uv_handle_t *)&s->sig_hup);
}

static int load_config(server *s, cfg_ref **out) {
    cfg_ref *r = bt_xcalloc(1, sizeof *r);
    if (ld_config_load(&r->c, s->config_path)) {
        free(r);
        return BT_ERR_INVALID;
    }
    if (s->socket_override) {
        free(r->c.socket_path);
        r->c.socket_path = bt_xstrdup(s->socket_override);
    }
    r->refs = 1;
    *out = r;
    return BT_OK;
}

static void on_signal(uv_signal_t *h, int signum) {
    server *s = h->data;
    if (signum == SIGHUP) {
        sd_notify(0, "RELOADING=1");
        cfg_ref *n = NULL;
        if (load_config(s, &n)) {
            bt_log(BT_LOG_ERROR, LOGC, "reload of %s failed, keeping the running configuration: %s", s->config_path,
                   bt_last_error());
        } else {
            int d = ld_config_log_diff(&s->cfg->c, &n->c);
            bt_log(BT_LOG_INFO, LOGC, "reloaded %s: %d setting(s) changed", s->config_path, d);
            cfg_put(s->cfg);
            s->cfg = n;
        }
        sd_notify(0, "READY=1");
        return;
    }
    server_stop(s, signum == SIGTERM ? "SIGTERM" : "SIGINT");
}

static int start_listening(server *s) {
    const ld_config *c = &s->cfg->c;
    int rc = ld_socket_clear_stale(c->socket_path);
    if (rc) return rc;
    uv_pipe_init(s->loop, &s->listener, 0);
    s->listener.data = s;
    mode_t old = umask(0177); /* created 0600, then widened to socket_mode */
    int r = uv_pipe_bind(&s->listener, c->socket_path);
    umask(old);
    if (r != 0) {
        uv_close((uv_handle_t *)&s->listener, NULL);
        return bt_fail(BT_ERR_IO, "bind %s: %s", c->socket_path, uv_strerror(r));
    }
    s->listening = 1;
    s->socket_path = bt_xstrdup(c->socket_path);
    if ((rc = ld_socket_set_perms(c))) return rc;
    if ((r = uv_listen((uv_stream_t *)&s->listener, 128, on_connection)) != 0)
        return bt_fail(BT_ERR_IO, "listen %s: %s", c->socket_path, uv_strerror(r));
    return BT_OK;
}

int ld_server_run(const ld_server_opts *opts) {
    server srv, *s = &srv;
    memset(s, 0, sizeof *s);
    s->config_path = opts->config_path;
    s->socket_override = opts->socket_override;
    s->t_start = bt_now();
    s->next_job_id = 1;
    pthread_mutex_init(&s->tok_mu, NULL);
    if (load_config(s, &s->cfg)) {
        bt_log(BT_LOG_ERROR, LOGC, "%s", bt_last_error());
        pthread_mutex_destroy(&s->tok_mu);
        return 1;
    }
    if (s->cfg->c.n_data_roots == 0)
        bt_log(BT_LOG_WARN, LOGC, "no usable data_roots: every attach will be refused until the config lists one");
    uv_loop_t loop;
    uv_loop_init(&loop);
    s->loop = &loop;
    int exit_code = 0;
    if (start_listening(s)) {
        bt_log(BT_LOG_ERROR, LOGC, "%s", bt_last_error());
        sd_notifyf(0, "STATUS=failed: %s", bt_last_error());
        if (s->listening) uv_close((uv_handle_t *)&s->listener, NULL);
        s->listening = 0;
        s->stopping = 1;
        exit_code = 1;
    } else {
        uv_signal_init(s->loop, &s->sig_term);
        uv_signal_init(s->loop, &s->sig_int);
        uv_signal_init(s->loop, &s->sig_hup);
        s->sig_term.data = s->sig_int.data = s->sig_hup.data = s;
        uv_signal_start(&s->sig_term, on_signal, SIGTERM);
        uv_signal_start(&s->sig_int, on_signal, SIGINT);
        uv_signal_start(&s->sig_hup, on_signal, SIGHUP);
        uv_timer_init(s->loop, &s->tick);
        s->tick.data = s;
        uv_timer_start(&s->tick, on_tick, 1000, 1000);
        uint64_t wd_usec = 0;
        uv_timer_init(s->loop, &s->watchdog);
        if (sd_watchdog_enabled(0, &wd_usec) > 0 && wd_usec > 0) {
            uint64_t ms = wd_usec / 2000;
            uv_timer_start(&s->watchdog, on_watchdog, ms ? ms : 1, ms ? ms : 1);
        }
        bt_log(BT_LOG_INFO, LOGC, "listening on %s (mode %04o%s%s), %d data root(s), %d model root(s)%s",
               s->socket_path, s->cfg->c.socket_mode, s->cfg->c.socket_group ? ", group " : "",
               s->cfg->c.socket_group ? s->cfg->c.socket_group : "", s->cfg->c.n_data_roots, s->cfg->c.n_model_roots,
               opts->foreground ? " [foreground]" : "");
        sd_notifyf(0, "READY=1\nSTATUS=listening on %s\nMAINPID=%d", s->socket_path, (int)getpid());
    }
    uv_run(s->loop, UV_RUN_DEFAULT);
    /* the loop only ends once every handle is closed and every pool request finished */
    if (uv_loop_close(s->loop) != 0) {
        uv_walk(s->loop, walk_close, NULL);
        uv_run(s->loop, UV_RUN_DEFAULT);
        uv_loop_close(s->loop);
    }
    if (s->socket_path) {
        unlink(s->socket_path); /* libuv removes it on close; make sure */
        free(s->socket_path);
    }
    while (s->toks) { /* only reachable if a job leaked its reference */
        tok_entry *e = s->toks;
        s->toks = e->next;
        bt_tokenizer_free(e->tok);
        free(e->path);
        free(e);
    }
    cfg_put(s->cfg);
    pthread_mutex_destroy(&s->tok_mu);
    bt_log(BT_LOG_INFO, LOGC, "stopped");
    return exit_code;
}
