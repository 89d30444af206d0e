/* The frozen Llama base model held by the CPU trainer.
 *
 * Layout is Hugging Face's (LlamaForCausalLM): every linear is torch.nn.Linear W[out, in]
 * row-major fp32 (or NF4 of that same matrix); q_proj/k_proj rows are in HF order, i.e. the
 * llama.cpp GGUF Q/K permutation is undone at load, so RoPE is the "rotate_half" form of
 * kernels.h (bt_rope_*). Embedding, lm_head and norms stay fp32 (as bitsandbytes QLoRA keeps
 * them unquantised); the seven linears per layer are BT_BASE_NF4 (kernels.h bt_nf4) or fp32. */
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
} bt_llama_hparams;

/* One frozen linear W[rows=out, cols=in]. Exactly one of w / q is in use (is_nf4). */
typedef struct {
    int rows, cols;
    int is_nf4;
    float *w;   /* [rows, cols] fp32 when !is_nf4 (owned) */
    bt_nf4 q;   /* when is_nf4 (owned) */
} bt_base_linear;

typedef struct {
    float *attn_norm;              /* [d_model] */
    float *ffn_norm;               /* [d_model] */
    bt_base_linear lin[BT_MOD_N];  /* indexed by BT_MOD_Q .. BT_MOD_DOWN */
} bt_layer;

typedef struct {
    bt_llama_hparams hp;
    int base_dtype;        /* BT_BASE_NF4 | BT_BASE_FP32 */
    float *tok_embd;       /* [vocab, d_model] fp32 (owned) */
    float *lm_head;        /* [vocab, d_model]; == tok_embd when tied (not separately owned) */
    int tied;
    float *output_norm;    /* [d_model] */
    bt_layer *layers;      /* [n_layer] */
} bt_model;

typedef struct {
    int base_dtype;          /* BT_BASE_NF4 | BT_BASE_FP32 */
    int keep_gguf_qk_order;  /* testing only: 1 = do NOT undo llama.cpp's Q/K permutation */
} bt_model_load_opts;

/* Load a llama-architecture GGUF (general.architecture == "llama"). Hyper-parameters from the
 * llama.* keys; tensors token_embd, output_norm, output (optional: tied to token_embd when
 * absent), blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output, ffn_norm, ffn_gate, ffn_up,
 * ffn_down}.weight, any ggml type bt_ggml_dequantize supports. Each tensor's shape is checked
 * against the hyper-parameters. q/k rows are un-permuted (inverse of convert_hf_to_gguf.py
 * LlamaModel.permute: w.reshape(n_head, 2, rows/n_head/2, cols).swapaxes(1, 2)). With NF4 the
 * fp32 copy of each linear is freed right after quantisation (peak extra memory: one matrix).
 * *m is owned by the caller (bt_model_free). Errors: BT_ERR_IO / BT_ERR_FORMAT from the reader,
 * BT_ERR_UNSUPPORTED (architecture, tensor type), BT_ERR_NOTFOUND (missing key or tensor),
 * BT_ERR_FORMAT (shape mismatch), BT_ERR_NOMEM; the message names the file and key/tensor. */
int bt_model_load_gguf(bt_model *m, const char *path, const bt_model_load_opts *opts);

/* A random tiny Llama for tests: embeddings N(0, 1), each linear W[out, in] N(0, 1/in) (so
 * activations keep unit scale through the layers and gradients are well above fp32 noise),
 * norm weights 1 + N(0, 0.1) (so they are not trivially 1), lm_head tied to the embedding when
 * tied != 0, else its own N(0, 1/d_model). hp->head_dim must equal d_model / n_head; for NF4 every
 * linear's element count must be a multiple of 64. Deterministic in seed.
 * Errors: BT_ERR_INVALID (bad hparams), BT_ERR_UNSUPPORTED (NF4 size), BT_ERR_NOMEM. */
int bt_model_init_random(bt_model *m, const bt_llama_hparams *hp, int base_dtype, int tied,
                         uint64_t seed);

void bt_model_free(bt_model *m);

/* Per-thread scratch (floats) needed by bt_base_fwd / bt_base_bwd_x for this model. */
size_t bt_model_scratch_floats(const bt_model *m);

/* Y[M, rows] = X[M, cols] @ W^T + beta * Y, W fp32 or NF4 (dequantised tile by tile). */
void bt_base_fwd(float *Y, const float *X, const bt_base_linear *l, int M, float beta,
                 float *scratch);
/* dX[M, cols] = dY[M, rows] @ W + beta * dX. */
void bt_base_bwd_x(float *dX, const float *dY, const bt_base_linear *l, int M, float beta,
                   float *scratch);

/* Bytes held by the model's tensors (for logs). */
size_t bt_model_bytes(const bt_model *m);

#endif
