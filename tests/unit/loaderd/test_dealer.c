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

#include <fcntl.h>
#include <glob.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "common/tokenizer.h"
#include "loaderd/pipeline.h"
#include "loaderd/tcache.h"
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

static int setup(void **state) {
    (void)state;
    if (tu_load_tokenizer(&g_tok)) return -1;
    if (!getenv("BT_LOG_LEVEL")) bt_log_set_level(BT_LOG_ERROR);
    if (tu_make_tmpdir(g_dir, sizeof g_dir, "dealer")) return -1;
    tu_write_two_datasets(g_dir, N_A, N_B, 211, 17);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    bt_tokenizer_free(g_tok);
    return tu_remove_dir(g_dir);
}

static void make_spec(ld_job_spec *spec, uint64_t seed, uint32_t rank, uint32_t world, int threads) {
    tu_two_dataset_spec(spec, g_dir, T_TEST, B_TEST, seed, EPOCHS, threads, rank, world);
}

/* Digest of one batch: everything but the spec hash in the resume state (bytes 8..15) and the
 * header checksum field itself (its content is covered through the arrays). The arrays are
 * hashed as layout 1's checksum did (input_ids, labels, position_ids, cu_seqlens), so the
 * recorded fixture still pins the token content; layout 2's segment fields of these SFT jobs
 * must all be plain (checked here, not hashed). */
static uint64_t batch_digest(const bt_batch_view *v) {
    const bt_batch_header *h = v->hdr;
    size_t bt = (size_t)h->B * h->T;
    uint64_t x = BT_FNV64_INIT;
    x = bt_fnv1a64(x, v->input_ids, bt * sizeof(int32_t));
    x = bt_fnv1a64(x, v->labels, bt * sizeof(int32_t));
    x = bt_fnv1a64(x, v->position_ids, bt * sizeof(int32_t));
    x = bt_fnv1a64(x, v->cu_seqlens, (size_t)h->n_cu * sizeof(int32_t));
    for (uint32_t k = 0; k + 1 < h->n_cu; k++)
        if (v->seg_kind[k] != BT_SEG_PLAIN || v->seg_pair[k] != -1)
            fail_msg("batch step %llu: segment %u is %d/%d, want plain/-1", (unsigned long long)h->step, k,
                     v->seg_kind[k], v->seg_pair[k]);
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

/* ---------------------------------------------------------------- shared streams (ld_hub) */

static uint64_t g_rng = 0x243F6A8885A308D3ull;
static uint32_t rnd(uint32_t n) {
    g_rng ^= g_rng >> 12;
    g_rng ^= g_rng << 25;
    g_rng ^= g_rng >> 27;
    return (uint32_t)((g_rng * 0x2545F4914F6CDD1Dull) >> 33) % n;
}

typedef struct {
    ld_pipeline *p;
    ld_job_spec spec;
    digests d;
    uint8_t state[BT_RESUME_STATE_BYTES]; /* after the last batch taken */
    uint64_t step0;
    int ended;
} rank_run;

static uint8_t *g_slot;

/* One batch of rank r: digest recorded, state kept; END ends it. */
static void take(rank_run *rr) {
    bt_batch_view v;
    bt_batch_view_init(&v, g_slot, B_TEST, T_TEST);
    int rc = ld_pipeline_next(rr->p, &v, 1);
    if (rc < 0) fail_msg("next: %s", bt_last_error());
    if (bt_batch_validate(&v, B_TEST, T_TEST, bt_tokenizer_vocab_size(g_tok)) != BT_OK)
        fail_msg("invalid batch: %s", bt_last_error());
    assert_int_equal(v.hdr->step, rr->step0 + rr->d.n);
    record_digest(&rr->d, rr->p, &v, rc == 1);
    memcpy(rr->state, v.hdr->resume_state, BT_RESUME_STATE_BYTES);
    rr->ended = rc == 1;
}

static void attach_rank(rank_run *rr, ld_hub *hub, uint64_t seed, uint32_t rank, uint32_t world, const uint8_t *resume,
                        uint64_t step0) {
    make_spec(&rr->spec, seed, rank, world, 1 + (int)(rank % 2));
    rr->step0 = step0;
    if (ld_pipeline_attach(&rr->p, hub, &rr->spec, g_tok, resume, NULL) != BT_OK)
        fail_msg("attach rank %u: %s", rank, bt_last_error());
}

static void detach_rank(rank_run *rr) {
    ld_pipeline_free(rr->p);
    rr->p = NULL;
    ld_job_spec_free(&rr->spec);
}

/* Pull every unfinished rank in random bursts of 1..max_burst batches until all ended (or each
 * has `stop_at` batches when > 0). */
static void drive(rank_run *rr, uint32_t world, uint32_t max_burst, size_t stop_at) {
    for (;;) {
        uint32_t live = 0;
        for (uint32_t r = 0; r < world; r++) live += !rr[r].ended && (!stop_at || rr[r].d.n < stop_at);
        if (!live) return;
        uint32_t r = rnd(world);
        for (uint32_t k = 1 + rnd(max_burst); k && !rr[r].ended && (!stop_at || rr[r].d.n < stop_at); k--) take(&rr[r]);
    }
}

/* All ranks of every (world, seed) through one hub, consumed in random interleavings: one
 * stream per job, every rank's batches equal to the per-rank design's. */
static void test_hub_matches_record(void **state) {
    (void)state;
    for (size_t w = 0; w < N_WORLDS; w++)
        for (size_t s = 0; s < N_SEEDS; s++) {
            uint32_t world = WORLDS[w];
            ld_hub *hub = NULL;
            assert_int_equal(ld_hub_new(&hub, NULL), BT_OK);
            rank_run rr[8];
            memset(rr, 0, sizeof rr);
            for (uint32_t r = 0; r < world; r++) attach_rank(&rr[r], hub, SEEDS[s], r, world, NULL, 0);
            uint32_t streams, cursors;
            ld_hub_counts(hub, &streams, &cursors);
            assert_int_equal(streams, 1);
            assert_int_equal(cursors, world);
            assert_int_equal(ld_pipeline_sharing(rr[0].p), (int)world);
            drive(rr, world, 6, 0);
            for (uint32_t r = 0; r < world; r++) {
                assert_same(&rr[r].d, ref_for(world, SEEDS[s], r), "hub", world, SEEDS[s], r, 0);
                free(rr[r].d.d);
                detach_rank(&rr[r]);
            }
            ld_hub_counts(hub, &streams, &cursors);
            assert_int_equal(streams, 0);
            ld_hub_free(hub);
        }
}

/* Stop every rank at step k (random interleaving before), detach all, re-attach all from their
 * resume states (through a fresh hub: one stream again) and finish: the tail equals the record. */
static void test_hub_resume(void **state) {
    (void)state;
    const uint32_t world = 3;
    const uint64_t seed = 11;
    const digests *ref0 = ref_for(world, seed, 0);
    size_t ks[] = {1, 2, 37, 64, 65, 129, 200, ref0->n / 2, ref0->n - 2};
    for (size_t i = 0; i < sizeof ks / sizeof ks[0]; i++) {
        size_t k = ks[i];
        ld_hub *hub = NULL;
        assert_int_equal(ld_hub_new(&hub, NULL), BT_OK);
        rank_run rr[3];
        memset(rr, 0, sizeof rr);
        for (uint32_t r = 0; r < world; r++) attach_rank(&rr[r], hub, seed, r, world, NULL, 0);
        drive(rr, world, 5, k);
        uint8_t st[3][BT_RESUME_STATE_BYTES];
        for (uint32_t r = 0; r < world; r++) {
            assert_int_equal(rr[r].d.n, k);
            memcpy(st[r], rr[r].state, sizeof st[r]);
            free(rr[r].d.d);
            detach_rank(&rr[r]);
        }
        memset(rr, 0, sizeof rr);
        for (uint32_t r = 0; r < world; r++) attach_rank(&rr[r], hub, seed, r, world, st[r], k);
        uint32_t streams, cursors;
        ld_hub_counts(hub, &streams, &cursors);
        assert_int_equal(streams, 1);
        drive(rr, world, 4, 0);
        for (uint32_t r = 0; r < world; r++) {
            assert_same(&rr[r].d, ref_for(world, seed, r), "hub resume", world, seed, r, k);
            free(rr[r].d.d);
            detach_rank(&rr[r]);
        }
        ld_hub_free(hub);
    }
}

/* Ranks that attach late: shortly after (the first window is still there: shared), long after
 * (their own stream), and a rank that does not consume while the others run to the end (falls
 * behind, continues on its own): every rank's batches stay those of the record. */
static void test_hub_late_and_lagging(void **state) {
    (void)state;
    const uint32_t world = 2;
    const uint64_t seed = 0;
    ld_hub *hub = NULL;
    assert_int_equal(ld_hub_new(&hub, NULL), BT_OK);
    ld_hub_set_max_windows(hub, 3);
    rank_run rr[2];
    memset(rr, 0, sizeof rr);
    attach_rank(&rr[0], hub, seed, 0, world, NULL, 0);
    for (int i = 0; i < 5; i++) take(&rr[0]);
    attach_rank(&rr[1], hub, seed, 1, world, NULL, 0); /* window 0 is still held */
    uint32_t streams, cursors;
    ld_hub_counts(hub, &streams, &cursors);
    assert_int_equal(streams, 1);
    assert_int_equal(cursors, 2);
    while (!rr[0].ended) take(&rr[0]); /* rank 1 falls far behind */
    assert_int_equal(ld_pipeline_sharing(rr[1].p), 2);
    take(&rr[1]);
    assert_int_equal(ld_pipeline_sharing(rr[1].p), 1); /* its windows were dropped: its own stream */
    drive(rr, world, 3, 0);
    for (uint32_t r = 0; r < world; r++) {
        assert_same(&rr[r].d, ref_for(world, seed, r), "late/lagging", world, seed, r, 0);
        free(rr[r].d.d);
        rr[r].d = (digests){0};
        rr[r].ended = 0;
    }
    /* a second job with the same spec: rank 1 long after rank 0 moved on: its own stream */
    rank_run late[2];
    memset(late, 0, sizeof late);
    attach_rank(&late[0], hub, seed, 0, world, NULL, 0);
    for (int i = 0; i < 700 && !late[0].ended; i++) take(&late[0]);
    attach_rank(&late[1], hub, seed, 1, world, NULL, 0);
    assert_int_equal(ld_pipeline_sharing(late[1].p), 1);
    ld_hub_counts(hub, &streams, &cursors); /* rr[1] went private: not in the hub any more */
    assert_int_equal(streams, 3);
    assert_int_equal(cursors, 3);
    drive(late, world, 7, 0);
    for (uint32_t r = 0; r < world; r++) {
        assert_same(&late[r].d, ref_for(world, seed, r), "late job", world, seed, r, 0);
        free(late[r].d.d);
        detach_rank(&late[r]);
        detach_rank(&rr[r]);
    }
    ld_hub_free(hub);
}

/* ---------------------------------------------------------------- token cache */

static char g_cache[96];

static ld_tcache *open_cache(uint64_t max_bytes) {
    ld_tcache *c = NULL;
    if (ld_tcache_open(&c, g_cache, max_bytes, 60) != BT_OK) fail_msg("tcache: %s", bt_last_error());
    return c;
}

#define ST(c, f) atomic_load(&ld_tcache_stats_of(c)->f)

/* Every rank of (world, seed) through one hub on cache c, to the end; checked against the record. */
static void run_cached(ld_tcache *c, uint32_t world, uint64_t seed, const char *what) {
    ld_hub *hub = NULL;
    assert_int_equal(ld_hub_new(&hub, c), BT_OK);
    rank_run rr[8];
    memset(rr, 0, sizeof rr);
    for (uint32_t r = 0; r < world; r++) attach_rank(&rr[r], hub, seed, r, world, NULL, 0);
    drive(rr, world, 5, 0);
    for (uint32_t r = 0; r < world; r++) {
        assert_same(&rr[r].d, ref_for(world, seed, r), what, world, seed, r, 0);
        free(rr[r].d.d);
        detach_rank(&rr[r]);
    }
    ld_hub_free(hub);
}

/* Paths of the cache's entries (sorted), NULL-terminated; caller frees. */
static char **entries(size_t *n) {
    char pat[160];
    snprintf(pat, sizeof pat, "%s/v1/*/*.btc", g_cache);
    glob_t gl;
    *n = 0;
    char **v = calloc(64, sizeof *v);
    if (glob(pat, 0, NULL, &gl) == 0) {
        for (size_t i = 0; i < gl.gl_pathc && i < 63; i++) v[(*n)++] = strdup(gl.gl_pathv[i]);
        globfree(&gl);
    }
    return v;
}

static void free_strv(char **v) {
    for (size_t i = 0; v[i]; i++) free(v[i]);
    free(v);
}

static int cache_setup(void **state) {
    (void)state;
    snprintf(g_cache, sizeof g_cache, "%s/cache", g_dir);
    return 0;
}

static int cache_teardown(void **state) {
    (void)state;
    char cmd[160];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_cache);
    return system(cmd) == 0 ? 0 : -1;
}

/* Cold cache: each shard tokenized once (both epochs, every rank), then read; a later job (a new
 * process: a new cache object) tokenizes nothing. Batches are the record's either way. */
static void test_cache_once_and_reused(void **state) {
    (void)state;
    ld_tcache *c = open_cache(1ull << 30);
    run_cached(c, 3, 11, "cold cache");
    assert_int_equal(ST(c, built), 3); /* a1.jsonl, a2.jsonl.zst, b.jsonl */
    assert_int_equal(ST(c, misses), 3);
    assert_true(ST(c, hits) >= 3);     /* epoch 2 and b.jsonl's later passes */
    assert_int_equal(ST(c, damaged) + ST(c, stale) + ST(c, bypassed), 0);
    size_t n;
    char **e = entries(&n);
    assert_int_equal(n, 3);
    free_strv(e);
    ld_tcache_free(c);
    c = open_cache(1ull << 30);
    run_cached(c, 1, 0, "warm cache");
    run_cached(c, 5, 11, "warm cache");
    assert_int_equal(ST(c, built), 0);
    assert_int_equal(ST(c, misses), 0);
    assert_true(ST(c, hits) >= 6);
    ld_tcache_free(c);
}

static void write_bytes(const char *path, const void *p, size_t n) {
    unlink(path);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    if (n) assert_int_equal(fwrite(p, 1, n, f), n);
    fclose(f);
}

/* Damaged, stale and hostile files where entries should be: each is detected, counted and
 * replaced; nothing crashes and the batches stay the record's. */
static void test_cache_damage_and_hostile_files(void **state) {
    (void)state;
    ld_tcache *c = open_cache(1ull << 30);
    run_cached(c, 1, 11, "build");
    ld_tcache_free(c);
    size_t n;
    char **e = entries(&n);
    assert_int_equal(n, 3);
    size_t len0;
    uint8_t *good = tu_slurp(e[0], &len0), *other = NULL;
    size_t len1;
    other = tu_slurp(e[1], &len1);
    enum { FLIP_BLOCK, FLIP_TRAILER, TRUNCATE, GARBAGE, EMPTY, OTHER_KEY, SYMLINK, DIRECTORY, FIFO, HUGE_COUNTS,
           N_CASES };
    for (int k = 0; k < N_CASES; k++) {
        uint8_t *b = malloc(len0 + 64);
        memcpy(b, good, len0);
        unlink(e[0]);
        rmdir(e[0]);
        switch (k) {
        case FLIP_BLOCK: b[64 + 48 + 10] ^= 0x40; write_bytes(e[0], b, len0); break;
        case FLIP_TRAILER: b[len0 - 5] ^= 1; write_bytes(e[0], b, len0); break;
        case TRUNCATE: write_bytes(e[0], b, len0 / 2); break;
        case GARBAGE:
            for (size_t i = 0; i < len0; i++) b[i] = (uint8_t)rnd(256);
            write_bytes(e[0], b, len0);
            break;
        case EMPTY: write_bytes(e[0], b, 0); break;
        case OTHER_KEY: write_bytes(e[0], other, len1); break;
        case SYMLINK: assert_int_equal(symlink("/etc/passwd", e[0]), 0); break;
        case DIRECTORY: assert_int_equal(mkdir(e[0], 0700), 0); break;
        case FIFO: assert_int_equal(mkfifo(e[0], 0600), 0); break;
        default: /* trailer claiming 2^40 blocks and records */
            for (int i = 8; i < 40; i++) b[len0 - 72 + i] = 0xFF;
            write_bytes(e[0], b, len0);
            break;
        }
        free(b);
        c = open_cache(1ull << 30);
        run_cached(c, 2, 0, "hostile cache file");
        uint64_t bad = ST(c, damaged) + ST(c, stale);
        if (bad < 1) fail_msg("case %d: not detected", k);
        assert_true(ST(c, built) >= 1); /* replaced */
        ld_tcache_free(c);
        struct stat st;
        assert_int_equal(lstat(e[0], &st), 0);
        assert_true(S_ISREG(st.st_mode));
    }
    free(good);
    free(other);
    free_strv(e);
}

/* Four "nodes" (a hub and a cache object each, as four loaderds would have) on one cache
 * directory, started together: each shard is tokenized once in total. */
typedef struct {
    uint32_t node;
    ld_tcache *c;
    digests d[2];
} node_arg;

static void *node_main(void *arg) {
    node_arg *a = arg;
    ld_hub *hub = NULL;
    ld_hub_new(&hub, a->c);
    uint8_t *slot = aligned_alloc(64, bt_batch_slot_bytes(B_TEST, T_TEST));
    ld_pipeline *p[2];
    ld_job_spec sp[2];
    for (uint32_t k = 0; k < 2; k++) { /* ranks 2 node + k of world 8 */
        make_spec(&sp[k], 0, 2 * a->node + k, 8, 2);
        if (ld_pipeline_attach(&p[k], hub, &sp[k], g_tok, NULL, NULL) != BT_OK) return NULL;
    }
    int done[2] = {0, 0};
    while (!done[0] || !done[1])
        for (uint32_t k = 0; k < 2; k++) {
            if (done[k]) continue;
            bt_batch_view v;
            bt_batch_view_init(&v, slot, B_TEST, T_TEST);
            int rc = ld_pipeline_next(p[k], &v, 1);
            if (rc < 0) return NULL;
            record_digest(&a->d[k], p[k], &v, rc == 1);
            done[k] = rc == 1;
        }
    for (uint32_t k = 0; k < 2; k++) {
        ld_pipeline_free(p[k]);
        ld_job_spec_free(&sp[k]);
    }
    ld_hub_free(hub);
    free(slot);
    return NULL;
}

static void test_cache_nodes_tokenize_once(void **state) {
    (void)state;
    node_arg a[4];
    pthread_t th[4];
    for (uint32_t i = 0; i < 4; i++) {
        memset(&a[i], 0, sizeof a[i]);
        a[i].node = i;
        a[i].c = open_cache(1ull << 30);
        assert_int_equal(pthread_create(&th[i], NULL, node_main, &a[i]), 0);
    }
    uint64_t built = 0, waited = 0;
    for (uint32_t i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        built += ST(a[i].c, built);
        waited += ST(a[i].c, waited);
        assert_int_equal(ST(a[i].c, bypassed) + ST(a[i].c, damaged), 0);
        ld_tcache_free(a[i].c);
    }
    fprintf(stderr, "4 nodes: %llu entries built in total, %llu waits\n", (unsigned long long)built,
            (unsigned long long)waited);
    assert_int_equal(built, 3);
    /* every rank's batches: a world of 8 is not in the record; compare with private pipelines */
    for (uint32_t i = 0; i < 4; i++)
        for (uint32_t k = 0; k < 2; k++) {
            digests want = run_rank(0, 2 * i + k, 8);
            assert_same(&a[i].d[k], &want, "4 nodes", 8, 0, 2 * i + k, 0);
            free(want.d);
            free(a[i].d[k].d);
        }
}

/* Resuming mid-shard from a state: records before it are skipped in the entries. */
static void test_cache_resume(void **state) {
    (void)state;
    const uint32_t world = 2;
    const uint64_t seed = 11;
    ld_tcache *c = open_cache(1ull << 30);
    size_t ks[] = {3, 150, 400};
    for (size_t i = 0; i < sizeof ks / sizeof ks[0]; i++) {
        ld_hub *hub = NULL;
        assert_int_equal(ld_hub_new(&hub, c), BT_OK);
        rank_run rr[2];
        memset(rr, 0, sizeof rr);
        for (uint32_t r = 0; r < world; r++) attach_rank(&rr[r], hub, seed, r, world, NULL, 0);
        drive(rr, world, 5, ks[i]);
        uint8_t st[2][BT_RESUME_STATE_BYTES];
        for (uint32_t r = 0; r < world; r++) {
            memcpy(st[r], rr[r].state, sizeof st[r]);
            free(rr[r].d.d);
            detach_rank(&rr[r]);
        }
        memset(rr, 0, sizeof rr);
        for (uint32_t r = 0; r < world; r++) attach_rank(&rr[r], hub, seed, r, world, st[r], ks[i]);
        drive(rr, world, 5, 0);
        for (uint32_t r = 0; r < world; r++) {
            assert_same(&rr[r].d, ref_for(world, seed, r), "cache resume", world, seed, r, ks[i]);
            free(rr[r].d.d);
            detach_rank(&rr[r]);
        }
        ld_hub_free(hub);
    }
    assert_int_equal(ST(c, built), 3);
    ld_tcache_free(c);
}

/* A cache far too small: entries are evicted (never one being read) and rebuilt, batches stay. */
static void test_cache_eviction(void **state) {
    (void)state;
    ld_tcache *c = open_cache(1);
    run_cached(c, 2, 11, "tiny cache");
    assert_true(ST(c, evicted) >= 1);
    assert_true(ST(c, built) >= 3);
    ld_tcache_free(c);
}

/* The cache tree is loaderd's alone (issue 21 §3): a level writable by others (group, world,
 * sticky or not) or a link in the tree is refused at open with the level and the reason; a
 * level found so later makes those lookups read raw (counted as untrusted), the batches stay
 * the record's, and once fixed the cache is used again. */
static void test_cache_tree_trust(void **state) {
    (void)state;
    char p[192];
    ld_tcache *c = NULL;
    assert_int_equal(mkdir(g_cache, 0750), 0);
    static const struct {
        mode_t mode;
        const char *why;
    } modes[] = {{0770, "is group-writable (mode 0770)"}, {0757, "is world-writable (mode 0757)"},
                 {01777, "is world-writable (mode 1777, sticky bit or not)"}, {0775, "is group-writable"}};
    for (size_t i = 0; i < sizeof modes / sizeof modes[0]; i++) {
        assert_int_equal(chmod(g_cache, modes[i].mode), 0);
        assert_int_equal(ld_tcache_open(&c, g_cache, 1ull << 30, 60), BT_ERR_INVALID);
        assert_null(c);
        if (!strstr(bt_last_error(), modes[i].why) || !strstr(bt_last_error(), g_cache))
            fail_msg("mode %o: %s", (unsigned)modes[i].mode, bt_last_error());
    }
    assert_int_equal(chmod(g_cache, 0750), 0);
    snprintf(p, sizeof p, "%s/v1/zz", g_cache);
    assert_int_equal(mkdir(p, 0777), 0);
    assert_int_equal(chmod(p, 0777), 0);
    assert_int_equal(ld_tcache_open(&c, g_cache, 1ull << 30, 60), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "/v1/zz is world-writable"));
    assert_int_equal(rmdir(p), 0);
    snprintf(p, sizeof p, "%s/v1/yy", g_cache);
    assert_int_equal(symlink("/tmp", p), 0);
    assert_int_equal(ld_tcache_open(&c, g_cache, 1ull << 30, 60), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "/v1/yy is a symbolic link"));
    assert_int_equal(unlink(p), 0);
    /* trusted: used; then every entry directory opened to others: read raw, same batches */
    c = open_cache(1ull << 30);
    run_cached(c, 2, 11, "trusted cache");
    assert_int_equal(ST(c, built), 3);
    assert_int_equal(ST(c, untrusted), 0);
    glob_t gl;
    snprintf(p, sizeof p, "%s/v1/??", g_cache);
    assert_int_equal(glob(p, 0, NULL, &gl), 0);
    for (size_t i = 0; i < gl.gl_pathc; i++) assert_int_equal(chmod(gl.gl_pathv[i], 0777), 0);
    uint64_t hits = ST(c, hits);
    run_cached(c, 2, 11, "untrusted cache");
    assert_true(ST(c, untrusted) >= 3);
    assert_int_equal(ST(c, hits), hits); /* nothing read from it */
    assert_int_equal(ST(c, built), 3);
    for (size_t i = 0; i < gl.gl_pathc; i++) assert_int_equal(chmod(gl.gl_pathv[i], 0750), 0);
    globfree(&gl);
    run_cached(c, 2, 11, "trusted again");
    assert_true(ST(c, hits) > hits);
    ld_tcache_free(c);
}

/* Temporary files of builders that died (issue 21 §4): removed at open and counted; one a live
 * builder holds (its flock) stays and counts in the cache's bytes. */
static void test_cache_stale_temporaries(void **state) {
    (void)state;
    ld_tcache *c = open_cache(1ull << 30);
    run_cached(c, 1, 11, "build");
    uint64_t entry_bytes = ST(c, bytes);
    ld_tcache_free(c);
    size_t n;
    char **e = entries(&n);
    assert_int_equal(n, 3);
    char stale[256], live[256];
    snprintf(stale, sizeof stale, "%s.tmp.4194301.7", e[0]);
    snprintf(live, sizeof live, "%s.tmp.4194302.7", e[1]);
    static char zeros[3 << 16];
    write_bytes(stale, zeros, 1 << 16);
    write_bytes(live, zeros, sizeof zeros);
    struct timespec past[2] = {{time(NULL) - 60, 0}, {time(NULL) - 60, 0}};
    assert_int_equal(utimensat(AT_FDCWD, stale, past, 0), 0);
    assert_int_equal(utimensat(AT_FDCWD, live, past, 0), 0);
    int held = open(live, O_RDWR);
    assert_true(held >= 0);
    assert_int_equal(flock(held, LOCK_EX), 0);
    c = open_cache(1ull << 30);
    assert_int_equal(ST(c, temps_removed), 1);
    assert_int_equal(ST(c, bytes), entry_bytes + sizeof zeros);
    assert_int_equal(access(stale, F_OK), -1);
    assert_int_equal(access(live, F_OK), 0);
    ld_tcache_free(c);
    close(held);
    c = open_cache(1ull << 30); /* its builder gone: removed now */
    assert_int_equal(ST(c, temps_removed), 1);
    assert_int_equal(ST(c, bytes), entry_bytes);
    ld_tcache_free(c);
    free_strv(e);
}

static int record(const char *path) {
    FILE *f = fopen(path, "w");
    if (!f) return 1;
    fprintf(f, "# per-rank batch digests (tests/unit/loaderd/test_dealer.c record mode); world seed rank n digests...\n");
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
    g_slot = aligned_alloc(64, bt_batch_slot_bytes(B_TEST, T_TEST));
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_private_matches_record),
        cmocka_unit_test(test_hub_matches_record),
        cmocka_unit_test(test_hub_resume),
        cmocka_unit_test(test_hub_late_and_lagging),
        cmocka_unit_test_setup_teardown(test_cache_once_and_reused, cache_setup, cache_teardown),
        cmocka_unit_test_setup_teardown(test_cache_damage_and_hostile_files, cache_setup, cache_teardown),
        cmocka_unit_test_setup_teardown(test_cache_nodes_tokenize_once, cache_setup, cache_teardown),
        cmocka_unit_test_setup_teardown(test_cache_resume, cache_setup, cache_teardown),
        cmocka_unit_test_setup_teardown(test_cache_eviction, cache_setup, cache_teardown),
        cmocka_unit_test_setup_teardown(test_cache_tree_trust, cache_setup, cache_teardown),
        cmocka_unit_test_setup_teardown(test_cache_stale_temporaries, cache_setup, cache_teardown),
    };
    int rc = cmocka_run_group_tests(tests, setup, teardown);
    free(g_slot);
    for (size_t i = 0; i < g_n_ref; i++) free(g_ref[i].d.d);
    free(g_ref);
    return rc;
}
