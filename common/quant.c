/* ggml block formats and 16-bit float conversions. See quant.h.
 *
 * Sources (all formulas follow these files exactly, including the order of float operations so
 * that results are bit-identical to the references):
 *   - ggml/src/ggml-common.h: block_q4_0 .. block_q6_K layouts and sizes (QK4_0 = 32, QK_K = 256,
 *     K_SCALE_SIZE = 12).
 *   - ggml/src/ggml-quants.c: dequantize_row_q4_0/q4_1/q5_0/q5_1/q8_0/q4_K/q5_K/q6_K and
 *     get_scale_min_k4.
 *   - gguf-py/gguf/quants.py (gguf 0.17.1): the numpy reference used by the fixtures in
 *     tests/fixtures/quant/ (tests/reference/gen_quant_fixtures.py).
 *   - ggml/src/ggml-impl.h: ggml_compute_fp32_to_bf16 (round-to-nearest-even, NaN quieted),
 *     identical to torch's c10::BFloat16 round_to_nearest_even.
 */
#include "common/quant.h"

#include "common/bt_common.h"
#include "common/bt_le.h"
#include "common/gguf.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "BarqTrain model I/O assumes a little-endian host (GGUF and safetensors are little-endian)"
#endif

/* ---------------------------------------------------------------- 16-bit floats */

static inline uint32_t f2u(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static inline float u2f(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

float bt_fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu;
    uint32_t man = h & 0x3FFu;
    if (exp == 0x1F) /* inf / nan: keep the payload */
        return u2f(sign | 0x7F800000u | (man << 13));
    if (exp == 0) {
        if (man == 0) return u2f(sign);
        /* subnormal: value = man * 2^-24, exactly representable in fp32 */
        float v = (float)man * 0x1p-24f;
        return u2f(sign | f2u(v));
    }
    return u2f(sign | ((exp + 112u) << 23) | (man << 13));
}

uint16_t bt_fp32_to_fp16(float f) {
    uint32_t u = f2u(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) { /* nan: keep the top payload bits, force quiet */
        return (uint16_t)(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
    }
    if (a >= 0x477FF000u) /* >= 65520 rounds to inf (max half is 65504) */
        return (uint16_t)(sign | 0x7C00u);
    if (a < 0x38800000u) { /* below the smallest normal half (2^-14): subnormal or zero */
        if (a < 0x33000000u) return sign; /* < 2^-25: rounds to zero (2^-25 ties to even: 0) */
        uint32_t e = a >> 23;              /* 102..112 */
        uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
        uint32_t shift = 126u - e;         /* value = m * 2^(e-150); half units are 2^-24 */
        uint32_t q = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1u);
        uint32_t halfway = 1u << (shift - 1u);
        if (rem > halfway || (rem == halfway && (q & 1u))) q++;
        return (uint16_t)(sign | q);
    }
    /* normal: rebias exponent, round the 13 dropped mantissa bits to nearest even */
    uint32_t r = a + 0xFFFu + ((a >> 13) & 1u);
    r -= (uint32_t)(127 - 15) << 23;
    return (uint16_t)(sign | (r >> 13));
}

float bt_bf16_to_fp32(uint16_t h) { return u2f((uint32_t)h << 16); }

uint16_t bt_fp32_to_bf16(float f) {
    uint32_t u = f2u(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 64u); /* quiet nan */
    return (uint16_t)((u + (0x7FFFu + ((u >> 16) & 1u))) >> 16);
}

/* ---------------------------------------------------------------- type table */

typedef struct {
    const char *name;
    int64_t blck;  /* elements per block */
    size_t bytes;  /* bytes per block */
    int dequant;   /* 1 if bt_ggml_dequantize supports it */
} type_info;

/* Sizes from ggml-common.h (static_asserts there): Q4_0 2+16, Q4_1 2*2+16, Q5_0 2+4+16,
 * Q5_1 2*2+4+16, Q8_0 2+32, Q8_1 2*2+32, Q2_K 2*2+256/16+256/4, Q3_K 2+256/4+256/8+12,
 * Q4_K 2*2+12+256/2, Q5_K 2*2+12+256/2+256/8, Q6_K 2+256/16+3*256/4, Q8_K 4+256+256/16*2.
 * The other types ggml defines (IQ*, TQ*, MXFP4, integer and F64 tensors; ggml.h enum ggml_type,
 * sizes as gguf-py constants.py GGML_QUANT_SIZES and ggml-common.h block_mxfp4) have a known size,
 * so files holding them open and their tensors can be named in an error, but no decoder. */
static const type_info *info(int type) {
    static const type_info table[] = {
        [BT_GGML_F32] = {"F32", 1, 4, 1},          [BT_GGML_F16] = {"F16", 1, 2, 1},
        [BT_GGML_Q4_0] = {"Q4_0", 32, 18, 1},      [BT_GGML_Q4_1] = {"Q4_1", 32, 20, 1},
        [BT_GGML_Q5_0] = {"Q5_0", 32, 22, 1},      [BT_GGML_Q5_1] = {"Q5_1", 32, 24, 1},
        [BT_GGML_Q8_0] = {"Q8_0", 32, 34, 1},      [BT_GGML_Q8_1] = {"Q8_1", 32, 36, 0},
        [BT_GGML_Q2_K] = {"Q2_K", 256, 84, 1},     [BT_GGML_Q3_K] = {"Q3_K", 256, 110, 1},
        [BT_GGML_Q4_K] = {"Q4_K", 256, 144, 1},    [BT_GGML_Q5_K] = {"Q5_K", 256, 176, 1},
        [BT_GGML_Q6_K] = {"Q6_K", 256, 210, 1},    [BT_GGML_Q8_K] = {"Q8_K", 256, 292, 0},
        [16] = {"IQ2_XXS", 256, 66, 0},            [17] = {"IQ2_XS", 256, 74, 0},
        [18] = {"IQ3_XXS", 256, 98, 0},            [19] = {"IQ1_S", 256, 50, 0},
        [20] = {"IQ4_NL", 32, 18, 0},              [21] = {"IQ3_S", 256, 110, 0},
        [22] = {"IQ2_S", 256, 82, 0},              [23] = {"IQ4_XS", 256, 136, 0},
        [24] = {"I8", 1, 1, 0},                    [25] = {"I16", 1, 2, 0},
        [26] = {"I32", 1, 4, 0},                   [27] = {"I64", 1, 8, 0},
        [28] = {"F64", 1, 8, 0},                   [29] = {"IQ1_M", 256, 56, 0},
        [BT_GGML_BF16] = {"BF16", 1, 2, 1},        [34] = {"TQ1_0", 256, 54, 0},
        [35] = {"TQ2_0", 256, 66, 0},              [39] = {"MXFP4", 32, 17, 0},
    };
    if (type < 0 || type >= (int)(sizeof table / sizeof table[0]) || !table[type].name)
        return NULL;
    return &table[type];
}

const char *bt_ggml_type_name(int type) {
    const type_info *t = info(type);
    return t ? t->name : "?";
}

void bt_ggml_type_mix(const int64_t weight[BT_GGML_TYPE_SLOTS], char *out, size_t cap) {
    if (!out || cap == 0) return;
    out[0] = 0;
    int64_t w[BT_GGML_TYPE_SLOTS];
    memcpy(w, weight, sizeof w);
    size_t len = 0;
    for (;;) {
        int best = -1;
        for (int t = 0; t < BT_GGML_TYPE_SLOTS; t++)
            if (w[t] > 0 && (best < 0 || w[t] > w[best])) best = t;
        if (best < 0) return;
        w[best] = 0;
        const char *name = bt_ggml_type_name(best);
        if (len + strlen(name) + 1 + 4 >= cap) { /* room for "+name", and "+..." after */
            if (len + 5 <= cap) snprintf(out + len, cap - len, "+...");
            return;
        }
        len += (size_t)snprintf(out + len, cap - len, "%s%s", len ? "+" : "", name);
    }
}

int64_t bt_ggml_block_elems(int type) {
    const type_info *t = info(type);
    return t ? t->blck : 0;
}

size_t bt_ggml_block_bytes(int type) {
    const type_info *t = info(type);
    return t ? t->bytes : 0;
}

size_t bt_ggml_row_size(int type, int64_t ne0) {
    const type_info *t = info(type);
    if (!t || ne0 < 0 || ne0 % t->blck != 0) return 0;
    uint64_t nb = (uint64_t)(ne0 / t->blck), r;
    if (__builtin_mul_overflow(nb, (uint64_t)t->bytes, &r) || r > SIZE_MAX) return 0;
    return (size_t)r;
}

const char *bt_ggml_decodable_types(void) {
    return "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, F16, BF16, F32";
}

int bt_ggml_can_dequantize(int type) {
    const type_info *t = info(type);
    return t && t->dequant;
}

/* ---------------------------------------------------------------- block decoders */

static inline float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return bt_fp16_to_fp32(h);
}

/* block_q4_0 {half d; uint8 qs[16]}: y[j] = ((qs[j]&15)-8)*d, y[j+16] = ((qs[j]>>4)-8)*d */
static void deq_q4_0(const uint8_t *b, float *y) {
    const float d = h2f(b);
    const uint8_t *qs = b + 2;
#pragma omp simd
    for (int j = 0; j < 16; j++) {
        const int x0 = (qs[j] & 0x0F) - 8;
        const int x1 = (qs[j] >> 4) - 8;
        y[j] = (float)x0 * d;
        y[j + 16] = (float)x1 * d;
    }
}

/* block_q4_1 {half d, m; uint8 qs[16]}: y = q*d + m */
static void deq_q4_1(const uint8_t *b, float *y) {
    const float d = h2f(b), m = h2f(b + 2);
    const uint8_t *qs = b + 4;
#pragma omp simd
    for (int j = 0; j < 16; j++) {
        const int x0 = qs[j] & 0x0F;
        const int x1 = qs[j] >> 4;
        y[j] = (float)x0 * d + m;
        y[j + 16] = (float)x1 * d + m;
    }
}

/* block_q5_0 {half d; uint8 qh[4]; uint8 qs[16]}: 5th bit of element j is bit j of qh; element j
 * < 16 takes the low nibble of qs[j], element j + 16 its high nibble (one loop over the 32: it
 * vectorises to full-width vectors) */
static void deq_q5_0(const uint8_t *b, float *y) {
    const float d = h2f(b);
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    const uint8_t *qs = b + 6;
#pragma omp simd
    for (int j = 0; j < 32; j++) {
        const int lo = j < 16 ? (qs[j] & 0x0F) : (qs[j - 16] >> 4);
        const int32_t x = (lo | (int)(((qh >> j) & 1u) << 4)) - 16;
        y[j] = (float)x * d;
    }
}

/* block_q5_1 {half d, m; uint8 qh[4]; uint8 qs[16]} */
static void deq_q5_1(const uint8_t *b, float *y) {
    const float d = h2f(b), m = h2f(b + 2);
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    const uint8_t *qs = b + 8;
#pragma omp simd
    for (int j = 0; j < 16; j++) {
        const uint8_t xh_0 = (uint8_t)(((qh >> (j + 0)) << 4) & 0x10);
        const uint8_t xh_1 = (uint8_t)(((qh >> (j + 12))) & 0x10);
        const int x0 = (qs[j] & 0x0F) | xh_0;
        const int x1 = (qs[j] >> 4) | xh_1;
        y[j] = (float)x0 * d + m;
        y[j + 16] = (float)x1 * d + m;
    }
}

/* block_q8_0 {half d; int8 qs[32]} */
static void deq_q8_0(const uint8_t *b, float *y) {
    const float d = h2f(b);
    const int8_t *qs = (const int8_t *)(b + 2);
#pragma omp simd
    for (int j = 0; j < 32; j++) y[j] = (float)qs[j] * d;
}

/* ggml-quants.c get_scale_min_k4: 6-bit scale/min pairs packed in 12 bytes */
static inline void get_scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4));
    }
}

/* block_q4_K {half d, dmin; uint8 scales[12]; uint8 qs[128]} */
static void deq_q4_k(const uint8_t *b, float *y) {
    const float d = h2f(b), min = h2f(b + 2);
    const uint8_t *scales = b + 4;
    const uint8_t *q = b + 16;
    int is = 0;
    uint8_t sc, m;
    for (int j = 0; j < 256; j += 64) {
        get_scale_min_k4(is + 0, scales, &sc, &m);
        const float d1 = d * sc, m1 = min * m;
        get_scale_min_k4(is + 1, scales, &sc, &m);
        const float d2 = d * sc, m2 = min * m;
#pragma omp simd
        for (int l = 0; l < 32; ++l) *y++ = d1 * (q[l] & 0xF) - m1;
#pragma omp simd
        for (int l = 0; l < 32; ++l) *y++ = d2 * (q[l] >> 4) - m2;
        q += 32;
        is += 2;
    }
}

/* block_q5_K {half d, dmin; uint8 scales[12]; uint8 qh[32]; uint8 qs[128]} */
static void deq_q5_k(const uint8_t *b, float *y) {
    const float d = h2f(b), min = h2f(b + 2);
    const uint8_t *scales = b + 4;
    const uint8_t *qh = b + 16;
    const uint8_t *ql = b + 48;
    int is = 0;
    uint8_t sc, m;
    unsigned u1 = 1, u2 = 2;
    for (int j = 0; j < 256; j += 64) {
        get_scale_min_k4(is + 0, scales, &sc, &m);
        const float d1 = d * sc, m1 = min * m;
        get_scale_min_k4(is + 1, scales, &sc, &m);
        const float d2 = d * sc, m2 = min * m;
#pragma omp simd
        for (int l = 0; l < 32; ++l) *y++ = d1 * ((ql[l] & 0xF) + (qh[l] & u1 ? 16 : 0)) - m1;
#pragma omp simd
        for (int l = 0; l < 32; ++l) *y++ = d2 * ((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
        ql += 32;
        is += 2;
        u1 <<= 2;
        u2 <<= 2;
    }
}

/* block_q6_K {uint8 ql[128]; uint8 qh[64]; int8 scales[16]; half d} */
static void deq_q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b;
    const uint8_t *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = h2f(b + 208);
    for (int n = 0; n < 256; n += 128) {
        for (int l0 = 0; l0 < 32; l0 += 16) { /* is = l / 16 constant: the loop vectorises */
            const int is = l0 / 16;
#pragma omp simd
            for (int l = l0; l < l0 + 16; ++l) {
                const int8_t q1 = (int8_t)((ql[l + 0] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                const int8_t q2 = (int8_t)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                const int8_t q3 = (int8_t)((ql[l + 0] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                const int8_t q4 = (int8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                y[l + 0] = d * sc[is + 0] * q1;
                y[l + 32] = d * sc[is + 2] * q2;
                y[l + 64] = d * sc[is + 4] * q3;
                y[l + 96] = d * sc[is + 6] * q4;
            }
        }
        y += 128;
        ql += 64;
        qh += 32;
        sc += 8;
    }
}

/* block_q2_K {uint8 scales[16]; uint8 qs[64]; half d, dmin} (ggml-quants.c dequantize_row_q2_K;
 * gguf-py Q2_K): 16 groups of 16; group scale byte: low nibble scale, high nibble min;
 * y = (d * (sc & 15)) * q - dmin * (sc >> 4), q = 2-bit field `shift` of qs[l] */
static void deq_q2_k(const uint8_t *b, float *y) {
    const uint8_t *scales = b;
    const uint8_t *q = b + 16;
    const float d = h2f(b + 80), min = h2f(b + 82);
    int is = 0;
    for (int n = 0; n < 256; n += 128) {
        int shift = 0;
        for (int j = 0; j < 4; ++j) {
            uint8_t sc = scales[is++];
            float dl = d * (sc & 0xF), ml = min * (sc >> 4);
            for (int l = 0; l < 16; ++l) *y++ = dl * ((q[l] >> shift) & 3) - ml;
            sc = scales[is++];
            dl = d * (sc & 0xF);
            ml = min * (sc >> 4);
            for (int l = 0; l < 16; ++l) *y++ = dl * ((q[l + 16] >> shift) & 3) - ml;
            shift += 2;
        }
        q += 32;
    }
}

/* Signed 6-bit group scale i (0..15) of a Q3_K block, minus 32 (ggml-quants.c
 * dequantize_row_q3_K's kmask1/kmask2 unpacking): low 4 bits in byte i % 8 (low nibble for
 * i < 8, high nibble after), high 2 bits in byte 8 + i % 4 at bit 2 * (i / 4). */
static inline int q3_k_scale(const uint8_t *sc12, int i) {
    const int lo = i < 8 ? (sc12[i] & 0xF) : (sc12[i - 8] >> 4);
    const int hi = (sc12[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
    return (lo | (hi << 4)) - 32;
}

/* block_q3_K {uint8 hmask[32]; uint8 qs[64]; uint8 scales[12]; half d} (dequantize_row_q3_K;
 * gguf-py Q3_K): y = (d * scale) * (q2 - (hmask bit set ? 0 : 4)) */
static void deq_q3_k(const uint8_t *b, float *y) {
    const uint8_t *hm = b;
    const uint8_t *q = b + 32;
    const uint8_t *sc12 = b + 96;
    const float d_all = h2f(b + 108);
    int is = 0;
    uint8_t m = 1;
    for (int n = 0; n < 256; n += 128) {
        int shift = 0;
        for (int j = 0; j < 4; ++j) {
            float dl = d_all * q3_k_scale(sc12, is++);
            for (int l = 0; l < 16; ++l)
                *y++ = dl * (((q[l] >> shift) & 3) - ((hm[l] & m) ? 0 : 4));
            dl = d_all * q3_k_scale(sc12, is++);
            for (int l = 0; l < 16; ++l)
                *y++ = dl * (((q[l + 16] >> shift) & 3) - ((hm[l + 16] & m) ? 0 : 4));
            shift += 2;
            m = (uint8_t)(m << 1);
        }
        q += 32;
    }
}

int bt_ggml_dequantize(int type, const void *src, float *dst, int64_t n) {
    const type_info *t = info(type);
    if (!t || !t->dequant)
        return bt_fail(BT_ERR_UNSUPPORTED, "dequantize: ggml type %d (%s) is not supported", type,
                       bt_ggml_type_name(type));
    if (n < 0 || n % t->blck != 0)
        return bt_fail(BT_ERR_INVALID,
                       "dequantize: %s: n=%lld is negative or not a multiple of the block size %lld",
                       t->name, (long long)n, (long long)t->blck);
    if (n == 0) return BT_OK;
    if (!src || !dst) return bt_fail(BT_ERR_INVALID, "dequantize: NULL buffer");
    const uint8_t *s = src;
    const int64_t nb = n / t->blck;
    switch (type) {
    case BT_GGML_F32: memcpy(dst, src, (size_t)n * 4); break;
    case BT_GGML_F16:
        for (int64_t i = 0; i < n; i++) dst[i] = h2f(s + 2 * i);
        break;
    case BT_GGML_BF16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, s + 2 * i, 2);
            dst[i] = bt_bf16_to_fp32(h);
        }
        break;
    default: {
        void (*fn)(const uint8_t *, float *) = NULL;
        switch (type) {
        case BT_GGML_Q4_0: fn = deq_q4_0; break;
        case BT_GGML_Q4_1: fn = deq_q4_1; break;
        case BT_GGML_Q5_0: fn = deq_q5_0; break;
        case BT_GGML_Q5_1: fn = deq_q5_1; break;
        case BT_GGML_Q8_0: fn = deq_q8_0; break;
        case BT_GGML_Q2_K: fn = deq_q2_k; break;
        case BT_GGML_Q3_K: fn = deq_q3_k; break;
        case BT_GGML_Q4_K: fn = deq_q4_k; break;
        case BT_GGML_Q5_K: fn = deq_q5_k; break;
        case BT_GGML_Q6_K: fn = deq_q6_k; break;
        default: return bt_fail(BT_ERR_UNSUPPORTED, "dequantize: type %d", type);
        }
        for (int64_t i = 0; i < nb; i++) fn(s + (size_t)i * t->bytes, dst + i * t->blck);
    } break;
    }
    return BT_OK;
}

/* ---------------------------------------------------------------- finiteness (quant.h) */

static int half_finite(const uint8_t *p) {
    uint16_t h = bt_get16(p);
    return (h & 0x7C00u) != 0x7C00u; /* exponent all ones: inf or nan */
}

int bt_ggml_all_finite(int type, const void *data, size_t nbytes, int64_t *first_elem) {
    const type_info *ti = info(type);
    if (!ti || nbytes % ti->bytes != 0 || (!data && nbytes)) return -1;
    const uint8_t *b = data;
    size_t nb = nbytes / ti->bytes;
    /* offsets of the 16-bit scales in a block (-1: none); Q8_K has an f32 scale at 0 */
    int h0 = -1, h1 = -1;
    switch (type) {
    case BT_GGML_F32:
        for (size_t i = 0; i < nb; i++) {
            float f;
            memcpy(&f, b + 4 * i, 4);
            if (!isfinite(f)) {
                if (first_elem) *first_elem = (int64_t)i;
                return 0;
            }
        }
        return 1;
    case BT_GGML_F16:
        for (size_t i = 0; i < nb; i++)
            if (!half_finite(b + 2 * i)) {
                if (first_elem) *first_elem = (int64_t)i;
                return 0;
            }
        return 1;
    case BT_GGML_BF16:
        for (size_t i = 0; i < nb; i++)
            if ((b[2 * i + 1] & 0x7F) == 0x7F && (b[2 * i] & 0x80)) { /* exponent all ones */
                if (first_elem) *first_elem = (int64_t)i;
                return 0;
            }
        return 1;
    case BT_GGML_Q4_0: case BT_GGML_Q5_0: case BT_GGML_Q8_0: h0 = 0; break;
    case BT_GGML_Q4_1: case BT_GGML_Q5_1: case BT_GGML_Q8_1: case BT_GGML_Q4_K: case BT_GGML_Q5_K:
        h0 = 0;
        h1 = 2;
        break;
    case BT_GGML_Q2_K: h0 = 80; h1 = 82; break; /* scales[16], qs[64], d, dmin */
    case BT_GGML_Q3_K: h0 = 108; break;         /* hmask[32], qs[64], scales[12], d */
    case BT_GGML_Q6_K: h0 = 208; break;         /* ql[128], qh[64], scales[16], d */
    case BT_GGML_Q8_K: break;                   /* float d first */
    default: return -1;
    }
    for (size_t i = 0; i < nb; i++) {
        const uint8_t *blk = b + i * ti->bytes;
        int ok;
        if (type == BT_GGML_Q8_K) {
            float d;
            memcpy(&d, blk, 4);
            ok = isfinite(d);
        } else {
            ok = half_finite(blk + h0) && (h1 < 0 || half_finite(blk + h1));
        }
        if (!ok) {
            if (first_elem) *first_elem = (int64_t)i * ti->blck;
            return 0;
        }
    }
    return 1;
}
