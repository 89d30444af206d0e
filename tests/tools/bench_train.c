/* bench_train: CPU training-path benchmarks, measured side by side in one run.
 *
 *   bench_train MODEL.gguf [--tokens M] [--reps N] [--ce-only]
 *
 * Prints markdown tables:
 *  1. fused chunked linear + cross-entropy (bt_linear_ce, 256-row chunks) against the unfused
 *     path that materialises the full [M x V] logits (bt_linear_fwd, then softmax/CE/gradient,
 *     then bt_linear_bwd_x): time, the memory each allocates for logits/workspace and the
 *     measured peak-RSS rise, at SmolLM2-135M's shape (hidden 576, vocab 49,152; M tokens) and
 *     at Gemma 3 270M's (hidden 640, vocab 262,144; the same M) — random weights of each shape,
 *     no model is loaded for this part; --ce-only stops after these two tables;
 *  2. NF4 (double-quantised) and GGUF Q4_1 (ggml blocks, the GGUF-native base) base linears
 *     against the fp32 linear on the same shape;
 *  3. one full training micro-batch (forward + backward, LoRA r=16 on all seven projections) of
 *     SmolLM2-135M on a packed batch of M tokens (4 documents) with the base held three ways:
 *     the GGUF's own Q4_1 blocks (base_dtype gguf), NF4 (nf4) and fp32 (fp32): tokens/s and the
 *     resident size of the model. The three are measured in two interleaved rounds (gguf, nf4,
 *     fp32, then fp32, nf4, gguf; one warm-up step per model load) so that a change in the
 *     machine's load hits them alike; the step time is the median over both rounds.
 * Timings are wall-clock medians of N repetitions on this machine's cores; only the ratios carry
 * over to other machines. Targets of the GGUF-native base (issue 13): step time <= 1.2x NF4's,
 * model memory <= 0.35x fp32's. */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "common/gguf.h"
#include "common/quant.h"
#include "kernels/kernels.h"
#include "trainer/config.h"
#include "trainer/model/lora.h"
#include "trainer/model/model.h"
#include "trainer/loop/step.h"
#include "trainer/loop/train.h"

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}
static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static float frand(void)
{
    g_rng ^= g_rng << 13; g_rng ^= g_rng >> 7; g_rng ^= g_rng << 17;
    return (float)((g_rng >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f;
}

/* The unfused reference: full logits, then per-row softmax CE and its gradient, then dX. */
static double unfused_ce(float *dX, float *logits, const float *X, const float *W, const int32_t *t,
                         int M, int D, int V)
{
    bt_linear_fwd(logits, X, W, M, D, V, 0.0f);
    double loss = 0;
    int nv = 0;
    for (int m = 0; m < M; m++) {
        float *row = logits + (size_t)m * V;
        float mx = row[0];
        for (int v = 1; v < V; v++) mx = row[v] > mx ? row[v] : mx;
        double s = 0;
        for (int v = 0; v < V; v++) s += exp((double)(row[v] - mx));
        double lse = mx + log(s);
        if (t[m] >= 0) { loss += lse - row[t[m]]; nv++; }
        for (int v = 0; v < V; v++) row[v] = t[m] >= 0 ? (float)exp(row[v] - lse) : 0.0f;
        if (t[m] >= 0) row[t[m]] -= 1.0f;
    }
    float scale = nv ? 1.0f / (float)nv : 0.0f;
    bt_scale(logits, (int64_t)M * V, scale);
    bt_linear_bwd_x(dX, logits, W, M, D, V, 0.0f);
    return loss;
}

/* Load model_path with base_dtype, run 1 + reps forward+backward steps of M tokens, append the
 * reps' times (s) to t[*nt], set *model_mib (bt_model_bytes). */
static void train_step_times(const char *model_path, int base_dtype, int M, int reps,
                             double *model_mib, double *t, int *nt)
{
    bt_model m;
    bt_model_load_opts o = {.base_dtype = base_dtype, .keep_gguf_qk_order = 0};
    if (bt_model_load_gguf(&m, model_path, &o) != 0) {
        fprintf(stderr, "bench_train: %s\n", bt_last_error());
        exit(1);
    }
    *model_mib = (double)bt_model_bytes(&m) / (1024.0 * 1024.0);
    bt_lora lo;
    if (bt_lora_init(&lo, &m, 16, 32.0, 0.0, (1u << BT_MOD_N) - 1, 0, 1234) != 0) exit(1);
    bt_step_ctx *ctx;
    if (bt_step_ctx_new(&ctx, &m, &lo, M, 0) != 0) exit(1);
    int32_t *ids = malloc(sizeof(int32_t) * M), *lab = malloc(sizeof(int32_t) * M);
    int32_t *pos = malloc(sizeof(int32_t) * M), cu[6];
    int doc = M / 4;
    for (int i = 0; i < M; i++) {
        frand();
        ids[i] = 100 + (int32_t)((g_rng >> 20) % 40000);
        pos[i] = i % doc;
        lab[i] = pos[i] == 0 ? -100 : ids[i];
    }
    int n_cu = 0;
    for (int d = 0; d <= 4; d++) cu[n_cu++] = d * doc;
    cu[n_cu - 1] = M;
    bt_microbatch mb = {.B = 1, .T = M, .input_ids = ids, .labels = lab, .position_ids = pos,
                        .cu_seqlens = cu, .n_cu = n_cu};
    for (int r = 0; r <= reps; r++) {  /* first run warms up */
        double loss; int nv;
        double t0 = bt_now();
        bt_lora_zero_grad(&lo);
        if (bt_forward_backward(ctx, &m, &lo, &mb, 1, 1.0f / (float)M, 7 + (uint64_t)r, &loss, &nv) != 0) {
            fprintf(stderr, "bench_train: %s\n", bt_last_error());
            exit(1);
        }
        if (r > 0) t[(*nt)++] = bt_now() - t0;
    }
    free(ids); free(lab); free(pos);
    bt_step_ctx_free(ctx);
    bt_lora_free(&lo);
    bt_model_free(&m);
}

/* VmRSS / VmHWM of this process in MiB (/proc/self/status), and a reset of VmHWM to the current
 * RSS (writing "5" to /proc/self/clear_refs, Linux >= 4.0; proc(5)). Returns -1 if unreadable. */
static double proc_status_mib(const char *key)
{
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return -1;
    char line[256];
    double v = -1;
    size_t kl = strlen(key);
    while (fgets(line, sizeof line, f))
        if (strncmp(line, key, kl) == 0 && line[kl] == ':') { v = atof(line + kl + 1) / 1024.0; break; }
    fclose(f);
    return v;
}
static int reset_peak_rss(void)
{
    FILE *f = fopen("/proc/self/clear_refs", "w");
    if (!f) return -1;
    int ok = fputs("5", f) >= 0;
    return (fclose(f) == 0 && ok) ? 0 : -1;
}

/* One fused-vs-unfused linear + cross-entropy comparison at M tokens, hidden D, vocabulary V
 * (random X [M, D] in [-1, 1), W [V, D] in [-0.05, 0.05), every 7th target -100), printed as a
 * markdown table: median wall time of `reps` runs after one warm-up (the two paths alternate in
 * each round so that load changes hit both), the memory each path allocates for logits or
 * workspace, and the measured peak-RSS rise of the warm-up run (VmHWM after the run minus VmRSS
 * before, with VmHWM reset first; each path allocates, runs and frees its own buffer inside). */
static void bench_ce(int M, int D, int V, int chunk, int reps, const char *model)
{
    float *X = bt_aligned_alloc(sizeof(float) * (size_t)M * D);
    float *W = bt_aligned_alloc(sizeof(float) * (size_t)V * D);
    float *dX1 = bt_aligned_alloc(sizeof(float) * (size_t)M * D);
    float *dX2 = bt_aligned_alloc(sizeof(float) * (size_t)M * D);
    int32_t *tg = malloc(sizeof(int32_t) * M);
    if (!X || !W || !dX1 || !dX2 || !tg) exit(1);
    for (size_t i = 0; i < (size_t)M * D; i++) X[i] = frand();
    for (size_t i = 0; i < (size_t)V * D; i++) W[i] = 0.05f * frand();
    for (int i = 0; i < M; i++) {
        frand();
        tg[i] = (i % 7 == 0) ? -100 : (int32_t)((g_rng >> 17) % V);
    }
    size_t ws_f = bt_linear_ce_workspace_floats(chunk, V);
    double tf[16], tu[16], lf = 0, lu = 0, peak_f = -1, peak_u = -1;
    int nvf = 0;
    for (int r = 0; r <= reps && r < 15; r++) {
        int measure = r == 0 && reset_peak_rss() == 0;
        double rss0 = proc_status_mib("VmRSS");
        double t0 = bt_now();
        float *ws = bt_aligned_alloc(sizeof(float) * ws_f);
        if (!ws) exit(1);
        lf = bt_linear_ce(dX1, &nvf, X, W, tg, M, D, V, chunk, 1.0f, ws);
        free(ws);
        tf[r] = bt_now() - t0;
        if (measure) peak_f = proc_status_mib("VmHWM") - rss0;
        measure = r == 0 && reset_peak_rss() == 0;
        rss0 = proc_status_mib("VmRSS");
        t0 = bt_now();
        float *logits = bt_aligned_alloc(sizeof(float) * (size_t)M * V);
        if (!logits) exit(1);
        lu = unfused_ce(dX2, logits, X, W, tg, M, D, V);
        free(logits);
        tu[r] = bt_now() - t0;
        if (measure) peak_u = proc_status_mib("VmHWM") - rss0;
    }
    int n = reps < 15 ? reps : 15;
    double mf = median(tf + 1, n), mu = median(tu + 1, n);
    double maxdiff = 0;
    for (size_t i = 0; i < (size_t)M * D; i++) {
        double d = fabs((double)dX1[i] / (nvf ? nvf : 1) - (double)dX2[i]);
        maxdiff = d > maxdiff ? d : maxdiff;
    }
    printf("### Fused linear + cross-entropy, %s shape (M=%d tokens, hidden %d, vocab %d; "
           "median of %d)\n\n", model, M, D, V, n);
    printf("| path | time (ms) | logits/workspace memory (MiB) | measured peak RSS rise (MiB) | loss sum |\n"
           "|---|---|---|---|---|\n");
    printf("| unfused: full [M x V] logits, softmax, dX | %.0f | %.1f | %.0f | %.4f |\n", mu * 1e3,
           (double)M * V * 4 / 1048576.0, peak_u, lu);
    printf("| fused chunked (bt_linear_ce, %d-row chunks) | %.0f | %.1f | %.0f | %.4f |\n", chunk,
           mf * 1e3, (double)ws_f * 4 / 1048576.0, peak_f, lf);
    printf("\nfused/unfused: time %.2fx, memory %.3fx (measured peak rise %.3fx); max |dX difference| "
           "%.2e\n\n", mf / mu, (double)ws_f / ((double)M * V),
           peak_u > 0 ? peak_f / peak_u : 0.0, maxdiff);
    fflush(stdout);
    free(X); free(W); free(dX1); free(dX2);
    free(tg);
}

int main(int argc, char **argv)
{
    bt_openblas_env_reexec(argv);
    static const struct option lopts[] = {{"tokens", required_argument, NULL, 'M'},
                                       {"reps", required_argument, NULL, 'r'},
                                       {"ce-only", no_argument, NULL, 'c'},
                                       {"help", no_argument, NULL, 'h'},
                                       {NULL, 0, NULL, 0}};
    static const char usage[] =
        "usage: bench_train MODEL.gguf [--tokens M (>= 64)] [--reps N (>= 1)]\n"
        "         [--ce-only (only the two linear + cross-entropy tables)]\n";
    int M = 2048, reps = 3, ce_only = 0, c;
    while ((c = getopt_long(argc, argv, "", lopts, NULL)) != -1) {
        switch (c) {
        case 'M': M = atoi(optarg); break;
        case 'r': reps = atoi(optarg); break;
        case 'c': ce_only = 1; break;
        case 'h': fputs(usage, stdout); return 0;
        default: fputs(usage, stderr); return 2;
        }
    }
    if (argc - optind != 1 || M < 64 || reps < 1) {
        fputs(usage, stderr);
        return 2;
    }
    const char *model = argv[optind];
    const int D = 576, V = 49152, F = 1536, chunk = 256;

    /* 1. fused vs unfused linear + CE: SmolLM2's vocabulary, then Gemma 3 270M's */
    bench_ce(M, D, V, chunk, reps, "SmolLM2-135M");
    bench_ce(M, 640, 262144, chunk, reps, "Gemma 3 270M");
    if (ce_only) return 0;
    const int n = reps < 15 ? reps : 15;
    float *X = bt_aligned_alloc(sizeof(float) * (size_t)M * D);
    if (!X) return 1;
    for (size_t i = 0; i < (size_t)M * D; i++) X[i] = frand();

    /* 2. NF4 and GGUF Q4_1 vs fp32 base linear */
    float *Wd = bt_aligned_alloc(sizeof(float) * (size_t)F * D);
    float *Y = bt_aligned_alloc(sizeof(float) * (size_t)M * F);
    for (size_t i = 0; i < (size_t)F * D; i++) Wd[i] = 0.05f * frand();
    bt_nf4 q;
    if (bt_nf4_quantize(&q, Wd, F, D) != 0) return 1;
    const size_t q41b = bt_ggml_row_size(BT_GGML_Q4_1, D) * (size_t)F;
    uint8_t *q41 = malloc(q41b);
    bt_ggml_mat g;
    if (!q41 || bt_ggml_quantize(BT_GGML_Q4_1, Wd, q41, (int64_t)F * D) != 0 ||
        bt_ggml_mat_init(&g, BT_GGML_Q4_1, F, D, q41, NULL) != 0)
        return 1;
    free(q41);
    float *scr = bt_aligned_alloc(sizeof(float) * bt_nf4_scratch_floats(D));
    double t32[16], t4[16], tq[16];
    for (int r = 0; r <= n; r++) {
        double t0 = bt_now();
        bt_linear_fwd(Y, X, Wd, M, D, F, 0.0f);
        t32[r] = bt_now() - t0;
        t0 = bt_now();
        bt_nf4_linear_fwd(Y, X, &q, M, D, F, 0.0f, scr);
        t4[r] = bt_now() - t0;
        t0 = bt_now();
        bt_ggml_linear_fwd(Y, X, &g, M, D, F, 0.0f, scr);
        tq[r] = bt_now() - t0;
    }
    double m32 = median(t32 + 1, n), m4 = median(t4 + 1, n), mg = median(tq + 1, n);
    double fl = 2.0 * M * D * F;
    printf("### Base linear %dx%d -> %d (gate_proj shape)\n\n", M, D, F);
    printf("| weights | bytes | time (ms) | GFLOP/s |\n|---|---|---|---|\n");
    printf("| fp32 | %zu | %.1f | %.0f |\n", (size_t)F * D * 4, m32 * 1e3, fl / m32 * 1e-9);
    size_t nf4b = (size_t)F * D / 2 + (size_t)F * D / 64 + ((size_t)F * D / 64 + 255) / 256 * 4 + 4;
    printf("| NF4 + double-quantised absmax | %zu | %.1f | %.0f |\n", nf4b, m4 * 1e3, fl / m4 * 1e-9);
    printf("| GGUF Q4_1 blocks (tile dequantisation) | %zu | %.1f | %.0f |\n", q41b, mg * 1e3,
           fl / mg * 1e-9);
    printf("\nNF4/fp32: memory %.3fx, time %.2fx; Q4_1/fp32: memory %.3fx, time %.2fx; Q4_1/NF4 time "
           "%.2fx\n\n", (double)nf4b / ((double)F * D * 4), m4 / m32, (double)q41b / ((double)F * D * 4),
           mg / m32, mg / m4);
    bt_nf4_free(&q); bt_ggml_mat_free(&g); free(scr); free(Y); free(Wd); free(X);

    /* 3. whole micro-batch, the three bases in two interleaved rounds */
    enum { NB = 3 };
    const int bases[NB] = {BT_BASE_GGUF, BT_BASE_NF4, BT_BASE_FP32};
    double mib[NB], *ts[NB], med[NB];
    int nts[NB] = {0, 0, 0};
    for (int b = 0; b < NB; b++) ts[b] = malloc(sizeof(double) * (size_t)(2 * reps));
    for (int round = 0; round < 2; round++)
        for (int k = 0; k < NB; k++) {
            const int b = round == 0 ? k : NB - 1 - k;
            train_step_times(model, bases[b], M, reps, &mib[b], ts[b], &nts[b]);
        }
    for (int b = 0; b < NB; b++) med[b] = median(ts[b], nts[b]);
    printf("### SmolLM2-135M training micro-batch (%d tokens, LoRA r=16 on 7 projections, fwd+bwd)\n\n", M);
    printf("Base held three ways, measured in two interleaved rounds (gguf, nf4, fp32; fp32, nf4, gguf), "
           "median of %d steps each.\n\n", 2 * reps);
    printf("| base | model resident (MiB) | step (s) | tokens/s |\n|---|---|---|---|\n");
    printf("| GGUF Q4_1 blocks (base_dtype gguf: the file's own weights) | %.0f | %.2f | %.0f |\n",
           mib[0], med[0], M / med[0]);
    printf("| NF4 (QLoRA: the GGUF re-quantised) | %.0f | %.2f | %.0f |\n", mib[1], med[1], M / med[1]);
    printf("| fp32 (LoRA: the GGUF dequantised) | %.0f | %.2f | %.0f |\n", mib[2], med[2], M / med[2]);
    printf("\nGGUF-native: step time %.2fx NF4's (target <= 1.2x), model memory %.2fx fp32's (target "
           "<= 0.35x), %.2fx NF4's\n", med[0] / med[1], mib[0] / mib[2], mib[0] / mib[1]);
    printf("NF4/fp32: model memory %.2fx, throughput %.2fx; process peak RSS %.0f MiB\n",
           mib[1] / mib[2], med[2] / med[1], bt_peak_rss_mib());
    for (int b = 0; b < NB; b++) free(ts[b]);
    return 0;
}
