/* NF4 (bitsandbytes nf4, blocksize 64, double-quantised absmax) on the device: dequantisation to
 * bf16 with the nested absmax decoded in the same kernel, and the dequantise + cuBLAS linear paths.
 * Format: docs/formats/nf4.md and kernels/cpu/nf4.c (the bit-exact reference). */
#include "kernels/cuda/cuda_internal.h"

#include <cstdlib>
#include <cstring>

/* bitsandbytes csrc/kernels.cu nf4_dequantization_lut == get_4bit_type("nf4") */
__constant__ float c_nf4_lut[16] = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
    -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
    0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
    0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f,
};

/* One thread per 8 packed bytes = 16 elements (a quarter of a 64-block): one 8-byte load, two
 * 16-byte stores. absmax of the block: code8[q] * nested (rounded) then + offset (rounded): the
 * __fmul_rn/__fadd_rn intrinsics stop nvcc from contracting it into one FMA, so the value is
 * bit-identical to bitsandbytes (dequantize_blockwise then `+= offset`) and to kernels/cpu/nf4.c. */
__global__ void nf4_dequant_kernel(bt_bf16 *__restrict__ out, const uint8_t *__restrict__ packed,
                                   const uint8_t *__restrict__ absmax_q,
                                   const float *__restrict__ nested, const float *__restrict__ code8,
                                   float offset, int64_t e0, int64_t nelem)
{
    /* the code book in shared memory: lanes index it with different nibbles, which the constant
     * cache would serialise (up to 16 ways); 16 floats sit in 16 banks, so shared loads do not */
    __shared__ float s_lut[16];
    if (threadIdx.x < 16)
        s_lut[threadIdx.x] = c_nf4_lut[threadIdx.x];
    __syncthreads();
    const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t i = t * 16; /* element offset within the output */
    if (i >= nelem)
        return;
    const int64_t e = e0 + i; /* element of the flattened weight; multiple of 16 */
    const int64_t b = e >> 6;
    const float am = __fadd_rn(__fmul_rn(__ldg(code8 + __ldg(absmax_q + b)), __ldg(nested + (b >> 8))),
                               offset);
    const uint2 raw = *reinterpret_cast<const uint2 *>(packed + (e >> 1));
    uint32_t w[2] = {raw.x, raw.y};
    __align__(16) bt_bf16 v[16];
#pragma unroll
    for (int q = 0; q < 2; q++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const uint32_t byte = (w[q] >> (8 * j)) & 0xffu;
            v[q * 8 + 2 * j] = __float2bfloat16_rn(__fmul_rn(s_lut[byte >> 4], am));
            v[q * 8 + 2 * j + 1] = __float2bfloat16_rn(__fmul_rn(s_lut[byte & 15u], am));
        }
    uint4 *o = reinterpret_cast<uint4 *>(out + i);
    o[0] = reinterpret_cast<const uint4 *>(v)[0];
    o[1] = reinterpret_cast<const uint4 *>(v)[1];
}

extern "C" int bt_cuda_nf4_dequant(bt_bf16 *out, const bt_cuda_nf4 *w, int64_t r0, int64_t nr,
                                   cudaStream_t stream)
{
    BT_CU_REFUSE(BT_ERR_INVALID, !out || !w || !w->packed || !w->absmax_q || !w->nested_absmax ||
                                 !w->code8 || r0 < 0 || nr < 0 || r0 + nr > w->rows);
    const int64_t e0 = r0 * w->cols, ne = nr * w->cols;
    /* 16-byte aligned output, 16-element granularity */
    BT_CU_REFUSE(BT_ERR_UNSUPPORTED, e0 % 64 != 0 || ne % 16 != 0 || ((uintptr_t)out & 15) != 0);
    if (ne == 0)
        return BT_OK;
    const int threads = 256;
    const int64_t nthr = ne / 16;
    nf4_dequant_kernel<<<(unsigned)((nthr + threads - 1) / threads), threads, 0, stream>>>(
        out, w->packed, w->absmax_q, w->nested_absmax, w->code8, w->offset, e0, ne);
    BT_LAUNCH_CHECK();
    return BT_OK;
}

extern "C" int bt_cuda_nf4_upload(bt_cuda_nf4 *dst, int64_t rows, int64_t cols,
                                  const uint8_t *packed_host, const uint8_t *absmax_q_host,
                                  const float *nested_absmax_host, float offset,
                                  const float *code8_host)
{
    BT_CU_REFUSE(BT_ERR_INVALID, !dst || rows <= 0 || cols <= 0 || !packed_host || !absmax_q_host ||
                                 !nested_absmax_host || !code8_host);
    memset(dst, 0, sizeof *dst);
    const int64_t n = rows * cols;
    BT_CU_REFUSE(BT_ERR_INVALID, n % 64 != 0);
    const int64_t nb = n / 64, nn = (nb + 255) / 256;
    /* one allocation: code8 | nested | packed | absmax_q (each 256-byte aligned) */
    const size_t o_code = 0, o_nested = 1024, o_packed = o_nested + ((size_t)nn * 4 + 255) / 256 * 256;
    const size_t o_absq = o_packed + ((size_t)(n / 2) + 255) / 256 * 256;
    const size_t total = o_absq + (size_t)nb;
    uint8_t *base = nullptr;
    if (cudaMalloc(&base, total) != cudaSuccess) {
        const cudaError_t e = cudaGetLastError();
        return bt_fail(BT_ERR_NOMEM, "cuda: %s: cudaMalloc of %zu bytes: %s", __func__, total,
                       cudaGetErrorString(e));
    }
    int rc = BT_CUDA_CHECK(cudaMemcpy(base + o_code, code8_host, 256 * sizeof(float), cudaMemcpyHostToDevice));
    if (!rc)
        rc = BT_CUDA_CHECK(cudaMemcpy(base + o_nested, nested_absmax_host, (size_t)nn * 4, cudaMemcpyHostToDevice));
    if (!rc)
        rc = BT_CUDA_CHECK(cudaMemcpy(base + o_packed, packed_host, (size_t)(n / 2), cudaMemcpyHostToDevice));
    if (!rc)
        rc = BT_CUDA_CHECK(cudaMemcpy(base + o_absq, absmax_q_host, (size_t)nb, cudaMemcpyHostToDevice));
    if (!rc) /* pageable-source cudaMemcpy may return before the DMA lands: make the upload truly synchronous */
        rc = BT_CUDA_CHECK(cudaStreamSynchronize(0));
    if (rc) {
        cudaFree(base);
        return rc;
    }
    dst->n = n;
    dst->rows = rows;
    dst->cols = cols;
    dst->code8 = reinterpret_cast<const float *>(base + o_code);
    dst->nested_absmax = reinterpret_cast<const float *>(base + o_nested);
    dst->packed = base + o_packed;
    dst->absmax_q = base + o_absq;
    dst->offset = offset;
    return BT_OK;
}

extern "C" void bt_cuda_nf4_free(bt_cuda_nf4 *w)
{
    if (!w)
        return;
    if (w->code8) /* code8 is the start of the single allocation made by bt_cuda_nf4_upload */
        cudaFree(const_cast<float *>(w->code8));
    memset(w, 0, sizeof *w);
}

extern "C" int bt_cuda_nf4_linear_fwd(cublasHandle_t h, cudaStream_t stream, bt_bf16 *Y,
                                      const bt_bf16 *X, const bt_cuda_nf4 *W, int M, int K, int N,
                                      float beta, bt_bf16 *wbuf)
{
    BT_CU_REFUSE(BT_ERR_INVALID, !W || W->rows != N || W->cols != K || !wbuf);
    BT_TRY(bt_cuda_nf4_dequant(wbuf, W, 0, N, stream));
    return bt_cuda_dq_gemm(h, stream, false, Y, X, M, K, N, beta, wbuf);
}

extern "C" int bt_cuda_nf4_linear_bwd_x(cublasHandle_t h, cudaStream_t stream, bt_bf16 *dX,
                                        const bt_bf16 *dY, const bt_cuda_nf4 *W, int M, int K,
                                        int N, float beta, bt_bf16 *wbuf, int wbuf_valid)
{
    BT_CU_REFUSE(BT_ERR_INVALID, !W || W->rows != N || W->cols != K || !wbuf);
    if (!wbuf_valid)
        BT_TRY(bt_cuda_nf4_dequant(wbuf, W, 0, N, stream));
    return bt_cuda_dq_gemm(h, stream, true, dX, dY, M, K, N, beta, wbuf);
}
