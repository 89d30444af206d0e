/* The GGUF-native base (base_dtype "gguf"): frozen linears kept in their file's own ggml blocks
 * (kernels.h bt_ggml_mat, kernels/cpu/ggml.c, trainer/model/model.c).
 *
 *  - tile dequantisation bit-exact, per type: bt_ggml_mat rows and the matrices the tiled
 *    forward / input-gradient matmuls multiply equal gguf-py's quants.dequantize of the same
 *    blocks bit for bit (tests/fixtures/quant, gguf 0.17.1) -- one-hot activations make every
 *    output a single product 1 * w, exact in fp32 whatever the summation order (a -0 weight
 *    comes out as +0: the zero products it is summed with);
 *  - the matmuls (several tiles, two threads, a row permutation, beta) against bt_linear_fwd /
 *    bt_linear_bwd_x on the dequantised matrix: equal up to fp32 summation order;
 *  - forward + backward (loss and every LoRA gradient) through a GGUF-native base against the
 *    fp32-dequantised base of the same file: a tiny random Llama per type (mk_tiny_gguf's writer,
 *    tests/unit/util/tiny_gguf.c) and SmolLM2-135M-Instruct (Q4_1, $BT_MODEL);
 *  - loading: q/k rows un-permuted on the blocks (dequantised rows == the fp32 loader's rows, bit
 *    for bit), bytes / bits per weight, refusals (a type without decoder, names the tensor and the
 *    supported types; a non-finite block; base_dtype gguf for a Hugging Face directory);
 *  - the llama.cpp LoRA export applied to the very GGUF the base came from: W (the file's Q4_K
 *    blocks decoded in GGUF row order) + (alpha / r) * lora_b @ lora_a (our gguf-lora file, q/k
 *    lora_b rows in GGUF order) equals our merged GGUF export bit for bit (gguf-py's side of the
 *    same identity: tests/py/test_gguf_native.py).
 * Tolerances for the fp32-vs-fp32 comparisons (different summation orders only): loss relative
 * 1e-5, gradients relative L2 1e-4 (measured values are printed). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "common/gguf.h"
#include "common/quant.h"
#include "kernels/kernels.h"
#include "trainer/config.h"
#include "trainer/io/export.h"
#include "trainer/model/lora.h"
#include "trainer/model/model.h"
#include "trainer/loop/step.h"
#include "tests/unit/util/test_util.h"
#include "tests/unit/util/tiny_gguf.h"

#define FIXDIR "tests/fixtures/quant/"

static const int k_quant_types[] = {BT_GGML_Q4_0, BT_GGML_Q4_1, BT_GGML_Q5_0, BT_GGML_Q5_1,
                                    BT_GGML_Q8_0, BT_GGML_Q2_K, BT_GGML_Q3_K, BT_GGML_Q4_K,
                                    BT_GGML_Q5_K, BT_GGML_Q6_K};
#define N_QUANT (int)(sizeof k_quant_types / sizeof k_quant_types[0])

static uint64_t g_rng = 0x243F6A8885A308D3ull;
static float frand(void) { /* uniform in [-1, 1) */
    g_rng ^= g_rng << 13, g_rng ^= g_rng >> 7, g_rng ^= g_rng << 17;
    return (float)((g_rng >> 40) * (1.0 / 8388608.0)) - 1.0f;
}

static int same_bits(float a, float b) { return memcmp(&a, &b, sizeof a) == 0; }
/* a matmul output equals w exactly, except that a -0 weight comes out as +0 (0 * x sums) */
static int same_value(float got, float w) { return same_bits(got, w) || (got == 0.0f && w == 0.0f); }

static size_t count_value_mismatch(const float *g, const float *r, size_t n, const char *what) {
    size_t bad = 0;
    for (size_t i = 0; i < n; i++)
        if (!same_value(g[i], r[i])) {
            if (bad < 3) print_error("%s[%zu]: got %.9g want %.9g\n", what, i, g[i], r[i]);
            bad++;
        }
    return bad;
}

static size_t count_bit_mismatch(const float *g, const float *r, size_t n, const char *what) {
    size_t bad = 0;
    for (size_t i = 0; i < n; i++)
        if (!same_bits(g[i], r[i])) {
            if (bad < 3) print_error("%s[%zu]: got %.9g want %.9g\n", what, i, g[i], r[i]);
            bad++;
        }
    return bad;
}

/* ---------------------------------------------------------------- tile dequant vs gguf-py */

/* The fixture's blocks as a matrix [rows, cols] (cols = 2 blocks, or 64 elements for the float
 * types): its rows, and the tiled matmuls with one-hot activations, must give gguf-py's values. */
static void check_type_fixture(int type) {
    const char *name = bt_ggml_type_name(type);
    char fn[128];
    size_t nb, nf;
    snprintf(fn, sizeof fn, FIXDIR "%s.blocks", name);
    uint8_t *blocks = tu_slurp(fn, &nb);
    snprintf(fn, sizeof fn, FIXDIR "%s.f32", name);
    float *want = (float *)tu_slurp(fn, &nf);
    const int64_t blck = bt_ggml_block_elems(type);
    const int K = (int)(blck == 1 ? 64 : 2 * blck);
    const int N = (int)(nf / 4 / (size_t)K);
    assert_true(N >= 2);
    bt_ggml_mat w;
    assert_int_equal(bt_ggml_mat_init(&w, type, N, K, blocks, NULL), BT_OK);
    assert_int_equal(bt_ggml_mat_bytes(&w), bt_ggml_row_size(type, K) * (size_t)N);
    float *rows = malloc((size_t)N * K * sizeof(float));
    bt_ggml_mat_dequantize_rows(&w, 0, N, rows);
    assert_int_equal(count_bit_mismatch(rows, want, (size_t)N * K, name), 0);
    int finite = 1;
    for (size_t i = 0; i < (size_t)N * K; i++) finite &= isfinite(want[i]) != 0;
    if (finite) { /* the float fixtures hold inf / nan on purpose: 0 * inf would not be exact */
        float *scratch = malloc(bt_ggml_scratch_floats(K) * sizeof(float));
        /* forward, X = I_K: Y[k, n] = W[n, k] */
        float *X = calloc((size_t)K * K, sizeof(float)), *Y = malloc((size_t)K * N * sizeof(float));
        for (int k = 0; k < K; k++) X[(size_t)k * K + k] = 1.0f;
        bt_ggml_linear_fwd(Y, X, &w, K, K, N, 0.0f, scratch);
        float *wt = malloc((size_t)K * N * sizeof(float));
        for (int n = 0; n < N; n++)
            for (int k = 0; k < K; k++) wt[(size_t)k * N + n] = want[(size_t)n * K + k];
        assert_int_equal(count_value_mismatch(Y, wt, (size_t)K * N, "fwd one-hot"), 0);
        /* input gradient, dY = I_N: dX = W */
        float *dY = calloc((size_t)N * N, sizeof(float)), *dX = malloc((size_t)N * K * sizeof(float));
        for (int n = 0; n < N; n++) dY[(size_t)n * N + n] = 1.0f;
        bt_ggml_linear_bwd_x(dX, dY, &w, N, K, N, 0.0f, scratch);
        assert_int_equal(count_value_mismatch(dX, want, (size_t)N * K, "bwd_x one-hot"), 0);
        free(X), free(Y), free(wt), free(dY), free(dX), free(scratch);
    }
    free(rows);
    bt_ggml_mat_free(&w);
    free(blocks);
    free(want);
}

static void test_tile_dequant_vs_ggufpy(void **s) {
    (void)s;
    const int types[] = {BT_GGML_F32,  BT_GGML_F16,  BT_GGML_BF16, BT_GGML_Q4_0, BT_GGML_Q4_1,
                         BT_GGML_Q5_0, BT_GGML_Q5_1, BT_GGML_Q8_0, BT_GGML_Q2_K, BT_GGML_Q3_K,
                         BT_GGML_Q4_K, BT_GGML_Q5_K, BT_GGML_Q6_K};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) check_type_fixture(types[i]);
}

/* ---------------------------------------------------------------- matmuls */

/* W [N, K] of `type` from random data, stored with a row permutation; the reference is the fp32
 * matrix of the permuted rows. Two threads, N = 300 rows (shares of 160 / 140: two tiles each),
 * K = 512. One-hot activations: bit-exact; random activations: fp32 summation order only. */
static void check_matmuls(int type) {
    enum { N = 300, K = 512, M = 37 };
    const char *name = bt_ggml_type_name(type);
    float *src = malloc((size_t)N * K * sizeof(float));
    for (size_t i = 0; i < (size_t)N * K; i++) src[i] = 0.05f * frand();
    const size_t rb = bt_ggml_row_size(type, K);
    uint8_t *blocks = malloc(rb * N);
    assert_int_equal(bt_ggml_quantize(type, src, blocks, (int64_t)N * K), BT_OK);
    int32_t perm[N];
    for (int r = 0; r < N; r++) perm[r] = (int32_t)((r * 7 + 3) % N); /* 7 is prime to 300 */
    bt_ggml_mat w;
    assert_int_equal(bt_ggml_mat_init(&w, type, N, K, blocks, perm), BT_OK);
    float *Wd = malloc((size_t)N * K * sizeof(float)), *all = malloc((size_t)N * K * sizeof(float));
    assert_int_equal(bt_ggml_dequantize(type, blocks, all, (int64_t)N * K), BT_OK);
    for (int r = 0; r < N; r++) memcpy(Wd + (size_t)r * K, all + (size_t)perm[r] * K, K * sizeof(float));
    float *got = malloc((size_t)N * K * sizeof(float));
    bt_ggml_mat_dequantize_rows(&w, 0, N, got);
    assert_int_equal(count_bit_mismatch(got, Wd, (size_t)N * K, name), 0);
    bt_ggml_mat_dequantize_rows(&w, 123, 5, got); /* a row range */
    assert_int_equal(count_bit_mismatch(got, Wd + (size_t)123 * K, (size_t)5 * K, name), 0);
    /* a range past the weight is refused with the reason (it used to write nothing, silently) */
    assert_int_equal(bt_ggml_mat_dequantize_rows(&w, N - 1, 2, got), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "ggml: dequantize rows"));

    const int nthr = omp_get_max_threads();
    omp_set_num_threads(2);
    float *scratch = malloc(bt_ggml_scratch_floats(K) * sizeof(float));
    /* one-hot through several tiles and both threads */
    float *X1 = calloc((size_t)K * K, sizeof(float)), *Y1 = malloc((size_t)K * N * sizeof(float));
    for (int k = 0; k < K; k++) X1[(size_t)k * K + k] = 1.0f;
    bt_ggml_linear_fwd(Y1, X1, &w, K, K, N, 0.0f, scratch);
    size_t bad = 0;
    for (int k = 0; k < K; k++)
        for (int n = 0; n < N; n++) bad += !same_value(Y1[(size_t)k * N + n], Wd[(size_t)n * K + k]);
    assert_int_equal(bad, 0);
    /* random X, beta 0.5 into a filled Y */
    float *X = malloc((size_t)M * K * sizeof(float)), *Y = malloc((size_t)M * N * sizeof(float));
    float *Yr = malloc((size_t)M * N * sizeof(float));
    for (size_t i = 0; i < (size_t)M * K; i++) X[i] = frand();
    for (size_t i = 0; i < (size_t)M * N; i++) Y[i] = Yr[i] = frand();
    bt_ggml_linear_fwd(Y, X, &w, M, K, N, 0.5f, scratch);
    bt_linear_fwd(Yr, X, Wd, M, K, N, 0.5f);
    double maxe = 0, maxr = 0;
    for (size_t i = 0; i < (size_t)M * N; i++) {
        maxe = fmax(maxe, fabs((double)Y[i] - Yr[i]));
        maxr = fmax(maxr, fabs((double)Yr[i]));
    }
    if (maxe > 1e-5 * maxr) fail_msg("%s fwd: max error %g (max |ref| %g)", name, maxe, maxr);
    /* input gradient: dX[M, K] = dY[M, N] @ W + 0.5 dX */
    float *dY = malloc((size_t)M * N * sizeof(float)), *dX = malloc((size_t)M * K * sizeof(float));
    float *dXr = malloc((size_t)M * K * sizeof(float));
    for (size_t i = 0; i < (size_t)M * N; i++) dY[i] = frand();
    for (size_t i = 0; i < (size_t)M * K; i++) dX[i] = dXr[i] = frand();
    bt_ggml_linear_bwd_x(dX, dY, &w, M, K, N, 0.5f, scratch);
    bt_linear_bwd_x(dXr, dY, Wd, M, K, N, 0.5f);
    maxe = maxr = 0;
    for (size_t i = 0; i < (size_t)M * K; i++) {
        maxe = fmax(maxe, fabs((double)dX[i] - dXr[i]));
        maxr = fmax(maxr, fabs((double)dXr[i]));
    }
    if (maxe > 1e-5 * maxr) fail_msg("%s bwd_x: max error %g (max |ref| %g)", name, maxe, maxr);
    omp_set_num_threads(nthr);
    free(src), free(blocks), free(Wd), free(all), free(got), free(scratch), free(X1), free(Y1);
    free(X), free(Y), free(Yr), free(dY), free(dX), free(dXr);
    bt_ggml_mat_free(&w);
}

static void test_matmuls(void **s) {
    (void)s;
    for (int i = 0; i < N_QUANT; i++) check_matmuls(k_quant_types[i]);
    check_matmuls(BT_GGML_F16);
    check_matmuls(BT_GGML_BF16);
    check_matmuls(BT_GGML_F32); /* the direct sgemm path */
}

static void test_mat_errors(void **s) {
    (void)s;
    uint8_t b[4096] = {0};
    bt_ggml_mat w;
    assert_int_equal(bt_ggml_mat_init(&w, 23 /* IQ4_XS */, 2, 256, b, NULL), BT_ERR_UNSUPPORTED);
    assert_non_null(strstr(bt_last_error(), "IQ4_XS"));
    assert_non_null(strstr(bt_last_error(), "Q4_K"));
    assert_null(w.data);
    assert_int_equal(bt_ggml_mat_init(&w, BT_GGML_Q4_K, 2, 128, b, NULL), BT_ERR_INVALID);
    assert_int_equal(bt_ggml_mat_init(&w, BT_GGML_Q4_0, 0, 32, b, NULL), BT_ERR_INVALID);
    assert_int_equal(bt_ggml_mat_init(&w, BT_GGML_Q4_0, 2, 32, NULL, NULL), BT_ERR_INVALID);
    const int32_t bad_perm[2] = {0, 2};
    assert_int_equal(bt_ggml_mat_init(&w, BT_GGML_Q4_0, 2, 32, b, bad_perm), BT_ERR_INVALID);
    assert_null(w.data);
    bt_ggml_mat_free(&w);
}

/* ---------------------------------------------------------------- models */

/* fwd+bwd of one packed batch (3 documents over M tokens) through m with LoRA (B random so
 * that every A gets a gradient); returns the loss sum and a copy of the gradients. */
static double run_step(const bt_model *m, int M, float **grads, int64_t *n_params) {
    bt_lora lo;
    assert_int_equal(bt_lora_init(&lo, m, 4, 8.0, 0.0, (1u << BT_MOD_N) - 1, 0, 77), 0);
    uint64_t st = 99;
    for (int l = 0; l < m->hp.n_layer; l++)
        for (int mod = 0; mod < BT_MOD_N; mod++) {
            const bt_lora_mod *md = bt_lora_get(&lo, l, mod);
            for (int64_t i = 0; i < (int64_t)md->out * lo.r; i++) {
                st ^= st << 13, st ^= st >> 7, st ^= st << 17;
                md->B[i] = 0.02f * ((float)((st >> 40) * (1.0 / 8388608.0)) - 1.0f);
            }
        }
    bt_step_ctx *ctx;
    assert_int_equal(bt_step_ctx_new(&ctx, m, &lo, M, 0), 0);
    int32_t *ids = malloc(sizeof(int32_t) * M), *lab = malloc(sizeof(int32_t) * M);
    int32_t *pos = malloc(sizeof(int32_t) * M), cu[4] = {0, M / 3, 2 * M / 3, M};
    for (int i = 0; i < M; i++) {
        ids[i] = (int32_t)((i * 2654435761u) % (unsigned)m->hp.vocab);
        int d = i < cu[1] ? 0 : i < cu[2] ? 1 : 2;
        pos[i] = i - cu[d];
        lab[i] = pos[i] == 0 ? -100 : ids[i];
    }
    bt_microbatch mb = {.B = 1, .T = M, .input_ids = ids, .labels = lab, .position_ids = pos,
                        .cu_seqlens = cu, .n_cu = 4};
    double loss = 0;
    int nv = 0;
    bt_lora_zero_grad(&lo);
    if (bt_forward_backward(ctx, m, &lo, &mb, 1, 1.0f, 0, &loss, &nv)) fail_msg("%s", bt_last_error());
    *n_params = lo.n_params;
    *grads = malloc((size_t)lo.n_params * sizeof(float));
    memcpy(*grads, lo.grads, (size_t)lo.n_params * sizeof(float));
    free(ids), free(lab), free(pos);
    bt_step_ctx_free(ctx);
    bt_lora_free(&lo);
    return loss;
}

/* The GGUF-native model against the fp32 model of the same file: every linear dequantises to
 * the fp32 loader's matrix bit for bit (q/k un-permuted on the blocks), and one training step
 * gives the same loss and LoRA gradients up to fp32 summation order. */
static void compare_with_fp32(const char *path, int type, int M, const char *what) {
    bt_model g, f;
    bt_model_load_opts og = {BT_BASE_AUTO, 0}, of = {BT_BASE_FP32, 0};
    if (bt_model_load(&g, path, &og)) fail_msg("%s: %s", what, bt_last_error());
    if (bt_model_load(&f, path, &of)) fail_msg("%s: %s", what, bt_last_error());
    assert_int_equal(g.base_dtype, BT_BASE_GGUF);
    size_t lin_f32 = 0, lin_g = 0;
    for (int l = 0; l < g.hp.n_layer; l++)
        for (int mod = 0; mod < BT_MOD_N; mod++) {
            const bt_base_linear *a = &g.layers[l].lin[mod], *b = &f.layers[l].lin[mod];
            assert_true(a->is_gguf && !a->is_nf4 && !a->w);
            if (type >= 0) assert_int_equal(a->g.type, type);
            float *rows = malloc((size_t)a->rows * a->cols * sizeof(float));
            bt_ggml_mat_dequantize_rows(&a->g, 0, a->rows, rows);
            char nm[64];
            snprintf(nm, sizeof nm, "%s layer %d %s", what, l, bt_module_name(mod));
            assert_int_equal(count_bit_mismatch(rows, b->w, (size_t)a->rows * a->cols, nm), 0);
            free(rows);
            lin_g += bt_ggml_mat_bytes(&a->g);
            lin_f32 += (size_t)a->rows * a->cols * 4;
        }
    bt_base_info bi;
    bt_model_base_info(&g, &bi);
    assert_int_equal(bi.bytes, lin_g);
    assert_true(fabs(bi.bits_per_weight - 32.0 * (double)lin_g / (double)lin_f32) < 1e-9);
    if (type >= 0) assert_string_equal(bi.types, bt_ggml_type_name(type));
    float *gg, *gf;
    int64_t ng, nf;
    const double lg = run_step(&g, M, &gg, &ng), lf = run_step(&f, M, &gf, &nf);
    assert_int_equal(ng, nf);
    double num = 0, den = 0;
    for (int64_t i = 0; i < ng; i++) {
        num += ((double)gg[i] - gf[i]) * ((double)gg[i] - gf[i]);
        den += (double)gf[i] * gf[i];
    }
    const double rl = fabs(lg - lf) / fabs(lf), rg = sqrt(num / den);
    print_message("%-44s loss %.6f vs fp32 %.6f (rel %.1e); LoRA grads rel L2 %.1e; linears "
                  "%.2f bits/weight (%s)\n", what, lg, lf, rl, rg, bi.bits_per_weight, bi.types);
    assert_true(den > 0);
    assert_true(rl < 1e-5);
    assert_true(rg < 1e-4);
    free(gg), free(gf);
    bt_model_free(&g);
    bt_model_free(&f);
}

static void test_tiny_models_per_type(void **s) {
    (void)s;
    char dir[128], path[256];
    assert_int_equal(tu_make_tmpdir(dir, sizeof dir, "gguf_native"), 0);
    const int extra[] = {BT_GGML_F16, BT_GGML_BF16, BT_GGML_F32};
    for (int i = 0; i < N_QUANT + 3; i++) {
        const int type = i < N_QUANT ? k_quant_types[i] : extra[i - N_QUANT];
        tu_tiny_spec sp = tu_tiny_default();
        sp.hidden = 256, sp.ffn = 512, sp.heads = 4, sp.kv_heads = 2, sp.vocab = 300;
        sp.type = type;
        sp.embd_type = i % 2 ? BT_GGML_Q8_0 : BT_GGML_F16;
        sp.tied = i % 3 != 0; /* some with their own output.weight */
        sp.seed = 10 + (uint64_t)i;
        snprintf(path, sizeof path, "%s/tiny_%s.gguf", dir, bt_ggml_type_name(type));
        if (tu_tiny_gguf_write(path, &sp, NULL)) fail_msg("%s", bt_last_error());
        char what[64];
        snprintf(what, sizeof what, "tiny %s%s", bt_ggml_type_name(type), sp.tied ? "" : " untied");
        compare_with_fp32(path, type, 48, what);
    }
    assert_int_equal(tu_remove_dir(dir), 0);
}

static void test_smollm2_q4_1(void **s) {
    (void)s;
    const char *p = tu_model_path();
    if (access(p, R_OK) != 0) fail_msg("%s not readable (run `make model`)", p);
    compare_with_fp32(p, BT_GGML_Q4_1, 24, "SmolLM2-135M-Instruct Q4_1");
}

/* bt_model_to_ggml: an fp32 model turned into blocks behaves like the file-loaded one. */
static void test_to_ggml(void **s) {
    (void)s;
    bt_llama_hparams hp = {.n_layer = 1, .d_model = 64, .n_head = 4, .n_kv_head = 2,
                           .head_dim = 16, .d_ff = 96, .vocab = 50, .ctx = 64,
                           .rope_theta = 10000.f, .rms_eps = 1e-5f};
    bt_model m;
    assert_int_equal(bt_model_init_random(&m, &hp, BT_BASE_GGUF, 1, 1), BT_ERR_INVALID);
    assert_int_equal(bt_model_init_random(&m, &hp, BT_BASE_FP32, 1, 1), 0);
    assert_int_equal(bt_model_to_ggml(&m, BT_GGML_Q4_K), BT_ERR_INVALID); /* 64 % 256 */
    assert_int_equal(m.base_dtype, BT_BASE_FP32);
    assert_int_equal(bt_model_to_ggml(&m, BT_GGML_Q8_0), 0);
    assert_int_equal(m.base_dtype, BT_BASE_GGUF);
    assert_true(m.layers[0].lin[BT_MOD_DOWN].is_gguf);
    bt_base_info bi;
    bt_model_base_info(&m, &bi);
    assert_string_equal(bi.types, "Q8_0");
    assert_true(fabs(bi.bits_per_weight - 8.5) < 1e-12); /* 34 bytes per 32 weights */
    assert_int_equal(bt_model_to_ggml(&m, BT_GGML_Q8_0), BT_ERR_INVALID); /* not fp32 any more */
    bt_model_free(&m);
}

/* ---------------------------------------------------------------- refusals */

static void test_load_refusals(void **s) {
    (void)s;
    char dir[128], path[256];
    assert_int_equal(tu_make_tmpdir(dir, sizeof dir, "gguf_refuse"), 0);
    snprintf(path, sizeof path, "%s/t.gguf", dir);
    /* a Q8_0 tiny model; then its blk.1.ffn_up.weight bytes are patched in the file */
    tu_tiny_spec sp = tu_tiny_default();
    sp.type = BT_GGML_Q8_0;
    assert_int_equal(tu_tiny_gguf_write(path, &sp, NULL), 0);
    bt_gguf *gf;
    assert_int_equal(bt_gguf_open(&gf, path), 0);
    const bt_gguf_tensor *t = bt_gguf_find_tensor(gf, "blk.1.ffn_up.weight");
    assert_non_null(t);
    const uint64_t off = bt_gguf_data_offset(gf) + t->offset;
    bt_gguf_close(gf);
    FILE *f = fopen(path, "r+b");
    assert_non_null(f);
    const uint16_t nan16 = 0x7E00; /* block 0's fp16 scale d = NaN */
    assert_int_equal(fseek(f, (long)off, SEEK_SET), 0);
    assert_int_equal(fwrite(&nan16, 2, 1, f), 1);
    fclose(f);
    bt_model m;
    bt_model_load_opts og = {BT_BASE_GGUF, 0};
    assert_int_equal(bt_model_load(&m, path, &og), BT_ERR_FORMAT);
    assert_non_null(strstr(bt_last_error(), "blk.1.ffn_up.weight"));
    assert_non_null(strstr(bt_last_error(), "non-finite"));

    /* a linear of a type without a decoder (IQ4_XS, 136 bytes per 256) */
    bt_gguf_writer *w = bt_gguf_writer_new();
    const char *arch = "llama";
    assert_int_equal(bt_gguf_w_str(w, "general.architecture", arch, 5), 0);
    assert_int_equal(bt_gguf_w_u32(w, "llama.block_count", 1), 0);
    assert_int_equal(bt_gguf_w_u32(w, "llama.embedding_length", 256), 0);
    assert_int_equal(bt_gguf_w_u32(w, "llama.feed_forward_length", 256), 0);
    assert_int_equal(bt_gguf_w_u32(w, "llama.attention.head_count", 4), 0);
    assert_int_equal(bt_gguf_w_f32(w, "llama.attention.layer_norm_rms_epsilon", 1e-5f), 0);
    static float f32[256 * 64];
    static uint8_t iq[136 * 256];
    for (size_t i = 0; i < sizeof f32 / sizeof f32[0]; i++) f32[i] = 0.01f;
    const uint64_t emb[2] = {256, 64}, vec[1] = {256}, sq[2] = {256, 256};
    assert_int_equal(bt_gguf_w_tensor(w, "token_embd.weight", BT_GGML_F32, 2, emb, f32, sizeof f32), 0);
    assert_int_equal(bt_gguf_w_tensor(w, "output_norm.weight", BT_GGML_F32, 1, vec, f32, 1024), 0);
    assert_int_equal(bt_gguf_w_tensor(w, "blk.0.attn_norm.weight", BT_GGML_F32, 1, vec, f32, 1024), 0);
    assert_int_equal(bt_gguf_w_tensor(w, "blk.0.ffn_norm.weight", BT_GGML_F32, 1, vec, f32, 1024), 0);
    static const char *const lin[] = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                      "ffn_up", "ffn_down"};
    char tn[64];
    for (int j = 0; j < 7; j++) {
        snprintf(tn, sizeof tn, "blk.0.%s.weight", lin[j]);
        assert_int_equal(bt_gguf_w_tensor(w, tn, 23, 2, sq, iq, sizeof iq), 0);
    }
    snprintf(path, sizeof path, "%s/iq.gguf", dir);
    assert_int_equal(bt_gguf_writer_write(w, path), 0);
    bt_gguf_writer_free(w);
    const int dtypes[] = {BT_BASE_GGUF, BT_BASE_NF4, BT_BASE_FP32, BT_BASE_AUTO};
    for (int i = 0; i < 4; i++) {
        bt_model_load_opts o = {dtypes[i], 0};
        assert_int_equal(bt_model_load(&m, path, &o), BT_ERR_UNSUPPORTED);
        const char *e = bt_last_error();
        assert_non_null(strstr(e, "blk.0.attn_q.weight"));
        assert_non_null(strstr(e, "IQ4_XS"));
        assert_non_null(strstr(e, "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K"));
    }
    assert_int_equal(tu_remove_dir(dir), 0);

    /* base_dtype gguf for a Hugging Face directory */
    assert_int_equal(bt_model_load(&m, "tests/fixtures/hf/tiny-llama-tied", &og), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "gguf"));
    assert_int_equal(bt_model_resolve_base_dtype("tests/fixtures/hf/tiny-llama-tied", BT_BASE_AUTO),
                     BT_BASE_NF4);
    assert_int_equal(bt_model_resolve_base_dtype(tu_model_path(), BT_BASE_AUTO), BT_BASE_GGUF);
    assert_int_equal(bt_model_resolve_base_dtype(tu_model_path(), BT_BASE_FP32), BT_BASE_FP32);
}

/* ---------------------------------------------------------------- exports */

static float *tensor_f32(const bt_gguf *g, const char *name, int64_t n) {
    const bt_gguf_tensor *t = bt_gguf_find_tensor(g, name);
    if (!t) fail_msg("tensor %s missing", name);
    float *out = malloc((size_t)n * sizeof(float));
    assert_int_equal(bt_ggml_dequantize(t->type, t->data, out, n), 0);
    return out;
}

static void test_lora_export_on_base(void **s) {
    (void)s;
    char dir[128], base[256], lora[256], merged[256];
    assert_int_equal(tu_make_tmpdir(dir, sizeof dir, "gguf_lora"), 0);
    snprintf(base, sizeof base, "%s/base.gguf", dir);
    snprintf(lora, sizeof lora, "%s/lora.gguf", dir);
    snprintf(merged, sizeof merged, "%s/merged.gguf", dir);
    tu_tiny_spec sp = tu_tiny_default();
    sp.hidden = 256, sp.ffn = 512, sp.heads = 4, sp.kv_heads = 2, sp.vocab = 120;
    sp.type = BT_GGML_Q4_K, sp.embd_type = BT_GGML_Q8_0, sp.seed = 5;
    assert_int_equal(tu_tiny_gguf_write(base, &sp, NULL), 0);
    bt_model mg, mf;
    bt_model_load_opts og = {BT_BASE_GGUF, 0}, of = {BT_BASE_FP32, 0};
    assert_int_equal(bt_model_load(&mg, base, &og), 0);
    assert_int_equal(bt_model_load(&mf, base, &of), 0);
    /* an adapter as trained against the GGUF-native base: A and B random and non-zero */
    bt_lora lo;
    assert_int_equal(bt_lora_init(&lo, &mg, 4, 8.0, 0.0, (1u << BT_MOD_N) - 1, 0, 3), 0);
    for (int64_t i = 0; i < lo.n_lora; i++) lo.params[i] = 0.05f * frand();
    assert_int_equal(bt_export_gguf_lora(&mg, &lo, BT_EXPORT_F32, lora), 0);
    bt_gguf *gb, *gl, *gm;
    assert_int_equal(bt_gguf_open(&gb, base), 0);
    assert_int_equal(bt_export_gguf_merged(&mf, &lo, gb, BT_EXPORT_F32, merged), 0);
    assert_int_equal(bt_gguf_open(&gl, lora), 0);
    assert_int_equal(bt_gguf_open(&gm, merged), 0);
    double alpha;
    assert_int_equal(bt_gguf_get_f64(gl, "adapter.lora.alpha", &alpha), 0);
    static const char *const lin[BT_MOD_N] = {"attn_q", "attn_k", "attn_v", "attn_output",
                                              "ffn_gate", "ffn_up", "ffn_down"};
    char name[96], na[112], nb[112];
    size_t bad = 0, total = 0;
    for (int l = 0; l < mg.hp.n_layer; l++)
        for (int j = 0; j < BT_MOD_N; j++) {
            const int rows = mg.layers[l].lin[j].rows, cols = mg.layers[l].lin[j].cols, r = lo.r;
            snprintf(name, sizeof name, "blk.%d.%s.weight", l, lin[j]);
            snprintf(na, sizeof na, "%s.lora_a", name);
            snprintf(nb, sizeof nb, "%s.lora_b", name);
            assert_int_equal(bt_gguf_find_tensor(gb, name)->type, BT_GGML_Q4_K);
            float *W = tensor_f32(gb, name, (int64_t)rows * cols);
            float *A = tensor_f32(gl, na, (int64_t)r * cols), *B = tensor_f32(gl, nb, (int64_t)rows * r);
            float *Mg = tensor_f32(gm, name, (int64_t)rows * cols);
            const float scale = (float)(alpha / r); /* 8 / 4: exact */
            float *acc = malloc((size_t)cols * sizeof(float));
            for (int o = 0; o < rows; o++) { /* as llama.cpp: W x + scale * B (A x), merged */
                memset(acc, 0, (size_t)cols * sizeof(float));
                for (int k = 0; k < r; k++)
                    for (int c = 0; c < cols; c++) acc[c] += B[(size_t)o * r + k] * A[(size_t)k * cols + c];
                for (int c = 0; c < cols; c++) {
                    const float want = W[(size_t)o * cols + c] + acc[c] * scale;
                    bad += !same_bits(Mg[(size_t)o * cols + c], want);
                    total++;
                }
            }
            free(acc), free(W), free(A), free(B), free(Mg);
        }
    print_message("gguf-lora applied to the Q4_K base vs the merged export: %zu of %zu values "
                  "differ\n", bad, total);
    assert_int_equal(bad, 0);
    bt_gguf_close(gb), bt_gguf_close(gl), bt_gguf_close(gm);
    bt_lora_free(&lo);
    bt_model_free(&mg), bt_model_free(&mf);
    assert_int_equal(tu_remove_dir(dir), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tile_dequant_vs_ggufpy),
        cmocka_unit_test(test_matmuls),
        cmocka_unit_test(test_mat_errors),
        cmocka_unit_test(test_tiny_models_per_type),
        cmocka_unit_test(test_smollm2_q4_1),
        cmocka_unit_test(test_to_ggml),
        cmocka_unit_test(test_load_refusals),
        cmocka_unit_test(test_lora_export_on_base),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
