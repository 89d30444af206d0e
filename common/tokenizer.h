/* Byte-level BPE and SentencePiece-family tokenizers with the exact semantics of their references:
 * Hugging Face `tokenizers` 0.20.3 for tokenizer.json files (byte-level BPE; BPE over chars with
 * byte_fallback, as SentencePiece models converted by transformers: Llama 2, Mistral, Gemma) and
 * llama.cpp b4965 for SentencePiece GGUF vocabularies (tokenizer.ggml.model "llama",
 * tokenizer_spm.c); fixtures from tests/reference/gen_tokenizer_fixtures.py and
 * gen_tokenizer_spm_fixtures.py.
 * Sources: a GGUF's tokenizer.ggml.* metadata, or a Hugging Face tokenizer.json (plain or
 * zstd-compressed; a model directory means its tokenizer.json, with tokenizer_config.json for
 * bos/eos/pad and chat_template).
 * Pipeline (HF Tokenizer::encode, add_special_tokens = false): invalid UTF-8 replaced; added
 * tokens split out (HF AddedVocabulary: leftmost-longest; special ones only when parse_special,
 * non-special ones always; lstrip/rstrip/single_word/normalized honoured); normalizer (NFC, NFD,
 * NFKC, NFKD via utf8proc); pre-tokenizers (Split with Oniguruma patterns run on PCRE2, Digits,
 * ByteLevel; the standard pipelines on dedicated scanners, bt_tokenizer_pre_engine); BPE (merge
 * ranks, ignore_merges; a per-thread piece cache). Families covered by fixtures: SmolLM2
 * (Digits + GPT-2 regex), Llama 3 (cl100k Split, ignore_merges), Qwen2 (NFC, Split with single
 * digits). Details: tokenizer.c (core), tokenizer_pre.c, tokenizer_gguf.c, tokenizer_json.c.
 * A bt_tokenizer is immutable after creation: every function below is thread-safe. */
#ifndef BT_TOKENIZER_H
#define BT_TOKENIZER_H
#include <stddef.h>
#include <stdint.h>

#include "common/bt_vec.h"
#include "gguf.h"

typedef struct bt_tokenizer bt_tokenizer;

/* Build from the tokenizer.ggml.* keys of an open GGUF. Model "llama" (SentencePiece): tokens,
 * scores, token_type, add_space_prefix (default true), bos/eos/unknown ids (llama.cpp's defaults 1,
 * 2, 0 when absent), encoded as llama.cpp does (tokenizer_spm.c; pre "spm"). Model "gpt2" (tokens, merges,
 * token_type, pre, bos/eos/unknown/padding ids, chat_template). The GGUF may be closed
 * afterwards (everything is copied); *out is owned by the caller (bt_tokenizer_free), NULL on
 * failure. Merges are "A B" strings, rank = index (later duplicates win, as HF's merge map).
 * Pre types (tokenizer_gguf.c): gpt2, smollm, llama-bpe/llama3 (ignore_merges), qwen2 (NFC).
 * Control tokens (type 3) are HF special added tokens, user-defined ones (type 4) non-special.
 * Errors: BT_ERR_UNSUPPORTED for other tokenizer models/pre types; BT_ERR_FORMAT for scores that
 * are not one f32 per token; BT_ERR_NOTFOUND for a missing
 * model/pre/tokens/merges key; BT_ERR_FORMAT for zero merges, a merge whose parts or result are
 * not in the vocabulary, a token_type count differing from the token count. A bos/eos/pad id
 * outside the vocabulary is logged and treated as absent (-1). Added tokens whose text is not
 * valid UTF-8 are never matched. */
int bt_tokenizer_from_gguf(bt_tokenizer **out, const bt_gguf *g);
/* Build from the text of a Hugging Face tokenizer.json (json, len bytes; UTF-8) and optionally
 * its tokenizer_config.json (config may be NULL): supported components and defaults are listed
 * in tokenizer_json.c. Vocabulary size = largest id in model.vocab or added_tokens + 1; ids
 * used by neither are holes (token type 5, empty text). Token types: 1 model tokens, 3 special
 * added tokens, 4 non-special added tokens. bos/eos: tokenizer_config.json bos_token/eos_token,
 * else the special tokens a TemplateProcessing post_processor puts before/after $A, else -1;
 * pad: tokenizer_config.json pad_token or -1. *out owned by the caller, NULL on failure.
 * Errors: BT_ERR_FORMAT (malformed JSON, missing model/vocab/merges, merge parts not in the
 * vocabulary, conflicting ids), BT_ERR_UNSUPPORTED (model other than BPE, byte_fallback with a
 * ByteLevel pre-tokenizer, dropout, unsupported normalizer/pre-tokenizer/decoder or regex
 * construct; the message names it), BT_ERR_INVALID (NULL arguments). Without a ByteLevel step the
 * model is a BPE over chars (SentencePiece-converted files): chars found in model.vocab, else
 * their bytes' "<0xNN>" tokens with byte_fallback, else unk_token (fused with fuse_unk); pre "sentencepiece". */
int bt_tokenizer_from_json(bt_tokenizer **out, const char *json, size_t len, const char *config, size_t config_len);
/* Load by content: a file starting with "GGUF" -> bt_tokenizer_from_gguf; otherwise a
 * tokenizer.json, plain or zstd-compressed (frame magic 28 B5 2F FD); a directory -> its
 * tokenizer.json. A tokenizer_config.json in the same directory is read for bos/eos/pad and
 * chat_template. Errors: BT_ERR_IO (missing/unreadable), those of the builders. */
int bt_tokenizer_load(bt_tokenizer **out, const char *path);
void bt_tokenizer_free(bt_tokenizer *t);

/* Encode `len` bytes of UTF-8 `text`, appending int32 ids to *out (HF encode(text,
 * add_special_tokens=False); for a SentencePiece GGUF vocabulary llama_tokenize(add_special =
 * false), which reads the bytes as given: no replacement, invalid bytes become their <0xNN>
 * tokens). Adds no BOS/EOS. Otherwise invalid UTF-8 is first replaced, one U+FFFD per
 * maximal invalid subpart (Python bytes.decode("utf-8", errors="replace"); HF tokenizers only
 * accept valid strings), so decoding gives that text back (normalizers aside). With
 * parse_special == 0 special-token strings are ordinary text (HF encode_special_tokens = True);
 * non-special added tokens (token_type 4) are always matched. BT_ERR_INVALID on NULL t/out
 * (text may be NULL when len == 0), BT_ERR_RANGE (input > 2 GiB), BT_ERR_NOMEM (the text's
 * tokens or scratch do not fit in memory, whatever the tokenizer family: never an abort, loaderd
 * skips and counts such a document); on error nothing is appended. Thread-safe. */
int bt_tokenize(const bt_tokenizer *t, const char *text, size_t len, int parse_special, bt_ids *out);
/* One run of text between two special tokens of a larger input (a chat rendering cut at its
 * template's special tokens), tokenized as bt_tokenize(parse_special = 0) does that run inside the
 * whole input: at_start says whether the run begins the input (HF Metaspace prepend_scheme
 * "first" prepends U+2581 only there); a SentencePiece GGUF vocabulary gives every run the space
 * prefix, as llama.cpp does for a fragment after a token. Whitespace a neighbouring special token
 * absorbs (bt_tokenizer_strip) must already be cut off by the caller. Same errors as bt_tokenize. */
int bt_tokenize_run(const bt_tokenizer *t, const char *text, size_t len, int at_start, bt_ids *out);
/* Bytes of whitespace the special token `id` absorbs from text[0..len): after = 1: at the start of
 * the text that follows it (rstrip), after = 0: at the end of the text before it (lstrip).
 * SentencePiece GGUF: llama.cpp's LLAMA_TOKEN_ATTR_RSTRIP / LSTRIP (C isspace bytes; phi-3 gives
 * its special tokens RSTRIP); tokenizer.json: the added token's rstrip / lstrip (Unicode
 * White_Space). 0 for a token without that attribute. */
size_t bt_tokenizer_strip(const bt_tokenizer *t, int32_t id, const char *text, size_t len, int after);
/* Free the calling thread's piece cache (bt_tokenize keeps, per thread, the ids of up to 8192
 * recent short pre-tokens, 256 KiB, as HF's BPE model caches words; freed at thread exit anyway).
 * The next bt_tokenize on this thread starts cold. Benchmarks call it between passes over the
 * same text so that the figures are not those of a memorised corpus. */
void bt_tokenize_release_cache(void);
/* Decode ids to a malloc'd NUL-terminated byte string (*out, *out_len without the NUL; caller
 * frees). SentencePiece families: U+2581 -> " ", "<0xNN>" -> the byte (llama.cpp token_to_piece /
 * HF Replace + ByteFallback), no leading space removed (llama.cpp and HF's Strip drop the one
 * add_space_prefix put in front). Byte-level: HF ByteLevel decoder byte mapping, but the raw bytes are returned (no lossy UTF-8
 * repair), so decoding token by token and concatenating equals decoding all at once.
 * Control/unknown/unused tokens are emitted as their text when keep_special, else skipped.
 * BT_ERR_RANGE for an id outside [0, vocab) (*out stays NULL), BT_ERR_INVALID, BT_ERR_NOMEM. */
int bt_detokenize(const bt_tokenizer *t, const int32_t *ids, size_t n, int keep_special,
                  char **out, size_t *out_len);

/* Hugging Face tokenizer files for a GGUF's tokenizer (common/tokenizer_hf.c). */
typedef struct {
    char *tokenizer_json;          /* tokenizer.json (malloc'd JSON text) */
    char *tokenizer_config_json;   /* tokenizer_config.json: PreTrainedTokenizerFast, bos/eos/pad/
                                    * unk tokens, added_tokens_decoder, chat_template */
    char *special_tokens_map_json; /* special_tokens_map.json */
    int32_t bos, eos, pad, unk;    /* tokenizer.ggml.*_token_id, -1 if none */
} bt_hf_tokenizer_files;
/* Build the three files from the tokenizer.ggml.* keys of an open GGUF: the vocabulary (every
 * token at its GGUF id; a duplicated string keeps the id our tokenizer reads it as), control
 * tokens (type 3) as special added tokens and user-defined ones (type 4) as non-special, none
 * normalized. So AutoTokenizer.from_pretrained on the result encodes exactly as bt_tokenize does
 * on the GGUF.
 * Byte-level ("gpt2") vocabularies: merges in rank order ("a b" strings); the pre-tokeniser
 * pipeline of the model family's own tokenizer.json for tokenizer.ggml.pre (the table of
 * bt_tokenizer_from_gguf: gpt2 ByteLevel; smollm Digits + ByteLevel; llama-bpe / llama3 cl100k
 * Split + ByteLevel, ignore_merges; qwen2 NFC + Split), a ByteLevel decoder, and a ByteLevel
 * post-processor (plus TemplateProcessing adding BOS / EOS when tokenizer.ggml.add_bos_token /
 * add_eos_token are true). transformers' own GGUF conversion (integrations/ggml.py) does not: it
 * gives every "gpt2" GGUF plain ByteLevel.
 * SentencePiece ("llama": Llama 2, Mistral, TinyLlama, Phi-3, Gemma) vocabularies: the HF form of
 * llama.cpp's tokenizer (Llama 2's / Gemma's tokenizer.json layout): BPE with byte_fallback,
 * fuse_unk and the unknown token; merges = every split of a piece into two pieces, ranked by the
 * merged piece's score (tokenizer_hf_spm.c; transformers' generate_merges order), as ["a", "b"]
 * pairs; normalizer Prepend("\u2581") (only with tokenizer.ggml.add_space_prefix, default true)
 * + Replace(" ", "\u2581"), no pre-tokenizer; decoder Replace("\u2581", " ") + ByteFallback +
 * Fuse (+ Strip(" ", 1, 0) with the space prefix); unknown-type tokens special too; llama.cpp's
 * LSTRIP / RSTRIP attributes (Phi-3) on the added tokens; TemplateProcessing adding BOS / EOS
 * per add_bos_token (default true, as llama.cpp) / add_eos_token. Checked against llama.cpp's
 * ids and detokenizer on the parity and stress corpora (tests/py/test_export_spm_tokenizer.py).
 * tokenizer_config.json lists every other control token as additional_special_tokens and sets
 * model_max_length (when > 0) and chat_template (tokenizer.chat_template). Errors: those of
 * bt_tokenizer_from_gguf; BT_ERR_UNSUPPORTED for a token, merge or chat template that is not
 * valid UTF-8 (JSON cannot carry it); BT_ERR_RANGE for a SentencePiece vocabulary implying more
 * than BT_TOKENIZER_MAX_MERGES merges; BT_ERR_NOMEM. *f is zeroed on failure; free with
 * bt_hf_tokenizer_files_free. */
int bt_tokenizer_hf_from_gguf(const bt_gguf *g, int64_t model_max_length, bt_hf_tokenizer_files *f);
void bt_hf_tokenizer_files_free(bt_hf_tokenizer_files *f);

int32_t bt_tokenizer_vocab_size(const bt_tokenizer *t);

/* ---- bounds and memory (issue 21 §8: a tokenizer is data a user may name) ----
 * Every loader refuses a tokenizer past these bounds (BT_ERR_RANGE, naming the bound) before
 * anything proportional to it is allocated. BT_TOKENIZER_MAX_VOCAB: 2^20 = 1,048,576 ids, four
 * times the largest real vocabularies (Gemma 3: 262,144; Gemma 2: 256,000; Llama 4: 202,048;
 * Qwen2/3: 151,936; Llama 3: 128,256), so every real tokenizer loads while no file can make a
 * load cost more than ~200 MiB. Token text: 64 MiB in all (real ones: 1-3 MB). Merges: 2^21
 * (real: at most ~280k, Llama 3). */
#define BT_TOKENIZER_MAX_VOCAB (1u << 20)
#define BT_TOKENIZER_MAX_TEXT ((uint64_t)64 << 20)
#define BT_TOKENIZER_MAX_MERGES (2u << 20)
/* Bytes a loaded tokenizer holds (its tables, strings, regexes; what it keeps resident). */
uint64_t bt_tokenizer_mem_bytes(const bt_tokenizer *t);
/* Upper bound of the memory bt_tokenizer_load(path) will hold at its peak (*bytes), read from
 * the file without loading it: for a GGUF, from the counts and string sizes of its
 * tokenizer.ggml.* arrays (mapped, nothing proportional to them kept); for a tokenizer.json,
 * 20 x its text (the parsed JSON tree dominates; plus tokenizer_config.json). BT_ERR_RANGE for a
 * tokenizer past the bounds above, else the errors of bt_tokenizer_load's first steps (BT_ERR_IO,
 * BT_ERR_FORMAT, ...). loaderd checks it against memory_budget_bytes before loading. */
int bt_tokenizer_load_estimate(const char *path, uint64_t *bytes);
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
/* The chat template (GGUF tokenizer.chat_template or tokenizer_config.json chat_template; NULL
 * if none). */
const char *bt_tokenizer_chat_template(const bt_tokenizer *t);
/* Pre-tokeniser family: the GGUF pre name ("smollm", "gpt2", "llama-bpe", "qwen2"; "spm" for a
 * SentencePiece GGUF), or for a tokenizer.json "smollm", "gpt2", "llama3", "qwen2" when the
 * pipeline is exactly that family's, "sentencepiece" for a BPE over chars, else "custom". */
const char *bt_tokenizer_pre(const bt_tokenizer *t);
/* Engine running the pre-tokenizers: "spm" (a SentencePiece GGUF: no pre-tokenizer), "none" (no
 * regex step, e.g. Metaspace or none), a dedicated scanner ("gpt2": GPT-2 ByteLevel regex;
 * "smollm": Digits(individual_digits) + GPT-2; "llama3": cl100k Split; "qwen2": Qwen2 Split;
 * no regex engine, so no JIT is needed, e.g. under W^X) chosen automatically when the pipeline
 * is exactly one of those, else "pcre2" (Oniguruma patterns on PCRE2, tokenizer_pre.c). Both
 * give the same ids (tests/unit/common/test_tokenizer_pre.c). */
const char *bt_tokenizer_pre_engine(const bt_tokenizer *t);
/* Version of the encoding behaviour (bt_tokenize's ids for given tokenizer contents); bumped
 * whenever a change makes any input tokenize differently, so that caches keyed by
 * bt_tokenizer_digest (loaderd's token cache) never serve ids of the old behaviour. */
#define BT_TOKENIZER_IMPL_VERSION 1u
/* Feed a canonical description of everything that determines bt_tokenize's output (vocabulary
 * pieces and types, merges in rank order, added tokens and their flags, normalizers,
 * pre-tokenizer steps with their patterns, unk/bos/eos/pad, BT_TOKENIZER_IMPL_VERSION) to
 * update(ctx, bytes, n), in pieces; the caller hashes it (loaderd: SHA-256). Equal
 * descriptions give equal ids for every input; the engine (dedicated or PCRE2) is not part of
 * it (same ids). A few MB for a 150k vocabulary. */
void bt_tokenizer_digest(const bt_tokenizer *t, void (*update)(void *ctx, const void *p, size_t n), void *ctx);
/* Force the PCRE2 engine (dedicated = 0) or go back to the dedicated one (1; BT_ERR_UNSUPPORTED
 * when the pipeline has none). For tests and benchmarks: call before the tokenizer is shared
 * between threads. BT_ERR_INVALID on NULL. */
int bt_tokenizer_set_pre_engine(bt_tokenizer *t, int dedicated);

#endif
