/* NF4 (4-bit NormalFloat) quantisation with double quantisation of the block scales, bit-exact
 * with bitsandbytes quantize_4bit(quant_type="nf4", blocksize=64, compress_statistics=True), and
 * the dequantise / fused dequantise+GEMM paths used by the frozen QLoRA base weights.
 *
 * Sources (see docs/formats/nf4.md):
 *   - NF4 table: bitsandbytes/functional.py get_4bit_type("nf4") == csrc/kernels.cu
 *     nf4_dequantization_lut (Dettmers et al. 2023, "QLoRA", arXiv 2305.14314).
 *   - NF4 encoding: csrc/kernels.cu dQuantizeNF4 (decision tree on the midpoints, strict `>`) applied
 *     to x * (1.0f / absmax_block) as kQuantizeBlockwise does; high nibble = even element.
 *   - Nested (double) quantisation: functional.py quantize_4bit: offset = absmax.mean();
 *     quantize_blockwise(absmax - offset, code=create_dynamic_map(signed=True), blocksize=256),
 *     whose CUDA kernel (kQuantizeBlockwise<General8bit>) encodes with dQuantize<0>: a 7-step binary
 *     search over the sorted 256-value code followed by a nearest-of-neighbours decision.
 *   - Dynamic 8-bit map: functional.py create_dynamic_map (Dettmers 2015, arXiv 1511.04561), with
 *     torch.linspace evaluated as ATen's CPU linspace kernel does (RangeFactoriesKernel.cpp).
 * These functions are fp32 throughout and compiled in ISO C mode (-std=c17), where GCC does not
 * contract a*b+c into FMA; the one place an FMA is wanted (linspace) calls fmaf explicitly. */
#include "kernels/kernels.h"
#include "common/bt_common.h"
#include "kernels/cpu/cpu_math.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* bitsandbytes get_4bit_type("nf4"); float literals exactly as in csrc/kernels.cu. */
const float bt_nf4_code[16] = {
    -1.0f,
    -0.6961928009986877f,
    -0.5250730514526367f,
    -0.39491748809814453f,
    -0.28444138169288635f,
    -0.18477343022823334f,
    -0.09105003625154495f,
    0.0f,
    0.07958029955625534f,
    0.16093020141124725f,
    0.24611230194568634f,
    0.33791524171829224f,
    0.44070982933044434f,
    0.5626170039176941f,
    0.7229568362236023f,
    1.0f,
};

/* The 15 midpoints of csrc/kernels.cu dQuantizeNF4, sorted ascending. That function is a binary
 * decision tree over exactly these thresholds with `x > t` picking the upper branch, so its result
 * equals the number of thresholds t with x > t (NaN compares false everywhere and gives 0 in both). */
static const float nf4_thresholds[15] = {
    -0.8480964004993439f,  -0.6106329262256622f, -0.4599952697753906f, -0.33967943489551544f,
    -0.23460740596055984f, -0.13791173323988914f, -0.045525018125772476f, 0.03979014977812767f,
    0.1202552504837513f,   0.2035212516784668f,  0.2920137718319893f,  0.3893125355243683f,
    0.5016634166240692f,   0.6427869200706482f,  0.8614784181118011f,
};

static inline uint8_t nf4_encode(float x)
{
    unsigned q = 0;
    for (int t = 0; t < 15; t++)
        q += (unsigned)(x > nf4_thresholds[t]);
    return (uint8_t)q;
}

/* ---- create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8) ---- */

/* torch.linspace(start, end, steps) for a float32 CPU tensor, as ATen computes it
 * (aten/src/ATen/native/cpu/RangeFactoriesKernel.cpp linspace_kernel): step = (end - start) /
 * (steps - 1) in fp32; element idx < steps/2 is start + step*idx, the others
 * end - step*(steps-1-idx), each evaluated with one rounding (the compiled kernel contracts them to
 * FMA). Verified element for element against torch 2.15 (CPU capability AVX512) for every steps
 * count used below, and the resulting 256-entry map against torch's
 * create_dynamic_map(signed=True) (tests/fixtures/nf4). Older torch builds that did not contract
 * produce a map differing in the last ulp of some entries; bitsandbytes checkpoints carry the map
 * they were made with (nested_quant_map), which loaders should prefer. */
static void torch_linspace_f32(float *out, float start, float end, int steps)
{
    const float step = (end - start) / (float)(steps - 1);
    const int half = steps / 2;
    for (int i = 0; i < steps; i++)
        out[i] = i < half ? fmaf(step, (float)i, start) : fmaf(-step, (float)(steps - i - 1), end);
}

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

static float g_code8[256];
static pthread_once_t g_code8_once = PTHREAD_ONCE_INIT;

static void build_code8(void)
{
    /* signed: non_sign_bits = 7, additional_items = 2^(7-7) - 1 = 0 */
    float data[256];
    int n = 0;
    float bnd[65];
    for (int i = 0; i < 7; i++) {
        int items = (1 << i) + 1; /* fraction_items = 2^(i + 7 - 7) + 1 */
        torch_linspace_f32(bnd, 0.1f, 1.0f, items);
        /* 10 ** (-(7-1) + i) is a Python float (exact int 1 for i = 6); torch multiplies a float32
         * tensor by a Python scalar in fp32 after casting the scalar to float. */
        float scale = (float)pow(10.0, (double)(i - 6));
        for (int j = 0; j + 1 < items; j++) {
            float mean = (bnd[j] + bnd[j + 1]) / 2.0f;
            data[n++] = scale * mean;
            data[n++] = (-scale) * mean;
        }
    }
    data[n++] = 0.0f;
    data[n++] = 1.0f;
    /* n == 256 */
    qsort(data, (size_t)n, sizeof(float), cmp_float);
    memcpy(g_code8, data, sizeof g_code8);
}

static const float *code8_table(void)
{
    pthread_once(&g_code8_once, build_code8);
    return g_code8;
}

float bt_dynamic_code8(int idx)
{
    if (idx < 0 || idx > 255)
        return NAN;
    return code8_table()[idx];
}

/* csrc/kernels.cu dQuantize<0> (non-stochastic): binary search for x in the sorted 256-entry code,
 * then round to the nearer neighbour using fp32 midpoints. Ported operation for operation so ties
 * and NaN behave as on the GPU. */
static uint8_t code8_encode(const float *code, float x)
{
    int pivot = 127, upper_pivot = 255, lower_pivot = 0;
    float lower = -1.0f, upper = 1.0f;
    float val = code[pivot];
    for (int i = 64; i > 0; i >>= 1) {
        if (x > val) {
            lower_pivot = pivot;
            lower = val;
            pivot += i;
        } else {
            upper_pivot = pivot;
            upper = val;
            pivot -= i;
        }
        val = code[pivot];
    }
    if (upper_pivot == 255)
        upper = code[upper_pivot];
    if (lower_pivot == 0)
        lower = code[lower_pivot];
    if (x > val) {
        float midpoint = (upper + val) * 0.5f;
        return (uint8_t)(x > midpoint ? upper_pivot : pivot);
    }
    float midpoint = (lower + val) * 0.5f;
    return (uint8_t)(x < midpoint ? lower_pivot : pivot);
}

/* torch.sum of a contiguous 1-D fp32 CPU tensor, as ATen computes it
 * (aten/src/ATen/native/cpu/SumKernel.cpp: vectorized_inner_sum -> row_sum with ilp_factor 4 ->
 * multi_row_sum with 4 cascade levels over 8-lane vectors; then the scalar tail, then the 8 lanes
 * added in order). Every addition is a single fp32 rounding, in the same order as ATen. Checked
 * bit for bit against torch 2.15 on x86-64 for n <= 32768 (torch's GRAIN_SIZE); longer inputs are
 * split over torch's threads, so torch's own result then depends on its thread count. */
#define BT_TS_VL 8
#define BT_TS_ILP 4
#define BT_TS_LEVELS 4
static int64_t ceil_log2_i64(int64_t x) /* ATen utils::CeilLog2 */
{
    if (x <= 2)
        return 1;
    uint64_t v = (uint64_t)x - 1;
    int64_t last = 0;
    while (v) {
        last++;
        v >>= 1;
    }
    return last; /* llvm::findLastSet(x-1) + 1 == bit length of x-1 */
}

static float torch_sum_f32(const float *x, int64_t n)
{
    const int64_t vec_size = n / BT_TS_VL;
    const int64_t size_ilp = vec_size / BT_TS_ILP;
    float acc[BT_TS_LEVELS][BT_TS_ILP][BT_TS_VL];
    memset(acc, 0, sizeof acc);
    int64_t level_power = ceil_log2_i64(size_ilp) / BT_TS_LEVELS;
    if (level_power < 4)
        level_power = 4;
    const int64_t level_step = (int64_t)1 << level_power, level_mask = level_step - 1;
    int64_t i = 0;
    for (; i + level_step <= size_ilp;) {
        for (int64_t j = 0; j < level_step; ++j, ++i)
            for (int k = 0; k < BT_TS_ILP; k++)
                for (int l = 0; l < BT_TS_VL; l++)
                    acc[0][k][l] += x[(i * BT_TS_ILP + k) * BT_TS_VL + l];
        for (int j = 1; j < BT_TS_LEVELS; ++j) {
            for (int k = 0; k < BT_TS_ILP; k++)
                for (int l = 0; l < BT_TS_VL; l++) {
                    acc[j][k][l] += acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.0f;
                }
            if ((i & (level_mask << (j * level_power))) != 0)
                break;
        }
    }
    for (; i < size_ilp; ++i)
        for (int k = 0; k < BT_TS_ILP; k++)
            for (int l = 0; l < BT_TS_VL; l++)
                acc[0][k][l] += x[(i * BT_TS_ILP + k) * BT_TS_VL + l];
    for (int j = 1; j < BT_TS_LEVELS; ++j)
        for (int k = 0; k < BT_TS_ILP; k++)
            for (int l = 0; l < BT_TS_VL; l++)
                acc[0][k][l] += acc[j][k][l];
    /* row_sum: leftover vectors into partial 0, then partials 1..3 into partial 0 */
    for (int64_t v = size_ilp * BT_TS_ILP; v < vec_size; v++)
        for (int l = 0; l < BT_TS_VL; l++)
            acc[0][0][l] += x[v * BT_TS_VL + l];
    for (int k = 1; k < BT_TS_ILP; k++)
        for (int l = 0; l < BT_TS_VL; l++)
            acc[0][0][l] += acc[0][k][l];
    float final_acc = 0.0f;
    for (int64_t t = vec_size * BT_TS_VL; t < n; t++)
        final_acc += x[t];
    for (int l = 0; l < BT_TS_VL; l++)
        final_acc += acc[0][0][l];
    return 0.0f + final_acc;
}

/* ---- quantise / dequantise ---- */

void bt_nf4_free(bt_nf4 *q)
{
    if (!q)
        return;
    free(q->packed);
    free(q->absmax_q);
    free(q->nested_absmax);
    memset(q, 0, sizeof *q);
}

/* Quantise W[rows, cols] (fp32, row-major; rows*cols a positive multiple of 64).
 * On success fills *q (packed [n/2], absmax_q [n/64], nested_absmax [ceil(n/64/256)], offset) with
 * buffers owned by q (free with bt_nf4_free) and returns BT_OK. Errors: BT_ERR_INVALID for bad
 * shapes or NULL pointers, BT_ERR_NOMEM if an allocation fails (q is then left zeroed).
 *
 * Steps (bitsandbytes functional.quantize_4bit + kQuantizeBlockwise):
 *   absmax[b] = max_i |x_i| over the 64-block b (fp32);
 *   nibble = dQuantizeNF4(x * (1.0f / absmax[b])), element 2j -> high nibble of byte j;
 *   offset = absmax.mean() as torch computes it on CPU: torch.sum in fp32 with ATen's cascade
 *     order (torch_sum_f32 above), then divided by (float)nblocks in fp32. A CUDA-made checkpoint
 *     used CUDA's tree reduction and can differ in the last ulp; bitsandbytes stores the offset
 *     (quant_state nested_offset), so loading a checkpoint uses the stored value and stays exact;
 *   c[b] = absmax[b] - offset (fp32); nested_absmax[k] = max |c| over the 256-block k;
 *   absmax_q[b] = dQuantize<0>(code8, c[b] * (1.0f / nested_absmax[b/256])). */
void bt_nf4_block_absmax(const float *x, int64_t nblocks, float *absmax)
{
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < nblocks; b++) {
        float am = 0.0f;
        for (int i = 0; i < BT_NF4_BLOCKSIZE; i++)
            am = fmaxf(am, fabsf(x[b * BT_NF4_BLOCKSIZE + i]));
        absmax[b] = am;
    }
}

float bt_nf4_absmax_offset(const float *absmax, int64_t nblocks)
{
    return nblocks > 0 ? torch_sum_f32(absmax, nblocks) / (float)nblocks : 0.0f;
}

/* bt_nf4_quantize over n elements (a multiple of 64) of W; offset NULL: the mean of W's block
 * absmaxes (the whole matrix), else *offset (bt_nf4_quantize_part). */
static int quantize_core(bt_nf4 *q, const float *W, int64_t n, int64_t rows, int64_t cols,
                         const float *offset_in)
{
    memset(q, 0, sizeof *q);
    if (n % BT_NF4_BLOCKSIZE != 0)
        return bt_fail(BT_ERR_INVALID, "nf4_quantize: rows*cols=%lld is not a multiple of %d",
                       (long long)n, BT_NF4_BLOCKSIZE);
    const int64_t nb = n / BT_NF4_BLOCKSIZE;
    const int64_t nn = (nb + BT_NF4_NESTED_BLOCKSIZE - 1) / BT_NF4_NESTED_BLOCKSIZE;
    q->n = n;
    q->rows = rows;
    q->cols = cols;
    q->packed = malloc((size_t)(n / 2));
    q->absmax_q = malloc((size_t)nb);
    q->nested_absmax = malloc((size_t)nn * sizeof(float));
    float *absmax = malloc((size_t)nb * sizeof(float));
    if (!q->packed || !q->absmax_q || !q->nested_absmax || !absmax) {
        free(absmax);
        bt_nf4_free(q);
        return bt_fail(BT_ERR_NOMEM, "nf4_quantize: out of memory for %lld elements", (long long)n);
    }

#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < nb; b++) {
        const float *x = W + b * BT_NF4_BLOCKSIZE;
        float am = 0.0f;
        for (int i = 0; i < BT_NF4_BLOCKSIZE; i++)
            am = fmaxf(am, fabsf(x[i]));
        absmax[b] = am;
        const float inv = 1.0f / am;
        uint8_t *p = q->packed + b * (BT_NF4_BLOCKSIZE / 2);
        for (int j = 0; j < BT_NF4_BLOCKSIZE / 2; j++)
            p[j] = (uint8_t)((nf4_encode(x[2 * j] * inv) << 4) | nf4_encode(x[2 * j + 1] * inv));
    }

    const float offset = offset_in ? *offset_in : torch_sum_f32(absmax, nb) / (float)nb;
    q->offset = offset;

    const float *code = code8_table();
#pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < nn; k++) {
        int64_t b0 = k * BT_NF4_NESTED_BLOCKSIZE;
        int64_t b1 = b0 + BT_NF4_NESTED_BLOCKSIZE < nb ? b0 + BT_NF4_NESTED_BLOCKSIZE : nb;
        float am = 0.0f;
        for (int64_t b = b0; b < b1; b++)
            am = fmaxf(am, fabsf(absmax[b] - offset));
        q->nested_absmax[k] = am;
        const float inv = 1.0f / am;
        for (int64_t b = b0; b < b1; b++) {
            float c = absmax[b] - offset;
            q->absmax_q[b] = code8_encode(code, c * inv);
        }
    }
    free(absmax);
    return BT_OK;
}

int bt_nf4_quantize(bt_nf4 *q, const float *W, int64_t rows, int64_t cols)
{
    if (!q || !W || rows <= 0 || cols <= 0)
        return bt_fail(BT_ERR_INVALID, "nf4_quantize: bad arguments (rows=%lld cols=%lld)",
                       (long long)rows, (long long)cols);
    return quantize_core(q, W, rows * cols, rows, cols, NULL);
}

int bt_nf4_quantize_part(bt_nf4 *q, const float *x, int64_t n, float offset, int64_t rows, int64_t cols)
{
    if (!q || (!x && n) || n < 0 || rows <= 0 || cols <= 0 || n > rows * cols)
        return bt_fail(BT_ERR_INVALID, "nf4_quantize_part: bad arguments (n=%lld of %lld x %lld)",
                       (long long)n, (long long)rows, (long long)cols);
    if (n == 0) { /* a rank past the end of a short matrix: nothing held */
        memset(q, 0, sizeof *q);
        q->rows = rows;
        q->cols = cols;
        q->offset = offset;
        return BT_OK;
    }
    return quantize_core(q, x, n, rows, cols, &offset);
}

/* absmax of 64-block b as bitsandbytes dequantize_4bit reconstructs it: dequantize_blockwise gives
 * code8[q] * nested (fp32), then `+ offset` (fp32): two separate roundings (no FMA; this file is
 * compiled in ISO C mode where GCC does not contract). */
static inline float block_absmax(const bt_nf4 *q, const float *code, int64_t b)
{
    float s = code[q->absmax_q[b]] * q->nested_absmax[b / BT_NF4_NESTED_BLOCKSIZE];
    return s + q->offset;
}

/* Dequantise elements [e0, e1) of the flattened tensor (e0, e1 even) into out[0 .. e1-e0). */
static void dequant_range(const bt_nf4 *q, const float *code, int64_t e0, int64_t e1, float *out)
{
    int64_t e = e0;
    while (e < e1) {
        int64_t b = e / BT_NF4_BLOCKSIZE;
        int64_t bend = (b + 1) * BT_NF4_BLOCKSIZE;
        if (bend > e1)
            bend = e1;
        const float am = block_absmax(q, code, b);
        float lut[16];
        for (int t = 0; t < 16; t++)
            lut[t] = bt_nf4_code[t] * am;
        const uint8_t *p = q->packed + e / 2;
        float *o = out + (e - e0);
        const int64_t npair = (bend - e) / 2;
        for (int64_t j = 0; j < npair; j++) {
            o[2 * j] = lut[p[j] >> 4];
            o[2 * j + 1] = lut[p[j] & 0x0F];
        }
        e = bend;
    }
}

/* Dequantise rows [r0, r0+nr) of q (logical shape [rows, cols]) into out[nr, cols] fp32, caller
 * owned. x = NF4[nibble] * absmax(block) in fp32, as bitsandbytes kDequantizeBlockwise<NF4>.
 * Rows are dequantised in parallel (OpenMP). BT_ERR_INVALID (nothing written) unless q, out and
 * 0 <= r0 <= r0+nr <= rows; nr == 0 writes nothing. */
int bt_nf4_dequantize_rows(const bt_nf4 *q, int64_t r0, int64_t nr, float *out)
{
    if (!q || !out || r0 < 0 || nr < 0 || r0 + nr > q->rows)
        return bt_fail(BT_ERR_INVALID, "nf4: dequantize rows [%lld, %lld) of a %lld-row weight%s",
                       (long long)r0, (long long)(r0 + nr), q ? (long long)q->rows : 0LL,
                       q && out ? "" : " (NULL weight or output)");
    if (nr == 0)
        return BT_OK;
    const float *code = code8_table();
    const int64_t cols = q->cols;
    if (cols % 2 != 0) {
        /* odd rows: dequantise the covering even-aligned range element by element */
        for (int64_t i = 0; i < nr * cols; i++) {
            int64_t e = r0 * cols + i;
            uint8_t byte = q->packed[e / 2];
            uint8_t nib = (e & 1) ? (byte & 0x0F) : (byte >> 4);
            out[i] = bt_nf4_code[nib] * block_absmax(q, code, e / BT_NF4_BLOCKSIZE);
        }
        return BT_OK;
    }
#pragma omp parallel for schedule(static) if (nr * cols >= 32768)
    for (int64_t r = 0; r < nr; r++)
        dequant_range(q, code, (r0 + r) * cols, (r0 + r + 1) * cols, out + r * cols);
    return BT_OK;
}

/* ---- fused dequantise + GEMM (the tiled driver of kernels/cpu/tiled_gemm.c) ---- */

/* Dequantise rows [n0, n0 + nt) of Wq (K columns) into tile [nt, K] (bt_tile_dequant_fn). */
static void dequant_tile(const void *w, int n0, int nt, int K, float *tile)
{
    const bt_nf4 *Wq = w;
    const float *code = code8_table();
    for (int r = 0; r < nt; r++)
        dequant_range(Wq, code, (int64_t)(n0 + r) * K, (int64_t)(n0 + r + 1) * K,
                      tile + (size_t)r * K);
}

/* Floats of scratch needed by bt_nf4_linear_fwd / bt_nf4_linear_bwd_x for inner dimension K: one
 * BT_TILE_ROWS x K tile per OpenMP thread (omp_get_max_threads() at the time of the call, so
 * query it after setting the thread count). */
size_t bt_nf4_scratch_floats(int K)
{
    return bt_tiled_scratch_floats(K);
}

/* Y[M,N] = X[M,K] @ deq(Wq)[N,K]^T + beta*Y (fp32, row-major). Wq has rows == N, cols == K.
 * One OpenMP region, no barriers inside: thread t owns a contiguous range of W rows (= Y columns)
 * and, BT_TILE_ROWS rows at a time, dequantises them into its part of scratch (>=
 * bt_nf4_scratch_floats(K) floats, caller owned) and runs a single-threaded sgemm on them
 * (Y columns [n0, n0+nt), ldc = N). Same result as a dense sgemm on the fully dequantised matrix
 * up to sgemm summation order; the full fp32 matrix is never formed. */
void bt_nf4_linear_fwd(float *Y, const float *X, const bt_nf4 *Wq, int M, int K, int N, float beta,
                       float *scratch)
{
    code8_table(); /* build the map before the threads need it */
    bt_tiled_linear_fwd(Y, X, Wq, dequant_tile, M, K, N, beta, scratch);
}

/* dX[M,K] = dY[M,N] @ deq(Wq)[N,K] + beta*dX (fp32, row-major). One OpenMP region: thread t owns a
 * contiguous range of dX rows and walks all of W in BT_TILE_ROWS-row tiles, dequantising each
 * tile into its own scratch (every thread dequantises the whole matrix: N*K table lookups, small
 * next to its 2*M*N*K/threads GEMM flops) and accumulating dX[rows] += dY[rows, tile] @ tile
 * (the first tile applies beta). scratch as for bt_nf4_linear_fwd. */
void bt_nf4_linear_bwd_x(float *dX, const float *dY, const bt_nf4 *Wq, int M, int K, int N,
                         float beta, float *scratch)
{
    code8_table();
    bt_tiled_linear_bwd_x(dX, dY, Wq, dequant_tile, M, K, N, beta, scratch);
}
