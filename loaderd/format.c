/* loaderd formats: JSONL line -> (ids, mask). See format.h. */
#include "loaderd/format.h"

#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "common/bt_json.h"
#include "common/chat.h"

size_t ld_utf8_check(const uint8_t *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t need;
        uint8_t lo = 0x80, hi = 0xBF; /* allowed range of the second byte */
        if (c >= 0xC2 && c <= 0xDF) need = 1;
        else if (c == 0xE0) need = 2, lo = 0xA0;
        else if (c >= 0xE1 && c <= 0xEC) need = 2;
        else if (c == 0xED) need = 2, hi = 0x9F; /* no UTF-16 surrogates */
        else if (c >= 0xEE && c <= 0xEF) need = 2;
        else if (c == 0xF0) need = 3, lo = 0x90;
        else if (c >= 0xF1 && c <= 0xF3) need = 3;
        else if (c == 0xF4) need = 3, hi = 0x8F; /* <= U+10FFFF */
        else return i;
        if (n - i <= need) return i;
        if (s[i + 1] < lo || s[i + 1] > hi) return i;
        for (size_t k = 2; k <= need; k++)
            if ((s[i + k] & 0xC0) != 0x80) return i;
        i += need + 1;
    }
    return n;
}

/* A bad line: *reason = r, the description in bt_last_error() (bt_fail), returns 1. */
static int bad(int *reason, int r, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int bad(int *reason, int r, const char *fmt, ...) {
    char msg[256];
    *reason = r;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    bt_fail(BT_ERR_FORMAT, "%s", msg);
    return 1;
}

static const char *type_name(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "object";
    case JSON_ARRAY: return "array";
    case JSON_STRING: return "string";
    case JSON_INTEGER: return "integer";
    case JSON_REAL: return "number";
    case JSON_TRUE:
    case JSON_FALSE: return "boolean";
    case JSON_NULL: return "null";
    }
    return "?";
}

/* Fetch a string field: 0 ok, 1 missing, 2 wrong type. */
static int get_str(const json_t *obj, const char *key, const char **s, size_t *n, const char **tn) {
    json_t *v = json_object_get(obj, key);
    if (!v) return 1;
    if (!json_is_string(v)) {
        *tn = type_name(v);
        return 2;
    }
    *s = json_string_value(v);
    *n = json_string_length(v);
    return 0;
}

/* ---------------------------------------------------------------- chat templates */

/* The SentencePiece families' templates are bt_chat_encode styles (common/chat.h). */
static int spm_style(ld_chat_tpl t, bt_chat_style *st) {
    switch (t) {
    case LD_TPL_GEMMA: *st = BT_CHAT_GEMMA; return 1;
    case LD_TPL_LLAMA2: *st = BT_CHAT_LLAMA2; return 1;
    case LD_TPL_MISTRAL: *st = BT_CHAT_MISTRAL; return 1;
    case LD_TPL_MISTRAL_V3: *st = BT_CHAT_MISTRAL_V3; return 1;
    case LD_TPL_PHI3: *st = BT_CHAT_PHI3; return 1;
    default: return 0;
    }
}

const char *ld_chat_tpl_name(ld_chat_tpl t) {
    bt_chat_style st;
    if (spm_style(t, &st)) return bt_chat_style_name(st);
    return t == LD_TPL_AUTO ? "auto" : t == LD_TPL_CHATML ? "chatml" : t == LD_TPL_LLAMA3 ? "llama3" : "unknown";
}

static int has(const bt_tokenizer *t, const char *piece) { return bt_tokenizer_find(t, piece) >= 0; }
static int has_chatml(const bt_tokenizer *t) { return has(t, "<|im_start|>") && has(t, "<|im_end|>"); }
static int has_llama3(const bt_tokenizer *t) {
    return has(t, "<|begin_of_text|>") && has(t, "<|start_header_id|>") && has(t, "<|end_header_id|>") &&
           has(t, "<|eot_id|>");
}
static int has_gemma(const bt_tokenizer *t) {
    return has(t, "<start_of_turn>") && has(t, "<end_of_turn>") && bt_tokenizer_bos(t) >= 0;
}
static int has_phi3(const bt_tokenizer *t) {
    return has(t, "<|system|>") && has(t, "<|user|>") && has(t, "<|assistant|>") && has(t, "<|end|>") &&
           has(t, "<|endoftext|>");
}

/* Which supported template a tokenizer's chat_template string is, by text only its family has
 * (the official templates: tests/reference/gen_chat_template_fixtures.py); LD_TPL_AUTO if none. */
static ld_chat_tpl tpl_of_string(const char *ct) {
    if (strstr(ct, "<|im_start|>")) return LD_TPL_CHATML;
    if (strstr(ct, "<|start_header_id|>")) return LD_TPL_LLAMA3;
    if (strstr(ct, "<start_of_turn>") && strstr(ct, "<end_of_turn>")) return LD_TPL_GEMMA;
    if (strstr(ct, "<|assistant|>") && strstr(ct, "<|end|>")) return LD_TPL_PHI3;
    if (strstr(ct, "<<SYS>>") && strstr(ct, "content.strip() + ' [/INST]'")) return LD_TPL_LLAMA2;
    if (strstr(ct, "' [INST] ' + system_message")) return LD_TPL_MISTRAL;
    if (strstr(ct, "\"[INST] \" + system_message")) return LD_TPL_MISTRAL_V3;
    return LD_TPL_AUTO;
}

int ld_chat_tpl_resolve(const bt_tokenizer *tok, ld_chat_tpl want, ld_chat_tpl *out) {
    if (want == LD_TPL_AUTO) {
        const char *ct = bt_tokenizer_chat_template(tok);
        if (ct && *ct) {
            want = tpl_of_string(ct);
            if (want == LD_TPL_AUTO && strstr(ct, "[INST]"))
                return bt_fail(BT_ERR_UNSUPPORTED, "chat template: the tokenizer's chat_template is an [INST] template "
                               "this loaderd does not recognise (its variants render differently): set the job's "
                               "\"chat_template\" to \"llama2\", \"mistral\" (Mistral 7B Instruct v0.1/v0.2) or "
                               "\"mistral-v3\" (v0.3) if it is one of those");
            if (want == LD_TPL_AUTO)
                return bt_fail(BT_ERR_UNSUPPORTED, "chat template: the tokenizer's chat_template (\"%.80s%s\") is none "
                               "of the supported templates (chatml, llama3, gemma, llama2, mistral, mistral-v3, phi3); "
                               "set the job's \"chat_template\" to the one it renders, or convert the data to "
                               "\"text\"", ct, strlen(ct) > 80 ? "..." : "");
        } else if (has_chatml(tok)) want = LD_TPL_CHATML;
        else if (has_llama3(tok)) want = LD_TPL_LLAMA3;
        else if (has_gemma(tok)) want = LD_TPL_GEMMA;
        else if (has_phi3(tok)) want = LD_TPL_PHI3;
        else
            return bt_fail(BT_ERR_UNSUPPORTED, "chat template: the tokenizer has no chat_template and none of the "
                           "ChatML, Llama-3, Gemma or Phi-3 special tokens; set the job's \"chat_template\" "
                           "(\"llama2\", \"mistral\" or \"mistral-v3\" need only bos/eos)");
    }
    const char *name = ld_chat_tpl_name(want);
    switch (want) {
    case LD_TPL_CHATML:
        if (!has_chatml(tok)) return bt_fail(BT_ERR_UNSUPPORTED, "chat template \"chatml\": the tokenizer has no <|im_start|>/<|im_end|>");
        break;
    case LD_TPL_LLAMA3:
        if (!has_llama3(tok))
            return bt_fail(BT_ERR_UNSUPPORTED, "chat template \"llama3\": the tokenizer lacks <|begin_of_text|>, "
                           "<|start_header_id|>, <|end_header_id|> or <|eot_id|>");
        break;
    case LD_TPL_GEMMA:
        if (!has_gemma(tok))
            return bt_fail(BT_ERR_UNSUPPORTED, "chat template \"gemma\": the tokenizer lacks <start_of_turn>, "
                           "<end_of_turn> or a bos token");
        break;
    case LD_TPL_PHI3:
        if (!has_phi3(tok))
            return bt_fail(BT_ERR_UNSUPPORTED, "chat template \"phi3\": the tokenizer lacks <|system|>, <|user|>, "
                           "<|assistant|>, <|end|> or <|endoftext|>");
        break;
    case LD_TPL_LLAMA2:
    case LD_TPL_MISTRAL:
    case LD_TPL_MISTRAL_V3:
        if (bt_tokenizer_bos(tok) < 0 || bt_tokenizer_eos(tok) < 0)
            return bt_fail(BT_ERR_UNSUPPORTED, "chat template \"%s\": the tokenizer has no bos or no eos token", name);
        break;
    default: return bt_fail(BT_ERR_UNSUPPORTED, "chat template %d unknown", (int)want);
    }
    *out = want;
    return BT_OK;
}

/* Input bytes a token produced by bt_tokenize (parse_special = 0) covers: user-defined tokens are
 * matched literally (their piece text), every other token covers the bytes it decodes to
 * (same rule as common/chat.c). */
static size_t src_len(const bt_tokenizer *t, int32_t id) {
    if (bt_tokenizer_token_type(t, id) == 4) return strlen(bt_tokenizer_piece(t, id));
    size_t n = 0;
    bt_tokenizer_token_bytes(t, id, &n);
    return n;
}

/* Append a token and its mask bit, fallibly: a document is as long as its line, so running out of
 * memory fails it (BT_ERR_NOMEM: the stream skips and counts it), never the daemon. */
static int push2(bt_ids *ids, bt_ids *mask, int32_t id, int32_t m) {
    if (bt_ids_try_push(ids, id)) return BT_ERR_NOMEM;
    if (bt_ids_try_push(mask, m)) {
        ids->n--;
        return BT_ERR_NOMEM;
    }
    return BT_OK;
}
#define OOM() bt_fail(BT_ERR_NOMEM, "format: out of memory for the document's tokens")

/* Llama-3 rendering (see format.h). Appends to ids/mask; on error they may hold a partial
 * document (the caller rolls back). */
static int llama3_encode(const bt_tokenizer *t, const bt_chat_msg *msgs, size_t n, bt_ids *ids, bt_ids *mask) {
    int32_t bot = bt_tokenizer_find(t, "<|begin_of_text|>"), sh = bt_tokenizer_find(t, "<|start_header_id|>"),
            eh = bt_tokenizer_find(t, "<|end_header_id|>"), eot = bt_tokenizer_find(t, "<|eot_id|>");
    if (bot < 0 || sh < 0 || eh < 0 || eot < 0)
        return bt_fail(BT_ERR_UNSUPPORTED, "format: tokenizer lacks the Llama-3 chat tokens");
    bt_ids tmp = {0};
    char *run = NULL;
    size_t run_cap = 0;
    int rc = 0;
    if (push2(ids, mask, bot, 0)) rc = OOM();
    for (size_t i = 0; i < n && rc == 0; i++) {
        int train = strcmp(msgs[i].role, "assistant") == 0;
        if (push2(ids, mask, sh, 0)) {
            rc = OOM();
            break;
        }
        tmp.n = 0;
        rc = bt_tokenize(t, msgs[i].role, strlen(msgs[i].role), 0, &tmp);
        if (rc < 0) break;
        for (size_t k = 0; k < tmp.n && rc == 0; k++)
            if (push2(ids, mask, tmp.v[k], 0)) rc = OOM();
        if (rc == 0 && push2(ids, mask, eh, 0)) rc = OOM();
        if (rc < 0) break;
        const char *c = msgs[i].content;
        size_t cn = msgs[i].content_len;
        bt_chat_py_strip(&c, &cn, 1, 1); /* Jinja `trim` is Python's str.strip() */
        if (cn + 3 > run_cap) {
            run_cap = cn + 3;
            char *nr = realloc(run, run_cap);
            if (!nr) {
                rc = bt_fail(BT_ERR_NOMEM, "format: out of memory (%zu bytes)", run_cap);
                break;
            }
            run = nr;
        }
        run[0] = run[1] = '\n';
        if (cn) memcpy(run + 2, c, cn);
        tmp.n = 0;
        rc = bt_tokenize(t, run, cn + 2, 0, &tmp);
        if (rc < 0) break;
        size_t off = 0;
        for (size_t k = 0; k < tmp.n && rc == 0; k++) {
            off += src_len(t, tmp.v[k]);
            if (push2(ids, mask, tmp.v[k], train && off > 2 ? 1 : 0)) rc = OOM();
        }
        if (rc == 0 && push2(ids, mask, eot, train ? 1 : 0)) rc = OOM();
    }
    free(run);
    bt_ids_free(&tmp);
    return rc;
}

/* Render msgs with cfg's template; prepend BOS when asked and not already there. */
static int render_chat(const ld_format_cfg *cfg, const bt_chat_msg *msgs, size_t n, bt_ids *ids, bt_ids *mask) {
    size_t n0 = ids->n;
    bt_chat_style st;
    if (spm_style(cfg->tpl, &st)) /* these templates place bos themselves */
        return bt_chat_encode(cfg->tok, st, msgs, (int)n, ids, mask);
    int rc = cfg->tpl == LD_TPL_LLAMA3 ? llama3_encode(cfg->tok, msgs, n, ids, mask)
                                       : bt_chat_encode(cfg->tok, BT_CHAT_CHATML, msgs, (int)n, ids, mask);
    if (rc < 0) return rc;
    int32_t bos = bt_tokenizer_bos(cfg->tok);
    if (cfg->add_bos && bos >= 0 && (ids->n == n0 || ids->v[n0] != bos)) {
        if (push2(ids, mask, 0, 0)) return OOM();
        memmove(ids->v + n0 + 1, ids->v + n0, (ids->n - n0 - 1) * sizeof *ids->v);
        memmove(mask->v + n0 + 1, mask->v + n0, (mask->n - n0 - 1) * sizeof *mask->v);
        ids->v[n0] = bos;
        mask->v[n0] = 0;
    }
    return 0;
}

/* A conversation the template refuses (BT_ERR_FORMAT from bt_chat_encode: roles, or tokens that do
 * not line up with the text) is a bad line (`field`), with the template's reason. */
static int template_refusal(int rc, int *reason) {
    if (rc != BT_ERR_FORMAT) return rc;
    char msg[256];
    snprintf(msg, sizeof msg, "%s", bt_last_error());
    return bad(reason, LD_BAD_FIELD, "%s", msg);
}

#define MAX_STACK_MSGS 16

static int format_chat(const ld_format_cfg *cfg, const json_t *root, bt_ids *ids, bt_ids *mask,
                       int *reason) {
    json_t *arr = json_object_get(root, "messages");
    if (!arr) return bad(reason, LD_BAD_FIELD, "missing \"messages\"");
    if (!json_is_array(arr))
        return bad(reason, LD_BAD_FIELD, "\"messages\": expected array, got %s",
                   type_name(arr));
    size_t n = json_array_size(arr);
    if (n == 0) return bad(reason, LD_BAD_EMPTY, "\"messages\" is empty");
    if (n > INT32_MAX) return bad(reason, LD_BAD_FIELD, "too many messages");
    bt_chat_msg stack[MAX_STACK_MSGS];
    bt_chat_msg *msgs = n <= MAX_STACK_MSGS ? stack : malloc(n * sizeof *msgs);
    if (!msgs) return bt_fail(BT_ERR_NOMEM, "format: out of memory (%zu messages)", n);
    int rc = 0, trained = 0;
    for (size_t i = 0; i < n && rc == 0; i++) {
        json_t *m = json_array_get(arr, i);
        if (!json_is_object(m)) {
            rc = bad(reason, LD_BAD_FIELD, "messages[%zu]: expected object, got %s", i,
                     type_name(m));
            break;
        }
        const char *tn = "", *role;
        size_t role_len;
        int g = get_str(m, "role", &role, &role_len, &tn);
        if (g == 0 && strlen(role) != role_len) g = 3;
        if (g != 0) {
            rc = bad(reason, LD_BAD_FIELD, "messages[%zu].role: %s%s", i,
                     g == 1 ? "missing" : g == 2 ? "expected string, got " : "contains NUL", tn);
            break;
        }
        g = get_str(m, "content", &msgs[i].content, &msgs[i].content_len, &tn);
        if (g != 0) {
            rc = bad(reason, LD_BAD_FIELD, "messages[%zu].content: %s%s", i,
                     g == 1 ? "missing" : "expected string, got ", tn);
            break;
        }
        msgs[i].role = role;
        trained += strcmp(role, "assistant") == 0 && msgs[i].content_len > 0;
    }
    if (rc == 0 && !trained)
        rc = bad(reason, LD_BAD_EMPTY, "no assistant message with content");
    if (rc == 0) rc = template_refusal(render_chat(cfg, msgs, n, ids, mask), reason);
    if (msgs != stack) free(msgs);
    return rc;
}

static int format_alpaca(const ld_format_cfg *cfg, const json_t *root, bt_ids *ids, bt_ids *mask,
                         int *reason) {
    const char *ins, *out, *in = "", *tn = "";
    size_t ins_n, out_n, in_n = 0;
    int g = get_str(root, "instruction", &ins, &ins_n, &tn);
    if (g) return bad(reason, LD_BAD_FIELD, "\"instruction\": %s%s",
                      g == 1 ? "missing" : "expected string, got ", tn);
    g = get_str(root, "output", &out, &out_n, &tn);
    if (g) return bad(reason, LD_BAD_FIELD, "\"output\": %s%s",
                      g == 1 ? "missing" : "expected string, got ", tn);
    json_t *iv = json_object_get(root, "input");
    if (iv && !json_is_null(iv)) {
        if (!json_is_string(iv))
            return bad(reason, LD_BAD_FIELD, "\"input\": expected string, got %s",
                       type_name(iv));
        in = json_string_value(iv);
        in_n = json_string_length(iv);
    }
    if (out_n == 0) return bad(reason, LD_BAD_EMPTY, "\"output\" is empty");
    char *user = malloc(ins_n + 2 + in_n + 1);
    if (!user) return bt_fail(BT_ERR_NOMEM, "format: out of memory");
    size_t un = ins_n;
    memcpy(user, ins, ins_n);
    if (in_n) {
        memcpy(user + un, "\n\n", 2);
        memcpy(user + un + 2, in, in_n);
        un += 2 + in_n;
    }
    user[un] = 0;
    bt_chat_msg msgs[2] = {{"user", user, un}, {"assistant", out, out_n}};
    int rc = template_refusal(render_chat(cfg, msgs, 2, ids, mask), reason);
    free(user);
    return rc;
}

static int format_text(const ld_format_cfg *cfg, const json_t *root, bt_ids *ids, bt_ids *mask,
                       int *reason) {
    const char *key = cfg->text_field ? cfg->text_field : "text", *s, *tn = "";
    size_t n;
    int g = get_str(root, key, &s, &n, &tn);
    if (g) return bad(reason, LD_BAD_FIELD, "\"%s\": %s%s", key,
                      g == 1 ? "missing" : "expected string, got ", tn);
    if (n == 0) return bad(reason, LD_BAD_EMPTY, "\"%s\" is empty", key);
    size_t n0 = ids->n;
    int32_t bos = bt_tokenizer_bos(cfg->tok), eos = bt_tokenizer_eos(cfg->tok);
    /* the text itself cannot hold a BOS: special strings are not parsed */
    if (cfg->add_bos && bos >= 0 && bt_ids_try_push(ids, bos)) return OOM();
    int rc = bt_tokenize(cfg->tok, s, n, 0, ids);
    if (rc != BT_OK) return rc;
    if (eos >= 0 && (ids->n == n0 || ids->v[ids->n - 1] != eos) && bt_ids_try_push(ids, eos)) return OOM();
    /* mask: one 1 per id, grown once */
    size_t m0 = mask->n, k = ids->n - n0;
    int32_t *mv = bt_vec_grow(mask->v, &mask->cap, m0 + k, sizeof *mask->v);
    if (!mv) return OOM();
    mask->v = mv;
    for (size_t i = 0; i < k; i++) mask->v[m0 + i] = 1;
    mask->n = m0 + k;
    return 0;
}

int ld_format_render(const ld_format_cfg *cfg, const char *line, size_t len, bt_ids *ids, bt_ids *mask,
                     int *reason) {
    *reason = -1;
    size_t badoff = ld_utf8_check((const uint8_t *)line, len);
    if (badoff != len)
        return bad(reason, LD_BAD_UTF8, "invalid UTF-8 at byte %zu", badoff + 1);
    /* a UTF-8 BOM (a shard saved "with BOM", or files concatenated) is skipped as JSON readers
     * do; a key given twice is refused (common/bt_json.h) */
    size_t bom = bt_utf8_bom_len(line, len);
    json_error_t jerr;
    json_t *root = json_loadb(line + bom, len - bom, JSON_ALLOW_NUL | JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return bad(reason, LD_BAD_JSON, "column %d: %s", jerr.column + (int)bom, jerr.text);
    if (!json_is_object(root)) {
        int r = bad(reason, LD_BAD_JSON, "expected an object, got %s", type_name(root));
        json_decref(root);
        return r;
    }
    size_t n0 = ids->n, m0 = mask->n;
    int rc;
    switch (cfg->format) {
    case LD_FMT_CHAT: rc = format_chat(cfg, root, ids, mask, reason); break;
    case LD_FMT_ALPACA: rc = format_alpaca(cfg, root, ids, mask, reason); break;
    case LD_FMT_TEXT: rc = format_text(cfg, root, ids, mask, reason); break;
    default: rc = bt_fail(BT_ERR_INVALID, "format: unknown format %d", (int)cfg->format); break;
    }
    json_decref(root);
    if (rc == 0 && ids->n - n0 != mask->n - m0)
        rc = bt_fail(BT_ERR_FORMAT, "format: %zu ids but %zu mask entries", ids->n - n0, mask->n - m0);
    if (rc != 0) {
        ids->n = n0;
        mask->n = m0;
    }
    return rc;
}

int ld_format_fit(const ld_format_cfg *cfg, bt_ids *ids, bt_ids *mask, size_t n0, int *truncated, int *reason) {
    *truncated = 0;
    *reason = -1;
    if (ids->n != mask->n || n0 > ids->n)
        return bt_fail(BT_ERR_INVALID, "format: %zu ids, %zu mask entries, document from %zu", ids->n, mask->n, n0);
    int rc = 0;
    if (cfg->format != LD_FMT_TEXT && cfg->T && ids->n - n0 > cfg->T && cfg->overlong_drop) {
        rc = bad(reason, LD_BAD_OVERLONG, "%zu tokens, longer than seq_len %u (overlong: drop)",
                 ids->n - n0, cfg->T);
    } else if (cfg->format != LD_FMT_TEXT && cfg->T && ids->n - n0 > cfg->T) {
        ids->n = n0 + cfg->T;
        mask->n = n0 + cfg->T;
        *truncated = 1;
    }
    if (rc == 0) {
        int any = 0;
        for (size_t i = n0 + 1; i < mask->n && !any; i++) any = mask->v[i] != 0;
        if (!any) {
            *truncated = 0;
            if (cfg->T && ids->n - n0 >= cfg->T)
                rc = bad(reason, LD_BAD_EMPTY,
                         "no tokens with loss within the first %u tokens", cfg->T);
            else
                rc = bad(reason, LD_BAD_EMPTY, "no tokens with loss");
        }
    }
    if (rc != 0) {
        ids->n = n0;
        mask->n = n0;
    }
    return rc;
}

int ld_format_line(const ld_format_cfg *cfg, const char *line, size_t len, bt_ids *ids,
                   bt_ids *mask, int *truncated, int *reason) {
    *truncated = 0;
    size_t n0 = ids->n;
    if (mask->n != n0) return bt_fail(BT_ERR_INVALID, "format: ids and mask differ in length");
    int rc = ld_format_render(cfg, line, len, ids, mask, reason);
    if (rc != 0) return rc;
    return ld_format_fit(cfg, ids, mask, n0, truncated, reason);
}

/* ---------------------------------------------------------------- preference / kto (format.h) */

/* One side of a record (prompt, chosen, rejected, completion) as messages: a string is one
 * message of role `role`, an array is TRL's conversational form. Appends to *msgs (grown with
 * malloc/realloc; *cap its capacity). Returns 0, 1 bad (*reason), or BT_ERR_NOMEM. */
static int side_msgs(const json_t *root, const char *key, const char *role, bt_chat_msg **msgs, size_t *n,
                     size_t *cap, int *reason) {
    json_t *v = json_object_get(root, key);
    if (!v) return bad(reason, LD_BAD_FIELD, "missing \"%s\"", key);
    size_t k = json_is_array(v) ? json_array_size(v) : 1;
    if (!json_is_string(v) && !json_is_array(v))
        return bad(reason, LD_BAD_FIELD, "\"%s\": expected string or array of messages, got %s", key,
                   type_name(v));
    if (k == 0 || (json_is_string(v) && json_string_length(v) == 0))
        return bad(reason, LD_BAD_EMPTY, "\"%s\" is empty", key);
    if (k > INT32_MAX / 4 || *n + k > INT32_MAX / 4) return bad(reason, LD_BAD_FIELD, "\"%s\": too many messages", key);
    if (*n + k > *cap) {
        size_t nc = (*n + k) * 2;
        bt_chat_msg *nm = realloc(*msgs, nc * sizeof *nm);
        if (!nm) return bt_fail(BT_ERR_NOMEM, "format: out of memory (%zu messages)", nc);
        *msgs = nm;
        *cap = nc;
    }
    if (json_is_string(v)) {
        (*msgs)[(*n)++] = (bt_chat_msg){role, json_string_value(v), json_string_length(v)};
        return 0;
    }
    for (size_t i = 0; i < k; i++) {
        json_t *m = json_array_get(v, i);
        if (!json_is_object(m))
            return bad(reason, LD_BAD_FIELD, "\"%s\"[%zu]: expected object, got %s", key, i, type_name(m));
        const char *tn = "", *r;
        size_t rn;
        bt_chat_msg *out = &(*msgs)[*n];
        int g = get_str(m, "role", &r, &rn, &tn);
        if (g == 0 && strlen(r) != rn) g = 3;
        if (g != 0)
            return bad(reason, LD_BAD_FIELD, "\"%s\"[%zu].role: %s%s", key, i,
                       g == 1 ? "missing" : g == 2 ? "expected string, got " : "contains NUL", tn);
        g = get_str(m, "content", &out->content, &out->content_len, &tn);
        if (g != 0)
            return bad(reason, LD_BAD_FIELD, "\"%s\"[%zu].content: %s%s", key, i,
                       g == 1 ? "missing" : "expected string, got ", tn);
        out->role = r;
        (*n)++;
    }
    return 0;
}

/* Render msgs[0..n) into fresh ids/mask (the chat renderer: template, BOS rule). */
static int render_to(const ld_format_cfg *cfg, const bt_chat_msg *msgs, size_t n, bt_ids *ids, bt_ids *mask,
                     int *reason) {
    ids->n = mask->n = 0;
    int rc = template_refusal(render_chat(cfg, msgs, n, ids, mask), reason);
    if (rc == 0 && ids->n != mask->n)
        rc = bt_fail(BT_ERR_FORMAT, "format: %zu ids but %zu mask entries", ids->n, mask->n);
    return rc;
}

static int append_doc(bt_ids *ids, bt_ids *mask, const bt_ids *di, const bt_ids *dm) {
    for (size_t i = 0; i < di->n; i++)
        if (push2(ids, mask, di->v[i], dm->v[i])) return OOM();
    return 0;
}

int ld_format_pref_render(const ld_format_cfg *cfg, const char *line, size_t len, bt_ids *ids, bt_ids *mask,
                          ld_pref_rec *rec, int *reason) {
    *reason = -1;
    memset(rec, 0, sizeof *rec);
    rec->label = -1;
    if (cfg->format != LD_FMT_PREFERENCE && cfg->format != LD_FMT_KTO)
        return bt_fail(BT_ERR_INVALID, "format: ld_format_pref_render on format %d", (int)cfg->format);
    if (ids->n != mask->n) return bt_fail(BT_ERR_INVALID, "format: ids and mask differ in length");
    size_t badoff = ld_utf8_check((const uint8_t *)line, len);
    if (badoff != len) return bad(reason, LD_BAD_UTF8, "invalid UTF-8 at byte %zu", badoff + 1);
    size_t bom = bt_utf8_bom_len(line, len);
    json_error_t jerr;
    json_t *root = json_loadb(line + bom, len - bom, JSON_ALLOW_NUL | JSON_REJECT_DUPLICATES, &jerr);
    if (!root) return bad(reason, LD_BAD_JSON, "column %d: %s", jerr.column + (int)bom, jerr.text);
    size_t n0 = ids->n;
    bt_chat_msg *msgs = NULL;
    size_t nm = 0, cap = 0;
    bt_ids pi = {0}, pm = {0}, di = {0}, dm = {0};
    int rc = 0;
    const int kto = cfg->format == LD_FMT_KTO;
    const char *sides[2] = {kto ? "completion" : "chosen", kto ? NULL : "rejected"};
    if (!json_is_object(root)) rc = bad(reason, LD_BAD_JSON, "expected an object, got %s", type_name(root));
    if (rc == 0 && kto) {
        json_t *lab = json_object_get(root, "label");
        if (!lab) rc = bad(reason, LD_BAD_FIELD, "missing \"label\"");
        else if (!json_is_boolean(lab))
            rc = bad(reason, LD_BAD_FIELD, "\"label\": expected true or false, got %s", type_name(lab));
        else rec->label = json_is_true(lab);
    }
    /* every side present, typed and non-empty before rendering anything */
    for (int s = 0; s < 2 && rc == 0 && sides[s]; s++) {
        size_t scratch = 0;
        rc = side_msgs(root, sides[s], "assistant", &msgs, &scratch, &cap, reason);
    }
    if (rc == 0 && !kto && json_equal(json_object_get(root, "chosen"), json_object_get(root, "rejected")))
        rc = bad(reason, LD_BAD_FIELD, "\"chosen\" and \"rejected\" are identical");
    if (rc == 0) rc = side_msgs(root, "prompt", "user", &msgs, &nm, &cap, reason);
    const size_t np = nm;
    /* the prompt, rendered once: its turns, then the assistant header found below */
    if (rc == 0) rc = render_to(cfg, msgs, np, &pi, &pm, reason);
    uint32_t P = 0;
    for (int s = 0; s < 2 && rc == 0 && sides[s]; s++) {
        nm = np;
        rc = side_msgs(root, sides[s], "assistant", &msgs, &nm, &cap, reason);
        int content = 0; /* as "chat": the end-of-turn token alone is nothing to train on */
        for (size_t i = np; rc == 0 && i < nm; i++)
            content += strcmp(msgs[i].role, "assistant") == 0 && msgs[i].content_len > 0;
        if (rc == 0 && !content) rc = bad(reason, LD_BAD_EMPTY, "\"%s\": no assistant message with content", sides[s]);
        if (rc == 0) rc = render_to(cfg, msgs, nm, &di, &dm, reason);
        if (rc != 0) break;
        int same = di.n > pi.n && memcmp(di.v, pi.v, pi.n * sizeof *pi.v) == 0;
        if (!same) {
            rc = bad(reason, LD_BAD_FIELD, "\"%s\": the template renders the prompt differently once the "
                     "response follows it (the prompt must be a prefix of prompt + response)", sides[s]);
            break;
        }
        size_t p = pi.n;
        while (p < dm.n && dm.v[p] == 0) p++;
        if (p == dm.n) {
            rc = bad(reason, LD_BAD_EMPTY, "\"%s\": no assistant content to train on", sides[s]);
            break;
        }
        for (size_t i = 0; i < p; i++) dm.v[i] = 0; /* assistant turns inside the prompt: no loss */
        if (s == 0) P = (uint32_t)p;
        else if (p != P || memcmp(di.v, ids->v + n0, p * sizeof *di.v) != 0) {
            rc = bad(reason, LD_BAD_FIELD, "\"%s\": its prompt renders differently from \"%s\"'s", sides[s], sides[0]);
            break;
        }
        if (di.n > UINT32_MAX / 4) {
            rc = bad(reason, LD_BAD_OVERLONG, "\"%s\": %zu tokens", sides[s], di.n);
            break;
        }
        rc = append_doc(ids, mask, &di, &dm);
        rec->len[s] = (uint32_t)di.n;
        rec->n_docs = s + 1;
    }
    rec->prompt_len = P;
    free(msgs);
    bt_ids_free(&pi), bt_ids_free(&pm), bt_ids_free(&di), bt_ids_free(&dm);
    json_decref(root);
    if (rc != 0) {
        ids->n = mask->n = n0;
        memset(rec, 0, sizeof *rec);
        rec->label = -1;
    }
    return rc;
}

int ld_format_pref_fit(const ld_format_cfg *cfg, bt_ids *ids, bt_ids *mask, size_t n0, ld_pref_rec *rec,
                       int *reason) {
    *reason = -1;
    size_t tot = 0;
    for (int s = 0; s < rec->n_docs && s < 2; s++) tot += rec->len[s];
    if (ids->n != mask->n || n0 > ids->n || rec->n_docs < 1 || rec->n_docs > 2 || tot != ids->n - n0)
        return bt_fail(BT_ERR_INVALID, "format: preference record does not match ids/mask (%zu ids from %zu, %zu mask)",
                       ids->n, n0, mask->n);
    for (int s = 0; s < rec->n_docs; s++)
        if (rec->len[s] <= rec->prompt_len)
            return bt_fail(BT_ERR_INVALID, "format: preference document %d has no response", s);
    uint32_t P = rec->prompt_len, L = 0, keep_p = P, keep_r = UINT32_MAX;
    for (int s = 0; s < rec->n_docs; s++)
        if (rec->len[s] - P > L) L = rec->len[s] - P;
    const uint32_t ML = cfg->max_length, MP = cfg->max_prompt_length;
    /* TRL DPOTrainer.tokenize_row (v0.11, truncation_mode "keep_end"): prompt first, then responses */
    if (ML && (uint64_t)P + L > ML && MP && P > MP) keep_p = MP;
    if (ML && (uint64_t)keep_p + L > ML) keep_r = MP ? (MP < ML ? ML - MP : 0) : (keep_p < ML ? ML - keep_p : 0);
    int rc = 0;
    if (keep_p != P || keep_r < L) {
        /* rebuild in place: each document = last keep_p prompt tokens + first keep_r response tokens */
        size_t src = n0, dst = n0;
        for (int s = 0; s < rec->n_docs; s++) {
            uint32_t r = rec->len[s] - P, kr = r < keep_r ? r : keep_r;
            memmove(ids->v + dst, ids->v + src + (P - keep_p), (size_t)(keep_p + kr) * sizeof *ids->v);
            memmove(mask->v + dst, mask->v + src + (P - keep_p), (size_t)(keep_p + kr) * sizeof *mask->v);
            src += rec->len[s];
            rec->len[s] = keep_p + kr;
            dst += rec->len[s];
        }
        ids->n = mask->n = dst;
        rec->prompt_len = keep_p;
        rec->truncated = 1;
    }
    for (int s = 0, off = 0; s < rec->n_docs && rc == 0; off += (int)rec->len[s], s++) {
        int any = 0;
        for (uint32_t i = rec->prompt_len; i < rec->len[s] && !any; i++) any = mask->v[n0 + off + i] != 0;
        if (!any)
            rc = bad(reason, LD_BAD_EMPTY, "%s: no loss token left after truncation to max_length %u "
                     "(max_prompt_length %u)", rec->n_docs == 2 ? (s ? "rejected" : "chosen") : "completion", ML, MP);
    }
    tot = ids->n - n0;
    if (rc == 0 && cfg->T && tot > cfg->T)
        rc = bad(reason, LD_BAD_OVERLONG, "%s of %zu tokens does not fit a row of seq_len %u (never split; lower "
                 "max_length / max_prompt_length or raise seq_len)", rec->n_docs == 2 ? "pair" : "record", tot, cfg->T);
    if (rc != 0) ids->n = mask->n = n0;
    return rc;
}
