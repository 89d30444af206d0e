/* The fp32 -> bf16 conversion (round to nearest even), the residual add (y = a + b in bf16) and
 * the in-place scale (x *= s, Gemma's embedding scale) of the CUDA backend, and the device count.
 * Contracts: kernels/cuda/kernels_cuda.h. The CPU
 * backend has no counterpart file: it is fp32 throughout (common/ converts bf16/fp16 files). */
#include "kernels/cuda/cuda_internal.h"

extern "C" int bt_cuda_device_count(void)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return bt_fail(BT_ERR_IO, "cudaGetDeviceCount: %s", cudaGetErrorString(e));
    }
    if (n == 0)
        return bt_fail(BT_ERR_IO, "cudaGetDeviceCount returned 0 devices");
    return n;
}

__global__ void f32_to_bf16_kernel(bt_bf16 *out, const float *in, int64_t n)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        out[i] = __float2bfloat16_rn(in[i]);
}
__global__ void add_bf16_kernel(bt_bf16 *y, const bt_bf16 *a, const bt_bf16 *b, int64_t n)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        y[i] = __float2bfloat16_rn(__bfloat162float(a[i]) + __bfloat162float(b[i]));
}
extern "C" int bt_cuda_f32_to_bf16(bt_bf16 *out, const float *in, int64_t n, cudaStream_t stream)
{
    BT_CU_REFUSE(BT_ERR_INVALID, n < 0 || (n > 0 && (!out || !in)));
    if (n == 0)
        return BT_OK;
    f32_to_bf16_kernel<<<bt_grid_for(n, 256), 256, 0, stream>>>(out, in, n);
    BT_LAUNCH_CHECK();
    return BT_OK;
}
extern "C" int bt_cuda_add_bf16(bt_bf16 *y, const bt_bf16 *a, const bt_bf16 *b, int64_t n,
                                cudaStream_t stream)
{
    BT_CU_REFUSE(BT_ERR_INVALID, n < 0 || (n > 0 && (!y || !a || !b)));
    if (n == 0)
        return BT_OK;
    add_bf16_kernel<<<bt_grid_for(n, 256), 256, 0, stream>>>(y, a, b, n);
    BT_LAUNCH_CHECK();
    return BT_OK;
}
__global__ void scale_bf16_kernel(bt_bf16 *x, int64_t n, float s)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        x[i] = __float2bfloat16_rn(__bfloat162float(x[i]) * s);
}
extern "C" int bt_cuda_scale_bf16(bt_bf16 *x, int64_t n, float s, cudaStream_t stream)
{
    BT_CU_REFUSE(BT_ERR_INVALID, n < 0 || (n > 0 && !x));
    if (n == 0)
        return BT_OK;
    scale_bf16_kernel<<<bt_grid_for(n, 256), 256, 0, stream>>>(x, n, s);
    BT_LAUNCH_CHECK();
    return BT_OK;
}
