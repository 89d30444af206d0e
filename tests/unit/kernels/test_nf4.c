/* NF4 + double quantisation: bit-exact parity with bitsandbytes fixtures
 * (tests/reference/gen_nf4_fixtures.py), the dynamic 8-bit map, nibble order, round-trip error
 * bound, row-range dequantisation and the fused dequantise+GEMM paths. Run from the repo root
 * (or set BT_NF4_FIXTURES to the fixture folder). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>

#include "common/bt_common.h"
#include "kernels/kernels.h"
#include "tests/unit/util/test_util.h"

static const char *fixture_dir(void)
{
    const char *d = getenv("BT_NF4_FIXTURES");
    return d && *d ? d : "tests/fixtures/nf4";
}

static void *read_file(const char *name, size_t *size)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", fixture_dir(), name);
    return tu_slurp(path, size);
}

static uint32_t rng_state = 12345u;
static float frand(void) /* uniform [-1, 1) */
{
    rng_state = rng_state * 1664525u + 1013904223u;
    return (float)((rng_state >> 8) & 0xFFFFFF) / 8388608.0f - 1.0f;
}
static float nrand(void) /* approx N(0,1): sum of 12 uniforms */
{
    float s = 0.0f;
    for (int i = 0; i < 12; i++)
        s += 0.5f * (frand() + 1.0f);
    return s - 6.0f;
}

/* ---- dynamic map ---- */

static void test_code8_matches_bitsandbytes(void **state)
{
    (void)state;
    size_t n = 0;
    float *code = read_file("code8.bin", &n);
    assert_int_equal(n, 256 * sizeof(float));
    for (int i = 0; i < 256; i++) {
        float mine = bt_dynamic_code8(i);
        if (memcmp(&mine, &code[i], sizeof(float)) != 0)
            fail_msg("code8[%d]: bitsandbytes %.9g, ours %.9g", i, code[i], mine);
    }
    free(code);
}

static void test_code8_properties(void **state)
{
    (void)state;
    /* sorted, 256 values, contains 0 and 1.0, 127 positive and 127 negative (besides 1.0) */
    int npos = 0, nneg = 0, nzero = 0;
    for (int i = 0; i < 256; i++) {
        float v = bt_dynamic_code8(i);
        if (i > 0)
            assert_true(bt_dynamic_code8(i - 1) <= v);
        npos += v > 0.0f;
        nneg += v < 0.0f;
        nzero += v == 0.0f;
    }
    assert_int_equal(nzero, 1);
    assert_int_equal(npos, 128);
    assert_int_equal(nneg, 127);
    assert_true(bt_dynamic_code8(255) == 1.0f);
    assert_true(bt_dynamic_code8(127) == 0.0f);
    assert_true(bt_dynamic_code8(0) == -0.992968738079071f);
    assert_true(isnan(bt_dynamic_code8(256)));
    assert_true(isnan(bt_dynamic_code8(-1)));
    /* NF4 table: 16 sorted values, -1, 0, 1 present */
    assert_true(bt_nf4_code[0] == -1.0f && bt_nf4_code[7] == 0.0f && bt_nf4_code[15] == 1.0f);
    for (int i = 1; i < 16; i++)
        assert_true(bt_nf4_code[i - 1] < bt_nf4_code[i]);
}

/* ---- bitsandbytes fixtures ---- */

static void check_fixture(const char *name)
{
    size_t size = 0;
    uint8_t *buf = read_file(name, &size);
    assert_true(size > 36);
    assert_memory_equal(buf, "BTNF4FX1", 8);
    int64_t rows, cols, nnested;
    float offset;
    memcpy(&rows, buf + 8, 8);
    memcpy(&cols, buf + 16, 8);
    memcpy(&offset, buf + 24, 4);
    memcpy(&nnested, buf + 28, 8);
    const int64_t n = rows * cols, nb = n / 64;
    size_t need = 36 + (size_t)n * 4 + (size_t)n / 2 + (size_t)nb + (size_t)nnested * 4 + (size_t)n * 4;
    assert_int_equal(size, need);
    const float *W = (const float *)(buf + 36); /* 36 is 4-aligned */
    const uint8_t *packed = buf + 36 + n * 4;
    const uint8_t *absq = packed + n / 2;
    float *nested = malloc((size_t)nnested * 4);
    float *deq = malloc((size_t)n * 4);
    memcpy(nested, absq + nb, (size_t)nnested * 4);
    memcpy(deq, absq + nb + nnested * 4, (size_t)n * 4);

    bt_nf4 q;
    assert_int_equal(bt_nf4_quantize(&q, W, rows, cols), BT_OK);
    assert_int_equal(q.n, n);
    assert_int_equal((nb + 255) / 256, nnested);
    if (memcmp(&q.offset, &offset, 4) != 0)
        fail_msg("%s: offset bitsandbytes %.9g ours %.9g", name, offset, q.offset);
    for (int64_t i = 0; i < n / 2; i++)
        if (q.packed[i] != packed[i])
            fail_msg("%s: packed[%lld] bnb 0x%02x ours 0x%02x", name, (long long)i, packed[i],
                     q.packed[i]);
    for (int64_t b = 0; b < nb; b++)
        if (q.absmax_q[b] != absq[b])
            fail_msg("%s: absmax_q[%lld] bnb %u ours %u", name, (long long)b, absq[b], q.absmax_q[b]);
    for (int64_t k = 0; k < nnested; k++)
        if (memcmp(&q.nested_absmax[k], &nested[k], 4) != 0)
            fail_msg("%s: nested[%lld] bnb %.9g ours %.9g", name, (long long)k, nested[k],
                     q.nested_absmax[k]);
    float *out = malloc((size_t)n * 4);
    bt_nf4_dequantize_rows(&q, 0, rows, out);
    for (int64_t i = 0; i < n; i++)
        if (memcmp(&out[i], &deq[i], 4) != 0)
            fail_msg("%s: deq[%lld] bnb %.9g ours %.9g", name, (long long)i, deq[i], out[i]);
    free(out);
    free(nested);
    free(deq);
    bt_nf4_free(&q);
    free(buf);
}

static void test_fixture_small(void **state) { (void)state; check_fixture("small_8x64.bin"); }
static void test_fixture_576(void **state) { (void)state; check_fixture("rows_20x576.bin"); }
static void test_fixture_1536(void **state) { (void)state; check_fixture("rows_12x1536.bin"); }

/* Many blocks with W[b] = (am[b], 0, ...): checks the offset (torch's cascade-summed mean) and the
 * nested 8-bit codes over 5000 and 13824 blocks (several nested blocks, cascade levels used). */
static void check_scales(const char *name)
{
    size_t size = 0;
    uint8_t *buf = read_file(name, &size);
    assert_memory_equal(buf, "BTNF4SC1", 8);
    int64_t nb, nn;
    float offset;
    memcpy(&nb, buf + 8, 8);
    memcpy(&offset, buf + 16, 4);
    memcpy(&nn, buf + 20, 8);
    assert_int_equal(size, 28 + (size_t)nb * 4 + (size_t)nb + (size_t)nn * 4);
    float *am = malloc((size_t)nb * 4), *nested = malloc((size_t)nn * 4);
    memcpy(am, buf + 28, (size_t)nb * 4);
    const uint8_t *absq = buf + 28 + nb * 4;
    memcpy(nested, absq + nb, (size_t)nn * 4);
    float *W = calloc((size_t)nb * 64, 4);
    for (int64_t b = 0; b < nb; b++)
        W[b * 64] = am[b];
    bt_nf4 q;
    assert_int_equal(bt_nf4_quantize(&q, W, nb, 64), BT_OK);
    if (memcmp(&q.offset, &offset, 4) != 0)
        fail_msg("%s: offset bitsandbytes %.9g ours %.9g", name, offset, q.offset);
    for (int64_t b = 0; b < nb; b++)
        if (q.absmax_q[b] != absq[b])
            fail_msg("%s: absmax_q[%lld] bnb %u ours %u", name, (long long)b, absq[b], q.absmax_q[b]);
    for (int64_t k = 0; k < nn; k++)
        assert_memory_equal(&q.nested_absmax[k], &nested[k], 4);
    bt_nf4_free(&q);
    free(W);
    free(am);
    free(nested);
    free(buf);
}

static void test_fixture_scales(void **state)
{
    (void)state;
    check_scales("scales_5000.bin");
    check_scales("scales_13824.bin");
}

/* ---- hand-made packing ---- */

static void test_nibble_order_and_codes(void **state)
{
    (void)state;
    /* one block whose values are exactly code * 0.5 (absmax 0.5): element i gets code i % 16 */
    float W[64];
    for (int i = 0; i < 64; i++)
        W[i] = bt_nf4_code[i % 16] * 0.5f;
    bt_nf4 q;
    assert_int_equal(bt_nf4_quantize(&q, W, 1, 64), BT_OK);
    for (int j = 0; j < 32; j++) {
        int hi = (2 * j) % 16, lo = (2 * j + 1) % 16;
        assert_int_equal(q.packed[j], (hi << 4) | lo);
    }
    /* single block: centred absmax is 0, nested absmax 0 -> code index of NaN = 0 (as CUDA) */
    assert_true(q.offset == 0.5f);
    assert_true(q.nested_absmax[0] == 0.0f);
    float out[64];
    bt_nf4_dequantize_rows(&q, 0, 1, out);
    /* absmax = code8[0] * 0 + 0.5 = 0.5: exact round trip */
    for (int i = 0; i < 64; i++)
        assert_true(out[i] == W[i]);
    bt_nf4_free(&q);
}

static void test_thresholds_strict(void **state)
{
    (void)state;
    /* block [1.0, t, ...]: absmax 1 so x*(1/absmax) == x. A value exactly at the midpoint 0.03979..
     * stays at code 7 (0.0) because the rule is strict `>`; the next float up goes to code 8. */
    float W[64] = {0};
    W[0] = 1.0f;
    W[1] = 0.03979014977812767f;
    W[2] = nextafterf(0.03979014977812767f, 1.0f);
    W[3] = -0.8480964004993439f;                     /* at a threshold: stays low (code 0) */
    W[4] = nextafterf(-0.8480964004993439f, 1.0f);   /* code 1 */
    W[5] = -1.0f;
    bt_nf4 q;
    assert_int_equal(bt_nf4_quantize(&q, W, 1, 64), BT_OK);
    assert_int_equal(q.packed[0], (15 << 4) | 7);
    assert_int_equal(q.packed[1], (8 << 4) | 0);
    assert_int_equal(q.packed[2], (1 << 4) | 0);
    assert_int_equal(q.packed[3], (7 << 4) | 7); /* zeros */
    bt_nf4_free(&q);
}

static void test_bad_args(void **state)
{
    (void)state;
    float W[96] = {0};
    bt_nf4 q;
    assert_int_equal(bt_nf4_quantize(&q, W, 1, 96), BT_ERR_INVALID);
    assert_int_equal(bt_nf4_quantize(&q, W, 0, 64), BT_ERR_INVALID);
    assert_int_equal(bt_nf4_quantize(&q, NULL, 1, 64), BT_ERR_INVALID);
    bt_nf4_free(NULL);
}

/* ---- round trip ---- */

static void test_roundtrip_bound(void **state)
{
    (void)state;
    const int64_t rows = 96, cols = 320; /* 480 blocks: two nested blocks, the second partial */
    float *W = malloc((size_t)(rows * cols) * 4), *out = malloc((size_t)(rows * cols) * 4);
    for (int64_t r = 0; r < rows; r++) {
        float scale = 0.01f * (1.0f + 4.0f * (float)(r % 7)); /* spread of block scales */
        for (int64_t c = 0; c < cols; c++)
            W[r * cols + c] = scale * nrand();
    }
    bt_nf4 q;
    assert_int_equal(bt_nf4_quantize(&q, W, rows, cols), BT_OK);
    bt_nf4_dequantize_rows(&q, 0, rows, out);
    /* max half-gap between neighbouring NF4 codes */
    float half_gap = 0.0f;
    for (int i = 1; i < 16; i++)
        half_gap = fmaxf(half_gap, 0.5f * (bt_nf4_code[i] - bt_nf4_code[i - 1]));
    assert_true(half_gap > 0.150f && half_gap < 0.153f);
    const int64_t nb = rows * cols / 64;
    for (int64_t b = 0; b < nb; b++) {
        float am = 0.0f;
        for (int i = 0; i < 64; i++)
            am = fmaxf(am, fabsf(W[b * 64 + i]));
        /* absmax quantisation error: at most half the widest gap of the 8-bit map (the top gap,
         * 1 - 0.99297 = 0.0070, or 0.014/2 in the linear region) times the nested absmax */
        float nested = q.nested_absmax[b / 256];
        float am_err = 0.0071f * nested + 1e-7f;
        for (int i = 0; i < 64; i++) {
            float e = fabsf(W[b * 64 + i] - out[b * 64 + i]);
            float bound = am * half_gap + am_err * 1.0f + 1e-6f * am;
            if (e > bound)
                fail_msg("block %lld elem %d: |err| %g > bound %g", (long long)b, i, e, bound);
        }
    }
    bt_nf4_free(&q);
    free(W);
    free(out);
}

static void test_dequantize_row_ranges(void **state)
{
    (void)state;
    const int64_t rows = 40, cols = 576;
    float *W = malloc((size_t)(rows * cols) * 4), *full = malloc((size_t)(rows * cols) * 4);
    float *part = malloc((size_t)(rows * cols) * 4);
    for (int64_t i = 0; i < rows * cols; i++)
        W[i] = 0.02f * nrand();
    bt_nf4 q;
    assert_int_equal(bt_nf4_quantize(&q, W, rows, cols), BT_OK);
    bt_nf4_dequantize_rows(&q, 0, rows, full);
    const int64_t ranges[][2] = {{0, 1}, {3, 5}, {17, 23}, {39, 1}, {0, 40}};
    for (size_t t = 0; t < sizeof ranges / sizeof ranges[0]; t++) {
        int64_t r0 = ranges[t][0], nr = ranges[t][1];
        memset(part, 0xFF, (size_t)(rows * cols) * 4);
        bt_nf4_dequantize_rows(&q, r0, nr, part);
        assert_memory_equal(part, full + r0 * cols, (size_t)(nr * cols) * 4);
    }
    /* odd column count: blocks cross rows */
    bt_nf4 q2;
    const int64_t r2 = 64, c2 = 5; /* 320 elements = 5 blocks */
    assert_int_equal(bt_nf4_quantize(&q2, W, r2, c2), BT_OK);
    float *full2 = malloc((size_t)(r2 * c2) * 4);
    bt_nf4_dequantize_rows(&q2, 0, r2, full2);
    bt_nf4_dequantize_rows(&q2, 7, 3, part);
    assert_memory_equal(part, full2 + 7 * c2, 3 * c2 * 4);
    /* and the row-crossing dequantisation equals the flattened one of the same data */
    bt_nf4 q3;
    assert_int_equal(bt_nf4_quantize(&q3, W, 1, r2 * c2), BT_OK);
    bt_nf4_dequantize_rows(&q3, 0, 1, part);
    assert_memory_equal(part, full2, (size_t)(r2 * c2) * 4);
    /* a range outside the weight is refused with the reason, nothing written */
    memset(part, 0xFF, (size_t)(rows * cols) * 4);
    assert_int_equal(bt_nf4_dequantize_rows(&q, 39, 2, part), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "rows [39, 41) of a 40-row weight"));
    assert_int_equal(bt_nf4_dequantize_rows(&q, -1, 1, part), BT_ERR_INVALID);
    assert_int_equal(bt_nf4_dequantize_rows(&q, 0, 1, NULL), BT_ERR_INVALID);
    assert_int_equal(bt_nf4_dequantize_rows(&q, 5, 0, part), BT_OK);
    for (int64_t i = 0; i < rows * cols; i++)
        assert_true(isnan(part[i]));
    bt_nf4_free(&q);
    bt_nf4_free(&q2);
    bt_nf4_free(&q3);
    free(full2);
    free(W);
    free(full);
    free(part);
}

/* ---- fused GEMM ---- */

/* dist.shard_base loading NF4 per rank (issue 26): the W parts of a matrix quantised apart, with
 * the offset of the whole matrix's absmaxes (streamed in uneven pieces), cut at 16384-weight
 * nested groups (plan.h bt_shard_cut_nf4: ceil(groups / W) a rank), concatenate to
 * bt_nf4_quantize's packed codes, absmax codes and nested absmax bit for bit; with the part's own
 * offset instead (quantised alone), they would not. 5.5 groups: a short last group. */
static void test_quantize_parts_concatenate(void **state)
{
    (void)state;
    const int64_t rows = 88, cols = 1024, n = rows * cols, G = 256 * 64, nb = n / 64;
    float *w = malloc((size_t)n * sizeof(float)), *am = malloc((size_t)nb * sizeof(float));
    uint64_t s = 7;
    for (int64_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        w[i] = ((float)(s >> 40) / (float)(1 << 24) - 0.5f) * (i % 977 == 0 ? 9.0f : 0.05f);
    }
    bt_nf4 whole;
    assert_int_equal(bt_nf4_quantize(&whole, w, rows, cols), 0);
    for (int64_t b = 0; b < nb;) { /* pass 1 in uneven pieces, as a row-tile stream gives them */
        int64_t k = nb - b < 37 ? nb - b : 37;
        bt_nf4_block_absmax(w + b * 64, k, am + b);
        b += k;
    }
    const float off = bt_nf4_absmax_offset(am, nb);
    assert_memory_equal(&off, &whole.offset, sizeof off);
    for (int W = 2; W <= 7; W++) {
        const int64_t groups = (n + G - 1) / G, per = (groups + W - 1) / W;
        int64_t at = 0;
        int differs_alone = 0;
        for (int r = 0; r < W; r++) {
            int64_t a = r * per * G < n ? r * per * G : n, e = a + per * G < n ? a + per * G : n;
            bt_nf4 p;
            assert_int_equal(bt_nf4_quantize_part(&p, w + a, e - a, off, rows, cols), 0);
            assert_int_equal(p.n, e - a);
            assert_memory_equal(&p.offset, &whole.offset, sizeof off);
            if (e > a) {
                assert_memory_equal(p.packed, whole.packed + a / 2, (size_t)(e - a) / 2);
                assert_memory_equal(p.absmax_q, whole.absmax_q + a / 64, (size_t)(e - a) / 64);
                assert_memory_equal(p.nested_absmax, whole.nested_absmax + a / G,
                                    (size_t)((e - a + G - 1) / G) * sizeof(float));
                bt_nf4 alone; /* the part quantised as a matrix of its own: its own offset */
                assert_int_equal(bt_nf4_quantize(&alone, w + a, 1, e - a), 0);
                differs_alone |= memcmp(alone.absmax_q, whole.absmax_q + a / 64, (size_t)(e - a) / 64) != 0;
                bt_nf4_free(&alone);
            }
            at = e;
            bt_nf4_free(&p);
        }
        assert_int_equal(at, n);
        assert_true(differs_alone);
    }
    bt_nf4 z;
    assert_int_equal(bt_nf4_quantize_part(&z, NULL, 0, off, rows, cols), 0);
    assert_null(z.packed);
    assert_int_equal(bt_nf4_quantize_part(&z, w, n + 64, off, rows, cols), BT_ERR_INVALID);
    bt_nf4_free(&whole);
    free(w), free(am);
}

static void test_nf4_linear_vs_dense(void **state)
{
    (void)state;
    const int M = 37, K = 192, N = 300; /* N not a multiple of the tile */
    float *W = malloc((size_t)N * K * 4), *Wd = malloc((size_t)N * K * 4);
    float *X = malloc((size_t)M * K * 4), *dY = malloc((size_t)M * N * 4);
    float *Y = malloc((size_t)M * N * 4), *Yref = malloc((size_t)M * N * 4);
    float *dX = malloc((size_t)M * K * 4), *dXref = malloc((size_t)M * K * 4);
    for (int i = 0; i < N * K; i++)
        W[i] = 0.05f * nrand();
    for (int i = 0; i < M * K; i++)
        X[i] = frand();
    for (int i = 0; i < M * N; i++)
        dY[i] = frand();
    bt_nf4 q;
    assert_int_equal(bt_nf4_quantize(&q, W, N, K), BT_OK);
    bt_nf4_dequantize_rows(&q, 0, N, Wd);
    float *scratch = malloc(bt_nf4_scratch_floats(K) * 4);
    for (int pass = 0; pass < 2; pass++) {
        float beta = pass == 0 ? 0.0f : 0.5f;
        for (int i = 0; i < M * N; i++)
            Y[i] = Yref[i] = pass == 0 ? NAN : (float)(i % 5);
        for (int i = 0; i < M * K; i++)
            dX[i] = dXref[i] = pass == 0 ? NAN : (float)(i % 3);
        if (pass == 0) { /* beta 0 must overwrite: the reference starts from zeros */
            memset(Yref, 0, (size_t)M * N * 4);
            memset(dXref, 0, (size_t)M * K * 4);
        }
        bt_nf4_linear_fwd(Y, X, &q, M, K, N, beta, scratch);
        /* double reference */
        for (int m = 0; m < M; m++)
            for (int n = 0; n < N; n++) {
                double s = 0.0;
                for (int k = 0; k < K; k++)
                    s += (double)X[m * K + k] * Wd[n * K + k];
                Yref[m * N + n] = (float)(s + (double)beta * Yref[m * N + n]);
            }
        for (int i = 0; i < M * N; i++)
            assert_float_equal(Y[i], Yref[i], 1e-4 * (1.0 + fabs(Yref[i])));
        bt_nf4_linear_bwd_x(dX, dY, &q, M, K, N, beta, scratch);
        for (int m = 0; m < M; m++)
            for (int k = 0; k < K; k++) {
                double s = 0.0;
                for (int n = 0; n < N; n++)
                    s += (double)dY[m * N + n] * Wd[n * K + k];
                dXref[m * K + k] = (float)(s + (double)beta * dXref[m * K + k]);
            }
        for (int i = 0; i < M * K; i++)
            assert_float_equal(dX[i], dXref[i], 1e-4 * (1.0 + fabs(dXref[i])));
    }
    bt_nf4_free(&q);
    free(scratch);
    free(W);
    free(Wd);
    free(X);
    free(dY);
    free(Y);
    free(Yref);
    free(dX);
    free(dXref);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_code8_matches_bitsandbytes),
        cmocka_unit_test(test_quantize_parts_concatenate),
        cmocka_unit_test(test_code8_properties),
        cmocka_unit_test(test_fixture_small),
        cmocka_unit_test(test_fixture_576),
        cmocka_unit_test(test_fixture_1536),
        cmocka_unit_test(test_fixture_scales),
        cmocka_unit_test(test_nibble_order_and_codes),
        cmocka_unit_test(test_thresholds_strict),
        cmocka_unit_test(test_bad_args),
        cmocka_unit_test(test_roundtrip_bound),
        cmocka_unit_test(test_dequantize_row_ranges),
        cmocka_unit_test(test_nf4_linear_vs_dense),
    };
    return cmocka_run_group_tests_name("nf4", tests, NULL, NULL);
}
