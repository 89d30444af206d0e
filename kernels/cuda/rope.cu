/* RoPE (HF rotate_half layout) of the CUDA backend, from theta or from the model's
 * inverse-frequency table. Contracts: kernels/cuda/kernels_cuda.h; the fp32 reference is
 * kernels/cpu/rope.c. */
#include "kernels/cuda/cuda_internal.h"

#include <cmath>

__global__ void rope_kernel(bt_bf16 *x, const int32_t *pos, int M, int H, int D, int64_t ld,
                            float theta, const float *inv_freq, float pos_scale, float dir)
{
    const int half = D / 2;
    const int64_t total = (int64_t)M * H * half;
    for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < total;
         t += (int64_t)gridDim.x * blockDim.x) {
        const int i = (int)(t % half);
        const int64_t mh = t / half;
        const int h = (int)(mh % H);
        const int64_t m = mh / H;
        float c, s;
        if (inv_freq)
            sincosf(((float)pos[m] * pos_scale) * inv_freq[i], &s, &c);
        else
            bt_rope_cs(pos[m], i, D, theta, pos_scale, &c, &s);
        s *= dir;
        bt_bf16 *xr = x + m * ld + (int64_t)h * D;
        const float x1 = __bfloat162float(xr[i]), x2 = __bfloat162float(xr[i + half]);
        xr[i] = __float2bfloat16_rn(x1 * c - x2 * s);
        xr[i + half] = __float2bfloat16_rn(x2 * c + x1 * s);
    }
}

/* inv_freq == NULL: angles from theta (bt_cuda_rope); else from the table (bt_cuda_rope_freq) */
static int rope_launch(const char *who, bt_bf16 *x, const int32_t *position_ids, int M, int H,
                       int D, int64_t ld, float theta, const float *inv_freq, float pos_scale,
                       int inverse, cudaStream_t stream)
{
    BT_CU_REFUSE_AS(who, BT_ERR_INVALID, !x || !position_ids || M < 0 || H <= 0 || D < 2 || (D & 1) ||
                                         ld < (int64_t)H * D);
    if (M == 0)
        return BT_OK;
    const int64_t total = (int64_t)M * H * (D / 2);
    rope_kernel<<<bt_grid_for(total, 256), 256, 0, stream>>>(x, position_ids, M, H, D, ld, theta,
                                                          inv_freq, pos_scale,
                                                          inverse ? -1.0f : 1.0f);
    BT_LAUNCH_CHECK();
    return BT_OK;
}

extern "C" int bt_cuda_rope(bt_bf16 *x, const int32_t *position_ids, int M, int H, int D, int64_t ld,
                            float theta, float pos_scale, int inverse, cudaStream_t stream)
{
    return rope_launch(__func__, x, position_ids, M, H, D, ld, theta, nullptr, pos_scale, inverse,
                       stream);
}

extern "C" int bt_cuda_rope_freq(bt_bf16 *x, const int32_t *position_ids, int M, int H, int D,
                                 int64_t ld, const float *inv_freq, float pos_scale, int inverse,
                                 cudaStream_t stream)
{
    BT_CU_REFUSE(BT_ERR_INVALID, !inv_freq);
    return rope_launch(__func__, x, position_ids, M, H, D, ld, 0.0f, inv_freq, pos_scale, inverse,
                       stream);
}
