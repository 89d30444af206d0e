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
static void test_fixture_q2_k(void **s) { (void)s; check_fixture(BT_GGML_Q2_K); }
static void test_fixture_q3_k(void **s) { (void)s; check_fixture(BT_GGML_Q3_K); }
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
    /* types without a decoder still have their sizes (files holding them open) */
    assert_string_equal(bt_ggml_type_name(23), "IQ4_XS");
    assert_int_equal(bt_ggml_block_bytes(23), 136);
    assert_int_equal(bt_ggml_block_elems(23), 256);
    assert_int_equal(bt_ggml_block_bytes(20), 18); /* IQ4_NL */
    assert_int_equal(bt_ggml_block_bytes(35), 66); /* TQ2_0 */
    assert_int_equal(bt_ggml_block_bytes(39), 17); /* MXFP4 */
    assert_int_equal(bt_ggml_block_bytes(36), 0);  /* removed IQ4_NL_4_4 */
    assert_int_equal(bt_ggml_block_bytes(40), 0);
    assert_false(bt_ggml_can_dequantize(23));
    assert_false(bt_ggml_can_dequantize(BT_GGML_Q8_K));
    assert_int_equal(bt_ggml_row_size(BT_GGML_Q4_1, 576), 360);
    assert_int_equal(bt_ggml_row_size(BT_GGML_Q8_0, 576), 612);
    assert_int_equal(bt_ggml_row_size(BT_GGML_F32, 576), 2304);
    assert_int_equal(bt_ggml_row_size(BT_GGML_Q4_K, 576), 0); /* not a multiple of 256 */
    assert_int_equal(bt_ggml_row_size(BT_GGML_Q4_0, 33), 0);
    assert_int_equal(bt_ggml_row_size(BT_GGML_F32, -1), 0);
    assert_int_equal(bt_ggml_row_size(BT_GGML_F32, INT64_C(1) << 62), 0); /* 2^64 bytes */
    assert_int_equal(bt_ggml_row_size(77, 32), 0);
    assert_true(bt_ggml_can_dequantize(BT_GGML_Q6_K));
    assert_true(bt_ggml_can_dequantize(BT_GGML_Q2_K));
    assert_true(bt_ggml_can_dequantize(BT_GGML_Q3_K));
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
    assert_int_equal(bt_ggml_dequantize(BT_GGML_Q8_K, blk, out, 256), BT_ERR_UNSUPPORTED);
    assert_int_equal(bt_ggml_dequantize(23 /* IQ4_XS */, blk, out, 256), BT_ERR_UNSUPPORTED);
    assert_non_null(strstr(bt_last_error(), "IQ4_XS"));
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


/* Encoders of the block-32 types and 16-bit floats against gguf-py quants.quantize (fixtures
 * T.enc.in.f32 -> T.enc.blocks): byte for byte. */
static void check_encoder_fixture(int type) {
    const char *name = bt_ggml_type_name(type);
    char fn[64];
    size_t nx, nb;
    snprintf(fn, sizeof fn, "%s.enc.in.f32", name);
    float *x = slurp(fn, &nx);
    snprintf(fn, sizeof fn, "%s.enc.blocks", name);
    uint8_t *want = slurp(fn, &nb);
    const int64_t n = (int64_t)(nx / 4);
    assert_int_equal(bt_ggml_row_size(type, n), nb);
    uint8_t *got = malloc(nb);
    assert_int_equal(bt_ggml_quantize(type, x, got, n), BT_OK);
    size_t bad = 0;
    for (size_t i = 0; i < nb; i++)
        if (got[i] != want[i]) {
            if (bad < 5)
                print_error("%s encoder: byte %zu (block %zu): got 0x%02x want 0x%02x\n", name, i,
                            i / bt_ggml_block_bytes(type), got[i], want[i]);
            bad++;
        }
    assert_int_equal(bad, 0);
    free(got);
    free(x);
    free(want);
}

static void test_encoders_vs_ggufpy(void **s) {
    (void)s;
    const int types[] = {BT_GGML_F16, BT_GGML_BF16, BT_GGML_Q4_0, BT_GGML_Q4_1,
                         BT_GGML_Q5_0, BT_GGML_Q5_1, BT_GGML_Q8_0};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) check_encoder_fixture(types[i]);
}

/* K-quant encoders (round to nearest, no scale search): the blocks decode (with the
 * fixture-checked decoders) to within the quantisation step of every group. Per element: half a
 * step of the group, plus what rounding the group's scale (and min) code against the fp16
 * super-block scale costs at the group's extreme (at most (levels + 1) half code steps), plus a
 * small slack for the fp16 rounding of d; and the relative rms error must be what the bit width
 * allows. The symmetric types (Q3_K, Q6_K) reach one step less on the side opposite their group's
 * extreme, so there the bound is a full step. */
static void test_kquant_encoders_roundtrip(void **s) {
    (void)s;
    const struct {
        int type, gsize, levels;
        double rms_max; /* relative rms error ceiling for N(0,1) data */
    } ks[] = {{BT_GGML_Q2_K, 16, 3, 0.40}, {BT_GGML_Q3_K, 16, 7, 0.20},
              {BT_GGML_Q4_K, 32, 15, 0.10}, {BT_GGML_Q5_K, 32, 31, 0.05},
              {BT_GGML_Q6_K, 16, 63, 0.025}};
    enum { N = 256 * 48 };
    float *x = malloc(N * 4), *y = malloc(N * 4);
    uint8_t *b = malloc(N);
    uint64_t st = 0x1234567;
    for (size_t k = 0; k < sizeof ks / sizeof ks[0]; k++) {
        for (int i = 0; i < N; i++) {
            /* Box-Muller from a xorshift stream; blocks of different scales, a zero block, a
             * constant block and an all-negative block */
            st ^= st << 13, st ^= st >> 7, st ^= st << 17;
            double u1 = ((st >> 11) + 0.5) / 9007199254740992.0;
            st ^= st << 13, st ^= st >> 7, st ^= st << 17;
            double u2 = (st >> 11) / 9007199254740992.0;
            double z = sqrt(-2 * log(u1)) * cos(6.283185307179586 * u2);
            x[i] = (float)(z * pow(2.0, (i / 256) % 7 - 3));
        }
        for (int i = 0; i < 256; i++) x[i] = 0.0f, x[256 + i] = 0.75f, x[512 + i] = -fabsf(x[512 + i]);
        const int t = ks[k].type;
        assert_int_equal(bt_ggml_quantize(t, x, b, N), BT_OK);
        assert_int_equal(bt_ggml_dequantize(t, b, y, N), BT_OK);
        for (int i = 0; i < 256; i++) assert_true(y[i] == 0.0f);
        double num = 0, den = 0;
        for (int g = 0; g < N / ks[k].gsize; g++) {
            float lo = 0, hi = 0, amax = 0;
            for (int l = 0; l < ks[k].gsize; l++) {
                float v = x[g * ks[k].gsize + l];
                lo = v < lo ? v : lo;
                hi = v > hi ? v : hi;
                amax = fabsf(v) > amax ? fabsf(v) : amax;
            }
            /* a step of the group (asymmetric: range / levels; symmetric: 2 amax / (levels+1)) and
             * the largest group of the super-block bounds the code rounding */
            float sb_lo = 0, sb_hi = 0;
            const int sb = g * ks[k].gsize / 256 * 256;
            for (int l = 0; l < 256; l++) {
                sb_lo = x[sb + l] < sb_lo ? x[sb + l] : sb_lo;
                sb_hi = x[sb + l] > sb_hi ? x[sb + l] : sb_hi;
            }
            /* asymmetric types (Q2_K, Q4_K, Q5_K) spread [min(0, lo), hi] over `levels` steps;
             * symmetric ones (Q3_K, Q6_K) put the extreme at -(levels+1)/2 steps */
            const int sym = t == BT_GGML_Q3_K || t == BT_GGML_Q6_K;
            const double step = sym ? 2.0 * amax / (ks[k].levels + 1)
                                    : (double)(hi - lo) / ks[k].levels;
            const double sb_step = (double)(sb_hi - sb_lo) / ks[k].levels;
            const double code_step = sb_step / (t == BT_GGML_Q2_K ? 15 : t == BT_GGML_Q6_K ? 127 : 31);
            /* symmetric: the side opposite the extreme reaches one step less (q in [-4, 3]), so a
             * value there may be clipped by up to a full step */
            const double bound = (sym ? 1.0 : 0.5) * step + (ks[k].levels + 1) * code_step +
                                 1e-3 * sb_step;
            for (int l = 0; l < ks[k].gsize; l++) {
                const int i = g * ks[k].gsize + l;
                const double e = fabs((double)x[i] - (double)y[i]);
                if (e > bound)
                    fail_msg("%s: element %d: x %g decoded %g: error %g > bound %g (group step %g)",
                             bt_ggml_type_name(t), i, x[i], y[i], e, bound, step);
                num += e * e;
                den += (double)x[i] * x[i];
            }
        }
        const double rel = sqrt(num / den);
        print_message("%s: relative rms error %.4f (ceiling %.3f)\n", bt_ggml_type_name(t), rel,
                      ks[k].rms_max);
        assert_true(rel < ks[k].rms_max);
    }
    assert_int_equal(bt_ggml_quantize(BT_GGML_Q4_K, x, b, 255), BT_ERR_INVALID);
    assert_int_equal(bt_ggml_quantize(BT_GGML_Q8_K, x, b, 256), BT_ERR_UNSUPPORTED);
    assert_int_equal(bt_ggml_quantize(BT_GGML_Q4_0, NULL, b, 32), BT_ERR_INVALID);
    free(x);
    free(y);
    free(b);
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
        cmocka_unit_test(test_fixture_q2_k),  cmocka_unit_test(test_fixture_q3_k),
        cmocka_unit_test(test_encoders_vs_ggufpy), cmocka_unit_test(test_kquant_encoders_roundtrip),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
