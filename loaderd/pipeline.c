/* loaderd data pipeline: per-rank cursors over streams shared through a hub. Contract:
 * loaderd/pipeline.h; the stream (reader, workers, windows): loaderd/stream.c.
 *
 * A cursor (ld_pipeline) is one rank of one job: it walks its stream's windows and writes its
 * own rows (r, r + W, ... of each window) into batches. Cursors of the same job on this node
 * (equal canonical description: datasets, shards, formats, weights, template, overlong policy,
 * T, B, seed, world size, epochs; the same tokenizer object) share one stream when they start
 * at a window the stream still has or is about to build: ld_pipeline_attach finds it in the
 * hub, or starts a new stream. Without a hub (ld_pipeline_new) a cursor has a stream of its own.
 *
 * Resume state (BT_RESUME_STATE_BYTES, little-endian, see encode_state; unchanged by sharing):
 * magic, version, a hash of the spec (rank included), the next step, the epoch, merged start n
 * and per-dataset (pass, line) of the window that holds the next row, and how many of this
 * rank's rows of it were already emitted (or a "finished" flag). Resuming starts (or joins) a
 * stream at that window and drops the rows already emitted: the batches are exactly those of
 * an uninterrupted run. Stats of a resumed pipeline count only what it processed. */
#include "loaderd/pipeline.h"

#include <glob.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/bt_common.h"
#include "common/bt_le.h"
#include "common/bt_vec.h"
#include "common/gguf.h"
#include "loaderd/stream.h"

#define LD_WEIGHT_SCALE 1000.0
#define LD_STATE_MAGIC 0x3153444Cu /* "LDS1" */
#define LD_STATE_VERSION 2u
#define LD_STATE_F_FINISHED 1u

#define ADD(field, n) atomic_fetch_add_explicit(&p->stats->field, (uint64_t)(n), memory_order_relaxed)

struct ld_hub {
    pthread_mutex_t mu;
    ld_tcache *cache;
    uint32_t max_windows;
    ld_stream *streams; /* shared streams (hub_next) */
};

struct ld_pipeline {
    ld_hub *hub;
    ld_scfg *cfg;
    ld_stream *s;       /* NULL once finished at creation */
    uint32_t rank;
    uint64_t spec_hash;
    ld_stats *stats;
    ld_stats own_stats;
    ld_window *w;       /* current window (a reference), NULL before the first */
    size_t next_row;    /* of this rank's rows of w */
    uint64_t want_seq;  /* before the first window: the seq of the window at `start` */
    ld_spos start;      /* position of the first window */
    size_t skip_rows;   /* rows of the first window already emitted (resume) */
    int data_done, finished;
    _Atomic int sharing; /* pipelines on p's stream (set under the stream's mu; read by status) */
    uint64_t step;
    int err;            /* sticky error of ld_pipeline_next */
    char err_msg[512];
    _Atomic int cancelled; /* ld_pipeline_cancel */
    pthread_mutex_t s_mu;  /* serialises ld_pipeline_cancel with p->s changing (join/leave) */
};

/* ---------------------------------------------------------------- job configuration */


static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* Expand one dataset's globs, sort and deduplicate them, append to cfg->paths. */
static int expand_shards(ld_scfg *cfg, char *const *shards, int n_shards, uint32_t d) {
    size_t n = 0, cap = 0;
    char **v = bt_vec_xgrow(NULL, &cap, 16, sizeof *v);
    for (int i = 0; i < n_shards; i++) {
        glob_t gl;
        int rc = glob(shards[i], GLOB_ERR, NULL, &gl);
        struct stat sst;
        if (rc == GLOB_NOMATCH && stat(shards[i], &sst) == 0) {
            /* an existing file whose name holds glob characters (e.g. "part[1].jsonl") */
            v = bt_vec_xgrow(v, &cap, n + 1, sizeof *v);
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
            v = bt_vec_xgrow(v, &cap, n + 1, sizeof *v);
            v[n++] = bt_xstrdup(gl.gl_pathv[k]);
        }
        globfree(&gl);
    }
    qsort(v, n, sizeof *v, cmp_str);
    cfg->paths = bt_xrealloc(cfg->paths, (cfg->n_paths + n + 1) * sizeof *cfg->paths);
    cfg->ds[d].first = (uint32_t)cfg->n_paths;
    for (size_t k = 0; k < n; k++) {
        if (cfg->n_paths > cfg->ds[d].first && strcmp(cfg->paths[cfg->n_paths - 1], v[k]) == 0) free(v[k]);
        else cfg->paths[cfg->n_paths++] = v[k];
    }
    cfg->ds[d].n = (uint32_t)(cfg->n_paths - cfg->ds[d].first);
    free(v);
    return BT_OK;
}

/* The resume-state hash of the spec for `rank` of `world` ranks (unchanged since state version 2). */
static uint64_t hash_spec(const ld_scfg *cfg, uint32_t rank, uint32_t world) {
    uint64_t h = BT_FNV64_INIT;
    for (uint32_t d = 0; d < cfg->n_ds; d++) {
        const ld_dataset *ds = &cfg->ds[d];
        uint32_t v[5] = {d, ds->n, (uint32_t)ds->fcfg.format, ds->q, (uint32_t)ds->fcfg.tpl};
        h = bt_fnv1a64(h, v, sizeof v);
        for (uint32_t i = 0; i < ds->n; i++)
            h = bt_fnv1a64(h, cfg->paths[ds->first + i], strlen(cfg->paths[ds->first + i]) + 1);
        if (ds->fcfg.format == LD_FMT_TEXT) h = bt_fnv1a64(h, ds->text_field, strlen(ds->text_field) + 1);
        if (ds->fcfg.format == LD_FMT_PREFERENCE || ds->fcfg.format == LD_FMT_KTO) { /* SFT hashes unchanged */
            uint32_t m[2] = {ds->fcfg.max_prompt_length, ds->fcfg.max_length};
            h = bt_fnv1a64(h, m, sizeof m);
        }
    }
    uint32_t v[9] = {cfg->T, cfg->B, rank, world, LD_STATE_VERSION, (uint32_t)cfg->ds[0].fcfg.overlong_drop,
                     (uint32_t)cfg->ds[0].fcfg.add_bos, (uint32_t)cfg->win_tokens, LD_WINDOW_DOCS};
    h = bt_fnv1a64(h, v, sizeof v);
    return bt_fnv1a64(h, &cfg->seed, sizeof cfg->seed);
}

/* Canonical description of everything a stream depends on (compared byte for byte). */
static void canon_put(ld_scfg *cfg, size_t *cap, const void *p, size_t n) {
    if (cfg->canon_len + n > *cap) {
        while (cfg->canon_len + n > *cap) *cap = *cap ? 2 * *cap : 1024;
        cfg->canon = bt_xrealloc(cfg->canon, *cap);
    }
    memcpy(cfg->canon + cfg->canon_len, p, n);
    cfg->canon_len += n;
}

static void make_canon(ld_scfg *cfg) {
    size_t cap = 0;
    for (uint32_t d = 0; d < cfg->n_ds; d++) {
        const ld_dataset *ds = &cfg->ds[d];
        uint32_t v[10] = {d, ds->n, (uint32_t)ds->fcfg.format, ds->q, (uint32_t)ds->fcfg.tpl, (uint32_t)ds->fcfg.add_bos,
                          (uint32_t)ds->fcfg.overlong_drop, ds->fcfg.T, ds->fcfg.max_prompt_length, ds->fcfg.max_length};
        canon_put(cfg, &cap, v, sizeof v);
        for (uint32_t i = 0; i < ds->n; i++)
            canon_put(cfg, &cap, cfg->paths[ds->first + i], strlen(cfg->paths[ds->first + i]) + 1);
        canon_put(cfg, &cap, ds->text_field, strlen(ds->text_field) + 1);
    }
    uint64_t v[7] = {cfg->T, cfg->B, cfg->world, cfg->epochs, cfg->win_tokens, cfg->seed, (uint64_t)cfg->pad_id};
    canon_put(cfg, &cap, v, sizeof v);
    if (cfg->ref_base) { /* jobs of another reference key never share a stream (its tables) */
        canon_put(cfg, &cap, &cfg->ref_uid, sizeof cfg->ref_uid);
        canon_put(cfg, &cap, cfg->ref_base, strlen(cfg->ref_base) + 1);
    }
}

/* tokenizer.ggml.add_bos_token of a .gguf tokenizer file (0 when absent or unreadable). */
static int gguf_add_bos(const char *path) {
    size_t n = path ? strlen(path) : 0;
    if (n < 5 || strcmp(path + n - 5, ".gguf") != 0) return 0;
    bt_gguf *g = NULL;
    if (bt_gguf_open(&g, path) != BT_OK) return 0;
    int v = 0;
    if (bt_gguf_check(g, bt_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &v)) != BT_OK) v = 0;
    bt_gguf_close(g);
    return v != 0;
}

/* Datasets of the spec (or its single-dataset fields) -> cfg->ds, paths, weights, format configs. */
static int setup_datasets(ld_scfg *cfg, const ld_job_spec *spec, const bt_tokenizer *tok) {
    ld_dataset_spec one = {spec->shards, spec->n_shards, spec->format, spec->text_field, 1.0};
    const ld_dataset_spec *dv = spec->n_datasets > 0 ? spec->datasets : &one;
    int nd = spec->n_datasets > 0 ? spec->n_datasets : 1;
    if (nd > LD_MAX_DATASETS)
        return bt_fail(BT_ERR_INVALID, "pipeline: %d datasets (at most %d)", nd, LD_MAX_DATASETS);
    double wmax = 0;
    for (int d = 0; d < nd; d++) {
        if (!(dv[d].weight > 0) || !isfinite(dv[d].weight) || dv[d].n_shards < 1 ||
            (dv[d].format != LD_FMT_TEXT && dv[d].format != LD_FMT_CHAT && dv[d].format != LD_FMT_ALPACA &&
             dv[d].format != LD_FMT_PREFERENCE && dv[d].format != LD_FMT_KTO))
            return bt_fail(BT_ERR_INVALID, "pipeline: dataset %d: bad weight, shards or format", d);
        if (dv[d].weight > wmax) wmax = dv[d].weight;
    }
    int add_bos = gguf_add_bos(spec->tokenizer);
    ld_chat_tpl tpl = LD_TPL_CHATML;
    int tpl_done = 0;
    for (int d = 0; d < nd; d++) {
        ld_dataset *ds = &cfg->ds[d];
        double q = round(dv[d].weight / wmax * LD_WEIGHT_SCALE);
        ds->q = q < 1 ? 1 : (uint32_t)q;
        cfg->W += ds->q;
        ds->text_field = bt_xstrdup(dv[d].text_field ? dv[d].text_field : "text");
        cfg->n_ds = (uint32_t)d + 1;
        if (dv[d].format != LD_FMT_TEXT && !tpl_done) {
            int rc = ld_chat_tpl_resolve(tok, spec->chat_template, &tpl);
            if (rc != BT_OK) return rc;
            tpl_done = 1;
        }
        ds->fcfg = (ld_format_cfg){dv[d].format, ds->text_field, tok, dv[d].format == LD_FMT_TEXT ? 0 : spec->T,
                                   tpl, add_bos, spec->overlong_drop,
                                   spec->max_prompt_length, spec->max_length};
        int rc = expand_shards(cfg, dv[d].shards, dv[d].n_shards, (uint32_t)d);
        if (rc != BT_OK) return rc;
    }
    /* the template used by chat datasets before the first was seen is the same one */
    for (int d = 0; d < nd; d++) cfg->ds[d].fcfg.tpl = tpl;
    return BT_OK;
}

static int scfg_new(ld_scfg **out, const ld_job_spec *spec, const bt_tokenizer *tok, ld_tcache *cache) {
    ld_scfg *cfg = bt_xcalloc(1, sizeof *cfg);
    atomic_store(&cfg->refs, 1);
    cfg->T = spec->T;
    cfg->B = spec->B;
    cfg->world = spec->world_size;
    cfg->epochs = spec->epochs;
    cfg->n_threads = spec->n_threads ? spec->n_threads : 1;
    cfg->seed = spec->seed;
    cfg->tok = tok;
    cfg->cache = cache;
    int32_t pad = bt_tokenizer_pad(tok);
    if (pad < 0) pad = bt_tokenizer_eos(tok);
    cfg->pad_id = pad < 0 ? 0 : pad;
    uint64_t wt = (uint64_t)LD_WINDOW_ROWS * cfg->T;
    uint64_t cap = LD_WINDOW_MAX_TOKENS > 2ull * cfg->T ? LD_WINDOW_MAX_TOKENS : 2ull * cfg->T;
    cfg->win_tokens = wt < cap ? wt : cap;
    int rc = setup_datasets(cfg, spec, tok);
    if (rc != BT_OK) {
        ld_scfg_put(cfg);
        *out = NULL;
        return rc;
    }
    if (cache && spec->ref_base) {
        int pref = 0;
        for (uint32_t d = 0; d < cfg->n_ds; d++)
            pref |= cfg->ds[d].fcfg.format == LD_FMT_PREFERENCE || cfg->ds[d].fcfg.format == LD_FMT_KTO;
        if (pref) {
            cfg->ref_base = bt_xstrdup(spec->ref_base);
            cfg->ref_uid = spec->ref_uid;
            cfg->ref_tab = bt_xcalloc(cfg->n_paths ? cfg->n_paths : 1, sizeof *cfg->ref_tab);
        }
    }
    make_canon(cfg);
    if (cache) {
        ld_tcache_tokenizer_sha256(tok, cfg->tok_sha256);
        cfg->shards = bt_xcalloc(cfg->n_paths ? cfg->n_paths : 1, sizeof *cfg->shards);
        for (uint32_t d = 0; d < cfg->n_ds; d++)
            for (uint32_t i = 0; i < cfg->ds[d].n; i++) {
                size_t f = cfg->ds[d].first + i;
                cfg->shards[f] = (ld_tc_shard){cfg->paths[f], &cfg->ds[d].fcfg, cfg->tok_sha256};
            }
    }
    *out = cfg;
    return BT_OK;
}

/* ---------------------------------------------------------------- resume state */

/* little-endian fields at b[*o], advancing *o (common/bt_le.h) */
static void put32(uint8_t *b, size_t *o, uint32_t v) { bt_put32(b + *o, v), *o += 4; }
static void put64(uint8_t *b, size_t *o, uint64_t v) { bt_put64(b + *o, v), *o += 8; }
static uint32_t get32(const uint8_t *b, size_t *o) { return *o += 4, bt_get32(b + *o - 4); }
static uint64_t get64(const uint8_t *b, size_t *o) { return *o += 8, bt_get64(b + *o - 8); }

/* Layout (248 of 256 bytes, rest zero): u32 magic, u32 version, u64 spec_hash, u64 next_step,
 * u32 epoch, u32 flags, u64 window start n, u64 rows of this rank in that window already emitted,
 * u32 n_datasets, u32 0, then per dataset (LD_MAX_DATASETS slots) u32 pass, u64 line. */
static void encode_state(const ld_pipeline *p, uint8_t *out) {
    memset(out, 0, BT_RESUME_STATE_BYTES);
    const ld_window *w = p->w;
    const ld_scfg *cfg = p->cfg;
    uint32_t flags = 0;
    uint64_t rows;
    ld_spos at, zero;
    memset(&zero, 0, sizeof zero);
    if (p->finished || p->data_done || (w && w->last && p->next_row >= w->rank_rows)) {
        flags = LD_STATE_F_FINISHED; /* canonical form: the same however we got here */
        at = zero;
        at.epoch = cfg->epochs;
        rows = 0;
    } else if (!w) { /* the first window is not taken yet (resume) */
        at = p->start;
        rows = p->skip_rows;
    } else if (p->next_row >= w->rank_rows) { /* at a window boundary: the next window's start */
        at = w->end;
        rows = 0;
    } else {
        at = w->start;
        rows = p->next_row;
    }
    size_t o = 0;
    put32(out, &o, LD_STATE_MAGIC);
    put32(out, &o, LD_STATE_VERSION);
    put64(out, &o, p->spec_hash);
    put64(out, &o, p->step);
    put32(out, &o, at.epoch);
    put32(out, &o, flags);
    put64(out, &o, at.g);
    put64(out, &o, rows);
    put32(out, &o, cfg->n_ds);
    put32(out, &o, 0);
    for (uint32_t d = 0; d < LD_MAX_DATASETS; d++) {
        put32(out, &o, d < cfg->n_ds ? at.pos[d].pass : 0);
        put64(out, &o, d < cfg->n_ds ? at.pos[d].g : 0);
    }
}

/* p's start from state st. from_world (0: p's world): the world size st was written by; another
 * than p's is a state of rank 0 of that world, and p continues at the same row of the same window
 * (pipeline.h, the world-size change). */
static int decode_state(ld_pipeline *p, const uint8_t *st, uint32_t from_world) {
    size_t o = 0;
    const ld_scfg *cfg = p->cfg;
    uint32_t magic = get32(st, &o), ver = get32(st, &o);
    uint64_t hash = get64(st, &o);
    int rewrap = from_world && from_world != cfg->world;
    if (magic != LD_STATE_MAGIC || ver != LD_STATE_VERSION)
        return bt_fail(BT_ERR_INVALID, "resume state: bad magic/version (0x%08x v%u, want v%u)", magic, ver,
                       LD_STATE_VERSION);
    if (rewrap && hash != hash_spec(cfg, 0, from_world))
        return bt_fail(BT_ERR_INVALID, "resume state: not rank 0's state of a job of world size %u with this spec "
                       "(datasets, shards, formats, weights, chat_template, overlong, seq_len, micro_batch_size or "
                       "seed changed)", from_world);
    if (!rewrap && hash != p->spec_hash)
        return bt_fail(BT_ERR_INVALID, "resume state: written for a different job spec (datasets, shards, formats, "
                       "weights, chat_template, overlong, seq_len, micro_batch_size, seed, rank or world size changed)");
    p->step = get64(st, &o);
    p->start.epoch = get32(st, &o);
    uint32_t flags = get32(st, &o);
    p->start.g = get64(st, &o);
    uint64_t rows = get64(st, &o);
    uint32_t n_ds = get32(st, &o);
    (void)get32(st, &o);
    if (rows > SIZE_MAX / 2 || (!(flags & LD_STATE_F_FINISHED) && n_ds != cfg->n_ds))
        return bt_fail(BT_ERR_INVALID, "resume state: bad row or dataset count");
    for (uint32_t d = 0; d < LD_MAX_DATASETS; d++) {
        ld_dpos x;
        x.pass = get32(st, &o);
        x.g = get64(st, &o);
        if (d < cfg->n_ds) p->start.pos[d] = x;
    }
    if (!(flags & LD_STATE_F_FINISHED) && p->start.pos[0].pass != p->start.epoch)
        return bt_fail(BT_ERR_INVALID, "resume state: inconsistent (epoch %u, first dataset pass %u)",
                       p->start.epoch, p->start.pos[0].pass);
    if (rewrap && !(flags & LD_STATE_F_FINISHED)) {
        /* rank r of W ranks takes rows r, r + W, ... of a window: rank 0 of from_world ranks having
         * emitted `rows` of its rows, every rank of that run had, so rows x from_world of the window
         * are consumed; here they are rows x from_world / W rows of each of W ranks */
        uint64_t g = rows * from_world;
        if (g % cfg->world)
            return bt_fail(BT_ERR_INVALID, "resume state: %u rank(s) stopped %llu rows into a window, not a multiple "
                           "of this run's %u rank(s): resume with a world size that divides %llu", from_world,
                           (unsigned long long)g, cfg->world, (unsigned long long)g);
        rows = g / cfg->world;
    }
    p->skip_rows = (size_t)rows;
    if ((flags & LD_STATE_F_FINISHED) || (cfg->epochs && p->start.epoch >= cfg->epochs)) p->finished = 1;
    return BT_OK;
}

/* ---------------------------------------------------------------- streams and the hub */

static int same_spos(const ld_spos *a, const ld_spos *b, uint32_t n_ds) {
    if (a->epoch != b->epoch || a->g != b->g) return 0;
    for (uint32_t d = 0; d < n_ds; d++)
        if (a->pos[d].pass != b->pos[d].pass || a->pos[d].g != b->pos[d].g) return 0;
    return 1;
}


/* The seq of s's window starting at `at` if s has it or builds it next (under s->mu). */
static int stream_offers(const ld_stream *s, const ld_spos *at, uint64_t *seq) {
    if (s->err) return 0;
    for (const ld_window *w = s->head; w; w = w->next)
        if (same_spos(&w->start, at, s->cfg->n_ds)) {
            *seq = w->seq;
            return 1;
        }
    if (same_spos(ld_stream_next_start(s), at, s->cfg->n_ds)) {
        *seq = s->next_seq;
        return 1;
    }
    return 0;
}

/* Tell every member how many share the stream (under s->mu). */
static void count_members(ld_stream *s) {
    for (size_t i = 0; i < s->n_members; i++) atomic_store(&s->members[i]->sharing, (int)s->n_members);
}

static void add_member(ld_stream *s, ld_pipeline *p) {
    s->members = bt_vec_xgrow(s->members, &s->cap_members, s->n_members + 1, sizeof *s->members);
    s->members[s->n_members++] = p;
    count_members(s);
}

/* Drop windows nobody may need: behind the slowest cursor (less LD_KEEP_BEHIND), and the
 * oldest ones beyond LD_MAX_WINDOWS (a cursor that needs them later goes its own way). */
static void trim(ld_stream *s) {
    uint64_t min = UINT64_MAX;
    for (size_t i = 0; i < s->n_members; i++) {
        const ld_pipeline *m = s->members[i];
        uint64_t need = m->w ? m->w->seq : m->want_seq;
        if (need < min) min = need;
    }
    size_t count = 0;
    for (ld_window *w = s->head; w; w = w->next) count++;
    while (s->head && (s->head->seq + LD_KEEP_BEHIND < min || count > s->max_windows)) {
        ld_window *w = s->head;
        s->head = w->next;
        if (!s->head) s->tail = NULL;
        ld_window_put(w);
        count--;
    }
}

/* Remove p from its stream; free the stream when it was the last member. */
static void leave_stream(ld_pipeline *p) {
    pthread_mutex_lock(&p->s_mu);
    ld_stream *s = p->s;
    if (!s) {
        pthread_mutex_unlock(&p->s_mu);
        return;
    }
    if (s->shared) pthread_mutex_lock(&p->hub->mu);
    pthread_mutex_lock(&s->mu);
    for (size_t i = 0; i < s->n_members; i++)
        if (s->members[i] == p) {
            s->members[i] = s->members[--s->n_members];
            break;
        }
    count_members(s);
    atomic_store(&p->sharing, 0);
    ld_window_put(p->w);
    p->w = NULL;
    int last = s->n_members == 0;
    if (!last) trim(s);
    pthread_mutex_unlock(&s->mu);
    if (last && s->shared)
        for (ld_stream **pp = &p->hub->streams; *pp; pp = &(*pp)->hub_next)
            if (*pp == s) {
                *pp = s->hub_next;
                break;
            }
    if (s->shared) pthread_mutex_unlock(&p->hub->mu);
    p->s = NULL;
    pthread_mutex_unlock(&p->s_mu);
    if (last) ld_stream_free(s); /* joins its threads: outside the locks */
}

/* A stream for p starting at `at`: joined from the hub when one offers it (shared), else new.
 * Caller holds p->s_mu. */
static int join_stream_locked(ld_pipeline *p, const ld_spos *at, int use_hub) {
    ld_hub *h = use_hub ? p->hub : NULL;
    if (h) {
        pthread_mutex_lock(&h->mu);
        for (ld_stream *s = h->streams; s; s = s->hub_next) {
            if (s->cfg->tok != p->cfg->tok || s->cfg->canon_len != p->cfg->canon_len ||
                memcmp(s->cfg->canon, p->cfg->canon, p->cfg->canon_len) != 0)
                continue;
            pthread_mutex_lock(&s->mu);
            int taken = 0;
            for (size_t i = 0; i < s->n_members && !taken; i++) taken = s->members[i]->rank == p->rank;
            uint64_t seq;
            if (!taken && stream_offers(s, at, &seq)) {
                add_member(s, p);
                p->want_seq = seq;
                p->s = s;
            }
            pthread_mutex_unlock(&s->mu);
            if (p->s) break;
        }
        if (p->s) {
            pthread_mutex_unlock(&h->mu);
            return BT_OK;
        }
    }
    ld_stream *s = NULL;
    int rc = ld_stream_new(&s, p->cfg, at, h ? NULL : p->stats);
    if (rc == BT_OK) {
        add_member(s, p);
        p->want_seq = 0;
        p->s = s;
        if (h) {
            s->max_windows = h->max_windows;
            s->shared = 1;
            s->hub_next = h->streams;
            h->streams = s;
        }
    }
    if (h) pthread_mutex_unlock(&h->mu);
    return rc;
}

static int join_stream(ld_pipeline *p, const ld_spos *at, int use_hub) {
    pthread_mutex_lock(&p->s_mu);
    int rc = join_stream_locked(p, at, use_hub);
    pthread_mutex_unlock(&p->s_mu);
    return rc;
}

/* p fell too far behind its shared stream: continue on a stream of its own from where it is. */
static int go_private(ld_pipeline *p) {
    ld_spos at = p->w ? p->w->end : p->start;
    if (p->w) p->skip_rows = 0;
    bt_log(BT_LOG_INFO, "loaderd", "pipeline: rank %u fell %u+ windows behind the other ranks of its job: it "
           "continues on a stream of its own", p->rank, p->s->max_windows);
    leave_stream(p);
    p->start = at;
    return join_stream(p, &at, 0);
}

/* Make p->w the next window (building it if nobody has yet). */
static int advance(ld_pipeline *p) {
    for (;;) {
        if (atomic_load(&p->cancelled)) return bt_fail(BT_ERR_CLOSED, "cancelled");
        ld_stream *s = p->s;
        pthread_mutex_lock(&s->mu);
        uint64_t want = p->w ? p->w->seq + 1 : p->want_seq;
        for (;;) {
            ld_window *w = s->head;
            while (w && w->seq != want) w = w->next;
            if (w) {
                w->refs++;
                ld_window_put(p->w);
                p->w = w;
                p->next_row = 0;
                trim(s);
                pthread_mutex_unlock(&s->mu);
                return BT_OK;
            }
            if (want < s->next_seq) break; /* dropped: we are too far behind */
            if (s->err) {
                int rc = s->err;
                char msg[512];
                snprintf(msg, sizeof msg, "%s", s->err_msg);
                pthread_mutex_unlock(&s->mu);
                return bt_fail(rc, "%s", msg);
            }
            if (atomic_load(&p->cancelled)) { /* ld_pipeline_cancel broadcasts s->cv */
                pthread_mutex_unlock(&s->mu);
                return bt_fail(BT_ERR_CLOSED, "cancelled");
            }
            if (s->building) {
                pthread_cond_wait(&s->cv, &s->mu);
                continue;
            }
            s->building = 1;
            pthread_mutex_unlock(&s->mu);
            ld_window *nw = NULL;
            int rc = ld_stream_build_window(s, &nw);
            pthread_mutex_lock(&s->mu);
            s->building = 0;
            if (rc < 0) {
                s->err = rc;
                snprintf(s->err_msg, sizeof s->err_msg, "%s", bt_last_error());
            } else {
                nw->seq = s->next_seq++;
                nw->refs = 1;
                if (s->tail) s->tail->next = nw;
                else s->head = nw;
                s->tail = nw;
                trim(s);
            }
            pthread_cond_broadcast(&s->cv);
        }
        pthread_mutex_unlock(&s->mu);
        int rc = go_private(p);
        if (rc != BT_OK) return rc;
    }
}

int ld_hub_new(ld_hub **out, ld_tcache *cache) {
    ld_hub *h = bt_xcalloc(1, sizeof *h);
    pthread_mutex_init(&h->mu, NULL);
    h->cache = cache;
    h->max_windows = LD_MAX_WINDOWS;
    *out = h;
    return BT_OK;
}

void ld_hub_free(ld_hub *h) {
    if (!h) return;
    pthread_mutex_destroy(&h->mu);
    free(h);
}


void ld_hub_set_max_windows(ld_hub *h, uint32_t n) { h->max_windows = n < 1 ? 1 : n; }

void ld_hub_counts(ld_hub *h, uint32_t *streams, uint32_t *cursors) {
    *streams = *cursors = 0;
    if (!h) return;
    pthread_mutex_lock(&h->mu);
    for (ld_stream *s = h->streams; s; s = s->hub_next) {
        (*streams)++;
        pthread_mutex_lock(&s->mu);
        *cursors += (uint32_t)s->n_members;
        pthread_mutex_unlock(&s->mu);
    }
    pthread_mutex_unlock(&h->mu);
}

/* ---------------------------------------------------------------- create / next / free */

int ld_pipeline_attach(ld_pipeline **out, ld_hub *hub, const ld_job_spec *spec, const bt_tokenizer *tok,
                       const uint8_t *resume_state, ld_stats *stats) {
    *out = NULL;
    if (!spec || !tok) return bt_fail(BT_ERR_INVALID, "pipeline: spec and tokenizer are required");
    if (spec->T < 1 || spec->B < 1 || spec->world_size < 1 || spec->rank >= spec->world_size ||
        (spec->n_datasets < 1 && spec->n_shards < 1) || (uint64_t)spec->B * spec->T > (1u << 24))
        return bt_fail(BT_ERR_INVALID, "pipeline: bad spec (B=%u T=%u rank=%u world_size=%u shards=%d datasets=%d)",
                       spec->B, spec->T, spec->rank, spec->world_size, spec->n_shards, spec->n_datasets);
    ld_pipeline *p = bt_xcalloc(1, sizeof *p);
    pthread_mutex_init(&p->s_mu, NULL);
    p->hub = hub;
    p->rank = spec->rank;
    p->stats = stats ? stats : &p->own_stats;
    int rc = scfg_new(&p->cfg, spec, tok, hub ? hub->cache : NULL);
    if (rc == BT_OK) {
        p->spec_hash = hash_spec(p->cfg, p->rank, p->cfg->world);
        for (uint32_t d = 0; d < p->cfg->n_ds; d++) p->start.pos[d].pass = 0;
        if (resume_state) rc = decode_state(p, resume_state, spec->resume_world);
    }
    if (rc == BT_OK && !p->finished) rc = join_stream(p, &p->start, hub != NULL);
    if (rc != BT_OK) {
        ld_pipeline_free(p);
        return rc;
    }
    atomic_store_explicit(&p->stats->epoch, p->start.epoch, memory_order_relaxed);
    bt_log(BT_LOG_INFO, "loaderd", "pipeline: %u dataset(s), %zu shard(s), rank %u/%u, B=%u T=%u, %u tokenize "
           "thread(s), chat template %s%s%s%s", p->cfg->n_ds, p->cfg->n_paths, p->rank, p->cfg->world, p->cfg->B,
           p->cfg->T, p->cfg->n_threads, ld_chat_tpl_name(p->cfg->ds[0].fcfg.tpl), resume_state ? ", resumed" : "",
           atomic_load(&p->sharing) > 1 ? ", sharing the job's stream" : "", p->cfg->cache ? ", token cache" : "");
    *out = p;
    return BT_OK;
}

int ld_pipeline_new(ld_pipeline **out, const ld_job_spec *spec, const bt_tokenizer *tok,
                    const uint8_t *resume_state, ld_stats *stats) {
    return ld_pipeline_attach(out, NULL, spec, tok, resume_state, stats);
}

static void write_header(ld_pipeline *p, bt_batch_view *v, uint32_t job_id, uint32_t n_cu, uint32_t real,
                         uint32_t labelled, uint32_t docs, uint32_t flags, uint32_t epoch) {
    bt_batch_header *h = v->hdr;
    h->magic = BT_BATCH_MAGIC;
    h->layout_version = BT_BATCH_LAYOUT_VERSION;
    h->job_id = job_id;
    h->rank = p->rank;
    h->step = p->step;
    h->B = p->cfg->B;
    h->T = p->cfg->T;
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

/* A shared stream counts documents, lines and bad lines once for all its ranks: copy them. */
static void mirror_stats(ld_pipeline *p) {
    if (!p->s || p->s->stats == p->stats) return;
    const ld_stats *a = p->s->stats;
    ld_stats *b = p->stats;
#define CP(f) atomic_store_explicit(&b->f, atomic_load_explicit(&a->f, memory_order_relaxed), memory_order_relaxed)
    CP(docs);
    CP(truncated);
    CP(split);
    CP(windows);
    CP(lines);
    CP(blank);
    CP(epoch);
    for (int r = 0; r < LD_BAD_N; r++) CP(bad[r]);
    for (int d = 0; d < LD_MAX_DATASETS; d++) {
        CP(dataset_docs[d]);
        CP(dataset_pass[d]);
    }
#undef CP
}

/* Rows of this rank into the batch; returns how many came from windows (0: the data ended). */
static int fill_rows(ld_pipeline *p, bt_batch_view *v, uint32_t *n_cu, uint32_t *real, uint32_t *labelled,
                     uint32_t *docs, uint32_t *epoch, uint32_t *rows, int32_t *n_rec) {
    const uint32_t T = p->cfg->T, B = p->cfg->B, world = p->cfg->world;
    for (uint32_t r = 0; r < B; r++) {
        while (!p->data_done && (!p->w || p->next_row >= p->w->rank_rows)) {
            if (p->w && p->w->last) {
                p->data_done = 1;
                break;
            }
            int first = !p->w;
            int rc = advance(p);
            if (rc < 0) return rc;
            if (first && p->skip_rows) {
                if (p->skip_rows > p->w->rank_rows)
                    return bt_fail(BT_ERR_INVALID, "pipeline: resume state skips %zu rows of a window of %zu "
                                   "(data or spec changed?)", p->skip_rows, p->w->rank_rows);
                p->next_row = p->skip_rows;
                p->skip_rows = 0;
            }
        }
        const ld_window *w = p->w;
        size_t o = (size_t)r * T;
        if (!p->data_done && (*rows)++ == 0) *epoch = w->start.epoch;
        size_t pr = p->data_done ? SIZE_MAX : p->next_row++ * world + p->rank; /* plan row */
        if (p->data_done || pr >= w->plan.n_rows) {
            ld_pack_write_pad_row(T, p->cfg->pad_id, (uint32_t)o, v->input_ids + o, v->labels + o,
                                  v->position_ids + o, v->cu_seqlens, n_cu, v->seg_pair, v->seg_kind, v->seg_src,
                                  v->seg_line);
            ADD(pad_rows, 1);
            continue;
        }
        ld_row_stats st;
        ld_pack_write_row(&w->plan, pr, w->docs, T, p->cfg->pad_id, (uint32_t)o, v->input_ids + o, v->labels + o,
                          v->position_ids + o, v->cu_seqlens, n_cu, &st, v->seg_pair, v->seg_kind, n_rec,
                          v->seg_src, v->seg_line);
        *real += st.real;
        *labelled += st.labelled;
        *docs += st.pieces;
    }
    return BT_OK;
}

/* Layout 3's reference fields of every segment: the cached value where the job has a reference key
 * and the store holds one (loaderd/refstore.h), else 0 / 0.0. */
static void fill_ref(ld_pipeline *p, bt_batch_view *v, uint32_t n_cu) {
    const ld_scfg *cfg = p->s ? p->s->cfg : NULL;
    for (uint32_t k = 0; k + 1 < n_cu; k++) {
        v->seg_ref_ok[k] = 0;
        v->seg_ref_logp[k] = 0.0;
        int32_t src = v->seg_src[k], line = v->seg_line[k];
        if (!cfg || !cfg->ref_tab || v->seg_kind[k] == BT_SEG_PLAIN || src < 0 || (size_t)src >= cfg->n_paths || line < 1)
            continue;
        ld_reftab *t = atomic_load(&cfg->ref_tab[src]);
        double x;
        if (t && ld_reftab_lookup(t, (uint64_t)line, ld_ref_side(v->seg_kind[k]), &x)) {
            v->seg_ref_ok[k] = 1;
            v->seg_ref_logp[k] = x;
        } else if (!t) {
            atomic_fetch_add_explicit(&ld_tcache_stats_of(cfg->cache)->ref_missed, 1, memory_order_relaxed);
        }
    }
}

int ld_pipeline_next(ld_pipeline *p, bt_batch_view *v, uint32_t job_id) {
    const uint32_t T = p->cfg->T, B = p->cfg->B;
    if (p->err) return bt_fail(p->err, "%s", p->err_msg);
    uint32_t n_cu = 0, real = 0, labelled = 0, docs = 0, epoch = p->w ? p->w->start.epoch : p->start.epoch, rows = 0;
    if (!p->finished) {
        int32_t n_rec = 0;
        int rc = fill_rows(p, v, &n_cu, &real, &labelled, &docs, &epoch, &rows, &n_rec);
        mirror_stats(p);
        if (rc < 0) return next_failed(p, rc);
    }
    if (rows == 0) { /* END_OF_DATA: all-padding rows, no documents */
        if (!p->finished) atomic_fetch_sub_explicit(&p->stats->pad_rows, B, memory_order_relaxed);
        p->finished = 1;
        n_cu = 0;
        for (uint32_t r = 0; r < B; r++) {
            size_t o = (size_t)r * T;
            ld_pack_write_pad_row(T, p->cfg->pad_id, (uint32_t)o, v->input_ids + o, v->labels + o,
                                  v->position_ids + o, v->cu_seqlens, &n_cu, v->seg_pair, v->seg_kind, v->seg_src,
                                  v->seg_line);
        }
        v->cu_seqlens[n_cu++] = (int32_t)(B * T);
        fill_ref(p, v, n_cu);
        encode_state(p, v->hdr->resume_state);
        write_header(p, v, job_id, n_cu, 0, 0, 0, BT_BATCH_F_END_OF_DATA, p->cfg->epochs);
        return 1;
    }
    v->cu_seqlens[n_cu++] = (int32_t)(B * T);
    fill_ref(p, v, n_cu);
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

int ld_pipeline_ref_put(ld_pipeline *p, int64_t src, int64_t line, int64_t side, double v, char *why, size_t cap,
                        ld_reftab **done) {
    if (done) *done = NULL;
    pthread_mutex_lock(&p->s_mu); /* p->s cannot change or go away meanwhile */
    const ld_scfg *cfg = p->s ? p->s->cfg : p->cfg;
    int rc = BT_ERR_INVALID;
    ld_reftab *t = NULL;
    if (!cfg->ref_tab) snprintf(why, cap, "this job has no reference key (job key \"ref_base\", a preference or kto "
                                "dataset and loaderd's token_cache_dir)");
    else if (src < 0 || (uint64_t)src >= cfg->n_paths)
        snprintf(why, cap, "shard %lld: the job has %zu shard(s)", (long long)src, cfg->n_paths);
    else if (line < 1 || line > INT32_MAX) snprintf(why, cap, "line %lld: outside [1, 2^31-1]", (long long)line);
    else if (side < 0 || side > 1) snprintf(why, cap, "side %lld: 0 (chosen or kto) or 1 (rejected)", (long long)side);
    else if (!(t = atomic_load(&cfg->ref_tab[src])))
        snprintf(why, cap, "shard %lld has no reference table (not opened yet, or read without the token cache)",
                 (long long)src);
    else rc = ld_reftab_set(t, (uint64_t)line, (int)side, v, why, cap, done);
    if (rc != BT_OK && !t && cfg->cache)
        atomic_fetch_add_explicit(&ld_tcache_stats_of(cfg->cache)->ref_rejected, 1, memory_order_relaxed);
    pthread_mutex_unlock(&p->s_mu);
    return rc;
}

int ld_pipeline_sharing(ld_pipeline *p) { return p ? atomic_load(&p->sharing) : 0; }

void ld_pipeline_cancel(ld_pipeline *p) {
    if (!p) return;
    atomic_store(&p->cancelled, 1);
    pthread_mutex_lock(&p->s_mu); /* p->s cannot change or go away meanwhile */
    ld_stream *s = p->s;
    if (s) {
        pthread_mutex_lock(&s->mu);
        int live = 0;
        for (size_t i = 0; i < s->n_members; i++) live += !atomic_load(&s->members[i]->cancelled);
        if (!live && s->q) { /* nobody will use the window being built: abandon it */
            if (!s->err) {
                s->err = BT_ERR_CLOSED;
                snprintf(s->err_msg, sizeof s->err_msg, "cancelled");
            }
            ld_chunkq_cancel_take(s->q);
        }
        pthread_cond_broadcast(&s->cv); /* a member waiting for another's window */
        pthread_mutex_unlock(&s->mu);
    }
    pthread_mutex_unlock(&p->s_mu);
}

void ld_pipeline_free(ld_pipeline *p) {
    if (!p) return;
    leave_stream(p);
    pthread_mutex_destroy(&p->s_mu);
    ld_scfg_put(p->cfg);
    free(p);
}

uint64_t ld_pipeline_mem_estimate(const ld_job_spec *spec) {
    if (!spec || spec->B == 0 || spec->T == 0) return 0;
    uint64_t threads = spec->n_threads ? spec->n_threads : 1;
    uint64_t q = 2 * threads + 2; /* p->Q */
    uint64_t chunks = q * (uint64_t)LD_CHUNK_BYTES * 3;
    uint64_t wt = (uint64_t)LD_WINDOW_ROWS * spec->T;
    uint64_t cap = LD_WINDOW_MAX_TOKENS > 2ull * spec->T ? LD_WINDOW_MAX_TOKENS : 2ull * spec->T;
    uint64_t win = (wt < cap ? wt : cap) * 16;
    uint64_t nd = spec->n_datasets > 0 ? (uint64_t)spec->n_datasets : 1;
    uint64_t sources = nd * (((uint64_t)256 << 10) + ((uint64_t)256 << 10));
    return chunks + win + bt_batch_slot_bytes(spec->B, spec->T) + sources;
}
