/* loaderd token cache: tokenize one shard into an entry (see loaderd/tcache.h). A feeder thread
 * reads the shard's lines into chunks (loaderd/chunkq.h), n workers render them
 * (ld_format_render), this thread writes the results in line order. The raw bytes read are
 * hashed on the way and must equal the content the key was made from. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "loaderd/chunkq.h"
#include "loaderd/pipeline.h"
#include "loaderd/source.h"
#include "loaderd/tcache_priv.h"

typedef struct {
    const ld_tc_shard *sh;
    ld_source *src;
    ld_chunkq *q;
    tc_sha sha;
    uint64_t n_lines, n_blank;
    int io_failed; /* the shard could not be read to its end */
    char io_msg[320];
} build_t;

static int render_item(void *ctx, ld_item *it, const char *line) {
    const build_t *b = ctx;
    int reason = -1;
    int rc = ld_format_render(b->sh->fcfg, line, it->len, &it->ids, &it->mask, &reason, it->msg, sizeof it->msg);
    if (rc < 0) return rc;
    it->bad = rc == 1 ? reason : -1;
    return BT_OK;
}

static int is_blank(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (s[i] != ' ' && s[i] != '\t' && s[i] != '\r' && s[i] != '\f' && s[i] != '\v') return 0;
    return 1;
}

/* Feeder: the shard's lines -> chunks. Blank lines are only counted (as the stream does). */
static void *feed_main(void *arg) {
    build_t *b = arg;
    ld_chunk *c = ld_chunkq_claim(b->q);
    while (c) {
        const char *line = NULL;
        size_t len = 0;
        uint64_t no = 0;
        int rc = ld_source_next(b->src, &line, &len, &no);
        if (rc < 0) {
            ld_chunkq_fail(b->q, rc, bt_last_error());
            return NULL;
        }
        if (rc == LD_SRC_END) break;
        if (rc == LD_SRC_IO) {
            b->io_failed = 1;
            snprintf(b->io_msg, sizeof b->io_msg, "%s", bt_last_error());
            ld_chunkq_fail(b->q, BT_ERR_IO, b->io_msg);
            return NULL;
        }
        if (rc == LD_SRC_ZSTD) { /* deterministic for this content: the entry records it */
            b->n_lines++;
            ld_item *it = ld_chunk_add(c, NULL, 0);
            it->line_no = no;
            it->ready = 1;
            it->bad = it->pre_bad = LD_BAD_ZSTD;
            snprintf(it->msg, sizeof it->msg, "%s", bt_last_error());
            break;
        }
        b->n_lines++;
        if (rc == LD_SRC_LINE && is_blank(line, len)) {
            b->n_blank++;
            continue;
        }
        ld_item *it = ld_chunk_add(c, line, rc == LD_SRC_TOO_LONG ? 0 : len);
        it->line_no = no;
        if (rc == LD_SRC_TOO_LONG) {
            it->ready = 1;
            it->bad = it->pre_bad = LD_BAD_TOO_LONG;
            snprintf(it->msg, sizeof it->msg, "line longer than %zu bytes", LD_SOURCE_MAX_LINE);
        }
        if (c->n >= LD_CHUNK_LINES || c->tlen >= LD_CHUNK_BYTES) {
            ld_chunkq_publish(b->q, c);
            c = ld_chunkq_claim(b->q);
        }
    }
    if (c) ld_chunkq_publish(b->q, c);
    ld_chunkq_finish(b->q);
    return NULL;
}

/* Hash the bytes of path from `from` to `to` (what the source did not read after a zstd error). */
static int hash_rest(tc_sha *s, const char *path, uint64_t from, uint64_t to) {
    if (from >= to) return BT_OK;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return bt_fail(BT_ERR_IO, "%s: %s", path, strerror(errno));
    char buf[65536];
    int rc = BT_OK;
    while (from < to) {
        size_t want = to - from > sizeof buf ? sizeof buf : (size_t)(to - from);
        ssize_t r = pread(fd, buf, want, (off_t)from);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            rc = bt_fail(BT_ERR_IO, "%s: shrank while being tokenized", path);
            break;
        }
        tc_sha_update(s, buf, (size_t)r);
        from += (uint64_t)r;
    }
    close(fd);
    return rc;
}

/* Take the chunks in order and write their records; BT_OK, or the error. */
static int write_records(build_t *b, tc_writer *w, const _Atomic int *stop, uint64_t *tokens) {
    for (;;) {
        if (atomic_load(stop)) return bt_fail(BT_ERR_TIMEOUT, "token cache: stopped");
        ld_chunk *c = NULL;
        int rc = ld_chunkq_take(b->q, &c);
        if (rc == 1) return BT_OK;
        if (rc < 0) return rc;
        for (size_t i = 0; i < c->n && rc == BT_OK; i++) {
            const ld_item *it = &c->items[i];
            if (it->bad == LD_BAD_ZSTD) rc = tc_writer_bad(w, TC_SHARD_ERROR, it->line_no, it->bad, it->msg);
            else if (it->bad >= 0) rc = tc_writer_bad(w, TC_BAD, it->line_no, it->bad, it->msg);
            else {
                rc = tc_writer_doc(w, it->line_no, it->ids.v, it->mask.v, it->ids.n);
                *tokens += it->ids.n;
            }
        }
        ld_chunkq_release(b->q, c);
        if (rc != BT_OK) return rc;
    }
}

int tc_build(ld_tcache *c, const ld_tc_shard *sh, const char *path, const uint8_t key[32],
             const uint8_t content[32], uint64_t size, uint32_t n_threads, const _Atomic int *stop) {
    build_t b = {.sh = sh};
    if (ld_source_open(&b.src, sh->path, 0) != BT_OK) {
        bt_log(BT_LOG_WARN, "loaderd", "token cache: %s", bt_last_error());
        return LD_TC_BYPASS;
    }
    int rc = tc_sha_init(&b.sha);
    if (rc != BT_OK) {
        ld_source_close(b.src);
        return rc;
    }
    ld_source_observe(b.src, tc_sha_cb, &b.sha);
    tc_writer w;
    if (tc_writer_open(&w, path, key, size) != BT_OK) {
        bt_log(BT_LOG_WARN, "loaderd", "token cache: cannot write an entry (%s): reading %s raw", bt_last_error(),
               sh->path);
        tc_sha_free(&b.sha);
        ld_source_close(b.src);
        return LD_TC_BYPASS;
    }
    pthread_t feeder;
    int feeding = 0;
    rc = ld_chunkq_new(&b.q, n_threads, render_item, &b);
    if (rc == BT_OK) {
        if (pthread_create(&feeder, NULL, feed_main, &b) == 0) feeding = 1;
        else rc = bt_fail(BT_ERR_NOMEM, "token cache: cannot start a reader thread");
    }
    uint64_t tokens = 0;
    if (rc == BT_OK) rc = write_records(&b, &w, stop, &tokens);
    if (b.q) ld_chunkq_stop(b.q); /* a feeder blocked on a full queue returns */
    if (feeding) pthread_join(feeder, NULL);
    ld_chunkq_free(b.q);
    if (rc == BT_ERR_TIMEOUT || rc == BT_ERR_NOMEM) { /* stopped, or out of memory: no entry */
        tc_sha_free(&b.sha);
        tc_writer_abort(&w);
        ld_source_close(b.src);
        return rc;
    }
    int bypass = 0;
    if (rc != BT_OK) { /* the shard could not be read to its end, or the entry not written */
        bt_log(BT_LOG_WARN, "loaderd", "token cache: %s: %s not cached, read raw", b.io_failed ? b.io_msg : bt_last_error(),
               sh->path);
        bypass = 1;
        tc_sha_free(&b.sha);
    } else {
        uint8_t got[32];
        rc = hash_rest(&b.sha, sh->path, ld_source_bytes_read(b.src), ld_source_size(b.src));
        tc_sha_final(&b.sha, got);
        if (rc != BT_OK || ld_source_size(b.src) != size || memcmp(got, content, 32) != 0) {
            atomic_fetch_add_explicit(&ld_tcache_stats_of(c)->stale, 1, memory_order_relaxed);
            bt_log(BT_LOG_WARN, "loaderd", "token cache: %s changed while being tokenized: not cached, read raw",
                   sh->path);
            bypass = 1;
        }
    }
    if (!bypass) {
        if (tc_writer_commit(&w, b.n_lines, b.n_blank) == BT_OK)
            atomic_fetch_add_explicit(&ld_tcache_stats_of(c)->build_tokens, tokens, memory_order_relaxed);
        else {
            bt_log(BT_LOG_WARN, "loaderd", "token cache: %s: reading %s raw", bt_last_error(), sh->path);
            bypass = 1;
        }
    } else {
        tc_writer_abort(&w);
    }
    ld_source_close(b.src);
    return bypass ? LD_TC_BYPASS : BT_OK;
}
