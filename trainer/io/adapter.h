/* PEFT LoRA adapter checkpoints (huggingface/peft save_pretrained layout; see
 * docs/formats/peft.md):
 *   <dir>/adapter_model.safetensors  F32 tensors, __metadata__ {"format": "pt"}, keys
 *     base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_A.weight  [r, in]
 *     base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_B.weight  [out, r]
 *     base_model.model.model.layers.{i}.mlp.{gate,up,down}_proj.lora_{A,B}.weight
 *     (Phi-3: self_attn.qkv_proj and mlp.gate_up_proj instead of q/k/v and gate/up: one lora_A
 *     [r, D] and the fused lora_B [Dq + 2 Dkv, r] / [2 F, r]; target_modules lists "qkv_proj",
 *     "gate_up_proj"; trainer/model/lora.h)
 *   <dir>/adapter_config.json  the conservative core key set (peft_type "LORA", task_type
 *     "CAUSAL_LM", r, lora_alpha, lora_dropout, target_modules, bias "none", fan_in_fan_out false,
 *     inference_mode true, init_lora_weights true, modules_to_save null, use_rslora false,
 *     use_dora false, revision null, layers_to_transform null, layers_pattern null,
 *     rank_pattern {}, alpha_pattern {}, base_model_name_or_path).
 * Weights are in Hugging Face layout (the trainer's base has Q/K un-permuted from GGUF).
 * LoRA+ (bt_lora.trainable, lora.h) is saved the PEFT-native way, as modules_to_save: the
 * config lists "embed_tokens" (+ "lm_head" when tied: PEFT's ModulesToSaveWrapper copies would
 * otherwise untie them, so both are saved with the same trained values), "input_layernorm",
 * "post_attention_layernorm", "norm"; the tensors use the keys get_peft_model_state_dict writes
 * for them (huggingface/peft src/peft/utils/save_and_load.py: "modules_to_save." and the adapter
 * name are stripped): base_model.model.model.embed_tokens.weight [vocab, d_model],
 * base_model.model.lm_head.weight, base_model.model.model.layers.{i}.input_layernorm.weight,
 * ...post_attention_layernorm.weight [d_model], base_model.model.model.norm.weight. (LongLoRA
 * itself saves these to a separate trainable_params.bin; PEFT loads modules_to_save directly.) */
#ifndef BT_TRAINER_ADAPTER_H
#define BT_TRAINER_ADAPTER_H

#include "trainer/model/lora.h"
#include "trainer/model/model.h"

/* Write the adapter to `dir` atomically: BarqTrain's marker (common/out_dir.h BT_OUT_MARKER) and
 * both files go to a fresh sibling directory "<dir>.tmp-<pid>", are fsync'ed, and that directory
 * then replaces `dir` in one step (renameat2 RENAME_EXCHANGE when `dir` exists, then the old
 * copy's files are removed; plain rename otherwise), so a reader never sees a half-written
 * adapter. An existing `dir` must be one BarqTrain may replace (trainer/io/outputs.h
 * bt_out_adapter: empty, or only an adapter's / a checkpoint's files): anything else is refused
 * before a file is written. Parent directories of `dir` are created. Errors: BT_ERR_INVALID (a
 * directory that is not ours, a link), BT_ERR_IO (message names the path), BT_ERR_NOMEM.
 * When m (may be NULL) carries the job's context extension (m->ctx_extended,
 * bt_model_extend_context) adapter_config.json also gets
 *   "barqtrain_context_extension": {"method": "linear"|"yarn"|"dynamic", "target_length",
 *     "original_length", "factor", "rope_scaling" (the base config's rope_scaling that reproduces
 *     the positions in transformers, trainer/io/export.h bt_export_hf_rope),
 *     "max_position_embeddings", "rope_theta", "note" (what to do with it)}
 * so the adapter is never applied to the unextended base by BarqTrain (trainer/io/adapter_load.h
 * bt_adapter_apply_context reads it back) and says what transformers needs. PEFT >= 0.14 ignores
 * the key with a warning; PEFT 0.13 refuses unknown keys (the note says so). */
int bt_adapter_save(const bt_lora *lo, const char *base_model_name_or_path, const char *dir,
                    const bt_model *m);

/* The keys adapter_config.json gets from bt_adapter_save (besides the optional
 * "barqtrain_context_extension"), NULL-terminated: how an adapter directory written before the
 * marker is recognised as ours (trainer/io/outputs.h). */
extern const char *const bt_adapter_config_keys[];

/* PEFT state-dict key for (layer, module, is_B) into buf (NUL-terminated). */
void bt_adapter_key(char *buf, size_t n, int layer, int mod, int is_B);
/* The same for a PEFT module (trainer/model/lora.h bt_lora_peft_get), fused ones included:
 * base_model.model.model.layers.N.self_attn.qkv_proj.lora_A.weight [r, D] and lora_B [Dq + 2 Dkv, r],
 * ...mlp.gate_up_proj.lora_{A,B}.weight (Phi-3, as PEFT writes them). */
void bt_adapter_peft_key(char *buf, size_t n, int layer, const bt_lora_peft_mod *u, int is_B);

#endif
