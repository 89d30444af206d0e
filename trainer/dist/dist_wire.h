/* Internal to trainer/dist/dist_rdv.c and trainer/dist/dist_monitor.c: little-endian helpers and the
 * connections a rendezvous hands to the monitor (trainer/dist/dist.h, trainer/dist/dist_monitor.h). */
#ifndef BT_TRAINER_DIST_WIRE_H
#define BT_TRAINER_DIST_WIRE_H
#include <stdint.h>

#define BT_DIST_HOST_MAX 64 /* host name bytes carried per rank (NUL-terminated, truncated) */

static inline void bt_put32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint32_t bt_get32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static inline void bt_put64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint64_t bt_get64(const uint8_t *p) {
    return (uint64_t)bt_get32(p) | (uint64_t)bt_get32(p + 4) << 32;
}

/* The authenticated TCP connections of a finished rendezvous: rank 0 holds one per other rank
 * (fd[r], r in [1, world); fd[0] = -1), every other rank one to rank 0 (fd[0]; the rest -1).
 * pid[r] / host[r]: what each rank said in its hello (rank 0 knows every rank; the others know
 * rank 0 and themselves; unknown: pid 0, host ""). Owned: bt_dist_link_free closes and frees. */
struct bt_dist_link {
    int rank, world;
    int *fd;
    int32_t *pid;
    char (*host)[BT_DIST_HOST_MAX];
};

#endif
