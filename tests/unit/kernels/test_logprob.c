/* bt_linear_logprob (per-token label log-probs from the fused chunked linear + cross-entropy) and
 * bt_seq_sum against a naive full-logits computation in double: log-probs of valid and ignored
 * (-100, out-of-range) targets, chunk sizes that do not divide M, large logits, dX and dW for a
 * random per-token upstream gradient (and for dlogp == NULL = all ones, scaled afterwards, which
 * must equal passing dlogp), per-sequence sums over cu_seqlens (with and without a mask) and
 * their refusals. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels.h"

static uint32_t rs = 2525u;
static float frand(void)
{
    rs = rs * 1664525u + 1013904223u;
    return (float)((rs >> 8) & 0xFFFFFF) / 8388608.0f - 1.0f;
}

/* naive reference in double: logp[m] (0 if ignored), dX[m] = g[m] * dlogp_m/dX_m, dW = sum. */
static void ref_logprob(double *logp, double *dX, double *dW, const float *X, const float *W,
                        const int32_t *t, const float *g, int M, int D, int V)
{
    double *lg = malloc(sizeof(double) * V);
    memset(dX, 0, sizeof(double) * M * D);
    memset(dW, 0, sizeof(double) * V * D);
    for (int m = 0; m < M; m++) {
        logp[m] = 0.0;
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
        const double lse = mx + log(se);
        logp[m] = lg[t[m]] - lse;
        for (int v = 0; v < V; v++) {
            /* d logp / d logit_v = onehot - softmax */
            const double dl = g[m] * ((v == t[m]) - exp(lg[v] - lse));
            for (int d = 0; d < D; d++) {
                dX[m * D + d] += dl * W[v * D + d];
                dW[v * D + d] += dl * X[m * D + d];
            }
        }
    }
    free(lg);
}

static void check_close(const char *what, const float *got, const double *want, int n, double atol,
                        double rtol)
{
    for (int i = 0; i < n; i++)
        if (!(fabs((double)got[i] - want[i]) <= atol + rtol * fabs(want[i])))
            fail_msg("%s[%d] = %.9g, reference %.9g", what, i, (double)got[i], want[i]);
}

static void run_case(int M, int D, int V, int chunk, float xscale, const int32_t *targets)
{
    float *X = malloc(sizeof(float) * M * D), *W = malloc(sizeof(float) * V * D);
    float *g = malloc(sizeof(float) * M);
    for (int i = 0; i < M * D; i++)
        X[i] = xscale * frand();
    for (int i = 0; i < V * D; i++)
        W[i] = frand();
    for (int m = 0; m < M; m++)
        g[m] = 2.0f * frand(); /* signed upstream gradient, as a preference loss gives */
    float *logp = malloc(sizeof(float) * M), *dX = malloc(sizeof(float) * M * D);
    float *dW = malloc(sizeof(float) * V * D), *dX1 = malloc(sizeof(float) * M * D);
    double *lr = malloc(sizeof(double) * M), *dXr = malloc(sizeof(double) * M * D);
    double *dWr = malloc(sizeof(double) * V * D);
    float *ws = malloc(sizeof(float) * bt_linear_ce_workspace_floats(chunk, V));
    for (int i = 0; i < M * D; i++)
        dX[i] = dX1[i] = NAN; /* must be overwritten */
    for (int m = 0; m < M; m++)
        logp[m] = NAN;
    for (int i = 0; i < V * D; i++)
        dW[i] = 0.5f; /* accumulated into */

    const double sum = bt_linear_logprob(logp, dX, dW, X, W, targets, g, M, D, V, chunk, ws);
    ref_logprob(lr, dXr, dWr, X, W, targets, g, M, D, V);
    double sref = 0.0;
    for (int m = 0; m < M; m++)
        sref += lr[m];
    if (!(fabs(sum - sref) <= 1e-5 * (1.0 + fabs(sref))))
        fail_msg("sum of log-probs %.9g vs reference %.9g", sum, sref);
    check_close("logp", logp, lr, M, 2e-5, 2e-6);
    for (int m = 0; m < M; m++)
        if (targets[m] < 0 || targets[m] >= V)
            assert_true(logp[m] == 0.0f && !signbit(logp[m]));
        else
            assert_true(logp[m] <= 0.0f);
    check_close("dX", dX, dXr, M * D, 1e-5, 1e-4);
    for (int i = 0; i < V * D; i++)
        dWr[i] += 0.5;
    check_close("dW", dW, dWr, V * D, 1e-5, 1e-4);

    /* forward only: same log-probs, same sum (bitwise: the forward does not depend on grad) */
    float *logp2 = malloc(sizeof(float) * M);
    const double sum2 = bt_linear_logprob(logp2, NULL, NULL, X, W, targets, NULL, M, D, V, chunk, ws);
    assert_true(sum2 == sum);
    assert_memory_equal(logp2, logp, sizeof(float) * M);

    /* dlogp NULL = unit upstream; scaling its rows by g afterwards gives the dX of the g pass */
    bt_linear_logprob(NULL, dX1, NULL, X, W, targets, NULL, M, D, V, chunk, ws);
    for (int m = 0; m < M; m++)
        for (int d = 0; d < D; d++)
            dX1[m * D + d] *= g[m];
    check_close("dX (unit upstream, scaled after)", dX1, dXr, M * D, 1e-5, 1e-4);

    free(X), free(W), free(g), free(logp), free(logp2), free(dX), free(dX1), free(dW);
    free(lr), free(dXr), free(dWr), free(ws);
}

static void test_logprob_mixed_targets(void **state)
{
    (void)state;
    enum { M = 11, D = 9, V = 37 };
    int32_t t[M];
    for (int m = 0; m < M; m++)
        t[m] = (m * 7 + 3) % V;
    t[0] = -100; /* prompt token */
    t[4] = -100;
    t[7] = V;    /* out of range: ignored, never read */
    t[9] = -5;
    const int chunks[] = {1, 3, 4, M, 64};
    for (size_t i = 0; i < sizeof chunks / sizeof *chunks; i++)
        run_case(M, D, V, chunks[i], 1.0f, t);
}

static void test_logprob_large_logits(void **state)
{
    (void)state;
    enum { M = 6, D = 8, V = 50 };
    int32_t t[M] = {1, 49, 0, 17, -100, 25};
    run_case(M, D, V, 4, 40.0f, t); /* |logits| in the hundreds: needs the max subtraction */
}

static void test_logprob_uniform_value(void **state)
{
    (void)state;
    /* X = 0: uniform softmax, logp = -log V exactly in value; gradient of the unit upstream is
     * (onehot - 1/V) W */
    enum { M = 3, D = 4, V = 10 };
    float X[M * D] = {0}, W[V * D], logp[M], dX[M * D];
    for (int i = 0; i < V * D; i++)
        W[i] = (float)(i % 7) - 3.0f;
    int32_t t[M] = {2, -100, 9};
    float ws[64];
    assert_true(bt_linear_ce_workspace_floats(2, V) <= 64);
    double s = bt_linear_logprob(logp, dX, NULL, X, W, t, NULL, M, D, V, 2, ws);
    assert_true(fabs(s + 2.0 * log(10.0)) < 1e-6);
    assert_true(fabs(logp[0] + log(10.0)) < 1e-6 && logp[1] == 0.0f);
    for (int d = 0; d < D; d++) {
        double mean = 0.0;
        for (int v = 0; v < V; v++)
            mean += W[v * D + d] / V;
        assert_true(fabs(dX[0 * D + d] - (W[2 * D + d] - mean)) < 1e-5);
        assert_true(dX[1 * D + d] == 0.0f);
    }
}

static void test_seq_sum(void **state)
{
    (void)state;
    const float pt[8] = {-1.0f, -2.0f, -0.5f, -4.0f, -0.25f, -8.0f, -3.0f, -1.5f};
    const int32_t t[8] = {-100, 5, 6, -100, -100, 7, 8, 99}; /* V = 10: 99 is ignored */
    const int32_t cu[4] = {0, 3, 5, 8};                       /* [0,3) [3,5) [5,8) */
    double out[3];
    int n[3];
    assert_int_equal(bt_seq_sum(out, n, pt, t, NULL, cu, 3, 10), 0);
    assert_true(out[0] == -2.5 && n[0] == 2);
    assert_true(out[1] == 0.0 && n[1] == 0); /* a sequence with no response token */
    assert_true(out[2] == -11.0 && n[2] == 2);
    assert_int_equal(bt_seq_sum(NULL, n, pt, t, NULL, cu, 3, 10), 0);
    /* a mask keeps a subset of the valid targets (masked-in invalid targets stay out) */
    const uint8_t mk[8] = {1, 0, 1, 1, 1, 1, 1, 1};
    assert_int_equal(bt_seq_sum(out, n, pt, t, mk, cu, 3, 10), 0);
    assert_true(out[0] == -0.5 && n[0] == 1);
    assert_true(out[1] == 0.0 && n[1] == 0);
    assert_true(out[2] == -11.0 && n[2] == 2);
    /* refusals: not starting at 0, decreasing, NULL, negative count; nothing written */
    const int32_t bad0[3] = {1, 3, 5}, bad1[3] = {0, 4, 3};
    out[0] = 42.0;
    assert_int_equal(bt_seq_sum(out, NULL, pt, t, NULL, bad0, 2, 10), -1);
    assert_int_equal(bt_seq_sum(out, NULL, pt, t, NULL, bad1, 2, 10), -1);
    assert_int_equal(bt_seq_sum(out, NULL, pt, t, NULL, NULL, 2, 10), -1);
    assert_int_equal(bt_seq_sum(out, NULL, pt, t, NULL, cu, -1, 10), -1);
    assert_true(out[0] == 42.0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_logprob_mixed_targets),
        cmocka_unit_test(test_logprob_large_logits),
        cmocka_unit_test(test_logprob_uniform_value),
        cmocka_unit_test(test_seq_sum),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
