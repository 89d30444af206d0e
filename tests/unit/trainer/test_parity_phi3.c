/* Parity of the CPU (fp32) trainer with transformers 5.23 + PEFT 0.21 on a tiny random Phi-3
 * (tests/fixtures/hf/phi3, made by tests/reference/gen_phi3_fixtures.py; see its docstring for
 * the files), loaded from its Hugging Face directory (fused self_attn.qkv_proj and
 * mlp.gate_up_proj split into q/k/v and gate/up at load) and from its GGUF (general.architecture
 * "phi3", fused blk.N.attn_qkv / blk.N.ffn_up as gguf-py's TensorNameMap names them), dequantised
 * to fp32 and kept as GGUF blocks (base_dtype "gguf"): logits and loss of the packed batch without
 * and with the PEFT adapter (LoRA on every linear as PEFT names them for Phi-3: the fused
 * qkv_proj and gate_up_proj with one lora_A each, o_proj, down_proj), the LoRA gradients (the
 * fused lora_A / lora_B included), and the inference path (KV cache, two chunks) against the same
 * logits. The checks can fail: with gate and up swapped (a wrong split of gate_up_proj) the logits
 * are far off. Also: part of a fused group refused, adapters of another family refused, the
 * adapter round trip (save, load: same bytes), merged GGUF / safetensors loaded back, the sliding
 * window, and the refusals of what is not implemented ("longrope" / "su" RoPE scaling from HF
 * and GGUF, partial_rotary_factor != 1; device "cuda" is in tests/emu). Tolerances: logits 1e-4 absolute, loss 1e-5, LoRA gradients 1e-4 relative to their
 * max (the tiny-Llama parity's, tests/reference/README.md). Run from the repo root
 * (BT_HF_FIXTURES overrides tests/fixtures/hf). */
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
#include <sys/stat.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "common/safetensors.h"
#include "trainer/config.h"
#include "trainer/estimate.h"
#include "trainer/infer/infer.h"
#include "trainer/io/adapter.h"
#include "trainer/io/adapter_load.h"
#include "trainer/io/checkpoint.h"
#include "trainer/io/export.h"
#include "trainer/loop/step.h"
#include "trainer/model/lora.h"
#include "trainer/model/model.h"
#include "tests/unit/util/parity_util.h"
#include "tests/unit/util/test_util.h"
#include "trainer/model/model_internal.h"

enum { PB = TU_FIX_B, PT = TU_FIX_T, PM = TU_FIX_M, NV = 260 };

static bt_st_file *open_fix(const char *rel) { return tu_fix_open("phi3", rel); }

static const float *fix_f32(const bt_st_file *f, const char *name, int64_t n) {
    return tu_st_data((bt_st_file *)f, name, BT_ST_F32, n);
}

typedef tu_fix_batch batch;

/* source: "hf" (the directory), "gguf" (model.gguf dequantised to fp32), "native" (model.gguf
 * kept as BF16 blocks, base_dtype "gguf") */
static void load_model(bt_model *m, const char *source) {
    char p[512];
    int gg = strcmp(source, "hf") != 0;
    snprintf(p, sizeof p, "%s/phi3/%s", tu_hf_fixdir(), gg ? "model.gguf" : "hf");
    bt_model_load_opts o = {!strcmp(source, "native") ? BT_BASE_GGUF : BT_BASE_FP32, 0};
    if (bt_model_load(m, p, &o)) fail_msg("loading %s: %s", p, bt_last_error());
    assert_int_equal(m->hp.arch, BT_ARCH_PHI3);
    assert_int_equal(m->hp.qk_norm, 0);
    assert_int_equal(m->hp.head_dim, 8);
    assert_int_equal(m->hp.n_head, 4);
    assert_int_equal(m->hp.n_kv_head, 2);
    assert_int_equal(m->hp.d_model, 32);
    assert_int_equal(m->hp.d_ff, 64);
    assert_int_equal(m->hp.vocab, NV);
    assert_int_equal(m->tied, 0);
    assert_true(m->hp.rope_theta == 10000.0f);
    for (int l = 0; l < m->hp.n_layer; l++)
        for (int j = 0; j < BT_MOD_N; j++) {
            int rows, cols;
            bt_model_lin_shape(&m->hp, j, &rows, &cols);
            assert_int_equal(m->layers[l].lin[j].rows, rows);
            assert_int_equal(m->layers[l].lin[j].cols, cols);
            assert_null(m->layers[l].lin[j].bias);
        }
}

static void check_source(const char *source) {
    batch b;
    bt_microbatch mb = tu_fix_load_batch("phi3", &b);
    bt_model m;
    load_model(&m, source);
    bt_st_file *ref = open_fix("ref.safetensors");
    const float *rl_base = fix_f32(ref, "logits_base", (int64_t)PM * NV);
    float *logits = malloc((size_t)PM * NV * sizeof(float));

    bt_lora lo;
    char dir[512];
    snprintf(dir, sizeof dir, "%s/phi3/adapter-init", tu_hf_fixdir());
    if (bt_lora_load_peft(&lo, &m, dir)) fail_msg("%s", bt_last_error());
    assert_int_equal(lo.target_mask, (1u << BT_MOD_N) - 1);
    assert_int_equal(lo.fused, 1);
    tu_fix_parity("phi3", source, &m, &lo, &mb, &b, ref, logits);

    /* the checks can fail: gate and up exchanged (gate_up_proj split the wrong way round) */
    bt_base_linear t = m.layers[0].lin[BT_MOD_GATE];
    m.layers[0].lin[BT_MOD_GATE] = m.layers[0].lin[BT_MOD_UP];
    m.layers[0].lin[BT_MOD_UP] = t;
    tu_fix_forward(&m, NULL, &mb, logits, 0);
    t = m.layers[0].lin[BT_MOD_GATE];
    m.layers[0].lin[BT_MOD_GATE] = m.layers[0].lin[BT_MOD_UP];
    m.layers[0].lin[BT_MOD_UP] = t;
    assert_true(tu_max_abs_diff(logits, rl_base, (int64_t)PM * NV) > 1e-2);

    bt_lora_free(&lo);
    free(logits);
    bt_st_close(ref);
    bt_model_free(&m);
}

static void test_phi3_hf(void **st) { (void)st; check_source("hf"); }
static void test_phi3_gguf(void **st) { (void)st; check_source("gguf"); }
static void test_phi3_gguf_native(void **st) { (void)st; check_source("native"); }

/* The HF directory (fused tensors split at load) and the GGUF hold the same values. */
static void test_gguf_equals_hf(void **st) {
    (void)st;
    bt_model a, g;
    load_model(&a, "hf");
    load_model(&g, "gguf");
    const bt_llama_hparams *hp = &a.hp;
    assert_int_equal(memcmp(a.tok_embd, g.tok_embd, (size_t)hp->vocab * hp->d_model * 4), 0);
    assert_int_equal(memcmp(a.lm_head, g.lm_head, (size_t)hp->vocab * hp->d_model * 4), 0);
    for (int l = 0; l < hp->n_layer; l++)
        for (int j = 0; j < BT_MOD_N; j++) {
            const bt_base_linear *x = &a.layers[l].lin[j], *y = &g.layers[l].lin[j];
            assert_int_equal(memcmp(x->w, y->w, (size_t)x->rows * x->cols * 4), 0);
        }
    bt_model_free(&a);
    bt_model_free(&g);
}

/* Phi-3's fused groups are all or nothing: part of qkv_proj (q, k or v alone) or of gate_up_proj
 * is refused naming the fused module; whole groups, o_proj and down_proj are taken, and a group
 * shares one A (pointer-equal) with its B as consecutive row slices of one fused B. */
static void test_phi3_fused_lora_groups(void **st) {
    (void)st;
    bt_model m;
    load_model(&m, "hf");
    const unsigned qkv = (1u << BT_MOD_Q) | (1u << BT_MOD_K) | (1u << BT_MOD_V),
                   gu = (1u << BT_MOD_GATE) | (1u << BT_MOD_UP);
    for (int mod = 0; mod < BT_MOD_N; mod++) {
        bt_lora lo;
        int rc = bt_lora_init(&lo, &m, 4, 8, 0, 1u << mod, 0, 1);
        if (mod == BT_MOD_O || mod == BT_MOD_DOWN) {
            assert_int_equal(rc, 0);
            bt_lora_free(&lo);
        } else {
            assert_int_equal(rc, BT_ERR_UNSUPPORTED);
            assert_non_null(strstr(bt_last_error(), "Phi-3"));
            assert_non_null(strstr(bt_last_error(), mod <= BT_MOD_V ? "part of qkv_proj"
                                                                    : "part of gate_up_proj"));
        }
    }
    bt_lora lo;
    assert_int_equal(bt_lora_init(&lo, &m, 4, 8, 0, qkv | gu, 0, 1), 0);
    /* per layer: r * (D + Dq + 2 Dkv) + r * (D + 2 F) = 4 * (32 + 64) + 4 * (32 + 128) */
    assert_int_equal(lo.n_params, 2 * (4 * (32 + 64) + 4 * (32 + 128)));
    for (int l = 0; l < 2; l++) {
        const bt_lora_mod *q = bt_lora_get(&lo, l, BT_MOD_Q), *k = bt_lora_get(&lo, l, BT_MOD_K),
                          *v = bt_lora_get(&lo, l, BT_MOD_V), *g = bt_lora_get(&lo, l, BT_MOD_GATE),
                          *u = bt_lora_get(&lo, l, BT_MOD_UP);
        assert_ptr_equal(k->A, q->A);
        assert_ptr_equal(v->dA, q->dA);
        assert_ptr_equal(k->B, q->B + 32 * 4);
        assert_ptr_equal(v->B, q->B + 48 * 4);
        assert_ptr_equal(u->A, g->A);
        assert_ptr_equal(u->B, g->B + 64 * 4);
        assert_int_equal(k->group, BT_MOD_Q);
        bt_lora_peft_mod pm;
        assert_int_equal(bt_lora_peft_get(&lo, l, BT_MOD_Q, &pm), 1);
        assert_string_equal(pm.name, "qkv_proj");
        assert_string_equal(pm.gguf, "attn_qkv");
        assert_int_equal(pm.out, 64);
        assert_int_equal(bt_lora_peft_get(&lo, l, BT_MOD_K, &pm), 0);
        assert_int_equal(bt_lora_peft_get(&lo, l, BT_MOD_GATE, &pm), 1);
        assert_string_equal(pm.name, "gate_up_proj");
        assert_string_equal(pm.gguf, "ffn_up");
        assert_int_equal(pm.out, 128);
        assert_int_equal(bt_lora_peft_get(&lo, l, BT_MOD_UP, &pm), 0);
    }
    bt_lora_free(&lo);
    bt_model_free(&m);
}

static void write_adapter_config(const char *dir, const char *targets) {
    char cp[600];
    snprintf(cp, sizeof cp, "%s/adapter_config.json", dir);
    FILE *f = fopen(cp, "w");
    assert_non_null(f);
    fprintf(f, "{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 8, \"target_modules\": "
            "[%s], \"bias\": \"none\", \"task_type\": \"CAUSAL_LM\"}", targets);
    fclose(f);
}

/* An adapter of another family is refused naming the module: qkv_proj / gate_up_proj on a
 * non-Phi-3 base (the tiny Qwen2), q_proj / gate_proj on Phi-3 (PEFT finds no such module). */
static void test_phi3_adapter_of_other_family_refused(void **st) {
    (void)st;
    bt_model m, q;
    load_model(&m, "hf");
    char p[512];
    snprintf(p, sizeof p, "%s/qwen/qwen2/hf", tu_hf_fixdir());
    bt_model_load_opts o = {BT_BASE_FP32, 0};
    if (bt_model_load(&q, p, &o)) fail_msg("%s", bt_last_error());
    static const struct { int phi3; const char *targets, *want; } cases[] = {
        {0, "\"o_proj\", \"qkv_proj\"", "qkv_proj"},
        {0, "\"gate_up_proj\"", "gate_up_proj"},
        {1, "\"o_proj\", \"q_proj\"", "q_proj"},
        {1, "\"gate_proj\", \"up_proj\"", "gate_proj"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char dir[] = "/tmp/bt_phi3_adXXXXXX";
        assert_non_null(mkdtemp(dir));
        write_adapter_config(dir, cases[i].targets);
        bt_lora lo;
        int rc = bt_lora_load_peft(&lo, cases[i].phi3 ? &m : &q, dir);
        if (rc != BT_ERR_UNSUPPORTED || !strstr(bt_last_error(), cases[i].want) ||
            !strstr(bt_last_error(), "another family"))
            fail_msg("case %zu: rc %d, %s", i, rc, bt_last_error());
        char cp[600];
        snprintf(cp, sizeof cp, "%s/adapter_config.json", dir);
        unlink(cp);
        rmdir(dir);
    }
    bt_model_free(&q);
    bt_model_free(&m);
}

static void rm_tree(const char *dir) {
    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    assert_int_equal(system(cmd), 0);
}

/* The fused adapter round trip: PEFT's files -> bt_lora -> bt_adapter_save -> bt_lora_load_peft
 * give the same parameters, and the written file holds exactly PEFT's tensor names, shapes and
 * values; adapter_config.json lists qkv_proj / gate_up_proj, never q_proj. */
static void test_phi3_adapter_round_trip(void **st) {
    (void)st;
    bt_model m;
    load_model(&m, "hf");
    bt_lora a, b;
    char dir[512];
    snprintf(dir, sizeof dir, "%s/phi3/adapter-init", tu_hf_fixdir());
    if (bt_lora_load_peft(&a, &m, dir)) fail_msg("%s", bt_last_error());
    char out[] = "/tmp/bt_phi3_rtXXXXXX";
    assert_non_null(mkdtemp(out));
    char sub[600];
    snprintf(sub, sizeof sub, "%s/adapter", out);
    if (bt_adapter_save(&a, "tests/fixtures/hf/phi3/hf", sub, &m)) fail_msg("%s", bt_last_error());
    if (bt_lora_load_peft(&b, &m, sub)) fail_msg("%s", bt_last_error());
    assert_int_equal(a.n_params, b.n_params);
    assert_memory_equal(a.params, b.params, (size_t)a.n_params * sizeof(float));
    char p1[700], p2[700];
    snprintf(p1, sizeof p1, "%s/adapter_model.safetensors", dir);
    snprintf(p2, sizeof p2, "%s/adapter_model.safetensors", sub);
    bt_st_file *f1, *f2;
    assert_int_equal(bt_st_open(&f1, p1), 0);
    assert_int_equal(bt_st_open(&f2, p2), 0);
    assert_int_equal(bt_st_n_tensors(f1), 16);
    assert_int_equal(bt_st_n_tensors(f2), 16);
    for (int i = 0; i < bt_st_n_tensors(f1); i++) {
        const bt_st_tensor *t = bt_st_tensor_at(f1, i), *u = bt_st_find(f2, t->name);
        if (!u) fail_msg("%s missing from our adapter", t->name);
        assert_int_equal(t->n_dims, u->n_dims);
        for (int d = 0; d < t->n_dims; d++) assert_int_equal(t->shape[d], u->shape[d]);
        int64_t n = t->shape[0] * t->shape[1];
        assert_memory_equal(tu_st_data(f1, t->name, BT_ST_F32, n), tu_st_data(f2, t->name, BT_ST_F32, n),
                            (size_t)n * 4);
    }
    bt_st_close(f1);
    bt_st_close(f2);
    snprintf(p2, sizeof p2, "%s/adapter_config.json", sub);
    FILE *f = fopen(p2, "r");
    assert_non_null(f);
    char buf[4096];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = 0;
    fclose(f);
    assert_non_null(strstr(buf, "\"qkv_proj\""));
    assert_non_null(strstr(buf, "\"gate_up_proj\""));
    assert_null(strstr(buf, "\"q_proj\""));
    rm_tree(out);
    bt_lora_free(&a);
    bt_lora_free(&b);
    bt_model_free(&m);
}

/* The merged GGUF of base + fused adapter (blk.N.attn_qkv / ffn_up re-fused, phi3 keys) and the
 * merged safetensors directory (qkv_proj / gate_up_proj) load back as a Phi-3 whose logits are
 * transformers + PEFT's (transformers and llama.cpp load them: tests/py/test_export_phi3.py,
 * tests/py/test_llamacpp.py). */
static void test_phi3_merged_exports_load_back(void **st) {
    (void)st;
    batch b;
    bt_microbatch mb = tu_fix_load_batch("phi3", &b);
    bt_model m;
    load_model(&m, "hf");
    bt_lora lo;
    char dir[512];
    snprintf(dir, sizeof dir, "%s/phi3/adapter-init", tu_hf_fixdir());
    if (bt_lora_load_peft(&lo, &m, dir)) fail_msg("%s", bt_last_error());
    char out[] = "/tmp/bt_phi3_mgXXXXXX";
    assert_non_null(mkdtemp(out));
    char pg[600], ps[600];
    snprintf(pg, sizeof pg, "%s/merged.gguf", out);
    snprintf(ps, sizeof ps, "%s/merged", out);
    if (bt_export_gguf_merged(&m, &lo, NULL, BT_EXPORT_F32, pg)) fail_msg("%s", bt_last_error());
    if (bt_export_safetensors_merged(&m, &lo, BT_EXPORT_F32, NULL, ps)) fail_msg("%s", bt_last_error());
    bt_st_file *ref = open_fix("ref.safetensors");
    const float *rl = fix_f32(ref, "logits", (int64_t)PM * NV);
    float *logits = malloc((size_t)PM * NV * sizeof(float));
    for (int i = 0; i < 2; i++) {
        bt_model g;
        bt_model_load_opts o = {BT_BASE_FP32, 0};
        if (bt_model_load(&g, i ? ps : pg, &o)) fail_msg("%s", bt_last_error());
        assert_int_equal(g.hp.arch, BT_ARCH_PHI3);
        assert_int_equal(g.hp.sliding_window, 512);
        tu_fix_forward(&g, NULL, &mb, logits, 0);
        double e = tu_max_abs_diff(logits, rl, (int64_t)PM * NV);
        print_message("parity: phi3 merged %s (f32) loaded back: logits max abs err %.3g vs "
                      "transformers + PEFT\n", i ? "safetensors" : "GGUF", e);
        assert_true(e <= 1e-4);
        bt_model_free(&g);
    }
    free(logits);
    bt_st_close(ref);
    rm_tree(out);
    bt_lora_free(&lo);
    bt_model_free(&m);
}

/* Resume: a checkpoint of a fused Phi-3 LoRA (parameters and AdamW moments, after a real
 * gradient) loads back bit-exactly into a fresh bt_lora of the same config, and its adapter files
 * hold PEFT's fused names. */
static void test_phi3_checkpoint_round_trip(void **st) {
    (void)st;
    batch bt;
    bt_microbatch mb = tu_fix_load_batch("phi3", &bt);
    bt_model m;
    load_model(&m, "hf");
    bt_train_config c;
    assert_int_equal(bt_config_parse(&c, "{\"model\": \"m\", \"data\": {\"shards\": [\"d\"], "
                                     "\"seq_len\": 24, \"micro_batch_size\": 2}, \"lora\": {\"r\": 4, "
                                     "\"lora_alpha\": 8, \"target_modules\": [\"qkv_proj\", "
                                     "\"gate_up_proj\", \"o_proj\"]}, \"steps\": 10}", "t", NULL, 0),
                     0);
    assert_int_equal(c.lora.target_mask, (1u << BT_MOD_N) - 1 - (1u << BT_MOD_DOWN));
    bt_lora a, b;
    assert_int_equal(bt_lora_init(&a, &m, 4, 8, c.lora.dropout, c.lora.target_mask, 0, c.seed), 0);
    assert_int_equal(bt_lora_init(&b, &m, 4, 8, c.lora.dropout, c.lora.target_mask, 0, c.seed + 1), 0);
    float *logits = malloc((size_t)PM * NV * sizeof(float));
    for (int64_t i = 0; i < a.n_lora; i++) a.params[i] += 0.01f * (float)((i % 7) - 3);
    tu_fix_forward(&m, &a, &mb, logits, 0);
    for (int64_t i = 0; i < a.n_params; i++) { /* moments as after a step */
        a.m[i] = 0.1f * a.grads[i];
        a.v[i] = 0.001f * a.grads[i] * a.grads[i];
    }
    char dir[] = "/tmp/bt_phi3_ckXXXXXX";
    assert_non_null(mkdtemp(dir));
    char ck[600];
    snprintf(ck, sizeof ck, "%s/ck", dir);
    if (bt_checkpoint_save(ck, &c, &m, &a, 3, NULL, 1)) fail_msg("%s", bt_last_error());
    int64_t step = -1;
    int has = -1;
    uint8_t rs[BT_RESUME_STATE_BYTES];
    if (bt_checkpoint_load(ck, &c, &m, &b, &step, rs, &has, NULL, 0, 1)) fail_msg("%s", bt_last_error());
    assert_int_equal(step, 3);
    size_t nb = (size_t)a.n_params * sizeof(float);
    assert_memory_equal(b.params, a.params, nb);
    assert_memory_equal(b.m, a.m, nb);
    assert_memory_equal(b.v, a.v, nb);
    bt_lora p; /* the checkpoint's adapter is a PEFT adapter with the fused names */
    if (bt_lora_load_peft(&p, &m, ck)) fail_msg("%s", bt_last_error());
    assert_memory_equal(p.params, a.params, nb);
    bt_lora_free(&p);
    rm_tree(dir);
    free(logits);
    bt_lora_free(&a);
    bt_lora_free(&b);
    bt_config_free(&c);
    bt_model_free(&m);
}

/* Phi-3's sliding_window (512 in the fixture, from config.json and from the GGUF's
 * phi3.attention.sliding_window): a windowed backend (the CPU) takes any row; one without a
 * window takes rows up to it (exact full attention) and refuses longer ones naming the key and
 * the setting. */
static void test_phi3_sliding_window(void **st) {
    (void)st;
    for (int i = 0; i < 2; i++) {
        bt_model m;
        load_model(&m, i ? "gguf" : "hf");
        assert_int_equal(m.hp.sliding_window, 512);
        assert_int_equal(bt_model_check_window(&m, 512, "data.seq_len", 0), 0);
        assert_int_equal(bt_model_check_window(&m, 513, "data.seq_len", 1), 0);
        assert_int_equal(bt_model_check_window(&m, 513, "data.seq_len", 0), BT_ERR_UNSUPPORTED);
        assert_non_null(strstr(bt_last_error(), "sliding_window 512"));
        assert_non_null(strstr(bt_last_error(), "Phi-3"));
        assert_non_null(strstr(bt_last_error(), "data.seq_len"));
        bt_model_free(&m);
    }
}

/* Phi-3's long-context RoPE ("longrope", "su", and "yarn" which Phi3Config renames longrope) and
 * partial RoPE are refused by name from config.json; the GGUF's rope_factors tables likewise. */
static void test_phi3_rope_refusals(void **st) {
    (void)st;
    static const struct { const char *extra, *want; } cases[] = {
        {"\"rope_scaling\": {\"type\": \"su\", \"short_factor\": [1,1,1,1], "
         "\"long_factor\": [1,1,1,1]}", "\"su\""},
        {"\"rope_scaling\": {\"rope_type\": \"longrope\", \"short_factor\": [1,1,1,1], "
         "\"long_factor\": [1,1,1,1]}", "\"longrope\""},
        {"\"rope_parameters\": {\"rope_type\": \"yarn\", \"factor\": 2}", "\"yarn\""},
        {"\"partial_rotary_factor\": 0.5", "partial_rotary_factor 0.5"},
    };
    char dir[] = "/tmp/bt_phi3_cfgXXXXXX";
    assert_non_null(mkdtemp(dir));
    char cp[600];
    snprintf(cp, sizeof cp, "%s/config.json", dir);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        FILE *f = fopen(cp, "w");
        assert_non_null(f);
        fprintf(f, "{\"architectures\": [\"Phi3ForCausalLM\"], \"hidden_size\": 32, "
                "\"intermediate_size\": 64, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, "
                "\"num_key_value_heads\": 2, \"vocab_size\": 260, \"rms_norm_eps\": 1e-5, "
                "\"hidden_act\": \"silu\", \"max_position_embeddings\": 512, %s}", cases[i].extra);
        fclose(f);
        bt_model m;
        bt_model_load_opts o = {BT_BASE_FP32, 0};
        int rc = bt_model_load(&m, dir, &o);
        if (rc != BT_ERR_UNSUPPORTED || !strstr(bt_last_error(), cases[i].want) ||
            !strstr(bt_last_error(), "Phi-3"))
            fail_msg("case %zu: rc %d, %s", i, rc, bt_last_error());
    }
    unlink(cp);
    rmdir(dir);
    char p[512];
    snprintf(p, sizeof p, "%s/phi3/longrope.gguf", tu_hf_fixdir());
    bt_model m;
    bt_model_load_opts o = {BT_BASE_FP32, 0};
    assert_int_equal(bt_model_load(&m, p, &o), BT_ERR_UNSUPPORTED);
    assert_non_null(strstr(bt_last_error(), "longrope"));
    assert_non_null(strstr(bt_last_error(), "rope_factors_long"));
}

/* `trainer estimate` on the Phi-3 files (GGUF with its fused tensors, and the HF directory)
 * bills exactly the bytes the CPU step context allocates, with checkpointing and without. */
static void test_phi3_estimate_is_the_plan(void **st) {
    (void)st;
    for (int src = 0; src < 2; src++)
        for (int ck = 0; ck < 2; ck++) {
            bt_model m;
            load_model(&m, src ? "hf" : "gguf");
            char p[512], txt[1024];
            snprintf(p, sizeof p, "%s/phi3/%s", tu_hf_fixdir(), src ? "hf" : "model.gguf");
            snprintf(txt, sizeof txt, "{\"model\": \"%s\", \"base_dtype\": \"fp32\", \"data\": "
                     "{\"shards\": [\"d\"], \"seq_len\": 32, \"micro_batch_size\": 2}, \"lora\": "
                     "{\"r\": 4, \"target_modules\": [\"qkv_proj\", \"o_proj\", \"gate_up_proj\", "
                     "\"down_proj\"]}, "
                     "\"activation_checkpointing\": %s}", p, ck ? "true" : "false");
            bt_train_config c;
            assert_int_equal(bt_config_parse(&c, txt, "t", NULL, 0), 0);
            bt_lora lo;
            assert_int_equal(bt_lora_init(&lo, &m, 4, 8, 0, c.lora.target_mask, 0, 1), 0);
            bt_step_ctx *ctx = NULL;
            assert_int_equal(bt_step_ctx_new(&ctx, &m, &lo, 64, ck), 0);
            bt_est_model em;
            if (bt_est_model_read(&em, p)) fail_msg("%s: %s", p, bt_last_error());
            assert_int_equal(em.hp.head_dim, 8);
            bt_mem_bill b;
            bt_estimate_bill(&em, &c, BT_EST_CPU, omp_get_max_threads(), &b);
            assert_int_equal(b.n_lora, lo.n_lora); /* the fused groups' shared lora_A counted once */
            if (b.step != (double)bt_step_ctx_bytes(ctx))
                fail_msg("%s, checkpointing %d: bill step %.0f bytes, bt_step_ctx_bytes %zu", p, ck,
                         b.step, bt_step_ctx_bytes(ctx));
            bt_step_ctx_free(ctx);
            bt_lora_free(&lo);
            bt_config_free(&c);
            bt_model_free(&m);
        }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_phi3_hf),
        cmocka_unit_test(test_phi3_gguf),
        cmocka_unit_test(test_phi3_gguf_native),
        cmocka_unit_test(test_gguf_equals_hf),
        cmocka_unit_test(test_phi3_fused_lora_groups),
        cmocka_unit_test(test_phi3_rope_refusals),
        cmocka_unit_test(test_phi3_adapter_of_other_family_refused),
        cmocka_unit_test(test_phi3_adapter_round_trip),
        cmocka_unit_test(test_phi3_merged_exports_load_back),
        cmocka_unit_test(test_phi3_checkpoint_round_trip),
        cmocka_unit_test(test_phi3_sliding_window),
        cmocka_unit_test(test_phi3_estimate_is_the_plan),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
