/* RMSNorm forward and backward of the CUDA backend, with 16-byte (8 x bf16) accesses, and the
 * per-head RMSNorm of q and k (QK-norm), one warp per head. Contracts:
 * kernels/cuda/kernels_cuda.h; the fp32 reference is kernels/cpu/norm.c. */
#include "kernels/cuda/cuda_internal.h"

#include <cmath>

#define RMS_THREADS 256
/* CH = 16-byte chunks per thread (D <= CH * 8 * RMS_THREADS). The row stays in registers between
 * the reduction and the write: x is read once from memory. */
template <int CH>
__global__ void __launch_bounds__(RMS_THREADS) rmsnorm_fwd_kernel(bt_bf16 *y, float *rstd,
                                                                  const bt_bf16 *x, const float *w,
                                                                  int D, float eps)
{
    __shared__ float sbuf[32];
    const int64_t row = blockIdx.x;
    const uint4 *xr = reinterpret_cast<const uint4 *>(x + row * D);
    const int nchunk = D / 8;
    uint4 raw[CH];
    float ss = 0.0f;
#pragma unroll
    for (int c = 0; c < CH; c++) {
        const int ci = c * RMS_THREADS + threadIdx.x;
        if (ci < nchunk) {
            raw[c] = xr[ci];
            float f[8];
            bt_unpack8(raw[c], f);
#pragma unroll
            for (int j = 0; j < 8; j++)
                ss += f[j] * f[j];
        }
    }
    ss = bt_block_sum(ss, sbuf);
    const float r = 1.0f / sqrtf(ss / (float)D + eps);
    if (threadIdx.x == 0)
        rstd[row] = r;
    uint4 *yr = reinterpret_cast<uint4 *>(y + row * D);
#pragma unroll
    for (int c = 0; c < CH; c++) {
        const int ci = c * RMS_THREADS + threadIdx.x;
        if (ci < nchunk) {
            float f[8];
            bt_unpack8(raw[c], f);
            const float4 w0 = reinterpret_cast<const float4 *>(w)[2 * ci];
            const float4 w1 = reinterpret_cast<const float4 *>(w)[2 * ci + 1];
            const float wv[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
            for (int j = 0; j < 8; j++)
                f[j] = wv[j] * (f[j] * r);
            yr[ci] = bt_pack8(f);
        }
    }
}

/* Block b owns rows [b*rpb, min(M,(b+1)*rpb)); dw partial sums of its rows go to
 * scratch[b][D] (when dw is wanted), reduced in block order by rmsnorm_dw_reduce_kernel. */
template <int CH>
__global__ void __launch_bounds__(RMS_THREADS) rmsnorm_bwd_kernel(bt_bf16 *dx, float *partial,
                                                                  const bt_bf16 *dy, const bt_bf16 *x,
                                                                  const float *w, const float *rstd,
                                                                  int M, int D, int rpb)
{
    __shared__ float sbuf[32];
    const int nchunk = D / 8;
    float acc[CH][8];
#pragma unroll
    for (int c = 0; c < CH; c++)
#pragma unroll
        for (int j = 0; j < 8; j++)
            acc[c][j] = 0.0f;
    const int m0 = blockIdx.x * rpb, m1 = min(M, m0 + rpb);
    for (int m = m0; m < m1; m++) {
        const uint4 *xr = reinterpret_cast<const uint4 *>(x + (int64_t)m * D);
        const uint4 *dyr = reinterpret_cast<const uint4 *>(dy + (int64_t)m * D);
        const float r = rstd[m];
        uint4 rx[CH], rdy[CH];
        float dot = 0.0f;
#pragma unroll
        for (int c = 0; c < CH; c++) {
            const int ci = c * RMS_THREADS + threadIdx.x;
            if (ci < nchunk) {
                rx[c] = xr[ci];
                rdy[c] = dyr[ci];
                float fx[8], fdy[8];
                bt_unpack8(rx[c], fx);
                bt_unpack8(rdy[c], fdy);
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    const float xh = fx[j] * r;
                    dot += fdy[j] * w[ci * 8 + j] * xh;
                    if (partial)
                        acc[c][j] += fdy[j] * xh;
                }
            }
        }
        dot = bt_block_sum(dot, sbuf);
        const float cm = dot / (float)D;
        uint4 *dxr = reinterpret_cast<uint4 *>(dx + (int64_t)m * D);
#pragma unroll
        for (int c = 0; c < CH; c++) {
            const int ci = c * RMS_THREADS + threadIdx.x;
            if (ci < nchunk) {
                float fx[8], fdy[8], o[8];
                bt_unpack8(rx[c], fx);
                bt_unpack8(rdy[c], fdy);
#pragma unroll
                for (int j = 0; j < 8; j++)
                    o[j] = r * (fdy[j] * w[ci * 8 + j] - (fx[j] * r) * cm);
                dxr[ci] = bt_pack8(o); /* dx may alias dy: this row's dy is already in registers */
            }
        }
    }
    if (partial) {
#pragma unroll
        for (int c = 0; c < CH; c++) {
            const int ci = c * RMS_THREADS + threadIdx.x;
            if (ci < nchunk)
#pragma unroll
                for (int j = 0; j < 8; j++)
                    partial[(int64_t)blockIdx.x * D + ci * 8 + j] = acc[c][j];
        }
    }
}
__global__ void rmsnorm_dw_reduce_kernel(float *dw, const float *partial, int nb, int D)
{
    const int d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= D)
        return;
    float s = 0.0f;
    for (int b = 0; b < nb; b++)
        s += partial[(int64_t)b * D + d];
    dw[d] += s;
}

#define RMS_BWD_MAX_BLOCKS BT_CUDA_RMS_BWD_MAX_BLOCKS /* kernels/cuda/sizes.h */
static int rms_ch(int D)
{
    const int nchunk = D / 8;
    for (int ch = 1; ch <= 8; ch *= 2)
        if (nchunk <= ch * RMS_THREADS)
            return ch;
    return 0;
}
static bool rms_aligned(const void *p) { return ((uintptr_t)p & 15) == 0; }

extern "C" int bt_cuda_rmsnorm_fwd(bt_bf16 *y, float *rstd, const bt_bf16 *x, const float *w, int M,
                                   int D, float eps, cudaStream_t stream)
{
    BT_CU_REFUSE(BT_ERR_INVALID, !y || !rstd || !x || !w || M < 0 || D <= 0);
    const int ch = rms_ch(D);
    BT_CU_REFUSE(BT_ERR_UNSUPPORTED, D % 8 != 0 || ch == 0 || !rms_aligned(x) || !rms_aligned(y) ||
                                     !rms_aligned(w));
    if (M == 0)
        return BT_OK;
    switch (ch) {
    case 1: rmsnorm_fwd_kernel<1><<<M, RMS_THREADS, 0, stream>>>(y, rstd, x, w, D, eps); break;
    case 2: rmsnorm_fwd_kernel<2><<<M, RMS_THREADS, 0, stream>>>(y, rstd, x, w, D, eps); break;
    case 4: rmsnorm_fwd_kernel<4><<<M, RMS_THREADS, 0, stream>>>(y, rstd, x, w, D, eps); break;
    default: rmsnorm_fwd_kernel<8><<<M, RMS_THREADS, 0, stream>>>(y, rstd, x, w, D, eps); break;
    }
    BT_LAUNCH_CHECK();
    return BT_OK;
}

extern "C" int bt_cuda_rmsnorm_bwd(bt_bf16 *dx, float *dw, const bt_bf16 *dy, const bt_bf16 *x,
                                   const float *w, const float *rstd, int M, int D, float *scratch,
                                   cudaStream_t stream)
{
    BT_CU_REFUSE(BT_ERR_INVALID, !dx || !dy || !x || !w || !rstd || M < 0 || D <= 0 || (dw &&
                                 !scratch));
    const int ch = rms_ch(D);
    BT_CU_REFUSE(BT_ERR_UNSUPPORTED, D % 8 != 0 || ch == 0 || !rms_aligned(x) || !rms_aligned(dy) ||
                                     !rms_aligned(dx));
    if (M == 0)
        return BT_OK;
    /* with dw: at most RMS_BWD_MAX_BLOCKS blocks (fixed row ranges -> deterministic partials);
     * without: one block per row, as the forward */
    const int nb = !dw ? M : (M < RMS_BWD_MAX_BLOCKS ? M : RMS_BWD_MAX_BLOCKS);
    const int rpb = (M + nb - 1) / nb;
    const int nbu = (M + rpb - 1) / rpb; /* blocks actually owning rows */
    float *part = dw ? scratch : nullptr;
    switch (ch) {
    case 1: rmsnorm_bwd_kernel<1><<<nbu, RMS_THREADS, 0, stream>>>(dx, part, dy, x, w, rstd, M, D, rpb); break;
    case 2: rmsnorm_bwd_kernel<2><<<nbu, RMS_THREADS, 0, stream>>>(dx, part, dy, x, w, rstd, M, D, rpb); break;
    case 4: rmsnorm_bwd_kernel<4><<<nbu, RMS_THREADS, 0, stream>>>(dx, part, dy, x, w, rstd, M, D, rpb); break;
    default: rmsnorm_bwd_kernel<8><<<nbu, RMS_THREADS, 0, stream>>>(dx, part, dy, x, w, rstd, M, D, rpb); break;
    }
    BT_LAUNCH_CHECK();
    if (dw) {
        rmsnorm_dw_reduce_kernel<<<(D + 255) / 256, 256, 0, stream>>>(dw, scratch, nbu, D);
        BT_LAUNCH_CHECK();
    }
    return BT_OK;
}

/* ------------------------------------------------- per-head RMSNorm (QK-norm: Qwen3, Gemma 3) */

/* One warp per row of D (= head_dim) values, each lane holds D/32 of them (D % 32 == 0,
 * D <= 32 * HN_MAX). Same fp32 operations as rmsnorm_fwd_kernel / rmsnorm_bwd_kernel. */
#define HN_WARPS 8
#define HN_MAX 16
__global__ void __launch_bounds__(HN_WARPS * 32) head_rmsnorm_fwd_kernel(
    bt_bf16 *y, float *rstd, const bt_bf16 *x, const float *w, int64_t rows, int D, float eps)
{
    const int64_t row = (int64_t)blockIdx.x * HN_WARPS + threadIdx.x / 32;
    const int lane = threadIdx.x & 31, per = D / 32;
    if (row >= rows)
        return;
    const bt_bf16 *xr = x + row * D;
    float f[HN_MAX];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < HN_MAX; j++)
        if (j < per) {
            f[j] = __bfloat162float(xr[j * 32 + lane]);
            ss += f[j] * f[j];
        }
    ss = bt_warp_sum(ss);
    const float r = 1.0f / sqrtf(ss / (float)D + eps);
    if (lane == 0)
        rstd[row] = r;
    bt_bf16 *yr = y + row * D;
#pragma unroll
    for (int j = 0; j < HN_MAX; j++)
        if (j < per)
            yr[j * 32 + lane] = __float2bfloat16_rn(w[j * 32 + lane] * (f[j] * r));
}
__global__ void __launch_bounds__(HN_WARPS * 32) head_rmsnorm_bwd_kernel(
    bt_bf16 *dx, const bt_bf16 *dy, const bt_bf16 *x, const float *w, const float *rstd,
    int64_t rows, int D)
{
    const int64_t row = (int64_t)blockIdx.x * HN_WARPS + threadIdx.x / 32;
    const int lane = threadIdx.x & 31, per = D / 32;
    if (row >= rows)
        return;
    const bt_bf16 *xr = x + row * D, *dyr = dy + row * D;
    const float r = rstd[row];
    float fx[HN_MAX], fg[HN_MAX];
    float dot = 0.0f;
#pragma unroll
    for (int j = 0; j < HN_MAX; j++)
        if (j < per) {
            fx[j] = __bfloat162float(xr[j * 32 + lane]) * r; /* xh */
            fg[j] = __bfloat162float(dyr[j * 32 + lane]) * w[j * 32 + lane];
            dot += fg[j] * fx[j];
        }
    const float cm = bt_warp_sum(dot) / (float)D;
    bt_bf16 *dxr = dx + row * D; /* may alias dy: this lane read its dy values above */
#pragma unroll
    for (int j = 0; j < HN_MAX; j++)
        if (j < per)
            dxr[j * 32 + lane] = __float2bfloat16_rn(r * (fg[j] - fx[j] * cm));
}

extern "C" int bt_cuda_head_rmsnorm_fwd(bt_bf16 *y, float *rstd, const bt_bf16 *x, const float *w,
                                        int64_t rows, int D, float eps, cudaStream_t stream)
{
    BT_CU_REFUSE(BT_ERR_INVALID, !y || !rstd || !x || !w || rows < 0 || D <= 0);
    BT_CU_REFUSE(BT_ERR_UNSUPPORTED, D % 32 != 0 || D > 32 * HN_MAX);
    BT_CU_REFUSE(BT_ERR_UNSUPPORTED, (rows + HN_WARPS - 1) / HN_WARPS > 0x7fffffffLL);
    if (rows == 0)
        return BT_OK;
    head_rmsnorm_fwd_kernel<<<(unsigned)((rows + HN_WARPS - 1) / HN_WARPS), HN_WARPS * 32, 0,
                              stream>>>(y, rstd, x, w, rows, D, eps);
    BT_LAUNCH_CHECK();
    return BT_OK;
}

extern "C" int bt_cuda_head_rmsnorm_bwd(bt_bf16 *dx, const bt_bf16 *dy, const bt_bf16 *x,
                                        const float *w, const float *rstd, int64_t rows, int D,
                                        cudaStream_t stream)
{
    BT_CU_REFUSE(BT_ERR_INVALID, !dx || !dy || !x || !w || !rstd || rows < 0 || D <= 0);
    BT_CU_REFUSE(BT_ERR_UNSUPPORTED, D % 32 != 0 || D > 32 * HN_MAX);
    BT_CU_REFUSE(BT_ERR_UNSUPPORTED, (rows + HN_WARPS - 1) / HN_WARPS > 0x7fffffffLL);
    if (rows == 0)
        return BT_OK;
    head_rmsnorm_bwd_kernel<<<(unsigned)((rows + HN_WARPS - 1) / HN_WARPS), HN_WARPS * 32, 0,
                              stream>>>(dx, dy, x, w, rstd, rows, D);
    BT_LAUNCH_CHECK();
    return BT_OK;
}
