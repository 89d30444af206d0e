/* Shared unit-test helpers. See test_util.h. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zstd.h>

#include "common/atomic_io.h"
#include "common/bt_common.h"
#include "common/safetensors.h"
#include "tests/unit/util/test_util.h"

const char *tu_model_path(void) {
    const char *m = getenv("BT_MODEL");
    return m && *m ? m : "models/SmolLM2-135M-Instruct.Q4_1.gguf";
}

int tu_load_tokenizer(bt_tokenizer **tok) {
    if (bt_tokenizer_load(tok, tu_model_path()) != BT_OK) {
        fprintf(stderr, "cannot load tokenizer %s: %s\n", tu_model_path(), bt_last_error());
        return -1;
    }
    return 0;
}

int tu_make_tmpdir(char *dir, size_t dir_size, const char *tag) {
    int k = snprintf(dir, dir_size, "/tmp/bt_test_%s_XXXXXX", tag);
    if (k < 0 || (size_t)k >= dir_size) return -1;
    return mkdtemp(dir) ? 0 : -1;
}

int tu_remove_dir(const char *dir) {
    bt_rm_tree(dir);
    return access(dir, F_OK) == 0 ? -1 : 0;
}

uint8_t *tu_slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) fail_msg("cannot open %s (tests run from the repo root)", path);
    assert_int_equal(fseek(f, 0, SEEK_END), 0);
    long sz = ftell(f);
    assert_true(sz >= 0);
    assert_int_equal(fseek(f, 0, SEEK_SET), 0);
    uint8_t *p = bt_xmalloc((size_t)sz + 1);
    assert_int_equal(fread(p, 1, (size_t)sz, f), (size_t)sz);
    fclose(f);
    *n = (size_t)sz;
    return p;
}

void tu_write_file(const char *dir, const char *path, const void *data, size_t n) {
    char full[512];
    if (dir) snprintf(full, sizeof full, "%s/%s", dir, path);
    else snprintf(full, sizeof full, "%s", path);
    FILE *f = fopen(full, "wb");
    assert_non_null(f);
    if (n) assert_int_equal(fwrite(data, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

void tu_sb_add(tu_sbuf *b, const void *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        b->cap = 2 * (b->n + n + 1);
        b->p = bt_xrealloc(b->p, b->cap);
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

void tu_sb_str(tu_sbuf *b, const char *s) { tu_sb_add(b, s, strlen(s)); }

void *tu_zstd_frame(const void *src, size_t n, size_t *zn) {
    size_t cap = ZSTD_compressBound(n);
    void *z = bt_xmalloc(cap);
    *zn = ZSTD_compress(z, cap, src, n, 3);
    assert_false(ZSTD_isError(*zn));
    return z;
}

char *tu_read_zst(const char *path, size_t *out_len) {
    size_t sz;
    char *src = (char *)tu_slurp(path, &sz);
    /* streaming: the zstd CLI writes no content size when reading a pipe */
    size_t cap = sz * 5 + 1024, n = 0;
    char *dst = bt_xmalloc(cap + 1);
    ZSTD_DStream *ds = ZSTD_createDStream();
    ZSTD_inBuffer in = {src, sz, 0};
    for (;;) {
        if (n == cap) {
            cap *= 2;
            dst = bt_xrealloc(dst, cap + 1);
        }
        ZSTD_outBuffer ob = {dst, cap, n};
        size_t r = ZSTD_decompressStream(ds, &ob, &in);
        if (ZSTD_isError(r)) fail_msg("%s: %s", path, ZSTD_getErrorName(r));
        n = ob.pos;
        if (r == 0 && in.pos == in.size) break;
        if (ob.pos < cap && in.pos == in.size) fail_msg("%s: truncated zstd data", path);
    }
    ZSTD_freeDStream(ds);
    dst[n] = 0;
    free(src);
    *out_len = n;
    return dst;
}

int tu_st_put_nan(const char *path, const char *name, size_t elem) {
    size_t n = 0;
    uint8_t *b = tu_slurp(path, &n);
    uint64_t hn;
    assert_true(n >= 8);
    memcpy(&hn, b, 8);
    assert_true(hn <= n - 8);
    json_error_t je;
    json_t *h = json_loadb((const char *)b + 8, (size_t)hn, 0, &je);
    assert_non_null(h);
    json_t *t = json_object_get(h, name);
    int done = 0;
    if (t) {
        const char *dt = json_string_value(json_object_get(t, "dtype"));
        json_t *off = json_object_get(t, "data_offsets");
        assert_non_null(dt);
        size_t es = !strcmp(dt, "F32") ? 4 : (!strcmp(dt, "F16") || !strcmp(dt, "BF16")) ? 2 : 0;
        assert_true(es > 0);
        size_t at = 8 + (size_t)hn + (size_t)json_integer_value(json_array_get(off, 0)) + elem * es;
        assert_true(at + es <= 8 + hn + (size_t)json_integer_value(json_array_get(off, 1)));
        uint32_t f32 = 0x7FC00000u;
        uint16_t f16 = !strcmp(dt, "F16") ? 0x7E00 : 0x7FC0;
        memcpy(b + at, es == 4 ? (const void *)&f32 : (const void *)&f16, es);
        FILE *f = fopen(path, "wb");
        assert_non_null(f);
        assert_int_equal(fwrite(b, 1, n, f), n);
        assert_int_equal(fclose(f), 0);
        done = 1;
    }
    json_decref(h);
    free(b);
    return done;
}

const void *tu_st_data(struct bt_st_file *f, const char *name, int dt, int64_t n) {
    const bt_st_tensor *t = bt_st_find(f, name);
    if (!t) fail_msg("fixture lacks %s", name);
    if ((int)t->dtype != dt || (n >= 0 && (int64_t)(t->nbytes / 4) != n))
        fail_msg("fixture %s: dtype %d, %zu bytes, want dtype %d with %lld elements", name,
                 (int)t->dtype, t->nbytes, dt, (long long)n);
    return t->data;
}

const char *tu_hf_fixdir(void) {
    const char *d = getenv("BT_HF_FIXTURES");
    return d && *d ? d : "tests/fixtures/hf";
}

struct bt_st_file *tu_fix_open(const char *fam, const char *rel) {
    char p[512];
    snprintf(p, sizeof p, "%s/%s/%s", tu_hf_fixdir(), fam, rel);
    bt_st_file *f = NULL;
    if (bt_st_open(&f, p)) fail_msg("cannot open fixture %s: %s", p, bt_last_error());
    return f;
}

double tu_max_abs_diff(const float *a, const float *b, int64_t n) {
    double d = 0;
    for (int64_t i = 0; i < n; i++) d = fmax(d, fabs((double)a[i] - b[i]));
    return d;
}

double tu_max_abs(const float *a, int64_t n) {
    double d = 0;
    for (int64_t i = 0; i < n; i++) d = fmax(d, fabs((double)a[i]));
    return d;
}
