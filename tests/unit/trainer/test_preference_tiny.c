/* DPO, ORPO, SimPO and KTO end to end on the CPU step against TRL 1.16.0 running the real model: the
 * tiny Llama of
 * tests/fixtures/hf/tiny-llama-tied with the PEFT LoRA adapter tests/fixtures/hf/lora/adapter-init
 * (non-zero lora_B), three tokenized pairs packed as six documents of one row (cu_seqlens,
 * position_ids restarting, labels on the response tokens only). Fixtures
 * tests/fixtures/preference/tiny_dpo.json and tiny_dpo_grads.safetensors come from
 * tests/reference/gen_preference_fixtures.py, which runs DPOTrainer._compute_loss with TRL's fused
 * LM head, its DataCollatorForPreference (right-padded rows) and the reference as the same model
 * with the adapter disabled.
 * Checked: per-sequence policy and reference log-probs (bt_forward_logprobs with and without the
 * adapter, bt_seq_sum), the loss and TRL's metrics (bt_pref_pair_loss), and the LoRA gradients
 * after bt_backward_logprobs, for DPO loss types sigmoid and ipo; activation checkpointing gives
 * the same gradients bit for bit; ORPO and CPO's SimPO with its NLL term (TRL's
 * ORPOTrainer / CPOTrainer concatenated_forward + get_batch_loss_metrics on full logits) from one
 * scoring pass with labels on every token: average response log-probs, the chosen NLL, loss,
 * metrics, LoRA gradients; KTO (KTOTrainer._compute_loss, non-default desirable / undesirable
 * weights) on four unpaired examples and their KL documents (TRL's cycled completions) in one
 * row: log-probs, the batch KL estimate, loss, metrics, LoRA gradients; a backward without its
 * forward is refused.
 * Tolerances (TRL runs in fp32): per-sequence log-probs, loss and metrics relative 2e-6; LoRA
 * gradients max|ours - TRL| / max|TRL| <= 2e-5 per tensor. Measured (printed): DPO 1.8e-7,
 * 2.5e-7, 3.9e-7 and 2.6e-6; ORPO / SimPO 1.7e-7, 6.5e-8, 4.9e-7 and 2.6e-6; KTO 2.0e-7,
 * 1.9e-8, 4.8e-7 and 1.9e-6. */
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
#include "trainer/preference.h"
#include "trainer/loop/step.h"
#include "trainer/model/lora.h"
#include "trainer/model/model.h"

#define FIX "tests/fixtures/preference/"
#define MAXT 128
#define NP 3          /* pairs */
#define NS (2 * NP)   /* sequences: chosen 0..NP-1, then rejected 0..NP-1 (TRL's order) */
#define MAXD 16       /* documents in the packed row */

typedef struct {
    bt_model m;
    bt_lora lo;
    json_t *doc;
    int32_t ids[MAXT], lab[MAXT], pos[MAXT], cu[MAXD + 1], resp[MAXD];
    int n_doc;
    uint8_t resp_mask[MAXT]; /* position t predicts a response token (its target is one) */
    int T;
    bt_microbatch mb;
} rig;

static void ids_of(json_t *a, int32_t *out, int *n)
{
    for (size_t i = 0; i < json_array_size(a); i++) {
        assert_true(*n < MAXT);
        out[(*n)++] = (int32_t)json_integer_value(json_array_get(a, i));
    }
}

/* Pack documents prompt[d] + completion[d] (JSON id arrays) into one row: labels = input_ids on
 * the completion, -100 on the prompt (TRL: input_ids.masked_fill(completion_mask == 0, -100));
 * with all_labels, labels on every token (ORPO's NLL scores the prompt too) and resp_mask telling
 * the response targets apart. Position ids restart per document; cu_seqlens bound them. */
static void pack_docs(rig *r, json_t *const *prompt, json_t *const *completion, int n,
                      int all_labels)
{
    assert_true(n <= MAXD);
    int T = 0;
    r->cu[0] = 0;
    for (int s = 0; s < n; s++) {
        const int start = T;
        ids_of(prompt[s], r->ids, &T);
        const int pend = T;
        ids_of(completion[s], r->ids, &T);
        for (int t = start; t < T; t++) {
            r->pos[t] = t - start;
            r->lab[t] = t >= pend || all_labels ? r->ids[t] : -100;
            r->resp_mask[t] = t + 1 >= pend && t + 1 < T; /* T is this document's end here */
        }
        r->resp[s] = T - pend;
        r->cu[s + 1] = T;
    }
    r->T = T;
    r->n_doc = n;
    bt_microbatch mb = {1, T, r->ids, r->lab, r->pos, r->cu, n + 1};
    r->mb = mb;
}

/* The model, the adapter, the fixture; the six DPO sequences packed (chosen 0..2, rejected 0..2). */
static void rig_init_ex(rig *r, int all_labels)
{
    memset(r, 0, sizeof *r);
    bt_model_load_opts o = {BT_BASE_FP32, 0};
    if (bt_model_load(&r->m, "tests/fixtures/hf/tiny-llama-tied", &o))
        fail_msg("%s", bt_last_error());
    if (bt_lora_load_peft(&r->lo, &r->m, "tests/fixtures/hf/lora/adapter-init"))
        fail_msg("%s", bt_last_error());
    json_error_t je;
    r->doc = json_load_file(FIX "tiny_dpo.json", 0, &je);
    if (!r->doc)
        fail_msg(FIX "tiny_dpo.json: %s", je.text);
    json_t *pairs = json_object_get(r->doc, "pairs");
    assert_int_equal(json_array_size(pairs), NP);
    json_t *pr[NS], *co[NS];
    for (int s = 0; s < NS; s++) {
        json_t *p = json_array_get(pairs, (size_t)(s % NP));
        pr[s] = json_object_get(p, "prompt_ids");
        co[s] = json_object_get(p, s < NP ? "chosen_ids" : "rejected_ids");
    }
    pack_docs(r, pr, co, NS, all_labels);
}

static void rig_init(rig *r) { rig_init_ex(r, 0); }

static void rig_free(rig *r)
{
    json_decref(r->doc);
    bt_lora_free(&r->lo);
    bt_model_free(&r->m);
}

static double rel(double got, double want)
{
    return fabs(got - want) / (fabs(want) > 1e-30 ? fabs(want) : 1.0);
}

/* per-sequence log-prob sums and response-token counts of one pass */
static void seq_logps(bt_step_ctx *c, rig *r, const bt_lora *lo, int backward, double *sums,
                      float *logp)
{
    int nv = -1;
    assert_int_equal(bt_forward_logprobs(c, &r->m, lo, &r->mb, backward, 0, logp, &nv), 0);
    int32_t tg[MAXT], cnt[NS];
    assert_true(bt_shift_targets(tg, &r->mb, r->m.hp.vocab) == nv);
    int ncnt[NS];
    assert_int_equal(bt_seq_sum(sums, ncnt, logp, tg, NULL, r->cu, NS, r->m.hp.vocab), 0);
    for (int s = 0; s < NS; s++) {
        cnt[s] = ncnt[s];
        assert_int_equal(cnt[s], r->resp[s]); /* every response token is scored, nothing else */
    }
}

static double grads_rel_err(const bt_lora *lo, const bt_st_file *f, const char *prefix)
{
    double worst = 0;
    char key[192], name[256];
    for (int l = 0; l < lo->n_layer; l++)
        for (int mod = 0; mod < BT_MOD_N; mod++) {
            const bt_lora_mod *md = bt_lora_get(lo, l, mod);
            for (int isB = 0; isB < 2; isB++) {
                bt_adapter_key(key, sizeof key, l, mod, isB);
                snprintf(name, sizeof name, "%s.%s", prefix, key);
                const bt_st_tensor *t = bt_st_find(f, name);
                if (!t)
                    fail_msg("fixture tensor %s missing", name);
                const int64_t n = isB ? (int64_t)md->out * lo->r : (int64_t)lo->r * md->in;
                assert_int_equal(t->dtype, BT_ST_F32);
                assert_int_equal((int64_t)(t->nbytes / 4), n);
                const float *ref = t->data, *g = isB ? md->dB : md->dA;
                double mx = 0, d = 0;
                for (int64_t i = 0; i < n; i++) {
                    mx = fmax(mx, fabs((double)ref[i]));
                    d = fmax(d, fabs((double)g[i] - ref[i]));
                }
                assert_true(mx > 0);
                worst = fmax(worst, d / mx);
            }
        }
    return worst;
}

static void test_tiny_dpo_against_trl(void **state)
{
    (void)state;
    rig r;
    rig_init(&r);
    const int M = r.T;
    bt_step_ctx *c = NULL, *ck = NULL;
    assert_int_equal(bt_step_ctx_new(&c, &r.m, &r.lo, M, 0), 0);
    assert_int_equal(bt_step_ctx_new(&ck, &r.m, &r.lo, M, 1), 0);
    float logp[MAXT], dlogp[MAXT];
    double ref[NS], pol[NS];
    seq_logps(c, &r, NULL, 0, ref, logp);

    /* per-sequence log-probs against TRL's fused LM head */
    json_t *jp = json_object_get(r.doc, "policy_logps"), *jr = json_object_get(r.doc, "ref_logps");
    double e_lp = 0;
    seq_logps(c, &r, &r.lo, 0, pol, logp);
    for (int s = 0; s < NS; s++) {
        e_lp = fmax(e_lp, rel(pol[s], json_number_value(json_array_get(jp, (size_t)s))));
        e_lp = fmax(e_lp, rel(ref[s], json_number_value(json_array_get(jr, (size_t)s))));
    }
    assert_true(e_lp <= 2e-6);
    /* the adapter matters: policy and reference differ well beyond the tolerance */
    double d_pr = 0;
    for (int s = 0; s < NS; s++)
        d_pr = fmax(d_pr, rel(pol[s], ref[s]));
    assert_true(d_pr > 1e-2);

    bt_st_file *gf = NULL;
    if (bt_st_open(&gf, FIX "tiny_dpo_grads.safetensors"))
        fail_msg("%s", bt_last_error());
    json_t *cases = json_object_get(r.doc, "cases");
    assert_int_equal(json_array_size(cases), 2);
    double e_loss = 0, e_met = 0, e_grad = 0;
    for (size_t k = 0; k < json_array_size(cases); k++) {
        json_t *cs = json_array_get(cases, k);
        const char *lt = json_string_value(json_object_get(cs, "loss_type"));
        bt_pref_params p;
        bt_pref_defaults(&p, BT_PREF_DPO);
        const int t = bt_pref_loss_type_parse(BT_PREF_DPO, lt);
        assert_true(t >= 0);
        p.loss_type[0] = (bt_pref_loss_type)t;
        p.beta = json_number_value(json_object_get(json_object_get(cs, "params"), "beta"));

        float *g0 = NULL; /* the plain pass's gradients, for the checkpointing pass */
        for (int pass = 0; pass < 2; pass++) { /* plain, then activation checkpointing */
            bt_step_ctx *cx = pass ? ck : c;
            double pl[NS];
            seq_logps(cx, &r, &r.lo, 1, pl, logp);
            double dch[NP], drj[NP];
            bt_pref_metrics m;
            assert_int_equal(bt_pref_pair_loss(&p, NP, pl, pl + NP, ref, ref + NP, r.resp,
                                               r.resp + NP, 0.0, dch, drj, NULL, &m), 0);
            if (pass == 0) {
                e_loss = fmax(e_loss, rel(m.loss, json_number_value(json_object_get(cs, "loss"))));
                json_t *jm = json_object_get(cs, "metrics");
                const double got[6] = {m.rewards_chosen, m.rewards_rejected,
                                       m.rewards_accuracies, m.rewards_margins,
                                       m.logps_chosen, m.logps_rejected};
                const char *keys[6] = {"rewards/chosen", "rewards/rejected", "rewards/accuracies",
                                       "rewards/margins", "logps/chosen", "logps/rejected"};
                for (int i = 0; i < 6; i++) {
                    const double want = json_number_value(json_object_get(jm, keys[i]));
                    /* rewards are beta x a difference of two sums of ~40: compare in units of
                     * the sums' scale */
                    e_met = fmax(e_met, fabs(got[i] - want) / (i == 2 ? 1.0 : 1.0 + fabs(want)));
                }
            }
            /* each sequence's dloss/dlogp_sum on each of its scored positions */
            int32_t tg[MAXT];
            bt_shift_targets(tg, &r.mb, r.m.hp.vocab);
            for (int s = 0; s < NS; s++)
                for (int i = r.cu[s]; i < r.cu[s + 1]; i++)
                    dlogp[i] = tg[i] >= 0 ? (float)(s < NP ? dch[s] : drj[s - NP]) : 0.0f;
            bt_lora_zero_grad(&r.lo);
            assert_int_equal(bt_backward_logprobs(cx, &r.m, &r.lo, &r.mb, dlogp, 0), 0);
            if (pass == 0) {
                e_grad = fmax(e_grad, grads_rel_err(&r.lo, gf, lt));
                /* can fail: a wrong sign on the rejected side is far off */
                float *keep = malloc(r.lo.n_params * sizeof(float));
                memcpy(keep, r.lo.grads, r.lo.n_params * sizeof(float));
                seq_logps(cx, &r, &r.lo, 1, pl, logp);
                for (int i = 0; i < M; i++)
                    for (int s = NP; s < NS; s++)
                        if (i >= r.cu[s] && i < r.cu[s + 1])
                            dlogp[i] = -dlogp[i];
                bt_lora_zero_grad(&r.lo);
                assert_int_equal(bt_backward_logprobs(cx, &r.m, &r.lo, &r.mb, dlogp, 0), 0);
                assert_true(grads_rel_err(&r.lo, gf, lt) > 0.05);
                memcpy(r.lo.grads, keep, r.lo.n_params * sizeof(float));
                free(keep);
                g0 = malloc(r.lo.n_params * sizeof(float));
                memcpy(g0, r.lo.grads, r.lo.n_params * sizeof(float));
            } else {
                assert_memory_equal(g0, r.lo.grads, r.lo.n_params * sizeof(float));
                free(g0);
            }
        }
    }
    print_message("preference tiny DPO vs TRL 1.16.0: log-probs max rel err %.3g, loss %.3g, "
                  "metrics %.3g, LoRA grads max rel err %.3g\n", e_lp, e_loss, e_met, e_grad);
    assert_true(e_loss <= 2e-6);
    assert_true(e_met <= 2e-6);
    assert_true(e_grad <= 2e-5);
    bt_st_close(gf);
    bt_step_ctx_free(ck);
    bt_step_ctx_free(c);
    rig_free(&r);
}

/* ORPO and CPO's SimPO (cpo_alpha 1): one training pass scores every token (labels on the prompt
 * too); the odds ratio / SimPO term sums the response targets (resp_mask), the NLL averages over
 * the chosen documents' targets (ORPO: all of them, CPO: the response ones), and the per-token
 * upstream gradient is the sum of both terms' gradients. */
static void test_tiny_orpo_simpo_against_trl(void **state)
{
    (void)state;
    rig r;
    rig_init_ex(&r, 1);
    const int M = r.T, V = r.m.hp.vocab;
    bt_step_ctx *c = NULL;
    assert_int_equal(bt_step_ctx_new(&c, &r.m, &r.lo, M, 0), 0);
    bt_st_file *gf = NULL;
    if (bt_st_open(&gf, FIX "tiny_dpo_grads.safetensors"))
        fail_msg("%s", bt_last_error());
    json_t *cases = json_object_get(r.doc, "orpo_cpo_cases");
    assert_int_equal(json_array_size(cases), 2);
    double e_lp = 0, e_nll = 0, e_loss = 0, e_met = 0, e_grad = 0;
    for (size_t k = 0; k < json_array_size(cases); k++) {
        json_t *cs = json_array_get(cases, k);
        const char *name = json_string_value(json_object_get(cs, "name"));
        const int orpo = strcmp(name, "orpo") == 0;
        json_t *jp = json_object_get(cs, "params");
        bt_pref_params p;
        bt_pref_defaults(&p, orpo ? BT_PREF_ORPO : BT_PREF_CPO);
        if (!orpo)
            p.loss_type[0] = BT_PREF_LOSS_SIMPO;
        p.beta = json_number_value(json_object_get(jp, "beta"));
        p.simpo_gamma = json_number_value(json_object_get(jp, "simpo_gamma"));
        p.cpo_alpha = json_number_value(json_object_get(jp, "cpo_alpha"));
        assert_int_equal(bt_pref_check(&p, NULL, 0), 0);

        float logp[MAXT], dlogp[MAXT];
        int nv = 0;
        assert_int_equal(bt_forward_logprobs(c, &r.m, &r.lo, &r.mb, 1, 0, logp, &nv), 0);
        int32_t tg[MAXT];
        assert_int_equal(bt_shift_targets(tg, &r.mb, V), nv);
        double sums[NS], all[NS];
        int cnt[NS], call[NS];
        assert_int_equal(bt_seq_sum(sums, cnt, logp, tg, r.resp_mask, r.cu, NS, V), 0);
        assert_int_equal(bt_seq_sum(all, call, logp, tg, NULL, r.cu, NS, V), 0);
        /* the NLL: mean token NLL over the chosen documents (ORPO: every target, CPO: response) */
        double nll_sum = 0;
        int nll_n = 0;
        for (int s = 0; s < NP; s++) {
            assert_int_equal(cnt[s], r.resp[s]);
            nll_sum -= orpo ? all[s] : sums[s];
            nll_n += orpo ? call[s] : cnt[s];
        }
        const double nll = nll_sum / nll_n;
        e_nll = fmax(e_nll, rel(nll, json_number_value(json_object_get(cs, "nll"))));
        json_t *ac = json_object_get(cs, "avg_logps_chosen"), *ar = json_object_get(cs, "avg_logps_rejected");
        for (int s = 0; s < NP; s++) {
            e_lp = fmax(e_lp, rel(sums[s] / cnt[s], json_number_value(json_array_get(ac, (size_t)s))));
            e_lp = fmax(e_lp, rel(sums[NP + s] / cnt[NP + s],
                                  json_number_value(json_array_get(ar, (size_t)s))));
        }
        double dch[NP], drj[NP], dnll = 0;
        bt_pref_metrics m;
        assert_int_equal(bt_pref_pair_loss(&p, NP, sums, sums + NP, NULL, NULL, cnt, cnt + NP, nll,
                                           dch, drj, &dnll, &m), 0);
        assert_true(dnll == (orpo ? 1.0 : p.cpo_alpha));
        e_loss = fmax(e_loss, rel(m.loss, json_number_value(json_object_get(cs, "loss"))));
        json_t *jm = json_object_get(cs, "metrics");
        const double got[9] = {m.rewards_chosen, m.rewards_rejected, m.rewards_accuracies,
                               m.rewards_margins, m.logps_chosen, m.logps_rejected, m.nll_loss,
                               m.log_odds_ratio, m.log_odds_chosen};
        const char *keys[9] = {"rewards/chosen", "rewards/rejected", "rewards/accuracies",
                               "rewards/margins", "logps/chosen", "logps/rejected", "nll_loss",
                               "log_odds_ratio", "log_odds_chosen"};
        for (int i = 0; i < (orpo ? 9 : 7); i++) {
            const double want = json_number_value(json_object_get(jm, keys[i]));
            e_met = fmax(e_met, fabs(got[i] - want) / (1.0 + fabs(want)));
        }
        for (int s = 0; s < NS; s++)
            for (int t = r.cu[s]; t < r.cu[s + 1]; t++) {
                double g = 0;
                if (tg[t] >= 0 && r.resp_mask[t])
                    g += s < NP ? dch[s] : drj[s - NP];
                if (s < NP && tg[t] >= 0 && (orpo || r.resp_mask[t]))
                    g += dnll * (-1.0 / nll_n);
                dlogp[t] = (float)g;
            }
        bt_lora_zero_grad(&r.lo);
        assert_int_equal(bt_backward_logprobs(c, &r.m, &r.lo, &r.mb, dlogp, 0), 0);
        e_grad = fmax(e_grad, grads_rel_err(&r.lo, gf, name));
    }
    print_message("preference tiny ORPO / SimPO vs TRL 1.16.0: average log-probs max rel err "
                  "%.3g, nll %.3g, loss %.3g, metrics %.3g, LoRA grads max rel err %.3g\n", e_lp,
                  e_nll, e_loss, e_met, e_grad);
    assert_true(e_lp <= 2e-6);
    assert_true(e_nll <= 2e-6);
    assert_true(e_loss <= 2e-6);
    assert_true(e_met <= 2e-6);
    assert_true(e_grad <= 2e-5);
    bt_st_close(gf);
    bt_step_ctx_free(c);
    rig_free(&r);
}

/* KTO: four unpaired examples and their four KL documents (TRL's cycled completions) packed in
 * one row; one pass with the adapter and one without give every sequence's log-prob; the KL
 * estimate (detached: its documents get no upstream gradient) and the loss follow. */
static void test_tiny_kto_against_trl(void **state)
{
    (void)state;
    rig r;
    rig_init(&r);
    json_t *kc = json_object_get(r.doc, "kto_case"), *ex = json_object_get(kc, "examples");
    enum { NE = 4 };
    assert_int_equal(json_array_size(ex), NE);
    json_t *pr[2 * NE], *co[2 * NE];
    uint8_t des[NE];
    for (int i = 0; i < NE; i++) {
        json_t *e = json_array_get(ex, (size_t)i);
        pr[i] = pr[NE + i] = json_object_get(e, "prompt_ids");
        co[i] = json_object_get(e, "completion_ids");
        co[NE + i] = json_object_get(e, "KL_completion_ids");
        des[i] = json_is_true(json_object_get(e, "label"));
    }
    pack_docs(&r, pr, co, 2 * NE, 0);
    const int V = r.m.hp.vocab;
    bt_step_ctx *c = NULL;
    assert_int_equal(bt_step_ctx_new(&c, &r.m, &r.lo, r.T, 0), 0);
    float logp[MAXT], dlogp[MAXT];
    int32_t tg[MAXT];
    double ref[2 * NE], pol[2 * NE];
    assert_int_equal(bt_forward_logprobs(c, &r.m, NULL, &r.mb, 0, 0, logp, NULL), 0);
    bt_shift_targets(tg, &r.mb, V);
    assert_int_equal(bt_seq_sum(ref, NULL, logp, tg, NULL, r.cu, 2 * NE, V), 0);
    assert_int_equal(bt_forward_logprobs(c, &r.m, &r.lo, &r.mb, 1, 0, logp, NULL), 0);
    assert_int_equal(bt_seq_sum(pol, NULL, logp, tg, NULL, r.cu, 2 * NE, V), 0);
    double e_lp = 0;
    const char *keys[4] = {"policy_logps", "ref_logps", "KL_policy_logps", "KL_ref_logps"};
    for (int i = 0; i < NE; i++)
        for (int k = 0; k < 4; k++) {
            const double got = (k & 1 ? ref : pol)[(k >= 2 ? NE : 0) + i];
            e_lp = fmax(e_lp, rel(got, json_number_value(json_array_get(
                                           json_object_get(kc, keys[k]), (size_t)i))));
        }
    bt_pref_params p;
    bt_pref_defaults(&p, BT_PREF_KTO);
    json_t *jp = json_object_get(kc, "params");
    p.beta = json_number_value(json_object_get(jp, "beta"));
    p.desirable_weight = json_number_value(json_object_get(jp, "desirable_weight"));
    p.undesirable_weight = json_number_value(json_object_get(jp, "undesirable_weight"));
    const double kl = bt_kto_kl_mean(NE, pol + NE, ref + NE);
    double g[NE];
    bt_pref_metrics m;
    assert_int_equal(bt_kto_loss(&p, NE, pol, ref, des, kl, g, &m), 0);
    const double e_loss = rel(m.loss, json_number_value(json_object_get(kc, "loss")));
    json_t *jm = json_object_get(kc, "metrics");
    assert_true(json_is_null(json_object_get(jm, "rewards/accuracies")) &&
                isnan(m.rewards_accuracies));
    const double got[6] = {m.rewards_chosen, m.rewards_rejected, m.rewards_margins,
                           m.logps_chosen, m.logps_rejected, m.kl};
    const char *mk[6] = {"rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
                         "logps/rejected", "kl"};
    double e_met = 0;
    for (int i = 0; i < 6; i++) {
        const double want = json_number_value(json_object_get(jm, mk[i]));
        e_met = fmax(e_met, fabs(got[i] - want) / (1.0 + fabs(want)));
    }
    assert_true(m.kl > 0.5); /* not clamped: the KL term shifts every example's loss */
    for (int s = 0; s < 2 * NE; s++)
        for (int t = r.cu[s]; t < r.cu[s + 1]; t++)
            dlogp[t] = s < NE && tg[t] >= 0 ? (float)g[s] : 0.0f;
    bt_lora_zero_grad(&r.lo);
    assert_int_equal(bt_backward_logprobs(c, &r.m, &r.lo, &r.mb, dlogp, 0), 0);
    bt_st_file *gf = NULL;
    if (bt_st_open(&gf, FIX "tiny_dpo_grads.safetensors"))
        fail_msg("%s", bt_last_error());
    const double e_grad = grads_rel_err(&r.lo, gf, "kto");
    print_message("preference tiny KTO vs TRL 1.16.0: log-probs max rel err %.3g, loss %.3g, "
                  "metrics %.3g, LoRA grads max rel err %.3g\n", e_lp, e_loss, e_met, e_grad);
    assert_true(e_lp <= 2e-6);
    assert_true(e_loss <= 2e-6);
    assert_true(e_met <= 2e-6);
    assert_true(e_grad <= 2e-5);
    bt_st_close(gf);
    bt_step_ctx_free(c);
    rig_free(&r);
}

static void test_logprob_pass_refusals(void **state)
{
    (void)state;
    rig r;
    rig_init(&r);
    bt_step_ctx *c = NULL;
    assert_int_equal(bt_step_ctx_new(&c, &r.m, &r.lo, r.T, 0), 0);
    float logp[MAXT], dlogp[MAXT] = {0};
    /* backward without a forward, after an evaluation pass, after another kind of pass */
    assert_int_equal(bt_backward_logprobs(c, &r.m, &r.lo, &r.mb, dlogp, 0), BT_ERR_INVALID);
    assert_int_equal(bt_forward_logprobs(c, &r.m, &r.lo, &r.mb, 0, 0, logp, NULL), 0);
    assert_int_equal(bt_backward_logprobs(c, &r.m, &r.lo, &r.mb, dlogp, 0), BT_ERR_INVALID);
    assert_int_equal(bt_forward_logprobs(c, &r.m, &r.lo, &r.mb, 1, 0, logp, NULL), 0);
    assert_int_equal(bt_forward_hidden(c, &r.m, &r.lo, &r.mb, 0), 0);
    assert_int_equal(bt_backward_logprobs(c, &r.m, &r.lo, &r.mb, dlogp, 0), BT_ERR_INVALID);
    /* a training pass needs the adapter; outputs are required; one backward per forward */
    assert_int_equal(bt_forward_logprobs(c, &r.m, NULL, &r.mb, 1, 0, logp, NULL), BT_ERR_INVALID);
    assert_int_equal(bt_forward_logprobs(c, &r.m, &r.lo, &r.mb, 1, 0, NULL, NULL), BT_ERR_INVALID);
    assert_int_equal(bt_forward_logprobs(c, &r.m, &r.lo, &r.mb, 1, 0, logp, NULL), 0);
    assert_int_equal(bt_backward_logprobs(c, &r.m, &r.lo, &r.mb, NULL, 0), BT_ERR_INVALID);
    assert_int_equal(bt_forward_logprobs(c, &r.m, &r.lo, &r.mb, 1, 0, logp, NULL), 0);
    assert_int_equal(bt_backward_logprobs(c, &r.m, &r.lo, &r.mb, dlogp, 0), 0);
    assert_int_equal(bt_backward_logprobs(c, &r.m, &r.lo, &r.mb, dlogp, 0), BT_ERR_INVALID);
    /* a bad micro-batch is refused by the shared checks (a label outside the vocabulary) */
    r.lab[3] = 100000;
    assert_true(bt_forward_logprobs(c, &r.m, &r.lo, &r.mb, 1, 0, logp, NULL) < 0);
    assert_int_equal(bt_backward_logprobs(c, &r.m, &r.lo, &r.mb, dlogp, 0), BT_ERR_INVALID);
    bt_step_ctx_free(c);
    rig_free(&r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tiny_dpo_against_trl),
        cmocka_unit_test(test_tiny_orpo_simpo_against_trl),
        cmocka_unit_test(test_tiny_kto_against_trl),
        cmocka_unit_test(test_logprob_pass_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
