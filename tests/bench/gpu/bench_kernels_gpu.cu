/* Kernel benchmark of the CUDA backend (kernels/cuda) on Llama-2-7B-shaped operands (T = 4096
 * tokens, d 4096, ffn 11008, 32 heads of 128, vocab 32000, r 16). Prints markdown table rows
 *   | kernel | shape | impl | ms | throughput | % of ceiling | card |
 * (the same rows tests/bench/gpu/bench_torch.py prints for the PyTorch equivalents), line-buffered
 * so that each row reaches the log as it is measured. Time: median of 20 runs after 3 warm-ups,
 * cudaEvent. Ceilings: MEASURED on this card at start, not datasheet peaks (a datasheet's 989 bf16
 * TFLOP/s and 3.35 TB/s are what no kernel reaches on an H100; measured there: about 798 TFLOP/s
 * and 3.0 TB/s, 4.3 TB/s on an H200: tests/gpu/README.md): the bf16 TFLOP/s of a cuBLAS
 * N x N x N GEMM (cublasGemmEx, fp32 accumulation, N = 8192, random data) and the GB/s of a
 * device-to-device copy of 2 GiB counting bytes read and written, each the median of 10 after 3
 * warm-ups; printed first as "ceilings: <card>: X bf16 TFLOP/s ..., Y GB/s ..." (tests/bench/gpu/
 * run.sh hands them to bench_torch.py, so both tables use the same ceilings).
 * Usage: bench_kernels_gpu [--T 4096] [--quick] [--shape llama2-7b|tiny] [--probe-only]
 *   --probe-only   the device check and the one-kernel probe (tests/gpu/gpu_probe.h) only
 *   --quick        5 timed runs per row instead of 20
 *   --shape tiny   d 256, ffn 512, 4 heads of 64, vocab 1000, ceilings from a 512^3 GEMM and a
 *                  4 MiB copy: for the CPU emulator (tests/py/test_gpu_scripts.py), where the
 *                  Llama-2-7B shapes would take hours
 * Exit 77 without a device (1 under BT_GPU_REQUIRE=1). */
#include <algorithm>
#include <getopt.h>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

extern "C" {
#include "common/bt_common.h"
#include "common/gguf.h"
#include "common/quant.h"
#include "kernels/kernels.h"
}
#include "kernels/cuda/kernels_cuda.h"
#include "tests/gpu/gpu_probe.h"

#define CU(x)                                                                                  \
    do {                                                                                       \
        cudaError_t e_ = (x);                                                                  \
        if (e_ != cudaSuccess) {                                                               \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)
#define OK(x)                                                                    \
    do {                                                                         \
        int r_ = (x);                                                            \
        if (r_) {                                                                \
            fprintf(stderr, "%s:%d: %s returned %d: %s\n", __FILE__, __LINE__, #x, r_, \
                    bt_last_error());                                            \
            exit(1);                                                             \
        }                                                                        \
    } while (0)

static double g_ceil_tflops = 0, g_ceil_gbs = 0;
static char g_card[256] = "?";
static cudaStream_t g_s;
static cublasHandle_t g_h;
static int g_iters = 20;

template <typename F>
static double time_ms(F f)
{
    cudaEvent_t a, b;
    CU(cudaEventCreate(&a));
    CU(cudaEventCreate(&b));
    for (int i = 0; i < 3; i++)
        f();
    std::vector<float> t;
    for (int i = 0; i < g_iters; i++) {
        CU(cudaEventRecord(a, g_s));
        f();
        CU(cudaEventRecord(b, g_s));
        CU(cudaEventSynchronize(b));
        float ms;
        CU(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms);
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}
static void row_flops(const char *k, const char *shape, double ms, double flops)
{
    const double tf = flops / (ms * 1e-3) / 1e12;
    printf("| %s | %s | barq | %.3f | %.1f TFLOP/s | %.1f%% | %s |\n", k, shape, ms, tf,
           100 * tf / g_ceil_tflops, g_card);
    fflush(stdout);
}
static void row_bytes(const char *k, const char *shape, double ms, double bytes)
{
    const double gbs = bytes / (ms * 1e-3) / 1e9;
    printf("| %s | %s | barq | %.3f | %.0f GB/s | %.1f%% | %s |\n", k, shape, ms, gbs,
           100 * gbs / g_ceil_gbs, g_card);
    fflush(stdout);
}

template <typename T>
static T *dalloc(size_t n)
{
    T *p;
    CU(cudaMalloc(&p, n * sizeof(T) + 16));
    return p;
}
__global__ void fill_kernel(bt_bf16 *x, size_t n, uint32_t seed, float a)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 2654435761u ^ seed;
        h ^= h >> 15;
        h *= 2246822519u;
        h ^= h >> 13;
        x[i] = __float2bfloat16((float)(h & 0xffff) / 32768.0f * a - a);
    }
}
static bt_bf16 *drand(size_t n, float a)
{
    bt_bf16 *p = dalloc<bt_bf16>(n);
    fill_kernel<<<1024, 256>>>(p, n, (uint32_t)n, a);
    CU(cudaGetLastError());
    return p;
}

/* The card's measured ceilings (see the file comment): a cuBLAS bf16 n^3 GEMM and a
 * device-to-device copy of copy_bytes, median of 10 timed runs after 3 warm-ups each. */
static void measure_ceilings(int n, size_t copy_bytes)
{
    cudaDeviceProp p;
    CU(cudaGetDeviceProperties(&p, 0));
    snprintf(g_card, sizeof g_card, "%s", p.name);
    const int saved = g_iters;
    g_iters = 10;
    bt_bf16 *A = drand((size_t)n * n, 1.f), *B = drand((size_t)n * n, 1.f), *C = dalloc<bt_bf16>((size_t)n * n);
    const double gemm_ms = time_ms([&] {
        OK(bt_cuda_gemm(g_h, g_s, 0, 1, n, n, n, 1.f, A, n, B, n, 0.f, C, n, 0));
    });
    g_ceil_tflops = 2.0 * n * (double)n * n / (gemm_ms * 1e-3) / 1e12;
    cudaFree(A); cudaFree(B); cudaFree(C);
    char *src = dalloc<char>(copy_bytes), *dst = dalloc<char>(copy_bytes);
    CU(cudaMemset(src, 1, copy_bytes));
    const double copy_ms = time_ms([&] {
        CU(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice, g_s));
    });
    g_ceil_gbs = 2.0 * copy_bytes / (copy_ms * 1e-3) / 1e9;
    cudaFree(src); cudaFree(dst);
    g_iters = saved;
    printf("ceilings: %s: %.4g bf16 TFLOP/s (cuBLAS %dx%dx%d GEMM), %.4g GB/s (device-to-device copy "
           "of %zu MiB, read + write); measured now, median of 10\n\n",
           g_card, g_ceil_tflops, n, n, n, g_ceil_gbs, copy_bytes >> 20);
    printf("| kernel | shape | impl | ms | throughput | %% of ceiling | card |\n"
           "|---|---|---|---|---|---|---|\n");
}

int main(int argc, char **argv)
{
    setvbuf(stdout, nullptr, _IOLBF, 0);
    int T = 4096;
    bool tiny = false, probe = false;
    static const struct option lopts[] = {{"probe-only", no_argument, nullptr, 'p'},
                                          {"T", required_argument, nullptr, 'T'},
                                          {"quick", no_argument, nullptr, 'q'},
                                          {"shape", required_argument, nullptr, 's'},
                                          {"help", no_argument, nullptr, 'h'},
                                          {nullptr, 0, nullptr, 0}};
    static const char usage[] = "usage: bench_kernels_gpu [--T 4096] [--quick] [--shape llama2-7b|tiny] "
                                "[--probe-only]\n";
    int c;
    while ((c = getopt_long(argc, argv, "", lopts, nullptr)) != -1) {
        switch (c) {
        case 'p': probe = true; break;
        case 'T': T = atoi(optarg); break;
        case 'q': g_iters = 5; break;
        case 's':
            if (strcmp(optarg, "tiny") && strcmp(optarg, "llama2-7b")) {
                fprintf(stderr, "bench_kernels_gpu: --shape %s: want llama2-7b or tiny\n%s", optarg, usage);
                return 2;
            }
            tiny = !strcmp(optarg, "tiny");
            break;
        case 'h': fputs(usage, stdout); return 0;
        default: fputs(usage, stderr); return 2;
        }
    }
    if (optind != argc) {
        fprintf(stderr, "bench_kernels_gpu: unexpected argument %s\n%s", argv[optind], usage);
        return 2;
    }
    if (bt_cuda_device_count() <= 0) {
        const char *req = getenv("BT_GPU_REQUIRE");
        printf("bench_kernels_gpu: %s: no CUDA device (%s)\n", req && atoi(req) ? "FAILED" : "skipped", bt_last_error());
        return req && atoi(req) ? 1 : 77;
    }
    if (probe)
        return bt_gpu_probe_kernel() ? 0 : 1;
    CU(cudaStreamCreate(&g_s));
    if (cublasCreate(&g_h) != CUBLAS_STATUS_SUCCESS)
        return 1;
    measure_ceilings(tiny ? 512 : 8192, tiny ? (4u << 20) : ((size_t)2 << 30));
    const int M = T, D = tiny ? 256 : 4096, F = tiny ? 512 : 11008, H = tiny ? 4 : 32,
              HD = tiny ? 64 : 128, V = tiny ? 1000 : 32000, R = 16;
    char shp[128];

    /* NF4 */
    {
        const int64_t rows = F, cols = D, n = rows * cols;
        std::vector<uint8_t> pk(n / 2), aq(n / 64);
        std::vector<float> nest((n / 64 + 255) / 256, 0.02f), code8(256);
        for (size_t i = 0; i < pk.size(); i++)
            pk[i] = (uint8_t)(i * 2654435761u >> 13);
        for (size_t i = 0; i < aq.size(); i++)
            aq[i] = (uint8_t)(i * 40503u >> 7);
        for (int i = 0; i < 256; i++)
            code8[i] = bt_dynamic_code8(i);
        bt_cuda_nf4 w;
        OK(bt_cuda_nf4_upload(&w, rows, cols, pk.data(), aq.data(), nest.data(), 0.f, code8.data()));
        bt_bf16 *out = dalloc<bt_bf16>(n);
        double ms = time_ms([&] { OK(bt_cuda_nf4_dequant(out, &w, 0, rows, g_s)); });
        snprintf(shp, sizeof shp, "%lldx%lld", (long long)rows, (long long)cols);
        row_bytes("nf4_dequant", shp, ms, n / 2.0 + n / 64.0 + 2.0 * n);
        bt_bf16 *X = drand((size_t)M * cols, 1.f), *Y = dalloc<bt_bf16>((size_t)M * rows);
        ms = time_ms([&] { OK(bt_cuda_nf4_linear_fwd(g_h, g_s, Y, X, &w, M, (int)cols, (int)rows, 0.f, out)); });
        snprintf(shp, sizeof shp, "M%d K%lld N%lld", M, (long long)cols, (long long)rows);
        row_flops("nf4_linear_fwd (dequant+gemm)", shp, ms, 2.0 * M * rows * cols);
        ms = time_ms([&] { OK(bt_cuda_gemm(g_h, g_s, 0, 1, M, (int)rows, (int)cols, 1.f, X, (int)cols, out, (int)cols, 0.f, Y, (int)rows, 0)); });
        row_flops("gemm bf16 (cuBLAS)", shp, ms, 2.0 * M * rows * cols);
        /* LoRA fwd/bwd on the same layer (r 16) */
        bt_bf16 *A16 = drand((size_t)R * cols, 0.02f), *B16 = drand((size_t)rows * R, 0.02f);
        bt_bf16 *XA = dalloc<bt_bf16>((size_t)M * R), *dXA = dalloc<bt_bf16>((size_t)M * R);
        bt_bf16 *dX = dalloc<bt_bf16>((size_t)M * cols);
        float *dA = dalloc<float>((size_t)R * cols), *dB = dalloc<float>((size_t)rows * R);
        ms = time_ms([&] { OK(bt_cuda_lora_fwd(g_h, g_s, Y, XA, X, A16, B16, M, (int)cols, (int)rows, R, 2.f)); });
        snprintf(shp, sizeof shp, "M%d K%lld N%lld r%d", M, (long long)cols, (long long)rows, R);
        row_flops("lora_fwd", shp, ms, 2.0 * M * R * (cols + rows));
        ms = time_ms([&] { OK(bt_cuda_lora_bwd(g_h, g_s, dA, dB, dX, dXA, Y, X, XA, A16, B16, M, (int)cols, (int)rows, R, 2.f, 1.f)); });
        row_flops("lora_bwd", shp, ms, 2.0 * M * R * (2.0 * cols + 2.0 * rows));
        cudaFree(A16); cudaFree(B16); cudaFree(XA); cudaFree(dXA); cudaFree(dX); cudaFree(dA); cudaFree(dB);
        cudaFree(X); cudaFree(Y); cudaFree(out);
        bt_cuda_nf4_free(&w);
    }
    /* Fused NF4 GEMMs (kernels/cuda/nf4_gemm.cu) vs dequantise + cuBLAS (bt_cuda_nf4_linear_*,
     * which dequantises the whole weight every call), Llama-2-7B projections (K, N) = (4096, 4096)
     * q/k/v/o, (4096, 11008) gate/up, (11008, 4096) down, at M = T and at M = 16 (decode-sized;
     * the fused forward then runs its small-M kernel; "tiled" forces the tensor-core kernel).
     * FLOP = 2 M N K for every row. */
    {
        const int nk_shapes[3][2] = {{D, D}, {D, F}, {F, D}}; /* {K, N} */
        const int m_list[2] = {M, 16};
        for (const auto &kn : nk_shapes) {
            const int gK = kn[0], gN = kn[1];
            const int64_t wn = (int64_t)gN * gK;
            std::vector<uint8_t> pk(wn / 2), aq(wn / 64);
            std::vector<float> nest((wn / 64 + 255) / 256, 0.02f), code8(256);
            for (size_t i = 0; i < pk.size(); i++)
                pk[i] = (uint8_t)(i * 2654435761u >> 13);
            for (size_t i = 0; i < aq.size(); i++)
                aq[i] = (uint8_t)(i * 40503u >> 7);
            for (int i = 0; i < 256; i++)
                code8[i] = bt_dynamic_code8(i);
            bt_cuda_nf4 w;
            OK(bt_cuda_nf4_upload(&w, gN, gK, pk.data(), aq.data(), nest.data(), 0.f, code8.data()));
            bt_bf16 *wbuf = dalloc<bt_bf16>(wn);
            for (int gM : m_list) {
                bt_bf16 *X = drand((size_t)gM * gK, 1.f), *Y = dalloc<bt_bf16>((size_t)gM * gN);
                bt_bf16 *dY = drand((size_t)gM * gN, 1.f), *dX = dalloc<bt_bf16>((size_t)gM * gK);
                const double fl = 2.0 * gM * (double)gN * gK;
                snprintf(shp, sizeof shp, "M%d K%d N%d", gM, gK, gN);
                double ms = time_ms([&] { OK(bt_cuda_nf4_gemm_fwd(g_s, Y, X, &w, gM, gK, gN, 0.f)); });
                row_flops(gM <= 16 ? "nf4_gemm_fwd (fused, small-M)" : "nf4_gemm_fwd (fused)", shp, ms, fl);
                if (gM <= 16) {
                    ms = time_ms([&] { OK(bt_cuda_nf4_gemm_fwd_impl(g_s, Y, X, &w, gM, gK, gN, 0.f, 1)); });
                    row_flops("nf4_gemm_fwd (fused, tiled)", shp, ms, fl);
                }
                ms = time_ms([&] { OK(bt_cuda_nf4_linear_fwd(g_h, g_s, Y, X, &w, gM, gK, gN, 0.f, wbuf)); });
                row_flops("nf4_linear_fwd (dequant+gemm)", shp, ms, fl);
                ms = time_ms([&] { OK(bt_cuda_nf4_gemm_bwd_x(g_s, dX, dY, &w, gM, gK, gN, 0.f)); });
                row_flops("nf4_gemm_bwd_x (fused)", shp, ms, fl);
                ms = time_ms([&] { OK(bt_cuda_nf4_linear_bwd_x(g_h, g_s, dX, dY, &w, gM, gK, gN, 0.f, wbuf, 0)); });
                row_flops("nf4_linear_bwd_x (dequant+gemm)", shp, ms, fl);
                cudaFree(X); cudaFree(Y); cudaFree(dY); cudaFree(dX);
            }
            cudaFree(wbuf);
            bt_cuda_nf4_free(&w);
        }
    }
    /* GGUF-native base (kernels/cuda/ggml.cu, nf4_gemm.cu's ggml sources): the gate_proj shape
     * (K 4096, N 11008) at M = T for every type with a device decoder; random weights encoded on
     * the host (common/quant.h bt_ggml_quantize). Dequantisation bytes = blocks read + bf16 written.
     * FLOP = 2 M N K. */
    {
        const int gK = D, gN = F;
        const int64_t wn = (int64_t)gN * gK;
        std::vector<float> wf((size_t)wn);
        for (size_t i = 0; i < wf.size(); i++)
            wf[i] = 0.02f * (float)((int)((i * 2654435761u) >> 20 & 1023) - 512) / 512.f;
        bt_bf16 *wbuf = dalloc<bt_bf16>(wn);
        bt_bf16 *X = drand((size_t)M * gK, 1.f), *Y = dalloc<bt_bf16>((size_t)M * gN);
        bt_bf16 *dY = drand((size_t)M * gN, 1.f), *dX = dalloc<bt_bf16>((size_t)M * gK);
        const int types[6] = {BT_GGML_Q4_0, BT_GGML_Q4_1, BT_GGML_Q8_0,
                              BT_GGML_Q4_K, BT_GGML_Q5_K, BT_GGML_Q6_K};
        for (int type : types) {
            const size_t nb = bt_ggml_row_size(type, gK) * (size_t)gN;
            std::vector<uint8_t> blocks(nb);
            OK(bt_ggml_quantize(type, wf.data(), blocks.data(), wn));
            bt_cuda_ggml w;
            OK(bt_cuda_ggml_upload(&w, type, gN, gK, blocks.data()));
            const std::string tn = bt_ggml_type_name(type);
            const double fl = 2.0 * M * (double)gN * gK;
            snprintf(shp, sizeof shp, "%dx%d", gN, gK);
            double ms = time_ms([&] { OK(bt_cuda_ggml_dequant(wbuf, &w, 0, gN, g_s)); });
            row_bytes((tn + " dequant").c_str(), shp, ms, (double)nb + 2.0 * wn);
            snprintf(shp, sizeof shp, "M%d K%d N%d", M, gK, gN);
            ms = time_ms([&] { OK(bt_cuda_ggml_gemm_fwd(g_s, Y, X, &w, M, gK, gN, 0.f)); });
            row_flops((tn + " gemm_fwd (fused)").c_str(), shp, ms, fl);
            ms = time_ms([&] { OK(bt_cuda_ggml_linear_fwd(g_h, g_s, Y, X, &w, M, gK, gN, 0.f, wbuf)); });
            row_flops((tn + " linear_fwd (dequant+gemm)").c_str(), shp, ms, fl);
            ms = time_ms([&] { OK(bt_cuda_ggml_gemm_bwd_x(g_s, dX, dY, &w, M, gK, gN, 0.f)); });
            row_flops((tn + " gemm_bwd_x (fused)").c_str(), shp, ms, fl);
            ms = time_ms([&] { OK(bt_cuda_ggml_linear_bwd_x(g_h, g_s, dX, dY, &w, M, gK, gN, 0.f, wbuf, 0)); });
            row_flops((tn + " linear_bwd_x (dequant+gemm)").c_str(), shp, ms, fl);
            bt_cuda_ggml_free(&w);
        }
        cudaFree(wbuf); cudaFree(X); cudaFree(Y); cudaFree(dY); cudaFree(dX);
    }
    /* RMSNorm */
    {
        bt_bf16 *x = drand((size_t)M * D, 1.f), *y = dalloc<bt_bf16>((size_t)M * D), *dx = dalloc<bt_bf16>((size_t)M * D);
        float *w = dalloc<float>(D), *rs = dalloc<float>(M);
        CU(cudaMemset(w, 0, D * sizeof(float)));
        double ms = time_ms([&] { OK(bt_cuda_rmsnorm_fwd(y, rs, x, w, M, D, 1e-5f, g_s)); });
        snprintf(shp, sizeof shp, "M%d D%d", M, D);
        row_bytes("rmsnorm_fwd", shp, ms, 4.0 * M * D);
        ms = time_ms([&] { OK(bt_cuda_rmsnorm_bwd(dx, nullptr, y, x, w, rs, M, D, nullptr, g_s)); });
        row_bytes("rmsnorm_bwd", shp, ms, 6.0 * M * D);
        cudaFree(x); cudaFree(y); cudaFree(dx); cudaFree(w); cudaFree(rs);
    }
    /* SwiGLU */
    {
        const int64_t n = (int64_t)M * F;
        bt_bf16 *g = drand(n, 2.f), *u = drand(n, 2.f), *h = dalloc<bt_bf16>(n);
        double ms = time_ms([&] { OK(bt_cuda_swiglu_fwd(h, g, u, n, g_s)); });
        snprintf(shp, sizeof shp, "M%d F%d", M, F);
        row_bytes("swiglu_fwd", shp, ms, 6.0 * n);
        bt_bf16 *dg = dalloc<bt_bf16>(n), *du = dalloc<bt_bf16>(n);
        ms = time_ms([&] { OK(bt_cuda_swiglu_bwd(dg, du, h, g, u, n, g_s)); });
        row_bytes("swiglu_bwd", shp, ms, 10.0 * n);
        cudaFree(g); cudaFree(u); cudaFree(h); cudaFree(dg); cudaFree(du);
    }
    /* attention: one causal document of TT tokens, 32 heads of 128 (MHA as Llama-2-7B), both
     * implementations: wmma (bt_cuda_attn_fwd/bwd, rows "attn_*") and mma.sync (bt_cuda_attn_*_mma,
     * rows "attn_* mma"), at TT = --T and at TT = 8192 (FlashAttention's benchmark length) when it
     * differs and fits in free device memory. FLOPs as FlashAttention's benchmark counts them:
     * fwd 4*TT^2*D*H/2 (causal half), bwd 2.5x fwd, fwd+bwd 3.5x fwd. */
    {
        auto bench_attn = [&](int TT) {
            const size_t n = (size_t)TT * H * HD;
            size_t fr = 0, tot = 0;
            CU(cudaMemGetInfo(&fr, &tot));
            const size_t need = 9 * n * sizeof(bt_bf16) + 2 * (size_t)TT * H * sizeof(float) + (256u << 20);
            if (need > fr) {
                printf("| attn | T%d H%d D%d causal | barq | - | skipped: needs %.1f GiB, %.1f GiB free | - | %s |\n",
                       TT, H, HD, need / 1073741824.0, fr / 1073741824.0, g_card);
                return;
            }
            bt_bf16 *q = drand(n, 1.f), *k = drand(n, 1.f), *v = drand(n, 1.f), *o = dalloc<bt_bf16>(n);
            bt_bf16 *dq = dalloc<bt_bf16>(n), *dk = dalloc<bt_bf16>(n), *dv = dalloc<bt_bf16>(n), *dout = drand(n, 1.f);
            float *lse = dalloc<float>((size_t)TT * H), *delta = dalloc<float>((size_t)TT * H);
            int32_t *cu = dalloc<int32_t>(2), *pos = dalloc<int32_t>(TT);
            int32_t hcu[2] = {0, TT};
            std::vector<int32_t> hp(TT);
            for (int i = 0; i < TT; i++)
                hp[i] = i;
            CU(cudaMemcpy(cu, hcu, sizeof hcu, cudaMemcpyHostToDevice));
            CU(cudaMemcpy(pos, hp.data(), (size_t)TT * 4, cudaMemcpyHostToDevice));
            bt_cuda_attn_params p;
            memset(&p, 0, sizeof p);
            p.M = TT; p.Hq = H; p.Hkv = H; p.D = HD; p.n_seq = 1; p.max_seqlen = TT; p.cu_seqlens = cu;
            p.ldq = p.ldk = p.ldv = (int64_t)H * HD; p.scale = 1.0f / sqrtf((float)HD);
            p.rope_theta = 10000.f; p.pos_scale = 1.f;
            const double fl = 4.0 * TT * (double)TT * H * HD / 2.0; /* causal half */
            snprintf(shp, sizeof shp, "T%d H%d D%d causal", TT, H, HD);
            for (int impl = 0; impl < 2; impl++) {
                const char *sfx = impl ? " mma" : "";
                auto fwd = [&] {
                    OK(impl ? bt_cuda_attn_fwd_mma(&p, o, lse, q, k, v, g_s)
                            : bt_cuda_attn_fwd(&p, o, lse, q, k, v, g_s));
                };
                auto bwd = [&] {
                    OK(impl ? bt_cuda_attn_bwd_mma(&p, dq, dk, dv, dout, o, lse, q, k, v, delta, g_s)
                            : bt_cuda_attn_bwd(&p, dq, dk, dv, dout, o, lse, q, k, v, delta, g_s));
                };
                char kn[64];
                p.position_ids = pos;
                double ms = time_ms(fwd);
                snprintf(kn, sizeof kn, "attn_fwd%s (+RoPE)", sfx);
                row_flops(kn, shp, ms, fl);
                ms = time_ms(bwd);
                snprintf(kn, sizeof kn, "attn_bwd%s (+RoPE)", sfx);
                row_flops(kn, shp, ms, 2.5 * fl);
                ms = time_ms([&] { fwd(); bwd(); });
                snprintf(kn, sizeof kn, "attn_fwd+bwd%s (+RoPE)", sfx);
                row_flops(kn, shp, ms, 3.5 * fl);
                p.position_ids = nullptr;
                ms = time_ms(fwd);
                snprintf(kn, sizeof kn, "attn_fwd%s (no RoPE)", sfx);
                row_flops(kn, shp, ms, fl);
                ms = time_ms(bwd);
                snprintf(kn, sizeof kn, "attn_bwd%s (no RoPE)", sfx);
                row_flops(kn, shp, ms, 2.5 * fl);
            }
            cudaFree(q); cudaFree(k); cudaFree(v); cudaFree(o); cudaFree(dq); cudaFree(dk); cudaFree(dv);
            cudaFree(dout); cudaFree(lse); cudaFree(delta); cudaFree(cu); cudaFree(pos);
        };
        bench_attn(M);
        if (M != 8192 && !tiny)
            bench_attn(8192);
    }
    /* fused linear + CE (fwd + dX) */
    {
        bt_bf16 *x = drand((size_t)M * D, 1.f), *W = drand((size_t)V * D, 0.02f), *dx = dalloc<bt_bf16>((size_t)M * D);
        int32_t *tg = dalloc<int32_t>(M);
        std::vector<int32_t> ht(M);
        for (int i = 0; i < M; i++)
            ht[i] = (i * 7919) % V;
        CU(cudaMemcpy(tg, ht.data(), M * 4, cudaMemcpyHostToDevice));
        float *rl = dalloc<float>(M);
        const int chunk = M < 1024 ? M : 1024;
        void *ws = dalloc<char>(bt_cuda_linear_ce_workspace_bytes(chunk, V));
        double ms = time_ms([&] { OK(bt_cuda_linear_ce(g_h, g_s, rl, dx, nullptr, x, W, tg, M, D, V, chunk, 1.f / M, ws)); });
        snprintf(shp, sizeof shp, "M%d D%d V%d", M, D, V);
        row_flops("linear_ce fwd+dX", shp, ms, 4.0 * M * (double)D * V);
        cudaFree(x); cudaFree(W); cudaFree(dx); cudaFree(tg); cudaFree(rl); cudaFree(ws);
    }
    /* AdamW over 40M parameters (Llama-2-7B r16 on all linears: 40.0M; 64K for --shape tiny) */
    {
        const int64_t n = tiny ? 65536 : 39976960;
        float *p = dalloc<float>(n), *g = dalloc<float>(n), *m = dalloc<float>(n), *v = dalloc<float>(n);
        bt_bf16 *p16 = dalloc<bt_bf16>(n);
        CU(cudaMemset(p, 0, n * 4)); CU(cudaMemset(g, 0, n * 4)); CU(cudaMemset(m, 0, n * 4)); CU(cudaMemset(v, 0, n * 4));
        bt_cuda_adamw_tensor t = {p, g, m, v, p16, n, 0.f};
        bt_cuda_adamw_tensor *dt = dalloc<bt_cuda_adamw_tensor>(1);
        CU(cudaMemcpy(dt, &t, sizeof t, cudaMemcpyHostToDevice));
        int64_t step = 1;
        double ms = time_ms([&] { OK(bt_cuda_adamw_multi(dt, 1, n, 1e-4f, 0.9f, 0.999f, 1e-8f, 1.f, step++, g_s)); });
        snprintf(shp, sizeof shp, "n=%lld", (long long)n);
        row_bytes("adamw_multi", shp, ms, 30.0 * n);
        cudaFree(p); cudaFree(g); cudaFree(m); cudaFree(v); cudaFree(p16); cudaFree(dt);
    }
    CU(cudaDeviceSynchronize());
    return 0;
}
