/* GPU trainer parity (trainer/cuda/cuda_trainer.h) against the CPU fp32 trainer step
 * (trainer/loop/step.h bt_forward_backward; clip + AdamW as trainer/loop/train.c):
 *   - one micro-batch forward + backward on a tiny random Llama (bt_model_init_random) in several
 *     configurations (NF4 / fp32 / GGUF-native base -- the fp32 linears encoded as Q4_0, Q4_1,
 *     Q8_0, Q4_K, Q5_K, Q6_K or F16 blocks by bt_model_to_ggml, both GPU matmul paths; a type
 *     without a CUDA decoder refused --, tied / untied, LoRA dropout, activation checkpointing,
 *     LoRA+ trainable embedding + norms, packed segments with reset position_ids, S^2-Attn in
 *     training with linear / YaRN / dynamic context extension and llama3 + YaRN, both attention
 *     kernels), and on SmolLM2-135M (BT_MODEL, default models/SmolLM2-135M-Instruct.Q4_1.gguf;
 *     skipped if absent; BT_MODEL=random:smollm2-135m: its shapes with random weights, NF4 and
 *     GGUF-native Q4_1);
 *   - 10 optimiser steps on SmolLM2 with the GPU loss following the CPU loss curve;
 *   - offloading the checkpointed layer inputs to pinned host memory: bit-identical losses and
 *     gradients to checkpointing without it;
 *   - no drift between `trainer estimate` and the trainer: for NF4 (dequantise / fused), fp32 and
 *     GGUF-native (Q4_K, F16) bases, with and without checkpointing, offload, LoRA+ and a subset
 *     of target modules, the device bytes the trainer allocates for its step and its pinned host
 *     bytes equal the CUDA bill's step and host figures (both walk trainer/backend/plan.h);
 *   - dist.shard_base with the base cut at load: the same shard bytes as a whole load cut on upload.
 * The other families' pieces (Mistral's sliding window, Gemma 3's head_dim 256, Qwen2, Qwen3,
 * Phi-3, Gemma 3) are tests/gpu/test_families_gpu.cu; the step parity both use, with its
 * tolerances, is tests/gpu/gpu_step_util.h.
 * Tolerances (bf16 activations vs the fp32 reference):
 *   one step: step_parity's (loss_sum 1e-2 relative; the whole LoRA gradient vector and the LoRA+
 *     blocks cosine >= 0.99 and rel-L2 <= 5e-2; every LoRA module cosine >= 0.95);
 *   10-step curve: every step's loss within 3% (relative) of the CPU's.
 * Options: those of every GPU test binary (tests/gpu/gpu_test.h gt_init: --case SUBSTR, --after
 * NAME, --list, --probe-only). Without a CUDA device it prints "SKIPPED" and exits 77 (never an OK
 * line; FAIL and 1 under BT_GPU_REQUIRE=1). */
#include "tests/gpu/gpu_test.h"
#include "tests/gpu/gpu_step_util.h"

extern "C" {
#include "common/gguf.h"
#include "common/quant.h"
#include "trainer/loop/optim.h"
#include "trainer/config.h"
#include "trainer/estimate.h"
}
#include "trainer/cuda/cuda_trainer_internal.h" /* the shards' device bytes */

#include <unistd.h>

static void test_tiny_nf4(void)
{
    run_tiny_case({"nf4 tied, no dropout", BT_BASE_NF4, 1, 0, 0.f, 0, 2, 128, 3});
}
static void test_tiny_dropout(void)
{
    run_tiny_case({"nf4 tied, dropout 0.1 (same masks as CPU)", BT_BASE_NF4, 1, 0, 0.1f, 0, 2, 128, 3});
}
static void test_tiny_fp32_untied_ckpt(void)
{
    run_tiny_case({"fp32 base untied, checkpointing, dropout 0.05", BT_BASE_FP32, 0, 1, 0.05f, 0, 3, 96, 2});
}
static void test_tiny_loraplus(void)
{
    run_tiny_case({"nf4 tied, LoRA+ embed + norm", BT_BASE_NF4, 1, 0, 0.f, BT_TRAIN_EMBED | BT_TRAIN_NORM,
                   2, 128, 2});
}
/* BT_GPU_EMU=1 (the CPU emulation of tests/emu, `make test-emu`): the 1000-token rows become 320
 * tokens (still several 64- and 128-token tiles and a partial last one) to keep the run short */
static int long_T(void) { return gt_emu() ? 320 : 1000; }
static void test_tiny_long_doc(void)
{ /* one 1000-token document: several 64-key tiles, partial last tile */
    run_tiny_case({"nf4 tied, one 1000-token row", BT_BASE_NF4, 1, 0, 0.f, 0, 1, long_T(), 1});
}

static void test_tiny_llama3_rope(void)
{ /* positions up to 300 (> original_max_position_embeddings 128) */
    run_tiny_case({"nf4 tied, llama3 rope_scaling (device inv_freq table)", BT_BASE_NF4, 1, 0, 0.f, 0,
                   1, 300, 1},
                  true);
}

/* Long context: S^2-Attn in training (groups of 32, half the heads shifted, on rows of packed
 * documents) with each context extension (the rows run to twice the trained context; dynamic NTK
 * uploads the table of the batch's longest position; YaRN's attention factor in the softmax
 * scale), with checkpointing, for both attention kernels. */
static void test_tiny_long_context(void)
{
    run_tiny_case({"nf4 tied, S2 32, linear extension, checkpointing", BT_BASE_NF4, 1, 1, 0.f, 0, 2,
                   128, 2, 32, 0},
                  false, BT_ROPE_EXT_LINEAR);
    run_tiny_case({"nf4 tied, S2 32, YaRN extension", BT_BASE_NF4, 1, 0, 0.f, 0, 2, 128, 2, 32, 0},
                  false, BT_ROPE_EXT_YARN);
    run_tiny_case({"fp32 untied, dynamic NTK extension", BT_BASE_FP32, 0, 0, 0.f, 0, 1, 128, 1, 0, 0},
                  false, BT_ROPE_EXT_DYNAMIC);
    g_attn_impl = 1;
    run_tiny_case({"[mma attention] nf4 tied, S2 32, llama3 + YaRN extension", BT_BASE_NF4, 1, 0, 0.f,
                   0, 2, 128, 2, 32, 0},
                  true, BT_ROPE_EXT_YARN);
    g_attn_impl = 0;
}

/* Offloading the checkpointed layer inputs to pinned host memory changes nothing: loss and LoRA
 * (+ LoRA+) gradients bit-identical to checkpointing without offload, for a training step
 * followed by an evaluation pass and a second training step (buffers reused). (On the emulator
 * copies are synchronous: this checks the buffer and event bookkeeping, not the overlap.) */
static void test_tiny_offload(void)
{
    const bt_llama_hparams hp = tiny_hp(3);
    bt_model m;
    bt_lora lo;
    if (tiny_model_lora(&m, &lo, hp, BT_BASE_NF4, 1, 0.1f, (1u << BT_MOD_N) - 1,
                        BT_TRAIN_EMBED | BT_TRAIN_NORM) != 0)
        return;
    randomise_B(&lo, 0.05f);
    Batch b = make_batch(2, 128, hp.vocab, 2);
    const int nlab = bt_shift_targets(nullptr, &b.mb, hp.vocab);
    const float gs = 1.0f / (float)nlab;
    std::vector<float> g[2];
    double loss[2][3];
    for (int off = 0; off < 2; off++) {
        bt_cuda_trainer *t = nullptr;
        bt_cuda_trainer_opts o;
        memset(&o, 0, sizeof o);
        o.checkpointing = 1;
        o.offload = off;
        o.s2_group = 32;
        if (bt_cuda_trainer_new(&t, &m, &lo, 256, &o) != 0) {
            printf("    bt_cuda_trainer_new(offload %d): %s\n", off, bt_last_error());
            g_case_ok = false;
            break;
        }
        BTOK(bt_cuda_trainer_zero_grad(t));
        BTOK(bt_cuda_trainer_step(t, &b.mb, 1, gs, 0x77, &loss[off][0], nullptr));
        BTOK(bt_cuda_trainer_step(t, &b.mb, 0, 1.0f, 0, &loss[off][1], nullptr));
        BTOK(bt_cuda_trainer_step(t, &b.mb, 1, gs, 0x78, &loss[off][2], nullptr));
        g[off].resize((size_t)lo.n_params);
        bt_lora tmp = lo;
        tmp.grads = g[off].data();
        BTOK(bt_cuda_trainer_download_lora(t, &tmp, BT_CUDA_DL_GRADS));
        bt_cuda_trainer_free(t);
    }
    if (g[1].size() == g[0].size() && !g[0].empty()) {
        printf("    losses without offload %.9g %.9g %.9g, with %.9g %.9g %.9g\n", loss[0][0],
               loss[0][1], loss[0][2], loss[1][0], loss[1][1], loss[1][2]);
        check_true("offload: the same losses, bit for bit",
                   !memcmp(loss[0], loss[1], sizeof loss[0]));
        check_true("offload: the same gradients, bit for bit",
                   !memcmp(g[0].data(), g[1].data(), g[0].size() * sizeof(float)));
    }
    /* offload without checkpointing is refused */
    bt_cuda_trainer *t = nullptr;
    bt_cuda_trainer_opts o;
    memset(&o, 0, sizeof o);
    o.offload = 1;
    check_true("offload needs checkpointing", bt_cuda_trainer_new(&t, &m, &lo, 256, &o) ==
                                                  BT_ERR_INVALID);
    bt_lora_free(&lo);
    bt_model_free(&m);
}

/* The same step with the mma.sync attention and the fused NF4 GEMM (config cuda.attention "mma",
 * cuda.base_matmul "fused"): NF4 with dropout and checkpointing, a 1000-token row, llama3 RoPE. */
static void test_tiny_mma_fused(void)
{
    g_attn_impl = 1;
    g_nf4_impl = 1;
    run_tiny_case({"[mma attention, fused NF4] nf4 tied, checkpointing, dropout 0.1", BT_BASE_NF4, 1, 1,
                   0.1f, 0, 2, 128, 3});
    run_tiny_case({"[mma attention, fused NF4] nf4 tied, one 1000-token row", BT_BASE_NF4, 1, 0, 0.f, 0,
                   1, long_T(), 1});
    run_tiny_case({"[mma attention, fused NF4] llama3 rope", BT_BASE_NF4, 1, 0, 0.f, 0, 1, 300, 1}, true);
    g_attn_impl = 0;
    g_nf4_impl = 0;
}

/* GGUF-native base, dequantise + cuBLAS and fused GEMM paths (Q5_0 / Q5_1 are checked bit-exact
 * against the CPU dequantiser in test_ggml_gpu); F16 blocks take the dense bf16 path; a type
 * without a decoder (Q3_K) is refused with the list. */
static void test_tiny_gguf(void)
{
    const struct {
        int type, fused;
    } runs[] = {{BT_GGML_Q4_0, 0}, {BT_GGML_Q8_0, 0}, {BT_GGML_Q5_K, 0}, {BT_GGML_F16, 0},
                {BT_GGML_Q4_1, 1}, {BT_GGML_Q4_K, 1}, {BT_GGML_Q6_K, 1}};
    static char names[8][96];
    for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
        g_gguf_type = runs[i].type;
        g_nf4_impl = runs[i].fused;
        snprintf(names[i], sizeof names[i], "gguf-native %s tied, dropout 0.05 [%s]",
                 bt_ggml_type_name(runs[i].type), runs[i].fused ? "fused GEMM" : "dequant+cuBLAS");
        run_tiny_case({names[i], BT_BASE_FP32, 1, 0, 0.05f, 0, 2, 128, 3});
    }
    g_gguf_type = -1;
    g_nf4_impl = 0;
    const bt_llama_hparams hp = llama_hp(1, 256, 4, 2, 64, 512, 100, 256);
    bt_model m;
    bt_lora lo;
    if (bt_model_init_random(&m, &hp, BT_BASE_FP32, 1, 3) || bt_model_to_ggml(&m, BT_GGML_Q3_K) ||
        bt_lora_init(&lo, &m, 4, 8.0, 0.0, (1u << BT_MOD_N) - 1, 0, 1)) {
        printf("    set-up: %s\n", bt_last_error());
        g_case_ok = false;
        return;
    }
    bt_cuda_trainer *t = nullptr;
    const int rc = bt_cuda_trainer_new(&t, &m, &lo, 64, nullptr);
    const char *e = bt_last_error();
    check_true("Q3_K base refused (BT_ERR_UNSUPPORTED)", rc == BT_ERR_UNSUPPORTED && !t);
    check_true("  ... naming the type, the supported ones and base_dtype nf4",
               strstr(e, "Q3_K") && strstr(e, "Q5_0") && strstr(e, "base_dtype \"nf4\""));
    printf("    message: %s\n", e);
    if (t)
        bt_cuda_trainer_free(t);
    bt_lora_free(&lo);
    bt_model_free(&m);
}

/* ------------------------------------------------------------------------ SmolLM2 */
/* BT_MODEL: a GGUF file or HF directory (default models/SmolLM2-135M-Instruct.Q4_1.gguf), or
 * "random:smollm2-135m": the SmolLM2-135M shapes (30 layers of 576, 9 heads of 64 over 3 KV heads,
 * FFN 1536, vocab 49152, tied embeddings, rope_theta 1e5, context 8192) with random weights
 * (bt_model_init_random, seed 135; no model file needed, e.g. on a lent GPU machine before the
 * model travels). Its NF4 base quantises those weights; its GGUF-native base is the same fp32
 * weights quantised to Q4_1 blocks (bt_model_to_ggml), the real file's block type. */
static const char *const k_random_smol = "random:smollm2-135m";
static const char *model_path(void)
{
    const char *p = getenv("BT_MODEL");
    return p && *p ? p : "models/SmolLM2-135M-Instruct.Q4_1.gguf";
}
static bool model_is_random(void) { return !strncmp(model_path(), "random:", 7); }
static bool g_have_smol = false;
static bt_model g_smol;

/* Loads BT_MODEL with base_dtype BT_BASE_NF4 or BT_BASE_GGUF into *m (see above). 0 or -1 with the
 * reason printed. */
static int smol_load(bt_model *m, int base_dtype)
{
    double t0 = bt_now();
    if (model_is_random()) {
        if (strcmp(model_path(), k_random_smol) != 0) {
            printf("    BT_MODEL=%s: unknown random model (%s is the one)\n", model_path(), k_random_smol);
            return -1;
        }
        const bt_llama_hparams hp = llama_hp(30, 576, 9, 3, 64, 1536, 49152, 8192, 100000.f);
        const int gguf = base_dtype == BT_BASE_GGUF;
        if (bt_model_init_random(m, &hp, gguf ? BT_BASE_FP32 : base_dtype, 1, 135) != 0 ||
            (gguf && bt_model_to_ggml(m, BT_GGML_Q4_1) != 0)) {
            printf("    %s: %s\n", k_random_smol, bt_last_error());
            return -1;
        }
        printf("    %s: random SmolLM2-135M-shaped model (seed 135, %s base) made in %.1f s\n",
               k_random_smol, gguf ? "GGUF-native Q4_1" : "NF4", bt_now() - t0);
        return 0;
    }
    bt_model_load_opts lo = {base_dtype, 0};
    if (bt_model_load(m, model_path(), &lo) != 0) {
        printf("    bt_model_load: %s\n", bt_last_error());
        return -1;
    }
    printf("    loaded %s (%s base) in %.1f s\n", model_path(),
           base_dtype == BT_BASE_GGUF ? "GGUF-native" : "NF4", bt_now() - t0);
    return 0;
}

/* The SmolLM2 cases' micro-batch: 2 rows of 256 tokens; under BT_GPU_EMU=1 (the CPU emulation,
 * where these cases run only on a small model, e.g. tests/py/test_gpu_scripts.py's) 1 row of 32. */
static int smol_B(void) { return gt_emu() ? 1 : 2; }
static int smol_T(void) { return gt_emu() ? 32 : 256; }

static bool load_smol(void)
{
    if (g_have_smol)
        return true;
    if (getenv("BT_GPU_QUICK") && atoi(getenv("BT_GPU_QUICK"))) {
        gt_skip("BT_GPU_QUICK set (tiny-model cases only)");
        return false;
    }
    if (!model_is_random()) {
        FILE *f = fopen(model_path(), "rb");
        if (!f) {
            char why[512];
            snprintf(why, sizeof why, "%s not found (set BT_MODEL, e.g. to %s, or run `make model`)",
                     model_path(), k_random_smol);
            gt_skip(why);
            return false;
        }
        fclose(f);
    }
    if (smol_load(&g_smol, BT_BASE_NF4) != 0) {
        g_case_ok = false;
        return false;
    }
    g_have_smol = true;
    return true;
}

static void test_smollm2_step(void)
{
    if (!load_smol())
        return;
    bt_lora lo;
    if (bt_lora_init(&lo, &g_smol, 16, 32.0, 0.05, (1u << BT_MOD_N) - 1, 0, 1234) != 0) {
        printf("    bt_lora_init: %s\n", bt_last_error());
        g_case_ok = false;
        return;
    }
    randomise_B(&lo, 0.01f);
    Case cs = {"SmolLM2 nf4, dropout 0.05", BT_BASE_NF4, 1, 0, 0.05f, 0, smol_B(), smol_T(), 3};
    step_parity(&g_smol, &lo, cs, 0xabcdef12345ull);
    /* the same with the mma.sync attention and the fused NF4 GEMM */
    g_attn_impl = g_nf4_impl = 1;
    Case cs2 = {"SmolLM2 nf4, dropout 0.05 [mma attention, fused NF4]", BT_BASE_NF4, 1, 0, 0.05f, 0,
                smol_B(), smol_T(), 3};
    step_parity(&g_smol, &lo, cs2, 0xabcdef12345ull);
    g_attn_impl = g_nf4_impl = 0;
    bt_lora_free(&lo);
}

/* SmolLM2-135M-Instruct trained on its own Q4_1 blocks (base_dtype gguf; for random:smollm2-135m
 * the random weights quantised to Q4_1): the GPU step on the uploaded blocks (both matmul paths)
 * against the CPU step on the same blocks. */
static void test_smollm2_gguf_step(void)
{
    if (!load_smol())
        return;
    bt_model m;
    if (smol_load(&m, BT_BASE_GGUF) != 0) {
        g_case_ok = false;
        return;
    }
    bt_lora lo;
    if (bt_lora_init(&lo, &m, 16, 32.0, 0.05, (1u << BT_MOD_N) - 1, 0, 1234) != 0) {
        printf("    bt_lora_init: %s\n", bt_last_error());
        g_case_ok = false;
        bt_model_free(&m);
        return;
    }
    randomise_B(&lo, 0.01f);
    Case cs = {"SmolLM2 gguf-native Q4_1, dropout 0.05 [dequant+cuBLAS]", BT_BASE_GGUF, 1, 0, 0.05f,
               0, smol_B(), smol_T(), 3};
    step_parity(&m, &lo, cs, 0xabcdef12345ull);
    g_nf4_impl = 1;
    Case cs2 = {"SmolLM2 gguf-native Q4_1, dropout 0.05 [fused GEMM]", BT_BASE_GGUF, 1, 0, 0.05f, 0,
                smol_B(), smol_T(), 3};
    step_parity(&m, &lo, cs2, 0xabcdef12345ull);
    g_nf4_impl = 0;
    bt_lora_free(&lo);
    bt_model_free(&m);
}

static void test_smollm2_10_steps(void)
{
    if (!load_smol())
        return;
    const int B = smol_B(), T = smol_T(), M = B * T, STEPS = 10;
    const float lr = 1e-3f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 0.0f;
    const double clip = 1.0;
    bt_lora lo;
    if (bt_lora_init(&lo, &g_smol, 16, 32.0, 0.05, (1u << BT_MOD_N) - 1, 0, 1234) != 0) {
        printf("    bt_lora_init: %s\n", bt_last_error());
        g_case_ok = false;
        return;
    }
    /* 3 fixed batches cycled: the loss must fall (memorisation) along the same curve */
    std::vector<Batch> bs;
    for (int i = 0; i < 3; i++)
        bs.push_back(make_batch(B, T, 8000, 2)); /* common-ish token ids */
    for (auto &b : bs)
        b.view();
    bt_cuda_trainer *t = nullptr;
    if (bt_cuda_trainer_new(&t, &g_smol, &lo, M, nullptr) != 0) { /* uploads the initial LoRA */
        printf("    bt_cuda_trainer_new: %s\n", bt_last_error());
        g_case_ok = false;
        bt_lora_free(&lo);
        return;
    }
    bt_step_ctx *ctx = nullptr;
    BTOK(bt_step_ctx_new(&ctx, &g_smol, &lo, M, 0));
    double worst = 0;
    double t_cpu = 0, t_gpu = 0;
    for (int step = 0; step < STEPS && ctx; step++) {
        Batch &b = bs[step % 3];
        const int nl = bt_shift_targets(nullptr, &b.mb, g_smol.hp.vocab);
        const float gs = 1.0f / (float)nl;
        const uint64_t key = bt_hash64(1234 ^ bt_hash64(((uint64_t)step << 20) + 1)) | 1;
        /* CPU (train.c order) */
        double t0 = bt_now();
        bt_lora_zero_grad(&lo);
        double cl = 0;
        BTOK(bt_forward_backward(ctx, &g_smol, &lo, &b.mb, 1, gs, key, &cl, nullptr));
        double cn = bt_clip_grad_norm(lo.grads, lo.n_params, clip);
        bt_adamw_step(lo.params, lo.grads, lo.m, lo.v, lo.n_decay, lr, b1, b2, eps, wd, step + 1);
        t_cpu += bt_now() - t0;
        /* GPU */
        t0 = bt_now();
        double gl = 0, gn = 0;
        BTOK(bt_cuda_trainer_zero_grad(t));
        BTOK(bt_cuda_trainer_step(t, &b.mb, 1, gs, key, &gl, nullptr));
        BTOK(bt_cuda_trainer_clip_and_step(t, clip, lr, b1, b2, eps, wd, step + 1, 0, &gn, nullptr));
        t_gpu += bt_now() - t0;
        const double lc = cl / nl, lg = gl / nl, rel = fabs(lg - lc) / lc;
        if (rel > worst)
            worst = rel;
        printf("    step %2d  loss cpu %.4f gpu %.4f (rel %.2e)  grad norm cpu %.4f gpu %.4f%s\n",
               step + 1, lc, lg, rel, cn, gn, rel <= 0.03 ? "" : "  <-- FAIL");
        if (rel > 0.03)
            g_case_ok = false;
    }
    printf("    worst step rel err %.3e (tol 3e-2); time cpu %.2f s, gpu %.2f s\n", worst, t_cpu, t_gpu);
    /* parameters after training are close too */
    std::vector<float> gp((size_t)lo.n_params);
    bt_lora tmp = lo;
    tmp.params = gp.data();
    BTOK(bt_cuda_trainer_download_lora(t, &tmp, BT_CUDA_DL_PARAMS));
    check_grad_block("LoRA params after 10 steps", gp.data(), lo.params, lo.n_lora, 0.99, 5e-2);
    bt_step_ctx_free(ctx);
    bt_cuda_trainer_free(t);
    bt_lora_free(&lo);
}

#define PLAN_CHECK(cond)                                                                \
    do {                                                                                \
        if (!(cond)) {                                                                  \
            printf("    check failed: %s (%s:%d)\n", #cond, __FILE__, __LINE__);          \
            g_case_ok = false;                                                          \
        }                                                                               \
    } while (0)

/* The GPU trainer allocates exactly what `trainer estimate` bills for its step (the memory plan of
 * trainer/backend/plan.h that both walk): device bytes and pinned host bytes, byte for byte. */
static void test_plan_matches_estimate(void)
{
    struct PlanCase {
        const char *name, *json; /* the job's keys beyond model / data / lora */
        int base_dtype, gguf_type, tied, ckpt, offload, fused;
        unsigned targets, trainable;
        int world; /* > 1: dist.shard_base over `world` ranks, this trainer rank 1's */
    };
    const unsigned all = (1u << BT_MOD_N) - 1, qv = (1u << BT_MOD_Q) | (1u << BT_MOD_V);
    const PlanCase cases[] = {
        {"nf4 dequantise, all targets", "\"base_dtype\": \"nf4\"", BT_BASE_NF4, -1, 1, 0, 0, 0,
         all, 0, 0},
        {"nf4 fused, checkpointing, LoRA+ untied",
         "\"base_dtype\": \"nf4\", \"activation_checkpointing\": true, \"cuda\": "
         "{\"nf4_matmul\": \"fused\"}, \"trainable_modules\": [\"embed_tokens\", \"norm\"]",
         BT_BASE_NF4, -1, 0, 1, 0, 1, all, BT_TRAIN_EMBED | BT_TRAIN_NORM, 0},
        {"fp32, checkpointing + offload, q/v only",
         "\"base_dtype\": \"fp32\", \"activation_checkpointing\": true, \"cuda\": "
         "{\"offload_checkpoints\": true}", BT_BASE_FP32, -1, 1, 1, 1, 0, qv, 0, 0},
        {"gguf Q4_K, LoRA+ norms", "\"base_dtype\": \"gguf\", \"trainable_modules\": [\"norm\"]",
         BT_BASE_FP32, BT_GGML_Q4_K, 1, 0, 0, 0, all, BT_TRAIN_NORM, 0},
        {"gguf F16 (held as bf16: no dequantisation buffer)", "\"base_dtype\": \"gguf\"",
         BT_BASE_FP32, BT_GGML_F16, 1, 0, 0, 0, all, 0, 0},
        {"nf4, dist.shard_base over 2 ranks (NF4 groups)",
         "\"base_dtype\": \"nf4\", \"dist\": {\"shard_base\": true}", BT_BASE_NF4, -1, 1, 0, 0, 0, all, 0, 2},
        {"fp32, dist.shard_base over 3 ranks (bf16 rows), checkpointing",
         "\"base_dtype\": \"fp32\", \"activation_checkpointing\": true, \"dist\": {\"shard_base\": true}",
         BT_BASE_FP32, -1, 1, 1, 0, 0, qv, 0, 3},
    };
    const bt_llama_hparams hp = tiny_hp(2);
    const bt_dims dims = bt_dims_of(&hp);
    for (const PlanCase &pc : cases) {
        printf("    case %s\n", pc.name);
        bt_model m;
        bt_lora lo;
        const auto to_ggml = [&](bt_model *pm) {
            return pc.gguf_type >= 0 ? bt_model_to_ggml(pm, pc.gguf_type) : 0;
        };
        if (tiny_model_lora(&m, &lo, hp, pc.base_dtype, pc.tied, 0.f, pc.targets, pc.trainable, to_ggml) != 0)
            return;
        const char *tm = pc.targets == all ? "\"q_proj\", \"k_proj\", \"v_proj\", \"o_proj\", "
                                             "\"gate_proj\", \"up_proj\", \"down_proj\""
                                           : "\"q_proj\", \"v_proj\"";
        char json[1024];
        snprintf(json, sizeof json,
                 "{\"model\": \"m.gguf\", \"device\": \"cuda\", \"data\": {\"shards\": [\"d\"], "
                 "\"seq_len\": 64, \"micro_batch_size\": 2}, \"lora\": {\"r\": 8, "
                 "\"target_modules\": [%s]}, %s}", tm, pc.json);
        bt_train_config cfg;
        if (bt_config_parse(&cfg, json, "plan case", nullptr, 0) != 0) {
            printf("    config: %s\n", bt_last_error());
            g_case_ok = false;
            bt_lora_free(&lo);
            bt_model_free(&m);
            return;
        }
        bt_est_model em;
        memset(&em, 0, sizeof em);
        em.hp = hp;
        em.tied = pc.tied;
        em.max_linear = bt_dims_max_linear(&dims);
        em.gguf = pc.gguf_type >= 0;
        em.gguf_quant = pc.gguf_type >= 0 && pc.gguf_type != BT_GGML_F16;
        cfg.world_size = pc.world;
        bt_mem_bill g;
        bt_estimate_bill(&em, &cfg, BT_EST_CUDA, 1, &g);
        const int M = cfg.data.seq_len * cfg.data.micro_batch_size;
        bt_cuda_trainer_opts o;
        memset(&o, 0, sizeof o);
        o.checkpointing = pc.ckpt;
        o.offload = pc.offload;
        o.base_matmul_impl = pc.fused;
        if (pc.world > 1) {
            o.shard_rank = 1;
            o.shard_world = pc.world;
        }
        bt_cuda_trainer *t = nullptr;
        if (bt_cuda_trainer_new(&t, &m, &lo, M, &o) != 0) {
            printf("    bt_cuda_trainer_new: %s\n", bt_last_error());
            g_case_ok = false;
        } else {
            size_t host = 0;
            const size_t dev = bt_cuda_trainer_plan_bytes(t, &host);
            printf("    trainer %zu device + %zu pinned bytes; estimate %.0f + %.0f\n", dev, host,
                   g.step, g.host);
            PLAN_CHECK((double)dev == g.step);
            PLAN_CHECK((double)host == g.host);
            PLAN_CHECK((pc.offload != 0) == (host > 0));
            PLAN_CHECK(g.n_lora + g.n_dense == lo.n_params);
            /* the bill's rows are the plan's groups: they add up to the step */
            PLAN_CHECK(g.lora + g.dense + g.acts + g.loss_ws + g.other + g.gather == g.step);
            /* dist.shard_base: the shards held and the two gathered layers are the bill's */
            size_t gathered = 0;
            const size_t lin = bt_cuda_trainer_base_bytes(t, &gathered);
            if (pc.world > 1) {
                printf("    shard %zu bytes, gathered layer %zu; estimate %.0f, %.0f\n", lin, gathered,
                       g.base, g.gather);
                PLAN_CHECK(g.sharded && (double)lin == g.base && 2.0 * (double)gathered == g.gather);
            } else {
                PLAN_CHECK(!g.sharded && gathered == 0 && g.gather == 0);
            }
            bt_cuda_trainer_free(t);
        }
        bt_config_free(&cfg);
        bt_lora_free(&lo);
        bt_model_free(&m);
    }
}

/* dist.shard_base with the base cut at load (issue 26, model.h bt_model_load_gguf_shard): for
 * every rank k of W, the trainer built from the cut load holds the same shard bytes, byte for byte,
 * as the one built from a whole load (which cuts on upload), for GGUF blocks kept as they are
 * (Q4_K, Q8_0) and rows converted to bf16 (F16); a cut load refused by a trainer of another rank or
 * by an unsharded one. Llama q/k rows are un-permuted before the cut (random rows: the file's order
 * is as good as any). */
static void test_shard_cut_load(void)
{
    const int D = 256, H = 4, KV = 2, HD = 64, F = 512, V = 64, L = 2;
    const int types[] = {BT_GGML_Q4_K, BT_GGML_Q8_0, BT_GGML_F16};
    char path[] = "/tmp/bt_shard_cut_XXXXXX.gguf";
    const int fd = mkstemps(path, 5);
    if (fd < 0) {
        printf("    mkstemps failed\n");
        g_case_ok = false;
        return;
    }
    close(fd);
    for (int type : types) {
        bt_gguf_writer *w = bt_gguf_writer_new();
        BTOK(bt_gguf_w_str(w, "general.architecture", "llama", 5));
        BTOK(bt_gguf_w_u32(w, "llama.block_count", L));
        BTOK(bt_gguf_w_u32(w, "llama.embedding_length", D));
        BTOK(bt_gguf_w_u32(w, "llama.attention.head_count", H));
        BTOK(bt_gguf_w_u32(w, "llama.attention.head_count_kv", KV));
        BTOK(bt_gguf_w_u32(w, "llama.feed_forward_length", F));
        BTOK(bt_gguf_w_u32(w, "llama.context_length", 256));
        BTOK(bt_gguf_w_f32(w, "llama.attention.layer_norm_rms_epsilon", 1e-5f));
        std::vector<float> f((size_t)F * D);
        std::vector<uint8_t> q((size_t)F * D * 4);
        auto add = [&](const char *name, int rows, int cols, int t) {
            for (auto &x : f)
                x = (float)(rng_normal() * 0.02);
            for (int i = 0; i < (rows ? rows : 1) * cols && !rows; i++)
                f[(size_t)i] = 1.0f; /* norms */
            const size_t nb = bt_ggml_row_size(t, cols) * (size_t)(rows ? rows : 1);
            BTOK(bt_ggml_quantize(t, f.data(), q.data(), (int64_t)(rows ? rows : 1) * cols));
            const uint64_t ne[2] = {(uint64_t)cols, (uint64_t)(rows ? rows : 1)};
            BTOK(bt_gguf_w_tensor(w, name, t, rows ? 2 : 1, ne, q.data(), nb));
        };
        add("token_embd.weight", V, D, BT_GGML_F32);
        add("output_norm.weight", 0, D, BT_GGML_F32);
        static const char *const lin[7] = {"attn_q", "attn_k", "attn_v", "attn_output",
                                           "ffn_gate", "ffn_up", "ffn_down"};
        const int rows[7] = {D, KV * HD, KV * HD, D, F, F, D};
        const int cols[7] = {D, D, D, D, D, D, F};
        char name[64];
        for (int l = 0; l < L; l++) {
            snprintf(name, sizeof name, "blk.%d.attn_norm.weight", l);
            add(name, 0, D, BT_GGML_F32);
            snprintf(name, sizeof name, "blk.%d.ffn_norm.weight", l);
            add(name, 0, D, BT_GGML_F32);
            for (int j = 0; j < 7; j++) {
                snprintf(name, sizeof name, "blk.%d.%s.weight", l, lin[j]);
                add(name, rows[j], cols[j], type);
            }
        }
        BTOK(bt_gguf_writer_write(w, path));
        bt_gguf_writer_free(w);
        printf("    %s\n", bt_ggml_type_name(type));
        bt_model_load_opts gg = {BT_BASE_GGUF, 0};
        bt_model whole;
        if (bt_model_load_gguf(&whole, path, &gg) != 0) {
            printf("    whole load: %s\n", bt_last_error());
            g_case_ok = false;
            break;
        }
        bt_lora lo;
        BTOK(bt_lora_init(&lo, &whole, 8, 16.0, 0.0, (1u << BT_MOD_N) - 1, 0, 7));
        for (int W = 2; W <= 3; W++)
            for (int k = 0; k < W; k++) {
                bt_model cut;
                bt_model_shard sh = {k, W};
                if (bt_model_load_gguf_shard(&cut, path, &gg, &sh) != 0) {
                    printf("    cut load: %s\n", bt_last_error());
                    g_case_ok = false;
                    continue;
                }
                bt_cuda_trainer_opts o;
                memset(&o, 0, sizeof o);
                o.shard_rank = k;
                o.shard_world = W;
                bt_cuda_trainer *ta = nullptr, *tb = nullptr;
                BTOK(bt_cuda_trainer_new(&ta, &whole, &lo, 64, &o));
                BTOK(bt_cuda_trainer_new(&tb, &cut, &lo, 64, &o));
                size_t diff = 0, total = 0;
                for (int i = 0; ta && tb && i < L * BT_MOD_N; i++) {
                    const btc_shard &a = ta->md.shards[i], &b = tb->md.shards[i];
                    const int64_t n = bt_shard_cut_bytes(&a.cut);
                    if (n != bt_shard_cut_bytes(&b.cut) || a.gtype != b.gtype) {
                        diff++;
                        continue;
                    }
                    std::vector<uint8_t> ha((size_t)n), hb((size_t)n);
                    CU(cudaMemcpy(ha.data(), a.data, (size_t)n, cudaMemcpyDeviceToHost));
                    CU(cudaMemcpy(hb.data(), b.data, (size_t)n, cudaMemcpyDeviceToHost));
                    diff += memcmp(ha.data(), hb.data(), (size_t)n) != 0;
                    total += (size_t)n;
                }
                printf("      W %d rank %d: %zu shard bytes, %zu linears differ\n", W, k, total, diff);
                if (!ta || !tb || diff || total == 0)
                    g_case_ok = false;
                bt_cuda_trainer_free(ta);
                bt_cuda_trainer_free(tb);
                /* another rank's cut, and an unsharded trainer, refuse it */
                o.shard_rank = (k + 1) % W;
                bt_cuda_trainer *tc = nullptr;
                if (bt_cuda_trainer_new(&tc, &cut, &lo, 64, &o) == 0 ||
                    !strstr(bt_last_error(), "loaded as rank")) {
                    printf("      another rank's trainer took the cut: %s\n", bt_last_error());
                    g_case_ok = false;
                }
                bt_cuda_trainer_free(tc);
                tc = nullptr;
                memset(&o, 0, sizeof o);
                if (bt_cuda_trainer_new(&tc, &cut, &lo, 64, &o) == 0 ||
                    !strstr(bt_last_error(), "keeps the whole base")) {
                    printf("      an unsharded trainer took the cut: %s\n", bt_last_error());
                    g_case_ok = false;
                }
                bt_cuda_trainer_free(tc);
                bt_model_free(&cut);
            }
        bt_lora_free(&lo);
        bt_model_free(&whole);
    }
    unlink(path);
}

int main(int argc, char **argv)
{
    const char *prog = "test_trainer_gpu";
    const int init = gt_init(prog, argc, argv);
    if (init >= 0)
        return init;
    GT_CASE(test_tiny_nf4);
    GT_CASE(test_tiny_dropout);
    GT_CASE(test_tiny_fp32_untied_ckpt);
    GT_CASE(test_tiny_loraplus);
    GT_CASE(test_tiny_long_doc);
    GT_CASE(test_tiny_llama3_rope);
    GT_CASE(test_tiny_mma_fused);
    GT_CASE(test_tiny_gguf);
    GT_CASE(test_tiny_long_context);
    GT_CASE(test_tiny_offload);
    GT_CASE(test_plan_matches_estimate);
    GT_CASE(test_shard_cut_load);
    GT_CASE(test_smollm2_step);
    GT_CASE(test_smollm2_gguf_step);
    GT_CASE(test_smollm2_10_steps);
    const int rc = gt_run(prog);
    if (g_have_smol)
        bt_model_free(&g_smol);
    return rc;
}
