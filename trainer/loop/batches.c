/* The trainer's side of the batch stream from loaderd: attach, the next batch (stoppable wait),
 * micro-batch copies. See trainer/loop/run.h. */
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "trainer/loop/run.h"

void bt_mb_view(const bt_mb_copy *c, int B, int T, bt_microbatch *mb) {
    mb->B = B;
    mb->T = T;
    mb->input_ids = c->ids;
    mb->labels = c->labels;
    mb->position_ids = c->pos;
    mb->cu_seqlens = c->cu;
    mb->n_cu = c->n_cu;
}

/* Layout 2's per-segment fields (proto/batch.h), checked again on the trainer's copy (loaderd's
 * client checks them too: bt_batch_validate): a malformed batch is refused, never trained on. */
static int seg_check(const bt_mb_copy *c, int T, uint64_t step) {
    int next = 0;
    for (int k = 0; k + 1 < c->n_cu; k++) {
        const int32_t kind = c->seg_kind[k], pair = c->seg_pair[k];
        if (kind < BT_SEG_PLAIN || kind >= BT_SEG_N)
            return bt_fail(BT_ERR_FORMAT, "batch %llu: segment %d: seg_kind %d out of range",
                           (unsigned long long)step, k, kind);
        if (kind == BT_SEG_PLAIN) {
            if (pair != -1)
                return bt_fail(BT_ERR_FORMAT, "batch %llu: plain segment %d has seg_pair %d (expected "
                               "-1)", (unsigned long long)step, k, pair);
            continue;
        }
        if (kind == BT_SEG_REJECTED) {
            if (k == 0 || c->seg_kind[k - 1] != BT_SEG_CHOSEN || c->seg_pair[k - 1] != pair)
                return bt_fail(BT_ERR_FORMAT, "batch %llu: rejected segment %d does not follow its "
                               "chosen one", (unsigned long long)step, k);
            continue;
        }
        if (pair != next)
            return bt_fail(BT_ERR_FORMAT, "batch %llu: segment %d: record %d, expected %d",
                           (unsigned long long)step, k, pair, next);
        next++;
        if (kind == BT_SEG_CHOSEN &&
            (k + 2 >= c->n_cu || c->seg_kind[k + 1] != BT_SEG_REJECTED ||
             c->seg_pair[k + 1] != pair || c->cu[k + 1] / T != c->cu[k] / T ||
             (c->cu[k + 2] - 1) / T != c->cu[k] / T))
            return bt_fail(BT_ERR_FORMAT, "batch %llu: chosen segment %d is not followed by its "
                           "rejected one in the same row", (unsigned long long)step, k);
    }
    return 0;
}

static int mb_take(bt_mb_copy *c, const bt_batch_view *v, int B, int T) {
    size_t M = (size_t)B * T;
    if (v->hdr->B != (uint32_t)B || v->hdr->T != (uint32_t)T || v->hdr->n_cu < 2 ||
        v->hdr->n_cu > M + 1)
        return bt_fail(BT_ERR_FORMAT, "batch %llu: shape %ux%u (n_cu %u), expected %dx%d",
                       (unsigned long long)v->hdr->step, v->hdr->B, v->hdr->T, v->hdr->n_cu, B, T);
    memcpy(c->ids, v->input_ids, M * 4);
    memcpy(c->labels, v->labels, M * 4);
    memcpy(c->pos, v->position_ids, M * 4);
    memcpy(c->cu, v->cu_seqlens, (size_t)v->hdr->n_cu * 4);
    memcpy(c->seg_kind, v->seg_kind, (size_t)(v->hdr->n_cu - 1) * 4);
    memcpy(c->seg_pair, v->seg_pair, (size_t)(v->hdr->n_cu - 1) * 4);
    memcpy(c->seg_src, v->seg_src, (size_t)(v->hdr->n_cu - 1) * 4);
    memcpy(c->seg_line, v->seg_line, (size_t)(v->hdr->n_cu - 1) * 4);
    memcpy(c->seg_ref_ok, v->seg_ref_ok, (size_t)(v->hdr->n_cu - 1) * 4);
    memcpy(c->seg_ref_logp, v->seg_ref_logp, (size_t)(v->hdr->n_cu - 1) * sizeof(double));
    c->n_cu = (int)v->hdr->n_cu;
    int rc = seg_check(c, T, v->hdr->step);
    if (rc) return rc;
    c->n_real = v->hdr->n_real_tokens;
    memcpy(c->resume, v->hdr->resume_state, BT_RESUME_STATE_BYTES);
    return 0;
}

int bt_mb_alloc(bt_mb_copy *c, int B, int T) {
    size_t M = (size_t)B * T;
    c->ids = malloc(M * 4);
    c->labels = malloc(M * 4);
    c->pos = malloc(M * 4);
    c->cu = malloc((M + 1) * 4);
    c->seg_kind = malloc(M * 4);
    c->seg_pair = malloc(M * 4);
    c->seg_src = malloc(M * 4);
    c->seg_line = malloc(M * 4);
    c->seg_ref_ok = malloc(M * 4);
    c->seg_ref_logp = malloc(M * sizeof(double));
    if (!c->ids || !c->labels || !c->pos || !c->cu || !c->seg_kind || !c->seg_pair || !c->seg_src ||
        !c->seg_line || !c->seg_ref_ok || !c->seg_ref_logp)
        return bt_fail(BT_ERR_NOMEM, "out of memory for batch copies");
    return 0;
}

void bt_mb_free(bt_mb_copy *c) {
    free(c->ids);
    free(c->labels);
    free(c->pos);
    free(c->cu);
    free(c->seg_kind);
    free(c->seg_pair);
    free(c->seg_src);
    free(c->seg_line);
    free(c->seg_ref_ok);
    free(c->seg_ref_logp);
    memset(c, 0, sizeof *c);
}

/* resume: NULL = from the start, else the BT_RESUME_STATE_BYTES state to continue after. */
int bt_run_attach(bt_run *r, bt_client **cl, const bt_train_config *cfg, int eval,
                  const uint8_t *resume) {
    char *job = bt_config_job_json(cfg, eval, r->ref_base[0] ? r->ref_base : NULL);
    if (!job) return bt_fail(BT_ERR_NOMEM, "out of memory");
    int rc = bt_client_attach_from(cl, cfg->socket, job, r->dist.rank, r->dist.world, resume,
                                   resume && !eval ? r->resume_world : 0, r->id);
    free(job);
    if (rc) return bt_fail(rc, "attach to loaderd at %s (%s stream): %s", cfg->socket,
                           eval ? "eval" : "train", bt_last_error());
    if (bt_client_B(*cl) != (uint32_t)cfg->data.micro_batch_size ||
        bt_client_T(*cl) != (uint32_t)cfg->data.seq_len) {
        rc = bt_fail(BT_ERR_FORMAT, "loaderd serves %ux%u batches, config asks %dx%d",
                     bt_client_B(*cl), bt_client_T(*cl), cfg->data.micro_batch_size,
                     cfg->data.seq_len);
        bt_client_close(*cl);
        *cl = NULL;
    }
    return rc;
}

/* 0: a batch in *dst; 1: end of data; 2: a stop request while waiting (nothing taken); <0: error
 * (another rank's failure included). The wait (up to timeout_s) is cut into 1 s slices so that
 * a signal stops it promptly: the client retries EINTR, so the handler alone would only take
 * effect once a batch arrived. */
int bt_run_next_batch(bt_run *r, bt_client *cl, const bt_train_config *cfg, bt_mb_copy *dst,
                      const char *what) {
    bt_batch_view v;
    double deadline = bt_now() + cfg->timeout_s;
    int rc;
    for (;;) {
        double left = deadline - bt_now();
        rc = bt_client_next(cl, &v, left >= 1.0 ? 1000 : left > 0 ? (int)(left * 1000.0) : 0);
        if (rc != BT_ERR_TIMEOUT || bt_now() >= deadline) break;
        int st = bt_run_stop_check(r);
        if (st) return st == BT_ERR_CANCELLED ? 2 : st;
    }
    if (rc == 1) return 1;
    if (rc == BT_ERR_TIMEOUT)
        return bt_fail(rc, "no %s batch from loaderd within %d s (timeout_s)", what,
                       cfg->timeout_s);
    if (rc) return bt_fail(rc, "%s batch: %s", what, bt_last_error());
    rc = mb_take(dst, &v, cfg->data.micro_batch_size, cfg->data.seq_len);
    bt_client_release(cl);
    return rc;
}