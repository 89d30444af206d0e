/* loaderd control server internals. Not a public API. The files are floors; calls and includes
 * only go down (scripts/depgraph.py checks it, tests/py/test_layering.py):
 *   server.c         lifecycle (signals, the 1 s tick, the systemd watchdog, the orderly stop) and
 *                    the command table: every op is one row {name, parse, handler, who}; it
 *                    parses each request line (server_proto.c) and runs the row's handler
 *   server_status.c  the operators' ops: status, jobs, metrics, drain, reload, hello; rate ticks
 *   server_jobs.c    the trainers' ops: attach, detach, report; tokenizer cache, producer
 *                    threads, teardown (the ranks of a job share one pipeline stream, ld_hub)
 *   server_conn.c    transport: accept, peer checks, slot limits, line framing, timeouts,
 *                    backpressure, replies; it hands each request line up through ld_conn_hooks
 *                    and never names an op
 *   server_config.c  the running configuration: load, reload, references
 *   server_proto.c   a request line -> a checked request (no server state)
 * A handler that wants loaderd to stop says so with ld_srv_want_stop (state the tick reads); it
 * never calls up into server.c.
 *
 * Threads: the libuv loop thread owns every connection, the job list and the configuration;
 * attach preparation (path resolution, tokenizer load, ring and pipeline creation) and job
 * teardown (joining the producer) run on the libuv thread pool; each job has one producer
 * thread that only touches its own pipeline, ring, stats (atomics) and state word.
 * The ring memory is shared with a possibly hostile trainer: the producer builds each batch in
 * private memory and copies it into the slot, so nothing the trainer writes is ever read back
 * except the consumer's tail, which is range-checked. */
#ifndef LD_SERVER_PRIV_H
#define LD_SERVER_PRIV_H
#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/socket.h>
#include <uv.h>

#include "common/tokenizer.h"
#include "loaderd/config.h"
#include "loaderd/pipeline.h"
#include "loaderd/server_proto.h"
#include "proto/batch.h"
#include "proto/ring.h"

#define LOGC "loaderd"
#define READ_CHUNK 65536
#define WRITE_HIGH_WATER (4u << 20) /* pause reading a client whose replies pile up */
#define RATE_TAU_S 5.0              /* EWMA time constant of docs/s and tokens/s */
#define STOP_GRACE_MS 3000          /* force-close clients that do not read their last reply */
#define MAX_PEER_GROUPS 256         /* supplementary groups read with SO_PEERGROUPS */

enum { JOB_RUNNING = 0, JOB_DONE, JOB_STOPPED, JOB_FAILED };
extern const char *const ld_job_state_name[];

enum { REFUSE_MAX_CLIENTS = 0, REFUSE_PERMISSION, REFUSE_TIMEOUT, REFUSE_TOO_LONG, REFUSE_PER_UID, REFUSE_N };
extern const char *const ld_refuse_name[];

typedef struct cfg_ref {
    ld_config c;
    int refs; /* loop thread only */
} cfg_ref;

typedef struct tok_entry {
    char *path;
    bt_tokenizer *tok;
    int refs;
    uint64_t mem_bytes; /* reserved in server.mem_used while the entry lives (bt_tokenizer_mem_bytes) */
    struct tok_entry *next;
} tok_entry;

struct server;
struct conn;

typedef struct job {
    struct server *s;
    struct conn *owner; /* NULL once torn down */
    uint32_t id, rank, world, B, T, slots;
    char run[LD_RUN_MAX + 1]; /* the attach's "run" ("" when the trainer gave none) */
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
    uint64_t mem_bytes; /* reserved in server.mem_used (ring + pipeline buffers) */
    int32_t vocab;
    int n_shards;
    /* rates and consumer progress (loop thread) */
    double last_t, docs_rate, tok_rate;
    uint64_t last_docs, last_tokens;
    uint64_t consumed;  /* batches the trainer released (ring tail, range-checked) */
    double t_last_take; /* when `consumed` last moved (attach time until the first) */
    /* last trainer report */
    int has_report;
    uint64_t rep_step;
    double rep_loss, rep_tps, rep_t;
    double rep_period; /* seconds per step between its last two reports (0 = unknown) */
    int has_base; /* the trainer's frozen base, from its reports */
    char base_dtype[16], base_types[64];
    double base_bpw;
    uint64_t base_bytes;
    struct job *next;
    uv_work_t teardown;
} job;

/* What the transport hands up (set by server.c before listening; server_conn.c calls nothing
 * above itself). */
typedef struct {
    /* one complete request line (trailing '\r', blanks removed; never empty); the line's bytes
     * may be modified and are valid until return */
    void (*request)(struct conn *c, char *line, size_t n);
    /* the connection is going away (peer gone, refused, stop): drop what it owns */
    void (*closing)(struct conn *c);
} ld_conn_hooks;

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
    int is_operator;        /* root, loaderd's uid or operator_groups (may call LD_OPERATORS ops) */
    uint32_t n_jobs;        /* jobs attached on this connection (kept by server_jobs.c) */
    int reserve;            /* an operator's connection past the slot limits (OPERATOR_RESERVE) */
    double t_active;        /* last complete, valid request (or accept, or attach done) */
    double t_partial;       /* when the pending partial line started; 0 = none */
    uv_shutdown_t sreq;
    struct conn *next, *prev;
} conn;

typedef struct server {
    uv_loop_t *loop;
    uv_pipe_t listener;
    uv_signal_t sig_term, sig_int, sig_hup;
    uv_timer_t tick, watchdog, stop_timer;
    uv_async_t wake;             /* runs the tick's stop check at once (ld_srv_want_stop) */
    const char *stop_why;        /* a stop asked for by a handler (static text), NULL: none */
    ld_conn_hooks hooks;         /* the transport's way up (server.c) */
    const ld_command *commands;  /* the command table (server.c), for hello's "ops" */
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
    struct ld_tcache *tcache; /* token cache (NULL: none), from token_cache_dir at start */
    ld_hub *hub;              /* one stream per job: the ranks' pipelines meet here */
    uint64_t connections_total, requests_total, bad_requests_total;
    uint64_t refused[REFUSE_N];
    _Atomic uint64_t mem_used; /* bytes reserved by jobs, attaches in preparation and tokenizers (any thread) */
    _Atomic uint64_t tok_mem;  /* of which the cached tokenizers (each counted once, however many jobs use it) */
    double t_reload;     /* last successful reload (0: never) */
    uint64_t reloads_total, reload_failures_total;
    int no_exec;         /* ld_sandbox_no_exec() holds for this process (status: sandbox.no_exec) */
} server;

/* Ask the server to stop (why: static text for the log): the state the tick reads, acted on at
 * once through s->wake. For handlers (drain): they never call server.c. Loop thread. */
static inline void ld_srv_want_stop(server *s, const char *why) {
    if (s->stopping || s->stop_why) return;
    s->stop_why = why;
    uv_async_send(&s->wake);
}

/* server_config.c */
/* Load s->config_path (with s->socket_override applied) into a new reference (*out, refs 1).
 * BT_OK or BT_ERR_INVALID / BT_ERR_IO / BT_ERR_FORMAT with the reason in bt_last_error(). */
int ld_cfg_load(server *s, cfg_ref **out);
/* Re-read s->config_path (SIGHUP and the "reload" op): on success the new configuration replaces
 * the running one, the changes are logged one line each, *changed gets their count and 0 is
 * returned; on failure the running configuration is kept, the reason is logged and left in
 * bt_last_error(), and BT_ERR_INVALID is returned. Notifies systemd (RELOADING=1 ... READY=1). */
int ld_srv_reload(server *s, int *changed);
void ld_cfg_put(cfg_ref *r);

/* server_conn.c */
void ld_conn_on_connection(uv_stream_t *ls, int status);
/* Queue `msg` (reference stolen) as one reply line ("v" added). */
void ld_conn_send(conn *c, json_t *msg);
/* Queue {"ok":false,"error":...,"op"?}; returns 0. */
int ld_conn_reply_error(conn *c, const char *op, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Queue raw bytes (malloc'd, ownership taken). */
void ld_conn_write(conn *c, char *data, size_t n);
/* Stop reading, let queued replies drain, then close. */
void ld_conn_finish(conn *c);
/* Close at once (hooks.closing drops what the connection owns). */
void ld_conn_close_now(conn *c);
/* Handle buffered complete lines (after an attach finished or backpressure eased). */
void ld_conn_process(conn *c);
/* Release a connection whose handle closed once no pool request points at it. */
void ld_conn_maybe_free(conn *c);
/* Close connections idle / stuck in a partial line beyond client_timeout_s (tick). */
void ld_conn_check_timeouts(server *s, double now);

/* server_jobs.c */
void ld_tok_put(server *s, tok_entry *e);
void ld_job_teardown(job *j);
void ld_job_free(job *j);
uint32_t ld_job_count(const server *s);
/* Tear down the jobs attached on c (its hooks.closing). */
void ld_jobs_drop_conn(conn *c);
/* Ask for a stop when draining and nothing is left (ld_srv_want_stop). */
void ld_check_drained(server *s);
/* Update j->consumed / j->t_last_take from the ring (loop thread). */
void ld_job_observe_consumer(job *j, double now);
void ld_op_attach(conn *c, ld_request *rq);
void ld_op_detach(conn *c, ld_request *rq);
void ld_op_report(conn *c, ld_request *rq);
void ld_op_ref_put(conn *c, ld_request *rq);

/* ---- status of a training run's ranks (server_status.c) ---- */
#define LD_BEHIND_MIN_S 30.0   /* a rank silent this much longer than the freshest one is behind */
#define LD_MAX_STATUS_RANKS 256 /* ranks of one run looked at together */
typedef struct {
    int has_report;  /* the rank reported at least once */
    uint64_t step;   /* its last reported step */
    double age_s;    /* seconds since that report */
    double period_s; /* seconds per step between its last two reports (0 = unknown) */
} ld_rank_progress;
/* Whether rank r[i] of the n ranks of one run (those attached to this loaderd) falls behind the
 * others. Synchronous data-parallel ranks report the same step, at most one apart while a step
 * ends, at about the same time. Behind: its step is 2 or more below the highest; or it never
 * reported while another rank reached step 2; or its last report is older than the freshest
 * one by more than max(LD_BEHIND_MIN_S, 3 x the longest step period seen). Never with fewer
 * than 2 ranks or no report at all. why (may be NULL): a short reason ("3 steps behind"). */
int ld_rank_behind(const ld_rank_progress *r, int n, int i, char *why, size_t why_n);

/* server_status.c: the operators' ops (handlers of the command table) */
void ld_op_hello(conn *c, ld_request *rq);
void ld_op_status(conn *c, ld_request *rq);
void ld_op_jobs(conn *c, ld_request *rq);
void ld_op_metrics(conn *c, ld_request *rq);
void ld_op_drain(conn *c, ld_request *rq);
void ld_op_reload(conn *c, ld_request *rq);
/* Refresh rates and consumer progress of every job (1 s tick); returns total tokens/s. */
double ld_jobs_tick(server *s, double now);

#endif
