/* loaderd stream: datasets -> merged line stream -> (workers) documents -> windows of packed
 * rows for every rank. Contract: loaderd/pipeline.h; structure: loaderd/stream.h.
 *
 * Reader thread: walks every dataset's shards (sorted, deduplicated glob matches) and merges
 * their lines with smooth weighted round robin into one stream; every non-blank line of an
 * epoch gets a merged index n (0, 1, ...; over-long lines get one too, blank lines do not) and,
 * within its dataset, a pass number and line index g. With a token cache (loaderd/tcache.h) a
 * shard's lines come as records of its entry, already tokenized (the T rules are applied here,
 * ld_format_fit); otherwise, or when its entry cannot be had, as raw lines the workers format
 * and tokenize (ld_format_line). Lines are copied into chunks of up to LD_CHUNK_LINES lines
 * (loaderd/chunkq.h); the window builder takes finished chunks strictly by sequence number, so
 * everything downstream is independent of thread count, timing and of where a shard's tokens
 * came from.
 *
 * Windows: documents (in n order) are collected into a window until it holds
 * win_tokens = min(LD_WINDOW_ROWS * T, max(LD_WINDOW_MAX_TOKENS, 2T)) tokens or LD_WINDOW_DOCS
 * documents, or the epoch ends. The window is packed with best-fit decreasing (packer.c) and
 * its rows shuffled by a seed derived from (spec seed, epoch, window start n); rank r's rows are
 * r, r + W, ... (W = world size), padded to the same count for every rank. A window is
 * self-contained, so it is a pure function of its start position. With 256-row windows packing
 * loses well under 1% on chat SFT data (measured by tests/bench/bench_loaderd.sh).
 *
 * Bad input: line-level reasons (json, utf8, field, empty, too_long, overlong) are counted by
 * the window builder in stream order; shard-level ones (zstd, io) by the reader. Logged as
 * "path:line: reason: detail", the first LD_LOG_FIRST per reason and then every
 * LD_LOG_EVERY-th. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "common/bt_vec.h"
#include "loaderd/source.h"
#include "proto/batch.h"
#include "loaderd/stream.h"

#define LD_LOG_FIRST 20
#define LD_LOG_EVERY 1000

#define ADD(field, n) atomic_fetch_add_explicit(&s->stats->field, (uint64_t)(n), memory_order_relaxed)

/* ---------------------------------------------------------------- helpers */

static int log_due(uint64_t *seen, int reason) {
    uint64_t n = ++seen[reason];
    return n <= LD_LOG_FIRST || n % LD_LOG_EVERY == 0;
}

/* Count a bad line and log it (rate-limited) from the reader (seen = log_seen_reader) or the
 * window builder (seen = log_seen): each reason is only ever counted by one of the two. */
static void count_bad(ld_stream *s, uint64_t *seen, int reason, uint32_t file, uint64_t line_no, const char *detail) {
    ADD(bad[reason], 1);
    if (log_due(seen, reason))
        bt_log(BT_LOG_WARN, "loaderd", "%s:%llu: %s: %s (%llu so far)",
               file < s->cfg->n_paths ? s->cfg->paths[file] : "?", (unsigned long long)line_no,
               ld_bad_reason_name(reason), detail, (unsigned long long)seen[reason]);
}

static uint64_t mix3(uint64_t a, uint64_t b, uint64_t c) {
    uint64_t x = a;
    uint64_t h = ld_splitmix64(&x);
    x = h ^ b;
    h = ld_splitmix64(&x);
    x = h ^ c;
    return ld_splitmix64(&x);
}

static int is_blank(const char *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (p[i] != ' ' && p[i] != '\t' && p[i] != '\r' && p[i] != '\f' && p[i] != '\v') return 0;
    return 1;
}

/* Smooth weighted round robin (nginx ngx_http_upstream_get_peer): one pick. */
static uint32_t swrr_pick(const ld_scfg *cfg, int64_t *credit) {
    uint32_t best = 0;
    for (uint32_t d = 0; d < cfg->n_ds; d++) {
        credit[d] += cfg->ds[d].q;
        if (credit[d] > credit[best]) best = d;
    }
    credit[best] -= cfg->W;
    return best;
}

/* Credits after n picks from a fresh start: the schedule repeats every W picks. */
static void swrr_at(const ld_scfg *cfg, int64_t *credit, uint64_t n) {
    memset(credit, 0, LD_MAX_DATASETS * sizeof *credit);
    for (uint64_t i = 0; i < n % cfg->W; i++) swrr_pick(cfg, credit);
}

/* ---------------------------------------------------------------- reader thread */

/* reader's cursor in one dataset */
typedef struct {
    ld_dpos pos;         /* pos.g = lines passed in this pass */
    uint64_t skip_to;    /* resume: lines of the pass to skip */
    uint32_t file;       /* index within the dataset */
    ld_source *src;      /* raw shard, or */
    ld_tc_reader *tc;    /* its token-cache entry */
    uint64_t file_skip;  /* raw lines of this file already delivered from a damaged entry */
} rcur;

static void rd_close(rcur *cur) {
    ld_source_close(cur->src);
    ld_tc_close(cur->tc);
    cur->src = NULL;
    cur->tc = NULL;
}

/* Open file cur->file of dataset d: its cache entry when there is a cache and one can be had,
 * else the raw shard. 0 opened, 1 skip this file (counted), <0 fatal / stopping. */
static int rd_open(ld_stream *s, rcur *cur, uint32_t d) {
    const ld_scfg *cfg = s->cfg;
    uint32_t f = cfg->ds[d].first + cur->file;
    cur->file_skip = 0;
    if (cfg->cache) {
        int rc = ld_tcache_acquire(cfg->cache, &cfg->shards[f], cfg->shards, cfg->n_paths, cfg->n_threads, &s->stop,
                                   &cur->tc);
        if (rc == BT_OK && cfg->ref_tab && atomic_load(&cfg->ref_tab[f])) /* reopened (next epoch): */
            ld_reftab_sync(atomic_load(&cfg->ref_tab[f]));                 /* share with the other nodes */
        else if (rc == BT_OK && cfg->ref_tab &&
                 (cfg->ds[d].fcfg.format == LD_FMT_PREFERENCE || cfg->ds[d].fcfg.format == LD_FMT_KTO)) {
            ld_refparams rp = {cfg->ref_base, cfg->ref_uid};
            ld_reftab *t = NULL;
            int trc = ld_reftab_get(cfg->cache, ld_tc_key(cur->tc), &cfg->ds[d].fcfg, &rp, &t);
            if (trc == BT_ERR_NOMEM) {
                ld_tc_close(cur->tc);
                cur->tc = NULL;
                return trc;
            }
            struct ld_reftab *none = NULL;
            if (t && !atomic_compare_exchange_strong(&cfg->ref_tab[f], &none, t)) ld_reftab_put(t);
        }
        if (rc == BT_OK) return 0;
        if (rc < 0) return rc;
    }
    int rc = ld_source_open(&cur->src, cfg->paths[f], 0);
    if (rc == BT_ERR_NOMEM) return rc;
    if (rc != BT_OK) {
        count_bad(s, s->log_seen_reader, LD_BAD_IO, f, 0, bt_last_error());
        return 1;
    }
    return 0;
}

/* Next record of the open cache entry as a ready item of chunk c: 1 (added), 0 at its end, 2
 * when the entry turned out damaged (the rest of the file is read raw), <0 fatal. Records are
 * skipped (not decoded) while cur->pos.g < cur->skip_to; shard errors are counted here. */
static int rd_cached(ld_stream *s, rcur *cur, uint32_t d, ld_chunk *c) {
    const ld_scfg *cfg = s->cfg;
    uint32_t f = cfg->ds[d].first + cur->file;
    for (;;) {
        int skip = cur->pos.g < cur->skip_to;
        bt_ids ids = {0}, mask = {0};
        ld_tc_record rec;
        int rc = ld_tc_next(cur->tc, &rec, skip ? NULL : &ids, skip ? NULL : &mask);
        if (rc != 1) {
            bt_ids_free(&ids);
            bt_ids_free(&mask);
        }
        if (rc == 0) {
            ADD(lines, ld_tc_lines(cur->tc));
            ADD(blank, ld_tc_blank(cur->tc));
            return 0;
        }
        if (rc == LD_TC_DAMAGED) {
            uint64_t done = ld_tc_records(cur->tc);
            ld_tc_close(cur->tc);
            cur->tc = NULL;
            int orc = ld_source_open(&cur->src, cfg->paths[f], 0);
            if (orc == BT_ERR_NOMEM) return orc;
            if (orc != BT_OK) {
                count_bad(s, s->log_seen_reader, LD_BAD_IO, f, 0, bt_last_error());
                return 0;
            }
            cur->file_skip = done;
            return 2;
        }
        if (rc < 0) return rc;
        if (rec.kind == 2) { /* shard error (zstd): counted by the reader, like a raw shard's */
            char msg[128];
            snprintf(msg, sizeof msg, "%.*s", (int)rec.msg_len, rec.msg);
            count_bad(s, s->log_seen_reader, rec.reason, f, rec.line_no, msg);
            continue;
        }
        cur->pos.g++;
        if (skip) continue;
        ld_item *it = ld_chunk_add(c, NULL, 0);
        it->line_no = rec.line_no;
        it->file = f;
        it->ready = 1;
        int pref_fmt = cfg->ds[d].fcfg.format == LD_FMT_PREFERENCE || cfg->ds[d].fcfg.format == LD_FMT_KTO;
        if (rec.kind != 1 && (rec.kind == 3) != pref_fmt) { /* only a forged entry can hold this */
            rec.kind = 1;
            rec.reason = LD_BAD_FIELD;
            rec.msg = "token cache: record kind does not match the format";
            rec.msg_len = strlen(rec.msg);
        }
        if (rec.kind == 1) {
            it->bad = rec.reason;
            snprintf(it->msg, sizeof it->msg, "%.*s", (int)rec.msg_len, rec.msg);
            bt_ids_free(&ids);
            bt_ids_free(&mask);
            return 1;
        }
        it->ids = ids;
        it->mask = mask;
        int reason = -1, frc;
        if (rec.kind == 3) { /* a preference / kto record: the job's truncation, as format_item */
            ld_pref_rec pr = {rec.n_docs, {rec.len[0], rec.len[1]}, rec.prompt_len, rec.label, 0};
            frc = ld_format_pref_fit(&cfg->ds[d].fcfg, &it->ids, &it->mask, 0, &pr, &reason);
            if (frc == 0) {
                it->truncated = pr.truncated;
                it->pref_n = pr.n_docs;
                it->pref_len0 = pr.len[0];
                it->pref_label = pr.label;
            }
        } else {
            frc = ld_format_fit(&cfg->ds[d].fcfg, &it->ids, &it->mask, 0, &it->truncated, &reason);
        }
        if (frc < 0) return frc;
        it->bad = frc == 1 ? reason : -1;
        if (frc == 1) snprintf(it->msg, sizeof it->msg, "%s", bt_last_error());
        return 1;
    }
}

/* Next non-blank line of dataset d's current pass, added to chunk c: 1 (added), 0 at the end
 * of the pass, <0 fatal. Unreadable shards (io) and corrupt zstd are counted and skipped here;
 * lines before cur->skip_to are passed over (resume). */
static int rd_next(ld_stream *s, rcur *cur, uint32_t d, ld_chunk *c) {
    const ld_scfg *cfg = s->cfg;
    const ld_dataset *ds = &cfg->ds[d];
    for (;;) {
        if (!cur->src && !cur->tc) {
            if (cur->file >= ds->n) return 0;
            int rc = rd_open(s, cur, d);
            if (rc < 0) return rc;
            if (rc == 1) {
                cur->file++;
                continue;
            }
        }
        uint32_t f = ds->first + cur->file;
        if (cur->tc) {
            int rc = rd_cached(s, cur, d, c);
            if (rc < 0) return rc;
            if (rc == 1) return 1;
            if (rc == 2) continue; /* the rest of this file comes raw */
            rd_close(cur);
            cur->file++;
            continue;
        }
        const char *line = NULL;
        size_t len = 0;
        uint64_t no = 0;
        int rc = ld_source_next(cur->src, &line, &len, &no);
        if (rc < 0) return rc;
        if (rc == LD_SRC_END || rc == LD_SRC_ZSTD || rc == LD_SRC_IO) {
            if (rc != LD_SRC_END) {
                const char *m = bt_last_error();
                size_t pl = strlen(cfg->paths[f]);
                if (strncmp(m, cfg->paths[f], pl) == 0 && m[pl] == ':') m += pl + 1 + (m[pl + 1] == ' ');
                count_bad(s, s->log_seen_reader, rc == LD_SRC_ZSTD ? LD_BAD_ZSTD : LD_BAD_IO, f, no, m);
            }
            rd_close(cur);
            cur->file++;
            continue;
        }
        ADD(lines, 1);
        if (rc == LD_SRC_LINE && is_blank(line, len)) {
            ADD(blank, 1);
            continue;
        }
        if (cur->file_skip) { /* delivered from the cache before it turned out damaged */
            cur->file_skip--;
            continue;
        }
        if (cur->pos.g < cur->skip_to) {
            cur->pos.g++;
            continue;
        }
        cur->pos.g++;
        ld_item *it = ld_chunk_add(c, line, rc == LD_SRC_TOO_LONG ? 0 : len);
        it->line_no = no;
        it->file = f;
        if (rc == LD_SRC_TOO_LONG) {
            it->ready = 1;
            it->bad = it->pre_bad = LD_BAD_TOO_LONG;
            snprintf(it->msg, sizeof it->msg, "line longer than %zu bytes", LD_SOURCE_MAX_LINE);
        }
        return 1;
    }
}

static void rd_restart(rcur *cur, uint32_t pass) {
    rd_close(cur);
    memset(cur, 0, sizeof *cur);
    cur->pos.pass = pass;
}

static int reader_fail(ld_stream *s, int code, const char *msg) {
    ld_chunkq_fail(s->q, code, msg);
    return 0;
}

/* The merged stream from s->start: 1 when every epoch was produced, 0 when stopped/failed. */
static int reader_run(ld_stream *s, rcur *cur) {
    const ld_scfg *cfg = s->cfg;
    char msg[256];
    for (uint32_t d = 0; d < cfg->n_ds; d++) {
        memset(&cur[d], 0, sizeof cur[d]);
        cur[d].pos.pass = s->start.pos[d].pass;
        cur[d].skip_to = s->start.pos[d].g;
    }
    for (uint32_t epoch = s->start.epoch; cfg->epochs == 0 || epoch < cfg->epochs; epoch++) {
        uint64_t g = epoch == s->start.epoch ? s->start.g : 0;
        if (epoch != s->start.epoch) rd_restart(&cur[0], epoch);
        int64_t credit[LD_MAX_DATASETS];
        swrr_at(cfg, credit, g);
        ld_chunk *c = ld_chunkq_claim(s->q);
        if (!c) return 0;
        c->epoch = epoch;
        for (;;) {
            uint32_t d = swrr_pick(cfg, credit);
            size_t n0 = c->n;
            int rc = rd_next(s, &cur[d], d, c);
            if (rc == 0 && d == 0) break; /* the first dataset defines the epoch */
            if (rc == 0) {                /* a secondary dataset wraps around */
                if (cur[d].pos.g == 0) {
                    snprintf(msg, sizeof msg, "dataset %u: a whole pass over its %u shard(s) gave no lines", d,
                             cfg->ds[d].n);
                    return reader_fail(s, BT_ERR_FORMAT, msg);
                }
                rd_restart(&cur[d], cur[d].pos.pass + 1);
                rc = rd_next(s, &cur[d], d, c);
                if (rc == 0) {
                    snprintf(msg, sizeof msg, "dataset %u: its shards gave no lines on pass %u", d, cur[d].pos.pass);
                    return reader_fail(s, BT_ERR_FORMAT, msg);
                }
            }
            if (rc == BT_ERR_TIMEOUT && atomic_load(&s->stop)) return 0;
            if (rc < 0) return reader_fail(s, rc, bt_last_error());
            ld_item *it = &c->items[n0];
            it->g = g++;
            it->ds = d;
            it->pass = cur[d].pos.pass;
            it->dg = cur[d].pos.g - 1;
            if (c->n >= LD_CHUNK_LINES || c->tlen >= LD_CHUNK_BYTES) {
                ld_chunkq_publish(s->q, c);
                if (!(c = ld_chunkq_claim(s->q))) return 0;
                c->epoch = epoch;
            }
        }
        c->end_epoch = 1;
        c->last = cfg->epochs != 0 && epoch + 1 == cfg->epochs;
        ld_chunkq_publish(s->q, c);
        if (cfg->epochs == 0 && epoch == UINT32_MAX) break;
    }
    return 1;
}

static void *reader_main(void *arg) {
    ld_stream *s = arg;
    rcur cur[LD_MAX_DATASETS];
    memset(cur, 0, sizeof cur);
    int done = reader_run(s, cur);
    for (uint32_t d = 0; d < s->cfg->n_ds; d++) rd_close(&cur[d]);
    if (done) ld_chunkq_finish(s->q);
    return NULL;
}

/* Worker: format and tokenize one raw line (ld_format_line with its dataset's format). */
static int format_item(void *ctx, ld_item *it, const char *line) {
    const ld_stream *s = ctx;
    int reason = -1;
    const ld_format_cfg *fc = &s->cfg->ds[it->ds].fcfg;
    int rc;
    if (fc->format == LD_FMT_PREFERENCE || fc->format == LD_FMT_KTO) {
        ld_pref_rec rec;
        rc = ld_format_pref_render(fc, line, it->len, &it->ids, &it->mask, &rec, &reason);
        if (rc == 0) rc = ld_format_pref_fit(fc, &it->ids, &it->mask, 0, &rec, &reason);
        if (rc == 0) {
            it->truncated = rec.truncated;
            it->pref_n = rec.n_docs;
            it->pref_len0 = rec.len[0];
            it->pref_label = rec.label;
        }
    } else {
        rc = ld_format_line(fc, line, it->len, &it->ids, &it->mask, &it->truncated, &reason);
    }
    if (rc == BT_ERR_NOMEM) { /* its tokens do not fit in memory: skip and count the document, go on */
        bt_ids_free(&it->ids);
        bt_ids_free(&it->mask);
        it->bad = LD_BAD_MEMORY;
        snprintf(it->msg, sizeof it->msg, "out of memory tokenizing a document of %zu bytes: skipped", it->len);
        return BT_OK;
    }
    if (rc < 0) return rc;
    it->bad = rc == 1 ? reason : -1;
    if (rc == 1) snprintf(it->msg, sizeof it->msg, "%s", bt_last_error()); /* this worker's, made just now */
    return BT_OK;
}

/* ---------------------------------------------------------------- windows */

static ld_window *window_new(const ld_stream *s) {
    ld_window *w = bt_xcalloc(1, sizeof *w);
    w->start = s->cpos;
    return w;
}

static void window_free(ld_window *w) {
    for (size_t i = 0; i < w->n_docs; i++) {
        bt_ids_free(&w->ids[i]);
        bt_ids_free(&w->mask[i]);
    }
    ld_pack_plan_free(&w->plan);
    free(w->docs);
    free(w->ids);
    free(w->mask);
    free(w);
}

void ld_window_put(ld_window *w) {
    if (w && --w->refs == 0) window_free(w);
}

static void window_add(ld_stream *s, ld_window *w, ld_item *it) {
    if (w->n_docs + 2 > w->cap) { /* three parallel arrays of the same capacity (room for a pair) */
        size_t need = w->n_docs < 256 ? 256 : w->n_docs + 1, c1 = w->cap, c2 = w->cap;
        w->docs = bt_vec_xgrow(w->docs, &w->cap, need, sizeof *w->docs);
        w->ids = bt_vec_xgrow(w->ids, &c1, w->cap, sizeof *w->ids);
        w->mask = bt_vec_xgrow(w->mask, &c2, w->cap, sizeof *w->mask);
    }
    size_t k = w->n_docs++;
    w->ids[k] = it->ids;
    w->mask[k] = it->mask;
    w->docs[k] = (ld_pack_doc){w->ids[k].v, w->mask[k].v, (uint32_t)w->ids[k].n,
                               s->cfg->ds[it->ds].fcfg.format == LD_FMT_TEXT, 0, BT_SEG_PLAIN, -1, -1};
    int32_t src = (int32_t)it->file, line = it->line_no <= INT32_MAX ? (int32_t)it->line_no : -1;
    w->docs[k].src = src, w->docs[k].line = line;
    if (it->pref_n == 1) /* kto */
        w->docs[k].kind = it->pref_label ? BT_SEG_KTO_DESIRABLE : BT_SEG_KTO_UNDESIRABLE;
    if (it->pref_n == 2) { /* a pair: two documents over the one buffer (owned by entry k) */
        size_t k2 = w->n_docs++;
        uint32_t n0 = it->pref_len0, n1 = (uint32_t)w->ids[k].n - n0;
        memset(&w->ids[k2], 0, sizeof w->ids[k2]);
        memset(&w->mask[k2], 0, sizeof w->mask[k2]);
        w->docs[k] = (ld_pack_doc){w->ids[k].v, w->mask[k].v, n0, 0, 1, BT_SEG_CHOSEN, src, line};
        w->docs[k2] = (ld_pack_doc){w->ids[k].v + n0, w->mask[k].v + n0, n1, 0, 0, BT_SEG_REJECTED, src, line};
    }
    memset(&it->ids, 0, sizeof it->ids);
    memset(&it->mask, 0, sizeof it->mask);
    w->tokens += w->ids[k].n;
    if (it->truncated) ADD(truncated, 1);
    if (w->docs[k].split && w->docs[k].n > s->cfg->T) ADD(split, 1);
    ADD(docs, 1);
    ADD(dataset_docs[it->ds], 1);
    s->epoch_docs++;
}

/* The window's end of epoch: checks, then moves the consumer position to the next epoch. */
static int end_epoch(ld_stream *s, ld_window *w, int last) {
    if (!last && s->epoch_from_start && s->epoch_docs == 0)
        return bt_fail(BT_ERR_FORMAT, "pipeline: epoch %u has no valid documents (see the bad-line counters)",
                       s->cpos.epoch);
    w->ends_epoch = 1;
    w->last = last;
    s->exhausted = last;
    s->cpos.epoch++;
    s->cpos.g = 0;
    s->cpos.pos[0] = (ld_dpos){s->cpos.epoch, 0};
    s->epoch_docs = 0;
    s->epoch_from_start = 1;
    atomic_store_explicit(&s->stats->epoch, s->cpos.epoch, memory_order_relaxed);
    return BT_OK;
}

/* Take documents from the chunks into w until it is full or the epoch / stream ends. */
static int fill_window(ld_stream *s, ld_window *w) {
    const ld_scfg *cfg = s->cfg;
    for (;;) {
        if (!s->cc) {
            int rc = s->exhausted ? 1 : ld_chunkq_take(s->q, &s->cc);
            if (rc < 0) return rc;
            if (rc == 1) {
                s->exhausted = 1;
                w->last = 1;
                return BT_OK;
            }
            s->cc_pos = 0;
        }
        ld_chunk *c = s->cc;
        int full = 0;
        while (s->cc_pos < c->n && !full) {
            ld_item *it = &c->items[s->cc_pos++];
            s->cpos.g = it->g + 1;
            s->cpos.pos[it->ds] = (ld_dpos){it->pass, it->dg + 1};
            atomic_store_explicit(&s->stats->dataset_pass[it->ds], it->pass, memory_order_relaxed);
            if (it->bad >= 0) {
                count_bad(s, s->log_seen, it->bad, it->file, it->line_no, it->msg);
                continue;
            }
            window_add(s, w, it);
            full = w->tokens >= cfg->win_tokens || w->n_docs >= LD_WINDOW_DOCS;
        }
        if (s->cc_pos == c->n) {
            int end = c->end_epoch, last = c->last;
            ld_chunkq_release(s->q, c);
            s->cc = NULL;
            if (end) return end_epoch(s, w, last);
        }
        if (full) return BT_OK;
    }
}

int ld_stream_build_window(ld_stream *s, ld_window **out) {
    *out = NULL;
    ld_window *w = window_new(s);
    int rc = fill_window(s, w);
    if (rc == BT_OK)
        rc = ld_pack_plan_build(&w->plan, w->docs, w->n_docs, s->cfg->T, mix3(s->cfg->seed, w->start.epoch, w->start.g), 1);
    if (rc != BT_OK) {
        window_free(w);
        return rc;
    }
    if (w->plan.n_truncated) ADD(truncated, w->plan.n_truncated);
    /* ld_format_pref_fit already skips pairs longer than T; a pair the packer could not place is
     * counted all the same, never lost silently */
    if (w->plan.n_pairs_dropped) ADD(bad[LD_BAD_OVERLONG], w->plan.n_pairs_dropped);
    w->rank_rows = (w->plan.n_rows + s->cfg->world - 1) / s->cfg->world;
    w->end = s->cpos;
    ADD(windows, 1);
    *out = w;
    return BT_OK;
}

/* ---------------------------------------------------------------- create / free */

void ld_scfg_put(ld_scfg *cfg) {
    if (!cfg || atomic_fetch_sub(&cfg->refs, 1) != 1) return;
    for (size_t i = 0; i < cfg->n_paths; i++) free(cfg->paths[i]);
    free(cfg->paths);
    for (uint32_t d = 0; d < cfg->n_ds; d++) free(cfg->ds[d].text_field);
    free(cfg->shards);
    free(cfg->canon);
    if (cfg->ref_tab)
        for (size_t i = 0; i < cfg->n_paths; i++) ld_reftab_put(atomic_load(&cfg->ref_tab[i]));
    free(cfg->ref_tab);
    free(cfg->ref_base);
    free(cfg);
}

const ld_spos *ld_stream_next_start(const ld_stream *s) { return s->tail ? &s->tail->end : &s->start; }

int ld_stream_new(ld_stream **out, ld_scfg *cfg, const ld_spos *start, ld_stats *stats) {
    *out = NULL;
    ld_stream *s = bt_xcalloc(1, sizeof *s);
    atomic_fetch_add(&cfg->refs, 1);
    s->cfg = cfg;
    s->stats = stats ? stats : &s->own_stats;
    s->start = *start;
    s->cpos = *start;
    s->epoch_from_start = start->g == 0;
    s->max_windows = LD_MAX_WINDOWS;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    atomic_store_explicit(&s->stats->epoch, start->epoch, memory_order_relaxed);
    int rc = ld_chunkq_new(&s->q, cfg->n_threads, format_item, s);
    if (rc == BT_OK) {
        if (pthread_create(&s->reader, NULL, reader_main, s) == 0) s->reader_started = 1;
        else rc = bt_fail(BT_ERR_NOMEM, "pipeline: cannot start the reader thread");
    }
    if (rc != BT_OK) {
        ld_stream_free(s);
        return rc;
    }
    *out = s;
    return BT_OK;
}

void ld_stream_free(ld_stream *s) {
    if (!s) return;
    atomic_store(&s->stop, 1);
    if (s->q) ld_chunkq_stop(s->q); /* wakes a reader waiting for a free slot */
    if (s->reader_started) pthread_join(s->reader, NULL);
    if (s->cc) ld_chunkq_release(s->q, s->cc);
    ld_chunkq_free(s->q);
    for (ld_window *w = s->head; w;) {
        ld_window *n = w->next;
        ld_window_put(w);
        w = n;
    }
    free(s->members);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    ld_scfg_put(s->cfg);
    free(s);
}
