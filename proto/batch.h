/* The batch contract from loaderd (producer) to trainer (consumer): docs/ARCHITECTURE.md §Batch.
 * A micro-batch is B rows of T tokens, stored in one ring slot:
 *   [bt_batch_header][pad to 64][input_ids i32 B*T][labels i32 B*T][position_ids i32 B*T]
 *   [cu_seqlens i32 (B*T + 1)]   (each array starts 64-byte aligned)
 * labels follow Hugging Face's *unshifted* convention: labels[t] is the target for the model's
 * prediction made at position t-1 (the trainer shifts). -100 marks no loss: prompt tokens,
 * padding, and the first token of each packed document (it must not be predicted from the
 * previous document). position_ids restart at 0 for each document. cu_seqlens are cumulative
 * segment boundaries over the flattened B*T tokens (flash-attn varlen convention):
 * cu_seqlens[0] = 0, cu_seqlens[n_cu-1] = B*T, every row start is a boundary, padding at the end
 * of a row is its own segment (all labels -100). Attention never crosses a boundary. */
#ifndef BT_PROTO_BATCH_H
#define BT_PROTO_BATCH_H
#include <stddef.h>
#include <stdint.h>

#define BT_BATCH_MAGIC 0x41425442u /* "BTBA" little-endian */
#define BT_BATCH_LAYOUT_VERSION 1u
#define BT_RESUME_STATE_BYTES 256u
#define BT_LABEL_IGNORE (-100)

enum {
    BT_BATCH_F_END_OF_DATA = 1u << 0, /* no rows: the stream has ended (finite epochs) */
};

typedef struct {
    uint32_t magic;            /* BT_BATCH_MAGIC */
    uint32_t layout_version;   /* BT_BATCH_LAYOUT_VERSION */
    uint32_t job_id;
    uint32_t rank;
    uint64_t step;             /* index of this micro-batch in the rank's stream, from 0 */
    uint32_t B, T;
    uint32_t n_real_tokens;    /* non-padding tokens */
    uint32_t n_labelled_tokens;/* labels != -100 */
    uint32_t n_cu;             /* entries used in cu_seqlens (segments + 1) */
    uint32_t n_docs;           /* documents (or document pieces) in this batch */
    uint32_t flags;            /* BT_BATCH_F_* */
    uint32_t epoch;            /* epoch the first row's first document came from */
    uint64_t checksum;         /* bt_batch_checksum of the arrays */
    uint8_t resume_state[BT_RESUME_STATE_BYTES]; /* opaque: loader state after this batch */
} bt_batch_header;

typedef struct {
    bt_batch_header *hdr;
    int32_t *input_ids;    /* [B*T] */
    int32_t *labels;       /* [B*T] */
    int32_t *position_ids; /* [B*T] */
    int32_t *cu_seqlens;   /* capacity B*T + 1, hdr->n_cu used */
} bt_batch_view;

/* Bytes of one slot for B x T (64-byte multiple). */
size_t bt_batch_slot_bytes(uint32_t B, uint32_t T);
/* Point a view at a slot of bt_batch_slot_bytes(B,T) bytes (does not touch the contents). */
void bt_batch_view_init(bt_batch_view *v, void *slot, uint32_t B, uint32_t T);
/* FNV-1a 64 over input_ids, labels, position_ids (B*T each) and cu_seqlens[0..n_cu). */
uint64_t bt_batch_checksum(const bt_batch_view *v);
/* Structural check of a received batch: magic, version, B/T match, n_cu in range, cu_seqlens
 * strictly increasing from 0 to B*T with every row start present, position_ids restart at
 * each boundary, token ids in [0, vocab) (vocab <= 0 skips that check), checksum.
 * BT_ERR_FORMAT with a message on the first violation. */
int bt_batch_validate(const bt_batch_view *v, uint32_t B, uint32_t T, int32_t vocab);

#endif
