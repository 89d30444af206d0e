/* Chat templates of the SentencePiece families (contract: common/chat.h): Gemma 3, Llama 2,
 * Mistral 'v1' (7B Instruct v0.1/v0.2) and 'v3' (v0.3), Phi-3. Each renders a conversation as
 * the model's own Jinja chat template does (the strings and their sources:
 * tests/reference/gen_chat_template_fixtures.py), into
 *   a byte string (the rendering's text) with a class per byte (template text, message content,
 *   trained content = an assistant message's), and
 *   the template's special tokens (bos/eos, <start_of_turn>, <|end|>, [INST] where the vocabulary
 *   has it as a control token ...) as markers between the bytes, inserted by id;
 * then tokenizes each run of text between two markers on its own (bt_tokenize_run, without
 * special-token parsing: content cannot inject control tokens), which equals tokenizing the whole
 * rendering with special-token parsing (transformers' apply_chat_template(tokenize=True),
 * llama.cpp's llama_tokenize(parse_special = true)) as long as the contents hold no
 * special-token strings: special tokens cut the text into fragments tokenized independently (HF
 * AddedVocabulary, llama.cpp tokenizer_st_partition), the whitespace a token absorbs (rstrip /
 * lstrip: Phi-3's) is cut off first (bt_tokenizer_strip).
 * Loss mask: a token is trained iff it covers at least one byte of an assistant message's content
 * (the byte spans come from aligning each run's tokens to its text: align() below; a run whose
 * tokens do not line up with its text is refused, never mis-masked), and the end-of-turn token
 * after each assistant message is trained (</s>, <end_of_turn>, <|end|>). */
#include "common/chat.h"

#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"

enum { C_TPL = 0, C_MSG = 1, C_TRAIN = 2 };

typedef struct {
    size_t pos;  /* the marker stands before txt[pos] */
    int32_t id;
    int train;
} marker;

typedef struct {
    const bt_tokenizer *t;
    const char *name;
    char *txt;
    uint8_t *cls;
    size_t n, cap;
    marker *mk;
    size_t nmk, cmk;
    int err;
} render;

static void put(render *r, const char *s, size_t n, int cls) {
    if (r->err || !n) return;
    if (r->n + n > r->cap) {
        size_t cap = r->cap ? r->cap : 256;
        while (cap < r->n + n) cap *= 2;
        char *t = realloc(r->txt, cap);
        if (t) r->txt = t;
        uint8_t *c = t ? realloc(r->cls, cap) : NULL;
        if (!t || !c) {
            r->err = BT_ERR_NOMEM;
            return;
        }
        r->cls = c;
        r->cap = cap;
    }
    memcpy(r->txt + r->n, s, n);
    memset(r->cls + r->n, cls, n);
    r->n += n;
}
static void lit(render *r, const char *s) { put(r, s, strlen(s), C_TPL); }

static void tok(render *r, int32_t id, int train) {
    if (r->err) return;
    if (r->nmk == r->cmk) {
        size_t c = r->cmk ? 2 * r->cmk : 16;
        marker *m = realloc(r->mk, c * sizeof *m);
        if (!m) {
            r->err = BT_ERR_NOMEM;
            return;
        }
        r->mk = m;
        r->cmk = c;
    }
    r->mk[r->nmk++] = (marker){r->n, id, train};
}

/* Template text that may be a special token of the vocabulary ("[INST]" is one in Mistral v0.3's,
 * plain text in Llama 2's): tokenizing the rendering with special-token parsing makes it one. */
static void lit_or_tok(render *r, const char *s) {
    int32_t id = bt_tokenizer_find(r->t, s);
    int ty = id >= 0 ? bt_tokenizer_token_type(r->t, id) : 0;
    if (ty == 3 || ty == 4) tok(r, id, 0);
    else lit(r, s);
}

/* Python str.isspace / str.strip() (what Jinja's `trim` and `.strip()` call): Unicode White_Space
 * plus U+001C..U+001F (bidirectional class B/S). Content is valid UTF-8 (format.c checks lines). */
static int py_space(uint32_t c) {
    return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}
static size_t u8_len(uint8_t b) { return b < 0x80 ? 1 : b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : b >= 0xC0 ? 2 : 1; }
static uint32_t u8_at(const uint8_t *s, size_t n, size_t *len) {
    size_t l = u8_len(s[0]);
    if (l > n) l = 1;
    *len = l;
    if (l == 1) return s[0];
    uint32_t c = s[0] & (0x7F >> l);
    for (size_t k = 1; k < l; k++) c = c << 6 | (s[k] & 0x3F);
    return c;
}

void bt_chat_py_strip(const char **s, size_t *n, int left, int right) {
    const uint8_t *p = (const uint8_t *)*s;
    size_t a = 0, b = *n, l;
    while (left && a < b && py_space(u8_at(p + a, b - a, &l))) a += l;
    while (right && b > a) {
        size_t c = b - 1;
        while (c > a && (p[c] & 0xC0) == 0x80) c--;
        if (!py_space(u8_at(p + c, b - c, &l)) || c + l != b) break;
        b = c;
    }
    *s += a;
    *n = b - a;
}

/* Drops the trailing Python whitespace of txt[from..n) (Llama 2 strips `<<SYS>>...` + content),
 * never past a token marker (a token's text is not whitespace). */
static void rstrip_from(render *r, size_t from) {
    for (size_t i = 0; i < r->nmk; i++)
        if (r->mk[i].pos > from) from = r->mk[i].pos;
    const char *s = r->txt + from;
    size_t n = r->n - from;
    bt_chat_py_strip(&s, &n, 0, 1);
    r->n = from + n;
}

static int refuse(render *r, const char *msg) {
    return bt_fail(BT_ERR_FORMAT, "chat template \"%s\": %s", r->name, msg);
}

static int is_role(const bt_chat_msg *m, const char *role) { return strcmp(m->role, role) == 0; }

/* The optional first system message, then strictly alternating user/assistant turns starting with
 * user (what the templates' raise_exception checks enforce for these roles); other roles are
 * refused (the Jinja templates would skip or misplace them silently). */
static int check_turns(render *r, const bt_chat_msg *m, int n, const char *alternate_msg) {
    for (int k = 0; k < n; k++) {
        if ((is_role(&m[k], "user")) != (k % 2 == 0)) return refuse(r, alternate_msg);
        if (!is_role(&m[k], "user") && !is_role(&m[k], "assistant"))
            return bt_fail(BT_ERR_FORMAT, "chat template \"%s\": role \"%s\" is not supported (an optional first "
                           "\"system\" message, then \"user\" and \"assistant\" turns)", r->name, m[k].role);
    }
    return 0;
}

static const char ALTERNATE[] = "Conversation roles must alternate user/assistant/user/assistant/...";
static const char ALTERNATE_SYS[] =
    "After the optional system message, conversation roles must alternate user/assistant/user/assistant/...";

static int need(render *r, int32_t id, const char *what) {
    if (id < 0) return bt_fail(BT_ERR_UNSUPPORTED, "chat template \"%s\": the tokenizer has no %s", r->name, what);
    return 0;
}

/* Gemma 3 instruction-tuned: bos, then per turn "<start_of_turn>" role "\n" content|trim
 * "<end_of_turn>" "\n", role "model" for assistant, a system message put in front of the first
 * turn's content followed by "\n\n" (not trimmed). */
static int gemma(render *r, const bt_chat_msg *m, int n) {
    int32_t bos = bt_tokenizer_bos(r->t), sot = bt_tokenizer_find(r->t, "<start_of_turn>"),
            eot = bt_tokenizer_find(r->t, "<end_of_turn>");
    int rc = need(r, bos, "bos token");
    if (!rc) rc = need(r, sot, "<start_of_turn>");
    if (!rc) rc = need(r, eot, "<end_of_turn>");
    int s = n > 0 && is_role(&m[0], "system");
    if (!rc) rc = check_turns(r, m + s, n - s, ALTERNATE);
    if (rc) return rc;
    tok(r, bos, 0);
    for (int k = s; k < n; k++) {
        int a = is_role(&m[k], "assistant");
        tok(r, sot, 0);
        lit(r, a ? "model" : m[k].role);
        lit(r, "\n");
        if (k == s && s) {
            put(r, m[0].content, m[0].content_len, C_MSG);
            lit(r, "\n\n");
        }
        const char *c = m[k].content;
        size_t cn = m[k].content_len;
        bt_chat_py_strip(&c, &cn, 1, 1);
        put(r, c, cn, a ? C_TRAIN : C_MSG);
        tok(r, eot, a);
        lit(r, "\n");
    }
    return 0;
}

/* Llama 2 chat: per user turn bos "[INST] " content.strip() " [/INST]", per assistant turn " "
 * content.strip() " " eos; a system message becomes "<<SYS>>\n" system "\n<</SYS>>\n\n" in front of
 * the first user turn's content (stripped together). */
static int llama2(render *r, const bt_chat_msg *m, int n) {
    int32_t bos = bt_tokenizer_bos(r->t), eos = bt_tokenizer_eos(r->t);
    int rc = need(r, bos, "bos token");
    if (!rc) rc = need(r, eos, "eos token");
    int s = n > 0 && is_role(&m[0], "system");
    if (!rc) rc = check_turns(r, m + s, n - s, ALTERNATE);
    if (rc) return rc;
    for (int k = s; k < n; k++) {
        int a = is_role(&m[k], "assistant");
        if (!a) {
            tok(r, bos, 0);
            lit_or_tok(r, "[INST]");
            lit(r, " ");
        } else {
            lit(r, " ");
        }
        const char *c = m[k].content;
        size_t cn = m[k].content_len, from = r->n;
        if (k == s && s) {
            lit_or_tok(r, "<<SYS>>");
            lit(r, "\n");
            put(r, m[0].content, m[0].content_len, C_MSG);
            lit(r, "\n");
            lit_or_tok(r, "<</SYS>>");
            lit(r, "\n\n");
            put(r, c, cn, C_MSG);
            if (!r->err) rstrip_from(r, from);
        } else {
            bt_chat_py_strip(&c, &cn, 1, 1);
            put(r, c, cn, a ? C_TRAIN : C_MSG);
        }
        if (!a) {
            lit(r, " ");
            lit_or_tok(r, "[/INST]");
        } else {
            lit(r, " ");
            tok(r, eos, 1);
        }
    }
    return 0;
}

/* Mistral 'v1' (v3 = 0: Mistral 7B Instruct v0.1/v0.2) and 'v3' (v3 = 1: v0.3). v1: bos, per user
 * turn " [INST] " content " [/INST]" (the system message + "\n\n" in front of the first one), per
 * assistant turn " " content eos. v3: bos, "[INST] " content "[/INST]" (the system message +
 * "\n\n" in front of the LAST message when it is a user turn: dropped otherwise, as the template
 * does), assistant " " content|trim eos. */
static int mistral(render *r, const bt_chat_msg *m, int n, int v3) {
    int32_t bos = bt_tokenizer_bos(r->t), eos = bt_tokenizer_eos(r->t);
    int rc = need(r, bos, "bos token");
    if (!rc) rc = need(r, eos, "eos token");
    int s = n > 0 && is_role(&m[0], "system");
    if (!rc) rc = check_turns(r, m + s, n - s, ALTERNATE_SYS);
    if (rc) return rc;
    tok(r, bos, 0);
    for (int k = s; k < n; k++) {
        int a = is_role(&m[k], "assistant");
        const char *c = m[k].content;
        size_t cn = m[k].content_len;
        if (!a) {
            if (!v3) lit(r, " ");
            lit_or_tok(r, "[INST]");
            lit(r, " ");
            if (s && (v3 ? k == n - 1 : k == s)) {
                put(r, m[0].content, m[0].content_len, C_MSG);
                lit(r, "\n\n");
            }
            put(r, c, cn, C_MSG);
            if (!v3) lit(r, " ");
            lit_or_tok(r, "[/INST]");
        } else {
            lit(r, " ");
            if (v3) bt_chat_py_strip(&c, &cn, 1, 1);
            put(r, c, cn, C_TRAIN);
            tok(r, eos, 1);
        }
    }
    return 0;
}

/* Phi-3 (Phi-3.5-mini-instruct's template): per message "<|system|>" / "<|user|>" / "<|assistant|>"
 * "\n" content "<|end|>" "\n" (a system message with empty content is left out), then the
 * eos_token "<|endoftext|>"; any order of these roles. */
static int phi3(render *r, const bt_chat_msg *m, int n) {
    int32_t sy = bt_tokenizer_find(r->t, "<|system|>"), us = bt_tokenizer_find(r->t, "<|user|>"),
            as = bt_tokenizer_find(r->t, "<|assistant|>"), end = bt_tokenizer_find(r->t, "<|end|>"),
            eot = bt_tokenizer_find(r->t, "<|endoftext|>");
    int rc = need(r, sy, "<|system|>");
    if (!rc) rc = need(r, us, "<|user|>");
    if (!rc) rc = need(r, as, "<|assistant|>");
    if (!rc) rc = need(r, end, "<|end|>");
    if (!rc) rc = need(r, eot, "<|endoftext|>");
    if (rc) return rc;
    for (int k = 0; k < n; k++) {
        int a = is_role(&m[k], "assistant"), u = is_role(&m[k], "user"), sys = is_role(&m[k], "system");
        if (!a && !u && !sys)
            return bt_fail(BT_ERR_FORMAT, "chat template \"%s\": role \"%s\" is not supported (\"system\", \"user\", "
                           "\"assistant\")", r->name, m[k].role);
        if (sys && m[k].content_len == 0) continue;
        tok(r, a ? as : u ? us : sy, 0);
        lit(r, "\n");
        put(r, m[k].content, m[k].content_len, a ? C_TRAIN : C_MSG);
        tok(r, end, a);
        lit(r, "\n");
    }
    tok(r, eot, 0);
    return 0;
}

/* Aligns the tokens of the run txt[a..b) to its bytes and sets train[i] = 1 for each token whose
 * bytes include a trained one: a user-defined token stands for its own text (matched literally);
 * any other token for the bytes it decodes to, where a decoded " " may stand for a " " or a
 * literal U+2581 of the text (SentencePiece escapes both alike), and, with prefix, the first
 * token's leading " " for nothing (the space prefix). 0 when every byte is accounted for exactly,
 * -1 otherwise. */
static int align(const render *r, const bt_ids *tk, size_t a, size_t b, int prefix, int32_t *train) {
    const bt_tokenizer *t = r->t;
    const char *x = r->txt;
    size_t off = a;
    for (size_t i = 0; i < tk->n; i++) {
        size_t start = off;
        if (bt_tokenizer_token_type(t, tk->v[i]) == 4) {
            const char *pc = bt_tokenizer_piece(t, tk->v[i]);
            size_t l = strlen(pc);
            if (l > b - off || memcmp(x + off, pc, l) != 0) return -1;
            off += l;
        } else {
            size_t l = 0;
            const uint8_t *d = bt_tokenizer_token_bytes(t, tk->v[i], &l);
            size_t j = 0;
            if (i == 0 && prefix) {
                if (!l || d[0] != ' ') return -1;
                j = 1;
            }
            for (; j < l; j++) {
                if (off < b && (uint8_t)x[off] == d[j]) off++;
                else if (d[j] == ' ' && b - off >= 3 && memcmp(x + off, "\xe2\x96\x81", 3) == 0) off += 3;
                else return -1;
            }
        }
        train[i] = 0;
        for (size_t q = start; q < off && !train[i]; q++) train[i] = r->cls[q] == C_TRAIN;
    }
    return off == b ? 0 : -1;
}

static int push2(bt_ids *ids, bt_ids *mask, int32_t id, int32_t m) {
    if (bt_ids_try_push(ids, id)) return BT_ERR_NOMEM;
    if (bt_ids_try_push(mask, m)) {
        ids->n--;
        return BT_ERR_NOMEM;
    }
    return BT_OK;
}
#define OOM() bt_fail(BT_ERR_NOMEM, "chat: out of memory for the document's tokens")

/* Tokenizes the rendering: markers by id, each run of text between them with bt_tokenize_run. */
static int encode(render *r, bt_ids *ids, bt_ids *mask) {
    const bt_tokenizer *t = r->t;
    bt_ids tmp = {0}, tr = {0};
    int rc = 0;
    size_t pos = 0, k = 0;
    int32_t prev = -1;
    while (rc == 0 && (pos < r->n || k < r->nmk)) {
        if (k < r->nmk && r->mk[k].pos == pos) {
            if (push2(ids, mask, r->mk[k].id, r->mk[k].train)) rc = OOM();
            prev = r->mk[k++].id;
            continue;
        }
        size_t end = k < r->nmk ? r->mk[k].pos : r->n;
        int32_t next = k < r->nmk ? r->mk[k].id : -1;
        size_t a = pos, b = end;
        if (prev >= 0) a += bt_tokenizer_strip(t, prev, r->txt + a, b - a, 1);
        if (next >= 0) b -= bt_tokenizer_strip(t, next, r->txt + a, b - a, 0);
        tmp.n = 0;
        if (b > a && (rc = bt_tokenize_run(t, r->txt + a, b - a, pos == 0, &tmp)) < 0) break;
        if (tmp.n > tr.cap) {
            int32_t *v = bt_vec_grow(tr.v, &tr.cap, tmp.n, sizeof *tr.v);
            if (!v) {
                rc = OOM();
                break;
            }
            tr.v = v;
        }
        if (align(r, &tmp, a, b, 0, tr.v) && align(r, &tmp, a, b, 1, tr.v)) {
            rc = bt_fail(BT_ERR_FORMAT, "chat template \"%s\": the %zu tokens of a %zu-byte run of the rendering "
                         "do not line up with its text: not masked", r->name, tmp.n, b - a);
            break;
        }
        for (size_t i = 0; i < tmp.n && rc == 0; i++)
            if (push2(ids, mask, tmp.v[i], tr.v[i])) rc = OOM();
        pos = end;
        prev = -1;
    }
    bt_ids_free(&tmp);
    bt_ids_free(&tr);
    return rc;
}

const char *bt_chat_style_name(bt_chat_style s) {
    switch (s) {
    case BT_CHAT_CHATML: return "chatml";
    case BT_CHAT_GEMMA: return "gemma";
    case BT_CHAT_LLAMA2: return "llama2";
    case BT_CHAT_MISTRAL: return "mistral";
    case BT_CHAT_MISTRAL_V3: return "mistral-v3";
    case BT_CHAT_PHI3: return "phi3";
    }
    return "unknown";
}

int bt_chat_encode_spm(const bt_tokenizer *t, bt_chat_style style, const bt_chat_msg *msgs, int n, bt_ids *ids,
                       bt_ids *mask) {
    render r = {.t = t, .name = bt_chat_style_name(style)};
    int rc;
    switch (style) {
    case BT_CHAT_GEMMA: rc = gemma(&r, msgs, n); break;
    case BT_CHAT_LLAMA2: rc = llama2(&r, msgs, n); break;
    case BT_CHAT_MISTRAL: rc = mistral(&r, msgs, n, 0); break;
    case BT_CHAT_MISTRAL_V3: rc = mistral(&r, msgs, n, 1); break;
    case BT_CHAT_PHI3: rc = phi3(&r, msgs, n); break;
    default: rc = bt_fail(BT_ERR_UNSUPPORTED, "chat_encode: unknown style %d", (int)style);
    }
    if (rc == 0 && r.err) rc = bt_fail(BT_ERR_NOMEM, "chat: out of memory rendering the conversation");
    size_t n_ids0 = ids->n, n_mask0 = mask->n;
    if (rc == 0) rc = encode(&r, ids, mask);
    if (rc < 0) {
        ids->n = n_ids0;
        mask->n = n_mask0;
    }
    free(r.txt);
    free(r.cls);
    free(r.mk);
    return rc;
}
