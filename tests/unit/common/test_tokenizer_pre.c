/* The dedicated pre-tokenizers (common/tokenizer_pre.c) against the PCRE2 path they replace, on
 * an adversarial Unicode corpus generated here (deterministic): every ASCII byte, every kind of
 * whitespace (\p{Z}, \t \n \v \f \r, U+0085, and look-alikes that are not \s: U+180E, U+200B,
 * U+FEFF), apostrophes with contraction letters in every case plus U+017F LONG S and U+212A
 * KELVIN SIGN, digits of every numeric category (Nd Nl No, scripts, fullwidth, mathematical,
 * Unicode 15 additions that PCRE2 10.42 and utf8proc classify differently), letters of many
 * scripts and combining marks, CJK, Hangul, emoji sequences, private use, unassigned and
 * noncharacter code points, CR/LF runs, long whitespace runs, and random code points from all
 * planes; invalid UTF-8 bytes for the full-pipeline comparison.
 * For the GPT-2, SmolLM2 (Digits + GPT-2, from the GGUF and from tokenizer.json), Llama 3 and
 * Qwen2 pipelines: the pieces (bt_tok_pieces) and the ids (bt_tokenize, with and without
 * special-token parsing) must be identical with both engines. Also checks the one assumption
 * the Llama 3 / Qwen2 scanner makes about PCRE2 caseless matching, the engine selection, and
 * that the piece cache gives the same ids across threads and tokenizers. Run from the repo root
 * (BT_MODEL: the SmolLM2 GGUF). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "common/tokenizer.h"
#include "common/tokenizer_internal.h"
#include "tests/unit/util/test_util.h"

#define FIX "tests/fixtures/tokenizer/"
#define N_DOCS 3000

typedef struct {
    char *p;
    size_t n;
    int valid; /* valid UTF-8 (pieces are compared on these) */
} doc_t;

static doc_t g_docs[N_DOCS];

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void) { /* xorshift64* */
    g_rng ^= g_rng >> 12;
    g_rng ^= g_rng << 25;
    g_rng ^= g_rng >> 27;
    return g_rng * 0x2545F4914F6CDD1Dull;
}
static uint32_t below(uint32_t n) { return (uint32_t)(rnd() % n); }

static void put_cp(tu_sbuf *b, uint32_t cp) {
    char u[4];
    size_t n;
    if (cp < 0x80) { u[0] = (char)cp; n = 1; }
    else if (cp < 0x800) { u[0] = (char)(0xC0 | cp >> 6); u[1] = (char)(0x80 | (cp & 0x3F)); n = 2; }
    else if (cp < 0x10000) {
        u[0] = (char)(0xE0 | cp >> 12); u[1] = (char)(0x80 | ((cp >> 6) & 0x3F)); u[2] = (char)(0x80 | (cp & 0x3F));
        n = 3;
    } else {
        u[0] = (char)(0xF0 | cp >> 18); u[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
        u[2] = (char)(0x80 | ((cp >> 6) & 0x3F)); u[3] = (char)(0x80 | (cp & 0x3F));
        n = 4;
    }
    tu_sb_add(b, u, n);
}

static const uint32_t WS[] = {' ', '\t', '\n', 0x0B, 0x0C, '\r', 0x85, 0xA0, 0x1680, 0x2000, 0x2001, 0x2002, 0x2003,
                              0x2004, 0x2005, 0x2006, 0x2007, 0x2008, 0x2009, 0x200A, 0x2028, 0x2029, 0x202F,
                              0x205F, 0x3000, 0x180E, 0x200B, 0xFEFF, 0x1C, 0x1F};
static const uint32_t APOS[] = {'\'', 's', 'S', 't', 'T', 'r', 'R', 'e', 'E', 'v', 'V', 'm', 'M', 'l', 'L', 'd', 'D',
                                0x17F, 0x212A, 'k', 0x2019, 0xFF07, 0x2BC, 'x', '\''};
static const uint32_t DIGITS[] = {'0', '1', '7', '9', 0x660, 0x669, 0x6F5, 0x966, 0xFF10, 0xFF19, 0x2160, 0x2188,
                                  0x3007, 0x16EE, 0xB2, 0xB3, 0xB9, 0xBD, 0x2070, 0x2460, 0x1D7CE, 0x1D7FF,
                                  0x11F50, 0x11F59, 0x1D2C0, 0x1D2D3, 0x1FBF0, 0x10107, 0x12400, 0xF2C, 0x2CFD};
static const uint32_t LETTERS[] = {'a', 'z', 'A', 'Q', 0xC0, 0xE9, 0xFF, 0x130, 0x131, 0x3B1, 0x416, 0x5E9, 0x627,
                                   0x928, 0xE2A, 0x10D0, 0x1100, 0xAC00, 0x4E00, 0x9FFF, 0x3042, 0x30AB, 0x1E900,
                                   0x2BC, 0x2B0, 0x1E030, 0x11F04, 0x31350, 0x1DF25, 0x16F00, 0x10400, 0x20000, 0xAA,
                                   0xBA, 0x1E9B, 0xFB01, 0x2C00, 0xA7C0};
static const uint32_t MARKS[] = {0x300, 0x301, 0x36F, 0x951, 0xE31, 0x20D0, 0x200D, 0xFE0F, 0x1F3FB, 0x302A, 0x1AB0,
                                 0x1DFF, 0x0E47, 0x093C};
static const uint32_t OTHER[] = {'.', ',', '!', '?', '(', ')', '[', '$', '_', '-', '@', '#', '<', '>', '|', '/',
                                 '\\', '"', '`', '~', 0x00, 0x01, 0x7F, 0xAD, 0xA9, 0x2013, 0x201C, 0x20AC, 0x2603,
                                 0x1F600, 0x1F468, 0x1F1EF, 0xFFFD, 0xE000, 0xF0000, 0x378, 0x2FFFF, 0x10FFFF,
                                 0xFFFE, 0xFFFF, 0xE0001, 0x3002, 0xFF0C, 0x60C};

#define PICK(a) (a)[below(sizeof(a) / sizeof((a)[0]))]

static void make_doc(doc_t *d, int i) {
    tu_sbuf b = {0};
    int parts = 1 + (int)below(i % 10 == 0 ? 400 : 60);
    for (int k = 0; k < parts; k++) {
        uint32_t r = below(100), rep = 1 + below(4);
        for (uint32_t q = 0; q < rep; q++) {
            if (r < 18) put_cp(&b, PICK(WS));
            else if (r < 30) put_cp(&b, PICK(APOS));
            else if (r < 42) put_cp(&b, PICK(DIGITS));
            else if (r < 62) put_cp(&b, PICK(LETTERS));
            else if (r < 68) put_cp(&b, PICK(MARKS));
            else if (r < 80) put_cp(&b, PICK(OTHER));
            else if (r < 86) put_cp(&b, below(128));
            else if (r < 90) tu_sb_str(&b, below(2) ? "\r\n" : "\n\n \n");
            else if (r < 93) { /* a long whitespace run ending in various ways */
                uint32_t n = 2 + below(40), w = PICK(WS);
                for (uint32_t z = 0; z < n; z++) put_cp(&b, below(4) ? ' ' : w);
            } else { /* any scalar value, any plane */
                uint32_t cp;
                do cp = below(4) ? below(0x30000) : below(0x110000);
                while (cp >= 0xD800 && cp <= 0xDFFF);
                put_cp(&b, cp);
            }
        }
    }
    d->valid = 1;
    if (i % 7 == 3 && b.n) { /* invalid UTF-8 in the middle (full-pipeline comparison only) */
        static const char *const bad[] = {"\xff", "\x80", "\xc3", "\xe2\x82", "\xf0\x9f\x98", "\xed\xa0\x80",
                                          "\xc0\x80", "\xfe"};
        size_t at = below((uint32_t)b.n);
        tu_sbuf c = {0};
        tu_sb_add(&c, b.p, at);
        tu_sb_str(&c, bad[below(8)]);
        tu_sb_add(&c, b.p + at, b.n - at);
        free(b.p);
        b = c;
        d->valid = 0;
    }
    if (!b.p) tu_sb_add(&b, "", 0);
    d->p = b.p;
    d->n = b.n;
}

static int setup(void **state) {
    (void)state;
    for (int i = 0; i < N_DOCS; i++) make_doc(&g_docs[i], i);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    for (int i = 0; i < N_DOCS; i++) free(g_docs[i].p);
    return 0;
}

static bt_tokenizer *load(const char *path) {
    bt_tokenizer *t = NULL;
    if (bt_tokenizer_load(&t, path) < 0) fail_msg("load %s: %s", path, bt_last_error());
    return t;
}

/* The SmolLM2 tokenizer.json with another pre_tokenizer (JSON text). */
static bt_tokenizer *smollm2_with_pre(const char *pre_json) {
    size_t len;
    char *js = tu_read_zst(FIX "smollm2-tokenizer.json.zst", &len);
    json_error_t err;
    json_t *root = json_loadb(js, len, 0, &err), *pre = json_loads(pre_json, 0, &err);
    assert_non_null(root);
    assert_non_null(pre);
    json_object_set_new(root, "pre_tokenizer", pre);
    char *text = json_dumps(root, JSON_COMPACT);
    bt_tokenizer *t = NULL;
    if (bt_tokenizer_from_json(&t, text, strlen(text), NULL, 0) < 0) fail_msg("from_json: %s", bt_last_error());
    free(text);
    json_decref(root);
    free(js);
    return t;
}

/* Pieces and ids of every document with both engines; returns the number of differences. */
static size_t compare_engines(const char *name, bt_tokenizer *t) {
    size_t bad = 0, pieces = 0;
    bt_ids a = {0}, b = {0};
    for (int i = 0; i < N_DOCS; i++) {
        const doc_t *d = &g_docs[i];
        if (d->valid) {
            a.n = b.n = 0;
            assert_int_equal(bt_tokenizer_set_pre_engine(t, 1), 0);
            assert_int_equal(bt_tok_pieces(t, d->p, d->n, &a), 0);
            assert_int_equal(bt_tokenizer_set_pre_engine(t, 0), 0);
            assert_int_equal(bt_tok_pieces(t, d->p, d->n, &b), 0);
            pieces += a.n;
            if (a.n != b.n || memcmp(a.v, b.v, a.n * sizeof *a.v) != 0) {
                if (bad < 5) {
                    size_t k = 0, off = 0;
                    while (k < a.n && k < b.n && a.v[k] == b.v[k]) off += (size_t)a.v[k++];
                    fprintf(stderr, "%s: doc %d: pieces differ at byte %zu (dedicated %d, pcre2 %d bytes): ", name, i,
                            off, k < a.n ? a.v[k] : -1, k < b.n ? b.v[k] : -1);
                    for (size_t z = off; z < d->n && z < off + 24; z++) fprintf(stderr, "%02x ", (uint8_t)d->p[z]);
                    fprintf(stderr, "\n");
                }
                bad++;
            }
        }
        for (int special = 0; special < 2; special++) {
            a.n = b.n = 0;
            assert_int_equal(bt_tokenizer_set_pre_engine(t, 1), 0);
            assert_int_equal(bt_tokenize(t, d->p, d->n, special, &a), 0);
            assert_int_equal(bt_tokenizer_set_pre_engine(t, 0), 0);
            assert_int_equal(bt_tokenize(t, d->p, d->n, special, &b), 0);
            if (a.n != b.n || memcmp(a.v, b.v, a.n * sizeof *a.v) != 0) {
                if (bad < 5) fprintf(stderr, "%s: doc %d (special %d): ids differ\n", name, i, special);
                bad++;
            }
        }
    }
    assert_int_equal(bt_tokenizer_set_pre_engine(t, 1), 0);
    fprintf(stderr, "%s: %d documents, %zu pieces, %zu differences\n", name, N_DOCS, pieces, bad);
    assert_true(pieces > 100000);
    bt_ids_free(&a);
    bt_ids_free(&b);
    return bad;
}

static void test_smollm2_gguf(void **state) {
    (void)state;
    bt_tokenizer *t = load(tu_model_path());
    assert_string_equal(bt_tokenizer_pre_engine(t), "smollm");
    assert_int_equal(compare_engines("smollm2/gguf", t), 0);
    bt_tokenizer_free(t);
}

static void test_smollm2_json(void **state) {
    (void)state;
    bt_tokenizer *t = load(FIX "smollm2-tokenizer.json.zst");
    assert_string_equal(bt_tokenizer_pre_engine(t), "smollm");
    assert_int_equal(compare_engines("smollm2/json", t), 0);
    bt_tokenizer_free(t);
}

static void test_gpt2(void **state) {
    (void)state;
    bt_tokenizer *t = smollm2_with_pre("{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"trim_offsets\":true,"
                                       "\"use_regex\":true}");
    assert_string_equal(bt_tokenizer_pre_engine(t), "gpt2");
    assert_int_equal(compare_engines("gpt2", t), 0);
    bt_tokenizer_free(t);
    /* the same pattern as an explicit Split */
    char pre[512];
    snprintf(pre, sizeof pre, "{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Split\",\"pattern\":{\"Regex\":\"%s\"},"
             "\"behavior\":\"Isolated\",\"invert\":false},{\"type\":\"ByteLevel\",\"add_prefix_space\":false,"
             "\"use_regex\":false}]}", "'s|'t|'re|'ve|'m|'ll|'d| ?\\\\p{L}+| ?\\\\p{N}+| ?[^\\\\s\\\\p{L}\\\\p{N}]+|\\\\s+(?!\\\\S)|\\\\s+");
    t = smollm2_with_pre(pre);
    assert_string_equal(bt_tokenizer_pre_engine(t), "gpt2");
    assert_int_equal(compare_engines("gpt2/split", t), 0);
    bt_tokenizer_free(t);
}

static void test_llama3(void **state) {
    (void)state;
    bt_tokenizer *t = load(FIX "llama3-tokenizer.json.zst");
    assert_string_equal(bt_tokenizer_pre_engine(t), "llama3");
    assert_int_equal(compare_engines("llama3", t), 0);
    bt_tokenizer_free(t);
}

static void test_qwen2(void **state) {
    (void)state;
    bt_tokenizer *t = load(FIX "qwen2-tokenizer.json.zst");
    assert_string_equal(bt_tokenizer_pre_engine(t), "qwen2");
    assert_int_equal(compare_engines("qwen2", t), 0);
    bt_tokenizer_free(t);
}

/* Pipelines without a dedicated scanner stay on PCRE2 and refuse to switch. */
static void test_other_pipelines(void **state) {
    (void)state;
    const char *pres[] = {
        "{\"type\":\"ByteLevel\",\"add_prefix_space\":true,\"use_regex\":true}",
        "{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Digits\",\"individual_digits\":false},"
        "{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"use_regex\":true}]}",
        "{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Split\",\"pattern\":{\"Regex\":\"\\\\p{N}{1,3}\"},"
        "\"behavior\":\"Isolated\",\"invert\":false},{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"use_regex\":false}]}",
    };
    for (size_t i = 0; i < sizeof pres / sizeof pres[0]; i++) {
        bt_tokenizer *t = smollm2_with_pre(pres[i]);
        assert_string_equal(bt_tokenizer_pre_engine(t), "pcre2");
        assert_int_equal(bt_tokenizer_set_pre_engine(t, 1), BT_ERR_UNSUPPORTED);
        assert_int_equal(bt_tokenizer_set_pre_engine(t, 0), 0);
        bt_tokenizer_free(t);
    }
    assert_int_equal(bt_tokenizer_set_pre_engine(NULL, 1), BT_ERR_INVALID);
}

/* PCRE2 UCP caseless matching of the contraction letters: exactly the ASCII pairs, plus U+017F
 * LONG S for s (what l3_piece's fold_at implements). Checked over every code point. */
static void test_caseless_letters(void **state) {
    (void)state;
    tu_sbuf all = {0};
    for (uint32_t cp = 1; cp < 0x110000; cp++)
        if (cp < 0xD800 || cp > 0xDFFF) put_cp(&all, cp);
    int err;
    PCRE2_SIZE eoff;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR) "(?i:[stervmld])", PCRE2_ZERO_TERMINATED,
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE, &err, &eoff, NULL);
    assert_non_null(re);
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(re, NULL);
    size_t off = 0, n = 0;
    char got[64];
    while (pcre2_match(re, (PCRE2_SPTR)all.p, all.n, off, PCRE2_NO_UTF_CHECK, md, NULL) > 0) {
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        size_t l = ov[1] - ov[0];
        if (l == 1) got[n < 63 ? n : 63] = all.p[ov[0]];
        else if (l == 2 && (uint8_t)all.p[ov[0]] == 0xC5 && (uint8_t)all.p[ov[0] + 1] == 0xBF) got[n < 63 ? n : 63] = '*';
        else fail_msg("unexpected caseless match of %zu bytes at %zu", l, (size_t)ov[0]);
        n++;
        off = ov[1];
    }
    got[n < 63 ? n : 63] = 0;
    assert_string_equal(got, "DELMRSTVdelmrstv*");
    pcre2_match_data_free(md);
    pcre2_code_free(re);
    free(all.p);
}

/* Several threads, two tokenizers each, alternating per document: the per-thread piece cache
 * must never hand one tokenizer's ids to the other. */
typedef struct {
    bt_tokenizer *t[2];
    bt_ids *want[2];
    size_t bad;
} thr_arg;

static void *thr_main(void *p) {
    thr_arg *a = p;
    bt_ids got = {0};
    for (int rep = 0; rep < 2; rep++)
        for (int i = 0; i < N_DOCS; i += 3)
            for (int k = 0; k < 2; k++) {
                got.n = 0;
                if (bt_tokenize(a->t[k], g_docs[i].p, g_docs[i].n, 0, &got) != 0 || got.n != a->want[k][i].n ||
                    memcmp(got.v, a->want[k][i].v, got.n * sizeof *got.v) != 0)
                    a->bad++;
            }
    bt_ids_free(&got);
    bt_tokenize_release_cache();
    return NULL;
}

static void test_cache_threads(void **state) {
    (void)state;
    thr_arg a = {{load(tu_model_path()), load(FIX "llama3-tokenizer.json.zst")}, {NULL, NULL}, 0};
    for (int k = 0; k < 2; k++) {
        a.want[k] = calloc(N_DOCS, sizeof *a.want[k]);
        for (int i = 0; i < N_DOCS; i += 3) {
            bt_tokenize_release_cache(); /* reference ids computed without any cached piece */
            assert_int_equal(bt_tokenize(a.t[k], g_docs[i].p, g_docs[i].n, 0, &a.want[k][i]), 0);
        }
    }
    pthread_t th[3];
    thr_arg args[3] = {a, a, a};
    for (int i = 0; i < 3; i++) assert_int_equal(pthread_create(&th[i], NULL, thr_main, &args[i]), 0);
    for (int i = 0; i < 3; i++) {
        pthread_join(th[i], NULL);
        assert_int_equal(args[i].bad, 0);
    }
    for (int k = 0; k < 2; k++) {
        for (int i = 0; i < N_DOCS; i++) bt_ids_free(&a.want[k][i]);
        free(a.want[k]);
        bt_tokenizer_free(a.t[k]);
    }
    bt_tokenize_release_cache();
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_caseless_letters),
        cmocka_unit_test(test_other_pipelines),
        cmocka_unit_test(test_smollm2_gguf),
        cmocka_unit_test(test_smollm2_json),
        cmocka_unit_test(test_gpt2),
        cmocka_unit_test(test_llama3),
        cmocka_unit_test(test_qwen2),
        cmocka_unit_test(test_cache_threads),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
