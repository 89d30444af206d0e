/* proto/batch.c: slot layout, checksum and bt_batch_validate catching each kind of corruption. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/bt_common.h"
#include "proto/batch.h"

#define NB 2
#define NT 8
#define VOCAB 100

typedef struct {
    void *mem;
    bt_batch_view v;
} fixture;

/* Row 0: doc A (5 tokens, prompt 2) + doc B (3 tokens); row 1: doc C (6 tokens) + padding (2).
 * Segments: [0,5) [5,8) [8,14) [14,16) -> n_cu = 5. */
static void fill_valid(bt_batch_view *v) {
    bt_batch_header *h = v->hdr;
    memset(h, 0, sizeof *h);
    h->magic = BT_BATCH_MAGIC;
    h->layout_version = BT_BATCH_LAYOUT_VERSION;
    h->job_id = 3;
    h->rank = 0;
    h->step = 7;
    h->B = NB;
    h->T = NT;
    static const int32_t cu[] = {0, 5, 8, 14, 16};
    memcpy(v->cu_seqlens, cu, sizeof cu);
    h->n_cu = 5;
    h->n_docs = 3;
    uint32_t labelled = 0;
    for (uint32_t k = 0; k + 1 < h->n_cu; k++) {
        for (int32_t t = cu[k]; t < cu[k + 1]; t++) {
            v->input_ids[t] = (t * 7 + 1) % VOCAB;
            v->position_ids[t] = t - cu[k];
            int pad = k == 3, prompt = (k == 0 && t - cu[k] < 2) || t == cu[k];
            v->labels[t] = (pad || prompt) ? BT_LABEL_IGNORE : v->input_ids[t];
            if (v->labels[t] != BT_LABEL_IGNORE) labelled++;
        }
    }
    for (uint32_t k = 0; k + 1 < h->n_cu; k++) {
        v->seg_kind[k] = BT_SEG_PLAIN, v->seg_pair[k] = -1;
        v->seg_src[k] = v->seg_line[k] = -1, v->seg_ref_ok[k] = 0, v->seg_ref_logp[k] = 0.0;
    }
    h->n_real_tokens = 14;
    h->n_labelled_tokens = labelled;
    h->checksum = bt_batch_checksum(v);
}

static int setup(void **state) {
    fixture *f = calloc(1, sizeof *f);
    size_t n = bt_batch_slot_bytes(NB, NT);
    f->mem = bt_aligned_alloc(n);
    bt_batch_view_init(&f->v, f->mem, NB, NT);
    fill_valid(&f->v);
    *state = f;
    return 0;
}

static int teardown(void **state) {
    fixture *f = *state;
    free(f->mem);
    free(f);
    return 0;
}

static void reseal(bt_batch_view *v) { v->hdr->checksum = bt_batch_checksum(v); }

static void expect_bad(bt_batch_view *v, const char *needle) {
    int rc = bt_batch_validate(v, NB, NT, VOCAB);
    if (rc != BT_ERR_FORMAT || !strstr(bt_last_error(), needle))
        fail_msg("want BT_ERR_FORMAT mentioning '%s', got %d: '%s'", needle, rc, bt_last_error());
}

static void test_slot_layout(void **state) {
    (void)state;
    size_t n = bt_batch_slot_bytes(NB, NT);
    assert_int_equal(n % 64, 0);
    /* header 320 + 3 arrays of 64 (16 ints) + cu 17 ints -> 128 + seg_pair, seg_kind, seg_src,
     * seg_line, seg_ref_ok 64 each + seg_ref_logp 128 (16 doubles) */
    assert_int_equal(n, 320 + 3 * 64 + 128 + 5 * 64 + 128);
    assert_int_equal(bt_batch_slot_bytes(0, 8), 0);
    assert_int_equal(bt_batch_slot_bytes(8, 0), 0);
    assert_int_equal(bt_batch_slot_bytes(1u << 16, 1u << 16), 0); /* 2^32 tokens: refused */
    assert_true(bt_batch_slot_bytes(8, 4096) >= sizeof(bt_batch_header) + (4u * 8 * 4096 + 1) * 4);
    uint8_t *slot = bt_aligned_alloc(bt_batch_slot_bytes(3, 5));
    bt_batch_view v;
    bt_batch_view_init(&v, slot, 3, 5);
    assert_ptr_equal(v.hdr, slot);
    assert_int_equal(((uintptr_t)v.input_ids) % 64, 0);
    assert_int_equal(((uintptr_t)v.labels) % 64, 0);
    assert_int_equal(((uintptr_t)v.position_ids) % 64, 0);
    assert_int_equal(((uintptr_t)v.cu_seqlens) % 64, 0);
    assert_true((uint8_t *)(v.input_ids + 15) <= (uint8_t *)v.labels);
    assert_true((uint8_t *)(v.position_ids + 15) <= (uint8_t *)v.cu_seqlens);
    assert_true((uint8_t *)(v.cu_seqlens + 16) <= (uint8_t *)v.seg_pair);
    assert_int_equal(((uintptr_t)v.seg_pair) % 64, 0);
    assert_int_equal(((uintptr_t)v.seg_kind) % 64, 0);
    assert_true((uint8_t *)(v.seg_pair + 15) < (uint8_t *)v.seg_kind);
    assert_true((uint8_t *)(v.seg_kind + 15) <= (uint8_t *)v.seg_src);
    assert_true((uint8_t *)(v.seg_src + 15) <= (uint8_t *)v.seg_line);
    assert_true((uint8_t *)(v.seg_line + 15) <= (uint8_t *)v.seg_ref_ok);
    assert_true((uint8_t *)(v.seg_ref_ok + 15) <= (uint8_t *)v.seg_ref_logp);
    assert_int_equal(((uintptr_t)v.seg_ref_logp) % 64, 0);
    assert_true((uint8_t *)(v.seg_ref_logp + 15) <= slot + bt_batch_slot_bytes(3, 5));
    free(slot);
}

static void test_valid_passes(void **state) {
    fixture *f = *state;
    assert_int_equal(bt_batch_validate(&f->v, NB, NT, VOCAB), BT_OK);
    assert_int_equal(bt_batch_validate(&f->v, NB, NT, 0), BT_OK); /* vocab check skipped */
}

static void test_checksum_sensitive(void **state) {
    fixture *f = *state;
    uint64_t c0 = bt_batch_checksum(&f->v);
    f->v.input_ids[3] ^= 1;
    assert_true(bt_batch_checksum(&f->v) != c0);
    expect_bad(&f->v, "checksum");
    f->v.input_ids[3] ^= 1;
    f->v.labels[6] = BT_LABEL_IGNORE;
    expect_bad(&f->v, "checksum");
    fill_valid(&f->v);
    f->v.position_ids[15] = 9;
    expect_bad(&f->v, "checksum");
    fill_valid(&f->v);
    f->v.cu_seqlens[2] = 7;
    expect_bad(&f->v, "checksum");
    /* a value past n_cu is outside the checksum and harmless */
    fill_valid(&f->v);
    f->v.cu_seqlens[10] = 12345;
    assert_int_equal(bt_batch_validate(&f->v, NB, NT, VOCAB), BT_OK);
}

static void test_header_corruptions(void **state) {
    fixture *f = *state;
    f->v.hdr->magic ^= 0x100;
    expect_bad(&f->v, "magic");
    fill_valid(&f->v);
    f->v.hdr->layout_version = 1; /* a layout-1 batch has no segment fields: refused, never misread */
    expect_bad(&f->v, "layout version");
    fill_valid(&f->v);
    assert_int_equal(bt_batch_validate(&f->v, NB, NT + 1, VOCAB), BT_ERR_FORMAT);
    assert_non_null(strstr(bt_last_error(), "shape"));
    f->v.hdr->flags = 0x80;
    expect_bad(&f->v, "flags");
    fill_valid(&f->v);
    f->v.hdr->n_cu = 2; /* fewer than B + 1 */
    expect_bad(&f->v, "n_cu");
    f->v.hdr->n_cu = NB * NT + 2;
    expect_bad(&f->v, "n_cu");
    fill_valid(&f->v);
    f->v.hdr->n_real_tokens = NB * NT + 1;
    expect_bad(&f->v, "token counts");
    fill_valid(&f->v);
    f->v.hdr->n_labelled_tokens += 1;
    expect_bad(&f->v, "n_labelled_tokens");
    /* end of data: header-only */
    fill_valid(&f->v);
    f->v.hdr->flags = BT_BATCH_F_END_OF_DATA;
    f->v.hdr->n_cu = 0;
    assert_int_equal(bt_batch_validate(&f->v, NB, NT, VOCAB), BT_OK);
}

static void test_structure_corruptions(void **state) {
    fixture *f = *state;
    bt_batch_view *v = &f->v;
    /* each corruption is resealed so the structural check, not the checksum, must catch it */
    v->cu_seqlens[0] = 1;
    reseal(v);
    expect_bad(v, "cu_seqlens[0]");
    fill_valid(v);
    v->cu_seqlens[4] = 15;
    reseal(v);
    expect_bad(v, "want B*T");
    fill_valid(v);
    v->cu_seqlens[2] = 5; /* 5 -> 5: not increasing */
    reseal(v);
    expect_bad(v, "not increasing");
    fill_valid(v);
    /* drop the row-1 boundary: segments [0,5) [5,14) [14,16) */
    static const int32_t cu_norow[] = {0, 5, 14, 16};
    memcpy(v->cu_seqlens, cu_norow, sizeof cu_norow);
    v->hdr->n_cu = 4;
    for (int t = 8; t < 14; t++) v->position_ids[t] = t - 5;
    reseal(v);
    expect_bad(v, "crosses a row end");
    fill_valid(v);
    v->labels[5] = v->input_ids[5]; /* first token of doc B labelled */
    v->hdr->n_labelled_tokens++;
    reseal(v);
    expect_bad(v, "first token of segment");
    fill_valid(v);
    v->position_ids[9] = 5;
    reseal(v);
    expect_bad(v, "position_ids[9]");
    fill_valid(v);
    v->position_ids[5] = 5; /* position not restarted at a document boundary */
    reseal(v);
    expect_bad(v, "position_ids[5]");
    fill_valid(v);
    v->input_ids[10] = VOCAB;
    reseal(v);
    expect_bad(v, "input_ids[10]");
    assert_int_equal(bt_batch_validate(v, NB, NT, 0), BT_OK); /* vocab unknown: only >= 0 */
    v->input_ids[10] = -1;
    reseal(v);
    expect_bad(v, "input_ids[10]");
    fill_valid(v);
    v->labels[11] = VOCAB + 5;
    reseal(v);
    expect_bad(v, "labels[11]");
    v->labels[11] = -7;
    reseal(v);
    expect_bad(v, "labels[11]");
}

/* segment k's kind and record index; its record (layout 3) is shard 1, line 10 + pair (plain: -1) */
static void seg(bt_batch_view *v, uint32_t k, int32_t kind, int32_t pair) {
    v->seg_kind[k] = kind, v->seg_pair[k] = pair;
    v->seg_src[k] = kind == BT_SEG_PLAIN ? -1 : 1;
    v->seg_line[k] = kind == BT_SEG_PLAIN ? -1 : 10 + pair;
}

/* Layout 2's per-segment preference fields (issue 25): segments [0,5) [5,8) | [8,14) [14,16). */
static void test_segment_meta(void **state) {
    fixture *f = *state;
    bt_batch_view *v = &f->v;
    seg(v, 0, BT_SEG_CHOSEN, 0);
    seg(v, 1, BT_SEG_REJECTED, 0);
    seg(v, 2, BT_SEG_KTO_UNDESIRABLE, 1);
    reseal(v);
    assert_int_equal(bt_batch_validate(v, NB, NT, VOCAB), BT_OK);
    v->seg_pair[1] = 5; /* the checksum covers the fields */
    expect_bad(v, "checksum");
    reseal(v);
    expect_bad(v, "rejected segment 1 does not follow its chosen");
    v->seg_pair[1] = 0;
    v->seg_kind[3] = 9;
    reseal(v);
    expect_bad(v, "seg_kind[3]=9 unknown");
    v->seg_kind[3] = BT_SEG_PLAIN, v->seg_pair[3] = 0;
    reseal(v);
    expect_bad(v, "plain segment 3 has seg_pair 0");
    v->seg_pair[3] = -1;
    seg(v, 2, BT_SEG_KTO_UNDESIRABLE, 2); /* records count 0, 1, 2... */
    reseal(v);
    expect_bad(v, "segment 2 has seg_pair 2 (want 1)");
    /* a pair across a row end: chosen in row 0, rejected in row 1 */
    seg(v, 0, BT_SEG_PLAIN, -1);
    seg(v, 1, BT_SEG_CHOSEN, 0);
    seg(v, 2, BT_SEG_REJECTED, 0);
    reseal(v);
    expect_bad(v, "chosen segment 1 is not followed by its rejected segment in the same row");
    /* a chosen without its rejected */
    seg(v, 1, BT_SEG_PLAIN, -1);
    seg(v, 2, BT_SEG_CHOSEN, 0);
    reseal(v);
    expect_bad(v, "chosen segment 2 is not followed");
}

/* Layout 3: each record's shard / line and the cached reference log-probs (issue 25 §2). */
static void test_segment_ref(void **state) {
    fixture *f = *state;
    bt_batch_view *v = &f->v;
    seg(v, 0, BT_SEG_CHOSEN, 0);
    seg(v, 1, BT_SEG_REJECTED, 0);
    seg(v, 2, BT_SEG_KTO_DESIRABLE, 1);
    v->seg_ref_ok[0] = 1, v->seg_ref_logp[0] = -12.5;
    v->seg_ref_ok[2] = 1, v->seg_ref_logp[2] = -0.0;
    reseal(v);
    assert_int_equal(bt_batch_validate(v, NB, NT, VOCAB), BT_OK);
    v->seg_ref_logp[0] = -12.25; /* the checksum covers the values */
    expect_bad(v, "checksum");
    v->seg_ref_logp[0] = 0.5; /* a log-probability is <= 0 */
    reseal(v);
    expect_bad(v, "seg_ref_logp[0]=0.5");
    v->seg_ref_logp[0] = (double)NAN;
    reseal(v);
    expect_bad(v, "seg_ref_logp[0]");
    v->seg_ref_logp[0] = -1.0;
    v->seg_ref_logp[1] = -3.0; /* a value without its flag */
    reseal(v);
    expect_bad(v, "seg_ref_logp[1]=-3 with seg_ref_ok 0");
    v->seg_ref_logp[1] = 0.0;
    v->seg_ref_ok[1] = 2;
    reseal(v);
    expect_bad(v, "seg_ref_ok[1]=2");
    v->seg_ref_ok[1] = 0;
    v->seg_line[1] = 11; /* the pair's two segments are one record */
    reseal(v);
    expect_bad(v, "rejected segment 1 does not follow its chosen");
    v->seg_line[1] = 10;
    v->seg_src[2] = -1;
    reseal(v);
    expect_bad(v, "segment 2 has seg_src -1");
    v->seg_src[2] = 1;
    v->seg_line[2] = 0;
    reseal(v);
    expect_bad(v, "seg_line 0");
    v->seg_line[2] = -1; /* a line past INT32_MAX: known shard, unknown line */
    reseal(v);
    assert_int_equal(bt_batch_validate(v, NB, NT, VOCAB), BT_OK);
    v->seg_ref_ok[3] = 1, v->seg_ref_logp[3] = -1.0; /* padding never has a value */
    reseal(v);
    expect_bad(v, "plain segment 3 has seg_src -1, seg_line -1, seg_ref_ok 1");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_slot_layout),
        cmocka_unit_test_setup_teardown(test_valid_passes, setup, teardown),
        cmocka_unit_test_setup_teardown(test_checksum_sensitive, setup, teardown),
        cmocka_unit_test_setup_teardown(test_header_corruptions, setup, teardown),
        cmocka_unit_test_setup_teardown(test_structure_corruptions, setup, teardown),
        cmocka_unit_test_setup_teardown(test_segment_meta, setup, teardown),
        cmocka_unit_test_setup_teardown(test_segment_ref, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
