/* Internal to the training run: what trainer/loop/train.c (the run and its stages),
 * trainer/loop/eval.c (held-out evaluation) and trainer/loop/batches.c (the batch stream from
 * loaderd) share. Not a public contract (that is train.h): the process-wide state of the one run
 * a trainer process makes at a time, owned by train.c and valid during bt_train_run.
 *
 * train.c and eval.c are compiled twice, for the CPU and with -DBT_WITH_CUDA (device "cuda"):
 * the CUDA trainer binary links both of its own objects (Makefile: CUDA_TRAINER_MAIN). */
#ifndef BT_TRAINER_LOOP_RUN_INTERNAL_H
#define BT_TRAINER_LOOP_RUN_INTERNAL_H

#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>

#include "proto/batch.h"
#include "proto/client.h"
#include "trainer/config.h"
#include "trainer/dist/dist.h"
#include "trainer/loop/step.h"
#include "trainer/loop/train.h"
#ifdef BT_WITH_CUDA
#include "trainer/cuda/cuda_trainer.h"
/* device "cuda" (make CUDA=1): the GPU trainer that replaces the CPU step context; NULL on the
 * CPU. Owned by train.c (created in its backend stage, freed at teardown). */
extern bt_cuda_trainer *bt_run_cuda;
#endif

/* This process's place in a data-parallel run (trainer/dist/dist.h; rank 0 of 1 by default). */
extern bt_dist_env bt_run_dist;
/* The run's name for loaderd (the attach's "run"): 16 hex digits + NUL, the same on every rank. */
extern char bt_run_id[17];
/* The signal that asked this process to stop (SIGINT, SIGTERM, SIGUSR1); 0 = none. Written by
 * the signal handler, read anywhere. */
extern atomic_int bt_run_stop_sig;

/* 0 to go on; else why to stop now, with bt_last_error set: BT_ERR_CANCELLED for a stop request
 * (a signal to this process, or one relayed from another rank), another code when another rank
 * failed (trainer/dist/dist_monitor.h names it). arg is unused (the hook signature of
 * bt_step_ctx_set_check and bt_cuda_hooks). */
int bt_run_stop_check(void *arg);

/* The stop request that cut a wait or an evaluation short, as an error: bt_run_stop_check's
 * code and message (BT_ERR_CANCELLED, or another rank's failure), else BT_ERR_CANCELLED
 * "interrupted" (the request was seen earlier and nothing is pending now). Never 0. */
int bt_run_stop_error(void);

/* vals[0..n) <- their sum over all ranks (a no-op for one process). Every rank must call it at
 * the same point (an NCCL collective on device "cuda"). Returns 0 or the collective's error. */
int bt_run_dist_sum(double *vals, int n);

/* A trainer-owned copy of one micro-batch (the ring slot is released right away): int32 arrays
 * of B*T elements (cu: up to B*T + 1), heap-owned by the copy (bt_mb_alloc / bt_mb_free). */
typedef struct {
    int32_t *ids, *labels, *pos, *cu;
    int n_cu;
    uint32_t n_real;
    uint8_t resume[BT_RESUME_STATE_BYTES]; /* loader state after this batch */
} bt_mb_copy;

/* *mb <- a view of c's arrays as a B x T micro-batch (no copy; valid while c is). */
void bt_mb_view(const bt_mb_copy *c, int B, int T, bt_microbatch *mb);
/* Allocates c's arrays for B x T tokens. BT_ERR_NOMEM (call bt_mb_free either way). */
int bt_mb_alloc(bt_mb_copy *c, int B, int T);
/* Frees c's arrays and zeroes it; safe on a zeroed copy. */
void bt_mb_free(bt_mb_copy *c);

/* Attaches cfg's job to loaderd (the train stream, or with eval != 0 the held-out one) as rank
 * bt_run_dist.rank of world, resumed after `resume` (BT_RESUME_STATE_BYTES; NULL: from the
 * start). Checks that loaderd serves micro_batch_size x seq_len batches. *cl is owned by the
 * caller (bt_client_close). Errors name the socket and the stream. */
int bt_run_attach(bt_client **cl, const bt_train_config *cfg, int eval, const uint8_t *resume);

/* The next batch of cl copied into *dst. 0: a batch; 1: end of data; 2: a stop request while
 * waiting (nothing taken); < 0: error (another rank's failure included, or no batch within
 * cfg->timeout_s). The wait is cut into 1 s slices so that a signal stops it promptly. `what`
 * ("train", "eval") names the stream in messages. */
int bt_run_next_batch(bt_client *cl, const bt_train_config *cfg, bt_mb_copy *dst, const char *what);

/* The "held-out perplexity at L tokens: ..." lines of a per-length evaluation on out: a alone,
 * or before (a) -> after (b); n lengths. */
void bt_eval_print_lengths(FILE *out, const bt_eval_length *a, const bt_eval_length *b, int n);

#endif
