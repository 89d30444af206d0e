/* The backend interface (trainer/backend/backend.h) and its CPU implementation
 * (trainer/loop/backend_cpu.c), on a tiny random Llama with LoRA+ (trainable norms, so the
 * update has a block without weight decay):
 *   - the registry of a program linked with libbarq.a alone: the CPU backend, no CUDA one, and
 *     device "cuda" refused with the message of a CPU-only trainer;
 *   - the CPU backend IS the reference step: zero_grad + step + update through the interface give
 *     bit for bit the loss, gradient norm, parameters and AdamW moments of bt_forward_backward +
 *     bt_clip_grad_norm + bt_adamw_step called directly, over two optimiser steps;
 *   - update: skip (no labelled token, a non-finite loss) and a non-finite norm change nothing,
 *     a parameter that is not finite after the update is named;
 *   - the run's check hook stops a pass; an evaluation workspace of another size gives the same
 *     forward loss; one process: the collectives are local (allgather copies). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "kernels/kernels.h"
#include "trainer/backend/backend.h"
#include "trainer/loop/optim.h"
#include "trainer/loop/step.h"
#include "trainer/model/lora.h"
#include "trainer/model/model.h"

#define T_ 8
static const bt_llama_hparams k_hp = {
    .n_layer = 2, .d_model = 32, .n_head = 4, .n_kv_head = 2, .head_dim = 8, .d_ff = 64,
    .vocab = 97, .ctx = 64, .rope_theta = 10000.f, .rms_eps = 1e-5f};
/* B = 2, T = 8: two documents in row 0, one in row 1 (its first 3 tokens a prompt) */
static const int32_t k_ids[16] = {5, 17, 42, 8, 91, 33, 60, 0, 12, 7, 77, 23, 54, 3, 88, 41};
static const int32_t k_lab[16] = {-100, 17, 42, 8, 91, 33, -100, -100,
                                  -100, -100, -100, 23, 54, 3, 88, 41};
static const int32_t k_pos[16] = {0, 1, 2, 3, 4, 5, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7};
static const int32_t k_cu[4] = {0, 6, 8, 16};

static bt_microbatch packed(void) {
    bt_microbatch mb = {2, T_, k_ids, k_lab, k_pos, k_cu, 4};
    return mb;
}

static void lora_init(bt_lora *lo, const bt_model *m) {
    assert_int_equal(bt_lora_init(lo, m, 4, 8.0, 0.1, (1u << BT_MOD_N) - 1, BT_TRAIN_NORM, 7), 0);
    for (int64_t i = 0; i < lo->n_params; i++) /* B non-zero: every gradient is exercised */
        if (lo->params[i] == 0.f) lo->params[i] = 0.01f * (float)((i * 7919) % 23 - 11);
    assert_true(lo->n_params > lo->n_decay);
}

static void cfg_init(bt_train_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    cfg->data.micro_batch_size = 2;
    cfg->data.seq_len = T_;
}

static bt_backend *cpu_backend(const bt_train_config *cfg, const bt_model *m, bt_lora *lo,
                               int (*check)(void *), void *arg) {
    const bt_backend_reg *reg = bt_backend_find(BT_DEVICE_CPU);
    assert_non_null(reg);
    bt_backend_params p = {.cfg = cfg, .model = m, .lora = lo, .max_M = 2 * T_, .world = 1,
                           .check = check, .hook_arg = arg};
    bt_backend *b = NULL;
    assert_int_equal(reg->init(&b, &p), 0);
    assert_non_null(b);
    return b;
}

static void test_registry_of_a_cpu_only_program(void **st) {
    (void)st;
    const bt_backend_reg *cpu = bt_backend_find(BT_DEVICE_CPU), *reg = NULL;
    assert_ptr_equal(cpu, &bt_backend_cpu_reg);
    assert_string_equal(cpu->name, "cpu");
    assert_null(cpu->dist_unique_id); /* one process only */
    assert_null(bt_backend_find(BT_DEVICE_CUDA));
    assert_int_equal(bt_backend_get(BT_DEVICE_CPU, &reg), 0);
    assert_ptr_equal(reg, cpu);
    assert_int_equal(bt_backend_get(BT_DEVICE_CUDA, &reg), BT_ERR_UNSUPPORTED);
    assert_null(reg);
    assert_string_equal(bt_last_error(), "config: device: \"cuda\": this trainer was built "
                                         "without CUDA (make CUDA=1)");
}

static void test_cpu_backend_is_the_reference_step(void **st) {
    (void)st;
    bt_model m;
    assert_int_equal(bt_model_init_random(&m, &k_hp, BT_BASE_FP32, 0, 42), 0);
    bt_lora la, lb; /* a: through the interface; b: the functions called directly */
    lora_init(&la, &m);
    lora_init(&lb, &m);
    bt_train_config cfg;
    cfg_init(&cfg);
    bt_backend *be = cpu_backend(&cfg, &m, &la, NULL, NULL);
    bt_step_ctx *ctx;
    assert_int_equal(bt_step_ctx_new(&ctx, &m, &lb, 2 * T_, 0), 0);
    bt_microbatch mb = packed();
    const int n = bt_shift_targets(NULL, &mb, k_hp.vocab);
    for (int step = 1; step <= 2; step++) {
        const uint64_t key = 0x9e3779b97f4a7c15ull * (uint64_t)step | 1;
        const float gs = 1.f / (float)n;
        double sa, sb, na, nb;
        int va, vb;
        int64_t bad = 7;
        assert_int_equal(bt_backend_zero_grad(be), 0);
        assert_int_equal(bt_backend_step(be, &mb, 1, gs, key, &sa, &va), 0);
        const bt_backend_update u = {0.05, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, step, 0};
        assert_int_equal(bt_backend_update_params(be, &u, &na, &bad), 0);
        assert_int_equal(bad, -1);
        bt_lora_zero_grad(&lb);
        assert_int_equal(bt_forward_backward(ctx, &m, &lb, &mb, 1, gs, key, &sb, &vb), 0);
        nb = bt_clip_grad_norm(lb.grads, lb.n_params, 0.05);
        bt_adamw_step(lb.params, lb.grads, lb.m, lb.v, lb.n_decay, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f,
                      step);
        bt_adamw_step(lb.params + lb.n_decay, lb.grads + lb.n_decay, lb.m + lb.n_decay,
                      lb.v + lb.n_decay, lb.n_params - lb.n_decay, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.f,
                      step);
        assert_true(sa == sb && va == vb && va == n);
        assert_true(na == nb && na > 0.05); /* clipped */
        const size_t bytes = (size_t)la.n_params * sizeof(float);
        assert_memory_equal(la.params, lb.params, bytes);
        assert_memory_equal(la.m, lb.m, bytes);
        assert_memory_equal(la.v, lb.v, bytes);
    }
    assert_true(bt_backend_bytes(be) == bt_step_ctx_bytes(ctx));
    size_t held = 1, peak = 1;
    assert_int_equal(bt_backend_device_memory(be, &held, &peak), 0); /* host memory */
    assert_true(held == 0 && peak == 0);
    assert_int_equal(bt_backend_sync_lora(be, 1), 0); /* the host state is the live one */
    bt_backend_free(be);
    bt_step_ctx_free(ctx);
    bt_lora_free(&la);
    bt_lora_free(&lb);
    bt_model_free(&m);
}

static void test_cpu_backend_update_skips_and_names_a_bad_parameter(void **st) {
    (void)st;
    bt_model m;
    assert_int_equal(bt_model_init_random(&m, &k_hp, BT_BASE_FP32, 0, 42), 0);
    bt_lora lo;
    lora_init(&lo, &m);
    bt_train_config cfg;
    cfg_init(&cfg);
    bt_backend *be = cpu_backend(&cfg, &m, &lo, NULL, NULL);
    bt_microbatch mb = packed();
    const size_t bytes = (size_t)lo.n_params * sizeof(float);
    float *before = malloc(bytes);
    assert_non_null(before);
    double loss, norm = 0;
    int64_t bad = 0;
    assert_int_equal(bt_backend_zero_grad(be), 0);
    assert_int_equal(bt_backend_step(be, &mb, 1, 0.1f, 3, &loss, NULL), 0);
    memcpy(before, lo.params, bytes);
    /* skip: the norm is measured, no parameter moves */
    bt_backend_update u = {0, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.f, 1, 1};
    assert_int_equal(bt_backend_update_params(be, &u, &norm, &bad), 0);
    assert_true(norm > 0 && isfinite(norm) && bad == -1);
    assert_memory_equal(before, lo.params, bytes);
    /* a non-finite gradient: a non-finite norm, nothing applied */
    lo.grads[3] = NAN;
    u.skip = 0;
    assert_int_equal(bt_backend_update_params(be, &u, &norm, &bad), 0);
    assert_true(isnan(norm) && bad == -1);
    assert_memory_equal(before, lo.params, bytes);
    /* applied, but parameter 5 is not finite afterwards: named */
    lo.grads[3] = 0.f;
    lo.params[5] = INFINITY;
    assert_int_equal(bt_backend_update_params(be, &u, &norm, &bad), 0);
    assert_true(isfinite(norm));
    assert_int_equal(bad, 5);
    free(before);
    bt_backend_free(be);
    bt_lora_free(&lo);
    bt_model_free(&m);
}

static int g_checks_left; /* the test's own counter for the check hook below */
static int stop_after(void *arg) {
    (void)arg;
    return --g_checks_left < 0 ? bt_fail(BT_ERR_CANCELLED, "interrupted by the test") : 0;
}

static void test_cpu_backend_hooks_workspace_and_collectives(void **st) {
    (void)st;
    bt_model m;
    assert_int_equal(bt_model_init_random(&m, &k_hp, BT_BASE_FP32, 0, 42), 0);
    bt_lora lo;
    lora_init(&lo, &m);
    bt_train_config cfg;
    cfg_init(&cfg);
    g_checks_left = 1000;
    bt_backend *be = cpu_backend(&cfg, &m, &lo, stop_after, NULL);
    bt_microbatch mb = packed();
    double l1, l2;
    int v1, v2;
    assert_int_equal(bt_backend_step(be, &mb, 0, 1.f, 0, &l1, &v1), 0);
    /* a workspace of its own, twice the tokens: the same forward loss */
    bt_backend *big = NULL;
    assert_int_equal(bt_backend_eval_workspace(be, 4 * T_, &big), 0);
    assert_non_null(big);
    assert_true(bt_backend_bytes(big) > 0);
    assert_int_equal(bt_backend_step(big, &mb, 0, 1.f, 0, &l2, &v2), 0);
    assert_true(l1 == l2 && v1 == v2);
    /* the check hook, given at creation, reaches the new workspace too: the pass stops with
     * the hook's error before its second layer */
    g_checks_left = 1;
    assert_int_equal(bt_backend_step(big, &mb, 0, 1.f, 0, &l2, &v2), BT_ERR_CANCELLED);
    g_checks_left = 1;
    assert_int_equal(bt_backend_step(be, &mb, 1, 1.f, 5, &l2, &v2), BT_ERR_CANCELLED);
    bt_backend_free(big);
    /* one process: no collective leaves the process */
    double vals[2] = {1.5, -2};
    assert_int_equal(bt_backend_allreduce_sum(be, vals, 2), 0);
    assert_true(vals[0] == 1.5 && vals[1] == -2);
    assert_int_equal(bt_backend_allreduce_grads(be), 0);
    uint8_t mine[4] = {1, 2, 3, 4}, all[4] = {0};
    assert_int_equal(bt_backend_allgather(be, mine, all, 4), 0);
    assert_memory_equal(mine, all, 4);
    bt_backend_abort(be);
    bt_backend_abort(NULL);
    bt_backend_free(be);
    bt_backend_free(NULL);
    bt_lora_free(&lo);
    bt_model_free(&m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_registry_of_a_cpu_only_program),
        cmocka_unit_test(test_cpu_backend_is_the_reference_step),
        cmocka_unit_test(test_cpu_backend_update_skips_and_names_a_bad_parameter),
        cmocka_unit_test(test_cpu_backend_hooks_workspace_and_collectives),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
