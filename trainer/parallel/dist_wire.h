/* Internal to trainer/parallel/dist_rdv.c and trainer/parallel/dist_monitor.c: the connections a rendezvous
 * hands to the monitor (trainer/parallel/dist.h, trainer/parallel/dist_monitor.h); the wire's little-endian
 * fields are written with common/bt_le.h. */
#ifndef BT_TRAINER_DIST_WIRE_H
#define BT_TRAINER_DIST_WIRE_H
#include <stdint.h>

#include "common/bt_le.h"

#define BT_DIST_HOST_MAX 64 /* host name bytes carried per rank (NUL-terminated, truncated) */

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
