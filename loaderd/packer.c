/* loaderd packer: best-fit decreasing over a window of documents. See packer.h. */
#include "loaderd/packer.h"

#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "common/rng.h"
#include "proto/batch.h"

uint64_t ld_splitmix64(uint64_t *x) { return bt_splitmix64_next(x); }

void ld_rng_seed(ld_rng *r, uint64_t seed) {
    for (int i = 0; i < 4; i++) r->s[i] = ld_splitmix64(&seed);
}

uint64_t ld_rng_next(ld_rng *r) { return bt_xoshiro256ss_next(r->s); }

uint64_t ld_rng_below(ld_rng *r, uint64_t n) {
    if (n <= 1) return 0;
    uint64_t lim = UINT64_MAX - UINT64_MAX % n; /* accept [0, lim) : a multiple of n values */
    for (;;) {
        uint64_t x = ld_rng_next(r);
        if (x < lim) return x % n;
    }
}

typedef struct {
    uint32_t len; /* tokens of the unit (a piece, or a pair's two documents) */
    uint64_t key;
    uint32_t idx; /* first piece of the unit */
    uint32_t cnt; /* pieces in the unit: 1, or 2 for a pair */
} sort_ent;

static int cmp_ent(const void *a, const void *b) {
    const sort_ent *x = a, *y = b;
    if (x->len != y->len) return x->len > y->len ? -1 : 1;
    if (x->key != y->key) return x->key < y->key ? -1 : 1;
    return x->idx < y->idx ? -1 : (x->idx > y->idx);
}

void ld_pack_plan_free(ld_pack_plan *plan) {
    if (!plan) return;
    free(plan->pieces);
    free(plan->rows);
    memset(plan, 0, sizeof *plan);
}

/* docs[i] starts a pair that can be placed whole in a row of T */
static int pair_at(const ld_pack_doc *docs, size_t n_docs, size_t i) { return docs[i].with_next && i + 1 < n_docs; }
static int pair_fits(const ld_pack_doc *docs, size_t i, uint32_t T) {
    return docs[i].n > 0 && docs[i + 1].n > 0 && (uint64_t)docs[i].n + docs[i + 1].n <= T;
}

int ld_pack_plan_build(ld_pack_plan *plan, const ld_pack_doc *docs, size_t n_docs, uint32_t T,
                       uint64_t seed, int shuffle) {
    memset(plan, 0, sizeof *plan);
    if (T == 0) return bt_fail(BT_ERR_INVALID, "packer: T must be >= 1");
    /* 1. pieces (np) and units (nu: what is sorted and placed) */
    size_t np = 0, nu = 0;
    for (size_t i = 0; i < n_docs; i++) {
        if (pair_at(docs, n_docs, i)) {
            if (pair_fits(docs, i, T)) np += 2, nu++;
            i++;
            continue;
        }
        uint32_t n = docs[i].n;
        if (n == 0) continue;
        size_t k = (n > T && docs[i].split) ? (n + T - 1) / T : 1;
        np += k, nu += k;
    }
    if (np > UINT32_MAX || n_docs > UINT32_MAX)
        return bt_fail(BT_ERR_RANGE, "packer: %zu pieces in one window", np);
    ld_piece *pieces = malloc((np ? np : 1) * sizeof *pieces);
    sort_ent *ord = malloc((nu ? nu : 1) * sizeof *ord);
    uint32_t *row_of = malloc((np ? np : 1) * sizeof *row_of);
    uint32_t *rem = malloc((nu ? nu : 1) * sizeof *rem);  /* remaining space per row */
    uint32_t *open = malloc((nu ? nu : 1) * sizeof *open); /* rows that may still take a unit */
    if (!pieces || !ord || !row_of || !rem || !open) {
        free(pieces), free(ord), free(row_of), free(rem), free(open);
        return bt_fail(BT_ERR_NOMEM, "packer: out of memory (%zu pieces)", np);
    }
    ld_rng rng;
    ld_rng_seed(&rng, seed);
    size_t k = 0, u = 0;
    for (size_t i = 0; i < n_docs; i++) {
        if (pair_at(docs, n_docs, i)) {
            if (pair_fits(docs, i, T)) {
                uint64_t key = shuffle ? ld_rng_next(&rng) : 0;
                pieces[k] = (ld_piece){(uint32_t)i, 0, docs[i].n};
                pieces[k + 1] = (ld_piece){(uint32_t)(i + 1), 0, docs[i + 1].n};
                ord[u++] = (sort_ent){docs[i].n + docs[i + 1].n, key, (uint32_t)k, 2};
                plan->real_tokens += docs[i].n + docs[i + 1].n;
                k += 2;
            } else {
                plan->n_pairs_dropped++;
            }
            i++;
            continue;
        }
        uint32_t n = docs[i].n;
        if (n == 0) continue;
        uint64_t key = shuffle ? ld_rng_next(&rng) : 0;
        if (n > T && !docs[i].split) {
            plan->n_truncated++;
            n = T;
        }
        for (uint32_t off = 0; off < n; off += T) {
            uint32_t len = n - off < T ? n - off : T;
            pieces[k] = (ld_piece){(uint32_t)i, off, len};
            ord[u++] = (sort_ent){len, key, (uint32_t)k, 1};
            plan->real_tokens += len;
            k++;
        }
    }
    qsort(ord, nu, sizeof *ord, cmp_ent);

    /* 2. best fit, decreasing */
    size_t n_rows = 0, n_open = 0;
    uint32_t min_len = nu ? ord[nu - 1].len : 0;
    for (size_t j = 0; j < nu; j++) {
        uint32_t len = ord[j].len;
        size_t best = SIZE_MAX;
        uint32_t best_rem = UINT32_MAX;
        for (size_t o = 0; o < n_open; o++) {
            uint32_t r = rem[open[o]];
            if (r >= len && r < best_rem) { /* `open` is in row order: ties keep the oldest */
                best = o;
                best_rem = r;
            }
        }
        uint32_t row;
        if (best == SIZE_MAX) {
            row = (uint32_t)n_rows++;
            rem[row] = T;
            open[n_open] = row;
            best = n_open++;
        } else {
            row = open[best];
        }
        rem[row] -= len;
        for (uint32_t c = 0; c < ord[j].cnt; c++) row_of[ord[j].idx + c] = row;
        if (rem[row] < min_len) { /* nothing left can fit: close it (keep `open` ordered) */
            memmove(open + best, open + best + 1, (n_open - best - 1) * sizeof *open);
            n_open--;
        }
    }

    /* 3. flatten: rows in creation order, pieces of a row in placement (sorted) order */
    ld_row *rows = calloc(n_rows ? n_rows : 1, sizeof *rows);
    ld_piece *flat = malloc((np ? np : 1) * sizeof *flat);
    if (!rows || !flat) {
        free(rows), free(flat), free(pieces), free(ord), free(row_of), free(rem), free(open);
        return bt_fail(BT_ERR_NOMEM, "packer: out of memory (%zu rows)", n_rows);
    }
    for (size_t q = 0; q < np; q++) rows[row_of[q]].n_pieces++;
    uint32_t acc = 0;
    for (size_t r = 0; r < n_rows; r++) {
        rows[r].first = acc;
        acc += rows[r].n_pieces;
        rows[r].n_pieces = 0;
    }
    for (size_t j = 0; j < nu; j++) /* a pair's two pieces land adjacent, in order */
        for (uint32_t c = 0; c < ord[j].cnt; c++) {
            ld_piece pc = pieces[ord[j].idx + c];
            ld_row *rw = &rows[row_of[ord[j].idx + c]];
            flat[rw->first + rw->n_pieces++] = pc;
            rw->used += pc.len;
        }
    free(pieces), free(ord), free(row_of), free(rem), free(open);

    /* 4. shuffle rows (Fisher-Yates) */
    if (shuffle)
        for (size_t r = n_rows; r > 1; r--) {
            size_t s = (size_t)ld_rng_below(&rng, r);
            ld_row t = rows[r - 1];
            rows[r - 1] = rows[s];
            rows[s] = t;
        }
    plan->pieces = flat;
    plan->n_pieces = np;
    plan->rows = rows;
    plan->n_rows = n_rows;
    return BT_OK;
}

void ld_pack_write_row(const ld_pack_plan *plan, size_t r, const ld_pack_doc *docs, uint32_t T,
                       int32_t pad_id, uint32_t base, int32_t *ids, int32_t *labels, int32_t *pos,
                       int32_t *cu, uint32_t *n_cu, ld_row_stats *st, int32_t *seg_pair, int32_t *seg_kind,
                       int32_t *n_rec, int32_t *seg_src, int32_t *seg_line) {
    const ld_row *rw = &plan->rows[r];
    uint32_t t = 0;
    memset(st, 0, sizeof *st);
    for (uint32_t q = 0; q < rw->n_pieces; q++) {
        const ld_piece *pc = &plan->pieces[rw->first + q];
        const ld_pack_doc *d = &docs[pc->doc];
        if (seg_kind) {
            seg_kind[*n_cu] = d->kind;
            seg_pair[*n_cu] = d->kind == BT_SEG_PLAIN ? -1 : d->kind == BT_SEG_REJECTED ? *n_rec - 1 : (*n_rec)++;
        }
        if (seg_src) {
            seg_src[*n_cu] = d->kind == BT_SEG_PLAIN ? -1 : d->src;
            seg_line[*n_cu] = d->kind == BT_SEG_PLAIN ? -1 : d->line;
        }
        cu[(*n_cu)++] = (int32_t)(base + t);
        for (uint32_t k = 0; k < pc->len; k++, t++) {
            int32_t id = d->ids[pc->off + k];
            ids[t] = id;
            pos[t] = (int32_t)k;
            if (k > 0 && d->mask[pc->off + k]) {
                labels[t] = id;
                st->labelled++;
            } else {
                labels[t] = BT_LABEL_IGNORE;
            }
        }
        st->pieces++;
    }
    st->real = t;
    if (t < T) {
        if (seg_kind) seg_kind[*n_cu] = BT_SEG_PLAIN, seg_pair[*n_cu] = -1;
        if (seg_src) seg_src[*n_cu] = -1, seg_line[*n_cu] = -1;
        cu[(*n_cu)++] = (int32_t)(base + t);
        for (uint32_t k = 0; t < T; t++, k++) {
            ids[t] = pad_id;
            labels[t] = BT_LABEL_IGNORE;
            pos[t] = (int32_t)k;
        }
    }
}

void ld_pack_write_pad_row(uint32_t T, int32_t pad_id, uint32_t base, int32_t *ids,
                           int32_t *labels, int32_t *pos, int32_t *cu, uint32_t *n_cu, int32_t *seg_pair,
                           int32_t *seg_kind, int32_t *seg_src, int32_t *seg_line) {
    if (seg_kind) seg_kind[*n_cu] = BT_SEG_PLAIN, seg_pair[*n_cu] = -1;
    if (seg_src) seg_src[*n_cu] = -1, seg_line[*n_cu] = -1;
    cu[(*n_cu)++] = (int32_t)base;
    for (uint32_t t = 0; t < T; t++) {
        ids[t] = pad_id;
        labels[t] = BT_LABEL_IGNORE;
        pos[t] = (int32_t)t;
    }
}
