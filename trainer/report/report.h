/* The run report: what a training run measured, as files people and tools read.
 *
 * In cfg->report.dir (config key report.dir; trainer/config.h):
 *   metrics.jsonl   one JSON object per line, appended and flushed as the run goes:
 *                     {"type": "train", "step": 12, "loss": 2.31, "lr": 0.0002,
 *                      "grad_norm": 0.93, "tokens": 8192, "tokens_per_s": 1843.2,
 *                      "step_s": 4.44, "data_wait_s": 0.002, "peak_rss_mib": 612.0,
 *                      ["device_mib": 1530.0,] "time": 1795000000.123}
 *                   a preference objective (config objective) adds TRL's metrics to train
 *                   lines: "rewards/chosen", "rewards/rejected", "rewards/accuracies",
 *                   "rewards/margins", "logps/chosen", "logps/rejected", and where the algorithm
 *                   logs them "nll_loss", "log_odds_ratio", "log_odds_chosen", "kl" (null when
 *                   TRL logs nothing: KTO's accuracies), then ours for paired algorithms:
 *                   "logps/accuracies" (share of pairs whose policy log-prob of chosen >
 *                   rejected) and "logps/margins" (mean policy chosen - rejected log-prob;
 *                   trainer/preference.h); its eval lines carry the same and
 *                   "records" instead of perplexity and tokens; TensorBoard train/<name> and
 *                   eval/<name>; report.png adds a panel of rewards/accuracies (train, held-out)
 *                     {"type": "eval", "step": 0, "loss": 2.91, "perplexity": 18.4,
 *                      "tokens": 5230, "time": ...}
 *                     {"type": "run", "step": 0, "name": "demo", "model": "models/x.gguf",
 *                      "base_dtype": "gguf", "time": ...}   (first line of each run: the
 *                      plot's title; a resumed run adds its own with step = its start step)
 *                   step = optimiser steps done (eval at step 0 = before training, and every
 *                   eval.every steps during training); loss = mean
 *                   per labelled target over the step's micro-batches (null when not finite);
 *                   lr = the learning rate the step used; grad_norm = global L2 norm of the LoRA
 *                   gradients before clipping; tokens = real (non-padding) tokens of the step over
 *                   all ranks, tokens_per_s = tokens / step_s (wall seconds of the whole step);
 *                   data_wait_s = seconds spent waiting for batches from loaderd in the step;
 *                   peak_rss_mib = peak resident set of the process (getrusage); device_mib =
 *                   the GPU trainer's device allocation (device "cuda" only). A fresh run
 *                   truncates the file; a resumed run keeps the lines up to its start step.
 *   report.png      loss (train and held-out), learning rate and throughput against step, drawn
 *                   by gnuplot (pngcairo) at the end of a run (report.plot, default true) and by
 *                   `trainer report RUN_DIR`.
 *   events.out.tfevents.<time>.<host>.<pid>.0   with report.tensorboard: the same scalars as
 *                   TensorBoard event files (trainer/report/tb_events.h), tags train/loss, train/lr,
 *                   train/grad_norm, train/tokens_per_s, train/data_wait_s, train/peak_rss_mib,
 *                   eval/loss, eval/perplexity.
 * Only rank 0 of a data-parallel run writes a report. */
#ifndef BT_TRAINER_REPORT_H
#define BT_TRAINER_REPORT_H
#include <stdint.h>

#include "trainer/config.h"

typedef struct bt_report bt_report;

/* One optimiser step's measurements (see the file format above; device_mib < 0 = none). */
typedef struct {
    int step;
    double loss, lr, grad_norm;
    long long tokens;
    double step_s, data_wait_s, peak_rss_mib, device_mib;
    const bt_pref_metrics *pref; /* a preference objective's metrics (TRL's names), NULL: none */
} bt_step_metrics;

/* Open the report of a run in cfg->report.dir (created, parents included): metrics.jsonl is
 * truncated (start_step 0) or cut back to the lines with step <= start_step (a resumed run); a
 * TensorBoard event file is started when cfg->report.tensorboard. *out owned by the caller
 * (bt_report_close). Errors: BT_ERR_IO naming the path, BT_ERR_NOMEM. */
int bt_report_open(bt_report **out, const bt_train_config *cfg, int start_step);
/* Append a step / a held-out evaluation (one line, flushed; and the event file). BT_ERR_IO. */
int bt_report_step(bt_report *r, const bt_step_metrics *m);
int bt_report_eval(bt_report *r, int step, double loss, long long tokens);
/* A preference objective's held-out evaluation: {"type": "eval", "step", "loss", "records" (pairs
 * or KTO examples), and TRL's metrics: "rewards/chosen", ..., null where the algorithm logs none};
 * TensorBoard eval/loss and eval/<metric>. */
int bt_report_eval_pref(bt_report *r, int step, const bt_pref_metrics *m, long long records);
/* Close the files; with plot != 0 draw report.png (bt_report_plot; a failure there is logged as
 * a warning, the metrics stay). NULL is a no-op. */
void bt_report_close(bt_report *r, int plot);

/* dir/metrics.jsonl -> dir/report.png (1200x900, titled with the run's name and model, three
 * panels against one shared step axis: train and held-out loss; learning rate; tokens/s), by running gnuplot with the pngcairo terminal on data files
 * written next to it (removed afterwards; the PNG replaces the old one atomically). Lines that
 * are not JSON objects of a known type are skipped and counted in the warning. *n_steps (may be
 * NULL) = train lines plotted. Errors: BT_ERR_IO (no metrics.jsonl, gnuplot missing: the message
 * says "apt-get install gnuplot-nox", gnuplot failed), BT_ERR_INVALID (no train line). */
int bt_report_plot(const char *dir, int *n_steps);

/* `trainer report RUN_DIR` (argv[0] = "report"): bt_report_plot and a one-line summary (steps,
 * first and last loss, held-out loss before and after, mean tokens/s). Exit status 0, 1 (plot
 * failed), 2 (usage). */
int bt_report_cli(int argc, char **argv);

#endif
