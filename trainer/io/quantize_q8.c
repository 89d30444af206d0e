/* Q8_0 quantisation for the exports (ggml block_q8_0: fp16 d, 32 x int8 q; x = d * q):
 * common/quant_encode.c bt_ggml_quantize(BT_GGML_Q8_0), bit-identical to ggml-quants.c
 * quantize_row_q8_0_ref and gguf-py quants.py Q8_0.quantize_blocks. See export.h. */
#include <stdint.h>

#include "common/bt_common.h"
#include "common/gguf.h"
#include "common/quant.h"
#include "trainer/io/export.h"

int bt_q8_0_quantize(const float *x, void *dst, int64_t n) {
    if (!x || !dst || n < 0 || n % 32 != 0)
        return bt_fail(BT_ERR_INVALID, "q8_0: %lld elements is not a multiple of the block size 32",
                       (long long)n);
    return bt_ggml_quantize(BT_GGML_Q8_0, x, dst, n);
}
