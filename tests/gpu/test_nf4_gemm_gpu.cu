/* GPU parity tests of the fused NF4 GEMMs (kernels/cuda/nf4_gemm.cu): bt_cuda_nf4_gemm_fwd,
 * bt_cuda_nf4_gemm_fwd_impl (tiled and small-M kernels forced) and bt_cuda_nf4_gemm_bwd_x.
 *
 * Reference: the weight is quantised by the CPU backend (bt_nf4_quantize, bitsandbytes layout),
 * dequantised on the CPU (bt_nf4_dequantize_rows) and rounded to bf16 -- exactly the bf16 values
 * the fused kernels must decode (bit-identical decode; test_nf4_gemm_decode_exact checks that
 * directly). Activations are bf16-rounded; the reference GEMM runs in fp32 (bt_sgemm).
 *
 * Tolerances (per element i, derived, not tuned):
 *   ref_i = sum_k x_k w_k (+ beta*y_i) in fp32;  abs_i = sum_k |x_k w_k| (+ |beta*y_i|)
 *   |gpu_i - ref_i| <= 2^-8 |ref_i| + 4 (R+2) 2^-24 abs_i        (R = reduction length)
 *   - 2^-8 |ref_i|: the final fp32 -> bf16 round-to-nearest (bf16 has 8 significant bits, unit
 *     roundoff u = 2^-8);
 *   - (R+2) 2^-24 abs_i = gamma_{R+2} bound of fp32 summation in ANY order (R products + the beta
 *     term), once for the GPU and once for the CPU reference, x2 margin for tensor-core fp32
 *     accumulation (which truncates aligned products, Fasi et al. 2021) -> factor 4.
 *   Also, for outputs of >= 256 elements, rel_l2 = ||gpu-ref|| / ||ref|| <= 4e-3 (bf16 rounding
 *   alone gives an rms relative error below 2^-8/sqrt(3) = 2.3e-3).
 *   Fused vs dequantise + cuBLAS (bt_cuda_nf4_linear_fwd/_bwd_x): both obey the bound above, so
 *   |fused_i - cublas_i| <= 2 * 2^-8 |ref_i| + 8 (R+2) 2^-24 abs_i (about one bf16 ulp) and
 *   rel_l2 <= 6e-3 (n >= 256).
 *   Decode exactness: one-hot activation rows make every output a single product 1*w (exact in
 *   fp32 and in bf16), so the output must equal bf16(CPU dequant) bit for bit.
 * Also checked: beta = 0 never reads the output (it is pre-filled with NaN); nothing is written past
 * M x Nout (a 256-element sentinel tail after the output); error codes.
 * BT_GPU_QUICK=1 (set by tests/gpu/run.sh under compute-sanitizer) runs a reduced shape grid.
 * Options: those of every GPU test binary (tests/gpu/gpu_test.h gt_init: --case SUBSTR, --after
 * NAME, --list, --probe-only). Without a CUDA device it prints "SKIPPED" and exits 77 (never an OK
 * line; FAIL and 1 under BT_GPU_REQUIRE=1). */
#include "tests/gpu/gpu_test.h"

#include <algorithm>

static cublasHandle_t g_cublas;
static cudaStream_t g_stream;
static bool g_quick = false;

static std::vector<int> sizes(std::initializer_list<int> full, std::initializer_list<int> quick)
{
    return g_quick ? std::vector<int>(quick) : std::vector<int>(full);
}

/* One (M, N, K) case of the forward (impls: auto, and for M <= 16 also tiled and small-M forced)
 * and the comparison with dequantise + cuBLAS, for beta 0 and 1. */
static void run_fwd_case(HostNF4 &w, int M, int K, int N, float xscale)
{
    auto X = randv((size_t)M * K, xscale);
    auto Y0 = randv((size_t)M * N, 1.0f);
    DBuf<bt_bf16> dX((size_t)M * K), wbuf((size_t)N * K);
    up_bf16(dX, X);
    OutBuf Y((size_t)M * N);
    for (float beta : {0.0f, 1.0f}) {
        RefOut r = make_ref(false, X, w.deq, M, K, N, beta, Y0);
        const int impls[3] = {0, 1, 2};
        const int nimpl = M <= 16 ? 3 : 1;
        std::vector<float> fused;
        for (int ii = 0; ii < nimpl; ii++) {
            Y.fill(beta != 0 ? &Y0 : nullptr);
            BTOK(bt_cuda_nf4_gemm_fwd_impl(g_stream, Y.b.p, dX.p, &w.d, M, K, N, beta, impls[ii]));
            CU(cudaStreamSynchronize(g_stream));
            auto got = Y.get();
            char name[96];
            snprintf(name, sizeof name, "fwd %s M=%d K=%d N=%d beta=%g",
                     impls[ii] == 0 ? "auto " : impls[ii] == 1 ? "tiled" : "smallM", M, K, N, beta);
            check_bound(name, got, r.ref, r.tol, N, 4e-3);
            if (!Y.tail_ok()) {
                printf("    %s: wrote past the %dx%d output  <-- FAIL\n", name, M, N);
                g_case_ok = false;
            }
            if (ii == 0)
                fused = got;
        }
        /* dequantise + cuBLAS path on the same inputs */
        Y.fill(beta != 0 ? &Y0 : nullptr);
        BTOK(bt_cuda_nf4_linear_fwd(g_cublas, g_stream, Y.b.p, dX.p, &w.d, M, K, N, beta, wbuf.p));
        CU(cudaStreamSynchronize(g_stream));
        auto cub = Y.get();
        /* check_bound(fused vs cublas): use cublas as "ref" with the doubled tolerance */
        char name[96];
        snprintf(name, sizeof name, "fwd fused-vs-cuBLAS M=%d K=%d N=%d beta=%g", M, K, N, beta);
        check_bound(name, fused, cub, r.tol2, N, 6e-3);
    }
}

static void run_bwd_case(HostNF4 &w, int M, int K, int N, float gscale)
{
    auto dY = randv((size_t)M * N, gscale);
    auto dX0 = randv((size_t)M * K, 1.0f);
    DBuf<bt_bf16> ddY((size_t)M * N), wbuf((size_t)N * K);
    up_bf16(ddY, dY);
    OutBuf dX((size_t)M * K);
    for (float beta : {0.0f, 1.0f}) {
        RefOut r = make_ref(true, dY, w.deq, M, K, N, beta, dX0);
        dX.fill(beta != 0 ? &dX0 : nullptr);
        BTOK(bt_cuda_nf4_gemm_bwd_x(g_stream, dX.b.p, ddY.p, &w.d, M, K, N, beta));
        CU(cudaStreamSynchronize(g_stream));
        auto fused = dX.get();
        char name[96];
        snprintf(name, sizeof name, "bwd_x M=%d K=%d N=%d beta=%g", M, K, N, beta);
        check_bound(name, fused, r.ref, r.tol, K, 4e-3);
        if (!dX.tail_ok()) {
            printf("    %s: wrote past the %dx%d output  <-- FAIL\n", name, M, K);
            g_case_ok = false;
        }
        dX.fill(beta != 0 ? &dX0 : nullptr);
        BTOK(bt_cuda_nf4_linear_bwd_x(g_cublas, g_stream, dX.b.p, ddY.p, &w.d, M, K, N, beta,
                                      wbuf.p, 0));
        CU(cudaStreamSynchronize(g_stream));
        auto cub = dX.get();
        snprintf(name, sizeof name, "bwd_x fused-vs-cuBLAS M=%d K=%d N=%d beta=%g", M, K, N, beta);
        check_bound(name, fused, cub, r.tol2, K, 6e-3);
    }
}

/* Forward over the shape grid M x N x K (weights N(0, 0.05^2), X uniform(-1, 1)). */
static void test_nf4_gemm_fwd(void)
{
    for (int K : sizes({64, 576, 1536}, {64, 576}))
        for (int N : sizes({1, 8, 100, 576, 1536}, {8, 100, 576})) {
            HostNF4 w(N, K, 0.05f);
            for (int M : sizes({1, 3, 17, 64, 130, 300}, {1, 17, 130}))
                run_fwd_case(w, M, K, N, 1.0f);
        }
}

/* bwd_x over the same grid (reduction over N; N % 64 != 0 and N % 8 != 0 exercise the partial
 * reduction step and element loads of dY). */
static void test_nf4_gemm_bwd_x(void)
{
    for (int K : sizes({64, 576, 1536}, {64, 576}))
        for (int N : sizes({1, 8, 100, 576, 1536}, {8, 100, 576})) {
            HostNF4 w(N, K, 0.05f);
            for (int M : sizes({1, 3, 17, 64, 130, 300}, {1, 17, 130}))
                run_bwd_case(w, M, K, N, 1.0f);
        }
}

/* Large magnitudes: weights N(0, 3000^2) (absmax ~ 1e4, offset large, so the nested decode's two
 * roundings matter), activations up to 8; outputs ~1e6 (bf16 range is fine). */
static void test_nf4_gemm_large(void)
{
    {
        HostNF4 w(576, 1536, 3000.0f);
        run_fwd_case(w, 130, 1536, 576, 8.0f);
        run_fwd_case(w, 5, 1536, 576, 8.0f);
        run_bwd_case(w, 130, 1536, 576, 8.0f);
    }
    {
        HostNF4 w(300, 320, 1e-3f); /* tiny weights, non-multiple-of-128 tiles in both dims */
        run_fwd_case(w, 77, 320, 300, 1.0f);
        run_bwd_case(w, 77, 320, 300, 1.0f);
    }
}

/* Decode exactness: one-hot activation rows pick single weights, so out == bf16(CPU dequant)
 * exactly. Forward: X row m = e_{k_m} -> Y[m, n] = Wd[n, k_m]; bwd_x: dY row m = e_{n_m} ->
 * dX[m, k] = Wd[n_m, k]. k_m / n_m cycle through every column / row (M = K or N, rounded up). */
static void test_nf4_gemm_decode_exact(void)
{
    const int N = 200, K = 640; /* 2000 64-blocks: 8 nested blocks, the last one partial */
    HostNF4 w(N, K, 0.7f);
    for (int impl : {1, 2}) {
        const int M = impl == 2 ? 16 : K;
        for (int rep = 0; rep < (impl == 2 ? K / 16 : 1); rep++) {
            std::vector<float> X((size_t)M * K, 0.0f), ref((size_t)M * N);
            for (int m = 0; m < M; m++) {
                const int km = (rep * 16 + m) % K;
                X[(size_t)m * K + km] = 1.0f;
                for (int n = 0; n < N; n++)
                    ref[(size_t)m * N + n] = w.deq[(size_t)n * K + km];
            }
            DBuf<bt_bf16> dX(X.size());
            up_bf16(dX, X);
            OutBuf Y((size_t)M * N);
            Y.fill(nullptr);
            BTOK(bt_cuda_nf4_gemm_fwd_impl(g_stream, Y.b.p, dX.p, &w.d, M, K, N, 0.0f, impl));
            CU(cudaStreamSynchronize(g_stream));
            auto got = Y.get();
            char name[96];
            snprintf(name, sizeof name, "fwd %s one-hot rows %d..%d", impl == 1 ? "tiled" : "smallM",
                     rep * 16, rep * 16 + M - 1);
            if (!check_exact(name, got.data(), ref.data(), ref.size()))
                break;
        }
    }
    {
        const int M = N;
        std::vector<float> dY((size_t)M * N, 0.0f);
        for (int m = 0; m < M; m++)
            dY[(size_t)m * N + m] = 1.0f;
        DBuf<bt_bf16> ddY(dY.size());
        up_bf16(ddY, dY);
        OutBuf dX((size_t)M * K);
        dX.fill(nullptr);
        BTOK(bt_cuda_nf4_gemm_bwd_x(g_stream, dX.b.p, ddY.p, &w.d, M, K, N, 0.0f));
        CU(cudaStreamSynchronize(g_stream));
        auto got = dX.get();
        check_exact("bwd_x one-hot rows (== Wd)", got.data(), w.deq.data(), w.deq.size());
    }
}

/* Return codes: BT_ERR_INVALID (-6) and BT_ERR_UNSUPPORTED (-5); nothing may be written. */
static void test_nf4_gemm_errors(void)
{
    const int M = 4, K = 128, N = 16;
    HostNF4 w(N, K, 0.1f);
    HostNF4 w96(16, 96, 0.1f); /* cols % 64 != 0 */
    DBuf<bt_bf16> a((size_t)M * 256 + 16), o((size_t)M * 256 + 16);
    CU(cudaMemset(o.p, 0, o.n * 2));
    bt_cuda_nf4 bad = w.d;
    bad.packed = nullptr;
    bt_cuda_nf4 unal = w.d;
    unal.packed = w.d.packed + 8;
    const CodeCase cs[] = {
        {"fwd Y NULL", bt_cuda_nf4_gemm_fwd(g_stream, nullptr, a.p, &w.d, M, K, N, 0.f), -6},
        {"fwd X NULL", bt_cuda_nf4_gemm_fwd(g_stream, o.p, nullptr, &w.d, M, K, N, 0.f), -6},
        {"fwd W NULL", bt_cuda_nf4_gemm_fwd(g_stream, o.p, a.p, nullptr, M, K, N, 0.f), -6},
        {"fwd W->packed NULL", bt_cuda_nf4_gemm_fwd(g_stream, o.p, a.p, &bad, M, K, N, 0.f), -6},
        {"fwd M=0", bt_cuda_nf4_gemm_fwd(g_stream, o.p, a.p, &w.d, 0, K, N, 0.f), -6},
        {"fwd M=-1", bt_cuda_nf4_gemm_fwd(g_stream, o.p, a.p, &w.d, -1, K, N, 0.f), -6},
        {"fwd N != W rows", bt_cuda_nf4_gemm_fwd(g_stream, o.p, a.p, &w.d, M, K, N + 1, 0.f), -6},
        {"fwd K != W cols", bt_cuda_nf4_gemm_fwd(g_stream, o.p, a.p, &w.d, M, K + 64, N, 0.f), -6},
        {"fwd K=0", bt_cuda_nf4_gemm_fwd(g_stream, o.p, a.p, &w.d, M, 0, N, 0.f), -6},
        {"fwd K%64 != 0", bt_cuda_nf4_gemm_fwd(g_stream, o.p, a.p, &w96.d, M, 96, 16, 0.f), -5},
        {"fwd X misaligned", bt_cuda_nf4_gemm_fwd(g_stream, o.p, a.p + 1, &w.d, M, K, N, 0.f), -5},
        {"fwd Y misaligned", bt_cuda_nf4_gemm_fwd(g_stream, o.p + 4, a.p, &w.d, M, K, N, 0.f), -5},
        {"fwd packed misaligned", bt_cuda_nf4_gemm_fwd(g_stream, o.p, a.p, &unal, M, K, N, 0.f), -5},
        {"fwd impl=3", bt_cuda_nf4_gemm_fwd_impl(g_stream, o.p, a.p, &w.d, M, K, N, 0.f, 3), -6},
        {"fwd impl=2 M=17", bt_cuda_nf4_gemm_fwd_impl(g_stream, o.p, a.p, &w.d, 17, K, N, 0.f, 2), -5},
        {"bwd dX NULL", bt_cuda_nf4_gemm_bwd_x(g_stream, nullptr, a.p, &w.d, M, K, N, 0.f), -6},
        {"bwd dY NULL", bt_cuda_nf4_gemm_bwd_x(g_stream, o.p, nullptr, &w.d, M, K, N, 0.f), -6},
        {"bwd W NULL", bt_cuda_nf4_gemm_bwd_x(g_stream, o.p, a.p, nullptr, M, K, N, 0.f), -6},
        {"bwd N=0", bt_cuda_nf4_gemm_bwd_x(g_stream, o.p, a.p, &w.d, M, K, 0, 0.f), -6},
        {"bwd N != W rows", bt_cuda_nf4_gemm_bwd_x(g_stream, o.p, a.p, &w.d, M, K, N - 1, 0.f), -6},
        {"bwd K%64 != 0", bt_cuda_nf4_gemm_bwd_x(g_stream, o.p, a.p, &w96.d, M, 96, 16, 0.f), -5},
        {"bwd dY misaligned", bt_cuda_nf4_gemm_bwd_x(g_stream, o.p, a.p + 2, &w.d, M, K, N, 0.f), -5},
    };
    check_codes(cs, sizeof cs / sizeof cs[0]);
    CU(cudaStreamSynchronize(g_stream));
    check_untouched(o.p, o.n);
}

int main(int argc, char **argv)
{
    const char *prog = "test_nf4_gemm_gpu";
    const int init = gt_init(prog, argc, argv);
    if (init >= 0)
        return init;
    g_quick = getenv("BT_GPU_QUICK") && atoi(getenv("BT_GPU_QUICK"));
    if (g_quick)
        printf("%s: BT_GPU_QUICK set: reduced shape grid\n", prog);
    CU(cudaStreamCreate(&g_stream));
    if (cublasCreate(&g_cublas) != CUBLAS_STATUS_SUCCESS) {
        printf("%s: cublasCreate failed\n", prog);
        return 2;
    }
    GT_CASE(test_nf4_gemm_errors);
    GT_CASE(test_nf4_gemm_decode_exact);
    GT_CASE(test_nf4_gemm_fwd);
    GT_CASE(test_nf4_gemm_bwd_x);
    GT_CASE(test_nf4_gemm_large);
    const int rc = gt_run(prog);
    cublasDestroy(g_cublas);
    cudaStreamDestroy(g_stream);
    return rc;
}
