/* `trainer estimate` (trainer/estimate.h): the bill's parts against what the trainer really
 * allocates on a random tiny Llama (LoRA and LoRA+ parameter counts, base bytes, the step
 * workspace of bt_step_ctx_new with and without activation checkpointing), the CUDA bill's
 * relations, reading the hyper-parameters from a GGUF header ($BT_MODEL, skipped when
 * absent) or refusing bad files, and a GGUF-native base billed at its file's tensor bytes (a tiny
 * Q4_K / F16 model: base, model bytes and step workspace against what the trainer holds); no drift
 * between the bill and the step context: for several jobs bt_step_ctx_bytes (the training and a
 * held-out length's context) equals the bill's step / eval figures byte for byte, as both walk the
 * memory plan (trainer/backend/plan.h), whose bad options are refused. The GPU trainer's side is
 * tests/gpu/test_trainer_gpu.cu (test_plan_matches_estimate). The end-to-end check against
 * measured peak RSS is tests/py/test_trainer_cli.py. */
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
#include "kernels/kernels.h"
#include "trainer/backend/plan.h"
#include "trainer/config.h"
#include "trainer/estimate.h"
#include "trainer/model/lora.h"
#include "trainer/model/model.h"
#include "trainer/loop/pref_step.h"
#include "trainer/loop/step.h"
#include "tests/unit/util/test_util.h"
#include "tests/unit/util/tiny_gguf.h"

static const bt_llama_hparams k_hp = {
    .n_layer = 3, .d_model = 64, .n_head = 4, .n_kv_head = 2, .head_dim = 16, .d_ff = 128,
    .vocab = 301, .ctx = 64, .rope_theta = 10000.f, .rms_eps = 1e-5f};
/* explicit head_dim: n_head * head_dim (256, o_proj's K) wider than d_ff and d_model */
static const bt_llama_hparams k_wide = {
    .n_layer = 2, .d_model = 64, .n_head = 8, .n_kv_head = 2, .head_dim = 32, .d_ff = 128,
    .vocab = 301, .ctx = 64, .rope_theta = 10000.f, .rms_eps = 1e-5f};

static void config(bt_train_config *c, const char *extra) {
    char txt[1024];
    snprintf(txt, sizeof txt,
             "{\"model\": \"m.gguf\", \"data\": {\"shards\": [\"d\"], \"seq_len\": 48,"
             " \"micro_batch_size\": 3}, \"lora\": {\"r\": 4, \"target_modules\": [\"q_proj\","
             " \"v_proj\", \"down_proj\"]}%s}",
             extra ? extra : "");
    assert_int_equal(bt_config_parse(c, txt, "t", NULL, 0), 0);
}

static bt_est_model est_model(int tied) {
    bt_est_model em;
    memset(&em, 0, sizeof em);
    em.hp = k_hp;
    em.tied = tied;
    em.max_linear = (int64_t)k_hp.d_ff * k_hp.d_model;
    return em;
}

/* The estimate of everything bt_step_ctx_new allocates must match bt_step_ctx_bytes within 1%;
 * parameter counts must be exact. */
static void check(const char *extra, int base_dtype, int tied) {
    bt_train_config c;
    config(&c, extra);
    c.base_dtype = base_dtype;
    bt_model m;
    assert_int_equal(bt_model_init_random(&m, &k_hp, base_dtype, tied, 1), 0);
    unsigned tr = ((c.trainable_mask & (1u << BT_TRAINABLE_EMBED)) ? BT_TRAIN_EMBED : 0) |
                  ((c.trainable_mask & (1u << BT_TRAINABLE_NORM)) ? BT_TRAIN_NORM : 0);
    bt_lora lo;
    assert_int_equal(bt_lora_init(&lo, &m, c.lora.r, c.lora.alpha, 0.0, c.lora.target_mask, tr, 1), 0);
    int M = c.data.seq_len * c.data.micro_batch_size;
    bt_step_ctx *ctx = NULL;
    assert_int_equal(bt_step_ctx_new(&ctx, &m, &lo, M, c.activation_checkpointing), 0);
    bt_est_model em = est_model(tied);
    bt_mem_bill b;
    int threads = omp_get_max_threads();
    bt_estimate_bill(&em, &c, BT_EST_CPU, threads, &b);
    assert_int_equal(b.n_lora + b.n_dense, lo.n_params);
    assert_int_equal(b.n_lora, lo.n_lora);
    assert_true(fabs(b.lora + b.dense - 16.0 * (double)lo.n_params) < 1.0);
    /* base + embedding + norms = the model's bytes */
    double model_bytes = (double)bt_model_bytes(&m);
    if (fabs(b.base + b.embed + b.norms - model_bytes) > 0.01 * model_bytes)
        fail_msg("model bytes: estimate %.0f, actual %.0f", b.base + b.embed + b.norms, model_bytes);
    /* workspace: activations + loss chunk + other, less what is not in the step context
     * (batch copies, targets; the NF4 scratch is in it) */
    double ws = b.acts + b.loss_ws + b.other - (double)c.grad_accum * (4.0 * M + 1) * 4.0 - 4.0 * M;
    if (base_dtype != BT_BASE_NF4) ws += 4.0; /* an fp32 base allocates a 1-float scratch */
    double real = (double)bt_step_ctx_bytes(ctx);
    if (fabs(ws - real) > 0.01 * real)
        fail_msg("%s: step workspace estimate %.0f bytes, bt_step_ctx_bytes %.0f",
                 extra ? extra : "plain", ws, real);
    assert_true(b.total >= b.acts + b.lora + b.base);
    assert_true(b.peak >= b.total && b.peak >= b.load_peak);
    /* CUDA: bf16 activations are half the fp32 ones (up to the fp32 lse / rstd) */
    bt_mem_bill g;
    bt_estimate_bill(&em, &c, BT_EST_CUDA, threads, &g);
    assert_true(g.acts < 0.6 * b.acts && g.acts > 0.45 * b.acts);
    assert_true(g.lora > b.lora); /* + the bf16 compute copy */
    assert_true(g.load_peak == 0);
    bt_step_ctx_free(ctx);
    bt_lora_free(&lo);
    bt_model_free(&m);
    bt_config_free(&c);
}

static void test_plain_nf4(void **st) {
    (void)st;
    check(NULL, BT_BASE_NF4, 1);
}
static void test_fp32_untied(void **st) {
    (void)st;
    check(NULL, BT_BASE_FP32, 0);
}
static void test_checkpointing(void **st) {
    (void)st;
    check(", \"activation_checkpointing\": true", BT_BASE_NF4, 1);
}
static void test_lora_plus(void **st) {
    (void)st;
    check(", \"trainable_modules\": [\"embed_tokens\", \"norm\"], \"grad_accum\": 3", BT_BASE_NF4,
          1);
}

/* the NF4 dequant tiles are as wide as the widest K, here o_proj's n_head * head_dim */
static void test_wide_heads_nf4(void **st) {
    (void)st;
    bt_train_config c;
    config(&c, NULL);
    bt_est_model em;
    memset(&em, 0, sizeof em);
    em.hp = k_wide;
    em.tied = 1;
    em.max_linear = (int64_t)k_wide.n_head * k_wide.head_dim * k_wide.d_model;
    bt_model m; /* bt_model_scratch_floats reads only the shape and base dtype */
    memset(&m, 0, sizeof m);
    m.hp = k_wide;
    m.base_dtype = BT_BASE_NF4;
    int threads = omp_get_max_threads();
    bt_mem_bill nf4, f32;
    c.base_dtype = BT_BASE_NF4;
    bt_estimate_bill(&em, &c, BT_EST_CPU, threads, &nf4);
    c.base_dtype = BT_BASE_FP32;
    bt_estimate_bill(&em, &c, BT_EST_CPU, threads, &f32);
    /* the NF4 bill's extra workspace is exactly the step context's dequant scratch */
    assert_true(nf4.other - f32.other == 4.0 * (double)bt_model_scratch_floats(&m));
    assert_true(bt_model_scratch_floats(&m) == bt_nf4_scratch_floats(k_wide.n_head * k_wide.head_dim));
    bt_config_free(&c);
}

/* Activation checkpointing keeps one layer instead of all; more tokens cost proportionally. */
static void test_scaling(void **st) {
    (void)st;
    bt_train_config c;
    config(&c, NULL);
    bt_est_model em = est_model(1);
    bt_mem_bill a, b, d;
    bt_estimate_bill(&em, &c, BT_EST_CPU, 2, &a);
    c.activation_checkpointing = 1;
    bt_estimate_bill(&em, &c, BT_EST_CPU, 2, &b);
    assert_true(b.acts < a.acts);
    c.activation_checkpointing = 0;
    c.data.seq_len *= 2;
    bt_estimate_bill(&em, &c, BT_EST_CPU, 2, &d);
    assert_true(fabs(d.acts / a.acts - 2.0) < 1e-9);
    bt_config_free(&c);
}

static void test_read_gguf(void **st) {
    (void)st;
    const char *model = getenv("BT_MODEL");
    if (!model) model = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    bt_est_model em;
    if (access(model, R_OK) == 0) {
        assert_int_equal(bt_est_model_read(&em, model), 0);
        /* SmolLM2-135M: 30 layers, 576 hidden, 9/3 heads, 1536 FFN, 49152 vocab, tied */
        assert_int_equal(em.hp.n_layer, 30);
        assert_int_equal(em.hp.d_model, 576);
        assert_int_equal(em.hp.n_head, 9);
        assert_int_equal(em.hp.n_kv_head, 3);
        assert_int_equal(em.hp.d_ff, 1536);
        assert_int_equal(em.hp.vocab, 49152);
        assert_int_equal(em.tied, 1);
        assert_true(em.file_tensor_bytes > 50u << 20 && em.file_tensor_bytes < 100u << 20);
        /* its linears are Q4_1: 20 bytes per 32 weights = 5 bits per weight */
        assert_int_equal(em.gguf, 1);
        assert_string_equal(em.gguf_types, "Q4_1");
        assert_int_equal(em.gguf_lin_bytes * 32, (uint64_t)em.lin_weights * 20);
    } else {
        print_message("skipping the GGUF part: %s not present\n", model);
    }
    /* bad input is refused, not crashed on */
    assert_int_not_equal(bt_est_model_read(&em, "/nonexistent/model.gguf"), 0);
    char tmp[] = "/tmp/bt-est-XXXXXX";
    int fd = mkstemp(tmp);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, "GGUF\x03\0\0\0garbage", 15), 15);
    close(fd);
    assert_int_not_equal(bt_est_model_read(&em, tmp), 0);
    unlink(tmp);
}

/* A GGUF-native base: the bill's base is the file's linear tensor bytes, the same bytes the
 * loaded model holds; with the embedding and norms it is the model's size; the step workspace
 * (tile scratch like NF4) matches bt_step_ctx_bytes. CUDA: the blocks as they are, F16 as bf16. */
static void test_gguf_base(void **st) {
    (void)st;
    char dir[128], path[256];
    assert_int_equal(tu_make_tmpdir(dir, sizeof dir, "est_gguf"), 0);
    const int types[2] = {BT_GGML_Q4_K, BT_GGML_F16};
    for (int i = 0; i < 2; i++) {
        tu_tiny_spec sp = tu_tiny_default();
        sp.hidden = 256, sp.ffn = 512, sp.vocab = 300, sp.type = types[i];
        sp.embd_type = BT_GGML_Q8_0;
        snprintf(path, sizeof path, "%s/m%d.gguf", dir, i);
        assert_int_equal(tu_tiny_gguf_write(path, &sp, NULL), 0);
        bt_est_model em;
        assert_int_equal(bt_est_model_read(&em, path), 0);
        assert_int_equal(em.gguf, 1);
        bt_train_config c;
        config(&c, NULL);
        assert_int_equal(c.base_dtype, BT_BASE_AUTO);
        bt_model m;
        bt_model_load_opts o = {BT_BASE_AUTO, 0};
        assert_int_equal(bt_model_load(&m, path, &o), 0);
        bt_base_info bi;
        bt_model_base_info(&m, &bi);
        assert_int_equal(em.gguf_lin_bytes, bi.bytes);
        assert_string_equal(em.gguf_types, bi.types);
        const int threads = omp_get_max_threads();
        bt_mem_bill b, g;
        bt_estimate_bill(&em, &c, BT_EST_CPU, threads, &b);
        bt_estimate_bill(&em, &c, BT_EST_CUDA, threads, &g);
        assert_true(b.base == (double)bi.bytes);
        assert_true(fabs(b.base + b.embed + b.norms - (double)bt_model_bytes(&m)) < 1.0);
        /* CUDA: Q4_K blocks as they are, F16 as bf16 (2 bytes per weight either way) */
        assert_true(g.base == (double)bi.bytes);
        bt_lora lo;
        assert_int_equal(bt_lora_init(&lo, &m, c.lora.r, c.lora.alpha, 0.0, c.lora.target_mask, 0, 1), 0);
        const int M = c.data.seq_len * c.data.micro_batch_size;
        bt_step_ctx *ctx = NULL;
        assert_int_equal(bt_step_ctx_new(&ctx, &m, &lo, M, 0), 0);
        const double ws = b.acts + b.loss_ws + b.other - (double)c.grad_accum * (4.0 * M + 1) * 4.0 -
                          4.0 * M;
        const double real = (double)bt_step_ctx_bytes(ctx);
        if (fabs(ws - real) > 0.01 * real)
            fail_msg("gguf: step workspace estimate %.0f bytes, bt_step_ctx_bytes %.0f", ws, real);
        /* explicit base dtypes still bill what they hold */
        c.base_dtype = BT_BASE_FP32;
        bt_estimate_bill(&em, &c, BT_EST_CPU, threads, &b);
        assert_true(b.base == 4.0 * (double)em.lin_weights);
        bt_step_ctx_free(ctx);
        bt_lora_free(&lo);
        bt_model_free(&m);
        bt_config_free(&c);
    }
    assert_int_equal(tu_remove_dir(dir), 0);
}

/* Long rows: offload moves the layer inputs to pinned host memory (three device buffers stay);
 * a held-out length beyond the micro-batch adds a checkpointed workspace of that length; the
 * CPU attention scratch holds per-head dK/dV with GQA; S^2 changes no memory; the longest
 * seq_len that fits is found for each backend (it fits, 64 more tokens do not). */
static void test_long_rows(void **st) {
    (void)st;
    bt_est_model em = est_model(1);
    int threads = omp_get_max_threads();
    bt_train_config c;
    config(&c, ", \"activation_checkpointing\": true");
    bt_mem_bill a, b;
    bt_estimate_bill(&em, &c, BT_EST_CUDA, threads, &a);
    c.cuda_offload = 1;
    bt_estimate_bill(&em, &c, BT_EST_CUDA, threads, &b);
    const double M = 48 * 3, D = k_hp.d_model;
    assert_true(a.host == 0 && b.host == (k_hp.n_layer + 1) * M * D * 2.0);
    assert_true(fabs((a.acts - b.acts) - (k_hp.n_layer + 1 - 3) * M * D * 2.0) < 1.0);
    c.cuda_offload = 0;
    bt_estimate_bill(&em, &c, BT_EST_CPU, threads, &a);
    assert_true(a.attn >= 2.0 * M * k_hp.n_head * k_hp.head_dim * 4.0); /* GQA 4 / 2 */
    assert_true(a.eval == 0);
    c.eval.n_shards = 1;
    c.eval.n_lengths = 2;
    c.eval.lengths[0] = 64;
    c.eval.lengths[1] = 1000; /* > 144 tokens per micro-batch */
    bt_estimate_bill(&em, &c, BT_EST_CPU, threads, &b);
    assert_true(b.eval > a.acts && b.total > a.total);
    c.eval.n_lengths = 0;
    c.s2_group_fraction = 0.25;
    bt_estimate_bill(&em, &c, BT_EST_CPU, threads, &b);
    assert_true(b.total == a.total);
    for (int dev = BT_EST_CPU; dev <= BT_EST_CUDA; dev++) {
        const double budget = 64.0 * 1048576.0 + (dev ? 600.0 * 1048576.0 : 0.0);
        const int T = bt_estimate_max_seq_len(&em, &c, dev, threads, budget);
        assert_true(T > 0 && T % 64 == 0);
        c.data.seq_len = T;
        bt_estimate_bill(&em, &c, dev, threads, &b);
        assert_true(b.peak <= budget);
        c.data.seq_len = T + 64;
        bt_estimate_bill(&em, &c, dev, threads, &b);
        assert_true(b.peak > budget);
        fprintf(stderr, "# %s: longest seq_len x 3 rows in %.0f MiB: %d\n", dev ? "CUDA" : "CPU",
                budget / 1048576.0, T);
        c.data.seq_len = 48;
    }
    assert_int_equal(bt_estimate_max_seq_len(&em, &c, BT_EST_CPU, threads, 1.0), 0);
    bt_config_free(&c);
}

/* No drift: the bill's step figure is exactly what bt_step_ctx_new allocates (the plan both walk),
 * for NF4 / fp32 / GGUF-native bases, tied or not, with and without checkpointing, LoRA+ and
 * target subsets; its rows add up to it; a held-out length's own context is billed exactly. */
static void test_plan_exact(void **st) {
    (void)st;
    static const struct {
        const char *extra;
        int base_dtype, gguf_type, tied;
        const bt_llama_hparams *hp;
    } cases[] = { /* (bt_model_init_random needs n_head * head_dim == d_model: not k_wide) */
        {NULL, BT_BASE_NF4, -1, 1, &k_hp},
        {", \"activation_checkpointing\": true", BT_BASE_FP32, -1, 0, &k_hp},
        {", \"trainable_modules\": [\"embed_tokens\", \"norm\"], \"grad_accum\": 2", BT_BASE_NF4,
         -1, 0, &k_hp},
        {NULL, BT_BASE_GGUF, BT_GGML_Q8_0, 1, &k_hp}, /* r 3 on o_proj and up_proj (below) */
        {", \"activation_checkpointing\": true", BT_BASE_GGUF, BT_GGML_F16, 0, &k_hp},
    };
    const int threads = omp_get_max_threads();
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        bt_train_config c;
        config(&c, cases[i].extra);
        c.base_dtype = cases[i].base_dtype;
        if (cases[i].gguf_type == BT_GGML_Q8_0) {
            c.lora.r = 3;
            c.lora.target_mask = (1u << BT_MOD_O) | (1u << BT_MOD_UP);
        }
        bt_model m;
        const int init_dtype = cases[i].gguf_type >= 0 ? BT_BASE_FP32 : cases[i].base_dtype;
        assert_int_equal(bt_model_init_random(&m, cases[i].hp, init_dtype, cases[i].tied, 1), 0);
        if (cases[i].gguf_type >= 0) assert_int_equal(bt_model_to_ggml(&m, cases[i].gguf_type), 0);
        unsigned tr = ((c.trainable_mask & (1u << BT_TRAINABLE_EMBED)) ? BT_TRAIN_EMBED : 0) |
                      ((c.trainable_mask & (1u << BT_TRAINABLE_NORM)) ? BT_TRAIN_NORM : 0);
        bt_lora lo;
        assert_int_equal(bt_lora_init(&lo, &m, c.lora.r, c.lora.alpha, 0.0, c.lora.target_mask,
                                         tr, 1), 0);
        const int M = c.data.seq_len * c.data.micro_batch_size;
        bt_step_ctx *ctx = NULL;
        assert_int_equal(bt_step_ctx_new(&ctx, &m, &lo, M, c.activation_checkpointing), 0);
        bt_est_model em;
        memset(&em, 0, sizeof em);
        em.hp = *cases[i].hp;
        em.tied = cases[i].tied;
        em.gguf = cases[i].gguf_type >= 0;
        em.gguf_quant = em.gguf;
        bt_dims d = bt_dims_of(cases[i].hp);
        em.max_linear = bt_dims_max_linear(&d);
        bt_mem_bill b;
        bt_estimate_bill(&em, &c, BT_EST_CPU, threads, &b);
        if (b.step != (double)bt_step_ctx_bytes(ctx))
            fail_msg("case %zu: bill step %.0f bytes, bt_step_ctx_bytes %zu", i, b.step,
                     bt_step_ctx_bytes(ctx));
        /* the rows: acts + loss + other hold the step plus the run's batch copies */
        assert_true(b.acts + b.loss_ws + b.other - (double)c.grad_accum * (4.0 * M + 1) * 4.0 == b.step);
        assert_int_equal(b.n_lora + b.n_dense, lo.n_params);
        bt_step_ctx_free(ctx);
        /* a held-out length past the micro-batch: its own checkpointed context, billed exactly */
        c.eval.n_shards = 1;
        c.eval.n_lengths = 1;
        c.eval.lengths[0] = 3 * M;
        bt_estimate_bill(&em, &c, BT_EST_CPU, threads, &b);
        assert_int_equal(bt_step_ctx_new(&ctx, &m, &lo, 3 * M, 1), 0);
        if (b.eval != (double)bt_step_ctx_bytes(ctx))
            fail_msg("case %zu: bill eval %.0f bytes, bt_step_ctx_bytes %zu", i, b.eval,
                     bt_step_ctx_bytes(ctx));
        bt_step_ctx_free(ctx);
        bt_lora_free(&lo);
        bt_model_free(&m);
        bt_config_free(&c);
    }
}

/* A preference objective bills the preference step's buffers (plan.h bt_plan_pref), exactly what
 * bt_pref_step_new allocates: dpo vs sft, the CPU total grows by them, the CUDA device total by
 * the log-prob backward's dlogp rows only (the step's buffers are host memory there); kto adds
 * its KL micro-batch. */
static void test_pref_buffers(void **st) {
    (void)st;
    const int threads = omp_get_max_threads();
    bt_est_model em = est_model(1);
    bt_train_config sft;
    config(&sft, NULL);
    bt_mem_bill cs, gs;
    bt_estimate_bill(&em, &sft, BT_EST_CPU, threads, &cs);
    bt_estimate_bill(&em, &sft, BT_EST_CUDA, threads, &gs);
    assert_true(cs.pref == 0 && gs.pref == 0);
    static const struct {
        const char *objective, *format;
        double per_token, extra; /* bytes of the plan: per token, plus */
    } k[] = {{"dpo", "preference", 118, 0}, {"orpo", "preference", 118, 0}, {"kto", "kto", 134, 4}};
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) {
        char txt[512];
        snprintf(txt, sizeof txt,
                 "{\"model\": \"m.gguf\", \"data\": {\"shards\": [\"d\"], \"seq_len\": 48,"
                 " \"micro_batch_size\": 3, \"format\": \"%s\"}, \"objective\": \"%s\", \"lora\": {\"r\": 4,"
                 " \"target_modules\": [\"q_proj\", \"v_proj\", \"down_proj\"]}}",
                 k[i].format, k[i].objective);
        bt_train_config c;
        if (bt_config_parse(&c, txt, "t", NULL, 0) != 0) fail_msg("%s: %s", k[i].objective, bt_last_error());
        const int M = c.data.seq_len * c.data.micro_batch_size;
        bt_mem_bill b, g;
        bt_estimate_bill(&em, &c, BT_EST_CPU, threads, &b);
        bt_estimate_bill(&em, &c, BT_EST_CUDA, threads, &g);
        bt_pref_step *s = NULL;
        assert_int_equal(bt_pref_step_new(&s, &c.pref, c.data.micro_batch_size, c.data.seq_len,
                                          k_hp.vocab), 0);
        if (b.pref != (double)bt_pref_step_bytes(s) || g.pref != b.pref ||
            b.pref != k[i].per_token * M + k[i].extra)
            fail_msg("%s: bill %.0f (CUDA %.0f) bytes, bt_pref_step_bytes %zu, plan %.0f x %d + %.0f",
                     k[i].objective, b.pref, g.pref, bt_pref_step_bytes(s), k[i].per_token, M,
                     k[i].extra);
        /* CPU: host memory, in the total; CUDA: only the dlogp rows on the device */
        assert_true(b.total - cs.total == b.pref);
        assert_true(g.total - gs.total == 4.0 * M && g.loss_ws - gs.loss_ws == 4.0 * M);
        bt_pref_step_free(s);
        bt_config_free(&c);
    }
    bt_config_free(&sft);
}

/* The plan refuses options no context can hold, naming them; sizes follow the dims. */
static void test_plan_refusals(void **st) {
    (void)st;
    const bt_dims d = bt_dims_of(&k_hp);
    bt_plan p;
    bt_plan_opts o;
    memset(&o, 0, sizeof o);
    o.max_M = 0;
    assert_int_equal(bt_plan_step(&p, &d, &o), BT_ERR_INVALID);
    o.max_M = 16;
    o.r = -1;
    assert_int_equal(bt_plan_step(&p, &d, &o), BT_ERR_INVALID);
    o.r = 0; /* CPU without LoRA: a 1-wide dXA, no XA buffers */
    assert_int_equal(bt_plan_step(&p, &d, &o), 0);
    assert_true(bt_plan_find(&p, BT_BUF_DXA)->count == 16);
    assert_null(bt_plan_find(&p, BT_BUF_XA + BT_MOD_Q));
    assert_true(bt_plan_find(&p, BT_BUF_X_IN)->copies == k_hp.n_layer + 1);
    assert_true(bt_plan_find(&p, BT_BUF_Q)->count == 16 * k_hp.n_head * k_hp.head_dim);
    assert_true(bt_plan_find(&p, BT_BUF_TILES)->count == 0); /* not quantised */
    o.backend = BT_PLAN_CUDA; /* CUDA needs a rank and parameters */
    assert_int_equal(bt_plan_step(&p, &d, &o), BT_ERR_INVALID);
    o.r = 4;
    assert_int_equal(bt_plan_step(&p, &d, &o), BT_ERR_INVALID);
    o.n_params = 100;
    o.offload = 1; /* offload without checkpointing */
    assert_int_equal(bt_plan_step(&p, &d, &o), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "checkpointing"));
    o.checkpointing = 1;
    assert_int_equal(bt_plan_step(&p, &d, &o), 0);
    assert_true(bt_plan_bytes(&p, BT_PG_HOST) == (uint64_t)(k_hp.n_layer + 1) * 16 * k_hp.d_model * 2);
    assert_true(bt_plan_find(&p, BT_BUF_XBUF)->copies == 3);
    assert_null(bt_plan_find(&p, BT_BUF_X_IN));
    assert_true(bt_plan_bytes(&p, BT_PG_LORA) == 100 * 18);
    o.backend = 7;
    assert_int_equal(bt_plan_step(&p, &d, &o), BT_ERR_INVALID);
}

/* dist.shard_base: a rank's base is its shard of whole NF4 double-quantisation groups (the last
 * one padded), the plan gains two gathered layers, nothing else of the bill changes; the CPU bill
 * and one rank ignore it; bt_estimate_gpus_for answers the fewest W that fit. */
static void test_shard_base(void **st) {
    (void)st;
    bt_train_config c;
    config(&c, ", \"base_dtype\": \"nf4\", \"dist\": {\"shard_base\": true}");
    bt_est_model em = est_model(0);
    const int threads = 2;
    bt_mem_bill one, two, four, cpu;
    c.world_size = 1;
    bt_estimate_bill(&em, &c, BT_EST_CUDA, threads, &one);
    assert_false(one.sharded);
    assert_true(one.gather == 0);
    c.world_size = 2;
    bt_estimate_bill(&em, &c, BT_EST_CUDA, threads, &two);
    c.world_size = 4;
    bt_estimate_bill(&em, &c, BT_EST_CUDA, threads, &four);
    bt_estimate_bill(&em, &c, BT_EST_CPU, threads, &cpu);
    assert_true(two.sharded && four.sharded && !cpu.sharded && cpu.gather == 0);
    /* per linear: ceil(ceil(n / 16384) / W) units of 8452 bytes (k_hp's linears are each less
     * than one unit of 16384 weights: rank 0 holds it, padded, and rank 1 padding) */
    const bt_dims d = bt_dims_of(&k_hp);
    double want2 = 0, layer2 = 0;
    for (int mod = 0; mod < BT_MOD_N; mod++) {
        int rows, cols;
        bt_dims_lin_shape(&d, mod, &rows, &cols);
        const int64_t u = bt_shard_nf4_units((int64_t)rows * cols), per = bt_shard_units(u, 2);
        want2 += (double)per * BT_SHARD_NF4_UNIT;
        layer2 += 2.0 * per * (8192 + 256) + (double)bt_shard_region(2 * per * 4);
        bt_shard_cut cut;
        bt_shard_cut_nf4(&cut, (int64_t)rows * cols, 2);
        assert_true(bt_shard_cut_bytes(&cut) == per * BT_SHARD_NF4_UNIT);
    }
    assert_true(two.base == want2 * k_hp.n_layer);
    assert_true(two.gather == 2 * layer2);
    assert_true(two.total - two.base - two.gather == one.total - one.base);
    assert_true(four.base <= two.base);
    /* the shard cut: 10 units over 4 ranks is 3 each (the last rank: 1 and 2 of padding) */
    assert_true(bt_shard_units(10, 4) == 3 && bt_shard_units(8, 4) == 2 && bt_shard_units(0, 4) == 0);
    assert_true(bt_shard_nf4_units(16384) == 1 && bt_shard_nf4_units(16385) == 2);
    /* fewest W: W = 1 fits its own bill exactly; a budget between the W = 2 and W = 1 bills
     * (a model large enough that sharding pays for the gathered layers) gives 2 */
    assert_int_equal(bt_estimate_gpus_for(&em, &c, threads, one.peak, NULL), 1);
    assert_int_equal(bt_estimate_gpus_for(&em, &c, threads, 1.0, NULL), 0);
    em.hp.n_layer = 64; /* 64 layers of whole groups (d_model 256, ffn 1024): the base dominates */
    em.hp.d_model = 256;
    em.hp.head_dim = 64;
    em.hp.d_ff = 1024;
    em.max_linear = 1024 * 256;
    c.world_size = 1;
    bt_estimate_bill(&em, &c, BT_EST_CUDA, threads, &one);
    c.world_size = 2;
    bt_estimate_bill(&em, &c, BT_EST_CUDA, threads, &two);
    assert_true(two.peak < one.peak);
    bt_mem_bill got;
    assert_int_equal(bt_estimate_gpus_for(&em, &c, threads, (one.peak + two.peak) / 2, &got), 2);
    assert_true(got.peak == two.peak && got.world == 2);
    /* the plan: two copies of the gathered layer, refused on the CPU */
    bt_plan p;
    bt_plan_opts o;
    memset(&o, 0, sizeof o);
    o.backend = BT_PLAN_CUDA;
    o.max_M = 16;
    o.r = 4;
    o.n_params = 100;
    o.gather_bytes = 1000;
    assert_int_equal(bt_plan_step(&p, &d, &o), 0);
    assert_true(bt_plan_find(&p, BT_BUF_GATHER)->copies == 2);
    assert_true(bt_plan_bytes(&p, BT_PG_GATHER) == 2000);
    o.backend = BT_PLAN_CPU;
    assert_int_equal(bt_plan_step(&p, &d, &o), BT_ERR_INVALID);
    bt_config_free(&c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_plain_nf4),     cmocka_unit_test(test_fp32_untied),
        cmocka_unit_test(test_checkpointing), cmocka_unit_test(test_lora_plus),
        cmocka_unit_test(test_scaling),       cmocka_unit_test(test_read_gguf),
        cmocka_unit_test(test_wide_heads_nf4), cmocka_unit_test(test_gguf_base),
        cmocka_unit_test(test_long_rows),     cmocka_unit_test(test_plan_exact),
        cmocka_unit_test(test_plan_refusals), cmocka_unit_test(test_shard_base),
        cmocka_unit_test(test_pref_buffers),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
