/* loaderd shard source: read(2) + optional zstd streaming decode -> lines. See source.h.
 * Plain and zstd shards share one line splitter over a heap buffer [beg, end) of bytes not yet
 * returned; fill() appends raw bytes (plain) or decoded bytes (zstd) to it. */
#include "loaderd/source.h"

#include <errno.h>
#include <stdarg.h>
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

#define LD_READ_BLOCK ((size_t)256 << 10)

struct ld_source {
    char *path;
    int fd;
    size_t size0;     /* file size at open: never read past it (a growing file stays stable) */
    size_t rd;        /* bytes read from the file so far */
    size_t max_line;
    uint64_t line_no; /* number of the last line reported */
    int is_zstd;
    int done;         /* END is all that is left */
    /* zstd */
    ZSTD_DStream *zd;
    ZSTD_inBuffer in;
    uint8_t *inbuf;
    size_t incap;
    int in_eof, frame_open, pending_flush;
    /* line buffer */
    char *buf;
    size_t cap, beg, end, scan; /* pending bytes [beg,end); no '\n' in [beg,scan) */
    int in_done;                /* nothing more will be appended */
    int failed;                 /* 0, LD_SRC_ZSTD or LD_SRC_IO: why in_done came early */
    int discarding;             /* inside an over-long line: dropping bytes up to the next '\n' */
    char fail_msg[320];
    void (*observe)(void *ctx, const void *p, size_t n); /* sees every raw byte read, in order */
    void *observe_ctx;
};

static int starts_with_zstd_magic(const uint8_t *d, size_t n) {
    if (n < 4) return 0;
    uint32_t v = bt_get32(d);
    return v == 0xFD2FB528u || (v & 0xFFFFFFF0u) == 0x184D2A50u;
}

static void fail_src(ld_source *s, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void fail_src(ld_source *s, int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s->fail_msg, sizeof s->fail_msg, fmt, ap);
    va_end(ap);
    s->failed = code;
    s->in_done = 1;
}

/* Read up to n bytes (never past size0). >0 bytes, 0 at size0, -1 after fail_src(LD_SRC_IO). */
static long read_some(ld_source *s, void *dst, size_t n) {
    if (s->rd >= s->size0) return 0;
    if (n > s->size0 - s->rd) n = s->size0 - s->rd;
    for (;;) {
        ssize_t r = read(s->fd, dst, n);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            fail_src(s, LD_SRC_IO, "%s: read error at byte %zu: %s", s->path, s->rd, strerror(errno));
            return -1;
        }
        if (r == 0) {
            fail_src(s, LD_SRC_IO, "%s: shard shrank while being read (%zu bytes at open, ends at %zu)",
                     s->path, s->size0, s->rd);
            return -1;
        }
        if (s->observe) s->observe(s->observe_ctx, dst, (size_t)r);
        s->rd += (size_t)r;
        return (long)r;
    }
}

int ld_source_open(ld_source **out, const char *path, size_t max_line) {
    *out = NULL;
    ld_source *s = calloc(1, sizeof *s);
    if (!s) return bt_fail(BT_ERR_NOMEM, "source: out of memory");
    s->fd = -1;
    s->path = strdup(path);
    if (!s->path) {
        free(s);
        return bt_fail(BT_ERR_NOMEM, "source: out of memory");
    }
    s->max_line = max_line ? max_line : LD_SOURCE_MAX_LINE;
    /* the one safe open (bt_common.h): a regular file only, never blocking; in loaderd no
     * symlink may have been swapped in since the path was checked */
    struct stat st;
    int rc = BT_OK;
    s->fd = bt_open_file(path, 0, &st);
    if (s->fd < 0) {
        ld_source_close(s);
        return BT_ERR_IO; /* bt_last_error names the path and why */
    }
    s->size0 = (size_t)st.st_size;
    bt_test_pause_point(path); /* tests truncate the shard here (bt_common.h) */
    posix_fadvise(s->fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    uint8_t head[4];
    ssize_t h = s->size0 >= 4 ? pread(s->fd, head, 4, 0) : 0;
    if (h < 0) {
        rc = bt_fail(BT_ERR_IO, "%s: read: %s", path, strerror(errno));
        ld_source_close(s);
        return rc;
    }
    s->is_zstd = starts_with_zstd_magic(head, (size_t)h);
    if (s->is_zstd) {
        s->zd = ZSTD_createDStream();
        s->incap = ZSTD_DStreamInSize();
        s->inbuf = malloc(s->incap);
        if (!s->zd || !s->inbuf) {
            ld_source_close(s);
            return bt_fail(BT_ERR_NOMEM, "%s: out of memory (zstd stream)", path);
        }
        ZSTD_initDStream(s->zd);
    }
    *out = s;
    return BT_OK;
}

static size_t strip_cr(const char *p, size_t n) { return (n > 0 && p[n - 1] == '\r') ? n - 1 : n; }

/* Make room for `need` more bytes at the end of buf (moving pending bytes to the front). */
static int make_room(ld_source *s, size_t need) {
    if (s->beg > 0) {
        memmove(s->buf, s->buf + s->beg, s->end - s->beg);
        s->end -= s->beg;
        s->scan -= s->beg;
        s->beg = 0;
    }
    if (s->cap - s->end < need) {
        char *nb = bt_vec_grow(s->buf, &s->cap, s->end + need < 2 * need ? 2 * need : s->end + need, 1);
        if (!nb) return bt_fail(BT_ERR_NOMEM, "%s: out of memory (line buffer of %zu bytes)", s->path, s->end + need);
        s->buf = nb;
    }
    return BT_OK;
}

/* Append more bytes to buf, or set in_done (end of data, or failed). */
static int fill(ld_source *s) {
    if (!s->is_zstd) {
        int rc = make_room(s, LD_READ_BLOCK);
        if (rc != BT_OK) return rc;
        long n = read_some(s, s->buf + s->end, s->cap - s->end);
        if (n < 0) return BT_OK;
        if (n == 0) s->in_done = 1;
        s->end += (size_t)n;
        return BT_OK;
    }
    if (s->in.pos == s->in.size && !s->in_eof) {
        long n = read_some(s, s->inbuf, s->incap);
        if (n < 0) return BT_OK;
        if (n == 0) s->in_eof = 1;
        s->in = (ZSTD_inBuffer){s->inbuf, (size_t)n, 0};
    }
    if (s->in_eof && s->in.pos == s->in.size && !s->pending_flush) {
        s->in_done = 1;
        if (s->frame_open)
            fail_src(s, LD_SRC_ZSTD, "%s: truncated zstd frame (input ends at %zu bytes inside a frame)",
                     s->path, s->rd);
        return BT_OK;
    }
    size_t outsz = ZSTD_DStreamOutSize();
    int rc = make_room(s, outsz);
    if (rc != BT_OK) return rc;
    ZSTD_outBuffer out = {s->buf + s->end, s->cap - s->end, 0};
    size_t before = s->in.pos;
    size_t ret = ZSTD_decompressStream(s->zd, &out, &s->in);
    if (ZSTD_isError(ret)) {
        fail_src(s, LD_SRC_ZSTD, "%s: corrupt zstd data: %s (compressed offset %zu of %zu)", s->path,
                 ZSTD_getErrorName(ret), s->rd - (s->in.size - s->in.pos), s->size0);
        return BT_OK;
    }
    if (ret == 0) s->frame_open = 0;
    else if (s->in.pos != before || out.pos) s->frame_open = 1;
    s->pending_flush = out.pos == out.size;
    s->end += out.pos;
    return BT_OK;
}

int ld_source_next(ld_source *s, const char **line, size_t *len, uint64_t *line_no) {
    *line = NULL;
    *len = 0;
    *line_no = s->line_no;
    if (s->done) return LD_SRC_END;
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
                bt_fail(s->failed == LD_SRC_IO ? BT_ERR_IO : BT_ERR_FORMAT, "%s", s->fail_msg);
                return s->failed;
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
        int rc = fill(s);
        if (rc != BT_OK) return rc;
    }
}

int ld_source_is_zstd(const ld_source *s) { return s->is_zstd; }

void ld_source_close(ld_source *s) {
    if (!s) return;
    if (s->zd) ZSTD_freeDStream(s->zd);
    if (s->fd >= 0) close(s->fd);
    free(s->inbuf);
    free(s->buf);
    free(s->path);
    free(s);
}

void ld_source_observe(ld_source *s, void (*fn)(void *ctx, const void *p, size_t n), void *ctx) {
    s->observe = fn;
    s->observe_ctx = ctx;
}

size_t ld_source_bytes_read(const ld_source *s) { return s->rd; }

size_t ld_source_size(const ld_source *s) { return s->size0; }
