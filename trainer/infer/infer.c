/* KV-cache inference forward of Llama + LoRA on the CPU kernels. See infer.h. */
#include "trainer/infer/infer.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "common/bt_common.h"
#include "kernels/kernels.h"

struct bt_infer {
    const bt_model *m;
    const bt_lora *lo;
    int max_ctx, max_chunk, pos, nthr;
    int D, Dq, Dkv, F, V, Hq, Hkv, hd, n_layer;
    float **kc, **vc;        /* [n_layer] each [max_ctx, Dkv] */
    float *x, *xn, *q, *att, *lse, *g, *u, *h, *as, *scratch, *scores;
    float *rope_tab;         /* [hd/2] dynamic NTK: the table grown to dyn_len (0 = the model's) */
    int64_t dyn_len;
    bt_rope_cache rope;      /* cos/sin of the RoPE table by position (kernels.h), this state's own */
    bt_rope_cache rope_local; /* the same for the local layers' table (m->inv_freq_local) */
    int32_t *pos_ids;        /* [max_chunk] */
    size_t bytes;
};

static float *falloc(bt_infer *s, size_t n) {
    float *p = bt_aligned_alloc((n ? n : 1) * sizeof(float));
    if (p) s->bytes += n * sizeof(float);
    return p;
}

void bt_infer_free(bt_infer *s) {
    if (!s) return;
    for (int l = 0; s->kc && l < s->n_layer; l++) free(s->kc[l]);
    for (int l = 0; s->vc && l < s->n_layer; l++) free(s->vc[l]);
    free(s->kc);
    free(s->vc);
    free(s->x);
    free(s->xn);
    free(s->q);
    free(s->att);
    free(s->lse);
    free(s->g);
    free(s->u);
    free(s->h);
    free(s->as);
    free(s->scratch);
    free(s->scores);
    free(s->pos_ids);
    free(s->rope_tab);
    bt_rope_cache_free(&s->rope);
    bt_rope_cache_free(&s->rope_local);
    free(s);
}

int bt_infer_new(bt_infer **out, const bt_model *m, const bt_lora *lo, int max_ctx, int max_chunk) {
    *out = NULL;
    if (max_ctx < 1 || max_chunk < 1)
        return bt_fail(BT_ERR_INVALID, "infer: max_ctx %d and max_chunk %d must be >= 1", max_ctx,
                       max_chunk);
    if (lo && (lo->n_layer != m->hp.n_layer ||
               ((lo->embed || lo->norms) && lo->d_model != m->hp.d_model) ||
               (lo->embed && lo->vocab != m->hp.vocab)))
        return bt_fail(BT_ERR_INVALID, "infer: the LoRA (%d layers) does not fit the model (%d "
                       "layers, d_model %d, vocab %d)", lo->n_layer, m->hp.n_layer, m->hp.d_model,
                       m->hp.vocab);
    if (!m->inv_freq)
        return bt_fail(BT_ERR_INVALID, "infer: the model has no RoPE table (bt_model_rope_init)");
    if (max_chunk > max_ctx) max_chunk = max_ctx;
    bt_infer *s = calloc(1, sizeof *s);
    if (!s) return bt_fail(BT_ERR_NOMEM, "infer: out of memory");
    const bt_llama_hparams *hp = &m->hp;
    s->m = m;
    s->lo = lo;
    s->max_ctx = max_ctx;
    s->max_chunk = max_chunk;
    const bt_dims d = bt_dims_of(hp);
    s->n_layer = d.L;
    s->D = d.D;
    s->Hq = d.Hq;
    s->Hkv = d.Hkv;
    s->hd = d.hd;
    s->Dq = d.Dq;
    s->Dkv = d.Dkv;
    s->F = d.F;
    s->V = d.V;
#ifdef _OPENMP
    s->nthr = omp_get_max_threads();
#else
    s->nthr = 1;
#endif
    if (s->nthr < 1) s->nthr = 1;
    size_t C = (size_t)max_chunk, D = (size_t)s->D, F = (size_t)s->F;
    s->kc = calloc((size_t)s->n_layer, sizeof(float *));
    s->vc = calloc((size_t)s->n_layer, sizeof(float *));
    s->pos_ids = malloc(C * sizeof(int32_t));
    if (!s->kc || !s->vc || !s->pos_ids) goto oom;
    for (int l = 0; l < s->n_layer; l++)
        if (!(s->kc[l] = falloc(s, (size_t)max_ctx * s->Dkv)) ||
            !(s->vc[l] = falloc(s, (size_t)max_ctx * s->Dkv)))
            goto oom;
    int r = s->lo ? s->lo->r : 1;
    if (!(s->x = falloc(s, C * D)) || !(s->xn = falloc(s, C * D)) ||
        !(s->q = falloc(s, C * s->Dq)) || !(s->att = falloc(s, C * s->Dq)) ||
        !(s->lse = falloc(s, C * s->Hq)) || !(s->g = falloc(s, C * F)) ||
        !(s->u = falloc(s, C * F)) || !(s->h = falloc(s, C * F)) ||
        !(s->as = falloc(s, C * (size_t)r)) ||
        !(s->scratch = falloc(s, bt_model_scratch_floats(m))) ||
        !(s->scores = falloc(s, (size_t)s->nthr * max_ctx)) ||
        !(s->rope_tab = falloc(s, (size_t)s->hd / 2)))
        goto oom;
    *out = s;
    return 0;
oom:;
    size_t cache_mib = ((size_t)2 * s->n_layer * max_ctx * s->Dkv * sizeof(float)) >> 20;
    bt_infer_free(s);
    return bt_fail(BT_ERR_NOMEM, "infer: out of memory for a KV cache of %d positions (%zu MiB) "
                   "and chunks of %d tokens", max_ctx, cache_mib, max_chunk);
}

void bt_infer_reset(bt_infer *s) {
    s->pos = 0;
    s->dyn_len = 0;
}
int bt_infer_pos(const bt_infer *s) { return s->pos; }
int bt_infer_max_ctx(const bt_infer *s) { return s->max_ctx; }
int bt_infer_vocab(const bt_infer *s) { return s->V; }
size_t bt_infer_bytes(const bt_infer *s) { return s->bytes; }

/* y = W x (+ LoRA) for module `mod` of layer l over n rows; beta 1 accumulates into y. */
static void proj(bt_infer *s, int l, int mod, float *y, const float *x, int n, float beta) {
    bt_base_fwd(y, x, &s->m->layers[l].lin[mod], n, beta, s->scratch);
    const bt_lora_mod *md = bt_lora_get(s->lo, l, mod);
    if (md) bt_lora_fwd(s->lo, md, y, x, n, s->as, NULL, 0);
}

/* Causal attention of n new queries q[n, Hq, hd] (positions p0 .. p0+n-1, already in the cache)
 * over cached K/V [0, p0+n) of one layer: out[n, Hq, hd]; with a sliding window W > 0 query i
 * sees keys (i - W, i] only (kernels.h bt_attn_fwd_win). */
static void attn_cached(bt_infer *s, float *out, const float *q, const float *K, const float *Vv,
                        int p0, int n, int W) {
    const int Hq = s->Hq, Hkv = s->Hkv, hd = s->hd, group = Hq / Hkv, ldk = Hkv * hd;
    const float scale = bt_model_attn_scale(&s->m->hp);
    const int ntask = n * Hq;
    /* a single decode step is too little work for a parallel region (~len * Hq * hd MACs) */
    const int par = (int64_t)ntask * (p0 + n) * hd >= (1 << 17);
#pragma omp parallel for schedule(dynamic, 1) num_threads(s->nthr) if (par)
    for (int t = 0; t < ntask; t++) {
#ifdef _OPENMP
        float *S = s->scores + (size_t)omp_get_thread_num() * s->max_ctx;
#else
        float *S = s->scores;
#endif
        int i = t / Hq, h = t % Hq, kvh = h / group, len = p0 + i + 1;
        const int j0 = W > 0 && len - W > 0 ? len - W : 0;
        const float *qi = q + ((size_t)i * Hq + h) * hd;
        float mx = -INFINITY;
        for (int j = j0; j < len; j++) {
            const float *kj = K + (size_t)j * ldk + (size_t)kvh * hd;
            float d = 0.f;
            for (int c = 0; c < hd; c++) d += qi[c] * kj[c];
            S[j] = d * scale;
            if (S[j] > mx) mx = S[j];
        }
        float sum = 0.f;
        for (int j = j0; j < len; j++) {
            S[j] = expf(S[j] - mx);
            sum += S[j];
        }
        float *o = out + ((size_t)i * Hq + h) * hd;
        memset(o, 0, (size_t)hd * sizeof(float));
        for (int j = j0; j < len; j++) {
            const float *vj = Vv + (size_t)j * ldk + (size_t)kvh * hd;
            float w = S[j];
            for (int c = 0; c < hd; c++) o[c] += w * vj[c];
        }
        float inv = 1.0f / sum;
        for (int c = 0; c < hd; c++) o[c] *= inv;
    }
}

static void add_inplace(float *dst, const float *a, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= 65536)
    for (int64_t i = 0; i < n; i++) dst[i] += a[i];
}

/* One chunk of n tokens at positions s->pos .. s->pos+n-1 (validated by the caller). Leaves the
 * final-normed hidden states in s->xn[n, D] and advances s->pos. 0, or a kernel's error. */
static int chunk_fwd(bt_infer *s, const int32_t *ids, int n) {
    const bt_model *m = s->m;
    const int p0 = s->pos, D = s->D;
    const bt_lora *lo = s->lo;
    const float eps = m->hp.rms_eps;
    for (int i = 0; i < n; i++) s->pos_ids[i] = p0 + i;
    /* dynamic NTK: as transformers' _dynamic_frequency_update, the table grows with the longest
     * position seen in this session; cached keys keep the rotation they were stored with */
    if (m->hp.rope_ext == BT_ROPE_EXT_DYNAMIC && (int64_t)p0 + n > s->dyn_len &&
        bt_model_rope_table(m, (int64_t)p0 + n, s->rope_tab) == 1)
        s->dyn_len = (int64_t)p0 + n;
    const float *inv = s->dyn_len > 0 ? s->rope_tab : m->inv_freq;
    int rc = bt_embedding_fwd(s->x, bt_lora_embed(lo, m), ids, n, D, s->V);
    if (rc) return rc;
    if (m->hp.embed_scale > 0.f) bt_scale(s->x, (int64_t)n * D, m->hp.embed_scale); /* Gemma */
    for (int l = 0; l < s->n_layer; l++) {
        const int W = bt_model_layer_window(&m->hp, l);
        const float *linv = bt_model_layer_inv(m, l, inv);
        bt_rope_cache *rcache = linv == inv ? &s->rope : &s->rope_local;
        const bt_layer *Ly = &m->layers[l];
        float *kc = s->kc[l] + (size_t)p0 * s->Dkv, *vc = s->vc[l] + (size_t)p0 * s->Dkv;
        /* s->lse doubles as rstd scratch for the norms ([n] <= [n * Hq]). */
        bt_rmsnorm_fwd(s->xn, s->lse, s->x, bt_lora_norm(lo, m, l, 0), n, D, eps);
        proj(s, l, BT_MOD_Q, s->q, s->xn, n, 0.f);
        proj(s, l, BT_MOD_K, kc, s->xn, n, 0.f);
        proj(s, l, BT_MOD_V, vc, s->xn, n, 0.f);
        if (m->hp.qk_norm) { /* Qwen3: per-head RMSNorm of q and k before RoPE (in place;
                              * s->lse [n * Hq] holds the rstd) */
            bt_rmsnorm_fwd(s->q, s->lse, s->q, m->layers[l].q_norm, n * s->Hq, s->hd, eps);
            bt_rmsnorm_fwd(kc, s->lse, kc, m->layers[l].k_norm, n * s->Hkv, s->hd, eps);
        }
        if ((rc = bt_rope_fwd_cached(rcache, s->q, s->pos_ids, n, s->Hq, s->hd, linv, 1.0f)) ||
            (rc = bt_rope_fwd_cached(rcache, kc, s->pos_ids, n, s->Hkv, s->hd, linv, 1.0f)))
            return rc;
        if (p0 == 0) {
            int32_t cu[2] = {0, n};
            if ((rc = bt_attn_fwd_win(s->att, s->lse, s->q, kc, vc, cu, 1, n, s->Hq, s->Hkv, s->hd,
                                      bt_model_attn_scale(&m->hp), 0, W)))
                return rc;
        } else {
            attn_cached(s, s->att, s->q, s->kc[l], s->vc[l], p0, n, W);
        }
        /* x += o_proj(att): the o_proj output goes to xn (free now), then the residual add, in
         * the order HF adds (residual + attn_out). Gemma 3 normalises the o_proj output first
         * (post_attention_layernorm), in place: bt_rmsnorm_fwd reads each row before writing it. */
        proj(s, l, BT_MOD_O, s->xn, s->att, n, 0.f);
        if (Ly->post_attn_norm) bt_rmsnorm_fwd(s->xn, s->lse, s->xn, Ly->post_attn_norm, n, D, eps);
        add_inplace(s->x, s->xn, (int64_t)n * D);
        bt_rmsnorm_fwd(s->xn, s->lse, s->x, bt_lora_norm(lo, m, l, 1), n, D, eps);
        proj(s, l, BT_MOD_GATE, s->g, s->xn, n, 0.f);
        proj(s, l, BT_MOD_UP, s->u, s->xn, n, 0.f);
        if (m->hp.act == BT_ACT_GELU_TANH) bt_geglu_fwd(s->h, s->g, s->u, (int64_t)n * s->F);
        else bt_swiglu_fwd(s->h, s->g, s->u, (int64_t)n * s->F);
        proj(s, l, BT_MOD_DOWN, s->xn, s->h, n, 0.f);
        if (Ly->post_ffn_norm) bt_rmsnorm_fwd(s->xn, s->lse, s->xn, Ly->post_ffn_norm, n, D, eps);
        add_inplace(s->x, s->xn, (int64_t)n * D);
    }
    bt_rmsnorm_fwd(s->xn, s->lse, s->x, bt_lora_norm(lo, m, s->n_layer, 0), n, D, eps);
    s->pos = p0 + n;
    return 0;
}

int bt_infer_forward(bt_infer *s, const int32_t *ids, int n, int which, float *logits) {
    if (n < 1 || !ids)
        return bt_fail(BT_ERR_INVALID, "infer: need at least one token (n = %d)", n);
    if (which != BT_INFER_LOGITS_NONE && which != BT_INFER_LOGITS_LAST &&
        which != BT_INFER_LOGITS_ALL)
        return bt_fail(BT_ERR_INVALID, "infer: bad logits selector %d", which);
    if (which != BT_INFER_LOGITS_NONE && !logits)
        return bt_fail(BT_ERR_INVALID, "infer: logits buffer is NULL");
    if (n > s->max_ctx - s->pos)
        return bt_fail(BT_ERR_RANGE, "infer: %d tokens at position %d exceed the context of %d",
                       n, s->pos, s->max_ctx);
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= s->V)
            return bt_fail(BT_ERR_RANGE, "infer: token id %d at %d outside [0, %d)", ids[i], i,
                           s->V);
    const float *lm_head = bt_lora_lm_head(s->lo, s->m);
    for (int done = 0; done < n;) {
        int c = n - done < s->max_chunk ? n - done : s->max_chunk;
        const int rc = chunk_fwd(s, ids + done, c);
        if (rc) return rc;
        size_t at = 0, rows = 0;
        float *out = NULL;
        if (which == BT_INFER_LOGITS_ALL) {
            out = logits + (size_t)done * s->V;
            rows = (size_t)c;
            bt_linear_fwd(out, s->xn, lm_head, c, s->D, s->V, 0.f);
        } else if (which == BT_INFER_LOGITS_LAST && done + c == n) {
            out = logits;
            rows = 1;
            bt_linear_fwd(logits, s->xn + (size_t)(c - 1) * s->D, lm_head, 1, s->D, s->V, 0.f);
        }
        /* no caller ever samples from or scores non-finite logits (issue 21 §6) */
        if (out && !bt_all_finite_f32(out, rows * (size_t)s->V, &at)) {
            const int row = rows == 1 ? c - 1 : (int)(at / (size_t)s->V); /* within this chunk */
            return bt_fail(BT_ERR_DIVERGED, "infer: the logits at position %d are not finite (token id %zu: %g): "
                           "the model or adapter overflows fp32 (weights, or lora_alpha / r, too large)",
                           s->pos - c + row, at % (size_t)s->V, (double)out[at]);
        }
        done += c;
    }
    return 0;
}
