/* GGUF-native base weights on the device: upload of a ggml tensor's blocks as they are, their
 * dequantisation to bf16 (bit-identical to common/quant.c, then rounded to bf16) and the
 * dequantise + cuBLAS linear paths, as nf4.cu does for NF4. Decoders: ggml_decode.h. The fused
 * GEMMs (no bf16 copy of the weight) are in nf4_gemm.cu, which shares its tiled kernel. */
#include "kernels/cuda/cuda_internal.h"
#include "kernels/cuda/ggml_decode.h"

#include <cstring>

/* Bytes per block and elements per block of the types with a decoder (ggml-common.h); 0 else. */
static int ggml_block_bytes(int type, int *blck)
{
    switch (type) {
    case BT_CU_GGML_Q4_0: *blck = 32; return GgmlDec<BT_CU_GGML_Q4_0>::BYTES;
    case BT_CU_GGML_Q4_1: *blck = 32; return GgmlDec<BT_CU_GGML_Q4_1>::BYTES;
    case BT_CU_GGML_Q5_0: *blck = 32; return GgmlDec<BT_CU_GGML_Q5_0>::BYTES;
    case BT_CU_GGML_Q5_1: *blck = 32; return GgmlDec<BT_CU_GGML_Q5_1>::BYTES;
    case BT_CU_GGML_Q8_0: *blck = 32; return GgmlDec<BT_CU_GGML_Q8_0>::BYTES;
    case BT_CU_GGML_Q4_K: *blck = 256; return GgmlDec<BT_CU_GGML_Q4_K>::BYTES;
    case BT_CU_GGML_Q5_K: *blck = 256; return GgmlDec<BT_CU_GGML_Q5_K>::BYTES;
    case BT_CU_GGML_Q6_K: *blck = 256; return GgmlDec<BT_CU_GGML_Q6_K>::BYTES;
    default: *blck = 0; return 0;
    }
}

extern "C" int bt_cuda_ggml_supported(int type)
{
    int blck;
    return ggml_block_bytes(type, &blck) > 0;
}

extern "C" int bt_cuda_ggml_upload(bt_cuda_ggml *dst, int type, int64_t rows, int64_t cols,
                                   const uint8_t *data_host)
{
    BT_CU_REFUSE(BT_ERR_INVALID, !dst);
    memset(dst, 0, sizeof *dst);
    int blck;
    const int bytes = ggml_block_bytes(type, &blck);
    BT_CU_REFUSE(BT_ERR_UNSUPPORTED, bytes == 0);
    BT_CU_REFUSE(BT_ERR_INVALID, rows <= 0 || cols <= 0 || cols % blck != 0 || !data_host ||
                                 rows > INT32_MAX);
    const int64_t row_bytes = cols / blck * bytes;
    const size_t total = (size_t)(rows * row_bytes);
    uint8_t *d = nullptr;
    if (cudaMalloc(&d, total) != cudaSuccess) {
        const cudaError_t e = cudaGetLastError();
        return bt_fail(BT_ERR_NOMEM, "cuda: %s: cudaMalloc of %zu bytes: %s", __func__, total,
                       cudaGetErrorString(e));
    }
    int rc = BT_CUDA_CHECK(cudaMemcpy(d, data_host, total, cudaMemcpyHostToDevice));
    if (!rc) /* pageable-source cudaMemcpy may return before the DMA lands */
        rc = BT_CUDA_CHECK(cudaStreamSynchronize(0));
    if (rc) {
        cudaFree(d);
        return rc;
    }
    dst->type = type;
    dst->rows = rows;
    dst->cols = cols;
    dst->row_bytes = row_bytes;
    dst->data = d;
    return BT_OK;
}

extern "C" void bt_cuda_ggml_free(bt_cuda_ggml *w)
{
    if (!w)
        return;
    if (w->data)
        cudaFree(const_cast<uint8_t *>(w->data));
    memset(w, 0, sizeof *w);
}

/* One thread per 32-element chunk of rows [r0, r0 + nr): decode, four 16-byte stores. */
template <int T>
__global__ void ggml_dequant_kernel(bt_bf16 *__restrict__ out, const uint8_t *__restrict__ data,
                                    int64_t row_bytes, int64_t cols, int64_t r0, int64_t nchunks)
{
    const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= nchunks)
        return;
    const int64_t per_row = cols / 32, r = t / per_row;
    const int c0 = (int)((t % per_row) * 32);
    typename GgmlDec<T>::Raw raw;
    GgmlDec<T>::load(raw, data + (r0 + r) * row_bytes, c0);
    uint32_t w[16];
    GgmlDec<T>::decode(raw, w);
    uint4 *o = reinterpret_cast<uint4 *>(out + t * 32);
#pragma unroll
    for (int q = 0; q < 4; q++)
        o[q] = make_uint4(w[4 * q], w[4 * q + 1], w[4 * q + 2], w[4 * q + 3]);
}

template <int T>
static int launch_dequant(bt_bf16 *out, const bt_cuda_ggml *w, int64_t r0, int64_t nr,
                          cudaStream_t stream)
{
    const int64_t nchunks = nr * (w->cols / 32);
    const int threads = 256;
    ggml_dequant_kernel<T><<<(unsigned)((nchunks + threads - 1) / threads), threads, 0, stream>>>(
        out, w->data, w->row_bytes, w->cols, r0, nchunks);
    BT_LAUNCH_CHECK();
    return BT_OK;
}

extern "C" int bt_cuda_ggml_dequant(bt_bf16 *out, const bt_cuda_ggml *w, int64_t r0, int64_t nr,
                                    cudaStream_t stream)
{
    BT_CU_REFUSE(BT_ERR_INVALID, !out || !w || !w->data || r0 < 0 || nr < 0 || r0 + nr > w->rows);
    BT_CU_REFUSE(BT_ERR_UNSUPPORTED, ((uintptr_t)out & 15) != 0 || w->cols % 32 != 0);
    if (nr == 0)
        return BT_OK;
    BT_CU_REFUSE(BT_ERR_UNSUPPORTED, (nr * (w->cols / 32) + 255) / 256 > 0x7fffffffLL);
    switch (w->type) {
    case BT_CU_GGML_Q4_0: return launch_dequant<BT_CU_GGML_Q4_0>(out, w, r0, nr, stream);
    case BT_CU_GGML_Q4_1: return launch_dequant<BT_CU_GGML_Q4_1>(out, w, r0, nr, stream);
    case BT_CU_GGML_Q5_0: return launch_dequant<BT_CU_GGML_Q5_0>(out, w, r0, nr, stream);
    case BT_CU_GGML_Q5_1: return launch_dequant<BT_CU_GGML_Q5_1>(out, w, r0, nr, stream);
    case BT_CU_GGML_Q8_0: return launch_dequant<BT_CU_GGML_Q8_0>(out, w, r0, nr, stream);
    case BT_CU_GGML_Q4_K: return launch_dequant<BT_CU_GGML_Q4_K>(out, w, r0, nr, stream);
    case BT_CU_GGML_Q5_K: return launch_dequant<BT_CU_GGML_Q5_K>(out, w, r0, nr, stream);
    case BT_CU_GGML_Q6_K: return launch_dequant<BT_CU_GGML_Q6_K>(out, w, r0, nr, stream);
    default:
        return bt_fail(BT_ERR_UNSUPPORTED, "cuda: %s: ggml type %d has no CUDA decoder", __func__,
                       w->type);
    }
}

extern "C" int bt_cuda_ggml_linear_fwd(cublasHandle_t h, cudaStream_t stream, bt_bf16 *Y,
                                       const bt_bf16 *X, const bt_cuda_ggml *W, int M, int K, int N,
                                       float beta, bt_bf16 *wbuf)
{
    BT_CU_REFUSE(BT_ERR_INVALID, !W || W->rows != N || W->cols != K || !wbuf);
    BT_TRY(bt_cuda_ggml_dequant(wbuf, W, 0, N, stream));
    return bt_cuda_dq_gemm(h, stream, false, Y, X, M, K, N, beta, wbuf);
}

extern "C" int bt_cuda_ggml_linear_bwd_x(cublasHandle_t h, cudaStream_t stream, bt_bf16 *dX,
                                         const bt_bf16 *dY, const bt_cuda_ggml *W, int M, int K,
                                         int N, float beta, bt_bf16 *wbuf, int wbuf_valid)
{
    BT_CU_REFUSE(BT_ERR_INVALID, !W || W->rows != N || W->cols != K || !wbuf);
    if (!wbuf_valid)
        BT_TRY(bt_cuda_ggml_dequant(wbuf, W, 0, N, stream));
    return bt_cuda_dq_gemm(h, stream, true, dX, dY, M, K, N, beta, wbuf);
}
