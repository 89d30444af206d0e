/* Forward/backward orchestration of Llama + LoRA on the CPU kernels. See step.h. */
#include "trainer/loop/step.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "kernels/kernels.h"
#include "trainer/backend/plan.h"
#include "trainer/backend/profile.h"


typedef struct {
    float *xn1, *rstd1, *q, *k, *v, *att, *lse, *x2, *xn2, *rstd2, *g, *u;
    float *as[BT_MOD_N];
    /* QK-norm (hp.qk_norm, Qwen3) only, else NULL: q / k before the per-head RMSNorm (its
     * backward input) [M, Dq] / [M, Dkv] and its rstd [M * Hq] / [M * Hkv] */
    float *qr, *kr, *rq, *rk;
    /* sandwich norms (hp.sandwich_norm, Gemma 3) only, else NULL: o_proj's and down_proj's
     * outputs before their RMSNorm [M, D] and its rstd [M] */
    float *ao, *rpa, *fo, *rpf;
} layer_acts;

struct bt_step_ctx {
    int max_M, ckpt, n_layer;
    int s2_group;      /* S^2-Attn group for training micro-batches (0 = full attention) */
    int s2_now;        /* the group of the pass in progress (0 outside training) */
    float attn_scale;  /* bt_model_attn_scale */
    float *rope_tab;   /* [hd/2] the pass's RoPE table when it differs from m->inv_freq (dynamic) */
    const float *inv;  /* the RoPE table of the pass in progress */
    bt_rope_cache rope; /* cos/sin of `inv` by position (kernels.h), this context's own */
    bt_rope_cache rope_local; /* the same for the local layers' table (m->inv_freq_local) */
    int D, Dq, Dkv, F, V, r, Hq, Hkv, hd; /* bt_dims_of(&m->hp); r: the LoRA rank (1 without) */
    float **x_in;      /* [n_layer + 1][max_M * D]: input of each layer; [n_layer] = final hidden */
    layer_acts *acts;  /* [n_layer], or [1] shared when checkpointing */
    float *xf, *rstdf, *h;
    float *dx, *dx2, *dxn, *dtmp, *dq, *dk, *dv, *datt, *dg, *du, *dh, *das, *xd;
    float *scratch, *ce_ws;
    int32_t *targets;
    int n_acts;        /* layers whose activations are kept: n_layer, or 1 when checkpointing */
    void **allocs;
    int n_allocs, cap_allocs;
    size_t bytes;
    bt_prof *prof; /* --profile: per-op times (NULL = off) */
    int (*check)(void *); /* bt_step_ctx_set_check: asked between layers; NULL = never */
    void *check_arg;
    const bt_microbatch *lp_mb; /* bt_forward_logprobs' training pass awaiting its backward */
};

/* Runs `call`; when profiling, times it as op `name` writing `bytes` (trainer/backend/profile.h). */
#define OP(c, name, bytes, call)                                                                   \
    do {                                                                                           \
        if (!(c)->prof) {                                                                          \
            call;                                                                                  \
            break;                                                                                 \
        }                                                                                          \
        double t0_ = bt_now();                                                                     \
        call;                                                                                      \
        bt_prof_add((c)->prof, (name), bt_now() - t0_, (double)(bytes));                           \
    } while (0)
#define F4(n) ((double)(n) * 4.0) /* bytes of n floats */

void bt_step_ctx_set_profile(bt_step_ctx *c, bt_prof *p) { c->prof = p; }

void bt_step_ctx_set_check(bt_step_ctx *c, int (*check)(void *arg), void *arg) {
    c->check = check;
    c->check_arg = arg;
}

/* 0, or the check's error: the caller abandons the micro-batch. */
static int asked_to_stop(bt_step_ctx *c) { return c->check ? c->check(c->check_arg) : 0; }

/* One plan buffer's allocation: bytes of it (at least one element is allocated, so a 0-element
 * buffer is a valid pointer, billed as 0 bytes). */
static void *ctx_alloc(bt_step_ctx *c, size_t bytes, size_t elem) {
    if (c->n_allocs == c->cap_allocs) {
        c->cap_allocs = c->cap_allocs ? 2 * c->cap_allocs : 64;
        c->allocs = bt_xrealloc(c->allocs, (size_t)c->cap_allocs * sizeof(void *));
    }
    void *p = bt_aligned_alloc(bytes ? bytes : elem);
    if (p) {
        c->allocs[c->n_allocs++] = p;
        c->bytes += bytes;
    }
    return p;
}

/* Point copy i of plan buffer `id` at p (the context's field for it). */
static void bind(bt_step_ctx *c, int id, int i, void *p) {
    layer_acts *A = &c->acts[i < c->n_acts ? i : 0];
    switch (id) {
    case BT_BUF_X_IN: c->x_in[i] = p; break;
    case BT_BUF_XN1: A->xn1 = p; break;
    case BT_BUF_RSTD1: A->rstd1 = p; break;
    case BT_BUF_Q: A->q = p; break;
    case BT_BUF_K: A->k = p; break;
    case BT_BUF_V: A->v = p; break;
    case BT_BUF_ATT: A->att = p; break;
    case BT_BUF_LSE: A->lse = p; break;
    case BT_BUF_X2: A->x2 = p; break;
    case BT_BUF_XN2: A->xn2 = p; break;
    case BT_BUF_RSTD2: A->rstd2 = p; break;
    case BT_BUF_G: A->g = p; break;
    case BT_BUF_U: A->u = p; break;
    case BT_BUF_QR: A->qr = p; break;
    case BT_BUF_KR: A->kr = p; break;
    case BT_BUF_RQ: A->rq = p; break;
    case BT_BUF_RK: A->rk = p; break;
    case BT_BUF_AO: A->ao = p; break;
    case BT_BUF_RPA: A->rpa = p; break;
    case BT_BUF_FO: A->fo = p; break;
    case BT_BUF_RPF: A->rpf = p; break;
    case BT_BUF_XF: c->xf = p; break;
    case BT_BUF_RSTDF: c->rstdf = p; break;
    case BT_BUF_H: c->h = p; break;
    case BT_BUF_DX: c->dx = p; break;
    case BT_BUF_DX2: c->dx2 = p; break;
    case BT_BUF_DXN: c->dxn = p; break;
    case BT_BUF_DTMP: c->dtmp = p; break;
    case BT_BUF_DQ: c->dq = p; break;
    case BT_BUF_DK: c->dk = p; break;
    case BT_BUF_DV: c->dv = p; break;
    case BT_BUF_DATT: c->datt = p; break;
    case BT_BUF_DG: c->dg = p; break;
    case BT_BUF_DU: c->du = p; break;
    case BT_BUF_DH: c->dh = p; break;
    case BT_BUF_DXA: c->das = p; break;
    case BT_BUF_XD: c->xd = p; break;
    case BT_BUF_TILES: c->scratch = p; break;
    case BT_BUF_ROPE: c->rope_tab = p; break;
    case BT_BUF_CE_WS: c->ce_ws = p; break;
    case BT_BUF_TARGETS: c->targets = p; break;
    default: /* BT_BUF_XA + mod */
        A->as[id - BT_BUF_XA] = p;
        break;
    }
}

void bt_step_ctx_free(bt_step_ctx *c) {
    if (!c) return;
    for (int i = 0; i < c->n_allocs; i++) free(c->allocs[i]);
    free(c->allocs);
    free(c->x_in);
    free(c->acts);
    bt_rope_cache_free(&c->rope);
    bt_rope_cache_free(&c->rope_local);
    free(c);
}

size_t bt_step_ctx_bytes(const bt_step_ctx *c) { return c->bytes; }

int bt_step_set_s2(bt_step_ctx *c, int s2_group) {
    if (s2_group < 0 || (s2_group & 1))
        return bt_fail(BT_ERR_INVALID, "step: S^2-Attn group %d must be 0 or a positive even number",
                       s2_group);
    c->s2_group = s2_group;
    return 0;
}

int bt_step_ctx_new(bt_step_ctx **out, const bt_model *m, const bt_lora *lo, int max_M,
                    int checkpointing) {
    *out = NULL;
    if (max_M < 1) return bt_fail(BT_ERR_INVALID, "step: max_M %d < 1", max_M);
    if (!m->inv_freq)
        return bt_fail(BT_ERR_INVALID, "step: the model has no RoPE table (bt_model_rope_init)");
    const bt_dims d = bt_dims_of(&m->hp);
    bt_plan plan;
    bt_plan_opts po;
    memset(&po, 0, sizeof po);
    po.backend = BT_PLAN_CPU;
    po.max_M = max_M;
    po.checkpointing = checkpointing;
    po.r = lo ? lo->r : 0;
    po.target_mask = lo ? lo->target_mask : 0;
    po.quant_base = m->base_dtype == BT_BASE_NF4 || m->base_dtype == BT_BASE_GGUF;
    po.threads = omp_get_max_threads(); /* as bt_model_scratch_floats sizes the tiles */
    po.qk_norm = m->hp.qk_norm;
    po.sandwich_norm = m->hp.sandwich_norm;
    if (lo && lo->norms && m->hp.sandwich_norm)
        return bt_fail(BT_ERR_UNSUPPORTED, "step: trainable RMSNorm weights (LoRA+ norms) are not "
                       "supported for %s (its norms hold 1 + w); train LoRA only",
                       bt_arch_name(m->hp.arch));
    int rc = bt_plan_step(&plan, &d, &po);
    if (rc) return rc;
    bt_step_ctx *c = bt_xcalloc(1, sizeof *c);
    c->max_M = max_M;
    c->ckpt = checkpointing;
    c->n_layer = d.L;
    c->D = d.D;
    c->Hq = d.Hq;
    c->Hkv = d.Hkv;
    c->hd = d.hd;
    c->Dq = d.Dq;
    c->Dkv = d.Dkv;
    c->F = d.F;
    c->V = d.V;
    c->r = lo ? lo->r : 1;
    c->attn_scale = bt_model_attn_scale(&m->hp);
    c->n_acts = checkpointing ? 1 : c->n_layer;
    c->x_in = calloc((size_t)c->n_layer + 1, sizeof(float *));
    c->acts = calloc((size_t)c->n_acts, sizeof(layer_acts));
    if (!c->x_in || !c->acts) goto oom;
    /* the plan's buffers, one allocation per copy (trainer/backend/plan.h) */
    for (int b = 0; b < plan.n; b++) {
        const bt_plan_buf *pb = &plan.buf[b];
        const size_t elem = bt_dtype_size(pb->dtype);
        for (int i = 0; i < pb->copies; i++) {
            void *p = ctx_alloc(c, (size_t)pb->count * elem, elem);
            if (!p) goto oom;
            bind(c, pb->id, i, p);
        }
    }
    *out = c;
    return 0;
oom:;
    size_t want = c->bytes;
    bt_step_ctx_free(c);
    return bt_fail(BT_ERR_NOMEM, "step: out of memory for activations of %d tokens (%zu MiB "
                   "allocated so far; try activation_checkpointing or a smaller micro-batch)",
                   max_M, want >> 20);
}

static void add_into(float *dst, const float *a, const float *b, int64_t n) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) dst[i] = a[i] + b[i];
}

/* Base linear + LoRA branch for module `mod` of layer `l`: y = W x (+ lora). */
static void proj_fwd(bt_step_ctx *c, const bt_model *m, const bt_lora *lo, int l, int mod,
                     float *y, const float *x, int M, layer_acts *A, uint64_t key) {
    const bt_base_linear *b = &m->layers[l].lin[mod];
    char nm[2][48];
    if (c->prof) {
        snprintf(nm[0], sizeof nm[0], "%s base fwd%s", bt_module_name(mod), b->is_nf4 ? " (nf4)" : "");
        snprintf(nm[1], sizeof nm[1], "%s lora fwd", bt_module_name(mod));
    }
    OP(c, nm[0], F4((int64_t)M * b->rows), bt_base_fwd(y, x, b, M, 0.f, c->scratch));
    const bt_lora_mod *md = bt_lora_get(lo, l, mod);
    if (md)
        OP(c, nm[1], F4((int64_t)M * (b->rows + lo->r)),
           bt_lora_fwd(lo, md, y, x, M, A->as[mod], c->xd, bt_lora_drop_key(key, l, md->group)));
}

/* dx (+)= dy @ W (+ LoRA backward, which also accumulates the LoRA grads). */
static void proj_bwd(bt_step_ctx *c, const bt_model *m, const bt_lora *lo, int l, int mod,
                     float *dx, const float *dy, const float *x, int M, float beta, layer_acts *A,
                     uint64_t key) {
    const bt_base_linear *b = &m->layers[l].lin[mod];
    char nm[2][48];
    if (c->prof) {
        snprintf(nm[0], sizeof nm[0], "%s base bwd%s", bt_module_name(mod), b->is_nf4 ? " (nf4)" : "");
        snprintf(nm[1], sizeof nm[1], "%s lora bwd", bt_module_name(mod));
    }
    OP(c, nm[0], F4((int64_t)M * b->cols), bt_base_bwd_x(dx, dy, b, M, beta, c->scratch));
    const bt_lora_mod *md = bt_lora_get(lo, l, mod);
    if (md)
        OP(c, nm[1], F4((int64_t)M * b->cols + (int64_t)lo->r * (b->rows + b->cols)),
           bt_lora_bwd(lo, md, dx, dy, x, A->as[mod], M, c->das, c->xd,
                       bt_lora_drop_key(key, l, md->group)));
}

/* The MLP's gated activation: SwiGLU, or GeGLU with the tanh GELU (hp.act, Gemma 3). */
static void glu_fwd(const bt_model *m, float *h, const float *g, const float *u, int64_t n) {
    if (m->hp.act == BT_ACT_GELU_TANH) bt_geglu_fwd(h, g, u, n);
    else bt_swiglu_fwd(h, g, u, n);
}
static void glu_bwd(const bt_model *m, float *dg, float *du, const float *dh, const float *g,
                    const float *u, int64_t n) {
    if (m->hp.act == BT_ACT_GELU_TANH) bt_geglu_bwd(dg, du, dh, g, u, n);
    else bt_swiglu_bwd(dg, du, dh, g, u, n);
}

static int layer_fwd(bt_step_ctx *c, const bt_model *m, const bt_lora *lo, int l,
                      const bt_microbatch *mb, uint64_t key) {
    int M = mb->B * mb->T;
    layer_acts *A = &c->acts[c->ckpt ? 0 : l];
    const float *x = c->x_in[l];
    float *xout = c->x_in[l + 1];
    int64_t nD = (int64_t)M * c->D;
    float eps = m->hp.rms_eps;

    OP(c, "rmsnorm fwd", F4(nD + M), bt_rmsnorm_fwd(A->xn1, A->rstd1, x, bt_lora_norm(lo, m, l, 0), M, c->D, eps));
    const bt_layer *L = &m->layers[l];
    proj_fwd(c, m, lo, l, BT_MOD_Q, A->qr ? A->qr : A->q, A->xn1, M, A, key);
    proj_fwd(c, m, lo, l, BT_MOD_K, A->kr ? A->kr : A->k, A->xn1, M, A, key);
    proj_fwd(c, m, lo, l, BT_MOD_V, A->v, A->xn1, M, A, key);
    if (A->qr) { /* Qwen3 QK-norm: RMSNorm over each head's head_dim values, before RoPE */
        OP(c, "qk-norm fwd", F4((int64_t)M * (c->Dq + c->Dkv)),
           (bt_rmsnorm_fwd(A->q, A->rq, A->qr, L->q_norm, M * c->Hq, c->hd, eps),
            bt_rmsnorm_fwd(A->k, A->rk, A->kr, L->k_norm, M * c->Hkv, c->hd, eps)));
    }
    int rc;
    /* the layer's RoPE table and window (Gemma 3's local layers: their own base and window) */
    const float *inv = bt_model_layer_inv(m, l, c->inv);
    bt_rope_cache *rcache = inv == c->inv ? &c->rope : &c->rope_local;
    const int win = bt_model_layer_window(&m->hp, l);
    OP(c, "rope fwd", F4((int64_t)M * c->Dq),
       rc = bt_rope_fwd_cached(rcache, A->q, mb->position_ids, M, c->Hq, c->hd, inv, 1.0f));
    if (rc) return rc;
    OP(c, "rope fwd", F4((int64_t)M * c->Dkv),
       rc = bt_rope_fwd_cached(rcache, A->k, mb->position_ids, M, c->Hkv, c->hd, inv, 1.0f));
    if (rc) return rc;
    OP(c, "attention fwd", F4((int64_t)M * (c->Dq + c->Hq)),
       rc = bt_attn_fwd_win(A->att, A->lse, A->q, A->k, A->v, mb->cu_seqlens, mb->n_cu - 1, M,
                            c->Hq, c->Hkv, c->hd, c->attn_scale, c->s2_now, win));
    if (rc) return rc;
    proj_fwd(c, m, lo, l, BT_MOD_O, A->ao ? A->ao : A->x2, A->att, M, A, key);
    if (A->ao) /* Gemma 3 post_attention_layernorm of the attention output */
        OP(c, "rmsnorm fwd", F4(nD + M),
           bt_rmsnorm_fwd(A->x2, A->rpa, A->ao, L->post_attn_norm, M, c->D, eps));
    OP(c, "residual add", F4(nD), add_into(A->x2, A->x2, x, nD));
    OP(c, "rmsnorm fwd", F4(nD + M),
       bt_rmsnorm_fwd(A->xn2, A->rstd2, A->x2, bt_lora_norm(lo, m, l, 1), M, c->D, eps));
    proj_fwd(c, m, lo, l, BT_MOD_GATE, A->g, A->xn2, M, A, key);
    proj_fwd(c, m, lo, l, BT_MOD_UP, A->u, A->xn2, M, A, key);
    OP(c, "glu fwd", F4((int64_t)M * c->F), glu_fwd(m, c->h, A->g, A->u, (int64_t)M * c->F));
    proj_fwd(c, m, lo, l, BT_MOD_DOWN, A->fo ? A->fo : xout, c->h, M, A, key);
    if (A->fo) /* Gemma 3 post_feedforward_layernorm of the MLP output */
        OP(c, "rmsnorm fwd", F4(nD + M),
           bt_rmsnorm_fwd(xout, A->rpf, A->fo, L->post_ffn_norm, M, c->D, eps));
    OP(c, "residual add", F4(nD), add_into(xout, xout, A->x2, nD));
    return 0;
}

/* On entry c->dx = dLoss/d(layer output); on exit c->dx = dLoss/d(layer input). */
static int layer_bwd(bt_step_ctx *c, const bt_model *m, const bt_lora *lo, int l,
                      const bt_microbatch *mb, uint64_t key) {
    int M = mb->B * mb->T;
    layer_acts *A = &c->acts[c->ckpt ? 0 : l];
    const float *x = c->x_in[l];
    int64_t nD = (int64_t)M * c->D;
    int rc;

    if (c->ckpt) { /* recompute (rewrites x_in[l+1] identically) */
        if ((rc = layer_fwd(c, m, lo, l, mb, key))) return rc;
    } else /* h is not kept per layer */
        OP(c, "glu fwd (recompute)", F4((int64_t)M * c->F),
           glu_fwd(m, c->h, A->g, A->u, (int64_t)M * c->F));
    const bt_layer *Ly = &m->layers[l];
    const int win = bt_model_layer_window(&m->hp, l);
    const float *inv = bt_model_layer_inv(m, l, c->inv);
    bt_rope_cache *rcache = inv == c->inv ? &c->rope : &c->rope_local;

    /* MLP (Gemma 3: first back through post_feedforward_layernorm, into dtmp) */
    const float *dmlp = c->dx;
    if (A->fo) {
        OP(c, "rmsnorm bwd", F4(nD),
           bt_rmsnorm_bwd(c->dtmp, NULL, c->dx, A->fo, Ly->post_ffn_norm, A->rpf, M, c->D));
        dmlp = c->dtmp;
    }
    proj_bwd(c, m, lo, l, BT_MOD_DOWN, c->dh, dmlp, c->h, M, 0.f, A, key);
    OP(c, "glu bwd", F4(2 * (int64_t)M * c->F),
       glu_bwd(m, c->dg, c->du, c->dh, A->g, A->u, (int64_t)M * c->F));
    proj_bwd(c, m, lo, l, BT_MOD_GATE, c->dxn, c->dg, A->xn2, M, 0.f, A, key);
    proj_bwd(c, m, lo, l, BT_MOD_UP, c->dxn, c->du, A->xn2, M, 1.f, A, key);
    OP(c, "rmsnorm bwd", F4(nD), bt_rmsnorm_bwd(c->dtmp, bt_lora_dnorm(lo, l, 1), c->dxn, A->x2,
                                                bt_lora_norm(lo, m, l, 1), A->rstd2, M, c->D));
    OP(c, "residual add", F4(nD), add_into(c->dx2, c->dx, c->dtmp, nD));
    /* attention (Gemma 3: first back through post_attention_layernorm, into dtmp) */
    const float *dattn = c->dx2;
    if (A->ao) {
        OP(c, "rmsnorm bwd", F4(nD),
           bt_rmsnorm_bwd(c->dtmp, NULL, c->dx2, A->ao, Ly->post_attn_norm, A->rpa, M, c->D));
        dattn = c->dtmp;
    }
    proj_bwd(c, m, lo, l, BT_MOD_O, c->datt, dattn, A->att, M, 0.f, A, key);
    OP(c, "attention bwd", F4((int64_t)M * (c->Dq + 2 * c->Dkv)),
       rc = bt_attn_bwd_win(c->dq, c->dk, c->dv, c->datt, A->att, A->lse, A->q, A->k, A->v,
                            mb->cu_seqlens, mb->n_cu - 1, M, c->Hq, c->Hkv, c->hd, c->attn_scale,
                            c->s2_now, win));
    if (rc) return rc;
    OP(c, "rope bwd", F4((int64_t)M * c->Dq),
       rc = bt_rope_bwd_cached(rcache, c->dq, mb->position_ids, M, c->Hq, c->hd, inv, 1.0f));
    if (rc) return rc;
    OP(c, "rope bwd", F4((int64_t)M * c->Dkv),
       rc = bt_rope_bwd_cached(rcache, c->dk, mb->position_ids, M, c->Hkv, c->hd, inv, 1.0f));
    if (rc) return rc;
    if (A->qr) { /* QK-norm backward, in place (the norm weights are frozen: no dw) */
        const bt_layer *L = &m->layers[l];
        OP(c, "qk-norm bwd", F4((int64_t)M * (c->Dq + c->Dkv)),
           (bt_rmsnorm_bwd(c->dq, NULL, c->dq, A->qr, L->q_norm, A->rq, M * c->Hq, c->hd),
            bt_rmsnorm_bwd(c->dk, NULL, c->dk, A->kr, L->k_norm, A->rk, M * c->Hkv, c->hd)));
    }
    proj_bwd(c, m, lo, l, BT_MOD_Q, c->dxn, c->dq, A->xn1, M, 0.f, A, key);
    proj_bwd(c, m, lo, l, BT_MOD_K, c->dxn, c->dk, A->xn1, M, 1.f, A, key);
    proj_bwd(c, m, lo, l, BT_MOD_V, c->dxn, c->dv, A->xn1, M, 1.f, A, key);
    OP(c, "rmsnorm bwd", F4(nD), bt_rmsnorm_bwd(c->dtmp, bt_lora_dnorm(lo, l, 0), c->dxn, x,
                                                bt_lora_norm(lo, m, l, 0), A->rstd1, M, c->D));
    OP(c, "residual add", F4(nD), add_into(c->dx, c->dx2, c->dtmp, nD));
    return 0;
}

/* Validate, shift targets, then run embedding -> layers -> final RMSNorm (into c->x_in, c->xf).
 * training: S^2-Attn (c->s2_group) for this pass; evaluation and inference use full attention. */
static int forward_hidden(bt_step_ctx *c, const bt_model *m, const bt_lora *lo,
                          const bt_microbatch *mb, uint64_t drop_key, int training) {
    if ((int64_t)mb->B * mb->T > c->max_M)
        return bt_fail(BT_ERR_RANGE, "step: micro-batch of %d x %d tokens exceeds the workspace (%d)",
                       mb->B, mb->T, c->max_M);
    int rc = bt_shift_targets(c->targets, mb, c->V);
    if (rc < 0) return rc;
    int M = mb->B * mb->T;
    if (lo && lo->mods && lo->n_layer != c->n_layer)
        return bt_fail(BT_ERR_INVALID, "step: LoRA has %d layers, model %d", lo->n_layer, c->n_layer);
    /* the RoPE table of this pass: the model's, or dynamic NTK's for its longest position */
    int32_t maxp = 0;
    for (int t = 0; t < M; t++) maxp = mb->position_ids[t] > maxp ? mb->position_ids[t] : maxp;
    if ((rc = bt_model_rope_table(m, (int64_t)maxp + 1, c->rope_tab)) < 0) return rc;
    c->inv = rc == 1 ? c->rope_tab : m->inv_freq;
    c->s2_now = training ? c->s2_group : 0;

    OP(c, "embedding fwd", F4((int64_t)M * c->D),
       rc = bt_embedding_fwd(c->x_in[0], bt_lora_embed(lo, m), mb->input_ids, M, c->D, c->V));
    if (rc) return rc;
    if (m->hp.embed_scale > 0.f) /* Gemma: Gemma3TextScaledWordEmbedding's sqrt(hidden_size) */
        OP(c, "embedding scale", F4((int64_t)M * c->D),
           bt_scale(c->x_in[0], (int64_t)M * c->D, m->hp.embed_scale));
    for (int l = 0; l < c->n_layer; l++) {
        if ((rc = asked_to_stop(c))) return rc;
        if ((rc = layer_fwd(c, m, lo, l, mb, drop_key))) return rc;
    }
    OP(c, "rmsnorm fwd", F4((int64_t)M * c->D + M),
       bt_rmsnorm_fwd(c->xf, c->rstdf, c->x_in[c->n_layer], bt_lora_norm(lo, m, c->n_layer, 0),
                      M, c->D, m->hp.rms_eps));
    return 0;
}

int bt_forward_hidden(bt_step_ctx *c, const bt_model *m, const bt_lora *lo,
                      const bt_microbatch *mb, uint64_t drop_key) {
    c->lp_mb = NULL;
    return forward_hidden(c, m, lo, mb, drop_key, 0);
}

const float *bt_step_hidden(const bt_step_ctx *c, int i) {
    if (i < 0 || i > c->n_layer + 1) return NULL;
    return i <= c->n_layer ? c->x_in[i] : c->xf;
}

/* From dLoss/dxf in c->dtmp: the final RMSNorm's backward, every layer's, and the embedding's
 * scatter-add into a trainable embedding (LoRA+). */
static int backward_from_final(bt_step_ctx *c, const bt_model *m, bt_lora *lo,
                               const bt_microbatch *mb, uint64_t drop_key) {
    int rc;
    const int M = mb->B * mb->T;
    if ((rc = asked_to_stop(c))) return rc;
    OP(c, "rmsnorm bwd", F4((int64_t)M * c->D),
       bt_rmsnorm_bwd(c->dx, bt_lora_dnorm(lo, c->n_layer, 0), c->dtmp, c->x_in[c->n_layer],
                      bt_lora_norm(lo, m, c->n_layer, 0), c->rstdf, M, c->D));
    for (int l = c->n_layer - 1; l >= 0; l--) {
        if ((rc = asked_to_stop(c))) return rc;
        if ((rc = layer_bwd(c, m, lo, l, mb, drop_key))) return rc;
    }
    /* c->dx = dLoss/d(embedding output): scatter-add into a trainable embedding (LoRA+) */
    if (bt_lora_dembed(lo) && m->hp.embed_scale > 0.f)
        bt_scale(c->dx, (int64_t)M * c->D, m->hp.embed_scale);
    if (bt_lora_dembed(lo))
        OP(c, "embedding bwd", F4((int64_t)c->V * c->D),
           rc = bt_embedding_bwd(bt_lora_dembed(lo), c->dx, mb->input_ids, M, c->D, c->V));
    return rc;
}

int bt_forward_logprobs(bt_step_ctx *c, const bt_model *m, const bt_lora *lo,
                        const bt_microbatch *mb, int backward, uint64_t drop_key, float *logp,
                        int *n_valid) {
    c->lp_mb = NULL;
    if (!logp || (backward && !lo))
        return bt_fail(BT_ERR_INVALID, "step: log-probs need an output array%s",
                       backward ? " and, for a training pass, the LoRA adapter" : "");
    int rc = forward_hidden(c, m, lo, mb, drop_key, backward);
    if (rc) return rc;
    const int M = mb->B * mb->T;
    /* the unit-upstream gradient d logp_t / d xf_t into c->dtmp; bt_backward_logprobs scales its
     * rows once the loss knows dlogp (kernels.h: a row's gradient is linear in its upstream) */
    OP(c, backward ? "lm_head + log-probs fwd+bwd" : "lm_head + log-probs fwd",
       backward ? F4((int64_t)M * c->D) : 0.0,
       bt_linear_logprob(logp, backward ? c->dtmp : NULL, NULL, c->xf, bt_lora_lm_head(lo, m),
                         c->targets, NULL, M, c->D, c->V, BT_PLAN_CPU_CE_ROWS, c->ce_ws));
    if (n_valid) {
        int nv = 0;
        for (int t = 0; t < M; t++) nv += c->targets[t] >= 0 && c->targets[t] < c->V;
        *n_valid = nv;
    }
    if (backward) c->lp_mb = mb;
    return 0;
}

int bt_backward_logprobs(bt_step_ctx *c, const bt_model *m, bt_lora *lo, const bt_microbatch *mb,
                         const float *dlogp, uint64_t drop_key) {
    if (!dlogp || !lo || c->lp_mb != mb)
        return bt_fail(BT_ERR_INVALID, "step: bt_backward_logprobs must follow bt_forward_logprobs "
                       "with backward on the same micro-batch, and needs dlogp and the adapter");
    c->lp_mb = NULL;
    const int M = mb->B * mb->T;
    float *dW = bt_lora_dlm_head(lo);
    if (dW) {
        /* a trainable lm_head (tied LoRA+ embedding) needs dlogp inside the vocabulary pass: one
         * more pass, which also rewrites dX with dlogp applied */
        OP(c, "lm_head + log-probs bwd (dW)", F4((int64_t)M * c->D),
           bt_linear_logprob(NULL, c->dtmp, dW, c->xf, bt_lora_lm_head(lo, m), c->targets, dlogp,
                             M, c->D, c->V, BT_PLAN_CPU_CE_ROWS, c->ce_ws));
    } else {
        for (int t = 0; t < M; t++) {
            float *row = c->dtmp + (size_t)t * c->D;
            const float g = dlogp[t];
            for (int d = 0; d < c->D; d++) row[d] *= g;
        }
    }
    return backward_from_final(c, m, lo, mb, drop_key);
}

int bt_forward_backward(bt_step_ctx *c, const bt_model *m, bt_lora *lo, const bt_microbatch *mb,
                        int backward, float grad_scale, uint64_t drop_key, double *loss_sum,
                        int *n_valid) {
    c->lp_mb = NULL;
    int rc = forward_hidden(c, m, lo, mb, drop_key, backward);
    if (rc) return rc;
    int M = mb->B * mb->T;
    int nv = 0;
    /* dLoss/dxf goes into c->dtmp (free until the first layer's backward). */
    /* LoRA+: a trainable embedding tied to lm_head also gets the CE's weight gradient */
    double loss = 0;
    OP(c, backward ? "lm_head + cross-entropy fwd+bwd" : "lm_head + cross-entropy fwd",
       backward ? F4((int64_t)M * c->D) : 0.0,
       loss = bt_linear_ce_dw(backward ? c->dtmp : NULL, backward ? bt_lora_dlm_head(lo) : NULL,
                              &nv, c->xf, bt_lora_lm_head(lo, m), c->targets, M, c->D, c->V,
                              BT_PLAN_CPU_CE_ROWS, grad_scale, c->ce_ws));
    if (loss_sum) *loss_sum = loss;
    if (n_valid) *n_valid = nv;
    if (!backward) return 0;
    return backward_from_final(c, m, lo, mb, drop_key);
}
