/* Fused NF4 x bf16 and ggml-blocks x bf16 GEMMs: the quantised weight is decoded inside the GEMM
 * main loop (never written to global memory as bf16). The tiled kernel is a template over the
 * weight source (NF4, or one of the ggml block formats of the GGUF-native base, ggml_decode.h);
 * everything below describes it with NF4, the ggml sources differ only in what a thread loads and
 * decodes per step (one 32-element chunk of a weight row: a Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 block or a K-quant
 * sub-block, decoded by GgmlDec<T>, see the end of this file). Two kernels:
 *
 *  1. Tiled tensor-core kernel (any M): CTA tile 128 x 128 outputs, reduction step 64, 256 threads
 *     = 8 warps as 2 (rows) x 4 (cols), warp tile 64 x 32 = 4 x 2 nvcuda::wmma 16x16x16 bf16
 *     fragments with fp32 accumulators. Per step the activation tile [128 x 64] bf16 and the weight
 *     tile (64 x 128 decoded bf16) are staged in shared memory, double-buffered (two stages, one
 *     __syncthreads per step): global loads for step s+1 go to registers before the MMAs of step s
 *     and are decoded/stored into the other stage after them.
 *     Weight tile: each thread owns one half NF4 block (32 elements = 16 packed bytes, one 16-byte
 *     load) plus that block's absmax (absmax_q byte -> code8 -> * nested -> + offset), decodes it in
 *     registers with a 16-entry shared-memory LUT (bitsandbytes kgemm_4bit_inference /
 *     gemv_4bit keep quant_map in shared memory the same way) and stores 4 x 16 bytes of bf16.
 *       forward  (Y = X W^T):  the weight tile is 128 W rows x 64 cols = one 64-block per W row per
 *                              step; smem [128][72], read as wmma matrix_b col_major.
 *       backward (dX = dY W):  the weight tile is 64 W rows (reduction) x 128 W cols = two 64-blocks
 *                              per W row per step; smem [64][136], read as matrix_b row_major.
 *     Epilogue: each 16x16 accumulator fragment goes through a per-warp fp32 scratch (1 KB) and is
 *     written as bf16 with bounds guards (16-byte stores when the row stride allows).
 *     Shared memory: 128 (LUT) + 8192 (epilogue scratch) + 2 x (18432 + 18432) = 82,048 bytes
 *     (dynamic; the launcher raises the limit with cudaFuncSetAttribute). __launch_bounds__(256, 1):
 *     ptxas (CUDA 13.0) uses ~228-236 registers and spills nothing, so 1 CTA (8 warps) per SM;
 *     with (256, 2) it is capped at 128 registers and spills ~100-170 bytes per thread -- which of
 *     the two is faster has to be measured on the GPU (tests/bench/gpu/bench_kernels_gpu).
 *  2. Small-M forward kernel (M <= 16; decode / inference): CUDA cores, the packed weight is read
 *     exactly once. 256 threads = 8 warps, each warp owns 4 consecutive output columns (W rows),
 *     a CTA owns 32 columns; K runs in chunks of 512 with the X chunk [MT][512] staged in shared
 *     memory (16 KB at MT = 16). Each lane decodes 2 x 8 elements per W row per chunk (one 4-byte
 *     packed load each, coalesced 128 B per warp) and accumulates MT x 4 fp32 partial sums, reduced
 *     with warp shuffles at the end (bitsandbytes kgemm_4bit_inference_naive has the same
 *     one-warp-per-output-row shape; this one adds column blocking so X is reused 4x).
 *
 * Dequantisation is bit-identical to bt_cuda_nf4_dequant (nf4.cu) and kernels/cpu/nf4.c:
 *   absmax = __fadd_rn(__fmul_rn(code8[absmax_q[b]], nested_absmax[b >> 8]), offset)
 *   w      = __float2bfloat16_rn(__fmul_rn(NF4[nibble], absmax))    (high nibble = even element)
 * (bitsandbytes dequantize_blockwise + offset, then kDequantizeBlockwise<NF4>; research §1.2-1.3).
 * The GEMM therefore multiplies exactly the bf16 weight the dequantise + cuBLAS path would. */
#include "kernels/cuda/cuda_internal.h"
#include "kernels/cuda/ggml_decode.h"

#include <mma.h>
#include <type_traits>

using namespace nvcuda;

namespace {

/* bitsandbytes csrc/kernels.cu nf4_dequantization_lut == get_4bit_type("nf4") (same literals as
 * c_nf4_lut in nf4.cu, so the same fp32 values). */
__constant__ float c_nf4g_lut[16] = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
    -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
    0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
    0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f,
};

struct Nf4Dev {
    const uint8_t *packed;
    const uint8_t *absmax_q;
    const float *nested;
    const float *code8;
    float offset;
};

/* absmax of 64-block b: two separate roundings, never an FMA (see nf4.cu). */
__device__ __forceinline__ float nf4_block_absmax(const Nf4Dev &w, int64_t b)
{
    return __fadd_rn(__fmul_rn(__ldg(w.code8 + __ldg(w.absmax_q + b)), __ldg(w.nested + (b >> 8))),
                     w.offset);
}

__device__ __forceinline__ uint32_t bf16_bits(float x)
{
    return (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(x));
}
__device__ __forceinline__ float bf16_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }

/* Decode 4 packed bytes (8 elements; byte j -> elements 2j (high nibble), 2j+1 (low nibble)) into
 * 4 words of two bf16 each (element 2j in the low half = lower address). */
__device__ __forceinline__ void nf4_decode_word(uint32_t wq, float am, const float *lut, uint32_t out[4])
{
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const uint32_t byte = (wq >> (8 * j)) & 0xffu;
        const uint32_t lo = bf16_bits(__fmul_rn(lut[byte >> 4], am));
        const uint32_t hi = bf16_bits(__fmul_rn(lut[byte & 15u], am));
        out[j] = lo | (hi << 16);
    }
}

/* ============================================================ tiled tensor-core kernel */

constexpr int TM = 128, TN = 128, TK = 64, NT = 256;
constexpr int LDA_S = TK + 8;  /* 72: activation tile [TM][LDA_S] */
constexpr int LDBF = TK + 8;   /* 72: forward weight tile [TN][LDBF] (W row, k) */
constexpr int LDBB = TN + 8;   /* 136: backward weight tile [TK][LDBB] (W row = reduction, W col) */
constexpr int A_ELEMS = TM * LDA_S;                                           /* 9216 */
constexpr int B_ELEMS = (TN * LDBF > TK * LDBB) ? TN * LDBF : TK * LDBB;      /* 9216 */
constexpr int STAGE_ELEMS = A_ELEMS + B_ELEMS;
constexpr size_t SM_LUT = 128;                 /* 16 floats, padded */
constexpr size_t SM_SCR = (NT / 32) * 256 * 4; /* 8 warps x 16x16 fp32 */
constexpr size_t SMEM_TILED = SM_LUT + SM_SCR + 2 * (size_t)STAGE_ELEMS * 2; /* 82048 */
static_assert((A_ELEMS * 2) % 128 == 0 && (B_ELEMS * 2) % 128 == 0, "stage alignment");
static_assert(SM_LUT % 128 == 0 && SM_SCR % 128 == 0, "region alignment");

/* Activation tile rows m0..m0+127, reduction cols k0..k0+63 of A [M][Kred] (row stride Kred).
 * Chunk id = tid + 256 i (i < 4): row id/8, cols (id%8)*8 .. +8: 8 threads read one 128-byte row
 * segment. avec (Kred % 8 == 0, A 16-byte aligned): 16-byte loads (a chunk is then either wholly
 * inside or wholly outside [0, Kred)); otherwise element loads. Out-of-range elements are 0. */
__device__ __forceinline__ void tile_load_a(uint4 a[4], const bt_bf16 *__restrict__ A, int M,
                                            int Kred, bool avec, int m0, int k0, int tid)
{
    const uint16_t *Ah = reinterpret_cast<const uint16_t *>(A);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int id = tid + NT * i;
        const int gr = m0 + (id >> 3), gc = k0 + (id & 7) * 8;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (gr < M) {
            const int64_t off = (int64_t)gr * Kred + gc;
            if (avec) {
                if (gc < Kred)
                    v = __ldg(reinterpret_cast<const uint4 *>(A + off));
            } else {
                uint32_t h[8];
#pragma unroll
                for (int e = 0; e < 8; e++)
                    h[e] = (gc + e < Kred) ? (uint32_t)__ldg(Ah + off + e) : 0u;
                v.x = h[0] | (h[1] << 16);
                v.y = h[2] | (h[3] << 16);
                v.z = h[4] | (h[5] << 16);
                v.w = h[6] | (h[7] << 16);
            }
        }
        a[i] = v;
    }
}

/* ---- weight sources of the tiled kernel: what one thread loads for its 32-element chunk of a
 * weight row (W row wrow, cols wcol .. wcol+31, wcol % 32 == 0) before the MMAs of a step
 * (load: global -> registers, `valid` false outside W) and decodes into 32 bf16 of shared memory
 * after them (store; zeros when not valid). ---- */

/* NF4: 16 packed bytes (one 16-byte load; Kw % 64 == 0 keeps the 32 elements inside one 64-block)
 * and that block's absmax; decoded with the 16-entry LUT in shared memory. */
struct Nf4Src {
    Nf4Dev w{};
    static constexpr bool kLut = true;
    struct Raw {
        uint4 wq;
        float am;
        bool valid;
    };
    __device__ __forceinline__ void load(Raw &p, int64_t Wrows, int64_t Kw, int64_t wrow,
                                         int64_t wcol) const
    {
        p.valid = wrow < Wrows && wcol < Kw;
        p.wq = make_uint4(0u, 0u, 0u, 0u);
        p.am = 0.0f;
        if (p.valid) {
            const int64_t e = wrow * Kw + wcol;
            p.wq = __ldg(reinterpret_cast<const uint4 *>(w.packed + (e >> 1)));
            p.am = nf4_block_absmax(w, e >> 6);
        }
    }
    __device__ __forceinline__ void store(bt_bf16 *dst, const Raw &p, const float *lut) const
    {
        const uint32_t wq[4] = {p.wq.x, p.wq.y, p.wq.z, p.wq.w};
#pragma unroll
        for (int q = 0; q < 4; q++) {
            uint32_t o[4] = {0u, 0u, 0u, 0u};
            if (p.valid)
                nf4_decode_word(wq[q], p.am, lut, o);
            *reinterpret_cast<uint4 *>(dst + q * 8) = make_uint4(o[0], o[1], o[2], o[3]);
        }
    }
};

/* ggml blocks of type T (GGUF-native base): rows of row_bytes, GgmlDec<T> per 32-element chunk. */
template <int T>
struct GgmlSrc {
    const uint8_t *data;
    int64_t row_bytes;
    static constexpr bool kLut = false;
    struct Raw {
        typename GgmlDec<T>::Raw r;
        bool valid;
    };
    __device__ __forceinline__ void load(Raw &p, int64_t Wrows, int64_t Kw, int64_t wrow,
                                         int64_t wcol) const
    {
        p.valid = wrow < Wrows && wcol < Kw;
        if (p.valid)
            GgmlDec<T>::load(p.r, data + wrow * row_bytes, (int)wcol);
    }
    __device__ __forceinline__ void store(bt_bf16 *dst, const Raw &p, const float *) const
    {
        uint32_t o[16];
        if (p.valid) {
            GgmlDec<T>::decode(p.r, o);
        } else {
#pragma unroll
            for (int i = 0; i < 16; i++)
                o[i] = 0u;
        }
#pragma unroll
        for (int q = 0; q < 4; q++)
            *reinterpret_cast<uint4 *>(dst + q * 8) =
                make_uint4(o[4 * q], o[4 * q + 1], o[4 * q + 2], o[4 * q + 3]);
    }
};

/* What one thread carries from the global loads of step s+1 to the smem stores after step s. */
template <class WS>
struct TilePrefetch {
    uint4 a[4];            /* 4 x 8 activation elements */
    typename WS::Raw w;    /* its weight chunk */
};

/* C[M][Nout] = A[M][Kred] @ B + beta*C, B[Kred][Nout] taken from the quantised weight W (source
 * WS: Nf4Src or GgmlSrc<T>):
 *   BWD == false (forward):  W is [Nout rows][Kred cols], B = W^T   (Y = X W^T)
 *   BWD == true  (bwd_x):    W is [Kred rows][Nout cols], B = W     (dX = dY W)
 * Row strides: A Kred, C Nout. Grid (ceil(Nout/128), ceil(M/128)), 256 threads, SMEM_TILED bytes.
 * Requires (checked by the launchers) Kw (W cols: Kred forward, Nout backward) % 64 == 0 and
 * W.packed 16-byte aligned for NF4, Kw % 32 == 0 for ggml (a chunk is then wholly inside or
 * outside W), C and A 16-byte aligned; avec/cvec say whether Kred/Nout are multiples of 8. */
template <bool BWD, class WS>
__global__ void __launch_bounds__(NT, 1)
dq_gemm_tiled_kernel(bt_bf16 *__restrict__ C, const bt_bf16 *__restrict__ A, const WS w, int M,
                     int Nout, int Kred, float beta)
{
    extern __shared__ __align__(128) unsigned char smem[];
    float *lut = reinterpret_cast<float *>(smem);
    float *scr_all = reinterpret_cast<float *>(smem + SM_LUT);
    bt_bf16 *stages = reinterpret_cast<bt_bf16 *>(smem + SM_LUT + SM_SCR);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 2, wn = warp & 3; /* warp tile rows wm*64.., cols wn*32.. */
    const int n0 = blockIdx.x * TN, m0 = blockIdx.y * TM;
    const bool avec = (Kred & 7) == 0, cvec = (Nout & 7) == 0;
    const int64_t Kw = BWD ? Nout : Kred;    /* W cols */
    const int64_t Wrows = BWD ? Kred : Nout; /* W rows */

    if (WS::kLut && tid < 16)
        lut[tid] = c_nf4g_lut[tid];
    __syncthreads();

    /* this thread's weight chunk within the tile and its smem offset */
    const int wr_f = tid >> 1, wc_f = (tid & 1) * 32; /* forward: 128 rows x 2 halves */
    const int wr_b = tid >> 2, wc_b = (tid & 3) * 32; /* backward: 64 rows x 4 quarters */
    const int w_soff = BWD ? wr_b * LDBB + wc_b : wr_f * LDBF + wc_f;

    auto load_step = [&](TilePrefetch<WS> &p, int s) {
        const int k0 = s * TK;
        tile_load_a(p.a, A, M, Kred, avec, m0, k0, tid);
        if (BWD)
            w.load(p.w, Wrows, Kw, (int64_t)k0 + wr_b, (int64_t)n0 + wc_b);
        else
            w.load(p.w, Wrows, Kw, (int64_t)n0 + wr_f, (int64_t)k0 + wc_f);
    };
    auto store_step = [&](const TilePrefetch<WS> &p, int stage) {
        bt_bf16 *As = stages + stage * STAGE_ELEMS;
        bt_bf16 *Bs = As + A_ELEMS;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int id = tid + NT * i;
            *reinterpret_cast<uint4 *>(As + (id >> 3) * LDA_S + (id & 7) * 8) = p.a[i];
        }
        w.store(Bs + w_soff, p.w, lut);
    };

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[4][2];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 2; j++)
            wmma::fill_fragment(acc[i][j], 0.0f);

    const int nsteps = (Kred + TK - 1) / TK;
    TilePrefetch<WS> pf;
    load_step(pf, 0);
    store_step(pf, 0);
    __syncthreads();
    for (int s = 0; s < nsteps; s++) {
        const bool more = s + 1 < nsteps;
        if (more)
            load_step(pf, s + 1);
        const bt_bf16 *As = stages + (s & 1) * STAGE_ELEMS;
        const bt_bf16 *Bs = As + A_ELEMS;
#pragma unroll
        for (int kk = 0; kk < TK / 16; kk++) {
            typedef typename std::conditional<BWD, wmma::row_major, wmma::col_major>::type LB;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, LB> fb[2];
#pragma unroll
            for (int j = 0; j < 2; j++) {
                if (BWD) /* element (k, n) at Bs[k * LDBB + n] */
                    wmma::load_matrix_sync(fb[j], Bs + (kk * 16) * LDBB + wn * 32 + j * 16, LDBB);
                else     /* element (k, n) at Bs[n * LDBF + k] */
                    wmma::load_matrix_sync(fb[j], Bs + (wn * 32 + j * 16) * LDBF + kk * 16, LDBF);
            }
#pragma unroll
            for (int i = 0; i < 4; i++) {
                /* element (m, k) at As[m * LDA_S + k] */
                wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
                wmma::load_matrix_sync(fa, As + (wm * 64 + i * 16) * LDA_S + kk * 16, LDA_S);
#pragma unroll
                for (int j = 0; j < 2; j++)
                    wmma::mma_sync(acc[i][j], fa, fb[j], acc[i][j]);
            }
        }
        if (more)
            store_step(pf, (s + 1) & 1);
        __syncthreads();
    }

    /* epilogue: fragment -> warp scratch (row-major 16x16 fp32) -> bf16 C, guarded */
    float *scr = scr_all + warp * 256;
    const int er = lane >> 1, ec = (lane & 1) * 8;
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 2; j++) {
            wmma::store_matrix_sync(scr, acc[i][j], 16, wmma::mem_row_major);
            __syncwarp();
            const int gr = m0 + wm * 64 + i * 16 + er;
            const int gc = n0 + wn * 32 + j * 16 + ec;
            if (gr < M && gc < Nout) {
                float v[8];
#pragma unroll
                for (int e = 0; e < 8; e++)
                    v[e] = scr[er * 16 + ec + e];
                bt_bf16 *cp = C + (int64_t)gr * Nout + gc;
                if (cvec) { /* gc % 8 == 0 and Nout % 8 == 0: all 8 inside, 16-byte aligned */
                    if (beta != 0.0f) {
                        const uint4 old = *reinterpret_cast<const uint4 *>(cp);
                        const uint32_t o[4] = {old.x, old.y, old.z, old.w};
#pragma unroll
                        for (int q = 0; q < 4; q++) {
                            v[2 * q] = fmaf(beta, bf16_lo(o[q]), v[2 * q]);
                            v[2 * q + 1] = fmaf(beta, bf16_hi(o[q]), v[2 * q + 1]);
                        }
                    }
                    uint32_t r[4];
#pragma unroll
                    for (int q = 0; q < 4; q++)
                        r[q] = bf16_bits(v[2 * q]) | (bf16_bits(v[2 * q + 1]) << 16);
                    *reinterpret_cast<uint4 *>(cp) = make_uint4(r[0], r[1], r[2], r[3]);
                } else {
#pragma unroll
                    for (int e = 0; e < 8; e++)
                        if (gc + e < Nout) {
                            float y = v[e];
                            if (beta != 0.0f)
                                y = fmaf(beta, __bfloat162float(cp[e]), y);
                            cp[e] = __float2bfloat16_rn(y);
                        }
                }
            }
            __syncwarp();
        }
}

/* ============================================================ small-M forward kernel */

constexpr int GV_NC = 4;              /* output columns (W rows) per warp */
constexpr int GV_COLS = 8 * GV_NC;    /* per CTA (8 warps) */
constexpr int GV_KC = 512;            /* K chunk staged in smem */

/* Y[M][N] = X[M][K] @ deq(W)[N][K]^T + beta*Y for M <= MT (MT in {1,2,4,8,16}).
 * Grid ceil(N/32), 256 threads. K % 64 == 0; X, Y 16-byte aligned; packed 16-byte aligned.
 * Lane l of a warp covers, in each K chunk kc, elements kc + g*256 + l*8 .. +8 (g = 0, 1). */
template <int MT>
__global__ void __launch_bounds__(256)
nf4_gemv_fwd_kernel(bt_bf16 *__restrict__ Y, const bt_bf16 *__restrict__ X, const Nf4Dev w, int M,
                    int K, int N, float beta)
{
    __shared__ __align__(16) bt_bf16 xs[MT][GV_KC];
    __shared__ float lut[16];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nb = blockIdx.x * GV_COLS + warp * GV_NC; /* first W row of this warp */
    if (tid < 16)
        lut[tid] = c_nf4g_lut[tid];

    float acc[MT][GV_NC];
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int c = 0; c < GV_NC; c++)
            acc[m][c] = 0.0f;

    for (int kc = 0; kc < K; kc += GV_KC) {
        __syncthreads(); /* previous chunk's xs reads done (and lut visible on the first pass) */
        /* stage X[0..MT)[kc .. kc+512) (zeros outside M / K): MT*64 16-byte chunks */
        for (int id = tid; id < MT * (GV_KC / 8); id += 256) {
            const int m = id / (GV_KC / 8), col = (id % (GV_KC / 8)) * 8;
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (m < M && kc + col < K) /* K % 8 == 0: the chunk is wholly inside */
                v = __ldg(reinterpret_cast<const uint4 *>(X + (int64_t)m * K + kc + col));
            *reinterpret_cast<uint4 *>(&xs[m][col]) = v;
        }
        __syncthreads();
#pragma unroll
        for (int g = 0; g < 2; g++) {
            const int kl = g * 256 + lane * 8; /* within the chunk */
            const int k = kc + kl;
            if (k >= K)
                continue;
            float wf[GV_NC][8];
#pragma unroll
            for (int c = 0; c < GV_NC; c++) {
                const int64_t n = nb + c;
                if (n < N) {
                    const int64_t e = n * K + k;
                    const uint32_t wq = __ldg(reinterpret_cast<const uint32_t *>(w.packed + (e >> 1)));
                    const float am = nf4_block_absmax(w, e >> 6);
                    uint32_t o[4];
                    nf4_decode_word(wq, am, lut, o);
#pragma unroll
                    for (int q = 0; q < 4; q++) {
                        wf[c][2 * q] = bf16_lo(o[q]);
                        wf[c][2 * q + 1] = bf16_hi(o[q]);
                    }
                } else {
#pragma unroll
                    for (int e = 0; e < 8; e++)
                        wf[c][e] = 0.0f;
                }
            }
#pragma unroll
            for (int m = 0; m < MT; m++) {
                if (m >= M)
                    break;
                const uint4 xv = *reinterpret_cast<const uint4 *>(&xs[m][kl]);
                const uint32_t xw[4] = {xv.x, xv.y, xv.z, xv.w};
                float xf[8];
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    xf[2 * q] = bf16_lo(xw[q]);
                    xf[2 * q + 1] = bf16_hi(xw[q]);
                }
#pragma unroll
                for (int c = 0; c < GV_NC; c++)
#pragma unroll
                    for (int e = 0; e < 8; e++)
                        acc[m][c] = fmaf(xf[e], wf[c][e], acc[m][c]);
            }
        }
    }

    /* reduce each accumulator over the warp; lane (m*NC + c) % 32 writes output (m, nb + c) */
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int c = 0; c < GV_NC; c++) {
            const float s = bt_warp_sum(acc[m][c]);
            const int n = nb + c;
            if (lane == ((m * GV_NC + c) & 31) && m < M && n < N) {
                bt_bf16 *yp = Y + (int64_t)m * N + n;
                float y = s;
                if (beta != 0.0f)
                    y = fmaf(beta, __bfloat162float(*yp), y);
                *yp = __float2bfloat16_rn(y);
            }
        }
}

template <int MT>
int launch_gemv(cudaStream_t stream, bt_bf16 *Y, const bt_bf16 *X, const Nf4Dev &w, int M, int K,
                int N, float beta)
{
    nf4_gemv_fwd_kernel<MT><<<bt_ceil_div(N, GV_COLS), 256, 0, stream>>>(Y, X, w, M, K, N, beta);
    BT_LAUNCH_CHECK();
    return BT_OK;
}

template <bool BWD, class WS>
int launch_tiled(cudaStream_t stream, bt_bf16 *C, const bt_bf16 *A, const WS &w, int M, int Nout,
                 int Kred, float beta)
{
    BT_TRY(BT_CUDA_CHECK(cudaFuncSetAttribute(dq_gemm_tiled_kernel<BWD, WS>,
                                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              (int)SMEM_TILED)));
    const dim3 grid((unsigned)bt_ceil_div(Nout, TN), (unsigned)bt_ceil_div(M, TM));
    dq_gemm_tiled_kernel<BWD, WS><<<grid, NT, SMEM_TILED, stream>>>(C, A, w, M, Nout, Kred, beta);
    BT_LAUNCH_CHECK();
    return BT_OK;
}

/* Shared argument checks; fills *w. */
int nf4_gemm_args(const char *who, const bt_bf16 *out, const bt_bf16 *in, const bt_cuda_nf4 *W,
                  int M, int K, int N, Nf4Dev *w)
{
    BT_CU_REFUSE_AS(who, BT_ERR_INVALID, !out || !in || !W || !W->packed || !W->absmax_q ||
                                         !W->nested_absmax || !W->code8 || M < 1 || K < 1 ||
                                         N < 1 || W->rows != N || W->cols != K);
    BT_CU_REFUSE_AS(who, BT_ERR_UNSUPPORTED, K % 64 != 0 || ((uintptr_t)out & 15) != 0 ||
                                             ((uintptr_t)in & 15) != 0 ||
                                             ((uintptr_t)W->packed & 15) != 0 ||
                                             bt_ceil_div(M, TM) > 65535);
    w->packed = W->packed;
    w->absmax_q = W->absmax_q;
    w->nested = W->nested_absmax;
    w->code8 = W->code8;
    w->offset = W->offset;
    return BT_OK;
}

} /* namespace */

extern "C" int bt_cuda_nf4_gemm_fwd_impl(cudaStream_t stream, bt_bf16 *Y, const bt_bf16 *X,
                                         const bt_cuda_nf4 *W, int M, int K, int N, float beta,
                                         int impl)
{
    Nf4Dev w{};
    BT_CU_REFUSE(BT_ERR_INVALID, impl < 0 || impl > 2);
    BT_TRY(nf4_gemm_args(__func__, Y, X, W, M, K, N, &w));
    BT_CU_REFUSE(BT_ERR_UNSUPPORTED, impl == 2 && M > 16);
    if (impl == 2 || (impl == 0 && M <= 16)) {
        if (M <= 1)
            return launch_gemv<1>(stream, Y, X, w, M, K, N, beta);
        if (M <= 2)
            return launch_gemv<2>(stream, Y, X, w, M, K, N, beta);
        if (M <= 4)
            return launch_gemv<4>(stream, Y, X, w, M, K, N, beta);
        if (M <= 8)
            return launch_gemv<8>(stream, Y, X, w, M, K, N, beta);
        return launch_gemv<16>(stream, Y, X, w, M, K, N, beta);
    }
    return launch_tiled<false>(stream, Y, X, Nf4Src{w}, M, N, K, beta);
}

extern "C" int bt_cuda_nf4_gemm_fwd(cudaStream_t stream, bt_bf16 *Y, const bt_bf16 *X,
                                    const bt_cuda_nf4 *W, int M, int K, int N, float beta)
{
    return bt_cuda_nf4_gemm_fwd_impl(stream, Y, X, W, M, K, N, beta, 0);
}

extern "C" int bt_cuda_nf4_gemm_bwd_x(cudaStream_t stream, bt_bf16 *dX, const bt_bf16 *dY,
                                      const bt_cuda_nf4 *W, int M, int K, int N, float beta)
{
    Nf4Dev w{};
    BT_TRY(nf4_gemm_args(__func__, dX, dY, W, M, K, N, &w));
    /* C = dX [M][K] (Nout = K), A = dY [M][N] (Kred = N), W [N rows = Kred][K cols = Nout] */
    return launch_tiled<true>(stream, dX, dY, Nf4Src{w}, M, K, N, beta);
}

/* ============================================================ ggml weight sources */

namespace {

/* Argument checks of the ggml GEMMs (kernels_cuda.h). */
int ggml_gemm_args(const char *who, const bt_bf16 *out, const bt_bf16 *in, const bt_cuda_ggml *W,
                   int M, int K, int N)
{
    BT_CU_REFUSE_AS(who, BT_ERR_INVALID, !out || !in || !W || !W->data || M < 1 || K < 1 || N < 1 ||
                                         W->rows != N || W->cols != K);
    BT_CU_REFUSE_AS(who, BT_ERR_UNSUPPORTED, !bt_cuda_ggml_supported(W->type) || K % 32 != 0 ||
                                             ((uintptr_t)out & 15) != 0 ||
                                             ((uintptr_t)in & 15) != 0 ||
                                             bt_ceil_div(M, TM) > 65535);
    return BT_OK;
}

/* C = A @ B with B from W (forward: Nout = N, Kred = K; backward: Nout = K, Kred = N) */
template <bool BWD>
int ggml_launch(cudaStream_t stream, bt_bf16 *C, const bt_bf16 *A, const bt_cuda_ggml *W, int M,
                int Nout, int Kred, float beta)
{
    const uint8_t *d = W->data;
    const int64_t rb = W->row_bytes;
    switch (W->type) {
    case BT_CU_GGML_Q4_0:
        return launch_tiled<BWD>(stream, C, A, GgmlSrc<BT_CU_GGML_Q4_0>{d, rb}, M, Nout, Kred, beta);
    case BT_CU_GGML_Q4_1:
        return launch_tiled<BWD>(stream, C, A, GgmlSrc<BT_CU_GGML_Q4_1>{d, rb}, M, Nout, Kred, beta);
    case BT_CU_GGML_Q5_0:
        return launch_tiled<BWD>(stream, C, A, GgmlSrc<BT_CU_GGML_Q5_0>{d, rb}, M, Nout, Kred, beta);
    case BT_CU_GGML_Q5_1:
        return launch_tiled<BWD>(stream, C, A, GgmlSrc<BT_CU_GGML_Q5_1>{d, rb}, M, Nout, Kred, beta);
    case BT_CU_GGML_Q8_0:
        return launch_tiled<BWD>(stream, C, A, GgmlSrc<BT_CU_GGML_Q8_0>{d, rb}, M, Nout, Kred, beta);
    case BT_CU_GGML_Q4_K:
        return launch_tiled<BWD>(stream, C, A, GgmlSrc<BT_CU_GGML_Q4_K>{d, rb}, M, Nout, Kred, beta);
    case BT_CU_GGML_Q5_K:
        return launch_tiled<BWD>(stream, C, A, GgmlSrc<BT_CU_GGML_Q5_K>{d, rb}, M, Nout, Kred, beta);
    case BT_CU_GGML_Q6_K:
        return launch_tiled<BWD>(stream, C, A, GgmlSrc<BT_CU_GGML_Q6_K>{d, rb}, M, Nout, Kred, beta);
    default:
        return bt_fail(BT_ERR_UNSUPPORTED, "cuda: ggml GEMM: ggml type %d has no CUDA decoder",
                       W->type);
    }
}

} /* namespace */

extern "C" int bt_cuda_ggml_gemm_fwd(cudaStream_t stream, bt_bf16 *Y, const bt_bf16 *X,
                                     const bt_cuda_ggml *W, int M, int K, int N, float beta)
{
    BT_TRY(ggml_gemm_args(__func__, Y, X, W, M, K, N));
    return ggml_launch<false>(stream, Y, X, W, M, N, K, beta);
}

extern "C" int bt_cuda_ggml_gemm_bwd_x(cudaStream_t stream, bt_bf16 *dX, const bt_bf16 *dY,
                                       const bt_cuda_ggml *W, int M, int K, int N, float beta)
{
    BT_TRY(ggml_gemm_args(__func__, dX, dY, W, M, K, N));
    /* C = dX [M][K] (Nout = K), A = dY [M][N] (Kred = N), W [N rows = Kred][K cols = Nout] */
    return ggml_launch<true>(stream, dX, dY, W, M, K, N, beta);
}
