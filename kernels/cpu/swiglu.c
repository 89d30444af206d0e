/* SwiGLU activation (Shazeer 2020, "GLU Variants Improve Transformer", arXiv 2002.05202; HF
 * LlamaMLP: down(act_fn(gate(x)) * up(x)) with act_fn = SiLU) and the token embedding lookup. */
#include "kernels/kernels.h"
#include "kernels/cpu/cpu_math.h"
#include "common/bt_common.h"

#include <omp.h>
#include <string.h>

int bt_cpu_max_threads(void)
{
    return omp_get_max_threads();
}

/* h[i] = silu(gate[i]) * up[i], silu(g) = g * sigmoid(g) = g / (1 + exp(-g)); n fp32 elements,
 * any shape (elementwise); h may alias neither input. exp via bt_expf (~2 ulp). */
void bt_swiglu_fwd(float *h, const float *gate, const float *up, int64_t n)
{
#pragma omp parallel for simd schedule(static) if (n >= 32768)
    for (int64_t i = 0; i < n; i++) {
        float g = gate[i];
        float sig = 1.0f / (1.0f + bt_expf(-g));
        h[i] = g * sig * up[i];
    }
}

/* Backward of bt_swiglu_fwd: with s = sigmoid(g),
 *   dgate = dh * up * s * (1 + g*(1 - s))   (d silu/dg = s + g*s*(1-s)),
 *   dup   = dh * g * s.
 * dgate, dup [n] overwritten; each element's inputs are read before its outputs are written, so
 * dgate/dup may alias dh, gate or up (elementwise in-place use). */
void bt_swiglu_bwd(float *dgate, float *dup, const float *dh, const float *gate, const float *up,
                   int64_t n)
{
#pragma omp parallel for simd schedule(static) if (n >= 32768)
    for (int64_t i = 0; i < n; i++) {
        float g = gate[i];
        float s = 1.0f / (1.0f + bt_expf(-g));
        float d = dh[i];
        dgate[i] = d * up[i] * (s * (1.0f + g * (1.0f - s)));
        dup[i] = d * (g * s);
    }
}

#define BT_GELU_C 0.7978845608028654f /* sqrt(2 / pi) */
#define BT_GELU_A 0.044715f

/* 1 + tanh(z) = 2 sigmoid(2z) (no cancellation where tanh(z) is near -1), so
 * gelu_tanh(g) = 0.5 g (1 + tanh(z)) = g * s with s = sigmoid(2z), z = c (g + a g^3). */
static inline float gelu_sig(float g)
{
    const float z = BT_GELU_C * (g + BT_GELU_A * g * g * g);
    return 1.0f / (1.0f + bt_expf(-2.0f * z));
}

/* h[i] = gelu_tanh(gate[i]) * up[i] (kernels.h). */
void bt_geglu_fwd(float *h, const float *gate, const float *up, int64_t n)
{
#pragma omp parallel for simd schedule(static) if (n >= 32768)
    for (int64_t i = 0; i < n; i++) {
        const float g = gate[i];
        h[i] = g * gelu_sig(g) * up[i];
    }
}

/* Backward of bt_geglu_fwd: with s = sigmoid(2z) (1 + t = 2s, 1 - t^2 = 4 s (1 - s)),
 *   d gelu/dg = s + 2 g s (1 - s) c (1 + 3 a g^2),
 *   dgate = dh * up * d gelu/dg,  dup = dh * g s. Aliasing as bt_swiglu_bwd. */
void bt_geglu_bwd(float *dgate, float *dup, const float *dh, const float *gate, const float *up,
                  int64_t n)
{
#pragma omp parallel for simd schedule(static) if (n >= 32768)
    for (int64_t i = 0; i < n; i++) {
        const float g = gate[i], u = up[i], d = dh[i];
        const float s = gelu_sig(g);
        const float dgelu = s + 2.0f * g * s * (1.0f - s) * BT_GELU_C * (1.0f + 3.0f * BT_GELU_A * g * g);
        dgate[i] = d * u * dgelu;
        dup[i] = d * (g * s);
    }
}

/* out[m, :] = table[ids[m], :] for m < M; table [vocab, D] fp32. An id outside [0, vocab) is
 * refused before anything is written (BT_ERR_RANGE, bt_embedding_check_ids). Rows are copied in
 * parallel. */
int bt_embedding_fwd(float *out, const float *table, const int32_t *ids, int M, int D, int vocab)
{
    if (M < 0 || D <= 0 || vocab <= 0 || (M > 0 && (!out || !table || !ids)))
        return bt_fail(BT_ERR_INVALID, "embedding forward: M %d, D %d, vocab %d%s", M, D, vocab,
                       M > 0 && (!out || !table || !ids) ? ", a NULL pointer" : "");
    const int rc = bt_embedding_check_ids(ids, M, vocab, "forward");
    if (rc)
        return rc;
#pragma omp parallel for schedule(static) if ((int64_t)M * D >= 65536)
    for (int m = 0; m < M; m++)
        memcpy(out + (size_t)m * D, table + (size_t)ids[m] * D, (size_t)D * sizeof(float));
    return BT_OK;
}
