/* The preference step (issue 25): DPO, ORPO, CPO / SimPO and KTO on the trainer's packed
 * micro-batches, between the loss functions (trainer/preference.h) and the backend's
 * log-prob passes (trainer/backend/backend.h logprobs / backward_logprobs).
 *
 * A micro-batch of a preference job (proto/batch.h layout 2) holds records: a pair is two adjacent
 * segments of one row, BT_SEG_CHOSEN then BT_SEG_REJECTED, with the same seg_pair; a KTO example
 * is one BT_SEG_KTO_DESIRABLE / _UNDESIRABLE segment. Each segment is a whole sequence, prompt
 * (labels -100) then response (labels = input_ids), so a record's summed log-prob is the sum of
 * the label log-probs of its segment (bt_seq_sum), the response tokens only. Plain segments are
 * padding and must carry no label.
 *
 * One optimiser step over the micro-batches mb_1 .. mb_G of every rank:
 *   1. bt_pref_step_count on each: records and NLL targets (summed over ranks by the caller);
 *   2. KTO only: bt_pref_step_kl on each (the KL sequences), summed over ranks -> kl_mean;
 *   3. bt_pref_step_begin with the global counts and kl_mean;
 *   4. bt_pref_step_micro on each: the reference sums (pref_ref_sums: the batch's own when
 *      loaderd supplies them, else a forward with the adapter off), the policy forward, the loss
 *      of the micro-batch's records and its gradient, dlogp per token, the backward;
 *   5. bt_pref_step_sums -> weighted sums (summed over ranks by the caller) -> bt_pref_metrics_of.
 * The gradient is that of the loss of the whole step as TRL averages it: the mean over the step's
 * records (pairs, or KTO examples) of all micro-batches and ranks; each micro-batch's loss (a mean
 * over its own records, bt_pref_pair_loss / bt_kto_loss) is weighted by its records / the step's.
 * The NLL terms (ORPO: every target of the chosen sequences, prompt included; CPO: their response
 * targets; torch CrossEntropyLoss "mean") are means over the step's NLL targets likewise. TRL
 * computes both per device micro-batch; with loaderd's packing a micro-batch holds as many
 * records as fit, so the step's mean is the one that does not depend on the packing.
 *
 * KTO's KL estimate (TRL's KTOTrainer: completions cycled by one within a batch, detached):
 * within each micro-batch the i-th KTO example's prompt (its segment's leading unlabelled tokens)
 * is joined with the completion (the rest) of example i-1 (the first with the last's), packed
 * into micro-batches of the same shape, scored by the policy (no dropout, no gradient) and the
 * reference; kl_mean = mean over the step's KL sequences of policy - reference, all ranks (TRL:
 * one estimate per micro-batch, gathered over ranks), clamped at 0 by bt_kto_loss. A KL sequence
 * longer than a row keeps its first T tokens.
 *
 * Evaluation uses the same calls without backward (bt_pref_step_micro backward 0) over the held-out
 * stream, with kl_mean known only at the end: the metrics are computed then, over every record. */
#ifndef BT_TRAINER_LOOP_PREF_STEP_H
#define BT_TRAINER_LOOP_PREF_STEP_H
#include <stdint.h>

#include "trainer/backend/backend.h"
#include "trainer/preference.h"

typedef struct bt_pref_step bt_pref_step;

/* A micro-batch of preference records: the packed tokens (mb) and layout 2's per-segment fields
 * (proto/batch.h), [mb.n_cu - 1] each: seg_kind (BT_SEG_*) and seg_pair (record index, -1 plain;
 * NULL both: every segment plain). ref_logps: the reference's summed log-prob of each segment
 * brought with the batch (loaderd's cached reference log-probs, layout 3 seg_ref_logp, issue 25:
 * TRL's precompute_ref_log_probs), used where ref_ok[k] is 1 (ref_ok NULL: every segment's);
 * NULL: every value computed by the step with the adapter off. */
typedef struct {
    bt_microbatch mb;
    const int32_t *seg_kind, *seg_pair;
    const double *ref_logps;
    const int32_t *ref_ok;
} bt_pref_batch;

/* What the records of micro-batches hold (added up over micro-batches, then ranks). */
typedef struct {
    double records;    /* pairs (dpo, orpo, cpo) or examples (kto) */
    double nll_tokens; /* ORPO: targets of the chosen sequences; CPO: their response targets */
} bt_pref_counts;

/* Weighted sums bt_pref_step_sums writes and bt_pref_metrics_of reads (after the caller summed
 * them over ranks). */
#define BT_PREF_NSUMS 16

/* A step over micro-batches of B x T tokens, vocabulary `vocab`, the validated parameters p
 * (copied; bt_pref_check). Owned buffers: the memory plan trainer/backend/plan.h bt_plan_pref
 * (118 bytes per token, 134 for KTO; `trainer estimate` bills the same), one allocation, plus
 * the step's records for its metrics (41 bytes per record). Errors: BT_ERR_INVALID (p
 * fails bt_pref_check), BT_ERR_NOMEM. */
int bt_pref_step_new(bt_pref_step **out, const bt_pref_params *p, int B, int T, int vocab);
void bt_pref_step_free(bt_pref_step *s); /* NULL: no-op */
/* Bytes of the step's planned buffers (= bt_plan_bytes of bt_plan_pref for B * T tokens); 0 for
 * NULL. */
size_t bt_pref_step_bytes(const bt_pref_step *s);

/* Checks mb's segments against the objective (pairs for dpo / orpo / cpo, KTO examples for kto,
 * plain segments without labels; bt_shift_targets' checks) and adds its records and NLL targets
 * into *add. Errors: BT_ERR_FORMAT naming the segment (e.g. a KTO example in a DPO step, a plain
 * segment with labels: data.format is not the objective's), those of bt_shift_targets. */
int bt_pref_step_count(bt_pref_step *s, const bt_pref_batch *pb, bt_pref_counts *add);

/* KTO: builds mb's KL sequences (see above) and adds sum(policy - reference) over them to kl[0],
 * their number to kl[1]. No gradient. Errors: the backend's. */
int bt_pref_step_kl(bt_pref_step *s, bt_backend *be, const bt_pref_batch *pb, double kl[2]);

/* Starts a step (or an evaluation): global = the step's counts over all micro-batches and ranks
 * (for the gradient scale; ignored without backward), kl_mean = the step's KL estimate (KTO). */
void bt_pref_step_begin(bt_pref_step *s, const bt_pref_counts *global, double kl_mean);

/* One micro-batch (already checked by bt_pref_step_count): log-probs, records kept for the
 * metrics, and with `backward` the gradients of (its records / global records) x its loss (+ its
 * share of the NLL mean) accumulated into the backend's LoRA gradients. The reference sums (DPO,
 * KTO) are pb->ref_logps when given, else a forward with the adapter off (pref_ref_sums, the one
 * place they come from).
 * drop_key: the policy pass's dropout key (0: none). Errors: the backend's (a stop request
 * included: the gradients then hold a partial sum), BT_ERR_NOMEM. */
int bt_pref_step_micro(bt_pref_step *s, bt_backend *be, const bt_pref_batch *pb, int backward,
                       uint64_t drop_key);

/* Declares the policy equal to the reference (on: the adapter is the identity, as a fresh LoRA
 * is before its first update: every lora_B zero, PEFT's init, nothing else trainable): from then
 * on until it is called with 0, bt_pref_step_micro without backward runs no policy forward for
 * DPO / KTO and scores each record with its reference sums as the policy's (the evaluation
 * before training: one forward per micro-batch instead of two, none when loaderd brought every
 * reference value), and bt_pref_step_kl adds 0 for each KL sequence without a forward (policy -
 * reference = 0). The caller vouches for the identity (pref_run.c checks the LoRA); a
 * training pass (backward) always runs the policy forward. Other objectives: no effect. */
void bt_pref_step_set_policy_is_ref(bt_pref_step *s, int on);
/* Policy forwards bt_pref_step_micro / bt_pref_step_kl skipped under
 * bt_pref_step_set_policy_is_ref since bt_pref_step_new. */
long long bt_pref_step_policy_skipped(const bt_pref_step *s);

/* After bt_pref_step_micro of a DPO / KTO micro-batch: *seg_ref <- the reference sums it used,
 * [n_cu - 1] (valid until the next call on s). Returns the number of record segments whose value
 * came with the batch (ref_ok) and sets *computed to those computed by a reference forward (0
 * when every record segment's value came with the batch: the forward was skipped). */
int bt_pref_step_ref_used(const bt_pref_step *s, const double **seg_ref, int *computed);

/* The records since bt_pref_step_begin as weighted sums (loss and metrics of this rank's records
 * times their count, the NLL sum and targets, KTO's desirable / undesirable counts), kl_mean the
 * KTO estimate to score them with. */
void bt_pref_step_sums(const bt_pref_step *s, double kl_mean, double sums[BT_PREF_NSUMS]);

/* The loss and TRL's metrics of sums added up over ranks (NaN where TRL logs nothing, as in
 * preference.h); m->loss is NaN when there was no record. */
void bt_pref_metrics_of(const bt_pref_params *p, const double sums[BT_PREF_NSUMS], double kl_mean,
                        bt_pref_metrics *m);

/* Records of the sums (pairs or examples). */
double bt_pref_sums_records(const double sums[BT_PREF_NSUMS]);

#endif
