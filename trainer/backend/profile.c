/* Per-op step profile. See profile.h. */
#include "trainer/backend/profile.h"

#include <errno.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"

typedef struct {
    char name[64];
    long calls;
    double seconds, bytes;
} prof_op;

struct bt_prof {
    prof_op *ops;
    int n, cap;
};

bt_prof *bt_prof_new(void) { return calloc(1, sizeof(bt_prof)); }

void bt_prof_free(bt_prof *p) {
    if (!p) return;
    free(p->ops);
    free(p);
}

void bt_prof_add(bt_prof *p, const char *name, double seconds, double bytes) {
    if (!p) return;
    int i = 0;
    while (i < p->n && strncmp(p->ops[i].name, name, sizeof p->ops[i].name - 1)) i++;
    if (i == p->n) {
        if (p->n == p->cap) {
            int nc = p->cap ? 2 * p->cap : 64;
            prof_op *o = realloc(p->ops, (size_t)nc * sizeof *o);
            if (!o) return; /* out of memory: the op goes unrecorded */
            p->ops = o, p->cap = nc;
        }
        memset(&p->ops[i], 0, sizeof p->ops[i]);
        snprintf(p->ops[i].name, sizeof p->ops[i].name, "%s", name);
        p->n++;
    }
    p->ops[i].calls++;
    p->ops[i].seconds += seconds;
    p->ops[i].bytes += bytes;
}

double bt_prof_total(const bt_prof *p) {
    double t = 0;
    for (int i = 0; p && i < p->n; i++) t += p->ops[i].seconds;
    return t;
}

static int by_time(const void *a, const void *b) {
    double x = ((const prof_op *)a)->seconds, y = ((const prof_op *)b)->seconds;
    return x < y ? 1 : x > y ? -1 : strcmp(((const prof_op *)a)->name, ((const prof_op *)b)->name);
}

int bt_prof_print(const bt_prof *p, FILE *f, const char *title, double step_s,
                  double workspace_mib, double peak_rss_mib, double device_mib) {
    prof_op *s = malloc((size_t)(p->n ? p->n : 1) * sizeof *s);
    if (!s) return -1;
    memcpy(s, p->ops, (size_t)p->n * sizeof *s);
    qsort(s, (size_t)p->n, sizeof *s, by_time);
    double tot = bt_prof_total(p);
    int e = fprintf(f, "profile: %s\n%-34s %7s %11s %7s %12s %12s\n", title, "op", "calls",
                    "total ms", "%", "us/call", "MiB written");
    for (int i = 0; i < p->n && e >= 0; i++)
        e = s[i].bytes > 0
                ? fprintf(f, "%-34s %7ld %11.3f %6.1f%% %12.1f %12.2f\n", s[i].name, s[i].calls,
                          1e3 * s[i].seconds, tot > 0 ? 100.0 * s[i].seconds / tot : 0.0,
                          1e6 * s[i].seconds / (double)s[i].calls, s[i].bytes / 1048576.0)
                : fprintf(f, "%-34s %7ld %11.3f %6.1f%% %12.1f %12s\n", s[i].name, s[i].calls,
                          1e3 * s[i].seconds, tot > 0 ? 100.0 * s[i].seconds / tot : 0.0,
                          1e6 * s[i].seconds / (double)s[i].calls, "-");
    if (e >= 0)
        e = fprintf(f, "ops: %.3f ms of a %.3f ms step (%.1f%%); workspace %.1f MiB, peak RSS %.1f MiB",
                    1e3 * tot, 1e3 * step_s, step_s > 0 ? 100.0 * tot / step_s : 0.0, workspace_mib,
                    peak_rss_mib);
    if (e >= 0 && device_mib >= 0) e = fprintf(f, ", device %.1f MiB", device_mib);
    if (e >= 0) e = fprintf(f, "\n");
    free(s);
    return e < 0 ? e : 0;
}

int bt_prof_write_json(const bt_prof *p, const char *path, const char *title, double step_s) {
    json_t *ops = json_array();
    for (int i = 0; i < p->n; i++)
        json_array_append_new(ops, json_pack("{s:s, s:I, s:f, s:f}", "op", p->ops[i].name, "calls",
                                             (json_int_t)p->ops[i].calls, "seconds",
                                             p->ops[i].seconds, "bytes", p->ops[i].bytes));
    json_t *j = json_pack("{s:s, s:f, s:o}", "title", title, "step_s", step_s, "ops", ops);
    int rc = j && json_dump_file(j, path, JSON_INDENT(2)) == 0
                 ? 0 : bt_fail(BT_ERR_IO, "profile: write %s: %s", path, strerror(errno));
    json_decref(j);
    return rc;
}
