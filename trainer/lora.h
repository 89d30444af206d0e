/* LoRA adapters with PEFT semantics (huggingface/peft src/peft/tuners/lora/layer.py, Linear):
 *   y = W x + scaling * B(A(dropout(x))),  scaling = lora_alpha / r,
 *   A [r, in] initialised kaiming_uniform_(a = sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)),
 *   B [out, r] initialised to zeros (so the adapted model starts equal to the base),
 *   dropout = nn.Dropout(lora_dropout) on the LoRA branch input only (inverted: kept values are
 *   scaled by 1/(1-p)); each module has its own mask, as each PEFT module has its own Dropout.
 * All LoRA parameters (fp32) live in ONE contiguous buffer (params), with matching grads and
 * AdamW moments m, v, so clipping and the optimiser run over a single array. Order: layer 0..L-1,
 * module q, k, v, o, gate, up, down (targeted ones only), A then B. */
#ifndef BT_TRAINER_LORA_H
#define BT_TRAINER_LORA_H
#include <stdint.h>

#include "trainer/model.h"

typedef struct {
    int in, out;
    float *A, *B;     /* [r, in], [out, r] inside bt_lora.params; NULL when not targeted */
    float *dA, *dB;   /* same shapes inside bt_lora.grads */
} bt_lora_mod;

typedef struct {
    int r;
    float alpha, scale;   /* scale = alpha / r */
    float dropout;        /* probability, [0, 1) */
    unsigned target_mask; /* bit BT_MOD_* */
    int n_layer;
    bt_lora_mod *mods;    /* [n_layer * BT_MOD_N] */
    int64_t n_params;
    float *params, *grads, *m, *v; /* [n_params] each, 64-byte aligned, owned */
} bt_lora;

/* Allocate and initialise LoRA for every targeted linear of model `md` (A kaiming-uniform from a
 * xoshiro256** stream seeded with `seed`, in the parameter order above; B zeros; grads and
 * moments zeros). Errors: BT_ERR_INVALID (r < 1, alpha <= 0, dropout outside [0,1), empty mask),
 * BT_ERR_NOMEM. */
int bt_lora_init(bt_lora *lo, const bt_model *md, int r, double alpha, double dropout,
                 unsigned target_mask, uint64_t seed);
void bt_lora_free(bt_lora *lo);
/* The module (layer, BT_MOD_*) or NULL when it is not targeted. */
const bt_lora_mod *bt_lora_get(const bt_lora *lo, int layer, int mod);
void bt_lora_zero_grad(bt_lora *lo);

/* Dropout key for (step key, layer, module); step_key 0 = no dropout (evaluation). */
uint64_t bt_lora_drop_key(uint64_t step_key, int layer, int mod);

/* Forward of the LoRA branch, accumulated into the base output:
 *   as[M, r] = scale * drop(x) @ A^T   (saved for backward)
 *   y[M, out] += as @ B^T
 * x [M, in]. xd: scratch of M*in floats (the dropped input; unused when dropout is off).
 * drop_key 0 disables dropout. */
void bt_lora_fwd(const bt_lora *lo, const bt_lora_mod *md, float *y, const float *x, int M,
                 float *as, float *xd, uint64_t drop_key);
/* Backward of the LoRA branch given dy [M, out]:
 *   dB += dy^T @ as;  da = scale * dy @ B;  dA += da^T @ drop(x);  dx += drop'(da @ A)
 * (grads accumulate, dx accumulates). das: scratch M*r floats; xd: scratch M*in floats.
 * drop_key must equal the forward's. */
void bt_lora_bwd(const bt_lora *lo, const bt_lora_mod *md, float *dx, const float *dy,
                 const float *x, const float *as, int M, float *das, float *xd, uint64_t drop_key);

#endif
