/* loaderd ordered tokenize queue: one producer thread fills chunks of lines, n worker threads
 * format and tokenize them in any order, one consumer takes them strictly in production order,
 * so what comes out is independent of thread count and timing (docs/ARCHITECTURE.md §Determinism).
 * Used by the pipeline's stream (reader -> workers -> window builder, loaderd/stream.c) and by
 * the token-cache builder (shard -> workers -> cache entry, loaderd/tcache.c).
 *
 * Slots: a ring of 2 * n_threads + 2 chunks. A chunk goes EMPTY -> PRODUCER (claimed) ->
 * FILLED (published) -> WORKING -> DONE -> EMPTY (released by the consumer). Items the
 * producer already filled (`ready`: from the token cache, or found bad by the producer) are
 * not handed to the worker function; a chunk holding only such items goes straight to DONE.
 * Backpressure: the producer waits for a free slot. Thread-safe as described; one producer and
 * one consumer at a time. */
#ifndef LD_CHUNKQ_H
#define LD_CHUNKQ_H
#include <stddef.h>
#include <stdint.h>

#include "common/tokenizer.h"

#define LD_CHUNK_LINES 64
#define LD_CHUNK_BYTES ((size_t)8 << 20)

typedef struct {
    uint64_t g;       /* merged index within the epoch (stream), or record index (builder) */
    uint64_t dg;      /* line index within its dataset's pass */
    uint64_t line_no; /* 1-based, in its shard */
    uint32_t file;    /* index into the owner's shard paths */
    uint32_t ds, pass;
    int pre_bad;      /* ld_bad_reason found by the producer (too_long), else -1 */
    int ready;        /* bad/ids/mask/truncated/msg already filled: no work for the workers */
    size_t off, len;  /* line bytes in the chunk's text */
    /* results (filled by a worker unless ready) */
    int bad;          /* -1 ok, else ld_bad_reason */
    int truncated;
    bt_ids ids, mask;
    /* preference / kto (issue 25): pref_n documents in ids/mask (0: an SFT document), the first
     * pref_len0 tokens long (a pair: chosen, then rejected); pref_label kto 1/0, else -1 */
    int pref_n, pref_label;
    uint32_t pref_len0;
    uint32_t pref_prompt; /* tokens of the shared prompt prefix (the token cache stores it) */
    char msg[120];
} ld_item;

typedef struct {
    uint64_t seq;
    int state;
    uint32_t epoch;
    int end_epoch; /* stream: last chunk of its epoch */
    int last;      /* stream: last chunk of the whole stream (finite epochs) */
    ld_item *items;
    size_t n, cap;
    char *text;
    size_t tlen, tcap;
} ld_chunk;

/* Worker function: fill it->bad / ids / mask / truncated / msg for the line
 * (line, it->len bytes). Return 0, or a negative bt_err (fatal for the queue). */
typedef int (*ld_item_fn)(void *ctx, ld_item *it, const char *line);

typedef struct ld_chunkq ld_chunkq;

/* Start n_threads (>= 1) workers calling fn(ctx, ...). BT_ERR_NOMEM if a thread cannot start. */
int ld_chunkq_new(ld_chunkq **out, uint32_t n_threads, ld_item_fn fn, void *ctx);
/* Producer: wait for the next free slot and claim it (emptied: n = tlen = 0, flags 0). NULL
 * when the queue is stopping or has failed. */
ld_chunk *ld_chunkq_claim(ld_chunkq *q);
/* Append a line (copied; len 0 allowed) to a claimed chunk; returns its item, zeroed except
 * off/len and pre_bad = bad = -1; when the copy does not fit in memory, a ready item of len 0
 * with bad = pre_bad = LD_BAD_MEMORY and a message instead (the line is skipped and counted,
 * loaderd goes on). Never NULL. */
ld_item *ld_chunk_add(ld_chunk *c, const char *line, size_t len);
/* Producer: hand a claimed chunk to the workers (or straight to the consumer when every item
 * is ready). */
void ld_chunkq_publish(ld_chunkq *q, ld_chunk *c);
/* Producer: no more chunks will come (the consumer gets 1 once it took them all). */
void ld_chunkq_finish(ld_chunkq *q);
/* Anyone: fail the queue with a bt_err code and message (first failure wins); every waiter
 * wakes up, ld_chunkq_take returns the error from then on. */
void ld_chunkq_fail(ld_chunkq *q, int code, const char *msg);
/* Consumer: the next chunk in production order, waiting for it: 0 (*c set), 1 when the
 * producer finished and every chunk was taken, <0 on failure (bt_fail with the message). */
int ld_chunkq_take(ld_chunkq *q, ld_chunk **c);
/* Consumer: give a taken chunk back (frees what its items still own). */
void ld_chunkq_release(ld_chunkq *q, ld_chunk *c);
/* Make claim/take return at once (NULL / error) and the workers exit; then join them. */
void ld_chunkq_stop(ld_chunkq *q);
/* Make ld_chunkq_take return BT_ERR_CLOSED ("cancelled") now and from then on, without stopping
 * the reader or the workers (ld_chunkq_stop does that): the consumer gave up. Thread-safe. */
void ld_chunkq_cancel_take(ld_chunkq *q);
/* Stop, join and free (NULL is fine). */
void ld_chunkq_free(ld_chunkq *q);

#endif
