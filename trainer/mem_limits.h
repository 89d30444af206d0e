/* What memory this process may use, and whether a run's memory plan fits in it (issue 21 §7).
 *
 * `trainer train` compares its own plan (trainer/estimate.h bt_estimate_bill, the bill `trainer
 * estimate` prints) with every limit it can see before it allocates anything:
 *   MemAvailable   /proc/meminfo: the kernel's estimate of memory available to new work without
 *                  swapping (Documentation/filesystems/proc.rst);
 *   cgroup         the smallest memory limit of this process's cgroup and its ancestors: cgroup v2
 *                  memory.max ("max" = none), v1 memory.limit_in_bytes (values near 2^63 = none),
 *                  found through /proc/self/cgroup and the cgroup mounts of /proc/self/mountinfo
 *                  (Documentation/admin-guide/cgroup-v2.rst, cgroup-v1/memory.rst);
 *   RLIMIT_AS      the soft limit of the address space (getrlimit(2); `ulimit -v`, `prlimit --as`).
 * The sources are files and a flag (bt_mem_sources) so tests give their own; RLIMIT_AS is set for
 * real by the tests (prlimit). */
#ifndef BT_TRAINER_MEM_LIMITS_H
#define BT_TRAINER_MEM_LIMITS_H
#include <stddef.h>

typedef struct {
    const char *meminfo;   /* "/proc/meminfo" */
    const char *cgroup;    /* "/proc/self/cgroup" */
    const char *mountinfo; /* "/proc/self/mountinfo" */
    int rlimit;            /* 1: read getrlimit(RLIMIT_AS); 0: none */
} bt_mem_sources;

/* Limits in bytes; < 0 = none found (or no such limit). */
typedef struct {
    double mem_available;
    double cgroup;          /* the smallest limit on the way up */
    char cgroup_file[1100]; /* the file it came from ("" when none) */
    double rlimit_as;
} bt_mem_limits;

/* Read the limits from `src` (NULL: the real sources above). A source that is missing or cannot
 * be parsed counts as "no limit from it" (the check then rests on the others). Never fails. */
void bt_mem_limits_read(bt_mem_limits *l, const bt_mem_sources *src);

/* The smallest of the limits (bytes) and which one it is ("MemAvailable", "cgroup memory.max",
 * "RLIMIT_AS" ...) in *which (static string); < 0 (and *which "none") when there is none. */
double bt_mem_limit_min(const bt_mem_limits *l, const char **which);

/* "MemAvailable 21.9 GiB, cgroup memory.max (/sys/fs/cgroup/job/memory.max) 8.0 GiB, RLIMIT_AS
 * unlimited" into buf[n]. */
void bt_mem_limits_describe(const bt_mem_limits *l, char *buf, size_t n);

#endif
