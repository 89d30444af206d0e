/* SwiGLU and GeGLU (tanh GELU) forward and backward of the CUDA backend, 16-byte (8 x bf16)
 * accesses where the layout allows. Contracts: kernels/cuda/kernels_cuda.h; the fp32 reference is
 * kernels/cpu/swiglu.c. */
#include "kernels/cuda/cuda_internal.h"

#include <cmath>

/* The gated linear units share one pair of kernels; ACT picks the activation a(g) = g * sig(g):
 * GLU_SILU (SwiGLU: sig = sigmoid(g)) or GLU_GELU_TANH (GeGLU with the tanh GELU, Gemma 3). */
enum { GLU_SILU = 0, GLU_GELU_TANH = 1 };

__device__ __forceinline__ float silu_sig(float g) { return 1.0f / (1.0f + expf(-g)); }

/* gelu_tanh(g) = g * s, s = sigmoid(2 z), z = c (g + a g^3): kernels/cpu/swiglu.c gelu_sig */
#define GELU_C 0.7978845608028654f /* sqrt(2 / pi) */
#define GELU_A 0.044715f
__device__ __forceinline__ float gelu_sig(float g)
{
    const float z = GELU_C * (g + GELU_A * g * g * g);
    return 1.0f / (1.0f + expf(-2.0f * z));
}
__device__ __forceinline__ void geglu_grad(float g, float u, float d, float *dg, float *du)
{
    const float s = gelu_sig(g);
    const float dgelu = s + 2.0f * g * s * (1.0f - s) * GELU_C * (1.0f + 3.0f * GELU_A * g * g);
    *dg = d * u * dgelu;
    *du = d * (g * s);
}
__device__ __forceinline__ void swiglu_grad(float g, float u, float d, float *dg, float *du)
{
    const float s = silu_sig(g);
    *dg = d * u * (s * (1.0f + g * (1.0f - s)));
    *du = d * (g * s);
}
template <int ACT> __device__ __forceinline__ float glu_sig(float g)
{
    return ACT == GLU_SILU ? silu_sig(g) : gelu_sig(g);
}
template <int ACT> __device__ __forceinline__ void glu_grad(float g, float u, float d, float *dg, float *du)
{
    if (ACT == GLU_SILU)
        swiglu_grad(g, u, d, dg, du);
    else
        geglu_grad(g, u, d, dg, du);
}

template <int ACT>
__global__ void glu_fwd_kernel(bt_bf16 *h, const bt_bf16 *g, const bt_bf16 *u, int64_t n, int vec)
{
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    if (vec) { /* n % 8 == 0 and all pointers 16-byte aligned */
        const int64_t nv = n / 8;
        for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < nv; t += stride) {
            float fg[8], fu[8], fh[8];
            bt_unpack8(reinterpret_cast<const uint4 *>(g)[t], fg);
            bt_unpack8(reinterpret_cast<const uint4 *>(u)[t], fu);
#pragma unroll
            for (int j = 0; j < 8; j++)
                fh[j] = fg[j] * glu_sig<ACT>(fg[j]) * fu[j];
            reinterpret_cast<uint4 *>(h)[t] = bt_pack8(fh);
        }
        return;
    }
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float gv = __bfloat162float(g[i]);
        h[i] = __float2bfloat16_rn(gv * glu_sig<ACT>(gv) * __bfloat162float(u[i]));
    }
}
template <int ACT>
__global__ void glu_bwd_kernel(bt_bf16 *dg, bt_bf16 *du, const bt_bf16 *dh, const bt_bf16 *g,
                               const bt_bf16 *u, int64_t n, int vec)
{
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    if (vec) {
        const int64_t nv = n / 8;
        for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < nv; t += stride) {
            float fg[8], fu[8], fd[8], og[8], ou[8];
            bt_unpack8(reinterpret_cast<const uint4 *>(g)[t], fg);
            bt_unpack8(reinterpret_cast<const uint4 *>(u)[t], fu);
            bt_unpack8(reinterpret_cast<const uint4 *>(dh)[t], fd);
#pragma unroll
            for (int j = 0; j < 8; j++)
                glu_grad<ACT>(fg[j], fu[j], fd[j], &og[j], &ou[j]);
            reinterpret_cast<uint4 *>(dg)[t] = bt_pack8(og);
            reinterpret_cast<uint4 *>(du)[t] = bt_pack8(ou);
        }
        return;
    }
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float og, ou;
        glu_grad<ACT>(__bfloat162float(g[i]), __bfloat162float(u[i]), __bfloat162float(dh[i]), &og, &ou);
        dg[i] = __float2bfloat16_rn(og);
        du[i] = __float2bfloat16_rn(ou);
    }
}
static int vec8_ok(int64_t n, const void *a, const void *b, const void *c, const void *d = nullptr,
                   const void *e = nullptr)
{
    uintptr_t o = (uintptr_t)a | (uintptr_t)b | (uintptr_t)c | (uintptr_t)d | (uintptr_t)e;
    return n % 8 == 0 && (o & 15) == 0;
}
template <int ACT>
static int glu_fwd(const char *who, bt_bf16 *h, const bt_bf16 *g, const bt_bf16 *u, int64_t n, cudaStream_t stream)
{
    BT_CU_REFUSE_AS(who, BT_ERR_INVALID, n < 0 || (n > 0 && (!h || !g || !u)));
    if (n == 0)
        return BT_OK;
    const int vec = vec8_ok(n, h, g, u);
    glu_fwd_kernel<ACT><<<bt_grid_for(vec ? n / 8 : n, 256), 256, 0, stream>>>(h, g, u, n, vec);
    BT_LAUNCH_CHECK();
    return BT_OK;
}
template <int ACT>
static int glu_bwd(const char *who, bt_bf16 *dg, bt_bf16 *du, const bt_bf16 *dh, const bt_bf16 *g,
                   const bt_bf16 *u, int64_t n, cudaStream_t stream)
{
    BT_CU_REFUSE_AS(who, BT_ERR_INVALID, n < 0 || (n > 0 && (!dg || !du || !dh || !g || !u)));
    if (n == 0)
        return BT_OK;
    const int vec = vec8_ok(n, dg, du, dh, g, u);
    glu_bwd_kernel<ACT><<<bt_grid_for(vec ? n / 8 : n, 256), 256, 0, stream>>>(dg, du, dh, g, u, n, vec);
    BT_LAUNCH_CHECK();
    return BT_OK;
}

extern "C" int bt_cuda_swiglu_fwd(bt_bf16 *h, const bt_bf16 *g, const bt_bf16 *u, int64_t n,
                                  cudaStream_t stream)
{
    return glu_fwd<GLU_SILU>(__func__, h, g, u, n, stream);
}
extern "C" int bt_cuda_swiglu_bwd(bt_bf16 *dg, bt_bf16 *du, const bt_bf16 *dh, const bt_bf16 *g,
                                  const bt_bf16 *u, int64_t n, cudaStream_t stream)
{
    return glu_bwd<GLU_SILU>(__func__, dg, du, dh, g, u, n, stream);
}
extern "C" int bt_cuda_geglu_fwd(bt_bf16 *h, const bt_bf16 *g, const bt_bf16 *u, int64_t n,
                                 cudaStream_t stream)
{
    return glu_fwd<GLU_GELU_TANH>(__func__, h, g, u, n, stream);
}
extern "C" int bt_cuda_geglu_bwd(bt_bf16 *dg, bt_bf16 *du, const bt_bf16 *dh, const bt_bf16 *g,
                                 const bt_bf16 *u, int64_t n, cudaStream_t stream)
{
    return glu_bwd<GLU_GELU_TANH>(__func__, dg, du, dh, g, u, n, stream);
}
