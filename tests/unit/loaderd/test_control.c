/* loaderd control protocol without sockets: ld_request_parse (loaderd/server_proto.h) against
 * loaderd's command table (ld_server_commands) for every op and the ways a request can be wrong,
 * the table itself (the op list and who may call what come from it), ld_peer_allowed and the
 * allowed_users / allowed_groups / client_timeout_s configuration keys (loaderd/config.h). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "common/bt_common.h"
#include "loaderd/config.h"
#include "loaderd/server.h"
#include "loaderd/server_proto.h"

/* ld_request_parse with depth limit `depth`: 0, or 1 with the message copied into err (512 bytes) */
static int parse_depth(const char *line, ld_request *r, unsigned depth, char *err) {
    int rc = ld_request_parse(r, ld_server_commands(), line, strlen(line), depth);
    snprintf(err, 512, "%s", rc ? bt_last_error() : "");
    assert_true(rc == BT_OK || rc == BT_ERR_INVALID);
    return rc ? 1 : 0;
}

static int parse(const char *line, ld_request *r, char *err) { return parse_depth(line, r, 32, err); }

static void test_ops_accepted(void **state) {
    (void)state;
    ld_request r;
    char err[512];
    const char *simple[] = {"hello", "status", "jobs", "metrics", "drain"};
    for (size_t i = 0; i < sizeof simple / sizeof simple[0]; i++) {
        char line[64];
        snprintf(line, sizeof line, "{\"v\":1,\"op\":\"%s\"}", simple[i]);
        assert_int_equal(parse(line, &r, err), 0);
        assert_string_equal(r.cmd->name, simple[i]);
        ld_request_free(&r);
    }
    char att[1024];
    char hex[513];
    for (int i = 0; i < 256; i++) snprintf(hex + 2 * i, 3, "%02X", i);
    snprintf(att, sizeof att, "{\"v\":1,\"op\":\"attach\",\"rank\":2,\"world_size\":4,\"resume\":\"%s\",\"job\":{\"a\":1}}",
             hex);
    assert_int_equal(parse(att, &r, err), 0);
    assert_string_equal(r.cmd->name, "attach");
    assert_int_equal(r.rank, 2);
    assert_int_equal(r.world, 4);
    assert_true(r.has_resume);
    for (int i = 0; i < 256; i++) assert_int_equal(r.resume[i], i);
    assert_true(json_is_object(r.job));
    ld_request_free(&r);
    assert_int_equal(parse("{\"v\":1,\"op\":\"attach\",\"job\":{},\"resume\":null}", &r, err), 0);
    assert_int_equal(r.rank, 0);
    assert_int_equal(r.world, 1);
    assert_false(r.has_resume);
    ld_request_free(&r);
    assert_int_equal(parse("{\"v\":1,\"op\":\"report\",\"job_id\":7,\"step\":12,\"loss\":1.5,\"tokens_per_s\":null}",
                           &r, err), 0);
    assert_true(r.has_job_id);
    assert_int_equal(r.job_id, 7);
    assert_int_equal(r.step, 12);
    assert_true(r.loss == 1.5);
    assert_true(isnan(r.tokens_per_s));
    ld_request_free(&r);
    assert_int_equal(parse("{\"v\":1,\"op\":\"detach\"}", &r, err), 0);
    assert_false(r.has_job_id);
    ld_request_free(&r);
}

static void test_bad_requests(void **state) {
    (void)state;
    static const struct {
        const char *line, *needle, *op;
    } cases[] = {
        {"not json", "invalid JSON", NULL},
        {"[1,2]", "JSON object", NULL},
        {"{\"op\":\"status\"}", "version", "status"},
        {"{\"v\":2,\"op\":\"status\"}", "version", "status"},
        {"{\"v\":\"1\",\"op\":\"status\"}", "version", "status"},
        {"{\"v\":1}", "missing \"op\"", NULL},
        {"{\"v\":1,\"op\":\"frob\"}", "unknown op", "frob"},
        {"{\"v\":1,\"op\":\"status\",\"op\":\"jobs\"}", "duplicate key \"op\"", NULL}, /* named */
        {"{\"v\":1,\"op\":\"attach\"}", "\"job\"", "attach"},
        {"{\"v\":1,\"op\":\"attach\",\"job\":[]}", "\"job\"", "attach"},
        {"{\"v\":1,\"op\":\"attach\",\"job\":{},\"rank\":-1}", "\"rank\"", "attach"},
        {"{\"v\":1,\"op\":\"attach\",\"job\":{},\"rank\":1}", "below", "attach"},
        {"{\"v\":1,\"op\":\"attach\",\"job\":{},\"world_size\":0}", "world_size", "attach"},
        {"{\"v\":1,\"op\":\"attach\",\"job\":{},\"resume\":\"abc\"}", "hex digits", "attach"},
        {"{\"v\":1,\"op\":\"report\"}", "\"step\"", "report"},
        {"{\"v\":1,\"op\":\"report\",\"step\":-3}", "\"step\"", "report"},
        {"{\"v\":1,\"op\":\"report\",\"step\":1,\"loss\":\"x\"}", "numbers", "report"},
        {"{\"v\":1,\"op\":\"detach\",\"job_id\":\"7\"}", "job_id", "detach"},
        {"{\"v\":1,\"op\":\"detach\",\"job_id\":4294967296}", "job_id", "detach"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        ld_request r;
        char err[512];
        assert_int_equal(parse(cases[i].line, &r, err), 1);
        if (!strstr(err, cases[i].needle)) fail_msg("case %zu: \"%s\" lacks \"%s\"", i, err, cases[i].needle);
        if (cases[i].op) assert_string_equal(r.op_name, cases[i].op);
        else assert_null(r.op_name);
        ld_request_free(&r);
    }
    /* a bad resume hex digit at the very end */
    char att[700] = "{\"v\":1,\"op\":\"attach\",\"job\":{},\"resume\":\"";
    size_t n = strlen(att);
    memset(att + n, 'a', 511);
    strcpy(att + n + 511, "g\"}");
    ld_request r;
    char err[512];
    assert_int_equal(parse(att, &r, err), 1);
    assert_non_null(strstr(err, "not a hex"));
    ld_request_free(&r);
}

/* Control characters anywhere in a request (issue 21 §10): every string and key, whatever the
 * op, refused naming where and which character, before "op" is taken (so an error reply never
 * echoes it); the request's text is never quoted. Plain UTF-8 names pass. */
static void test_control_characters_refused(void **state) {
    (void)state;
    ld_request r;
    char err[512];
    static const struct {
        const char *line, *want;
    } bad[] = {
        {"{\"v\":1,\"op\":\"attach\",\"job\":{\"name\":\"x\\u001b]0;t\\u0007\"}}",
         "request: string \"job.name\" holds a control character (U+001B at byte 1)"},
        {"{\"v\":1,\"op\":\"attach\",\"job\":{\"shards\":[\"/a\",\"/b\\nc\"]}}",
         "string \"job.shards[1]\" holds a control character (U+000A at byte 2)"},
        {"{\"v\":1,\"op\":\"attach\",\"job\":{\"datasets\":[{\"text_field\":\"t\\u202e\"}]}}",
         "\"job.datasets[0].text_field\" holds a control character (U+202E at byte 1)"},
        {"{\"v\":1,\"op\":\"attach\",\"job\":{\"na\\u009bme\":1}}",
         "request: a key inside \"job\" holds a control character (U+009B at byte 2)"},
        {"{\"v\":1,\"op\":\"status\\u001b[2J\"}", "string \"op\" holds a control character (U+001B"},
        {"{\"v\":1,\"op\":\"report\",\"step\":1,\"x\\u0001\":2}", "a key inside \"(the request)\""},
        {"{\"v\":1,\"op\":\"hello\",\"note\":\"\\u007f\"}", "(U+007F at byte 0)"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = 0;
        assert_int_equal(parse(bad[i].line, &r, err), 1);
        if (!strstr(err, bad[i].want)) fail_msg("%zu: %s", i, err);
        assert_null(r.op_name); /* never echoed in the error reply */
        assert_int_equal(bt_text_unsafe(err, strlen(err), NULL), strlen(err));
        ld_request_free(&r);
    }
    assert_int_equal(parse("{\"v\":1,\"op\":\"attach\",\"job\":{\"name\":\"caf\u00e9 \u2713\"}}", &r, err), 0);
    ld_request_free(&r);
}

static void test_depth_limit(void **state) {
    (void)state;
    ld_request r;
    char err[512];
    const char *ok = "{\"v\":1,\"op\":\"status\",\"x\":[[1]]}";   /* depth 3 */
    const char *deep = "{\"v\":1,\"op\":\"status\",\"x\":[[[1]]]}"; /* depth 4 */
    assert_int_equal(parse_depth(ok, &r, 3, err), 0);
    ld_request_free(&r);
    assert_int_equal(parse_depth(deep, &r, 3, err), 1);
    assert_non_null(strstr(err, "nested deeper than 3"));
    ld_request_free(&r);
    /* brackets inside strings do not count */
    const char *str = "{\"v\":1,\"op\":\"status\",\"x\":\"[[[[[[[[\"}";
    assert_int_equal(parse_depth(str, &r, 3, err), 0);
    ld_request_free(&r);
}

/* ref_put (issue 25 §2): "base" and "values" are checked here, each value by the handler; more
 * than LD_REF_PUT_MAX values are refused before anything is looked at. */
static void test_ref_put_parse(void **state) {
    (void)state;
    ld_request r;
    char err[512];
    assert_int_equal(parse("{\"v\":1,\"op\":\"ref_put\",\"job_id\":3,\"base\":\"b\",\"values\":[[0,1,0,-2.5]]}", &r, err), 0);
    assert_string_equal(r.ref_base, "b");
    assert_int_equal(json_array_size(r.ref_values), 1);
    assert_true(r.has_job_id && r.job_id == 3);
    ld_request_free(&r);
    const char *bad[][2] = {
        {"{\"v\":1,\"op\":\"ref_put\",\"values\":[]}", "\"base\": expected"},
        {"{\"v\":1,\"op\":\"ref_put\",\"base\":\"\",\"values\":[]}", "\"base\": expected"},
        {"{\"v\":1,\"op\":\"ref_put\",\"base\":5,\"values\":[]}", "\"base\": expected"},
        {"{\"v\":1,\"op\":\"ref_put\",\"base\":\"b\"}", "\"values\": expected an array"},
        {"{\"v\":1,\"op\":\"ref_put\",\"base\":\"b\",\"values\":{}}", "\"values\": expected an array"},
        {"{\"v\":1,\"op\":\"ref_put\",\"base\":\"b\",\"values\":[],\"job_id\":-1}", "\"job_id\""},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(parse(bad[i][0], &r, err), 1);
        assert_non_null(strstr(err, bad[i][1]));
        ld_request_free(&r);
    }
    /* LD_REF_PUT_MAX + 1 values */
    size_t cap = 64 + (LD_REF_PUT_MAX + 1) * 3;
    char *big = malloc(cap);
    size_t n = (size_t)snprintf(big, cap, "{\"v\":1,\"op\":\"ref_put\",\"base\":\"b\",\"values\":[");
    for (int i = 0; i <= LD_REF_PUT_MAX; i++) n += (size_t)snprintf(big + n, cap - n, "%s[]", i ? "," : "");
    snprintf(big + n, cap - n, "]}");
    assert_int_equal(parse(big, &r, err), 1);
    assert_non_null(strstr(err, "at most 4096"));
    ld_request_free(&r);
    free(big);
}

/* The command table is the one list of ops: every refusal that lists them, and who may call
 * what, come from its rows. */
static void test_command_table(void **state) {
    (void)state;
    const ld_command *t = ld_server_commands();
    char list[256];
    assert_string_equal(ld_command_list(t, list, sizeof list),
                        "hello, attach, detach, report, ref_put, status, jobs, metrics, drain, reload");
    for (const ld_command *c = t; c->name; c++) {
        assert_non_null(c->handler);
        int ops_only = !strcmp(c->name, "drain") || !strcmp(c->name, "reload");
        assert_int_equal(c->who, ops_only ? LD_OPERATORS : LD_ANYONE);
    }
    ld_request r;
    char err[512];
    assert_int_equal(parse("{\"v\":1,\"op\":\"frob\"}", &r, err), 1);
    char want[300];
    snprintf(want, sizeof want, "unknown op (%s)", list);
    assert_string_equal(err, want);
    assert_null(r.cmd);
    ld_request_free(&r);
    assert_int_equal(parse("{\"v\":1}", &r, err), 1);
    snprintf(want, sizeof want, "missing \"op\" (%s)", list);
    assert_string_equal(err, want);
    ld_request_free(&r);
    /* a table of its own: its rows are the only ops (a row is all an op takes) */
    static const ld_command mine[] = {{"ping", NULL, NULL, LD_ANYONE}, {NULL, NULL, NULL, LD_ANYONE}};
    const char *ping = "{\"v\":1,\"op\":\"ping\"}", *status = "{\"v\":1,\"op\":\"status\"}";
    assert_int_equal(ld_request_parse(&r, mine, ping, strlen(ping), 32), BT_OK);
    assert_ptr_equal(r.cmd, &mine[0]);
    ld_request_free(&r);
    assert_int_equal(ld_request_parse(&r, mine, status, strlen(status), 32), BT_ERR_INVALID);
    assert_string_equal(bt_last_error(), "unknown op (ping)");
    ld_request_free(&r);
}

/* A report's "base" is a closed object (json_unpack_ex with '!'): a key more, a key less or a
 * wrong type is refused, naming it. */
static void test_report_base_shape(void **state) {
    (void)state;
    ld_request r;
    char err[512];
    const char *ok = "{\"v\":1,\"op\":\"report\",\"step\":1,\"base\":{\"dtype\":\"gguf\",\"types\":\"Q4_K+Q6_K\","
                     "\"bits_per_weight\":4.75,\"bytes\":3}}";
    assert_int_equal(parse(ok, &r, err), 0);
    assert_true(r.has_base);
    assert_string_equal(r.base_types, "Q4_K+Q6_K");
    assert_true(r.base_bpw == 4.75 && r.base_bytes == 3);
    ld_request_free(&r);
    static const struct {
        const char *base, *want;
    } bad[] = {
        {"{\"dtype\":\"gguf\",\"types\":\"Q4_K\",\"bits_per_weight\":4,\"bytes\":3,\"extra\":1}", "extra"},
        {"{\"dtype\":\"gguf\",\"types\":\"Q4_K\",\"bits_per_weight\":4}", "bytes"},
        {"{\"dtype\":\"gguf\",\"types\":\"Q4_K\",\"bits_per_weight\":\"4\",\"bytes\":3}", "bits_per_weight"},
        {"{\"dtype\":\"gguf\",\"types\":\"Q4 K\",\"bits_per_weight\":4,\"bytes\":3}", "\"types\": 1-63 chars"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char line[256];
        snprintf(line, sizeof line, "{\"v\":1,\"op\":\"report\",\"step\":1,\"base\":%s}", bad[i].base);
        assert_int_equal(parse(line, &r, err), 1);
        if (!strstr(err, "\"base\"") || !strstr(err, bad[i].want)) fail_msg("%zu: %s", i, err);
        ld_request_free(&r);
    }
}

static void test_peer_allowed_and_config(void **state) {
    (void)state;
    ld_config c;
    assert_int_equal(ld_config_parse(&c, "{}", "t"), 0);
    assert_int_equal(c.client_timeout_s, 60);
    assert_true(ld_peer_allowed(&c, 1234, 1234, NULL, 0, 999)); /* no lists: anyone */
    ld_config_free(&c);
    assert_int_equal(ld_config_parse(&c, "{\"allowed_users\":[\"root\", 1234, \"4321\"], \"allowed_groups\":[77],"
                                         "\"client_timeout_s\":0}", "t"), 0);
    assert_int_equal(c.n_allowed_uids, 3);
    assert_int_equal(c.client_timeout_s, 0);
    gid_t groups[] = {5, 77};
    assert_true(ld_peer_allowed(&c, 1234, 1, NULL, 0, 999));
    assert_true(ld_peer_allowed(&c, 4321, 1, NULL, 0, 999));
    assert_true(ld_peer_allowed(&c, 555, 77, NULL, 0, 999));      /* primary group */
    assert_true(ld_peer_allowed(&c, 555, 1, groups, 2, 999));     /* supplementary group */
    assert_false(ld_peer_allowed(&c, 555, 1, groups, 1, 999));
    assert_true(ld_peer_allowed(&c, 999, 1, NULL, 0, 999));       /* loaderd's own uid */
    assert_true(ld_peer_allowed(&c, 0, 1, NULL, 0, 999));         /* root */
    ld_config_free(&c);
    static const char *bad[] = {"{\"allowed_users\":[\"no-such-user-xyz-42\"]}", "{\"allowed_groups\":[\"\"]}",
                                "{\"allowed_users\":[-5]}", "{\"allowed_users\":\"root\"}",
                                "{\"allowed_groups\":[true]}", "{\"client_timeout_s\":86401}",
                                "{\"client_timeout_s\":1.5}"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(ld_config_parse(&c, bad[i], "t"), BT_ERR_INVALID);
        const char *key = strstr(bad[i], "allowed_users") ? "allowed_users"
                          : strstr(bad[i], "allowed_groups") ? "allowed_groups" : "client_timeout_s";
        if (!strstr(bt_last_error(), key)) fail_msg("%s: message \"%s\" does not name %s", bad[i], bt_last_error(), key);
    }
}

int main(void) {
    bt_log_set_level(BT_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ops_accepted),
        cmocka_unit_test(test_bad_requests),
        cmocka_unit_test(test_control_characters_refused),
        cmocka_unit_test(test_depth_limit),
        cmocka_unit_test(test_command_table),
        cmocka_unit_test(test_ref_put_parse),
        cmocka_unit_test(test_report_base_shape),
        cmocka_unit_test(test_peer_allowed_and_config),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
