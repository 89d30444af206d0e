/* common/bt_common.c errors: bt_fail keeps the message (also when an argument is the previous
 * message), bt_last_error_in drops a leading "<part>: " that a wrapper of the same part would
 * repeat, and only that exact prefix; bt_fail and bt_log never write a leading part twice
 * (issue 21 §11); the unsafe-text check and escape (issue 21 §10) and bt_log's one line per
 * event, whatever the message quotes. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/bt_common.h"

static void test_fail_wraps_itself(void **st) {
    (void)st;
    assert_int_equal(bt_fail(BT_ERR_FORMAT, "gguf: %s: bad magic", "x.gguf"), BT_ERR_FORMAT);
    assert_string_equal(bt_last_error(), "gguf: x.gguf: bad magic");
    bt_fail(BT_ERR_IO, "model: %s", bt_last_error());
    assert_string_equal(bt_last_error(), "model: gguf: x.gguf: bad magic");
}

static void test_last_error_in(void **st) {
    (void)st;
    bt_fail(BT_ERR_INVALID, "model: RoPE head_dim %d must be even", 7);
    assert_string_equal(bt_last_error_in("model"), "RoPE head_dim 7 must be even");
    bt_fail(BT_ERR_INVALID, "model: %s: %s", "m.gguf", bt_last_error_in("model"));
    assert_string_equal(bt_last_error(), "model: m.gguf: RoPE head_dim 7 must be even");
    /* another part, a longer word, no ": " after it, empty: unchanged */
    bt_fail(BT_ERR_INVALID, "gguf: short read");
    assert_string_equal(bt_last_error_in("model"), "gguf: short read");
    bt_fail(BT_ERR_INVALID, "models: 3 found");
    assert_string_equal(bt_last_error_in("model"), "models: 3 found");
    bt_fail(BT_ERR_INVALID, "model:x");
    assert_string_equal(bt_last_error_in("model"), "model:x");
    bt_fail(BT_ERR_INVALID, "model");
    assert_string_equal(bt_last_error_in("model"), "model");
    bt_fail(BT_ERR_INVALID, "%s", "");
    assert_string_equal(bt_last_error_in("model"), "");
}

/* A message wrapped with the part it already starts with keeps it once (the class of "token
 * cache: token cache: ..."); a part repeated later in the message, or different parts, stay. */
static void test_fail_never_doubles_its_part(void **st) {
    (void)st;
    bt_fail(BT_ERR_IO, "token cache: %s: write: %s", "/c/x.tmp", "No space left on device");
    bt_fail(BT_ERR_IO, "token cache: %s", bt_last_error());
    assert_string_equal(bt_last_error(), "token cache: /c/x.tmp: write: No space left on device");
    bt_fail(BT_ERR_IO, "a: a: a: b");
    assert_string_equal(bt_last_error(), "a: b");
    bt_fail(BT_ERR_IO, "config: /etc/x.json: config: y");
    assert_string_equal(bt_last_error(), "config: /etc/x.json: config: y");
    bt_fail(BT_ERR_IO, "ab: a: x");
    assert_string_equal(bt_last_error(), "ab: a: x");
}

static void test_text_unsafe_and_escape(void **st) {
    (void)st;
    static const struct {
        const char *in;
        size_t bad; /* offset of the first unsafe character */
        int32_t cp;
        const char *out;
    } cases[] = {
        {"plain name-1.jsonl", 18, 0, "plain name-1.jsonl"},
        {"caf\xc3\xa9 \xe2\x9c\x93", 9, 0, "caf\xc3\xa9 \xe2\x9c\x93"}, /* UTF-8 stays */
        {"a\nb", 1, '\n', "a\\nb"},
        {"x\x1b]0;pwned\x07y", 1, 0x1b, "x\\x1b]0;pwned\\x07y"},            /* OSC ... BEL */
        {"t\tr\r", 1, '\t', "t\\tr\\r"},
        {"del\x7f", 3, 0x7f, "del\\x7f"},
        {"c1\xc2\x9b" "31m", 2, 0x9b, "c1\\u009b31m"},                       /* U+009B CSI */
        {"rtl\xe2\x80\xae" "gpj.exe", 3, 0x202e, "rtl\\u202egpj.exe"},        /* bidi override */
        {"bad\xff", 3, -1 - 0xff, "bad\\xff"},
        {"over\xc0\xaf", 4, -1 - 0xc0, "over\\xc0\\xaf"},                 /* overlong '/' */
        {"cut\xe2\x80", 3, -1 - 0xe2, "cut\\xe2\\x80"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int32_t cp = 0;
        size_t n = strlen(cases[i].in);
        assert_int_equal(bt_text_unsafe(cases[i].in, n, &cp), cases[i].bad);
        if (cases[i].bad < n) assert_int_equal(cp, cases[i].cp);
        char out[128];
        size_t k = bt_escape_text(out, sizeof out, cases[i].in, n);
        assert_string_equal(out, cases[i].out);
        assert_int_equal(k, strlen(out));
        assert_int_equal(bt_text_unsafe(out, k, NULL), k); /* the result is always safe */
    }
    /* cut short only between whole characters and escapes */
    char small[6];
    bt_escape_text(small, sizeof small, "ab\x1b" "cd", 5);
    assert_string_equal(small, "ab");
    bt_escape_text(small, sizeof small, "\xc3\xa9\xc3\xa9\xc3\xa9", 6);
    assert_string_equal(small, "\xc3\xa9\xc3\xa9");
}

/* bt_log: whatever the message quotes, one event is one line, without terminal controls, and it
 * names its part once. */
static void test_log_one_line_per_event(void **st) {
    (void)st;
    char path[] = "/tmp/bt_test_log_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    fflush(stderr);
    int saved = dup(2);
    dup2(fd, 2);
    bt_log(BT_LOG_WARN, "loaderd", "job \"%s\" attached", "x\n2099-01-01T00:00:00.000Z info loaderd: forged\x1b[2J\x07");
    bt_log(BT_LOG_WARN, "loaderd", "token cache: %s", "token cache: /c/e.btc.tmp: write: No space left on device");
    bt_log(BT_LOG_WARN, "loaderd", "loaderd: %s", "stopping");
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    char buf[2048] = {0};
    ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
    close(fd);
    unlink(path);
    assert_true(n > 0);
    int lines = 0;
    for (ssize_t i = 0; i < n; i++) lines += buf[i] == '\n';
    assert_int_equal(lines, 3);
    assert_null(strchr(buf, 0x1b));
    assert_null(strchr(buf, 0x07));
    assert_non_null(strstr(buf, "job \"x\\n2099-01-01T00:00:00.000Z info loaderd: forged\\x1b[2J\\x07\" attached\n"));
    assert_non_null(strstr(buf, " loaderd: token cache: /c/e.btc.tmp: write: No space left on device\n"));
    assert_null(strstr(buf, "token cache: token cache"));
    assert_non_null(strstr(buf, " warn loaderd: stopping\n"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fail_wraps_itself),
        cmocka_unit_test(test_last_error_in),
        cmocka_unit_test(test_fail_never_doubles_its_part),
        cmocka_unit_test(test_text_unsafe_and_escape),
        cmocka_unit_test(test_log_one_line_per_event),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
