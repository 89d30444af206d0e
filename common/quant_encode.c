/* ggml block encoders (bt_ggml_quantize, see quant.h).
 *
 * Sources:
 *   - ggml/src/ggml-common.h: the block layouts (same as the decoders in quant.c).
 *   - ggml/src/ggml-quants.c quantize_row_q4_0_ref .. quantize_row_q8_0_ref and gguf-py
 *     gguf/quants.py (gguf 0.17.1) Q4_0..Q8_0 quantize_blocks: the block-32 encoders below follow
 *     gguf-py operation for operation (its Q4_0 / Q5_0 add the offset in float64 and round the sum
 *     to float32 before truncating, "depends on FMA" in its comment; we do the same), so the
 *     blocks are bit-identical to gguf-py's (tests/fixtures/quant/<T>.enc.*).
 *   - The K-quant encoders are plain round-to-nearest on the ggml layouts (quant.h says why they
 *     are not llama.cpp's scale search). Every group (16 or 32 consecutive elements) gets the
 *     scale (and, for the asymmetric types, the min) that covers its range; the group scales are
 *     rounded to their 4/6/8-bit codes against the super-block's fp16 d (and dmin), and the
 *     elements are rounded against the decoded group scale, so decode(encode(x)) is x up to
 *     half a quantisation step plus the scale rounding.
 * Compiled in ISO C mode (no FMA contraction), like quant.c. */
#include <math.h>
#include <string.h>

#include "common/bt_common.h"
#include "common/gguf.h"
#include "common/quant.h"

static inline void put_f16(uint8_t *p, float f) {
    const uint16_t h = bt_fp32_to_fp16(f);
    memcpy(p, &h, 2);
}
static inline float f16_round(float f) { return bt_fp16_to_fp32(bt_fp32_to_fp16(f)); }

/* clamp(v, lo, hi) of a float that may be NaN (-> lo), as an int */
static inline int clampi(float v, int lo, int hi) {
    if (!(v >= (float)lo)) return lo;
    if (v > (float)hi) return hi;
    return (int)v;
}
/* round half away from zero (numpy np_roundf / C roundf), clamped to [lo, hi] */
static inline int round_clamp(float v, int lo, int hi) { return clampi(roundf(v), lo, hi); }

/* the element of largest magnitude, with its sign (first one on ties: numpy argmax, ggml) */
static float signed_absmax(const float *x, int n) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < n; j++)
        if (amax < fabsf(x[j])) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    return max;
}

static void min_max(const float *x, int n, float *mn, float *mx) {
    float lo = x[0], hi = x[0];
    for (int j = 1; j < n; j++) {
        lo = x[j] < lo ? x[j] : lo;
        hi = x[j] > hi ? x[j] : hi;
    }
    *mn = lo;
    *mx = hi;
}

/* ---------------------------------------------------------------- block 32 (ggml reference) */

/* The nibbles (and, five != 0, the 5th bits) of a block-32 type: qs[j] holds element j in its
 * low and element j + 16 in its high nibble; bit j of the 32-bit qh is element j's 5th bit. */
static void pack_q32(uint8_t *qs, uint8_t *qh, const int *q, int five) {
    uint32_t h = 0;
    for (int j = 0; j < 32; j++) h |= (uint32_t)((q[j] >> 4) & 1) << j;
    if (five) memcpy(qh, &h, 4);
    for (int j = 0; j < 16; j++) qs[j] = (uint8_t)((q[j] & 0xF) | ((q[j + 16] & 0xF) << 4));
}

/* Q4_0 / Q5_0 (five): d = max / -2^(bits-1), q = trunc(f32(f64(x) * f64(1/d) + 2^(bits-1) + 0.5)),
 * clamped to [0, 2^bits - 1]; blocks {d; (qh[4]); qs[16]} */
static void enc_x_0(const float *x, uint8_t *b, int five) {
    const float half = five ? 16.0f : 8.0f;
    const float d = signed_absmax(x, 32) / -half;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    put_f16(b, d);
    int q[32];
    for (int j = 0; j < 32; j++)
        q[j] = clampi(truncf((float)((double)x[j] * (double)id + ((double)half + 0.5))), 0,
                      five ? 31 : 15);
    pack_q32(b + (five ? 6 : 2), b + 2, q, five);
}

/* Q4_1 / Q5_1 (five): d = (max - min) / (2^bits - 1), q = trunc((x - min) * (1/d) + 0.5f) (fp32
 * operations), clamped; blocks {d; m = min; (qh[4]); qs[16]} */
static void enc_x_1(const float *x, uint8_t *b, int five) {
    float mn, mx;
    min_max(x, 32, &mn, &mx);
    const float d = (mx - mn) / (five ? 31.0f : 15.0f);
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    put_f16(b, d);
    put_f16(b + 2, mn);
    int q[32];
    for (int j = 0; j < 32; j++) q[j] = clampi(truncf((x[j] - mn) * id + 0.5f), 0, five ? 31 : 15);
    pack_q32(b + (five ? 8 : 4), b + 4, q, five);
}

static void enc_q4_0(const float *x, uint8_t *b) { enc_x_0(x, b, 0); }
static void enc_q5_0(const float *x, uint8_t *b) { enc_x_0(x, b, 1); }
static void enc_q4_1(const float *x, uint8_t *b) { enc_x_1(x, b, 0); }
static void enc_q5_1(const float *x, uint8_t *b) { enc_x_1(x, b, 1); }

/* Q8_0: d = amax / 127, q = roundf(x * (1/d)) (a NaN element gives 0) */
static void enc_q8_0(const float *x, uint8_t *b) {
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    put_f16(b, d);
    for (int j = 0; j < 32; j++) {
        const float v = x[j] * id;
        b[2 + j] = (uint8_t)(int8_t)(v != v ? 0 : round_clamp(v, -128, 127));
    }
}

/* ---------------------------------------------------------------- K-quants (round to nearest) */

/* Asymmetric groups (Q2_K: 16 x 16, nq 3, 4-bit codes; Q4_K / Q5_K: 8 x 32, nq 15 / 31, 6-bit
 * codes): group g covers [lo, hi] with lo = min(0, min x) (the stored min m = -lo >= 0) and step
 * (hi - lo) / nq; d = max step / cmax, dmin = max m / cmax (fp16); codes sc[g], mc[g] in
 * [0, cmax]; element codes q[] in [0, nq] against dl = d * sc, ml = dmin * mc as the decoder
 * forms them (y = dl * q - ml). */
static void enc_asym_groups(const float *x, int ngroups, int gsize, int nq, int cmax, float *d_out,
                            float *dmin_out, int *sc, int *mc, int *q) {
    float step[16], mins[16], max_step = 0.0f, max_min = 0.0f;
    for (int g = 0; g < ngroups; g++) {
        float lo, hi;
        min_max(x + g * gsize, gsize, &lo, &hi);
        lo = lo < 0.0f ? lo : 0.0f;
        hi = hi > lo ? hi : lo;
        step[g] = (hi - lo) / (float)nq;
        mins[g] = -lo;
        max_step = step[g] > max_step ? step[g] : max_step;
        max_min = mins[g] > max_min ? mins[g] : max_min;
    }
    const float d = f16_round(max_step / (float)cmax), dmin = f16_round(max_min / (float)cmax);
    for (int g = 0; g < ngroups; g++) {
        sc[g] = d > 0.0f ? round_clamp(step[g] / d, 0, cmax) : 0;
        mc[g] = dmin > 0.0f ? round_clamp(mins[g] / dmin, 0, cmax) : 0;
        const float dl = d * (float)sc[g], ml = dmin * (float)mc[g];
        for (int l = 0; l < gsize; l++) {
            const float v = x[g * gsize + l];
            q[g * gsize + l] = dl > 0.0f ? round_clamp((v + ml) / dl, 0, nq) : 0;
        }
    }
    *d_out = d;
    *dmin_out = dmin;
}

/* Symmetric groups of 16 (Q3_K: q in [-4, 3], 6-bit signed codes; Q6_K: q in [-32, 31], int8
 * codes): group step = (signed absmax) / qmin so that the extreme maps to qmin (= -4 / -32, as
 * ggml's make_q3_quants / make_qx_quants orient it); d = (signed largest step) / cmin
 * (cmin = -32 / -128), fp16; codes sc[g] in [cmin, -cmin - 1]; q against dl = d * sc. */
static void enc_sym_groups16(const float *x, int qmin, int cmin, float *d_out, int *sc, int *q) {
    float step[16], max_step = 0.0f, amax_step = 0.0f;
    for (int g = 0; g < 16; g++) {
        step[g] = signed_absmax(x + 16 * g, 16) / (float)qmin;
        if (fabsf(step[g]) > amax_step) {
            amax_step = fabsf(step[g]);
            max_step = step[g];
        }
    }
    const float d = f16_round(max_step / (float)cmin);
    for (int g = 0; g < 16; g++) {
        sc[g] = d != 0.0f ? round_clamp(step[g] / d, cmin, -cmin - 1) : 0;
        const float dl = d * (float)sc[g];
        for (int l = 0; l < 16; l++)
            q[16 * g + l] = dl != 0.0f ? round_clamp(x[16 * g + l] / dl, qmin, -qmin - 1) : 0;
    }
    *d_out = d;
}

/* The 2-bit field of element e = n*128 + 32j + 16*hi + l of a Q2_K / Q3_K block: qs byte
 * n*32 + 16*hi + l, bits 2j (dequantize_row_q2_K / q3_K walk). */
static inline void put_2bit(uint8_t *qs, int e, int v) {
    const int n = e >> 7, j = (e >> 5) & 3, t = e & 31;
    qs[n * 32 + t] |= (uint8_t)((v & 3) << (2 * j));
}

/* block_q2_K {scales[16]; qs[64]; d; dmin} */
static void enc_q2_k(const float *x, uint8_t *b) {
    int sc[16], mc[16], q[256];
    float d, dmin;
    enc_asym_groups(x, 16, 16, 3, 15, &d, &dmin, sc, mc, q);
    memset(b, 0, 84);
    for (int g = 0; g < 16; g++) b[g] = (uint8_t)(sc[g] | (mc[g] << 4));
    for (int e = 0; e < 256; e++) put_2bit(b + 16, e, q[e]);
    put_f16(b + 80, d);
    put_f16(b + 82, dmin);
}

/* block_q3_K {hmask[32]; qs[64]; scales[12]; d}: q + 4 in [0, 7]; its bit 2 goes to hmask
 * (byte e % 32, bit e / 32: the decoder's mask m doubles every 32 elements), the low 2 bits to qs;
 * 6-bit scale codes sc + 32: low 4 bits in byte i % 8 (high nibble for i >= 8), high 2 bits in
 * byte 8 + i % 4 at bit 2 * (i / 4) (the inverse of quant.c q3_k_scale). */
static void enc_q3_k(const float *x, uint8_t *b) {
    int sc[16], q[256];
    float d;
    enc_sym_groups16(x, -4, -32, &d, sc, q);
    memset(b, 0, 110);
    for (int e = 0; e < 256; e++) {
        const int u = q[e] + 4;
        put_2bit(b + 32, e, u & 3);
        if (u & 4) b[e & 31] |= (uint8_t)(1u << (e >> 5));
    }
    uint8_t *s12 = b + 96;
    for (int i = 0; i < 16; i++) {
        const int v = sc[i] + 32;
        s12[i & 7] |= (uint8_t)((v & 0xF) << (i >= 8 ? 4 : 0));
        s12[8 + (i & 3)] |= (uint8_t)((v >> 4) << (2 * (i >> 2)));
    }
    put_f16(b + 108, d);
}

/* The 12 scale bytes of Q4_K / Q5_K: the inverse of get_scale_min_k4 (quant.c). */
static void pack_scale_min_k4(const int *sc, const int *mc, uint8_t *q) {
    memset(q, 0, 12);
    for (int j = 0; j < 4; j++) {
        q[j] = (uint8_t)((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
        q[j + 4] = (uint8_t)((mc[j] & 63) | ((mc[j + 4] >> 4) << 6));
        q[j + 8] = (uint8_t)((sc[j + 4] & 0xF) | ((mc[j + 4] & 0xF) << 4));
    }
}

/* block_q4_K {d; dmin; scales[12]; qs[128]} / block_q5_K {d; dmin; scales[12]; qh[32]; qs[128]}:
 * groups 2p and 2p+1 share qs[32p .. 32p+32) (low / high nibble); Q5_K's bit 4 of element l of
 * group g is bit g of qh[l]. */
static void enc_q45_k(const float *x, uint8_t *b, int five) {
    int sc[8], mc[8], q[256];
    float d, dmin;
    enc_asym_groups(x, 8, 32, five ? 31 : 15, 63, &d, &dmin, sc, mc, q);
    memset(b, 0, five ? 176 : 144);
    put_f16(b, d);
    put_f16(b + 2, dmin);
    pack_scale_min_k4(sc, mc, b + 4);
    uint8_t *qh = b + 16, *qs = b + (five ? 48 : 16);
    for (int g = 0; g < 8; g++)
        for (int l = 0; l < 32; l++) {
            const int v = q[32 * g + l];
            qs[32 * (g / 2) + l] |= (uint8_t)((v & 0xF) << (g & 1 ? 4 : 0));
            if (five && (v & 16)) qh[l] |= (uint8_t)(1u << g);
        }
}

/* block_q6_K {ql[128]; qh[64]; scales[16] int8; d}: q + 32 in [0, 63]; element
 * e = n*128 + 32p + l: low 4 bits in ql[n*64 + 32(p&1) + l] (high nibble for p >= 2), high 2
 * bits in qh[n*32 + l] at bit 2p (dequantize_row_q6_K). */
static void enc_q6_k(const float *x, uint8_t *b) {
    int sc[16], q[256];
    float d;
    enc_sym_groups16(x, -32, -128, &d, sc, q);
    memset(b, 0, 210);
    for (int e = 0; e < 256; e++) {
        const int u = q[e] + 32, n = e >> 7, p = (e >> 5) & 3, l = e & 31;
        b[n * 64 + 32 * (p & 1) + l] |= (uint8_t)((u & 0xF) << (p >= 2 ? 4 : 0));
        b[128 + n * 32 + l] |= (uint8_t)((u >> 4) << (2 * p));
    }
    for (int g = 0; g < 16; g++) b[192 + g] = (uint8_t)(int8_t)sc[g];
    put_f16(b + 208, d);
}

/* ---------------------------------------------------------------- entry point */

int bt_ggml_quantize(int type, const float *src, void *dst, int64_t n) {
    const int64_t blck = bt_ggml_block_elems(type);
    const size_t bsize = bt_ggml_block_bytes(type);
    void (*fn)(const float *, uint8_t *) = NULL;
    switch (type) {
    case BT_GGML_F32: case BT_GGML_F16: case BT_GGML_BF16: break;
    case BT_GGML_Q4_0: fn = enc_q4_0; break;
    case BT_GGML_Q4_1: fn = enc_q4_1; break;
    case BT_GGML_Q5_0: fn = enc_q5_0; break;
    case BT_GGML_Q5_1: fn = enc_q5_1; break;
    case BT_GGML_Q8_0: fn = enc_q8_0; break;
    case BT_GGML_Q2_K: fn = enc_q2_k; break;
    case BT_GGML_Q3_K: fn = enc_q3_k; break;
    case BT_GGML_Q6_K: fn = enc_q6_k; break;
    case BT_GGML_Q4_K: case BT_GGML_Q5_K: break;
    default:
        return bt_fail(BT_ERR_UNSUPPORTED, "quantize: ggml type %d (%s) has no encoder", type,
                       bt_ggml_type_name(type));
    }
    if (n < 0 || n % blck != 0)
        return bt_fail(BT_ERR_INVALID,
                       "quantize: %s: n=%lld is negative or not a multiple of the block size %lld",
                       bt_ggml_type_name(type), (long long)n, (long long)blck);
    if (n == 0) return BT_OK;
    if (!src || !dst) return bt_fail(BT_ERR_INVALID, "quantize: NULL buffer");
    uint8_t *o = dst;
    switch (type) {
    case BT_GGML_F32: memcpy(dst, src, (size_t)n * 4); return BT_OK;
    case BT_GGML_F16:
        for (int64_t i = 0; i < n; i++) put_f16(o + 2 * i, src[i]);
        return BT_OK;
    case BT_GGML_BF16:
        for (int64_t i = 0; i < n; i++) {
            const uint16_t h = bt_fp32_to_bf16(src[i]);
            memcpy(o + 2 * i, &h, 2);
        }
        return BT_OK;
    default: break;
    }
    const int64_t nb = n / blck;
    for (int64_t i = 0; i < nb; i++) {
        if (fn) fn(src + i * blck, o + (size_t)i * bsize);
        else enc_q45_k(src + i * blck, o + (size_t)i * bsize, type == BT_GGML_Q5_K);
    }
    return BT_OK;
}
