/* Shared stages of the tiny-model parity tests (see parity_util.h). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/safetensors.h"
#include "tests/unit/util/parity_util.h"
#include "trainer/infer/infer.h"
#include "trainer/io/adapter.h"
#include "trainer/loop/step.h"

bt_microbatch tu_fix_load_batch(const char *fam, tu_fix_batch *b) {
    bt_st_file *f = tu_fix_open(fam, "batch.safetensors");
    memcpy(b->ids, tu_st_data(f, "input_ids", BT_ST_I32, TU_FIX_M), sizeof b->ids);
    memcpy(b->lab, tu_st_data(f, "labels", BT_ST_I32, TU_FIX_M), sizeof b->lab);
    memcpy(b->pos, tu_st_data(f, "position_ids", BT_ST_I32, TU_FIX_M), sizeof b->pos);
    memcpy(b->cu, tu_st_data(f, "cu_seqlens", BT_ST_I32, 4), sizeof b->cu);
    bt_st_close(f);
    bt_microbatch mb = {TU_FIX_B, TU_FIX_T, b->ids, b->lab, b->pos, b->cu, 4};
    return mb;
}

double tu_fix_forward(const bt_model *m, bt_lora *lo, const bt_microbatch *mb, float *logits,
                      int ckpt) {
    bt_step_ctx *ctx;
    assert_int_equal(bt_step_ctx_new(&ctx, m, lo, TU_FIX_M, ckpt), 0);
    assert_int_equal(bt_forward_logits(ctx, m, lo, mb, logits), 0);
    double s;
    int nv;
    if (lo) bt_lora_zero_grad(lo);
    assert_int_equal(bt_forward_backward(ctx, m, lo, mb, lo != NULL, 1.f / TU_FIX_NSCORED, 0, &s,
                                         &nv), 0);
    assert_int_equal(nv, TU_FIX_NSCORED);
    bt_step_ctx_free(ctx);
    return s / nv;
}

double tu_fix_infer_err(const bt_model *m, const bt_lora *lo, const tu_fix_batch *b,
                        const float *ref) {
    const int64_t nv = m->hp.vocab;
    bt_infer *s;
    assert_int_equal(bt_infer_new(&s, m, lo, 64, 16), 0);
    float *lg = malloc((size_t)TU_FIX_T * nv * sizeof(float));
    assert_non_null(lg);
    assert_int_equal(bt_infer_forward(s, b->ids + TU_FIX_T, 10, BT_INFER_LOGITS_ALL, lg), 0);
    assert_int_equal(bt_infer_forward(s, b->ids + TU_FIX_T + 10, 14, BT_INFER_LOGITS_ALL,
                                      lg + 10 * nv), 0);
    double e = tu_max_abs_diff(lg, ref + (size_t)TU_FIX_T * nv, (int64_t)TU_FIX_T * nv);
    free(lg);
    bt_infer_free(s);
    return e;
}

double tu_fix_grads_rel_err(const bt_lora *lo, struct bt_st_file *f) {
    double worst = 0;
    char key[192];
    for (int l = 0; l < lo->n_layer; l++) {
        int found = 0;
        for (int mod = 0; mod < BT_MOD_N; mod++) {
            bt_lora_peft_mod u;
            if (!bt_lora_peft_get(lo, l, mod, &u)) continue;
            found++;
            for (int isB = 0; isB < 2; isB++) {
                bt_adapter_peft_key(key, sizeof key, l, &u, isB);
                int64_t n = isB ? (int64_t)u.out * lo->r : (int64_t)lo->r * u.in;
                const float *rg = tu_st_data(f, key, BT_ST_F32, n);
                double den = tu_max_abs(rg, n);
                assert_true(den > 0);
                worst = fmax(worst, tu_max_abs_diff(isB ? u.dB : u.dA, rg, n) / den);
            }
        }
        if (!found) fail_msg("layer %d has no LoRA module", l);
    }
    return worst;
}

void tu_fix_parity(const char *fam, const char *source, const bt_model *m, bt_lora *lo,
                   const bt_microbatch *mb, const tu_fix_batch *b, struct bt_st_file *ref, float *logits) {
    const int64_t n = (int64_t)TU_FIX_M * m->hp.vocab;
    const float *rl_base = tu_st_data(ref, "logits_base", BT_ST_F32, n);
    const float *rl = tu_st_data(ref, "logits", BT_ST_F32, n);
    /* base model */
    double loss = tu_fix_forward(m, NULL, mb, logits, 0);
    double e_base = tu_max_abs_diff(logits, rl_base, n);
    double e_loss_base = fabs(loss - ((const float *)tu_st_data(ref, "loss_base", BT_ST_F32, 1))[0]);
    double e_inf_base = tu_fix_infer_err(m, NULL, b, rl_base);
    /* with the PEFT adapter: logits, loss, LoRA gradients */
    loss = tu_fix_forward(m, lo, mb, logits, 0);
    double e_lora = tu_max_abs_diff(logits, rl, n);
    double e_loss = fabs(loss - ((const float *)tu_st_data(ref, "loss", BT_ST_F32, 1))[0]);
    double e_grad = tu_fix_grads_rel_err(lo, ref);
    double e_inf = tu_fix_infer_err(m, lo, b, rl);
    tu_fix_forward(m, lo, mb, logits, 1); /* activation checkpointing: the same gradients */
    double e_grad_ck = tu_fix_grads_rel_err(lo, ref);
    print_message("parity: %s from %s: logits max abs err %.3g (max |logit| %.3g), loss %.3g; "
                  "with LoRA: logits %.3g, loss %.3g, grads max rel err %.3g; inference (KV cache) "
                  "logits %.3g / %.3g; grads with activation checkpointing %.3g\n", fam, source,
                  e_base, tu_max_abs(rl_base, n), e_loss_base, e_lora, e_loss, e_grad, e_inf_base, e_inf,
                  e_grad_ck);
    assert_true(e_base <= 1e-4);
    assert_true(e_loss_base <= 1e-5);
    assert_true(e_lora <= 1e-4);
    assert_true(e_loss <= 1e-5);
    assert_true(e_grad <= 1e-4);
    assert_true(e_inf_base <= 1e-4);
    assert_true(e_inf <= 1e-4);
    assert_true(e_grad_ck <= 1e-4);
}
