/* Tests of loaderd/pipeline.c + job.c end to end: shards with good and bad lines written
 * into a temporary directory, the real tokenizer (env BT_MODEL). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "common/tokenizer.h"
#include "loaderd/pipeline.h"
#include "proto/batch.h"
#include "tests/unit/util/pipeline_util.h"

#define N_GOOD 600 /* good chat docs over all shards */
#define T_TEST 128
#define B_TEST 4

static bt_tokenizer *g_tok;
static char g_dir[64];
/* expected counts (built with the shards) */
static uint64_t e_bad[LD_BAD_N], e_lines, e_blank, e_good;

static void good_line(tu_sbuf *b, int id, const char *eol) {
    char tmp[4096];
    int words = (id * 7) % 20;
    if (id == 5) words = 300; /* longer than T: truncated, still present */
    int k = snprintf(tmp, sizeof tmp, "{\"messages\":[{\"role\":\"user\",\"content\":\"ID%d; question\"},"
                                      "{\"role\":\"assistant\",\"content\":\"answer", id);
    for (int w = 0; w < words; w++) k += snprintf(tmp + k, sizeof tmp - (size_t)k, " w%d", w);
    snprintf(tmp + k, sizeof tmp - (size_t)k, "\"}]}%s", eol);
    tu_sb_str(b, tmp);
    e_lines++;
    e_good++;
}

static void bad_line(tu_sbuf *b, const char *line, int reason) {
    tu_sb_str(b, line);
    tu_sb_str(b, "\n");
    e_lines++;
    if (reason >= 0) e_bad[reason]++;
    else e_blank++;
}

static void make_shards(void) {
    int id = 0;
    /* a.jsonl: good lines (some CRLF) and every kind of bad line */
    tu_sbuf a = {0};
    for (int i = 0; i < 200; i++) good_line(&a, id++, i % 3 ? "\n" : "\r\n");
    bad_line(&a, "{\"messages\": [", LD_BAD_JSON);
    bad_line(&a, "not json at all", LD_BAD_JSON);
    bad_line(&a, "[1,2,3]", LD_BAD_JSON);
    bad_line(&a, "{\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}", LD_BAD_UTF8);
    bad_line(&a, "{\"messages\":[{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"assistant\",\"content\":\"caf\xc3\"}]}",
             LD_BAD_UTF8);
    bad_line(&a, "{\"msgs\":[]}", LD_BAD_FIELD);
    bad_line(&a, "{\"messages\":[{\"role\":\"user\",\"content\":5}]}", LD_BAD_FIELD);
    bad_line(&a, "{\"messages\":\"hello\"}", LD_BAD_FIELD);
    bad_line(&a, "{\"messages\":[]}", LD_BAD_EMPTY);
    bad_line(&a, "{\"messages\":[{\"role\":\"user\",\"content\":\"only a question\"}]}", LD_BAD_EMPTY);
    bad_line(&a, "", -1);
    bad_line(&a, "   \r", -1);
    for (int i = 0; i < 100; i++) good_line(&a, id++, "\n");
    a.n--; /* no newline at the very end */
    a.p[a.n] = 0;
    tu_write_file(g_dir, "a.jsonl", a.p, a.n);
    free(a.p);

    /* b.jsonl.zst: two frames, one over-long line (16 MiB + 1) in the middle */
    tu_sbuf b = {0};
    for (int i = 0; i < 150; i++) good_line(&b, id++, "\n");
    size_t z1n, z2n;
    void *z1 = tu_zstd_frame(b.p, b.n, &z1n);
    b.n = 0;
    char *big = malloc(((size_t)16 << 20) + 2);
    memset(big, 'x', ((size_t)16 << 20) + 1);
    big[((size_t)16 << 20) + 1] = 0;
    bad_line(&b, big, LD_BAD_TOO_LONG);
    free(big);
    for (int i = 0; i < 100; i++) good_line(&b, id++, "\n");
    void *z2 = tu_zstd_frame(b.p, b.n, &z2n);
    tu_sbuf zb = {0};
    tu_sb_add(&zb, z1, z1n);
    tu_sb_add(&zb, z2, z2n);
    tu_write_file(g_dir, "b.jsonl.zst", zb.p, zb.n);
    free(z1), free(z2), free(zb.p);

    /* c.jsonl.zst: one complete frame, then a second frame cut after its header */
    b.n = 0;
    for (int i = 0; i < 50; i++) good_line(&b, id++, "\n");
    z1 = tu_zstd_frame(b.p, b.n, &z1n);
    z2 = tu_zstd_frame("{\"never\":1}\n", 12, &z2n);
    zb.p = NULL, zb.n = zb.cap = 0;
    tu_sb_add(&zb, z1, z1n);
    tu_sb_add(&zb, z2, 6);
    tu_write_file(g_dir, "c.jsonl.zst", zb.p, zb.n);
    e_bad[LD_BAD_ZSTD]++;
    free(z1), free(z2), free(zb.p), free(b.p);

    /* d.jsonl: empty */
    tu_write_file(g_dir, "d.jsonl", "", 0);
    assert_int_equal(id, N_GOOD);
}

static int setup(void **state) {
    (void)state;
    if (tu_load_tokenizer(&g_tok)) return -1;
    if (!getenv("BT_LOG_LEVEL")) bt_log_set_level(BT_LOG_ERROR); /* bad lines are expected here */
    if (tu_make_tmpdir(g_dir, sizeof g_dir, "pipeline")) return -1;
    make_shards();
    return 0;
}

static int teardown(void **state) {
    (void)state;
    bt_tokenizer_free(g_tok);
    return tu_remove_dir(g_dir);
}

static void make_spec(ld_job_spec *spec, int threads, int epochs, const char *extra) {
    char json[2048];
    snprintf(json, sizeof json,
             "{\"name\":\"t\",\"shards\":[\"%s/*.jsonl\",\"%s/*.zst\",\"%s/a.jsonl\"],\"format\":\"chat\","
             "\"tokenizer\":\"%s\",\"seq_len\":%d,\"micro_batch_size\":%d,\"seed\":7,\"epochs\":%d,"
             "\"tokenizer_threads\":%d%s}",
             g_dir, g_dir, g_dir, tu_model_path(), T_TEST, B_TEST, epochs, threads, extra ? extra : "");
    int rc = ld_job_spec_parse(spec, json, NULL);
    if (rc != BT_OK) fail_msg("spec: %s", bt_last_error());
}

typedef struct {
    uint8_t **slots;
    size_t n; /* batches before END */
    int ended;
    const ld_job_spec *spec;
} run_t;

/* keeps a copy of every batch (the END one included) */
static void keep_batch(void *ctx, ld_pipeline *p, bt_batch_view *v, int is_end) {
    run_t *r = ctx;
    assert_int_equal(v->hdr->job_id, 9);
    assert_int_equal(v->hdr->rank, r->spec->rank);
    size_t bytes = bt_batch_slot_bytes(r->spec->B, r->spec->T);
    uint8_t *slot = aligned_alloc(64, bytes);
    memcpy(slot, v->hdr, bytes); /* the view starts at its slot */
    r->slots = realloc(r->slots, (r->n + 1) * sizeof *r->slots);
    r->slots[r->n] = slot;
    if (is_end) {
        assert_true(v->hdr->flags & BT_BATCH_F_END_OF_DATA);
        assert_int_equal(v->hdr->n_real_tokens, 0);
        r->ended = 1;
        /* END is sticky */
        assert_int_equal(ld_pipeline_next(p, v, 9), 1);
        return;
    }
    assert_int_equal(v->hdr->flags, 0);
    r->n++;
}

/* Run a pipeline; collect up to max_batches batches (to END when max_batches == 0). */
static run_t run_pipeline(const ld_job_spec *spec, const uint8_t *resume, ld_stats *st, size_t max_batches,
                          uint64_t step0) {
    run_t r = {.spec = spec};
    tu_run_pipeline(spec, g_tok, resume, st, max_batches, step0, 9, keep_batch, &r);
    return r;
}

static void free_run(run_t *r) {
    for (size_t i = 0; i < r->n + (size_t)r->ended; i++) free(r->slots[i]);
    free(r->slots);
}

/* Doc ids (from the "ID<k>;" marker) of every segment of every batch; counts[k]++. */
static void collect_docs(const run_t *r, const ld_job_spec *spec, int *counts, uint64_t *real) {
    for (size_t b = 0; b < r->n; b++) {
        bt_batch_view v;
        bt_batch_view_init(&v, r->slots[b], spec->B, spec->T);
        uint32_t segs = 0;
        for (uint32_t s = 0; s + 1 < v.hdr->n_cu; s++) {
            int32_t a = v.cu_seqlens[s], e = v.cu_seqlens[s + 1];
            char *txt;
            size_t len;
            assert_int_equal(bt_detokenize(g_tok, v.input_ids + a, (size_t)(e - a), 1, &txt, &len), BT_OK);
            const char *m = strstr(txt, "<|im_start|>user\nID");
            if (m) {
                int k = atoi(m + strlen("<|im_start|>user\nID"));
                assert_true(k >= 0 && k < N_GOOD);
                counts[k]++;
                segs++;
                if (real) *real += (uint64_t)(e - a);
            } else {
                for (int32_t t = a; t < e; t++) assert_int_equal(v.labels[t], BT_LABEL_IGNORE); /* padding */
            }
            free(txt);
        }
        assert_int_equal(segs, v.hdr->n_docs);
    }
}

static void test_jobspec(void **state) {
    (void)state;
    ld_job_spec s;
    assert_int_equal(ld_job_spec_parse(&s, "{\"shards\":[\"x\"],\"format\":\"text\",\"tokenizer\":\"t.gguf\","
                                           "\"seq_len\":512,\"micro_batch_size\":2,\"ring_slots\":8}",
                                       NULL), BT_OK);
    assert_int_equal(s.n_threads, 2);
    assert_int_equal(s.T, 512);
    assert_int_equal(s.B, 2);
    assert_int_equal(s.epochs, 0);
    assert_int_equal(s.world_size, 1);
    assert_string_equal(s.text_field, "text");
    assert_int_equal(s.format, LD_FMT_TEXT);
    ld_job_spec_free(&s);
    struct {
        const char *json, *key;
    } bad[] = {
        {"{\"shards\":[\"x\"],\"format\":\"chat\",\"tokenizer\":\"t\",\"seq_len\":512,\"micro_batch_size\":2,\"bogus\":1}", "bogus"},
        {"{\"shards\":\"x\",\"format\":\"chat\",\"tokenizer\":\"t\",\"seq_len\":512,\"micro_batch_size\":2}", "shards"},
        {"{\"shards\":[1],\"format\":\"chat\",\"tokenizer\":\"t\",\"seq_len\":512,\"micro_batch_size\":2}", "shards[0]"},
        {"{\"shards\":[\"x\"],\"format\":\"xml\",\"tokenizer\":\"t\",\"seq_len\":512,\"micro_batch_size\":2}", "format"},
        {"{\"shards\":[\"x\"],\"format\":\"chat\",\"tokenizer\":\"t\",\"seq_len\":8,\"micro_batch_size\":2}", "seq_len"},
        {"{\"shards\":[\"x\"],\"format\":\"chat\",\"tokenizer\":\"t\",\"seq_len\":2000000,\"micro_batch_size\":2}", "seq_len"},
        {"{\"shards\":[\"x\"],\"format\":\"chat\",\"tokenizer\":\"t\",\"seq_len\":\"512\",\"micro_batch_size\":2}", "seq_len"},
        {"{\"shards\":[\"x\"],\"format\":\"chat\",\"tokenizer\":\"t\",\"seq_len\":512,\"micro_batch_size\":0}", "micro_batch_size"},
        {"{\"shards\":[\"x\"],\"format\":\"chat\",\"tokenizer\":\"t\",\"seq_len\":1048576,\"micro_batch_size\":17}", "micro_batch_size"},
        {"{\"shards\":[\"x\"],\"format\":\"chat\",\"tokenizer\":\"t\",\"seq_len\":512,\"micro_batch_size\":2,\"tokenizer_threads\":0}", "tokenizer_threads"},
        {"{\"shards\":[\"x\"],\"format\":\"chat\",\"tokenizer\":\"t\",\"seq_len\":512,\"micro_batch_size\":2,\"seed\":-1}", "seed"},
        {"{\"shards\":[\"x\"],\"format\":\"chat\",\"tokenizer\":\"t\",\"seq_len\":512,\"micro_batch_size\":2,\"epochs\":1.5}", "epochs"},
        {"{\"shards\":[\"x\"],\"format\":\"chat\",\"seq_len\":512,\"micro_batch_size\":2}", "tokenizer"},
        {"{\"shards\":[\"x\"],\"format\":\"chat\",\"tokenizer\":\"t\",\"micro_batch_size\":2}", "seq_len"},
        {"{\"shards\":[\"x\"],\"format\":\"chat\",\"tokenizer\":\"t\",\"seq_len\":512,\"micro_batch_size\":2,\"text_field\":\"x\"}", "text_field"},
        {"{\"shards\":[\"x\"],\"format\":\"chat\",\"tokenizer\":\"t\",\"seq_len\":512,\"micro_batch_size\":2,\"ring_slots\":\"8\"}", "ring_slots"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        bt_keypath key;
        assert_int_equal(ld_job_spec_parse(&s, bad[i].json, &key), BT_ERR_INVALID);
        char want[64];
        snprintf(want, sizeof want, "\"%s\"", bad[i].key);
        if (!strstr(bt_last_error(), want)) fail_msg("case %zu: error \"%s\" does not name %s", i, bt_last_error(), want);
        assert_string_equal(key.s, bad[i].key); /* the key, as data */
    }
    assert_int_equal(ld_job_spec_parse(&s, "[1]", NULL), BT_ERR_INVALID);
    assert_int_equal(ld_job_spec_parse(&s, "{", NULL), BT_ERR_INVALID);
    ld_job_spec_free(&s); /* after a failed parse: zeroed, harmless */
}

static void test_glob_errors(void **state) {
    (void)state;
    ld_job_spec spec;
    make_spec(&spec, 1, 1, NULL);
    free(spec.shards[1]);
    spec.shards[1] = strdup("/nonexistent/dir/*.jsonl");
    ld_pipeline *p = NULL;
    assert_int_equal(ld_pipeline_new(&p, &spec, g_tok, NULL, NULL), BT_ERR_NOTFOUND);
    assert_null(p);
    assert_non_null(strstr(bt_last_error(), "/nonexistent/dir/*.jsonl"));
    /* a literal file name holding glob characters is taken as it is */
    tu_write_file(g_dir, "lit[1].jsonl", "", 0);
    char lit[256];
    snprintf(lit, sizeof lit, "%s/lit[1].jsonl", g_dir);
    free(spec.shards[1]);
    spec.shards[1] = strdup(lit);
    spec.epochs = 1;
    assert_int_equal(ld_pipeline_new(&p, &spec, g_tok, NULL, NULL), BT_OK);
    ld_pipeline_free(p);
    ld_job_spec_free(&spec);
    snprintf(lit, sizeof lit, "rm -f '%s/lit[1].jsonl'", g_dir);
    assert_int_equal(system(lit), 0);
}

static void test_counts_and_coverage(void **state) {
    (void)state;
    ld_job_spec spec;
    make_spec(&spec, 2, 1, NULL);
    ld_stats st;
    memset(&st, 0, sizeof st);
    run_t r = run_pipeline(&spec, NULL, &st, 0, 0);
    assert_true(r.ended);
    for (int k = 0; k < LD_BAD_N; k++)
        if (st.bad[k] != e_bad[k])
            fail_msg("bad[%s] = %llu, want %llu", ld_bad_reason_name(k), (unsigned long long)st.bad[k],
                     (unsigned long long)e_bad[k]);
    assert_int_equal(st.lines, e_lines);
    assert_int_equal(st.blank, e_blank);
    assert_int_equal(st.docs, e_good);
    assert_int_equal(st.truncated, 1);
    assert_int_equal(st.batches, r.n);
    assert_int_equal(st.slot_tokens, (uint64_t)r.n * B_TEST * T_TEST);
    assert_int_equal(st.epoch, 1);
    int counts[N_GOOD] = {0};
    uint64_t real = 0, hdr_real = 0, hdr_lab = 0;
    collect_docs(&r, &spec, counts, &real);
    for (int k = 0; k < N_GOOD; k++)
        if (counts[k] != 1) fail_msg("doc %d seen %d times", k, counts[k]);
    for (size_t b = 0; b < r.n; b++) {
        bt_batch_view v;
        bt_batch_view_init(&v, r.slots[b], B_TEST, T_TEST);
        hdr_real += v.hdr->n_real_tokens;
        hdr_lab += v.hdr->n_labelled_tokens;
        assert_int_equal(v.hdr->epoch, 0);
    }
    assert_int_equal(real, hdr_real);
    assert_int_equal(st.tokens, hdr_real);
    assert_int_equal(st.labelled, hdr_lab);
    double eff = (double)hdr_real / (double)st.slot_tokens;
    print_message("chat docs at T=%d: %zu batches, packing efficiency %.3f\n", T_TEST, r.n, eff);
    assert_true(eff > 0.85);
    free_run(&r);
    ld_job_spec_free(&spec);
}

static void test_threads_identical(void **state) {
    (void)state;
    ld_job_spec s1, s3;
    make_spec(&s1, 1, 1, NULL);
    make_spec(&s3, 3, 1, NULL);
    run_t a = run_pipeline(&s1, NULL, NULL, 0, 0), b = run_pipeline(&s3, NULL, NULL, 0, 0);
    assert_int_equal(a.n, b.n);
    size_t bytes = bt_batch_slot_bytes(B_TEST, T_TEST);
    for (size_t i = 0; i <= a.n; i++) assert_memory_equal(a.slots[i], b.slots[i], bytes);
    /* a different seed changes the order */
    ld_job_spec s9;
    make_spec(&s9, 2, 1, NULL);
    s9.seed = 8;
    run_t c = run_pipeline(&s9, NULL, NULL, 0, 0);
    int differ = 0;
    for (size_t i = 0; i < a.n && i < c.n; i++) {
        bt_batch_view va, vc;
        bt_batch_view_init(&va, a.slots[i], B_TEST, T_TEST);
        bt_batch_view_init(&vc, c.slots[i], B_TEST, T_TEST);
        differ |= va.hdr->checksum != vc.hdr->checksum;
    }
    assert_true(differ);
    free_run(&a), free_run(&b), free_run(&c);
    ld_job_spec_free(&s1), ld_job_spec_free(&s3), ld_job_spec_free(&s9);
}

static void test_ranks_partition(void **state) {
    (void)state;
    int counts[N_GOOD] = {0};
    uint64_t bad_sum[LD_BAD_N] = {0}, docs = 0;
    size_t n_batches[2] = {0, 0};
    for (uint32_t rank = 0; rank < 2; rank++) {
        ld_job_spec spec;
        make_spec(&spec, 2, 1, NULL);
        spec.rank = rank;
        spec.world_size = 2;
        ld_stats st;
        memset(&st, 0, sizeof st);
        run_t r = run_pipeline(&spec, NULL, &st, 0, 0);
        int mine[N_GOOD] = {0};
        collect_docs(&r, &spec, mine, NULL);
        int n_mine = 0;
        for (int k = 0; k < N_GOOD; k++) counts[k] += mine[k], n_mine += mine[k];
        assert_true(n_mine > N_GOOD / 3 && n_mine < 2 * N_GOOD / 3);
        n_batches[rank] = r.n;
        for (int k = 0; k < LD_BAD_N; k++) bad_sum[k] += st.bad[k];
        docs += st.docs;
        assert_int_equal(st.bad[LD_BAD_ZSTD], 1); /* every rank reads and parses every line */
        assert_int_equal(st.lines, e_lines);
        free_run(&r);
        ld_job_spec_free(&spec);
    }
    for (int k = 0; k < N_GOOD; k++) assert_int_equal(counts[k], 1);
    assert_int_equal(n_batches[0], n_batches[1]); /* rows dealt evenly, windows padded */
    assert_int_equal(docs, 2 * e_good);
    for (int k = 0; k < LD_BAD_N; k++) assert_int_equal(bad_sum[k], 2 * e_bad[k]);
}

static void test_resume_and_epochs(void **state) {
    (void)state;
    ld_job_spec spec;
    make_spec(&spec, 2, 2, NULL);
    run_t full = run_pipeline(&spec, NULL, NULL, 0, 0);
    assert_true(full.ended);
    int counts[N_GOOD] = {0};
    collect_docs(&full, &spec, counts, NULL);
    for (int k = 0; k < N_GOOD; k++) assert_int_equal(counts[k], 2); /* epochs = 2 */
    int saw_epoch1 = 0;
    size_t bytes = bt_batch_slot_bytes(B_TEST, T_TEST);
    /* resume after several points, including window and epoch boundaries, must replay exactly */
    /* every 9th batch, around the epoch boundary, the last real batch and after it, and the
     * batches that cross into a new window (bytes 32..39 of the state: window start) */
    size_t points[128], n_points = 0;
    for (size_t k = 1; k < full.n && n_points < 56; k += 9) points[n_points++] = k;
    size_t extra[] = {full.n / 2 - 1, full.n / 2, full.n / 2 + 1, full.n - 1, full.n};
    for (size_t i = 0; i < 5; i++) points[n_points++] = extra[i];
    size_t n_fixed = n_points;
    for (size_t k = 1; k + 1 < full.n && n_points < 120; k++) {
        bt_batch_view a, b;
        bt_batch_view_init(&a, full.slots[k - 1], B_TEST, T_TEST);
        bt_batch_view_init(&b, full.slots[k], B_TEST, T_TEST);
        if (memcmp(a.hdr->resume_state + 32, b.hdr->resume_state + 32, 8) != 0) points[n_points++] = k;
    }
    int saw_window_boundary = n_points > n_fixed + 2; /* window crossings besides the epochs' */
    for (size_t i = 0; i < n_points; i++) {
        size_t k = points[i];
        bt_batch_view v;
        bt_batch_view_init(&v, full.slots[k - (k > 0)], B_TEST, T_TEST);
        uint8_t state_bytes[BT_RESUME_STATE_BYTES];
        memcpy(state_bytes, v.hdr->resume_state, sizeof state_bytes);
        if (k == 0) continue;
        /* bytes 40..47 of the state: rows of the window already emitted (0 = at a boundary) */
        uint64_t rows_done = 0;
        memcpy(&rows_done, state_bytes + 40, 8);
        saw_window_boundary |= rows_done == 0 && k < full.n;
        ld_job_spec s2;
        make_spec(&s2, 3, 2, NULL);
        run_t r = run_pipeline(&s2, state_bytes, NULL, 0, k);
        assert_int_equal(r.n + k, full.n);
        for (size_t j = 0; j <= r.n; j++) {
            if (memcmp(r.slots[j], full.slots[k + j], bytes) != 0) {
                bt_batch_view x, y;
                bt_batch_view_init(&x, r.slots[j], B_TEST, T_TEST);
                bt_batch_view_init(&y, full.slots[k + j], B_TEST, T_TEST);
                size_t off = 0;
                while (r.slots[j][off] == full.slots[k + j][off]) off++;
                fail_msg("resume after batch %zu (of %zu): batch %zu differs at byte %zu: step %llu/%llu flags %u/%u "
                         "real %u/%u epoch %u/%u",
                         k, full.n, k + j, off, (unsigned long long)x.hdr->step, (unsigned long long)y.hdr->step,
                         x.hdr->flags, y.hdr->flags, x.hdr->n_real_tokens, y.hdr->n_real_tokens,
                         x.hdr->epoch, y.hdr->epoch);
            }
        }
        free_run(&r);
        ld_job_spec_free(&s2);
    }
    for (size_t b = 0; b < full.n; b++) {
        bt_batch_view v;
        bt_batch_view_init(&v, full.slots[b], B_TEST, T_TEST);
        saw_epoch1 |= v.hdr->epoch == 1;
    }
    assert_true(saw_epoch1);
    assert_true(saw_window_boundary);
    /* a state from another spec is refused */
    bt_batch_view v;
    bt_batch_view_init(&v, full.slots[3], B_TEST, T_TEST);
    ld_job_spec s3;
    make_spec(&s3, 1, 2, NULL);
    s3.seed = 99;
    ld_pipeline *p = NULL;
    assert_int_equal(ld_pipeline_new(&p, &s3, g_tok, v.hdr->resume_state, NULL), BT_ERR_INVALID);
    assert_null(p);
    free_run(&full);
    ld_job_spec_free(&spec), ld_job_spec_free(&s3);
}

/* Row i (over batches: batch i / B, row i % B) of run r: its input_ids, labels and position_ids
 * equal row j of run s. */
static void assert_same_row(const run_t *r, size_t i, const run_t *s, size_t j) {
    bt_batch_view a, b;
    assert_true(i / B_TEST < r->n && j / B_TEST < s->n);
    bt_batch_view_init(&a, r->slots[i / B_TEST], B_TEST, T_TEST);
    bt_batch_view_init(&b, s->slots[j / B_TEST], B_TEST, T_TEST);
    size_t oa = i % B_TEST * T_TEST, ob = j % B_TEST * T_TEST;
    assert_memory_equal(a.input_ids + oa, b.input_ids + ob, T_TEST * sizeof *a.input_ids);
    assert_memory_equal(a.labels + oa, b.labels + ob, T_TEST * sizeof *a.labels);
    assert_memory_equal(a.position_ids + oa, b.position_ids + ob, T_TEST * sizeof *a.position_ids);
}

/* A job resumed on another number of ranks (issue 26, spec.resume_world): rank 0's state of two
 * ranks after one batch each (rows 0 .. 2B-1 of the window consumed) continues one rank at row 2B
 * (then 2B+1, ...: the two ranks' rows interleaved) and rank r of four at row 2B + r; three ranks
 * (2B = 8 not a multiple of 3) and a rank-1 state are refused. */
static void test_resume_on_another_world_size(void **state) {
    (void)state;
    run_t two[2];
    uint8_t st0[BT_RESUME_STATE_BYTES], st1[BT_RESUME_STATE_BYTES];
    for (uint32_t q = 0; q < 2; q++) {
        ld_job_spec spec;
        make_spec(&spec, 2, 1, NULL);
        spec.rank = q;
        spec.world_size = 2;
        two[q] = run_pipeline(&spec, NULL, NULL, 3, 0);
        assert_int_equal(two[q].n, 3);
        bt_batch_view v;
        bt_batch_view_init(&v, two[q].slots[0], B_TEST, T_TEST);
        memcpy(q ? st1 : st0, v.hdr->resume_state, BT_RESUME_STATE_BYTES);
        ld_job_spec_free(&spec);
    }
    ld_job_spec one;
    make_spec(&one, 1, 1, NULL);
    one.resume_world = 2;
    run_t r1 = run_pipeline(&one, st0, NULL, 2, 1);
    for (size_t j = 0; j < 2 * B_TEST; j++) assert_same_row(&r1, j, &two[j % 2], B_TEST + j / 2);
    ld_job_spec four;
    make_spec(&four, 1, 1, NULL);
    four.world_size = 4;
    four.resume_world = 2;
    for (uint32_t q = 0; q < 4; q++) {
        four.rank = q;
        run_t r4 = run_pipeline(&four, st0, NULL, 1, 1);
        for (size_t j = 0; j < B_TEST; j++) { /* global row 2B + 4j + q: rank (q % 2), its row B + 2j + q/2 */
            if (B_TEST + 2 * j + q / 2 < 3 * B_TEST) assert_same_row(&r4, j, &two[q % 2], B_TEST + 2 * j + q / 2);
        }
        free_run(&r4);
    }
    ld_pipeline *p = NULL;
    four.rank = 0;
    four.world_size = 3;
    assert_int_equal(ld_pipeline_new(&p, &four, g_tok, st0, NULL), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "2 rank(s) stopped 8 rows into a window, not a multiple of this run's 3"));
    assert_null(p);
    assert_int_equal(ld_pipeline_new(&p, &one, g_tok, st1, NULL), BT_ERR_INVALID); /* rank 1's state */
    assert_non_null(strstr(bt_last_error(), "not rank 0's state of a job of world size 2"));
    one.resume_world = 0; /* without it, rank 0 of two's state is another spec's */
    assert_int_equal(ld_pipeline_new(&p, &one, g_tok, st0, NULL), BT_ERR_INVALID);
    free_run(&r1), free_run(&two[0]), free_run(&two[1]);
    ld_job_spec_free(&one), ld_job_spec_free(&four);
}

static void test_endless(void **state) {
    (void)state;
    ld_job_spec spec;
    make_spec(&spec, 2, 0, NULL);
    ld_stats st;
    memset(&st, 0, sizeof st);
    /* enough batches for more than two epochs */
    run_t r = run_pipeline(&spec, NULL, &st, 600, 0);
    assert_int_equal(r.n, 600);
    assert_false(r.ended);
    bt_batch_view v;
    bt_batch_view_init(&v, r.slots[599], B_TEST, T_TEST);
    assert_true(v.hdr->epoch >= 2);
    assert_true(st.epoch >= 2);
    free_run(&r);
    ld_job_spec_free(&spec);
}

static void test_text_split(void **state) {
    (void)state;
    /* text docs of many lengths, some longer than T (split into pieces, none lost) */
    tu_sbuf s = {0};
    uint64_t want_tokens = 0;
    for (int i = 0; i < 40; i++) {
        char body[8192];
        int k = 0;
        for (int w = 0; w < (i * 37) % 500 + 1; w++) k += snprintf(body + k, sizeof body - (size_t)k, "t%d ", w);
        bt_ids ids = {0};
        assert_int_equal(bt_tokenize(g_tok, body, (size_t)k, 0, &ids), BT_OK);
        want_tokens += ids.n + 1; /* + EOS */
        bt_ids_free(&ids);
        tu_sb_str(&s, "{\"body\":\"");
        tu_sb_str(&s, body);
        tu_sb_str(&s, "\"}\n");
    }
    char path[256];
    snprintf(path, sizeof path, "%s/text/", g_dir);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "mkdir -p '%s'", path);
    assert_int_equal(system(cmd), 0);
    tu_write_file(g_dir, "text/t.jsonl", s.p, s.n);
    free(s.p);
    char json[1024];
    snprintf(json, sizeof json, "{\"shards\":[\"%s/text/*.jsonl\"],\"format\":\"text\",\"text_field\":\"body\","
             "\"tokenizer\":\"%s\",\"seq_len\":64,\"micro_batch_size\":3,\"epochs\":1,\"seed\":1}", g_dir, tu_model_path());
    ld_job_spec spec;
    assert_int_equal(ld_job_spec_parse(&spec, json, NULL), BT_OK);
    ld_stats st;
    memset(&st, 0, sizeof st);
    run_t r = run_pipeline(&spec, NULL, &st, 0, 0);
    assert_int_equal(st.tokens, want_tokens);
    assert_int_equal(st.docs, 40);
    assert_int_equal(st.truncated, 0);
    uint64_t labelled = 0, pieces = 0;
    for (size_t b = 0; b < r.n; b++) {
        bt_batch_view v;
        bt_batch_view_init(&v, r.slots[b], 3, 64);
        labelled += v.hdr->n_labelled_tokens;
        pieces += v.hdr->n_docs;
    }
    assert_true(pieces > 40);                     /* long docs were split */
    assert_int_equal(labelled, want_tokens - pieces); /* all but each piece's first token */
    free_run(&r);
    ld_job_spec_free(&spec);
}

static void test_no_valid_docs(void **state) {
    (void)state;
    char cmd[300];
    snprintf(cmd, sizeof cmd, "mkdir -p '%s/bad/sub.jsonl'", g_dir); /* a directory: unreadable shard */
    assert_int_equal(system(cmd), 0);
    const char *lines = "{\"messages\":[]}\nnot json\n\n";
    tu_write_file(g_dir, "bad/only_bad.jsonl", lines, strlen(lines));
    for (int epochs = 1; epochs >= 0; epochs--) {
        char json[1024];
        snprintf(json, sizeof json, "{\"shards\":[\"%s/bad/*.jsonl\"],\"format\":\"chat\",\"tokenizer\":\"%s\","
                 "\"seq_len\":64,\"micro_batch_size\":2,\"epochs\":%d}", g_dir, tu_model_path(), epochs);
        ld_job_spec spec;
        assert_int_equal(ld_job_spec_parse(&spec, json, NULL), BT_OK);
        ld_stats st;
        memset(&st, 0, sizeof st);
        ld_pipeline *p = NULL;
        assert_int_equal(ld_pipeline_new(&p, &spec, g_tok, NULL, &st), BT_OK);
        size_t bytes = bt_batch_slot_bytes(2, 64);
        uint8_t *slot = aligned_alloc(64, bytes);
        bt_batch_view v;
        bt_batch_view_init(&v, slot, 2, 64);
        if (epochs == 1) { /* finite: nothing to train on, END right away */
            assert_int_equal(ld_pipeline_next(p, &v, 1), 1);
            assert_int_equal(v.hdr->step, 0);
            assert_true(v.hdr->flags & BT_BATCH_F_END_OF_DATA);
            assert_int_equal(bt_batch_validate(&v, 2, 64, 0), BT_OK);
        } else { /* endless: an error (sticky), never a hang */
            assert_int_equal(ld_pipeline_next(p, &v, 1), BT_ERR_FORMAT);
            assert_non_null(strstr(bt_last_error(), "no valid documents"));
            assert_int_equal(ld_pipeline_next(p, &v, 1), BT_ERR_FORMAT);
        }
        /* line-level reasons are counted in order by the consumer: exact. Shard-level ones and
         * blank lines are counted by the reader, which may already be into the next epoch. */
        assert_int_equal(st.bad[LD_BAD_EMPTY], 1);
        assert_int_equal(st.bad[LD_BAD_JSON], 1);
        if (epochs == 1) {
            assert_int_equal(st.bad[LD_BAD_IO], 1);
            assert_int_equal(st.blank, 1);
        } else {
            assert_true(st.bad[LD_BAD_IO] >= 1 && st.blank >= 1);
        }
        assert_int_equal(st.docs, 0);
        ld_pipeline_free(p);
        free(slot);
        ld_job_spec_free(&spec);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_jobspec),
        cmocka_unit_test(test_glob_errors),
        cmocka_unit_test(test_counts_and_coverage),
        cmocka_unit_test(test_threads_identical),
        cmocka_unit_test(test_ranks_partition),
        cmocka_unit_test(test_resume_and_epochs),
        cmocka_unit_test(test_resume_on_another_world_size),
        cmocka_unit_test(test_endless),
        cmocka_unit_test(test_text_split),
        cmocka_unit_test(test_no_valid_docs),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
