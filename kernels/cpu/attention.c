/* Causal scaled-dot-product attention over packed variable-length segments with grouped-query
 * attention (GQA; Ainslie et al. 2023, arXiv 2305.13245) and LongLoRA's shifted sparse attention
 * (S^2-Attn; Chen et al. 2023, arXiv 2309.12307), fp32.
 *
 * S^2-Attn as a segmentation: with group size G > 0, query head h attends only within its group of
 * the document (positions local to the cu_seqlens segment): heads h < Hq/2 use groups [kG, (k+1)G),
 * heads h >= Hq/2 groups shifted by G/2: [0, G/2), [G/2, 3G/2), ... (half-size groups at both ends,
 * never a roll that wraps the last tokens round to the first: the varlen form of LongLoRA's
 * llama_attn_replace.py forward_flashattn, and the rule of kernels/cuda/attention_common.h).
 * Causal inside each group. So for head h every (document, group) pair is an independent causal
 * sub-segment, and the kernels below run plain causal attention over the sub-segments of each head
 * (G = 0: the sub-segment is the whole document).
 *
 * Forward, per task (sub-segment, query head, block of BT_ATTN_BQ queries): FlashAttention-2's
 * online softmax (Dao 2023, arXiv 2307.08691, Algorithm 1) over key tiles of BT_ATTN_KT keys:
 *   S = scale Q_blk K_tile^T (bt_sgemm), causal mask j <= i, m' = max(m, rowmax S),
 *   l = l e^(m - m') + rowsum e^(S - m'), O = O e^(m - m') + e^(S - m') V_tile (bt_sgemm),
 * then O /= l, lse = m + log l. The score tile (BQ x KT floats) stays in the core's cache, so the
 * cost per token does not grow with the segment length beyond the O(L) keys it must read.
 * Backward (FlashAttention-2 Algorithm 2, per block and key tile with dense sgemm), per task
 * (sub-segment, query head): P = exp(S - lse), dV += P^T dO, dP = dO V^T,
 *   dS = P o (dP - rowsum(dO o O)), dQ += scale dS K, dK += scale dS^T Q.
 * GQA: query head h reads kv head h / (Hq/Hkv); dK/dV are accumulated per query head in scratch and
 * then summed over the heads of each group in head order (deterministic).
 * Threads: OpenMP over the tasks (dynamic schedule, longest first), each calling single-threaded
 * sgemm (bt_sgemm inside a parallel region; OpenBLAS is kept at one thread, see blas_par.c). Every
 * output element is computed by one task in a fixed order: results do not depend on the thread
 * count or schedule. */
#include "kernels/kernels.h"
#include "kernels/cpu/cpu_math.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "common/bt_common.h"

#define BT_ATTN_BQ 128 /* queries per block */
#define BT_ATTN_KT 256 /* keys per tile */

/* Rows of [0, M) not covered by [cu[0], cu[n_seq]) (a caller bug; zeroed for safety). */
static void zero_uncovered(float *x, int64_t row_elems, const int32_t *cu, int n_seq, int M)
{
    int a = cu[0] < 0 ? 0 : (cu[0] > M ? M : cu[0]);
    int b = cu[n_seq] < a ? a : (cu[n_seq] > M ? M : cu[n_seq]);
    if (a > 0)
        memset(x, 0, (size_t)a * (size_t)row_elems * sizeof(float));
    if (b < M)
        memset(x + (size_t)b * row_elems, 0, (size_t)(M - b) * (size_t)row_elems * sizeof(float));
}

int bt_s2_group_end(int i, int G, int shifted)
{
    if (G <= 0)
        return 0x7fffffff;
    if (!shifted)
        return (i / G + 1) * G;
    return ((i + G / 2) / G) * G + G / 2;
}

/* The first key a query at local position i sees with a sliding window of W keys (0: no window):
 * max(0, i - W + 1), i.e. key j is visible iff i - W < j <= i. */
static inline int win_lo(int i, int W)
{
    return W > 0 && i - W + 1 > 0 ? i - W + 1 : 0;
}

/* One unit of work: rows [start + i0, start + i0 + bq) of query head h attend to keys
 * [start, start + i0 + bq) (causally); len = the sub-segment's length. Backward tasks cover a whole
 * sub-segment (i0 = 0, bq = len). cost orders them (longest first). */
typedef struct {
    int start, len, h, i0, bq;
    int64_t cost;
} att_task;

static int cmp_task(const void *a, const void *b)
{
    const att_task *x = a, *y = b;
    if (x->cost != y->cost)
        return x->cost > y->cost ? -1 : 1;
    if (x->start != y->start)
        return x->start < y->start ? -1 : 1;
    if (x->h != y->h)
        return x->h < y->h ? -1 : 1;
    return x->i0 < y->i0 ? -1 : (x->i0 > y->i0);
}

/* The tasks of every (segment, head, S^2 sub-segment), split into query blocks when `blocks`.
 * Returns the count (>= 0) with *out malloc'd, or -1 when out of memory. Segments outside
 * [0, M] are clipped (a caller bug; bt_shift_targets refuses such batches in the trainer). */
static int64_t make_tasks(att_task **out, const int32_t *cu, int n_seq, int M, int Hq, int G,
                          int W, int blocks)
{
    int64_t n = 0, cap = 0;
    att_task *t = NULL;
    for (int pass = 0; pass < 2; pass++) {
        n = 0;
        for (int s = 0; s < n_seq; s++) {
            int a = cu[s] < 0 ? 0 : cu[s], b = cu[s + 1] > M ? M : cu[s + 1];
            if (b <= a)
                continue;
            for (int h = 0; h < Hq; h++) {
                const int shifted = G > 0 && h >= Hq / 2;
                for (int g0 = 0; g0 < b - a;) {
                    int g1 = bt_s2_group_end(g0, G, shifted);
                    if (g1 > b - a || g1 <= g0)
                        g1 = b - a;
                    const int len = g1 - g0;
                    for (int i0 = 0; i0 < len; i0 += blocks ? BT_ATTN_BQ : len) {
                        const int bq = !blocks ? len : len - i0 < BT_ATTN_BQ ? len - i0 : BT_ATTN_BQ;
                        if (pass == 1)
                            t[n] = (att_task){a + g0, len, h, i0, bq,
                                              (int64_t)bq * (i0 + bq - win_lo(i0, W))};
                        n++;
                    }
                    g0 = g1;
                }
            }
        }
        if (pass == 0) {
            cap = n;
            t = malloc((size_t)(cap > 0 ? cap : 1) * sizeof *t);
            if (!t)
                return -1;
        }
    }
    qsort(t, (size_t)n, sizeof *t, cmp_task);
    *out = t;
    return n;
}

static int check_args(int n_seq, int M, int Hq, int Hkv, int D, int G, int W, const char *what)
{
    if (M < 0 || n_seq < 0 || Hq <= 0 || Hkv <= 0 || D <= 0 || Hq % Hkv != 0 || G < 0 || (G & 1) ||
        W < 0)
        return bt_fail(BT_ERR_INVALID, "attention %s: bad arguments (M %d, segments %d, heads %d/%d, "
                       "head_dim %d, s2_group %d: must be 0 or even, window %d: must be >= 0)", what,
                       M, n_seq, Hq, Hkv, D, G, W);
    return 0;
}

/* Forward of one task (see the file comment). Q/K/V/O point at the sub-segment's first row for
 * this head (row strides ldq / ldk / ldq); lse at its first row (stride Hq). ws: BQ x KT + 2 BQ. */
static void fwd_block(const att_task *tk, const float *Q, const float *K, const float *V, float *O,
                      float *lse, int ldq, int ldk, int Hq, int D, float scale, int W, float *ws)
{
    float *S = ws, *mrow = ws + BT_ATTN_BQ * BT_ATTN_KT, *lrow = mrow + BT_ATTN_BQ;
    const int i0 = tk->i0, bq = tk->bq, nk = i0 + bq;
    const int jlo = win_lo(i0, W); /* no query of the block sees a key before it */
    const float *Qb = Q + (size_t)i0 * ldq;
    float *Ob = O + (size_t)i0 * ldq;
    for (int r = 0; r < bq; r++) {
        mrow[r] = -INFINITY;
        lrow[r] = 0.0f;
    }
    for (int j0 = jlo; j0 < nk; j0 += BT_ATTN_KT) {
        const int kt = nk - j0 < BT_ATTN_KT ? nk - j0 : BT_ATTN_KT;
        bt_sgemm(0, 1, bq, kt, D, scale, Qb, ldq, K + (size_t)j0 * ldk, ldk, 0.0f, S, kt);
        for (int r = 0; r < bq; r++) {
            float *row = S + (size_t)r * kt;
            int nv = i0 + r + 1 - j0; /* valid keys ja <= j < nv of this tile */
            nv = nv < 0 ? 0 : (nv > kt ? kt : nv);
            int ja = win_lo(i0 + r, W) - j0;
            ja = ja < 0 ? 0 : (ja > nv ? nv : ja);
            float *orow = Ob + (size_t)r * ldq;
            if (nv == ja) { /* the whole tile lies after this query, or before its window */
                memset(row, 0, (size_t)kt * sizeof(float));
                continue;
            }
            float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
            for (int j = ja; j < nv; j++)
                mx = row[j] > mx ? row[j] : mx;
            const float mnew = mx > mrow[r] ? mx : mrow[r];
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int j = ja; j < nv; j++) {
                const float e = bt_expf(row[j] - mnew);
                row[j] = e;
                sum += e;
            }
            for (int j = 0; j < ja; j++)
                row[j] = 0.0f;
            for (int j = nv; j < kt; j++)
                row[j] = 0.0f;
            if (j0 > jlo) { /* rescale what earlier tiles accumulated */
                const float corr = bt_expf(mrow[r] - mnew);
                lrow[r] *= corr;
#pragma omp simd
                for (int d = 0; d < D; d++)
                    orow[d] *= corr;
            }
            lrow[r] += sum;
            mrow[r] = mnew;
        }
        bt_sgemm(0, 0, bq, D, kt, 1.0f, S, kt, V + (size_t)j0 * ldk, ldk, j0 > jlo ? 1.0f : 0.0f, Ob,
                 ldq);
    }
    for (int r = 0; r < bq; r++) {
        float *orow = Ob + (size_t)r * ldq;
        const float inv = 1.0f / lrow[r];
#pragma omp simd
        for (int d = 0; d < D; d++)
            orow[d] *= inv;
        lse[(size_t)(i0 + r) * Hq] = mrow[r] + logf(lrow[r]);
    }
}

int bt_attn_fwd_win(float *out, float *lse, const float *q, const float *k, const float *v,
                    const int32_t *cu_seqlens, int n_seq, int M, int Hq, int Hkv, int D, float scale,
                    int s2_group, int window)
{
    int rc = check_args(n_seq, M, Hq, Hkv, D, s2_group, window, "forward");
    if (rc)
        return rc;
    if (M == 0)
        return 0;
    if (n_seq == 0) {
        memset(out, 0, (size_t)M * Hq * D * sizeof(float));
        memset(lse, 0, (size_t)M * Hq * sizeof(float));
        return 0;
    }
    zero_uncovered(out, (int64_t)Hq * D, cu_seqlens, n_seq, M);
    zero_uncovered(lse, Hq, cu_seqlens, n_seq, M);
    att_task *tasks = NULL;
    const int64_t nt = make_tasks(&tasks, cu_seqlens, n_seq, M, Hq, s2_group, window, 1);
    if (nt < 0)
        return bt_fail(BT_ERR_NOMEM, "attention forward: out of memory (task list)");
    const int group = Hq / Hkv, ldq = Hq * D, ldk = Hkv * D;
    int nthr = bt_cpu_max_threads();
    if (nthr > nt)
        nthr = nt > 0 ? (int)nt : 1;
    const size_t per = (size_t)BT_ATTN_BQ * BT_ATTN_KT + 2 * BT_ATTN_BQ;
    float *ws = malloc((size_t)nthr * per * sizeof(float));
    if (!ws) {
        free(tasks);
        return bt_fail(BT_ERR_NOMEM, "attention forward: out of memory (%d x %zu floats scratch)",
                       nthr, per);
    }
    bt_cpu_blas_init();
#pragma omp parallel num_threads(nthr)
    {
#ifdef _OPENMP
        float *my = ws + (size_t)omp_get_thread_num() * per;
#else
        float *my = ws;
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < nt; i++) {
            const att_task *tk = &tasks[i];
            const int h = tk->h, g = h / group;
            fwd_block(tk, q + (size_t)tk->start * ldq + (size_t)h * D,
                      k + (size_t)tk->start * ldk + (size_t)g * D,
                      v + (size_t)tk->start * ldk + (size_t)g * D,
                      out + (size_t)tk->start * ldq + (size_t)h * D, lse + (size_t)tk->start * Hq + h,
                      ldq, ldk, Hq, D, scale, window, my);
        }
    }
    free(ws);
    free(tasks);
    return 0;
}

/* Backward of one sub-segment of one query head (see the file comment). Pointers at the
 * sub-segment's first row for this head; dK/dV rows of stride ldh (accumulated: zeroed by the
 * caller). ws: 2 x BQ x KT + BQ floats. */
static void bwd_segment(const att_task *tk, const float *Q, const float *K, const float *V,
                        const float *O, const float *dO, const float *LSE, float *dQ, float *dK,
                        float *dV, int ldq, int ldk, int ldh, int Hq, int D, float scale, int W,
                        float *ws)
{
    float *P = ws, *dP = ws + BT_ATTN_BQ * BT_ATTN_KT, *Di = dP + BT_ATTN_BQ * BT_ATTN_KT;
    const int L = tk->len;
    for (int i0 = 0; i0 < L; i0 += BT_ATTN_BQ) {
        const int bq = L - i0 < BT_ATTN_BQ ? L - i0 : BT_ATTN_BQ, nk = i0 + bq;
        const float *Qb = Q + (size_t)i0 * ldq, *dOb = dO + (size_t)i0 * ldq;
        float *dQb = dQ + (size_t)i0 * ldq;
        for (int r = 0; r < bq; r++) {
            const float *o = O + (size_t)(i0 + r) * ldq, *dor = dOb + (size_t)r * ldq;
            float di = 0.0f;
#pragma omp simd reduction(+ : di)
            for (int d = 0; d < D; d++)
                di += dor[d] * o[d];
            Di[r] = di;
        }
        const int jlo = win_lo(i0, W);
        for (int j0 = jlo; j0 < nk; j0 += BT_ATTN_KT) {
            const int kt = nk - j0 < BT_ATTN_KT ? nk - j0 : BT_ATTN_KT;
            const float *Kt = K + (size_t)j0 * ldk, *Vt = V + (size_t)j0 * ldk;
            /* P = exp(scale Q K^T - lse), masked */
            bt_sgemm(0, 1, bq, kt, D, scale, Qb, ldq, Kt, ldk, 0.0f, P, kt);
            for (int r = 0; r < bq; r++) {
                float *row = P + (size_t)r * kt;
                int nv = i0 + r + 1 - j0;
                nv = nv < 0 ? 0 : (nv > kt ? kt : nv);
                int ja = win_lo(i0 + r, W) - j0;
                ja = ja < 0 ? 0 : (ja > nv ? nv : ja);
                const float l = LSE[(size_t)(i0 + r) * Hq];
                for (int j = 0; j < ja; j++)
                    row[j] = 0.0f;
#pragma omp simd
                for (int j = ja; j < nv; j++)
                    row[j] = bt_expf(row[j] - l);
                for (int j = nv; j < kt; j++)
                    row[j] = 0.0f;
            }
            /* dV[tile] += P^T dO_b ; dP = dO_b V^T */
            bt_sgemm(1, 0, kt, D, bq, 1.0f, P, kt, dOb, ldq, 1.0f, dV + (size_t)j0 * ldh, ldh);
            bt_sgemm(0, 1, bq, kt, D, 1.0f, dOb, ldq, Vt, ldk, 0.0f, dP, kt);
            /* dS = P o (dP - Di), in dP (zero where masked, since P is 0 there) */
            for (int r = 0; r < bq; r++) {
                float *dpr = dP + (size_t)r * kt;
                const float *pr = P + (size_t)r * kt;
                const float di = Di[r];
#pragma omp simd
                for (int j = 0; j < kt; j++)
                    dpr[j] = pr[j] * (dpr[j] - di);
            }
            /* dQ_b (+)= scale dS K_tile ; dK[tile] += scale dS^T Q_b */
            bt_sgemm(0, 0, bq, D, kt, scale, dP, kt, Kt, ldk, j0 > jlo ? 1.0f : 0.0f, dQb, ldq);
            bt_sgemm(1, 0, kt, D, bq, scale, dP, kt, Qb, ldq, 1.0f, dK + (size_t)j0 * ldh, ldh);
        }
    }
}

int bt_attn_bwd_win(float *dq, float *dk, float *dv, const float *dout, const float *out,
                    const float *lse, const float *q, const float *k, const float *v,
                    const int32_t *cu_seqlens, int n_seq, int M, int Hq, int Hkv, int D, float scale,
                    int s2_group, int window)
{
    int rc = check_args(n_seq, M, Hq, Hkv, D, s2_group, window, "backward");
    if (rc)
        return rc;
    const size_t nq = (size_t)M * Hq * D, nkv = (size_t)M * Hkv * D;
    const int group = Hq / Hkv, ldq = Hq * D, ldk = Hkv * D;
    memset(dq, 0, nq * sizeof(float));
    memset(dk, 0, nkv * sizeof(float));
    memset(dv, 0, nkv * sizeof(float));
    if (M == 0 || n_seq == 0)
        return 0;
    att_task *tasks = NULL;
    const int64_t nt = make_tasks(&tasks, cu_seqlens, n_seq, M, Hq, s2_group, window, 0);
    if (nt < 0)
        return bt_fail(BT_ERR_NOMEM, "attention backward: out of memory (task list)");
    /* per-query-head dK/dV accumulators in the q layout [M, Hq, D] (dk/dv directly when
     * Hq == Hkv) */
    float *dkh = dk, *dvh = dv;
    if (group > 1) {
        dkh = calloc(nq, sizeof(float));
        dvh = calloc(nq, sizeof(float));
    }
    int nthr = bt_cpu_max_threads();
    if (nthr > nt)
        nthr = nt > 0 ? (int)nt : 1;
    const size_t per = 2 * (size_t)BT_ATTN_BQ * BT_ATTN_KT + BT_ATTN_BQ;
    float *ws = malloc((size_t)nthr * per * sizeof(float));
    if (!ws || !dkh || !dvh) {
        if (group > 1) {
            free(dkh);
            free(dvh);
        }
        free(ws);
        free(tasks);
        return bt_fail(BT_ERR_NOMEM, "attention backward: out of memory (%zu MiB of dK/dV "
                       "accumulators and scratch)",
                       ((group > 1 ? 2 * nq : 0) + (size_t)nthr * per) * sizeof(float) >> 20);
    }
    const int ldh = group > 1 ? ldq : ldk;
    bt_cpu_blas_init();
#pragma omp parallel num_threads(nthr)
    {
#ifdef _OPENMP
        float *my = ws + (size_t)omp_get_thread_num() * per;
#else
        float *my = ws;
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < nt; i++) {
            const att_task *tk = &tasks[i];
            const int h = tk->h, g = h / group, st = tk->start;
            const size_t qo = (size_t)st * ldq + (size_t)h * D, ko = (size_t)st * ldk + (size_t)g * D;
            const size_t ho = (size_t)st * ldh + (size_t)(group > 1 ? h : g) * D;
            bwd_segment(tk, q + qo, k + ko, v + ko, out + qo, dout + qo, lse + (size_t)st * Hq + h,
                        dq + qo, dkh + ho, dvh + ho, ldq, ldk, ldh, Hq, D, scale, window, my);
        }
    }
    if (group > 1) {
        /* dk[m, g, :] = sum over the group's query heads, in head order */
#pragma omp parallel for schedule(static) if (nq >= 65536)
        for (int m = 0; m < M; m++)
            for (int g = 0; g < Hkv; g++) {
                float *dkr = dk + ((size_t)m * Hkv + g) * D, *dvr = dv + ((size_t)m * Hkv + g) * D;
                const float *sk = dkh + ((size_t)m * Hq + (size_t)g * group) * D;
                const float *sv = dvh + ((size_t)m * Hq + (size_t)g * group) * D;
                for (int d = 0; d < D; d++) {
                    dkr[d] = sk[d];
                    dvr[d] = sv[d];
                }
                for (int j = 1; j < group; j++)
                    for (int d = 0; d < D; d++) {
                        dkr[d] += sk[(size_t)j * D + d];
                        dvr[d] += sv[(size_t)j * D + d];
                    }
            }
        free(dkh);
        free(dvh);
    }
    free(ws);
    free(tasks);
    return 0;
}

int bt_attn_fwd_s2(float *out, float *lse, const float *q, const float *k, const float *v,
                   const int32_t *cu_seqlens, int n_seq, int M, int Hq, int Hkv, int D, float scale,
                   int s2_group)
{
    return bt_attn_fwd_win(out, lse, q, k, v, cu_seqlens, n_seq, M, Hq, Hkv, D, scale, s2_group, 0);
}

int bt_attn_bwd_s2(float *dq, float *dk, float *dv, const float *dout, const float *out,
                   const float *lse, const float *q, const float *k, const float *v,
                   const int32_t *cu_seqlens, int n_seq, int M, int Hq, int Hkv, int D, float scale,
                   int s2_group)
{
    return bt_attn_bwd_win(dq, dk, dv, dout, out, lse, q, k, v, cu_seqlens, n_seq, M, Hq, Hkv, D,
                           scale, s2_group, 0);
}

int bt_attn_fwd(float *out, float *lse, const float *q, const float *k, const float *v,
                const int32_t *cu_seqlens, int n_seq, int M, int Hq, int Hkv, int D, float scale)
{
    const int rc = bt_attn_fwd_s2(out, lse, q, k, v, cu_seqlens, n_seq, M, Hq, Hkv, D, scale, 0);
    if (rc && M > 0 && Hq > 0 && D > 0 && out && lse) {
        memset(out, 0, (size_t)M * Hq * D * sizeof(float)); /* never garbage */
        memset(lse, 0, (size_t)M * Hq * sizeof(float));
    }
    return rc;
}

int bt_attn_bwd(float *dq, float *dk, float *dv, const float *dout, const float *out,
                const float *lse, const float *q, const float *k, const float *v,
                const int32_t *cu_seqlens, int n_seq, int M, int Hq, int Hkv, int D, float scale)
{
    return bt_attn_bwd_s2(dq, dk, dv, dout, out, lse, q, k, v, cu_seqlens, n_seq, M, Hq, Hkv, D,
                          scale, 0);
}
