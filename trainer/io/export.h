/* Exports of a trained LoRA adapter (`trainer export`): the PEFT adapter itself, a llama.cpp LoRA
 * adapter GGUF, and the base with the adapter merged in, as a full llama GGUF or as a Hugging Face
 * safetensors directory. Formats: docs/formats/peft.md, docs/formats/gguf.md §LoRA,
 * docs/formats/safetensors.md.
 *
 *   peft         <out>/adapter_model.safetensors + adapter_config.json (trainer/io/adapter.h layout,
 *                F32, conservative PEFT key set; Hugging Face Q/K row order).
 *   gguf-lora    llama.cpp adapter (convert_lora_to_gguf.py; src/llama-adapter.cpp checks):
 *                general.architecture "llama" (or the family's, below), general.type
 *                "adapter", adapter.type "lora",
 *                adapter.lora.alpha (F32); tensors blk.{i}.{attn_q,attn_k,attn_v,attn_output,
 *                ffn_gate,ffn_up,ffn_down}.weight.lora_a with ne = (in, r) (PEFT A [r, in]) and
 *                .lora_b with ne = (r, out) (PEFT B [out, r]). lora_b of attn_q / attn_k has its
 *                rows permuted exactly like the GGUF base weight (convert_hf_to_gguf.py
 *                LlamaModel.permute with n_head / n_head_kv), as the converter's LoraTorchTensor
 *                does. Types F32, F16, BF16 or Q8_0 (a tensor whose ne[0] is not a multiple of 32
 *                falls back to F16, as the converter does).
 *   gguf         merged full llama GGUF: W' = W + (alpha / r) B A in Hugging Face layout from the
 *                fp32-dequantised base, then Q/K rows re-permuted; llama.* hyper-parameters written
 *                from the model, every other KV (tokenizer.*, general.name, ...) copied from the
 *                base GGUF. token_embd / output / the 7 linears in the chosen type (F32, F16, BF16
 *                or Q8_0 with F16 fallback), norms F32; general.file_type 0 / 1 / 32 / 7.
 *   safetensors  merged Hugging Face LlamaForCausalLM directory (trainer/io/export_hf.c), what
 *                save_pretrained + the tokenizer's save_pretrained write: weights (keys
 *                model.embed_tokens.weight, model.layers.{i}.self_attn.{q,k,v,o}_proj.weight,
 *                model.layers.{i}.mlp.{gate,up,down}_proj.weight, model.layers.{i}.{input_layernorm,
 *                post_attention_layernorm}.weight, model.norm.weight, lm_head.weight when untied;
 *                F32, F16 or BF16; __metadata__ {"format": "pt"}) in state_dict order, as
 *                model.safetensors or, past max_shard_bytes (default 5 GB, save_pretrained's),
 *                model-0000k-of-0000n.safetensors + model.safetensors.index.json with shards cut
 *                exactly as huggingface_hub split_state_dict_into_shards_factory cuts them (weights
 *                files of an earlier export that this one did not write are removed); config.json;
 *                generation_config.json (bos / eos / pad ids; eos also lists <|im_end|> when that
 *                is another token); tokenizer.json, tokenizer_config.json (chat template, special
 *                tokens) and special_tokens_map.json built from a GGUF base's tokenizer.ggml.*
 *                (byte-level or SentencePiece vocabularies: common/tokenizer.h
 *                bt_tokenizer_hf_from_gguf), or the tokenizer and generation
 *                files of a Hugging Face base directory copied verbatim.
 *
 * Families (model.h hp.arch): the GGUF formats write general.architecture and the <arch>.* keys
 * of the base's family, "llama", "qwen2" or "qwen3" (convert_hf_to_gguf.py LlamaModel /
 * Qwen2Model / Qwen3Model), and permute q/k rows (lora_b, merged weights, biases) for "llama"
 * only: Qwen2Model / Qwen3Model keep Hugging Face's rows (llama.cpp applies NEOX RoPE to them).
 * Qwen3's frozen QK-norm weights go to blk.N.attn_{q,k}_norm.weight (F32) and
 * model.layers.N.self_attn.{q,k}_norm.weight; its safetensors config is Qwen3ForCausalLM
 * (Qwen2's Qwen2ForCausalLM). A Qwen model with RoPE scaling cannot go to a merged GGUF
 * (BT_ERR_UNSUPPORTED: only "llama" GGUFs carry the keys here). The peft format is the same for
 * every family (PEFT names the modules the same way).
 * Linear biases of the base (Qwen2 q/k/v, Llama attention_bias / mlp_bias) are carried over
 * (GGUF blk.N.<lin>.bias, F32, Q/K permuted like the rows; HF ...<proj>.bias); a head_dim other
 * than d_model / n_head adds llama.attention.key_length / value_length, and linear RoPE scaling
 * llama.rope.scaling.{type,factor} (HF rope_scaling). Llama 3.1 RoPE scaling (rope_type
 * BT_ROPE_LLAMA3 or a GGUF's BT_ROPE_FREQS) is written as GGUF tensor rope_freqs.weight (F32
 * [head_dim/2], computed as convert_hf_to_gguf.py LlamaModel does, or the source GGUF's table
 * verbatim) and as config.json rope_scaling {"rope_type": "llama3", factor, low_freq_factor,
 * high_freq_factor, original_max_position_embeddings}; a GGUF table that Llama 3.x parameters
 * (low 1, high 4, context 8192) do not reproduce cannot go to safetensors (BT_ERR_UNSUPPORTED).
 * LoRA+ adapters (PEFT modules_to_save: trained embed_tokens / norms, trainer/io/adapter.h): peft
 * copies them; the merged formats write the trained embedding (token_embd / embed_tokens, and so
 * a tied lm_head) and norm weights in place of the base's; gguf-lora refuses them
 * (BT_ERR_UNSUPPORTED): llama.cpp LoRA GGUFs carry lora_a / lora_b pairs only
 * (convert_lora_to_gguf.py rejects embeddings, llama_adapter_lora_init skips *_norm.weight).
 * The adapter is read with
 * trainer/io/adapter_load.h bt_lora_load_peft; an rsLoRA adapter (scale alpha / sqrt(r)) is written
 * with the lora_alpha that gives the same scale under the plain alpha / r rule (adapter.lora.alpha,
 * PEFT lora_alpha with use_rslora false).
 *
 * Every file is written atomically (temp file + fsync + rename, see common/gguf.h,
 * common/safetensors.h). `out` must be a destination BarqTrain may write (trainer/io/outputs.h):
 * a GGUF file is created, or replaces only a GGUF an export of ours wrote (BT_EXPORT_GGUF_MARK_KEY);
 * a directory is created, or must be empty or hold only that format's files and BarqTrain's
 * marker; anything else is refused before the model is loaded. */
#ifndef BT_TRAINER_EXPORT_H
#define BT_TRAINER_EXPORT_H
#include <stddef.h>
#include <stdint.h>

#include "common/gguf.h"
#include "trainer/model/lora.h"
#include "trainer/model/model.h"

/* The GGUF KV (a string: "gguf-lora" or "gguf") every GGUF this exporter writes carries, so that a
 * later export recognises the file as BarqTrain's before replacing it (trainer/io/outputs.h
 * bt_out_gguf_is_ours); llama.cpp ignores keys it does not know. */
#define BT_EXPORT_GGUF_MARK_KEY "barqtrain.export"

/* 1 when `name` is a file a merged Hugging Face export writes (config.json, generation_config.json,
 * the tokenizer files, model.safetensors, model.safetensors.index.json,
 * model-NNNNN-of-NNNNN.safetensors): the bt_out_export kind (trainer/io/outputs.h). */
int bt_export_hf_owns(const char *name);

enum { BT_EXPORT_PEFT = 0, BT_EXPORT_GGUF_LORA, BT_EXPORT_GGUF, BT_EXPORT_SAFETENSORS };
enum { BT_EXPORT_F32 = 0, BT_EXPORT_F16, BT_EXPORT_BF16, BT_EXPORT_Q8_0 };

/* "peft" | "gguf-lora" | "gguf" | "safetensors" -> BT_EXPORT_*; "f32" | "f16" | "bf16" | "q8_0"
 * -> BT_EXPORT_F32..; BT_ERR_INVALID (message lists the choices) otherwise. */
int bt_export_format_parse(const char *s, int *out);
int bt_export_dtype_parse(const char *s, int *out);

/* convert_hf_to_gguf.py LlamaModel.permute for `rows` rows of `cols` floats:
 *   dst = src.reshape(n_head, 2, rows / n_head / 2, cols).swapaxes(1, 2).reshape(rows, cols)
 * (HF row h*hd + j*hd/2 + i -> GGUF row h*hd + 2i + j, hd = rows / n_head). src and dst must not
 * overlap. rows must be a multiple of 2 * n_head (BT_ERR_INVALID otherwise). */
int bt_export_permute_rows(float *dst, const float *src, int n_head, int rows, int cols);

/* The merged fp32 weight of linear (layer, mod) in Hugging Face layout:
 *   out[rows, cols] = W + lo->scale * B @ A    (W alone when the module is not targeted)
 * m must hold fp32 linears (BT_BASE_FP32; BT_ERR_INVALID for NF4). lo may be NULL (no adapter);
 * when given its shapes must match m. out is caller-owned, rows * cols floats. */
int bt_export_merged_weight(const bt_model *m, const bt_lora *lo, int layer, int mod, float *out);

/* Q8_0 quantisation, bit-identical to ggml quantize_row_q8_0_ref (and gguf-py quants.py): per
 * block of 32, d = amax / 127, q = roundf(x * (1 / d)) (0 when d = 0), d stored fp16; 34 bytes per
 * block. n must be a multiple of 32 (BT_ERR_INVALID otherwise). dst: caller-owned, n / 32 * 34
 * bytes. Source: trainer/io/quantize_q8.c. */
int bt_q8_0_quantize(const float *x, void *dst, int64_t n);

/* config.json's RoPE description of m with transformers' semantics (modeling_rope_utils.py), and
 * the max_position_embeddings to write with it: *rs = JSON null (no scaling), {"rope_type":
 * "linear", factor}, {"rope_type": "yarn", factor, original_max_position_embeddings,
 * [attention_factor, beta_fast, beta_slow]} with max_position_embeddings = the pre-YaRN context
 * (so transformers 4.4x, which takes YaRN's correction range from max_position_embeddings, and
 * 5.x, which takes it from original_max_position_embeddings, agree), {"rope_type": "dynamic",
 * factor} with max_position_embeddings = the pre-scaling context, {"rope_type": "llama3", ...},
 * or, for a llama3 / rope_freqs table composed with linear or YaRN scaling (or any fixed table
 * that is not Llama 3.x), {"rope_type": "longrope", short_factor = long_factor = default[i] /
 * inv_freq[i], attention_factor, factor, original_max_position_embeddings}, which transformers
 * evaluates to the same table at every length. *rs: a new reference (caller json_decref).
 * Errors: BT_ERR_UNSUPPORTED (dynamic NTK on top of a llama3 / rope_freqs table), BT_ERR_INVALID. */
struct json_t;
int bt_export_hf_rope(const bt_model *m, struct json_t **rs, int *max_pos);

/* Writers. m: the base (fp32 linears for the merged formats), lo: the adapter (non-NULL; for the
 * merged formats NULL means "base only"). base_gguf: an open reader of the base GGUF whose KVs
 * (tokenizer, general.name, ...) are copied into the merged GGUF, and whose bos/eos ids go into
 * config.json; NULL writes the model's hyper-parameters only. dtype: BT_EXPORT_* allowed by the
 * format (gguf-lora, gguf: all four; safetensors: F32/F16/BF16). `out` is the file (gguf
 * formats) or the directory (peft, safetensors; created, parents included). Errors: BT_ERR_INVALID
 * (dtype, NF4 base for a merge, shapes of lo and m differ), BT_ERR_UNSUPPORTED (RoPE scaling a
 * format cannot carry), BT_ERR_IO, BT_ERR_NOMEM. Phi-3 (hp.arch BT_ARCH_PHI3) is written as its
 * files hold it: gguf-lora blk.N.attn_qkv / ffn_up .lora_a / .lora_b for the fused qkv_proj /
 * gate_up_proj (convert_lora_to_gguf.py through Phi3MiniModel), merged GGUF blk.N.attn_qkv
 * [q; k; v] and blk.N.ffn_up [gate; up] plus phi3.attention.sliding_window and
 * phi3.rope.scaling.original_context_length (Phi3MiniModel.set_gguf_parameters), merged
 * safetensors model.layers.N.self_attn.qkv_proj / mlp.gate_up_proj with a Phi3ForCausalLM
 * config.json (a Llama-family base with a sliding_window: MistralForCausalLM). Gemma 3
 * (BT_ARCH_GEMMA3): merged GGUF general.architecture "gemma3" with the keys
 * convert_hf_to_gguf.py Gemma3Model writes (key_length / value_length, rope.freq_base,
 * attention.sliding_window, rope.scaling linear), blk.N.post_attention_norm / post_ffw_norm
 * beside attn_norm / ffn_norm / attn_{q,k}_norm, every norm stored as HF's 1 + w (the factor the
 * model holds), no output.weight (tied); a model llama.cpp's fixed gemma3 choices cannot express
 * (global period 6, local base 10000, scale 1/sqrt(key_length)) is refused (BT_ERR_UNSUPPORTED).
 * Merged safetensors: Gemma3ForCausalLM (gemma3_text config.json as transformers 5.23 writes it:
 * layer_types, rope_parameters per attention type, query_pre_attn_scalar, sliding_window), norms
 * input_layernorm / post_attention_layernorm / pre_feedforward_layernorm /
 * post_feedforward_layernorm / self_attn.{q,k}_norm / model.norm written as w (factor - 1), since
 * Gemma3RMSNorm multiplies by 1 + w. */
int bt_export_gguf_lora(const bt_model *m, const bt_lora *lo, int dtype, const char *out);
int bt_export_gguf_merged(const bt_model *m, const bt_lora *lo, const bt_gguf *base_gguf, int dtype,
                          const char *out);

/* save_pretrained's default max_shard_size "5GB" (decimal, as huggingface_hub parses it). */
#define BT_EXPORT_DEFAULT_SHARD_BYTES 5000000000ull

/* Where the merged Hugging Face directory takes its tokenizer from, and how it is sharded. */
typedef struct {
    const bt_gguf *base_gguf; /* tokenizer.ggml.* -> tokenizer files; bos/eos/pad; or NULL */
    const char *base_dir;     /* Hugging Face base directory: tokenizer.json, tokenizer_config.json,
                               * special_tokens_map.json, chat_template.jinja / .json, vocab.json,
                               * merges.txt, added_tokens.json, tokenizer.model and
                               * generation_config.json copied when present; or NULL */
    int64_t max_shard_bytes;  /* <= 0: BT_EXPORT_DEFAULT_SHARD_BYTES */
} bt_hf_export_opts;

/* The merged directory with its tokenizer and generation files (layout above); `o` may be NULL
 * (no tokenizer files, default sharding). A GGUF base whose tokenizer.ggml.* keys are absent or
 * cannot be written (bt_tokenizer_hf_from_gguf: other tokenizer models, invalid UTF-8, ...), or a
 * base directory without a tokenizer we can read, gives a warning naming the reason (the directory then has no,
 * or unchecked, tokenizer files; config.json still gets the GGUF's bos/eos/pad ids). Errors as
 * bt_export_gguf_merged, plus BT_ERR_IO for a base file that cannot be copied. */
int bt_export_safetensors_merged(const bt_model *m, const bt_lora *lo, int dtype,
                                 const bt_hf_export_opts *o, const char *out_dir);

/* "5GB", "500MB", "1.5GB", "2GiB", "123456" (bytes; no spaces): a positive size in bytes, decimal units KB/MB/GB/TB (10^3..) or binary KiB/MiB/GiB/TiB (2^10..), case-insensitive,
 * as transformers' convert_file_size_to_int reads max_shard_size. BT_ERR_INVALID otherwise. */
int bt_export_parse_size(const char *s, int64_t *out);

/* Parameters of one `trainer export` run. */
typedef struct {
    const char *model;    /* base: GGUF file or Hugging Face directory (bt_model_load) */
    const char *adapter;  /* PEFT adapter directory */
    const char *out;      /* output file or directory */
    int format;           /* BT_EXPORT_PEFT .. */
    int dtype;            /* BT_EXPORT_F32 ..; -1 = the format's default (peft, gguf-lora: f32;
                             gguf, safetensors: f16) */
    int64_t max_shard_bytes; /* safetensors: shard size limit; <= 0 = 5 GB (save_pretrained's) */
} bt_export_opts;

/* Load the base, the adapter (bt_lora_load_peft), write the export. The base is loaded fp32
 * (bt_model_load) for the merged formats and for a Hugging Face directory; for the adapter-only
 * formats a GGUF base is only read for its hyper-parameters and linear shapes (no weights). The
 * peft format is F32 only. The merged GGUF copies the KVs of a GGUF base; from a Hugging Face
 * base it has no tokenizer metadata (a warning is logged). Errors: BT_ERR_INVALID (bad
 * options), BT_ERR_IO (missing base) and those of the loaders and writers (bt_last_error). */
int bt_export_run(const bt_export_opts *o);

/* `trainer export` command line (argv[0] = "export"): --model BASE.gguf|HF_DIR --adapter DIR
 * --format peft|gguf-lora|gguf|safetensors --out PATH [--dtype f32|f16|bf16|q8_0]
 * [--max-shard-size SIZE] (safetensors only; bt_export_parse_size). Prints a
 * one-line summary to stdout; errors to stderr. Returns the process exit status: 0 ok, 1 runtime
 * failure, 2 usage error. */
int bt_export_main(int argc, char **argv);
/* The usage text of `trainer export` (static string). */
const char *bt_export_usage(void);

#endif
