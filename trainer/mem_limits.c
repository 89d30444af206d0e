/* The memory this process may use. See mem_limits.h. */
#include "trainer/mem_limits.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#define GIB 1073741824.0

/* One line of `f` into buf (cut to n - 1 bytes, the rest of a long line dropped); 0 at the end. */
static int get_line(FILE *f, char *buf, size_t n) {
    if (!fgets(buf, (int)n, f)) return 0;
    size_t k = strlen(buf);
    if (k && buf[k - 1] == '\n') buf[k - 1] = 0;
    else {
        int c;
        while ((c = fgetc(f)) != EOF && c != '\n') {}
    }
    return 1;
}

static double read_meminfo(const char *path) {
    FILE *f = fopen(path, "re");
    if (!f) return -1;
    char line[256];
    double v = -1;
    while (get_line(f, line, sizeof line)) {
        unsigned long long kb;
        if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) {
            v = (double)kb * 1024.0;
            break;
        }
    }
    fclose(f);
    return v;
}

/* The limit in the file `path` (v2 "max" / v1 near 2^63: none): bytes, or -1. */
static double read_limit(const char *path) {
    FILE *f = fopen(path, "re");
    if (!f) return -1;
    char line[64];
    double v = -1;
    if (get_line(f, line, sizeof line)) {
        char *end;
        unsigned long long x = strtoull(line, &end, 10);
        if (end != line && (*end == 0 || *end == ' ') && x < (1ULL << 62)) v = (double)x;
    }
    fclose(f);
    return v;
}

/* mountinfo's octal escapes (\040 for a space) decoded in place. */
static void unescape(char *s) {
    char *o = s;
    for (char *p = s; *p; p++) {
        if (p[0] == '\\' && p[1] >= '0' && p[1] <= '3' && p[2] >= '0' && p[2] <= '7' && p[3] >= '0' && p[3] <= '7') {
            *o++ = (char)((p[1] - '0') * 64 + (p[2] - '0') * 8 + (p[3] - '0'));
            p += 3;
        } else {
            *o++ = *p;
        }
    }
    *o = 0;
}

/* Whether the comma-separated list `opts` holds `word`. */
static int has_word(const char *opts, const char *word) {
    size_t n = strlen(word);
    for (const char *p = opts; p && *p;) {
        const char *c = strchr(p, ',');
        size_t k = c ? (size_t)(c - p) : strlen(p);
        if (k == n && !strncmp(p, word, n)) return 1;
        p = c ? c + 1 : NULL;
    }
    return 0;
}

/* This process's cgroup paths (from /proc/self/cgroup): v2 ("0::/path") and v1 memory. */
static void own_cgroups(const char *path, char *v2, char *v1, size_t n) {
    v2[0] = v1[0] = 0;
    FILE *f = fopen(path, "re");
    if (!f) return;
    char line[1024];
    while (get_line(f, line, sizeof line)) {
        char *a = strchr(line, ':'), *b = a ? strchr(a + 1, ':') : NULL;
        if (!b) continue;
        *a = *b = 0;
        if (!strcmp(line, "0") && a + 1 == b) snprintf(v2, n, "%s", b + 1);
        else if (has_word(a + 1, "memory")) snprintf(v1, n, "%s", b + 1);
    }
    fclose(f);
}

/* Walk from <mount><rel> up to <mount>, keeping the smallest limit in `file`. */
static void walk_up(const char *mnt, const char *root, const char *cg, const char *file, bt_mem_limits *l) {
    char dir[1024];
    size_t rl = strlen(root);
    const char *rel = !strcmp(root, "/") ? cg : !strncmp(cg, root, rl) && (cg[rl] == '/' || !cg[rl]) ? cg + rl : "";
    if ((size_t)snprintf(dir, sizeof dir, "%s%s", mnt, !strcmp(rel, "/") ? "" : rel) >= sizeof dir) return;
    size_t ml = strlen(mnt);
    for (;;) {
        char p[1100];
        snprintf(p, sizeof p, "%s/%s", dir, file);
        double v = read_limit(p);
        if (v >= 0 && (l->cgroup < 0 || v < l->cgroup)) {
            l->cgroup = v;
            snprintf(l->cgroup_file, sizeof l->cgroup_file, "%s", p);
        }
        char *slash = strrchr(dir, '/');
        if (!slash || (size_t)(slash - dir) < ml || strlen(dir) <= ml) break;
        *slash = 0;
    }
}

static void read_cgroups(const bt_mem_sources *src, bt_mem_limits *l) {
    char v2[512], v1[512];
    own_cgroups(src->cgroup, v2, v1, sizeof v2);
    if (!v2[0] && !v1[0]) return;
    FILE *f = fopen(src->mountinfo, "re");
    if (!f) return;
    char line[4096];
    while (get_line(f, line, sizeof line)) {
        /* id parent maj:min root mountpoint opts [optional...] - fstype source superopts */
        char *sep = strstr(line, " - ");
        if (!sep) continue;
        *sep = 0;
        char root[1024], mnt[1024], fstype[64], source[256], super[1024] = "";
        if (sscanf(line, "%*s %*s %*s %1023s %1023s", root, mnt) != 2) continue;
        if (sscanf(sep + 3, "%63s %255s %1023s", fstype, source, super) < 2) continue;
        unescape(root);
        unescape(mnt);
        if (!strcmp(fstype, "cgroup2") && v2[0]) walk_up(mnt, root, v2, "memory.max", l);
        else if (!strcmp(fstype, "cgroup") && v1[0] && has_word(super, "memory"))
            walk_up(mnt, root, v1, "memory.limit_in_bytes", l);
    }
    fclose(f);
}

void bt_mem_limits_read(bt_mem_limits *l, const bt_mem_sources *src) {
    static const bt_mem_sources real = {"/proc/meminfo", "/proc/self/cgroup", "/proc/self/mountinfo", 1};
    if (!src) src = &real;
    memset(l, 0, sizeof *l);
    l->mem_available = src->meminfo ? read_meminfo(src->meminfo) : -1;
    l->cgroup = -1;
    if (src->cgroup && src->mountinfo) read_cgroups(src, l);
    l->rlimit_as = -1;
    struct rlimit rl;
    if (src->rlimit && getrlimit(RLIMIT_AS, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
        l->rlimit_as = (double)rl.rlim_cur;
}

double bt_mem_limit_min(const bt_mem_limits *l, const char **which) {
    double v = -1;
    *which = "none";
    if (l->mem_available >= 0) v = l->mem_available, *which = "MemAvailable";
    if (l->cgroup >= 0 && (v < 0 || l->cgroup < v)) v = l->cgroup, *which = "the cgroup's memory limit";
    if (l->rlimit_as >= 0 && (v < 0 || l->rlimit_as < v)) v = l->rlimit_as, *which = "RLIMIT_AS";
    return v;
}

void bt_mem_limits_describe(const bt_mem_limits *l, char *buf, size_t n) {
    char a[48], c[1200], r[48];
    if (l->mem_available >= 0) snprintf(a, sizeof a, "%.1f GiB", l->mem_available / GIB);
    else snprintf(a, sizeof a, "unknown");
    if (l->cgroup >= 0) snprintf(c, sizeof c, "%.1f GiB (%s)", l->cgroup / GIB, l->cgroup_file);
    else snprintf(c, sizeof c, "none");
    if (l->rlimit_as >= 0) snprintf(r, sizeof r, "%.1f GiB", l->rlimit_as / GIB);
    else snprintf(r, sizeof r, "unlimited");
    snprintf(buf, n, "MemAvailable %s, cgroup memory limit %s, RLIMIT_AS %s", a, c, r);
}
