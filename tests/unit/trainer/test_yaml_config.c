/* YAML job configs (common/yaml_json.h, trainer/config.h bt_config_parse_yaml): YAML 1.2 core
 * scalar resolution, the same tree and validation as JSON, messages with file and line,
 * duplicate keys, refused constructs (merge keys, tags, several documents), caps on alias
 * expansion and depth, --set, and the template dump reading back as the same config. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "common/yaml_json.h"
#include "trainer/config.h"

static json_t *load(const char *y) {
    json_t *j = NULL;
    int rc = bt_yaml_load(y, strlen(y), "t.yaml", &j, NULL);
    if (rc) print_message("yaml: %s\n", bt_last_error());
    return j;
}

/* the value of key "v" in "v: <text>" */
static json_t *scalar(const char *text) {
    char y[256];
    snprintf(y, sizeof y, "v: %s\n", text);
    json_t *j = load(y);
    assert_non_null(j);
    json_t *v = json_incref(json_object_get(j, "v"));
    json_decref(j);
    return v;
}

static void test_core_schema_scalars(void **st) {
    (void)st;
    static const struct {
        const char *yaml, *json;
    } cases[] = {
        {"~", "null"},          {"null", "null"},         {"", "null"},
        {"NULL", "null"},       {"true", "true"},         {"False", "false"},
        {"yes", "\"yes\""},     {"off", "\"off\""},       {"12", "12"},
        {"-7", "-7"},           {"+3", "3"},              {"0x1f", "31"},
        {"0o17", "15"},         {"1e-3", "0.001"},        {"2.5", "2.5"},
        {".5", "0.5"},          {"-2.", "-2.0"},          {"3E+2", "300.0"},
        {"1_000", "\"1_000\""}, {"'12'", "\"12\""},       {"\"true\"", "\"true\""},
        {"!!str 12", "\"12\""}, {"!!int \"12\"", "12"},   {"!!float 1", "1.0"},
        {"!!float 0o17", "15.0"}, {"!!float 0x1f", "31.0"},
        {"q_proj", "\"q_proj\""}, {"[a, 1, 2.0]", "[\"a\", 1, 2.0]"}, {"{}", "{}"},
        {"|\n  two\n  lines", "\"two\\nlines\\n\""}, {"0.1 # comment", "0.1"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        json_t *got = scalar(cases[i].yaml);
        json_t *want = json_loads(cases[i].json, JSON_DECODE_ANY, NULL);
        assert_non_null(want);
        if (!json_equal(got, want)) {
            char *g = json_dumps(got, JSON_ENCODE_ANY);
            print_message("%s -> %s, expected %s\n", cases[i].yaml, g, cases[i].json);
            free(g);
        }
        assert_true(json_equal(got, want));
        /* and the type, not only the value (1 vs 1.0) */
        assert_int_equal(json_typeof(got), json_typeof(want));
        json_decref(got);
        json_decref(want);
    }
}

/* bt_yaml_load fails with a message containing `want` (and "t.yaml:LINE:" when line > 0). */
static void refused(const char *y, int line, const char *want) {
    json_t *j = NULL, *lines = NULL;
    int rc = bt_yaml_load(y, strlen(y), "t.yaml", &j, &lines);
    const char *msg = bt_last_error();
    if (rc == 0 || !strstr(msg, want)) print_message("%s\n -> rc %d: %s\n", y, rc, msg);
    assert_int_equal(rc, BT_ERR_FORMAT);
    assert_null(j);
    assert_null(lines);
    assert_non_null(strstr(msg, want));
    if (line > 0) {
        char pre[32];
        snprintf(pre, sizeof pre, "t.yaml:%d:", line);
        assert_non_null(strstr(msg, pre));
    }
}

static void test_refusals(void **st) {
    (void)st;
    refused("a: 1\nb:\n  c: 2\n  c: 3\n", 4, "duplicate key \"b.c\" (first at line 3)");
    refused("base: &b {r: 1}\nlora:\n  <<: *b\n", 3, "merge keys");
    refused("a: 1\n---\nb: 2\n", 2, "more than one YAML document");
    refused("- a\n- b\n", 0, "expected a mapping");
    refused("42\n", 0, "expected a mapping");
    refused("", 0, "expected a mapping");
    refused("a: 1\n\tb: 2\n", 2, "");                 /* a tab: libyaml's own syntax error */
    refused("a: [1, 2\n", 0, "");
    refused("a: .inf\n", 1, "infinities");
    refused("a: 99999999999999999999\n", 1, "64 bits");
    refused("a: !!binary aGk=\n", 1, "unsupported tag");
    refused("a: !custom x\n", 1, "unsupported tag");
    refused("a: !!int abc\n", 1, "not a valid !!int");
    refused("a: *nothing\n", 1, "unknown alias");
    refused("? [a, b]\n: 1\n", 1, "as a key");
    /* billion laughs: 10 levels of 10 aliases expand past the node cap */
    char lol[2048] = "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n";
    for (int i = 1; i < 8; i++) {
        char line[160];
        snprintf(line, sizeof line, "a%d: &a%d [*a%d, *a%d, *a%d, *a%d, *a%d, *a%d, *a%d, *a%d, *a%d, *a%d]\n",
                 i, i, i - 1, i - 1, i - 1, i - 1, i - 1, i - 1, i - 1, i - 1, i - 1, i - 1);
        strcat(lol, line);
    }
    refused(lol, 0, "aliases expand to more than");
    /* nesting past the depth cap (flow style: [[[[...]]]]) */
    char deep[400] = "a: ";
    for (int i = 0; i < 100; i++) strcat(deep, "[");
    for (int i = 0; i < 100; i++) strcat(deep, "]");
    refused(deep, 1, "nesting deeper than");
    /* a NUL byte inside a scalar or key */
    json_t *j = NULL;
    assert_int_not_equal(bt_yaml_load("a: x\0y\n", 7, "t.yaml", &j, NULL), 0);
    assert_null(j);
}

static void test_anchors_and_lines(void **st) {
    (void)st;
    const char *y = "\xEF\xBB\xBF# comment\n"
                    "data:\n"
                    "  shards: &s\n"
                    "    - a/*.jsonl\n"
                    "    - b/*.jsonl\n"
                    "eval:\n"
                    "  shards: *s\n";
    json_t *j = NULL, *lines = NULL;
    assert_int_equal(bt_yaml_load(y, strlen(y), "t.yaml", &j, &lines), 0);
    assert_true(json_equal(json_object_get(json_object_get(j, "data"), "shards"),
                           json_object_get(json_object_get(j, "eval"), "shards")));
    assert_int_equal(json_integer_value(json_object_get(lines, "data")), 2);
    assert_int_equal(json_integer_value(json_object_get(lines, "data.shards")), 3);
    assert_int_equal(json_integer_value(json_object_get(lines, "data.shards[1]")), 5);
    assert_int_equal(json_integer_value(json_object_get(lines, "eval.shards")), 7);
    json_decref(j);
    json_decref(lines);
}

static const char *k_job = "model: m.gguf\n"           /* 1 */
                           "data:\n"                   /* 2 */
                           "  shards: [d/*.jsonl.zst]\n" /* 3 */
                           "  seq_len: 256\n"          /* 4 */
                           "optim:\n"                  /* 5 */
                           "  lr: 3.0e-4\n"            /* 6 */
                           "  warmup_steps: 5\n"       /* 7 */
                           "lora: {r: 8, target_modules: [q_proj, v_proj]}\n" /* 8 */
                           "activation_checkpointing: true\n"; /* 9 */

/* bt_config_parse_yaml on k_job with line `line` replaced by `repl`; returns rc, message in msg. */
static int parse_with(int line, const char *repl, const char *const *sets, int n_sets,
                      bt_train_config *c) {
    char y[1024] = "";
    const char *p = k_job;
    for (int l = 1; *p; l++) {
        const char *nl = strchr(p, '\n');
        if (l == line) strcat(y, repl), strcat(y, "\n");
        else strncat(y, p, (size_t)(nl - p + 1));
        p = nl + 1;
    }
    return bt_config_parse_yaml(c, y, strlen(y), "job.yaml", sets, n_sets);
}

static void expect_msg(int rc, const char *want) {
    if (rc == 0 || !strstr(bt_last_error(), want)) print_message("rc %d: %s\n", rc, bt_last_error());
    assert_int_not_equal(rc, 0);
    assert_non_null(strstr(bt_last_error(), want));
}

static void test_config_yaml(void **st) {
    (void)st;
    bt_train_config c, cj;
    assert_int_equal(parse_with(0, "", NULL, 0, &c), 0);
    assert_int_equal(c.data.seq_len, 256);
    assert_true(c.optim.lr == 3.0e-4);
    assert_int_equal(c.lora.r, 8);
    assert_int_equal(c.lora.target_mask, (1u << BT_MOD_Q) | (1u << BT_MOD_V));
    assert_true(c.activation_checkpointing);
    /* the same effective config as the equivalent JSON */
    assert_int_equal(bt_config_parse(&cj,
                                     "{\"model\": \"m.gguf\", \"data\": {\"shards\": [\"d/*.jsonl.zst\"],"
                                     " \"seq_len\": 256}, \"optim\": {\"lr\": 3e-4, \"warmup_steps\": 5},"
                                     " \"lora\": {\"r\": 8, \"target_modules\": [\"q_proj\", \"v_proj\"]},"
                                     " \"activation_checkpointing\": true}", "j", NULL, 0), 0);
    char *a = bt_config_dump(&c), *b = bt_config_dump(&cj);
    assert_string_equal(a, b);
    free(a), free(b);
    bt_config_free(&c), bt_config_free(&cj);

    /* validation messages carry the file and the key's line */
    expect_msg(parse_with(6, "  lr: abc", NULL, 0, &c), "config: job.yaml:6: optim.lr: expected a number in (0, 1], got \"abc\"");
    expect_msg(parse_with(7, "  warmup: 5", NULL, 0, &c), "job.yaml:7: unknown key \"optim.warmup\"");
    expect_msg(parse_with(9, "activation_checkpointing: yes", NULL, 0, &c),
               "job.yaml:9: activation_checkpointing: expected true, false or \"auto\", got "
               "\"yes\"");
    expect_msg(parse_with(8, "lora: {r: 8, target_modules: [q_proj, w_proj]}", NULL, 0, &c),
               "job.yaml:8: lora.target_modules");
    /* a missing required key: the line of its enclosing section */
    expect_msg(parse_with(3, "  format: chat", NULL, 0, &c), "job.yaml:2: data.shards: required key missing");
    expect_msg(parse_with(4, "  seq_len: 256\n  seq_len: 512", NULL, 0, &c),
               "job.yaml:5:3: duplicate key \"data.seq_len\" (first at line 4)");
    /* --set: fixes a bad value, and a bad --set value is reported without a stale line */
    const char *fix[] = {"optim.lr=1e-4"};
    assert_int_equal(parse_with(6, "  lr: abc", fix, 1, &c), 0);
    assert_true(c.optim.lr == 1e-4);
    bt_config_free(&c);
    const char *bad[] = {"optim.lr=-1"};
    expect_msg(parse_with(0, "", bad, 1, &c), "config: optim.lr: expected a number in (0, 1], got -1");
    assert_null(strstr(bt_last_error(), "job.yaml:"));
    const char *sect[] = {"optim={\"lr\": \"x\"}"};
    expect_msg(parse_with(0, "", sect, 1, &c), "config: optim.lr:");
    assert_null(strstr(bt_last_error(), "job.yaml:"));
    assert_int_equal(bt_config_is_yaml("a/job.yaml"), 1);
    assert_int_equal(bt_config_is_yaml("job.yml"), 1);
    assert_int_equal(bt_config_is_yaml("job.json"), 0);
    assert_int_equal(bt_config_is_yaml("yaml"), 0);
}

/* Every template, documented or not, dumped as YAML reads back as the same config. */
static void test_template_round_trip(void **st) {
    (void)st;
    for (int i = 0; bt_config_template_names[i]; i++)
        for (int doc = 0; doc < 2; doc++) {
            char *js = bt_config_template(bt_config_template_names[i], doc);
            assert_non_null(js);
            json_t *j = json_loads(js, 0, NULL);
            char *y = bt_yaml_dump(j);
            assert_non_null(y);
            if (doc) assert_non_null(strstr(y, "\n# ")); /* comments, as YAML comments */
            assert_null(strstr(y, "\"#"));                /* ... not "#" keys */
            bt_train_config a, b;
            assert_int_equal(bt_config_parse(&a, js, "t.json", NULL, 0), 0);
            if (bt_config_parse_yaml(&b, y, strlen(y), "t.yaml", NULL, 0) != 0)
                print_message("%s\n%s\n", bt_last_error(), y);
            char *da = bt_config_dump(&a), *db = bt_config_dump(&b);
            assert_string_equal(da, db);
            free(da), free(db), free(y), free(js);
            bt_config_free(&a), bt_config_free(&b);
            json_decref(j);
        }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_core_schema_scalars), cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_anchors_and_lines),   cmocka_unit_test(test_config_yaml),
        cmocka_unit_test(test_template_round_trip),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
