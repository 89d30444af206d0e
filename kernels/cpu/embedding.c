/* Embedding backward (scatter-add of the output gradient into the table gradient), for a
 * trainable token embedding (LongLoRA "LoRA+", docs/algorithms.md §LongLoRA; the same
 * operation as torch.nn.functional.embedding's backward, dense, without padding_idx). */
#include "kernels/kernels.h"

#include <stddef.h>
#include <stdint.h>

/* dtable [vocab, D] fp32 (accumulated into), dout [M, D] fp32, ids [M] int32. A token repeated in
 * the batch adds all its rows. Ids outside [0, vocab) are skipped (never read or written out of
 * bounds). The D columns are split into blocks of 64 processed in parallel; inside a block the
 * tokens are added in order m = 0..M-1, so every element's sum order is fixed and the result is
 * bit-identical for any thread count. */
void bt_embedding_bwd(float *dtable, const float *dout, const int32_t *ids, int M, int D, int vocab)
{
    if (M <= 0 || D <= 0 || vocab <= 0)
        return;
    const int nblk = (D + 63) / 64;
#pragma omp parallel for schedule(static) if ((int64_t)M * D >= 65536)
    for (int b = 0; b < nblk; b++) {
        const int d0 = b * 64, d1 = d0 + 64 < D ? d0 + 64 : D;
        for (int m = 0; m < M; m++) {
            const int32_t id = ids[m];
            if (id < 0 || id >= vocab)
                continue;
            float *dst = dtable + (size_t)id * D;
            const float *src = dout + (size_t)m * D;
#pragma omp simd
            for (int d = d0; d < d1; d++)
                dst[d] += src[d];
        }
    }
}
