/* Pipeline helpers for unit tests. See pipeline_util.h. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

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
