/* Learning-rate schedule and gradient clipping for the trainer. */
#ifndef BT_TRAINER_OPTIM_H
#define BT_TRAINER_OPTIM_H
#include <stdint.h>

typedef struct {
    int kind;            /* BT_SCHED_* (trainer/config.h) */
    double lr;           /* peak learning rate */
    double min_lr_ratio; /* floor of the decay, as a fraction of lr, [0, 1] */
    int warmup;          /* warm-up steps (>= 0) */
    int total;           /* optimiser steps in the run (>= 1) */
} bt_schedule;

/* Learning rate for optimiser step `step` (0-based: the first update uses step 0).
 * Warm-up (llm.c llmc/schedulers.h): step < warmup -> lr * (step + 1) / warmup, so the first
 * update is not wasted at lr 0 (HF get_cosine_schedule_with_warmup would use 0).
 * Then with p = (step - warmup) / (total - warmup) in [0, 1) and min = lr * min_lr_ratio:
 *   cosine:   min + (lr - min) * 0.5 * (1 + cos(pi * p))
 *   linear:   min + (lr - min) * (1 - p)
 *   constant: lr
 * Steps beyond total return the value at p = 1 (min for cosine/linear). */
double bt_schedule_lr(const bt_schedule *s, int64_t step);

/* torch.nn.utils.clip_grad_norm_ semantics: total = ||g||_2 over all n entries (double
 * accumulation); when max_norm > 0 and total > max_norm, g *= max_norm / (total + 1e-6).
 * max_norm <= 0 disables clipping. Returns the pre-clip norm (inf/nan are returned as is and
 * then g is left untouched, so the caller can skip the step). */
double bt_clip_grad_norm(float *g, int64_t n, double max_norm);

#endif
