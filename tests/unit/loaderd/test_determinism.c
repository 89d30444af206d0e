/* Determinism, resume, ranks and mixing of loaderd/pipeline.c (issue 3 §4), and shards that
 * disappear or shrink while a pipeline reads them (§8). Two datasets written into a temporary
 * directory: A = chat docs "ID<k>;" over a plain and a zstd shard (weight 2), B = text docs
 * "TX<k>;" (weight 1, smaller than its share, so it wraps around within an epoch of A).
 * Real tokenizer (env BT_MODEL). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "common/tokenizer.h"
#include "loaderd/pipeline.h"
#include "proto/batch.h"
#include "tests/unit/util/pipeline_util.h"

#define N_A 1500
#define N_B 400
#define T_TEST 128
#define B_TEST 3

static bt_tokenizer *g_tok;
static char g_dir[64];

static int setup(void **state) {
    (void)state;
    if (tu_load_tokenizer(&g_tok)) return -1;
    if (!getenv("BT_LOG_LEVEL")) bt_log_set_level(BT_LOG_ERROR);
    if (tu_make_tmpdir(g_dir, sizeof g_dir, "determinism")) return -1;
    tu_write_two_datasets(g_dir, N_A, N_B, 0, 0);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    bt_tokenizer_free(g_tok);
    return tu_remove_dir(g_dir);
}

static void make_spec(ld_job_spec *spec, int threads, int epochs, uint32_t rank, uint32_t world) {
    tu_two_dataset_spec(spec, g_dir, T_TEST, B_TEST, 11, epochs, threads, rank, world);
}

typedef struct {
    uint64_t *sum;        /* checksum per batch */
    uint8_t (*state)[BT_RESUME_STATE_BYTES];
    int *ids;             /* doc ids seen, A as k, B as 100000 + k */
    size_t n, n_ids;
    uint64_t real;
} run_t;

static void add_ids(run_t *r, const bt_batch_view *v) {
    for (uint32_t s = 0; s + 1 < v->hdr->n_cu; s++) {
        int32_t a = v->cu_seqlens[s], e = v->cu_seqlens[s + 1];
        char *txt;
        size_t len;
        assert_int_equal(bt_detokenize(g_tok, v->input_ids + a, (size_t)(e - a), 1, &txt, &len), BT_OK);
        const char *m = strstr(txt, "user\nID"), *t = strstr(txt, "TX");
        int id = -1;
        if (m) id = atoi(m + 7);
        else if (t && t == txt) id = 100000 + atoi(t + 2);
        if (id >= 0) {
            r->ids = realloc(r->ids, (r->n_ids + 1) * sizeof *r->ids);
            r->ids[r->n_ids++] = id;
        }
        free(txt);
    }
}

/* records checksum, resume state and doc ids of every batch before END */
static void record_batch(void *ctx, ld_pipeline *p, bt_batch_view *v, int is_end) {
    (void)p;
    run_t *r = ctx;
    if (is_end) return;
    r->sum = realloc(r->sum, (r->n + 1) * sizeof *r->sum);
    r->state = realloc(r->state, (r->n + 1) * sizeof *r->state);
    r->sum[r->n] = v->hdr->checksum;
    memcpy(r->state[r->n], v->hdr->resume_state, BT_RESUME_STATE_BYTES);
    r->real += v->hdr->n_real_tokens;
    add_ids(r, v);
    r->n++;
}

/* Run to END (max = 0) or max batches; step numbers must continue from step0. */
static run_t run(const ld_job_spec *spec, const uint8_t *resume, size_t max, uint64_t step0, ld_stats *st) {
    run_t r = {0};
    tu_run_pipeline(spec, g_tok, resume, st, max, step0, 1, record_batch, &r);
    return r;
}

static void free_run(run_t *r) {
    free(r->sum), free(r->state), free(r->ids);
    memset(r, 0, sizeof *r);
}

static int cmp_int(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

/* bytes 32..39 of the state: the window start n; 40..47: rows of it already emitted */
static uint64_t st_rows(const uint8_t *s) {
    uint64_t v;
    memcpy(&v, s + 40, 8);
    return v;
}
static uint64_t st_start(const uint8_t *s) {
    uint64_t v;
    memcpy(&v, s + 32, 8);
    return v;
}
static uint32_t st_epoch(const uint8_t *s) {
    uint32_t v;
    memcpy(&v, s + 24, 4);
    return v;
}

static void test_resume_exact(void **state) {
    (void)state;
    ld_job_spec spec;
    make_spec(&spec, 2, 2, 0, 1);
    run_t full = run(&spec, NULL, 0, 0, NULL);
    assert_true(full.n > 40);
    /* resume points: a few fixed ones, every window boundary and every epoch change */
    size_t pts[256], np = 0;
    size_t fixed[] = {1, 2, 7, full.n / 3, full.n - 1, full.n};
    for (size_t i = 0; i < 6; i++) pts[np++] = fixed[i];
    int boundaries = 0, epoch_change = 0;
    for (size_t k = 1; k < full.n && np < 250; k++) {
        if (st_start(full.state[k - 1]) != st_start(full.state[k]) || st_rows(full.state[k - 1]) == 0) {
            pts[np++] = k; /* the batch after k - 1 crosses into a new window */
            pts[np++] = k + 1;
            boundaries++;
        }
        if (st_epoch(full.state[k - 1]) != st_epoch(full.state[k])) pts[np++] = k, epoch_change++;
    }
    assert_true(boundaries >= 4); /* several windows per epoch */
    assert_true(epoch_change >= 1);
    for (size_t i = 0; i < np; i++) {
        size_t k = pts[i];
        ld_job_spec s2;
        make_spec(&s2, 1 + (int)(i % 3), 2, 0, 1);
        run_t r = run(&s2, full.state[k - 1], 0, k, NULL);
        if (r.n + k != full.n) fail_msg("resume at %zu: %zu + %zu batches, want %zu", k, k, r.n, full.n);
        for (size_t j = 0; j < r.n; j++)
            if (r.sum[j] != full.sum[k + j]) fail_msg("resume at %zu: batch %zu differs", k, k + j);
        free_run(&r);
        ld_job_spec_free(&s2);
    }
    /* resuming from a state of the finished stream gives END right away */
    ld_pipeline *p = NULL;
    assert_int_equal(ld_pipeline_new(&p, &spec, g_tok, full.state[full.n - 1], NULL), BT_OK);
    ld_pipeline_free(p);
    free_run(&full);
    ld_job_spec_free(&spec);
}

static void test_threads_equal(void **state) {
    (void)state;
    ld_job_spec s1, s4;
    make_spec(&s1, 1, 1, 0, 1);
    make_spec(&s4, 4, 1, 0, 1);
    run_t a = run(&s1, NULL, 0, 0, NULL), b = run(&s4, NULL, 0, 0, NULL);
    assert_int_equal(a.n, b.n);
    assert_memory_equal(a.sum, b.sum, a.n * sizeof *a.sum);
    assert_memory_equal(a.state, b.state, a.n * sizeof *a.state);
    free_run(&a), free_run(&b);
    ld_job_spec_free(&s1), ld_job_spec_free(&s4);
}

static void test_ranks_cover_once(void **state) {
    (void)state;
    const int epochs = 2;
    ld_job_spec s;
    make_spec(&s, 2, epochs, 0, 1);
    ld_stats st1;
    memset(&st1, 0, sizeof st1);
    run_t one = run(&s, NULL, 0, 0, &st1);
    ld_job_spec_free(&s);
    qsort(one.ids, one.n_ids, sizeof *one.ids, cmp_int);
    /* world 1: every A doc exactly `epochs` times; B docs in proportion 1:2 (wrapping) */
    size_t na = 0, nb = 0;
    for (size_t i = 0; i < one.n_ids; i++) *(one.ids[i] < 100000 ? &na : &nb) += 1;
    assert_int_equal(na, (size_t)epochs * N_A);
    for (size_t i = 0; i < na; i++) assert_int_equal(one.ids[i], (int)(i / epochs));
    /* SWRR 2:1 over lines (A has N_A + 16 lines per epoch, broken ones included) */
    size_t a_lines = N_A + (N_A + 96) / 97;
    assert_true(nb >= (size_t)epochs * (a_lines / 2 - 1) && nb <= (size_t)epochs * (a_lines / 2 + 1));
    assert_int_equal(st1.dataset_docs[0], (uint64_t)epochs * N_A);
    assert_int_equal(st1.dataset_docs[1], nb);
    assert_true(st1.dataset_pass[1] >= 2); /* B wrapped */
    assert_int_equal(st1.bad[LD_BAD_JSON], (uint64_t)epochs * ((N_A + 96) / 97));
    for (uint32_t world = 2; world <= 3; world++) {
        run_t u = {0};
        size_t n0 = 0;
        for (uint32_t r = 0; r < world; r++) {
            ld_job_spec sr;
            make_spec(&sr, 1 + (int)r, epochs, r, world);
            ld_stats st;
            memset(&st, 0, sizeof st);
            run_t x = run(&sr, NULL, 0, 0, &st);
            if (r == 0) n0 = x.n;
            if (x.n != n0) fail_msg("world %u: rank %u has %zu batches, rank 0 %zu", world, r, x.n, n0);
            assert_int_equal(st.bad[LD_BAD_JSON], st1.bad[LD_BAD_JSON]);
            u.ids = realloc(u.ids, (u.n_ids + x.n_ids) * sizeof *u.ids);
            memcpy(u.ids + u.n_ids, x.ids, x.n_ids * sizeof *x.ids);
            u.n_ids += x.n_ids;
            free_run(&x);
            ld_job_spec_free(&sr);
        }
        qsort(u.ids, u.n_ids, sizeof *u.ids, cmp_int);
        assert_int_equal(u.n_ids, one.n_ids);
        assert_memory_equal(u.ids, one.ids, one.n_ids * sizeof *one.ids);
        free_run(&u);
    }
    free_run(&one);
}

/* A shard truncated (while a pipeline reads it) and another deleted after attach: counted as
 * io, no crash, the run goes on. */
typedef struct {
    char path[256];
    volatile int go;
} trunc_arg;
static void *truncate_later(void *arg) {
    trunc_arg *t = arg;
    while (!t->go) usleep(100);
    assert_int_equal(truncate(t->path, 1000), 0);
    return NULL;
}

static void test_shards_vanish(void **state) {
    (void)state;
    char cmd[512];
    snprintf(cmd, sizeof cmd, "mkdir -p '%s/v' && cp '%s/a1.jsonl' '%s/v/a1.jsonl' && cp '%s/b.jsonl' '%s/v/b.jsonl'",
             g_dir, g_dir, g_dir, g_dir, g_dir);
    assert_int_equal(system(cmd), 0);
    char json[1024];
    snprintf(json, sizeof json, "{\"shards\":[\"%s/v/*.jsonl\"],\"format\":\"chat\",\"tokenizer\":\"%s\","
             "\"seq_len\":128,\"micro_batch_size\":2,\"epochs\":2,\"tokenizer_threads\":2}", g_dir, tu_model_path());
    ld_job_spec spec;
    assert_int_equal(ld_job_spec_parse(&spec, json, NULL), BT_OK);
    ld_stats st;
    memset(&st, 0, sizeof st);
    ld_pipeline *p = NULL;
    assert_int_equal(ld_pipeline_new(&p, &spec, g_tok, NULL, &st), BT_OK);
    /* b.jsonl (text lines for a chat job: all `field`) is deleted right after attach */
    snprintf(cmd, sizeof cmd, "%s/v/b.jsonl", g_dir);
    unlink(cmd);
    trunc_arg ta;
    snprintf(ta.path, sizeof ta.path, "%s/v/a1.jsonl", g_dir);
    ta.go = 0;
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, truncate_later, &ta), 0);
    size_t bytes = bt_batch_slot_bytes(2, 128);
    uint8_t *slot = aligned_alloc(64, bytes);
    int rc, n = 0;
    do {
        bt_batch_view v;
        bt_batch_view_init(&v, slot, 2, 128);
        rc = ld_pipeline_next(p, &v, 1);
        if (rc < 0) fail_msg("next: %s", bt_last_error());
        assert_int_equal(bt_batch_validate(&v, 2, 128, 0), BT_OK);
        if (++n == 2) ta.go = 1; /* the reader is busy with a1.jsonl or already past it */
    } while (rc == 0);
    pthread_join(th, NULL);
    /* epoch 2 at least: b.jsonl missing (io); a1.jsonl shrank while read or is 1000 bytes now
     * (its last line is then cut: a json error) */
    assert_true(st.bad[LD_BAD_IO] >= 1);
    assert_true(st.docs > 0);
    free(slot);
    ld_pipeline_free(p);
    ld_job_spec_free(&spec);
}

static void test_spec_datasets(void **state) {
    (void)state;
    ld_job_spec s;
    const char *good = "{\"datasets\":[{\"shards\":[\"x\"],\"format\":\"text\",\"text_field\":\"t\",\"weight\":0.25},"
                       "{\"shards\":[\"y\"],\"format\":\"chat\"}],\"tokenizer\":\"t\",\"seq_len\":64,"
                       "\"micro_batch_size\":1,\"chat_template\":\"llama3\",\"overlong\":\"drop\"}";
    assert_int_equal(ld_job_spec_parse(&s, good, NULL), BT_OK);
    assert_int_equal(s.n_datasets, 2);
    assert_string_equal(s.datasets[0].text_field, "t");
    assert_true(s.datasets[0].weight == 0.25 && s.datasets[1].weight == 1.0);
    assert_int_equal(s.datasets[1].format, LD_FMT_CHAT);
    assert_int_equal(s.chat_template, LD_TPL_LLAMA3);
    assert_int_equal(s.overlong_drop, 1);
    ld_job_spec_free(&s);
    assert_int_equal(ld_job_spec_parse(&s, "{\"shards\":[\"x\"],\"format\":\"preference\",\"tokenizer\":\"t\","
                                           "\"seq_len\":64,\"micro_batch_size\":1,\"max_prompt_length\":16,\"max_length\":48}",
                                       NULL), BT_OK);
    assert_int_equal(s.format, LD_FMT_PREFERENCE);
    assert_int_equal(s.max_prompt_length, 16);
    assert_int_equal(s.max_length, 48);
    ld_job_spec_free(&s);
    struct {
        const char *json, *key;
    } bad[] = {
        {"{\"datasets\":[],\"tokenizer\":\"t\",\"seq_len\":64,\"micro_batch_size\":1}", "datasets"},
        {"{\"datasets\":[{\"shards\":[\"x\"],\"format\":\"chat\",\"weight\":0}],\"tokenizer\":\"t\",\"seq_len\":64,\"micro_batch_size\":1}", "datasets[0].weight"},
        {"{\"datasets\":[{\"shards\":[\"x\"]}],\"tokenizer\":\"t\",\"seq_len\":64,\"micro_batch_size\":1}", "datasets[0].format"},
        {"{\"datasets\":[{\"shards\":[\"x\"],\"format\":\"chat\"},{\"format\":\"chat\"}],\"tokenizer\":\"t\",\"seq_len\":64,\"micro_batch_size\":1}", "datasets[1].shards"},
        {"{\"datasets\":[{\"shards\":[\"x\"],\"format\":\"chat\",\"text_field\":\"q\"}],\"tokenizer\":\"t\",\"seq_len\":64,\"micro_batch_size\":1}", "datasets[0].text_field"},
        {"{\"datasets\":[{\"shards\":[\"x\"],\"format\":\"chat\",\"bogus\":1}],\"tokenizer\":\"t\",\"seq_len\":64,\"micro_batch_size\":1}", "datasets[0].bogus"},
        {"{\"datasets\":[{\"shards\":[\"x\"],\"format\":\"chat\"}],\"shards\":[\"y\"],\"tokenizer\":\"t\",\"seq_len\":64,\"micro_batch_size\":1}", "datasets"},
        {"{\"shards\":[\"x\"],\"format\":\"chat\",\"tokenizer\":\"t\",\"seq_len\":64,\"micro_batch_size\":1,\"chat_template\":\"x\"}", "chat_template"},
        {"{\"shards\":[\"x\"],\"format\":\"chat\",\"tokenizer\":\"t\",\"seq_len\":64,\"micro_batch_size\":1,\"overlong\":1}", "overlong"},
        {"{\"shards\":[\"x\"],\"format\":\"preference\",\"tokenizer\":\"t\",\"seq_len\":64,\"micro_batch_size\":1,\"max_length\":-1}", "max_length"},
        {"{\"shards\":[\"x\"],\"format\":\"kto\",\"tokenizer\":\"t\",\"seq_len\":64,\"micro_batch_size\":1,\"max_prompt_length\":\"8\"}", "max_prompt_length"},
        {"{\"shards\":[\"x\"],\"format\":\"dpo\",\"tokenizer\":\"t\",\"seq_len\":64,\"micro_batch_size\":1}", "format"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        bt_keypath key;
        assert_int_equal(ld_job_spec_parse(&s, bad[i].json, &key), BT_ERR_INVALID);
        char want[64];
        snprintf(want, sizeof want, "\"%s", bad[i].key);
        if (!strstr(bt_last_error(), want)) fail_msg("case %zu: error \"%s\" does not name %s", i, bt_last_error(), want);
        assert_string_equal(key.s, bad[i].key); /* the key, as data */
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_spec_datasets),
        cmocka_unit_test(test_threads_equal),
        cmocka_unit_test(test_resume_exact),
        cmocka_unit_test(test_ranks_cover_once),
        cmocka_unit_test(test_shards_vanish),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
