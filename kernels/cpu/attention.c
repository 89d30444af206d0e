/* Causal scaled-dot-product attention over packed variable-length segments with grouped-query
 * attention (GQA; Ainslie et al. 2023, arXiv 2305.13245), fp32.
 *
 * Forward per (segment, query head), in blocks of BT_ATTN_BQ queries (bounding scratch to
 * BT_ATTN_BQ x segment length floats per thread):
 *   S = scale * Q_blk K^T (bt_sgemm), causal mask j <= i, P = softmax(S) with max subtraction,
 *   lse = max + log(sum exp(S - max)), O_blk = P V (bt_sgemm).
 * Backward (FlashAttention-2's recomputation, Dao 2023, arXiv 2307.08691, Algorithm 2, done per
 * block with dense sgemm): P = exp(S - lse), dV += P^T dO, dP = dO V^T,
 *   dS = P o (dP - rowsum(dO o O)), dQ = scale dS K, dK += scale dS^T Q.
 * GQA: query head h reads kv head h / (Hq/Hkv); dK/dV are accumulated per query head in scratch and
 * then summed over the heads of each group in head order (deterministic).
 * Threads: OpenMP over (segment, head) tasks, each calling single-threaded sgemm (bt_sgemm inside
 * a parallel region; OpenBLAS is kept at one thread, see blas_par.c). */
#include "kernels/kernels.h"
#include "kernels/cpu/cpu_math.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define BT_ATTN_BQ 128

static int max_seg_len(const int32_t *cu, int n_seq)
{
    int mx = 0;
    for (int s = 0; s < n_seq; s++)
        if (cu[s + 1] - cu[s] > mx)
            mx = cu[s + 1] - cu[s];
    return mx;
}

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

/* q [M, Hq, D], k, v [M, Hkv, D], out [M, Hq, D], lse [M, Hq] (natural log); cu_seqlens [n_seq+1]
 * nondecreasing with cu[0] = 0 and cu[n_seq] = M (rows outside get out = 0, lse = 0); scale is the
 * softmax scale (1/sqrt(D) for Llama). All fp32, caller owned. Memory: allocates
 * threads x BT_ATTN_BQ x max_segment_len floats of scratch (returns with out untouched except the
 * uncovered rows if that allocation fails; the trainer sizes segments <= T so this is ~1 MiB). */
void bt_attn_fwd(float *out, float *lse, const float *q, const float *k, const float *v,
                 const int32_t *cu_seqlens, int n_seq, int M, int Hq, int Hkv, int D, float scale)
{
    if (M <= 0 || n_seq <= 0 || Hq <= 0 || Hkv <= 0 || D <= 0)
        return;
    zero_uncovered(out, (int64_t)Hq * D, cu_seqlens, n_seq, M);
    zero_uncovered(lse, Hq, cu_seqlens, n_seq, M);
    const int maxL = max_seg_len(cu_seqlens, n_seq);
    if (maxL <= 0)
        return;
    const int group = Hq / Hkv;
    const int ldq = Hq * D, ldk = Hkv * D;
    const int ntasks = n_seq * Hq;
#ifdef _OPENMP
    const int nthr = omp_get_max_threads() < ntasks ? omp_get_max_threads() : ntasks;
#else
    const int nthr = 1;
#endif
    const size_t per = (size_t)BT_ATTN_BQ * (size_t)maxL;
    float *scratch = malloc((size_t)nthr * per * sizeof(float));
    if (!scratch)
        return;
    bt_cpu_blas_init();
#pragma omp parallel num_threads(nthr)
    {
#ifdef _OPENMP
        float *S = scratch + (size_t)omp_get_thread_num() * per;
#else
        float *S = scratch;
#endif
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < ntasks; task++) {
            const int s = task / Hq, h = task % Hq, g = h / group;
            const int start = cu_seqlens[s], L = cu_seqlens[s + 1] - start;
            if (L <= 0)
                continue;
            const float *Q = q + (size_t)start * ldq + (size_t)h * D;
            const float *K = k + (size_t)start * ldk + (size_t)g * D;
            const float *V = v + (size_t)start * ldk + (size_t)g * D;
            float *O = out + (size_t)start * ldq + (size_t)h * D;
            for (int i0 = 0; i0 < L; i0 += BT_ATTN_BQ) {
                const int bq = L - i0 < BT_ATTN_BQ ? L - i0 : BT_ATTN_BQ;
                const int nk = i0 + bq; /* keys 0 .. i0+bq-1 can be seen by this block */
                bt_sgemm(0, 1, bq, nk, D, scale,
                            Q + (size_t)i0 * ldq, ldq, K, ldk, 0.0f, S, nk);
                for (int r = 0; r < bq; r++) {
                    float *row = S + (size_t)r * nk;
                    const int nv = i0 + r + 1; /* valid keys j < nv */
                    float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
                    for (int j = 0; j < nv; j++)
                        mx = row[j] > mx ? row[j] : mx;
                    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                    for (int j = 0; j < nv; j++) {
                        float e = bt_expf(row[j] - mx);
                        row[j] = e;
                        sum += e;
                    }
                    const float inv = 1.0f / sum;
#pragma omp simd
                    for (int j = 0; j < nv; j++)
                        row[j] *= inv;
                    for (int j = nv; j < nk; j++)
                        row[j] = 0.0f;
                    lse[(size_t)(start + i0 + r) * Hq + h] = mx + logf(sum);
                }
                bt_sgemm(0, 0, bq, D, nk, 1.0f, S, nk, V,
                            ldk, 0.0f, O + (size_t)i0 * ldq, ldq);
            }
        }
    }
    free(scratch);
}

/* Backward of bt_attn_fwd. dout, out [M, Hq, D]; lse [M, Hq] from the forward; q, k, v as in the
 * forward. dq [M, Hq, D], dk, dv [M, Hkv, D] are overwritten. Scratch: 2 x M x Hq x D floats for the
 * per-query-head dK/dV plus threads x (2 x BT_ATTN_BQ x max_segment_len + BT_ATTN_BQ) floats; if an
 * allocation fails the outputs are zeroed (the caller sees zero gradients, never garbage). */
void bt_attn_bwd(float *dq, float *dk, float *dv, const float *dout, const float *out,
                 const float *lse, const float *q, const float *k, const float *v,
                 const int32_t *cu_seqlens, int n_seq, int M, int Hq, int Hkv, int D, float scale)
{
    if (M <= 0 || Hq <= 0 || Hkv <= 0 || D <= 0)
        return;
    const size_t nq = (size_t)M * Hq * D, nkv = (size_t)M * Hkv * D;
    const int maxL = n_seq > 0 ? max_seg_len(cu_seqlens, n_seq) : 0;
    const int group = Hq / Hkv;
    const int ldq = Hq * D, ldk = Hkv * D;
    const int ntasks = n_seq * Hq;
#ifdef _OPENMP
    const int nthr = ntasks < 1 ? 1 : (omp_get_max_threads() < ntasks ? omp_get_max_threads() : ntasks);
#else
    const int nthr = 1;
#endif
    const size_t per = 2 * (size_t)BT_ATTN_BQ * (size_t)(maxL > 0 ? maxL : 1) + BT_ATTN_BQ;
    float *dkh = group > 1 ? calloc(nq, sizeof(float)) : NULL;
    float *dvh = group > 1 ? calloc(nq, sizeof(float)) : NULL;
    float *scratch = malloc((size_t)nthr * per * sizeof(float));
    memset(dq, 0, nq * sizeof(float));
    if (group == 1) { /* accumulate straight into dk/dv */
        memset(dk, 0, nkv * sizeof(float));
        memset(dv, 0, nkv * sizeof(float));
        dkh = dk;
        dvh = dv;
    } else if (!dkh || !dvh) {
        goto fail;
    }
    if (!scratch)
        goto fail;
    if (maxL > 0) {
        /* per-head accumulators use the q layout [M, Hq, D] (or dk/dv directly when Hq == Hkv) */
        const int ldh = group > 1 ? ldq : ldk;
        bt_cpu_blas_init();
#pragma omp parallel num_threads(nthr)
        {
#ifdef _OPENMP
            float *P = scratch + (size_t)omp_get_thread_num() * per;
#else
            float *P = scratch;
#endif
            float *dP = P + (size_t)BT_ATTN_BQ * maxL;
            float *Di = dP + (size_t)BT_ATTN_BQ * maxL;
#pragma omp for schedule(dynamic, 1)
            for (int task = 0; task < ntasks; task++) {
                const int s = task / Hq, h = task % Hq, g = h / group;
                const int start = cu_seqlens[s], L = cu_seqlens[s + 1] - start;
                if (L <= 0)
                    continue;
                const float *Q = q + (size_t)start * ldq + (size_t)h * D;
                const float *K = k + (size_t)start * ldk + (size_t)g * D;
                const float *V = v + (size_t)start * ldk + (size_t)g * D;
                const float *O = out + (size_t)start * ldq + (size_t)h * D;
                const float *dO = dout + (size_t)start * ldq + (size_t)h * D;
                const float *LSE = lse + (size_t)start * Hq + h;
                float *dQ = dq + (size_t)start * ldq + (size_t)h * D;
                float *dK = dkh + (size_t)start * ldh + (size_t)(group > 1 ? h : g) * D;
                float *dV = dvh + (size_t)start * ldh + (size_t)(group > 1 ? h : g) * D;
                for (int i0 = 0; i0 < L; i0 += BT_ATTN_BQ) {
                    const int bq = L - i0 < BT_ATTN_BQ ? L - i0 : BT_ATTN_BQ;
                    const int nk = i0 + bq;
                    const float *Qb = Q + (size_t)i0 * ldq;
                    const float *dOb = dO + (size_t)i0 * ldq;
                    /* P = exp(scale Q K^T - lse), masked */
                    bt_sgemm(0, 1, bq, nk, D, scale, Qb, ldq,
                                K, ldk, 0.0f, P, nk);
                    for (int r = 0; r < bq; r++) {
                        float *row = P + (size_t)r * nk;
                        const int nv = i0 + r + 1;
                        const float l = LSE[(size_t)(i0 + r) * Hq];
#pragma omp simd
                        for (int j = 0; j < nv; j++)
                            row[j] = bt_expf(row[j] - l);
                        for (int j = nv; j < nk; j++)
                            row[j] = 0.0f;
                        const float *o = O + (size_t)(i0 + r) * ldq, *dor = dOb + (size_t)r * ldq;
                        float di = 0.0f;
#pragma omp simd reduction(+ : di)
                        for (int d = 0; d < D; d++)
                            di += dor[d] * o[d];
                        Di[r] = di;
                    }
                    /* dV[0:nk] += P^T dO_b */
                    bt_sgemm(1, 0, nk, D, bq, 1.0f, P, nk, dOb,
                                ldq, 1.0f, dV, ldh);
                    /* dP = dO_b V^T */
                    bt_sgemm(0, 1, bq, nk, D, 1.0f, dOb, ldq,
                                V, ldk, 0.0f, dP, nk);
                    /* dS = P o (dP - Di), stored in dP (zero where masked since P is 0 there) */
                    for (int r = 0; r < bq; r++) {
                        float *dpr = dP + (size_t)r * nk;
                        const float *pr = P + (size_t)r * nk;
                        const float di = Di[r];
#pragma omp simd
                        for (int j = 0; j < nk; j++)
                            dpr[j] = pr[j] * (dpr[j] - di);
                    }
                    /* dQ_b = scale dS K ; dK[0:nk] += scale dS^T Q_b */
                    bt_sgemm(0, 0, bq, D, nk, scale, dP, nk,
                                K, ldk, 0.0f, dQ + (size_t)i0 * ldq, ldq);
                    bt_sgemm(1, 0, nk, D, bq, scale, dP, nk, Qb,
                                ldq, 1.0f, dK, ldh);
                }
            }
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
    free(scratch);
    return;
fail:
    memset(dk, 0, nkv * sizeof(float));
    memset(dv, 0, nkv * sizeof(float));
    if (group > 1) {
        free(dkh);
        free(dvh);
    }
    free(scratch);
}
