/* bench_dataplane: what the data plane costs each node, for N simulated nodes x 2 ranks.
 *
 *   bench_dataplane --model M.gguf --shards GLOB [--format chat] [--seq-len T] [--batch B]
 *                   [--threads K] [--nodes N] --design today|shared|cached [--cache-dir DIR]
 *
 * Forks N processes ("nodes", started together); node i serves ranks 2i and 2i+1 of a world of
 * 2N and pulls both ranks' batches in turn to the end, as two trainers would, twice: the first
 * epoch (a 1-epoch job on a cold cache) and the second (the same job again: what every later
 * epoch, or a later job on the same data, costs):
 *   today   each rank has a pipeline of its own (the per-rank design: every rank reads and
 *           tokenizes every line), no cache
 *   shared  the node's two ranks share one stream (ld_hub), no cache
 *   cached  shared, and every node uses the token cache in DIR (one directory for all nodes:
 *           a shared filesystem); DIR must be empty for a cold first epoch
 * Each node measures its own CPU time (getrusage RUSAGE_SELF: all its threads: reading, hashing,
 * tokenizing, packing, cache I/O) per epoch, from attach to the end, and checks every batch
 * (bt_batch_validate). Prints one line of key=value pairs:
 *   nodes, design, epoch1_cpu_mean / epoch1_cpu_max, epoch2_cpu_mean / epoch2_cpu_max (CPU
 *   seconds per node), tokens (non-padding tokens, all ranks), built (shards tokenized into the
 *   cache, all nodes), checksum (FNV-1a over every rank's batch checksums in order: equal for
 *   the three designs when the batches are).
 * Exit status 0, 1 with a message on stderr, or 2 with the usage on a bad command line. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "common/tokenizer.h"
#include "loaderd/pipeline.h"
#include "loaderd/tcache.h"
#include "proto/batch.h"

static double cpu_now(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6 + (double)ru.ru_stime.tv_sec +
           ru.ru_stime.tv_usec * 1e-6;
}

typedef struct {
    double cpu1, cpu2;
    unsigned long long tokens, built, checksum[2];
    int ok;
} node_result;

typedef struct {
    const char *model, *glob, *format, *design, *cache_dir;
    unsigned T, B, threads, nodes;
} opts;

/* One pass (a 1-epoch job) of node `node`'s two ranks: CPU seconds in *cpu. */
static int node_pass(const opts *o, const bt_tokenizer *tok, unsigned node, ld_hub *hub, node_result *res,
                     double *cpu) {
    char json[4096];
    snprintf(json, sizeof json,
             "{\"shards\":[\"%s\"],\"format\":\"%s\",\"tokenizer\":\"%s\",\"seq_len\":%u,\"micro_batch_size\":%u,"
             "\"seed\":1234,\"epochs\":1,\"tokenizer_threads\":%u}",
             o->glob, o->format, o->model, o->T, o->B, o->threads);
    ld_job_spec spec[2];
    ld_pipeline *p[2] = {NULL, NULL};
    double c0 = cpu_now();
    for (unsigned k = 0; k < 2; k++) {
        if (ld_job_spec_parse(&spec[k], json, NULL) != BT_OK) {
            fprintf(stderr, "spec: %s\n", bt_last_error());
            return 1;
        }
        spec[k].rank = 2 * node + k;
        spec[k].world_size = 2 * o->nodes;
        int rc = hub ? ld_pipeline_attach(&p[k], hub, &spec[k], tok, NULL, NULL)
                     : ld_pipeline_new(&p[k], &spec[k], tok, NULL, NULL);
        if (rc != BT_OK) {
            fprintf(stderr, "node %u rank %u: %s\n", node, spec[k].rank, bt_last_error());
            return 1;
        }
    }
    size_t bytes = bt_batch_slot_bytes(o->B, o->T);
    uint8_t *slot = aligned_alloc(64, bytes);
    int done[2] = {0, 0};
    while (!done[0] || !done[1])
        for (unsigned k = 0; k < 2; k++) {
            if (done[k]) continue;
            bt_batch_view v;
            bt_batch_view_init(&v, slot, o->B, o->T);
            int rc = ld_pipeline_next(p[k], &v, 1);
            if (rc < 0 || bt_batch_validate(&v, o->B, o->T, bt_tokenizer_vocab_size(tok)) != BT_OK) {
                fprintf(stderr, "node %u rank %u: %s\n", node, 2 * node + k, bt_last_error());
                return 1;
            }
            res->tokens += v.hdr->n_real_tokens;
            res->checksum[k] = bt_fnv1a64(res->checksum[k], &v.hdr->checksum, sizeof v.hdr->checksum);
            done[k] = rc == 1;
        }
    for (unsigned k = 0; k < 2; k++) {
        ld_pipeline_free(p[k]);
        ld_job_spec_free(&spec[k]);
    }
    free(slot);
    *cpu = cpu_now() - c0;
    return 0;
}

/* Two passes: the first epoch (cold) and the second (what every later epoch costs). */
static int node_run(const opts *o, const bt_tokenizer *tok, unsigned node, node_result *res) {
    ld_tcache *cache = NULL;
    if (!strcmp(o->design, "cached") && ld_tcache_open(&cache, o->cache_dir, 1ull << 40, 3600) != BT_OK) {
        fprintf(stderr, "node %u: %s\n", node, bt_last_error());
        return 1;
    }
    ld_hub *hub = NULL;
    if (strcmp(o->design, "today")) ld_hub_new(&hub, cache);
    res->checksum[0] = res->checksum[1] = BT_FNV64_INIT;
    int rc = node_pass(o, tok, node, hub, res, &res->cpu1);
    if (rc == 0) rc = node_pass(o, tok, node, hub, res, &res->cpu2);
    if (cache) res->built = atomic_load(&ld_tcache_stats_of(cache)->built);
    ld_hub_free(hub);
    ld_tcache_free(cache);
    res->ok = rc == 0;
    return rc;
}

/* The usage text on f; returns rc (2: a usage error, 0: --help). */
static int usage(FILE *f, int rc) {
    fprintf(f, "usage: bench_dataplane --model M.gguf --shards GLOB --design today|shared|cached [--cache-dir DIR]\n"
               "       [--format chat] [--seq-len T] [--batch B] [--threads K] [--nodes N]\n");
    return rc;
}

int main(int argc, char **argv) {
    opts o = {NULL, NULL, "chat", NULL, NULL, 2048, 4, 1, 1};
    static const struct option lopts[] = {
        {"model", required_argument, NULL, 'm'},  {"shards", required_argument, NULL, 's'},
        {"format", required_argument, NULL, 'f'}, {"design", required_argument, NULL, 'd'},
        {"cache-dir", required_argument, NULL, 'c'}, {"seq-len", required_argument, NULL, 'T'},
        {"batch", required_argument, NULL, 'B'},  {"threads", required_argument, NULL, 'k'},
        {"nodes", required_argument, NULL, 'n'},  {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "", lopts, NULL)) != -1) {
        switch (c) {
        case 'm': o.model = optarg; break;
        case 's': o.glob = optarg; break;
        case 'f': o.format = optarg; break;
        case 'd': o.design = optarg; break;
        case 'c': o.cache_dir = optarg; break;
        case 'T': o.T = (unsigned)strtoul(optarg, NULL, 10); break;
        case 'B': o.B = (unsigned)strtoul(optarg, NULL, 10); break;
        case 'k': o.threads = (unsigned)strtoul(optarg, NULL, 10); break;
        case 'n': o.nodes = (unsigned)strtoul(optarg, NULL, 10); break;
        case 'h': return usage(stdout, 0);
        default: return usage(stderr, 2);
        }
    }
    if (optind != argc) return usage(stderr, 2);
    if (!o.model || !o.glob || !o.design || o.nodes < 1 || o.nodes > 64 ||
        (strcmp(o.design, "today") && strcmp(o.design, "shared") && strcmp(o.design, "cached")) ||
        (!strcmp(o.design, "cached") && !o.cache_dir))
        return usage(stderr, 2);
    bt_log_set_level(BT_LOG_WARN);
    bt_tokenizer *tok = NULL;
    if (bt_tokenizer_load(&tok, o.model) != BT_OK) {
        fprintf(stderr, "%s: %s\n", o.model, bt_last_error());
        return 1;
    }
    node_result *res = calloc(o.nodes, sizeof *res);
    int (*pipes)[2] = calloc(o.nodes, sizeof *pipes);
    pid_t *pids = calloc(o.nodes, sizeof *pids);
    for (unsigned i = 0; i < o.nodes; i++) {
        if (pipe(pipes[i]) != 0) return 1;
        pids[i] = fork();
        if (pids[i] == 0) {
            node_result r = {0};
            close(pipes[i][0]);
            int rc = node_run(&o, tok, i, &r);
            ssize_t w = write(pipes[i][1], &r, sizeof r);
            _exit(rc == 0 && w == (ssize_t)sizeof r ? 0 : 1);
        }
        close(pipes[i][1]);
    }
    int ok = 1;
    double s1 = 0, m1 = 0, s2 = 0, m2 = 0;
    unsigned long long tokens = 0, built = 0, sum = BT_FNV64_INIT;
    for (unsigned i = 0; i < o.nodes; i++) {
        int st = 0;
        ssize_t r = read(pipes[i][0], &res[i], sizeof res[i]);
        waitpid(pids[i], &st, 0);
        close(pipes[i][0]);
        if (r != (ssize_t)sizeof res[i] || !res[i].ok || !WIFEXITED(st) || WEXITSTATUS(st) != 0) ok = 0;
    }
    if (!ok) {
        fprintf(stderr, "bench_dataplane: a node failed\n");
        return 1;
    }
    for (unsigned i = 0; i < o.nodes; i++) {
        s1 += res[i].cpu1;
        s2 += res[i].cpu2;
        if (res[i].cpu1 > m1) m1 = res[i].cpu1;
        if (res[i].cpu2 > m2) m2 = res[i].cpu2;
        tokens += res[i].tokens;
        built += res[i].built;
        sum = bt_fnv1a64(sum, res[i].checksum, sizeof res[i].checksum);
    }
    printf("nodes=%u design=%s epoch1_cpu_mean=%.3f epoch1_cpu_max=%.3f epoch2_cpu_mean=%.3f epoch2_cpu_max=%.3f "
           "tokens=%llu built=%llu checksum=%016llx\n",
           o.nodes, o.design, s1 / o.nodes, m1, s2 / o.nodes, m2, tokens, built, sum);
    free(res);
    free(pipes);
    free(pids);
    bt_tokenizer_free(tok);
    return 0;
}
