/* Tests for common/tokenizer.c against the real SmolLM2 GGUF ($BT_MODEL) and the HF tokenizers
 * fixtures in tests/fixtures/tokenizer/smollm2_cases.jsonl (tests/reference/gen_tokenizer_fixtures.py).
 * Run from the repo root; BT_SHARED (default ../shared) locates tinyshakespeare.txt. */
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
#include <unistd.h>

#include "common/bt_common.h"
#include "common/gguf.h"
#include "common/tokenizer.h"
#include "tests/unit/util/test_util.h"

#define CASES_PATH "tests/fixtures/tokenizer/smollm2_cases.jsonl"

typedef struct {
    char *in;      /* raw input bytes */
    size_t in_len;
    char *text;    /* expected decoding (input with invalid UTF-8 replaced) */
    size_t text_len;
    int32_t *ids;
    size_t n_ids;
    int special;
    int raw;       /* input came from "hex" (maybe invalid UTF-8) */
} tcase;

static bt_tokenizer *g_tok;
static tcase *g_cases;
static size_t g_n_cases;

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

static void load_cases(void) {
    FILE *f = fopen(CASES_PATH, "r");
    if (!f) fail_msg("cannot open %s (run from the repo root)", CASES_PATH);
    char *line = NULL;
    size_t cap = 0;
    size_t n = 0, alloc = 0;
    while (getline(&line, &cap, f) > 0) {
        json_error_t err;
        json_t *o = json_loads(line, JSON_ALLOW_NUL, &err);
        if (!o) fail_msg("%s: %s", CASES_PATH, err.text);
        assert_non_null(o);
        if (n == alloc) {
            alloc = alloc ? alloc * 2 : 256;
            g_cases = realloc(g_cases, alloc * sizeof *g_cases);
            assert_non_null(g_cases);
        }
        tcase *c = &g_cases[n++];
        memset(c, 0, sizeof *c);
        json_t *text = json_object_get(o, "text"), *ids = json_object_get(o, "ids");
        json_t *hex = json_object_get(o, "hex"), *sp = json_object_get(o, "special");
        assert_true(json_is_string(text) && json_is_array(ids) && json_is_boolean(sp));
        c->text_len = json_string_length(text);
        c->text = malloc(c->text_len + 1);
        memcpy(c->text, json_string_value(text), c->text_len + 1);
        c->special = json_is_true(sp);
        if (hex) {
            const char *h = json_string_value(hex);
            size_t hl = strlen(h);
            c->in = malloc(hl / 2 + 1);
            for (size_t i = 0; i + 1 < hl; i += 2) c->in[i / 2] = (char)(hexval(h[i]) * 16 + hexval(h[i + 1]));
            c->in_len = hl / 2;
            c->raw = 1;
        } else {
            c->in = malloc(c->text_len + 1);
            memcpy(c->in, c->text, c->text_len + 1);
            c->in_len = c->text_len;
        }
        c->n_ids = json_array_size(ids);
        c->ids = malloc((c->n_ids + 1) * sizeof *c->ids);
        for (size_t i = 0; i < c->n_ids; i++) c->ids[i] = (int32_t)json_integer_value(json_array_get(ids, i));
        json_decref(o);
    }
    free(line);
    fclose(f);
    g_n_cases = n;
}

static int setup(void **state) {
    (void)state;
    if (tu_load_tokenizer(&g_tok)) return -1;
    load_cases();
    return 0;
}

static int teardown(void **state) {
    (void)state;
    bt_tokenizer_free(g_tok);
    for (size_t i = 0; i < g_n_cases; i++) {
        free(g_cases[i].in);
        free(g_cases[i].text);
        free(g_cases[i].ids);
    }
    free(g_cases);
    return 0;
}

static void print_ids(const char *label, const int32_t *v, size_t n) {
    fprintf(stderr, "  %s (%zu):", label, n);
    for (size_t i = 0; i < n && i < 40; i++) fprintf(stderr, " %d", v[i]);
    fprintf(stderr, "%s\n", n > 40 ? " ..." : "");
}

static void test_metadata(void **state) {
    (void)state;
    assert_int_equal(bt_tokenizer_vocab_size(g_tok), 49152);
    assert_string_equal(bt_tokenizer_pre(g_tok), "smollm");
    assert_int_equal(bt_tokenizer_find(g_tok, "<|endoftext|>"), 0);
    assert_int_equal(bt_tokenizer_find(g_tok, "<|im_start|>"), 1);
    assert_int_equal(bt_tokenizer_find(g_tok, "<|im_end|>"), 2);
    assert_int_equal(bt_tokenizer_find(g_tok, "<empty_output>"), 16);
    assert_int_equal(bt_tokenizer_find(g_tok, "no-such-token-xyz"), -1);
    assert_int_equal(bt_tokenizer_find(g_tok, NULL), -1);
    assert_int_equal(bt_tokenizer_bos(g_tok), 1);
    assert_int_equal(bt_tokenizer_eos(g_tok), 2);
    assert_int_equal(bt_tokenizer_pad(g_tok), 2);
    assert_string_equal(bt_tokenizer_piece(g_tok, 1), "<|im_start|>");
    assert_null(bt_tokenizer_piece(g_tok, -1));
    assert_null(bt_tokenizer_piece(g_tok, 49152));
    /* "Ġ" (U+0120) is the space byte in the GPT-2 alphabet; id 216 per the HF fixture */
    assert_int_equal(bt_tokenizer_find(g_tok, "\xc4\xa0"), 216);
    const char *tpl = bt_tokenizer_chat_template(g_tok);
    assert_non_null(tpl);
    assert_non_null(strstr(tpl, "You are a helpful AI assistant named SmolLM, trained by Hugging Face"));
}

static void test_hand_ids(void **state) {
    (void)state;
    bt_ids ids = {0};
    assert_int_equal(bt_tokenize(g_tok, "<|im_start|>", 12, 1, &ids), 0);
    assert_int_equal(ids.n, 1);
    assert_int_equal(ids.v[0], 1);
    ids.n = 0;
    assert_int_equal(bt_tokenize(g_tok, "<|im_end|>", 10, 1, &ids), 0);
    assert_int_equal(ids.n, 1);
    assert_int_equal(ids.v[0], 2);
    /* without parse_special the control string is ordinary text: several tokens, none special */
    ids.n = 0;
    assert_int_equal(bt_tokenize(g_tok, "<|im_end|>", 10, 0, &ids), 0);
    assert_true(ids.n > 1);
    for (size_t i = 0; i < ids.n; i++) assert_true(ids.v[i] > 16);
    /* "Hello world" -> [19556 "Hello", 905 "Ġworld"] (HF fixture, checked in the vocab here) */
    ids.n = 0;
    assert_int_equal(bt_tokenize(g_tok, "Hello world", 11, 0, &ids), 0);
    assert_int_equal(ids.n, 2);
    assert_string_equal(bt_tokenizer_piece(g_tok, ids.v[0]), "Hello");
    assert_string_equal(bt_tokenizer_piece(g_tok, ids.v[1]), "\xc4\xa0world");
    /* digits are split individually: "123" -> "1" "2" "3" */
    ids.n = 0;
    assert_int_equal(bt_tokenize(g_tok, "123", 3, 0, &ids), 0);
    assert_int_equal(ids.n, 3);
    assert_string_equal(bt_tokenizer_piece(g_tok, ids.v[0]), "1");
    assert_string_equal(bt_tokenizer_piece(g_tok, ids.v[2]), "3");
    /* empty input appends nothing */
    ids.n = 0;
    assert_int_equal(bt_tokenize(g_tok, "", 0, 1, &ids), 0);
    assert_int_equal(bt_tokenize(g_tok, NULL, 0, 1, &ids), 0);
    assert_int_equal(ids.n, 0);
    bt_ids_free(&ids);
}

static size_t check_all(const bt_tokenizer *t, int verbose) {
    size_t bad = 0;
    bt_ids ids = {0};
    for (size_t k = 0; k < g_n_cases; k++) {
        const tcase *c = &g_cases[k];
        ids.n = 0;
        int rc = bt_tokenize(t, c->in, c->in_len, c->special, &ids);
        if (rc != 0 || ids.n != c->n_ids || (ids.n && memcmp(ids.v, c->ids, ids.n * sizeof *ids.v) != 0)) {
            if (verbose && bad < 10) {
                fprintf(stderr, "mismatch case %zu special=%d rc=%d text=\"%.80s\"\n", k, c->special, rc, c->text);
                print_ids("want", c->ids, c->n_ids);
                print_ids("got ", ids.v, ids.n);
            }
            bad++;
        }
    }
    bt_ids_free(&ids);
    return bad;
}

static void test_fixture_parity(void **state) {
    (void)state;
    assert_true(g_n_cases >= 500);
    size_t bad = check_all(g_tok, 1);
    fprintf(stderr, "tokenizer parity: %zu cases, %zu mismatches\n", g_n_cases, bad);
    assert_int_equal(bad, 0);
}

static void test_round_trip(void **state) {
    (void)state;
    for (size_t k = 0; k < g_n_cases; k++) {
        const tcase *c = &g_cases[k];
        char *s = NULL;
        size_t n = 0;
        assert_int_equal(bt_detokenize(g_tok, c->ids, c->n_ids, 1, &s, &n), 0);
        /* valid input: exact bytes back; invalid input: its U+FFFD-replaced form */
        if (n != c->text_len || memcmp(s, c->text, n) != 0)
            fail_msg("round trip case %zu: \"%.60s\" -> \"%.60s\"", k, c->text, s);
        assert_int_equal(s[n], 0);
        free(s);
    }
    /* keep_special = 0 drops control tokens */
    bt_ids ids = {0};
    const char *txt = "<|im_start|>user\nHi<|im_end|>\n";
    assert_int_equal(bt_tokenize(g_tok, txt, strlen(txt), 1, &ids), 0);
    char *s = NULL;
    size_t n = 0;
    assert_int_equal(bt_detokenize(g_tok, ids.v, ids.n, 0, &s, &n), 0);
    assert_string_equal(s, "user\nHi\n");
    free(s);
    assert_int_equal(bt_detokenize(g_tok, ids.v, ids.n, 1, &s, &n), 0);
    assert_string_equal(s, txt);
    free(s);
    /* empty decode */
    assert_int_equal(bt_detokenize(g_tok, NULL, 0, 1, &s, &n), 0);
    assert_int_equal(n, 0);
    assert_string_equal(s, "");
    free(s);
    bt_ids_free(&ids);
}

static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)sz + 1);
    size_t got = fread(b, 1, (size_t)sz, f);
    fclose(f);
    b[got] = 0;
    *len = got;
    return b;
}

static void test_shakespeare_round_trip(void **state) {
    (void)state;
    const char *sh = getenv("BT_SHARED");
    char path[4096];
    snprintf(path, sizeof path, "%s/data/tinyshakespeare.txt", sh && *sh ? sh : "../shared");
    size_t len = 0;
    char *text = read_file(path, &len);
    if (!text) fail_msg("cannot read %s", path);
    bt_ids ids = {0};
    assert_int_equal(bt_tokenize(g_tok, text, len, 0, &ids), 0);
    assert_true(ids.n > len / 8 && ids.n < len);
    char *s = NULL;
    size_t n = 0;
    assert_int_equal(bt_detokenize(g_tok, ids.v, ids.n, 1, &s, &n), 0);
    assert_int_equal(n, len);
    assert_memory_equal(s, text, len);
    free(s);
    free(text);
    bt_ids_free(&ids);
}

typedef struct {
    size_t bad;
} thr_arg;

static void *thr_main(void *p) {
    thr_arg *a = p;
    for (int rep = 0; rep < 2; rep++) a->bad += check_all(g_tok, 0);
    return NULL;
}

static void test_threads(void **state) {
    (void)state;
    pthread_t th[2];
    thr_arg args[2] = {{0}, {0}};
    for (int i = 0; i < 2; i++) assert_int_equal(pthread_create(&th[i], NULL, thr_main, &args[i]), 0);
    for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
    assert_int_equal(args[0].bad, 0);
    assert_int_equal(args[1].bad, 0);
}

static void test_large_inputs(void **state) {
    (void)state;
    /* long whitespace run before a word: "\s+(?!\S)" then " x"; long single letter run */
    size_t n = 1 << 20;
    char *buf = malloc(n + 2);
    memset(buf, ' ', n);
    buf[n] = 'x';
    bt_ids ids = {0};
    assert_int_equal(bt_tokenize(g_tok, buf, n + 1, 1, &ids), 0);
    char *s = NULL;
    size_t sl = 0;
    assert_int_equal(bt_detokenize(g_tok, ids.v, ids.n, 1, &s, &sl), 0);
    assert_int_equal(sl, n + 1);
    assert_memory_equal(s, buf, n + 1);
    free(s);
    memset(buf, 'a', n);
    ids.n = 0;
    assert_int_equal(bt_tokenize(g_tok, buf, n, 0, &ids), 0);
    assert_true(ids.n > 0 && ids.n < n);
    assert_int_equal(bt_detokenize(g_tok, ids.v, ids.n, 1, &s, &sl), 0);
    assert_int_equal(sl, n);
    assert_memory_equal(s, buf, n);
    free(s);
    /* all 256 byte values, many times: invalid UTF-8 handled without crashing */
    for (size_t i = 0; i < 65536; i++) buf[i] = (char)(i * 7 + (i >> 8));
    ids.n = 0;
    assert_int_equal(bt_tokenize(g_tok, buf, 65536, 1, &ids), 0);
    assert_true(ids.n > 0);
    free(buf);
    bt_ids_free(&ids);
}

static void test_bad_args(void **state) {
    (void)state;
    bt_ids ids = {0};
    assert_int_equal(bt_tokenize(NULL, "a", 1, 0, &ids), BT_ERR_INVALID);
    assert_int_equal(bt_tokenize(g_tok, NULL, 1, 0, &ids), BT_ERR_INVALID);
    assert_int_equal(bt_tokenize(g_tok, "a", 1, 0, NULL), BT_ERR_INVALID);
    int32_t bad_ids[] = {5, 49152};
    char *s = (char *)1;
    size_t n = 7;
    assert_int_equal(bt_detokenize(g_tok, bad_ids, 2, 1, &s, &n), BT_ERR_RANGE);
    assert_null(s);
    assert_non_null(strstr(bt_last_error(), "49152"));
    int32_t neg[] = {-1};
    assert_int_equal(bt_detokenize(g_tok, neg, 1, 1, &s, &n), BT_ERR_RANGE);
    assert_int_equal(bt_detokenize(g_tok, NULL, 3, 1, &s, &n), BT_ERR_INVALID);
    bt_tokenizer *t = (bt_tokenizer *)1;
    assert_int_equal(bt_tokenizer_from_gguf(&t, NULL), BT_ERR_INVALID);
    assert_true(bt_tokenizer_load(&t, "/nonexistent/model.gguf") < 0);
    assert_null(t);
    bt_tokenizer_free(NULL);
    bt_ids_free(&ids);
}

/* ---- synthetic vocabularies (written with the GGUF writer) ---- */

static char g_tmpdir[] = "/tmp/bt_tok_test_XXXXXX";

/* Builds a GGUF holding only tokenizer keys (types: n_types entries, NULL for none). */
static int make_gguf(const char *path, const char *model, const char *pre, const char **toks, int n_tok,
                     const int32_t *types, int n_types, const char **merges, int n_merge) {
    bt_gguf_writer *w = bt_gguf_writer_new();
    assert_non_null(w);
    bt_str *ts = calloc((size_t)n_tok + 1, sizeof *ts), *ms = calloc((size_t)n_merge + 1, sizeof *ms);
    for (int i = 0; i < n_tok; i++) ts[i] = (bt_str){toks[i], strlen(toks[i])};
    for (int i = 0; i < n_merge; i++) ms[i] = (bt_str){merges[i], strlen(merges[i])};
    int rc = 0;
    rc |= bt_gguf_w_str(w, "tokenizer.ggml.model", model, strlen(model));
    if (pre) rc |= bt_gguf_w_str(w, "tokenizer.ggml.pre", pre, strlen(pre));
    rc |= bt_gguf_w_str_arr(w, "tokenizer.ggml.tokens", ts, (uint64_t)n_tok);
    if (types) rc |= bt_gguf_w_num_arr(w, "tokenizer.ggml.token_type", BT_GGUF_I32, types, (uint64_t)n_types);
    rc |= bt_gguf_w_str_arr(w, "tokenizer.ggml.merges", ms, (uint64_t)n_merge);
    rc |= bt_gguf_w_u32(w, "tokenizer.ggml.eos_token_id", 0);
    rc |= bt_gguf_w_u32(w, "tokenizer.ggml.padding_token_id", 0xFFFFFFFFu); /* "none" */
    assert_int_equal(rc, 0);
    rc = bt_gguf_writer_write(w, path);
    bt_gguf_writer_free(w);
    free(ts);
    free(ms);
    return rc;
}

/* Full byte alphabet (256 tokens in GPT-2 order) plus extras. */
static int byte_alphabet(const char **toks, char store[256][4]) {
    int k = 0;
    uint32_t n = 0;
    for (int b = 0; b < 256; b++) {
        int keep = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
        uint32_t cp = keep ? (uint32_t)b : 256 + n++;
        if (cp < 0x80) { store[b][0] = (char)cp; store[b][1] = 0; }
        else { store[b][0] = (char)(0xC0 | (cp >> 6)); store[b][1] = (char)(0x80 | (cp & 0x3F)); store[b][2] = 0; }
        toks[k++] = store[b];
    }
    return k;
}

static void test_synthetic(void **state) {
    (void)state;
    assert_non_null(mkdtemp(g_tmpdir));
    char path[512];
    snprintf(path, sizeof path, "%s/t.gguf", g_tmpdir);
    static char store[256][4];
    const char *toks[300];
    int n = byte_alphabet(toks, store);
    /* merges: "a a" (rank 0) -> "aa", "b c" (rank 1), "a bc" (rank 2) -> "abc", "aa a" (3) */
    toks[n++] = "aa";
    toks[n++] = "bc";
    toks[n++] = "abc";
    toks[n++] = "aaa";
    toks[n++] = "<ctl>";
    int32_t types[300];
    for (int i = 0; i < n; i++) types[i] = 1;
    types[n - 1] = 3;
    const char *merges[] = {"a a", "b c", "a bc", "aa a"};
    assert_int_equal(make_gguf(path, "gpt2", "gpt2", toks, n, types, n, merges, 4), 0);
    bt_tokenizer *t = NULL;
    assert_int_equal(bt_tokenizer_load(&t, path), 0);
    assert_int_equal(bt_tokenizer_vocab_size(t), n);
    assert_string_equal(bt_tokenizer_pre(t), "gpt2");
    assert_int_equal(bt_tokenizer_bos(t), -1);
    assert_int_equal(bt_tokenizer_eos(t), 0);
    assert_int_equal(bt_tokenizer_pad(t), -1); /* out of range -> absent */
    assert_int_equal(bt_tokenizer_token_type(t, n - 1), 3);
    assert_int_equal(bt_tokenizer_token_type(t, n), -1);
    size_t bl = 9;
    const uint8_t *bytes = bt_tokenizer_token_bytes(t, bt_tokenizer_find(t, "\xc4\xa0"), &bl);
    assert_int_equal(bl, 1);
    assert_int_equal(bytes[0], ' ');
    assert_null(bt_tokenizer_token_bytes(t, -3, &bl));
    assert_int_equal(bl, 0);
    assert_null(bt_tokenizer_chat_template(t));
    int32_t id_aa = bt_tokenizer_find(t, "aa"), id_a = bt_tokenizer_find(t, "a");
    int32_t id_abc = bt_tokenizer_find(t, "abc"), id_ctl = bt_tokenizer_find(t, "<ctl>");
    bt_ids ids = {0};
    /* "aaa": rank 0 at positions 0 and 1 -> leftmost first: "aa" "a" -> then "aa a" rank 3 -> "aaa" */
    assert_int_equal(bt_tokenize(t, "aaa", 3, 0, &ids), 0);
    assert_int_equal(ids.n, 1);
    assert_int_equal(ids.v[0], bt_tokenizer_find(t, "aaa"));
    /* "aaaa": "aa" "aa" (rank 0 twice, leftmost first), no "aa aa" merge */
    ids.n = 0;
    assert_int_equal(bt_tokenize(t, "aaaa", 4, 0, &ids), 0);
    assert_int_equal(ids.n, 2);
    assert_int_equal(ids.v[0], id_aa);
    assert_int_equal(ids.v[1], id_aa);
    /* "abc": "b c" (rank 1) before "a bc" (rank 2) */
    ids.n = 0;
    assert_int_equal(bt_tokenize(t, "abc", 3, 0, &ids), 0);
    assert_int_equal(ids.n, 1);
    assert_int_equal(ids.v[0], id_abc);
    /* control token split out only with parse_special */
    ids.n = 0;
    assert_int_equal(bt_tokenize(t, "a<ctl>a", 7, 1, &ids), 0);
    assert_int_equal(ids.n, 3);
    assert_int_equal(ids.v[0], id_a);
    assert_int_equal(ids.v[1], id_ctl);
    ids.n = 0;
    assert_int_equal(bt_tokenize(t, "a<ctl>a", 7, 0, &ids), 0);
    assert_int_equal(ids.n, 7);
    bt_tokenizer_free(t);
    bt_ids_free(&ids);

    /* error paths: unsupported model / pre-tokeniser, merges outside the vocabulary */
    assert_int_equal(make_gguf(path, "bert", "gpt2", toks, n, types, n, merges, 4), 0);
    assert_int_equal(bt_tokenizer_load(&t, path), BT_ERR_UNSUPPORTED);
    assert_null(t);
    assert_int_equal(make_gguf(path, "gpt2", "qwen9", toks, n, types, n, merges, 4), 0);
    assert_int_equal(bt_tokenizer_load(&t, path), BT_ERR_UNSUPPORTED);
    assert_int_equal(make_gguf(path, "gpt2", NULL, toks, n, types, n, merges, 4), 0);
    assert_int_equal(bt_tokenizer_load(&t, path), BT_ERR_NOTFOUND);
    const char *bad_merges[] = {"a a", "x yz"};
    assert_int_equal(make_gguf(path, "gpt2", "gpt2", toks, n, types, n, bad_merges, 2), 0);
    assert_int_equal(bt_tokenizer_load(&t, path), BT_ERR_FORMAT);
    assert_non_null(strstr(bt_last_error(), "merge 1"));
    const char *bad_merges2[] = {"aa"};
    assert_int_equal(make_gguf(path, "gpt2", "gpt2", toks, n, types, n, bad_merges2, 1), 0);
    assert_int_equal(bt_tokenizer_load(&t, path), BT_ERR_FORMAT);
    assert_int_equal(make_gguf(path, "gpt2", "gpt2", toks, n, types, n, merges, 0), 0);
    assert_int_equal(bt_tokenizer_load(&t, path), BT_ERR_FORMAT);
    assert_int_equal(make_gguf(path, "gpt2", "gpt2", toks, n - 1, types, n, merges, 4), 0);
    assert_int_equal(bt_tokenizer_load(&t, path), BT_ERR_FORMAT); /* token_type count differs */
    assert_null(t);
    unlink(path);
    rmdir(g_tmpdir);
}

/* Bounds and memory (issue 21 §8): the real tokenizer's estimate bounds what it holds (and not
 * by far); a vocabulary past BT_TOKENIZER_MAX_VOCAB is refused, from the GGUF's counts, by the
 * estimate and by the loader, and in a tokenizer.json before its tables are made. */
static void test_bounds_and_memory(void **state) {
    (void)state;
    uint64_t est = 0;
    assert_int_equal(bt_tokenizer_load_estimate(tu_model_path(), &est), 0);
    bt_tokenizer *t = NULL;
    assert_int_equal(bt_tokenizer_load(&t, tu_model_path()), 0);
    uint64_t held = bt_tokenizer_mem_bytes(t);
    fprintf(stderr, "SmolLM2 tokenizer: %.2f MiB held, estimate %.2f MiB\n", held / 1048576.0, est / 1048576.0);
    assert_true(held > (uint64_t)bt_tokenizer_vocab_size(t) * 20); /* its tables, at least */
    assert_true(est >= held && est < 4 * held);
    bt_tokenizer_free(t);

    char dir[] = "/tmp/bt_tok_bound_XXXXXX", path[256];
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/big.gguf", dir);
    const int n = (int)BT_TOKENIZER_MAX_VOCAB + 1;
    const char **toks = malloc((size_t)n * sizeof *toks);
    char (*names)[8] = malloc((size_t)n * sizeof *names);
    for (int i = 0; i < n; i++) {
        snprintf(names[i], sizeof names[i], "t%06x", i);
        toks[i] = names[i];
    }
    const char *merges[] = {"t t"};
    assert_int_equal(make_gguf(path, "gpt2", "gpt2", toks, n, NULL, 0, merges, 1), 0);
    assert_int_equal(bt_tokenizer_load_estimate(path, &est), BT_ERR_RANGE);
    assert_non_null(strstr(bt_last_error(), "1048577 tokens, more than the 1048576 accepted"));
    assert_int_equal(bt_tokenizer_load(&t, path), BT_ERR_RANGE);
    assert_null(t);
    /* at the bound: accepted by the estimate, which then bounds it */
    assert_int_equal(make_gguf(path, "gpt2", "gpt2", toks, n - 1, NULL, 0, merges, 1), 0);
    assert_int_equal(bt_tokenizer_load_estimate(path, &est), 0);
    assert_true(est < ((uint64_t)256 << 20));
    free(toks);
    free(names);
    unlink(path);
    /* tokenizer.json: an id past the bound, refused before the tables of that size */
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    const char *js = "{\"pre_tokenizer\": {\"type\": \"ByteLevel\"}, \"decoder\": {\"type\": \"ByteLevel\"}, "
                     "\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 999999999}, \"merges\": []}}";
    tu_write_file(NULL, path, js, strlen(js));
    assert_int_equal(bt_tokenizer_load_estimate(path, &est), 0);
    assert_true(est >= 20 * strlen(js));
    assert_int_equal(bt_tokenizer_load(&t, path), BT_ERR_RANGE);
    assert_non_null(strstr(bt_last_error(), "more than the 1048576 tokens accepted"));
    unlink(path);
    rmdir(dir);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_metadata),
        cmocka_unit_test(test_hand_ids),
        cmocka_unit_test(test_fixture_parity),
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_shakespeare_round_trip),
        cmocka_unit_test(test_threads),
        cmocka_unit_test(test_large_inputs),
        cmocka_unit_test(test_bad_args),
        cmocka_unit_test(test_synthetic),
        cmocka_unit_test(test_bounds_and_memory),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
