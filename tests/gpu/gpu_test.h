/* Shared helpers of the GPU parity tests (tests/gpu/test_*.cu): device buffers, bf16 rounding,
 * deterministic random inputs, tolerance checks, and the cases run as cmocka tests (gt_run).
 * Every test compares a CUDA launcher against the CPU fp32 reference (kernels/kernels.h) run on the
 * SAME bf16-rounded inputs, so the measured error is the CUDA kernel's own (bf16 storage of
 * intermediates, fp32 accumulation order), not input quantisation. */
#ifndef BT_TESTS_GPU_TEST_H
#define BT_TESTS_GPU_TEST_H
#include <cmath>
#include <csetjmp>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

extern "C" {
#include <cmocka.h>

#include "common/bt_common.h"
#include "kernels/kernels.h"
}
#include "kernels/cuda/kernels_cuda.h"
#include "tests/gpu/gpu_probe.h"

#define GT_SKIP_STATUS 77

static int g_fail = 0, g_skip = 0; /* cases failed / skipped (gt_run) */
static bool g_case_skip = false; /* the current test skipped itself (gt_skip) */
static bool g_case_ok = true; /* the current test's checks so far */

#define CU(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            exit(2);                                                                               \
        }                                                                                          \
    } while (0)
/* a launcher's return code must be 0 */
#define BTOK(call)                                                                     \
    do {                                                                               \
        int r_ = (call);                                                               \
        if (r_ != 0) {                                                                 \
            printf("    launcher failed: %s returned %d: %s (%s:%d)\n", #call, r_,        \
                   bt_last_error(), __FILE__, __LINE__);                               \
            g_case_ok = false;                                                         \
        }                                                                              \
    } while (0)

/* ---- random numbers (splitmix64; deterministic) ---- */
static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static inline uint64_t rng_u64(void)
{
    uint64_t z = (g_rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static inline float rng_uniform(void) { return (float)((rng_u64() >> 40) * (1.0 / 16777216.0)); }
static inline float rng_sym(float a) { return (2.0f * rng_uniform() - 1.0f) * a; }
static inline float rng_normal(void)
{
    float u1 = rng_uniform(), u2 = rng_uniform();
    if (u1 < 1e-7f)
        u1 = 1e-7f;
    return sqrtf(-2.0f * logf(u1)) * cosf(6.2831853f * u2);
}
static inline int rng_int(int n) { return (int)(rng_u64() % (uint64_t)n); }

/* ---- bf16 ---- */
static inline float bf16_round(float x) { return __bfloat162float(__float2bfloat16(x)); }
static std::vector<float> randv(size_t n, float a)
{
    std::vector<float> v(n);
    for (auto &x : v)
        x = bf16_round(rng_sym(a));
    return v;
}
static std::vector<float> randn_v(size_t n, float sd)
{
    std::vector<float> v(n);
    for (auto &x : v)
        x = bf16_round(rng_normal() * sd);
    return v;
}

/* ---- device buffers ---- */
template <typename T>
struct DBuf {
    T *p = nullptr;
    size_t n = 0;
    explicit DBuf(size_t n_ = 0) { alloc(n_); }
    void alloc(size_t n_)
    {
        n = n_;
        if (n)
            CU(cudaMalloc(&p, n * sizeof(T)));
    }
    ~DBuf()
    {
        if (p)
            cudaFree(p);
    }
    DBuf(const DBuf &) = delete;
    DBuf &operator=(const DBuf &) = delete;
};
static void up_bf16(DBuf<bt_bf16> &d, const std::vector<float> &h)
{
    std::vector<bt_bf16> t(h.size());
    for (size_t i = 0; i < h.size(); i++)
        t[i] = __float2bfloat16(h[i]);
    CU(cudaMemcpy(d.p, t.data(), t.size() * sizeof(bt_bf16), cudaMemcpyHostToDevice));
}
static std::vector<float> down_bf16(const bt_bf16 *p, size_t n)
{
    std::vector<bt_bf16> t(n);
    CU(cudaMemcpy(t.data(), p, n * sizeof(bt_bf16), cudaMemcpyDeviceToHost));
    std::vector<float> h(n);
    for (size_t i = 0; i < n; i++)
        h[i] = __bfloat162float(t[i]);
    return h;
}
template <typename T>
static void up(DBuf<T> &d, const std::vector<T> &h)
{
    CU(cudaMemcpy(d.p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
}
template <typename T>
static std::vector<T> down(const T *p, size_t n)
{
    std::vector<T> h(n);
    CU(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
}

/* ---- checks ----
 * check(): relative L2 error ||g-r|| / ||r|| <= rel_l2 AND max |g-r| <= max_rel * max|r| (+ tiny
 * absolute floor). Non-finite values in g where r is finite always fail. Prints one line. */
static bool check(const char *what, const float *g, const float *r, size_t n, double rel_l2,
                  double max_rel)
{
    double num = 0, den = 0, maxerr = 0, maxref = 0;
    size_t worst = 0;
    bool finite_ok = true;
    for (size_t i = 0; i < n; i++) {
        if (std::isfinite(r[i]) && !std::isfinite(g[i]))
            finite_ok = false;
        double e = fabs((double)g[i] - (double)r[i]);
        num += e * e;
        den += (double)r[i] * r[i];
        if (e > maxerr) {
            maxerr = e;
            worst = i;
        }
        maxref = fmax(maxref, fabs((double)r[i]));
    }
    const double rl2 = den > 0 ? sqrt(num / den) : sqrt(num);
    const double lim = max_rel * maxref + 1e-30;
    const bool ok = finite_ok && rl2 <= rel_l2 && maxerr <= lim;
    printf("    %-28s n=%-8zu rel_l2=%.2e (tol %.1e) max_err=%.3e (tol %.3e, at %zu: gpu %g ref %g)%s\n",
           what, n, rl2, rel_l2, maxerr, lim, worst, n ? (double)g[worst] : 0.0,
           n ? (double)r[worst] : 0.0, ok ? "" : "  <-- FAIL");
    if (!ok)
        g_case_ok = false;
    return ok;
}
/* check() for quantities that may be exactly zero in exact arithmetic (e.g. dq and dk of
 * one-token documents, where P = 1 and dS = 0): when every |g - r| <= abs_floor the check passes
 * whatever the relative error of pure rounding noise; otherwise check() decides. */
static bool check_floor(const char *what, const float *g, const float *r, size_t n, double rel_l2,
                        double max_rel, double abs_floor)
{
    double maxerr = 0;
    bool finite_ok = true;
    for (size_t i = 0; i < n; i++) {
        if (!std::isfinite(g[i]))
            finite_ok = false;
        maxerr = fmax(maxerr, fabs((double)g[i] - (double)r[i]));
    }
    if (finite_ok && maxerr <= abs_floor) {
        printf("    %-28s n=%-8zu max_err=%.3e <= absolute floor %.1e\n", what, n, maxerr, abs_floor);
        return true;
    }
    return check(what, g, r, n, rel_l2, max_rel);
}

static bool check_exact(const char *what, const float *g, const float *r, size_t n)
{
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < n; i++)
        if (memcmp(&g[i], &r[i], sizeof(float)) != 0 && !(g[i] == r[i])) {
            if (!bad)
                first = i;
            bad++;
        }
    printf("    %-28s n=%-8zu bit-exact mismatches=%zu%s", what, n, bad, bad ? "" : "\n");
    if (bad) {
        printf(" (first at %zu: gpu %.9g ref %.9g)  <-- FAIL\n", first, (double)g[first],
               (double)r[first]);
        g_case_ok = false;
    }
    return bad == 0;
}
static bool check_true(const char *what, bool cond)
{
    printf("    %-28s %s\n", what, cond ? "ok" : "<-- FAIL");
    if (!cond)
        g_case_ok = false;
    return cond;
}

/* Launcher return codes: each case prints "what -> want (got N)  ok|<-- FAIL". */
struct CodeCase {
    const char *what;
    int got, want;
};
static inline void check_codes(const CodeCase *cs, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        char name[128];
        snprintf(name, sizeof name, "%s -> %d (got %d)", cs[i].what, cs[i].want, cs[i].got);
        check_true(name, cs[i].got == cs[i].want);
    }
}
/* After refused calls: the n bf16 words at p (device, zero-filled before) are still all zero. */
static inline void check_untouched(const bt_bf16 *p, size_t n)
{
    std::vector<uint16_t> h(n);
    CU(cudaMemcpy(h.data(), p, n * sizeof(uint16_t), cudaMemcpyDeviceToHost));
    bool untouched = true;
    for (auto v : h)
        untouched = untouched && v == 0;
    check_true("rejected calls wrote nothing", untouched);
}

/* The current case cannot run here (no model, quick mode): prints "    SKIP: why"; the case then
 * ends as skipped ("[  SKIPPED ] name"), not passed (unless a check already failed). */
static void gt_skip(const char *why)
{
    printf("    SKIP: %s\n", why);
    g_case_skip = true;
}

/* ---- case selection (gt_init parses the command line every GPU test binary shares) ----
 * A case is a named unit of a binary: one GT_CASE function, or one attention case
 * ("attn/<case>", whose cmocka tests are "attn/<case>/<impl>"). gt_case_selected(name) says whether
 * it runs: --case SUBSTR keeps the cases whose name contains SUBSTR; --after NAME skips every case
 * up to and including the one named NAME or holding the sub-test NAME (tests/gpu/run.sh restarts
 * a binary so after a case crashed it); --list prints the names instead of running them. */
static const char *g_case_substr = nullptr; /* --case */
static const char *g_after = nullptr;       /* --after; cleared once passed */
static bool g_list = false;                 /* --list */

static bool gt_case_selected(const char *name)
{
    if (g_list) {
        printf("%s\n", name);
        return false;
    }
    if (g_after) {
        const size_t n = strlen(name);
        const bool hit = !strcmp(g_after, name) || (!strncmp(g_after, name, n) && g_after[n] == '/');
        if (hit)
            g_after = nullptr; /* the cases after this one run */
        printf("  case %s: skipped (--after %s)\n", name, hit ? "this case" : "a later case");
        return false;
    }
    return !g_case_substr || strstr(name, g_case_substr);
}

/* ---- the cases run as cmocka tests (the framework of tests/unit, from C++) ----
 * A binary registers its cases in order (GT_CASE(fn), or gt_add_case for a case with a computed
 * name or shared state, e.g. attention's "attn/<case>/<impl>"), then main returns gt_run(prog),
 * which hands them to cmocka's runner: "[ RUN      ] name", then "[       OK ] name", "[  FAILED  ]
 * name" or "[  SKIPPED ] name" for each, cmocka's closing lines, and this harness's summary line
 * "<prog>: N passed, M failed, K skipped" (tests/gpu/run.sh and tests/emu/run.sh read it). A case's
 * checks (check*, BTOK, check_codes, ...) print one line each and go on after a miss, so one run
 * shows every error; the case fails at its end (after its buffers are freed, cudaDeviceSynchronize
 * included), with cmocka's fail_msg. */
struct GtCase {
    std::string name;
    std::function<void()> fn;
};
static std::vector<GtCase> g_cases;

/* Adds a case with no selection of its own (the caller applied gt_case_selected to the name that
 * holds it). */
static void gt_add_case(const std::string &name, std::function<void()> fn)
{
    g_cases.push_back({name, std::move(fn)});
}
/* Adds the case `name` when it is selected (gt_case_selected: --case, --after, --list). */
static void gt_add(const char *name, std::function<void()> fn)
{
    if (gt_case_selected(name))
        gt_add_case(name, std::move(fn));
}
#define GT_CASE(fn) gt_add(#fn, fn)

static void gt_cmocka_case(void **state)
{
    const GtCase *c = static_cast<const GtCase *>(*state);
    g_case_ok = true;
    g_case_skip = false;
    c->fn();
    const cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) {
        printf("    CUDA error: %s\n", cudaGetErrorString(e));
        g_case_ok = false;
    }
    fflush(stdout);
    if (!g_case_ok)
        fail_msg("%s: a check failed (the lines above)", c->name.c_str());
    if (g_case_skip) {
        g_skip++;
        skip();
    }
}

/* BT_GPU_REQUIRE=1 (scripts/gpu-run sets it on the lent GPU machine): a missing or unusable device
 * is a failure, not a skip, so that a broken device set-up never reads as a pass. */
static bool gt_require_env(void)
{
    const char *r = getenv("BT_GPU_REQUIRE");
    return r && atoi(r) != 0;
}

/* Returns true if a device is usable; otherwise prints the skip line (never a pass line), or under
 * BT_GPU_REQUIRE=1 a FAIL line. */
static bool gt_require_device(const char *prog)
{
    if (bt_cuda_device_count() <= 0) {
        const char *reason = bt_last_error();
        if (gt_require_env())
            printf("%s: FAIL: no CUDA device (%s) and BT_GPU_REQUIRE=1\n", prog, reason);
        else
            printf("%s: SKIPPED: no CUDA device (%s)\n", prog, reason);
        return false;
    }
    cudaDeviceProp prop;
    CU(cudaGetDeviceProperties(&prop, 0));
    printf("%s: device 0: %s (sm_%d%d, %d SMs)\n", prog, prop.name, prop.major, prop.minor,
           prop.multiProcessorCount);
    return true;
}

/* The command line of every GPU test binary; call first in main:
 *   --case SUBSTR  --after NAME  --list   case selection (gt_case_selected)
 *   --probe-only   device check + the one-kernel probe (tests/gpu/gpu_probe.h), no cases
 * `own` lists the binary's own options that take a value (e.g. {"--impl", nullptr}); gt_init
 * skips them for the caller to parse. Also line-buffers stdout (output reaches a pipe or a log as
 * each line is written, so a timeout or a crash leaves everything printed so far).
 * Returns -1: run the cases; otherwise the exit status main must return: 0 (listed, probed),
 * 77 (no device; 1 under BT_GPU_REQUIRE=1), 1 (probe failed), 2 (bad command line). */
static int gt_init(const char *prog, int argc, char **argv, const char *const *own = nullptr)
{
    setvbuf(stdout, nullptr, _IOLBF, 0);
    bool probe = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool mine = false;
        for (const char *const *o = own; o && *o; o++)
            mine = mine || !strcmp(a, *o);
        if (mine && i + 1 < argc) {
            i++;
        } else if (!strcmp(a, "--case") && i + 1 < argc) {
            g_case_substr = argv[++i];
        } else if (!strcmp(a, "--after") && i + 1 < argc) {
            g_after = argv[++i];
        } else if (!strcmp(a, "--list")) {
            g_list = true;
        } else if (!strcmp(a, "--probe-only")) {
            probe = true;
        } else {
            fprintf(stderr, "%s: unknown option '%s' (--case SUBSTR, --after NAME, --list, --probe-only%s)\n",
                    prog, a, own ? ", or the binary's own" : "");
            return 2;
        }
    }
    if (g_list)
        return -1; /* the cases print their names; no device needed */
    if (!gt_require_device(prog))
        return gt_require_env() ? 1 : GT_SKIP_STATUS;
    if (probe)
        return bt_gpu_probe_kernel() ? 0 : 1;
    return -1;
}
/* Runs the registered cases (nothing with --list); returns main's exit status: 0 every case passed
 * or skipped, 1 one failed (a failed check, a CUDA error, or a signal cmocka caught in it), 2 --after
 * named no case of this binary. */
static int gt_run(const char *prog)
{
    if (g_list)
        return 0;
    if (g_after) {
        printf("%s: --after %s: no such case (--list prints them)\n", prog, g_after);
        return 2;
    }
    std::vector<CMUnitTest> tests;
    for (GtCase &c : g_cases)
        tests.push_back({c.name.c_str(), gt_cmocka_case, nullptr, nullptr, &c});
    g_fail = g_skip = 0;
    if (!tests.empty()) {
        fflush(stdout);
        g_fail = _cmocka_run_group_tests(prog, tests.data(), tests.size(), nullptr, nullptr);
    }
    printf("%s: %d passed, %d failed, %d skipped\n", prog,
           (int)tests.size() - g_fail - g_skip, g_fail, g_skip);
    return g_fail ? 1 : 0;
}

/* CPU row-major reference GEMM helpers (fp32) */
static void ref_gemm(int tA, int tB, int M, int N, int K, float alpha, const float *A, int lda,
                     const float *B, int ldb, float beta, float *C, int ldc)
{
    bt_sgemm(tA, tB, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

/* A random NF4 weight [rows, cols] (N(0, scale^2) before quantisation): the CPU quantisation q
 * (bitsandbytes layout, kernels/kernels.h), its device copy d, and deq, the bf16-rounded CPU
 * dequantisation (the exact values the device dequantisers must produce). Exits on failure. */
struct HostNF4 {
    bt_nf4 q;
    bt_cuda_nf4 d;
    std::vector<float> deq; /* bf16-rounded CPU dequantisation [rows, cols] */
    HostNF4(int64_t rows, int64_t cols, float scale)
    {
        std::vector<float> W(rows * cols);
        for (auto &x : W)
            x = rng_normal() * scale;
        if (bt_nf4_quantize(&q, W.data(), rows, cols) != 0) {
            printf("    bt_nf4_quantize failed\n");
            exit(2);
        }
        float code8[256];
        for (int i = 0; i < 256; i++)
            code8[i] = bt_dynamic_code8(i);
        if (bt_cuda_nf4_upload(&d, rows, cols, q.packed, q.absmax_q, q.nested_absmax, q.offset,
                               code8) != 0) {
            printf("    bt_cuda_nf4_upload failed\n");
            exit(2);
        }
        deq.resize(rows * cols);
        bt_nf4_dequantize_rows(&q, 0, rows, deq.data());
        for (auto &x : deq)
            x = bf16_round(x);
    }
    ~HostNF4()
    {
        bt_nf4_free(&q);
        bt_cuda_nf4_free(&d);
    }
};

/* ---- quantised GEMM checks (test_nf4_gemm_gpu.cu, test_ggml_gpu.cu): an output buffer with a
 * sentinel tail, the per-element bound of a bf16 GEMM against the fp32 reference, and the
 * reference itself. The tolerance is derived in test_nf4_gemm_gpu.cu's file comment:
 *   |gpu_i - ref_i| <= 2^-8 |ref_i| + 4 (R+2) 2^-24 abs_i (tol; tol2 = twice that, for two GPU
 *   paths against each other), abs_i = sum_k |x_k w_k| (+ |beta y_i|), R the reduction length. */
static const uint16_t SENTINEL = 0x7fbf; /* a bf16 NaN bit pattern no kernel produces */
static const size_t TAIL = 256;


/* Output buffer with a sentinel tail: n elements + TAIL. */
struct OutBuf {
    DBuf<bt_bf16> b;
    size_t n;
    explicit OutBuf(size_t n_) : b(n_ + TAIL), n(n_) {}
    /* main part: init (beta != 0) or NaN (beta == 0); tail: SENTINEL */
    void fill(const std::vector<float> *init)
    {
        std::vector<uint16_t> h(n + TAIL, SENTINEL);
        if (init)
            for (size_t i = 0; i < n; i++) {
                bt_bf16 v = __float2bfloat16((*init)[i]);
                memcpy(&h[i], &v, 2);
            }
        else
            for (size_t i = 0; i < n; i++)
                h[i] = 0xffff; /* NaN: must never be read when beta == 0 */
        CU(cudaMemcpy(b.p, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
    }
    std::vector<float> get() const { return down_bf16(b.p, n); }
    bool tail_ok() const
    {
        std::vector<uint16_t> h(TAIL);
        CU(cudaMemcpy(h.data(), b.p + n, TAIL * 2, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < TAIL; i++)
            if (h[i] != SENTINEL)
                return false;
        return true;
    }
};

/* Element-wise bound check: |g-r| <= tol[i] for every i, and rel_l2 <= rl2_tol. Prints one line:
 * n, max abs err, max rel err (over |ref| > 1e-6 max|ref|), the element with the largest err/tol
 * (row, col, gpu, ref, tol), the violation count, rel_l2. Non-finite g always violates. */
static inline bool check_bound(const char *what, const std::vector<float> &g, const std::vector<float> &r,
                        const std::vector<float> &tol, int ncols, double rl2_tol)
{
    const size_t n = r.size();
    double num = 0, den = 0, maxabs = 0, maxrel = 0, worst_ratio = -1, maxref = 0;
    size_t worst = 0, bad = 0;
    for (size_t i = 0; i < n; i++)
        maxref = std::max(maxref, (double)fabsf(r[i]));
    for (size_t i = 0; i < n; i++) {
        const double e = fabs((double)g[i] - (double)r[i]);
        const bool ok = std::isfinite(g[i]) && e <= (double)tol[i];
        if (!ok)
            bad++;
        const double ratio = std::isfinite(e) ? e / ((double)tol[i] + 1e-37) : 1e30;
        if (ratio > worst_ratio) {
            worst_ratio = ratio;
            worst = i;
        }
        if (std::isfinite(e)) {
            num += e * e;
            maxabs = std::max(maxabs, e);
            if (fabs(r[i]) > 1e-6 * maxref)
                maxrel = std::max(maxrel, e / fabs((double)r[i]));
        } else {
            num = INFINITY;
        }
        den += (double)r[i] * r[i];
    }
    const double rl2 = den > 0 ? sqrt(num / den) : sqrt(num);
    /* rel_l2 is a statistical criterion: only for n >= 256 (with a handful of outputs a single
     * cancelling sum can make it exceed the bf16 rounding level legitimately; the per-element
     * bound above is rigorous for every n) */
    const bool ok = bad == 0 && (n < 256 || rl2 <= rl2_tol);
    printf("    %-44s n=%-7zu max_abs=%.3e max_rel=%.2e rel_l2=%.2e (tol %.0e) worst err/tol=%.2f "
           "at [%zu,%zu] gpu %.6g ref %.6g tol %.3g; violations %zu%s\n",
           what, n, maxabs, maxrel, rl2, rl2_tol, worst_ratio, worst / (size_t)ncols,
           worst % (size_t)ncols, n ? (double)g[worst] : 0.0, n ? (double)r[worst] : 0.0,
           n ? (double)tol[worst] : 0.0, bad, ok ? "" : "  <-- FAIL");
    if (!ok)
        g_case_ok = false;
    return ok;
}

/* ref = op (+ beta*init) and per-element tolerances (see the file comment).
 * fwd: A = X [M,K], ref [M,N] = X Wd^T; bwd: A = dY [M,N], ref [M,K] = dY Wd. */
struct RefOut {
    std::vector<float> ref, tol, tol2;
};
static inline RefOut make_ref(bool bwd, const std::vector<float> &A, const std::vector<float> &Wd, int M,
                       int K, int N, float beta, const std::vector<float> &init)
{
    const int Nout = bwd ? K : N, R = bwd ? N : K;
    RefOut o;
    o.ref = init;
    std::vector<float> absA(A.size()), absW(Wd.size()), absv((size_t)M * Nout);
    for (size_t i = 0; i < A.size(); i++)
        absA[i] = fabsf(A[i]);
    for (size_t i = 0; i < Wd.size(); i++)
        absW[i] = fabsf(Wd[i]);
    for (size_t i = 0; i < absv.size(); i++)
        absv[i] = fabsf(beta * init[i]);
    if (bwd) {
        ref_gemm(0, 0, M, K, N, 1.0f, A.data(), N, Wd.data(), K, beta, o.ref.data(), K);
        ref_gemm(0, 0, M, K, N, 1.0f, absA.data(), N, absW.data(), K, 1.0f, absv.data(), K);
    } else {
        ref_gemm(0, 1, M, N, K, 1.0f, A.data(), K, Wd.data(), K, beta, o.ref.data(), N);
        ref_gemm(0, 1, M, N, K, 1.0f, absA.data(), K, absW.data(), K, 1.0f, absv.data(), N);
    }
    const double u = 1.0 / 256.0, g = (R + 2) * ldexp(1.0, -24);
    o.tol.resize(o.ref.size());
    o.tol2.resize(o.ref.size());
    for (size_t i = 0; i < o.ref.size(); i++) {
        o.tol[i] = (float)(u * fabs(o.ref[i]) + 4.0 * g * absv[i]) * 1.0001f + 1e-30f;
        o.tol2[i] = (float)(2.0 * u * fabs(o.ref[i]) + 8.0 * g * absv[i]) * 1.0001f + 1e-30f;
    }
    return o;
}

#endif
