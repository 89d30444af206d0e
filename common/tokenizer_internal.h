/* Internal layout shared by the tokenizer sources (not a public header):
 *   tokenizer.c       core: vocabulary/merges tables, added-token splitting, BPE, encode/decode
 *   tokenizer_pre.c   normalizers (utf8proc), regex translation (Oniguruma -> PCRE2), pre-tokenizers
 *   tokenizer_gguf.c  builder from GGUF tokenizer.ggml.* metadata
 *   tokenizer_json.c  builder from a Hugging Face tokenizer.json (+ tokenizer_config.json)
 *   tokenizer_hf.c    Hugging Face tokenizer files for a GGUF vocabulary (tokenizer_hf_spm.c:
 *                     the merges of a SentencePiece one)
 * Reference implementation everywhere: Hugging Face tokenizers 0.20.3 (tokenizers/src/...). */
#ifndef BT_TOKENIZER_INTERNAL_H
#define BT_TOKENIZER_INTERNAL_H
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stddef.h>
#include <stdint.h>

#include "common/bt_common.h"
#include "common/tokenizer.h"

/* GGUF token types (llama.cpp llama_token_type / gguf-py TokenType). */
enum { TT_NORMAL = 1, TT_UNKNOWN = 2, TT_CONTROL = 3, TT_USER = 4, TT_UNUSED = 5, TT_BYTE = 6 };

/* Normalizers (HF normalizers/{unicode,prepend,replace}.rs). NORM_PREPEND / NORM_REPLACE take
 * their strings from bt_tokenizer.norm_a / norm_b. */
enum { NORM_NFC = 1, NORM_NFD, NORM_NFKC, NORM_NFKD, NORM_PREPEND, NORM_REPLACE };

/* Pre-tokenizer steps (HF pre_tokenizers/{split,digits,byte_level,metaspace}.rs). */
enum { PRE_SPLIT = 1, PRE_DIGITS, PRE_BYTELEVEL, PRE_METASPACE };

/* Vocabulary models (bt_tokenizer.model):
 *   MODEL_BYTELEVEL  HF BPE over the GPT-2 byte alphabet (pre-tokenizers end in ByteLevel)
 *   MODEL_CHARS      HF BPE over Unicode chars, byte_fallback to "<0xNN>" tokens, unk_token
 *                    (SentencePiece-converted tokenizer.json files: Llama 2, Mistral, Gemma)
 *   MODEL_SPM        llama.cpp's SentencePiece tokenizer (GGUF tokenizer.ggml.model "llama":
 *                    llm_tokenizer_spm, greedy merges by piece score; tokenizer_spm.c) */
enum { MODEL_BYTELEVEL = 0, MODEL_CHARS, MODEL_SPM };

/* Metaspace prepend_scheme (HF pre_tokenizers/metaspace.rs PrependScheme). */
enum { MS_NEVER = 0, MS_ALWAYS, MS_FIRST };

/* HF SplitDelimiterBehavior (tokenizer/normalizer.rs). */
enum { BEH_REMOVED = 0, BEH_ISOLATED, BEH_MERGED_PREV, BEH_MERGED_NEXT, BEH_CONTIGUOUS };

#define BT_TOK_MAX_NORM 8
#define BT_TOK_MAX_PRE 8

/* Patterns with a dedicated scanner (tokenizer_pre.c), recorded per step by the builders. */
enum { PAT_OTHER = 0, PAT_GPT2, PAT_LLAMA3, PAT_QWEN2 };

/* Dedicated pre-tokenizer pipelines (bt_tokenizer.fast_pre; tokenizer_pre.c bt_tok_pre_select). */
enum { FAST_NONE = 0, FAST_GPT2, FAST_DIGITS_GPT2, FAST_LLAMA3, FAST_QWEN2 };

typedef struct {
    int kind;
    int behavior;         /* PRE_SPLIT, PRE_DIGITS (Isolated or Contiguous) */
    int invert;           /* PRE_SPLIT */
    int add_prefix_space; /* PRE_BYTELEVEL */
    int pat;              /* PAT_*: which pattern `re` was compiled from (PAT_OTHER: any other) */
    pcre2_code *re;       /* PRE_SPLIT; PRE_BYTELEVEL with use_regex (GPT-2 pattern); else NULL */
    char *src;            /* the pattern as given (owned; NULL without re), for the digest */
    size_t src_len;
    int literal;          /* src is a Split String pattern (escaped before compiling) */
    int ms_prepend;       /* PRE_METASPACE: MS_* */
    int ms_split;         /* PRE_METASPACE: split into words before each replacement char */
    char ms_rep[8];       /* PRE_METASPACE: the replacement char, UTF-8, NUL-terminated ("\u2581") */
    uint8_t ms_rep_len;
} bt_pre_step;

/* SentencePiece-family state (MODEL_CHARS and MODEL_SPM). */
typedef struct bt_spm {
    float *score;          /* [n_vocab] MODEL_SPM: tokenizer.ggml.scores (0 when absent) */
    int add_space_prefix;  /* MODEL_SPM: " " before the first fragment and after each token */
    /* MODEL_SPM special-token partition (llama.cpp tokenizer_st_partition): the CONTROL /
     * USER_DEFINED / UNKNOWN ids in match order (text length descending), their flags, and a
     * byte trie over their texts. */
    int32_t *sp_id;
    uint8_t *sp_flag;      /* SPF_* */
    int32_t n_sp;
    int any_strip;         /* some sp_flag has SPF_LSTRIP / SPF_RSTRIP (phi-3, jina <mask>) */
    int32_t *trie;         /* nodes x (first child, next sibling, byte, sp index or -1) */
    int32_t trie_n;
    size_t trie_cap;       /* nodes allocated (bt_vec_xgrow: built once, at load) */
    int32_t root[256];     /* child of the root for each first byte, -1 */
    int32_t n_unk_bytes;   /* bytes without a <0xNN> / single-byte token (mapped to unk) */
} bt_spm;
enum { SPF_PARSE_ONLY = 1, SPF_LSTRIP = 2, SPF_RSTRIP = 4 };

/* Merge (a, b) -> id `new_id` of rank `rank`; key = a << 32 | b, UINT64_MAX marks an empty slot. */
struct bt_merge_slot {
    uint64_t key;
    int32_t rank, new_id;
};

/* One added token (HF AddedToken). text is what is matched: the content, or for normalized
 * tokens the content passed through the normalizer. */
typedef struct {
    int32_t id;
    uint32_t len;
    char *text;
    uint8_t special, lstrip, rstrip, single_word, normalized;
} bt_added;

/* A set of added tokens to match, ordered by (first byte asc, length desc): the first entry
 * matching at a position is the longest one there. */
typedef struct {
    int32_t *idx; /* indexes into bt_tokenizer.added */
    int32_t n;
    uint32_t first[257];
    int only_first; /* the first byte of every entry when they all share one (memchr), else -1 */
} bt_added_set;

struct bt_tokenizer {
    int32_t n_vocab;
    char *pieces;        /* NUL-terminated token strings (byte-level alphabet), concatenated */
    uint32_t *piece_off; /* [n_vocab + 1] */
    uint8_t *raw;        /* bytes each token decodes to, concatenated */
    uint32_t *raw_off;   /* [n_vocab + 1] */
    uint8_t *byte_ok;    /* [n_vocab] 1 if the piece maps fully through the byte alphabet */
    uint8_t *type;       /* [n_vocab] TT_* */
    int32_t *vslot;      /* piece-string hash, open addressing, -1 empty */
    uint32_t vmask;
    int32_t *rslot;      /* raw-bytes hash over byte_ok tokens (ignore_merges lookups) */
    uint32_t rmask;
    struct bt_merge_slot *merges; /* merge hash, open addressing (one cache line per probe) */
    uint32_t mmask;
    int32_t byte_id[256]; /* id of each single-byte token, -1 if absent */
    int32_t fb_id[256];   /* MODEL_CHARS / MODEL_SPM: id of "<0xNN>" (byte fallback), -1 if absent */
    int model;            /* MODEL_* */
    int byte_fallback;    /* MODEL_CHARS: HF BPE byte_fallback */
    int dup_last;         /* piece lookup: a duplicated string maps to its last id (llama.cpp) */
    int dec_replace;      /* MODEL_CHARS: the decoder replaces U+2581 by " " */
    int dec_bytefb;       /* MODEL_CHARS: the decoder maps "<0xNN>" tokens to bytes */
    int dec_strip;        /* MODEL_CHARS: HF decode drops one leading " " (Strip / Metaspace) */
    char *norm_a[BT_TOK_MAX_NORM], *norm_b[BT_TOK_MAX_NORM]; /* PREPEND: a; REPLACE: a -> b */
    size_t norm_al[BT_TOK_MAX_NORM], norm_bl[BT_TOK_MAX_NORM];
    bt_spm spm;
    int32_t unk;          /* BPE unk_token id or -1 */
    int fuse_unk, ignore_merges;
    bt_added *added;
    int32_t n_added;
    bt_added_set set_raw, set_norm; /* matched before / after normalisation */
    int norm[BT_TOK_MAX_NORM];
    int n_norm;
    bt_pre_step pre_steps[BT_TOK_MAX_PRE];
    int n_pre;
    pcre2_code *re_word; /* one Rust-regex \w char (single_word checks) */
    char *pre, *chat_template;
    int32_t bos, eos, pad;
    int fast_pre;        /* FAST_*: pre_steps run by a dedicated scanner instead of PCRE2 */
    int fast_avail;      /* what bt_tok_pre_select found (bt_tokenizer_set_pre_engine toggles) */
    uint64_t serial;     /* unique per tokenizer in this process (keys the per-thread piece cache) */
};

struct bt_piece_cache;

/* Per-call scratch. */
typedef struct {
    const bt_tokenizer *t;
    struct bt_piece_cache *pc; /* this thread's piece cache (tokenizer.c), NULL if unavailable */
    pcre2_match_data *md;      /* created on first use (bt_tok_md) */
    int pieces_only;           /* bt_tok_pieces: record piece lengths instead of BPE ids */
    struct bt_sym *sym;
    struct bt_merge *heap;
    size_t cap;
    char *pbuf[BT_TOK_MAX_PRE]; /* ByteLevel add_prefix_space copies, per step */
    size_t pcap[BT_TOK_MAX_PRE];
    bt_ids *out;
    int at0;                    /* the run being pre-tokenized starts at offset 0 of the input
                                 * (Metaspace prepend_scheme "first") */
    char *mbuf;                 /* Metaspace / SPM scratch */
    size_t mcap;
    /* sticky: BT_ERR_NOMEM once an append to out or a scratch buffer could not grow (a document
     * larger than memory allows); every later step is a no-op and bt_tokenize fails with it */
    int err;
} bt_enc_ctx;

/* Append x to c->out, the encoders' only way to emit a token (BPE, SentencePiece, added tokens):
 * out of memory sets the sticky c->err (then nothing more is appended; bt_tokenize fails with
 * BT_ERR_NOMEM and leaves out as it was). */
static inline void bt_tok_out_push(bt_enc_ctx *c, int32_t x) {
    if (!c->err && bt_ids_try_push(c->out, x)) c->err = BT_ERR_NOMEM;
}

/* ---- tokenizer.c ---- */
/* Decodes one UTF-8 code point at s[*i] (valid UTF-8 assumed); advances *i; -1 if invalid. */
int32_t bt_tok_utf8_next(const uint8_t *s, size_t n, size_t *i);
int bt_tok_utf8_valid(const uint8_t *s, size_t n);
/* Empty tokenizer: bos/eos/pad/unk = -1. */
bt_tokenizer *bt_tok_new(void);
/* Vocabulary of n ids: pieces[i] (NULL ptr = hole, typed TT_UNUSED), types[i] (NULL = all
 * TT_NORMAL), in_model[i] (NULL = all) marks ids of the BPE model vocabulary (ignore_merges
 * lookups). Builds piece/raw tables, hashes and the byte-token map. BT_ERR_FORMAT on a
 * string table over 4 GiB. */
int bt_tok_set_vocab(bt_tokenizer *t, int32_t n, const bt_str *pieces, const uint8_t *types,
                     const uint8_t *in_model);
/* Upper bound of a GGUF tokenizer's peak memory (bt_tokenizer_load_estimate), refusing one past
 * the bounds (tokenizer.h). BT_OK or BT_ERR_RANGE / the reader's error. */
int bt_tok_gguf_estimate(const bt_gguf *g, uint64_t *bytes);
/* Resident bytes of a tokenizer of n ids, `text` bytes of token text, m merges, a added tokens
 * (texts: added_text bytes), plus `other` (strings, regexes): the formula bt_tokenizer_mem_bytes
 * evaluates and bt_tok_gguf_estimate bounds. */
uint64_t bt_tok_mem_formula(uint64_t n, uint64_t text, uint64_t m, uint64_t a, uint64_t added_text, uint64_t other);
/* Merges: pair m is (a[m], b[m]), rank m; later duplicates win (HF builds a HashMap).
 * BT_ERR_FORMAT for zero merges or a part/result missing from the vocabulary. */
int bt_tok_set_merges(bt_tokenizer *t, uint64_t n, const bt_str *a, const bt_str *b);
/* Lookup by piece string, -1 if absent. */
int32_t bt_tok_vocab_find(const bt_tokenizer *t, const char *s, size_t n);
/* After t->added is filled (texts owned by t): builds the two match sets. */
int bt_tok_build_added(bt_tokenizer *t);
/* Byte-level BPE of one pre-token (raw bytes), appending ids to c->out. Short pieces go through
 * the calling thread's piece cache (same ids; see tokenizer.c). Out of memory sets c->err
 * (nothing aborts: the size of a piece is the input's). */
void bt_tok_bpe_word(bt_enc_ctx *c, const uint8_t *w, size_t n);
/* Pre-tokenizer pieces of s[0..n) (valid UTF-8; no added-token split, no normalizer): appends
 * each piece's byte length to *lens, in order (the pieces tile s for the dedicated pipelines).
 * For tests comparing the engines. 0 or BT_ERR_*. */
int bt_tok_pieces(const bt_tokenizer *t, const char *s, size_t n, bt_ids *lens);
/* c->md, created on first use; NULL (with bt_fail BT_ERR_NOMEM) if allocation fails. */
pcre2_match_data *bt_tok_md(bt_enc_ctx *c);

/* MODEL_CHARS: lookup in the BPE model's vocabulary (not added tokens) by piece string. */
int32_t bt_tok_model_find(const bt_tokenizer *t, const char *s, size_t n);
/* Frees c's scratch buffers. */
void bt_tok_ctx_free(bt_enc_ctx *c);

/* ---- tokenizer_spm.c ---- */
/* MODEL_SPM builder from GGUF (tokenizer.ggml.model "llama"), after bt_tok_set_vocab: scores,
 * add_space_prefix, the byte fallback map, llama.cpp's control-type overrides and the special
 * partition list (tokenizer_spm.c). Errors: BT_ERR_FORMAT (scores count), BT_ERR_NOMEM. */
int bt_tok_spm_from_gguf(bt_tokenizer *t, const bt_gguf *g);
/* MODEL_SPM encode of raw bytes (no UTF-8 repair: llama.cpp tokenizes bytes), appending to
 * c->out. 0, or BT_ERR_NOMEM (also left in c->err): the text's scratch (occurrences, symbols,
 * bigram heap, escaped copy) or its ids did not fit in memory; never aborts. */
int bt_tok_spm_encode(bt_enc_ctx *c, const char *text, size_t len, int parse_special);
void bt_tok_spm_free(bt_tokenizer *t);
uint64_t bt_tok_spm_mem(const bt_tokenizer *t);

/* ---- tokenizer_hf_spm.c ---- */
/* Pieces longer than this (bytes) are not split into merges (real SentencePiece pieces: at most
 * 48 bytes in Llama 2 and Gemma 3); bounds the cost at one hash lookup per byte of token text. */
#define BT_HF_SPM_SPLIT_MAX 256
/* MODEL_SPM: model.merges of the HF BPE form of the vocabulary, as id pairs (*pairs: malloc'd,
 * 2 * *n_merges int32, L then R, best first): every split of a piece P (at most
 * BT_HF_SPM_SPLIT_MAX bytes, the id the piece lookup gives) into two pieces L + R, ranked by P's
 * score descending, then code points of L, of R descending, then P's id (transformers
 * generate_merges). *n_long: pieces too long to be split. BT_ERR_RANGE past
 * BT_TOKENIZER_MAX_MERGES, BT_ERR_NOMEM (*pairs NULL). */
int bt_tok_hf_spm_merges(const bt_tokenizer *t, int32_t **pairs, uint64_t *n_merges, int32_t *n_long);

/* ---- tokenizer_pre.c ---- */
/* Compiles an Oniguruma pattern (HF Split / ByteLevel) into PCRE2 with Oniguruma semantics
 * (see tokenizer_pre.c). BT_ERR_UNSUPPORTED for constructs without an exact translation. */
int bt_tok_compile_onig(pcre2_code **out, const char *pat, size_t len, int literal);
/* bt_tok_compile_onig into s->re, keeping a copy of the pattern in s->src / src_len / literal. */
int bt_tok_step_regex(bt_pre_step *s, const char *pat, size_t len, int literal);
/* The GPT-2 pattern HF ByteLevel(use_regex=true) applies (pre_tokenizers/byte_level.rs). */
extern const char BT_TOK_GPT2_PATTERN[];
extern const char BT_TOK_LLAMA3_PATTERN[];
extern const char BT_TOK_QWEN2_PATTERN[];
/* Compiles t->re_word. */
int bt_tok_init_word_re(bt_tokenizer *t);
/* Applies t's normalizers to s[0..n) (valid UTF-8). *out NULL when unchanged, else a malloc'd
 * buffer (*out_len bytes). BT_ERR_NOMEM / BT_ERR_FORMAT (utf8proc failure). */
int bt_tok_normalize(const bt_tokenizer *t, const char *s, size_t n, char **out, size_t *out_len);
/* Pre-tokenizes s[0..n) from step `step` on and BPE-encodes every resulting piece. 0, or
 * BT_ERR_* (c->err: out of memory). */
int bt_tok_pre_run(bt_enc_ctx *c, int step, const char *s, size_t n);
/* Whole pre-tokenizer pipeline of s[0..n) (valid UTF-8): the dedicated scanner when
 * t->fast_pre is set, else bt_tok_pre_run from step 0. */
int bt_tok_pre_all(bt_enc_ctx *c, const char *s, size_t n);
/* After the builders filled pre_steps: sets t->fast_avail / t->fast_pre when the steps are
 * exactly one of the dedicated pipelines (GPT-2 ByteLevel; Digits(individual) + GPT-2 ByteLevel;
 * Split(Llama-3 / Qwen2 pattern, Isolated) + ByteLevel without regex; no add_prefix_space). */
void bt_tok_pre_select(bt_tokenizer *t);
/* Frees the regexes of the steps. */
void bt_tok_pre_free(bt_tokenizer *t);

#endif
