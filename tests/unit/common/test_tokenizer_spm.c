/* Parity of the SentencePiece-family tokenizers with their real references, on the real
 * tokenizer files (fixtures: tests/reference/gen_tokenizer_spm_fixtures.py; counts and versions
 * in tests/fixtures/tokenizer/spm_references.json):
 *   GGUF tokenizer.ggml.model "llama" (common/tokenizer_spm.c) against llama.cpp b4965:
 *     llama-spm  Llama 2's vocabulary (ggml-vocab-llama-spm.gguf; TinyLlama has the same)
 *     phi-3      Phi-3's (ggml-vocab-phi-3.gguf; RSTRIP special tokens)
 *     gemma3     the real Gemma 3 270M GGUF (262,144 pieces, no space prefix)
 *   tokenizer.json BPE with byte_fallback (MODEL_CHARS) against Hugging Face tokenizers 0.20.3:
 *     mistral-v0.1  Prepend + Replace normalizer, no pre-tokenizer (the Llama 2 layout)
 *     mistral-v0.3  Metaspace(prepend_scheme "first"), [INST] ... control tokens
 * on the >= 1 MB parity corpus (corpus.bin.zst) and the stress strings (stress.bin.zst): ids must
 * match exactly (0 mismatches), and our decode of the reference ids must equal the reference
 * decode (FNV-1a-64; one leading space dropped where the reference drops it). The GGUF files are
 * fetched by scripts/fetch-tokenizers (pinned PyPI packages, sha256-checked; `make tokenizers`);
 * where that reported PyPI unreachable (models/tokenizers/SKIPPED) those cases skip, saying why.
 * Run from the repo root. */
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
#include "common/bt_le.h"
#include "common/gguf.h"
#include "common/tokenizer.h"
#include "tests/unit/util/test_util.h"

#define FIX "tests/fixtures/tokenizer/"

typedef struct {
    const uint8_t *text;
    size_t len;
    int special;
} doc_t;

typedef struct {
    uint8_t *buf;
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

/* Python bytes.decode("utf-8", "replace"): U+FFFD per maximal invalid subpart. */
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

/* Every document of c through t against the BTTKIDS1 file: returns id + decode mismatches.
 * strip: the reference decode drops one leading " " (llama.cpp with add_space_prefix; HF Strip). */
static int g_valid_only; /* check_family: skip documents that are not valid UTF-8 */

static size_t check_family(const char *name, const bt_tokenizer *t, const corpus_t *c, const char *ids_path, int strip,
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
        uint64_t h = bt_get64(p + off);
        off += 8;
        size_t n = (size_t)varint(p, len, &off);
        if (n > want_cap) {
            want_cap = n * 2;
            want = realloc(want, want_cap * sizeof *want);
        }
        for (size_t k = 0; k < n; k++) want[k] = (int32_t)varint(p, len, &off);
        ntok += n;
        if (g_valid_only) {
            uint8_t *tmp = malloc(c->docs[i].len * 3 + 1);
            size_t tl = utf8_lossy(c->docs[i].text, c->docs[i].len, tmp);
            int valid = tl == c->docs[i].len && !memcmp(tmp, c->docs[i].text, tl);
            free(tmp);
            if (!valid) continue;
        }
        got.n = 0;
        int rc = bt_tokenize(t, (const char *)c->docs[i].text, c->docs[i].len, c->docs[i].special, &got);
        if (rc != 0 || got.n != n || (n && memcmp(got.v, want, n * sizeof *want) != 0)) {
            if (bad < 5) {
                size_t k = 0;
                while (k < n && k < got.n && got.v[k] == want[k]) k++;
                fprintf(stderr, "%s: mismatch doc %zu (special=%d rc=%d) at id %zu of %zu/%zu: \"%.60s\"\n", name, i,
                        c->docs[i].special, rc, k, n, got.n, (const char *)c->docs[i].text);
            }
            bad++;
        }
        char *s = NULL;
        size_t sl = 0;
        assert_int_equal(bt_detokenize(t, want, n, 1, &s, &sl), 0);
        const uint8_t *d = (const uint8_t *)s;
        if (strip && sl && d[0] == ' ') d++, sl--;
        uint8_t *lossy = malloc(sl * 3 + 1);
        size_t ll = utf8_lossy(d, sl, lossy);
        if (bt_fnv1a64(BT_FNV64_INIT, lossy, ll) != h) {
            if (dbad < 3) fprintf(stderr, "%s: decode mismatch doc %zu: \"%.60s\"\n", name, i, s);
            dbad++;
        }
        free(lossy);
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

static corpus_t g_corpus, g_stress;

static int setup(void **state) {
    (void)state;
    load_corpus(&g_corpus, FIX "corpus.bin.zst");
    load_corpus(&g_stress, FIX "stress.bin.zst");
    return 0;
}

static int teardown(void **state) {
    (void)state;
    free_corpus(&g_corpus);
    free_corpus(&g_stress);
    return 0;
}

static const char *tok_dir(void) {
    const char *d = getenv("BT_TOKENIZERS_DIR");
    return d && *d ? d : "models/tokenizers";
}

/* Path of a fetched file; skips the test when scripts/fetch-tokenizers said PyPI was unreachable,
 * fails when the file was never fetched. */
static const char *fetched(const char *path, char *buf, size_t cap) {
    if (access(path, R_OK) == 0) return path;
    char sk[512];
    snprintf(sk, sizeof sk, "%s/SKIPPED", tok_dir());
    size_t n = 0;
    uint8_t *why = tu_slurp(sk, &n);
    if (why) {
        snprintf(buf, cap, "%.*s", (int)(n && why[n - 1] == '\n' ? n - 1 : n), (const char *)why);
        fprintf(stderr, "SKIPPED: %s not fetched: %s\n", path, buf);
        free(why);
        skip();
    }
    fail_msg("%s missing: run `make tokenizers` (scripts/fetch-tokenizers)", path);
    return NULL;
}

static bt_tokenizer *load(const char *path) {
    bt_tokenizer *t = NULL;
    int rc = bt_tokenizer_load(&t, path);
    if (rc < 0) fail_msg("load %s: %s", path, bt_last_error());
    return t;
}

/* Both corpora, then the memory accounting: what it holds <= what the estimate promised. */
static void check_all(const char *name, const char *path, int strip) {
    bt_tokenizer *t = load(path);
    char ids[256], label[64];
    size_t ntok = 0;
    snprintf(ids, sizeof ids, FIX "%s_ids.bin.zst", name);
    assert_int_equal(check_family(name, t, &g_corpus, ids, strip, &ntok), 0);
    assert_true(ntok > 100000);
    snprintf(ids, sizeof ids, FIX "%s_stress_ids.bin.zst", name);
    snprintf(label, sizeof label, "%s/stress", name);
    assert_int_equal(check_family(label, t, &g_stress, ids, strip, NULL), 0);
    uint64_t est = 0;
    assert_int_equal(bt_tokenizer_load_estimate(path, &est), 0);
    fprintf(stderr, "%s: %.2f MiB held, estimate %.2f MiB\n", name, bt_tokenizer_mem_bytes(t) / 1048576.0,
            est / 1048576.0);
    assert_true(bt_tokenizer_mem_bytes(t) <= est);
    bt_tokenizer_free(t);
}

static void test_llama_spm(void **state) {
    (void)state;
    char p[512], why[512];
    snprintf(p, sizeof p, "%s/ggml-vocab-llama-spm.gguf", tok_dir());
    const char *path = fetched(p, why, sizeof why);
    bt_tokenizer *t = load(path);
    assert_int_equal(bt_tokenizer_vocab_size(t), 32000);
    assert_string_equal(bt_tokenizer_pre(t), "spm");
    assert_string_equal(bt_tokenizer_pre_engine(t), "spm");
    assert_int_equal(bt_tokenizer_bos(t), 1);
    assert_int_equal(bt_tokenizer_eos(t), 2);
    assert_int_equal(bt_tokenizer_token_type(t, 13), 6); /* <0x0A> */
    /* " Hello" -> "▁▁Hello"? no: add_space_prefix gives "▁Hello" for "Hello" */
    bt_ids ids = {0};
    assert_int_equal(bt_tokenize(t, "Hello", 5, 0, &ids), 0);
    assert_int_equal(ids.n, 1);
    assert_string_equal(bt_tokenizer_piece(t, ids.v[0]), "\xe2\x96\x81Hello");
    /* control tokens split out only with parse_special; bytes without a piece fall back */
    ids.n = 0;
    assert_int_equal(bt_tokenize(t, "<s>", 3, 1, &ids), 0);
    assert_int_equal(ids.n, 1);
    assert_int_equal(ids.v[0], 1);
    ids.n = 0;
    assert_int_equal(bt_tokenize(t, "\xff", 1, 0, &ids), 0);
    assert_int_equal(ids.n, 2); /* "▁" and <0xFF> */
    assert_int_equal(ids.v[1], bt_tokenizer_find(t, "<0xFF>"));
    size_t bl = 0;
    const uint8_t *b = bt_tokenizer_token_bytes(t, ids.v[1], &bl);
    assert_int_equal(bl, 1);
    assert_int_equal(b[0], 0xFF);
    bt_ids_free(&ids);
    bt_tokenizer_free(t);
    check_all("llama-spm", path, 1);
}

static void test_phi3(void **state) {
    (void)state;
    char p[512], why[512];
    snprintf(p, sizeof p, "%s/ggml-vocab-phi-3.gguf", tok_dir());
    const char *path = fetched(p, why, sizeof why);
    bt_tokenizer *t = load(path);
    /* RSTRIP (general.name "Phi3"): the spaces after <|end|> are dropped */
    bt_ids a = {0}, b = {0};
    assert_int_equal(bt_tokenize(t, "<|end|>   x", 11, 1, &a), 0);
    assert_int_equal(bt_tokenize(t, "<|end|>x", 8, 1, &b), 0);
    assert_int_equal(a.n, b.n);
    assert_memory_equal(a.v, b.v, a.n * sizeof *a.v);
    assert_int_equal(a.v[0], bt_tokenizer_find(t, "<|end|>"));
    bt_ids_free(&a);
    bt_ids_free(&b);
    bt_tokenizer_free(t);
    check_all("phi-3", path, 1);
}

static void test_gemma3(void **state) {
    (void)state;
    const char *m = getenv("BT_GEMMA");
    char why[512];
    const char *path = fetched(m && *m ? m : "models/gemma-3-270m-q4_k_m.gguf", why, sizeof why);
    bt_tokenizer *t = load(path);
    assert_int_equal(bt_tokenizer_vocab_size(t), 262144);
    assert_int_equal(bt_tokenizer_bos(t), 2);
    assert_int_equal(bt_tokenizer_eos(t), 1);
    int32_t sot = bt_tokenizer_find(t, "<start_of_turn>"), nn = bt_tokenizer_find(t, "\n\n");
    assert_true(sot > 0 && nn > 0);
    assert_int_equal(bt_tokenizer_token_type(t, sot), 3);
    assert_int_equal(bt_tokenizer_token_type(t, nn), 4);
    bt_ids ids = {0};
    /* no space prefix; user-defined "\n\n" always split out, the control token only when parsed */
    assert_int_equal(bt_tokenize(t, "<start_of_turn>user\n\nHi", 23, 1, &ids), 0);
    assert_int_equal(ids.v[0], sot);
    assert_string_equal(bt_tokenizer_piece(t, ids.v[1]), "user");
    assert_int_equal(ids.v[2], nn);
    ids.n = 0;
    assert_int_equal(bt_tokenize(t, "<start_of_turn>user\n\nHi", 23, 0, &ids), 0);
    assert_true(ids.v[0] != sot);
    int has_nn = 0;
    for (size_t i = 0; i < ids.n; i++) has_nn |= ids.v[i] == nn;
    assert_true(has_nn);
    bt_ids_free(&ids);
    bt_tokenizer_free(t);
    check_all("gemma3", path, 0);
}

static void test_mistral_json(void **state) {
    (void)state;
    bt_tokenizer *t = load(FIX "mistral-v0.1-tokenizer.json.zst");
    assert_string_equal(bt_tokenizer_pre(t), "sentencepiece");
    assert_string_equal(bt_tokenizer_pre_engine(t), "none");
    assert_int_equal(bt_tokenizer_vocab_size(t), 32000);
    assert_int_equal(bt_tokenizer_bos(t), 1); /* TemplateProcessing "<s> $A" */
    bt_ids ids = {0};
    assert_int_equal(bt_tokenize(t, "\xf0\x9f\xa6\x99", 4, 0, &ids), 0); /* not a piece: 4 byte tokens after "▁" */
    assert_int_equal(ids.n, 5);
    assert_int_equal(ids.v[1], bt_tokenizer_find(t, "<0xF0>"));
    bt_ids_free(&ids);
    bt_tokenizer_free(t);
    check_all("mistral-v0.1", FIX "mistral-v0.1-tokenizer.json.zst", 1);
    t = load(FIX "mistral-v0.3-tokenizer.json.zst");
    assert_int_equal(bt_tokenizer_vocab_size(t), 32768);
    int32_t inst = bt_tokenizer_find(t, "[INST]");
    assert_int_equal(inst, 3);
    assert_int_equal(bt_tokenizer_token_type(t, inst), 3);
    bt_tokenizer_free(t);
    check_all("mistral-v0.3", FIX "mistral-v0.3-tokenizer.json.zst", 1);
}

/* Hand-made tokenizer.json files: the options of the SentencePiece-style pipeline and their
 * refusals. */
static void test_json_options(void **state) {
    (void)state;
    static const char base[] =
        "{\"model\":{\"type\":\"BPE\",\"byte_fallback\":%s,\"fuse_unk\":%s,\"unk_token\":\"<unk>\","
        "\"vocab\":{\"<unk>\":0,\"<0x61>\":1,\"\\u2581\":2,\"a\":3,\"b\":4,\"ab\":5,\"\\u2581a\":6,\"<0xC3>\":7,"
        "\"<0xA9>\":8},\"merges\":[\"a b\",\"\\u2581 a\"]},\"normalizer\":%s,\"pre_tokenizer\":%s,"
        "\"decoder\":%s}";
    char js[2048];
    bt_tokenizer *t = NULL;
    bt_ids ids = {0};
    /* Metaspace split: "ab ab" -> "▁ab" "▁ab"; merge "a b" (rank 0) before "▁ a" (rank 1): [▁, ab] twice */
    snprintf(js, sizeof js, base, "true", "false", "null",
             "{\"type\":\"Metaspace\",\"replacement\":\"\\u2581\",\"prepend_scheme\":\"always\",\"split\":true}",
             "{\"type\":\"Metaspace\",\"replacement\":\"\\u2581\",\"prepend_scheme\":\"always\"}");
    assert_int_equal(bt_tokenizer_from_json(&t, js, strlen(js), NULL, 0), 0);
    assert_int_equal(bt_tokenize(t, "ab ab", 5, 0, &ids), 0);
    assert_int_equal(ids.n, 4);
    assert_int_equal(ids.v[0], 2);
    assert_int_equal(ids.v[1], 5);
    assert_int_equal(ids.v[3], 5);
    /* without split the whole run is one word: the same here */
    ids.n = 0;
    assert_int_equal(bt_tokenize(t, "a", 1, 0, &ids), 0);
    assert_int_equal(ids.n, 1);
    assert_int_equal(ids.v[0], 6); /* "▁a" */
    /* é (C3 A9) has no piece: byte fallback */
    ids.n = 0;
    assert_int_equal(bt_tokenize(t, "\xc3\xa9", 2, 0, &ids), 0);
    assert_int_equal(ids.n, 3);
    assert_int_equal(ids.v[1], 7);
    assert_int_equal(ids.v[2], 8);
    bt_tokenizer_free(t);
    /* no byte fallback, fuse_unk: consecutive unknown chars become one <unk> */
    snprintf(js, sizeof js, base, "false", "true", "{\"type\":\"Replace\",\"pattern\":{\"String\":\" \"},\"content\":\"\\u2581\"}",
             "null", "null");
    assert_int_equal(bt_tokenizer_from_json(&t, js, strlen(js), NULL, 0), 0);
    ids.n = 0;
    assert_int_equal(bt_tokenize(t, "a\xc3\xa9\xc3\xa9" "b", 6, 0, &ids), 0);
    assert_int_equal(ids.n, 3);
    assert_int_equal(ids.v[0], 3);
    assert_int_equal(ids.v[1], 0);
    assert_int_equal(ids.v[2], 4);
    bt_tokenizer_free(t);
    /* refusals name what is unsupported */
    snprintf(js, sizeof js, base, "true", "false",
             "{\"type\":\"Replace\",\"pattern\":{\"Regex\":\" +\"},\"content\":\"\\u2581\"}", "null", "null");
    assert_int_equal(bt_tokenizer_from_json(&t, js, strlen(js), NULL, 0), BT_ERR_UNSUPPORTED);
    assert_non_null(strstr(bt_last_error(), "Regex"));
    snprintf(js, sizeof js, base, "true", "false", "null", "null", "{\"type\":\"WordPiece\"}");
    assert_int_equal(bt_tokenizer_from_json(&t, js, strlen(js), NULL, 0), BT_ERR_UNSUPPORTED);
    snprintf(js, sizeof js, base, "true", "false", "null", "{\"type\":\"ByteLevel\"}", "null");
    assert_int_equal(bt_tokenizer_from_json(&t, js, strlen(js), NULL, 0), BT_ERR_UNSUPPORTED);
    assert_non_null(strstr(bt_last_error(), "byte_fallback"));
    assert_null(t);
    bt_ids_free(&ids);
}

/* The Hugging Face files bt_tokenizer_hf_from_gguf writes for a SentencePiece GGUF (issue 24:
 * the merged safetensors export carries them), read back by our tokenizer.json engine (HF
 * tokenizers semantics: MODEL_CHARS): the ids and decode of llama.cpp on every valid UTF-8 stress
 * document (invalid bytes: HF reads text, llama.cpp bytes). The comparison with transformers
 * itself is tests/py/test_export_spm_tokenizer.py. */
static void hf_export_case(const char *name, const char *file) {
    char p[512], why[512], dir[128], path[256];
    snprintf(p, sizeof p, "%s/%s", tok_dir(), file);
    const char *src = fetched(p, why, sizeof why);
    bt_gguf *g = NULL;
    assert_int_equal(bt_gguf_open(&g, src), 0);
    bt_hf_tokenizer_files f;
    int rc = bt_tokenizer_hf_from_gguf(g, 4096, &f);
    if (rc) fail_msg("%s: %s", name, bt_last_error());
    bt_gguf_close(g);
    assert_int_equal(f.bos, 1);
    assert_int_equal(f.unk, 0);
    assert_non_null(strstr(f.tokenizer_json, "\"byte_fallback\": true"));
    assert_non_null(strstr(f.tokenizer_json, "\"type\": \"Prepend\""));
    assert_non_null(strstr(f.tokenizer_config_json, "\"add_bos_token\": true"));
    assert_int_equal(tu_make_tmpdir(dir, sizeof dir, "hfspm"), 0);
    tu_write_file(dir, "tokenizer.json", f.tokenizer_json, strlen(f.tokenizer_json));
    tu_write_file(dir, "tokenizer_config.json", f.tokenizer_config_json, strlen(f.tokenizer_config_json));
    bt_hf_tokenizer_files_free(&f);
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    bt_tokenizer *t = load(path);
    assert_int_equal(bt_tokenizer_vocab_size(t), 32000 + (strcmp(name, "phi-3") ? 0 : 64));
    assert_int_equal(bt_tokenizer_bos(t), 1);
    char ids[256], label[64];
    snprintf(ids, sizeof ids, FIX "%s_stress_ids.bin.zst", name);
    snprintf(label, sizeof label, "%s/hf-export", name);
    g_valid_only = 1;
    size_t bad = check_family(label, t, &g_stress, ids, 1, NULL);
    g_valid_only = 0;
    assert_int_equal(bad, 0);
    bt_tokenizer_free(t);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    assert_int_equal(system(cmd), 0);
}

static void test_hf_export_llama_spm(void **state) {
    (void)state;
    hf_export_case("llama-spm", "ggml-vocab-llama-spm.gguf");
}

static void test_hf_export_phi3(void **state) {
    (void)state;
    hf_export_case("phi-3", "ggml-vocab-phi-3.gguf");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_llama_spm),
        cmocka_unit_test(test_phi3),
        cmocka_unit_test(test_gemma3),
        cmocka_unit_test(test_mistral_json),
        cmocka_unit_test(test_json_options),
        cmocka_unit_test(test_hf_export_llama_spm),
        cmocka_unit_test(test_hf_export_phi3),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
