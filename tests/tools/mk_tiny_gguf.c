/* mk_tiny_gguf: write a tiny random Llama-architecture GGUF for tests.
 *
 *   mk_tiny_gguf --out PATH --tokenizer-from MODEL.gguf [--layers 2] [--hidden 64] [--heads 4]
 *                [--kv-heads 2] [--ffn 128] [--seed 1] [--tied 1] [--ctx 2048]
 *                [--rope-base 10000] [--eps 1e-5] [--type F32] [--embd-type F32] [--ffn-type T]
 *                [--name NAME]
 *
 * The file (metadata, tensor names and shapes, values) is tests/unit/util/tiny_gguf.h's: every
 * "tokenizer.*" key of MODEL.gguf is copied verbatim, so the vocabulary is the real one (49152
 * tokens for SmolLM2); --rope-base defaults to MODEL's llama.rope.freq_base when present (else
 * 10000). --type is the ggml type of the seven linears of every layer, --embd-type that of
 * token_embd (and output): F32 (default), F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K,
 * Q4_K, Q5_K, Q6_K (common/quant.h bt_ggml_quantize; K-quants need hidden and ffn multiples of
 * 256, the others multiples of 32); --ffn-type (default --type's) that of ffn_gate / ffn_up /
 * ffn_down, for a file mixing two block types as llama.cpp's _M files do. --name sets
 * general.name (default barq-tiny-llama): llama.cpp gives a "phi-3" name's special tokens RSTRIP. Norms stay F32, as llama.cpp keeps them. */
#include <getopt.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "common/gguf.h"
#include "common/quant.h"
#include "tests/unit/util/tiny_gguf.h"

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

/* The usage text on f (stdout for --help, stderr for a usage error). */
static void usage(FILE *f) {
    fprintf(f,
            "usage: mk_tiny_gguf --out PATH --tokenizer-from MODEL.gguf [--layers 2] "
            "[--hidden 64] [--heads 4] [--kv-heads 2] [--ffn 128] [--seed 1] [--tied 1] "
            "[--ctx 2048] [--rope-base F] [--eps 1e-5] [--type F32] [--embd-type F32] [--ffn-type T] [--name NAME]\n");
}

/* a ggml type name with an encoder ("Q4_K") -> BT_GGML_*; -1 (message printed) otherwise */
static int parse_type(const char *flag, const char *v) {
    static const int types[] = {BT_GGML_F32,  BT_GGML_F16,  BT_GGML_BF16, BT_GGML_Q4_0,
                                BT_GGML_Q4_1, BT_GGML_Q5_0, BT_GGML_Q5_1, BT_GGML_Q8_0,
                                BT_GGML_Q2_K, BT_GGML_Q3_K, BT_GGML_Q4_K, BT_GGML_Q5_K,
                                BT_GGML_Q6_K};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
        if (!strcmp(v, bt_ggml_type_name(types[i]))) return types[i];
    fprintf(stderr, "mk_tiny_gguf: %s %s: want F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, "
                    "Q3_K, Q4_K, Q5_K or Q6_K\n", flag, v);
    return -1;
}

int main(int argc, char **argv) {
    const char *out = NULL, *tok = NULL, *name = NULL;
    long long layers = 2, hidden = 64, heads = 4, kv_heads = 2, ffn = 128, seed = 1, tied = 1,
              ctx = 2048;
    double rope_base = 0, eps = 1e-5;
    int type = BT_GGML_F32, embd_type = BT_GGML_F32, ffn_type = -1;
    static const struct option lopts[] = {
        {"out", required_argument, NULL, 'o'},       {"tokenizer-from", required_argument, NULL, 'k'},
        {"layers", required_argument, NULL, 'L'},    {"hidden", required_argument, NULL, 'D'},
        {"heads", required_argument, NULL, 'H'},     {"kv-heads", required_argument, NULL, 'K'},
        {"ffn", required_argument, NULL, 'F'},       {"seed", required_argument, NULL, 's'},
        {"tied", required_argument, NULL, 't'},      {"ctx", required_argument, NULL, 'c'},
        {"rope-base", required_argument, NULL, 'r'}, {"eps", required_argument, NULL, 'e'},
        {"type", required_argument, NULL, 'y'},      {"embd-type", required_argument, NULL, 'E'},
        {"ffn-type", required_argument, NULL, 'f'},  {"help", no_argument, NULL, 'h'},
        {"name", required_argument, NULL, 'n'},
        {NULL, 0, NULL, 0}};
    int c, li = 0;
    while ((c = getopt_long(argc, argv, "h", lopts, &li)) != -1) {
        char a[32]; /* the flag as typed in full, for the value checks' messages */
        snprintf(a, sizeof a, "--%s", c == '?' || c == 'h' ? "" : lopts[li].name);
        const char *v = optarg;
        int bad = 0;
        switch (c) {
        case 'o': out = v; break;
        case 'k': tok = v; break;
        case 'L': bad = parse_int(a, v, 1, 512, &layers); break;
        case 'D': bad = parse_int(a, v, 2, 65536, &hidden); break;
        case 'H': bad = parse_int(a, v, 1, 1024, &heads); break;
        case 'K': bad = parse_int(a, v, 1, 1024, &kv_heads); break;
        case 'F': bad = parse_int(a, v, 1, 1 << 20, &ffn); break;
        case 's': bad = parse_int(a, v, 0, INT64_MAX, &seed); break;
        case 't': bad = parse_int(a, v, 0, 1, &tied); break;
        case 'c': bad = parse_int(a, v, 1, 1 << 24, &ctx); break;
        case 'r': bad = parse_float(a, v, &rope_base); break;
        case 'e': bad = parse_float(a, v, &eps); break;
        case 'y': bad = (type = parse_type(a, v)) < 0; break;
        case 'E': bad = (embd_type = parse_type(a, v)) < 0; break;
        case 'f': bad = (ffn_type = parse_type(a, v)) < 0; break;
        case 'n': name = v; break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
        if (bad) return 2;
    }
    if (optind != argc) {
        fprintf(stderr, "mk_tiny_gguf: unexpected argument %s\n", argv[optind]);
        usage(stderr);
        return 2;
    }
    if (!out || !tok) {
        usage(stderr);
        return 2;
    }
    if (ffn_type == BT_GGML_F32 && type != BT_GGML_F32) { /* tu_tiny_spec's 0 means "as --type" */
        fprintf(stderr, "mk_tiny_gguf: --ffn-type F32 needs --type F32\n");
        return 2;
    }
    bt_gguf *src;
    int rc = bt_gguf_open(&src, tok);
    if (rc) {
        fprintf(stderr, "mk_tiny_gguf: %s\n", bt_last_error());
        return 1;
    }
    tu_tiny_spec sp = tu_tiny_default();
    sp.layers = (int)layers;
    sp.hidden = (int)hidden;
    sp.heads = (int)heads;
    sp.kv_heads = (int)kv_heads;
    sp.ffn = (int)ffn;
    sp.tied = (int)tied;
    sp.ctx = (int)ctx;
    sp.type = type;
    sp.embd_type = embd_type;
    sp.ffn_type = ffn_type < 0 ? type : ffn_type;
    sp.seed = (uint64_t)seed;
    sp.rope_base = rope_base;
    sp.eps = eps;
    sp.name = name;
    rc = tu_tiny_gguf_write(out, &sp, src);
    if (rc) fprintf(stderr, "mk_tiny_gguf: %s\n", bt_last_error());
    bt_gguf_close(src);
    return rc == BT_ERR_INVALID ? 2 : rc ? 1 : 0;
}
