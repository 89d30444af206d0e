/* A tiny random Llama-architecture GGUF for tests (tests/tools/mk_tiny_gguf and the unit tests;
 * this file has no cmocka dependency so the tools link it too, see the Makefile's tools rule).
 *
 * Metadata: general.architecture = "llama", general.name, general.file_type (0 = ALL_F32, or
 * llama.cpp's LLAMA_FTYPE of `type`: 1 F16, 2 Q4_0, 3 Q4_1, 7 Q8_0, 8 Q5_0, 9 Q5_1, 10 Q2_K,
 * 11 Q3_K_S, 14 Q4_K_S, 16 Q5_K_S, 18 Q6_K, 32 BF16), and the llama.* hyper-parameter keys under
 * the names llama.cpp uses (llama-arch.cpp LLM_KV_*): context_length, embedding_length,
 * block_count, feed_forward_length, attention.head_count, attention.head_count_kv, rope.freq_base
 * (f32), attention.layer_norm_rms_epsilon (f32), vocab_size, rope.dimension_count (= hidden /
 * heads). With a tokenizer source every "tokenizer.*" key of it is copied verbatim (its vocabulary
 * size is then the model's); without one the model has `vocab` rows and no tokenizer.
 *
 * Tensors, llama.cpp names and GGUF shapes (ne[0] = input features):
 *   token_embd.weight [hidden, vocab] (embd_type); blk.N.attn_norm.weight [hidden] (F32);
 *   blk.N.attn_q.weight [hidden, hidden]; blk.N.attn_k.weight / attn_v.weight
 *   [hidden, kv_heads*head_dim]; blk.N.attn_output.weight [hidden, hidden];
 *   blk.N.ffn_norm.weight [hidden] (F32); blk.N.ffn_gate.weight / ffn_up.weight [hidden, ffn];
 *   blk.N.ffn_down.weight [ffn, hidden] (the seven linears in `type`); output_norm.weight [hidden]
 *   (F32); output.weight [hidden, vocab] (embd_type) only when untied.
 * Values: norm weights 1.0; all others N(0, 0.02^2) from PCG32 (O'Neill 2014, pcg32_random_r,
 * seeded with pcg32_srandom_r(seed, 54)) through Box-Muller, drawn in the tensor order above, then
 * encoded with common/quant.h bt_ggml_quantize (so a seed gives the same file, and the F32 file is
 * the one mk_tiny_gguf always wrote). Q/K rows are random, hence already "in GGUF order". */
#ifndef BT_TESTS_TINY_GGUF_H
#define BT_TESTS_TINY_GGUF_H
#include <stdint.h>

#include "common/gguf.h"

typedef struct {
    int layers, hidden, heads, kv_heads, ffn; /* hidden % heads == 0, heads % kv_heads == 0 */
    int tied;                                 /* 1: no output.weight */
    int ctx;                                  /* llama.context_length */
    int vocab;                                /* rows when tok_src is NULL */
    int type;                                 /* ggml type of the seven linears (BT_GGML_*) */
    int embd_type;                            /* ggml type of token_embd / output */
    uint64_t seed;
    double rope_base, eps;                    /* rope_base 0: tok_src's, else 10000 */
    int ffn_type;                             /* ffn_gate / ffn_up / ffn_down when not 0 (BT_GGML_F32
                                                 is 0: then `type`): two block types in one file,
                                                 as llama.cpp's _M mixes */
    const char *name;                         /* general.name (NULL: "barq-tiny-llama"); llama.cpp
                                                 reads some tokenizer attributes from it (Phi-3) */
} tu_tiny_spec;

/* The defaults: 2 layers, hidden 64, 4 heads, 2 kv heads, ffn 128, tied, ctx 2048, vocab 256,
 * F32 everywhere, seed 1, rope_base 0, eps 1e-5. */
tu_tiny_spec tu_tiny_default(void);

/* Write the file (atomically, common/gguf.h writer). tok_src: an open GGUF whose tokenizer.* keys
 * are copied (NULL: none). Errors: BT_ERR_INVALID (shape rules above, or a dimension not a
 * multiple of a type's block size, message names it), BT_ERR_UNSUPPORTED (type without an
 * encoder), BT_ERR_NOMEM, BT_ERR_IO. */
int tu_tiny_gguf_write(const char *path, const tu_tiny_spec *s, const bt_gguf *tok_src);

#endif
