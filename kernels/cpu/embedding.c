/* Embedding backward (scatter-add of the output gradient into the table gradient), for a
 * trainable token embedding (LongLoRA "LoRA+", docs/algorithms.md §LongLoRA; the same
 * operation as torch.nn.functional.embedding's backward, dense, without padding_idx). */
#include "kernels/kernels.h"
#include "common/bt_common.h"

#include <stddef.h>
#include <stdint.h>

/* The first of ids[0..M) outside [0, vocab): BT_ERR_RANGE naming it (for `what`), else BT_OK. */
int bt_embedding_check_ids(const int32_t *ids, int M, int vocab, const char *what)
{
    for (int m = 0; m < M; m++)
        if (ids[m] < 0 || ids[m] >= vocab)
            return bt_fail(BT_ERR_RANGE, "embedding %s: input_ids[%d] = %d is outside the "
                           "vocabulary [0, %d)", what, m, ids[m], vocab);
    return BT_OK;
}

/* dtable [vocab, D] fp32 (accumulated into), dout [M, D] fp32, ids [M] int32. A token repeated in
 * the batch adds all its rows. An id outside [0, vocab) is refused before anything is written
 * (BT_ERR_RANGE). The D columns are split into blocks of 64 processed in parallel; inside a block the
 * tokens are added in order m = 0..M-1, so every element's sum order is fixed and the result is
 * bit-identical for any thread count. */
int bt_embedding_bwd(float *dtable, const float *dout, const int32_t *ids, int M, int D, int vocab)
{
    if (M < 0 || D <= 0 || vocab <= 0 || (M > 0 && (!dtable || !dout || !ids)))
        return bt_fail(BT_ERR_INVALID, "embedding backward: M %d, D %d, vocab %d%s", M, D, vocab,
                       M > 0 && (!dtable || !dout || !ids) ? ", a NULL pointer" : "");
    const int rc = bt_embedding_check_ids(ids, M, vocab, "backward");
    if (rc)
        return rc;
    const int nblk = (D + 63) / 64;
#pragma omp parallel for schedule(static) if ((int64_t)M * D >= 65536)
    for (int b = 0; b < nblk; b++) {
        const int d0 = b * 64, d1 = d0 + 64 < D ? d0 + 64 : D;
        for (int m = 0; m < M; m++) {
            const int32_t id = ids[m];
            float *dst = dtable + (size_t)id * D;
            const float *src = dout + (size_t)m * D;
#pragma omp simd
            for (int d = d0; d < d1; d++)
                dst[d] += src[d];
        }
    }
    return BT_OK;
}
