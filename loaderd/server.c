/* loaderd control server, the top floor (contract: loaderd/server.h; internals and the floors
 * below: loaderd/server_priv.h; protocol and lifecycle: proto/PROTOCOL.md §1-2).
 * The command table and the dispatch of each request line to its row's handler; configuration
 * load and SIGHUP reload, socket bind/permissions, signals, the 1 s tick (rates, client
 * timeouts, STATUS=, a stop a handler asked for), the systemd watchdog, and the orderly stop. */
#include "loaderd/server.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "loaderd/sandbox.h"
#include "loaderd/server_priv.h"
#include "loaderd/tcache.h"

/* ------------------------------------------------------------------ the command table */

/* The ops loaderd answers (proto/PROTOCOL.md §1), one row each: name, the parser of its own
 * arguments (server_proto.c), its handler (server_jobs.c: the trainers' ops; server_status.c:
 * the operators'), who may call it. The hello reply's "ops", the "unknown op (...)" refusal and
 * the operators-only refusal are made from this table: adding an op is one row here. */
static const ld_command commands[] = {
    {"hello", NULL, ld_op_hello, LD_ANYONE},
    {"attach", ld_parse_attach, ld_op_attach, LD_ANYONE},
    {"detach", ld_parse_detach, ld_op_detach, LD_ANYONE},
    {"report", ld_parse_report, ld_op_report, LD_ANYONE},
    {"ref_put", ld_parse_ref_put, ld_op_ref_put, LD_ANYONE}, /* the attaching connection's own job only */
    {"status", NULL, ld_op_status, LD_ANYONE},
    {"jobs", NULL, ld_op_jobs, LD_ANYONE},
    {"metrics", NULL, ld_op_metrics, LD_ANYONE},
    {"drain", NULL, ld_op_drain, LD_OPERATORS},
    {"reload", NULL, ld_op_reload, LD_OPERATORS},
    {NULL, NULL, NULL, LD_ANYONE},
};

const ld_command *ld_server_commands(void) { return commands; }

/* One request line from the transport (hooks.request): parse it against the table, check who
 * may call its op, run the row's handler. A complete, valid request is the connection's
 * activity (client_timeout_s), whether or not its op is allowed to the caller. */
static void on_request(conn *c, char *line, size_t n) {
    server *s = c->s;
    s->requests_total++;
    ld_request rq;
    if (ld_request_parse(&rq, s->commands, line, n, s->cfg->c.max_json_depth)) {
        s->bad_requests_total++;
        ld_conn_reply_error(c, rq.op_name, "%s", bt_last_error());
    } else {
        c->t_active = bt_now();
        if (rq.cmd->who == LD_OPERATORS && !c->is_operator) {
            bt_log(BT_LOG_WARN, LOGC, "%s refused for pid %d uid %u (operators only: root, loaderd's own user, "
                   "operator_groups)", rq.cmd->name, (int)c->cred.pid, (unsigned)c->cred.uid);
            ld_conn_reply_error(c, rq.cmd->name, "%s is allowed for operators only (root, loaderd's own user and the "
                                "members of operator_groups)", rq.cmd->name);
        } else {
            rq.cmd->handler(c, &rq);
        }
    }
    ld_request_free(&rq);
}

/* ------------------------------------------------------------------ timers, signals, lifecycle */

static void srv_stop(server *s, const char *why);

/* A stop a handler asked for (ld_srv_want_stop: draining and nothing left). */
static void check_stop(server *s) {
    if (s->stop_why && !s->stopping) srv_stop(s, s->stop_why);
}

static void on_wake(uv_async_t *a) { check_stop(a->data); }

static void on_tick(uv_timer_t *t) {
    server *s = t->data;
    double now = bt_now();
    double tok_total = ld_jobs_tick(s, now);
    uint32_t n = ld_job_count(s);
    ld_conn_check_timeouts(s, now);
    if (++s->ticks % 5 == 0)
        sd_notifyf(0, "STATUS=%s%u job(s), %u client(s), %.0f tokens/s", s->draining ? "draining: " : "", n,
                   s->n_clients, tok_total);
    check_stop(s);
}

static void on_watchdog(uv_timer_t *t) { sd_notify(0, "WATCHDOG=1"); }

static void on_stop_timer(uv_timer_t *t) {
    server *s = t->data;
    for (conn *c = s->conns, *nx; c; c = nx) {
        nx = c->next;
        ld_conn_close_now(c);
    } /* clients that never read their reply */
    uv_close((uv_handle_t *)t, NULL);
}

static void close_if_open(uv_handle_t *h) {
    if (h->type != UV_UNKNOWN_HANDLE && !uv_is_closing(h)) uv_close(h, NULL);
}

static void walk_close(uv_handle_t *h, void *arg) { close_if_open(h); }

static void srv_stop(server *s, const char *why) {
    if (s->stopping) return;
    s->stopping = 1;
    bt_log(BT_LOG_INFO, LOGC, "stopping: %s", why);
    sd_notifyf(0, "STOPPING=1\nSTATUS=stopping: %s", why);
    if (s->listening) uv_close((uv_handle_t *)&s->listener, NULL);
    s->listening = 0;
    while (s->jobs) ld_job_teardown(s->jobs);
    for (conn *c = s->conns, *nx; c; c = nx) {
        nx = c->next;
        ld_conn_finish(c);
    }
    uv_timer_init(s->loop, &s->stop_timer);
    s->stop_timer.data = s;
    uv_timer_start(&s->stop_timer, on_stop_timer, STOP_GRACE_MS, 0);
    uv_unref((uv_handle_t *)&s->stop_timer); /* does not by itself keep the loop alive */
    close_if_open((uv_handle_t *)&s->tick);
    close_if_open((uv_handle_t *)&s->watchdog);
    close_if_open((uv_handle_t *)&s->sig_term);
    close_if_open((uv_handle_t *)&s->sig_int);
    close_if_open((uv_handle_t *)&s->sig_hup);
    close_if_open((uv_handle_t *)&s->wake);
}

static void on_signal(uv_signal_t *h, int signum) {
    server *s = h->data;
    if (signum == SIGHUP) {
        int changed;
        ld_srv_reload(s, &changed);
        return;
    }
    srv_stop(s, signum == SIGTERM ? "SIGTERM" : "SIGINT");
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
    if ((r = uv_listen((uv_stream_t *)&s->listener, 128, ld_conn_on_connection)) != 0)
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
    /* every path loaderd opens from here on (tokenizers, shards) was resolved and checked against
     * the roots first: a symbolic link met at open time was swapped in since (proto/PROTOCOL.md) */
    bt_open_refuse_symlinks(1);
    pthread_mutex_init(&s->tok_mu, NULL);
    s->commands = commands;
    s->hooks = (ld_conn_hooks){on_request, ld_jobs_drop_conn};
    if (ld_cfg_load(s, &s->cfg)) {
        bt_log(BT_LOG_ERROR, LOGC, "%s", bt_last_error());
        pthread_mutex_destroy(&s->tok_mu);
        return 1;
    }
    /* loaderd never runs a program: refuse execve/execveat to every thread from here on */
    if (ld_sandbox_no_exec() == BT_OK) s->no_exec = 1;
    else bt_log(BT_LOG_WARN, LOGC, "%s: going on without it (the unit's NoExecPaths= still holds)", bt_last_error());
    if (s->cfg->c.n_data_roots == 0)
        bt_log(BT_LOG_WARN, LOGC, "no usable data_roots: every attach will be refused until the config lists one");
    if (s->cfg->c.token_cache_dir && ld_tcache_open(&s->tcache, s->cfg->c.token_cache_dir, s->cfg->c.token_cache_max_bytes,
                                                    s->cfg->c.token_cache_wait_s) != BT_OK) {
        bt_log(BT_LOG_ERROR, LOGC, "%s", bt_last_error());
        sd_notifyf(0, "STATUS=failed: %s", bt_last_error());
        ld_cfg_put(s->cfg);
        pthread_mutex_destroy(&s->tok_mu);
        return 1;
    }
    ld_hub_new(&s->hub, s->tcache);
    uv_loop_t loop;
    uv_loop_init(&loop);
    s->loop = &loop;
    int exit_code = 0;
    /* signals first: a SIGTERM arriving as soon as the socket exists must still stop cleanly */
    uv_signal_init(s->loop, &s->sig_term);
    uv_signal_init(s->loop, &s->sig_int);
    uv_signal_init(s->loop, &s->sig_hup);
    s->sig_term.data = s->sig_int.data = s->sig_hup.data = s;
    uv_signal_start(&s->sig_term, on_signal, SIGTERM);
    uv_signal_start(&s->sig_int, on_signal, SIGINT);
    uv_signal_start(&s->sig_hup, on_signal, SIGHUP);
    uv_async_init(s->loop, &s->wake, on_wake);
    s->wake.data = s;
    if (start_listening(s)) {
        bt_log(BT_LOG_ERROR, LOGC, "%s", bt_last_error());
        sd_notifyf(0, "STATUS=failed: %s", bt_last_error());
        if (s->listening) uv_close((uv_handle_t *)&s->listener, NULL);
        s->listening = 0;
        s->stopping = 1;
        exit_code = 1;
        close_if_open((uv_handle_t *)&s->sig_term);
        close_if_open((uv_handle_t *)&s->sig_int);
        close_if_open((uv_handle_t *)&s->sig_hup);
        close_if_open((uv_handle_t *)&s->wake);
    } else {
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
    ld_hub_free(s->hub); /* every job (and so every pipeline) is gone */
    ld_tcache_free(s->tcache);
    ld_cfg_put(s->cfg);
    pthread_mutex_destroy(&s->tok_mu);
    bt_log(BT_LOG_INFO, LOGC, "stopped");
    return exit_code;
}
