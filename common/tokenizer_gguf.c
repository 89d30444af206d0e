/* Byte-level BPE tokenizer from GGUF tokenizer.ggml.* metadata (llama.cpp gguf-py conventions:
 * tokens, token_type, merges "A B", pre, bos/eos/padding ids, chat_template).
 * The pre-tokenizer name selects the Hugging Face pipeline the model's tokenizer.json uses
 * (llama.cpp src/llama-vocab.cpp pre types; HF tokenizer.json of each family):
 *   "gpt2"               ByteLevel(use_regex = true)
 *   "smollm"             Digits(individual_digits = true), ByteLevel(use_regex = true)
 *   "llama-bpe"/"llama3" Split(Llama-3 pattern, Isolated), ByteLevel(use_regex = false);
 *                        BPE ignore_merges = true
 *   "qwen2"              NFC; Split(Qwen2 pattern, Isolated), ByteLevel(use_regex = false)
 * Added tokens: control tokens (type 3) are HF special tokens, user-defined tokens (type 4)
 * non-special ones; none normalized, stripped or single-word (as llama.cpp converts them). */
#include "common/tokenizer_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>


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

/* Sets the pre-tokenizer pipeline of a GGUF pre type; BT_ERR_UNSUPPORTED for other names. */
static int set_pre(bt_tokenizer *t, bt_str s) {
#define IS(lit) (s.len == sizeof(lit) - 1 && memcmp(s.ptr, lit, s.len) == 0)
    int rc = 0;
    if (IS("gpt2") || IS("smollm")) {
        if (IS("smollm")) t->pre_steps[t->n_pre++] = (bt_pre_step){.kind = PRE_DIGITS, .behavior = BEH_ISOLATED};
        bt_pre_step *p = &t->pre_steps[t->n_pre++];
        *p = (bt_pre_step){.kind = PRE_BYTELEVEL, .pat = PAT_GPT2};
        rc = bt_tok_step_regex(p, BT_TOK_GPT2_PATTERN, strlen(BT_TOK_GPT2_PATTERN), 0);
    } else if (IS("llama-bpe") || IS("llama3") || IS("qwen2")) {
        const char *pat = IS("qwen2") ? BT_TOK_QWEN2_PATTERN : BT_TOK_LLAMA3_PATTERN;
        if (IS("qwen2")) t->norm[t->n_norm++] = NORM_NFC;
        else t->ignore_merges = 1;
        bt_pre_step *p = &t->pre_steps[t->n_pre++];
        *p = (bt_pre_step){.kind = PRE_SPLIT, .behavior = BEH_ISOLATED, .pat = IS("qwen2") ? PAT_QWEN2 : PAT_LLAMA3};
        rc = bt_tok_step_regex(p, pat, strlen(pat), 0);
        t->pre_steps[t->n_pre++] = (bt_pre_step){.kind = PRE_BYTELEVEL};
    } else {
        return bt_fail(BT_ERR_UNSUPPORTED,
                       "tokenizer: pre-tokeniser \"%.*s\" unsupported (gpt2, smollm, llama-bpe, llama3, qwen2)",
                       (int)(s.len > 64 ? 64 : s.len), s.ptr);
    }
#undef IS
    if (rc == 0) {
        t->pre = dup_str(s);
        bt_tok_pre_select(t);
    }
    return rc;
}

/* Stage: tokenizer.ggml.model must be "gpt2" (byte-level BPE; then tokenizer.ggml.pre must be
 * present) or "llama" (SentencePiece: *spm = 1, *pre untouched). Reads g; writes *pre (points
 * into g's mapping). Errors: BT_ERR_NOTFOUND (a key missing), BT_ERR_UNSUPPORTED (another
 * model), the reader's error for a key of the wrong type. */
static int gguf_tok_kind(const bt_gguf *g, bt_str *pre, int *spm) {
    bt_str s;
    *spm = 0;
    int rc = bt_gguf_get_str(g, "tokenizer.ggml.model", &s);
    if (rc < 0) return rc == BT_ERR_NOTFOUND ? bt_fail(rc, "tokenizer: no tokenizer.ggml.model key") : rc;
    if (s.len == 5 && memcmp(s.ptr, "llama", 5) == 0) {
        *spm = 1;
        return 0;
    }
    if (s.len != 4 || memcmp(s.ptr, "gpt2", 4) != 0)
        return bt_fail(BT_ERR_UNSUPPORTED, "tokenizer: model \"%.*s\" unsupported (\"gpt2\" byte-level BPE, \"llama\" "
                       "SentencePiece)", (int)(s.len > 64 ? 64 : s.len), s.ptr);
    rc = bt_gguf_get_str(g, "tokenizer.ggml.pre", pre);
    if (rc < 0)
        return rc == BT_ERR_NOTFOUND ? bt_fail(rc, "tokenizer: no tokenizer.ggml.pre key (pre-tokeniser unknown)") : rc;
    return 0;
}

/* Stage: tokenizer.ggml.token_type into types [n_tok] (pre-filled by the caller with TT_NORMAL:
 * an absent key means all normal, as llama.cpp). Reads g; writes types. Errors: BT_ERR_FORMAT
 * (count differs from n_tok, an element not an integer in [0, 255]), the reader's error. */
static int gguf_tok_types(const bt_gguf *g, uint64_t n_tok, uint8_t *types) {
    bt_gguf_vtype et;
    const void *data;
    uint64_t cnt;
    int rc = bt_gguf_get_num_arr(g, "tokenizer.ggml.token_type", &et, &data, &cnt);
    if (rc == BT_ERR_NOTFOUND) return 0;
    if (rc != 0) return rc;
    if (cnt != n_tok)
        return bt_fail(BT_ERR_FORMAT, "tokenizer: token_type has %llu entries, tokens %llu",
                       (unsigned long long)cnt, (unsigned long long)n_tok);
    for (uint64_t i = 0; i < cnt; i++) {
        int64_t v;
        if (read_int_elem(et, data, i, &v) < 0 || v < 0 || v > 255)
            return bt_fail(BT_ERR_FORMAT, "tokenizer: token_type[%llu] invalid (element type %d)",
                           (unsigned long long)i, (int)et);
        types[i] = (uint8_t)v;
    }
    return 0;
}

/* Stage: tokenizer.ggml.merges ("A B" in the byte alphabet, rank = index) into t
 * (bt_tok_set_merges, which copies). Reads g; writes t's merge table; the temporary arrays are
 * freed here. Errors: BT_ERR_FORMAT (too many merges, a merge not exactly "A B"), those of the
 * reader and of bt_tok_set_merges. */
static int gguf_tok_merges(bt_tokenizer *t, const bt_gguf *g) {
    bt_str *merges = NULL, *ma = NULL, *mb = NULL;
    uint64_t n_merge = 0;
    int rc = bt_gguf_get_str_arr(g, "tokenizer.ggml.merges", &merges, &n_merge);
    if (rc < 0) return rc;
    if (n_merge > (uint64_t)INT32_MAX / 4) {
        free(merges);
        return bt_fail(BT_ERR_FORMAT, "tokenizer: tokenizer.ggml.merges has %llu entries", (unsigned long long)n_merge);
    }
    ma = bt_xmalloc(((size_t)n_merge + 1) * sizeof *ma);
    mb = bt_xmalloc(((size_t)n_merge + 1) * sizeof *mb);
    for (uint64_t m = 0; m < n_merge && rc >= 0; m++) {
        const char *p = merges[m].ptr;
        size_t len = merges[m].len;
        const char *sp = memchr(p, ' ', len);
        if (!sp || sp == p || (size_t)(sp - p) + 1 >= len || memchr(sp + 1, ' ', len - (size_t)(sp - p) - 1)) {
            rc = bt_fail(BT_ERR_FORMAT, "tokenizer: merge %llu \"%.*s\" is not \"A B\"", (unsigned long long)m,
                         (int)(len > 64 ? 64 : len), p);
            break;
        }
        ma[m] = (bt_str){p, (size_t)(sp - p)};
        mb[m] = (bt_str){sp + 1, len - (size_t)(sp - p) - 1};
    }
    if (rc >= 0) rc = bt_tok_set_merges(t, n_merge, ma, mb);
    free(merges);
    free(ma);
    free(mb);
    return rc;
}

/* Stage: the optional special ids (bos / eos / padding, get_opt_id) and tokenizer.chat_template
 * (copied). Reads g; writes t->bos, t->eos, t->pad, t->chat_template (owned by t). Errors: those
 * of get_opt_id, the reader's error for a chat_template that is not a string. */
static int gguf_tok_specials(bt_tokenizer *t, const bt_gguf *g, int32_t n) {
    int rc;
    if ((rc = get_opt_id(g, "tokenizer.ggml.bos_token_id", n, &t->bos)) < 0) return rc;
    if ((rc = get_opt_id(g, "tokenizer.ggml.eos_token_id", n, &t->eos)) < 0) return rc;
    if ((rc = get_opt_id(g, "tokenizer.ggml.padding_token_id", n, &t->pad)) < 0) return rc;
    if (t->model == MODEL_SPM) { /* llama.cpp's SPM defaults: bos 1, eos 2, unk 0 */
        uint64_t v;
        if (bt_gguf_get_u64(g, "tokenizer.ggml.bos_token_id", &v) != 0 && n > 1) t->bos = 1;
        if (bt_gguf_get_u64(g, "tokenizer.ggml.eos_token_id", &v) != 0 && n > 2) t->eos = 2;
        if ((rc = get_opt_id(g, "tokenizer.ggml.unknown_token_id", n, &t->unk)) < 0) return rc;
        if (bt_gguf_get_u64(g, "tokenizer.ggml.unknown_token_id", &v) != 0) t->unk = 0;
    }
    bt_str s;
    rc = bt_gguf_get_str(g, "tokenizer.chat_template", &s);
    if (rc == 0) t->chat_template = dup_str(s);
    else if (rc != BT_ERR_NOTFOUND) return rc;
    return 0;
}

/* Stage: added tokens: control (type 3, special) and user-defined (type 4, non-special) tokens
 * with valid UTF-8 text; others of those types become TT_UNUSED (never matched). Reads toks /
 * types [n]; writes t->added (texts copied, owned by t), t->type. Errors: those of
 * bt_tok_build_added. */
static int gguf_tok_added(bt_tokenizer *t, const bt_str *toks, const uint8_t *types, int32_t n) {
    int32_t n_add = 0;
    for (int32_t i = 0; i < n; i++) n_add += types[i] == TT_CONTROL || types[i] == TT_USER;
    t->added = bt_xmalloc(((size_t)n_add + 1) * sizeof *t->added); /* not one per token: few are */
    for (int32_t i = 0; i < n; i++) {
        if (types[i] != TT_CONTROL && types[i] != TT_USER) continue;
        if (!bt_tok_utf8_valid((const uint8_t *)toks[i].ptr, toks[i].len)) {
            t->type[i] = TT_UNUSED;
            continue;
        }
        bt_added *a = &t->added[t->n_added++];
        memset(a, 0, sizeof *a);
        a->id = i;
        a->text = dup_str(toks[i]);
        a->len = (uint32_t)toks[i].len;
        a->special = types[i] == TT_CONTROL;
    }
    return bt_tok_build_added(t);
}

/* Element count of the array at key (0 when absent or not an array). */
static uint64_t arr_count(const bt_gguf *g, const char *key) {
    int64_t i = bt_gguf_find_key(g, key);
    uint64_t n = 0;
    bt_gguf_vtype et;
    if (i >= 0) bt_gguf_kv_type(g, i, &et, &n);
    return n;
}

int bt_tok_gguf_estimate(const bt_gguf *g, uint64_t *bytes) {
    *bytes = 0;
    uint64_t n = arr_count(g, "tokenizer.ggml.tokens"), m = arr_count(g, "tokenizer.ggml.merges");
    if (n > BT_TOKENIZER_MAX_VOCAB)
        return bt_fail(BT_ERR_RANGE, "tokenizer: vocabulary of %llu tokens, more than the %u accepted (the largest real "
                       "ones have ~262k)", (unsigned long long)n, BT_TOKENIZER_MAX_VOCAB);
    if (m > BT_TOKENIZER_MAX_MERGES)
        return bt_fail(BT_ERR_RANGE, "tokenizer: %llu merges, more than the %u accepted", (unsigned long long)m,
                       BT_TOKENIZER_MAX_MERGES);
    bt_str *toks = NULL;
    uint64_t got = 0, text = 0, tmpl = 0;
    int rc = bt_gguf_get_str_arr(g, "tokenizer.ggml.tokens", &toks, &got);
    if (rc < 0) return rc == BT_ERR_NOTFOUND ? bt_fail(rc, "tokenizer: no tokenizer.ggml.tokens key") : rc;
    for (uint64_t i = 0; i < got; i++) text += toks[i].len;
    free(toks);
    if (text > BT_TOKENIZER_MAX_TEXT)
        return bt_fail(BT_ERR_RANGE, "tokenizer: %llu bytes of token text, more than the %llu MiB accepted",
                       (unsigned long long)text, (unsigned long long)(BT_TOKENIZER_MAX_TEXT >> 20));
    bt_str s;
    if (bt_gguf_get_str(g, "tokenizer.chat_template", &s) == 0) tmpl = s.len + 1;
    /* resident: every token could be an added one; regexes and per-thread scratch: 1 MiB;
     * transient while building: the token array (16 B each) and types, the merge arrays (48 B each);
     * SentencePiece: scores (4 B each), the special list (5 B each) and its trie (at most one
     * 16-byte node per byte of token text, twice for the growth) */
    *bytes = bt_tok_mem_formula(n, text, m, n, text, tmpl + ((uint64_t)1 << 20)) + 17 * n + 48 * (m + 1);
    bt_str model;
    if (bt_gguf_get_str(g, "tokenizer.ggml.model", &model) == 0 && model.len == 5 && memcmp(model.ptr, "llama", 5) == 0) {
        /* the special tokens' text bounds the trie; without types every token may be special */
        uint64_t sp_text = text;
        bt_gguf_vtype et;
        const void *data;
        uint64_t cnt;
        if (bt_gguf_get_num_arr(g, "tokenizer.ggml.token_type", &et, &data, &cnt) == 0 && cnt == got &&
            (rc = bt_gguf_get_str_arr(g, "tokenizer.ggml.tokens", &toks, &got)) == 0) {
            sp_text = 0;
            for (uint64_t i = 0; i < cnt; i++) {
                int64_t v;
                if (read_int_elem(et, data, i, &v) < 0 || v == TT_CONTROL || v == TT_USER || v == TT_UNKNOWN)
                    sp_text += toks[i].len;
            }
            free(toks);
        }
        *bytes += 9 * n + 32 * (sp_text + 256);
    }
    return BT_OK;
}

/* Stages, in order (each error stops the load): model / pre keys (gguf_tok_kind), the
 * pre-tokenizer (set_pre), tokens, token types (gguf_tok_types), vocabulary, merges
 * (gguf_tok_merges), special ids and chat template (gguf_tok_specials), added tokens
 * (gguf_tok_added). Contract: common/tokenizer.h. */
int bt_tokenizer_from_gguf(bt_tokenizer **out, const bt_gguf *g) {
    if (!out || !g) return bt_fail(BT_ERR_INVALID, "tokenizer_from_gguf: NULL argument");
    *out = NULL;
    bt_str pre_name;
    int spm = 0;
    int rc = gguf_tok_kind(g, &pre_name, &spm);
    if (rc < 0) return rc;
    bt_str *toks = NULL;
    uint64_t n_tok = 0;
    uint8_t *types = NULL;
    char *empty_names = NULL;
    bt_tokenizer *t = bt_tok_new();
    if (spm) {
        t->model = MODEL_SPM;
        t->dup_last = 1;
        t->pre = bt_xstrdup("spm");
    } else if ((rc = set_pre(t, pre_name)) < 0) {
        goto fail;
    }
    uint64_t est;
    if ((rc = bt_tok_gguf_estimate(g, &est)) < 0) goto fail; /* the bounds, before any large allocation */
    if ((rc = bt_gguf_get_str_arr(g, "tokenizer.ggml.tokens", &toks, &n_tok)) < 0) goto fail;
    if (n_tok == 0 || n_tok > (uint64_t)INT32_MAX / 2) {
        rc = bt_fail(BT_ERR_FORMAT, "tokenizer: tokenizer.ggml.tokens has %llu entries", (unsigned long long)n_tok);
        goto fail;
    }
    const int32_t n = (int32_t)n_tok;
    types = bt_xmalloc((size_t)n);
    memset(types, TT_NORMAL, (size_t)n);
    if ((rc = gguf_tok_types(g, n_tok, types)) != 0) goto fail;
    if (spm) { /* llama.cpp names an empty token "[EMPTY_<id>]" */
        size_t ne = 0;
        for (int32_t i = 0; i < n; i++) ne += toks[i].len == 0;
        empty_names = bt_xmalloc(ne * 24 + 1);
        size_t o = 0;
        for (int32_t i = 0; i < n; i++)
            if (toks[i].len == 0) {
                int k = snprintf(empty_names + o, 24, "[EMPTY_%d]", i);
                toks[i] = (bt_str){empty_names + o, (size_t)k};
                o += (size_t)k + 1;
            }
    }
    if ((rc = bt_tok_set_vocab(t, n, toks, types, NULL)) < 0) goto fail;
    if (!spm && (rc = gguf_tok_merges(t, g)) < 0) goto fail;
    if ((rc = gguf_tok_specials(t, g, n)) != 0) goto fail;
    if (spm) rc = bt_tok_spm_from_gguf(t, g);
    else rc = gguf_tok_added(t, toks, types, n);
    if (rc < 0) goto fail;
    free(toks);
    free(types);
    free(empty_names);
    *out = t;
    return 0;
fail:
    free(toks);
    free(types);
    free(empty_names);
    bt_tokenizer_free(t);
    return rc;
}
