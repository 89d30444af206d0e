/* Whole-training-step benchmark of the GPU trainer (trainer/cuda): forward + backward of one
 * micro-batch of B x T tokens (one document per row), clip + AdamW, timed over --steps steps after
 * --warmup; tokens/s and the process's peak device memory (cudaMemGetInfo, sampled after every
 * step; includes the CUDA context). Prints one markdown row, line-buffered,
 *   | trainer | model | B x T | r | ckpt | tokens/s | step ms | peak GiB | card |
 * matching tests/bench/gpu/bench_hf_step.py (card: the device's name, so that rows of two cards
 * are never mixed).
 *   --model PATH              a GGUF / HF directory loaded as the trainer loads it (NF4 base)
 *   --model random:llama2-7b  Llama-2-7B shapes (32 x 4096, ffn 11008, 32 heads, vocab 32000,
 *                             untied) with random NF4 weights generated for the device (no host
 *                             weights); also random:smollm2-135m (SmolLM2-135M shapes: 30 x 576,
 *                             9 heads of 64 over 3 KV heads, ffn 1536, vocab 49152, tied) and
 *                             random:tiny (2 x 256, 4 heads of 64 over 2, ffn 512, vocab 1000: for
 *                             the CPU emulator, tests/py/test_gpu_scripts.py). Bench-only specs.
 *   --B 1 --T 4096 --r 16 --alpha 32 --dropout 0.05 --steps 10 --warmup 2 --ckpt 0|1
 *   --attn wmma|mma --nf4 dequant|fused   kernel choices (config cuda.attention / cuda.base_matmul)
 *   --probe-only              the device check and the one-kernel probe (tests/gpu/gpu_probe.h)
 * Long context (issue 12):
 *   --s2 F          S^2-Attn in training with groups of F x T tokens (0 = full attention)
 *   --offload 0|1   checkpointed layer inputs in pinned host memory (needs --ckpt 1)
 *   --extend L      context_extension (linear) of the model to L >= T tokens first
 *   --max-T 1       instead of timing: double T from --T until a step no longer fits on the device
 *                   (trainer creation or the step fails for memory) or T would pass the cap, and
 *                   print the longest T that ran one step next to `trainer estimate`'s prediction
 *                   for the device's memory (bt_estimate_max_seq_len with these settings,
 *                   checkpointing on); each T is printed to stderr as it is tried
 *   --max-T-limit N the cap of that search (default 131072: a 1M-token step of a 7B-shaped model
 *                   alone takes minutes)
 * LoRA on all seven linears. Exit 77 without a device (1 under BT_GPU_REQUIRE=1). */
#include <cmath>
#include <getopt.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

extern "C" {
#include "common/bt_common.h"
#include "trainer/config.h"
#include "trainer/estimate.h"
#include "trainer/model/lora.h"
#include "trainer/model/model.h"
#include "trainer/model/rng.h"
}
#include "kernels/cuda/kernels_cuda.h"
#include "tests/gpu/gpu_probe.h"
#include "trainer/cuda/cuda_trainer.h"

static int fake_model(bt_model *m, const char *spec)
{
    memset(m, 0, sizeof *m);
    bt_llama_hparams &hp = m->hp;
    if (!strcmp(spec, "random:llama2-7b")) {
        hp.n_layer = 32; hp.d_model = 4096; hp.n_head = 32; hp.n_kv_head = 32; hp.head_dim = 128;
        hp.d_ff = 11008; hp.vocab = 32000; hp.ctx = 4096; hp.rope_theta = 10000.f; hp.rms_eps = 1e-5f;
        m->tied = 0;
    } else if (!strcmp(spec, "random:smollm2-135m")) {
        hp.n_layer = 30; hp.d_model = 576; hp.n_head = 9; hp.n_kv_head = 3; hp.head_dim = 64;
        hp.d_ff = 1536; hp.vocab = 49152; hp.ctx = 8192; hp.rope_theta = 100000.f; hp.rms_eps = 1e-5f;
        m->tied = 1;
    } else if (!strcmp(spec, "random:tiny")) {
        hp.n_layer = 2; hp.d_model = 256; hp.n_head = 4; hp.n_kv_head = 2; hp.head_dim = 64;
        hp.d_ff = 512; hp.vocab = 1000; hp.ctx = 1024; hp.rope_theta = 10000.f; hp.rms_eps = 1e-5f;
        m->tied = 1;
    } else {
        fprintf(stderr, "unknown model spec %s (random:llama2-7b | random:smollm2-135m | random:tiny)\n", spec);
        return -1;
    }
    m->base_dtype = BT_BASE_NF4;
    m->layers = (bt_layer *)calloc((size_t)hp.n_layer, sizeof(bt_layer));
    const int Dq = hp.n_head * hp.head_dim, Dkv = hp.n_kv_head * hp.head_dim;
    const int shape[BT_MOD_N][2] = {{Dq, hp.d_model}, {Dkv, hp.d_model}, {Dkv, hp.d_model},
                                    {hp.d_model, Dq}, {hp.d_ff, hp.d_model}, {hp.d_ff, hp.d_model},
                                    {hp.d_model, hp.d_ff}};
    for (int l = 0; l < hp.n_layer; l++)
        for (int mod = 0; mod < BT_MOD_N; mod++) {
            m->layers[l].lin[mod].rows = shape[mod][0];
            m->layers[l].lin[mod].cols = shape[mod][1];
            m->layers[l].lin[mod].is_nf4 = 1;
        }
    return bt_model_rope_init(m, nullptr); /* the RoPE table (a context extension scales it) */
}

/* One training step of B x T on a fresh trainer: 0 ok, 1 out of device memory, -1 other error. */
static int try_step(const bt_model *m, bt_lora *lora, const bt_cuda_trainer_opts *o, int B, int T)
{
    bt_cuda_trainer *t = nullptr;
    if (bt_cuda_trainer_new(&t, m, lora, B * T, o) != 0)
        return strstr(bt_last_error(), "out of") ? 1 : -1;
    const int M = B * T;
    std::vector<int32_t> ids(M), pos(M), cu(B + 1);
    for (int i = 0; i < M; i++) {
        ids[i] = (int32_t)((i * 7919u) % (unsigned)m->hp.vocab);
        pos[i] = i % T;
    }
    for (int b = 0; b <= B; b++)
        cu[b] = b * T;
    bt_microbatch mb = {B, T, ids.data(), ids.data(), pos.data(), cu.data(), B + 1};
    int rc = bt_cuda_trainer_zero_grad(t) ||
             bt_cuda_trainer_step(t, &mb, 1, 1.0f / M, 0, nullptr, nullptr);
    int oom = rc && (strstr(bt_last_error(), "out of memory") || strstr(bt_last_error(), "out of"));
    bt_cuda_trainer_free(t);
    cudaGetLastError();
    return rc ? (oom ? 1 : -1) : 0;
}

/* The longest T (doubling from T0) that runs a step, and the estimate's answer for the device. */
static int find_max_T(const char *model, const bt_model *m, bt_lora *lora,
                      const bt_cuda_trainer_opts *o, int B, int T0, int r, double s2, int ext,
                      int limit)
{
    size_t fr = 0, tot = 0;
    cudaMemGetInfo(&fr, &tot);
    int best = 0;
    bool capped = true; /* the search stopped at the cap, not at a step that did not fit */
    for (int T = T0; T <= limit / B; T *= 2) {
        fprintf(stderr, "bench_step_gpu: %s longest-T search: trying T = %d (cap %d) ...\n", model, T, limit);
        bt_model mm = *m; /* the extension is a RoPE table: re-extend per length when asked */
        float *own = mm.inv_freq;
        if (ext) {
            mm.inv_freq = (float *)malloc(sizeof(float) * (size_t)(m->hp.head_dim / 2));
            memcpy(mm.inv_freq, own, sizeof(float) * (size_t)(m->hp.head_dim / 2));
            mm.rope_freqs = nullptr;
            if (T > mm.hp.ctx && bt_model_extend_context(&mm, BT_ROPE_EXT_LINEAR, T) != 0) {
                free(mm.inv_freq);
                break;
            }
        }
        bt_cuda_trainer_opts oo = *o;
        oo.s2_group = s2 > 0 ? 2 * (int)lround(T * s2 / 2) : 0;
        const int rc = try_step(&mm, lora, &oo, B, T);
        if (ext)
            free(mm.inv_freq);
        fprintf(stderr, "bench_step_gpu: %s longest-T search: T = %d: %s\n", model, T,
                rc == 0 ? "fits" : rc == 1 ? "out of memory" : bt_last_error());
        if (rc != 0) {
            capped = false;
            break;
        }
        best = T;
    }
    bt_est_model em;
    memset(&em, 0, sizeof em);
    em.hp = m->hp;
    em.tied = m->tied;
    const bt_dims dims = bt_dims_of(&m->hp);
    em.max_linear = bt_dims_max_linear(&dims);
    bt_train_config c;
    char txt[512];
    snprintf(txt, sizeof txt, "{\"model\": \"m\", \"data\": {\"shards\": [\"d\"], \"micro_batch_size\": "
             "%d}, \"lora\": {\"r\": %d}, \"activation_checkpointing\": %s, \"cuda\": "
             "{\"offload_checkpoints\": %s}}", B, r, o->checkpointing ? "true" : "false",
             o->offload ? "true" : "false");
    int predicted = -1;
    if (bt_config_parse(&c, txt, "bench", nullptr, 0) == 0) {
        predicted = bt_estimate_max_seq_len(&em, &c, BT_EST_CUDA, 1, (double)tot);
        bt_config_free(&c);
    }
    cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, 0);
    printf("| barq (CUDA) longest T | %s | %d x T | %d | %s%s | T = %d runs (%s) | "
           "estimate: %d | %.1f GiB device | %s |\n", model, B, r, o->checkpointing ? "yes" : "no",
           o->offload ? " + offload" : "", best,
           capped ? "the cap: longer not tried" : "the next doubling does not", predicted,
           tot / 1073741824.0, prop.name);
    return best > 0 ? 0 : 1;
}

int main(int argc, char **argv)
{
    const char *model = "random:llama2-7b";
    int B = 1, T = 4096, r = 16, steps = 10, warmup = 2, ckpt = 0, attn_mma = 0, nf4_fused = 0;
    int offload = 0, extend = 0, max_T = 0, max_T_limit = 131072;
    setvbuf(stdout, nullptr, _IOLBF, 0);
    setvbuf(stderr, nullptr, _IOLBF, 0);
    double alpha = 32, dropout = 0.05, s2 = 0;
    bool probe = false;
    static const struct option lopts[] = {
        {"model", required_argument, nullptr, 'm'},  {"B", required_argument, nullptr, 'B'},
        {"T", required_argument, nullptr, 'T'},      {"r", required_argument, nullptr, 'r'},
        {"alpha", required_argument, nullptr, 'a'},  {"dropout", required_argument, nullptr, 'd'},
        {"steps", required_argument, nullptr, 's'},  {"warmup", required_argument, nullptr, 'w'},
        {"ckpt", required_argument, nullptr, 'c'},   {"attn", required_argument, nullptr, 'A'},
        {"nf4", required_argument, nullptr, 'N'},    {"s2", required_argument, nullptr, '2'},
        {"offload", required_argument, nullptr, 'o'}, {"extend", required_argument, nullptr, 'e'},
        {"max-T", required_argument, nullptr, 'x'},  {"max-T-limit", required_argument, nullptr, 'X'},
        {"probe-only", no_argument, nullptr, 'p'},   {"help", no_argument, nullptr, 'h'},
        {nullptr, 0, nullptr, 0}};
    static const char usage[] =
        "usage: bench_step_gpu [--model PATH|random:llama2-7b|random:smollm2-135m|random:tiny] [--B 1] [--T 4096]\n"
        "       [--r 16] [--alpha 32] [--dropout 0.05] [--steps 10] [--warmup 2] [--ckpt 0|1] [--attn wmma|mma]\n"
        "       [--nf4 dequant|fused] [--s2 F] [--offload 0|1] [--extend L] [--max-T 0|1] [--max-T-limit N]\n"
        "       [--probe-only]\n";
    int c;
    while ((c = getopt_long(argc, argv, "", lopts, nullptr)) != -1) {
        const char *v = optarg;
        switch (c) {
        case 'm': model = v; break;
        case 'B': B = atoi(v); break;
        case 'T': T = atoi(v); break;
        case 'r': r = atoi(v); break;
        case 'a': alpha = atof(v); break;
        case 'd': dropout = atof(v); break;
        case 's': steps = atoi(v); break;
        case 'w': warmup = atoi(v); break;
        case 'c': ckpt = atoi(v); break;
        case 'A':
            if (strcmp(v, "wmma") && strcmp(v, "mma")) {
                fprintf(stderr, "bench_step_gpu: --attn %s: want wmma or mma\n%s", v, usage);
                return 2;
            }
            attn_mma = !strcmp(v, "mma");
            break;
        case 'N':
            if (strcmp(v, "dequant") && strcmp(v, "fused")) {
                fprintf(stderr, "bench_step_gpu: --nf4 %s: want dequant or fused\n%s", v, usage);
                return 2;
            }
            nf4_fused = !strcmp(v, "fused");
            break;
        case '2': s2 = atof(v); break;
        case 'o': offload = atoi(v); break;
        case 'e': extend = atoi(v); break;
        case 'x': max_T = atoi(v); break;
        case 'X':
            if (atoi(v) <= 0) {
                fprintf(stderr, "bench_step_gpu: --max-T-limit %s: want a positive count of tokens\n%s", v, usage);
                return 2;
            }
            max_T_limit = atoi(v);
            break;
        case 'p': probe = true; break;
        case 'h': fputs(usage, stdout); return 0;
        default: fputs(usage, stderr); return 2;
        }
    }
    if (optind != argc) {
        fprintf(stderr, "bench_step_gpu: unexpected argument %s\n%s", argv[optind], usage);
        return 2;
    }
    if (bt_cuda_device_count() <= 0) {
        const char *req = getenv("BT_GPU_REQUIRE");
        printf("bench_step_gpu: %s: no CUDA device (%s)\n", req && atoi(req) ? "FAILED" : "skipped", bt_last_error());
        return req && atoi(req) ? 1 : 77;
    }
    if (probe)
        return bt_gpu_probe_kernel() ? 0 : 1;
    bt_model m;
    const bool rnd = !strncmp(model, "random:", 7);
    double t0 = bt_now();
    if (rnd) {
        if (fake_model(&m, model))
            return 2;
    } else {
        bt_model_load_opts lo = {BT_BASE_NF4, 0};
        if (bt_model_load(&m, model, &lo) != 0) {
            printf("bench_step_gpu: skipped: cannot load %s: %s\n", model, bt_last_error());
            return 1;
        }
    }
    bt_lora lora;
    if (bt_lora_init(&lora, &m, r, alpha, dropout, (1u << BT_MOD_N) - 1, 0, 1234) != 0) {
        fprintf(stderr, "bt_lora_init: %s\n", bt_last_error());
        return 1;
    }
    bt_cuda_trainer_opts o;
    memset(&o, 0, sizeof o);
    o.checkpointing = ckpt;
    o.attn_impl = attn_mma;
    o.base_matmul_impl = nf4_fused;
    o.random_weights = rnd;
    o.random_seed = 1;
    o.offload = offload;
    o.s2_group = s2 > 0 ? 2 * (int)lround(T * s2 / 2) : 0;
    if (max_T)
        return find_max_T(model, &m, &lora, &o, B, T, r, s2, extend, max_T_limit);
    if (extend > m.hp.ctx && bt_model_extend_context(&m, BT_ROPE_EXT_LINEAR, extend) != 0) {
        fprintf(stderr, "context extension: %s\n", bt_last_error());
        return 1;
    }
    bt_cuda_trainer *t = nullptr;
    if (bt_cuda_trainer_new(&t, &m, &lora, B * T, &o) != 0) {
        printf("bench_step_gpu: FAILED to create the trainer: %s\n", bt_last_error());
        return 1;
    }
    fprintf(stderr, "bench_step_gpu: %s on %s: set-up %.1f s, trainer holds %.0f MiB\n", model,
            bt_cuda_trainer_device_name(t), bt_now() - t0, bt_cuda_trainer_bytes(t) / 1048576.0);
    const int M = B * T;
    std::vector<int32_t> ids(M), lab(M), pos(M), cu(B + 1);
    bt_rng rng;
    bt_rng_seed(&rng, 99);
    for (int i = 0; i < M; i++) {
        ids[i] = (int32_t)(bt_rng_next(&rng) % (uint64_t)m.hp.vocab);
        lab[i] = ids[i];
        pos[i] = i % T;
    }
    for (int b = 0; b <= B; b++)
        cu[b] = b * T;
    bt_microbatch mb = {B, T, ids.data(), lab.data(), pos.data(), cu.data(), B + 1};
    const int nl = bt_shift_targets(nullptr, &mb, m.hp.vocab);
    double tt = 0, loss = 0;
    for (int s = 0; s < warmup + steps; s++) {
        const double ts = bt_now();
        double ls = 0;
        if (bt_cuda_trainer_zero_grad(t) ||
            bt_cuda_trainer_step(t, &mb, 1, 1.0f / nl, bt_hash64((uint64_t)s + 1) | 1, &ls, nullptr) ||
            bt_cuda_trainer_clip_and_step(t, 1.0, 1e-4f, 0.9f, 0.999f, 1e-8f, 0.f, s + 1, 0, nullptr, nullptr) ||
            cudaDeviceSynchronize() != cudaSuccess) {
            printf("bench_step_gpu: FAILED at step %d: %s\n", s + 1, bt_last_error());
            return 1;
        }
        if (s >= warmup)
            tt += bt_now() - ts;
        loss = ls / nl;
    }
    size_t base = 0;
    const size_t peak = bt_cuda_trainer_peak_used(t, &base);
    const double tps = steps > 0 ? (double)M * steps / tt : 0;
    fprintf(stderr, "bench_step_gpu: last loss %.4f, peak device memory %.2f GiB (context/baseline %.2f GiB)\n",
            loss, peak / 1073741824.0, base / 1073741824.0);
    char extra[96] = "";
    if (o.s2_group || offload || extend)
        snprintf(extra, sizeof extra, ", %s%s%s", o.s2_group ? "S2-Attn" : "full attn",
                 offload ? ", offload" : "", extend ? ", extended" : "");
    printf("| barq (CUDA, %s attn, %s NF4%s) | %s | %d x %d | %d | %s | %.0f | %.1f | %.2f | %s |\n",
           attn_mma ? "mma" : "wmma", nf4_fused ? "fused" : "dequant", extra, model, B, T, r,
           ckpt ? "yes" : "no", tps, steps > 0 ? 1e3 * tt / steps : 0.0, peak / 1073741824.0,
           bt_cuda_trainer_device_name(t));
    bt_cuda_trainer_free(t);
    bt_lora_free(&lora);
    bt_model_free(&m); /* random specs: layers hold only shapes (no buffers to free) */
    return 0;
}
