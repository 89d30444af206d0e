/* Memory-bound kernels of the CUDA backend: casts, residual add, sum of squares, RMSNorm, RoPE,
 * SwiGLU, embedding, multi-tensor AdamW. Contracts: kernels/cuda/kernels_cuda.h; the fp32
 * references are kernels/cpu/{norm,rope,swiglu,optim}.c. 16-byte (8 x bf16) accesses where the
 * layout allows (Hopper habit: coalesced 16-byte loads, several in flight). */
#include "kernels/cuda/cuda_internal.h"

#include <cmath>

/* ------------------------------------------------------------------------------ utilities */

extern "C" int bt_cuda_device_count(char *reason, size_t reason_len)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        if (reason && reason_len)
            snprintf(reason, reason_len, "cudaGetDeviceCount: %s", cudaGetErrorString(e));
        cudaGetLastError();
        return 0;
    }
    if (n == 0 && reason && reason_len)
        snprintf(reason, reason_len, "cudaGetDeviceCount returned 0 devices");
    return n;
}

static inline unsigned grid_for(int64_t n, int threads, int64_t cap = 65535LL * 16)
{
    int64_t b = (n + threads - 1) / threads;
    if (b < 1)
        b = 1;
    return (unsigned)(b < cap ? b : cap);
}

__global__ void f32_to_bf16_kernel(bt_bf16 *out, const float *in, int64_t n)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        out[i] = __float2bfloat16_rn(in[i]);
}
__global__ void bf16_to_f32_kernel(float *out, const bt_bf16 *in, int64_t n)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        out[i] = __bfloat162float(in[i]);
}
__global__ void add_bf16_kernel(bt_bf16 *y, const bt_bf16 *a, const bt_bf16 *b, int64_t n)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        y[i] = __float2bfloat16_rn(__bfloat162float(a[i]) + __bfloat162float(b[i]));
}
__global__ void scale_f32_kernel(float *x, int64_t n, float s)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        x[i] *= s;
}

extern "C" int bt_cuda_f32_to_bf16(bt_bf16 *out, const float *in, int64_t n, cudaStream_t stream)
{
    if (n < 0 || (n > 0 && (!out || !in)))
        return BT_CU_ERR_INVALID;
    if (n == 0)
        return BT_CU_OK;
    f32_to_bf16_kernel<<<grid_for(n, 256), 256, 0, stream>>>(out, in, n);
    BT_LAUNCH_CHECK();
    return BT_CU_OK;
}
extern "C" int bt_cuda_bf16_to_f32(float *out, const bt_bf16 *in, int64_t n, cudaStream_t stream)
{
    if (n < 0 || (n > 0 && (!out || !in)))
        return BT_CU_ERR_INVALID;
    if (n == 0)
        return BT_CU_OK;
    bf16_to_f32_kernel<<<grid_for(n, 256), 256, 0, stream>>>(out, in, n);
    BT_LAUNCH_CHECK();
    return BT_CU_OK;
}
extern "C" int bt_cuda_add_bf16(bt_bf16 *y, const bt_bf16 *a, const bt_bf16 *b, int64_t n,
                                cudaStream_t stream)
{
    if (n < 0 || (n > 0 && (!y || !a || !b)))
        return BT_CU_ERR_INVALID;
    if (n == 0)
        return BT_CU_OK;
    add_bf16_kernel<<<grid_for(n, 256), 256, 0, stream>>>(y, a, b, n);
    BT_LAUNCH_CHECK();
    return BT_CU_OK;
}
extern "C" int bt_cuda_scale_f32(float *x, int64_t n, float s, cudaStream_t stream)
{
    if (n < 0 || (n > 0 && !x))
        return BT_CU_ERR_INVALID;
    if (n == 0 || s == 1.0f)
        return BT_CU_OK;
    scale_f32_kernel<<<grid_for(n, 256), 256, 0, stream>>>(x, n, s);
    BT_LAUNCH_CHECK();
    return BT_CU_OK;
}

/* ---- deterministic sum of squares ---- */
#define SUMSQ_CHUNK 16384
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
extern "C" size_t bt_cuda_sumsq_scratch(int64_t n)
{
    return n <= 0 ? 1 : (size_t)((n + SUMSQ_CHUNK - 1) / SUMSQ_CHUNK);
}
extern "C" int bt_cuda_sumsq(double *out, const float *x, int64_t n, double *partial, int accumulate,
                             cudaStream_t stream)
{
    if (!out || n < 0 || (n > 0 && (!x || !partial)))
        return BT_CU_ERR_INVALID;
    const int64_t np = n > 0 ? (n + SUMSQ_CHUNK - 1) / SUMSQ_CHUNK : 0;
    if (np > 0x7fffffff)
        return BT_CU_ERR_UNSUPPORTED;
    if (np > 0) {
        sumsq_partial_kernel<<<(unsigned)np, 256, 0, stream>>>(partial, x, n);
        BT_LAUNCH_CHECK();
    }
    sumsq_final_kernel<<<1, 256, 0, stream>>>(out, partial, (int)np, accumulate);
    BT_LAUNCH_CHECK();
    return BT_CU_OK;
}

/* ------------------------------------------------------------------------------- RMSNorm */

/* 8 bf16 <-> 8 floats through one 16-byte access */
__device__ __forceinline__ void unpack8(const uint4 &r, float f[8])
{
    const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&r);
#pragma unroll
    for (int j = 0; j < 4; j++) {
        float2 t = __bfloat1622float2(h[j]);
        f[2 * j] = t.x;
        f[2 * j + 1] = t.y;
    }
}
__device__ __forceinline__ uint4 pack8(const float f[8])
{
    uint4 r;
    __nv_bfloat162 *h = reinterpret_cast<__nv_bfloat162 *>(&r);
#pragma unroll
    for (int j = 0; j < 4; j++)
        h[j] = __floats2bfloat162_rn(f[2 * j], f[2 * j + 1]);
    return r;
}

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
            unpack8(raw[c], f);
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
            unpack8(raw[c], f);
            const float4 w0 = reinterpret_cast<const float4 *>(w)[2 * ci];
            const float4 w1 = reinterpret_cast<const float4 *>(w)[2 * ci + 1];
            const float wv[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
            for (int j = 0; j < 8; j++)
                f[j] = wv[j] * (f[j] * r);
            yr[ci] = pack8(f);
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
                unpack8(rx[c], fx);
                unpack8(rdy[c], fdy);
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
                unpack8(rx[c], fx);
                unpack8(rdy[c], fdy);
#pragma unroll
                for (int j = 0; j < 8; j++)
                    o[j] = r * (fdy[j] * w[ci * 8 + j] - (fx[j] * r) * cm);
                dxr[ci] = pack8(o); /* dx may alias dy: this row's dy is already in registers */
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

#define RMS_BWD_MAX_BLOCKS 512
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
    if (!y || !rstd || !x || !w || M < 0 || D <= 0)
        return BT_CU_ERR_INVALID;
    const int ch = rms_ch(D);
    if (D % 8 != 0 || ch == 0 || !rms_aligned(x) || !rms_aligned(y) || !rms_aligned(w))
        return BT_CU_ERR_UNSUPPORTED;
    if (M == 0)
        return BT_CU_OK;
    switch (ch) {
    case 1: rmsnorm_fwd_kernel<1><<<M, RMS_THREADS, 0, stream>>>(y, rstd, x, w, D, eps); break;
    case 2: rmsnorm_fwd_kernel<2><<<M, RMS_THREADS, 0, stream>>>(y, rstd, x, w, D, eps); break;
    case 4: rmsnorm_fwd_kernel<4><<<M, RMS_THREADS, 0, stream>>>(y, rstd, x, w, D, eps); break;
    default: rmsnorm_fwd_kernel<8><<<M, RMS_THREADS, 0, stream>>>(y, rstd, x, w, D, eps); break;
    }
    BT_LAUNCH_CHECK();
    return BT_CU_OK;
}

extern "C" size_t bt_cuda_rmsnorm_bwd_scratch_floats(int M, int D)
{
    if (M <= 0 || D <= 0)
        return 0;
    return (size_t)(M < RMS_BWD_MAX_BLOCKS ? M : RMS_BWD_MAX_BLOCKS) * (size_t)D;
}

extern "C" int bt_cuda_rmsnorm_bwd(bt_bf16 *dx, float *dw, const bt_bf16 *dy, const bt_bf16 *x,
                                   const float *w, const float *rstd, int M, int D, float *scratch,
                                   cudaStream_t stream)
{
    if (!dx || !dy || !x || !w || !rstd || M < 0 || D <= 0 || (dw && !scratch))
        return BT_CU_ERR_INVALID;
    const int ch = rms_ch(D);
    if (D % 8 != 0 || ch == 0 || !rms_aligned(x) || !rms_aligned(dy) || !rms_aligned(dx))
        return BT_CU_ERR_UNSUPPORTED;
    if (M == 0)
        return BT_CU_OK;
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
    return BT_CU_OK;
}

/* ---------------------------------------------------------------------------------- RoPE */

__global__ void rope_kernel(bt_bf16 *x, const int32_t *pos, int M, int H, int D, int64_t ld,
                            float theta, const float *inv_freq, float pos_scale, float dir)
{
    const int half = D / 2;
    const int64_t total = (int64_t)M * H * half;
    for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < total;
         t += (int64_t)gridDim.x * blockDim.x) {
        const int i = (int)(t % half);
        const int64_t mh = t / half;
        const int h = (int)(mh % H);
        const int64_t m = mh / H;
        float c, s;
        if (inv_freq)
            sincosf(((float)pos[m] * pos_scale) * inv_freq[i], &s, &c);
        else
            bt_rope_cs(pos[m], i, D, theta, pos_scale, &c, &s);
        s *= dir;
        bt_bf16 *xr = x + m * ld + (int64_t)h * D;
        const float x1 = __bfloat162float(xr[i]), x2 = __bfloat162float(xr[i + half]);
        xr[i] = __float2bfloat16_rn(x1 * c - x2 * s);
        xr[i + half] = __float2bfloat16_rn(x2 * c + x1 * s);
    }
}

/* inv_freq == NULL: angles from theta (bt_cuda_rope); else from the table (bt_cuda_rope_freq) */
static int rope_launch(bt_bf16 *x, const int32_t *position_ids, int M, int H, int D, int64_t ld,
                       float theta, const float *inv_freq, float pos_scale, int inverse,
                       cudaStream_t stream)
{
    if (!x || !position_ids || M < 0 || H <= 0 || D < 2 || (D & 1) || ld < (int64_t)H * D)
        return BT_CU_ERR_INVALID;
    if (M == 0)
        return BT_CU_OK;
    const int64_t total = (int64_t)M * H * (D / 2);
    rope_kernel<<<grid_for(total, 256), 256, 0, stream>>>(x, position_ids, M, H, D, ld, theta,
                                                          inv_freq, pos_scale,
                                                          inverse ? -1.0f : 1.0f);
    BT_LAUNCH_CHECK();
    return BT_CU_OK;
}

extern "C" int bt_cuda_rope(bt_bf16 *x, const int32_t *position_ids, int M, int H, int D, int64_t ld,
                            float theta, float pos_scale, int inverse, cudaStream_t stream)
{
    return rope_launch(x, position_ids, M, H, D, ld, theta, nullptr, pos_scale, inverse, stream);
}

extern "C" int bt_cuda_rope_freq(bt_bf16 *x, const int32_t *position_ids, int M, int H, int D,
                                 int64_t ld, const float *inv_freq, float pos_scale, int inverse,
                                 cudaStream_t stream)
{
    if (!inv_freq)
        return BT_CU_ERR_INVALID;
    return rope_launch(x, position_ids, M, H, D, ld, 0.0f, inv_freq, pos_scale, inverse, stream);
}

/* -------------------------------------------------------------------------------- SwiGLU */

__device__ __forceinline__ float silu_sig(float g) { return 1.0f / (1.0f + expf(-g)); }

__global__ void swiglu_fwd_kernel(bt_bf16 *h, const bt_bf16 *g, const bt_bf16 *u, int64_t n, int vec)
{
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    if (vec) { /* n % 8 == 0 and all pointers 16-byte aligned */
        const int64_t nv = n / 8;
        for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < nv; t += stride) {
            float fg[8], fu[8], fh[8];
            unpack8(reinterpret_cast<const uint4 *>(g)[t], fg);
            unpack8(reinterpret_cast<const uint4 *>(u)[t], fu);
#pragma unroll
            for (int j = 0; j < 8; j++)
                fh[j] = fg[j] * silu_sig(fg[j]) * fu[j];
            reinterpret_cast<uint4 *>(h)[t] = pack8(fh);
        }
        return;
    }
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float gv = __bfloat162float(g[i]);
        h[i] = __float2bfloat16_rn(gv * silu_sig(gv) * __bfloat162float(u[i]));
    }
}
__global__ void swiglu_bwd_kernel(bt_bf16 *dg, bt_bf16 *du, const bt_bf16 *dh, const bt_bf16 *g,
                                  const bt_bf16 *u, int64_t n, int vec)
{
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    if (vec) {
        const int64_t nv = n / 8;
        for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < nv; t += stride) {
            float fg[8], fu[8], fd[8], og[8], ou[8];
            unpack8(reinterpret_cast<const uint4 *>(g)[t], fg);
            unpack8(reinterpret_cast<const uint4 *>(u)[t], fu);
            unpack8(reinterpret_cast<const uint4 *>(dh)[t], fd);
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const float s = silu_sig(fg[j]);
                og[j] = fd[j] * fu[j] * (s * (1.0f + fg[j] * (1.0f - s)));
                ou[j] = fd[j] * (fg[j] * s);
            }
            reinterpret_cast<uint4 *>(dg)[t] = pack8(og);
            reinterpret_cast<uint4 *>(du)[t] = pack8(ou);
        }
        return;
    }
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float gv = __bfloat162float(g[i]), uv = __bfloat162float(u[i]),
                    d = __bfloat162float(dh[i]);
        const float s = silu_sig(gv);
        dg[i] = __float2bfloat16_rn(d * uv * (s * (1.0f + gv * (1.0f - s))));
        du[i] = __float2bfloat16_rn(d * (gv * s));
    }
}
static int vec8_ok(int64_t n, const void *a, const void *b, const void *c, const void *d = nullptr,
                   const void *e = nullptr)
{
    uintptr_t o = (uintptr_t)a | (uintptr_t)b | (uintptr_t)c | (uintptr_t)d | (uintptr_t)e;
    return n % 8 == 0 && (o & 15) == 0;
}
extern "C" int bt_cuda_swiglu_fwd(bt_bf16 *h, const bt_bf16 *g, const bt_bf16 *u, int64_t n,
                                  cudaStream_t stream)
{
    if (n < 0 || (n > 0 && (!h || !g || !u)))
        return BT_CU_ERR_INVALID;
    if (n == 0)
        return BT_CU_OK;
    const int vec = vec8_ok(n, h, g, u);
    swiglu_fwd_kernel<<<grid_for(vec ? n / 8 : n, 256), 256, 0, stream>>>(h, g, u, n, vec);
    BT_LAUNCH_CHECK();
    return BT_CU_OK;
}
extern "C" int bt_cuda_swiglu_bwd(bt_bf16 *dg, bt_bf16 *du, const bt_bf16 *dh, const bt_bf16 *g,
                                  const bt_bf16 *u, int64_t n, cudaStream_t stream)
{
    if (n < 0 || (n > 0 && (!dg || !du || !dh || !g || !u)))
        return BT_CU_ERR_INVALID;
    if (n == 0)
        return BT_CU_OK;
    const int vec = vec8_ok(n, dg, du, dh, g, u);
    swiglu_bwd_kernel<<<grid_for(vec ? n / 8 : n, 256), 256, 0, stream>>>(dg, du, dh, g, u, n, vec);
    BT_LAUNCH_CHECK();
    return BT_CU_OK;
}

/* ----------------------------------------------------------------------------- embedding */

__global__ void embedding_fwd_kernel(bt_bf16 *out, const bt_bf16 *table, const int32_t *ids, int M,
                                     int D, int V)
{
    const int64_t total = (int64_t)M * D;
    for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < total;
         t += (int64_t)gridDim.x * blockDim.x) {
        const int64_t m = t / D;
        const int d = (int)(t % D);
        const int32_t id = ids[m];
        out[t] = (id >= 0 && id < V) ? table[(int64_t)id * D + d] : __float2bfloat16_rn(0.0f);
    }
}
__global__ void embedding_bwd_kernel(float *dtable, const bt_bf16 *dout, const int32_t *ids, int M,
                                     int D, int V)
{
    const int64_t total = (int64_t)M * D;
    for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < total;
         t += (int64_t)gridDim.x * blockDim.x) {
        const int64_t m = t / D;
        const int d = (int)(t % D);
        const int32_t id = ids[m];
        if (id >= 0 && id < V)
            atomicAdd(dtable + (int64_t)id * D + d, __bfloat162float(dout[t]));
    }
}
extern "C" int bt_cuda_embedding_fwd(bt_bf16 *out, const bt_bf16 *table, const int32_t *ids, int M,
                                     int D, int V, cudaStream_t stream)
{
    if (!out || !table || !ids || M < 0 || D <= 0 || V <= 0)
        return BT_CU_ERR_INVALID;
    if (M == 0)
        return BT_CU_OK;
    embedding_fwd_kernel<<<grid_for((int64_t)M * D, 256), 256, 0, stream>>>(out, table, ids, M, D, V);
    BT_LAUNCH_CHECK();
    return BT_CU_OK;
}
extern "C" int bt_cuda_embedding_bwd(float *dtable, const bt_bf16 *dout, const int32_t *ids, int M,
                                     int D, int V, cudaStream_t stream)
{
    if (!dtable || !dout || !ids || M < 0 || D <= 0 || V <= 0)
        return BT_CU_ERR_INVALID;
    if (M == 0)
        return BT_CU_OK;
    embedding_bwd_kernel<<<grid_for((int64_t)M * D, 256), 256, 0, stream>>>(dtable, dout, ids, M, D, V);
    BT_LAUNCH_CHECK();
    return BT_CU_OK;
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
    if (!tensors || n_tensors < 0 || n_tensors > 65535 || max_n < 0)
        return BT_CU_ERR_INVALID;
    if (n_tensors == 0 || max_n == 0)
        return BT_CU_OK;
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
    return BT_CU_OK;
}
