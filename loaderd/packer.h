/* loaderd packer: documents (token ids + 0/1 loss mask) -> rows of T tokens with document
 * boundaries, plus the seeded RNG used for shuffling.
 *
 * Algorithm: best-fit decreasing (BFD) bin packing over one window of documents, as in
 * Axolotl's multipack FFD / NeMo's first_fit_decreasing (docs/algorithms.md §Packing):
 * pieces are sorted by length (descending; ties by a seeded random key, then by index so the
 * result is deterministic) and each goes into the open row with the least remaining space that
 * still fits it (ties: the oldest row), else into a new row. A window is self-contained: all
 * of its rows are returned (the last ones may be partly empty).
 * Documents longer than T are split into consecutive T-token pieces (split = 1, `text`) or cut
 * to their first T tokens (split = 0, `chat`/`alpaca`; counted in n_truncated). A pair
 * (with_next) is sorted and placed as one item of its summed length, its two documents adjacent.
 *
 * Row contents (proto/batch.h contract): each piece is a segment; position_ids restart at 0 per
 * segment; labels[t] = ids[t] where mask = 1, else -100, and the first token of every segment
 * is -100; the unused tail of a row is one padding segment (pad id, labels -100,
 * positions 0, 1, ...). */
#ifndef LD_PACKER_H
#define LD_PACKER_H
#include <stddef.h>
#include <stdint.h>

/* splitmix64 (Steele, Lea, Flood 2014; constants from Vigna's splitmix64.c): advances *x. */
uint64_t ld_splitmix64(uint64_t *x);
/* xoshiro256** 1.0 (Blackman & Vigna, prng.di.unimi.it/xoshiro256starstar.c), seeded with
 * four splitmix64 outputs of `seed`. */
typedef struct {
    uint64_t s[4];
} ld_rng;
void ld_rng_seed(ld_rng *r, uint64_t seed);
uint64_t ld_rng_next(ld_rng *r);
/* Uniform integer in [0, n) (n >= 1), by rejection (no modulo bias). */
uint64_t ld_rng_below(ld_rng *r, uint64_t n);

typedef struct {
    const int32_t *ids;  /* [n] token ids (borrowed) */
    const int32_t *mask; /* [n] 1 = carries loss, 0 = not (borrowed) */
    uint32_t n;          /* tokens; 0 = nothing to pack (skipped) */
    int split;           /* n > T: 1 = split into T-sized pieces, 0 = truncate to T */
    int with_next;       /* 1: this document and the next one are one unit (a preference pair,
                            issue 25): placed in one row, adjacent, in this order, never split or
                            cut; a unit longer than T (or with an empty member) is dropped and
                            counted in n_pairs_dropped. The next document's own with_next is ignored. */
    int32_t kind;        /* BT_SEG_* (proto/batch.h) of its segment(s): BT_SEG_PLAIN (0) for SFT
                            documents; a pair is CHOSEN (with_next) then REJECTED */
    int32_t src, line;   /* a non-plain document's record: shard index in the job and 1-based line
                            (-1 beyond INT32_MAX), written to seg_src / seg_line (layout 3); ignored
                            for plain documents (-1 / -1 written) */
} ld_pack_doc;

typedef struct {
    uint32_t doc; /* index into the docs array given to ld_pack_plan_build */
    uint32_t off; /* first token of the piece within the doc */
    uint32_t len; /* tokens, 1..T */
} ld_piece;

typedef struct {
    uint32_t first;    /* pieces[first .. first + n_pieces) in placement order */
    uint32_t n_pieces;
    uint32_t used;     /* tokens used, <= T */
} ld_row;

typedef struct {
    ld_piece *pieces;
    size_t n_pieces;
    ld_row *rows;
    size_t n_rows;
    size_t n_truncated;   /* docs cut to T (split = 0 and n > T) */
    uint64_t real_tokens; /* sum of piece lengths */
    size_t n_pairs_dropped; /* with_next units that could not be placed whole (longer than T) */
} ld_pack_plan;

/* Plan the rows for docs[0..n_docs) at row length T (>= 1). When `shuffle` is set, equal-length
 * ties are broken by a key drawn from ld_rng_seed(seed) and the rows are then shuffled
 * (Fisher-Yates, same generator); otherwise ties go by index and rows stay in creation order.
 * *plan is overwritten (owned; free with ld_pack_plan_free). Errors: BT_ERR_NOMEM,
 * BT_ERR_RANGE if more than 2^32-1 pieces. */
int ld_pack_plan_build(ld_pack_plan *plan, const ld_pack_doc *docs, size_t n_docs, uint32_t T,
                       uint64_t seed, int shuffle);
void ld_pack_plan_free(ld_pack_plan *plan);

typedef struct {
    uint32_t real;     /* non-padding tokens */
    uint32_t labelled; /* labels != -100 */
    uint32_t pieces;   /* document pieces */
} ld_row_stats;

/* Write row `r` of `plan` (docs as given to the build) into ids/labels/pos [T] (int32) and
 * append the start of each segment (row start included, padding tail included), offset by
 * `base` (the row's index in the flattened batch, B*T units), at cu[*n_cu], advancing *n_cu.
 * pad_id: token id for padding. *st receives the row's counts. The segment metadata of layout 2
 * goes at the same index as its cu entry: seg_kind[k] = the piece's doc kind (padding:
 * BT_SEG_PLAIN), seg_pair[k] = -1 for plain, the partner's index for REJECTED, else *n_rec
 * (the batch's running record count, advanced). seg_pair / seg_kind may be NULL (not written).
 * Layout 3: seg_src[k] / seg_line[k] = the doc's src / line (-1 / -1 for plain and padding);
 * seg_src / seg_line may be NULL (not written). The ref fields are the caller's. */
void ld_pack_write_row(const ld_pack_plan *plan, size_t r, const ld_pack_doc *docs, uint32_t T,
                       int32_t pad_id, uint32_t base, int32_t *ids, int32_t *labels, int32_t *pos,
                       int32_t *cu, uint32_t *n_cu, ld_row_stats *st, int32_t *seg_pair, int32_t *seg_kind,
                       int32_t *n_rec, int32_t *seg_src, int32_t *seg_line);
/* Write an all-padding row (one segment) the same way. */
void ld_pack_write_pad_row(uint32_t T, int32_t pad_id, uint32_t base, int32_t *ids,
                           int32_t *labels, int32_t *pos, int32_t *cu, uint32_t *n_cu, int32_t *seg_pair,
                           int32_t *seg_kind, int32_t *seg_src, int32_t *seg_line);

#endif
