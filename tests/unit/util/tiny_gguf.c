/* Tiny random Llama GGUF writer; see tiny_gguf.h. */
#include "tests/unit/util/tiny_gguf.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "common/quant.h"

typedef struct {
    uint64_t state, inc;
} pcg32;

static uint32_t pcg32_next(pcg32 *r) {
    uint64_t old = r->state;
    r->state = old * 6364136223846793005ULL + r->inc;
    uint32_t xorshifted = (uint32_t)(((old >> 18u) ^ old) >> 27u);
    uint32_t rot = (uint32_t)(old >> 59u);
    return (xorshifted >> rot) | (xorshifted << ((-rot) & 31));
}

static void pcg32_seed(pcg32 *r, uint64_t seed, uint64_t seq) {
    r->state = 0;
    r->inc = (seq << 1u) | 1u;
    pcg32_next(r);
    r->state += seed;
    pcg32_next(r);
}

/* uniform in (0, 1): 24 random bits, never 0 */
static double uniform01(pcg32 *r) { return ((pcg32_next(r) >> 8) + 0.5) / 16777216.0; }

static void fill_normal(pcg32 *r, float *x, size_t n, double std) {
    for (size_t i = 0; i < n; i += 2) {
        double u1 = uniform01(r), u2 = uniform01(r);
        double rad = sqrt(-2.0 * log(u1)), th = 6.283185307179586 * u2;
        x[i] = (float)(std * rad * cos(th));
        if (i + 1 < n) x[i + 1] = (float)(std * rad * sin(th));
    }
}

/* One tensor [ne1 rows of ne0] in `type`: norms are 1.0 (F32), others N(0, 0.02^2) encoded. */
static int add_tensor(bt_gguf_writer *w, pcg32 *r, const char *name, uint64_t ne0, uint64_t ne1,
                      int is_norm, int type) {
    if (is_norm) type = BT_GGML_F32;
    const size_t n = (size_t)(ne0 * ne1);
    const size_t row = bt_ggml_row_size(type, (int64_t)ne0);
    if (row == 0)
        return bt_fail(BT_ERR_INVALID, "tiny gguf: %s: %llu columns is not a multiple of the %s "
                       "block size %lld", name, (unsigned long long)ne0, bt_ggml_type_name(type),
                       (long long)bt_ggml_block_elems(type));
    float *x = malloc(n * sizeof(float));
    uint8_t *b = malloc(row * ne1);
    int rc = 0;
    if (!x || !b) {
        rc = bt_fail(BT_ERR_NOMEM, "tiny gguf: out of memory for %s", name);
        goto out;
    }
    if (is_norm)
        for (size_t i = 0; i < n; i++) x[i] = 1.0f;
    else
        fill_normal(r, x, n, 0.02);
    if ((rc = bt_ggml_quantize(type, x, b, (int64_t)n))) goto out;
    uint64_t ne[2] = {ne0, ne1};
    rc = bt_gguf_w_tensor(w, name, type, ne1 == 1 ? 1 : 2, ne, b, row * ne1);
out:
    free(x);
    free(b);
    return rc;
}

/* llama.cpp LLAMA_FTYPE_* of a file whose linears are `type` (llama.h; the K-quant "_S" mixes) */
static uint32_t file_type(int type) {
    switch (type) {
    case BT_GGML_F16: return 1;
    case BT_GGML_Q4_0: return 2;
    case BT_GGML_Q4_1: return 3;
    case BT_GGML_Q8_0: return 7;
    case BT_GGML_Q5_0: return 8;
    case BT_GGML_Q5_1: return 9;
    case BT_GGML_Q2_K: return 10;
    case BT_GGML_Q3_K: return 11;
    case BT_GGML_Q4_K: return 14;
    case BT_GGML_Q5_K: return 16;
    case BT_GGML_Q6_K: return 18;
    case BT_GGML_BF16: return 32;
    default: return 0;
    }
}

tu_tiny_spec tu_tiny_default(void) {
    tu_tiny_spec s = {2, 64, 4, 2, 128, 1, 2048, 256, BT_GGML_F32, BT_GGML_F32, 1, 0.0, 1e-5, 0, NULL};
    return s;
}

int tu_tiny_gguf_write(const char *path, const tu_tiny_spec *s, const bt_gguf *tok_src) {
    if (s->layers < 1 || s->hidden < 2 || s->heads < 1 || s->kv_heads < 1 || s->ffn < 1 ||
        s->hidden % s->heads || s->heads % s->kv_heads || (s->hidden / s->heads) % 2)
        return bt_fail(BT_ERR_INVALID, "tiny gguf: need hidden %% heads == 0, heads %% kv-heads == 0 "
                       "and an even head dim (hidden %d, heads %d, kv-heads %d)", s->hidden,
                       s->heads, s->kv_heads);
    uint64_t vocab = (uint64_t)(s->vocab > 0 ? s->vocab : 256);
    double rope_base = s->rope_base;
    if (tok_src) {
        bt_str *tokens = NULL;
        int rc = bt_gguf_get_str_arr(tok_src, "tokenizer.ggml.tokens", &tokens, &vocab);
        free(tokens);
        if (rc || vocab == 0 || vocab > UINT32_MAX)
            return bt_fail(BT_ERR_INVALID, "tiny gguf: tokenizer source has no usable "
                           "tokenizer.ggml.tokens%s%s", rc ? ": " : "", rc ? bt_last_error() : "");
        double f;
        if (rope_base == 0 && bt_gguf_get_f64(tok_src, "llama.rope.freq_base", &f) == BT_OK && f > 0)
            rope_base = f;
    }
    if (rope_base == 0) rope_base = 1e4;
    const uint64_t hidden = (uint64_t)s->hidden, head_dim = hidden / (uint64_t)s->heads;
    const uint64_t kv_dim = (uint64_t)s->kv_heads * head_dim, ffn = (uint64_t)s->ffn;

    bt_gguf_writer *w = bt_gguf_writer_new();
    if (!w) return bt_fail(BT_ERR_NOMEM, "tiny gguf: out of memory");
    const char *arch = "llama", *name = s->name ? s->name : "barq-tiny-llama";
    int rc = bt_gguf_w_str(w, "general.architecture", arch, strlen(arch));
    if (!rc) rc = bt_gguf_w_str(w, "general.name", name, strlen(name));
    if (!rc) rc = bt_gguf_w_u32(w, "general.file_type", file_type(s->type));
    if (!rc) rc = bt_gguf_w_u32(w, "llama.context_length", (uint32_t)s->ctx);
    if (!rc) rc = bt_gguf_w_u32(w, "llama.embedding_length", (uint32_t)hidden);
    if (!rc) rc = bt_gguf_w_u32(w, "llama.block_count", (uint32_t)s->layers);
    if (!rc) rc = bt_gguf_w_u32(w, "llama.feed_forward_length", (uint32_t)ffn);
    if (!rc) rc = bt_gguf_w_u32(w, "llama.attention.head_count", (uint32_t)s->heads);
    if (!rc) rc = bt_gguf_w_u32(w, "llama.attention.head_count_kv", (uint32_t)s->kv_heads);
    if (!rc) rc = bt_gguf_w_f32(w, "llama.rope.freq_base", (float)rope_base);
    if (!rc) rc = bt_gguf_w_f32(w, "llama.attention.layer_norm_rms_epsilon", (float)s->eps);
    if (!rc) rc = bt_gguf_w_u32(w, "llama.vocab_size", (uint32_t)vocab);
    if (!rc) rc = bt_gguf_w_u32(w, "llama.rope.dimension_count", (uint32_t)head_dim);
    for (int64_t i = 0; !rc && tok_src && i < bt_gguf_n_kv(tok_src); i++) {
        bt_str k = bt_gguf_key_at(tok_src, i);
        if (k.len < 10 || memcmp(k.ptr, "tokenizer.", 10) != 0) continue;
        char key[512];
        if (k.len >= sizeof key) continue;
        memcpy(key, k.ptr, k.len);
        key[k.len] = 0;
        rc = bt_gguf_w_copy_kv(w, tok_src, key);
    }
    pcg32 r;
    pcg32_seed(&r, s->seed, 54);
    char tn[64];
    if (!rc) rc = add_tensor(w, &r, "token_embd.weight", hidden, vocab, 0, s->embd_type);
    for (int l = 0; !rc && l < s->layers; l++) {
        static const struct {
            const char *suffix;
            int out_kind; /* 0 hidden, 1 kv_dim, 2 ffn, 3 norm, 4 down */
        } parts[] = {{"attn_norm", 3}, {"attn_q", 0},   {"attn_k", 1},  {"attn_v", 1},
                     {"attn_output", 0}, {"ffn_norm", 3}, {"ffn_gate", 2}, {"ffn_up", 2},
                     {"ffn_down", 4}};
        for (size_t p = 0; !rc && p < sizeof parts / sizeof parts[0]; p++) {
            snprintf(tn, sizeof tn, "blk.%d.%s.weight", l, parts[p].suffix);
            uint64_t ne0 = hidden, ne1;
            switch (parts[p].out_kind) {
            case 0: ne1 = hidden; break;
            case 1: ne1 = kv_dim; break;
            case 2: ne1 = ffn; break;
            case 3: ne1 = 1; break;
            default: ne0 = ffn; ne1 = hidden; break;
            }
            int ty = parts[p].out_kind >= 2 && parts[p].out_kind != 3 && s->ffn_type ? s->ffn_type : s->type;
            rc = add_tensor(w, &r, tn, ne0, ne1, parts[p].out_kind == 3, ty);
        }
    }
    if (!rc) rc = add_tensor(w, &r, "output_norm.weight", hidden, 1, 1, BT_GGML_F32);
    if (!rc && !s->tied) rc = add_tensor(w, &r, "output.weight", hidden, vocab, 0, s->embd_type);
    if (!rc) rc = bt_gguf_writer_write(w, path);
    bt_gguf_writer_free(w);
    return rc;
}
