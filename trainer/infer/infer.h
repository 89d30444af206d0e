/* Inference forward of the Llama + LoRA model with a KV cache (CPU, fp32), for generation and
 * logit parity checks. Separate from step.c's training forward: no activations are kept for
 * backward, no dropout, and the logits are materialised (rows requested by the caller only).
 *
 * Per layer (HF LlamaDecoderLayer, same math as step.c): RMSNorm -> q, k, v (base + LoRA) ->
 * RoPE at the tokens' absolute positions -> causal GQA attention over the cache -> o_proj (base +
 * LoRA) -> residual -> RMSNorm -> gate, up (base + LoRA) -> SwiGLU -> down (base + LoRA) ->
 * residual; then the final RMSNorm and logits = h @ lm_head^T. Linear biases (bt_base_fwd) and
 * the model's RoPE frequency table (bt_model.inv_freq: default, Llama 3.1 "llama3", GGUF
 * rope_freqs, with linear / YaRN scaling; for dynamic NTK the table grows with the session's
 * longest position as transformers' LlamaRotaryEmbedding._dynamic_frequency_update grows it, keys
 * already cached keeping their rotation) are honoured, with YaRN's attention factor in the softmax
 * scale (bt_model_attn_scale). Attention is full (never S^2-Attn). With LoRA+ (lora.h) the embedding, norm
 * weights and tied lm_head are read through bt_lora_embed / bt_lora_norm / bt_lora_lm_head, as
 * step.c does, so a session and the training forward give the same logits.
 *
 * Cache: per layer K and V [max_ctx, n_kv_head * head_dim] fp32, K after RoPE. A call with n
 * tokens appends them at positions pos .. pos+n-1 (pos = tokens already cached) and attends each
 * to every cached position <= its own. Attention: a chunk that starts an empty cache goes through
 * kernels.h bt_attn_fwd (one segment); a chunk after cached tokens (decode, or a continued
 * prefill) uses this file's own query-vs-cache attention (softmax with max subtraction, fp32,
 * OpenMP over query x head). Long inputs are processed in chunks of at most max_chunk tokens.
 *
 * Thread safety: one bt_infer per thread; the model and LoRA are only read. */
#ifndef BT_TRAINER_INFER_H
#define BT_TRAINER_INFER_H
#include <stddef.h>
#include <stdint.h>

#include "trainer/model/lora.h"
#include "trainer/model/model.h"

typedef struct bt_infer bt_infer;

/* Which logits bt_infer_forward writes. */
enum { BT_INFER_LOGITS_NONE = 0, BT_INFER_LOGITS_LAST = 1, BT_INFER_LOGITS_ALL = 2 };

/* Create a session for model m (borrowed; must outlive the session) with optional LoRA lo
 * (borrowed, may be NULL; its modules are applied with their scale and no dropout), a cache of
 * max_ctx positions (>= 1) and chunks of at most max_chunk tokens (>= 1; workspace scales with
 * it, about max_chunk * (6 d_model + 3 d_ff + 4 n_head*head_dim) floats). *out is owned by the
 * caller (bt_infer_free); NULL on error. Errors: BT_ERR_INVALID (max_ctx or max_chunk < 1, LoRA
 * layer count differing from the model's, a model without its RoPE table m->inv_freq),
 * BT_ERR_NOMEM (the message gives the cache size). */
int bt_infer_new(bt_infer **out, const bt_model *m, const bt_lora *lo, int max_ctx, int max_chunk);
void bt_infer_free(bt_infer *s);

/* Forget the cached tokens (the next forward starts at position 0). */
void bt_infer_reset(bt_infer *s);
/* Tokens cached so far (= the position the next token gets). */
int bt_infer_pos(const bt_infer *s);
/* Cache capacity (max_ctx given at creation). */
int bt_infer_max_ctx(const bt_infer *s);
/* The model's vocabulary size (length of one logits row). */
int bt_infer_vocab(const bt_infer *s);
/* Bytes held by the cache and workspace (for logs). */
size_t bt_infer_bytes(const bt_infer *s);

/* Run ids[n] (each in [0, vocab)) through the model at positions pos .. pos+n-1, append their
 * K/V to the cache and write logits fp32 into `logits` (caller-owned):
 *   which == BT_INFER_LOGITS_ALL:  logits[n, vocab], row i for ids[i] (predicts the next token);
 *   which == BT_INFER_LOGITS_LAST: logits[vocab] for ids[n-1];
 *   which == BT_INFER_LOGITS_NONE: logits unused (may be NULL; prefill only).
 * Errors (the cache is unchanged): BT_ERR_INVALID (n < 1, NULL ids, NULL logits when requested,
 * bad `which`), BT_ERR_RANGE (an id outside [0, vocab), or pos + n > max_ctx). A requested logit
 * that is nan or infinite is BT_ERR_DIVERGED naming its position and token id (the tokens are then
 * in the cache: bt_infer_reset before reusing the session): no caller samples from it. */
int bt_infer_forward(bt_infer *s, const int32_t *ids, int n, int which, float *logits);

#endif
