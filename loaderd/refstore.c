/* loaderd reference log-probs kept in the token cache. Contract and file format: loaderd/refstore.h. */
#include "loaderd/refstore.h"

#include <errno.h>
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
    ld_tcache_stats *st;    /* the cache's counters (the cache outlives its jobs' tables) */
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
    if (last) tab_free(t);
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

/* The whole file image of t's values (under t->mu), malloc'd, file_bytes(t) long. */
static uint8_t *image(const ld_reftab *t) {
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
    memcpy(b + REF_HEADER_BYTES, t->base, bl);
    uint8_t *r = b + REF_HEADER_BYTES + base_pad(bl);
    for (size_t i = 0; i < t->n; i++, r += REF_RECORD_BYTES) {
        bt_put64(r, t->line[i]);
        put_f64(r + 8, t->val[2 * i]);
        put_f64(r + 16, t->nside[i] == 2 ? t->val[2 * i + 1] : 0.0);
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

/* Write the sidecar (under t->mu, every value known). */
static void write_sidecar(ld_reftab *t) {
    uint8_t *b = image(t);
    if (!b) return;
    bt_atomic_file af;
    int rc = bt_atomic_open(&af, t->path, "reference log-probs");
    if (rc == BT_OK) rc = bt_atomic_write(&af, b, file_bytes(t));
    if (rc == BT_OK) rc = bt_atomic_commit(&af);
    else bt_atomic_abort(&af);
    free(b);
    if (rc != BT_OK) {
        bt_log(BT_LOG_WARN, "loaderd", "%s (the values stay in memory for this loaderd's jobs)", bt_last_error());
        return;
    }
    t->written = 1;
    ADD(t->st, ref_written, 1);
    bt_log(BT_LOG_INFO, "loaderd", "reference log-probs: wrote %s (%zu records, %llu values, base %s)", t->path, t->n,
           (unsigned long long)t->n_slots, t->base);
}

/* Refuse the sidecar at t->path: log why, count, remove it (loaderd wrote it: a file it can no
 * longer use). */
static void refuse(ld_reftab *t, const char *fmt, ...) {
    char why[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    ADD(t->st, ref_refused, 1);
    bt_log(BT_LOG_WARN, "loaderd", "reference log-probs: %s refused: %s; not used (removed), the values are computed "
           "again", t->path, why);
    unlink(t->path);
}

/* Fill t from its sidecar when there is a valid one. */
static void load_sidecar(ld_reftab *t) {
    struct stat st;
    int fd = bt_open_file(t->path, BT_OPEN_NO_LINKS, &st);
    if (fd < 0) return; /* none (or not a regular file: never read) */
    size_t want = file_bytes(t);
    if ((uint64_t)st.st_size != (uint64_t)want) {
        close(fd);
        /* the size follows from the records and the base: a file of another size is another table's */
        uint8_t h[REF_HEADER_BYTES];
        int fd2 = bt_open_file(t->path, BT_OPEN_NO_LINKS, &st);
        ssize_t got = fd2 >= 0 ? pread(fd2, h, sizeof h, 0) : -1;
        if (fd2 >= 0) close(fd2);
        if (got == (ssize_t)sizeof h && !memcmp(h, REF_MAGIC, 8) && bt_get64(h + 96) != t->n)
            refuse(t, "it holds %llu records, this job packs %zu of the shard (same key, other records: damaged)",
                   (unsigned long long)bt_get64(h + 96), t->n);
        else
            refuse(t, "%lld bytes, %zu expected", (long long)st.st_size, want);
        return;
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
    if (off != want) {
        free(b);
        refuse(t, "short read");
        return;
    }
    uint8_t h[32];
    tc_sha s;
    if (tc_sha_init(&s) != BT_OK) {
        free(b);
        return;
    }
    tc_sha_update(&s, b, want - 32);
    tc_sha_final(&s, h);
    size_t bl = strlen(t->base);
    uint32_t fbl = bt_get32(b + 92);
    if (memcmp(b, REF_MAGIC, 8) != 0 || bt_get32(b + 8) != REF_VERSION) refuse(t, "not a version-%u sidecar", REF_VERSION);
    else if (memcmp(h, b + want - 32, 32) != 0) refuse(t, "checksum mismatch (damaged)");
    else if (fbl != bl || memcmp(b + REF_HEADER_BYTES, t->base, bl) != 0)
        refuse(t, "its values are for base \"%.*s\" but this job's ref_base is \"%s\"",
               (int)(fbl <= LD_REF_BASE_MAX && REF_HEADER_BYTES + (size_t)fbl <= want ? fbl : 0), (const char *)b + REF_HEADER_BYTES,
               t->base);
    else if (bt_get32(b + 80) != t->T || bt_get32(b + 84) != t->mpl || bt_get32(b + 88) != t->ml)
        refuse(t, "its values are for seq_len %u, max_prompt_length %u, max_length %u but this job has %u, %u, %u",
               bt_get32(b + 80), bt_get32(b + 84), bt_get32(b + 88), t->T, t->mpl, t->ml);
    else if (bt_get32(b + 12) != t->uid)
        refuse(t, "its values were put by uid %u, this job's trainer is uid %u", bt_get32(b + 12), t->uid);
    else if (memcmp(b + 48, t->entry_key, 32) != 0) refuse(t, "it belongs to another shard content or tokenizer");
    else if (memcmp(b + 16, t->key, 32) != 0) refuse(t, "another reference key");
    else if (bt_get64(b + 104) != t->n_slots) refuse(t, "value count differs");
    else {
        const uint8_t *r = b + REF_HEADER_BYTES + base_pad(bl);
        size_t i;
        for (i = 0; i < t->n; i++, r += REF_RECORD_BYTES) {
            double v0 = get_f64(r + 8), v1 = get_f64(r + 16);
            if (bt_get64(r) != t->line[i] || !(isfinite(v0) && v0 <= 0 && v0 >= LD_REF_MIN_VALUE) ||
                (t->nside[i] == 2 ? !(isfinite(v1) && v1 <= 0 && v1 >= LD_REF_MIN_VALUE) : v1 != 0.0))
                break;
            t->val[2 * i] = v0;
            t->val[2 * i + 1] = t->nside[i] == 2 ? v1 : 0.0;
        }
        if (i < t->n) {
            memset(t->val, 0, 2 * t->n * sizeof *t->val);
            refuse(t, "record %zu (line %llu) does not match the shard's or holds an invalid value", i,
                   (unsigned long long)t->line[i]);
        } else {
            for (i = 0; i < t->n; i++) t->have[2 * i] = 1, t->have[2 * i + 1] = t->nside[i] == 2;
            t->n_have = t->n_slots;
            t->written = 1;
            ADD(t->st, ref_loaded, 1);
        }
    }
    free(b);
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
    load_sidecar(t);
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

int ld_reftab_set(ld_reftab *t, uint64_t line, int side, double v, char *why, size_t cap) {
    if (!isfinite(v) || v > 0.0 || v < LD_REF_MIN_VALUE) {
        snprintf(why, cap, "value %g: a summed log-probability must be finite and in [%g, 0]", v, LD_REF_MIN_VALUE);
        ADD(t->st, ref_rejected, 1);
        return BT_ERR_INVALID;
    }
    int rc = BT_OK;
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
        if (t->n_have == t->n_slots && !t->written) write_sidecar(t);
    }
    pthread_mutex_unlock(&t->mu);
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
