/* Device decoders of the ggml block formats the GPU trainer keeps as they are in the GGUF file
 * (the "GGUF-native" base): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K. Private to
 * kernels/cuda (included
 * by ggml.cu, the dequantise kernel, and nf4_gemm.cu, the fused GEMMs); device code only, no
 * shared memory, no launches (so the emulator needs no rewrite: tests/emu/cu2cpp.py --check).
 *
 * Unit of work: a CHUNK of 32 consecutive elements of one weight row starting at a column c0 that
 * is a multiple of 32 (one whole block of the 32-element types; one 32-element sub-block of the
 * 256-element K-quant super-blocks). Dec<T>::load fetches what the chunk needs from global memory
 * (16-bit / 32-bit / 128-bit loads as the block layout's alignment allows: block sizes 18, 20, 22,
 * 24, 34, 144, 176, 210 bytes keep every field 2-, 4- or 16-byte aligned when the row starts at a
 * cudaMalloc'ed base) into registers, Dec<T>::decode turns them into 16 words of two bf16 each
 * (element 2i in the low half). Splitting the two lets the GEMM issue the loads of the next step
 * before the tensor-core work of the current one, as for NF4.
 *
 * Values are bit-identical to common/quant.c bt_ggml_dequantize (ggml-quants.c dequantize_row_*,
 * gguf-py quants.py), then rounded to bf16: the same fp32 operations in the same order, each
 * rounded on its own (__fmul_rn / __fadd_rn / __fsub_rn stop nvcc contracting them into FMAs):
 *   Q4_0  (q - 8) * d                   Q4_1  q * d + m              Q8_0  q * d
 *   Q5_0  (q + 16 h - 16) * d           Q5_1  (q + 16 h) * d + m
 *   Q4_K  (d * sc) * q - dmin * m       Q5_K  (d * sc) * (q + 16 h) - dmin * m
 *   Q6_K  (d * sc) * (q - 32)
 * fp16 scales are widened exactly (ggml_h2f, the bit-level conversion of quant.c). */
#ifndef BT_KERNELS_CUDA_GGML_DECODE_H
#define BT_KERNELS_CUDA_GGML_DECODE_H
#include <cstdint>

#include "kernels/cuda/kernels_cuda.h"

/* ggml.h enum ggml_type values of the types with a device decoder */
enum { BT_CU_GGML_Q4_0 = 2, BT_CU_GGML_Q4_1 = 3, BT_CU_GGML_Q5_0 = 6, BT_CU_GGML_Q5_1 = 7,
       BT_CU_GGML_Q8_0 = 8, BT_CU_GGML_Q4_K = 12,
       BT_CU_GGML_Q5_K = 13, BT_CU_GGML_Q6_K = 14 };

/* IEEE half bits -> float, exact (subnormals, inf, NaN payload: common/quant.c bt_fp16_to_fp32) */
__device__ __forceinline__ float ggml_h2f(uint32_t h)
{
    const uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (e == 0x1fu)
        return __uint_as_float(sign | 0x7f800000u | (man << 13));
    if (e == 0) {
        const float v = (float)man * 5.9604644775390625e-08f; /* man * 2^-24, exact */
        return sign ? -v : v;
    }
    return __uint_as_float(sign | ((e + 112u) << 23) | (man << 13));
}

__device__ __forceinline__ uint32_t ggml_bf16_bits(float x)
{
    return (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(x));
}
__device__ __forceinline__ uint32_t ggml_pack2(float lo, float hi)
{
    return ggml_bf16_bits(lo) | (ggml_bf16_bits(hi) << 16);
}
__device__ __forceinline__ uint32_t ggml_ld16(const uint8_t *p)
{
    return (uint32_t)__ldg(reinterpret_cast<const unsigned short *>(p));
}
__device__ __forceinline__ uint32_t ggml_ld32(const uint8_t *p)
{
    return __ldg(reinterpret_cast<const unsigned int *>(p));
}
/* n bytes (n % 4 == 0) at a 2-byte aligned p into w[n/4] (little-endian words) */
template <int NW>
__device__ __forceinline__ void ggml_ld_words16(uint32_t *w, const uint8_t *p)
{
#pragma unroll
    for (int i = 0; i < NW; i++)
        w[i] = ggml_ld16(p + 4 * i) | (ggml_ld16(p + 4 * i + 2) << 16);
}
__device__ __forceinline__ uint32_t ggml_byte(const uint32_t *w, int i)
{
    return (w[i >> 2] >> (8 * (i & 3))) & 0xffu;
}
/* The 32 values f(0) .. f(31) of a chunk as 16 words of two bf16 (element 2i in the low half). */
template <class F>
__device__ __forceinline__ void ggml_emit(uint32_t out[16], F f)
{
#pragma unroll
    for (int i = 0; i < 16; i++)
        out[i] = ggml_pack2(f(2 * i), f(2 * i + 1));
}
/* Element e (0..31) of a block-32 4-bit type: the low nibble of qs byte e for e < 16, the high
 * nibble of byte e - 16 after. */
__device__ __forceinline__ uint32_t ggml_nib32(const uint32_t qs[4], int e)
{
    return e < 16 ? (ggml_byte(qs, e) & 15u) : (ggml_byte(qs, e - 16) >> 4);
}

template <int T> struct GgmlDec;

/* block_q4_0 {half d; uint8 qs[16]} (18 bytes): element j < 16 low nibble of qs[j], j >= 16 high
 * nibble of qs[j - 16] */
template <> struct GgmlDec<BT_CU_GGML_Q4_0> {
    static constexpr int BLCK = 32, BYTES = 18;
    struct Raw {
        float d;
        uint32_t qs[4];
    };
    __device__ static void load(Raw &r, const uint8_t *row, int c0)
    {
        const uint8_t *b = row + (size_t)(c0 / 32) * BYTES;
        r.d = ggml_h2f(ggml_ld16(b));
        ggml_ld_words16<4>(r.qs, b + 2);
    }
    __device__ static void decode(const Raw &r, uint32_t out[16])
    {
        ggml_emit(out, [&](int e) { return __fmul_rn((float)((int)ggml_nib32(r.qs, e) - 8), r.d); });
    }
};

/* block_q4_1 {half d, m; uint8 qs[16]} (20 bytes) */
template <> struct GgmlDec<BT_CU_GGML_Q4_1> {
    static constexpr int BLCK = 32, BYTES = 20;
    struct Raw {
        float d, m;
        uint32_t qs[4];
    };
    __device__ static void load(Raw &r, const uint8_t *row, int c0)
    {
        const uint8_t *b = row + (size_t)(c0 / 32) * BYTES;
        const uint32_t dm = ggml_ld32(b);
        r.d = ggml_h2f(dm & 0xffffu);
        r.m = ggml_h2f(dm >> 16);
#pragma unroll
        for (int i = 0; i < 4; i++)
            r.qs[i] = ggml_ld32(b + 4 + 4 * i);
    }
    __device__ static void decode(const Raw &r, uint32_t out[16])
    {
        ggml_emit(out, [&](int e) {
            return __fadd_rn(__fmul_rn((float)ggml_nib32(r.qs, e), r.d), r.m);
        });
    }
};

/* Element e (0..31) of a Q5 block: its 4-bit ggml_nib32 value plus bit e of qh as bit 4
 * (ggml-quants.c dequantize_row_q5_0: xh_0 = ((qh >> j) << 4) & 0x10 for j < 16,
 * xh_1 = (qh >> (j + 12)) & 0x10 for element j + 16). */
__device__ __forceinline__ uint32_t ggml_q5(const uint32_t qs[4], uint32_t qh, int e)
{
    return ggml_nib32(qs, e) | (((qh >> e) & 1u) << 4);
}

/* block_q5_0 {half d; uint8 qh[4]; uint8 qs[16]} (22 bytes: 2-byte aligned fields) */
template <> struct GgmlDec<BT_CU_GGML_Q5_0> {
    static constexpr int BLCK = 32, BYTES = 22;
    struct Raw {
        float d;
        uint32_t qh;
        uint32_t qs[4];
    };
    __device__ static void load(Raw &r, const uint8_t *row, int c0)
    {
        const uint8_t *b = row + (size_t)(c0 / 32) * BYTES;
        r.d = ggml_h2f(ggml_ld16(b));
        r.qh = ggml_ld16(b + 2) | (ggml_ld16(b + 4) << 16);
        ggml_ld_words16<4>(r.qs, b + 6);
    }
    __device__ static void decode(const Raw &r, uint32_t out[16])
    {
        ggml_emit(out, [&](int e) {
            return __fmul_rn((float)((int)ggml_q5(r.qs, r.qh, e) - 16), r.d);
        });
    }
};

/* block_q5_1 {half d, m; uint8 qh[4]; uint8 qs[16]} (24 bytes) */
template <> struct GgmlDec<BT_CU_GGML_Q5_1> {
    static constexpr int BLCK = 32, BYTES = 24;
    struct Raw {
        float d, m;
        uint32_t qh;
        uint32_t qs[4];
    };
    __device__ static void load(Raw &r, const uint8_t *row, int c0)
    {
        const uint8_t *b = row + (size_t)(c0 / 32) * BYTES;
        const uint32_t dm = ggml_ld32(b);
        r.d = ggml_h2f(dm & 0xffffu);
        r.m = ggml_h2f(dm >> 16);
        r.qh = ggml_ld32(b + 4);
#pragma unroll
        for (int i = 0; i < 4; i++)
            r.qs[i] = ggml_ld32(b + 8 + 4 * i);
    }
    __device__ static void decode(const Raw &r, uint32_t out[16])
    {
        ggml_emit(out, [&](int e) {
            return __fadd_rn(__fmul_rn((float)ggml_q5(r.qs, r.qh, e), r.d), r.m);
        });
    }
};

/* block_q8_0 {half d; int8 qs[32]} (34 bytes) */
template <> struct GgmlDec<BT_CU_GGML_Q8_0> {
    static constexpr int BLCK = 32, BYTES = 34;
    struct Raw {
        float d;
        uint32_t qs[8];
    };
    __device__ static void load(Raw &r, const uint8_t *row, int c0)
    {
        const uint8_t *b = row + (size_t)(c0 / 32) * BYTES;
        r.d = ggml_h2f(ggml_ld16(b));
        ggml_ld_words16<8>(r.qs, b + 2);
    }
    __device__ static void decode(const Raw &r, uint32_t out[16])
    {
        ggml_emit(out, [&](int e) { return __fmul_rn((float)(int8_t)ggml_byte(r.qs, e), r.d); });
    }
};

/* 6-bit scale and min of sub-block j of a Q4_K / Q5_K super-block (ggml-quants.c
 * get_scale_min_k4), from its 12 scale bytes as three little-endian words. */
__device__ __forceinline__ void ggml_scale_min_k4(const uint32_t s[3], int j, uint32_t *sc,
                                                  uint32_t *m)
{
    const uint32_t *q = s; /* byte i of the 12 = ggml_byte(q, i) */
    if (j < 4) {
        *sc = ggml_byte(q, j) & 63u;
        *m = ggml_byte(q, j + 4) & 63u;
    } else {
        *sc = (ggml_byte(q, j + 4) & 0xfu) | ((ggml_byte(q, j - 4) >> 6) << 4);
        *m = (ggml_byte(q, j + 4) >> 4) | ((ggml_byte(q, j) >> 6) << 4);
    }
}

/* Q4_K / Q5_K: d1 = d * sc, m1 = dmin * m of the chunk's sub-block j; the chunk's 32 nibbles are
 * the low (j even) or high (j odd) halves of the 32 bytes qs[32 * (j / 2) ..]. */
struct GgmlK45Raw {
    float d1, m1;
    uint32_t q[8]; /* the 32 qs bytes */
    uint32_t hbits; /* Q5_K: bit l = the 5th bit of element l */
    int hi;         /* j odd: high nibbles */
};
__device__ __forceinline__ void ggml_k45_load(GgmlK45Raw &r, const uint8_t *row, int c0, int bytes,
                                              int qs_off, bool five)
{
    const uint8_t *b = row + (size_t)(c0 / 256) * bytes;
    const int j = (c0 % 256) / 32;
    const uint32_t dd = ggml_ld32(b);
    const uint32_t s[3] = {ggml_ld32(b + 4), ggml_ld32(b + 8), ggml_ld32(b + 12)};
    uint32_t sc, m;
    ggml_scale_min_k4(s, j, &sc, &m);
    r.d1 = __fmul_rn(ggml_h2f(dd & 0xffffu), (float)sc);
    r.m1 = __fmul_rn(ggml_h2f(dd >> 16), (float)m);
    r.hi = j & 1;
    const uint4 *qp = reinterpret_cast<const uint4 *>(b + qs_off + 32 * (j / 2));
    const uint4 q0 = __ldg(qp), q1 = __ldg(qp + 1);
    r.q[0] = q0.x, r.q[1] = q0.y, r.q[2] = q0.z, r.q[3] = q0.w;
    r.q[4] = q1.x, r.q[5] = q1.y, r.q[6] = q1.z, r.q[7] = q1.w;
    r.hbits = 0;
    if (five) { /* qh[l] bit j, l = 0..31 (block_q5_K qh at byte 16) */
        const uint4 *hp = reinterpret_cast<const uint4 *>(b + 16);
        const uint4 h0 = __ldg(hp), h1 = __ldg(hp + 1);
        const uint32_t h[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
#pragma unroll
        for (int l = 0; l < 32; l++)
            r.hbits |= ((ggml_byte(h, l) >> j) & 1u) << l;
    }
}
__device__ __forceinline__ void ggml_k45_decode(const GgmlK45Raw &r, uint32_t out[16])
{
    ggml_emit(out, [&](int l) {
        const uint32_t byte = ggml_byte(r.q, l);
        const uint32_t q = (r.hi ? byte >> 4 : byte & 15u) + (((r.hbits >> l) & 1u) << 4);
        return __fsub_rn(__fmul_rn(r.d1, (float)q), r.m1);
    });
}

/* block_q4_K {half d, dmin; uint8 scales[12]; uint8 qs[128]} (144 bytes) */
template <> struct GgmlDec<BT_CU_GGML_Q4_K> {
    static constexpr int BLCK = 256, BYTES = 144;
    typedef GgmlK45Raw Raw;
    __device__ static void load(Raw &r, const uint8_t *row, int c0)
    {
        ggml_k45_load(r, row, c0, BYTES, 16, false);
    }
    __device__ static void decode(const Raw &r, uint32_t out[16]) { ggml_k45_decode(r, out); }
};

/* block_q5_K {half d, dmin; uint8 scales[12]; uint8 qh[32]; uint8 qs[128]} (176 bytes) */
template <> struct GgmlDec<BT_CU_GGML_Q5_K> {
    static constexpr int BLCK = 256, BYTES = 176;
    typedef GgmlK45Raw Raw;
    __device__ static void load(Raw &r, const uint8_t *row, int c0)
    {
        ggml_k45_load(r, row, c0, BYTES, 48, true);
    }
    __device__ static void decode(const Raw &r, uint32_t out[16]) { ggml_k45_decode(r, out); }
};

/* block_q6_K {uint8 ql[128]; uint8 qh[64]; int8 scales[16]; half d} (210 bytes). Chunk c (0..7)
 * of the super-block: half n = c / 4, part p = c % 4; element l (0..31): low 4 bits in
 * ql[64n + 32(p & 1) + l] (high nibble when p >= 2), high 2 bits in qh[32n + l] at bit 2p, scale
 * scales[8n + 2p + l / 16] (dequantize_row_q6_K). */
template <> struct GgmlDec<BT_CU_GGML_Q6_K> {
    static constexpr int BLCK = 256, BYTES = 210;
    struct Raw {
        float ds[2];    /* d * scale of elements 0..15 and 16..31 */
        uint32_t lo[4]; /* the 32 low nibbles, two per byte (element 2i low, 2i+1 high) */
        uint32_t hb[2]; /* the 32 2-bit high parts, 16 per word */
    };
    __device__ static void load(Raw &r, const uint8_t *row, int c0)
    {
        const uint8_t *b = row + (size_t)(c0 / 256) * BYTES;
        const int c = (c0 % 256) / 32, n = c / 4, p = c % 4;
        uint32_t ql[8], qh[8];
        ggml_ld_words16<8>(ql, b + 64 * n + 32 * (p & 1));
        ggml_ld_words16<8>(qh, b + 128 + 32 * n);
        const float d = ggml_h2f(ggml_ld16(b + 208));
        const uint32_t sc = ggml_ld16(b + 192 + 8 * n + 2 * p); /* scales 2p and 2p + 1 */
        r.ds[0] = __fmul_rn(d, (float)(int8_t)(sc & 0xffu));
        r.ds[1] = __fmul_rn(d, (float)(int8_t)(sc >> 8));
#pragma unroll
        for (int i = 0; i < 4; i++)
            r.lo[i] = 0;
        r.hb[0] = r.hb[1] = 0;
#pragma unroll
        for (int l = 0; l < 32; l++) {
            const uint32_t nib = (p >= 2 ? ggml_byte(ql, l) >> 4 : ggml_byte(ql, l)) & 15u;
            r.lo[l >> 3] |= nib << (4 * (l & 7));
            r.hb[l >> 4] |= ((ggml_byte(qh, l) >> (2 * p)) & 3u) << (2 * (l & 15));
        }
    }
    __device__ static void decode(const Raw &r, uint32_t out[16])
    {
        ggml_emit(out, [&](int l) {
            const int q = (int)(((r.lo[l >> 3] >> (4 * (l & 7))) & 15u) |
                                (((r.hb[l >> 4] >> (2 * (l & 15))) & 3u) << 4)) - 32;
            return __fmul_rn(r.ds[l >> 4], (float)q);
        });
    }
};

#endif
