/* Fused linear + cross-entropy, chunked over tokens so that at most chunk_rows x V logits exist at
 * a time (Liger Kernel FusedLinearCrossEntropy, src/liger_kernel/ops/fused_linear_cross_entropy.py;
 * Apple Cut Cross-Entropy, arXiv 2411.09009; see docs/algorithms.md §Cross-entropy).
 * Per chunk: logits = X_c W^T (bt_sgemm), per row max / log-sum-exp with max subtraction,
 * loss = lse - logit[target]; gradient dlogits = (softmax - onehot) * grad_scale written over the
 * logits, then dX_c = dlogits W (bt_sgemm). Matches torch.nn.functional.cross_entropy
 * (reduction="sum", ignore_index=-100) on logits = X @ W^T. */
#include "kernels/kernels.h"
#include "kernels/cpu/cpu_math.h"

#include <math.h>
#include <string.h>

/* Floats of workspace bt_linear_ce needs: the chunk_rows x V logits block plus chunk_rows per-row
 * losses (as doubles, 2 floats each). */
size_t bt_linear_ce_workspace_floats(int chunk_rows, int V)
{
    if (chunk_rows <= 0 || V <= 0)
        return 0;
    return (size_t)chunk_rows * (size_t)V + 2 * (size_t)chunk_rows;
}

/* X [M, D], W [V, D] fp32 (W is the lm_head / tied embedding, read only); targets [M] int32.
 * A target outside [0, V) (including -100, the ignore index) is ignored: no loss, zero gradient
 * row, not counted; validating labels is the data pipeline's job, this kernel never reads out of
 * bounds. Returns the sum over counted rows of (lse - logit[target]) in double (per-row values
 * computed in fp32 logits with the exp-sum accumulated in double, summed in row order, so the
 * result does not depend on the thread count); *n_valid (if non-NULL) gets the count.
 * If dX != NULL, dX [M, D] is overwritten with grad_scale * d(loss sum)/dX (rows of ignored
 * targets get 0); the caller passes e.g. grad_scale = 1/n_valid_total for a mean loss.
 * chunk_rows > 0 rows of logits are processed per step (any value; need not divide M);
 * workspace >= bt_linear_ce_workspace_floats(chunk_rows, V) floats, caller owned.
 * No gradient for W here (the base lm_head is frozen under LoRA); bt_linear_ce_dw adds it. */
/* row_scale (NULL: all 1) multiplies grad_scale per row: row m's gradient is
 * grad_scale * row_scale[m] * d(loss_m)/d(.) (used by bt_linear_logprob for a per-token upstream
 * gradient). row_out (NULL: not written) gets each row's loss as float (0 for ignored rows). */
static double linear_ce_core(float *dX, float *dW, int *n_valid, float *row_out, const float *X,
                             const float *W, const int32_t *targets, const float *row_scale,
                             int M, int D, int V, int chunk_rows, float grad_scale,
                             float *workspace)
{
    const int grad = dX != NULL || dW != NULL;
    if (n_valid)
        *n_valid = 0;
    if (M <= 0 || V <= 0 || chunk_rows <= 0)
        return 0.0;
    float *logits = workspace;
    /* per-row losses as doubles after the logits; only 4-byte aligned, so accessed with memcpy */
    unsigned char *row_loss = (unsigned char *)(workspace + (size_t)chunk_rows * V);
    double total = 0.0;
    int count = 0;
    for (int r0 = 0; r0 < M; r0 += chunk_rows) {
        const int cr = M - r0 < chunk_rows ? M - r0 : chunk_rows;
        bt_sgemm(0, 1, cr, V, D, 1.0f, X + (size_t)r0 * D, D,
                    W, D, 0.0f, logits, V);
#pragma omp parallel for schedule(static)
        for (int r = 0; r < cr; r++) {
            float *row = logits + (size_t)r * V;
            const int32_t t = targets[r0 + r];
            double loss = 0.0;
            if (t >= 0 && t < V) {
                float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
                for (int j = 0; j < V; j++)
                    mx = row[j] > mx ? row[j] : mx;
                const float target_logit = row[t];
                double sum = 0.0;
                if (grad) {
#pragma omp simd reduction(+ : sum)
                    for (int j = 0; j < V; j++) {
                        float e = bt_expf(row[j] - mx);
                        row[j] = e;
                        sum += (double)e;
                    }
                } else {
#pragma omp simd reduction(+ : sum)
                    for (int j = 0; j < V; j++)
                        sum += (double)bt_expf(row[j] - mx);
                }
                const double lse = (double)mx + log(sum);
                loss = lse - (double)target_logit;
                if (grad) {
                    const float gs = row_scale ? grad_scale * row_scale[r0 + r] : grad_scale;
                    const float c = (float)((double)gs / sum);
#pragma omp simd
                    for (int j = 0; j < V; j++)
                        row[j] *= c;
                    row[t] -= gs;
                }
            } else if (grad) {
                memset(row, 0, (size_t)V * sizeof(float));
            }
            memcpy(row_loss + (size_t)r * sizeof(double), &loss, sizeof loss);
        }
        for (int r = 0; r < cr; r++) {
            double l;
            memcpy(&l, row_loss + (size_t)r * sizeof(double), sizeof l);
            if (row_out)
                row_out[r0 + r] = (float)l;
            if (targets[r0 + r] >= 0 && targets[r0 + r] < V) {
                total += l;
                count++;
            }
        }
        if (dX)
            bt_sgemm(0, 0, cr, D, V, 1.0f, logits, V, W, D,
                        0.0f, dX + (size_t)r0 * D, D);
        /* dW[V, D] += dlogits_c^T [V, cr] @ X_c [cr, D]; chunks are added in order, so the sum
         * order is fixed for a given thread count */
        if (dW)
            bt_sgemm(1, 0, V, D, cr, 1.0f, logits, V, X + (size_t)r0 * D, D,
                        1.0f, dW, D);
    }
    if (n_valid)
        *n_valid = count;
    return total;
}

double bt_linear_ce(float *dX, int *n_valid, const float *X, const float *W, const int32_t *targets,
                    int M, int D, int V, int chunk_rows, float grad_scale, float *workspace)
{
    return linear_ce_core(dX, NULL, n_valid, NULL, X, W, targets, NULL, M, D, V, chunk_rows,
                          grad_scale, workspace);
}

/* As bt_linear_ce, plus (when dW != NULL) dW [V, D] += grad_scale * d(loss sum)/dW, i.e. the
 * sum over chunks of dlogits_c^T @ X_c (Liger FusedLinearCrossEntropy's grad_weight; used when
 * the lm_head, or the embedding tied to it, is trainable). dX and dW may each be NULL. */
double bt_linear_ce_dw(float *dX, float *dW, int *n_valid, const float *X, const float *W,
                       const int32_t *targets, int M, int D, int V, int chunk_rows,
                       float grad_scale, float *workspace)
{
    return linear_ce_core(dX, dW, n_valid, NULL, X, W, targets, NULL, M, D, V, chunk_rows,
                          grad_scale, workspace);
}

/* Per-token label log-probs log softmax(X W^T)[m, targets[m]] = -(lse_m - logit_m[target]) from
 * the same chunked pass (never [M x V] logits), and their backward for any per-token upstream
 * gradient: the loss core with row_out negated and grad_scale -1 times dlogp (d logp / d logits
 * = onehot - softmax, the negative of the cross-entropy gradient). Preference losses (DPO, KTO,
 * ORPO, SimPO; trainer/preference.h) sum these over a sequence's response tokens, as TRL
 * 1.16.0 does (trl/trainer/dpo_trainer.py: `per_token_logps.sum(dim=1)` of the fused LM head's
 * `log_probs`, labels -100 outside the completion giving 0). */
double bt_linear_logprob(float *logp, float *dX, float *dW, const float *X, const float *W,
                         const int32_t *targets, const float *dlogp, int M, int D, int V,
                         int chunk_rows, float *workspace)
{
    const double s = linear_ce_core(dX, dW, NULL, logp, X, W, targets, dlogp, M, D, V, chunk_rows,
                                    -1.0f, workspace);
    if (logp)
        for (int m = 0; m < M; m++)
            logp[m] = logp[m] == 0.0f ? 0.0f : -logp[m]; /* ignored rows: +0, not -0 */
    return -s;
}

/* Per-sequence sums of per-token values over valid targets (see kernels.h). */
int bt_seq_sum(double *out, int *n_tokens, const float *per_token, const int32_t *targets,
               const uint8_t *mask, const int32_t *cu_seqlens, int n_seq, int V)
{
    if (n_seq < 0 || !cu_seqlens || (n_seq > 0 && cu_seqlens[0] != 0))
        return -1;
    for (int s = 0; s < n_seq; s++)
        if (cu_seqlens[s + 1] < cu_seqlens[s])
            return -1;
    for (int s = 0; s < n_seq; s++) {
        double acc = 0.0;
        int n = 0;
        for (int m = cu_seqlens[s]; m < cu_seqlens[s + 1]; m++)
            if (targets[m] >= 0 && targets[m] < V && (!mask || mask[m])) {
                acc += (double)per_token[m];
                n++;
            }
        if (out)
            out[s] = acc;
        if (n_tokens)
            n_tokens[s] = n;
    }
    return 0;
}
