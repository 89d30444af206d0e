/* The trainer's key table (trainer/config_keys.c): its defaults parse through their rows; an
 * unknown key is refused naming it, with its path returned as data; every integer and number
 * row refuses the values just outside its range, naming the key; the deprecated alias
 * cuda.nf4_matmul reads exactly as cuda.base_matmul; and every key, set to a value other than its
 * default, survives bt_config_dump -> bt_config_parse unchanged (and shows in the dump). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "common/keytab.h"
#include "trainer/config.h"

#define MINIMAL "{\"model\": \"m.gguf\", \"data\": {\"shards\": [\"d/*.jsonl.zst\"]}}"

/* Parse MINIMAL with sets; the dump (malloc'd) or NULL with the error in bt_last_error(). */
static char *dump_with(const char *const *sets, int n) {
    bt_train_config c;
    if (bt_config_parse(&c, MINIMAL, "t", sets, n)) return NULL;
    char *d = bt_config_dump(&c);
    bt_config_free(&c);
    return d;
}

static void test_defaults_and_unknown_keys(void **st) {
    (void)st;
    bt_train_config c;
    memset(&c, 0, sizeof c);
    assert_int_equal(bt_keytab_defaults(bt_config_keys, &c), BT_OK);
    bt_keytab_free(bt_config_keys, &c);
    static const struct {
        const char *json, *path;
    } unknown[] = {
        {"{\"model\": \"m\", \"data\": {\"shards\": [\"a\"]}, \"optim\": {\"momentum\": 0.9}}", "optim.momentum"},
        {"{\"model\": \"m\", \"data\": {\"shards\": [\"a\"]}, \"trainer_steps\": 3}", "trainer_steps"},
        {"{\"model\": \"m\", \"data\": {\"shards\": [\"a\"]}, \"attention\": {\"s2\": {\"groups\": 4}}}",
         "attention.s2.groups"},
        {"{\"model\": \"m\", \"data\": {\"shards\": [\"a\"]}, \"cuda\": {\"nf4\": \"fused\"}}", "cuda.nf4"},
    };
    for (size_t i = 0; i < sizeof unknown / sizeof unknown[0]; i++) {
        json_t *o = json_loads(unknown[i].json, 0, NULL);
        assert_non_null(o);
        memset(&c, 0, sizeof c);
        bt_keypath bad;
        assert_int_equal(bt_keytab_defaults(bt_config_keys, &c), BT_OK);
        assert_int_equal(bt_keytab_parse(bt_config_keys, o, &c, NULL, "", BT_KEYTAB_COMMENTS | BT_KEYTAB_GOT, &bad),
                         BT_ERR_INVALID);
        assert_string_equal(bad.s, unknown[i].path); /* the key as data */
        char want[128];
        snprintf(want, sizeof want, "unknown key \"%s\" (known: ", unknown[i].path);
        assert_non_null(strstr(bt_last_error(), want));
        bt_keytab_free(bt_config_keys, &c);
        json_decref(o);
        /* and through the public parser: the same message after "config: " */
        assert_int_equal(bt_config_parse(&c, unknown[i].json, "t", NULL, 0), BT_ERR_INVALID);
        assert_int_equal(strncmp(bt_last_error(), "config: unknown key", 19), 0);
    }
}

/* Each integer / number row of tab (section prefix) refuses the values just outside its range. */
static void check_ranges(const bt_key *tab, const char *prefix, int *n_checked) {
    for (const bt_key *k = tab; k->name; k++) {
        char path[BT_KEY_PATH_MAX];
        snprintf(path, sizeof path, "%s%s", prefix, k->name);
        if (k->alias) continue;
        if (k->type == BT_KEY_OBJ) {
            char sub[BT_KEY_PATH_MAX + 1];
            snprintf(sub, sizeof sub, "%s.", path);
            check_ranges(k->sub, sub, n_checked);
            continue;
        }
        char vals[2][64];
        int nv = 0;
        if (k->type == BT_KEY_INT) {
            snprintf(vals[nv++], sizeof vals[0], "%lld", (long long)k->ilo - 1);
            if (k->ihi < 9000000000000000ll) snprintf(vals[nv++], sizeof vals[0], "%lld", (long long)k->ihi + 1);
        } else if (k->type == BT_KEY_NUM) {
            snprintf(vals[nv++], sizeof vals[0], "%.17g", k->flags & BT_KEY_LO_OPEN ? k->nlo : k->nlo - 1);
            if (!isinf(k->nhi)) snprintf(vals[nv++], sizeof vals[0], "%.17g", k->flags & BT_KEY_HI_OPEN ? k->nhi : k->nhi + 1);
        } else {
            continue;
        }
        for (int i = 0; i < nv; i++) {
            char set[400], want[200];
            snprintf(set, sizeof set, "%s=%s", path, vals[i]);
            const char *sets[] = {set};
            char *d = dump_with(sets, 1);
            if (d) fail_msg("%s accepted", set);
            snprintf(want, sizeof want, "config: %s: expected ", path);
            if (strncmp(bt_last_error(), want, strlen(want))) fail_msg("%s: \"%s\"", set, bt_last_error());
            (*n_checked)++;
        }
    }
}

static void test_range_errors(void **st) {
    (void)st;
    int n = 0;
    check_ranges(bt_config_keys, "", &n);
    assert_true(n >= 50); /* every integer and number key, both ends where the range has two */
}

/* cuda.nf4_matmul, the deprecated alias: the same config as cuda.base_matmul, both refused. */
static void test_alias(void **st) {
    (void)st;
    for (int v = 0; v < 2; v++) {
        char a[64], b[64];
        snprintf(a, sizeof a, "cuda.nf4_matmul=%s", v ? "fused" : "dequant");
        snprintf(b, sizeof b, "cuda.base_matmul=%s", v ? "fused" : "dequant");
        const char *sa[] = {"device=cuda", a}, *sb[] = {"device=cuda", b};
        bt_train_config ca, cb;
        assert_int_equal(bt_config_parse(&ca, MINIMAL, "t", sa, 2), 0);
        assert_int_equal(bt_config_parse(&cb, MINIMAL, "t", sb, 2), 0);
        assert_int_equal(ca.cuda_base_matmul, v ? BT_CUDA_BASE_FUSED : BT_CUDA_BASE_DEQUANT);
        assert_int_equal(ca.cuda_base_matmul, cb.cuda_base_matmul);
        char *da = bt_config_dump(&ca), *db = bt_config_dump(&cb);
        assert_string_equal(da, db);
        assert_null(strstr(da, "nf4_matmul")); /* the dump names the key by its name */
        free(da);
        free(db);
        bt_config_free(&ca);
        bt_config_free(&cb);
    }
    /* the YAML front end too, with the line of the alias in messages */
    const char *y = "model: m.gguf\ndata:\n  shards: [a]\ncuda:\n  nf4_matmul: fast\n";
    bt_train_config c;
    assert_int_equal(bt_config_parse_yaml(&c, y, strlen(y), "j.yaml", NULL, 0), BT_ERR_INVALID);
    assert_string_equal(bt_last_error(), "config: j.yaml:5: cuda.nf4_matmul: expected one of \"dequant\", \"fused\", "
                                         "got \"fast\"");
    const char *both[] = {"cuda.nf4_matmul=fused", "cuda.base_matmul=fused"};
    assert_null(dump_with(both, 2));
    assert_non_null(strstr(bt_last_error(), "cuda.nf4_matmul: give nf4_matmul or base_matmul, not both"));
    assert_int_equal(bt_config_key_used(BT_CMD_ESTIMATE, "cuda.nf4_matmul", &c), 0);
}

/* Custom rows' test values (other_value). */
static const struct {
    const char *path, *value, *also; /* also: a key the value needs ("" none) */
} k_custom[] = {
    {"data.shards", "[\"a/*.jsonl\", \"b.jsonl\"]", ""},
    {"eval.shards", "[\"e.jsonl\"]", ""},
    {"eval.lengths", "[64, 32]", ""},
    {"lora.target_modules", "[\"v_proj\", \"q_proj\"]", ""},
    {"trainable_modules", "[\"norm\"]", ""},
    {"activation_checkpointing", "true", ""},
    {"preference.loss_type", "\"ipo\"", ""},
    {"preference.loss_weights", "[0.5]", ""},
    {"preference.cpo_alpha", "0.25", ""},
};
static const struct {
    const char *path, *also;
} k_needs[] = {
    {"cuda.offload_checkpoints", "activation_checkpointing=true"},
    {"context_extension.method", "context_extension.target_length=32768"},
    {"eval.every", "eval.shards=[\"x/*.jsonl\"]"},
    {"objective", "data.format=\"kto\""}, /* a preference objective needs its data format */
    {"data.format", "objective=\"kto\""},
};

/* A value for row k other than its default (JSON text into buf; *also: a setting it needs). */
static int other_value(const bt_key *k, const char *path, char *buf, size_t n, const char **also) {
    *also = "";
    for (size_t i = 0; i < sizeof k_needs / sizeof k_needs[0]; i++)
        if (!strcmp(path, k_needs[i].path)) *also = k_needs[i].also;
    json_t *def = k->def ? json_loads(k->def, JSON_DECODE_ANY, NULL) : NULL;
    int ok = 1;
    switch (k->type) {
    case BT_KEY_INT: {
        long long lo = k->ilo, d = def ? (long long)json_integer_value(def) : lo;
        snprintf(buf, n, "%lld", d == lo + 1 ? lo + 2 : lo + 1);
        break;
    }
    case BT_KEY_NUM: snprintf(buf, n, "%.17g", isinf(k->nhi) ? k->nlo + 1 : (k->nlo + k->nhi) / 2 + 1e-3); break;
    case BT_KEY_BOOL: snprintf(buf, n, "%s", json_is_true(def) ? "false" : "true"); break;
    case BT_KEY_STR:
    case BT_KEY_ENUM:
        if (k->names) {
            const char *d = def ? json_string_value(def) : NULL, *pick = NULL;
            for (int i = 0; k->names[i]; i++) /* the last name other than the default */
                if (!d || strcmp(d, k->names[i])) pick = k->names[i];
            snprintf(buf, n, "\"%s\"", pick ? pick : "?");
        } else {
            snprintf(buf, n, "\"x/%s\"", k->name);
        }
        break;
    default:
        ok = 0;
        for (size_t i = 0; i < sizeof k_custom / sizeof k_custom[0]; i++)
            if (!strcmp(path, k_custom[i].path)) snprintf(buf, n, "%s", k_custom[i].value), ok = 1;
    }
    json_decref(def);
    return ok;
}

static void round_trip(const bt_key *tab, const char *prefix, const char *base, int *n_keys) {
    for (const bt_key *k = tab; k->name; k++) {
        char path[BT_KEY_PATH_MAX];
        snprintf(path, sizeof path, "%s%s", prefix, k->name);
        if (k->alias) continue;
        if (k->type == BT_KEY_OBJ) {
            char sub[BT_KEY_PATH_MAX + 1];
            snprintf(sub, sizeof sub, "%s.", path);
            round_trip(k->sub, sub, base, n_keys);
            continue;
        }
        char value[160], set[400];
        const char *also;
        if (!other_value(k, path, value, sizeof value, &also)) fail_msg("%s: no test value for this custom row", path);
        snprintf(set, sizeof set, "%s=%s", path, value);
        const char *sets[] = {set, "device=cuda", also};
        char *d1 = dump_with(sets, *also ? 3 : 2);
        if (!d1) fail_msg("%s: %s", set, bt_last_error());
        if (!strcmp(d1, base) && strcmp(path, "device")) fail_msg("%s: the dump does not show it", set);
        bt_train_config c;
        if (bt_config_parse(&c, d1, "dump", NULL, 0)) fail_msg("%s: its dump does not parse: %s", set, bt_last_error());
        char *d2 = bt_config_dump(&c);
        if (strcmp(d1, d2)) fail_msg("%s: dump -> parse -> dump differs:\n%s\n%s", set, d1, d2);
        free(d1);
        free(d2);
        bt_config_free(&c);
        (*n_keys)++;
    }
}

static void test_dump_parse_round_trip(void **st) {
    (void)st;
    const char *dev[] = {"device=cuda"}; /* cuda.* keys are read on device cuda */
    char *base = dump_with(dev, 1);
    assert_non_null(base);
    int n = 0;
    round_trip(bt_config_keys, "", base, &n);
    assert_true(n >= 55);
    free(base);
}

int main(void) {
    bt_log_set_level(BT_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_defaults_and_unknown_keys),
        cmocka_unit_test(test_range_errors),
        cmocka_unit_test(test_alias),
        cmocka_unit_test(test_dump_parse_round_trip),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
