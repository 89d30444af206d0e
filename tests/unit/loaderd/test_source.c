/* Tests of loaderd/source.c: plain and zstd shards -> lines. Files are written into a fresh
 * temporary directory; zstd data is made here with libzstd. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zstd.h>

#include "common/bt_common.h"
#include "loaderd/source.h"

static char g_dir[64];

static void write_file(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    if (n) assert_int_equal(fwrite(data, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

static char *tmp_path(const char *name) {
    static char buf[4][256];
    static int k;
    char *p = buf[k++ & 3];
    snprintf(p, 256, "%s/%s", g_dir, name);
    return p;
}

/* Compress with content checksum on, one frame. Caller frees. */
static void *zcompress(const void *src, size_t n, size_t *out_n) {
    size_t cap = ZSTD_compressBound(n);
    void *dst = malloc(cap);
    ZSTD_CCtx *c = ZSTD_createCCtx();
    ZSTD_CCtx_setParameter(c, ZSTD_c_checksumFlag, 1);
    ZSTD_CCtx_setParameter(c, ZSTD_c_compressionLevel, 3);
    size_t r = ZSTD_compress2(c, dst, cap, src, n);
    assert_false(ZSTD_isError(r));
    ZSTD_freeCCtx(c);
    *out_n = r;
    return dst;
}

typedef struct {
    int code;
    char *text; /* for LD_SRC_LINE */
    size_t len;
    uint64_t line_no;
} ev;

/* Read all events of a shard (bounded). Returns count; evs owned by caller (free_evs). */
static size_t read_all(const char *path, size_t max_line, ev *evs, size_t cap) {
    ld_source *s = NULL;
    assert_int_equal(ld_source_open(&s, path, max_line), BT_OK);
    size_t n = 0;
    for (;;) {
        const char *l;
        size_t len;
        uint64_t no;
        int rc = ld_source_next(s, &l, &len, &no);
        assert_true(rc >= 0);
        if (rc == LD_SRC_END) break;
        assert_true(n < cap);
        evs[n].code = rc;
        evs[n].line_no = no;
        evs[n].len = len;
        evs[n].text = NULL;
        if (rc == LD_SRC_LINE) {
            evs[n].text = malloc(len + 1);
            if (len) memcpy(evs[n].text, l, len);
            evs[n].text[len] = 0;
        }
        n++;
    }
    /* END is sticky */
    const char *l;
    size_t len;
    uint64_t no;
    assert_int_equal(ld_source_next(s, &l, &len, &no), LD_SRC_END);
    ld_source_close(s);
    return n;
}

static void free_evs(ev *evs, size_t n) {
    for (size_t i = 0; i < n; i++) free(evs[i].text);
}

static void expect_line(const ev *e, const char *text, uint64_t no) {
    assert_int_equal(e->code, LD_SRC_LINE);
    assert_int_equal(e->line_no, no);
    assert_int_equal(e->len, strlen(text));
    assert_string_equal(e->text, text);
}

static void test_plain_lines(void **state) {
    (void)state;
    const char *data = "{\"a\":1}\nbb\r\n\n\r\nccc";
    write_file(tmp_path("p.jsonl"), data, strlen(data));
    ev evs[16];
    size_t n = read_all(tmp_path("p.jsonl"), 0, evs, 16);
    assert_int_equal(n, 5);
    expect_line(&evs[0], "{\"a\":1}", 1);
    expect_line(&evs[1], "bb", 2);
    expect_line(&evs[2], "", 3);
    expect_line(&evs[3], "", 4);
    expect_line(&evs[4], "ccc", 5); /* no trailing newline */
    free_evs(evs, n);

    /* trailing newline: no extra empty line */
    write_file(tmp_path("p2.jsonl"), "x\ny\n", 4);
    n = read_all(tmp_path("p2.jsonl"), 0, evs, 16);
    assert_int_equal(n, 2);
    expect_line(&evs[1], "y", 2);
    free_evs(evs, n);
}

static void test_empty_and_missing(void **state) {
    (void)state;
    write_file(tmp_path("empty.jsonl"), "", 0);
    ev evs[2];
    assert_int_equal(read_all(tmp_path("empty.jsonl"), 0, evs, 2), 0);
    ld_source *s = (ld_source *)0x1;
    assert_int_equal(ld_source_open(&s, tmp_path("nope.jsonl"), 0), BT_ERR_IO);
    assert_null(s);
    assert_non_null(strstr(bt_last_error(), "nope.jsonl"));
    ld_source_close(NULL);
}

/* Random text of n lines with random lengths (some empty, some CRLF), no trailing newline. */
static char *random_text(unsigned seed, int n_lines, size_t *out_n) {
    srand(seed);
    size_t cap = 1024, n = 0;
    char *t = malloc(cap);
    for (int i = 0; i < n_lines; i++) {
        int len = rand() % 5 == 0 ? 0 : rand() % 300;
        if (n + (size_t)len + 3 > cap) {
            cap = 2 * (n + (size_t)len + 3);
            t = realloc(t, cap);
        }
        for (int k = 0; k < len; k++) t[n++] = (char)('a' + rand() % 26);
        if (rand() % 7 == 0) t[n++] = '\r';
        if (i + 1 < n_lines) t[n++] = '\n';
    }
    *out_n = n;
    return t;
}

static void test_zstd_multiframe_matches_plain(void **state) {
    (void)state;
    size_t n;
    char *text = random_text(7, 3000, &n);
    write_file(tmp_path("r.jsonl"), text, n);
    /* frames cut at arbitrary byte positions (mid-line), skippable frames at start and middle */
    size_t cap = ZSTD_compressBound(n) + 4096, zn = 0;
    uint8_t *z = malloc(cap);
    uint8_t skip[12] = {0x50, 0x2A, 0x4D, 0x18, 4, 0, 0, 0, 'j', 'u', 'n', 'k'};
    memcpy(z, skip, sizeof skip);
    zn = sizeof skip;
    size_t cuts[] = {0, 17, 50000, 50001, 200000, n};
    for (int i = 0; i + 1 < 6; i++) {
        size_t a = cuts[i], b = cuts[i + 1] < n ? cuts[i + 1] : n;
        if (a >= b) continue;
        size_t fn;
        void *f = zcompress(text + a, b - a, &fn);
        memcpy(z + zn, f, fn);
        zn += fn;
        free(f);
        if (i == 2) {
            skip[0] = 0x5F; /* another skippable magic */
            memcpy(z + zn, skip, sizeof skip);
            zn += sizeof skip;
        }
    }
    write_file(tmp_path("r.jsonl.zst"), z, zn);
    free(z);

    static ev a[3100], b[3100];
    size_t na = read_all(tmp_path("r.jsonl"), 0, a, 3100);
    size_t nb = read_all(tmp_path("r.jsonl.zst"), 0, b, 3100);
    assert_int_equal(na, 3000);
    assert_int_equal(nb, 3000);
    for (size_t i = 0; i < na; i++) {
        assert_int_equal(a[i].code, LD_SRC_LINE);
        assert_int_equal(b[i].code, LD_SRC_LINE);
        assert_int_equal(a[i].line_no, i + 1);
        assert_int_equal(b[i].line_no, i + 1);
        assert_int_equal(a[i].len, b[i].len);
        assert_memory_equal(a[i].text, b[i].text, a[i].len);
        assert_null(memchr(a[i].text, '\r', a[i].len));
    }
    free_evs(a, na);
    free_evs(b, nb);
    ld_source *s;
    assert_int_equal(ld_source_open(&s, tmp_path("r.jsonl.zst"), 0), BT_OK);
    assert_int_equal(ld_source_is_zstd(s), 1);
    ld_source_close(s);
    free(text);
}

static void test_zstd_truncated(void **state) {
    (void)state;
    size_t n;
    char *text = random_text(11, 2000, &n);
    size_t zn;
    uint8_t *z = zcompress(text, n, &zn);
    write_file(tmp_path("t.jsonl.zst"), z, zn / 2);
    static ev e[2100];
    size_t ne = read_all(tmp_path("t.jsonl.zst"), 0, e, 2100);
    assert_true(ne >= 1);
    /* a prefix of correct complete lines, then exactly one ZSTD event, then END */
    assert_int_equal(e[ne - 1].code, LD_SRC_ZSTD);
    assert_int_equal(e[ne - 1].line_no, ne);
    size_t off = 0;
    for (size_t i = 0; i + 1 < ne; i++) {
        assert_int_equal(e[i].code, LD_SRC_LINE);
        const char *nl = memchr(text + off, '\n', n - off);
        assert_non_null(nl);
        size_t len = (size_t)(nl - (text + off));
        if (len && text[off + len - 1] == '\r') len--;
        assert_int_equal(e[i].len, len);
        assert_memory_equal(e[i].text, text + off, len);
        off = (size_t)(nl - text) + 1;
    }
    assert_true(ne - 1 < 2000);
    free_evs(e, ne);

    /* only the magic */
    write_file(tmp_path("t4.zst"), z, 4);
    ne = read_all(tmp_path("t4.zst"), 0, e, 4);
    assert_int_equal(ne, 1);
    assert_int_equal(e[0].code, LD_SRC_ZSTD);
    free(z);
    free(text);
}

static void test_zstd_corrupt(void **state) {
    (void)state;
    size_t n;
    char *text = random_text(3, 2000, &n);
    size_t zn;
    uint8_t *z = zcompress(text, n, &zn);
    for (size_t i = zn / 3; i < zn / 3 + 64; i++) z[i] ^= 0x5A;
    write_file(tmp_path("c.jsonl.zst"), z, zn);
    static ev e[4100];
    size_t ne = read_all(tmp_path("c.jsonl.zst"), 0, e, 4100);
    assert_true(ne >= 1);
    assert_int_equal(e[ne - 1].code, LD_SRC_ZSTD);
    for (size_t i = 0; i + 1 < ne; i++) assert_int_not_equal(e[i].code, LD_SRC_ZSTD);
    free_evs(e, ne);

    /* a good frame followed by garbage: the good lines, then ZSTD */
    size_t gn;
    uint8_t *g = zcompress("a\nb\n", 4, &gn);
    uint8_t buf[256];
    memcpy(buf, g, gn);
    memset(buf + gn, 0x77, 20);
    write_file(tmp_path("g.jsonl.zst"), buf, gn + 20);
    ne = read_all(tmp_path("g.jsonl.zst"), 0, e, 10);
    assert_int_equal(ne, 3);
    expect_line(&e[0], "a", 1);
    expect_line(&e[1], "b", 2);
    assert_int_equal(e[2].code, LD_SRC_ZSTD);
    assert_int_equal(e[2].line_no, 3);
    free_evs(e, ne);
    free(g);
    free(z);
    free(text);
}

/* Lines: "ok1", a line of `big` 'x', "ok2", a line of exactly `limit` bytes, last line over limit. */
static char *long_line_text(size_t limit, size_t big, size_t *out_n) {
    size_t n = 4 + big + 1 + 4 + limit + 1 + limit + 1;
    char *t = malloc(n);
    size_t k = 0;
    memcpy(t + k, "ok1\n", 4), k += 4;
    memset(t + k, 'x', big), k += big;
    t[k++] = '\n';
    memcpy(t + k, "ok2\n", 4), k += 4;
    memset(t + k, 'y', limit), k += limit;
    t[k++] = '\n';
    memset(t + k, 'z', limit + 1), k += limit + 1; /* no newline at the end */
    *out_n = k;
    return t;
}

static void check_long_events(ev *e, size_t ne, size_t limit) {
    assert_int_equal(ne, 5);
    expect_line(&e[0], "ok1", 1);
    assert_int_equal(e[1].code, LD_SRC_TOO_LONG);
    assert_int_equal(e[1].line_no, 2);
    expect_line(&e[2], "ok2", 3);
    assert_int_equal(e[3].code, LD_SRC_LINE);
    assert_int_equal(e[3].len, limit);
    assert_int_equal(e[3].line_no, 4);
    assert_int_equal(e[4].code, LD_SRC_TOO_LONG);
    assert_int_equal(e[4].line_no, 5);
}

static void test_long_lines(void **state) {
    (void)state;
    ev e[8];
    size_t n, zn, ne;
    /* small limit, line far larger than the zstd output buffer */
    char *t = long_line_text(1000, 3u << 20, &n);
    write_file(tmp_path("l.jsonl"), t, n);
    ne = read_all(tmp_path("l.jsonl"), 1000, e, 8);
    check_long_events(e, ne, 1000);
    free_evs(e, ne);
    void *z = zcompress(t, n, &zn);
    write_file(tmp_path("l.jsonl.zst"), z, zn);
    ne = read_all(tmp_path("l.jsonl.zst"), 1000, e, 8);
    check_long_events(e, ne, 1000);
    free_evs(e, ne);
    free(z);
    free(t);

    /* the default 16 MiB limit */
    t = long_line_text(LD_SOURCE_MAX_LINE, LD_SOURCE_MAX_LINE + 1, &n);
    z = zcompress(t, n, &zn);
    write_file(tmp_path("L.jsonl.zst"), z, zn);
    ne = read_all(tmp_path("L.jsonl.zst"), 0, e, 8);
    check_long_events(e, ne, LD_SOURCE_MAX_LINE);
    free_evs(e, ne);
    write_file(tmp_path("L.jsonl"), t, n);
    ne = read_all(tmp_path("L.jsonl"), 0, e, 8);
    check_long_events(e, ne, LD_SOURCE_MAX_LINE);
    free_evs(e, ne);
    free(z);
    free(t);
}

static int setup(void **state) {
    (void)state;
    snprintf(g_dir, sizeof g_dir, "/tmp/bt_test_source_XXXXXX");
    return mkdtemp(g_dir) ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    return system(cmd) == 0 ? 0 : -1;
}

/* A shard truncated by someone else while we read it: no SIGBUS (we never mmap), the lines
 * read so far are intact, then LD_SRC_IO once (naming the path), then END. Plain and zstd. */
static void test_truncated_while_reading(void **state) {
    (void)state;
    size_t n_lines = 40000;
    char *data = malloc(n_lines * 80);
    size_t n = 0;
    uint64_t x = 1; /* incompressible padding (LCG, Knuth MMIX constants): the zstd shard stays big */
    for (size_t i = 0; i < n_lines; i++) {
        x = x * 6364136223846793005ULL + 1442695040888963407ULL;
        uint64_t y = x * 6364136223846793005ULL + 1442695040888963407ULL;
        x = y;
        n += (size_t)sprintf(data + n, "{\"line\":%zu,\"pad\":\"%016llx%016llx\"}\n", i,
                             (unsigned long long)(x >> 1), (unsigned long long)(y * 31));
    }
    size_t zn;
    void *z = zcompress(data, n, &zn);
    for (int zst = 0; zst <= 1; zst++) {
        const char *path = tmp_path(zst ? "shrink.jsonl.zst" : "shrink.jsonl");
        write_file(path, zst ? z : data, zst ? zn : n);
        ld_source *s = NULL;
        assert_int_equal(ld_source_open(&s, path, 0), BT_OK);
        const char *l;
        size_t len;
        uint64_t no;
        for (int i = 0; i < 10; i++) assert_int_equal(ld_source_next(s, &l, &len, &no), LD_SRC_LINE);
        assert_int_equal(truncate(path, (off_t)((zst ? zn : n) / 2)), 0);
        int rc, last = -1;
        size_t lines = 10;
        while ((rc = ld_source_next(s, &l, &len, &no)) == LD_SRC_LINE) {
            char want[64];
            int k = sprintf(want, "{\"line\":%zu,", lines);
            assert_true(len > (size_t)k && memcmp(l, want, (size_t)k) == 0);
            lines++;
        }
        last = rc;
        /* plain: read(2) returns 0 early; zstd: the same, or the decoder sees the cut frame */
        if (zst) assert_true(last == LD_SRC_IO || last == LD_SRC_ZSTD);
        else assert_int_equal(last, LD_SRC_IO);
        assert_non_null(strstr(bt_last_error(), "shrink.jsonl"));
        assert_true(lines < n_lines);
        assert_int_equal(no, lines + 1);
        assert_int_equal(ld_source_next(s, &l, &len, &no), LD_SRC_END);
        ld_source_close(s);
    }
    free(z);
    free(data);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_plain_lines),
        cmocka_unit_test(test_empty_and_missing),
        cmocka_unit_test(test_zstd_multiframe_matches_plain),
        cmocka_unit_test(test_zstd_truncated),
        cmocka_unit_test(test_zstd_corrupt),
        cmocka_unit_test(test_long_lines),
        cmocka_unit_test(test_truncated_while_reading),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
