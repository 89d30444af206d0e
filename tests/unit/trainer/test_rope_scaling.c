/* RoPE frequency scaling: Llama 3.1 rope_scaling "llama3" (transformers modeling_rope_utils
 * _compute_llama3_parameters) and llama.cpp's GGUF rope_freqs.weight, against the transformers
 * reference in tests/fixtures/hf/rope_llama3.safetensors and tests/fixtures/hf/tiny-llama-llama3/
 * (tests/reference/gen_rope_fixtures.py):
 *  - bt_rope_inv_freq equals transformers' fp32 inv_freq (llama3 and default, head_dim 64 / 96 /
 *    128) to <= 1e-7 relative; unsupported types and bad parameters are refused;
 *  - bt_rope_fwd_freq / bt_rope_bwd_freq: the theta form is the default table bit for bit, the
 *    rotation matches a double-precision reference, bwd is the transpose of fwd (adjoint identity)
 *    and its inverse, cached and uncached positions alike;
 *  - the tiny Llama with llama3 scaling loaded from its HF directory gives transformers' logits
 *    at positions 9000.. (<= 1e-4), and visibly not those without the scaling;
 *  - config.json parsing: llama3 keys required and checked, "dynamic" / "yarn" load, a
 *    length-switching longrope or an unknown type is refused with a message saying why;
 *  - GGUF: merged GGUF export writes rope_freqs.weight as convert_hf_to_gguf.py does (<= 1e-7 rel.
 *    of llama.cpp's own formula), and loading a GGUF with rope_freqs.weight honours it (logits
 *    parity again); the merged safetensors export writes rope_scaling llama3 back; linear
 *    scaling round-trips through GGUF llama.rope.scaling.{type,factor}. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <ftw.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "common/gguf.h"
#include "common/safetensors.h"
#include "kernels/kernels.h"
#include "trainer/io/export.h"
#include "trainer/model/model.h"
#include "trainer/model/rng.h"
#include "trainer/loop/step.h"

#define FIX "tests/fixtures/hf/rope_llama3.safetensors"
#define TINY_DIR "tests/fixtures/hf/tiny-llama-llama3"

static const char *const k_cases[] = {"d64_f8", "d128_f8", "d64_f32", "d128_f32", "d96_odd",
                                      "d128_default"};
enum { N_CASES = 6 };

static bt_st_file *g_fix;
static char g_tmp[64];

static int setup(void **st) {
    (void)st;
    if (bt_st_open(&g_fix, FIX) != 0) {
        fprintf(stderr, "cannot open %s: %s\n", FIX, bt_last_error());
        return -1;
    }
    snprintf(g_tmp, sizeof g_tmp, "/tmp/bt_rope_XXXXXX");
    if (!mkdtemp(g_tmp)) return -1;
    return 0;
}

static int rm_cb(const char *p, const struct stat *sb, int fl, struct FTW *f) {
    (void)sb, (void)fl, (void)f;
    return remove(p);
}

static int teardown(void **st) {
    (void)st;
    bt_st_close(g_fix);
    nftw(g_tmp, rm_cb, 8, FTW_DEPTH | FTW_PHYS);
    return 0;
}

/* Fixture tensor `name` (F32 or I32) with n elements. */
static const void *fix(const char *name, bt_st_dtype dt, int64_t n) {
    const bt_st_tensor *t = bt_st_find(g_fix, name);
    if (!t) fail_msg("fixture lacks %s", name);
    if (t->dtype != dt || (int64_t)(t->nbytes / 4) != n)
        fail_msg("fixture %s: dtype %d, %zu bytes, want %lld elements", name, t->dtype, t->nbytes,
                 (long long)n);
    return t->data;
}

static const float *fixf(const char *fmt, const char *cs, int64_t n) {
    char name[96];
    snprintf(name, sizeof name, fmt, cs);
    return fix(name, BT_ST_F32, n);
}

typedef struct {
    int D, orig;
    float theta, factor, low, high;
} rcase;

static rcase case_params(const char *cs) {
    const float *p = fixf("params.%s", cs, 6);
    rcase c = {(int)p[0], (int)p[5], p[1], p[2], p[3], p[4]};
    return c;
}

static double max_rel(const float *a, const float *b, int n) {
    double m = 0;
    for (int i = 0; i < n; i++) m = fmax(m, fabs((double)a[i] - b[i]) / fabs((double)b[i]));
    return m;
}

/* ---- inverse frequencies ---- */

static void test_inv_freq_matches_transformers(void **st) {
    (void)st;
    for (int k = 0; k < N_CASES; k++) {
        rcase c = case_params(k_cases[k]);
        const float *want = fixf("inv_freq.%s", k_cases[k], c.D / 2);
        float got[64];
        int dflt = c.factor == 0.f;
        assert_int_equal(bt_rope_inv_freq(got, c.D, c.theta, dflt ? "default" : "llama3", c.factor,
                                          c.low, c.high, c.orig), 0);
        double e = max_rel(got, want, c.D / 2);
        int exact = 0;
        for (int i = 0; i < c.D / 2; i++) exact += got[i] == want[i];
        fprintf(stderr, "# inv_freq %-12s D %3d: max rel err %.3g, %d/%d bit-exact\n", k_cases[k],
                c.D, e, exact, c.D / 2);
        assert_true(e <= 1e-7);
        if (!dflt) { /* the scaling really changed the low frequencies */
            float base[64];
            assert_int_equal(bt_rope_inv_freq(base, c.D, c.theta, NULL, 0, 0, 0, 0), 0);
            assert_true(want[c.D / 2 - 1] < base[c.D / 2 - 1] / (c.factor * 0.99f));
            assert_true(want[0] == base[0]);
        }
    }
    /* linear: default / factor */
    float a[32], b[32];
    assert_int_equal(bt_rope_inv_freq(a, 64, 10000.f, "default", 0, 0, 0, 0), 0);
    assert_int_equal(bt_rope_inv_freq(b, 64, 10000.f, "linear", 3.f, 0, 0, 0), 0);
    for (int i = 0; i < 32; i++) assert_true(b[i] == a[i] / 3.f);
    /* refusals */
    assert_int_equal(bt_rope_inv_freq(a, 64, 10000.f, "dynamic", 2.f, 0, 0, 0), BT_ERR_UNSUPPORTED);
    assert_non_null(strstr(bt_last_error(), "dynamic"));
    assert_int_equal(bt_rope_inv_freq(a, 64, 10000.f, "yarn", 2.f, 0, 0, 0), BT_ERR_UNSUPPORTED);
    assert_int_equal(bt_rope_inv_freq(a, 63, 10000.f, NULL, 0, 0, 0, 0), BT_ERR_INVALID);
    assert_int_equal(bt_rope_inv_freq(a, 64, 0.f, NULL, 0, 0, 0, 0), BT_ERR_INVALID);
    assert_int_equal(bt_rope_inv_freq(a, 64, 1e4f, "llama3", 8.f, 4.f, 4.f, 8192), BT_ERR_INVALID);
    assert_int_equal(bt_rope_inv_freq(a, 64, 1e4f, "llama3", 0.f, 1.f, 4.f, 8192), BT_ERR_INVALID);
    assert_int_equal(bt_rope_inv_freq(a, 64, 1e4f, "llama3", 8.f, 1.f, 4.f, 0), BT_ERR_INVALID);
}

/* ---- the kernel with a table ---- */

static float dot(const float *a, const float *b, size_t n) {
    double s = 0;
    for (size_t i = 0; i < n; i++) s += (double)a[i] * b[i];
    return (float)s;
}

static void test_rope_freq_fwd_bwd(void **st) {
    (void)st;
    enum { M = 7, H = 3, D = 128 };
    const size_t n = (size_t)M * H * D;
    const int32_t pos[M] = {0, 1, 9000, 131071, -5, (1 << 20) + 3, 3000000};
    rcase c = case_params("d128_f8");
    const float *inv = fixf("inv_freq.%s", "d128_f8", D / 2);
    float *x = malloc(n * 4), *y = malloc(n * 4), *rx = malloc(n * 4), *ry = malloc(n * 4);
    bt_rng r;
    bt_rng_seed(&r, 5);
    for (size_t i = 0; i < n; i++) x[i] = bt_rng_normal(&r), y[i] = bt_rng_normal(&r);

    /* the theta form is the default table, bit for bit */
    float dflt[D / 2];
    assert_int_equal(bt_rope_inv_freq(dflt, D, c.theta, NULL, 0, 0, 0, 0), 0);
    memcpy(rx, x, n * 4), memcpy(ry, x, n * 4);
    bt_rope_fwd(rx, pos, M, H, D, c.theta, 0.5f);
    bt_rope_fwd_freq(ry, pos, M, H, D, dflt, 0.5f);
    assert_memory_equal(rx, ry, n * 4);

    /* fwd against a direct reference (angle in fp32 as the kernel documents, rotation in double) */
    memcpy(rx, x, n * 4);
    bt_rope_fwd_freq(rx, pos, M, H, D, inv, 1.f);
    double emax = 0;
    for (int m = 0; m < M; m++)
        for (int h = 0; h < H; h++)
            for (int i = 0; i < D / 2; i++) {
                const float ang = (float)pos[m] * inv[i];
                const double cs = cos((double)ang), sn = sin((double)ang);
                const float *xr = x + ((size_t)m * H + h) * D;
                const float *yr = rx + ((size_t)m * H + h) * D;
                emax = fmax(emax, fabs(yr[i] - (xr[i] * cs - xr[i + D / 2] * sn)));
                emax = fmax(emax, fabs(yr[i + D / 2] - (xr[i + D / 2] * cs + xr[i] * sn)));
            }
    fprintf(stderr, "# rope_fwd_freq vs double reference: max abs err %.3g\n", emax);
    assert_true(emax <= 1e-5);
    /* with the default table the result differs (the table is what rotates) */
    memcpy(ry, x, n * 4);
    bt_rope_fwd_freq(ry, pos, M, H, D, dflt, 1.f);
    double dd = 0;
    for (size_t i = 0; i < n; i++) dd = fmax(dd, fabs(rx[i] - ry[i]));
    assert_true(dd > 0.1);

    /* adjoint: <R x, y> == <x, R^T y> */
    memcpy(ry, y, n * 4);
    bt_rope_bwd_freq(ry, pos, M, H, D, inv, 1.f);
    const float l = dot(rx, y, n), rr = dot(x, ry, n);
    fprintf(stderr, "# <Rx,y> %.9g  <x,R^T y> %.9g\n", l, rr);
    assert_true(fabs(l - rr) <= 1e-5 * (fabs(l) + 1));
    /* inverse: R^T R x == x */
    bt_rope_bwd_freq(rx, pos, M, H, D, inv, 1.f);
    double einv = 0;
    for (size_t i = 0; i < n; i++) einv = fmax(einv, fabs(rx[i] - x[i]));
    fprintf(stderr, "# |R^T R x - x| max %.3g\n", einv);
    assert_true(einv <= 1e-5);
    free(x), free(y), free(rx), free(ry);
}

/* ---- tiny Llama with llama3 scaling: logits parity with transformers ---- */

enum { T = 12 };

static float *logits_at(const bt_model *m, const int32_t *ids, const int32_t *pos) {
    int32_t lab[T], cu[2] = {0, T};
    for (int i = 0; i < T; i++) lab[i] = i ? ids[i] : -100;
    bt_microbatch mb = {1, T, ids, lab, pos, cu, 2};
    bt_step_ctx *ctx;
    if (bt_step_ctx_new(&ctx, m, NULL, T, 0)) fail_msg("%s", bt_last_error());
    float *lg = malloc((size_t)T * m->hp.vocab * 4);
    assert_int_equal(bt_forward_logits(ctx, m, NULL, &mb, lg), 0);
    bt_step_ctx_free(ctx);
    return lg;
}

static double parity(const bt_model *m, const char *what) {
    const int V = m->hp.vocab;
    const int32_t *ids = fix("tiny.ids", BT_ST_I32, T), *pos = fix("tiny.pos", BT_ST_I32, T);
    const float *want = fix("tiny.logits", BT_ST_F32, (int64_t)T * V);
    const float *plain = fix("tiny.logits_norope_scaling", BT_ST_F32, (int64_t)T * V);
    float *lg = logits_at(m, ids, pos);
    double e = 0, e0 = 0;
    for (int i = 0; i < T * V; i++) {
        e = fmax(e, fabs((double)lg[i] - want[i]));
        e0 = fmax(e0, fabs((double)lg[i] - plain[i]));
    }
    fprintf(stderr, "# %s: max|logits - HF llama3| %.3g (vs HF without scaling %.3g)\n", what, e, e0);
    assert_true(e0 > 0.1);
    free(lg);
    return e;
}

static const bt_model_load_opts k_fp32 = {BT_BASE_FP32, 0};

static void test_tiny_llama3_logits(void **st) {
    (void)st;
    bt_model m;
    if (bt_model_load_hf(&m, TINY_DIR, &k_fp32)) fail_msg("%s", bt_last_error());
    assert_int_equal(m.hp.rope_type, BT_ROPE_LLAMA3);
    assert_true(m.hp.rope_factor == 8.f && m.hp.rope_low_freq_factor == 1.f &&
                m.hp.rope_high_freq_factor == 4.f && m.hp.rope_orig_ctx == 8192);
    assert_int_equal(m.hp.rope_ext, BT_ROPE_EXT_NONE);
    assert_true(parity(&m, "HF dir") <= 1e-4);
    bt_model_free(&m);
}

/* ---- config.json parsing ---- */

/* Copy of the tiny model dir whose config.json rope_scaling is `rs` (JSON); returns the dir. */
static const char *variant(const char *rs) {
    static char dir[128];
    snprintf(dir, sizeof dir, "%s/cfg", g_tmp);
    mkdir(dir, 0755);
    char src[256], dst[256];
    snprintf(src, sizeof src, "%s/model.safetensors", TINY_DIR);
    snprintf(dst, sizeof dst, "%s/model.safetensors", dir);
    unlink(dst);
    char abs_src[4096];
    assert_non_null(realpath(src, abs_src));
    assert_int_equal(symlink(abs_src, dst), 0);
    json_error_t je;
    json_t *c = json_load_file(TINY_DIR "/config.json", 0, &je);
    assert_non_null(c);
    json_t *v = json_loads(rs, 0, &je);
    assert_non_null(v);
    json_object_set_new(c, "rope_scaling", v);
    snprintf(dst, sizeof dst, "%s/config.json", dir);
    assert_int_equal(json_dump_file(c, dst, 0), 0);
    json_decref(c);
    return dir;
}

static void expect(const char *rs, int err, const char *what, const char *what2) {
    bt_model m;
    int rc = bt_model_load_hf(&m, variant(rs), &k_fp32);
    if (rc != err || (what && !strstr(bt_last_error(), what)) ||
        (what2 && !strstr(bt_last_error(), what2)))
        fail_msg("%s: expected %d naming \"%s\", got %d: %s", rs, err, what ? what : "", rc,
                 rc ? bt_last_error() : "");
    if (!rc) bt_model_free(&m);
    else assert_null(m.inv_freq);
}

static void test_config_parsing(void **st) {
    (void)st;
    /* the legacy "type" key works like "rope_type" */
    bt_model m;
    assert_int_equal(bt_model_load_hf(&m, variant("{\"type\": \"llama3\", \"factor\": 32.0, "
                                                  "\"low_freq_factor\": 1.0, \"high_freq_factor\": "
                                                  "4.0, \"original_max_position_embeddings\": 8192}"),
                                      &k_fp32), 0);
    assert_int_equal(m.hp.rope_type, BT_ROPE_LLAMA3);
    assert_true(m.hp.rope_factor == 32.f);
    float want[16];
    assert_int_equal(bt_rope_inv_freq(want, 32, 500000.f, "llama3", 32.f, 1.f, 4.f, 8192), 0);
    assert_memory_equal(m.inv_freq, want, sizeof want);
    bt_model_free(&m);
    expect("{\"rope_type\": \"llama3\", \"factor\": 8.0, \"low_freq_factor\": 1.0, "
           "\"original_max_position_embeddings\": 8192}", BT_ERR_FORMAT, "high_freq_factor", NULL);
    expect("{\"rope_type\": \"llama3\", \"factor\": 8.0, \"low_freq_factor\": 4.0, "
           "\"high_freq_factor\": 1.0, \"original_max_position_embeddings\": 8192}", BT_ERR_FORMAT,
           "high_freq_factor", NULL);
    expect("{\"rope_type\": \"llama3\", \"factor\": -8.0, \"low_freq_factor\": 1.0, "
           "\"high_freq_factor\": 4.0, \"original_max_position_embeddings\": 8192}", BT_ERR_FORMAT,
           "rope_scaling.factor", NULL);
    expect("{\"rope_type\": \"llama3\", \"factor\": 8.0, \"low_freq_factor\": 1.0, "
           "\"high_freq_factor\": 4.0, \"original_max_position_embeddings\": 8192.5}", BT_ERR_FORMAT,
           "original_max_position_embeddings", NULL);
    /* dynamic / yarn load (their numerics: tests/unit/trainer/test_rope_extension.c); a longrope table
     * that switches with the length, or an unknown type, does not */
    expect("{\"rope_type\": \"dynamic\", \"factor\": 2.0}", 0, NULL, NULL);
    expect("{\"rope_type\": \"yarn\", \"factor\": 4.0, \"original_max_position_embeddings\": 4096}",
           0, NULL, NULL);
    expect("{\"rope_type\": \"longrope\", \"factor\": 4.0, \"short_factor\": [1,1,1,1,1,1,1,1,1,1,1,"
           "1,1,1,1,1], \"long_factor\": [2,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1]}", BT_ERR_UNSUPPORTED,
           "short_factor", NULL);
    expect("{\"rope_type\": \"su\", \"factor\": 4.0}", BT_ERR_UNSUPPORTED, "\"su\"", "yarn");
    expect("{\"rope_type\": \"default\"}", 0, NULL, NULL);
}

/* ---- GGUF rope_freqs.weight ---- */

static void gguf_tensor_f32(const char *path, const char *name, float *out, int n) {
    bt_gguf *g;
    if (bt_gguf_open(&g, path)) fail_msg("%s", bt_last_error());
    const bt_gguf_tensor *t = bt_gguf_find_tensor(g, name);
    assert_non_null(t);
    assert_int_equal(t->type, 0); /* GGML_TYPE_F32 */
    assert_int_equal(t->n_dims, 1);
    assert_int_equal(t->ne[0], n);
    memcpy(out, t->data, (size_t)n * 4);
    assert_true(bt_gguf_find_key(g, "llama.rope.scaling.type") < 0);
    bt_gguf_close(g);
}

static void test_gguf_rope_freqs(void **st) {
    (void)st;
    char path[128], dir[128];
    snprintf(path, sizeof path, "%s/tiny.gguf", g_tmp);
    /* 1) tiny HF llama3 model -> merged GGUF -> loaded back: rope_freqs honoured */
    bt_model m, g;
    if (bt_model_load_hf(&m, TINY_DIR, &k_fp32)) fail_msg("%s", bt_last_error());
    if (bt_export_gguf_merged(&m, NULL, NULL, BT_EXPORT_F32, path)) fail_msg("%s", bt_last_error());
    if (bt_model_load_gguf(&g, path, &k_fp32)) fail_msg("%s", bt_last_error());
    assert_int_equal(g.hp.rope_type, BT_ROPE_FREQS);
    assert_non_null(g.rope_freqs);
    double e = max_rel(g.inv_freq, m.inv_freq, 16);
    fprintf(stderr, "# tiny GGUF inv_freq (default / rope_freqs) vs HF llama3: max rel %.3g\n", e);
    assert_true(e <= 5e-7);
    assert_true(parity(&g, "GGUF with rope_freqs.weight") <= 1e-4);
    /* 2) that GGUF model -> merged safetensors: rope_scaling llama3 recovered exactly */
    snprintf(dir, sizeof dir, "%s/st", g_tmp);
    if (bt_export_safetensors_merged(&g, NULL, BT_EXPORT_F32, NULL, dir))
        fail_msg("%s", bt_last_error());
    bt_model h;
    if (bt_model_load_hf(&h, dir, &k_fp32)) fail_msg("%s", bt_last_error());
    assert_int_equal(h.hp.rope_type, BT_ROPE_LLAMA3);
    assert_true(h.hp.rope_factor == 8.f && h.hp.rope_low_freq_factor == 1.f &&
                h.hp.rope_high_freq_factor == 4.f && h.hp.rope_orig_ctx == 8192);
    assert_memory_equal(h.inv_freq, m.inv_freq, 16 * sizeof(float));
    bt_model_free(&h);
    /* 3) the HF model -> merged safetensors keeps its rope_scaling */
    if (bt_export_safetensors_merged(&m, NULL, BT_EXPORT_F32, NULL, dir))
        fail_msg("%s", bt_last_error());
    if (bt_model_load_hf(&h, dir, &k_fp32)) fail_msg("%s", bt_last_error());
    assert_int_equal(h.hp.rope_type, BT_ROPE_LLAMA3);
    assert_memory_equal(h.inv_freq, m.inv_freq, 16 * sizeof(float));
    assert_true(parity(&h, "merged safetensors export") <= 1e-4);
    bt_model_free(&h);
    /* a table no Llama 3.x parameters reproduce goes to config.json as a fixed "longrope" table
     * (equal short and long factors), which loads back as the same frequencies */
    g.rope_freqs[3] *= 1.5f;
    if (bt_model_rope_init(&g, g.rope_freqs)) fail_msg("%s", bt_last_error());
    if (bt_export_safetensors_merged(&g, NULL, BT_EXPORT_F32, NULL, dir))
        fail_msg("%s", bt_last_error());
    if (bt_model_load_hf(&h, dir, &k_fp32)) fail_msg("%s", bt_last_error());
    assert_int_equal(h.hp.rope_type, BT_ROPE_FREQS);
    assert_true(max_rel(h.inv_freq, g.inv_freq, 16) <= 3e-7);
    bt_model_free(&h);
    bt_model_free(&g);
    bt_model_free(&m);

    /* 4) head_dim 64 / 128 models with the fixture's llama3 parameters: the exported
     * rope_freqs.weight equals llama.cpp's (convert_hf_to_gguf.py) and loads back to HF's inv_freq */
    for (int k = 0; k < N_CASES; k++) {
        rcase c = case_params(k_cases[k]);
        if (c.factor == 0.f || c.D == 96) continue;
        bt_llama_hparams hp = {.n_layer = 1, .d_model = 128, .n_head = 128 / c.D,
                               .n_kv_head = 128 / c.D, .head_dim = c.D, .d_ff = 64, .vocab = 16,
                               .ctx = 131072, .rope_theta = c.theta, .rms_eps = 1e-5f,
                               .rope_factor = c.factor, .rope_type = BT_ROPE_LLAMA3,
                               .rope_low_freq_factor = c.low, .rope_high_freq_factor = c.high,
                               .rope_orig_ctx = c.orig};
        if (bt_model_init_random(&m, &hp, BT_BASE_FP32, 1, 3)) fail_msg("%s", bt_last_error());
        assert_memory_equal(m.inv_freq, fixf("inv_freq.%s", k_cases[k], c.D / 2), c.D / 2 * 4);
        if (bt_export_gguf_merged(&m, NULL, NULL, BT_EXPORT_F16, path))
            fail_msg("%s", bt_last_error());
        float ff[64];
        gguf_tensor_f32(path, "rope_freqs.weight", ff, c.D / 2);
        double ef = max_rel(ff, fixf("rope_freqs.%s", k_cases[k], c.D / 2), c.D / 2);
        if (bt_model_load_gguf(&g, path, &k_fp32)) fail_msg("%s", bt_last_error());
        double ei = max_rel(g.inv_freq, fixf("inv_freq.%s", k_cases[k], c.D / 2), c.D / 2);
        fprintf(stderr, "# %-8s rope_freqs.weight vs convert_hf_to_gguf.py max rel %.3g; "
                "GGUF inv_freq vs HF max rel %.3g\n", k_cases[k], ef, ei);
        assert_true(ef <= 1e-7);
        assert_true(ei <= 5e-7);
        bt_model_free(&g);
        bt_model_free(&m);
    }
    /* 5) linear scaling goes to GGUF as llama.rope.scaling.{type,factor} and loads back */
    bt_llama_hparams hl = {.n_layer = 1, .d_model = 64, .n_head = 1, .n_kv_head = 1, .head_dim = 64,
                           .d_ff = 64, .vocab = 16, .ctx = 4096, .rope_theta = 1e4f,
                           .rms_eps = 1e-5f, .rope_ext = BT_ROPE_EXT_LINEAR, .rope_ext_factor = 2.f};
    if (bt_model_init_random(&m, &hl, BT_BASE_FP32, 1, 4)) fail_msg("%s", bt_last_error());
    if (bt_export_gguf_merged(&m, NULL, NULL, BT_EXPORT_F32, path)) fail_msg("%s", bt_last_error());
    if (bt_model_load_gguf(&g, path, &k_fp32)) fail_msg("%s", bt_last_error());
    assert_int_equal(g.hp.rope_type, BT_ROPE_DEFAULT);
    assert_true(g.hp.rope_ext == BT_ROPE_EXT_LINEAR && g.hp.rope_ext_factor == 2.f);
    assert_null(g.rope_freqs);
    assert_memory_equal(g.inv_freq, m.inv_freq, 32 * sizeof(float));
    bt_model_free(&g);
    bt_model_free(&m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_inv_freq_matches_transformers),
        cmocka_unit_test(test_rope_freq_fwd_bwd),
        cmocka_unit_test(test_tiny_llama3_logits),
        cmocka_unit_test(test_config_parsing),
        cmocka_unit_test(test_gguf_rope_freqs),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
