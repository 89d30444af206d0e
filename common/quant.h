/* ggml block formats (dequantisation) and 16-bit float conversions.
 * Block layouts and formulas match ggml/src/ggml-quants.c (dequantize_row_*) and the Python
 * reference gguf-py/gguf/quants.py: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (block 32), Q2_K, Q3_K, Q4_K,
 * Q5_K, Q6_K (super-block 256), F16, BF16, F32; and encoders for the same types
 * (common/quant_encode.c, bt_ggml_quantize). */
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
/* The ggml types of a tensor mix for messages: the names of the types t < BT_GGML_TYPE_SLOTS with
 * weight[t] > 0, largest weight first (ties: lower id first), joined with '+' ("Q4_K+Q6_K"),
 * written NUL-terminated into out[cap] (truncated with "+..." when it does not fit; "" when every
 * weight is 0). weight is not modified. */
#define BT_GGML_TYPE_SLOTS 64
void bt_ggml_type_mix(const int64_t weight[BT_GGML_TYPE_SLOTS], char *out, size_t cap);
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
/* 1 if bt_ggml_dequantize supports `type` (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K,
 * Q3_K, Q4_K, Q5_K, Q6_K), else 0. The other ggml types (Q8_1, Q8_K, IQ*, TQ*, MXFP4, I8..I64,
 * F64) have known sizes (so GGUF files holding them open and their tensors can be named) but
 * cannot be dequantised. */
int bt_ggml_can_dequantize(int type);
/* Those types as a static string for messages: "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K,
 * Q5_K, Q6_K, F16, BF16, F32". */
const char *bt_ggml_decodable_types(void);

/* Encode n floats (n a multiple of the block size) from src into dst (bt_ggml_row_size(type, n)
 * bytes, caller-owned, any alignment) as ggml `type` (common/quant_encode.c):
 *   F32, F16, BF16: the conversions above (numpy astype / gguf-py BF16);
 *   Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: ggml-quants.c quantize_row_*_ref, bit-identical to gguf-py
 *     quants.quantize (tests/fixtures/quant/<T>.enc.*, gen_quant_fixtures.py);
 *   Q2_K, Q3_K, Q4_K, Q5_K, Q6_K: round-to-nearest with the layout of ggml-common.h (per-group
 *     scale/min from the group's range, the 4/6/8-bit group scales rounded against the
 *     super-block's fp16 d/dmin). NOT llama.cpp's quantize_row_*_ref, which searches the scales
 *     (make_qkx2_quants / make_q3_quants): our blocks decode with every ggml dequantiser but the
 *     error is somewhat higher. Use them for test models; real K-quant files come from llama.cpp.
 * Non-finite inputs give unspecified (but valid, finite-scaled) blocks. Errors: BT_ERR_INVALID
 * (n negative or not a multiple of the block size, NULL buffers), BT_ERR_UNSUPPORTED (any other
 * type). */
int bt_ggml_quantize(int type, const float *src, void *dst, int64_t n);

/* Whether every value encoded in data[0..nbytes) (whole blocks of `type`) is finite: F32, F16,
 * BF16 element by element; block types by their scales (a block's values are d * q (+ m / dmin
 * terms) with small integers q, so they are finite iff its f16/f32 scales are): d of Q4_0,
 * Q5_0, Q8_0, Q3_K, Q6_K; d and m of Q4_1, Q5_1; d and s of Q8_1; d and dmin of Q2_K, Q4_K,
 * Q5_K; the f32 d of Q8_K (offsets from ggml-common.h block_*). Returns 1 if all are finite, 0
 * with *first_elem (may be NULL) = the first element of the first offending value's block, -1
 * for an unknown type or a size that is not whole blocks. Writers refuse non-finite tensors
 * with it (issue 10 §4). */
int bt_ggml_all_finite(int type, const void *data, size_t nbytes, int64_t *first_elem);

#endif
