/* libFuzzer target: the SentencePiece-family tokenizers on arbitrary bytes.
 * Input: byte 0 bit 0 = parse_special, bit 1 = which tokenizer (0: a GGUF SentencePiece vocabulary,
 * common/tokenizer_spm.c: $BT_SPM_GGUF, default models/tokenizers/ggml-vocab-llama-spm.gguf
 * (scripts/fetch-tokenizers), or when that file is absent the real Gemma 3 GGUF, or else the
 * tokenizer.json below; 1: tests/fixtures/tokenizer/mistral-v0.1-tokenizer.json.zst, a BPE over
 * chars with byte_fallback); the rest is the text.
 * Invariants: tokenize never fails on any bytes; every id is in [0, vocab); decoding token by
 * token and concatenating equals decoding at once; and, where the text holds no U+2581 (which
 * the vocabulary's escaping makes a space again) and parse_special is off:
 *   valid UTF-8 on a GGUF vocabulary with every <0xNN> byte token: decode(encode(text)) is the
 *     text exactly, after the one " " that add_space_prefix puts in front (invalid UTF-8 is
 *     tokenized as llama.cpp does, byte for byte, but an invalid lead byte there can swallow part
 *     of an escaped space, which then decodes as the bytes of U+2581: llama.cpp's own reading);
 *   valid UTF-8 on the tokenizer.json (HF replaces invalid UTF-8 first): the same, with the
 *     Prepend("\u2581") of its normalizer. */
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "fuzz_common.h"
#include "loaderd/format.h"

static const bt_tokenizer *load_once(bt_tokenizer **slot, const char *const *paths) {
    if (!*slot) {
        bt_log_set_level(BT_LOG_ERROR);
        for (int i = 0; paths[i] && !*slot; i++)
            if (access(paths[i], R_OK) == 0 && bt_tokenizer_load(slot, paths[i]) != 0)
                fuzz_fail("cannot load a SentencePiece tokenizer");
        if (!*slot) {
            fprintf(stderr, "fuzz: no SentencePiece tokenizer found (run make tokenizers)\n");
            exit(2);
        }
    }
    return *slot;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static bt_tokenizer *gguf, *json;
    static const char *json_paths[] = {"tests/fixtures/tokenizer/mistral-v0.1-tokenizer.json.zst", NULL};
    const char *env = getenv("BT_SPM_GGUF");
    const char *gguf_paths[] = {env && *env ? env : "models/tokenizers/ggml-vocab-llama-spm.gguf",
                                "models/gemma-3-270m-q4_k_m.gguf", json_paths[0], NULL};
    if (size == 0) return 0;
    int special = data[0] & 1, use_json = (data[0] >> 1) & 1;
    const bt_tokenizer *tok = use_json ? load_once(&json, json_paths) : load_once(&gguf, gguf_paths);
    const char *text = (const char *)data + 1;
    size_t n = size - 1;
    bt_ids ids = {0};
    if (bt_tokenize(tok, n ? text : NULL, n, special, &ids)) fuzz_fail("bt_tokenize failed");
    int32_t vocab = bt_tokenizer_vocab_size(tok);
    for (size_t i = 0; i < ids.n; i++)
        if (ids.v[i] < 0 || ids.v[i] >= vocab) fuzz_fail("token id out of range");
    char *all = NULL;
    size_t all_len = 0;
    if (bt_detokenize(tok, ids.v, ids.n, 1, &all, &all_len)) fuzz_fail("bt_detokenize failed on its own ids");
    size_t off = 0;
    for (size_t i = 0; i < ids.n; i++) {
        size_t len = 0;
        const uint8_t *b = bt_tokenizer_token_bytes(tok, ids.v[i], &len);
        if (!b || off + len > all_len || memcmp(all + off, b, len) != 0)
            fuzz_fail("token-by-token decoding differs from decoding at once");
        off += len;
    }
    if (off != all_len) fuzz_fail("token-by-token decoding has a different length");
    int escaped = n >= 3 && memmem(text, n, "\xe2\x96\x81", 3) != NULL;
    int prefix = strcmp(bt_tokenizer_pre(tok), "spm") == 0 ? bt_tokenizer_find(tok, "<0xFF>") >= 0 : 1;
    int lossless = ld_utf8_check((const uint8_t *)text, n) == n &&
                   (strcmp(bt_tokenizer_pre(tok), "spm") != 0 || bt_tokenizer_find(tok, "<0xFF>") >= 0);
    if (n > 0 && !special && !escaped && lossless && bt_tokenizer_vocab_size(tok) < 100000) {
        /* (Gemma's vocabulary has no space prefix and user-defined tokens: checked only by parity) */
        if (all_len != n + (size_t)prefix || (prefix && all[0] != ' ') || memcmp(all + prefix, text, n) != 0)
            fuzz_fail("decode(encode(text)) is not the text");
    }
    free(all);
    bt_ids_free(&ids);
    return 0;
}
