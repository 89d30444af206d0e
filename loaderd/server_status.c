/* loaderd control server: the operators' ops (internals and floors: loaderd/server_priv.h,
 * protocol: proto/PROTOCOL.md §1 "status, jobs, metrics, drain, hello"). status/jobs JSON,
 * Prometheus text exposition 0.0.4 (prometheus.io "Exposition formats": # HELP / # TYPE before
 * the samples, label values escaped \\ \" \n), drain, reload, hello (its "ops" from the command
 * table), and the 1 s tick that keeps the EWMA rates and the consumer progress. Calls only the
 * floors below it (server_jobs.c, server_conn.c, server_config.c). Loop thread only; job
 * counters are atomics written by producers. */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "loaderd/server_priv.h"
#include "loaderd/tcache.h"
#include "proto/client.h"

/* ------------------------------------------------------------------ per-job figures */

/* Batches produced by the pipeline (committed or waiting in the producer's hands) minus the
 * batches the trainer released. */
static uint64_t consumer_lag(job *j) {
    uint64_t produced = atomic_load(&j->stats.batches);
    return produced > j->consumed ? produced - j->consumed : 0;
}

static double packing_eff(job *j) {
    uint64_t slot = atomic_load(&j->stats.slot_tokens);
    return slot ? (double)atomic_load(&j->stats.tokens) / (double)slot : 0.0;
}

double ld_jobs_tick(server *s, double now) {
    double tok_total = 0;
    for (job *j = s->jobs; j; j = j->next) {
        ld_job_observe_consumer(j, now);
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
    }
    return tok_total;
}

/* ------------------------------------------------------------------ ranks of a run */

int ld_rank_behind(const ld_rank_progress *r, int n, int i, char *why, size_t why_n) {
    uint64_t top = 0;
    double freshest = INFINITY, period = 0;
    int any = 0;
    for (int k = 0; k < n; k++) {
        if (!r[k].has_report) continue;
        any = 1;
        if (r[k].step > top) top = r[k].step;
        if (r[k].age_s < freshest) freshest = r[k].age_s;
        if (r[k].period_s > period) period = r[k].period_s;
    }
    if (why && why_n) why[0] = 0;
    if (!any || n < 2) return 0;
    if (!r[i].has_report) {
        if (top < 2) return 0; /* the others have barely started */
        if (why) snprintf(why, why_n, "no report yet, the others are at step %llu", (unsigned long long)top);
        return 1;
    }
    if (top - r[i].step >= 2) {
        if (why) snprintf(why, why_n, "%llu steps behind", (unsigned long long)(top - r[i].step));
        return 1;
    }
    double lim = 3 * period > LD_BEHIND_MIN_S ? 3 * period : LD_BEHIND_MIN_S;
    if (r[i].age_s - freshest > lim) {
        if (why) snprintf(why, why_n, "no report for %.0f s, the others reported %.0f s ago", r[i].age_s, freshest);
        return 1;
    }
    return 0;
}

/* The ranks attached here that belong to j's training run: the same "run" when the trainer gave
 * one, else the same name, world size and user. Fills `out` (<= cap entries, j included) and
 * returns their number. */
static int run_members(server *s, job *j, job **out, int cap) {
    int n = 0;
    for (job *k = s->jobs; k && n < cap; k = k->next) {
        int same = j->run[0] ? !strcmp(k->run, j->run) && !strcmp(k->spec.name, j->spec.name)
                             : !k->run[0] && !strcmp(k->spec.name, j->spec.name) && k->world == j->world &&
                                   k->peer.uid == j->peer.uid;
        if (same) out[n++] = k;
    }
    return n;
}

/* "behind" and why, for job j among its run's ranks here. */
static int job_behind(server *s, job *j, double now, char *why, size_t n) {
    job *m[LD_MAX_STATUS_RANKS];
    ld_rank_progress p[LD_MAX_STATUS_RANKS];
    int k = run_members(s, j, m, LD_MAX_STATUS_RANKS), me = 0;
    for (int i = 0; i < k; i++) {
        p[i] = (ld_rank_progress){m[i]->has_report, m[i]->rep_step, now - m[i]->rep_t, m[i]->rep_period};
        if (m[i] == j) me = i;
    }
    return ld_rank_behind(p, k, me, why, n);
}

/* ------------------------------------------------------------------ status, jobs */

static json_t *num_or_null(double x) { return isfinite(x) ? json_real(x) : json_null(); }

/* A string for operators' eyes: names were checked at attach, but paths come from the disk
 * (realpath of a link may lead to any file name) and errors quote them: every control
 * character is made visible (bt_escape_text), here as in the log. */
static json_t *safe_str(const char *s) {
    char b[2048];
    bt_escape_text(b, sizeof b, s, strlen(s));
    return json_string(b);
}

static json_t *job_json(job *j, int full, double now) {
    int state = atomic_load(&j->state);
    ld_job_observe_consumer(j, now);
    json_t *o = json_pack("{s:I, s:o, s:I, s:I, s:s}", "job_id", (json_int_t)j->id, "name", safe_str(j->spec.name),
                          "rank", (json_int_t)j->rank, "world_size", (json_int_t)j->world, "state",
                          ld_job_state_name[state]);
    json_object_set_new(o, "peer_pid", json_integer(j->peer.pid));
    json_object_set_new(o, "batches", json_integer((json_int_t)atomic_load(&j->stats.batches)));
    json_object_set_new(o, "consumed", json_integer((json_int_t)j->consumed));
    if (state == JOB_FAILED) json_object_set_new(o, "error", safe_str(j->err));
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
    json_t *more = json_pack("{s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:f, s:f, s:f, s:I, s:I, s:o, s:I, s:I, s:o, s:f}",
                             "B", (json_int_t)j->B, "T", (json_int_t)j->T, "docs", U64(st->docs), "tokens",
                             U64(st->tokens), "labelled_tokens", U64(st->labelled), "lines", U64(st->lines),
                             "truncated", U64(st->truncated), "epoch", (json_int_t)atomic_load(&st->epoch),
                             "docs_per_s", j->docs_rate, "tokens_per_s", j->tok_rate, "packing_efficiency",
                             packing_eff(j), "ring_fill", (json_int_t)bt_ring_fill(&j->ring), "ring_slots",
                             (json_int_t)j->slots, "bad_lines", bad, "bad_lines_total", (json_int_t)bad_total,
                             "shards", (json_int_t)j->n_shards, "tokenizer", safe_str(j->spec.tokenizer), "attached_s",
                             now - j->t_attach);
#undef U64
    json_object_update(o, more);
    json_decref(more);
    json_object_set_new(o, "stream_ranks", json_integer(ld_pipeline_sharing(j->pipe)));
    json_object_set_new(o, "consumer_lag_batches", json_integer((json_int_t)consumer_lag(j)));
    json_object_set_new(o, "memory_bytes", json_integer((json_int_t)j->mem_bytes));
    json_object_set_new(o, "consumer_idle_s", json_real(now - j->t_last_take));
    json_object_set_new(o, "peer", json_pack("{s:i, s:I, s:I}", "pid", (int)j->peer.pid, "uid", (json_int_t)j->peer.uid,
                                             "gid", (json_int_t)j->peer.gid));
    if (j->has_report) {
        json_t *t = json_pack("{s:I, s:o, s:o, s:f}", "step", (json_int_t)j->rep_step, "loss",
                              num_or_null(j->rep_loss), "tokens_per_s", num_or_null(j->rep_tps), "age_s",
                              now - j->rep_t);
        json_object_set_new(t, "base", j->has_base ? json_pack("{s:s, s:s, s:f, s:I}", "dtype", j->base_dtype,
                                                               "types", j->base_types, "bits_per_weight",
                                                               j->base_bpw, "bytes", (json_int_t)j->base_bytes)
                                                   : json_null());
        json_object_set_new(o, "trainer", t);
    } else {
        json_object_set_new(o, "trainer", json_null());
    }
    json_object_set_new(o, "run", j->run[0] ? json_string(j->run) : json_null());
    char why[160];
    int behind = job_behind(j->s, j, now, why, sizeof why);
    json_object_set_new(o, "behind", json_boolean(behind));
    json_object_set_new(o, "behind_reason", behind ? json_string(why) : json_null());
    return o;
}

/* The token cache's counters (loaderd/tcache.h), in status and metrics. */
static const struct {
    const char *name, *help;
    size_t off;
} tc_fields[] = {
#define F(f, h) {#f, h, offsetof(ld_tcache_stats, f)}
    F(hits, "Token-cache lookups that found a valid entry."),
    F(misses, "Token-cache lookups that found no entry."),
    F(built, "Shards this loaderd tokenized into the token cache."),
    F(waited, "Token-cache lookups that waited for another loaderd building the entry."),
    F(damaged, "Token-cache entries found damaged (removed, rebuilt when needed)."),
    F(stale, "Token-cache entries holding another key, or shards that changed while tokenized."),
    F(bypassed, "Shards read without the token cache (unreadable, cache not writable, wait too long)."),
    F(evicted, "Token-cache entries removed to stay under token_cache_max_bytes."),
    F(build_bytes, "Shard bytes tokenized into the token cache."),
    F(build_tokens, "Tokens written into the token cache."),
    F(read_bytes, "Token-cache entry bytes read."),
    F(hashed_bytes, "Shard bytes hashed for token-cache keys."),
    F(temps_removed, "Temporary files of token-cache builders that died, removed (at start and while evicting)."),
    F(untrusted, "Token-cache lookups that did without the cache: a level of its tree is not loaderd's alone."),
    F(ref_tables, "Reference log-prob tables made (a shard under a job's reference key)."),
    F(ref_loaded, "Reference log-prob sidecars read from the token cache."),
    F(ref_refused, "Reference log-prob sidecars refused (damaged, or a key part differs; removed)."),
    F(ref_written, "Reference log-prob sidecars written (every value of a shard known)."),
    F(ref_accepted, "Reference log-probs put by trainers and kept."),
    F(ref_rejected, "Reference log-probs put by trainers and refused (malformed, unknown record, conflict)."),
    F(ref_served, "Preference segments given their cached reference log-prob in a batch."),
    F(ref_missed, "Preference segments of jobs with ref_base that had no cached reference log-prob yet."),
#undef F
};

static json_t *token_cache_json(server *s) {
    if (!s->tcache) return json_null();
    ld_tcache_stats *st = ld_tcache_stats_of(s->tcache);
    json_t *o = json_pack("{s:s, s:I, s:I}", "dir", ld_tcache_dir(s->tcache), "max_bytes",
                          (json_int_t)ld_tcache_max_bytes(s->tcache), "bytes", (json_int_t)atomic_load(&st->bytes));
    for (size_t i = 0; i < sizeof tc_fields / sizeof tc_fields[0]; i++)
        json_object_set_new(o, tc_fields[i].name,
                            json_integer((json_int_t)atomic_load((_Atomic uint64_t *)((char *)st + tc_fields[i].off))));
    return o;
}

/* status (full) and jobs (the job list only); op: the request's op, echoed */
static void status_reply(conn *c, const char *op, int full) {
    server *s = c->s;
    double now = bt_now();
    json_t *arr = json_array();
    for (job *j = s->jobs; j; j = j->next) json_array_append_new(arr, job_json(j, full, now));
    json_t *r = json_pack("{s:b, s:s, s:o}", "ok", 1, "op", op, "jobs", arr);
    if (full) {
        int n_tok = 0;
        pthread_mutex_lock(&s->tok_mu);
        for (tok_entry *e = s->toks; e; e = e->next) n_tok++;
        pthread_mutex_unlock(&s->tok_mu);
        json_t *refused = json_object();
        for (int i = 0; i < REFUSE_N; i++)
            json_object_set_new(refused, ld_refuse_name[i], json_integer((json_int_t)s->refused[i]));
        json_object_set_new(r, "uptime_s", json_real(now - s->t_start));
        json_object_set_new(r, "pid", json_integer(getpid()));
        json_object_set_new(r, "socket", json_string(s->socket_path));
        json_object_set_new(r, "draining", json_boolean(s->draining));
        json_object_set_new(r, "clients", json_integer(s->n_clients));
        json_object_set_new(r, "attaching", json_integer(s->n_attaching));
        json_object_set_new(r, "tokenizers_cached", json_integer(n_tok));
        uint32_t streams, cursors;
        ld_hub_counts(s->hub, &streams, &cursors);
        json_object_set_new(r, "streams", json_integer(streams));
        json_object_set_new(r, "token_cache", token_cache_json(s));
        json_object_set_new(r, "requests_total", json_integer((json_int_t)s->requests_total));
        json_object_set_new(r, "bad_requests_total", json_integer((json_int_t)s->bad_requests_total));
        json_object_set_new(r, "connections_total", json_integer((json_int_t)s->connections_total));
        json_object_set_new(r, "refused", refused);
        json_object_set_new(r, "reloads_total", json_integer((json_int_t)s->reloads_total));
        json_object_set_new(r, "sandbox", json_pack("{s:b}", "no_exec", s->no_exec));
        json_object_set_new(r, "max_jobs", json_integer(s->cfg->c.max_jobs));
        json_object_set_new(r, "max_clients", json_integer(s->cfg->c.max_clients));
        json_object_set_new(r, "client_timeout_s", json_integer(s->cfg->c.client_timeout_s));
        json_object_set_new(r, "max_clients_per_uid", json_integer(s->cfg->c.max_clients_per_uid));
        json_object_set_new(r, "memory_budget_bytes", json_integer((json_int_t)s->cfg->c.memory_budget_bytes));
        json_object_set_new(r, "memory_used_bytes", json_integer((json_int_t)atomic_load(&s->mem_used)));
        json_object_set_new(r, "tokenizer_memory_bytes", json_integer((json_int_t)atomic_load(&s->tok_mem)));
    }
    ld_conn_send(c, r);
}

void ld_op_status(conn *c, ld_request *rq) { status_reply(c, rq->cmd->name, 1); }
void ld_op_jobs(conn *c, ld_request *rq) { status_reply(c, rq->cmd->name, 0); }

/* ------------------------------------------------------------------ metrics */

/* Prometheus label value escaping (exposition format: backslash, double quote, newline), after
 * every control character was made visible (bt_escape_text: no raw ESC reaches whoever reads
 * the exposition on a terminal). */
static void prom_label(FILE *f, const char *raw) {
    char safe[1024];
    bt_escape_text(safe, sizeof safe, raw, strlen(raw));
    for (const char *v = safe; *v; v++) {
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

static void prom_value(FILE *f, double x) {
    if (isnan(x)) fputs(" NaN\n", f);
    else if (isinf(x)) fprintf(f, " %s\n", x > 0 ? "+Inf" : "-Inf");
    else fprintf(f, " %.17g\n", x);
}

typedef enum { M_DOCS, M_TOKENS, M_LABELLED, M_BATCHES, M_CONSUMED, M_LINES, M_TRUNC, M_EFF, M_FILL, M_SLOTS, M_LAG,
               M_IDLE, M_DRATE, M_TRATE, M_EPOCH, M_MEM, M_STEP, M_LOSS, M_TTPS, M_N } metric_id;
static const struct {
    const char *name, *type, *help;
} metrics[M_N] = {
    {"loaderd_documents_total", "counter", "Documents accepted into packed rows."},
    {"loaderd_tokens_total", "counter", "Real (non-padding) tokens packed."},
    {"loaderd_labelled_tokens_total", "counter", "Tokens carrying a loss label."},
    {"loaderd_batches_total", "counter", "Micro-batches produced."},
    {"loaderd_batches_consumed_total", "counter", "Micro-batches the trainer released from its ring."},
    {"loaderd_lines_total", "counter", "Input lines read."},
    {"loaderd_truncated_documents_total", "counter", "Documents truncated to seq_len."},
    {"loaderd_packing_efficiency", "gauge", "Real tokens / slot tokens (1 = no padding)."},
    {"loaderd_ring_fill", "gauge", "Ring slots holding batches not yet consumed."},
    {"loaderd_ring_slots", "gauge", "Ring capacity in slots."},
    {"loaderd_consumer_lag_batches", "gauge", "Batches produced minus batches consumed by the trainer."},
    {"loaderd_consumer_idle_seconds", "gauge", "Seconds since the trainer last took a batch (since attach if none)."},
    {"loaderd_documents_per_second", "gauge", "Documents per second (EWMA, ~5 s)."},
    {"loaderd_tokens_per_second", "gauge", "Tokenizer throughput: tokens tokenized and packed per second (EWMA, ~5 s)."},
    {"loaderd_epoch", "gauge", "Current epoch of the job's stream."},
    {"loaderd_job_memory_bytes", "gauge", "Memory reserved for the job: ring + pipeline buffers (memory_budget_bytes)."},
    {"loaderd_trainer_step", "gauge", "Last step reported by the trainer."},
    {"loaderd_trainer_loss", "gauge", "Last loss reported by the trainer."},
    {"loaderd_trainer_tokens_per_second", "gauge", "Last tokens/s reported by the trainer."},
};

static double metric_value(job *j, metric_id m, double now) {
    ld_stats *st = &j->stats;
    switch (m) {
    case M_DOCS: return (double)atomic_load(&st->docs);
    case M_TOKENS: return (double)atomic_load(&st->tokens);
    case M_LABELLED: return (double)atomic_load(&st->labelled);
    case M_BATCHES: return (double)atomic_load(&st->batches);
    case M_CONSUMED: return (double)j->consumed;
    case M_LINES: return (double)atomic_load(&st->lines);
    case M_TRUNC: return (double)atomic_load(&st->truncated);
    case M_EFF: return packing_eff(j);
    case M_FILL: return bt_ring_fill(&j->ring);
    case M_SLOTS: return j->slots;
    case M_LAG: return (double)consumer_lag(j);
    case M_IDLE: return now - j->t_last_take;
    case M_DRATE: return j->docs_rate;
    case M_TRATE: return j->tok_rate;
    case M_EPOCH: return atomic_load(&st->epoch);
    case M_MEM: return (double)j->mem_bytes;
    case M_STEP: return j->has_report ? (double)j->rep_step : NAN;
    case M_LOSS: return j->has_report ? j->rep_loss : NAN;
    case M_TTPS: return j->has_report ? j->rep_tps : NAN;
    default: return NAN;
    }
}

void ld_op_metrics(conn *c, ld_request *rq) {
    server *s = c->s;
    double now = bt_now();
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f) {
        ld_conn_reply_error(c, rq->cmd->name, "out of memory");
        return;
    }
    double tok_total = 0;
    for (job *j = s->jobs; j; j = j->next) {
        ld_job_observe_consumer(j, now);
        tok_total += j->tok_rate;
    }
    const struct {
        const char *name, *type, *help;
        double v;
    } glob[] = {
        {"loaderd_uptime_seconds", "gauge", "Seconds since loaderd started.", now - s->t_start},
        {"loaderd_clients", "gauge", "Connected control-socket clients.", s->n_clients},
        {"loaderd_jobs", "gauge", "Attached jobs.", ld_job_count(s)},
        {"loaderd_draining", "gauge", "1 while draining.", s->draining},
        {"loaderd_connections_total", "counter", "Control-socket connections accepted.", (double)s->connections_total},
        {"loaderd_requests_total", "counter", "Control requests received.", (double)s->requests_total},
        {"loaderd_bad_requests_total", "counter", "Malformed control requests.", (double)s->bad_requests_total},
        {"loaderd_reloads_total", "counter", "Successful configuration reloads (SIGHUP).", (double)s->reloads_total},
        {"loaderd_tokenizer_tokens_per_second", "gauge", "Tokenizer throughput summed over all jobs (EWMA, ~5 s).",
         tok_total},
        {"loaderd_memory_budget_bytes", "gauge",
         "memory_budget_bytes: rings + pipeline buffers of all jobs + the tokenizers they use.",
         (double)s->cfg->c.memory_budget_bytes},
        {"loaderd_memory_used_bytes", "gauge",
         "Memory reserved by attached jobs, attaches in preparation and loaded tokenizers.",
         (double)atomic_load(&s->mem_used)},
        {"loaderd_tokenizer_memory_bytes", "gauge", "Memory held by loaded tokenizers (each counted once).",
         (double)atomic_load(&s->tok_mem)},
    };
    for (size_t g = 0; g < sizeof glob / sizeof glob[0]; g++) {
        fprintf(f, "# HELP %s %s\n# TYPE %s %s\n%s", glob[g].name, glob[g].help, glob[g].name, glob[g].type,
                glob[g].name);
        prom_value(f, glob[g].v);
    }
    uint32_t streams, cursors;
    ld_hub_counts(s->hub, &streams, &cursors);
    fprintf(f, "# HELP loaderd_streams Pipeline streams (one per job and start position; its ranks share it).\n"
               "# TYPE loaderd_streams gauge\nloaderd_streams %u\n", streams);
    if (s->tcache) {
        ld_tcache_stats *st = ld_tcache_stats_of(s->tcache);
        fprintf(f, "# HELP loaderd_token_cache_bytes Size of the token cache's entries and live builders' temporary files.\n"
                   "# TYPE loaderd_token_cache_bytes gauge\nloaderd_token_cache_bytes %llu\n",
                (unsigned long long)atomic_load(&st->bytes));
        for (size_t i = 0; i < sizeof tc_fields / sizeof tc_fields[0]; i++)
            fprintf(f, "# HELP loaderd_token_cache_%s_total %s\n# TYPE loaderd_token_cache_%s_total counter\n"
                       "loaderd_token_cache_%s_total %llu\n", tc_fields[i].name, tc_fields[i].help, tc_fields[i].name,
                    tc_fields[i].name,
                    (unsigned long long)atomic_load((_Atomic uint64_t *)((char *)st + tc_fields[i].off)));
    }
    fputs("# HELP loaderd_refused_connections_total Connections closed by loaderd, by reason.\n"
          "# TYPE loaderd_refused_connections_total counter\n", f);
    for (int i = 0; i < REFUSE_N; i++)
        fprintf(f, "loaderd_refused_connections_total{reason=\"%s\"} %llu\n", ld_refuse_name[i],
                (unsigned long long)s->refused[i]);
    for (int m = 0; m < M_N; m++) {
        fprintf(f, "# HELP %s %s\n# TYPE %s %s\n", metrics[m].name, metrics[m].help, metrics[m].name, metrics[m].type);
        for (job *j = s->jobs; j; j = j->next) {
            double x = metric_value(j, (metric_id)m, now);
            if (isnan(x) && m >= M_STEP) continue; /* no trainer report yet */
            fputs(metrics[m].name, f);
            prom_labels(f, j);
            fputc('}', f);
            prom_value(f, x);
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
    json_t *r = json_pack("{s:b, s:s, s:s, s:s%}", "ok", 1, "op", rq->cmd->name, "format", "prometheus-text-0.0.4",
                          "text", text, len);
    free(text);
    ld_conn_send(c, r);
}

/* ------------------------------------------------------------------ drain, reload, hello */

/* drain and reload are LD_OPERATORS rows of the command table: server.c refused everyone else. */
void ld_op_drain(conn *c, ld_request *rq) {
    server *s = c->s;
    uint32_t n = ld_job_count(s);
    if (!s->draining)
        bt_log(BT_LOG_INFO, LOGC, "drain requested by pid %d uid %u: %u job(s) left", (int)c->cred.pid,
               (unsigned)c->cred.uid, n);
    s->draining = 1;
    sd_notifyf(0, "STATUS=draining: %u job(s) left", n);
    ld_conn_send(c, json_pack("{s:b, s:s, s:I}", "ok", 1, "op", rq->cmd->name, "jobs", (json_int_t)n));
    ld_check_drained(s);
}

/* "reload": the SIGHUP reload, asked for over the socket by an operator (`loaderctl reload`, the
 * unit's ExecReload=), answered with its outcome so that `systemctl reload` fails when the new
 * configuration is refused (the running one is kept either way). */
void ld_op_reload(conn *c, ld_request *rq) {
    server *s = c->s;
    bt_log(BT_LOG_INFO, LOGC, "reload requested by pid %d uid %u", (int)c->cred.pid, (unsigned)c->cred.uid);
    int changed = 0;
    if (ld_srv_reload(s, &changed)) {
        ld_conn_reply_error(c, rq->cmd->name, "%s", bt_last_error());
        return;
    }
    ld_conn_send(c, json_pack("{s:b, s:s, s:s, s:i}", "ok", 1, "op", rq->cmd->name, "config", s->config_path,
                              "changed", changed));
}

void ld_op_hello(conn *c, ld_request *rq) {
    json_t *ops = json_array();
    for (const ld_command *k = c->s->commands; k->name; k++) json_array_append_new(ops, json_string(k->name));
    ld_conn_send(c, json_pack("{s:b, s:s, s:i, s:i, s:i, s:i, s:o, s:I, s:I, s:I}", "ok", 1, "op", rq->cmd->name,
                              "proto", BT_PROTO_VERSION, "min_proto", BT_PROTO_VERSION, "ring_version",
                              (int)BT_RING_VERSION, "batch_layout_version", (int)BT_BATCH_LAYOUT_VERSION, "ops", ops,
                              "pid", (json_int_t)getpid(), "uid", (json_int_t)c->cred.uid, "gid",
                              (json_int_t)c->cred.gid));
}
