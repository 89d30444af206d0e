/* cuBLAS GEMM wrapper (row-major, bf16 in, bf16/fp32 out, fp32 compute) and the LoRA forward /
 * backward built on it. See kernels/cuda/kernels_cuda.h for the contracts. */
#include "kernels/cuda/cuda_internal.h"

extern "C" int bt_cuda_gemm(cublasHandle_t h, cudaStream_t stream, int transA, int transB, int M,
                            int N, int K, float alpha, const bt_bf16 *A, int lda, const bt_bf16 *B,
                            int ldb, float beta, void *C, int ldc, int c_f32)
{
    BT_CU_REFUSE(BT_ERR_INVALID, !h || M < 0 || N < 0 || K < 0);
    if (M == 0 || N == 0)
        return BT_OK;
    BT_CU_REFUSE(BT_ERR_INVALID, !A || !B || !C);
    /* Row-major C[M,N] = op(A) op(B) is column-major C^T[N,M] = op(B)^T op(A)^T: the column-major
     * view of a row-major [r,c] buffer is its transpose, so B goes first with its own op. */
    BT_TRY(BT_CUBLAS_CHECK(cublasSetStream(h, stream)));
    const cublasOperation_t opB = transB ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t opA = transA ? CUBLAS_OP_T : CUBLAS_OP_N;
    return BT_CUBLAS_CHECK(cublasGemmEx(h, opB, opA, N, M, K, &alpha, B, CUDA_R_16BF, ldb, A,
                                        CUDA_R_16BF, lda, &beta, C,
                                        c_f32 ? CUDA_R_32F : CUDA_R_16BF, ldc, CUBLAS_COMPUTE_32F,
                                        CUBLAS_GEMM_DEFAULT));
}

extern "C" int bt_cuda_lora_fwd(cublasHandle_t h, cudaStream_t stream, bt_bf16 *Y, bt_bf16 *XA,
                                const bt_bf16 *X, const bt_bf16 *A16, const bt_bf16 *B16, int M,
                                int K, int N, int r, float s)
{
    BT_CU_REFUSE(BT_ERR_INVALID, !Y || !XA || !X || !A16 || !B16 || M < 0 || K <= 0 || N <= 0 ||
                                 r <= 0);
    /* XA[M,r] = X[M,K] @ A[r,K]^T */
    BT_TRY(bt_cuda_gemm(h, stream, 0, 1, M, r, K, 1.0f, X, K, A16, K, 0.0f, XA, r, 0));
    /* Y[M,N] += s * XA[M,r] @ B[N,r]^T (beta = 1: accumulate in the GEMM epilogue) */
    return bt_cuda_gemm(h, stream, 0, 1, M, N, r, s, XA, r, B16, r, 1.0f, Y, N, 0);
}

extern "C" int bt_cuda_lora_bwd(cublasHandle_t h, cudaStream_t stream, float *dA, float *dB,
                                bt_bf16 *dX, bt_bf16 *dXA, const bt_bf16 *dY, const bt_bf16 *X,
                                const bt_bf16 *XA, const bt_bf16 *A16, const bt_bf16 *B16, int M,
                                int K, int N, int r, float s, float beta_w)
{
    BT_CU_REFUSE(BT_ERR_INVALID, !dA || !dB || !dXA || !dY || !X || !XA || !A16 || !B16 || M < 0 ||
                                 K <= 0 || N <= 0 || r <= 0);
    /* dB[N,r] = beta_w dB + s * dY[M,N]^T @ XA[M,r] */
    BT_TRY(bt_cuda_gemm(h, stream, 1, 0, N, r, M, s, dY, N, XA, r, beta_w, dB, r, 1));
    /* dXA[M,r] = s * dY[M,N] @ B[N,r] */
    BT_TRY(bt_cuda_gemm(h, stream, 0, 0, M, r, N, s, dY, N, B16, r, 0.0f, dXA, r, 0));
    /* dA[r,K] = beta_w dA + dXA[M,r]^T @ X[M,K] */
    BT_TRY(bt_cuda_gemm(h, stream, 1, 0, r, K, M, 1.0f, dXA, r, X, K, beta_w, dA, K, 1));
    /* dX[M,K] += dXA[M,r] @ A[r,K] */
    if (dX)
        BT_TRY(bt_cuda_gemm(h, stream, 0, 0, M, K, r, 1.0f, dXA, r, A16, K, 1.0f, dX, K, 0));
    return BT_OK;
}
