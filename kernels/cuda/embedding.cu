/* Embedding lookup and its backward (a trainable table) of the CUDA backend. Contracts:
 * kernels/cuda/kernels_cuda.h; the fp32 reference is kernels/cpu/embedding.c. */
#include "kernels/cuda/cuda_internal.h"

__global__ void embedding_fwd_kernel(bt_bf16 *out, const bt_bf16 *table, const int32_t *ids, int M,
                                     int D, int V)
{
    const int64_t total = (int64_t)M * D;
    for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < total;
         t += (int64_t)gridDim.x * blockDim.x) {
        const int64_t m = t / D;
        const int d = (int)(t % D);
        const int32_t id = ids[m];
        out[t] = (id >= 0 && id < V) ? table[(int64_t)id * D + d] : __float2bfloat16_rn(0.0f);
    }
}
__global__ void embedding_bwd_kernel(float *dtable, const bt_bf16 *dout, const int32_t *ids, int M,
                                     int D, int V)
{
    const int64_t total = (int64_t)M * D;
    for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < total;
         t += (int64_t)gridDim.x * blockDim.x) {
        const int64_t m = t / D;
        const int d = (int)(t % D);
        const int32_t id = ids[m];
        if (id >= 0 && id < V)
            atomicAdd(dtable + (int64_t)id * D + d, __bfloat162float(dout[t]));
    }
}
extern "C" int bt_cuda_embedding_fwd(bt_bf16 *out, const bt_bf16 *table, const int32_t *ids, int M,
                                     int D, int V, cudaStream_t stream)
{
    BT_CU_REFUSE(BT_ERR_INVALID, !out || !table || !ids || M < 0 || D <= 0 || V <= 0);
    if (M == 0)
        return BT_OK;
    embedding_fwd_kernel<<<bt_grid_for((int64_t)M * D, 256), 256, 0, stream>>>(out, table, ids, M, D, V);
    BT_LAUNCH_CHECK();
    return BT_OK;
}
extern "C" int bt_cuda_embedding_bwd(float *dtable, const bt_bf16 *dout, const int32_t *ids, int M,
                                     int D, int V, cudaStream_t stream)
{
    BT_CU_REFUSE(BT_ERR_INVALID, !dtable || !dout || !ids || M < 0 || D <= 0 || V <= 0);
    if (M == 0)
        return BT_OK;
    embedding_bwd_kernel<<<bt_grid_for((int64_t)M * D, 256), 256, 0, stream>>>(dtable, dout, ids, M, D, V);
    BT_LAUNCH_CHECK();
    return BT_OK;
}
