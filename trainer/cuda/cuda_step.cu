/* The GPU trainer's forward/backward over one packed micro-batch (step_run) and its workspace
 * (bt_cuda_trainer_new / _free): trainer/loop/step.c on the kernels/cuda launchers (bf16
 * activations, fp32 accumulation). layer_fwd / layer_bwd below follow step.c's op for op; they
 * differ in where RoPE happens (the attention kernels apply it to Q/K as they load them, and
 * return gradients with respect to the unrotated Q/K, so there is no separate RoPE pass), in the
 * storage precision, in the base matmul (a fused GEMM on the NF4 / ggml blocks, or dequantise +
 * cuBLAS), and in the optional offload of the checkpointed layer inputs to host memory. */
#include "common/rng.h"
#include "trainer/cuda/cuda_trainer_internal.h"
extern "C" {
#include "trainer/backend/backend.h"
/* backend_cuda.cu: its sliding_window flag says whether the GPU attention applies windows */
extern const bt_backend_reg bt_backend_cuda_reg;
}

#include <cmath>
#include <cstring>

/* ------------------------------------------------------------------ dropout (lora.c mirror) */

namespace {

/* lora.c apply_dropout: element i keeps iff u = bits [16*(i%4), +16) of
 * hash(key + (i/4) * golden) >= th; kept values are scaled by ks. */
__device__ __forceinline__ bool drop_keep(uint64_t key, int64_t i, uint32_t th)
{
    const uint64_t h = bt_hash64(key + (uint64_t)(i >> 2) * 0x9E3779B97F4A7C15ULL);
    const uint32_t u = (uint32_t)(h >> (16 * (i & 3))) & 0xffffu;
    return u >= th;
}
__global__ void dropout_kernel(bt_bf16 *out, const bt_bf16 *x, int64_t n, uint32_t th, float ks,
                               uint64_t key)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        out[i] = drop_keep(key, i, th) ? __float2bfloat16_rn(__bfloat162float(x[i]) * ks)
                                       : __float2bfloat16_rn(0.0f);
}
/* dx[i] += mask_i * ks * t[i] (dropout backward, accumulated) */
__global__ void dropout_add_kernel(bt_bf16 *dx, const bt_bf16 *t, int64_t n, uint32_t th, float ks,
                                   uint64_t key)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        if (drop_keep(key, i, th))
            dx[i] = __float2bfloat16_rn(__bfloat162float(dx[i]) + __bfloat162float(t[i]) * ks);
}
unsigned grid_for(int64_t n)
{
    int64_t b = (n + 255) / 256;
    if (b > 65535LL * 8)
        b = 65535LL * 8;
    return (unsigned)(b < 1 ? 1 : b);
}

struct drop_params {
    uint32_t th;
    float ks;
};
drop_params drop_of(float p)
{ /* lora.c drop_thresh / keep scale */
    drop_params d;
    d.th = (uint32_t)lrintf(p * 65536.0f);
    d.ks = d.th >= 65536 ? 0.f : 65536.0f / (float)(65536u - d.th);
    return d;
}

} // namespace

/* ------------------------------------------------------------------------------ allocation */

int btc_alloc(bt_cuda_trainer *t, void **p, size_t bytes, const char *what)
{
    cudaError_t e = cudaMalloc(p, bytes ? bytes : 16);
    if (e != cudaSuccess) {
        *p = nullptr;
        cudaGetLastError();
        size_t fr = 0, tot = 0;
        cudaMemGetInfo(&fr, &tot);
        return bt_fail(BT_ERR_NOMEM, "cuda: out of device memory for %s (%zu MiB; %zu MiB free of "
                       "%zu MiB; trainer so far %zu MiB; try activation_checkpointing or a smaller "
                       "micro-batch)", what, bytes >> 20, fr >> 20, tot >> 20,
                       (t->bytes + t->md.bytes) >> 20);
    }
    t->allocs.push_back(*p);
    t->bytes += bytes;
    return 0;
}

template <typename T>
static int talloc(bt_cuda_trainer *t, T **p, size_t n, const char *what)
{
    return btc_alloc(t, (void **)p, n * sizeof(T), what);
}

/* ------------------------------------------------------------------------------ weights */

static const float *norm_w(const bt_cuda_trainer *t, int l, int which)
{
    const size_t idx = l == t->L ? (size_t)(2 * l) : (size_t)(2 * l + (which ? 1 : 0));
    return (t->off_norms >= 0 && !t->adapter_off ? t->p + t->off_norms : t->md.norms) +
           idx * (size_t)t->D;
}
static float *dnorm_w(const bt_cuda_trainer *t, int l, int which)
{
    if (t->off_norms < 0)
        return nullptr;
    const size_t idx = l == t->L ? (size_t)(2 * l) : (size_t)(2 * l + (which ? 1 : 0));
    return t->g + t->off_norms + idx * (size_t)t->D;
}
/* QK-norm weight [hd] of layer l (which 0: q_norm, 1: k_norm); sandwich post-norm weight [D]
 * (0: post_attention_layernorm, 1: post_feedforward_layernorm). Frozen. */
static const float *qk_w(const bt_cuda_trainer *t, int l, int which)
{
    return t->md.qk_norms + (size_t)(2 * l + which) * t->hd;
}
static const float *post_w(const bt_cuda_trainer *t, int l, int which)
{
    return t->md.post_norms + (size_t)(2 * l + which) * t->D;
}
static const bt_bf16 *embed16(const bt_cuda_trainer *t)
{
    return t->off_embed >= 0 && !t->adapter_off ? t->p16 + t->off_embed : t->md.embd16;
}
static const bt_bf16 *head16(const bt_cuda_trainer *t)
{
    return t->off_embed >= 0 && t->md.tied && !t->adapter_off ? t->p16 + t->off_embed : t->md.head16;
}
static float *dhead(const bt_cuda_trainer *t)
{
    return t->off_embed >= 0 && t->md.tied ? t->g + t->off_embed : nullptr;
}

/* ---------------------------------------------------------------------- projections */

/* y[M, N] = x[M, K] @ W^T (+ bias) (+ LoRA: scale * drop(x) @ A^T @ B^T; XA saved) */
static int proj_fwd(bt_cuda_trainer *t, int l, int mod, bt_bf16 *y, const bt_bf16 *x, int M,
                    btc_acts *A, uint64_t key)
{
    const btc_linear *bl = btc_lin(t, l, mod);
    if (!bl)
        return bt_fail(BT_ERR_INVALID, "cuda: layer %d's base is not gathered (dist.shard_base)", l);
    const int N = bl->rows, K = bl->cols;
    if (bl->is_nf4 && t->base_matmul_impl)
        BTC_TRY(BTC_L(bt_cuda_nf4_gemm_fwd(t->stream, y, x, &bl->q, M, K, N, 0.f)));
    else if (bl->is_nf4)
        BTC_TRY(BTC_L(bt_cuda_nf4_linear_fwd(t->blas, t->stream, y, x, &bl->q, M, K, N, 0.f, t->wbuf)));
    else if (bl->is_gguf && t->base_matmul_impl)
        BTC_TRY(BTC_L(bt_cuda_ggml_gemm_fwd(t->stream, y, x, &bl->g, M, K, N, 0.f)));
    else if (bl->is_gguf)
        BTC_TRY(BTC_L(bt_cuda_ggml_linear_fwd(t->blas, t->stream, y, x, &bl->g, M, K, N, 0.f,
                                              t->wbuf)));
    else
        BTC_TRY(BTC_L(bt_cuda_gemm(t->blas, t->stream, 0, 1, M, N, K, 1.f, x, K, bl->w16, K, 0.f, y,
                                   N, 0)));
    if (bl->bias)
        BTC_TRY(btc_add_bias(y, bl->bias, M, N, t->stream));
    const btc_lmod *lm = &t->lmods[(size_t)l * BT_MOD_N + mod];
    if (lm->offA < 0 || t->adapter_off) /* adapter_off: the reference pass (base only) */
        return 0;
    const bt_bf16 *xin = x;
    const uint64_t dk = bt_lora_drop_key(key, l, lm->group);
    if (dk && t->dropout > 0) {
        const drop_params d = drop_of(t->dropout);
        const int64_t n = (int64_t)M * K;
        dropout_kernel<<<grid_for(n), 256, 0, t->stream>>>(t->xd, x, n, d.th, d.ks, dk);
        BTC_TRY(BTC_CUDA(cudaGetLastError()));
        xin = t->xd;
    }
    return BTC_L(bt_cuda_lora_fwd(t->blas, t->stream, y, A->xa[mod], xin, t->p16 + lm->offA,
                                  t->p16 + lm->offB, M, K, N, t->r, t->scale));
}

/* dx[M, K] (beta: 0 overwrite, 1 accumulate) (+)= dy @ W (+ LoRA input gradient); LoRA weight
 * gradients accumulate into t->g. */
static int proj_bwd(bt_cuda_trainer *t, int l, int mod, bt_bf16 *dx, const bt_bf16 *dy,
                    const bt_bf16 *x, int M, float beta, btc_acts *A, uint64_t key)
{
    const btc_linear *bl = btc_lin(t, l, mod);
    if (!bl)
        return bt_fail(BT_ERR_INVALID, "cuda: layer %d's base is not gathered (dist.shard_base)", l);
    const int N = bl->rows, K = bl->cols;
    if (bl->is_nf4 && t->base_matmul_impl)
        BTC_TRY(BTC_L(bt_cuda_nf4_gemm_bwd_x(t->stream, dx, dy, &bl->q, M, K, N, beta)));
    else if (bl->is_nf4)
        BTC_TRY(BTC_L(bt_cuda_nf4_linear_bwd_x(t->blas, t->stream, dx, dy, &bl->q, M, K, N, beta,
                                               t->wbuf, 0)));
    else if (bl->is_gguf && t->base_matmul_impl)
        BTC_TRY(BTC_L(bt_cuda_ggml_gemm_bwd_x(t->stream, dx, dy, &bl->g, M, K, N, beta)));
    else if (bl->is_gguf)
        BTC_TRY(BTC_L(bt_cuda_ggml_linear_bwd_x(t->blas, t->stream, dx, dy, &bl->g, M, K, N, beta,
                                                t->wbuf, 0)));
    else
        BTC_TRY(BTC_L(bt_cuda_gemm(t->blas, t->stream, 0, 0, M, K, N, 1.f, dy, N, bl->w16, K, beta,
                                   dx, K, 0)));
    const btc_lmod *lm = &t->lmods[(size_t)l * BT_MOD_N + mod];
    if (lm->offA < 0)
        return 0;
    const uint64_t dk = bt_lora_drop_key(key, l, lm->group);
    const bool drop = dk && t->dropout > 0;
    const bt_bf16 *xin = x;
    const int64_t n = (int64_t)M * K;
    drop_params d = drop_of(t->dropout);
    if (drop) {
        dropout_kernel<<<grid_for(n), 256, 0, t->stream>>>(t->xd, x, n, d.th, d.ks, dk);
        BTC_TRY(BTC_CUDA(cudaGetLastError()));
        xin = t->xd;
    }
    const bt_bf16 *A16 = t->p16 + lm->offA, *B16 = t->p16 + lm->offB;
    BTC_TRY(BTC_L(bt_cuda_lora_bwd(t->blas, t->stream, t->g + lm->offA, t->g + lm->offB,
                                   drop ? nullptr : dx, t->dxa, dy, xin, A->xa[mod], A16, B16, M, K,
                                   N, t->r, t->scale, 1.f)));
    if (!drop)
        return 0;
    /* dx += mask * ks * (dXA @ A): xd is free again (stream order) */
    BTC_TRY(BTC_L(bt_cuda_gemm(t->blas, t->stream, 0, 0, M, K, t->r, 1.f, t->dxa, t->r, A16, K, 0.f,
                               t->xd, K, 0)));
    dropout_add_kernel<<<grid_for(n), 256, 0, t->stream>>>(dx, t->xd, n, d.th, d.ks, dk);
    return BTC_CUDA(cudaGetLastError());
}

/* ----------------------------------------------------------------------------- layers */

static btc_acts *acts_of(bt_cuda_trainer *t, int l) { return &t->acts[t->ckpt ? 0 : (size_t)l]; }

/* The MLP's gated activation: SwiGLU, or GeGLU with the tanh GELU (hp.act, Gemma 3; step.c glu_fwd) */
static int glu_fwd(bt_cuda_trainer *t, bt_bf16 *h, const bt_bf16 *g, const bt_bf16 *u, int64_t n)
{
    if (t->md.hp.act == BT_ACT_GELU_TANH)
        return BTC_L(bt_cuda_geglu_fwd(h, g, u, n, t->stream));
    return BTC_L(bt_cuda_swiglu_fwd(h, g, u, n, t->stream));
}
static int glu_bwd(bt_cuda_trainer *t, bt_bf16 *dg, bt_bf16 *du, const bt_bf16 *dh, const bt_bf16 *g,
                   const bt_bf16 *u, int64_t n)
{
    if (t->md.hp.act == BT_ACT_GELU_TANH)
        return BTC_L(bt_cuda_geglu_bwd(dg, du, dh, g, u, n, t->stream));
    return BTC_L(bt_cuda_swiglu_bwd(dg, du, dh, g, u, n, t->stream));
}

/* The attention parameters of layer l: the step's, with the local layers' own RoPE table (Gemma 3
 * rope_local_base_freq; step.c bt_model_layer_inv) where the model has one. */
static bt_cuda_attn_params layer_attn(const bt_cuda_trainer *t, int l, const bt_cuda_attn_params *ap)
{
    bt_cuda_attn_params a = *ap;
    a.window = bt_model_layer_window(&t->md.hp, l); /* Mistral / Phi-3 sliding_window, Gemma 3's local layers */
    if (t->md.inv_local && a.window > 0)
        a.inv_freq = t->md.inv_local;
    return a;
}

/* Layer l from its input x [M, D] into xout [M, D] (the next layer's input). */
static int layer_fwd(bt_cuda_trainer *t, int l, int M, const bt_cuda_attn_params *ap0, uint64_t key,
                     const bt_bf16 *x, bt_bf16 *xout)
{
    btc_acts *A = acts_of(t, l);
    const bt_cuda_attn_params lap = layer_attn(t, l, ap0), *ap = &lap;
    const int64_t nD = (int64_t)M * t->D;
    const float eps = t->md.hp.rms_eps;
    cudaStream_t s = t->stream;

    BTC_TRY(BTC_L(bt_cuda_rmsnorm_fwd(A->xn1, A->rstd1, x, norm_w(t, l, 0), M, t->D, eps, s)));
    BTC_TRY(proj_fwd(t, l, BT_MOD_Q, A->qr ? A->qr : A->q, A->xn1, M, A, key));
    BTC_TRY(proj_fwd(t, l, BT_MOD_K, A->kr ? A->kr : A->k, A->xn1, M, A, key));
    BTC_TRY(proj_fwd(t, l, BT_MOD_V, A->v, A->xn1, M, A, key));
    if (A->qr) { /* QK-norm (Qwen3 / Gemma 3): RMSNorm over each head's head_dim values, before RoPE */
        BTC_TRY(BTC_L(bt_cuda_head_rmsnorm_fwd(A->q, A->rq, A->qr, qk_w(t, l, 0), (int64_t)M * t->Hq,
                                               t->hd, eps, s)));
        BTC_TRY(BTC_L(bt_cuda_head_rmsnorm_fwd(A->k, A->rk, A->kr, qk_w(t, l, 1), (int64_t)M * t->Hkv,
                                               t->hd, eps, s)));
    }
    /* RoPE is applied inside the attention kernel as Q/K tiles load (position_ids, theta, scale) */
    BTC_TRY(BTC_L(t->attn_impl ? bt_cuda_attn_fwd_mma(ap, A->att, A->lse, A->q, A->k, A->v, s)
                               : bt_cuda_attn_fwd(ap, A->att, A->lse, A->q, A->k, A->v, s)));
    BTC_TRY(proj_fwd(t, l, BT_MOD_O, A->ao ? A->ao : A->x2, A->att, M, A, key));
    if (A->ao) /* Gemma 3 post_attention_layernorm of the attention output */
        BTC_TRY(BTC_L(bt_cuda_rmsnorm_fwd(A->x2, A->rpa, A->ao, post_w(t, l, 0), M, t->D, eps, s)));
    BTC_TRY(BTC_L(bt_cuda_add_bf16(A->x2, A->x2, x, nD, s)));
    BTC_TRY(BTC_L(bt_cuda_rmsnorm_fwd(A->xn2, A->rstd2, A->x2, norm_w(t, l, 1), M, t->D, eps, s)));
    BTC_TRY(proj_fwd(t, l, BT_MOD_GATE, A->g, A->xn2, M, A, key));
    BTC_TRY(proj_fwd(t, l, BT_MOD_UP, A->u, A->xn2, M, A, key));
    BTC_TRY(glu_fwd(t, t->h, A->g, A->u, (int64_t)M * t->F));
    BTC_TRY(proj_fwd(t, l, BT_MOD_DOWN, A->fo ? A->fo : xout, t->h, M, A, key));
    if (A->fo) /* Gemma 3 post_feedforward_layernorm of the MLP output */
        BTC_TRY(BTC_L(bt_cuda_rmsnorm_fwd(xout, A->rpf, A->fo, post_w(t, l, 1), M, t->D, eps, s)));
    return BTC_L(bt_cuda_add_bf16(xout, xout, A->x2, nD, s));
}

/* On entry t->dx = dLoss/d(layer output); on exit t->dx = dLoss/d(layer input). x: the layer's
 * input; recompute_out: where checkpointing's recomputed forward writes its (unused) output. */
static int layer_bwd(bt_cuda_trainer *t, int l, int M, const bt_cuda_attn_params *ap0, uint64_t key,
                     const bt_bf16 *x, bt_bf16 *recompute_out)
{
    btc_acts *A = acts_of(t, l);
    const bt_cuda_attn_params lap = layer_attn(t, l, ap0), *ap = &lap;
    const int64_t nD = (int64_t)M * t->D;
    cudaStream_t s = t->stream;

    if (t->ckpt)
        BTC_TRY(layer_fwd(t, l, M, ap0, key, x, recompute_out)); /* recompute, same values */
    else
        BTC_TRY(glu_fwd(t, t->h, A->g, A->u, (int64_t)M * t->F));
    /* MLP (Gemma 3: first back through post_feedforward_layernorm, into dtmp) */
    const bt_bf16 *dmlp = t->dx;
    if (A->fo) {
        BTC_TRY(BTC_L(bt_cuda_rmsnorm_bwd(t->dtmp, nullptr, t->dx, A->fo, post_w(t, l, 1), A->rpf, M,
                                          t->D, nullptr, s)));
        dmlp = t->dtmp;
    }
    BTC_TRY(proj_bwd(t, l, BT_MOD_DOWN, t->dh, dmlp, t->h, M, 0.f, A, key));
    BTC_TRY(glu_bwd(t, t->dg, t->du, t->dh, A->g, A->u, (int64_t)M * t->F));
    BTC_TRY(proj_bwd(t, l, BT_MOD_GATE, t->dxn, t->dg, A->xn2, M, 0.f, A, key));
    BTC_TRY(proj_bwd(t, l, BT_MOD_UP, t->dxn, t->du, A->xn2, M, 1.f, A, key));
    BTC_TRY(BTC_L(bt_cuda_rmsnorm_bwd(t->dtmp, dnorm_w(t, l, 1), t->dxn, A->x2, norm_w(t, l, 1),
                                      A->rstd2, M, t->D, t->rms_scratch, s)));
    BTC_TRY(BTC_L(bt_cuda_add_bf16(t->dx2, t->dx, t->dtmp, nD, s)));
    /* attention (Gemma 3: first back through post_attention_layernorm, into dtmp) */
    const bt_bf16 *dattn = t->dx2;
    if (A->ao) {
        BTC_TRY(BTC_L(bt_cuda_rmsnorm_bwd(t->dtmp, nullptr, t->dx2, A->ao, post_w(t, l, 0), A->rpa, M,
                                          t->D, nullptr, s)));
        dattn = t->dtmp;
    }
    BTC_TRY(proj_bwd(t, l, BT_MOD_O, t->datt, dattn, A->att, M, 0.f, A, key));
    BTC_TRY(BTC_L((t->attn_impl ? bt_cuda_attn_bwd_mma : bt_cuda_attn_bwd)(
        ap, t->dq, t->dk, t->dv, t->datt, A->att, A->lse, A->q, A->k, A->v, t->delta, s)));
    /* dq, dk are already gradients w.r.t. the unrotated q, k (inverse RoPE inside the kernel) */
    if (A->qr) { /* QK-norm backward, in place (the norm weights are frozen: no dw) */
        BTC_TRY(BTC_L(bt_cuda_head_rmsnorm_bwd(t->dq, t->dq, A->qr, qk_w(t, l, 0), A->rq,
                                               (int64_t)M * t->Hq, t->hd, s)));
        BTC_TRY(BTC_L(bt_cuda_head_rmsnorm_bwd(t->dk, t->dk, A->kr, qk_w(t, l, 1), A->rk,
                                               (int64_t)M * t->Hkv, t->hd, s)));
    }
    BTC_TRY(proj_bwd(t, l, BT_MOD_Q, t->dxn, t->dq, A->xn1, M, 0.f, A, key));
    BTC_TRY(proj_bwd(t, l, BT_MOD_K, t->dxn, t->dk, A->xn1, M, 1.f, A, key));
    BTC_TRY(proj_bwd(t, l, BT_MOD_V, t->dxn, t->dv, A->xn1, M, 1.f, A, key));
    BTC_TRY(BTC_L(bt_cuda_rmsnorm_bwd(t->dtmp, dnorm_w(t, l, 0), t->dxn, x, norm_w(t, l, 0),
                                      A->rstd1, M, t->D, t->rms_scratch, s)));
    return BTC_L(bt_cuda_add_bf16(t->dx, t->dx2, t->dtmp, nD, s));
}

/* --------------------------------------------------- layer inputs: device or offloaded */

/* Device buffer of layer input l (x_in[L] = the last layer's output). */
static bt_bf16 *xin_dev(bt_cuda_trainer *t, int l)
{
    return t->offload ? t->xbuf[l & 1] : t->x_in[l];
}
static bt_bf16 *host_xin(bt_cuda_trainer *t, int l)
{
    return t->h_xin + (size_t)l * t->max_M * t->D;
}
/* Copy layer input l to the host on the copy stream once the compute stream has produced it. */
static int offload_out(bt_cuda_trainer *t, int l, int M)
{
    BTC_TRY(BTC_CUDA(cudaEventRecord(t->ev_out[l], t->stream)));
    BTC_TRY(BTC_CUDA(cudaStreamWaitEvent(t->copy_stream, t->ev_out[l], 0)));
    BTC_TRY(BTC_CUDA(cudaMemcpyAsync(host_xin(t, l), xin_dev(t, l), (size_t)M * t->D * sizeof(bt_bf16),
                                     cudaMemcpyDeviceToHost, t->copy_stream)));
    return BTC_CUDA(cudaEventRecord(t->ev_copy[l], t->copy_stream));
}

/* Dynamic NTK scaling: the table of this micro-batch's longest position (bt_model_rope_table on
 * the host, uploaded into d_rope_dyn), as the CPU step uses it. Other scalings: nothing. */
static int dynamic_table(bt_cuda_trainer *t, const bt_microbatch *mb, bt_cuda_attn_params *ap)
{
    if (t->md.hp.rope_ext != BT_ROPE_EXT_DYNAMIC || t->h_inv_freq.empty())
        return 0;
    int32_t maxp = 0;
    for (int i = 0; i < mb->B * mb->T; i++)
        maxp = mb->position_ids[i] > maxp ? mb->position_ids[i] : maxp;
    bt_model view;
    memset(&view, 0, sizeof view);
    view.hp = t->md.hp;
    view.inv_freq = t->h_inv_freq.data();
    std::vector<float> tab(t->h_inv_freq.size());
    const int rc = bt_model_rope_table(&view, (int64_t)maxp + 1, tab.data());
    if (rc < 0)
        return rc;
    if (rc == 1) {
        BTC_TRY(BTC_CUDA(cudaMemcpy(t->d_rope_dyn, tab.data(), tab.size() * sizeof(float),
                                    cudaMemcpyHostToDevice)));
        ap->inv_freq = t->d_rope_dyn;
    }
    return 0;
}

/* ------------------------------------------------------------------------------ public */

thread_local btc_prof_state *btc_prof_cur = nullptr;

extern "C" void bt_cuda_trainer_set_profile(bt_cuda_trainer *t, struct bt_prof *p)
{
    if (t)
        t->prof = p;
}

/* The profiled launches of a finished (synchronised) step into t->prof: op name = the launcher's
 * function name without its "bt_cuda_" prefix. */
static void prof_resolve(bt_cuda_trainer *t, btc_prof_state *ps)
{
    for (btc_prof_rec &r : ps->recs) {
        float ms = 0.f;
        if (r.what && r.b && cudaEventElapsedTime(&ms, r.a, r.b) == cudaSuccess) {
            char name[64];
            const char *w = r.what;
            while (*w == ' ' || *w == '(')
                w++;
            const int cond = !strncmp(w, "t->attn_impl ? ", 15); /* either attention kernel */
            if (cond)
                w += 15;
            size_t n = strcspn(w, "( ");
            if (!strncmp(w, "bt_cuda_", 8))
                w += 8, n -= 8;
            if (cond && n > 4 && !strncmp(w + n - 4, "_mma", 4))
                n -= 4;
            snprintf(name, sizeof name, "%.*s%s", (int)(n < 48 ? n : 48), w,
                     !cond ? "" : t->attn_impl ? " (mma)" : " (wmma)");
            bt_prof_add(t->prof, name, ms / 1e3, 0.0);
        }
        if (r.a)
            cudaEventDestroy(r.a);
        if (r.b)
            cudaEventDestroy(r.b);
    }
    ps->recs.clear();
}

static void sample_mem(bt_cuda_trainer *t)
{
    size_t fr = 0, tot = 0;
    if (cudaMemGetInfo(&fr, &tot) == cudaSuccess && tot - fr > t->peak_used)
        t->peak_used = tot - fr;
}

static int step_run(bt_cuda_trainer *t, const bt_microbatch *mb, int backward, float grad_scale,
                    uint64_t drop_key, int M, int nv);

extern "C" int bt_cuda_trainer_step(bt_cuda_trainer *t, const bt_microbatch *mb, int backward,
                                    float grad_scale, uint64_t drop_key, double *loss_sum,
                                    int *n_valid)
{
    if (!t || !mb)
        return bt_fail(BT_ERR_INVALID, "cuda step: NULL argument");
    t->lp_mb = nullptr; /* a log-prob pass awaiting its backward is void now (cuda_logprobs.cu) */
    if ((int64_t)mb->B * mb->T > t->max_M)
        return bt_fail(BT_ERR_RANGE, "cuda step: micro-batch of %d x %d tokens exceeds the workspace (%d)",
                       mb->B, mb->T, t->max_M);
    const int nv = bt_shift_targets(t->h_tgt.data(), mb, t->V);
    if (nv < 0)
        return nv;
    const int M = mb->B * mb->T;
    cudaStream_t s = t->stream;
    btc_prof_state ps;
    ps.stream = s;
    if (t->prof)
        btc_prof_cur = &ps;
    const int rc = step_run(t, mb, backward, grad_scale, drop_key, M, nv);
    if (t->prof) {
        btc_prof_cur = nullptr;
        if (rc == 0)
            prof_resolve(t, &ps);
        else
            for (btc_prof_rec &r : ps.recs) {
                if (r.a)
                    cudaEventDestroy(r.a);
                if (r.b)
                    cudaEventDestroy(r.b);
            }
    }
    if (rc)
        return rc;
    if (loss_sum)
        *loss_sum = *t->h_loss;
    if (n_valid)
        *n_valid = nv;
    return 0;
}

/* The step proper (bt_cuda_trainer_step): upload the batch, forward, loss, backward, sync. */
static int step_run(bt_cuda_trainer *t, const bt_microbatch *mb, int backward, float grad_scale,
                    uint64_t drop_key, int M, int nv)
{
    (void)nv;
    cudaStream_t s = t->stream;
    bt_cuda_attn_params ap;
    BTC_TRY(btc_step_forward(t, mb, backward, drop_key, M, &ap));
    /* dLoss/dxf goes into t->dtmp (free until the first layer's backward) */
    BTC_TRY(BTC_L(bt_cuda_linear_ce(t->blas, s, t->row_loss, backward ? t->dtmp : nullptr,
                                    backward ? dhead(t) : nullptr, t->xf, head16(t), t->d_tgt, M,
                                    t->D, t->V, t->ce_chunk, grad_scale, t->ce_ws)));
    BTC_TRY(BTC_L(bt_cuda_ce_reduce(t->d_loss, t->d_count, t->row_loss, t->d_tgt, M, t->V, s)));
    BTC_TRY(BTC_CUDA(cudaMemcpyAsync(t->h_loss, t->d_loss, sizeof(double), cudaMemcpyDeviceToHost, s)));
    if (backward)
        BTC_TRY(btc_step_backward(t, M, &ap, drop_key));
    return btc_step_sync(t, backward);
}

int btc_step_attn(bt_cuda_trainer *t, const bt_microbatch *mb, int backward, int M,
                  bt_cuda_attn_params *pap)
{
    int max_len = 1;
    for (int i = 0; i + 1 < mb->n_cu; i++)
        if (mb->cu_seqlens[i + 1] - mb->cu_seqlens[i] > max_len)
            max_len = mb->cu_seqlens[i + 1] - mb->cu_seqlens[i];
    bt_cuda_attn_params &ap = *pap;
    memset(&ap, 0, sizeof ap);
    ap.M = M;
    ap.Hq = t->Hq;
    ap.Hkv = t->Hkv;
    ap.D = t->hd;
    ap.n_seq = mb->n_cu - 1;
    ap.max_seqlen = max_len;
    ap.cu_seqlens = t->d_cu;
    ap.ldq = t->Dq;
    ap.ldk = t->Dkv;
    ap.ldv = t->Dkv;
    ap.scale = bt_model_attn_scale(&t->md.hp); /* 1/sqrt(hd), x mscale^2 for YaRN */
    ap.position_ids = t->d_pos;
    ap.rope_theta = t->md.hp.rope_theta;
    ap.pos_scale = 1.0f; /* every scaling is in the table */
    ap.inv_freq = t->d_inv_freq; /* NULL only for a model without a table (derived from theta) */
    ap.s2_group = backward ? t->s2_group : 0; /* S^2-Attn in training, full attention to evaluate */
    return dynamic_table(t, mb, &ap);
}

int btc_step_forward(bt_cuda_trainer *t, const bt_microbatch *mb, int backward, uint64_t drop_key,
                     int M, bt_cuda_attn_params *pap)
{
    cudaStream_t s = t->stream;
    BTC_TRY(BTC_CUDA(cudaMemcpyAsync(t->d_ids, mb->input_ids, (size_t)M * 4, cudaMemcpyHostToDevice, s)));
    BTC_TRY(BTC_CUDA(cudaMemcpyAsync(t->d_pos, mb->position_ids, (size_t)M * 4, cudaMemcpyHostToDevice, s)));
    BTC_TRY(BTC_CUDA(cudaMemcpyAsync(t->d_cu, mb->cu_seqlens, (size_t)mb->n_cu * 4, cudaMemcpyHostToDevice, s)));
    BTC_TRY(BTC_CUDA(cudaMemcpyAsync(t->d_tgt, t->h_tgt.data(), (size_t)M * 4, cudaMemcpyHostToDevice, s)));
    BTC_TRY(btc_step_attn(t, mb, backward, M, pap));
    const bt_cuda_attn_params &ap = *pap;

    const bool off = t->offload && backward; /* evaluation passes keep nothing for backward */
    BTC_TRY(BTC_L(bt_cuda_embedding_fwd(xin_dev(t, 0), embed16(t), t->d_ids, M, t->D, t->V, s)));
    if (t->md.hp.embed_scale > 0.f) /* Gemma: Gemma3TextScaledWordEmbedding's sqrt(hidden_size) */
        BTC_TRY(BTC_L(bt_cuda_scale_bf16(xin_dev(t, 0), (int64_t)M * t->D, t->md.hp.embed_scale, s)));
    if (off)
        BTC_TRY(offload_out(t, 0, M));
    for (int l = 0; l < t->L; l++) {
        BTC_TRY(btc_check(t)); /* a stop request ends the micro-batch between layers */
        /* layer l writes the buffer that held input l-1: its copy to the host must be done */
        if (off && l >= 1)
            BTC_TRY(BTC_CUDA(cudaStreamWaitEvent(s, t->ev_copy[l - 1], 0)));
        /* dist.shard_base: layer l's base resident, layer l+1's gathered while it computes */
        BTC_TRY(btc_shard_layer(t, l, l + 1 < t->L ? l + 1 : -1));
        BTC_TRY(layer_fwd(t, l, M, &ap, drop_key, xin_dev(t, l), xin_dev(t, l + 1)));
        BTC_TRY(btc_shard_done(t));
        if (off && l + 1 < t->L)
            BTC_TRY(offload_out(t, l + 1, M));
    }
    return BTC_L(bt_cuda_rmsnorm_fwd(t->xf, t->rstdf, xin_dev(t, t->L), norm_w(t, t->L, 0), M, t->D,
                                     t->md.hp.rms_eps, s));
}

int btc_step_backward(bt_cuda_trainer *t, int M, const bt_cuda_attn_params *pap, uint64_t drop_key)
{
    cudaStream_t s = t->stream;
    const bt_cuda_attn_params &ap = *pap;
    const bool off = t->offload;
    { /* from dLoss/dxf in t->dtmp */
        BTC_TRY(BTC_L(bt_cuda_rmsnorm_bwd(t->dx, dnorm_w(t, t->L, 0), t->dtmp, xin_dev(t, t->L),
                                          norm_w(t, t->L, 0), t->rstdf, M, t->D, t->rms_scratch, s)));
        if (off) /* the buffer of x_in[L] is free from here */
            BTC_TRY(BTC_CUDA(cudaEventRecord(t->ev_out[t->L], s)));
        for (int l = t->L - 1; l >= 0; l--) {
            BTC_TRY(btc_check(t));
            if (off && l >= 1) { /* bring input l-1 back while layer l computes */
                BTC_TRY(BTC_CUDA(cudaStreamWaitEvent(t->copy_stream, t->ev_out[l + 1], 0)));
                BTC_TRY(BTC_CUDA(cudaMemcpyAsync(xin_dev(t, l - 1), host_xin(t, l - 1),
                                                 (size_t)M * t->D * sizeof(bt_bf16),
                                                 cudaMemcpyHostToDevice, t->copy_stream)));
                BTC_TRY(BTC_CUDA(cudaEventRecord(t->ev_copy[l - 1], t->copy_stream)));
            }
            if (off && l + 1 < t->L) /* input l came back from the host (input L-1 never left) */
                BTC_TRY(BTC_CUDA(cudaStreamWaitEvent(s, t->ev_copy[l], 0)));
            /* the recompute and backward of layer l read its base again: resident (the last two
             * forward layers still are), layer l-1's gathered meanwhile */
            BTC_TRY(btc_shard_layer(t, l, l - 1));
            BTC_TRY(layer_bwd(t, l, M, &ap, drop_key, xin_dev(t, l),
                              t->offload ? t->xbuf[2] : t->x_in[l + 1]));
            BTC_TRY(btc_shard_done(t));
            if (off)
                BTC_TRY(BTC_CUDA(cudaEventRecord(t->ev_out[l], s)));
        }
        /* t->dx = dLoss/d(embedding output): scatter-add into a trainable embedding (LoRA+) */
        if (t->off_embed >= 0 && t->md.hp.embed_scale > 0.f)
            BTC_TRY(BTC_L(bt_cuda_scale_bf16(t->dx, (int64_t)M * t->D, t->md.hp.embed_scale, s)));
        if (t->off_embed >= 0)
            BTC_TRY(BTC_L(bt_cuda_embedding_bwd(t->g + t->off_embed, t->dx, t->d_ids, M, t->D, t->V, s)));
    }
    return 0;
}

int btc_step_sync(bt_cuda_trainer *t, int backward)
{
    const bool off = t->offload && backward;
    BTC_TRY(BTC_CUDA(cudaStreamSynchronize(t->stream)));
    if (off) /* the last copies out (of inputs no backward needed back) */
        BTC_TRY(BTC_CUDA(cudaStreamSynchronize(t->copy_stream)));
    sample_mem(t);
    return 0;
}

void btc_prof_resolve(bt_cuda_trainer *t, btc_prof_state *ps) { prof_resolve(t, ps); }
const bt_bf16 *btc_head16(const bt_cuda_trainer *t) { return head16(t); }
float *btc_dhead(const bt_cuda_trainer *t) { return dhead(t); }

extern "C" void bt_cuda_trainer_free(bt_cuda_trainer *t)
{
    if (!t)
        return;
    btc_dist_free(t); /* first: an abort ends NCCL kernels still waiting for a dead peer */
    if (t->stream)
        cudaStreamSynchronize(t->stream);
    if (t->copy_stream) {
        cudaStreamSynchronize(t->copy_stream);
        cudaStreamDestroy(t->copy_stream);
    }
    if (t->gather_stream) {
        cudaStreamSynchronize(t->gather_stream);
        cudaStreamDestroy(t->gather_stream);
    }
    for (cudaEvent_t e : t->g_free)
        if (e)
            cudaEventDestroy(e);
    for (cudaEvent_t e : t->ev_out)
        if (e)
            cudaEventDestroy(e);
    for (cudaEvent_t e : t->ev_copy)
        if (e)
            cudaEventDestroy(e);
    if (t->h_xin)
        cudaFreeHost(t->h_xin);
    for (void *p : t->allocs)
        cudaFree(p);
    btc_model_free(&t->md);
    if (t->h_loss)
        cudaFreeHost(t->h_loss);
    free(t->x_in);
    if (t->blas)
        cublasDestroy(t->blas);
    if (t->stream)
        cudaStreamDestroy(t->stream);
    delete t;
}

extern "C" size_t bt_cuda_trainer_bytes(const bt_cuda_trainer *t) { return t ? t->bytes + t->md.bytes : 0; }
extern "C" size_t bt_cuda_trainer_plan_bytes(const bt_cuda_trainer *t, size_t *host)
{
    if (host)
        *host = t ? t->host_bytes : 0;
    return t ? t->plan_bytes : 0;
}
extern "C" size_t bt_cuda_trainer_base_bytes(const bt_cuda_trainer *t, size_t *gathered)
{
    if (gathered)
        *gathered = t && t->md.shards ? (size_t)t->md.gather_bytes : 0;
    return t ? t->md.lin_bytes : 0;
}
extern "C" const char *bt_cuda_trainer_device_name(const bt_cuda_trainer *t) { return t ? t->dev_name : ""; }
extern "C" size_t bt_cuda_trainer_peak_used(const bt_cuda_trainer *t, size_t *baseline)
{
    if (baseline)
        *baseline = t ? t->base_used : 0;
    return t ? t->peak_used : 0;
}

template <typename T>
static void set_ptr(T *&field, void *p)
{
    field = static_cast<T *>(p);
}

/* Point copy i of plan buffer `id` (trainer/backend/plan.h) at p: the trainer's field for it. */
static void bind(bt_cuda_trainer *t, int id, int i, void *p)
{
    btc_acts &A = t->acts[i < (int)t->acts.size() ? i : 0];
    switch (id) {
    case BT_BUF_LORA_P: set_ptr(t->p, p); break;
    case BT_BUF_LORA_G: set_ptr(t->g, p); break;
    case BT_BUF_LORA_M: set_ptr(t->m, p); break;
    case BT_BUF_LORA_V: set_ptr(t->v, p); break;
    case BT_BUF_LORA_P16: set_ptr(t->p16, p); break;
    case BT_BUF_ADAM_DESC: set_ptr(t->adam_desc, p); break;
    case BT_BUF_GNORM: set_ptr(t->d_norm, p); break;
    case BT_BUF_GNORM_PARTIAL: set_ptr(t->d_partial, p); break;
    case BT_BUF_LOSS_SUM: set_ptr(t->d_loss, p); break;
    case BT_BUF_LOSS_COUNT: set_ptr(t->d_count, p); break;
    case BT_BUF_X_IN: set_ptr(t->x_in[i], p); break;
    case BT_BUF_X_HOST: set_ptr(t->h_xin, p); break;
    case BT_BUF_XBUF: set_ptr(t->xbuf[i], p); break;
    case BT_BUF_XN1: set_ptr(A.xn1, p); break;
    case BT_BUF_RSTD1: set_ptr(A.rstd1, p); break;
    case BT_BUF_Q: set_ptr(A.q, p); break;
    case BT_BUF_K: set_ptr(A.k, p); break;
    case BT_BUF_V: set_ptr(A.v, p); break;
    case BT_BUF_ATT: set_ptr(A.att, p); break;
    case BT_BUF_LSE: set_ptr(A.lse, p); break;
    case BT_BUF_X2: set_ptr(A.x2, p); break;
    case BT_BUF_XN2: set_ptr(A.xn2, p); break;
    case BT_BUF_RSTD2: set_ptr(A.rstd2, p); break;
    case BT_BUF_G: set_ptr(A.g, p); break;
    case BT_BUF_U: set_ptr(A.u, p); break;
    case BT_BUF_QR: set_ptr(A.qr, p); break;
    case BT_BUF_KR: set_ptr(A.kr, p); break;
    case BT_BUF_RQ: set_ptr(A.rq, p); break;
    case BT_BUF_RK: set_ptr(A.rk, p); break;
    case BT_BUF_AO: set_ptr(A.ao, p); break;
    case BT_BUF_RPA: set_ptr(A.rpa, p); break;
    case BT_BUF_FO: set_ptr(A.fo, p); break;
    case BT_BUF_RPF: set_ptr(A.rpf, p); break;
    case BT_BUF_XF: set_ptr(t->xf, p); break;
    case BT_BUF_RSTDF: set_ptr(t->rstdf, p); break;
    case BT_BUF_H: set_ptr(t->h, p); break;
    case BT_BUF_DX: set_ptr(t->dx, p); break;
    case BT_BUF_DX2: set_ptr(t->dx2, p); break;
    case BT_BUF_DXN: set_ptr(t->dxn, p); break;
    case BT_BUF_DTMP: set_ptr(t->dtmp, p); break;
    case BT_BUF_DQ: set_ptr(t->dq, p); break;
    case BT_BUF_DK: set_ptr(t->dk, p); break;
    case BT_BUF_DV: set_ptr(t->dv, p); break;
    case BT_BUF_DATT: set_ptr(t->datt, p); break;
    case BT_BUF_DG: set_ptr(t->dg, p); break;
    case BT_BUF_DU: set_ptr(t->du, p); break;
    case BT_BUF_DH: set_ptr(t->dh, p); break;
    case BT_BUF_DXA: set_ptr(t->dxa, p); break;
    case BT_BUF_XD: set_ptr(t->xd, p); break;
    case BT_BUF_DEQUANT: set_ptr(t->wbuf, p); break;
    case BT_BUF_ROPE: set_ptr(t->d_inv_freq, p); break;
    case BT_BUF_ROPE_DYN: set_ptr(t->d_rope_dyn, p); break;
    case BT_BUF_DELTA: set_ptr(t->delta, p); break;
    case BT_BUF_RMS_SCRATCH: set_ptr(t->rms_scratch, p); break;
    case BT_BUF_CE_WS: set_ptr(t->ce_ws, p); break;
    case BT_BUF_ROW_LOSS: set_ptr(t->row_loss, p); break;
    case BT_BUF_ROW_W: set_ptr(t->d_roww, p); break;
    case BT_BUF_TARGETS: set_ptr(t->d_tgt, p); break;
    case BT_BUF_IDS: set_ptr(t->d_ids, p); break;
    case BT_BUF_POS: set_ptr(t->d_pos, p); break;
    case BT_BUF_CU: set_ptr(t->d_cu, p); break;
    case BT_BUF_GATHER: set_ptr(t->gbuf[i], p); break;
    default: /* BT_BUF_XA + mod; the plan has no other id (BT_BUF_TILES is the CPU's) */
        set_ptr(A.xa[id - BT_BUF_XA], p);
        break;
    }
}

/* Allocate every buffer of plan p (device, or pinned host for BT_PG_HOST) and bind it. */
static int alloc_plan(bt_cuda_trainer *t, const bt_plan *p)
{
    for (int b = 0; b < p->n; b++) {
        const bt_plan_buf *pb = &p->buf[b];
        const size_t bytes = (size_t)pb->count * bt_dtype_size(pb->dtype);
        for (int i = 0; i < pb->copies; i++) {
            void *ptr = nullptr;
            if (pb->group == BT_PG_HOST) {
                if (cudaMallocHost(&ptr, bytes ? bytes : 16) != cudaSuccess) {
                    cudaGetLastError();
                    return bt_fail(BT_ERR_NOMEM, "cuda: out of pinned host memory for the %s "
                                   "(%zu MiB)", pb->name, bytes >> 20);
                }
                t->host_bytes += bytes;
            } else {
                BTC_TRY(btc_alloc(t, &ptr, bytes, pb->name));
            }
            bind(t, pb->id, i, ptr);
        }
    }
    return 0;
}

static int trainer_init(bt_cuda_trainer *t, const bt_model *m, const bt_lora *lo, int max_M,
                        const bt_cuda_trainer_opts *o)
{
    const bt_llama_hparams *hp = &m->hp;
    const bt_dims d = bt_dims_of(hp);
    t->L = d.L;
    t->D = d.D;
    t->Hq = d.Hq;
    t->Hkv = d.Hkv;
    t->hd = d.hd;
    t->Dq = d.Dq;
    t->Dkv = d.Dkv;
    t->F = d.F;
    t->V = d.V;
    t->max_M = max_M;
    t->ckpt = o->checkpointing ? 1 : 0;
    t->attn_impl = o->attn_impl ? 1 : 0;
    t->base_matmul_impl = o->base_matmul_impl ? 1 : 0;
    t->s2_group = o->s2_group;
    t->offload = o->offload ? 1 : 0;
    if (o->s2_group < 0 || (o->s2_group & 1))
        return bt_fail(BT_ERR_INVALID, "cuda: S^2-Attn group %d must be 0 or a positive even number",
                       o->s2_group);
    if (t->offload && !t->ckpt)
        return bt_fail(BT_ERR_INVALID, "cuda: offloading the checkpointed layer inputs needs "
                       "activation checkpointing");
    if (t->hd != 64 && t->hd != 128 && (t->hd != 256 || t->attn_impl))
        return bt_fail(BT_ERR_UNSUPPORTED, "cuda: head_dim %d (%s) is not supported by the %s attention "
                       "kernels (%s); use device: \"cpu\"", t->hd, bt_arch_name(hp->arch),
                       t->attn_impl ? "mma" : "wmma",
                       t->attn_impl ? "64 or 128; head_dim 256 runs on config cuda.attention \"wmma\""
                                    : "64, 128 or 256");
    if (t->D % 8 != 0 || t->Dq % 8 != 0 || t->Dkv % 8 != 0)
        return bt_fail(BT_ERR_UNSUPPORTED, "cuda: d_model %d / q %d / kv %d must be multiples of 8",
                       t->D, t->Dq, t->Dkv);
    if (hp->rope_type != BT_ROPE_DEFAULT && !m->inv_freq)
        return bt_fail(BT_ERR_INVALID, "cuda: RoPE type %d (llama3 / GGUF rope_freqs) needs the "
                       "model's inverse-frequency table (bt_model_rope_init)", hp->rope_type);
    if (!lo || lo->n_layer != t->L || lo->r < 1)
        return bt_fail(BT_ERR_INVALID, "cuda: LoRA state does not match the model (%d layers vs %d)",
                       lo ? lo->n_layer : -1, t->L);
    BTC_TRY(BTC_CUDA(cudaStreamCreateWithFlags(&t->stream, cudaStreamNonBlocking)));
    if (cublasCreate(&t->blas) != CUBLAS_STATUS_SUCCESS) {
        t->blas = nullptr;
        return bt_fail(BT_ERR_IO, "cuda: cublasCreate failed");
    }
    cublasSetStream(t->blas, t->stream);
    if (o->shard_world > 1 && (o->shard_rank < 0 || o->shard_rank >= o->shard_world))
        return bt_fail(BT_ERR_INVALID, "cuda: shard rank %d of %d", o->shard_rank, o->shard_world);
    BTC_TRY(btc_model_upload(&t->md, m, o->random_weights, o->random_seed, o->shard_rank,
                             o->shard_world));
    t->g_layer[0] = t->g_layer[1] = -1;
    t->g_pending = -1;
    if (t->md.shards) {
        BTC_TRY(BTC_CUDA(cudaStreamCreateWithFlags(&t->gather_stream, cudaStreamNonBlocking)));
        for (int i = 0; i < 2; i++)
            BTC_TRY(BTC_CUDA(cudaEventCreateWithFlags(&t->g_free[i], cudaEventDisableTiming)));
    }

    /* LoRA state */
    t->r = lo->r;
    t->scale = lo->scale;
    t->dropout = lo->dropout;
    t->target_mask = lo->target_mask;
    t->trainable = lo->trainable;
    t->n_params = lo->n_params;
    t->n_decay = lo->n_decay;
    t->off_embed = lo->embed ? (int64_t)(lo->embed - lo->params) : -1;
    t->off_norms = lo->norms ? (int64_t)(lo->norms - lo->params) : -1;
    t->lmods.assign((size_t)t->L * BT_MOD_N, btc_lmod{-1, -1, 0, 0, 0});
    for (int l = 0; l < t->L; l++)
        for (int mod = 0; mod < BT_MOD_N; mod++) {
            const bt_lora_mod *x = bt_lora_get(lo, l, mod);
            if (!x)
                continue;
            const btc_linear *bl = &t->md.lin[l * BT_MOD_N + mod];
            if (x->in != bl->cols || x->out != bl->rows)
                return bt_fail(BT_ERR_INVALID, "cuda: LoRA %d %s is %dx%d, the base %dx%d", l,
                               bt_module_name(mod), x->out, x->in, bl->rows, bl->cols);
            btc_lmod &dl = t->lmods[(size_t)l * BT_MOD_N + mod];
            dl.offA = (int64_t)(x->A - lo->params);
            dl.offB = (int64_t)(x->B - lo->params);
            dl.in = x->in;
            dl.out = x->out;
            dl.group = x->group;
        }

    /* every buffer of the step: the memory plan `trainer estimate` bills (trainer/backend/plan.h) */
    bool any_quant = false;
    for (int i = 0; i < t->L * BT_MOD_N; i++)
        any_quant = any_quant || t->md.lin[i].is_nf4 || t->md.lin[i].is_gguf;
    bt_plan_opts po;
    memset(&po, 0, sizeof po);
    po.backend = BT_PLAN_CUDA;
    po.max_M = max_M;
    po.checkpointing = t->ckpt;
    po.r = t->r;
    po.target_mask = t->target_mask;
    po.quant_base = any_quant; /* the fused GEMMs dequantise tiles in shared memory instead */
    po.fused_quant = t->base_matmul_impl;
    po.max_linear = t->md.max_nk;
    po.n_params = t->n_params;
    po.trainable_norms = t->off_norms >= 0;
    po.ce_chunk_rows = o->ce_chunk_rows;
    po.gather_bytes = t->md.shards ? t->md.gather_bytes : 0;
    po.offload = t->offload;
    po.rope_table = m->inv_freq != nullptr;
    po.rope_dynamic = hp->rope_ext == BT_ROPE_EXT_DYNAMIC;
    po.qk_norm = hp->qk_norm;
    po.sandwich_norm = hp->sandwich_norm;
    po.preference = o->preference;
    t->ce_chunk = bt_plan_ce_chunk(&po);
    bt_plan plan;
    BTC_TRY(bt_plan_step(&plan, &d, &po));
    t->x_in = (bt_bf16 **)calloc((size_t)t->L + 1, sizeof(bt_bf16 *));
    if (!t->x_in)
        return bt_fail(BT_ERR_NOMEM, "cuda: out of host memory");
    t->acts.assign((size_t)(t->ckpt ? 1 : t->L), btc_acts{});
    BTC_TRY(alloc_plan(t, &plan));
    t->plan_bytes = t->bytes;

    BTC_TRY(BTC_CUDA(cudaMemset(t->g, 0, (size_t)t->n_params * sizeof(float))));
    BTC_TRY(bt_cuda_trainer_upload_lora(t, lo));
    BTC_TRY(btc_optim_init(t));
    if (t->offload) { /* the copies of the layer inputs to / from pinned host memory */
        BTC_TRY(BTC_CUDA(cudaStreamCreateWithFlags(&t->copy_stream, cudaStreamNonBlocking)));
        t->ev_out.assign((size_t)t->L + 1, nullptr);
        t->ev_copy.assign((size_t)t->L + 1, nullptr);
        for (int l = 0; l <= t->L; l++) {
            BTC_TRY(BTC_CUDA(cudaEventCreateWithFlags(&t->ev_out[l], cudaEventDisableTiming)));
            BTC_TRY(BTC_CUDA(cudaEventCreateWithFlags(&t->ev_copy[l], cudaEventDisableTiming)));
        }
    }
    if (m->inv_freq) {
        /* the model's RoPE table (default / llama3 / GGUF rope_freqs, context scaling), exactly
         * the CPU step's */
        BTC_TRY(BTC_CUDA(cudaMemcpy(t->d_inv_freq, m->inv_freq, sizeof(float) * (size_t)(t->hd / 2),
                                    cudaMemcpyHostToDevice)));
        t->h_inv_freq.assign(m->inv_freq, m->inv_freq + t->hd / 2);
    }
    BTC_TRY(BTC_CUDA(cudaMallocHost((void **)&t->h_loss, sizeof(double))));
    *t->h_loss = 0;
    t->h_tgt.assign((size_t)max_M, -100);
    BTC_TRY(BTC_CUDA(cudaDeviceSynchronize()));
    sample_mem(t);
    return 0;
}

extern "C" int bt_cuda_trainer_new(bt_cuda_trainer **out, const bt_model *m, const bt_lora *lo,
                                   int max_M, const bt_cuda_trainer_opts *opts)
{
    *out = nullptr;
    if (!m || !lo || max_M < 1)
        return bt_fail(BT_ERR_INVALID, "cuda: bad trainer arguments (max_M %d)", max_M);
    /* Gemma 3's GeGLU, sandwich norms, QK-norm, scaled embeddings and local RoPE table are here;
     * its sliding-window layers need the GPU attention's window (the backend's sliding_window
     * flag), and its head_dim 256 the attention kernels' (checked in trainer_init) */
    if (m->hp.arch == BT_ARCH_GEMMA3 && !bt_backend_cuda_reg.sliding_window)
        return bt_fail(BT_ERR_UNSUPPORTED, "cuda: device \"cuda\" does not implement the Gemma 3 "
                       "family (gemma3) yet: its sliding-window attention has no GPU kernel in this "
                       "build; it is verified on the CPU backend only; use device: \"cpu\"");
    if (m->hp.act != BT_ACT_SILU && m->hp.act != BT_ACT_GELU_TANH)
        return bt_fail(BT_ERR_UNSUPPORTED, "cuda: MLP activation %d has no GPU kernel", m->hp.act);
    if (lo->norms && m->hp.sandwich_norm) /* as the CPU step (trainer/loop/step.c) */
        return bt_fail(BT_ERR_UNSUPPORTED, "cuda: trainable RMSNorm weights (LoRA+ norms) are not "
                       "supported for %s (its norms hold 1 + w); train LoRA only",
                       bt_arch_name(m->hp.arch));
    bt_cuda_trainer_opts o;
    memset(&o, 0, sizeof o);
    if (opts)
        o = *opts;
    if (bt_cuda_device_count() <= 0)
        return bt_fail(BT_ERR_IO, "cuda: no usable CUDA device (%s)", bt_last_error());
    bt_cuda_trainer *t = new bt_cuda_trainer();
    t->dev = o.device;
    t->desc_wd = -1.f;
    int rc = BTC_CUDA(cudaSetDevice(t->dev));
    if (!rc)
        rc = BTC_CUDA(cudaFree(0)); /* create the context before the baseline */
    if (!rc) {
        cudaDeviceProp prop;
        if (cudaGetDeviceProperties(&prop, t->dev) == cudaSuccess)
            snprintf(t->dev_name, sizeof t->dev_name, "%s", prop.name);
        size_t fr = 0, tot = 0;
        cudaMemGetInfo(&fr, &tot);
        t->base_used = tot - fr;
        t->peak_used = t->base_used;
        rc = trainer_init(t, m, lo, max_M, &o);
    }
    if (rc) {
        bt_cuda_trainer_free(t);
        return rc;
    }
    *out = t;
    return 0;
}
