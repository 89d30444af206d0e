/* The trainer's preference step (trainer/loop/pref_step.h) on the CPU backend against TRL 1.16.0:
 * the same tiny Llama (tests/fixtures/hf/tiny-llama-tied, fp32) with the PEFT adapter
 * tests/fixtures/hf/lora/adapter-init and the same tokenized records as
 * tests/unit/trainer/test_preference_tiny.c, from the fixtures that
 * tests/reference/gen_preference_fixtures.py makes by running TRL's DPOTrainer._compute_loss
 * (sigmoid, ipo), ORPOTrainer / CPOTrainer (SimPO) get_batch_loss_metrics and
 * KTOTrainer._compute_loss (tests/fixtures/preference/tiny_dpo.json, tiny_dpo_grads.safetensors).
 * Here the records arrive as the trainer gets them from loaderd: micro-batches of packed segments
 * with layout 2's seg_kind / seg_pair (a pair = chosen then rejected, adjacent; a KTO example one
 * segment; padding segments), and the step does everything the run does: counts, the reference
 * pass (adapter off), KTO's KL sequences built from the batch (prompt i + completion i-1, as
 * TRL cycles them), the policy pass, per-token gradients, the backward, the metrics.
 * Checked: loss and TRL's metrics (relative 2e-6, metrics against 1 + |value|), the LoRA gradients
 * (max |ours - TRL| / max |TRL| per tensor <= 2e-5); the three DPO pairs split over two
 * micro-batches (gradient accumulation) give the one-batch loss (relative 1e-5) and gradients
 * (2e-5: fp32 rounding of another packing; the step's loss is the mean over its pairs); reference log-probs given with the batch (the hook
 * for loaderd's cache) give the recomputed step bit for bit; malformed batches are refused, naming
 * the segment. */
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
#include "proto/batch.h"
#include "trainer/backend/backend.h"
#include "trainer/io/adapter.h"
#include "trainer/io/adapter_load.h"
#include "trainer/loop/pref_step.h"
#include "trainer/model/lora.h"
#include "trainer/model/model.h"

#define FIX "tests/fixtures/preference/"
#define MAXT 160
#define MAXS 24

typedef struct {
    int32_t ids[MAXT], lab[MAXT], pos[MAXT], cu[MAXS + 1], kind[MAXS], pair[MAXS];
    int T, nseg, nrec;
} pbatch;

static void add_seq(pbatch *b, json_t *prompt, json_t *resp, int kind) {
    const int a = b->T;
    for (size_t i = 0; i < json_array_size(prompt); i++) {
        b->ids[b->T] = (int32_t)json_integer_value(json_array_get(prompt, i));
        b->lab[b->T++] = -100;
    }
    for (size_t i = 0; i < json_array_size(resp); i++) {
        b->ids[b->T] = (int32_t)json_integer_value(json_array_get(resp, i));
        b->lab[b->T] = b->ids[b->T];
        b->T++;
    }
    assert_true(b->T <= MAXT && b->nseg < MAXS);
    for (int t = a; t < b->T; t++) b->pos[t] = t - a;
    b->kind[b->nseg] = kind;
    b->pair[b->nseg] = kind == BT_SEG_REJECTED ? b->nrec - 1 : b->nrec++;
    b->cu[++b->nseg] = b->T;
}

/* the row ends with a padding segment of `pad` tokens (labels -100, its own segment) */
static void finish(pbatch *b, int pad, bt_pref_batch *pb) {
    const int a = b->T;
    for (int u = 0; u < pad; u++) b->ids[b->T] = 0, b->lab[b->T] = -100, b->pos[b->T] = u, b->T++;
    if (pad) {
        b->kind[b->nseg] = BT_SEG_PLAIN;
        b->pair[b->nseg] = -1;
        b->cu[++b->nseg] = b->T;
    }
    (void)a;
    memset(pb, 0, sizeof *pb);
    pb->mb = (bt_microbatch){1, b->T, b->ids, b->lab, b->pos, b->cu, b->nseg + 1};
    pb->seg_kind = b->kind;
    pb->seg_pair = b->pair;
}

typedef struct {
    bt_model m;
    bt_lora lo;
    json_t *doc;
    bt_st_file *gf;
    bt_train_config cfg;
} rig;

static void rig_init(rig *r) {
    memset(r, 0, sizeof *r);
    bt_model_load_opts o = {BT_BASE_FP32, 0};
    if (bt_model_load(&r->m, "tests/fixtures/hf/tiny-llama-tied", &o)) fail_msg("%s", bt_last_error());
    if (bt_lora_load_peft(&r->lo, &r->m, "tests/fixtures/hf/lora/adapter-init")) fail_msg("%s", bt_last_error());
    json_error_t je;
    if (!(r->doc = json_load_file(FIX "tiny_dpo.json", 0, &je))) fail_msg("%s", je.text);
    if (bt_st_open(&r->gf, FIX "tiny_dpo_grads.safetensors")) fail_msg("%s", bt_last_error());
    r->cfg.data.micro_batch_size = 1;
    r->cfg.data.seq_len = MAXT;
}

static void rig_free(rig *r) {
    bt_st_close(r->gf);
    json_decref(r->doc);
    bt_lora_free(&r->lo);
    bt_model_free(&r->m);
}

static bt_backend *backend(rig *r) {
    bt_backend *b = NULL;
    bt_backend_params p = {.cfg = &r->cfg, .model = &r->m, .lora = &r->lo, .max_M = MAXT, .world = 1};
    assert_int_equal(bt_backend_cpu_reg.init(&b, &p), 0);
    assert_true(bt_backend_has_logprobs(b));
    return b;
}

static double rel(double got, double want) { return fabs(got - want) / (fabs(want) > 1e-30 ? fabs(want) : 1.0); }

static double grads_rel_err(const bt_lora *lo, const bt_st_file *f, const char *prefix) {
    double worst = 0;
    char key[192], name[256];
    for (int l = 0; l < lo->n_layer; l++)
        for (int mod = 0; mod < BT_MOD_N; mod++) {
            const bt_lora_mod *md = bt_lora_get(lo, l, mod);
            for (int isB = 0; isB < 2; isB++) {
                bt_adapter_key(key, sizeof key, l, mod, isB);
                snprintf(name, sizeof name, "%s.%s", prefix, key);
                const bt_st_tensor *t = bt_st_find(f, name);
                if (!t) fail_msg("fixture tensor %s missing", name);
                const int64_t n = isB ? (int64_t)md->out * lo->r : (int64_t)lo->r * md->in;
                assert_int_equal((int64_t)(t->nbytes / 4), n);
                const float *ref = t->data, *g = isB ? md->dB : md->dA;
                double mx = 0, d = 0;
                for (int64_t i = 0; i < n; i++) {
                    mx = fmax(mx, fabs((double)ref[i]));
                    d = fmax(d, fabs((double)g[i] - ref[i]));
                }
                worst = fmax(worst, d / mx);
            }
        }
    return worst;
}

/* one optimiser step over micro-batches pb[0..n) the way pref_run.c drives it (one rank) */
static void run_step(bt_pref_step *s, bt_backend *be, bt_pref_batch *pb, int n, const bt_pref_params *p,
                     bt_pref_metrics *m) {
    bt_pref_counts c = {0, 0};
    double kl[2] = {0, 0};
    for (int i = 0; i < n; i++) assert_int_equal(bt_pref_step_count(s, &pb[i], &c), 0);
    for (int i = 0; i < n && p->algo == BT_PREF_KTO; i++) assert_int_equal(bt_pref_step_kl(s, be, &pb[i], kl), 0);
    const double kl_mean = kl[1] > 0 ? kl[0] / kl[1] : 0;
    bt_pref_step_begin(s, &c, kl_mean);
    assert_int_equal(bt_backend_zero_grad(be), 0);
    for (int i = 0; i < n; i++) assert_int_equal(bt_pref_step_micro(s, be, &pb[i], 1, 0), 0);
    double sums[BT_PREF_NSUMS];
    bt_pref_step_sums(s, kl_mean, sums);
    bt_pref_metrics_of(p, sums, kl_mean, m);
}

static double metrics_err(const bt_pref_metrics *m, json_t *jm) {
    const char *keys[10] = {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                            "logps/chosen", "logps/rejected", "nll_loss", "log_odds_ratio", "log_odds_chosen", "kl"};
    const double got[10] = {m->rewards_chosen, m->rewards_rejected, m->rewards_accuracies, m->rewards_margins,
                            m->logps_chosen, m->logps_rejected, m->nll_loss, m->log_odds_ratio,
                            m->log_odds_chosen, m->kl};
    double e = 0;
    for (int i = 0; i < 10; i++) {
        json_t *w = json_object_get(jm, keys[i]);
        if (!w) continue;
        if (json_is_null(w)) {
            assert_true(isnan(got[i]));
            continue;
        }
        e = fmax(e, fabs(got[i] - json_number_value(w)) / (1.0 + fabs(json_number_value(w))));
    }
    return e;
}

/* the three fixture pairs as chosen/rejected segments; split: pairs 0, 1 in pb[0], pair 2 in pb[1] */
static int pair_batches(rig *r, pbatch *b, bt_pref_batch *pb, int split) {
    json_t *pairs = json_object_get(r->doc, "pairs");
    memset(b, 0, 2 * sizeof *b);
    for (size_t i = 0; i < json_array_size(pairs); i++) {
        json_t *pr = json_array_get(pairs, i);
        pbatch *x = &b[split && i == 2];
        add_seq(x, json_object_get(pr, "prompt_ids"), json_object_get(pr, "chosen_ids"), BT_SEG_CHOSEN);
        add_seq(x, json_object_get(pr, "prompt_ids"), json_object_get(pr, "rejected_ids"), BT_SEG_REJECTED);
    }
    finish(&b[0], 5, &pb[0]);
    if (split) finish(&b[1], 3, &pb[1]);
    return split ? 2 : 1;
}

static void test_pair_objectives_against_trl(void **state) {
    (void)state;
    rig r;
    rig_init(&r);
    bt_backend *be = backend(&r);
    pbatch b[2];
    bt_pref_batch pb[2];
    double e_loss = 0, e_met = 0, e_grad = 0;
    struct {
        json_t *cs;
        bt_pref_algo algo;
    } cases[4];
    int nc = 0;
    json_t *dpo = json_object_get(r.doc, "cases"), *oc = json_object_get(r.doc, "orpo_cpo_cases");
    for (size_t k = 0; k < json_array_size(dpo); k++) cases[nc].cs = json_array_get(dpo, k), cases[nc++].algo = BT_PREF_DPO;
    for (size_t k = 0; k < json_array_size(oc); k++) {
        cases[nc].cs = json_array_get(oc, k);
        cases[nc].algo = strcmp(json_string_value(json_object_get(cases[nc].cs, "name")), "orpo") ? BT_PREF_CPO : BT_PREF_ORPO;
        nc++;
    }
    assert_int_equal(nc, 4);
    for (int k = 0; k < nc; k++) {
        json_t *cs = cases[k].cs, *jp = json_object_get(cs, "params");
        const char *name = json_string_value(json_object_get(cs, cases[k].algo == BT_PREF_DPO ? "loss_type" : "name"));
        bt_pref_params p;
        bt_pref_defaults(&p, cases[k].algo);
        const int t = bt_pref_loss_type_parse(cases[k].algo, json_string_value(json_array_get(json_object_get(jp, "loss_type"), 0)));
        assert_true(t >= 0);
        p.loss_type[0] = (bt_pref_loss_type)t;
        p.beta = json_number_value(json_object_get(jp, "beta"));
        p.simpo_gamma = json_number_value(json_object_get(jp, "simpo_gamma"));
        p.cpo_alpha = json_number_value(json_object_get(jp, "cpo_alpha"));
        bt_pref_step *s = NULL;
        assert_int_equal(bt_pref_step_new(&s, &p, 1, MAXT, r.m.hp.vocab), 0);
        bt_pref_metrics m;
        run_step(s, be, pb, pair_batches(&r, b, pb, 0), &p, &m);
        e_loss = fmax(e_loss, rel(m.loss, json_number_value(json_object_get(cs, "loss"))));
        e_met = fmax(e_met, metrics_err(&m, json_object_get(cs, "metrics")));
        e_grad = fmax(e_grad, grads_rel_err(&r.lo, r.gf, name));
        /* gradient accumulation: the same pairs over two micro-batches, the same step */
        float *g1 = malloc(r.lo.n_params * sizeof(float));
        memcpy(g1, r.lo.grads, r.lo.n_params * sizeof(float));
        bt_pref_metrics m2;
        run_step(s, be, pb, pair_batches(&r, b, pb, 1), &p, &m2);
        /* the same sequences in another packing: fp32 rounding of their log-probs only */
        assert_true(rel(m2.loss, m.loss) <= 1e-5);
        assert_true(fabs(m2.rewards_margins - m.rewards_margins) <= 1e-5 * (1.0 + fabs(m.rewards_margins)));
        /* ours, through the step's sums: a share of the 3 pairs, the same in either packing, and
         * logps/margins = logps/chosen - logps/rejected (both are means over the same pairs) */
        assert_true(m.logps_accuracies == 0.0 || fabs(m.logps_accuracies - 1.0 / 3) < 1e-12 ||
                    fabs(m.logps_accuracies - 2.0 / 3) < 1e-12 || m.logps_accuracies == 1.0);
        assert_true(m2.logps_accuracies == m.logps_accuracies);
        assert_true(fabs(m.logps_margins - (m.logps_chosen - m.logps_rejected)) <=
                    1e-9 * (1.0 + fabs(m.logps_margins)));
        double mx = 0, d = 0;
        for (int64_t i = 0; i < r.lo.n_params; i++)
            mx = fmax(mx, fabs(g1[i])), d = fmax(d, fabs(g1[i] - r.lo.grads[i]));
        print_message("%s split over two micro-batches: loss rel %.3g, margins %.3g, grads rel %.3g\n", name,
                      rel(m2.loss, m.loss), fabs(m2.rewards_margins - m.rewards_margins), d / mx);
        assert_true(mx > 0 && d / mx <= 2e-5);
        free(g1);
        bt_pref_step_free(s);
    }
    print_message("preference step (DPO sigmoid / ipo, ORPO, SimPO) vs TRL 1.16.0: loss max rel err %.3g, "
                  "metrics %.3g, LoRA grads %.3g\n", e_loss, e_met, e_grad);
    assert_true(e_loss <= 2e-6);
    assert_true(e_met <= 2e-6);
    assert_true(e_grad <= 2e-5);
    bt_backend_free(be);
    rig_free(&r);
}

static void test_kto_against_trl(void **state) {
    (void)state;
    rig r;
    rig_init(&r);
    bt_backend *be = backend(&r);
    json_t *kc = json_object_get(r.doc, "kto_case"), *ex = json_object_get(kc, "examples"), *jp = json_object_get(kc, "params");
    pbatch b;
    memset(&b, 0, sizeof b);
    for (size_t i = 0; i < json_array_size(ex); i++) {
        json_t *e = json_array_get(ex, i);
        add_seq(&b, json_object_get(e, "prompt_ids"), json_object_get(e, "completion_ids"),
                json_is_true(json_object_get(e, "label")) ? BT_SEG_KTO_DESIRABLE : BT_SEG_KTO_UNDESIRABLE);
    }
    bt_pref_batch pb;
    finish(&b, 4, &pb);
    bt_pref_params p;
    bt_pref_defaults(&p, BT_PREF_KTO);
    p.beta = json_number_value(json_object_get(jp, "beta"));
    p.desirable_weight = json_number_value(json_object_get(jp, "desirable_weight"));
    p.undesirable_weight = json_number_value(json_object_get(jp, "undesirable_weight"));
    bt_pref_step *s = NULL;
    assert_int_equal(bt_pref_step_new(&s, &p, 1, MAXT, r.m.hp.vocab), 0);
    bt_pref_metrics m;
    run_step(s, be, &pb, 1, &p, &m);
    const double e_loss = rel(m.loss, json_number_value(json_object_get(kc, "loss")));
    const double e_met = metrics_err(&m, json_object_get(kc, "metrics"));
    assert_true(isnan(m.logps_accuracies) && isnan(m.logps_margins)); /* KTO: no pairs */
    const double e_grad = grads_rel_err(&r.lo, r.gf, "kto");
    print_message("preference step KTO vs TRL 1.16.0 (KL sequences built by the step): loss rel err %.3g, "
                  "metrics %.3g, LoRA grads %.3g\n", e_loss, e_met, e_grad);
    assert_true(m.kl > 0.5);
    assert_true(e_loss <= 2e-6);
    assert_true(e_met <= 2e-6);
    assert_true(e_grad <= 2e-5);
    bt_pref_step_free(s);
    bt_backend_free(be);
    rig_free(&r);
}

/* The hook for loaderd's cached reference log-probs (bt_pref_batch.ref_logps): reference sums given
 * with the batch (here computed once, as a cache would hold them) give the recomputed step's loss,
 * metrics and gradients bit for bit, and no reference pass runs (a wrong cache shows). */
static void test_given_reference_is_the_computed_one(void **state) {
    (void)state;
    rig r;
    rig_init(&r);
    bt_backend *be = backend(&r);
    pbatch b[2];
    bt_pref_batch pb[2];
    pair_batches(&r, b, pb, 0);
    bt_pref_params p;
    bt_pref_defaults(&p, BT_PREF_DPO);
    bt_pref_step *s = NULL;
    assert_int_equal(bt_pref_step_new(&s, &p, 1, MAXT, r.m.hp.vocab), 0);
    bt_pref_metrics m1, m2;
    run_step(s, be, pb, 1, &p, &m1);
    float *g1 = malloc(r.lo.n_params * sizeof(float));
    memcpy(g1, r.lo.grads, r.lo.n_params * sizeof(float));
    /* the cache's content: every segment's summed reference log-prob */
    float logp[MAXT];
    int32_t tg[MAXT];
    double ref[MAXS];
    assert_int_equal(bt_backend_logprobs(be, &pb[0].mb, 0, 0, 0, logp, NULL), 0);
    assert_true(bt_shift_targets(tg, &pb[0].mb, r.m.hp.vocab) > 0);
    assert_int_equal(bt_seq_sum(ref, NULL, logp, tg, NULL, b[0].cu, b[0].nseg, r.m.hp.vocab), 0);
    pb[0].ref_logps = ref;
    run_step(s, be, pb, 1, &p, &m2);
    assert_memory_equal(&m1, &m2, sizeof m1);
    assert_memory_equal(g1, r.lo.grads, r.lo.n_params * sizeof(float));
    const double *used;
    int computed = -1;
    assert_int_equal(bt_pref_step_ref_used(s, &used, &computed), 6); /* 3 pairs, no forward */
    assert_int_equal(computed, 0);
    ref[0] += 1.0; /* a different reference changes the loss: the given values are used */
    run_step(s, be, pb, 1, &p, &m2);
    assert_true(fabs(m2.loss - m1.loss) > 1e-3);
    /* layout 3's seg_ref_ok: a segment without a cached value is computed, the others taken; the
     * wrong value of segment 0 is not used when its ok flag is 0 */
    int32_t ok[MAXS];
    for (int k = 0; k < b[0].nseg; k++) ok[k] = 1;
    ok[0] = 0;
    pb[0].ref_ok = ok;
    run_step(s, be, pb, 1, &p, &m2);
    assert_memory_equal(&m1, &m2, sizeof m1);
    assert_memory_equal(g1, r.lo.grads, r.lo.n_params * sizeof(float));
    assert_int_equal(bt_pref_step_ref_used(s, &used, &computed), 5);
    assert_int_equal(computed, 1);
    assert_true(used[0] == ref[0] - 1.0); /* the computed value, bit for bit the cached one */
    free(g1);
    bt_pref_step_free(s);
    bt_backend_free(be);
    rig_free(&r);
}

/* An evaluation (no backward) with the adapter the identity (adapter-init's lora_A, every lora_B
 * zeroed: PEFT's init) declared by bt_pref_step_set_policy_is_ref: no policy forward (counted), the reference's
 * sums scored as the policy's, and the same loss and metrics as the evaluation with both forwards
 * (relative 1e-12: B = 0 adds exact zeros, so the two forwards agree); a training pass still runs
 * its policy forward; KTO's KL sequences add 0 each without a forward. */
static void eval_pass(bt_pref_step *s, bt_backend *be, bt_pref_batch *pb, const bt_pref_params *p,
                      bt_pref_metrics *m) {
    bt_pref_step_begin(s, NULL, 0.0);
    assert_int_equal(bt_pref_step_micro(s, be, pb, 0, 0), 0);
    double sums[BT_PREF_NSUMS];
    bt_pref_step_sums(s, 0.0, sums);
    bt_pref_metrics_of(p, sums, 0.0, m);
}

static void test_identity_adapter_skips_the_policy_forward(void **state) {
    (void)state;
    rig r;
    rig_init(&r);
    for (int l = 0; l < r.lo.n_layer; l++)
        for (int mod = 0; mod < BT_MOD_N; mod++) {
            const bt_lora_mod *md = bt_lora_get(&r.lo, l, mod);
            for (int i = 0; md && i < md->out * r.lo.r; i++) md->B[i] = 0.0f; /* a fresh PEFT adapter */
        }
    bt_backend *be = backend(&r);
    pbatch b[2];
    bt_pref_batch pb[2];
    pair_batches(&r, b, pb, 0);
    bt_pref_params p;
    bt_pref_defaults(&p, BT_PREF_DPO);
    bt_pref_step *s = NULL;
    assert_int_equal(bt_pref_step_new(&s, &p, 1, MAXT, r.m.hp.vocab), 0);
    bt_pref_metrics m1, m2;
    eval_pass(s, be, pb, &p, &m1);
    assert_int_equal(bt_pref_step_policy_skipped(s), 0);
    bt_pref_step_set_policy_is_ref(s, 1);
    eval_pass(s, be, pb, &p, &m2);
    assert_int_equal(bt_pref_step_policy_skipped(s), 1);
    const double a[] = {m1.loss, m1.rewards_accuracies, m1.rewards_margins, m1.logps_chosen, m1.logps_rejected,
                        m1.logps_accuracies, m1.logps_margins};
    const double c[] = {m2.loss, m2.rewards_accuracies, m2.rewards_margins, m2.logps_chosen, m2.logps_rejected,
                        m2.logps_accuracies, m2.logps_margins};
    for (int i = 0; i < 7; i++) assert_true(fabs(a[i] - c[i]) <= 1e-12 * (1.0 + fabs(a[i])));
    assert_true(m2.rewards_margins == 0.0 && fabs(m1.loss - log(2.0)) < 1e-9); /* policy = reference */
    /* a different policy shows: the skipped pass would have mattered had B not been zero */
    r.lo.mods[0].B[0] = 0.5f;
    bt_pref_step_set_policy_is_ref(s, 0);
    eval_pass(s, be, pb, &p, &m1);
    assert_true(fabs(m1.logps_chosen - m2.logps_chosen) > 1e-6);
    r.lo.mods[0].B[0] = 0.0f;
    /* training (backward) always runs the policy forward */
    bt_pref_step_set_policy_is_ref(s, 1);
    run_step(s, be, pb, 1, &p, &m1);
    assert_int_equal(bt_pref_step_policy_skipped(s), 1);
    bt_pref_step_free(s);
    /* KTO: each KL sequence adds 0 (policy - reference), counted, no forward */
    bt_pref_defaults(&p, BT_PREF_KTO);
    assert_int_equal(bt_pref_step_new(&s, &p, 1, MAXT, r.m.hp.vocab), 0);
    pbatch kb;
    bt_pref_batch kpb;
    memset(&kb, 0, sizeof kb);
    json_t *pairs = json_object_get(r.doc, "pairs");
    for (size_t i = 0; i < 2; i++) {
        json_t *pr = json_array_get(pairs, i);
        add_seq(&kb, json_object_get(pr, "prompt_ids"), json_object_get(pr, "chosen_ids"),
                i ? BT_SEG_KTO_UNDESIRABLE : BT_SEG_KTO_DESIRABLE);
    }
    finish(&kb, 2, &kpb);
    double kl0[2] = {0, 0}, kl1[2] = {0, 0};
    assert_int_equal(bt_pref_step_kl(s, be, &kpb, kl0), 0);
    bt_pref_step_set_policy_is_ref(s, 1);
    assert_int_equal(bt_pref_step_kl(s, be, &kpb, kl1), 0);
    assert_true(kl1[1] == kl0[1] && kl1[1] == 2 && kl1[0] == 0.0 && fabs(kl0[0]) < 1e-9);
    assert_int_equal(bt_pref_step_policy_skipped(s), 1);
    bt_pref_step_free(s);
    bt_backend_free(be);
    rig_free(&r);
}

static void test_malformed_batches_are_refused(void **state) {
    (void)state;
    rig r;
    rig_init(&r);
    pbatch b[2];
    bt_pref_batch pb[2];
    bt_pref_params p;
    bt_pref_defaults(&p, BT_PREF_DPO);
    bt_pref_step *s = NULL;
    assert_int_equal(bt_pref_step_new(&s, &p, 1, MAXT, r.m.hp.vocab), 0);
    bt_pref_counts c = {0, 0};
    pair_batches(&r, b, pb, 0);
    assert_int_equal(bt_pref_step_count(s, &pb[0], &c), 0);
    assert_true(c.records == 3);
    /* a rejected segment without its chosen one */
    b[0].kind[0] = BT_SEG_PLAIN;
    b[0].pair[0] = -1;
    for (int t = b[0].cu[0]; t < b[0].cu[1]; t++) b[0].lab[t] = -100;
    assert_int_equal(bt_pref_step_count(s, &pb[0], &c), BT_ERR_FORMAT);
    assert_non_null(strstr(bt_last_error(), "segment 1: a rejected sequence without its chosen one"));
    /* a plain segment with labels: SFT data in a DPO step */
    pair_batches(&r, b, pb, 0);
    b[0].kind[0] = BT_SEG_PLAIN;
    assert_int_equal(bt_pref_step_count(s, &pb[0], &c), BT_ERR_FORMAT);
    assert_non_null(strstr(bt_last_error(), "data.format must be \"preference\""));
    /* a KTO example in a DPO step */
    pair_batches(&r, b, pb, 0);
    b[0].kind[0] = BT_SEG_KTO_DESIRABLE;
    assert_int_equal(bt_pref_step_count(s, &pb[0], &c), BT_ERR_FORMAT);
    assert_non_null(strstr(bt_last_error(), "a kto desirable segment in a dpo step"));
    /* a kind out of range */
    pair_batches(&r, b, pb, 0);
    b[0].kind[2] = 9;
    assert_int_equal(bt_pref_step_count(s, &pb[0], &c), BT_ERR_FORMAT);
    /* the token checks of bt_shift_targets */
    pair_batches(&r, b, pb, 0);
    b[0].ids[3] = r.m.hp.vocab;
    assert_true(bt_pref_step_count(s, &pb[0], &c) < 0);
    bt_pref_step_free(s);
    /* refused parameters */
    p.beta = 0;
    assert_int_equal(bt_pref_step_new(&s, &p, 1, MAXT, r.m.hp.vocab), BT_ERR_INVALID);
    assert_null(s);
    rig_free(&r);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pair_objectives_against_trl),
        cmocka_unit_test(test_kto_against_trl),
        cmocka_unit_test(test_given_reference_is_the_computed_one),
        cmocka_unit_test(test_identity_adapter_skips_the_policy_forward),
        cmocka_unit_test(test_malformed_batches_are_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
