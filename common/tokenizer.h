/* Byte-level BPE tokenizer (GPT-2 family) built from a GGUF vocabulary.
 * Algorithm: HF tokenizers ByteLevel BPE (bytes -> GPT-2 byte-to-unicode alphabet, merges by
 * rank, lowest rank first) after pre-tokenisation by regex (PCRE2 with UTF + UCP).
 * Pre-tokenisers by tokenizer.ggml.pre (llama.cpp src/llama-vocab.cpp):
 *   "smollm" (and "gpt2"-with-digits): split each \p{N} individually, then the GPT-2 pattern
 *   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 *   "gpt2": the GPT-2 pattern alone.
 * Added tokens are matched as whole strings before pre-tokenisation, leftmost then longest, as HF
 * added_tokens do: control tokens (token_type 3) only when parse_special is set, user-defined
 * tokens (token_type 4) always. Parity: tests/fixtures/tokenizer (tokenizers 0.20.3).
 * A bt_tokenizer is immutable after creation: every function below is thread-safe. */
#ifndef BT_TOKENIZER_H
#define BT_TOKENIZER_H
#include <stddef.h>
#include <stdint.h>

#include "gguf.h"

typedef struct bt_tokenizer bt_tokenizer;

/* Growable int32 vector (ids or masks). Zero-initialise; free with bt_ids_free. */
typedef struct {
    int32_t *v;
    size_t n, cap;
} bt_ids;
void bt_ids_push(bt_ids *a, int32_t x);
void bt_ids_free(bt_ids *a);

/* Build from the tokenizer.ggml.* keys of an open GGUF (model "gpt2"; tokens, merges,
 * token_type, pre, bos/eos/unknown/padding ids, chat_template). The GGUF may be closed
 * afterwards (everything is copied); *out is owned by the caller (bt_tokenizer_free), NULL on
 * failure. Merges are "A B" strings, rank = index (later duplicates win, as HF's merge map).
 * Errors: BT_ERR_UNSUPPORTED for other tokenizer models/pre types; BT_ERR_NOTFOUND for a missing
 * model/pre/tokens/merges key; BT_ERR_FORMAT for zero merges, a merge whose parts or result are
 * not in the vocabulary, a token_type count differing from the token count. A bos/eos/pad id
 * outside the vocabulary is logged and treated as absent (-1). Added tokens whose text is not
 * valid UTF-8 are never matched. */
int bt_tokenizer_from_gguf(bt_tokenizer **out, const bt_gguf *g);
/* Convenience: open the file, build, close. */
int bt_tokenizer_load(bt_tokenizer **out, const char *path);
void bt_tokenizer_free(bt_tokenizer *t);

/* Encode `len` bytes of UTF-8 `text`, appending ids to *out. Adds no BOS/EOS. Invalid UTF-8 is
 * first replaced, one U+FFFD per maximal invalid subpart (Python bytes.decode("utf-8",
 * errors="replace"); HF tokenizers only accept valid strings), so decoding gives that text back.
 * With parse_special == 0 control-token strings are ordinary text; user-defined tokens
 * (token_type 4, HF non-special added tokens) are always matched. BT_ERR_INVALID on NULL t/out
 * (text may be NULL when len == 0), BT_ERR_NOMEM. Thread-safe. */
int bt_tokenize(const bt_tokenizer *t, const char *text, size_t len, int parse_special, bt_ids *out);
/* Decode ids to a malloc'd NUL-terminated byte string (*out, *out_len without the NUL; caller
 * frees). HF ByteLevel decoder byte mapping, but the raw bytes are returned (no lossy UTF-8
 * repair), so decoding token by token and concatenating equals decoding all at once.
 * Control/unknown/unused tokens are emitted as their text when keep_special, else skipped.
 * BT_ERR_RANGE for an id outside [0, vocab) (*out stays NULL), BT_ERR_INVALID, BT_ERR_NOMEM. */
int bt_detokenize(const bt_tokenizer *t, const int32_t *ids, size_t n, int keep_special,
                  char **out, size_t *out_len);

int32_t bt_tokenizer_vocab_size(const bt_tokenizer *t);
/* Id of an exact token string (e.g. "<|im_start|>"), -1 if absent. */
int32_t bt_tokenizer_find(const bt_tokenizer *t, const char *piece);
/* Token text (in the GPT-2 byte alphabet, as stored in the vocabulary), NULL if out of range. */
const char *bt_tokenizer_piece(const bt_tokenizer *t, int32_t id);
/* Bytes one token decodes to (what bt_detokenize emits for it with keep_special): pointer into
 * the tokenizer, not NUL-terminated, length in *len; NULL (and *len = 0) if id out of range. */
const uint8_t *bt_tokenizer_token_bytes(const bt_tokenizer *t, int32_t id, size_t *len);
/* GGUF token type of id (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte;
 * llama.cpp llama_token_type), -1 if out of range. */
int bt_tokenizer_token_type(const bt_tokenizer *t, int32_t id);
int32_t bt_tokenizer_bos(const bt_tokenizer *t); /* -1 if none */
int32_t bt_tokenizer_eos(const bt_tokenizer *t);
int32_t bt_tokenizer_pad(const bt_tokenizer *t);
/* The chat template string from the GGUF (NULL if none). */
const char *bt_tokenizer_chat_template(const bt_tokenizer *t);
/* Pre-tokeniser name ("smollm", "gpt2", ...). */
const char *bt_tokenizer_pre(const bt_tokenizer *t);

#endif
