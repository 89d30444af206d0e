/* BarqTrain numeric kernels, CPU reference API: the fp32 kernels of kernels/cpu/ (one file per op:
 * linear, nf4, ggml, norm, rope, attention, swiglu, embedding, loss, optim; OpenBLAS sgemm for
 * matmuls, threads via OpenMP where it pays). They define the numerics every other backend is
 * checked against: kernels/cuda/kernels_cuda.h is the GPU API, with the same op names file for
 * file (kernels/cpu/X.c <-> kernels/cuda/X.cu), and tests/gpu/ compares each launcher with the
 * function here. All tensors are row-major, contiguous, fp32 unless stated; M = number of
 * tokens (B*T flattened). Weights follow torch.nn.Linear: W[out, in].
 * Functions with `beta` compute out = op(...) + beta * out (beta 0 overwrites). */
#ifndef BT_KERNELS_H
#define BT_KERNELS_H
#include <stddef.h>
#include <stdint.h>

/* ---- linear algebra ---- */
/* Y[M,N] = X[M,K] @ W[N,K]^T + beta*Y */
void bt_linear_fwd(float *Y, const float *X, const float *W, int M, int K, int N, float beta);
/* dX[M,K] = dY[M,N] @ W[N,K] + beta*dX */
void bt_linear_bwd_x(float *dX, const float *dY, const float *W, int M, int K, int N, float beta);
/* dW[N,K] = dY[M,N]^T @ X[M,K] + beta*dW */
void bt_linear_bwd_w(float *dW, const float *dY, const float *X, int M, int K, int N, float beta);
/* General row-major GEMM, C[M,N] = alpha * op(A) @ op(B) + beta*C, op = transpose when trans* != 0
 * (A is [M,K] or, transposed, [K,M]; B is [K,N] or [N,K]; lda/ldb/ldc are row strides). Same
 * threading as every kernel here: OpenBLAS is kept at one thread for the whole process and the
 * GEMM is split over OpenMP threads (kernels/cpu/blas_par.c says why). Use this instead of calling
 * cblas_sgemm directly. */
void bt_sgemm(int transA, int transB, int M, int N, int K, float alpha, const float *A, int lda,
              const float *B, int ldb, float beta, float *C, int ldc);

/* ---- NF4 with double quantisation (bitsandbytes layout; docs/formats/nf4.md) ----
 * blocksize 64 over the flattened tensor; packed byte j holds element 2j in the high nibble and
 * 2j+1 in the low nibble; absmax per 64-block is mean-centred (offset) and quantised with the
 * signed 8-bit dynamic map (create_dynamic_map(signed=True)) in blocks of 256 with one fp32
 * nested_absmax each. Dequant: absmax[b] = code8[absmax_q[b]] * nested_absmax[b/256] + offset;
 * x[i] = NF4[nibble(i)] * absmax[i/64]. */
#define BT_NF4_BLOCKSIZE 64
#define BT_NF4_NESTED_BLOCKSIZE 256
typedef struct {
    int64_t n;              /* elements (multiple of 64) */
    int64_t rows, cols;     /* logical shape [out, in] */
    uint8_t *packed;        /* [n/2] */
    uint8_t *absmax_q;      /* [n/64] */
    float *nested_absmax;   /* [ceil(n/64/256)] */
    float offset;
} bt_nf4;
extern const float bt_nf4_code[16];        /* bitsandbytes get_4bit_type("nf4") */
float bt_dynamic_code8(int idx);            /* create_dynamic_map(signed=True)[idx], idx 0..255 */
/* Quantise W[rows, cols] (rows*cols multiple of 64). Allocates q's buffers (free with
 * bt_nf4_free). Reproduces bitsandbytes quantize_4bit(nf4, blocksize=64, compress_statistics=True). */
int bt_nf4_quantize(bt_nf4 *q, const float *W, int64_t rows, int64_t cols);
/* One data-parallel rank's part of bt_nf4_quantize (dist.shard_base loading only its cut,
 * trainer/backend/plan.h bt_shard_cut_nf4): the double quantisation subtracts one offset per
 * matrix (the mean of ALL its 64-block absmaxes), so a part alone cannot find it. Pass 1:
 * bt_nf4_block_absmax over the whole matrix (streamed, any number of calls, blocks in order) and
 * bt_nf4_absmax_offset of the result (bitsandbytes' torch.sum order, fp32, / nblocks); pass 2:
 * bt_nf4_quantize_part on the part's x[n] (n a multiple of 64; it must start at a 256-block
 * nested-group boundary of the whole matrix, 16384 weights) with that offset. q then holds
 * exactly the whole quantisation's bytes of those elements (packed [n/2], absmax_q [n/64],
 * nested_absmax [ceil(n/64/256)], offset): the parts concatenate to bt_nf4_quantize's arrays bit
 * for bit. q->n = n; q->rows / cols = the whole matrix's shape (a part is never a CPU operand).
 * n = 0 (a rank past the end): no buffers. BT_ERR_INVALID / BT_ERR_NOMEM. */
void bt_nf4_block_absmax(const float *x, int64_t nblocks, float *absmax);
float bt_nf4_absmax_offset(const float *absmax, int64_t nblocks);
int bt_nf4_quantize_part(bt_nf4 *q, const float *x, int64_t n, float offset, int64_t rows, int64_t cols);
/* Dequantise rows [r0, r0+nr) into out[nr, cols]. BT_ERR_INVALID (nothing written) for a range
 * outside [0, rows) or NULL q / out. */
int bt_nf4_dequantize_rows(const bt_nf4 *q, int64_t r0, int64_t nr, float *out);
void bt_nf4_free(bt_nf4 *q);
/* Y[M,N] = X[M,K] @ deq(Wq)[N,K]^T + beta*Y, dequantising tile by tile (no full fp32 copy).
 * scratch: at least bt_nf4_scratch_floats(K) floats (bt_tile_scratch_floats for the current
 * omp_get_max_threads() team). */
size_t bt_nf4_scratch_floats(int K);
/* Floats of dequantisation scratch the tiled NF4 / ggml drivers (kernels/cpu/tiled_gemm.c) need
 * for inner dimension K with a team of `threads` OpenMP threads: one 128-row (BT_TILE_ROWS) x K
 * fp32 tile per thread; 0 for K <= 0, threads < 1 counts as 1. Pure arithmetic (the memory plan,
 * trainer/backend/plan.h, sizes the step's scratch with it for any team). */
size_t bt_tile_scratch_floats(int threads, int K);
void bt_nf4_linear_fwd(float *Y, const float *X, const bt_nf4 *Wq, int M, int K, int N, float beta,
                       float *scratch);
/* dX[M,K] = dY[M,N] @ deq(Wq)[N,K] + beta*dX */
void bt_nf4_linear_bwd_x(float *dX, const float *dY, const bt_nf4 *Wq, int M, int K, int N,
                         float beta, float *scratch);

/* ---- ggml block-quantised weights (GGUF's own formats; the "GGUF-native" base) ----
 * A frozen linear W[rows = out, cols = in] kept in the blocks of its GGUF file, without
 * re-quantisation: row r is bytes [r * row_bytes, (r+1) * row_bytes) of `data`, each row
 * cols / block_elems consecutive ggml blocks (ggml-common.h layouts; blocks run along `cols`,
 * GGUF ne[0]). Types: every one common/quant.h bt_ggml_can_dequantize accepts (Q4_0, Q4_1, Q5_0,
 * Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, F16, BF16, F32). Dequantisation goes through
 * common/quant.c bt_ggml_dequantize, so every value the matmuls below use is bit-identical to
 * gguf-py's quants.dequantize of the same bytes (tests/fixtures/quant). */
typedef struct {
    int type;          /* bt_ggml_type (common/gguf.h) */
    int64_t rows, cols;
    size_t row_bytes;  /* bt_ggml_row_size(type, cols) */
    uint8_t *data;     /* [rows * row_bytes], owned (bt_aligned_alloc; free with bt_ggml_mat_free) */
} bt_ggml_mat;
/* Copy a [rows, cols] ggml tensor into *w (allocated here). Row r of w is row row_src[r] of
 * `src` (row_src NULL: row r; a permutation lets the loader undo llama.cpp's Q/K row order on
 * the blocks themselves, which is exact: blocks never cross rows). src: rows * row_bytes bytes,
 * any alignment, read only during the call. Errors (w zeroed): BT_ERR_UNSUPPORTED (type without a
 * decoder; the message lists the supported types), BT_ERR_INVALID (rows/cols < 1, cols not a
 * multiple of the block size, row_src entry out of range, NULL src), BT_ERR_NOMEM. */
int bt_ggml_mat_init(bt_ggml_mat *w, int type, int64_t rows, int64_t cols, const void *src,
                     const int32_t *row_src);
void bt_ggml_mat_free(bt_ggml_mat *w);
/* Bytes held by w's blocks (rows * row_bytes). */
size_t bt_ggml_mat_bytes(const bt_ggml_mat *w);
/* Dequantise rows [r0, r0+nr) into out[nr, cols] fp32 (caller owned), bit-identical to
 * bt_ggml_dequantize of those rows' bytes; rows in parallel (OpenMP) when large. BT_ERR_INVALID
 * (nothing written) for a range outside [0, rows) or NULL w / out. */
int bt_ggml_mat_dequantize_rows(const bt_ggml_mat *w, int64_t r0, int64_t nr, float *out);
/* Y[M,N] = X[M,K] @ deq(W)[N,K]^T + beta*Y, W rows == N, cols == K, dequantising BT_TILE_ROWS
 * (128) rows at a time per thread into scratch (>= bt_ggml_scratch_floats(K) floats, the same
 * size as bt_nf4_scratch_floats) and multiplying each tile with a single-threaded sgemm: the
 * NF4 path's driver (kernels/cpu/tiled_gemm.c). The fp32 weight is never formed; F32 tensors
 * skip the copy (bt_linear_fwd on the blocks themselves). Same result as bt_linear_fwd on the
 * dequantised matrix up to sgemm summation order. */
size_t bt_ggml_scratch_floats(int K);
void bt_ggml_linear_fwd(float *Y, const float *X, const bt_ggml_mat *W, int M, int K, int N,
                        float beta, float *scratch);
/* dX[M,K] = dY[M,N] @ deq(W)[N,K] + beta*dX (input gradient of the frozen base), same tiling. */
void bt_ggml_linear_bwd_x(float *dX, const float *dY, const bt_ggml_mat *W, int M, int K, int N,
                          float beta, float *scratch);

/* ---- RMSNorm (Zhang & Sennrich 2019; HF LlamaRMSNorm: y = w * x * rsqrt(mean(x^2) + eps)) ---- */
/* x,y [M,D]; w [D]; rstd [M] saved for backward. */
void bt_rmsnorm_fwd(float *y, float *rstd, const float *x, const float *w, int M, int D, float eps);
/* dx [M,D] (overwritten); dw [D] accumulated into if non-NULL. */
void bt_rmsnorm_bwd(float *dx, float *dw, const float *dy, const float *x, const float *w,
                    const float *rstd, int M, int D);

/* ---- RoPE, HF "rotate_half" layout (pairs (i, i+D/2)); theta^(-2i/D); position p is
 * position_ids[m] * pos_scale (pos_scale = 1/interpolation factor, 1.0 = none) ---- */
/* x [M, H, D] rotated in place. */
int bt_rope_fwd(float *x, const int32_t *position_ids, int M, int H, int D, float theta, float pos_scale);
/* dx [M, H, D] in place: applies the inverse rotation (transpose). */
int bt_rope_bwd(float *dx, const int32_t *position_ids, int M, int H, int D, float theta, float pos_scale);

/* RoPE with a precomputed inverse-frequency table (kernels/cpu/rope.c): x [M, H, D] fp32 rotated in
 * place, pair (x[i], x[i+D/2]) by angle ((float)position_ids[m] * pos_scale) * inv_freq[i] (fp32,
 * cos/sin in double rounded to fp32); inv_freq [D/2] fp32, borrowed (read during the call).
 * position_ids [M] int32 (any value). BT_ERR_INVALID (nothing rotated) unless M >= 0, H >= 1 and D
 * even >= 2 (M == 0: nothing to do); BT_ERR_NOMEM when a row's cos/sin buffer (D > 512) cannot be
 * allocated. The same errors for every RoPE function below and for bt_rope_fwd / bt_rope_bwd.
 * Every row's cos/sin is computed here; bt_rope_fwd_cached is the same rotation with a table kept
 * between calls. bt_rope_fwd(theta) equals bt_rope_fwd_freq with the "default" table of
 * bt_rope_inv_freq, bit for bit. */
int bt_rope_fwd_freq(float *x, const int32_t *position_ids, int M, int H, int D,
                     const float *inv_freq, float pos_scale);
/* Backward of bt_rope_fwd_freq: dx [M, H, D] in place gets the transposed (inverse) rotation
 * dx[i] = dy[i]*cos + dy[i+D/2]*sin, dx[i+D/2] = dy[i+D/2]*cos - dy[i]*sin. Same arguments. */
int bt_rope_bwd_freq(float *dx, const int32_t *position_ids, int M, int H, int D,
                     const float *inv_freq, float pos_scale);
/* The cos/sin table of bt_rope_fwd_cached / bt_rope_bwd_cached, owned by its user (the trainer's
 * step context, the inference state: never process-wide). Zero-initialised = empty; the first
 * call builds the table of its (inv_freq, pos_scale, D) for positions [0, max(4096, needed)), a
 * later call with more positions doubles it (capped at 2^20 positions: beyond, rows are computed
 * directly), and one with another table, scale or head size replaces it (cos_sin: npos * D/2
 * (cos, sin) fp32 pairs; inv: a copy of the inv_freq it was built from). Not thread-safe: one
 * caller at a time (the rotation itself runs on OpenMP threads). bt_rope_cache_free releases it
 * and leaves it empty; NULL is a no-op. */
typedef struct {
    float pos_scale;
    int D, npos;    /* the table covers positions [0, npos) for head dim D */
    float *inv;     /* [D/2] */
    float *cos_sin; /* [npos][D/2][2] */
} bt_rope_cache;
void bt_rope_cache_free(bt_rope_cache *cache);
/* bt_rope_fwd_freq / bt_rope_bwd_freq with the cos/sin table kept in *cache (NULL: none, every
 * row computed): bit for bit the same results (the table holds the same fp32 values). When the
 * table cannot be allocated, rows are computed directly (not an error). */
int bt_rope_fwd_cached(bt_rope_cache *cache, float *x, const int32_t *position_ids, int M, int H,
                       int D, const float *inv_freq, float pos_scale);
int bt_rope_bwd_cached(bt_rope_cache *cache, float *dx, const int32_t *position_ids, int M, int H,
                       int D, const float *inv_freq, float pos_scale);
/* inv_freq [D/2] fp32 (caller-owned output) as transformers 4.46 modeling_rope_utils.py computes
 * it in fp32 (ROPE_INIT_FUNCTIONS[type]): type NULL or "default" (_compute_default_rope_parameters:
 * 1.0 / theta ** (arange(0, D, 2).float() / D)); "linear" (_compute_linear_scaling_rope_parameters:
 * default / factor); "llama3" (_compute_llama3_parameters, Llama 3.1: wavelen = 2*pi / inv_freq;
 * wavelen < original_max_pos / high_freq_factor keeps inv_freq, wavelen > original_max_pos /
 * low_freq_factor divides it by factor, in between smooth = (original_max_pos / wavelen -
 * low_freq_factor) / (high_freq_factor - low_freq_factor) and inv = (1 - smooth) * inv / factor +
 * smooth * inv), each operation rounded as torch does (Python scalars in double then fp32;
 * `scalar / tensor` as tensor.reciprocal() * scalar). factor / low / high / original_max_pos are
 * ignored by "default". The attention scaling of these types is 1. Errors (bt_fail message):
 * BT_ERR_INVALID (D odd or < 2, theta <= 0, factor <= 0, llama3 with low_freq_factor >=
 * high_freq_factor or original_max_pos < 1), BT_ERR_UNSUPPORTED (any other type: inv_freq untouched;
 * "yarn" and "dynamic" have their own functions below, since they take more parameters). */
int bt_rope_inv_freq(float *inv_freq, int D, float theta, const char *type, float factor,
                     float low_freq_factor, float high_freq_factor, int original_max_pos);

/* YaRN (Peng et al. 2023, arXiv 2309.00071) as transformers 4.46 _compute_yarn_parameters computes
 * it in fp32 for rope_scaling {"rope_type": "yarn", factor, beta_fast, beta_slow} on a model whose
 * max_position_embeddings is `orig`: pos_freqs = theta^(2i/D), extrapolation = 1 / pos_freqs,
 * interpolation = 1 / (factor pos_freqs), low / high = floor / ceil of D ln(orig / (beta 2 pi)) /
 * (2 ln theta) for beta_fast / beta_slow (clamped to [0, D-1]), ramp = clamp((i - low) /
 * (high - low), 0, 1) (high += 0.001 when equal), e = 1 - ramp, inv = interpolation (1 - e) +
 * extrapolation e. beta_fast / beta_slow 0 = the defaults 32 / 1. inv_freq [D/2] fp32,
 * caller-owned. Errors: BT_ERR_INVALID (D odd, theta <= 1, factor <= 0, orig < 1, betas <= 0). */
int bt_rope_inv_freq_yarn(float *inv_freq, int D, float theta, float factor, int orig,
                          float beta_fast, float beta_slow);
/* YaRN applied to an arbitrary table (composition with a model's own scaling, e.g. Llama 3.1
 * "llama3" or GGUF rope_freqs): inv[i] = (inv[i] / factor)(1 - e_i) + inv[i] e_i with the e_i of
 * bt_rope_inv_freq_yarn (the same ramp llama.cpp's ggml_rope_yarn_corr_dims / rope_yarn_ramp use,
 * which also compose it with rope_freqs). In place; errors as bt_rope_inv_freq_yarn. */
int bt_rope_yarn_mix(float *inv_freq, int D, float theta, float factor, int orig, float beta_fast,
                     float beta_slow);
/* YaRN's attention (cos/sin magnitude) scaling: attention_factor when > 0 (rope_scaling
 * "attention_factor"), else 0.1 ln(factor) + 1 (the paper's mscale; transformers' default). Both
 * q and k are scaled by it in transformers (cos and sin are multiplied), so the attention scores
 * carry its square: the trainer folds that into the softmax scale. */
float bt_rope_yarn_attention_factor(float factor, float attention_factor);
/* Dynamic NTK scaling (transformers 4.46 _compute_dynamic_ntk_parameters, called from
 * LlamaRotaryEmbedding._dynamic_frequency_update with seq_len = max(position_ids) + 1): for
 * seq_len <= orig (max_position_embeddings) the default table; beyond, base' = theta * ((factor *
 * seq_len / orig) - (factor - 1))^(D / (D - 2)) evaluated in fp32 as torch does it (seq_len is an
 * int64 tensor there), inv[i] = 1 / base'^(2i/D). inv_freq [D/2] fp32 caller-owned. Errors:
 * BT_ERR_INVALID (D odd or < 4, theta / factor <= 0, orig < 1). */
int bt_rope_inv_freq_dynamic(float *inv_freq, int D, float theta, float factor, int orig,
                             int64_t seq_len);

/* ---- causal attention over packed variable-length segments, GQA, optional S^2-Attn ----
 * (kernels/cpu/attention.c: FlashAttention-2-style online softmax over key tiles, fp32)
 * q [M, Hq, D], k,v [M, Hkv, D], Hq % Hkv == 0 (query head h uses kv head h / (Hq/Hkv)).
 * cu_seqlens [n_seq+1] over M (nondecreasing, cu[0] = 0, cu[n_seq] = M; rows outside get out = 0,
 * lse = 0); token i attends to j in its own segment with j <= i.
 * out [M, Hq, D]; lse [M, Hq] (natural-log logsumexp of the scaled scores) saved for backward.
 * scale: the softmax scale (1/sqrt(D) for Llama; times mscale^2 for YaRN). All fp32, caller owned.
 * Errors as bt_attn_fwd_s2 below (the outputs then zeroed). */
int bt_attn_fwd(float *out, float *lse, const float *q, const float *k, const float *v,
                const int32_t *cu_seqlens, int n_seq, int M, int Hq, int Hkv, int D, float scale);
/* dq [M,Hq,D], dk, dv [M,Hkv,D] overwritten. Errors as bt_attn_bwd_s2 below. */
int bt_attn_bwd(float *dq, float *dk, float *dv, const float *dout, const float *out,
                const float *lse, const float *q, const float *k, const float *v,
                const int32_t *cu_seqlens, int n_seq, int M, int Hq, int Hkv, int D, float scale);
/* The same with LongLoRA's shifted sparse attention (S^2-Attn; Chen et al. 2023, arXiv 2309.12307,
 * llama_attn_replace.py, in its varlen form without the roll) when s2_group = G > 0: positions are
 * local to each cu_seqlens segment (document); query heads h < Hq/2 attend only within groups
 * [kG, (k+1)G), heads h >= Hq/2 within groups shifted by G/2: [0, G/2), [G/2, 3G/2), ... (a
 * half-size group at the start and whatever is left at the end; no token ever sees a later one, or
 * one of another document). Causal inside each group. G = 0 is full causal attention (exactly
 * bt_attn_fwd / bt_attn_bwd). Same semantics as kernels/cuda bt_cuda_attn_params.s2_group.
 * Returns 0, BT_ERR_INVALID (bad shapes, G odd or < 0; outputs untouched) or BT_ERR_NOMEM
 * (scratch: forward threads x 33 K floats; backward the same x 2 plus, with GQA, 2 x M x Hq x D
 * floats of per-head dK/dV accumulators; the backward's outputs are zeroed then), with a message.
 * bt_attn_fwd / bt_attn_bwd are these with G = 0 (errors leave their outputs zeroed). */
int bt_attn_fwd_s2(float *out, float *lse, const float *q, const float *k, const float *v,
                   const int32_t *cu_seqlens, int n_seq, int M, int Hq, int Hkv, int D, float scale,
                   int s2_group);
int bt_attn_bwd_s2(float *dq, float *dk, float *dv, const float *dout, const float *out,
                   const float *lse, const float *q, const float *k, const float *v,
                   const int32_t *cu_seqlens, int n_seq, int M, int Hq, int Hkv, int D, float scale,
                   int s2_group);
/* The same with a sliding window of `window` keys (Mistral / Gemma 2-3 / Phi-3 local attention;
 * transformers sliding_window_overlay and llama.cpp LLAMA_SWA_TYPE_STANDARD: a query at local
 * position i sees key j of its own segment (S^2 sub-segment) iff i - window < j <= i); window 0 is
 * no window (exactly bt_attn_fwd_s2 / bt_attn_bwd_s2). Key tiles wholly before a block's window
 * are skipped, so the cost per query is O(window). Errors as bt_attn_fwd_s2 (also window < 0). */
int bt_attn_fwd_win(float *out, float *lse, const float *q, const float *k, const float *v,
                    const int32_t *cu_seqlens, int n_seq, int M, int Hq, int Hkv, int D, float scale,
                    int s2_group, int window);
int bt_attn_bwd_win(float *dq, float *dk, float *dv, const float *dout, const float *out,
                    const float *lse, const float *q, const float *k, const float *v,
                    const int32_t *cu_seqlens, int n_seq, int M, int Hq, int Hkv, int D, float scale,
                    int s2_group, int window);
/* One past the last local position of the S^2 group that contains local position i (i >= 0):
 * (i/G + 1) G unshifted, ((i + G/2) / G) G + G/2 shifted; INT_MAX when G <= 0 (one group). */
int bt_s2_group_end(int i, int G, int shifted);

/* ---- SwiGLU: h = silu(gate) * up (Shazeer 2020; HF LlamaMLP) ---- */
void bt_swiglu_fwd(float *h, const float *gate, const float *up, int64_t n);
void bt_swiglu_bwd(float *dgate, float *dup, const float *dh, const float *gate, const float *up, int64_t n);
/* ---- GeGLU with the tanh-approximated GELU: h = gelu_tanh(gate) * up (Shazeer 2020; HF
 * Gemma3MLP with hidden_activation "gelu_pytorch_tanh", torch.nn.functional.gelu(approximate=
 * "tanh"): gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))). Shapes, aliasing and
 * threading as bt_swiglu_fwd / bt_swiglu_bwd (kernels/cpu/swiglu.c). ---- */
void bt_geglu_fwd(float *h, const float *gate, const float *up, int64_t n);
void bt_geglu_bwd(float *dgate, float *dup, const float *dh, const float *gate, const float *up, int64_t n);

/* ---- embedding ---- */
/* out[M, D] = table[ids[m], :], table [vocab, D]. Errors (nothing written): BT_ERR_RANGE for an id
 * outside [0, vocab) ("embedding forward: input_ids[m] = id is outside the vocabulary [0, V)"),
 * BT_ERR_INVALID for M < 0, D or vocab < 1 or a NULL pointer (M > 0). */
int bt_embedding_fwd(float *out, const float *table, const int32_t *ids, int M, int D, int vocab);
/* Backward (scatter-add): dtable[ids[m], :] += dout[m, :] for m < M in order of m. dtable
 * [vocab, D]; deterministic for any thread count (threads split the D columns, each column summed
 * in token order). Errors as bt_embedding_fwd (nothing written). */
int bt_embedding_bwd(float *dtable, const float *dout, const int32_t *ids, int M, int D, int vocab);
/* BT_ERR_RANGE naming the first of ids[0..M) outside [0, vocab) (`what`: "forward", "backward"
 * in the message), else BT_OK. */
int bt_embedding_check_ids(const int32_t *ids, int M, int vocab, const char *what);

/* ---- fused linear + cross-entropy, chunked (Liger FLCE / Apple CCE idea; never holds
 * [M x V] logits: at most chunk_rows x V at a time) ----
 * logits = X[M,D] @ W[V,D]^T; targets[m] in [0,V) or -100 (ignored).
 * Returns the SUM of per-token losses over non-ignored tokens (log-sum-exp in fp32 with max
 * subtraction); *n_valid gets their count. If dX != NULL: dX[M,D] = grad_scale * dLoss_sum/dX
 * (overwritten). workspace: at least bt_linear_ce_workspace_floats(chunk_rows, V) floats. */
size_t bt_linear_ce_workspace_floats(int chunk_rows, int V);
double bt_linear_ce(float *dX, int *n_valid, const float *X, const float *W, const int32_t *targets,
                    int M, int D, int V, int chunk_rows, float grad_scale, float *workspace);
/* Same, and when dW != NULL also dW[V,D] += grad_scale * dLoss_sum/dW (the lm_head gradient, for a
 * trainable lm_head or an embedding tied to it; chunks accumulate in order). dX, dW may be NULL. */
double bt_linear_ce_dw(float *dX, float *dW, int *n_valid, const float *X, const float *W,
                       const int32_t *targets, int M, int D, int V, int chunk_rows,
                       float grad_scale, float *workspace);

/* Per-token log-probs of the labels, fused and chunked the same way (no [M x V] logits), for the
 * preference losses (kernels/cpu/loss.c; TRL 1.16.0's fused LM head `log_probs`).
 * logp [M] (may be NULL) is overwritten with log softmax(X W^T)[m, targets[m]] (fp32, nats; 0 for
 * ignored rows: targets outside [0, V), -100 included). Returns their sum over valid rows (double).
 * Backward, when dX or dW is non-NULL: with upstream dlogp [M] = dL/dlogp (NULL: all 1),
 * dX [M, D] is overwritten with dlogp[m] * dlogp_m/dX_m (0 rows for ignored targets) and
 * dW [V, D] += sum_m dlogp[m] * dlogp_m/dW. Since a row's gradient is linear in dlogp[m], a caller
 * that learns dlogp only after the forward can pass dlogp = NULL, get the unit-upstream dX, and
 * scale its rows afterwards (no second vocab pass); dW needs dlogp up front.
 * X [M, D], W [V, D] fp32, caller owned; workspace >= bt_linear_ce_workspace_floats(chunk_rows,
 * V) floats. */
double bt_linear_logprob(float *logp, float *dX, float *dW, const float *X, const float *W,
                         const int32_t *targets, const float *dlogp, int M, int D, int V,
                         int chunk_rows, float *workspace);
/* Per-sequence sums over the valid tokens of a packed row: for s < n_seq, out[s] = sum of
 * per_token[m] over m in [cu_seqlens[s], cu_seqlens[s+1]) with targets[m] in [0, V) and, when
 * mask != NULL, mask[m] != 0 (double, summed in token order); n_tokens[s] = their count (either
 * output may be NULL). The mask lets one pass serve two sums: ORPO scores every token for its NLL
 * and sums the response tokens only for its odds ratio. cu_seqlens [n_seq + 1] int32, starting at
 * 0, non-decreasing (flash-attention's layout); mask [cu_seqlens[n_seq]] uint8. Returns 0, or -1
 * (nothing written) when cu_seqlens is NULL, does not start at 0 or decreases, or n_seq < 0. */
int bt_seq_sum(double *out, int *n_tokens, const float *per_token, const int32_t *targets,
               const uint8_t *mask, const int32_t *cu_seqlens, int n_seq, int V);

/* ---- optimiser (torch.optim.AdamW, decoupled weight decay, bias-corrected; step is 1-based) ---- */
void bt_adamw_step(float *p, const float *g, float *m, float *v, int64_t n, float lr, float beta1,
                   float beta2, float eps, float weight_decay, int64_t step);
/* sum of squares (double accumulation) */
double bt_sumsq(const float *x, int64_t n);
void bt_scale(float *x, int64_t n, float s);

/* ---- process set-up (kernels/cpu/blas_env.c) ----
 * OpenBLAS 0.3.21 mis-detects recent x86 CPUs and then runs ~8x slower; the kernel family can
 * only be forced through OPENBLAS_CORETYPE before the library loads. */
/* "SkylakeX" on AVX-512 CPUs, "Haswell" on AVX2+FMA, NULL otherwise (leave OpenBLAS's choice). */
const char *bt_openblas_coretype_for_cpu(void);
/* Call first thing in main(): if OPENBLAS_CORETYPE is unset and the CPU has a better kernel
 * family, set it; if OMP_WAIT_POLICY is unset, set it to "passive" (OpenMP threads sleep at
 * barriers instead of spinning: blas_env.c says why); if either was set, re-exec
 * /proc/self/exe with the same argv (returns only when nothing needs doing, or when the exec
 * fails, with a warning). A value the user set is kept. BT_NO_BLAS_REEXEC=1 disables it. */
void bt_openblas_env_reexec(char **argv);

#endif
