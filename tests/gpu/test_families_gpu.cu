/* GPU trainer parity on the other model families' pieces (issue 24), against the CPU fp32 trainer
 * step (tests/gpu/gpu_step_util.h step_parity), on the tiny random Llama of test_trainer_gpu.cu
 * (2 layers, head_dim 64: the committed family fixtures' head_dims 8-24 have no GPU attention
 * kernel) given each family's own pieces, random where they are weights:
 *   - Mistral: a sliding_window on every layer, on both attention kernels, matching the windowed
 *     CPU step and not the full-attention one;
 *   - Gemma 3's head_dim 256 through the whole step on the wmma attention; the mma attention
 *     refuses it by name;
 *   - Qwen2 q/k/v biases, Qwen3 QK-norm (through checkpointing's recompute), Phi-3 fused LoRA
 *     groups (with LoRA dropout), Gemma 3's MLP and norms on a Llama-arch model, and Gemma 3 itself
 *     where the GPU attention applies windows (refused by name otherwise).
 * Tolerances: step_parity's (tests/gpu/gpu_step_util.h: loss 1e-2 relative; LoRA gradients cosine
 * >= 0.99 and rel-L2 <= 5e-2, every module cosine >= 0.95).
 * Options: those of every GPU test binary (tests/gpu/gpu_test.h gt_init: --case SUBSTR, --after
 * NAME, --list, --probe-only). Without a CUDA device it prints "SKIPPED" and exits 77 (never an OK
 * line; FAIL and 1 under BT_GPU_REQUIRE=1). */
#include "tests/gpu/gpu_test.h"
#include "tests/gpu/gpu_step_util.h"

extern "C" {
#include "trainer/backend/backend.h"
extern const bt_backend_reg bt_backend_cuda_reg; /* trainer/cuda/backend_cuda.cu */
}

/* Mistral-style sliding_window on every layer (bt_model_layer_window), rows of packed documents
 * longer than the window: the CUDA step passes each layer's window to both attention kernels. */
static void test_tiny_sliding_window(void)
{
    Case c = {"nf4 tied, sliding_window 16, packed documents", BT_BASE_NF4, 1, 0, 0.f, 0, 1, 96, 2};
    c.window = 16;
    run_tiny_case(c);
    g_attn_impl = 1;
    c.name = "[mma attention] fp32 untied, sliding_window 16, checkpointing";
    c.base_dtype = BT_BASE_FP32;
    c.tied = 0;
    c.ckpt = 1;
    run_tiny_case(c);
    g_attn_impl = 0;
}

/* head_dim 256 (Gemma 3's) through the whole step on the wmma attention, with a sliding window;
 * the mma attention has no head_dim 256 kernel and the trainer refuses it up front, naming it. */
static void test_tiny_head_dim_256(void)
{
    Case c = {"fp32 untied, head_dim 256, sliding_window 16", BT_BASE_FP32, 0, 0, 0.f, 0, 1, 64, 2};
    c.window = 16;
    c.head_dim = 256;
    run_tiny_case(c);
    bt_llama_hparams hp = tiny_hp(1);
    hp.head_dim = 256;
    hp.n_head = 1;
    hp.n_kv_head = 1;
    bt_model m;
    bt_lora lo;
    if (tiny_model_lora(&m, &lo, hp, BT_BASE_FP32, 1, 0.f, (1u << BT_MOD_N) - 1, 0) != 0)
        return;
    bt_cuda_trainer *t = nullptr;
    bt_cuda_trainer_opts o;
    memset(&o, 0, sizeof o);
    o.attn_impl = 1;
    check_true("mma attention + head_dim 256 refused",
               bt_cuda_trainer_new(&t, &m, &lo, 64, &o) == BT_ERR_UNSUPPORTED);
    printf("    bt_last_error: %s\n", bt_last_error());
    check_true("the refusal names head_dim 256 and \"wmma\"",
               strstr(bt_last_error(), "head_dim 256") && strstr(bt_last_error(), "\"wmma\""));
    bt_cuda_trainer_free(t);
    bt_lora_free(&lo);
    bt_model_free(&m);
}

/* A family the GPU trainer does not cover yet is refused naming it (issue 24), never trained
 * without its kernels: the model of fixture directory `dir` with LoRA on `targets`. */
static void check_family_refused(const char *dir, unsigned targets, const char *family)
{
    bt_model m;
    bt_lora lo;
    bt_model_load_opts o = {BT_BASE_FP32, 0};
    if (bt_model_load(&m, dir, &o) || bt_lora_init(&lo, &m, 4, 8.0, 0.0, targets, 0, 1)) {
        printf("    set-up: %s\n", bt_last_error());
        g_case_ok = false;
        return;
    }
    bt_cuda_trainer *t = nullptr;
    const int rc = bt_cuda_trainer_new(&t, &m, &lo, 64, nullptr);
    const char *e = bt_last_error();
    char what[96];
    snprintf(what, sizeof what, "%s refused (BT_ERR_UNSUPPORTED)", family);
    check_true(what, rc == BT_ERR_UNSUPPORTED && !t);
    check_true("  ... naming the family and device \"cpu\"",
               strstr(e, family) && strstr(e, "device: \"cpu\""));
    printf("    message: %s\n", e);
    if (t)
        bt_cuda_trainer_free(t);
    bt_lora_free(&lo);
    bt_model_free(&m);
}

/* ------------------------------------------------- the other families' pieces (issue 24) */
/* The tiny Llama of run_tiny_case (2 layers, head_dim 64: the committed family fixtures' head_dims
 * 8-24 have no GPU attention kernel) given each family's own pieces, random where they are weights:
 *   "qwen2": q/k/v biases N(0, 0.5^2) (Qwen2Attention);
 *   "qwen3": QK-norm weights 1 + N(0, 0.3^2) per head_dim (Qwen3Attention q_norm / k_norm);
 *   "phi3": arch phi3, so bt_lora_init makes the fused qkv_proj / gate_up_proj LoRA groups (one A
 *     and one dropout mask per group; LoRA dropout 0.1 checks the shared mask);
 *   "gemma": Gemma 3's MLP and norms on a Llama-arch model (the GPU refuses arch gemma3 until its
 *     attention has windows): QK-norm, sandwich post-norms 1 + N(0, 0.3^2), GeGLU with the tanh
 *     GELU, embedding scale sqrt(256) = 16, query_pre_attn_scalar 256, and local layers (every
 *     other one) with their own RoPE base (10000 vs 1e6) and a window as long as the rows, so the
 *     window itself changes nothing.
 * CPU fp32 step vs GPU step on one row of 96 tokens (two documents): loss and LoRA gradients
 * (step_parity's tolerances). */
static float *rand_weights(int n, float base, float sd)
{
    float *w = (float *)malloc((size_t)n * sizeof(float));
    for (int i = 0; i < n; i++)
        w[i] = base + rng_normal() * sd;
    return w;
}
static void run_family_case(const char *family, int base_dtype, int ckpt, float dropout)
{
    bt_llama_hparams hp = tiny_hp(2);
    const bool q2 = !strcmp(family, "qwen2"), q3 = !strcmp(family, "qwen3"),
               phi3 = !strcmp(family, "phi3"), gemma3 = !strcmp(family, "gemma3"),
               gemma = gemma3 || !strcmp(family, "gemma");
    hp.arch = q2 ? BT_ARCH_QWEN2 : q3 ? BT_ARCH_QWEN3 : phi3 ? BT_ARCH_PHI3 : gemma3 ? BT_ARCH_GEMMA3 : BT_ARCH_LLAMA;
    hp.qk_norm = q3 || gemma;
    if (gemma) {
        hp.sandwich_norm = 1;
        hp.act = BT_ACT_GELU_TANH;
        hp.embed_scale = 16.f;
        hp.attn_scalar = 256.f;
        hp.rope_theta = 1e6f;
        hp.rope_local_theta = 10000.f;
        hp.sliding_window = 256;
        hp.swa_pattern = 2;
    }
    if (gemma3) { /* Gemma 3 itself: head_dim 256 (one query and one KV head: bt_model_init_random
                   * makes heads x head_dim = hidden) and a 24-token window on the local layer,
                   * shorter than both documents of the row, so the window changes the result */
        hp.head_dim = 256;
        hp.n_head = 1;
        hp.n_kv_head = 1;
        hp.sliding_window = 24;
    }
    bt_model m;
    bt_lora lo;
    const auto prep = [&](bt_model *pm) {
        check_true("gemma: the local layers have their own RoPE table", !gemma || pm->inv_freq_local);
        for (int l = 0; l < hp.n_layer; l++) {
            bt_layer *Ly = &pm->layers[l];
            for (int mod = BT_MOD_Q; q2 && mod <= BT_MOD_V; mod++)
                Ly->lin[mod].bias = rand_weights(Ly->lin[mod].rows, 0.f, 0.5f);
            if (hp.qk_norm) {
                Ly->q_norm = rand_weights(hp.head_dim, 1.f, 0.3f);
                Ly->k_norm = rand_weights(hp.head_dim, 1.f, 0.3f);
            }
            if (hp.sandwich_norm) {
                Ly->post_attn_norm = rand_weights(hp.d_model, 1.f, 0.3f);
                Ly->post_ffn_norm = rand_weights(hp.d_model, 1.f, 0.3f);
            }
        }
        return 0;
    };
    if (tiny_model_lora(&m, &lo, hp, base_dtype, 1, dropout, (1u << BT_MOD_N) - 1, 0, prep) != 0)
        return;
    check_true("phi3: fused LoRA groups", lo.fused == phi3);
    randomise_B(&lo, 0.05f);
    char name[96];
    snprintf(name, sizeof name, "%s-like tiny, %s base%s%s", family,
             base_dtype == BT_BASE_NF4 ? "nf4" : "fp32", ckpt ? ", checkpointing" : "",
             dropout > 0 ? ", dropout" : "");
    printf("    case %s\n", name);
    step_parity(&m, &lo, {name, base_dtype, 1, ckpt, dropout, 0, 1, 96, 2},
                dropout > 0 ? 0x1234567ull : 0);
    bt_lora_free(&lo);
    bt_model_free(&m);
}
static void test_qwen2_bias(void) { run_family_case("qwen2", BT_BASE_NF4, 0, 0.f); }
/* QK-norm through checkpointing's recompute; the gemma case keeps every layer's QK-norm and
 * post-norm buffers instead */
static void test_qwen3_qk_norm(void) { run_family_case("qwen3", BT_BASE_NF4, 1, 0.f); }
static void test_phi3_fused(void) { run_family_case("phi3", BT_BASE_FP32, 0, 0.1f); }
static void test_gemma_pieces(void) { run_family_case("gemma", BT_BASE_NF4, 0, 0.f); }

/* Gemma 3 as a whole on the GPU (where its attention has windows): arch gemma3, head_dim 256 on
 * the wmma attention, a local layer with a window shorter than the documents, QK-norm, sandwich
 * norms, GeGLU, embedding scale, local RoPE base; checkpointing on. */
static void test_gemma3_step(void)
{
    if (!bt_backend_cuda_reg.sliding_window) {
        gt_skip("this build's GPU attention has no windows: Gemma 3 is refused (test_gemma3_refused)");
        return;
    }
    run_family_case("gemma3", BT_BASE_NF4, 1, 0.f);
}

/* Gemma 3 without windowed GPU attention in this build (bt_backend_cuda_reg.sliding_window 0):
 * refused by name. The tiny fixture of tests/reference/gen_gemma3_fixtures.py, LoRA on every
 * linear. */
static void test_gemma3_refused(void)
{
    if (bt_backend_cuda_reg.sliding_window) {
        gt_skip("this build's GPU attention has windows: Gemma 3 is not refused");
        return;
    }
    check_family_refused("tests/fixtures/hf/gemma3/hf", (1u << BT_MOD_N) - 1, "Gemma 3");
}

int main(int argc, char **argv)
{
    const char *prog = "test_families_gpu";
    const int init = gt_init(prog, argc, argv);
    if (init >= 0)
        return init;
    GT_CASE(test_tiny_sliding_window);
    GT_CASE(test_tiny_head_dim_256);
    GT_CASE(test_qwen2_bias);
    GT_CASE(test_qwen3_qk_norm);
    GT_CASE(test_phi3_fused);
    GT_CASE(test_gemma_pieces);
    GT_CASE(test_gemma3_refused);
    GT_CASE(test_gemma3_step);
    return gt_run(prog);
}
