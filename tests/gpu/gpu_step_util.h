/* The one-step parity of the GPU trainer tests (tests/gpu/test_trainer_gpu.cu,
 * test_families_gpu.cu, test_pref_gpu.cu): tiny random Llama models with a LoRA on them, packed
 * micro-batches, the CPU fp32 step (trainer/loop/step.h bt_forward_backward) against the GPU step
 * (trainer/cuda/cuda_trainer.h), and the gradient comparisons with their tolerances.
 * Include after tests/gpu/gpu_test.h; header-only (its checks set the including binary's
 * g_case_ok). Every function here is static inline: a binary uses what it needs.
 * Tolerances (bf16 activations vs the fp32 reference), step_parity:
 *   loss_sum: |gpu - cpu| / |cpu| <= 1e-2;
 *   gradients (the whole LoRA gradient vector, and the LoRA+ blocks separately):
 *     cosine similarity >= 0.99 and rel-L2 ||g - c|| / ||c|| <= 5e-2;
 *     each LoRA module (A or B of one layer) is printed when worse than that; modules must reach
 *     cosine >= 0.95 (small modules are noisier). */
#ifndef BT_TESTS_GPU_STEP_UTIL_H
#define BT_TESTS_GPU_STEP_UTIL_H
#include "tests/gpu/gpu_test.h"

extern "C" {
#include "common/bt_common.h"
#include "trainer/loop/step.h"
#include "trainer/model/lora.h"
#include "trainer/model/model.h"
#include "trainer/model/rng.h"
}
#include "trainer/cuda/cuda_trainer.h"

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

/* BT_GPU_EMU=1: the run is on the CPU emulator of tests/emu (`make test-emu`), whose cases are
 * emulation-sized (shorter rows, a smaller micro-batch). */
static inline bool gt_emu(void)
{
    const char *e = getenv("BT_GPU_EMU");
    return e && atoi(e);
}

/* ------------------------------------------------------------------------ models */
/* A Llama's hparams: n_layer layers of d_model, n_head query heads of head_dim over n_kv_head KV
 * heads, FFN d_ff, vocabulary `vocab`, context `ctx` tokens, RoPE base rope_theta, RMSNorm eps
 * 1e-5; everything else zero (no scaling, no window, arch llama). */
static inline bt_llama_hparams llama_hp(int n_layer, int d_model, int n_head, int n_kv_head, int head_dim,
                                        int d_ff, int vocab, int ctx, float rope_theta = 10000.f)
{
    bt_llama_hparams hp;
    memset(&hp, 0, sizeof hp);
    hp.n_layer = n_layer;
    hp.d_model = d_model;
    hp.n_head = n_head;
    hp.n_kv_head = n_kv_head;
    hp.head_dim = head_dim;
    hp.d_ff = d_ff;
    hp.vocab = vocab;
    hp.ctx = ctx;
    hp.rope_theta = rope_theta;
    hp.rms_eps = 1e-5f;
    return hp;
}

/* The tiny Llama of the trainer and family cases: n_layer layers of 256, 4 heads of 64 over 2 KV
 * heads, FFN 512, vocab 1000, context 1024. */
static inline bt_llama_hparams tiny_hp(int n_layer) { return llama_hp(n_layer, 256, 4, 2, 64, 512, 1000, 1024); }

/* A random model and its LoRA: *m = bt_model_init_random(hp, base_dtype, tied, seed 42), then
 * prep(m) where given (weights changed, blocks converted, context extended: 0, or nonzero with
 * bt_last_error saying why), then *lo = bt_lora_init(m, r 8, alpha 16, dropout, `targets` (BT_MOD_*
 * bits), `trainable` (BT_TRAIN_*), seed 7). Returns 0 (the caller frees both), or -1 with
 * "    set-up: <why>" printed, g_case_ok false and nothing left allocated. */
static inline int tiny_model_lora(bt_model *m, bt_lora *lo, const bt_llama_hparams &hp, int base_dtype,
                                  int tied, float dropout, unsigned targets, unsigned trainable,
                                  const std::function<int(bt_model *)> &prep = nullptr)
{
    if (bt_model_init_random(m, &hp, base_dtype, tied, 42) != 0) {
        printf("    set-up: %s\n", bt_last_error());
        g_case_ok = false;
        return -1;
    }
    if ((prep && prep(m) != 0) || bt_lora_init(lo, m, 8, 16.0, dropout, targets, trainable, 7) != 0) {
        printf("    set-up: %s\n", bt_last_error());
        g_case_ok = false;
        bt_model_free(m);
        return -1;
    }
    return 0;
}

/* Every LoRA's B (zero at init) drawn N(0, sd^2) from the test RNG (layer by layer, module by
 * module), so that dA and the policy's change are not trivially zero. */
static inline void randomise_B(bt_lora *lo, float sd)
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

/* ------------------------------------------------------------------------ batches */
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
static inline Batch make_batch(int B, int T, int V, int max_docs_per_row)
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
    double cos, rl2, nr, ng; /* cosine, ||g - c|| / ||c||, ||c||, ||g|| */
};
/* g (GPU) against c (CPU reference), n floats, in double. Cosine 1 when both are zero, 0 when one
 * is; rel-L2 is the absolute ||g - c|| when c is zero. */
static inline Stat compare(const float *g, const float *c, int64_t n)
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
/* One gradient block: passes with cosine >= min_cos and rel-L2 <= max_rl2 against a non-zero
 * reference (an all-zero one checks nothing); one line printed with both figures, their bounds and
 * the two norms; a miss sets g_case_ok false. */
static inline bool check_grad_block(const char *what, const float *g, const float *c, int64_t n,
                                    double min_cos, double max_rl2)
{
    Stat s = compare(g, c, n);
    bool ok = std::isfinite(s.cos) && s.cos >= min_cos && s.rl2 <= max_rl2 && s.nr > 0;
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

/* kernel choices for the GPU side of step_parity (bt_cuda_trainer_opts attn_impl / base_matmul_impl) */
static int g_attn_impl = 0, g_nf4_impl = 0;
/* >= 0: run_tiny_case turns the fp32 model's linears into ggml blocks of this type
 * (bt_model_to_ggml: a GGUF-native base; the CPU reference multiplies the same blocks) */
static int g_gguf_type = -1;

/* One micro-batch (cs.B rows of cs.T tokens, up to cs.docs documents a row) through the CPU step
 * and the GPU step (g_attn_impl, g_nf4_impl; cs.ckpt, cs.s2, cs.offload) on model m with LoRA lo,
 * dropout masks from drop_key: n_valid, loss, the eval pass, LoRA (+ LoRA+) gradients within the
 * tolerances above; with cs.window, the GPU must match the windowed CPU step and not the
 * full-attention one; a micro-batch past the trainer's size refused. */
static inline void step_parity(const bt_model *m, bt_lora *lo, const Case &cs, uint64_t drop_key)
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

/* step_parity on the tiny Llama (tiny_hp(2)) made for case cs: its base dtype, tying, window and
 * head size (cs.head_dim: d_model / head_dim query heads over 1 KV head); llama3: Llama 3.1 RoPE
 * ("llama3" rope_scaling, factor 8, low 1, high 4, original 128 so that the table has all three
 * regions at head_dim 64, theta 500000: the GPU uses the model's inv_freq table); ext: a context
 * extension (BT_ROPE_EXT_*) of a model trained on cs.T / 2 tokens to cs.T; g_gguf_type >= 0: the
 * linears as ggml blocks of that type. LoRA r 8 on every linear, B N(0, 0.05^2), dropout cs.dropout
 * with key 0x1234567 (0 without dropout). */
static inline void run_tiny_case(const Case &cs, bool llama3 = false, int ext = BT_ROPE_EXT_NONE)
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
    bt_lora lo;
    const auto prep = [&](bt_model *pm) {
        return (ext != BT_ROPE_EXT_NONE && bt_model_extend_context(pm, ext, cs.T) != 0) ||
               (g_gguf_type >= 0 && bt_model_to_ggml(pm, g_gguf_type) != 0);
    };
    if (tiny_model_lora(&m, &lo, hp, cs.base_dtype, cs.tied, cs.dropout, (1u << BT_MOD_N) - 1,
                        cs.trainable, prep) != 0)
        return;
    randomise_B(&lo, 0.05f);
    printf("    case %s\n", cs.name);
    step_parity(&m, &lo, cs, cs.dropout > 0 ? 0x1234567ull : 0);
    bt_lora_free(&lo);
    bt_model_free(&m);
}

#endif
