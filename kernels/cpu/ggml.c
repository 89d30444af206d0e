/* Frozen linears held in their GGUF file's own ggml blocks (kernels.h bt_ggml_mat): copy with a
 * row permutation, row dequantisation and the tiled dequantise + GEMM of the forward and
 * input-gradient matmuls (kernels/cpu/tiled_gemm.c, the NF4 path's driver). Every dequantised
 * value comes from common/quant.c bt_ggml_dequantize (bit-identical to gguf-py quants.dequantize,
 * tests/fixtures/quant), called on whole rows: a row of a ggml tensor is a whole number of
 * blocks (GGUF requires ne[0] % block_elems == 0), so a tile of rows never splits a block. */
#include "kernels/kernels.h"
#include "common/bt_common.h"
#include "common/gguf.h"
#include "common/quant.h"
#include "kernels/cpu/cpu_math.h"

#include <stdlib.h>
#include <string.h>

void bt_ggml_mat_free(bt_ggml_mat *w)
{
    if (!w)
        return;
    free(w->data);
    memset(w, 0, sizeof *w);
}

size_t bt_ggml_mat_bytes(const bt_ggml_mat *w)
{
    return w && w->data ? (size_t)w->rows * w->row_bytes : 0;
}

int bt_ggml_mat_init(bt_ggml_mat *w, int type, int64_t rows, int64_t cols, const void *src,
                     const int32_t *row_src)
{
    memset(w, 0, sizeof *w);
    if (!bt_ggml_can_dequantize(type))
        return bt_fail(BT_ERR_UNSUPPORTED, "ggml type %s (%d) has no decoder (supported: %s)",
                       bt_ggml_type_name(type), type, bt_ggml_decodable_types());
    const size_t row_bytes = bt_ggml_row_size(type, cols);
    if (!src || rows < 1 || cols < 1 || row_bytes == 0 || rows > INT32_MAX)
        return bt_fail(BT_ERR_INVALID, "ggml matrix: %lld x %lld %s: bad shape (cols must be a "
                       "multiple of %lld)", (long long)rows, (long long)cols,
                       bt_ggml_type_name(type), (long long)bt_ggml_block_elems(type));
    size_t total;
    if (__builtin_mul_overflow((size_t)rows, row_bytes, &total))
        return bt_fail(BT_ERR_INVALID, "ggml matrix: %lld rows x %zu bytes overflows",
                       (long long)rows, row_bytes);
    if (row_src)
        for (int64_t r = 0; r < rows; r++)
            if (row_src[r] < 0 || row_src[r] >= rows)
                return bt_fail(BT_ERR_INVALID, "ggml matrix: row permutation entry %lld = %d is "
                               "outside [0, %lld)", (long long)r, row_src[r], (long long)rows);
    uint8_t *d = bt_aligned_alloc(total ? total : 1);
    if (!d)
        return bt_fail(BT_ERR_NOMEM, "ggml matrix: out of memory for %zu bytes", total);
    const uint8_t *s = src;
    if (!row_src)
        memcpy(d, s, total);
    else
        for (int64_t r = 0; r < rows; r++)
            memcpy(d + (size_t)r * row_bytes, s + (size_t)row_src[r] * row_bytes, row_bytes);
    w->type = type;
    w->rows = rows;
    w->cols = cols;
    w->row_bytes = row_bytes;
    w->data = d;
    return BT_OK;
}

int bt_ggml_mat_dequantize_rows(const bt_ggml_mat *w, int64_t r0, int64_t nr, float *out)
{
    if (!w || !w->data || !out || r0 < 0 || nr < 0 || r0 + nr > w->rows)
        return bt_fail(BT_ERR_INVALID, "ggml: dequantize rows [%lld, %lld) of a %lld-row weight%s",
                       (long long)r0, (long long)(r0 + nr), w ? (long long)w->rows : 0LL,
                       w && w->data && out ? "" : " (NULL weight or output)");
    const int64_t cols = w->cols;
#pragma omp parallel for schedule(static) if (nr * cols >= 32768)
    for (int64_t r = 0; r < nr; r++)
        bt_ggml_dequantize(w->type, w->data + (size_t)(r0 + r) * w->row_bytes, out + r * cols, cols);
    return BT_OK;
}

/* bt_tile_dequant_fn: rows [n0, n0 + nt) of W into tile [nt, K] */
static void dequant_tile(const void *wp, int n0, int nt, int K, float *tile)
{
    const bt_ggml_mat *w = wp;
    for (int r = 0; r < nt; r++)
        bt_ggml_dequantize(w->type, w->data + (size_t)(n0 + r) * w->row_bytes,
                           tile + (size_t)r * K, K);
}

size_t bt_ggml_scratch_floats(int K)
{
    return bt_tiled_scratch_floats(K);
}

void bt_ggml_linear_fwd(float *Y, const float *X, const bt_ggml_mat *W, int M, int K, int N,
                        float beta, float *scratch)
{
    if (W->type == BT_GGML_F32) /* the blocks are the fp32 matrix (64-byte aligned copy) */
        bt_linear_fwd(Y, X, (const float *)(const void *)W->data, M, K, N, beta);
    else
        bt_tiled_linear_fwd(Y, X, W, dequant_tile, M, K, N, beta, scratch);
}

void bt_ggml_linear_bwd_x(float *dX, const float *dY, const bt_ggml_mat *W, int M, int K, int N,
                          float beta, float *scratch)
{
    if (W->type == BT_GGML_F32)
        bt_linear_bwd_x(dX, dY, (const float *)(const void *)W->data, M, K, N, beta);
    else
        bt_tiled_linear_bwd_x(dX, dY, W, dequant_tile, M, K, N, beta, scratch);
}
