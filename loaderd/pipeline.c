/* loaderd data pipeline: datasets -> merged line stream -> (workers) documents -> windows ->
 * packed rows dealt to ranks -> batches. Contract and policies: pipeline.h.
 *
 * Threads: one reader thread walks every dataset's shards (sorted, deduplicated glob matches)
 * and merges their lines with smooth weighted round robin into one stream; every non-blank line
 * of an epoch gets a merged index n (0, 1, ...; over-long lines get one too, blank lines do not)
 * and, within its dataset, a pass number and line index g. Lines are copied into chunks of up to
 * LD_CHUNK_LINES lines, placed in a ring of Q chunks (backpressure: the reader waits for a free
 * slot). n_threads workers take chunks in sequence order and format + tokenize them (format.c).
 * The consumer (the thread calling ld_pipeline_next) takes finished chunks strictly by sequence
 * number, so everything downstream is independent of thread count and timing.
 *
 * Windows: the consumer collects documents (in n order) into a window until it holds
 * win_tokens = min(LD_WINDOW_ROWS * T, max(LD_WINDOW_MAX_TOKENS, 2T)) tokens or LD_WINDOW_DOCS
 * documents, or the epoch ends. The window is packed with best-fit decreasing (packer.c), its
 * rows shuffled by a seed derived from (spec seed, epoch, window start n), padded to a multiple
 * of world_size and dealt round robin to the ranks. A window is self-contained (no rows carried
 * over), so it is a pure function of its start position. With 256-row windows packing loses
 * well under 1% on chat SFT data (measured by tests/bench/bench_loaderd.sh).
 *
 * Resume state (BT_RESUME_STATE_BYTES, little-endian, see encode_state): magic, version, a hash
 * of the spec, the next step, the epoch, merged start n and per-dataset (pass, line) of the
 * window that holds the next row, and how many of this rank's rows of it were already emitted
 * (or a "finished" flag). Resuming reopens each dataset at its pass and skips its first g lines
 * (decoded and counted, not parsed), restarts the schedule at n (SWRR credits repeat every W
 * picks, so they are rebuilt by replaying n mod W picks), rebuilds the window and drops the rows
 * already emitted: the batches are exactly those of an uninterrupted run. Stats of a resumed
 * pipeline count only what it processed.
 *
 * Bad input: line-level reasons (json, utf8, field, empty, too_long, overlong) are counted by
 * the consumer in stream order; shard-level ones (zstd, io) by the reader. Every rank counts
 * every bad line (every rank reads every line). Logged as "path:line: reason: detail", the first
 * LD_LOG_FIRST per reason and then every LD_LOG_EVERY-th. */
#include "loaderd/pipeline.h"

#include <glob.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/bt_common.h"
#include "common/gguf.h"
#include "loaderd/format.h"
#include "loaderd/packer.h"
#include "loaderd/source.h"

#define LD_CHUNK_LINES 64
#define LD_CHUNK_BYTES ((size_t)8 << 20)
#define LD_WINDOW_ROWS 256u
#define LD_WINDOW_DOCS 65536u
#define LD_WINDOW_MAX_TOKENS ((uint64_t)1 << 22)
#define LD_WEIGHT_SCALE 1000.0
#define LD_LOG_FIRST 20
#define LD_LOG_EVERY 1000
#define LD_STATE_MAGIC 0x3153444Cu /* "LDS1" */
#define LD_STATE_VERSION 2u
#define LD_STATE_F_FINISHED 1u

static const char *const BAD_NAMES[LD_BAD_N] = {"json", "utf8", "field", "empty", "too_long", "zstd", "io", "overlong"};

const char *ld_bad_reason_name(int reason) {
    return (reason >= 0 && reason < LD_BAD_N) ? BAD_NAMES[reason] : "unknown";
}

#define ADD(field, n) atomic_fetch_add_explicit(&p->stats->field, (uint64_t)(n), memory_order_relaxed)

typedef struct {
    uint32_t pass; /* pass (epoch) of the dataset */
    uint64_t g;    /* index of the next line within that pass */
} dpos;

typedef struct {
    uint32_t first, n; /* paths[first .. first + n) */
    uint32_t q;        /* integer SWRR weight, 1..1000 */
    char *text_field;
    ld_format_cfg fcfg;
} dataset;

typedef struct {
    uint64_t g;       /* merged index within the epoch */
    uint64_t dg;      /* line index within its dataset's pass */
    uint64_t line_no; /* 1-based, in its shard */
    uint32_t file;    /* index into paths */
    uint32_t ds, pass;
    int pre_bad;      /* reason found by the reader (too_long), else -1 */
    size_t off, len;  /* line bytes in the chunk's text */
    /* filled by a worker */
    int bad; /* -1 ok, else ld_bad_reason */
    int truncated;
    bt_ids ids, mask;
    char msg[120];
} item;

enum { SLOT_EMPTY = 0, SLOT_READER, SLOT_FILLED, SLOT_WORKING, SLOT_DONE };

typedef struct {
    uint64_t seq;
    int state;
    uint32_t epoch;
    int end_epoch; /* last chunk of its epoch */
    int last;      /* last chunk of the whole stream (finite epochs) */
    item *items;
    size_t n, cap;
    char *text;
    size_t tlen, tcap;
} chunk;

typedef struct {
    ld_pack_doc *docs;
    bt_ids *ids, *mask;
    size_t n_docs, cap;
    uint64_t tokens;
    ld_pack_plan plan;
    size_t my_rows;  /* rows of this rank: ceil(plan.n_rows / world) */
    size_t next_row; /* of this rank's rows */
    uint32_t epoch;
    uint64_t start_g;
    dpos start_pos[LD_MAX_DATASETS];
    int ends_epoch, last, built;
} window;

/* reader's cursor in one dataset */
typedef struct {
    dpos pos;         /* pos.g = lines passed in this pass */
    uint64_t skip_to; /* resume: lines of the pass to skip */
    uint32_t file;    /* index within the dataset */
    ld_source *src;
} rcur;

struct ld_pipeline {
    /* configuration */
    uint32_t T, B, rank, world, epochs, n_threads;
    uint64_t seed, spec_hash;
    char **paths;
    size_t n_paths;
    dataset ds[LD_MAX_DATASETS];
    uint32_t n_ds, W; /* W = sum of q */
    int32_t pad_id;
    ld_stats *stats;
    ld_stats own_stats;
    uint64_t win_tokens;
    /* threads and queue (all under mu) */
    pthread_mutex_t mu;
    pthread_cond_t cv_reader, cv_worker, cv_consumer;
    chunk *ring;
    size_t Q;
    uint64_t next_fill, next_work, next_take;
    int stop, reader_done, fatal;
    char fatal_msg[512];
    pthread_t reader;
    pthread_t *workers;
    uint32_t n_workers;
    int reader_started;
    /* reader start */
    uint32_t start_epoch;
    uint64_t start_g;
    dpos start_pos[LD_MAX_DATASETS];
    uint64_t log_seen_reader[LD_BAD_N];
    /* consumer */
    uint64_t log_seen[LD_BAD_N];
    window win;
    chunk *cc;
    size_t cc_pos;
    uint32_t c_epoch;
    uint64_t c_g, epoch_docs;
    dpos c_pos[LD_MAX_DATASETS];
    int epoch_from_start, exhausted, data_done, finished;
    size_t skip_rows;
    uint64_t step;
    int err; /* sticky error of ld_pipeline_next */
    char err_msg[512];
};

/* ---------------------------------------------------------------- helpers */

static void set_fatal(ld_pipeline *p, int code, const char *msg) {
    pthread_mutex_lock(&p->mu);
    if (!p->fatal) {
        p->fatal = code;
        size_t n = strlen(msg);
        if (n >= sizeof p->fatal_msg) n = sizeof p->fatal_msg - 1;
        memcpy(p->fatal_msg, msg, n);
        p->fatal_msg[n] = 0;
    }
    pthread_cond_broadcast(&p->cv_reader);
    pthread_cond_broadcast(&p->cv_worker);
    pthread_cond_broadcast(&p->cv_consumer);
    pthread_mutex_unlock(&p->mu);
}

static int log_due(uint64_t *seen, int reason) {
    uint64_t n = ++seen[reason];
    return n <= LD_LOG_FIRST || n % LD_LOG_EVERY == 0;
}

/* Count a bad line and log it (rate-limited) from the reader (seen = log_seen_reader) or the
 * consumer (seen = log_seen): each reason is only ever counted by one of the two. */
static void count_bad(ld_pipeline *p, uint64_t *seen, int reason, uint32_t file, uint64_t line_no,
                      const char *detail) {
    ADD(bad[reason], 1);
    if (log_due(seen, reason))
        bt_log(BT_LOG_WARN, "loaderd", "%s:%llu: %s: %s (%llu so far, rank %u)",
               file < p->n_paths ? p->paths[file] : "?", (unsigned long long)line_no,
               ld_bad_reason_name(reason), detail, (unsigned long long)seen[reason], p->rank);
}

static uint64_t mix3(uint64_t a, uint64_t b, uint64_t c) {
    uint64_t x = a;
    uint64_t h = ld_splitmix64(&x);
    x = h ^ b;
    h = ld_splitmix64(&x);
    x = h ^ c;
    return ld_splitmix64(&x);
}

static int is_blank(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (s[i] != ' ' && s[i] != '\t' && s[i] != '\r' && s[i] != '\f' && s[i] != '\v') return 0;
    return 1;
}

/* Smooth weighted round robin (nginx ngx_http_upstream_get_peer): one pick. */
static uint32_t swrr_pick(const ld_pipeline *p, int64_t *credit) {
    uint32_t best = 0;
    for (uint32_t d = 0; d < p->n_ds; d++) {
        credit[d] += p->ds[d].q;
        if (credit[d] > credit[best]) best = d;
    }
    credit[best] -= p->W;
    return best;
}

/* Credits after n picks from a fresh start: the schedule repeats every W picks. */
static void swrr_at(const ld_pipeline *p, int64_t *credit, uint64_t n) {
    memset(credit, 0, LD_MAX_DATASETS * sizeof *credit);
    for (uint64_t i = 0; i < n % p->W; i++) swrr_pick(p, credit);
}

/* ---------------------------------------------------------------- reader thread */

/* Wait for the next ring slot to be free and claim it; NULL when stopping. */
static chunk *claim_slot(ld_pipeline *p, uint32_t epoch) {
    pthread_mutex_lock(&p->mu);
    chunk *c = &p->ring[p->next_fill % p->Q];
    while (c->state != SLOT_EMPTY && !p->stop && !p->fatal) pthread_cond_wait(&p->cv_reader, &p->mu);
    if (p->stop || p->fatal) {
        pthread_mutex_unlock(&p->mu);
        return NULL;
    }
    c->state = SLOT_READER;
    c->seq = p->next_fill;
    pthread_mutex_unlock(&p->mu);
    c->epoch = epoch;
    c->end_epoch = c->last = 0;
    c->n = c->tlen = 0;
    return c;
}

static void publish_slot(ld_pipeline *p, chunk *c) {
    pthread_mutex_lock(&p->mu);
    c->state = SLOT_FILLED;
    p->next_fill++;
    pthread_cond_signal(&p->cv_worker);
    pthread_mutex_unlock(&p->mu);
}

static item *chunk_add(chunk *c, const char *line, size_t len) {
    if (c->n == c->cap) {
        c->cap = c->cap ? 2 * c->cap : LD_CHUNK_LINES;
        c->items = bt_xrealloc(c->items, c->cap * sizeof *c->items);
    }
    if (c->tlen + len > c->tcap) {
        size_t nc = c->tcap ? c->tcap : 64 * 1024;
        while (nc < c->tlen + len) nc *= 2;
        c->text = bt_xrealloc(c->text, nc);
        c->tcap = nc;
    }
    item *it = &c->items[c->n++];
    memset(it, 0, sizeof *it);
    it->off = c->tlen;
    it->len = len;
    if (len) memcpy(c->text + c->tlen, line, len);
    c->tlen += len;
    it->pre_bad = it->bad = -1;
    return it;
}

/* Next non-blank line of dataset d's current pass: 1 (line, or over-long when *too_long),
 * 0 at the end of the pass, <0 fatal. Unreadable shards (io) and corrupt zstd are counted and
 * skipped here; lines before cur->skip_to are passed over (resume). */
static int rd_next(ld_pipeline *p, rcur *cur, uint32_t d, const char **line, size_t *len, uint64_t *no,
                   int *too_long, uint32_t *file) {
    const dataset *ds = &p->ds[d];
    for (;;) {
        if (!cur->src) {
            if (cur->file >= ds->n) return 0;
            int rc = ld_source_open(&cur->src, p->paths[ds->first + cur->file], 0);
            if (rc == BT_ERR_NOMEM) return rc;
            if (rc != BT_OK) {
                count_bad(p, p->log_seen_reader, LD_BAD_IO, ds->first + cur->file, 0, bt_last_error());
                cur->file++;
                continue;
            }
        }
        uint32_t f = ds->first + cur->file;
        int rc = ld_source_next(cur->src, line, len, no);
        if (rc < 0) return rc;
        if (rc == LD_SRC_END || rc == LD_SRC_ZSTD || rc == LD_SRC_IO) {
            if (rc != LD_SRC_END) {
                const char *m = bt_last_error();
                size_t pl = strlen(p->paths[f]);
                if (strncmp(m, p->paths[f], pl) == 0 && m[pl] == ':') m += pl + 1 + (m[pl + 1] == ' ');
                count_bad(p, p->log_seen_reader, rc == LD_SRC_ZSTD ? LD_BAD_ZSTD : LD_BAD_IO, f, *no, m);
            }
            ld_source_close(cur->src);
            cur->src = NULL;
            cur->file++;
            continue;
        }
        ADD(lines, 1);
        if (rc == LD_SRC_LINE && is_blank(*line, *len)) {
            ADD(blank, 1);
            continue;
        }
        if (cur->pos.g < cur->skip_to) {
            cur->pos.g++;
            continue;
        }
        cur->pos.g++;
        *too_long = rc == LD_SRC_TOO_LONG;
        *file = f;
        return 1;
    }
}

static void rd_restart(rcur *cur, uint32_t pass) {
    ld_source_close(cur->src);
    *cur = (rcur){{pass, 0}, 0, 0, NULL};
}

static int reader_run(ld_pipeline *p, rcur *cur) {
    char msg[256];
    for (uint32_t d = 0; d < p->n_ds; d++) cur[d] = (rcur){{p->start_pos[d].pass, 0}, p->start_pos[d].g, 0, NULL};
    for (uint32_t epoch = p->start_epoch; p->epochs == 0 || epoch < p->epochs; epoch++) {
        uint64_t g = epoch == p->start_epoch ? p->start_g : 0;
        if (epoch != p->start_epoch) rd_restart(&cur[0], epoch);
        int64_t credit[LD_MAX_DATASETS];
        swrr_at(p, credit, g);
        chunk *c = claim_slot(p, epoch);
        if (!c) return 0;
        for (;;) {
            uint32_t d = swrr_pick(p, credit), file = 0;
            const char *line = NULL;
            size_t len = 0;
            uint64_t no = 0;
            int too_long = 0;
            int rc = rd_next(p, &cur[d], d, &line, &len, &no, &too_long, &file);
            if (rc == 0 && d == 0) break; /* the first dataset defines the epoch */
            if (rc == 0) {                /* a secondary dataset wraps around */
                if (cur[d].pos.g == 0) {
                    snprintf(msg, sizeof msg, "dataset %u: a whole pass over its %u shard(s) gave no lines", d,
                             p->ds[d].n);
                    set_fatal(p, BT_ERR_FORMAT, msg);
                    return 0;
                }
                rd_restart(&cur[d], cur[d].pos.pass + 1);
                rc = rd_next(p, &cur[d], d, &line, &len, &no, &too_long, &file);
                if (rc == 0) {
                    snprintf(msg, sizeof msg, "dataset %u: its shards gave no lines on pass %u", d, cur[d].pos.pass);
                    set_fatal(p, BT_ERR_FORMAT, msg);
                    return 0;
                }
            }
            if (rc < 0) {
                set_fatal(p, rc, bt_last_error());
                return 0;
            }
            item *it = chunk_add(c, line, too_long ? 0 : len);
            it->g = g++;
            it->ds = d;
            it->pass = cur[d].pos.pass;
            it->dg = cur[d].pos.g - 1;
            it->line_no = no;
            it->file = file;
            if (too_long) it->pre_bad = LD_BAD_TOO_LONG;
            if (c->n >= LD_CHUNK_LINES || c->tlen >= LD_CHUNK_BYTES) {
                publish_slot(p, c);
                c = claim_slot(p, epoch);
                if (!c) return 0;
            }
        }
        c->end_epoch = 1;
        c->last = p->epochs != 0 && epoch + 1 == p->epochs;
        publish_slot(p, c);
        if (p->epochs == 0 && epoch == UINT32_MAX) break;
    }
    return 1;
}

static void *reader_main(void *arg) {
    ld_pipeline *p = arg;
    rcur cur[LD_MAX_DATASETS];
    memset(cur, 0, sizeof cur);
    int done = reader_run(p, cur);
    for (uint32_t d = 0; d < p->n_ds; d++) ld_source_close(cur[d].src);
    if (done) {
        pthread_mutex_lock(&p->mu);
        p->reader_done = 1;
        pthread_cond_broadcast(&p->cv_consumer);
        pthread_mutex_unlock(&p->mu);
    }
    return NULL;
}

/* ---------------------------------------------------------------- workers */

static int process_chunk(ld_pipeline *p, chunk *c) {
    for (size_t i = 0; i < c->n; i++) {
        item *it = &c->items[i];
        if (it->pre_bad >= 0) {
            it->bad = it->pre_bad;
            snprintf(it->msg, sizeof it->msg, "line longer than %zu bytes", LD_SOURCE_MAX_LINE);
            continue;
        }
        int reason = -1;
        int rc = ld_format_line(&p->ds[it->ds].fcfg, c->text + it->off, it->len, &it->ids, &it->mask,
                                &it->truncated, &reason, it->msg, sizeof it->msg);
        if (rc < 0) return rc;
        it->bad = rc == 1 ? reason : -1;
    }
    return BT_OK;
}

static void *worker_main(void *arg) {
    ld_pipeline *p = arg;
    for (;;) {
        pthread_mutex_lock(&p->mu);
        while (!p->stop && !p->fatal && p->next_work == p->next_fill) pthread_cond_wait(&p->cv_worker, &p->mu);
        if (p->stop || p->fatal) {
            pthread_mutex_unlock(&p->mu);
            return NULL;
        }
        chunk *c = &p->ring[p->next_work % p->Q];
        p->next_work++;
        c->state = SLOT_WORKING;
        pthread_mutex_unlock(&p->mu);
        int rc = process_chunk(p, c);
        if (rc < 0) {
            char msg[600];
            snprintf(msg, sizeof msg, "tokenize worker: %s", bt_last_error());
            set_fatal(p, rc, msg);
            return NULL;
        }
        pthread_mutex_lock(&p->mu);
        c->state = SLOT_DONE;
        pthread_cond_broadcast(&p->cv_consumer);
        pthread_mutex_unlock(&p->mu);
    }
}

/* ---------------------------------------------------------------- consumer */

static int fatal_error(ld_pipeline *p) {
    return bt_fail(p->fatal < 0 ? p->fatal : BT_ERR_IO, "pipeline: %s", p->fatal_msg);
}

/* 0: p->cc is the next chunk; 1: no more chunks; <0 error. */
static int take_chunk(ld_pipeline *p) {
    pthread_mutex_lock(&p->mu);
    chunk *c = &p->ring[p->next_take % p->Q];
    for (;;) {
        if (p->fatal) {
            pthread_mutex_unlock(&p->mu);
            return fatal_error(p);
        }
        if (c->state == SLOT_DONE && c->seq == p->next_take) break;
        if (p->reader_done && p->next_take == p->next_fill) {
            pthread_mutex_unlock(&p->mu);
            return 1;
        }
        pthread_cond_wait(&p->cv_consumer, &p->mu);
    }
    pthread_mutex_unlock(&p->mu);
    p->cc = c;
    p->cc_pos = 0;
    return 0;
}

static void release_chunk(ld_pipeline *p) {
    chunk *c = p->cc;
    for (size_t i = 0; i < c->n; i++) {
        bt_ids_free(&c->items[i].ids);
        bt_ids_free(&c->items[i].mask);
    }
    c->n = c->tlen = 0;
    pthread_mutex_lock(&p->mu);
    c->state = SLOT_EMPTY;
    p->next_take++;
    pthread_cond_signal(&p->cv_reader);
    pthread_mutex_unlock(&p->mu);
    p->cc = NULL;
}

static void window_clear(window *w) {
    for (size_t i = 0; i < w->n_docs; i++) {
        bt_ids_free(&w->ids[i]);
        bt_ids_free(&w->mask[i]);
    }
    w->n_docs = 0;
    w->tokens = 0;
    ld_pack_plan_free(&w->plan);
    w->next_row = w->my_rows = 0;
    w->ends_epoch = w->last = w->built = 0;
}

static void window_add(ld_pipeline *p, window *w, item *it) {
    if (w->n_docs == w->cap) {
        w->cap = w->cap ? 2 * w->cap : 256;
        w->docs = bt_xrealloc(w->docs, w->cap * sizeof *w->docs);
        w->ids = bt_xrealloc(w->ids, w->cap * sizeof *w->ids);
        w->mask = bt_xrealloc(w->mask, w->cap * sizeof *w->mask);
    }
    size_t k = w->n_docs++;
    w->ids[k] = it->ids;
    w->mask[k] = it->mask;
    w->docs[k] = (ld_pack_doc){w->ids[k].v, w->mask[k].v, (uint32_t)w->ids[k].n,
                               p->ds[it->ds].fcfg.format == LD_FMT_TEXT};
    memset(&it->ids, 0, sizeof it->ids);
    memset(&it->mask, 0, sizeof it->mask);
    w->tokens += w->ids[k].n;
    if (it->truncated) ADD(truncated, 1);
    if (w->docs[k].split && w->docs[k].n > p->T) ADD(split, 1);
    ADD(docs, 1);
    ADD(dataset_docs[it->ds], 1);
    p->epoch_docs++;
}

static int build_window(ld_pipeline *p) {
    window *w = &p->win;
    window_clear(w);
    w->epoch = p->c_epoch;
    w->start_g = p->c_g;
    memcpy(w->start_pos, p->c_pos, sizeof w->start_pos);
    for (;;) {
        if (!p->cc) {
            int rc = p->exhausted ? 1 : take_chunk(p);
            if (rc < 0) return rc;
            if (rc == 1) {
                p->exhausted = 1;
                w->last = 1;
                break;
            }
        }
        chunk *c = p->cc;
        int full = 0;
        while (p->cc_pos < c->n && !full) {
            item *it = &c->items[p->cc_pos++];
            p->c_g = it->g + 1;
            p->c_pos[it->ds] = (dpos){it->pass, it->dg + 1};
            atomic_store_explicit(&p->stats->dataset_pass[it->ds], it->pass, memory_order_relaxed);
            if (it->bad >= 0) {
                count_bad(p, p->log_seen, it->bad, it->file, it->line_no, it->msg);
                continue;
            }
            window_add(p, w, it);
            full = w->tokens >= p->win_tokens || w->n_docs >= LD_WINDOW_DOCS;
        }
        if (p->cc_pos == c->n) {
            int end_epoch = c->end_epoch, last = c->last;
            release_chunk(p);
            if (end_epoch) {
                if (!last && p->epoch_from_start && p->epoch_docs == 0)
                    return bt_fail(BT_ERR_FORMAT,
                                   "pipeline: epoch %u has no valid documents (see the bad-line counters)",
                                   p->c_epoch);
                w->ends_epoch = 1;
                w->last = last;
                p->exhausted = last;
                p->c_epoch++;
                p->c_g = 0;
                p->c_pos[0] = (dpos){p->c_epoch, 0};
                p->epoch_docs = 0;
                p->epoch_from_start = 1;
                atomic_store_explicit(&p->stats->epoch, p->c_epoch, memory_order_relaxed);
                break;
            }
        }
        if (full) break;
    }
    int rc = ld_pack_plan_build(&w->plan, w->docs, w->n_docs, p->T, mix3(p->seed, w->epoch, w->start_g), 1);
    if (rc != BT_OK) return rc;
    if (w->plan.n_truncated) ADD(truncated, w->plan.n_truncated);
    w->my_rows = (w->plan.n_rows + p->world - 1) / p->world;
    w->built = 1;
    ADD(windows, 1);
    if (p->skip_rows) {
        if (p->skip_rows > w->my_rows)
            return bt_fail(BT_ERR_INVALID, "pipeline: resume state skips %zu rows of a window of %zu "
                           "(data or spec changed?)", p->skip_rows, w->my_rows);
        w->next_row = p->skip_rows;
        p->skip_rows = 0;
    }
    return BT_OK;
}

/* ---------------------------------------------------------------- resume state */

static void put32(uint8_t *b, size_t *o, uint32_t v) {
    for (int i = 0; i < 4; i++) b[(*o)++] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *b, size_t *o, uint64_t v) {
    for (int i = 0; i < 8; i++) b[(*o)++] = (uint8_t)(v >> (8 * i));
}
static uint32_t get32(const uint8_t *b, size_t *o) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) v |= (uint32_t)b[(*o)++] << (8 * i);
    return v;
}
static uint64_t get64(const uint8_t *b, size_t *o) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)b[(*o)++] << (8 * i);
    return v;
}

/* Layout (248 of 256 bytes, rest zero): u32 magic, u32 version, u64 spec_hash, u64 next_step,
 * u32 epoch, u32 flags, u64 window start n, u64 rows of this rank in that window already emitted,
 * u32 n_datasets, u32 0, then per dataset (LD_MAX_DATASETS slots) u32 pass, u64 line. */
static void encode_state(const ld_pipeline *p, uint8_t *out) {
    memset(out, 0, BT_RESUME_STATE_BYTES);
    const window *w = &p->win;
    uint32_t epoch = w->epoch, flags = 0;
    uint64_t start = w->start_g, rows = w->next_row;
    const dpos *pos = w->start_pos;
    dpos zero[LD_MAX_DATASETS];
    if (p->finished || p->data_done || (w->built && w->last && w->next_row >= w->my_rows)) {
        flags = LD_STATE_F_FINISHED; /* canonical form: the same however we got here */
        epoch = p->epochs;
        start = rows = 0;
        memset(zero, 0, sizeof zero);
        pos = zero;
    } else if (!w->built || w->next_row >= w->my_rows) { /* at a window boundary: the consumer's */
        epoch = p->c_epoch;
        start = p->c_g;
        rows = w->built ? 0 : p->skip_rows;
        pos = p->c_pos;
    }
    size_t o = 0;
    put32(out, &o, LD_STATE_MAGIC);
    put32(out, &o, LD_STATE_VERSION);
    put64(out, &o, p->spec_hash);
    put64(out, &o, p->step);
    put32(out, &o, epoch);
    put32(out, &o, flags);
    put64(out, &o, start);
    put64(out, &o, rows);
    put32(out, &o, p->n_ds);
    put32(out, &o, 0);
    for (uint32_t d = 0; d < LD_MAX_DATASETS; d++) {
        put32(out, &o, d < p->n_ds ? pos[d].pass : 0);
        put64(out, &o, d < p->n_ds ? pos[d].g : 0);
    }
}

static int decode_state(ld_pipeline *p, const uint8_t *st) {
    size_t o = 0;
    uint32_t magic = get32(st, &o), ver = get32(st, &o);
    uint64_t hash = get64(st, &o);
    if (magic != LD_STATE_MAGIC || ver != LD_STATE_VERSION)
        return bt_fail(BT_ERR_INVALID, "resume state: bad magic/version (0x%08x v%u, want v%u)", magic, ver,
                       LD_STATE_VERSION);
    if (hash != p->spec_hash)
        return bt_fail(BT_ERR_INVALID, "resume state: written for a different job spec (datasets, shards, formats, "
                       "weights, chat_template, overlong, seq_len, micro_batch_size, seed, rank or world size changed)");
    p->step = get64(st, &o);
    p->start_epoch = p->c_epoch = get32(st, &o);
    uint32_t flags = get32(st, &o);
    p->start_g = p->c_g = get64(st, &o);
    uint64_t rows = get64(st, &o);
    uint32_t n_ds = get32(st, &o);
    (void)get32(st, &o);
    if (rows > SIZE_MAX / 2 || (!(flags & LD_STATE_F_FINISHED) && n_ds != p->n_ds))
        return bt_fail(BT_ERR_INVALID, "resume state: bad row or dataset count");
    for (uint32_t d = 0; d < LD_MAX_DATASETS; d++) {
        dpos x;
        x.pass = get32(st, &o);
        x.g = get64(st, &o);
        if (d < p->n_ds) p->start_pos[d] = p->c_pos[d] = x;
    }
    if (!(flags & LD_STATE_F_FINISHED) && p->start_pos[0].pass != p->start_epoch)
        return bt_fail(BT_ERR_INVALID, "resume state: inconsistent (epoch %u, first dataset pass %u)",
                       p->start_epoch, p->start_pos[0].pass);
    p->skip_rows = (size_t)rows;
    p->epoch_from_start = p->start_g == 0 && rows == 0;
    if ((flags & LD_STATE_F_FINISHED) || (p->epochs && p->start_epoch >= p->epochs)) p->finished = 1;
    return BT_OK;
}

/* ---------------------------------------------------------------- create / next / free */

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* Expand one dataset's globs, sort and deduplicate them, append to p->paths. */
static int expand_shards(ld_pipeline *p, char *const *shards, int n_shards, uint32_t d) {
    size_t n = 0, cap = 16;
    char **v = bt_xmalloc(cap * sizeof *v);
    for (int i = 0; i < n_shards; i++) {
        glob_t gl;
        int rc = glob(shards[i], GLOB_ERR, NULL, &gl);
        struct stat sst;
        if (rc == GLOB_NOMATCH && stat(shards[i], &sst) == 0) {
            /* an existing file whose name holds glob characters (e.g. "part[1].jsonl") */
            if (n == cap) v = bt_xrealloc(v, (cap *= 2) * sizeof *v);
            v[n++] = bt_xstrdup(shards[i]);
            continue;
        }
        if (rc != 0) {
            if (rc != GLOB_NOMATCH) globfree(&gl);
            for (size_t k = 0; k < n; k++) free(v[k]);
            free(v);
            return bt_fail(rc == GLOB_NOSPACE ? BT_ERR_NOMEM : BT_ERR_NOTFOUND,
                           "job spec: dataset %u \"shards\": pattern \"%s\" %s", d, shards[i],
                           rc == GLOB_NOMATCH ? "matches no file" : "could not be read");
        }
        for (size_t k = 0; k < gl.gl_pathc; k++) {
            if (n == cap) v = bt_xrealloc(v, (cap *= 2) * sizeof *v);
            v[n++] = bt_xstrdup(gl.gl_pathv[k]);
        }
        globfree(&gl);
    }
    qsort(v, n, sizeof *v, cmp_str);
    p->paths = bt_xrealloc(p->paths, (p->n_paths + n + 1) * sizeof *p->paths);
    p->ds[d].first = (uint32_t)p->n_paths;
    for (size_t k = 0; k < n; k++) {
        if (p->n_paths > p->ds[d].first && strcmp(p->paths[p->n_paths - 1], v[k]) == 0) free(v[k]);
        else p->paths[p->n_paths++] = v[k];
    }
    p->ds[d].n = (uint32_t)(p->n_paths - p->ds[d].first);
    free(v);
    return BT_OK;
}

static uint64_t hash_spec(const ld_pipeline *p) {
    uint64_t h = BT_FNV64_INIT;
    for (uint32_t d = 0; d < p->n_ds; d++) {
        const dataset *ds = &p->ds[d];
        uint32_t v[5] = {d, ds->n, (uint32_t)ds->fcfg.format, ds->q, (uint32_t)ds->fcfg.tpl};
        h = bt_fnv1a64(h, v, sizeof v);
        for (uint32_t i = 0; i < ds->n; i++) h = bt_fnv1a64(h, p->paths[ds->first + i], strlen(p->paths[ds->first + i]) + 1);
        if (ds->fcfg.format == LD_FMT_TEXT) h = bt_fnv1a64(h, ds->text_field, strlen(ds->text_field) + 1);
    }
    uint32_t v[9] = {p->T, p->B, p->rank, p->world, LD_STATE_VERSION, (uint32_t)p->ds[0].fcfg.overlong_drop,
                     (uint32_t)p->ds[0].fcfg.add_bos, (uint32_t)p->win_tokens, LD_WINDOW_DOCS};
    h = bt_fnv1a64(h, v, sizeof v);
    return bt_fnv1a64(h, &p->seed, sizeof p->seed);
}

/* tokenizer.ggml.add_bos_token of a .gguf tokenizer file (0 when absent or unreadable). */
static int gguf_add_bos(const char *path) {
    size_t n = path ? strlen(path) : 0;
    if (n < 5 || strcmp(path + n - 5, ".gguf") != 0) return 0;
    bt_gguf *g = NULL;
    if (bt_gguf_open(&g, path) != BT_OK) return 0;
    int v = 0;
    if (bt_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &v) != BT_OK) v = 0;
    bt_gguf_close(g);
    return v != 0;
}

/* Datasets of the spec (or its single-dataset fields) -> p->ds, paths, weights, format configs. */
static int setup_datasets(ld_pipeline *p, const ld_job_spec *spec, const bt_tokenizer *tok) {
    ld_dataset_spec one = {spec->shards, spec->n_shards, spec->format, spec->text_field, 1.0};
    const ld_dataset_spec *dv = spec->n_datasets > 0 ? spec->datasets : &one;
    int nd = spec->n_datasets > 0 ? spec->n_datasets : 1;
    if (nd > LD_MAX_DATASETS)
        return bt_fail(BT_ERR_INVALID, "pipeline: %d datasets (at most %d)", nd, LD_MAX_DATASETS);
    double wmax = 0;
    for (int d = 0; d < nd; d++) {
        if (!(dv[d].weight > 0) || !isfinite(dv[d].weight) || dv[d].n_shards < 1 ||
            (dv[d].format != LD_FMT_TEXT && dv[d].format != LD_FMT_CHAT && dv[d].format != LD_FMT_ALPACA))
            return bt_fail(BT_ERR_INVALID, "pipeline: dataset %d: bad weight, shards or format", d);
        if (dv[d].weight > wmax) wmax = dv[d].weight;
    }
    int add_bos = gguf_add_bos(spec->tokenizer);
    ld_chat_tpl tpl = LD_TPL_CHATML;
    int tpl_done = 0;
    p->n_ds = (uint32_t)nd;
    for (int d = 0; d < nd; d++) {
        dataset *ds = &p->ds[d];
        double q = round(dv[d].weight / wmax * LD_WEIGHT_SCALE);
        ds->q = q < 1 ? 1 : (uint32_t)q;
        p->W += ds->q;
        ds->text_field = bt_xstrdup(dv[d].text_field ? dv[d].text_field : "text");
        if (dv[d].format != LD_FMT_TEXT && !tpl_done) {
            int rc = ld_chat_tpl_resolve(tok, spec->chat_template, &tpl);
            if (rc != BT_OK) return rc;
            tpl_done = 1;
        }
        ds->fcfg = (ld_format_cfg){dv[d].format, ds->text_field, tok, dv[d].format == LD_FMT_TEXT ? 0 : spec->T,
                                   tpl, add_bos, spec->overlong_drop};
        int rc = expand_shards(p, dv[d].shards, dv[d].n_shards, (uint32_t)d);
        if (rc != BT_OK) return rc;
    }
    /* the template used by chat datasets before the first was seen is the same one */
    for (int d = 0; d < nd; d++) p->ds[d].fcfg.tpl = tpl;
    return BT_OK;
}

int ld_pipeline_new(ld_pipeline **out, const ld_job_spec *spec, const bt_tokenizer *tok,
                    const uint8_t *resume_state, ld_stats *stats) {
    *out = NULL;
    if (!spec || !tok) return bt_fail(BT_ERR_INVALID, "pipeline: spec and tokenizer are required");
    if (spec->T < 1 || spec->B < 1 || spec->world_size < 1 || spec->rank >= spec->world_size ||
        (spec->n_datasets < 1 && spec->n_shards < 1) || (uint64_t)spec->B * spec->T > (1u << 24))
        return bt_fail(BT_ERR_INVALID, "pipeline: bad spec (B=%u T=%u rank=%u world_size=%u shards=%d datasets=%d)",
                       spec->B, spec->T, spec->rank, spec->world_size, spec->n_shards, spec->n_datasets);
    ld_pipeline *p = bt_xcalloc(1, sizeof *p);
    p->T = spec->T;
    p->B = spec->B;
    p->rank = spec->rank;
    p->world = spec->world_size;
    p->epochs = spec->epochs;
    p->n_threads = spec->n_threads ? spec->n_threads : 1;
    p->seed = spec->seed;
    p->stats = stats ? stats : &p->own_stats;
    int32_t pad = bt_tokenizer_pad(tok);
    if (pad < 0) pad = bt_tokenizer_eos(tok);
    p->pad_id = pad < 0 ? 0 : pad;
    uint64_t wt = (uint64_t)LD_WINDOW_ROWS * p->T;
    uint64_t cap = LD_WINDOW_MAX_TOKENS > 2ull * p->T ? LD_WINDOW_MAX_TOKENS : 2ull * p->T;
    p->win_tokens = wt < cap ? wt : cap;
    p->epoch_from_start = 1;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv_reader, NULL);
    pthread_cond_init(&p->cv_worker, NULL);
    pthread_cond_init(&p->cv_consumer, NULL);
    p->Q = 2 * (size_t)p->n_threads + 2;
    p->ring = bt_xcalloc(p->Q, sizeof *p->ring);
    int rc = setup_datasets(p, spec, tok);
    if (rc == BT_OK) {
        p->spec_hash = hash_spec(p);
        if (resume_state) rc = decode_state(p, resume_state);
    }
    if (rc != BT_OK) {
        ld_pipeline_free(p);
        return rc;
    }
    atomic_store_explicit(&p->stats->epoch, p->c_epoch, memory_order_relaxed);
    if (!p->finished) {
        p->workers = bt_xcalloc(p->n_threads, sizeof *p->workers);
        for (uint32_t i = 0; i < p->n_threads; i++) {
            if (pthread_create(&p->workers[i], NULL, worker_main, p) != 0) {
                ld_pipeline_free(p);
                return bt_fail(BT_ERR_NOMEM, "pipeline: cannot start tokenize thread %u", i);
            }
            p->n_workers++;
        }
        if (pthread_create(&p->reader, NULL, reader_main, p) != 0) {
            ld_pipeline_free(p);
            return bt_fail(BT_ERR_NOMEM, "pipeline: cannot start the reader thread");
        }
        p->reader_started = 1;
    }
    bt_log(BT_LOG_INFO, "loaderd", "pipeline: %u dataset(s), %zu shard(s), rank %u/%u, B=%u T=%u, %u tokenize "
           "thread(s), chat template %s%s", p->n_ds, p->n_paths, p->rank, p->world, p->B, p->T, p->n_threads,
           ld_chat_tpl_name(p->ds[0].fcfg.tpl), resume_state ? ", resumed" : "");
    *out = p;
    return BT_OK;
}

static void write_header(ld_pipeline *p, bt_batch_view *v, uint32_t job_id, uint32_t n_cu,
                         uint32_t real, uint32_t labelled, uint32_t docs, uint32_t flags, uint32_t epoch) {
    bt_batch_header *h = v->hdr;
    h->magic = BT_BATCH_MAGIC;
    h->layout_version = BT_BATCH_LAYOUT_VERSION;
    h->job_id = job_id;
    h->rank = p->rank;
    h->step = p->step;
    h->B = p->B;
    h->T = p->T;
    h->n_real_tokens = real;
    h->n_labelled_tokens = labelled;
    h->n_cu = n_cu;
    h->n_docs = docs;
    h->flags = flags;
    h->epoch = epoch;
    h->checksum = bt_batch_checksum(v);
}

static int next_failed(ld_pipeline *p, int rc) {
    p->err = rc;
    snprintf(p->err_msg, sizeof p->err_msg, "%s", bt_last_error());
    return rc;
}

int ld_pipeline_next(ld_pipeline *p, bt_batch_view *v, uint32_t job_id) {
    const uint32_t T = p->T, B = p->B;
    if (p->err) return bt_fail(p->err, "%s", p->err_msg);
    uint32_t n_cu = 0, real = 0, labelled = 0, docs = 0, epoch = p->win.epoch, rows = 0;
    if (!p->finished) {
        for (uint32_t r = 0; r < B; r++) {
            window *w = &p->win;
            while (!p->data_done && (!w->built || w->next_row >= w->my_rows)) {
                if (w->built && w->last) {
                    p->data_done = 1;
                    break;
                }
                int rc = build_window(p);
                if (rc < 0) return next_failed(p, rc);
            }
            size_t o = (size_t)r * T;
            if (!p->data_done && rows++ == 0) epoch = w->epoch;
            size_t pr = p->data_done ? SIZE_MAX : w->next_row++ * p->world + p->rank; /* plan row */
            if (pr >= w->plan.n_rows) {
                ld_pack_write_pad_row(T, p->pad_id, (uint32_t)o, v->input_ids + o, v->labels + o,
                                      v->position_ids + o, v->cu_seqlens, &n_cu);
                ADD(pad_rows, 1);
                continue;
            }
            ld_row_stats st;
            ld_pack_write_row(&w->plan, pr, w->docs, T, p->pad_id, (uint32_t)o, v->input_ids + o, v->labels + o,
                              v->position_ids + o, v->cu_seqlens, &n_cu, &st);
            real += st.real;
            labelled += st.labelled;
            docs += st.pieces;
        }
    }
    if (rows == 0) { /* END_OF_DATA: all-padding rows, no documents */
        if (!p->finished) atomic_fetch_sub_explicit(&p->stats->pad_rows, B, memory_order_relaxed);
        p->finished = 1;
        n_cu = 0;
        for (uint32_t r = 0; r < B; r++) {
            size_t o = (size_t)r * T;
            ld_pack_write_pad_row(T, p->pad_id, (uint32_t)o, v->input_ids + o, v->labels + o,
                                  v->position_ids + o, v->cu_seqlens, &n_cu);
        }
        v->cu_seqlens[n_cu++] = (int32_t)(B * T);
        encode_state(p, v->hdr->resume_state);
        write_header(p, v, job_id, n_cu, 0, 0, 0, BT_BATCH_F_END_OF_DATA,
                     p->epochs ? p->epochs : p->c_epoch);
        return 1;
    }
    v->cu_seqlens[n_cu++] = (int32_t)(B * T);
    p->step++;
    encode_state(p, v->hdr->resume_state);
    p->step--;
    write_header(p, v, job_id, n_cu, real, labelled, docs, 0, epoch);
    p->step++;
    ADD(batches, 1);
    ADD(tokens, real);
    ADD(labelled, labelled);
    ADD(slot_tokens, (uint64_t)B * T);
    return 0;
}

void ld_pipeline_free(ld_pipeline *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_cond_broadcast(&p->cv_reader);
    pthread_cond_broadcast(&p->cv_worker);
    pthread_cond_broadcast(&p->cv_consumer);
    pthread_mutex_unlock(&p->mu);
    if (p->reader_started) pthread_join(p->reader, NULL);
    for (uint32_t i = 0; i < p->n_workers; i++) pthread_join(p->workers[i], NULL);
    free(p->workers);
    for (size_t q = 0; q < p->Q; q++) {
        chunk *c = &p->ring[q];
        for (size_t i = 0; i < c->n; i++) {
            bt_ids_free(&c->items[i].ids);
            bt_ids_free(&c->items[i].mask);
        }
        free(c->items);
        free(c->text);
    }
    free(p->ring);
    window_clear(&p->win);
    free(p->win.docs);
    free(p->win.ids);
    free(p->win.mask);
    for (size_t i = 0; i < p->n_paths; i++) free(p->paths[i]);
    free(p->paths);
    for (uint32_t d = 0; d < p->n_ds; d++) free(p->ds[d].text_field);
    pthread_cond_destroy(&p->cv_reader);
    pthread_cond_destroy(&p->cv_worker);
    pthread_cond_destroy(&p->cv_consumer);
    pthread_mutex_destroy(&p->mu);
    free(p);
}
