/* Private helpers for kernels/cpu: a vectorisable expf and small utilities. Not part of the public
 * kernel API. */
#ifndef BT_KERNELS_CPU_MATH_H
#define BT_KERNELS_CPU_MATH_H
#include <math.h>
#include <stdint.h>
#include <string.h>

/* exp(x) for fp32, written so that GCC vectorises it inside `#pragma omp simd` loops (glibc's
 * expf is a scalar call under -std=c17 without -ffast-math). Algorithm and coefficients: Cephes
 * expf.c (S. Moshier): n = round(x*log2(e)) (by the 1.5*2^23 trick, exact for |n| < 2^22),
 * r = x - n*ln2 (Cody-Waite split C1 + C2), exp(r) by a degree-6 minimax polynomial, times 2^n
 * built in the exponent bits. Relative error <= ~2e-7 (about 2 ulp) on [-87.3, 88]; x < -87.3
 * (including -inf) returns exactly 0; x > 88 is clamped to 88 (exp(88) = 1.65e38); NaN -> NaN. */
static inline float bt_expf(float x)
{
    /* clamp with compares (fminf/fmaxf are libm calls under strict IEEE); NaN maps to -88 here
     * and is restored at the end, so no NaN reaches the float->int conversion */
    float xc = x > -88.0f ? x : -88.0f;
    xc = xc < 88.0f ? xc : 88.0f;
    const float t = xc * 1.44269504088896341f;
    const float n = (t + 12582912.0f) - 12582912.0f;
    float r = xc - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    const float z = r * r;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * z + r + 1.0f;
    const int32_t e = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, sizeof scale);
    float res = y * scale;
    res = x < -87.3f ? 0.0f : res;
    return x != x ? x : res;
}

/* Number of OpenMP threads a parallel region would use here (1 without OpenMP). */
int bt_cpu_max_threads(void);

/* Set OpenBLAS to one thread (once per process; blas_par.c explains why). Every kernel that calls
 * BLAS goes through bt_sgemm, which calls this first. */
void bt_cpu_blas_init(void);

/* ---- tiled "dequantise then GEMM" driver (kernels/cpu/tiled_gemm.c) shared by the NF4 and the
 * ggml block-format linears: the weight W[N, K] is never materialised in fp32 as a whole; each
 * OpenMP thread dequantises BT_TILE_ROWS rows at a time into its own part of `scratch` and runs a
 * single-threaded sgemm on that tile. ----
 * A tile dequantiser writes rows [n0, n0 + nt) of the weight `w` (K columns) as fp32 into
 * tile[nt, K]; it is called concurrently from several threads on disjoint tiles. */
#define BT_TILE_ROWS 128
typedef void (*bt_tile_dequant_fn)(const void *w, int n0, int nt, int K, float *tile);
/* Floats of scratch the two drivers need for inner dimension K: one BT_TILE_ROWS x K tile per
 * OpenMP thread (omp_get_max_threads() at the time of the call). */
size_t bt_tiled_scratch_floats(int K);
/* Y[M,N] = X[M,K] @ W[N,K]^T + beta*Y: thread t owns a contiguous range of W rows (= Y columns). */
void bt_tiled_linear_fwd(float *Y, const float *X, const void *w, bt_tile_dequant_fn dq, int M,
                         int K, int N, float beta, float *scratch);
/* dX[M,K] = dY[M,N] @ W[N,K] + beta*dX: thread t owns a contiguous range of dX rows and walks all
 * of W tile by tile (every thread dequantises the whole weight). */
void bt_tiled_linear_bwd_x(float *dX, const float *dY, const void *w, bt_tile_dequant_fn dq, int M,
                           int K, int N, float beta, float *scratch);

#endif
