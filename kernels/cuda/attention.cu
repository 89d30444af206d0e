/* Fused causal varlen GQA attention with RoPE-on-load, S^2-Attn mask and saved lse: forward and
 * backward in the FlashAttention-2 style (Dao 2023, arXiv 2307.08691; Dao-AILab/flash-attention
 * csrc/flash_attn/src/flash_{fwd,bwd}_kernel.h for the split of the backward into a dK/dV pass per
 * key tile and a separate dQ pass, so no atomics are needed). LongLoRA S^2-Attn mask after
 * dvlab-research/LongLoRA llama_attn_replace.py forward_flashattn (varlen, no roll).
 *
 * This is the first, correctness-first tensor-core version: nvcuda::wmma m16n16k16 bf16 -> fp32
 * fragments; every matrix product goes shared memory -> fragments -> shared memory (block_mma), the
 * softmax / dS element work runs on all threads in between. Tiles: 64 queries x 64 keys, 4 warps
 * (head_dim 256: 16-query steps in the dK/dV pass, 32-query tiles in the dQ pass, to fit 227 KB).
 * Sliding window (bt_cuda_attn_params.window, the CPU bt_attn_fwd_win rule): key tiles before a
 * query tile's first window (forward, dQ) and query tiles past a key tile's last window (dK/dV)
 * are never visited; the tiles that straddle a window edge are masked per element.
 * Later versions: register-resident accumulators with mma.sync / wgmma, cp.async double buffering.
 * Contracts: kernels/cuda/kernels_cuda.h. Reference: kernels/cpu/attention.c (+ kernels/cpu/rope.c). */
#include "kernels/cuda/attention_common.h"

#include <mma.h>
#include <type_traits>

namespace wmma = nvcuda::wmma;

#define ATT_BC 64      /* keys per tile */
#define ATT_THREADS 128
#define ATT_WARPS 4
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

/* ------------------------------------------------------------------------- helpers */

/* C[M_,N_] (fp32, row-major, ldc) (+)= A[M_,K_] @ B[K_,N_] with bf16 operands in shared memory.
 * LA/LB are wmma::row_major or wmma::col_major: row_major A(i,k) = A[i*lda+k], col_major
 * A(i,k) = A[k*lda+i]; likewise B(k,j) = B[k*ldb+j] (row) or B[j*ldb+k] (col). Warps split the
 * 16x16 output tiles. Starts and ends with __syncthreads (all threads must call it). */
template <int M_, int N_, int K_, typename LA, typename LB>
__device__ __forceinline__ void block_mma(float *C, int ldc, const bt_bf16 *A, int lda,
                                          const bt_bf16 *B, int ldb, bool accumulate)
{
    __syncthreads();
    const int warp = threadIdx.x >> 5;
    constexpr int TM = M_ / 16, TN = N_ / 16;
    for (int t = warp; t < TM * TN; t += ATT_WARPS) {
        const int ti = t / TN, tj = t % TN;
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
        float *cp = C + ti * 16 * ldc + tj * 16;
        if (accumulate)
            wmma::load_matrix_sync(acc, cp, ldc, wmma::mem_row_major);
        else
            wmma::fill_fragment(acc, 0.0f);
#pragma unroll 4
        for (int tk = 0; tk < K_ / 16; tk++) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, LA> a;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, LB> b;
            const bt_bf16 *ap = std::is_same<LA, wmma::row_major>::value
                                    ? A + ti * 16 * lda + tk * 16
                                    : A + tk * 16 * lda + ti * 16;
            const bt_bf16 *bp = std::is_same<LB, wmma::row_major>::value
                                    ? B + tk * 16 * ldb + tj * 16
                                    : B + tj * 16 * ldb + tk * 16;
            wmma::load_matrix_sync(a, ap, lda);
            wmma::load_matrix_sync(b, bp, ldb);
            wmma::mma_sync(acc, a, b, acc);
        }
        wmma::store_matrix_sync(cp, acc, ldc, wmma::mem_row_major);
    }
    __syncthreads();
}

__device__ __forceinline__ void rot8(float a[8], float b[8], const float *inv_freq, int i0, int pos,
                                     float pos_scale, float dir)
{
    const float p = (float)pos * pos_scale;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        float s, c;
        sincosf(p * inv_freq[i0 + j], &s, &c);
        s *= dir;
        const float x1 = a[j], x2 = b[j];
        a[j] = x1 * c - x2 * s;
        b[j] = x2 * c + x1 * s;
    }
}
__device__ __forceinline__ void u4_to_f8(const uint4 &r, float f[8])
{
    const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&r);
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const float2 t = __bfloat1622float2(h[j]);
        f[2 * j] = t.x;
        f[2 * j + 1] = t.y;
    }
}
__device__ __forceinline__ uint4 f8_to_u4(const float f[8])
{
    uint4 r;
    __nv_bfloat162 *h = reinterpret_cast<__nv_bfloat162 *>(&r);
#pragma unroll
    for (int j = 0; j < 4; j++)
        h[j] = __floats2bfloat162_rn(f[2 * j], f[2 * j + 1]);
    return r;
}

/* Load rows [0, nvalid) of a [ROWS, D] tile (global row stride ldg elements) into shared memory
 * (row pitch lds), zero rows [nvalid, ROWS). If pos != NULL (positions of the tile's rows), the
 * HF rotate_half RoPE is applied on the way (pairs (i, i+D/2), 8 pairs per thread step). */
template <int D, int ROWS>
__device__ __forceinline__ void load_tile(bt_bf16 *s, int lds, const bt_bf16 *g, int64_t ldg,
                                          int nvalid, const int32_t *pos, const float *inv_freq,
                                          float pos_scale)
{
    constexpr int HALF = D / 2, CPR = HALF / 8; /* chunks (8 pairs) per row */
    for (int c = threadIdx.x; c < ROWS * CPR; c += ATT_THREADS) {
        const int r = c / CPR, i0 = (c % CPR) * 8;
        uint4 a = make_uint4(0, 0, 0, 0), b = a;
        if (r < nvalid) {
            a = *reinterpret_cast<const uint4 *>(g + r * ldg + i0);
            b = *reinterpret_cast<const uint4 *>(g + r * ldg + HALF + i0);
            if (pos) {
                float fa[8], fb[8];
                u4_to_f8(a, fa);
                u4_to_f8(b, fb);
                rot8(fa, fb, inv_freq, i0, pos[r], pos_scale, 1.0f);
                a = f8_to_u4(fa);
                b = f8_to_u4(fb);
            }
        }
        *reinterpret_cast<uint4 *>(s + r * lds + i0) = a;
        *reinterpret_cast<uint4 *>(s + r * lds + HALF + i0) = b;
    }
}

/* Store rows [0, nvalid) of an fp32 shared tile (pitch lds) as bf16 to global (stride ldg),
 * multiplying row r by rowmul[r] (if given) and applying the INVERSE RoPE rotation if pos != NULL
 * (gradients w.r.t. the unrotated input). */
template <int D, int ROWS>
__device__ __forceinline__ void store_tile(bt_bf16 *g, int64_t ldg, const float *s, int lds,
                                           int nvalid, const float *rowmul, const int32_t *pos,
                                           const float *inv_freq, float pos_scale)
{
    constexpr int HALF = D / 2, CPR = HALF / 8;
    for (int c = threadIdx.x; c < ROWS * CPR; c += ATT_THREADS) {
        const int r = c / CPR, i0 = (c % CPR) * 8;
        if (r >= nvalid)
            continue;
        const float mul = rowmul ? rowmul[r] : 1.0f;
        float fa[8], fb[8];
#pragma unroll
        for (int j = 0; j < 8; j++) {
            fa[j] = s[r * lds + i0 + j] * mul;
            fb[j] = s[r * lds + HALF + i0 + j] * mul;
        }
        if (pos)
            rot8(fa, fb, inv_freq, i0, pos[r], pos_scale, -1.0f);
        *reinterpret_cast<uint4 *>(g + r * ldg + i0) = f8_to_u4(fa);
        *reinterpret_cast<uint4 *>(g + r * ldg + HALF + i0) = f8_to_u4(fb);
    }
}

/* ----------------------------------------------------------------------------- forward */

template <int D>
struct FwdSmem {
    static constexpr int BR = 64;
    static constexpr int LDB = D + 8, LDS = ATT_BC + 4, LDP = ATT_BC + 8, LDO = D + 4;
    static constexpr size_t q = 0;
    static constexpr size_t k = bt_att_align(q + sizeof(bt_bf16) * BR * LDB);
    static constexpr size_t v = bt_att_align(k + sizeof(bt_bf16) * ATT_BC * LDB);
    static constexpr size_t s = bt_att_align(v + sizeof(bt_bf16) * ATT_BC * LDB);
    static constexpr size_t p = bt_att_align(s + sizeof(float) * BR * LDS);
    static constexpr size_t o = bt_att_align(p + sizeof(bt_bf16) * BR * LDP);
    static constexpr size_t f = bt_att_align(o + sizeof(float) * BR * LDO); /* inv_freq[D/2], rowmul[BR] */
    static constexpr size_t bytes = bt_att_align(f + sizeof(float) * (D / 2 + BR));
};

template <int D>
__global__ void __launch_bounds__(ATT_THREADS) attn_fwd_kernel(BtAttArgs a, bt_bf16 *out, float *lse,
                                                               const bt_bf16 *q, const bt_bf16 *k,
                                                               const bt_bf16 *v)
{
    using SM = FwdSmem<D>;
    constexpr int BR = SM::BR;
    extern __shared__ __align__(128) unsigned char smem[];
    bt_bf16 *sQ = reinterpret_cast<bt_bf16 *>(smem + SM::q);
    bt_bf16 *sK = reinterpret_cast<bt_bf16 *>(smem + SM::k);
    bt_bf16 *sV = reinterpret_cast<bt_bf16 *>(smem + SM::v);
    float *sS = reinterpret_cast<float *>(smem + SM::s);
    bt_bf16 *sP = reinterpret_cast<bt_bf16 *>(smem + SM::p);
    float *sO = reinterpret_cast<float *>(smem + SM::o);
    float *sInvF = reinterpret_cast<float *>(smem + SM::f);
    float *sRowMul = sInvF + D / 2;

    const int seq = blockIdx.x / a.nblk, qb = blockIdx.x % a.nblk, h = blockIdx.y;
    const int g = h / (a.Hq / a.Hkv);
    const int start = a.cu[seq], L = a.cu[seq + 1] - start;
    const int q0 = qb * BR;
    if (q0 >= L)
        return;
    const int nq = min(BR, L - q0);
    const bool shifted = a.G > 0 && h >= a.Hq / 2;
    if (a.pos)
        bt_att_init_inv_freq(sInvF, D, a.theta, a.invf);
    for (int i = threadIdx.x; i < BR * SM::LDO; i += ATT_THREADS)
        sO[i] = 0.0f;
    __syncthreads();
    const int32_t *pos = a.pos ? a.pos + start : nullptr;
    load_tile<D, BR>(sQ, SM::LDB, q + (int64_t)(start + q0) * a.ldq + (int64_t)h * D, a.ldq, nq,
                     pos ? pos + q0 : nullptr, sInvF, a.pos_scale);

    const float sl2 = a.scale * LOG2E;
    /* softmax work split: 2 threads per row, 32 columns each */
    const int row = threadIdx.x >> 1, half = threadIdx.x & 1;
    const int qi = q0 + row;
    float m_run = -INFINITY, l_run = 0.0f;
    const int kfirst = bt_att_key_lo(q0, a.G, shifted, a.W); /* key tiles before it skipped */
    const int kt0 = kfirst / ATT_BC, kt1 = (q0 + nq - 1) / ATT_BC;
    for (int kt = kt0; kt <= kt1; kt++) {
        const int k0 = kt * ATT_BC, nk = min(ATT_BC, L - k0);
        __syncthreads(); /* previous iteration's P V done with sK/sV */
        load_tile<D, ATT_BC>(sK, SM::LDB, k + (int64_t)(start + k0) * a.ldk + (int64_t)g * D, a.ldk,
                             nk, pos ? pos + k0 : nullptr, sInvF, a.pos_scale);
        load_tile<D, ATT_BC>(sV, SM::LDB, v + (int64_t)(start + k0) * a.ldv + (int64_t)g * D, a.ldv,
                             nk, nullptr, nullptr, 0.0f);
        block_mma<BR, ATT_BC, D, wmma::row_major, wmma::col_major>(sS, SM::LDS, sQ, SM::LDB, sK,
                                                                   SM::LDB, false);
        /* online softmax on this thread's half row */
        float sv[32];
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < 32; j++) {
            const int jj = half * 32 + j, kj = k0 + jj;
            const bool ok = row < nq && jj < nk && bt_att_visible(qi, kj, a.G, shifted, a.W);
            sv[j] = ok ? sS[row * SM::LDS + jj] * sl2 : -INFINITY;
            mx = fmaxf(mx, sv[j]);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        const float m_new = fmaxf(m_run, mx);
        const float alpha = m_new == -INFINITY ? 1.0f : exp2f(m_run - m_new);
        float ls = 0.0f;
#pragma unroll
        for (int j = 0; j < 32; j++) {
            const float pv = m_new == -INFINITY ? 0.0f : exp2f(sv[j] - m_new);
            const bt_bf16 pb = __float2bfloat16_rn(pv);
            sP[row * SM::LDP + half * 32 + j] = pb;
            ls += __bfloat162float(pb); /* normalise by exactly what P V sums */
        }
        ls += __shfl_xor_sync(0xffffffffu, ls, 1);
        l_run = l_run * alpha + ls;
        m_run = m_new;
        if (alpha != 1.0f)
            for (int c = half * (D / 2); c < (half + 1) * (D / 2); c++)
                sO[row * SM::LDO + c] *= alpha;
        block_mma<BR, D, ATT_BC, wmma::row_major, wmma::row_major>(sO, SM::LDO, sP, SM::LDP, sV,
                                                                   SM::LDB, true);
    }
    if (half == 0) {
        sRowMul[row] = l_run > 0.0f ? 1.0f / l_run : 0.0f;
        if (row < nq)
            lse[(int64_t)(start + qi) * a.Hq + h] =
                l_run > 0.0f ? (m_run + log2f(l_run)) * LN2 : -INFINITY;
    }
    __syncthreads();
    store_tile<D, BR>(out + (int64_t)(start + q0) * a.Hq * D + (int64_t)h * D, (int64_t)a.Hq * D, sO,
                      SM::LDO, nq, sRowMul, nullptr, nullptr, 0.0f);
}

/* ---------------------------------------------------------------------------- backward */

template <int D>
struct DkvSmem {
    /* query rows per step: fits sm_80's 163 KB at D=128, sm_90's 227 KB at D=256 */
    static constexpr int BR = D == 256 ? 16 : D == 128 ? 32 : 64;
    static constexpr int LDB = D + 8, LDS = ATT_BC + 4, LDP = ATT_BC + 8, LDA = D + 4;
    static constexpr size_t k = 0;
    static constexpr size_t v = bt_att_align(k + sizeof(bt_bf16) * ATT_BC * LDB);
    static constexpr size_t q = bt_att_align(v + sizeof(bt_bf16) * ATT_BC * LDB);
    static constexpr size_t dO = bt_att_align(q + sizeof(bt_bf16) * BR * LDB);
    static constexpr size_t s = bt_att_align(dO + sizeof(bt_bf16) * BR * LDB);
    static constexpr size_t dp = bt_att_align(s + sizeof(float) * BR * LDS);
    static constexpr size_t p = bt_att_align(dp + sizeof(float) * BR * LDS);
    static constexpr size_t ds = bt_att_align(p + sizeof(bt_bf16) * BR * LDP);
    static constexpr size_t dk = bt_att_align(ds + sizeof(bt_bf16) * BR * LDP);
    static constexpr size_t dv = bt_att_align(dk + sizeof(float) * ATT_BC * LDA);
    static constexpr size_t f = bt_att_align(dv + sizeof(float) * ATT_BC * LDA); /* inv_freq, lse2, delta */
    static constexpr size_t bytes = bt_att_align(f + sizeof(float) * (D / 2 + 2 * BR));
};

/* One CTA per (64-key tile, kv head, document): dK, dV for the tile, summed over all query heads of
 * the GQA group and all query rows that see the tile (no atomics). */
template <int D>
__global__ void __launch_bounds__(ATT_THREADS) attn_bwd_dkdv_kernel(
    BtAttArgs a, bt_bf16 *dk, bt_bf16 *dv, const bt_bf16 *dout, const float *lse, const float *delta,
    const bt_bf16 *q, const bt_bf16 *k, const bt_bf16 *v)
{
    using SM = DkvSmem<D>;
    constexpr int BR = SM::BR;
    extern __shared__ __align__(128) unsigned char smem[];
    bt_bf16 *sK = reinterpret_cast<bt_bf16 *>(smem + SM::k);
    bt_bf16 *sV = reinterpret_cast<bt_bf16 *>(smem + SM::v);
    bt_bf16 *sQ = reinterpret_cast<bt_bf16 *>(smem + SM::q);
    bt_bf16 *sdO = reinterpret_cast<bt_bf16 *>(smem + SM::dO);
    float *sS = reinterpret_cast<float *>(smem + SM::s);
    float *sdP = reinterpret_cast<float *>(smem + SM::dp);
    bt_bf16 *sP = reinterpret_cast<bt_bf16 *>(smem + SM::p);
    bt_bf16 *sdS = reinterpret_cast<bt_bf16 *>(smem + SM::ds);
    float *sdK = reinterpret_cast<float *>(smem + SM::dk);
    float *sdV = reinterpret_cast<float *>(smem + SM::dv);
    float *sInvF = reinterpret_cast<float *>(smem + SM::f);
    float *sLse2 = sInvF + D / 2;
    float *sDelta = sLse2 + BR;

    const int seq = blockIdx.x / a.nblk, kb = blockIdx.x % a.nblk, g = blockIdx.y;
    const int grp = a.Hq / a.Hkv;
    const int start = a.cu[seq], L = a.cu[seq + 1] - start;
    const int k0 = kb * ATT_BC;
    if (k0 >= L)
        return;
    const int nk = min(ATT_BC, L - k0);
    if (a.pos)
        bt_att_init_inv_freq(sInvF, D, a.theta, a.invf);
    for (int i = threadIdx.x; i < ATT_BC * SM::LDA; i += ATT_THREADS) {
        sdK[i] = 0.0f;
        sdV[i] = 0.0f;
    }
    __syncthreads();
    const int32_t *pos = a.pos ? a.pos + start : nullptr;
    load_tile<D, ATT_BC>(sK, SM::LDB, k + (int64_t)(start + k0) * a.ldk + (int64_t)g * D, a.ldk, nk,
                         pos ? pos + k0 : nullptr, sInvF, a.pos_scale);
    load_tile<D, ATT_BC>(sV, SM::LDB, v + (int64_t)(start + k0) * a.ldv + (int64_t)g * D, a.ldv, nk,
                         nullptr, nullptr, 0.0f);
    const float sl2 = a.scale * LOG2E;
    for (int hi = 0; hi < grp; hi++) {
        const int h = g * grp + hi;
        const bool shifted = a.G > 0 && h >= a.Hq / 2;
        /* rows that can see keys [k0, k0+nk): query tiles past the S^2 group / window skipped */
        const int qend = bt_att_query_end(k0 + nk - 1, a.G, shifted, a.W, L);
        for (int q0 = k0; q0 < qend; q0 += BR) {
            const int nq = min(BR, qend - q0);
            __syncthreads(); /* previous step done with sQ/sdO/stats */
            load_tile<D, BR>(sQ, SM::LDB, q + (int64_t)(start + q0) * a.ldq + (int64_t)h * D, a.ldq,
                             nq, pos ? pos + q0 : nullptr, sInvF, a.pos_scale);
            load_tile<D, BR>(sdO, SM::LDB, dout + (int64_t)(start + q0) * a.Hq * D + (int64_t)h * D,
                             (int64_t)a.Hq * D, nq, nullptr, nullptr, 0.0f);
            for (int r = threadIdx.x; r < BR; r += ATT_THREADS) {
                const int64_t idx = (int64_t)(start + q0 + r) * a.Hq + h;
                sLse2[r] = r < nq ? lse[idx] * LOG2E : 0.0f;
                sDelta[r] = r < nq ? delta[idx] : 0.0f;
            }
            block_mma<BR, ATT_BC, D, wmma::row_major, wmma::col_major>(sS, SM::LDS, sQ, SM::LDB, sK,
                                                                       SM::LDB, false);
            block_mma<BR, ATT_BC, D, wmma::row_major, wmma::col_major>(sdP, SM::LDS, sdO, SM::LDB,
                                                                       sV, SM::LDB, false);
            for (int e = threadIdx.x; e < BR * ATT_BC; e += ATT_THREADS) {
                const int r = e / ATT_BC, j = e % ATT_BC;
                const bool ok = r < nq && j < nk && bt_att_visible(q0 + r, k0 + j, a.G, shifted, a.W);
                const float p = ok ? exp2f(sS[r * SM::LDS + j] * sl2 - sLse2[r]) : 0.0f;
                sP[r * SM::LDP + j] = __float2bfloat16_rn(p);
                sdS[r * SM::LDP + j] =
                    __float2bfloat16_rn(p * (sdP[r * SM::LDS + j] - sDelta[r]) * a.scale);
            }
            /* dV += P^T dO ; dK += dS^T Q  (A operands read transposed: col_major views) */
            block_mma<ATT_BC, D, BR, wmma::col_major, wmma::row_major>(sdV, SM::LDA, sP, SM::LDP,
                                                                       sdO, SM::LDB, true);
            block_mma<ATT_BC, D, BR, wmma::col_major, wmma::row_major>(sdK, SM::LDA, sdS, SM::LDP,
                                                                       sQ, SM::LDB, true);
        }
    }
    __syncthreads();
    store_tile<D, ATT_BC>(dk + (int64_t)(start + k0) * a.ldk + (int64_t)g * D, a.ldk, sdK, SM::LDA,
                          nk, nullptr, pos ? pos + k0 : nullptr, sInvF, a.pos_scale);
    store_tile<D, ATT_BC>(dv + (int64_t)(start + k0) * a.ldv + (int64_t)g * D, a.ldv, sdV, SM::LDA,
                          nk, nullptr, nullptr, nullptr, 0.0f);
}

template <int D>
struct DqSmem {
    static constexpr int BR = D == 256 ? 32 : 64; /* query rows per CTA (227 KB at D=256) */
    static constexpr int LDB = D + 8, LDS = ATT_BC + 4, LDP = ATT_BC + 8, LDA = D + 4;
    static constexpr size_t q = 0;
    static constexpr size_t dO = bt_att_align(q + sizeof(bt_bf16) * BR * LDB);
    static constexpr size_t k = bt_att_align(dO + sizeof(bt_bf16) * BR * LDB);
    static constexpr size_t v = bt_att_align(k + sizeof(bt_bf16) * ATT_BC * LDB);
    static constexpr size_t s = bt_att_align(v + sizeof(bt_bf16) * ATT_BC * LDB);
    static constexpr size_t dp = bt_att_align(s + sizeof(float) * BR * LDS);
    static constexpr size_t ds = bt_att_align(dp + sizeof(float) * BR * LDS);
    static constexpr size_t dq = bt_att_align(ds + sizeof(bt_bf16) * BR * LDP);
    static constexpr size_t f = bt_att_align(dq + sizeof(float) * BR * LDA);
    static constexpr size_t bytes = bt_att_align(f + sizeof(float) * (D / 2 + 2 * BR));
};

/* One CTA per (BR-query tile, query head, document; BR = 64, 32 at D=256): dQ = sum over key
 * tiles of dS K. */
template <int D>
__global__ void __launch_bounds__(ATT_THREADS) attn_bwd_dq_kernel(
    BtAttArgs a, bt_bf16 *dq, const bt_bf16 *dout, const float *lse, const float *delta,
    const bt_bf16 *q, const bt_bf16 *k, const bt_bf16 *v)
{
    using SM = DqSmem<D>;
    constexpr int BR = SM::BR;
    extern __shared__ __align__(128) unsigned char smem[];
    bt_bf16 *sQ = reinterpret_cast<bt_bf16 *>(smem + SM::q);
    bt_bf16 *sdO = reinterpret_cast<bt_bf16 *>(smem + SM::dO);
    bt_bf16 *sK = reinterpret_cast<bt_bf16 *>(smem + SM::k);
    bt_bf16 *sV = reinterpret_cast<bt_bf16 *>(smem + SM::v);
    float *sS = reinterpret_cast<float *>(smem + SM::s);
    float *sdP = reinterpret_cast<float *>(smem + SM::dp);
    bt_bf16 *sdS = reinterpret_cast<bt_bf16 *>(smem + SM::ds);
    float *sdQ = reinterpret_cast<float *>(smem + SM::dq);
    float *sInvF = reinterpret_cast<float *>(smem + SM::f);
    float *sLse2 = sInvF + D / 2;
    float *sDelta = sLse2 + BR;

    const int seq = blockIdx.x / a.nblk, qb = blockIdx.x % a.nblk, h = blockIdx.y;
    const int g = h / (a.Hq / a.Hkv);
    const int start = a.cu[seq], L = a.cu[seq + 1] - start;
    const int q0 = qb * BR;
    if (q0 >= L)
        return;
    const int nq = min(BR, L - q0);
    const bool shifted = a.G > 0 && h >= a.Hq / 2;
    if (a.pos)
        bt_att_init_inv_freq(sInvF, D, a.theta, a.invf);
    for (int i = threadIdx.x; i < BR * SM::LDA; i += ATT_THREADS)
        sdQ[i] = 0.0f;
    for (int r = threadIdx.x; r < BR; r += ATT_THREADS) {
        const int64_t idx = (int64_t)(start + q0 + r) * a.Hq + h;
        sLse2[r] = r < nq ? lse[idx] * LOG2E : 0.0f;
        sDelta[r] = r < nq ? delta[idx] : 0.0f;
    }
    __syncthreads();
    const int32_t *pos = a.pos ? a.pos + start : nullptr;
    load_tile<D, BR>(sQ, SM::LDB, q + (int64_t)(start + q0) * a.ldq + (int64_t)h * D, a.ldq, nq,
                     pos ? pos + q0 : nullptr, sInvF, a.pos_scale);
    load_tile<D, BR>(sdO, SM::LDB, dout + (int64_t)(start + q0) * a.Hq * D + (int64_t)h * D,
                     (int64_t)a.Hq * D, nq, nullptr, nullptr, 0.0f);
    const float sl2 = a.scale * LOG2E;
    const int kfirst = bt_att_key_lo(q0, a.G, shifted, a.W); /* key tiles before it skipped */
    const int kt0 = kfirst / ATT_BC, kt1 = (q0 + nq - 1) / ATT_BC;
    for (int kt = kt0; kt <= kt1; kt++) {
        const int k0 = kt * ATT_BC, nk = min(ATT_BC, L - k0);
        __syncthreads();
        load_tile<D, ATT_BC>(sK, SM::LDB, k + (int64_t)(start + k0) * a.ldk + (int64_t)g * D, a.ldk,
                             nk, pos ? pos + k0 : nullptr, sInvF, a.pos_scale);
        load_tile<D, ATT_BC>(sV, SM::LDB, v + (int64_t)(start + k0) * a.ldv + (int64_t)g * D, a.ldv,
                             nk, nullptr, nullptr, 0.0f);
        block_mma<BR, ATT_BC, D, wmma::row_major, wmma::col_major>(sS, SM::LDS, sQ, SM::LDB, sK,
                                                                   SM::LDB, false);
        block_mma<BR, ATT_BC, D, wmma::row_major, wmma::col_major>(sdP, SM::LDS, sdO, SM::LDB, sV,
                                                                   SM::LDB, false);
        for (int e = threadIdx.x; e < BR * ATT_BC; e += ATT_THREADS) {
            const int r = e / ATT_BC, j = e % ATT_BC;
            const bool ok = r < nq && j < nk && bt_att_visible(q0 + r, k0 + j, a.G, shifted, a.W);
            const float p = ok ? exp2f(sS[r * SM::LDS + j] * sl2 - sLse2[r]) : 0.0f;
            sdS[r * SM::LDP + j] =
                __float2bfloat16_rn(p * (sdP[r * SM::LDS + j] - sDelta[r]) * a.scale);
        }
        /* dQ += dS K */
        block_mma<BR, D, ATT_BC, wmma::row_major, wmma::row_major>(sdQ, SM::LDA, sdS, SM::LDP, sK,
                                                                   SM::LDB, true);
    }
    __syncthreads();
    store_tile<D, BR>(dq + (int64_t)(start + q0) * a.ldq + (int64_t)h * D, a.ldq, sdQ, SM::LDA, nq,
                      nullptr, pos ? pos + q0 : nullptr, sInvF, a.pos_scale);
}

/* --------------------------------------------------------------------------- launchers */

template <int D>
static int wa_fwd(const bt_cuda_attn_params *p, bt_bf16 *out, float *lse, const bt_bf16 *q,
                  const bt_bf16 *k, const bt_bf16 *v, cudaStream_t stream)
{
    const BtAttArgs a = bt_att_args(p, FwdSmem<D>::BR);
    const int64_t gx = (int64_t)p->n_seq * a.nblk;
    BT_CU_REFUSE(BT_ERR_UNSUPPORTED, gx > 0x7fffffff || p->Hq > 65535);
    const dim3 grid((unsigned)gx, (unsigned)p->Hq);
    BT_TRY(bt_att_smem(attn_fwd_kernel<D>, FwdSmem<D>::bytes, D));
    attn_fwd_kernel<D><<<grid, ATT_THREADS, FwdSmem<D>::bytes, stream>>>(a, out, lse, q, k, v);
    BT_LAUNCH_CHECK();
    return BT_OK;
}

template <int D>
static int wa_bwd(const bt_cuda_attn_params *p, bt_bf16 *dq, bt_bf16 *dk, bt_bf16 *dv,
                  const bt_bf16 *dout, const bt_bf16 *out, const float *lse, const bt_bf16 *q,
                  const bt_bf16 *k, const bt_bf16 *v, float *delta, cudaStream_t stream)
{
    /* the shared-memory checks first: a device that cannot run a pass enqueues nothing */
    BT_TRY(bt_att_smem(attn_bwd_dkdv_kernel<D>, DkvSmem<D>::bytes, D));
    BT_TRY(bt_att_smem(attn_bwd_dq_kernel<D>, DqSmem<D>::bytes, D));
    const BtAttArgs akv = bt_att_args(p, ATT_BC), aq = bt_att_args(p, DqSmem<D>::BR);
    const int64_t gxkv = (int64_t)p->n_seq * akv.nblk, gxq = (int64_t)p->n_seq * aq.nblk;
    BT_CU_REFUSE(BT_ERR_UNSUPPORTED, gxkv > 0x7fffffff || gxq > 0x7fffffff || p->Hq > 65535);
    const int64_t rows = (int64_t)p->M * p->Hq, nthr = rows * (D / 8);
    bt_att_delta_kernel<D><<<(unsigned)((nthr + 255) / 256), 256, 0, stream>>>(delta, dout, out, rows);
    BT_LAUNCH_CHECK();
    const dim3 gkv((unsigned)gxkv, (unsigned)p->Hkv), gq((unsigned)gxq, (unsigned)p->Hq);
    attn_bwd_dkdv_kernel<D><<<gkv, ATT_THREADS, DkvSmem<D>::bytes, stream>>>(akv, dk, dv, dout, lse,
                                                                            delta, q, k, v);
    BT_LAUNCH_CHECK();
    attn_bwd_dq_kernel<D><<<gq, ATT_THREADS, DqSmem<D>::bytes, stream>>>(aq, dq, dout, lse, delta,
                                                                        q, k, v);
    BT_LAUNCH_CHECK();
    return BT_OK;
}

extern "C" int bt_cuda_attn_fwd(const bt_cuda_attn_params *p, bt_bf16 *out, float *lse,
                                const bt_bf16 *q, const bt_bf16 *k, const bt_bf16 *v,
                                cudaStream_t stream)
{
    const void *ptrs[] = {out, lse, q, k, v};
    const int e = bt_att_enter(__func__, p, ptrs, 5, false, lse, nullptr);
    if (e)
        return e > 0 ? BT_OK : e;
    return p->D == 64    ? wa_fwd<64>(p, out, lse, q, k, v, stream)
           : p->D == 128 ? wa_fwd<128>(p, out, lse, q, k, v, stream)
                         : wa_fwd<256>(p, out, lse, q, k, v, stream);
}

extern "C" int bt_cuda_attn_bwd(const bt_cuda_attn_params *p, bt_bf16 *dq, bt_bf16 *dk,
                                bt_bf16 *dv, const bt_bf16 *dout, const bt_bf16 *out,
                                const float *lse, const bt_bf16 *q, const bt_bf16 *k,
                                const bt_bf16 *v, float *delta, cudaStream_t stream)
{
    const void *ptrs[] = {dq, dk, dv, dout, out, q, k, v};
    const int e = bt_att_enter(__func__, p, ptrs, 8, true, lse, delta);
    if (e)
        return e > 0 ? BT_OK : e;
    return p->D == 64 ? wa_bwd<64>(p, dq, dk, dv, dout, out, lse, q, k, v, delta, stream)
           : p->D == 128
               ? wa_bwd<128>(p, dq, dk, dv, dout, out, lse, q, k, v, delta, stream)
               : wa_bwd<256>(p, dq, dk, dv, dout, out, lse, q, k, v, delta, stream);
}

/* Shared-memory budgets (bytes): D = 64 and 128 fit the smallest target, sm_80 (163 KB per
 * block); D = 256 fits sm_90 (227 KB, 232,448 B; checked on the host against the device's
 * opt-in limit, bt_att_smem). */
static_assert(FwdSmem<128>::bytes <= 166912, "attention fwd smem exceeds sm_80 limit");
static_assert(DkvSmem<128>::bytes <= 166912, "attention dkdv smem exceeds sm_80 limit");
static_assert(DqSmem<128>::bytes <= 166912, "attention dq smem exceeds sm_80 limit");
static_assert(FwdSmem<256>::bytes == 195328 && FwdSmem<256>::bytes <= 232448,
              "attention fwd smem (D=256) exceeds sm_90 limit / kernels_cuda.h figure");
static_assert(DkvSmem<256>::bytes == 231552 && DkvSmem<256>::bytes <= 232448,
              "attention dkdv smem (D=256) exceeds sm_90 limit / kernels_cuda.h figure");
static_assert(DqSmem<256>::bytes == 157440 && DqSmem<256>::bytes <= 232448,
              "attention dq smem (D=256) exceeds sm_90 limit / kernels_cuda.h figure");
