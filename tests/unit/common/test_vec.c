/* common/bt_vec.h (the one growable array) and common/bt_le.h (the one little-endian codec):
 * growth keeps what was there, an impossible size fails without touching the array (the
 * fallible path loaderd takes for a document's tokens), the sticky byte buffer, and the codec's
 * byte order whatever the host's. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/bt_common.h"
#include "common/bt_le.h"
#include "common/bt_vec.h"

/* under ASan a request no allocator can meet must come back NULL, as it does without ASan */
const char *__asan_default_options(void);
const char *__asan_default_options(void) { return "allocator_may_return_null=1"; }

static void test_grow_keeps_contents(void **st) {
    (void)st;
    bt_ids a = {0};
    for (int32_t i = 0; i < 10000; i++) assert_int_equal(bt_ids_try_push(&a, i), BT_OK);
    assert_int_equal(a.n, 10000);
    assert_true(a.cap >= a.n && a.cap < 2 * a.n + 16);
    for (int32_t i = 0; i < 10000; i++) assert_int_equal(a.v[i], i);
    int32_t more[3] = {7, 8, 9};
    assert_int_equal(bt_ids_try_append(&a, more, 3), BT_OK);
    assert_int_equal(a.v[10002], 9);
    bt_ids_push(&a, 42);
    assert_int_equal(a.v[a.n - 1], 42);
    bt_ids_free(&a);
    assert_null(a.v);
    assert_int_equal(a.n + a.cap, 0);
}

static void test_impossible_size_fails_cleanly(void **st) {
    (void)st;
    size_t cap = 0;
    void *v = bt_vec_grow(NULL, &cap, 4, sizeof(double));
    assert_non_null(v);
    assert_int_equal(cap, 16);
    /* an element count whose byte size overflows, and one no allocator can give: NULL, the old
     * array and capacity untouched */
    assert_null(bt_vec_grow(v, &cap, SIZE_MAX / 4, sizeof(double)));
    assert_int_equal(cap, 16);
    assert_null(bt_vec_grow(v, &cap, SIZE_MAX / 16 - 1, 8));
    assert_int_equal(cap, 16);
    free(v);
    /* bt_ids: the message names the count, the array is unchanged */
    bt_ids a = {0};
    bt_ids_push(&a, 5);
    static const int32_t one = 1;
    a.n = SIZE_MAX; /* as if it held more than memory allows */
    assert_int_equal(bt_ids_try_append(&a, &one, 1), BT_ERR_NOMEM);
    assert_non_null(strstr(bt_last_error(), "overflow"));
    a.n = 1;
    assert_int_equal(a.v[0], 5);
    bt_ids_free(&a);
}

static void test_buf_sticky(void **st) {
    (void)st;
    bt_buf b = {0};
    bt_buf_str(&b, "ab");
    bt_buf_printf(&b, "%d-%s", 12, "x");
    assert_string_equal(b.p, "ab12-x");
    char big[600];
    memset(big, 'z', sizeof big - 1);
    big[sizeof big - 1] = 0;
    bt_buf_printf(&b, "%s", big); /* longer than the formatting scratch */
    assert_int_equal(b.n, 6 + 599);
    assert_false(b.oom);
    b.oom = 1; /* after a failure every append is a no-op */
    bt_buf_str(&b, "more");
    assert_int_equal(b.n, 6 + 599);
    free(b.p);
}

static void test_le_codec(void **st) {
    (void)st;
    uint8_t b[8];
    bt_put32(b, 0x11223344u);
    assert_memory_equal(b, "\x44\x33\x22\x11", 4);
    assert_int_equal(bt_get32(b), 0x11223344u);
    bt_put64(b, 0x0102030405060708ull);
    assert_memory_equal(b, "\x08\x07\x06\x05\x04\x03\x02\x01", 8);
    assert_true(bt_get64(b) == 0x0102030405060708ull);
    bt_put16(b, 0xBEEF);
    assert_memory_equal(b, "\xEF\xBE", 2);
    assert_int_equal(bt_get16(b), 0xBEEF);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_grow_keeps_contents),
        cmocka_unit_test(test_impossible_size_fails_cleanly),
        cmocka_unit_test(test_buf_sticky),
        cmocka_unit_test(test_le_codec),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
