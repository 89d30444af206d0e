/* LongLoRA "LoRA+" (trainable embedding and norms): the new kernels (bt_linear_ce_dw's weight
 * gradient, bt_embedding_bwd's scatter-add) against references, and the full model's gradients
 * of the embedding (tied: lookup + lm_head; untied: lookup only) and of every RMSNorm weight
 * against central finite differences on a tiny random Llama. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <ftw.h>
#include <jansson.h>
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
#include "trainer/model/rng.h"
#include "trainer/loop/step.h"
#include "tests/unit/util/test_util.h"

/* ---- kernels ---- */

static void fill(float *x, size_t n, uint64_t seed, float sd) {
    bt_rng g;
    bt_rng_seed(&g, seed);
    for (size_t i = 0; i < n; i++) x[i] = sd * bt_rng_normal(&g);
}

/* dW of the chunked CE against finite differences of the loss sum, with chunks that do not
 * divide M and an ignored target; dX must equal bt_linear_ce's. */
static void test_linear_ce_dw(void **st) {
    (void)st;
    enum { M = 7, D = 5, V = 11 };
    float X[M * D], W[V * D], dX[M * D], dX0[M * D], dW[V * D];
    int32_t tg[M] = {3, -100, 10, 0, 7, 7, 2};
    fill(X, M * D, 1, 1.f);
    fill(W, V * D, 2, 0.5f);
    float ws[4 * V + 8];
    assert_true(bt_linear_ce_workspace_floats(4, V) <= sizeof ws / sizeof ws[0]);
    for (int i = 0; i < V * D; i++) dW[i] = 0.25f; /* accumulates */
    int nv, nv0;
    double l = bt_linear_ce_dw(dX, dW, &nv, X, W, tg, M, D, V, 3, 0.5f, ws);
    double l0 = bt_linear_ce(dX0, &nv0, X, W, tg, M, D, V, 3, 0.5f, ws);
    assert_int_equal(nv, 6);
    assert_int_equal(nv0, 6);
    assert_true(l == l0);
    assert_memory_equal(dX, dX0, sizeof dX);
    const float eps = 1e-2f;
    for (int i = 0; i < V * D; i++) {
        float s = W[i];
        W[i] = s + eps;
        double lp = bt_linear_ce(NULL, NULL, X, W, tg, M, D, V, 3, 1.f, ws);
        W[i] = s - eps;
        double lm = bt_linear_ce(NULL, NULL, X, W, tg, M, D, V, 3, 1.f, ws);
        W[i] = s;
        double fd = 0.5 * (lp - lm) / (2.0 * eps), an = dW[i] - 0.25;
        if (fabs(fd - an) > 2e-3 * fmax(1.0, fabs(fd)))
            fail_msg("dW[%d]: analytic %.6g vs finite difference %.6g", i, an, fd);
    }
    /* dW only (dX NULL) gives the same dW */
    float dW2[V * D];
    for (int i = 0; i < V * D; i++) dW2[i] = 0.25f;
    bt_linear_ce_dw(NULL, dW2, NULL, X, W, tg, M, D, V, 4, 0.5f, ws);
    for (int i = 0; i < V * D; i++)
        if (fabs(dW2[i] - dW[i]) > 1e-5f) fail_msg("dW2[%d] %.9g vs %.9g", i, dW2[i], dW[i]);
}

static void test_embedding_bwd(void **st) {
    (void)st;
    enum { M = 9, D = 70, V = 6 }; /* D > 64: two column blocks */
    float dout[M * D], dt[V * D], ref[V * D];
    int32_t ids[M] = {1, 4, 1, 0, 5, 1, 2, 5, 4}; /* repeats */
    fill(dout, M * D, 3, 1.f);
    for (int i = 0; i < V * D; i++) dt[i] = ref[i] = (float)i * 0.001f;
    for (int m = 0; m < M; m++)
        for (int d = 0; d < D; d++) ref[ids[m] * D + d] += dout[m * D + d];
    assert_int_equal(bt_embedding_bwd(dt, dout, ids, M, D, V), 0);
    assert_memory_equal(dt, ref, sizeof dt); /* same order of additions: bit-identical */
    assert_int_equal(bt_embedding_bwd(dt, dout, ids, 0, D, V), 0); /* nothing to add */
    assert_memory_equal(dt, ref, sizeof dt);
    /* an id outside [0, V) is refused by name before anything is written; so are bad shapes */
    for (int bad = 0; bad < 2; bad++) {
        ids[6] = bad ? V : -3;
        assert_int_equal(bt_embedding_bwd(dt, dout, ids, M, D, V), BT_ERR_RANGE);
        assert_non_null(strstr(bt_last_error(), bad ? "input_ids[6] = 6 is outside the vocabulary [0, 6)"
                                                    : "input_ids[6] = -3 is outside"));
        assert_int_equal(bt_embedding_fwd(dout, dt, ids, M, D, V), BT_ERR_RANGE);
        assert_memory_equal(dt, ref, sizeof dt);
    }
    assert_int_equal(bt_embedding_bwd(dt, dout, ids, M, 0, V), BT_ERR_INVALID);
    assert_int_equal(bt_embedding_bwd(dt, dout, ids, -1, D, V), BT_ERR_INVALID);
    assert_memory_equal(dt, ref, sizeof dt);
}

/* ---- model gradients ---- */

#define T_ 8
static const bt_llama_hparams k_hp = {
    .n_layer = 2, .d_model = 32, .n_head = 4, .n_kv_head = 2, .head_dim = 8, .d_ff = 64,
    .vocab = 97, .ctx = 64, .rope_theta = 10000.f, .rms_eps = 1e-5f};
static const int32_t k_ids[16] = {5, 17, 42, 8, 91, 33, 60, 0, 12, 7, 77, 23, 54, 3, 88, 41};
static const int32_t k_lab[16] = {-100, 17, 42, 8, 91, 33, -100, -100,
                                  -100, -100, -100, 23, 54, 3, 88, 41};
static const int32_t k_pos[16] = {0, 1, 2, 3, 4, 5, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7};
static const int32_t k_cu[5] = {0, 6, 7, 8, 16};

typedef struct {
    bt_model m;
    bt_lora lo;
    bt_step_ctx *ctx;
    bt_microbatch mb;
    int n;
} rig;

static void rig_init(rig *r, int tied, unsigned trainable) {
    assert_int_equal(bt_model_init_random(&r->m, &k_hp, BT_BASE_FP32, tied, 42), 0);
    assert_int_equal(bt_lora_init(&r->lo, &r->m, 4, 8.0, 0.0, (1u << BT_MOD_N) - 1, trainable, 7),
                     0);
    bt_rng g;
    bt_rng_seed(&g, 99);
    for (int l = 0; l < r->lo.n_layer; l++)
        for (int mod = 0; mod < BT_MOD_N; mod++) {
            const bt_lora_mod *md = bt_lora_get(&r->lo, l, mod);
            for (int i = 0; i < md->out * r->lo.r; i++) md->B[i] = 0.3f * bt_rng_normal(&g);
        }
    assert_int_equal(bt_step_ctx_new(&r->ctx, &r->m, &r->lo, 2 * T_, 0), 0);
    bt_microbatch mb = {2, T_, k_ids, k_lab, k_pos, k_cu, 5};
    r->mb = mb;
    r->n = bt_shift_targets(NULL, &mb, k_hp.vocab);
    assert_int_equal(r->n, 10);
}

static void rig_free(rig *r) {
    bt_step_ctx_free(r->ctx);
    bt_lora_free(&r->lo);
    bt_model_free(&r->m);
}

static double loss_of(rig *r) {
    double s;
    int nv;
    assert_int_equal(bt_forward_backward(r->ctx, &r->m, &r->lo, &r->mb, 0, 1.f, 0, &s, &nv), 0);
    return s / nv;
}

static void check_entry(rig *r, float *p, const float *g, const char *what, int i, double gmax) {
    const float eps = 1e-3f;
    float save = p[i];
    p[i] = save + eps;
    double lp = loss_of(r);
    p[i] = save - eps;
    double lm = loss_of(r);
    p[i] = save;
    double fd = (lp - lm) / (2.0 * eps), an = g[i];
    double tol = 2e-2 * fmax(fabs(fd), fabs(an)) + 2e-3 * gmax + 2e-5;
    if (fabs(fd - an) > tol)
        fail_msg("%s[%d]: analytic %.6g vs finite difference %.6g (max |g| %.3g)", what, i, an, fd,
                 gmax);
}

static void grad_check(int tied) {
    rig r;
    rig_init(&r, tied, BT_TRAIN_EMBED | BT_TRAIN_NORM);
    const int D = k_hp.d_model, V = k_hp.vocab, L = k_hp.n_layer;
    assert_int_equal(r.lo.n_params, r.lo.n_lora + (int64_t)V * D + (int64_t)(2 * L + 1) * D);
    assert_int_equal(r.lo.n_decay, r.lo.n_lora + (int64_t)V * D);
    /* the trainable copies start equal to the base */
    assert_memory_equal(r.lo.embed, r.m.tok_embd, (size_t)V * D * 4);
    assert_memory_equal(r.lo.norms + (size_t)2 * L * D, r.m.output_norm, (size_t)D * 4);
    double l_base = loss_of(&r);
    bt_lora_zero_grad(&r.lo);
    double s;
    int nv;
    assert_int_equal(
        bt_forward_backward(r.ctx, &r.m, &r.lo, &r.mb, 1, 1.f / (float)r.n, 0, &s, &nv), 0);
    assert_true(fabs(s / nv - l_base) < 1e-9);
    /* embedding: rows of input tokens; a row that is only a CE target / only in the vocabulary
     * gets an lm_head gradient when tied and none otherwise */
    double gmax = 0;
    for (int64_t i = 0; i < (int64_t)V * D; i++) gmax = fmax(gmax, fabs(r.lo.dembed[i]));
    assert_true(gmax > 1e-6);
    const int rows[] = {5, 42, 91, 0, 77, 88, 41, 60}; /* input ids */
    for (size_t k = 0; k < sizeof rows / sizeof rows[0]; k++)
        for (int d = 0; d < D; d += 7) check_entry(&r, r.lo.embed, r.lo.dembed, "embed", rows[k] * D + d, gmax);
    const int unused = 96; /* not an input id */
    double urow = 0;
    for (int d = 0; d < D; d++) urow = fmax(urow, fabs(r.lo.dembed[unused * D + d]));
    if (tied) assert_true(urow > 1e-7); /* softmax gradient through the tied lm_head */
    else assert_true(urow == 0.0);
    for (int d = 0; d < D; d += 5) check_entry(&r, r.lo.embed, r.lo.dembed, "embed", unused * D + d, gmax);
    /* every norm weight vector (input_layernorm, post_attention_layernorm per layer, final) */
    double nmax = 0;
    for (int64_t i = 0; i < (int64_t)(2 * L + 1) * D; i++) nmax = fmax(nmax, fabs(r.lo.dnorms[i]));
    assert_true(nmax > 1e-6);
    for (int l = 0; l <= L; l++)
        for (int which = 0; which < (l == L ? 1 : 2); which++) {
            float *w = (float *)bt_lora_norm(&r.lo, &r.m, l, which);
            float *g = bt_lora_dnorm(&r.lo, l, which);
            assert_true(w >= r.lo.norms && w < r.lo.norms + (2 * L + 1) * D);
            char what[48];
            snprintf(what, sizeof what, "norm(layer %d, %d)", l, which);
            for (int d = 0; d < D; d += 3) check_entry(&r, w, g, what, d, nmax);
        }
    /* the base model is untouched: perturbing its own tensors no longer changes the loss */
    r.m.tok_embd[5 * D] += 1.0f;
    r.m.output_norm[0] += 1.0f;
    if (!tied) r.m.lm_head[0] += 0.0f;
    assert_true(loss_of(&r) == l_base);
    rig_free(&r);
}

static void test_grad_tied(void **st) {
    (void)st;
    grad_check(1);
}

static void test_grad_untied(void **st) {
    (void)st;
    grad_check(0);
}

/* trainable 0 is exactly plain LoRA: same parameter layout and gradients */
static void test_plain_unchanged(void **st) {
    (void)st;
    rig a, b;
    rig_init(&a, 1, 0);
    assert_int_equal(bt_model_init_random(&b.m, &k_hp, BT_BASE_FP32, 1, 42), 0);
    assert_int_equal(bt_lora_init(&b.lo, &b.m, 4, 8.0, 0.0, (1u << BT_MOD_N) - 1, 0, 7), 0);
    assert_int_equal(a.lo.n_params, b.lo.n_params);
    assert_int_equal(a.lo.n_decay, a.lo.n_params);
    assert_null(a.lo.embed);
    assert_null(bt_lora_dembed(&a.lo));
    assert_null(bt_lora_dnorm(&a.lo, 0, 0));
    assert_ptr_equal(bt_lora_embed(&a.lo, &a.m), a.m.tok_embd);
    assert_ptr_equal(bt_lora_norm(NULL, &a.m, k_hp.n_layer, 0), a.m.output_norm);
    bt_lora bad;
    assert_int_equal(bt_lora_init(&bad, &a.m, 4, 8.0, 0.0, 1, 0x10, 7), BT_ERR_INVALID);
    bt_lora_free(&b.lo);
    bt_model_free(&b.m);
    rig_free(&a);
}

/* ---- LoRA+ adapters: save -> load -> infer / export ---- */

static char g_dir[64];

static int rm_cb(const char *p, const struct stat *sb, int tf, struct FTW *fw) {
    (void)sb, (void)fw;
    return tf == FTW_DP ? rmdir(p) : unlink(p);
}

static const char *tpath(const char *name) {
    static char buf[4][256];
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "%s/%s", g_dir, name);
    return buf[k];
}

/* "Trained" LoRA+ state: random B, embedding and norms moved away from the base. */
static void trained_plus(bt_model *m, bt_lora *lo, int tied, unsigned trainable) {
    assert_int_equal(bt_model_init_random(m, &k_hp, BT_BASE_FP32, tied, 42), 0);
    assert_int_equal(bt_lora_init(lo, m, 4, 8.0, 0.0, (1u << BT_MOD_Q) | (1u << BT_MOD_V) |
                                     (1u << BT_MOD_DOWN), trainable, 7), 0);
    bt_rng g;
    bt_rng_seed(&g, 123);
    for (int64_t i = 0; i < lo->n_params; i++) lo->params[i] += 0.2f * bt_rng_normal(&g);
}

/* Last-position logits of a fixed prompt through bt_infer (lo may be NULL). */
static void infer_logits(const bt_model *m, const bt_lora *lo, float *out) {
    bt_infer *s = NULL;
    assert_int_equal(bt_infer_new(&s, m, lo, 32, 8), 0);
    assert_int_equal(bt_infer_forward(s, k_ids, 11, BT_INFER_LOGITS_LAST, out), 0);
    bt_infer_free(s);
}

static void assert_same_lora(const bt_lora *a, const bt_lora *b) {
    assert_int_equal(a->r, b->r);
    assert_true(a->scale == b->scale && a->alpha == b->alpha);
    assert_int_equal(a->target_mask, b->target_mask);
    assert_int_equal(a->trainable, b->trainable);
    assert_int_equal(a->tied, b->tied);
    assert_int_equal(a->n_params, b->n_params);
    assert_int_equal(a->n_lora, b->n_lora);
    assert_int_equal(a->n_decay, b->n_decay);
    assert_memory_equal(a->params, b->params, (size_t)a->n_params * sizeof(float));
}

/* Rewrite dir/adapter_model.safetensors without tensor `drop` and with tensor `add` (F32, shape
 * n_dims / shape, every element `fill`) replacing any tensor of that name. */
static void rewrite_weights(const char *dir, const char *drop, const char *add, int n_dims,
                            const int64_t *shape, float fill) {
    char p[300], q[300];
    snprintf(p, sizeof p, "%s/adapter_model.safetensors", dir);
    snprintf(q, sizeof q, "%s/w.tmp", dir);
    bt_st_file *f = NULL;
    assert_int_equal(bt_st_open(&f, p), 0);
    bt_st_writer *w = bt_st_writer_new();
    for (int i = 0; i < bt_st_n_tensors(f); i++) {
        const bt_st_tensor *t = bt_st_tensor_at(f, i);
        if ((drop && !strcmp(t->name, drop)) || (add && !strcmp(t->name, add))) continue;
        size_t n = 4;
        for (int d = 0; d < t->n_dims; d++) n *= (size_t)t->shape[d];
        assert_int_equal(bt_st_w_tensor(w, t->name, t->dtype, t->n_dims, t->shape, t->data, n), 0);
    }
    if (add) {
        size_t n = 1;
        for (int d = 0; d < n_dims; d++) n *= (size_t)shape[d];
        float *x = malloc(n * 4);
        for (size_t i = 0; i < n; i++) x[i] = fill;
        assert_int_equal(bt_st_w_tensor(w, add, BT_ST_F32, n_dims, shape, x, n * 4), 0);
        free(x);
    }
    assert_int_equal(bt_st_writer_write(w, q), 0);
    bt_st_writer_free(w);
    bt_st_close(f);
    assert_int_equal(rename(q, p), 0);
}

static void set_mts(const char *dir, const char *mts_json) {
    char p[300];
    snprintf(p, sizeof p, "%s/adapter_config.json", dir);
    json_t *j = json_load_file(p, 0, NULL);
    assert_non_null(j);
    json_object_set_new(j, "modules_to_save", json_loads(mts_json, JSON_DECODE_ANY, NULL));
    assert_int_equal(json_dump_file(j, p, 0), 0);
    json_decref(j);
}

static void st_expect(const bt_st_file *f, const char *name, const float *want, size_t n) {
    const bt_st_tensor *t = bt_st_find(f, name);
    if (!t) fail_msg("missing %s", name);
    assert_int_equal(t->dtype, BT_ST_F32);
    assert_memory_equal(t->data, want, n * 4);
}

static void roundtrip(int tied) {
    const int D = k_hp.d_model, V = k_hp.vocab, L = k_hp.n_layer;
    bt_model m;
    bt_lora lo, lo2;
    trained_plus(&m, &lo, tied, BT_TRAIN_EMBED | BT_TRAIN_NORM);
    const char *adir = tpath(tied ? "plus_tied" : "plus_untied");
    char dir[256];
    snprintf(dir, sizeof dir, "%s", adir);
    assert_int_equal(bt_adapter_save(&lo, "tiny", dir, NULL), 0);
    /* load back: identical parameters */
    assert_int_equal(bt_lora_load_peft(&lo2, &m, dir), 0);
    assert_same_lora(&lo, &lo2);
    assert_non_null(lo2.embed);
    assert_non_null(lo2.norms);
    /* inference with the loaded adapter == with the in-memory one, != the base */
    float *l1 = malloc((size_t)V * 4), *l2 = malloc((size_t)V * 4), *l0 = malloc((size_t)V * 4);
    infer_logits(&m, &lo, l1);
    infer_logits(&m, &lo2, l2);
    infer_logits(&m, NULL, l0);
    assert_memory_equal(l1, l2, (size_t)V * 4);
    double dmax = 0;
    for (int i = 0; i < V; i++) dmax = fmax(dmax, fabs((double)l1[i] - l0[i]));
    assert_true(dmax > 1e-3);
    /* merged safetensors carry the trained embedding and norms */
    char out[256];
    snprintf(out, sizeof out, "%s", tpath(tied ? "st_tied" : "st_untied"));
    assert_int_equal(bt_export_safetensors_merged(&m, &lo2, BT_EXPORT_F32, NULL, out), 0);
    char p[300];
    snprintf(p, sizeof p, "%s/model.safetensors", out);
    bt_st_file *f = NULL;
    assert_int_equal(bt_st_open(&f, p), 0);
    st_expect(f, "model.embed_tokens.weight", lo.embed, (size_t)V * D);
    st_expect(f, "model.norm.weight", bt_lora_norm(&lo, &m, L, 0), (size_t)D);
    st_expect(f, "model.layers.1.input_layernorm.weight", bt_lora_norm(&lo, &m, 1, 0), (size_t)D);
    st_expect(f, "model.layers.0.post_attention_layernorm.weight", bt_lora_norm(&lo, &m, 0, 1),
              (size_t)D);
    if (tied) assert_null(bt_st_find(f, "lm_head.weight"));
    else st_expect(f, "lm_head.weight", m.lm_head, (size_t)V * D);
    bt_st_close(f);
    /* the driver from a GGUF base: peft (through the shape-only model), merged gguf, gguf-lora */
    char base[256];
    snprintf(base, sizeof base, "%s", tpath(tied ? "base_tied.gguf" : "base_untied.gguf"));
    assert_int_equal(bt_export_gguf_merged(&m, NULL, NULL, BT_EXPORT_F32, base), 0);
    snprintf(out, sizeof out, "%s", tpath(tied ? "peft_tied" : "peft_untied"));
    bt_export_opts o = {base, dir, out, BT_EXPORT_PEFT, -1, 0};
    assert_int_equal(bt_export_run(&o), 0);
    bt_lora lo3;
    assert_int_equal(bt_lora_load_peft(&lo3, &m, out), 0);
    assert_same_lora(&lo, &lo3);
    bt_lora_free(&lo3);
    snprintf(out, sizeof out, "%s", tpath(tied ? "merged_tied.gguf" : "merged_untied.gguf"));
    o = (bt_export_opts){base, dir, out, BT_EXPORT_GGUF, BT_EXPORT_F32, 0};
    assert_int_equal(bt_export_run(&o), 0);
    bt_gguf *g = NULL;
    assert_int_equal(bt_gguf_open(&g, out), 0);
    const bt_gguf_tensor *t = bt_gguf_find_tensor(g, "token_embd.weight");
    assert_non_null(t);
    assert_memory_equal(t->data, lo.embed, (size_t)V * D * 4);
    t = bt_gguf_find_tensor(g, "blk.1.ffn_norm.weight");
    assert_memory_equal(t->data, bt_lora_norm(&lo, &m, 1, 1), (size_t)D * 4);
    t = bt_gguf_find_tensor(g, "output_norm.weight");
    assert_memory_equal(t->data, bt_lora_norm(&lo, &m, L, 0), (size_t)D * 4);
    assert_true((bt_gguf_find_tensor(g, "output.weight") == NULL) == tied);
    bt_gguf_close(g);
    snprintf(out, sizeof out, "%s", tpath("plus_lora.gguf"));
    o = (bt_export_opts){base, dir, out, BT_EXPORT_GGUF_LORA, -1, 0};
    assert_int_equal(bt_export_run(&o), BT_ERR_UNSUPPORTED);
    assert_non_null(strstr(bt_last_error(), "gguf-lora"));
    struct stat sb;
    assert_int_not_equal(stat(out, &sb), 0);
    free(l0), free(l1), free(l2);
    bt_lora_free(&lo2);
    bt_lora_free(&lo);
    bt_model_free(&m);
}

static void test_adapter_roundtrip_tied(void **st) {
    (void)st;
    roundtrip(1);
}

static void test_adapter_roundtrip_untied(void **st) {
    (void)st;
    roundtrip(0);
}

/* embed-only and norm-only adapters; a subset of norms listed (unlisted norms keep the base) */
static void test_adapter_partial(void **st) {
    (void)st;
    const int D = k_hp.d_model, L = k_hp.n_layer;
    bt_model m;
    bt_lora lo, lo2;
    trained_plus(&m, &lo, 1, BT_TRAIN_EMBED);
    char dir[256];
    snprintf(dir, sizeof dir, "%s", tpath("embed_only"));
    assert_int_equal(bt_adapter_save(&lo, "tiny", dir, NULL), 0);
    assert_int_equal(bt_lora_load_peft(&lo2, &m, dir), 0);
    assert_same_lora(&lo, &lo2);
    assert_null(lo2.norms);
    bt_lora_free(&lo2);
    /* the tied lm_head entry is optional */
    rewrite_weights(dir, "base_model.model.lm_head.weight", NULL, 0, NULL, 0);
    set_mts(dir, "[\"embed_tokens\"]");
    assert_int_equal(bt_lora_load_peft(&lo2, &m, dir), 0);
    assert_same_lora(&lo, &lo2);
    bt_lora_free(&lo2);
    bt_lora_free(&lo);
    bt_model_free(&m);
    trained_plus(&m, &lo, 0, BT_TRAIN_NORM);
    snprintf(dir, sizeof dir, "%s", tpath("norm_only"));
    assert_int_equal(bt_adapter_save(&lo, "tiny", dir, NULL), 0);
    assert_int_equal(bt_lora_load_peft(&lo2, &m, dir), 0);
    assert_same_lora(&lo, &lo2);
    assert_null(lo2.embed);
    bt_lora_free(&lo2);
    /* only the final norm listed and saved: the layer norms are the base's */
    for (int l = 0; l < L; l++)
        for (int which = 0; which < 2; which++) {
            char key[128];
            snprintf(key, sizeof key, "base_model.model.model.layers.%d.%s.weight", l,
                     which ? "post_attention_layernorm" : "input_layernorm");
            rewrite_weights(dir, key, NULL, 0, NULL, 0);
        }
    set_mts(dir, "[\"norm\"]");
    assert_int_equal(bt_lora_load_peft(&lo2, &m, dir), 0);
    assert_memory_equal(bt_lora_norm(&lo2, &m, L, 0), bt_lora_norm(&lo, &m, L, 0), (size_t)D * 4);
    assert_memory_equal(bt_lora_norm(&lo2, &m, 1, 0), m.layers[1].attn_norm, (size_t)D * 4);
    assert_memory_equal(bt_lora_norm(&lo2, &m, 0, 1), m.layers[0].ffn_norm, (size_t)D * 4);
    bt_lora_free(&lo2);
    /* ... but a listed norm must be there */
    set_mts(dir, "[\"norm\", \"input_layernorm\"]");
    assert_int_equal(bt_lora_load_peft(&lo2, &m, dir), BT_ERR_NOTFOUND);
    assert_non_null(strstr(bt_last_error(), "input_layernorm"));
    bt_lora_free(&lo);
    bt_model_free(&m);
}

static void test_adapter_errors(void **st) {
    (void)st;
    const int D = k_hp.d_model, V = k_hp.vocab;
    bt_model m, mu;
    bt_lora lo, lo2;
    trained_plus(&m, &lo, 1, BT_TRAIN_EMBED | BT_TRAIN_NORM);
    assert_int_equal(bt_model_init_random(&mu, &k_hp, BT_BASE_FP32, 0, 42), 0);
    char dir[256];
    snprintf(dir, sizeof dir, "%s", tpath("bad_plus"));
    /* lm_head listed against an untied base */
    assert_int_equal(bt_adapter_save(&lo, "tiny", dir, NULL), 0);
    assert_int_equal(bt_lora_load_peft(&lo2, &mu, dir), BT_ERR_UNSUPPORTED);
    assert_non_null(strstr(bt_last_error(), "lm_head"));
    assert_null(lo2.params);
    /* unknown entry; lm_head without embed_tokens; not a list */
    set_mts(dir, "[\"embed_tokens\", \"wte\"]");
    assert_int_equal(bt_lora_load_peft(&lo2, &m, dir), BT_ERR_UNSUPPORTED);
    assert_non_null(strstr(bt_last_error(), "wte"));
    set_mts(dir, "[\"lm_head\", \"norm\"]");
    assert_int_equal(bt_lora_load_peft(&lo2, &m, dir), BT_ERR_UNSUPPORTED);
    set_mts(dir, "\"embed_tokens\"");
    assert_int_equal(bt_lora_load_peft(&lo2, &m, dir), BT_ERR_FORMAT);
    /* modules_to_save null while the file holds the dense tensors: unexpected tensor */
    set_mts(dir, "null");
    assert_int_equal(bt_lora_load_peft(&lo2, &m, dir), BT_ERR_FORMAT);
    assert_non_null(strstr(bt_last_error(), "unexpected tensor"));
    /* a tied lm_head that differs from the embedding */
    set_mts(dir, "[\"embed_tokens\", \"lm_head\", \"input_layernorm\", \"post_attention_layernorm\", \"norm\"]");
    int64_t se[2] = {V, D}, bad[2] = {V - 1, D}, sn[1] = {D}, sn2[2] = {1, D};
    rewrite_weights(dir, NULL, "base_model.model.lm_head.weight", 2, se, 0.5f);
    assert_int_equal(bt_lora_load_peft(&lo2, &m, dir), BT_ERR_UNSUPPORTED);
    assert_non_null(strstr(bt_last_error(), "differs"));
    /* missing / misshapen embedding, misshapen norm, non-finite norm */
    rewrite_weights(dir, "base_model.model.lm_head.weight", NULL, 0, NULL, 0);
    set_mts(dir, "[\"embed_tokens\", \"norm\"]");
    assert_int_equal(bt_lora_load_peft(&lo2, &m, dir), 0);
    bt_lora_free(&lo2);
    rewrite_weights(dir, "base_model.model.model.embed_tokens.weight", NULL, 0, NULL, 0);
    assert_int_equal(bt_lora_load_peft(&lo2, &m, dir), BT_ERR_NOTFOUND);
    assert_non_null(strstr(bt_last_error(), "embed_tokens"));
    rewrite_weights(dir, NULL, "base_model.model.model.embed_tokens.weight", 2, bad, 0.f);
    assert_int_equal(bt_lora_load_peft(&lo2, &m, dir), BT_ERR_FORMAT);
    assert_non_null(strstr(bt_last_error(), "shape"));
    rewrite_weights(dir, NULL, "base_model.model.model.embed_tokens.weight", 2, se, 0.f);
    rewrite_weights(dir, NULL, "base_model.model.model.norm.weight", 2, sn2, 1.f);
    assert_int_equal(bt_lora_load_peft(&lo2, &m, dir), BT_ERR_FORMAT);
    rewrite_weights(dir, NULL, "base_model.model.model.norm.weight", 1, sn, 1.f);
    char wp[300]; /* a NaN put in afterwards: the writer refuses non-finite tensors (issue 10 §4) */
    snprintf(wp, sizeof wp, "%s/adapter_model.safetensors", dir);
    assert_int_equal(tu_st_put_nan(wp, "base_model.model.model.norm.weight", 3), 1);
    assert_int_equal(bt_lora_load_peft(&lo2, &m, dir), BT_ERR_FORMAT);
    assert_non_null(strstr(bt_last_error(), "non-finite"));
    rewrite_weights(dir, NULL, "base_model.model.model.norm.weight", 1, sn, 1.f);
    assert_int_equal(bt_lora_load_peft(&lo2, &m, dir), 0);
    bt_lora_free(&lo2);
    bt_lora_free(&lo);
    bt_model_free(&mu);
    bt_model_free(&m);
}

static int setup(void **st) {
    (void)st;
    strcpy(g_dir, "/tmp/bt_test_loraplus_XXXXXX");
    return mkdtemp(g_dir) ? 0 : -1;
}
static int teardown(void **st) {
    (void)st;
    nftw(g_dir, rm_cb, 16, FTW_DEPTH | FTW_PHYS);
    return 0;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_linear_ce_dw),    cmocka_unit_test(test_embedding_bwd),
        cmocka_unit_test(test_grad_tied),       cmocka_unit_test(test_grad_untied),
        cmocka_unit_test(test_plain_unchanged), cmocka_unit_test(test_adapter_roundtrip_tied),
        cmocka_unit_test(test_adapter_roundtrip_untied), cmocka_unit_test(test_adapter_partial),
        cmocka_unit_test(test_adapter_errors),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
