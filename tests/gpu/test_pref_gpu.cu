/* GPU preference passes (trainer/cuda/cuda_trainer.h bt_cuda_trainer_logprobs /
 * _backward_logprobs, issue 25) against the CPU fp32 reference (trainer/loop/step.h
 * bt_forward_logprobs / bt_backward_logprobs), both driven by the real preference step
 * (trainer/loop/pref_step.h) on a tiny random Llama (tests/gpu/gpu_step_util.h tiny_model_lora: 2
 * layers of 128, 2 heads of 64 over 1 KV head, FFN 256, vocab 512) with LoRA on every linear:
 *   - one case per objective family: DPO sigmoid, ORPO, SimPO (CPO loss_type simpo), KTO (with
 *     its KL sequences; activation checkpointing on both backends), and DPO again with LoRA+ (trainable tied embedding = lm_head, norms:
 *     the extra vocabulary pass of the backward) and LoRA dropout;
 *   - per segment (each pair's chosen and rejected, each KTO example): the summed policy
 *     log-probs (adapter on) and reference log-probs (adapter off: base only, LoRA+ weights
 *     included) of the GPU vs the CPU; the reference differs from the policy (the adapter is
 *     really switched off, and on);
 *   - the step's loss and TRL metrics (logps/chosen, logps/rejected) and the LoRA (+ LoRA+)
 *     gradients of the whole step;
 *   - contract: a backward without its forward, or after another pass, is refused; a trainer
 *     without opts.preference refuses the backward.
 * Tolerances (bf16 activations vs the fp32 reference):
 *   segment log-prob sums: |gpu - cpu| <= 1e-2 x max(1, |cpu|);
 *   loss: |gpu - cpu| <= 1e-2 x max(0.1, |cpu|); logps/chosen, logps/rejected as the sums;
 *   gradients: cosine >= 0.99 and rel-L2 <= 5e-2 (the whole LoRA vector; LoRA+ blocks apart).
 * Options: those of every GPU test binary (tests/gpu/gpu_test.h gt_init). Without a CUDA device it
 * prints "SKIPPED" and exits 77. */
#include "tests/gpu/gpu_test.h"
#include "tests/gpu/gpu_step_util.h"

extern "C" {
#include "kernels/kernels.h"
#include "proto/batch.h"
#include "trainer/backend/backend.h"
#include "trainer/loop/pref_step.h"
}

/* ------------------------------------------------------------------ the two backends */
/* Minimal bt_backend tables over a CPU step context and a GPU trainer: the preference step only
 * calls the log-prob passes (backend.h logprobs / backward_logprobs). */
struct cpu_be {
    bt_step_ctx *ctx;
    const bt_model *m;
    bt_lora *lo;
};
static int cpu_lp(bt_backend *b, const bt_microbatch *mb, int policy, int backward, uint64_t key,
                  float *logp, int *nv)
{
    cpu_be *c = (cpu_be *)b->context;
    return bt_forward_logprobs(c->ctx, c->m, policy ? c->lo : nullptr, mb, backward, key, logp, nv);
}
static int cpu_blp(bt_backend *b, const bt_microbatch *mb, const float *dlogp, uint64_t key)
{
    cpu_be *c = (cpu_be *)b->context;
    return bt_backward_logprobs(c->ctx, c->m, c->lo, mb, dlogp, key);
}
static int gpu_lp(bt_backend *b, const bt_microbatch *mb, int policy, int backward, uint64_t key,
                  float *logp, int *nv)
{
    return bt_cuda_trainer_logprobs((bt_cuda_trainer *)b->context, mb, policy, backward, key, logp, nv);
}
static int gpu_blp(bt_backend *b, const bt_microbatch *mb, const float *dlogp, uint64_t key)
{
    return bt_cuda_trainer_backward_logprobs((bt_cuda_trainer *)b->context, mb, dlogp, key);
}

/* ------------------------------------------------------------------ preference batches */
struct PrefBatch {
    int B, T;
    std::vector<int32_t> ids, labels, pos, cu, kind, pair;
    bt_pref_batch pb;
    void seg(int plen, int rlen, int32_t k, int32_t p, int V)
    {
        const int a = (int)ids.size();
        for (int i = 0; i < plen + rlen; i++) {
            const int32_t id = (int32_t)rng_int(V);
            ids.push_back(id);
            labels.push_back(i < plen ? BT_LABEL_IGNORE : id);
            pos.push_back(i);
        }
        cu.push_back(a);
        kind.push_back(k);
        pair.push_back(p);
    }
    void pad_row(int V)
    {
        const int end = ((int)ids.size() + T - 1) / T * T;
        if ((int)ids.size() < end)
            seg(end - (int)ids.size(), 0, BT_SEG_PLAIN, -1, V);
    }
    void view()
    {
        cu.push_back((int32_t)ids.size());
        memset(&pb, 0, sizeof pb);
        pb.mb.B = B;
        pb.mb.T = T;
        pb.mb.input_ids = ids.data();
        pb.mb.labels = labels.data();
        pb.mb.position_ids = pos.data();
        pb.mb.cu_seqlens = cu.data();
        pb.mb.n_cu = (int)cu.size();
        pb.seg_kind = kind.data();
        pb.seg_pair = pair.data();
    }
};

/* Two rows of 64: pairs (prompt + chosen, prompt + rejected) or KTO examples, then padding. */
static PrefBatch make_pref_batch(int kto, int V)
{
    PrefBatch b;
    b.B = 2;
    b.T = 64;
    if (!kto) {
        b.seg(8, 16, BT_SEG_CHOSEN, 0, V);
        b.seg(8, 20, BT_SEG_REJECTED, 0, V);
        b.pad_row(V);
        b.seg(10, 14, BT_SEG_CHOSEN, 1, V);
        b.seg(10, 22, BT_SEG_REJECTED, 1, V);
        b.pad_row(V);
    } else {
        b.seg(8, 12, BT_SEG_KTO_DESIRABLE, 0, V);
        b.seg(6, 14, BT_SEG_KTO_UNDESIRABLE, 1, V);
        b.seg(8, 12, BT_SEG_KTO_DESIRABLE, 2, V);
        b.pad_row(V);
        b.seg(7, 15, BT_SEG_KTO_UNDESIRABLE, 3, V);
        b.seg(9, 11, BT_SEG_KTO_DESIRABLE, 4, V);
        b.pad_row(V);
    }
    b.view();
    return b;
}

/* ------------------------------------------------------------------ comparisons */
/* the step's LoRA (+ LoRA+) gradient blocks: cosine >= 0.99, rel-L2 <= 5e-2 (gpu_step_util.h) */
static void check_grads(const char *what, const float *g, const float *c, int64_t n)
{
    check_grad_block(what, g, c, n, 0.99, 5e-2);
}
static bool close_to(double gpu, double cpu, double floor_)
{
    return std::isfinite(gpu) && fabs(gpu - cpu) <= 1e-2 * fmax(floor_, fabs(cpu));
}

/* Per-segment sums of a log-prob pass (policy or reference) of pb on backend be. */
static std::vector<double> seg_logps(bt_backend *be, const PrefBatch &b, int policy, int V, int *nv)
{
    const int M = b.B * b.T, nseg = b.pb.mb.n_cu - 1;
    std::vector<float> logp((size_t)M, 1.f);
    std::vector<int32_t> tg((size_t)M);
    std::vector<double> sums((size_t)nseg, 0.0);
    if (bt_backend_logprobs(be, &b.pb.mb, policy, 0, 0, logp.data(), nv) != 0) {
        printf("    log-probs: %s\n", bt_last_error());
        g_case_ok = false;
        return sums;
    }
    bt_shift_targets(tg.data(), &b.pb.mb, V);
    bt_seq_sum(sums.data(), nullptr, logp.data(), tg.data(), nullptr, b.pb.mb.cu_seqlens, nseg, V);
    return sums;
}

/* One optimiser step's preference gradient on be (pref_run.c's order): counts, KTO's KL, begin,
 * the micro-batch with backward, the metrics. */
static int pref_step(bt_backend *be, const bt_pref_params *p, const PrefBatch &b, int V,
                     uint64_t key, bt_pref_metrics *m)
{
    bt_pref_step *s = nullptr;
    int rc = bt_pref_step_new(&s, p, b.B, b.T, V);
    bt_pref_counts cnt = {0, 0};
    double kl[2] = {0, 0}, kl_mean = 0, sums[BT_PREF_NSUMS];
    if (!rc)
        rc = bt_pref_step_count(s, &b.pb, &cnt);
    if (!rc && p->algo == BT_PREF_KTO && !(rc = bt_pref_step_kl(s, be, &b.pb, kl)))
        kl_mean = kl[1] > 0 ? kl[0] / kl[1] : 0;
    if (!rc) {
        bt_pref_step_begin(s, &cnt, kl_mean);
        rc = bt_pref_step_micro(s, be, &b.pb, 1, key);
    }
    if (!rc) {
        bt_pref_step_sums(s, kl_mean, sums);
        bt_pref_metrics_of(p, sums, kl_mean, m);
    }
    bt_pref_step_free(s);
    if (rc) {
        printf("    preference step: %s\n", bt_last_error());
        g_case_ok = false;
    }
    return rc;
}

/* ------------------------------------------------------------------ one case */
static void pref_case(bt_pref_algo algo, int simpo, unsigned trainable, float dropout, int ckpt)
{
    const bt_llama_hparams hp = llama_hp(2, 128, 2, 1, 64, 256, 512, 256);
    const int V = hp.vocab, tied = trainable != 0;
    bt_model m;
    bt_lora lo;
    /* a tied N(0, 1) embedding as lm_head gives logits far sharper than a trained model's (sums of
     * hundreds of nats a token); scaled down, the log-probs are a real model's few nats a token */
    const auto scale_embd = [&](bt_model *pm) {
        for (int64_t i = 0; tied && i < (int64_t)V * hp.d_model; i++)
            pm->tok_embd[i] *= 0.1f;
        return 0;
    };
    if (tiny_model_lora(&m, &lo, hp, BT_BASE_FP32, tied, dropout, (1u << BT_MOD_N) - 1, trainable,
                        scale_embd) != 0)
        return;
    /* B away from 0 (and LoRA+ weights away from the base), so the policy differs from the
     * reference and every gradient is non-trivial */
    randomise_B(&lo, 0.2f);
    if (lo.embed)
        for (int64_t i = 0; i < (int64_t)V * hp.d_model; i++)
            lo.embed[i] += rng_normal() * 0.01f;
    if (lo.norms)
        for (int64_t i = 0; i < (int64_t)(2 * hp.n_layer + 1) * hp.d_model; i++)
            lo.norms[i] *= 1.0f + rng_normal() * 0.05f;
    bt_pref_params p;
    bt_pref_defaults(&p, algo);
    if (simpo) { /* config.c: "simpo" is CPO with loss_type simpo and cpo_alpha 0 */
        p.loss_type[0] = BT_PREF_LOSS_SIMPO;
        p.cpo_alpha = 0.0;
    }
    PrefBatch b = make_pref_batch(algo == BT_PREF_KTO, V);
    const int M = b.B * b.T, nseg = b.pb.mb.n_cu - 1;
    const uint64_t key = dropout > 0 ? 0xABCDEF12345ull : 0;

    cpu_be cb = {nullptr, &m, &lo};
    bt_cuda_trainer *t = nullptr, *t_nopref = nullptr;
    bt_cuda_trainer_opts o;
    memset(&o, 0, sizeof o);
    o.preference = 1;
    o.checkpointing = ckpt;
    if (bt_step_ctx_new(&cb.ctx, &m, &lo, M, ckpt) != 0 || bt_cuda_trainer_new(&t, &m, &lo, M, &o) != 0) {
        printf("    set-up: %s\n", bt_last_error());
        g_case_ok = false;
        bt_step_ctx_free(cb.ctx);
        bt_lora_free(&lo);
        bt_model_free(&m);
        return;
    }
    bt_backend_i ci, gi;
    memset(&ci, 0, sizeof ci);
    memset(&gi, 0, sizeof gi);
    ci.logprobs = cpu_lp;
    ci.backward_logprobs = cpu_blp;
    gi.logprobs = gpu_lp;
    gi.backward_logprobs = gpu_blp;
    bt_backend cpu = {&ci, &cb}, gpu = {&gi, t};

    /* 1. per-segment log-probs: policy and reference */
    int ncv = 0, ngv = 0;
    const std::vector<double> cpol = seg_logps(&cpu, b, 1, V, &ncv), gpol = seg_logps(&gpu, b, 1, V, &ngv);
    const std::vector<double> cref = seg_logps(&cpu, b, 0, V, nullptr), gref = seg_logps(&gpu, b, 0, V, nullptr);
    check_true("n_valid equal", ncv == ngv && ncv > 0);
    bool seg_ok = true;
    double worst = 0, moved = 0, apart = 0;
    for (int k = 0; k < nseg; k++) {
        if (b.kind[k] == BT_SEG_PLAIN)
            continue;
        seg_ok = seg_ok && close_to(gpol[k], cpol[k], 1.0) && close_to(gref[k], cref[k], 1.0);
        worst = fmax(worst, fmax(fabs(gpol[k] - cpol[k]), fabs(gref[k] - cref[k])) / fmax(1.0, fabs(cpol[k])));
        /* what the adapter changes: |policy - reference| on the CPU, and how far the GPU's change
         * is from it (a reference pass that left the adapter on would change nothing) */
        moved += fabs(cpol[k] - cref[k]);
        apart += fabs((gpol[k] - gref[k]) - (cpol[k] - cref[k]));
        printf("    segment %d (%s): policy cpu %.4f gpu %.4f  reference cpu %.4f gpu %.4f\n", k,
               b.kind[k] == BT_SEG_CHOSEN ? "chosen" : b.kind[k] == BT_SEG_REJECTED ? "rejected"
               : b.kind[k] == BT_SEG_KTO_DESIRABLE ? "desirable" : "undesirable", cpol[k], gpol[k],
               cref[k], gref[k]);
    }
    printf("    worst segment error %.3e (relative to max(1, |cpu|); tol 1e-2)\n", worst);
    check_true("segment log-prob sums (policy and reference) within 1e-2", seg_ok);
    printf("    adapter on - off: sum over segments |cpu| %.4f nats, |gpu - cpu| %.4f\n", moved, apart);
    check_true("the adapter moves the log-probs (> 1 nat), the GPU's the CPU's way (within 20%)",
               moved > 1.0 && apart <= 0.2 * moved);

    /* 2. the step: loss, metrics, gradients */
    bt_pref_metrics mc, mg;
    bt_lora_zero_grad(&lo);
    BTOK(bt_cuda_trainer_zero_grad(t));
    if (pref_step(&cpu, &p, b, V, key, &mc) == 0 && pref_step(&gpu, &p, b, V, key, &mg) == 0) {
        printf("    loss cpu %.6f gpu %.6f; logps/chosen cpu %.4f gpu %.4f; logps/rejected cpu %.4f gpu %.4f\n",
               mc.loss, mg.loss, mc.logps_chosen, mg.logps_chosen, mc.logps_rejected, mg.logps_rejected);
        check_true("loss within 1e-2", close_to(mg.loss, mc.loss, 0.1));
        check_true("logps/chosen within 1e-2", close_to(mg.logps_chosen, mc.logps_chosen, 1.0));
        check_true("logps/rejected within 1e-2", close_to(mg.logps_rejected, mc.logps_rejected, 1.0));
        std::vector<float> gg((size_t)lo.n_params);
        bt_lora tmp = lo;
        tmp.grads = gg.data();
        BTOK(bt_cuda_trainer_download_lora(t, &tmp, BT_CUDA_DL_GRADS));
        check_grads("LoRA grads (all)", gg.data(), lo.grads, lo.n_lora);
        if (lo.dembed)
            check_grads("LoRA+ embedding grad", gg.data() + (lo.dembed - lo.grads), lo.dembed,
                        (int64_t)V * hp.d_model);
        if (lo.dnorms)
            check_grads("LoRA+ norm grads", gg.data() + (lo.dnorms - lo.grads), lo.dnorms,
                        (int64_t)(2 * hp.n_layer + 1) * hp.d_model);
    }

    /* 3. the contract: a backward needs its own forward, directly before it */
    std::vector<float> lp((size_t)M), dl((size_t)M, 0.5f);
    check_true("backward without a forward refused",
               bt_cuda_trainer_backward_logprobs(t, &b.pb.mb, dl.data(), key) == BT_ERR_INVALID);
    BTOK(bt_cuda_trainer_logprobs(t, &b.pb.mb, 1, 1, key, lp.data(), nullptr));
    BTOK(bt_cuda_trainer_step(t, &b.pb.mb, 0, 1.f, 0, nullptr, nullptr));
    check_true("backward after another pass refused",
               bt_cuda_trainer_backward_logprobs(t, &b.pb.mb, dl.data(), key) == BT_ERR_INVALID);
    check_true("training pass of the reference refused",
               bt_cuda_trainer_logprobs(t, &b.pb.mb, 0, 1, key, lp.data(), nullptr) == BT_ERR_INVALID);
    if (algo == BT_PREF_DPO && !trainable) { /* once: a trainer made without opts.preference */
        o.preference = 0;
        if (bt_cuda_trainer_new(&t_nopref, &m, &lo, M, &o) == 0) {
            BTOK(bt_cuda_trainer_logprobs(t_nopref, &b.pb.mb, 1, 1, 0, lp.data(), nullptr));
            check_true("no opts.preference: backward refused",
                       bt_cuda_trainer_backward_logprobs(t_nopref, &b.pb.mb, dl.data(), 0) == BT_ERR_INVALID);
            bt_cuda_trainer_free(t_nopref);
        }
    }
    bt_cuda_trainer_free(t);
    bt_step_ctx_free(cb.ctx);
    bt_lora_free(&lo);
    bt_model_free(&m);
}

static void test_pref_dpo_sigmoid(void) { pref_case(BT_PREF_DPO, 0, 0, 0.f, 0); }
static void test_pref_orpo(void) { pref_case(BT_PREF_ORPO, 0, 0, 0.f, 0); }
static void test_pref_simpo(void) { pref_case(BT_PREF_CPO, 1, 0, 0.f, 0); }
static void test_pref_kto_ckpt(void) { pref_case(BT_PREF_KTO, 0, 0, 0.f, 1); }
static void test_pref_dpo_loraplus_dropout(void)
{
    pref_case(BT_PREF_DPO, 0, BT_TRAIN_EMBED | BT_TRAIN_NORM, 0.1f, 0);
}

int main(int argc, char **argv)
{
    const char *prog = "test_pref_gpu";
    const int init = gt_init(prog, argc, argv);
    if (init >= 0)
        return init;
    GT_CASE(test_pref_dpo_sigmoid);
    GT_CASE(test_pref_orpo);
    GT_CASE(test_pref_simpo);
    GT_CASE(test_pref_kto_ckpt);
    GT_CASE(test_pref_dpo_loraplus_dropout);
    return gt_run(prog);
}
