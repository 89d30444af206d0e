/* Data-parallel training across processes, one per GPU, all-reducing only the trainable gradients
 * (docs/ARCHITECTURE.md §Parallel): the NCCL communicator of a bt_cuda_trainer and the few
 * collectives train.c needs. API and semantics: cuda_trainer.h ("Data-parallel"). NCCL calls are
 * enqueued on the trainer's stream, so they are ordered after the backward that produced the
 * gradients and before the clip + AdamW that read them; NCCL's ring/tree all-reduce hands every
 * rank the same bits, so every rank's AdamW update (and so its weights) stays identical.
 *
 * A rank that dies or stalls never hangs the others: the communicator is non-blocking
 * (ncclConfig_t.blocking = 0) and every wait is NCCL's fault-tolerance loop (NCCL User Guide,
 * "Fault Tolerance": poll cudaStreamQuery and ncclCommGetAsyncError instead of blocking in
 * cudaStreamSynchronize; on an error, ncclCommAbort), extended with the trainer's hooks
 * (bt_cuda_trainer_set_hooks: a stop request, or another rank's failure as trainer/parallel/dist_monitor.h
 * reports it, naming the rank) and a timeout. NCCL itself does not notice a peer that dies or is
 * stopped within one node: the hooks and the timeout are what end such a wait. */
#include "trainer/cuda/cuda_trainer_internal.h"

#include <cstring>
#include <ctime>

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

extern "C" void bt_cuda_trainer_set_hooks(bt_cuda_trainer *t, const bt_cuda_hooks *h)
{
    if (h)
        t->hooks = *h;
    else
        memset(&t->hooks, 0, sizeof t->hooks);
}

int btc_check(bt_cuda_trainer *t)
{
    return t->hooks.check ? t->hooks.check(t->hooks.arg) : 0;
}

static double btc_now()
{
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Give up on the communicator: ncclCommAbort ends NCCL work still waiting for peers (the stream
 * then drains); the trainer has no communicator afterwards (collectives fail, free is a no-op). */
static void btc_dist_abort(bt_cuda_trainer *t)
{
    if (t->comm)
        ncclCommAbort(t->comm);
    t->comm = nullptr;
    t->comm_failed = 1;
}

/* NCCL reported `r` for `what`: abort, and fail with the hooks' explanation when they have one
 * within 2 s (the other rank that died or asked to stop, named by the monitor; a relayed stop
 * keeps BT_ERR_CANCELLED), else with NCCL's own message. */
static int btc_dist_failed(bt_cuda_trainer *t, ncclResult_t r, const char *what)
{
    char nccl[600];
    const char *last = t->comm ? ncclGetLastError(t->comm) : ncclGetLastError(nullptr);
    snprintf(nccl, sizeof nccl, "nccl: %s: %s%s%s", what, ncclGetErrorString(r), last && *last ? ": " : "",
             last ? last : "");
    btc_dist_abort(t);
    for (const double until = btc_now() + 2.0; t->hooks.check && btc_now() < until;) {
        const int rc = btc_check(t);
        if (rc)
            return bt_fail(rc, "%s (%s)", bt_last_error(), nccl);
        const timespec ts = {0, 10000000};
        nanosleep(&ts, nullptr);
    }
    return bt_fail(BT_ERR_IO, "%s", nccl);
}

/* NCCL's fault-tolerance loop for the call `what` just issued (it returned `issued`): until the
 * trainer's stream is idle (with_stream) or, for the init, until ncclCommGetAsyncError leaves
 * ncclInProgress. Each round: an NCCL error, the hooks' check, and the timeout
 * (bt_cuda_hooks.timeout_s, counted from here) end the wait with ncclCommAbort. Sleeps grow from
 * 50 us to 2 ms, so a quick collective costs little and a long wait little CPU. */
static int btc_dist_wait_on(bt_cuda_trainer *t, ncclResult_t issued, const char *what, cudaStream_t stream,
                            int with_stream);
static int btc_dist_wait(bt_cuda_trainer *t, ncclResult_t issued, const char *what, int with_stream)
{
    return btc_dist_wait_on(t, issued, what, t->stream, with_stream);
}

/* btc_dist_wait on `stream` (with_stream) instead of the trainer's. */
static int btc_dist_wait_on(bt_cuda_trainer *t, ncclResult_t issued, const char *what, cudaStream_t stream,
                            int with_stream)
{
    if (issued != ncclSuccess && issued != ncclInProgress)
        return btc_dist_failed(t, issued, what);
    if (t->hooks.collective)
        t->hooks.collective(t->hooks.arg, 1);
    const double t0 = btc_now(), limit = t->hooks.timeout_s;
    long sleep_ns = 50000;
    int rc = 0;
    for (;;) {
        ncclResult_t st = ncclSuccess;
        const ncclResult_t q = ncclCommGetAsyncError(t->comm, &st);
        if (q != ncclSuccess || (st != ncclSuccess && st != ncclInProgress)) {
            rc = btc_dist_failed(t, q != ncclSuccess ? q : st, what);
            break;
        }
        if (st == ncclSuccess) {
            if (!with_stream)
                break;
            const cudaError_t e = cudaStreamQuery(stream);
            if (e == cudaSuccess)
                break;
            if (e != cudaErrorNotReady) {
                btc_dist_abort(t);
                rc = BTC_CUDA(e);
                break;
            }
        }
        if ((rc = btc_check(t))) { /* a stop request, or another rank failed: abandon the call */
            btc_dist_abort(t);
            rc = bt_fail(rc, "%s (while in %s)", bt_last_error(), what);
            break;
        }
        if (limit > 0 && btc_now() - t0 > limit) {
            btc_dist_abort(t);
            rc = bt_fail(BT_ERR_TIMEOUT, "nccl: %s did not complete within %.0f s (dist.timeout_s): a rank "
                         "stopped taking part; communicator aborted", what, limit);
            break;
        }
        const timespec ts = {0, sleep_ns};
        nanosleep(&ts, nullptr);
        if (sleep_ns < 2000000)
            sleep_ns += sleep_ns / 2;
    }
    if (t->hooks.collective)
        t->hooks.collective(t->hooks.arg, 0);
    return rc;
}

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
    const int n = bt_cuda_device_count();
    if (n <= 0)
        return bt_fail(BT_ERR_IO, "cuda: no usable CUDA device (%s)", bt_last_error());
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
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0; /* every wait below is ours: abortable, with a timeout */
    ncclComm_t c = nullptr;
    const ncclResult_t r = ncclCommInitRankConfig(&c, world, u, rank, &cfg);
    t->comm = c; /* valid while the init is in progress (NCCL's non-blocking mode) */
    return btc_dist_wait(t, r, "ncclCommInitRankConfig (every rank joins)", 0);
}

/* A clean end flushes the communicator (ncclCommFinalize; non-blocking: polled, at most 60 s) then
 * destroys it; after a failure, or when the flush fails, it is aborted (never waits on a peer). */
void btc_dist_free(bt_cuda_trainer *t)
{
    if (!t->comm)
        return;
    if (!t->comm_failed) {
        ncclResult_t r = ncclCommFinalize(t->comm), st = r;
        for (const double until = btc_now() + 60; r == ncclInProgress || st == ncclInProgress;) {
            if (ncclCommGetAsyncError(t->comm, &st) != ncclSuccess || btc_now() > until) {
                st = ncclInternalError;
                break;
            }
            r = ncclSuccess;
            const timespec ts = {0, 1000000};
            nanosleep(&ts, nullptr);
        }
        if (st == ncclSuccess) {
            ncclCommDestroy(t->comm);
            t->comm = nullptr;
            return;
        }
    }
    btc_dist_abort(t);
}

extern "C" void bt_cuda_trainer_dist_abort(bt_cuda_trainer *t)
{
    if (t && t->comm)
        btc_dist_abort(t);
}

/* The communicator, or a failure when an earlier error aborted it (world > 1). */
static int btc_dist_ready(bt_cuda_trainer *t, const char *what)
{
    if (t->comm)
        return 0;
    return bt_fail(BT_ERR_IO, "nccl: %s on a communicator that was aborted after an earlier error", what);
}

extern "C" int bt_cuda_trainer_allreduce_grads(bt_cuda_trainer *t)
{
    if (t->world == 1 || t->n_params == 0)
        return 0;
    BTC_TRY(btc_dist_ready(t, "ncclAllReduce (LoRA gradients)"));
    return btc_dist_wait(t, ncclAllReduce(t->g, t->g, (size_t)t->n_params, ncclFloat32, ncclSum, t->comm,
                                          t->stream), "ncclAllReduce (LoRA gradients)", 1);
}

extern "C" int bt_cuda_trainer_allreduce_sum(bt_cuda_trainer *t, double *vals, int n)
{
    if (n < 0 || n > BTC_DIST_MAX_SUM)
        return bt_fail(BT_ERR_INVALID, "cuda: all-reduce of %d values (at most %d)", n,
                       BTC_DIST_MAX_SUM);
    if (t->world == 1 || n == 0)
        return 0;
    BTC_TRY(btc_dist_ready(t, "ncclAllReduce (step totals)"));
    const size_t b = (size_t)n * sizeof(double);
    BTC_TRY(BTC_CUDA(cudaMemcpyAsync(t->d_red, vals, b, cudaMemcpyHostToDevice, t->stream)));
    BTC_TRY(btc_dist_wait(t, ncclAllReduce(t->d_red, t->d_red, (size_t)n, ncclFloat64, ncclSum, t->comm,
                                           t->stream), "ncclAllReduce (step totals)", 1));
    BTC_TRY(BTC_CUDA(cudaMemcpyAsync(vals, t->d_red, b, cudaMemcpyDeviceToHost, t->stream)));
    return BTC_CUDA(cudaStreamSynchronize(t->stream));
}

extern "C" int bt_cuda_trainer_allgather(bt_cuda_trainer *t, const void *mine, void *all, size_t bytes)
{
    if (bytes > BTC_DIST_MAX_GATHER)
        return bt_fail(BT_ERR_INVALID, "cuda: all-gather of %zu bytes per rank (at most %d)", bytes,
                       BTC_DIST_MAX_GATHER);
    if (t->world == 1) {
        memmove(all, mine, bytes);
        return 0;
    }
    BTC_TRY(btc_dist_ready(t, "ncclAllGather (loader states)"));
    uint8_t *mine_d = t->d_gather + (size_t)t->rank * bytes; /* in place: NCCL's own slot */
    BTC_TRY(BTC_CUDA(cudaMemcpyAsync(mine_d, mine, bytes, cudaMemcpyHostToDevice, t->stream)));
    BTC_TRY(btc_dist_wait(t, ncclAllGather(mine_d, t->d_gather, bytes, ncclUint8, t->comm, t->stream),
                          "ncclAllGather (loader states)", 1));
    BTC_TRY(BTC_CUDA(cudaMemcpyAsync(all, t->d_gather, (size_t)t->world * bytes,
                                     cudaMemcpyDeviceToHost, t->stream)));
    return BTC_CUDA(cudaStreamSynchronize(t->stream));
}

/* ---- dist.shard_base: the all-gather of a layer's base linears (FSDP's unshard + prefetch) ---- */

/* Issue the all-gather of layer l's shards into slot `slot` on gather_stream, after the slot's
 * last reader is done (g_free); not waited for. One ncclAllGather per segment of every linear
 * (bytes, in place of nothing: each rank sends its own shard), grouped. */
static int shard_issue(bt_cuda_trainer *t, int l, int slot)
{
    char what[96];
    snprintf(what, sizeof what, "ncclAllGather (layer %d base, dist.shard_base)", l);
    BTC_TRY(btc_dist_ready(t, what));
    BTC_TRY(BTC_CUDA(cudaStreamWaitEvent(t->gather_stream, t->g_free[slot], 0)));
    t->g_layer[slot] = l;
    t->g_pending = slot;
    ncclResult_t r = ncclGroupStart();
    for (int mod = 0; mod < BT_MOD_N && (r == ncclSuccess || r == ncclInProgress); mod++) {
        const btc_shard &sh = t->md.shards[l * BT_MOD_N + mod];
        const uint8_t *src = sh.data;
        for (int g = 0; g < sh.cut.nseg && (r == ncclSuccess || r == ncclInProgress); g++) {
            const size_t n = (size_t)(sh.cut.per * sh.cut.unit[g]);
            r = ncclAllGather(src, t->gbuf[slot] + sh.goff[g], n, ncclUint8, t->comm, t->gather_stream);
            src += n;
        }
        btc_shard_view(&t->md, l, mod, t->gbuf[slot], &t->glin[slot][mod]);
    }
    const ncclResult_t e = ncclGroupEnd();
    if (r == ncclSuccess || r == ncclInProgress)
        r = e;
    if (r != ncclSuccess && r != ncclInProgress) {
        t->g_layer[slot] = -1;
        t->g_pending = -1;
        return btc_dist_failed(t, r, what);
    }
    return 0;
}

/* Wait for the pending gather (the fault-tolerant wait of every collective: a dead or stopped
 * rank is named by the watchdog's check, the timeout ends it). */
static int shard_wait(bt_cuda_trainer *t)
{
    if (t->g_pending < 0)
        return 0;
    char what[96];
    snprintf(what, sizeof what, "ncclAllGather (layer %d base, dist.shard_base)", t->g_layer[t->g_pending]);
    const int slot = t->g_pending;
    const int rc = btc_dist_wait_on(t, ncclSuccess, what, t->gather_stream, 1);
    if (rc) {
        t->g_layer[slot] = -1;
        t->g_pending = -1;
        return rc;
    }
    t->g_pending = -1;
    return 0;
}

int btc_shard_layer(bt_cuda_trainer *t, int l, int next)
{
    if (!t->md.shards)
        return 0;
    int slot = t->g_layer[0] == l ? 0 : t->g_layer[1] == l ? 1 : -1;
    if (slot < 0) { /* not prefetched: into the slot the last layer did not use */
        BTC_TRY(shard_wait(t));
        slot = 1 - t->g_cur;
        BTC_TRY(shard_issue(t, l, slot));
    }
    if (t->g_pending == slot)
        BTC_TRY(shard_wait(t));
    t->g_cur = slot;
    if (next >= 0 && next < t->L && t->g_layer[0] != next && t->g_layer[1] != next) {
        BTC_TRY(shard_wait(t)); /* one gather in flight at a time */
        BTC_TRY(shard_issue(t, next, 1 - slot));
    }
    return 0;
}

int btc_shard_done(bt_cuda_trainer *t)
{
    if (!t->md.shards)
        return 0;
    return BTC_CUDA(cudaEventRecord(t->g_free[t->g_cur], t->stream));
}
