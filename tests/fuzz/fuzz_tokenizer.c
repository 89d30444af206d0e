/* libFuzzer target: bt_tokenize / bt_detokenize on arbitrary bytes with the real model vocabulary.
 * Input: byte 0 bit 0 = parse_special; the rest is the text.
 * Invariants: tokenize never fails on any bytes; every id is in [0, vocab); for valid UTF-8 text
 * made only of bytes the vocabulary has a byte token for, decoding the ids (keep_special) gives
 * the text back exactly (byte-level BPE is lossless there; with parse_special control tokens
 * decode to their own text). SmolLM2's vocabulary lacks the byte tokens of 0x04 0x06 0x13 0x14
 * 0x16 0x1d, and HF tokenizers (no unk token, no byte fallback) drops such bytes: so do we.
 * Decoding token by token and concatenating equals decoding everything at once. The dedicated
 * pre-tokenizer (the model's default engine) and the PCRE2 one give the same ids. */
#include <stdint.h>
#include <string.h>

#include "fuzz_common.h"
#include "loaderd/format.h"

/* byte_ok[b]: the vocabulary has a token decoding to exactly the byte b */
static unsigned char byte_ok[256];
static int byte_ok_ready;

static void init_byte_ok(const bt_tokenizer *tok) {
    int32_t vocab = bt_tokenizer_vocab_size(tok);
    for (int32_t id = 0; id < vocab; id++) {
        size_t len = 0;
        const uint8_t *b = bt_tokenizer_token_bytes(tok, id, &len);
        int type = bt_tokenizer_token_type(tok, id);
        if (b && len == 1 && type != 3) byte_ok[b[0]] = 1;
    }
    byte_ok_ready = 1;
}

/* The same tokenizer on the PCRE2 pre-tokenizer (the differential reference). */
static const bt_tokenizer *pcre2_tokenizer(void) {
    static bt_tokenizer *tok;
    if (!tok) {
        const char *path = getenv("BT_MODEL");
        if (bt_tokenizer_load(&tok, path && *path ? path : FUZZ_DEFAULT_MODEL) || bt_tokenizer_set_pre_engine(tok, 0))
            fuzz_fail("cannot load the PCRE2 reference tokenizer");
    }
    return tok;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const bt_tokenizer *tok = fuzz_tokenizer();
    if (!byte_ok_ready) init_byte_ok(tok);
    if (size == 0) return 0;
    int special = data[0] & 1;
    const char *text = (const char *)data + 1;
    size_t n = size - 1;
    bt_ids ids = {0};
    if (bt_tokenize(tok, n ? text : NULL, n, special, &ids)) fuzz_fail("bt_tokenize failed");
    bt_ids ref = {0};
    if (bt_tokenize(pcre2_tokenizer(), n ? text : NULL, n, special, &ref)) fuzz_fail("bt_tokenize (PCRE2) failed");
    if (ref.n != ids.n || (ids.n && memcmp(ref.v, ids.v, ids.n * sizeof *ids.v) != 0))
        fuzz_fail("dedicated and PCRE2 pre-tokenizers give different ids");
    bt_ids_free(&ref);
    int32_t vocab = bt_tokenizer_vocab_size(tok);
    for (size_t i = 0; i < ids.n; i++)
        if (ids.v[i] < 0 || ids.v[i] >= vocab) fuzz_fail("token id out of range");
    int covered = 1;
    for (size_t i = 0; i < n && covered; i++) covered = byte_ok[data[1 + i]];
    if (n > 0 && ids.n == 0 && covered) fuzz_fail("non-empty text gave no tokens");
    char *all = NULL;
    size_t all_len = 0;
    if (bt_detokenize(tok, ids.v, ids.n, 1, &all, &all_len)) fuzz_fail("bt_detokenize failed on its own ids");
    if (covered && ld_utf8_check((const uint8_t *)text, n) == n && (all_len != n || memcmp(all, text, n) != 0))
        fuzz_fail("decode(encode(valid UTF-8)) differs from the text");
    size_t off = 0;
    for (size_t i = 0; i < ids.n; i++) {
        size_t len = 0;
        const uint8_t *b = bt_tokenizer_token_bytes(tok, ids.v[i], &len);
        if (!b || off + len > all_len || memcmp(all + off, b, len) != 0)
            fuzz_fail("token-by-token decoding differs from decoding at once");
        off += len;
    }
    if (off != all_len) fuzz_fail("token-by-token decoding has a different length");
    free(all);
    bt_ids_free(&ids);
    return 0;
}
