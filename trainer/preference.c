/* Preference losses on per-sequence log-probs (DPO, ORPO, CPO / SimPO, KTO), in double, with
 * their gradients written out by hand (each derivative is next to its formula) and TRL 1.16.0's
 * metrics. trainer/preference.h gives the API and the TRL source of every formula. */
#include "trainer/preference.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* log(sigmoid(z)) without overflow: -log1p(exp(-z)) for z >= 0, z - log1p(exp(z)) below
 * (torch.nn.functional.logsigmoid). */
static double log_sigmoid(double z)
{
    return z >= 0 ? -log1p(exp(-z)) : z - log1p(exp(z));
}

static double sigmoid(double z)
{
    if (z >= 0)
        return 1.0 / (1.0 + exp(-z));
    const double e = exp(z);
    return e / (1.0 + e);
}

/* log(1 - exp(x)) for x <= 0, branching at -ln 2 (TRL orpo_trainer.py log1mexp; Maechler 2012). */
static double log1mexp(double x)
{
    return x < -0.6931471805599453 ? log1p(-exp(x)) : log(-expm1(x));
}

static const char *const loss_names[BT_PREF_LOSS_COUNT] = {
    [BT_PREF_LOSS_SIGMOID] = "sigmoid",   [BT_PREF_LOSS_HINGE] = "hinge",
    [BT_PREF_LOSS_IPO] = "ipo",           [BT_PREF_LOSS_ROBUST] = "robust",
    [BT_PREF_LOSS_EXO_PAIR] = "exo_pair", [BT_PREF_LOSS_SIMPO] = "simpo",
    [BT_PREF_LOSS_ORPO] = "orpo",         [BT_PREF_LOSS_KTO] = "kto",
    [BT_PREF_LOSS_APO_ZERO_UNPAIRED] = "apo_zero_unpaired",
};

static int loss_allowed(bt_pref_algo algo, bt_pref_loss_type t)
{
    switch (algo) {
    case BT_PREF_DPO:
        return t == BT_PREF_LOSS_SIGMOID || t == BT_PREF_LOSS_HINGE || t == BT_PREF_LOSS_IPO ||
               t == BT_PREF_LOSS_ROBUST || t == BT_PREF_LOSS_EXO_PAIR;
    case BT_PREF_ORPO:
        return t == BT_PREF_LOSS_ORPO;
    case BT_PREF_CPO:
        return t == BT_PREF_LOSS_SIGMOID || t == BT_PREF_LOSS_HINGE || t == BT_PREF_LOSS_IPO ||
               t == BT_PREF_LOSS_SIMPO;
    case BT_PREF_KTO:
        return t == BT_PREF_LOSS_KTO || t == BT_PREF_LOSS_APO_ZERO_UNPAIRED;
    }
    return 0;
}

const char *bt_pref_loss_type_name(bt_pref_loss_type t)
{
    return (unsigned)t < BT_PREF_LOSS_COUNT ? loss_names[t] : "?";
}

int bt_pref_loss_type_parse(bt_pref_algo algo, const char *name)
{
    if (!name)
        return -1;
    for (int t = 0; t < BT_PREF_LOSS_COUNT; t++)
        if (strcmp(name, loss_names[t]) == 0 && loss_allowed(algo, (bt_pref_loss_type)t))
            return t;
    return -1;
}

const char *bt_pref_algo_name(bt_pref_algo algo)
{
    switch (algo) {
    case BT_PREF_DPO: return "dpo";
    case BT_PREF_ORPO: return "orpo";
    case BT_PREF_CPO: return "cpo";
    case BT_PREF_KTO: return "kto";
    }
    return "?";
}

int bt_pref_algo_parse(const char *name, int *simpo_preset)
{
    if (simpo_preset)
        *simpo_preset = 0;
    if (!name)
        return -1;
    if (strcmp(name, "dpo") == 0)
        return BT_PREF_DPO;
    if (strcmp(name, "orpo") == 0)
        return BT_PREF_ORPO;
    if (strcmp(name, "cpo") == 0)
        return BT_PREF_CPO;
    if (strcmp(name, "simpo") == 0) {
        if (simpo_preset)
            *simpo_preset = 1;
        return BT_PREF_CPO;
    }
    if (strcmp(name, "kto") == 0)
        return BT_PREF_KTO;
    return -1;
}

void bt_pref_defaults(bt_pref_params *p, bt_pref_algo algo)
{
    memset(p, 0, sizeof *p);
    p->algo = algo;
    p->n_loss_types = 1;
    for (int k = 0; k < BT_PREF_MAX_LOSS_TYPES; k++)
        p->loss_weights[k] = 1.0;
    p->loss_type[0] = algo == BT_PREF_ORPO  ? BT_PREF_LOSS_ORPO
                      : algo == BT_PREF_KTO ? BT_PREF_LOSS_KTO
                                            : BT_PREF_LOSS_SIGMOID;
    p->beta = 0.1;
    p->label_smoothing = 0.0;
    p->simpo_gamma = 0.5;
    p->cpo_alpha = 1.0;
    p->desirable_weight = 1.0;
    p->undesirable_weight = 1.0;
}

static int nonneg(double x)
{
    return isfinite(x) && x >= 0.0;
}

int bt_pref_check(const bt_pref_params *p, char *err, int errlen)
{
#define FAIL(...)                                                                                  \
    do {                                                                                           \
        if (err && errlen > 0)                                                                     \
            snprintf(err, (size_t)errlen, __VA_ARGS__);                                            \
        return -1;                                                                                 \
    } while (0)
    if (!p)
        FAIL("no preference parameters");
    if ((unsigned)p->algo > BT_PREF_KTO)
        FAIL("unknown preference algorithm %d", (int)p->algo);
    const char *an = bt_pref_algo_name(p->algo);
    if (!(isfinite(p->beta) && p->beta > 0.0))
        FAIL("%s: beta must be a finite number > 0 (got %g)", an, p->beta);
    const int nmax = p->algo == BT_PREF_DPO ? BT_PREF_MAX_LOSS_TYPES : 1;
    if (p->n_loss_types < 1 || p->n_loss_types > nmax)
        FAIL("%s: loss_type takes 1 to %d types (got %d)", an, nmax, p->n_loss_types);
    const double ls = p->label_smoothing;
    if (!nonneg(ls) || ls > 1.0)
        FAIL("%s: label_smoothing must be in [0, 1] (got %g)", an, ls);
    for (int k = 0; k < p->n_loss_types; k++) {
        const bt_pref_loss_type t = p->loss_type[k];
        if ((unsigned)t >= BT_PREF_LOSS_COUNT || !loss_allowed(p->algo, t))
            FAIL("%s: loss_type '%s' is not one of this algorithm's", an,
                 bt_pref_loss_type_name(t));
        if (!nonneg(p->loss_weights[k]))
            FAIL("%s: loss_weights[%d] must be a finite number >= 0 (got %g)", an, k,
                 p->loss_weights[k]);
        if (t == BT_PREF_LOSS_ROBUST && !(ls < 0.5))
            FAIL("%s: label_smoothing must be in [0.0, 0.5) for the 'robust' loss (got %g)", an,
                 ls);
        if (t == BT_PREF_LOSS_EXO_PAIR && !(ls > 0.0 && ls < 1.0))
            FAIL("%s: label_smoothing must be in (0, 1) for the 'exo_pair' loss, e.g. 1e-3 "
                 "(got %g)", an, ls);
    }
    if (!isfinite(p->simpo_gamma))
        FAIL("%s: simpo_gamma must be finite", an);
    if (!nonneg(p->cpo_alpha))
        FAIL("%s: cpo_alpha must be a finite number >= 0 (got %g)", an, p->cpo_alpha);
    if (!nonneg(p->desirable_weight) || !nonneg(p->undesirable_weight))
        FAIL("%s: desirable_weight and undesirable_weight must be finite numbers >= 0", an);
    return 0;
#undef FAIL
}

static void metrics_nan(bt_pref_metrics *m)
{
    m->loss = m->rewards_chosen = m->rewards_rejected = m->rewards_accuracies = NAN;
    m->rewards_margins = m->logps_chosen = m->logps_rejected = NAN;
    m->logps_accuracies = m->logps_margins = NAN;
    m->nll_loss = m->log_odds_ratio = m->log_odds_chosen = m->kl = NAN;
}

/* DPO, TRL 1.16.0 trl/trainer/dpo_trainer.py _compute_loss (f_divergence_type "reverse_kl",
 * ld_alpha None, use_weighting False). c_i = policy_chosen - ref_chosen, r_i = policy_rejected -
 * ref_rejected (the log ratios), delta = c - r, z = beta * delta:
 *   sigmoid  -logsigmoid(z)                                 dL/dz = -sigmoid(-z)
 *   hinge    relu(1 - z)                                    dL/dz = -1 if z < 1 else 0 (torch's
 *                                                           relu gradient is 0 at 0)
 *   ipo      (c/nc - r/nr - 1/(2 beta))^2, nc, nr token     dL/dc = 2 (.) / nc, dL/dr = -2 (.) / nr
 *            counts clamped at 1
 *   robust   (-(1-e) logsigmoid(z) + e logsigmoid(-z)) / (1 - 2e)
 *                                   dL/dz = -((1-e) sigmoid(-z) + e sigmoid(z)) / (1 - 2e)
 *   exo_pair s(z)(logsigmoid(z) - log1p(-e)) + s(-z)(logsigmoid(-z) - log e)
 *                                   dL/dz = s(z) s(-z) (z - log1p(-e) + log e)
 * (e = label_smoothing, s = sigmoid). loss = sum_k w_k mean_i L_k; the policy log-probs get
 * dloss/dc and -dloss/dr. Metrics: rewards = beta * (log ratio), accuracies = chosen > rejected
 * (strictly), margins = mean difference, logps = mean summed policy log-probs. */
static void dpo(const bt_pref_params *p, int n, const double *pc, const double *pr,
                const double *rc, const double *rr, const int32_t *nc, const int32_t *nr,
                double *dc, double *dr, bt_pref_metrics *m)
{
    double loss = 0.0;
    for (int i = 0; i < n; i++) {
        if (dc)
            dc[i] = 0.0;
        if (dr)
            dr[i] = 0.0;
    }
    const double beta = p->beta, e = p->label_smoothing;
    for (int k = 0; k < p->n_loss_types; k++) {
        const double w = p->loss_weights[k] / n;
        double sum = 0.0;
        for (int i = 0; i < n; i++) {
            const double c = pc[i] - rc[i], r = pr[i] - rr[i];
            const double z = beta * (c - r);
            double L, dLdc, dLdr;
            switch (p->loss_type[k]) {
            case BT_PREF_LOSS_HINGE:
                L = 1.0 - z > 0.0 ? 1.0 - z : 0.0;
                dLdc = 1.0 - z > 0.0 ? -beta : 0.0;
                dLdr = -dLdc;
                break;
            case BT_PREF_LOSS_IPO: {
                const double ncl = nc[i] < 1 ? 1.0 : (double)nc[i];
                const double nrl = nr[i] < 1 ? 1.0 : (double)nr[i];
                const double u = c / ncl - r / nrl - 1.0 / (2.0 * beta);
                L = u * u;
                dLdc = 2.0 * u / ncl;
                dLdr = -2.0 * u / nrl;
                break;
            }
            case BT_PREF_LOSS_ROBUST: {
                const double den = 1.0 - 2.0 * e;
                L = (-(1.0 - e) * log_sigmoid(z) + e * log_sigmoid(-z)) / den;
                dLdc = -beta * ((1.0 - e) * sigmoid(-z) + e * sigmoid(z)) / den;
                dLdr = -dLdc;
                break;
            }
            case BT_PREF_LOSS_EXO_PAIR: {
                /* TRL makes epsilon a default-dtype (fp32) tensor, `torch.tensor(self.
                 * label_smoothing)`, so both logs are fp32 values there: the same here */
                const float ef = (float)e;
                const double lpw = (double)log1pf(-ef), lpl = (double)logf(ef);
                const double qw = sigmoid(z), ql = sigmoid(-z);
                L = qw * (log_sigmoid(z) - lpw) + ql * (log_sigmoid(-z) - lpl);
                dLdc = beta * qw * ql * (z - lpw + lpl);
                dLdr = -dLdc;
                break;
            }
            default: /* sigmoid */
                L = -log_sigmoid(z);
                dLdc = -beta * sigmoid(-z);
                dLdr = -dLdc;
                break;
            }
            sum += L;
            if (dc)
                dc[i] += w * dLdc;
            if (dr)
                dr[i] += w * dLdr;
        }
        loss += p->loss_weights[k] * (sum / n);
    }
    double rch = 0, rrej = 0, acc = 0, mar = 0, lc = 0, lr = 0, lacc = 0;
    for (int i = 0; i < n; i++) {
        const double a = beta * (pc[i] - rc[i]), b = beta * (pr[i] - rr[i]);
        lacc += pc[i] > pr[i] ? 1.0 : 0.0;
        rch += a;
        rrej += b;
        acc += a > b ? 1.0 : 0.0;
        mar += a - b;
        lc += pc[i];
        lr += pr[i];
    }
    m->loss = loss;
    m->rewards_chosen = rch / n;
    m->rewards_rejected = rrej / n;
    m->rewards_accuracies = acc / n;
    m->rewards_margins = mar / n;
    m->logps_chosen = lc / n;
    m->logps_rejected = lr / n;
    m->logps_accuracies = lacc / n;
    m->logps_margins = (lc - lr) / n;
}

/* ORPO, TRL 1.16.0 trl/experimental/orpo/orpo_trainer.py (odds_ratio_loss,
 * get_batch_loss_metrics): a = chosen average log-prob (sum / count), b = rejected,
 *   log_odds = (a - b) - (log1mexp(a) - log1mexp(b)),  loss = nll - mean(beta * logsigmoid(log_odds))
 * dloss/dlog_odds = -beta sigmoid(-log_odds) / n; dlog_odds/da = 1 / (1 - e^a) = -1 / expm1(a),
 * dlog_odds/db = 1 / expm1(b); d/dsum = d/davg / count; dloss/dnll = 1.
 * Metrics: rewards = beta * a (b), logps = mean a (b), nll_loss, log_odds_ratio =
 * mean logsigmoid(log_odds), log_odds_chosen = mean log_odds. TRL computes these in fp32
 * (`.float()`); here in double. */
static void orpo(const bt_pref_params *p, int n, const double *pc, const double *pr,
                 const int32_t *nc, const int32_t *nr, double nll, double *dc, double *dr,
                 double *dnll, bt_pref_metrics *m)
{
    const double beta = p->beta;
    double sum_ratio = 0, sum_lo = 0, rch = 0, rrej = 0, acc = 0, mar = 0, la = 0, lb = 0, lacc = 0;
    for (int i = 0; i < n; i++) {
        const double a = pc[i] / nc[i], b = pr[i] / nr[i];
        lacc += a > b ? 1.0 : 0.0;
        la += a;
        lb += b;
        const double lo = (a - b) - (log1mexp(a) - log1mexp(b));
        sum_ratio += log_sigmoid(lo);
        sum_lo += lo;
        const double g = -beta * sigmoid(-lo) / n;
        if (dc)
            dc[i] = g * (-1.0 / expm1(a)) / nc[i];
        if (dr)
            dr[i] = g * (1.0 / expm1(b)) / nr[i];
        rch += beta * a;
        rrej += beta * b;
        acc += beta * a > beta * b ? 1.0 : 0.0;
        mar += beta * a - beta * b;
    }
    if (dnll)
        *dnll = 1.0;
    m->loss = nll - beta * (sum_ratio / n);
    m->rewards_chosen = rch / n;
    m->rewards_rejected = rrej / n;
    m->rewards_accuracies = acc / n;
    m->rewards_margins = mar / n;
    m->logps_chosen = la / n;
    m->logps_rejected = lb / n;
    m->logps_accuracies = lacc / n;
    m->logps_margins = (la - lb) / n;
    m->nll_loss = nll;
    m->log_odds_ratio = sum_ratio / n;
    m->log_odds_chosen = sum_lo / n;
}

/* CPO, TRL 1.16.0 trl/experimental/cpo/cpo_trainer.py (cpo_loss with alpha 0,
 * get_batch_loss_metrics): logps are per-token averages for ipo and simpo, sums otherwise;
 * logits = a - b (simpo: minus simpo_gamma / beta), z = beta * logits, e = label_smoothing:
 *   sigmoid, simpo  -(1-e) logsigmoid(z) - e logsigmoid(-z)   dL/dz = -(1-e) sigmoid(-z) + e sigmoid(z)
 *   hinge           relu(1 - z)                               dL/dz = -1 if z < 1 else 0
 *   ipo             (logits - 1/(2 beta))^2                   dL/dlogits = 2 (.)
 * loss = mean L + cpo_alpha * nll (nll_loss 0 when cpo_alpha is 0: TRL skips it).
 * Metrics: rewards = beta * logps, logps = mean of the (averaged or summed) logps. */
static void cpo(const bt_pref_params *p, int n, const double *pc, const double *pr,
                const int32_t *nc, const int32_t *nr, double nll, double *dc, double *dr,
                double *dnll, bt_pref_metrics *m)
{
    const double beta = p->beta, e = p->label_smoothing;
    const bt_pref_loss_type t = p->loss_type[0];
    const int avg = t == BT_PREF_LOSS_IPO || t == BT_PREF_LOSS_SIMPO;
    const double shift = t == BT_PREF_LOSS_SIMPO ? p->simpo_gamma / beta : 0.0;
    double sum = 0, rch = 0, rrej = 0, acc = 0, mar = 0, la = 0, lb = 0, lacc = 0;
    for (int i = 0; i < n; i++) {
        const double a = avg ? pc[i] / nc[i] : pc[i], b = avg ? pr[i] / nr[i] : pr[i];
        lacc += a > b ? 1.0 : 0.0;
        const double lg = (a - b) - shift, z = beta * lg;
        double L, dLdlg;
        if (t == BT_PREF_LOSS_HINGE) {
            L = 1.0 - z > 0.0 ? 1.0 - z : 0.0;
            dLdlg = 1.0 - z > 0.0 ? -beta : 0.0;
        } else if (t == BT_PREF_LOSS_IPO) {
            const double u = lg - 1.0 / (2.0 * beta);
            L = u * u;
            dLdlg = 2.0 * u;
        } else {
            L = -(1.0 - e) * log_sigmoid(z) - e * log_sigmoid(-z);
            dLdlg = beta * (-(1.0 - e) * sigmoid(-z) + e * sigmoid(z));
        }
        sum += L;
        if (dc)
            dc[i] = dLdlg / n / (avg ? nc[i] : 1);
        if (dr)
            dr[i] = -dLdlg / n / (avg ? nr[i] : 1);
        rch += beta * a;
        rrej += beta * b;
        acc += beta * a > beta * b ? 1.0 : 0.0;
        mar += beta * a - beta * b;
        la += a;
        lb += b;
    }
    const double nll_used = p->cpo_alpha == 0.0 ? 0.0 : nll;
    if (dnll)
        *dnll = p->cpo_alpha;
    m->loss = sum / n + p->cpo_alpha * nll_used;
    m->rewards_chosen = rch / n;
    m->rewards_rejected = rrej / n;
    m->rewards_accuracies = acc / n;
    m->rewards_margins = mar / n;
    m->logps_chosen = la / n;
    m->logps_rejected = lb / n;
    m->logps_accuracies = lacc / n;
    m->logps_margins = (la - lb) / n;
    m->nll_loss = nll_used;
}

int bt_pref_pair_loss(const bt_pref_params *p, int n, const double *policy_chosen,
                      const double *policy_rejected, const double *ref_chosen,
                      const double *ref_rejected, const int32_t *chosen_tokens,
                      const int32_t *rejected_tokens, double nll, double *d_chosen,
                      double *d_rejected, double *d_nll, bt_pref_metrics *m)
{
    if (bt_pref_check(p, NULL, 0) != 0 || p->algo == BT_PREF_KTO || n < 1 || !policy_chosen ||
        !policy_rejected || !m)
        return -1;
    int need_ref = p->algo == BT_PREF_DPO, need_counts = p->algo == BT_PREF_ORPO;
    for (int k = 0; k < p->n_loss_types; k++)
        if (p->loss_type[k] == BT_PREF_LOSS_IPO || p->loss_type[k] == BT_PREF_LOSS_SIMPO)
            need_counts = 1;
    if ((need_ref && (!ref_chosen || !ref_rejected)) ||
        (need_counts && (!chosen_tokens || !rejected_tokens)))
        return -1;
    metrics_nan(m);
    if (d_nll)
        *d_nll = 0.0;
    switch (p->algo) {
    case BT_PREF_DPO:
        dpo(p, n, policy_chosen, policy_rejected, ref_chosen, ref_rejected, chosen_tokens,
            rejected_tokens, d_chosen, d_rejected, m);
        break;
    case BT_PREF_ORPO:
        orpo(p, n, policy_chosen, policy_rejected, chosen_tokens, rejected_tokens, nll, d_chosen,
             d_rejected, d_nll, m);
        break;
    default:
        cpo(p, n, policy_chosen, policy_rejected, chosen_tokens, rejected_tokens, nll, d_chosen,
            d_rejected, d_nll, m);
        break;
    }
    return 0;
}

double bt_kto_kl_mean(int n_kl, const double *policy_kl, const double *ref_kl)
{
    if (n_kl < 1 || !policy_kl || !ref_kl)
        return 0.0;
    double s = 0.0;
    for (int j = 0; j < n_kl; j++)
        s += policy_kl[j] - ref_kl[j];
    return s / n_kl;
}

/* KTO, TRL 1.16.0 trl/trainer/kto_trainer.py _compute_loss: r_i = policy_i - ref_i,
 * kl = max(kl_mean, 0) (detached), s = sigmoid:
 *   kto, desirable      w_d (1 - s(beta (r - kl)))     dL/dr = -w_d beta s(.) s(-.)
 *   kto, undesirable    w_u (1 - s(beta (kl - r)))     dL/dr = +w_u beta s(.) s(-.)
 *   apo_zero_unpaired   w_d (1 - s(beta r)) / w_u s(beta r), kl 0
 * loss = nanmean over the batch (NaN terms are dropped from the sum and the count); metrics
 * rewards/chosen = sum of beta r over desirable / their count (rejected alike), logps likewise
 * (nansum), margins = rewards/chosen - rewards/rejected when both exist, kl. No accuracies. */
int bt_kto_loss(const bt_pref_params *p, int n, const double *policy, const double *ref,
                const uint8_t *desirable, double kl_mean, double *d_policy, bt_pref_metrics *m)
{
    if (bt_pref_check(p, NULL, 0) != 0 || p->algo != BT_PREF_KTO || n < 1 || !policy || !ref ||
        !desirable || !m)
        return -1;
    metrics_nan(m);
    const double beta = p->beta;
    const int apo = p->loss_type[0] == BT_PREF_LOSS_APO_ZERO_UNPAIRED;
    /* torch clamp(min=0): NaN stays NaN */
    const double kl = apo ? 0.0 : (isnan(kl_mean) || kl_mean > 0.0 ? kl_mean : 0.0);
    double sum = 0.0;
    int cnt = 0, nch = 0, nrej = 0;
    double rch = 0, rrej = 0, lch = 0, lrej = 0;
    for (int i = 0; i < n; i++) {
        const double r = policy[i] - ref[i];
        double L, dL;
        if (desirable[i]) {
            const double x = apo ? beta * r : beta * (r - kl), s = sigmoid(x);
            L = p->desirable_weight * (1.0 - s);
            dL = -p->desirable_weight * beta * s * sigmoid(-x);
            nch++;
            if (!isnan(beta * r))
                rch += beta * r;
            if (!isnan(policy[i]))
                lch += policy[i];
        } else {
            const double x = apo ? beta * r : beta * (kl - r), s = sigmoid(x);
            L = apo ? p->undesirable_weight * s : p->undesirable_weight * (1.0 - s);
            dL = p->undesirable_weight * beta * s * sigmoid(-x);
            nrej++;
            if (!isnan(beta * r))
                rrej += beta * r;
            if (!isnan(policy[i]))
                lrej += policy[i];
        }
        if (d_policy)
            d_policy[i] = isnan(L) ? 0.0 : dL;
        if (!isnan(L)) {
            sum += L;
            cnt++;
        }
    }
    if (d_policy)
        for (int i = 0; i < n; i++)
            d_policy[i] = cnt > 0 ? d_policy[i] / cnt : 0.0;
    m->loss = cnt > 0 ? sum / cnt : NAN;
    m->kl = kl;
    if (nch > 0) {
        m->rewards_chosen = rch / nch;
        m->logps_chosen = lch / nch;
    }
    if (nrej > 0) {
        m->rewards_rejected = rrej / nrej;
        m->logps_rejected = lrej / nrej;
    }
    if (nch > 0 && nrej > 0)
        m->rewards_margins = m->rewards_chosen - m->rewards_rejected;
    return 0;
}
