/* LoRA parameters, initialisation, dropout and the branch's forward/backward. See lora.h. */
#include "trainer/model/lora.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "kernels/kernels.h"
#include "trainer/model/rng.h"

/* The fused group's first module (Phi-3: q for q/k/v, gate for gate/up), else mod itself. */
static int group_of(int fused, int mod) {
    if (!fused) return mod;
    return mod <= BT_MOD_V ? BT_MOD_Q : (mod == BT_MOD_GATE || mod == BT_MOD_UP) ? BT_MOD_GATE : mod;
}

const char *bt_lora_fused_name(int arch, int mod) {
    if (arch != BT_ARCH_PHI3) return NULL;
    return mod <= BT_MOD_V ? "qkv_proj" : (mod == BT_MOD_GATE || mod == BT_MOD_UP) ? "gate_up_proj" : NULL;
}

static void mod_shape(const bt_model *md, int mod, int *out, int *in) {
    const bt_base_linear *l = &md->layers[0].lin[mod];
    *out = l->rows;
    *in = l->cols;
}

int bt_lora_init(bt_lora *lo, const bt_model *md, int r, double alpha, double dropout,
                 unsigned target_mask, unsigned trainable, uint64_t seed) {
    memset(lo, 0, sizeof *lo);
    if (r < 1 || !(alpha > 0) || !(dropout >= 0 && dropout < 1) ||
        (target_mask & ((1u << BT_MOD_N) - 1)) == 0 ||
        (trainable & ~(unsigned)(BT_TRAIN_EMBED | BT_TRAIN_NORM)))
        return bt_fail(BT_ERR_INVALID, "lora: invalid settings (r %d, alpha %g, dropout %g, mask %#x, "
                       "trainable %#x)", r, alpha, dropout, target_mask, trainable);
    /* Phi-3 (hp.arch BT_ARCH_PHI3): PEFT adapts the fused qkv_proj / gate_up_proj with ONE
     * lora_A each (transformers Phi3Attention / Phi3MLP; see lora.h): a group is all or nothing */
    const unsigned qkv = (1u << BT_MOD_Q) | (1u << BT_MOD_K) | (1u << BT_MOD_V),
                   gu = (1u << BT_MOD_GATE) | (1u << BT_MOD_UP);
    const int fused = md->hp.arch == BT_ARCH_PHI3;
    if (fused && (((target_mask & qkv) && (target_mask & qkv) != qkv) ||
                  ((target_mask & gu) && (target_mask & gu) != gu)))
        return bt_fail(BT_ERR_UNSUPPORTED, "lora: Phi-3 fuses q_proj / k_proj / v_proj into "
                       "qkv_proj and gate_proj / up_proj into gate_up_proj, which PEFT adapts as "
                       "one module each (one lora_A): target \"qkv_proj\" / \"gate_up_proj\" "
                       "(or all three / both of their parts), not %s",
                       (target_mask & qkv) && (target_mask & qkv) != qkv ? "part of qkv_proj"
                                                                         : "part of gate_up_proj");
    lo->r = r;
    lo->alpha = (float)alpha;
    lo->scale = (float)(alpha / r);
    lo->dropout = (float)dropout;
    lo->target_mask = target_mask & ((1u << BT_MOD_N) - 1);
    lo->n_layer = md->hp.n_layer;
    lo->fused = fused;
    int64_t n = 0;
    for (int mod = 0; mod < BT_MOD_N; mod++) {
        if (!(lo->target_mask & (1u << mod))) continue;
        int out, in;
        mod_shape(md, mod, &out, &in);
        /* a fused group's k / v / up share the first module's A */
        n += (int64_t)r * out + (group_of(fused, mod) == mod ? (int64_t)r * in : 0);
    }
    n *= md->hp.n_layer;
    lo->n_lora = n;
    lo->trainable = trainable;
    lo->vocab = md->hp.vocab;
    lo->d_model = md->hp.d_model;
    lo->tied = md->tied;
    int64_t n_embed = (trainable & BT_TRAIN_EMBED) ? (int64_t)md->hp.vocab * md->hp.d_model : 0;
    int64_t n_norm = (trainable & BT_TRAIN_NORM) ? (int64_t)(2 * md->hp.n_layer + 1) * md->hp.d_model
                                                 : 0;
    lo->n_decay = n + n_embed;
    n += n_embed + n_norm;
    lo->n_params = n;
    lo->mods = calloc((size_t)lo->n_layer * BT_MOD_N, sizeof(bt_lora_mod));
    lo->params = bt_aligned_alloc((size_t)n * sizeof(float));
    lo->grads = bt_aligned_alloc((size_t)n * sizeof(float));
    lo->m = bt_aligned_alloc((size_t)n * sizeof(float));
    lo->v = bt_aligned_alloc((size_t)n * sizeof(float));
    if (!lo->mods || !lo->params || !lo->grads || !lo->m || !lo->v) {
        bt_lora_free(lo);
        return bt_fail(BT_ERR_NOMEM, "lora: out of memory for %lld parameters", (long long)n);
    }
    bt_rng rng;
    bt_rng_seed(&rng, seed);
    int64_t off = 0;
    for (int l = 0; l < lo->n_layer; l++)
        for (int mod = 0; mod < BT_MOD_N; mod++) {
            bt_lora_mod *x = &lo->mods[l * BT_MOD_N + mod];
            if (!(lo->target_mask & (1u << mod))) continue;
            mod_shape(md, mod, &x->out, &x->in);
            x->group = group_of(fused, mod);
            if (x->group != mod) { /* inside a fused group: the first module's A, the next rows of B */
                const bt_lora_mod *g = &lo->mods[l * BT_MOD_N + x->group], *prev = x - 1;
                x->A = g->A;
                x->dA = g->dA;
                x->row0 = prev->row0 + prev->out;
                x->B = g->B + (size_t)x->row0 * r;
                x->dB = g->dB + (size_t)x->row0 * r;
                off += (int64_t)x->out * r;
                continue;
            }
            x->A = lo->params + off;
            x->dA = lo->grads + off;
            off += (int64_t)r * x->in;
            x->B = lo->params + off;
            x->dB = lo->grads + off;
            if (fused && (mod == BT_MOD_Q || mod == BT_MOD_GATE)) {
                int o2, i2, last = mod == BT_MOD_Q ? BT_MOD_V : BT_MOD_UP;
                x->fused_out = 0;
                for (int k = mod; k <= last; k++) {
                    mod_shape(md, k, &o2, &i2);
                    x->fused_out += o2;
                }
                for (int k = mod + 1; k <= last; k++) lo->mods[l * BT_MOD_N + k].fused_out = x->fused_out;
            }
            off += (int64_t)x->out * r;
            /* torch.nn.init.kaiming_uniform_(A, a=sqrt(5)): gain = sqrt(2 / (1 + a^2)),
             * bound = gain * sqrt(3 / fan_in) = 1 / sqrt(fan_in), fan_in = in. */
            float bound = 1.0f / sqrtf((float)x->in);
            for (int64_t i = 0; i < (int64_t)r * x->in; i++)
                x->A[i] = (2.0f * bt_rng_uniform(&rng) - 1.0f) * bound;
            /* B stays zero (bt_aligned_alloc zero-fills). */
        }
    if (trainable & BT_TRAIN_EMBED) {
        lo->embed = lo->params + off;
        lo->dembed = lo->grads + off;
        if (md->tok_embd) /* a shape-only model (no weights) leaves zeros for the caller */
            memcpy(lo->embed, md->tok_embd, (size_t)n_embed * sizeof(float));
        off += n_embed;
    }
    if (trainable & BT_TRAIN_NORM) {
        size_t D = (size_t)md->hp.d_model;
        lo->norms = lo->params + off;
        lo->dnorms = lo->grads + off;
        for (int l = 0; l < lo->n_layer; l++) {
            if (md->layers[l].attn_norm)
                memcpy(lo->norms + (size_t)(2 * l) * D, md->layers[l].attn_norm, D * sizeof(float));
            if (md->layers[l].ffn_norm)
                memcpy(lo->norms + (size_t)(2 * l + 1) * D, md->layers[l].ffn_norm, D * sizeof(float));
        }
        if (md->output_norm)
            memcpy(lo->norms + (size_t)(2 * lo->n_layer) * D, md->output_norm, D * sizeof(float));
        off += n_norm;
    }
    return 0;
}

const float *bt_lora_embed(const bt_lora *lo, const bt_model *md) {
    return lo && lo->embed ? lo->embed : md->tok_embd;
}

const float *bt_lora_lm_head(const bt_lora *lo, const bt_model *md) {
    return lo && lo->embed && md->tied ? lo->embed : md->lm_head;
}

const float *bt_lora_norm(const bt_lora *lo, const bt_model *md, int l, int which) {
    if (lo && lo->norms && l >= 0 && l <= lo->n_layer)
        return lo->norms + (size_t)(l == lo->n_layer ? 2 * l : 2 * l + (which ? 1 : 0)) * lo->d_model;
    if (l == md->hp.n_layer) return md->output_norm;
    return which ? md->layers[l].ffn_norm : md->layers[l].attn_norm;
}

float *bt_lora_dembed(const bt_lora *lo) { return lo ? lo->dembed : NULL; }

float *bt_lora_dlm_head(const bt_lora *lo) { return lo && lo->tied ? lo->dembed : NULL; }

float *bt_lora_dnorm(const bt_lora *lo, int l, int which) {
    if (!lo || !lo->dnorms || l < 0 || l > lo->n_layer) return NULL;
    return lo->dnorms + (size_t)(l == lo->n_layer ? 2 * l : 2 * l + (which ? 1 : 0)) * lo->d_model;
}

void bt_lora_free(bt_lora *lo) {
    if (!lo) return;
    free(lo->mods);
    free(lo->params);
    free(lo->grads);
    free(lo->m);
    free(lo->v);
    memset(lo, 0, sizeof *lo);
}

const bt_lora_mod *bt_lora_get(const bt_lora *lo, int layer, int mod) {
    if (!lo || !lo->mods || layer < 0 || layer >= lo->n_layer || mod < 0 || mod >= BT_MOD_N)
        return NULL;
    const bt_lora_mod *x = &lo->mods[layer * BT_MOD_N + mod];
    return x->A ? x : NULL;
}

int bt_lora_peft_get(const bt_lora *lo, int layer, int mod, bt_lora_peft_mod *u) {
    static const char *const gguf[BT_MOD_N] = {"attn_q", "attn_k", "attn_v", "attn_output",
                                               "ffn_gate", "ffn_up", "ffn_down"};
    const bt_lora_mod *x = bt_lora_get(lo, layer, mod);
    if (!x || x->group != mod) return 0;
    memset(u, 0, sizeof *u);
    u->first_mod = mod;
    u->n_mods = 1;
    u->in = x->in;
    u->out = x->out;
    u->A = x->A, u->B = x->B, u->dA = x->dA, u->dB = x->dB;
    u->name = bt_module_name(mod);
    u->gguf = gguf[mod];
    if (x->fused_out) { /* Phi-3 (convert_hf_to_gguf.py Phi3MiniModel: blk.N.attn_qkv / ffn_up) */
        u->n_mods = mod == BT_MOD_Q ? 3 : 2;
        u->out = x->fused_out;
        u->name = mod == BT_MOD_Q ? "qkv_proj" : "gate_up_proj";
        u->gguf = mod == BT_MOD_Q ? "attn_qkv" : "ffn_up";
    }
    return 1;
}

void bt_lora_zero_grad(bt_lora *lo) {
    memset(lo->grads, 0, (size_t)lo->n_params * sizeof(float));
}

uint64_t bt_lora_drop_key(uint64_t step_key, int layer, int mod) {
    if (step_key == 0) return 0;
    uint64_t k = bt_hash64(step_key ^ bt_hash64(((uint64_t)layer << 8) | (uint64_t)(mod + 1)));
    return k ? k : 1;
}

/* Dropout mask from a counter-based hash: element i keeps iff its 16-bit uniform
 * u = bits[16*(i%4) .. +16) of hash(key + (i/4)*golden) satisfies u >= thresh, where
 * thresh = round(p * 65536); kept values are scaled by 1 / (1 - thresh/65536) so the branch is
 * unbiased for the quantised probability. Pure function of (key, i): backward regenerates it. */
static inline uint32_t drop_thresh(float p) { return (uint32_t)lrintf(p * 65536.0f); }

/* out[i] = x[i] * mask_i * keep_scale for i in [0, n) (out may alias x). Hashes are computed
 * 256 blocks (1024 elements) at a time in a SIMD-friendly loop. */
static void apply_dropout(float *out, const float *x, int64_t n, float p, uint64_t key) {
    uint32_t th = drop_thresh(p);
    float ks = th >= 65536 ? 0.f : 65536.0f / (float)(65536u - th);
    int64_t nb = (n + 3) / 4, nchunk = (nb + 255) / 256;
#pragma omp parallel for schedule(static)
    for (int64_t ch = 0; ch < nchunk; ch++) {
        uint64_t h[256];
        int64_t b0 = ch * 256, nbc = nb - b0 < 256 ? nb - b0 : 256;
#pragma omp simd
        for (int64_t j = 0; j < nbc; j++) h[j] = bt_hash64(key + (uint64_t)(b0 + j) * 0x9E3779B97F4A7C15ULL);
        int64_t i0 = b0 * 4, ne = n - i0 < 1024 ? n - i0 : 1024;
#pragma omp simd
        for (int64_t i = 0; i < ne; i++) {
            uint32_t u = (uint32_t)(h[i >> 2] >> (16 * (i & 3))) & 0xffffu;
            out[i0 + i] = u >= th ? x[i0 + i] * ks : 0.f;
        }
    }
}

void bt_lora_fwd(const bt_lora *lo, const bt_lora_mod *md, float *y, const float *x, int M,
                 float *as, float *xd, uint64_t drop_key) {
    const float *xin = x;
    if (drop_key && lo->dropout > 0) {
        apply_dropout(xd, x, (int64_t)M * md->in, lo->dropout, drop_key);
        xin = xd;
    }
    bt_linear_fwd(as, xin, md->A, M, md->in, lo->r, 0.f);
    bt_scale(as, (int64_t)M * lo->r, lo->scale);
    bt_linear_fwd(y, as, md->B, M, lo->r, md->out, 1.f);
}

void bt_lora_bwd(const bt_lora *lo, const bt_lora_mod *md, float *dx, const float *dy,
                 const float *x, const float *as, int M, float *das, float *xd, uint64_t drop_key) {
    int r = lo->r;
    /* y += as @ B^T  ->  dB += dy^T @ as ; das = dy @ B */
    bt_linear_bwd_w(md->dB, dy, as, M, r, md->out, 1.f);
    bt_linear_bwd_x(das, dy, md->B, M, r, md->out, 0.f);
    /* as = scale * xin @ A^T  ->  da = scale * das ; dA += da^T @ xin ; dxin = da @ A */
    bt_scale(das, (int64_t)M * r, lo->scale);
    int drop = drop_key && lo->dropout > 0;
    const float *xin = x;
    if (drop) {
        apply_dropout(xd, x, (int64_t)M * md->in, lo->dropout, drop_key);
        xin = xd;
    }
    bt_linear_bwd_w(md->dA, das, xin, M, md->in, r, 1.f);
    if (!drop) {
        bt_linear_bwd_x(dx, das, md->A, M, md->in, r, 1.f);
        return;
    }
    /* dx += mask * keep_scale * (da @ A): dropout's backward is the same masked scaling. */
    bt_linear_bwd_x(xd, das, md->A, M, md->in, r, 0.f);
    apply_dropout(xd, xd, (int64_t)M * md->in, lo->dropout, drop_key);
    int64_t n = (int64_t)M * md->in;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) dx[i] += xd[i];
}
