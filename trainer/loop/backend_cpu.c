/* The CPU backend (trainer/backend/backend.h): the fp32 reference step of trainer/loop/step.c and
 * clip + AdamW on the host (trainer/loop/optim.c bt_clip_grad_norm, kernels/cpu/optim.c
 * bt_adamw_step) over the caller's bt_lora, which it trains in place. One process only: no
 * collectives (data-parallel training needs device "cuda"). */
#include <math.h>
#include <stdlib.h>

#include "common/bt_common.h"
#include "kernels/kernels.h"
#include "trainer/backend/backend.h"
#include "trainer/backend/profile.h"
#include "trainer/loop/optim.h"
#include "trainer/loop/step.h"

typedef struct {
    bt_step_ctx *ctx;
    const bt_model *m;
    bt_lora *lo;
    bt_prof *prof; /* set_profile: the clip and AdamW are timed too */
    int (*check)(void *);
    void *check_arg;
} cpu_backend;

static const bt_backend_i k_cpu_iface;

static cpu_backend *cpu_of(const bt_backend *b) { return (cpu_backend *)b->context; }

static void cpu_free(bt_backend *b) {
    bt_step_ctx_free(cpu_of(b)->ctx);
    free(b->context);
    free(b);
}

static size_t cpu_bytes(const bt_backend *b) { return bt_step_ctx_bytes(cpu_of(b)->ctx); }

static int cpu_zero_grad(bt_backend *b) {
    bt_lora_zero_grad(cpu_of(b)->lo);
    return 0;
}

static int cpu_step(bt_backend *b, const bt_microbatch *mb, int backward, float grad_scale,
                    uint64_t drop_key, double *loss_sum, int *n_valid) {
    cpu_backend *c = cpu_of(b);
    return bt_forward_backward(c->ctx, c->m, c->lo, mb, backward, grad_scale, drop_key, loss_sum,
                               n_valid);
}

/* The preference passes: step.h bt_forward_logprobs (policy == 0: the reference, adapter off)
 * and bt_backward_logprobs. */
static int cpu_logprobs(bt_backend *b, const bt_microbatch *mb, int policy, int backward,
                        uint64_t drop_key, float *logp, int *n_valid) {
    cpu_backend *c = cpu_of(b);
    return bt_forward_logprobs(c->ctx, c->m, policy ? c->lo : NULL, mb, backward, drop_key, logp,
                               n_valid);
}

static int cpu_backward_logprobs(bt_backend *b, const bt_microbatch *mb, const float *dlogp,
                                 uint64_t drop_key) {
    cpu_backend *c = cpu_of(b);
    return bt_backward_logprobs(c->ctx, c->m, c->lo, mb, dlogp, drop_key);
}

/* torch clip_grad_norm_ then AdamW: the LoRA (+ embedding) block [0, n_decay) with weight decay,
 * the LoRA+ norm weights after it without (lora.h); then every parameter must be finite. */
static int cpu_update(bt_backend *b, const bt_backend_update *u, double *grad_norm,
                      int64_t *bad_param) {
    cpu_backend *c = cpu_of(b);
    bt_lora *lo = c->lo;
    *bad_param = -1;
    double t_clip = bt_now();
    const double gnorm = bt_clip_grad_norm(lo->grads, lo->n_params, u->max_norm);
    bt_prof_add(c->prof, "clip grad norm", bt_now() - t_clip, 0.0);
    *grad_norm = gnorm;
    if (u->skip || !isfinite(gnorm)) return 0;
    double t_opt = bt_now();
    bt_adamw_step(lo->params, lo->grads, lo->m, lo->v, lo->n_decay, u->lr, u->beta1, u->beta2,
                  u->eps, u->weight_decay, u->step);
    const int64_t nd = lo->n_decay;
    if (lo->n_params > nd)
        bt_adamw_step(lo->params + nd, lo->grads + nd, lo->m + nd, lo->v + nd, lo->n_params - nd,
                      u->lr, u->beta1, u->beta2, u->eps, 0.f, u->step);
    bt_prof_add(c->prof, "adamw", bt_now() - t_opt, 4.0 * 3.0 * (double)lo->n_params);
    size_t at = 0;
    if (!bt_all_finite_f32(lo->params, (size_t)lo->n_params, &at)) *bad_param = (int64_t)at;
    return 0;
}

static void cpu_set_profile(bt_backend *b, bt_prof *p) {
    cpu_of(b)->prof = p;
    bt_step_ctx_set_profile(cpu_of(b)->ctx, p);
}

/* A backend around a new step context of max_M tokens; ckpt: activation checkpointing. */
static int cpu_new(bt_backend **out, const bt_model *m, bt_lora *lo, int max_M, int ckpt,
                   int (*check)(void *), void *check_arg) {
    *out = NULL;
    bt_backend *b = calloc(1, sizeof *b);
    cpu_backend *c = calloc(1, sizeof *c);
    if (!b || !c) {
        free(b);
        free(c);
        return bt_fail(BT_ERR_NOMEM, "out of memory");
    }
    c->m = m;
    c->lo = lo;
    c->check = check;
    c->check_arg = check_arg;
    b->iface = &k_cpu_iface;
    b->context = c;
    int rc = bt_step_ctx_new(&c->ctx, m, lo, max_M, ckpt);
    if (rc) {
        cpu_free(b);
        return rc;
    }
    /* a stop request lands before every layer */
    bt_step_ctx_set_check(c->ctx, check, check_arg);
    *out = b;
    return 0;
}

/* Held-out evaluation at a length past the run's workspace: one row of max_M tokens in a
 * forward-only context of its own (activation checkpointing keeps it small). */
static int cpu_eval_workspace(bt_backend *b, int max_M, bt_backend **out) {
    cpu_backend *c = cpu_of(b);
    return cpu_new(out, c->m, c->lo, max_M, 1, c->check, c->check_arg);
}

static const bt_backend_i k_cpu_iface = {
    .free = cpu_free,
    .bytes = cpu_bytes,
    .device_memory = NULL, /* host memory: peak RSS */
    .zero_grad = cpu_zero_grad,
    .step = cpu_step,
    .update = cpu_update,
    .allreduce_grads = NULL, /* one process */
    .allreduce_sum = NULL,
    .allgather = NULL,
    .abort = NULL,
    .sync_lora = NULL, /* the host bt_lora is the live state */
    .set_profile = cpu_set_profile,
    .eval_workspace = cpu_eval_workspace,
    .logprobs = cpu_logprobs,
    .backward_logprobs = cpu_backward_logprobs,
};

static int cpu_init(bt_backend **out, const bt_backend_params *p) {
    const bt_train_config *cfg = p->cfg;
    int rc = cpu_new(out, p->model, p->lora, p->max_M, cfg->activation_checkpointing, p->check,
                     p->hook_arg);
    if (rc) return rc;
    cpu_backend *c = cpu_of(*out);
    if ((rc = bt_step_set_s2(c->ctx, p->s2_group))) {
        cpu_free(*out);
        *out = NULL;
        return rc;
    }
    bt_log(BT_LOG_INFO, "trainer", "workspace for %dx%d tokens: %.0f MiB%s",
           cfg->data.micro_batch_size, cfg->data.seq_len, bt_step_ctx_bytes(c->ctx) / 1048576.0,
           cfg->activation_checkpointing ? (cfg->checkpointing_auto ? " (activation checkpointing: "
                                            "auto, seq_len >= checkpointing_min_seq_len)"
                                                                    : " (activation checkpointing)")
                                         : "");
    return 0;
}

const bt_backend_reg bt_backend_cpu_reg = {
    .name = "cpu",
    .device = BT_DEVICE_CPU,
    .init = cpu_init,
    .dist_unique_id = NULL, /* one process only */
    .sliding_window = 1,    /* kernels/cpu/attention.c bt_attn_fwd_win / bt_attn_bwd_win */
};
