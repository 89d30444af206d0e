/* libFuzzer target: the chat template renderers (loaderd/format.h chat format: ChatML through
 * common/chat.h bt_chat_encode with SmolLM2's vocabulary from $BT_MODEL; Llama-3 with the
 * Llama-3 tokenizer fixture tests/fixtures/tokenizer/llama3-tokenizer.json.zst; the SentencePiece
 * families' llama2, mistral and mistral-v3 (common/chat_spm.c) with Mistral v0.3's tokenizer.json
 * fixture, where [INST] / [/INST] are control tokens and nothing gets a space prefix after a
 * special token) on arbitrary conversations, checked against the templates' definitions
 * (format.h, chat.h).
 * Input: byte 0 % 5 picks the template (ChatML, Llama-3, llama2, mistral, mistral-v3); the rest
 * is split into messages at 0x1E and each message into role and content at its first 0x1F; a
 * 1-byte role b becomes one of "system", "user", "assistant", "tool" (b % 4), longer roles are
 * kept. Roles and contents are made valid UTF-8 (invalid bytes -> '?'; roles also lose NULs: the
 * format refuses them) and rendered as a {"messages": [...]} line through ld_format_line (no
 * BOS, no truncation).
 * Invariants: the line is either refused for a documented reason (empty: no assistant message
 * with content; field: for the SentencePiece templates, roles out of the template's order — an
 * optional first system message, then user/assistant alternating from user — or a role it does
 * not know) or rendered; the rendered ids decode (special tokens kept) to exactly the template's
 * text (less the bytes the vocabulary has no character for, which byte-level BPE drops as HF
 * does) — ChatML: [SmolLM2's default system message when the first role is not "system"] then
 * per message "<|im_start|>" role "\n" content "<|im_end|>" "\n"; Llama-3: "<|begin_of_text|>"
 * then per message "<|start_header_id|>" role "<|end_header_id|>\n\n" trim(content)
 * "<|eot_id|>"; llama2 / mistral / mistral-v3 as common/chat.h and the models' templates
 * (tests/reference/gen_chat_template_fixtures.py) render them, trim being Python's str.strip()
 * (Unicode whitespace, written out independently here) — and a token carries loss iff it covers
 * at least one byte of an assistant message's (trimmed) content or that message's end-of-turn
 * token. */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <zstd.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_common.h"
#include "loaderd/format.h"

#define LLAMA3_TOKENIZER "tests/fixtures/tokenizer/llama3-tokenizer.json.zst"
#define MISTRAL_TOKENIZER "tests/fixtures/tokenizer/mistral-v0.3-tokenizer.json.zst"
#define DEFAULT_SYSTEM "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

static const bt_tokenizer *llama3_tokenizer(void) {
    static bt_tokenizer *tok;
    if (!tok && bt_tokenizer_load(&tok, LLAMA3_TOKENIZER)) {
        fprintf(stderr, "fuzz: cannot load %s (run from the repository root): %s\n", LLAMA3_TOKENIZER,
                bt_last_error());
        exit(2);
    }
    return tok;
}

/* A zstd file read whole and decompressed (streaming: zstd(1) reading a pipe records no size);
 * NULL on failure. */
static char *read_zst(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 1 << 20, got = 0, r;
    char *z = malloc(cap);
    while (z && (r = fread(z + got, 1, cap - got, f)) > 0)
        if ((got += r) == cap) z = realloc(z, cap *= 2);
    fclose(f);
    ZSTD_DStream *ds = ZSTD_createDStream();
    size_t ocap = 8 << 20;
    char *out = malloc(ocap);
    ZSTD_inBuffer in = {z, got, 0};
    ZSTD_outBuffer ob = {out, ocap, 0};
    size_t rc = 1;
    while (z && out && ds && in.pos < in.size) {
        if (ob.pos == ob.size) {
            out = realloc(out, ocap *= 2);
            ob.dst = out;
            ob.size = ocap;
            if (!out) break;
        }
        rc = ZSTD_decompressStream(ds, &ob, &in);
        if (ZSTD_isError(rc)) break;
    }
    ZSTD_freeDStream(ds);
    free(z);
    if (!out || rc != 0) {
        free(out);
        return NULL;
    }
    *n = ob.pos;
    return out;
}

/* Mistral v0.3's tokenizer.json with the special tokens of its tokenizer_config.json. */
static const bt_tokenizer *mistral_tokenizer(void) {
    static bt_tokenizer *tok;
    static const char cfg[] = "{\"bos_token\": \"<s>\", \"eos_token\": \"</s>\", \"unk_token\": \"<unk>\"}";
    if (!tok) {
        size_t n = 0;
        char *js = read_zst(MISTRAL_TOKENIZER, &n);
        if (!js || bt_tokenizer_from_json(&tok, js, n, cfg, sizeof cfg - 1)) {
            fprintf(stderr, "fuzz: cannot load %s (run from the repository root): %s\n", MISTRAL_TOKENIZER,
                    bt_last_error());
            exit(2);
        }
        free(js);
    }
    return tok;
}

/* Growing byte string with a parallel "trained" flag per byte. */
typedef struct {
    char *b;
    uint8_t *train;
    size_t n, cap;
} text;

static void put(text *t, const char *p, size_t n, int train) {
    if (t->n + n + 1 > t->cap) {
        t->cap = (t->n + n + 1) * 2;
        t->b = realloc(t->b, t->cap);
        t->train = realloc(t->train, t->cap);
        if (!t->b || !t->train) fuzz_fail("out of memory");
    }
    memcpy(t->b + t->n, p, n);
    memset(t->train + t->n, train, n);
    t->n += n;
}

static void puts_(text *t, const char *s, int train) { put(t, s, strlen(s), train); }

/* Byte-level BPE (GPT-2 bytes_to_unicode, as HF tokenizers' ByteLevel) gives each byte a
 * character; a byte whose character is not in the vocabulary is dropped from the text, as HF
 * does without an unk token (SmolLM2 lacks 0x04, 0x06, 0x13, 0x14, 0x16, 0x1d). keep[b] says
 * whether byte b survives. */
typedef struct {
    const bt_tokenizer *tok;
    uint8_t keep[256];
} byteset;

static void byteset_init(byteset *bs, const bt_tokenizer *tok) {
    bs->tok = tok;
    for (int b = 0; b < 256; b++) {
        int printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        int n = 0; /* the n-th non-printable byte maps to U+0100 + n */
        for (int c = 0; c < b; c++)
            n += !((c >= 0x21 && c <= 0x7E) || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF));
        unsigned cp = printable ? (unsigned)b : 0x100u + (unsigned)n;
        char u[4] = {0};
        if (cp < 0x80) u[0] = (char)cp;
        else {
            u[0] = (char)(0xC0 | cp >> 6);
            u[1] = (char)(0x80 | (cp & 0x3F));
        }
        bs->keep[b] = bt_tokenizer_find(tok, u) >= 0;
    }
}

/* Text the tokenizer renders back: the bytes it has characters for. */
static void put_text(text *t, const byteset *bs, const char *p, size_t n, int train) {
    for (size_t i = 0; i < n; i++)
        if (bs->keep[(uint8_t)p[i]]) put(t, p + i, 1, train);
}

/* Valid UTF-8 copy of p[0..n) (invalid bytes -> '?'; NULs -> ' ' when no_nul). */
static char *clean(const uint8_t *p, size_t n, int no_nul) {
    char *s = malloc(n + 1);
    if (!s) fuzz_fail("out of memory");
    memcpy(s, p, n);
    s[n] = 0;
    size_t off;
    while ((off = ld_utf8_check((const uint8_t *)s, n)) < n) s[off] = '?';
    if (no_nul)
        for (size_t i = 0; i < n; i++)
            if (!s[i]) s[i] = ' ';
    return s;
}

/* Python's str.isspace() code points (CPython _PyUnicode_IsWhitespace: bidirectional WS/B/S or
 * category Zs), which Jinja's `trim` and str.strip() remove. */
static int py_ws(uint32_t c) {
    static const uint32_t ws[] = {0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x1C, 0x1D, 0x1E, 0x1F, 0x20, 0x85, 0xA0,
                                  0x1680, 0x2000, 0x2001, 0x2002, 0x2003, 0x2004, 0x2005, 0x2006, 0x2007,
                                  0x2008, 0x2009, 0x200A, 0x2028, 0x2029, 0x202F, 0x205F, 0x3000};
    for (size_t i = 0; i < sizeof ws / sizeof *ws; i++)
        if (ws[i] == c) return 1;
    return 0;
}

/* Code point at s[i] (valid UTF-8), its length in *l. */
static uint32_t cp_at(const char *s, size_t i, size_t *l) {
    const uint8_t *u = (const uint8_t *)s + i;
    if (u[0] < 0x80) return *l = 1, u[0];
    if (u[0] < 0xE0) return *l = 2, (uint32_t)(u[0] & 0x1F) << 6 | (u[1] & 0x3F);
    if (u[0] < 0xF0) return *l = 3, (uint32_t)(u[0] & 0x0F) << 12 | (uint32_t)(u[1] & 0x3F) << 6 | (u[2] & 0x3F);
    return *l = 4, (uint32_t)(u[0] & 0x07) << 18 | (uint32_t)(u[1] & 0x3F) << 12 | (uint32_t)(u[2] & 0x3F) << 6 |
                       (u[3] & 0x3F);
}

/* str.strip() of c[0..*n): moves *c, shrinks *n. */
static void py_strip(const char **c, size_t *n) {
    size_t a = 0, b = *n, l;
    while (a < b && py_ws(cp_at(*c, a, &l))) a += l;
    while (b > a) {
        size_t q = b - 1;
        while (q > a && ((uint8_t)(*c)[q] & 0xC0) == 0x80) q--;
        if (!py_ws(cp_at(*c, q, &l))) break;
        b = q;
    }
    *c += a;
    *n = b - a;
}

/* The SentencePiece templates' reference text (llama2 = 2, mistral = 3, mistral-v3 = 4) of a
 * conversation in their order; trained bytes flagged. */
static void spm_text(text *w, int tpl, char **role, char **content, size_t *cn, int n) {
    int s = n > 0 && !strcmp(role[0], "system");
    if (tpl != 2) puts_(w, "<s>", 0);
    for (int k = s; k < n; k++) {
        int a = !strcmp(role[k], "assistant");
        const char *c = content[k];
        size_t m = cn[k];
        if (tpl == 2) { /* Llama 2 */
            if (!a) {
                puts_(w, "<s>[INST] ", 0);
                if (k == s && s) { /* strip("<<SYS>>\n" + system + "\n<</SYS>>\n\n" + content) */
                    text t = {0};
                    puts_(&t, "<<SYS>>\n", 0);
                    put(&t, content[0], cn[0], 0);
                    puts_(&t, "\n<</SYS>>\n\n", 0);
                    put(&t, c, m, 0);
                    const char *tc = t.b;
                    size_t tn = t.n;
                    py_strip(&tc, &tn);
                    put(w, tc, tn, 0);
                    free(t.b);
                    free(t.train);
                } else {
                    py_strip(&c, &m);
                    put(w, c, m, 0);
                }
                puts_(w, " [/INST]", 0);
            } else {
                py_strip(&c, &m);
                puts_(w, " ", 0);
                put(w, c, m, 1);
                puts_(w, " ", 0);
                puts_(w, "</s>", 1);
            }
        } else if (!a) { /* Mistral v1 / v3 user turn */
            puts_(w, tpl == 3 ? " [INST] " : "[INST] ", 0);
            if (s && (tpl == 4 ? k == n - 1 : k == s)) {
                put(w, content[0], cn[0], 0);
                puts_(w, "\n\n", 0);
            }
            put(w, c, m, 0);
            puts_(w, tpl == 3 ? " [/INST]" : "[/INST]", 0);
        } else {
            if (tpl == 4) py_strip(&c, &m);
            puts_(w, " ", 0);
            put(w, c, m, 1);
            puts_(w, "</s>", 1);
        }
    }
}

/* 1 when the SentencePiece templates refuse these roles (format.h). */
static int spm_refuses(char **role, int n) {
    int s = n > 0 && !strcmp(role[0], "system");
    for (int k = s; k < n; k++) {
        const char *want = (k - s) % 2 == 0 ? "user" : "assistant";
        if (strcmp(role[k], want)) return 1;
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 2) return 0;
    int tpl = data[0] % 5, llama3 = tpl == 1, spm = tpl >= 2;
    const bt_tokenizer *tok = spm ? mistral_tokenizer() : llama3 ? llama3_tokenizer() : fuzz_tokenizer();
    static byteset sets[2];
    byteset *bs = &sets[llama3];
    if (!spm && bs->tok != tok) byteset_init(bs, tok);
    static const char *const roles[] = {"system", "user", "assistant", "tool"};
    json_t *msgs = json_array();
    text want = {0};
    int n_msgs = 0, trained = 0;
    const uint8_t *p = data + 1, *end = data + size;
    char **role_s = NULL, **content_s = NULL;
    size_t *content_n = NULL;
    while (p < end && n_msgs < 64) {
        const uint8_t *e = memchr(p, 0x1E, (size_t)(end - p));
        if (!e) e = end;
        const uint8_t *sep = memchr(p, 0x1F, (size_t)(e - p));
        const uint8_t *rp = p, *cp = sep ? sep + 1 : e;
        size_t rn = sep ? (size_t)(sep - p) : 0, cn = (size_t)(e - cp);
        char *role = rn == 1 ? strdup(roles[rp[0] % 4]) : clean(rp, rn, 1);
        if (rn == 0) {
            free(role);
            role = strdup(roles[n_msgs % 3 == 2 ? 2 : n_msgs % 2]);
        }
        char *content = clean(cp, cn, 0);
        json_array_append_new(msgs, json_pack("{s:s, s:s%}", "role", role, "content", content, cn));
        role_s = realloc(role_s, (size_t)(n_msgs + 1) * sizeof *role_s);
        content_s = realloc(content_s, (size_t)(n_msgs + 1) * sizeof *content_s);
        content_n = realloc(content_n, (size_t)(n_msgs + 1) * sizeof *content_n);
        role_s[n_msgs] = role;
        content_s[n_msgs] = content;
        content_n[n_msgs] = cn;
        trained += !strcmp(role, "assistant") && cn > 0;
        n_msgs++;
        p = e + 1;
    }
    /* the template's text, and which bytes carry loss */
    int refused = spm && trained && n_msgs > 0 && spm_refuses(role_s, n_msgs);
    if (spm) {
        if (!refused) spm_text(&want, tpl, role_s, content_s, content_n, n_msgs);
    } else if (llama3) {
        puts_(&want, "<|begin_of_text|>", 0);
        for (int i = 0; i < n_msgs; i++) {
            int tr = !strcmp(role_s[i], "assistant");
            puts_(&want, "<|start_header_id|>", 0);
            put_text(&want, bs, role_s[i], strlen(role_s[i]), 0);
            puts_(&want, "<|end_header_id|>", 0);
            put_text(&want, bs, "\n\n", 2, 0);
            const char *c = content_s[i];
            size_t cn = content_n[i];
            py_strip(&c, &cn);
            put_text(&want, bs, c, cn, tr);
            puts_(&want, "<|eot_id|>", tr);
        }
    } else {
        for (int i = -1; i < n_msgs; i++) {
            if (i < 0 && n_msgs > 0 && !strcmp(role_s[0], "system")) continue;
            const char *r = i < 0 ? "system" : role_s[i];
            int tr = !strcmp(r, "assistant");
            puts_(&want, "<|im_start|>", 0);
            put_text(&want, bs, r, strlen(r), 0);
            put_text(&want, bs, "\n", 1, 0);
            if (i < 0) put_text(&want, bs, DEFAULT_SYSTEM, strlen(DEFAULT_SYSTEM), 0);
            else put_text(&want, bs, content_s[i], content_n[i], tr);
            puts_(&want, "<|im_end|>", tr);
            put_text(&want, bs, "\n", 1, 0);
        }
    }
    json_t *root = json_pack("{s:o}", "messages", msgs);
    char *line = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    if (!line) fuzz_fail("cannot encode the line");
    static const ld_chat_tpl tpls[5] = {LD_TPL_CHATML, LD_TPL_LLAMA3, LD_TPL_LLAMA2, LD_TPL_MISTRAL, LD_TPL_MISTRAL_V3};
    ld_format_cfg cfg = {.format = LD_FMT_CHAT, .tok = tok, .tpl = tpls[tpl]};
    bt_ids ids = {0}, mask = {0};
    int truncated = 0, reason = -1;
    int rc = ld_format_line(&cfg, line, strlen(line), &ids, &mask, &truncated, &reason);
    if (rc < 0) fuzz_fail("internal error on a valid line");
    if (n_msgs == 0 || !trained) {
        if (rc != 1 || reason != LD_BAD_EMPTY) fuzz_fail("a conversation without assistant content was not 'empty'");
    } else if (refused) {
        if (rc != 1 || reason != LD_BAD_FIELD || !strstr(bt_last_error(), ld_chat_tpl_name(tpls[tpl])))
            fuzz_fail("roles out of the template's order were not refused as 'field' naming the template");
    } else {
        if (rc != 0) {
            fprintf(stderr, "refused: %s\n", bt_last_error());
            fuzz_fail("a valid conversation was refused");
        }
        if (ids.n != mask.n || truncated) fuzz_fail("ids and mask differ in length, or truncated");
        size_t off = 0;
        for (size_t k = 0; k < ids.n; k++) {
            char *tt = NULL;
            size_t tl = 0;
            if (bt_detokenize(tok, &ids.v[k], 1, 1, &tt, &tl)) fuzz_fail("a rendered token does not decode");
            /* the template text this token stands for: its decoded bytes, where for SentencePiece a
             * decoded " " may stand for a literal U+2581 of the text (both are escaped to it) */
            size_t stop = off;
            for (size_t j = 0; j < tl; j++) {
                if (stop < want.n && want.b[stop] == tt[j]) stop++;
                else if (spm && tt[j] == ' ' && want.n - stop >= 3 && !memcmp(want.b + stop, "\xe2\x96\x81", 3)) stop += 3;
                else {
                    fprintf(stderr, "token %zu (id %d) at byte %zu differs from the template text\n", k, ids.v[k], off);
                    fuzz_fail("rendered text differs from the template");
                }
            }
            int covers = 0;
            for (size_t q = off; q < stop; q++) covers |= want.train[q];
            if ((mask.v[k] != 0) != covers) {
                fprintf(stderr, "token %zu (id %d, bytes %zu..%zu) mask %d, covers trained bytes %d\n", k, ids.v[k], off,
                        stop, mask.v[k], covers);
                fuzz_fail("loss mask differs from the template's trained bytes");
            }
            off = stop;
            free(tt);
        }
        if (off != want.n) fuzz_fail("rendered text shorter than the template");
    }
    for (int i = 0; i < n_msgs; i++) {
        free(role_s[i]);
        free(content_s[i]);
    }
    free(role_s);
    free(content_s);
    free(content_n);
    free(line);
    free(want.b);
    free(want.train);
    bt_ids_free(&ids);
    bt_ids_free(&mask);
    return 0;
}
