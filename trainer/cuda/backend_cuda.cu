/* The CUDA backend (trainer/backend/backend.h): the GPU trainer of trainer/cuda/cuda_trainer.h on
 * this rank's device, its stop / collective hooks and NCCL between ranks. bt_backend_cuda_reg is
 * what the registry's weak reference (trainer/loop/backends.c) finds when a program links this
 * object (the CUDA trainer; backend.h, "Registration"). */
#include "trainer/cuda/cuda_trainer.h"

extern "C" {
#include "common/bt_common.h"
#include "trainer/backend/backend.h"
}

#include <cstdlib>
#include <cstring>

static_assert(BT_BACKEND_DIST_ID_BYTES == BT_CUDA_DIST_ID_BYTES, "the NCCL id is the backend's id");

namespace {

struct cuda_backend {
    bt_cuda_trainer *t;
    bt_lora *lo; /* the host LoRA state sync_lora brings up to date */
    int max_M;   /* the workspace's tokens (eval_workspace cannot grow it) */
};

cuda_backend *cuda_of(const bt_backend *b) { return static_cast<cuda_backend *>(b->context); }

void cuda_free(bt_backend *b)
{
    bt_cuda_trainer_free(cuda_of(b)->t);
    free(b->context);
    free(b);
}

size_t cuda_bytes(const bt_backend *b) { return bt_cuda_trainer_bytes(cuda_of(b)->t); }

void cuda_device_memory(const bt_backend *b, size_t *held, size_t *peak)
{
    *held = bt_cuda_trainer_bytes(cuda_of(b)->t);
    *peak = bt_cuda_trainer_peak_used(cuda_of(b)->t, nullptr);
}

int cuda_zero_grad(bt_backend *b) { return bt_cuda_trainer_zero_grad(cuda_of(b)->t); }

int cuda_step(bt_backend *b, const bt_microbatch *mb, int backward, float grad_scale,
              uint64_t drop_key, double *loss_sum, int *n_valid)
{
    return bt_cuda_trainer_step(cuda_of(b)->t, mb, backward, grad_scale, drop_key, loss_sum, n_valid);
}

/* clip + AdamW on the device in one call; the parameters are not read back (bad_param -1) */
int cuda_update(bt_backend *b, const bt_backend_update *u, double *grad_norm, int64_t *bad_param)
{
    *bad_param = -1;
    return bt_cuda_trainer_clip_and_step(cuda_of(b)->t, u->max_norm, u->lr, u->beta1, u->beta2,
                                         u->eps, u->weight_decay, u->step, u->skip, grad_norm,
                                         nullptr);
}

int cuda_allreduce_grads(bt_backend *b) { return bt_cuda_trainer_allreduce_grads(cuda_of(b)->t); }

int cuda_allreduce_sum(bt_backend *b, double *vals, int n)
{
    return bt_cuda_trainer_allreduce_sum(cuda_of(b)->t, vals, n);
}

int cuda_allgather(bt_backend *b, const void *mine, void *all, size_t bytes)
{
    return bt_cuda_trainer_allgather(cuda_of(b)->t, mine, all, bytes);
}

void cuda_abort(bt_backend *b) { bt_cuda_trainer_dist_abort(cuda_of(b)->t); }

int cuda_sync_lora(bt_backend *b, int moments)
{
    return bt_cuda_trainer_download_lora(cuda_of(b)->t, cuda_of(b)->lo,
                                         BT_CUDA_DL_PARAMS | (moments ? BT_CUDA_DL_MOMENTS : 0));
}

void cuda_set_profile(bt_backend *b, struct bt_prof *p) { bt_cuda_trainer_set_profile(cuda_of(b)->t, p); }

/* The preference passes (backend.h logprobs / backward_logprobs): trainer/cuda/cuda_logprobs.cu. */
int cuda_logprobs(bt_backend *b, const bt_microbatch *mb, int policy, int backward,
                  uint64_t drop_key, float *logp, int *n_valid)
{
    return bt_cuda_trainer_logprobs(cuda_of(b)->t, mb, policy, backward, drop_key, logp, n_valid);
}

int cuda_backward_logprobs(bt_backend *b, const bt_microbatch *mb, const float *dlogp,
                           uint64_t drop_key)
{
    return bt_cuda_trainer_backward_logprobs(cuda_of(b)->t, mb, dlogp, drop_key);
}

/* the device workspace is sized once, for data.seq_len x data.micro_batch_size tokens */
int cuda_eval_workspace(bt_backend *b, int max_M, bt_backend **out)
{
    *out = nullptr;
    return bt_fail(BT_ERR_INVALID, "config: eval.lengths: %d tokens exceed the GPU workspace of "
                   "data.seq_len x data.micro_batch_size = %d; raise data.seq_len or drop that "
                   "length", max_M, cuda_of(b)->max_M);
}

const bt_backend_i k_cuda_iface = {
    cuda_free,          cuda_bytes,          cuda_device_memory, cuda_zero_grad,
    cuda_step,          cuda_update,         cuda_allreduce_grads, cuda_allreduce_sum,
    cuda_allgather,     cuda_abort,          cuda_sync_lora,     cuda_set_profile,
    cuda_eval_workspace, cuda_logprobs,       cuda_backward_logprobs,
};

/* The GPU trainer on this rank's device (config cuda.*), its hooks (a collective waits at most
 * dist.timeout_s, plus the time the watchdog needs to name a lost rank first: rank 0's straggler
 * check uses dist.timeout_s itself), then NCCL. On an error the trainer is freed here (given up
 * without waiting for the others after a stop request). */
int cuda_init(bt_backend **out, const bt_backend_params *p)
{
    *out = nullptr;
    const bt_train_config *cfg = p->cfg;
    bt_cuda_trainer_opts co;
    memset(&co, 0, sizeof co);
    co.checkpointing = cfg->activation_checkpointing;
    co.attn_impl = cfg->cuda_attention == BT_CUDA_ATTN_MMA;
    co.base_matmul_impl = cfg->cuda_base_matmul == BT_CUDA_BASE_FUSED;
    co.s2_group = p->s2_group;
    co.offload = cfg->cuda_offload;
    co.preference = cfg->pref_on; /* the log-prob backward's dlogp rows (plan BT_BUF_ROW_W) */
    if (cfg->dist.shard_base && p->world == 1)
        bt_log(BT_LOG_INFO, "trainer", "dist.shard_base: one rank, nothing to shard: the whole base "
               "stays on this GPU");
    if (cfg->dist.shard_base && p->world > 1) {
        co.shard_rank = p->rank;
        co.shard_world = p->world;
    }
    int rc = bt_cuda_device_for_local_rank(p->local_rank, &co.device);
    if (rc)
        return rc;
    bt_cuda_trainer *t = nullptr;
    if ((rc = bt_cuda_trainer_new(&t, p->model, p->lora, p->max_M, &co)))
        return rc;
    bt_cuda_hooks hooks = {p->check, p->collective, p->hook_arg,
                           (double)cfg->dist.timeout_s + cfg->dist.heartbeat_timeout_s};
    bt_cuda_trainer_set_hooks(t, &hooks);
    if ((rc = bt_cuda_trainer_dist_init(t, p->dist_id, p->rank, p->world))) {
        if (rc == BT_ERR_CANCELLED)
            bt_cuda_trainer_dist_abort(t); /* peers may be gone */
        bt_cuda_trainer_free(t);
        return rc;
    }
    bt_backend *b = static_cast<bt_backend *>(calloc(1, sizeof *b));
    cuda_backend *c = static_cast<cuda_backend *>(calloc(1, sizeof *c));
    if (!b || !c) {
        free(b);
        free(c);
        bt_cuda_trainer_free(t);
        return bt_fail(BT_ERR_NOMEM, "out of memory");
    }
    c->t = t;
    c->lo = p->lora;
    c->max_M = p->max_M;
    b->iface = &k_cuda_iface;
    b->context = c;
    if (p->world > 1)
        bt_log(BT_LOG_INFO, "trainer", "NCCL: rank %d of %d on CUDA device %d", p->rank, p->world,
               co.device);
    size_t gathered = 0;
    const size_t lin = bt_cuda_trainer_base_bytes(t, &gathered);
    if (co.shard_world > 1)
        bt_log(BT_LOG_INFO, "trainer", "dist.shard_base: rank %d holds %zu bytes of the base linears "
               "(its 1/%d shard) and gathers each layer into %zu bytes, twice (the next layer's ahead)",
               p->rank, lin, co.shard_world, gathered);
    else
        bt_log(BT_LOG_INFO, "trainer", "base linears: %zu bytes on this GPU", lin);
    bt_log(BT_LOG_INFO, "trainer", "CUDA device %s: model + LoRA + workspace for %dx%d tokens: "
           "%.0f MiB%s; attention %s, NF4 matmul %s", bt_cuda_trainer_device_name(t),
           cfg->data.micro_batch_size, cfg->data.seq_len, bt_cuda_trainer_bytes(t) / 1048576.0,
           cfg->activation_checkpointing ? " (activation checkpointing)" : "",
           co.attn_impl ? "mma" : "wmma", co.base_matmul_impl ? "fused" : "dequant+cuBLAS");
    *out = b;
    return 0;
}

} // namespace

/* sliding_window 1: the attention kernels take the layer's window (bt_cuda_attn_params.window,
 * passed per layer by trainer/cuda/cuda_step.cu) */
extern "C" const bt_backend_reg bt_backend_cuda_reg = {"cuda", BT_DEVICE_CUDA, cuda_init,
                                                       bt_cuda_dist_unique_id, 1};
