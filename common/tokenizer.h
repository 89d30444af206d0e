/* Byte-level BPE tokenizer (GPT-2 family) built from a GGUF vocabulary.
 * Algorithm: HF tokenizers ByteLevel BPE (bytes -> GPT-2 byte-to-unicode alphabet, merges by
 * rank, lowest rank first) after pre-tokenisation by regex (PCRE2 with UTF + UCP).
 * Pre-tokenisers by tokenizer.ggml.pre (llama.cpp src/llama-vocab.cpp):
 *   "smollm" (and "gpt2"-with-digits): split each \p{N} individually, then the GPT-2 pattern
 *   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 *   "gpt2": the GPT-2 pattern alone.
 * Special (control / user-defined) tokens are matched as whole strings before pre-tokenisation
 * when parse_special is set (longest match first), as HF added_tokens do.
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
 * afterwards (everything is copied). BT_ERR_UNSUPPORTED for other tokenizer models/pre types. */
int bt_tokenizer_from_gguf(bt_tokenizer **out, const bt_gguf *g);
/* Convenience: open the file, build, close. */
int bt_tokenizer_load(bt_tokenizer **out, const char *path);
void bt_tokenizer_free(bt_tokenizer *t);

/* Encode `len` bytes of UTF-8 `text`, appending ids to *out. Invalid UTF-8 bytes are encoded as
 * their byte tokens (as HF does after lossless byte mapping). Adds no BOS/EOS. */
int bt_tokenize(const bt_tokenizer *t, const char *text, size_t len, int parse_special, bt_ids *out);
/* Decode ids to a malloc'd NUL-terminated byte string (*out, *out_len without the NUL).
 * Special tokens are emitted as their text when keep_special, else skipped. */
int bt_detokenize(const bt_tokenizer *t, const int32_t *ids, size_t n, int keep_special,
                  char **out, size_t *out_len);

int32_t bt_tokenizer_vocab_size(const bt_tokenizer *t);
/* Id of an exact token string (e.g. "<|im_start|>"), -1 if absent. */
int32_t bt_tokenizer_find(const bt_tokenizer *t, const char *piece);
/* Token text (in the GPT-2 byte alphabet, as stored in the vocabulary), NULL if out of range. */
const char *bt_tokenizer_piece(const bt_tokenizer *t, int32_t id);
int32_t bt_tokenizer_bos(const bt_tokenizer *t); /* -1 if none */
int32_t bt_tokenizer_eos(const bt_tokenizer *t);
int32_t bt_tokenizer_pad(const bt_tokenizer *t);
/* The chat template string from the GGUF (NULL if none). */
const char *bt_tokenizer_chat_template(const bt_tokenizer *t);
/* Pre-tokeniser name ("smollm", "gpt2", ...). */
const char *bt_tokenizer_pre(const bt_tokenizer *t);

#endif
