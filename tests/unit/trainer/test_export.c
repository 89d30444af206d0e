/* Exports (trainer/io/export.h) on a tiny random Llama with a random non-zero LoRA:
 *  - Q8_0 quantiser: ggml quantize_row_q8_0_ref semantics (halves away from zero, fp16 d, zero
 *    blocks), round trip through common/quant.h.
 *  - merged GGUF (F32 / F16 / Q8_0) read back by bt_model_load_gguf: weights equal the
 *    independently merged W + (alpha/r) B A (after the type's rounding), tensor types, KVs copied
 *    from the base, and the loss equals base + adapter in the trainer's forward.
 *  - GGUF LoRA: KVs, names, ne, types; un-permuting lora_b gives B back; and llama.cpp's
 *    arithmetic W_gguf + scale * lora_b @ lora_a reproduces the merged GGUF tensor.
 *  - merged safetensors: names, shapes, dtypes, values; config.json.
 *  - PEFT: our writer's output against an independent schema check; the loader on it, on a
 *    real PEFT 0.13.2 adapter (tests/fixtures/hf/lora/adapter-init), and on broken adapters.
 *  - bt_export_run / bt_export_main on files.
 *  - Gemma 3's merged GGUF and safetensors read back as the same model; its GGUF refusals. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <ftw.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "common/gguf.h"
#include "common/quant.h"
#include "common/safetensors.h"
#include "trainer/io/adapter.h"
#include "trainer/io/adapter_load.h"
#include "trainer/io/export.h"
#include "trainer/model/rng.h"
#include "trainer/loop/step.h"
#include "tests/unit/util/test_util.h"

static const bt_llama_hparams k_hp = {.n_layer = 2, .d_model = 64, .n_head = 4, .n_kv_head = 2,
                                      .head_dim = 16, .d_ff = 128, .vocab = 96, .ctx = 128,
                                      .rope_theta = 10000.f, .rms_eps = 1e-5f};
static const char *const k_lin[BT_MOD_N] = {"attn_q", "attn_k", "attn_v", "attn_output",
                                            "ffn_gate", "ffn_up", "ffn_down"};
enum { R = 4 };
static const float ALPHA = 8.f;

static char g_dir[64];

static int rm_cb(const char *p, const struct stat *sb, int tf, struct FTW *fw) {
    (void)sb, (void)fw;
    return tf == FTW_DP ? rmdir(p) : unlink(p);
}

static int setup(void **st) {
    (void)st;
    strcpy(g_dir, "/tmp/bt_test_export_XXXXXX");
    return mkdtemp(g_dir) ? 0 : -1;
}
static int teardown(void **st) {
    (void)st;
    nftw(g_dir, rm_cb, 16, FTW_DEPTH | FTW_PHYS);
    return 0;
}

static char *tpath(const char *name) {
    static char buf[4][256];
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "%s/%s", g_dir, name);
    return buf[k];
}

/* Random model (fp32) and a LoRA on all 7 modules with random non-zero A and B. */
static void make_rig(bt_model *m, bt_lora *lo, int tied, uint64_t seed) {
    assert_int_equal(bt_model_init_random(m, &k_hp, BT_BASE_FP32, tied, seed), 0);
    assert_int_equal(bt_lora_init(lo, m, R, ALPHA, 0.0, (1u << BT_MOD_N) - 1, 0, seed + 1), 0);
    bt_rng r;
    bt_rng_seed(&r, seed + 2);
    for (int l = 0; l < lo->n_layer; l++)
        for (int mod = 0; mod < BT_MOD_N; mod++) {
            bt_lora_mod *md = &lo->mods[l * BT_MOD_N + mod];
            for (int i = 0; i < md->out * R; i++) md->B[i] = 0.3f * bt_rng_normal(&r);
        }
}

/* Independent merge in double: W + (alpha / r) B A. */
static void ref_merge(const bt_model *m, const bt_lora *lo, int l, int mod, float *out) {
    const bt_base_linear *b = &m->layers[l].lin[mod];
    const bt_lora_mod *md = bt_lora_get(lo, l, mod);
    for (int o = 0; o < b->rows; o++)
        for (int c = 0; c < b->cols; c++) {
            double s = 0;
            for (int k = 0; k < R; k++) s += (double)md->B[o * R + k] * md->A[k * b->cols + c];
            out[(size_t)o * b->cols + c] = (float)(b->w[(size_t)o * b->cols + c] + (double)ALPHA / R * s);
        }
}

/* GGUF row -> HF row: gguf row h*hd + 2i + j holds HF row h*hd + j*hd/2 + i. */
static void ref_unpermute(float *hf, const float *gg, int nh, int rows, int cols) {
    int hd = rows / nh, half = hd / 2;
    for (int h = 0; h < nh; h++)
        for (int i = 0; i < half; i++)
            for (int j = 0; j < 2; j++)
                memcpy(hf + ((size_t)h * hd + j * half + i) * cols, gg + ((size_t)h * hd + 2 * i + j) * cols,
                       (size_t)cols * 4);
}

/* A KV-only "base" GGUF carrying tokenizer keys and a stale llama.block_count (must not be copied
 * over the model's own). */
static bt_gguf *kv_base(void) {
    bt_gguf_writer *w = bt_gguf_writer_new();
    assert_int_equal(bt_gguf_w_str(w, "general.architecture", "llama", 5), 0);
    assert_int_equal(bt_gguf_w_str(w, "general.name", "tiny base", 9), 0);
    assert_int_equal(bt_gguf_w_u32(w, "llama.block_count", 99), 0);
    assert_int_equal(bt_gguf_w_u32(w, "general.file_type", 3), 0);
    assert_int_equal(bt_gguf_w_str(w, "tokenizer.ggml.model", "gpt2", 4), 0);
    bt_str toks[3] = {{"<s>", 3}, {"a", 1}, {"b", 1}};
    assert_int_equal(bt_gguf_w_str_arr(w, "tokenizer.ggml.tokens", toks, 3), 0);
    assert_int_equal(bt_gguf_w_u32(w, "tokenizer.ggml.bos_token_id", 1), 0);
    assert_int_equal(bt_gguf_w_u32(w, "tokenizer.ggml.eos_token_id", 2), 0);
    assert_int_equal(bt_gguf_writer_write(w, tpath("kvbase.gguf")), 0);
    bt_gguf_writer_free(w);
    bt_gguf *g = NULL;
    assert_int_equal(bt_gguf_open(&g, tpath("kvbase.gguf")), 0);
    return g;
}

/* Loss sum over a fixed 2 x 12 batch. lo may be NULL. Tolerances used with it (relative, measured
 * on this rig: F32 ~1e-8, F16 ~3e-6 (GGUF) / 2e-5 (safetensors), BF16 ~5e-5, Q8_0 ~6e-5):
 * F32 1e-6, F16 1e-4 / 2e-4, BF16 1e-3, Q8_0 2e-3; the adapter itself moves the loss by ~10%. */
static double loss_of(const bt_model *m, bt_lora *lo) {
    enum { T = 12, M = 24 };
    int32_t ids[M], pos[M], cu[3] = {0, T, M};
    bt_rng r;
    bt_rng_seed(&r, 77);
    for (int i = 0; i < M; i++) ids[i] = (int32_t)(bt_rng_next(&r) % (uint64_t)k_hp.vocab), pos[i] = i % T;
    bt_microbatch mb = {2, T, ids, ids, pos, cu, 3};
    bt_step_ctx *c = NULL;
    assert_int_equal(bt_step_ctx_new(&c, m, lo, M, 0), 0);
    double s = 0;
    int nv = 0;
    assert_int_equal(bt_forward_backward(c, m, lo, &mb, 0, 1.f, 0, &s, &nv), 0);
    assert_int_equal(nv, 2 * (T - 1));
    bt_step_ctx_free(c);
    return s;
}

/* ---- Q8_0 ---- */

static void test_q8_0(void **st) {
    (void)st;
    float x[64];
    for (int i = 0; i < 32; i++) x[i] = 0;
    x[0] = 127.f, x[1] = 0.5f, x[2] = -0.5f, x[3] = 2.5f, x[4] = -2.5f, x[5] = -127.f, x[6] = 3.49f;
    for (int i = 32; i < 64; i++) x[i] = 0.f; /* all-zero block: d = 0, q = 0 */
    uint8_t q[68];
    assert_int_equal(bt_q8_0_quantize(x, q, 64), 0);
    uint16_t d;
    memcpy(&d, q, 2);
    assert_int_equal(d, 0x3C00); /* fp16 1.0 */
    int8_t *qs = (int8_t *)(q + 2);
    assert_int_equal(qs[0], 127);
    assert_int_equal(qs[1], 1);   /* roundf: halves away from zero (rint would give 0) */
    assert_int_equal(qs[2], -1);
    assert_int_equal(qs[3], 3);   /* rint would give 2 */
    assert_int_equal(qs[4], -3);
    assert_int_equal(qs[5], -127);
    assert_int_equal(qs[6], 3);
    memcpy(&d, q + 34, 2);
    assert_int_equal(d, 0);
    for (int j = 0; j < 32; j++) assert_int_equal(q[36 + j], 0);
    assert_int_equal(bt_q8_0_quantize(x, q, 33), BT_ERR_INVALID);
    /* random data: dequantised error <= d/2 (+ fp16 rounding of d) */
    enum { N = 32 * 40 };
    float *y = malloc(N * 4), *z = malloc(N * 4);
    uint8_t *b = malloc(N / 32 * 34);
    bt_rng r;
    bt_rng_seed(&r, 3);
    for (int i = 0; i < N; i++) y[i] = bt_rng_normal(&r) * (float)(1 + i / 32);
    assert_int_equal(bt_q8_0_quantize(y, b, N), 0);
    assert_int_equal(bt_ggml_dequantize(BT_GGML_Q8_0, b, z, N), 0);
    for (int blk = 0; blk < N / 32; blk++) {
        float amax = 0;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(y[blk * 32 + j]));
        for (int j = 0; j < 32; j++)
            assert_true(fabsf(z[blk * 32 + j] - y[blk * 32 + j]) <= amax / 127.f * 0.5f + amax * 1e-3f);
    }
    free(y), free(z), free(b);
}

static void test_permute(void **st) {
    (void)st;
    float src[8], dst[8];
    for (int i = 0; i < 8; i++) src[i] = (float)i;
    assert_int_equal(bt_export_permute_rows(dst, src, 2, 8, 1), 0);
    const float want[8] = {0, 2, 1, 3, 4, 6, 5, 7}; /* reshape(2,2,2).swapaxes(1,2) */
    for (int i = 0; i < 8; i++) assert_true(dst[i] == want[i]);
    assert_int_equal(bt_export_permute_rows(dst, src, 3, 8, 1), BT_ERR_INVALID);
}

/* ---- merged GGUF ---- */

static void check_merged_gguf(int dtype, double loss_tol) {
    bt_model m, m2;
    bt_lora lo;
    make_rig(&m, &lo, 0, 11);
    bt_gguf *base = kv_base();
    char *out = tpath("merged.gguf");
    assert_int_equal(bt_export_gguf_merged(&m, &lo, base, dtype, out), 0);
    bt_gguf_close(base);

    /* types and KVs */
    bt_gguf *g = NULL;
    assert_int_equal(bt_gguf_open(&g, out), 0);
    int mat = dtype == BT_EXPORT_F32 ? BT_GGML_F32 : dtype == BT_EXPORT_F16 ? BT_GGML_F16 : BT_GGML_Q8_0;
    assert_int_equal(bt_gguf_find_tensor(g, "token_embd.weight")->type, mat);
    assert_int_equal(bt_gguf_find_tensor(g, "output.weight")->type, mat);
    assert_int_equal(bt_gguf_find_tensor(g, "blk.1.ffn_down.weight")->type, mat);
    assert_int_equal(bt_gguf_find_tensor(g, "blk.1.attn_norm.weight")->type, BT_GGML_F32);
    assert_int_equal(bt_gguf_find_tensor(g, "output_norm.weight")->type, BT_GGML_F32);
    assert_int_equal(bt_gguf_n_tensors(g), 3 + k_hp.n_layer * 9);
    uint64_t u;
    assert_int_equal(bt_gguf_get_u64(g, "general.file_type", &u), 0);
    assert_int_equal(u, dtype == BT_EXPORT_F32 ? 0 : dtype == BT_EXPORT_F16 ? 1 : 7);
    assert_int_equal(bt_gguf_get_u64(g, "llama.block_count", &u), 0);
    assert_int_equal(u, 2);
    assert_int_equal(bt_gguf_get_u64(g, "tokenizer.ggml.bos_token_id", &u), 0);
    assert_int_equal(u, 1);
    bt_str s;
    assert_int_equal(bt_gguf_get_str(g, "tokenizer.ggml.model", &s), 0);
    assert_true(s.len == 4 && !memcmp(s.ptr, "gpt2", 4));
    assert_int_equal(bt_gguf_get_str(g, "general.name", &s), 0);
    assert_true(s.len == 9 && !memcmp(s.ptr, "tiny base", 9));
    bt_gguf_close(g);

    /* read back by the trainer's loader: weights */
    bt_model_load_opts lopt = {BT_BASE_FP32, 0};
    assert_int_equal(bt_model_load_gguf(&m2, out, &lopt), 0);
    assert_memory_equal(&m2.hp, &m.hp, sizeof m.hp);
    assert_int_equal(m2.tied, 0);
    size_t big = (size_t)k_hp.d_ff * k_hp.d_model;
    float *ref = malloc(big * 4), *exp = malloc(big * 4), *tmp = malloc(big * 4);
    uint8_t *qb = malloc(big / 32 * 34);
    double max_rel = 0;
    for (int l = 0; l < k_hp.n_layer; l++) {
        assert_memory_equal(m2.layers[l].attn_norm, m.layers[l].attn_norm, (size_t)k_hp.d_model * 4);
        for (int mod = 0; mod < BT_MOD_N; mod++) {
            const bt_base_linear *b = &m2.layers[l].lin[mod];
            size_t n = (size_t)b->rows * b->cols;
            ref_merge(&m, &lo, l, mod, ref);
            assert_int_equal(bt_export_merged_weight(&m, &lo, l, mod, exp), 0);
            double dmax = 0, wmax = 0;
            for (size_t i = 0; i < n; i++) {
                dmax = fmax(dmax, fabs((double)exp[i] - ref[i]));
                wmax = fmax(wmax, fabs(ref[i]));
            }
            assert_true(dmax <= 1e-6 * wmax); /* the C merge is the merge */
            /* the exact value the file must hold, after the type's rounding */
            if (dtype == BT_EXPORT_F16)
                for (size_t i = 0; i < n; i++) exp[i] = bt_fp16_to_fp32(bt_fp32_to_fp16(exp[i]));
            if (dtype == BT_EXPORT_Q8_0) {
                assert_int_equal(bt_q8_0_quantize(exp, qb, (int64_t)n), 0);
                assert_int_equal(bt_ggml_dequantize(BT_GGML_Q8_0, qb, tmp, (int64_t)n), 0);
                memcpy(exp, tmp, n * 4);
            }
            assert_memory_equal(b->w, exp, n * 4);
            for (size_t i = 0; i < n; i++) max_rel = fmax(max_rel, fabs(b->w[i] - ref[i]) / wmax);
        }
    }
    /* loss: merged model (no adapter) vs base + adapter */
    double l_adapted = loss_of(&m, &lo), l_base = loss_of(&m, NULL), l_merged = loss_of(&m2, NULL);
    double rel = fabs(l_merged - l_adapted) / fabs(l_adapted);
    print_message("merged gguf %s: loss base %.6f, base+lora %.6f, merged %.6f (rel diff %.2e, "
                  "max weight err / max|w| %.2e)\n", dtype == BT_EXPORT_F32 ? "F32"
                  : dtype == BT_EXPORT_F16 ? "F16" : "Q8_0", l_base, l_adapted, l_merged, rel, max_rel);
    assert_true(rel <= loss_tol);
    assert_true(fabs(l_base - l_adapted) / fabs(l_adapted) > 20 * loss_tol); /* the adapter matters */
    free(ref), free(exp), free(tmp), free(qb);
    bt_model_free(&m2);
    bt_lora_free(&lo);
    bt_model_free(&m);
}

static void test_merged_gguf_f32(void **st) { (void)st; check_merged_gguf(BT_EXPORT_F32, 1e-6); }
static void test_merged_gguf_f16(void **st) { (void)st; check_merged_gguf(BT_EXPORT_F16, 1e-4); }
static void test_merged_gguf_q8_0(void **st) { (void)st; check_merged_gguf(BT_EXPORT_Q8_0, 2e-3); }

static void test_merged_gguf_tied_and_errors(void **st) {
    (void)st;
    bt_model m, m2;
    bt_lora lo;
    make_rig(&m, &lo, 1, 21);
    char *out = tpath("tied.gguf");
    assert_int_equal(bt_export_gguf_merged(&m, &lo, NULL, BT_EXPORT_BF16, out), 0);
    bt_model_load_opts lopt = {BT_BASE_FP32, 0};
    assert_int_equal(bt_model_load_gguf(&m2, out, &lopt), 0);
    assert_int_equal(m2.tied, 1);
    bt_model_free(&m2);
    assert_int_equal(bt_export_gguf_merged(&m, &lo, NULL, 9, out), BT_ERR_INVALID);
    bt_lora_free(&lo);
    bt_model_free(&m);
    /* an NF4 base cannot be merged */
    assert_int_equal(bt_model_init_random(&m, &k_hp, BT_BASE_NF4, 1, 5), 0);
    assert_int_equal(bt_lora_init(&lo, &m, R, ALPHA, 0, 1, 0, 6), 0);
    assert_int_equal(bt_export_gguf_merged(&m, &lo, NULL, BT_EXPORT_F16, out), BT_ERR_INVALID);
    float *x = malloc((size_t)k_hp.d_model * k_hp.d_model * 4);
    assert_int_equal(bt_export_merged_weight(&m, &lo, 0, BT_MOD_Q, x), BT_ERR_INVALID);
    assert_int_equal(bt_export_merged_weight(&m, &lo, 5, BT_MOD_Q, x), BT_ERR_INVALID);
    free(x);
    bt_lora_free(&lo);
    bt_model_free(&m);
}

/* ---- GGUF LoRA ---- */

static void check_gguf_lora(int dtype) {
    bt_model m;
    bt_lora lo;
    make_rig(&m, &lo, 0, 31);
    char *out = tpath("lora.gguf"), *pb = tpath("base.gguf"), *pm = tpath("merged32.gguf");
    assert_int_equal(bt_export_gguf_lora(&m, &lo, dtype, out), 0);
    assert_int_equal(bt_export_gguf_merged(&m, NULL, NULL, BT_EXPORT_F32, pb), 0);
    assert_int_equal(bt_export_gguf_merged(&m, &lo, NULL, BT_EXPORT_F32, pm), 0);
    bt_gguf *g = NULL, *gb = NULL, *gm = NULL;
    assert_int_equal(bt_gguf_open(&g, out), 0);
    assert_int_equal(bt_gguf_open(&gb, pb), 0);
    assert_int_equal(bt_gguf_open(&gm, pm), 0);
    bt_str s;
    assert_int_equal(bt_gguf_get_str(g, "general.architecture", &s), 0);
    assert_true(s.len == 5 && !memcmp(s.ptr, "llama", 5));
    assert_int_equal(bt_gguf_get_str(g, "general.type", &s), 0);
    assert_true(s.len == 7 && !memcmp(s.ptr, "adapter", 7));
    assert_int_equal(bt_gguf_get_str(g, "adapter.type", &s), 0);
    assert_true(s.len == 4 && !memcmp(s.ptr, "lora", 4));
    int64_t ki = bt_gguf_find_key(g, "adapter.lora.alpha");
    assert_true(ki >= 0);
    assert_int_equal(bt_gguf_kv_type(g, ki, NULL, NULL), BT_GGUF_F32); /* llama.cpp reads it as f32 */
    double a;
    assert_int_equal(bt_gguf_get_f64(g, "adapter.lora.alpha", &a), 0);
    assert_true(a == ALPHA);
    assert_int_equal(bt_gguf_n_tensors(g), 2 * BT_MOD_N * k_hp.n_layer);
    size_t big = (size_t)k_hp.d_ff * k_hp.d_model;
    float *fa = malloc(big * 4), *fb = malloc(big * 4), *hf = malloc(big * 4);
    float *wb = malloc(big * 4), *wm = malloc(big * 4);
    char name[96];
    double worst = 0;
    for (int l = 0; l < k_hp.n_layer; l++)
        for (int mod = 0; mod < BT_MOD_N; mod++) {
            const bt_lora_mod *md = bt_lora_get(&lo, l, mod);
            snprintf(name, sizeof name, "blk.%d.%s.weight.lora_a", l, k_lin[mod]);
            const bt_gguf_tensor *ta = bt_gguf_find_tensor(g, name);
            snprintf(name, sizeof name, "blk.%d.%s.weight.lora_b", l, k_lin[mod]);
            const bt_gguf_tensor *tb = bt_gguf_find_tensor(g, name);
            assert_non_null(ta);
            assert_non_null(tb);
            /* llama-adapter.cpp: a.ne = (in, r), b.ne = (r, out), base.ne = (in, out) */
            assert_int_equal(ta->n_dims, 2);
            assert_int_equal(ta->ne[0], md->in);
            assert_int_equal(ta->ne[1], R);
            assert_int_equal(tb->ne[0], R);
            assert_int_equal(tb->ne[1], md->out);
            int ta_want = dtype == BT_EXPORT_F32 ? BT_GGML_F32 : dtype == BT_EXPORT_Q8_0 ? BT_GGML_Q8_0
                          : BT_GGML_F16;
            int tb_want = dtype == BT_EXPORT_F32 ? BT_GGML_F32 : BT_GGML_F16; /* ne0 = r: no Q8_0 */
            assert_int_equal(ta->type, ta_want);
            assert_int_equal(tb->type, tb_want);
            size_t na = (size_t)R * md->in, nb = (size_t)R * md->out;
            assert_int_equal(bt_ggml_dequantize(ta->type, ta->data, fa, (int64_t)na), 0);
            assert_int_equal(bt_ggml_dequantize(tb->type, tb->data, fb, (int64_t)nb), 0);
            int perm = mod == BT_MOD_Q || mod == BT_MOD_K;
            if (perm) ref_unpermute(hf, fb, mod == BT_MOD_Q ? k_hp.n_head : k_hp.n_kv_head, md->out, R);
            else memcpy(hf, fb, nb * 4);
            if (dtype == BT_EXPORT_F32) {
                assert_memory_equal(fa, md->A, na * 4);
                assert_memory_equal(hf, md->B, nb * 4);
            } else {
                for (size_t i = 0; i < nb; i++)
                    assert_true(hf[i] == bt_fp16_to_fp32(bt_fp32_to_fp16(md->B[i])));
                for (size_t i = 0; i < na; i++) assert_true(fabsf(fa[i] - md->A[i]) <= 0.01f * 1.f);
            }
            if (perm) /* the permutation is not the identity: un-permuted != raw */
                assert_true(memcmp(hf, fb, nb * 4) != 0);
            /* llama.cpp: y = W_gguf x + scale * lora_b (lora_a x) must equal the merged GGUF */
            snprintf(name, sizeof name, "blk.%d.%s.weight", l, k_lin[mod]);
            const bt_gguf_tensor *t0 = bt_gguf_find_tensor(gb, name), *t1 = bt_gguf_find_tensor(gm, name);
            size_t n = (size_t)md->in * md->out;
            memcpy(wb, t0->data, n * 4);
            memcpy(wm, t1->data, n * 4);
            double wmax = 0, dmax = 0;
            for (int o = 0; o < md->out; o++)
                for (int c = 0; c < md->in; c++) {
                    double d = 0;
                    for (int k = 0; k < R; k++) d += (double)fb[o * R + k] * fa[k * md->in + c];
                    double want = wb[(size_t)o * md->in + c] + ALPHA / R * d;
                    dmax = fmax(dmax, fabs(want - wm[(size_t)o * md->in + c]));
                    wmax = fmax(wmax, fabs(want));
                }
            worst = fmax(worst, dmax / wmax);
        }
    print_message("gguf-lora %s: max |W_gguf + s*b@a - merged| / max|W| = %.2e\n",
                  dtype == BT_EXPORT_F32 ? "F32" : dtype == BT_EXPORT_F16 ? "F16" : "Q8_0", worst);
    assert_true(worst <= (dtype == BT_EXPORT_F32 ? 1e-6 : 1e-2));
    free(fa), free(fb), free(hf), free(wb), free(wm);
    bt_gguf_close(g), bt_gguf_close(gb), bt_gguf_close(gm);
    bt_lora_free(&lo);
    bt_model_free(&m);
}

static void test_gguf_lora_f32(void **st) { (void)st; check_gguf_lora(BT_EXPORT_F32); }
static void test_gguf_lora_f16(void **st) { (void)st; check_gguf_lora(BT_EXPORT_F16); }
static void test_gguf_lora_q8_0(void **st) { (void)st; check_gguf_lora(BT_EXPORT_Q8_0); }

/* ---- merged safetensors ---- */

static void check_safetensors(int dtype, int tied) {
    bt_model m;
    bt_lora lo;
    make_rig(&m, &lo, tied, 41);
    bt_gguf *base = kv_base();
    char *dir = tpath(tied ? "st_tied" : "st_untied");
    const bt_hf_export_opts ho = {base, NULL, 0};
    assert_int_equal(bt_export_safetensors_merged(&m, &lo, dtype, &ho, dir), 0);
    bt_gguf_close(base);
    char p[300];
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    bt_st_file *f = NULL;
    assert_int_equal(bt_st_open(&f, p), 0);
    assert_int_equal(bt_st_n_tensors(f), 2 + k_hp.n_layer * 9 + (tied ? 0 : 1));
    assert_string_equal(bt_st_metadata(f, "format"), "pt");
    bt_st_dtype want = dtype == BT_EXPORT_F32 ? BT_ST_F32 : dtype == BT_EXPORT_F16 ? BT_ST_F16 : BT_ST_BF16;
    size_t big = (size_t)k_hp.vocab * k_hp.d_model + (size_t)k_hp.d_ff * k_hp.d_model;
    float *ref = malloc(big * 4), *got = malloc(big * 4);
    char name[128];
    for (int l = 0; l < k_hp.n_layer; l++)
        for (int mod = 0; mod < BT_MOD_N + 2; mod++) {
            const bt_base_linear *b = mod < BT_MOD_N ? &m.layers[l].lin[mod] : NULL;
            int rows = b ? b->rows : 0, cols = b ? b->cols : k_hp.d_model;
            if (b) {
                snprintf(name, sizeof name, "model.layers.%d.%s.%s.weight", l,
                         mod <= BT_MOD_O ? "self_attn" : "mlp", bt_module_name(mod));
                assert_int_equal(bt_export_merged_weight(&m, &lo, l, mod, ref), 0);
            } else {
                snprintf(name, sizeof name, "model.layers.%d.%s.weight", l,
                         mod == BT_MOD_N ? "input_layernorm" : "post_attention_layernorm");
                memcpy(ref, mod == BT_MOD_N ? m.layers[l].attn_norm : m.layers[l].ffn_norm,
                       (size_t)cols * 4);
            }
            const bt_st_tensor *t = bt_st_find(f, name);
            assert_non_null(t);
            assert_int_equal(t->dtype, want);
            assert_int_equal(t->n_dims, b ? 2 : 1);
            assert_int_equal(t->shape[0], b ? rows : cols);
            if (b) assert_int_equal(t->shape[1], cols);
            size_t n = (size_t)(b ? rows : 1) * cols;
            const uint8_t *d = t->data;
            for (size_t i = 0; i < n; i++) {
                uint16_t h;
                if (want == BT_ST_F32) memcpy(&got[i], d + 4 * i, 4);
                else memcpy(&h, d + 2 * i, 2), got[i] = want == BT_ST_F16 ? bt_fp16_to_fp32(h) : bt_bf16_to_fp32(h);
                float e = want == BT_ST_F32 ? ref[i] : want == BT_ST_F16 ? bt_fp16_to_fp32(bt_fp32_to_fp16(ref[i]))
                                                                         : bt_bf16_to_fp32(bt_fp32_to_bf16(ref[i]));
                assert_true(got[i] == e);
            }
            if (b) { /* against the independent merge */
                ref_merge(&m, &lo, l, mod, ref);
                for (size_t i = 0; i < n; i++)
                    assert_true(fabsf(got[i] - ref[i]) <= (want == BT_ST_F32 ? 1e-5f : 1e-2f) * (1 + fabsf(ref[i])));
            }
        }
    const bt_st_tensor *t = bt_st_find(f, "model.embed_tokens.weight");
    assert_non_null(t);
    assert_int_equal(t->shape[0], k_hp.vocab);
    assert_int_equal(t->shape[1], k_hp.d_model);
    assert_non_null(bt_st_find(f, "model.norm.weight"));
    if (tied) assert_null(bt_st_find(f, "lm_head.weight"));
    else assert_non_null(bt_st_find(f, "lm_head.weight"));
    bt_st_close(f);
    snprintf(p, sizeof p, "%s/config.json", dir);
    json_error_t je;
    json_t *j = json_load_file(p, 0, &je);
    assert_non_null(j);
    assert_string_equal(json_string_value(json_array_get(json_object_get(j, "architectures"), 0)),
                        "LlamaForCausalLM");
    assert_string_equal(json_string_value(json_object_get(j, "model_type")), "llama");
    assert_int_equal(json_integer_value(json_object_get(j, "hidden_size")), k_hp.d_model);
    assert_int_equal(json_integer_value(json_object_get(j, "intermediate_size")), k_hp.d_ff);
    assert_int_equal(json_integer_value(json_object_get(j, "num_hidden_layers")), k_hp.n_layer);
    assert_int_equal(json_integer_value(json_object_get(j, "num_attention_heads")), k_hp.n_head);
    assert_int_equal(json_integer_value(json_object_get(j, "num_key_value_heads")), k_hp.n_kv_head);
    assert_int_equal(json_integer_value(json_object_get(j, "vocab_size")), k_hp.vocab);
    assert_int_equal(json_integer_value(json_object_get(j, "bos_token_id")), 1);
    assert_int_equal(json_integer_value(json_object_get(j, "eos_token_id")), 2);
    assert_true(json_real_value(json_object_get(j, "rms_norm_eps")) == 1e-5);
    assert_true(json_real_value(json_object_get(j, "rope_theta")) == 10000.0);
    assert_int_equal(json_is_true(json_object_get(j, "tie_word_embeddings")), tied);
    assert_string_equal(json_string_value(json_object_get(j, "torch_dtype")),
                        dtype == BT_EXPORT_F32 ? "float32" : dtype == BT_EXPORT_F16 ? "float16" : "bfloat16");
    json_decref(j);
    free(ref), free(got);
    /* read back as a Hugging Face directory by the trainer's loader: same loss as base + adapter */
    bt_model m2;
    bt_model_load_opts lopt = {BT_BASE_FP32, 0};
    assert_int_equal(bt_model_load(&m2, dir, &lopt), 0);
    assert_int_equal(m2.tied, tied);
    double l_adapted = loss_of(&m, &lo), l_merged = loss_of(&m2, NULL);
    double rel = fabs(l_merged - l_adapted) / fabs(l_adapted);
    print_message("merged safetensors %s %s: loss base+lora %.6f, merged %.6f (rel diff %.2e)\n",
                  dtype == BT_EXPORT_F32 ? "F32" : dtype == BT_EXPORT_F16 ? "F16" : "BF16",
                  tied ? "tied" : "untied", l_adapted, l_merged, rel);
    assert_true(rel <= (dtype == BT_EXPORT_F32 ? 1e-6 : dtype == BT_EXPORT_F16 ? 2e-4 : 1e-3));
    bt_model_free(&m2);
    assert_int_equal(bt_export_safetensors_merged(&m, &lo, BT_EXPORT_Q8_0, NULL, dir), BT_ERR_INVALID);
    bt_lora_free(&lo);
    bt_model_free(&m);
}

static void test_safetensors_f32_untied(void **st) { (void)st; check_safetensors(BT_EXPORT_F32, 0); }
static void test_safetensors_f16_tied(void **st) { (void)st; check_safetensors(BT_EXPORT_F16, 1); }
static void test_safetensors_bf16_untied(void **st) { (void)st; check_safetensors(BT_EXPORT_BF16, 0); }


/* A base with q/k/v biases (Qwen2 layout): the merged GGUF carries blk.N.attn_{q,k,v}.bias (q/k
 * permuted like their rows), the merged safetensors is a Qwen2ForCausalLM directory that the
 * trainer's HF loader reads back with the same loss. */
static void test_biases(void **st) {
    (void)st;
    bt_model m, m2;
    bt_lora lo;
    make_rig(&m, &lo, 1, 71);
    bt_rng r;
    bt_rng_seed(&r, 72);
    for (int l = 0; l < k_hp.n_layer; l++)
        for (int mod = BT_MOD_Q; mod <= BT_MOD_V; mod++) {
            bt_base_linear *b = &m.layers[l].lin[mod];
            b->bias = malloc((size_t)b->rows * 4);
            for (int i = 0; i < b->rows; i++) b->bias[i] = 0.5f * bt_rng_normal(&r);
        }
    char *out = tpath("bias.gguf");
    assert_int_equal(bt_export_gguf_merged(&m, &lo, NULL, BT_EXPORT_F16, out), 0);
    bt_gguf *g = NULL;
    assert_int_equal(bt_gguf_open(&g, out), 0);
    assert_int_equal(bt_gguf_n_tensors(g), 2 + k_hp.n_layer * 12);
    char name[64];
    float hf[64];
    for (int l = 0; l < k_hp.n_layer; l++)
        for (int mod = BT_MOD_Q; mod <= BT_MOD_O; mod++) {
            snprintf(name, sizeof name, "blk.%d.%s.bias", l, k_lin[mod]);
            const bt_gguf_tensor *t = bt_gguf_find_tensor(g, name);
            if (mod == BT_MOD_O) {
                assert_null(t);
                continue;
            }
            const bt_base_linear *b = &m.layers[l].lin[mod];
            assert_non_null(t);
            assert_int_equal(t->type, BT_GGML_F32);
            assert_int_equal(t->n_dims, 1);
            assert_int_equal(t->ne[0], b->rows);
            if (mod == BT_MOD_V) assert_memory_equal(t->data, b->bias, (size_t)b->rows * 4);
            else {
                ref_unpermute(hf, t->data, mod == BT_MOD_Q ? k_hp.n_head : k_hp.n_kv_head, b->rows, 1);
                assert_memory_equal(hf, b->bias, (size_t)b->rows * 4);
                assert_memory_not_equal(t->data, b->bias, (size_t)b->rows * 4);
            }
        }
    bt_gguf_close(g);
    char *dir = tpath("bias_st");
    assert_int_equal(bt_export_safetensors_merged(&m, &lo, BT_EXPORT_F32, NULL, dir), 0);
    char p[300];
    snprintf(p, sizeof p, "%s/config.json", dir);
    json_t *j = json_load_file(p, 0, NULL);
    assert_non_null(j);
    assert_string_equal(json_string_value(json_array_get(json_object_get(j, "architectures"), 0)),
                        "Qwen2ForCausalLM");
    json_decref(j);
    bt_model_load_opts lopt = {BT_BASE_FP32, 0};
    assert_int_equal(bt_model_load(&m2, dir, &lopt), 0);
    for (int l = 0; l < k_hp.n_layer; l++) {
        for (int mod = BT_MOD_Q; mod <= BT_MOD_V; mod++)
            assert_memory_equal(m2.layers[l].lin[mod].bias, m.layers[l].lin[mod].bias,
                                (size_t)m.layers[l].lin[mod].rows * 4);
        assert_null(m2.layers[l].lin[BT_MOD_O].bias);
    }
    double l_adapted = loss_of(&m, &lo), l_merged = loss_of(&m2, NULL), l_nobias;
    for (int l = 0; l < k_hp.n_layer; l++) { /* the biases matter */
        free(m.layers[l].lin[BT_MOD_V].bias);
        m.layers[l].lin[BT_MOD_V].bias = NULL;
    }
    l_nobias = loss_of(&m, &lo);
    print_message("biases: loss base+lora %.6f, merged %.6f, without v bias %.6f\n", l_adapted,
                  l_merged, l_nobias);
    assert_true(fabs(l_merged - l_adapted) <= 1e-6 * fabs(l_adapted));
    assert_true(fabs(l_nobias - l_adapted) > 1e-3 * fabs(l_adapted));
    bt_model_free(&m2);
    bt_lora_free(&lo);
    bt_model_free(&m);
}

/* ---- PEFT ---- */

/* Independent check of a PEFT LoRA adapter directory against the schema PEFT's
 * LoraConfig.from_pretrained / set_peft_model_state_dict need. Returns 0 or fails the test. */
static void peft_schema_check(const char *dir, const bt_model *m, int r, unsigned mask) {
    char p[300];
    snprintf(p, sizeof p, "%s/adapter_config.json", dir);
    json_error_t je;
    json_t *j = json_load_file(p, JSON_REJECT_DUPLICATES, &je);
    assert_non_null(j);
    assert_true(json_is_object(j));
    assert_string_equal(json_string_value(json_object_get(j, "peft_type")), "LORA");
    assert_string_equal(json_string_value(json_object_get(j, "task_type")), "CAUSAL_LM");
    assert_true(json_is_integer(json_object_get(j, "r")));
    assert_int_equal(json_integer_value(json_object_get(j, "r")), r);
    assert_true(json_is_number(json_object_get(j, "lora_alpha")));
    assert_true(json_is_number(json_object_get(j, "lora_dropout")));
    assert_true(json_is_string(json_object_get(j, "base_model_name_or_path")));
    assert_string_equal(json_string_value(json_object_get(j, "bias")), "none");
    assert_true(json_is_false(json_object_get(j, "fan_in_fan_out")));
    assert_true(json_is_boolean(json_object_get(j, "inference_mode")));
    assert_true(json_is_false(json_object_get(j, "use_dora")));
    assert_true(json_is_false(json_object_get(j, "use_rslora")));
    assert_true(json_is_object(json_object_get(j, "rank_pattern")));
    assert_true(json_is_object(json_object_get(j, "alpha_pattern")));
    assert_true(json_is_null(json_object_get(j, "modules_to_save")));
    const json_t *tm = json_object_get(j, "target_modules");
    assert_true(json_is_array(tm));
    unsigned got = 0;
    for (size_t i = 0; i < json_array_size(tm); i++) {
        const char *s = json_string_value(json_array_get(tm, i));
        assert_non_null(s);
        int found = -1;
        for (int mod = 0; mod < BT_MOD_N; mod++)
            if (!strcmp(s, bt_module_name(mod))) found = mod;
        assert_true(found >= 0);
        got |= 1u << found;
    }
    assert_int_equal(got, mask);
    /* keys older PEFT versions reject (TypeError in LoraConfig.__init__) must be absent */
    static const char *const newer[] = {"eva_config", "corda_config", "layer_replication",
                                        "trainable_token_indices", "lora_bias", "exclude_modules"};
    for (size_t i = 0; i < sizeof newer / sizeof *newer; i++) assert_null(json_object_get(j, newer[i]));
    json_decref(j);
    snprintf(p, sizeof p, "%s/adapter_model.safetensors", dir);
    bt_st_file *f = NULL;
    assert_int_equal(bt_st_open(&f, p), 0);
    assert_string_equal(bt_st_metadata(f, "format"), "pt");
    int nmod = __builtin_popcount(mask);
    assert_int_equal(bt_st_n_tensors(f), 2 * nmod * m->hp.n_layer);
    for (int i = 0; i < bt_st_n_tensors(f); i++) {
        const bt_st_tensor *t = bt_st_tensor_at(f, i);
        int l, consumed = 0;
        char blk[16], mod_name[16], ab;
        int nf = sscanf(t->name, "base_model.model.model.layers.%d.%15[a-z_].%15[a-z_].lora_%c.weight%n", &l,
                        blk, mod_name, &ab, &consumed);
        assert_int_equal(nf, 4);
        assert_int_equal((size_t)consumed, strlen(t->name));
        int mod = -1;
        for (int k = 0; k < BT_MOD_N; k++)
            if (!strcmp(mod_name, bt_module_name(k))) mod = k;
        assert_true(mod >= 0 && (mask & (1u << mod)));
        assert_string_equal(blk, mod <= BT_MOD_O ? "self_attn" : "mlp");
        assert_true(l >= 0 && l < m->hp.n_layer);
        assert_int_equal(t->dtype, BT_ST_F32);
        assert_int_equal(t->n_dims, 2);
        const bt_base_linear *b = &m->layers[l].lin[mod];
        if (ab == 'A') assert_true(t->shape[0] == r && t->shape[1] == b->cols);
        else assert_true(ab == 'B' && t->shape[0] == b->rows && t->shape[1] == r);
    }
    bt_st_close(f);
}

static void test_peft_roundtrip(void **st) {
    (void)st;
    bt_model m;
    bt_lora lo, lo2;
    make_rig(&m, &lo, 1, 51);
    char *dir = tpath("peft");
    assert_int_equal(bt_adapter_save(&lo, "HuggingFaceTB/SmolLM2-135M-Instruct", dir, NULL), 0);
    peft_schema_check(dir, &m, R, (1u << BT_MOD_N) - 1);
    assert_int_equal(bt_lora_load_peft(&lo2, &m, dir), 0);
    assert_int_equal(lo2.r, R);
    assert_true(lo2.alpha == ALPHA && lo2.scale == ALPHA / R);
    assert_int_equal(lo2.target_mask, (1u << BT_MOD_N) - 1);
    assert_int_equal(lo2.n_params, lo.n_params);
    assert_memory_equal(lo2.params, lo.params, (size_t)lo.n_params * 4);
    bt_lora_free(&lo2);
    bt_lora_free(&lo);
    /* a subset of modules */
    assert_int_equal(bt_lora_init(&lo, &m, 2, 16, 0.1, (1u << BT_MOD_Q) | (1u << BT_MOD_DOWN), 0, 9), 0);
    assert_int_equal(bt_adapter_save(&lo, "x", dir, NULL), 0);
    peft_schema_check(dir, &m, 2, (1u << BT_MOD_Q) | (1u << BT_MOD_DOWN));
    assert_int_equal(bt_lora_load_peft(&lo2, &m, dir), 0);
    assert_int_equal(lo2.target_mask, (1u << BT_MOD_Q) | (1u << BT_MOD_DOWN));
    assert_true(fabsf(lo2.dropout - 0.1f) < 1e-7f);
    assert_memory_equal(lo2.params, lo.params, (size_t)lo.n_params * 4);
    bt_lora_free(&lo2);
    bt_lora_free(&lo);
    bt_model_free(&m);
}

/* A real adapter written by PEFT 0.13.2 save_pretrained for tests/fixtures/hf/tiny-llama-tied
 * (config with PEFT's full key set: loftq_config, megatron_*, layer_replication ...). */
static void test_peft_real_fixture(void **st) {
    (void)st;
    const char *dir = "tests/fixtures/hf/lora/adapter-init";
    struct stat sb;
    if (stat(dir, &sb) != 0) {
        print_message("skipped: %s missing\n", dir);
        skip();
    }
    bt_llama_hparams hp = k_hp; /* its config.json */
    hp.vocab = 384, hp.ctx = 256;
    bt_model m;
    bt_lora lo;
    assert_int_equal(bt_model_init_random(&m, &hp, BT_BASE_FP32, 1, 1), 0);
    assert_int_equal(bt_lora_load_peft(&lo, &m, dir), 0);
    assert_int_equal(lo.r, 4);
    assert_true(lo.alpha == 8.f);
    assert_int_equal(lo.target_mask, (1u << BT_MOD_N) - 1);
    bt_st_file *f = NULL;
    assert_int_equal(bt_st_open(&f, "tests/fixtures/hf/lora/adapter-init/adapter_model.safetensors"), 0);
    const bt_st_tensor *t = bt_st_find(f, "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight");
    assert_non_null(t);
    assert_memory_equal(t->data, bt_lora_get(&lo, 1, BT_MOD_DOWN)->A, t->nbytes);
    bt_st_close(f);
    bt_lora_free(&lo);
    /* the same adapter does not fit a base with another width */
    bt_model_free(&m);
    hp.d_ff = 96;
    assert_int_equal(bt_model_init_random(&m, &hp, BT_BASE_FP32, 1, 1), 0);
    assert_int_not_equal(bt_lora_load_peft(&lo, &m, dir), 0);
    bt_model_free(&m);
}

static void write_file(const char *path, const char *text) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

enum { BAD_NONE, BAD_MISSING_B, BAD_SHAPE, BAD_EXTRA, BAD_LAYER, BAD_NAN, BAD_I32, BAD_NOT_TARGET };

/* Write a q_proj+v_proj adapter (r 2) for k_hp with one defect. */
static void write_peft(const char *dir, const char *cfg, int bad) {
    mkdir(dir, 0755);
    char p[300];
    snprintf(p, sizeof p, "%s/adapter_config.json", dir);
    write_file(p, cfg);
    bt_st_writer *w = bt_st_writer_new();
    bt_st_w_metadata(w, "format", "pt");
    static float buf[2 * 128];
    for (int i = 0; i < 2 * 128; i++) buf[i] = 0.01f * (float)(i % 17);
    char key[160];
    int mods[2] = {BT_MOD_Q, BT_MOD_V};
    for (int l = 0; l < k_hp.n_layer; l++)
        for (int k = 0; k < 2; k++) {
            int out = mods[k] == BT_MOD_Q ? 64 : 32;
            int64_t sa[2] = {2, 64}, sb[2] = {out, 2};
            if (bad == BAD_SHAPE && l == 1 && k == 1) sb[1] = 3;
            bt_adapter_key(key, sizeof key, l, mods[k], 0);
            assert_int_equal(bt_st_w_tensor(w, key, BT_ST_F32, 2, sa, buf, 2 * 64 * 4), 0);
            if (bad == BAD_MISSING_B && l == 1 && k == 0) continue;
            bt_adapter_key(key, sizeof key, l, mods[k], 1);
            assert_int_equal(bt_st_w_tensor(w, key, bad == BAD_I32 ? BT_ST_I32 : BT_ST_F32, 2, sb, buf,
                                            (size_t)(sb[0] * sb[1] * 4)), 0);
        }
    if (bad == BAD_EXTRA) {
        int64_t s1[1] = {4};
        assert_int_equal(bt_st_w_tensor(w, "base_model.model.lm_head.lora_A.weight", BT_ST_F32, 1, s1, buf, 16), 0);
    }
    if (bad == BAD_LAYER || bad == BAD_NOT_TARGET) {
        int64_t sa[2] = {2, 64};
        bt_adapter_key(key, sizeof key, bad == BAD_LAYER ? 7 : 0, bad == BAD_LAYER ? BT_MOD_Q : BT_MOD_K, 0);
        assert_int_equal(bt_st_w_tensor(w, key, BT_ST_F32, 2, sa, buf, 2 * 64 * 4), 0);
    }
    snprintf(p, sizeof p, "%s/adapter_model.safetensors", dir);
    assert_int_equal(bt_st_writer_write(w, p), 0);
    bt_st_writer_free(w);
    if (bad == BAD_NAN) /* afterwards: the writer refuses non-finite tensors (issue 10 §4) */
        for (int k = 0; k < 2; k++) {
            bt_adapter_key(key, sizeof key, 1, mods[k], 0);
            assert_int_equal(tu_st_put_nan(p, key, 5), 1);
        }
}

/* Broken adapters make every export fail cleanly (the loader is trainer/io/adapter_load.c; its own
 * error codes are tested there), and write nothing. */
static void test_peft_bad_inputs(void **st) {
    (void)st;
    bt_model m;
    assert_int_equal(bt_model_init_random(&m, &k_hp, BT_BASE_FP32, 1, 3), 0);
    char base[256], dir[256], out[256];
    snprintf(base, sizeof base, "%s", tpath("bad_base.gguf"));
    snprintf(dir, sizeof dir, "%s", tpath("bad"));
    assert_int_equal(bt_export_gguf_merged(&m, NULL, NULL, BT_EXPORT_F32, base), 0);
    const char *good = "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 4, \"target_modules\": "
                       "[\"q_proj\", \"v_proj\"], \"eva_config\": null}";
    write_peft(dir, good, BAD_NONE);
    for (int fmt = 0; fmt < 4; fmt++) {
        snprintf(out, sizeof out, "%s", tpath(fmt == BT_EXPORT_PEFT ? "bad_out_peft" : fmt == BT_EXPORT_SAFETENSORS
                                                  ? "bad_out_st" : "bad_out.gguf"));
        bt_export_opts o = {base, dir, out, fmt, -1, 0};
        assert_int_equal(bt_export_run(&o), 0);
    }
    static const struct {
        const char *cfg;
        int bad;
    } cases[] = {
        {"{\"peft_type\": \"LORA\", \"r\": 2", BAD_NONE}, /* truncated JSON */
        {"[1, 2]", BAD_NONE},
        {"{\"peft_type\": \"IA3\", \"r\": 2, \"lora_alpha\": 4, \"target_modules\": [\"q_proj\"]}", BAD_NONE},
        {"{\"peft_type\": \"LORA\", \"r\": 3, \"lora_alpha\": 4, \"target_modules\": [\"q_proj\", \"v_proj\"]}",
         BAD_NONE}, /* r != tensors */
        {"{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": -1, \"target_modules\": [\"q_proj\"]}", BAD_NONE},
        /* past the job config's limits (trainer/config.h BT_LORA_*; issue 21 §6: alpha 1e38 made
         * every logit nan) */
        {"{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 1e38, \"target_modules\": [\"q_proj\", \"v_proj\"]}",
         BAD_NONE},
        {"{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 65536.5, \"target_modules\": [\"q_proj\", \"v_proj\"]}",
         BAD_NONE},
        {"{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 4, \"target_modules\": [\"q_proj\", \"v_proj\"],"
         " \"use_dora\": true}", BAD_NONE},
        {"{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 4, \"target_modules\": [\"q_proj\", \"lm_head\"]}",
         BAD_NONE},
        {"{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 4, \"target_modules\": [\"q_proj\"]}", BAD_NONE},
        {"{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 4, \"target_modules\": [\"q_proj\", \"v_proj\","
         " \"k_proj\"]}", BAD_NONE}, /* k_proj tensors missing */
        {NULL, BAD_MISSING_B}, {NULL, BAD_SHAPE}, {NULL, BAD_EXTRA}, {NULL, BAD_LAYER},
        {NULL, BAD_NAN}, {NULL, BAD_I32}, {NULL, BAD_NOT_TARGET},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        write_peft(dir, cases[i].cfg ? cases[i].cfg : good, cases[i].bad);
        for (int fmt = 0; fmt < 4; fmt++) {
            snprintf(out, sizeof out, "%s/case%zu_%d", g_dir, i, fmt);
            bt_export_opts o = {base, dir, out, fmt, -1, 0};
            int rc = bt_export_run(&o);
            if (rc == 0) print_message("case %zu format %d: accepted\n", i, fmt);
            assert_int_not_equal(rc, 0);
            assert_true(strlen(bt_last_error()) > 0);
            struct stat sb;
            assert_int_not_equal(stat(out, &sb), 0); /* nothing written */
        }
    }
    bt_export_opts o = {base, tpath("nonexistent"), out, BT_EXPORT_GGUF_LORA, -1, 0};
    assert_int_equal(bt_export_run(&o), BT_ERR_NOTFOUND);
    bt_model_free(&m);
}

/* rsLoRA (scale alpha / sqrt(r)) is written with the plain-rule alpha giving the same scale. */
static void test_rslora_normalised(void **st) {
    (void)st;
    bt_model m;
    assert_int_equal(bt_model_init_random(&m, &k_hp, BT_BASE_FP32, 1, 4), 0);
    char base[256], dir[256], out[256];
    snprintf(base, sizeof base, "%s", tpath("rs_base.gguf"));
    snprintf(dir, sizeof dir, "%s", tpath("rs_adapter"));
    assert_int_equal(bt_export_gguf_merged(&m, NULL, NULL, BT_EXPORT_F32, base), 0);
    write_peft(dir, "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 4, \"use_rslora\": true, "
                    "\"target_modules\": [\"q_proj\", \"v_proj\"]}", BAD_NONE);
    snprintf(out, sizeof out, "%s", tpath("rs_lora.gguf"));
    bt_export_opts o = {base, dir, out, BT_EXPORT_GGUF_LORA, -1, 0};
    assert_int_equal(bt_export_run(&o), 0);
    bt_gguf *g = NULL;
    assert_int_equal(bt_gguf_open(&g, out), 0);
    double a;
    assert_int_equal(bt_gguf_get_f64(g, "adapter.lora.alpha", &a), 0);
    /* scale = 4 / sqrt(2); llama.cpp: alpha / r = scale -> alpha = 2 * 4 / sqrt(2) */
    assert_true(fabs(a - 2 * 4 / sqrt(2.0)) < 1e-5);
    bt_gguf_close(g);
    snprintf(out, sizeof out, "%s", tpath("rs_peft"));
    o = (bt_export_opts){base, dir, out, BT_EXPORT_PEFT, -1, 0};
    assert_int_equal(bt_export_run(&o), 0);
    bt_lora lo;
    assert_int_equal(bt_lora_load_peft(&lo, &m, out), 0);
    assert_true(fabsf(lo.scale - 4.f / sqrtf(2.f)) < 1e-6f);
    bt_lora_free(&lo);
    bt_model_free(&m);
}

/* ---- the driver ---- */

static size_t file_bytes(const char *p, uint8_t **out) {
    size_t n;
    *out = tu_slurp(p, &n);
    return n;
}

static void test_run_and_main(void **st) {
    (void)st;
    bt_model m;
    bt_lora lo;
    make_rig(&m, &lo, 0, 61);
    bt_gguf *kv = kv_base();
    char base[256], adir[256], o1[256], o2[256];
    snprintf(base, sizeof base, "%s", tpath("run_base.gguf"));
    snprintf(adir, sizeof adir, "%s", tpath("run_adapter"));
    assert_int_equal(bt_export_gguf_merged(&m, NULL, kv, BT_EXPORT_F32, base), 0);
    bt_gguf_close(kv);
    assert_int_equal(bt_adapter_save(&lo, "base", adir, NULL), 0);
    /* gguf-lora through the shapes-only path == from the full model, byte for byte */
    snprintf(o1, sizeof o1, "%s", tpath("run_lora.gguf"));
    snprintf(o2, sizeof o2, "%s", tpath("direct_lora.gguf"));
    bt_export_opts o = {base, adir, o1, BT_EXPORT_GGUF_LORA, BT_EXPORT_F16, 0};
    assert_int_equal(bt_export_run(&o), 0);
    assert_int_equal(bt_export_gguf_lora(&m, &lo, BT_EXPORT_F16, o2), 0);
    uint8_t *b1, *b2;
    size_t n1 = file_bytes(o1, &b1), n2 = file_bytes(o2, &b2);
    assert_int_equal(n1, n2);
    assert_memory_equal(b1, b2, n1);
    free(b1), free(b2);
    /* merged gguf through the driver == direct */
    snprintf(o1, sizeof o1, "%s", tpath("run_merged.gguf"));
    snprintf(o2, sizeof o2, "%s", tpath("direct_merged.gguf"));
    o = (bt_export_opts){base, adir, o1, BT_EXPORT_GGUF, BT_EXPORT_Q8_0, 0};
    assert_int_equal(bt_export_run(&o), 0);
    bt_gguf *g = NULL;
    assert_int_equal(bt_gguf_open(&g, base), 0);
    assert_int_equal(bt_export_gguf_merged(&m, &lo, g, BT_EXPORT_Q8_0, o2), 0);
    bt_gguf_close(g);
    n1 = file_bytes(o1, &b1), n2 = file_bytes(o2, &b2);
    assert_int_equal(n1, n2);
    assert_memory_equal(b1, b2, n1);
    free(b1), free(b2);
    /* peft and safetensors */
    snprintf(o1, sizeof o1, "%s", tpath("run_peft"));
    o = (bt_export_opts){base, adir, o1, BT_EXPORT_PEFT, -1, 0};
    assert_int_equal(bt_export_run(&o), 0);
    peft_schema_check(o1, &m, R, (1u << BT_MOD_N) - 1);
    o.dtype = BT_EXPORT_F16;
    assert_int_equal(bt_export_run(&o), BT_ERR_INVALID);
    snprintf(o1, sizeof o1, "%s", tpath("run_st/deeper"));
    o = (bt_export_opts){base, adir, o1, BT_EXPORT_SAFETENSORS, -1, 0};
    assert_int_equal(bt_export_run(&o), 0);
    char p[300];
    snprintf(p, sizeof p, "%s/model.safetensors", o1);
    bt_st_file *f = NULL;
    assert_int_equal(bt_st_open(&f, p), 0);
    assert_int_equal(bt_st_find(f, "lm_head.weight")->dtype, BT_ST_F16);
    bt_st_close(f);
    /* errors */
    o = (bt_export_opts){tpath("missing.gguf"), adir, tpath("run_none.gguf"), BT_EXPORT_GGUF, -1, 0};
    assert_int_equal(bt_export_run(&o), BT_ERR_IO);
    o = (bt_export_opts){base, tpath("missing_dir"), tpath("run_none.gguf"), BT_EXPORT_GGUF_LORA, -1, 0};
    assert_int_equal(bt_export_run(&o), BT_ERR_NOTFOUND);
    /* a destination BarqTrain did not write is refused before anything is loaded (issue 21 §1) */
    o = (bt_export_opts){tpath("missing.gguf"), adir, o1, BT_EXPORT_GGUF, -1, 0};
    assert_int_equal(bt_export_run(&o), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "is a directory"));
    /* command line */
    char *a1[] = {"export", "--model", base, "--adapter", adir, "--format", "gguf-lora", "--out",
                  o2, "--dtype=f32", NULL};
    assert_int_equal(bt_export_main(10, a1), 0);
    assert_int_equal(bt_gguf_open(&g, o2), 0);
    assert_int_equal(bt_gguf_find_tensor(g, "blk.0.attn_q.weight.lora_b")->type, BT_GGML_F32);
    bt_gguf_close(g);
    char *a2[] = {"export", "--model", base, "--adapter", adir, "--format", "onnx", "--out", o2, NULL};
    assert_int_equal(bt_export_main(9, a2), 2);
    char *a3[] = {"export", "--model", base, "--format", "gguf", "--out", o2, NULL};
    assert_int_equal(bt_export_main(7, a3), 2);
    char *a4[] = {"export", "--model", base, "--adapter", adir, "--format", "gguf", "--out", o2,
                  "--dtype", "q4_0", NULL};
    assert_int_equal(bt_export_main(11, a4), 2);
    char *a5[] = {"export", "--bogus", NULL};
    assert_int_equal(bt_export_main(2, a5), 2);
    char *a6[] = {"export", "--model", tpath("missing.gguf"), "--adapter", adir, "--format", "gguf",
                  "--out", o2, NULL};
    assert_int_equal(bt_export_main(9, a6), 1);
    int d;
    assert_int_equal(bt_export_format_parse("gguf-lora", &d), 0);
    assert_int_equal(d, BT_EXPORT_GGUF_LORA);
    assert_int_equal(bt_export_dtype_parse("bf16", &d), 0);
    assert_int_equal(d, BT_EXPORT_BF16);
    assert_int_equal(bt_export_dtype_parse(NULL, &d), BT_ERR_INVALID);
    bt_lora_free(&lo);
    bt_model_free(&m);
}

/* Gemma 3 (tests/fixtures/hf/gemma3/model.gguf, fp32): the merged GGUF and the merged
 * safetensors directory of the base alone read back by our own loaders as the same model: the
 * hyper-parameters llama.cpp and Gemma3TextConfig need (window, period, local RoPE base,
 * query_pre_attn_scalar), every norm factor 1 + w (the GGUF stores it, the directory stores w and
 * the HF loader adds 1 back: 1 ulp), the post-attention / post-FFN norms, tied embedding. A model
 * whose period, local base or RoPE scaling a gemma3 GGUF cannot say is refused there. */
static void check_same_gemma(const bt_model *a, const bt_model *b, float tol) {
    assert_int_equal(b->hp.arch, BT_ARCH_GEMMA3);
    assert_int_equal(b->hp.sliding_window, a->hp.sliding_window);
    assert_int_equal(b->hp.swa_pattern, a->hp.swa_pattern);
    assert_true(b->hp.rope_local_theta == a->hp.rope_local_theta);
    assert_true(b->hp.rope_theta == a->hp.rope_theta);
    assert_int_equal(b->hp.rope_ext, a->hp.rope_ext); /* Gemma 3 4B+'s linear scaling kept */
    assert_true(b->hp.rope_ext_factor == a->hp.rope_ext_factor);
    for (int i = 0; i < a->hp.head_dim / 2; i++) /* the global and local tables themselves */
        assert_true(b->inv_freq[i] == a->inv_freq[i] && b->inv_freq_local[i] == a->inv_freq_local[i]);
    assert_true(b->hp.attn_scalar == a->hp.attn_scalar);
    assert_int_equal(b->tied, 1);
    const int D = a->hp.d_model, hd = a->hp.head_dim;
    for (int l = 0; l < a->hp.n_layer; l++) {
        const bt_layer *x = &a->layers[l], *y = &b->layers[l];
        const float *nx[6] = {x->attn_norm, x->ffn_norm, x->post_attn_norm, x->post_ffn_norm,
                              x->q_norm, x->k_norm};
        const float *ny[6] = {y->attn_norm, y->ffn_norm, y->post_attn_norm, y->post_ffn_norm,
                              y->q_norm, y->k_norm};
        for (int k = 0; k < 6; k++)
            for (int i = 0; i < (k < 4 ? D : hd); i++) assert_true(fabsf(nx[k][i] - ny[k][i]) <= tol);
        const int64_t n = (int64_t)x->lin[BT_MOD_DOWN].rows * x->lin[BT_MOD_DOWN].cols;
        for (int64_t i = 0; i < n; i++) assert_true(x->lin[BT_MOD_DOWN].w[i] == y->lin[BT_MOD_DOWN].w[i]);
    }
    for (int i = 0; i < D; i++) assert_true(fabsf(a->output_norm[i] - b->output_norm[i]) <= tol);
}

/* m merged (no adapter) to a GGUF and to a safetensors directory, each read back as m */
static void gemma_round_trips(const bt_model *m, const char *out, const char *dir) {
    bt_model m2;
    bt_model_load_opts lopt = {BT_BASE_FP32, 0};
    assert_int_equal(bt_export_gguf_merged(m, NULL, NULL, BT_EXPORT_F32, out), 0);
    assert_int_equal(bt_model_load(&m2, out, &lopt), 0);
    check_same_gemma(m, &m2, 0.f);
    bt_model_free(&m2);
    assert_int_equal(bt_export_safetensors_merged(m, NULL, BT_EXPORT_F32, NULL, dir), 0);
    assert_int_equal(bt_model_load(&m2, dir, &lopt), 0);
    check_same_gemma(m, &m2, 2.5e-7f);
    bt_model_free(&m2);
}

static void test_gemma3_merged(void **st) {
    (void)st;
    bt_model m;
    bt_model_load_opts lopt = {BT_BASE_FP32, 0};
    char *out = tpath("gemma3.gguf"), *dir = tpath("gemma3-hf");
    /* the plain fixture and its linear-RoPE twin (gemma3.rope.scaling.* in the GGUF, then
     * rope_parameters.full_attention in config.json): both read back the same */
    assert_int_equal(bt_model_load(&m, "tests/fixtures/hf/gemma3-linear/model.gguf", &lopt), 0);
    assert_true(m.hp.rope_ext == BT_ROPE_EXT_LINEAR && m.hp.rope_ext_factor == 8.f);
    gemma_round_trips(&m, out, dir);
    bt_model_free(&m);
    assert_int_equal(bt_model_load(&m, "tests/fixtures/hf/gemma3/model.gguf", &lopt), 0);
    assert_int_equal(m.hp.rope_ext, BT_ROPE_EXT_NONE);
    gemma_round_trips(&m, out, dir);
    /* what llama.cpp's gemma3 loader fixes cannot be written into a gemma3 GGUF */
    m.hp.swa_pattern = 4;
    assert_int_equal(bt_export_gguf_merged(&m, NULL, NULL, BT_EXPORT_F32, out), BT_ERR_UNSUPPORTED);
    m.hp.swa_pattern = 6, m.hp.rope_local_theta = 5000.f;
    assert_int_equal(bt_export_gguf_merged(&m, NULL, NULL, BT_EXPORT_F32, out), BT_ERR_UNSUPPORTED);
    m.hp.rope_local_theta = 10000.f, m.hp.rope_ext = BT_ROPE_EXT_YARN, m.hp.rope_ext_factor = 2.f;
    assert_int_equal(bt_export_gguf_merged(&m, NULL, NULL, BT_EXPORT_F32, out), BT_ERR_UNSUPPORTED);
    assert_int_equal(bt_export_safetensors_merged(&m, NULL, BT_EXPORT_F32, NULL, dir),
                     BT_ERR_UNSUPPORTED);
    bt_model_free(&m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_q8_0),
        cmocka_unit_test(test_permute),
        cmocka_unit_test(test_merged_gguf_f32),
        cmocka_unit_test(test_merged_gguf_f16),
        cmocka_unit_test(test_merged_gguf_q8_0),
        cmocka_unit_test(test_merged_gguf_tied_and_errors),
        cmocka_unit_test(test_gguf_lora_f32),
        cmocka_unit_test(test_gguf_lora_f16),
        cmocka_unit_test(test_gguf_lora_q8_0),
        cmocka_unit_test(test_safetensors_f32_untied),
        cmocka_unit_test(test_safetensors_f16_tied),
        cmocka_unit_test(test_safetensors_bf16_untied),
        cmocka_unit_test(test_biases),
        cmocka_unit_test(test_peft_roundtrip),
        cmocka_unit_test(test_peft_real_fixture),
        cmocka_unit_test(test_peft_bad_inputs),
        cmocka_unit_test(test_rslora_normalised),
        cmocka_unit_test(test_run_and_main),
        cmocka_unit_test(test_gemma3_merged),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
