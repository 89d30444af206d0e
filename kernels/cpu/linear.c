/* Dense linear layers (torch.nn.Linear convention, W[out, in]) on OpenBLAS sgemm via bt_sgemm (blas_par.c).
 * All tensors fp32, row-major, contiguous, caller owned. Threads: OpenMP row blocks (bt_sgemm). */
#include "kernels/kernels.h"

#include <string.h>

/* Y[M,N] = X[M,K] @ W[N,K]^T + beta*Y. One sgemm (NoTrans x Trans). beta 0 overwrites Y (BLAS
 * semantics: Y may hold garbage). M, N or K == 0 is allowed (K == 0 gives Y = beta*Y). */
void bt_linear_fwd(float *Y, const float *X, const float *W, int M, int K, int N, float beta)
{
    if (M <= 0 || N <= 0)
        return;
    bt_sgemm(0, 1, M, N, K, 1.0f, X, K > 0 ? K : 1, W,
                K > 0 ? K : 1, beta, Y, N);
}

/* dX[M,K] = dY[M,N] @ W[N,K] + beta*dX. One sgemm (NoTrans x NoTrans). */
void bt_linear_bwd_x(float *dX, const float *dY, const float *W, int M, int K, int N, float beta)
{
    if (M <= 0 || K <= 0)
        return;
    bt_sgemm(0, 0, M, K, N, 1.0f, dY, N > 0 ? N : 1, W, K,
                beta, dX, K);
}

/* dW[N,K] = dY[M,N]^T @ X[M,K] + beta*dW. One sgemm (Trans x NoTrans); the reduction runs over
 * the M tokens. */
void bt_linear_bwd_w(float *dW, const float *dY, const float *X, int M, int K, int N, float beta)
{
    if (N <= 0 || K <= 0)
        return;
    bt_sgemm(1, 0, N, K, M, 1.0f, dY, N, X, K, beta, dW, K);
}
