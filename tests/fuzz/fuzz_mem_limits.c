/* libFuzzer target: the parsers of the memory limits `trainer train` checks its plan against
 * (trainer/mem_limits.h; issue 21 §7): /proc/meminfo, /proc/self/cgroup and
 * /proc/self/mountinfo text, and the cgroup limit files they lead to.
 * Input: three texts separated by 0x00 bytes (meminfo, cgroup, mountinfo), written to files in a
 * private temporary directory; a fourth part, when present, is written as every memory.max /
 * memory.limit_in_bytes the walk up a cgroup path "/a/b" below "<dir>/cg" may read (mountinfo
 * lines naming "<dir>/cg" as a cgroup2 or v1 memory mount reach them).
 * Invariants: never crashes, hangs or leaks; every limit is either "none" (< 0) or a finite
 * number >= 0; the limit file named is NUL-terminated and empty exactly when there is no cgroup
 * limit; bt_mem_limit_min is one of the limits (or none). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fuzz_common.h"
#include "trainer/mem_limits.h"

static char g_dir[64];

static const char *const k_files[] = {"meminfo", "cgroup", "mountinfo", "cg/memory.max", "cg/a/memory.max",
                                      "cg/a/b/memory.max", "cg/memory.limit_in_bytes", "cg/a/memory.limit_in_bytes",
                                      "cg/a/b/memory.limit_in_bytes", "cg/a/b", "cg/a", "cg", NULL};

/* The temporary directory goes when the fuzzer exits (libFuzzer ends with exit()). */
static void cleanup(void) {
    char p[128];
    for (int i = 0; k_files[i]; i++) {
        snprintf(p, sizeof p, "%s/%s", g_dir, k_files[i]);
        if (unlink(p) != 0) rmdir(p);
    }
    rmdir(g_dir);
}

static void put(const char *rel, const uint8_t *p, size_t n) {
    char path[256];
    snprintf(path, sizeof path, "%s/%s", g_dir, rel);
    FILE *f = fopen(path, "wb");
    if (!f) fuzz_fail("cannot write a temporary file");
    if (n && fwrite(p, 1, n, f) != n) fuzz_fail("short write");
    fclose(f);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!g_dir[0]) {
        snprintf(g_dir, sizeof g_dir, "/tmp/bt_fuzz_mem_XXXXXX");
        if (!mkdtemp(g_dir)) fuzz_fail("mkdtemp");
        char p[128];
        snprintf(p, sizeof p, "%s/cg", g_dir);
        mkdir(p, 0755);
        snprintf(p, sizeof p, "%s/cg/a", g_dir);
        mkdir(p, 0755);
        snprintf(p, sizeof p, "%s/cg/a/b", g_dir);
        mkdir(p, 0755);
        atexit(cleanup);
    }
    static const char *const names[3] = {"meminfo", "cgroup", "mountinfo"};
    const uint8_t *p = data, *end = data + size;
    for (int k = 0; k < 4; k++) {
        const uint8_t *z = memchr(p, 0, (size_t)(end - p));
        size_t n = z ? (size_t)(z - p) : (size_t)(end - p);
        if (k < 3) {
            put(names[k], p, n);
        } else {
            static const char *const lim[] = {"cg/memory.max", "cg/a/memory.max", "cg/a/b/memory.max",
                                              "cg/memory.limit_in_bytes", "cg/a/memory.limit_in_bytes",
                                              "cg/a/b/memory.limit_in_bytes"};
            for (size_t i = 0; i < sizeof lim / sizeof lim[0]; i++) put(lim[i], p, n);
        }
        p = z ? z + 1 : end;
    }
    char mi[128], cg[128], mt[128];
    snprintf(mi, sizeof mi, "%s/meminfo", g_dir);
    snprintf(cg, sizeof cg, "%s/cgroup", g_dir);
    snprintf(mt, sizeof mt, "%s/mountinfo", g_dir);
    bt_mem_sources src = {mi, cg, mt, 0};
    bt_mem_limits l;
    bt_mem_limits_read(&l, &src);
    const double v[3] = {l.mem_available, l.cgroup, l.rlimit_as};
    for (int i = 0; i < 3; i++)
        if (!isfinite(v[i]) || (v[i] < 0 && v[i] != -1)) fuzz_fail("a limit that is neither none nor >= 0");
    if (memchr(l.cgroup_file, 0, sizeof l.cgroup_file) == NULL) fuzz_fail("unterminated cgroup file name");
    if ((l.cgroup_file[0] != 0) != (l.cgroup >= 0)) fuzz_fail("cgroup limit and its file disagree");
    const char *which;
    double m = bt_mem_limit_min(&l, &which);
    if (m != -1 && m != v[0] && m != v[1] && m != v[2]) fuzz_fail("the smallest limit is none of them");
    char d[1400];
    bt_mem_limits_describe(&l, d, sizeof d);
    return 0;
}
