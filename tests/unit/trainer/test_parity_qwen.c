/* Parity of the CPU (fp32) trainer with transformers 5.23 + PEFT 0.21 on tiny random Qwen2 and
 * Qwen3 models (tests/fixtures/hf/qwen, made by tests/reference/gen_qwen_fixtures.py; see its
 * docstring for the files): each family loaded from its Hugging Face directory and from its GGUF
 * (general.architecture "qwen2" / "qwen3", written as convert_hf_to_gguf.py names the tensors),
 * dequantised to fp32 and kept as GGUF blocks (base_dtype "gguf"): logits and loss of the packed
 * batch without and with the PEFT adapter, the LoRA gradients (through Qwen2's frozen q/k/v biases
 * and Qwen3's per-head QK-norm), and the inference path (KV cache, two chunks) against the same
 * logits. Each check can fail: without the biases / the QK-norm the logits are far off.
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

#include "common/bt_common.h"
#include "common/safetensors.h"
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

static bt_st_file *open_fix(const char *rel) { return tu_fix_open("qwen", rel); }

static const float *fix_f32(const bt_st_file *f, const char *name, int64_t n) {
    return tu_st_data((bt_st_file *)f, name, BT_ST_F32, n);
}

typedef tu_fix_batch batch;

/* source: "hf" (the directory), "gguf" (model.gguf dequantised to fp32), "native" (model.gguf
 * kept as BF16 blocks, base_dtype "gguf") */
static void load_model(bt_model *m, const char *fam, const char *source) {
    char p[512];
    int gg = strcmp(source, "hf") != 0;
    snprintf(p, sizeof p, "%s/qwen/%s/%s", tu_hf_fixdir(), fam, gg ? "model.gguf" : "hf");
    bt_model_load_opts o = {!strcmp(source, "native") ? BT_BASE_GGUF : BT_BASE_FP32, 0};
    if (bt_model_load(m, p, &o)) fail_msg("loading %s: %s", p, bt_last_error());
    const int q3 = !strcmp(fam, "qwen3");
    assert_int_equal(m->hp.arch, q3 ? BT_ARCH_QWEN3 : BT_ARCH_QWEN2);
    assert_int_equal(m->hp.qk_norm, q3);
    assert_int_equal(m->hp.head_dim, 16);
    assert_int_equal(m->hp.n_head, q3 ? 4 : 2);
    assert_int_equal(m->hp.d_model, 32);
    assert_int_equal(m->hp.vocab, NV);
    assert_int_equal(m->tied, q3);
    assert_true(m->hp.rope_theta == 1000000.0f);
    for (int l = 0; l < m->hp.n_layer; l++) {
        for (int j = 0; j < BT_MOD_N; j++)
            assert_int_equal(m->layers[l].lin[j].bias != NULL, !q3 && j <= BT_MOD_V);
        assert_int_equal(m->layers[l].q_norm != NULL, q3);
        assert_int_equal(m->layers[l].k_norm != NULL, q3);
    }
}

static void check_family(const char *fam, const char *source) {
    batch b;
    bt_microbatch mb = tu_fix_load_batch("qwen", &b);
    bt_model m;
    load_model(&m, fam, source);
    char rel[128];
    snprintf(rel, sizeof rel, "%s/ref.safetensors", fam);
    bt_st_file *ref = open_fix(rel);
    const float *rl_base = fix_f32(ref, "logits_base", (int64_t)PM * NV);
    float *logits = malloc((size_t)PM * NV * sizeof(float));

    bt_lora lo;
    char dir[512];
    snprintf(dir, sizeof dir, "%s/qwen/%s/adapter-init", tu_hf_fixdir(), fam);
    if (bt_lora_load_peft(&lo, &m, dir)) fail_msg("%s", bt_last_error());
    assert_int_equal(lo.target_mask, (1u << BT_MOD_N) - 1);
    tu_fix_parity(fam, source, &m, &lo, &mb, &b, ref, logits);

    /* the checks can fail: without Qwen2's biases / Qwen3's QK-norm the logits are far off */
    if (m.hp.qk_norm) {
        m.hp.qk_norm = 0;
        tu_fix_forward(&m, NULL, &mb, logits, 0);
        m.hp.qk_norm = 1;
    } else {
        float *keep = m.layers[0].lin[BT_MOD_K].bias;
        m.layers[0].lin[BT_MOD_K].bias = NULL;
        tu_fix_forward(&m, NULL, &mb, logits, 0);
        m.layers[0].lin[BT_MOD_K].bias = keep;
    }
    assert_true(tu_max_abs_diff(logits, rl_base, (int64_t)PM * NV) > 1e-2);

    bt_lora_free(&lo);
    free(logits);
    bt_st_close(ref);
    bt_model_free(&m);
}

static void test_qwen2_hf(void **st) { (void)st; check_family("qwen2", "hf"); }
static void test_qwen2_gguf(void **st) { (void)st; check_family("qwen2", "gguf"); }
static void test_qwen2_gguf_native(void **st) { (void)st; check_family("qwen2", "native"); }
static void test_qwen3_hf(void **st) { (void)st; check_family("qwen3", "hf"); }
static void test_qwen3_gguf(void **st) { (void)st; check_family("qwen3", "gguf"); }
static void test_qwen3_gguf_native(void **st) { (void)st; check_family("qwen3", "native"); }

/* The HF directory and the GGUF hold the same values: every base tensor equal. */
static void test_gguf_equals_hf(void **st) {
    (void)st;
    const char *fams[2] = {"qwen2", "qwen3"};
    for (int f = 0; f < 2; f++) {
        bt_model a, g;
        load_model(&a, fams[f], "hf");
        load_model(&g, fams[f], "gguf");
        const bt_llama_hparams *hp = &a.hp;
        assert_int_equal(memcmp(a.tok_embd, g.tok_embd, (size_t)hp->vocab * hp->d_model * 4), 0);
        assert_int_equal(memcmp(a.lm_head, g.lm_head, (size_t)hp->vocab * hp->d_model * 4), 0);
        for (int l = 0; l < hp->n_layer; l++) {
            for (int j = 0; j < BT_MOD_N; j++) {
                const bt_base_linear *x = &a.layers[l].lin[j], *y = &g.layers[l].lin[j];
                assert_int_equal(memcmp(x->w, y->w, (size_t)x->rows * x->cols * 4), 0);
                if (x->bias) assert_int_equal(memcmp(x->bias, y->bias, (size_t)x->rows * 4), 0);
            }
            if (hp->qk_norm) {
                assert_int_equal(memcmp(a.layers[l].q_norm, g.layers[l].q_norm, hp->head_dim * 4), 0);
                assert_int_equal(memcmp(a.layers[l].k_norm, g.layers[l].k_norm, hp->head_dim * 4), 0);
            }
        }
        bt_model_free(&a);
        bt_model_free(&g);
    }
}

/* The memory plan covers the QK-norm buffers: `trainer estimate` on the Qwen3 files (GGUF and HF
 * directory: head_dim 16, not d_model / n_head = 8) bills exactly the bytes the CPU step context
 * allocates, with checkpointing and without. */
static void test_qwen3_estimate_is_the_plan(void **st) {
    (void)st;
    for (int src = 0; src < 2; src++)
        for (int ck = 0; ck < 2; ck++) {
            bt_model m;
            load_model(&m, "qwen3", src ? "hf" : "gguf");
            char p[512], txt[1024];
            snprintf(p, sizeof p, "%s/qwen/qwen3/%s", tu_hf_fixdir(), src ? "hf" : "model.gguf");
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
            assert_int_equal(em.hp.head_dim, 16);
            assert_int_equal(em.hp.qk_norm, 1);
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
        cmocka_unit_test(test_qwen2_hf),   cmocka_unit_test(test_qwen2_gguf),
        cmocka_unit_test(test_qwen2_gguf_native), cmocka_unit_test(test_qwen3_hf),
        cmocka_unit_test(test_qwen3_gguf), cmocka_unit_test(test_qwen3_gguf_native),
        cmocka_unit_test(test_gguf_equals_hf), cmocka_unit_test(test_qwen3_estimate_is_the_plan),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
