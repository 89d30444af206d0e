/* Parity of common/tokenizer*.c with Hugging Face tokenizers 0.20.3 on tokenizer.json files of
 * three families (fixtures: tests/reference/gen_tokenizer_fixtures.py):
 *   smollm2  SmolLM2's tokenizer (Digits + GPT-2 ByteLevel regex), also through the GGUF path
 *   llama3   Llama-3 pipeline (Split cl100k, ByteLevel no regex, ignore_merges), trained BPE
 *   qwen2    Qwen2.5 pipeline (NFC, Split single digits, special + non-special added tokens)
 *   qwen2x   qwen2 plus added tokens with lstrip/rstrip/single_word/normalized flags
 * on a >= 1 MB mixed corpus (corpus.bin.zst): ids must match exactly (0 mismatches), with the
 * dedicated pre-tokenizer and with the PCRE2 one, and the decode of the reference ids must
 * equal HF's decode (FNV-1a-64 of the bytes). variants.jsonl
 * covers every Split behaviour, inversion, String patterns, Digits, ByteLevel options, regex
 * constructs whose Oniguruma meaning differs from PCRE2, and NFD/NFKC/NFKD.
 * Run from the repo root (BT_MODEL: the SmolLM2 GGUF). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zstd.h>

#include "common/bt_common.h"
#include "common/bt_le.h"
#include "common/tokenizer.h"
#include "tests/unit/util/test_util.h"

#define FIX "tests/fixtures/tokenizer/"

typedef struct {
    const uint8_t *text;
    size_t len;
    int special;
} doc_t;

typedef struct {
    uint8_t *buf; /* decompressed corpus */
    size_t n;
    doc_t *docs;
} corpus_t;

static void load_corpus(corpus_t *c, const char *path) {
    size_t len;
    c->buf = (uint8_t *)tu_read_zst(path, &len);
    assert_true(len >= 12 && memcmp(c->buf, "BTTKCORP", 8) == 0);
    c->n = bt_get32(c->buf + 8);
    c->docs = calloc(c->n + 1, sizeof *c->docs);
    size_t off = 12;
    for (size_t i = 0; i < c->n; i++) {
        assert_true(off + 5 <= len);
        c->docs[i].special = c->buf[off] & 1;
        c->docs[i].len = bt_get32(c->buf + off + 1);
        off += 5;
        assert_true(off + c->docs[i].len <= len);
        c->docs[i].text = c->buf + off;
        off += c->docs[i].len;
    }
    assert_int_equal(off, len);
}

static void free_corpus(corpus_t *c) {
    free(c->buf);
    free(c->docs);
}

static uint64_t varint(const uint8_t *p, size_t len, size_t *off) {
    uint64_t v = 0;
    for (int sh = 0; sh < 64; sh += 7) {
        assert_true(*off < len);
        uint8_t b = p[(*off)++];
        v |= (uint64_t)(b & 0x7F) << sh;
        if (!(b & 0x80)) return v;
    }
    fail_msg("bad varint");
    return 0;
}

/* Rust String::from_utf8_lossy / Python errors="replace": U+FFFD per maximal invalid subpart
 * (Unicode Table 3-7 ranges). HF's ByteLevel decoder applies it to the decoded bytes. */
static size_t utf8_lossy(const uint8_t *s, size_t n, uint8_t *d) {
    size_t i = 0, o = 0;
    while (i < n) {
        uint8_t c = s[i];
        int len = 0;
        uint8_t lo = 0x80, hi = 0xBF;
        if (c < 0x80) len = 1;
        else if (c >= 0xC2 && c <= 0xDF) len = 2;
        else if (c == 0xE0) { len = 3; lo = 0xA0; }
        else if (c == 0xED) { len = 3; hi = 0x9F; }
        else if (c >= 0xE1 && c <= 0xEF) len = 3;
        else if (c == 0xF0) { len = 4; lo = 0x90; }
        else if (c == 0xF4) { len = 4; hi = 0x8F; }
        else if (c >= 0xF1 && c <= 0xF3) len = 4;
        int k = 1;
        for (; k < len; k++) {
            if (i + (size_t)k >= n) break;
            uint8_t b = s[i + (size_t)k];
            if (b < (k == 1 ? lo : 0x80) || b > (k == 1 ? hi : 0xBF)) break;
        }
        if (len && k == len) {
            memcpy(d + o, s + i, (size_t)len);
            o += (size_t)len;
            i += (size_t)len;
        } else {
            d[o++] = 0xEF; d[o++] = 0xBF; d[o++] = 0xBD;
            i += (size_t)(len ? k : 1);
        }
    }
    return o;
}

static void print_ids(const char *label, const int32_t *v, size_t n) {
    fprintf(stderr, "  %s (%zu):", label, n);
    for (size_t i = 0; i < n && i < 30; i++) fprintf(stderr, " %d", v[i]);
    fprintf(stderr, "%s\n", n > 30 ? " ..." : "");
}

/* Compares ids and decodes of every document; returns mismatches (ids + decode). */
static size_t check_family(const char *name, const bt_tokenizer *t, const corpus_t *c, const char *ids_path,
                           size_t *n_tokens) {
    size_t len;
    uint8_t *p = (uint8_t *)tu_read_zst(ids_path, &len);
    assert_true(len >= 12 && memcmp(p, "BTTKIDS1", 8) == 0);
    assert_int_equal(bt_get32(p + 8), c->n);
    size_t off = 12, bad = 0, dbad = 0, ntok = 0;
    bt_ids got = {0};
    int32_t *want = NULL;
    size_t want_cap = 0;
    for (size_t i = 0; i < c->n; i++) {
        assert_true(off + 8 <= len);
        uint64_t h = bt_get64(p + off);
        off += 8;
        size_t n = (size_t)varint(p, len, &off);
        if (n > want_cap) {
            want_cap = n * 2;
            want = realloc(want, want_cap * sizeof *want);
        }
        for (size_t k = 0; k < n; k++) want[k] = (int32_t)varint(p, len, &off);
        ntok += n;
        got.n = 0;
        int rc = bt_tokenize(t, (const char *)c->docs[i].text, c->docs[i].len, c->docs[i].special, &got);
        if (rc != 0 || got.n != n || (n && memcmp(got.v, want, n * sizeof *want) != 0)) {
            if (bad < 5) {
                size_t k = 0;
                while (k < n && k < got.n && got.v[k] == want[k]) k++;
                fprintf(stderr, "%s: mismatch doc %zu (special=%d rc=%d) at id %zu: \"%.60s\"\n", name, i,
                        c->docs[i].special, rc, k, (const char *)c->docs[i].text);
                print_ids("want", want + (k > 3 ? k - 3 : 0), n - (k > 3 ? k - 3 : 0));
                print_ids("got ", got.v + (k > 3 ? k - 3 : 0), got.n > k - (k > 3 ? 3 : 0) ? got.n - (k > 3 ? k - 3 : 0) : 0);
            }
            bad++;
        }
        char *s = NULL;
        size_t sl = 0;
        assert_int_equal(bt_detokenize(t, want, n, 1, &s, &sl), 0);
        uint8_t *lossy = malloc(sl * 3 + 1);
        size_t ll = utf8_lossy((const uint8_t *)s, sl, lossy);
        uint64_t got_h = bt_fnv1a64(BT_FNV64_INIT, lossy, ll);
        free(lossy);
        if (got_h != h) {
            if (dbad < 3) fprintf(stderr, "%s: decode mismatch doc %zu: \"%.60s\"\n", name, i, s);
            dbad++;
        }
        free(s);
    }
    assert_int_equal(off, len);
    fprintf(stderr, "%s: %zu documents, %zu tokens, %zu id mismatches, %zu decode mismatches\n", name, c->n, ntok, bad,
            dbad);
    bt_ids_free(&got);
    free(want);
    free(p);
    if (n_tokens) *n_tokens = ntok;
    return bad + dbad;
}

/* check_family with the dedicated pre-tokenizer (which must be `engine`), then again with the
 * PCRE2 one: both must reproduce HF exactly. */
static size_t check_engines(const char *name, bt_tokenizer *t, const corpus_t *c, const char *ids_path,
                            size_t *n_tokens, const char *engine) {
    assert_string_equal(bt_tokenizer_pre_engine(t), engine);
    size_t bad = check_family(name, t, c, ids_path, n_tokens);
    assert_int_equal(bt_tokenizer_set_pre_engine(t, 0), 0);
    assert_string_equal(bt_tokenizer_pre_engine(t), "pcre2");
    char label[64];
    snprintf(label, sizeof label, "%s/pcre2", name);
    bad += check_family(label, t, c, ids_path, NULL);
    assert_int_equal(bt_tokenizer_set_pre_engine(t, 1), 0);
    return bad;
}

static corpus_t g_corpus;

static int setup(void **state) {
    (void)state;
    load_corpus(&g_corpus, FIX "corpus.bin.zst");
    return 0;
}

static int teardown(void **state) {
    (void)state;
    free_corpus(&g_corpus);
    return 0;
}

static bt_tokenizer *load(const char *path) {
    bt_tokenizer *t = NULL;
    int rc = bt_tokenizer_load(&t, path);
    if (rc < 0) fail_msg("load %s: %s", path, bt_last_error());
    return t;
}

static void test_corpus_size(void **state) {
    (void)state;
    size_t total = 0, special = 0;
    for (size_t i = 0; i < g_corpus.n; i++) {
        total += g_corpus.docs[i].len;
        special += (size_t)g_corpus.docs[i].special;
    }
    assert_true(total >= 1000000);
    assert_true(special > 0 && special < g_corpus.n);
}

static void test_smollm2_json(void **state) {
    (void)state;
    bt_tokenizer *t = load(FIX "smollm2-tokenizer.json.zst");
    assert_string_equal(bt_tokenizer_pre(t), "smollm");
    assert_int_equal(bt_tokenizer_vocab_size(t), 49152);
    assert_int_equal(bt_tokenizer_find(t, "<|im_start|>"), 1);
    assert_int_equal(bt_tokenizer_token_type(t, 1), 3);
    assert_int_equal(bt_tokenizer_token_type(t, 100), 1);
    assert_int_equal(check_engines("smollm2/json", t, &g_corpus, FIX "smollm2_ids.bin.zst", NULL, "smollm"), 0);
    bt_tokenizer_free(t);
}

static void test_smollm2_gguf(void **state) {
    (void)state;
    const char *m = getenv("BT_MODEL");
    bt_tokenizer *t = load(m && *m ? m : "models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert_int_equal(check_engines("smollm2/gguf", t, &g_corpus, FIX "smollm2_ids.bin.zst", NULL, "smollm"), 0);
    bt_tokenizer_free(t);
}

static void test_llama3(void **state) {
    (void)state;
    bt_tokenizer *t = load(FIX "llama3-tokenizer.json.zst");
    assert_string_equal(bt_tokenizer_pre(t), "llama3");
    int32_t bot = bt_tokenizer_find(t, "<|begin_of_text|>");
    assert_true(bot >= 6000);
    assert_int_equal(bt_tokenizer_bos(t), bot); /* from the TemplateProcessing post-processor */
    assert_int_equal(bt_tokenizer_eos(t), -1);
    assert_int_equal(bt_tokenizer_token_type(t, bot), 3);
    size_t ntok = 0;
    assert_int_equal(check_engines("llama3", t, &g_corpus, FIX "llama3_ids.bin.zst", &ntok, "llama3"), 0);
    assert_true(ntok > 100000);
    bt_tokenizer_free(t);
}

static void test_qwen2(void **state) {
    (void)state;
    bt_tokenizer *t = load(FIX "qwen2-tokenizer.json.zst");
    assert_string_equal(bt_tokenizer_pre(t), "qwen2");
    int32_t tc = bt_tokenizer_find(t, "<tool_call>");
    assert_true(tc >= 6000);
    assert_int_equal(bt_tokenizer_token_type(t, tc), 4);
    assert_int_equal(bt_tokenizer_token_type(t, bt_tokenizer_find(t, "<|im_end|>")), 3);
    /* non-special added tokens are matched without parse_special, special ones are not */
    bt_ids ids = {0};
    assert_int_equal(bt_tokenize(t, "<tool_call><|im_end|>", 21, 0, &ids), 0);
    assert_true(ids.n > 2);
    assert_int_equal(ids.v[0], tc);
    ids.n = 0;
    assert_int_equal(bt_tokenize(t, "<tool_call><|im_end|>", 21, 1, &ids), 0);
    assert_int_equal(ids.n, 2);
    /* NFC: decomposed e + U+0301 encodes as the composed form */
    bt_ids a = {0};
    ids.n = 0;
    assert_int_equal(bt_tokenize(t, "caf\xc3\xa9", 5, 0, &ids), 0);
    assert_int_equal(bt_tokenize(t, "cafe\xcc\x81", 6, 0, &a), 0);
    assert_int_equal(a.n, ids.n);
    assert_memory_equal(a.v, ids.v, ids.n * sizeof *ids.v);
    bt_ids_free(&a);
    bt_ids_free(&ids);
    assert_int_equal(check_engines("qwen2", t, &g_corpus, FIX "qwen2_ids.bin.zst", NULL, "qwen2"), 0);
    bt_tokenizer_free(t);
}

static void test_qwen2x_flags(void **state) {
    (void)state;
    corpus_t c = {0};
    load_corpus(&c, FIX "qwen2x_corpus.bin.zst");
    bt_tokenizer *t = load(FIX "qwen2x-tokenizer.json.zst");
    assert_string_equal(bt_tokenizer_pre(t), "qwen2");
    assert_int_equal(check_engines("qwen2x", t, &c, FIX "qwen2x_ids.bin.zst", NULL, "qwen2"), 0);
    bt_tokenizer_free(t);
    free_corpus(&c);
}

static void test_variants(void **state) {
    (void)state;
    size_t blen;
    char *base = tu_read_zst(FIX "qwen2-tokenizer.json.zst", &blen);
    json_error_t err;
    json_t *root = json_loadb(base, blen, 0, &err);
    assert_non_null(root);
    free(base);
    FILE *f = fopen(FIX "variants.jsonl", "r");
    assert_non_null(f);
    char *line = NULL;
    size_t cap = 0;
    int n_var = 0;
    size_t bad = 0;
    bt_ids ids = {0};
    while (getline(&line, &cap, f) > 0) {
        json_t *v = json_loads(line, 0, &err);
        assert_non_null(v);
        json_object_set(root, "normalizer", json_object_get(v, "normalizer"));
        json_object_set(root, "pre_tokenizer", json_object_get(v, "pre_tokenizer"));
        json_object_set(json_object_get(root, "model"), "ignore_merges", json_object_get(v, "ignore_merges"));
        char *js = json_dumps(root, JSON_COMPACT);
        bt_tokenizer *t = NULL;
        const char *name = json_string_value(json_object_get(v, "name"));
        if (bt_tokenizer_from_json(&t, js, strlen(js), NULL, 0) < 0) fail_msg("variant %s: %s", name, bt_last_error());
        free(js);
        json_t *cases = json_object_get(v, "cases");
        for (size_t i = 0; i < json_array_size(cases); i++) {
            json_t *cs = json_array_get(cases, i), *want = json_object_get(cs, "ids");
            json_t *text = json_object_get(cs, "text");
            ids.n = 0;
            assert_int_equal(bt_tokenize(t, json_string_value(text), json_string_length(text), 1, &ids), 0);
            int ok = ids.n == json_array_size(want);
            for (size_t k = 0; ok && k < ids.n; k++) ok = ids.v[k] == json_integer_value(json_array_get(want, k));
            if (!ok) {
                fprintf(stderr, "variant %s: mismatch on \"%s\"\n", name, json_string_value(text));
                print_ids("got ", ids.v, ids.n);
                bad++;
            }
        }
        bt_tokenizer_free(t);
        json_decref(v);
        n_var++;
    }
    free(line);
    fclose(f);
    json_decref(root);
    bt_ids_free(&ids);
    fprintf(stderr, "variants: %d pipelines, %zu mismatching cases\n", n_var, bad);
    assert_true(n_var >= 30);
    assert_int_equal(bad, 0);
}

/* ---- hand-written tokenizer.json files ---- */

/* Tiny byte-level BPE: the 256-char alphabet, "ab" (merge "a b" or ["a","b"]), "abc". */
static char *tiny_json(const char *merges, const char *pre, const char *extra) {
    char *buf = malloc(1 << 16);
    size_t o = 0;
    o += (size_t)sprintf(buf + o, "{\"version\":\"1.0\",%s\"model\":{\"type\":\"BPE\",\"dropout\":null,\"unk_token\":null,"
                                  "\"continuing_subword_prefix\":\"\",\"end_of_word_suffix\":\"\",\"fuse_unk\":false,"
                                  "\"byte_fallback\":false,\"vocab\":{",
                         extra);
    uint32_t n = 0;
    for (int b = 0; b < 256; b++) {
        int keep = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
        uint32_t cp = keep ? (uint32_t)b : 256 + n++;
        if (cp == '"' || cp == '\\') o += (size_t)sprintf(buf + o, "\"\\%c\":%d,", (char)cp, b);
        else o += (size_t)sprintf(buf + o, "\"\\u%04x\":%d,", cp, b);
    }
    o += (size_t)sprintf(buf + o, "\"ab\":256,\"abc\":257},\"merges\":%s},\"pre_tokenizer\":%s,"
                                  "\"decoder\":{\"type\":\"ByteLevel\"}}",
                         merges, pre);
    return buf;
}

#define BL "{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"use_regex\":true}"

static void expect_json(const char *js, int want_rc, const char *msg_part) {
    bt_tokenizer *t = (bt_tokenizer *)1;
    int rc = bt_tokenizer_from_json(&t, js, strlen(js), NULL, 0);
    if (rc != want_rc) fail_msg("rc %d, want %d (%s) for %.200s", rc, want_rc, bt_last_error(), js);
    assert_null(t);
    if (msg_part && !strstr(bt_last_error(), msg_part)) fail_msg("error \"%s\" lacks \"%s\"", bt_last_error(), msg_part);
}

static void test_json_handmade(void **state) {
    (void)state;
    const char *forms[] = {"[\"a b\",\"ab c\"]", "[[\"a\",\"b\"],[\"ab\",\"c\"]]"};
    for (int k = 0; k < 2; k++) {
        char *js = tiny_json(forms[k], BL, "\"added_tokens\":[{\"id\":258,\"content\":\"<s>\",\"special\":true}],");
        bt_tokenizer *t = NULL;
        const char *cfg = "{\"bos_token\":{\"content\":\"<s>\"},\"eos_token\":\"<s>\",\"chat_template\":\"T\"}";
        if (bt_tokenizer_from_json(&t, js, strlen(js), cfg, strlen(cfg)) < 0) fail_msg("%s", bt_last_error());
        free(js);
        assert_int_equal(bt_tokenizer_vocab_size(t), 259);
        assert_string_equal(bt_tokenizer_pre(t), "gpt2");
        assert_int_equal(bt_tokenizer_bos(t), 258);
        assert_int_equal(bt_tokenizer_eos(t), 258);
        assert_int_equal(bt_tokenizer_pad(t), -1);
        assert_string_equal(bt_tokenizer_chat_template(t), "T");
        bt_ids ids = {0};
        assert_int_equal(bt_tokenize(t, "abc<s>ab", 8, 1, &ids), 0);
        assert_int_equal(ids.n, 3);
        assert_int_equal(ids.v[0], 257);
        assert_int_equal(ids.v[1], 258);
        assert_int_equal(ids.v[2], 256);
        char *s = NULL;
        size_t sl = 0;
        assert_int_equal(bt_detokenize(t, ids.v, ids.n, 0, &s, &sl), 0);
        assert_string_equal(s, "abcab");
        free(s);
        bt_ids_free(&ids);
        bt_tokenizer_free(t);
    }
    /* ignore_merges (HF tokenizers 0.20.3 output for this file): "abc" is a vocabulary token that
     * the merges cannot reach ("b c" ranks before "a b"); " abc" is not in the vocabulary and the
     * space byte has no token (dropped) */
    for (int im = 0; im < 2; im++) {
        char small[600];
        snprintf(small, sizeof small,
                 "{\"model\":{\"type\":\"BPE\",\"ignore_merges\":%s,\"vocab\":{\"a\":0,\"b\":1,\"c\":2,\"bc\":3,"
                 "\"ab\":4,\"abc\":5},\"merges\":[\"b c\",\"a b\",\"ab c\"]},\"pre_tokenizer\":" BL ","
                 "\"decoder\":{\"type\":\"ByteLevel\"}}",
                 im ? "true" : "false");
        bt_tokenizer *t = NULL;
        if (bt_tokenizer_from_json(&t, small, strlen(small), NULL, 0) < 0) fail_msg("%s", bt_last_error());
        bt_ids ids = {0};
        assert_int_equal(bt_tokenize(t, "abc abc", 7, 1, &ids), 0);
        const int32_t want_on[] = {5, 0, 3}, want_off[] = {0, 3, 0, 3};
        assert_int_equal(ids.n, im ? 3 : 4);
        assert_memory_equal(ids.v, im ? want_on : want_off, ids.n * sizeof *ids.v);
        bt_ids_free(&ids);
        bt_tokenizer_free(t);
    }
    /* errors: every one names what is wrong */
    /* a byte-level vocabulary and decoder without a ByteLevel pre-tokenizer (SentencePiece-style
     * files have their own decoder: tests/unit/common/test_tokenizer_spm.c) */
    char *js = tiny_json("[\"a b\"]", "{\"type\":\"Metaspace\"}", "");
    expect_json(js, BT_ERR_UNSUPPORTED, "no ByteLevel");
    free(js);
    js = tiny_json("[\"a b\"]", "{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Split\",\"pattern\":{\"Regex\":\"[\\\\S]\"},"
                                "\"behavior\":\"Isolated\",\"invert\":false}," BL "]}", "");
    expect_json(js, BT_ERR_UNSUPPORTED, "character class");
    free(js);
    js = tiny_json("[\"a b\"]", "{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Split\",\"pattern\":{\"Regex\":\"(a)\\\\1\"},"
                                "\"behavior\":\"Isolated\",\"invert\":false}," BL "]}", "");
    expect_json(js, BT_ERR_UNSUPPORTED, "escape");
    free(js);
    js = tiny_json("[\"a b\"]", "{\"type\":\"Sequence\",\"pretokenizers\":[" BL ",{\"type\":\"Digits\"}]}", "");
    expect_json(js, BT_ERR_UNSUPPORTED, "after ByteLevel");
    free(js);
    js = tiny_json("[\"a b\"]", "{\"type\":\"Digits\"}", "");
    expect_json(js, BT_ERR_UNSUPPORTED, "no ByteLevel");
    free(js);
    js = tiny_json("[\"a b\"]", BL, "\"normalizer\":{\"type\":\"Lowercase\"},");
    expect_json(js, BT_ERR_UNSUPPORTED, "Lowercase");
    free(js);
    js = tiny_json("[\"a x\"]", BL, "");
    expect_json(js, BT_ERR_FORMAT, "merge 0");
    free(js);
    js = tiny_json("[\"ab\"]", BL, "");
    expect_json(js, BT_ERR_FORMAT, "merges[0]");
    free(js);
    js = tiny_json("[]", BL, "");
    expect_json(js, BT_ERR_FORMAT, "merges");
    free(js);
    js = tiny_json("[\"a b\"]", BL, "\"added_tokens\":[{\"id\":257,\"content\":\"zz\",\"special\":true}],");
    expect_json(js, BT_ERR_FORMAT, "already holds");
    free(js);
    expect_json("{\"model\":{\"type\":\"Unigram\",\"vocab\":[]}}", BT_ERR_UNSUPPORTED, "Unigram");
    expect_json("{\"model\":{\"type\":\"BPE\",\"byte_fallback\":true,\"vocab\":{\"a\":0},\"merges\":[]}}", BT_ERR_FORMAT,
                "merges");
    expect_json("{\"model\":{\"type\":\"BPE\",\"byte_fallback\":true,\"vocab\":{\"a\":0},\"merges\":[]},"
                "\"pre_tokenizer\":" BL "}", BT_ERR_UNSUPPORTED, "byte_fallback");
    expect_json("{\"model\":", BT_ERR_FORMAT, NULL);
    expect_json("[1,2]", BT_ERR_FORMAT, "model");
    expect_json("", BT_ERR_FORMAT, NULL);
    bt_tokenizer *t = (bt_tokenizer *)1;
    assert_int_equal(bt_tokenizer_from_json(&t, NULL, 5, NULL, 0), BT_ERR_INVALID);
    /* truncated inputs of a valid file never crash */
    js = tiny_json("[\"a b\"]", BL, "");
    size_t n = strlen(js);
    for (size_t cut = 0; cut < n; cut += 97) {
        t = NULL;
        assert_true(bt_tokenizer_from_json(&t, js, cut, NULL, 0) < 0);
        assert_null(t);
    }
    free(js);
}

static void test_dir_load(void **state) {
    (void)state;
    char dir[] = "/tmp/bt_tokhf_XXXXXX";
    assert_non_null(mkdtemp(dir));
    char path[256], cfg[256];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    snprintf(cfg, sizeof cfg, "%s/tokenizer_config.json", dir);
    size_t len;
    char *js = tu_read_zst(FIX "qwen2-tokenizer.json.zst", &len);
    FILE *f = fopen(path, "wb");
    assert_int_equal(fwrite(js, 1, len, f), len);
    fclose(f);
    free(js);
    f = fopen(cfg, "wb");
    fputs("{\"bos_token\":null,\"eos_token\":\"<|im_end|>\",\"pad_token\":{\"content\":\"<|endoftext|>\"},"
          "\"chat_template\":[{\"name\":\"tool_use\",\"template\":\"X\"},{\"name\":\"default\",\"template\":\"{{ messages }}\"}]}",
          f);
    fclose(f);
    bt_tokenizer *t = load(dir);
    assert_int_equal(bt_tokenizer_bos(t), -1);
    assert_int_equal(bt_tokenizer_eos(t), bt_tokenizer_find(t, "<|im_end|>"));
    assert_int_equal(bt_tokenizer_pad(t), bt_tokenizer_find(t, "<|endoftext|>"));
    assert_string_equal(bt_tokenizer_chat_template(t), "{{ messages }}");
    bt_tokenizer_free(t);
    /* a file that is neither GGUF nor JSON */
    f = fopen(path, "wb");
    fputs("\x28\xb5\x2f\xfd garbage", f);
    fclose(f);
    t = (bt_tokenizer *)1;
    assert_int_equal(bt_tokenizer_load(&t, path), BT_ERR_FORMAT);
    assert_null(t);
    unlink(path);
    unlink(cfg);
    rmdir(dir);
    assert_int_equal(bt_tokenizer_load(&t, dir), BT_ERR_IO);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_corpus_size),
        cmocka_unit_test(test_smollm2_json),
        cmocka_unit_test(test_smollm2_gguf),
        cmocka_unit_test(test_llama3),
        cmocka_unit_test(test_qwen2),
        cmocka_unit_test(test_qwen2x_flags),
        cmocka_unit_test(test_variants),
        cmocka_unit_test(test_json_handmade),
        cmocka_unit_test(test_dir_load),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
