/* What memory the trainer may use (trainer/mem_limits.h) and `trainer train`'s check of its plan
 * against it (trainer/estimate.h bt_estimate_check_fits; issue 21 §7): MemAvailable from a
 * meminfo file, the smallest cgroup v2 memory.max / v1 memory.limit_in_bytes on the way up from
 * this process's cgroup (found through a cgroup file and a mountinfo, including a mount whose root
 * is not the hierarchy's and an escaped mount point), "max" and near-2^63 values as no limit, and
 * the refusal with the figures and what to change. The sources are files written here; RLIMIT_AS
 * is set for real by tests/py/test_trainer_refusals.py. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "trainer/config.h"
#include "trainer/estimate.h"
#include "trainer/mem_limits.h"
#include "tests/unit/util/test_util.h"
#include "tests/unit/util/tiny_gguf.h"

static char g_dir[64];

static int setup(void **st) {
    (void)st;
    return tu_make_tmpdir(g_dir, sizeof g_dir, "mem");
}

static int teardown(void **st) {
    (void)st;
    return tu_remove_dir(g_dir);
}

/* g_dir/<rel> with `text` (parent directories created). */
static void put(const char *rel, const char *text) {
    char p[512];
    snprintf(p, sizeof p, "%s/%s", g_dir, rel);
    for (char *s = p + strlen(g_dir) + 1; *s; s++)
        if (*s == '/') {
            *s = 0;
            mkdir(p, 0755);
            *s = '/';
        }
    tu_write_file(NULL, p, text, strlen(text));
}

static bt_mem_sources sources(char *mi, char *cg, char *mt, size_t n) {
    snprintf(mi, n, "%s/meminfo", g_dir);
    snprintf(cg, n, "%s/cgroup", g_dir);
    snprintf(mt, n, "%s/mountinfo", g_dir);
    return (bt_mem_sources){mi, cg, mt, 0};
}

static void test_cgroup_v2(void **st) {
    (void)st;
    char mi[128], cg[128], mt[128], line[512];
    bt_mem_sources src = sources(mi, cg, mt, sizeof mi);
    put("meminfo", "MemTotal:       16384000 kB\nMemFree:         1000 kB\nMemAvailable:    1048576 kB\n");
    put("cgroup", "0::/job/step\n");
    snprintf(line, sizeof line, "22 1 0:5 / /proc rw - proc proc rw\n"
             "30 25 0:26 / %s/cg rw,nosuid,nodev - cgroup2 cgroup2 rw,nsdelegate\n", g_dir);
    put("mountinfo", line);
    put("cg/memory.max", "max\n"); /* the root: no limit */
    put("cg/job/memory.max", "2147483648\n");
    put("cg/job/step/memory.max", "max\n");
    bt_mem_limits l;
    bt_mem_limits_read(&l, &src);
    assert_true(l.mem_available == 1073741824.0);
    assert_true(l.cgroup == 2147483648.0); /* the job's limit binds its step */
    assert_non_null(strstr(l.cgroup_file, "/cg/job/memory.max"));
    assert_true(l.rlimit_as < 0);
    const char *which;
    assert_true(bt_mem_limit_min(&l, &which) == 1073741824.0);
    assert_string_equal(which, "MemAvailable");
    put("cg/job/step/memory.max", "536870912\n");
    bt_mem_limits_read(&l, &src);
    assert_true(l.cgroup == 536870912.0);
    assert_true(bt_mem_limit_min(&l, &which) == 536870912.0);
    assert_string_equal(which, "the cgroup's memory limit");
    char d[1400];
    bt_mem_limits_describe(&l, d, sizeof d);
    assert_non_null(strstr(d, "MemAvailable 1.0 GiB, cgroup memory limit 0.5 GiB ("));
    assert_non_null(strstr(d, "RLIMIT_AS unlimited"));
}

static void test_cgroup_v1(void **st) {
    (void)st;
    char mi[128], cg[128], mt[128], line[768];
    bt_mem_sources src = sources(mi, cg, mt, sizeof mi);
    put("meminfo", "MemTotal: 100 kB\n"); /* no MemAvailable (kernels before 3.14): none */
    put("cgroup", "9:name=systemd:/\n4:memory:/process_api/abc\n3:cpuset:/\n0::/\n");
    /* an escaped mount point (a space), and a controller list that is not only "memory" */
    snprintf(line, sizeof line, "40 25 0:30 / %s/mem\\040v1 rw - cgroup cgroup rw,memory\n"
             "41 25 0:31 / %s/cpus rw - cgroup cgroup rw,cpuset\n", g_dir, g_dir);
    put("mountinfo", line);
    put("mem v1/process_api/abc/memory.limit_in_bytes", "9223372036854771712\n"); /* unlimited */
    put("mem v1/process_api/memory.limit_in_bytes", "805306368\n");
    put("cpus/process_api/abc/memory.limit_in_bytes", "1024\n"); /* not the memory hierarchy */
    bt_mem_limits l;
    bt_mem_limits_read(&l, &src);
    assert_true(l.mem_available < 0);
    assert_true(l.cgroup == 805306368.0);
    /* a container: the mount's root is the cgroup itself (cgroup namespace) */
    snprintf(line, sizeof line, "40 25 0:30 /process_api/abc %s/ns rw - cgroup cgroup rw,memory\n", g_dir);
    put("mountinfo", line);
    put("ns/memory.limit_in_bytes", "268435456\n");
    bt_mem_limits_read(&l, &src);
    assert_true(l.cgroup == 268435456.0);
    /* nothing readable: no limit from anywhere */
    bt_mem_sources none = {"/nonexistent/meminfo", "/nonexistent/cgroup", "/nonexistent/mountinfo", 0};
    bt_mem_limits_read(&l, &none);
    const char *which;
    assert_true(l.mem_available < 0 && l.cgroup < 0 && l.rlimit_as < 0);
    assert_true(bt_mem_limit_min(&l, &which) < 0);
    assert_string_equal(which, "none");
}

/* The plan against the limits: fits, refused with the figures and the setting to change (the
 * largest item of the bill first), or not checked when no limit is known / the model cannot be
 * read (the loader says why). */
static void test_check_fits(void **st) {
    (void)st;
    char model[128], txt[512];
    snprintf(model, sizeof model, "%s/tiny.gguf", g_dir);
    tu_tiny_spec ts = tu_tiny_default();
    assert_int_equal(tu_tiny_gguf_write(model, &ts, NULL), 0);
    snprintf(txt, sizeof txt, "{\"model\": \"%s\", \"data\": {\"shards\": [\"d\"], \"seq_len\": 64, "
             "\"micro_batch_size\": 2}, \"lora\": {\"r\": 4096}}", model);
    bt_train_config c;
    assert_int_equal(bt_config_parse(&c, txt, "t", NULL, 0), 0);
    bt_est_model em;
    assert_int_equal(bt_est_model_read(&em, model), 0);
    bt_mem_bill b;
    bt_estimate_bill(&em, &c, BT_EST_CPU, 1, &b);
    bt_mem_limits l = {b.peak * 2, -1, "", -1};
    assert_int_equal(bt_estimate_check_fits(&c, 1, &l), 0);
    l.rlimit_as = b.peak * 0.5;
    assert_int_equal(bt_estimate_check_fits(&c, 1, &l), BT_ERR_NOMEM);
    const char *e = bt_last_error();
    char need[64];
    snprintf(need, sizeof need, "memory: this run needs about %.1f GiB", b.peak / 1073741824.0);
    assert_non_null(strstr(e, need));
    assert_non_null(strstr(e, "LoRA r 4096 parameters, gradients and AdamW moments"));
    assert_non_null(strstr(e, "(RLIMIT_AS;"));
    assert_non_null(strstr(e, "lower lora.r (now 4096)"));
    assert_non_null(strstr(e, "`trainer train --force` tries anyway"));
    bt_mem_limits none = {-1, -1, "", -1};
    assert_int_equal(bt_estimate_check_fits(&c, 1, &none), 0);
    free(c.model);
    c.model = bt_xstrdup("/nonexistent/model.gguf");
    assert_int_equal(bt_estimate_check_fits(&c, 1, &l), 0);
    bt_config_free(&c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_cgroup_v2, setup, teardown),
        cmocka_unit_test_setup_teardown(test_cgroup_v1, setup, teardown),
        cmocka_unit_test_setup_teardown(test_check_fits, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
