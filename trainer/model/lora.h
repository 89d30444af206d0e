/* LoRA adapters with PEFT semantics (huggingface/peft src/peft/tuners/lora/layer.py, Linear):
 *   y = W x + scaling * B(A(dropout(x))),  scaling = lora_alpha / r,
 *   A [r, in] initialised kaiming_uniform_(a = sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)),
 *   B [out, r] initialised to zeros (so the adapted model starts equal to the base),
 *   dropout = nn.Dropout(lora_dropout) on the LoRA branch input only (inverted: kept values are
 *   scaled by 1/(1-p)); each module has its own mask, as each PEFT module has its own Dropout.
 * All LoRA parameters (fp32) live in ONE contiguous buffer (params), with matching grads and
 * AdamW moments m, v, so clipping and the optimiser run over a single array. Order: layer 0..L-1,
 * module q, k, v, o, gate, up, down (targeted ones only), A then B.
 *
 * Phi-3 (hp.arch BT_ARCH_PHI3, bt_lora.fused): PEFT adapts the FUSED linears Phi3Attention.qkv_proj
 * [Dq + 2 Dkv, D] and Phi3MLP.gate_up_proj [2 F, D] (transformers 5.23 modeling_phi3.py), one
 * lora_A [r, D] and one lora_B [out_fused, r] each; the model holds them split (q, k, v rows;
 * gate rows then up rows: trainer/model/model.h). So q, k and v SHARE one A (and one dA), and
 * their B are consecutive row slices of the one fused B [Dq + 2 Dkv, r] (q rows 0.., k rows Dq..,
 * v rows Dq + Dkv..); gate and up likewise (B [2 F, r]: gate rows 0.., up rows F..). The delta of
 * each slice, scale * B[rows] @ A, is exactly the fused delta's rows, and the shared dA sums the
 * slices' contributions, which is d loss / d A of the fused module. A group is targeted whole
 * (q_proj, k_proj, v_proj together = qkv_proj; gate_proj, up_proj = gate_up_proj) and uses one
 * dropout mask, as PEFT's one nn.Dropout per module (bt_lora_mod.group keys it). The buffer
 * holds the fused A then the fused B at the group's first module.
 *
 * LongLoRA "LoRA+" (arXiv 2309.12307; docs/algorithms.md §LongLoRA): `trainable` may add
 * dense fp32 parameters after the LoRA ones in the same buffers, in this order:
 *   BT_TRAIN_EMBED: the token embedding [vocab, d_model] (a trainable copy of the model's; when
 *     the model ties lm_head to it, the CE reads this copy and its gradient gets both the
 *     lm_head part (bt_linear_ce_dw) and the lookup part (bt_embedding_bwd));
 *   BT_TRAIN_NORM: every RMSNorm weight [(2 * n_layer + 1) * d_model]: layer l's
 *     input_layernorm at (2l) * d_model, post_attention_layernorm at (2l + 1) * d_model, the final
 *     model.norm at 2 * n_layer * d_model.
 * The base model is never modified: step.c reads the trainable copies through bt_lora_embed /
 * bt_lora_norm. Weight decay applies to params [0, n_decay) = LoRA + embedding; the norm weights
 * come last and get none (HF Trainer get_decay_parameter_names excludes norm weights). */
#ifndef BT_TRAINER_LORA_H
#define BT_TRAINER_LORA_H
#include <stdint.h>

#include "trainer/model/model.h"

typedef struct {
    int in, out;
    float *A, *B;     /* [r, in], [out, r] inside bt_lora.params; NULL when not targeted */
    float *dA, *dB;   /* same shapes inside bt_lora.grads */
    /* Phi-3 fused groups (see above): A / dA shared by the group, B / dB = rows [row0, row0 + out)
     * of the fused B [fused_out, r]. Not fused: group = this module, row0 0, fused_out 0. */
    int group;        /* BT_MOD_* of the group's first module (q or gate; the module itself) */
    int row0;         /* first row of this module's slice in the fused B */
    int fused_out;    /* rows of the fused B (0: not fused) */
} bt_lora_mod;

/* One LoRA module as PEFT names and stores it: a plain module, or a Phi-3 fused group at its
 * first module (bt_lora_peft_get). */
typedef struct {
    const char *name;   /* PEFT module name: "q_proj" ... "down_proj", "qkv_proj", "gate_up_proj" */
    const char *gguf;   /* llama.cpp tensor base: "attn_q" ... "ffn_down", "attn_qkv", "ffn_up" */
    int first_mod;      /* BT_MOD_* of the (first) module */
    int n_mods;         /* 1, or 3 (q, k, v) / 2 (gate, up) */
    int in, out;        /* lora_A [r, in], lora_B [out, r] (out: the fused rows) */
    float *A, *B, *dA, *dB;
} bt_lora_peft_mod;

enum { BT_TRAIN_EMBED = 1u << 0, BT_TRAIN_NORM = 1u << 1 };

typedef struct {
    int r;
    float alpha, scale;   /* scale = alpha / r */
    float dropout;        /* probability, [0, 1) */
    unsigned target_mask; /* bit BT_MOD_* */
    int n_layer;
    int fused;            /* 1: Phi-3's fused qkv_proj / gate_up_proj groups (see above) */
    bt_lora_mod *mods;    /* [n_layer * BT_MOD_N] */
    int64_t n_params;
    float *params, *grads, *m, *v; /* [n_params] each, 64-byte aligned, owned */
    /* LoRA+ (see above); all zero / NULL when trainable == 0 */
    unsigned trainable;   /* BT_TRAIN_* */
    int vocab, d_model, tied;
    int64_t n_lora;       /* LoRA A/B entries: params[0, n_lora) */
    int64_t n_decay;      /* entries that get weight decay: [0, n_decay) */
    float *embed, *dembed; /* [vocab, d_model] inside params / grads (BT_TRAIN_EMBED) */
    float *norms, *dnorms; /* [(2 * n_layer + 1) * d_model] inside params / grads (BT_TRAIN_NORM) */
} bt_lora;

/* Allocate and initialise LoRA for every targeted linear of model `md` (A kaiming-uniform from a
 * xoshiro256** stream seeded with `seed`, in the parameter order above; B zeros; grads and
 * moments zeros), plus the dense trainable parameters of `trainable` (BT_TRAIN_* bits; 0 = LoRA
 * only), copied from the model's tensors (embedding, norm weights; a tensor the model does not
 * hold, as in a shape-only model, is left zero for the caller to fill).
 * Errors: BT_ERR_INVALID (r < 1, alpha <= 0, dropout outside [0,1), empty mask, unknown
 * trainable bits), BT_ERR_UNSUPPORTED (a Phi-3 base, hp.arch BT_ARCH_PHI3, with part of a
 * fused group targeted: q/k/v must be targeted together (qkv_proj), gate/up together
 * (gate_up_proj); the message names the fused module), BT_ERR_NOMEM. */
int bt_lora_init(bt_lora *lo, const bt_model *md, int r, double alpha, double dropout,
                 unsigned target_mask, unsigned trainable, uint64_t seed);
void bt_lora_free(bt_lora *lo);

/* The weights the forward must use (lo may be NULL = the base model's):
 * token embedding [vocab, d_model]; lm_head [vocab, d_model] (the trainable embedding when the
 * model is tied and BT_TRAIN_EMBED is on); RMSNorm weight [d_model] of layer l (which 0 =
 * input_layernorm, 1 = post_attention_layernorm) or, for l == n_layer, the final norm. */
const float *bt_lora_embed(const bt_lora *lo, const bt_model *md);
const float *bt_lora_lm_head(const bt_lora *lo, const bt_model *md);
const float *bt_lora_norm(const bt_lora *lo, const bt_model *md, int l, int which);
/* Gradient buffers of the same (NULL when that parameter is not trainable): embedding grad
 * [vocab, d_model]; lm_head grad (== embedding grad when tied and trainable, else NULL); norm
 * grad [d_model] of (l, which). */
float *bt_lora_dembed(const bt_lora *lo);
float *bt_lora_dlm_head(const bt_lora *lo);
float *bt_lora_dnorm(const bt_lora *lo, int l, int which);
/* The module (layer, BT_MOD_*) or NULL when it is not targeted. */
const bt_lora_mod *bt_lora_get(const bt_lora *lo, int layer, int mod);
/* The PEFT module starting at (layer, mod): 1 and *u filled when mod is targeted and is a plain
 * module or the first of a fused group; 0 otherwise (not targeted, or k/v/up inside a group).
 * Iterate mod over [0, BT_MOD_N) to visit every PEFT module of a layer once. */
int bt_lora_peft_get(const bt_lora *lo, int layer, int mod, bt_lora_peft_mod *u);
/* The fused PEFT module name of `mod` on a base of family `arch` ("qkv_proj" for q/k/v and
 * "gate_up_proj" for gate/up on BT_ARCH_PHI3), or NULL when the module is not fused there. */
const char *bt_lora_fused_name(int arch, int mod);
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
