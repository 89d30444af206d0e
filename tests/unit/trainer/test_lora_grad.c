/* LoRA gradients of the full Llama forward/backward against central finite differences, on a
 * tiny random Llama (2 layers, hidden 32, 4 heads, 2 KV heads, FFN 64, vocab 97) with an fp32
 * and an NF4 base, over a packed batch of 2 rows holding 3 documents (one of 1 token) plus
 * padding, also with S^2-Attn in training; document isolation in packed batches; target
 * shifting; activation checkpointing (bit-identical); the PEFT adapter files; and a few optimiser
 * steps that must lower the loss. */
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

#include "common/bt_common.h"
#include "common/safetensors.h"
#include "kernels/kernels.h"
#include "trainer/io/adapter.h"
#include "trainer/model/lora.h"
#include "trainer/model/model.h"
#include "trainer/loop/optim.h"
#include "trainer/model/rng.h"
#include "trainer/loop/step.h"

#define T_ 8
static const bt_llama_hparams k_hp = {
    .n_layer = 2, .d_model = 32, .n_head = 4, .n_kv_head = 2, .head_dim = 8, .d_ff = 64,
    .vocab = 97, .ctx = 64, .rope_theta = 10000.f, .rms_eps = 1e-5f};

/* Packed batch, B=2, T=8:
 *   row 0: doc A (6 tokens, positions 0..5) | doc B (1 token) | padding (1 token)
 *   row 1: doc C (8 tokens), first 3 are a "prompt" (labels -100)
 * labels are HF-unshifted: labels[t] = input_ids[t] where trained, -100 on each document's first
 * token, the prompt and the padding. */
static const int32_t k_ids[16] = {5, 17, 42, 8, 91, 33, 60, 0, 12, 7, 77, 23, 54, 3, 88, 41};
static const int32_t k_lab[16] = {-100, 17, 42, 8, 91, 33, -100, -100,
                                  -100, -100, -100, 23, 54, 3, 88, 41};
static const int32_t k_pos[16] = {0, 1, 2, 3, 4, 5, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7};
static const int32_t k_cu[5] = {0, 6, 7, 8, 16};

static bt_microbatch packed(void) {
    bt_microbatch mb = {2, T_, k_ids, k_lab, k_pos, k_cu, 5};
    return mb;
}

typedef struct {
    bt_model m;
    bt_lora lo;
    bt_step_ctx *ctx;
} rig;

static void rig_init(rig *r, int base_dtype, double dropout) {
    assert_int_equal(bt_model_init_random(&r->m, &k_hp, base_dtype, 0, 42), 0);
    assert_int_equal(bt_lora_init(&r->lo, &r->m, 4, 8.0, dropout, (1u << BT_MOD_N) - 1, 0, 7), 0);
    /* B non-zero so that dA (which is proportional to B) is exercised */
    bt_rng g;
    bt_rng_seed(&g, 99);
    for (int l = 0; l < r->lo.n_layer; l++)
        for (int mod = 0; mod < BT_MOD_N; mod++) {
            const bt_lora_mod *md = bt_lora_get(&r->lo, l, mod);
            for (int i = 0; i < md->out * r->lo.r; i++) md->B[i] = 0.3f * bt_rng_normal(&g);
        }
    assert_int_equal(bt_step_ctx_new(&r->ctx, &r->m, &r->lo, 2 * T_, 0), 0);
}

static void rig_free(rig *r) {
    bt_step_ctx_free(r->ctx);
    bt_lora_free(&r->lo);
    bt_model_free(&r->m);
}

/* The mean token loss of an evaluation pass, or (train != 0) of a training pass, which is what
 * S^2-Attn applies to (grad_scale 0: the gradients it accumulates are zeros). */
static double loss_of_pass(rig *r, const bt_microbatch *mb, uint64_t key, int train) {
    double s;
    int nv;
    assert_int_equal(
        bt_forward_backward(r->ctx, &r->m, &r->lo, mb, train, train ? 0.f : 1.f, key, &s, &nv), 0);
    return s / nv;
}

static double loss_of(rig *r, const bt_microbatch *mb, uint64_t key) {
    return loss_of_pass(r, mb, key, 0);
}

/* Compare every LoRA tensor's gradient with central differences at sampled entries: the entry
 * with the largest |analytic grad| and 3 random ones. Loss = mean token loss. */
static void grad_check_ex(int base_dtype, double dropout, uint64_t key, int s2_group) {
    rig r;
    rig_init(&r, base_dtype, dropout);
    assert_int_equal(bt_step_set_s2(r.ctx, s2_group), 0);
    const int train = s2_group > 0;
    bt_microbatch mb = packed();
    int n = bt_shift_targets(NULL, &mb, k_hp.vocab);
    assert_int_equal(n, 10);
    bt_lora_zero_grad(&r.lo);
    double s;
    int nv;
    assert_int_equal(
        bt_forward_backward(r.ctx, &r.m, &r.lo, &mb, 1, 1.f / (float)n, key, &s, &nv), 0);
    assert_int_equal(nv, n);
    double l0 = s / nv;
    assert_true(isfinite(l0) && l0 > 0.5);
    assert_true(fabs(loss_of_pass(&r, &mb, key, train) - l0) < 1e-6 * l0); /* deterministic */
    bt_lora_zero_grad(&r.lo); /* (the check above may have accumulated) ... then again */
    assert_int_equal(
        bt_forward_backward(r.ctx, &r.m, &r.lo, &mb, 1, 1.f / (float)n, key, &s, &nv), 0);

    const float eps = 1e-3f;
    bt_rng g;
    bt_rng_seed(&g, 1234);
    int checked = 0, worst_i = -1;
    double worst = 0;
    for (int l = 0; l < r.lo.n_layer; l++)
        for (int mod = 0; mod < BT_MOD_N; mod++)
            for (int isB = 0; isB < 2; isB++) {
                const bt_lora_mod *md = bt_lora_get(&r.lo, l, mod);
                float *p = isB ? md->B : md->A, *gr = isB ? md->dB : md->dA;
                int cnt = isB ? md->out * r.lo.r : r.lo.r * md->in;
                int imax = 0;
                double gmax = 0;
                for (int i = 0; i < cnt; i++)
                    if (fabs(gr[i]) > gmax) gmax = fabs(gr[i]), imax = i;
                if (gmax < 1e-6)
                    fail_msg("layer %d %s lora_%c: gradient is identically ~0 (%g)", l,
                             bt_module_name(mod), isB ? 'B' : 'A', gmax);
                for (int k = 0; k < 4; k++) {
                    int i = k == 0 ? imax : (int)(bt_rng_next(&g) % (uint64_t)cnt);
                    float save = p[i];
                    p[i] = save + eps;
                    double lp = loss_of_pass(&r, &mb, key, train);
                    p[i] = save - eps;
                    double lm = loss_of_pass(&r, &mb, key, train);
                    p[i] = save;
                    double fd = (lp - lm) / (2.0 * eps), an = gr[i];
                    double err = fabs(fd - an);
                    double tol = 2e-2 * fmax(fabs(fd), fabs(an)) + 2e-3 * gmax + 2e-5;
                    if (err > tol)
                        fail_msg("base %s: layer %d %s lora_%c[%d]: analytic %.6g vs finite "
                                 "difference %.6g (tensor max |g| %.3g)",
                                 base_dtype == BT_BASE_NF4 ? "nf4" : "fp32", l,
                                 bt_module_name(mod), isB ? 'B' : 'A', i, an, fd, gmax);
                    if (err / (tol) > worst) worst = err / tol, worst_i = checked;
                    checked++;
                }
            }
    assert_int_equal(checked, 2 * 7 * 2 * 4);
    (void)worst_i;
    rig_free(&r);
}

static void grad_check(int base_dtype, double dropout, uint64_t key) {
    grad_check_ex(base_dtype, dropout, key, 0);
}

static void test_grad_fp32(void **st) {
    (void)st;
    grad_check(BT_BASE_FP32, 0.0, 0);
}
static void test_grad_nf4(void **st) {
    (void)st;
    grad_check(BT_BASE_NF4, 0.0, 0);
}
/* Dropout masks are counter-based, so with a fixed key the loss is a deterministic function of
 * the parameters and the gradient (through the masks) can be checked the same way. */
static void test_grad_dropout(void **st) {
    (void)st;
    grad_check(BT_BASE_FP32, 0.2, 0x1234567ULL);
}

/* Dropout is active with a key and off without; different keys give different losses. */
static void test_dropout_keys(void **st) {
    (void)st;
    rig r;
    rig_init(&r, BT_BASE_FP32, 0.3);
    bt_microbatch mb = packed();
    double l0 = loss_of(&r, &mb, 0), l1 = loss_of(&r, &mb, 11), l1b = loss_of(&r, &mb, 11),
           l2 = loss_of(&r, &mb, 12);
    assert_true(l1 == l1b);
    assert_true(l0 != l1 && l1 != l2);
    rig_free(&r);
}

static void test_shift_targets(void **st) {
    (void)st;
    bt_microbatch mb = packed();
    int32_t tg[16];
    assert_int_equal(bt_shift_targets(tg, &mb, k_hp.vocab), 10);
    /* row 0: doc A predicts its tokens 1..5; its last token must not predict doc B; doc B and
     * the padding predict nothing; row 1: positions 2..6 predict 23..41, the row end nothing. */
    const int32_t want[16] = {17, 42, 8, 91, 33, -100, -100, -100,
                              -100, -100, 23, 54, 3, 88, 41, -100};
    for (int i = 0; i < 16; i++)
        if (tg[i] != want[i]) fail_msg("target[%d] = %d, want %d", i, tg[i], want[i]);
    /* malformed batches are refused, not crashed on */
    int32_t bad_ids[16];
    memcpy(bad_ids, k_ids, sizeof bad_ids);
    bad_ids[3] = 97;
    bt_microbatch b1 = mb;
    b1.input_ids = bad_ids;
    assert_int_equal(bt_shift_targets(tg, &b1, k_hp.vocab), BT_ERR_RANGE);
    int32_t bad_cu[4] = {0, 6, 12, 16}; /* misses the row start at 8 */
    bt_microbatch b2 = mb;
    b2.cu_seqlens = bad_cu;
    b2.n_cu = 4;
    assert_int_equal(bt_shift_targets(tg, &b2, k_hp.vocab), BT_ERR_INVALID);
    int32_t bad_cu2[3] = {0, 8, 15}; /* does not end at M */
    b2.cu_seqlens = bad_cu2;
    b2.n_cu = 3;
    assert_int_equal(bt_shift_targets(tg, &b2, k_hp.vocab), BT_ERR_INVALID);
    int32_t bad_lab[16];
    memcpy(bad_lab, k_lab, sizeof bad_lab);
    bad_lab[2] = -5;
    bt_microbatch b3 = mb;
    b3.labels = bad_lab;
    assert_int_equal(bt_shift_targets(tg, &b3, k_hp.vocab), BT_ERR_RANGE);
}

/* Doc X = [21, 5, 64, 9, 30] (5 tokens). Alone: B=1, T=8, doc X then 3 padding tokens.
 * Packed: row 0 = doc Y (2 tokens) | doc X | 1 padding; row 1 = doc Z (8 tokens). Only X is
 * labelled. Loss and LoRA gradients must match; merging Y and X into one segment (a leak)
 * must change the loss, showing the check can fail. */
static void test_packing_isolation(void **st) {
    (void)st;
    rig r;
    rig_init(&r, BT_BASE_FP32, 0.0);
    const int32_t a_ids[8] = {21, 5, 64, 9, 30, 0, 0, 0};
    const int32_t a_lab[8] = {-100, 5, 64, 9, 30, -100, -100, -100};
    const int32_t a_pos[8] = {0, 1, 2, 3, 4, 0, 1, 2};
    const int32_t a_cu[3] = {0, 5, 8};
    bt_microbatch alone = {1, 8, a_ids, a_lab, a_pos, a_cu, 3};
    const int32_t p_ids[16] = {70, 71, 21, 5, 64, 9, 30, 0, 11, 12, 13, 14, 15, 16, 17, 18};
    const int32_t p_lab[16] = {-100, -100, -100, 5, 64, 9, 30, -100,
                               -100, -100, -100, -100, -100, -100, -100, -100};
    const int32_t p_pos[16] = {0, 1, 0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 5, 6, 7};
    const int32_t p_cu[5] = {0, 2, 7, 8, 16};
    bt_microbatch pk = {2, 8, p_ids, p_lab, p_pos, p_cu, 5};

    int64_t np = r.lo.n_params;
    float *g1 = malloc((size_t)np * sizeof(float));
    double s1, s2;
    int n1, n2;
    bt_lora_zero_grad(&r.lo);
    assert_int_equal(bt_forward_backward(r.ctx, &r.m, &r.lo, &alone, 1, 1.f, 0, &s1, &n1), 0);
    memcpy(g1, r.lo.grads, (size_t)np * sizeof(float));
    bt_lora_zero_grad(&r.lo);
    assert_int_equal(bt_forward_backward(r.ctx, &r.m, &r.lo, &pk, 1, 1.f, 0, &s2, &n2), 0);
    assert_int_equal(n1, 4);
    assert_int_equal(n2, 4);
    if (fabs(s1 - s2) > 1e-5 * fabs(s1)) fail_msg("packed loss %.8g != alone %.8g", s2, s1);
    double gn = sqrt(bt_sumsq(g1, np)), dn = 0;
    for (int64_t i = 0; i < np; i++) dn += ((double)g1[i] - r.lo.grads[i]) * ((double)g1[i] - r.lo.grads[i]);
    if (sqrt(dn) > 1e-4 * gn) fail_msg("packed grads differ: |diff| %.3g vs |g| %.3g", sqrt(dn), gn);

    /* the leak: Y and X in one segment with continuing positions */
    const int32_t l_pos[16] = {0, 1, 2, 3, 4, 5, 6, 0, 0, 1, 2, 3, 4, 5, 6, 7};
    const int32_t l_cu[4] = {0, 7, 8, 16};
    bt_microbatch leak = {2, 8, p_ids, p_lab, l_pos, l_cu, 4};
    double s3;
    int n3;
    assert_int_equal(bt_forward_backward(r.ctx, &r.m, &r.lo, &leak, 0, 1.f, 0, &s3, &n3), 0);
    assert_int_equal(n3, 4);
    if (fabs(s3 - s1) < 1e-3 * fabs(s1)) fail_msg("a leaking batch gave the same loss (%g)", s3);
    free(g1);
    rig_free(&r);
}

/* Grad accumulation with grad_scale = 1/total equals one batch holding both. */
static void test_accumulation(void **st) {
    (void)st;
    rig r;
    rig_init(&r, BT_BASE_FP32, 0.0);
    bt_microbatch mb = packed();
    bt_microbatch r0 = {1, T_, k_ids, k_lab, k_pos, k_cu, 4};
    const int32_t cu1[2] = {0, 8};
    bt_microbatch r1 = {1, T_, k_ids + 8, k_lab + 8, k_pos + 8, cu1, 2};
    int64_t np = r.lo.n_params;
    float *g = malloc((size_t)np * sizeof(float));
    bt_lora_zero_grad(&r.lo);
    assert_int_equal(bt_forward_backward(r.ctx, &r.m, &r.lo, &mb, 1, 1.f / 10, 0, NULL, NULL), 0);
    memcpy(g, r.lo.grads, (size_t)np * sizeof(float));
    bt_lora_zero_grad(&r.lo);
    int n0 = bt_shift_targets(NULL, &r0, 97), n1 = bt_shift_targets(NULL, &r1, 97);
    assert_int_equal(n0 + n1, 10);
    assert_int_equal(bt_forward_backward(r.ctx, &r.m, &r.lo, &r0, 1, 1.f / 10, 0, NULL, NULL), 0);
    assert_int_equal(bt_forward_backward(r.ctx, &r.m, &r.lo, &r1, 1, 1.f / 10, 0, NULL, NULL), 0);
    double dn = 0, gn = 0;
    for (int64_t i = 0; i < np; i++) {
        dn += ((double)g[i] - r.lo.grads[i]) * ((double)g[i] - r.lo.grads[i]);
        gn += (double)g[i] * g[i];
    }
    if (sqrt(dn) > 1e-4 * sqrt(gn)) fail_msg("accumulated grads differ by %.3g", sqrt(dn / gn));
    free(g);
    rig_free(&r);
}

/* Activation checkpointing recomputes each layer: the same loss and gradients, bit for bit
 * (dropout on, NF4 base), also with S^2-Attn in training, a YaRN context extension and LoRA+
 * (trainable embedding and norms). */
static void test_checkpointing(void **st) {
    (void)st;
    for (int cfg = 0; cfg < 3; cfg++) {
        rig r;
        if (cfg < 2) {
            rig_init(&r, BT_BASE_NF4, 0.1);
        } else { /* LoRA+ */
            assert_int_equal(bt_model_init_random(&r.m, &k_hp, BT_BASE_NF4, 1, 42), 0);
            assert_int_equal(bt_lora_init(&r.lo, &r.m, 4, 8.0, 0.1, (1u << BT_MOD_N) - 1,
                                             BT_TRAIN_EMBED | BT_TRAIN_NORM, 7), 0);
            r.ctx = NULL;
        }
        if (cfg >= 1) assert_int_equal(bt_model_extend_context(&r.m, BT_ROPE_EXT_YARN, 256), 0);
        bt_step_ctx_free(r.ctx);
        bt_step_ctx *ck = NULL;
        assert_int_equal(bt_step_ctx_new(&r.ctx, &r.m, &r.lo, 2 * T_, 0), 0);
        assert_int_equal(bt_step_ctx_new(&ck, &r.m, &r.lo, 2 * T_, 1), 0);
        if (cfg >= 1) {
            assert_int_equal(bt_step_set_s2(r.ctx, 4), 0);
            assert_int_equal(bt_step_set_s2(ck, 4), 0);
        }
        bt_microbatch mb = packed();
        int64_t np = r.lo.n_params;
        float *g = malloc((size_t)np * sizeof(float));
        double s1, s2;
        bt_lora_zero_grad(&r.lo);
        assert_int_equal(bt_forward_backward(r.ctx, &r.m, &r.lo, &mb, 1, 0.1f, 77, &s1, NULL), 0);
        memcpy(g, r.lo.grads, (size_t)np * sizeof(float));
        bt_lora_zero_grad(&r.lo);
        assert_int_equal(bt_forward_backward(ck, &r.m, &r.lo, &mb, 1, 0.1f, 77, &s2, NULL), 0);
        if (s1 != s2) fail_msg("config %d: checkpointed loss %.17g != %.17g", cfg, s2, s1);
        for (int64_t i = 0; i < np; i++)
            if (memcmp(&g[i], &r.lo.grads[i], sizeof(float)) != 0)
                fail_msg("config %d: checkpointed grad[%lld] %.9g != %.9g (not bit-identical)",
                         cfg, (long long)i, r.lo.grads[i], g[i]);
        free(g);
        bt_step_ctx_free(ck);
        rig_free(&r);
    }
}

/* S^2-Attn in training: the LoRA gradients of the training pass (groups of 4 tokens: the 6- and
 * 8-token documents split into groups, half the heads shifted) against finite differences of
 * that same pass; the training loss differs from full attention, an evaluation pass ignores S^2,
 * and a group as long as the row is full attention. */
static void test_grad_s2(void **st) {
    (void)st;
    grad_check_ex(BT_BASE_FP32, 0.0, 0, 4);
    rig r;
    rig_init(&r, BT_BASE_FP32, 0.0);
    bt_microbatch mb = packed();
    const double full_train = loss_of_pass(&r, &mb, 0, 1), full_eval = loss_of(&r, &mb, 0);
    assert_int_equal(bt_step_set_s2(r.ctx, 4), 0);
    const double s2_train = loss_of_pass(&r, &mb, 0, 1), s2_eval = loss_of(&r, &mb, 0);
    fprintf(stderr, "# loss: full %.6f, S2 (G=4) training %.6f, S2 evaluation %.6f\n", full_train,
            s2_train, s2_eval);
    assert_true(full_train == full_eval && s2_eval == full_eval);
    assert_true(fabs(s2_train - full_train) > 1e-4);
    assert_int_equal(bt_step_set_s2(r.ctx, 2 * T_), 0); /* shifted groups [0, T) cover a row */
    assert_true(loss_of_pass(&r, &mb, 0, 1) == full_train);
    assert_int_equal(bt_step_set_s2(r.ctx, 3), BT_ERR_INVALID);
    rig_free(&r);
}

/* LoRA init follows PEFT: A ~ U(-1/sqrt(in), 1/sqrt(in)), B = 0, so the adapted model equals
 * the base at step 0. */
static void test_init(void **st) {
    (void)st;
    bt_model m;
    assert_int_equal(bt_model_init_random(&m, &k_hp, BT_BASE_FP32, 1, 3), 0);
    bt_lora lo;
    assert_int_equal(bt_lora_init(&lo, &m, 8, 16, 0.05, (1u << BT_MOD_Q) | (1u << BT_MOD_DOWN), 0, 5), 0);
    assert_int_equal(lo.n_params, 2 * (8 * (32 + 32) + 8 * (64 + 32)));
    assert_true(lo.scale == 2.0f);
    assert_null(bt_lora_get(&lo, 0, BT_MOD_K));
    const bt_lora_mod *q = bt_lora_get(&lo, 1, BT_MOD_Q), *d = bt_lora_get(&lo, 1, BT_MOD_DOWN);
    assert_non_null(q);
    assert_int_equal(d->in, 64);
    assert_int_equal(d->out, 32);
    double mx = 0, s2 = 0;
    for (int i = 0; i < 8 * 64; i++) {
        mx = fmax(mx, fabs(d->A[i]));
        s2 += (double)d->A[i] * d->A[i];
    }
    for (int i = 0; i < 32 * 8; i++) assert_true(d->B[i] == 0.f);
    assert_true(mx <= 1.0 / 8.0 && mx > 0.9 / 8.0);                   /* bound 1/sqrt(64) */
    assert_true(fabs(s2 / 512 - 1.0 / (3 * 64)) < 0.25 / (3 * 64)); /* var of U(-b,b) = b^2/3 */
    bt_lora bad;
    assert_int_equal(bt_lora_init(&bad, &m, 0, 16, 0.0, 1, 0, 5), BT_ERR_INVALID);
    assert_int_equal(bt_lora_init(&bad, &m, 4, 16, 1.0, 1, 0, 5), BT_ERR_INVALID);
    /* B = 0: the LoRA model's loss equals the base model's */
    bt_step_ctx *c;
    assert_int_equal(bt_step_ctx_new(&c, &m, &lo, 16, 0), 0);
    bt_microbatch mb = packed();
    double a, b;
    assert_int_equal(bt_forward_backward(c, &m, &lo, &mb, 0, 1, 0, &a, NULL), 0);
    assert_int_equal(bt_forward_backward(c, &m, NULL, &mb, 0, 1, 0, &b, NULL), 0);
    assert_true(a == b);
    bt_step_ctx_free(c);
    bt_lora_free(&lo);
    bt_model_free(&m);
}

static void test_adapter_files(void **st) {
    (void)st;
    rig r;
    rig_init(&r, BT_BASE_FP32, 0.05);
    char dir[] = "/tmp/bt_adapter_XXXXXX";
    assert_non_null(mkdtemp(dir));
    char out[256], path[300];
    snprintf(out, sizeof out, "%s/run/adapter", dir);
    assert_int_equal(bt_adapter_save(&r.lo, "HuggingFaceTB/SmolLM2-135M-Instruct", out, NULL), 0);
    r.lo.params[0] += 1.0f; /* second save replaces the first */
    assert_int_equal(bt_adapter_save(&r.lo, "HuggingFaceTB/SmolLM2-135M-Instruct", out, NULL), 0);
    snprintf(path, sizeof path, "%s/adapter_model.safetensors", out);
    bt_st_file *f;
    assert_int_equal(bt_st_open(&f, path), 0);
    assert_int_equal(bt_st_n_tensors(f), 2 * 7 * 2);
    assert_string_equal(bt_st_metadata(f, "format"), "pt");
    const bt_st_tensor *t =
        bt_st_find(f, "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight");
    assert_non_null(t);
    assert_int_equal(t->dtype, BT_ST_F32);
    assert_int_equal(t->n_dims, 2);
    assert_int_equal(t->shape[0], 4);
    assert_int_equal(t->shape[1], 32);
    assert_memory_equal(t->data, bt_lora_get(&r.lo, 0, BT_MOD_Q)->A, 4 * 32 * 4);
    t = bt_st_find(f, "base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight");
    assert_non_null(t);
    assert_int_equal(t->shape[0], 16); /* n_kv_head * head_dim */
    assert_int_equal(t->shape[1], 4);
    assert_memory_equal(t->data, bt_lora_get(&r.lo, 1, BT_MOD_K)->B, 16 * 4 * 4);
    t = bt_st_find(f, "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight");
    assert_non_null(t);
    assert_int_equal(t->shape[0], 4);
    assert_int_equal(t->shape[1], 64);
    bt_st_close(f);

    snprintf(path, sizeof path, "%s/adapter_config.json", out);
    json_error_t e;
    json_t *j = json_load_file(path, 0, &e);
    assert_non_null(j);
    assert_string_equal(json_string_value(json_object_get(j, "peft_type")), "LORA");
    assert_string_equal(json_string_value(json_object_get(j, "task_type")), "CAUSAL_LM");
    assert_int_equal(json_integer_value(json_object_get(j, "r")), 4);
    assert_int_equal(json_integer_value(json_object_get(j, "lora_alpha")), 8);
    assert_true(fabs(json_real_value(json_object_get(j, "lora_dropout")) - 0.05) < 1e-7);
    assert_int_equal(json_array_size(json_object_get(j, "target_modules")), 7);
    assert_string_equal(json_string_value(json_object_get(j, "base_model_name_or_path")),
                        "HuggingFaceTB/SmolLM2-135M-Instruct");
    assert_string_equal(json_string_value(json_object_get(j, "bias")), "none");
    assert_true(json_is_false(json_object_get(j, "fan_in_fan_out")));
    assert_true(json_is_true(json_object_get(j, "inference_mode")));
    assert_true(json_is_null(json_object_get(j, "modules_to_save")));
    assert_true(json_is_false(json_object_get(j, "use_rslora")));
    json_decref(j);
    /* no temp directories left behind */
    char cmd[400];
    snprintf(cmd, sizeof cmd, "test $(ls -A %s/run | wc -l) -eq 1", dir);
    assert_int_equal(system(cmd), 0);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);
    rig_free(&r);
}

/* AdamW on the LoRA parameters over a fixed batch must drive the loss down (memorisation). */
static void test_training_lowers_loss(void **st) {
    (void)st;
    bt_model m;
    assert_int_equal(bt_model_init_random(&m, &k_hp, BT_BASE_NF4, 1, 11), 0);
    bt_lora lo;
    assert_int_equal(bt_lora_init(&lo, &m, 4, 8, 0.0, (1u << BT_MOD_N) - 1, 0, 5), 0);
    bt_step_ctx *c;
    assert_int_equal(bt_step_ctx_new(&c, &m, &lo, 16, 0), 0);
    bt_microbatch mb = packed();
    bt_schedule sch = {BT_SCHED_COSINE, 2e-2, 0.1, 2, 30};
    double first = 0, last = 0;
    for (int s = 0; s < 30; s++) {
        bt_lora_zero_grad(&lo);
        double ls;
        int nv;
        assert_int_equal(bt_forward_backward(c, &m, &lo, &mb, 1, 1.f / 10, 0, &ls, &nv), 0);
        if (s == 0) first = ls / nv;
        last = ls / nv;
        bt_clip_grad_norm(lo.grads, lo.n_params, 1.0);
        bt_adamw_step(lo.params, lo.grads, lo.m, lo.v, lo.n_params, (float)bt_schedule_lr(&sch, s),
                      0.9f, 0.999f, 1e-8f, 0.0f, s + 1);
    }
    if (!(last < 0.5 * first)) fail_msg("loss %.4f -> %.4f after 30 steps", first, last);
    bt_step_ctx_free(c);
    bt_lora_free(&lo);
    bt_model_free(&m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shift_targets),   cmocka_unit_test(test_init),
        cmocka_unit_test(test_grad_fp32),       cmocka_unit_test(test_grad_nf4),
        cmocka_unit_test(test_grad_dropout),    cmocka_unit_test(test_dropout_keys),
        cmocka_unit_test(test_packing_isolation), cmocka_unit_test(test_accumulation),
        cmocka_unit_test(test_checkpointing),   cmocka_unit_test(test_grad_s2),
        cmocka_unit_test(test_adapter_files),
        cmocka_unit_test(test_training_lowers_loss),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
