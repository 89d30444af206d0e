/* Helpers shared by the exporters (trainer/io/export.c: PEFT, GGUF; trainer/io/export_hf.c: the merged
 * Hugging Face directory). Not a public header. */
#ifndef BT_TRAINER_EXPORT_INTERNAL_H
#define BT_TRAINER_EXPORT_INTERNAL_H
#include "trainer/model/lora.h"
#include "trainer/model/model.h"

/* "f32" | "f16" | "bf16" | "q8_0" for BT_EXPORT_*, "?" otherwise (static string). */
const char *bt_export_dtype_name(int dtype);
/* 0 when lo is NULL or fits m (layers, linear shapes, LoRA+ embedding / norms); BT_ERR_INVALID
 * naming the first mismatch otherwise. */
int bt_export_lora_matches(const bt_model *m, const bt_lora *lo);
/* HF rope_scaling "llama3" parameters behind a GGUF rope_freqs table (Llama 3.x: low 1, high 4,
 * original context 8192, factor = the largest factor) when they reproduce it (rel. 1e-6);
 * BT_ERR_UNSUPPORTED otherwise (config.json cannot express the table). */
int bt_export_llama3_from_freqs(const bt_model *m, float *factor, float *low, float *high, int *ctx);
/* The context in tokens the model had before its RoPE context extension (hp->rope_ext_orig_ctx;
 * linear scaling loaded from a file may not say: round(ctx / factor)). */
int bt_export_orig_ctx(const bt_llama_hparams *hp);
/* How many of the model's split linears the file tensor starting at `mod` holds: Phi-3 (hp.arch
 * BT_ARCH_PHI3) stores q, k, v as one qkv_proj / attn_qkv (3 at BT_MOD_Q, 0 at k and v) and gate,
 * up as one gate_up_proj / ffn_up (2 at BT_MOD_GATE, 0 at up), as transformers' Phi3Attention /
 * Phi3MLP and convert_hf_to_gguf.py Phi3MiniModel hold them; 1 otherwise. */
int bt_export_fused_count(const bt_model *m, int mod);
/* The merged (base + LoRA, bt_export_merged_weight) fused weight starting at (layer, mod): the
 * bt_export_fused_count(m, mod) linears' rows stacked in order ([Dq + 2 Dkv, D] or [2 F, D]),
 * *out malloc'd [*rows, cols]. Errors: those of bt_export_merged_weight, BT_ERR_INVALID (no
 * tensor starts at mod), BT_ERR_NOMEM. */
int bt_export_merged_fused(const bt_model *m, const bt_lora *lo, int layer, int mod, float **out,
                           int64_t *rows);

#endif
