/* Parity of the CPU (fp32) trainer with Hugging Face transformers + PEFT on the tiny Llama
 * fixtures (tests/fixtures/hf, made by tests/reference/gen_hf_fixtures.py; tolerances from
 * tests/reference/README.md): the HF directory loader (sharded safetensors, tied and untied
 * lm_head), logits / hidden states / loss / token NLL / per-document loss of the packed batch,
 * per-document isolation (each document alone gives the fixture's doc_loss), the PEFT adapter
 * loader, LoRA gradients, one AdamW step from the reference gradients, and gradient accumulation
 * over two micro-batches with the global 1/total-labelled scale (not the mean of means).
 * Measured errors are printed ("parity: ...") for the issue log. Run from the repo root
 * (BT_HF_FIXTURES overrides the fixture directory). */
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

#include "common/bt_common.h"
#include "common/safetensors.h"
#include "kernels/kernels.h"
#include "trainer/io/adapter.h"
#include "trainer/io/adapter_load.h"
#include "trainer/model/lora.h"
#include "trainer/model/model.h"
#include "trainer/loop/step.h"

enum { PB = 2, PT = 32, PM = PB * PT };

static const char *fixdir(void) {
    const char *d = getenv("BT_HF_FIXTURES");
    return d && *d ? d : "tests/fixtures/hf";
}

static bt_st_file *open_fix(const char *rel) {
    char p[512];
    snprintf(p, sizeof p, "%s/%s", fixdir(), rel);
    bt_st_file *f = NULL;
    if (bt_st_open(&f, p)) fail_msg("cannot open fixture %s: %s", p, bt_last_error());
    return f;
}

/* Tensor `name` of f with the expected dtype and element count. */
static const void *fix_data(const bt_st_file *f, const char *name, bt_st_dtype dt, int64_t n) {
    const bt_st_tensor *t = bt_st_find(f, name);
    if (!t) fail_msg("fixture tensor %s missing", name);
    assert_int_equal(t->dtype, dt);
    assert_int_equal((int64_t)(t->nbytes / bt_st_dtype_size(dt)), n);
    return t->data;
}

static const float *fix_f32(const bt_st_file *f, const char *name, int64_t n) {
    return fix_data(f, name, BT_ST_F32, n);
}

/* ---- the packed batch ---- */

typedef struct {
    int32_t ids[PM], lab[PM], pos[PM], cu[PM + 1];
    int n_cu;
    uint8_t allowed[PB * PT * PT];
} packed_batch;

static void load_batch(packed_batch *b) {
    bt_st_file *f = open_fix("packed_batch.safetensors");
    memcpy(b->ids, fix_data(f, "input_ids", BT_ST_I32, PM), sizeof b->ids);
    memcpy(b->lab, fix_data(f, "labels", BT_ST_I32, PM), sizeof b->lab);
    memcpy(b->pos, fix_data(f, "position_ids", BT_ST_I32, PM), sizeof b->pos);
    const bt_st_tensor *cu = bt_st_find(f, "cu_seqlens");
    assert_non_null(cu);
    b->n_cu = (int)(cu->nbytes / 4);
    assert_int_equal(b->n_cu, 7);
    memcpy(b->cu, cu->data, cu->nbytes);
    memcpy(b->allowed, fix_data(f, "attn_allowed", BT_ST_U8, PB * PT * PT), sizeof b->allowed);
    bt_st_close(f);
    /* the fixture's mask is exactly "same cu_seqlens segment and causal" (what bt_attn_fwd does) */
    for (int r = 0; r < PB; r++)
        for (int t = 0; t < PT; t++)
            for (int s = 0; s < PT; s++) {
                int seg_t = 0, seg_s = 0;
                for (int k = 1; k < b->n_cu; k++) {
                    seg_t += r * PT + t >= b->cu[k];
                    seg_s += r * PT + s >= b->cu[k];
                }
                assert_int_equal(b->allowed[(r * PT + t) * PT + s], seg_t == seg_s && s <= t);
            }
}

static bt_microbatch whole(const packed_batch *b) {
    bt_microbatch mb = {PB, PT, b->ids, b->lab, b->pos, b->cu, b->n_cu};
    return mb;
}

/* Row `r` alone as a [1, PT] micro-batch (cu_seqlens rebased into cu_out). */
static bt_microbatch row_mb(const packed_batch *b, int r, int32_t *cu_out) {
    int n = 0;
    for (int k = 0; k < b->n_cu; k++)
        if (b->cu[k] >= r * PT && b->cu[k] <= (r + 1) * PT) cu_out[n++] = b->cu[k] - r * PT;
    bt_microbatch mb = {1, PT, b->ids + r * PT, b->lab + r * PT, b->pos + r * PT, cu_out, n};
    return mb;
}

/* ---- helpers ---- */

static void load_model(bt_model *m, const char *variant) {
    char dir[512];
    snprintf(dir, sizeof dir, "%s/%s", fixdir(), variant);
    bt_model_load_opts o = {BT_BASE_FP32, 0};
    if (bt_model_load(m, dir, &o)) fail_msg("loading %s: %s", dir, bt_last_error());
}

static double max_abs_diff(const float *a, const float *b, int64_t n) {
    double d = 0;
    for (int64_t i = 0; i < n; i++) d = fmax(d, fabs((double)a[i] - b[i]));
    return d;
}

static double max_abs(const float *a, int64_t n) {
    double d = 0;
    for (int64_t i = 0; i < n; i++) d = fmax(d, fabs((double)a[i]));
    return d;
}

/* token_nll[t] = CE(logits[t], target[t]) in double (0 where target is -100); targets from
 * bt_shift_targets (labels shifted within each segment). */
static void token_nll(double *nll, const float *logits, const int32_t *targets, int M, int V) {
    for (int t = 0; t < M; t++) {
        nll[t] = 0;
        if (targets[t] == -100) continue;
        const float *z = logits + (size_t)t * V;
        double mx = z[0], s = 0;
        for (int v = 1; v < V; v++) mx = fmax(mx, z[v]);
        for (int v = 0; v < V; v++) s += exp((double)z[v] - mx);
        nll[t] = mx + log(s) - z[targets[t]];
    }
}

/* Per-document mean loss over the labelled targets of each cu_seqlens segment that has any
 * (in order; the padding segment has none). Returns the count. */
static int doc_losses(double *out, const double *nll, const int32_t *targets, const int32_t *cu,
                      int n_cu) {
    int n = 0;
    for (int k = 0; k + 1 < n_cu; k++) {
        double s = 0;
        int c = 0;
        for (int t = cu[k]; t < cu[k + 1]; t++)
            if (targets[t] != -100) s += nll[t], c++;
        if (c) out[n++] = s / c;
    }
    return n;
}

/* ---- base model parity ---- */

static void check_base(const char *variant) {
    packed_batch b;
    load_batch(&b);
    bt_model m;
    load_model(&m, variant);
    assert_int_equal(m.hp.vocab, 384);
    assert_int_equal(m.hp.n_layer, 2);
    assert_int_equal(m.tied, strcmp(variant, "tiny-llama-tied") == 0);
    int V = m.hp.vocab, D = m.hp.d_model;
    char rel[256];
    snprintf(rel, sizeof rel, "%s.ref.safetensors", variant);
    bt_st_file *ref = open_fix(rel);
    bt_step_ctx *ctx;
    assert_int_equal(bt_step_ctx_new(&ctx, &m, NULL, PM, 0), 0);
    bt_microbatch mb = whole(&b);

    float *logits = malloc((size_t)PM * V * sizeof(float));
    assert_int_equal(bt_forward_logits(ctx, &m, NULL, &mb, logits), 0);
    const float *rl = fix_f32(ref, "logits", (int64_t)PM * V);
    double e_logits = max_abs_diff(logits, rl, (int64_t)PM * V);
    /* hidden_states: [0] embeddings, [1] after layer 0, [2] final norm of layer 1's output */
    const float *rh = fix_f32(ref, "hidden_states", 3 * (int64_t)PM * D);
    double e_h[3];
    const float *ours[3] = {bt_step_hidden(ctx, 0), bt_step_hidden(ctx, 1),
                            bt_step_hidden(ctx, m.hp.n_layer + 1)};
    for (int i = 0; i < 3; i++) e_h[i] = max_abs_diff(ours[i], rh + (size_t)i * PM * D, PM * D);

    int32_t targets[PM];
    assert_int_equal(bt_shift_targets(targets, &mb, V), 49);
    double nll[PM], dl[PM];
    token_nll(nll, logits, targets, PM, V);
    const float *rnll = fix_f32(ref, "token_nll", PM);
    double e_nll = 0;
    for (int t = 0; t < PM; t++) e_nll = fmax(e_nll, fabs(nll[t] - rnll[t]));
    const float *rdl = fix_f32(ref, "doc_loss", 5);
    assert_int_equal(doc_losses(dl, nll, targets, b.cu, b.n_cu), 5);
    double e_doc = 0;
    for (int k = 0; k < 5; k++) e_doc = fmax(e_doc, fabs(dl[k] - rdl[k]));

    /* the training path's loss (chunked fused lm_head + CE) */
    double s;
    int nv;
    assert_int_equal(bt_forward_backward(ctx, &m, NULL, &mb, 0, 1.f, 0, &s, &nv), 0);
    assert_int_equal(nv, 49);
    double e_loss = fabs(s / nv - fix_f32(ref, "loss", 1)[0]);

    /* isolation: each document alone (its own [1, len] micro-batch) gives the same doc loss */
    double e_iso = 0;
    int k = 0;
    for (int seg = 0; seg + 1 < b.n_cu; seg++) {
        int a = b.cu[seg], len = b.cu[seg + 1] - a;
        int32_t cu1[2] = {0, len};
        bt_microbatch one = {1, len, b.ids + a, b.lab + a, b.pos + a, cu1, 2};
        assert_int_equal(bt_forward_backward(ctx, &m, NULL, &one, 0, 1.f, 0, &s, &nv), 0);
        if (nv == 0) continue; /* padding */
        e_iso = fmax(e_iso, fabs(s / nv - rdl[k++]));
    }
    assert_int_equal(k, 5);

    print_message("parity: %s: logits max abs err %.3g (max |logit| %.3g), hidden_states %.3g / "
                  "%.3g / %.3g, loss %.3g, token_nll %.3g, doc_loss %.3g, doc alone %.3g\n",
                  variant, e_logits, max_abs(rl, (int64_t)PM * V), e_h[0], e_h[1], e_h[2], e_loss,
                  e_nll, e_doc, e_iso);
    assert_true(e_logits <= 1e-4);
    for (int i = 0; i < 3; i++) assert_true(e_h[i] <= 1e-4);
    assert_true(e_loss <= 1e-5);
    assert_true(e_nll <= 1e-5);
    assert_true(e_doc <= 1e-5);
    assert_true(e_iso <= 1e-5);
    /* the check can fail: the other variant's logits are far away */
    const char *other = strcmp(variant, "tiny-llama-tied") ? "tiny-llama-tied.ref.safetensors"
                                                           : "tiny-llama-untied.ref.safetensors";
    bt_st_file *oref = open_fix(other);
    assert_true(max_abs_diff(logits, fix_f32(oref, "logits", (int64_t)PM * V), PM * V) > 0.1);
    bt_st_close(oref);

    free(logits);
    bt_st_close(ref);
    bt_step_ctx_free(ctx);
    bt_model_free(&m);
}

static void test_tied(void **st) {
    (void)st;
    check_base("tiny-llama-tied");
}

static void test_untied(void **st) {
    (void)st;
    check_base("tiny-llama-untied");
}

/* ---- LoRA ---- */

typedef struct {
    packed_batch b;
    bt_model m;
    bt_lora lo;
    bt_step_ctx *ctx;
} lora_rig;

static void lora_rig_init(lora_rig *r) {
    load_batch(&r->b);
    load_model(&r->m, "tiny-llama-tied");
    char dir[512];
    snprintf(dir, sizeof dir, "%s/lora/adapter-init", fixdir());
    if (bt_lora_load_peft(&r->lo, &r->m, dir)) fail_msg("%s", bt_last_error());
    assert_int_equal(r->lo.r, 4);
    assert_true(r->lo.scale == 2.0f);
    assert_true(r->lo.dropout == 0.0f);
    assert_int_equal(r->lo.target_mask, (1u << BT_MOD_N) - 1);
    assert_int_equal(bt_step_ctx_new(&r->ctx, &r->m, &r->lo, PM, 0), 0);
}

static void lora_rig_free(lora_rig *r) {
    bt_step_ctx_free(r->ctx);
    bt_lora_free(&r->lo);
    bt_model_free(&r->m);
}

/* max over LoRA tensors of max|g - ref| / max|ref| (ref keys = prefix + PEFT key). */
static double grads_rel_err(const bt_lora *lo, const bt_st_file *f, const char *prefix,
                            int use_params) {
    double worst = 0;
    char key[192], name[256];
    for (int l = 0; l < lo->n_layer; l++)
        for (int mod = 0; mod < BT_MOD_N; mod++) {
            const bt_lora_mod *md = bt_lora_get(lo, l, mod);
            for (int isB = 0; isB < 2; isB++) {
                bt_adapter_key(key, sizeof key, l, mod, isB);
                snprintf(name, sizeof name, "%s%s", prefix, key);
                int64_t n = isB ? (int64_t)md->out * lo->r : (int64_t)lo->r * md->in;
                const float *g = use_params ? (isB ? md->B : md->A) : (isB ? md->dB : md->dA);
                const float *rg = fix_f32(f, name, n);
                double den = max_abs(rg, n);
                assert_true(den > 0);
                worst = fmax(worst, max_abs_diff(g, rg, n) / den);
            }
        }
    return worst;
}

static void test_lora_forward_grads(void **st) {
    (void)st;
    lora_rig r;
    lora_rig_init(&r);
    int V = r.m.hp.vocab;
    bt_microbatch mb = whole(&r.b);
    bt_st_file *ref = open_fix("lora/lora_ref.safetensors");
    float *logits = malloc((size_t)PM * V * sizeof(float));
    assert_int_equal(bt_forward_logits(r.ctx, &r.m, &r.lo, &mb, logits), 0);
    double e_logits = max_abs_diff(logits, fix_f32(ref, "logits", (int64_t)PM * V), PM * V);
    int32_t targets[PM];
    bt_shift_targets(targets, &mb, V);
    double nll[PM], dl[5];
    token_nll(nll, logits, targets, PM, V);
    assert_int_equal(doc_losses(dl, nll, targets, r.b.cu, r.b.n_cu), 5);
    const float *rdl = fix_f32(ref, "doc_loss", 5), *rnll = fix_f32(ref, "token_nll", PM);
    double e_doc = 0, e_nll = 0;
    for (int k = 0; k < 5; k++) e_doc = fmax(e_doc, fabs(dl[k] - rdl[k]));
    for (int t = 0; t < PM; t++) e_nll = fmax(e_nll, fabs(nll[t] - rnll[t]));

    bt_lora_zero_grad(&r.lo);
    double s;
    int nv;
    assert_int_equal(bt_forward_backward(r.ctx, &r.m, &r.lo, &mb, 1, 1.f / 49.f, 0, &s, &nv), 0);
    assert_int_equal(nv, 49);
    double e_loss = fabs(s / nv - fix_f32(ref, "loss", 1)[0]);
    bt_st_file *gf = open_fix("lora/lora_grads.safetensors");
    assert_int_equal(bt_st_n_tensors(gf), 28);
    double e_grad = grads_rel_err(&r.lo, gf, "", 0);
    print_message("parity: lora: logits max abs err %.3g, loss %.3g, token_nll %.3g, doc_loss "
                  "%.3g, grads max rel err %.3g\n", e_logits, e_loss, e_nll, e_doc, e_grad);
    assert_true(e_logits <= 1e-4);
    assert_true(e_loss <= 1e-5);
    assert_true(e_nll <= 1e-5);
    assert_true(e_doc <= 1e-5);
    assert_true(e_grad <= 1e-4);
    /* can fail: the same grads at twice the scale are far off */
    bt_scale(r.lo.grads, r.lo.n_params, 2.f);
    assert_true(grads_rel_err(&r.lo, gf, "", 0) > 0.5);
    bt_st_close(gf);
    bt_st_close(ref);
    free(logits);
    lora_rig_free(&r);
}

static double manifest_num(json_t *root, const char *a, const char *b, int idx) {
    json_t *v = json_object_get(json_object_get(root, a), b);
    if (idx >= 0) v = json_array_get(v, (size_t)idx);
    if (!json_is_number(v)) fail_msg("manifest.json: %s.%s[%d] missing", a, b, idx);
    return json_number_value(v);
}

static void test_adamw_step(void **st) {
    (void)st;
    lora_rig r;
    lora_rig_init(&r);
    char p[512];
    snprintf(p, sizeof p, "%s/manifest.json", fixdir());
    json_error_t je;
    json_t *man = json_load_file(p, 0, &je);
    assert_non_null(man);
    json_t *lora = json_object_get(man, "lora");
    double lr = manifest_num(lora, "adamw", "lr", -1), b1 = manifest_num(lora, "adamw", "betas", 0),
           b2 = manifest_num(lora, "adamw", "betas", 1), eps = manifest_num(lora, "adamw", "eps", -1),
           wd = manifest_num(lora, "adamw", "weight_decay", -1);
    assert_true(lr == 1e-3 && wd == 0.01);
    /* the reference grads go in (so only the optimiser is tested) */
    bt_st_file *gf = open_fix("lora/lora_grads.safetensors");
    char key[192];
    for (int l = 0; l < r.lo.n_layer; l++)
        for (int mod = 0; mod < BT_MOD_N; mod++) {
            const bt_lora_mod *md = bt_lora_get(&r.lo, l, mod);
            bt_adapter_key(key, sizeof key, l, mod, 0);
            memcpy(md->dA, fix_f32(gf, key, (int64_t)r.lo.r * md->in),
                   (size_t)r.lo.r * md->in * 4);
            bt_adapter_key(key, sizeof key, l, mod, 1);
            memcpy(md->dB, fix_f32(gf, key, (int64_t)md->out * r.lo.r),
                   (size_t)md->out * r.lo.r * 4);
        }
    bt_adamw_step(r.lo.params, r.lo.grads, r.lo.m, r.lo.v, r.lo.n_params, (float)lr, (float)b1,
                  (float)b2, (float)eps, (float)wd, 1);
    bt_st_file *af = open_fix("lora/lora_after_adamw.safetensors");
    bt_st_file *sf = open_fix("lora/lora_adamw_state.safetensors");
    double e_p = 0, e_m = 0, e_v = 0;
    char name[256];
    for (int l = 0; l < r.lo.n_layer; l++)
        for (int mod = 0; mod < BT_MOD_N; mod++) {
            const bt_lora_mod *md = bt_lora_get(&r.lo, l, mod);
            for (int isB = 0; isB < 2; isB++) {
                bt_adapter_key(key, sizeof key, l, mod, isB);
                const float *pp = isB ? md->B : md->A;
                int64_t n = isB ? (int64_t)md->out * r.lo.r : (int64_t)r.lo.r * md->in;
                int64_t off = pp - r.lo.params;
                e_p = fmax(e_p, max_abs_diff(pp, fix_f32(af, key, n), n));
                snprintf(name, sizeof name, "exp_avg.%s", key);
                const float *rm = fix_f32(sf, name, n);
                e_m = fmax(e_m, max_abs_diff(r.lo.m + off, rm, n) / max_abs(rm, n));
                snprintf(name, sizeof name, "exp_avg_sq.%s", key);
                const float *rv = fix_f32(sf, name, n);
                e_v = fmax(e_v, max_abs_diff(r.lo.v + off, rv, n) / max_abs(rv, n));
            }
        }
    print_message("parity: adamw (lr %g, betas %g/%g, eps %g, wd %g): params max abs err %.3g, "
                  "exp_avg rel %.3g, exp_avg_sq rel %.3g\n", lr, b1, b2, eps, wd, e_p, e_m, e_v);
    assert_true(e_p <= 1e-6);
    assert_true(e_m <= 1e-4);
    assert_true(e_v <= 1e-4);
    /* can fail: the initial params are lr-sized steps away from the result */
    bt_lora init;
    char dir[512];
    snprintf(dir, sizeof dir, "%s/lora/adapter-init", fixdir());
    assert_int_equal(bt_lora_load_peft(&init, &r.m, dir), 0);
    assert_true(max_abs_diff(init.params, r.lo.params, r.lo.n_params) > 5e-4);
    bt_lora_free(&init);
    bt_st_close(af);
    bt_st_close(sf);
    bt_st_close(gf);
    json_decref(man);
    lora_rig_free(&r);
}

static void test_grad_accum(void **st) {
    (void)st;
    lora_rig r;
    lora_rig_init(&r);
    bt_st_file *ga = open_fix("lora/grad_accum.safetensors");
    const int32_t *mb_tok = fix_data(ga, "mb_labelled_tokens", BT_ST_I32, 2);
    const float *mb_loss = fix_f32(ga, "mb_loss", 2);
    int32_t total_ref = ((const int32_t *)fix_data(ga, "total_labelled_tokens", BT_ST_I32, 1))[0];
    float full_loss = fix_f32(ga, "full_loss", 1)[0];
    int32_t cu[2][PM + 1];
    bt_microbatch mbs[2] = {row_mb(&r.b, 0, cu[0]), row_mb(&r.b, 1, cu[1])};
    int cnt[2], total = 0;
    for (int k = 0; k < 2; k++) {
        cnt[k] = bt_shift_targets(NULL, &mbs[k], r.m.hp.vocab);
        assert_int_equal(cnt[k], mb_tok[k]);
        total += cnt[k];
    }
    assert_int_equal(total, total_ref);
    bt_lora_zero_grad(&r.lo);
    float *g0 = malloc((size_t)r.lo.n_params * 4);
    double sums[2], e_mb = 0, e_loss = 0;
    for (int k = 0; k < 2; k++) {
        int nv;
        assert_int_equal(bt_forward_backward(r.ctx, &r.m, &r.lo, &mbs[k], 1, 1.f / (float)total,
                                             0, &sums[k], &nv),
                         0);
        assert_int_equal(nv, cnt[k]);
        e_loss = fmax(e_loss, fabs(sums[k] / total - mb_loss[k]));
        if (k == 0) {
            e_mb = grads_rel_err(&r.lo, ga, "mb0.", 0);
            memcpy(g0, r.lo.grads, (size_t)r.lo.n_params * 4);
        }
    }
    double e_full = grads_rel_err(&r.lo, ga, "full.", 0);
    /* mb1's own gradient = accumulated - mb0's */
    for (int64_t i = 0; i < r.lo.n_params; i++) r.lo.grads[i] -= g0[i];
    e_mb = fmax(e_mb, grads_rel_err(&r.lo, ga, "mb1.", 0));
    free(g0);
    double accumulated = (sums[0] + sums[1]) / total;
    double naive = 0.5 * (sums[0] / cnt[0] + sums[1] / cnt[1]);
    char p[512];
    snprintf(p, sizeof p, "%s/manifest.json", fixdir());
    json_error_t je;
    json_t *man = json_load_file(p, 0, &je);
    assert_non_null(man);
    double naive_ref = json_number_value(json_object_get(
        json_object_get(json_object_get(json_object_get(man, "lora"), "results"), "grad_accum"),
        "naive_mean_of_means_loss"));
    json_decref(man);
    print_message("parity: grad accumulation: mb_loss max abs err %.3g, mb0/mb1 grads rel %.3g, "
                  "accumulated vs full grads rel %.3g, loss %.7g vs full %.7g (mean of means "
                  "%.7g, ref %.7g)\n", e_loss, e_mb, e_full, accumulated, full_loss, naive,
                  naive_ref);
    assert_true(e_loss <= 1e-5);
    assert_true(e_mb <= 1e-4);
    assert_true(e_full <= 1e-4);
    assert_true(fabs(accumulated - full_loss) <= 1e-5);
    assert_true(fabs(naive - naive_ref) <= 1e-5);     /* we do compute the naive value right */
    assert_true(fabs(naive - full_loss) > 1e-2);       /* and it is not what the trainer uses */
    bt_st_close(ga);
    lora_rig_free(&r);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tied),
        cmocka_unit_test(test_untied),
        cmocka_unit_test(test_lora_forward_grads),
        cmocka_unit_test(test_adamw_step),
        cmocka_unit_test(test_grad_accum),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
