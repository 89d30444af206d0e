/* Preference losses (trainer/preference.c) against TRL 1.16.0's own loss code: every case of
 * tests/fixtures/preference/trl_losses.json (written by tests/reference/gen_preference_fixtures.py,
 * which runs DPOTrainer._compute_loss, ORPOTrainer / CPOTrainer.get_batch_loss_metrics and
 * KTOTrainer._compute_loss on fixed per-sequence log-probs, gradients by torch autograd): loss,
 * TRL's metrics (a metric TRL does not log is null there and must be NaN here) and the gradient
 * with respect to each summed log-prob and the NLL term.
 * Tolerances: |ours - TRL| <= atol + rtol |TRL| with rtol 1e-9, atol 1e-12 where TRL ran in
 * float64 (all but ORPO); ORPO's odds_ratio_loss casts to fp32 (`.float()`), so there rtol 2e-6,
 * atol 1e-7; rewards/accuracies is a fp32 mean in every TRL trainer (`.float()`): rtol 1e-7.
 * Also: the gradients against central finite differences of our own loss, parameter checks, name
 * parsing, and the refusals of bad calls. */
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

#include "trainer/preference.h"

#define FIXTURE "tests/fixtures/preference/trl_losses.json"
#define MAXN 16

static json_t *fixture(void)
{
    json_error_t je;
    json_t *doc = json_load_file(FIXTURE, 0, &je);
    if (!doc)
        fail_msg("%s: %s (line %d)", FIXTURE, je.text, je.line);
    return doc;
}

static int darr(json_t *a, double *out, int max)
{
    assert_true(json_is_array(a));
    const int n = (int)json_array_size(a);
    assert_true(n <= max);
    for (int i = 0; i < n; i++)
        out[i] = json_number_value(json_array_get(a, (size_t)i));
    return n;
}

static int iarr(json_t *a, int32_t *out, int max)
{
    assert_true(json_is_array(a));
    const int n = (int)json_array_size(a);
    assert_true(n <= max);
    for (int i = 0; i < n; i++)
        out[i] = (int32_t)json_integer_value(json_array_get(a, (size_t)i));
    return n;
}

static void params_from(bt_pref_params *p, const char *algo, json_t *jp)
{
    int simpo = 0;
    const int a = bt_pref_algo_parse(algo, &simpo);
    assert_true(a >= 0);
    bt_pref_defaults(p, (bt_pref_algo)a);
    json_t *lt = json_object_get(jp, "loss_type"), *lw = json_object_get(jp, "loss_weights");
    p->n_loss_types = (int)json_array_size(lt);
    for (int k = 0; k < p->n_loss_types; k++) {
        const int t = bt_pref_loss_type_parse(p->algo, json_string_value(json_array_get(lt, k)));
        assert_true(t >= 0);
        p->loss_type[k] = (bt_pref_loss_type)t;
        p->loss_weights[k] = json_number_value(json_array_get(lw, k));
    }
    p->beta = json_number_value(json_object_get(jp, "beta"));
    p->label_smoothing = json_number_value(json_object_get(jp, "label_smoothing"));
    p->simpo_gamma = json_number_value(json_object_get(jp, "simpo_gamma"));
    p->cpo_alpha = json_number_value(json_object_get(jp, "cpo_alpha"));
    p->desirable_weight = json_number_value(json_object_get(jp, "desirable_weight"));
    p->undesirable_weight = json_number_value(json_object_get(jp, "undesirable_weight"));
    char err[256];
    if (bt_pref_check(p, err, sizeof err) != 0)
        fail_msg("fixture parameters refused: %s", err);
}

/* worst relative error seen per algorithm (index 4: rewards/accuracies, fp32 in TRL), printed at
 * the end */
static double worst[5];

static void close_to(const char *cas, const char *what, double got, double want, double atol,
                     double rtol, int algo)
{
    const double err = fabs(got - want);
    if (!(err <= atol + rtol * fabs(want)))
        fail_msg("%s: %s = %.17g, TRL %.17g (|diff| %.3g)", cas, what, got, want, err);
    const double rel = err / (fabs(want) > 1e-300 ? fabs(want) : 1.0);
    if (rel > worst[algo])
        worst[algo] = rel;
}

static const struct {
    const char *key;
    size_t off;
} metric_fields[] = {
    {"rewards/chosen", offsetof(bt_pref_metrics, rewards_chosen)},
    {"rewards/rejected", offsetof(bt_pref_metrics, rewards_rejected)},
    {"rewards/accuracies", offsetof(bt_pref_metrics, rewards_accuracies)},
    {"rewards/margins", offsetof(bt_pref_metrics, rewards_margins)},
    {"logps/chosen", offsetof(bt_pref_metrics, logps_chosen)},
    {"logps/rejected", offsetof(bt_pref_metrics, logps_rejected)},
    {"nll_loss", offsetof(bt_pref_metrics, nll_loss)},
    {"log_odds_ratio", offsetof(bt_pref_metrics, log_odds_ratio)},
    {"log_odds_chosen", offsetof(bt_pref_metrics, log_odds_chosen)},
    {"kl", offsetof(bt_pref_metrics, kl)},
};

static void check_metrics(const char *cas, json_t *jm, const bt_pref_metrics *m, double atol,
                          double rtol, int algo)
{
    for (size_t f = 0; f < sizeof metric_fields / sizeof *metric_fields; f++) {
        const double got = *(const double *)((const char *)m + metric_fields[f].off);
        json_t *v = json_object_get(jm, metric_fields[f].key);
        if (!v)
            continue; /* a metric this trainer never logs */
        if (json_is_null(v)) {
            if (!isnan(got))
                fail_msg("%s: %s = %g, TRL logs none for this batch", cas, metric_fields[f].key,
                         got);
            continue;
        }
        const int fp32 = strcmp(metric_fields[f].key, "rewards/accuracies") == 0;
        close_to(cas, metric_fields[f].key, got, json_number_value(v), fp32 ? 1e-12 : atol,
                 fp32 ? 1e-7 : rtol, fp32 ? 4 : algo);
    }
}

static void test_against_trl(void **state)
{
    (void)state;
    json_t *doc = fixture();
    json_t *ver = json_object_get(json_object_get(doc, "versions"), "trl");
    assert_string_equal(json_string_value(ver), "1.16.0");
    json_t *cases = json_object_get(doc, "cases");
    assert_true(json_array_size(cases) >= 20);
    int seen[4] = {0};
    size_t ci;
    json_t *c;
    json_array_foreach(cases, ci, c) {
        const char *name = json_string_value(json_object_get(c, "name"));
        const char *algo = json_string_value(json_object_get(c, "algo"));
        json_t *in = json_object_get(c, "inputs"), *ex = json_object_get(c, "expected");
        json_t *gr = json_object_get(ex, "grad");
        bt_pref_params p;
        params_from(&p, algo, json_object_get(c, "params"));
        const double atol = p.algo == BT_PREF_ORPO ? 1e-7 : 1e-12;
        const double rtol = p.algo == BT_PREF_ORPO ? 2e-6 : 1e-9;
        bt_pref_metrics m;
        char what[64];
        seen[p.algo]++;
        if (p.algo == BT_PREF_KTO) {
            double pol[MAXN], ref[MAXN], pkl[MAXN], rkl[MAXN], g[MAXN], want[MAXN];
            uint8_t des[MAXN];
            const int n = darr(json_object_get(in, "policy"), pol, MAXN);
            assert_int_equal(darr(json_object_get(in, "ref"), ref, MAXN), n);
            json_t *dj = json_object_get(in, "desirable");
            for (int i = 0; i < n; i++)
                des[i] = json_is_true(json_array_get(dj, (size_t)i));
            const int nk = darr(json_object_get(in, "policy_kl"), pkl, MAXN);
            assert_int_equal(darr(json_object_get(in, "ref_kl"), rkl, MAXN), nk);
            const double kl = bt_kto_kl_mean(nk, pkl, rkl);
            assert_int_equal(bt_kto_loss(&p, n, pol, ref, des, kl, g, &m), 0);
            close_to(name, "loss", m.loss, json_number_value(json_object_get(ex, "loss")), atol,
                     rtol, p.algo);
            check_metrics(name, json_object_get(ex, "metrics"), &m, atol, rtol, p.algo);
            assert_int_equal(darr(json_object_get(gr, "policy"), want, MAXN), n);
            for (int i = 0; i < n; i++) {
                snprintf(what, sizeof what, "dloss/dpolicy[%d]", i);
                close_to(name, what, g[i], want[i], atol, rtol, p.algo);
            }
            continue;
        }
        double pc[MAXN], pr[MAXN], rc[MAXN], rr[MAXN], dc[MAXN], dr[MAXN], wc[MAXN], wr[MAXN];
        int32_t nc[MAXN], nr[MAXN];
        const int n = darr(json_object_get(in, "policy_chosen"), pc, MAXN);
        assert_int_equal(darr(json_object_get(in, "policy_rejected"), pr, MAXN), n);
        assert_int_equal(iarr(json_object_get(in, "chosen_tokens"), nc, MAXN), n);
        assert_int_equal(iarr(json_object_get(in, "rejected_tokens"), nr, MAXN), n);
        const int has_ref = json_object_get(in, "ref_chosen") != NULL;
        if (has_ref) {
            assert_int_equal(darr(json_object_get(in, "ref_chosen"), rc, MAXN), n);
            assert_int_equal(darr(json_object_get(in, "ref_rejected"), rr, MAXN), n);
        }
        const double nll = json_number_value(json_object_get(in, "nll"));
        double dnll = NAN;
        assert_int_equal(bt_pref_pair_loss(&p, n, pc, pr, has_ref ? rc : NULL,
                                           has_ref ? rr : NULL, nc, nr, nll, dc, dr, &dnll, &m),
                         0);
        close_to(name, "loss", m.loss, json_number_value(json_object_get(ex, "loss")), atol, rtol,
                 p.algo);
        check_metrics(name, json_object_get(ex, "metrics"), &m, atol, rtol, p.algo);
        assert_int_equal(darr(json_object_get(gr, "chosen"), wc, MAXN), n);
        assert_int_equal(darr(json_object_get(gr, "rejected"), wr, MAXN), n);
        for (int i = 0; i < n; i++) {
            snprintf(what, sizeof what, "dloss/dpolicy_chosen[%d]", i);
            close_to(name, what, dc[i], wc[i], atol, rtol, p.algo);
            snprintf(what, sizeof what, "dloss/dpolicy_rejected[%d]", i);
            close_to(name, what, dr[i], wr[i], atol, rtol, p.algo);
        }
        close_to(name, "dloss/dnll", dnll, json_number_value(json_object_get(gr, "nll")), 0.0,
                 0.0, p.algo);
    }
    /* every algorithm is covered */
    for (int a = 0; a < 4; a++)
        assert_true(seen[a] >= 2);
    printf("preference vs TRL 1.16.0: worst relative error dpo %.2e, orpo %.2e, cpo %.2e, "
           "kto %.2e, rewards/accuracies (fp32 in TRL) %.2e\n", worst[0], worst[1], worst[2],
           worst[3], worst[4]);
    json_decref(doc);
}

/* Our own gradients against central differences of our own loss, for every loss type, on inputs
 * of our own (independent of the fixture). */
static double pair_loss_at(const bt_pref_params *p, int n, const double *pc, const double *pr,
                           const double *rc, const double *rr, const int32_t *nc,
                           const int32_t *nr, double nll)
{
    bt_pref_metrics m;
    assert_int_equal(bt_pref_pair_loss(p, n, pc, pr, rc, rr, nc, nr, nll, NULL, NULL, NULL, &m), 0);
    return m.loss;
}

static void fd_check_pair(bt_pref_params *p)
{
    enum { N = 5 };
    double pc[N] = {-12.5, -3.25, -40.0, -7.0, -0.9}, pr[N] = {-15.0, -2.0, -33.0, -9.5, -1.7};
    double rc[N] = {-13.0, -4.0, -38.5, -6.0, -1.0}, rr[N] = {-14.0, -2.5, -35.0, -8.0, -1.1};
    const int32_t nc[N] = {9, 3, 30, 5, 2}, nr[N] = {11, 2, 25, 6, 3};
    double dc[N], dr[N], dnll;
    bt_pref_metrics m;
    assert_int_equal(bt_pref_pair_loss(p, N, pc, pr, rc, rr, nc, nr, 1.7, dc, dr, &dnll, &m), 0);
    const double h = 1e-5;
    for (int i = 0; i < N; i++) {
        for (int side = 0; side < 2; side++) {
            double *x = side ? pr : pc, x0 = x[i];
            x[i] = x0 + h;
            const double lp = pair_loss_at(p, N, pc, pr, rc, rr, nc, nr, 1.7);
            x[i] = x0 - h;
            const double lm = pair_loss_at(p, N, pc, pr, rc, rr, nc, nr, 1.7);
            x[i] = x0;
            const double fd = (lp - lm) / (2 * h), an = side ? dr[i] : dc[i];
            if (!(fabs(fd - an) <= 1e-7 + 1e-5 * fabs(fd)))
                fail_msg("%s %s: d/d%s[%d] = %.10g, finite difference %.10g",
                         bt_pref_algo_name(p->algo), bt_pref_loss_type_name(p->loss_type[0]),
                         side ? "rejected" : "chosen", i, an, fd);
        }
    }
    const double fdn = (pair_loss_at(p, N, pc, pr, rc, rr, nc, nr, 1.7 + h) -
                        pair_loss_at(p, N, pc, pr, rc, rr, nc, nr, 1.7 - h)) / (2 * h);
    assert_true(fabs(fdn - dnll) < 1e-7);
}

static void test_finite_differences(void **state)
{
    (void)state;
    bt_pref_params p;
    const bt_pref_loss_type dpo_types[] = {BT_PREF_LOSS_SIGMOID, BT_PREF_LOSS_HINGE,
                                           BT_PREF_LOSS_IPO, BT_PREF_LOSS_ROBUST,
                                           BT_PREF_LOSS_EXO_PAIR};
    for (size_t k = 0; k < sizeof dpo_types / sizeof *dpo_types; k++) {
        bt_pref_defaults(&p, BT_PREF_DPO);
        p.loss_type[0] = dpo_types[k];
        p.label_smoothing = dpo_types[k] == BT_PREF_LOSS_EXO_PAIR ? 1e-3
                            : dpo_types[k] == BT_PREF_LOSS_ROBUST ? 0.1 : 0.0;
        p.beta = 0.3;
        fd_check_pair(&p);
    }
    bt_pref_defaults(&p, BT_PREF_ORPO);
    fd_check_pair(&p);
    const bt_pref_loss_type cpo_types[] = {BT_PREF_LOSS_SIGMOID, BT_PREF_LOSS_HINGE,
                                           BT_PREF_LOSS_IPO, BT_PREF_LOSS_SIMPO};
    for (size_t k = 0; k < sizeof cpo_types / sizeof *cpo_types; k++) {
        bt_pref_defaults(&p, BT_PREF_CPO);
        p.loss_type[0] = cpo_types[k];
        p.label_smoothing = 0.15;
        fd_check_pair(&p);
    }
    /* KTO: the KL estimate is detached, so the finite difference moves the policy only */
    bt_pref_defaults(&p, BT_PREF_KTO);
    p.desirable_weight = 1.2;
    p.undesirable_weight = 0.8;
    enum { N = 6 };
    double pol[N] = {-10, -22, -5, -13, -30, -8}, ref[N] = {-11, -20, -7, -12, -29, -9}, g[N];
    const uint8_t des[N] = {1, 0, 1, 0, 0, 1};
    bt_pref_metrics m, m2;
    for (int lt = 0; lt < 2; lt++) {
        p.loss_type[0] = lt ? BT_PREF_LOSS_APO_ZERO_UNPAIRED : BT_PREF_LOSS_KTO;
        assert_int_equal(bt_kto_loss(&p, N, pol, ref, des, 1.5, g, &m), 0);
        for (int i = 0; i < N; i++) {
            const double x0 = pol[i], h = 1e-5;
            pol[i] = x0 + h;
            bt_kto_loss(&p, N, pol, ref, des, 1.5, NULL, &m2);
            const double lp = m2.loss;
            pol[i] = x0 - h;
            bt_kto_loss(&p, N, pol, ref, des, 1.5, NULL, &m2);
            pol[i] = x0;
            const double fd = (lp - m2.loss) / (2 * h);
            if (!(fabs(fd - g[i]) <= 1e-8 + 1e-5 * fabs(fd)))
                fail_msg("kto %s: d/dpolicy[%d] = %.10g, finite difference %.10g",
                         bt_pref_loss_type_name(p.loss_type[0]), i, g[i], fd);
        }
    }
}

static void test_params_and_names(void **state)
{
    (void)state;
    bt_pref_params p;
    char err[256];
    int simpo = -1;
    assert_int_equal(bt_pref_algo_parse("simpo", &simpo), BT_PREF_CPO);
    assert_int_equal(simpo, 1);
    assert_int_equal(bt_pref_algo_parse("dpo", &simpo), BT_PREF_DPO);
    assert_int_equal(simpo, 0);
    assert_int_equal(bt_pref_algo_parse("DPO", NULL), -1);
    assert_int_equal(bt_pref_algo_parse(NULL, NULL), -1);
    assert_int_equal(bt_pref_loss_type_parse(BT_PREF_DPO, "ipo"), BT_PREF_LOSS_IPO);
    assert_int_equal(bt_pref_loss_type_parse(BT_PREF_DPO, "simpo"), -1); /* CPO's, not DPO's */
    assert_int_equal(bt_pref_loss_type_parse(BT_PREF_CPO, "robust"), -1);
    assert_int_equal(bt_pref_loss_type_parse(BT_PREF_KTO, "sigmoid"), -1);
    assert_int_equal(bt_pref_loss_type_parse(BT_PREF_KTO, "apo_zero_unpaired"),
                     BT_PREF_LOSS_APO_ZERO_UNPAIRED);
    for (int a = 0; a < 4; a++) {
        bt_pref_defaults(&p, (bt_pref_algo)a);
        assert_int_equal(bt_pref_check(&p, err, sizeof err), 0);
        assert_true(p.beta == 0.1);
    }
    bt_pref_defaults(&p, BT_PREF_CPO);
    assert_true(p.cpo_alpha == 1.0 && p.simpo_gamma == 0.5 && p.label_smoothing == 0.0);

    /* refusals, each naming the key */
    bt_pref_defaults(&p, BT_PREF_DPO);
    p.beta = 0.0;
    assert_int_equal(bt_pref_check(&p, err, sizeof err), -1);
    assert_non_null(strstr(err, "beta"));
    p.beta = NAN;
    assert_int_equal(bt_pref_check(&p, err, sizeof err), -1);
    bt_pref_defaults(&p, BT_PREF_DPO);
    p.loss_type[0] = BT_PREF_LOSS_ROBUST;
    p.label_smoothing = 0.5;
    assert_int_equal(bt_pref_check(&p, err, sizeof err), -1);
    assert_non_null(strstr(err, "robust"));
    p.loss_type[0] = BT_PREF_LOSS_EXO_PAIR;
    p.label_smoothing = 0.0;
    assert_int_equal(bt_pref_check(&p, err, sizeof err), -1);
    assert_non_null(strstr(err, "exo_pair"));
    bt_pref_defaults(&p, BT_PREF_DPO);
    p.n_loss_types = 0;
    assert_int_equal(bt_pref_check(&p, err, sizeof err), -1);
    p.n_loss_types = BT_PREF_MAX_LOSS_TYPES + 1;
    assert_int_equal(bt_pref_check(&p, err, sizeof err), -1);
    bt_pref_defaults(&p, BT_PREF_DPO);
    p.loss_weights[0] = -1.0;
    assert_int_equal(bt_pref_check(&p, err, sizeof err), -1);
    assert_non_null(strstr(err, "loss_weights"));
    bt_pref_defaults(&p, BT_PREF_DPO);
    p.loss_type[0] = BT_PREF_LOSS_SIMPO;
    assert_int_equal(bt_pref_check(&p, err, sizeof err), -1);
    p.loss_type[0] = (bt_pref_loss_type)99;
    assert_int_equal(bt_pref_check(&p, err, sizeof err), -1);
    bt_pref_defaults(&p, BT_PREF_ORPO);
    p.n_loss_types = 2; /* only DPO combines loss types */
    assert_int_equal(bt_pref_check(&p, err, sizeof err), -1);
    bt_pref_defaults(&p, BT_PREF_CPO);
    p.cpo_alpha = INFINITY;
    assert_int_equal(bt_pref_check(&p, err, sizeof err), -1);
    assert_non_null(strstr(err, "cpo_alpha"));
    bt_pref_defaults(&p, BT_PREF_KTO);
    p.undesirable_weight = -0.5;
    assert_int_equal(bt_pref_check(&p, err, sizeof err), -1);
    assert_int_equal(bt_pref_check(NULL, err, sizeof err), -1);
    assert_int_equal(bt_pref_check(&p, NULL, 0), -1);
}

static void test_bad_calls(void **state)
{
    (void)state;
    bt_pref_params p;
    bt_pref_metrics m;
    double a[2] = {-1, -2}, g[2] = {7, 7};
    const int32_t t[2] = {1, 2};
    const uint8_t d[2] = {1, 0};
    bt_pref_defaults(&p, BT_PREF_DPO);
    /* DPO needs the reference; ipo needs the counts; n >= 1 */
    assert_int_equal(bt_pref_pair_loss(&p, 2, a, a, NULL, a, NULL, NULL, 0, g, g, NULL, &m), -1);
    assert_int_equal(bt_pref_pair_loss(&p, 0, a, a, a, a, NULL, NULL, 0, g, g, NULL, &m), -1);
    p.loss_type[0] = BT_PREF_LOSS_IPO;
    assert_int_equal(bt_pref_pair_loss(&p, 2, a, a, a, a, NULL, t, 0, g, g, NULL, &m), -1);
    assert_true(g[0] == 7 && g[1] == 7); /* nothing written */
    bt_pref_defaults(&p, BT_PREF_ORPO);
    assert_int_equal(bt_pref_pair_loss(&p, 2, a, a, NULL, NULL, t, NULL, 0, g, g, NULL, &m), -1);
    /* wrong entry point for the algorithm */
    bt_pref_defaults(&p, BT_PREF_KTO);
    assert_int_equal(bt_pref_pair_loss(&p, 2, a, a, a, a, t, t, 0, g, g, NULL, &m), -1);
    bt_pref_defaults(&p, BT_PREF_DPO);
    assert_int_equal(bt_kto_loss(&p, 2, a, a, d, 0.0, g, &m), -1);
    bt_pref_defaults(&p, BT_PREF_KTO);
    assert_int_equal(bt_kto_loss(&p, 2, a, a, NULL, 0.0, g, &m), -1);
    assert_int_equal(bt_kto_loss(&p, 0, a, a, d, 0.0, g, &m), -1);
    assert_true(g[0] == 7 && g[1] == 7);
    /* the KL estimate: mean difference, 0 for an empty batch; a negative one is clamped by the
     * loss, a NaN one stays NaN (torch.clamp) */
    double pk[3] = {-5, -7, -9}, rk[3] = {-6, -6, -12};
    assert_true(fabs(bt_kto_kl_mean(3, pk, rk) - 1.0) < 1e-15);
    assert_true(bt_kto_kl_mean(0, pk, rk) == 0.0);
    assert_int_equal(bt_kto_loss(&p, 2, a, a, d, -3.0, g, &m), 0);
    assert_true(m.kl == 0.0 && isnan(m.rewards_accuracies));
    assert_int_equal(bt_kto_loss(&p, 2, a, a, d, NAN, g, &m), 0);
    assert_true(isnan(m.kl) && isnan(m.loss));
}

/* Our logps/accuracies and logps/margins (not TRL's): the share of pairs whose POLICY log-prob of
 * chosen exceeds rejected, and the mean policy (chosen - rejected), on hand-computed pairs. They
 * must not depend on the reference (rewards/accuracies does: 0 when policy = reference), a tie is
 * not a win, and they use the log-probs as logps/chosen logs them (per-token averages for ORPO and
 * CPO simpo, sums for DPO and CPO sigmoid). */
static void test_logps_accuracies(void **state)
{
    (void)state;
    bt_pref_params p;
    bt_pref_metrics m;
    /* DPO, 4 pairs: -10 > -12 yes, -20 > -15 no, -5 = -5 tie (no), -8 > -9 yes -> 2/4; margins
     * 2, -5, 0, 1 -> mean -0.5 */
    const double pc[4] = {-10, -20, -5, -8}, pr[4] = {-12, -15, -5, -9};
    bt_pref_defaults(&p, BT_PREF_DPO);
    assert_int_equal(bt_pref_pair_loss(&p, 4, pc, pr, pc, pr, NULL, NULL, 0, NULL, NULL, NULL, &m), 0);
    assert_true(m.rewards_accuracies == 0.0); /* TRL's: 0 by construction, policy = reference */
    assert_true(m.logps_accuracies == 0.5);
    assert_true(fabs(m.logps_margins - (-0.5)) < 1e-15);
    /* another reference: TRL's accuracy moves (only pair 0's reward margin is > 0), ours does not */
    const double rc[4] = {-11, -20, -5, -8};
    assert_int_equal(bt_pref_pair_loss(&p, 4, pc, pr, rc, pr, NULL, NULL, 0, NULL, NULL, NULL, &m), 0);
    assert_true(m.rewards_accuracies == 0.25);
    assert_true(m.logps_accuracies == 0.5);
    assert_true(fabs(m.logps_margins - (-0.5)) < 1e-15);
    /* per-token averages vs sums, 2 pairs: sums -10 > -9 no, -6 > -8 yes -> 0.5, margins -1, 2 ->
     * 0.5; averages -10/5 = -2 > -9/3 = -3 yes, -6/3 = -2 > -8/2 = -4 yes -> 1, margins 1, 2 -> 1.5 */
    const double qc[2] = {-10, -6}, qr[2] = {-9, -8};
    const int32_t nc[2] = {5, 3}, nr[2] = {3, 2};
    bt_pref_defaults(&p, BT_PREF_ORPO);
    assert_int_equal(bt_pref_pair_loss(&p, 2, qc, qr, NULL, NULL, nc, nr, 0.5, NULL, NULL, NULL, &m), 0);
    assert_true(m.logps_accuracies == 1.0);
    assert_true(fabs(m.logps_margins - 1.5) < 1e-15);
    bt_pref_defaults(&p, BT_PREF_CPO); /* sigmoid: sums */
    assert_int_equal(bt_pref_pair_loss(&p, 2, qc, qr, NULL, NULL, nc, nr, 0.5, NULL, NULL, NULL, &m), 0);
    assert_true(m.logps_accuracies == 0.5);
    assert_true(fabs(m.logps_margins - 0.5) < 1e-15);
    p.loss_type[0] = BT_PREF_LOSS_SIMPO; /* averages */
    assert_int_equal(bt_pref_pair_loss(&p, 2, qc, qr, NULL, NULL, nc, nr, 0.5, NULL, NULL, NULL, &m), 0);
    assert_true(m.logps_accuracies == 1.0);
    assert_true(fabs(m.logps_margins - 1.5) < 1e-15);
    /* DPO ipo logs summed logps (TRL), so ours uses the sums too */
    bt_pref_defaults(&p, BT_PREF_DPO);
    p.loss_type[0] = BT_PREF_LOSS_IPO;
    assert_int_equal(bt_pref_pair_loss(&p, 2, qc, qr, qc, qr, nc, nr, 0, NULL, NULL, NULL, &m), 0);
    assert_true(m.logps_accuracies == 0.5);
    assert_true(fabs(m.logps_margins - 0.5) < 1e-15);
    /* KTO has no pairs: NaN (not logged) */
    const uint8_t d[2] = {1, 0};
    bt_pref_defaults(&p, BT_PREF_KTO);
    assert_int_equal(bt_kto_loss(&p, 2, qc, qr, d, 0.0, NULL, &m), 0);
    assert_true(isnan(m.logps_accuracies) && isnan(m.logps_margins));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_against_trl),
        cmocka_unit_test(test_finite_differences),
        cmocka_unit_test(test_params_and_names),
        cmocka_unit_test(test_bad_calls),
        cmocka_unit_test(test_logps_accuracies),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
