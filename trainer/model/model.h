/* The frozen Llama base model held by the CPU trainer.
 *
 * Layout is Hugging Face's (LlamaForCausalLM): every linear is torch.nn.Linear W[out, in]
 * row-major fp32 (or NF4 of that same matrix); q_proj/k_proj rows are in HF order, i.e. the
 * llama.cpp GGUF Q/K permutation is undone at load, so RoPE is the "rotate_half" form of
 * kernels.h (bt_rope_*). Embedding, lm_head and norms stay fp32 (as bitsandbytes QLoRA keeps
 * them unquantised); the seven linears per layer are NF4 (BT_BASE_NF4, kernels.h bt_nf4), the
 * GGUF file's own ggml blocks (BT_BASE_GGUF, kernels.h bt_ggml_mat: no re-quantisation; q/k rows
 * moved back to HF order block-row by block-row) or fp32 (BT_BASE_FP32). */
#ifndef BT_TRAINER_MODEL_H
#define BT_TRAINER_MODEL_H
#include <stdint.h>

#include "kernels/kernels.h"
#include "trainer/config.h"

typedef struct {
    int n_layer;       /* llama.block_count */
    int d_model;       /* llama.embedding_length */
    int n_head;        /* llama.attention.head_count */
    int n_kv_head;     /* llama.attention.head_count_kv (default n_head) */
    int head_dim;      /* d_model / n_head (llama.rope.dimension_count must equal it) */
    int d_ff;          /* llama.feed_forward_length */
    int vocab;         /* rows of token_embd.weight */
    int ctx;           /* llama.context_length (informational) */
    float rope_theta;  /* llama.rope.freq_base (default 10000) */
    float rms_eps;     /* llama.attention.layer_norm_rms_epsilon */
    float rope_factor; /* BT_ROPE_LLAMA3: rope_scaling.factor (0 otherwise: linear scaling is
                        * rope_ext BT_ROPE_EXT_LINEAR) */
    int rope_type;     /* the model's own frequency table: BT_ROPE_DEFAULT (theta^(-2i/D)),
                        * BT_ROPE_LLAMA3 (HF rope_scaling "llama3"), BT_ROPE_FREQS (GGUF
                        * rope_freqs.weight) */
    float rope_low_freq_factor, rope_high_freq_factor; /* llama3: rope_scaling.{low,high}_freq_factor */
    int rope_orig_ctx; /* llama3: rope_scaling.original_max_position_embeddings */
    /* Context scaling applied on top of that table (bt_model_rope_init): HF rope_scaling
     * "linear" / "yarn" / "dynamic", GGUF llama.rope.scaling.type "linear" / "yarn", or the job's
     * context_extension (bt_model_extend_context). */
    int rope_ext;             /* BT_ROPE_EXT_* (0 = none) */
    float rope_ext_factor;    /* the scaling factor (linear: positions / factor; yarn; dynamic) */
    int rope_ext_orig_ctx;    /* the context the model was trained with before the scaling (yarn's
                               * correction range, dynamic's threshold) */
    float rope_yarn_beta_fast, rope_yarn_beta_slow; /* yarn: 0 = 32 / 1 */
    float rope_attn_factor;   /* yarn: rope_scaling.attention_factor (0 = 0.1 ln factor + 1) */
    int arch;          /* BT_ARCH_*: the family the weights came from (GGUF general.architecture,
                        * HF architectures[0]); Llama and Mistral are BT_ARCH_LLAMA */
    int sliding_window; /* the config's attention window in tokens (0: none): HF config.json
                        * "sliding_window" of MistralForCausalLM / Phi3ForCausalLM, GGUF
                        * phi3.attention.sliding_window (a "llama" GGUF has no such key: llama.cpp
                        * runs Mistral GGUFs with full attention, and so do we), gemma3's
                        * gemma3.attention.sliding_window. The CPU step and trainer/infer apply it on
                        * every layer bt_model_layer_window names (keys a local layer's query sees,
                        * itself included; swa_pattern says which layers are global); a backend
                        * without windowed attention is held to rows within it:
                        * bt_model_check_window */
    int qk_norm;       /* 1: RMSNorm over each head of q and k (bt_layer q_norm / k_norm, weights
                        * [head_dim], eps rms_eps) after q_proj / k_proj and before RoPE, as
                        * transformers Qwen3Attention (Qwen3); 0 otherwise */
    /* Gemma 3 (BT_ARCH_GEMMA3; transformers 5.23 Gemma3ForCausalLM, llama.cpp LLM_ARCH_GEMMA3);
     * every other family leaves these 0 */
    int sandwich_norm; /* 1: RMSNorm of the attention output (bt_layer post_attn_norm) and of the
                        * MLP output (post_ffn_norm) before each residual add, as
                        * Gemma3DecoderLayer's post_attention_layernorm / post_feedforward_layernorm
                        * (its pre_feedforward_layernorm is ffn_norm) */
    int act;           /* the MLP's gate activation: BT_ACT_SILU (SwiGLU) | BT_ACT_GELU_TANH
                        * (GeGLU, hidden_activation "gelu_pytorch_tanh") */
    float embed_scale; /* the embedding rows are multiplied by it before layer 0 (Gemma:
                        * sqrt(d_model), Gemma3TextScaledWordEmbedding); 0 = none */
    float attn_scalar; /* the softmax scale is 1/sqrt(attn_scalar) (HF query_pre_attn_scalar);
                        * 0 = head_dim */
    int swa_pattern;   /* with sliding_window: layer l is global iff (l + 1) % swa_pattern == 0
                        * (HF sliding_window_pattern / layer_types, llama.cpp set_swa_pattern);
                        * 0 = every layer is local */
    float rope_local_theta; /* RoPE base of the local layers (HF rope_local_base_freq /
                             * rope_parameters.sliding_attention.rope_theta; llama.cpp's 10000);
                             * 0 = the same table as the global layers */
} bt_llama_hparams;

/* MLP activations (bt_llama_hparams.act). */
enum { BT_ACT_SILU = 0, BT_ACT_GELU_TANH = 1 };

/* The sliding window of layer l (0: full causal attention), from hp's sliding_window and
 * swa_pattern. */
int bt_model_layer_window(const bt_llama_hparams *hp, int l);

/* The dimensions every buffer and linear of the model is sized by, derived once from its
 * hyper-parameters (bt_dims_of): what the step contexts (trainer/loop/step.c, trainer/cuda/),
 * inference, the memory plan (trainer/backend/plan.h) and `trainer estimate` read instead of
 * re-deriving them. Element counts, not bytes. */
typedef struct {
    int L;        /* n_layer */
    int D;        /* d_model */
    int Hq, Hkv;  /* n_head, n_kv_head */
    int hd;       /* head_dim */
    int Dq;       /* Hq * hd: q_proj's rows, o_proj's cols */
    int Dkv;      /* Hkv * hd: k_proj's and v_proj's rows */
    int F;        /* d_ff */
    int V;        /* vocab */
} bt_dims;

/* The dimensions of hp (no checks: validate hp first, bt_model_check_hparams /
 * bt_est_model_read; products fit an int for every model they accept). */
bt_dims bt_dims_of(const bt_llama_hparams *hp);

/* Shape [rows = out, cols = in] of linear `mod` (BT_MOD_*), as HF LlamaForCausalLM holds it
 * (nn.Linear weight [out, in]): q Dq x D, k and v Dkv x D, o D x Dq, gate and up F x D, down
 * D x F. */
void bt_dims_lin_shape(const bt_dims *d, int mod, int *rows, int *cols);
/* Elements of the largest of the seven linears (the GPU's dequantisation buffer). */
int64_t bt_dims_max_linear(const bt_dims *d);
/* The widest linear input (K of every base GEMM): max(D, F, Dq). */
int bt_dims_max_cols(const bt_dims *d);

/* Model families (bt_llama_hparams.arch). */
enum { BT_ARCH_LLAMA = 0, BT_ARCH_QWEN2 = 1, BT_ARCH_QWEN3 = 2, BT_ARCH_PHI3 = 3,
       BT_ARCH_GEMMA3 = 4 };
/* "llama" | "qwen2" | "qwen3" | "phi3" | "gemma3": the GGUF general.architecture (and key prefix)
 * of a family. */
const char *bt_arch_name(int arch);

enum { BT_ROPE_DEFAULT = 0, BT_ROPE_LLAMA3 = 1, BT_ROPE_FREQS = 2 };
/* (BT_ROPE_EXT_NONE / LINEAR / YARN / DYNAMIC: trainer/config.h) */

/* "linear" | "yarn" | "dynamic" -> BT_ROPE_EXT_* (> 0), else -1; and back ("none" for 0). */
int bt_rope_ext_parse(const char *name);
const char *bt_rope_ext_name(int ext);

/* The attention softmax scale: 1 / sqrt(head_dim), times mscale^2 for YaRN (transformers
 * multiplies cos and sin by the attention factor, so q.k carries its square; folding it into the
 * scale is the same product). */
float bt_model_attn_scale(const bt_llama_hparams *hp);
/* The cos/sin magnitude factor itself (YaRN's bt_rope_yarn_attention_factor, or a fixed table's
 * HF longrope attention_factor; 1 otherwise). */
float bt_model_attn_factor(const bt_llama_hparams *hp);

/* One frozen linear W[rows=out, cols=in] (+ optional bias). Exactly one of w / q / g is in use
 * (is_nf4: q; is_gguf: g; neither: w). */
typedef struct {
    int rows, cols;
    int is_nf4;
    int is_gguf;
    float *w;     /* [rows, cols] fp32 when neither is_nf4 nor is_gguf (owned) */
    bt_nf4 q;     /* when is_nf4 (owned) */
    bt_ggml_mat g; /* when is_gguf (owned): the GGUF tensor's blocks, HF row order */
    float *bias;  /* [rows] fp32 or NULL (owned): Qwen2 q/k/v, Llama attention_bias/mlp_bias */
    /* shard_world > 1 (bt_model_load_gguf_shard, dist.shard_base): the linear holds only rank
     * shard_rank's cut of it (trainer/backend/plan.h bt_shard_cut_rows: rows [shard_r0,
     * shard_r0 + g.rows), g.rows possibly 0 past the end; NF4, bt_shard_cut_nf4: the q.n weights
     * of units [shard_r0, ...), 16384 a unit, q.n possibly 0); rows / cols stay the whole matrix's
     * shape. Such a linear is for the sharded GPU upload only (trainer/cuda/cuda_model.cu): the CPU
     * step and bt_base_fwd / bt_base_bwd_x read rows x cols and must never be given one. 0: whole. */
    int shard_rank, shard_world;
    int64_t shard_r0;
} bt_base_linear;

typedef struct {
    float *attn_norm;              /* [d_model] */
    float *ffn_norm;               /* [d_model] */
    float *q_norm, *k_norm;        /* [head_dim] fp32 (owned) when hp.qk_norm (Qwen3 q_norm /
                                    * k_norm, frozen), else NULL */
    float *post_attn_norm;         /* [d_model] (owned) when hp.sandwich_norm, else NULL */
    float *post_ffn_norm;          /* [d_model] (owned) when hp.sandwich_norm, else NULL */
    bt_base_linear lin[BT_MOD_N];  /* indexed by BT_MOD_Q .. BT_MOD_DOWN */
} bt_layer;

typedef struct {
    bt_llama_hparams hp;
    int base_dtype;        /* BT_BASE_NF4 | BT_BASE_FP32 | BT_BASE_GGUF (never AUTO once loaded) */
    float *tok_embd;       /* [vocab, d_model] fp32 (owned) */
    float *lm_head;        /* [vocab, d_model]; == tok_embd when tied (not separately owned) */
    int tied;
    float *output_norm;    /* [d_model] */
    bt_layer *layers;      /* [n_layer] */
    float *inv_freq;       /* [head_dim/2] fp32 RoPE inverse frequencies (owned; bt_model_rope_init):
                            * what bt_rope_fwd_freq / bt_rope_bwd_freq rotate with */
    float *inv_freq_local; /* [head_dim/2] the local (sliding-window) layers' table when
                            * hp.rope_local_theta > 0 (owned; bt_model_rope_init), else NULL */
    float *rope_freqs;     /* [head_dim/2] GGUF rope_freqs.weight factors (owned) for
                            * BT_ROPE_FREQS, else NULL */
    int ctx_extended;      /* 1 when bt_model_extend_context scaled the RoPE (the job's
                            * context_extension, recorded with the adapter), else 0 */
} bt_model;

/* Sliding-window attention (hp.sliding_window) against the longest row `max_T` a command will
 * run (`what` names the setting, e.g. "data.seq_len") on a backend that applies the window
 * (`has_window` 1: kernels/cpu/attention.c bt_attn_fwd_win, trainer/infer) or not (0: full causal
 * attention only, e.g. the GPU step). Token i attends to j when 0 <= i - j < window
 * (transformers' sliding_window mask). has_window: logged (INFO) and 0. Otherwise max_T <= window
 * makes every causal pair fall inside the window, so full causal attention is exactly the model's:
 * logged (INFO) and 0; max_T > window: BT_ERR_UNSUPPORTED naming the family's sliding_window, the
 * value and the fix. No window: 0, nothing logged. */
int bt_model_check_window(const bt_model *m, int64_t max_T, const char *what, int has_window);
/* The RoPE table of layer l: m->inv_freq_local for a local layer when the model has one, else
 * `global` (m->inv_freq, or the pass's dynamic table). */
const float *bt_model_layer_inv(const bt_model *m, int l, const float *global);

/* Fill m->inv_freq (allocated here, replacing any previous table) from m->hp. The model's own
 * table: rope_type BT_ROPE_DEFAULT -> bt_rope_inv_freq "default", BT_ROPE_LLAMA3 -> "llama3" with
 * hp's factor / low / high / original context (transformers _compute_llama3_parameters),
 * BT_ROPE_FREQS -> default[i] / rope_freqs[i] (llama.cpp ggml_rope_ext freq_factors, the
 * rope_freqs.weight tensor of convert_hf_to_gguf.py LlamaModel). Then hp->rope_ext on top: LINEAR
 * divides every frequency by the factor (transformers _compute_linear_scaling_rope_parameters;
 * llama.cpp freq_scale), YARN is bt_rope_inv_freq_yarn on a default table and bt_rope_yarn_mix on
 * the others (llama.cpp composes rope_freqs with YaRN the same way), DYNAMIC leaves the table as
 * it is at seq_len <= the original context (bt_model_rope_table gives longer ones). rope_freqs
 * [head_dim/2] fp32 is borrowed and copied into m->rope_freqs (required for BT_ROPE_FREQS, ignored
 * otherwise; may be m->rope_freqs itself). Called by every loader and bt_model_init_random.
 * Errors: BT_ERR_INVALID (bad parameters, non-finite or non-positive rope_freqs), BT_ERR_NOMEM;
 * m->inv_freq is NULL then. */
int bt_model_rope_init(bt_model *m, const float *rope_freqs);

/* The RoPE table for a forward whose largest position id is seq_len - 1: m->inv_freq, except for
 * dynamic NTK scaling beyond the original context, where it is transformers' dynamic table for
 * seq_len (bt_rope_inv_freq_dynamic; composed with a llama3 / rope_freqs table by scaling each of
 * its frequencies by dynamic[i] / default[i]). out [head_dim/2] fp32, caller-owned. Returns 1 when
 * out differs from m->inv_freq (dynamic, seq_len > original context), 0 when it is a copy, or
 * BT_ERR_INVALID. */
int bt_model_rope_table(const bt_model *m, int64_t seq_len, float *out);

/* Context extension (the job's context_extension {target_length, method}): scale the model's
 * RoPE so that target_length positions cover what its context hp->ctx covered, with factor =
 * target_length / hp->ctx: method BT_ROPE_EXT_LINEAR (position interpolation, Chen et al. 2023,
 * arXiv 2306.15595, as LongLoRA uses it), BT_ROPE_EXT_YARN (beta_fast 32, beta_slow 1, attention
 * factor 0.1 ln factor + 1) or BT_ROPE_EXT_DYNAMIC (dynamic NTK), each with transformers'
 * semantics for that rope_type and the model's hp->ctx as the original context; on top of the
 * model's own table (llama3 / rope_freqs compose, see bt_model_rope_init). hp->ctx becomes
 * target_length; the table is rebuilt. A model that already carries a scaling of the same method
 * with this target is left as it is (returns 0, e.g. an exported extended model loaded back).
 * Errors (message names the key and the fix): BT_ERR_INVALID (target_length <= hp->ctx, unknown
 * method, the model already has another rope_ext), those of bt_model_rope_init. */
int bt_model_extend_context(bt_model *m, int method, int target_length);

typedef struct {
    int base_dtype;          /* BT_BASE_NF4 | BT_BASE_FP32 | BT_BASE_GGUF | BT_BASE_AUTO */
    int keep_gguf_qk_order;  /* testing only: 1 = do NOT undo llama.cpp's Q/K permutation */
} bt_model_load_opts;

/* Load a GGUF of general.architecture "llama", "qwen2", "qwen3" or "phi3" (hp.arch), the format
 * llama.cpp's convert_hf_to_gguf.py writes (LlamaModel, Qwen2Model, Qwen3Model, Phi3MiniModel)
 * and llama-model.cpp load_hparams reads. "phi3": keys under "phi3.", no q/k un-permutation,
 * blk.N.attn_qkv [Dq + 2 Dkv, d_model] split into q, k, v rows (blk.N.attn_q/k/v when it is
 * absent, as llama.cpp allows) and blk.N.ffn_up [2 d_ff, d_model] into gate rows then up rows (no
 * ffn_gate tensor; gguf-py 0.19.0 TensorNameMap ATTN_QKV / FFN_UP), biases refused, and
 * rope_factors_long / rope_factors_short tensors (Phi-3 "longrope" / "su" scaling) refused with
 * BT_ERR_UNSUPPORTED naming them. For "qwen2" / "qwen3" every key below is read under that prefix instead of
 * "llama.", head_dim is <arch>.attention.key_length (default embedding_length / head_count),
 * q/k rows are NOT un-permuted (those converters keep HF's rows: llama.cpp applies NEOX RoPE),
 * "qwen2" requires blk.N.attn_{q,k,v}.bias [rows] (any arch: a present blk.N.<linear>.bias is
 * loaded), "qwen3" requires blk.N.attn_{q,k}_norm.weight [head_dim] (hp.qk_norm), and RoPE
 * scaling keys are refused (only "llama" GGUFs carry them here). For "llama": Stages (model.c):
 * architecture; hyper-parameters from the llama.* keys (block_count, embedding_length,
 * attention.head_count, feed_forward_length, attention.layer_norm_rms_epsilon required;
 * context_length 2048, rope.freq_base 10000, attention.head_count_kv = head_count,
 * rope.dimension_count = head_dim by default; partial RoPE refused); llama.rope.scaling.*
 * ("none", "linear", "yarn"; bt_model_gguf_rope_scaling); RoPE tables, with optional
 * rope_freqs.weight (F32 [head_dim/2], llama.cpp's Llama 3.1 RoPE factors: inv_freq = default /
 * rope_freqs -> BT_ROPE_FREQS); tensors token_embd [vocab, d_model] (vocab is its ne[1]),
 * output_norm, output (optional: tied to token_embd when absent); then per block
 * blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output, ffn_norm, ffn_gate, ffn_up,
 * ffn_down}.weight, any ggml type bt_ggml_dequantize supports. Each tensor's shape is checked
 * against the hyper-parameters. q/k rows are un-permuted (inverse of convert_hf_to_gguf.py
 * LlamaModel.permute: w.reshape(n_head, 2, rows/n_head/2, cols).swapaxes(1, 2)). With NF4 the
 * fp32 copy of each linear is freed right after quantisation (peak extra memory: one matrix).
 * base_dtype BT_BASE_GGUF (and BT_BASE_AUTO, which resolves to it here): each linear keeps its
 * tensor's bytes (bt_ggml_mat_init; the q/k un-permutation moves whole block rows, exact), every
 * value is checked finite once, nothing is re-quantised; a linear whose type has no decoder is
 * refused naming the tensor, its type and the supported types (kernels.h bt_ggml_mat).
 * *m is owned by the caller (bt_model_free); on error *m is freed and zeroed. Errors:
 * BT_ERR_IO / BT_ERR_FORMAT from the reader (BT_ERR_IO too when the file changed under the
 * mapping while loading, bt_gguf_check), BT_ERR_UNSUPPORTED (architecture, partial RoPE, RoPE
 * scaling type, tensor type), BT_ERR_NOTFOUND (missing key or tensor), BT_ERR_FORMAT (shape
 * mismatch, bad key value, non-finite weight), BT_ERR_INVALID (implausible hyper-parameters,
 * bt_model_check_hparams), BT_ERR_NOMEM; the message names the file and key/tensor. */
int bt_model_load_gguf(bt_model *m, const char *path, const bt_model_load_opts *opts);

/* dist.shard_base at load (issue 26): rank `rank` of `world` data-parallel ranks. */
typedef struct {
    int rank, world;
} bt_model_shard;
/* bt_model_load_gguf, but each frozen base linear keeps only this rank's cut of it
 * (trainer/backend/plan.h bt_shard_cut_rows over its HF rows: rows [k c, min((k + 1) c, rows)),
 * c = bt_shard_units(rows, world)), read from the mapped file (common/gguf.h bt_gguf_open mmaps
 * it read-only): the other ranks' rows are never copied, decoded or checked here, so the host
 * bytes of the base are about 1/world of the whole (the embedding, norms, biases and lm_head stay
 * whole: every rank runs them). q/k rows are un-permuted before the cut (the cut is of the HF
 * rows, as the GPU's gathered matrix holds them). shard NULL or world 1: bt_model_load_gguf.
 * base_dtype BT_BASE_GGUF / AUTO keeps the file's blocks of its rows; BT_BASE_NF4 quantises only
 * this rank's whole double-quantisation groups of the HF-order matrix (bt_shard_cut_nf4), with the
 * offset of the whole matrix found in a first pass over its rows (model_internal.h
 * bt_model_nf4_cut), so the ranks' bytes concatenate to bt_nf4_quantize's exactly; fp32 is refused
 * (BT_ERR_UNSUPPORTED). Errors: those of bt_model_load_gguf; BT_ERR_INVALID (rank outside
 * [0, world), world < 1). */
int bt_model_load_gguf_shard(bt_model *m, const char *path, const bt_model_load_opts *opts,
                             const bt_model_shard *shard);

/* Load a Hugging Face model directory (trainer/model/model_hf.c): <dir>/config.json and either
 * <dir>/model.safetensors or <dir>/model.safetensors.index.json ("weight_map": tensor -> shard
 * file in <dir>). architectures[0] must be LlamaForCausalLM (SmolLM2, Llama 2/3/3.1/3.2),
 * MistralForCausalLM, Qwen2ForCausalLM (hp.arch BT_ARCH_QWEN2) or Qwen3ForCausalLM
 * (BT_ARCH_QWEN3: hp.qk_norm, tensors model.layers.N.self_attn.{q,k}_norm.weight [head_dim];
 * attention_bias as Llama's, false by default) or Phi3ForCausalLM (BT_ARCH_PHI3: no biases;
 * model.layers.N.self_attn.qkv_proj.weight [Dq + 2 Dkv, hidden] split into q, k, v rows and
 * model.layers.N.mlp.gate_up_proj.weight [2 intermediate, hidden] into gate rows then up rows,
 * as transformers 5.23 Phi3Attention / Phi3MLP's chunk(2) read them; F32 / F16 / BF16 only;
 * rope_scaling / rope_parameters other than "default" ("su", "yarn", "longrope") and
 * partial_rotary_factor != 1 refused naming Phi-3; sliding_window warned about as Mistral's).
 * config.json keys: hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
 * rms_norm_eps, vocab_size (required); num_key_value_heads (default num_attention_heads),
 * head_dim (default hidden_size / num_attention_heads; may differ from it), rope_theta (10000),
 * rope_scaling (null, {"type"|"rope_type": "default"}, "linear" with "factor" > 0, or "llama3"
 * with "factor" > 0, "low_freq_factor" > 0, "high_freq_factor" > low_freq_factor and
 * "original_max_position_embeddings" >= 1, all required as transformers' _validate_llama3_parameters
 * requires them -> BT_ROPE_LLAMA3; "dynamic" (depends on the current sequence length, so it has
 * no fixed training-time meaning), "yarn", "longrope", ... are refused), tie_word_embeddings (false), hidden_act
 * ("silu"), max_position_embeddings (2048), attention_bias / mlp_bias (Llama, false),
 * use_sliding_window (Qwen2, must be false). Biases: Qwen2 has q/k/v biases; Llama's
 * attention_bias adds q/k/v/o biases and mlp_bias gate/up/down biases (all loaded as fp32).
 * Tensors (HF names, shapes [out, in]): model.embed_tokens.weight [vocab, hidden], model.norm.weight,
 * lm_head.weight (ignored when tied; required when not), model.layers.N.{input_layernorm,
 * post_attention_layernorm}.weight, model.layers.N.self_attn.{q,k,v,o}_proj.weight,
 * model.layers.N.mlp.{gate,up,down}_proj.weight. Dtypes F32, F16, BF16 (converted exactly to
 * fp32, common/quant.h); Q/K rows are already in HF (rotate_half) order. A linear stored as a
 * bitsandbytes 4-bit checkpoint (see bt_nf4_from_bnb) is taken as is when base_dtype is NF4 and
 * the checkpoint uses double quantisation, dequantised exactly for an fp32 base, and
 * dequantised then re-quantised (logged) for an NF4 base without double quantisation.
 * base_dtype BT_BASE_AUTO means BT_BASE_NF4 here; BT_BASE_GGUF is refused (BT_ERR_INVALID: a
 * directory has no GGUF blocks to keep).
 * Unknown extra tensors are ignored. *m is owned by the caller (bt_model_free).
 * Errors (message names the file and key/tensor): BT_ERR_IO (unreadable file), BT_ERR_FORMAT
 * (bad JSON, wrong key type, shape mismatch, non-finite weight, lying safetensors header),
 * BT_ERR_NOTFOUND (missing config key, tensor or shard), BT_ERR_UNSUPPORTED (architecture,
 * rope_scaling, dtype, activation, bnb variant), BT_ERR_INVALID (implausible hyper-parameters),
 * BT_ERR_NOMEM. */
int bt_model_load_hf(bt_model *m, const char *dir, const bt_model_load_opts *opts);
/* dist.shard_base at load for a Hugging Face directory (issue 26): bt_model_load_hf, but each
 * frozen base linear stored as F32 / F16 / BF16 (a Phi-3 fused qkv_proj / gate_up_proj part
 * included) keeps only rank shard->rank's NF4 groups of the HF-order matrix (bt_shard_cut_nf4),
 * read a row at a time from the mapped safetensors (common/safetensors.h bt_st_open mmaps it
 * read-only; pass 1's pages given back) and quantised with the whole matrix's offset
 * (model_internal.h bt_model_nf4_cut_rows): the ranks' bytes concatenate to bt_model_load_hf's
 * NF4 bytes exactly, and host memory per rank is about 1/world of the base's (the embedding,
 * norms, biases and lm_head stay whole: every rank runs them). A bitsandbytes 4-bit linear is
 * still held whole (shard_world 0; the GPU upload cuts it). shard NULL or world 1:
 * bt_model_load_hf. Only base_dtype nf4 (or auto) is cut: fp32 is refused (BT_ERR_UNSUPPORTED).
 * Errors: those of bt_model_load_hf; BT_ERR_INVALID (rank outside [0, world), world < 1). */
int bt_model_load_hf_shard(bt_model *m, const char *dir, const bt_model_load_opts *opts,
                           const bt_model_shard *shard);
/* dist.shard_base at load, whatever `path` is: a directory bt_model_load_hf_shard, anything else
 * bt_model_load_gguf_shard. Errors: theirs; BT_ERR_IO when `path` does not exist. */
int bt_model_load_shard(bt_model *m, const char *path, const bt_model_load_opts *opts,
                        const bt_model_shard *shard);

/* The trainer's `model` key: a directory is a Hugging Face model (bt_model_load_hf), anything
 * else a GGUF file (bt_model_load_gguf); opts->base_dtype BT_BASE_AUTO becomes BT_BASE_GGUF for
 * a GGUF file and BT_BASE_NF4 for a directory (bt_model_resolve_base_dtype). Errors: those of
 * the chosen loader; BT_ERR_IO when `path` does not exist. */
int bt_model_load(bt_model *m, const char *path, const bt_model_load_opts *opts);
/* base_dtype as bt_model_load would hold `path`'s base: BT_BASE_AUTO -> BT_BASE_GGUF for a file,
 * BT_BASE_NF4 for a directory (or a path that cannot be stat'ed); other values unchanged. */
int bt_model_resolve_base_dtype(const char *path, int base_dtype);

/* One bitsandbytes 4-bit linear in its checkpoint layout (QuantState.as_dict(packed=True);
 * docs/formats/nf4.md §Checkpoint) from safetensors `files` (`path` is for messages):
 *   <w>                                   U8 [rows*cols/2, 1] (or [rows*cols/2]) packed nibbles
 *   <w>.absmax                            U8 [nblocks] with double quantisation (F32 without)
 *   <w>.quant_map                         F32 [16], must equal bt_nf4_code
 *   <w>.nested_absmax                     F32 [ceil(nblocks/256)]        (double quantisation)
 *   <w>.nested_quant_map                  F32 [256], must equal bt_dynamic_code8 (entry 0 may
 *                                         also be -1.0, bnb's CPU overwrite, if no absmax code
 *                                         is 0; the kernels always decode with the tables)
 *   <w>.quant_state.bitsandbytes__nf4     U8 JSON: quant_type "nf4", blocksize 64, shape
 *                                         [rows, cols], nested_blocksize 256, nested_offset
 * where <w> = weight_name (e.g. "model.layers.0.mlp.gate_proj.weight"). The bytes are copied
 * into *q WITHOUT re-quantising (q->offset = nested_offset); *q is owned by the caller
 * (bt_nf4_free). `files`: n_files >= 1 open files searched in order for each key (the shards
 * of a sharded checkpoint). Errors: BT_ERR_NOTFOUND (missing key), BT_ERR_FORMAT (dtype, shape
 * or JSON mismatch), BT_ERR_UNSUPPORTED (fp4, blocksize != 64, other maps, a checkpoint without
 * double quantisation: F32 absmax; bt_model_load_hf dequantises those itself), BT_ERR_NOMEM;
 * *q is zeroed on error. */
struct bt_st_file;
int bt_nf4_from_bnb(bt_nf4 *q, struct bt_st_file *const *files, int n_files,
                    const char *weight_name, int64_t rows, int64_t cols, const char *path);

/* A random tiny Llama for tests: embeddings N(0, 1), each linear W[out, in] N(0, 1/in) (so
 * activations keep unit scale through the layers and gradients are well above fp32 noise),
 * norm weights 1 + N(0, 0.1) (so they are not trivially 1), lm_head tied to the embedding when
 * tied != 0, else its own N(0, 1/d_model). hp->head_dim must equal d_model / n_head; for NF4 every
 * linear's element count must be a multiple of 64. Deterministic in seed. base_dtype
 * BT_BASE_GGUF / AUTO are refused (BT_ERR_INVALID; use bt_model_to_ggml on an fp32 model).
 * Errors: BT_ERR_INVALID (bad hparams), BT_ERR_UNSUPPORTED (NF4 size), BT_ERR_NOMEM. */
int bt_model_init_random(bt_model *m, const bt_llama_hparams *hp, int base_dtype, int tied,
                         uint64_t seed);

/* Tests and benchmarks: turn every fp32 base linear of m (base_dtype BT_BASE_FP32) into ggml
 * `type` blocks in place (common/quant.h bt_ggml_quantize; the fp32 copies are freed), so that
 * m->base_dtype becomes BT_BASE_GGUF, as if loaded from a GGUF of that type (rows in HF order).
 * Errors: BT_ERR_INVALID (m not fp32, or a linear's cols not a multiple of the type's block:
 * m unchanged), BT_ERR_UNSUPPORTED (type without encoder/decoder), BT_ERR_NOMEM (then m is a
 * GGUF base whose remaining linears are still fp32: usable, bt_model_free frees it). */
int bt_model_to_ggml(bt_model *m, int type);

void bt_model_free(bt_model *m);

/* Scratch (floats) needed by bt_base_fwd / bt_base_bwd_x for this model: for every OpenMP thread
 * (omp_get_max_threads() now, so query it after setting the thread count) one dequantisation tile
 * (NF4 or ggml, kernels/cpu/tiled_gemm.c) as wide as the widest linear input (d_model, d_ff or
 * n_head * head_dim); 1 for an fp32 base. */
size_t bt_model_scratch_floats(const bt_model *m);

/* Y[M, rows] = X[M, cols] @ W^T (+ bias[rows] broadcast over M when l->bias) + beta * Y, W fp32,
 * NF4 or ggml blocks (the last two dequantised tile by tile). */
void bt_base_fwd(float *Y, const float *X, const bt_base_linear *l, int M, float beta,
                 float *scratch);
/* dX[M, cols] = dY[M, rows] @ W + beta * dX (the bias does not enter the input gradient). */
void bt_base_bwd_x(float *dX, const float *dY, const bt_base_linear *l, int M, float beta,
                   float *scratch);

/* Bytes held by the model's tensors (for logs). */
size_t bt_model_bytes(const bt_model *m);

/* What the frozen base linears hold, for logs, `trainer estimate` and the trainer's report to
 * loaderd: the seven linears of every layer (biases, embedding and norms excluded). */
typedef struct {
    int base_dtype;         /* BT_BASE_* of the model */
    int64_t n_weights;      /* elements of all base linears */
    uint64_t bytes;         /* bytes they occupy (blocks, NF4 codes + scales, or fp32) */
    double bits_per_weight; /* 8 * bytes / n_weights */
    char types[64];         /* "nf4", "fp32", or the ggml types present, most weights first
                             * ("Q4_K+Q6_K"); truncated with "+..." past 63 bytes */
} bt_base_info;
void bt_model_base_info(const bt_model *m, bt_base_info *out);

#endif
