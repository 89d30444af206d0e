/* dtype conversions and the residual add of the CUDA backend, and the device count: fp32 <-> bf16
 * (round to nearest even), y = a + b in bf16. Contracts: kernels/cuda/kernels_cuda.h. The CPU
 * backend has no counterpart file: it is fp32 throughout (common/ converts bf16/fp16 files). */
#include "kernels/cuda/cuda_internal.h"

extern "C" int bt_cuda_device_count(char *reason, size_t reason_len)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        if (reason && reason_len)
            snprintf(reason, reason_len, "cudaGetDeviceCount: %s", cudaGetErrorString(e));
        cudaGetLastError();
        return 0;
    }
    if (n == 0 && reason && reason_len)
        snprintf(reason, reason_len, "cudaGetDeviceCount returned 0 devices");
    return n;
}

__global__ void f32_to_bf16_kernel(bt_bf16 *out, const float *in, int64_t n)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        out[i] = __float2bfloat16_rn(in[i]);
}
__global__ void bf16_to_f32_kernel(float *out, const bt_bf16 *in, int64_t n)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        out[i] = __bfloat162float(in[i]);
}
__global__ void add_bf16_kernel(bt_bf16 *y, const bt_bf16 *a, const bt_bf16 *b, int64_t n)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        y[i] = __float2bfloat16_rn(__bfloat162float(a[i]) + __bfloat162float(b[i]));
}
extern "C" int bt_cuda_f32_to_bf16(bt_bf16 *out, const float *in, int64_t n, cudaStream_t stream)
{
    if (n < 0 || (n > 0 && (!out || !in)))
        return BT_CU_ERR_INVALID;
    if (n == 0)
        return BT_CU_OK;
    f32_to_bf16_kernel<<<bt_grid_for(n, 256), 256, 0, stream>>>(out, in, n);
    BT_LAUNCH_CHECK();
    return BT_CU_OK;
}
extern "C" int bt_cuda_bf16_to_f32(float *out, const bt_bf16 *in, int64_t n, cudaStream_t stream)
{
    if (n < 0 || (n > 0 && (!out || !in)))
        return BT_CU_ERR_INVALID;
    if (n == 0)
        return BT_CU_OK;
    bf16_to_f32_kernel<<<bt_grid_for(n, 256), 256, 0, stream>>>(out, in, n);
    BT_LAUNCH_CHECK();
    return BT_CU_OK;
}
extern "C" int bt_cuda_add_bf16(bt_bf16 *y, const bt_bf16 *a, const bt_bf16 *b, int64_t n,
                                cudaStream_t stream)
{
    if (n < 0 || (n > 0 && (!y || !a || !b)))
        return BT_CU_ERR_INVALID;
    if (n == 0)
        return BT_CU_OK;
    add_bf16_kernel<<<bt_grid_for(n, 256), 256, 0, stream>>>(y, a, b, n);
    BT_LAUNCH_CHECK();
    return BT_CU_OK;
}
