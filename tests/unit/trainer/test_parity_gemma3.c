/* Parity of the CPU (fp32) trainer with transformers 5.23 + PEFT 0.21 on a tiny random Gemma 3
 * (tests/fixtures/hf/gemma3, made by tests/reference/gen_gemma3_fixtures.py; see its docstring for
 * the files): 6 layers, 5 of them sliding-window (6 tokens, shorter than every document of the
 * batch) with RoPE base 1e4 and the last global with base 1e6, head_dim 24 != hidden / heads,
 * QK-norm, pre- and post-norms (stored 1 + w), GeGLU, embeddings times sqrt(hidden), tied
 * embedding. Loaded from its Hugging Face directory and from its GGUF (general.architecture
 * "gemma3", norms stored as w + 1 as convert_hf_to_gguf.py Gemma3Model writes them), dequantised to
 * fp32 and kept as GGUF blocks (base_dtype "gguf"): logits and loss of the packed batch without and
 * with the PEFT adapter, the LoRA gradients, with activation checkpointing, and the inference path
 * (KV cache, two chunks) against the same logits. Each check can fail: without the window, the
 * post-norms, the embedding scale or GeGLU (SwiGLU instead) the logits are far off.
 * The linear-RoPE variant (tests/fixtures/hf/gemma3-linear: the same weights with Gemma 3 4B+'s
 * linear scaling, factor 8, on the global layer only; its HF config in the transformers 4.x form
 * rope_scaling / rope_local_base_freq, its GGUF with gemma3.rope.scaling.type / factor) passes the
 * same parity from both sources, and fails it with the scaling dropped or applied to the sliding
 * layers as well.
 * Tolerances: logits 1e-4 absolute, loss 1e-5, LoRA gradients 1e-4 relative to their max
 * (the tiny-Llama parity's, tests/reference/README.md). Run from the repo root
 * (BT_HF_FIXTURES overrides tests/fixtures/hf). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <jansson.h>

#include "common/bt_common.h"
#include "common/safetensors.h"
#include "kernels/kernels.h"
#include "trainer/config.h"
#include "trainer/estimate.h"
#include "trainer/infer/infer.h"
#include "trainer/io/adapter.h"
#include "trainer/io/adapter_load.h"
#include "trainer/loop/step.h"
#include "trainer/model/lora.h"
#include "trainer/model/model.h"
#include "tests/unit/util/parity_util.h"
#include "tests/unit/util/test_util.h"

enum { PB = TU_FIX_B, PT = TU_FIX_T, PM = TU_FIX_M, NV = 260 };

static bt_st_file *open_fix(const char *rel) { return tu_fix_open("gemma3", rel); }

static const float *fix_f32(const bt_st_file *f, const char *name, int64_t n) {
    return tu_st_data((bt_st_file *)f, name, BT_ST_F32, n);
}

typedef tu_fix_batch batch;

/* source: "hf" (the directory), "gguf" (model.gguf dequantised to fp32), "native" (model.gguf
 * kept as BF16 blocks, base_dtype "gguf") */
static void load_fam(bt_model *m, const char *fam, const char *source) {
    char p[512];
    int gg = strcmp(source, "hf") != 0;
    snprintf(p, sizeof p, "%s/%s/%s", tu_hf_fixdir(), fam, gg ? "model.gguf" : "hf");
    bt_model_load_opts o = {!strcmp(source, "native") ? BT_BASE_GGUF : BT_BASE_FP32, 0};
    if (bt_model_load(m, p, &o)) fail_msg("loading %s: %s", p, bt_last_error());
    const bt_llama_hparams *hp = &m->hp;
    assert_int_equal(hp->arch, BT_ARCH_GEMMA3);
    assert_int_equal(hp->qk_norm, 1);
    assert_int_equal(hp->sandwich_norm, 1);
    assert_int_equal(hp->act, BT_ACT_GELU_TANH);
    assert_int_equal(hp->head_dim, 24);
    assert_int_equal(hp->n_head, 2);
    assert_int_equal(hp->n_kv_head, 1);
    assert_int_equal(hp->d_model, 32);
    assert_int_equal(hp->n_layer, 6);
    assert_int_equal(hp->vocab, NV);
    assert_int_equal(m->tied, 1);
    assert_true(hp->rope_theta == 1000000.0f);
    assert_true(hp->rope_local_theta == 10000.0f);
    assert_true(hp->embed_scale == sqrtf(32.f));
    assert_true(hp->attn_scalar == 24.f);
    assert_int_equal(hp->sliding_window, 6);
    for (int l = 0; l < hp->n_layer; l++) {
        assert_int_equal(bt_model_layer_window(hp, l), l == 5 ? 0 : 6);
        assert_true(bt_model_layer_inv(m, l, m->inv_freq) == (l == 5 ? m->inv_freq : m->inv_freq_local));
        assert_non_null(m->layers[l].post_attn_norm);
        assert_non_null(m->layers[l].post_ffn_norm);
        assert_non_null(m->layers[l].q_norm);
        for (int j = 0; j < BT_MOD_N; j++) assert_null(m->layers[l].lin[j].bias);
    }
}

static void load_model(bt_model *m, const char *source) { load_fam(m, "gemma3", source); }

static void check_source(const char *source) {
    batch b;
    bt_microbatch mb = tu_fix_load_batch("gemma3", &b);
    bt_model m;
    load_model(&m, source);
    bt_st_file *ref = open_fix("ref.safetensors");
    const float *rl_base = fix_f32(ref, "logits_base", (int64_t)PM * NV);
    float *logits = malloc((size_t)PM * NV * sizeof(float));

    bt_lora lo;
    char dir[512];
    snprintf(dir, sizeof dir, "%s/gemma3/adapter-init", tu_hf_fixdir());
    if (bt_lora_load_peft(&lo, &m, dir)) fail_msg("%s", bt_last_error());
    assert_int_equal(lo.target_mask, (1u << BT_MOD_N) - 1);
    tu_fix_parity("gemma3", source, &m, &lo, &mb, &b, ref, logits);

    /* the checks can fail: without the window, the post-norms, the embedding scale or GeGLU the
     * logits are far off */
    for (int k = 0; k < 4; k++) {
        bt_llama_hparams keep = m.hp;
        if (k == 0) m.hp.sliding_window = 0;   /* full causal attention everywhere */
        if (k == 1) m.hp.sandwich_norm = 0;    /* no post-attention / post-FFN norms */
        if (k == 2) m.hp.embed_scale = 0.f;    /* unscaled embeddings */
        if (k == 3) m.hp.act = BT_ACT_SILU;    /* SwiGLU instead of GeGLU */
        tu_fix_forward(&m, NULL, &mb, logits, 0);
        m.hp = keep;
        const double d = tu_max_abs_diff(logits, rl_base, (int64_t)PM * NV);
        if (!(d > 1e-2)) fail_msg("gemma3 variant %d: logits still match (%.3g)", k, d);
    }

    bt_lora_free(&lo);
    free(logits);
    bt_st_close(ref);
    bt_model_free(&m);
}

/* The linear-RoPE variant from `source`: hparams (linear, factor 8; the plain fixture has none),
 * the tables (global: the default table / 8, transformers' _compute_linear_scaling_rope_parameters;
 * local: the default table of base 1e4, unscaled), the whole parity from "hf" (the logits with the
 * adapter from the GGUF, whose reader is what differs), and the two wrong choices
 * (no scaling; the sliding layers scaled too) far off the reference logits. */
static void check_linear(const char *source) {
    batch b;
    bt_microbatch mb = tu_fix_load_batch("gemma3-linear", &b);
    bt_model m;
    load_fam(&m, "gemma3-linear", source);
    assert_int_equal(m.hp.rope_ext, BT_ROPE_EXT_LINEAR);
    assert_true(m.hp.rope_ext_factor == 8.0f);
    const int half = m.hp.head_dim / 2;
    float dflt[12], loc[12];
    assert_int_equal(bt_rope_inv_freq(dflt, m.hp.head_dim, 1e6f, "default", 0.f, 0.f, 0.f, 0), 0);
    assert_int_equal(bt_rope_inv_freq(loc, m.hp.head_dim, 1e4f, "default", 0.f, 0.f, 0.f, 0), 0);
    for (int i = 0; i < half; i++) {
        assert_true(m.inv_freq[i] == dflt[i] / 8.0f);
        assert_true(m.inv_freq_local[i] == loc[i]);
    }
    bt_model plain;
    load_model(&plain, source);
    assert_int_equal(plain.hp.rope_ext, BT_ROPE_EXT_NONE);
    bt_model_free(&plain);

    bt_st_file *ref = tu_fix_open("gemma3-linear", "ref.safetensors");
    const float *rl_base = fix_f32(ref, "logits_base", (int64_t)PM * NV);
    float *logits = malloc((size_t)PM * NV * sizeof(float));
    bt_lora lo;
    char dir[512];
    snprintf(dir, sizeof dir, "%s/gemma3-linear/adapter-init", tu_hf_fixdir());
    if (bt_lora_load_peft(&lo, &m, dir)) fail_msg("%s", bt_last_error());
    if (!strcmp(source, "hf")) {
        tu_fix_parity("gemma3-linear", source, &m, &lo, &mb, &b, ref, logits);
    } else { /* the GGUF: its reader's hparams; the rest is the HF run's code (logits suffice) */
        tu_fix_forward(&m, &lo, &mb, logits, 0);
        const double e = tu_max_abs_diff(logits, fix_f32(ref, "logits", (int64_t)PM * NV),
                                         (int64_t)PM * NV);
        print_message("parity: gemma3-linear from %s: with LoRA, logits max abs err %.3g\n",
                      source, e);
        assert_true(e <= 1e-4);
    }

    float keep_g[12], keep_l[12];
    memcpy(keep_g, m.inv_freq, sizeof keep_g);
    memcpy(keep_l, m.inv_freq_local, sizeof keep_l);
    for (int k = 0; k < 2; k++) {
        for (int i = 0; i < half; i++) {
            if (k == 0) m.inv_freq[i] = keep_g[i] * 8.0f;      /* scaling dropped */
            else m.inv_freq_local[i] = keep_l[i] / 8.0f;       /* sliding layers scaled too */
        }
        tu_fix_forward(&m, NULL, &mb, logits, 0);
        const double d = tu_max_abs_diff(logits, rl_base, (int64_t)PM * NV);
        memcpy(m.inv_freq, keep_g, sizeof keep_g);
        memcpy(m.inv_freq_local, keep_l, sizeof keep_l);
        print_message("parity: gemma3-linear from %s: with the %s, logits off by %.3g\n", source,
                      k ? "sliding layers scaled too" : "scaling dropped", d);
        if (!(d > 1e-2)) fail_msg("gemma3-linear variant %d: logits still match (%.3g)", k, d);
    }
    bt_lora_free(&lo);
    free(logits);
    bt_st_close(ref);
    bt_model_free(&m);
}

static void test_gemma3_linear_hf(void **st) { (void)st; check_linear("hf"); }
static void test_gemma3_linear_gguf(void **st) { (void)st; check_linear("native"); }

/* The HF config's RoPE forms, read as transformers 5.23 Gemma3TextConfig reads them (each
 * expectation checked there): the fixture's weights with config.json's RoPE keys replaced by
 * `rope` (JSON merged over the config with rope_parameters / rope_scaling / rope_theta /
 * rope_local_base_freq removed). Returns the load's error code; *hp the hparams on success. */
static int load_rope_form(const char *rope, bt_llama_hparams *hp) {
    char dir[128], p[512], src[512];
    assert_int_equal(tu_make_tmpdir(dir, sizeof dir, "gemma3_rope"), 0);
    snprintf(src, sizeof src, "%s/gemma3-linear/hf/config.json", tu_hf_fixdir());
    json_error_t e;
    json_t *c = json_load_file(src, 0, &e), *r = json_loads(rope, 0, &e);
    assert_non_null(c);
    assert_non_null(r);
    static const char *const drop[] = {"rope_parameters", "rope_scaling", "rope_theta",
                                       "rope_local_base_freq"};
    for (size_t i = 0; i < sizeof drop / sizeof *drop; i++) json_object_del(c, drop[i]);
    assert_int_equal(json_object_update(c, r), 0);
    snprintf(p, sizeof p, "%s/config.json", dir);
    assert_int_equal(json_dump_file(c, p, 0), 0);
    json_decref(c);
    json_decref(r);
    char *abs = realpath(tu_hf_fixdir(), NULL);
    assert_non_null(abs);
    snprintf(src, sizeof src, "%s/gemma3-linear/hf/model.safetensors", abs);
    free(abs);
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    assert_int_equal(symlink(src, p), 0);
    bt_model m;
    bt_model_load_opts o = {BT_BASE_FP32, 0};
    int rc = bt_model_load(&m, dir, &o);
    if (!rc) {
        *hp = m.hp;
        bt_model_free(&m);
    }
    assert_int_equal(tu_remove_dir(dir), 0);
    return rc;
}

static void test_gemma3_rope_config_forms(void **st) {
    (void)st;
    bt_llama_hparams hp;
    /* transformers 4 (google/gemma-3-4b-it's text_config): rope_scaling on the global layers,
     * the bases from rope_theta / rope_local_base_freq (defaults 1e6 / 1e4) */
    assert_int_equal(load_rope_form("{\"rope_scaling\": {\"rope_type\": \"linear\", "
                                    "\"factor\": 8.0}}", &hp), 0);
    assert_true(hp.rope_ext == BT_ROPE_EXT_LINEAR && hp.rope_ext_factor == 8.f);
    assert_true(hp.rope_theta == 1e6f && hp.rope_local_theta == 1e4f);
    /* transformers 5 per layer type, a set without rope_theta takes the top-level bases */
    assert_int_equal(load_rope_form("{\"rope_parameters\": {\"full_attention\": {\"rope_type\": "
                                    "\"linear\", \"factor\": 4.0}}, \"rope_theta\": 500000.0, "
                                    "\"rope_local_base_freq\": 20000.0}", &hp), 0);
    assert_true(hp.rope_ext == BT_ROPE_EXT_LINEAR && hp.rope_ext_factor == 4.f);
    assert_true(hp.rope_theta == 5e5f && hp.rope_local_theta == 2e4f);
    /* both: rope_scaling is merged over full_attention (its keys win) */
    assert_int_equal(load_rope_form("{\"rope_parameters\": {\"full_attention\": {\"rope_type\": "
                                    "\"default\", \"rope_theta\": 1000000.0}, "
                                    "\"sliding_attention\": {\"rope_type\": \"default\", "
                                    "\"rope_theta\": 10000.0}}, \"rope_scaling\": {\"rope_type\": "
                                    "\"linear\", \"factor\": 8.0}}", &hp), 0);
    assert_true(hp.rope_ext == BT_ROPE_EXT_LINEAR && hp.rope_ext_factor == 8.f);
    /* none, and factor 1: no scaling */
    assert_int_equal(load_rope_form("{\"rope_scaling\": null}", &hp), 0);
    assert_int_equal(hp.rope_ext, BT_ROPE_EXT_NONE);
    assert_int_equal(load_rope_form("{\"rope_scaling\": {\"rope_type\": \"linear\", "
                                    "\"factor\": 1.0}}", &hp), 0);
    assert_int_equal(hp.rope_ext, BT_ROPE_EXT_NONE);
    /* refused, naming the key: scaling on the sliding layers, another kind, no factor */
    assert_int_equal(load_rope_form("{\"rope_parameters\": {\"sliding_attention\": "
                                    "{\"rope_type\": \"linear\", \"factor\": 8.0}}}", &hp),
                     BT_ERR_UNSUPPORTED);
    assert_non_null(strstr(bt_last_error(), "sliding-layer"));
    assert_int_equal(load_rope_form("{\"rope_scaling\": {\"rope_type\": \"yarn\", "
                                    "\"factor\": 8.0}}", &hp), BT_ERR_UNSUPPORTED);
    assert_non_null(strstr(bt_last_error(), "\"yarn\""));
    assert_int_equal(load_rope_form("{\"rope_scaling\": {\"rope_type\": \"linear\"}}", &hp),
                     BT_ERR_FORMAT);
    assert_int_equal(load_rope_form("{\"rope_scaling\": 8}", &hp), BT_ERR_FORMAT);
}

static void test_gemma3_hf(void **st) { (void)st; check_source("hf"); }
static void test_gemma3_gguf(void **st) { (void)st; check_source("gguf"); }
static void test_gemma3_gguf_native(void **st) { (void)st; check_source("native"); }

/* The HF directory (norms w, made 1 + w at load) and the GGUF (norms stored as w + 1) hold the
 * same values: every base tensor equal. */
static void test_gguf_equals_hf(void **st) {
    (void)st;
    bt_model a, g;
    load_model(&a, "hf");
    load_model(&g, "gguf");
    const bt_llama_hparams *hp = &a.hp;
    assert_int_equal(memcmp(a.tok_embd, g.tok_embd, (size_t)hp->vocab * hp->d_model * 4), 0);
    assert_int_equal(memcmp(a.output_norm, g.output_norm, (size_t)hp->d_model * 4), 0);
    for (int l = 0; l < hp->n_layer; l++) {
        for (int j = 0; j < BT_MOD_N; j++) {
            const bt_base_linear *x = &a.layers[l].lin[j], *y = &g.layers[l].lin[j];
            assert_int_equal(memcmp(x->w, y->w, (size_t)x->rows * x->cols * 4), 0);
        }
        const bt_layer *x = &a.layers[l], *y = &g.layers[l];
        assert_int_equal(memcmp(x->attn_norm, y->attn_norm, hp->d_model * 4), 0);
        assert_int_equal(memcmp(x->ffn_norm, y->ffn_norm, hp->d_model * 4), 0);
        assert_int_equal(memcmp(x->post_attn_norm, y->post_attn_norm, hp->d_model * 4), 0);
        assert_int_equal(memcmp(x->post_ffn_norm, y->post_ffn_norm, hp->d_model * 4), 0);
        assert_int_equal(memcmp(x->q_norm, y->q_norm, hp->head_dim * 4), 0);
        assert_int_equal(memcmp(x->k_norm, y->k_norm, hp->head_dim * 4), 0);
    }
    bt_model_free(&a);
    bt_model_free(&g);
}

/* The memory plan covers the QK-norm and sandwich-norm buffers: `trainer estimate` on the GGUF
 * and the HF directory bills exactly the bytes the CPU step context allocates, with
 * checkpointing and without. */
static void test_estimate_is_the_plan(void **st) {
    (void)st;
    for (int src = 0; src < 2; src++)
        for (int ck = 0; ck < 2; ck++) {
            bt_model m;
            load_model(&m, src ? "hf" : "gguf");
            char p[512], txt[1024];
            snprintf(p, sizeof p, "%s/gemma3/%s", tu_hf_fixdir(), src ? "hf" : "model.gguf");
            snprintf(txt, sizeof txt, "{\"model\": \"%s\", \"base_dtype\": \"fp32\", \"data\": "
                     "{\"shards\": [\"d\"], \"seq_len\": 32, \"micro_batch_size\": 2}, \"lora\": "
                     "{\"r\": 4}, \"activation_checkpointing\": %s}", p, ck ? "true" : "false");
            bt_train_config c;
            assert_int_equal(bt_config_parse(&c, txt, "t", NULL, 0), 0);
            bt_lora lo;
            assert_int_equal(bt_lora_init(&lo, &m, 4, 8, 0, c.lora.target_mask, 0, 1), 0);
            bt_step_ctx *ctx = NULL;
            assert_int_equal(bt_step_ctx_new(&ctx, &m, &lo, 64, ck), 0);
            bt_est_model em;
            if (bt_est_model_read(&em, p)) fail_msg("%s: %s", p, bt_last_error());
            assert_int_equal(em.hp.head_dim, 24);
            assert_int_equal(em.hp.sandwich_norm, 1);
            bt_mem_bill b;
            bt_estimate_bill(&em, &c, BT_EST_CPU, omp_get_max_threads(), &b);
            if (b.step != (double)bt_step_ctx_bytes(ctx))
                fail_msg("%s, checkpointing %d: bill step %.0f bytes, bt_step_ctx_bytes %zu", p, ck,
                         b.step, bt_step_ctx_bytes(ctx));
            bt_step_ctx_free(ctx);
            bt_lora_free(&lo);
            bt_config_free(&c);
            bt_model_free(&m);
        }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gemma3_hf),      cmocka_unit_test(test_gemma3_gguf),
        cmocka_unit_test(test_gemma3_gguf_native), cmocka_unit_test(test_gguf_equals_hf),
        cmocka_unit_test(test_estimate_is_the_plan), cmocka_unit_test(test_gemma3_linear_hf),
        cmocka_unit_test(test_gemma3_linear_gguf), cmocka_unit_test(test_gemma3_rope_config_forms),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
