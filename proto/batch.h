/* The batch contract from loaderd (producer) to trainer (consumer): docs/ARCHITECTURE.md §Batch.
 * A micro-batch is B rows of T tokens, stored in one ring slot:
 *   [bt_batch_header][pad to 64][input_ids i32 B*T][labels i32 B*T][position_ids i32 B*T]
 *   [cu_seqlens i32 (B*T + 1)][seg_pair i32 (B*T)][seg_kind i32 (B*T)]
 *   [seg_src i32 (B*T)][seg_line i32 (B*T)][seg_ref_ok i32 (B*T)][seg_ref_logp f64 (B*T)]
 *   (each array starts 64-byte aligned; seg_pair / seg_kind since layout version 2, seg_src ..
 *   seg_ref_logp since 3)
 * labels follow Hugging Face's *unshifted* convention: labels[t] is the target for the model's
 * prediction made at position t-1 (the trainer shifts). -100 marks no loss: prompt tokens,
 * padding, and the first token of each packed document (it must not be predicted from the
 * previous document). position_ids restart at 0 for each document. cu_seqlens are cumulative
 * segment boundaries over the flattened B*T tokens (flash-attn varlen convention):
 * cu_seqlens[0] = 0, cu_seqlens[n_cu-1] = B*T, every row start is a boundary, padding at the end
 * of a row is its own segment (all labels -100). Attention never crosses a boundary.
 * Per segment k (tokens cu_seqlens[k] .. cu_seqlens[k+1]), entries 0 .. n_cu-2 used (layout 2,
 * issue 25): seg_kind[k] is a BT_SEG_* value, seg_pair[k] the index of the preference record the
 * segment belongs to, counted from 0 in order of appearance within the batch, or -1 for a plain
 * segment. A pair is two adjacent segments of one row, CHOSEN then REJECTED, same seg_pair; a KTO
 * record is one segment with its own index. A batch without preference data has every segment
 * BT_SEG_PLAIN / -1 (what a layout-1 batch meant).
 * Layout 3 (issue 25 §2, reference log-probs kept in loaderd's token cache), per segment k:
 * seg_src[k] / seg_line[k] name the record a CHOSEN / REJECTED / KTO segment comes from: the index
 * of its shard in the job (0-based, in the order of the job's resolved shard list, datasets in
 * order; the attach reply's "shards" counts them) and its 1-based line number in that shard (-1
 * when the line number exceeds INT32_MAX: such a record's reference value is never cached); -1 / -1
 * for a plain segment. They are the key of bt_client_ref_put (proto/client.h).
 * seg_ref_ok[k] is 1 when seg_ref_logp[k] holds the reference model's log-probability of the
 * segment, as stored in loaderd's token cache for this job's ref_base (loaderd/tcache.h): the sum,
 * in nats, over the segment's labelled tokens t (labels[t] != -100) of log p_ref(labels[t] |
 * input_ids[segment start .. t-1]) (natural log, the unshifted-labels convention above), the value
 * a trainer computed and handed back with bt_client_ref_put; 0 (and seg_ref_logp[k] = 0.0) when the
 * cache has none: the trainer computes it (and should hand it back). Always 0 for plain segments
 * and for jobs without ref_base. The ref fields are a cache: token arrays, resume_state and the
 * order of batches never depend on them. */
#ifndef BT_PROTO_BATCH_H
#define BT_PROTO_BATCH_H
#include <stddef.h>
#include <stdint.h>

#define BT_BATCH_MAGIC 0x41425442u /* "BTBA" little-endian */
#define BT_BATCH_LAYOUT_VERSION 3u
#define BT_RESUME_STATE_BYTES 256u
#define BT_LABEL_IGNORE (-100)

enum {
    BT_BATCH_F_END_OF_DATA = 1u << 0, /* no rows: the stream has ended (finite epochs) */
};

/* seg_kind values (layout 2): what a segment is. */
enum {
    BT_SEG_PLAIN = 0,          /* an SFT document piece, or padding */
    BT_SEG_CHOSEN = 1,         /* preference pair: the chosen response's document */
    BT_SEG_REJECTED = 2,       /* preference pair: the rejected one (the next segment after CHOSEN) */
    BT_SEG_KTO_DESIRABLE = 3,  /* kto record with "label": true */
    BT_SEG_KTO_UNDESIRABLE = 4,/* kto record with "label": false */
    BT_SEG_N
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
    int32_t *seg_pair;     /* capacity B*T, hdr->n_cu - 1 used (layout 2) */
    int32_t *seg_kind;     /* capacity B*T, hdr->n_cu - 1 used: BT_SEG_* (layout 2) */
    int32_t *seg_src;      /* capacity B*T, n_cu - 1 used: shard index in the job, -1 plain (layout 3) */
    int32_t *seg_line;     /* capacity B*T, n_cu - 1 used: 1-based line in that shard, -1 plain / unknown */
    int32_t *seg_ref_ok;   /* capacity B*T, n_cu - 1 used: 1 = seg_ref_logp[k] is the cached reference value */
    double *seg_ref_logp;  /* capacity B*T, n_cu - 1 used: reference summed log-prob (nats), 0.0 when !ok */
} bt_batch_view;

/* Bytes of one slot for B x T (64-byte multiple). */
size_t bt_batch_slot_bytes(uint32_t B, uint32_t T);
/* Point a view at a slot of bt_batch_slot_bytes(B,T) bytes (does not touch the contents). */
void bt_batch_view_init(bt_batch_view *v, void *slot, uint32_t B, uint32_t T);
/* FNV-1a 64 over input_ids, labels, position_ids (B*T each), cu_seqlens[0..n_cu), then
 * seg_pair, seg_kind, seg_src, seg_line, seg_ref_ok and seg_ref_logp, each [0..n_cu-1) (the f64
 * values as their little-endian IEEE-754 bytes). */
uint64_t bt_batch_checksum(const bt_batch_view *v);
/* Structural check of a received batch: magic, version, B/T match, n_cu in range, cu_seqlens
 * strictly increasing from 0 to B*T with every row start present, position_ids restart at
 * each boundary, token ids in [0, vocab) (vocab <= 0 skips that check), checksum; seg_kind in
 * range, plain segments with seg_pair -1, every CHOSEN followed in the same row by its REJECTED
 * (same seg_pair) and every REJECTED preceded by its CHOSEN, record indices 0, 1, 2... in order;
 * plain segments with seg_src / seg_line -1 and seg_ref_ok 0, others with seg_src >= 0 and seg_line
 * >= 1 or -1 (a pair's two segments the same), seg_ref_ok 0 or 1, seg_ref_logp 0.0 when not ok and
 * finite and <= 0 when ok. BT_ERR_FORMAT with a message on the first violation. */
int bt_batch_validate(const bt_batch_view *v, uint32_t B, uint32_t T, int32_t vocab);

#endif
