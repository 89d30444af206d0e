/* Q8_0 quantisation (ggml block_q8_0: fp16 d, 32 x int8 q; x = d * q). Bit-identical to ggml
 * ggml-quants.c quantize_row_q8_0_ref and gguf-py quants.py Q8_0.quantize_blocks:
 *   amax = max |x|, d = amax / 127, id = d ? 1 / d : 0, q = roundf(x * id)
 * (roundf: halves away from zero, as numpy's np_roundf in gguf-py). See export.h. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common/bt_common.h"
#include "common/quant.h"
#include "trainer/export.h"

int bt_q8_0_quantize(const float *x, void *dst, int64_t n) {
    if (!x || !dst || n < 0 || n % 32 != 0)
        return bt_fail(BT_ERR_INVALID, "q8_0: %lld elements is not a multiple of the block size 32",
                       (long long)n);
    uint8_t *o = dst;
    int64_t nb = n / 32;
    for (int64_t b = 0; b < nb; b++) {
        const float *v = x + b * 32;
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(v[j]));
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        uint16_t dh = bt_fp32_to_fp16(d);
        uint8_t *blk = o + b * 34;
        memcpy(blk, &dh, 2); /* little-endian host (x86-64/aarch64), as the GGUF reader assumes */
        for (int j = 0; j < 32; j++) {
            float q = roundf(v[j] * id);
            /* |x * id| <= 127 up to rounding; clamp guards against nan/inf input */
            if (!(q >= -128.0f)) q = q != q ? 0.0f : -128.0f;
            if (q > 127.0f) q = 127.0f;
            blk[2 + j] = (uint8_t)(int8_t)q;
        }
    }
    return 0;
}
