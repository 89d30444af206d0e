/* Forward and backward of the Llama + LoRA model over one packed micro-batch (CPU, fp32).
 *
 * Per layer (HF LlamaDecoderLayer): RMSNorm -> q,k,v (base + LoRA) -> RoPE (rotate_half,
 * position_ids from the batch; the model's table, or for dynamic NTK scaling the table of the
 * micro-batch's longest position, bt_model_rope_table) -> causal GQA attention within the batch's
 * cu_seqlens segments (with S^2-Attn on training passes when bt_step_set_s2 set a group; full
 * attention when evaluating, as LongLoRA does; softmax scale bt_model_attn_scale) ->
 * o_proj (base + LoRA) -> residual -> RMSNorm -> gate, up (base + LoRA) -> SwiGLU -> down
 * (base + LoRA) -> residual; then the final RMSNorm and the chunked fused lm_head +
 * cross-entropy (kernels.h bt_linear_ce; [M x vocab] logits never materialised).
 *
 * Loss: targets are the batch's HF-unshifted labels shifted by one inside each row and segment:
 * target[t] = labels[t+1] when t+1 is in the same row and the same cu_seqlens segment, else -100.
 * bt_forward_backward returns the SUM of token losses; the caller chooses grad_scale (the trainer
 * uses 1 / labelled targets over all micro-batches of the optimiser step, so the gradient is that
 * of the step's mean token loss, as HF Trainer computes with num_items_in_batch).
 *
 * Backward computes only LoRA parameter gradients (accumulated into bt_lora.grads) and the
 * input gradients they need; the base is frozen. With LoRA+ (bt_lora.trainable, lora.h) the
 * forward reads the trainable embedding / norm copies, and backward also accumulates their
 * gradients: RMSNorm dW (bt_rmsnorm_bwd), the embedding lookup's scatter-add (bt_embedding_bwd)
 * and, when lm_head is tied to the embedding, the CE weight gradient (bt_linear_ce_dw). Activations: every layer's are kept for
 * backward (about 28 * M * d_model + 2 * M * d_ff floats per layer), or with activation
 * checkpointing only each layer's input is kept and the layer is recomputed in backward (one
 * extra forward; dropout masks are counter-based, so the recompute is identical). */
#ifndef BT_TRAINER_STEP_H
#define BT_TRAINER_STEP_H
#include <stdint.h>

#include "trainer/backend/microbatch.h"
#include "trainer/model/lora.h"
#include "trainer/model/model.h"

typedef struct bt_step_ctx bt_step_ctx;

/* Workspace for micro-batches of up to max_M tokens (owned; bt_step_ctx_free): the buffers of the
 * step's memory plan (trainer/backend/plan.h: BT_PLAN_CPU, sized by bt_dims_of(&m->hp), lo's rank
 * and targets, the base dtype's dequantisation tiles for omp_get_max_threads() threads), one
 * allocation each. RoPE uses the
 * model's table m->inv_freq (bt_model_rope_init; bt_model_rope_table for dynamic scaling).
 * checkpointing: 1 = keep only each layer's input and recompute the layer in backward. Errors:
 * BT_ERR_INVALID (max_M < 1, a model without m->inv_freq). */
int bt_step_ctx_new(bt_step_ctx **out, const bt_model *m, const bt_lora *lo, int max_M,
                    int checkpointing);
void bt_step_ctx_free(bt_step_ctx *c);
/* Bytes of workspace held: exactly the total of the step's memory plan (trainer/backend/plan.h,
 * bt_plan_step with backend BT_PLAN_CPU for this model, LoRA, max_M and checkpointing), which
 * `trainer estimate` bills. */
size_t bt_step_ctx_bytes(const bt_step_ctx *c);
/* Profile every op of the following forward/backward calls into p (trainer/backend/profile.h; borrowed,
 * must outlive its use); NULL turns profiling off (the default; then nothing is timed). */
struct bt_prof;
void bt_step_ctx_set_profile(bt_step_ctx *c, struct bt_prof *p);
/* LongLoRA S^2-Attn for the training passes (bt_forward_backward with backward != 0): group size
 * in tokens (kernels.h bt_attn_fwd_s2; LongLoRA's group_size_ratio x seq_len), 0 = full attention
 * (the default). Evaluation passes (backward == 0), bt_forward_hidden and bt_forward_logits always
 * use full attention. Errors: BT_ERR_INVALID (negative or odd group). */
int bt_step_set_s2(bt_step_ctx *c, int s2_group);

/* A check asked before every layer of the forward and of the backward (and before the loss's
 * backward): check(arg) returns 0 to go on, or a negative bt_err (with bt_last_error set) that
 * bt_forward_backward / bt_forward_hidden then return at once, abandoning the micro-batch. The
 * trainer uses it to stop mid-step on a signal (BT_ERR_CANCELLED) whatever the step's length:
 * the wait is bounded by one layer's forward or backward. check NULL (default): never asked. */
void bt_step_ctx_set_check(bt_step_ctx *c, int (*check)(void *arg), void *arg);

/* Forward (and backward when `backward`: a training pass, with S^2-Attn if set) of one
 * micro-batch.
 * drop_key: 0 = no dropout (evaluation), else the step's dropout key (see bt_lora_drop_key).
 * grad_scale: multiplies dLoss_sum/d(everything) (see above). LoRA grads ACCUMULATE.
 * *loss_sum: sum of token losses (nats); *n_valid: labelled targets. Either may be NULL.
 * Errors: those of bt_shift_targets (the context is then unchanged), BT_ERR_NOMEM from the
 * attention's scratch, or the error of the check (bt_step_ctx_set_check; the LoRA grads then
 * hold a partial sum: drop the step). */
int bt_forward_backward(bt_step_ctx *c, const bt_model *m, bt_lora *lo, const bt_microbatch *mb,
                        int backward, float grad_scale, uint64_t drop_key, double *loss_sum,
                        int *n_valid);

/* Preference training (trainer/preference.h): the label log-prob of every position instead
 * of the summed cross-entropy, then a backward for whatever per-token upstream gradient the
 * preference loss hands back. Two calls, because that gradient is known only once every
 * sequence's log-prob is (DPO needs a pair's two sums):
 * bt_forward_logprobs: forward of one micro-batch (training pass with S^2-Attn if set when
 *   `backward`, else evaluation) and logp[M] (fp32, caller-owned, M = mb->B * mb->T) = log
 *   softmax(lm_head(xf))[target] at each position whose shifted target (bt_shift_targets) is
 *   labelled, 0 elsewhere; sum them per cu_seqlens segment with bt_seq_sum (kernels.h). lo may be
 *   NULL for the reference (base model, adapter off: TRL's `disable_adapter()`), only when
 *   !backward. *n_valid (may be NULL): labelled targets. The fused chunked lm_head pass never
 *   holds [M x vocab] logits (kernels.h bt_linear_logprob). With `backward`, the context keeps
 *   the activations and the unit-upstream gradient for the backward.
 * bt_backward_logprobs: backward of sum_t dlogp[t] * logp[t] (dlogp [M] fp32, e.g. a sequence's
 *   dloss/dlogp_sum on each of its labelled positions, 0 elsewhere) into the LoRA grads
 *   (ACCUMULATE), the trainable embedding / norms of LoRA+ too. Must directly follow
 *   bt_forward_logprobs with backward on the same `mb` (any other pass in between voids it:
 *   BT_ERR_INVALID); drop_key must be the forward's. A trainable tied lm_head costs one more
 *   vocabulary pass (its gradient needs dlogp inside it).
 * Errors: those of bt_forward_backward; BT_ERR_INVALID for logp / dlogp NULL, a training pass
 * without an adapter, or a backward without its forward. */
int bt_forward_logprobs(bt_step_ctx *c, const bt_model *m, const bt_lora *lo,
                        const bt_microbatch *mb, int backward, uint64_t drop_key, float *logp,
                        int *n_valid);
int bt_backward_logprobs(bt_step_ctx *c, const bt_model *m, bt_lora *lo, const bt_microbatch *mb,
                         const float *dlogp, uint64_t drop_key);

/* Forward only, without the loss: embedding, every layer, the final RMSNorm, for the same
 * micro-batch checks as bt_forward_backward (errors likewise; drop_key 0 = evaluation).
 * The results stay in the context until its next use; read them with bt_step_hidden. */
int bt_forward_hidden(bt_step_ctx *c, const bt_model *m, const bt_lora *lo,
                      const bt_microbatch *mb, uint64_t drop_key);
/* After bt_forward_hidden or bt_forward_backward: the [M, d_model] fp32 activations (borrowed,
 * valid until the context is next used): i = 0 the embeddings, i = 1..n_layer the residual
 * stream after layer i-1 (i = n_layer: the last layer's raw output), i = n_layer + 1 the final
 * RMSNorm's output (HF output_hidden_states[-1]). NULL for any other i. */
const float *bt_step_hidden(const bt_step_ctx *c, int i);

/* Full logits (trainer/loop/logits.c): logits[M, vocab] (fp32, caller-owned, M = mb->B * mb->T) =
 * lm_head(final RMSNorm(hidden)) for every position, including unlabelled and padding ones
 * (each cu_seqlens segment is its own causal context). [M x vocab] is materialised, so this is
 * for evaluation, generation and parity tests, not training. lo may be NULL (base model).
 * Errors: those of bt_forward_hidden. */
int bt_forward_logits(bt_step_ctx *c, const bt_model *m, const bt_lora *lo,
                      const bt_microbatch *mb, float *logits);

#endif
