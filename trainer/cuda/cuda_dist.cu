/* Data-parallel training across processes, one per GPU (../../../shared/DESIGN.md: "all-reduce
 * only the LoRA gradients with NCCL"): the NCCL communicator of a bt_cuda_trainer and the few
 * collectives train.c needs. API and semantics: cuda_trainer.h ("Data-parallel"). NCCL calls are
 * enqueued on the trainer's stream, so they are ordered after the backward that produced the
 * gradients and before the clip + AdamW that read them; NCCL's ring/tree all-reduce hands every
 * rank the same bits, so every rank's AdamW update (and so its weights) stays identical. */
#include "trainer/cuda/cuda_trainer_internal.h"

#include <cstring>

static int btc_nccl_(bt_cuda_trainer *t, ncclResult_t r, const char *what, const char *file, int line)
{
    if (r == ncclSuccess)
        return 0;
    if (t)
        t->comm_failed = 1;
    const char *last = t && t->comm ? ncclGetLastError(t->comm) : ncclGetLastError(nullptr);
    return bt_fail(BT_ERR_IO, "nccl: %s:%d: %s: %s%s%s", file, line, what, ncclGetErrorString(r),
                   last && *last ? ": " : "", last ? last : "");
}
#define BTC_NCCL(t, call) btc_nccl_((t), (call), #call, __FILE__, __LINE__)

extern "C" int bt_cuda_dist_unique_id(uint8_t id[BT_CUDA_DIST_ID_BYTES])
{
    static_assert(sizeof(ncclUniqueId) == BT_CUDA_DIST_ID_BYTES, "ncclUniqueId size");
    ncclUniqueId u;
    BTC_TRY(BTC_NCCL(nullptr, ncclGetUniqueId(&u)));
    memcpy(id, &u, sizeof u);
    return 0;
}

extern "C" int bt_cuda_device_for_local_rank(int local_rank, int *device)
{
    char reason[256] = "";
    const int n = bt_cuda_device_count(reason, sizeof reason);
    if (n <= 0)
        return bt_fail(BT_ERR_IO, "cuda: no usable CUDA device (%s)", reason);
    if (local_rank < 0)
        return bt_fail(BT_ERR_INVALID, "cuda: local rank %d", local_rank);
    if (n == 1) { /* one visible GPU per task (srun --gpus-per-task=1 sets CUDA_VISIBLE_DEVICES) */
        *device = 0;
        return 0;
    }
    if (local_rank >= n)
        return bt_fail(BT_ERR_INVALID, "cuda: local rank %d but this process sees only %d GPUs "
                       "(one process per GPU: start at most %d ranks on this node, or give each "
                       "its own GPU with CUDA_VISIBLE_DEVICES / --gpus-per-task=1)",
                       local_rank, n, n);
    *device = local_rank;
    return 0;
}

extern "C" int bt_cuda_trainer_dist_init(bt_cuda_trainer *t, const uint8_t id[BT_CUDA_DIST_ID_BYTES],
                                         int rank, int world)
{
    if (!t || world < 1 || rank < 0 || rank >= world)
        return bt_fail(BT_ERR_INVALID, "cuda: dist init: rank %d of %d", rank, world);
    if (t->comm)
        return bt_fail(BT_ERR_INVALID, "cuda: dist init: already initialised");
    t->rank = rank;
    t->world = world;
    if (world == 1)
        return 0;
    BTC_TRY(BTC_CUDA(cudaSetDevice(t->dev)));
    BTC_TRY(btc_alloc(t, (void **)&t->d_red, BTC_DIST_MAX_SUM * sizeof(double), "all-reduce scratch"));
    BTC_TRY(btc_alloc(t, (void **)&t->d_gather, (size_t)world * BTC_DIST_MAX_GATHER,
                      "all-gather scratch"));
    ncclUniqueId u;
    memcpy(&u, id, sizeof u);
    ncclComm_t c = nullptr;
    BTC_TRY(BTC_NCCL(t, ncclCommInitRank(&c, world, u, rank)));
    t->comm = c;
    return 0;
}

void btc_dist_free(bt_cuda_trainer *t)
{
    if (!t->comm)
        return;
    if (t->comm_failed)
        ncclCommAbort(t->comm);
    else
        ncclCommDestroy(t->comm);
    t->comm = nullptr;
}

extern "C" int bt_cuda_trainer_allreduce_grads(bt_cuda_trainer *t)
{
    if (!t->comm || t->n_params == 0)
        return 0;
    return BTC_NCCL(t, ncclAllReduce(t->g, t->g, (size_t)t->n_params, ncclFloat32, ncclSum, t->comm,
                                     t->stream));
}

extern "C" int bt_cuda_trainer_allreduce_sum(bt_cuda_trainer *t, double *vals, int n)
{
    if (n < 0 || n > BTC_DIST_MAX_SUM)
        return bt_fail(BT_ERR_INVALID, "cuda: all-reduce of %d values (at most %d)", n,
                       BTC_DIST_MAX_SUM);
    if (!t->comm || n == 0)
        return 0;
    const size_t b = (size_t)n * sizeof(double);
    BTC_TRY(BTC_CUDA(cudaMemcpyAsync(t->d_red, vals, b, cudaMemcpyHostToDevice, t->stream)));
    BTC_TRY(BTC_NCCL(t, ncclAllReduce(t->d_red, t->d_red, (size_t)n, ncclFloat64, ncclSum, t->comm,
                                      t->stream)));
    BTC_TRY(BTC_CUDA(cudaMemcpyAsync(vals, t->d_red, b, cudaMemcpyDeviceToHost, t->stream)));
    return BTC_CUDA(cudaStreamSynchronize(t->stream));
}

extern "C" int bt_cuda_trainer_allgather(bt_cuda_trainer *t, const void *mine, void *all, size_t bytes)
{
    if (bytes > BTC_DIST_MAX_GATHER)
        return bt_fail(BT_ERR_INVALID, "cuda: all-gather of %zu bytes per rank (at most %d)", bytes,
                       BTC_DIST_MAX_GATHER);
    if (!t->comm) {
        memmove(all, mine, bytes);
        return 0;
    }
    uint8_t *mine_d = t->d_gather + (size_t)t->rank * bytes; /* in place: NCCL's own slot */
    BTC_TRY(BTC_CUDA(cudaMemcpyAsync(mine_d, mine, bytes, cudaMemcpyHostToDevice, t->stream)));
    BTC_TRY(BTC_NCCL(t, ncclAllGather(mine_d, t->d_gather, bytes, ncclUint8, t->comm, t->stream)));
    BTC_TRY(BTC_CUDA(cudaMemcpyAsync(all, t->d_gather, (size_t)t->world * bytes,
                                     cudaMemcpyDeviceToHost, t->stream)));
    return BTC_CUDA(cudaStreamSynchronize(t->stream));
}
