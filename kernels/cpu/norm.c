/* RMSNorm (Zhang & Sennrich 2019, arXiv 1910.07467), as HF LlamaRMSNorm computes it in fp32:
 *   y = w * (x * rsqrt(mean(x^2) + eps)). */
#include "kernels/kernels.h"
#include "kernels/cpu/cpu_math.h"

#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdlib.h>
#include <string.h>

/* x, y [M, D] fp32 (y may equal x for in-place use); w [D]; rstd [M] receives
 * 1/sqrt(mean(x^2) + eps) per row for the backward. The mean of squares is accumulated in double
 * and rounded to fp32 before adding eps (HF accumulates in fp32; the difference is below fp32
 * resolution of the result). Rows run in parallel. */
void bt_rmsnorm_fwd(float *y, float *rstd, const float *x, const float *w, int M, int D, float eps)
{
#pragma omp parallel for schedule(static) if ((int64_t)M * D >= 32768)
    for (int m = 0; m < M; m++) {
        const float *xr = x + (size_t)m * D;
        float *yr = y + (size_t)m * D;
        double ss = 0.0;
#pragma omp simd reduction(+ : ss)
        for (int d = 0; d < D; d++)
            ss += (double)xr[d] * (double)xr[d];
        float var = (float)(ss / (double)D);
        float r = 1.0f / sqrtf(var + eps);
        rstd[m] = r;
#pragma omp simd
        for (int d = 0; d < D; d++)
            yr[d] = w[d] * (xr[d] * r);
    }
}

/* Backward of bt_rmsnorm_fwd with xh = x*r (r = rstd[m]) and g = dy*w:
 *   dx = r * (g - xh * mean(g * xh))        [M, D], overwritten (may alias dy);
 *   dw += sum_m dy * xh                     [D], accumulated into when dw != NULL.
 * The dw reduction is deterministic for a fixed thread count: each thread sums a fixed static
 * range of rows into its own buffer and the buffers are added in thread order. */
void bt_rmsnorm_bwd(float *dx, float *dw, const float *dy, const float *x, const float *w,
                    const float *rstd, int M, int D)
{
    const int nt = ((int64_t)M * D >= 32768) ? bt_cpu_max_threads() : 1;
    float *dwbuf = NULL;
    if (dw) {
        dwbuf = calloc((size_t)nt * (size_t)D, sizeof(float));
        if (!dwbuf) { /* fall back to a single-threaded direct accumulation */
            for (int m = 0; m < M; m++) {
                const float r = rstd[m];
                for (int d = 0; d < D; d++)
                    dw[d] += dy[(size_t)m * D + d] * (x[(size_t)m * D + d] * r);
            }
        }
    }
#pragma omp parallel num_threads(nt)
    {
#ifdef _OPENMP
        const int tid = omp_get_thread_num();
        const int nthr = omp_get_num_threads();
#else
        const int tid = 0, nthr = 1;
#endif
        const int m0 = (int)((int64_t)M * tid / nthr), m1 = (int)((int64_t)M * (tid + 1) / nthr);
        float *acc = dwbuf ? dwbuf + (size_t)tid * D : NULL;
        for (int m = m0; m < m1; m++) {
            const float *xr = x + (size_t)m * D, *dyr = dy + (size_t)m * D;
            float *dxr = dx + (size_t)m * D;
            const float r = rstd[m];
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < D; d++)
                dot += dyr[d] * w[d] * (xr[d] * r);
            if (acc) {
#pragma omp simd
                for (int d = 0; d < D; d++)
                    acc[d] += dyr[d] * (xr[d] * r);
            }
            const float c = dot / (float)D;
#pragma omp simd
            for (int d = 0; d < D; d++)
                dxr[d] = r * (dyr[d] * w[d] - (xr[d] * r) * c);
        }
    }
    if (dwbuf) {
        for (int t = 0; t < nt; t++)
            for (int d = 0; d < D; d++)
                dw[d] += dwbuf[(size_t)t * D + d];
        free(dwbuf);
    }
}
