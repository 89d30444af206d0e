/* The watchdog of a data-parallel run: after the rendezvous (trainer/parallel/dist.h) every rank keeps its
 * authenticated TCP connection (rank 0: one per rank) and a thread per process that heartbeats
 * over it, so that a rank that dies, is stopped (SIGSTOP), hangs, or loses its network is named
 * on every other rank within dist.heartbeat_timeout_s, and the NCCL waits (trainer/cuda/
 * cuda_trainer.h bt_cuda_hooks) end with that message instead of hanging. It also carries the
 * run's stop requests (a signal on any rank stops every rank mid-step) and each rank's last
 * word (an error, or goodbye). Plain C (pthreads, poll); no NCCL here.
 *
 * Wire (on the rendezvous' connections, little-endian): frames of an 8-byte header {u8 type,
 * u8 0, u8 0, u8 0, u32 len} and len <= 512 payload bytes:
 *   HB    (1) payload {u64 collectives entered, u32 1 while waiting in one}; every
 *             heartbeat_interval (heartbeat_timeout / 4, within [0.05, 1] s) both ways;
 *   STOP  (2) payload {u32 rank, u32 signal[, its name]}: that rank was asked to stop; rank 0
 *             relays it with the rank's name;
 *   ABORT (3) payload {u32 rank, text}: that rank failed (text: why); rank 0 relays it, with the
 *             rank's name, to every other rank;
 *   BYE   (4) no payload: the sender ends cleanly (its connection closing is then no failure).
 * Rank 0 sees every rank; the others see rank 0 and learn the rest from its relays. What is
 * reported (bt_dist_monitor_check), with each rank named "rank R (pid P on HOST)":
 *   - a connection that closes without BYE: "rank R (...) died: ..." (BT_ERR_CLOSED);
 *   - nothing received for heartbeat_timeout_s: "rank R (...) stopped responding ..."
 *     (BT_ERR_TIMEOUT);
 *   - rank 0 only, when collective_timeout_s > 0: a rank that has not entered a collective which
 *     another rank has waited in for collective_timeout_s: "rank R (...) has not reached
 *     collective #N ..." (BT_ERR_TIMEOUT);
 *   - an ABORT: "rank R (...) failed: TEXT" (BT_ERR_IO);
 *   - a STOP: "rank R (...) was interrupted (SIGTERM): every rank stops" (BT_ERR_CANCELLED).
 * The first failure wins; rank 0 relays it to every other rank. */
#ifndef BT_TRAINER_DIST_MONITOR_H
#define BT_TRAINER_DIST_MONITOR_H
#include <stdatomic.h>

#include "trainer/parallel/dist.h"

typedef struct bt_dist_monitor bt_dist_monitor;

typedef struct {
    double heartbeat_timeout_s;   /* > 0 (config dist.heartbeat_timeout_s) */
    double collective_timeout_s;  /* rank 0's straggler check (config dist.timeout_s); 0 = off */
    const atomic_int *local_stop; /* this process's stop request: the signal number, 0 = none
                                   * (may be NULL); once non-zero it is sent to every rank */
} bt_dist_monitor_opts;

/* Start watching `link` (from bt_dist_rendezvous; ownership moves to the monitor, also on error)
 * with a thread of its own. Errors: BT_ERR_INVALID (bad options), BT_ERR_IO (pipe / thread). */
int bt_dist_monitor_start(bt_dist_monitor **out, bt_dist_link *link, const bt_dist_monitor_opts *o);

/* 0 while all is well; else the first failure or stop seen (see above), with bt_last_error() set
 * on the calling thread. Cheap (an atomic load) when nothing happened: call it as often as
 * needed. */
int bt_dist_monitor_check(bt_dist_monitor *m);

/* Progress for rank 0's straggler check: entering = 1 when this rank starts waiting in a
 * collective (its count goes up), 0 when the wait ends. Any thread. */
void bt_dist_monitor_collective(bt_dist_monitor *m, int entering);

/* This rank failed with `why`: tell the others (ABORT, relayed by rank 0), waiting at most 2 s
 * for it to go out. Returns at once when the failure came from the monitor itself. */
void bt_dist_monitor_fail(bt_dist_monitor *m, const char *why);

/* A clean end: rank 0 says BYE to every rank (waiting at most 5 s for it to go out); another
 * rank says BYE and then waits until rank 0 says BYE too (so rank 0 finishes its saves before the
 * others exit: srun --kill-on-bad-exit ends a step when its first task exits non-zero), or until
 * the monitor reports rank 0 lost. Returns 0, or the failure that ended the wait. */
int bt_dist_monitor_finish(bt_dist_monitor *m);

/* Stop the thread, close the connections, free. NULL is a no-op. */
void bt_dist_monitor_free(bt_dist_monitor *m);

#endif
