/* Helpers shared by the model loaders (trainer/model/model.c: GGUF and random init;
 * trainer/model/model_hf.c: Hugging Face directories). Not part of the trainer's public API. */
#ifndef BT_TRAINER_MODEL_INTERNAL_H
#define BT_TRAINER_MODEL_INTERNAL_H

#include "trainer/model/model.h"

/* Shape [rows = out, cols = in] of linear `mod` (BT_MOD_*) under hp (q: n_head*head_dim x
 * d_model, k/v: n_kv_head*head_dim x d_model, o: d_model x n_head*head_dim, gate/up: d_ff x
 * d_model, down: d_model x d_ff). */
void bt_model_lin_shape(const bt_llama_hparams *hp, int mod, int *rows, int *cols);

/* Validate hyper-parameters; `src` names the source in messages. head_dim_free = 0 requires
 * head_dim * n_head == d_model (GGUF llama, random init); 1 allows any even head_dim (HF
 * configs with an explicit head_dim). BT_ERR_INVALID with a message otherwise. */
int bt_model_check_hparams(const bt_llama_hparams *hp, const char *src, int head_dim_free);

/* The layer index of a weight named "<prefix><N>.<...>" (prefix "blk." in GGUF files,
 * "model.layers." in Hugging Face checkpoints), or -1 for any other name. The loaders take every
 * layer index found in a file and refuse one at or past the layer count their header / config.json
 * gives: a header that claims fewer layers than the weights hold would load part of the model
 * silently (issue 21 §11; every other dimension is checked by the tensors' exact shapes). */
int bt_model_layer_of(const char *name, const char *prefix);

/* Make *l the frozen linear of fp32 w[rows, cols], taking ownership of w (freed on every path
 * when quantised or on error): fp32 base keeps it, NF4 base quantises it (bt_nf4_quantize; the
 * element count must be a multiple of 64, else BT_ERR_UNSUPPORTED naming `what`). */
int bt_model_lin_set(bt_base_linear *l, float *w, int rows, int cols, int base_dtype,
                     const char *what);

/* llama.rope.scaling.* of a GGUF (llama.cpp's keys: type none / linear / yarn, factor,
 * original_context_length, attn_factor, yarn_beta_fast / yarn_beta_slow) into hp->rope_ext and
 * friends (hp->ctx must already hold llama.context_length). Errors: BT_ERR_FORMAT /
 * BT_ERR_UNSUPPORTED / BT_ERR_NOTFOUND naming the key. */
struct bt_gguf;
int bt_model_gguf_rope_scaling(const struct bt_gguf *g, const char *path, bt_llama_hparams *hp);

#endif
