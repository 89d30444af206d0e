/* Pipeline helpers for unit tests. See pipeline_util.h. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "tests/unit/util/pipeline_util.h"

size_t tu_run_pipeline(const ld_job_spec *spec, const bt_tokenizer *tok, const uint8_t *resume,
                       ld_stats *st, size_t max, uint64_t step0, uint32_t job_id, tu_batch_fn fn,
                       void *ctx) {
    ld_pipeline *p = NULL;
    if (ld_pipeline_new(&p, spec, tok, resume, st) != BT_OK)
        fail_msg("pipeline_new: %s", bt_last_error());
    size_t bytes = bt_batch_slot_bytes(spec->B, spec->T), n = 0;
    uint8_t *slot = aligned_alloc(64, bytes);
    assert_non_null(slot);
    for (;;) {
        memset(slot, 0xAB, bytes);
        bt_batch_view v;
        bt_batch_view_init(&v, slot, spec->B, spec->T);
        int rc = ld_pipeline_next(p, &v, job_id);
        if (rc < 0) fail_msg("next: %s", bt_last_error());
        if (bt_batch_validate(&v, spec->B, spec->T, bt_tokenizer_vocab_size(tok)) != BT_OK)
            fail_msg("invalid batch: %s", bt_last_error());
        assert_int_equal(v.hdr->step, step0 + n);
        fn(ctx, p, &v, rc == 1);
        if (rc == 1) break;
        n++;
        if (max && n == max) break;
    }
    free(slot);
    ld_pipeline_free(p);
    return n;
}

void tu_write_two_datasets(const char *dir, int n_chat, int n_text, int blank_every, int long_every) {
    tu_sbuf a1 = {0}, a2 = {0}, bt = {0};
    char tmp[4096];
    for (int i = 0; i < n_chat; i++) {
        tu_sbuf *b = i < n_chat / 2 ? &a1 : &a2;
        int k = snprintf(tmp, sizeof tmp, "{\"messages\":[{\"role\":\"user\",\"content\":\"ID%d; q\"},"
                                          "{\"role\":\"assistant\",\"content\":\"a", i);
        for (int w = 0; w < (i * 13) % 40; w++) k += snprintf(tmp + k, sizeof tmp - (size_t)k, " w%d", w);
        snprintf(tmp + k, sizeof tmp - (size_t)k, "\"}]}\n");
        tu_sb_str(b, tmp);
        if (i % 97 == 0) tu_sb_str(b, "{broken json\n"); /* counted, skipped */
        if (blank_every > 0 && i % blank_every == 5) tu_sb_str(b, "\n");
    }
    tu_write_file(dir, "a1.jsonl", a1.p, a1.n);
    size_t zn;
    void *z = tu_zstd_frame(a2.p, a2.n, &zn);
    tu_write_file(dir, "a2.jsonl.zst", z, zn);
    for (int i = 0; i < n_text; i++) {
        int k = snprintf(tmp, sizeof tmp, "{\"body\":\"TX%d; text", i);
        int words = long_every > 0 && i % long_every == 0 ? 150 : i % 30; /* longer than T: split */
        for (int w = 0; w < words; w++) k += snprintf(tmp + k, sizeof tmp - (size_t)k, " v%d", w);
        snprintf(tmp + k, sizeof tmp - (size_t)k, "\"}\n");
        tu_sb_str(&bt, tmp);
    }
    tu_write_file(dir, "b.jsonl", bt.p, bt.n);
    free(a1.p), free(a2.p), free(bt.p), free(z);
}

void tu_two_dataset_spec(ld_job_spec *spec, const char *dir, uint32_t T, uint32_t B, uint64_t seed, int epochs,
                         int threads, uint32_t rank, uint32_t world) {
    char json[2048];
    snprintf(json, sizeof json,
             "{\"datasets\":[{\"shards\":[\"%s/a*.jsonl*\"],\"format\":\"chat\",\"weight\":2},"
             "{\"shards\":[\"%s/b.jsonl\"],\"format\":\"text\",\"text_field\":\"body\",\"weight\":1}],"
             "\"tokenizer\":\"%s\",\"seq_len\":%u,\"micro_batch_size\":%u,\"seed\":%llu,\"epochs\":%d,"
             "\"tokenizer_threads\":%d}",
             dir, dir, tu_model_path(), T, B, (unsigned long long)seed, epochs, threads);
    if (ld_job_spec_parse(spec, json, NULL) != BT_OK) fail_msg("spec: %s", bt_last_error());
    spec->rank = rank;
    spec->world_size = world;
}
