/* ggml block formats (dequantisation) and 16-bit float conversions.
 * Block layouts and formulas match ggml/src/ggml-quants.c (dequantize_row_*) and the Python
 * reference gguf-py/gguf/quants.py: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (block 32), Q4_K, Q5_K, Q6_K
 * (super-block 256), F16, BF16, F32. */
#ifndef BT_QUANT_H
#define BT_QUANT_H
#include <stdint.h>
#include <stddef.h>

/* IEEE half <-> float (round-to-nearest-even; inf/nan preserved). */
float bt_fp16_to_fp32(uint16_t h);
uint16_t bt_fp32_to_fp16(float f);
/* bfloat16 <-> float (round-to-nearest-even as torch does; nan stays nan). */
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
/* Dequantise n elements (n a multiple of the block size) from src into dst (fp32).
 * BT_ERR_UNSUPPORTED for unknown types, BT_ERR_INVALID for a bad n. */
int bt_ggml_dequantize(int type, const void *src, float *dst, int64_t n);

#endif
