/* Byte-level BPE tokenizer (GPT-2 family) built from GGUF tokenizer.ggml.* metadata.
 *
 * Reference behaviour: Hugging Face tokenizers (tokenizers/src/models/bpe/{model,word}.rs,
 * pre_tokenizers/{byte_level,digits}.rs, tokenizer/added_vocabulary.rs) configured as SmolLM2's
 * tokenizer.json; parity is checked against fixtures produced by
 * tests/reference/gen_tokenizer_fixtures.py (tokenizers 0.20.3).
 *
 * Pipeline of bt_tokenize:
 *   1. invalid UTF-8 -> U+FFFD per maximal invalid subpart (Python bytes.decode("utf-8",
 *      errors="replace"), Unicode 15 §3.9 "U+FFFD Substitution of Maximal Subparts");
 *   2. added tokens, leftmost-longest (HF AddedVocabulary): control tokens (token_type 3) only
 *      when parse_special, user-defined tokens (token_type 4) always (HF non-special added tokens);
 *   3. pre-tokenisation of the text between them: for "smollm" every \p{N} code point is its own
 *      piece (HF Digits(individual_digits=true) splits on Rust char::is_numeric = Nd|Nl|No),
 *      then the GPT-2 regex (HF ByteLevel(use_regex=true)) on each remaining run;
 *   4. BPE per piece: one symbol per byte, repeatedly merge the adjacent pair of lowest merge
 *      rank (leftmost on ties) with a binary heap, as HF word.rs merge_all.
 *
 * The GPT-2 regex is run by PCRE2 (UTF + UCP + JIT). HF runs it with Oniguruma, whose \s is
 * Unicode White_Space (U+0009..U+000D, U+0085, \p{Z}); PCRE2's UCP \s lacks U+0085, so the
 * pattern below spells the class out explicitly.
 *
 * Thread safety: the tokenizer is immutable after creation; every call allocates its own
 * scratch (match data, symbol and heap arrays). */
#include "common/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"

/* GGUF token types (llama.cpp llama_token_type / gguf-py TokenType). */
enum { TT_NORMAL = 1, TT_UNKNOWN = 2, TT_CONTROL = 3, TT_USER = 4, TT_UNUSED = 5, TT_BYTE = 6 };
enum { PRE_GPT2 = 0, PRE_SMOLLM = 1 };

/* White_Space as Oniguruma's Unicode \s (see header comment). */
#define WS "\\t\\n\\x0B\\f\\r\\x{85}\\p{Z}"
/* GPT-2 pattern: openai/gpt-2 src/encoder.py, HF pre_tokenizers/byte_level.rs. */
static const char GPT2_PATTERN[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^" WS "\\p{L}\\p{N}]+|[" WS "]+(?![^" WS
    "])|[" WS "]+";

struct bt_tokenizer {
    int32_t n_vocab;
    char *pieces;       /* NUL-terminated vocabulary strings, concatenated */
    uint32_t *piece_off; /* [n_vocab + 1] offsets into pieces */
    uint8_t *raw;       /* decoded bytes of each token, concatenated */
    uint32_t *raw_off;  /* [n_vocab + 1] */
    uint8_t *type;      /* [n_vocab] token types */
    int32_t *vslot;     /* vocabulary hash: open addressing, -1 empty */
    uint32_t vmask;
    uint64_t *mkey;     /* merge hash: key (a << 32 | b), UINT64_MAX empty */
    int32_t *mrank, *mnew;
    uint32_t mmask;
    int32_t byte_id[256]; /* id of each single-byte token, -1 if absent */
    int32_t *spec;        /* added-token ids sorted by (first byte, length desc) */
    uint32_t spec_first[257]; /* spec[spec_first[b] .. spec_first[b+1]) start with byte b */
    int32_t n_spec;
    int pre_kind;
    char *pre, *chat_template;
    int32_t bos, eos, pad;
    pcre2_code *re, *re_num;
};

/* ---- small helpers ---- */

void bt_ids_push(bt_ids *a, int32_t x) {
    if (a->n == a->cap) {
        size_t cap = a->cap ? a->cap * 2 : 64;
        a->v = bt_xrealloc(a->v, cap * sizeof *a->v);
        a->cap = cap;
    }
    a->v[a->n++] = x;
}

void bt_ids_free(bt_ids *a) {
    if (!a) return;
    free(a->v);
    a->v = NULL;
    a->n = a->cap = 0;
}

/* GPT-2 bytes_to_unicode (openai/gpt-2 src/encoder.py; HF byte_level.rs bytes_char): printable
 * bytes 0x21-0x7E, 0xA1-0xAC, 0xAE-0xFF map to themselves, the other 68 bytes in increasing
 * order to U+0100, U+0101, ... */
static void byte_map(uint32_t b2u[256], int16_t u2b[512]) {
    for (int i = 0; i < 512; i++) u2b[i] = -1;
    uint32_t n = 0;
    for (int b = 0; b < 256; b++) {
        int keep = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
        b2u[b] = keep ? (uint32_t)b : 256 + n++;
        u2b[b2u[b]] = (int16_t)b;
    }
}

/* Decodes one UTF-8 code point at s[*i] (s valid for n bytes); returns it, or -1 if invalid. */
static int32_t utf8_next(const uint8_t *s, size_t n, size_t *i) {
    uint8_t c = s[*i];
    if (c < 0x80) { (*i)++; return c; }
    int len = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 0;
    if (!len || *i + (size_t)len > n) return -1;
    uint32_t cp = c & (0x7F >> len);
    for (int k = 1; k < len; k++) {
        if ((s[*i + k] & 0xC0) != 0x80) return -1;
        cp = cp << 6 | (s[*i + k] & 0x3F);
    }
    *i += (size_t)len;
    return (int32_t)cp;
}

/* Length of the maximal valid-UTF-8 prefix check at s[i]: returns the sequence length (1..4) if
 * a complete valid sequence starts at i, else -(number of bytes forming the maximal invalid
 * subpart, >= 1). Ranges per Unicode Table 3-7 (Well-Formed UTF-8 Byte Sequences). */
static int utf8_seq(const uint8_t *s, size_t n, size_t i) {
    uint8_t c = s[i];
    if (c < 0x80) return 1;
    int len;
    uint8_t lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) len = 2;
    else if (c == 0xE0) { len = 3; lo = 0xA0; }
    else if (c == 0xED) { len = 3; hi = 0x9F; }
    else if (c >= 0xE1 && c <= 0xEF) len = 3;
    else if (c == 0xF0) { len = 4; lo = 0x90; }
    else if (c == 0xF4) { len = 4; hi = 0x8F; }
    else if (c >= 0xF1 && c <= 0xF3) len = 4;
    else return -1;
    for (int k = 1; k < len; k++) {
        if (i + (size_t)k >= n) return -k;
        uint8_t d = s[i + (size_t)k];
        uint8_t l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
        if (d < l || d > h) return -k;
    }
    return len;
}

/* If text is valid UTF-8 returns 0 and leaves *out NULL; else builds a malloc'd copy with each
 * maximal invalid subpart replaced by U+FFFD (EF BF BD). */
static int utf8_sanitize(const char *text, size_t len, char **out, size_t *out_len) {
    const uint8_t *s = (const uint8_t *)text;
    *out = NULL;
    size_t i = 0;
    while (i < len) {
        if (s[i] < 0x80) { i++; continue; }
        int r = utf8_seq(s, len, i);
        if (r < 0) break;
        i += (size_t)r;
    }
    if (i == len) return 0;
    if (len > (SIZE_MAX - 1) / 3) return bt_fail(BT_ERR_NOMEM, "tokenizer: input too large");
    uint8_t *d = malloc(len * 3 + 1);
    if (!d) return bt_fail(BT_ERR_NOMEM, "tokenizer: out of memory sanitising %zu bytes", len);
    memcpy(d, s, i);
    size_t o = i;
    while (i < len) {
        int r = utf8_seq(s, len, i);
        if (r > 0) {
            memcpy(d + o, s + i, (size_t)r);
            o += (size_t)r;
            i += (size_t)r;
        } else {
            d[o++] = 0xEF; d[o++] = 0xBF; d[o++] = 0xBD;
            i += (size_t)-r;
        }
    }
    *out = (char *)d;
    *out_len = o;
    return 0;
}

static uint32_t hash_bytes(const char *s, size_t n) {
    uint64_t h = bt_fnv1a64(BT_FNV64_INIT, s, n);
    return (uint32_t)(h ^ (h >> 32));
}

static uint32_t hash_pair(uint64_t key) {
    return (uint32_t)((key * 0x9E3779B97F4A7C15ULL) >> 32);
}

static const char *piece_of(const bt_tokenizer *t, int32_t id) { return t->pieces + t->piece_off[id]; }
static uint32_t piece_len(const bt_tokenizer *t, int32_t id) {
    return t->piece_off[id + 1] - t->piece_off[id] - 1;
}

static int32_t vocab_find(const bt_tokenizer *t, const char *s, size_t n) {
    uint32_t h = hash_bytes(s, n) & t->vmask;
    for (;;) {
        int32_t id = t->vslot[h];
        if (id < 0) return -1;
        if (piece_len(t, id) == n && memcmp(piece_of(t, id), s, n) == 0) return id;
        h = (h + 1) & t->vmask;
    }
}

/* Merge lookup: returns the slot index or -1. */
static inline int32_t merge_find(const bt_tokenizer *t, int32_t a, int32_t b) {
    uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
    uint32_t h = hash_pair(key) & t->mmask;
    for (;;) {
        uint64_t k = t->mkey[h];
        if (k == key) return (int32_t)h;
        if (k == UINT64_MAX) return -1;
        h = (h + 1) & t->mmask;
    }
}

static uint32_t pow2_at_least(uint64_t n) {
    uint32_t c = 16;
    while (c < n) c <<= 1;
    return c;
}

/* ---- construction ---- */

void bt_tokenizer_free(bt_tokenizer *t) {
    if (!t) return;
    free(t->pieces);
    free(t->piece_off);
    free(t->raw);
    free(t->raw_off);
    free(t->type);
    free(t->vslot);
    free(t->mkey);
    free(t->mrank);
    free(t->mnew);
    free(t->spec);
    free(t->pre);
    free(t->chat_template);
    pcre2_code_free(t->re);
    pcre2_code_free(t->re_num);
    free(t);
}

static int read_int_elem(bt_gguf_vtype ty, const void *data, uint64_t i, int64_t *out) {
    const uint8_t *p = data;
    switch (ty) {
    case BT_GGUF_U8: { uint8_t v; memcpy(&v, p + i, 1); *out = v; return 0; }
    case BT_GGUF_I8: { int8_t v; memcpy(&v, p + i, 1); *out = v; return 0; }
    case BT_GGUF_U16: { uint16_t v; memcpy(&v, p + i * 2, 2); *out = v; return 0; }
    case BT_GGUF_I16: { int16_t v; memcpy(&v, p + i * 2, 2); *out = v; return 0; }
    case BT_GGUF_U32: { uint32_t v; memcpy(&v, p + i * 4, 4); *out = v; return 0; }
    case BT_GGUF_I32: { int32_t v; memcpy(&v, p + i * 4, 4); *out = v; return 0; }
    case BT_GGUF_I64: { int64_t v; memcpy(&v, p + i * 8, 8); *out = v; return 0; }
    case BT_GGUF_U64: {
        uint64_t v; memcpy(&v, p + i * 8, 8);
        if (v > INT64_MAX) return -1;
        *out = (int64_t)v; return 0;
    }
    default: return -1;
    }
}

/* Optional special id key: -1 when absent, or (with a warning, as llama.cpp tolerates) when
 * outside the vocabulary, e.g. converters writing 0xFFFFFFFF for "none"; BT_ERR_FORMAT when
 * the value is not an integer. */
static int get_opt_id(const bt_gguf *g, const char *key, int32_t n_vocab, int32_t *out) {
    uint64_t v;
    *out = -1;
    int rc = bt_gguf_get_u64(g, key, &v);
    if (rc == BT_ERR_NOTFOUND) return 0;
    if (rc < 0) {
        int64_t sv;
        if (bt_gguf_get_i64(g, key, &sv) == 0) { /* negative: "none" */
            bt_log(BT_LOG_WARN, "tokenizer", "%s = %lld ignored (no such token)", key, (long long)sv);
            return 0;
        }
        return rc;
    }
    if (v >= (uint64_t)n_vocab) {
        bt_log(BT_LOG_WARN, "tokenizer", "%s = %llu outside vocabulary [0, %d): ignored", key,
               (unsigned long long)v, n_vocab);
        return 0;
    }
    *out = (int32_t)v;
    return 0;
}

static char *dup_str(bt_str s) {
    char *p = bt_xmalloc(s.len + 1);
    memcpy(p, s.ptr, s.len);
    p[s.len] = 0;
    return p;
}

static int compile_re(pcre2_code **out, const char *pat) {
    int err;
    PCRE2_SIZE eoff;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pat, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP,
                                   &err, &eoff, NULL);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        return bt_fail(BT_ERR_INVALID, "tokenizer: regex compile failed at %zu: %s", (size_t)eoff,
                       (char *)msg);
    }
    /* JIT is an optimisation: pcre2_match falls back to the interpreter if it is unavailable. */
    (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
    *out = re;
    return 0;
}

static int build_specials(bt_tokenizer *t) {
    int32_t n = 0;
    for (int32_t i = 0; i < t->n_vocab; i++)
        if ((t->type[i] == TT_CONTROL || t->type[i] == TT_USER) && piece_len(t, i) > 0) n++;
    t->spec = bt_xmalloc(((size_t)n + 1) * sizeof *t->spec);
    n = 0;
    for (int32_t i = 0; i < t->n_vocab; i++)
        if ((t->type[i] == TT_CONTROL || t->type[i] == TT_USER) && piece_len(t, i) > 0)
            t->spec[n++] = i;
    t->n_spec = n;
    /* Insertion sort by (first byte asc, length desc, id asc): n is small (tens), and qsort
     * would need a global context. Length-descending order gives the longest match first. */
    for (int32_t i = 1; i < n; i++) {
        int32_t v = t->spec[i], j = i - 1;
        while (j >= 0) {
            int32_t u = t->spec[j];
            uint8_t fu = (uint8_t)piece_of(t, u)[0], fv = (uint8_t)piece_of(t, v)[0];
            uint32_t lu = piece_len(t, u), lv = piece_len(t, v);
            int gt = fu > fv || (fu == fv && (lu < lv || (lu == lv && u > v)));
            if (!gt) break;
            t->spec[j + 1] = u;
            j--;
        }
        t->spec[j + 1] = v;
    }
    int32_t k = 0;
    for (int b = 0; b < 256; b++) {
        t->spec_first[b] = (uint32_t)k;
        while (k < n && (uint8_t)piece_of(t, t->spec[k])[0] == b) k++;
    }
    t->spec_first[256] = (uint32_t)n;
    return 0;
}

static int utf8_valid(const uint8_t *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        int r = utf8_seq(s, n, i);
        if (r < 0) return 0;
        i += (size_t)r;
    }
    return 1;
}

int bt_tokenizer_from_gguf(bt_tokenizer **out, const bt_gguf *g) {
    if (!out || !g) return bt_fail(BT_ERR_INVALID, "tokenizer_from_gguf: NULL argument");
    *out = NULL;
    bt_str s;
    int rc = bt_gguf_get_str(g, "tokenizer.ggml.model", &s);
    if (rc < 0) return rc == BT_ERR_NOTFOUND ? bt_fail(rc, "tokenizer: no tokenizer.ggml.model key") : rc;
    if (s.len != 4 || memcmp(s.ptr, "gpt2", 4) != 0)
        return bt_fail(BT_ERR_UNSUPPORTED, "tokenizer: model \"%.*s\" unsupported (only \"gpt2\" byte-level BPE)",
                       (int)(s.len > 64 ? 64 : s.len), s.ptr);
    int pre_kind;
    rc = bt_gguf_get_str(g, "tokenizer.ggml.pre", &s);
    if (rc < 0)
        return rc == BT_ERR_NOTFOUND ? bt_fail(rc, "tokenizer: no tokenizer.ggml.pre key (pre-tokeniser unknown)") : rc;
    if (s.len == 6 && memcmp(s.ptr, "smollm", 6) == 0) pre_kind = PRE_SMOLLM;
    else if (s.len == 4 && memcmp(s.ptr, "gpt2", 4) == 0) pre_kind = PRE_GPT2;
    else
        return bt_fail(BT_ERR_UNSUPPORTED, "tokenizer: pre-tokeniser \"%.*s\" unsupported (smollm, gpt2)",
                       (int)(s.len > 64 ? 64 : s.len), s.ptr);
    bt_str pre_name = s;

    bt_str *toks = NULL, *merges = NULL;
    uint64_t n_tok = 0, n_merge = 0;
    rc = bt_gguf_get_str_arr(g, "tokenizer.ggml.tokens", &toks, &n_tok);
    if (rc < 0) return rc;
    bt_tokenizer *t = bt_xcalloc(1, sizeof *t);
    t->pre_kind = pre_kind;
    t->pre = dup_str(pre_name);
    if (n_tok == 0 || n_tok > (uint64_t)INT32_MAX / 2) {
        rc = bt_fail(BT_ERR_FORMAT, "tokenizer: tokenizer.ggml.tokens has %llu entries", (unsigned long long)n_tok);
        goto fail;
    }
    int32_t n = (int32_t)n_tok;
    t->n_vocab = n;

    /* token types (optional: absent means all normal, as llama.cpp) */
    t->type = bt_xmalloc((size_t)n);
    memset(t->type, TT_NORMAL, (size_t)n);
    {
        bt_gguf_vtype et;
        const void *data;
        uint64_t cnt;
        rc = bt_gguf_get_num_arr(g, "tokenizer.ggml.token_type", &et, &data, &cnt);
        if (rc == 0) {
            if (cnt != n_tok) {
                rc = bt_fail(BT_ERR_FORMAT, "tokenizer: token_type has %llu entries, tokens %llu",
                             (unsigned long long)cnt, (unsigned long long)n_tok);
                goto fail;
            }
            for (uint64_t i = 0; i < cnt; i++) {
                int64_t v;
                if (read_int_elem(et, data, i, &v) < 0 || v < 0 || v > 255) {
                    rc = bt_fail(BT_ERR_FORMAT, "tokenizer: token_type[%llu] invalid (element type %d)",
                                 (unsigned long long)i, (int)et);
                    goto fail;
                }
                t->type[i] = (uint8_t)v;
            }
        } else if (rc != BT_ERR_NOTFOUND) {
            goto fail;
        }
    }

    /* pieces and their raw bytes */
    uint64_t total = 0;
    for (int32_t i = 0; i < n; i++) total += toks[i].len + 1;
    if (total > UINT32_MAX) {
        rc = bt_fail(BT_ERR_FORMAT, "tokenizer: vocabulary strings total %llu bytes", (unsigned long long)total);
        goto fail;
    }
    t->pieces = bt_xmalloc(total);
    t->piece_off = bt_xmalloc(((size_t)n + 1) * sizeof *t->piece_off);
    t->raw = bt_xmalloc(total);
    t->raw_off = bt_xmalloc(((size_t)n + 1) * sizeof *t->raw_off);
    uint32_t b2u[256];
    int16_t u2b[512];
    byte_map(b2u, u2b);
    uint32_t po = 0, ro = 0;
    for (int32_t i = 0; i < n; i++) {
        const uint8_t *p = (const uint8_t *)toks[i].ptr;
        size_t len = toks[i].len;
        t->piece_off[i] = po;
        memcpy(t->pieces + po, p, len);
        t->pieces[po + len] = 0;
        po += (uint32_t)len + 1;
        /* HF ByteLevel decoder: every char through the byte decoder, else the raw text. */
        t->raw_off[i] = ro;
        size_t j = 0;
        uint32_t r0 = ro;
        int ok = 1;
        while (j < len) {
            int32_t cp = utf8_next(p, len, &j);
            if (cp < 0 || cp >= 512 || u2b[cp] < 0) { ok = 0; break; }
            t->raw[ro++] = (uint8_t)u2b[cp];
        }
        if (!ok) {
            ro = r0;
            memcpy(t->raw + ro, p, len);
            ro += (uint32_t)len;
        }
    }
    t->piece_off[n] = po;
    t->raw_off[n] = ro;

    /* vocabulary hash; on duplicate strings the first id wins */
    t->vmask = pow2_at_least((uint64_t)n * 2) - 1;
    t->vslot = bt_xmalloc(((size_t)t->vmask + 1) * sizeof *t->vslot);
    memset(t->vslot, 0xFF, ((size_t)t->vmask + 1) * sizeof *t->vslot);
    for (int32_t i = 0; i < n; i++) {
        if (vocab_find(t, piece_of(t, i), piece_len(t, i)) >= 0) continue;
        uint32_t h = hash_bytes(piece_of(t, i), piece_len(t, i)) & t->vmask;
        while (t->vslot[h] >= 0) h = (h + 1) & t->vmask;
        t->vslot[h] = i;
    }
    for (int b = 0; b < 256; b++) {
        char u[4];
        size_t ul;
        uint32_t cp = b2u[b];
        if (cp < 0x80) { u[0] = (char)cp; ul = 1; }
        else { u[0] = (char)(0xC0 | (cp >> 6)); u[1] = (char)(0x80 | (cp & 0x3F)); ul = 2; }
        t->byte_id[b] = vocab_find(t, u, ul);
    }

    /* merges: "A B" in the byte alphabet; rank = index; later duplicates overwrite earlier ones
     * (HF BPE builder collects into a HashMap) */
    rc = bt_gguf_get_str_arr(g, "tokenizer.ggml.merges", &merges, &n_merge);
    if (rc < 0) goto fail;
    if (n_merge == 0 || n_merge > (uint64_t)INT32_MAX / 4) {
        rc = bt_fail(BT_ERR_FORMAT, "tokenizer: tokenizer.ggml.merges has %llu entries", (unsigned long long)n_merge);
        goto fail;
    }
    t->mmask = pow2_at_least(n_merge * 2) - 1;
    t->mkey = bt_xmalloc(((size_t)t->mmask + 1) * sizeof *t->mkey);
    memset(t->mkey, 0xFF, ((size_t)t->mmask + 1) * sizeof *t->mkey);
    t->mrank = bt_xmalloc(((size_t)t->mmask + 1) * sizeof *t->mrank);
    t->mnew = bt_xmalloc(((size_t)t->mmask + 1) * sizeof *t->mnew);
    {
        char *cat = NULL;
        size_t cat_cap = 0;
        for (uint64_t m = 0; m < n_merge; m++) {
            const char *p = merges[m].ptr;
            size_t len = merges[m].len;
            const char *sp = memchr(p, ' ', len);
            if (!sp || sp == p || (size_t)(sp - p) + 1 >= len || memchr(sp + 1, ' ', len - (size_t)(sp - p) - 1)) {
                free(cat);
                rc = bt_fail(BT_ERR_FORMAT, "tokenizer: merge %llu \"%.*s\" is not \"A B\"", (unsigned long long)m,
                             (int)(len > 64 ? 64 : len), p);
                goto fail;
            }
            size_t la = (size_t)(sp - p), lb = len - la - 1;
            int32_t a = vocab_find(t, p, la), b = vocab_find(t, sp + 1, lb);
            if (len > cat_cap) { cat_cap = len * 2; cat = bt_xrealloc(cat, cat_cap); }
            memcpy(cat, p, la);
            memcpy(cat + la, sp + 1, lb);
            int32_t c = vocab_find(t, cat, la + lb);
            if (a < 0 || b < 0 || c < 0) {
                free(cat);
                rc = bt_fail(BT_ERR_FORMAT, "tokenizer: merge %llu \"%.*s\": %s not in the vocabulary",
                             (unsigned long long)m, (int)(len > 64 ? 64 : len), p,
                             a < 0 ? "left part" : b < 0 ? "right part" : "merged token");
                goto fail;
            }
            uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
            uint32_t h = hash_pair(key) & t->mmask;
            while (t->mkey[h] != UINT64_MAX && t->mkey[h] != key) h = (h + 1) & t->mmask;
            t->mkey[h] = key;
            t->mrank[h] = (int32_t)m;
            t->mnew[h] = c;
        }
        free(cat);
    }

    /* special ids */
    if ((rc = get_opt_id(g, "tokenizer.ggml.bos_token_id", n, &t->bos)) < 0) goto fail;
    if ((rc = get_opt_id(g, "tokenizer.ggml.eos_token_id", n, &t->eos)) < 0) goto fail;
    if ((rc = get_opt_id(g, "tokenizer.ggml.padding_token_id", n, &t->pad)) < 0) goto fail;
    rc = bt_gguf_get_str(g, "tokenizer.chat_template", &s);
    if (rc == 0) t->chat_template = dup_str(s);
    else if (rc != BT_ERR_NOTFOUND) goto fail;

    /* added tokens must be valid UTF-8 to be matched (so splits fall on character boundaries) */
    for (int32_t i = 0; i < n; i++)
        if ((t->type[i] == TT_CONTROL || t->type[i] == TT_USER) &&
            !utf8_valid((const uint8_t *)piece_of(t, i), piece_len(t, i)))
            t->type[i] = TT_UNUSED;
    if ((rc = build_specials(t)) < 0) goto fail;
    if ((rc = compile_re(&t->re, GPT2_PATTERN)) < 0) goto fail;
    if ((rc = compile_re(&t->re_num, "\\p{N}")) < 0) goto fail;

    free(toks);
    free(merges);
    *out = t;
    return 0;
fail:
    free(toks);
    free(merges);
    bt_tokenizer_free(t);
    return rc;
}

int bt_tokenizer_load(bt_tokenizer **out, const char *path) {
    if (!out || !path) return bt_fail(BT_ERR_INVALID, "tokenizer_load: NULL argument");
    *out = NULL;
    bt_gguf *g = NULL;
    int rc = bt_gguf_open(&g, path);
    if (rc < 0) return rc;
    rc = bt_tokenizer_from_gguf(out, g);
    bt_gguf_close(g);
    return rc;
}

/* ---- encoding ---- */

typedef struct {
    int32_t id, prev, next; /* id < 0: merged into its left neighbour */
} sym_t;

typedef struct {
    int32_t rank, pos, new_id;
} merge_t;

typedef struct {
    const bt_tokenizer *t;
    pcre2_match_data *md;
    sym_t *sym;
    merge_t *heap;
    size_t cap; /* sym has cap entries, heap 3 * cap */
    bt_ids *out;
} enc_ctx;

static inline int merge_less(const merge_t *a, const merge_t *b) {
    return a->rank < b->rank || (a->rank == b->rank && a->pos < b->pos);
}

static inline void heap_push(merge_t *h, size_t *n, merge_t m) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!merge_less(&m, &h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = m;
}

static inline merge_t heap_pop(merge_t *h, size_t *n) {
    merge_t top = h[0], last = h[--(*n)];
    size_t i = 0, sz = *n;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= sz) break;
        if (c + 1 < sz && merge_less(&h[c + 1], &h[c])) c++;
        if (!merge_less(&h[c], &last)) break;
        h[i] = h[c];
        i = c;
    }
    if (sz) h[i] = last;
    return top;
}

static inline void push_pair(const bt_tokenizer *t, merge_t *heap, size_t *hn, int32_t pos, int32_t a, int32_t b) {
    int32_t m = merge_find(t, a, b);
    if (m >= 0) heap_push(heap, hn, (merge_t){t->mrank[m], pos, t->mnew[m]});
}

/* BPE of one pre-token (HF models/bpe/word.rs merge_all): lowest rank first, leftmost on ties.
 * Bytes without a single-byte token are dropped (HF BPE with unk_token = None). */
static void bpe_word(enc_ctx *c, const uint8_t *w, size_t n) {
    const bt_tokenizer *t = c->t;
    if (n == 1) {
        if (t->byte_id[w[0]] >= 0) bt_ids_push(c->out, t->byte_id[w[0]]);
        return;
    }
    if (n > c->cap) {
        size_t cap = c->cap ? c->cap : 64;
        while (cap < n) cap *= 2;
        c->sym = bt_xrealloc(c->sym, cap * sizeof *c->sym);
        c->heap = bt_xrealloc(c->heap, 3 * cap * sizeof *c->heap);
        c->cap = cap;
    }
    sym_t *sym = c->sym;
    int32_t k = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t id = t->byte_id[w[i]];
        if (id < 0) continue;
        sym[k] = (sym_t){id, k - 1, k + 1};
        k++;
    }
    if (k == 0) return;
    sym[k - 1].next = -1;
    size_t hn = 0;
    for (int32_t i = 0; i + 1 < k; i++) push_pair(t, c->heap, &hn, i, sym[i].id, sym[i + 1].id);
    while (hn) {
        merge_t top = heap_pop(c->heap, &hn);
        sym_t *s = &sym[top.pos];
        if (s->id < 0 || s->next < 0) continue;
        sym_t *r = &sym[s->next];
        int32_t m = merge_find(t, s->id, r->id);
        if (m < 0 || t->mnew[m] != top.new_id) continue; /* stale entry */
        s->id = top.new_id;
        r->id = -1;
        s->next = r->next;
        if (r->next >= 0) sym[r->next].prev = top.pos;
        if (s->prev >= 0) push_pair(t, c->heap, &hn, s->prev, sym[s->prev].id, s->id);
        if (s->next >= 0) push_pair(t, c->heap, &hn, top.pos, s->id, sym[s->next].id);
    }
    for (int32_t i = 0; i >= 0; i = sym[i].next) bt_ids_push(c->out, sym[i].id);
}

/* GPT-2 regex pieces of s[0..n) (a run without \p{N} for "smollm"); every match and every
 * unmatched gap is a piece (HF SplitDelimiterBehavior::Isolated). */
static int regex_split(enc_ctx *c, const char *s, size_t n) {
    size_t off = 0;
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(c->md);
    while (off < n) {
        int rc = pcre2_match(c->t->re, (PCRE2_SPTR)s, n, off, PCRE2_NO_UTF_CHECK, c->md, NULL);
        if (rc == PCRE2_ERROR_NOMATCH) {
            bpe_word(c, (const uint8_t *)s + off, n - off);
            return 0;
        }
        if (rc < 0) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(rc, msg, sizeof msg);
            return bt_fail(BT_ERR_RANGE, "tokenizer: regex match failed at byte %zu: %s", off, (char *)msg);
        }
        size_t b = ov[0], e = ov[1];
        if (b > off) bpe_word(c, (const uint8_t *)s + off, b - off);
        if (e == b) { /* empty match (not produced by the built-in patterns): emit one char */
            size_t j = b;
            utf8_next((const uint8_t *)s, n, &j);
            e = j > b ? j : b + 1;
        }
        bpe_word(c, (const uint8_t *)s + b, e - b);
        off = e;
    }
    return 0;
}

/* Pre-tokenise and encode one run of text between added tokens. */
static int encode_run(enc_ctx *c, const char *s, size_t n) {
    if (n == 0) return 0;
    if (c->t->pre_kind != PRE_SMOLLM) return regex_split(c, s, n);
    /* HF Digits(individual_digits=true): each numeric char is its own piece. ASCII digits are
     * found directly; non-ASCII code points are classified with PCRE2 \p{N}. */
    size_t start = 0, i = 0;
    while (i < n) {
        uint8_t b = (uint8_t)s[i];
        size_t clen;
        if (b < 0x80) {
            if (b < '0' || b > '9') { i++; continue; }
            clen = 1;
        } else {
            size_t j = i;
            utf8_next((const uint8_t *)s, n, &j);
            clen = j - i;
            int rc = pcre2_match(c->t->re_num, (PCRE2_SPTR)s + i, clen, 0,
                                 PCRE2_NO_UTF_CHECK | PCRE2_ANCHORED, c->md, NULL);
            if (rc == PCRE2_ERROR_NOMATCH) { i = j; continue; }
            if (rc < 0) return bt_fail(BT_ERR_RANGE, "tokenizer: \\p{N} match failed (%d)", rc);
        }
        if (i > start) {
            int rc = regex_split(c, s + start, i - start);
            if (rc < 0) return rc;
        }
        bpe_word(c, (const uint8_t *)s + i, clen);
        i += clen;
        start = i;
    }
    return start < n ? regex_split(c, s + start, n - start) : 0;
}

int bt_tokenize(const bt_tokenizer *t, const char *text, size_t len, int parse_special, bt_ids *out) {
    if (!t || !out || (!text && len)) return bt_fail(BT_ERR_INVALID, "tokenize: NULL argument");
    if (len == 0) return 0;
    if (len > (size_t)INT32_MAX)
        return bt_fail(BT_ERR_RANGE, "tokenize: input of %zu bytes exceeds the 2 GiB limit", len);
    size_t n0 = out->n;
    char *clean = NULL;
    size_t clen = 0;
    int rc = utf8_sanitize(text, len, &clean, &clen);
    if (rc < 0) return rc;
    if (clean) { text = clean; len = clen; }
    enc_ctx c = {.t = t, .out = out};
    c.md = pcre2_match_data_create_from_pattern(t->re, NULL);
    if (!c.md) {
        free(clean);
        return bt_fail(BT_ERR_NOMEM, "tokenize: pcre2 match data allocation failed");
    }
    const uint8_t *s = (const uint8_t *)text;
    size_t seg = 0, i = 0;
    while (i < len && rc == 0) {
        uint32_t lo = t->spec_first[s[i]], hi = t->spec_first[s[i] + 1];
        int32_t hit = -1;
        for (uint32_t k = lo; k < hi; k++) {
            int32_t id = t->spec[k];
            if (!parse_special && t->type[id] != TT_USER) continue;
            uint32_t pl = piece_len(t, id);
            if (pl <= len - i && memcmp(s + i, piece_of(t, id), pl) == 0) { hit = id; break; }
        }
        if (hit < 0) { i++; continue; }
        rc = encode_run(&c, text + seg, i - seg);
        bt_ids_push(out, hit);
        i += piece_len(t, hit);
        seg = i;
    }
    if (rc == 0) rc = encode_run(&c, text + seg, len - seg);
    pcre2_match_data_free(c.md);
    free(c.sym);
    free(c.heap);
    free(clean);
    if (rc < 0) out->n = n0; /* nothing appended on failure */
    return rc;
}

/* ---- decoding and accessors ---- */

int bt_detokenize(const bt_tokenizer *t, const int32_t *ids, size_t n, int keep_special, char **out,
                  size_t *out_len) {
    if (!t || !out || !out_len || (!ids && n)) return bt_fail(BT_ERR_INVALID, "detokenize: NULL argument");
    *out = NULL;
    *out_len = 0;
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= t->n_vocab)
            return bt_fail(BT_ERR_RANGE, "detokenize: id %d at %zu outside vocabulary [0, %d)", ids[i], i,
                           t->n_vocab);
        total += t->raw_off[ids[i] + 1] - t->raw_off[ids[i]];
    }
    char *buf = malloc(total + 1);
    if (!buf) return bt_fail(BT_ERR_NOMEM, "detokenize: out of memory (%zu bytes)", total + 1);
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        uint8_t ty = t->type[ids[i]];
        if (!keep_special && (ty == TT_CONTROL || ty == TT_UNKNOWN || ty == TT_UNUSED)) continue;
        uint32_t a = t->raw_off[ids[i]], b = t->raw_off[ids[i] + 1];
        memcpy(buf + o, t->raw + a, b - a);
        o += b - a;
    }
    buf[o] = 0;
    *out = buf;
    *out_len = o;
    return 0;
}

int32_t bt_tokenizer_vocab_size(const bt_tokenizer *t) { return t ? t->n_vocab : 0; }

int32_t bt_tokenizer_find(const bt_tokenizer *t, const char *piece) {
    if (!t || !piece) return -1;
    return vocab_find(t, piece, strlen(piece));
}

const char *bt_tokenizer_piece(const bt_tokenizer *t, int32_t id) {
    if (!t || id < 0 || id >= t->n_vocab) return NULL;
    return piece_of(t, id);
}

int32_t bt_tokenizer_bos(const bt_tokenizer *t) { return t ? t->bos : -1; }
int32_t bt_tokenizer_eos(const bt_tokenizer *t) { return t ? t->eos : -1; }
int32_t bt_tokenizer_pad(const bt_tokenizer *t) { return t ? t->pad : -1; }
const char *bt_tokenizer_chat_template(const bt_tokenizer *t) { return t ? t->chat_template : NULL; }
const char *bt_tokenizer_pre(const bt_tokenizer *t) { return t ? t->pre : NULL; }

const uint8_t *bt_tokenizer_token_bytes(const bt_tokenizer *t, int32_t id, size_t *len) {
    if (!t || id < 0 || id >= t->n_vocab) {
        if (len) *len = 0;
        return NULL;
    }
    if (len) *len = t->raw_off[id + 1] - t->raw_off[id];
    return t->raw + t->raw_off[id];
}

int bt_tokenizer_token_type(const bt_tokenizer *t, int32_t id) {
    if (!t || id < 0 || id >= t->n_vocab) return -1;
    return t->type[id];
}
