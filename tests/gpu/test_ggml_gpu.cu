/* GPU parity tests of the GGUF-native base kernels (kernels/cuda/ggml.cu, ggml_decode.h and the
 * ggml sources of the fused GEMMs in nf4_gemm.cu), per type with a device decoder: Q4_0, Q4_1,
 * Q5_0, Q5_1 (Gemma 3 270M Q4_K_M's 640-wide rows), Q8_0, Q4_K, Q5_K, Q6_K.
 *
 * Reference: a random weight is encoded by the CPU library (common/quant.h bt_ggml_quantize),
 * dequantised by the CPU library (bt_ggml_dequantize, bit-identical to gguf-py) and rounded to
 * bf16 -- exactly the values the device decoders must produce:
 *   - bt_cuda_ggml_dequant (every row, and a row range): bit-exact;
 *   - fused forward with one-hot activation rows, fused bwd_x with one-hot dY rows: every output
 *     is a single product 1 * w, so bit-exact too (the tile decode of both GEMM directions);
 *   - fused GEMMs and dequantise + cuBLAS with random activations, beta 0 and 1: the per-element
 *     bound of test_nf4_gemm_gpu.cu (gpu_test.h check_bound: bf16 output rounding + fp32
 *     summation in any order), the two GPU paths against each other with the doubled bound; beta
 *     0 never reads the output (pre-filled with NaN), nothing is written past the output;
 *   - error codes (unsupported types, shapes, alignment; nothing written).
 * Shapes: reductions that are not multiples of the 64-wide tile step (K = 96 for the 32-element
 * types), outputs that are not multiples of 128 or 8. BT_GPU_QUICK / BT_GPU_EMU: a reduced grid.
 * Options: those of every GPU test binary (tests/gpu/gpu_test.h gt_init: --case SUBSTR, --after
 * NAME, --list, --probe-only). Without a CUDA device it prints "SKIPPED" and exits 77 (FAIL and 1
 * under BT_GPU_REQUIRE=1). */
#include "tests/gpu/gpu_test.h"

extern "C" {
#include "common/gguf.h"
#include "common/quant.h"
}

static cublasHandle_t g_cublas;
static cudaStream_t g_stream;
static bool g_quick = false;

static const int k_types[] = {BT_GGML_Q4_0, BT_GGML_Q4_1, BT_GGML_Q5_0, BT_GGML_Q5_1,
                              BT_GGML_Q8_0, BT_GGML_Q4_K, BT_GGML_Q5_K, BT_GGML_Q6_K};

/* A random ggml weight [rows, cols] (N(0, scale^2) before encoding): its blocks, device copy and
 * the bf16-rounded CPU dequantisation. */
struct HostGgml {
    int type;
    std::vector<uint8_t> blocks;
    bt_cuda_ggml d;
    std::vector<float> deq;
    HostGgml(int type_, int64_t rows, int64_t cols, float scale) : type(type_)
    {
        std::vector<float> W(rows * cols);
        for (auto &x : W)
            x = rng_normal() * scale;
        blocks.resize(bt_ggml_row_size(type, cols) * rows);
        deq.resize(rows * cols);
        if (bt_ggml_quantize(type, W.data(), blocks.data(), rows * cols) != 0 ||
            bt_ggml_dequantize(type, blocks.data(), deq.data(), rows * cols) != 0) {
            printf("    CPU encode/decode of %s failed\n", bt_ggml_type_name(type));
            exit(2);
        }
        for (auto &x : deq)
            x = bf16_round(x);
        if (bt_cuda_ggml_upload(&d, type, rows, cols, blocks.data()) != 0) {
            printf("    bt_cuda_ggml_upload failed\n");
            exit(2);
        }
    }
    ~HostGgml() { bt_cuda_ggml_free(&d); }
};

static const char *tn(int type) { return bt_ggml_type_name(type); }

/* dequantisation kernel, all rows and rows [3, 3 + 5) */
static void test_ggml_dequant_exact(void)
{
    for (int type : k_types) {
        const int rows = 37, cols = 512;
        HostGgml w(type, rows, cols, 0.7f);
        DBuf<bt_bf16> out((size_t)rows * cols);
        BTOK(bt_cuda_ggml_dequant(out.p, &w.d, 0, rows, g_stream));
        CU(cudaStreamSynchronize(g_stream));
        auto got = down_bf16(out.p, (size_t)rows * cols);
        char name[64];
        snprintf(name, sizeof name, "%s dequant all rows", tn(type));
        check_exact(name, got.data(), w.deq.data(), got.size());
        BTOK(bt_cuda_ggml_dequant(out.p, &w.d, 3, 5, g_stream));
        CU(cudaStreamSynchronize(g_stream));
        got = down_bf16(out.p, (size_t)5 * cols);
        snprintf(name, sizeof name, "%s dequant rows 3..7", tn(type));
        check_exact(name, got.data(), w.deq.data() + (size_t)3 * cols, got.size());
    }
}

/* one-hot activations: fused forward (X = rows of I_K) and bwd_x (dY = I_N) give W exactly */
static void test_ggml_gemm_decode_exact(void)
{
    for (int type : k_types) {
        const int N = 72, K = 256; /* N not a multiple of 8 * 16 or of the 128 tile */
        HostGgml w(type, N, K, 0.7f);
        {
            const int M = K;
            std::vector<float> X((size_t)M * K, 0.0f), ref((size_t)M * N);
            for (int m = 0; m < M; m++) {
                X[(size_t)m * K + m] = 1.0f;
                for (int n = 0; n < N; n++)
                    ref[(size_t)m * N + n] = w.deq[(size_t)n * K + m];
            }
            DBuf<bt_bf16> dX(X.size());
            up_bf16(dX, X);
            OutBuf Y((size_t)M * N);
            Y.fill(nullptr);
            BTOK(bt_cuda_ggml_gemm_fwd(g_stream, Y.b.p, dX.p, &w.d, M, K, N, 0.0f));
            CU(cudaStreamSynchronize(g_stream));
            auto got = Y.get();
            char name[64];
            snprintf(name, sizeof name, "%s fwd one-hot (== Wd^T)", tn(type));
            check_exact(name, got.data(), ref.data(), ref.size());
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
            BTOK(bt_cuda_ggml_gemm_bwd_x(g_stream, dX.b.p, ddY.p, &w.d, M, K, N, 0.0f));
            CU(cudaStreamSynchronize(g_stream));
            auto got = dX.get();
            char name[64];
            snprintf(name, sizeof name, "%s bwd_x one-hot (== Wd)", tn(type));
            check_exact(name, got.data(), w.deq.data(), w.deq.size());
        }
    }
}

/* fused and dequantise + cuBLAS, forward and bwd_x, beta 0 and 1, against the fp32 reference */
static void run_case(HostGgml &w, int M, int K, int N)
{
    auto X = randv((size_t)M * K, 1.0f), Y0 = randv((size_t)M * N, 1.0f);
    auto dY = randv((size_t)M * N, 1.0f), dX0 = randv((size_t)M * K, 1.0f);
    DBuf<bt_bf16> dXin((size_t)M * K), ddY((size_t)M * N), wbuf((size_t)N * K);
    up_bf16(dXin, X);
    up_bf16(ddY, dY);
    OutBuf Y((size_t)M * N), dX((size_t)M * K);
    for (float beta : {0.0f, 1.0f}) {
        char name[96];
        /* forward */
        RefOut r = make_ref(false, X, w.deq, M, K, N, beta, Y0);
        Y.fill(beta != 0 ? &Y0 : nullptr);
        BTOK(bt_cuda_ggml_gemm_fwd(g_stream, Y.b.p, dXin.p, &w.d, M, K, N, beta));
        CU(cudaStreamSynchronize(g_stream));
        auto fused = Y.get();
        snprintf(name, sizeof name, "%s fwd M=%d K=%d N=%d beta=%g", tn(w.type), M, K, N, beta);
        check_bound(name, fused, r.ref, r.tol, N, 4e-3);
        if (!Y.tail_ok()) {
            printf("    %s: wrote past the output  <-- FAIL\n", name);
            g_case_ok = false;
        }
        Y.fill(beta != 0 ? &Y0 : nullptr);
        BTOK(bt_cuda_ggml_linear_fwd(g_cublas, g_stream, Y.b.p, dXin.p, &w.d, M, K, N, beta, wbuf.p));
        CU(cudaStreamSynchronize(g_stream));
        auto cub = Y.get();
        snprintf(name, sizeof name, "%s fwd fused-vs-cuBLAS beta=%g", tn(w.type), beta);
        check_bound(name, fused, cub, r.tol2, N, 6e-3);
        /* input gradient */
        RefOut rb = make_ref(true, dY, w.deq, M, K, N, beta, dX0);
        dX.fill(beta != 0 ? &dX0 : nullptr);
        BTOK(bt_cuda_ggml_gemm_bwd_x(g_stream, dX.b.p, ddY.p, &w.d, M, K, N, beta));
        CU(cudaStreamSynchronize(g_stream));
        auto fb = dX.get();
        snprintf(name, sizeof name, "%s bwd_x M=%d K=%d N=%d beta=%g", tn(w.type), M, K, N, beta);
        check_bound(name, fb, rb.ref, rb.tol, K, 4e-3);
        if (!dX.tail_ok()) {
            printf("    %s: wrote past the output  <-- FAIL\n", name);
            g_case_ok = false;
        }
        dX.fill(beta != 0 ? &dX0 : nullptr);
        BTOK(bt_cuda_ggml_linear_bwd_x(g_cublas, g_stream, dX.b.p, ddY.p, &w.d, M, K, N, beta,
                                       wbuf.p, 0));
        CU(cudaStreamSynchronize(g_stream));
        auto cb = dX.get();
        snprintf(name, sizeof name, "%s bwd_x fused-vs-cuBLAS beta=%g", tn(w.type), beta);
        check_bound(name, fb, cb, rb.tol2, K, 6e-3);
    }
}

static void test_ggml_gemm(void)
{
    for (int type : k_types) {
        const bool k256 = bt_ggml_block_elems(type) == 256;
        /* K: one or several 64-wide steps, and for the 32-element types a half step (96) */
        std::vector<int> Ks = k256 ? std::vector<int>{256, 512} : std::vector<int>{96, 576};
        std::vector<int> Ns = g_quick ? std::vector<int>{100} : std::vector<int>{8, 100, 300};
        std::vector<int> Ms = g_quick ? std::vector<int>{17, 130} : std::vector<int>{1, 17, 130, 300};
        if (g_quick)
            Ks.resize(1);
        for (int K : Ks)
            for (int N : Ns) {
                HostGgml w(type, N, K, 0.05f);
                for (int M : Ms)
                    run_case(w, M, K, N);
            }
    }
}

static void test_ggml_errors(void)
{
    const int M = 4, K = 256, N = 16;
    HostGgml w(BT_GGML_Q4_K, N, K, 0.1f);
    DBuf<bt_bf16> a((size_t)M * K + 16), o((size_t)M * K + 16);
    CU(cudaMemset(o.p, 0, o.n * 2));
    std::vector<uint8_t> host(4096, 0);
    bt_cuda_ggml tmp;
    bt_cuda_ggml bad = w.d;
    bad.type = BT_GGML_Q3_K; /* a type without a device decoder */
    bt_cuda_ggml nodata = w.d;
    nodata.data = nullptr;
    const CodeCase cs[] = {
        {"upload Q3_K", bt_cuda_ggml_upload(&tmp, BT_GGML_Q3_K, 2, 256, host.data()), -5},
        {"upload Q2_K", bt_cuda_ggml_upload(&tmp, BT_GGML_Q2_K, 2, 256, host.data()), -5},
        {"upload F16", bt_cuda_ggml_upload(&tmp, BT_GGML_F16, 2, 32, host.data()), -5},
        {"upload Q4_K cols 128", bt_cuda_ggml_upload(&tmp, BT_GGML_Q4_K, 2, 128, host.data()), -6},
        {"upload rows 0", bt_cuda_ggml_upload(&tmp, BT_GGML_Q4_0, 0, 32, host.data()), -6},
        {"upload NULL", bt_cuda_ggml_upload(&tmp, BT_GGML_Q4_0, 2, 32, nullptr), -6},
        {"dequant NULL out", bt_cuda_ggml_dequant(nullptr, &w.d, 0, 1, g_stream), -6},
        {"dequant past rows", bt_cuda_ggml_dequant(o.p, &w.d, 10, 7, g_stream), -6},
        {"dequant misaligned", bt_cuda_ggml_dequant(o.p + 1, &w.d, 0, 1, g_stream), -5},
        {"dequant Q3_K", bt_cuda_ggml_dequant(o.p, &bad, 0, 1, g_stream), -5},
        {"fwd Y NULL", bt_cuda_ggml_gemm_fwd(g_stream, nullptr, a.p, &w.d, M, K, N, 0.f), -6},
        {"fwd W NULL", bt_cuda_ggml_gemm_fwd(g_stream, o.p, a.p, nullptr, M, K, N, 0.f), -6},
        {"fwd W->data NULL", bt_cuda_ggml_gemm_fwd(g_stream, o.p, a.p, &nodata, M, K, N, 0.f), -6},
        {"fwd M=0", bt_cuda_ggml_gemm_fwd(g_stream, o.p, a.p, &w.d, 0, K, N, 0.f), -6},
        {"fwd N != W rows", bt_cuda_ggml_gemm_fwd(g_stream, o.p, a.p, &w.d, M, K, N + 1, 0.f), -6},
        {"fwd K != W cols", bt_cuda_ggml_gemm_fwd(g_stream, o.p, a.p, &w.d, M, K - 32, N, 0.f), -6},
        {"fwd X misaligned", bt_cuda_ggml_gemm_fwd(g_stream, o.p, a.p + 1, &w.d, M, K, N, 0.f), -5},
        {"fwd Q3_K", bt_cuda_ggml_gemm_fwd(g_stream, o.p, a.p, &bad, M, K, N, 0.f), -5},
        {"bwd dX NULL", bt_cuda_ggml_gemm_bwd_x(g_stream, nullptr, a.p, &w.d, M, K, N, 0.f), -6},
        {"bwd N=0", bt_cuda_ggml_gemm_bwd_x(g_stream, o.p, a.p, &w.d, M, K, 0, 0.f), -6},
        {"bwd dX misaligned", bt_cuda_ggml_gemm_bwd_x(g_stream, o.p + 4, a.p, &w.d, M, K, N, 0.f), -5},
        {"linear_fwd no wbuf", bt_cuda_ggml_linear_fwd(g_cublas, g_stream, o.p, a.p, &w.d, M, K, N,
                                                        0.f, nullptr), -6},
    };
    check_codes(cs, sizeof cs / sizeof cs[0]);
    /* the reason of the last refusal (linear_fwd, no wbuf) is in bt_last_error, nothing printed */
    const char *err = bt_last_error();
    printf("    bt_last_error: %s\n", err);
    check_true("refusal names launcher + check",
               !strncmp(err, "cuda: bt_cuda_ggml_linear_fwd: invalid arguments: ", 50) &&
                   strstr(err, "!wbuf"));
    check_true("supported: Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K only",
               bt_cuda_ggml_supported(BT_GGML_Q4_0) && bt_cuda_ggml_supported(BT_GGML_Q4_1) &&
                   bt_cuda_ggml_supported(BT_GGML_Q5_0) && bt_cuda_ggml_supported(BT_GGML_Q5_1) &&
                   bt_cuda_ggml_supported(BT_GGML_Q8_0) && bt_cuda_ggml_supported(BT_GGML_Q4_K) &&
                   bt_cuda_ggml_supported(BT_GGML_Q5_K) && bt_cuda_ggml_supported(BT_GGML_Q6_K) &&
                   !bt_cuda_ggml_supported(BT_GGML_Q2_K) && !bt_cuda_ggml_supported(BT_GGML_Q3_K) &&
                   !bt_cuda_ggml_supported(BT_GGML_BF16));
    CU(cudaStreamSynchronize(g_stream));
    check_untouched(o.p, o.n);
}

int main(int argc, char **argv)
{
    const char *prog = "test_ggml_gpu";
    const int init = gt_init(prog, argc, argv);
    if (init >= 0)
        return init;
    g_quick = (getenv("BT_GPU_QUICK") && atoi(getenv("BT_GPU_QUICK"))) ||
              (getenv("BT_GPU_EMU") && atoi(getenv("BT_GPU_EMU")));
    if (g_quick)
        printf("%s: BT_GPU_QUICK / BT_GPU_EMU set: reduced shape grid\n", prog);
    CU(cudaStreamCreate(&g_stream));
    if (cublasCreate(&g_cublas) != CUBLAS_STATUS_SUCCESS) {
        printf("%s: cublasCreate failed\n", prog);
        return 2;
    }
    GT_CASE(test_ggml_errors);
    GT_CASE(test_ggml_dequant_exact);
    GT_CASE(test_ggml_gemm_decode_exact);
    GT_CASE(test_ggml_gemm);
    const int rc = gt_run(prog);
    cublasDestroy(g_cublas);
    cudaStreamDestroy(g_stream);
    return rc;
}
