/* One pipeline per job per node (loaderd/pipeline.c streams shared through an ld_hub) gives
 * every rank exactly the batches of the per-rank pipelines it replaced. The reference is
 * tests/fixtures/pipeline/rank_batches.txt, recorded from the per-rank design (commit b8e98b9,
 * before the hub existed) by this test in record mode:
 *     BT_RECORD_BATCHES=tests/fixtures/pipeline/rank_batches.txt build/tests/test_dealer
 * For several world sizes and seeds, one line per (world, seed, rank): a 64-bit FNV-1a digest
 * of every batch (arrays, header counts, step, epoch, flags, and the resume state without its
 * spec hash, which covers the temporary paths). Data: two datasets written here (chat docs
 * "ID<k>;" over a plain and a zstd shard with broken lines, weight 2; text docs "TX<k>;" some
 * longer than T, weight 1), 2 epochs, T = 64 so that an epoch spans several packing windows.
 * Real tokenizer (env BT_MODEL). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "common/tokenizer.h"
#include "loaderd/pipeline.h"
#include "proto/batch.h"
#include "tests/unit/util/pipeline_util.h"

#define FIXTURE "tests/fixtures/pipeline/rank_batches.txt"
#define N_A 900
#define N_B 300
#define T_TEST 64
#define B_TEST 2
#define EPOCHS 2

static bt_tokenizer *g_tok;
static char g_dir[64];

static const uint32_t WORLDS[] = {1, 2, 3, 5};
static const uint64_t SEEDS[] = {0, 11};
#define N_WORLDS (sizeof WORLDS / sizeof WORLDS[0])
#define N_SEEDS (sizeof SEEDS / sizeof SEEDS[0])

static void make_data(void) {
    tu_sbuf a1 = {0}, a2 = {0}, bt = {0};
    char tmp[4096];
    for (int i = 0; i < N_A; i++) {
        tu_sbuf *b = i < N_A / 2 ? &a1 : &a2;
        int k = snprintf(tmp, sizeof tmp, "{\"messages\":[{\"role\":\"user\",\"content\":\"ID%d; q\"},"
                                          "{\"role\":\"assistant\",\"content\":\"a", i);
        for (int w = 0; w < (i * 13) % 40; w++) k += snprintf(tmp + k, sizeof tmp - (size_t)k, " w%d", w);
        snprintf(tmp + k, sizeof tmp - (size_t)k, "\"}]}\n");
        tu_sb_str(b, tmp);
        if (i % 97 == 0) tu_sb_str(b, "{broken json\n");
        if (i % 211 == 5) tu_sb_str(b, "\n");
    }
    tu_write_file(g_dir, "a1.jsonl", a1.p, a1.n);
    size_t zn;
    void *z = tu_zstd_frame(a2.p, a2.n, &zn);
    tu_write_file(g_dir, "a2.jsonl.zst", z, zn);
    for (int i = 0; i < N_B; i++) {
        int k = snprintf(tmp, sizeof tmp, "{\"body\":\"TX%d; text", i);
        int words = i % 17 == 0 ? 150 : i % 30; /* some documents longer than T: split */
        for (int w = 0; w < words; w++) k += snprintf(tmp + k, sizeof tmp - (size_t)k, " v%d", w);
        snprintf(tmp + k, sizeof tmp - (size_t)k, "\"}\n");
        tu_sb_str(&bt, tmp);
    }
    tu_write_file(g_dir, "b.jsonl", bt.p, bt.n);
    free(a1.p), free(a2.p), free(bt.p), free(z);
}

static int setup(void **state) {
    (void)state;
    if (tu_load_tokenizer(&g_tok)) return -1;
    if (!getenv("BT_LOG_LEVEL")) bt_log_set_level(BT_LOG_ERROR);
    if (tu_make_tmpdir(g_dir, sizeof g_dir, "dealer")) return -1;
    make_data();
    return 0;
}

static int teardown(void **state) {
    (void)state;
    bt_tokenizer_free(g_tok);
    return tu_remove_dir(g_dir);
}

static void make_spec(ld_job_spec *spec, uint64_t seed, uint32_t rank, uint32_t world, int threads) {
    char json[2048], err[256];
    snprintf(json, sizeof json,
             "{\"datasets\":[{\"shards\":[\"%s/a*.jsonl*\"],\"format\":\"chat\",\"weight\":2},"
             "{\"shards\":[\"%s/b.jsonl\"],\"format\":\"text\",\"text_field\":\"body\",\"weight\":1}],"
             "\"tokenizer\":\"%s\",\"seq_len\":%d,\"micro_batch_size\":%d,\"seed\":%llu,\"epochs\":%d,"
             "\"tokenizer_threads\":%d}",
             g_dir, g_dir, tu_model_path(), T_TEST, B_TEST, (unsigned long long)seed, EPOCHS, threads);
    if (ld_job_spec_parse(spec, json, err, sizeof err) != BT_OK) fail_msg("spec: %s", err);
    spec->rank = rank;
    spec->world_size = world;
}

/* Digest of one batch: everything but the spec hash in the resume state (bytes 8..15) and the
 * header checksum field itself (its content is covered through the arrays). */
static uint64_t batch_digest(const bt_batch_view *v) {
    const bt_batch_header *h = v->hdr;
    uint64_t x = bt_batch_checksum(v);
    uint32_t f[10] = {h->rank, (uint32_t)h->step, h->B, h->T, h->n_real_tokens, h->n_labelled_tokens, h->n_cu,
                      h->n_docs, h->flags, h->epoch};
    x = bt_fnv1a64(x, f, sizeof f);
    x = bt_fnv1a64(x, h->resume_state, 8);
    return bt_fnv1a64(x, h->resume_state + 16, BT_RESUME_STATE_BYTES - 16);
}

typedef struct {
    uint64_t *d;
    size_t n;
} digests;

static void record_digest(void *ctx, ld_pipeline *p, bt_batch_view *v, int is_end) {
    (void)p;
    digests *r = ctx;
    r->d = realloc(r->d, (r->n + 1) * sizeof *r->d);
    r->d[r->n++] = batch_digest(v); /* END included */
    (void)is_end;
}

/* Per-rank reference: one private pipeline per rank, to END. */
static digests run_rank(uint64_t seed, uint32_t rank, uint32_t world) {
    ld_job_spec s;
    make_spec(&s, seed, rank, world, 1 + (int)(rank % 3));
    digests r = {0};
    tu_run_pipeline(&s, g_tok, NULL, NULL, 0, 0, 1, record_digest, &r);
    ld_job_spec_free(&s);
    return r;
}

/* fixture: "world=W seed=S rank=R n=N" then N hex digests, one line per (world, seed, rank) */
typedef struct {
    uint32_t world, rank;
    uint64_t seed;
    digests d;
} ref_line;

static ref_line *g_ref;
static size_t g_n_ref;

static void load_fixture(void) {
    size_t len;
    char *text = (char *)tu_slurp(FIXTURE, &len);
    text[len] = 0;
    char *save = NULL;
    for (char *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        if (line[0] == '#') continue;
        ref_line r = {0};
        unsigned long long seed = 0;
        size_t n = 0;
        int off = 0;
        if (sscanf(line, "world=%u seed=%llu rank=%u n=%zu%n", &r.world, &seed, &r.rank, &n, &off) != 4)
            fail_msg("%s: bad line \"%.60s\"", FIXTURE, line);
        r.seed = seed;
        r.d.d = calloc(n + 1, sizeof *r.d.d);
        char *p = line + off;
        for (size_t i = 0; i < n; i++) {
            char *end;
            r.d.d[i] = strtoull(p, &end, 16);
            if (end == p) fail_msg("%s: short line for world %u rank %u", FIXTURE, r.world, r.rank);
            p = end;
        }
        r.d.n = n;
        g_ref = realloc(g_ref, (g_n_ref + 1) * sizeof *g_ref);
        g_ref[g_n_ref++] = r;
    }
    free(text);
}

static const digests *ref_for(uint32_t world, uint64_t seed, uint32_t rank) {
    for (size_t i = 0; i < g_n_ref; i++)
        if (g_ref[i].world == world && g_ref[i].seed == seed && g_ref[i].rank == rank) return &g_ref[i].d;
    fail_msg("%s has no line for world %u seed %llu rank %u", FIXTURE, world, (unsigned long long)seed, rank);
    return NULL;
}

static void assert_same(const digests *got, const digests *want, const char *what, uint32_t world, uint64_t seed,
                        uint32_t rank, size_t from) {
    if (got->n + from != want->n)
        fail_msg("%s: world %u seed %llu rank %u: %zu batches from %zu, want %zu", what, world,
                 (unsigned long long)seed, rank, got->n, from, want->n);
    for (size_t i = 0; i < got->n; i++)
        if (got->d[i] != want->d[from + i])
            fail_msg("%s: world %u seed %llu rank %u: batch %zu differs from the per-rank design", what, world,
                     (unsigned long long)seed, rank, from + i);
}

/* The private (per-rank) pipeline still reproduces the recorded batches. */
static void test_private_matches_record(void **state) {
    (void)state;
    for (size_t w = 0; w < N_WORLDS; w++)
        for (size_t s = 0; s < N_SEEDS; s++)
            for (uint32_t r = 0; r < WORLDS[w]; r++) {
                digests d = run_rank(SEEDS[s], r, WORLDS[w]);
                assert_same(&d, ref_for(WORLDS[w], SEEDS[s], r), "private", WORLDS[w], SEEDS[s], r, 0);
                free(d.d);
            }
}

static int record(const char *path) {
    FILE *f = fopen(path, "w");
    if (!f) return 1;
    fprintf(f, "# per-rank batch digests (tests/unit/test_dealer.c record mode); world seed rank n digests...\n");
    for (size_t w = 0; w < N_WORLDS; w++)
        for (size_t s = 0; s < N_SEEDS; s++)
            for (uint32_t r = 0; r < WORLDS[w]; r++) {
                digests d = run_rank(SEEDS[s], r, WORLDS[w]);
                fprintf(f, "world=%u seed=%llu rank=%u n=%zu", WORLDS[w], (unsigned long long)SEEDS[s], r, d.n);
                for (size_t i = 0; i < d.n; i++) fprintf(f, " %016llx", (unsigned long long)d.d[i]);
                fputc('\n', f);
                free(d.d);
            }
    return fclose(f) != 0;
}

int main(void) {
    const char *rec = getenv("BT_RECORD_BATCHES");
    if (rec && *rec) {
        if (setup(NULL)) return 1;
        int rc = record(rec);
        teardown(NULL);
        fprintf(stderr, "recorded %s: %s\n", rec, rc ? "FAILED" : "ok");
        return rc;
    }
    load_fixture();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_private_matches_record),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
