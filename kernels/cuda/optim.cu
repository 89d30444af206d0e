/* The optimiser's kernels of the CUDA backend: the deterministic sum of squares of the gradient
 * norm, and multi-tensor AdamW (the clipping scale folded in as grad_scale). Contracts:
 * kernels/cuda/kernels_cuda.h; the fp32 reference is kernels/cpu/optim.c (bt_sumsq, bt_scale,
 * bt_adamw_step). */
#include "kernels/cuda/cuda_internal.h"

#include <cmath>

/* ---- deterministic sum of squares ---- */
#define SUMSQ_CHUNK BT_CUDA_SUMSQ_CHUNK /* kernels/cuda/sizes.h */
static_assert(sizeof(bt_cuda_adamw_tensor) == BT_CUDA_ADAMW_DESC_BYTES, "kernels/cuda/sizes.h");
__device__ double block_sum_double(double v, double *sbuf)
{ /* fixed-order tree over blockDim.x (power of two) values */
    sbuf[threadIdx.x] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s)
            sbuf[threadIdx.x] += sbuf[threadIdx.x + s];
        __syncthreads();
    }
    return sbuf[0];
}
__global__ void sumsq_partial_kernel(double *partial, const float *x, int64_t n)
{
    __shared__ double sbuf[256];
    const int64_t i0 = (int64_t)blockIdx.x * SUMSQ_CHUNK;
    const int64_t i1 = i0 + SUMSQ_CHUNK < n ? i0 + SUMSQ_CHUNK : n;
    double s = 0.0;
    for (int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x)
        s += (double)x[i] * (double)x[i];
    s = block_sum_double(s, sbuf);
    if (threadIdx.x == 0)
        partial[blockIdx.x] = s;
}
__global__ void sumsq_final_kernel(double *out, const double *partial, int np, int accumulate)
{
    __shared__ double sbuf[256];
    double s = 0.0;
    for (int i = threadIdx.x; i < np; i += blockDim.x)
        s += partial[i];
    s = block_sum_double(s, sbuf);
    if (threadIdx.x == 0)
        out[0] = accumulate ? out[0] + s : s;
}
extern "C" int bt_cuda_sumsq(double *out, const float *x, int64_t n, double *partial, int accumulate,
                             cudaStream_t stream)
{
    BT_CU_REFUSE(BT_ERR_INVALID, !out || n < 0 || (n > 0 && (!x || !partial)));
    const int64_t np = n > 0 ? (n + SUMSQ_CHUNK - 1) / SUMSQ_CHUNK : 0;
    BT_CU_REFUSE(BT_ERR_UNSUPPORTED, np > 0x7fffffff);
    if (np > 0) {
        sumsq_partial_kernel<<<(unsigned)np, 256, 0, stream>>>(partial, x, n);
        BT_LAUNCH_CHECK();
    }
    sumsq_final_kernel<<<1, 256, 0, stream>>>(out, partial, (int)np, accumulate);
    BT_LAUNCH_CHECK();
    return BT_OK;
}

/* --------------------------------------------------------------------------------- AdamW */

struct adamw_scalars {
    float lr, beta1, beta2, eps, grad_scale, step_size, bc2_sqrt, w1, omb2;
};

/* blockIdx.y = tensor; blocks of x stride over its elements. Per-element operations in the order
 * and with the roundings of kernels/cpu/optim.c (explicit _rn intrinsics: no FMA contraction), so
 * results match the CPU reference to the last bit for grad_scale == 1. */
__global__ void adamw_multi_kernel(const bt_cuda_adamw_tensor *tensors, adamw_scalars s)
{
    const bt_cuda_adamw_tensor t = tensors[blockIdx.y];
    const float decay = (float)(1.0 - (double)s.lr * (double)t.weight_decay);
    const float neg_step = -s.step_size;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < t.n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const float gi = s.grad_scale == 1.0f ? t.g[i] : __fmul_rn(t.g[i], s.grad_scale);
        const float mi0 = t.m[i];
        const float pi = __fmul_rn(t.p[i], decay);
        const float d = __fsub_rn(gi, mi0);
        const float mi = s.w1 < 0.5f ? __fadd_rn(mi0, __fmul_rn(s.w1, d))
                                     : __fsub_rn(gi, __fmul_rn(d, __fsub_rn(1.0f, s.w1)));
        const float vi = __fadd_rn(__fmul_rn(t.v[i], s.beta2), __fmul_rn(__fmul_rn(s.omb2, gi), gi));
        t.m[i] = mi;
        t.v[i] = vi;
        const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), s.bc2_sqrt), s.eps);
        const float pn = __fadd_rn(pi, __fdiv_rn(__fmul_rn(neg_step, mi), denom));
        t.p[i] = pn;
        if (t.p16)
            t.p16[i] = __float2bfloat16_rn(pn);
    }
}

extern "C" int bt_cuda_adamw_multi(const bt_cuda_adamw_tensor *tensors, int n_tensors, int64_t max_n,
                                   float lr, float beta1, float beta2, float eps, float grad_scale,
                                   int64_t step, cudaStream_t stream)
{
    BT_CU_REFUSE(BT_ERR_INVALID, !tensors || n_tensors < 0 || n_tensors > 65535 || max_n < 0);
    if (n_tensors == 0 || max_n == 0)
        return BT_OK;
    if (step < 1)
        step = 1;
    adamw_scalars s;
    const double bc1 = 1.0 - pow((double)beta1, (double)step);
    const double bc2 = 1.0 - pow((double)beta2, (double)step);
    s.lr = lr;
    s.beta1 = beta1;
    s.beta2 = beta2;
    s.eps = eps;
    s.grad_scale = grad_scale;
    s.step_size = (float)((double)lr / bc1);
    s.bc2_sqrt = (float)sqrt(bc2);
    s.w1 = (float)(1.0 - (double)beta1);
    s.omb2 = (float)(1.0 - (double)beta2);
    const int threads = 256;
    int64_t bx = (max_n + threads * 4 - 1) / (threads * 4); /* ~4 elements per thread */
    if (bx > 4096)
        bx = 4096;
    adamw_multi_kernel<<<dim3((unsigned)bx, (unsigned)n_tensors), threads, 0, stream>>>(tensors, s);
    BT_LAUNCH_CHECK();
    return BT_OK;
}
