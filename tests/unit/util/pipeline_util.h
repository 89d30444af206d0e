/* Pipeline helpers shared by the loaderd pipeline unit tests (test_pipeline, test_determinism):
 * a loop that drives a loaderd pipeline to END and hands every batch to a callback. Compiled
 * into every test binary like the rest of tests/unit/util. */
#ifndef BT_TEST_PIPELINE_UTIL_H
#define BT_TEST_PIPELINE_UTIL_H
#include <stddef.h>
#include <stdint.h>

#include "common/tokenizer.h"
#include "loaderd/pipeline.h"
#include "proto/batch.h"
#include "tests/unit/util/test_util.h"

/* Called by tu_run_pipeline for every batch: is_end = 1 for the END batch (the last call). The
 * view points into the runner's slot, valid only during the call; p may be used (e.g. to check
 * that END is sticky). */
typedef void (*tu_batch_fn)(void *ctx, ld_pipeline *p, bt_batch_view *v, int is_end);

/* Create a pipeline for spec (tokenizer tok, resume state or NULL, stats st or NULL) and pull
 * batches with job_id until END, or until max batches before END when max > 0. Every batch is
 * pulled into a slot pre-filled with 0xAB, must validate (bt_batch_validate against the
 * tokenizer's vocabulary) and carry step step0 + its index; then fn(ctx, ...) sees it.
 * Returns the number of batches before END (END itself not counted). Fails the test on error. */
size_t tu_run_pipeline(const ld_job_spec *spec, const bt_tokenizer *tok, const uint8_t *resume,
                       ld_stats *st, size_t max, uint64_t step0, uint32_t job_id, tu_batch_fn fn,
                       void *ctx);

/* Two datasets written into dir, as the pipeline tests use them: "a1.jsonl" and "a2.jsonl.zst"
 * (n_chat chat documents "ID<k>; q" -> "a w0 w1 ..." with (k * 13) % 40 words, split in half,
 * the second half one zstd frame; a broken JSON line after every k % 97 == 0; a blank line
 * after every k % blank_every == 5 when blank_every > 0) and "b.jsonl" (n_text text documents
 * {"body": "TX<k>; text v0 v1 ..."} of k % 30 words, 150 words when long_every > 0 and
 * k % long_every == 0). Asserts on failure. */
void tu_write_two_datasets(const char *dir, int n_chat, int n_text, int blank_every, int long_every);

/* The job spec over those datasets (chat weight 2 on a*.jsonl*, text weight 1 on b.jsonl with
 * text_field "body") with the given seq_len, micro_batch_size, seed, epochs and tokenizer
 * threads; rank and world_size set. Fails the test when it does not parse. */
void tu_two_dataset_spec(ld_job_spec *spec, const char *dir, uint32_t T, uint32_t B, uint64_t seed, int epochs,
                         int threads, uint32_t rank, uint32_t world);

#endif
