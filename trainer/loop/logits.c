/* Full-vocabulary logits for evaluation and parity tests. See step.h (bt_forward_logits). */
#include "trainer/loop/step.h"

#include "kernels/kernels.h"

int bt_forward_logits(bt_step_ctx *c, const bt_model *m, const bt_lora *lo,
                      const bt_microbatch *mb, float *logits) {
    int rc = bt_forward_hidden(c, m, lo, mb, 0);
    if (rc) return rc;
    const float *xf = bt_step_hidden(c, m->hp.n_layer + 1);
    /* logits = xf[M, D] @ lm_head[V, D]^T (HF: self.lm_head(hidden_states), no bias); the
     * lm_head the loss uses (a trainable tied embedding when LoRA+ trains it, lora.h) */
    bt_linear_fwd(logits, xf, bt_lora_lm_head(lo, m), mb->B * mb->T, m->hp.d_model, m->hp.vocab,
                  0.f);
    return 0;
}
