/* GPU trainer parity (trainer/cuda/cuda_trainer.h) against the CPU fp32 trainer step
 * (trainer/loop/step.h bt_forward_backward; clip + AdamW as trainer/loop/train.c):
 *   - one micro-batch forward + backward on a tiny random Llama (bt_model_init_random) in several
 *     configurations (NF4 / fp32 / GGUF-native base -- the fp32 linears encoded as Q4_0, Q4_1,
 *     Q8_0, Q4_K, Q5_K, Q6_K or F16 blocks by bt_model_to_ggml, both GPU matmul paths; a type
 *     without a CUDA decoder refused --, tied / untied, LoRA dropout, activation checkpointing,
 *     LoRA+ trainable embedding + norms, packed segments with reset position_ids, S^2-Attn in
 *     training with linear / YaRN / dynamic context extension and llama3 + YaRN, both attention
 *     kernels; a Mistral-style sliding_window on both kernels, matching the windowed CPU step and
 *     not the full-attention one; head_dim 256 on wmma, refused by name on mma), and on
 *     SmolLM2-135M (BT_MODEL, default models/SmolLM2-135M-Instruct.Q4_1.gguf; skipped if absent;
 *     BT_MODEL=random:smollm2-135m: its shapes with random weights, NF4 and GGUF-native Q4_1);
 *   - 10 optimiser steps on SmolLM2 with the GPU loss following the CPU loss curve;
 *   - offloading the checkpointed layer inputs to pinned host memory: bit-identical losses and
 *     gradients to checkpointing without it;
 *   - no drift between `trainer estimate` and the trainer: for NF4 (dequantise / fused), fp32 and
 *     GGUF-native (Q4_K, F16) bases, with and without checkpointing, offload, LoRA+ and a subset
 *     of target modules, the device bytes the trainer allocates for its step and its pinned host
 *     bytes equal the CUDA bill's step and host figures (both walk trainer/backend/plan.h).
 * Tolerances (bf16 activations vs the fp32 reference):
 *   loss_sum: |gpu - cpu| / |cpu| <= 1e-2;
 *   gradients (the whole LoRA gradient vector, and the LoRA+ blocks separately):
 *     cosine similarity >= 0.99 and rel-L2 ||g - c|| / ||c|| <= 5e-2;
 *     each LoRA module (A or B of one layer) is printed when worse than that; modules must reach
 *     cosine >= 0.95 (small modules are noisier);
 *   10-step curve: every step's loss within 3% (relative) of the CPU's.
 * Options: those of every GPU test binary (tests/gpu/gpu_test.h gt_init: --case SUBSTR, --after
 * NAME, --list, --probe-only). Without a CUDA device it prints "SKIPPED" and exits 77 (never an OK
 * line; FAIL and 1 under BT_GPU_REQUIRE=1). */
#include "tests/gpu/gpu_test.h"

extern "C" {
#include "common/bt_common.h"
#include "common/gguf.h"
#include "common/quant.h"
#include "trainer/model/lora.h"
#include "trainer/model/model.h"
#include "trainer/loop/optim.h"
#include "trainer/model/rng.h"
#include "trainer/loop/step.h"
#include "trainer/config.h"
#include "trainer/estimate.h"
}
#include "trainer/cuda/cuda_trainer.h"
#include "trainer/cuda/cuda_trainer_internal.h" /* the shards' device bytes */
extern "C" {
#include "trainer/backend/backend.h"
extern const bt_backend_reg bt_backend_cuda_reg; /* trainer/cuda/backend_cuda.cu */
}

#include <algorithm>
#include <string>

#include <unistd.h>

/* ------------------------------------------------------------------------ batch helpers */
struct Batch {
    int B, T;
    std::vector<int32_t> ids, labels, pos, cu;
    bt_microbatch mb;
    void view()
    {
        mb.B = B;
        mb.T = T;
        mb.input_ids = ids.data();
        mb.labels = labels.data();
        mb.position_ids = pos.data();
        mb.cu_seqlens = cu.data();
        mb.n_cu = (int)cu.size();
    }
};

/* B rows of T tokens; each row is cut into documents at random points (>= 8 tokens each),
 * position_ids restart per document; labels = ids with ~10% -100. */
static Batch make_batch(int B, int T, int V, int max_docs_per_row)
{
    Batch b;
    b.B = B;
    b.T = T;
    const int M = B * T;
    b.ids.resize(M);
    b.labels.resize(M);
    b.pos.resize(M);
    for (int r = 0; r < B; r++) {
        int start = r * T;
        b.cu.push_back(start);
        int nd = 1 + rng_int(max_docs_per_row);
        std::vector<int> cuts;
        for (int d = 1; d < nd; d++) {
            int c = 8 + rng_int(T - 16);
            bool dup = false;
            for (int x : cuts)
                dup = dup || std::abs(x - c) < 8;
            if (!dup)
                cuts.push_back(c);
        }
        std::sort(cuts.begin(), cuts.end());
        for (int c : cuts)
            b.cu.push_back(start + c);
    }
    b.cu.push_back(M);
    for (size_t s = 0; s + 1 < b.cu.size(); s++)
        for (int t = b.cu[s]; t < b.cu[s + 1]; t++)
            b.pos[t] = t - b.cu[s];
    for (int t = 0; t < M; t++) {
        b.ids[t] = rng_int(V);
        b.labels[t] = rng_int(10) == 0 ? -100 : b.ids[t];
    }
    b.view();
    return b;
}

/* ------------------------------------------------------------------------ comparisons */
struct Stat {
    double cos, rl2, nr, ng;
};
static Stat compare(const float *g, const float *c, int64_t n)
{
    double dot = 0, gg = 0, cc = 0, dd = 0;
    for (int64_t i = 0; i < n; i++) {
        dot += (double)g[i] * c[i];
        gg += (double)g[i] * g[i];
        cc += (double)c[i] * c[i];
        dd += ((double)g[i] - c[i]) * ((double)g[i] - c[i]);
    }
    Stat s;
    s.cos = (gg > 0 && cc > 0) ? dot / sqrt(gg * cc) : (gg == cc ? 1.0 : 0.0);
    s.rl2 = cc > 0 ? sqrt(dd / cc) : sqrt(dd);
    s.nr = sqrt(cc);
    s.ng = sqrt(gg);
    return s;
}
static bool check_grad_block(const char *what, const float *g, const float *c, int64_t n,
                             double min_cos, double max_rl2)
{
    Stat s = compare(g, c, n);
    bool ok = std::isfinite(s.cos) && s.cos >= min_cos && s.rl2 <= max_rl2;
    printf("    %-28s n=%-9lld cos=%.5f (>= %.2f) rel_l2=%.3e (<= %.0e) |cpu|=%.3e |gpu|=%.3e%s\n",
           what, (long long)n, s.cos, min_cos, s.rl2, max_rl2, s.nr, s.ng, ok ? "" : "  <-- FAIL");
    if (!ok)
        g_case_ok = false;
    return ok;
}

/* ------------------------------------------------------------------------ one-step parity */
struct Case {
    const char *name;
    int base_dtype, tied, ckpt;
    float dropout;
    unsigned trainable;
    int B, T, docs;
    int s2 = 0;      /* S^2-Attn group in training (0 = full attention) */
    int offload = 0; /* offload the checkpointed layer inputs (needs ckpt) */
    int window = 0;  /* the model's sliding_window (Mistral-style, every layer; 0 = none) */
    int head_dim = 0; /* != 0: heads of this size (d_model / head_dim query heads, 1 KV head) */
};

/* Give B (zero at init) small random values so dA is not trivially zero. */
static void randomise_B(bt_lora *lo, float sd)
{
    for (int l = 0; l < lo->n_layer; l++)
        for (int mod = 0; mod < BT_MOD_N; mod++) {
            const bt_lora_mod *x = bt_lora_get(lo, l, mod);
            if (!x)
                continue;
            for (int64_t i = 0; i < (int64_t)x->out * lo->r; i++)
                x->B[i] = rng_normal() * sd;
        }
}

/* kernel choices for the GPU side of step_parity (bt_cuda_trainer_opts attn_impl / base_matmul_impl) */
static int g_attn_impl = 0, g_nf4_impl = 0;
/* >= 0: run_tiny_case turns the fp32 model's linears into ggml blocks of this type
 * (bt_model_to_ggml: a GGUF-native base; the CPU reference multiplies the same blocks) */
static int g_gguf_type = -1;

static void step_parity(const bt_model *m, bt_lora *lo, const Case &cs, uint64_t drop_key)
{
    const int M = cs.B * cs.T;
    Batch b = make_batch(cs.B, cs.T, m->hp.vocab, cs.docs);
    /* CPU reference */
    bt_step_ctx *ctx = nullptr;
    if (bt_step_ctx_new(&ctx, m, lo, M, cs.ckpt) != 0 || bt_step_set_s2(ctx, cs.s2) != 0) {
        printf("    bt_step_ctx_new: %s\n", bt_last_error());
        g_case_ok = false;
        return;
    }
    const int nlab = bt_shift_targets(nullptr, &b.mb, m->hp.vocab);
    const float gs = nlab > 0 ? 1.0f / (float)nlab : 0.f;
    bt_lora_zero_grad(lo);
    double cpu_loss = 0, cpu_eval = 0;
    int cpu_nv = 0;
    BTOK(bt_forward_backward(ctx, m, lo, &b.mb, 1, gs, drop_key, &cpu_loss, &cpu_nv));
    std::vector<float> cg(lo->grads, lo->grads + lo->n_params);
    BTOK(bt_forward_backward(ctx, m, lo, &b.mb, 0, 1.0f, drop_key, &cpu_eval, nullptr));
    bt_step_ctx_free(ctx);
    /* with a sliding window: the same step on the CPU with full causal attention, which the GPU
     * must NOT match (so a GPU step that ignored the window fails below) */
    double cpu_full = 0;
    std::vector<float> cg_full;
    if (cs.window > 0) {
        bt_model mf = *m; /* shallow: the same weights, no window */
        mf.hp.sliding_window = 0;
        bt_step_ctx *cf = nullptr;
        BTOK(bt_step_ctx_new(&cf, &mf, lo, M, cs.ckpt));
        bt_lora_zero_grad(lo);
        BTOK(bt_forward_backward(cf, &mf, lo, &b.mb, 1, gs, drop_key, &cpu_full, nullptr));
        cg_full.assign(lo->grads, lo->grads + lo->n_params);
        bt_step_ctx_free(cf);
    }
    /* GPU */
    bt_cuda_trainer *t = nullptr;
    bt_cuda_trainer_opts o;
    memset(&o, 0, sizeof o);
    o.checkpointing = cs.ckpt;
    o.attn_impl = g_attn_impl;
    o.base_matmul_impl = g_nf4_impl;
    o.s2_group = cs.s2;
    o.offload = cs.offload;
    if (bt_cuda_trainer_new(&t, m, lo, M, &o) != 0) {
        printf("    bt_cuda_trainer_new: %s\n", bt_last_error());
        g_case_ok = false;
        return;
    }
    double gpu_loss = 0;
    int gpu_nv = 0;
    BTOK(bt_cuda_trainer_zero_grad(t));
    BTOK(bt_cuda_trainer_step(t, &b.mb, 1, gs, drop_key, &gpu_loss, &gpu_nv));
    std::vector<float> gg((size_t)lo->n_params);
    bt_lora tmp = *lo;
    tmp.grads = gg.data();
    BTOK(bt_cuda_trainer_download_lora(t, &tmp, BT_CUDA_DL_GRADS));
    /* forward-only (eval) gives the same loss as the training forward */
    double ev_loss = 0;
    int ev_nv = 0;
    BTOK(bt_cuda_trainer_step(t, &b.mb, 0, 1.0f, drop_key, &ev_loss, &ev_nv));
    printf("    M=%d docs=%d labelled=%d  loss_sum cpu %.6f gpu %.6f (eval pass %.6f)\n", M,
           b.mb.n_cu - 1, nlab, cpu_loss, gpu_loss, ev_loss);
    check_true("n_valid equal", cpu_nv == gpu_nv && gpu_nv == nlab && ev_nv == nlab);
    const double lrel = fabs(gpu_loss - cpu_loss) / fmax(fabs(cpu_loss), 1e-30);
    printf("    loss rel err %.3e (tol 1e-2)\n", lrel);
    check_true("loss within 1e-2", lrel <= 1e-2);
    if (cs.window > 0) {
        const Stat sw = compare(gg.data(), cg.data(), lo->n_lora);
        const Stat sf = compare(gg.data(), cg_full.data(), lo->n_lora);
        printf("    sliding_window %d: cpu full-attention loss %.6f; GPU grads vs windowed CPU rel_l2 "
               "%.3e, vs full-attention CPU %.3e\n", cs.window, cpu_full, sw.rl2, sf.rl2);
        check_true("the window changes the CPU gradients past the tolerance",
                   compare(cg_full.data(), cg.data(), lo->n_lora).rl2 > 2 * 5e-2);
        check_true("GPU grads match the windowed CPU, not full attention", sw.rl2 * 4 < sf.rl2);
    }
    if (cs.s2 == 0) {
        check_true("eval loss == train loss", fabs(ev_loss - gpu_loss) <= 1e-6 * fabs(gpu_loss) + 1e-9);
    } else { /* S^2 in training only: the eval pass is full attention, as on the CPU */
        const double erel = fabs(ev_loss - cpu_eval) / fmax(fabs(cpu_eval), 1e-30);
        printf("    eval pass (full attention) cpu %.6f gpu %.6f rel %.3e; S2 changes the training "
               "loss by %.3e\n", cpu_eval, ev_loss, erel, fabs(cpu_loss - cpu_eval) / fabs(cpu_eval));
        check_true("eval pass (full attention) within 1e-2 of the CPU's", erel <= 1e-2);
        check_true("S2 changes the training loss", fabs(cpu_loss - cpu_eval) > 1e-4 * fabs(cpu_eval));
    }
    check_grad_block("LoRA grads (all)", gg.data(), cg.data(), lo->n_lora, 0.99, 5e-2);
    /* per module */
    double worst = 2;
    std::string worst_name;
    for (int l = 0; l < lo->n_layer; l++)
        for (int mod = 0; mod < BT_MOD_N; mod++) {
            const bt_lora_mod *x = bt_lora_get(lo, l, mod);
            if (!x)
                continue;
            for (int ab = 0; ab < 2; ab++) {
                const int64_t off = (ab ? x->dB : x->dA) - lo->grads;
                const int64_t n = ab ? (int64_t)x->out * lo->r : (int64_t)lo->r * x->in;
                Stat s = compare(gg.data() + off, cg.data() + off, n);
                char nm[64];
                snprintf(nm, sizeof nm, "L%d %s %s", l, bt_module_name(mod), ab ? "B" : "A");
                if (s.cos < worst) {
                    worst = s.cos;
                    worst_name = nm;
                }
                if (s.cos < 0.99 || s.rl2 > 5e-2)
                    printf("      note: %-22s cos=%.5f rel_l2=%.3e |cpu|=%.3e\n", nm, s.cos, s.rl2, s.nr);
            }
        }
    printf("    worst module: %s cos %.5f\n", worst_name.c_str(), worst);
    check_true("every module cos >= 0.95", worst >= 0.95);
    if (lo->dembed)
        check_grad_block("LoRA+ embedding grad", gg.data() + (lo->dembed - lo->grads),
                         cg.data() + (lo->dembed - lo->grads), (int64_t)lo->vocab * lo->d_model,
                         0.99, 5e-2);
    if (lo->dnorms)
        check_grad_block("LoRA+ norm grads", gg.data() + (lo->dnorms - lo->grads),
                         cg.data() + (lo->dnorms - lo->grads),
                         (int64_t)(2 * lo->n_layer + 1) * lo->d_model, 0.99, 5e-2);
    /* too-large micro-batch is refused */
    Batch big = make_batch(cs.B + 1, cs.T, m->hp.vocab, 1);
    check_true("M > max_M refused", bt_cuda_trainer_step(t, &big.mb, 1, gs, 0, nullptr, nullptr) == BT_ERR_RANGE);
    bt_cuda_trainer_free(t);
}

/* llama3: Llama 3.1 RoPE ("llama3" rope_scaling, factor 8, low 1, high 4, original 128 so that the
 * table has all three regions at head_dim 64, theta 500000): the GPU uses the model's inv_freq table. */
/* The tiny Llama of these cases: n_layer layers of 256, 4 heads of 64 over 2 KV heads, FFN 512,
 * vocab 1000, context 1024. */
static bt_llama_hparams tiny_hp(int n_layer)
{
    bt_llama_hparams hp;
    memset(&hp, 0, sizeof hp);
    hp.n_layer = n_layer;
    hp.d_model = 256;
    hp.n_head = 4;
    hp.n_kv_head = 2;
    hp.head_dim = 64;
    hp.d_ff = 512;
    hp.vocab = 1000;
    hp.ctx = 1024;
    hp.rope_theta = 10000.f;
    hp.rms_eps = 1e-5f;
    return hp;
}

static void run_tiny_case(const Case &cs, bool llama3 = false, int ext = BT_ROPE_EXT_NONE)
{
    bt_llama_hparams hp = tiny_hp(2);
    hp.sliding_window = cs.window;
    if (cs.head_dim) {
        hp.head_dim = cs.head_dim;
        hp.n_head = hp.d_model / cs.head_dim;
        hp.n_kv_head = 1;
    }
    if (llama3) {
        hp.rope_type = BT_ROPE_LLAMA3;
        hp.rope_theta = 500000.f;
        hp.rope_factor = 8.f;
        hp.rope_low_freq_factor = 1.f;
        hp.rope_high_freq_factor = 4.f;
        hp.rope_orig_ctx = 128;
    }
    if (ext != BT_ROPE_EXT_NONE)
        hp.ctx = cs.T / 2; /* the rows reach twice the trained context */
    bt_model m;
    if (bt_model_init_random(&m, &hp, cs.base_dtype, cs.tied, 42) != 0 ||
        (ext != BT_ROPE_EXT_NONE && bt_model_extend_context(&m, ext, cs.T) != 0)) {
        printf("    model set-up: %s\n", bt_last_error());
        g_case_ok = false;
        return;
    }
    if (g_gguf_type >= 0 && bt_model_to_ggml(&m, g_gguf_type) != 0) {
        printf("    bt_model_to_ggml: %s\n", bt_last_error());
        g_case_ok = false;
        bt_model_free(&m);
        return;
    }
    bt_lora lo;
    if (bt_lora_init(&lo, &m, 8, 16.0, cs.dropout, (1u << BT_MOD_N) - 1, cs.trainable, 7) != 0) {
        printf("    bt_lora_init: %s\n", bt_last_error());
        g_case_ok = false;
        bt_model_free(&m);
        return;
    }
    randomise_B(&lo, 0.05f);
    printf("    case %s\n", cs.name);
    step_parity(&m, &lo, cs, cs.dropout > 0 ? 0x1234567ull : 0);
    bt_lora_free(&lo);
    bt_model_free(&m);
}

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
static int long_T(void)
{
    const char *e = getenv("BT_GPU_EMU");
    return e && atoi(e) ? 320 : 1000;
}
static void test_tiny_long_doc(void)
{ /* one 1000-token document: several 64-key tiles, partial last tile */
    run_tiny_case({"nf4 tied, one 1000-token row", BT_BASE_NF4, 1, 0, 0.f, 0, 1, long_T(), 1});
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
    if (bt_model_init_random(&m, &hp, BT_BASE_FP32, 1, 42) != 0 ||
        bt_lora_init(&lo, &m, 8, 16.0, 0.f, (1u << BT_MOD_N) - 1, 0, 7) != 0) {
        printf("    set-up: %s\n", bt_last_error());
        g_case_ok = false;
        return;
    }
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
    if (bt_model_init_random(&m, &hp, BT_BASE_NF4, 1, 42) != 0 ||
        bt_lora_init(&lo, &m, 8, 16.0, 0.1, (1u << BT_MOD_N) - 1, BT_TRAIN_EMBED | BT_TRAIN_NORM,
                        7) != 0) {
        printf("    set-up: %s\n", bt_last_error());
        g_case_ok = false;
        return;
    }
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
    bt_llama_hparams hp;
    memset(&hp, 0, sizeof hp);
    hp.n_layer = 1, hp.d_model = 256, hp.n_head = 4, hp.n_kv_head = 2, hp.head_dim = 64;
    hp.d_ff = 512, hp.vocab = 100, hp.ctx = 256, hp.rope_theta = 10000.f, hp.rms_eps = 1e-5f;
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
    if (bt_model_init_random(&m, &hp, base_dtype, 1, 42) != 0) {
        printf("    model set-up: %s\n", bt_last_error());
        g_case_ok = false;
        return;
    }
    check_true("gemma: the local layers have their own RoPE table", !gemma || m.inv_freq_local);
    for (int l = 0; l < hp.n_layer; l++) {
        bt_layer *Ly = &m.layers[l];
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
    bt_lora lo;
    if (bt_lora_init(&lo, &m, 8, 16.0, dropout, (1u << BT_MOD_N) - 1, 0, 7) != 0) {
        printf("    bt_lora_init: %s\n", bt_last_error());
        g_case_ok = false;
        bt_model_free(&m);
        return;
    }
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
        bt_llama_hparams hp;
        memset(&hp, 0, sizeof hp);
        hp.n_layer = 30;
        hp.d_model = 576;
        hp.n_head = 9;
        hp.n_kv_head = 3;
        hp.head_dim = 64;
        hp.d_ff = 1536;
        hp.vocab = 49152;
        hp.ctx = 8192;
        hp.rope_theta = 100000.f;
        hp.rms_eps = 1e-5f;
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
static bool emu_size(void)
{
    const char *e = getenv("BT_GPU_EMU");
    return e && atoi(e);
}
static int smol_B(void) { return emu_size() ? 1 : 2; }
static int smol_T(void) { return emu_size() ? 32 : 256; }

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
        if (bt_model_init_random(&m, &hp, pc.base_dtype, pc.tied, 42) != 0 ||
            (pc.gguf_type >= 0 && bt_model_to_ggml(&m, pc.gguf_type) != 0)) {
            printf("    model set-up: %s\n", bt_last_error());
            g_case_ok = false;
            return;
        }
        bt_lora lo;
        if (bt_lora_init(&lo, &m, 8, 16.0, 0.0, pc.targets, pc.trainable, 7) != 0) {
            printf("    bt_lora_init: %s\n", bt_last_error());
            g_case_ok = false;
            bt_model_free(&m);
            return;
        }
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
    GT_CASE(test_tiny_sliding_window);
    GT_CASE(test_tiny_head_dim_256);
    GT_CASE(test_tiny_mma_fused);
    GT_CASE(test_tiny_gguf);
    GT_CASE(test_qwen2_bias);
    GT_CASE(test_qwen3_qk_norm);
    GT_CASE(test_phi3_fused);
    GT_CASE(test_gemma_pieces);
    GT_CASE(test_gemma3_refused);
    GT_CASE(test_gemma3_step);
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
