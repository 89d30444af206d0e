/* CPU kernels: linear, RMSNorm, RoPE, SwiGLU, embedding, sumsq/scale and the vectorised expf,
 * each against a double-precision reference (and backward passes against central differences of
 * that reference). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "kernels/cpu/cpu_math.h"
#include "kernels/kernels.h"

static uint32_t rs = 987654321u;
static float frand(void) /* uniform [-1, 1) */
{
    rs = rs * 1664525u + 1013904223u;
    return (float)((rs >> 8) & 0xFFFFFF) / 8388608.0f - 1.0f;
}
static float *rand_buf(size_t n, float scale)
{
    float *p = malloc(n * sizeof(float));
    assert_non_null(p);
    for (size_t i = 0; i < n; i++)
        p[i] = scale * frand();
    return p;
}
#define CLOSE(a, b, rtol, atol)                                                                    \
    do {                                                                                           \
        double a_ = (a), b_ = (b);                                                                 \
        if (!(fabs(a_ - b_) <= (atol) + (rtol)*fabs(b_)))                                          \
            fail_msg("%s:%d: %.9g vs %.9g", __FILE__, __LINE__, a_, b_);                           \
    } while (0)

/* ---- linear ---- */

static void test_linear(void **state)
{
    (void)state;
    const int M = 7, K = 13, N = 5;
    float *X = rand_buf(M * K, 1), *W = rand_buf(N * K, 1), *dY = rand_buf(M * N, 1);
    float *Y = rand_buf(M * N, 1), *dX = rand_buf(M * K, 1), *dW = rand_buf(N * K, 1);
    float *Y0 = malloc(sizeof(float) * M * N), *dX0 = malloc(sizeof(float) * M * K);
    float *dW0 = malloc(sizeof(float) * N * K);
    memcpy(Y0, Y, sizeof(float) * M * N);
    memcpy(dX0, dX, sizeof(float) * M * K);
    memcpy(dW0, dW, sizeof(float) * N * K);
    const float beta = 0.75f;
    bt_linear_fwd(Y, X, W, M, K, N, beta);
    bt_linear_bwd_x(dX, dY, W, M, K, N, beta);
    bt_linear_bwd_w(dW, dY, X, M, K, N, beta);
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            double s = beta * (double)Y0[m * N + n];
            for (int k = 0; k < K; k++)
                s += (double)X[m * K + k] * W[n * K + k];
            CLOSE(Y[m * N + n], s, 1e-5, 1e-5);
        }
    for (int m = 0; m < M; m++)
        for (int k = 0; k < K; k++) {
            double s = beta * (double)dX0[m * K + k];
            for (int n = 0; n < N; n++)
                s += (double)dY[m * N + n] * W[n * K + k];
            CLOSE(dX[m * K + k], s, 1e-5, 1e-5);
        }
    for (int n = 0; n < N; n++)
        for (int k = 0; k < K; k++) {
            double s = beta * (double)dW0[n * K + k];
            for (int m = 0; m < M; m++)
                s += (double)dY[m * N + n] * X[m * K + k];
            CLOSE(dW[n * K + k], s, 1e-5, 1e-5);
        }
    /* beta 0 overwrites garbage (NaN) */
    for (int i = 0; i < M * N; i++)
        Y[i] = NAN;
    bt_linear_fwd(Y, X, W, M, K, N, 0.0f);
    for (int i = 0; i < M * N; i++)
        assert_false(isnan(Y[i]));
    free(X), free(W), free(dY), free(Y), free(dX), free(dW), free(Y0), free(dX0), free(dW0);
}

/* bt_sgemm on the matrix-vector shapes (one row, M == 1: a decode token; one column, N == 1),
 * which take the sgemv path (blas_par.c), for every transpose combination, with row strides
 * wider than the rows, beta 0 over nan garbage and beta 0.5, and sizes on both sides of the
 * threading threshold; C's padding between rows (ldc > 1 with N == 1) stays untouched. */
static void test_sgemm_vector_shapes(void **state)
{
    (void)state;
    static const int shapes[][3] = {{1, 3001, 97}, {2999, 1, 101}, {1, 1, 50}, {1, 37, 9},
                                    {23, 1, 7}, {1, 19, 0}, {5, 1, 0}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
        for (int tA = 0; tA < 2; tA++)
            for (int tB = 0; tB < 2; tB++)
                for (int bi = 0; bi < 2; bi++) {
                    const int M = shapes[si][0], N = shapes[si][1], K = shapes[si][2];
                    const float beta = bi ? 0.5f : 0.0f;
                    /* A is [M,K] or [K,M]; B is [K,N] or [N,K]; each row padded by 3 */
                    const int ar = tA ? K : M, ac = tA ? M : K, br = tB ? N : K, bc = tB ? K : N;
                    const int lda = ac + 3, ldb = bc + 3, ldc = N + 3;
                    float *A = rand_buf((size_t)(ar > 0 ? ar : 1) * lda, 1);
                    float *B = rand_buf((size_t)(br > 0 ? br : 1) * ldb, 1);
                    float *C = rand_buf((size_t)M * ldc, 1), *C0 = malloc(sizeof(float) * M * ldc);
                    assert_non_null(C0);
                    if (beta == 0.0f)
                        for (int m = 0; m < M; m++)
                            for (int n = 0; n < N; n++)
                                C[(size_t)m * ldc + n] = NAN;
                    memcpy(C0, C, sizeof(float) * M * ldc);
                    bt_sgemm(tA, tB, M, N, K, 1.5f, A, lda, B, ldb, beta, C, ldc);
                    for (int m = 0; m < M; m++)
                        for (int n = 0; n < ldc; n++) {
                            const size_t at = (size_t)m * ldc + n;
                            if (n >= N) { /* padding */
                                assert_memory_equal(&C[at], &C0[at], sizeof(float));
                                continue;
                            }
                            double r = beta != 0.0f ? beta * (double)C0[at] : 0.0;
                            for (int k = 0; k < K; k++) {
                                double a = tA ? A[(size_t)k * lda + m] : A[(size_t)m * lda + k];
                                double b = tB ? B[(size_t)n * ldb + k] : B[(size_t)k * ldb + n];
                                r += 1.5 * a * b;
                            }
                            CLOSE(C[at], r, 1e-5, 1e-4);
                        }
                    free(A), free(B), free(C), free(C0);
                }
}

/* ---- RMSNorm ---- */

static double rms_ref_loss(const double *x, const double *w, const double *dy, int M, int D, double eps)
{
    double L = 0.0;
    for (int m = 0; m < M; m++) {
        double ss = 0.0;
        for (int d = 0; d < D; d++)
            ss += x[m * D + d] * x[m * D + d];
        double r = 1.0 / sqrt(ss / D + eps);
        for (int d = 0; d < D; d++)
            L += dy[m * D + d] * w[d] * x[m * D + d] * r;
    }
    return L;
}

static void test_rmsnorm(void **state)
{
    (void)state;
    const int M = 6, D = 24;
    const float eps = 1e-5f;
    float *x = rand_buf(M * D, 2), *w = rand_buf(D, 1), *dy = rand_buf(M * D, 1);
    float *y = malloc(sizeof(float) * M * D), *rstd = malloc(sizeof(float) * M);
    float *dx = malloc(sizeof(float) * M * D), *dw = malloc(sizeof(float) * D);
    bt_rmsnorm_fwd(y, rstd, x, w, M, D, eps);
    for (int m = 0; m < M; m++) {
        double ss = 0.0;
        for (int d = 0; d < D; d++)
            ss += (double)x[m * D + d] * x[m * D + d];
        double r = 1.0 / sqrt(ss / D + eps);
        CLOSE(rstd[m], r, 1e-6, 0);
        for (int d = 0; d < D; d++)
            CLOSE(y[m * D + d], w[d] * x[m * D + d] * r, 2e-6, 1e-7);
    }
    for (int d = 0; d < D; d++)
        dw[d] = 0.5f; /* accumulated into */
    bt_rmsnorm_bwd(dx, dw, dy, x, w, rstd, M, D);
    double *xd = malloc(sizeof(double) * M * D), *wd = malloc(sizeof(double) * D);
    double *dyd = malloc(sizeof(double) * M * D);
    for (int i = 0; i < M * D; i++)
        xd[i] = x[i], dyd[i] = dy[i];
    for (int d = 0; d < D; d++)
        wd[d] = w[d];
    const double h = 1e-6;
    for (int i = 0; i < M * D; i++) {
        double o = xd[i];
        xd[i] = o + h;
        double lp = rms_ref_loss(xd, wd, dyd, M, D, eps);
        xd[i] = o - h;
        double lm = rms_ref_loss(xd, wd, dyd, M, D, eps);
        xd[i] = o;
        CLOSE(dx[i], (lp - lm) / (2 * h), 1e-4, 1e-5);
    }
    for (int d = 0; d < D; d++) {
        double o = wd[d];
        wd[d] = o + h;
        double lp = rms_ref_loss(xd, wd, dyd, M, D, eps);
        wd[d] = o - h;
        double lm = rms_ref_loss(xd, wd, dyd, M, D, eps);
        wd[d] = o;
        CLOSE(dw[d], 0.5 + (lp - lm) / (2 * h), 1e-4, 1e-5);
    }
    /* dw == NULL and in-place dx == dy */
    float *dy2 = malloc(sizeof(float) * M * D);
    memcpy(dy2, dy, sizeof(float) * M * D);
    bt_rmsnorm_bwd(dy2, NULL, dy2, x, w, rstd, M, D);
    assert_memory_equal(dy2, dx, sizeof(float) * M * D);
    /* a larger case takes the multi-threaded path: compare with the serial one row by row */
    const int M2 = 700, D2 = 96;
    float *x2 = rand_buf(M2 * D2, 1), *w2 = rand_buf(D2, 1), *g2 = rand_buf(M2 * D2, 1);
    float *y2 = malloc(sizeof(float) * M2 * D2), *r2 = malloc(sizeof(float) * M2);
    float *dx2 = malloc(sizeof(float) * M2 * D2), *dw2 = calloc(D2, sizeof(float));
    float *dw1 = calloc(D2, sizeof(float)), *dxr = malloc(sizeof(float) * D2);
    bt_rmsnorm_fwd(y2, r2, x2, w2, M2, D2, eps);
    bt_rmsnorm_bwd(dx2, dw2, g2, x2, w2, r2, M2, D2);
    for (int m = 0; m < M2; m++) {
        bt_rmsnorm_bwd(dxr, dw1, g2 + m * D2, x2 + m * D2, w2, r2 + m, 1, D2);
        assert_memory_equal(dxr, dx2 + m * D2, sizeof(float) * D2);
    }
    for (int d = 0; d < D2; d++)
        CLOSE(dw2[d], dw1[d], 1e-5, 1e-5);
    free(x2), free(w2), free(g2), free(y2), free(r2), free(dx2), free(dw2), free(dw1), free(dxr);
    free(x), free(w), free(dy), free(y), free(rstd), free(dx), free(dw), free(xd), free(wd), free(dyd);
    free(dy2);
}

/* ---- RoPE ---- */

static void test_rope_hand_value(void **state)
{
    (void)state;
    /* D = 4, theta = 10000: inv_freq = [1, 1/100]; pairs (0,2) and (1,3) */
    float x[4] = {1, 2, 3, 4};
    int32_t pos = 1;
    bt_rope_fwd(x, &pos, 1, 1, 4, 10000.0f, 1.0f);
    CLOSE(x[0], 1 * cos(1.0) - 3 * sin(1.0), 1e-6, 1e-6);
    CLOSE(x[2], 3 * cos(1.0) + 1 * sin(1.0), 1e-6, 1e-6);
    CLOSE(x[1], 2 * cos(0.01) - 4 * sin(0.01), 1e-6, 1e-6);
    CLOSE(x[3], 4 * cos(0.01) + 2 * sin(0.01), 1e-6, 1e-6);
    /* position 0 is the identity */
    float y[4] = {1, 2, 3, 4};
    pos = 0;
    bt_rope_fwd(y, &pos, 1, 1, 4, 10000.0f, 1.0f);
    assert_true(y[0] == 1 && y[1] == 2 && y[2] == 3 && y[3] == 4);
    /* pos_scale: position 4 at scale 0.25 == position 1 at scale 1 */
    float z[4] = {1, 2, 3, 4};
    pos = 4;
    bt_rope_fwd(z, &pos, 1, 1, 4, 10000.0f, 0.25f);
    for (int i = 0; i < 4; i++)
        CLOSE(z[i], x[i], 1e-6, 1e-6);
}

/* Bad shapes are refused with the reason (they used to return silently, leaving x unrotated);
 * M == 0 is nothing to do. */
static void test_rope_refuses_bad_shapes(void **state)
{
    (void)state;
    int32_t pos[2] = {0, 1};
    float x[2 * 2 * 6], x0[2 * 2 * 6], inv[3] = {1.0f, 0.1f, 0.01f};
    for (int i = 0; i < 24; i++)
        x[i] = x0[i] = (float)i;
    bt_rope_cache cache = {0};
    const struct { int M, H, D; } bad[] = {{2, 2, 5}, {2, 0, 6}, {-1, 2, 6}, {2, 2, 0}};
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        const int M = bad[k].M, H = bad[k].H, D = bad[k].D;
        assert_int_equal(bt_rope_fwd(x, pos, M, H, D, 10000.0f, 1.0f), BT_ERR_INVALID);
        assert_non_null(strstr(bt_last_error(), "rope: M "));
        assert_int_equal(bt_rope_bwd(x, pos, M, H, D, 10000.0f, 1.0f), BT_ERR_INVALID);
        assert_int_equal(bt_rope_fwd_freq(x, pos, M, H, D, inv, 1.0f), BT_ERR_INVALID);
        assert_int_equal(bt_rope_bwd_freq(x, pos, M, H, D, inv, 1.0f), BT_ERR_INVALID);
        assert_int_equal(bt_rope_fwd_cached(&cache, x, pos, M, H, D, inv, 1.0f), BT_ERR_INVALID);
        assert_int_equal(bt_rope_bwd_cached(&cache, x, pos, M, H, D, inv, 1.0f), BT_ERR_INVALID);
    }
    assert_int_equal(bt_rope_fwd_freq(x, pos, 2, 2, 6, NULL, 1.0f), BT_ERR_INVALID);
    assert_memory_equal(x, x0, sizeof x);
    assert_int_equal(bt_rope_fwd(x, pos, 0, 2, 6, 10000.0f, 1.0f), BT_OK);
    assert_int_equal(bt_rope_fwd_cached(&cache, x, pos, 2, 2, 6, inv, 1.0f), BT_OK);
    bt_rope_cache_free(&cache);
}

static void test_rope_inverse_and_transpose(void **state)
{
    (void)state;
    const int M = 9, H = 3, D = 64;
    int32_t pos[9] = {0, 1, 2, 100, 2047, 5, 3000000, -3, 7}; /* uncached positions too */
    float *x = rand_buf(M * H * D, 1), *x0 = malloc(sizeof(float) * M * H * D);
    float *y = rand_buf(M * H * D, 1), *y0 = malloc(sizeof(float) * M * H * D);
    memcpy(x0, x, sizeof(float) * M * H * D);
    memcpy(y0, y, sizeof(float) * M * H * D);
    bt_rope_fwd(x, pos, M, H, D, 100000.0f, 1.0f);
    /* <R x, y> == <x, R^T y> */
    bt_rope_bwd(y, pos, M, H, D, 100000.0f, 1.0f);
    double a = 0, b = 0;
    for (int i = 0; i < M * H * D; i++) {
        a += (double)x[i] * y0[i];
        b += (double)x0[i] * y[i];
    }
    CLOSE(a, b, 1e-5, 1e-5);
    /* inverse */
    bt_rope_bwd(x, pos, M, H, D, 100000.0f, 1.0f);
    for (int i = 0; i < M * H * D; i++)
        CLOSE(x[i], x0[i], 1e-5, 1e-5);
    /* every row against the HF formula with the fp32 angle */
    memcpy(x, x0, sizeof(float) * M * H * D);
    bt_rope_fwd(x, pos, M, H, D, 100000.0f, 1.0f);
    for (int m = 0; m < M; m++)
        for (int h = 0; h < H; h++)
            for (int i = 0; i < D / 2; i++) {
                float inv = 1.0f / powf(100000.0f, (float)(2 * i) / (float)D);
                float ang = (float)pos[m] * inv;
                double c = cos((double)ang), s = sin((double)ang);
                const float *r0 = x0 + (m * H + h) * D;
                const float *r1 = x + (m * H + h) * D;
                CLOSE(r1[i], r0[i] * c - r0[i + D / 2] * s, 1e-5, 1e-6);
                CLOSE(r1[i + D / 2], r0[i + D / 2] * c + r0[i] * s, 1e-5, 1e-6);
            }
    free(x), free(x0), free(y), free(y0);
}

/* The cos/sin cache belongs to its caller (bt_rope_cache; the step context and the inference
 * state each own one): the cached rotation equals the computed one bit for bit whatever the cache
 * holds (empty, grown, replaced by another table or scale, positions past it or negative), and a
 * cache is touched only by the calls given it, so two callers with different tables never share
 * (or thrash) one table. */
static void test_rope_cache_owned_and_exact(void **state)
{
    (void)state;
    enum { M = 10, H = 2, D = 64, HALF = D / 2 };
    const int32_t pos[M] = {0, 1, 4095, 4096, 9000, 5, -3, 7, 8191, 2};
    float inv_a[HALF], inv_b[HALF];
    assert_int_equal(bt_rope_inv_freq(inv_a, D, 10000.0f, NULL, 1, 1, 1, 0), 0);
    assert_int_equal(bt_rope_inv_freq(inv_b, D, 500000.0f, "linear", 4.0f, 1, 1, 0), 0);
    float *x0 = rand_buf(M * H * D, 1), *want = malloc(sizeof(float) * M * H * D),
          *got = malloc(sizeof(float) * M * H * D);
    assert_non_null(want);
    assert_non_null(got);
    bt_rope_cache ca, cb;
    memset(&ca, 0, sizeof ca);
    memset(&cb, 0, sizeof cb);
    /* (table, pos_scale, positions used, direction) in an order that builds, grows, replaces and
     * reuses the caches */
    const struct {
        const float *inv;
        float scale;
        int m;
        int fwd;
        bt_rope_cache *c;
    } calls[] = {
        {inv_a, 1.0f, 3, 1, &ca},  /* builds ca for [0, 4096) */
        {inv_a, 1.0f, 5, 0, &ca},  /* 9000: grows ca */
        {inv_b, 1.0f, 10, 1, &cb}, /* cb is another table: ca stays */
        {inv_a, 1.0f, 10, 1, &ca}, /* a hit; -3 is a computed row */
        {inv_a, 0.5f, 10, 0, &ca}, /* another scale: replaces ca */
        {inv_b, 1.0f, 4, 0, &cb},
    };
    for (size_t k = 0; k < sizeof calls / sizeof calls[0]; k++) {
        const int n = calls[k].m * H * D;
        memcpy(want, x0, sizeof(float) * n);
        memcpy(got, x0, sizeof(float) * n);
        if (calls[k].fwd) {
            bt_rope_fwd_freq(want, pos, calls[k].m, H, D, calls[k].inv, calls[k].scale);
            bt_rope_fwd_cached(calls[k].c, got, pos, calls[k].m, H, D, calls[k].inv, calls[k].scale);
        } else {
            bt_rope_bwd_freq(want, pos, calls[k].m, H, D, calls[k].inv, calls[k].scale);
            bt_rope_bwd_cached(calls[k].c, got, pos, calls[k].m, H, D, calls[k].inv, calls[k].scale);
        }
        if (memcmp(want, got, sizeof(float) * n))
            fail_msg("call %zu: the cached rotation differs from the computed one", k);
        /* the cache given holds this call's table; the other one is untouched */
        assert_non_null(calls[k].c->cos_sin);
        assert_memory_equal(calls[k].c->inv, calls[k].inv, sizeof inv_a);
        assert_true(calls[k].c->pos_scale == calls[k].scale && calls[k].c->D == D);
        if (k == 0)
            assert_int_equal(ca.npos, 4096);
        if (k == 1)
            assert_int_equal(ca.npos, 9001); /* > 2 * 4096: exactly what was asked */
        if (k == 2 || k == 3) {
            assert_memory_equal(ca.inv, inv_a, sizeof inv_a);
            assert_memory_equal(cb.inv, inv_b, sizeof inv_b);
        }
        if (k >= 3)
            assert_int_equal(ca.npos, 9001);
    }
    /* the theta form is the default table, uncached, bit for bit */
    memcpy(want, x0, sizeof(float) * M * H * D);
    memcpy(got, x0, sizeof(float) * M * H * D);
    bt_rope_fwd(want, pos, M, H, D, 10000.0f, 1.0f);
    bt_rope_fwd_cached(&cb, got, pos, M, H, D, inv_a, 1.0f);
    assert_memory_equal(want, got, sizeof(float) * M * H * D);
    bt_rope_cache_free(&ca);
    bt_rope_cache_free(&cb);
    assert_null(ca.cos_sin);
    assert_null(cb.inv);
    assert_int_equal(cb.npos, 0);
    bt_rope_cache_free(NULL);
    free(x0), free(want), free(got);
}

/* ---- SwiGLU ---- */

static void test_swiglu(void **state)
{
    (void)state;
    const int n = 1000;
    float *g = rand_buf(n, 8), *u = rand_buf(n, 2), *dh = rand_buf(n, 1);
    float *h = malloc(sizeof(float) * n), *dg = malloc(sizeof(float) * n), *du = malloc(sizeof(float) * n);
    g[0] = 0.0f;
    g[1] = -100.0f;
    g[2] = 100.0f;
    bt_swiglu_fwd(h, g, u, n);
    bt_swiglu_bwd(dg, du, dh, g, u, n);
    for (int i = 0; i < n; i++) {
        double gd = g[i], s = 1.0 / (1.0 + exp(-gd));
        CLOSE(h[i], gd * s * u[i], 1e-6, 1e-7);
        /* central difference of dh * silu(g) * u in double */
        const double e = 1e-6;
        double fp = (gd + e) / (1.0 + exp(-(gd + e))), fm = (gd - e) / (1.0 + exp(-(gd - e)));
        CLOSE(dg[i], dh[i] * u[i] * (fp - fm) / (2 * e), 1e-5, 1e-6);
        CLOSE(du[i], dh[i] * gd * s, 1e-6, 1e-7);
    }
    free(g), free(u), free(dh), free(h), free(dg), free(du);
}

/* GeGLU (tanh GELU, HF gelu_pytorch_tanh) against the formula in double, and its gradient
 * against central differences */
static void test_geglu(void **state)
{
    (void)state;
    const int n = 1000;
    float *g = rand_buf(n, 8), *u = rand_buf(n, 2), *dh = rand_buf(n, 1);
    float *h = malloc(sizeof(float) * n), *dg = malloc(sizeof(float) * n), *du = malloc(sizeof(float) * n);
    g[0] = 0.0f;
    g[1] = -100.0f;
    g[2] = 100.0f;
    g[3] = 1e-4f;
    bt_geglu_fwd(h, g, u, n);
    bt_geglu_bwd(dg, du, dh, g, u, n);
    for (int i = 0; i < n; i++) {
        const double gd = g[i], c = 0.79788456080286535588; /* sqrt(2 / pi) */
#define GELU(x) (0.5 * (x) * (1.0 + tanh(c * ((x) + 0.044715 * (x) * (x) * (x)))))
        CLOSE(h[i], GELU(gd) * u[i], 1e-6, 1e-7);
        const double e = 1e-6;
        CLOSE(dg[i], dh[i] * u[i] * (GELU(gd + e) - GELU(gd - e)) / (2 * e), 1e-5, 1e-6);
        CLOSE(du[i], dh[i] * GELU(gd), 1e-6, 1e-7);
#undef GELU
    }
    free(g), free(u), free(dh), free(h), free(dg), free(du);
}

/* ---- embedding, sumsq, scale, expf ---- */

static void test_embedding_sumsq_scale(void **state)
{
    (void)state;
    const int V = 10, D = 7, M = 5;
    float *table = rand_buf(V * D, 1), *out = malloc(sizeof(float) * M * D);
    int32_t ids[5] = {3, 0, 9, 3, 5};
    assert_int_equal(bt_embedding_fwd(out, table, ids, M, D, V), 0);
    for (int m = 0; m < M; m++)
        assert_memory_equal(out + m * D, table + ids[m] * D, sizeof(float) * D);
    const int64_t n = 100003;
    float *x = rand_buf((size_t)n, 3);
    double ref = 0.0;
    for (int64_t i = 0; i < n; i++)
        ref += (double)x[i] * x[i];
    CLOSE(bt_sumsq(x, n), ref, 1e-12, 0);
    assert_true(bt_sumsq(x, 0) == 0.0);
    float x5 = x[5];
    bt_scale(x, n, -0.5f);
    assert_true(x[5] == -0.5f * x5);
    free(table), free(out), free(x);
}

static void test_expf(void **state)
{
    (void)state;
    double maxrel = 0.0;
    for (int i = 0; i <= 2000000; i++) {
        float x = -87.0f + 175.0f * (float)i / 2000000.0f;
        double r = fabs((double)bt_expf(x) / exp((double)x) - 1.0);
        if (r > maxrel)
            maxrel = r;
    }
    assert_true(maxrel < 3e-7);
    assert_true(bt_expf(-INFINITY) == 0.0f);
    assert_true(bt_expf(-1000.0f) == 0.0f);
    assert_true(bt_expf(0.0f) == 1.0f);
    assert_true(isnan(bt_expf(NAN)));
    assert_true(isfinite(bt_expf(1000.0f)));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_linear),
        cmocka_unit_test(test_sgemm_vector_shapes),
        cmocka_unit_test(test_rmsnorm),
        cmocka_unit_test(test_rope_hand_value),
        cmocka_unit_test(test_rope_refuses_bad_shapes),
        cmocka_unit_test(test_rope_inverse_and_transpose),
        cmocka_unit_test(test_rope_cache_owned_and_exact),
        cmocka_unit_test(test_swiglu),
        cmocka_unit_test(test_geglu),
        cmocka_unit_test(test_embedding_sumsq_scale),
        cmocka_unit_test(test_expf),
    };
    return cmocka_run_group_tests_name("kernels", tests, NULL, NULL);
}
