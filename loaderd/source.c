/* loaderd shard source: mmap + optional zstd streaming decode -> lines. See source.h. */
#include "loaderd/source.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <zstd.h>

#include "common/bt_common.h"

struct ld_source {
    char *path;
    bt_map map;
    size_t max_line;
    uint64_t line_no; /* number of the last line reported */
    int is_zstd;
    int done; /* END is all that is left */
    /* plain */
    size_t pos;
    /* zstd */
    ZSTD_DStream *zd;
    ZSTD_inBuffer in;
    char *buf;
    size_t cap, beg, end, scan; /* pending decoded bytes [beg,end); no '\n' in [beg,scan) */
    int in_done;                /* the decoder has nothing more to give */
    int failed;                 /* ... because the zstd data is corrupt or truncated */
    int discarding;             /* inside an over-long line: dropping bytes up to the next '\n' */
    char fail_msg[256];
};

static int starts_with_zstd_magic(const uint8_t *d, size_t n) {
    if (n < 4) return 0;
    uint32_t v = (uint32_t)d[0] | (uint32_t)d[1] << 8 | (uint32_t)d[2] << 16 | (uint32_t)d[3] << 24;
    return v == 0xFD2FB528u || (v & 0xFFFFFFF0u) == 0x184D2A50u;
}

int ld_source_open(ld_source **out, const char *path, size_t max_line) {
    *out = NULL;
    ld_source *s = calloc(1, sizeof *s);
    if (!s) return bt_fail(BT_ERR_NOMEM, "source: out of memory");
    s->path = strdup(path);
    if (!s->path) {
        free(s);
        return bt_fail(BT_ERR_NOMEM, "source: out of memory");
    }
    s->max_line = max_line ? max_line : LD_SOURCE_MAX_LINE;
    int rc = bt_map_open(&s->map, path);
    if (rc != BT_OK) {
        free(s->path);
        free(s);
        return rc;
    }
    if (s->map.size > 0) madvise((void *)s->map.data, s->map.size, MADV_SEQUENTIAL);
    s->is_zstd = starts_with_zstd_magic(s->map.data, s->map.size);
    if (s->is_zstd) {
        s->zd = ZSTD_createDStream();
        if (!s->zd) {
            ld_source_close(s);
            return bt_fail(BT_ERR_NOMEM, "%s: ZSTD_createDStream failed", path);
        }
        ZSTD_initDStream(s->zd);
        s->in.src = s->map.data;
        s->in.size = s->map.size;
        s->in.pos = 0;
    }
    *out = s;
    return BT_OK;
}

static size_t strip_cr(const char *p, size_t n) { return (n > 0 && p[n - 1] == '\r') ? n - 1 : n; }

static int next_plain(ld_source *s, const char **line, size_t *len, uint64_t *line_no) {
    if (s->pos >= s->map.size) {
        s->done = 1;
        return LD_SRC_END;
    }
    const char *base = (const char *)s->map.data;
    const char *p = base + s->pos;
    size_t rest = s->map.size - s->pos;
    const char *nl = memchr(p, '\n', rest);
    size_t n = nl ? (size_t)(nl - p) : rest;
    s->pos += nl ? n + 1 : n;
    *line_no = ++s->line_no;
    if (n > s->max_line) return LD_SRC_TOO_LONG;
    *line = p;
    *len = strip_cr(p, n);
    return LD_SRC_LINE;
}

/* Run the decoder once into the free tail of buf. Sets in_done/failed at the end of input. */
static int decode_some(ld_source *s) {
    size_t outsz = ZSTD_DStreamOutSize();
    if (s->beg > 0) {
        memmove(s->buf, s->buf + s->beg, s->end - s->beg);
        s->end -= s->beg;
        s->scan -= s->beg;
        s->beg = 0;
    }
    if (s->cap - s->end < outsz) {
        size_t ncap = s->cap ? s->cap : 2 * outsz;
        while (ncap - s->end < outsz) ncap *= 2;
        char *nb = realloc(s->buf, ncap);
        if (!nb) return bt_fail(BT_ERR_NOMEM, "%s: out of memory (line buffer %zu bytes)", s->path, ncap);
        s->buf = nb;
        s->cap = ncap;
    }
    ZSTD_outBuffer out = {s->buf + s->end, s->cap - s->end, 0};
    size_t ret = ZSTD_decompressStream(s->zd, &out, &s->in);
    if (ZSTD_isError(ret)) {
        snprintf(s->fail_msg, sizeof s->fail_msg, "%s: corrupt zstd data: %s (compressed offset %zu of %zu)",
                 s->path, ZSTD_getErrorName(ret), s->in.pos, s->in.size);
        s->in_done = s->failed = 1;
        return BT_OK;
    }
    s->end += out.pos;
    if (s->in.pos == s->in.size && out.pos < out.size) {
        /* All input consumed and everything flushed: ret == 0 means the last frame is complete. */
        s->in_done = 1;
        if (ret != 0) {
            snprintf(s->fail_msg, sizeof s->fail_msg,
                     "%s: truncated zstd frame (input ends at %zu bytes, decoder wants %zu more)",
                     s->path, s->in.size, ret);
            s->failed = 1;
        }
    }
    return BT_OK;
}

static int next_zstd(ld_source *s, const char **line, size_t *len, uint64_t *line_no) {
    for (;;) {
        if (s->scan < s->end) {
            char *nl = memchr(s->buf + s->scan, '\n', s->end - s->scan);
            if (nl) {
                size_t lend = (size_t)(nl - s->buf);
                size_t start = s->beg, n = lend - s->beg;
                int too_long = s->discarding || n > s->max_line;
                s->discarding = 0;
                s->beg = s->scan = lend + 1;
                *line_no = ++s->line_no;
                if (too_long) return LD_SRC_TOO_LONG;
                *line = s->buf + start;
                *len = strip_cr(s->buf + start, n);
                return LD_SRC_LINE;
            }
            s->scan = s->end;
        }
        if (s->discarding || s->end - s->beg > s->max_line) {
            s->discarding = 1; /* drop what we hold of the over-long line */
            s->beg = s->scan = s->end = 0;
        }
        if (s->in_done) {
            s->done = 1;
            if (s->failed) {
                *line_no = s->line_no + 1;
                bt_fail(BT_ERR_FORMAT, "%s", s->fail_msg);
                return LD_SRC_ZSTD;
            }
            if (s->discarding) {
                *line_no = ++s->line_no;
                return LD_SRC_TOO_LONG;
            }
            if (s->end > s->beg) {
                *line_no = ++s->line_no;
                *line = s->buf + s->beg;
                *len = strip_cr(s->buf + s->beg, s->end - s->beg);
                s->beg = s->end;
                return LD_SRC_LINE;
            }
            return LD_SRC_END;
        }
        int rc = decode_some(s);
        if (rc != BT_OK) return rc;
    }
}

int ld_source_next(ld_source *s, const char **line, size_t *len, uint64_t *line_no) {
    *line = NULL;
    *len = 0;
    *line_no = s->line_no;
    if (s->done) return LD_SRC_END;
    return s->is_zstd ? next_zstd(s, line, len, line_no) : next_plain(s, line, len, line_no);
}

int ld_source_is_zstd(const ld_source *s) { return s->is_zstd; }
const char *ld_source_path(const ld_source *s) { return s->path; }

void ld_source_close(ld_source *s) {
    if (!s) return;
    if (s->zd) ZSTD_freeDStream(s->zd);
    free(s->buf);
    bt_map_close(&s->map);
    free(s->path);
    free(s);
}
