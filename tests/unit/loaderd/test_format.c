/* Tests of loaderd/format.c with the real SmolLM2 tokenizer (env BT_MODEL). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "common/chat.h"
#include "common/gguf.h"
#include "common/tokenizer.h"
#include "loaderd/format.h"
#include "tests/unit/util/test_util.h"

static bt_tokenizer *g_tok;

static int setup(void **state) {
    (void)state;
    return tu_load_tokenizer(&g_tok);
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
    ld_format_cfg cfg = {fmt, fmt == LD_FMT_TEXT ? "body" : NULL, g_tok, T, LD_TPL_CHATML, 0, 0, 0, 0};
    /* pre-existing content must be kept on success and failure */
    bt_ids_push(&r.ids, 42);
    bt_ids_push(&r.mask, 0);
    r.rc = ld_format_line(&cfg, line, strlen(line), &r.ids, &r.mask, &r.truncated, &r.reason);
    snprintf(r.msg, sizeof r.msg, "%s", r.rc == 1 ? bt_last_error() : ""); /* a bad line's description */
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

/* A Llama-3-style tokenizer: SmolLM2's vocabulary and merges plus the four Llama-3 chat tokens
 * (control), BOS = <|begin_of_text|>, add_bos_token = true, a Llama-3 chat_template string. */
static bt_tokenizer *llama3_tokenizer(char *path, size_t pathlen) {
    bt_gguf *g = NULL;
    assert_int_equal(bt_gguf_open(&g, tu_model_path()), BT_OK);
    bt_str *toks;
    uint64_t n;
    assert_int_equal(bt_gguf_get_str_arr(g, "tokenizer.ggml.tokens", &toks, &n), BT_OK);
    const void *tt;
    uint64_t ntt;
    bt_gguf_vtype et;
    assert_int_equal(bt_gguf_get_num_arr(g, "tokenizer.ggml.token_type", &et, &tt, &ntt), BT_OK);
    assert_int_equal(ntt, n);
    static const char *extra[4] = {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"};
    bt_str *all = malloc((n + 4) * sizeof *all);
    int32_t *types = malloc((n + 4) * sizeof *types);
    memcpy(all, toks, n * sizeof *all);
    for (uint64_t i = 0; i < n; i++) memcpy(&types[i], (const char *)tt + 4 * i, 4);
    for (int k = 0; k < 4; k++) {
        all[n + k].ptr = extra[k];
        all[n + k].len = strlen(extra[k]);
        types[n + k] = 3;
    }
    bt_gguf_writer *w = bt_gguf_writer_new();
    assert_int_equal(bt_gguf_w_copy_kv(w, g, "tokenizer.ggml.model"), BT_OK);
    assert_int_equal(bt_gguf_w_copy_kv(w, g, "tokenizer.ggml.pre"), BT_OK);
    assert_int_equal(bt_gguf_w_copy_kv(w, g, "tokenizer.ggml.merges"), BT_OK);
    assert_int_equal(bt_gguf_w_str_arr(w, "tokenizer.ggml.tokens", all, n + 4), BT_OK);
    assert_int_equal(bt_gguf_w_num_arr(w, "tokenizer.ggml.token_type", BT_GGUF_I32, types, n + 4), BT_OK);
    assert_int_equal(bt_gguf_w_u32(w, "tokenizer.ggml.bos_token_id", (uint32_t)n), BT_OK);
    assert_int_equal(bt_gguf_w_u32(w, "tokenizer.ggml.eos_token_id", (uint32_t)n + 3), BT_OK);
    assert_int_equal(bt_gguf_w_bool(w, "tokenizer.ggml.add_bos_token", 1), BT_OK);
    const char *ct = "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + "
                     "'<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}{% endfor %}";
    assert_int_equal(bt_gguf_w_str(w, "tokenizer.chat_template", ct, strlen(ct)), BT_OK);
    snprintf(path, pathlen, "/tmp/bt_test_format_llama3_%d.gguf", (int)getpid());
    assert_int_equal(bt_gguf_writer_write(w, path), BT_OK);
    bt_gguf_writer_free(w);
    free(all), free(types), free(toks);
    bt_gguf_close(g);
    bt_tokenizer *t = NULL;
    if (bt_tokenizer_load(&t, path) != BT_OK) fail_msg("llama3 tokenizer: %s", bt_last_error());
    return t;
}

/* Masked tokens decoded, concatenated. */
static char *masked_text(const bt_tokenizer *t, const bt_ids *ids, const bt_ids *mask, size_t from) {
    bt_ids sel = {0};
    for (size_t i = from; i < ids->n; i++)
        if (mask->v[i]) bt_ids_push(&sel, ids->v[i]);
    char *s;
    size_t len;
    assert_int_equal(bt_detokenize(t, sel.v, sel.n, 1, &s, &len), BT_OK);
    bt_ids_free(&sel);
    return s;
}

static void test_llama3_template(void **state) {
    (void)state;
    char path[128];
    bt_tokenizer *t = llama3_tokenizer(path, sizeof path);
    ld_chat_tpl tpl = LD_TPL_AUTO;
    /* the template string decides (this vocabulary also has the ChatML tokens) */
    assert_int_equal(ld_chat_tpl_resolve(t, LD_TPL_AUTO, &tpl), BT_OK);
    assert_int_equal(tpl, LD_TPL_LLAMA3);
    assert_int_equal(ld_chat_tpl_resolve(g_tok, LD_TPL_AUTO, &tpl), BT_OK);
    assert_int_equal(tpl, LD_TPL_CHATML);
    assert_int_equal(ld_chat_tpl_resolve(g_tok, LD_TPL_LLAMA3, &tpl), BT_ERR_UNSUPPORTED);
    const char *line = "{\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},"
                       "{\"role\":\"user\",\"content\":\"Hi there\"},{\"role\":\"assistant\",\"content\":\"  Hello!\\n\"},"
                       "{\"role\":\"user\",\"content\":\"More <|eot_id|>\"},{\"role\":\"assistant\",\"content\":\"Sure.\"}]}";
    for (int add_bos = 0; add_bos <= 1; add_bos++) {
        ld_format_cfg cfg = {LD_FMT_CHAT, NULL, t, 0, LD_TPL_LLAMA3, add_bos, 0, 0, 0};
        bt_ids ids = {0}, mask = {0};
        int trunc, reason;
        assert_int_equal(ld_format_line(&cfg, line, strlen(line), &ids, &mask, &trunc, &reason), 0);
        char *s;
        size_t len;
        assert_int_equal(bt_detokenize(t, ids.v, ids.n, 1, &s, &len), BT_OK);
        assert_string_equal(s, "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                               "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
                               "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
                               "<|start_header_id|>user<|end_header_id|>\n\nMore <|eot_id|><|eot_id|>"
                               "<|start_header_id|>assistant<|end_header_id|>\n\nSure.<|eot_id|>");
        free(s);
        /* BOS once (the template's), the literal "<|eot_id|>" in user text is text, not the token */
        int n_bos = 0, n_eot = 0;
        for (size_t i = 0; i < ids.n; i++) {
            n_bos += ids.v[i] == bt_tokenizer_bos(t);
            n_eot += ids.v[i] == bt_tokenizer_find(t, "<|eot_id|>");
        }
        assert_int_equal(n_bos, 1);
        assert_int_equal(ids.v[0], bt_tokenizer_bos(t));
        assert_int_equal(n_eot, 5);
        char *m = masked_text(t, &ids, &mask, 0);
        assert_string_equal(m, "Hello!<|eot_id|>Sure.<|eot_id|>"); /* loss on both assistant turns */
        free(m);
        bt_ids_free(&ids), bt_ids_free(&mask);
    }
    /* Jinja's `trim` is Python's str.strip(): Unicode whitespace (U+3000, U+00A0, U+2028, U+001C)
     * goes too, not only ASCII; inner whitespace stays */
    const char *ws = "{\"messages\":[{\"role\":\"user\",\"content\":\"\\u3000Hi\\u00a0\"},"
                     "{\"role\":\"assistant\",\"content\":\"\\u2028\\u001c Yes\\u2003no \\u3000\"}]}";
    ld_format_cfg cfg = {LD_FMT_CHAT, NULL, t, 0, LD_TPL_LLAMA3, 0, 0, 0, 0};
    bt_ids ids = {0}, mask = {0};
    int trunc, reason;
    assert_int_equal(ld_format_line(&cfg, ws, strlen(ws), &ids, &mask, &trunc, &reason), 0);
    char *s;
    size_t len;
    assert_int_equal(bt_detokenize(t, ids.v, ids.n, 1, &s, &len), BT_OK);
    assert_string_equal(s, "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                           "<|start_header_id|>assistant<|end_header_id|>\n\nYes\u2003no<|eot_id|>");
    free(s);
    bt_ids_free(&ids), bt_ids_free(&mask);
    bt_tokenizer_free(t);
    unlink(path);
}

static void test_bos_eos_overlong(void **state) {
    (void)state;
    int32_t bos = bt_tokenizer_bos(g_tok), eos = bt_tokenizer_eos(g_tok);
    assert_true(bos >= 0 && eos >= 0);
    const char *line = "{\"body\":\"hello world\"}";
    for (int add_bos = 0; add_bos <= 1; add_bos++) {
        ld_format_cfg cfg = {LD_FMT_TEXT, "body", g_tok, 0, LD_TPL_CHATML, add_bos, 0, 0, 0};
        bt_ids ids = {0}, mask = {0};
        int trunc, reason;
        assert_int_equal(ld_format_line(&cfg, line, strlen(line), &ids, &mask, &trunc, &reason), 0);
        assert_int_equal(ids.v[0] == bos, add_bos);
        assert_int_equal(ids.v[ids.n - 1], eos);
        assert_true(ids.n < 2 || ids.v[ids.n - 2] != eos);
        bt_ids_free(&ids), bt_ids_free(&mask);
        /* chat with add_bos: one BOS in front of the ChatML rendering */
        ld_format_cfg cc = {LD_FMT_CHAT, NULL, g_tok, 0, LD_TPL_CHATML, add_bos, 0, 0, 0};
        const char *chat = "{\"messages\":[{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"assistant\",\"content\":\"a\"}]}";
        assert_int_equal(ld_format_line(&cc, chat, strlen(chat), &ids, &mask, &trunc, &reason), 0);
        int n_bos = 0;
        for (size_t i = 0; i < ids.n; i++) n_bos += ids.v[i] == bos;
        if (bos == bt_tokenizer_find(g_tok, "<|im_start|>")) { /* SmolLM2: the rendering starts with BOS */
            assert_int_equal(ids.v[0], bos);
            assert_int_equal(n_bos, 3); /* system, user, assistant headers; none added */
        } else {
            assert_int_equal(ids.v[0] == bos, add_bos);
            assert_int_equal(n_bos, add_bos);
        }
        bt_ids_free(&ids), bt_ids_free(&mask);
    }
    /* overlong: "drop" rejects, "truncate" cuts */
    char chat[4096];
    int k = snprintf(chat, sizeof chat, "{\"messages\":[{\"role\":\"user\",\"content\":\"q\"},"
                                        "{\"role\":\"assistant\",\"content\":\"");
    for (int w = 0; w < 200; w++) k += snprintf(chat + k, sizeof chat - (size_t)k, "w%d ", w);
    snprintf(chat + k, sizeof chat - (size_t)k, "\"}]}");
    for (int drop = 0; drop <= 1; drop++) {
        ld_format_cfg cfg = {LD_FMT_CHAT, NULL, g_tok, 64, LD_TPL_CHATML, 0, drop, 0, 0};
        bt_ids ids = {0}, mask = {0};
        int trunc = -1, reason = -1;
        int rc = ld_format_line(&cfg, chat, strlen(chat), &ids, &mask, &trunc, &reason);
        if (drop) {
            assert_int_equal(rc, 1);
            assert_int_equal(reason, LD_BAD_OVERLONG);
            assert_int_equal(ids.n, 0);
        } else {
            assert_int_equal(rc, 0);
            assert_int_equal(trunc, 1);
            assert_int_equal(ids.n, 64);
        }
        bt_ids_free(&ids), bt_ids_free(&mask);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_utf8_check),
        cmocka_unit_test(test_text),
        cmocka_unit_test(test_chat),
        cmocka_unit_test(test_chat_truncation),
        cmocka_unit_test(test_alpaca),
        cmocka_unit_test(test_llama3_template),
        cmocka_unit_test(test_bos_eos_overlong),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
