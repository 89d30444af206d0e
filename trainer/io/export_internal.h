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

#endif
