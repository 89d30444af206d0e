/* Single-producer / single-consumer ring of batch slots in a memfd (docs/ARCHITECTURE.md §Ring).
 * Memory: [bt_ring_header (4096 bytes)][slot 0][slot 1]...; slot size bt_batch_slot_bytes(B,T).
 * head = slots produced, tail = slots consumed (monotonic u64, C11 acquire/release).
 * Waiting uses futexes on 32-bit sequence words (head_seq, tail_seq) bumped after every
 * commit/release, FUTEX_WAKE only when the other side flagged it is waiting. The memfd is
 * sealed (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) so a peer cannot truncate it under us.
 * Either side may set `closed` (producer: no more data; consumer: detached) and wake the other. */
#ifndef BT_PROTO_RING_H
#define BT_PROTO_RING_H
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define BT_RING_MAGIC 0x3130474e49525442ull /* "BTRING01" */
#define BT_RING_VERSION 1u
#define BT_RING_HEADER_BYTES 4096u

typedef struct {
    uint64_t magic;
    uint32_t version;
    uint32_t n_slots;
    uint64_t slot_bytes;
    uint32_t B, T;
    uint64_t total_bytes;
    _Alignas(64) _Atomic uint64_t head;
    _Atomic uint32_t head_seq;
    _Atomic uint32_t consumer_waiting;
    _Alignas(64) _Atomic uint64_t tail;
    _Atomic uint32_t tail_seq;
    _Atomic uint32_t producer_waiting;
    _Alignas(64) _Atomic uint32_t producer_closed;
    _Atomic uint32_t consumer_closed;
} bt_ring_header;

typedef struct {
    bt_ring_header *hdr;
    uint8_t *slots;
    size_t map_bytes;
    int fd;          /* owned: closed by bt_ring_close */
    /* Private copies (never re-read from the peer-writable header): geometry validated at
     * create/attach, and this side's own counter (producer: head, consumer: tail). */
    uint32_t n_slots, B, T;
    size_t slot_bytes;
    uint64_t pos;
    int err;         /* bt_err of the last NULL from acquire/peek (BT_ERR_TIMEOUT/CLOSED/FORMAT) */
} bt_ring;

/* Producer side: memfd_create + ftruncate + seals + mmap + header init.
 * On success r->fd is the memfd (send it with SCM_RIGHTS). n_slots in [1, 4096]; B*T <= 2^28.
 * Errors: BT_ERR_INVALID (geometry), BT_ERR_IO (memfd/ftruncate/seal/mmap, errno text). */
int bt_ring_create(bt_ring *r, uint32_t n_slots, uint32_t B, uint32_t T);
/* Consumer side: map a received fd (takes ownership of fd, closed on failure too) and validate
 * the header against the fd size (a lying header is BT_ERR_FORMAT; a fd without F_SEAL_SHRINK
 * is refused, since a peer could truncate it under us and cause SIGBUS). */
int bt_ring_attach(bt_ring *r, int fd);
void bt_ring_close(bt_ring *r);

/* Producer: wait (up to timeout_ms, -1 forever, 0 = poll) for a free slot; returns it (slot_bytes
 * bytes, owned by the producer until commit) or NULL: BT_ERR_TIMEOUT on timeout, BT_ERR_CLOSED
 * when the consumer closed, BT_ERR_FORMAT when the consumer wrote an impossible tail
 * (message in bt_last_error, code in r->err). */
void *bt_ring_producer_acquire(bt_ring *r, int timeout_ms);
/* Publish the slot returned by the last successful acquire (head+1, release; wakes a waiting
 * consumer). Only after a non-NULL acquire. */
void bt_ring_producer_commit(bt_ring *r);
/* Set producer_closed (after the last commit) and wake the consumer; the mapping stays valid. */
void bt_ring_producer_close(bt_ring *r);
/* Consumer: wait for a filled slot (valid until release); NULL with r->err = BT_ERR_TIMEOUT on
 * timeout, BT_ERR_CLOSED when the producer closed and the ring is empty, BT_ERR_FORMAT when the
 * producer wrote an impossible head. */
void *bt_ring_consumer_peek(bt_ring *r, int timeout_ms);
/* Hand the slot returned by the last successful peek back (tail+1, release; wakes a waiting
 * producer). Only after a non-NULL peek; the slot must not be read afterwards. */
void bt_ring_consumer_release(bt_ring *r);
/* Set consumer_closed (the producer stops with BT_ERR_CLOSED) and wake the producer. */
void bt_ring_consumer_close(bt_ring *r);
/* Slots currently filled (head - tail), clamped to [0, n_slots]. */
uint32_t bt_ring_fill(const bt_ring *r);
/* Whether the producer / consumer has set its closed flag (1) or not (0). */
int bt_ring_producer_closed(const bt_ring *r);
int bt_ring_consumer_closed(const bt_ring *r);

#endif
