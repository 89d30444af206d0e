/* The one place kernels/cpu calls BLAS: cblas_sgemm (OpenBLAS, pthreads build) kept
 * single-threaded and parallelised by OpenMP over row (or column) blocks of C.
 *
 * Why: OpenBLAS's pthread pool and libgomp's pool both spin-wait after work. Alternating OpenBLAS
 * threaded sgemm with OpenMP elementwise kernels on a 2-core machine made each pool steal the cores
 * the other was about to use (measured: nf4_linear_fwd 85 ms with both pools vs 34 ms with one;
 * a 0.35 ms dequantisation took 12 ms). With OpenBLAS at one thread and all threading in OpenMP,
 * a split 2048x576x1536 sgemm runs at the same speed as OpenBLAS's own threading.
 *
 * A product with a single row (M == 1: one decode token, the lm_head of `trainer generate`) or a
 * single column (N == 1) is a matrix-vector product and goes to cblas_sgemv. OpenBLAS 0.3.21's
 * sgemm has no such shortcut (its GEMM_GEMV_FORWARD came in 0.3.27): it packs the whole of the other
 * operand into panels first (sgemm_incopy), so a 1 x 640 row against Gemma 3's tied 262144 x 640
 * lm_head copied 671 MB per call; measured there, that copy was 40% of `trainer generate`'s CPU. */
#include "kernels/kernels.h"
#include "kernels/cpu/cpu_math.h"

#include <cblas.h>
#include <pthread.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static pthread_once_t g_blas_once = PTHREAD_ONCE_INIT;

static void blas_single_thread(void)
{
    openblas_set_num_threads(1);
}

void bt_cpu_blas_init(void)
{
    pthread_once(&g_blas_once, blas_single_thread);
}

/* Below this many multiply-adds a GEMM runs on the calling thread. */
#define BT_SGEMM_PAR_MIN_FMA (1L << 18)

/* y[i * incy] = alpha * sum_k Mat[i, k] x[k * incx] + beta * y[i * incy], i in [0, rows), where
 * Mat[i, k] = P[i * ld + k] (trans 0) or P[k * ld + i] (trans 1), k in [0, K). beta 0 overwrites y
 * even where it held nan (BLAS semantics of bt_sgemm; sgemv's own beta 0 is not relied on). rows
 * are split over OpenMP threads in contiguous blocks when the product is large enough. */
static void gemv_rows(int trans, int rows, int K, float alpha, const float *P, int ld,
                      const float *x, int incx, float beta, float *y, int incy, int nt)
{
    if (beta == 0.0f)
        for (int i = 0; i < rows; i++)
            y[(size_t)i * incy] = 0.0f;
    if (K <= 0) {
        if (beta != 0.0f && beta != 1.0f)
            for (int i = 0; i < rows; i++)
                y[(size_t)i * incy] *= beta;
        return;
    }
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
#ifdef _OPENMP
        const int id = omp_get_thread_num(), n = omp_get_num_threads();
#else
        const int id = 0, n = 1;
#endif
        int chunk = (rows + n - 1) / n;
        if (chunk > 16)
            chunk = (chunk + 15) / 16 * 16;
        const int a = id * chunk, b = a + chunk < rows ? a + chunk : rows;
        if (a < b) {
            if (trans) /* Mat^T is [K, rows] row-major: columns a..b of it */
                cblas_sgemv(CblasRowMajor, CblasTrans, K, b - a, alpha, P + a, ld, x, incx, beta,
                            y + (size_t)a * incy, incy);
            else
                cblas_sgemv(CblasRowMajor, CblasNoTrans, b - a, K, alpha, P + (size_t)a * ld, ld,
                            x, incx, beta, y + (size_t)a * incy, incy);
        }
    }
}

void bt_sgemm(int transA, int transB, int M, int N, int K, float alpha, const float *A, int lda,
              const float *B, int ldb, float beta, float *C, int ldc)
{
    if (M <= 0 || N <= 0)
        return;
    bt_cpu_blas_init();
    const enum CBLAS_TRANSPOSE ta = transA ? CblasTrans : CblasNoTrans;
    const enum CBLAS_TRANSPOSE tb = transB ? CblasTrans : CblasNoTrans;
    int nt = 1;
#ifdef _OPENMP
    if (!omp_in_parallel() && (long)M * N * (K > 0 ? K : 1) >= BT_SGEMM_PAR_MIN_FMA)
        nt = omp_get_max_threads();
#endif
    if (M == 1) { /* C[0, j] = alpha * sum_k op(A)[0, k] op(B)[k, j]: op(B)^T times the row */
        const int incx = transA ? lda : 1; /* A is [K, 1] (stride lda) or [1, K] */
        gemv_rows(!transB, N, K, alpha, B, ldb, A, incx, beta, C, 1, nt);
        return;
    }
    if (N == 1) { /* C[i, 0] = alpha * sum_k op(A)[i, k] op(B)[k, 0]: op(A) times the column */
        const int incx = transB ? 1 : ldb; /* B is [1, K] or [K, 1] (stride ldb) */
        gemv_rows(transA, M, K, alpha, A, lda, B, incx, beta, C, ldc, nt);
        return;
    }
    if (nt <= 1) {
        cblas_sgemm(CblasRowMajor, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
        return;
    }
    /* split the larger of M and N into nt contiguous parts (multiples of 16 where possible) */
    const int split_m = M >= N;
    const int len = split_m ? M : N;
#pragma omp parallel num_threads(nt)
    {
#ifdef _OPENMP
        const int id = omp_get_thread_num(), n = omp_get_num_threads();
#else
        const int id = 0, n = 1;
#endif
        int chunk = (len + n - 1) / n;
        if (chunk > 16)
            chunk = (chunk + 15) / 16 * 16;
        const int a = id * chunk, b = a + chunk < len ? a + chunk : len;
        if (a < b) {
            if (split_m) {
                const float *Ap = transA ? A + a : A + (size_t)a * lda;
                cblas_sgemm(CblasRowMajor, ta, tb, b - a, N, K, alpha, Ap, lda, B, ldb, beta,
                            C + (size_t)a * ldc, ldc);
            } else {
                const float *Bp = transB ? B + (size_t)a * ldb : B + a;
                cblas_sgemm(CblasRowMajor, ta, tb, M, b - a, K, alpha, A, lda, Bp, ldb, beta, C + a,
                            ldc);
            }
        }
    }
}
