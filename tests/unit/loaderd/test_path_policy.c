/* loaderd's path policy and slots configuration (issue 10 §2, §3, §7): ld_path_where (symlinks
 * that exist followed, `..` applied, missing parts literal, loops refused), the one refusal for
 * every tokenizer / shard path leading outside the roots whatever lies there (a secret, a device,
 * nothing, a symlink leading out, a dangling one), operators (root, loaderd's uid,
 * operator_groups), and the new configuration keys with their ranges and defaults. */
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
#include "loaderd/config.h"
#include "loaderd/pipeline.h"
#include "tests/unit/util/test_util.h"

static char g_dir[64];

static int setup(void **st) {
    (void)st;
    bt_log_set_level(BT_LOG_ERROR);
    return tu_make_tmpdir(g_dir, sizeof g_dir, "policy");
}
static int teardown(void **st) {
    (void)st;
    return tu_remove_dir(g_dir);
}

static void p_of(char *p, size_t n, const char *rel) { snprintf(p, n, "%s/%s", g_dir, rel); }

static void expect_where(const char *path, const char *want) {
    char *w = ld_path_where(path);
    if (!want) {
        if (w) fail_msg("%s: expected NULL, got %s", path, w);
        return;
    }
    if (!w || strcmp(w, want)) fail_msg("%s: expected %s, got %s", path, want, w ? w : "NULL");
    free(w);
}

static void test_path_where(void **st) {
    (void)st;
    char root[128], p[256], q[256], want[256];
    char *real = realpath(g_dir, NULL); /* /tmp may itself be a link */
    snprintf(root, sizeof root, "%s", real);
    free(real);
    p_of(p, sizeof p, "d");
    assert_int_equal(mkdir(p, 0755), 0);
    p_of(p, sizeof p, "d/f");
    tu_write_file(NULL, p, "x", 1);
    p_of(p, sizeof p, "up");
    assert_int_equal(symlink("/etc", p), 0);
    p_of(p, sizeof p, "rel");
    assert_int_equal(symlink("d/f", p), 0);
    p_of(p, sizeof p, "dangling");
    assert_int_equal(symlink("/no-such-dir-xyz/secret", p), 0);
    p_of(p, sizeof p, "loop1");
    p_of(q, sizeof q, "loop2");
    assert_int_equal(symlink(q, p), 0);
    assert_int_equal(symlink(p, q), 0);

    expect_where("/", "/");
    expect_where("relative/path", NULL);
    p_of(p, sizeof p, "d/f");
    snprintf(want, sizeof want, "%s/d/f", root);
    expect_where(p, want);
    p_of(p, sizeof p, "rel"); /* relative link: from the link's directory */
    expect_where(p, want);
    p_of(p, sizeof p, "d/../d/./f");
    expect_where(p, want);
    p_of(p, sizeof p, "d/missing/../f"); /* after a missing part, `..` is literal */
    expect_where(p, want);
    p_of(p, sizeof p, "d/nope.gguf");
    snprintf(want, sizeof want, "%s/d/nope.gguf", root);
    expect_where(p, want);
    p_of(p, sizeof p, "up/shadow");
    expect_where(p, "/etc/shadow");
    p_of(p, sizeof p, "up/../etc/hostname"); /* `..` of the link's target, as the kernel does */
    expect_where(p, "/etc/hostname");
    p_of(p, sizeof p, "dangling"); /* a link to nothing still says where it leads */
    expect_where(p, "/no-such-dir-xyz/secret");
    p_of(p, sizeof p, "dangling/../x");
    expect_where(p, "/no-such-dir-xyz/x");
    p_of(p, sizeof p, "loop1/x");
    expect_where(p, NULL);
    expect_where("/../../etc", "/etc");
}

/* A config with data_roots = [g_dir/data], model_roots = [g_dir/models]. */
static void make_config(ld_config *c) {
    char data[128], models[128], js[512];
    p_of(data, sizeof data, "data");
    p_of(models, sizeof models, "models");
    mkdir(data, 0755);
    mkdir(models, 0755);
    snprintf(js, sizeof js, "{\"data_roots\": [\"%s\"], \"model_roots\": [\"%s\"]}", data, models);
    assert_int_equal(ld_config_parse(c, js, "t"), BT_OK);
}

/* The reply text with the path the client gave replaced by P. */
static char *normalised(const char *msg, const char *path) {
    char *out = bt_xstrdup(msg), *at = strstr(out, path);
    assert_non_null(at);
    memmove(at + 1, at + strlen(path), strlen(at + strlen(path)) + 1);
    at[0] = 'P';
    return out;
}

static void test_uniform_refusals(void **st) {
    (void)st;
    ld_config c;
    make_config(&c);
    char p[256], ok[256];
    p_of(ok, sizeof ok, "models/tok.gguf");
    tu_write_file(NULL, ok, "GGUF", 4);
    p_of(p, sizeof p, "data/train.jsonl");
    tu_write_file(NULL, p, "{}\n", 3);
    p_of(p, sizeof p, "data/to-shadow.jsonl");
    assert_int_equal(symlink("/etc/shadow", p), 0);
    p_of(p, sizeof p, "data/to-nothing.jsonl");
    assert_int_equal(symlink("/no-such-dir-xyz/x.jsonl", p), 0);
    p_of(p, sizeof p, "data/to-zero.jsonl");
    assert_int_equal(symlink("/dev/zero", p), 0);
    p_of(p, sizeof p, "data/etc");
    assert_int_equal(symlink("/etc", p), 0);

    /* tokenizer: a secret, nothing, a device, a link out, a dangling link, `..` out: one text */
    char link_tok[256], dangling_tok[256], dotdot[256];
    p_of(link_tok, sizeof link_tok, "data/to-shadow.jsonl");
    p_of(dangling_tok, sizeof dangling_tok, "data/to-nothing.jsonl");
    p_of(dotdot, sizeof dotdot, "models/../../../etc/passwd");
    const char *toks[] = {"/etc/shadow", "/no-such-file-xyz.gguf", "/dev/zero", link_tok, dangling_tok, dotdot,
                          "/proc/self/environ"};
    char *first = NULL;
    for (size_t i = 0; i < sizeof toks / sizeof toks[0]; i++) {
        char *out = NULL;
        assert_int_equal(ld_resolve_tokenizer(&c, toks[i], &out), BT_ERR_NOTFOUND);
        assert_null(out);
        char *n = normalised(bt_last_error(), toks[i]);
        if (!first) first = n;
        else {
            if (strcmp(first, n)) fail_msg("%s: \"%s\" differs from \"%s\"", toks[i], n, first);
            free(n);
        }
    }
    assert_string_equal(first, "job: tokenizer \"P\": no file by that name inside model_roots or data_roots (see "
                               "loaderd's log)");
    free(first);
    /* inside the roots: a missing file reads the same; the real one resolves */
    p_of(p, sizeof p, "models/missing.gguf");
    char *out = NULL;
    assert_int_equal(ld_resolve_tokenizer(&c, p, &out), BT_ERR_NOTFOUND);
    assert_non_null(strstr(bt_last_error(), "no file by that name inside"));
    assert_int_equal(ld_resolve_tokenizer(&c, ok, &out), BT_OK);
    free(out);

    /* shards: the same for patterns and for matches leading out, and for no match at all */
    char pats[8][256];
    p_of(pats[0], 256, "data/to-shadow.jsonl");
    p_of(pats[1], 256, "data/to-nothing.jsonl");
    p_of(pats[2], 256, "data/to-zero.jsonl");
    p_of(pats[3], 256, "data/to-*.jsonl"); /* every match leads out */
    p_of(pats[4], 256, "data/etc/shadow");
    p_of(pats[5], 256, "data/etc/no-such-file");
    p_of(pats[6], 256, "data/nothing-*.jsonl"); /* inside, matches nothing */
    snprintf(pats[7], 256, "/etc/*");
    first = NULL;
    for (int i = 0; i < 8; i++) {
        char *pv[1] = {pats[i]}, **files = NULL;
        int n = 0;
        assert_int_equal(ld_resolve_shards(&c, pv, 1, &files, &n), BT_ERR_NOTFOUND);
        assert_null(files);
        char *nm = normalised(bt_last_error(), pats[i]);
        if (!first) first = nm;
        else {
            if (strcmp(first, nm)) fail_msg("%s: \"%s\" differs from \"%s\"", pats[i], nm, first);
            free(nm);
        }
    }
    assert_string_equal(first, "job: shard pattern \"P\": no file by that name inside data_roots (see loaderd's log)");
    free(first);
    p_of(p, sizeof p, "data/train.jsonl");
    char *pv[1] = {p}, **files = NULL;
    int n = 0;
    assert_int_equal(ld_resolve_shards(&c, pv, 1, &files, &n), BT_OK);
    assert_int_equal(n, 1);
    ld_free_strv(files, n);
    ld_config_free(&c);
}

static void test_operators_and_keys(void **st) {
    (void)st;
    ld_config c;
    assert_int_equal(ld_config_parse(&c, "{}", "t"), BT_OK);
    assert_int_equal(c.max_clients_per_uid, 32);
    assert_true(c.memory_budget_bytes >= (256u << 20));
    assert_int_equal(c.memory_budget_bytes, ld_default_memory_budget());
    assert_true(ld_peer_is_operator(&c, 0, 5, NULL, 0, 999));
    assert_true(ld_peer_is_operator(&c, 999, 5, NULL, 0, 999));
    assert_false(ld_peer_is_operator(&c, 1000, 5, NULL, 0, 999));
    ld_config_free(&c);
    assert_int_equal(ld_config_parse(&c, "{\"operator_groups\": [\"root\", 4242], \"max_clients_per_uid\": 3,"
                                         " \"memory_budget_bytes\": 33554432}", "t"), BT_OK);
    gid_t groups[] = {7, 4242};
    assert_true(ld_peer_is_operator(&c, 1000, 0, NULL, 0, 999));  /* primary group root */
    assert_true(ld_peer_is_operator(&c, 1000, 5, groups, 2, 999)); /* supplementary 4242 */
    assert_false(ld_peer_is_operator(&c, 1000, 5, groups, 1, 999));
    assert_int_equal(c.max_clients_per_uid, 3);
    assert_int_equal(c.memory_budget_bytes, 33554432);
    ld_config_free(&c);
    static const char *bad[][2] = {{"{\"max_clients_per_uid\": 0}", "max_clients_per_uid"},
                                   {"{\"memory_budget_bytes\": 1024}", "memory_budget_bytes"},
                                   {"{\"operator_groups\": [\"no-such-group-xyz-1\"]}", "operator_groups"},
                                   {"{\"operator_groups\": \"root\"}", "operator_groups"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(ld_config_parse(&c, bad[i][0], "t"), BT_ERR_INVALID);
        if (!strstr(bt_last_error(), bad[i][1])) fail_msg("%s: %s", bad[i][0], bt_last_error());
    }
    /* the pipeline's share of the budget grows with threads and T, and is more than a batch */
    ld_job_spec s = {.T = 2048, .B = 4, .n_threads = 2, .n_shards = 1};
    uint64_t a = ld_pipeline_mem_estimate(&s);
    s.n_threads = 8;
    uint64_t b = ld_pipeline_mem_estimate(&s);
    assert_true(a > bt_batch_slot_bytes(4, 2048) && b > a);
    s.B = 0;
    assert_int_equal(ld_pipeline_mem_estimate(&s), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_path_where),
        cmocka_unit_test(test_uniform_refusals),
        cmocka_unit_test(test_operators_and_keys),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
