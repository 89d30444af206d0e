/* A preference run's step and held-out evaluation on the run's micro-batches (trainer/loop/run.h
 * "pref_run.c"): the run-level side of trainer/loop/pref_step.h, with the sums over ranks. Called
 * by train.c (the step) and eval.c (the evaluation); calls batches.c and run.c. */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "trainer/loop/run.h"

void bt_pref_view(const bt_mb_copy *c, int B, int T, bt_pref_batch *pb) {
    bt_mb_view(c, B, T, &pb->mb);
    pb->seg_kind = c->seg_kind;
    pb->seg_pair = c->seg_pair;
    pb->ref_logps = NULL; /* loaderd's cached reference log-probs: not served yet (issue 25) */
}

int bt_pref_run_count(bt_run *r, const bt_mb_copy *c, bt_pref_counts *add) {
    bt_pref_batch pb;
    bt_pref_view(c, r->B, r->T, &pb);
    return bt_pref_step_count(r->pref, &pb, add);
}

/* KTO: the step's KL estimate over the micro-batches of every rank (mean of policy - reference
 * over all KL sequences); 0 for the other objectives. */
static int kl_of(bt_run *r, int n_mb, bt_mb_copy *mbs, double *kl_mean) {
    double kl[2] = {0, 0};
    *kl_mean = 0;
    if (r->cfg->pref.algo != BT_PREF_KTO) return 0;
    for (int i = 0; i < n_mb; i++) {
        bt_pref_batch pb;
        bt_pref_view(&mbs[i], r->B, r->T, &pb);
        int rc = bt_pref_step_kl(r->pref, r->be, &pb, kl);
        if (rc) return rc;
    }
    int rc = bt_run_dist_sum(r, kl, 2);
    if (rc) return rc;
    *kl_mean = kl[1] > 0 ? kl[0] / kl[1] : 0.0;
    return 0;
}

int bt_pref_run_backward(bt_run *r, int step) {
    const int G = r->cfg->grad_accum;
    double kl_mean = 0;
    r->at_mb = 1;
    int rc = kl_of(r, G, r->mbs, &kl_mean);
    if (rc) return rc;
    r->pref_kl = kl_mean;
    bt_pref_step_begin(r->pref, &r->pref_global, kl_mean);
    for (int i = 0; i < G; i++) {
        bt_pref_batch pb;
        bt_pref_view(&r->mbs[i], r->B, r->T, &pb);
        r->at_mb = i + 1;
        if ((rc = bt_pref_step_micro(r->pref, r->be, &pb, 1, bt_run_drop_key(r, step, i))))
            return rc;
    }
    return 0;
}

int bt_pref_run_metrics(bt_run *r, double kl_mean, bt_pref_metrics *m, double *records) {
    double sums[BT_PREF_NSUMS];
    bt_pref_step_sums(r->pref, kl_mean, sums);
    int rc = bt_run_dist_sum(r, sums, BT_PREF_NSUMS);
    if (rc) return rc;
    bt_pref_metrics_of(&r->cfg->pref, sums, kl_mean, m);
    if (records) *records = bt_pref_sums_records(sums);
    return 0;
}

int bt_pref_run_eval(bt_run *r, bt_pref_metrics *m, long long *n_records, int *interrupted) {
    const bt_train_config *cfg = r->cfg;
    const int B = cfg->data.micro_batch_size, T = cfg->data.seq_len;
    bt_client *cl = NULL;
    bt_mb_copy mc = {0};
    int cut = 0, nb = 0;
    double kl[2] = {0, 0}, t0 = bt_now();
    *n_records = 0;
    if (interrupted) *interrupted = 0;
    bt_pref_step_begin(r->pref, NULL, 0.0);
    int rc = bt_run_attach(r, &cl, cfg, 1, NULL); /* the eval stream restarts every time */
    if (!rc) rc = bt_mb_alloc(&mc, B, T);
    while (!rc && (cfg->eval.max_batches == 0 || nb < cfg->eval.max_batches)) {
        rc = bt_run_next_batch(r, cl, cfg, &mc, "eval");
        if (rc == 1 || rc == 2) {
            cut = rc == 2;
            rc = 0;
            break;
        }
        if (rc) break;
        bt_pref_batch pb;
        bt_pref_view(&mc, B, T, &pb);
        if (cfg->pref.algo == BT_PREF_KTO) rc = bt_pref_step_kl(r->pref, r->be, &pb, kl);
        if (!rc) rc = bt_pref_step_micro(r->pref, r->be, &pb, 0, 0);
        if (rc == BT_ERR_CANCELLED) { /* mid-batch: the metrics cover the batches before it */
            cut = 1;
            rc = 0;
            break;
        }
        if (rc) break;
        nb++;
        if (atomic_load(&bt_run_stop_sig) && (cfg->eval.max_batches == 0 || nb < cfg->eval.max_batches)) {
            cut = 1;
            break;
        }
    }
    bt_mb_free(&mc);
    bt_client_close(cl);
    if (cut && r->dist.world > 1) return bt_run_stop_error(r); /* every rank stops: no collective */
    if (r->dist.world > 1) { /* a rank whose evaluation failed still takes part */
        double v[5] = {kl[0], kl[1], cut, nb, rc != 0};
        int rc2 = bt_run_dist_sum(r, v, 5);
        if (!rc && rc2) rc = rc2;
        if (!rc && v[4] > 0) rc = bt_fail(BT_ERR_IO, "held-out evaluation failed on another rank (see its log)");
        kl[0] = v[0], kl[1] = v[1], cut = v[2] > 0, nb = (int)v[3];
    }
    if (rc) return rc;
    const double kl_mean = kl[1] > 0 ? kl[0] / kl[1] : 0.0;
    double recs = 0;
    if ((rc = bt_pref_run_metrics(r, kl_mean, m, &recs))) return rc;
    if (interrupted) *interrupted = cut;
    *n_records = (long long)recs;
    if (recs == 0 && !cut)
        return bt_fail(BT_ERR_INVALID, "the held-out stream (eval.shards) gave no preference record "
                       "in %d batches", nb);
    if (recs > 0 && !isfinite(m->loss))
        return bt_fail(BT_ERR_DIVERGED, "held-out evaluation: the %s loss is %g, not a number: the model "
                       "gives non-finite log-probs", cfg->objective, m->loss);
    if (r->dist.rank == 0 && recs > 0)
        bt_log(BT_LOG_INFO, "trainer", "held-out%s: %d batches, %lld %s, loss %.4f, %s %.4f, "
               "rewards/margins %.4f (%.1f s)", cut ? " (partial, interrupted)" : "", nb, *n_records,
               cfg->pref.algo == BT_PREF_KTO ? "examples" : "pairs", m->loss,
               cfg->pref.algo == BT_PREF_KTO ? "kl" : "rewards/accuracies",
               cfg->pref.algo == BT_PREF_KTO ? m->kl : m->rewards_accuracies, m->rewards_margins,
               bt_now() - t0);
    return 0;
}

/* "| acc 0.62 | margin 0.031" (pairs) or "| kl 0.012 | margin 0.031" (KTO), TRL's
 * rewards/accuracies and rewards/margins, for the progress line. */
void bt_pref_short(char *buf, size_t n, const bt_train_config *cfg, const bt_pref_metrics *m) {
    if (cfg->pref.algo == BT_PREF_KTO)
        snprintf(buf, n, " | kl %.4f | margin %.4f", m->kl, m->rewards_margins);
    else
        snprintf(buf, n, " | acc %.2f | margin %.4f", m->rewards_accuracies, m->rewards_margins);
}
