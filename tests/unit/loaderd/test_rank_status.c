/* loaderd's rule for a rank that falls behind the others of its data-parallel run
 * (loaderd/server_priv.h ld_rank_behind), on fabricated reports: steps apart, a missing report,
 * a rank that stopped reporting while the others go on (relative to the freshest report and the
 * run's step period), and the cases that are not "behind" (one rank, no reports, a step apart). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <string.h>

#include "loaderd/server_priv.h"

static void test_steps_and_missing_reports(void **st) {
    (void)st;
    char why[160];
    ld_rank_progress r[3] = {{1, 10, 0.5, 2.0}, {1, 9, 0.4, 2.0}, {1, 8, 0.6, 2.0}};
    assert_false(ld_rank_behind(r, 3, 0, why, sizeof why));
    assert_false(ld_rank_behind(r, 3, 1, why, sizeof why)); /* one step apart: a step ending */
    assert_true(ld_rank_behind(r, 3, 2, why, sizeof why));
    assert_string_equal(why, "2 steps behind");
    r[2] = (ld_rank_progress){0, 0, 0, 0};
    assert_true(ld_rank_behind(r, 3, 2, why, sizeof why));
    assert_string_equal(why, "no report yet, the others are at step 10");
    r[0].step = r[1].step = 1; /* the others have barely started */
    assert_false(ld_rank_behind(r, 3, 2, why, sizeof why));
    assert_string_equal(why, "");
    ld_rank_progress one = {1, 5, 100.0, 1.0};
    assert_false(ld_rank_behind(&one, 1, 0, NULL, 0)); /* nobody to fall behind */
    ld_rank_progress none[2] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
    assert_false(ld_rank_behind(none, 2, 1, why, sizeof why));
}

static void test_silence(void **st) {
    (void)st;
    char why[160];
    /* steps of 2 s: silent for 31 s longer than the freshest is behind (the 30 s floor) */
    ld_rank_progress r[2] = {{1, 20, 1.0, 2.0}, {1, 20, 32.0, 2.0}};
    assert_false(ld_rank_behind(r, 2, 0, why, sizeof why));
    assert_true(ld_rank_behind(r, 2, 1, why, sizeof why));
    assert_string_equal(why, "no report for 32 s, the others reported 1 s ago");
    r[1].age_s = 30.5; /* within the floor */
    assert_false(ld_rank_behind(r, 2, 1, why, sizeof why));
    /* steps of 60 s: the same silence is normal; three steps' worth is not */
    r[0].period_s = r[1].period_s = 60.0;
    r[1].age_s = 100.0;
    assert_false(ld_rank_behind(r, 2, 1, why, sizeof why));
    r[1].age_s = 182.0;
    assert_true(ld_rank_behind(r, 2, 1, why, sizeof why));
    /* all silent together (a long evaluation, loaderd restarted): nobody is behind */
    r[0].age_s = r[1].age_s = 500.0;
    assert_false(ld_rank_behind(r, 2, 0, why, sizeof why));
    assert_false(ld_rank_behind(r, 2, 1, why, sizeof why));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_steps_and_missing_reports),
        cmocka_unit_test(test_silence),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
