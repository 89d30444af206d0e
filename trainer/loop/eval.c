/* Held-out evaluation: one pass over the eval stream (bt_eval_heldout), or one per length over
 * whole-window documents (bt_eval_lengths), on the run's backend. See trainer/loop/run.h. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "trainer/loop/run.h"

/* Labels of segments shorter than `full` tokens become -100 (in place), so that only whole
 * `full`-token windows count; returns the number of whole windows: segments of exactly `full`
 * tokens that carry labels (a padding row is a `full`-token segment without any). full = 0:
 * nothing changes, returns 0. */
static int keep_full_windows(bt_mb_copy *c, int M, int full) {
    if (full <= 0) return 0;
    int n = 0;
    for (int i = 0; i + 1 < c->n_cu; i++) {
        const int a = c->cu[i], b = c->cu[i + 1];
        if (b - a == full) {
            int labelled = 0;
            for (int t = a; t < b && t < M && !labelled; t++) labelled = c->labels[t] != -100;
            n += labelled;
            continue;
        }
        for (int t = a; t < b && t < M; t++) c->labels[t] = -100;
    }
    return n;
}

/* Drop the trailing rows of mb that carry no label (each row starts a segment, so the rows
 * before them are unaffected); returns the rows left (0: nothing to compute). */
static int trim_unlabelled_rows(bt_microbatch *mb) {
    int rows = mb->B;
    while (rows > 0) {
        int labelled = 0;
        for (int t = (rows - 1) * mb->T; t < rows * mb->T && !labelled; t++)
            labelled = mb->labels[t] != -100;
        if (labelled) break;
        rows--;
    }
    if (rows > 0 && rows < mb->B) {
        int n = 0;
        while (n < mb->n_cu && mb->cu_seqlens[n] < rows * mb->T) n++;
        /* cu_seqlens[n] == rows * T: a row start is always a boundary */
        mb->n_cu = n + 1;
        mb->B = rows;
    }
    return rows;
}

/* dist.shard_base: every forward pass all-gathers the frozen base layer by layer (collectives),
 * so the ranks, whose shares of the held-out stream differ by a batch (and whose batches without
 * labels are skipped), run their passes in rounds: before each pass a rank says it has one (an
 * all-reduce of 1); a rank out of batches says 0 and runs a 1-token pass without labels (no loss)
 * in every round some rank still has a pass, until a round where none has. */
static int shard_level(const bt_run *r, const bt_train_config *cfg) {
    return r->dist.world > 1 && cfg->dist.shard_base && cfg->device == BT_DEVICE_CUDA;
}

/* One round: *any = some rank has a pass this round (have: this rank has). */
static int shard_round(bt_run *r, int have, int *any) {
    double v = have;
    int rc = bt_run_dist_sum(r, &v, 1);
    *any = v > 0;
    return rc;
}

/* After this rank's last pass: label-free passes while the others still have theirs. */
static int shard_catch_up(bt_run *r, bt_backend *be) {
    static const int32_t ids[1] = {0}, labels[1] = {-100}, pos[1] = {0}, cu[2] = {0, 1};
    const bt_microbatch mb = {1, 1, ids, labels, pos, cu, 2};
    for (;;) {
        int any, rc = shard_round(r, 0, &any);
        if (rc || !any) return rc;
        double ls;
        int nv;
        if ((rc = bt_backend_step(be, &mb, 0, 1.0f, 0, &ls, &nv))) return rc;
    }
}

/* One pass over cfg's held-out stream (cfg->data.seq_len x micro_batch_size rows) on backend be.
 * full > 0: only segments of exactly `full` tokens carry loss (per-length evaluation). Sums (over
 * all ranks) into *sum / *cnt / *windows; *cut = interrupted by a signal. */
static int eval_stream(bt_run *r, const bt_train_config *cfg, bt_backend *be, int full,
                       double *sum_out, long long *cnt_out, long long *windows_out, int *cut_out,
                       int *nb_out) {
    int cut = 0;
    bt_client *cl = NULL;
    bt_mb_copy mc = {0};
    double sum = 0;
    long long cnt = 0, windows = 0;
    int nb = 0;
    const int level = shard_level(r, cfg);
    const int B = cfg->data.micro_batch_size, T = cfg->data.seq_len;
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
        windows += keep_full_windows(&mc, B * T, full);
        bt_microbatch mb;
        bt_mb_view(&mc, B, T, &mb);
        /* rows after the last labelled one (the last batch's padding rows, or rows whose only
         * segments are shorter than a window) change no loss: not computed */
        if (trim_unlabelled_rows(&mb) == 0) {
            nb++;
            continue;
        }
        double ls;
        int nv;
        int any;
        if (level && (rc = shard_round(r, 1, &any))) break;
        rc = bt_backend_step(be, &mb, 0, 1.0f, 0, &ls, &nv);
        if (rc == BT_ERR_CANCELLED) { /* mid-batch: that batch does not count */
            cut = 1;
            rc = 0;
            break;
        }
        if (rc) break;
        if (!isfinite(ls)) { /* never reported as a loss (issue 21 §6): the weights overflow */
            rc = bt_fail(BT_ERR_DIVERGED, "held-out evaluation: batch %d: the loss is %g, not a number: the model%s%s "
                         "gives non-finite logits (weights, or lora_alpha / r, that overflow fp32); no held-out "
                         "loss to report", nb + 1, ls, cfg->eval_adapter ? " with adapter " : "",
                         cfg->eval_adapter ? cfg->eval_adapter : "");
            break;
        }
        sum += ls;
        cnt += nv;
        nb++;
        bt_log(BT_LOG_DEBUG, "trainer", "held-out batch %d: %d labelled tokens", nb, nv);
        if (atomic_load(&bt_run_stop_sig) && (cfg->eval.max_batches == 0 || nb < cfg->eval.max_batches)) {
            cut = 1;
            break;
        }
    }
    if (cut && r->dist.world > 1) { /* every rank stops (relayed): no collective any more */
        rc = bt_run_stop_error(r);
        goto out;
    }
    if (rc) bt_log(BT_LOG_ERROR, "trainer", "held-out evaluation: %s", bt_last_error()); /* before a
                                                                                          * collective's message */
    if (level) { /* a rank whose evaluation failed catches up too, as it takes part in the sum below */
        const int rc2 = shard_catch_up(r, be);
        if (!rc) rc = rc2;
    }
    /* every rank evaluated its own share of the held-out stream: add them up (a collective; a
     * rank whose evaluation failed still takes part, so that none of the others waits forever) */
    if (r->dist.world > 1) {
        double v[6] = {sum, (double)cnt, cut, nb, rc != 0, (double)windows};
        int rc2 = bt_run_dist_sum(r, v, 6);
        if (!rc && rc2) rc = rc2;
        if (!rc && v[4] > 0)
            rc = bt_fail(BT_ERR_IO, "held-out evaluation failed on another rank (see its log)");
        sum = v[0];
        cnt = (long long)v[1];
        cut = v[2] > 0;
        nb = (int)v[3];
        windows = (long long)v[5];
    }
out:
    bt_mb_free(&mc);
    bt_client_close(cl);
    *sum_out = sum;
    *cnt_out = cnt;
    *windows_out = windows;
    *cut_out = cut;
    *nb_out = nb;
    return rc;
}

int bt_eval_heldout(bt_run *r, double *mean_loss, long long *n_tokens, int *interrupted) {
    const bt_train_config *cfg = r->cfg;
    *mean_loss = NAN;
    *n_tokens = 0;
    double sum, t0 = bt_now();
    long long cnt, windows;
    int cut, nb;
    int rc = eval_stream(r, cfg, r->be, 0, &sum, &cnt, &windows, &cut, &nb);
    if (rc) return rc;
    if (interrupted) *interrupted = cut;
    if (cnt == 0 && cut) {
        bt_log(BT_LOG_WARN, "trainer", "held-out evaluation interrupted before any batch");
        return 0;
    }
    if (cnt == 0)
        return bt_fail(BT_ERR_INVALID, "the held-out stream (eval.shards) gave no labelled "
                       "tokens in %d batches", nb);
    *mean_loss = sum / (double)cnt;
    *n_tokens = cnt;
    if (r->dist.rank == 0)
        bt_log(BT_LOG_INFO, "trainer", "held-out%s: %d batches, %lld labelled tokens, loss %.4f "
               "(%.1f s)", cut ? " (partial, interrupted)" : "", nb, cnt, *mean_loss, bt_now() - t0);
    return 0;
}

int bt_eval_lengths(bt_run *r, bt_eval_length *res, int *interrupted) {
    const bt_train_config *cfg = r->cfg;
    const int max_M = r->M;
    int rc = 0, cut = 0;
    if (interrupted) *interrupted = 0;
    for (int i = 0; i < cfg->eval.n_lengths && !rc && !cut; i++) {
        const int L = cfg->eval.lengths[i];
        bt_eval_length *e = &res[i];
        memset(e, 0, sizeof *e);
        e->length = L;
        e->loss = NAN;
        /* the same stream at row length L (loaderd splits text documents into consecutive
         * L-token pieces): as many rows as the training workspace holds, else one row in a
         * forward-only workspace of its own (the CPU's; the GPU's is fixed) */
        bt_train_config c = *cfg;
        char name[600];
        snprintf(name, sizeof name, "%s-L%d", cfg->name, L);
        c.name = name;
        c.data.seq_len = L;
        c.data.micro_batch_size = L <= max_M ? max_M / L : 1;
        if (c.data.micro_batch_size > 64) c.data.micro_batch_size = 64;
        bt_backend *ebe = r->be;
        if (L > max_M) {
            /* a workspace of its own for this long forward, with the run's stop check before
             * every layer (the GPU's cannot grow: refused naming the keys) */
            if ((rc = bt_backend_eval_workspace(r->be, L, &ebe))) break;
        }
        double sum, t0 = bt_now();
        long long cnt, windows;
        int nb;
        rc = eval_stream(r, &c, ebe, L, &sum, &cnt, &windows, &cut, &nb);
        if (ebe != r->be) bt_backend_free(ebe);
        if (rc) break;
        e->windows = windows;
        e->tokens = cnt;
        if (cnt > 0) e->loss = sum / (double)cnt;
        if (r->dist.rank == 0)
            bt_log(BT_LOG_INFO, "trainer", "held-out at %d tokens%s: %lld windows, %lld labelled "
                   "tokens, loss %.4f, perplexity %.3f (%.1f s)", L,
                   cut ? " (partial, interrupted)" : "", windows, cnt, e->loss, exp(e->loss),
                   bt_now() - t0);
        if (cnt == 0 && !cut)
            bt_log(BT_LOG_WARN, "trainer", "held-out at %d tokens: no document has %d tokens "
                   "(%d batches read): no perplexity at this length", L, L, nb);
    }
    if (interrupted) *interrupted = cut;
    return rc;
}

/* "at 2048: 12.345 (loss 2.5132, 96 windows)" lines of a per-length evaluation */
void bt_eval_print_lengths(FILE *out, const bt_eval_length *a, const bt_eval_length *b, int n) {
    for (int i = 0; i < n; i++) {
        if (!b)
            fprintf(out, "held-out perplexity at %d tokens: %.3f (loss %.4f, %lld windows, %lld "
                    "tokens)\n", a[i].length, exp(a[i].loss), a[i].loss, a[i].windows, a[i].tokens);
        else
            fprintf(out, "held-out perplexity at %d tokens: before %.3f -> after %.3f (loss %.4f "
                    "-> %.4f, %lld windows)\n", a[i].length, exp(a[i].loss), exp(b[i].loss),
                    a[i].loss, b[i].loss, b[i].windows);
    }
    fflush(out);
}