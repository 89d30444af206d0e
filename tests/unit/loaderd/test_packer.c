/* Tests of loaderd/packer.c: BFD packing into rows with boundaries, labels, positions. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "loaderd/packer.h"
#include "proto/batch.h"

#define TAG 100000 /* token id = (doc + 1) * TAG + index in doc (T < TAG), never PAD */
#define PAD 7

typedef struct {
    ld_pack_doc *docs;
    int32_t **ids, **mask;
    size_t n;
} docset;

static docset make_docs(size_t n, uint32_t min_len, uint32_t max_len, int split_mode, unsigned seed) {
    docset d = {calloc(n, sizeof(ld_pack_doc)), calloc(n, sizeof(int32_t *)), calloc(n, sizeof(int32_t *)), n};
    srand(seed);
    for (size_t i = 0; i < n; i++) {
        uint32_t len = min_len + (uint32_t)rand() % (max_len - min_len + 1);
        d.ids[i] = malloc((len ? len : 1) * sizeof(int32_t));
        d.mask[i] = malloc((len ? len : 1) * sizeof(int32_t));
        for (uint32_t k = 0; k < len; k++) {
            d.ids[i][k] = (int32_t)((i + 1) * TAG + k);
            d.mask[i][k] = rand() % 3 != 0;
        }
        d.docs[i] = (ld_pack_doc){d.ids[i], d.mask[i], len, split_mode == 2 ? (int)(i & 1) : split_mode, 0, 0, -1, -1};
    }
    return d;
}

static void free_docs(docset *d) {
    for (size_t i = 0; i < d->n; i++) free(d->ids[i]), free(d->mask[i]);
    free(d->docs), free(d->ids), free(d->mask);
}

/* Write every row of the plan into flat arrays and check the batch contract; returns the
 * real token count. covered[doc] counts tokens of each doc seen (each exactly once). */
static uint64_t check_plan(const ld_pack_plan *pl, const docset *d, uint32_t T) {
    size_t R = pl->n_rows, N = R * T;
    int32_t *ids = malloc((N ? N : 1) * 4), *lab = malloc((N ? N : 1) * 4), *pos = malloc((N ? N : 1) * 4);
    int32_t *cu = malloc((N + 1) * 4);
    uint32_t n_cu = 0;
    uint64_t real = 0, labelled = 0, pieces = 0;
    for (size_t r = 0; r < R; r++) {
        ld_row_stats st;
        uint32_t before = n_cu;
        ld_pack_write_row(pl, r, d->docs, T, PAD, (uint32_t)(r * T), ids + r * T, lab + r * T,
                          pos + r * T, cu, &n_cu, &st, NULL, NULL, NULL, NULL, NULL);
        assert_int_equal(cu[before], (int32_t)(r * T)); /* row start is a boundary */
        assert_true(st.real <= T && st.real > 0);
        assert_int_equal(st.real, pl->rows[r].used);
        real += st.real;
        labelled += st.labelled;
        pieces += st.pieces;
    }
    cu[n_cu++] = (int32_t)N;
    assert_int_equal(cu[0], 0);
    assert_int_equal(pieces, pl->n_pieces);
    assert_int_equal(real, pl->real_tokens);

    /* per doc: how often each token was seen (pieces may land in any row, in any order) */
    uint32_t *seen = calloc(d->n, sizeof(uint32_t)); /* tokens seen per doc */
    uint8_t **hit = calloc(d->n, sizeof(uint8_t *));
    for (size_t i = 0; i < d->n; i++) hit[i] = calloc(d->docs[i].n + 1, 1);
    uint64_t lab_seen = 0;
    for (uint32_t s = 0; s + 1 < n_cu; s++) {
        int32_t a = cu[s], b = cu[s + 1];
        assert_true(a < b);
        assert_true((uint32_t)(b - 1) / T == (uint32_t)a / T); /* segment within a row */
        if (ids[a] == PAD) { /* the padding segment: at the row end, all PAD */
            assert_int_equal((uint32_t)b % T, 0);
            for (int32_t t = a; t < b; t++) {
                assert_int_equal(ids[t], PAD);
                assert_int_equal(lab[t], BT_LABEL_IGNORE);
                assert_int_equal(pos[t], t - a);
            }
            continue;
        }
        int32_t doc = ids[a] / TAG - 1;
        assert_true((size_t)doc < d->n);
        uint32_t off = (uint32_t)(ids[a] % TAG);
        assert_true(d->docs[doc].split || off == 0); /* truncation keeps the head */
        assert_int_equal(off % T, 0);                  /* split pieces start every T */
        for (int32_t t = a; t < b; t++) {
            uint32_t k = off + (uint32_t)(t - a);
            assert_true(k < d->docs[doc].n);
            assert_int_equal(hit[doc][k]++, 0); /* never duplicated */
            assert_int_equal(ids[t], d->ids[doc][k]);
            assert_int_equal(pos[t], t - a);
            int32_t want = (t == a || !d->mask[doc][k]) ? BT_LABEL_IGNORE : ids[t];
            assert_int_equal(lab[t], want);
            lab_seen += lab[t] != BT_LABEL_IGNORE;
        }
        seen[doc] += (uint32_t)(b - a);
    }
    assert_int_equal(lab_seen, labelled);
    for (size_t i = 0; i < d->n; i++) {
        uint32_t want = d->docs[i].n;
        if (want > T && !d->docs[i].split) want = T;
        assert_int_equal(seen[i], want); /* with no duplicates: none lost */
        for (uint32_t k = 0; k < want; k++) assert_int_equal(hit[i][k], 1);
        free(hit[i]);
    }
    free(hit), free(seen), free(ids), free(lab), free(pos), free(cu);
    return real;
}

static void test_rng(void **state) {
    (void)state;
    uint64_t x = 0;
    assert_true(ld_splitmix64(&x) == 0xe220a8397b1dcdafULL); /* Vigna's splitmix64.c, seed 0 */
    ld_rng a, b;
    ld_rng_seed(&a, 42);
    ld_rng_seed(&b, 42);
    for (int i = 0; i < 100; i++) assert_true(ld_rng_next(&a) == ld_rng_next(&b));
    int hist[5] = {0};
    for (int i = 0; i < 5000; i++) {
        uint64_t v = ld_rng_below(&a, 5);
        assert_true(v < 5);
        hist[v]++;
    }
    for (int i = 0; i < 5; i++) assert_true(hist[i] > 800 && hist[i] < 1200);
    assert_int_equal(ld_rng_below(&a, 1), 0);
}

static void test_bfd_small_exact(void **state) {
    (void)state;
    uint32_t lens[6] = {6, 4, 5, 5, 3, 7};
    int32_t buf[6][8];
    ld_pack_doc docs[6];
    for (int i = 0; i < 6; i++) {
        for (uint32_t k = 0; k < lens[i]; k++) buf[i][k] = i * 10 + (int32_t)k;
        docs[i] = (ld_pack_doc){buf[i], buf[i], lens[i], 0, 0, 0, -1, -1};
    }
    ld_pack_plan pl;
    assert_int_equal(ld_pack_plan_build(&pl, docs, 6, 10, 1, 0), BT_OK);
    /* 7->r0, 6->r1, 5->r2, 5->r2, 4->r1, 3->r0: three full rows */
    assert_int_equal(pl.n_rows, 3);
    uint32_t want[3][2] = {{5, 4}, {0, 1}, {2, 3}};
    for (int r = 0; r < 3; r++) {
        assert_int_equal(pl.rows[r].used, 10);
        assert_int_equal(pl.rows[r].n_pieces, 2);
        for (int q = 0; q < 2; q++) assert_int_equal(pl.pieces[pl.rows[r].first + q].doc, want[r][q]);
    }
    ld_pack_plan_free(&pl);
    /* nothing to pack */
    assert_int_equal(ld_pack_plan_build(&pl, docs, 0, 10, 1, 1), BT_OK);
    assert_int_equal(pl.n_rows, 0);
    ld_pack_plan_free(&pl);
    assert_int_equal(ld_pack_plan_build(&pl, docs, 6, 0, 1, 1), BT_ERR_INVALID);
}

static void test_random_docs_contract(void **state) {
    (void)state;
    for (unsigned seed = 1; seed <= 6; seed++) {
        uint32_t T = 64 + seed * 37;
        docset d = make_docs(300, 1, T + T / 2, 2, seed); /* odd docs split, even truncated */
        ld_pack_plan pl;
        assert_int_equal(ld_pack_plan_build(&pl, d.docs, d.n, T, seed, 1), BT_OK);
        size_t trunc = 0;
        for (size_t i = 0; i < d.n; i++) trunc += d.docs[i].n > T && !d.docs[i].split;
        assert_int_equal(pl.n_truncated, trunc);
        assert_true(trunc > 0);
        check_plan(&pl, &d, T);
        /* deterministic */
        ld_pack_plan p2;
        assert_int_equal(ld_pack_plan_build(&p2, d.docs, d.n, T, seed, 1), BT_OK);
        assert_int_equal(p2.n_rows, pl.n_rows);
        assert_memory_equal(p2.rows, pl.rows, pl.n_rows * sizeof(ld_row));
        assert_memory_equal(p2.pieces, pl.pieces, pl.n_pieces * sizeof(ld_piece));
        ld_pack_plan_free(&p2);
        /* another seed: same multiset, different row order */
        assert_int_equal(ld_pack_plan_build(&p2, d.docs, d.n, T, seed + 1000, 1), BT_OK);
        assert_int_equal(p2.real_tokens, pl.real_tokens);
        assert_true(memcmp(p2.rows, pl.rows, pl.n_rows * sizeof(ld_row)) != 0);
        check_plan(&p2, &d, T);
        ld_pack_plan_free(&p2);
        ld_pack_plan_free(&pl);
        free_docs(&d);
    }
}

static void test_long_split(void **state) {
    (void)state;
    docset d = make_docs(3, 1000, 1000, 1, 5);
    d.docs[1].n = 256; /* exactly 2 rows */
    d.docs[2].n = 1;
    ld_pack_plan pl;
    assert_int_equal(ld_pack_plan_build(&pl, d.docs, d.n, 128, 9, 1), BT_OK);
    /* 1000 = 7*128 + 104; 104 + 1 share a row: 7 + 2 + 1 rows */
    assert_int_equal(pl.n_pieces, 8 + 2 + 1);
    assert_int_equal(pl.n_rows, 10);
    assert_int_equal(pl.n_truncated, 0);
    assert_int_equal(check_plan(&pl, &d, 128), 1257);
    ld_pack_plan_free(&pl);
    for (size_t i = 0; i < 3; i++) d.docs[i].split = 0;
    assert_int_equal(ld_pack_plan_build(&pl, d.docs, d.n, 128, 9, 1), BT_OK);
    assert_int_equal(pl.n_truncated, 2);
    assert_int_equal(pl.n_rows, 3);
    assert_int_equal(check_plan(&pl, &d, 128), 257);
    ld_pack_plan_free(&pl);
    free_docs(&d);
}

static void test_efficiency_short_docs(void **state) {
    (void)state;
    /* short chat-like docs, 256-doc window, T = 512 */
    docset d = make_docs(256, 40, 400, 0, 77);
    ld_pack_plan pl;
    assert_int_equal(ld_pack_plan_build(&pl, d.docs, d.n, 512, 3, 1), BT_OK);
    uint64_t real = check_plan(&pl, &d, 512);
    double eff = (double)real / ((double)pl.n_rows * 512);
    print_message("packing efficiency (256 docs of 40..400 tokens, T=512): %.4f over %zu rows\n",
                  eff, pl.n_rows);
    assert_true(eff >= 0.95);
    ld_pack_plan_free(&pl);
    free_docs(&d);
}

static void test_pad_row(void **state) {
    (void)state;
    int32_t ids[8], lab[8], pos[8], cu[2];
    uint32_t n = 0;
    ld_pack_write_pad_row(8, PAD, 16, ids, lab, pos, cu, &n, NULL, NULL, NULL, NULL);
    assert_int_equal(n, 1);
    assert_int_equal(cu[0], 16);
    for (int t = 0; t < 8; t++) {
        assert_int_equal(ids[t], PAD);
        assert_int_equal(lab[t], BT_LABEL_IGNORE);
        assert_int_equal(pos[t], t);
    }
}

/* Preference pairs (with_next): both documents in one row, adjacent and in order, never split;
 * a pair longer than T is dropped and counted; singles around them pack as before. */
static void test_pairs_whole(void **state) {
    (void)state;
    const uint32_t T = 64;
    for (int shuffle = 0; shuffle < 2; shuffle++) {
        docset d = make_docs(300, 1, 40, 0, 11u + (unsigned)shuffle);
        size_t want_dropped = 0, pair_docs = 0;
        for (size_t i = 0; i + 1 < d.n; i += 3) { /* docs i, i+1 a pair; i+2 a single */
            d.docs[i].with_next = 1;
            d.docs[i].kind = BT_SEG_CHOSEN;
            d.docs[i + 1].kind = BT_SEG_REJECTED;
            d.docs[i].src = d.docs[i + 1].src = 3; /* the record's shard and line (layout 3) */
            d.docs[i].line = d.docs[i + 1].line = (int32_t)i + 1;
            pair_docs += 2;
            if (d.docs[i].n + d.docs[i + 1].n > T) want_dropped++;
        }
        ld_pack_plan pl;
        assert_int_equal(ld_pack_plan_build(&pl, d.docs, d.n, T, 5, shuffle), BT_OK);
        assert_true(want_dropped > 0 && pair_docs > 150); /* the draw exercises both cases */
        assert_int_equal(pl.n_pairs_dropped, want_dropped);
        uint32_t *seen = calloc(d.n, sizeof *seen);
        for (size_t r = 0; r < pl.n_rows; r++) {
            const ld_row *rw = &pl.rows[r];
            uint32_t used = 0;
            for (uint32_t q = 0; q < rw->n_pieces; q++) {
                const ld_piece *pc = &pl.pieces[rw->first + q];
                used += pc->len;
                seen[pc->doc]++;
                assert_int_equal(pc->off, 0);
                if (d.docs[pc->doc].with_next) { /* first of a pair: its partner follows at once */
                    assert_true(q + 1 < rw->n_pieces);
                    const ld_piece *nx = &pl.pieces[rw->first + q + 1];
                    assert_int_equal(nx->doc, pc->doc + 1);
                    assert_int_equal(pc->len, d.docs[pc->doc].n);
                    assert_int_equal(nx->len, d.docs[pc->doc + 1].n);
                } else if (pc->doc % 3 == 1) { /* second of a pair: its partner precedes it */
                    assert_true(q > 0);
                    assert_int_equal(pl.pieces[rw->first + q - 1].doc + 1, pc->doc);
                }
            }
            assert_int_equal(used, rw->used);
            assert_true(used <= T);
        }
        for (size_t i = 0; i < d.n; i++) {
            int in_pair = i % 3 != 2 && (i % 3 == 0 ? i + 1 < d.n : 1);
            size_t first = i - i % 3;
            int dropped = in_pair && d.docs[first].n + d.docs[first + 1].n > T;
            assert_int_equal(seen[i], dropped ? 0 : 1);
        }
        free(seen);
        /* the rows as a batch: seg_kind / seg_pair per segment, checked by bt_batch_validate */
        uint32_t B = (uint32_t)pl.n_rows;
        size_t sb = bt_batch_slot_bytes(B, T);
        void *slot = aligned_alloc(64, sb);
        memset(slot, 0, sb);
        bt_batch_view v;
        bt_batch_view_init(&v, slot, B, T);
        uint32_t n_cu = 0;
        int32_t n_rec = 0;
        uint32_t labelled = 0;
        for (uint32_t r = 0; r < B; r++) {
            ld_row_stats st;
            ld_pack_write_row(&pl, r, d.docs, T, PAD, r * T, v.input_ids + r * T, v.labels + r * T,
                              v.position_ids + r * T, v.cu_seqlens, &n_cu, &st, v.seg_pair, v.seg_kind, &n_rec,
                              v.seg_src, v.seg_line);
            labelled += st.labelled;
        }
        v.cu_seqlens[n_cu++] = (int32_t)(B * T);
        *v.hdr = (bt_batch_header){.magic = BT_BATCH_MAGIC, .layout_version = BT_BATCH_LAYOUT_VERSION, .B = B, .T = T,
                                   .n_labelled_tokens = labelled, .n_cu = n_cu};
        v.hdr->checksum = bt_batch_checksum(&v);
        assert_int_equal(bt_batch_validate(&v, B, T, 0), BT_OK);
        size_t pairs = 0;
        for (uint32_t k = 0; k + 1 < n_cu; k++) pairs += v.seg_kind[k] == BT_SEG_CHOSEN;
        assert_int_equal((size_t)n_rec, pairs);
        assert_int_equal(pairs, pair_docs / 2 - want_dropped);
        /* the validator catches a pair torn apart: swap a chosen with the segment before it */
        for (uint32_t k = 1; k + 1 < n_cu; k++)
            if (v.seg_kind[k] == BT_SEG_CHOSEN && v.seg_kind[k - 1] == BT_SEG_PLAIN) {
                v.seg_kind[k] = BT_SEG_PLAIN, v.seg_pair[k] = -1, v.seg_src[k] = v.seg_line[k] = -1;
                v.hdr->checksum = bt_batch_checksum(&v);
                assert_int_equal(bt_batch_validate(&v, B, T, 0), BT_ERR_FORMAT);
                assert_non_null(strstr(bt_last_error(), "does not follow its chosen"));
                break;
            }
        free(slot);
        ld_pack_plan_free(&pl);
        free_docs(&d);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rng),
        cmocka_unit_test(test_bfd_small_exact),
        cmocka_unit_test(test_random_docs_contract),
        cmocka_unit_test(test_long_split),
        cmocka_unit_test(test_efficiency_short_docs),
        cmocka_unit_test(test_pad_row),
        cmocka_unit_test(test_pairs_whole),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
