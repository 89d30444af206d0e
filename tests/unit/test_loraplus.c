/* LongLoRA "LoRA+" (trainable embedding and norms): the new kernels (bt_linear_ce_dw's weight
 * gradient, bt_embedding_bwd's scatter-add) against references, and the full model's gradients
 * of the embedding (tied: lookup + lm_head; untied: lookup only) and of every RMSNorm weight
 * against central finite differences on a tiny random Llama. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "kernels/kernels.h"
#include "trainer/lora.h"
#include "trainer/model.h"
#include "trainer/rng.h"
#include "trainer/step.h"

/* ---- kernels ---- */

static void fill(float *x, size_t n, uint64_t seed, float sd) {
    bt_rng g;
    bt_rng_seed(&g, seed);
    for (size_t i = 0; i < n; i++) x[i] = sd * bt_rng_normal(&g);
}

/* dW of the chunked CE against finite differences of the loss sum, with chunks that do not
 * divide M and an ignored target; dX must equal bt_linear_ce's. */
static void test_linear_ce_dw(void **st) {
    (void)st;
    enum { M = 7, D = 5, V = 11 };
    float X[M * D], W[V * D], dX[M * D], dX0[M * D], dW[V * D];
    int32_t tg[M] = {3, -100, 10, 0, 7, 7, 2};
    fill(X, M * D, 1, 1.f);
    fill(W, V * D, 2, 0.5f);
    float ws[4 * V + 8];
    assert_true(bt_linear_ce_workspace_floats(4, V) <= sizeof ws / sizeof ws[0]);
    for (int i = 0; i < V * D; i++) dW[i] = 0.25f; /* accumulates */
    int nv, nv0;
    double l = bt_linear_ce_dw(dX, dW, &nv, X, W, tg, M, D, V, 3, 0.5f, ws);
    double l0 = bt_linear_ce(dX0, &nv0, X, W, tg, M, D, V, 3, 0.5f, ws);
    assert_int_equal(nv, 6);
    assert_int_equal(nv0, 6);
    assert_true(l == l0);
    assert_memory_equal(dX, dX0, sizeof dX);
    const float eps = 1e-2f;
    for (int i = 0; i < V * D; i++) {
        float s = W[i];
        W[i] = s + eps;
        double lp = bt_linear_ce(NULL, NULL, X, W, tg, M, D, V, 3, 1.f, ws);
        W[i] = s - eps;
        double lm = bt_linear_ce(NULL, NULL, X, W, tg, M, D, V, 3, 1.f, ws);
        W[i] = s;
        double fd = 0.5 * (lp - lm) / (2.0 * eps), an = dW[i] - 0.25;
        if (fabs(fd - an) > 2e-3 * fmax(1.0, fabs(fd)))
            fail_msg("dW[%d]: analytic %.6g vs finite difference %.6g", i, an, fd);
    }
    /* dW only (dX NULL) gives the same dW */
    float dW2[V * D];
    for (int i = 0; i < V * D; i++) dW2[i] = 0.25f;
    bt_linear_ce_dw(NULL, dW2, NULL, X, W, tg, M, D, V, 4, 0.5f, ws);
    for (int i = 0; i < V * D; i++)
        if (fabs(dW2[i] - dW[i]) > 1e-5f) fail_msg("dW2[%d] %.9g vs %.9g", i, dW2[i], dW[i]);
}

static void test_embedding_bwd(void **st) {
    (void)st;
    enum { M = 9, D = 70, V = 6 }; /* D > 64: two column blocks */
    float dout[M * D], dt[V * D], ref[V * D];
    int32_t ids[M] = {1, 4, 1, 0, 5, 1, -3, 6, 4}; /* repeats; -3 and 6 are out of range */
    fill(dout, M * D, 3, 1.f);
    for (int i = 0; i < V * D; i++) dt[i] = ref[i] = (float)i * 0.001f;
    for (int m = 0; m < M; m++)
        if (ids[m] >= 0 && ids[m] < V)
            for (int d = 0; d < D; d++) ref[ids[m] * D + d] += dout[m * D + d];
    bt_embedding_bwd(dt, dout, ids, M, D, V);
    assert_memory_equal(dt, ref, sizeof dt); /* same order of additions: bit-identical */
    bt_embedding_bwd(dt, dout, ids, 0, D, V); /* no-ops, no crash */
    bt_embedding_bwd(dt, dout, ids, M, 0, V);
}

/* ---- model gradients ---- */

#define T_ 8
static const bt_llama_hparams k_hp = {
    .n_layer = 2, .d_model = 32, .n_head = 4, .n_kv_head = 2, .head_dim = 8, .d_ff = 64,
    .vocab = 97, .ctx = 64, .rope_theta = 10000.f, .rms_eps = 1e-5f};
static const int32_t k_ids[16] = {5, 17, 42, 8, 91, 33, 60, 0, 12, 7, 77, 23, 54, 3, 88, 41};
static const int32_t k_lab[16] = {-100, 17, 42, 8, 91, 33, -100, -100,
                                  -100, -100, -100, 23, 54, 3, 88, 41};
static const int32_t k_pos[16] = {0, 1, 2, 3, 4, 5, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7};
static const int32_t k_cu[5] = {0, 6, 7, 8, 16};

typedef struct {
    bt_model m;
    bt_lora lo;
    bt_step_ctx *ctx;
    bt_microbatch mb;
    int n;
} rig;

static void rig_init(rig *r, int tied, unsigned trainable) {
    assert_int_equal(bt_model_init_random(&r->m, &k_hp, BT_BASE_FP32, tied, 42), 0);
    assert_int_equal(bt_lora_init_ex(&r->lo, &r->m, 4, 8.0, 0.0, (1u << BT_MOD_N) - 1, trainable, 7),
                     0);
    bt_rng g;
    bt_rng_seed(&g, 99);
    for (int l = 0; l < r->lo.n_layer; l++)
        for (int mod = 0; mod < BT_MOD_N; mod++) {
            const bt_lora_mod *md = bt_lora_get(&r->lo, l, mod);
            for (int i = 0; i < md->out * r->lo.r; i++) md->B[i] = 0.3f * bt_rng_normal(&g);
        }
    assert_int_equal(bt_step_ctx_new(&r->ctx, &r->m, &r->lo, 2 * T_, 0), 0);
    bt_microbatch mb = {2, T_, k_ids, k_lab, k_pos, k_cu, 5};
    r->mb = mb;
    r->n = bt_shift_targets(NULL, &mb, k_hp.vocab);
    assert_int_equal(r->n, 10);
}

static void rig_free(rig *r) {
    bt_step_ctx_free(r->ctx);
    bt_lora_free(&r->lo);
    bt_model_free(&r->m);
}

static double loss_of(rig *r) {
    double s;
    int nv;
    assert_int_equal(bt_forward_backward(r->ctx, &r->m, &r->lo, &r->mb, 0, 1.f, 0, &s, &nv), 0);
    return s / nv;
}

static void check_entry(rig *r, float *p, const float *g, const char *what, int i, double gmax) {
    const float eps = 1e-3f;
    float save = p[i];
    p[i] = save + eps;
    double lp = loss_of(r);
    p[i] = save - eps;
    double lm = loss_of(r);
    p[i] = save;
    double fd = (lp - lm) / (2.0 * eps), an = g[i];
    double tol = 2e-2 * fmax(fabs(fd), fabs(an)) + 2e-3 * gmax + 2e-5;
    if (fabs(fd - an) > tol)
        fail_msg("%s[%d]: analytic %.6g vs finite difference %.6g (max |g| %.3g)", what, i, an, fd,
                 gmax);
}

static void grad_check(int tied) {
    rig r;
    rig_init(&r, tied, BT_TRAIN_EMBED | BT_TRAIN_NORM);
    const int D = k_hp.d_model, V = k_hp.vocab, L = k_hp.n_layer;
    assert_int_equal(r.lo.n_params, r.lo.n_lora + (int64_t)V * D + (int64_t)(2 * L + 1) * D);
    assert_int_equal(r.lo.n_decay, r.lo.n_lora + (int64_t)V * D);
    /* the trainable copies start equal to the base */
    assert_memory_equal(r.lo.embed, r.m.tok_embd, (size_t)V * D * 4);
    assert_memory_equal(r.lo.norms + (size_t)2 * L * D, r.m.output_norm, (size_t)D * 4);
    double l_base = loss_of(&r);
    bt_lora_zero_grad(&r.lo);
    double s;
    int nv;
    assert_int_equal(
        bt_forward_backward(r.ctx, &r.m, &r.lo, &r.mb, 1, 1.f / (float)r.n, 0, &s, &nv), 0);
    assert_true(fabs(s / nv - l_base) < 1e-9);
    /* embedding: rows of input tokens; a row that is only a CE target / only in the vocabulary
     * gets an lm_head gradient when tied and none otherwise */
    double gmax = 0;
    for (int64_t i = 0; i < (int64_t)V * D; i++) gmax = fmax(gmax, fabs(r.lo.dembed[i]));
    assert_true(gmax > 1e-6);
    const int rows[] = {5, 42, 91, 0, 77, 88, 41, 60}; /* input ids */
    for (size_t k = 0; k < sizeof rows / sizeof rows[0]; k++)
        for (int d = 0; d < D; d += 7) check_entry(&r, r.lo.embed, r.lo.dembed, "embed", rows[k] * D + d, gmax);
    const int unused = 96; /* not an input id */
    double urow = 0;
    for (int d = 0; d < D; d++) urow = fmax(urow, fabs(r.lo.dembed[unused * D + d]));
    if (tied) assert_true(urow > 1e-7); /* softmax gradient through the tied lm_head */
    else assert_true(urow == 0.0);
    for (int d = 0; d < D; d += 5) check_entry(&r, r.lo.embed, r.lo.dembed, "embed", unused * D + d, gmax);
    /* every norm weight vector (input_layernorm, post_attention_layernorm per layer, final) */
    double nmax = 0;
    for (int64_t i = 0; i < (int64_t)(2 * L + 1) * D; i++) nmax = fmax(nmax, fabs(r.lo.dnorms[i]));
    assert_true(nmax > 1e-6);
    for (int l = 0; l <= L; l++)
        for (int which = 0; which < (l == L ? 1 : 2); which++) {
            float *w = (float *)bt_lora_norm(&r.lo, &r.m, l, which);
            float *g = bt_lora_dnorm(&r.lo, l, which);
            assert_true(w >= r.lo.norms && w < r.lo.norms + (2 * L + 1) * D);
            char what[48];
            snprintf(what, sizeof what, "norm(layer %d, %d)", l, which);
            for (int d = 0; d < D; d += 3) check_entry(&r, w, g, what, d, nmax);
        }
    /* the base model is untouched: perturbing its own tensors no longer changes the loss */
    r.m.tok_embd[5 * D] += 1.0f;
    r.m.output_norm[0] += 1.0f;
    if (!tied) r.m.lm_head[0] += 0.0f;
    assert_true(loss_of(&r) == l_base);
    rig_free(&r);
}

static void test_grad_tied(void **st) {
    (void)st;
    grad_check(1);
}

static void test_grad_untied(void **st) {
    (void)st;
    grad_check(0);
}

/* trainable 0 is exactly plain LoRA: same parameter layout and gradients */
static void test_plain_unchanged(void **st) {
    (void)st;
    rig a, b;
    rig_init(&a, 1, 0);
    assert_int_equal(bt_model_init_random(&b.m, &k_hp, BT_BASE_FP32, 1, 42), 0);
    assert_int_equal(bt_lora_init(&b.lo, &b.m, 4, 8.0, 0.0, (1u << BT_MOD_N) - 1, 7), 0);
    assert_int_equal(a.lo.n_params, b.lo.n_params);
    assert_int_equal(a.lo.n_decay, a.lo.n_params);
    assert_null(a.lo.embed);
    assert_null(bt_lora_dembed(&a.lo));
    assert_null(bt_lora_dnorm(&a.lo, 0, 0));
    assert_ptr_equal(bt_lora_embed(&a.lo, &a.m), a.m.tok_embd);
    assert_ptr_equal(bt_lora_norm(NULL, &a.m, k_hp.n_layer, 0), a.m.output_norm);
    bt_lora bad;
    assert_int_equal(bt_lora_init_ex(&bad, &a.m, 4, 8.0, 0.0, 1, 0x10, 7), BT_ERR_INVALID);
    bt_lora_free(&b.lo);
    bt_model_free(&b.m);
    rig_free(&a);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_linear_ce_dw),    cmocka_unit_test(test_embedding_bwd),
        cmocka_unit_test(test_grad_tied),       cmocka_unit_test(test_grad_untied),
        cmocka_unit_test(test_plain_unchanged),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
