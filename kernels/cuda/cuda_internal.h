/* Private helpers shared by kernels/cuda/ .cu files (C++/CUDA only; not part of the public API). */
#ifndef BT_KERNELS_CUDA_INTERNAL_H
#define BT_KERNELS_CUDA_INTERNAL_H
#ifndef __CUDACC__
#error "kernels/cuda/cuda_internal.h is for .cu files"
#endif
#include "kernels/cuda/kernels_cuda.h"
extern "C" {
#include "common/bt_common.h"
}

/* Errors follow the project's one convention (common/bt_common.h): a launcher returns BT_OK or a
 * negative bt_err and leaves the reason in bt_last_error(); it prints nothing. */

/* A CUDA error (with where it came from): BT_ERR_IO, "cuda: <file>:<line>: <call>: <text>". */
static inline int bt_cuda_check_(cudaError_t e, const char *what, const char *file, int line)
{
    if (e == cudaSuccess)
        return BT_OK;
    return bt_fail(BT_ERR_IO, "cuda: %s:%d: %s: %s", file, line, what, cudaGetErrorString(e));
}
static inline int bt_cublas_check_(cublasStatus_t s, const char *what, const char *file, int line)
{
    if (s == CUBLAS_STATUS_SUCCESS)
        return BT_OK;
    return bt_fail(BT_ERR_IO, "cuda: %s:%d: %s: cuBLAS status %d (%s)", file, line, what, (int)s,
                   cublasGetStatusString(s));
}
/* A launcher refuses its arguments before it enqueues anything: `code` (BT_ERR_INVALID: bad
 * shapes, strides, NULL pointers; BT_ERR_UNSUPPORTED: shapes or alignments the kernel does not
 * implement), "cuda: <launcher>: invalid arguments|not supported: <the check that failed>". */
static inline int bt_cu_refuse(int code, const char *who, const char *check)
{
    return bt_fail(code, "cuda: %s: %s: %s", who,
                   code == BT_ERR_UNSUPPORTED ? "not supported" : "invalid arguments", check);
}
/* if (cond) return the refusal, naming the enclosing function (who: a launcher's name, for the
 * shared checks of a family, e.g. attention_common.h). */
#define BT_CU_REFUSE_AS(who, code, cond)                 \
    do {                                                 \
        if (cond)                                        \
            return bt_cu_refuse((code), (who), #cond);   \
    } while (0)
#define BT_CU_REFUSE(code, cond) BT_CU_REFUSE_AS(__func__, code, cond)
#define BT_CUDA_CHECK(call) bt_cuda_check_((call), #call, __FILE__, __LINE__)
#define BT_CUBLAS_CHECK(call) bt_cublas_check_((call), #call, __FILE__, __LINE__)
/* After a <<<>>> launch: returns BT_ERR_IO from the enclosing function on a launch error. */
#define BT_LAUNCH_CHECK()                                                                   \
    do {                                                                                    \
        int rc_ = bt_cuda_check_(cudaGetLastError(), "kernel launch", __FILE__, __LINE__); \
        if (rc_)                                                                            \
            return rc_;                                                                     \
    } while (0)
#define BT_TRY(x)          \
    do {                   \
        int rc_ = (x);     \
        if (rc_)           \
            return rc_;    \
    } while (0)

static inline int bt_ceil_div(int64_t a, int64_t b) { return (int)((a + b - 1) / b); }

/* Blocks of `threads` for a grid-stride loop over n elements: ceil(n / threads), at least 1, at
 * most cap (the loops stride over the rest). */
static inline unsigned bt_grid_for(int64_t n, int threads, int64_t cap = 65535LL * 16)
{
    int64_t b = (n + threads - 1) / threads;
    if (b < 1)
        b = 1;
    return (unsigned)(b < cap ? b : cap);
}

/* 8 bf16 <-> 8 floats through one 16-byte access */
__device__ __forceinline__ void bt_unpack8(const uint4 &r, float f[8])
{
    const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&r);
#pragma unroll
    for (int j = 0; j < 4; j++) {
        float2 t = __bfloat1622float2(h[j]);
        f[2 * j] = t.x;
        f[2 * j + 1] = t.y;
    }
}
__device__ __forceinline__ uint4 bt_pack8(const float f[8])
{
    uint4 r;
    __nv_bfloat162 *h = reinterpret_cast<__nv_bfloat162 *>(&r);
#pragma unroll
    for (int j = 0; j < 4; j++)
        h[j] = __floats2bfloat162_rn(f[2 * j], f[2 * j + 1]);
    return r;
}

/* The cuBLAS half of the "dequantise then GEMM" linears (NF4, nf4.cu; ggml blocks, ggml.cu), once
 * wbuf holds the bf16 weight [N, K]: forward Y[M,N] = X[M,K] @ wbuf^T + beta*Y, or (bwd) the input
 * gradient dX[M,K] = dY[M,N] @ wbuf + beta*dX (in = X or dY, out = Y or dX). */
static inline int bt_cuda_dq_gemm(cublasHandle_t h, cudaStream_t stream, bool bwd, bt_bf16 *out,
                                  const bt_bf16 *in, int M, int K, int N, float beta,
                                  const bt_bf16 *wbuf)
{
    return bwd ? bt_cuda_gemm(h, stream, 0, 0, M, K, N, 1.0f, in, N, wbuf, K, beta, out, K, 0)
               : bt_cuda_gemm(h, stream, 0, 1, M, N, K, 1.0f, in, K, wbuf, K, beta, out, N, 0);
}

/* ---- warp / block reductions (fp32) ---- */
__device__ __forceinline__ float bt_warp_sum(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
/* Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets the result.
 * sbuf: __shared__ float[32]. Contains __syncthreads: call from all threads. */
__device__ __forceinline__ float bt_block_sum(float v, float *sbuf)
{
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = bt_warp_sum(v);
    __syncthreads(); /* sbuf may be in use by a previous call */
    if (lane == 0)
        sbuf[wid] = v;
    __syncthreads();
    v = lane < nw ? sbuf[lane] : 0.0f;
    return bt_warp_sum(v);
}

/* HF RoPE angle for pair i of head dim D at position pos (fp32 like HF: inv_freq =
 * 1/theta^(2i/D), p = pos*pos_scale, angle = p*inv_freq), cos/sin by accurate sincosf. */
__device__ __forceinline__ void bt_rope_cs(int pos, int i, int D, float theta, float pos_scale,
                                           float *c, float *s)
{
    const float inv_freq = 1.0f / powf(theta, (float)(2 * i) / (float)D);
    const float ang = ((float)pos * pos_scale) * inv_freq;
    sincosf(ang, s, c);
}

#endif
