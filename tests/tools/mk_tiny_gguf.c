/* mk_tiny_gguf: write a tiny random Llama-architecture GGUF for tests.
 *
 *   mk_tiny_gguf --out PATH --tokenizer-from MODEL.gguf [--layers 2] [--hidden 64] [--heads 4]
 *                [--kv-heads 2] [--ffn 128] [--seed 1] [--tied 1] [--ctx 2048]
 *                [--rope-base 10000] [--eps 1e-5]
 *
 * Metadata: general.architecture = "llama", general.name, general.file_type = 0 (ALL_F32), and
 * the llama.* hyper-parameter keys under the names llama.cpp uses (llama-arch.cpp LLM_KV_*):
 * context_length, embedding_length, block_count, feed_forward_length, attention.head_count,
 * attention.head_count_kv, rope.freq_base (f32), attention.layer_norm_rms_epsilon (f32),
 * vocab_size, rope.dimension_count (= hidden / heads). Every "tokenizer.*" key of MODEL.gguf is
 * copied verbatim, so the vocabulary is the real one (49152 tokens for SmolLM2).
 * --rope-base defaults to MODEL's llama.rope.freq_base when present (else 10000).
 *
 * Tensors, all F32, llama.cpp names and GGUF shapes (ne[0] = input features):
 *   token_embd.weight [hidden, vocab]; blk.N.attn_norm.weight [hidden];
 *   blk.N.attn_q.weight [hidden, hidden]; blk.N.attn_k.weight / attn_v.weight
 *   [hidden, kv_heads*head_dim]; blk.N.attn_output.weight [hidden, hidden];
 *   blk.N.ffn_norm.weight [hidden]; blk.N.ffn_gate.weight / ffn_up.weight [hidden, ffn];
 *   blk.N.ffn_down.weight [ffn, hidden]; output_norm.weight [hidden];
 *   output.weight [hidden, vocab] only with --tied 0.
 * Values: norm weights 1.0; all others N(0, 0.02^2) from PCG32 (O'Neill 2014, pcg32_random_r,
 * seeded with pcg32_srandom_r(seed, 54)) through Box-Muller, so a seed gives the same file. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "common/gguf.h"

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

static int add_f32(bt_gguf_writer *w, pcg32 *r, const char *name, uint64_t ne0, uint64_t ne1,
                   int is_norm) {
    size_t n = (size_t)(ne0 * ne1);
    float *x = malloc(n * sizeof(float));
    if (!x) return bt_fail(BT_ERR_NOMEM, "mk_tiny_gguf: out of memory for %s", name);
    if (is_norm)
        for (size_t i = 0; i < n; i++) x[i] = 1.0f;
    else
        fill_normal(r, x, n, 0.02);
    uint64_t ne[2] = {ne0, ne1};
    int rc = bt_gguf_w_tensor(w, name, 0 /* F32 */, ne1 == 1 ? 1 : 2, ne, x, n * sizeof(float));
    free(x);
    return rc;
}

static int parse_int(const char *flag, const char *s, long long lo, long long hi, long long *out) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) {
        fprintf(stderr, "mk_tiny_gguf: %s %s: want an integer in [%lld, %lld]\n", flag, s, lo, hi);
        return -1;
    }
    *out = v;
    return 0;
}

static int parse_float(const char *flag, const char *s, double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v > 0) || !isfinite(v)) {
        fprintf(stderr, "mk_tiny_gguf: %s %s: want a positive number\n", flag, s);
        return -1;
    }
    *out = v;
    return 0;
}

static void usage(void) {
    fprintf(stderr,
            "usage: mk_tiny_gguf --out PATH --tokenizer-from MODEL.gguf [--layers 2] "
            "[--hidden 64] [--heads 4] [--kv-heads 2] [--ffn 128] [--seed 1] [--tied 1] "
            "[--ctx 2048] [--rope-base F] [--eps 1e-5]\n");
}

int main(int argc, char **argv) {
    const char *out = NULL, *tok = NULL;
    long long layers = 2, hidden = 64, heads = 4, kv_heads = 2, ffn = 128, seed = 1, tied = 1,
              ctx = 2048;
    double rope_base = 0, eps = 1e-5;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage();
            return 0;
        }
        if (i + 1 >= argc) {
            usage();
            return 2;
        }
        const char *v = argv[++i];
        int bad = 0;
        if (!strcmp(a, "--out")) out = v;
        else if (!strcmp(a, "--tokenizer-from")) tok = v;
        else if (!strcmp(a, "--layers")) bad = parse_int(a, v, 1, 512, &layers);
        else if (!strcmp(a, "--hidden")) bad = parse_int(a, v, 2, 65536, &hidden);
        else if (!strcmp(a, "--heads")) bad = parse_int(a, v, 1, 1024, &heads);
        else if (!strcmp(a, "--kv-heads")) bad = parse_int(a, v, 1, 1024, &kv_heads);
        else if (!strcmp(a, "--ffn")) bad = parse_int(a, v, 1, 1 << 20, &ffn);
        else if (!strcmp(a, "--seed")) bad = parse_int(a, v, 0, INT64_MAX, &seed);
        else if (!strcmp(a, "--tied")) bad = parse_int(a, v, 0, 1, &tied);
        else if (!strcmp(a, "--ctx")) bad = parse_int(a, v, 1, 1 << 24, &ctx);
        else if (!strcmp(a, "--rope-base")) bad = parse_float(a, v, &rope_base);
        else if (!strcmp(a, "--eps")) bad = parse_float(a, v, &eps);
        else {
            fprintf(stderr, "mk_tiny_gguf: unknown option %s\n", a);
            usage();
            return 2;
        }
        if (bad) return 2;
    }
    if (!out || !tok) {
        usage();
        return 2;
    }
    if (hidden % heads || heads % kv_heads || (hidden / heads) % 2) {
        fprintf(stderr, "mk_tiny_gguf: need hidden %% heads == 0, heads %% kv-heads == 0 and an "
                        "even head dim (hidden %lld, heads %lld, kv-heads %lld)\n",
                hidden, heads, kv_heads);
        return 2;
    }
    bt_gguf *src;
    int rc = bt_gguf_open(&src, tok);
    if (rc) {
        fprintf(stderr, "mk_tiny_gguf: %s\n", bt_last_error());
        return 1;
    }
    bt_str *tokens = NULL;
    uint64_t vocab = 0;
    if ((rc = bt_gguf_get_str_arr(src, "tokenizer.ggml.tokens", &tokens, &vocab)) || vocab == 0 ||
        vocab > UINT32_MAX) {
        fprintf(stderr, "mk_tiny_gguf: %s: no usable tokenizer.ggml.tokens: %s\n", tok,
                rc ? bt_last_error() : "empty or too large");
        free(tokens);
        bt_gguf_close(src);
        return 1;
    }
    free(tokens);
    if (rope_base == 0) {
        double f;
        rope_base = bt_gguf_get_f64(src, "llama.rope.freq_base", &f) == BT_OK && f > 0 ? f : 1e4;
    }
    const long long head_dim = hidden / heads, kv_dim = kv_heads * head_dim;

    bt_gguf_writer *w = bt_gguf_writer_new();
    const char *arch = "llama", *name = "barq-tiny-llama";
    rc = bt_gguf_w_str(w, "general.architecture", arch, strlen(arch));
    if (!rc) rc = bt_gguf_w_str(w, "general.name", name, strlen(name));
    if (!rc) rc = bt_gguf_w_u32(w, "general.file_type", 0);
    if (!rc) rc = bt_gguf_w_u32(w, "llama.context_length", (uint32_t)ctx);
    if (!rc) rc = bt_gguf_w_u32(w, "llama.embedding_length", (uint32_t)hidden);
    if (!rc) rc = bt_gguf_w_u32(w, "llama.block_count", (uint32_t)layers);
    if (!rc) rc = bt_gguf_w_u32(w, "llama.feed_forward_length", (uint32_t)ffn);
    if (!rc) rc = bt_gguf_w_u32(w, "llama.attention.head_count", (uint32_t)heads);
    if (!rc) rc = bt_gguf_w_u32(w, "llama.attention.head_count_kv", (uint32_t)kv_heads);
    if (!rc) rc = bt_gguf_w_f32(w, "llama.rope.freq_base", (float)rope_base);
    if (!rc) rc = bt_gguf_w_f32(w, "llama.attention.layer_norm_rms_epsilon", (float)eps);
    if (!rc) rc = bt_gguf_w_u32(w, "llama.vocab_size", (uint32_t)vocab);
    if (!rc) rc = bt_gguf_w_u32(w, "llama.rope.dimension_count", (uint32_t)head_dim);
    for (int64_t i = 0; !rc && i < bt_gguf_n_kv(src); i++) {
        bt_str k = bt_gguf_key_at(src, i);
        if (k.len < 10 || memcmp(k.ptr, "tokenizer.", 10) != 0) continue;
        char key[512];
        if (k.len >= sizeof key) continue;
        memcpy(key, k.ptr, k.len);
        key[k.len] = 0;
        rc = bt_gguf_w_copy_kv(w, src, key);
    }
    pcg32 r;
    pcg32_seed(&r, (uint64_t)seed, 54);
    char tn[64];
    if (!rc) rc = add_f32(w, &r, "token_embd.weight", (uint64_t)hidden, vocab, 0);
    for (long long l = 0; !rc && l < layers; l++) {
        static const struct {
            const char *suffix;
            int out_kind; /* 0 hidden, 1 kv_dim, 2 ffn, 3 norm, 4 down */
        } parts[] = {{"attn_norm", 3}, {"attn_q", 0},   {"attn_k", 1},  {"attn_v", 1},
                     {"attn_output", 0}, {"ffn_norm", 3}, {"ffn_gate", 2}, {"ffn_up", 2},
                     {"ffn_down", 4}};
        for (size_t p = 0; !rc && p < sizeof parts / sizeof parts[0]; p++) {
            snprintf(tn, sizeof tn, "blk.%lld.%s.weight", l, parts[p].suffix);
            uint64_t ne0 = (uint64_t)hidden, ne1;
            switch (parts[p].out_kind) {
            case 0: ne1 = (uint64_t)hidden; break;
            case 1: ne1 = (uint64_t)kv_dim; break;
            case 2: ne1 = (uint64_t)ffn; break;
            case 3: ne1 = 1; break;
            default: ne0 = (uint64_t)ffn; ne1 = (uint64_t)hidden; break;
            }
            rc = add_f32(w, &r, tn, ne0, ne1, parts[p].out_kind == 3);
        }
    }
    if (!rc) rc = add_f32(w, &r, "output_norm.weight", (uint64_t)hidden, 1, 1);
    if (!rc && !tied) rc = add_f32(w, &r, "output.weight", (uint64_t)hidden, vocab, 0);
    if (!rc) rc = bt_gguf_writer_write(w, out);
    if (rc) fprintf(stderr, "mk_tiny_gguf: %s\n", bt_last_error());
    bt_gguf_writer_free(w);
    bt_gguf_close(src);
    return rc ? 1 : 0;
}
