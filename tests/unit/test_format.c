/* Tests of loaderd/format.c with the real SmolLM2 tokenizer (env BT_MODEL). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "common/chat.h"
#include "common/tokenizer.h"
#include "loaderd/format.h"

static bt_tokenizer *g_tok;

static const char *model_path(void) {
    const char *m = getenv("BT_MODEL");
    return m && *m ? m : "models/SmolLM2-135M-Instruct.Q4_1.gguf";
}

static int setup(void **state) {
    (void)state;
    if (bt_tokenizer_load(&g_tok, model_path()) != BT_OK) {
        fprintf(stderr, "cannot load tokenizer %s: %s\n", model_path(), bt_last_error());
        return -1;
    }
    return 0;
}

static int teardown(void **state) {
    (void)state;
    bt_tokenizer_free(g_tok);
    return 0;
}

typedef struct {
    int rc, reason, truncated;
    bt_ids ids, mask;
    char msg[128];
} res;

static res run(ld_format fmt, uint32_t T, const char *line) {
    res r;
    memset(&r, 0, sizeof r);
    ld_format_cfg cfg = {fmt, fmt == LD_FMT_TEXT ? "body" : NULL, g_tok, T};
    /* pre-existing content must be kept on success and failure */
    bt_ids_push(&r.ids, 42);
    bt_ids_push(&r.mask, 0);
    r.rc = ld_format_line(&cfg, line, strlen(line), &r.ids, &r.mask, &r.truncated, &r.reason, r.msg,
                          sizeof r.msg);
    assert_int_equal(r.ids.n, r.mask.n);
    assert_int_equal(r.ids.v[0], 42);
    return r;
}

static void res_free(res *r) {
    bt_ids_free(&r->ids);
    bt_ids_free(&r->mask);
}

static void expect_bad(ld_format fmt, const char *line, int reason) {
    res r = run(fmt, 0, line);
    if (r.rc != 1 || r.reason != reason)
        fail_msg("line %s: rc %d reason %d (want %d) msg %s", line, r.rc, r.reason, reason, r.msg);
    assert_int_equal(r.ids.n, 1); /* untouched */
    assert_true(strlen(r.msg) > 0);
    res_free(&r);
}

static char *detok(const int32_t *ids, size_t n) {
    char *s;
    size_t len;
    assert_int_equal(bt_detokenize(g_tok, ids, n, 1, &s, &len), BT_OK);
    return s;
}

static void test_utf8_check(void **state) {
    (void)state;
    struct {
        const char *s;
        size_t want;
    } cases[] = {
        {"plain", 5},           {"caf\xc3\xa9", 5},          {"\xe2\x82\xac!", 4},
        {"\xf0\x9f\x98\x80", 4}, {"a\xff", 1},                {"\xc0\xaf", 0},
        {"ab\xc3", 2},          {"\xed\xa0\x80", 0},         {"\xf4\x90\x80\x80", 0},
        {"\xe0\x9f\xbf", 0},    {"x\xf0\x8f\xbf\xbf", 1},    {"\xef\xbf\xbf", 3},
        {"\xf4\x8f\xbf\xbf", 4}, {"\xe2\x28\xa1", 0},         {"\x80", 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        assert_int_equal(ld_utf8_check((const uint8_t *)cases[i].s, strlen(cases[i].s)), cases[i].want);
}

static void test_text(void **state) {
    (void)state;
    res r = run(LD_FMT_TEXT, 16, "{\"body\":\"Hello world, this is a longer text that is not cut.\",\"x\":1}");
    assert_int_equal(r.rc, 0);
    bt_ids want = {0};
    const char *t = "Hello world, this is a longer text that is not cut.";
    assert_int_equal(bt_tokenize(g_tok, t, strlen(t), 0, &want), BT_OK);
    assert_int_equal(r.ids.n, 1 + want.n + 1);
    assert_true(want.n > 10);
    assert_memory_equal(r.ids.v + 1, want.v, want.n * sizeof(int32_t));
    assert_int_equal(r.ids.v[r.ids.n - 1], bt_tokenizer_eos(g_tok));
    for (size_t i = 1; i < r.mask.n; i++) assert_int_equal(r.mask.v[i], 1);
    assert_int_equal(r.truncated, 0); /* text is never cut here, even over T */
    bt_ids_free(&want);
    res_free(&r);
    /* special-token text is not parsed as a control token */
    r = run(LD_FMT_TEXT, 0, "{\"body\":\"<|im_end|>\"}");
    assert_int_equal(r.rc, 0);
    assert_true(r.ids.n > 3);
    for (size_t i = 1; i + 1 < r.ids.n; i++) assert_int_not_equal(r.ids.v[i], bt_tokenizer_find(g_tok, "<|im_end|>"));
    res_free(&r);
    /* NUL inside a string is kept */
    r = run(LD_FMT_TEXT, 0, "{\"body\":\"a\\u0000b\"}");
    assert_int_equal(r.rc, 0);
    res_free(&r);

    expect_bad(LD_FMT_TEXT, "{\"body\":\"\"}", LD_BAD_EMPTY);
    expect_bad(LD_FMT_TEXT, "{\"text\":\"wrong key\"}", LD_BAD_FIELD);
    expect_bad(LD_FMT_TEXT, "{\"body\":5}", LD_BAD_FIELD);
    expect_bad(LD_FMT_TEXT, "{\"body\":[\"a\"]}", LD_BAD_FIELD);
    expect_bad(LD_FMT_TEXT, "{\"body\":null}", LD_BAD_FIELD);
    expect_bad(LD_FMT_TEXT, "{\"body\":\"caf\xc3\"}", LD_BAD_UTF8);
    expect_bad(LD_FMT_TEXT, "{\"body\":\"\xed\xa0\x80\"}", LD_BAD_UTF8);
    expect_bad(LD_FMT_TEXT, "{\"body\":\"unterminated}", LD_BAD_JSON);
    expect_bad(LD_FMT_TEXT, "{\"body\":\"x\"} trailing", LD_BAD_JSON);
    expect_bad(LD_FMT_TEXT, "[1,2]", LD_BAD_JSON);
    expect_bad(LD_FMT_TEXT, "\"just a string\"", LD_BAD_JSON);
    expect_bad(LD_FMT_TEXT, "", LD_BAD_JSON);
    expect_bad(LD_FMT_TEXT, "{\"body\":\"\\ud800\"}", LD_BAD_JSON); /* lone surrogate escape */
}

/* The trained tokens' text: concatenation of the tokens with mask 1. */
static char *trained_text(const res *r) {
    bt_ids t = {0};
    for (size_t i = 1; i < r->ids.n; i++)
        if (r->mask.v[i]) bt_ids_push(&t, r->ids.v[i]);
    char *s = detok(t.v, t.n);
    bt_ids_free(&t);
    return s;
}

static void test_chat(void **state) {
    (void)state;
    const char *line = "{\"messages\":[{\"role\":\"user\",\"content\":\"What is 2+2?\"},"
                       "{\"role\":\"assistant\",\"content\":\"It is 4.\"}],\"meta\":{\"k\":1}}";
    res r = run(LD_FMT_CHAT, 0, line);
    assert_int_equal(r.rc, 0);
    bt_chat_msg msgs[2] = {{"user", "What is 2+2?", 12}, {"assistant", "It is 4.", 8}};
    bt_ids ids = {0}, mask = {0};
    assert_int_equal(bt_chat_encode(g_tok, BT_CHAT_CHATML, msgs, 2, &ids, &mask), BT_OK);
    assert_int_equal(r.ids.n - 1, ids.n);
    assert_memory_equal(r.ids.v + 1, ids.v, ids.n * 4);
    assert_memory_equal(r.mask.v + 1, mask.v, mask.n * 4);
    char *s = detok(r.ids.v + 1, r.ids.n - 1);
    assert_string_equal(s, "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                           "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                           "<|im_start|>assistant\nIt is 4.<|im_end|>\n");
    free(s);
    s = trained_text(&r);
    assert_string_equal(s, "It is 4.<|im_end|>");
    free(s);
    bt_ids_free(&ids);
    bt_ids_free(&mask);
    res_free(&r);

    expect_bad(LD_FMT_CHAT, "{\"msgs\":[]}", LD_BAD_FIELD);
    expect_bad(LD_FMT_CHAT, "{\"messages\":{}}", LD_BAD_FIELD);
    expect_bad(LD_FMT_CHAT, "{\"messages\":[]}", LD_BAD_EMPTY);
    expect_bad(LD_FMT_CHAT, "{\"messages\":[\"hi\"]}", LD_BAD_FIELD);
    expect_bad(LD_FMT_CHAT, "{\"messages\":[{\"content\":\"x\"}]}", LD_BAD_FIELD);
    expect_bad(LD_FMT_CHAT, "{\"messages\":[{\"role\":1,\"content\":\"x\"}]}", LD_BAD_FIELD);
    expect_bad(LD_FMT_CHAT, "{\"messages\":[{\"role\":\"assistant\",\"content\":7}]}", LD_BAD_FIELD);
    expect_bad(LD_FMT_CHAT, "{\"messages\":[{\"role\":\"assistant\"}]}", LD_BAD_FIELD);
    expect_bad(LD_FMT_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"no answer\"}]}", LD_BAD_EMPTY);
    expect_bad(LD_FMT_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"q\"},"
                            "{\"role\":\"assistant\",\"content\":\"\"}]}", LD_BAD_EMPTY);
}

static void test_chat_truncation(void **state) {
    (void)state;
    char line[4096];
    char body[2048];
    for (int i = 0; i < 300; i++) memcpy(body + 5 * i, "word ", 5);
    body[1500] = 0;
    snprintf(line, sizeof line, "{\"messages\":[{\"role\":\"user\",\"content\":\"q\"},"
                                "{\"role\":\"assistant\",\"content\":\"%s\"}]}", body);
    res r = run(LD_FMT_CHAT, 64, line);
    assert_int_equal(r.rc, 0);
    assert_int_equal(r.truncated, 1);
    assert_int_equal(r.ids.n - 1, 64);
    res_free(&r);
    r = run(LD_FMT_CHAT, 0, line);
    assert_int_equal(r.rc, 0);
    assert_int_equal(r.truncated, 0);
    assert_true(r.ids.n - 1 > 300);
    res_free(&r);
    /* the prompt alone is longer than T: nothing to learn within T */
    snprintf(line, sizeof line, "{\"messages\":[{\"role\":\"user\",\"content\":\"%s\"},"
                                "{\"role\":\"assistant\",\"content\":\"ok\"}]}", body);
    r = run(LD_FMT_CHAT, 64, line);
    assert_int_equal(r.rc, 1);
    assert_int_equal(r.reason, LD_BAD_EMPTY);
    assert_int_equal(r.truncated, 0);
    res_free(&r);
}

static void test_alpaca(void **state) {
    (void)state;
    res r = run(LD_FMT_ALPACA, 0, "{\"instruction\":\"Translate.\",\"input\":\"Bonjour\",\"output\":\"Hello\"}");
    assert_int_equal(r.rc, 0);
    char *s = detok(r.ids.v + 1, r.ids.n - 1);
    assert_string_equal(s, "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                           "Hugging Face<|im_end|>\n<|im_start|>user\nTranslate.\n\nBonjour<|im_end|>\n"
                           "<|im_start|>assistant\nHello<|im_end|>\n");
    free(s);
    s = trained_text(&r);
    assert_string_equal(s, "Hello<|im_end|>");
    free(s);
    res_free(&r);
    /* empty / null / missing input: no "\n\n" */
    const char *variants[] = {"{\"instruction\":\"Say hi.\",\"input\":\"\",\"output\":\"Hi\"}",
                              "{\"instruction\":\"Say hi.\",\"input\":null,\"output\":\"Hi\"}",
                              "{\"instruction\":\"Say hi.\",\"output\":\"Hi\"}"};
    for (int i = 0; i < 3; i++) {
        r = run(LD_FMT_ALPACA, 0, variants[i]);
        assert_int_equal(r.rc, 0);
        s = detok(r.ids.v + 1, r.ids.n - 1);
        assert_non_null(strstr(s, "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\nHi<|im_end|>\n"));
        free(s);
        res_free(&r);
    }
    expect_bad(LD_FMT_ALPACA, "{\"input\":\"x\",\"output\":\"y\"}", LD_BAD_FIELD);
    expect_bad(LD_FMT_ALPACA, "{\"instruction\":\"x\"}", LD_BAD_FIELD);
    expect_bad(LD_FMT_ALPACA, "{\"instruction\":\"x\",\"output\":3}", LD_BAD_FIELD);
    expect_bad(LD_FMT_ALPACA, "{\"instruction\":\"x\",\"input\":[1],\"output\":\"y\"}", LD_BAD_FIELD);
    expect_bad(LD_FMT_ALPACA, "{\"instruction\":\"x\",\"output\":\"\"}", LD_BAD_EMPTY);
    expect_bad(LD_FMT_ALPACA, "{\"instruction\":\"x\xf5\",\"output\":\"y\"}", LD_BAD_UTF8);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_utf8_check),
        cmocka_unit_test(test_text),
        cmocka_unit_test(test_chat),
        cmocka_unit_test(test_chat_truncation),
        cmocka_unit_test(test_alpaca),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
