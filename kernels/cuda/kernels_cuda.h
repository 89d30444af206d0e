/* BarqTrain CUDA backend: public launcher API (C linkage; implemented in kernels/cuda/ .cu files,
 * which mirror kernels/cpu/ file for file: norm, rope, swiglu, embedding, optim, linear, nf4, ggml,
 * attention, loss; plus convert.cu for the bf16 conversions the fp32 CPU backend does not need).
 *
 * Conventions (every launcher below unless its comment says otherwise):
 *   - All pointers are DEVICE pointers, except where a parameter is named *_host.
 *   - Tensors are row-major and contiguous; M = number of tokens (B*T flattened); weights follow
 *     torch.nn.Linear, W[out, in]. Activations are bf16 (__nv_bfloat16); accumulation is fp32;
 *     LoRA master weights, gradients of trainable parameters and optimiser state are fp32
 *     (docs/ARCHITECTURE.md §Numerics). The CPU fp32 backend (kernels/kernels.h) is the
 *     reference; tests/gpu/ checks each launcher against it.
 *   - Stream semantics: every launcher only ENQUEUES work on `stream` (asynchronous with respect to
 *     the host; ordered with respect to other work on that stream). None synchronises, allocates
 *     device memory or copies to/from the host, except the _upload and _free helpers, which are
 *     synchronous. cuBLAS-using launchers bind the given handle to `stream` (cublasSetStream) and
 *     use the handle's default workspace; one handle must not be used concurrently from two host
 *     threads.
 *   - Return value: 0 (BT_OK) when the work was enqueued; BT_ERR_INVALID (-6) for bad arguments
 *     (nothing is enqueued); BT_ERR_UNSUPPORTED (-5) for shapes the kernel does not implement;
 *     BT_ERR_IO (-1) if a CUDA launch or cuBLAS call reported an error. On every error the reason
 *     is in bt_last_error() (common/bt_common.h; "cuda: <launcher>: invalid arguments: <the check
 *     that failed>", "cuda: <file>:<line>: <call>: <CUDA or cuBLAS error text>"); nothing is
 *     printed. Errors that occur asynchronously inside a kernel show up at the next synchronising
 *     call, as usual in CUDA.
 *   - Sizes are int (per-dimension) and int64_t for flattened element counts.
 */
#ifndef BT_KERNELS_CUDA_H
#define BT_KERNELS_CUDA_H
#include <stddef.h>
#include <stdint.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cublas_v2.h>

#include "kernels/cuda/sizes.h" /* bt_cuda_sumsq_scratch, bt_cuda_rmsnorm_bwd_scratch_floats,
                                 * bt_cuda_linear_ce_workspace_bytes */

#ifdef __cplusplus
extern "C" {
#endif

typedef __nv_bfloat16 bt_bf16;

/* ================= utilities: device count, fp32 -> bf16, residual add (convert.cu); the
 * gradient norm's sum of squares (optim.cu) */

/* Device count (>= 1), or BT_ERR_IO when there is no usable device or no driver, the reason in
 * bt_last_error() (e.g. "cudaGetDeviceCount: no CUDA-capable device is detected"); never aborts.
 * Synchronous. */
int bt_cuda_device_count(void);

/* out[i] = bf16(in[i]) (round to nearest even), n elements. */
int bt_cuda_f32_to_bf16(bt_bf16 *out, const float *in, int64_t n, cudaStream_t stream);
/* y[i] = bf16(float(a[i]) + float(b[i])) (residual add); y may alias a or b. */
int bt_cuda_add_bf16(bt_bf16 *y, const bt_bf16 *a, const bt_bf16 *b, int64_t n, cudaStream_t stream);
/* x[i] = bf16(x[i] * s) in place, n elements (convert.cu): Gemma's embedding scale sqrt(d_model)
 * (Gemma3TextScaledWordEmbedding; kernels/cpu/optim.c bt_scale on the CPU), forward and, on a
 * trainable embedding's gradient, backward. */
int bt_cuda_scale_bf16(bt_bf16 *x, int64_t n, float s, cudaStream_t stream);

/* Deterministic sum of squares over n fp32 values: out[0] (device double) = sum x[i]^2,
 * accumulated in double. Two passes (fixed 1024-block partials, then one block adds them in
 * order), no atomics, so the result is bit-identical run to run (llm.c global_norm.cuh idea).
 * partial: device scratch of >= bt_cuda_sumsq_scratch(n) doubles (kernels/cuda/sizes.h). If
 * accumulate != 0, adds to out[0]. */
int bt_cuda_sumsq(double *out, const float *x, int64_t n, double *partial, int accumulate,
                  cudaStream_t stream);

/* ======================================================= GEMM and LoRA (linear.cu, cuBLAS) */

/* Row-major GEMM, C[M,N] = alpha * op(A) @ op(B) + beta * C, with the same argument convention as
 * bt_sgemm in kernels/kernels.h (A is [M,K] or, transposed, [K,M]; B is [K,N] or [N,K]; lda/ldb/ldc
 * are row strides in elements). A and B are bf16; C is bf16 (c_f32 == 0) or fp32 (c_f32 != 0);
 * compute is fp32 (CUBLAS_COMPUTE_32F). Implemented with cublasGemmEx by the usual row-major =
 * transposed column-major identity (C^T = op(B)^T op(A)^T). beta = 1 accumulates into C: that is
 * how the LoRA path adds onto the base output without an extra pass. */
int bt_cuda_gemm(cublasHandle_t h, cudaStream_t stream, int transA, int transB, int M, int N, int K,
                 float alpha, const bt_bf16 *A, int lda, const bt_bf16 *B, int ldb, float beta,
                 void *C, int ldc, int c_f32);

/* LoRA adapter on a linear layer (Hu et al. 2021, arXiv 2106.09685; PEFT LoraLayer):
 *   Y[M,N] += s * (X[M,K] @ A[r,K]^T) @ B[N,r]^T,  s = lora_alpha / r.
 * Forward, run after the base GEMM wrote Y (bt_cuda_gemm or bt_cuda_nf4_linear_fwd):
 *   XA[M,r] = X @ A^T (bf16, saved for backward), then Y += s * XA @ B^T with cuBLAS beta = 1 (the
 *   accumulate happens in the GEMM epilogue; Y is not re-read by a separate kernel).
 * A16 [r,K], B16 [N,r]: bf16 copies of the fp32 master weights (refresh them after each optimiser
 * step with bt_cuda_f32_to_bf16, or let bt_cuda_adamw_multi write them). */
int bt_cuda_lora_fwd(cublasHandle_t h, cudaStream_t stream, bt_bf16 *Y, bt_bf16 *XA, const bt_bf16 *X,
                     const bt_bf16 *A16, const bt_bf16 *B16, int M, int K, int N, int r, float s);
/* LoRA backward for a frozen base (the base contributes only to dX):
 *   dB[N,r]  (fp32) = beta_w*dB + s * dY^T @ XA
 *   dXA[M,r] (bf16 scratch) = s * dY @ B
 *   dA[r,K]  (fp32) = beta_w*dA + dXA^T @ X
 *   dX[M,K]  (bf16) += dXA @ A        (cuBLAS beta = 1; the caller computed dX = dY @ W first, e.g.
 *                                      with bt_cuda_nf4_linear_bwd_x; dX may be NULL to skip)
 * beta_w = 1 accumulates weight gradients across micro-batches (gradient accumulation). */
int bt_cuda_lora_bwd(cublasHandle_t h, cudaStream_t stream, float *dA, float *dB, bt_bf16 *dX,
                     bt_bf16 *dXA, const bt_bf16 *dY, const bt_bf16 *X, const bt_bf16 *XA,
                     const bt_bf16 *A16, const bt_bf16 *B16, int M, int K, int N, int r, float s,
                     float beta_w);

/* ================================================================== NF4 (nf4.cu) */

/* An NF4 double-quantised weight resident on the device: the same layout as bt_nf4
 * (kernels/kernels.h; bitsandbytes quantize_4bit nf4, blocksize 64, compress_statistics=True,
 * docs/formats/nf4.md). code8 is the 256-entry signed dynamic map the absmax
 * codes index (create_dynamic_map(signed=True), or the checkpoint's nested_quant_map). */
typedef struct {
    int64_t n, rows, cols;         /* elements, logical [rows=out, cols=in] */
    const uint8_t *packed;         /* [n/2]; byte j: element 2j high nibble, 2j+1 low nibble */
    const uint8_t *absmax_q;       /* [n/64] */
    const float *nested_absmax;    /* [ceil(n/64/256)] */
    const float *code8;            /* [256] */
    float offset;
} bt_cuda_nf4;

/* Copy a host NF4 weight to freshly cudaMalloc'ed device buffers (one allocation; synchronous).
 * code8_host [256] is the dynamic map (e.g. filled with bt_dynamic_code8(i)). The host-side fields
 * are passed individually so this library does not depend on the CPU backend. Returns 0, or
 * BT_ERR_INVALID / BT_ERR_NOMEM. Free with bt_cuda_nf4_free. */
int bt_cuda_nf4_upload(bt_cuda_nf4 *dst, int64_t rows, int64_t cols, const uint8_t *packed_host,
                       const uint8_t *absmax_q_host, const float *nested_absmax_host, float offset,
                       const float *code8_host);
void bt_cuda_nf4_free(bt_cuda_nf4 *w);

/* Dequantise rows [r0, r0+nr) of W into out[nr, cols] bf16. In one kernel per 16 elements:
 * absmax[b] = code8[absmax_q[b]] * nested_absmax[b/256] + offset (fp32, two roundings, as
 * bitsandbytes dequantize_blockwise + offset), x = NF4[nibble] * absmax (fp32) -> bf16
 * (bitsandbytes kDequantizeBlockwise). (r0*cols) must be a multiple of 64 (true whenever cols is). */
int bt_cuda_nf4_dequant(bt_bf16 *out, const bt_cuda_nf4 *w, int64_t r0, int64_t nr, cudaStream_t stream);

/* Y[M,N] = X[M,K] @ deq(W)[N,K]^T + beta*Y (bf16 in/out, fp32 accumulate); W rows == N, cols == K.
 * Algorithm (Unsloth fast_dequantize + matmul; bnb MatMul4Bit classic path): dequantise the whole
 * weight into wbuf (bf16, >= N*K elements, 16-byte aligned as cudaMalloc returns; a reusable buffer
 * shared by all layers), then one cuBLAS GEMM (Y's old contents are read only when beta != 0). The fused alternative that dequantises tiles in the GEMM main loop (no wbuf) is
 * bt_cuda_nf4_gemm_fwd below. */
int bt_cuda_nf4_linear_fwd(cublasHandle_t h, cudaStream_t stream, bt_bf16 *Y, const bt_bf16 *X,
                           const bt_cuda_nf4 *W, int M, int K, int N, float beta, bt_bf16 *wbuf);
/* dX[M,K] = dY[M,N] @ deq(W)[N,K] + beta*dX (input gradient only: the base is frozen). Same
 * wbuf convention; if wbuf_valid != 0 the caller guarantees wbuf already holds deq(W) (e.g. from
 * the forward of the same layer under recomputation) and the dequantisation is skipped. */
int bt_cuda_nf4_linear_bwd_x(cublasHandle_t h, cudaStream_t stream, bt_bf16 *dX, const bt_bf16 *dY,
                             const bt_cuda_nf4 *W, int M, int K, int N, float beta, bt_bf16 *wbuf,
                             int wbuf_valid);

/* Fused NF4 GEMMs (nf4_gemm.cu): the weight is decoded inside the GEMM main loop, so no bf16 copy
 * of it (no wbuf) exists. The decoded values are bit-identical to bt_cuda_nf4_dequant (same fp32
 * operations: absmax = code8[q]*nested + offset with two roundings, NF4[nibble]*absmax -> bf16),
 * so results match bt_cuda_nf4_linear_fwd/_bwd_x up to fp32 summation order and the final bf16
 * rounding. Algorithm: tiled tensor-core GEMM (nvcuda::wmma 16x16x16 bf16, fp32 accumulate; CTA
 * tile 128x128, reduction step 64 = one NF4 block per weight row, 8 warps of 64x32, two smem
 * stages, 82,048 bytes of dynamic shared memory) with the weight tile dequantised in registers
 * (bitsandbytes kDequantizeBlockwise<NF4> arithmetic; bnb gemm_4bit idea, research §1.6) and
 * stored to shared memory as bf16; activation tiles by 16-byte loads. Epilogue: fp32 acc ->
 * (beta != 0 ? acc + beta*float(old) : acc) -> bf16 (old output read only when beta != 0).
 *
 * Y[M,N] = X[M,K] @ deq(W)[N,K]^T + beta*Y. W: host pointer to a device descriptor (its fields are
 * device pointers; they are copied into the kernel arguments, the descriptor itself may be freed
 * or reused as soon as the call returns). M >= 1 tokens, any N >= 1. For M <= 16 a CUDA-core
 * small-M kernel is used instead (decode/inference: the packed weight is read once, 8 warps x 4
 * output columns per CTA, X staged in 512-column chunks, fp32 FMA, warp-shuffle reduction).
 * Requirements (else BT_ERR_UNSUPPORTED): K % 64 == 0; X, Y and W->packed 16-byte aligned;
 * ceil(M/128) <= 65535. N % 8 != 0 is supported (element-wise epilogue). Errors: BT_ERR_INVALID
 * for NULL pointers (Y, X, W or its buffers), M/K/N < 1, W->rows != N or W->cols != K; BT_ERR_IO
 * if the launch fails. X and Y must not overlap. */
int bt_cuda_nf4_gemm_fwd(cudaStream_t stream, bt_bf16 *Y, const bt_bf16 *X, const bt_cuda_nf4 *W,
                         int M, int K, int N, float beta);
/* dX[M,K] = dY[M,N] @ deq(W)[N,K] + beta*dX: the input gradient of a frozen NF4 base (the reduction
 * runs over N, the weight's rows; each step decodes 64 weight rows x 128 weight columns = two NF4
 * blocks per row). Always the tiled kernel. Same requirements and errors as bt_cuda_nf4_gemm_fwd
 * (K % 64 == 0; dY, dX, W->packed 16-byte aligned; any M, N >= 1, N % 8 != 0 uses element loads
 * of dY). dX and dY must not overlap. */
int bt_cuda_nf4_gemm_bwd_x(cudaStream_t stream, bt_bf16 *dX, const bt_bf16 *dY,
                           const bt_cuda_nf4 *W, int M, int K, int N, float beta);
/* bt_cuda_nf4_gemm_fwd with the kernel chosen explicitly (tests and benchmarks): impl 0 = automatic
 * (as bt_cuda_nf4_gemm_fwd), 1 = always the tiled tensor-core kernel, 2 = the small-M kernel
 * (BT_ERR_UNSUPPORTED when M > 16). Other impl values: BT_ERR_INVALID. */
int bt_cuda_nf4_gemm_fwd_impl(cudaStream_t stream, bt_bf16 *Y, const bt_bf16 *X,
                              const bt_cuda_nf4 *W, int M, int K, int N, float beta, int impl);

/* ================================= GGUF-native base: ggml blocks (ggml.cu, nf4_gemm.cu) */

/* A frozen linear W[rows = out, cols = in] resident on the device in its GGUF file's own ggml
 * blocks (no re-quantisation; kernels/kernels.h bt_ggml_mat is the host side): row r is bytes
 * [r * row_bytes, (r+1) * row_bytes) of `data`, cols / block_elems consecutive blocks
 * (ggml-common.h layouts). Types with a device decoder (ggml.h enum values): Q4_0 = 2, Q4_1 = 3,
 * Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14. Decoded values are bit-identical to
 * common/quant.c bt_ggml_dequantize (gguf-py quants.dequantize) before the bf16 rounding
 * (kernels/cuda/ggml_decode.h). */
typedef struct {
    int type;
    int64_t rows, cols;
    int64_t row_bytes;     /* cols / block_elems * block_bytes */
    const uint8_t *data;   /* device [rows * row_bytes] (one cudaMalloc, 256-byte aligned) */
} bt_cuda_ggml;

/* 1 if `type` has a device decoder (the six types above), else 0. */
int bt_cuda_ggml_supported(int type);
/* Copy a host ggml tensor [rows, cols] (rows * row_bytes bytes, HF row order) to one fresh
 * cudaMalloc (synchronous). Errors: BT_ERR_UNSUPPORTED (type without a device decoder),
 * BT_ERR_INVALID (rows/cols < 1, cols not a multiple of the block, NULL), BT_ERR_NOMEM. Free with
 * bt_cuda_ggml_free. */
int bt_cuda_ggml_upload(bt_cuda_ggml *dst, int type, int64_t rows, int64_t cols,
                        const uint8_t *data_host);
void bt_cuda_ggml_free(bt_cuda_ggml *w);

/* Dequantise rows [r0, r0+nr) of W into out[nr, cols] bf16 (16-byte aligned): one thread per 32
 * elements (a Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 block or a K-quant sub-block), value = bf16_rn(the fp32 value
 * bt_ggml_dequantize gives). Errors: BT_ERR_INVALID (NULL, range), BT_ERR_UNSUPPORTED (type,
 * misaligned out). */
int bt_cuda_ggml_dequant(bt_bf16 *out, const bt_cuda_ggml *w, int64_t r0, int64_t nr,
                         cudaStream_t stream);
/* Y[M,N] = X[M,K] @ deq(W)[N,K]^T + beta*Y and dX[M,K] = dY[M,N] @ deq(W)[N,K] + beta*dX by
 * dequantising into wbuf (>= N*K bf16, 16-byte aligned) then one cuBLAS GEMM, exactly as
 * bt_cuda_nf4_linear_fwd / _bwd_x (wbuf_valid: wbuf already holds deq(W)). Errors as those. */
int bt_cuda_ggml_linear_fwd(cublasHandle_t h, cudaStream_t stream, bt_bf16 *Y, const bt_bf16 *X,
                            const bt_cuda_ggml *W, int M, int K, int N, float beta, bt_bf16 *wbuf);
int bt_cuda_ggml_linear_bwd_x(cublasHandle_t h, cudaStream_t stream, bt_bf16 *dX,
                              const bt_bf16 *dY, const bt_cuda_ggml *W, int M, int K, int N,
                              float beta, bt_bf16 *wbuf, int wbuf_valid);
/* Fused ggml GEMMs: the tiled tensor-core kernel of bt_cuda_nf4_gemm_fwd / _bwd_x (nf4_gemm.cu;
 * same tiles, stages, shared memory and epilogue) with the weight tile decoded by the ggml
 * decoders instead of NF4: each thread loads one 32-element chunk of a weight row per step and
 * writes its 32 bf16 values to shared memory. The decoded values equal bt_cuda_ggml_dequant's,
 * so results match bt_cuda_ggml_linear_fwd / _bwd_x up to fp32 summation order and the final
 * bf16 rounding. Any M >= 1 (always the tiled kernel: there is no small-M variant for ggml),
 * N >= 1. Requirements (else BT_ERR_UNSUPPORTED): a supported type; X/Y (dY/dX) 16-byte aligned;
 * ceil(M/128) <= 65535. Errors: BT_ERR_INVALID for NULL pointers, M/K/N < 1, W->rows != N or
 * W->cols != K; BT_ERR_IO if the launch fails. Input and output must not overlap. */
int bt_cuda_ggml_gemm_fwd(cudaStream_t stream, bt_bf16 *Y, const bt_bf16 *X, const bt_cuda_ggml *W,
                          int M, int K, int N, float beta);
int bt_cuda_ggml_gemm_bwd_x(cudaStream_t stream, bt_bf16 *dX, const bt_bf16 *dY,
                            const bt_cuda_ggml *W, int M, int K, int N, float beta);

/* ====================================================================== RMSNorm (norm.cu) */

/* RMSNorm forward (Zhang & Sennrich 2019; HF LlamaRMSNorm): y = w * (x * rstd),
 * rstd = 1/sqrt(mean(x^2) + eps) in fp32. x, y [M,D] bf16 (y may alias x), w [D] fp32 (the master
 * weight; trainable under LongLoRA "norm"), rstd [M] fp32 saved for backward. One block per row,
 * one read and one write of x (the row stays in registers between the reduction and the write).
 * D <= 16384, D % 8 == 0 and x, y, w 16-byte aligned (else BT_ERR_UNSUPPORTED): 16-byte accesses. */
int bt_cuda_rmsnorm_fwd(bt_bf16 *y, float *rstd, const bt_bf16 *x, const float *w, int M, int D,
                        float eps, cudaStream_t stream);
/* RMSNorm backward: with xh = x*rstd, g = dy*w: dx = rstd * (g - xh * mean(g*xh)) (bf16 [M,D],
 * may alias dy); if dw != NULL, dw[D] (fp32) += sum_m dy*xh, deterministically: per-block partial
 * sums into scratch (>= bt_cuda_rmsnorm_bwd_scratch_floats(M,D) floats, kernels/cuda/sizes.h;
 * fixed row ranges) then one ordered reduction kernel (no atomics; llm.c layernorm_backward idea).
 * scratch may be NULL when dw == NULL. */
int bt_cuda_rmsnorm_bwd(bt_bf16 *dx, float *dw, const bt_bf16 *dy, const bt_bf16 *x, const float *w,
                        const float *rstd, int M, int D, float *scratch, cudaStream_t stream);
/* Per-head RMSNorm (QK-norm: transformers Qwen3Attention / Gemma3Attention q_norm, k_norm, before
 * RoPE; the CPU step runs bt_rmsnorm_fwd / _bwd over M * H rows of head_dim): x, y [rows, D] bf16
 * (rows = tokens * heads, D = head_dim), w [D] fp32 (as stored: Gemma's GGUF holds 1 + w already,
 * the HF loader adds the 1), rstd [rows] fp32 saved for backward; the same fp32 math as
 * bt_cuda_rmsnorm_fwd / _bwd (y = w * (x * rstd); dx = rstd * (g - xh * mean(g * xh)), g = dy * w).
 * The weight is frozen: no dw. One warp per row. dx may alias dy (in place on dq / dk); y must not
 * alias x. D % 32 == 0 and D <= 512 (else BT_ERR_UNSUPPORTED); no alignment needed. */
int bt_cuda_head_rmsnorm_fwd(bt_bf16 *y, float *rstd, const bt_bf16 *x, const float *w,
                             int64_t rows, int D, float eps, cudaStream_t stream);
int bt_cuda_head_rmsnorm_bwd(bt_bf16 *dx, const bt_bf16 *dy, const bt_bf16 *x, const float *w,
                             const float *rstd, int64_t rows, int D, cudaStream_t stream);

/* ========================================================================= RoPE (rope.cu) */

/* RoPE in place, HF rotate_half layout (same math as bt_rope_fwd/bt_rope_bwd): x has M tokens, H
 * heads of D (even) elements, token stride ld elements (ld >= H*D; lets it run on one part of a
 * packed QKV buffer). Position p = position_ids[m] * pos_scale; angle = p * theta^(-2i/D) in fp32,
 * cos/sin by sincosf. inverse != 0 applies the transposed rotation (the backward). */
int bt_cuda_rope(bt_bf16 *x, const int32_t *position_ids, int M, int H, int D, int64_t ld,
                 float theta, float pos_scale, int inverse, cudaStream_t stream);
/* The same with a precomputed inverse-frequency table inv_freq [D/2] fp32 (DEVICE; the model's
 * bt_model.inv_freq: default, Llama 3.1 "llama3" or GGUF rope_freqs, kernels/kernels.h
 * bt_rope_inv_freq): angle = (position_ids[m] * pos_scale) * inv_freq[i], as bt_rope_fwd_freq /
 * bt_rope_bwd_freq on the CPU. BT_ERR_INVALID for NULL inv_freq or the arguments above. */
int bt_cuda_rope_freq(bt_bf16 *x, const int32_t *position_ids, int M, int H, int D, int64_t ld,
                      const float *inv_freq, float pos_scale, int inverse, cudaStream_t stream);

/* ===================================================================== SwiGLU (swiglu.cu) */

/* SwiGLU (Shazeer 2020; HF LlamaMLP): h = silu(g) * u, fp32 math, bf16 in/out, n elements.
 * Backward, s = sigmoid(g): dg = dh*u*s*(1 + g*(1-s)), du = dh*g*s; each element's inputs are read
 * before its outputs are written, so dg/du may alias g/u/dh (Unsloth swiglu_DWf_DW_dfg in place). */
int bt_cuda_swiglu_fwd(bt_bf16 *h, const bt_bf16 *g, const bt_bf16 *u, int64_t n, cudaStream_t stream);
int bt_cuda_swiglu_bwd(bt_bf16 *dg, bt_bf16 *du, const bt_bf16 *dh, const bt_bf16 *g,
                       const bt_bf16 *u, int64_t n, cudaStream_t stream);
/* GeGLU with the tanh GELU (Gemma 3's MLP, hidden_activation "gelu_pytorch_tanh";
 * kernels/cpu/swiglu.c bt_geglu_fwd / _bwd): h = gelu_tanh(g) * u, gelu_tanh(g) = g * s,
 * s = sigmoid(2 z), z = sqrt(2/pi) (g + 0.044715 g^3). Backward: dg = dh * u * (s + 2 g s (1 - s)
 * sqrt(2/pi) (1 + 3 * 0.044715 g^2)), du = dh * g * s. fp32 math, bf16 in/out, aliasing as
 * SwiGLU's. */
int bt_cuda_geglu_fwd(bt_bf16 *h, const bt_bf16 *g, const bt_bf16 *u, int64_t n, cudaStream_t stream);
int bt_cuda_geglu_bwd(bt_bf16 *dg, bt_bf16 *du, const bt_bf16 *dh, const bt_bf16 *g,
                      const bt_bf16 *u, int64_t n, cudaStream_t stream);

/* ================================================================ embedding (embedding.cu) */

/* Embedding: out[m,:] = table[ids[m],:] (bf16 table [V,D], bf16 out [M,D]); ids outside [0,V)
 * give a zero row (the data pipeline validates ids; the kernel never reads out of bounds). */
int bt_cuda_embedding_fwd(bt_bf16 *out, const bt_bf16 *table, const int32_t *ids, int M, int D, int V,
                          cudaStream_t stream);
/* Embedding backward for a trainable table (LongLoRA "embed"): dtable[ids[m],:] += dout[m,:]
 * (fp32 [V,D], atomicAdd: the summation order of repeated ids is not deterministic). */
int bt_cuda_embedding_bwd(float *dtable, const bt_bf16 *dout, const int32_t *ids, int M, int D, int V,
                          cudaStream_t stream);

/* ====================================================================== AdamW (optim.cu) */

/* One tensor of a multi-tensor AdamW step (all device pointers, fp32, n elements). p16 (optional,
 * may be NULL) receives bf16(p) after the update: the bf16 compute copy of a LoRA weight. */
typedef struct {
    float *p;
    const float *g;
    float *m, *v;
    bt_bf16 *p16;
    int64_t n;
    float weight_decay;
} bt_cuda_adamw_tensor;

/* AdamW over all trainable tensors in ONE launch (torch.optim.AdamW semantics as bt_adamw_step:
 * decoupled decay, bias correction, same per-element operation order; Loshchilov & Hutter 2019).
 * tensors: DEVICE array of n_tensors descriptors (n_tensors <= 65535; build it once, reuse it every
 * step); max_n: the largest n among them (host value; sizes the grid). grad_scale multiplies g
 * before use (1/accumulated-token-count or the clipping factor; 1 for none). step is 1-based. */
int bt_cuda_adamw_multi(const bt_cuda_adamw_tensor *tensors, int n_tensors, int64_t max_n, float lr,
                        float beta1, float beta2, float eps, float grad_scale, int64_t step,
                        cudaStream_t stream);

/* ==================================================================== attention (attention.cu) */

/* Parameters of the fused causal varlen GQA attention. */
typedef struct {
    int M;            /* tokens */
    int Hq, Hkv, D;   /* heads; Hq % Hkv == 0; D = 64, 128 or 256 (256: the wmma launchers
                       * only, Gemma 3's head_dim; needs 227 KB of shared memory per block, sm_90) */
    int n_seq;        /* documents; cu_seqlens has n_seq+1 entries (device) */
    int max_seqlen;   /* host value: >= the longest document (sizes the grid) */
    const int32_t *cu_seqlens; /* [n_seq+1], cu[0] = 0, nondecreasing, cu[n_seq] <= M */
    int64_t ldq, ldk, ldv;     /* token strides (elements) of q, k, v (and of dq, dk, dv) */
    float scale;      /* softmax scale, 1/sqrt(D) for Llama */
    /* RoPE applied as Q and K tiles are loaded (NULL position_ids = none): HF rotate_half,
     * p = position_ids[m] * pos_scale, angle = p * theta^(-2i/D) (same as bt_cuda_rope). */
    const int32_t *position_ids;
    float rope_theta, pos_scale;
    /* Optional RoPE inverse-frequency table, DEVICE [D/2] fp32 (the model's bt_model.inv_freq:
     * default, Llama 3.1 "llama3" or GGUF rope_freqs; kernels/kernels.h bt_rope_inv_freq). When set,
     * angle = (position_ids[m] * pos_scale) * inv_freq[i] and rope_theta is ignored; NULL derives
     * inv_freq[i] = 1/theta^(2i/D) on the device. */
    const float *inv_freq;
    /* LongLoRA S^2-Attn (arXiv 2309.12307, llama_attn_replace.py forward_flashattn, the varlen
     * no-roll version): s2_group = G > 0 enables it. Positions are local to each document; query
     * heads h < Hq/2 attend within groups [kG, (k+1)G); heads h >= Hq/2 within groups shifted by
     * G/2: [0, G/2), [G/2, 3G/2), ... (half-size groups at both ends, no wrap-around). Causal inside
     * each group. G must be even. 0 = full causal attention. */
    int s2_group;
    /* Sliding window of `window` keys (Mistral / Phi-3 sliding_window, Gemma 3's local layers;
     * transformers' sliding-window causal mask, exactly the CPU bt_attn_fwd_win / bt_attn_bwd_win of
     * kernels/kernels.h): a query at local position i sees key j of its own document (and S^2
     * group) iff i - window < j <= i. 0 = no window; < 0 is BT_ERR_INVALID. Key tiles wholly outside
     * every window of a query tile are skipped (cost per query O(window)), partial ones masked. */
    int window;
} bt_cuda_attn_params;

/* Forward (FlashAttention-2, Dao 2023, arXiv 2307.08691, Algorithm 1): one CTA per (64-query tile,
 * query head, document); K/V streamed in 64-key tiles through shared memory; S = QK^T and O += PV on
 * tensor cores (nvcuda::wmma m16n16k16 bf16, fp32 accumulate); online softmax in fp32 (exp2 with
 * the scale folded in); the T x T score matrix never exists in memory.
 * q [M, Hq, D] (row stride ldq), k, v [M, Hkv, D] (ldk, ldv), bf16, UNROTATED when position_ids is
 * set (RoPE is applied on load). out [M, Hq, D] bf16 contiguous; lse [M, Hq] fp32 (natural-log
 * log-sum-exp of the scaled scores, saved for backward). Rows outside [0, cu[n_seq]) are not written.
 * Requirements: D in {64, 128, 256}; ldq/ldk/ldv multiples of 8 and every pointer 16-byte aligned
 * (else BT_ERR_UNSUPPORTED); grid n_seq*ceil(max_seqlen/64) x Hq. Shared memory per CTA: 72 KB
 * (D=64), 113 KB (D=128), 195,328 B (D=256; its backward 231,552 B for dK/dV with 16-query steps
 * and 157,440 B for dQ with 32-query tiles: sm_90's 227 KB opt-in); the launcher checks the
 * device's per-block opt-in limit on the host (BT_ERR_UNSUPPORTED naming head_dim, the bytes
 * needed and the device's limit when it is smaller) and raises the kernel's limit with
 * cudaFuncSetAttribute. window: bt_cuda_attn_params. */
int bt_cuda_attn_fwd(const bt_cuda_attn_params *p, bt_bf16 *out, float *lse, const bt_bf16 *q,
                     const bt_bf16 *k, const bt_bf16 *v, cudaStream_t stream);

/* Backward (FlashAttention-2 Algorithm 2, split as in FA2's implementation into passes that need
 * no atomics): (1) delta[m,h] = sum_d dout*out (fp32 scratch [M,Hq]); (2) one CTA per (64-key
 * tile, KV head, document) accumulates dK, dV in shared memory over every query head of its GQA
 * group and every query tile that can see it (P recomputed from lse); (3) one CTA per (64-query
 * tile, query head, document) accumulates dQ over key tiles. dq/dk/dv (bf16, strides ldq/ldk/ldv)
 * are overwritten for rows inside documents and are gradients w.r.t. the UNROTATED q/k (the
 * inverse RoPE is applied before the store). delta: device scratch of M*Hq floats. */
int bt_cuda_attn_bwd(const bt_cuda_attn_params *p, bt_bf16 *dq, bt_bf16 *dk, bt_bf16 *dv,
                     const bt_bf16 *dout, const bt_bf16 *out, const float *lse, const bt_bf16 *q,
                     const bt_bf16 *k, const bt_bf16 *v, float *delta, cudaStream_t stream);

/* Second, fast implementation of the same two launchers (attention_mma.cu): identical semantics,
 * arguments, outputs (out, lse natural-log, dq/dk/dv w.r.t. the UNROTATED q/k, delta scratch
 * M*Hq floats), requirements (D in {64,128}: D = 256 is BT_ERR_UNSUPPORTED, its 2 x D/2
 * dK/dV accumulator registers per lane exceed the 255-register cap, use bt_cuda_attn_fwd/bwd;
 * ldq/ldk/ldv multiples of 8; every pointer 16-byte
 * aligned) and return codes as bt_cuda_attn_fwd / bt_cuda_attn_bwd; results agree with them up to
 * fp32 summation order and bf16 rounding of P/dS (tests/gpu/test_attention_gpu.cu checks both
 * against the CPU reference and against each other).
 * Algorithm: FlashAttention-2 (Dao 2023, arXiv 2307.08691, Alg. 1 and 2) with register-resident
 * S/P/dS: mma.sync.m16n8k16 bf16 -> fp32, ldmatrix(.trans) B operands from padded shared tiles
 * (pitch D+8), C fragments repacked in registers as the A operand of the next product, online
 * softmax with exp2 (scale folded) and quad shuffles, cp.async + register-staged double buffering
 * (K/Q tiles are rotated by RoPE between the global load and the shared store). RoPE sin/cos use
 * an exact 2*pi reduction and __sincosf (~1e-6 abs), the wmma kernel uses sincosf.
 * Forward: 1-D grid of Hq * n_seq * ceil(max_seqlen/128) CTAs (heavy causal tiles first), 256
 * threads (8 warps x 16 query rows, 128-query tile), 64-key tiles; dynamic shared memory
 * 104,704 B (D=128) / 55,424 B (D=64).
 * Backward: (1) delta = rowsum(dout*out); (2) dK/dV: one CTA per (128-key tile, KV head,
 * document), 8 warps x 16 keys computing S^T, P^T, dP^T, dS^T in registers, steps of 32 (D=128) / 64
 * (D=64) queries over all query heads of the GQA group, 105,216 B (D=128) / 74,880 B (D=64)
 * smem; (3) dQ: one CTA per (128-query tile, query head, document), 64-key tiles, 139,520 B
 * (D=128) / 73,856 B (D=64). 256 threads each, __launch_bounds__(256, 1), no register spills
 * (ptxas, sm_90a and sm_80).
 * No atomics (deterministic). Kernel smem limits are raised with cudaFuncSetAttribute (host
 * call). Errors as bt_cuda_attn_fwd/bwd, plus BT_ERR_UNSUPPORTED when Hq * n_seq *
 * ceil(max_seqlen/128) exceeds 2^31-1. */
int bt_cuda_attn_fwd_mma(const bt_cuda_attn_params *p, bt_bf16 *out, float *lse, const bt_bf16 *q,
                         const bt_bf16 *k, const bt_bf16 *v, cudaStream_t stream);
int bt_cuda_attn_bwd_mma(const bt_cuda_attn_params *p, bt_bf16 *dq, bt_bf16 *dk, bt_bf16 *dv,
                         const bt_bf16 *dout, const bt_bf16 *out, const float *lse,
                         const bt_bf16 *q, const bt_bf16 *k, const bt_bf16 *v, float *delta,
                         cudaStream_t stream);

/* ============================================================= fused linear + CE (loss.cu) */

/* (bt_cuda_linear_ce_workspace_bytes, the workspace's bytes: kernels/cuda/sizes.h) */
/* Fused linear + cross-entropy by chunks of rows (Liger FusedLinearCrossEntropy; research §3.2):
 * for each chunk of <= chunk_rows rows: logits = X_c @ W^T into an fp32 workspace (cuBLAS, bf16 in,
 * fp32 out), then one CTA per row computes max and sum exp in fp32 (online, then a block reduction),
 * loss = lse - logit[target], and writes dlogits = grad_scale * (softmax - onehot) in bf16; then
 * dX_c = dlogits @ W (cuBLAS) and, if dW != NULL, dW += dlogits^T @ X_c (fp32, beta 1; for a
 * trainable lm_head). Logits never exist for more than chunk_rows rows.
 * X [M,D] bf16, W [V,D] bf16, targets [M] int32 (outside [0,V), e.g. -100: ignored, zero loss and
 * zero gradient row). row_loss [M] fp32 receives each row's loss (0 for ignored rows); sum it with
 * bt_cuda_ce_reduce. dX [M,D] bf16 overwritten (NULL: forward only). */
int bt_cuda_linear_ce(cublasHandle_t h, cudaStream_t stream, float *row_loss, bt_bf16 *dX, float *dW,
                      const bt_bf16 *X, const bt_bf16 *W, const int32_t *targets, int M, int D, int V,
                      int chunk_rows, float grad_scale, void *workspace);
/* The label log-probs of a preference loss by the same chunked pass (TRL's get_batch_logps
 * without a [M x V] logits tensor; CPU reference: kernels.h bt_linear_logprob): logp [M] fp32 =
 * log softmax(X W^T)[target] per row (0 for ignored rows). dX [M,D] bf16 (NULL: forward only) =
 * d(sum_r w_r logp_r)/dX with w_r = row_w[r] (row_w [M] fp32 on the device; NULL: 1, the
 * unit-upstream gradient that a later bt_cuda_scale_rows_bf16 turns into any weights), and dW
 * (fp32 [V,D], needs dX) += d(sum_r w_r logp_r)/dW for a trainable lm_head. Other arguments and
 * the workspace as bt_cuda_linear_ce. */
int bt_cuda_linear_logprob(cublasHandle_t h, cudaStream_t stream, float *logp, bt_bf16 *dX,
                           float *dW, const bt_bf16 *X, const bt_bf16 *W, const int32_t *targets,
                           const float *row_w, int M, int D, int V, int chunk_rows,
                           void *workspace);
/* x[m, :] *= w[m] for m < M (x [M,D] bf16 in place, w [M] fp32, product in fp32). */
int bt_cuda_scale_rows_bf16(bt_bf16 *x, const float *w, int M, int D, cudaStream_t stream);
/* out_sum[0] (double) = sum of row_loss over rows with targets in [0,V), out_count[0] = their count;
 * one block, fixed order (deterministic). */
int bt_cuda_ce_reduce(double *out_sum, int *out_count, const float *row_loss, const int32_t *targets,
                      int M, int V, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif
