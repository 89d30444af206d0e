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

#endif
