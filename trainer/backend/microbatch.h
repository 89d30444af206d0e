/* The packed micro-batch every backend consumes (the CPU step, trainer/loop/step.h, and the GPU
 * trainer, trainer/cuda/cuda_trainer.h), and the target shift they share. It sits below both
 * backends and below the run (trainer/loop/train.c) that feeds them.
 *
 * Layout: the batch contract of proto/batch.h (B rows of T tokens; labels unshifted, -100 = no
 * loss; position_ids restart at 0 for each packed document; cu_seqlens the document boundaries,
 * so attention never crosses documents). */
#ifndef BT_TRAINER_BACKEND_MICROBATCH_H
#define BT_TRAINER_BACKEND_MICROBATCH_H
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A packed micro-batch (borrowed arrays, proto/batch.h conventions). */
typedef struct {
    int B, T;                    /* M = B * T tokens */
    const int32_t *input_ids;    /* [M] in [0, vocab) */
    const int32_t *labels;       /* [M] unshifted, -100 = no loss */
    const int32_t *position_ids; /* [M] >= 0 */
    const int32_t *cu_seqlens;   /* [n_cu], 0 .. M strictly increasing, every row start present */
    int n_cu;
} bt_microbatch;

/* Check the micro-batch against a vocabulary of `vocab` tokens (1 <= B, T and B*T <= 2^26;
 * input_ids in [0, vocab); labels in [0, vocab) or -100; position_ids >= 0; cu_seqlens from 0 to
 * M, strictly increasing, holding every row start) and write the shifted targets into
 * targets[M] (int32, caller-owned; may be NULL to only count): target[t] = labels[t+1] when t+1
 * is in the same row and the same cu_seqlens segment, else -100 (HF's shift of unshifted labels,
 * within each packed document). Returns the number of labelled targets (>= 0), or
 * BT_ERR_INVALID / BT_ERR_RANGE with a message naming the bad entry. The workspace bound
 * (M <= the backend's max_M) is the backend's own check. */
int bt_shift_targets(int32_t *targets, const bt_microbatch *mb, int vocab);

#ifdef __cplusplus
}
#endif
#endif
