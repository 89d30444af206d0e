/* loaderd token cache entries: reader (every block checked before use, everything bounded)
 * and writer. Format: loaderd/tcache.h. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zstd.h>

#include "common/bt_common.h"
#include "common/bt_le.h"
#include "common/bt_vec.h"
#include "loaderd/job.h"
#include "loaderd/tcache_priv.h"

#define ADD(field, n) atomic_fetch_add_explicit(&st->field, (uint64_t)(n), memory_order_relaxed)

/* ------------------------------------------------------------------ SHA-256 */

int tc_sha_init(tc_sha *s) {
    s->md = EVP_MD_CTX_new();
    if (!s->md || EVP_DigestInit_ex(s->md, EVP_sha256(), NULL) != 1) {
        EVP_MD_CTX_free(s->md);
        s->md = NULL;
        return bt_fail(BT_ERR_NOMEM, "token cache: cannot initialise SHA-256");
    }
    return BT_OK;
}
void tc_sha_update(tc_sha *s, const void *p, size_t n) {
    if (n) EVP_DigestUpdate(s->md, p, n);
}
void tc_sha_cb(void *ctx, const void *p, size_t n) { tc_sha_update(ctx, p, n); }
void tc_sha_final(tc_sha *s, uint8_t out[32]) {
    unsigned len = 32;
    EVP_DigestFinal_ex(s->md, out, &len);
    tc_sha_free(s);
}
void tc_sha_free(tc_sha *s) {
    EVP_MD_CTX_free(s->md);
    s->md = NULL;
}

static void sha_of(const void *a, size_t na, const void *b, size_t nb, uint8_t out[32]) {
    tc_sha s;
    if (tc_sha_init(&s) != BT_OK) {
        memset(out, 0, 32);
        return;
    }
    tc_sha_update(&s, a, na);
    tc_sha_update(&s, b, nb);
    tc_sha_final(&s, out);
}

/* ------------------------------------------------------------------ LEB128 (fixed fields: common/bt_le.h) */

/* LEB128 at p[*o], bounded by n; 0 when it runs past n or over 64 bits. */
static int uleb(const uint8_t *p, size_t n, size_t *o, uint64_t *v) {
    uint64_t x = 0;
    for (int sh = 0; sh < 64 && *o < n; sh += 7) {
        uint8_t b = p[(*o)++];
        if (sh == 63 && b > 1) return 0;
        x |= (uint64_t)(b & 0x7F) << sh;
        if (!(b & 0x80)) {
            *v = x;
            return 1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ reader */

struct ld_tc_reader {
    ld_tcache *c;
    uint8_t key[32];
    char *path;
    int fd;
    dev_t dev;
    ino_t ino;
    uint64_t size, off;
    int32_t vocab;
    uint64_t n_records, n_lines, n_blank, n_blocks;
    uint8_t trailer[TC_TRAILER_BYTES];
    tc_sha chain;
    uint64_t blocks, records, line_no;
    uint8_t *raw, *stored;
    size_t raw_len, raw_pos, raw_cap, stored_cap;
    uint32_t block_left;
    int damaged, done;
};

static void reader_free(ld_tc_reader *r) {
    if (r->fd >= 0) close(r->fd);
    tc_sha_free(&r->chain);
    free(r->path);
    free(r->raw);
    free(r->stored);
    free(r);
}

/* Remove what sits at path if it is still the file we opened (or any non-directory when we
 * could not open it: ino 0). */
static void remove_entry(const char *path, dev_t dev, ino_t ino) {
    struct stat st;
    if (lstat(path, &st) != 0) return;
    if (ino && (st.st_dev != dev || st.st_ino != ino)) return; /* already replaced */
    if (S_ISDIR(st.st_mode)) {
        if (rmdir(path) != 0)
            bt_log(BT_LOG_WARN, "loaderd", "token cache: %s is a directory and cannot be removed (%s): remove it",
                   path, strerror(errno));
        return;
    }
    unlink(path);
}

static int pread_all(int fd, void *buf, size_t n, uint64_t off) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = pread(fd, (char *)buf + got, n - got, (off_t)(off + got));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        got += (size_t)r;
    }
    return 0;
}

static int open_bad(ld_tcache *c, const char *path, dev_t dev, ino_t ino, int stale, const char *why) {
    ld_tcache_stats *st = ld_tcache_stats_of(c);
    if (stale) ADD(stale, 1);
    else ADD(damaged, 1);
    bt_log(BT_LOG_WARN, "loaderd", "token cache: %s: %s: removed, will be rebuilt", path, why);
    remove_entry(path, dev, ino);
    return TC_OPEN_BAD;
}

int tc_reader_open(ld_tcache *c, const char *path, const uint8_t key[32], int32_t vocab, ld_tc_reader **out) {
    *out = NULL;
    struct stat st;
    /* the one safe open, links refused: a regular file or nothing, never blocking */
    int fd = bt_open_file(path, BT_OPEN_NO_LINKS, &st);
    if (fd < 0) {
        if (errno == ENOENT) return TC_OPEN_MISSING;
        char why[256]; /* a symlink, a FIFO, a directory, no permission, ...: without the path */
        const char *e = bt_last_error();
        snprintf(why, sizeof why, "%s", strncmp(e, path, strlen(path)) == 0 && e[strlen(path)] == ':'
                                            ? e + strlen(path) + 2 : e);
        return open_bad(c, path, 0, 0, 0, why);
    }
    if (st.st_uid != geteuid()) { /* only loaderd's user can write the tree (tcache.c, trust) */
        close(fd);
        return open_bad(c, path, st.st_dev, st.st_ino, 0, "not owned by loaderd's user");
    }
    ld_tc_reader *r = bt_xcalloc(1, sizeof *r);
    r->c = c;
    r->fd = fd;
    r->dev = st.st_dev;
    r->ino = st.st_ino;
    r->size = (uint64_t)st.st_size;
    r->vocab = vocab;
    memcpy(r->key, key, 32);
    r->path = bt_xstrdup(path);
    uint8_t h[TC_HEADER_BYTES];
    const char *why = NULL;
    int stale = 0;
    if (r->size < TC_HEADER_BYTES + TC_TRAILER_BYTES) why = "shorter than a header and a trailer";
    else if (pread_all(fd, h, sizeof h, 0) != 0 || pread_all(fd, r->trailer, TC_TRAILER_BYTES, r->size - TC_TRAILER_BYTES) != 0)
        why = "read error";
    else if (memcmp(h, TC_MAGIC, 8) != 0 || bt_get32(h + 8) != TC_VERSION || bt_get32(h + 12) != TC_HEADER_BYTES)
        why = "bad header (magic or version)";
    else if (memcmp(h + 16, key, 32) != 0)
        why = "written for another key (renamed or copied file)", stale = 1;
    else if (bt_get32(r->trailer) != TC_TRAILER_MAGIC || bt_get32(r->trailer + 4) != TC_VERSION)
        why = "bad trailer (truncated or unfinished)";
    if (!why) {
        r->n_records = bt_get64(r->trailer + 8);
        r->n_lines = bt_get64(r->trailer + 16);
        r->n_blank = bt_get64(r->trailer + 24);
        r->n_blocks = bt_get64(r->trailer + 32);
        uint64_t body = r->size - TC_HEADER_BYTES - TC_TRAILER_BYTES;
        if (r->n_blocks > body / TC_BLOCK_HEADER_BYTES || r->n_records < r->n_blocks ||
            r->n_records > r->n_lines || r->n_blank > r->n_lines - r->n_records || (r->n_blocks == 0) != (r->n_records == 0))
            why = "inconsistent trailer counts";
    }
    if (!why && tc_sha_init(&r->chain) != BT_OK) why = "out of memory";
    if (why) {
        dev_t dev = r->dev;
        ino_t ino = r->ino;
        reader_free(r);
        return open_bad(c, path, dev, ino, stale, why);
    }
    tc_sha_update(&r->chain, h, sizeof h);
    r->off = TC_HEADER_BYTES;
    *out = r;
    return TC_OPEN_OK;
}

static int damaged(ld_tc_reader *r, const char *why) {
    if (!r->damaged) {
        r->damaged = 1;
        ld_tcache_stats *st = ld_tcache_stats_of(r->c);
        ADD(damaged, 1);
        bt_log(BT_LOG_WARN, "loaderd", "token cache: %s: damaged (%s) after %llu of %llu records: removed; the rest "
               "of the shard is read raw", r->path, why, (unsigned long long)r->records, (unsigned long long)r->n_records);
        remove_entry(r->path, r->dev, r->ino);
    }
    return LD_TC_DAMAGED;
}

/* Load and check the next block; 0 or LD_TC_DAMAGED. */
static int next_block(ld_tc_reader *r) {
    uint8_t bh[TC_BLOCK_HEADER_BYTES];
    uint64_t end = r->size - TC_TRAILER_BYTES;
    if (r->off + sizeof bh > end || pread_all(r->fd, bh, sizeof bh, r->off) != 0) return damaged(r, "truncated block header");
    uint32_t n = bt_get32(bh + 4), raw = bt_get32(bh + 8), stored = bt_get32(bh + 12);
    if (bt_get32(bh) != TC_BLOCK_MAGIC || n == 0 || raw == 0 || raw > TC_MAX_RAW || stored == 0 || stored > raw ||
        stored > end - r->off - sizeof bh || n > r->n_records - r->records)
        return damaged(r, "bad block header");
    if (stored > r->stored_cap) {
        free(r->stored);
        r->stored = malloc(stored);
        r->stored_cap = r->stored ? stored : 0;
        if (!r->stored) return damaged(r, "out of memory for a block");
    }
    if (pread_all(r->fd, r->stored, stored, r->off + sizeof bh) != 0) return damaged(r, "truncated block");
    uint8_t hash[32];
    sha_of(bh, 16, r->stored, stored, hash);
    if (memcmp(hash, bh + 16, 32) != 0) return damaged(r, "block checksum mismatch");
    tc_sha_update(&r->chain, hash, 32);
    if (raw > r->raw_cap) {
        free(r->raw);
        r->raw = malloc(raw);
        r->raw_cap = r->raw ? raw : 0;
        if (!r->raw) return damaged(r, "out of memory for a block");
    }
    if (stored == raw) {
        memcpy(r->raw, r->stored, raw);
    } else {
        size_t got = ZSTD_decompress(r->raw, raw, r->stored, stored);
        if (ZSTD_isError(got) || got != raw) return damaged(r, "block does not decompress to its size");
    }
    ld_tcache_stats *st = ld_tcache_stats_of(r->c);
    ADD(read_bytes, sizeof bh + stored);
    r->off += sizeof bh + stored;
    r->blocks++;
    r->raw_len = raw;
    r->raw_pos = 0;
    r->block_left = n;
    return 0;
}

/* All blocks read: the trailer must close the file and match the chain. */
static int finish(ld_tc_reader *r) {
    if (r->off != r->size - TC_TRAILER_BYTES || r->records != r->n_records) return damaged(r, "trailer does not match");
    tc_sha_update(&r->chain, r->trailer, 40);
    uint8_t h[32];
    tc_sha_final(&r->chain, h);
    if (memcmp(h, r->trailer + 40, 32) != 0) return damaged(r, "trailer checksum mismatch");
    r->done = 1;
    return 0;
}

#define DOC_NO_MEMORY 3 /* parse_doc: read, but its tokens did not fit (not LD_TC_DAMAGED, 2) */
_Static_assert(DOC_NO_MEMORY != LD_TC_DAMAGED && DOC_NO_MEMORY != 1, "parse_doc's results are distinct");

/* A document record: 1 (appended to ids / mask, or decoded and dropped when they are NULL),
 * DOC_NO_MEMORY when its tokens did not fit in memory (decoded and dropped: the caller reports a
 * bad line), else damaged()'s LD_TC_DAMAGED. */
static int parse_doc(ld_tc_reader *r, bt_ids *ids, bt_ids *mask) {
    const uint8_t *p = r->raw;
    size_t n = r->raw_len, *o = &r->raw_pos;
    uint64_t k, runs, total = 0;
    if (!uleb(p, n, o, &k) || k > n - *o) return damaged(r, "bad document length");
    int oom = 0;
    if (ids) { /* room for the whole document first: its size is the shard's, so fallible */
        int32_t *iv = bt_vec_grow(ids->v, &ids->cap, ids->n + (size_t)k, sizeof *ids->v);
        if (iv) ids->v = iv;
        int32_t *mv = iv && mask ? bt_vec_grow(mask->v, &mask->cap, mask->n + (size_t)k, sizeof *mask->v) : NULL;
        if (mv) mask->v = mv;
        if (!iv || (mask && !mv)) {
            oom = 1;
            ids = mask = NULL;
        }
    }
    size_t i0 = ids ? ids->n : 0;
    for (uint64_t i = 0; i < k; i++) {
        uint64_t id;
        if (!uleb(p, n, o, &id) || id >= (uint64_t)r->vocab) return damaged(r, "token id outside the vocabulary");
        if (ids) ids->v[ids->n++] = (int32_t)id; /* room reserved above */
    }
    if (!uleb(p, n, o, &runs) || runs > k + 1) return damaged(r, "bad mask");
    for (uint64_t i = 0; i < runs; i++) {
        uint64_t len;
        if (!uleb(p, n, o, &len) || len > k - total) return damaged(r, "bad mask run");
        total += len;
        if (mask)
            for (uint64_t j = 0; j < len; j++) mask->v[mask->n++] = (int32_t)(i & 1);
    }
    if (total != k) {
        if (ids) ids->n = i0;
        return damaged(r, "mask length differs from the document's");
    }
    return oom ? DOC_NO_MEMORY : 1;
}

int ld_tc_next(ld_tc_reader *r, ld_tc_record *rec, bt_ids *ids, bt_ids *mask) {
    if (r->damaged) return LD_TC_DAMAGED;
    if (r->done) return 0;
    while (r->block_left == 0) {
        if (r->raw_pos != r->raw_len) return damaged(r, "bytes after the block's records");
        if (r->blocks == r->n_blocks) return finish(r);
        int rc = next_block(r);
        if (rc) return rc;
    }
    const uint8_t *p = r->raw;
    size_t n = r->raw_len, *o = &r->raw_pos;
    uint64_t delta;
    if (*o >= n) return damaged(r, "block ends early");
    int kind = p[(*o)++];
    if (kind > TC_PREF || !uleb(p, n, o, &delta) || delta == 0 || delta > UINT64_MAX - r->line_no ||
        r->line_no + delta > r->n_lines)
        return damaged(r, "bad record header");
    memset(rec, 0, sizeof *rec);
    rec->kind = kind;
    rec->line_no = r->line_no + delta;
    if (kind == TC_DOC || kind == TC_PREF) {
        if (kind == TC_PREF) { /* u8 n_docs, u8 label + 1, prompt_len, len0, then the documents as one */
            uint64_t pl, l0;
            if (n - *o < 2) return damaged(r, "block ends early");
            rec->n_docs = p[(*o)++];
            rec->label = (int)p[(*o)++] - 1;
            if (rec->n_docs < 1 || rec->n_docs > 2 || rec->label > 1 || !uleb(p, n, o, &pl) ||
                !uleb(p, n, o, &l0) || pl >= l0 || l0 > UINT32_MAX)
                return damaged(r, "bad preference record");
            size_t save = *o;
            uint64_t tot;
            if (!uleb(p, n, o, &tot) || l0 > tot || (rec->n_docs == 1) != (l0 == tot) || tot - l0 > UINT32_MAX ||
                (rec->n_docs == 2 && tot - l0 <= pl))
                return damaged(r, "bad preference record lengths");
            *o = save;
            rec->prompt_len = (uint32_t)pl;
            rec->len[0] = (uint32_t)l0;
            rec->len[1] = (uint32_t)(tot - l0);
        }
        size_t i0 = ids ? ids->n : 0, m0 = mask ? mask->n : 0;
        int rc = parse_doc(r, ids, ids ? mask : NULL);
        if (rc == DOC_NO_MEMORY) { /* read, but its tokens did not fit: a bad line for the caller */
            static const char oom_msg[] = "out of memory for the tokens of a cached document: skipped";
            rec->kind = TC_BAD;
            rec->reason = LD_BAD_MEMORY;
            rec->msg = oom_msg;
            rec->msg_len = sizeof oom_msg - 1;
        } else if (rc != 1) {
            if (ids) ids->n = i0;
            if (mask) mask->n = m0;
            return rc;
        }
    } else {
        uint64_t len;
        if (*o >= n) return damaged(r, "block ends early");
        rec->reason = p[(*o)++];
        if (rec->reason >= LD_BAD_N || !uleb(p, n, o, &len) || len > TC_MSG_MAX || len > n - *o)
            return damaged(r, "bad bad-line record");
        rec->msg = (const char *)p + *o;
        rec->msg_len = (size_t)len;
        *o += (size_t)len;
    }
    r->line_no = rec->line_no;
    r->block_left--;
    r->records++;
    return 1;
}

uint64_t ld_tc_records(const ld_tc_reader *r) { return r->records; }
uint64_t ld_tc_lines(const ld_tc_reader *r) { return r->n_lines; }
uint64_t ld_tc_blank(const ld_tc_reader *r) { return r->n_blank; }
const uint8_t *ld_tc_key(const ld_tc_reader *r) { return r->key; }

void ld_tc_close(ld_tc_reader *r) {
    if (!r) return;
    tc_inuse_del(r->c, r->key);
    reader_free(r);
}

/* ------------------------------------------------------------------ writer */

static void raw_need(tc_writer *w, size_t k) {
    if (w->raw_len + k > w->raw_cap)
        w->raw = bt_vec_xgrow(w->raw, &w->raw_cap, w->raw_len + k < TC_BLOCK_BYTES + 4096 ? TC_BLOCK_BYTES + 4096
                                                                                        : w->raw_len + k, 1);
}

static void put_uleb(tc_writer *w, uint64_t v) {
    raw_need(w, 10);
    do {
        uint8_t b = v & 0x7F;
        v >>= 7;
        w->raw[w->raw_len++] = (uint8_t)(b | (v ? 0x80 : 0));
    } while (v);
}

static int wr(tc_writer *w, const void *p, size_t n) {
    if (w->failed) return w->failed;
    int rc = bt_atomic_write(&w->af, p, n);
    if (rc != BT_OK) w->failed = rc;
    w->bytes += n;
    return rc;
}

static int flush_block(tc_writer *w) {
    if (w->n_in_block == 0) return BT_OK;
    if (w->raw_len > TC_MAX_RAW) return w->failed = bt_fail(BT_ERR_RANGE, "token cache: a block exceeds %zu bytes", TC_MAX_RAW);
    size_t bound = ZSTD_compressBound(w->raw_len);
    if (bound > w->z_cap) {
        w->z = bt_xrealloc(w->z, bound);
        w->z_cap = bound;
    }
    size_t zn = ZSTD_compress(w->z, bound, w->raw, w->raw_len, 1);
    const uint8_t *stored = w->raw;
    size_t sn = w->raw_len;
    if (!ZSTD_isError(zn) && zn < w->raw_len) {
        stored = w->z;
        sn = zn;
    }
    uint8_t bh[TC_BLOCK_HEADER_BYTES];
    bt_put32(bh, TC_BLOCK_MAGIC);
    bt_put32(bh + 4, w->n_in_block);
    bt_put32(bh + 8, (uint32_t)w->raw_len);
    bt_put32(bh + 12, (uint32_t)sn);
    sha_of(bh, 16, stored, sn, bh + 16);
    tc_sha_update(&w->chain, bh + 16, 32);
    int rc = wr(w, bh, sizeof bh);
    if (rc == BT_OK) rc = wr(w, stored, sn);
    w->n_blocks++;
    w->n_in_block = 0;
    w->raw_len = 0;
    return rc;
}

int tc_writer_open(tc_writer *w, const char *path, const uint8_t key[32], uint64_t shard_size) {
    memset(w, 0, sizeof *w);
    int rc = tc_sha_init(&w->chain);
    if (rc != BT_OK) return rc;
    rc = bt_atomic_open(&w->af, path, "token cache");
    if (rc != BT_OK) {
        tc_sha_free(&w->chain);
        return rc;
    }
    uint8_t h[TC_HEADER_BYTES] = {0};
    memcpy(h, TC_MAGIC, 8);
    bt_put32(h + 8, TC_VERSION);
    bt_put32(h + 12, TC_HEADER_BYTES);
    memcpy(h + 16, key, 32);
    bt_put64(h + 48, shard_size);
    tc_sha_update(&w->chain, h, sizeof h);
    return wr(w, h, sizeof h);
}

static int record_head(tc_writer *w, int kind, uint64_t line_no) {
    if (w->failed) return w->failed;
    if (line_no <= w->last_line)
        return w->failed = bt_fail(BT_ERR_INVALID, "token cache: line %llu after line %llu", (unsigned long long)line_no,
                                   (unsigned long long)w->last_line);
    raw_need(w, 1);
    w->raw[w->raw_len++] = (uint8_t)kind;
    put_uleb(w, line_no - w->last_line);
    w->last_line = line_no;
    return BT_OK;
}

static int record_done(tc_writer *w) {
    w->n_records++;
    w->n_in_block++;
    if (w->n_in_block >= TC_BLOCK_RECORDS || w->raw_len >= TC_BLOCK_BYTES) return flush_block(w);
    return BT_OK;
}

/* Mask runs, alternating 0-runs and 1-runs from a (possibly empty) 0-run; written to w unless
 * NULL. Returns the number of runs. */
static size_t mask_runs(tc_writer *w, const int32_t *mask, size_t n) {
    size_t runs = 0, len = 0;
    int cur = 0;
    for (size_t i = 0; i < n; i++) {
        int m = mask[i] != 0;
        if (m != cur) {
            if (w) put_uleb(w, len);
            runs++;
            len = 0;
            cur = m;
        }
        len++;
    }
    if (n) {
        if (w) put_uleb(w, len);
        runs++;
    }
    return runs;
}

int tc_writer_doc(tc_writer *w, uint64_t line_no, const int32_t *ids, const int32_t *mask, size_t n) {
    int rc = record_head(w, TC_DOC, line_no);
    if (rc != BT_OK) return rc;
    put_uleb(w, n);
    for (size_t i = 0; i < n; i++) put_uleb(w, (uint32_t)ids[i]);
    put_uleb(w, mask_runs(NULL, mask, n));
    mask_runs(w, mask, n);
    return record_done(w);
}

int tc_writer_pref(tc_writer *w, uint64_t line_no, const ld_pref_rec *rec, const int32_t *ids, const int32_t *mask) {
    if (rec->n_docs < 1 || rec->n_docs > 2 || rec->label < -1 || rec->label > 1)
        return w->failed = bt_fail(BT_ERR_INVALID, "token cache: bad preference record at line %llu",
                                   (unsigned long long)line_no);
    int rc = record_head(w, TC_PREF, line_no);
    if (rc != BT_OK) return rc;
    size_t n = rec->len[0] + (rec->n_docs == 2 ? rec->len[1] : 0);
    raw_need(w, 2);
    w->raw[w->raw_len++] = (uint8_t)rec->n_docs;
    w->raw[w->raw_len++] = (uint8_t)(rec->label + 1);
    put_uleb(w, rec->prompt_len);
    put_uleb(w, rec->len[0]);
    put_uleb(w, n);
    for (size_t i = 0; i < n; i++) put_uleb(w, (uint32_t)ids[i]);
    put_uleb(w, mask_runs(NULL, mask, n));
    mask_runs(w, mask, n);
    return record_done(w);
}

int tc_writer_bad(tc_writer *w, int kind, uint64_t line_no, int reason, const char *msg) {
    int rc = record_head(w, kind, line_no);
    if (rc != BT_OK) return rc;
    size_t len = msg ? strlen(msg) : 0;
    if (len > TC_MSG_MAX) len = TC_MSG_MAX;
    raw_need(w, 1 + 10 + len);
    w->raw[w->raw_len++] = (uint8_t)reason;
    put_uleb(w, len);
    memcpy(w->raw + w->raw_len, msg, len);
    w->raw_len += len;
    return record_done(w);
}

static void writer_release(tc_writer *w) {
    tc_sha_free(&w->chain);
    free(w->raw);
    free(w->z);
    w->raw = w->z = NULL;
}

int tc_writer_commit(tc_writer *w, uint64_t n_lines, uint64_t n_blank) {
    int rc = flush_block(w);
    if (rc == BT_OK && (n_lines < w->last_line || n_blank > n_lines - w->n_records))
        rc = w->failed = bt_fail(BT_ERR_INVALID, "token cache: %llu lines, %llu blank, %llu records",
                                 (unsigned long long)n_lines, (unsigned long long)n_blank,
                                 (unsigned long long)w->n_records);
    uint8_t t[TC_TRAILER_BYTES];
    bt_put32(t, TC_TRAILER_MAGIC);
    bt_put32(t + 4, TC_VERSION);
    bt_put64(t + 8, w->n_records);
    bt_put64(t + 16, n_lines);
    bt_put64(t + 24, n_blank);
    bt_put64(t + 32, w->n_blocks);
    tc_sha_update(&w->chain, t, 40);
    tc_sha_final(&w->chain, t + 40);
    if (rc == BT_OK) rc = wr(w, t, sizeof t);
    if (rc == BT_OK) rc = bt_atomic_commit(&w->af);
    else bt_atomic_abort(&w->af);
    writer_release(w);
    return rc;
}

void tc_writer_abort(tc_writer *w) {
    bt_atomic_abort(&w->af);
    writer_release(w);
}
