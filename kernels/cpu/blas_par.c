/* The one place kernels/cpu calls BLAS: cblas_sgemm (OpenBLAS, pthreads build) kept
 * single-threaded and parallelised by OpenMP over row (or column) blocks of C.
 *
 * Why: OpenBLAS's pthread pool and libgomp's pool both spin-wait after work. Alternating OpenBLAS
 * threaded sgemm with OpenMP elementwise kernels on a 2-core machine made each pool steal the cores
 * the other was about to use (measured: nf4_linear_fwd 85 ms with both pools vs 34 ms with one;
 * a 0.35 ms dequantisation took 12 ms). With OpenBLAS at one thread and all threading in OpenMP,
 * a split 2048x576x1536 sgemm runs at the same speed as OpenBLAS's own threading. */
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
