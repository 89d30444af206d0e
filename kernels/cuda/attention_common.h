/* Pieces shared by the two attention implementations, kernels/cuda/attention.cu (wmma) and
 * kernels/cuda/attention_mma.cu (mma.sync): the LongLoRA S^2-Attn group bounds, the causal/S^2
 * visibility rule, the RoPE frequency table in shared memory, shared-memory carving, the
 * launchers' argument checks and common entry, the delta (rowsum dO*O) kernel of both backwards
 * and the dynamic shared-memory opt-in. Semantics: kernels_cuda.h
 * (bt_cuda_attn_params). Include only from .cu files. */
#ifndef BT_ATTENTION_COMMON_H
#define BT_ATTENTION_COMMON_H
#include "kernels/cuda/cuda_internal.h"

/* S^2-Attn (LongLoRA, arXiv 2309.12307; llama_attn_replace.py, varlen without roll): first key of
 * query i's group, positions local to the document. Unshifted heads: groups [kG, (k+1)G); shifted
 * heads (h >= Hq/2): groups shifted by G/2, half-size groups at both ends. */
static __device__ __forceinline__ int bt_s2_group_start(int i, int G, bool shifted)
{
    if (!shifted)
        return (i / G) * G;
    const int gs = ((i + G / 2) / G) * G - G / 2;
    return gs > 0 ? gs : 0;
}
/* one past the last query whose group contains key j */
static __device__ __forceinline__ int bt_s2_group_end(int j, int G, bool shifted)
{
    if (!shifted)
        return (j / G + 1) * G;
    return ((j + G / 2) / G) * G + G / 2;
}
/* The first key query i sees (local positions within one document): the start of its S^2 group
 * when G > 0, and with a sliding window of W > 0 keys no earlier than i - W + 1 (transformers'
 * sliding-window causal mask, kernels/cpu/attention.c win_lo: key j visible iff i - W < j <= i).
 * Nondecreasing in i, so a tile's first row bounds the whole tile from below. */
static __device__ __forceinline__ int bt_att_key_lo(int i, int G, bool shifted, int W)
{
    int lo = G > 0 ? bt_s2_group_start(i, G, shifted) : 0;
    if (W > 0 && i - W + 1 > lo)
        lo = i - W + 1;
    return lo;
}
/* One past the last query that sees key j in a document of L tokens: the end of j's S^2 group,
 * j + W with a window, L otherwise. Nondecreasing in j (a tile's last key bounds it from above). */
static __device__ __forceinline__ int bt_att_query_end(int j, int G, bool shifted, int W, int L)
{
    int e = G > 0 ? min(L, bt_s2_group_end(j, G, shifted)) : L;
    if (W > 0 && W < e - j) /* j + W < e without overflow */
        e = j + W;
    return e;
}
/* query i may attend key j (local positions within one document): causal, inside i's S^2 group
 * when G > 0, inside its window when W > 0 */
static __device__ __forceinline__ bool bt_att_visible(int i, int j, int G, bool shifted, int W)
{
    return j <= i && j >= bt_att_key_lo(i, G, shifted, W);
}

/* The RoPE inverse frequencies into shared memory (all threads of the block take part): the
 * model's table when given (default / linear / llama3 / GGUF rope_freqs, computed on the host as
 * transformers does), else 1/theta^(2i/D). */
static __device__ __forceinline__ void bt_att_init_inv_freq(float *inv_freq, int D, float theta,
                                                            const float *table)
{
    for (int i = threadIdx.x; i < D / 2; i += blockDim.x)
        inv_freq[i] = table ? table[i] : 1.0f / powf(theta, (float)(2 * i) / (float)D);
}

/* shared-memory carving: 128-byte aligned regions */
static __host__ __device__ constexpr size_t bt_att_align(size_t x) { return (x + 127) & ~(size_t)127; }

/* The kernels' view of bt_cuda_attn_params (by value, in the kernel's parameter space). */
struct BtAttArgs {
    int M, Hq, Hkv, n_seq, nblk, G; /* nblk = ceil(max_seqlen / tile); G = s2_group */
    int W;                          /* sliding window (0: none) */
    const int32_t *cu;              /* cu_seqlens [n_seq + 1] */
    int64_t ldq, ldk, ldv;
    float scale, theta, pos_scale;
    const int32_t *pos;             /* position_ids or NULL (no RoPE) */
    const float *invf;              /* [D/2] device RoPE table or NULL (derive from theta) */
};
static inline BtAttArgs bt_att_args(const bt_cuda_attn_params *p, int tile)
{
    BtAttArgs a;
    a.M = p->M;
    a.Hq = p->Hq;
    a.Hkv = p->Hkv;
    a.n_seq = p->n_seq;
    a.nblk = (p->max_seqlen + tile - 1) / tile;
    a.G = p->s2_group;
    a.W = p->window;
    a.cu = p->cu_seqlens;
    a.ldq = p->ldq;
    a.ldk = p->ldk;
    a.ldv = p->ldv;
    a.scale = p->scale;
    a.theta = p->rope_theta;
    a.pos_scale = p->pos_scale;
    a.pos = p->position_ids;
    a.invf = p->inv_freq;
    return a;
}

/* Argument checks of bt_cuda_attn_fwd/bwd and their _mma twins (same codes; `who` the launcher, for
 * the message): BT_ERR_INVALID for bad shapes, strides, a negative window or NULL pointers;
 * BT_ERR_UNSUPPORTED for D not in {64, 128, 256} (the _mma launchers refuse 256 themselves),
 * strides not multiples of 8 or pointers not 16-byte aligned (the kernels use 16-byte vector
 * accesses). */
static inline int bt_att_check(const char *who, const bt_cuda_attn_params *p,
                               const void *const *ptrs, int nptr)
{
    BT_CU_REFUSE_AS(who, BT_ERR_INVALID, !p || p->M < 0 || p->Hq <= 0 || p->Hkv <= 0 ||
                                         p->Hq % p->Hkv != 0 || p->n_seq < 0 || p->max_seqlen < 0 ||
                                         (p->n_seq > 0 && !p->cu_seqlens) || p->s2_group < 0 ||
                                         (p->s2_group & 1) || p->window < 0);
    BT_CU_REFUSE_AS(who, BT_ERR_UNSUPPORTED, p->D != 64 && p->D != 128 && p->D != 256);
    const int64_t hd = (int64_t)p->D;
    BT_CU_REFUSE_AS(who, BT_ERR_INVALID, p->ldq < p->Hq * hd || p->ldk < p->Hkv * hd ||
                                         p->ldv < p->Hkv * hd);
    /* 16-byte row alignment for the vector loads */
    BT_CU_REFUSE_AS(who, BT_ERR_UNSUPPORTED, p->ldq % 8 || p->ldk % 8 || p->ldv % 8);
    for (int i = 0; i < nptr; i++) {
        BT_CU_REFUSE_AS(who, BT_ERR_INVALID, !ptrs[i]);
        BT_CU_REFUSE_AS(who, BT_ERR_UNSUPPORTED, (uintptr_t)ptrs[i] & 15);
    }
    return BT_OK;
}

/* The common entry of the four launchers (bt_cuda_attn_fwd/bwd and their _mma twins): the checks
 * of bt_att_check on ptrs, and for a backward (bwd) lse and delta present (else
 * BT_ERR_INVALID). Returns the error, 1 when there is nothing to compute (no token, document or
 * row: the launcher enqueues nothing and returns BT_OK), or 0 to go on. */
static inline int bt_att_enter(const char *who, const bt_cuda_attn_params *p,
                               const void *const *ptrs, int nptr, bool bwd, const float *lse,
                               const float *delta)
{
    const int rc = bt_att_check(who, p, ptrs, nptr);
    if (rc)
        return rc;
    BT_CU_REFUSE_AS(who, BT_ERR_INVALID, bwd && (!lse || !delta));
    return p->M == 0 || p->n_seq == 0 || p->max_seqlen == 0 ? 1 : 0;
}

/* Backward pass 1 of both implementations (FlashAttention-2 Algorithm 2 line 4):
 * delta[row] = sum_d dout[row, d] * out[row, d] in fp32, rows = M*Hq of the contiguous
 * [M, Hq, D] bf16 dout and out (16-byte aligned, bt_att_check); D/8 lanes per row with 16-byte
 * loads, reduced by shuffles within the lane group. Launch with rows*(D/8) threads. */
template <int D>
static __global__ void bt_att_delta_kernel(float *delta, const bt_bf16 *dout, const bt_bf16 *out,
                                           int64_t rows)
{
    constexpr int LPR = D / 8;
    const int64_t gid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t row = gid / LPR;
    const int c = (int)(gid % LPR);
    float s = 0.0f;
    if (row < rows) {
        const uint4 x = *reinterpret_cast<const uint4 *>(dout + row * D + c * 8);
        const uint4 y = *reinterpret_cast<const uint4 *>(out + row * D + c * 8);
        const __nv_bfloat162 *hx = reinterpret_cast<const __nv_bfloat162 *>(&x);
        const __nv_bfloat162 *hy = reinterpret_cast<const __nv_bfloat162 *>(&y);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float2 a = __bfloat1622float2(hx[j]), b = __bfloat1622float2(hy[j]);
            s += a.x * b.x;
            s += a.y * b.y;
        }
    }
#pragma unroll
    for (int o = LPR / 2; o > 0; o >>= 1)
        s += __shfl_xor_sync(0xffffffffu, s, o);
    if (c == 0 && row < rows)
        delta[row] = s;
}

/* Raise a kernel's dynamic shared-memory limit above the 48 KB default (host call, cheap; D the
 * head_dim, for the message). A device whose per-block opt-in limit
 * (cudaDevAttrMaxSharedMemoryPerBlockOptin: sm_86 / sm_89: 99 KB, which the sm_80 binary also
 * runs on; sm_80: 163 KB; sm_90: 227 KB, CUDA C Programming Guide, "Compute Capabilities") is
 * below `smem` is BT_ERR_UNSUPPORTED with a message naming head_dim and both sizes, instead of
 * the bare "invalid argument" of cudaFuncSetAttribute at the first launch. */
template <typename K>
static int bt_att_smem(K kernel, size_t smem, int D)
{
    /* the current device's limit, asked at every launch (an attribute read, not the slow
     * cudaGetDeviceProperties): a process that switches devices is judged by the right one */
    int dev = 0, optin = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess)
    {
        optin = 0; /* unknown: cudaFuncSetAttribute below reports what the runtime says */
        (void)cudaGetLastError(); /* not left for the launch check to find */
    }
    if (optin > 0 && smem > (size_t)optin) {
        return bt_fail(BT_ERR_UNSUPPORTED, "cuda: attention kernel for head_dim %d needs %zu bytes "
                       "of shared memory per block; this device allows %d (%s)", D, smem, optin,
                       D == 256 ? "head_dim 256 needs an sm_90 GPU: H100 / H200, 227 KB"
                                : "for head_dim 128 use config cuda.attention \"wmma\" if it "
                                  "fits, or a GPU with more shared memory: sm_80, sm_90");
    }
    return BT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              (int)smem));
}
#endif
