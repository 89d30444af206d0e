/* Runtime of the CPU CUDA emulator (tests/emu/cuda_emu.h, tests/emu/README.md): fibers and the
 * block scheduler, barriers and warp collectives, the PTX operations and wmma used by our kernels,
 * the CUDA runtime API subset (memory, streams, events, device properties, launch checks) and the
 * cuBLAS subset (cublasGemmEx as a plain fp32-accumulating loop).
 *
 * Scheduling: the blocks of a launch run one after another; inside a block every thread is a fiber
 * that runs until it blocks on a barrier (__syncthreads, __syncwarp, a shuffle, ldmatrix, mma,
 * a wmma operation) or exits. Warps run one at a time from one __syncthreads to the next, in
 * ascending and descending warp (and lane) order alternately, so a missing barrier between a write
 * by one thread and a read by another shows up as a wrong result in one of the two orders. Checks (each aborts with the kernel, block and
 * thread): barrier deadlock / __syncthreads reached at different places / different warp
 * collectives in one warp, a collective reading a lane that did not take part, misaligned
 * ldmatrix / cp.async / wmma / __ldg(16-byte) addresses, ldmatrix / cp.async destinations outside
 * shared memory, wmma tiles that run past the dynamic shared memory, a thread exiting with
 * cp.async copies not waited for, accesses past the end of the dynamic shared memory or of a
 * cudaMalloc buffer (guard pages, reported by a SIGSEGV handler), stack overflow of a thread. */
#include "tests/emu/cuda_emu.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdarg>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace bt_emu {
void stream_drain(cudaStream_t s); /* below, with the streams */

uint3 g_tid, g_bid;
dim3 g_bdim, g_gdim;

namespace {

/* ------------------------------------------------------------------------------ diagnostics */
struct LaunchInfo {
    const char *name = nullptr;
    bool active = false;
};
LaunchInfo g_launch;
struct Fiber;
Fiber *g_cur = nullptr;

[[noreturn]] void vfail(const char *fmt, va_list ap)
{
    fflush(stdout);
    fprintf(stderr, "bt-emu: FATAL: ");
    vfprintf(stderr, fmt, ap);
    if (g_launch.active)
        fprintf(stderr, "\n  in kernel %s, block (%u,%u,%u) of (%u,%u,%u), block dim (%u,%u,%u)%s",
                g_launch.name, g_bid.x, g_bid.y, g_bid.z, g_gdim.x, g_gdim.y, g_gdim.z, g_bdim.x,
                g_bdim.y, g_bdim.z, "");
    if (g_launch.active && g_cur)
        fprintf(stderr, ", thread (%u,%u,%u)", g_tid.x, g_tid.y, g_tid.z);
    fprintf(stderr, "\n");
    fflush(stderr);
    abort();
}
[[noreturn]] __attribute__((format(printf, 1, 2))) void fail(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vfail(fmt, ap);
}

/* ------------------------------------------------------------------------------ fibers */
constexpr size_t STACK = 256 * 1024;
constexpr int MAXT = 1024;
size_t g_page = 4096;

#if defined(__x86_64__)
extern "C" void bt_emu_swap(void **save_sp, void *load_sp);
asm(R"(
    .text
    .globl bt_emu_swap
    .type bt_emu_swap,@function
bt_emu_swap:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size bt_emu_swap, .-bt_emu_swap
    .section .note.GNU-stack,"",@progbits
    .text
)");
#endif

enum { F_READY, F_BAR, F_WARP, F_DONE };

struct CpReq {
    unsigned char *dst;
    unsigned char data[16];
    int group; /* -1: not committed yet */
};

struct Fiber {
#if defined(__x86_64__)
    void *sp;
#else
    ucontext_t ctx;
#endif
    char *stack;
    int state;
    uint3 tid;
    int warp, lane;
    const char *file; /* barrier site */
    int line;
    int wkind;
    std::vector<CpReq> cp;
    int cp_groups; /* groups committed so far */
};

constexpr int XB = 64; /* bytes per lane in a collective exchange slot */
struct Slot {
    unsigned char data[32][XB];
    unsigned gen[32];
};
struct Warp {
    int live, arrived, nlanes;
    unsigned gen;
    Slot slot[2];
};
struct Block {
    int live, arrived;
    int nthreads;
};

Fiber *g_fib = nullptr; /* MAXT fibers */
char *g_stacks = nullptr;
Warp g_warps[MAXT / 32];
Block g_blk;
#if defined(__x86_64__)
void *g_sched_sp;
#else
ucontext_t g_sched_ctx;
#endif
bt_emu::body_fn g_body;
void *g_body_ctx;

void resume(Fiber &f)
{
    g_cur = &f;
    g_tid = f.tid;
#if defined(__x86_64__)
    bt_emu_swap(&g_sched_sp, f.sp);
#else
    swapcontext(&g_sched_ctx, &f.ctx);
#endif
    g_cur = nullptr;
}
void yield()
{
    Fiber &f = *g_cur;
#if defined(__x86_64__)
    bt_emu_swap(&f.sp, g_sched_sp);
#else
    swapcontext(&f.ctx, &g_sched_ctx);
#endif
}

void block_release();
void warp_release(Warp &w, int wi);

[[noreturn]] void thread_exit()
{
    Fiber &f = *g_cur;
    if (!f.cp.empty())
        fail("thread exits with %zu cp.async copies that were never waited for "
             "(cp.async.wait_group missing)", f.cp.size());
    f.state = F_DONE;
    g_blk.live--;
    Warp &w = g_warps[f.warp];
    w.live--;
    if (g_blk.arrived > 0 && g_blk.arrived == g_blk.live)
        block_release();
    if (w.arrived > 0 && w.arrived == w.live)
        warp_release(w, f.warp);
    yield();
    fail("resumed a finished thread");
}

extern "C" void bt_emu_fiber_main()
{
    g_body(g_body_ctx);
    thread_exit();
}

void init_fibers()
{
    if (g_fib)
        return;
    g_page = (size_t)sysconf(_SC_PAGESIZE);
    g_fib = new Fiber[MAXT];
    const size_t per = STACK + g_page;
    void *m = mmap(nullptr, per * MAXT, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED)
        fail("mmap of the fiber stacks failed");
    g_stacks = (char *)m;
    for (int i = 0; i < MAXT; i++) {
        g_fib[i].stack = g_stacks + per * i + g_page;
        mprotect(g_stacks + per * i, g_page, PROT_NONE); /* guard: stack overflow -> SIGSEGV */
    }
}

void start_fiber(Fiber &f)
{
#if defined(__x86_64__)
    uintptr_t top = ((uintptr_t)(f.stack + STACK)) & ~(uintptr_t)15;
    uint64_t *sp = (uint64_t *)top;
    *--sp = 0;                                  /* fake return address of bt_emu_fiber_main */
    *--sp = (uint64_t)(uintptr_t)&bt_emu_fiber_main; /* popped by ret: 16-byte aligned slot */
    for (int i = 0; i < 6; i++)
        *--sp = 0; /* rbp rbx r12..r15 */
    --sp;
    uint32_t mx;
    uint16_t cw;
    asm volatile("stmxcsr %0" : "=m"(mx));
    asm volatile("fnstcw %0" : "=m"(cw));
    memcpy((char *)sp, &mx, 4);
    memcpy((char *)sp + 4, &cw, 2);
    f.sp = sp;
#else
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = STACK;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, (void (*)())bt_emu_fiber_main, 0);
#endif
}

/* ------------------------------------------------------------------------------ barriers */
void block_release()
{
    const int n = g_blk.nthreads;
    const Fiber *first = nullptr;
    for (int i = 0; i < n; i++) {
        Fiber &f = g_fib[i];
        if (f.state != F_BAR)
            continue;
        if (!first)
            first = &f;
        else if (f.line != first->line || strcmp(f.file, first->file) != 0)
            fail("__syncthreads reached at different places by one block: thread %d at %s:%d, "
                 "thread %d at %s:%d (divergent barrier)",
                 (int)(first - g_fib), first->file, first->line, i, f.file, f.line);
        f.state = F_READY;
    }
    g_blk.arrived = 0;
}

const char *kind_name(int k)
{
    static const char *const names[] = {"__syncwarp", "__shfl_sync", "__shfl_up_sync",
                                        "__shfl_down_sync", "__shfl_xor_sync", "vote",
                                        "ldmatrix", "ldmatrix.trans", "mma.sync.m16n8k16",
                                        "wmma::load_matrix_sync", "wmma::store_matrix_sync",
                                        "wmma::mma_sync"};
    return k >= 0 && k < (int)(sizeof names / sizeof names[0]) ? names[k] : "?";
}
enum { K_SYNCWARP, K_SHFL, K_SHFL_UP, K_SHFL_DOWN, K_SHFL_XOR, K_VOTE, K_LDSM, K_LDSM_T, K_MMA,
       K_WLOAD, K_WSTORE, K_WMMA };

void warp_release(Warp &w, int wi)
{
    const Fiber *first = nullptr;
    for (int l = 0; l < w.nlanes; l++) {
        Fiber &f = g_fib[wi * 32 + l];
        if (f.state != F_WARP)
            continue;
        if (!first)
            first = &f;
        else if (f.wkind != first->wkind)
            fail("divergent warp collectives in warp %d: lane %d in %s (%s:%d), lane %d in %s "
                 "(%s:%d)", wi, first->lane, kind_name(first->wkind), first->file, first->line, l,
                 kind_name(f.wkind), f.file, f.line);
        f.state = F_READY;
    }
    w.arrived = 0;
    w.gen++;
}

void check_mask(unsigned mask, const Warp &w, const char *what)
{
    const unsigned need = w.nlanes == 32 ? 0xffffffffu : ((1u << w.nlanes) - 1u);
    if ((mask & need) != need)
        fail("%s with mask 0x%08x: only full-warp masks are emulated", what, mask);
}

/* Write this lane's data into the warp's exchange slot, wait for the whole warp, return the slot.
 * Double-buffered by barrier generation: the next collective writes the other slot, and the one
 * after that starts only after every lane has passed the next barrier (so finished reading). */
Slot &collective(int kind, const void *mine, size_t n, unsigned mask, const char *file, int line)
{
    Fiber &f = *g_cur;
    Warp &w = g_warps[f.warp];
    check_mask(mask, w, kind_name(kind));
    const unsigned gen = w.gen;
    Slot &s = w.slot[gen & 1];
    if (n)
        memcpy(s.data[f.lane], mine, n);
    s.gen[f.lane] = gen + 1; /* +1: 0 never matches a fresh block */
    f.state = F_WARP;
    f.wkind = kind;
    f.file = file;
    f.line = line;
    w.arrived++;
    if (w.arrived == w.live)
        warp_release(w, f.warp);
    yield();
    return s;
}
const unsigned char *lane_data(const Slot &s, int src, const char *what)
{
    const Fiber &f = *g_cur;
    const unsigned gen = g_warps[f.warp].gen; /* released: gen was incremented once */
    if (src < 0 || src >= 32 || s.gen[src] != gen)
        fail("%s: lane %d reads lane %d, which did not take part (exited or outside the block)",
             what, f.lane, src);
    return s.data[src];
}

/* ------------------------------------------------------------------------------ shared memory */
constexpr size_t MAX_DYN_SMEM = 232448; /* 227 KB: sm_90 opt-in maximum per block */
/* The opt-in maximum the emulated device reports and enforces: MAX_DYN_SMEM, or a smaller
 * BT_EMU_SMEM_OPTIN=BYTES (read at every call: a test emulates a smaller GPU, e.g. sm_80's
 * 166912, around one call and sets it back) */
size_t optin_smem()
{
    const char *e = getenv("BT_EMU_SMEM_OPTIN");
    const long v = e ? atol(e) : 0;
    return v > 0 && (size_t)v < MAX_DYN_SMEM ? (size_t)v : MAX_DYN_SMEM;
}
constexpr size_t DEFAULT_DYN_SMEM = 48 * 1024;
unsigned char *g_dyn_area = nullptr, *g_dyn_guard = nullptr;
unsigned char *g_dyn = nullptr;
size_t g_dyn_size = 0;
uint64_t g_block_serial = 0;
struct StaticShared {
    void *p;
    size_t n;
    uint64_t serial;
};
std::vector<StaticShared> g_static_shared;

void init_dyn()
{
    if (g_dyn_area)
        return;
    const size_t len = ((MAX_DYN_SMEM + g_page - 1) / g_page) * g_page + g_page;
    void *m = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED)
        fail("mmap of the shared memory area failed");
    g_dyn_area = (unsigned char *)m;
    g_dyn_guard = g_dyn_area + len - g_page;
    mprotect(g_dyn_guard, g_page, PROT_NONE);
}

bool in_shared(const void *p, size_t n)
{
    const unsigned char *c = (const unsigned char *)p;
    if (c >= g_dyn && c + n <= g_dyn + g_dyn_size)
        return true;
    for (const StaticShared &s : g_static_shared)
        if (c >= (unsigned char *)s.p && c + n <= (unsigned char *)s.p + s.n)
            return true;
    return false;
}
void check_shared(const void *p, size_t n, const char *what)
{
    if (!in_shared(p, n))
        fail("%s: address %p (+%zu bytes) is not in shared memory (dynamic shared memory %p, "
             "%zu bytes)", what, p, n, (void *)g_dyn, g_dyn_size);
}
/* a tile touching the dynamic region must lie inside it */
void check_dyn_extent(const void *p, size_t last_byte_excl, const char *what)
{
    const unsigned char *c = (const unsigned char *)p;
    if (c >= g_dyn && c < g_dyn_guard && c + last_byte_excl > g_dyn + g_dyn_size)
        fail("%s: tile at dynamic shared offset %td extends %zu bytes, past the %zu-byte "
             "dynamic shared memory", what, c - g_dyn, last_byte_excl, g_dyn_size);
}

/* ------------------------------------------------------------------------------ launches */
std::map<const void *, int> g_func_max_dyn;
cudaError_t g_last_error = cudaSuccess;
int g_trace = -1;
double g_emu_seconds = 0;
uint64_t g_launches = 0;

void run_block(int nthreads)
{
    g_blk.live = nthreads;
    g_blk.arrived = 0;
    g_blk.nthreads = nthreads;
    const int nw = (nthreads + 31) / 32;
    for (int w = 0; w < nw; w++) {
        Warp &wp = g_warps[w];
        wp.nlanes = nthreads - w * 32 < 32 ? nthreads - w * 32 : 32;
        wp.live = wp.nlanes;
        wp.arrived = 0;
        wp.gen = 0;
        memset(wp.slot[0].gen, 0, sizeof wp.slot[0].gen);
        memset(wp.slot[1].gen, 0, sizeof wp.slot[1].gen);
    }
    for (int i = 0; i < nthreads; i++) {
        Fiber &f = g_fib[i];
        f.state = F_READY;
        f.tid.x = (unsigned)i % g_bdim.x;
        f.tid.y = ((unsigned)i / g_bdim.x) % g_bdim.y;
        f.tid.z = (unsigned)i / (g_bdim.x * g_bdim.y);
        f.warp = i / 32;
        f.lane = i % 32;
        f.cp.clear();
        f.cp_groups = 0;
        start_fiber(f);
    }
    /* Warp-greedy rounds: each warp in turn runs until all its lanes wait at __syncthreads (or
     * exited), its lanes in alternating order between warp collectives; the warp order alternates
     * between rounds (= between __syncthreads). So one warp runs a whole barrier interval before
     * the next one starts: a read of data another warp writes (or cp.async-copies) in the same
     * interval sees the old contents (or the 0xcd garbage) in one of the two orders. */
    for (int round = 0;; round++) {
        bool ran = false;
        for (int wi = 0; wi < nw; wi++) {
            const int w = (round & 1) ? nw - 1 - wi : wi;
            const int base = w * 32, nl = g_warps[w].nlanes;
            for (int it = 0;; it++) {
                bool any = false;
                for (int li = 0; li < nl; li++) {
                    const int l = ((round + it) & 1) ? nl - 1 - li : li;
                    if (g_fib[base + l].state == F_READY) {
                        any = true;
                        resume(g_fib[base + l]);
                    }
                }
                if (!any)
                    break;
                ran = true;
            }
        }
        if (g_blk.live == 0)
            break;
        if (!ran) {
            std::string msg;
            int shown = 0;
            for (int i = 0; i < nthreads && shown < 8; i++) {
                const Fiber &f = g_fib[i];
                if (f.state == F_DONE)
                    continue;
                char b[256];
                snprintf(b, sizeof b, "\n    thread %d: %s at %s:%d", i,
                         f.state == F_BAR ? "__syncthreads" : kind_name(f.wkind), f.file, f.line);
                msg += b;
                shown++;
            }
            fail("barrier deadlock: %d live threads all wait, %d at __syncthreads; first ones:%s",
                 g_blk.live, g_blk.arrived, msg.c_str());
        }
    }
}

/* ------------------------------------------------------------------------------ SIGSEGV */
struct Alloc {
    unsigned char *map;
    size_t maplen, size;
    unsigned char *user;
};
std::map<uintptr_t, Alloc> g_allocs; /* by user pointer */
size_t g_alloc_bytes = 0;

void on_segv(int sig, siginfo_t *si, void *)
{
    const unsigned char *a = (const unsigned char *)si->si_addr;
    char what[512];
    if (a >= g_dyn_guard && a < g_dyn_guard + g_page)
        snprintf(what, sizeof what, "access past the end of the dynamic shared memory (%zu bytes; "
                 "byte offset %td)", g_dyn_size, a - g_dyn);
    else if (g_stacks && a >= (unsigned char *)g_stacks &&
             a < (unsigned char *)g_stacks + (STACK + g_page) * MAXT)
        snprintf(what, sizeof what, "thread stack overflow (or access to its guard page)");
    else if (si->si_addr == nullptr)
        snprintf(what, sizeof what, "NULL pointer dereference or general protection fault (a "
                 "misaligned 16-byte vector access compiles to an aligned SSE move that faults)");
    else {
        snprintf(what, sizeof what, "invalid access at %p", si->si_addr);
        for (auto &kv : g_allocs) {
            const Alloc &al = kv.second;
            if (a >= al.map && a < al.map + al.maplen + g_page) {
                snprintf(what, sizeof what, "access at byte offset %td of a %zu-byte cudaMalloc "
                         "buffer (out of bounds: guard page after it)", a - al.user, al.size);
                break;
            }
        }
    }
    fflush(stdout);
    fprintf(stderr, "bt-emu: FATAL: %s %s", sig == SIGBUS ? "SIGBUS" : "SIGSEGV", what);
    if (g_launch.active)
        fprintf(stderr, "\n  in kernel %s, block (%u,%u,%u), thread (%u,%u,%u)", g_launch.name,
                g_bid.x, g_bid.y, g_bid.z, g_tid.x, g_tid.y, g_tid.z);
    else
        fprintf(stderr, " (host code)");
    fprintf(stderr, "\n");
    signal(SIGABRT, SIG_DFL);
    abort();
}

struct Init {
    Init()
    {
        static char altstack[256 * 1024];
        stack_t ss;
        ss.ss_sp = altstack;
        ss.ss_size = sizeof altstack;
        ss.ss_flags = 0;
        sigaltstack(&ss, nullptr);
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = on_segv;
        sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
        sigaction(SIGSEGV, &sa, nullptr);
        sigaction(SIGBUS, &sa, nullptr);
    }
    ~Init()
    {
        if (g_trace > 0)
            fprintf(stderr, "bt-emu: %llu launches, %.2f s emulated\n",
                    (unsigned long long)g_launches, g_emu_seconds);
    }
} g_init;

} /* namespace */

/* ------------------------------------------------------------------------------ public: device */
void syncthreads(const char *file, int line)
{
    if (!g_cur)
        fail("__syncthreads outside a kernel");
    Fiber &f = *g_cur;
    f.state = F_BAR;
    f.file = file;
    f.line = line;
    g_blk.arrived++;
    if (g_blk.arrived == g_blk.live)
        block_release();
    yield();
}

void syncwarp(unsigned mask, const char *file, int line)
{
    if (!g_cur)
        fail("__syncwarp outside a kernel");
    collective(K_SYNCWARP, nullptr, 0, mask, file, line);
}

uint64_t shfl(int kind, unsigned mask, uint64_t v, int arg, int width)
{
    static const int kinds[4] = {K_SHFL, K_SHFL_UP, K_SHFL_DOWN, K_SHFL_XOR};
    if (width < 1 || width > 32 || (width & (width - 1)))
        fail("%s: width %d is not a power of two <= 32", kind_name(kinds[kind]), width);
    Slot &s = collective(kinds[kind], &v, sizeof v, mask, "shuffle", 0);
    const int lane = g_cur->lane, seg = lane & ~(width - 1);
    int src = lane;
    switch (kind) {
    case 0: src = seg + (arg & (width - 1)); break;
    case 1: src = lane - arg >= seg ? lane - arg : lane; break;
    case 2: src = lane + arg < seg + width ? lane + arg : lane; break;
    default: src = ((lane ^ arg) & ~(width - 1)) == seg ? (lane ^ arg) : lane; break;
    }
    uint64_t r;
    memcpy(&r, lane_data(s, src, kind_name(kinds[kind])), sizeof r);
    return r;
}

unsigned vote(int kind, unsigned mask, int pred)
{
    const int p = pred != 0;
    Slot &s = collective(K_VOTE, &p, sizeof p, mask, "vote", 0);
    const Warp &w = g_warps[g_cur->warp];
    unsigned b = 0;
    for (int l = 0; l < w.nlanes; l++) {
        int q;
        memcpy(&q, lane_data(s, l, "vote"), sizeof q);
        b |= (unsigned)q << l;
    }
    const unsigned all = w.nlanes == 32 ? 0xffffffffu : ((1u << w.nlanes) - 1u);
    return kind == 0 ? b : kind == 1 ? (unsigned)(b != 0) : (unsigned)(b == all);
}

void *dyn_smem() { return g_dyn; }

void shared_poison(void *p, size_t n)
{
    for (StaticShared &s : g_static_shared)
        if (s.p == p) {
            if (s.serial != g_block_serial) {
                s.serial = g_block_serial;
                memset(p, 0xcd, n);
            }
            return;
        }
    g_static_shared.push_back({p, n, g_block_serial});
    memset(p, 0xcd, n);
}

void check_align(const void *p, size_t a, const char *what)
{
    if ((uintptr_t)p & (a - 1))
        fail("%s: address %p is not %zu-byte aligned", what, p, a);
}

static inline float bf_lo(uint32_t u) { return __uint_as_float(u << 16); }
static inline float bf_hi(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }

void ldmatrix_x4(uint32_t r[4], const void *p, bool trans)
{
    const char *what = trans ? "ldmatrix.x4.trans" : "ldmatrix.x4";
    check_align(p, 16, what);
    check_shared(p, 16, what);
    Slot &s = collective(trans ? K_LDSM_T : K_LDSM, &p, sizeof p, 0xffffffffu, what, 0);
    const int l = g_cur->lane;
    for (int j = 0; j < 4; j++) {
        const uint16_t *rows[8];
        for (int i = 0; i < 8; i++)
            memcpy(&rows[i], lane_data(s, 8 * j + i, what), sizeof(void *));
        uint16_t lo, hi;
        if (!trans) {
            lo = rows[l / 4][2 * (l % 4)];
            hi = rows[l / 4][2 * (l % 4) + 1];
        } else {
            lo = rows[2 * (l % 4)][l / 4];
            hi = rows[2 * (l % 4) + 1][l / 4];
        }
        r[j] = (uint32_t)lo | ((uint32_t)hi << 16);
    }
}

/* PTX mma.m16n8k16 .bf16 (row.col): g = lane/4, t = lane%4. A regs a0..a3 = (row g, k 2t..),
 * (row g+8, k 2t..), (row g, k 2t+8..), (row g+8, k 2t+8..); B b0 = (k 2t, 2t+1; n g), b1 = (k
 * 2t+8, 2t+9; n g); C c0..c3 = (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1). */
void mma_m16n8k16_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
{
    uint32_t mine[6] = {a[0], a[1], a[2], a[3], b0, b1};
    Slot &s = collective(K_MMA, mine, sizeof mine, 0xffffffffu, "mma.sync", 0);
    const int l = g_cur->lane, g = l >> 2, t = l & 3;
    float A[2][16], B[2][16]; /* rows g, g+8 of A; columns 2t, 2t+1 of B */
    for (int tt = 0; tt < 4; tt++) {
        uint32_t o[6];
        memcpy(o, lane_data(s, 4 * g + tt, "mma.sync"), sizeof o); /* lanes with row g */
        A[0][2 * tt] = bf_lo(o[0]);
        A[0][2 * tt + 1] = bf_hi(o[0]);
        A[1][2 * tt] = bf_lo(o[1]);
        A[1][2 * tt + 1] = bf_hi(o[1]);
        A[0][2 * tt + 8] = bf_lo(o[2]);
        A[0][2 * tt + 9] = bf_hi(o[2]);
        A[1][2 * tt + 8] = bf_lo(o[3]);
        A[1][2 * tt + 9] = bf_hi(o[3]);
        for (int cc = 0; cc < 2; cc++) { /* lanes with n = 2t + cc */
            memcpy(o, lane_data(s, 4 * (2 * t + cc) + tt, "mma.sync"), sizeof o);
            B[cc][2 * tt] = bf_lo(o[4]);
            B[cc][2 * tt + 1] = bf_hi(o[4]);
            B[cc][2 * tt + 8] = bf_lo(o[5]);
            B[cc][2 * tt + 9] = bf_hi(o[5]);
        }
    }
    for (int i = 0; i < 4; i++) {
        const float *ar = A[i >> 1], *bc = B[i & 1];
        float acc = c[i];
        for (int k = 0; k < 16; k++)
            acc += ar[k] * bc[k];
        c[i] = acc;
    }
}

void cp_async16(void *dst, const void *src, int src_bytes)
{
    check_align(dst, 16, "cp.async (shared destination)");
    check_align(src, 16, "cp.async (global source)");
    check_shared(dst, 16, "cp.async destination");
    if (src_bytes < 0 || src_bytes > 16)
        fail("cp.async: src-size %d not in [0, 16]", src_bytes);
    CpReq r;
    r.dst = (unsigned char *)dst;
    memset(r.data, 0, 16);
    if (src_bytes)
        memcpy(r.data, src, (size_t)src_bytes);
    r.group = -1;
    g_cur->cp.push_back(r);
}
void cp_async_commit()
{
    Fiber &f = *g_cur;
    f.cp_groups++;
    for (CpReq &r : f.cp)
        if (r.group < 0)
            r.group = f.cp_groups;
}
/* data lands only here: every committed group but the newest n */
void cp_async_wait(int n)
{
    Fiber &f = *g_cur;
    size_t keep = 0;
    for (size_t i = 0; i < f.cp.size(); i++) {
        CpReq &r = f.cp[i];
        if (r.group >= 0 && r.group <= f.cp_groups - n)
            memcpy(r.dst, r.data, 16);
        else
            f.cp[keep++] = r;
    }
    f.cp.resize(keep);
}

/* wmma: lane l holds elements (l/2, (l%2)*8 + e), e < 8, of the logical 16x16 matrix
 * (matrix_a (m,k), matrix_b (k,n), accumulator (m,n)); layout picks the memory order. */
struct WTile {
    const void *p;
    unsigned ldm;
    int colmaj, use;
};
static void wmma_collective(int kind, const void *p, unsigned ldm, bool col, int use, size_t esz,
                            const char *what)
{
    check_align(p, 32, what); /* CUDA: mptr must be 256-bit aligned */
    if ((ldm * esz) % 16 != 0)
        fail("%s: ldm %u is not a multiple of 16 bytes", what, ldm);
    check_dyn_extent(p, (15 * (size_t)ldm + 16) * esz, what);
    WTile t = {p, ldm, col ? 1 : 0, use};
    Slot &s = collective(kind, &t, sizeof t, 0xffffffffu, what, 0);
    const Warp &w = g_warps[g_cur->warp];
    for (int l = 0; l < w.nlanes; l++) {
        WTile o;
        memcpy(&o, lane_data(s, l, what), sizeof o);
        if (o.p != t.p || o.ldm != t.ldm || o.colmaj != t.colmaj || o.use != t.use)
            fail("%s: arguments differ between lanes (lane %d: %p ldm %u, lane %d: %p ldm %u)",
                 what, g_cur->lane, t.p, t.ldm, l, o.p, o.ldm);
    }
}
void wmma_load_bf16(__nv_bfloat16 x[8], const __nv_bfloat16 *p, unsigned ldm, bool col, int use)
{
    wmma_collective(K_WLOAD, p, ldm, col, use, 2, "wmma::load_matrix_sync");
    const int l = g_cur->lane, r = l >> 1, c0 = (l & 1) * 8;
    for (int e = 0; e < 8; e++)
        x[e] = col ? p[(size_t)(c0 + e) * ldm + r] : p[(size_t)r * ldm + c0 + e];
}
void wmma_load_f32(float x[8], const float *p, unsigned ldm, bool col)
{
    wmma_collective(K_WLOAD, p, ldm, col, 2, 4, "wmma::load_matrix_sync");
    const int l = g_cur->lane, r = l >> 1, c0 = (l & 1) * 8;
    for (int e = 0; e < 8; e++)
        x[e] = col ? p[(size_t)(c0 + e) * ldm + r] : p[(size_t)r * ldm + c0 + e];
}
void wmma_store_f32(float *p, const float x[8], unsigned ldm, bool col)
{
    wmma_collective(K_WSTORE, p, ldm, col, 2, 4, "wmma::store_matrix_sync");
    const int l = g_cur->lane, r = l >> 1, c0 = (l & 1) * 8;
    for (int e = 0; e < 8; e++)
        (col ? p[(size_t)(c0 + e) * ldm + r] : p[(size_t)r * ldm + c0 + e]) = x[e];
}
void wmma_mma(float d[8], const __nv_bfloat16 a[8], const __nv_bfloat16 b[8], const float c[8])
{
    __nv_bfloat16 mine[16];
    memcpy(mine, a, 16);
    memcpy(mine + 8, b, 16);
    Slot &s = collective(K_WMMA, mine, sizeof mine, 0xffffffffu, "wmma::mma_sync", 0);
    const int l = g_cur->lane, r = l >> 1, half = l & 1;
    float A[16], B[16][8];
    for (int h = 0; h < 2; h++) {
        __nv_bfloat16 o[16];
        memcpy(o, lane_data(s, 2 * r + h, "wmma::mma_sync"), sizeof o);
        for (int e = 0; e < 8; e++)
            A[h * 8 + e] = __bfloat162float(o[e]);
    }
    for (int k = 0; k < 16; k++) {
        __nv_bfloat16 o[16];
        memcpy(o, lane_data(s, 2 * k + half, "wmma::mma_sync"), sizeof o);
        for (int e = 0; e < 8; e++)
            B[k][e] = __bfloat162float(o[8 + e]);
    }
    float out[8];
    for (int e = 0; e < 8; e++) {
        float acc = c[e];
        for (int k = 0; k < 16; k++)
            acc += A[k] * B[k][e];
        out[e] = acc;
    }
    memcpy(d, out, sizeof out);
}

/* ------------------------------------------------------------------------------ public: launch */
cudaError_t run(const void *kfn, const char *name, dim3 grid, dim3 block, size_t smem,
                cudaStream_t stream, body_fn body, void *ctx)
{
    stream_drain(stream); /* after the stream's earlier work (an NCCL collective) */
    if (g_launch.active)
        fail("kernel %s launched from inside kernel %s (dynamic parallelism is not emulated)", name,
             g_launch.name);
    if (g_trace < 0) {
        const char *t = getenv("BT_EMU_TRACE");
        g_trace = t && atoi(t) > 0 ? atoi(t) : 0;
    }
    /* fault injection for the scripts that must survive a crashing GPU program (tests/gpu/run.sh
     * restarts a test binary after the case it crashed in; tests/py/test_gpu_scripts.py) */
    const char *crash = getenv("BT_EMU_CRASH_KERNEL");
    if (crash && *crash && strstr(name, crash)) {
        fprintf(stderr, "bt-emu: BT_EMU_CRASH_KERNEL=%s: aborting at the launch of %s (injected fault)\n",
                crash, name);
        fflush(stdout);
        abort();
    }
    const uint64_t nthr = (uint64_t)block.x * block.y * block.z;
    cudaError_t err = cudaSuccess;
    if (nthr == 0 || nthr > 1024 || block.x > 1024 || block.y > 1024 || block.z > 64 ||
        grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 2147483647u || grid.y > 65535 ||
        grid.z > 65535)
        err = cudaErrorInvalidConfiguration;
    else {
        auto it = g_func_max_dyn.find(kfn);
        const size_t lim = it != g_func_max_dyn.end() && (size_t)it->second > DEFAULT_DYN_SMEM
                               ? (size_t)it->second
                               : DEFAULT_DYN_SMEM;
        if (smem > lim)
            err = cudaErrorInvalidValue;
    }
    if (err != cudaSuccess) {
        if (g_trace)
            fprintf(stderr, "bt-emu: launch of %s <<<(%u,%u,%u), (%u,%u,%u), %zu>>> rejected: %s\n",
                    name, grid.x, grid.y, grid.z, block.x, block.y, block.z, smem,
                    cudaGetErrorString(err));
        g_last_error = err;
        return err;
    }
    init_fibers();
    init_dyn();
    const auto t0 = std::chrono::steady_clock::now();
    g_launch.name = name;
    g_launch.active = true;
    g_gdim = grid;
    g_bdim = block;
    g_body = body;
    g_body_ctx = ctx;
    const size_t rs = (smem + 127) & ~(size_t)127;
    g_dyn = g_dyn_guard - rs;
    g_dyn_size = smem;
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                g_bid.x = x;
                g_bid.y = y;
                g_bid.z = z;
                g_block_serial++;
                if (rs)
                    memset(g_dyn, 0xcd, rs); /* shared memory starts as garbage */
                run_block((int)nthr);
            }
    g_launch.active = false;
    g_dyn = nullptr;
    g_dyn_size = 0;
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    g_emu_seconds += sec;
    g_launches++;
    if (g_trace > 1 || (g_trace == 1 && sec > 0.5))
        fprintf(stderr, "bt-emu: %-40s <<<(%u,%u,%u), (%u,%u,%u), %zu>>> %.3f s\n", name, grid.x,
                grid.y, grid.z, block.x, block.y, block.z, smem, sec);
    return cudaSuccess;
}

} /* namespace bt_emu */

/* ================================================================== CUDA runtime API subset */
using namespace bt_emu;

struct CUstream_st {
    unsigned magic;
    std::atomic<int> holds; /* work of other threads still pending on this stream (NCCL) */
};
struct CUevent_st {
    double t;
};
static const unsigned STREAM_MAGIC = 0x57AEA3u;
static CUstream_st g_null_stream{STREAM_MAGIC, {0}}; /* the legacy default stream (0) */

/* Stream-ordered work that runs on another thread: tests/emu/nccl_emu.cpp's collectives on a
 * non-blocking communicator hold their stream (+1) from the call until they complete (-1). Until
 * then cudaStreamQuery says cudaErrorNotReady, and every later operation on the stream
 * (launches, async copies and sets, cuBLAS, synchronisation) first waits for it: CUDA's stream
 * order. Called from any thread. */
extern "C" void bt_emu_stream_hold(cudaStream_t s, int delta)
{
    (s ? s : &g_null_stream)->holds.fetch_add(delta, std::memory_order_acq_rel);
}

namespace bt_emu {
void stream_drain(cudaStream_t s)
{
    CUstream_st *st = s ? s : &g_null_stream;
    for (unsigned spins = 0; st->holds.load(std::memory_order_acquire) > 0; spins++) {
        if (spins < 1000) {
            sched_yield();
            continue;
        }
        const timespec ts = {0, 200000};
        nanosleep(&ts, nullptr);
    }
}
} // namespace bt_emu

static double now_ms()
{
    return std::chrono::duration<double, std::milli>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

extern "C" {

cudaError_t cudaMalloc(void **p, size_t size)
{
    if (!p)
        return g_last_error = cudaErrorInvalidValue;
    *p = nullptr;
    if (size == 0)
        return cudaSuccess;
    if (size > ((size_t)64 << 30))
        return g_last_error = cudaErrorMemoryAllocation;
    init_fibers(); /* page size */
    const size_t us = (size + 255) & ~(size_t)255;
    const size_t body = (us + g_page - 1) / g_page * g_page;
    void *m = mmap(nullptr, body + g_page, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED)
        return g_last_error = cudaErrorMemoryAllocation;
    unsigned char *map = (unsigned char *)m;
    mprotect(map + body, g_page, PROT_NONE); /* reading/writing past the end -> SIGSEGV */
    unsigned char *user = map + body - us;
    /* fresh device memory is garbage: 0x7fc0 is a bf16 NaN, 0x7fc07fc0 an fp32 NaN */
    for (size_t i = 0; i + 1 < us; i += 2) {
        user[i] = 0xc0;
        user[i + 1] = 0x7f;
    }
    g_allocs[(uintptr_t)user] = {map, body, size, user};
    g_alloc_bytes += us;
    *p = user;
    return cudaSuccess;
}
cudaError_t cudaFree(void *p)
{
    if (!p)
        return cudaSuccess;
    auto it = g_allocs.find((uintptr_t)p);
    if (it == g_allocs.end())
        return g_last_error = cudaErrorInvalidValue;
    munmap(it->second.map, it->second.maplen + g_page); /* use after free -> SIGSEGV */
    g_alloc_bytes -= (it->second.size + 255) & ~(size_t)255;
    g_allocs.erase(it);
    return cudaSuccess;
}
cudaError_t cudaMallocHost(void **p, size_t size)
{
    if (!p)
        return g_last_error = cudaErrorInvalidValue;
    *p = aligned_alloc(256, (size + 255) & ~(size_t)255);
    return *p || !size ? cudaSuccess : (g_last_error = cudaErrorMemoryAllocation);
}
cudaError_t cudaFreeHost(void *p)
{
    free(p);
    return cudaSuccess;
}
/* A valid stream (0 included) whose earlier work is done (stream_drain). */
static cudaError_t check_stream(cudaStream_t s)
{
    if (s && s->magic != STREAM_MAGIC)
        return g_last_error = cudaErrorInvalidResourceHandle;
    stream_drain(s);
    return cudaSuccess;
}
cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, enum cudaMemcpyKind)
{
    if (n && (!dst || !src))
        return g_last_error = cudaErrorInvalidValue;
    if (n)
        memmove(dst, src, n);
    return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, enum cudaMemcpyKind k,
                            cudaStream_t s)
{
    if (check_stream(s))
        return cudaErrorInvalidResourceHandle;
    return cudaMemcpy(dst, src, n, k);
}
cudaError_t cudaMemset(void *p, int v, size_t n)
{
    if (n && !p)
        return g_last_error = cudaErrorInvalidValue;
    if (n)
        memset(p, v, n);
    return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t s)
{
    if (check_stream(s))
        return cudaErrorInvalidResourceHandle;
    return cudaMemset(p, v, n);
}
cudaError_t cudaStreamCreate(cudaStream_t *s)
{
    *s = new CUstream_st{STREAM_MAGIC, {0}};
    return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned int) { return cudaStreamCreate(s); }
cudaError_t cudaStreamDestroy(cudaStream_t s)
{
    if (!s || check_stream(s))
        return g_last_error = cudaErrorInvalidResourceHandle;
    s->magic = 0;
    delete s;
    return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) { return check_stream(s); }
cudaError_t cudaStreamQuery(cudaStream_t s)
{
    if (s && s->magic != STREAM_MAGIC)
        return g_last_error = cudaErrorInvalidResourceHandle;
    return (s ? s : &g_null_stream)->holds.load(std::memory_order_acquire) > 0 ? cudaErrorNotReady
                                                                              : cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void) { return cudaSuccess; }
cudaError_t cudaGetLastError(void)
{
    cudaError_t e = g_last_error;
    g_last_error = cudaSuccess;
    return e;
}
cudaError_t cudaPeekAtLastError(void) { return g_last_error; }
const char *cudaGetErrorString(cudaError_t e)
{
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    default: return "unknown error (bt-emu)";
    }
}
const char *cudaGetErrorName(cudaError_t e) { return cudaGetErrorString(e); }
/* BT_EMU_NO_DEVICE=1: no device, as the CUDA runtime says it on a machine without a usable GPU
 * (how tests/py/test_gpu_scripts.py checks that "no device" fails under BT_GPU_REQUIRE=1). */
cudaError_t cudaGetDeviceCount(int *n)
{
    const char *none = getenv("BT_EMU_NO_DEVICE");
    if (none && atoi(none)) {
        *n = 0;
        return g_last_error = cudaErrorNoDevice;
    }
    *n = 1;
    return cudaSuccess;
}
cudaError_t cudaSetDevice(int d) { return d == 0 ? cudaSuccess : (g_last_error = cudaErrorInvalidDevice); }
cudaError_t cudaGetDevice(int *d)
{
    *d = 0;
    return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *p, int d)
{
    if (d != 0)
        return g_last_error = cudaErrorInvalidDevice;
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "CPU emulator");
    p->totalGlobalMem = (size_t)80 << 30;
    p->sharedMemPerBlock = DEFAULT_DYN_SMEM;
    p->sharedMemPerBlockOptin = optin_smem();
    p->sharedMemPerMultiprocessor = 228 * 1024;
    p->regsPerBlock = 65536;
    p->warpSize = 32;
    p->maxThreadsPerBlock = 1024;
    p->maxThreadsDim[0] = 1024;
    p->maxThreadsDim[1] = 1024;
    p->maxThreadsDim[2] = 64;
    p->maxGridSize[0] = 2147483647;
    p->maxGridSize[1] = 65535;
    p->maxGridSize[2] = 65535;
    p->major = 9;
    p->minor = 0;
    p->multiProcessorCount = 132;
    p->l2CacheSize = 50 * 1024 * 1024;
    p->maxThreadsPerMultiProcessor = 2048;
    return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int *v, enum cudaDeviceAttr attr, int d)
{
    if (d != 0)
        return g_last_error = cudaErrorInvalidDevice;
    switch (attr) {
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *v = (int)optin_smem(); break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *v = (int)DEFAULT_DYN_SMEM; break;
    case cudaDevAttrComputeCapabilityMajor: *v = 9; break;
    case cudaDevAttrComputeCapabilityMinor: *v = 0; break;
    case cudaDevAttrMultiProcessorCount: *v = 132; break;
    case cudaDevAttrWarpSize: *v = 32; break;
    default: return g_last_error = cudaErrorInvalidValue; /* not emulated */
    }
    return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t *fr, size_t *tot)
{
    const size_t total = (size_t)80 << 30;
    if (tot)
        *tot = total;
    if (fr)
        *fr = total - g_alloc_bytes;
    return cudaSuccess;
}
cudaError_t cudaFuncSetAttribute(const void *func, enum cudaFuncAttribute attr, int value)
{
    if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
        if (value < 0 || (size_t)value > optin_smem())
            return g_last_error = cudaErrorInvalidValue;
        g_func_max_dyn[func] = value;
    }
    return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t *e)
{
    *e = new CUevent_st{0};
    return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned int) { return cudaEventCreate(e); }
cudaError_t cudaEventDestroy(cudaEvent_t e)
{
    delete e;
    return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s)
{
    if (check_stream(s))
        return cudaErrorInvalidResourceHandle;
    e->t = now_ms();
    return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b)
{
    *ms = (float)(b->t - a->t);
    return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned int) { return cudaSuccess; }

} /* extern "C" */

/* ================================================================== cuBLAS subset */
struct cublasContext {
    cudaStream_t stream;
    cublasMath_t mode;
};

extern "C" {

cublasStatus_t cublasCreate_v2(cublasHandle_t *h)
{
    *h = new cublasContext{nullptr, CUBLAS_DEFAULT_MATH};
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy_v2(cublasHandle_t h)
{
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream_v2(cublasHandle_t h, cudaStream_t s)
{
    if (!h)
        return CUBLAS_STATUS_NOT_INITIALIZED;
    h->stream = s;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasGetStream_v2(cublasHandle_t h, cudaStream_t *s)
{
    if (!h)
        return CUBLAS_STATUS_NOT_INITIALIZED;
    *s = h->stream;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t m)
{
    if (!h)
        return CUBLAS_STATUS_NOT_INITIALIZED;
    h->mode = m;
    return CUBLAS_STATUS_SUCCESS;
}
const char *cublasGetStatusString(cublasStatus_t s)
{
    switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "CUBLAS_STATUS (bt-emu: other)";
    }
}

/* c[i] += a[i] * b, i < m: one step of m independent sums (each element's own order is kept;
 * vectorised across i, which -O2's cost model leaves scalar) */
__attribute__((optimize("O3"))) static void gemm_axpy(float *__restrict c, const float *__restrict a,
                                                      float b, int m)
{
    for (int i = 0; i < m; i++)
        c[i] += a[i] * b;
}

/* column-major: C(m x n) = alpha op(A)(m x k) op(B)(k x n) + beta C; fp32 accumulation in k order */
cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                            int n, int k, const void *alpha, const void *A, cudaDataType Atype,
                            int lda, const void *B, cudaDataType Btype, int ldb, const void *beta,
                            void *C, cudaDataType Ctype, int ldc, cublasComputeType_t ct,
                            cublasGemmAlgo_t)
{
    if (!h)
        return CUBLAS_STATUS_NOT_INITIALIZED;
    if (check_stream(h->stream))
        return CUBLAS_STATUS_INVALID_VALUE;
    const bool tA = ta != CUBLAS_OP_N, tB = tb != CUBLAS_OP_N;
    if ((ta != CUBLAS_OP_N && ta != CUBLAS_OP_T) || (tb != CUBLAS_OP_N && tb != CUBLAS_OP_T))
        return CUBLAS_STATUS_NOT_SUPPORTED;
    if (m < 0 || n < 0 || k < 0 || lda < (tA ? (k > 1 ? k : 1) : (m > 1 ? m : 1)) ||
        ldb < (tB ? (n > 1 ? n : 1) : (k > 1 ? k : 1)) || ldc < (m > 1 ? m : 1))
        return CUBLAS_STATUS_INVALID_VALUE;
    const bool a16 = Atype == CUDA_R_16BF, b16 = Btype == CUDA_R_16BF, c16 = Ctype == CUDA_R_16BF;
    if ((!a16 && Atype != CUDA_R_32F) || (!b16 && Btype != CUDA_R_32F) ||
        (!c16 && Ctype != CUDA_R_32F))
        return CUBLAS_STATUS_NOT_SUPPORTED;
    if (ct != CUBLAS_COMPUTE_32F && ct != CUBLAS_COMPUTE_32F_FAST_16BF &&
        ct != CUBLAS_COMPUTE_32F_PEDANTIC)
        return CUBLAS_STATUS_NOT_SUPPORTED;
    if (m == 0 || n == 0)
        return CUBLAS_STATUS_SUCCESS;
    const float al = *(const float *)alpha, be = *(const float *)beta;
    auto ld = [](const void *p, bool bf, int64_t i) -> float {
        return bf ? __bfloat162float(((const __nv_bfloat16 *)p)[i]) : ((const float *)p)[i];
    };
    /* op(A) stored k-major (column l of op(A) contiguous) and op(B) column by column. Each C(i, j)
     * is still ((0 + a_i0 b_0j) + a_i1 b_1j) + ... in k order, exactly as one dot product per
     * element; but a tile of TI rows of up to 4 columns advances together (an axpy per l over
     * sums held in L1: independent chains the CPU vectorises, instead of one latency-bound chain
     * per element), which is what makes the emulated vocabulary-sized GEMMs affordable. */
    std::vector<float> Ac((size_t)m * k), Bt((size_t)n * k);
    if (tA) /* A(i, l) at i * lda + l: read along l */
        for (int i = 0; i < m; i++)
            for (int l = 0; l < k; l++)
                Ac[(size_t)l * m + i] = ld(A, a16, (int64_t)i * lda + l);
    else
        for (int l = 0; l < k; l++)
            for (int i = 0; i < m; i++)
                Ac[(size_t)l * m + i] = ld(A, a16, (int64_t)l * lda + i);
    for (int j = 0; j < n; j++)
        for (int l = 0; l < k; l++)
            Bt[(size_t)j * k + l] = ld(B, b16, tB ? (int64_t)l * ldb + j : (int64_t)j * ldb + l);
    enum { TI = 256, TJ = 4 };
    float acc[TJ][TI];
    for (int i0 = 0; i0 < m; i0 += TI) {
        const int mi = m - i0 < TI ? m - i0 : TI;
        for (int j0 = 0; j0 < n; j0 += TJ) {
            const int nj = n - j0 < TJ ? n - j0 : TJ;
            for (int jj = 0; jj < nj; jj++)
                std::fill(acc[jj], acc[jj] + mi, 0.0f);
            for (int l = 0; l < k; l++)
                for (int jj = 0; jj < nj; jj++)
                    gemm_axpy(acc[jj], &Ac[(size_t)l * m + i0], Bt[(size_t)(j0 + jj) * k + l], mi);
            for (int jj = 0; jj < nj; jj++)
                for (int i = 0; i < mi; i++) {
                    const int64_t ci = (int64_t)(j0 + jj) * ldc + i0 + i;
                    float v = al * acc[jj][i];
                    if (be != 0.0f) /* beta == 0: C is not read (may hold NaN) */
                        v += be * ld(C, c16, ci);
                    if (c16)
                        ((__nv_bfloat16 *)C)[ci] = __float2bfloat16_rn(v);
                    else
                        ((float *)C)[ci] = v;
                }
        }
    }
    return CUBLAS_STATUS_SUCCESS;
}

} /* extern "C" */
