/* Fused linear + cross-entropy against a naive full-logits reference in double: sum of losses,
 * n_valid, ignored (-100) and out-of-range targets, chunk sizes that do not divide M, dX == NULL,
 * large logits (max subtraction); dX against the analytic double-precision gradient. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels.h"

static uint32_t rs = 4242u;
static float frand(void)
{
    rs = rs * 1664525u + 1013904223u;
    return (float)((rs >> 8) & 0xFFFFFF) / 8388608.0f - 1.0f;
}

/* naive reference: returns loss sum, fills dX (grad_scale applied) and count */
static double ref_ce(double *dX, int *cnt, const float *X, const float *W, const int32_t *t, int M,
                     int D, int V, double gs)
{
    double total = 0.0;
    double *lg = malloc(sizeof(double) * V);
    *cnt = 0;
    for (int m = 0; m < M; m++) {
        if (dX)
            for (int d = 0; d < D; d++)
                dX[m * D + d] = 0.0;
        if (t[m] < 0 || t[m] >= V)
            continue;
        double mx = -INFINITY;
        for (int v = 0; v < V; v++) {
            double s = 0.0;
            for (int d = 0; d < D; d++)
                s += (double)X[m * D + d] * W[v * D + d];
            lg[v] = s;
            mx = s > mx ? s : mx;
        }
        double se = 0.0;
        for (int v = 0; v < V; v++)
            se += exp(lg[v] - mx);
        double lse = mx + log(se);
        total += lse - lg[t[m]];
        (*cnt)++;
        if (dX)
            for (int v = 0; v < V; v++) {
                double g = (exp(lg[v] - lse) - (v == t[m])) * gs;
                for (int d = 0; d < D; d++)
                    dX[m * D + d] += g * W[v * D + d];
            }
    }
    free(lg);
    return total;
}

static void run_case(int M, int D, int V, int chunk, float xscale, const int32_t *targets)
{
    float *X = malloc(sizeof(float) * M * D), *W = malloc(sizeof(float) * V * D);
    for (int i = 0; i < M * D; i++)
        X[i] = xscale * frand();
    for (int i = 0; i < V * D; i++)
        W[i] = frand();
    float *dX = malloc(sizeof(float) * M * D);
    for (int i = 0; i < M * D; i++)
        dX[i] = NAN; /* must be overwritten */
    double *dXr = malloc(sizeof(double) * M * D);
    float *ws = malloc(sizeof(float) * bt_linear_ce_workspace_floats(chunk, V));
    int nv = -1, nr = -1;
    const float gs = 0.37f;
    double loss = bt_linear_ce(dX, &nv, X, W, targets, M, D, V, chunk, gs, ws);
    double lref = ref_ce(dXr, &nr, X, W, targets, M, D, V, gs);
    assert_int_equal(nv, nr);
    if (!(fabs(loss - lref) <= 1e-5 * (1.0 + fabs(lref))))
        fail_msg("loss %.9g vs ref %.9g", loss, lref);
    for (int i = 0; i < M * D; i++)
        if (!(fabs(dX[i] - dXr[i]) <= 1e-4 * (1e-3 + fabs(dXr[i])) + 1e-6))
            fail_msg("dX[%d] %.9g vs ref %.9g", i, dX[i], dXr[i]);
    /* loss only */
    int nv2 = -1;
    double loss2 = bt_linear_ce(NULL, &nv2, X, W, targets, M, D, V, chunk, gs, ws);
    assert_int_equal(nv2, nv);
    assert_true(fabs(loss2 - loss) <= 1e-9 * (1.0 + fabs(loss)));
    free(X), free(W), free(dX), free(dXr), free(ws);
}

static void test_ce_mixed_targets(void **state)
{
    (void)state;
    const int M = 13, V = 50;
    int32_t t[13] = {3, -100, 49, 0, 7, -100, 12, 50 /* out of range */, -5, 22, 22, 1, -100};
    run_case(M, 16, V, 4, 1.0f, t);  /* 4 does not divide 13 */
    run_case(M, 16, V, 13, 1.0f, t); /* one chunk */
    run_case(M, 16, V, 64, 1.0f, t); /* chunk larger than M */
    run_case(M, 16, V, 1, 1.0f, t);
}

static void test_ce_large_logits(void **state)
{
    (void)state;
    int32_t t[6] = {0, 1, 2, 3, 4, 5};
    run_case(6, 8, 300, 5, 60.0f, t); /* logits ~ +-500: needs the max subtraction */
}

static void test_ce_all_ignored(void **state)
{
    (void)state;
    int32_t t[3] = {-100, -100, -100};
    float X[3 * 4] = {0}, W[5 * 4] = {0}, dX[12];
    float ws[64];
    assert_true(bt_linear_ce_workspace_floats(2, 5) <= 64);
    int nv = 7;
    double l = bt_linear_ce(dX, &nv, X, W, t, 3, 4, 5, 2, 1.0f, ws);
    assert_true(l == 0.0);
    assert_int_equal(nv, 0);
    for (int i = 0; i < 12; i++)
        assert_true(dX[i] == 0.0f);
}

static void test_ce_uniform_value(void **state)
{
    (void)state;
    /* W = 0: every logit 0, loss per token = log(V) */
    const int M = 4, D = 3, V = 1000;
    float X[12], *W = calloc(V * D, sizeof(float));
    for (int i = 0; i < 12; i++)
        X[i] = frand();
    int32_t t[4] = {0, 999, 500, -100};
    float *ws = malloc(sizeof(float) * bt_linear_ce_workspace_floats(3, V));
    int nv = 0;
    double l = bt_linear_ce(NULL, &nv, X, W, t, M, D, V, 3, 1.0f, ws);
    assert_int_equal(nv, 3);
    assert_true(fabs(l - 3.0 * log(1000.0)) < 1e-5);
    free(W), free(ws);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ce_mixed_targets),
        cmocka_unit_test(test_ce_large_logits),
        cmocka_unit_test(test_ce_all_ignored),
        cmocka_unit_test(test_ce_uniform_value),
    };
    return cmocka_run_group_tests_name("linear_ce", tests, NULL, NULL);
}
