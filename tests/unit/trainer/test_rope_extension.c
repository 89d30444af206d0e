/* Context extension: RoPE "linear", "yarn" and "dynamic" scaling against transformers
 * (tests/fixtures/hf/rope_ext.safetensors and tests/fixtures/hf/tiny-llama-ctx256/, written by
 * tests/reference/gen_rope_ext_fixtures.py with transformers 4.46.3):
 *  - the inverse-frequency tables (bt_rope_inv_freq "linear", bt_rope_inv_freq_yarn,
 *    bt_rope_inv_freq_dynamic) equal transformers' (linear, YaRN bit for bit; dynamic to 4 ulp:
 *    torch's vectorised fp32 pow is not correctly rounded), YaRN's attention factor to 1e-7,
 *    and the cos/sin of LlamaRotaryEmbedding at long positions (with its attention scaling)
 *    follow from them (the kernels rotate with the table; the factor is folded into the softmax
 *    scale, bt_model_attn_scale);
 *  - the tiny Llama (trained context 256) extended to 1024 with each method
 *    (bt_model_extend_context, the job's context_extension) gives transformers' logits at
 *    positions 900..923 with rope_scaling {rope_type, factor 4} (<= 1e-4), and visibly not the
 *    unscaled ones; dynamic below the original context is unscaled; the same configs loaded from
 *    config.json (rope_scaling, or transformers 5's rope_parameters with rope_theta inside) give
 *    the same logits;
 *  - extension rules: a second, different scaling is refused; the same one again is a no-op; the
 *    target must exceed the context; composition with Llama 3.1 "llama3" (linear divides the
 *    llama3 table, YaRN mixes it as llama.cpp does with rope_freqs, dynamic scales each frequency
 *    as it scales the default one);
 *  - exports of an extended model: merged GGUF (llama.rope.scaling.{type, factor,
 *    original_context_length, attn_factor}, llama.context_length) and merged safetensors
 *    (config.json rope_scaling / max_position_embeddings, "longrope" for a composed table) load
 *    back with the same table, attention scale and logits; dynamic is refused for GGUF with a
 *    message; a LoRA GGUF of an adapter trained with the extension records the keys; the
 *    adapter's adapter_config.json note round-trips (bt_adapter_save /
 *    bt_adapter_context_extension). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

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
#include "trainer/io/adapter.h"
#include "trainer/io/adapter_load.h"
#include "trainer/io/export.h"
#include "trainer/infer/infer.h"
#include "trainer/model/lora.h"
#include "trainer/model/model.h"
#include "trainer/loop/step.h"
#include "tests/unit/util/test_util.h"

#define FIX "tests/fixtures/hf/rope_ext.safetensors"
#define TINY_DIR "tests/fixtures/hf/tiny-llama-ctx256"
#define LLAMA3_DIR "tests/fixtures/hf/tiny-llama-llama3"

static const char *const k_cases[] = {"linear_f2",    "linear_f3",     "yarn_smollm2",
                                      "yarn_llama",   "yarn_betas",    "yarn_d96",
                                      "dynamic_short", "dynamic_at",   "dynamic_16k",
                                      "dynamic_odd"};
enum { N_CASES = 10, T = 24 };

static bt_st_file *g_fix;
static char g_tmp[64];
static const bt_model_load_opts k_fp32 = {BT_BASE_FP32, 0};

static int setup(void **st) {
    (void)st;
    if (bt_st_open(&g_fix, FIX) != 0) {
        fprintf(stderr, "cannot open %s: %s\n", FIX, bt_last_error());
        return -1;
    }
    return tu_make_tmpdir(g_tmp, sizeof g_tmp, "ropeext");
}

static int teardown(void **st) {
    (void)st;
    bt_st_close(g_fix);
    return tu_remove_dir(g_tmp);
}

static const void *fix(const char *name, bt_st_dtype dt, int64_t n) {
    return tu_st_data(g_fix, name, dt, n);
}

static const void *fixn(const char *pre, const char *cs, bt_st_dtype dt, int64_t n) {
    char name[96];
    snprintf(name, sizeof name, "%s.%s", pre, cs);
    return fix(name, dt, n);
}

/* ulps between two positive floats */
static int ulps(float a, float b) {
    int32_t x, y;
    memcpy(&x, &a, 4), memcpy(&y, &b, 4);
    return abs(x - y);
}

/* ---- tables ---- */

static void test_tables_match_transformers(void **st) {
    (void)st;
    for (int k = 0; k < N_CASES; k++) {
        const char *cs = k_cases[k];
        const float *p = fixn("params", cs, BT_ST_F32, 8);
        const int D = (int)p[0], orig = (int)p[3], seq = (int)p[7];
        const float theta = p[1], f = p[2];
        const float *want = fixn("inv", cs, BT_ST_F32, D / 2);
        const float att = *(const float *)fixn("attn", cs, BT_ST_F32, 1);
        float got[64], a = 1.f;
        if (!strncmp(cs, "linear", 6)) {
            assert_int_equal(bt_rope_inv_freq(got, D, theta, "linear", f, 0, 0, 0), 0);
        } else if (!strncmp(cs, "yarn", 4)) {
            assert_int_equal(bt_rope_inv_freq_yarn(got, D, theta, f, orig, p[4], p[5]), 0);
            a = bt_rope_yarn_attention_factor(f, p[6]);
        } else {
            assert_int_equal(bt_rope_inv_freq_dynamic(got, D, theta, f, orig, seq), 0);
        }
        int worst = 0, exact = 0;
        for (int i = 0; i < D / 2; i++) {
            const int u = ulps(got[i], want[i]);
            worst = u > worst ? u : worst;
            exact += u == 0;
        }
        fprintf(stderr, "# %-14s inv_freq: %d/%d exact, worst %d ulp; attention factor %.9g vs "
                "%.9g\n", cs, exact, D / 2, worst, (double)a, (double)att);
        /* linear and YaRN come out bit for bit; dynamic raises a 0-dim fp32 tensor to a tensor
         * power, which torch evaluates with its vectorised pow (Sleef, 1-ulp bound, not
         * correctly rounded like powf): up to a few ulp apart */
        const int tol = !strncmp(cs, "dynamic", 7) ? 4 : 0;
        if (worst > tol) fail_msg("%s: inv_freq differs from transformers by %d ulp", cs, worst);
        assert_true(fabsf(a - att) <= 1e-7f * att);

        /* cos/sin of LlamaRotaryEmbedding at the case's positions: rotating e_i with the table
         * gives (cos, sin) of the angle; transformers multiplies both by the attention factor
         * (transformers' table here, so that the rotation itself is what is compared) */
        char nm[64];
        snprintf(nm, sizeof nm, "pos.%s", cs);
        const bt_st_tensor *pt = bt_st_find(g_fix, nm);
        assert_non_null(pt);
        const int P = (int)(pt->nbytes / 4);
        const int32_t *pos = pt->data;
        const float *hc = fixn("cos", cs, BT_ST_F32, (int64_t)P * D);
        const float *hs = fixn("sin", cs, BT_ST_F32, (int64_t)P * D);
        float *x = calloc((size_t)P * D, sizeof(float));
        double e = 0;
        for (int i = 0; i < D / 2; i++) {
            for (int m = 0; m < P; m++) {
                memset(x + (size_t)m * D, 0, (size_t)D * 4);
                x[(size_t)m * D + i] = 1.f;
            }
            bt_rope_fwd_freq(x, pos, P, 1, D, want, 1.f);
            for (int m = 0; m < P; m++) {
                e = fmax(e, fabs(a * x[(size_t)m * D + i] - hc[(size_t)m * D + i]));
                e = fmax(e, fabs(a * x[(size_t)m * D + i + D / 2] - hs[(size_t)m * D + i]));
                e = fmax(e, fabs(hc[(size_t)m * D + i] - hc[(size_t)m * D + i + D / 2]));
            }
        }
        free(x);
        fprintf(stderr, "# %-14s cos/sin at positions up to %d vs transformers: max abs %.3g\n",
                cs, pos[P - 1], e);
        assert_true(e <= 2e-6);
    }
    /* bad arguments are refused, never a garbage table */
    float t[32];
    assert_int_equal(bt_rope_inv_freq_yarn(t, 64, 1e4f, 0.f, 2048, 0, 0), BT_ERR_INVALID);
    assert_int_equal(bt_rope_inv_freq_yarn(t, 63, 1e4f, 2.f, 2048, 0, 0), BT_ERR_INVALID);
    assert_int_equal(bt_rope_inv_freq_yarn(t, 64, 1e4f, 2.f, 0, 0, 0), BT_ERR_INVALID);
    assert_int_equal(bt_rope_inv_freq_yarn(t, 64, 1e4f, 2.f, 2048, -1.f, 0), BT_ERR_INVALID);
    assert_int_equal(bt_rope_inv_freq_dynamic(t, 64, 1e4f, -2.f, 2048, 9000), BT_ERR_INVALID);
    assert_int_equal(bt_rope_inv_freq_dynamic(t, 64, 1e4f, 2.f, 0, 9000), BT_ERR_INVALID);
}

/* ---- the tiny Llama extended past its trained context ---- */

static float *logits_at(const bt_model *m, const int32_t *pos) {
    const int32_t *ids = fix("tiny.ids", BT_ST_I32, T);
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

static double maxdiff(const float *a, const float *b, int n) {
    double e = 0;
    for (int i = 0; i < n; i++) e = fmax(e, fabs((double)a[i] - b[i]));
    return e;
}

/* logits of m at tiny.pos (or tiny.pos_short) against fixture tiny.logits.<which> */
static double parity(const bt_model *m, const char *which, int short_pos, const char *what) {
    const int V = m->hp.vocab;
    const int32_t *pos = fix(short_pos ? "tiny.pos_short" : "tiny.pos", BT_ST_I32, T);
    char nm[64];
    snprintf(nm, sizeof nm, "tiny.logits.%s", which);
    const float *want = fix(nm, BT_ST_F32, (int64_t)T * V);
    float *lg = logits_at(m, pos);
    double e = maxdiff(lg, want, T * V);
    double e0 = short_pos ? 0 : maxdiff(lg, fix("tiny.logits.none", BT_ST_F32, (int64_t)T * V), T * V);
    fprintf(stderr, "# %-34s max|logits - transformers %s| %.3g (vs unscaled %.3g)\n", what, which,
            e, e0);
    if (!short_pos && strcmp(which, "none") != 0) assert_true(e0 > 0.1);
    free(lg);
    return e;
}

static void load_tiny(bt_model *m) {
    if (bt_model_load_hf(m, TINY_DIR, &k_fp32)) fail_msg("%s", bt_last_error());
    assert_int_equal(m->hp.ctx, 256);
}

static void test_tiny_extended(void **st) {
    (void)st;
    bt_model m;
    load_tiny(&m);
    assert_true(parity(&m, "none", 0, "unscaled base") <= 1e-4);
    bt_model_free(&m);
    static const char *const meth[3] = {"linear", "yarn", "dynamic"};
    for (int k = 0; k < 3; k++) {
        load_tiny(&m);
        assert_int_equal(bt_model_extend_context(&m, bt_rope_ext_parse(meth[k]), 1024), 0);
        assert_int_equal(m.ctx_extended, 1);
        assert_int_equal(m.hp.ctx, 1024);
        assert_true(m.hp.rope_ext_factor == 4.f && m.hp.rope_ext_orig_ctx == 256);
        char what[64];
        snprintf(what, sizeof what, "context_extension %s 256 -> 1024", meth[k]);
        assert_true(parity(&m, meth[k], 0, what) <= 1e-4);
        if (k == 2) /* dynamic below the original context: the unscaled table */
            assert_true(parity(&m, "dynamic_short", 1, "dynamic at positions < 256") <= 1e-4);
        /* extension rules */
        assert_int_equal(bt_model_extend_context(&m, bt_rope_ext_parse(meth[k]), 1024), 0);
        assert_int_equal(bt_model_extend_context(&m, bt_rope_ext_parse(meth[(k + 1) % 3]), 1024),
                         BT_ERR_INVALID);
        assert_non_null(strstr(bt_last_error(), "already has RoPE scaling"));
        assert_int_equal(m.hp.ctx, 1024); /* unchanged by the refusal */
        bt_model_free(&m);
    }
    load_tiny(&m);
    assert_int_equal(bt_model_extend_context(&m, BT_ROPE_EXT_LINEAR, 256), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "target_length"));
    assert_int_equal(bt_model_extend_context(&m, 7, 1024), BT_ERR_INVALID);
    assert_int_equal(m.ctx_extended, 0);
    bt_model_free(&m);
}

/* Generation (trainer/infer/infer.c) with dynamic NTK: a prefill of n > 256 tokens uses the table of
 * its longest position, exactly as a training-style forward of the same tokens does; a decode
 * step past it grows the table (transformers' _dynamic_frequency_update), while the keys already
 * cached keep their rotation, so the chunked result differs (slightly) from the one-shot one. */
static void test_generation_dynamic(void **st) {
    (void)st;
    bt_model m;
    load_tiny(&m);
    assert_int_equal(bt_model_extend_context(&m, BT_ROPE_EXT_DYNAMIC, 1024), 0);
    enum { N = 300 };
    int32_t ids[N], lab[N], pos[N], cu[2] = {0, N};
    for (int i = 0; i < N; i++) ids[i] = (i * 37 + 11) % 64, lab[i] = -100, pos[i] = i;
    const int V = m.hp.vocab;
    float *full = malloc((size_t)N * V * 4), *one = malloc((size_t)V * 4), *chunk = malloc((size_t)V * 4);
    bt_step_ctx *ctx;
    assert_int_equal(bt_step_ctx_new(&ctx, &m, NULL, N, 0), 0);
    bt_microbatch mb = {1, N, ids, lab, pos, cu, 2};
    assert_int_equal(bt_forward_logits(ctx, &m, NULL, &mb, full), 0);
    bt_step_ctx_free(ctx);
    bt_infer *s;
    assert_int_equal(bt_infer_new(&s, &m, NULL, 1024, 512), 0);
    assert_int_equal(bt_infer_forward(s, ids, N, BT_INFER_LOGITS_LAST, one), 0);
    const double e1 = maxdiff(one, full + (size_t)(N - 1) * V, V);
    bt_infer_reset(s);
    assert_int_equal(bt_infer_forward(s, ids, N - 20, BT_INFER_LOGITS_NONE, NULL), 0);
    for (int i = N - 20; i < N; i++)
        assert_int_equal(bt_infer_forward(s, ids + i, 1, BT_INFER_LOGITS_LAST, chunk), 0);
    const double e2 = maxdiff(chunk, full + (size_t)(N - 1) * V, V);
    fprintf(stderr, "# dynamic generation: one-shot prefill vs forward %.3g; prefill + 20 decode "
            "steps vs forward %.3g\n", e1, e2);
    assert_true(e1 <= 1e-4);
    assert_true(e2 > e1 && e2 < 0.5);
    bt_infer_free(s);
    free(full), free(one), free(chunk);
    bt_model_free(&m);
}

/* A copy of the tiny model dir whose config.json gets `patch` (a JSON object merged in; "-key"
 * entries with value null delete key). */
static const char *variant(const char *patch) {
    static char dir[128];
    snprintf(dir, sizeof dir, "%s/cfg", g_tmp);
    mkdir(dir, 0755);
    char src[256], dst[256], abs_src[4096];
    snprintf(src, sizeof src, "%s/model.safetensors", TINY_DIR);
    snprintf(dst, sizeof dst, "%s/model.safetensors", dir);
    unlink(dst);
    assert_non_null(realpath(src, abs_src));
    assert_int_equal(symlink(abs_src, dst), 0);
    json_error_t je;
    json_t *c = json_load_file(TINY_DIR "/config.json", 0, &je), *p = json_loads(patch, 0, &je);
    assert_non_null(c);
    assert_non_null(p);
    const char *k;
    json_t *v;
    json_object_foreach(p, k, v) {
        if (k[0] == '-') json_object_del(c, k + 1);
        else json_object_set(c, k, v);
    }
    json_decref(p);
    snprintf(dst, sizeof dst, "%s/config.json", dir);
    assert_int_equal(json_dump_file(c, dst, 0), 0);
    json_decref(c);
    return dir;
}

static void test_hf_configs(void **st) {
    (void)st;
    static const struct {
        const char *patch, *which;
        int ext, ctx;
    } cases[] = {
        {"{\"rope_scaling\": {\"rope_type\": \"linear\", \"factor\": 4.0}}", "linear",
         BT_ROPE_EXT_LINEAR, 256},
        {"{\"rope_scaling\": {\"type\": \"yarn\", \"factor\": 4.0}}", "yarn", BT_ROPE_EXT_YARN, 1024},
        /* transformers 5: YaRN's original context from rope_scaling */
        {"{\"max_position_embeddings\": 1024, \"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": "
         "4.0, \"original_max_position_embeddings\": 256}}", "yarn", BT_ROPE_EXT_YARN, 1024},
        {"{\"rope_scaling\": {\"rope_type\": \"dynamic\", \"factor\": 4.0}}", "dynamic",
         BT_ROPE_EXT_DYNAMIC, 1024},
        /* transformers 5 writes rope_parameters, with rope_theta inside */
        {"{\"-rope_theta\": null, \"-rope_scaling\": null, \"rope_parameters\": {\"rope_type\": "
         "\"linear\", \"factor\": 4.0, \"rope_theta\": 10000.0}}", "linear", BT_ROPE_EXT_LINEAR, 256},
        {"{\"-rope_theta\": null, \"-rope_scaling\": null, \"rope_parameters\": {\"rope_type\": "
         "\"default\", \"rope_theta\": 10000.0}}", "none", BT_ROPE_EXT_NONE, 256},
    };
    /* hostile values are refused, naming the key or the range */
    static const char *const bad[] = {
        "{\"rope_scaling\": {\"rope_type\": \"linear\", \"factor\": 1e-30}}",
        "{\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0, \"beta_fast\": -1}}",
        "{\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0, "
        "\"original_max_position_embeddings\": 2.5}}",
        "{\"rope_scaling\": {\"rope_type\": \"dynamic\", \"factor\": \"4\"}}",
        "{\"rope_scaling\": {\"rope_type\": \"longrope\", \"short_factor\": [1], \"long_factor\": [1]}}",
        "{\"rope_scaling\": 7}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        bt_model m;
        int rc = bt_model_load_hf(&m, variant(bad[i]), &k_fp32);
        if (rc == 0) fail_msg("%s loaded", bad[i]);
        fprintf(stderr, "# refused: %s\n", bt_last_error());
        assert_null(m.inv_freq);
    }
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        bt_model m;
        if (bt_model_load_hf(&m, variant(cases[i].patch), &k_fp32))
            fail_msg("%s: %s", cases[i].patch, bt_last_error());
        assert_int_equal(m.hp.rope_ext, cases[i].ext);
        assert_int_equal(m.hp.ctx, cases[i].ctx);
        assert_true(m.hp.rope_theta == 10000.f);
        assert_true(parity(&m, cases[i].which, 0, cases[i].patch) <= 1e-4);
        /* a config that already scales this way takes the same context_extension as a no-op */
        if (cases[i].ext != BT_ROPE_EXT_NONE && cases[i].ext != BT_ROPE_EXT_LINEAR) {
            assert_int_equal(bt_model_extend_context(&m, cases[i].ext, 1024), 0);
            assert_int_equal(m.ctx_extended, 0);
        }
        bt_model_free(&m);
    }
}

/* ---- composition with the model's own scaling (Llama 3.1 "llama3") ---- */

static void test_compose_llama3(void **st) {
    (void)st;
    bt_model base, m;
    if (bt_model_load_hf(&base, LLAMA3_DIR, &k_fp32)) fail_msg("%s", bt_last_error());
    const int half = base.hp.head_dim / 2, ctx = base.hp.ctx;
    float dflt[64], want[64];
    assert_int_equal(bt_rope_inv_freq(dflt, 2 * half, base.hp.rope_theta, "default", 0, 0, 0, 0), 0);
    for (int k = BT_ROPE_EXT_LINEAR; k <= BT_ROPE_EXT_DYNAMIC; k++) {
        if (bt_model_load_hf(&m, LLAMA3_DIR, &k_fp32)) fail_msg("%s", bt_last_error());
        assert_int_equal(bt_model_extend_context(&m, k, 2 * ctx), 0);
        assert_int_equal(m.hp.rope_type, BT_ROPE_LLAMA3);
        memcpy(want, base.inv_freq, (size_t)half * 4);
        if (k == BT_ROPE_EXT_LINEAR)
            for (int i = 0; i < half; i++) want[i] = want[i] / 2.f;
        else if (k == BT_ROPE_EXT_YARN)
            assert_int_equal(bt_rope_yarn_mix(want, 2 * half, m.hp.rope_theta, 2.f, ctx, 0, 0), 0);
        assert_memory_equal(m.inv_freq, want, (size_t)half * 4);
        if (k == BT_ROPE_EXT_DYNAMIC) { /* each llama3 frequency scaled as the default one */
            float tab[64], dyn[64];
            assert_int_equal(bt_model_rope_table(&m, (int64_t)ctx, tab), 0);
            assert_memory_equal(tab, base.inv_freq, (size_t)half * 4);
            assert_int_equal(bt_model_rope_table(&m, (int64_t)3 * ctx, tab), 1);
            assert_int_equal(bt_rope_inv_freq_dynamic(dyn, 2 * half, m.hp.rope_theta, 2.f, ctx,
                                                      (int64_t)3 * ctx), 0);
            for (int i = 0; i < half; i++)
                assert_true(fabsf(tab[i] - base.inv_freq[i] * (dyn[i] / dflt[i])) <=
                            1e-6f * tab[i]);
        }
        bt_model_free(&m);
    }
    bt_model_free(&base);
}

/* ---- exports ---- */

static void gguf_expect(const char *path, const char *type, float factor, int orig, int ctx,
                        float attn) {
    bt_gguf *g;
    if (bt_gguf_open(&g, path)) fail_msg("%s", bt_last_error());
    bt_str s;
    int64_t v;
    double d;
    assert_int_equal(bt_gguf_get_str(g, "llama.rope.scaling.type", &s), 0);
    assert_int_equal((int)s.len, (int)strlen(type));
    assert_memory_equal(s.ptr, type, s.len);
    assert_int_equal(bt_gguf_get_f64(g, "llama.rope.scaling.factor", &d), 0);
    assert_true((float)d == factor);
    assert_int_equal(bt_gguf_get_i64(g, "llama.rope.scaling.original_context_length", &v), 0);
    assert_int_equal(v, orig);
    assert_int_equal(bt_gguf_get_i64(g, "llama.context_length", &v), 0);
    assert_int_equal(v, ctx);
    if (attn > 0) {
        assert_int_equal(bt_gguf_get_f64(g, "llama.rope.scaling.attn_factor", &d), 0);
        assert_true(fabs(d - attn) <= 1e-7);
    }
    bt_gguf_close(g);
}

static void test_exports(void **st) {
    (void)st;
    char gpath[160], sdir[160], adir[160], lpath[160];
    snprintf(gpath, sizeof gpath, "%s/merged.gguf", g_tmp);
    snprintf(sdir, sizeof sdir, "%s/merged-st", g_tmp);
    snprintf(adir, sizeof adir, "%s/adapter", g_tmp);
    snprintf(lpath, sizeof lpath, "%s/lora.gguf", g_tmp);
    static const char *const meth[3] = {"linear", "yarn", "dynamic"};
    for (int k = 0; k < 3; k++) {
        bt_model m, g;
        load_tiny(&m);
        const int ext = bt_rope_ext_parse(meth[k]);
        assert_int_equal(bt_model_extend_context(&m, ext, 1024), 0);
        /* merged GGUF: llama.cpp's keys, loading back to the same positions */
        if (ext == BT_ROPE_EXT_DYNAMIC) {
            assert_int_equal(bt_export_gguf_merged(&m, NULL, NULL, BT_EXPORT_F32, gpath),
                             BT_ERR_UNSUPPORTED);
            assert_non_null(strstr(bt_last_error(), "dynamic"));
        } else {
            if (bt_export_gguf_merged(&m, NULL, NULL, BT_EXPORT_F32, gpath))
                fail_msg("%s", bt_last_error());
            gguf_expect(gpath, meth[k], 4.f, 256, 1024, ext == BT_ROPE_EXT_YARN ? 1.f : 0.f);
            if (bt_model_load_gguf(&g, gpath, &k_fp32)) fail_msg("%s", bt_last_error());
            assert_int_equal(g.hp.rope_ext, ext);
            assert_int_equal(g.hp.ctx, 1024);
            assert_memory_equal(g.inv_freq, m.inv_freq, 16 * sizeof(float));
            assert_true(bt_model_attn_scale(&g.hp) == bt_model_attn_scale(&m.hp));
            bt_model_free(&g);
        }
        /* merged safetensors: config.json rope_scaling; loads back with the same logits */
        if (bt_export_safetensors_merged(&m, NULL, BT_EXPORT_F32, NULL, sdir))
            fail_msg("%s", bt_last_error());
        char cj[200];
        snprintf(cj, sizeof cj, "%s/config.json", sdir);
        json_error_t je;
        json_t *c = json_load_file(cj, 0, &je);
        assert_non_null(c);
        json_t *rs = json_object_get(c, "rope_scaling");
        assert_string_equal(json_string_value(json_object_get(rs, "rope_type")), meth[k]);
        assert_true(json_real_value(json_object_get(rs, "factor")) == 4.0);
        /* linear: the extended length; YaRN / dynamic: the original (see export.h) */
        assert_int_equal(json_integer_value(json_object_get(c, "max_position_embeddings")),
                         ext == BT_ROPE_EXT_LINEAR ? 1024 : 256);
        json_decref(c);
        if (bt_model_load_hf(&g, sdir, &k_fp32)) fail_msg("%s", bt_last_error());
        assert_int_equal(g.hp.ctx, 1024);
        assert_true(parity(&g, meth[k], 0, "merged safetensors loaded back") <= 1e-4);
        bt_model_free(&g);
        /* the adapter records the extension; its LoRA GGUF carries the keys as notes */
        bt_lora lo;
        assert_int_equal(bt_lora_init(&lo, &m, 2, 4.0, 0.0, 1u << BT_MOD_Q, 0, 5), 0);
        assert_int_equal(bt_adapter_save(&lo, "tiny", adir, &m), 0);
        int gm, gt;
        assert_int_equal(bt_adapter_context_extension(adir, &gm, &gt), 0);
        assert_int_equal(gm, ext);
        assert_int_equal(gt, 1024);
        if (bt_export_gguf_lora(&m, &lo, BT_EXPORT_F32, lpath)) fail_msg("%s", bt_last_error());
        gguf_expect(lpath, meth[k], 4.f, 256, 1024, ext == BT_ROPE_EXT_YARN ? 1.f : 0.f);
        /* applying the adapter's note to a fresh base extends it the same way */
        bt_model f;
        load_tiny(&f);
        assert_int_equal(bt_adapter_apply_context(&f, adir), 0);
        assert_int_equal(f.hp.rope_ext, ext);
        assert_memory_equal(f.inv_freq, m.inv_freq, 16 * sizeof(float));
        bt_model_free(&f);
        bt_lora_free(&lo);
        bt_model_free(&m);
    }
    /* an adapter without a note, or a plain save, changes nothing */
    bt_model m;
    load_tiny(&m);
    bt_lora lo;
    assert_int_equal(bt_lora_init(&lo, &m, 2, 4.0, 0.0, 1u << BT_MOD_Q, 0, 5), 0);
    assert_int_equal(bt_adapter_save(&lo, "tiny", adir, NULL), 0);
    assert_int_equal(bt_adapter_apply_context(&m, adir), 0);
    assert_int_equal(m.hp.rope_ext, BT_ROPE_EXT_NONE);
    bt_lora_free(&lo);
    bt_model_free(&m);
    /* llama3 + linear: a composed table goes to config.json as a fixed "longrope" table, to GGUF
     * as rope_freqs.weight + linear scaling; both load back to the same frequencies */
    if (bt_model_load_hf(&m, LLAMA3_DIR, &k_fp32)) fail_msg("%s", bt_last_error());
    assert_int_equal(bt_model_extend_context(&m, BT_ROPE_EXT_YARN, 2 * m.hp.ctx), 0);
    bt_model g;
    if (bt_export_safetensors_merged(&m, NULL, BT_EXPORT_F32, NULL, sdir))
        fail_msg("%s", bt_last_error());
    if (bt_model_load_hf(&g, sdir, &k_fp32)) fail_msg("%s", bt_last_error());
    assert_int_equal(g.hp.rope_type, BT_ROPE_FREQS);
    for (int i = 0; i < m.hp.head_dim / 2; i++)
        assert_true(fabsf(g.inv_freq[i] - m.inv_freq[i]) <= 3e-7f * m.inv_freq[i]);
    assert_true(fabsf(bt_model_attn_scale(&g.hp) - bt_model_attn_scale(&m.hp)) <=
                1e-6f * bt_model_attn_scale(&m.hp));
    bt_model_free(&g);
    if (bt_export_gguf_merged(&m, NULL, NULL, BT_EXPORT_F32, gpath)) fail_msg("%s", bt_last_error());
    if (bt_model_load_gguf(&g, gpath, &k_fp32)) fail_msg("%s", bt_last_error());
    assert_int_equal(g.hp.rope_type, BT_ROPE_FREQS);
    assert_int_equal(g.hp.rope_ext, BT_ROPE_EXT_YARN);
    for (int i = 0; i < m.hp.head_dim / 2; i++)
        assert_true(fabsf(g.inv_freq[i] - m.inv_freq[i]) <= 3e-7f * m.inv_freq[i]);
    assert_true(bt_model_attn_scale(&g.hp) == bt_model_attn_scale(&m.hp));
    bt_model_free(&g);
    bt_model_free(&m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tables_match_transformers),
        cmocka_unit_test(test_tiny_extended),
        cmocka_unit_test(test_hf_configs),
        cmocka_unit_test(test_generation_dynamic),
        cmocka_unit_test(test_compose_llama3),
        cmocka_unit_test(test_exports),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
