/* SPSC batch ring in a sealed memfd, futex wake-ups (contract: proto/ring.h,
 * proto/PROTOCOL.md §3). Sources: memfd_create(2), fcntl(2) "File Sealing", futex(2)
 * (shared, i.e. non-FUTEX_PRIVATE_FLAG, futexes because the two sides are different processes),
 * C11 <stdatomic.h> acquire/release.
 *
 * Each side keeps its own copy of the geometry (n_slots, slot_bytes, B, T) and of its own
 * counter (the producer's head, the consumer's tail) in the bt_ring struct, in private memory:
 * the shared header is writable by the peer, so nothing read from it is trusted for memory
 * addressing. A peer that writes an impossible counter (tail > head, head - tail > n_slots) is
 * reported as BT_ERR_FORMAT and treated as closed. */
#include "proto/ring.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <linux/futex.h>
#include <stddef.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "proto/batch.h"

/* Offsets the Python test consumer (tests/py) and PROTOCOL.md rely on. */
_Static_assert(sizeof(bt_ring_header) <= BT_RING_HEADER_BYTES, "ring header too large");
_Static_assert(offsetof(bt_ring_header, total_bytes) == 32, "ring header layout");
_Static_assert(offsetof(bt_ring_header, head) == 64, "ring header layout");
_Static_assert(offsetof(bt_ring_header, head_seq) == 72, "ring header layout");
_Static_assert(offsetof(bt_ring_header, consumer_waiting) == 76, "ring header layout");
_Static_assert(offsetof(bt_ring_header, tail) == 128, "ring header layout");
_Static_assert(offsetof(bt_ring_header, tail_seq) == 136, "ring header layout");
_Static_assert(offsetof(bt_ring_header, producer_waiting) == 140, "ring header layout");
_Static_assert(offsetof(bt_ring_header, producer_closed) == 192, "ring header layout");
_Static_assert(offsetof(bt_ring_header, consumer_closed) == 196, "ring header layout");

#define RING_MAX_SLOTS 4096u

static long futex_wait(_Atomic uint32_t *addr, uint32_t expected, const struct timespec *rel) {
    return syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT, expected, rel, NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t *addr) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static int ring_total(uint32_t n_slots, uint32_t B, uint32_t T, size_t *slot_bytes, size_t *total) {
    size_t sb = bt_batch_slot_bytes(B, T);
    if (sb == 0) return bt_fail(BT_ERR_INVALID, "ring: batch shape %ux%u out of range", B, T);
    if (n_slots == 0 || n_slots > RING_MAX_SLOTS)
        return bt_fail(BT_ERR_INVALID, "ring: n_slots %u outside [1, %u]", n_slots, RING_MAX_SLOTS);
    if (sb > (SIZE_MAX - BT_RING_HEADER_BYTES) / n_slots)
        return bt_fail(BT_ERR_INVALID, "ring: %u slots of %zu bytes overflow", n_slots, sb);
    *slot_bytes = sb;
    *total = BT_RING_HEADER_BYTES + (size_t)n_slots * sb;
    return BT_OK;
}

static void ring_set_local(bt_ring *r, uint32_t n_slots, uint32_t B, uint32_t T, size_t slot_bytes) {
    r->n_slots = n_slots;
    r->B = B;
    r->T = T;
    r->slot_bytes = slot_bytes;
    r->slots = (uint8_t *)r->hdr + BT_RING_HEADER_BYTES;
}

int bt_ring_create(bt_ring *r, uint32_t n_slots, uint32_t B, uint32_t T) {
    memset(r, 0, sizeof *r);
    r->fd = -1;
    size_t sb, total;
    int rc = ring_total(n_slots, B, T, &sb, &total);
    if (rc) return rc;
    int fd = memfd_create("barq-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) return bt_fail(BT_ERR_IO, "ring: memfd_create: %s", strerror(errno));
    if (ftruncate(fd, (off_t)total) != 0) {
        rc = bt_fail(BT_ERR_IO, "ring: ftruncate %zu bytes: %s", total, strerror(errno));
        close(fd);
        return rc;
    }
    if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
        rc = bt_fail(BT_ERR_IO, "ring: F_ADD_SEALS: %s", strerror(errno));
        close(fd);
        return rc;
    }
    void *m = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
        rc = bt_fail(BT_ERR_IO, "ring: mmap %zu bytes: %s", total, strerror(errno));
        close(fd);
        return rc;
    }
    r->hdr = m;
    r->map_bytes = total;
    r->fd = fd;
    ring_set_local(r, n_slots, B, T, sb);
    bt_ring_header *h = r->hdr; /* memfd pages start zeroed: counters and flags are 0 */
    h->version = BT_RING_VERSION;
    h->n_slots = n_slots;
    h->slot_bytes = sb;
    h->B = B;
    h->T = T;
    h->total_bytes = total;
    atomic_thread_fence(memory_order_release);
    h->magic = BT_RING_MAGIC; /* written last: a mapped header with the magic is complete */
    return BT_OK;
}

int bt_ring_attach(bt_ring *r, int fd) {
    memset(r, 0, sizeof *r);
    r->fd = -1;
    int rc;
    struct stat st;
    if (fd < 0) return bt_fail(BT_ERR_INVALID, "ring: attach: bad fd %d", fd);
    if (fstat(fd, &st) != 0) {
        rc = bt_fail(BT_ERR_IO, "ring: fstat: %s", strerror(errno));
        goto fail_fd;
    }
    if (!S_ISREG(st.st_mode) || st.st_size < (off_t)BT_RING_HEADER_BYTES) {
        rc = bt_fail(BT_ERR_FORMAT, "ring: fd is %lld bytes, smaller than the %u-byte header",
                     (long long)st.st_size, BT_RING_HEADER_BYTES);
        goto fail_fd;
    }
    int seals = fcntl(fd, F_GET_SEALS);
    if (seals < 0 || !(seals & F_SEAL_SHRINK)) {
        rc = bt_fail(BT_ERR_FORMAT, "ring: fd is not a memfd sealed against shrinking (seals %d)", seals);
        goto fail_fd;
    }
    /* Read the geometry from a private copy of the header, check it against the fd size, and
     * only then map the whole file. */
    bt_ring_header hcopy;
    if (pread(fd, &hcopy, sizeof hcopy, 0) != (ssize_t)sizeof hcopy) {
        rc = bt_fail(BT_ERR_IO, "ring: reading header: %s", strerror(errno));
        goto fail_fd;
    }
    if (hcopy.magic != BT_RING_MAGIC || hcopy.version != BT_RING_VERSION) {
        rc = bt_fail(BT_ERR_FORMAT, "ring: bad magic/version (0x%llx/%u)", (unsigned long long)hcopy.magic,
                     hcopy.version);
        goto fail_fd;
    }
    size_t sb, total;
    if ((rc = ring_total(hcopy.n_slots, hcopy.B, hcopy.T, &sb, &total)) != 0) {
        char why[256]; /* bt_fail must not read the buffer it writes */
        snprintf(why, sizeof why, "%s", bt_last_error());
        rc = bt_fail(BT_ERR_FORMAT, "ring: header geometry invalid: %s", why);
        goto fail_fd;
    }
    if (hcopy.slot_bytes != sb || hcopy.total_bytes != total || (uint64_t)st.st_size != total) {
        rc = bt_fail(BT_ERR_FORMAT,
                     "ring: lying header: %u slots x %llu bytes (%llu total) but the layout needs %zu x %zu "
                     "(%zu) and the fd holds %lld bytes",
                     hcopy.n_slots, (unsigned long long)hcopy.slot_bytes, (unsigned long long)hcopy.total_bytes,
                     sb, total, total, (long long)st.st_size);
        goto fail_fd;
    }
    void *m = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
        rc = bt_fail(BT_ERR_IO, "ring: mmap %zu bytes: %s", total, strerror(errno));
        goto fail_fd;
    }
    r->hdr = m;
    r->map_bytes = total;
    r->fd = fd;
    ring_set_local(r, hcopy.n_slots, hcopy.B, hcopy.T, sb);
    r->pos = atomic_load_explicit(&r->hdr->tail, memory_order_acquire);
    return BT_OK;
fail_fd:
    close(fd);
    return rc;
}

void bt_ring_close(bt_ring *r) {
    if (r->hdr) munmap(r->hdr, r->map_bytes);
    if (r->fd >= 0) close(r->fd);
    memset(r, 0, sizeof *r);
    r->fd = -1;
}

/* Relative timeout left until `deadline` (CLOCK_MONOTONIC seconds); 0 when passed. */
static int time_left(double deadline, struct timespec *ts) {
    double left = deadline - bt_now();
    if (left <= 0) return 0;
    ts->tv_sec = (time_t)left;
    ts->tv_nsec = (long)((left - (double)ts->tv_sec) * 1e9);
    return 1;
}

/* Block on `seq` (expected value `seen`) with the `waiting` flag raised, until woken or the
 * deadline (timeout_ms < 0: none). Returns 0 to re-check, BT_ERR_TIMEOUT when time is up.
 * The caller re-checks its condition after raising the flag (proto/PROTOCOL.md §3, Wake-ups). */
static int ring_block(_Atomic uint32_t *seq, uint32_t seen, int timeout_ms, double deadline) {
    struct timespec ts, *tp = NULL;
    if (timeout_ms >= 0) {
        if (!time_left(deadline, &ts)) return BT_ERR_TIMEOUT;
        tp = &ts;
    }
    long rc = futex_wait(seq, seen, tp);
    if (rc != 0 && errno == ETIMEDOUT) return BT_ERR_TIMEOUT;
    return 0; /* woken, EAGAIN (value changed) or EINTR: re-check */
}

void *bt_ring_producer_acquire(bt_ring *r, int timeout_ms) {
    bt_ring_header *h = r->hdr;
    double deadline = timeout_ms >= 0 ? bt_now() + timeout_ms / 1000.0 : 0;
    for (;;) {
        if (atomic_load_explicit(&h->consumer_closed, memory_order_acquire)) {
            r->err = bt_fail(BT_ERR_CLOSED, "ring: consumer closed");
            return NULL;
        }
        uint64_t tail = atomic_load_explicit(&h->tail, memory_order_acquire);
        if (tail > r->pos || r->pos - tail > r->n_slots) {
            r->err = bt_fail(BT_ERR_FORMAT, "ring: consumer wrote an impossible tail %llu (head %llu)",
                    (unsigned long long)tail, (unsigned long long)r->pos);
            return NULL;
        }
        if (r->pos - tail < r->n_slots) return r->slots + (size_t)(r->pos % r->n_slots) * r->slot_bytes;
        if (timeout_ms == 0) {
            r->err = bt_fail(BT_ERR_TIMEOUT, "ring: no free slot");
            return NULL;
        }
        uint32_t seen = atomic_load(&h->tail_seq);
        atomic_store(&h->producer_waiting, 1);
        /* re-check after raising the flag so a release in between is not missed */
        if (atomic_load(&h->tail) != tail || atomic_load(&h->consumer_closed)) {
            atomic_store(&h->producer_waiting, 0);
            continue;
        }
        int rc = ring_block(&h->tail_seq, seen, timeout_ms, deadline);
        atomic_store(&h->producer_waiting, 0);
        if (rc == BT_ERR_TIMEOUT) {
            r->err = bt_fail(BT_ERR_TIMEOUT, "ring: no free slot within %d ms", timeout_ms);
            return NULL;
        }
    }
}

void bt_ring_producer_commit(bt_ring *r) {
    bt_ring_header *h = r->hdr;
    r->pos++;
    atomic_store_explicit(&h->head, r->pos, memory_order_release);
    atomic_fetch_add(&h->head_seq, 1);
    if (atomic_load(&h->consumer_waiting)) futex_wake_all(&h->head_seq);
}

void bt_ring_producer_close(bt_ring *r) {
    bt_ring_header *h = r->hdr;
    atomic_store_explicit(&h->producer_closed, 1, memory_order_release);
    atomic_fetch_add(&h->head_seq, 1);
    futex_wake_all(&h->head_seq);
}

void *bt_ring_consumer_peek(bt_ring *r, int timeout_ms) {
    bt_ring_header *h = r->hdr;
    double deadline = timeout_ms >= 0 ? bt_now() + timeout_ms / 1000.0 : 0;
    for (;;) {
        uint64_t head = atomic_load_explicit(&h->head, memory_order_acquire);
        if (head < r->pos || head - r->pos > r->n_slots) {
            r->err = bt_fail(BT_ERR_FORMAT, "ring: producer wrote an impossible head %llu (tail %llu)",
                    (unsigned long long)head, (unsigned long long)r->pos);
            return NULL;
        }
        if (head != r->pos) return r->slots + (size_t)(r->pos % r->n_slots) * r->slot_bytes;
        if (atomic_load_explicit(&h->producer_closed, memory_order_acquire)) {
            /* closed is set after the last commit: look at head once more */
            if (atomic_load_explicit(&h->head, memory_order_acquire) != r->pos) continue;
            r->err = bt_fail(BT_ERR_CLOSED, "ring: producer closed");
            return NULL;
        }
        if (timeout_ms == 0) {
            r->err = bt_fail(BT_ERR_TIMEOUT, "ring: no batch ready");
            return NULL;
        }
        uint32_t seen = atomic_load(&h->head_seq);
        atomic_store(&h->consumer_waiting, 1);
        if (atomic_load(&h->head) != head || atomic_load(&h->producer_closed)) {
            atomic_store(&h->consumer_waiting, 0);
            continue;
        }
        int rc = ring_block(&h->head_seq, seen, timeout_ms, deadline);
        atomic_store(&h->consumer_waiting, 0);
        if (rc == BT_ERR_TIMEOUT) {
            r->err = bt_fail(BT_ERR_TIMEOUT, "ring: no batch within %d ms", timeout_ms);
            return NULL;
        }
    }
}

void bt_ring_consumer_release(bt_ring *r) {
    bt_ring_header *h = r->hdr;
    r->pos++;
    atomic_store_explicit(&h->tail, r->pos, memory_order_release);
    atomic_fetch_add(&h->tail_seq, 1);
    if (atomic_load(&h->producer_waiting)) futex_wake_all(&h->tail_seq);
}

void bt_ring_consumer_close(bt_ring *r) {
    bt_ring_header *h = r->hdr;
    atomic_store_explicit(&h->consumer_closed, 1, memory_order_release);
    atomic_fetch_add(&h->tail_seq, 1);
    futex_wake_all(&h->tail_seq);
}

uint32_t bt_ring_fill(const bt_ring *r) {
    uint64_t head = atomic_load_explicit(&r->hdr->head, memory_order_acquire);
    uint64_t tail = atomic_load_explicit(&r->hdr->tail, memory_order_acquire);
    if (tail > head) return 0;
    uint64_t d = head - tail;
    return d > r->n_slots ? r->n_slots : (uint32_t)d;
}

int bt_ring_producer_closed(const bt_ring *r) {
    return atomic_load_explicit(&r->hdr->producer_closed, memory_order_acquire) != 0;
}

int bt_ring_consumer_closed(const bt_ring *r) {
    return atomic_load_explicit(&r->hdr->consumer_closed, memory_order_acquire) != 0;
}
