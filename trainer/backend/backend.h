/* One backend interface for the training step: the run (trainer/loop/train.c, eval.c) calls a
 * table of operations and no backend's own functions, as llama.cpp does through ggml's
 * `ggml_backend_i` (ggml/src/ggml-backend-impl.h: a struct of function pointers plus an opaque
 * context, and a registry entry, `ggml_backend_reg_i`, per kind of backend). Two
 * implementations:
 *   "cpu"   trainer/loop/backend_cpu.c: the fp32 reference step (trainer/loop/step.c) and clip +
 *           AdamW on the host (trainer/loop/optim.c, kernels/cpu/optim.c);
 *   "cuda"  trainer/cuda/backend_cuda.cu: the GPU trainer (trainer/cuda/cuda_trainer.h), bf16
 *           activations, fp32 LoRA state, NCCL collectives between ranks.
 * Both compute the same thing: the loss and LoRA gradients of step.h's bt_forward_backward, and
 * torch's clip_grad_norm_ + AdamW (trainer/cuda/cuda_trainer.h says how closely).
 *
 * Registration: a program holds the backends it was linked with, and no other. The registry
 * (trainer/loop/backends.c, bt_backend_find) holds the CPU backend and refers to the CUDA one
 * through a weak reference: the CUDA trainer links trainer/cuda/backend_cuda.o as an object
 * (`make CUDA=1`, and build/emu/trainer on the emulator), which defines it; a CPU-only trainer
 * has no definition, the reference is NULL, and device "cuda" is refused. No #ifdef in the run,
 * no constructor and no mutable registry, and the include and link arrows run one way: the run
 * -> the registry -> the implementations -> this interface.
 *
 * Conventions: every operation returns 0 or a negative bt_err with bt_last_error() set (CUDA /
 * NCCL failures are BT_ERR_IO), unless its comment says otherwise. One backend is used from one
 * host thread at a time. The model and the host LoRA state (bt_lora) are the caller's and must
 * outlive the backend. */
#ifndef BT_TRAINER_BACKEND_H
#define BT_TRAINER_BACKEND_H
#include <stddef.h>
#include <stdint.h>

#include "trainer/backend/microbatch.h"
#include "trainer/config.h"
#include "trainer/model/lora.h"
#include "trainer/model/model.h"

#ifdef __cplusplus
extern "C" {
#endif

struct bt_prof;
typedef struct bt_backend bt_backend;

/* The opaque id rank 0 makes for the others before any backend exists (an ncclUniqueId). */
#define BT_BACKEND_DIST_ID_BYTES 128

/* What a backend is created with (bt_backend_reg.init). */
typedef struct {
    const bt_train_config *cfg; /* activation_checkpointing (+ checkpointing_auto), data.seq_len x
                                 * micro_batch_size (for the log line), cuda.*, dist.timeout_s and
                                 * dist.heartbeat_timeout_s */
    const bt_model *model;      /* the frozen base (borrowed) */
    bt_lora *lora;              /* the host LoRA state (borrowed): the CPU backend trains it in
                                 * place; the GPU one uploads it and sync_lora copies it back */
    int max_M;                  /* tokens per micro-batch the workspace holds (B * T) */
    int s2_group;               /* LongLoRA S^2-Attn group of training passes (0 = full) */
    int rank, world, local_rank;
    const uint8_t *dist_id;     /* [BT_BACKEND_DIST_ID_BYTES] rank 0's id (bt_backend_reg.
                                 * dist_unique_id, handed out by the rendezvous); read when
                                 * world > 1 */
    /* The run's hooks (all optional): check(arg) is asked before every layer of a pass and in
     * every collective wait, and a non-zero result (a negative bt_err) abandons the pass or the
     * collective and is returned; collective(arg, entering) says when a collective wait starts
     * (1) and ends (0), for the watchdog (trainer/parallel/dist_monitor.h). */
    int (*check)(void *arg);
    void (*collective)(void *arg, int entering);
    void *hook_arg;
} bt_backend_params;

/* One optimiser update (update op): clip to max_norm, then AdamW with these hyper-parameters
 * (torch.optim.AdamW semantics; weight decay only on the LoRA / embedding block [0, n_decay) of
 * bt_lora, none on the LoRA+ norm weights after it). step is 1-based (bias correction). skip != 0
 * (no labelled token, a non-finite loss): measure the norm, change no parameter. */
typedef struct {
    double max_norm; /* <= 0: no clipping */
    float lr, beta1, beta2, eps, weight_decay;
    int64_t step;
    int skip;
} bt_backend_update;

/* The operations. Optional ones (NULL) have the meaning their wrapper below gives. */
typedef struct bt_backend_i {
    /* Release everything the backend holds. */
    void (*free)(bt_backend *b);
    /* Bytes held by the backend (CPU: the step context's activations and workspace; GPU: model
     * copy + LoRA state + workspace on the device). */
    size_t (*bytes)(const bt_backend *b);
    /* Device memory: *held (what bytes says) and *peak (peak in use by the process); NULL: the
     * backend uses host memory only (peak RSS tells it). */
    void (*device_memory)(const bt_backend *b, size_t *held, size_t *peak);
    /* Zero the LoRA (and LoRA+) gradients. */
    int (*zero_grad)(bt_backend *b);
    /* Forward, and backward when `backward`, of one micro-batch: step.h bt_forward_backward's
     * contract (bt_shift_targets' checks and errors; drop_key 0 = no dropout; gradients of
     * grad_scale * loss_sum ACCUMULATE; *loss_sum = sum of token losses in nats, *n_valid =
     * labelled targets, either may be NULL; the check hook's error abandons the micro-batch). */
    int (*step)(bt_backend *b, const bt_microbatch *mb, int backward, float grad_scale,
                uint64_t drop_key, double *loss_sum, int *n_valid);
    /* Clip + AdamW (bt_backend_update). *grad_norm = the pre-clip global norm (double
     * accumulation); a non-finite norm applies nothing. *bad_param = the index of the first
     * parameter that is not finite after the update, -1 when all are or when the backend does
     * not look (GPU). */
    int (*update)(bt_backend *b, const bt_backend_update *u, double *grad_norm, int64_t *bad_param);
    /* Data-parallel collectives, called only with world > 1, by every rank at the same point
     * (NULL: a backend that runs one process only). allreduce_grads: in-place SUM of the LoRA
     * gradients; allreduce_sum: vals[0..n) (n <= 16) summed; allgather: all[r * bytes ..) <- rank
     * r's mine (bytes <= 512); abort: give the communicator up without waiting (peers may be gone;
     * later collectives fail). */
    int (*allreduce_grads)(bt_backend *b);
    int (*allreduce_sum)(bt_backend *b, double *vals, int n);
    int (*allgather)(bt_backend *b, const void *mine, void *all, size_t bytes);
    void (*abort)(bt_backend *b);
    /* Bring the host bt_lora given at creation up to date: parameters, and the AdamW moments when
     * `moments` (before a save). NULL: the host state is the live one. */
    int (*sync_lora)(bt_backend *b, int moments);
    /* Profile every op of the following step calls into p (trainer/backend/profile.h; NULL =
     * off). */
    void (*set_profile)(bt_backend *b, struct bt_prof *p);
    /* *out <- a backend over the same model and LoRA for forward-only passes of up to max_M
     * tokens (a held-out length past the run's workspace), with the same check hook; freed with
     * bt_backend_free. A backend whose workspace cannot grow fails saying so (the message names
     * the config keys to change). */
    int (*eval_workspace)(bt_backend *b, int max_M, bt_backend **out);
    /* Preference training (trainer/loop/pref_step.h), step.h bt_forward_logprobs /
     * bt_backward_logprobs' contract: logprobs writes logp[M] (the label log-prob of every
     * labelled shifted target, 0 elsewhere) of the policy (adapter on; with `backward` the pass
     * keeps what backward_logprobs needs) or, policy == 0, of the reference (adapter off, never
     * with backward); backward_logprobs accumulates the LoRA gradients of sum_t dlogp[t] * logp[t]
     * and must directly follow logprobs with backward on the same mb and drop_key. NULL: a backend
     * without these passes: a preference objective is refused (both "cpu" and "cuda" have them;
     * the GPU's are trainer/cuda/cuda_logprobs.cu). */
    int (*logprobs)(bt_backend *b, const bt_microbatch *mb, int policy, int backward,
                    uint64_t drop_key, float *logp, int *n_valid);
    int (*backward_logprobs)(bt_backend *b, const bt_microbatch *mb, const float *dlogp,
                             uint64_t drop_key);
} bt_backend_i;

/* A backend: its operations and its own state. */
struct bt_backend {
    const bt_backend_i *iface;
    void *context;
};

/* A registry entry: one kind of backend. */
typedef struct bt_backend_reg {
    const char *name; /* the config's device name: "cpu", "cuda" */
    int device;       /* BT_DEVICE_* (trainer/config.h) */
    /* Create the backend (it logs one line saying what it holds). */
    int (*init)(bt_backend **out, const bt_backend_params *p);
    /* Data-parallel start-up, before any backend exists: rank 0's id for the others. NULL: this
     * backend runs one process only. */
    int (*dist_unique_id)(uint8_t id[BT_BACKEND_DIST_ID_BYTES]);
    /* 1 when the backend's step applies the model's sliding-window attention on the layers that
     * have one (bt_model_layer_window: Gemma 3's local layers, Mistral / Phi-3 sliding_window),
     * 0 when its attention is full causal only: rows longer than the window are then refused
     * (bt_model_check_window) rather than trained on the wrong attention. */
    int sliding_window;
} bt_backend_reg;

/* The CPU backend's entry (trainer/loop/backend_cpu.c); the CUDA one, bt_backend_cuda_reg, is
 * defined by trainer/cuda/backend_cuda.cu and only the registry refers to it. */
extern const bt_backend_reg bt_backend_cpu_reg;

/* The registry (trainer/loop/backends.c): this program's backend for `device` (BT_DEVICE_*), or
 * NULL when it was built without it. */
const bt_backend_reg *bt_backend_find(int device);
/* *reg <- bt_backend_find(device); a device this program was built without is
 * BT_ERR_UNSUPPORTED: 'config: device: "cuda": this trainer was built without CUDA (make
 * CUDA=1)'. */
int bt_backend_get(int device, const bt_backend_reg **reg);

/* The operations, NULL-safe where the op is optional (ggml_backend_* style wrappers). */
void bt_backend_free(bt_backend *b); /* NULL: no-op */
size_t bt_backend_bytes(const bt_backend *b);
/* 1 and *held / *peak for a device backend; 0 (and both 0) for a host one. */
int bt_backend_device_memory(const bt_backend *b, size_t *held, size_t *peak);
int bt_backend_zero_grad(bt_backend *b);
int bt_backend_step(bt_backend *b, const bt_microbatch *mb, int backward, float grad_scale,
                    uint64_t drop_key, double *loss_sum, int *n_valid);
int bt_backend_update_params(bt_backend *b, const bt_backend_update *u, double *grad_norm,
                             int64_t *bad_param);
/* Collectives: no-ops (0) for a backend without them (one process). */
int bt_backend_allreduce_grads(bt_backend *b);
int bt_backend_allreduce_sum(bt_backend *b, double *vals, int n);
/* Without the op: all <- mine (one rank). */
int bt_backend_allgather(bt_backend *b, const void *mine, void *all, size_t bytes);
void bt_backend_abort(bt_backend *b); /* NULL b or op: no-op */
int bt_backend_sync_lora(bt_backend *b, int moments);
void bt_backend_set_profile(bt_backend *b, struct bt_prof *p);
int bt_backend_eval_workspace(bt_backend *b, int max_M, bt_backend **out);
/* 1 when the backend has the preference log-prob passes (logprobs and backward_logprobs). */
int bt_backend_has_logprobs(const bt_backend *b);
/* The log-prob passes; a backend without them: BT_ERR_UNSUPPORTED naming it. */
int bt_backend_logprobs(bt_backend *b, const bt_microbatch *mb, int policy, int backward,
                        uint64_t drop_key, float *logp, int *n_valid);
int bt_backend_backward_logprobs(bt_backend *b, const bt_microbatch *mb, const float *dlogp,
                                 uint64_t drop_key);

#ifdef __cplusplus
}
#endif
#endif
