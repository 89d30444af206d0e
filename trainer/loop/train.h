/* The training run: loaderd batches -> forward/backward -> clip -> AdamW on the backend of the
 * config's device (trainer/backend/backend.h: CPU or CUDA) -> progress, reports, adapter
 * checkpoints, held-out evaluation before and after. */
#ifndef BT_TRAINER_TRAIN_H
#define BT_TRAINER_TRAIN_H
#include <stdio.h>

#include "trainer/config.h"
#include "trainer/loop/run_types.h"
#include "trainer/model/lora.h"

/* The trainer's exit statuses (trainer/main.c), in one table so that every way of stopping keeps
 * its own number; scripts/train.sbatch and the README rely on them:
 *   0   done: `steps` (or stop_at_step) completed, adapter saved
 *   1   failure (the message on stderr says why; completed steps are saved when possible)
 *   2   usage or configuration error (the message names the argument or key)
 *   3   training diverged: a non-finite loss, gradient norm or parameter; nothing of the diverged
 *       steps was saved, out_dir and checkpoint_dir keep the last good adapter and checkpoint;
 *       also a held-out loss (`trainer eval`, the evaluations of `train`) or logits (`trainer
 *       generate`) that are not finite: the model or adapter overflows fp32
 *   75  interrupted: SIGINT, SIGTERM or SIGUSR1 (Slurm's warning before a time limit) on any
 *       rank; stopped mid-step, the adapter and checkpoint of the last completed step are saved:
 *       continue with --resume CHECKPOINT_DIR (sysexits.h EX_TEMPFAIL: "try again later")
 *   76..79  reserved for other deliberate stops of a run. */
enum { BT_EXIT_OK = 0, BT_EXIT_FAILURE = 1, BT_EXIT_USAGE = 2, BT_EXIT_DIVERGED = 3, BT_EXIT_INTERRUPTED = 75 };

/* Run a job. eval_only = 0: `trainer train` (eval before if eval.shards, train cfg->steps steps,
 * save the adapter every save_every steps and at the end, eval after, summary); eval_only = 1:
 * `trainer eval` (held-out loss of the base model only). Progress lines and the summary go to
 * `out` (stdout in the CLI), diagnostics to stderr via bt_log:
 *   step 12/60 | loss 2.3141 | lr 1.95e-04 | 1843 tok/s | elapsed 1m02s | eta 4m10s
 *   held-out loss: before 2.9134 -> after 2.4512 (-15.9%)
 *   adapter: runs/demo/adapter
 * loss = the step's mean loss per labelled target over its grad_accum micro-batches; tok/s = real
 * (non-padding) tokens of the step / its wall time. SIGINT, SIGTERM and SIGUSR1 stop mid-step,
 * whatever the step's length: the wait for a batch is sliced (~1 s), every layer of the forward
 * and backward asks (bt_backend_params.check), and so does every NCCL wait; the
 * step in progress is dropped and rank 0 saves the adapter and a checkpoint (to checkpoint_dir,
 * whatever checkpoint_every; not when it equals out_dir) of the last completed step, without any
 * collective. With several ranks a signal on one stops all of them (trainer/parallel/dist_monitor.h
 * relays it), and another rank that dies or stalls ends the run naming it. Returns
 * BT_ERR_CANCELLED then, with the message saying what was saved where. When the batch stream
 * fails after some steps (loaderd gone, timeout) the adapter and checkpoint of the last completed
 * step are saved too, the error message says so, and the error is returned. Returns 0 or a
 * negative bt_err with bt_last_error() set. A device this trainer was built without is
 * BT_ERR_UNSUPPORTED (bt_backend_get). */
int bt_train_run(const bt_train_config *cfg, int eval_only, FILE *out);

/* bt_train_run with hooks (NULL: none; borrowed for the call). */
int bt_train_run_ex(const bt_train_config *cfg, int eval_only, FILE *out, const bt_run_hooks *hooks);


/* "1m02s" / "1h02m03s" for a duration in seconds (buf >= 24 bytes). */
void bt_fmt_duration(char *buf, size_t n, double seconds);

/* Peak resident set size of this process in MiB (getrusage ru_maxrss). */
double bt_peak_rss_mib(void);

#endif
