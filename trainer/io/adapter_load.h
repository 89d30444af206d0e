/* Loading a PEFT LoRA adapter directory into bt_lora (the inverse of trainer/io/adapter.h's
 * bt_adapter_save; huggingface/peft save_pretrained layout, docs/formats/peft.md). */
#ifndef BT_TRAINER_ADAPTER_LOAD_H
#define BT_TRAINER_ADAPTER_LOAD_H

#include "trainer/model/lora.h"
#include "trainer/model/model.h"

/* Read <dir>/adapter_config.json and <dir>/adapter_model.safetensors into a new *lo shaped for
 * model `m` (bt_lora_init layout; grads and AdamW moments zero). Config keys: r (integer >= 1),
 * lora_alpha (number > 0), lora_dropout (default 0, in [0, 1)), target_modules (a list of
 * q_proj ... down_proj, qkv_proj / gate_up_proj (Phi-3's fused modules, on a Phi-3 base only, which
 * in turn has no q/k/v/gate/up: either mismatch is BT_ERR_UNSUPPORTED naming the module), or the
 * string "all-linear" or one module name); peft_type "LORA",
 * bias "none", use_dora false, fan_in_fan_out false, layers_to_transform null, rank_pattern /
 * alpha_pattern empty are required when present; use_rslora true gives scale = lora_alpha /
 * sqrt(r) (PEFT), else lora_alpha / r.
 * modules_to_save (null / [] = plain LoRA) loads a LongLoRA LoRA+ adapter (lora.h, adapter.h):
 * entries "embed_tokens" (-> BT_TRAIN_EMBED), "lm_head" (only with embed_tokens on a base whose
 * lm_head is tied to it: the tensor must then equal the embedding), "input_layernorm",
 * "post_attention_layernorm", "norm" (any of them -> BT_TRAIN_NORM); other entries are
 * BT_ERR_UNSUPPORTED. *lo is then shaped by bt_lora_init and its lo->embed / lo->norms are read
 * from base_model.model.model.embed_tokens.weight [vocab, d_model],
 * base_model.model.lm_head.weight, base_model.model.model.layers.{i}.{input_layernorm,
 * post_attention_layernorm}.weight [d_model], base_model.model.model.norm.weight [d_model]. The
 * tensors of every listed entry are required; a norm tensor of an unlisted norm entry is optional
 * (PEFT matches modules_to_save by name suffix) and keeps the base's value when absent, which
 * needs a model holding its weights (not export's shape-only model).
 * Tensors: base_model.model.model.layers.{i}.{self_attn|mlp}.{q..down}_proj.lora_A.weight
 * [r, in] and .lora_B.weight [out, r] for every layer and targeted module (Phi-3: qkv_proj
 * [r, D] / [Dq + 2 Dkv, r], gate_up_proj [r, D] / [2 F, r]), F32/F16/BF16 (converted
 * exactly to fp32, all values finite); any other tensor is an error (so nothing in the file is
 * silently dropped). *lo is owned by the caller (bt_lora_free); zeroed on error.
 * Errors (message names the file and key/tensor): BT_ERR_IO, BT_ERR_NOTFOUND (missing file, key
 * or tensor), BT_ERR_FORMAT (bad JSON or value, shape mismatch, non-finite value, unexpected
 * tensor), BT_ERR_UNSUPPORTED (DoRA, biases, per-module ranks, unknown target module or
 * modules_to_save entry, an untied or separately trained lm_head, dtype),
 * BT_ERR_INVALID / BT_ERR_NOMEM from bt_lora_init. */
int bt_lora_load_peft(bt_lora *lo, const bt_model *m, const char *dir);

/* The context extension an adapter was trained with (adapter_config.json
 * "barqtrain_context_extension", trainer/io/adapter.h): *method = BT_ROPE_EXT_* (BT_ROPE_EXT_NONE
 * when the adapter has none) and *target_length. Errors: BT_ERR_IO / BT_ERR_FORMAT (unreadable
 * config, a note without a known method or a target_length in [2, 2^24]), naming the file. */
int bt_adapter_context_extension(const char *dir, int *method, int *target_length);
/* Apply it to m (bt_model_extend_context; nothing when the adapter has none, or when m already
 * carries that extension), logging what was done. Errors: those of the two functions. */
int bt_adapter_apply_context(bt_model *m, const char *dir);

#endif
