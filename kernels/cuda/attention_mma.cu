/* Fused causal varlen GQA attention, second (fast) implementation: register-resident
 * FlashAttention-2 on mma.sync.m16n8k16 (bf16 in, fp32 accumulate), ldmatrix, cp.async.
 * Same semantics, parameters and errors as bt_cuda_attn_fwd / bt_cuda_attn_bwd (attention.cu);
 * contracts in kernels/cuda/kernels_cuda.h.
 *
 * Sources: Dao 2023, FlashAttention-2 (arXiv 2307.08691), Algorithms 1 and 2; the split of the
 * backward into a dK/dV pass per key tile and a dQ pass per query tile (no atomics) as in
 * attention.cu; fragment layouts from the PTX ISA, "Matrix Fragments for mma.m16n8k16 with
 * floating point type" and "ldmatrix" (sm_80 features only: mma.sync, ldmatrix, cp.async).
 *
 * Fragment facts used everywhere below (lane = 0..31, g = lane / 4, t = lane % 4):
 *   A (16x16, row-major) regs a0..a3 = (row g, k 2t..2t+1), (row g+8, k 2t..), (row g, k 2t+8..),
 *     (row g+8, k 2t+8..); each reg holds 2 bf16, the lower k in the low 16 bits.
 *   B (16x8, B(k,n))  regs b0, b1 = (k 2t..2t+1, n g), (k 2t+8..2t+9, n g).
 *   C (16x8 fp32)     c0..c3 = (row g, n 2t), (row g, n 2t+1), (row g+8, n 2t), (row g+8, n 2t+1).
 *   So the C fragments of two adjacent 8-column blocks, packed to bf16 pairs, ARE the A fragment of
 *   the next product over those 16 columns (P, dS stay in registers).
 *   ldmatrix.x4: lanes 8j..8j+7 give the 8 row addresses of matrix j; reg j receives (row g,
 *   cols 2t, 2t+1) of matrix j; with .trans, (rows 2t, 2t+1, col g).
 * Shared-memory tiles are row-major with a pitch of D+8 bf16 (16-byte padding), which makes every
 * 8-row ldmatrix phase hit 32 distinct banks (pitch 272 B = 68 words for D=128, 144 B = 36 words
 * for D=64: rows step by 4 banks).
 *
 * RoPE (HF rotate_half, pairs (i, i+D/2)) is applied as Q and K tiles are loaded and, inverted,
 * to dQ and dK before the store (directly on the accumulator fragments: columns c and c+D/2 sit in
 * the same lane and register slot of n-blocks c/8 and c/8+D/16). The angle is p * inv_freq[i] in
 * fp32 (p = position_ids * pos_scale), reduced exactly modulo 2*pi (Cody-Waite, two constants;
 * the first fma is exact for |angle| < 2^24) and fed to __sincosf: about 1e-6 absolute error, far
 * below the bf16 rounding of the rotated values, and several times cheaper than sincosf, which
 * matters because every K tile is rotated once per query tile.
 *
 * Sliding window (bt_cuda_attn_params.window): each row's first visible key is bt_att_key_lo and
 * each key's last query bt_att_query_end - 1 (attention_common.h), so key tiles before a query
 * tile's first window and query steps past a key tile's last window are never visited, and the
 * warp-level mask tests cover the tiles that straddle a window edge. */
#include "kernels/cuda/attention_common.h"

#define MA_LOG2E 1.4426950408889634f
#define MA_LN2 0.6931471805599453f

namespace {

/* ------------------------------------------------------------------ PTX wrappers (sm_80+) */

__device__ __forceinline__ uint32_t smem_u32(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void ldsm_x4(uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3,
                                        const bt_bf16 *p)
{
#ifndef BT_CUDA_EMU
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_u32(p)));
#else /* CPU emulator (tests/emu) */
    uint32_t r[4];
    bt_emu::ldmatrix_x4(r, p, false);
    r0 = r[0], r1 = r[1], r2 = r[2], r3 = r[3];
#endif
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3,
                                          const bt_bf16 *p)
{
#ifndef BT_CUDA_EMU
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_u32(p)));
#else /* CPU emulator (tests/emu) */
    uint32_t r[4];
    bt_emu::ldmatrix_x4(r, p, true);
    r0 = r[0], r1 = r[1], r2 = r[2], r3 = r[3];
#endif
}
/* c[0..3] += A(16x16) * B(16x8), bf16 x bf16 -> fp32 */
__device__ __forceinline__ void mma16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
{
#ifndef BT_CUDA_EMU
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else /* CPU emulator (tests/emu) */
    bt_emu::mma_m16n8k16_bf16(c, a, b0, b1);
#endif
}
/* 16-byte global -> shared copy; src_bytes 0 writes zeros (PTX cp.async zero-fill) */
__device__ __forceinline__ void cp_async16(void *dst, const void *src, int src_bytes)
{
#ifndef BT_CUDA_EMU
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(src_bytes)
                 : "memory");
#else /* CPU emulator (tests/emu) */
    bt_emu::cp_async16(dst, src, src_bytes);
#endif
}
__device__ __forceinline__ void cp_async_commit()
{
#ifndef BT_CUDA_EMU
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#else /* CPU emulator (tests/emu) */
    bt_emu::cp_async_commit();
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait()
{
#ifndef BT_CUDA_EMU
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#else /* CPU emulator (tests/emu) */
    bt_emu::cp_async_wait(N);
#endif
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi)
{
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi); /* .x = lo -> low 16 bits */
    return *reinterpret_cast<uint32_t *>(&h);
}
__device__ __forceinline__ float2 unpack_bf16(uint32_t u)
{
    __nv_bfloat162 h = *reinterpret_cast<__nv_bfloat162 *>(&u);
    return __bfloat1622float2(h);
}

/* ------------------------------------------------------------ warp-level tile products
 * All operate on one warp's 16 output rows. Bs points at element (0,0) of the B tile in shared
 * memory (pitch LD elements); As (when from smem) at the warp's first row. */

/* acc[N/8][4] += A * Bs^T, A = 16 x (16*KS) in registers (a[KS][4]), Bs row-major [N][16*KS]
 * ("B(k,n) = Bs[n][k]", e.g. S = Q K^T with Bs = K). ldmatrix (no .trans): matrix 0 = rows n0..+7
 * cols k0..+7 (b0 of block n0), 1 = rows n0..+7 cols k0+8.. (b1 of n0), 2 = rows n0+8.. cols k0
 * (b0 of n0+8), 3 = rows n0+8.. cols k0+8 (b1 of n0+8). */
template <int N, int KS, int LD>
__device__ __forceinline__ void mma_nt_rA(float (*acc)[4], const uint32_t (*a)[4], const bt_bf16 *Bs,
                                          int lane)
{
    const bt_bf16 *bp = Bs + ((lane & 7) + (lane >> 4) * 8) * LD + ((lane >> 3) & 1) * 8;
#pragma unroll
    for (int kk = 0; kk < KS; kk++) {
#pragma unroll
        for (int np = 0; np < N / 16; np++) {
            uint32_t b0, b1, b2, b3;
            ldsm_x4(b0, b1, b2, b3, bp + np * 16 * LD + kk * 16);
            mma16816(acc[2 * np], a[kk], b0, b1);
            mma16816(acc[2 * np + 1], a[kk], b2, b3);
        }
    }
}
/* A fragment (16 x 16 at column k0) from a row-major smem tile: matrix 0 = rows 0..7 cols k0..+7
 * (a0), 1 = rows 8..15 (a1), 2 = rows 0..7 cols k0+8 (a2), 3 = rows 8..15 cols k0+8 (a3). */
template <int LD>
__device__ __forceinline__ void lda_frag(uint32_t a[4], const bt_bf16 *As, int k0, int lane)
{
    ldsm_x4(a[0], a[1], a[2], a[3],
            As + ((lane & 7) + ((lane >> 3) & 1) * 8) * LD + k0 + (lane >> 4) * 8);
}
/* Same as mma_nt_rA with A read from shared memory (16 rows at As, pitch LD) one k-step at a time. */
template <int N, int KS, int LD>
__device__ __forceinline__ void mma_nt_sA(float (*acc)[4], const bt_bf16 *As, const bt_bf16 *Bs,
                                          int lane)
{
    const bt_bf16 *bp = Bs + ((lane & 7) + (lane >> 4) * 8) * LD + ((lane >> 3) & 1) * 8;
#pragma unroll 2
    for (int kk = 0; kk < KS; kk++) {
        uint32_t a[4];
        lda_frag<LD>(a, As, kk * 16, lane);
#pragma unroll
        for (int np = 0; np < N / 16; np++) {
            uint32_t b0, b1, b2, b3;
            ldsm_x4(b0, b1, b2, b3, bp + np * 16 * LD + kk * 16);
            mma16816(acc[2 * np], a, b0, b1);
            mma16816(acc[2 * np + 1], a, b2, b3);
        }
    }
}
/* acc[N/8][4] += A * Bs, A = 16 x (16*KS) in registers, Bs row-major [16*KS][N] ("B(k,n) =
 * Bs[k][n]", e.g. O += P V with Bs = V). ldmatrix.trans: matrix 0 = rows k0..+7 cols n0..+7 (b0
 * of block n0), 1 = rows k0+8.. cols n0 (b1 of n0), 2 = rows k0.. cols n0+8 (b0 of n0+8), 3 =
 * rows k0+8.. cols n0+8 (b1 of n0+8). */
template <int N, int KS, int LD>
__device__ __forceinline__ void mma_nn_rA(float (*acc)[4], const uint32_t (*a)[4], const bt_bf16 *Bs,
                                          int lane)
{
    const bt_bf16 *bp = Bs + ((lane & 7) + ((lane >> 3) & 1) * 8) * LD + (lane >> 4) * 8;
#pragma unroll
    for (int kk = 0; kk < KS; kk++) {
#pragma unroll
        for (int np = 0; np < N / 16; np++) {
            uint32_t b0, b1, b2, b3;
            ldsm_x4_t(b0, b1, b2, b3, bp + kk * 16 * LD + np * 16);
            mma16816(acc[2 * np], a[kk], b0, b1);
            mma16816(acc[2 * np + 1], a[kk], b2, b3);
        }
    }
}
/* C fragments (fp32, 16 x 16*KS as 2*KS blocks of 8 columns) -> A fragments (bf16). */
template <int KS>
__device__ __forceinline__ void c_to_a(uint32_t (*a)[4], const float (*c)[4])
{
#pragma unroll
    for (int kk = 0; kk < KS; kk++) {
        a[kk][0] = pack_bf16(c[2 * kk][0], c[2 * kk][1]);
        a[kk][1] = pack_bf16(c[2 * kk][2], c[2 * kk][3]);
        a[kk][2] = pack_bf16(c[2 * kk + 1][0], c[2 * kk + 1][1]);
        a[kk][3] = pack_bf16(c[2 * kk + 1][2], c[2 * kk + 1][3]);
    }
}
template <int NB>
__device__ __forceinline__ void zero_acc(float (*c)[4])
{
#pragma unroll
    for (int i = 0; i < NB; i++)
        c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.0f;
}

/* ---------------------------------------------------------------------------------- RoPE */

/* sin/cos of an fp32 angle: exact reduction modulo 2*pi (2*pi = HI + LO, HI = fp32(2*pi); for
 * |x| < 2^24 the first fma is exact because x - k*HI is a multiple of 2^-21 of magnitude < 8),
 * then the fast hardware sin/cos on [-pi, pi] (abs error ~ 2^-21). */
__device__ __forceinline__ void fast_sincos(float x, float *s, float *c)
{
    const float k = rintf(x * 0.15915494309189535f);
    float r = fmaf(-k, 6.28318548202514648f, x);
    r = fmaf(-k, -1.7484555314695172e-7f, r);
    __sincosf(r, s, c);
}
/* Rotate 8 pairs (a[j], b[j]) = (x[i0+j], x[i0+j+D/2]) by angle p * inv_freq[i0+j]; dir = +1
 * forward (a' = a cos - b sin, b' = b cos + a sin), -1 the inverse (transposed) rotation. */
__device__ __forceinline__ void rot_pair(float &x1, float &x2, float ang, float dir)
{
    float s, c;
    fast_sincos(ang, &s, &c);
    s *= dir;
    const float a = x1, b = x2;
    x1 = a * c - b * s;
    x2 = b * c + a * s;
}
__device__ __forceinline__ void u4_to_f8(const uint4 &r, float f[8])
{
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const float2 t = unpack_bf16(w[j]);
        f[2 * j] = t.x;
        f[2 * j + 1] = t.y;
    }
}
__device__ __forceinline__ uint4 f8_to_u4(const float f[8])
{
    return make_uint4(pack_bf16(f[0], f[1]), pack_bf16(f[2], f[3]), pack_bf16(f[4], f[5]),
                      pack_bf16(f[6], f[7]));
}

/* Register-staged tile load with RoPE: ROWS x D bf16 from global (row stride ldg) -> rotated ->
 * shared (pitch LD). Chunk c (of ROWS * D/16) = row c / (D/16), pair columns i0 = (c % (D/16))*8:
 * the thread loads x[i0..i0+8) and x[D/2+i0..) (two 16-byte loads), so the rotation needs no
 * exchange. load() issues the global loads (rows >= nvalid give zeros), store() rotates (when
 * rot) and writes shared memory; between the two the registers hide the global latency. */
template <int D, int ROWS, int THREADS, int LD>
struct RotTile {
    static constexpr int CPR = D / 16;
    static constexpr int N = ROWS * CPR / THREADS;
    static_assert((ROWS * CPR) % THREADS == 0, "tile chunks must divide among threads");
    uint4 a[N], b[N];
    float p[N];
    __device__ __forceinline__ void load(const bt_bf16 *g, int64_t ldg, int nvalid,
                                         const int32_t *pos, float pos_scale)
    {
#pragma unroll
        for (int i = 0; i < N; i++) {
            const int c = threadIdx.x + i * THREADS, r = c / CPR, i0 = (c % CPR) * 8;
            a[i] = b[i] = make_uint4(0, 0, 0, 0);
            p[i] = 0.0f;
            if (r < nvalid) {
                a[i] = *reinterpret_cast<const uint4 *>(g + r * ldg + i0);
                b[i] = *reinterpret_cast<const uint4 *>(g + r * ldg + D / 2 + i0);
                if (pos)
                    p[i] = (float)pos[r] * pos_scale;
            }
        }
    }
    __device__ __forceinline__ void store(bt_bf16 *s, const float *inv_freq, bool rot)
    {
#pragma unroll
        for (int i = 0; i < N; i++) {
            const int c = threadIdx.x + i * THREADS, r = c / CPR, i0 = (c % CPR) * 8;
            uint4 ua = a[i], ub = b[i];
            if (rot) {
                float fa[8], fb[8];
                u4_to_f8(ua, fa);
                u4_to_f8(ub, fb);
#pragma unroll
                for (int j = 0; j < 8; j++)
                    rot_pair(fa[j], fb[j], p[i] * inv_freq[i0 + j], 1.0f);
                ua = f8_to_u4(fa);
                ub = f8_to_u4(fb);
            }
            *reinterpret_cast<uint4 *>(s + r * LD + i0) = ua;
            *reinterpret_cast<uint4 *>(s + r * LD + D / 2 + i0) = ub;
        }
    }
};

/* ROWS x D bf16 global -> shared (pitch LD) by cp.async, rows >= nvalid zero-filled. The caller
 * commits the group. */
template <int D, int ROWS, int THREADS, int LD>
__device__ __forceinline__ void cp_tile(bt_bf16 *s, const bt_bf16 *g, int64_t ldg, int nvalid)
{
    constexpr int CPR = D / 8, N = ROWS * CPR / THREADS;
    static_assert((ROWS * CPR) % THREADS == 0, "tile chunks must divide among threads");
#pragma unroll
    for (int i = 0; i < N; i++) {
        const int c = threadIdx.x + i * THREADS, r = c / CPR, c8 = (c % CPR) * 8;
        const bool ok = r < nvalid;
        cp_async16(s + r * LD + c8, ok ? (const void *)(g + r * ldg + c8) : (const void *)g,
                   ok ? 16 : 0);
    }
}

/* The warp's 16 x D fp32 accumulator fragments (acc[D/8][4]) -> bf16 global rows, with the
 * inverse RoPE (rot: positions prow[0] for row g, prow[1] for row g+8, already * pos_scale; prow
 * and inv_freq are not read when rot is false) and a per-row multiplier (mul[0], mul[1]). Staged
 * through the warp's own 16 rows of shared memory (stage, pitch LD; no other warp may touch them)
 * for coalesced 16-byte stores of rows < nvalid. */
template <int D, int LD>
__device__ __forceinline__ void store_acc(bt_bf16 *gdst, int64_t ldg, int nvalid, float (*acc)[4],
                                          bt_bf16 *stage, const float mul[2], bool rot,
                                          const float prow[2], const float *inv_freq, int lane)
{
    const int g = lane >> 2, t = lane & 3;
    if (rot) {
#pragma unroll
        for (int n = 0; n < D / 16; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int col = n * 8 + 2 * t + (e & 1); /* < D/2; partner col + D/2 */
                rot_pair(acc[n][e], acc[n + D / 16][e], prow[e >> 1] * inv_freq[col], -1.0f);
            }
    }
    __syncwarp();
#pragma unroll
    for (int n = 0; n < D / 8; n++) {
        *reinterpret_cast<uint32_t *>(stage + g * LD + n * 8 + 2 * t) =
            pack_bf16(acc[n][0] * mul[0], acc[n][1] * mul[0]);
        *reinterpret_cast<uint32_t *>(stage + (g + 8) * LD + n * 8 + 2 * t) =
            pack_bf16(acc[n][2] * mul[1], acc[n][3] * mul[1]);
    }
    __syncwarp();
    constexpr int CPR = D / 8;
#pragma unroll
    for (int i = lane; i < 16 * CPR; i += 32) {
        const int r = i / CPR, c8 = (i % CPR) * 8;
        if (r < nvalid)
            *reinterpret_cast<uint4 *>(gdst + r * ldg + c8) =
                *reinterpret_cast<const uint4 *>(stage + r * LD + c8);
    }
}


/* 1-D grid: block b -> (head = b % H, doc = (b / H) % n_seq, tile index = b / (H * n_seq)), so the
 * blocks of equal tile index (equal work under the causal mask) are adjacent and the order can put
 * the heavy tiles first. */
__device__ __forceinline__ void decode_block(int H, int n_seq, int &h, int &seq, int &tb)
{
    const int b = (int)blockIdx.x;
    h = b % H;
    const int r = b / H;
    seq = r % n_seq;
    tb = r / n_seq;
}

/* ================================================================================ forward */

constexpr int MF_WARPS = 8, MF_THREADS = MF_WARPS * 32, MF_BR = 16 * MF_WARPS, MF_BN = 64;

template <int D>
struct MFwdSmem {
    static constexpr int LD = D + 8;
    static constexpr size_t q = 0;                                            /* [BR][LD] */
    static constexpr size_t k = bt_att_align(q + sizeof(bt_bf16) * MF_BR * LD);   /* 2 x [BN][LD] */
    static constexpr size_t v = bt_att_align(k + 2 * sizeof(bt_bf16) * MF_BN * LD); /* 2 x [BN][LD] */
    static constexpr size_t f = bt_att_align(v + 2 * sizeof(bt_bf16) * MF_BN * LD); /* inv_freq */
    static constexpr size_t bytes = bt_att_align(f + sizeof(float) * (D / 2));
};

/* One CTA per (128-query tile, query head, document); warp w owns query rows q0+16w..q0+16w+15
 * for the whole kernel: Q as A fragments, S (16 x 64) and O (16 x D) as C fragments, row max m
 * and row sum l (per-lane partial sums over the lane's columns, reduced over the 4 lanes of a row
 * at the end, FA2 style). K/V 64-key tiles double-buffered: K(j+1) global loads are issued into
 * registers before the math of tile j and rotated + stored after it; V(j+1) by cp.async. */
template <int D>
__global__ void __launch_bounds__(MF_THREADS, 1)
    mma_attn_fwd_kernel(BtAttArgs a, bt_bf16 *out, float *lse, const bt_bf16 *q, const bt_bf16 *k,
                        const bt_bf16 *v)
{
    using SM = MFwdSmem<D>;
    constexpr int LD = SM::LD, BR = MF_BR, BN = MF_BN;
    extern __shared__ __align__(128) unsigned char smem[];
    bt_bf16 *sQ = reinterpret_cast<bt_bf16 *>(smem + SM::q);
    bt_bf16 *sK = reinterpret_cast<bt_bf16 *>(smem + SM::k);
    bt_bf16 *sV = reinterpret_cast<bt_bf16 *>(smem + SM::v);
    float *sInvF = reinterpret_cast<float *>(smem + SM::f);

    int h, seq, tb;
    decode_block(a.Hq, a.n_seq, h, seq, tb);
    const int qb = a.nblk - 1 - tb; /* heaviest (last) query tiles first */
    const int g = h / (a.Hq / a.Hkv);
    const int start = a.cu[seq], L = a.cu[seq + 1] - start;
    const int q0 = qb * BR;
    if (q0 >= L)
        return;
    const int nq = min(BR, L - q0);
    const bool shifted = a.G > 0 && h >= a.Hq / 2;
    const bool rot = a.pos != nullptr;
    const int32_t *pos = rot ? a.pos + start : nullptr;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    if (rot)
        bt_att_init_inv_freq(sInvF, D, a.theta, a.invf);
    __syncthreads();

    /* Q tile (rotated) -> smem -> this warp's A fragments */
    {
        RotTile<D, BR, MF_THREADS, LD> qt;
        qt.load(q + (int64_t)(start + q0) * a.ldq + (int64_t)h * D, a.ldq, nq,
                rot ? pos + q0 : nullptr, a.pos_scale);
        qt.store(sQ, sInvF, rot);
    }
    const int kfirst = bt_att_key_lo(q0, a.G, shifted, a.W); /* key tiles before it skipped */
    const int kt0 = kfirst / BN, kt1 = (q0 + nq - 1) / BN;
    const bt_bf16 *kbase = k + (int64_t)start * a.ldk + (int64_t)g * D;
    const bt_bf16 *vbase = v + (int64_t)start * a.ldv + (int64_t)g * D;
    RotTile<D, BN, MF_THREADS, LD> kt;
    {
        const int k0 = kt0 * BN;
        kt.load(kbase + (int64_t)k0 * a.ldk, a.ldk, L - k0, rot ? pos + k0 : nullptr, a.pos_scale);
        cp_tile<D, BN, MF_THREADS, LD>(sV, vbase + (int64_t)k0 * a.ldv, a.ldv, L - k0);
        cp_async_commit();
        kt.store(sK, sInvF, rot);
    }
    __syncthreads();
    uint32_t qf[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++)
        lda_frag<LD>(qf[kk], sQ + warp * 16 * LD, kk * 16, lane);

    /* this lane's two rows: r = 0 -> row gq, r = 1 -> row gq + 8 (local positions) */
    const int qw0 = q0 + warp * 16;
    int qi[2], lo[2];
    for (int r = 0; r < 2; r++) {
        qi[r] = qw0 + gq + 8 * r;
        lo[r] = bt_att_key_lo(qi[r], a.G, shifted, a.W);
    }
    const int lo_w0 = bt_att_key_lo(qw0, a.G, shifted, a.W);      /* smallest in warp */
    const int lo_w1 = bt_att_key_lo(qw0 + 15, a.G, shifted, a.W); /* largest in warp */
    const float sl2 = a.scale * MA_LOG2E;
    float o[D / 8][4];
    zero_acc<D / 8>(o);
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

    for (int kt_i = kt0; kt_i <= kt1; kt_i++) {
        const int buf = (kt_i - kt0) & 1;
        const int k0 = kt_i * BN;
        const bool has_next = kt_i < kt1;
        __syncthreads(); /* K(kt_i) stored; everyone done with tile kt_i-1 (buffers buf^1 free) */
        if (has_next) {
            const int k1 = k0 + BN;
            kt.load(kbase + (int64_t)k1 * a.ldk, a.ldk, L - k1, rot ? pos + k1 : nullptr, a.pos_scale);
            cp_tile<D, BN, MF_THREADS, LD>(sV + (buf ^ 1) * BN * LD, vbase + (int64_t)k1 * a.ldv,
                                           a.ldv, L - k1);
        }
        cp_async_commit(); /* possibly empty: keeps one group per iteration */
        /* warp-uniform: does any (row, key) of this warp x tile survive the mask? */
        const bool active = qw0 < L && k0 <= qw0 + 15 && k0 + BN > lo_w0;
        uint32_t pf[BN / 16][4];
        if (active) {
            float s[BN / 8][4];
            zero_acc<BN / 8>(s);
            mma_nt_rA<BN, D / 16, LD>(s, qf, sK + buf * BN * LD, lane);
            const bool need_mask = k0 + BN > L || k0 + BN - 1 > qw0 || k0 < lo_w1;
            if (need_mask) {
#pragma unroll
                for (int nb = 0; nb < BN / 8; nb++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int kj = k0 + nb * 8 + 2 * tq + (e & 1), r = e >> 1;
                        if (kj >= L || kj > qi[r] || kj < lo[r])
                            s[nb][e] = -INFINITY;
                    }
            }
            float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
            for (int nb = 0; nb < BN / 8; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    s[nb][e] *= sl2; /* -inf stays -inf */
                    mx[e >> 1] = fmaxf(mx[e >> 1], s[nb][e]);
                }
            float alpha[2], mu[2];
#pragma unroll
            for (int r = 0; r < 2; r++) {
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
                const float mn = fmaxf(m[r], mx[r]);
                mu[r] = mn == -INFINITY ? 0.0f : mn; /* no (-inf) - (-inf) */
                alpha[r] = exp2f(m[r] - mu[r]);     /* 0 while the row had nothing */
                m[r] = mn;
            }
            float ls[2] = {0.0f, 0.0f};
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) {
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    /* A reg j: block 2kk + (j>>1), row r = j & 1 */
                    const int nb = 2 * kk + (j >> 1), r = j & 1;
                    const uint32_t u = pack_bf16(exp2f(s[nb][2 * r] - mu[r]),
                                                 exp2f(s[nb][2 * r + 1] - mu[r]));
                    pf[kk][j] = u;
                    const float2 pb = unpack_bf16(u); /* l sums exactly what P V sums */
                    ls[r] += pb.x + pb.y;
                }
            }
#pragma unroll
            for (int r = 0; r < 2; r++)
                l[r] = l[r] * alpha[r] + ls[r];
#pragma unroll
            for (int n = 0; n < D / 8; n++) {
                o[n][0] *= alpha[0];
                o[n][1] *= alpha[0];
                o[n][2] *= alpha[1];
                o[n][3] *= alpha[1];
            }
        }
        cp_async_wait<1>(); /* this thread's V(kt_i) copies landed */
        __syncthreads();    /* ... and everyone's */
        if (active)
            mma_nn_rA<D, BN / 16, LD>(o, pf, sV + buf * BN * LD, lane);
        if (has_next)
            kt.store(sK + (buf ^ 1) * BN * LD, sInvF, rot);
    }
    cp_async_wait<0>();

    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        inv[r] = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        if (tq == 0 && qi[r] < L)
            lse[(int64_t)(start + qi[r]) * a.Hq + h] =
                l[r] > 0.0f ? (m[r] + log2f(l[r])) * MA_LN2 : -INFINITY;
    }
    const int64_t ldo = (int64_t)a.Hq * D;
    store_acc<D, LD>(out + (int64_t)(start + qw0) * ldo + (int64_t)h * D, ldo, L - qw0, o,
                     sQ + warp * 16 * LD, inv, false, nullptr, sInvF, lane);
}

/* =============================================================================== backward */

/* ---- dK / dV: one CTA per (128-key tile, KV head, document); warp w owns keys k0+16w..+15 ----
 * The warp computes the TRANSPOSED products with its keys as rows, so every intermediate stays in
 * its registers: S^T = K Q^T, P^T = exp2(S^T*scale*log2e - lse2[q]), dV += P^T dO,
 * dP^T = V dO^T, dS^T = P^T (dP^T - delta[q]) * scale, dK += dS^T Q. K and V (A operands) stay in
 * smem (read by ldmatrix each step); Q (rotated on load) and dO stream in 64-query steps over
 * every query head of the GQA group and every query tile that can see the key tile,
 * double-buffered (Q via registers, dO via cp.async, lse/delta via registers). */
constexpr int MB_WARPS = 8, MB_THREADS = MB_WARPS * 32, MB_BN = 16 * MB_WARPS;
/* queries per step: 64 for D=64; 32 for D=128 (at 64 the 128 dK/dV accumulator registers plus
 * S^T and dP^T spill under the 255-register cap) */
template <int D>
struct MDkvTile {
    static constexpr int BM = D == 128 ? 32 : 64;
};

template <int D>
struct MDkvSmem {
    static constexpr int LD = D + 8, MB_BM = MDkvTile<D>::BM;
    static constexpr size_t k = 0;                                             /* [BN][LD] */
    static constexpr size_t v = bt_att_align(k + sizeof(bt_bf16) * MB_BN * LD);    /* [BN][LD] */
    static constexpr size_t q = bt_att_align(v + sizeof(bt_bf16) * MB_BN * LD);    /* 2 x [BM][LD] */
    static constexpr size_t dO = bt_att_align(q + 2 * sizeof(bt_bf16) * MB_BM * LD); /* 2 x [BM][LD] */
    static constexpr size_t st = bt_att_align(dO + 2 * sizeof(bt_bf16) * MB_BM * LD); /* 2 x [BM] lse2, 2 x [BM] delta */
    static constexpr size_t f = bt_att_align(st + 4 * sizeof(float) * MB_BM);       /* inv_freq */
    static constexpr size_t bytes = bt_att_align(f + sizeof(float) * (D / 2));
};

template <int D>
__global__ void __launch_bounds__(MB_THREADS, 1)
    mma_attn_bwd_dkdv_kernel(BtAttArgs a, bt_bf16 *dk, bt_bf16 *dv, const bt_bf16 *dout,
                             const float *lse, const float *delta, const bt_bf16 *q,
                             const bt_bf16 *k, const bt_bf16 *v)
{
    using SM = MDkvSmem<D>;
    constexpr int LD = SM::LD, BN = MB_BN, BM = SM::MB_BM;
    extern __shared__ __align__(128) unsigned char smem[];
    bt_bf16 *sK = reinterpret_cast<bt_bf16 *>(smem + SM::k);
    bt_bf16 *sV = reinterpret_cast<bt_bf16 *>(smem + SM::v);
    bt_bf16 *sQ = reinterpret_cast<bt_bf16 *>(smem + SM::q);
    bt_bf16 *sdO = reinterpret_cast<bt_bf16 *>(smem + SM::dO);
    float *sLse = reinterpret_cast<float *>(smem + SM::st); /* [2][BM] */
    float *sDel = sLse + 2 * BM;                            /* [2][BM] */
    float *sInvF = reinterpret_cast<float *>(smem + SM::f);

    int g, seq, kb;
    decode_block(a.Hkv, a.n_seq, g, seq, kb); /* first key tiles (most queries) first */
    const int grp = a.Hq / a.Hkv;
    const int start = a.cu[seq], L = a.cu[seq + 1] - start;
    const int k0 = kb * BN;
    if (k0 >= L)
        return;
    const int nk = min(BN, L - k0);
    const bool rot = a.pos != nullptr;
    const int32_t *pos = rot ? a.pos + start : nullptr;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    const int tid = threadIdx.x;
    if (rot)
        bt_att_init_inv_freq(sInvF, D, a.theta, a.invf);
    __syncthreads();
    {
        RotTile<D, BN, MB_THREADS, LD> ktile;
        ktile.load(k + (int64_t)(start + k0) * a.ldk + (int64_t)g * D, a.ldk, nk,
                   rot ? pos + k0 : nullptr, a.pos_scale);
        cp_tile<D, BN, MB_THREADS, LD>(sV, v + (int64_t)(start + k0) * a.ldv + (int64_t)g * D,
                                       a.ldv, nk);
        cp_async_commit();
        ktile.store(sK, sInvF, rot);
    }
    /* step sequence: for hi in [0, grp): q0 = k0, k0+BM, ... < qend(head) */
    auto qend_of = [&](int hi) {
        const int hh = g * grp + hi;
        const bool sh = a.G > 0 && hh >= a.Hq / 2;
        return bt_att_query_end(k0 + nk - 1, a.G, sh, a.W, L); /* S^2 group / window end */
    };
    const int64_t ldo = (int64_t)a.Hq * D;
    RotTile<D, BM, MB_THREADS, LD> qt;
    float pf_lse = 0.0f, pf_del = 0.0f;
    /* issue the loads of step (hi, q0) into buffer b */
    auto prefetch = [&](int hi, int q0s, int b) {
        const int hh = g * grp + hi;
        qt.load(q + (int64_t)(start + q0s) * a.ldq + (int64_t)hh * D, a.ldq, L - q0s,
                rot ? pos + q0s : nullptr, a.pos_scale);
        cp_tile<D, BM, MB_THREADS, LD>(sdO + b * BM * LD,
                                       dout + (int64_t)(start + q0s) * ldo + (int64_t)hh * D, ldo,
                                       L - q0s);
        if (tid < BM) {
            const int qi = q0s + tid;
            pf_lse = 0.0f;
            pf_del = 0.0f;
            if (qi < L) {
                const int64_t idx = (int64_t)(start + qi) * a.Hq + hh;
                pf_lse = lse[idx] * MA_LOG2E;
                pf_del = delta[idx];
            }
        }
    };
    auto commit_regs = [&](int b) {
        qt.store(sQ + b * BM * LD, sInvF, rot);
        if (tid < BM) {
            sLse[b * BM + tid] = pf_lse;
            sDel[b * BM + tid] = pf_del;
        }
    };
    int hi = 0, q0 = k0;
    int qend = qend_of(0);
    prefetch(0, k0, 0);
    cp_async_commit();
    commit_regs(0);

    const int kw0 = k0 + warp * 16; /* this warp's first key (local position) */
    int kj[2];
    kj[0] = kw0 + gq;
    kj[1] = kw0 + gq + 8;
    const float sl2 = a.scale * MA_LOG2E;
    float dK[D / 8][4], dV[D / 8][4];
    zero_acc<D / 8>(dK);
    zero_acc<D / 8>(dV);
    const bt_bf16 *sKw = sK + warp * 16 * LD, *sVw = sV + warp * 16 * LD;

    for (int step = 0;; step++) {
        const int buf = step & 1;
        /* next step */
        int hn = hi, qn = q0 + BM, qend_n = qend;
        if (qn >= qend) {
            hn = hi + 1;
            qn = k0;
            if (hn < grp)
                qend_n = qend_of(hn);
        }
        const bool has_next = hn < grp;
        __syncthreads(); /* step's Q/stats stored; everyone done with the previous step */
        if (has_next)
            prefetch(hn, qn, buf ^ 1);
        cp_async_commit();

        const int hh = g * grp + hi;
        const bool sh = a.G > 0 && hh >= a.Hq / 2;
        /* query columns visible from key row r: [kj[r], hi_r] */
        int qhi[2];
#pragma unroll
        for (int r = 0; r < 2; r++)
            qhi[r] = bt_att_query_end(kj[r], a.G, sh, a.W, L) - 1;
        const int qhi_w0 = bt_att_query_end(kw0, a.G, sh, a.W, L) - 1; /* smallest */
        const int qhi_w1 = bt_att_query_end(kw0 + 15, a.G, sh, a.W, L) - 1;
        const bool active = kw0 < L && q0 + BM - 1 >= kw0 && q0 <= qhi_w1;
        const bool need_mask = q0 < kw0 + 15 || q0 + BM - 1 > qhi_w0;
        float pt[BM / 8][4];
        const float *lse2 = sLse + buf * BM, *dl = sDel + buf * BM;
        if (active) {
            zero_acc<BM / 8>(pt);
            mma_nt_sA<BM, D / 16, LD>(pt, sKw, sQ + buf * BM * LD, lane);
#pragma unroll
            for (int nb = 0; nb < BM / 8; nb++) {
                const float2 l2 = *reinterpret_cast<const float2 *>(lse2 + nb * 8 + 2 * tq);
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int qi = q0 + nb * 8 + 2 * tq + (e & 1), r = e >> 1;
                    const float p = exp2f(pt[nb][e] * sl2 - ((e & 1) ? l2.y : l2.x));
                    pt[nb][e] = (need_mask && (qi < kj[r] || qi > qhi[r])) ? 0.0f : p;
                }
            }
        }
        cp_async_wait<1>(); /* dO(step) (and, at step 0, V) landed for this thread */
        __syncthreads();
        if (active) {
            {
                uint32_t pa[BM / 16][4];
                c_to_a<BM / 16>(pa, pt);
                mma_nn_rA<D, BM / 16, LD>(dV, pa, sdO + buf * BM * LD, lane);
            }
            float dpt[BM / 8][4];
            zero_acc<BM / 8>(dpt);
            mma_nt_sA<BM, D / 16, LD>(dpt, sVw, sdO + buf * BM * LD, lane);
#pragma unroll
            for (int nb = 0; nb < BM / 8; nb++) {
                const float2 d2 = *reinterpret_cast<const float2 *>(dl + nb * 8 + 2 * tq);
#pragma unroll
                for (int e = 0; e < 4; e++)
                    dpt[nb][e] = pt[nb][e] * (dpt[nb][e] - ((e & 1) ? d2.y : d2.x)) * a.scale;
            }
            uint32_t da[BM / 16][4];
            c_to_a<BM / 16>(da, dpt);
            mma_nn_rA<D, BM / 16, LD>(dK, da, sQ + buf * BM * LD, lane);
        }
        if (!has_next)
            break;
        commit_regs(buf ^ 1);
        hi = hn;
        q0 = qn;
        qend = qend_n;
    }
    cp_async_wait<0>();
    /* epilogue: dK (inverse RoPE at the key positions) and dV; each warp stages through its own
     * 16 rows of sK / sV (only this warp ever read them) */
    float prow[2] = {0.0f, 0.0f};
    const float one[2] = {1.0f, 1.0f};
    if (rot)
        for (int r = 0; r < 2; r++)
            prow[r] = kj[r] < L ? (float)pos[kj[r]] * a.pos_scale : 0.0f;
    store_acc<D, LD>(dk + (int64_t)(start + kw0) * a.ldk + (int64_t)g * D, a.ldk, L - kw0, dK,
                     sK + warp * 16 * LD, one, rot, prow, sInvF, lane);
    store_acc<D, LD>(dv + (int64_t)(start + kw0) * a.ldv + (int64_t)g * D, a.ldv, L - kw0, dV,
                     sV + warp * 16 * LD, one, false, prow, sInvF, lane);
}

/* ---- dQ: one CTA per (128-query tile, query head, document); warp w owns 16 query rows ----
 * Q (rotated) and dO loaded once into smem (A operands by ldmatrix); K (rotated, register-staged)
 * and V (cp.async) 64-key tiles double-buffered as in the forward; per tile S = Q K^T,
 * P = exp2(S*scale*log2e - lse2), dP = dO V^T, dS = P (dP - delta) * scale, dQ += dS K, all in
 * registers. */
template <int D>
struct MDqSmem {
    static constexpr int LD = D + 8;
    static constexpr size_t q = 0;                                             /* [BR][LD] */
    static constexpr size_t dO = bt_att_align(q + sizeof(bt_bf16) * MF_BR * LD);   /* [BR][LD] */
    static constexpr size_t k = bt_att_align(dO + sizeof(bt_bf16) * MF_BR * LD);   /* 2 x [BN][LD] */
    static constexpr size_t v = bt_att_align(k + 2 * sizeof(bt_bf16) * MF_BN * LD);
    static constexpr size_t f = bt_att_align(v + 2 * sizeof(bt_bf16) * MF_BN * LD);
    static constexpr size_t bytes = bt_att_align(f + sizeof(float) * (D / 2));
};

template <int D>
__global__ void __launch_bounds__(MF_THREADS, 1)
    mma_attn_bwd_dq_kernel(BtAttArgs a, bt_bf16 *dq, const bt_bf16 *dout, const float *lse,
                           const float *delta, const bt_bf16 *q, const bt_bf16 *k, const bt_bf16 *v)
{
    using SM = MDqSmem<D>;
    constexpr int LD = SM::LD, BR = MF_BR, BN = MF_BN;
    extern __shared__ __align__(128) unsigned char smem[];
    bt_bf16 *sQ = reinterpret_cast<bt_bf16 *>(smem + SM::q);
    bt_bf16 *sdO = reinterpret_cast<bt_bf16 *>(smem + SM::dO);
    bt_bf16 *sK = reinterpret_cast<bt_bf16 *>(smem + SM::k);
    bt_bf16 *sV = reinterpret_cast<bt_bf16 *>(smem + SM::v);
    float *sInvF = reinterpret_cast<float *>(smem + SM::f);

    int h, seq, tb;
    decode_block(a.Hq, a.n_seq, h, seq, tb);
    const int qb = a.nblk - 1 - tb;
    const int g = h / (a.Hq / a.Hkv);
    const int start = a.cu[seq], L = a.cu[seq + 1] - start;
    const int q0 = qb * BR;
    if (q0 >= L)
        return;
    const int nq = min(BR, L - q0);
    const bool shifted = a.G > 0 && h >= a.Hq / 2;
    const bool rot = a.pos != nullptr;
    const int32_t *pos = rot ? a.pos + start : nullptr;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    if (rot)
        bt_att_init_inv_freq(sInvF, D, a.theta, a.invf);
    __syncthreads();
    const int64_t ldo = (int64_t)a.Hq * D;
    {
        RotTile<D, BR, MF_THREADS, LD> qt;
        qt.load(q + (int64_t)(start + q0) * a.ldq + (int64_t)h * D, a.ldq, nq,
                rot ? pos + q0 : nullptr, a.pos_scale);
        cp_tile<D, BR, MF_THREADS, LD>(sdO, dout + (int64_t)(start + q0) * ldo + (int64_t)h * D,
                                       ldo, nq);
        qt.store(sQ, sInvF, rot);
    }
    const int kfirst = bt_att_key_lo(q0, a.G, shifted, a.W); /* key tiles before it skipped */
    const int kt0 = kfirst / BN, kt1 = (q0 + nq - 1) / BN;
    const bt_bf16 *kbase = k + (int64_t)start * a.ldk + (int64_t)g * D;
    const bt_bf16 *vbase = v + (int64_t)start * a.ldv + (int64_t)g * D;
    RotTile<D, BN, MF_THREADS, LD> kt;
    {
        const int k0 = kt0 * BN;
        kt.load(kbase + (int64_t)k0 * a.ldk, a.ldk, L - k0, rot ? pos + k0 : nullptr, a.pos_scale);
        cp_tile<D, BN, MF_THREADS, LD>(sV, vbase + (int64_t)k0 * a.ldv, a.ldv, L - k0);
        cp_async_commit(); /* dO and V(kt0) */
        kt.store(sK, sInvF, rot);
    }
    const int qw0 = q0 + warp * 16;
    int qi[2], lo[2];
    float lse2[2], dl[2];
    for (int r = 0; r < 2; r++) {
        qi[r] = qw0 + gq + 8 * r;
        lo[r] = bt_att_key_lo(qi[r], a.G, shifted, a.W);
        lse2[r] = 0.0f;
        dl[r] = 0.0f;
        if (qi[r] < L) {
            const int64_t idx = (int64_t)(start + qi[r]) * a.Hq + h;
            lse2[r] = lse[idx] * MA_LOG2E;
            dl[r] = delta[idx];
        }
    }
    const int lo_w0 = bt_att_key_lo(qw0, a.G, shifted, a.W);
    const int lo_w1 = bt_att_key_lo(qw0 + 15, a.G, shifted, a.W);
    const float sl2 = a.scale * MA_LOG2E;
    const bt_bf16 *sQw = sQ + warp * 16 * LD, *sdOw = sdO + warp * 16 * LD;
    float dQ[D / 8][4];
    zero_acc<D / 8>(dQ);

    for (int kt_i = kt0; kt_i <= kt1; kt_i++) {
        const int buf = (kt_i - kt0) & 1;
        const int k0 = kt_i * BN;
        const bool has_next = kt_i < kt1;
        __syncthreads();
        if (has_next) {
            const int k1 = k0 + BN;
            kt.load(kbase + (int64_t)k1 * a.ldk, a.ldk, L - k1, rot ? pos + k1 : nullptr, a.pos_scale);
            cp_tile<D, BN, MF_THREADS, LD>(sV + (buf ^ 1) * BN * LD, vbase + (int64_t)k1 * a.ldv,
                                           a.ldv, L - k1);
        }
        cp_async_commit();
        const bool active = qw0 < L && k0 <= qw0 + 15 && k0 + BN > lo_w0;
        float s[BN / 8][4];
        if (active) {
            zero_acc<BN / 8>(s);
            mma_nt_sA<BN, D / 16, LD>(s, sQw, sK + buf * BN * LD, lane);
            const bool need_mask = k0 + BN > L || k0 + BN - 1 > qw0 || k0 < lo_w1;
#pragma unroll
            for (int nb = 0; nb < BN / 8; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int kj = k0 + nb * 8 + 2 * tq + (e & 1), r = e >> 1;
                    const float p = exp2f(s[nb][e] * sl2 - lse2[r]);
                    s[nb][e] = (need_mask && (kj >= L || kj > qi[r] || kj < lo[r])) ? 0.0f : p;
                }
        }
        cp_async_wait<1>();
        __syncthreads();
        if (active) {
            float dp[BN / 8][4];
            zero_acc<BN / 8>(dp);
            mma_nt_sA<BN, D / 16, LD>(dp, sdOw, sV + buf * BN * LD, lane);
#pragma unroll
            for (int nb = 0; nb < BN / 8; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    dp[nb][e] = s[nb][e] * (dp[nb][e] - dl[e >> 1]) * a.scale;
            uint32_t da[BN / 16][4];
            c_to_a<BN / 16>(da, dp);
            mma_nn_rA<D, BN / 16, LD>(dQ, da, sK + buf * BN * LD, lane);
        }
        if (has_next)
            kt.store(sK + (buf ^ 1) * BN * LD, sInvF, rot);
    }
    cp_async_wait<0>();
    float prow[2] = {0.0f, 0.0f};
    const float one[2] = {1.0f, 1.0f};
    if (rot)
        for (int r = 0; r < 2; r++)
            prow[r] = qi[r] < L ? (float)pos[qi[r]] * a.pos_scale : 0.0f;
    store_acc<D, LD>(dq + (int64_t)(start + qw0) * a.ldq + (int64_t)h * D, a.ldq, L - qw0, dQ,
                     sQ + warp * 16 * LD, one, rot, prow, sInvF, lane);
}

/* ------------------------------------------------------------------------------ launchers */


/* grid size H * n_seq * nblk, or 0 when it does not fit a 1-D grid */
unsigned ma_grid(int H, const BtAttArgs &a)
{
    const int64_t n = (int64_t)H * a.n_seq * a.nblk;
    return n > 0x7fffffff ? 0u : (unsigned)n;
}

template <int D>
int ma_fwd(const BtAttArgs &a, unsigned grid, bt_bf16 *out, float *lse, const bt_bf16 *q,
           const bt_bf16 *k, const bt_bf16 *v, cudaStream_t stream)
{
    BT_TRY(bt_att_smem(mma_attn_fwd_kernel<D>, MFwdSmem<D>::bytes, D));
    mma_attn_fwd_kernel<D><<<grid, MF_THREADS, MFwdSmem<D>::bytes, stream>>>(a, out, lse, q, k, v);
    BT_LAUNCH_CHECK();
    return BT_OK;
}

template <int D>
int ma_bwd(const bt_cuda_attn_params *p, bt_bf16 *dq, bt_bf16 *dk, bt_bf16 *dv,
           const bt_bf16 *dout, const bt_bf16 *out, const float *lse, const bt_bf16 *q,
           const bt_bf16 *k, const bt_bf16 *v, float *delta, cudaStream_t stream)
{
    const int64_t rows = (int64_t)p->M * p->Hq;
    const int64_t threads = rows * (D / 8);
    bt_att_delta_kernel<D><<<(unsigned)((threads + 255) / 256), 256, 0, stream>>>(delta, dout, out,
                                                                                  rows);
    BT_LAUNCH_CHECK();
    const BtAttArgs akv = bt_att_args(p, MB_BN), aq = bt_att_args(p, MF_BR);
    const unsigned gkv = ma_grid(p->Hkv, akv), gq = ma_grid(p->Hq, aq);
    BT_TRY(bt_att_smem(mma_attn_bwd_dkdv_kernel<D>, MDkvSmem<D>::bytes, D));
    mma_attn_bwd_dkdv_kernel<D><<<gkv, MB_THREADS, MDkvSmem<D>::bytes, stream>>>(
        akv, dk, dv, dout, lse, delta, q, k, v);
    BT_LAUNCH_CHECK();
    BT_TRY(bt_att_smem(mma_attn_bwd_dq_kernel<D>, MDqSmem<D>::bytes, D));
    mma_attn_bwd_dq_kernel<D><<<gq, MF_THREADS, MDqSmem<D>::bytes, stream>>>(aq, dq, dout, lse,
                                                                           delta, q, k, v);
    BT_LAUNCH_CHECK();
    return BT_OK;
}

/* Shared-memory budgets must fit the smallest target, sm_80 (163 KB = 166912 B per block). */
static_assert(MFwdSmem<128>::bytes <= 166912, "mma attention fwd smem exceeds sm_80 limit");
static_assert(MDkvSmem<128>::bytes <= 166912, "mma attention dkdv smem exceeds sm_80 limit");
static_assert(MDqSmem<128>::bytes <= 166912, "mma attention dq smem exceeds sm_80 limit");

/* head_dim 256 has no mma.sync kernel: the warp-resident dK/dV accumulators would take 2 x D/2 =
 * 256 fp32 registers per lane, past the 255-register cap; the wmma kernels (attention.cu) run it */
int ma_refuse_d256(const char *who, int D)
{
    if (D != 256)
        return 0;
    return bt_fail(BT_ERR_UNSUPPORTED, "cuda: %s: head_dim 256 has no mma.sync attention kernel "
                   "(its register-resident dK/dV would need 256 registers per lane); use config "
                   "cuda.attention \"wmma\"", who);
}

} // namespace

extern "C" int bt_cuda_attn_fwd_mma(const bt_cuda_attn_params *p, bt_bf16 *out, float *lse,
                                    const bt_bf16 *q, const bt_bf16 *k, const bt_bf16 *v,
                                    cudaStream_t stream)
{
    const void *ptrs[] = {out, lse, q, k, v};
    const int e = bt_att_enter(__func__, p, ptrs, 5, false, lse, nullptr);
    if (e < 0)
        return e;
    BT_TRY(ma_refuse_d256(__func__, p->D));
    if (e)
        return BT_OK;
    BT_CU_REFUSE(BT_ERR_UNSUPPORTED, p->Hq > 65535);
    const BtAttArgs a = bt_att_args(p, MF_BR);
    const unsigned grid = ma_grid(p->Hq, a);
    BT_CU_REFUSE(BT_ERR_UNSUPPORTED, !grid);
    return p->D == 64 ? ma_fwd<64>(a, grid, out, lse, q, k, v, stream)
                      : ma_fwd<128>(a, grid, out, lse, q, k, v, stream);
}

extern "C" int bt_cuda_attn_bwd_mma(const bt_cuda_attn_params *p, bt_bf16 *dq, bt_bf16 *dk,
                                    bt_bf16 *dv, const bt_bf16 *dout, const bt_bf16 *out,
                                    const float *lse, const bt_bf16 *q, const bt_bf16 *k,
                                    const bt_bf16 *v, float *delta, cudaStream_t stream)
{
    const void *ptrs[] = {dq, dk, dv, dout, out, q, k, v};
    const int e = bt_att_enter(__func__, p, ptrs, 8, true, lse, delta);
    if (e < 0)
        return e;
    BT_TRY(ma_refuse_d256(__func__, p->D));
    if (e)
        return BT_OK;
    BT_CU_REFUSE(BT_ERR_UNSUPPORTED, p->Hq > 65535);
    BT_CU_REFUSE(BT_ERR_UNSUPPORTED, !ma_grid(p->Hq, bt_att_args(p, MF_BR)) ||
                                     !ma_grid(p->Hkv, bt_att_args(p, MB_BN)));
    return p->D == 64 ? ma_bwd<64>(p, dq, dk, dv, dout, out, lse, q, k, v, delta, stream)
                      : ma_bwd<128>(p, dq, dk, dv, dout, out, lse, q, k, v, delta, stream);
}
