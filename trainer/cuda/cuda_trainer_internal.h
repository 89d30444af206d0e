/* Private structures shared by trainer/cuda/ .cu files (C++/CUDA only). */
#ifndef BT_TRAINER_CUDA_INTERNAL_H
#define BT_TRAINER_CUDA_INTERNAL_H
#ifndef __CUDACC__
#error "trainer/cuda/cuda_trainer_internal.h is for .cu files"
#endif
extern "C" {
#include "common/bt_common.h"
#include "trainer/backend/plan.h"
#include "trainer/backend/profile.h"
#include "trainer/model/rng.h"
}
#include "kernels/cuda/kernels_cuda.h"
#include "trainer/cuda/cuda_trainer.h"

#include <nccl.h>

#include <cstdio>
#include <vector>

/* Report a CUDA / cuBLAS error through bt_fail (BT_ERR_IO). */
static inline int btc_cuda_(cudaError_t e, const char *what, const char *file, int line)
{
    if (e == cudaSuccess)
        return 0;
    return bt_fail(BT_ERR_IO, "cuda: %s:%d: %s: %s", file, line, what, cudaGetErrorString(e));
}
#define BTC_CUDA(call) btc_cuda_((call), #call, __FILE__, __LINE__)
/* `trainer train --profile` on the GPU (trainer/backend/profile.h): while a step is profiled,
 * btc_prof_cur points at its state and every BTC_L launch is bracketed by two CUDA events recorded
 * on the step's stream; bt_cuda_trainer_step turns them into per-op times after it synchronises. */
struct btc_prof_rec {
    const char *what; /* the launch expression (#call) */
    cudaEvent_t a, b;
};
struct btc_prof_state {
    cudaStream_t stream;
    std::vector<btc_prof_rec> recs;
};
extern thread_local btc_prof_state *btc_prof_cur;
static inline int btc_prof_begin_(void)
{
    if (btc_prof_cur) {
        btc_prof_rec r = {nullptr, nullptr, nullptr};
        if (cudaEventCreate(&r.a) == cudaSuccess && cudaEventRecord(r.a, btc_prof_cur->stream) == cudaSuccess)
            btc_prof_cur->recs.push_back(r);
        else if (r.a)
            cudaEventDestroy(r.a);
    }
    return 0;
}
/* A launcher (kernels/cuda) returned non-zero: wrap its bt_last_error() into a message naming the
 * call site. */
static inline int btc_launch_(int rc, const char *what, const char *file, int line)
{
    if (btc_prof_cur && !btc_prof_cur->recs.empty() && !btc_prof_cur->recs.back().what) {
        btc_prof_rec &r = btc_prof_cur->recs.back();
        r.what = what;
        if (cudaEventCreate(&r.b) != cudaSuccess || cudaEventRecord(r.b, btc_prof_cur->stream) != cudaSuccess)
            r.what = nullptr; /* dropped when the step resolves the events */
    }
    if (rc == 0)
        return 0;
    return bt_fail(rc, "cuda: %s:%d: %s returned %d: %s", file, line, what, rc,
                   bt_last_error_in("cuda"));
}
#define BTC_L(call) btc_launch_((btc_prof_begin_(), (call)), #call, __FILE__, __LINE__)
#define BTC_TRY(x)         \
    do {                   \
        int rc_ = (x);     \
        if (rc_)           \
            return rc_;    \
    } while (0)

/* One frozen linear on the device: NF4 (q), the GGUF file's own ggml blocks (g; GGUF-native
 * base) or dense bf16 (w16); optional fp32 bias. */
typedef struct {
    int rows, cols, is_nf4, is_gguf;
    bt_cuda_nf4 q;
    bt_cuda_ggml g;
    bt_bf16 *w16;
    float *bias;
} btc_linear;

/* dist.shard_base: this rank's shard of one frozen linear (cuda_model.cu), cut at its storage
 * format's units (trainer/backend/plan.h bt_shard_cut: NF4 double-quantisation groups, GGUF or
 * bf16 rows; never re-quantised). */
typedef struct {
    bt_shard_cut cut;
    uint8_t *data;   /* device: segment s's [cut.per x cut.unit[s]] bytes, one after another */
    int64_t goff[3]; /* where segment s goes in a gathered layer buffer (256-byte aligned) */
    float offset;    /* NF4: the absmax offset */
    int gtype;       /* GGUF blocks: the ggml type; -1: bf16 rows; NF4: unused */
} btc_shard;

typedef struct {
    bt_llama_hparams hp;
    int tied;
    /* dist.shard_base (shard_world > 1): lin[] keeps shapes, flags and biases but no weights; each
     * linear's weights are shards[i] (this rank's 1/W), all-gathered per layer into a buffer of
     * gather_bytes (cuda_dist.cu btc_shard_layer) whose views replace lin[] while it runs */
    int shard_rank, shard_world;
    btc_shard *shards;    /* [L * BT_MOD_N], NULL when not sharded */
    int64_t gather_bytes; /* the largest layer's linears as gathered */
    size_t shard_bytes;   /* this rank's base bytes (the shards) */
    size_t lin_bytes;     /* device bytes of the base linears (and their biases), sharded or not */
    float *code8;         /* device [256]: the NF4 absmax code map of the gathered views */
    bt_bf16 *embd16;   /* [V, D] */
    bt_bf16 *head16;   /* [V, D]; == embd16 when tied */
    float *norms;      /* [(2L+1) * D] fp32: layer l input_layernorm at 2l*D, post_attention at
                        * (2l+1)*D, final norm at 2L*D (the bt_lora.norms layout) */
    float *qk_norms;   /* [2L * head_dim] fp32 when hp.qk_norm (Qwen3 / Gemma 3 q_norm, k_norm; frozen):
                        * layer l's q_norm at 2l*hd, k_norm at (2l+1)*hd; else NULL */
    float *post_norms; /* [2L * D] fp32 when hp.sandwich_norm (Gemma 3 post_attention_layernorm,
                        * post_feedforward_layernorm; frozen) at 2l*D, (2l+1)*D; else NULL */
    float *inv_local;  /* [hd/2] the local (sliding-window) layers' RoPE table (bt_model
                        * inv_freq_local, Gemma 3's rope_local_base_freq); else NULL */
    btc_linear *lin;   /* [L * BT_MOD_N] */
    int64_t max_nk;    /* largest rows*cols of a linear (dequantisation buffer) */
    size_t bytes;
} btc_model;

/* cuda_model.cu */
/* shard_world > 1: keep only rank shard_rank's shard of every base linear (dist.shard_base). */
int btc_model_upload(btc_model *dm, const bt_model *m, int random_weights, uint64_t seed,
                     int shard_rank, int shard_world);
/* The gathered view of linear mod of a layer whose shards fill `buf` (gather_bytes bytes). */
void btc_shard_view(const btc_model *dm, int l, int mod, uint8_t *buf, btc_linear *out);
void btc_model_free(btc_model *dm);
/* y[m, n] += bias[n] (bf16 y [M, N], fp32 bias) */
int btc_add_bias(bt_bf16 *y, const float *bias, int M, int N, cudaStream_t s);

/* per-layer activations (bf16 unless noted) */
typedef struct {
    bt_bf16 *xn1, *q, *k, *v, *att, *x2, *xn2, *g, *u;
    float *rstd1, *rstd2, *lse;
    bt_bf16 *xa[BT_MOD_N]; /* X @ A^T per targeted module [M, r] */
    /* QK-norm (hp.qk_norm) only: q / k before the per-head RMSNorm [M, Dq] / [M, Dkv] and its
     * rstd [M * Hq] / [M * Hkv]; sandwich norms (hp.sandwich_norm) only: o_proj's and down_proj's
     * outputs before their RMSNorm [M, D] and its rstd [M] (step.c layer_acts) */
    bt_bf16 *qr, *kr, *ao, *fo;
    float *rq, *rk, *rpa, *rpf;
} btc_acts;

/* a LoRA module's place in the parameter buffer (offsets in elements; -1 = not targeted) */
typedef struct {
    int64_t offA, offB;
    int in, out;
    int group; /* bt_lora_mod.group: the dropout key's module (Phi-3's fused q/k/v, gate/up share
                * one mask and one A) */
} btc_lmod;

struct bt_cuda_trainer {
    struct bt_prof *prof; /* bt_cuda_trainer_set_profile (NULL = off) */
    int dev;
    char dev_name[256];
    cudaStream_t stream;
    cublasHandle_t blas;
    btc_model md;
    int max_M, ckpt, ce_chunk;
    int attn_impl, base_matmul_impl; /* bt_cuda_trainer_opts */
    int s2_group;            /* S^2-Attn group of training passes (0: full attention) */
    /* offload (opts.offload, with ckpt): layer inputs in pinned host memory h_xin [L+1][max_M*D];
     * on the device xbuf[0..1] hold the inputs of the layers in flight (layer l's in
     * xbuf[l % 2]) and xbuf[2] takes the output of a layer recomputed in backward; copies run on
     * copy_stream, ordered by ev_out[l] (layer l's output is ready / its buffer is free again) and
     * ev_copy[l] (the copy that fills or drains layer input l is done) */
    int offload;
    bt_bf16 *xbuf[3];
    bt_bf16 *h_xin;
    cudaStream_t copy_stream;
    std::vector<cudaEvent_t> ev_out, ev_copy;
    int L, D, Dq, Dkv, F, V, Hq, Hkv, hd, r;
    float scale, dropout;
    unsigned target_mask, trainable;
    int64_t n_params, n_decay, off_embed, off_norms; /* off_*: -1 when absent */
    std::vector<btc_lmod> lmods;                      /* [L * BT_MOD_N] */
    /* LoRA state (device) */
    float *p, *g, *m, *v;
    bt_bf16 *p16;
    bt_cuda_adamw_tensor *adam_desc; /* device [2] */
    bt_cuda_adamw_tensor h_desc[2];  /* host copy (the weight decay of [0] is set per call) */
    float desc_wd;                   /* weight decay in the uploaded descriptors (-1: none yet) */
    int n_adam;
    int64_t adam_max_n;
    double *d_norm, *d_partial, *d_loss;
    int *d_count;
    /* activations */
    bt_bf16 **x_in; /* [L + 1] of [M, D] */
    std::vector<btc_acts> acts;
    bt_bf16 *xf, *h, *dx, *dx2, *dxn, *dtmp, *dq, *dk, *dv, *datt, *dg, *du, *dh, *dxa, *xd;
    bt_bf16 *wbuf;
    float *rstdf, *row_loss, *delta, *rms_scratch;
    void *ce_ws;
    int32_t *d_ids, *d_pos, *d_cu, *d_tgt;
    float *d_inv_freq; /* [hd/2] RoPE inverse frequencies (NULL: derived from rope_theta) */
    float *d_rope_dyn; /* [hd/2] the step's table for dynamic NTK scaling (else unused) */
    std::vector<float> h_inv_freq; /* host copy of the model's table (dynamic NTK: the base) */
    std::vector<int32_t> h_tgt;
    double *h_loss; /* pinned [1] */
    std::vector<void *> allocs;
    size_t bytes, base_used, peak_used;
    size_t plan_bytes, host_bytes; /* the step's memory plan: device bytes allocated for it
                                    * (trainer/backend/plan.h), pinned host bytes (offload) */
    /* data-parallel (cuda_dist.cu): NULL comm = one process */
    ncclComm_t comm;
    int rank, world, comm_failed; /* comm_failed: an NCCL call failed (free aborts, not waits) */
    bt_cuda_hooks hooks;          /* bt_cuda_trainer_set_hooks (zeroed: none) */
    double *d_red;                /* [BTC_DIST_MAX_SUM] all-reduce scratch */
    uint8_t *d_gather;            /* [world * BTC_DIST_MAX_GATHER] all-gather scratch */
    /* dist.shard_base (md.shards): two layer buffers (plan BT_BUF_GATHER); a layer's shards are
     * all-gathered on gather_stream into a slot, the next layer's while this one computes */
    uint8_t *gbuf[2];
    btc_linear glin[2][BT_MOD_N]; /* the views of the layer in each slot */
    int g_layer[2];               /* the layer a slot holds (-1: none) */
    int g_pending;                /* the slot whose gather is issued and not yet waited for, or -1 */
    int g_cur;                    /* the slot of the layer that runs */
    cudaStream_t gather_stream;
    cudaEvent_t g_free[2];        /* on stream: the last layer that read the slot is done */
    /* preference log-prob passes (cuda_logprobs.cu) */
    int adapter_off;              /* 1 during a reference pass: base only (no LoRA, no LoRA+) */
    const bt_microbatch *lp_mb;   /* the training log-prob pass awaiting its backward, or NULL */
    float *d_roww;                /* [max_M] dlogp rows (plan BT_BUF_ROW_W; NULL without
                                   * opts.preference) */
};
/* cuda_dist.cu, dist.shard_base: make layer l's linears resident (wait for its gather, or issue and
 * wait), then issue the gather of layer `next` (-1: none) into the other slot without waiting:
 * it runs on gather_stream while layer l computes. btc_lin then returns layer l's views. */
int btc_shard_layer(bt_cuda_trainer *t, int l, int next);
/* cuda_dist.cu: after layer l's work is enqueued: its slot may be refilled once it is done. */
int btc_shard_done(bt_cuda_trainer *t);
/* Linear mod of layer l: the model's, or with dist.shard_base the gathered view (NULL when layer
 * l is not resident: a bug, refused by the caller). */
static inline const btc_linear *btc_lin(const bt_cuda_trainer *t, int l, int mod)
{
    if (!t->md.shards)
        return &t->md.lin[l * BT_MOD_N + mod];
    for (int s = 0; s < 2; s++)
        if (t->g_layer[s] == l && t->g_pending != s)
            return &t->glin[s][mod];
    return nullptr;
}
#define BTC_DIST_MAX_SUM 16
#define BTC_DIST_MAX_GATHER 512

/* cuda_dist.cu: tear down the NCCL communicator (bt_cuda_trainer_free) */
void btc_dist_free(bt_cuda_trainer *t);
/* cuda_dist.cu: the hooks' check (0 without hooks): cuda_step.cu asks it between layers */
int btc_check(bt_cuda_trainer *t);

/* cuda_step.cu, the step in parts (bt_cuda_trainer_step runs them in this order; the preference
 * passes of cuda_logprobs.cu put their own lm_head pass between forward and backward):
 *   btc_step_attn: *ap <- the attention parameters of mb (S^2-Attn when backward), the dynamic
 *     NTK table uploaded if the model scales so (no batch upload);
 *   btc_step_forward: upload mb (ids, positions, cu_seqlens, t->h_tgt as targets), btc_step_attn,
 *     embedding, every layer, the final norm into t->xf (keeping what backward needs when
 *     `backward`); asynchronous;
 *   btc_step_backward: from dLoss/dxf in t->dtmp (bf16 [M, D]) through the final norm, every
 *     layer and a trainable embedding; gradients accumulate into t->g; asynchronous;
 *   btc_step_sync: wait for the stream (and the offload copies after a training pass).
 * btc_head16 / btc_dhead: the lm_head the pass uses (LoRA+ tied embedding unless adapter_off) and
 * its gradient (NULL when it is frozen). */
int btc_step_attn(bt_cuda_trainer *t, const bt_microbatch *mb, int backward, int M,
                  bt_cuda_attn_params *ap);
int btc_step_forward(bt_cuda_trainer *t, const bt_microbatch *mb, int backward, uint64_t drop_key,
                     int M, bt_cuda_attn_params *ap);
int btc_step_backward(bt_cuda_trainer *t, int M, const bt_cuda_attn_params *ap, uint64_t drop_key);
int btc_step_sync(bt_cuda_trainer *t, int backward);
const bt_bf16 *btc_head16(const bt_cuda_trainer *t);
float *btc_dhead(const bt_cuda_trainer *t);
/* After a profiled pass has synchronised: its launches' times into t->prof (the op names
 * bt_cuda_trainer_step gives them), the events freed. */
void btc_prof_resolve(bt_cuda_trainer *t, btc_prof_state *ps);

/* cuda_step.cu: device allocation owned by the trainer (freed by bt_cuda_trainer_free) */
int btc_alloc(bt_cuda_trainer *t, void **p, size_t bytes, const char *what);
/* cuda_optim.cu: fill the AdamW descriptors (after the plan's p, g, m, v, p16, adam_desc exist) */
int btc_optim_init(bt_cuda_trainer *t);

#endif
