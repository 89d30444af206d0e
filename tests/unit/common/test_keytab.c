/* common/keytab.h, the one way a configuration object is read: one row per key drives parsing,
 * defaults (parsed by the row itself), the unknown-key refusal, required keys, nested objects
 * through a prefix, dump / diff and the docs; a failure names the key in its message and returns
 * the key's path as data. Also loaderd's two tables (config file, job spec): their defaults parse
 * and are the documented ones. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/bt_common.h"
#include "common/keytab.h"
#include "loaderd/config.h"
#include "loaderd/job.h"

typedef struct {
    uint32_t threads;
    int64_t offset;
    double lr;
    int plot;
    char *name;
    int mode;
    int seen_custom;
} cfg;

static const char *const MODES[] = {"off", "on", "auto", NULL};
static const int MODE_VALUES[] = {0, 1, -1};

static int parse_even(const bt_key *k, json_t *v, void *dst, const char *path, bt_keypath *bad) {
    if (!json_is_array(v)) return bt_fail(BT_ERR_INVALID, "\"%s\": expected a list", path);
    for (size_t i = 0; i < json_array_size(v); i++)
        if (json_integer_value(json_array_get(v, i)) % 2) {
            snprintf(bad->s, sizeof bad->s, "%s[%zu]", path, i);
            return bt_fail(BT_ERR_INVALID, "\"%s\": odd", bad->s);
        }
    ((cfg *)dst)->seen_custom = (int)json_array_size(v);
    return BT_OK;
}

static const bt_key keys[] = {
    BT_KEY_I("threads", cfg, threads, 1, 256, "2", 0, "workers"),
    BT_KEY_I("offset", cfg, offset, -5, INT64_MAX, "-3", 0, "an offset"),
    BT_KEY_N("lr", cfg, lr, 0, 1, "0.5", BT_KEY_LO_OPEN, "learning rate"),
    BT_KEY_B("plot", cfg, plot, "true", 0, "draw"),
    BT_KEY_S("name", cfg, name, 1, 8, "\"run\"", BT_KEY_SAFE_TEXT | BT_KEY_REQUIRED, "the run's name"),
    BT_KEY_E("mode", cfg, mode, MODES, MODE_VALUES, "\"auto\"", 0, "the mode"),
    BT_KEY_C("evens", cfg, seen_custom, parse_even, NULL, NULL, NULL, 0, "even numbers"),
    BT_KEY_END,
};

static int parse_text(cfg *c, const char *text, const char *prefix, bt_keypath *bad) {
    json_t *o = json_loads(text, 0, NULL);
    assert_non_null(o);
    int rc = bt_keytab_parse(keys, o, c, "t.json", prefix, 1, bad);
    json_decref(o);
    return rc;
}

static void test_defaults_and_parse(void **st) {
    (void)st;
    cfg c = {0};
    assert_int_equal(bt_keytab_defaults(keys, &c), BT_OK);
    assert_int_equal(c.threads, 2);
    assert_true(c.offset == -3 && c.lr == 0.5 && c.plot == 1 && c.mode == -1);
    assert_string_equal(c.name, "run");
    bt_keypath bad;
    assert_int_equal(parse_text(&c, "{\"threads\": 8, \"name\": \"x\", \"mode\": \"on\", \"# note\": 1, \"evens\": [2, 4]}",
                                "", &bad), BT_OK);
    assert_int_equal(c.threads, 8);
    assert_string_equal(c.name, "x");
    assert_int_equal(c.mode, 1);
    assert_int_equal(c.seen_custom, 2);
    assert_string_equal(bad.s, "");
    bt_keytab_free(keys, &c);
    assert_null(c.name);
}

static void test_errors_name_the_key(void **st) {
    (void)st;
    static const struct {
        const char *json, *prefix, *path, *msg;
    } bad[] = {
        {"{\"name\": \"a\", \"threads\": 0}", "", "threads", "t.json: \"threads\": 0 is out of range [1, 256]"},
        {"{\"name\": \"a\", \"threads\": \"8\"}", "", "threads", "\"threads\": expected an integer in [1, 256]"},
        {"{\"name\": \"a\", \"lr\": 0}", "", "lr", "\"lr\": expected a number in (0, 1]"},
        {"{\"name\": \"a\", \"plot\": 1}", "", "plot", "\"plot\": expected true or false"},
        {"{\"name\": \"a\", \"mode\": \"x\"}", "", "mode", "\"mode\": expected \"off\", \"on\" or \"auto\""},
        {"{\"name\": \"too long a name\"}", "", "name", "\"name\": expected a string of 1..8 bytes"},
        {"{\"name\": \"a\\u001b\"}", "", "name", "\"name\": holds a control character (U+001B at byte 1)"},
        {"{\"name\": \"a\", \"thread\": 1}", "", "thread", "unknown key \"thread\" (known: threads, offset, lr, plot, name, "
                                                          "mode, evens)"},
        {"{\"threads\": 4}", "", "name", "\"name\": required: the run's name"},
        {"{\"name\": \"a\", \"evens\": [2, 3]}", "", "evens[1]", "\"evens[1]\": odd"},
        {"{\"name\": \"a\", \"threads\": 0}", "sec[2]", "sec[2].threads", "\"sec[2].threads\": 0 is out of range"},
        {"{\"name\": \"a\", \"x\": 0}", "sec", "sec.x", "unknown key \"sec.x\""},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cfg c = {0};
        bt_keypath key;
        assert_int_equal(parse_text(&c, bad[i].json, bad[i].prefix, &key), BT_ERR_INVALID);
        if (strcmp(key.s, bad[i].path)) fail_msg("%zu: key \"%s\", want \"%s\"", i, key.s, bad[i].path);
        if (!strstr(bt_last_error(), bad[i].msg)) fail_msg("%zu: \"%s\" lacks \"%s\"", i, bt_last_error(), bad[i].msg);
        assert_non_null(strstr(bt_last_error(), "t.json: "));
        bt_keytab_free(keys, &c);
    }
}

static int diffs;
static char last_diff[128];
static void on_diff(const bt_key *k, const char *a, const char *b, void *ctx) {
    diffs++;
    snprintf(last_diff, sizeof last_diff, "%s: %s -> %s", k->name, a, b);
}

static void test_dump_diff_doc(void **st) {
    (void)st;
    cfg a = {0}, b = {0};
    bt_keytab_defaults(keys, &a);
    bt_keytab_defaults(keys, &b);
    json_t *d = bt_keytab_dump(keys, &a);
    assert_int_equal(json_integer_value(json_object_get(d, "threads")), 2);
    assert_string_equal(json_string_value(json_object_get(d, "mode")), "auto");
    assert_null(json_object_get(d, "evens")); /* a custom row without dump */
    json_decref(d);
    assert_int_equal(bt_keytab_diff(keys, &a, &b, on_diff, NULL), 0);
    b.threads = 9;
    assert_int_equal(bt_keytab_diff(keys, &a, &b, on_diff, NULL), 1);
    assert_string_equal(last_diff, "threads: 2 -> 9");
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    bt_keytab_doc_md(keys, "", f);
    fclose(f);
    assert_non_null(strstr(text, "| `threads` | an integer in [1, 256] | `2` | workers |"));
    assert_non_null(strstr(text, "| `name` | a string of 1..8 bytes | `\"run\"` | the run's name |"));
    free(text);
    bt_keytab_free(keys, &a);
    bt_keytab_free(keys, &b);
}

/* loaderd's tables: every default parses through its row, and they are the documented ones. */
static void test_loaderd_tables(void **st) {
    (void)st;
    ld_config c;
    ld_config_defaults(&c);
    assert_string_equal(c.socket_path, "/run/loaderd/loaderd.sock");
    assert_int_equal(c.socket_mode, 0660);
    assert_true(c.tokenizer_threads == 2 && c.ring_slots == 8 && c.max_clients == 64 && c.max_jobs == 32);
    assert_true(c.max_request_bytes == 1u << 20 && c.max_ring_bytes == 1ull << 30 && c.max_json_depth == 32);
    assert_true(c.client_timeout_s == 60 && c.max_clients_per_uid == 32 && c.token_cache_wait_s == 1800);
    assert_true(c.token_cache_max_bytes == 64ull << 30 && c.memory_budget_bytes == ld_default_memory_budget());
    assert_true(c.n_data_roots == 0 && !c.token_cache_dir && !c.socket_group);
    ld_config_free(&c);
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    ld_config_print_keys(f);
    ld_job_print_keys(f);
    fclose(f);
    static const char *const some[] = {"`token_cache_wait_s`", "`operator_groups`", "`seq_len`", "`datasets[].weight`"};
    for (size_t i = 0; i < sizeof some / sizeof some[0]; i++) assert_non_null(strstr(text, some[i]));
    free(text);
    ld_job_spec s;
    assert_int_equal(ld_job_spec_parse(&s, "{\"shards\":[\"/x\"],\"format\":\"text\",\"tokenizer\":\"/t\",\"seq_len\":64,"
                                           "\"micro_batch_size\":1}", NULL), BT_OK);
    assert_string_equal(s.name, "job");
    assert_true(s.n_threads == 2 && s.chat_template == LD_TPL_AUTO && s.overlong_drop == 0 && s.seed == 0);
    ld_job_spec_free(&s);
}

int main(void) {
    bt_log_set_level(BT_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_defaults_and_parse),
        cmocka_unit_test(test_errors_name_the_key),
        cmocka_unit_test(test_dump_diff_doc),
        cmocka_unit_test(test_loaderd_tables),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
