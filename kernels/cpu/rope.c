/* Rotary position embedding (Su et al. 2021, RoFormer, arXiv 2104.09864) in the HF Llama
 * "rotate_half" layout: for i < D/2 the pair (x[i], x[i + D/2]) is rotated by angle p * inv_freq[i]:
 *   y[i]       = x[i] * cos - x[i+D/2] * sin
 *   y[i + D/2] = x[i+D/2] * cos + x[i] * sin
 * (transformers/models/llama/modeling_llama.py apply_rotary_pos_emb: q*cos + rotate_half(q)*sin).
 * The inverse frequencies come from a table (bt_rope_inv_freq computes it as transformers'
 * modeling_rope_utils.py does: "default" 1 / theta^(2i/D), "linear", "llama3"); p = (float)position
 * * pos_scale in fp32 and the angle = p * inv_freq[i] rounded to fp32 like HF's fp32 matmul; cos/sin
 * of that fp32 angle are evaluated in double and rounded (torch's fp32 cos/sin are within ~1 ulp
 * of that). The _cached forms keep a cos/sin table per (inv_freq table, pos_scale, D) for positions
 * [0, npos) in a cache their caller owns (bt_rope_cache: the step context's, the inference
 * state's), grown on demand; positions outside [0, 1<<20), and every position of the uncached
 * forms, are computed directly, with the same function, so both give the same bits. */
#include "kernels/kernels.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"

#define BT_ROPE_MAX_CACHED_POS (1 << 20)

static void rope_angle_cs(int32_t pos, float inv_freq, float pos_scale, float *c, float *s)
{
    const float p = (float)pos * pos_scale;
    const float ang = p * inv_freq;
    *c = (float)cos((double)ang);
    *s = (float)sin((double)ang);
}

void bt_rope_cache_free(bt_rope_cache *c)
{
    if (!c)
        return;
    free(c->cos_sin);
    free(c->inv);
    memset(c, 0, sizeof *c);
}

/* The cos/sin table of c covering positions [0, need) for (inv, pos_scale, D), built or grown
 * when it does not (a different table, scale or head size replaces it); NULL without a cache or
 * when the allocation fails (the caller then computes every row directly). */
static const float *rope_table(bt_rope_cache *c, int need, int D, const float *inv, float pos_scale)
{
    if (!c)
        return NULL;
    const int half = D / 2;
    const int same = c->cos_sin && c->D == D && c->pos_scale == pos_scale &&
                     !memcmp(c->inv, inv, (size_t)half * sizeof(float));
    if (same && c->npos >= need)
        return c->cos_sin;
    int npos = need < 4096 ? 4096 : need;
    if (same && npos < 2 * c->npos)
        npos = 2 * c->npos;
    if (npos > BT_ROPE_MAX_CACHED_POS)
        npos = BT_ROPE_MAX_CACHED_POS;
    float *t = malloc((size_t)npos * (size_t)half * 2 * sizeof(float));
    float *ic = malloc((size_t)half * sizeof(float));
    if (!t || !ic) {
        free(t);
        free(ic);
        return NULL;
    }
    memcpy(ic, inv, (size_t)half * sizeof(float));
#pragma omp parallel for schedule(static)
    for (int p = 0; p < npos; p++)
        for (int i = 0; i < half; i++)
            rope_angle_cs(p, ic[i], pos_scale, &t[((size_t)p * half + i) * 2],
                          &t[((size_t)p * half + i) * 2 + 1]);
    free(c->cos_sin);
    free(c->inv);
    c->cos_sin = t;
    c->inv = ic;
    c->npos = npos;
    c->D = D;
    c->pos_scale = pos_scale;
    return t;
}

/* Rotate the H heads of one token by the (cos, sin) pairs cs[2i], cs[2i+1] (sin times dir). */
static inline void rope_rotate_row(float *x, int H, int D, const float *cs, float dir)
{
    const int half = D / 2;
    for (int h = 0; h < H; h++) {
        float *xr = x + (size_t)h * D;
#pragma omp simd
        for (int i = 0; i < half; i++) {
            const float c = cs[2 * i], s = dir * cs[2 * i + 1];
            const float x1 = xr[i], x2 = xr[i + half];
            xr[i] = x1 * c - x2 * s;
            xr[i + half] = x2 * c + x1 * s;
        }
    }
}

/* The arguments every form checks: BT_ERR_INVALID unless M >= 0, H >= 1, D even >= 2 and (M > 0)
 * x, position_ids and the table present. */
static int rope_check(const float *x, const int32_t *pos, int M, int H, int D, const void *table)
{
    if (M < 0 || H < 1 || D < 2 || (D & 1) || (M > 0 && (!x || !pos || !table)))
        return bt_fail(BT_ERR_INVALID, "rope: M %d, H %d, D %d (need M >= 0, H >= 1, D even >= 2)%s",
                       M, H, D, M > 0 && (!x || !pos || !table) ? ", a NULL pointer" : "");
    return BT_OK;
}

/* dir = +1: forward rotation; dir = -1: inverse (transpose) rotation. cache NULL: every row's
 * cos/sin computed directly. BT_ERR_INVALID (rope_check), BT_ERR_NOMEM (a row's cos/sin buffer,
 * D > 512, could not be allocated: rows may be rotated in part). */
static int rope_apply(bt_rope_cache *cache, float *x, const int32_t *pos, int M, int H, int D,
                      const float *inv, float pos_scale, float dir)
{
    const int rc = rope_check(x, pos, M, H, D, inv);
    if (rc || M == 0)
        return rc;
    const int half = D / 2;
    int32_t maxp = 0;
    for (int m = 0; m < M; m++)
        if (pos[m] > maxp)
            maxp = pos[m];
    const int need = maxp < BT_ROPE_MAX_CACHED_POS ? maxp + 1 : BT_ROPE_MAX_CACHED_POS;
    const float *tab = rope_table(cache, need, D, inv, pos_scale);
    int nomem = 0;
#pragma omp parallel for schedule(static) if ((int64_t)M * H * D >= 32768)
    for (int m = 0; m < M; m++) {
        const int32_t p = pos[m];
        float *xm = x + (size_t)m * H * D;
        if (tab && p >= 0 && p < need) {
            rope_rotate_row(xm, H, D, tab + (size_t)p * half * 2, dir);
            continue;
        }
        /* uncached position (negative, huge, or no table): compute this row directly */
        float cs_local[2 * 256];
        float *buf = cs_local, *heap = NULL;
        if (half > 256)
            buf = heap = malloc((size_t)half * 2 * sizeof(float));
        if (!buf) {
#pragma omp atomic write
            nomem = 1;
            continue;
        }
        for (int i = 0; i < half; i++)
            rope_angle_cs(p, inv[i], pos_scale, &buf[2 * i], &buf[2 * i + 1]);
        rope_rotate_row(xm, H, D, buf, dir);
        free(heap);
    }
    if (nomem)
        return bt_fail(BT_ERR_NOMEM, "rope: out of memory for a row's cos/sin (D %d)", D);
    return BT_OK;
}

/* HF _compute_default_rope_parameters in fp32:
 * 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)). */
static void default_inv_freq(float *inv, int D, float theta)
{
    for (int i = 0; i < D / 2; i++)
        inv[i] = 1.0f / powf(theta, (float)(2 * i) / (float)D);
}

int bt_rope_inv_freq(float *inv_freq, int D, float theta, const char *type, float factor,
                     float low_freq_factor, float high_freq_factor, int original_max_pos)
{
    if (!inv_freq || D < 2 || D % 2 != 0 || !(theta > 0) || !isfinite(theta))
        return bt_fail(BT_ERR_INVALID, "rope: inv_freq: bad arguments (D %d, theta %g)", D,
                       (double)theta);
    if (!type || !strcmp(type, "default")) {
        default_inv_freq(inv_freq, D, theta);
        return 0;
    }
    if (!(factor > 0) || !isfinite(factor))
        return bt_fail(BT_ERR_INVALID, "rope: inv_freq: rope_type \"%s\" needs factor > 0 (got %g)",
                       type, (double)factor);
    if (!strcmp(type, "linear")) {
        /* _compute_linear_scaling_rope_parameters: inv_freq /= factor */
        default_inv_freq(inv_freq, D, theta);
        for (int i = 0; i < D / 2; i++)
            inv_freq[i] = inv_freq[i] / factor;
        return 0;
    }
    if (strcmp(type, "llama3") != 0)
        return bt_fail(BT_ERR_UNSUPPORTED, "rope: inv_freq: rope_type \"%s\" is not supported "
                       "(default, linear, llama3)", type);
    if (!(high_freq_factor > low_freq_factor) || !(low_freq_factor > 0) ||
        !isfinite(high_freq_factor) || original_max_pos < 1)
        return bt_fail(BT_ERR_INVALID, "rope: inv_freq: llama3 needs 0 < low_freq_factor (%g) < "
                       "high_freq_factor (%g) and original_max_position_embeddings (%d) >= 1",
                       (double)low_freq_factor, (double)high_freq_factor, original_max_pos);
    /* _compute_llama3_parameters, op by op as torch evaluates it in fp32: Python scalars are
     * computed in double, then cast to fp32 where they meet a tensor; `scalar / tensor` is
     * tensor.reciprocal() * scalar (torch/_tensor.py __rtruediv__). */
    default_inv_freq(inv_freq, D, theta);
    const double old_ctx = (double)original_max_pos;
    const float low_wl = (float)(old_ctx / (double)low_freq_factor);
    const float high_wl = (float)(old_ctx / (double)high_freq_factor);
    const float two_pi = (float)(2.0 * M_PI);
    const float f_old = (float)old_ctx, f_low = low_freq_factor;
    const float f_den = (float)((double)high_freq_factor - (double)low_freq_factor);
    for (int i = 0; i < D / 2; i++) {
        const float inv = inv_freq[i];
        const float wavelen = (1.0f / inv) * two_pi;
        float llama = wavelen > low_wl ? inv / factor : inv;
        if (!(wavelen < high_wl) && !(wavelen > low_wl)) { /* medium frequency: smooth */
            const float smooth = ((1.0f / wavelen) * f_old - f_low) / f_den;
            llama = (1.0f - smooth) * llama / factor + smooth * llama;
        }
        inv_freq[i] = llama;
    }
    return 0;
}

/* transformers _compute_yarn_parameters' correction range, in double as Python computes it:
 * find_correction_dim(r) = dim * ln(orig / (r * 2 pi)) / (2 ln base); low = max(floor(dim(fast)),
 * 0), high = min(ceil(dim(slow)), dim - 1). */
static void yarn_range(int D, double theta, int orig, double beta_fast, double beta_slow, int *lo,
                       int *hi)
{
    const double pi2 = 2.0 * M_PI;
    const double dlo = (D * log((double)orig / (beta_fast * pi2))) / (2.0 * log(theta));
    const double dhi = (D * log((double)orig / (beta_slow * pi2))) / (2.0 * log(theta));
    const double l = floor(dlo), h = ceil(dhi);
    *lo = l > 0 ? (int)l : 0;
    *hi = h < D - 1 ? (int)h : D - 1;
}

/* 1 - linear_ramp_factor(low, high, D/2)[i] in fp32 (the extrapolation weight of dimension i) */
static float yarn_extrap_weight(int i, int lo, int hi)
{
    const float den = (float)(lo == hi ? (double)hi + 0.001 - lo : (double)(hi - lo));
    float r = ((float)i - (float)lo) / den;
    r = r < 0.0f ? 0.0f : (r > 1.0f ? 1.0f : r);
    return 1.0f - r;
}

static int yarn_check(int D, float theta, float factor, int orig, float *beta_fast,
                      float *beta_slow)
{
    if (D < 2 || D % 2 != 0 || !(theta > 1.0f) || !isfinite(theta) || !(factor > 0) ||
        !isfinite(factor) || orig < 1)
        return bt_fail(BT_ERR_INVALID, "rope: yarn: bad arguments (D %d, theta %g, factor %g, "
                       "original_max_position_embeddings %d)", D, (double)theta, (double)factor,
                       orig);
    /* `config.rope_scaling.get("beta_fast") or 32`: absent or 0 -> the default */
    if (*beta_fast == 0.0f)
        *beta_fast = 32.0f;
    if (*beta_slow == 0.0f)
        *beta_slow = 1.0f;
    if (!(*beta_fast > 0) || !(*beta_slow > 0) || !isfinite(*beta_fast) || !isfinite(*beta_slow))
        return bt_fail(BT_ERR_INVALID, "rope: yarn: beta_fast %g / beta_slow %g must be > 0",
                       (double)*beta_fast, (double)*beta_slow);
    return 0;
}

float bt_rope_yarn_attention_factor(float factor, float attention_factor)
{
    if (attention_factor > 0.0f)
        return attention_factor;
    return (float)(0.1 * log((double)factor) + 1.0); /* a Python float; used by torch in fp32 */
}

/* Arguments checked, default betas filled in, the correction range [*lo, *hi]. */
static int yarn_prepare(const float *inv_freq, int D, float theta, float factor, int orig,
                        float beta_fast, float beta_slow, int *lo, int *hi)
{
    int rc = inv_freq ? yarn_check(D, theta, factor, orig, &beta_fast, &beta_slow)
                      : bt_fail(BT_ERR_INVALID, "rope: yarn: NULL table");
    if (!rc)
        yarn_range(D, theta, orig, beta_fast, beta_slow, lo, hi);
    return rc;
}

int bt_rope_inv_freq_yarn(float *inv_freq, int D, float theta, float factor, int orig,
                          float beta_fast, float beta_slow)
{
    int lo, hi;
    int rc = yarn_prepare(inv_freq, D, theta, factor, orig, beta_fast, beta_slow, &lo, &hi);
    if (rc)
        return rc;
    const float f = factor;
    for (int i = 0; i < D / 2; i++) {
        /* pos_freqs = base ** (arange(0, dim, 2).float() / dim); extrapolation = 1 / pos_freqs;
         * interpolation = 1 / (factor * pos_freqs) */
        const float pf = powf(theta, (float)(2 * i) / (float)D);
        const float extrap = 1.0f / pf, interp = 1.0f / (f * pf);
        const float e = yarn_extrap_weight(i, lo, hi);
        inv_freq[i] = interp * (1.0f - e) + extrap * e;
    }
    return 0;
}

int bt_rope_yarn_mix(float *inv_freq, int D, float theta, float factor, int orig, float beta_fast,
                     float beta_slow)
{
    int lo, hi;
    int rc = yarn_prepare(inv_freq, D, theta, factor, orig, beta_fast, beta_slow, &lo, &hi);
    if (rc)
        return rc;
    for (int i = 0; i < D / 2; i++) {
        const float e = yarn_extrap_weight(i, lo, hi);
        inv_freq[i] = (inv_freq[i] / factor) * (1.0f - e) + inv_freq[i] * e;
    }
    return 0;
}

int bt_rope_inv_freq_dynamic(float *inv_freq, int D, float theta, float factor, int orig,
                             int64_t seq_len)
{
    if (!inv_freq || D < 4 || D % 2 != 0 || !(theta > 0) || !isfinite(theta) || !(factor > 0) ||
        !isfinite(factor) || orig < 1)
        return bt_fail(BT_ERR_INVALID, "rope: dynamic: bad arguments (D %d, theta %g, factor %g, "
                       "max_position_embeddings %d)", D, (double)theta, (double)factor, orig);
    if (seq_len <= orig) { /* the init-time table: base unchanged (Python floats: exactly base) */
        default_inv_freq(inv_freq, D, theta);
        return 0;
    }
    /* LlamaRotaryEmbedding._dynamic_frequency_update passes seq_len = max(position_ids) + 1 as an
     * int64 0-dim tensor, so _compute_dynamic_ntk_parameters evaluates
     *   base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
     * in fp32 tensor arithmetic (Python scalars cast to fp32 where they meet the tensor) */
    float t = factor * (float)seq_len;
    t = t / (float)orig;
    t = t - (float)((double)factor - 1.0);
    t = powf(t, (float)((double)D / (double)(D - 2)));
    const float base = theta * t;
    for (int i = 0; i < D / 2; i++)
        inv_freq[i] = 1.0f / powf(base, (float)(2 * i) / (float)D);
    return 0;
}

int bt_rope_fwd_freq(float *x, const int32_t *position_ids, int M, int H, int D,
                     const float *inv_freq, float pos_scale)
{
    return rope_apply(NULL, x, position_ids, M, H, D, inv_freq, pos_scale, 1.0f);
}

int bt_rope_bwd_freq(float *dx, const int32_t *position_ids, int M, int H, int D,
                     const float *inv_freq, float pos_scale)
{
    return rope_apply(NULL, dx, position_ids, M, H, D, inv_freq, pos_scale, -1.0f);
}

int bt_rope_fwd_cached(bt_rope_cache *cache, float *x, const int32_t *position_ids, int M, int H,
                       int D, const float *inv_freq, float pos_scale)
{
    return rope_apply(cache, x, position_ids, M, H, D, inv_freq, pos_scale, 1.0f);
}

int bt_rope_bwd_cached(bt_rope_cache *cache, float *dx, const int32_t *position_ids, int M, int H,
                       int D, const float *inv_freq, float pos_scale)
{
    return rope_apply(cache, dx, position_ids, M, H, D, inv_freq, pos_scale, -1.0f);
}

/* The theta form: the default table (on the stack up to D = 1024) then the table form. */
static int rope_theta_apply(float *x, const int32_t *pos, int M, int H, int D, float theta,
                            float pos_scale, float dir)
{
    const int rc = rope_check(x, pos, M, H, D, "");
    if (rc || M == 0)
        return rc;
    float local[512], *inv = local, *heap = NULL;
    if (D / 2 > 512 && !(inv = heap = malloc((size_t)(D / 2) * sizeof(float))))
        return bt_fail(BT_ERR_NOMEM, "rope: out of memory for the inv_freq table (D %d)", D);
    default_inv_freq(inv, D, theta);
    const int rc2 = rope_apply(NULL, x, pos, M, H, D, inv, pos_scale, dir);
    free(heap);
    return rc2;
}

/* x [M, H, D] fp32 rotated in place; position_ids [M] (int32, >= 0 expected; any value works);
 * theta = rope base (e.g. 10000 or 100000 for SmolLM2); pos_scale multiplies positions (linear
 * position interpolation: 1/factor; 1.0 = none). D must be even. */
int bt_rope_fwd(float *x, const int32_t *position_ids, int M, int H, int D, float theta, float pos_scale)
{
    return rope_theta_apply(x, position_ids, M, H, D, theta, pos_scale, 1.0f);
}

/* Backward of bt_rope_fwd: dx [M, H, D] in place gets the transposed (inverse) rotation
 *   dx[i] = dy[i]*cos + dy[i+D/2]*sin,  dx[i+D/2] = dy[i+D/2]*cos - dy[i]*sin.
 * Same arguments as bt_rope_fwd. */
int bt_rope_bwd(float *dx, const int32_t *position_ids, int M, int H, int D, float theta, float pos_scale)
{
    return rope_theta_apply(dx, position_ids, M, H, D, theta, pos_scale, -1.0f);
}
