/* The JSON input rules of common/bt_json.h, everywhere users give us JSON (issue 10 §5): a UTF-8
 * byte-order mark at the start is skipped; a key given twice in one object is refused naming
 * the key and its line/column. Covered: bt_json_loadb / bt_json_load_file themselves, loaderd's
 * config, job specs (ld_job_spec_parse: loaderctl preview, the attach path), control requests,
 * shard lines (ld_format_line: a BOM-led first record is a document, not a `json` error), the
 * trainer's job config (test_trainer_config.c), HF config.json (test_model_hf.c). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "common/bt_json.h"
#include "loaderd/config.h"
#include "loaderd/format.h"
#include "loaderd/pipeline.h"
#include "loaderd/server.h"
#include "loaderd/server_proto.h"
#include "tests/unit/util/test_util.h"

#define BOM "\xEF\xBB\xBF"

static void test_loadb(void **st) {
    (void)st;
    json_t *j = NULL;
    assert_int_equal(bt_utf8_bom_len(BOM "{}", 5), 3);
    assert_int_equal(bt_utf8_bom_len("\xEF\xBB", 2), 0);
    assert_int_equal(bt_json_loadb(&j, BOM "{\"a\": 1}", 11, 0, "x.json"), BT_OK);
    assert_int_equal(json_integer_value(json_object_get(j, "a")), 1);
    json_decref(j);
    /* nested objects too, the key named as written, with line and column */
    const char *t = "{\"a\": {\"b\": 1,\n  \"b\": 2}}";
    assert_int_equal(bt_json_loadb(&j, t, strlen(t), 0, "x.json"), BT_ERR_FORMAT);
    assert_null(j);
    assert_string_equal(bt_last_error(), "x.json:2:5: duplicate key \"b\" (each key may appear only once in an object)");
    /* the same key in two different objects is fine */
    t = "{\"a\": {\"b\": 1}, \"c\": {\"b\": 2}}";
    assert_int_equal(bt_json_loadb(&j, t, strlen(t), 0, "x.json"), BT_OK);
    json_decref(j);
    assert_int_equal(bt_json_loadb(&j, "{\"a\": ", 6, 0, "y.json"), BT_ERR_FORMAT);
    assert_non_null(strstr(bt_last_error(), "y.json:1:"));
    assert_non_null(strstr(bt_last_error(), "invalid JSON"));
    /* a BOM anywhere else is not skipped */
    assert_int_equal(bt_json_loadb(&j, "{}" BOM, 5, 0, "z"), BT_ERR_FORMAT);
    /* from a file */
    char dir[64], p[128];
    assert_int_equal(tu_make_tmpdir(dir, sizeof dir, "json"), 0);
    snprintf(p, sizeof p, "%s/config.json", dir);
    tu_write_file(NULL, p, BOM "{\"k\": [1, 2]}", 16);
    assert_int_equal(bt_json_load_file(&j, p, 0, 1 << 20), BT_OK);
    assert_int_equal(json_array_size(json_object_get(j, "k")), 2);
    json_decref(j);
    tu_write_file(NULL, p, "{\"k\": 1, \"k\": 2}", 16);
    assert_int_equal(bt_json_load_file(&j, p, 0, 1 << 20), BT_ERR_FORMAT);
    assert_non_null(strstr(bt_last_error(), "config.json:1:"));
    assert_non_null(strstr(bt_last_error(), "duplicate key \"k\""));
    assert_int_equal(bt_json_load_file(&j, p, 0, 4), BT_ERR_RANGE);
    assert_int_equal(tu_remove_dir(dir), 0);
}

static void test_loaderd_config(void **st) {
    (void)st;
    ld_config c;
    assert_int_equal(ld_config_parse(&c, BOM "{\"max_jobs\": 3}", "ld.json"), BT_OK);
    assert_int_equal(c.max_jobs, 3);
    ld_config_free(&c);
    assert_int_equal(ld_config_parse(&c, "{\"max_jobs\": 3, \"max_jobs\": 300}", "ld.json"), BT_ERR_FORMAT);
    assert_non_null(strstr(bt_last_error(), "ld.json:1:"));
    assert_non_null(strstr(bt_last_error(), "duplicate key \"max_jobs\""));
}

#define SPEC "\"tokenizer\": \"/m/t.gguf\", \"shards\": [\"/d/*.jsonl\"], \"format\": \"chat\", \"micro_batch_size\": 2"

static void test_job_spec(void **st) {
    (void)st;
    ld_job_spec s;
    assert_int_equal(ld_job_spec_parse(&s, BOM "{" SPEC ", \"seq_len\": 64}", NULL), BT_OK);
    assert_int_equal(s.T, 64);
    ld_job_spec_free(&s);
    assert_int_equal(ld_job_spec_parse(&s, "{" SPEC ", \"seq_len\": 64, \"seq_len\": 4096}", NULL),
                     BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "duplicate key \"seq_len\""));
    assert_non_null(strstr(bt_last_error(), "job spec:1:"));
    /* inside "datasets" too */
    const char *t = "{\"tokenizer\": \"/t\", \"seq_len\": 64, \"micro_batch_size\": 1, \"datasets\": "
                    "[{\"shards\": [\"/a\"], \"format\": \"text\", \"weight\": 1, \"weight\": 9}]}";
    assert_int_equal(ld_job_spec_parse(&s, t, NULL), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "duplicate key \"weight\""));
}

static void test_request(void **st) {
    (void)st;
    ld_request r;
    const char *t = "{\"v\": 1, \"op\": \"attach\", \"job\": {\"seq_len\": 1, \"seq_len\": 2}}";
    assert_int_equal(ld_request_parse(&r, ld_server_commands(), t, strlen(t), 32), BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "duplicate key \"seq_len\""));
    ld_request_free(&r);
}

/* A shard that starts with a BOM: its first record is a document (it used to be lost, counted
 * as `json`); a record with a key given twice is a `json` bad line naming the key. */
static void test_shard_lines(void **st) {
    (void)st;
    bt_tokenizer *tok = NULL;
    assert_int_equal(tu_load_tokenizer(&tok), 0);
    ld_format_cfg cfg = {.format = LD_FMT_TEXT, .tok = tok};
    bt_ids ids = {0}, mask = {0}, ids2 = {0}, mask2 = {0};
    int trunc = 0, reason = -1;
    const char *plain = "{\"text\": \"hello world\"}", *bom = BOM "{\"text\": \"hello world\"}";
    assert_int_equal(ld_format_line(&cfg, plain, strlen(plain), &ids, &mask, &trunc, &reason), 0);
    assert_int_equal(ld_format_line(&cfg, bom, strlen(bom), &ids2, &mask2, &trunc, &reason), 0);
    assert_int_equal(ids.n, ids2.n);
    assert_memory_equal(ids.v, ids2.v, ids.n * sizeof ids.v[0]);
    const char *dup = "{\"text\": \"a\", \"text\": \"b\"}";
    size_t n0 = ids.n;
    assert_int_equal(ld_format_line(&cfg, dup, strlen(dup), &ids, &mask, &trunc, &reason), 1);
    assert_int_equal(reason, LD_BAD_JSON);
    assert_non_null(strstr(bt_last_error(), "duplicate object key near '\"text\"'"));
    assert_int_equal(ids.n, n0);
    bt_ids_free(&ids);
    bt_ids_free(&mask);
    bt_ids_free(&ids2);
    bt_ids_free(&mask2);
    bt_tokenizer_free(tok);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_loadb),
        cmocka_unit_test(test_loaderd_config),
        cmocka_unit_test(test_job_spec),
        cmocka_unit_test(test_request),
        cmocka_unit_test(test_shard_lines),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
