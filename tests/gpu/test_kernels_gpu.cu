/* GPU parity tests for the non-attention CUDA kernels: each launcher of kernels/cuda/kernels_cuda.h
 * against the CPU fp32 reference (kernels/kernels.h) on the same bf16-rounded inputs, with random
 * and adversarial shapes/values (odd sizes, partial chunks, one-row cases, large magnitudes,
 * ignored/out-of-range ids). Tolerances are stated per check (rel_l2, max_rel of max|ref|).
 * Options: those of every GPU test binary (tests/gpu/gpu_test.h gt_init: --case SUBSTR, --after
 * NAME, --list, --probe-only). Without a CUDA device it prints "SKIPPED" and exits 77 (never an OK
 * line; FAIL and 1 under BT_GPU_REQUIRE=1). */
#include "tests/gpu/gpu_test.h"

static cublasHandle_t g_cublas;
static cudaStream_t g_stream;

/* ---------------------------------------------------------------- NF4 */

/* bf16(deq) must equal bf16(CPU fp32 deq) bit for bit: both compute code*absmax in fp32 with the
 * same roundings (tol: exact). Covers a partial nested block (n/64 % 256 != 0), a row range not
 * starting at 0, and large magnitudes. */
static void test_nf4_dequant(void)
{
    const int64_t shapes[][2] = {{96, 192}, {5, 64}, {300, 320}};
    const float scales[] = {0.02f, 3.0f, 3000.0f};
    for (int s = 0; s < 3; s++) {
        const int64_t rows = shapes[s][0], cols = shapes[s][1];
        HostNF4 w(rows, cols, scales[s]);
        const int64_t r0 = rows > 40 ? 17 : 0, nr = rows > 40 ? rows - 17 - 3 : rows;
        std::vector<float> ref(nr * cols);
        bt_nf4_dequantize_rows(&w.q, r0, nr, ref.data());
        for (auto &x : ref)
            x = bf16_round(x);
        DBuf<bt_bf16> out(nr * cols);
        if ((r0 * cols) % 64 == 0 && (nr * cols) % 16 == 0) {
            BTOK(bt_cuda_nf4_dequant(out.p, &w.d, r0, nr, g_stream));
            CU(cudaStreamSynchronize(g_stream));
            auto got = down_bf16(out.p, nr * cols);
            char name[64];
            snprintf(name, sizeof name, "deq %lldx%lld r0=%lld", (long long)rows, (long long)cols,
                     (long long)r0);
            check_exact(name, got.data(), ref.data(), ref.size());
        }
    }
}

/* Y = X deq(W)^T (+ beta Y) and dX = dY deq(W): cuBLAS bf16 GEMM vs CPU fp32 bt_nf4_linear_*;
 * tol rel_l2 1e-2, max 2e-2 (bf16 output rounding + fp32 order). */
static void test_nf4_linear(void)
{
    const int M = 37, K = 192, N = 96;
    HostNF4 w(N, K, 0.05f);
    auto X = randv((size_t)M * K, 1.0f);
    auto Y0 = randv((size_t)M * N, 1.0f);
    auto dY = randv((size_t)M * N, 1.0f);
    std::vector<float> scratch(bt_nf4_scratch_floats(K > N ? K : N));
    DBuf<bt_bf16> dX(M * K), dYd(M * N), dYo(M * N), dW(N * K), ddX(M * K);
    up_bf16(dX, X);
    up_bf16(dYd, dY);
    for (float beta : {0.0f, 1.0f}) {
        std::vector<float> ref = Y0;
        bt_nf4_linear_fwd(ref.data(), X.data(), &w.q, M, K, N, beta, scratch.data());
        up_bf16(dYo, Y0);
        BTOK(bt_cuda_nf4_linear_fwd(g_cublas, g_stream, dYo.p, dX.p, &w.d, M, K, N, beta, dW.p));
        CU(cudaStreamSynchronize(g_stream));
        auto got = down_bf16(dYo.p, (size_t)M * N);
        check(beta == 0 ? "nf4 fwd beta=0" : "nf4 fwd beta=1", got.data(), ref.data(), ref.size(),
              1e-2, 2e-2);
    }
    std::vector<float> ref((size_t)M * K, 0.0f);
    bt_nf4_linear_bwd_x(ref.data(), dY.data(), &w.q, M, K, N, 0.0f, scratch.data());
    BTOK(bt_cuda_nf4_linear_bwd_x(g_cublas, g_stream, ddX.p, dYd.p, &w.d, M, K, N, 0.0f, dW.p, 1));
    CU(cudaStreamSynchronize(g_stream));
    auto got = down_bf16(ddX.p, (size_t)M * K);
    check("nf4 bwd_x (wbuf reused)", got.data(), ref.data(), ref.size(), 1e-2, 2e-2);
}

/* All transpose combinations, odd sizes, fp32 and bf16 outputs, alpha/beta. fp32 out: tol 1e-5
 * (same inputs, fp32 accumulation); bf16 out: 1e-2. */
static void test_gemm(void)
{
    const int M = 33, N = 17, K = 40;
    for (int tA = 0; tA < 2; tA++)
        for (int tB = 0; tB < 2; tB++)
            for (int f32 = 0; f32 < 2; f32++) {
                auto A = randv((size_t)M * K, 1.0f), B = randv((size_t)K * N, 1.0f);
                auto C0 = randv((size_t)M * N, 1.0f);
                const int lda = tA ? M : K, ldb = tB ? K : N;
                std::vector<float> ref = C0;
                ref_gemm(tA, tB, M, N, K, 0.5f, A.data(), lda, B.data(), ldb, 0.75f, ref.data(), N);
                DBuf<bt_bf16> dA(A.size()), dB(B.size()), dC16(C0.size());
                DBuf<float> dC32(C0.size());
                up_bf16(dA, A);
                up_bf16(dB, B);
                void *C = f32 ? (void *)dC32.p : (void *)dC16.p;
                if (f32)
                    up(dC32, C0);
                else
                    up_bf16(dC16, C0);
                BTOK(bt_cuda_gemm(g_cublas, g_stream, tA, tB, M, N, K, 0.5f, dA.p, lda, dB.p, ldb,
                                  0.75f, C, N, f32));
                CU(cudaStreamSynchronize(g_stream));
                auto got = f32 ? down(dC32.p, C0.size()) : down_bf16(dC16.p, C0.size());
                char name[64];
                snprintf(name, sizeof name, "gemm tA=%d tB=%d %s", tA, tB, f32 ? "f32" : "bf16");
                check(name, got.data(), ref.data(), ref.size(), f32 ? 1e-5 : 1e-2, f32 ? 1e-5 : 2e-2);
            }
}

/* LoRA forward (Y = base + s XA B^T via beta=1) and backward (dA, dB fp32, dX += dXA A) vs fp32
 * sgemm compositions. XA/dXA are bf16 on the GPU: tol 1e-2 rel_l2, 3e-2 max. */
static void test_lora(void)
{
    const int M = 45, K = 72, N = 40, r = 8;
    const float s = 2.0f;
    auto X = randv((size_t)M * K, 1.0f), A = randv((size_t)r * K, 0.2f), B = randv((size_t)N * r, 0.2f);
    auto Y0 = randv((size_t)M * N, 1.0f), dY = randv((size_t)M * N, 1.0f);
    auto dX0 = randv((size_t)M * K, 1.0f);
    auto dA0 = randv((size_t)r * K, 1.0f), dB0 = randv((size_t)N * r, 1.0f);
    /* reference */
    std::vector<float> XA((size_t)M * r), Y = Y0, dXA((size_t)M * r), dA = dA0, dB = dB0, dX = dX0;
    ref_gemm(0, 1, M, r, K, 1.0f, X.data(), K, A.data(), K, 0.0f, XA.data(), r);
    ref_gemm(0, 1, M, N, r, s, XA.data(), r, B.data(), r, 1.0f, Y.data(), N);
    ref_gemm(1, 0, N, r, M, s, dY.data(), N, XA.data(), r, 1.0f, dB.data(), r);
    ref_gemm(0, 0, M, r, N, s, dY.data(), N, B.data(), r, 0.0f, dXA.data(), r);
    ref_gemm(1, 0, r, K, M, 1.0f, dXA.data(), r, X.data(), K, 1.0f, dA.data(), K);
    ref_gemm(0, 0, M, K, r, 1.0f, dXA.data(), r, A.data(), K, 1.0f, dX.data(), K);
    /* gpu */
    DBuf<bt_bf16> gX(X.size()), gA(A.size()), gB(B.size()), gY(Y0.size()), gXA(XA.size()),
        gdY(dY.size()), gdXA(XA.size()), gdX(dX0.size());
    DBuf<float> gdA(dA0.size()), gdB(dB0.size()), gA32(A.size());
    up_bf16(gX, X);
    up(gA32, A); /* exercise the fp32 master -> bf16 copy path */
    BTOK(bt_cuda_f32_to_bf16(gA.p, gA32.p, (int64_t)A.size(), g_stream));
    up_bf16(gB, B);
    up_bf16(gY, Y0);
    up_bf16(gdY, dY);
    up_bf16(gdX, dX0);
    up(gdA, dA0);
    up(gdB, dB0);
    BTOK(bt_cuda_lora_fwd(g_cublas, g_stream, gY.p, gXA.p, gX.p, gA.p, gB.p, M, K, N, r, s));
    BTOK(bt_cuda_lora_bwd(g_cublas, g_stream, gdA.p, gdB.p, gdX.p, gdXA.p, gdY.p, gX.p, gXA.p, gA.p,
                          gB.p, M, K, N, r, s, 1.0f));
    CU(cudaStreamSynchronize(g_stream));
    auto y = down_bf16(gY.p, Y.size());
    check("lora fwd Y", y.data(), Y.data(), Y.size(), 1e-2, 3e-2);
    auto xa = down_bf16(gXA.p, XA.size());
    check("lora fwd XA", xa.data(), XA.data(), XA.size(), 1e-2, 2e-2);
    auto da = down(gdA.p, dA.size()), db = down(gdB.p, dB.size());
    check("lora dA (accumulated)", da.data(), dA.data(), dA.size(), 1e-2, 3e-2);
    check("lora dB (accumulated)", db.data(), dB.data(), dB.size(), 1e-2, 3e-2);
    auto dx = down_bf16(gdX.p, dX.size());
    check("lora dX (+= onto base)", dx.data(), dX.data(), dX.size(), 1e-2, 3e-2);
}

/* RMSNorm fwd/bwd incl. dw; D = 96 (1 chunk), 4096 (2 chunks/thread), 16384 (8), odd M, one row,
 * large magnitudes. y/dx bf16: rel_l2 1e-2 / max 2e-2; rstd 1e-3; dw 1e-2. */
static void test_rmsnorm(void)
{
    const int cases[][2] = {{67, 96}, {1, 4096}, {9, 16384}, {130, 136}};
    const float mags[] = {1.0f, 1000.0f, 0.01f, 5.0f};
    for (int c = 0; c < 4; c++) {
        const int M = cases[c][0], D = cases[c][1];
        auto x = randv((size_t)M * D, mags[c]);
        std::vector<float> w(D);
        for (auto &v : w)
            v = 1.0f + rng_sym(0.5f);
        auto dy = randv((size_t)M * D, 1.0f);
        std::vector<float> y((size_t)M * D), rstd(M), dx((size_t)M * D), dw(D, 0.25f);
        bt_rmsnorm_fwd(y.data(), rstd.data(), x.data(), w.data(), M, D, 1e-5f);
        bt_rmsnorm_bwd(dx.data(), dw.data(), dy.data(), x.data(), w.data(), rstd.data(), M, D);
        DBuf<bt_bf16> gx(x.size()), gy(x.size()), gdy(x.size());
        DBuf<float> gw(D), grstd(M), gdw(D), scr(bt_cuda_rmsnorm_bwd_scratch_floats(M, D));
        up_bf16(gx, x);
        up_bf16(gdy, dy);
        up(gw, w);
        up(gdw, std::vector<float>(D, 0.25f));
        BTOK(bt_cuda_rmsnorm_fwd(gy.p, grstd.p, gx.p, gw.p, M, D, 1e-5f, g_stream));
        /* backward in place (dx aliases dy) */
        BTOK(bt_cuda_rmsnorm_bwd(gdy.p, gdw.p, gdy.p, gx.p, gw.p, grstd.p, M, D, scr.p, g_stream));
        CU(cudaStreamSynchronize(g_stream));
        char name[64];
        auto gyv = down_bf16(gy.p, y.size());
        snprintf(name, sizeof name, "rms y M=%d D=%d", M, D);
        check(name, gyv.data(), y.data(), y.size(), 1e-2, 2e-2);
        auto gr = down(grstd.p, M);
        check("rms rstd", gr.data(), rstd.data(), M, 1e-3, 1e-3);
        auto gdx = down_bf16(gdy.p, dx.size());
        check("rms dx (in place)", gdx.data(), dx.data(), dx.size(), 1e-2, 2e-2);
        auto gdwv = down(gdw.p, D);
        check("rms dw (accumulated)", gdwv.data(), dw.data(), D, 1e-2, 2e-2);
    }
    { /* backward without dw (frozen norm weights): one block per row, M > 512 */
        const int M = 1100, D = 576;
        auto x = randv((size_t)M * D, 2.0f), dy = randv((size_t)M * D, 1.0f);
        std::vector<float> w(D);
        for (auto &v : w)
            v = 1.0f + rng_sym(0.5f);
        std::vector<float> y((size_t)M * D), rstd(M), dx((size_t)M * D);
        bt_rmsnorm_fwd(y.data(), rstd.data(), x.data(), w.data(), M, D, 1e-5f);
        bt_rmsnorm_bwd(dx.data(), nullptr, dy.data(), x.data(), w.data(), rstd.data(), M, D);
        DBuf<bt_bf16> gx(x.size()), gy(x.size()), gdy(x.size()), gdx(x.size());
        DBuf<float> gw(D), grstd(M);
        up_bf16(gx, x);
        up_bf16(gdy, dy);
        up(gw, w);
        BTOK(bt_cuda_rmsnorm_fwd(gy.p, grstd.p, gx.p, gw.p, M, D, 1e-5f, g_stream));
        BTOK(bt_cuda_rmsnorm_bwd(gdx.p, nullptr, gdy.p, gx.p, gw.p, grstd.p, M, D, nullptr, g_stream));
        CU(cudaStreamSynchronize(g_stream));
        auto gdxv = down_bf16(gdx.p, dx.size());
        check("rms dx without dw, M=1100", gdxv.data(), dx.data(), dx.size(), 1e-2, 2e-2);
    }
    DBuf<bt_bf16> a(24), b(24);
    DBuf<float> r(3), w(24);
    check_true("rms D%8!=0 -> UNSUPPORTED",
               bt_cuda_rmsnorm_fwd(b.p, r.p, a.p, w.p, 2, 12, 1e-5f, g_stream) == -5);
}

/* RoPE fwd/inverse on a strided buffer (ld > H*D), large positions, pos_scale != 1. bf16 output of
 * the rotation: rel_l2 1e-2, max 1e-2. */
static void test_rope(void)
{
    const int M = 29, H = 3, D = 64;
    const int64_t ld = H * D + 8;
    for (int inv = 0; inv < 2; inv++) {
        auto buf = randv((size_t)M * ld, 2.0f);
        std::vector<int32_t> pos(M);
        for (int m = 0; m < M; m++)
            pos[m] = m == 0 ? 0 : rng_int(20000);
        std::vector<float> x((size_t)M * H * D);
        for (int m = 0; m < M; m++)
            memcpy(&x[(size_t)m * H * D], &buf[(size_t)m * ld], sizeof(float) * H * D);
        if (inv)
            bt_rope_bwd(x.data(), pos.data(), M, H, D, 500000.0f, 0.25f);
        else
            bt_rope_fwd(x.data(), pos.data(), M, H, D, 500000.0f, 0.25f);
        DBuf<bt_bf16> g(buf.size());
        DBuf<int32_t> gp(M);
        up_bf16(g, buf);
        up(gp, pos);
        BTOK(bt_cuda_rope(g.p, gp.p, M, H, D, ld, 500000.0f, 0.25f, inv, g_stream));
        CU(cudaStreamSynchronize(g_stream));
        auto got = down_bf16(g.p, buf.size());
        std::vector<float> gx((size_t)M * H * D);
        bool pad_ok = true;
        for (int m = 0; m < M; m++) {
            memcpy(&gx[(size_t)m * H * D], &got[(size_t)m * ld], sizeof(float) * H * D);
            for (int64_t j = H * D; j < ld; j++)
                pad_ok &= got[(size_t)m * ld + j] == buf[(size_t)m * ld + j];
        }
        check(inv ? "rope inverse" : "rope forward", gx.data(), x.data(), x.size(), 1e-2, 1e-2);
        check_true("rope leaves row padding alone", pad_ok);
    }
}

/* RoPE with the Llama 3.1 "llama3" inverse-frequency table (bt_rope_inv_freq, factor 8, low 1,
 * high 4, original_max_position_embeddings 8192; rope_theta 500000), positions up to 130000, against
 * bt_rope_fwd_freq / bt_rope_bwd_freq; plus the default table must equal bt_cuda_rope(theta). Same
 * bf16 tolerance as test_rope. */
static void test_rope_freq(void)
{
    const int M = 37, H = 2, D = 128;
    std::vector<float> invf(D / 2);
    BTOK(bt_rope_inv_freq(invf.data(), D, 500000.0f, "llama3", 8.0f, 1.0f, 4.0f, 8192));
    DBuf<float> gf(D / 2);
    up(gf, invf);
    for (int inv = 0; inv < 2; inv++) {
        auto x = randv((size_t)M * H * D, 2.0f);
        std::vector<int32_t> pos(M);
        for (int m = 0; m < M; m++)
            pos[m] = m == 0 ? 0 : rng_int(130000);
        DBuf<bt_bf16> g(x.size());
        DBuf<int32_t> gp(M);
        up_bf16(g, x);
        up(gp, pos);
        if (inv)
            bt_rope_bwd_freq(x.data(), pos.data(), M, H, D, invf.data(), 1.0f);
        else
            bt_rope_fwd_freq(x.data(), pos.data(), M, H, D, invf.data(), 1.0f);
        BTOK(bt_cuda_rope_freq(g.p, gp.p, M, H, D, (int64_t)H * D, gf.p, 1.0f, inv, g_stream));
        CU(cudaStreamSynchronize(g_stream));
        auto got = down_bf16(g.p, x.size());
        check(inv ? "rope llama3 table inverse" : "rope llama3 table forward", got.data(), x.data(),
              x.size(), 1e-2, 1e-2);
    }
    DBuf<bt_bf16> b(4);
    DBuf<int32_t> p(1);
    check_true("rope_freq NULL table -> INVALID",
               bt_cuda_rope_freq(b.p, p.p, 1, 1, 4, 4, nullptr, 1.0f, 0, g_stream) == -6);
}

/* SwiGLU fwd/bwd; n divisible by 8 (vector path) and odd n (scalar path); gates up to +-30. */
static void test_swiglu(void)
{
    for (int64_t n : {4096, 1001, 1}) {
        auto g = randv(n, 30.0f), u = randv(n, 3.0f), dh = randv(n, 1.0f);
        std::vector<float> h(n), dg(n), du(n);
        bt_swiglu_fwd(h.data(), g.data(), u.data(), n);
        bt_swiglu_bwd(dg.data(), du.data(), dh.data(), g.data(), u.data(), n);
        DBuf<bt_bf16> gg(n), gu(n), gh(n), gdh(n), gdg(n), gdu(n);
        up_bf16(gg, g);
        up_bf16(gu, u);
        up_bf16(gdh, dh);
        BTOK(bt_cuda_swiglu_fwd(gh.p, gg.p, gu.p, n, g_stream));
        BTOK(bt_cuda_swiglu_bwd(gdg.p, gdu.p, gdh.p, gg.p, gu.p, n, g_stream));
        CU(cudaStreamSynchronize(g_stream));
        auto a = down_bf16(gh.p, n), b = down_bf16(gdg.p, n), c = down_bf16(gdu.p, n);
        check("swiglu h", a.data(), h.data(), n, 1e-2, 1e-2);
        check("swiglu dgate", b.data(), dg.data(), n, 1e-2, 1e-2);
        check("swiglu dup", c.data(), du.data(), n, 1e-2, 1e-2);
    }
}

/* GeGLU with the tanh GELU (Gemma 3) vs bt_geglu_fwd / _bwd: vectorised (n % 8 == 0), scalar
 * tail and one element; gates up to |30| (both tails of the GELU). bf16 outputs: rel_l2 1e-2,
 * max 1e-2; backward in place (dg, du alias g, u). */
static void test_geglu(void)
{
    for (int64_t n : {4096, 1001, 1}) {
        auto g = randv(n, 30.0f), u = randv(n, 3.0f), dh = randv(n, 1.0f);
        std::vector<float> h(n), dg(n), du(n);
        bt_geglu_fwd(h.data(), g.data(), u.data(), n);
        bt_geglu_bwd(dg.data(), du.data(), dh.data(), g.data(), u.data(), n);
        DBuf<bt_bf16> gg(n), gu(n), gh(n), gdh(n);
        up_bf16(gg, g);
        up_bf16(gu, u);
        up_bf16(gdh, dh);
        BTOK(bt_cuda_geglu_fwd(gh.p, gg.p, gu.p, n, g_stream));
        BTOK(bt_cuda_geglu_bwd(gg.p, gu.p, gdh.p, gg.p, gu.p, n, g_stream));
        CU(cudaStreamSynchronize(g_stream));
        auto a = down_bf16(gh.p, n), b = down_bf16(gg.p, n), c = down_bf16(gu.p, n);
        check("geglu h", a.data(), h.data(), n, 1e-2, 1e-2);
        check("geglu dgate (in place)", b.data(), dg.data(), n, 1e-2, 1e-2);
        check("geglu dup (in place)", c.data(), du.data(), n, 1e-2, 1e-2);
    }
    check_true("geglu n < 0 -> INVALID", bt_cuda_geglu_fwd(nullptr, nullptr, nullptr, -1, g_stream) == -6);
}

/* Per-head RMSNorm (QK-norm, bt_cuda_head_rmsnorm_*) vs the CPU step's bt_rmsnorm_fwd / _bwd over
 * rows = tokens * heads of head_dim (dw not wanted: frozen weights), head_dim 64 / 128 / 256 and
 * large magnitudes; backward in place (dx aliases dy), as the step runs it on dq / dk. bf16 y and
 * dx: rel_l2 1e-2, max 2e-2; rstd: 1e-3. */
static void test_head_rmsnorm(void)
{
    const int cases[][2] = {{37 * 4, 64}, {9 * 2, 128}, {5 * 8, 256}};
    const float mags[] = {1.0f, 300.0f, 0.02f};
    for (int c = 0; c < 3; c++) {
        const int rows = cases[c][0], D = cases[c][1];
        auto x = randv((size_t)rows * D, mags[c]), dy = randv((size_t)rows * D, 1.0f);
        std::vector<float> w(D);
        for (auto &v : w)
            v = 1.0f + rng_sym(0.5f);
        std::vector<float> y((size_t)rows * D), rstd(rows), dx((size_t)rows * D);
        bt_rmsnorm_fwd(y.data(), rstd.data(), x.data(), w.data(), rows, D, 1e-6f);
        bt_rmsnorm_bwd(dx.data(), nullptr, dy.data(), x.data(), w.data(), rstd.data(), rows, D);
        DBuf<bt_bf16> gx(x.size()), gy(x.size()), gdy(x.size());
        DBuf<float> gw(D), grstd(rows);
        up_bf16(gx, x);
        up_bf16(gdy, dy);
        up(gw, w);
        BTOK(bt_cuda_head_rmsnorm_fwd(gy.p, grstd.p, gx.p, gw.p, rows, D, 1e-6f, g_stream));
        BTOK(bt_cuda_head_rmsnorm_bwd(gdy.p, gdy.p, gx.p, gw.p, grstd.p, rows, D, g_stream));
        CU(cudaStreamSynchronize(g_stream));
        char name[64];
        auto gyv = down_bf16(gy.p, y.size());
        snprintf(name, sizeof name, "qk-norm y rows=%d head_dim=%d", rows, D);
        check(name, gyv.data(), y.data(), y.size(), 1e-2, 2e-2);
        auto gr = down(grstd.p, rows);
        check("qk-norm rstd", gr.data(), rstd.data(), rows, 1e-3, 1e-3);
        auto gdx = down_bf16(gdy.p, dx.size());
        check("qk-norm dx (in place)", gdx.data(), dx.data(), dx.size(), 1e-2, 2e-2);
    }
    DBuf<bt_bf16> a(96), b(96);
    DBuf<float> r(4), w(96);
    check_true("qk-norm head_dim 24 -> UNSUPPORTED",
               bt_cuda_head_rmsnorm_fwd(b.p, r.p, a.p, w.p, 4, 24, 1e-6f, g_stream) == -5);
    check_true("qk-norm NULL w -> INVALID",
               bt_cuda_head_rmsnorm_bwd(b.p, b.p, a.p, nullptr, r.p, 1, 64, g_stream) == -6);
}

/* In-place bf16 scale (Gemma's embedding scale sqrt(d_model)) vs bt_scale: rel_l2 1e-2, max 1e-2. */
static void test_scale_bf16(void)
{
    const int64_t n = 1003;
    const float sc = sqrtf(640.0f);
    auto x = randv(n, 2.0f);
    std::vector<float> ref = x;
    bt_scale(ref.data(), n, sc);
    DBuf<bt_bf16> gx(n);
    up_bf16(gx, x);
    BTOK(bt_cuda_scale_bf16(gx.p, n, sc, g_stream));
    CU(cudaStreamSynchronize(g_stream));
    auto g = down_bf16(gx.p, n);
    check("scale x sqrt(640)", g.data(), ref.data(), n, 1e-2, 1e-2);
}

/* Embedding gather (exact) and scatter-add backward (fp32 atomics; tol 1e-5) with repeated and
 * out-of-range ids. */
static void test_embedding(void)
{
    const int V = 50, D = 40, M = 33;
    auto table = randv((size_t)V * D, 1.0f), dout = randv((size_t)M * D, 1.0f);
    std::vector<int32_t> ids(M);
    for (int m = 0; m < M; m++)
        ids[m] = rng_int(7); /* many repeats */
    ids[3] = -100;
    ids[5] = V;
    std::vector<float> ref((size_t)M * D, 0.0f), dref((size_t)V * D, 0.5f);
    for (int m = 0; m < M; m++)
        if (ids[m] >= 0 && ids[m] < V)
            for (int d = 0; d < D; d++) {
                ref[(size_t)m * D + d] = table[(size_t)ids[m] * D + d];
                dref[(size_t)ids[m] * D + d] += dout[(size_t)m * D + d];
            }
    DBuf<bt_bf16> gt(table.size()), go(ref.size()), gdo(dout.size());
    DBuf<int32_t> gi(M);
    DBuf<float> gdt(dref.size());
    up_bf16(gt, table);
    up_bf16(gdo, dout);
    up(gi, ids);
    up(gdt, std::vector<float>(dref.size(), 0.5f));
    BTOK(bt_cuda_embedding_fwd(go.p, gt.p, gi.p, M, D, V, g_stream));
    BTOK(bt_cuda_embedding_bwd(gdt.p, gdo.p, gi.p, M, D, V, g_stream));
    CU(cudaStreamSynchronize(g_stream));
    auto o = down_bf16(go.p, ref.size());
    check_exact("embedding fwd", o.data(), ref.data(), ref.size());
    auto dt = down(gdt.p, dref.size());
    check("embedding bwd", dt.data(), dref.data(), dref.size(), 1e-6, 1e-5);
}

/* Multi-tensor AdamW (one launch, 3 tensors incl. n = 1 and a size not a multiple of the block)
 * for 3 consecutive steps vs bt_adamw_step: same operation order and roundings, so bit-exact is
 * expected; the check allows 2e-7 relative (1-2 ulp) in case libm pow differs. p16 = bf16(p). */
static void test_adamw(void)
{
    const int64_t ns[3] = {1, 1000, 70001};
    const float wds[3] = {0.0f, 0.01f, 0.1f};
    std::vector<float> P[3], G[3], Mm[3], Vv[3];
    DBuf<float> gp[3], gg[3], gm[3], gv[3];
    DBuf<bt_bf16> gp16[3];
    std::vector<bt_cuda_adamw_tensor> desc(3);
    for (int t = 0; t < 3; t++) {
        P[t] = randv(ns[t], 1.0f);
        Mm[t].assign(ns[t], 0.0f);
        Vv[t].assign(ns[t], 0.0f);
        gp[t].alloc(ns[t]);
        gg[t].alloc(ns[t]);
        gm[t].alloc(ns[t]);
        gv[t].alloc(ns[t]);
        gp16[t].alloc(ns[t]);
        up(gp[t], P[t]);
        up(gm[t], Mm[t]);
        up(gv[t], Vv[t]);
        desc[t] = {gp[t].p, gg[t].p, gm[t].p, gv[t].p, gp16[t].p, ns[t], wds[t]};
    }
    DBuf<bt_cuda_adamw_tensor> gdesc(3);
    up(gdesc, desc);
    for (int step = 1; step <= 3; step++) {
        for (int t = 0; t < 3; t++) {
            G[t].resize(ns[t]);
            for (auto &x : G[t])
                x = rng_normal() * (step == 2 ? 1e3f : 1e-3f); /* large and tiny gradients */
            up(gg[t], G[t]);
            bt_adamw_step(P[t].data(), G[t].data(), Mm[t].data(), Vv[t].data(), ns[t], 1e-3f, 0.9f,
                          0.999f, 1e-8f, wds[t], step);
        }
        BTOK(bt_cuda_adamw_multi(gdesc.p, 3, 70001, 1e-3f, 0.9f, 0.999f, 1e-8f, 1.0f, step, g_stream));
    }
    CU(cudaStreamSynchronize(g_stream));
    for (int t = 0; t < 3; t++) {
        auto p = down(gp[t].p, ns[t]), m = down(gm[t].p, ns[t]), v = down(gv[t].p, ns[t]);
        auto p16 = down_bf16(gp16[t].p, ns[t]);
        char name[64];
        snprintf(name, sizeof name, "adamw p (n=%lld)", (long long)ns[t]);
        check(name, p.data(), P[t].data(), ns[t], 2e-7, 2e-7);
        check("adamw m", m.data(), Mm[t].data(), ns[t], 2e-7, 2e-7);
        check("adamw v", v.data(), Vv[t].data(), ns[t], 2e-7, 2e-7);
        std::vector<float> pr(ns[t]);
        for (int64_t i = 0; i < ns[t]; i++)
            pr[i] = bf16_round(p[i]);
        check_exact("adamw p16 == bf16(p)", p16.data(), pr.data(), ns[t]);
    }
}

/* Deterministic sum of squares vs bt_sumsq (double; rel 1e-12) and run-to-run bit equality. */
static void test_sumsq(void)
{
    const int64_t n = 100003;
    auto x = randv(n, 10.0f);
    const double ref = bt_sumsq(x.data(), n);
    DBuf<float> gx(n);
    DBuf<double> out(1), part(bt_cuda_sumsq_scratch(n));
    up(gx, x);
    BTOK(bt_cuda_sumsq(out.p, gx.p, n, part.p, 0, g_stream));
    const double a = down(out.p, 1)[0];
    BTOK(bt_cuda_sumsq(out.p, gx.p, n, part.p, 0, g_stream));
    const double b = down(out.p, 1)[0];
    printf("    sumsq gpu %.17g ref %.17g\n", a, ref);
    check_true("sumsq rel err <= 1e-12", fabs(a - ref) <= 1e-12 * fabs(ref));
    check_true("sumsq deterministic", a == b);
}

/* Fused linear + CE: loss sum (rel 1e-4: fp32 logits from identical bf16 inputs), count (exact),
 * per-row losses (abs 2e-3 + 1e-4 rel), dX (bf16 dlogits: rel_l2 1e-2, max 3e-2), dW (fp32
 * accumulate of bf16 dlogits: rel_l2 1e-2). Chunk size that does not divide M, ignored (-100) and
 * out-of-range targets, a chunk of 1 row, large logits (|logit| ~ 40). */
static void test_linear_ce(void)
{
    const int M = 45, D = 64, V = 1000;
    for (int variant = 0; variant < 2; variant++) {
        const int chunk = variant == 0 ? 16 : 1;
        const float xs = variant == 0 ? 1.0f : 8.0f;
        auto X = randv((size_t)M * D, xs), W = randv((size_t)V * D, 0.6f);
        std::vector<int32_t> tg(M);
        for (int m = 0; m < M; m++)
            tg[m] = rng_int(V);
        tg[0] = -100;
        tg[7] = -100;
        tg[12] = V + 3;
        tg[44] = V - 1;
        const float gs = 1.0f / 40.0f;
        std::vector<float> ws(bt_linear_ce_workspace_floats(chunk, V)), dX((size_t)M * D);
        int nvalid = 0;
        const double loss = bt_linear_ce(dX.data(), &nvalid, X.data(), W.data(), tg.data(), M, D, V,
                                         chunk, gs, ws.data());
        /* reference per-row losses and dW = dlogits^T X (fp64 host loop) */
        std::vector<float> rowl(M, 0.0f), dW((size_t)V * D, 0.0f);
        std::vector<double> lg(V);
        for (int m = 0; m < M; m++) {
            if (tg[m] < 0 || tg[m] >= V)
                continue;
            double mx = -1e300, s = 0;
            for (int v = 0; v < V; v++) {
                double a = 0;
                for (int d = 0; d < D; d++)
                    a += (double)X[(size_t)m * D + d] * W[(size_t)v * D + d];
                lg[v] = a;
                mx = fmax(mx, a);
            }
            for (int v = 0; v < V; v++)
                s += exp(lg[v] - mx);
            rowl[m] = (float)(mx + log(s) - lg[tg[m]]);
            for (int v = 0; v < V; v++) {
                double p = exp(lg[v] - mx) / s * gs - (v == tg[m] ? gs : 0.0);
                for (int d = 0; d < D; d++)
                    dW[(size_t)v * D + d] += (float)(p * X[(size_t)m * D + d]);
            }
        }
        DBuf<bt_bf16> gX(X.size()), gW(W.size()), gdX(dX.size());
        DBuf<int32_t> gt(M);
        DBuf<float> grow(M), gdW(dW.size());
        DBuf<unsigned char> gws(bt_cuda_linear_ce_workspace_bytes(chunk, V));
        DBuf<double> gsum(1);
        DBuf<int> gcnt(1);
        up_bf16(gX, X);
        up_bf16(gW, W);
        up(gt, tg);
        CU(cudaMemset(gdW.p, 0, dW.size() * sizeof(float)));
        BTOK(bt_cuda_linear_ce(g_cublas, g_stream, grow.p, gdX.p, gdW.p, gX.p, gW.p, gt.p, M, D, V,
                               chunk, gs, gws.p));
        BTOK(bt_cuda_ce_reduce(gsum.p, gcnt.p, grow.p, gt.p, M, V, g_stream));
        CU(cudaStreamSynchronize(g_stream));
        const double gl = down(gsum.p, 1)[0];
        const int gc = down(gcnt.p, 1)[0];
        printf("    chunk=%d loss gpu %.9g cpu %.9g, n_valid gpu %d cpu %d\n", chunk, gl, loss, gc,
               nvalid);
        check_true("ce loss sum rel <= 1e-4", fabs(gl - loss) <= 1e-4 * fabs(loss));
        check_true("ce n_valid", gc == nvalid);
        auto rl = down(grow.p, M);
        check("ce row losses", rl.data(), rowl.data(), M, 1e-4, 1e-4);
        auto gdx = down_bf16(gdX.p, dX.size());
        check("ce dX", gdx.data(), dX.data(), dX.size(), 1e-2, 3e-2);
        auto gdw = down(gdW.p, dW.size());
        check("ce dW", gdw.data(), dW.data(), dW.size(), 1e-2, 3e-2);
    }
}

int main(int argc, char **argv)
{
    const char *prog = "test_kernels_gpu";
    const int init = gt_init(prog, argc, argv);
    if (init >= 0)
        return init;
    CU(cudaStreamCreate(&g_stream));
    if (cublasCreate(&g_cublas) != CUBLAS_STATUS_SUCCESS) {
        printf("%s: cublasCreate failed\n", prog);
        return 2;
    }
    GT_CASE(test_nf4_dequant);
    GT_CASE(test_nf4_linear);
    GT_CASE(test_gemm);
    GT_CASE(test_lora);
    GT_CASE(test_rmsnorm);
    GT_CASE(test_rope);
    GT_CASE(test_rope_freq);
    GT_CASE(test_swiglu);
    GT_CASE(test_geglu);
    GT_CASE(test_head_rmsnorm);
    GT_CASE(test_scale_bf16);
    GT_CASE(test_embedding);
    GT_CASE(test_adamw);
    GT_CASE(test_sumsq);
    GT_CASE(test_linear_ce);
    const int rc = gt_run(prog);
    cublasDestroy(g_cublas);
    cudaStreamDestroy(g_stream);
    return rc;
}
