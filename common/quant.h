/* ggml block formats (dequantisation) and 16-bit float conversions.
 * Block layouts and formulas match ggml/src/ggml-quants.c (dequantize_row_*) and the Python
 * reference gguf-py/gguf/quants.py: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (block 32), Q4_K, Q5_K, Q6_K
 * (super-block 256), F16, BF16, F32. */
#ifndef BT_QUANT_H
#define BT_QUANT_H
#include <stdint.h>
#include <stddef.h>

/* IEEE half <-> float. half -> float is exact (subnormals included); float -> half rounds to
 * nearest even, overflows (>= 65520) to inf, flushes below 2^-25 to zero, keeps nan (quieted,
 * top payload bits kept) — matches numpy astype(float16). */
float bt_fp16_to_fp32(uint16_t h);
uint16_t bt_fp32_to_fp16(float f);
/* bfloat16 <-> float (round-to-nearest-even as torch does; nan stays nan, quieted: (u>>16)|0x40,
 * ggml-impl.h ggml_compute_fp32_to_bf16). bf16 -> float is exact (h << 16). */
float bt_bf16_to_fp32(uint16_t h);
uint16_t bt_fp32_to_bf16(float f);

/* Name of a ggml type ("Q4_1"), "?" if unknown. */
const char *bt_ggml_type_name(int type);
/* Elements per block (1 for F32/F16/BF16), 0 if unsupported. */
int64_t bt_ggml_block_elems(int type);
/* Bytes per block, 0 if unsupported. */
size_t bt_ggml_block_bytes(int type);
/* Bytes for a row of ne0 elements; 0 if the type is unsupported or ne0 is not a multiple of
 * the block size. */
size_t bt_ggml_row_size(int type, int64_t ne0);
/* Dequantise n elements (n a multiple of the block size) from src (bt_ggml_row_size(type, n)
 * bytes, any alignment) into dst (n floats, caller-owned). Bit-identical to gguf-py
 * quants.dequantize (tests/fixtures/quant). BT_ERR_UNSUPPORTED for unknown types or types
 * without a decoder, BT_ERR_INVALID for a bad n or NULL buffers. */
int bt_ggml_dequantize(int type, const void *src, float *dst, int64_t n);
/* 1 if bt_ggml_dequantize supports `type` (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
 * Q5_K, Q6_K), else 0. Q8_1, Q2_K, Q3_K, Q8_K have known sizes (so GGUF files holding them open)
 * but cannot be dequantised. */
int bt_ggml_can_dequantize(int type);

#endif
