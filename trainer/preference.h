/* Preference losses (DPO, ORPO, CPO / SimPO, KTO) on per-sequence log-probs: loss, its gradient
 * with respect to each sequence's log-prob (and the NLL term), and TRL's metrics. CPU reference in
 * double; the per-sequence log-probs come from the fused chunked linear + cross-entropy
 * (bt_linear_logprob + bt_seq_sum, kernels/kernels.h), and the per-token gradient handed back to
 * it is the per-sequence gradient here, copied to every response token of the sequence.
 *
 * Names, defaults and formulas are TRL 1.16.0's (pinned in python/requirements-torch.txt):
 *   DPO   trl/trainer/dpo_trainer.py  DPOTrainer._compute_loss,  trl/trainer/dpo_config.py
 *   ORPO  trl/experimental/orpo/orpo_trainer.py  odds_ratio_loss, get_batch_loss_metrics, log1mexp
 *   CPO   trl/experimental/cpo/cpo_trainer.py  cpo_loss, get_batch_loss_metrics (SimPO is CPO's
 *         loss_type "simpo", as in TRL's SimPO recipe: cpo_alpha 0 for pure SimPO)
 *   KTO   trl/trainer/kto_trainer.py  KTOTrainer._compute_loss, trl/trainer/kto_config.py
 * and are checked against those functions, run by tests/reference/gen_preference_fixtures.py, in
 * tests/unit/trainer/test_preference.c (fixture tests/fixtures/preference/trl_losses.json).
 *
 * It sits beside the job config (trainer/config.h holds a resolved bt_pref_params and checks it
 * with bt_pref_check), below the run that calls it (trainer/loop/pref_step.h).
 *
 * Inputs are "summed log-probs": the sum over a sequence's response (completion) tokens of the
 * label log-probs, in nats (TRL's `per_token_logps.sum(dim=1)` with labels -100 outside the
 * completion). Where TRL averages per token (ORPO always; CPO's ipo and simpo; DPO's ipo) the
 * response token counts are passed too, and the average is taken here (TRL's get_batch_logps
 * `average_log_prob=True`: sum / count), so that every gradient is with respect to the SUM: the
 * caller's per-token upstream gradient is the sequence's value for every response token.
 *
 * Differences from TRL 1.16.0 on purpose: parameters are validated (bt_pref_check: beta > 0 and
 * finite, label_smoothing in TRL's documented range, weights >= 0) where TRL divides by them
 * unchecked; CPO's AlphaPO `alpha` (!= 0) and DPO's ld_alpha, f_divergence_type other than
 * reverse_kl, use_weighting and the loss types not listed below are not implemented. In TRL 1.16.0
 * DPO's "sigmoid" does not use label_smoothing (it did in TRL 0.x, as cDPO): label_smoothing
 * acts in "robust" and "exo_pair" only, and in every CPO loss of the sigmoid family. */
#ifndef BT_TRAINER_PREFERENCE_H
#define BT_TRAINER_PREFERENCE_H
#include <stdint.h>

typedef enum { BT_PREF_DPO = 0, BT_PREF_ORPO, BT_PREF_CPO, BT_PREF_KTO } bt_pref_algo;

/* loss_type values, TRL's strings (bt_pref_loss_type_name / _parse). */
typedef enum {
    BT_PREF_LOSS_SIGMOID = 0,   /* DPO, CPO: -logsigmoid(beta * delta) (CPO: label-smoothed) */
    BT_PREF_LOSS_HINGE,         /* DPO, CPO: relu(1 - beta * delta) */
    BT_PREF_LOSS_IPO,           /* DPO, CPO: (per-token delta - 1 / (2 beta))^2 */
    BT_PREF_LOSS_ROBUST,        /* DPO: Robust DPO (label_smoothing = flip probability) */
    BT_PREF_LOSS_EXO_PAIR,      /* DPO: EXO-pref (label_smoothing = epsilon > 0) */
    BT_PREF_LOSS_SIMPO,         /* CPO: SimPO, per-token average, margin simpo_gamma */
    BT_PREF_LOSS_ORPO,          /* ORPO: its one loss (odds ratio + NLL) */
    BT_PREF_LOSS_KTO,           /* KTO: eqn (7) of the KTO paper, batch KL estimate */
    BT_PREF_LOSS_APO_ZERO_UNPAIRED, /* KTO: APO-zero, unpaired (no KL term) */
    BT_PREF_LOSS_COUNT
} bt_pref_loss_type;

#define BT_PREF_MAX_LOSS_TYPES 4

typedef struct {
    bt_pref_algo algo;
    /* DPO may combine several loss types: loss = sum_k loss_weights[k] * mean(loss_k) (TRL's
     * list-valued `loss_type` and `loss_weights`, weights default 1). Other algorithms use
     * exactly one. */
    int n_loss_types;
    bt_pref_loss_type loss_type[BT_PREF_MAX_LOSS_TYPES];
    double loss_weights[BT_PREF_MAX_LOSS_TYPES];
    double beta;               /* all: 0.1 */
    double label_smoothing;    /* DPO robust/exo_pair, CPO sigmoid/simpo: 0.0 */
    double simpo_gamma;        /* CPO simpo: 0.5 */
    double cpo_alpha;          /* CPO: weight of the chosen NLL term, 1.0 */
    double desirable_weight;   /* KTO: 1.0 */
    double undesirable_weight; /* KTO: 1.0 */
} bt_pref_params;

/* TRL 1.16.0's defaults for `algo`: DPOConfig loss_type ["sigmoid"], beta 0.1, label_smoothing 0;
 * ORPOConfig beta 0.1; CPOConfig loss_type "sigmoid", beta 0.1, label_smoothing 0, cpo_alpha 1,
 * simpo_gamma 0.5; KTOConfig loss_type "kto", beta 0.1, desirable/undesirable_weight 1. */
void bt_pref_defaults(bt_pref_params *p, bt_pref_algo algo);

/* "dpo", "orpo", "cpo", "simpo" (CPO with loss_type simpo and cpo_alpha 0, TRL's SimPO recipe:
 * *simpo_preset set to 1 when given), "kto"; -1 when unknown. */
int bt_pref_algo_parse(const char *name, int *simpo_preset);
const char *bt_pref_algo_name(bt_pref_algo algo);
/* TRL's loss_type string for `algo` ("sigmoid", "hinge", "ipo", "robust", "exo_pair", "simpo",
 * "kto", "apo_zero_unpaired"; ORPO has none and accepts "orpo"); -1 when the string is not a
 * loss type of that algorithm. */
int bt_pref_loss_type_parse(bt_pref_algo algo, const char *name);
const char *bt_pref_loss_type_name(bt_pref_loss_type t);

/* 0 when p is usable; else -1 with a one-line reason (naming the TRL key) in err[errlen]:
 * beta > 0 and finite; each loss type belongs to the algorithm; 1 <= n_loss_types <=
 * BT_PREF_MAX_LOSS_TYPES (exactly 1 except DPO); loss_weights >= 0 and finite; label_smoothing
 * in [0, 0.5) for robust (TRL's check), in (0, 1) for exo_pair (TRL refuses 0; log(epsilon)),
 * in [0, 1] otherwise; simpo_gamma finite; cpo_alpha, desirable_weight, undesirable_weight
 * >= 0 and finite. */
int bt_pref_check(const bt_pref_params *p, char *err, int errlen);

/* Metrics with TRL's names: rewards/chosen, rewards/rejected, rewards/accuracies,
 * rewards/margins, logps/chosen, logps/rejected (means over the batch), plus the extra ones each
 * TRL trainer logs: nll_loss (ORPO, CPO), log_odds_ratio and log_odds_chosen (ORPO), kl (KTO).
 * A field that the algorithm does not log is NaN (rewards/accuracies for KTO; KTO's chosen-side
 * metrics when the batch has no desirable example, rejected-side ones when it has no undesirable
 * one, margins unless it has both: TRL appends nothing then).
 * Ours, not TRL's (paired algorithms only; NaN for KTO): logps/accuracies = share of pairs whose
 * POLICY log-prob of the chosen response exceeds that of the rejected one, and logps/margins = mean
 * over pairs of (chosen - rejected) policy log-prob, both on the log-probs as logps/chosen and
 * logps/rejected log them (sums for DPO and CPO sigmoid / hinge; per-token averages for ORPO and
 * CPO ipo / simpo). Unlike rewards/accuracies (0 at step 0 by construction, policy = reference)
 * it says whether the model itself prefers the chosen answer, before training as after (issue 25
 * §4). A tie counts as not preferred, like TRL's strict `>` for rewards/accuracies. */
typedef struct {
    double loss;
    double rewards_chosen, rewards_rejected, rewards_accuracies, rewards_margins;
    double logps_chosen, logps_rejected;
    double logps_accuracies, logps_margins; /* ours, see above */
    double nll_loss, log_odds_ratio, log_odds_chosen, kl;
} bt_pref_metrics;

/* Paired batch (DPO, ORPO, CPO), n >= 1 pairs, all arrays [n], caller owned:
 *   policy_chosen, policy_rejected: summed response log-probs under the policy (adapter on);
 *   ref_chosen, ref_rejected: the same under the reference (adapter off); DPO only (may be NULL
 *     for ORPO and CPO, which have no reference);
 *   chosen_tokens, rejected_tokens: response token counts; needed for DPO ipo, ORPO and CPO ipo /
 *     simpo (the per-token averages; TRL clamps the count at 1 for DPO ipo and divides
 *     unclamped elsewhere, so a 0 there gives a non-finite loss, as in TRL), may be NULL else;
 *   nll: ORPO / CPO: the chosen sequences' mean token NLL (torch CrossEntropyLoss "mean" over the
 *     chosen rows of the batch; ORPO over prompt + response tokens, CPO over the response
 *     tokens; the caller computes it with bt_linear_ce), ignored for DPO (and for CPO when
 *     cpo_alpha is 0, where TRL does not compute it and logs nll_loss 0).
 * Outputs (caller owned, [n]): d_chosen[i] = dloss / dpolicy_chosen[i], d_rejected[i] = dloss /
 * dpolicy_rejected[i] (summed log-probs; the reference gets no gradient); *d_nll = dloss / dnll
 * (ORPO 1, CPO cpo_alpha, DPO 0); any output pointer may be NULL; *m gets the loss and metrics.
 * Returns 0, or -1 when p fails bt_pref_check, p->algo is KTO, n < 1, or a needed array is NULL
 * (nothing written then). A non-finite input gives a non-finite loss, as in TRL; it is the
 * caller's job to skip such a step. */
int bt_pref_pair_loss(const bt_pref_params *p, int n, const double *policy_chosen,
                      const double *policy_rejected, const double *ref_chosen,
                      const double *ref_rejected, const int32_t *chosen_tokens,
                      const int32_t *rejected_tokens, double nll, double *d_chosen,
                      double *d_rejected, double *d_nll, bt_pref_metrics *m);

/* KTO's batch KL estimate before the clamp: mean over the n_kl mismatched (prompt, completion)
 * sequences of policy_kl[j] - ref_kl[j] (summed log-probs; TRL cycles the completions of the
 * batch by one to build them). Detached: no gradient flows through it. A data-parallel caller
 * averages this over ranks (TRL gathers the per-rank means) before bt_kto_loss. 0 when n_kl < 1. */
double bt_kto_kl_mean(int n_kl, const double *policy_kl, const double *ref_kl);

/* KTO on an unpaired batch of n >= 1 examples ([n] arrays): policy, ref = summed completion
 * log-probs; desirable[i] != 0 for label True. kl_mean = bt_kto_kl_mean (rank-averaged), clamped
 * at 0 here (TRL: `.clamp(min=0)`); ignored for apo_zero_unpaired (TRL's calculate_KL is false:
 * kl 0). loss = nanmean over the n examples of desirable_weight * (1 - sigmoid(beta * (r_i -
 * kl))) for desirable, undesirable_weight * (1 - sigmoid(beta * (kl - r_i))) for undesirable,
 * r_i = policy_i - ref_i. d_policy[i] = dloss / dpolicy[i] (may be NULL). Returns 0, or -1
 * (nothing written) when p fails bt_pref_check, is not KTO, n < 1 or an array is NULL. */
int bt_kto_loss(const bt_pref_params *p, int n, const double *policy, const double *ref,
                const uint8_t *desirable, double kl_mean, double *d_policy, bt_pref_metrics *m);

#endif
