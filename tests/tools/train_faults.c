/* train_faults: `trainer train` with a fault injected through the run's test hooks
 * (trainer/loop/train.h bt_run_hooks), for the process-level tests of what the trainer does when
 * a run goes wrong (tests/py/test_trainer_hardening.py). Test-only: the trainer itself reads no
 * fault from its environment.
 *
 *   train_faults --nonfinite-grad-at-step K --config JOB [--set key.path=value ...]
 *
 * Runs the job as `trainer train --config JOB` does (same config loading, progress on stdout,
 * "trainer: <error>" on stderr, the exit statuses of trainer/loop/train.h), except that after the
 * backward passes of optimiser step K the first LoRA gradient is made NaN, as an overflow would
 * (device "cpu" only: a GPU run keeps its gradients on the device, so it is refused here).
 * Exit 2 on a usage or configuration error. */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "common/bt_common.h"
#include "trainer/config.h"
#include "trainer/loop/train.h"

static void poison_first_grad(void *arg, int step, bt_lora *lo) {
    if (step == *(const int *)arg && lo->n_params > 0) lo->grads[0] = NAN;
}

static int usage(void) {
    fprintf(stderr, "usage: train_faults --nonfinite-grad-at-step K --config JOB [--set key=value ...]\n");
    return 2;
}

int main(int argc, char **argv) {
    bt_openblas_env_reexec(argv);
    static const struct option opts[] = {{"nonfinite-grad-at-step", required_argument, NULL, 'k'},
                                         {"config", required_argument, NULL, 'c'},
                                         {"set", required_argument, NULL, 's'},
                                         {NULL, 0, NULL, 0}};
    const char *config = NULL;
    const char **sets = calloc((size_t)argc, sizeof *sets);
    int n_sets = 0, at_step = 0, o;
    if (!sets) return 1;
    while ((o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        if (o == 'k') at_step = atoi(optarg);
        else if (o == 'c') config = optarg;
        else if (o == 's') sets[n_sets++] = optarg;
        else return usage();
    }
    if (!config || at_step < 1 || optind != argc) return usage();
    bt_train_config cfg;
    if (bt_config_load(&cfg, config, sets, n_sets)) {
        fprintf(stderr, "trainer: %s\n", bt_last_error());
        free(sets);
        return 2;
    }
    free(sets);
    if (cfg.device != BT_DEVICE_CPU) {
        fprintf(stderr, "train_faults: device \"cpu\" only (the hook poisons host gradients)\n");
        bt_config_free(&cfg);
        return 2;
    }
    const bt_run_hooks hooks = {poison_first_grad, &at_step};
    int rc = bt_train_run_ex(&cfg, 0, stdout, &hooks);
    if (rc) fprintf(stderr, "trainer: %s\n", bt_last_error());
    bt_config_free(&cfg);
    return rc == BT_ERR_CANCELLED ? BT_EXIT_INTERRUPTED
           : rc == BT_ERR_DIVERGED ? BT_EXIT_DIVERGED
           : rc                    ? BT_EXIT_FAILURE
                                   : BT_EXIT_OK;
}
