/* Tests for common/safetensors.c: writer/reader round trip (ordering, 8-byte header padding,
 * metadata, 0-dim and empty tensors), writer validation, and hostile headers / truncation. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "common/quant.h"
#include "common/safetensors.h"
#include "tests/unit/util/test_util.h"

static char g_dir[64];

static int setup_dir(void **s) {
    (void)s;
    return tu_make_tmpdir(g_dir, sizeof g_dir, "st");
}

static int teardown_dir(void **s) {
    (void)s;
    return tu_remove_dir(g_dir);
}

static void path_of(char *out, size_t n, const char *name) { snprintf(out, n, "%s/%s", g_dir, name); }

/* writes u64(len(json)) + json + data_len bytes (0,1,2,...) */
static void write_raw(const char *path, const char *json, size_t data_len) {
    size_t jl = strlen(json);
    uint8_t *b = malloc(8 + jl + data_len + 1);
    uint64_t h = jl;
    memcpy(b, &h, 8);
    memcpy(b + 8, json, jl);
    for (size_t i = 0; i < data_len; i++) b[8 + jl + i] = (uint8_t)i;
    tu_write_file(NULL, path, b, 8 + jl + data_len);
    free(b);
}

static int open_raw(const char *json, size_t data_len) {
    char p[128];
    path_of(p, sizeof p, "raw.safetensors");
    write_raw(p, json, data_len);
    bt_st_file *f = (bt_st_file *)1;
    int rc = bt_st_open(&f, p);
    if (rc == BT_OK) bt_st_close(f);
    else {
        assert_null(f);
        assert_true(strlen(bt_last_error()) > 0);
    }
    return rc;
}

static void test_dtypes(void **s) {
    (void)s;
    assert_string_equal(bt_st_dtype_name(BT_ST_BF16), "BF16");
    assert_string_equal(bt_st_dtype_name(BT_ST_U64), "U64");
    assert_string_equal(bt_st_dtype_name((bt_st_dtype)99), "?");
    assert_int_equal(bt_st_dtype_size(BT_ST_F32), 4);
    assert_int_equal(bt_st_dtype_size(BT_ST_BOOL), 1);
    assert_int_equal(bt_st_dtype_size(BT_ST_I64), 8);
    assert_int_equal(bt_st_dtype_size((bt_st_dtype)-1), 0);
    bt_st_dtype d;
    assert_int_equal(bt_st_dtype_from_name("I16", &d), BT_OK);
    assert_int_equal(d, BT_ST_I16);
    assert_int_equal(bt_st_dtype_from_name("F8_E4M3", &d), BT_ERR_UNSUPPORTED);
    assert_int_equal(bt_st_dtype_from_name("f32", &d), BT_ERR_UNSUPPORTED);
}

static void test_round_trip(void **s) {
    (void)s;
    bt_st_writer *w = bt_st_writer_new();
    assert_non_null(w);
    float a[6] = {1, 2, 3, 4, 5, 6};
    uint16_t bf[4] = {0x3F80, 0x4000, 0xBF80, 0x0000};
    uint16_t hf[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    int64_t sc = -42;
    int64_t sh_a[2] = {2, 3}, sh_bf[1] = {4}, sh_hf[3] = {2, 2, 2}, sh_e[1] = {0};
    assert_int_equal(bt_st_w_metadata(w, "format", "pt"), BT_OK);
    assert_int_equal(bt_st_w_metadata(w, "note", "ünïcode"), BT_OK);
    assert_int_equal(bt_st_w_tensor(w, "z.lora_B.weight", BT_ST_F32, 2, sh_a, a, sizeof a), BT_OK);
    assert_int_equal(bt_st_w_tensor(w, "b.bf", BT_ST_BF16, 1, sh_bf, bf, sizeof bf), BT_OK);
    assert_int_equal(bt_st_w_tensor(w, "a.hf", BT_ST_F16, 3, sh_hf, hf, sizeof hf), BT_OK);
    assert_int_equal(bt_st_w_tensor(w, "scalar", BT_ST_I64, 0, NULL, &sc, 8), BT_OK);
    assert_int_equal(bt_st_w_tensor(w, "empty", BT_ST_U8, 1, sh_e, NULL, 0), BT_OK);
    /* writer validation */
    assert_int_equal(bt_st_w_tensor(w, "b.bf", BT_ST_BF16, 1, sh_bf, bf, sizeof bf),
                     BT_ERR_INVALID);
    assert_int_equal(bt_st_w_tensor(w, "x", BT_ST_BF16, 1, sh_bf, bf, 6), BT_ERR_INVALID);
    int64_t neg[1] = {-1};
    assert_int_equal(bt_st_w_tensor(w, "x", BT_ST_U8, 1, neg, bf, 0), BT_ERR_INVALID);
    assert_int_equal(bt_st_w_tensor(w, "x", (bt_st_dtype)77, 1, sh_bf, bf, 8), BT_ERR_INVALID);
    assert_int_equal(bt_st_w_tensor(w, "__metadata__", BT_ST_U8, 1, sh_e, NULL, 0),
                     BT_ERR_INVALID);
    assert_int_equal(bt_st_w_tensor(w, "x", BT_ST_U8, 9, sh_hf, bf, 8), BT_ERR_INVALID);
    assert_int_equal(bt_st_w_tensor(w, "bad\xff", BT_ST_U8, 1, sh_e, NULL, 0), BT_ERR_INVALID);
    assert_int_equal(bt_st_w_metadata(w, "format", "np"), BT_ERR_INVALID);
    char p[128];
    path_of(p, sizeof p, "rt.safetensors");
    assert_int_equal(bt_st_writer_write(w, p), BT_OK);
    bt_st_writer_free(w);

    size_t n;
    uint8_t *raw = tu_slurp(p, &n);
    uint64_t hn;
    memcpy(&hn, raw, 8);
    assert_int_equal(hn % 8, 0);
    assert_int_equal(n, 8 + hn + 8 + sizeof a + sizeof bf + sizeof hf);
    assert_int_equal(raw[8], '{');
    free(raw);

    bt_st_file *f;
    int rc = bt_st_open(&f, p);
    if (rc) fail_msg("%s", bt_last_error());
    assert_int_equal(bt_st_n_tensors(f), 5);
    assert_string_equal(bt_st_metadata(f, "format"), "pt");
    assert_string_equal(bt_st_metadata(f, "note"), "ünïcode");
    assert_null(bt_st_metadata(f, "nope"));
    /* file order: descending dtype size, then name */
    const char *order[5] = {"scalar", "z.lora_B.weight", "a.hf", "b.bf", "empty"};
    for (int i = 0; i < 5; i++) assert_string_equal(bt_st_tensor_at(f, i)->name, order[i]);
    assert_null(bt_st_tensor_at(f, 5));
    assert_null(bt_st_tensor_at(f, -1));
    const bt_st_tensor *t = bt_st_find(f, "z.lora_B.weight");
    assert_non_null(t);
    assert_int_equal(t->dtype, BT_ST_F32);
    assert_int_equal(t->n_dims, 2);
    assert_int_equal(t->shape[0], 2);
    assert_int_equal(t->shape[1], 3);
    assert_int_equal(t->nbytes, sizeof a);
    assert_memory_equal(t->data, a, sizeof a);
    assert_int_equal(((uintptr_t)t->data) % 4, 0); /* padded header keeps data aligned */
    t = bt_st_find(f, "b.bf");
    assert_memory_equal(t->data, bf, sizeof bf);
    t = bt_st_find(f, "a.hf");
    assert_int_equal(t->n_dims, 3);
    assert_memory_equal(t->data, hf, sizeof hf);
    t = bt_st_find(f, "scalar");
    assert_int_equal(t->n_dims, 0);
    assert_int_equal(t->nbytes, 8);
    assert_memory_equal(t->data, &sc, 8);
    t = bt_st_find(f, "empty");
    assert_int_equal(t->nbytes, 0);
    assert_int_equal(t->shape[0], 0);
    assert_null(bt_st_find(f, "zz"));
    assert_null(bt_st_find(f, ""));
    bt_st_close(f);

    /* writing again over the same path replaces it atomically; no temp files left behind */
    w = bt_st_writer_new();
    assert_int_equal(bt_st_w_tensor(w, "only", BT_ST_F32, 1, (int64_t[]){1}, a, 4), BT_OK);
    assert_int_equal(bt_st_writer_write(w, p), BT_OK);
    bt_st_writer_free(w);
    assert_int_equal(bt_st_open(&f, p), BT_OK);
    assert_int_equal(bt_st_n_tensors(f), 1);
    assert_null(bt_st_metadata(f, "format"));
    bt_st_close(f);
    char cmd[256];
    snprintf(cmd, sizeof cmd, "ls '%s' | grep -q tmp", g_dir);
    assert_int_not_equal(system(cmd), 0);
    /* unwritable destination */
    w = bt_st_writer_new();
    assert_int_equal(bt_st_writer_write(w, "/nonexistent/dir/x.safetensors"), BT_ERR_IO);
    bt_st_writer_free(w);
}

static void test_hostile(void **s) {
    (void)s;
    const char *ok = "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}";
    assert_int_equal(open_raw(ok, 8), BT_OK);
    assert_int_equal(open_raw(ok, 7), BT_ERR_RANGE);   /* buffer too short */
    assert_int_equal(open_raw(ok, 9), BT_ERR_FORMAT);  /* trailing bytes */
    assert_int_equal(open_raw("{}", 0), BT_OK);
    assert_int_equal(open_raw("{}", 1), BT_ERR_FORMAT);
    assert_int_equal(open_raw("[]", 0), BT_ERR_FORMAT);
    assert_int_equal(open_raw("{\"a\":", 0), BT_ERR_FORMAT);
    assert_int_equal(open_raw("{\"a\":1}", 0), BT_ERR_FORMAT);
    assert_int_equal(open_raw("{\"a\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4), BT_ERR_FORMAT);
    assert_int_equal(open_raw("{\"a\":{\"dtype\":\"F8_E4M3\",\"shape\":[1],"
                              "\"data_offsets\":[0,1]}}", 1), BT_ERR_UNSUPPORTED);
    assert_int_equal(open_raw("{\"a\":{\"dtype\":7,\"shape\":[1],\"data_offsets\":[0,1]}}", 1),
                     BT_ERR_FORMAT);
    assert_int_equal(open_raw("{\"a\":{\"dtype\":\"U8\",\"shape\":[-1],\"data_offsets\":[0,1]}}", 1),
                     BT_ERR_FORMAT);
    assert_int_equal(open_raw("{\"a\":{\"dtype\":\"U8\",\"shape\":[\"1\"],"
                              "\"data_offsets\":[0,1]}}", 1), BT_ERR_FORMAT);
    assert_int_equal(open_raw("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0]}}", 1),
                     BT_ERR_FORMAT);
    assert_int_equal(open_raw("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,0]}}", 1),
                     BT_ERR_FORMAT);
    assert_int_equal(open_raw("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],"
                              "\"data_offsets\":[0,18446744073709551615]}}", 1), BT_ERR_FORMAT);
    assert_int_equal(open_raw("{\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,1]}}", 1),
                     BT_ERR_FORMAT); /* size mismatch */
    assert_int_equal(open_raw("{\"a\":{\"dtype\":\"U8\",\"shape\":[4611686018427387904,8],"
                              "\"data_offsets\":[0,1]}}", 1), BT_ERR_FORMAT); /* overflow */
    assert_int_equal(open_raw("{\"a\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,1],"
                              "\"data_offsets\":[0,1]}}", 1), BT_ERR_UNSUPPORTED);
    /* overlap, gap, duplicate */
    assert_int_equal(open_raw("{\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]},"
                              "\"b\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[1,3]}}", 3),
                     BT_ERR_FORMAT);
    assert_int_equal(open_raw("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
                              "\"b\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[2,3]}}", 3),
                     BT_ERR_FORMAT);
    assert_int_equal(open_raw("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
                              "\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}", 2),
                     BT_ERR_FORMAT);
    assert_int_equal(open_raw("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
                              "\"b\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1),
                     BT_ERR_FORMAT);
    assert_int_equal(open_raw("{\"__metadata__\":{\"k\":1}}", 0), BT_ERR_FORMAT);
    assert_int_equal(open_raw("{\"__metadata__\":[]}", 0), BT_ERR_FORMAT);
    assert_int_equal(open_raw("{\"__metadata__\":{\"k\":\"v\"}}", 0), BT_OK);

    /* header length lies */
    char p[128];
    path_of(p, sizeof p, "lie.safetensors");
    uint8_t b[16] = {0};
    uint64_t big = (uint64_t)1 << 63;
    memcpy(b, &big, 8);
    tu_write_file(NULL, p, b, 16);
    bt_st_file *f;
    assert_int_equal(bt_st_open(&f, p), BT_ERR_FORMAT);
    big = 9;
    memcpy(b, &big, 8);
    tu_write_file(NULL, p, b, 16);
    assert_int_equal(bt_st_open(&f, p), BT_ERR_FORMAT);
    tu_write_file(NULL, p, b, 5);
    assert_int_equal(bt_st_open(&f, p), BT_ERR_FORMAT);
    tu_write_file(NULL, p, b, 0);
    assert_int_equal(bt_st_open(&f, p), BT_ERR_FORMAT);
    assert_int_equal(bt_st_open(&f, "/nonexistent.safetensors"), BT_ERR_IO);
}

/* every proper prefix of a valid file is rejected */
static void test_truncation(void **s) {
    (void)s;
    bt_st_writer *w = bt_st_writer_new();
    float a[5] = {1, 2, 3, 4, 5};
    assert_int_equal(bt_st_w_metadata(w, "format", "pt"), BT_OK);
    assert_int_equal(bt_st_w_tensor(w, "a", BT_ST_F32, 1, (int64_t[]){5}, a, sizeof a), BT_OK);
    assert_int_equal(bt_st_w_tensor(w, "b", BT_ST_U8, 2, (int64_t[]){1, 3}, a, 3), BT_OK);
    char p[128], q[128];
    path_of(p, sizeof p, "full.safetensors");
    path_of(q, sizeof q, "cut.safetensors");
    assert_int_equal(bt_st_writer_write(w, p), BT_OK);
    bt_st_writer_free(w);
    size_t n;
    uint8_t *raw = tu_slurp(p, &n);
    for (size_t len = 0; len < n; len++) {
        tu_write_file(NULL, q, raw, len);
        bt_st_file *f;
        int rc = bt_st_open(&f, q);
        if (rc == BT_OK) fail_msg("prefix %zu/%zu accepted", len, n);
    }
    free(raw);
}

/* No nan/inf ever reaches a file (issue 10 §4): the writer refuses the tensor, naming it and
 * the first offending element, for every float dtype; the file on disk is untouched. */
static void test_nonfinite_refused(void **s) {
    (void)s;
    char p[128];
    path_of(p, sizeof p, "nf.safetensors");
    tu_write_file(NULL, p, "previous", 8);
    bt_st_writer *w = bt_st_writer_new();
    float f[4] = {1, 2, 3, 4};
    int64_t sh[1] = {4};
    assert_int_equal(bt_st_w_tensor(w, "ok", BT_ST_F32, 1, sh, f, sizeof f), BT_OK);
    f[2] = NAN;
    assert_int_equal(bt_st_w_tensor(w, "lora_B", BT_ST_F32, 1, sh, f, sizeof f), BT_ERR_INVALID);
    assert_string_equal(bt_last_error(), "safetensors writer: tensor 'lora_B' (F32) holds a non-finite value (at "
                                         "element 2): refusing to write it");
    f[2] = -INFINITY;
    assert_int_equal(bt_st_w_tensor(w, "inf", BT_ST_F32, 1, sh, f, sizeof f), BT_ERR_INVALID);
    uint16_t h[4] = {bt_fp32_to_fp16(1.f), bt_fp32_to_fp16(70000.f) /* overflows to inf */, 0, 0};
    assert_int_equal(bt_st_w_tensor(w, "h", BT_ST_F16, 1, sh, h, sizeof h), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "element 1"));
    uint16_t b[4] = {0, 0, 0, bt_fp32_to_bf16(NAN)};
    assert_int_equal(bt_st_w_tensor(w, "b", BT_ST_BF16, 1, sh, b, sizeof b), BT_ERR_INVALID);
    double d[4] = {0, NAN, 0, 0};
    assert_int_equal(bt_st_w_tensor(w, "d", BT_ST_F64, 1, sh, d, sizeof d), BT_ERR_INVALID);
    int32_t i[4] = {-1, 0x7F800000, 0x7FC00000, 3}; /* integers: any bits are fine */
    assert_int_equal(bt_st_w_tensor(w, "i", BT_ST_I32, 1, sh, i, sizeof i), BT_OK);
    uint16_t hb[4] = {bt_fp32_to_fp16(65504.f), bt_fp32_to_fp16(-0.f), 1, 0x7BFF}; /* max, -0, subnormal */
    assert_int_equal(bt_st_w_tensor(w, "edge", BT_ST_F16, 1, sh, hb, sizeof hb), BT_OK);
    bt_st_writer_free(w);
    size_t n;
    uint8_t *raw = tu_slurp(p, &n);
    assert_int_equal(n, 8);
    free(raw);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_nonfinite_refused),
        cmocka_unit_test(test_dtypes),
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_hostile),
        cmocka_unit_test(test_truncation),
    };
    return cmocka_run_group_tests(tests, setup_dir, teardown_dir);
}
