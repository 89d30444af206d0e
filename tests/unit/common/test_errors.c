/* common/bt_common.c errors: bt_fail keeps the message (also when an argument is the previous
 * message), bt_last_error_in drops a leading "<part>: " that a wrapper of the same part would
 * repeat, and only that exact prefix. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <string.h>

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

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fail_wraps_itself),
        cmocka_unit_test(test_last_error_in),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
