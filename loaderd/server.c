/* loaderd control server: lifecycle (contract: loaderd/server.h; internals:
 * loaderd/server_priv.h; protocol and lifecycle: proto/PROTOCOL.md §1-2).
 * Configuration load and SIGHUP reload, socket bind/permissions, signals, the 1 s tick
 * (rates, client timeouts, STATUS=), the systemd watchdog, and the orderly stop.
 * The rest of the server: server_conn.c (connections), server_jobs.c (jobs, producers),
 * server_status.c (status, metrics, drain, reload), server_proto.c (request parsing). */
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

void ld_cfg_put(cfg_ref *r) {
    if (r && --r->refs == 0) {
        ld_config_free(&r->c);
        free(r);
    }
}

/* ------------------------------------------------------------------ timers, signals, lifecycle */

static void on_tick(uv_timer_t *t) {
    server *s = t->data;
    double now = bt_now();
    double tok_total = ld_jobs_tick(s, now);
    uint32_t n = ld_job_count(s);
    ld_conn_check_timeouts(s, now);
    if (++s->ticks % 5 == 0)
        sd_notifyf(0, "STATUS=%s%u job(s), %u client(s), %.0f tokens/s", s->draining ? "draining: " : "", n,
                   s->n_clients, tok_total);
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

void ld_srv_stop(server *s, const char *why) {
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

int ld_srv_reload(server *s, int *changed) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    /* MONOTONIC_USEC: required by Type=notify-reload (systemd >= 253), ignored before */
    sd_notifyf(0, "RELOADING=1\nSTATUS=reloading %s\nMONOTONIC_USEC=%llu", s->config_path,
               (unsigned long long)ts.tv_sec * 1000000ull + (unsigned long long)ts.tv_nsec / 1000ull);
    cfg_ref *n = NULL;
    int rc = load_config(s, &n);
    *changed = 0;
    if (rc) {
        rc = bt_fail(BT_ERR_INVALID, "reload of %s failed, keeping the running configuration: %s", s->config_path,
                     bt_last_error());
        bt_log(BT_LOG_ERROR, LOGC, "%s", bt_last_error());
        s->reload_failures_total++;
    } else {
        *changed = ld_config_log_diff(&s->cfg->c, &n->c);
        bt_log(BT_LOG_INFO, LOGC, "reloaded %s: %d setting(s) changed", s->config_path, *changed);
        ld_cfg_put(s->cfg);
        s->cfg = n;
        s->reloads_total++;
        s->t_reload = bt_now();
    }
    sd_notifyf(0, "READY=1\nSTATUS=listening on %s (config %s)", s->socket_path, rc ? "reload failed" : "reloaded");
    return rc;
}

static void on_signal(uv_signal_t *h, int signum) {
    server *s = h->data;
    if (signum == SIGHUP) {
        int changed;
        ld_srv_reload(s, &changed);
        return;
    }
    ld_srv_stop(s, signum == SIGTERM ? "SIGTERM" : "SIGINT");
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
    if (load_config(s, &s->cfg)) {
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
