/* The GPU (CUDA) trainer: the same forward/backward as trainer/loop/step.c and the same clip + AdamW
 * as the CPU backend (trainer/loop/backend_cpu.c), on one CUDA device, built only with
 * `make CUDA=1` / `make cuda` (trainer/cuda/ .cu files, kernels/cuda launchers). The run reaches
 * it through the CUDA backend (trainer/cuda/backend_cuda.cu, trainer/backend/backend.h).
 *
 * Numerics (docs/ARCHITECTURE.md §Numerics): activations and the frozen base are bf16 (NF4
 * linears stay NF4 and are dequantised to bf16 per layer; GGUF-native linears stay in their ggml
 * blocks likewise (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; F16/BF16/F32 ones are held as
 * bf16);
 * fp32 base linears are held as bf16),
 * norm weights fp32, accumulation fp32; LoRA master weights, their gradients and the AdamW moments
 * fp32 (with a bf16 copy of the LoRA weights that the AdamW kernel refreshes). The CPU fp32 step
 * (trainer/loop/step.h) is the reference: tests/gpu/test_trainer_gpu.cu checks loss and LoRA gradients.
 *
 * Semantics mirrored exactly from step.c / lora.c / backend_cpu.c:
 *   - targets: bt_shift_targets (labels unshifted; shift inside each row and cu_seqlens segment);
 *   - loss: SUM of token losses; gradients are d(grad_scale * loss_sum) and ACCUMULATE into the
 *     device gradient buffer until bt_cuda_trainer_zero_grad;
 *   - dropout: the counter-based mask of lora.c (bt_lora_drop_key per (layer, module); element i of
 *     the row-major [M, in] LoRA input keeps iff 16-bit u_i >= round(p * 65536)), so CPU and GPU
 *     drop the same elements for the same key;
 *   - LoRA+ (bt_lora.trainable): trainable embedding and norm weights are supported (their
 *     gradients as in step.c; weight decay only on [0, n_decay));
 *   - RoPE: the model's table (bt_model.inv_freq, context extension included), for dynamic NTK
 *     the table of the micro-batch's longest position (bt_model_rope_table, uploaded per step);
 *     the softmax scale bt_model_attn_scale (YaRN's attention factor); S^2-Attn on training
 *     passes only (opts.s2_group), as bt_step_set_s2.
 * All functions return 0 or a negative bt_err (common/bt_common.h) with bt_last_error() set; CUDA /
 * cuBLAS failures are BT_ERR_IO. One trainer must be used from one host thread at a time. */
#ifndef BT_TRAINER_CUDA_TRAINER_H
#define BT_TRAINER_CUDA_TRAINER_H
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif
#include "trainer/model/lora.h"
#include "trainer/model/model.h"
#include "trainer/backend/microbatch.h"

typedef struct bt_cuda_trainer bt_cuda_trainer;

typedef struct {
    int checkpointing;   /* 1 = activation checkpointing (keep each layer's input, recompute) */
    int ce_chunk_rows;   /* rows per fused lm_head + CE chunk; 0 = min(1024, max_M) */
    int device;          /* CUDA device ordinal (default 0) */
    int attn_impl;       /* 0 = wmma attention (bt_cuda_attn_fwd/bwd), 1 = mma.sync attention
                          * (bt_cuda_attn_fwd_mma/bwd_mma); config cuda.attention */
    int base_matmul_impl; /* the matmuls against a quantised base, NF4 and GGUF-native alike
                           * (config cuda.base_matmul, alias cuda.nf4_matmul): 0 = dequantise +
                           * cuBLAS (bt_cuda_nf4_linear_fwd/bwd_x, bt_cuda_ggml_linear_*), 1 = fused
                           * GEMM (bt_cuda_nf4_gemm_fwd/bwd_x, bt_cuda_ggml_gemm_*; no
                           * dequantisation buffer) */
    int s2_group;        /* LongLoRA S^2-Attn group for training passes (bt_cuda_attn_params
                          * s2_group; 0 = full attention); evaluation passes use full attention */
    int offload;         /* with checkpointing: keep the checkpointed layer inputs in pinned host
                          * memory; the device holds three [max_M, d_model] buffers instead of
                          * n_layer + 1. Each layer's output is copied out on a second stream while
                          * the next layer computes, and in backward the input of layer l-1 is
                          * copied in while layer l's backward runs (events order the reuse of
                          * the buffers). Same results as without (config cuda.offload_checkpoints) */
    /* Benchmarks only: do not read the model's weights (m may then hold only hp, tied and each
     * layer's lin[].rows/cols/is_nf4); fill the device with deterministic random weights of the
     * right shapes instead (NF4 codes with |w| ~ 0.02, bf16 embeddings ~ N(0, 0.02^2)-like,
     * norms 1). */
    int random_weights;
    uint64_t random_seed;
    /* dist.shard_base: with shard_world W > 1 this rank (shard_rank) keeps its 1/W shard of
     * every base linear (trainer/backend/plan.h bt_shard_cut) and each layer is all-gathered over
     * NCCL before it runs (bt_cuda_trainer_dist_init must be called with the same rank and W
     * before the first step); needs the model's weights (not random_weights) */
    int shard_rank, shard_world;
    /* a preference objective: the plan adds the dlogp rows bt_cuda_trainer_backward_logprobs
     * uploads (without it that call is refused; the forward log-prob pass works either way) */
    int preference;
} bt_cuda_trainer_opts;

/* Upload the model (NF4 linears as NF4; fp32 linears, embedding and lm_head as bf16; norms and
 * biases fp32) and the LoRA state (params, grads zeroed, AdamW m and v: so a resumed run continues
 * from the host moments), and allocate the workspace for micro-batches of up to max_M tokens.
 * lo must stay valid (layout only) for the trainer's lifetime. Requirements checked here (else
 * BT_ERR_UNSUPPORTED with a message): head_dim 64 or 128 (or 256 with the wmma attention);
 * d_model % 8 == 0; NF4 linears have cols % 64 == 0; GGUF-native linears have a type with a CUDA
 * decoder or F16/BF16/F32 (others are refused naming the supported types and base_dtype "nf4");
 * Gemma 3 (BT_ARCH_GEMMA3) only where the GPU attention applies sliding windows
 * (bt_backend_cuda_reg.sliding_window), else refused naming the family; trainable norms (LoRA+
 * "norm") not with sandwich norms (as the CPU step). A model's sliding window
 * (bt_model_layer_window) is applied per layer. The families' pieces run as step.c runs them:
 * Qwen2's q/k/v biases, QK-norm (Qwen3, Gemma 3), Phi-3's fused LoRA groups (one A and one dropout
 * mask per group), Gemma's post-norms, GeGLU, embedding scale and local RoPE table. Errors also:
 * BT_ERR_NOMEM (device memory; the message gives the sizes), BT_ERR_IO (no device / CUDA error). */
int bt_cuda_trainer_new(bt_cuda_trainer **out, const bt_model *m, const bt_lora *lo, int max_M,
                        const bt_cuda_trainer_opts *opts);
void bt_cuda_trainer_free(bt_cuda_trainer *t);

/* Device bytes held by the trainer (model + LoRA state + workspace), and the device name. */
size_t bt_cuda_trainer_bytes(const bt_cuda_trainer *t);
/* Device bytes the trainer allocated for its step (the memory plan, trainer/backend/plan.h
 * bt_plan_step with BT_PLAN_CUDA: LoRA state, optimiser scratch, activations, workspace, batch
 * arrays; not the model's weights nor a data-parallel run's NCCL scratch), and in *host (may be
 * NULL) the pinned host bytes of its offloaded layer inputs. Equal to the plan's totals: `trainer
 * estimate` bills the same plan. 0 for NULL. */
size_t bt_cuda_trainer_plan_bytes(const bt_cuda_trainer *t, size_t *host);
const char *bt_cuda_trainer_device_name(const bt_cuda_trainer *t);

/* Zero the device LoRA (and LoRA+) gradient buffer. */
int bt_cuda_trainer_zero_grad(bt_cuda_trainer *t);

/* Forward (and backward when `backward`) of one micro-batch, as bt_forward_backward (step.h):
 * validates it with bt_shift_targets (same errors), drop_key 0 = no dropout, gradients of
 * grad_scale * loss_sum accumulate. *loss_sum (sum of token losses, nats) and *n_valid (labelled
 * targets) may be NULL. Synchronises with the device once (to return the loss). */
int bt_cuda_trainer_step(bt_cuda_trainer *t, const bt_microbatch *mb, int backward,
                         float grad_scale, uint64_t drop_key, double *loss_sum, int *n_valid);

/* Preference training, step.h bt_forward_logprobs / bt_backward_logprobs' contract on the device
 * (trainer/cuda/cuda_logprobs.cu): bt_cuda_trainer_logprobs writes logp[M] (host fp32, M = B*T:
 * the label log-prob of every labelled shifted target, 0 elsewhere) from the fused chunked
 * lm_head pass (kernels_cuda.h bt_cuda_linear_logprob: no [M x vocab] logits), of the policy
 * (policy != 0: adapter on) or of the reference (policy == 0: the frozen base, LoRA and LoRA+
 * off: TRL's disable_adapter(); never with backward). With `backward` the pass keeps the
 * activations and the unit-upstream gradient d logp / d xf. bt_cuda_trainer_backward_logprobs
 * accumulates the gradients of sum_t dlogp[t] * logp[t] (dlogp host fp32 [M]); it must directly
 * follow a logprobs call with backward on the same mb (else BT_ERR_INVALID), with the same
 * drop_key, and needs opts.preference. A trainable tied lm_head (LoRA+) costs one more vocabulary
 * pass, as on the CPU. Both synchronise with the device. */
int bt_cuda_trainer_logprobs(bt_cuda_trainer *t, const bt_microbatch *mb, int policy, int backward,
                             uint64_t drop_key, float *logp, int *n_valid);
int bt_cuda_trainer_backward_logprobs(bt_cuda_trainer *t, const bt_microbatch *mb,
                                      const float *dlogp, uint64_t drop_key);

/* ||grads||_2 over all n_params gradient entries (double accumulation, deterministic). Synchronous. */
int bt_cuda_trainer_grad_norm(bt_cuda_trainer *t, double *norm);

/* One AdamW step over all trainable parameters in one launch (torch.optim.AdamW semantics as
 * bt_adamw_step): weight_decay applies to [0, n_decay), none to the LoRA+ norm weights after it.
 * grad_scale multiplies every gradient first (the clip factor max_norm / (norm + 1e-6), or 1).
 * step is 1-based (bias correction). Refreshes the bf16 weight copies. Asynchronous. */
int bt_cuda_trainer_optimizer_step(bt_cuda_trainer *t, float lr, float beta1, float beta2,
                                   float eps, float weight_decay, float grad_scale, int64_t step);

/* Clip (torch clip_grad_norm_: factor max_norm / (norm + 1e-6) when max_norm > 0 and
 * norm > max_norm) + AdamW, exactly as trainer/loop/backend_cpu.c does it on the CPU. *grad_norm
 * receives the pre-clip norm. The update is skipped (and *applied = 0) when the norm is not
 * finite or skip != 0; applied / grad_norm may be NULL. */
int bt_cuda_trainer_clip_and_step(bt_cuda_trainer *t, double max_norm, float lr, float beta1,
                                  float beta2, float eps, float weight_decay, int64_t step,
                                  int skip, double *grad_norm, int *applied);

/* Copy device state into the host bt_lora (same layout as the one given to _new):
 * BT_CUDA_DL_PARAMS = params, BT_CUDA_DL_MOMENTS = m and v, BT_CUDA_DL_GRADS = grads (bit mask).
 * Synchronous. _upload_lora copies params (and the bf16 copies), m and v to the device. */
enum { BT_CUDA_DL_PARAMS = 1, BT_CUDA_DL_MOMENTS = 2, BT_CUDA_DL_GRADS = 4 };
int bt_cuda_trainer_download_lora(bt_cuda_trainer *t, bt_lora *lo, unsigned what);
int bt_cuda_trainer_upload_lora(bt_cuda_trainer *t, const bt_lora *lo);

/* Hooks the trainer calls while it works (all optional; arg is passed back):
 *   check(arg): asked between layers of bt_cuda_trainer_step (forward and backward) and in every
 *     round of an NCCL wait: 0 = go on; a negative bt_err (bt_last_error set: BT_ERR_CANCELLED for
 *     a stop request, another code for another rank's failure) abandons the micro-batch (its
 *     gradients are then partial) or the collective (the communicator is aborted: later
 *     collectives fail), and is returned;
 *   collective(arg, entering): 1 when the trainer starts waiting for an NCCL call, 0 when the wait
 *     ends (progress for a watchdog: trainer/parallel/dist_monitor.h);
 *   timeout_s: the longest wait for one NCCL call, init included (> 0; 0 = none), after which the
 *     communicator is aborted (BT_ERR_TIMEOUT naming the call).
 * Called on the thread that calls the trainer. NULL h clears them. */
typedef struct {
    int (*check)(void *arg);
    void (*collective)(void *arg, int entering);
    void *arg;
    double timeout_s;
} bt_cuda_hooks;
void bt_cuda_trainer_set_hooks(bt_cuda_trainer *t, const bt_cuda_hooks *h);

/* Device bytes of the frozen base linears this trainer holds (with dist.shard_base: its shards)
 * and, in *gathered (may be NULL), the bytes of one all-gathered layer (0 when not sharded). */
size_t bt_cuda_trainer_base_bytes(const bt_cuda_trainer *t, size_t *gathered);

/* ---- Data-parallel: one process per GPU, NCCL (trainer/cuda/cuda_dist.cu) ----
 * Start-up: rank 0 makes the id (bt_cuda_dist_unique_id) and hands it to every rank
 * (trainer/parallel/dist.h bt_dist_rendezvous); each rank picks its GPU (bt_cuda_device_for_local_rank ->
 * bt_cuda_trainer_opts.device), creates its trainer, then bt_cuda_trainer_dist_init (collective:
 * blocks until all `world` ranks have called it). Every collective below must be called by every
 * rank in the same order (NCCL semantics). Each call waits NCCL's fault-tolerant way (non-blocking
 * communicator; cudaStreamQuery + ncclCommGetAsyncError polling, ncclCommAbort on an error, on
 * the hooks' check or on the hooks' timeout), so a rank that dies or stalls never hangs the
 * others: the wait ends with the hook's message (naming the rank) or the timeout's. world 1: no
 * communicator, all of these are local no-ops. NCCL errors are BT_ERR_IO naming the call and
 * NCCL's last error; after one, the communicator is aborted and every later collective fails. */
#define BT_CUDA_DIST_ID_BYTES 128 /* sizeof(ncclUniqueId) */
int bt_cuda_dist_unique_id(uint8_t id[BT_CUDA_DIST_ID_BYTES]);
/* The device ordinal for local rank `local_rank`: 0 when the process sees one GPU (Slurm
 * --gpus-per-task=1), else local_rank; BT_ERR_INVALID when local_rank >= visible GPUs (> 1),
 * BT_ERR_IO when there is none. */
int bt_cuda_device_for_local_rank(int local_rank, int *device);
/* ncclCommInitRankConfig(world, id, rank, non-blocking) on the trainer's device, waiting (as the
 * collectives do, hooks and timeout included) until every rank has joined (world 1: records
 * rank 0 of 1). Set the hooks first. */
int bt_cuda_trainer_dist_init(bt_cuda_trainer *t, const uint8_t id[BT_CUDA_DIST_ID_BYTES], int rank,
                              int world);
/* In-place SUM of the fp32 LoRA gradient buffer over all ranks, on the trainer's stream; returns
 * once it is complete (or failed: see above). Each rank's buffer holds
 * d(grad_scale * its loss_sum) with grad_scale = 1 / (labelled targets of ALL ranks), so the sum
 * is the gradient of the global mean loss: exactly what one process with all ranks' rows
 * computes. */
int bt_cuda_trainer_allreduce_grads(bt_cuda_trainer *t);
/* Give the communicator up without waiting for anyone (ncclCommAbort): after a stop request,
 * when other ranks may already be gone; later collectives fail. NULL or world 1: no-op. */
void bt_cuda_trainer_dist_abort(bt_cuda_trainer *t);
/* vals[0..n) (host fp64, n <= 16) <- their sum over all ranks; synchronous. */
int bt_cuda_trainer_allreduce_sum(bt_cuda_trainer *t, double *vals, int n);
/* all[r * bytes .. +bytes) <- rank r's `mine` (host buffers; bytes <= 512, all holds world *
 * bytes); synchronous. For the checkpoint's per-rank loader states. */
int bt_cuda_trainer_allgather(bt_cuda_trainer *t, const void *mine, void *all, size_t bytes);

/* Peak device memory in use by the process since the trainer was created (cudaMemGetInfo samples
 * taken after each step), in bytes, and the baseline before the trainer allocated anything. */
size_t bt_cuda_trainer_peak_used(const bt_cuda_trainer *t, size_t *baseline);
/* Profile the next bt_cuda_trainer_step calls into p (trainer/backend/profile.h; NULL = off): every
 * kernel / cuBLAS launch of the step is timed with a pair of CUDA events on the trainer's stream
 * and added to p under the launcher's name ("rmsnorm_fwd", "gemm", "attn_fwd", "lora_fwd", ...)
 * once the step has synchronised. p is borrowed and must outlive its use. */
struct bt_prof;
void bt_cuda_trainer_set_profile(bt_cuda_trainer *t, struct bt_prof *p);

#ifdef __cplusplus
}
#endif
#endif
