/* Fused linear + cross-entropy by row chunks (Liger Kernel FusedLinearCrossEntropy,
 * src/liger_kernel/ops/fused_linear_cross_entropy.py; docs/algorithms.md §Cross-entropy):
 * cuBLAS writes one chunk of fp32 logits, one CTA per row does the softmax / loss / gradient in
 * fp32 and writes bf16 dlogits, then cuBLAS forms dX (and optionally dW in fp32). Reference:
 * kernels/cpu/loss.c (bt_linear_ce). Contracts: kernels/cuda/kernels_cuda.h. */
#include "kernels/cuda/cuda_internal.h"

#define CE_THREADS 512

/* merge two (max, sum-of-exp relative to max) pairs */
__device__ __forceinline__ void lse_merge(float &m, float &s, float m2, float s2)
{
    if (m2 == -INFINITY)
        return;
    if (m == -INFINITY) {
        m = m2;
        s = s2;
        return;
    }
    if (m2 > m) {
        s = s * expf(m - m2) + s2;
        m = m2;
    } else {
        s = s + s2 * expf(m2 - m);
    }
}

/* One CTA per row of the chunk: logits row (fp32, V) -> row loss, dlogits row (bf16, V).
 * out_sign 1: row_out = loss = lse - logit[target] (cross-entropy); -1: row_out = logit[target] -
 * lse, the label log-prob (bt_cuda_linear_logprob). row_scale (NULL: 1) multiplies grad_scale per
 * row: the per-token upstream weights of a preference loss. */
__global__ void __launch_bounds__(CE_THREADS) ce_row_kernel(float *row_loss, bt_bf16 *dlogits,
                                                            const float *logits,
                                                            const int32_t *targets, int V,
                                                            float grad_scale, float out_sign,
                                                            const float *row_scale)
{
    __shared__ float sm[32], ss[32];
    const int64_t r = blockIdx.x;
    const float *x = logits + r * V;
    const int32_t t = targets[r];
    const bool valid = t >= 0 && t < V;
    bt_bf16 *dl = dlogits ? dlogits + r * V : nullptr;
    if (!valid) {
        if (threadIdx.x == 0)
            row_loss[r] = 0.0f;
        if (dl)
            for (int j = threadIdx.x; j < V; j += blockDim.x)
                dl[j] = __float2bfloat16_rn(0.0f);
        return;
    }
    /* pass 1: online max / sum of exp per thread, then warp and block merges (fp32) */
    float m = -INFINITY, s = 0.0f;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        const float v = x[j];
        if (v > m) {
            s = (m == -INFINITY ? 0.0f : s * expf(m - v)) + 1.0f;
            m = v;
        } else {
            s += expf(v - m);
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
        lse_merge(m, s, m2, s2);
    }
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0) {
        sm[wid] = m;
        ss[wid] = s;
    }
    __syncthreads();
    m = -INFINITY;
    s = 0.0f;
    for (int w = 0; w < nw; w++) /* every thread merges the warp results in the same order */
        lse_merge(m, s, sm[w], ss[w]);
    const float lse = m + logf(s);
    if (threadIdx.x == 0)
        row_loss[r] = out_sign * (lse - x[t]);
    if (!dl)
        return;
    /* pass 2: dlogits = grad_scale * (softmax - onehot) */
    if (row_scale)
        grad_scale *= row_scale[r];
    const float c = grad_scale / s;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        float d = expf(x[j] - m) * c;
        if (j == t)
            d -= grad_scale;
        dl[j] = __float2bfloat16_rn(d);
    }
}

extern "C" int bt_cuda_linear_ce(cublasHandle_t h, cudaStream_t stream, float *row_loss, bt_bf16 *dX,
                                 float *dW, const bt_bf16 *X, const bt_bf16 *W,
                                 const int32_t *targets, int M, int D, int V, int chunk_rows,
                                 float grad_scale, void *workspace)
{
    BT_CU_REFUSE(BT_ERR_INVALID, !row_loss || !X || !W || !targets || !workspace || M < 0 || D <= 0 ||
                                 V <= 0 || chunk_rows <= 0);
    float *logits = static_cast<float *>(workspace);
    const size_t n = (size_t)chunk_rows * (size_t)V;
    bt_bf16 *dlog = reinterpret_cast<bt_bf16 *>(static_cast<unsigned char *>(workspace) +
                                                ((n * sizeof(float) + 255) / 256) * 256);
    const bool grad = dX || dW;
    for (int r0 = 0; r0 < M; r0 += chunk_rows) {
        const int cr = M - r0 < chunk_rows ? M - r0 : chunk_rows;
        const bt_bf16 *Xc = X + (int64_t)r0 * D;
        /* logits[cr,V] (fp32) = X_c[cr,D] @ W[V,D]^T */
        BT_TRY(bt_cuda_gemm(h, stream, 0, 1, cr, V, D, 1.0f, Xc, D, W, D, 0.0f, logits, V, 1));
        ce_row_kernel<<<cr, CE_THREADS, 0, stream>>>(row_loss + r0, grad ? dlog : nullptr, logits,
                                                     targets + r0, V, grad_scale, 1.0f, nullptr);
        BT_LAUNCH_CHECK();
        if (dX) /* dX_c[cr,D] = dlogits[cr,V] @ W[V,D] */
            BT_TRY(bt_cuda_gemm(h, stream, 0, 0, cr, D, V, 1.0f, dlog, V, W, D, 0.0f,
                                dX + (int64_t)r0 * D, D, 0));
        if (dW) /* dW[V,D] += dlogits^T @ X_c (fp32 accumulation across chunks) */
            BT_TRY(bt_cuda_gemm(h, stream, 1, 0, V, D, cr, 1.0f, dlog, V, Xc, D, 1.0f, dW, D, 1));
    }
    return BT_OK;
}

/* The label log-probs by the same chunked pass (preference training: TRL's get_batch_logps
 * without the [tokens x vocab] logits): ce_row_kernel with out_sign -1 and the gradient of
 * sum_r w_r * logp_r, i.e. dlogits = -w_r * (softmax - onehot). */
extern "C" int bt_cuda_linear_logprob(cublasHandle_t h, cudaStream_t stream, float *logp, bt_bf16 *dX,
                                      float *dW, const bt_bf16 *X, const bt_bf16 *W,
                                      const int32_t *targets, const float *row_w, int M, int D,
                                      int V, int chunk_rows, void *workspace)
{
    BT_CU_REFUSE(BT_ERR_INVALID, !logp || !X || !W || !targets || !workspace || M < 0 || D <= 0 ||
                                 V <= 0 || chunk_rows <= 0 || (dW && !dX));
    float *logits = static_cast<float *>(workspace);
    const size_t n = (size_t)chunk_rows * (size_t)V;
    bt_bf16 *dlog = reinterpret_cast<bt_bf16 *>(static_cast<unsigned char *>(workspace) +
                                                ((n * sizeof(float) + 255) / 256) * 256);
    for (int r0 = 0; r0 < M; r0 += chunk_rows) {
        const int cr = M - r0 < chunk_rows ? M - r0 : chunk_rows;
        const bt_bf16 *Xc = X + (int64_t)r0 * D;
        BT_TRY(bt_cuda_gemm(h, stream, 0, 1, cr, V, D, 1.0f, Xc, D, W, D, 0.0f, logits, V, 1));
        ce_row_kernel<<<cr, CE_THREADS, 0, stream>>>(logp + r0, dX ? dlog : nullptr, logits,
                                                     targets + r0, V, -1.0f, -1.0f,
                                                     row_w ? row_w + r0 : nullptr);
        BT_LAUNCH_CHECK();
        if (dX)
            BT_TRY(bt_cuda_gemm(h, stream, 0, 0, cr, D, V, 1.0f, dlog, V, W, D, 0.0f,
                                dX + (int64_t)r0 * D, D, 0));
        if (dW)
            BT_TRY(bt_cuda_gemm(h, stream, 1, 0, V, D, cr, 1.0f, dlog, V, Xc, D, 1.0f, dW, D, 1));
    }
    return BT_OK;
}

/* x[m, :] *= w[m] (bf16 rows, fp32 product) */
__global__ void scale_rows_kernel(bt_bf16 *x, const float *w, int64_t n, int D)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        x[i] = __float2bfloat16_rn(__bfloat162float(x[i]) * w[i / D]);
}

extern "C" int bt_cuda_scale_rows_bf16(bt_bf16 *x, const float *w, int M, int D, cudaStream_t stream)
{
    BT_CU_REFUSE(BT_ERR_INVALID, M < 0 || D <= 0 || (M > 0 && (!x || !w)));
    if (M == 0)
        return BT_OK;
    const int64_t n = (int64_t)M * D;
    int64_t blocks = (n + 255) / 256;
    if (blocks > 65535LL * 8)
        blocks = 65535LL * 8;
    scale_rows_kernel<<<(unsigned)blocks, 256, 0, stream>>>(x, w, n, D);
    BT_LAUNCH_CHECK();
    return BT_OK;
}

__global__ void ce_reduce_kernel(double *out_sum, int *out_count, const float *row_loss,
                                 const int32_t *targets, int M, int V)
{
    __shared__ double sd[256];
    __shared__ int sc[256];
    double s = 0.0;
    int c = 0;
    for (int i = threadIdx.x; i < M; i += blockDim.x)
        if (targets[i] >= 0 && targets[i] < V) {
            s += (double)row_loss[i];
            c++;
        }
    sd[threadIdx.x] = s;
    sc[threadIdx.x] = c;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if ((int)threadIdx.x < o) {
            sd[threadIdx.x] += sd[threadIdx.x + o];
            sc[threadIdx.x] += sc[threadIdx.x + o];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        out_sum[0] = sd[0];
        out_count[0] = sc[0];
    }
}

extern "C" int bt_cuda_ce_reduce(double *out_sum, int *out_count, const float *row_loss,
                                 const int32_t *targets, int M, int V, cudaStream_t stream)
{
    BT_CU_REFUSE(BT_ERR_INVALID, !out_sum || !out_count || M < 0 || (M > 0 && (!row_loss || !targets)));
    ce_reduce_kernel<<<1, 256, 0, stream>>>(out_sum, out_count, row_loss, targets, M, V);
    BT_LAUNCH_CHECK();
    return BT_OK;
}
