/* AdamW step against values computed by hand (in double, from the torch.optim.AdamW update rule:
 * p *= 1 - lr*wd; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; p -= lr/(1-b1^t) * m /
 * (sqrt(v)/sqrt(1-b2^t) + eps)), plus the sumsq/scale helpers used for gradient clipping. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels.h"

#define CLOSE(a, b)                                                                                \
    do {                                                                                           \
        double a_ = (a), b_ = (b);                                                                 \
        if (!(fabs(a_ - b_) <= 1e-6 * (1.0 + fabs(b_))))                                           \
            fail_msg("%s:%d: %.9g vs %.9g", __FILE__, __LINE__, a_, b_);                           \
    } while (0)

static const float P0[5] = {1.0f, -2.0f, 0.5f, 0.0f, 3.0f};
static const float G[5] = {0.1f, -0.2f, 0.0f, 1.5f, -1e-3f};

static void test_first_step(void **state)
{
    (void)state;
    float p[5], m[5] = {0}, v[5] = {0};
    memcpy(p, P0, sizeof p);
    bt_adamw_step(p, G, m, v, 5, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, 1);
    /* step 1: bias corrections cancel, so p = p(1 - 1e-5) - 1e-3 * g/(|g| + 1e-8) */
    const double pe[5] = {0.99899000010000005, -1.99898000005, 0.49999500000000002,
                          -0.00099999999333333345, 3.0009699900001001};
    const double me[5] = {0.01, -0.02, 0.0, 0.15, -1e-4};
    const double ve[5] = {1e-5, 4e-5, 0.0, 2.25e-3, 1e-9};
    for (int i = 0; i < 5; i++) {
        CLOSE(p[i], pe[i]);
        CLOSE(m[i], me[i]);
        CLOSE(v[i], ve[i]);
    }
}

static void test_later_step(void **state)
{
    (void)state;
    float p[5], m[5] = {0.05f, -0.01f, 0.002f, 0.3f, 0.0f}, v[5] = {1e-3f, 4e-4f, 1e-6f, 0.02f, 1e-8f};
    memcpy(p, P0, sizeof p);
    bt_adamw_step(p, G, m, v, 5, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, 7);
    const double pe[5] = {0.99971273735325694, -1.9997585154644197, 0.49970662097594998,
                          -0.00045108026442726814, 3.0001227467444345};
    const double me[5] = {0.055, -0.029, 0.0018, 0.42, -1e-4};
    const double ve[5] = {0.001009, 0.0004396, 9.99e-07, 0.02223, 1.099e-08};
    for (int i = 0; i < 5; i++) {
        CLOSE(p[i], pe[i]);
        CLOSE(m[i], me[i]);
        CLOSE(v[i], ve[i]);
    }
}

static void test_large_parallel_matches_small(void **state)
{
    (void)state;
    /* the OpenMP path (n >= 65536) gives the same bits as element-by-element calls */
    const int64_t n = 70001;
    float *p = malloc(n * 4), *g = malloc(n * 4), *m = calloc(n, 4), *v = calloc(n, 4);
    float *p1 = malloc(n * 4), *m1 = calloc(n, 4), *v1 = calloc(n, 4);
    for (int64_t i = 0; i < n; i++) {
        p[i] = p1[i] = sinf((float)i);
        g[i] = cosf((float)i * 0.37f);
    }
    for (int t = 1; t <= 3; t++) {
        bt_adamw_step(p, g, m, v, n, 2e-4f, 0.9f, 0.999f, 1e-8f, 0.0f, t);
        for (int64_t i = 0; i < n; i += 997)
            bt_adamw_step(p1 + i, g + i, m1 + i, v1 + i, 1, 2e-4f, 0.9f, 0.999f, 1e-8f, 0.0f, t);
    }
    for (int64_t i = 0; i < n; i += 997)
        assert_memory_equal(&p[i], &p1[i], 4);
    free(p), free(g), free(m), free(v), free(p1), free(m1), free(v1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_first_step),
        cmocka_unit_test(test_later_step),
        cmocka_unit_test(test_large_parallel_matches_small),
    };
    return cmocka_run_group_tests_name("adamw", tests, NULL, NULL);
}
