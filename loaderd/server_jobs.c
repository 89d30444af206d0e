/* loaderd control server: the trainers' ops and their jobs (internals and floors:
 * loaderd/server_priv.h, protocol: proto/PROTOCOL.md). Tokenizer cache shared by jobs, attach
 * (checked on the loop thread, prepared on the libuv thread pool: path policy, tokenizer, ring,
 * pipeline; reply with the ring memfd as SCM_RIGHTS), detach/report, one producer thread per
 * job, the consumer's progress, teardown (join off the loop thread). Calls only the floors
 * below it (server_conn.c, server_config.c). */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "loaderd/refstore.h"
#include "loaderd/server_priv.h"
#include "loaderd/tcache.h"
#include "proto/client.h"

const char *const ld_job_state_name[] = {"running", "done", "stopped", "failed"};

typedef struct {
    uv_work_t w;
    server *s;
    conn *c;
    const char *op; /* the request's op (its table row's name), for the reply */
    cfg_ref *cfg;
    json_t *job_obj; /* deep copy, owned by the request */
    uint32_t rank, world;
    char run[LD_RUN_MAX + 1];
    int has_resume;
    uint8_t resume[BT_RESUME_STATE_BYTES];
    uint32_t resume_world; /* 0: world */
    job *j; /* result */
    char err[512]; /* the failure's message (bt_last_error is per thread: made on the pool, read on the loop) */
} attach_req;

/* ------------------------------------------------------------------ tokenizer cache */

static double mib(uint64_t b) { return (double)b / 1048576.0; }

/* Reserve `need` bytes of memory_budget_bytes (any thread: a CAS loop, so attaches racing on the
 * pool never overshoot it). 1 when reserved, 0 when it does not fit (*used: what was in use). */
static int budget_take(server *s, uint64_t budget, uint64_t need, uint64_t *used) {
    *used = atomic_load(&s->mem_used);
    do {
        if (*used + need > budget) return 0;
    } while (!atomic_compare_exchange_weak(&s->mem_used, used, *used + need));
    return 1;
}

/* The load itself runs without tok_mu: the loop thread takes the lock (ld_tok_put, status) and
 * must never wait on a slow tokenizer load. Two attaches racing on the same new path may both
 * load it; the loser frees its copy and uses the cached one.
 * Memory: a tokenizer is counted in memory_budget_bytes once, whatever number of jobs share it.
 * Before loading, the most the load may take (bt_tokenizer_load_estimate: from the file's
 * counts, refusing a vocabulary past the bounds) is reserved, and the attach refused when it
 * does not fit; once loaded the reservation becomes what the tokenizer holds
 * (bt_tokenizer_mem_bytes), released with the entry. */
static tok_entry *tok_find_ref(server *s, const char *path) {
    tok_entry *e = s->toks;
    while (e && strcmp(e->path, path)) e = e->next;
    if (e) e->refs++;
    return e;
}

/* The cached tokenizer of `path` (a reference), loaded and counted in the budget when it is not
 * cached; NULL with the reason in bt_last_error() (BT_ERR_* of the estimate or the load, or the
 * budget's figures). Any thread. */
static tok_entry *tok_get(server *s, uint64_t budget, const char *path) {
    pthread_mutex_lock(&s->tok_mu);
    tok_entry *e = tok_find_ref(s, path);
    pthread_mutex_unlock(&s->tok_mu);
    if (e) return e;
    uint64_t est = 0, used = 0;
    if (bt_tokenizer_load_estimate(path, &est) != BT_OK) {
        const char *why = bt_last_error_in("tokenizer");
        size_t pl = strlen(path);
        if (strncmp(why, path, pl) == 0 && why[pl] == ':' && why[pl + 1] == ' ') why += pl + 2;
        bt_fail(BT_ERR_INVALID, "tokenizer %s: %s", path, why);
        return NULL;
    }
    if (!budget_take(s, budget, est, &used)) {
        bt_fail(BT_ERR_RANGE,
                 "not enough of loaderd's memory budget to load tokenizer %s: it needs up to %.1f MiB, %.1f MiB of "
                 "memory_budget_bytes %.1f MiB are in use (%.1f MiB free): use a tokenizer another job has loaded, "
                 "wait for jobs to end, or ask the operator to raise memory_budget_bytes",
                 path, mib(est), mib(used), mib(budget), mib(budget > used ? budget - used : 0));
        return NULL;
    }
    bt_tokenizer *t = NULL;
    double t0 = bt_now();
    if (bt_tokenizer_load(&t, path)) {
        atomic_fetch_sub(&s->mem_used, est);
        /* the loader's messages already say "tokenizer: <path>: ..." */
        const char *why = bt_last_error_in("tokenizer");
        size_t pl = strlen(path);
        if (strncmp(why, path, pl) == 0 && why[pl] == ':' && why[pl + 1] == ' ') why += pl + 2;
        bt_fail(BT_ERR_INVALID, "tokenizer %s: %s", path, why);
        return NULL;
    }
    uint64_t held = bt_tokenizer_mem_bytes(t);
    /* the reservation becomes what it holds (the estimate bounds it; stay right if it did not) */
    if (held <= est) atomic_fetch_sub(&s->mem_used, est - held);
    else atomic_fetch_add(&s->mem_used, held - est);
    bt_log(BT_LOG_INFO, LOGC, "loaded tokenizer %s (vocab %d, %.1f MiB) in %.2f s", path, bt_tokenizer_vocab_size(t),
           mib(held), bt_now() - t0);
    pthread_mutex_lock(&s->tok_mu);
    e = tok_find_ref(s, path);
    if (!e) {
        e = bt_xcalloc(1, sizeof *e);
        e->path = bt_xstrdup(path);
        e->tok = t;
        e->refs = 1;
        e->mem_bytes = held;
        atomic_fetch_add(&s->tok_mem, held);
        e->next = s->toks;
        s->toks = e;
        t = NULL;
    }
    pthread_mutex_unlock(&s->tok_mu);
    if (t) { /* another attach cached the same tokenizer meanwhile */
        bt_tokenizer_free(t);
        atomic_fetch_sub(&s->mem_used, held);
    }
    return e;
}

void ld_tok_put(server *s, tok_entry *e) {
    if (!e) return;
    pthread_mutex_lock(&s->tok_mu);
    if (--e->refs == 0) {
        for (tok_entry **pp = &s->toks; *pp; pp = &(*pp)->next)
            if (*pp == e) {
                *pp = e->next;
                break;
            }
        atomic_fetch_sub(&s->mem_used, e->mem_bytes);
        atomic_fetch_sub(&s->tok_mem, e->mem_bytes);
        bt_tokenizer_free(e->tok);
        free(e->path);
        free(e);
    }
    pthread_mutex_unlock(&s->tok_mu);
}

/* ------------------------------------------------------------------ producer, teardown */

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
            if (rc < 0 && atomic_load(&j->stop)) break; /* cancelled by the teardown: not a failure */
            if (rc < 0) {
                snprintf(j->err, sizeof j->err, "pipeline: %s", bt_last_error_in("pipeline"));
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

void ld_job_free(job *j) {
    if (j->pipe) ld_pipeline_free(j->pipe);
    if (j->ring.hdr) bt_ring_close(&j->ring);
    if (j->mem_bytes) atomic_fetch_sub(&j->s->mem_used, j->mem_bytes);
    ld_tok_put(j->s, j->tok);
    ld_job_spec_free(&j->spec);
    free(j);
}

static void teardown_work(uv_work_t *w) {
    job *j = w->data;
    if (j->thread_started) pthread_join(j->thread, NULL);
    if (j->pipe) ld_pipeline_free(j->pipe);
    j->pipe = NULL;
}

void ld_check_drained(server *s) {
    if (s->draining && !s->stopping && !s->jobs && !s->n_attaching) ld_srv_want_stop(s, "drained: no jobs left");
}

static void teardown_done(uv_work_t *w, int status) {
    job *j = w->data;
    server *s = j->s;
    ld_job_free(j);
    ld_check_drained(s);
}

/* Free a job that never went into s->jobs (its producer never started) off the loop thread:
 * ld_pipeline_free joins tokenizer threads that may be in the middle of a chunk. */
static void job_discard(job *j) {
    j->teardown.data = j;
    if (uv_queue_work(j->s->loop, &j->teardown, teardown_work, teardown_done) != 0) {
        teardown_work(&j->teardown); /* cannot happen with a live loop; stay correct anyway */
        teardown_done(&j->teardown, 0);
    }
}

void ld_jobs_drop_conn(conn *c) {
    for (job *j = c->s->jobs, *nx; j; j = nx) {
        nx = j->next;
        if (j->owner == c) ld_job_teardown(j);
    }
}

void ld_job_observe_consumer(job *j, double now) {
    if (!j->ring.hdr) return;
    /* head is ours; tail is the trainer's and only trusted when it is possible */
    uint64_t head = atomic_load_explicit(&j->ring.hdr->head, memory_order_acquire);
    uint64_t tail = atomic_load_explicit(&j->ring.hdr->tail, memory_order_acquire);
    if (tail > head || head - tail > j->slots || tail < j->consumed) return;
    if (tail != j->consumed) {
        j->consumed = tail;
        j->t_last_take = now;
    }
}

uint32_t ld_job_count(const server *s) {
    uint32_t n = 0;
    for (const job *j = s->jobs; j; j = j->next) n++;
    return n;
}

void ld_job_teardown(job *j) {
    server *s = j->s;
    for (job **pp = &s->jobs; *pp; pp = &(*pp)->next)
        if (*pp == j) {
            *pp = j->next;
            break;
        }
    ld_job_observe_consumer(j, bt_now());
    if (j->owner) j->owner->n_jobs--;
    bt_log(BT_LOG_INFO, LOGC, "job %u (%s rank %u/%u) detached after %.1f s: %llu batches, %llu consumed, %llu docs",
           j->id, j->spec.name, j->rank, j->world, bt_now() - j->t_attach,
           (unsigned long long)atomic_load(&j->stats.batches), (unsigned long long)j->consumed,
           (unsigned long long)atomic_load(&j->stats.docs));
    j->owner = NULL;
    atomic_store(&j->stop, 1);
    bt_ring_consumer_close(&j->ring); /* wakes a producer blocked on a full ring */
    ld_pipeline_cancel(j->pipe);      /* ... and one waiting for the window it needs */
    j->teardown.data = j;
    if (uv_queue_work(s->loop, &j->teardown, teardown_work, teardown_done) != 0) {
        teardown_work(&j->teardown); /* cannot happen with a live loop; stay correct anyway */
        teardown_done(&j->teardown, 0);
    }
}

/* ------------------------------------------------------------------ attach */

/* Reserve ring + pipeline bytes of the job in the global memory_budget_bytes (budget_take). 0,
 * or 1 with r->err set. */
static int mem_reserve(attach_req *r, job *j, uint64_t ring, uint64_t pipe) {
    uint64_t need = ring + pipe, budget = r->cfg->c.memory_budget_bytes, used;
    if (!budget_take(r->s, budget, need, &used)) {
        snprintf(r->err, sizeof r->err,
                 "not enough of loaderd's memory budget: this job needs %.1f MiB (ring %.1f MiB + pipeline "
                 "buffers %.1f MiB), %.1f MiB of memory_budget_bytes %.1f MiB are in use by other jobs and "
                 "tokenizers (%.1f MiB free): use a smaller ring_slots / micro_batch_size x seq_len / "
                 "tokenizer_threads, wait for jobs to end, or ask the operator to raise memory_budget_bytes",
                 mib(need), mib(ring), mib(pipe), mib(used), mib(budget), mib(budget > used ? budget - used : 0));
        return 1;
    }
    j->mem_bytes = need;
    return 0;
}

/* Resolve one "shards" array (object `holder`, key "shards") with the path policy and replace it
 * by the resolved, glob-escaped paths. `where` names it in messages ("shards",
 * "datasets[1].shards"). Adds the file count to *n_total. 0, or 1 with r->err set. */
static int resolve_shards_in(attach_req *r, json_t *holder, const char *where, int *n_total) {
    json_t *sh = json_object_get(holder, "shards");
    if (!json_is_array(sh) || json_array_size(sh) == 0 || json_array_size(sh) > 100000) {
        snprintf(r->err, sizeof r->err, "job spec: \"%s\": expected a non-empty array of absolute paths/globs", where);
        return 1;
    }
    int n_pats = (int)json_array_size(sh), n_files = 0, rc = 0;
    char **pats = bt_xcalloc((size_t)n_pats, sizeof *pats), **files = NULL;
    for (int i = 0; i < n_pats && !rc; i++) {
        const char *p = json_string_value(json_array_get(sh, (size_t)i));
        if (!p) {
            snprintf(r->err, sizeof r->err, "job spec: \"%s\"[%d]: expected a string", where, i);
            rc = 1;
        } else {
            pats[i] = bt_xstrdup(p);
        }
    }
    if (!rc && ld_resolve_shards(&r->cfg->c, pats, n_pats, &files, &n_files)) {
        snprintf(r->err, sizeof r->err, "%s", bt_last_error());
        rc = 1;
    }
    if (!rc) {
        json_t *arr = json_array();
        for (int i = 0; i < n_files; i++) json_array_append_new(arr, json_string(files[i]));
        json_object_set_new(holder, "shards", arr);
        *n_total += n_files;
    }
    ld_free_strv(files, n_files);
    ld_free_strv(pats, n_pats);
    return rc;
}

/* Thread pool: everything slow about an attach. On failure req->err is set, req->j NULL.
 * The pipeline only ever sees paths that passed the policy: every "shards" (top level and in
 * each of "datasets") and "tokenizer" are replaced by their resolved forms. */
static void attach_work(uv_work_t *w) {
    attach_req *r = w->data;
    const ld_config *cfg = &r->cfg->c;
    json_t *o = r->job_obj;
    char *tokpath = NULL, *text = NULL;
    int n_files = 0;
    job *j = NULL;
    json_t *ds = json_object_get(o, "datasets");
    const char *tk = json_string_value(json_object_get(o, "tokenizer"));
    if (ds) {
        if (!json_is_array(ds) || json_array_size(ds) == 0 || json_array_size(ds) > 64) {
            snprintf(r->err, sizeof r->err, "job spec: \"datasets\": expected a non-empty array of dataset objects");
            goto out;
        }
        for (size_t i = 0; i < json_array_size(ds); i++) {
            json_t *d = json_array_get(ds, i);
            char where[64];
            snprintf(where, sizeof where, "datasets[%zu].shards", i);
            if (!json_is_object(d)) {
                snprintf(r->err, sizeof r->err, "job spec: \"datasets\"[%zu]: expected an object", i);
                goto out;
            }
            if (resolve_shards_in(r, d, where, &n_files)) goto out;
        }
    }
    if ((!ds || json_object_get(o, "shards")) && resolve_shards_in(r, o, "shards", &n_files)) goto out;
    if (!tk) {
        snprintf(r->err, sizeof r->err, "job spec: \"tokenizer\": required (absolute path of a .gguf)");
        goto out;
    }
    if (ld_resolve_tokenizer(cfg, tk, &tokpath)) {
        snprintf(r->err, sizeof r->err, "%s", bt_last_error());
        goto out;
    }
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
    if (!text || ld_job_spec_parse(&j->spec, text, NULL)) {
        snprintf(r->err, sizeof r->err, "%s", text ? bt_last_error() : "job spec: cannot re-encode");
        free(j);
        j = NULL;
        goto out;
    }
    j->spec.rank = r->rank;
    j->spec.world_size = r->world;
    j->spec.resume_world = r->resume_world;
    j->spec.ref_uid = (uint32_t)r->c->cred.uid; /* a reference-key part: set at accept, never changes */
    if (!json_is_integer(tt) || j->spec.n_threads > cfg->tokenizer_threads) j->spec.n_threads = cfg->tokenizer_threads;
    j->B = j->spec.B;
    j->T = j->spec.T;
    j->rank = r->rank;
    j->world = r->world;
    memcpy(j->run, r->run, sizeof j->run);
    j->slots = slots;
    j->n_shards = n_files;
    size_t sb = bt_batch_slot_bytes(j->B, j->T);
    if (sb == 0 || (uint64_t)sb * slots > cfg->max_ring_bytes) {
        snprintf(r->err, sizeof r->err, "ring of %u slots x %ux%u tokens (%llu bytes) exceeds max_ring_bytes %llu",
                 slots, j->B, j->T, (unsigned long long)sb * slots, (unsigned long long)cfg->max_ring_bytes);
        goto fail_job;
    }
    if (mem_reserve(r, j, (uint64_t)sb * slots, ld_pipeline_mem_estimate(&j->spec))) goto fail_job;
    if (!(j->tok = tok_get(r->s, cfg->memory_budget_bytes, j->spec.tokenizer))) {
        snprintf(r->err, sizeof r->err, "%s", bt_last_error());
        goto fail_job;
    }
    j->vocab = bt_tokenizer_vocab_size(j->tok->tok);
    if (bt_ring_create(&j->ring, slots, j->B, j->T)) {
        snprintf(r->err, sizeof r->err, "%s", bt_last_error());
        goto fail_job;
    }
    if (ld_pipeline_attach(&j->pipe, r->s->hub, &j->spec, j->tok->tok, r->has_resume ? r->resume : NULL, &j->stats)) {
        snprintf(r->err, sizeof r->err, "%s", bt_last_error());
        j->pipe = NULL;
        goto fail_job;
    }
    r->j = j;
    goto out;
fail_job:
    r->j = NULL;
    ld_job_free(j); /* ld_tok_put is thread-safe; nothing else in j is shared yet */
out:
    free(text);
    free(tokpath);
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
        ld_conn_write(c, copy, rest);
    }
    return BT_OK;
}

static void attach_reply(conn *c, const char *op, job *j) {
    json_t *rep = json_pack("{s:b, s:s, s:I, s:I, s:I, s:I, s:I, s:s, s:I, s:I}", "ok", 1, "op", op, "job_id",
                            (json_int_t)j->id, "B", (json_int_t)j->B, "T", (json_int_t)j->T, "slots",
                            (json_int_t)j->slots, "vocab", (json_int_t)j->vocab, "name", j->spec.name, "slot_bytes",
                            (json_int_t)j->ring.slot_bytes, "shards", (json_int_t)j->n_shards);
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
        ld_conn_close_now(c); /* tears the job down */
        return;
    }
    free(text);
    bt_log(BT_LOG_INFO, LOGC,
           "job %u attached: \"%s\" rank %u/%u B=%u T=%u slots=%u shards=%d tokenizer=%s peer pid=%d uid=%u gid=%u",
           j->id, j->spec.name, j->rank, j->world, j->B, j->T, j->slots, j->n_shards, j->spec.tokenizer,
           (int)c->cred.pid, (unsigned)c->cred.uid, (unsigned)c->cred.gid);
}

static void attach_done(uv_work_t *w, int status) {
    attach_req *r = w->data;
    server *s = r->s;
    conn *c = r->c;
    job *j = r->j;
    s->n_attaching--;
    c->pending--;
    c->busy = 0;
    c->t_active = bt_now();
    if (!j) {
        bt_log(BT_LOG_WARN, LOGC, "attach refused for pid %d uid %u: %s", (int)c->cred.pid, (unsigned)c->cred.uid,
               r->err);
        if (!c->closing) ld_conn_reply_error(c, r->op, "%s", r->err);
    } else if (c->closing || s->stopping) {
        job_discard(j);
    } else {
        j->id = s->next_job_id++;
        j->owner = c;
        j->peer = c->cred;
        j->t_attach = j->last_t = j->t_last_take = bt_now();
        if (pthread_create(&j->thread, NULL, producer_main, j) != 0) {
            ld_conn_reply_error(c, r->op, "cannot start a producer thread");
            job_discard(j);
        } else {
            j->thread_started = 1;
            j->next = s->jobs;
            s->jobs = j;
            c->n_jobs++;
            attach_reply(c, r->op, j);
        }
    }
    json_decref(r->job_obj);
    ld_cfg_put(r->cfg);
    free(r);
    if (c->handle_closed) ld_conn_maybe_free(c);
    else if (!c->closing) ld_conn_process(c);
    ld_check_drained(s);
}

void ld_op_attach(conn *c, ld_request *rq) {
    server *s = c->s;
    const char *op = rq->cmd->name;
    if (s->draining || s->stopping) {
        ld_conn_reply_error(c, op, "loaderd is draining: no new attaches");
        return;
    }
    if (ld_job_count(s) + s->n_attaching >= s->cfg->c.max_jobs) {
        bt_log(BT_LOG_WARN, LOGC, "attach refused for pid %d uid %u: max_jobs %u reached", (int)c->cred.pid,
               (unsigned)c->cred.uid, s->cfg->c.max_jobs);
        ld_conn_reply_error(c, op, "too many jobs (max_jobs %u)", s->cfg->c.max_jobs);
        return;
    }
    attach_req *r = bt_xcalloc(1, sizeof *r);
    r->w.data = r;
    r->s = s;
    r->c = c;
    r->op = op;
    r->cfg = s->cfg;
    s->cfg->refs++;
    r->job_obj = json_deep_copy(rq->job);
    r->rank = rq->rank;
    r->world = rq->world;
    memcpy(r->run, rq->run, sizeof r->run);
    r->has_resume = rq->has_resume;
    memcpy(r->resume, rq->resume, sizeof r->resume);
    r->resume_world = rq->resume_world;
    if (!r->job_obj || uv_queue_work(s->loop, &r->w, attach_work, attach_done) != 0) {
        json_decref(r->job_obj);
        ld_cfg_put(r->cfg);
        free(r);
        ld_conn_reply_error(c, op, "cannot queue the attach");
        return;
    }
    c->busy = 1;
    c->pending++;
    s->n_attaching++;
}

/* ------------------------------------------------------------------ detach, report */

static job *find_own_job(conn *c, ld_request *rq) {
    for (job *j = c->s->jobs; j; j = j->next) {
        if (j->owner != c) continue;
        if (!rq->has_job_id || rq->job_id == j->id) return j;
    }
    ld_conn_reply_error(c, rq->cmd->name, rq->has_job_id ? "no job with this \"job_id\" is attached on this connection"
                                              : "no job is attached on this connection");
    return NULL;
}

void ld_op_detach(conn *c, ld_request *rq) {
    job *j = find_own_job(c, rq);
    if (!j) return;
    uint32_t id = j->id;
    ld_job_teardown(j);
    ld_conn_send(c, json_pack("{s:b, s:s, s:I}", "ok", 1, "op", rq->cmd->name, "job_id", (json_int_t)id));
}

/* A reference table whose last value a ref_put brought: its sidecar is written on libuv's thread
 * pool (a file write, fsync and directory scan never run on the event loop). */
typedef struct {
    uv_work_t w;
    ld_reftab *t;
} ref_write;

static void ref_write_work(uv_work_t *w) { ld_reftab_complete(((ref_write *)w->data)->t); }

static void ref_write_done(uv_work_t *w, int status) {
    (void)status;
    free(w->data);
}

static void ref_write_queue(server *s, ld_reftab *t) {
    ref_write *r = bt_xcalloc(1, sizeof *r);
    r->t = t;
    r->w.data = r;
    if (uv_queue_work(s->loop, &r->w, ref_write_work, ref_write_done) != 0) {
        ref_write_work(&r->w); /* cannot happen with a live loop; stay correct anyway */
        ref_write_done(&r->w, 0);
    }
}

/* ref_put: a trainer hands back reference log-probs of its job's records (loaderd/refstore.h). The
 * base must be the job's ref_base; each value is checked and stored or refused on its own. */
void ld_op_ref_put(conn *c, ld_request *rq) {
    job *j = find_own_job(c, rq);
    if (!j) return;
    size_t n = json_array_size(rq->ref_values);
    ld_tcache_stats *st = c->s->tcache ? ld_tcache_stats_of(c->s->tcache) : NULL;
    if (!j->spec.ref_base || strcmp(j->spec.ref_base, rq->ref_base) != 0) {
        if (st) atomic_fetch_add_explicit(&st->ref_rejected, n, memory_order_relaxed);
        if (!j->spec.ref_base)
            ld_conn_reply_error(c, rq->cmd->name, "job %u has no \"ref_base\" (give it in the job spec to keep reference "
                                "log-probs)", j->id);
        else
            ld_conn_reply_error(c, rq->cmd->name, "\"base\" \"%s\" does not match job %u's ref_base \"%s\": values "
                                "computed with another reference model are refused", rq->ref_base, j->id, j->spec.ref_base);
        return;
    }
    size_t accepted = 0, rejected = 0;
    json_t *errors = json_array();
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_array_get(rq->ref_values, i);
        char why[200];
        int ok = 0;
        if (!json_is_array(e) || json_array_size(e) != 4 || !json_is_integer(json_array_get(e, 0)) ||
            !json_is_integer(json_array_get(e, 1)) || !json_is_integer(json_array_get(e, 2)) ||
            !json_is_number(json_array_get(e, 3))) {
            snprintf(why, sizeof why, "expected [shard, line, side, logp] (three integers and a number)");
            if (st) atomic_fetch_add_explicit(&st->ref_rejected, 1, memory_order_relaxed);
        } else {
            ld_reftab *done = NULL;
            ok = ld_pipeline_ref_put(j->pipe, json_integer_value(json_array_get(e, 0)),
                                     json_integer_value(json_array_get(e, 1)), json_integer_value(json_array_get(e, 2)),
                                     json_number_value(json_array_get(e, 3)), why, sizeof why, &done) == BT_OK;
            if (done) ref_write_queue(c->s, done);
        }
        if (ok) {
            accepted++;
            continue;
        }
        rejected++;
        if (json_array_size(errors) < 8) {
            char m[260];
            snprintf(m, sizeof m, "values[%zu]: %s", i, why);
            json_array_append_new(errors, json_string(m));
        }
    }
    if (rejected)
        bt_log(BT_LOG_WARN, LOGC, "job %u ref_put from pid %d: %zu of %zu values refused, first: %s", j->id,
               (int)c->cred.pid, rejected, n, json_string_value(json_array_get(errors, 0)));
    ld_conn_send(c, json_pack("{s:b, s:s, s:I, s:I, s:o}", "ok", 1, "op", rq->cmd->name, "accepted",
                              (json_int_t)accepted, "rejected", (json_int_t)rejected, "errors", errors));
}

void ld_op_report(conn *c, ld_request *rq) {
    job *j = find_own_job(c, rq);
    if (!j) return;
    double now = bt_now();
    if (j->has_report && rq->step > j->rep_step) /* the trainer's step period, for `behind` */
        j->rep_period = (now - j->rep_t) / (double)(rq->step - j->rep_step);
    j->has_report = 1;
    j->rep_step = rq->step;
    j->rep_loss = rq->loss;
    j->rep_tps = rq->tokens_per_s;
    j->rep_t = now;
    if (rq->has_base) {
        j->has_base = 1;
        memcpy(j->base_dtype, rq->base_dtype, sizeof j->base_dtype);
        memcpy(j->base_types, rq->base_types, sizeof j->base_types);
        j->base_bpw = rq->base_bpw;
        j->base_bytes = rq->base_bytes;
    }
    ld_conn_send(c, json_pack("{s:b, s:s}", "ok", 1, "op", rq->cmd->name));
}
