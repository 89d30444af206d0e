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
    /* loaderd's cached reference log-probs (layout 3): all 0 unless the job has ref_base */
    pb->ref_logps = c->seg_ref_logp;
    pb->ref_ok = c->seg_ref_ok;
}

/* After bt_pref_step_micro of c: count the reference values taken / computed (into *hit, *miss)
 * and queue the computed ones of keyed segments (seg_line >= 1) for loaderd. */
static int ref_collect(bt_run *r, const bt_mb_copy *c, long long *hit, long long *miss) {
    const double *ref;
    int computed = 0;
    *hit += bt_pref_step_ref_used(r->pref, &ref, &computed);
    *miss += computed;
    if (!r->ref_base[0] || computed == 0) return 0;
    for (int k = 0; k + 1 < c->n_cu; k++) {
        if (c->seg_kind[k] == BT_SEG_PLAIN || c->seg_ref_ok[k] == 1 || c->seg_line[k] < 1 ||
            c->seg_src[k] < 0 || !(ref[k] <= 0 && ref[k] >= -1e9))
            continue; /* cached already, no key, or a value loaderd would refuse (not finite) */
        if (r->ref_n == r->ref_cap) {
            size_t cap = r->ref_cap ? 2 * r->ref_cap : 256;
            bt_ref_value *v = realloc(r->ref_pend, cap * sizeof *v);
            if (!v) return bt_fail(BT_ERR_NOMEM, "out of memory for reference log-probs");
            r->ref_pend = v;
            r->ref_cap = cap;
        }
        r->ref_pend[r->ref_n++] = (bt_ref_value){c->seg_src[k], c->seg_line[k],
                                                 bt_seg_ref_side(c->seg_kind[k]), ref[k]};
    }
    return 0;
}

void bt_pref_run_ref_flush(bt_run *r, bt_client *cl, const char *what) {
    if (r->ref_n == 0 || !cl) return;
    size_t acc = 0, rej = 0;
    int rc = bt_client_ref_put(cl, r->ref_base, r->ref_pend, r->ref_n, &acc, &rej);
    r->ref_acc += (long long)acc;
    r->ref_rej += (long long)rej;
    const int first = r->ref_put_fail == 0 && r->ref_rej == (long long)rej;
    if (rc) {
        r->ref_put_fail++;
        if (r->ref_put_fail == 1) /* once per run: the end-of-run line has the counts */
            bt_log(BT_LOG_WARN, "trainer", "%s: handing %zu reference log-probs to loaderd failed (they "
                   "are computed again when next needed; further failures are counted in the end-of-run "
                   "line): %s", what, r->ref_n, bt_last_error());
    } else if (rej > 0 && first) { /* once per run (without token_cache_dir loaderd keeps none) */
        bt_log(BT_LOG_WARN, "trainer", "%s: loaderd refused %zu of %zu reference log-probs (%lld refused "
               "so far; refused values are not kept; loaderd keeps values only for shards read through its "
               "token_cache_dir; further refusals are counted in the end-of-run line): %s", what, rej, r->ref_n,
               r->ref_rej, bt_last_error());
    }
    r->ref_n = 0;
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
    r->ref_hit_step = r->ref_miss_step = 0;
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
        if ((rc = ref_collect(r, &r->mbs[i], &r->ref_hit_step, &r->ref_miss_step))) return rc;
    }
    r->ref_hit += r->ref_hit_step;
    r->ref_miss += r->ref_miss_step;
    bt_pref_run_ref_flush(r, r->cl, "train");
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

/* 1 when lo adds nothing to the base: every targeted module's lora_B [out, r] is all zeros
 * (PEFT's init: B = 0, so scale * B A x = 0 whatever A) and nothing else is trainable (LoRA+
 * copies of the embedding / norms may have been trained); then the policy's log-probs are the
 * reference's (the base with the adapter disabled). */
static int lora_is_identity(const bt_lora *lo) {
    if (!lo->mods || lo->trainable) return 0;
    for (int l = 0; l < lo->n_layer; l++)
        for (int mod = 0; mod < BT_MOD_N; mod++) {
            const bt_lora_mod *md = bt_lora_get(lo, l, mod);
            if (!md || !md->B) continue;
            for (size_t i = 0; i < (size_t)md->out * (size_t)lo->r; i++)
                if (md->B[i] != 0.0f) return 0;
        }
    return 1;
}

int bt_pref_run_eval(bt_run *r, bt_pref_metrics *m, long long *n_records, int *interrupted) {
    const bt_train_config *cfg = r->cfg;
    const int B = cfg->data.micro_batch_size, T = cfg->data.seq_len;
    bt_client *cl = NULL;
    bt_mb_copy mc = {0};
    int cut = 0, nb = 0;
    double kl[2] = {0, 0}, t0 = bt_now(), c0 = bt_cpu_s();
    *n_records = 0;
    if (interrupted) *interrupted = 0;
    bt_pref_step_begin(r->pref, NULL, 0.0);
    /* before any update of this process (the evaluation before training, `trainer eval` of the
     * base): a fresh adapter is the identity and the reference's log-probs are the policy's, so
     * each batch costs one forward (none with cached reference values). Checked on the host's
     * LoRA, which is the backend's until the first step. */
    const long long skip0 = bt_pref_step_policy_skipped(r->pref);
    const int ident = r->done_steps == r->start_step && r->start_step == 0 && lora_is_identity(&r->lora);
    bt_pref_step_set_policy_is_ref(r->pref, ident);
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
        if (!rc && (rc = ref_collect(r, &mc, &r->ref_eval_hit, &r->ref_eval_miss)) == 0)
            bt_pref_run_ref_flush(r, cl, "eval");
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
    r->ref_n = 0; /* values of a batch cut short are dropped with it */
    bt_pref_step_set_policy_is_ref(r->pref, 0);
    const long long skipped = bt_pref_step_policy_skipped(r->pref) - skip0;
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
               "rewards/margins %.4f, logps/accuracies %.4f, logps/margins %.4f (%.1f s, CPU %.1f s%s)",
               cut ? " (partial, interrupted)" : "", nb, *n_records,
               cfg->pref.algo == BT_PREF_KTO ? "examples" : "pairs", m->loss,
               cfg->pref.algo == BT_PREF_KTO ? "kl" : "rewards/accuracies",
               cfg->pref.algo == BT_PREF_KTO ? m->kl : m->rewards_accuracies, m->rewards_margins,
               m->logps_accuracies, m->logps_margins, bt_now() - t0, bt_cpu_s() - c0,
               skipped > 0 ? "; the adapter is the identity: policy = reference, its forward skipped" : "");
    return 0;
}

/* "| acc 0.62 | margin 0.031 | lp-acc 0.71" (pairs) or "| kl 0.012 | margin 0.031" (KTO): TRL's
 * rewards/accuracies and rewards/margins, then our logps/accuracies, for the progress line. */
void bt_pref_short(char *buf, size_t n, const bt_train_config *cfg, const bt_pref_metrics *m) {
    if (cfg->pref.algo == BT_PREF_KTO)
        snprintf(buf, n, " | kl %.4f | margin %.4f", m->kl, m->rewards_margins);
    else
        snprintf(buf, n, " | acc %.2f | margin %.4f | lp-acc %.2f", m->rewards_accuracies,
                 m->rewards_margins, m->logps_accuracies);
}
