/* Per-op profile of one training step (`trainer train --profile`): wall time and the bytes each op
 * writes, accumulated by op name, printed as a table sorted by time and saved as JSON.
 *
 * CPU backend (trainer/loop/step.c): every kernel call of the forward and backward (embedding,
 * rmsnorm, <module> base / lora linears, rope, attention, swiglu, residual adds, lm_head +
 * cross-entropy) is timed with the monotonic clock around the call (the kernels are synchronous
 * OpenMP code, so that is the op's time); "bytes" = the size of the tensors the op writes.
 * GPU backend (trainer/cuda): the same op names timed with CUDA events recorded on the stream
 * around each launch (cudaEventElapsedTime after the step's synchronisation), so host-side
 * launch overhead is excluded and kernel time is what is measured. */
#ifndef BT_TRAINER_PROFILE_H
#define BT_TRAINER_PROFILE_H
#include <stddef.h>
#include <stdio.h>

typedef struct bt_prof bt_prof;

/* New empty profile (NULL on OOM). Free with bt_prof_free (NULL is a no-op). */
bt_prof *bt_prof_new(void);
void bt_prof_free(bt_prof *p);
/* Add one call of op `name` (copied; at most 63 bytes are kept) taking `seconds` and writing
 * `bytes`. Not thread-safe (one step runs its ops in order). */
void bt_prof_add(bt_prof *p, const char *name, double seconds, double bytes);
/* Sum of the recorded seconds. */
double bt_prof_total(const bt_prof *p);
/* The table: op, calls, total ms, % of the profiled ops, mean us per call, MiB written ("-" when
 * not recorded: the GPU table, whose footer gives the device memory instead); sorted
 * by total time; then the step's wall time, the ops' sum and the memory figures given
 * (workspace_mib: the step context's activation + workspace allocation; peak_rss_mib: the
 * process's peak resident set; device_mib < 0 = none). Returns fprintf's error (< 0) or 0. */
int bt_prof_print(const bt_prof *p, FILE *f, const char *title, double step_s,
                  double workspace_mib, double peak_rss_mib, double device_mib);
/* {"title", "step_s", "ops": [{"op", "calls", "seconds", "bytes"}...]} to path (BT_ERR_IO). */
int bt_prof_write_json(const bt_prof *p, const char *path, const char *title, double step_s);

#endif
