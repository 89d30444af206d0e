/* Optimiser and reduction helpers: AdamW, sum of squares (for gradient-norm clipping), scaling. */
#include "kernels/kernels.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* One AdamW step on n fp32 parameters, in place: p [n] parameters, g [n] gradient (read only),
 * m, v [n] first/second moment state (caller owned, zero before step 1). step is 1-based (the
 * count of steps including this one); lr, beta1, beta2, eps, weight_decay as torch.optim.AdamW.
 * Follows torch/optim/adamw.py (_single_tensor_adamw, non-capturable, amsgrad=False, the
 * non-foreach path; Loshchilov & Hutter 2019 decoupled weight decay):
 *   p *= 1 - lr*wd;  m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g*g;
 *   bc1 = 1 - b1^t;  bc2 = 1 - b2^t;  denom = sqrt(v)/sqrt(bc2) + eps;  p -= (lr/bc1) * m/denom.
 * Scalars are formed as torch forms them from Python floats (in double, then cast to fp32 by the
 * fp32 kernels) and the per-element operations follow the ATen CPU kernels' order: m.lerp_(g, 1-b1)
 * (m + w*(g-m) for w < 0.5, else g - (g-m)*(1-w)), v*b2 + ((1-b2)*g)*g (addcmul), and
 * p + ((-step_size)*m)/denom (addcdiv). step <= 0 is treated as 1. */
void bt_adamw_step(float *p, const float *g, float *m, float *v, int64_t n, float lr, float beta1,
                   float beta2, float eps, float weight_decay, int64_t step)
{
    if (n <= 0)
        return;
    if (step < 1)
        step = 1;
    const double bc1 = 1.0 - pow((double)beta1, (double)step);
    const double bc2 = 1.0 - pow((double)beta2, (double)step);
    const float step_size = (float)((double)lr / bc1);
    const float bc2_sqrt = (float)sqrt(bc2);
    const float decay = (float)(1.0 - (double)lr * (double)weight_decay);
    const float w1 = (float)(1.0 - (double)beta1), omb2 = (float)(1.0 - (double)beta2);
    const float neg_step = -step_size;
#pragma omp parallel for simd schedule(static) if (n >= 65536)
    for (int64_t i = 0; i < n; i++) {
        float gi = g[i];
        float pi = p[i] * decay;
        float d = gi - m[i];
        float mi = w1 < 0.5f ? m[i] + w1 * d : gi - d * (1.0f - w1);
        float vi = v[i] * beta2 + (omb2 * gi) * gi;
        m[i] = mi;
        v[i] = vi;
        float denom = sqrtf(vi) / bc2_sqrt + eps;
        p[i] = pi + (neg_step * mi) / denom;
    }
}

/* Sum of x[i]^2 over n fp32 values, accumulated in double. Deterministic regardless of thread
 * count: fixed chunks of 16384 elements are summed (in parallel) into double partials that are then
 * added in chunk order. Returns 0 for n <= 0 (and NaN if malloc of the partials fails for huge n,
 * after which the caller's norm check trips). */
#define BT_SUMSQ_CHUNK 16384
double bt_sumsq(const float *x, int64_t n)
{
    if (n <= 0)
        return 0.0;
    const int64_t nc = (n + BT_SUMSQ_CHUNK - 1) / BT_SUMSQ_CHUNK;
    double stackbuf[256];
    double *part = nc <= 256 ? stackbuf : malloc((size_t)nc * sizeof(double));
    if (!part)
        return NAN;
#pragma omp parallel for schedule(static) if (nc > 1)
    for (int64_t c = 0; c < nc; c++) {
        int64_t i0 = c * BT_SUMSQ_CHUNK, i1 = i0 + BT_SUMSQ_CHUNK < n ? i0 + BT_SUMSQ_CHUNK : n;
        double s = 0.0;
#pragma omp simd reduction(+ : s)
        for (int64_t i = i0; i < i1; i++)
            s += (double)x[i] * (double)x[i];
        part[c] = s;
    }
    double s = 0.0;
    for (int64_t c = 0; c < nc; c++)
        s += part[c];
    if (part != stackbuf)
        free(part);
    return s;
}

/* x[i] *= s for i < n, in place (IEEE: NaN/inf propagate, so s == 0 on a NaN gives NaN). */
void bt_scale(float *x, int64_t n, float s)
{
    if (n <= 0 || s == 1.0f)
        return;
#pragma omp parallel for simd schedule(static) if (n >= 65536)
    for (int64_t i = 0; i < n; i++)
        x[i] *= s;
}
