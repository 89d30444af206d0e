/* Rotary position embedding (Su et al. 2021, RoFormer, arXiv 2104.09864) in the HF Llama
 * "rotate_half" layout: for i < D/2 the pair (x[i], x[i + D/2]) is rotated by angle p * inv_freq[i]:
 *   y[i]       = x[i] * cos - x[i+D/2] * sin
 *   y[i + D/2] = x[i+D/2] * cos + x[i] * sin
 * (transformers/models/llama/modeling_llama.py apply_rotary_pos_emb: q*cos + rotate_half(q)*sin).
 * inv_freq[i] = 1 / theta^(2i/D) in fp32 as HF computes it
 * (1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))); p = (float)position * pos_scale in
 * fp32 and the angle = p * inv_freq[i] rounded to fp32 like HF's fp32 matmul; cos/sin of that fp32
 * angle are evaluated in double and rounded (torch's fp32 cos/sin are within ~1 ulp of that).
 * cos/sin tables are cached per (theta, pos_scale, D) for positions [0, cached) and grown on
 * demand under a rwlock; positions outside [0, 1<<20) are computed directly. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* pthread_rwlock_t under -std=c17 */
#endif
#include "kernels/kernels.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>

#define BT_ROPE_MAX_CACHED_POS (1 << 20)

typedef struct {
    pthread_rwlock_t lock;
    float theta, pos_scale;
    int D, npos;    /* table covers positions [0, npos) for head dim D */
    float *cos_sin; /* [npos][D/2][2]: cos, sin interleaved */
} rope_cache;

static rope_cache g_rope = {PTHREAD_RWLOCK_INITIALIZER, 0.0f, 0.0f, 0, 0, NULL};

static void rope_angle_cs(int32_t pos, int i, int D, float theta, float pos_scale, float *c, float *s)
{
    const float expo = (float)(2 * i) / (float)D;
    const float inv_freq = 1.0f / powf(theta, expo);
    const float p = (float)pos * pos_scale;
    const float ang = p * inv_freq;
    *c = (float)cos((double)ang);
    *s = (float)sin((double)ang);
}

/* Ensure the cache covers positions [0, need) for (theta, pos_scale, D); returns with the read lock
 * held, or with no lock held and NULL if allocation failed (callers then compute directly). */
static const float *rope_table_acquire(int need, int D, float theta, float pos_scale)
{
    pthread_rwlock_rdlock(&g_rope.lock);
    if (g_rope.cos_sin && g_rope.D == D && g_rope.theta == theta && g_rope.pos_scale == pos_scale &&
        g_rope.npos >= need)
        return g_rope.cos_sin;
    pthread_rwlock_unlock(&g_rope.lock);

    pthread_rwlock_wrlock(&g_rope.lock);
    if (!(g_rope.cos_sin && g_rope.D == D && g_rope.theta == theta &&
          g_rope.pos_scale == pos_scale && g_rope.npos >= need)) {
        int npos = need < 4096 ? 4096 : need;
        if (g_rope.D == D && g_rope.theta == theta && g_rope.pos_scale == pos_scale &&
            npos < 2 * g_rope.npos)
            npos = 2 * g_rope.npos;
        if (npos > BT_ROPE_MAX_CACHED_POS)
            npos = BT_ROPE_MAX_CACHED_POS;
        const int half = D / 2;
        float *t = malloc((size_t)npos * (size_t)half * 2 * sizeof(float));
        if (!t) {
            pthread_rwlock_unlock(&g_rope.lock);
            return NULL;
        }
#pragma omp parallel for schedule(static)
        for (int p = 0; p < npos; p++)
            for (int i = 0; i < half; i++)
                rope_angle_cs(p, i, D, theta, pos_scale, &t[((size_t)p * half + i) * 2],
                              &t[((size_t)p * half + i) * 2 + 1]);
        free(g_rope.cos_sin);
        g_rope.cos_sin = t;
        g_rope.npos = npos;
        g_rope.D = D;
        g_rope.theta = theta;
        g_rope.pos_scale = pos_scale;
    }
    pthread_rwlock_unlock(&g_rope.lock);
    /* re-acquire for reading; another thread may have replaced the table meanwhile, so re-check */
    return rope_table_acquire(need, D, theta, pos_scale);
}

/* dir = +1: forward rotation; dir = -1: inverse (transpose) rotation. */
static void rope_apply(float *x, const int32_t *pos, int M, int H, int D, float theta,
                       float pos_scale, float dir)
{
    if (M <= 0 || H <= 0 || D < 2)
        return;
    const int half = D / 2;
    int32_t maxp = 0;
    for (int m = 0; m < M; m++)
        if (pos[m] > maxp)
            maxp = pos[m];
    const int need = maxp < BT_ROPE_MAX_CACHED_POS ? maxp + 1 : BT_ROPE_MAX_CACHED_POS;
    const float *tab = rope_table_acquire(need, D, theta, pos_scale);
#pragma omp parallel for schedule(static) if ((int64_t)M * H * D >= 32768)
    for (int m = 0; m < M; m++) {
        const int32_t p = pos[m];
        float cs_local[2 * 256];
        const float *cs;
        if (tab && p >= 0 && p < need) {
            cs = tab + (size_t)p * half * 2;
        } else {
            /* uncached position (negative, huge, or no table): compute this row directly */
            float *buf = cs_local;
            float *heap = NULL;
            if (half > 256)
                buf = heap = malloc((size_t)half * 2 * sizeof(float));
            if (!buf)
                continue;
            for (int i = 0; i < half; i++)
                rope_angle_cs(p, i, D, theta, pos_scale, &buf[2 * i], &buf[2 * i + 1]);
            for (int h = 0; h < H; h++) {
                float *xr = x + ((size_t)m * H + h) * D;
                for (int i = 0; i < half; i++) {
                    const float c = buf[2 * i], s = dir * buf[2 * i + 1];
                    const float x1 = xr[i], x2 = xr[i + half];
                    xr[i] = x1 * c - x2 * s;
                    xr[i + half] = x2 * c + x1 * s;
                }
            }
            free(heap);
            continue;
        }
        for (int h = 0; h < H; h++) {
            float *xr = x + ((size_t)m * H + h) * D;
#pragma omp simd
            for (int i = 0; i < half; i++) {
                const float c = cs[2 * i], s = dir * cs[2 * i + 1];
                const float x1 = xr[i], x2 = xr[i + half];
                xr[i] = x1 * c - x2 * s;
                xr[i + half] = x2 * c + x1 * s;
            }
        }
    }
    if (tab)
        pthread_rwlock_unlock(&g_rope.lock);
}

/* x [M, H, D] fp32 rotated in place; position_ids [M] (int32, >= 0 expected; any value works);
 * theta = rope base (e.g. 10000 or 100000 for SmolLM2); pos_scale multiplies positions (linear
 * position interpolation: 1/factor; 1.0 = none). D must be even. */
void bt_rope_fwd(float *x, const int32_t *position_ids, int M, int H, int D, float theta, float pos_scale)
{
    rope_apply(x, position_ids, M, H, D, theta, pos_scale, 1.0f);
}

/* Backward of bt_rope_fwd: dx [M, H, D] in place gets the transposed (inverse) rotation
 *   dx[i] = dy[i]*cos + dy[i+D/2]*sin,  dx[i+D/2] = dy[i+D/2]*cos - dy[i]*sin.
 * Same arguments as bt_rope_fwd. */
void bt_rope_bwd(float *dx, const int32_t *position_ids, int M, int H, int D, float theta, float pos_scale)
{
    rope_apply(dx, position_ids, M, H, D, theta, pos_scale, -1.0f);
}
