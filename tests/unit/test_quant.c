/* Tests for common/quant.c: dequantisation against gguf-py fixtures (tests/fixtures/quant/, made
 * by tests/reference/gen_quant_fixtures.py with gguf==0.17.1), fp16/bf16 conversions against
 * numpy / gguf-py and hand-checked IEEE cases.
 * Tolerance: none. Every formula in quant.c performs the same float operations in the same
 * order as gguf-py (e.g. Q4_1: q*d + m; Q6_K: (d*sc)*q; Q4_K: (d*sc)*q - dmin*m), and the build
 * uses -std=c17 (no FMA contraction), so results are compared bit for bit. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "common/gguf.h"
#include "common/quant.h"
#include "tests/unit/util/test_util.h"

#define FIXDIR "tests/fixtures/quant/"

static void *slurp(const char *name, size_t *size) {
    char path[512];
    snprintf(path, sizeof path, FIXDIR "%s", name);
    return tu_slurp(path, size);
}

static uint32_t bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float fbits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void check_fixture(int type) {
    const char *name = bt_ggml_type_name(type);
    char fn[64];
    size_t nb, nf;
    snprintf(fn, sizeof fn, "%s.blocks", name);
    uint8_t *blocks = slurp(fn, &nb);
    snprintf(fn, sizeof fn, "%s.f32", name);
    float *want = slurp(fn, &nf);
    int64_t n = (int64_t)(nf / 4);
    assert_true(n > 0);
    assert_int_equal(bt_ggml_row_size(type, n), nb);
    float *got = malloc((size_t)n * sizeof(float));
    assert_int_equal(bt_ggml_dequantize(type, blocks, got, n), BT_OK);
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        if (bits(got[i]) != bits(want[i])) {
            if (bad < 5)
                print_error("%s[%lld]: got %.9g (0x%08x) want %.9g (0x%08x)\n", name,
                            (long long)i, got[i], bits(got[i]), want[i], bits(want[i]));
            bad++;
        }
    }
    assert_int_equal(bad, 0);
    free(got);
    free(blocks);
    free(want);
}

static void test_fixture_f32(void **s) { (void)s; check_fixture(BT_GGML_F32); }
static void test_fixture_f16(void **s) { (void)s; check_fixture(BT_GGML_F16); }
static void test_fixture_bf16(void **s) { (void)s; check_fixture(BT_GGML_BF16); }
static void test_fixture_q4_0(void **s) { (void)s; check_fixture(BT_GGML_Q4_0); }
static void test_fixture_q4_1(void **s) { (void)s; check_fixture(BT_GGML_Q4_1); }
static void test_fixture_q5_0(void **s) { (void)s; check_fixture(BT_GGML_Q5_0); }
static void test_fixture_q5_1(void **s) { (void)s; check_fixture(BT_GGML_Q5_1); }
static void test_fixture_q8_0(void **s) { (void)s; check_fixture(BT_GGML_Q8_0); }
static void test_fixture_q4_k(void **s) { (void)s; check_fixture(BT_GGML_Q4_K); }
static void test_fixture_q5_k(void **s) { (void)s; check_fixture(BT_GGML_Q5_K); }
static void test_fixture_q6_k(void **s) { (void)s; check_fixture(BT_GGML_Q6_K); }

/* float -> fp16 / bf16 on ~5400 inputs (random, halfway cases, subnormals, overflow, nan) */
static void test_conversion_fixtures(void **s) {
    (void)s;
    size_t ni, nh, nb;
    float *in = slurp("fp32_conv.in.f32", &ni);
    uint16_t *h = slurp("fp32_to_fp16.out.u16", &nh);
    uint16_t *b = slurp("fp32_to_bf16.out.u16", &nb);
    size_t n = ni / 4;
    assert_true(n > 1000);
    assert_int_equal(nh, n * 2);
    assert_int_equal(nb, n * 2);
    size_t bad_h = 0, bad_b = 0;
    for (size_t i = 0; i < n; i++) {
        uint16_t gh = bt_fp32_to_fp16(in[i]), gb = bt_fp32_to_bf16(in[i]);
        if (gh != h[i] && bad_h++ < 5)
            print_error("fp16(%.9g 0x%08x): got 0x%04x want 0x%04x\n", in[i], bits(in[i]), gh, h[i]);
        if (gb != b[i] && bad_b++ < 5)
            print_error("bf16(%.9g 0x%08x): got 0x%04x want 0x%04x\n", in[i], bits(in[i]), gb, b[i]);
    }
    assert_int_equal(bad_h, 0);
    assert_int_equal(bad_b, 0);
    free(in);
    free(h);
    free(b);
}

static void test_fp16_hand(void **s) {
    (void)s;
    assert_true(bt_fp16_to_fp32(0x3C00) == 1.0f);
    assert_true(bt_fp16_to_fp32(0xC000) == -2.0f);
    assert_true(bt_fp16_to_fp32(0x7BFF) == 65504.0f);
    assert_true(bt_fp16_to_fp32(0x0001) == 0x1p-24f);          /* smallest subnormal */
    assert_true(bt_fp16_to_fp32(0x03FF) == 1023 * 0x1p-24f);   /* largest subnormal */
    assert_true(bt_fp16_to_fp32(0x0400) == 0x1p-14f);          /* smallest normal */
    assert_int_equal(bits(bt_fp16_to_fp32(0x8000)), 0x80000000u); /* -0 */
    assert_true(isinf(bt_fp16_to_fp32(0x7C00)) && bt_fp16_to_fp32(0x7C00) > 0);
    assert_true(isinf(bt_fp16_to_fp32(0xFC00)) && bt_fp16_to_fp32(0xFC00) < 0);
    assert_true(isnan(bt_fp16_to_fp32(0x7E00)));
    assert_true(isnan(bt_fp16_to_fp32(0x7C01))); /* signalling payload stays a nan */

    assert_int_equal(bt_fp32_to_fp16(1.0f), 0x3C00);
    assert_int_equal(bt_fp32_to_fp16(-0.0f), 0x8000);
    assert_int_equal(bt_fp32_to_fp16(65504.0f), 0x7BFF);
    assert_int_equal(bt_fp32_to_fp16(65519.996f), 0x7BFF); /* just below the rounding edge */
    assert_int_equal(bt_fp32_to_fp16(65520.0f), 0x7C00);   /* ties to even -> inf */
    assert_int_equal(bt_fp32_to_fp16(INFINITY), 0x7C00);
    assert_int_equal(bt_fp32_to_fp16(-INFINITY), 0xFC00);
    assert_int_equal(bt_fp32_to_fp16(1e10f), 0x7C00);
    assert_true((bt_fp32_to_fp16(NAN) & 0x7FFF) > 0x7C00);
    assert_int_equal(bt_fp32_to_fp16(0x1p-24f), 0x0001);
    assert_int_equal(bt_fp32_to_fp16(0x1p-25f), 0x0000);              /* tie -> even 0 */
    assert_int_equal(bt_fp32_to_fp16(fbits(0x33000001u)), 0x0001);    /* just above the tie */
    assert_int_equal(bt_fp32_to_fp16(3 * 0x1p-25f), 0x0002);          /* 1.5 ulp -> 2 */
    assert_int_equal(bt_fp32_to_fp16(5 * 0x1p-25f), 0x0002);          /* 2.5 ulp -> 2 */
    assert_int_equal(bt_fp32_to_fp16(0x1p-14f - 0x1p-25f), 0x0400);   /* rounds up to normal */
    assert_int_equal(bt_fp32_to_fp16(1.0f + 0x1p-11f), 0x3C00);       /* tie -> even */
    assert_int_equal(bt_fp32_to_fp16(1.0f + 3 * 0x1p-11f), 0x3C02);   /* tie -> even (up) */
    assert_int_equal(bt_fp32_to_fp16(1.0f + 0x1p-11f + 0x1p-20f), 0x3C01);
    assert_int_equal(bt_fp32_to_fp16(1e-10f), 0x0000);

    /* every non-nan half survives half -> float -> half */
    for (uint32_t i = 0; i < 65536; i++) {
        if ((i & 0x7C00) == 0x7C00 && (i & 0x3FF)) continue;
        assert_int_equal(bt_fp32_to_fp16(bt_fp16_to_fp32((uint16_t)i)), i);
    }
}

static void test_bf16_hand(void **s) {
    (void)s;
    assert_true(bt_bf16_to_fp32(0x3F80) == 1.0f);
    assert_true(bt_bf16_to_fp32(0xC040) == -3.0f);
    assert_int_equal(bits(bt_bf16_to_fp32(0x8000)), 0x80000000u);
    assert_true(isinf(bt_bf16_to_fp32(0x7F80)));
    assert_true(isnan(bt_bf16_to_fp32(0x7FC0)));
    assert_true(bt_bf16_to_fp32(0x0001) == 0x1p-133f); /* bf16 subnormal */

    assert_int_equal(bt_fp32_to_bf16(1.0f), 0x3F80);
    assert_int_equal(bt_fp32_to_bf16(1.0f + 0x1p-8f), 0x3F80);       /* tie -> even */
    assert_int_equal(bt_fp32_to_bf16(1.0f + 3 * 0x1p-8f), 0x3F82);   /* tie -> even (up) */
    assert_int_equal(bt_fp32_to_bf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3F81);
    assert_int_equal(bt_fp32_to_bf16(-0.0f), 0x8000);
    assert_int_equal(bt_fp32_to_bf16(INFINITY), 0x7F80);
    assert_int_equal(bt_fp32_to_bf16(-INFINITY), 0xFF80);
    assert_int_equal(bt_fp32_to_bf16(3.4028235e38f), 0x7F80); /* FLT_MAX rounds to inf */
    assert_int_equal(bt_fp32_to_bf16(NAN) & 0x7FC0, 0x7FC0);
    assert_int_equal(bt_fp32_to_bf16(fbits(0x7F800001u)), 0x7FC0); /* snan -> quiet nan */
    assert_int_equal(bt_fp32_to_bf16(fbits(0x00018000u)), 0x0002); /* subnormal tie -> even */
    for (uint32_t i = 0; i < 65536; i++) {
        if ((i & 0x7F80) == 0x7F80 && (i & 0x7F)) continue;
        assert_int_equal(bt_fp32_to_bf16(bt_bf16_to_fp32((uint16_t)i)), i);
    }
}

static void test_type_table(void **s) {
    (void)s;
    assert_string_equal(bt_ggml_type_name(BT_GGML_Q4_1), "Q4_1");
    assert_string_equal(bt_ggml_type_name(BT_GGML_BF16), "BF16");
    assert_string_equal(bt_ggml_type_name(4), "?"); /* removed Q4_2 */
    assert_string_equal(bt_ggml_type_name(-1), "?");
    assert_int_equal(bt_ggml_block_elems(BT_GGML_Q8_0), 32);
    assert_int_equal(bt_ggml_block_elems(BT_GGML_Q6_K), 256);
    assert_int_equal(bt_ggml_block_elems(BT_GGML_F32), 1);
    assert_int_equal(bt_ggml_block_elems(99), 0);
    assert_int_equal(bt_ggml_block_bytes(BT_GGML_Q4_0), 18);
    assert_int_equal(bt_ggml_block_bytes(BT_GGML_Q4_1), 20);
    assert_int_equal(bt_ggml_block_bytes(BT_GGML_Q5_0), 22);
    assert_int_equal(bt_ggml_block_bytes(BT_GGML_Q5_1), 24);
    assert_int_equal(bt_ggml_block_bytes(BT_GGML_Q8_0), 34);
    assert_int_equal(bt_ggml_block_bytes(BT_GGML_Q4_K), 144);
    assert_int_equal(bt_ggml_block_bytes(BT_GGML_Q5_K), 176);
    assert_int_equal(bt_ggml_block_bytes(BT_GGML_Q6_K), 210);
    assert_int_equal(bt_ggml_block_bytes(BT_GGML_Q2_K), 84);
    assert_int_equal(bt_ggml_block_bytes(BT_GGML_Q3_K), 110);
    assert_int_equal(bt_ggml_block_bytes(BT_GGML_Q8_K), 292);
    assert_int_equal(bt_ggml_block_bytes(31), 0);
    assert_int_equal(bt_ggml_row_size(BT_GGML_Q4_1, 576), 360);
    assert_int_equal(bt_ggml_row_size(BT_GGML_Q8_0, 576), 612);
    assert_int_equal(bt_ggml_row_size(BT_GGML_F32, 576), 2304);
    assert_int_equal(bt_ggml_row_size(BT_GGML_Q4_K, 576), 0); /* not a multiple of 256 */
    assert_int_equal(bt_ggml_row_size(BT_GGML_Q4_0, 33), 0);
    assert_int_equal(bt_ggml_row_size(BT_GGML_F32, -1), 0);
    assert_int_equal(bt_ggml_row_size(BT_GGML_F32, INT64_C(1) << 62), 0); /* 2^64 bytes */
    assert_int_equal(bt_ggml_row_size(77, 32), 0);
    assert_true(bt_ggml_can_dequantize(BT_GGML_Q6_K));
    assert_false(bt_ggml_can_dequantize(BT_GGML_Q2_K));
    assert_false(bt_ggml_can_dequantize(1234));
}

static void test_dequant_errors(void **s) {
    (void)s;
    uint8_t blk[64] = {0};
    float out[64];
    assert_int_equal(bt_ggml_dequantize(BT_GGML_Q4_0, blk, out, 31), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "Q4_0"));
    assert_int_equal(bt_ggml_dequantize(BT_GGML_Q4_0, blk, out, -32), BT_ERR_INVALID);
    assert_int_equal(bt_ggml_dequantize(99, blk, out, 32), BT_ERR_UNSUPPORTED);
    assert_int_equal(bt_ggml_dequantize(BT_GGML_Q2_K, blk, out, 256), BT_ERR_UNSUPPORTED);
    assert_int_equal(bt_ggml_dequantize(BT_GGML_Q8_0, NULL, out, 32), BT_ERR_INVALID);
    assert_int_equal(bt_ggml_dequantize(BT_GGML_Q8_0, blk, out, 0), BT_OK);
}

/* hand-built blocks, values worked out from the ggml-quants.c formulas */
static void test_hand_blocks(void **s) {
    (void)s;
    float y[256];
    /* Q4_1: d = 0.5, m = -1; qs[j] = j | (15-j)<<4 -> y[j] = 0.5*j - 1, y[j+16] = 0.5*(15-j) - 1 */
    uint8_t q41[20];
    uint16_t d = bt_fp32_to_fp16(0.5f), m = bt_fp32_to_fp16(-1.0f);
    memcpy(q41, &d, 2);
    memcpy(q41 + 2, &m, 2);
    for (int j = 0; j < 16; j++) q41[4 + j] = (uint8_t)(j | (15 - j) << 4);
    assert_int_equal(bt_ggml_dequantize(BT_GGML_Q4_1, q41, y, 32), BT_OK);
    for (int j = 0; j < 16; j++) {
        assert_true(y[j] == 0.5f * (float)j - 1.0f);
        assert_true(y[j + 16] == 0.5f * (float)(15 - j) - 1.0f);
    }
    /* Q8_0: d = 0.25, qs = -128..-97 */
    uint8_t q80[34];
    d = bt_fp32_to_fp16(0.25f);
    memcpy(q80, &d, 2);
    for (int j = 0; j < 32; j++) q80[2 + j] = (uint8_t)(int8_t)(-128 + j);
    assert_int_equal(bt_ggml_dequantize(BT_GGML_Q8_0, q80, y, 32), BT_OK);
    for (int j = 0; j < 32; j++) assert_true(y[j] == 0.25f * (float)(-128 + j));
    /* Q5_0: d = 1, qh bit j set for odd j, qs nibbles 0 -> y[j] = (odd ? 16 : 0) - 16 */
    uint8_t q50[22] = {0};
    d = bt_fp32_to_fp16(1.0f);
    memcpy(q50, &d, 2);
    uint32_t qh = 0xAAAAAAAAu;
    memcpy(q50 + 2, &qh, 4);
    assert_int_equal(bt_ggml_dequantize(BT_GGML_Q5_0, q50, y, 32), BT_OK);
    for (int j = 0; j < 32; j++) assert_true(y[j] == ((j & 1) ? 0.0f : -16.0f));
    /* Q6_K: d = 1, all scales 2, ql = 0, qh = 0 -> q = -32 -> y = -64 */
    uint8_t q6[210] = {0};
    for (int i = 0; i < 16; i++) q6[192 + i] = 2;
    memcpy(q6 + 208, &d, 2);
    assert_int_equal(bt_ggml_dequantize(BT_GGML_Q6_K, q6, y, 256), BT_OK);
    for (int j = 0; j < 256; j++) assert_true(y[j] == -64.0f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fixture_f32),   cmocka_unit_test(test_fixture_f16),
        cmocka_unit_test(test_fixture_bf16),  cmocka_unit_test(test_fixture_q4_0),
        cmocka_unit_test(test_fixture_q4_1),  cmocka_unit_test(test_fixture_q5_0),
        cmocka_unit_test(test_fixture_q5_1),  cmocka_unit_test(test_fixture_q8_0),
        cmocka_unit_test(test_fixture_q4_k),  cmocka_unit_test(test_fixture_q5_k),
        cmocka_unit_test(test_fixture_q6_k),  cmocka_unit_test(test_conversion_fixtures),
        cmocka_unit_test(test_fp16_hand),     cmocka_unit_test(test_bf16_hand),
        cmocka_unit_test(test_type_table),    cmocka_unit_test(test_dequant_errors),
        cmocka_unit_test(test_hand_blocks),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
