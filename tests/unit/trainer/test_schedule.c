/* Learning-rate schedule (warm-up, cosine/linear/constant decay to min_lr_ratio) and gradient
 * clipping by global L2 norm (torch.nn.utils.clip_grad_norm_ semantics). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <string.h>

#include "trainer/config.h"
#include "trainer/loop/optim.h"
#include "trainer/loop/train.h"

static void near(double got, double want, double rel, const char *what) {
    if (!(fabs(got - want) <= rel * fabs(want) + 1e-15))
        fail_msg("%s: got %.10g, want %.10g", what, got, want);
}

static void test_cosine_warmup(void **st) {
    (void)st;
    bt_schedule s = {BT_SCHED_COSINE, 1e-3, 0.1, 10, 100};
    near(bt_schedule_lr(&s, 0), 1e-4, 1e-12, "warm-up step 0 = lr/warmup (not 0)");
    near(bt_schedule_lr(&s, 4), 5e-4, 1e-12, "warm-up step 4");
    near(bt_schedule_lr(&s, 9), 1e-3, 1e-12, "last warm-up step = peak");
    near(bt_schedule_lr(&s, 10), 1e-3, 1e-12, "decay start = peak");
    near(bt_schedule_lr(&s, 55), 1e-4 + 9e-4 * 0.5, 1e-12, "cosine midpoint");
    /* step 32: p = 22/90 */
    near(bt_schedule_lr(&s, 32), 1e-4 + 9e-4 * 0.5 * (1 + cos(M_PI * 22 / 90.0)), 1e-12,
         "cosine step 32");
    near(bt_schedule_lr(&s, 99), 1e-4 + 9e-4 * 0.5 * (1 + cos(M_PI * 89 / 90.0)), 1e-12,
         "last step");
    near(bt_schedule_lr(&s, 100), 1e-4, 1e-12, "end = min_lr");
    near(bt_schedule_lr(&s, 1000), 1e-4, 1e-12, "past end stays at min_lr");
    double prev = INFINITY;
    for (int i = 10; i < 100; i++) {
        double lr = bt_schedule_lr(&s, i);
        assert_true(lr <= prev && lr >= 1e-4 - 1e-18);
        prev = lr;
    }
    /* no warm-up: first step at peak */
    bt_schedule s0 = {BT_SCHED_COSINE, 2e-4, 0.0, 0, 50};
    near(bt_schedule_lr(&s0, 0), 2e-4, 1e-12, "no warm-up step 0");
    near(bt_schedule_lr(&s0, 25), 1e-4, 1e-12, "min ratio 0 midpoint");
    /* a 1-step run does not divide by zero */
    bt_schedule s1 = {BT_SCHED_COSINE, 2e-4, 0.1, 0, 1};
    near(bt_schedule_lr(&s1, 0), 2e-4, 1e-12, "single step");
    bt_schedule s2 = {BT_SCHED_COSINE, 2e-4, 0.1, 3, 3};
    near(bt_schedule_lr(&s2, 2), 2e-4, 1e-12, "warm-up == total");
}

static void test_linear_constant(void **st) {
    (void)st;
    bt_schedule l = {BT_SCHED_LINEAR, 1e-3, 0.1, 0, 10};
    near(bt_schedule_lr(&l, 0), 1e-3, 1e-12, "linear start");
    near(bt_schedule_lr(&l, 5), 1e-4 + 9e-4 * 0.5, 1e-12, "linear midpoint");
    near(bt_schedule_lr(&l, 10), 1e-4, 1e-12, "linear end");
    bt_schedule c = {BT_SCHED_CONSTANT, 3e-4, 0.1, 4, 10};
    near(bt_schedule_lr(&c, 1), 1.5e-4, 1e-12, "constant warm-up");
    near(bt_schedule_lr(&c, 4), 3e-4, 1e-12, "constant");
    near(bt_schedule_lr(&c, 9), 3e-4, 1e-12, "constant end");
}

static void test_clip(void **st) {
    (void)st;
    float g[5] = {3, 0, 4, 0, 0};
    double n = bt_clip_grad_norm(g, 5, 1.0);
    near(n, 5.0, 1e-12, "pre-clip norm");
    near(g[0], 0.6, 1e-5, "clipped g0");
    near(g[2], 0.8, 1e-5, "clipped g2");
    near(sqrt((double)g[0] * g[0] + (double)g[2] * g[2]), 1.0, 1e-5, "norm after clip");
    /* below the threshold: untouched */
    float h[2] = {0.3f, 0.4f};
    n = bt_clip_grad_norm(h, 2, 1.0);
    near(n, 0.5, 1e-6, "norm");
    assert_true(h[0] == 0.3f && h[1] == 0.4f);
    /* max_norm 0 disables */
    float k[2] = {30, 40};
    n = bt_clip_grad_norm(k, 2, 0.0);
    near(n, 50.0, 1e-12, "norm unclipped");
    assert_true(k[0] == 30 && k[1] == 40);
    /* non-finite: reported, grads untouched */
    float q[3] = {1, NAN, 2};
    n = bt_clip_grad_norm(q, 3, 1.0);
    assert_true(isnan(n));
    assert_true(q[0] == 1 && q[2] == 2);
    /* large vector: double accumulation */
    static float big[1 << 16];
    for (int i = 0; i < (1 << 16); i++) big[i] = (i & 1) ? -0.5f : 0.5f;
    n = bt_clip_grad_norm(big, 1 << 16, 64.0);
    near(n, 128.0, 1e-9, "big norm");
    near(big[0], 0.25, 1e-5, "big clipped");
}

static void test_duration(void **st) {
    (void)st;
    char b[24];
    bt_fmt_duration(b, sizeof b, 62.2);
    assert_string_equal(b, "1m02s");
    bt_fmt_duration(b, sizeof b, 250);
    assert_string_equal(b, "4m10s");
    bt_fmt_duration(b, sizeof b, 3723);
    assert_string_equal(b, "1h02m03s");
    bt_fmt_duration(b, sizeof b, 0.2);
    assert_string_equal(b, "0m00s");
    bt_fmt_duration(b, sizeof b, NAN);
    assert_string_equal(b, "0m00s");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cosine_warmup),
        cmocka_unit_test(test_linear_constant),
        cmocka_unit_test(test_clip),
        cmocka_unit_test(test_duration),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
