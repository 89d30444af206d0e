/* One training run's state, and what the files of the run share: trainer/loop/train.c (the run
 * and its stages), trainer/loop/eval.c (held-out evaluation), trainer/loop/batches.c (the batch
 * stream from loaderd) and trainer/loop/run.c (stop requests and the collectives the stages
 * agree through). Not a public contract (that is train.h).
 *
 * Everything a run knows lives in its bt_run, which bt_train_run owns and passes down: its place
 * among the ranks, its id for loaderd, the watchdog, the backend, the model and LoRA, the stream.
 * The process holds one global only: the stop flag a signal handler sets (bt_run_stop_sig).
 * Calls run one way: train.c -> eval.c -> batches.c -> run.c, never back. */
#ifndef BT_TRAINER_LOOP_RUN_H
#define BT_TRAINER_LOOP_RUN_H

#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>

#include "proto/batch.h"
#include "proto/client.h"
#include "trainer/backend/backend.h"
#include "trainer/backend/profile.h"
#include "trainer/config.h"
#include "trainer/parallel/dist.h"
#include "trainer/parallel/dist_monitor.h"
#include "trainer/loop/optim.h"
#include "trainer/loop/pref_step.h"
#include "trainer/loop/run_types.h"
#include "trainer/model/lora.h"
#include "trainer/model/model.h"
#include "trainer/report/report.h"

/* A trainer-owned copy of one micro-batch (the ring slot is released right away): int32 arrays
 * of B*T elements (cu: up to B*T + 1), heap-owned by the copy (bt_mb_alloc / bt_mb_free). */
typedef struct {
    int32_t *ids, *labels, *pos, *cu;
    int32_t *seg_kind, *seg_pair; /* layout 2: n_cu - 1 used (BT_SEG_*, record index or -1) */
    int32_t *seg_src, *seg_line, *seg_ref_ok; /* layout 3: n_cu - 1 used (proto/batch.h) */
    double *seg_ref_logp;                     /* layout 3: the cached reference value when ok */
    int n_cu;
    uint32_t n_real;
    uint8_t resume[BT_RESUME_STATE_BYTES]; /* loader state after this batch */
} bt_mb_copy;

/* How a run that stopped early ends (a stage returns an error code and sets `end`). */
typedef enum {
    RUN_END_DONE,         /* rc is final: tear down */
    RUN_END_STOP_OR_FAIL, /* rc from a wait, a layer or a collective: a stop request, or a failure */
    RUN_END_FAILED,       /* the batch stream failed after some steps: keep them */
} bt_run_end;

/* One run (bt_train_run): its stages' shared state, from the rendezvous to the teardown. */
typedef struct {
    const bt_train_config *cfg;
    const bt_run_hooks *hooks; /* test fault injection (train.h); NULL in production */
    int eval_only;
    FILE *out;
    bt_run_end end;
    /* this process among the ranks: rank / world / local rank (trainer/parallel/dist.h; rank 0 of 1
     * by default), the run's name for loaderd (the attach's "run": 16 hex digits, the same on
     * every rank), the watchdog that names a rank that dies or stalls and relays stop requests
     * (world > 1; else NULL), and the id rank 0 handed every rank at the rendezvous */
    bt_dist_env dist;
    char id[17];
    bt_dist_monitor *mon;
    uint8_t dist_id[BT_BACKEND_DIST_ID_BYTES];
    /* the model and the LoRA weights (fresh, an adapter to evaluate, or a checkpoint to resume) */
    int have_model; /* model and lora to free (bt_model_load succeeded) */
    bt_model model;
    bt_lora lora;
    bt_base_info binfo;
    int B, T, M, s2_group;
    /* the backend of cfg->device (trainer/backend/backend.h): its registry entry, and the backend
     * itself from stage 4 on */
    const bt_backend_reg *reg;
    bt_backend *be;
    /* resume: parameters, AdamW moments, step and the loader position */
    int has_resume;
    uint8_t resume[BT_RESUME_STATE_BYTES];
    int resume_world; /* resume is rank 0's state of a checkpoint of this many ranks (0: this run's own) */
    int start_step, done_steps;
    int at_mb; /* the micro-batch of the step in progress (for the stop message) */
    /* held-out evaluation: before and after training */
    int by_len, eval_cut;
    double before, after;
    long long n_eval;
    bt_eval_length len_before[BT_MAX_EVAL_LENGTHS], len_after[BT_MAX_EVAL_LENGTHS];
    /* training */
    bt_report *rep; /* the run report (trainer/report/report.h; rank 0 of `trainer train`) */
    int rep_steps;  /* steps it recorded */
    bt_prof *prof;  /* --profile: the profiled step's per-op times */
    bt_client *cl;
    bt_mb_copy *mbs;              /* grad_accum micro-batch copies */
    uint8_t *all_done, *all_next; /* every rank's loader state after the last / this step */
    bt_schedule sched;
    double train_t0, train_cpu0, last_loss; /* bt_now / bt_cpu_s at the first step */
    int end_step;     /* steps, or stop_at_step */
    int ck_step;      /* the step of the last checkpoint written, -1: none */
    int adapter_step; /* the step of the last adapter written by this run (save_every), -1: none */
    int prof_step;
    /* a preference objective (cfg->pref_on; pref_run.c): the step's buffers, the step's counts over
     * all ranks, its KL estimate (KTO), its metrics and the last held-out ones */
    bt_pref_step *pref;
    bt_pref_counts pref_global;
    double pref_kl;
    bt_pref_metrics pref_m, pref_eval_m, pref_before;
    /* preference.precompute_ref_log_probs (DPO / KTO): the base's identity sent as the job's
     * ref_base (bt_model_ref_id; "" when off), the values computed since the last put (rank-local,
     * handed to loaderd with bt_client_ref_put at the end of each step / evaluation batch), and
     * the counters: reference values taken from loaderd's cache / computed, this step and in the
     * run, values loaderd accepted / refused, puts that failed */
    char ref_base[48];
    bt_ref_value *ref_pend;
    size_t ref_n, ref_cap;
    long long ref_hit_step, ref_miss_step, ref_hit, ref_miss, ref_eval_hit, ref_eval_miss;
    long long ref_acc, ref_rej, ref_put_fail, ref_skipped_mb;
} bt_run;

/* ---- run.c: stop requests, signals, and the collectives every rank takes part in ---- */

/* The signal that asked this process to stop (SIGINT, SIGTERM, SIGUSR1: Slurm's early warning
 * before a time limit); 0 = none. The process's one global: written by the signal handler, read
 * by the run (bt_run_stop_check) and by the watchdog, which relays it to the other ranks. */
extern atomic_int bt_run_stop_sig;

/* The dispositions bt_run_catch_signals replaced. */
typedef struct {
    struct sigaction old[3];
} bt_run_signals;
/* Clear bt_run_stop_sig and make SIGINT, SIGTERM and SIGUSR1 set it (saving the old handlers in
 * *saved); bt_run_restore_signals puts them back. */
void bt_run_catch_signals(bt_run_signals *saved);
void bt_run_restore_signals(const bt_run_signals *saved);

/* 0 to go on; else why to stop now, with bt_last_error set: BT_ERR_CANCELLED for a stop request
 * (a signal to this process, or one relayed from another rank), another code when another rank
 * failed (trainer/parallel/dist_monitor.h names it). arg is the bt_run (the hook signature of
 * bt_backend_params.check): asked while waiting for batches, before every layer and in every
 * collective wait, so a stop lands mid-step. */
int bt_run_stop_check(void *arg);

/* The stop request that cut a wait or an evaluation short, as an error: bt_run_stop_check's
 * code and message (BT_ERR_CANCELLED, or another rank's failure), else BT_ERR_CANCELLED
 * "interrupted" (the request was seen earlier and nothing is pending now). Never 0. */
int bt_run_stop_error(bt_run *r);

/* The watchdog's view of collective waits (bt_backend_params.collective; arg is the bt_run). */
void bt_run_on_collective(void *arg, int entering);

/* vals[0..n) <- their sum over all ranks (a no-op for one process). Every rank must call it at
 * the same point (a collective of the backend). Returns 0 or the collective's error. */
int bt_run_dist_sum(bt_run *r, double *vals, int n);

/* all[rank * BT_RESUME_STATE_BYTES ..) <- every rank's loader state `mine` (collective, like
 * bt_run_dist_sum; one process: a copy). */
int bt_run_gather_resume(bt_run *r, const uint8_t *mine, uint8_t *all);

/* After a step that only rank 0 performed (a save): every rank learns whether it failed, so all
 * of them stop together instead of the others waiting forever in the next collective. Returns
 * rc, or a failure on another rank (BT_ERR_IO naming `what`), or the collective's error. */
int bt_run_agree(bt_run *r, int rc, const char *what);

/* The dropout key of micro-batch i of optimiser step `step` (0-based) on this rank: a hash of the
 * seed, the step and i, and of the rank (the ranks' rows are different rows). */
uint64_t bt_run_drop_key(const bt_run *r, int step, int i);

/* ---- batches.c: the batch stream from loaderd ---- */

/* *mb <- a view of c's arrays as a B x T micro-batch (no copy; valid while c is); the preference
 * step's view adds c->seg_kind / seg_pair (trainer/loop/pref_step.h bt_pref_batch). */
void bt_mb_view(const bt_mb_copy *c, int B, int T, bt_microbatch *mb);
/* Allocates c's arrays for B x T tokens. BT_ERR_NOMEM (call bt_mb_free either way). */
int bt_mb_alloc(bt_mb_copy *c, int B, int T);
/* Frees c's arrays and zeroes it; safe on a zeroed copy. */
void bt_mb_free(bt_mb_copy *c);

/* Attaches cfg's job to loaderd (the train stream, or with eval != 0 the held-out one) as rank
 * r->dist.rank of r->dist.world under the run's id, resumed after `resume`
 * (BT_RESUME_STATE_BYTES; NULL: from the start; the train stream with r->resume_world set: rank 0's
 * state of a run of that many ranks, bt_client_attach_from). Checks that loaderd serves micro_batch_size x
 * seq_len batches. *cl is owned by the caller (bt_client_close). Errors name the socket and the
 * stream. */
int bt_run_attach(bt_run *r, bt_client **cl, const bt_train_config *cfg, int eval,
                  const uint8_t *resume);

/* The next batch of cl copied into *dst (seg_kind / seg_pair too, checked again: kinds in range,
 * plain segments with record -1, each chosen segment directly followed by its rejected one in the
 * same row, records numbered 0, 1, ... in order; a malformed batch is BT_ERR_FORMAT). 0: a batch; 1: end of data; 2: a stop request while
 * waiting (nothing taken); < 0: error (another rank's failure included, or no batch within
 * cfg->timeout_s). The wait is cut into 1 s slices so that a signal stops it promptly. `what`
 * ("train", "eval") names the stream in messages. */
int bt_run_next_batch(bt_run *r, bt_client *cl, const bt_train_config *cfg, bt_mb_copy *dst,
                      const char *what);

/* ---- pref_run.c: a preference objective's step and evaluation (trainer/loop/pref_step.h) ---- */

/* *pb <- c as a preference micro-batch (tokens, seg_kind / seg_pair, and layout 3's cached
 * reference log-probs seg_ref_logp where seg_ref_ok: all 0 unless the job has ref_base). */
void bt_pref_view(const bt_mb_copy *c, int B, int T, bt_pref_batch *pb);
/* bt_pref_step_count of c: checks its records against the objective, adds their counts. */
int bt_pref_run_count(bt_run *r, const bt_mb_copy *c, bt_pref_counts *add);
/* Forward + backward of the step's grad_accum micro-batches r->mbs (after step_gather set
 * r->pref_global): KTO's KL estimate first (all ranks), then bt_pref_step_micro on each; the LoRA
 * gradients are those of the step's loss (the mean over its records on every rank, each rank
 * holding its share until the gradients are summed). Errors: the backend's, a collective's. */
int bt_pref_run_backward(bt_run *r, int step);
/* Hands the reference values computed since the last call to loaderd (bt_client_ref_put on cl, the
 * stream they came from) and counts the answer: a failed put or refused values are warnings with
 * counts (r->ref_rej, r->ref_put_fail), never an error: values are a cache. No-op without values. */
void bt_pref_run_ref_flush(bt_run *r, bt_client *cl, const char *what);
/* The loss and TRL's metrics of the records since the last bt_pref_step_begin, over all ranks
 * (collective); *records (may be NULL) = their number. */
int bt_pref_run_metrics(bt_run *r, double kl_mean, bt_pref_metrics *m, double *records);
/* Held-out evaluation of a preference objective: the eval stream's records scored without
 * gradient, the loss and metrics over all of them and all ranks (KTO: with the eval set's KL
 * estimate). *n_records = pairs or examples; a stop request cuts it short (*interrupted). */
int bt_pref_run_eval(bt_run *r, bt_pref_metrics *m, long long *n_records, int *interrupted);
/* The progress line's short form of the metrics ("| acc 0.62 | margin 0.0310"). */
void bt_pref_short(char *buf, size_t n, const bt_train_config *cfg, const bt_pref_metrics *m);

/* ---- eval.c: held-out evaluation ---- */

/* Held-out evaluation on the run's backend: attach a job for the run's eval stream (epochs 1),
 * run the forward (no dropout) over every batch until END_OF_DATA or eval.max_batches, and
 * return the mean loss per labelled target in *mean_loss and their count in *n_tokens. A stop
 * request cuts it short: *interrupted (when not NULL) is then 1 and the loss covers only the
 * batches seen (NAN, 0 tokens and no error when there were none). Collective across ranks (each
 * evaluates its share of the stream; the sums are added up). */
int bt_eval_heldout(bt_run *r, double *mean_loss, long long *n_tokens, int *interrupted);

/* Held-out perplexity per context length (cfg->eval.lengths): for each length L, the held-out
 * stream again at row length L (loaderd cuts `text` documents into consecutive L-token windows,
 * `chat`/`alpaca` ones to their first L tokens), loss over the windows of exactly L tokens only
 * (shorter remainders carry no loss), full attention. Rows per micro-batch: r->M / L (the
 * workspace holds r->M tokens), or one row in a workspace of its own when L > r->M
 * (bt_backend_eval_workspace: the CPU makes one, the GPU refuses with BT_ERR_INVALID).
 * res [cfg->eval.n_lengths]: length, windows, labelled tokens and mean loss (NAN when no window
 * had L tokens). Collective across ranks like bt_eval_heldout. */
int bt_eval_lengths(bt_run *r, bt_eval_length *res, int *interrupted);

/* The "held-out perplexity at L tokens: ..." lines of a per-length evaluation on out: a alone,
 * or before (a) -> after (b); n lengths. */
void bt_eval_print_lengths(FILE *out, const bt_eval_length *a, const bt_eval_length *b, int n);

#endif
