/* Tests for common/gguf.c: the real SmolLM2 model ($BT_MODEL), writer round trip (every value
 * type, tensors, alignment, verbatim KV copy), and hostile inputs built in memory (truncation at
 * every prefix, lying lengths and counts, bad offsets/types/dims, random byte corruption). */
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
#include "common/gguf.h"
#include "common/quant.h"
#include "tests/unit/util/test_util.h"

static int str_eq(bt_str s, const char *c) {
    return s.len == strlen(c) && memcmp(s.ptr, c, s.len) == 0;
}

static char g_dir[64];

static int setup_dir(void **s) {
    (void)s;
    return tu_make_tmpdir(g_dir, sizeof g_dir, "gguf");
}

static int teardown_dir(void **s) {
    (void)s;
    return tu_remove_dir(g_dir);
}

/* ------------------------------------------------------------------ real model */

static void test_real_model(void **s) {
    (void)s;
    bt_gguf *g;
    int rc = bt_gguf_open(&g, tu_model_path());
    if (rc) fail_msg("open %s: %s", tu_model_path(), bt_last_error());
    assert_int_equal(bt_gguf_version(g), 3);
    assert_int_equal(bt_gguf_alignment(g), 32);
    assert_int_equal(bt_gguf_data_offset(g) % 32, 0);
    assert_int_equal(bt_gguf_n_tensors(g), 272);
    assert_true(bt_gguf_n_kv(g) > 20);

    uint64_t u;
    int64_t i64;
    double f;
    int b;
    bt_str str;
    assert_int_equal(bt_gguf_get_u64(g, "llama.block_count", &u), BT_OK);
    assert_int_equal(u, 30);
    assert_int_equal(bt_gguf_get_i64(g, "llama.embedding_length", &i64), BT_OK);
    assert_int_equal(i64, 576);
    assert_int_equal(bt_gguf_get_u64(g, "llama.attention.head_count_kv", &u), BT_OK);
    assert_int_equal(u, 3);
    assert_int_equal(bt_gguf_get_f64(g, "llama.attention.layer_norm_rms_epsilon", &f), BT_OK);
    assert_true(f > 0 && f < 1e-3);
    assert_int_equal(bt_gguf_get_str(g, "general.architecture", &str), BT_OK);
    assert_true(str_eq(str, "llama"));
    assert_int_equal(bt_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &b), BT_OK);
    assert_int_equal(bt_gguf_get_str(g, "tokenizer.ggml.model", &str), BT_OK);
    assert_true(str_eq(str, "gpt2"));

    /* errors: absent, wrong type, message names the key */
    assert_int_equal(bt_gguf_get_u64(g, "no.such.key", &u), BT_ERR_NOTFOUND);
    assert_non_null(strstr(bt_last_error(), "no.such.key"));
    assert_int_equal(bt_gguf_get_u64(g, "general.architecture", &u), BT_ERR_FORMAT);
    assert_non_null(strstr(bt_last_error(), "general.architecture"));
    assert_int_equal(bt_gguf_get_f64(g, "llama.block_count", &f), BT_ERR_FORMAT);
    assert_int_equal(bt_gguf_get_str(g, "llama.block_count", &str), BT_ERR_FORMAT);
    assert_int_equal(bt_gguf_get_bool(g, "llama.block_count", &b), BT_ERR_FORMAT);

    bt_str *toks;
    uint64_t n;
    assert_int_equal(bt_gguf_get_str_arr(g, "tokenizer.ggml.tokens", &toks, &n), BT_OK);
    assert_int_equal(n, 49152);
    assert_true(str_eq(toks[0], "<|endoftext|>"));
    free(toks);
    assert_int_equal(bt_gguf_get_str_arr(g, "tokenizer.ggml.token_type", &toks, &n),
                     BT_ERR_FORMAT);
    bt_gguf_vtype et;
    const void *data;
    assert_int_equal(bt_gguf_get_num_arr(g, "tokenizer.ggml.token_type", &et, &data, &n), BT_OK);
    assert_int_equal(et, BT_GGUF_I32);
    assert_int_equal(n, 49152);
    int32_t tt0;
    memcpy(&tt0, data, 4);
    assert_int_equal(tt0, 3); /* <|endoftext|> is a control token */
    assert_int_equal(bt_gguf_get_num_arr(g, "tokenizer.ggml.tokens", &et, &data, &n),
                     BT_ERR_FORMAT);

    int64_t ki = bt_gguf_find_key(g, "tokenizer.ggml.merges");
    assert_true(ki >= 0);
    assert_true(str_eq(bt_gguf_key_at(g, ki), "tokenizer.ggml.merges"));
    bt_gguf_vtype at;
    assert_int_equal(bt_gguf_kv_type(g, ki, &at, &n), BT_GGUF_ARRAY);
    assert_int_equal(at, BT_GGUF_STRING);
    assert_true(n > 40000);
    assert_int_equal(bt_gguf_find_key(g, "tokenizer.ggml"), -1);
    assert_null(bt_gguf_key_at(g, -1).ptr);
    assert_null(bt_gguf_key_at(g, 1000).ptr);

    const bt_gguf_tensor *te = bt_gguf_find_tensor(g, "token_embd.weight");
    assert_non_null(te);
    assert_int_equal(te->type, BT_GGML_Q8_0);
    assert_int_equal(te->n_dims, 2);
    assert_int_equal(te->ne[0], 576);
    assert_int_equal(te->ne[1], 49152);
    assert_int_equal(te->nbytes, (uint64_t)612 * 49152);
    const bt_gguf_tensor *tq = bt_gguf_find_tensor(g, "blk.0.attn_q.weight");
    assert_non_null(tq);
    assert_int_equal(tq->type, BT_GGML_Q4_1);
    assert_int_equal(tq->ne[0], 576);
    assert_int_equal(tq->ne[1], 576);
    assert_non_null(bt_gguf_find_tensor(g, "blk.29.ffn_down.weight"));
    assert_non_null(bt_gguf_find_tensor(g, "output_norm.weight"));
    assert_null(bt_gguf_find_tensor(g, "output.weight")); /* tied embeddings */
    assert_null(bt_gguf_find_tensor(g, "blk.30.ffn_down.weight"));
    assert_null(bt_gguf_tensor_at(g, 272));

    /* every tensor dequantises to finite values of plausible size */
    for (int64_t t = 0; t < bt_gguf_n_tensors(g); t += 17) {
        const bt_gguf_tensor *x = bt_gguf_tensor_at(g, t);
        int64_t cnt = (int64_t)x->ne[0] * (x->ne[1] < 64 ? (int64_t)x->ne[1] : 64);
        float *y = malloc((size_t)cnt * sizeof(float));
        assert_int_equal(bt_ggml_dequantize(x->type, x->data, y, cnt), BT_OK);
        double ss = 0, mx = 0;
        for (int64_t k = 0; k < cnt; k++) {
            assert_true(isfinite(y[k]));
            ss += (double)y[k] * y[k];
            mx = fmax(mx, fabs(y[k]));
        }
        double rms = sqrt(ss / (double)cnt);
        assert_true(rms > 1e-4 && rms < 10);
        assert_true(mx < 100);
        free(y);
    }
    /* embedding row of token 0, Q8_0: first element = qs[0] * d */
    float row[576];
    assert_int_equal(bt_ggml_dequantize(BT_GGML_Q8_0, te->data, row, 576), BT_OK);
    uint16_t dh;
    memcpy(&dh, te->data, 2);
    assert_true(row[0] == (float)((const int8_t *)te->data)[2] * bt_fp16_to_fp32(dh));
    bt_gguf_close(g);
}

/* ------------------------------------------------------------------ writer round trip */

static void test_writer_round_trip(void **s) {
    (void)s;
    bt_gguf *src;
    assert_int_equal(bt_gguf_open(&src, tu_model_path()), BT_OK);
    bt_gguf_writer *w = bt_gguf_writer_new();
    uint8_t u8 = 200;
    int8_t i8 = -100;
    uint16_t u16 = 60000;
    int16_t i16 = -30000;
    int64_t i64 = INT64_MIN;
    double f64 = 3.141592653589793;
    assert_int_equal(bt_gguf_w_scalar(w, "t.u8", BT_GGUF_U8, &u8), BT_OK);
    assert_int_equal(bt_gguf_w_scalar(w, "t.i8", BT_GGUF_I8, &i8), BT_OK);
    assert_int_equal(bt_gguf_w_scalar(w, "t.u16", BT_GGUF_U16, &u16), BT_OK);
    assert_int_equal(bt_gguf_w_scalar(w, "t.i16", BT_GGUF_I16, &i16), BT_OK);
    assert_int_equal(bt_gguf_w_u32(w, "t.u32", 4000000000u), BT_OK);
    assert_int_equal(bt_gguf_w_i32(w, "t.i32", -2000000000), BT_OK);
    assert_int_equal(bt_gguf_w_f32(w, "t.f32", 0.1f), BT_OK);
    assert_int_equal(bt_gguf_w_bool(w, "t.bool", 1), BT_OK);
    assert_int_equal(bt_gguf_w_str(w, "t.str", "h\0llo", 5), BT_OK);
    assert_int_equal(bt_gguf_w_str(w, "t.empty", NULL, 0), BT_OK);
    assert_int_equal(bt_gguf_w_u64(w, "t.u64", UINT64_MAX), BT_OK);
    assert_int_equal(bt_gguf_w_scalar(w, "t.i64", BT_GGUF_I64, &i64), BT_OK);
    assert_int_equal(bt_gguf_w_scalar(w, "t.f64", BT_GGUF_F64, &f64), BT_OK);
    bt_str sa[3] = {{"a", 1}, {"", 0}, {"ccc", 3}};
    assert_int_equal(bt_gguf_w_str_arr(w, "t.sarr", sa, 3), BT_OK);
    int32_t ia[4] = {1, -2, 3, -4};
    assert_int_equal(bt_gguf_w_num_arr(w, "t.iarr", BT_GGUF_I32, ia, 4), BT_OK);
    assert_int_equal(bt_gguf_w_num_arr(w, "t.earr", BT_GGUF_F64, NULL, 0), BT_OK);
    assert_int_equal(bt_gguf_w_u32(w, "general.alignment", 64), BT_OK);
    assert_int_equal(bt_gguf_w_copy_kv(w, src, "tokenizer.ggml.merges"), BT_OK);
    assert_int_equal(bt_gguf_w_copy_kv(w, src, "tokenizer.ggml.bos_token_id"), BT_OK);
    /* writer-side validation */
    assert_int_equal(bt_gguf_w_u32(w, "t.u32", 1), BT_ERR_INVALID);      /* duplicate */
    assert_int_equal(bt_gguf_w_u32(w, "", 1), BT_ERR_INVALID);
    assert_int_equal(bt_gguf_w_copy_kv(w, src, "nope"), BT_ERR_NOTFOUND);
    assert_int_equal(bt_gguf_w_num_arr(w, "t.bad", BT_GGUF_STRING, ia, 1), BT_ERR_INVALID);
    uint8_t two = 2;
    assert_int_equal(bt_gguf_w_scalar(w, "t.bad", BT_GGUF_BOOL, &two), BT_ERR_INVALID);

    float a[3 * 5];
    for (int i = 0; i < 15; i++) a[i] = (float)i * 0.5f - 3.0f;
    uint8_t q8[34 * 2 * 3];
    for (size_t i = 0; i < sizeof q8; i++) q8[i] = (uint8_t)(i * 37 + 11);
    for (int blk = 0; blk < 6; blk++) { /* finite fp16 scales */
        uint16_t d = bt_fp32_to_fp16(0.01f * (float)(blk + 1));
        memcpy(q8 + 34 * blk, &d, 2);
    }
    uint16_t h4[2 * 1 * 3 * 2];
    for (int i = 0; i < 12; i++) h4[i] = bt_fp32_to_fp16((float)i);
    uint64_t ne_a[2] = {5, 3}, ne_q[2] = {64, 3}, ne_h[4] = {2, 1, 3, 2}, ne_1[1] = {7};
    assert_int_equal(bt_gguf_w_tensor(w, "a.weight", BT_GGML_F32, 2, ne_a, a, sizeof a), BT_OK);
    assert_int_equal(bt_gguf_w_tensor(w, "q.weight", BT_GGML_Q8_0, 2, ne_q, q8, sizeof q8), BT_OK);
    assert_int_equal(bt_gguf_w_tensor(w, "h4", BT_GGML_F16, 4, ne_h, h4, sizeof h4), BT_OK);
    assert_int_equal(bt_gguf_w_tensor(w, "v", BT_GGML_F32, 1, ne_1, a, 28), BT_OK);
    /* bad tensors */
    assert_int_equal(bt_gguf_w_tensor(w, "a.weight", BT_GGML_F32, 2, ne_a, a, sizeof a),
                     BT_ERR_INVALID);
    assert_int_equal(bt_gguf_w_tensor(w, "x", BT_GGML_F32, 2, ne_a, a, 4), BT_ERR_INVALID);
    uint64_t ne_bad[2] = {31, 1};
    assert_int_equal(bt_gguf_w_tensor(w, "x", BT_GGML_Q8_0, 2, ne_bad, q8, 34), BT_ERR_INVALID);
    assert_int_equal(bt_gguf_w_tensor(w, "x", 4, 1, ne_1, a, 28), BT_ERR_UNSUPPORTED);
    assert_int_equal(bt_gguf_w_tensor(w, "x", BT_GGML_F32, 5, ne_h, a, 4), BT_ERR_INVALID);
    char path[128];
    snprintf(path, sizeof path, "%s/rt.gguf", g_dir);
    assert_int_equal(bt_gguf_writer_write(w, path), BT_OK);
    bt_gguf_writer_free(w);

    bt_gguf *g;
    int rc = bt_gguf_open(&g, path);
    if (rc) fail_msg("%s", bt_last_error());
    assert_int_equal(bt_gguf_alignment(g), 64);
    assert_int_equal(bt_gguf_n_kv(g), 19);
    assert_int_equal(bt_gguf_n_tensors(g), 4);
    uint64_t u;
    int64_t i;
    double f;
    int b;
    bt_str str;
    assert_int_equal(bt_gguf_get_u64(g, "t.u8", &u), BT_OK);
    assert_int_equal(u, 200);
    assert_int_equal(bt_gguf_get_i64(g, "t.i8", &i), BT_OK);
    assert_int_equal(i, -100);
    assert_int_equal(bt_gguf_get_u64(g, "t.i8", &u), BT_ERR_RANGE); /* negative */
    assert_int_equal(bt_gguf_get_u64(g, "t.u16", &u), BT_OK);
    assert_int_equal(u, 60000);
    assert_int_equal(bt_gguf_get_i64(g, "t.i16", &i), BT_OK);
    assert_int_equal(i, -30000);
    assert_int_equal(bt_gguf_get_u64(g, "t.u32", &u), BT_OK);
    assert_int_equal(u, 4000000000u);
    assert_int_equal(bt_gguf_get_i64(g, "t.i32", &i), BT_OK);
    assert_int_equal(i, -2000000000);
    assert_int_equal(bt_gguf_get_f64(g, "t.f32", &f), BT_OK);
    assert_true(f == (double)0.1f);
    assert_int_equal(bt_gguf_get_bool(g, "t.bool", &b), BT_OK);
    assert_int_equal(b, 1);
    assert_int_equal(bt_gguf_get_str(g, "t.str", &str), BT_OK);
    assert_int_equal(str.len, 5);
    assert_memory_equal(str.ptr, "h\0llo", 5);
    assert_int_equal(bt_gguf_get_str(g, "t.empty", &str), BT_OK);
    assert_int_equal(str.len, 0);
    assert_int_equal(bt_gguf_get_u64(g, "t.u64", &u), BT_OK);
    assert_true(u == UINT64_MAX);
    assert_int_equal(bt_gguf_get_i64(g, "t.u64", &i), BT_ERR_RANGE); /* does not fit */
    assert_int_equal(bt_gguf_get_i64(g, "t.i64", &i), BT_OK);
    assert_true(i == INT64_MIN);
    assert_int_equal(bt_gguf_get_f64(g, "t.f64", &f), BT_OK);
    assert_true(f == 3.141592653589793);
    bt_str *arr;
    uint64_t n;
    assert_int_equal(bt_gguf_get_str_arr(g, "t.sarr", &arr, &n), BT_OK);
    assert_int_equal(n, 3);
    assert_true(str_eq(arr[0], "a") && str_eq(arr[1], "") && str_eq(arr[2], "ccc"));
    free(arr);
    bt_gguf_vtype et;
    const void *data;
    assert_int_equal(bt_gguf_get_num_arr(g, "t.iarr", &et, &data, &n), BT_OK);
    assert_int_equal(et, BT_GGUF_I32);
    assert_int_equal(n, 4);
    assert_memory_equal(data, ia, sizeof ia);
    assert_int_equal(bt_gguf_get_num_arr(g, "t.earr", &et, &data, &n), BT_OK);
    assert_int_equal(n, 0);
    assert_int_equal(bt_gguf_get_u64(g, "tokenizer.ggml.bos_token_id", &u), BT_OK);
    /* the copied merges equal the source's */
    bt_str *m1, *m2;
    uint64_t n1, n2;
    assert_int_equal(bt_gguf_get_str_arr(src, "tokenizer.ggml.merges", &m1, &n1), BT_OK);
    assert_int_equal(bt_gguf_get_str_arr(g, "tokenizer.ggml.merges", &m2, &n2), BT_OK);
    assert_int_equal(n1, n2);
    for (uint64_t k = 0; k < n1; k++) {
        assert_int_equal(m1[k].len, m2[k].len);
        assert_memory_equal(m1[k].ptr, m2[k].ptr, m1[k].len);
    }
    free(m1);
    free(m2);
    /* tensors */
    const bt_gguf_tensor *t = bt_gguf_find_tensor(g, "a.weight");
    assert_non_null(t);
    assert_int_equal(t->type, BT_GGML_F32);
    assert_int_equal(t->n_dims, 2);
    assert_int_equal(t->ne[0], 5);
    assert_int_equal(t->ne[1], 3);
    assert_int_equal(t->ne[2], 1);
    assert_memory_equal(t->data, a, sizeof a);
    t = bt_gguf_find_tensor(g, "q.weight");
    assert_int_equal(t->type, BT_GGML_Q8_0);
    assert_int_equal(t->nbytes, sizeof q8);
    assert_memory_equal(t->data, q8, sizeof q8);
    assert_int_equal(t->offset % 64, 0);
    t = bt_gguf_find_tensor(g, "h4");
    assert_int_equal(t->n_dims, 4);
    assert_int_equal(t->ne[3], 2);
    assert_memory_equal(t->data, h4, sizeof h4);
    t = bt_gguf_find_tensor(g, "v");
    assert_int_equal(t->n_dims, 1);
    assert_memory_equal(t->data, a, 28);
    assert_int_equal(bt_gguf_data_offset(g) % 64, 0);
    bt_gguf_close(g);
    bt_gguf_close(src);
    assert_int_equal(access(path, F_OK), 0);
}

/* ------------------------------------------------------------------ hostile inputs */

/* A small valid file: 4 KVs, 3 tensors; the last tensor ends exactly at EOF (no padding), so
 * every proper prefix is invalid. */
static uint8_t *small_file(size_t *n) {
    bt_gguf_writer *w = bt_gguf_writer_new();
    assert_int_equal(bt_gguf_w_str(w, "general.architecture", "llama", 5), BT_OK);
    assert_int_equal(bt_gguf_w_u32(w, "test.a1", 7), BT_OK);
    assert_int_equal(bt_gguf_w_bool(w, "test.a2", 1), BT_OK);
    bt_str sa[2] = {{"xy", 2}, {"z", 1}};
    assert_int_equal(bt_gguf_w_str_arr(w, "test.arr", sa, 2), BT_OK);
    float x[16];
    for (int i = 0; i < 16; i++) x[i] = (float)i;
    uint8_t q[34] = {0};
    uint64_t ne_x[2] = {4, 2}, ne_q[1] = {32}, ne_y[1] = {8};
    assert_int_equal(bt_gguf_w_tensor(w, "x", BT_GGML_F32, 2, ne_x, x, 32), BT_OK);
    assert_int_equal(bt_gguf_w_tensor(w, "q", BT_GGML_Q8_0, 1, ne_q, q, 34), BT_OK);
    assert_int_equal(bt_gguf_w_tensor(w, "y", BT_GGML_F32, 1, ne_y, x, 32), BT_OK);
    char path[128];
    snprintf(path, sizeof path, "%s/small.gguf", g_dir);
    assert_int_equal(bt_gguf_writer_write(w, path), BT_OK);
    bt_gguf_writer_free(w);
    return tu_slurp(path, n);
}

/* Opens a private exact-size copy (so ASan sees any over-read); returns rc. */
static int try_open(const uint8_t *buf, size_t n) {
    uint8_t *copy = malloc(n ? n : 1);
    memcpy(copy, buf, n);
    bt_gguf *g = NULL;
    int rc = bt_gguf_open_buffer(&g, copy, n, "hostile");
    if (rc == BT_OK) {
        /* a parsed file must be fully usable */
        for (int64_t i = 0; i < bt_gguf_n_tensors(g); i++) {
            const bt_gguf_tensor *t = bt_gguf_tensor_at(g, i);
            volatile uint8_t sink = 0;
            for (uint64_t k = 0; k < t->nbytes; k++) sink ^= ((const uint8_t *)t->data)[k];
            (void)sink;
        }
        bt_gguf_close(g);
    } else {
        assert_null(g);
        assert_true(rc < 0);
        assert_true(strlen(bt_last_error()) > 0);
    }
    free(copy);
    return rc;
}

typedef struct {
    size_t name_len, ndims, dims, type, offset; /* byte offsets inside the file */
} tinfo;

static void locate(const uint8_t *buf, size_t n, tinfo ti[3], size_t *kv_a1_val) {
    bt_gguf *g;
    assert_int_equal(bt_gguf_open_buffer(&g, buf, n, "small"), BT_OK);
    assert_int_equal(bt_gguf_n_tensors(g), 3);
    for (int i = 0; i < 3; i++) {
        const bt_gguf_tensor *t = bt_gguf_tensor_at(g, i);
        size_t name = (size_t)((const uint8_t *)t->name.ptr - buf);
        ti[i].name_len = name - 8;
        ti[i].ndims = name + t->name.len;
        ti[i].dims = ti[i].ndims + 4;
        ti[i].type = ti[i].dims + 8 * t->n_dims;
        ti[i].offset = ti[i].type + 4;
    }
    bt_str k = bt_gguf_key_at(g, bt_gguf_find_key(g, "test.a1"));
    *kv_a1_val = (size_t)((const uint8_t *)k.ptr - buf) + k.len + 4;
    bt_gguf_close(g);
}

static void put32(uint8_t *b, size_t off, uint32_t v) { memcpy(b + off, &v, 4); }
static void put64(uint8_t *b, size_t off, uint64_t v) { memcpy(b + off, &v, 8); }

static void test_truncation(void **s) {
    (void)s;
    size_t n;
    uint8_t *buf = small_file(&n);
    assert_int_equal(try_open(buf, n), BT_OK);
    for (size_t len = 0; len < n; len++)
        if (try_open(buf, len) == BT_OK) fail_msg("prefix of %zu/%zu bytes was accepted", len, n);
    free(buf);
}

static void test_hostile_header(void **s) {
    (void)s;
    size_t n;
    uint8_t *buf = small_file(&n);
    uint8_t *b = malloc(n);
    tinfo ti[3];
    size_t a1;
    locate(buf, n, ti, &a1);
#define FRESH() memcpy(b, buf, n)
    FRESH(); b[0] = 'X';
    assert_int_equal(try_open(b, n), BT_ERR_FORMAT);
    assert_non_null(strstr(bt_last_error(), "magic"));
    FRESH(); put32(b, 4, 1);
    assert_int_equal(try_open(b, n), BT_ERR_UNSUPPORTED);
    FRESH(); put32(b, 4, 0x03000000u); /* big-endian */
    assert_int_equal(try_open(b, n), BT_ERR_UNSUPPORTED);
    FRESH(); put64(b, 8, (uint64_t)1 << 60); /* n_tensors */
    assert_int_equal(try_open(b, n), BT_ERR_FORMAT);
    FRESH(); put64(b, 16, (uint64_t)1 << 60); /* n_kv */
    assert_int_equal(try_open(b, n), BT_ERR_FORMAT);
    FRESH(); put64(b, 16, UINT64_MAX);
    assert_int_equal(try_open(b, n), BT_ERR_FORMAT);
    FRESH(); put64(b, 16, 5); /* one KV more than present: runs into the tensor infos */
    assert_true(try_open(b, n) < 0);
    /* lying string lengths: first key */
    FRESH(); put64(b, 24, UINT64_MAX);
    assert_int_equal(try_open(b, n), BT_ERR_FORMAT);
    FRESH(); put64(b, 24, n);
    assert_int_equal(try_open(b, n), BT_ERR_FORMAT);
    FRESH(); put64(b, 24, 0);
    assert_int_equal(try_open(b, n), BT_ERR_FORMAT);
    for (uint64_t d = 1; d < 40; d++) { /* off-by-d lengths desynchronise the parse */
        FRESH(); put64(b, 24, 20 + d);
        assert_true(try_open(b, n) < 0);
    }
    /* value type of test.a1 */
    FRESH(); put32(b, a1 - 4, 13);
    assert_int_equal(try_open(b, n), BT_ERR_FORMAT);
    FRESH(); put32(b, a1 - 4, 0xFFFFFFFFu);
    assert_int_equal(try_open(b, n), BT_ERR_FORMAT);
    /* bool value 2: test.a2 follows test.a1 (u32) as key len 8 + "test.a2" 7 + type 4 */
    FRESH(); b[a1 + 4 + 8 + 7 + 4] = 2;
    assert_int_equal(try_open(b, n), BT_ERR_FORMAT);
    /* array: element type and count of test.arr */
    size_t arr = a1 + 4 + 8 + 7 + 4 + 1 + 8 + 8 + 4; /* -> elem type */
    FRESH(); put64(b, arr + 4, (uint64_t)1 << 62);
    assert_int_equal(try_open(b, n), BT_ERR_FORMAT);
    FRESH(); put32(b, arr, 99);
    assert_int_equal(try_open(b, n), BT_ERR_FORMAT);
    FRESH(); put64(b, arr + 12, UINT64_MAX); /* first string length */
    assert_int_equal(try_open(b, n), BT_ERR_FORMAT);
    FRESH(); put32(b, arr, BT_GGUF_ARRAY); /* array of arrays: "xy" is no array header */
    assert_true(try_open(b, n) < 0);
    /* duplicate key: test.a2 -> test.a1 */
    FRESH(); b[a1 + 4 + 8 + 6] = '1';
    assert_int_equal(try_open(b, n), BT_ERR_FORMAT);
    assert_non_null(strstr(bt_last_error(), "duplicate"));
    free(b);
    free(buf);
#undef FRESH
}

static void test_hostile_tensors(void **s) {
    (void)s;
    size_t n;
    uint8_t *buf = small_file(&n);
    uint8_t *b = malloc(n);
    tinfo ti[3];
    size_t a1;
    locate(buf, n, ti, &a1);
    uint64_t off1;
    memcpy(&off1, buf + ti[1].offset, 8);
    assert_int_equal(off1, 32);
#define FRESH() memcpy(b, buf, n)
    FRESH(); put64(b, ti[1].offset, off1 + 1); /* misaligned */
    assert_int_equal(try_open(b, n), BT_ERR_FORMAT);
    assert_non_null(strstr(bt_last_error(), "'q'"));
    FRESH(); put64(b, ti[1].offset, 1 << 20); /* out of range */
    assert_int_equal(try_open(b, n), BT_ERR_RANGE);
    FRESH(); put64(b, ti[1].offset, UINT64_MAX - 31); /* offset + nbytes overflows */
    assert_int_equal(try_open(b, n), BT_ERR_RANGE);
    FRESH(); put64(b, ti[1].offset, 0); /* overlaps x */
    assert_int_equal(try_open(b, n), BT_ERR_FORMAT);
    assert_non_null(strstr(bt_last_error(), "overlap"));
    FRESH(); put32(b, ti[0].type, 4); /* removed ggml type */
    assert_int_equal(try_open(b, n), BT_ERR_UNSUPPORTED);
    FRESH(); put32(b, ti[0].type, 0xFFFFFFFFu);
    assert_int_equal(try_open(b, n), BT_ERR_UNSUPPORTED);
    FRESH(); put32(b, ti[0].type, BT_GGML_Q8_0); /* ne0 = 4 not a multiple of 32 */
    assert_int_equal(try_open(b, n), BT_ERR_FORMAT);
    FRESH(); put32(b, ti[0].ndims, 0);
    assert_int_equal(try_open(b, n), BT_ERR_FORMAT);
    FRESH(); put32(b, ti[0].ndims, 5);
    assert_int_equal(try_open(b, n), BT_ERR_FORMAT);
    FRESH(); put32(b, ti[0].ndims, 0xFFFFFFFFu);
    assert_int_equal(try_open(b, n), BT_ERR_FORMAT);
    FRESH(); put64(b, ti[0].dims, 0); /* zero dim */
    assert_int_equal(try_open(b, n), BT_ERR_FORMAT);
    FRESH(); put64(b, ti[0].dims, (uint64_t)1 << 60); /* huge: data out of range */
    assert_int_equal(try_open(b, n), BT_ERR_RANGE);
    FRESH(); put64(b, ti[0].dims, (uint64_t)1 << 62); put64(b, ti[0].dims + 8, 8);
    assert_int_equal(try_open(b, n), BT_ERR_FORMAT); /* element count overflows */
    FRESH(); put64(b, ti[0].dims + 8, 3); /* x grows into q */
    assert_int_equal(try_open(b, n), BT_ERR_FORMAT);
    FRESH(); put64(b, ti[0].name_len, 0);
    assert_int_equal(try_open(b, n), BT_ERR_FORMAT);
    FRESH(); put64(b, ti[0].name_len, UINT64_MAX);
    assert_int_equal(try_open(b, n), BT_ERR_FORMAT);
    FRESH(); b[ti[1].ndims - 1] = 'x'; /* duplicate tensor name */
    assert_int_equal(try_open(b, n), BT_ERR_FORMAT);
    assert_non_null(strstr(bt_last_error(), "duplicate"));
    free(b);
    free(buf);
#undef FRESH
}

static void test_alignment_key(void **s) {
    (void)s;
    /* general.alignment must be a u32 power of two */
    const uint32_t vals[] = {0, 3, 48};
    for (int v = 0; v < 4; v++) {
        bt_gguf_writer *w = bt_gguf_writer_new();
        if (v < 3) {
            assert_int_equal(bt_gguf_w_u32(w, "general.alignment", vals[v]), BT_ERR_INVALID);
            assert_int_equal(bt_gguf_w_u32(w, "general.alignmenx", vals[v]), BT_OK);
        } else {
            assert_int_equal(bt_gguf_w_i32(w, "general.alignment", 32), BT_ERR_INVALID);
            assert_int_equal(bt_gguf_w_i32(w, "general.alignmenx", 32), BT_OK);
        }
        char path[128];
        snprintf(path, sizeof path, "%s/al.gguf", g_dir);
        assert_int_equal(bt_gguf_writer_write(w, path), BT_OK);
        bt_gguf_writer_free(w);
        size_t n;
        uint8_t *buf = tu_slurp(path, &n);
        uint8_t *p = memmem(buf, n, "general.alignmenx", 17);
        assert_non_null(p);
        p[16] = 't';
        assert_int_equal(try_open(buf, n), BT_ERR_FORMAT);
        assert_non_null(strstr(bt_last_error(), "general.alignment"));
        free(buf);
    }
}

/* random corruption of the small file: must never crash (ASan/UBSan watch) */
static void test_random_corruption(void **s) {
    (void)s;
    size_t n;
    uint8_t *buf = small_file(&n);
    uint8_t *b = malloc(n);
    uint64_t x = 0x9E3779B97F4A7C15ull;
    int rejected = 0;
    for (int it = 0; it < 3000; it++) {
        memcpy(b, buf, n);
        int flips = 1 + it % 4;
        for (int f = 0; f < flips; f++) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            b[x % n] = (uint8_t)(x >> 32);
        }
        if (try_open(b, n) != BT_OK) rejected++;
    }
    assert_true(rejected > 100);
    free(b);
    free(buf);
}

static void test_open_errors(void **s) {
    (void)s;
    bt_gguf *g = (bt_gguf *)1;
    assert_int_equal(bt_gguf_open(&g, "/nonexistent/x.gguf"), BT_ERR_IO);
    assert_null(g);
    assert_int_equal(bt_gguf_open_buffer(&g, NULL, 0, NULL), BT_ERR_FORMAT);
    assert_int_equal(bt_gguf_open(&g, "/tmp"), BT_ERR_IO);
    /* minimal valid file: header only, no KVs, no tensors */
    uint8_t h[24] = {'G', 'G', 'U', 'F', 3, 0, 0, 0};
    assert_int_equal(bt_gguf_open_buffer(&g, h, sizeof h, "min"), BT_OK);
    assert_int_equal(bt_gguf_n_kv(g), 0);
    assert_int_equal(bt_gguf_n_tensors(g), 0);
    assert_null(bt_gguf_find_tensor(g, "x"));
    assert_int_equal(bt_gguf_find_key(g, "x"), -1);
    bt_gguf_close(g);
    h[4] = 2; /* v2 has the same layout */
    assert_int_equal(bt_gguf_open_buffer(&g, h, sizeof h, "v2"), BT_OK);
    assert_int_equal(bt_gguf_version(g), 2);
    bt_gguf_close(g);
}

/* No nan/inf ever reaches a file (issue 10 §4): float tensors element by element, block types
 * by their scales (bt_ggml_all_finite), refused by the writer naming the tensor. */
static void test_nonfinite_refused(void **s) {
    (void)s;
    bt_gguf_writer *w = bt_gguf_writer_new();
    float f[32];
    for (int i = 0; i < 32; i++) f[i] = (float)i;
    uint64_t ne[1] = {32};
    assert_int_equal(bt_gguf_w_tensor(w, "ok", BT_GGML_F32, 1, ne, f, sizeof f), BT_OK);
    f[31] = INFINITY;
    assert_int_equal(bt_gguf_w_tensor(w, "bad", BT_GGML_F32, 1, ne, f, sizeof f), BT_ERR_INVALID);
    assert_string_equal(bt_last_error(), "gguf writer: tensor 'bad' (F32) holds a non-finite value (at element "
                                         "31): refusing to write it");
    uint8_t q8[2 * 34];
    memset(q8, 1, sizeof q8);
    uint16_t d = bt_fp32_to_fp16(0.5f), nan16 = 0x7E00;
    memcpy(q8, &d, 2);
    memcpy(q8 + 34, &d, 2);
    uint64_t ne64[1] = {64};
    assert_int_equal(bt_gguf_w_tensor(w, "q_ok", BT_GGML_Q8_0, 1, ne64, q8, sizeof q8), BT_OK);
    memcpy(q8 + 34, &nan16, 2); /* the second block's scale */
    assert_int_equal(bt_gguf_w_tensor(w, "q_bad", BT_GGML_Q8_0, 1, ne64, q8, sizeof q8), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "(Q8_0) holds a non-finite value (at element 32)"));
    bt_gguf_writer_free(w);
    /* every block layout: a non-finite scale is found where ggml-common.h puts it */
    static const struct { int type; int off; } scales[] = {
        {BT_GGML_Q4_0, 0}, {BT_GGML_Q4_1, 2}, {BT_GGML_Q5_0, 0}, {BT_GGML_Q5_1, 2}, {BT_GGML_Q8_1, 2},
        {BT_GGML_Q2_K, 80}, {BT_GGML_Q2_K, 82}, {BT_GGML_Q3_K, 108}, {BT_GGML_Q4_K, 0}, {BT_GGML_Q4_K, 2},
        {BT_GGML_Q5_K, 2}, {BT_GGML_Q6_K, 208}};
    uint8_t blk[512];
    for (size_t k = 0; k < sizeof scales / sizeof scales[0]; k++) {
        size_t bb = bt_ggml_block_bytes(scales[k].type);
        memset(blk, 0, sizeof blk);
        int64_t at = -1;
        assert_int_equal(bt_ggml_all_finite(scales[k].type, blk, bb, &at), 1);
        memcpy(blk + scales[k].off, &nan16, 2);
        assert_int_equal(bt_ggml_all_finite(scales[k].type, blk, bb, &at), 0);
        assert_int_equal(at, 0);
    }
    float inf = INFINITY;
    memset(blk, 0, sizeof blk);
    memcpy(blk, &inf, 4);
    assert_int_equal(bt_ggml_all_finite(BT_GGML_Q8_K, blk, bt_ggml_block_bytes(BT_GGML_Q8_K), NULL), 0);
    assert_int_equal(bt_ggml_all_finite(BT_GGML_Q8_0, blk, 33, NULL), -1); /* not whole blocks */
    uint16_t bf[2] = {0x3F80, 0xFF80}; /* 1.0, -inf */
    assert_int_equal(bt_ggml_all_finite(BT_GGML_BF16, bf, 4, NULL), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_nonfinite_refused),
        cmocka_unit_test(test_real_model),
        cmocka_unit_test(test_writer_round_trip),
        cmocka_unit_test(test_truncation),
        cmocka_unit_test(test_hostile_header),
        cmocka_unit_test(test_hostile_tensors),
        cmocka_unit_test(test_alignment_key),
        cmocka_unit_test(test_random_corruption),
        cmocka_unit_test(test_open_errors),
    };
    return cmocka_run_group_tests(tests, setup_dir, teardown_dir);
}
