/* The tiled "dequantise then GEMM" driver of the frozen quantised base linears (NF4,
 * kernels/cpu/nf4.c; ggml block formats, kernels/cpu/ggml.c). See cpu_math.h. The weight is never
 * held in fp32 as a whole: every thread dequantises BT_TILE_ROWS rows at a time into its own
 * tile (BT_TILE_ROWS x K floats: enough rows for an efficient sgemm, few enough that the tile stays
 * in L2) and multiplies with a single-threaded sgemm. One OpenMP region per call, no barriers. */
#include "kernels/cpu/cpu_math.h"
#include "kernels/kernels.h"

#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* Threads for a region that splits `rows` rows in chunks of 16: all of OpenMP's (one when already
 * inside a parallel region), at most one per chunk. */
static int tiled_threads(int rows)
{
#ifdef _OPENMP
    const int nthr = omp_in_parallel() ? 1 : omp_get_max_threads();
    return nthr > (rows + 15) / 16 ? (rows + 15) / 16 : nthr;
#else
    (void)rows;
    return 1;
#endif
}

/* Inside the OpenMP region: this thread's BT_TILE_ROWS x K tile of scratch, and its share
 * [*a, *b) of `rows` rows (contiguous, a multiple of 16 long; empty for spare threads). */
static float *thread_share(float *scratch, int K, int rows, int *a, int *b)
{
#ifdef _OPENMP
    const int id = omp_get_thread_num(), n = omp_get_num_threads();
#else
    const int id = 0, n = 1;
#endif
    int chunk = (rows + n - 1) / n;
    chunk = (chunk + 15) / 16 * 16;
    *a = id * chunk;
    *b = *a + chunk < rows ? *a + chunk : rows;
    return scratch + (size_t)id * BT_TILE_ROWS * (size_t)K;
}

size_t bt_tile_scratch_floats(int threads, int K)
{
    return (size_t)(threads > 1 ? threads : 1) * (size_t)BT_TILE_ROWS * (size_t)(K > 0 ? K : 0);
}

size_t bt_tiled_scratch_floats(int K)
{
#ifdef _OPENMP
    return bt_tile_scratch_floats(omp_get_max_threads(), K);
#else
    return bt_tile_scratch_floats(1, K);
#endif
}

/* Y columns [n0, n0+nt) = X @ tile^T (ldc = N), tile after tile over this thread's W rows. */
void bt_tiled_linear_fwd(float *Y, const float *X, const void *w, bt_tile_dequant_fn dq, int M,
                         int K, int N, float beta, float *scratch)
{
    if (M <= 0 || N <= 0)
        return;
    bt_cpu_blas_init();
    const int nthr = tiled_threads(N);
#pragma omp parallel num_threads(nthr) if (nthr > 1)
    {
        int a, b;
        float *tile = thread_share(scratch, K, N, &a, &b);
        for (int n0 = a; n0 < b; n0 += BT_TILE_ROWS) {
            const int nt = b - n0 < BT_TILE_ROWS ? b - n0 : BT_TILE_ROWS;
            dq(w, n0, nt, K, tile);
            bt_sgemm(0, 1, M, nt, K, 1.0f, X, K, tile, K, beta, Y + n0, N);
        }
    }
}

/* dX[rows a..b) accumulates dY[rows, tile] @ tile over all of W's tiles (the first applies beta). */
void bt_tiled_linear_bwd_x(float *dX, const float *dY, const void *w, bt_tile_dequant_fn dq, int M,
                           int K, int N, float beta, float *scratch)
{
    if (M <= 0 || K <= 0)
        return;
    if (N <= 0) {
        if (beta == 0.0f)
            memset(dX, 0, (size_t)M * (size_t)K * sizeof(float));
        else
            bt_scale(dX, (int64_t)M * K, beta);
        return;
    }
    bt_cpu_blas_init();
    const int nthr = tiled_threads(M);
#pragma omp parallel num_threads(nthr) if (nthr > 1)
    {
        int a, b;
        float *tile = thread_share(scratch, K, M, &a, &b);
        if (a < b) {
            for (int n0 = 0; n0 < N; n0 += BT_TILE_ROWS) {
                const int nt = N - n0 < BT_TILE_ROWS ? N - n0 : BT_TILE_ROWS;
                dq(w, n0, nt, K, tile);
                bt_sgemm(0, 0, b - a, K, nt, 1.0f, dY + (size_t)a * N + n0, N, tile, K,
                         n0 == 0 ? beta : 1.0f, dX + (size_t)a * K, K);
            }
        }
    }
}
