/* The two types the run (trainer/loop/run.h) and its callers (trainer/loop/train.h) share: the
 * test hooks a run is given and one length's held-out result. Kept on a floor of their own so
 * that run.h never includes train.h (no include circle in trainer/loop; tests/py/test_layering.py). */
#ifndef BT_TRAINER_LOOP_RUN_TYPES_H
#define BT_TRAINER_LOOP_RUN_TYPES_H
#include "trainer/model/lora.h"

/* Faults a test injects into a run (bt_train_run_ex), never read from the environment: the
 * divergence stop cannot be reached within a test's few steps on a tiny fp32 model (the
 * hyper-parameter ranges and RMSNorm see to that), so tests/tools/train_faults.c drives it this
 * way. Production runs pass none. */
typedef struct {
    /* After the backward passes of optimiser step `step` (1-based), before the gradients are
     * summed over ranks and clipped: lo->grads (n_params floats) is the host gradient buffer,
     * the live one of the CPU backend (a GPU backend's gradients are on the device). NULL: none. */
    void (*after_backward)(void *arg, int step, bt_lora *lo);
    void *arg;
} bt_run_hooks;

/* One length's result of the held-out perplexity per context length (cfg->eval.lengths;
 * trainer/loop/run.h bt_eval_lengths): the length L, the windows of exactly L tokens, their
 * labelled tokens and mean loss (NAN when no window had L tokens). */
typedef struct {
    int length;
    long long windows, tokens;
    double loss;
} bt_eval_length;

#endif
