/* Normalizers and pre-tokenizers of the byte-level BPE tokenizer (see tokenizer_internal.h).
 *
 * Normalizers: NFC, NFD, NFKC, NFKD (HF normalizers/unicode.rs) via utf8proc (utf8proc_map with
 * UTF8PROC_STABLE | COMPOSE / DECOMPOSE [| COMPAT], the same flags as utf8proc_NFC & co.).
 *
 * Pre-tokenizers (HF pre_tokenizers/{split,digits,byte_level}.rs, tokenizer/pattern.rs,
 * tokenizer/normalizer.rs NormalizedString::split): every step splits each piece of the previous
 * step into (offsets, is_match) events that cover it, combines them per SplitDelimiterBehavior
 * and passes the non-empty results on; the last step is ByteLevel, whose byte mapping is done by
 * the BPE tables (vocabulary held as raw bytes).
 *
 * Regexes: HF compiles Split and ByteLevel patterns with Oniguruma (onig crate, default syntax);
 * they run here on PCRE2 (UTF, UCP, MULTILINE, newline LF, JIT) after a translation that keeps
 * Oniguruma's meaning where PCRE2 differs (checked against tokenizers 0.20.3):
 *   \s  Oniguruma: \t\n\v\f\r, U+0085, \p{Z}; PCRE2 UCP \s lacks U+0085    -> spelled out
 *   \w  Oniguruma: \p{L}\p{M}\p{N}\p{Pc}; PCRE2 10.42 UCP: \p{L}\p{N}_     -> spelled out
 *   \b \B  defined on \w                                                     -> lookarounds
 *   \h \H  Oniguruma: hex digit (PCRE2: horizontal space)                    -> [0-9a-fA-F]
 *   \v  Oniguruma: U+000B (PCRE2: vertical space class)                      -> \x0B
 *   \uHHHH                                                                    -> \x{HHHH}
 *   {,n}  Oniguruma: {0,n} (PCRE2 10.42: literal)                             -> {0,n}
 *   ^ $  Oniguruma (Ruby): line anchors                                       -> PCRE2_MULTILINE
 *   .    not \n in both (PCRE2 newline set to LF)
 * Refused (BT_ERR_UNSUPPORTED): \S \W \H \b inside a class, nested classes, POSIX brackets,
 * class intersection &&, backreferences and \k \g \R \X \K \G \N \O \y \Y \Q, inline options
 * other than i, possessive intervals ({n,m}+ is a nested repeat in Oniguruma). */
#include "common/tokenizer_internal.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

/* HF pre_tokenizers/byte_level.rs (openai/gpt-2 src/encoder.py). */
const char BT_TOK_GPT2_PATTERN[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
/* Meta-Llama-3 tokenizer.json Split pattern (= tiktoken cl100k_base). */
const char BT_TOK_LLAMA3_PATTERN[] = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
                                     "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
/* Qwen2 tokenizer.json Split pattern: as Llama 3 with single \p{N}. */
const char BT_TOK_QWEN2_PATTERN[] = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
                                    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

#define WS_IN "\\t\\n\\x0B\\f\\r\\x{85}\\p{Z}"
#define W_IN "\\p{L}\\p{M}\\p{N}\\p{Pc}"


static int is_hex(char ch) {
    return (ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'f') || (ch >= 'A' && ch <= 'F');
}

static int unsup(const char *p, size_t n, size_t at, const char *what) {
    return bt_fail(BT_ERR_UNSUPPORTED,
                   "tokenizer: regex \"%.*s\": %s at offset %zu has no exact PCRE2 translation (supported: "
                   "literals, classes, \\s \\d \\w \\h \\p{..}, groups (?: (?= (?! (?<= (?<! (?> (?i, quantifiers, ^ $)",
                   (int)(n > 120 ? 120 : n), p, what, at);
}

/* Oniguruma pattern -> PCRE2 pattern (rules in the header comment). */
static int translate(const char *p, size_t n, bt_buf *o) {
    int in_class = 0, class_first = 0;
    size_t i = 0;
    while (i < n) {
        char ch = p[i];
        if (ch == '\\') {
            if (i + 1 >= n) return unsup(p, n, i, "trailing backslash");
            char e = p[i + 1];
            size_t at = i;
            i += 2;
            class_first = 0;
            switch (e) {
            case 's': bt_buf_str(o, in_class ? WS_IN : "[" WS_IN "]"); break;
            case 'w': bt_buf_str(o, in_class ? W_IN : "[" W_IN "]"); break;
            case 'h': bt_buf_str(o, in_class ? "0-9a-fA-F" : "[0-9a-fA-F]"); break;
            case 'S': case 'W': case 'H':
                if (in_class) return unsup(p, n, at, "negated class escape inside a character class");
                bt_buf_str(o, e == 'S' ? "[^" WS_IN "]" : e == 'W' ? "[^" W_IN "]" : "[^0-9a-fA-F]");
                break;
            case 'b': case 'B':
                if (in_class) return unsup(p, n, at, "\\b inside a character class");
                bt_buf_str(o, e == 'b' ? "(?:(?<=[" W_IN "])(?![" W_IN "])|(?<![" W_IN "])(?=[" W_IN "]))"
                                   : "(?:(?<=[" W_IN "])(?=[" W_IN "])|(?<![" W_IN "])(?![" W_IN "]))");
                break;
            case 'v': bt_buf_str(o, "\\x0B"); break;
            case 'u': {
                if (i + 4 > n || !is_hex(p[i]) || !is_hex(p[i + 1]) || !is_hex(p[i + 2]) || !is_hex(p[i + 3]))
                    return unsup(p, n, at, "\\u without 4 hex digits");
                bt_buf_str(o, "\\x{");
                bt_buf_put(o, p + i, 4);
                bt_buf_str(o, "}");
                i += 4;
                break;
            }
            case 'p': case 'P': {
                bt_buf_put(o, p + at, 2);
                if (i < n && p[i] == '{') {
                    const char *close = memchr(p + i, '}', n - i);
                    if (!close) return unsup(p, n, at, "unterminated \\p{");
                    bt_buf_put(o, p + i, (size_t)(close - (p + i)) + 1);
                    i = (size_t)(close - p) + 1;
                } else if (i < n) {
                    bt_buf_put(o, p + i, 1);
                    i++;
                }
                break;
            }
            case 'd': case 'D': case 'A': case 'z': case 'Z': case 't': case 'n': case 'r': case 'f':
            case 'e': case 'a': case 'x': case '0':
                bt_buf_put(o, p + at, 2);
                break;
            default:
                if ((e >= 'a' && e <= 'z') || (e >= 'A' && e <= 'Z') || (e >= '1' && e <= '9'))
                    return unsup(p, n, at, "escape");
                bt_buf_put(o, p + at, 1);
                { /* escaped literal: copy the whole (possibly multi-byte) char */
                    size_t j = at + 1;
                    if ((uint8_t)p[j] < 0x80) j++;
                    else { j++; while (j < n && ((uint8_t)p[j] & 0xC0) == 0x80) j++; }
                    bt_buf_put(o, p + at + 1, j - at - 1);
                    i = j;
                }
                break;
            }
            continue;
        }
        if (in_class) {
            if (ch == '[') return unsup(p, n, i, "nested class or POSIX bracket");
            if (ch == '&' && i + 1 < n && p[i + 1] == '&') return unsup(p, n, i, "class intersection &&");
            if (ch == ']' && !class_first) in_class = 0;
            class_first = 0;
            bt_buf_put(o, &ch, 1);
            i++;
            continue;
        }
        switch (ch) {
        case '[':
            in_class = 1;
            class_first = 1;
            bt_buf_put(o, "[", 1);
            i++;
            if (i < n && p[i] == '^') { bt_buf_put(o, "^", 1); i++; }
            continue;
        case '(':
            if (i + 1 < n && p[i + 1] == '?') {
                static const char *const ok[] = {"(?:", "(?=", "(?!", "(?<=", "(?<!", "(?>", "(?i:", "(?-i:", "(?i)",
                                                 "(?-i)"};
                size_t k;
                for (k = 0; k < sizeof ok / sizeof ok[0]; k++) {
                    size_t l = strlen(ok[k]);
                    if (i + l <= n && memcmp(p + i, ok[k], l) == 0) {
                        bt_buf_put(o, p + i, l);
                        i += l;
                        break;
                    }
                }
                if (k == sizeof ok / sizeof ok[0]) return unsup(p, n, i, "group kind or inline option");
                continue;
            }
            break;
        case '{': {
            /* interval {n}, {n,}, {n,m}, {,m}; anything else is a literal brace in both engines */
            size_t j = i + 1;
            while (j < n && p[j] >= '0' && p[j] <= '9') j++;
            int lo_digits = j > i + 1, comma = 0, hi_digits = 0;
            if (j < n && p[j] == ',') {
                comma = 1;
                size_t k = j + 1;
                while (k < n && p[k] >= '0' && p[k] <= '9') k++;
                hi_digits = k > j + 1;
                j = k;
            }
            if (j < n && p[j] == '}' && (lo_digits || (comma && hi_digits))) {
                if (j + 1 < n && p[j + 1] == '+') return unsup(p, n, i, "interval followed by '+'");
                if (!lo_digits) bt_buf_put(o, "{0", 2);
                else bt_buf_put(o, "{", 1);
                bt_buf_put(o, p + i + 1, j - i);
                i = j + 1;
                continue;
            }
            bt_buf_put(o, "\\{", 2);
            i++;
            continue;
        }
        case '}':
            bt_buf_put(o, "\\}", 2);
            i++;
            continue;
        default:
            break;
        }
        bt_buf_put(o, &ch, 1);
        i++;
    }
    if (in_class) return unsup(p, n, n, "unterminated character class");
    return 0;
}

static int compile_pcre(pcre2_code **out, const char *pat, size_t len, const char *src, size_t src_len) {
    pcre2_compile_context *cc = pcre2_compile_context_create(NULL);
    if (!cc) return bt_fail(BT_ERR_NOMEM, "tokenizer: pcre2 context allocation failed");
    pcre2_set_newline(cc, PCRE2_NEWLINE_LF);
    int err;
    PCRE2_SIZE eoff;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pat, len, PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE, &err, &eoff, cc);
    pcre2_compile_context_free(cc);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        return bt_fail(BT_ERR_UNSUPPORTED, "tokenizer: regex \"%.*s\" does not compile (PCRE2 offset %zu: %s)",
                       (int)(src_len > 120 ? 120 : src_len), src, (size_t)eoff, (char *)msg);
    }
    /* JIT is an optimisation: pcre2_match falls back to the interpreter if it is unavailable. */
    (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
    *out = re;
    return 0;
}

int bt_tok_compile_onig(pcre2_code **out, const char *pat, size_t len, int literal) {
    *out = NULL;
    bt_buf o = {0};
    bt_buf_put(&o, "", 0);
    if (literal) { /* HF Split String pattern: regex::escape(s) */
        for (size_t i = 0; i < len; i++) {
            uint8_t ch = (uint8_t)pat[i];
            if (ch < 0x20 || ch == 0x7F) {
                char x[8];
                snprintf(x, sizeof x, "\\x{%x}", ch);
                bt_buf_str(&o, x);
            } else if (ch < 0x80 && !((ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z'))) {
                char x[2] = {'\\', (char)ch};
                bt_buf_put(&o, x, 2);
            } else {
                bt_buf_put(&o, pat + i, 1);
            }
        }
    } else {
        if (memchr(pat, 0, len)) {
            free(o.p);
            return unsup(pat, len, (size_t)((const char *)memchr(pat, 0, len) - pat), "NUL byte");
        }
        int rc = translate(pat, len, &o);
        if (rc < 0) {
            free(o.p);
            return rc;
        }
    }
    if (o.oom) {
        free(o.p);
        return bt_fail(BT_ERR_NOMEM, "tokenizer: out of memory translating a pattern of %zu bytes", len);
    }
    int rc = compile_pcre(out, o.p, o.n, pat, len);
    free(o.p);
    return rc;
}

int bt_tok_step_regex(bt_pre_step *s, const char *pat, size_t len, int literal) {
    int rc = bt_tok_compile_onig(&s->re, pat, len, literal);
    if (rc < 0) return rc;
    s->src = bt_xmalloc(len + 1);
    memcpy(s->src, pat, len);
    s->src[len] = 0;
    s->src_len = len;
    s->literal = literal;
    return 0;
}

int bt_tok_init_word_re(bt_tokenizer *t) {
    /* Rust regex crate \w (HF added_vocabulary.rs STARTS_WITH_WORD / ENDS_WITH_WORD): Alphabetic,
     * M, Nd, Pc, Join_Control. */
    static const char w[] = "[\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\x{200C}\\x{200D}]";
    return compile_pcre(&t->re_word, w, sizeof w - 1, w, sizeof w - 1);
}

void bt_tok_pre_free(bt_tokenizer *t) {
    for (int i = 0; i < t->n_pre; i++) {
        pcre2_code_free(t->pre_steps[i].re);
        t->pre_steps[i].re = NULL;
        free(t->pre_steps[i].src);
        t->pre_steps[i].src = NULL;
    }
    t->n_pre = 0;
}

/* ---- normalizers ---- */

int bt_tok_normalize(const bt_tokenizer *t, const char *s, size_t n, char **out, size_t *out_len) {
    *out = NULL;
    *out_len = 0;
    const char *cur = s;
    size_t cn = n;
    uint8_t *owned = NULL;
    for (int k = 0; k < t->n_norm; k++) {
        int kind = t->norm[k];
        if (kind == NORM_PREPEND || kind == NORM_REPLACE) {
            /* HF normalizers/prepend.rs (non-empty input only) and replace.rs (String pattern:
             * every non-overlapping occurrence, left to right) */
            const char *a = t->norm_a[k], *b = t->norm_b[k];
            size_t al = t->norm_al[k], bl = t->norm_bl[k];
            if (cn == 0) continue;
            size_t cnt = 0;
            if (kind == NORM_REPLACE) {
                for (size_t i = 0; i + al <= cn;)
                    if (memcmp(cur + i, a, al) == 0) { cnt++; i += al; } else i++;
                if (!cnt) continue;
            }
            size_t nl = kind == NORM_PREPEND ? cn + al : cn - cnt * al + cnt * bl;
            uint8_t *d = malloc(nl + 1);
            if (!d) { free(owned); return bt_fail(BT_ERR_NOMEM, "tokenizer: normalizer: out of memory"); }
            size_t o = 0;
            if (kind == NORM_PREPEND) {
                memcpy(d, a, al);
                memcpy(d + al, cur, cn);
            } else {
                for (size_t i = 0; i < cn;) {
                    if (i + al <= cn && memcmp(cur + i, a, al) == 0) { memcpy(d + o, b, bl); o += bl; i += al; }
                    else d[o++] = (uint8_t)cur[i++];
                }
            }
            d[nl] = 0;
            free(owned);
            owned = d;
            cur = (const char *)d;
            cn = nl;
            continue;
        }
        /* fast paths: ASCII is invariant under every form; text of code points below U+0300
         * (lead bytes < 0xCC) is NFC (no combining marks, no singletons below U+0340) */
        uint8_t maxb = 0;
        for (size_t i = 0; i < cn; i++)
            if ((uint8_t)cur[i] > maxb) maxb = (uint8_t)cur[i];
        if (maxb < 0x80 || (kind == NORM_NFC && maxb < 0xCC)) continue;
        utf8proc_option_t opt = UTF8PROC_STABLE;
        if (kind == NORM_NFC) opt |= UTF8PROC_COMPOSE;
        else if (kind == NORM_NFD) opt |= UTF8PROC_DECOMPOSE;
        else if (kind == NORM_NFKC) opt |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
        else opt |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
        utf8proc_uint8_t *dst = NULL;
        utf8proc_ssize_t r = utf8proc_map((const utf8proc_uint8_t *)cur, (utf8proc_ssize_t)cn, &dst, opt);
        if (r < 0) {
            free(owned);
            return bt_fail(r == UTF8PROC_ERROR_NOMEM ? BT_ERR_NOMEM : BT_ERR_FORMAT, "tokenizer: normalizer: %s",
                           utf8proc_errmsg(r));
        }
        free(owned);
        owned = dst;
        cur = (const char *)dst;
        cn = (size_t)r;
    }
    if (owned) {
        *out = (char *)owned;
        *out_len = cn;
    }
    return 0;
}

/* ---- pre-tokenizers ---- */

typedef struct {
    size_t a, b;
    int has, prev_match, pend_match;
} comb_t;

static int emit(bt_enc_ctx *c, int step, const char *s, size_t a, size_t b) {
    return b > a ? bt_tok_pre_run(c, step + 1, s + a, b - a) : 0;
}

/* Feeds one (offsets, is_match) event through the behaviour (HF NormalizedString::split). */
static int comb_push(bt_enc_ctx *c, int step, int beh, comb_t *st, const char *s, size_t a, size_t b, int m) {
    int rc = 0;
    switch (beh) {
    case BEH_ISOLATED: return emit(c, step, s, a, b);
    case BEH_REMOVED: return m ? 0 : emit(c, step, s, a, b);
    case BEH_CONTIGUOUS:
        if (st->has && m == st->prev_match) {
            st->b = b;
        } else {
            if (st->has) rc = emit(c, step, s, st->a, st->b);
            st->a = a; st->b = b; st->has = 1;
        }
        st->prev_match = m;
        return rc;
    case BEH_MERGED_PREV:
        if (m && !st->prev_match && st->has) {
            st->b = b;
        } else {
            if (st->has) rc = emit(c, step, s, st->a, st->b);
            st->a = a; st->b = b; st->has = 1;
        }
        st->prev_match = m;
        return rc;
    default: /* BEH_MERGED_NEXT */
        if (st->has && st->pend_match && !m) {
            st->has = 0;
            return emit(c, step, s, st->a, b);
        }
        if (st->has) rc = emit(c, step, s, st->a, st->b);
        st->a = a; st->b = b; st->has = 1; st->pend_match = m;
        return rc;
    }
}

static int comb_flush(bt_enc_ctx *c, int step, comb_t *st, const char *s) {
    if (!st->has) return 0;
    st->has = 0;
    return emit(c, step, s, st->a, st->b);
}

/* HF pattern.rs find_matches for a SysRegex (onig FindMatches: an empty match right at the end
 * of the previous match is skipped by advancing one char), then the behaviour. */
static int split_regex(bt_enc_ctx *c, int step, const pcre2_code *re, int beh, int invert, const char *s, size_t n) {
    comb_t st = {0};
    pcre2_match_data *md = bt_tok_md(c);
    if (!md) return BT_ERR_NOMEM;
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
    size_t last_end = 0, prev = 0;
    size_t last_match_end = (size_t)-1;
    int rc = 0;
    while (last_end <= n) {
        int r = pcre2_match(re, (PCRE2_SPTR)s, n, last_end, PCRE2_NO_UTF_CHECK, md, NULL);
        if (r == PCRE2_ERROR_NOMATCH) break;
        if (r < 0) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(r, msg, sizeof msg);
            return bt_fail(BT_ERR_RANGE, "tokenizer: regex match failed at byte %zu: %s", last_end, (char *)msg);
        }
        size_t ms = ov[0], me = ov[1];
        if (me == ms && last_match_end == me) {
            if (last_end >= n) break;
            size_t j = last_end;
            if (bt_tok_utf8_next((const uint8_t *)s, n, &j) < 0) j = last_end + 1;
            last_end = j;
            continue;
        }
        last_end = me;
        last_match_end = me;
        if (prev != ms && (rc = comb_push(c, step, beh, &st, s, prev, ms, invert)) < 0) return rc;
        if ((rc = comb_push(c, step, beh, &st, s, ms, me, !invert)) < 0) return rc;
        prev = me;
        if (me == n && ms == me) break; /* the next search would start past the end */
    }
    if (prev != n && (rc = comb_push(c, step, beh, &st, s, prev, n, invert)) < 0) return rc;
    return comb_flush(c, step, &st, s);
}

/* Rust char::is_numeric: general category Nd, Nl or No. */
static int is_numeric(int32_t cp) {
    if (cp < 0x80) return cp >= '0' && cp <= '9';
    utf8proc_category_t k = utf8proc_category(cp);
    return k == UTF8PROC_CATEGORY_ND || k == UTF8PROC_CATEGORY_NL || k == UTF8PROC_CATEGORY_NO;
}

/* HF Digits: split on char::is_numeric, Isolated (individual_digits) or Contiguous. */
static int split_digits(bt_enc_ctx *c, int step, int beh, const char *s, size_t n) {
    comb_t st = {0};
    size_t last_offset = 0, i = 0;
    int rc;
    while (i < n) {
        size_t b = i;
        uint8_t ch = (uint8_t)s[i];
        int num;
        if (ch < 0x80) {
            num = ch >= '0' && ch <= '9';
            i++;
        } else {
            int32_t cp = bt_tok_utf8_next((const uint8_t *)s, n, &i);
            if (cp < 0) i = b + 1;
            num = cp >= 0 && is_numeric(cp);
        }
        if (!num) continue;
        if (last_offset < b && (rc = comb_push(c, step, beh, &st, s, last_offset, b, 0)) < 0) return rc;
        if ((rc = comb_push(c, step, beh, &st, s, b, i, 1)) < 0) return rc;
        last_offset = i;
    }
    if (n > last_offset && (rc = comb_push(c, step, beh, &st, s, last_offset, n, 0)) < 0) return rc;
    return comb_flush(c, step, &st, s);
}

/* HF pre_tokenizers/metaspace.rs: every " " becomes the replacement; it is prepended (scheme
 * always, or first when this run starts the input) unless the run already starts with it; with
 * split, the run is cut before each replacement char (SplitDelimiterBehavior::MergedWithNext). */
static int metaspace(bt_enc_ctx *c, int step, const bt_pre_step *p, const char *s, size_t n) {
    const char *rep = p->ms_rep;
    size_t rl = p->ms_rep_len, sp = 0;
    for (size_t i = 0; i < n; i++) sp += s[i] == ' ';
    int starts = n > 0 && (s[0] == ' ' || (n >= rl && memcmp(s, rep, rl) == 0));
    int pre = (p->ms_prepend == MS_ALWAYS || (p->ms_prepend == MS_FIRST && c->at0)) && !starts;
    size_t need = n + sp * (rl - 1) + (pre ? rl : 0);
    if (c->pcap[step] < need + 1) { /* the split's size: fallible */
        char *nb = bt_vec_grow(c->pbuf[step], &c->pcap[step], need + 1, 1);
        if (!nb) return c->err = BT_ERR_NOMEM;
        c->pbuf[step] = nb;
    }
    char *d = c->pbuf[step];
    size_t o = 0;
    if (pre) { memcpy(d, rep, rl); o = rl; }
    for (size_t i = 0; i < n; i++) {
        if (s[i] == ' ') { memcpy(d + o, rep, rl); o += rl; }
        else d[o++] = s[i];
    }
    if (!p->ms_split) return bt_tok_pre_run(c, step + 1, d, o);
    size_t a = 0;
    for (size_t i = 1; i + rl <= o; i++) {
        if (memcmp(d + i, rep, rl) != 0) continue;
        int rc = bt_tok_pre_run(c, step + 1, d + a, i - a);
        if (rc < 0) return rc;
        a = i;
        i += rl - 1;
    }
    return bt_tok_pre_run(c, step + 1, d + a, o - a);
}

int bt_tok_pre_run(bt_enc_ctx *c, int step, const char *s, size_t n) {
    const bt_tokenizer *t = c->t;
    if (n == 0) return 0;
    if (step >= t->n_pre) {
        bt_tok_bpe_word(c, (const uint8_t *)s, n);
        return c->err;
    }
    const bt_pre_step *p = &t->pre_steps[step];
    switch (p->kind) {
    case PRE_METASPACE: return metaspace(c, step, p, s, n);
    case PRE_BYTELEVEL:
        if (p->add_prefix_space && s[0] != ' ') { /* HF normalized.prepend(" ") on every split */
            if (c->pcap[step] < n + 1) { /* the split's size: fallible */
                char *nb = bt_vec_grow(c->pbuf[step], &c->pcap[step], n + 1, 1);
                if (!nb) return c->err = BT_ERR_NOMEM;
                c->pbuf[step] = nb;
            }
            c->pbuf[step][0] = ' ';
            memcpy(c->pbuf[step] + 1, s, n);
            s = c->pbuf[step];
            n++;
        }
        if (!p->re) return bt_tok_pre_run(c, step + 1, s, n);
        return split_regex(c, step, p->re, BEH_ISOLATED, 0, s, n);
    case PRE_SPLIT:
        return split_regex(c, step, p->re, p->behavior, p->invert, s, n);
    default:
        return split_digits(c, step, p->behavior, s, n);
    }
}

/* ---- dedicated pre-tokenizers ----
 *
 * The standard pipelines run without a regex engine (no JIT, so they keep their speed where
 * W^X forbids it: systemd MemoryDenyWriteExecute, prctl PR_SET_MDWE). Each scanner is the
 * leftmost-first alternation of its pattern written out by hand, so it yields exactly the pieces
 * of the PCRE2 path above (checked on the parity corpora and on an adversarial Unicode corpus
 * against that path: tests/unit/common/test_tokenizer_pre.c):
 *   GPT-2     's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 *   SmolLM2   Digits(individual_digits): every numeric char (Rust char::is_numeric) is a piece,
 *             then the GPT-2 pattern inside each run between them
 *   Llama 3   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}
 *             | ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+          (tiktoken cl100k_base)
 *   Qwen2     the same with \p{N} instead of \p{N}{1,3}
 * Every alternative consumes at least one char and some alternative matches at every position,
 * so the pieces tile the input (HF Split Isolated). \s is Oniguruma's (see the translation
 * rules at the top). Character classes come from a table built once per process by running
 * PCRE2 itself over every code point, so both paths agree whatever Unicode version PCRE2 has;
 * "numeric" for Digits comes from utf8proc like split_digits. Caseless contractions: PCRE2 UCP
 * caseless matching pairs s/S with U+017F LONG S and no other code point with t r e v m l d. */

enum { CL_L = 1, CL_N = 2, CL_S = 4, CL_D = 8 };

#define CT_SHIFT 7
#define CT_BLOCK (1u << CT_SHIFT)
#define CT_CPS 0x110000u

static uint16_t *ct_stage1; /* [CT_CPS >> CT_SHIFT] block of each code point range */
static uint8_t *ct_stage2;  /* [n_blocks * CT_BLOCK] class bits */
static uint8_t ct_ascii[128];
static int ct_err;
static char ct_msg[256];
static pthread_once_t ct_once = PTHREAD_ONCE_INIT;

/* UTF-8 encoding of cp into d (no surrogates given); returns the byte count. */
static size_t put_utf8(uint8_t *d, uint32_t cp) {
    if (cp < 0x80) { d[0] = (uint8_t)cp; return 1; }
    if (cp < 0x800) { d[0] = (uint8_t)(0xC0 | cp >> 6); d[1] = (uint8_t)(0x80 | (cp & 0x3F)); return 2; }
    if (cp < 0x10000) {
        d[0] = (uint8_t)(0xE0 | cp >> 12); d[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F)); d[2] = (uint8_t)(0x80 | (cp & 0x3F));
        return 3;
    }
    d[0] = (uint8_t)(0xF0 | cp >> 18); d[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3F));
    d[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F)); d[3] = (uint8_t)(0x80 | (cp & 0x3F));
    return 4;
}

/* Class bits of every code point: L/N/S from PCRE2 (one pass of a partitioning regex over a text
 * holding every scalar value in order), D from utf8proc (is_numeric). */
static int ct_fill(uint8_t *flat) {
    static const char pat[] = "(\\p{L}+)|(\\p{N}+)|([" WS_IN "]+)|[^\\p{L}\\p{N}" WS_IN "]+";
    size_t cap = (size_t)CT_CPS * 4, len = 0;
    uint8_t *text = malloc(cap);
    uint32_t *cps = malloc((size_t)CT_CPS * sizeof *cps); /* code point of each char, in order */
    if (!text || !cps) {
        free(text);
        free(cps);
        return bt_fail(BT_ERR_NOMEM, "tokenizer: out of memory building the character table");
    }
    size_t nc = 0;
    for (uint32_t cp = 0; cp < CT_CPS; cp++) {
        if (cp >= 0xD800 && cp <= 0xDFFF) continue;
        len += put_utf8(text + len, cp);
        cps[nc++] = cp;
    }
    pcre2_code *re = NULL;
    int rc = compile_pcre(&re, pat, sizeof pat - 1, pat, sizeof pat - 1);
    pcre2_match_data *md = rc == 0 ? pcre2_match_data_create_from_pattern(re, NULL) : NULL;
    if (rc == 0 && !md) rc = bt_fail(BT_ERR_NOMEM, "tokenizer: pcre2 match data allocation failed");
    size_t off = 0, ci = 0;
    while (rc == 0 && off < len) {
        int r = pcre2_match(re, text, len, off, PCRE2_NO_UTF_CHECK, md, NULL);
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        if (r < 0 || ov[0] != off || ov[1] <= off) {
            rc = bt_fail(BT_ERR_FORMAT, "tokenizer: character table: PCRE2 did not partition the code points at %zu", off);
            break;
        }
        uint8_t cls = r >= 2 && ov[2] != PCRE2_UNSET ? CL_L : r >= 3 && ov[4] != PCRE2_UNSET ? CL_N
                    : r >= 4 && ov[6] != PCRE2_UNSET ? CL_S : 0;
        for (size_t b = off; b < ov[1]; ci++) {
            flat[cps[ci]] = cls;
            uint8_t lead = text[b];
            b += lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
        }
        off = ov[1];
    }
    pcre2_match_data_free(md);
    pcre2_code_free(re);
    free(text);
    free(cps);
    if (rc == 0)
        for (uint32_t cp = 0; cp < CT_CPS; cp++)
            if (is_numeric((int32_t)cp)) flat[cp] |= CL_D;
    return rc;
}

/* Two-stage table: identical 128-entry blocks stored once. */
static void ct_build(void) {
    uint8_t *flat = calloc(CT_CPS, 1);
    if (!flat) {
        ct_err = BT_ERR_NOMEM;
        snprintf(ct_msg, sizeof ct_msg, "out of memory");
        return;
    }
    if ((ct_err = ct_fill(flat)) < 0) {
        snprintf(ct_msg, sizeof ct_msg, "%s", bt_last_error());
        free(flat);
        return;
    }
    const size_t nb = CT_CPS >> CT_SHIFT;
    uint16_t *s1 = malloc(nb * sizeof *s1);
    uint8_t *s2 = malloc(nb * CT_BLOCK);
    size_t hcap = 4096, uniq = 0;
    int32_t *hslot = malloc(hcap * sizeof *hslot);
    if (!s1 || !s2 || !hslot) {
        free(s1), free(s2), free(hslot), free(flat);
        ct_err = BT_ERR_NOMEM;
        snprintf(ct_msg, sizeof ct_msg, "out of memory");
        return;
    }
    memset(hslot, 0xFF, hcap * sizeof *hslot);
    for (size_t b = 0; b < nb; b++) {
        const uint8_t *blk = flat + b * CT_BLOCK;
        uint64_t h = bt_fnv1a64(BT_FNV64_INIT, blk, CT_BLOCK);
        size_t k = (size_t)h & (hcap - 1);
        while (hslot[k] >= 0 && memcmp(s2 + (size_t)hslot[k] * CT_BLOCK, blk, CT_BLOCK) != 0) k = (k + 1) & (hcap - 1);
        if (hslot[k] < 0) { /* at most nb (8704) < hcap / 2 unique blocks are never reached in practice */
            memcpy(s2 + uniq * CT_BLOCK, blk, CT_BLOCK);
            hslot[k] = (int32_t)uniq++;
        }
        s1[b] = (uint16_t)hslot[k];
    }
    for (int i = 0; i < 128; i++) ct_ascii[i] = flat[i];
    free(hslot);
    free(flat);
    ct_stage2 = bt_xrealloc(s2, uniq * CT_BLOCK);
    ct_stage1 = s1;
}

/* Class bits of the (valid UTF-8) char at s[i]; its byte length in *len. */
static inline uint8_t ct_at(const uint8_t *s, size_t i, size_t *len) {
    uint8_t c = s[i];
    uint32_t cp;
    if (c < 0x80) { *len = 1; return ct_ascii[c]; }
    if (c < 0xE0) { cp = (uint32_t)(c & 0x1F) << 6 | (s[i + 1] & 0x3Fu); *len = 2; }
    else if (c < 0xF0) { cp = (uint32_t)(c & 0x0F) << 12 | (uint32_t)(s[i + 1] & 0x3F) << 6 | (s[i + 2] & 0x3Fu); *len = 3; }
    else {
        cp = (uint32_t)(c & 0x07) << 18 | (uint32_t)(s[i + 1] & 0x3F) << 12 | (uint32_t)(s[i + 2] & 0x3F) << 6 |
             (s[i + 3] & 0x3Fu);
        *len = 4;
    }
    return ct_stage2[(size_t)ct_stage1[cp >> CT_SHIFT] * CT_BLOCK + (cp & (CT_BLOCK - 1))];
}

#define OTHER(k) (!((k) & (CL_L | CL_N | CL_S)))

/* End of the run of chars from i (< end) whose class has a bit of `want` (other = 1: chars that
 * are none of L N S instead). */
static inline size_t run_of(const uint8_t *s, size_t i, size_t end, uint8_t want, int other) {
    while (i < end) {
        size_t l;
        uint8_t k = ct_at(s, i, &l);
        if (other ? !OTHER(k) : !(k & want)) break;
        i += l;
    }
    return i;
}

/* Whitespace alternatives from i (s[i] is \s): `\s+(?!\S)|\s+`, or with crlf first
 * `\s*[\r\n]+` (Llama 3 / Qwen2). */
static inline size_t ws_piece(const uint8_t *s, size_t i, size_t end, int crlf) {
    size_t j = i, last = i, nl = SIZE_MAX;
    while (j < end) {
        size_t l;
        if (!(ct_at(s, j, &l) & CL_S)) break;
        if (s[j] == '\r' || s[j] == '\n') nl = j;
        last = j;
        j += l;
    }
    if (crlf && nl != SIZE_MAX) return nl + 1; /* \s* backs off to the last \r or \n of the run */
    if (j == end || last == i) return j;       /* (?!\S) holds at the end; else one char: \s+ */
    return last;                               /* all but the last char: it precedes a \s */
}

/* One GPT-2 pattern piece starting at i < end. */
static size_t gpt2_piece(const uint8_t *s, size_t i, size_t end) {
    if (s[i] == '\'' && i + 1 < end) {
        uint8_t a = s[i + 1], b = i + 2 < end ? s[i + 2] : 0;
        if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 2;
        if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return i + 3;
    }
    size_t l;
    uint8_t k = ct_at(s, i, &l);
    if (s[i] == ' ' && i + 1 < end) { /* ` ?X+`: the space joins a following L, N or other run */
        size_t l2;
        uint8_t k2 = ct_at(s, i + 1, &l2);
        if (k2 & CL_L) return run_of(s, i + 1 + l2, end, CL_L, 0);
        if (k2 & CL_N) return run_of(s, i + 1 + l2, end, CL_N, 0);
        if (OTHER(k2)) return run_of(s, i + 1 + l2, end, 0, 1);
    }
    if (k & CL_L) return run_of(s, i + l, end, CL_L, 0);
    if (k & CL_N) return run_of(s, i + l, end, CL_N, 0);
    if (OTHER(k)) return run_of(s, i + l, end, 0, 1);
    return ws_piece(s, i, end, 0);
}

/* Caseless letter of a contraction at s[i] (PCRE2 UCP caseless): lower-case ASCII letter, 'S'
 * for U+017F LONG S (folds to s), else 0; its byte length in *len. */
static inline uint8_t fold_at(const uint8_t *s, size_t i, size_t end, size_t *len) {
    uint8_t c = s[i];
    *len = 1;
    if (c >= 'A' && c <= 'Z') return (uint8_t)(c | 0x20);
    if (c >= 'a' && c <= 'z') return c;
    if (c == 0xC5 && i + 1 < end && s[i + 1] == 0xBF) { *len = 2; return 's'; }
    return 0;
}

/* One Llama 3 (max_digits 3) or Qwen2 (max_digits 1) pattern piece starting at i < end. */
static size_t l3_piece(const uint8_t *s, size_t i, size_t end, int max_digits) {
    if (s[i] == '\'' && i + 1 < end) {
        size_t la, lb = 0;
        uint8_t a = fold_at(s, i + 1, end, &la), b = i + 1 + la < end ? fold_at(s, i + 1 + la, end, &lb) : 0;
        if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 1 + la;
        if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return i + 1 + la + lb;
    }
    size_t l;
    uint8_t k = ct_at(s, i, &l);
    if (k & CL_L) return run_of(s, i + l, end, CL_L, 0);
    if (!(k & CL_N) && s[i] != '\r' && s[i] != '\n' && i + l < end) { /* [^\r\n\p{L}\p{N}]?\p{L}+ */
        size_t l2;
        if (ct_at(s, i + l, &l2) & CL_L) return run_of(s, i + l + l2, end, CL_L, 0);
    }
    if (k & CL_N) {
        size_t j = i + l;
        for (int d = 1; d < max_digits && j < end; d++) {
            size_t l2;
            if (!(ct_at(s, j, &l2) & CL_N)) break;
            j += l2;
        }
        return j;
    }
    size_t j = SIZE_MAX; /* ` ?[^\s\p{L}\p{N}]+[\r\n]*` */
    if (s[i] == ' ' && i + 1 < end) {
        size_t l2;
        if (OTHER(ct_at(s, i + 1, &l2))) j = run_of(s, i + 1 + l2, end, 0, 1);
    }
    if (j == SIZE_MAX && OTHER(k)) j = run_of(s, i + l, end, 0, 1);
    if (j != SIZE_MAX) {
        while (j < end && (s[j] == '\r' || s[j] == '\n')) j++;
        return j;
    }
    return ws_piece(s, i, end, 1);
}

static void gpt2_run(bt_enc_ctx *c, const uint8_t *s, size_t a, size_t b) {
    while (a < b && !c->err) {
        size_t e = gpt2_piece(s, a, b);
        bt_tok_bpe_word(c, s + a, e - a);
        a = e;
    }
}

int bt_tok_pre_all(bt_enc_ctx *c, const char *text, size_t n) {
    const bt_tokenizer *t = c->t;
    if (n == 0) return 0;
    if (!t->fast_pre) return bt_tok_pre_run(c, 0, text, n);
    const uint8_t *s = (const uint8_t *)text;
    size_t i = 0;
    switch (t->fast_pre) {
    case FAST_GPT2: gpt2_run(c, s, 0, n); break;
    case FAST_DIGITS_GPT2: {
        size_t a = 0;
        while (i < n) {
            size_t l;
            if (ct_at(s, i, &l) & CL_D) {
                gpt2_run(c, s, a, i);
                bt_tok_bpe_word(c, s + i, l);
                a = i + l;
            }
            i += l;
        }
        gpt2_run(c, s, a, n);
        break;
    }
    default: {
        int max_digits = t->fast_pre == FAST_LLAMA3 ? 3 : 1;
        while (i < n && !c->err) {
            size_t e = l3_piece(s, i, n, max_digits);
            bt_tok_bpe_word(c, s + i, e - i);
            i = e;
        }
        break;
    }
    }
    return c->err; /* 0, or BT_ERR_NOMEM: a piece or the ids did not fit in memory */
}

void bt_tok_pre_select(bt_tokenizer *t) {
    const bt_pre_step *p = t->pre_steps;
    int f = FAST_NONE;
    if (t->n_pre == 1 && p[0].kind == PRE_BYTELEVEL && p[0].pat == PAT_GPT2 && !p[0].add_prefix_space)
        f = FAST_GPT2;
    else if (t->n_pre == 2 && p[0].kind == PRE_DIGITS && p[0].behavior == BEH_ISOLATED && p[1].kind == PRE_BYTELEVEL &&
             p[1].pat == PAT_GPT2 && !p[1].add_prefix_space)
        f = FAST_DIGITS_GPT2;
    else if (t->n_pre == 2 && p[0].kind == PRE_SPLIT && p[0].behavior == BEH_ISOLATED && !p[0].invert &&
             p[1].kind == PRE_BYTELEVEL && !p[1].re && !p[1].add_prefix_space)
        f = p[0].pat == PAT_LLAMA3 ? FAST_LLAMA3 : p[0].pat == PAT_QWEN2 ? FAST_QWEN2 : p[0].pat == PAT_GPT2 ? FAST_GPT2 : 0;
    if (f != FAST_NONE) {
        pthread_once(&ct_once, ct_build);
        if (ct_err < 0) {
            bt_log(BT_LOG_WARN, "tokenizer", "dedicated pre-tokenizer unavailable (%s): using PCRE2", ct_msg);
            f = FAST_NONE;
        }
    }
    t->fast_avail = t->fast_pre = f;
}
