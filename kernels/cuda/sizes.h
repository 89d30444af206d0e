/* Workspace sizes of the CUDA launchers (kernels/cuda/kernels_cuda.h), as plain C with no CUDA
 * header: the launchers, the GPU trainer (trainer/cuda/) and the memory plan that `trainer
 * estimate` reads on a machine without CUDA (trainer/backend/plan.h) compute them from this one
 * place. Every function is pure arithmetic on its arguments; none fails. */
#ifndef BT_KERNELS_CUDA_SIZES_H
#define BT_KERNELS_CUDA_SIZES_H
#include <stddef.h>
#include <stdint.h>

/* Elements each block of the deterministic sum of squares (optim.cu bt_cuda_sumsq) reduces. */
#define BT_CUDA_SUMSQ_CHUNK 16384
/* Most blocks the RMSNorm backward's weight gradient uses (norm.cu: fixed row ranges, so the
 * partial sums are reduced in a fixed order). */
#define BT_CUDA_RMS_BWD_MAX_BLOCKS 512
/* sizeof(bt_cuda_adamw_tensor) (kernels_cuda.h; optim.cu checks it with a static_assert): five
 * device pointers, an int64 count and a float, padded to 8 bytes. */
#define BT_CUDA_ADAMW_DESC_BYTES 56

/* Doubles of the `partial` scratch of bt_cuda_sumsq over n values: ceil(n / BT_CUDA_SUMSQ_CHUNK),
 * at least 1. */
static inline size_t bt_cuda_sumsq_scratch(int64_t n)
{
    return n <= 0 ? 1 : (size_t)((n + BT_CUDA_SUMSQ_CHUNK - 1) / BT_CUDA_SUMSQ_CHUNK);
}

/* Floats of the `scratch` of bt_cuda_rmsnorm_bwd with a weight gradient over [M, D] rows:
 * min(M, BT_CUDA_RMS_BWD_MAX_BLOCKS) x D partial sums; 0 for M or D <= 0. */
static inline size_t bt_cuda_rmsnorm_bwd_scratch_floats(int M, int D)
{
    if (M <= 0 || D <= 0)
        return 0;
    return (size_t)(M < BT_CUDA_RMS_BWD_MAX_BLOCKS ? M : BT_CUDA_RMS_BWD_MAX_BLOCKS) * (size_t)D;
}

/* Bytes of the workspace bt_cuda_linear_ce needs for chunk_rows rows of a vocabulary of V:
 * chunk_rows x V fp32 logits (rounded up to 256 bytes, so the bf16 part stays aligned) +
 * chunk_rows x V bf16 dlogits; 0 for chunk_rows or V <= 0. */
static inline size_t bt_cuda_linear_ce_workspace_bytes(int chunk_rows, int V)
{
    if (chunk_rows <= 0 || V <= 0)
        return 0;
    const size_t n = (size_t)chunk_rows * (size_t)V;
    return ((n * 4 + 255) / 256) * 256 + n * 2;
}

#endif
