/* Batch slot layout, checksum and structural validation (contract: proto/batch.h,
 * proto/PROTOCOL.md §4). */
#include "proto/batch.h"

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "common/bt_common.h"

_Static_assert(sizeof(bt_batch_header) == 320, "bt_batch_header layout changed: update PROTOCOL.md");
_Static_assert(offsetof(bt_batch_header, step) == 16, "batch header layout");
_Static_assert(offsetof(bt_batch_header, checksum) == 56, "batch header layout");
_Static_assert(offsetof(bt_batch_header, resume_state) == 64, "batch header layout");

/* Largest B*T accepted by the layout: keeps every byte count far below SIZE_MAX and the
 * int32 cu_seqlens values representable. */
#define BT_BATCH_MAX_TOKENS (1u << 28)

static size_t round64(size_t n) { return (n + 63u) & ~(size_t)63u; }

size_t bt_batch_slot_bytes(uint32_t B, uint32_t T) {
    if (B == 0 || T == 0) return 0;
    uint64_t bt = (uint64_t)B * T;
    if (bt > BT_BATCH_MAX_TOKENS) return 0;
    size_t arr = round64((size_t)bt * sizeof(int32_t));
    size_t cu = round64(((size_t)bt + 1) * sizeof(int32_t));
    return round64(sizeof(bt_batch_header)) + 8 * arr + cu + round64((size_t)bt * sizeof(double));
}

void bt_batch_view_init(bt_batch_view *v, void *slot, uint32_t B, uint32_t T) {
    uint8_t *p = slot;
    size_t bt = (size_t)B * T;
    size_t arr = round64(bt * sizeof(int32_t));
    size_t off = round64(sizeof(bt_batch_header));
    v->hdr = slot;
    v->input_ids = (int32_t *)(p + off);
    v->labels = (int32_t *)(p + off + arr);
    v->position_ids = (int32_t *)(p + off + 2 * arr);
    v->cu_seqlens = (int32_t *)(p + off + 3 * arr);
    size_t cu = round64((bt + 1) * sizeof(int32_t));
    v->seg_pair = (int32_t *)(p + off + 3 * arr + cu);
    v->seg_kind = (int32_t *)(p + off + 4 * arr + cu);
    v->seg_src = (int32_t *)(p + off + 5 * arr + cu);
    v->seg_line = (int32_t *)(p + off + 6 * arr + cu);
    v->seg_ref_ok = (int32_t *)(p + off + 7 * arr + cu);
    v->seg_ref_logp = (double *)(p + off + 8 * arr + cu);
}

uint64_t bt_batch_checksum(const bt_batch_view *v) {
    size_t bt = (size_t)v->hdr->B * v->hdr->T;
    uint32_t n_cu = v->hdr->n_cu;
    if (n_cu > bt + 1) n_cu = (uint32_t)(bt + 1); /* never read past the slot */
    uint64_t h = BT_FNV64_INIT;
    h = bt_fnv1a64(h, v->input_ids, bt * sizeof(int32_t));
    h = bt_fnv1a64(h, v->labels, bt * sizeof(int32_t));
    h = bt_fnv1a64(h, v->position_ids, bt * sizeof(int32_t));
    h = bt_fnv1a64(h, v->cu_seqlens, (size_t)n_cu * sizeof(int32_t));
    size_t ns = n_cu ? n_cu - 1 : 0;
    h = bt_fnv1a64(h, v->seg_pair, ns * sizeof(int32_t));
    h = bt_fnv1a64(h, v->seg_kind, ns * sizeof(int32_t));
    h = bt_fnv1a64(h, v->seg_src, ns * sizeof(int32_t));
    h = bt_fnv1a64(h, v->seg_line, ns * sizeof(int32_t));
    h = bt_fnv1a64(h, v->seg_ref_ok, ns * sizeof(int32_t));
    h = bt_fnv1a64(h, v->seg_ref_logp, ns * sizeof(double));
    return h;
}

int bt_batch_validate(const bt_batch_view *v, uint32_t B, uint32_t T, int32_t vocab) {
    const bt_batch_header *h = v->hdr;
    if (h->magic != BT_BATCH_MAGIC)
        return bt_fail(BT_ERR_FORMAT, "batch: bad magic 0x%08x (want 0x%08x)", h->magic, BT_BATCH_MAGIC);
    if (h->layout_version != BT_BATCH_LAYOUT_VERSION)
        return bt_fail(BT_ERR_FORMAT, "batch: layout version %u (want %u)", h->layout_version,
                       BT_BATCH_LAYOUT_VERSION);
    if (h->B != B || h->T != T)
        return bt_fail(BT_ERR_FORMAT, "batch step %llu: shape %ux%u (want %ux%u)",
                       (unsigned long long)h->step, h->B, h->T, B, T);
    if (h->flags & ~(uint32_t)BT_BATCH_F_END_OF_DATA)
        return bt_fail(BT_ERR_FORMAT, "batch step %llu: unknown flags 0x%x", (unsigned long long)h->step,
                       h->flags);
    if (h->flags & BT_BATCH_F_END_OF_DATA) return BT_OK; /* no rows to check */
    if (bt_batch_slot_bytes(B, T) == 0)
        return bt_fail(BT_ERR_FORMAT, "batch: shape %ux%u out of range", B, T);
    const uint32_t bt = B * T;
    unsigned long long step = (unsigned long long)h->step;
    uint32_t n_cu = h->n_cu;
    if (n_cu < B + 1 || n_cu > bt + 1)
        return bt_fail(BT_ERR_FORMAT, "batch step %llu: n_cu %u outside [%u, %u]", step, n_cu, B + 1, bt + 1);
    if (h->n_real_tokens > bt || h->n_labelled_tokens > bt)
        return bt_fail(BT_ERR_FORMAT, "batch step %llu: token counts %u/%u exceed B*T=%u", step,
                       h->n_real_tokens, h->n_labelled_tokens, bt);
    if (bt_batch_checksum(v) != h->checksum)
        return bt_fail(BT_ERR_FORMAT, "batch step %llu: checksum mismatch", step);
    const int32_t *cu = v->cu_seqlens;
    if (cu[0] != 0) return bt_fail(BT_ERR_FORMAT, "batch step %llu: cu_seqlens[0]=%d (want 0)", step, cu[0]);
    if ((uint32_t)cu[n_cu - 1] != bt)
        return bt_fail(BT_ERR_FORMAT, "batch step %llu: cu_seqlens[%u]=%d (want B*T=%u)", step, n_cu - 1,
                       cu[n_cu - 1], bt);
    uint32_t next_row = 0; /* next row start that must appear as a boundary */
    uint32_t labelled = 0;
    for (uint32_t k = 0; k + 1 < n_cu; k++) {
        int32_t a = cu[k], b = cu[k + 1];
        if (b <= a)
            return bt_fail(BT_ERR_FORMAT, "batch step %llu: cu_seqlens not increasing at %u (%d -> %d)", step,
                           k, a, b);
        if ((uint32_t)b > bt)
            return bt_fail(BT_ERR_FORMAT, "batch step %llu: cu_seqlens[%u]=%d beyond B*T", step, k + 1, b);
        if ((uint32_t)a > next_row)
            return bt_fail(BT_ERR_FORMAT, "batch step %llu: row start %u is not a segment boundary", step,
                           next_row);
        if ((uint32_t)a == next_row) next_row += T;
        if ((uint32_t)a / T != ((uint32_t)b - 1) / T)
            return bt_fail(BT_ERR_FORMAT, "batch step %llu: segment [%d,%d) crosses a row end", step, a, b);
        if (v->labels[a] != BT_LABEL_IGNORE)
            return bt_fail(BT_ERR_FORMAT, "batch step %llu: first token of segment at %d has a label", step, a);
        for (int32_t t = a; t < b; t++) {
            if (v->position_ids[t] != t - a)
                return bt_fail(BT_ERR_FORMAT, "batch step %llu: position_ids[%d]=%d (want %d: restart per segment)",
                               step, t, v->position_ids[t], t - a);
            int32_t id = v->input_ids[t], lab = v->labels[t];
            if (id < 0 || (vocab > 0 && id >= vocab))
                return bt_fail(BT_ERR_FORMAT, "batch step %llu: input_ids[%d]=%d outside [0,%d)", step, t, id, vocab);
            if (lab != BT_LABEL_IGNORE) {
                if (lab < 0 || (vocab > 0 && lab >= vocab))
                    return bt_fail(BT_ERR_FORMAT, "batch step %llu: labels[%d]=%d outside [0,%d)", step, t, lab,
                                   vocab);
                labelled++;
            }
        }
    }
    int32_t next_rec = 0; /* preference records are numbered 0, 1, 2... in order */
    for (uint32_t k = 0; k + 1 < n_cu; k++) {
        int32_t kind = v->seg_kind[k], pair = v->seg_pair[k];
        if (kind < 0 || kind >= BT_SEG_N)
            return bt_fail(BT_ERR_FORMAT, "batch step %llu: seg_kind[%u]=%d unknown", step, k, kind);
        int32_t src = v->seg_src[k], line = v->seg_line[k], ok = v->seg_ref_ok[k];
        double lp = v->seg_ref_logp[k];
        if (ok != 0 && ok != 1)
            return bt_fail(BT_ERR_FORMAT, "batch step %llu: seg_ref_ok[%u]=%d (want 0 or 1)", step, k, ok);
        if (ok ? !(isfinite(lp) && lp <= 0.0) : lp != 0.0)
            return bt_fail(BT_ERR_FORMAT, "batch step %llu: seg_ref_logp[%u]=%g with seg_ref_ok %d", step, k, lp, ok);
        if (kind == BT_SEG_PLAIN) {
            if (pair != -1)
                return bt_fail(BT_ERR_FORMAT, "batch step %llu: plain segment %u has seg_pair %d (want -1)", step, k,
                               pair);
            if (src != -1 || line != -1 || ok)
                return bt_fail(BT_ERR_FORMAT, "batch step %llu: plain segment %u has seg_src %d, seg_line %d, "
                               "seg_ref_ok %d (want -1, -1, 0)", step, k, src, line, ok);
            continue;
        }
        if (src < 0 || (line < 1 && line != -1))
            return bt_fail(BT_ERR_FORMAT, "batch step %llu: segment %u has seg_src %d, seg_line %d", step, k, src,
                           line);
        if (kind == BT_SEG_REJECTED) {
            if (k == 0 || v->seg_kind[k - 1] != BT_SEG_CHOSEN || v->seg_pair[k - 1] != pair ||
                v->seg_src[k - 1] != src || v->seg_line[k - 1] != line)
                return bt_fail(BT_ERR_FORMAT, "batch step %llu: rejected segment %u does not follow its chosen "
                               "segment", step, k);
            continue;
        }
        if (pair != next_rec)
            return bt_fail(BT_ERR_FORMAT, "batch step %llu: segment %u has seg_pair %d (want %d)", step, k, pair,
                           next_rec);
        next_rec++;
        if (kind == BT_SEG_CHOSEN &&
            (k + 2 >= n_cu || v->seg_kind[k + 1] != BT_SEG_REJECTED || (uint32_t)cu[k] / T != (uint32_t)cu[k + 1] / T))
            return bt_fail(BT_ERR_FORMAT, "batch step %llu: chosen segment %u is not followed by its rejected "
                           "segment in the same row", step, k);
    }
    if (next_row != bt)
        return bt_fail(BT_ERR_FORMAT, "batch step %llu: row start %u is not a segment boundary", step, next_row);
    if (labelled != h->n_labelled_tokens)
        return bt_fail(BT_ERR_FORMAT, "batch step %llu: n_labelled_tokens %u but %u labels present", step,
                       h->n_labelled_tokens, labelled);
    return BT_OK;
}
