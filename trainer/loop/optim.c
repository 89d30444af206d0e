/* Learning-rate schedule and gradient clipping. See optim.h. */
#include "trainer/loop/optim.h"

#include <math.h>

#include "kernels/kernels.h"
#include "trainer/config.h"

double bt_schedule_lr(const bt_schedule *s, int64_t step) {
    if (step < 0) step = 0;
    if (s->warmup > 0 && step < s->warmup) return s->lr * (double)(step + 1) / (double)s->warmup;
    if (s->kind == BT_SCHED_CONSTANT) return s->lr;
    double min = s->lr * s->min_lr_ratio;
    int64_t span = (int64_t)s->total - s->warmup;
    double p = span > 0 ? (double)(step - s->warmup) / (double)span : 1.0;
    if (p > 1.0) p = 1.0;
    if (s->kind == BT_SCHED_LINEAR) return min + (s->lr - min) * (1.0 - p);
    return min + (s->lr - min) * 0.5 * (1.0 + cos(M_PI * p));
}

double bt_clip_grad_norm(float *g, int64_t n, double max_norm) {
    double total = sqrt(bt_sumsq(g, n));
    if (!isfinite(total)) return total;
    if (max_norm > 0 && total > max_norm) bt_scale(g, n, (float)(max_norm / (total + 1e-6)));
    return total;
}
