/* loaderd reference log-probs kept in the token cache. Contract and file format: loaderd/refstore.h. */
#include "loaderd/refstore.h"

#include <errno.h>
#include <dirent.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/atomic_io.h"
#include "common/bt_common.h"
#include "common/bt_le.h"
#include "common/bt_vec.h"
#include "loaderd/tcache_priv.h"
#include "proto/batch.h"

#define REF_MAGIC "BTREFLP1"
#define REF_VERSION 1u
#define REF_HEADER_BYTES 128
#define REF_RECORD_BYTES 24
#define REF_REL_TOL 1e-6

#define ADD(st, f, n) atomic_fetch_add_explicit(&(st)->f, (uint64_t)(n), memory_order_relaxed)

struct ld_reftab {
    struct ld_reftab *next; /* registry list (under reg_mu) */
    int refs;               /* under reg_mu */
    ld_tcache *c;           /* the cache (it outlives its jobs' tables) */
    ld_tcache_stats *st;    /* its counters */
    char *path;             /* the sidecar */
    uint8_t key[32], entry_key[32];
    char base[LD_REF_BASE_MAX + 1];
    uint32_t uid, T, mpl, ml;
    pthread_mutex_t mu; /* guards the values below */
    size_t n;           /* records */
    uint64_t *line;     /* [n] increasing */
    uint8_t *nside;     /* [n] 2 pair, 1 kto */
    double *val;        /* [2n] */
    uint8_t *have;      /* [2n] */
    uint64_t n_have, n_slots;
    uint64_t part_have; /* n_have when this process last wrote its part file */
    int written;
};

static pthread_mutex_t reg_mu = PTHREAD_MUTEX_INITIALIZER;
static ld_reftab *reg_head;

static void sha_cb(void *ctx, const void *p, size_t n) { tc_sha_update(ctx, p, n); }

static int ref_key(const uint8_t entry_key[32], const ld_format_cfg *f, const ld_refparams *rp, uint8_t out[32]) {
    tc_sha s;
    int rc = tc_sha_init(&s);
    if (rc != BT_OK) return rc;
    static const char tag[] = "barqtrain-refkey-v1";
    uint32_t v[5] = {rp->uid, f->T, f->max_prompt_length, f->max_length, (uint32_t)strlen(rp->base)};
    sha_cb(&s, tag, sizeof tag);
    sha_cb(&s, entry_key, 32);
    sha_cb(&s, v, sizeof v);
    sha_cb(&s, rp->base, strlen(rp->base));
    tc_sha_final(&s, out);
    return BT_OK;
}

static void tab_free(ld_reftab *t) {
    if (!t) return;
    pthread_mutex_destroy(&t->mu);
    free(t->path);
    free(t->line);
    free(t->nside);
    free(t->val);
    free(t->have);
    free(t);
}

void ld_reftab_put(ld_reftab *t) {
    if (!t) return;
    pthread_mutex_lock(&reg_mu);
    int last = --t->refs == 0;
    if (last)
        for (ld_reftab **pp = &reg_head; *pp; pp = &(*pp)->next)
            if (*pp == t) {
                *pp = t->next;
                break;
            }
    pthread_mutex_unlock(&reg_mu);
    if (last) {
        ld_reftab_sync(t); /* what this loaderd's trainers put, for the other nodes and later jobs */
        tab_free(t);
    }
}

int ld_ref_side(int32_t seg_kind) { return seg_kind == BT_SEG_REJECTED ? 1 : 0; }

/* index of line in t->line, or -1 */
static ptrdiff_t find_line(const ld_reftab *t, uint64_t line) {
    size_t lo = 0, hi = t->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (t->line[mid] < line) lo = mid + 1;
        else hi = mid;
    }
    return lo < t->n && t->line[lo] == line ? (ptrdiff_t)lo : -1;
}

/* ------------------------------------------------------------------ the records of an entry */

/* The entry's records the job packs: ld_format_pref_fit with the job's parameters, exactly as the
 * stream does (loaderd/stream.c rd_cached). BT_OK, LD_TC_BYPASS (entry missing or damaged). */
static int read_index(ld_tcache *c, const uint8_t entry_key[32], const ld_format_cfg *fcfg, ld_reftab *t) {
    char *p = tc_path(c, entry_key, ".btc", 0);
    ld_tc_reader *r = NULL;
    tc_inuse_add(c, entry_key);
    int orc = tc_reader_open(c, p, entry_key, bt_tokenizer_vocab_size(fcfg->tok), &r);
    free(p);
    if (orc != TC_OPEN_OK) {
        tc_inuse_del(c, entry_key);
        return LD_TC_BYPASS;
    }
    size_t cap = 0, cap2 = 0;
    bt_ids ids = {0}, mask = {0};
    int rc;
    for (;;) {
        ld_tc_record rec;
        ids.n = mask.n = 0;
        rc = ld_tc_next(r, &rec, &ids, &mask);
        if (rc != 1) break;
        if (rec.kind != 3 || rec.line_no > INT32_MAX) continue;
        ld_pref_rec pr = {rec.n_docs, {rec.len[0], rec.len[1]}, rec.prompt_len, rec.label, 0};
        int reason = -1;
        int frc = ld_format_pref_fit(fcfg, &ids, &mask, 0, &pr, &reason);
        if (frc < 0) {
            rc = frc;
            break;
        }
        if (frc == 1) continue;
        t->line = bt_vec_xgrow(t->line, &cap, t->n + 1, sizeof *t->line);
        t->nside = bt_vec_xgrow(t->nside, &cap2, t->n + 1, sizeof *t->nside);
        t->line[t->n] = rec.line_no;
        t->nside[t->n] = (uint8_t)pr.n_docs;
        t->n_slots += (uint64_t)pr.n_docs;
        t->n++;
    }
    bt_ids_free(&ids);
    bt_ids_free(&mask);
    ld_tc_close(r); /* drops the in-use mark */
    if (rc == LD_TC_DAMAGED) return LD_TC_BYPASS;
    if (rc < 0) return rc;
    t->val = bt_xcalloc(2 * (t->n ? t->n : 1), sizeof *t->val);
    t->have = bt_xcalloc(2 * (t->n ? t->n : 1), 1);
    return BT_OK;
}

/* ------------------------------------------------------------------ the sidecar */

static size_t base_pad(size_t n) { return (n + 7) & ~(size_t)7; }

static size_t file_bytes(const ld_reftab *t) {
    return REF_HEADER_BYTES + base_pad(strlen(t->base)) + t->n * REF_RECORD_BYTES + 32;
}

static void put_f64(uint8_t *p, double v) {
    uint64_t u;
    memcpy(&u, &v, 8);
    bt_put64(p, u);
}
static double get_f64(const uint8_t *p) {
    uint64_t u = bt_get64(p);
    double v;
    memcpy(&v, &u, 8);
    return v;
}

#define UNKNOWN_VALUE 1.0 /* a part file's slot with no value (never a valid log-probability) */

/* The file image of t's values (under t->mu), malloc'd, file_bytes(t) long; partial: a part file
 * (flags 1, unknown slots UNKNOWN_VALUE), else every value must be known. */
static uint8_t *image(const ld_reftab *t, int partial) {
    size_t len = file_bytes(t), bl = strlen(t->base);
    uint8_t *b = bt_xcalloc(1, len);
    memcpy(b, REF_MAGIC, 8);
    bt_put32(b + 8, REF_VERSION);
    bt_put32(b + 12, t->uid);
    memcpy(b + 16, t->key, 32);
    memcpy(b + 48, t->entry_key, 32);
    bt_put32(b + 80, t->T);
    bt_put32(b + 84, t->mpl);
    bt_put32(b + 88, t->ml);
    bt_put32(b + 92, (uint32_t)bl);
    bt_put64(b + 96, t->n);
    bt_put64(b + 104, t->n_slots);
    bt_put32(b + 112, partial ? 1u : 0u);
    memcpy(b + REF_HEADER_BYTES, t->base, bl);
    uint8_t *r = b + REF_HEADER_BYTES + base_pad(bl);
    for (size_t i = 0; i < t->n; i++, r += REF_RECORD_BYTES) {
        bt_put64(r, t->line[i]);
        for (int k = 0; k < 2; k++) {
            double v = k < t->nside[i] ? (t->have[2 * i + k] ? t->val[2 * i + k] : UNKNOWN_VALUE) : 0.0;
            put_f64(r + 8 + 8 * k, v);
        }
    }
    tc_sha s;
    if (tc_sha_init(&s) != BT_OK) {
        free(b);
        return NULL;
    }
    tc_sha_update(&s, b, len - 32);
    tc_sha_final(&s, b + len - 32);
    return b;
}

/* Write t's values to path atomically (under t->mu). BT_OK or BT_ERR_* (logged). */
static int write_values(ld_reftab *t, const char *path, int partial) {
    uint8_t *b = image(t, partial);
    if (!b) return BT_ERR_NOMEM;
    bt_atomic_file af;
    int rc = bt_atomic_open(&af, path, "reference log-probs");
    if (rc == BT_OK) rc = bt_atomic_write(&af, b, file_bytes(t));
    if (rc == BT_OK) bt_test_pause_point(path); /* tests probe the event loop meanwhile (bt_common.h) */
    if (rc == BT_OK) rc = bt_atomic_commit(&af);
    else bt_atomic_abort(&af);
    free(b);
    if (rc == BT_OK) ld_tcache_grew(t->c, t->entry_key, file_bytes(t)); /* counted against max_bytes */
    if (rc != BT_OK)
        bt_log(BT_LOG_WARN, "loaderd", "%s (the values stay in memory for this loaderd's jobs)", bt_last_error());
    return rc;
}

/* This process's part-file suffix: ".part-" + 16 hex digits of SHA-256(host name, pid). */
static char g_part_suffix[32];
static pthread_once_t g_part_once = PTHREAD_ONCE_INIT;
static void part_init(void) {
    char host[256] = "";
    gethostname(host, sizeof host - 1);
    long pid = (long)getpid();
    uint8_t h[32];
    tc_sha s;
    if (tc_sha_init(&s) != BT_OK) {
        snprintf(g_part_suffix, sizeof g_part_suffix, ".part-%016lx", (unsigned long)pid);
        return;
    }
    tc_sha_update(&s, host, strlen(host) + 1);
    tc_sha_update(&s, &pid, sizeof pid);
    tc_sha_final(&s, h);
    snprintf(g_part_suffix, sizeof g_part_suffix, ".part-%02x%02x%02x%02x%02x%02x%02x%02x", h[0], h[1], h[2], h[3], h[4],
             h[5], h[6], h[7]);
}
static const char *part_suffix(void) {
    pthread_once(&g_part_once, part_init);
    return g_part_suffix;
}

/* Refuse the file at path: log why, count, remove it (loaderd wrote it: a file it can no longer
 * use). */
static void refuse(ld_reftab *t, const char *path, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void refuse(ld_reftab *t, const char *path, const char *fmt, ...) {
    char why[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    ADD(t->st, ref_refused, 1);
    bt_log(BT_LOG_WARN, "loaderd", "reference log-probs: %s refused: %s; not used (removed), the values are computed "
           "again", path, why);
    unlink(path);
}

static int valid_value(double v) { return isfinite(v) && v <= 0 && v >= LD_REF_MIN_VALUE; }

/* Read the values file at path for t: 1 with val / have [2n] filled (partial: a part file, slots
 * it lacks have 0), 0 when there is none, -1 when it was refused (logged, counted, removed). */
static int read_values(ld_reftab *t, const char *path, int partial, double *val, uint8_t *have) {
    struct stat st;
    int fd = bt_open_file(path, BT_OPEN_NO_LINKS, &st);
    if (fd < 0) return 0; /* none (or not a regular file: never read) */
    size_t want = file_bytes(t);
    if ((uint64_t)st.st_size != (uint64_t)want) {
        uint8_t h[REF_HEADER_BYTES];
        ssize_t got = pread(fd, h, sizeof h, 0);
        close(fd);
        if (got == (ssize_t)sizeof h && !memcmp(h, REF_MAGIC, 8) && bt_get64(h + 96) != t->n)
            refuse(t, path, "it holds %llu records, this job packs %zu of the shard (same key, other records: damaged)",
                   (unsigned long long)bt_get64(h + 96), t->n);
        else
            refuse(t, path, "%lld bytes, %zu expected", (long long)st.st_size, want);
        return -1;
    }
    uint8_t *b = bt_xmalloc(want);
    size_t off = 0;
    while (off < want) {
        ssize_t r = pread(fd, b + off, want - off, (off_t)off);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        off += (size_t)r;
    }
    close(fd);
    int ok = -1;
    uint8_t h[32];
    tc_sha s;
    size_t bl = strlen(t->base);
    uint32_t fbl = off == want ? bt_get32(b + 92) : 0;
    int hashed = off == want && tc_sha_init(&s) == BT_OK;
    if (hashed) {
        tc_sha_update(&s, b, want - 32);
        tc_sha_final(&s, h);
    }
    if (off != want) refuse(t, path, "short read");
    else if (!hashed) ok = 0; /* out of memory: not used, kept */
    else if (memcmp(b, REF_MAGIC, 8) != 0 || bt_get32(b + 8) != REF_VERSION)
        refuse(t, path, "not a version-%u values file", REF_VERSION);
    else if (memcmp(h, b + want - 32, 32) != 0) refuse(t, path, "checksum mismatch (damaged)");
    else if (bt_get32(b + 112) != (partial ? 1u : 0u)) refuse(t, path, "%s", partial ? "not a part file" : "a part file");
    else if (fbl != bl || memcmp(b + REF_HEADER_BYTES, t->base, bl) != 0)
        refuse(t, path, "its values are for base \"%.*s\" but this job's ref_base is \"%s\"",
               (int)(fbl <= LD_REF_BASE_MAX && REF_HEADER_BYTES + (size_t)fbl <= want ? fbl : 0),
               (const char *)b + REF_HEADER_BYTES, t->base);
    else if (bt_get32(b + 80) != t->T || bt_get32(b + 84) != t->mpl || bt_get32(b + 88) != t->ml)
        refuse(t, path, "its values are for seq_len %u, max_prompt_length %u, max_length %u but this job has %u, %u, %u",
               bt_get32(b + 80), bt_get32(b + 84), bt_get32(b + 88), t->T, t->mpl, t->ml);
    else if (bt_get32(b + 12) != t->uid)
        refuse(t, path, "its values were put by uid %u, this job's trainer is uid %u", bt_get32(b + 12), t->uid);
    else if (memcmp(b + 48, t->entry_key, 32) != 0) refuse(t, path, "it belongs to another shard content or tokenizer");
    else if (memcmp(b + 16, t->key, 32) != 0) refuse(t, path, "another reference key");
    else if (bt_get64(b + 104) != t->n_slots) refuse(t, path, "value count differs");
    else {
        const uint8_t *r = b + REF_HEADER_BYTES + base_pad(bl);
        size_t i;
        for (i = 0; i < t->n; i++, r += REF_RECORD_BYTES) {
            if (bt_get64(r) != t->line[i]) break;
            int bad = 0;
            for (int k = 0; k < 2; k++) {
                double v = get_f64(r + 8 + 8 * k);
                if (k >= t->nside[i]) bad |= v != 0.0;
                else if (valid_value(v)) val[2 * i + k] = v, have[2 * i + k] = 1;
                else bad |= !(partial && v == UNKNOWN_VALUE);
            }
            if (bad) break;
        }
        if (i < t->n)
            refuse(t, path, "record %zu (line %llu) does not match the shard's or holds an invalid value", i,
                   (unsigned long long)t->line[i]);
        else
            ok = 1;
    }
    free(b);
    return ok;
}

/* Every value known: write the sidecar (under t->mu) and remove the part files merged into it. */
static void complete(ld_reftab *t) {
    if (write_values(t, t->path, 0) != BT_OK) return;
    t->written = 1;
    ADD(t->st, ref_written, 1);
    bt_log(BT_LOG_INFO, "loaderd", "reference log-probs: wrote %s (%zu records, %llu values, base %s)", t->path, t->n,
           (unsigned long long)t->n_slots, t->base);
}

/* Merge the part files other loaderds (nodes) wrote for t into it (under t->mu); with own, first
 * write this process's values as its own part file (when it has values the last one lacked).
 * When every value is then known, the sidecar is written and the part files are removed. */
static void sync_parts(ld_reftab *t, int own) {
    if (t->written) return;
    size_t plen = strlen(t->path);
    char *own_path = bt_xmalloc(plen + 40);
    snprintf(own_path, plen + 40, "%s%s", t->path, part_suffix());
    if (own && t->n_have > t->part_have && write_values(t, own_path, 1) == BT_OK) t->part_have = t->n_have;
    char *dir = bt_xstrdup(t->path);
    char *slash = strrchr(dir, '/');
    const char *base = slash ? slash + 1 : dir;
    if (slash) *slash = 0;
    size_t blen = strlen(base);
    DIR *dd = opendir(dir);
    struct dirent *e;
    double *val = bt_xcalloc(2 * (t->n ? t->n : 1), sizeof *val);
    uint8_t *have = bt_xcalloc(2 * (t->n ? t->n : 1), 1);
    char **merged = NULL;
    size_t n_merged = 0, cap = 0;
    while (dd && (e = readdir(dd))) {
        if (strncmp(e->d_name, base, blen) != 0 || strncmp(e->d_name + blen, ".part-", 6) != 0 ||
            strchr(e->d_name + blen + 6, '.'))
            continue; /* not a part file of t (its writers' temporaries have ".tmp." in their names) */
        size_t pn = strlen(dir) + strlen(e->d_name) + 2;
        char *pp = bt_xmalloc(pn);
        snprintf(pp, pn, "%s/%s", dir, e->d_name);
        int mine = strcmp(pp, own_path) == 0; /* ours: read too (an earlier table of this process wrote it) */
        memset(have, 0, 2 * (t->n ? t->n : 1));
        if (!(mine && own) && read_values(t, pp, 1, val, have) == 1) {
            uint64_t added = 0, conflicts = 0;
            for (size_t k = 0; k < 2 * t->n; k++) {
                if (!have[k]) continue;
                if (!t->have[k]) t->val[k] = val[k], t->have[k] = 1, t->n_have++, added++;
                else if (fabs(t->val[k] - val[k]) > REF_REL_TOL * fmax(1.0, fabs(t->val[k]))) conflicts++;
            }
            ADD(t->st, ref_loaded, 1);
            if (conflicts)
                bt_log(BT_LOG_WARN, "loaderd", "reference log-probs: %s: %llu values differ from those already "
                       "known (the first kept)", pp, (unsigned long long)conflicts);
            bt_log(BT_LOG_INFO, "loaderd", "reference log-probs: merged %s (%llu new values, %llu of %llu known)", pp,
                   (unsigned long long)added, (unsigned long long)t->n_have, (unsigned long long)t->n_slots);
        }
        if (mine || access(pp, F_OK) == 0) {
            merged = bt_vec_xgrow(merged, &cap, n_merged + 1, sizeof *merged);
            merged[n_merged++] = pp;
        } else {
            free(pp);
        }
    }
    if (dd) closedir(dd);
    if (t->n_have == t->n_slots) {
        complete(t);
        if (t->written)
            for (size_t i = 0; i < n_merged; i++) unlink(merged[i]);
    }
    for (size_t i = 0; i < n_merged; i++) free(merged[i]);
    free(merged);
    free(val);
    free(have);
    free(dir);
    free(own_path);
}

/* Fill t from its sidecar, or from the part files of other loaderds, when there are valid ones. */
static void load_values(ld_reftab *t) {
    if (read_values(t, t->path, 0, t->val, t->have) == 1) {
        t->n_have = t->n_slots;
        t->written = 1;
        ADD(t->st, ref_loaded, 1);
        return;
    }
    memset(t->val, 0, 2 * (t->n ? t->n : 1) * sizeof *t->val);
    memset(t->have, 0, 2 * (t->n ? t->n : 1));
    sync_parts(t, 0);
}

void ld_reftab_sync(ld_reftab *t) {
    if (!t) return;
    pthread_mutex_lock(&t->mu);
    sync_parts(t, 1);
    pthread_mutex_unlock(&t->mu);
}

/* ------------------------------------------------------------------ tables */

int ld_reftab_get(ld_tcache *c, const uint8_t entry_key[32], const ld_format_cfg *fcfg, const ld_refparams *rp,
                  ld_reftab **out) {
    *out = NULL;
    uint8_t key[32];
    int rc = ref_key(entry_key, fcfg, rp, key);
    if (rc != BT_OK) return rc;
    char hx[40];
    static const char d[] = "0123456789abcdef";
    hx[0] = '-';
    for (int i = 0; i < 16; i++) hx[1 + 2 * i] = d[key[i] >> 4], hx[2 + 2 * i] = d[key[i] & 15];
    memcpy(hx + 33, ".ref", 5);
    char *path = tc_path(c, entry_key, hx, 0);
    pthread_mutex_lock(&reg_mu);
    for (ld_reftab *t = reg_head; t; t = t->next)
        if (!memcmp(t->key, key, 32) && !strcmp(t->path, path)) {
            t->refs++;
            pthread_mutex_unlock(&reg_mu);
            free(path);
            *out = t;
            return BT_OK;
        }
    pthread_mutex_unlock(&reg_mu);
    ld_reftab *t = bt_xcalloc(1, sizeof *t);
    pthread_mutex_init(&t->mu, NULL);
    t->refs = 1;
    t->c = c;
    t->st = ld_tcache_stats_of(c);
    t->path = path;
    memcpy(t->key, key, 32);
    memcpy(t->entry_key, entry_key, 32);
    snprintf(t->base, sizeof t->base, "%s", rp->base);
    t->uid = rp->uid;
    t->T = fcfg->T;
    t->mpl = fcfg->max_prompt_length;
    t->ml = fcfg->max_length;
    rc = read_index(c, entry_key, fcfg, t);
    if (rc != BT_OK) {
        tab_free(t);
        return rc;
    }
    load_values(t);
    ADD(t->st, ref_tables, 1);
    pthread_mutex_lock(&reg_mu); /* another thread may have made the same table meanwhile: use it */
    for (ld_reftab *o = reg_head; o; o = o->next)
        if (!memcmp(o->key, key, 32) && !strcmp(o->path, t->path)) {
            o->refs++;
            pthread_mutex_unlock(&reg_mu);
            tab_free(t);
            *out = o;
            return BT_OK;
        }
    t->next = reg_head;
    reg_head = t;
    pthread_mutex_unlock(&reg_mu);
    *out = t;
    return BT_OK;
}

int ld_reftab_lookup(ld_reftab *t, uint64_t line, int side, double *v) {
    int found = 0;
    pthread_mutex_lock(&t->mu);
    ptrdiff_t i = find_line(t, line);
    if (i >= 0 && side >= 0 && side < t->nside[i] && t->have[2 * i + side]) {
        *v = t->val[2 * i + side];
        found = 1;
    }
    pthread_mutex_unlock(&t->mu);
    if (found) ADD(t->st, ref_served, 1);
    else ADD(t->st, ref_missed, 1);
    return found;
}

int ld_reftab_set(ld_reftab *t, uint64_t line, int side, double v, char *why, size_t cap, ld_reftab **done) {
    if (done) *done = NULL;
    if (!isfinite(v) || v > 0.0 || v < LD_REF_MIN_VALUE) {
        snprintf(why, cap, "value %g: a summed log-probability must be finite and in [%g, 0]", v, LD_REF_MIN_VALUE);
        ADD(t->st, ref_rejected, 1);
        return BT_ERR_INVALID;
    }
    int rc = BT_OK, full = 0;
    pthread_mutex_lock(&t->mu);
    ptrdiff_t i = find_line(t, line);
    if (i < 0) {
        snprintf(why, cap, "line %llu is not a record this job packs from that shard", (unsigned long long)line);
        rc = BT_ERR_INVALID;
    } else if (side < 0 || side >= t->nside[i]) {
        snprintf(why, cap, "line %llu has no side %d (%s)", (unsigned long long)line, side,
                 t->nside[i] == 2 ? "a pair: 0 chosen, 1 rejected" : "a kto record: side 0 only");
        rc = BT_ERR_INVALID;
    } else if (t->have[2 * i + side]) {
        double o = t->val[2 * i + side];
        if (fabs(o - v) > REF_REL_TOL * fmax(1.0, fabs(o))) {
            snprintf(why, cap, "line %llu side %d already has %.17g (conflict: first value kept)",
                     (unsigned long long)line, side, o);
            rc = BT_ERR_INVALID;
        }
    } else {
        t->val[2 * i + side] = v;
        t->have[2 * i + side] = 1;
        t->n_have++;
        full = t->n_have == t->n_slots && !t->written;
        if (full && !done) sync_parts(t, 0); /* writes it, removes merged parts */
    }
    pthread_mutex_unlock(&t->mu);
    if (full && done) { /* the caller's thread writes it (ld_reftab_complete); the table stays alive until then */
        pthread_mutex_lock(&reg_mu);
        t->refs++;
        pthread_mutex_unlock(&reg_mu);
        *done = t;
    }
    if (rc == BT_OK) ADD(t->st, ref_accepted, 1);
    else ADD(t->st, ref_rejected, 1);
    return rc;
}

void ld_reftab_fill(ld_reftab *t, uint64_t *have, uint64_t *total) {
    pthread_mutex_lock(&t->mu);
    *have = t->n_have;
    *total = t->n_slots;
    pthread_mutex_unlock(&t->mu);
}

void ld_reftab_complete(ld_reftab *t) {
    if (!t) return;
    pthread_mutex_lock(&t->mu);
    if (t->n_have == t->n_slots && !t->written) sync_parts(t, 0); /* writes it, removes merged parts */
    pthread_mutex_unlock(&t->mu);
    ld_reftab_put(t);
}
