/* Byte-level BPE tokenizer core: vocabulary and merge tables, added-token splitting, BPE, encode
 * and decode. Builders: tokenizer_gguf.c (GGUF tokenizer.ggml.*), tokenizer_json.c (Hugging Face
 * tokenizer.json); normalizers and pre-tokenizers: tokenizer_pre.c.
 *
 * Reference behaviour: Hugging Face tokenizers 0.20.3 (tokenizers/src/tokenizer/{mod,
 * added_vocabulary}.rs, models/bpe/{model,word}.rs, pre_tokenizers/, decoders/byte_level.rs).
 * Parity is checked against fixtures produced by tests/reference/gen_tokenizer_fixtures.py.
 *
 * Pipeline of bt_tokenize (HF Tokenizer::encode with add_special_tokens = false):
 *   1. invalid UTF-8 -> U+FFFD per maximal invalid subpart (Python bytes.decode("utf-8",
 *      errors="replace"), Unicode 15 §3.9 "U+FFFD Substitution of Maximal Subparts");
 *   2. added tokens with normalized = false are split out of the raw text (HF
 *      AddedVocabulary::extract_and_normalize, split_trie): leftmost-longest non-overlapping
 *      matches (aho-corasick MatchKind::LeftmostLongest); a special token found while
 *      parse_special == 0 (HF encode_special_tokens = true) or a single_word token not on word
 *      boundaries is skipped, and matching resumes after it; lstrip/rstrip absorb whitespace;
 *   3. every remaining run is normalized (tokenizer_pre.c), then added tokens with
 *      normalized = true are split out of it the same way (split_normalized_trie);
 *   4. each remaining run is pre-tokenized (tokenizer_pre.c) and every piece is BPE-encoded:
 *      ignore_merges -> a piece that is itself a vocabulary token is emitted whole; else one
 *      symbol per byte, repeatedly merge the adjacent pair of lowest rank (leftmost on ties)
 *      with a binary heap (HF word.rs merge_all).
 *
 * Thread safety: a tokenizer is immutable after creation; each call allocates its own scratch,
 * and each thread keeps its own piece cache (below; bt_tokenize_release_cache frees it). */
#include "common/tokenizer_internal.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

/* ---- small helpers ---- */

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

int32_t bt_tok_utf8_next(const uint8_t *s, size_t n, size_t *i) {
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

/* Length of the valid sequence at s[i] (1..4), else -(bytes in the maximal invalid subpart).
 * Ranges per Unicode Table 3-7 (Well-Formed UTF-8 Byte Sequences). */
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

int bt_tok_utf8_valid(const uint8_t *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        if (s[i] < 0x80) { i++; continue; }
        int r = utf8_seq(s, n, i);
        if (r < 0) return 0;
        i += (size_t)r;
    }
    return 1;
}

/* If text is valid UTF-8 returns 0 and leaves *out NULL; else builds a malloc'd copy with each
 * maximal invalid subpart replaced by U+FFFD (EF BF BD). */
static int utf8_sanitize(const char *text, size_t len, char **out, size_t *out_len) {
    const uint8_t *s = (const uint8_t *)text;
    *out = NULL;
    size_t i = 0;
    while (i < len) {
        uint64_t w8;
        if (i + 8 <= len && (memcpy(&w8, s + i, 8), !(w8 & 0x8080808080808080ull))) { i += 8; continue; } /* ASCII */
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

static uint32_t hash_bytes(const void *s, size_t n) {
    uint64_t h = bt_fnv1a64(BT_FNV64_INIT, s, n);
    return (uint32_t)(h ^ (h >> 32));
}

static uint32_t hash_pair(uint64_t key) { return (uint32_t)((key * 0x9E3779B97F4A7C15ULL) >> 32); }

static const char *piece_of(const bt_tokenizer *t, int32_t id) { return t->pieces + t->piece_off[id]; }
static uint32_t piece_len(const bt_tokenizer *t, int32_t id) {
    return t->piece_off[id + 1] - t->piece_off[id] - 1;
}

int32_t bt_tok_vocab_find(const bt_tokenizer *t, const char *s, size_t n) {
    uint32_t h = hash_bytes(s, n) & t->vmask;
    for (;;) {
        int32_t id = t->vslot[h];
        if (id < 0) return -1;
        if (piece_len(t, id) == n && memcmp(piece_of(t, id), s, n) == 0) return id;
        h = (h + 1) & t->vmask;
    }
}

/* Model-vocabulary token whose byte-level string maps to exactly these raw bytes, -1 if none. */
static int32_t raw_find(const bt_tokenizer *t, const uint8_t *s, size_t n) {
    uint32_t h = hash_bytes(s, n) & t->rmask;
    for (;;) {
        int32_t id = t->rslot[h];
        if (id < 0) return -1;
        uint32_t a = t->raw_off[id], b = t->raw_off[id + 1];
        if (b - a == n && memcmp(t->raw + a, s, n) == 0) return id;
        h = (h + 1) & t->rmask;
    }
}

static inline const struct bt_merge_slot *merge_find(const bt_tokenizer *t, int32_t a, int32_t b) {
    uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
    uint32_t h = hash_pair(key) & t->mmask;
    for (;;) {
        const struct bt_merge_slot *m = &t->merges[h];
        if (m->key == key) return m;
        if (m->key == UINT64_MAX) return NULL;
        h = (h + 1) & t->mmask;
    }
}

static uint32_t pow2_at_least(uint64_t n) {
    uint32_t c = 16;
    while (c < n) c <<= 1;
    return c;
}

/* ---- construction ---- */

static _Atomic uint64_t tok_serial;

bt_tokenizer *bt_tok_new(void) {
    bt_tokenizer *t = bt_xcalloc(1, sizeof *t);
    t->serial = atomic_fetch_add(&tok_serial, 1) + 1;
    t->bos = t->eos = t->pad = t->unk = -1;
    for (int b = 0; b < 256; b++) t->byte_id[b] = t->fb_id[b] = -1;
    return t;
}

void bt_tokenizer_free(bt_tokenizer *t) {
    if (!t) return;
    free(t->pieces);
    free(t->piece_off);
    free(t->raw);
    free(t->raw_off);
    free(t->byte_ok);
    free(t->type);
    free(t->vslot);
    free(t->rslot);
    free(t->merges);
    for (int32_t i = 0; i < t->n_added; i++) free(t->added[i].text);
    free(t->added);
    free(t->set_raw.idx);
    free(t->set_norm.idx);
    bt_tok_pre_free(t);
    pcre2_code_free(t->re_word);
    free(t->pre);
    free(t->chat_template);
    for (int k = 0; k < BT_TOK_MAX_NORM; k++) {
        free(t->norm_a[k]);
        free(t->norm_b[k]);
    }
    bt_tok_spm_free(t);
    free(t);
}

/* Hex digit value, -1 if none. */
static int hexval(uint8_t c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

/* Bytes a SentencePiece-family token decodes to, written to d (at most len bytes); returns the
 * count. MODEL_SPM (llama.cpp llama_vocab::token_to_piece, special = true): NORMAL tokens with
 * U+2581 -> " ", BYTE tokens "<0xNN>" -> byte NN, CONTROL / USER_DEFINED / UNKNOWN as their text,
 * UNUSED and other types -> nothing. MODEL_CHARS (HF decoders Replace("\u2581", " "),
 * ByteFallback): every token, with U+2581 -> " " when the decoder has that Replace, and a text of
 * exactly "<0xNN>" (hex, either case) -> byte NN when it has ByteFallback (Strip / Fuse act on
 * the whole output: bt_tokenizer.dec_strip). */
static size_t spm_raw(const bt_tokenizer *t, const uint8_t *p, size_t len, int type, uint8_t *d) {
    if (t->model == MODEL_SPM && type == TT_BYTE) { /* llama.cpp token_to_byte: strtol(text[3..5), 16) */
        int v = 0;
        for (size_t j = 3; j < 5 && j < len && hexval(p[j]) >= 0; j++) v = v << 4 | hexval(p[j]);
        d[0] = (uint8_t)v;
        return 1;
    }
    if (t->model == MODEL_CHARS && t->dec_bytefb && len == 6 && memcmp(p, "<0x", 3) == 0 && p[5] == '>' &&
        hexval(p[3]) >= 0 && hexval(p[4]) >= 0) {
        d[0] = (uint8_t)(hexval(p[3]) << 4 | hexval(p[4]));
        return 1;
    }
    int unescape = t->model == MODEL_SPM ? type == TT_NORMAL : t->dec_replace;
    if (t->model == MODEL_SPM && type != TT_NORMAL && type != TT_CONTROL && type != TT_USER && type != TT_UNKNOWN)
        return 0;
    size_t o = 0;
    for (size_t j = 0; j < len;) {
        if (unescape && j + 3 <= len && p[j] == 0xE2 && p[j + 1] == 0x96 && p[j + 2] == 0x81) {
            d[o++] = ' ';
            j += 3;
        } else {
            d[o++] = p[j++];
        }
    }
    return o;
}

int bt_tok_set_vocab(bt_tokenizer *t, int32_t n, const bt_str *toks, const uint8_t *types, const uint8_t *in_model) {
    if (n > (int32_t)BT_TOKENIZER_MAX_VOCAB)
        return bt_fail(BT_ERR_RANGE, "tokenizer: vocabulary of %d tokens, more than the %u accepted (the largest real "
                       "ones have ~262k)", n, BT_TOKENIZER_MAX_VOCAB);
    uint64_t total = 0;
    for (int32_t i = 0; i < n; i++) total += (toks[i].ptr ? toks[i].len : 0) + 1;
    if (n > 0 && total - (uint64_t)n > BT_TOKENIZER_MAX_TEXT)
        return bt_fail(BT_ERR_RANGE, "tokenizer: %llu bytes of token text, more than the %llu MiB accepted",
                       (unsigned long long)(total - (uint64_t)n), (unsigned long long)(BT_TOKENIZER_MAX_TEXT >> 20));
    if (n <= 0 || total > UINT32_MAX)
        return bt_fail(BT_ERR_FORMAT, "tokenizer: vocabulary of %d tokens, %llu string bytes", n,
                       (unsigned long long)total);
    t->n_vocab = n;
    t->type = bt_xmalloc((size_t)n);
    t->byte_ok = bt_xcalloc((size_t)n, 1);
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
        size_t len = p ? toks[i].len : 0;
        t->type[i] = !p ? TT_UNUSED : types ? types[i] : TT_NORMAL;
        t->piece_off[i] = po;
        if (len) memcpy(t->pieces + po, p, len);
        t->pieces[po + len] = 0;
        po += (uint32_t)len + 1;
        t->raw_off[i] = ro;
        if (t->model != MODEL_BYTELEVEL) {
            ro = spm_raw(t, p, len, t->type[i], t->raw + ro) + ro;
            continue;
        }
        /* HF ByteLevel decoder (decoders/byte_level.rs decode_chain): every char through the
         * byte decoder, or, if one char is outside the alphabet, the token's raw UTF-8 text. */
        size_t j = 0;
        uint32_t r0 = ro;
        int ok = 1;
        while (j < len) {
            int32_t cp = bt_tok_utf8_next(p, len, &j);
            if (cp < 0 || cp >= 512 || u2b[cp] < 0) { ok = 0; break; }
            t->raw[ro++] = (uint8_t)u2b[cp];
        }
        if (!ok) {
            ro = r0;
            memcpy(t->raw + ro, p, len);
            ro += (uint32_t)len;
        }
        t->byte_ok[i] = (uint8_t)(ok && len > 0);
    }
    t->piece_off[n] = po;
    t->raw_off[n] = ro;

    /* piece hash; on duplicate strings the first id wins (the last with dup_last, as llama.cpp's
     * token_to_id map); for MODEL_CHARS rslot holds the BPE model's own pieces instead */
    t->vmask = pow2_at_least((uint64_t)n * 2) - 1;
    t->vslot = bt_xmalloc(((size_t)t->vmask + 1) * sizeof *t->vslot);
    memset(t->vslot, 0xFF, ((size_t)t->vmask + 1) * sizeof *t->vslot);
    t->rmask = t->vmask;
    t->rslot = bt_xmalloc(((size_t)t->rmask + 1) * sizeof *t->rslot);
    memset(t->rslot, 0xFF, ((size_t)t->rmask + 1) * sizeof *t->rslot);
    for (int32_t i = 0; i < n; i++) {
        if (t->type[i] == TT_UNUSED && !toks[i].ptr) continue;
        {
            uint32_t h = hash_bytes(piece_of(t, i), piece_len(t, i)) & t->vmask;
            while (t->vslot[h] >= 0 && !(piece_len(t, t->vslot[h]) == piece_len(t, i) &&
                                         memcmp(piece_of(t, t->vslot[h]), piece_of(t, i), piece_len(t, i)) == 0))
                h = (h + 1) & t->vmask;
            if (t->vslot[h] < 0 || t->dup_last) t->vslot[h] = i;
        }
        if (t->model == MODEL_CHARS && (!in_model || in_model[i]) && bt_tok_model_find(t, piece_of(t, i), piece_len(t, i)) < 0) {
            uint32_t h = hash_bytes(piece_of(t, i), piece_len(t, i)) & t->rmask;
            while (t->rslot[h] >= 0) h = (h + 1) & t->rmask;
            t->rslot[h] = i;
        }
        if (t->byte_ok[i] && (!in_model || in_model[i])) {
            const uint8_t *r = t->raw + t->raw_off[i];
            size_t rl = t->raw_off[i + 1] - t->raw_off[i];
            if (raw_find(t, r, rl) < 0) {
                uint32_t h = hash_bytes(r, rl) & t->rmask;
                while (t->rslot[h] >= 0) h = (h + 1) & t->rmask;
                t->rslot[h] = i;
            }
        }
    }
    for (int b = 0; b < 256; b++) {
        char u[4];
        size_t ul;
        uint32_t cp = b2u[b];
        if (cp < 0x80) { u[0] = (char)cp; ul = 1; }
        else { u[0] = (char)(0xC0 | (cp >> 6)); u[1] = (char)(0x80 | (cp & 0x3F)); ul = 2; }
        t->byte_id[b] = t->model == MODEL_BYTELEVEL ? bt_tok_vocab_find(t, u, ul) : -1;
        char fb[7] = {'<', '0', 'x', "0123456789ABCDEF"[b >> 4], "0123456789ABCDEF"[b & 15], '>', 0};
        if (t->model == MODEL_CHARS) t->fb_id[b] = bt_tok_model_find(t, fb, 6);
        else if (t->model == MODEL_SPM) { /* llama.cpp byte_to_token: "<0xNN>", else the byte itself */
            t->fb_id[b] = bt_tok_vocab_find(t, fb, 6);
            if (t->fb_id[b] < 0) {
                char one = (char)b;
                t->fb_id[b] = bt_tok_vocab_find(t, &one, 1);
            }
        }
    }
    return 0;
}

int32_t bt_tok_model_find(const bt_tokenizer *t, const char *s, size_t n) {
    uint32_t h = hash_bytes(s, n) & t->rmask;
    for (;;) {
        int32_t id = t->rslot[h];
        if (id < 0) return -1;
        if (piece_len(t, id) == n && memcmp(piece_of(t, id), s, n) == 0) return id;
        h = (h + 1) & t->rmask;
    }
}

int bt_tok_set_merges(bt_tokenizer *t, uint64_t n_merge, const bt_str *ma, const bt_str *mb) {
    if (n_merge > BT_TOKENIZER_MAX_MERGES)
        return bt_fail(BT_ERR_RANGE, "tokenizer: %llu merges, more than the %u accepted", (unsigned long long)n_merge,
                       BT_TOKENIZER_MAX_MERGES);
    if (n_merge == 0)
        return bt_fail(BT_ERR_FORMAT, "tokenizer: %llu merges (a BPE vocabulary needs at least one)",
                       (unsigned long long)n_merge);
    t->mmask = pow2_at_least(n_merge * 2) - 1;
    t->merges = bt_xmalloc(((size_t)t->mmask + 1) * sizeof *t->merges);
    for (size_t h = 0; h <= t->mmask; h++) t->merges[h] = (struct bt_merge_slot){UINT64_MAX, 0, 0};
    char *cat = NULL;
    size_t cat_cap = 0;
    for (uint64_t m = 0; m < n_merge; m++) {
        size_t la = ma[m].len, lb = mb[m].len;
        int32_t a = bt_tok_vocab_find(t, ma[m].ptr, la), b = bt_tok_vocab_find(t, mb[m].ptr, lb);
        if (la + lb > cat_cap) { cat_cap = (la + lb) * 2; cat = bt_xrealloc(cat, cat_cap); }
        memcpy(cat, ma[m].ptr, la);
        memcpy(cat + la, mb[m].ptr, lb);
        int32_t c = bt_tok_vocab_find(t, cat, la + lb);
        if (a < 0 || b < 0 || c < 0) {
            free(cat);
            return bt_fail(BT_ERR_FORMAT, "tokenizer: merge %llu \"%.*s\" \"%.*s\": %s not in the vocabulary",
                           (unsigned long long)m, (int)(la > 64 ? 64 : la), ma[m].ptr, (int)(lb > 64 ? 64 : lb),
                           mb[m].ptr, a < 0 ? "left part" : b < 0 ? "right part" : "merged token");
        }
        uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
        uint32_t h = hash_pair(key) & t->mmask;
        while (t->merges[h].key != UINT64_MAX && t->merges[h].key != key) h = (h + 1) & t->mmask;
        t->merges[h] = (struct bt_merge_slot){key, (int32_t)m, c};
    }
    free(cat);
    return 0;
}

static void build_set(bt_tokenizer *t, bt_added_set *set, int normalized) {
    int32_t n = 0;
    set->idx = bt_xmalloc(((size_t)t->n_added + 1) * sizeof *set->idx);
    for (int32_t i = 0; i < t->n_added; i++)
        if (t->added[i].len > 0 && (t->added[i].normalized != 0) == normalized) set->idx[n++] = i;
    set->n = n;
    /* insertion sort by (first byte asc, length desc, position asc); n is small (<= thousands) */
    for (int32_t i = 1; i < n; i++) {
        int32_t v = set->idx[i], j = i - 1;
        const bt_added *av = &t->added[v];
        while (j >= 0) {
            const bt_added *au = &t->added[set->idx[j]];
            uint8_t fu = (uint8_t)au->text[0], fv = (uint8_t)av->text[0];
            int gt = fu > fv || (fu == fv && (au->len < av->len || (au->len == av->len && set->idx[j] > v)));
            if (!gt) break;
            set->idx[j + 1] = set->idx[j];
            j--;
        }
        set->idx[j + 1] = v;
    }
    int32_t k = 0;
    for (int b = 0; b < 256; b++) {
        set->first[b] = (uint32_t)k;
        while (k < n && (uint8_t)t->added[set->idx[k]].text[0] == b) k++;
    }
    set->first[256] = (uint32_t)n;
    set->only_first = n ? (uint8_t)t->added[set->idx[0]].text[0] : -1;
    for (int32_t i = 1; i < n; i++)
        if ((uint8_t)t->added[set->idx[i]].text[0] != set->only_first) set->only_first = -1;
}

int bt_tok_build_added(bt_tokenizer *t) {
    for (int32_t i = 0; i < t->n_added; i++)
        if (!bt_tok_utf8_valid((const uint8_t *)t->added[i].text, t->added[i].len)) t->added[i].len = 0;
    build_set(t, &t->set_raw, 0);
    build_set(t, &t->set_norm, 1);
    return bt_tok_init_word_re(t);
}

/* ---- BPE ---- */

struct bt_sym {
    int32_t id, prev, next; /* id < 0: merged into its left neighbour */
};

struct bt_merge {
    int32_t rank, pos, new_id;
    int32_t left, right; /* the pair's ids when pushed: the entry is stale once they changed */
};
typedef struct bt_sym sym_t;
typedef struct bt_merge merge_t;

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
    const struct bt_merge_slot *m = merge_find(t, a, b);
    if (m) heap_push(heap, hn, (merge_t){m->rank, pos, m->new_id, a, b});
}

static void out_append(bt_enc_ctx *c, const int32_t *v, size_t k);

/* word.rs merge_all for a short word, without a heap: the current pairs' ranks in an array,
 * repeatedly merge the lowest-ranked one (leftmost on ties), as the heap would pop them. The
 * symbols' ids are in sym[i].id (k of them). */
#define BPE_SMALL 32
static void bpe_small(bt_enc_ctx *c, sym_t *sym, int32_t k) {
    const bt_tokenizer *t = c->t;
    int32_t id[BPE_SMALL], rank[BPE_SMALL], nid[BPE_SMALL];
    for (int32_t i = 0; i < k; i++) id[i] = sym[i].id;
    for (int32_t i = 0; i + 1 < k; i++) {
        const struct bt_merge_slot *m = merge_find(t, id[i], id[i + 1]);
        rank[i] = m ? m->rank : INT32_MAX;
        nid[i] = m ? m->new_id : -1;
    }
    while (k > 1) {
        int32_t best = INT32_MAX, bi = -1;
        for (int32_t i = 0; i + 1 < k; i++)
            if (rank[i] < best) {
                best = rank[i];
                bi = i;
            }
        if (bi < 0) break;
        id[bi] = nid[bi];
        for (int32_t i = bi + 1; i + 1 < k; i++) id[i] = id[i + 1];
        for (int32_t i = bi + 1; i + 2 < k; i++) {
            rank[i] = rank[i + 1];
            nid[i] = nid[i + 1];
        }
        k--;
        for (int32_t i = bi > 0 ? bi - 1 : 0; i <= bi && i + 1 < k; i++) {
            const struct bt_merge_slot *m = merge_find(t, id[i], id[i + 1]);
            rank[i] = m ? m->rank : INT32_MAX;
            nid[i] = m ? m->new_id : -1;
        }
    }
    out_append(c, id, (size_t)k);
}

/* HF models/bpe/model.rs tokenize_with_cache + merge_word, word.rs merge_all (dropout none):
 * ignore_merges whole-piece lookup first; bytes without a single-byte token become unk_token
 * (consecutive ones fused when fuse_unk) or are dropped when there is no unk_token. */
static void bpe_merge(bt_enc_ctx *c, const uint8_t *w, size_t n) {
    const bt_tokenizer *t = c->t;
    if (t->ignore_merges) {
        int32_t id = t->model == MODEL_CHARS ? bt_tok_model_find(t, (const char *)w, n) : raw_find(t, w, n);
        if (id >= 0) { bt_tok_out_push(c, id); return; }
    }
    if (n > c->cap) { /* symbols and the heap's 3 x n pairs: the piece's size, so fallible */
        size_t sym_cap = c->cap, heap_cap = 3 * c->cap;
        sym_t *sy = bt_vec_grow(c->sym, &sym_cap, n, sizeof *c->sym);
        if (sy) c->sym = sy;
        merge_t *hp = sy ? bt_vec_grow(c->heap, &heap_cap, 3 * sym_cap, sizeof *c->heap) : NULL;
        if (!hp) {
            c->err = BT_ERR_NOMEM;
            return;
        }
        c->heap = hp;
        c->cap = sym_cap;
    }
    sym_t *sym = c->sym;
    int32_t k = 0;
    int prev_unk = 0;
    if (t->model == MODEL_CHARS) { /* model.rs merge_word: one symbol per char */
        int32_t unk_pending = 0; /* an unk symbol waiting to be added (fuse_unk extends it) */
        for (size_t i = 0; i < n;) {
            size_t cl = 1;
            while (i + cl < n && (w[i + cl] & 0xC0) == 0x80) cl++;
            int32_t id = bt_tok_model_find(t, (const char *)w + i, cl);
            if (id >= 0) {
                if (unk_pending) { sym[k] = (sym_t){t->unk, k - 1, k + 1}; k++; unk_pending = 0; }
                sym[k] = (sym_t){id, k - 1, k + 1};
                k++;
            } else {
                int fb_ok = t->byte_fallback;
                for (size_t j = 0; j < cl && fb_ok; j++) fb_ok = t->fb_id[w[i + j]] >= 0;
                if (fb_ok) { /* byte_fallback: the char's bytes, an unk waiting before them stays pending */
                    for (size_t j = 0; j < cl; j++) { sym[k] = (sym_t){t->fb_id[w[i + j]], k - 1, k + 1}; k++; }
                } else if (t->unk >= 0) {
                    if (unk_pending && !t->fuse_unk) { sym[k] = (sym_t){t->unk, k - 1, k + 1}; k++; }
                    unk_pending = 1;
                }
            }
            i += cl;
        }
        if (unk_pending) { sym[k] = (sym_t){t->unk, k - 1, k + 1}; k++; }
    }
    for (size_t i = 0; i < n && t->model != MODEL_CHARS; i++) {
        int32_t id = t->byte_id[w[i]];
        if (id < 0) {
            if (t->unk < 0) continue;
            if (prev_unk && t->fuse_unk) continue;
            id = t->unk;
            prev_unk = 1;
        } else {
            prev_unk = 0;
        }
        sym[k] = (sym_t){id, k - 1, k + 1};
        k++;
    }
    if (k == 0) return;
    if (k <= BPE_SMALL) {
        bpe_small(c, sym, k);
        return;
    }
    sym[k - 1].next = -1;
    size_t hn = 0;
    for (int32_t i = 0; i + 1 < k; i++) push_pair(t, c->heap, &hn, i, sym[i].id, sym[i + 1].id);
    while (hn) {
        merge_t top = heap_pop(c->heap, &hn);
        sym_t *s = &sym[top.pos];
        if (s->id < 0 || s->next < 0) continue;
        sym_t *r = &sym[s->next];
        if (s->id != top.left || r->id != top.right) continue; /* stale: a neighbour merged meanwhile */
        s->id = top.new_id;
        r->id = -1;
        s->next = r->next;
        if (r->next >= 0) sym[r->next].prev = top.pos;
        if (s->prev >= 0) push_pair(t, c->heap, &hn, s->prev, sym[s->prev].id, s->id);
        if (s->next >= 0) push_pair(t, c->heap, &hn, top.pos, s->id, sym[s->next].id);
    }
    for (int32_t i = 0; i >= 0; i = sym[i].next) bt_tok_out_push(c, sym[i].id);
}

/* Piece cache (as HF BPE's per-model cache, models/bpe/model.rs): a pre-token's ids depend only
 * on its bytes, and natural text repeats its pieces, so each thread keeps a direct-mapped table
 * of the last PC_SLOTS pieces of up to PC_MAX_BYTES bytes and PC_MAX_IDS ids (32-byte entries,
 * 256 KiB: it stays in L2 next to the hot part of the merge table; about 97% of the lookups on
 * the parity corpus are pieces this short). An entry is valid
 * for the generation it was written in; the generation changes when the thread switches to
 * another tokenizer (bt_tokenizer.serial), so a hit always comes from the same vocabulary and
 * merges. Owned by the thread (pthread key destructor frees it at thread exit). */
#define PC_SLOTS 8192u
#define PC_MAX_BYTES 14
#define PC_MAX_IDS 3

typedef struct {
    uint32_t gen;
    uint8_t len, nids;
    uint8_t b[PC_MAX_BYTES];
    int32_t ids[PC_MAX_IDS];
} pc_ent;
_Static_assert(sizeof(pc_ent) == 32, "piece cache entries are half a cache line");

struct bt_piece_cache {
    uint64_t serial;
    uint32_t gen;
    pc_ent e[PC_SLOTS];
};

static pthread_key_t pc_key;
static int pc_key_ok;
static pthread_once_t pc_once = PTHREAD_ONCE_INIT;

static void pc_key_make(void) { pc_key_ok = pthread_key_create(&pc_key, free) == 0; }

static struct bt_piece_cache *pc_get(const bt_tokenizer *t) {
    pthread_once(&pc_once, pc_key_make);
    if (!pc_key_ok) return NULL;
    struct bt_piece_cache *pc = pthread_getspecific(pc_key);
    if (!pc) {
        pc = calloc(1, sizeof *pc);
        if (!pc) return NULL; /* the cache is an optimisation: run without it */
        if (pthread_setspecific(pc_key, pc) != 0) {
            free(pc);
            return NULL;
        }
    }
    if (pc->serial != t->serial) {
        pc->serial = t->serial;
        if (++pc->gen == 0) { /* generations wrapped: forget everything */
            memset(pc->e, 0, sizeof pc->e);
            pc->gen = 1;
        }
    }
    return pc;
}

static inline uint32_t pc_hash(const uint8_t *w, size_t n) {
    uint64_t h = (uint64_t)n * 0x9E3779B97F4A7C15ull;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t x;
        memcpy(&x, w + i, 8);
        h = (h ^ x) * 0xFF51AFD7ED558CCDull;
        h ^= h >> 32;
    }
    if (i < n) {
        uint64_t x = 0;
        memcpy(&x, w + i, n - i);
        h = (h ^ x) * 0xC4CEB9FE1A85EC53ull;
    }
    return (uint32_t)(h ^ (h >> 29));
}

static void out_append(bt_enc_ctx *c, const int32_t *v, size_t k) {
    if (!c->err && bt_ids_try_append(c->out, v, k)) c->err = BT_ERR_NOMEM;
}

void bt_tok_bpe_word(bt_enc_ctx *c, const uint8_t *w, size_t n) {
    const bt_tokenizer *t = c->t;
    if (n == 0 || c->err) return;
    if (c->pieces_only) {
        bt_tok_out_push(c, (int32_t)n);
        return;
    }
    if (n == 1 && t->byte_id[w[0]] >= 0 && !t->ignore_merges && t->model == MODEL_BYTELEVEL) {
        bt_tok_out_push(c, t->byte_id[w[0]]);
        return;
    }
    struct bt_piece_cache *pc = c->pc;
    if (!pc || n > PC_MAX_BYTES) {
        bpe_merge(c, w, n);
        return;
    }
    pc_ent *e = &pc->e[pc_hash(w, n) & (PC_SLOTS - 1)];
    if (e->gen == pc->gen && e->len == n && memcmp(e->b, w, n) == 0) {
        out_append(c, e->ids, e->nids);
        return;
    }
    size_t n0 = c->out->n;
    bpe_merge(c, w, n);
    size_t k = c->out->n - n0;
    if (k <= PC_MAX_IDS && !c->err) {
        e->gen = pc->gen;
        e->len = (uint8_t)n;
        e->nids = (uint8_t)k;
        memcpy(e->b, w, n);
        if (k) memcpy(e->ids, c->out->v + n0, k * sizeof *e->ids);
    }
}

void bt_tokenize_release_cache(void) {
    pthread_once(&pc_once, pc_key_make);
    if (!pc_key_ok) return;
    free(pthread_getspecific(pc_key));
    pthread_setspecific(pc_key, NULL);
}

int bt_tok_pieces(const bt_tokenizer *t, const char *s, size_t n, bt_ids *lens) {
    bt_enc_ctx c = {.t = t, .out = lens, .pieces_only = 1};
    c.at0 = 1;
    int rc = bt_tok_pre_all(&c, s, n);
    if (rc == 0 && c.err) rc = bt_fail(c.err, "tokenize: out of memory listing the pieces of %zu bytes", n);
    bt_tok_ctx_free(&c);
    return rc;
}

void bt_tok_ctx_free(bt_enc_ctx *c) {
    pcre2_match_data_free(c->md);
    free(c->sym);
    free(c->heap);
    for (int i = 0; i < BT_TOK_MAX_PRE; i++) free(c->pbuf[i]);
    free(c->mbuf);
}

pcre2_match_data *bt_tok_md(bt_enc_ctx *c) {
    if (!c->md && !(c->md = pcre2_match_data_create(4, NULL)))
        bt_fail(BT_ERR_NOMEM, "tokenize: pcre2 match data allocation failed");
    return c->md;
}

/* ---- added tokens ---- */

/* Rust char::is_whitespace (Unicode White_Space). */
static int is_white(int32_t cp) {
    return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
           (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
           cp == 0x3000;
}

/* Start of the char ending at s[end) (end > 0). */
static size_t char_start_before(const char *s, size_t end) {
    size_t i = end - 1;
    while (i > 0 && ((uint8_t)s[i] & 0xC0) == 0x80) i--;
    return i;
}

/* Rust regex \w on the char at s[a..b). */
static int is_word_char(bt_enc_ctx *c, const char *s, size_t a, size_t b) {
    pcre2_match_data *md = bt_tok_md(c);
    if (!md) return 0;
    return pcre2_match(c->t->re_word, (PCRE2_SPTR)s + a, b - a, 0, PCRE2_NO_UTF_CHECK | PCRE2_ANCHORED, md,
                       NULL) >= 0;
}

static int run_normalized(bt_enc_ctx *c, const char *s, size_t n, int parse_special, int at0);

/* Pre-tokenizes one run; at0: the run starts at offset 0 of the input (Metaspace "first"). */
static int pre_run_at(bt_enc_ctx *c, const char *s, size_t n, int at0) {
    c->at0 = at0;
    return bt_tok_pre_all(c, s, n);
}

/* HF AddedVocabulary::find_matches over one split, then the gaps go on to the next stage
 * (pass 0: normalisation and pass 1; pass 1: pre-tokenisation). */
static int added_split(bt_enc_ctx *c, const bt_added_set *set, int pass, const char *s, size_t n, int parse_special,
                       int at0) {
    const bt_tokenizer *t = c->t;
    size_t start_offset = 0, i = 0;
    int rc = 0;
    if (set->n > 0) {
        while (i < n) {
            if (set->only_first >= 0) { /* jump to the next byte that can start an added token */
                const char *q = memchr(s + i, set->only_first, n - i);
                if (!q) break;
                i = (size_t)(q - s);
            }
            uint32_t lo = set->first[(uint8_t)s[i]], hi = set->first[(uint8_t)s[i] + 1];
            const bt_added *a = NULL;
            for (uint32_t k = lo; k < hi; k++) {
                const bt_added *e = &t->added[set->idx[k]];
                if (e->len <= n - i && memcmp(s + i, e->text, e->len) == 0) { a = e; break; }
            }
            if (!a) { i++; continue; }
            size_t start = i, stop = i + a->len;
            i = stop; /* non-overlapping: the search resumes after this match */
            if (a->special && !parse_special) continue;
            if (a->single_word) {
                int start_space = start == 0 || !is_word_char(c, s, char_start_before(s, start), start);
                int stop_space = 1;
                if (stop < n) {
                    size_t j = stop;
                    bt_tok_utf8_next((const uint8_t *)s, n, &j);
                    stop_space = !is_word_char(c, s, stop, j);
                }
                if (!start_space || !stop_space) continue;
            }
            if (a->lstrip) {
                size_t ns = start;
                while (ns > 0) {
                    size_t cs = char_start_before(s, ns), j = cs;
                    if (!is_white(bt_tok_utf8_next((const uint8_t *)s, n, &j))) break;
                    ns = cs;
                }
                start = ns > start_offset ? ns : start_offset;
            }
            if (a->rstrip) {
                while (stop < n) {
                    size_t j = stop;
                    if (!is_white(bt_tok_utf8_next((const uint8_t *)s, n, &j))) break;
                    stop = j;
                }
            }
            if (start_offset < start) {
                rc = pass == 0 ? run_normalized(c, s + start_offset, start - start_offset, parse_special,
                                                at0 && start_offset == 0)
                               : pre_run_at(c, s + start_offset, start - start_offset, at0 && start_offset == 0);
                if (rc < 0) return rc;
            }
            bt_tok_out_push(c, a->id);
            if (c->err) return c->err;
            start_offset = stop;
        }
    }
    if (start_offset < n)
        rc = pass == 0 ? run_normalized(c, s + start_offset, n - start_offset, parse_special, at0 && start_offset == 0)
                       : pre_run_at(c, s + start_offset, n - start_offset, at0 && start_offset == 0);
    return rc;
}

static int run_normalized(bt_enc_ctx *c, const char *s, size_t n, int parse_special, int at0) {
    char *norm = NULL;
    size_t nl = 0;
    if (c->t->n_norm) {
        int rc = bt_tok_normalize(c->t, s, n, &norm, &nl);
        if (rc < 0) return rc;
        if (norm) { s = norm; n = nl; }
    }
    int rc = added_split(c, &c->t->set_norm, 1, s, n, parse_special, at0);
    free(norm);
    return rc;
}

/* bt_tokenize / bt_tokenize_run: at0 = the text starts the input (HF Metaspace "first"). */
static int tokenize_at(const bt_tokenizer *t, const char *text, size_t len, int parse_special, int at0,
                       bt_ids *out) {
    if (!t || !out || (!text && len)) return bt_fail(BT_ERR_INVALID, "tokenize: NULL argument");
    if (len == 0) return 0;
    if (len > (size_t)INT32_MAX)
        return bt_fail(BT_ERR_RANGE, "tokenize: input of %zu bytes exceeds the 2 GiB limit", len);
    size_t n0 = out->n;
    char *clean = NULL;
    size_t clen = 0;
    int rc;
    bt_enc_ctx c = {.t = t, .out = out};
    if (t->model == MODEL_SPM) { /* llama.cpp tokenizes the bytes as given (byte fallback) */
        rc = bt_tok_spm_encode(&c, text, len, parse_special);
    } else {
        rc = utf8_sanitize(text, len, &clean, &clen);
        if (rc < 0) return rc;
        if (clean) { text = clean; len = clen; }
        c.pc = pc_get(t);
        rc = added_split(&c, &t->set_raw, 0, text, len, parse_special, at0);
    }
    if (c.err && (rc == 0 || rc == c.err)) /* a document larger than memory allows: the caller skips it */
        rc = bt_fail(BT_ERR_NOMEM, "tokenize: out of memory for the tokens of %zu bytes of text", len);
    bt_tok_ctx_free(&c);
    free(clean);
    if (rc < 0) out->n = n0; /* nothing appended on failure */
    return rc;
}

int bt_tokenize(const bt_tokenizer *t, const char *text, size_t len, int parse_special, bt_ids *out) {
    return tokenize_at(t, text, len, parse_special, 1, out);
}

int bt_tokenize_run(const bt_tokenizer *t, const char *text, size_t len, int at_start, bt_ids *out) {
    /* SentencePiece GGUF: a fragment after a token gets the space prefix as the first one does
     * (llama.cpp's is_prev_special), so the run alone tokenizes as it does inside the text */
    return tokenize_at(t, text, len, 0, at_start != 0, out);
}

size_t bt_tokenizer_strip(const bt_tokenizer *t, int32_t id, const char *text, size_t len, int after) {
    if (!t || !text || !len) return 0;
    if (t->model == MODEL_SPM) {
        if (!t->spm.any_strip) return 0; /* the common case: no scan of the special tokens */
        int fl = 0;
        for (int32_t k = 0; k < t->spm.n_sp; k++)
            if (t->spm.sp_id[k] == id) { fl = t->spm.sp_flag[k]; break; }
        if (!(fl & (after ? SPF_RSTRIP : SPF_LSTRIP))) return 0;
        size_t n = 0; /* C isspace, as llama.cpp's tokenizer_st_partition */
        if (after)
            while (n < len && (text[n] == ' ' || (text[n] >= '\t' && text[n] <= '\r'))) n++;
        else
            while (n < len && (text[len - 1 - n] == ' ' || (text[len - 1 - n] >= '\t' && text[len - 1 - n] <= '\r'))) n++;
        return n;
    }
    const bt_added *a = NULL;
    for (int32_t i = 0; i < t->n_added && !a; i++)
        if (t->added[i].id == id) a = &t->added[i];
    if (!a || !(after ? a->rstrip : a->lstrip)) return 0;
    size_t n = 0; /* Rust char::is_whitespace, as HF's AddedVocabulary */
    if (after) {
        while (n < len) {
            size_t j = n;
            int32_t cp = bt_tok_utf8_next((const uint8_t *)text, len, &j);
            if (cp < 0 || !is_white(cp)) break;
            n = j;
        }
    } else {
        while (n < len) {
            size_t cs = char_start_before(text, len - n), j = cs;
            int32_t cp = bt_tok_utf8_next((const uint8_t *)text, len, &j);
            if (cp < 0 || j != len - n || !is_white(cp)) break;
            n = len - cs;
        }
    }
    return n;
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

uint64_t bt_tok_mem_formula(uint64_t n, uint64_t text, uint64_t m, uint64_t a, uint64_t added_text, uint64_t other) {
    uint64_t b = sizeof(bt_tokenizer) + other;
    b += 2 * n;                                          /* type, byte_ok */
    b += 2 * (text + n);                                 /* pieces, raw (NUL-terminated / same size) */
    b += 2 * 4 * (n + 1);                                /* piece_off, raw_off */
    b += 2 * 4 * (uint64_t)pow2_at_least(2 * n);         /* vslot, rslot */
    if (m) b += sizeof(struct bt_merge_slot) * (uint64_t)pow2_at_least(2 * m);
    b += (a + 1) * sizeof(bt_added) + added_text + a;    /* added tokens and their texts */
    b += 2 * 4 * (a + 1);                                /* set_raw, set_norm */
    return b;
}

static uint64_t re_size(const pcre2_code *re) {
    size_t sz = 0;
    return re && pcre2_pattern_info(re, PCRE2_INFO_SIZE, &sz) == 0 ? sz : 0;
}

uint64_t bt_tokenizer_mem_bytes(const bt_tokenizer *t) {
    if (!t) return 0;
    uint64_t n = (uint64_t)t->n_vocab, text = n ? (uint64_t)t->piece_off[n] - n : 0, added_text = 0, other = 0;
    for (int32_t i = 0; i < t->n_added; i++) added_text += t->added[i].len;
    for (int i = 0; i < t->n_pre; i++) other += re_size(t->pre_steps[i].re) + t->pre_steps[i].src_len;
    other += re_size(t->re_word);
    if (t->pre) other += strlen(t->pre) + 1;
    if (t->chat_template) other += strlen(t->chat_template) + 1;
    for (int k = 0; k < BT_TOK_MAX_NORM; k++) other += t->norm_al[k] + t->norm_bl[k];
    other += bt_tok_spm_mem(t);
    uint64_t m = t->merges ? ((uint64_t)t->mmask + 1) / 2 : 0;
    return bt_tok_mem_formula(n, text, m, (uint64_t)t->n_added, added_text, other);
}

int32_t bt_tokenizer_find(const bt_tokenizer *t, const char *piece) {
    if (!t || !piece) return -1;
    size_t n = strlen(piece);
    for (int32_t i = 0; i < t->n_added; i++) /* HF token_to_id: added vocabulary first */
        if (t->added[i].len == n && !t->added[i].normalized && memcmp(t->added[i].text, piece, n) == 0)
            return t->added[i].id;
    return bt_tok_vocab_find(t, piece, n);
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

static int cmp_merge_rank(const void *a, const void *b) {
    int32_t x = ((const struct bt_merge_slot *)a)->rank, y = ((const struct bt_merge_slot *)b)->rank;
    return (x > y) - (x < y);
}

void bt_tokenizer_digest(const bt_tokenizer *t, void (*update)(void *ctx, const void *p, size_t n), void *ctx) {
    static const char tag[] = "barqtrain-tokenizer-digest-v1";
    uint32_t impl = BT_TOKENIZER_IMPL_VERSION;
    update(ctx, tag, sizeof tag);
    update(ctx, &impl, sizeof impl);
    int32_t head[8] = {t->n_vocab, t->unk, t->fuse_unk, t->ignore_merges, t->bos, t->eos, t->pad, t->n_added};
    update(ctx, head, sizeof head);
    update(ctx, t->type, (size_t)t->n_vocab);
    update(ctx, t->piece_off, ((size_t)t->n_vocab + 1) * sizeof *t->piece_off);
    update(ctx, t->pieces, t->piece_off[t->n_vocab]);
    size_t nm = 0;
    for (size_t h = 0; t->merges && h <= t->mmask; h++) nm += t->merges[h].key != UINT64_MAX;
    struct bt_merge_slot *m = bt_xmalloc((nm ? nm : 1) * sizeof *m);
    nm = 0;
    for (size_t h = 0; t->merges && h <= t->mmask; h++)
        if (t->merges[h].key != UINT64_MAX) m[nm++] = t->merges[h];
    qsort(m, nm, sizeof *m, cmp_merge_rank); /* ranks are unique: a canonical order */
    update(ctx, &nm, sizeof nm);
    update(ctx, m, nm * sizeof *m);
    free(m);
    for (int32_t i = 0; i < t->n_added; i++) {
        const bt_added *a = &t->added[i];
        int32_t f[7] = {a->id, (int32_t)a->len, a->special, a->lstrip, a->rstrip, a->single_word, a->normalized};
        update(ctx, f, sizeof f);
        update(ctx, a->text, a->len);
    }
    int32_t nn[2] = {t->n_norm, t->n_pre};
    update(ctx, nn, sizeof nn);
    update(ctx, t->norm, (size_t)t->n_norm * sizeof *t->norm);
    for (int i = 0; i < t->n_pre; i++) {
        const bt_pre_step *p = &t->pre_steps[i];
        int32_t f[6] = {p->kind, p->behavior, p->invert, p->add_prefix_space, p->literal, (int32_t)p->src_len};
        update(ctx, f, sizeof f);
        if (p->src) update(ctx, p->src, p->src_len);
        if (p->kind == PRE_METASPACE) {
            int32_t ms[3] = {p->ms_prepend, p->ms_split, p->ms_rep_len};
            update(ctx, ms, sizeof ms);
            update(ctx, p->ms_rep, p->ms_rep_len);
        }
    }
    if (t->model == MODEL_BYTELEVEL) return; /* the byte-level description is unchanged (v1 caches) */
    int32_t sf[7] = {t->model, t->byte_fallback, t->dup_last, t->dec_replace, t->dec_bytefb, t->dec_strip,
                     t->spm.add_space_prefix};
    update(ctx, sf, sizeof sf);
    for (int k = 0; k < t->n_norm; k++) {
        uint64_t l[2] = {t->norm_al[k], t->norm_bl[k]};
        update(ctx, l, sizeof l);
        if (t->norm_al[k]) update(ctx, t->norm_a[k], t->norm_al[k]);
        if (t->norm_bl[k]) update(ctx, t->norm_b[k], t->norm_bl[k]);
    }
    if (t->spm.score) update(ctx, t->spm.score, (size_t)t->n_vocab * sizeof *t->spm.score);
    update(ctx, &t->spm.n_sp, sizeof t->spm.n_sp);
    if (t->spm.n_sp) {
        update(ctx, t->spm.sp_id, (size_t)t->spm.n_sp * sizeof *t->spm.sp_id);
        update(ctx, t->spm.sp_flag, (size_t)t->spm.n_sp);
    }
}

const char *bt_tokenizer_pre_engine(const bt_tokenizer *t) {
    static const char *const names[] = {"pcre2", "gpt2", "smollm", "llama3", "qwen2"};
    if (!t) return NULL;
    if (t->model == MODEL_SPM) return "spm";
    int re = 0;
    for (int i = 0; i < t->n_pre; i++) re |= t->pre_steps[i].re != NULL;
    return !t->fast_pre && !re ? "none" : names[t->fast_pre];
}

int bt_tokenizer_set_pre_engine(bt_tokenizer *t, int dedicated) {
    if (!t) return bt_fail(BT_ERR_INVALID, "tokenizer: NULL tokenizer");
    if (dedicated && !t->fast_avail)
        return bt_fail(BT_ERR_UNSUPPORTED, "tokenizer: no dedicated pre-tokenizer for this pipeline (pre \"%s\")",
                       t->pre ? t->pre : "?");
    t->fast_pre = dedicated ? t->fast_avail : 0;
    return 0;
}

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
