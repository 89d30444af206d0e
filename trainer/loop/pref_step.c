/* The preference step on the trainer's micro-batches: see trainer/loop/pref_step.h. */
#include "trainer/loop/pref_step.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "kernels/kernels.h"
#include "proto/batch.h"
#include "trainer/backend/plan.h"

/* the records kept since bt_pref_step_begin (this rank's), for the metrics */
typedef struct {
    double *pc, *pr, *rc, *rr; /* policy / reference sums: chosen (kto: the example), rejected */
    int32_t *nc, *nr;          /* response targets */
    uint8_t *des;              /* kto: desirable */
    int n, cap;
} recs;

struct bt_pref_step {
    bt_pref_params p;
    int B, T, M, V;
    void *block;  /* every buffer below: the memory plan's (plan.h bt_plan_pref), one allocation */
    size_t bytes; /* its bytes */
    int32_t *tg, *tg2, *lab2;   /* [M] targets; ORPO's all-labels copy and its targets */
    float *logp, *dlogp;        /* [M] */
    uint8_t *resp;              /* [M] position t predicts a response token */
    double *seg_sum, *seg_all, *seg_ref; /* [M] per segment */
    int *seg_cnt, *seg_cnta;    /* [M] */
    /* one micro-batch's records: segment of the chosen (kto: the example) and rejected side */
    int *rec_c, *rec_r;         /* [M] */
    double *mpc, *mpr, *mrc, *mrr, *dc, *dr; /* [M] */
    int32_t *mnc, *mnr;         /* [M] */
    uint8_t *mdes;              /* [M] */
    /* KTO KL micro-batch */
    int32_t *kid, *klab, *kpos, *kcu; /* [M], cu [M + 1] */
    /* the step */
    int ref_hit, ref_miss; /* the last micro-batch: record segments' reference values given / computed */
    int policy_is_ref;     /* bt_pref_step_set_policy_is_ref */
    long long policy_skipped;
    bt_pref_counts global;
    double kl_mean, nll_sum, nll_tok;
    recs r;
};

static int is_pair_algo(const bt_pref_step *s) { return s->p.algo != BT_PREF_KTO; }
static int needs_ref(const bt_pref_step *s) {
    return s->p.algo == BT_PREF_DPO || s->p.algo == BT_PREF_KTO;
}
/* the weight of the NLL term: ORPO 1, CPO cpo_alpha, DPO and KTO none */
static double nll_coef(const bt_pref_params *p) {
    return p->algo == BT_PREF_ORPO ? 1.0 : p->algo == BT_PREF_CPO ? p->cpo_alpha : 0.0;
}

void bt_pref_step_free(bt_pref_step *s) {
    if (!s) return;
    void *bufs[] = {s->block, s->r.pc, s->r.pr, s->r.rc, s->r.rr, s->r.nc, s->r.nr, s->r.des};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
    free(s);
}

size_t bt_pref_step_bytes(const bt_pref_step *s) { return s ? s->bytes : 0; }

/* Point plan buffer `id` at p (the step's field for it). */
static void pref_bind(bt_pref_step *s, int id, void *p) {
    switch (id) {
    case BT_BUF_PREF_TG: s->tg = p; break;
    case BT_BUF_PREF_TG2: s->tg2 = p; break;
    case BT_BUF_PREF_LAB2: s->lab2 = p; break;
    case BT_BUF_PREF_LOGP: s->logp = p; break;
    case BT_BUF_PREF_DLOGP: s->dlogp = p; break;
    case BT_BUF_PREF_RESP: s->resp = p; break;
    case BT_BUF_PREF_SEG_SUM: s->seg_sum = p; break;
    case BT_BUF_PREF_SEG_ALL: s->seg_all = p; break;
    case BT_BUF_PREF_SEG_REF: s->seg_ref = p; break;
    case BT_BUF_PREF_SEG_CNT: s->seg_cnt = p; break;
    case BT_BUF_PREF_SEG_CNTA: s->seg_cnta = p; break;
    case BT_BUF_PREF_REC_C: s->rec_c = p; break;
    case BT_BUF_PREF_REC_R: s->rec_r = p; break;
    case BT_BUF_PREF_MPC: s->mpc = p; break;
    case BT_BUF_PREF_MPR: s->mpr = p; break;
    case BT_BUF_PREF_MRC: s->mrc = p; break;
    case BT_BUF_PREF_MRR: s->mrr = p; break;
    case BT_BUF_PREF_DC: s->dc = p; break;
    case BT_BUF_PREF_DR: s->dr = p; break;
    case BT_BUF_PREF_MNC: s->mnc = p; break;
    case BT_BUF_PREF_MNR: s->mnr = p; break;
    case BT_BUF_PREF_MDES: s->mdes = p; break;
    case BT_BUF_PREF_KID: s->kid = p; break;
    case BT_BUF_PREF_KLAB: s->klab = p; break;
    case BT_BUF_PREF_KPOS: s->kpos = p; break;
    case BT_BUF_PREF_KCU: s->kcu = p; break;
    default: break; /* bt_plan_pref holds no other id */
    }
}

int bt_pref_step_new(bt_pref_step **out, const bt_pref_params *p, int B, int T, int vocab) {
    *out = NULL;
    char why[256];
    if (bt_pref_check(p, why, sizeof why)) return bt_fail(BT_ERR_INVALID, "preference: %s", why);
    if (B < 1 || T < 2 || vocab < 1) return bt_fail(BT_ERR_INVALID, "preference step: bad shape");
    bt_pref_step *s = calloc(1, sizeof *s);
    if (!s) return bt_fail(BT_ERR_NOMEM, "out of memory");
    s->p = *p;
    s->B = B;
    s->T = T;
    s->M = B * T;
    s->V = vocab;
    /* every buffer from the memory plan `trainer estimate` bills (plan.h bt_plan_pref), carved
     * out of one allocation of exactly the plan's bytes: the 8-byte elements first, then the
     * 4-byte, then the 1-byte ones, so every buffer is aligned to its element */
    bt_plan plan;
    int rc = bt_plan_pref(&plan, s->M, p->algo == BT_PREF_KTO);
    if (rc) {
        bt_pref_step_free(s);
        return rc;
    }
    const size_t total = (size_t)bt_plan_bytes(&plan, BT_PG_PREF);
    s->block = calloc(1, total);
    if (!s->block) {
        bt_pref_step_free(s);
        return bt_fail(BT_ERR_NOMEM, "out of memory for the preference step (%zu bytes)", total);
    }
    s->bytes = total;
    size_t at = 0;
    for (size_t es = 8; es >= 1; es /= 2)
        for (int i = 0; i < plan.n; i++)
            if (bt_dtype_size(plan.buf[i].dtype) == es) {
                pref_bind(s, plan.buf[i].id, (char *)s->block + at);
                at += (size_t)bt_plan_buf_bytes(&plan.buf[i]);
            }
    *out = s;
    return 0;
}

static const char *kind_name(int32_t k) {
    switch (k) {
    case BT_SEG_PLAIN: return "plain";
    case BT_SEG_CHOSEN: return "chosen";
    case BT_SEG_REJECTED: return "rejected";
    case BT_SEG_KTO_DESIRABLE: return "kto desirable";
    case BT_SEG_KTO_UNDESIRABLE: return "kto undesirable";
    }
    return "?";
}

/* mb's records into s->rec_c / rec_r (segment indices), after checking the segments against the
 * objective; targets into s->tg. Returns the number of records, or a negative bt_err. */
static int find_records(bt_pref_step *s, const bt_pref_batch *pb) {
    const bt_microbatch *mb = &pb->mb;
    if (mb->B < 1 || mb->T < 1 || mb->B > s->M / mb->T) /* before anything is written */
        return bt_fail(BT_ERR_INVALID, "preference step: a %dx%d micro-batch exceeds the step's %d tokens",
                       mb->B, mb->T, s->M);
    int nv = bt_shift_targets(s->tg, mb, s->V);
    if (nv < 0) return nv;
    const int nseg = mb->n_cu - 1;
    int n = 0;
    for (int k = 0; k < nseg; k++) {
        const int32_t kind = pb->seg_kind ? pb->seg_kind[k] : BT_SEG_PLAIN;
        const int32_t pair = pb->seg_pair ? pb->seg_pair[k] : -1;
        int lab = 0;
        for (int t = mb->cu_seqlens[k]; t < mb->cu_seqlens[k + 1]; t++) lab += s->tg[t] >= 0;
        if (kind == BT_SEG_PLAIN) {
            if (lab > 0)
                return bt_fail(BT_ERR_FORMAT, "micro-batch segment %d: a plain (SFT) document with %d "
                               "labelled tokens in a %s step: the data is not preference data "
                               "(data.format must be \"%s\")", k, lab, bt_pref_algo_name(s->p.algo),
                               is_pair_algo(s) ? "preference" : "kto");
            continue;
        }
        const int kto_kind = kind == BT_SEG_KTO_DESIRABLE || kind == BT_SEG_KTO_UNDESIRABLE;
        if (kto_kind == is_pair_algo(s) || kind < 0 || kind >= BT_SEG_N)
            return bt_fail(BT_ERR_FORMAT, "micro-batch segment %d: a %s segment in a %s step (data.format "
                           "must be \"%s\")", k, kind_name(kind), bt_pref_algo_name(s->p.algo),
                           is_pair_algo(s) ? "preference" : "kto");
        if (kto_kind) {
            s->rec_c[n] = k;
            s->rec_r[n] = -1;
            s->mdes[n] = kind == BT_SEG_KTO_DESIRABLE;
            n++;
            continue;
        }
        if (kind == BT_SEG_REJECTED) continue; /* taken with its chosen segment */
        if (k + 1 >= nseg || !pb->seg_kind || pb->seg_kind[k + 1] != BT_SEG_REJECTED ||
            !pb->seg_pair || pb->seg_pair[k + 1] != pair)
            return bt_fail(BT_ERR_FORMAT, "micro-batch segment %d: a chosen sequence without its "
                           "rejected one right after it", k);
        s->rec_c[n] = k;
        s->rec_r[n] = k + 1;
        n++;
    }
    /* a rejected segment must follow its chosen one */
    for (int k = 0; k < nseg; k++)
        if (pb->seg_kind && pb->seg_kind[k] == BT_SEG_REJECTED &&
            (k == 0 || pb->seg_kind[k - 1] != BT_SEG_CHOSEN))
            return bt_fail(BT_ERR_FORMAT, "micro-batch segment %d: a rejected sequence without its "
                           "chosen one", k);
    return n;
}

/* response targets of segment k */
static int seg_targets(const bt_pref_step *s, const bt_microbatch *mb, int k) {
    int c = 0;
    for (int t = mb->cu_seqlens[k]; t < mb->cu_seqlens[k + 1]; t++) c += s->tg[t] >= 0;
    return c;
}

int bt_pref_step_count(bt_pref_step *s, const bt_pref_batch *pb, bt_pref_counts *add) {
    const bt_microbatch *mb = &pb->mb;
    const int n = find_records(s, pb);
    if (n < 0) return n;
    add->records += n;
    if (s->p.algo == BT_PREF_ORPO) /* every target of the chosen sequence: its length - 1 */
        for (int j = 0; j < n; j++)
            add->nll_tokens += mb->cu_seqlens[s->rec_c[j] + 1] - mb->cu_seqlens[s->rec_c[j]] - 1;
    else if (s->p.algo == BT_PREF_CPO)
        for (int j = 0; j < n; j++) add->nll_tokens += seg_targets(s, mb, s->rec_c[j]);
    return 0;
}

/* Per-segment sums of logp over the targets tg (and mask) of mb: out[k], cnt[k] (may be NULL). */
static int seg_sums(const bt_pref_step *s, const bt_microbatch *mb, const int32_t *tg,
                    const uint8_t *mask, double *out, int *cnt) {
    if (bt_seq_sum(out, cnt, s->logp, tg, mask, mb->cu_seqlens, mb->n_cu - 1, s->V))
        return bt_fail(BT_ERR_INVALID, "preference step: bad cu_seqlens");
    return 0;
}

/* The reference's summed log-prob of every segment of mb into s->seg_ref: the ones the batch
 * brings (pb->ref_logps where pb->ref_ok: loaderd's cached reference log-probs, issue 25), the
 * others from a forward of the base with the adapter off (TRL's disable_adapter()), no dropout,
 * no gradient, run only when some record segment has no value. This is the one place the
 * reference comes from. Counts s->ref_hit / ref_miss over the record segments. */
static int pref_ref_sums(bt_pref_step *s, bt_backend *be, const bt_pref_batch *pb) {
    const bt_microbatch *mb = &pb->mb;
    const int nseg = mb->n_cu - 1;
    int hit = 0, miss = 0;
    for (int k = 0; k < nseg; k++) {
        const int32_t kind = pb->seg_kind ? pb->seg_kind[k] : BT_SEG_PLAIN;
        if (kind == BT_SEG_PLAIN) continue;
        if (pb->ref_logps && (!pb->ref_ok || pb->ref_ok[k] == 1)) hit++;
        else miss++;
    }
    s->ref_hit = hit;
    s->ref_miss = miss;
    if (miss > 0) {
        int rc = bt_backend_logprobs(be, mb, 0, 0, 0, s->logp, NULL);
        if (rc) return rc;
        if ((rc = seg_sums(s, mb, s->tg, NULL, s->seg_ref, NULL))) return rc;
    } else {
        memset(s->seg_ref, 0, (size_t)nseg * sizeof(double));
    }
    if (pb->ref_logps)
        for (int k = 0; k < nseg; k++)
            if (!pb->ref_ok || pb->ref_ok[k] == 1) s->seg_ref[k] = pb->ref_logps[k];
    return 0;
}

void bt_pref_step_set_policy_is_ref(bt_pref_step *s, int on) { s->policy_is_ref = on != 0; }

long long bt_pref_step_policy_skipped(const bt_pref_step *s) { return s ? s->policy_skipped : 0; }

int bt_pref_step_ref_used(const bt_pref_step *s, const double **seg_ref, int *computed) {
    *seg_ref = s->seg_ref;
    *computed = s->ref_miss;
    return s->ref_hit;
}

int bt_pref_step_kl(bt_pref_step *s, bt_backend *be, const bt_pref_batch *pb, double kl[2]) {
    const bt_microbatch *mb = &pb->mb;
    const int n = find_records(s, pb);
    if (n < 0) return n;
    if (s->p.algo != BT_PREF_KTO || n == 0) return 0;
    if (s->policy_is_ref) { /* policy - reference = 0 for each of the n KL sequences (one per example) */
        kl[1] += n;
        s->policy_skipped++;
        return 0;
    }
    const int T = s->T;
    int *is_kl = s->seg_cnta; /* per KL-batch segment: 1 a KL sequence, 0 padding */
    int j = 0;
    while (j < n) {
        /* pack KL sequences j.. into one micro-batch of B rows */
        int t = 0, nseg = 0, row = 0, first = j;
        s->kcu[0] = 0;
        while (j < n && row < s->B) {
            const int ki = s->rec_c[j], kc = s->rec_c[(j + n - 1) % n];
            const int a = mb->cu_seqlens[ki], b = mb->cu_seqlens[ki + 1];
            int plen = 0; /* the prompt: the leading unlabelled tokens */
            while (a + plen < b && mb->labels[a + plen] == BT_LABEL_IGNORE) plen++;
            const int ca = mb->cu_seqlens[kc], cb = mb->cu_seqlens[kc + 1];
            int cstart = 0;
            while (ca + cstart < cb && mb->labels[ca + cstart] == BT_LABEL_IGNORE) cstart++;
            int clen = cb - ca - cstart;
            if (plen + clen > T) clen = T - plen; /* plen < T: the prompt fits its own row */
            const int len = plen + clen;
            const int row_end = (row + 1) * T;
            if (t + len > row_end) { /* next row: pad the rest of this one */
                if (t < row_end) {
                    for (int u = t; u < row_end; u++) {
                        s->kid[u] = 0;
                        s->klab[u] = BT_LABEL_IGNORE;
                        s->kpos[u] = u - t;
                    }
                    is_kl[nseg] = 0;
                    s->kcu[++nseg] = row_end;
                    t = row_end;
                }
                row++;
                continue;
            }
            for (int u = 0; u < plen; u++) {
                s->kid[t + u] = mb->input_ids[a + u];
                s->klab[t + u] = BT_LABEL_IGNORE;
                s->kpos[t + u] = u;
            }
            for (int u = 0; u < clen; u++) {
                s->kid[t + plen + u] = mb->input_ids[ca + cstart + u];
                s->klab[t + plen + u] = mb->labels[ca + cstart + u];
                s->kpos[t + plen + u] = plen + u;
            }
            t += len;
            is_kl[nseg] = 1;
            s->kcu[++nseg] = t;
            j++;
            if (t == row_end) row++;
        }
        const int n_kl = j - first;
        /* pad the last row, then the remaining rows, each a segment of its own */
        const int M = s->M;
        while (t < M) {
            const int row_end = (t / T + 1) * T;
            for (int u = t; u < row_end; u++) {
                s->kid[u] = 0;
                s->klab[u] = BT_LABEL_IGNORE;
                s->kpos[u] = u - t;
            }
            is_kl[nseg] = 0;
            s->kcu[++nseg] = row_end;
            t = row_end;
        }
        bt_microbatch kb = {s->B, T, s->kid, s->klab, s->kpos, s->kcu, nseg + 1};
        int nv = bt_shift_targets(s->tg2, &kb, s->V);
        if (nv < 0) return nv;
        int rc = bt_backend_logprobs(be, &kb, 1, 0, 0, s->logp, NULL);
        if (!rc) rc = seg_sums(s, &kb, s->tg2, NULL, s->seg_all, NULL);
        if (!rc) rc = bt_backend_logprobs(be, &kb, 0, 0, 0, s->logp, NULL);
        if (!rc) rc = seg_sums(s, &kb, s->tg2, NULL, s->seg_ref, NULL);
        if (rc) return rc;
        for (int k = 0; k < nseg; k++)
            if (is_kl[k]) kl[0] += s->seg_all[k] - s->seg_ref[k];
        kl[1] += n_kl;
    }
    return 0;
}

void bt_pref_step_begin(bt_pref_step *s, const bt_pref_counts *global, double kl_mean) {
    s->global = global ? *global : (bt_pref_counts){0, 0};
    s->kl_mean = kl_mean;
    s->nll_sum = 0;
    s->nll_tok = 0;
    s->r.n = 0;
}

static int recs_grow(recs *r, int add) {
    if (r->n + add <= r->cap) return 0;
    int cap = r->cap ? r->cap : 64;
    while (cap < r->n + add) cap *= 2;
    double **d[] = {&r->pc, &r->pr, &r->rc, &r->rr};
    for (int i = 0; i < 4; i++) {
        double *x = realloc(*d[i], (size_t)cap * sizeof(double));
        if (!x) return bt_fail(BT_ERR_NOMEM, "out of memory");
        *d[i] = x;
    }
    int32_t *a = realloc(r->nc, (size_t)cap * 4);
    if (!a) return bt_fail(BT_ERR_NOMEM, "out of memory");
    r->nc = a;
    a = realloc(r->nr, (size_t)cap * 4);
    if (!a) return bt_fail(BT_ERR_NOMEM, "out of memory");
    r->nr = a;
    uint8_t *u = realloc(r->des, (size_t)cap);
    if (!u) return bt_fail(BT_ERR_NOMEM, "out of memory");
    r->des = u;
    r->cap = cap;
    return 0;
}

int bt_pref_step_micro(bt_pref_step *s, bt_backend *be, const bt_pref_batch *pb, int backward,
                       uint64_t drop_key) {
    const bt_microbatch *mb = &pb->mb;
    const int n = find_records(s, pb);
    s->ref_hit = s->ref_miss = 0;
    if (n <= 0) return n; /* no record (padding only): nothing to score */
    const int orpo = s->p.algo == BT_PREF_ORPO, kto = s->p.algo == BT_PREF_KTO;
    const int M = mb->B * mb->T;
    int rc = 0;
    if (needs_ref(s) && (rc = pref_ref_sums(s, be, pb))) return rc;
    /* ORPO scores every token of the chosen sequences for its NLL (prompt included): a copy of
     * the micro-batch with labels on them; its odds ratio sums the response targets only */
    bt_microbatch pm = *mb;
    const int32_t *ptg = s->tg;
    for (int t = 0; t < M; t++) s->resp[t] = s->tg[t] >= 0;
    if (orpo) {
        memcpy(s->lab2, mb->labels, (size_t)M * 4);
        for (int j = 0; j < n; j++) {
            const int a = mb->cu_seqlens[s->rec_c[j]], b = mb->cu_seqlens[s->rec_c[j] + 1];
            for (int t = a + 1; t < b; t++) s->lab2[t] = mb->input_ids[t];
        }
        pm.labels = s->lab2;
        int nv = bt_shift_targets(s->tg2, &pm, s->V);
        if (nv < 0) return nv;
        ptg = s->tg2;
    }
    if (!backward && s->policy_is_ref && needs_ref(s)) {
        /* the adapter is the identity: the policy's sums are the reference's (pref_ref_sums);
         * only the response-target counts are needed */
        const int nseg = mb->n_cu - 1;
        for (int k = 0; k < nseg; k++) {
            s->seg_sum[k] = s->seg_ref[k];
            s->seg_cnt[k] = seg_targets(s, mb, k);
        }
        s->policy_skipped++;
    } else {
        if ((rc = bt_backend_logprobs(be, &pm, 1, backward, drop_key, s->logp, NULL))) return rc;
        if ((rc = seg_sums(s, &pm, ptg, orpo ? s->resp : NULL, s->seg_sum, s->seg_cnt))) return rc;
    }
    if (orpo && (rc = seg_sums(s, &pm, ptg, NULL, s->seg_all, s->seg_cnta))) return rc;
    /* this micro-batch's records, and the NLL of its chosen sequences */
    for (int j = 0; j < n; j++) {
        const int c = s->rec_c[j], r = s->rec_r[j];
        s->mpc[j] = s->seg_sum[c];
        s->mnc[j] = s->seg_cnt[c];
        s->mrc[j] = needs_ref(s) ? s->seg_ref[c] : 0;
        if (!kto) {
            s->mpr[j] = s->seg_sum[r];
            s->mnr[j] = s->seg_cnt[r];
            s->mrr[j] = needs_ref(s) ? s->seg_ref[r] : 0;
            if (orpo) s->nll_sum -= s->seg_all[c], s->nll_tok += s->seg_cnta[c];
            else if (s->p.algo == BT_PREF_CPO) s->nll_sum -= s->seg_sum[c], s->nll_tok += s->seg_cnt[c];
        }
    }
    if ((rc = recs_grow(&s->r, n))) return rc;
    for (int j = 0; j < n; j++) {
        const int i = s->r.n + j;
        s->r.pc[i] = s->mpc[j];
        s->r.rc[i] = s->mrc[j];
        s->r.nc[i] = s->mnc[j];
        s->r.pr[i] = kto ? 0 : s->mpr[j];
        s->r.rr[i] = kto ? 0 : s->mrr[j];
        s->r.nr[i] = kto ? 0 : s->mnr[j];
        s->r.des[i] = kto ? s->mdes[j] : 0;
    }
    s->r.n += n;
    if (!backward) return 0;
    if (!(s->global.records > 0))
        return bt_fail(BT_ERR_INVALID, "preference step: no records counted for the step");
    /* the gradient of (n / N) x this micro-batch's mean loss: the step's mean over its N records */
    bt_pref_metrics m;
    double dnll = 0;
    const int bad = kto ? bt_kto_loss(&s->p, n, s->mpc, s->mrc, s->mdes, s->kl_mean, s->dc, &m)
                        : bt_pref_pair_loss(&s->p, n, s->mpc, s->mpr, s->mrc, s->mrr, s->mnc,
                                            s->mnr, 0.0, s->dc, s->dr, &dnll, &m);
    if (bad) return bt_fail(BT_ERR_INVALID, "preference step: the loss refused its inputs");
    const double w = (double)n / s->global.records;
    const double gnll = dnll != 0 && s->global.nll_tokens > 0 ? -dnll / s->global.nll_tokens : 0;
    memset(s->dlogp, 0, (size_t)M * sizeof(float));
    for (int j = 0; j < n; j++) {
        const int c = s->rec_c[j];
        for (int t = mb->cu_seqlens[c]; t < mb->cu_seqlens[c + 1]; t++) {
            if (ptg[t] < 0) continue;
            double g = s->resp[t] ? w * s->dc[j] : 0;
            if (orpo || (s->p.algo == BT_PREF_CPO && s->resp[t])) g += gnll;
            s->dlogp[t] = (float)g;
        }
        if (kto) continue;
        const int r = s->rec_r[j];
        for (int t = mb->cu_seqlens[r]; t < mb->cu_seqlens[r + 1]; t++)
            if (ptg[t] >= 0 && s->resp[t]) s->dlogp[t] = (float)(w * s->dr[j]);
    }
    return bt_backend_backward_logprobs(be, &pm, s->dlogp, drop_key);
}

/* sums: [0] records, [1] records x loss (without the NLL term), [2..9] records x metric (KTO:
 * the chosen-side ones x desirable, rejected-side x undesirable), [10] NLL sum, [11] NLL targets,
 * [12] desirable, [13] undesirable, [14] records x logps/accuracies, [15] records x logps/margins
 * (ours: policy chosen > rejected; pairs only) */
enum { S_N, S_LOSS, S_RC, S_RR, S_ACC, S_MAR, S_LC, S_LR, S_LOR, S_LOC, S_NLL, S_NLLT, S_DES, S_UND,
       S_LACC, S_LMAR };

void bt_pref_step_sums(const bt_pref_step *s, double kl_mean, double sums[BT_PREF_NSUMS]) {
    memset(sums, 0, BT_PREF_NSUMS * sizeof(double));
    const recs *r = &s->r;
    sums[S_NLL] = s->nll_sum;
    sums[S_NLLT] = s->nll_tok;
    if (r->n == 0) return;
    bt_pref_metrics m;
    const double n = r->n;
    if (s->p.algo == BT_PREF_KTO) {
        if (bt_kto_loss(&s->p, r->n, r->pc, r->rc, r->des, kl_mean, NULL, &m)) return;
        int nd = 0;
        for (int i = 0; i < r->n; i++) nd += r->des[i] != 0;
        const int nu = r->n - nd;
        sums[S_N] = n;
        sums[S_LOSS] = n * m.loss;
        sums[S_DES] = nd;
        sums[S_UND] = nu;
        if (nd) sums[S_RC] = nd * m.rewards_chosen, sums[S_LC] = nd * m.logps_chosen;
        if (nu) sums[S_RR] = nu * m.rewards_rejected, sums[S_LR] = nu * m.logps_rejected;
        return;
    }
    if (bt_pref_pair_loss(&s->p, r->n, r->pc, r->pr, r->rc, r->rr, r->nc, r->nr, 0.0, NULL, NULL,
                          NULL, &m))
        return;
    sums[S_N] = n;
    sums[S_LOSS] = n * m.loss;
    sums[S_RC] = n * m.rewards_chosen;
    sums[S_RR] = n * m.rewards_rejected;
    sums[S_ACC] = n * m.rewards_accuracies;
    sums[S_MAR] = n * m.rewards_margins;
    sums[S_LC] = n * m.logps_chosen;
    sums[S_LR] = n * m.logps_rejected;
    sums[S_LACC] = n * m.logps_accuracies;
    sums[S_LMAR] = n * m.logps_margins;
    if (s->p.algo == BT_PREF_ORPO) sums[S_LOR] = n * m.log_odds_ratio, sums[S_LOC] = n * m.log_odds_chosen;
}

double bt_pref_sums_records(const double sums[BT_PREF_NSUMS]) { return sums[S_N]; }

void bt_pref_metrics_of(const bt_pref_params *p, const double sums[BT_PREF_NSUMS], double kl_mean,
                        bt_pref_metrics *m) {
    const double n = sums[S_N];
    m->loss = m->rewards_chosen = m->rewards_rejected = m->rewards_accuracies = NAN;
    m->rewards_margins = m->logps_chosen = m->logps_rejected = NAN;
    m->logps_accuracies = m->logps_margins = NAN;
    m->nll_loss = m->log_odds_ratio = m->log_odds_chosen = m->kl = NAN;
    if (!(n > 0)) return;
    m->loss = sums[S_LOSS] / n;
    if (p->algo == BT_PREF_KTO) {
        const double nd = sums[S_DES], nu = sums[S_UND];
        if (nd > 0) m->rewards_chosen = sums[S_RC] / nd, m->logps_chosen = sums[S_LC] / nd;
        if (nu > 0) m->rewards_rejected = sums[S_RR] / nu, m->logps_rejected = sums[S_LR] / nu;
        if (nd > 0 && nu > 0) m->rewards_margins = m->rewards_chosen - m->rewards_rejected;
        m->kl = p->loss_type[0] == BT_PREF_LOSS_APO_ZERO_UNPAIRED ? 0.0
                : (isnan(kl_mean) || kl_mean > 0 ? kl_mean : 0.0);
        return;
    }
    m->rewards_chosen = sums[S_RC] / n;
    m->rewards_rejected = sums[S_RR] / n;
    m->rewards_accuracies = sums[S_ACC] / n;
    m->rewards_margins = sums[S_MAR] / n;
    m->logps_chosen = sums[S_LC] / n;
    m->logps_rejected = sums[S_LR] / n;
    m->logps_accuracies = sums[S_LACC] / n;
    m->logps_margins = sums[S_LMAR] / n;
    const double coef = nll_coef(p);
    if (p->algo != BT_PREF_DPO) {
        const double nll = sums[S_NLLT] > 0 ? sums[S_NLL] / sums[S_NLLT] : 0.0;
        m->nll_loss = coef == 0.0 ? 0.0 : nll; /* TRL: CPO with cpo_alpha 0 logs nll_loss 0 */
        m->loss += coef * m->nll_loss;
    }
    if (p->algo == BT_PREF_ORPO) {
        m->log_odds_ratio = sums[S_LOR] / n;
        m->log_odds_chosen = sums[S_LOC] / n;
    }
}
