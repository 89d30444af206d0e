/* CPU emulation of the CUDA subset BarqTrain uses (tests/emu/README.md).
 *
 * Force-included (g++ -x c++ -DBT_CUDA_EMU -include tests/emu/cuda_emu.h) when a .cu file, first
 * rewritten by tests/emu/cu2cpp.py (kernel launches, extern __shared__), is compiled as host C++.
 * Every CUDA thread is a fiber; the blocks of a launch run one after another on the calling host
 * thread; __syncthreads / __syncwarp / warp collectives (shuffles, ldmatrix, mma, wmma) are
 * barriers that switch fibers. The runtime (scheduler, memory, streams, cuBLAS) is in
 * tests/emu/cuda_emu.cpp. This checks the indexing / synchronisation logic of the kernels on the
 * CPU; it says nothing about timing, occupancy, register pressure or the GPU memory model. */
#ifndef BT_TESTS_EMU_CUDA_EMU_H
#define BT_TESTS_EMU_CUDA_EMU_H
#ifdef __cplusplus

#ifndef BT_CUDA_EMU
#define BT_CUDA_EMU 1
#endif

/* keep the real crt/mma.h (device-only wmma) empty: nvcuda::wmma is emulated below */
#define __CUDA_MMA_H__
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cublas_v2.h>
#include <vector_types.h>
#include <vector_functions.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

/* ---- execution-space and storage qualifiers (host_defines.h made them empty or attributes) ----
 * (the standard headers above come first: libstdc++'s <functional> and <memory> spell
 * __attribute__((__noinline__)), which the __noinline__ macro below would break) */
#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __noinline__
#undef __launch_bounds__
#undef __shared__
#undef __constant__
#undef __managed__
#undef __align__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
/* blocks run one at a time, so one static instance per declaration is the block's shared copy
 * (cu2cpp.py adds a per-block 0xcd poisoning call after each declaration) */
#define __shared__ static
#define __constant__
#define __managed__
#define __align__(n) __attribute__((aligned(n)))
/* kernels/cuda/cuda_internal.h and trainer/cuda/cuda_trainer_internal.h insist on a CUDA compiler */
#ifndef __CUDACC__
#define __CUDACC__ 1
#endif

/* ---------------------------------------------------------------- runtime interface (cuda_emu.cpp) */
namespace bt_emu {
extern uint3 g_tid, g_bid;
extern dim3 g_bdim, g_gdim;

void syncthreads(const char *file, int line);
void syncwarp(unsigned mask, const char *file, int line);
/* kind: 0 idx, 1 up, 2 down, 3 xor */
uint64_t shfl(int kind, unsigned mask, uint64_t v, int arg, int width);
unsigned vote(int kind, unsigned mask, int pred); /* 0 ballot, 1 any, 2 all */
void *dyn_smem();
void shared_poison(void *p, size_t n);
void check_align(const void *p, size_t a, const char *what);
/* PTX-level operations (attention_mma.cu's asm wrappers under BT_CUDA_EMU) */
void ldmatrix_x4(uint32_t r[4], const void *p, bool trans);
void mma_m16n8k16_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1);
void cp_async16(void *dst, const void *src, int src_bytes);
void cp_async_commit();
void cp_async_wait(int n);
/* wmma (bf16 m16n16k16, fp32 accumulators); element e of lane l = matrix element (l/2, (l%2)*8+e) */
void wmma_load_bf16(__nv_bfloat16 x[8], const __nv_bfloat16 *p, unsigned ldm, bool col_major,
                    int use);
void wmma_load_f32(float x[8], const float *p, unsigned ldm, bool col_major);
void wmma_store_f32(float *p, const float x[8], unsigned ldm, bool col_major);
void wmma_mma(float d[8], const __nv_bfloat16 a[8], const __nv_bfloat16 b[8], const float c[8]);

typedef void (*body_fn)(void *);
/* returns the launch error (cudaSuccess, cudaErrorInvalidConfiguration, cudaErrorInvalidValue) */
cudaError_t run(const void *kfn, const char *name, dim3 grid, dim3 block, size_t smem,
                cudaStream_t stream, body_fn body, void *ctx);

template <typename T> static inline uint64_t to_bits(T v)
{
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle type");
    uint64_t u = 0;
    memcpy(&u, &v, sizeof v);
    return u;
}
template <typename T> static inline T from_bits(uint64_t u)
{
    T v;
    memcpy(&v, &u, sizeof v);
    return v;
}

template <typename... P>
struct Launcher {
    void (*k)(P...);
    const char *name;
    dim3 g, b;
    size_t smem;
    cudaStream_t s;
    typedef std::tuple<typename std::decay<P>::type...> Args;
    struct Ctx {
        void (*k)(P...);
        Args *args;
    };
    static void body(void *c)
    {
        Ctx *cc = static_cast<Ctx *>(c);
        std::apply(cc->k, *cc->args); /* each thread gets its own copies of the parameters */
    }
    template <typename... A>
    void operator()(A &&...a) const
    {
        static_assert(sizeof...(A) == sizeof...(P), "kernel launch: wrong number of arguments");
        Args args(std::forward<A>(a)...); /* converted to the parameter types, as at a launch */
        Ctx c = {k, &args};
        const cudaError_t e = run((const void *)k, name, g, b, smem, s, &Launcher::body, &c);
        (void)e;
    }
};
} /* namespace bt_emu */

/* kernel<<<g, b, smem, stream>>>(args) is rewritten by cu2cpp.py into
 * bt_emu_launch(kernel, "kernel", g, b, smem, stream)(args) */
template <typename... P>
static inline bt_emu::Launcher<P...> bt_emu_launch(void (*k)(P...), const char *name, dim3 g,
                                                   dim3 b, size_t smem = 0,
                                                   cudaStream_t s = nullptr)
{
    return bt_emu::Launcher<P...>{k, name, g, b, smem, s};
}

/* cuda_runtime.h declares its kernel-pointer templates only for nvcc (__CUDACC__) */
template <typename T>
static inline cudaError_t cudaFuncSetAttribute(T *entry, enum cudaFuncAttribute attr, int value)
{
    return ::cudaFuncSetAttribute((const void *)entry, attr, value);
}

/* ---------------------------------------------------------------- built-in variables */
#define threadIdx (static_cast<const uint3 &>(bt_emu::g_tid))
#define blockIdx (static_cast<const uint3 &>(bt_emu::g_bid))
#define blockDim (static_cast<const dim3 &>(bt_emu::g_bdim))
#define gridDim (static_cast<const dim3 &>(bt_emu::g_gdim))
#undef warpSize /* a variable, not a macro: cudaDeviceProp has a member of that name */
static constexpr int warpSize = 32;

/* ---------------------------------------------------------------- synchronisation */
#define __syncthreads() bt_emu::syncthreads(__FILE__, __LINE__)
#define __syncwarp(...) bt_emu::syncwarp(bt_emu_mask_or_full(__VA_ARGS__), __FILE__, __LINE__)
static inline unsigned bt_emu_mask_or_full(unsigned m = 0xffffffffu) { return m; }
static inline void __threadfence() {}
static inline void __threadfence_block() {}

template <typename T> static inline T __shfl_sync(unsigned m, T v, int src, int w = 32)
{
    return bt_emu::from_bits<T>(bt_emu::shfl(0, m, bt_emu::to_bits(v), src, w));
}
template <typename T> static inline T __shfl_up_sync(unsigned m, T v, unsigned d, int w = 32)
{
    return bt_emu::from_bits<T>(bt_emu::shfl(1, m, bt_emu::to_bits(v), (int)d, w));
}
template <typename T> static inline T __shfl_down_sync(unsigned m, T v, unsigned d, int w = 32)
{
    return bt_emu::from_bits<T>(bt_emu::shfl(2, m, bt_emu::to_bits(v), (int)d, w));
}
template <typename T> static inline T __shfl_xor_sync(unsigned m, T v, int lm, int w = 32)
{
    return bt_emu::from_bits<T>(bt_emu::shfl(3, m, bt_emu::to_bits(v), lm, w));
}
static inline unsigned __ballot_sync(unsigned m, int p) { return bt_emu::vote(0, m, p); }
static inline int __any_sync(unsigned m, int p) { return (int)bt_emu::vote(1, m, p); }
static inline int __all_sync(unsigned m, int p) { return (int)bt_emu::vote(2, m, p); }

/* ---------------------------------------------------------------- atomics (fibers are cooperative:
 * nothing else runs during a plain read-modify-write) */
template <typename T> static inline T atomicAdd(T *p, T v)
{
    T o = *p;
    *p = o + v;
    return o;
}
template <typename T> static inline T atomicMax(T *p, T v)
{
    T o = *p;
    *p = o > v ? o : v;
    return o;
}
template <typename T> static inline T atomicMin(T *p, T v)
{
    T o = *p;
    *p = o < v ? o : v;
    return o;
}
template <typename T> static inline T atomicExch(T *p, T v)
{
    T o = *p;
    *p = v;
    return o;
}
template <typename T> static inline T atomicCAS(T *p, T cmp, T v)
{
    T o = *p;
    if (o == cmp)
        *p = v;
    return o;
}

/* ---------------------------------------------------------------- loads, address spaces */
template <typename T> static inline T __ldg(const T *p)
{
    if (sizeof(T) >= 8)
        bt_emu::check_align(p, sizeof(T) >= 16 ? 16 : sizeof(T), "__ldg");
    return *p;
}
static inline size_t __cvta_generic_to_shared(const void *p) { return (size_t)p; }

/* ---------------------------------------------------------------- math intrinsics -> libm */
/* CUDA's global min/max overloads (int, unsigned, 64-bit, float, double and mixed) */
template <typename A, typename B>
static inline typename std::common_type<A, B>::type min(A a, B b)
{
    typedef typename std::common_type<A, B>::type C;
    return (C)a < (C)b ? (C)a : (C)b;
}
template <typename A, typename B>
static inline typename std::common_type<A, B>::type max(A a, B b)
{
    typedef typename std::common_type<A, B>::type C;
    return (C)a > (C)b ? (C)a : (C)b;
}
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fsqrt_rn(float a) { return sqrtf(a); }
static inline float __frcp_rn(float a) { return 1.0f / a; }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline float __fdividef(float a, float b) { return a / b; }
/* __expf, __exp2f, __logf, __log2f, __sinf, __cosf, __powf, __tanhf: glibc declares and exports
 * these as its own (accurate) aliases of expf, ..., which is what the emulator wants; __sincosf is
 * declared but not exported */
static inline void bt_emu_sincosf(float x, float *s, float *c) { sincosf(x, s, c); }
#define __sincosf bt_emu_sincosf
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
static inline float __uint_as_float(unsigned u) { return bt_emu::from_bits<float>(u); }
static inline unsigned __float_as_uint(float f) { return (unsigned)bt_emu::to_bits(f); }
static inline float __int_as_float(int u) { return bt_emu::from_bits<float>((uint32_t)u); }
static inline int __float_as_int(float f) { return (int)(uint32_t)bt_emu::to_bits(f); }
static inline int __float2int_rn(float f) { return (int)lrintf(f); }
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
static inline int __ffs(int x) { return __builtin_ffs(x); }

/* ---------------------------------------------------------------- nvcuda::wmma (bf16 16x16x16) */
namespace nvcuda {
namespace wmma {
struct row_major {};
struct col_major {};
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
    static_assert(M == 16 && N == 16 && K == 16, "bt-emu wmma: only m16n16k16 is emulated");
    static_assert(std::is_same<Use, accumulator>::value ? std::is_same<T, float>::value
                                                        : std::is_same<T, __nv_bfloat16>::value,
                  "bt-emu wmma: only bf16 operands with fp32 accumulators are emulated");
    enum { num_elements = 8 };
    T x[8];
};

template <typename Use, typename T, typename L>
static inline void fill_fragment(fragment<Use, 16, 16, 16, T, L> &f,
                                 const typename std::common_type<T>::type &v)
{
    for (int i = 0; i < 8; i++)
        f.x[i] = v;
}
template <typename L>
static inline void load_matrix_sync(fragment<matrix_a, 16, 16, 16, __nv_bfloat16, L> &f,
                                    const __nv_bfloat16 *p, unsigned ldm)
{
    static_assert(std::is_same<L, row_major>::value || std::is_same<L, col_major>::value, "layout");
    bt_emu::wmma_load_bf16(f.x, p, ldm, std::is_same<L, col_major>::value, 0);
}
template <typename L>
static inline void load_matrix_sync(fragment<matrix_b, 16, 16, 16, __nv_bfloat16, L> &f,
                                    const __nv_bfloat16 *p, unsigned ldm)
{
    static_assert(std::is_same<L, row_major>::value || std::is_same<L, col_major>::value, "layout");
    bt_emu::wmma_load_bf16(f.x, p, ldm, std::is_same<L, col_major>::value, 1);
}
static inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float> &f, const float *p,
                                    unsigned ldm, layout_t l)
{
    bt_emu::wmma_load_f32(f.x, p, ldm, l == mem_col_major);
}
static inline void store_matrix_sync(float *p, const fragment<accumulator, 16, 16, 16, float> &f,
                                     unsigned ldm, layout_t l)
{
    bt_emu::wmma_store_f32(p, f.x, ldm, l == mem_col_major);
}
template <typename LA, typename LB>
static inline void mma_sync(fragment<accumulator, 16, 16, 16, float> &d,
                            const fragment<matrix_a, 16, 16, 16, __nv_bfloat16, LA> &a,
                            const fragment<matrix_b, 16, 16, 16, __nv_bfloat16, LB> &b,
                            const fragment<accumulator, 16, 16, 16, float> &c)
{
    bt_emu::wmma_mma(d.x, a.x, b.x, c.x);
}
} /* namespace wmma */
} /* namespace nvcuda */

#endif /* __cplusplus */
#endif
