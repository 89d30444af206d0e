/* bench_pipeline: loaderd's data pipeline end to end in-process (shards -> lines -> format ->
 * BPE tokenize on N threads -> best-fit packing -> batches), timed.
 *
 *   bench_pipeline --model MODEL.gguf --shards GLOB [--shards GLOB ...] [--format chat]
 *                  [--seq-len 2048] [--batch 4] [--threads 1] [--epochs 1] [--world 1]
 *                  [--seed 1234] [--repeat 1]
 *
 * Runs `epochs` epochs to END_OF_DATA `repeat` times (fresh pipeline each time; the best run is
 * reported, as the first one pays page-cache misses) and prints one line of key=value pairs:
 *   tokens        non-padding tokens emitted (sum of n_real_tokens)
 *   slot_tokens   B*T per batch emitted (the denominator of packing efficiency)
 *   efficiency    tokens / slot_tokens (Krell et al. 2021, arXiv 2107.02027: 1 - padding/total)
 *   docs, batches, seconds (wall clock of the best run, bt_now), tok_per_s = tokens / seconds,
 *   tok_per_s_per_thread = tok_per_s / threads (tokenize threads only; the reader and the
 *   consumer thread come on top), cpu_seconds (process CPU time of the best run, getrusage),
 *   tok_per_cpu_s = tokens / cpu_seconds (the honest per-core figure).
 * Exit status 0, 1 with a message on stderr, or 2 with the usage on a bad command line. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "common/bt_common.h"
#include "common/tokenizer.h"
#include "loaderd/pipeline.h"
#include "proto/batch.h"

static double cpu_now(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6 + (double)ru.ru_stime.tv_sec +
           ru.ru_stime.tv_usec * 1e-6;
}

/* The usage text on f; returns rc (2: a usage error, 0: --help). */
static int usage(FILE *f, int rc) {
    fprintf(f, "usage: bench_pipeline --model M.gguf --shards GLOB [--shards GLOB ...] [--format chat|text|alpaca]\n"
               "       [--seq-len T] [--batch B] [--threads N] [--epochs E] [--world W] [--seed S] [--repeat R]\n");
    return rc;
}

int main(int argc, char **argv) {
    const char *model = NULL, *format = "chat";
    const char *shards[64];
    int n_shards = 0;
    unsigned T = 2048, B = 4, threads = 1, epochs = 1, world = 1, repeat = 1;
    unsigned long long seed = 1234;
    static const struct option lopts[] = {
        {"model", required_argument, NULL, 'm'},   {"shards", required_argument, NULL, 's'},
        {"format", required_argument, NULL, 'f'},  {"seq-len", required_argument, NULL, 'T'},
        {"batch", required_argument, NULL, 'B'},   {"threads", required_argument, NULL, 'k'},
        {"epochs", required_argument, NULL, 'e'},  {"world", required_argument, NULL, 'w'},
        {"seed", required_argument, NULL, 'S'},    {"repeat", required_argument, NULL, 'r'},
        {"help", no_argument, NULL, 'h'},          {NULL, 0, NULL, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "", lopts, NULL)) != -1) {
        switch (c) {
        case 'm': model = optarg; break;
        case 's':
            if (n_shards == 64) return usage(stderr, 2);
            shards[n_shards++] = optarg;
            break;
        case 'f': format = optarg; break;
        case 'T': T = (unsigned)strtoul(optarg, NULL, 10); break;
        case 'B': B = (unsigned)strtoul(optarg, NULL, 10); break;
        case 'k': threads = (unsigned)strtoul(optarg, NULL, 10); break;
        case 'e': epochs = (unsigned)strtoul(optarg, NULL, 10); break;
        case 'w': world = (unsigned)strtoul(optarg, NULL, 10); break;
        case 'S': seed = strtoull(optarg, NULL, 10); break;
        case 'r': repeat = (unsigned)strtoul(optarg, NULL, 10); break;
        case 'h': return usage(stdout, 0);
        default: return usage(stderr, 2);
        }
    }
    if (optind != argc || !model || n_shards == 0 || epochs == 0 || repeat == 0 || world == 0)
        return usage(stderr, 2);
    bt_log_set_level(BT_LOG_ERROR);
    bt_tokenizer *tok = NULL;
    if (bt_tokenizer_load(&tok, model) != BT_OK) {
        fprintf(stderr, "bench_pipeline: %s\n", bt_last_error());
        return 1;
    }
    char json[8192];
    int k = snprintf(json, sizeof json, "{\"shards\":[");
    for (int i = 0; i < n_shards; i++)
        k += snprintf(json + k, sizeof json - (size_t)k, "%s\"%s\"", i ? "," : "", shards[i]);
    snprintf(json + k, sizeof json - (size_t)k,
             "],\"format\":\"%s\",\"tokenizer\":\"%s\",\"seq_len\":%u,\"micro_batch_size\":%u,"
             "\"seed\":%llu,\"epochs\":%u,\"tokenizer_threads\":%u}",
             format, model, T, B, seed, epochs, threads);
    ld_job_spec spec;
    if (ld_job_spec_parse(&spec, json, NULL) != BT_OK) {
        fprintf(stderr, "bench_pipeline: %s\n", bt_last_error());
        bt_tokenizer_free(tok);
        return 1;
    }
    spec.world_size = world;
    size_t bytes = bt_batch_slot_bytes(B, T);
    void *slot = bt_aligned_alloc(bytes);
    double best = 0, best_cpu = 0;
    uint64_t tokens = 0, slot_tokens = 0, docs = 0, batches = 0;
    int rc = 0;
    for (unsigned r = 0; r < repeat && rc == 0; r++) {
        ld_stats st;
        memset(&st, 0, sizeof st);
        ld_pipeline *p = NULL;
        double t0 = bt_now(), c0 = cpu_now();
        if (ld_pipeline_new(&p, &spec, tok, NULL, &st) != BT_OK) {
            fprintf(stderr, "bench_pipeline: %s\n", bt_last_error());
            rc = 1;
            break;
        }
        bt_batch_view v;
        bt_batch_view_init(&v, slot, B, T);
        uint64_t tk = 0, n = 0;
        for (;;) {
            int x = ld_pipeline_next(p, &v, 1);
            if (x < 0) {
                fprintf(stderr, "bench_pipeline: %s\n", bt_last_error());
                rc = 1;
                break;
            }
            if (x == 1) break;
            tk += v.hdr->n_real_tokens;
            n++;
        }
        double dt = bt_now() - t0, dc = cpu_now() - c0;
        ld_pipeline_free(p);
        if (rc) break;
        if (r == 0 || dt < best) {
            best = dt;
            best_cpu = dc;
        }
        tokens = tk;
        batches = n;
        slot_tokens = n * (uint64_t)B * T;
        docs = st.docs;
    }
    free(slot);
    ld_job_spec_free(&spec);
    bt_tokenizer_free(tok);
    if (rc) return rc;
    double tps = best > 0 ? (double)tokens / best : 0;
    printf("tokens=%llu slot_tokens=%llu efficiency=%.4f docs=%llu batches=%llu seconds=%.3f tok_per_s=%.0f "
           "tok_per_s_per_thread=%.0f cpu_seconds=%.3f tok_per_cpu_s=%.0f\n",
           (unsigned long long)tokens, (unsigned long long)slot_tokens,
           slot_tokens ? (double)tokens / (double)slot_tokens : 0.0, (unsigned long long)docs,
           (unsigned long long)batches, best, tps, tps / threads, best_cpu,
           best_cpu > 0 ? (double)tokens / best_cpu : 0.0);
    return 0;
}
