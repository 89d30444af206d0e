/* loaderd formats: JSONL line -> (ids, mask). See format.h. */
#include "loaderd/format.h"

#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
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

static int bad(int *reason, int r, char *msg, size_t msglen, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static int bad(int *reason, int r, char *msg, size_t msglen, const char *fmt, ...) {
    *reason = r;
    if (msglen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, msglen, fmt, ap);
        va_end(ap);
    }
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

#define MAX_STACK_MSGS 16

static int format_chat(const ld_format_cfg *cfg, const json_t *root, bt_ids *ids, bt_ids *mask,
                       int *reason, char *msg, size_t msglen) {
    json_t *arr = json_object_get(root, "messages");
    if (!arr) return bad(reason, LD_BAD_FIELD, msg, msglen, "missing \"messages\"");
    if (!json_is_array(arr))
        return bad(reason, LD_BAD_FIELD, msg, msglen, "\"messages\": expected array, got %s",
                   type_name(arr));
    size_t n = json_array_size(arr);
    if (n == 0) return bad(reason, LD_BAD_EMPTY, msg, msglen, "\"messages\" is empty");
    if (n > INT32_MAX) return bad(reason, LD_BAD_FIELD, msg, msglen, "too many messages");
    bt_chat_msg stack[MAX_STACK_MSGS];
    bt_chat_msg *msgs = n <= MAX_STACK_MSGS ? stack : malloc(n * sizeof *msgs);
    if (!msgs) return bt_fail(BT_ERR_NOMEM, "format: out of memory (%zu messages)", n);
    int rc = 0, trained = 0;
    for (size_t i = 0; i < n && rc == 0; i++) {
        json_t *m = json_array_get(arr, i);
        if (!json_is_object(m)) {
            rc = bad(reason, LD_BAD_FIELD, msg, msglen, "messages[%zu]: expected object, got %s", i,
                     type_name(m));
            break;
        }
        const char *tn = "", *role;
        size_t role_len;
        int g = get_str(m, "role", &role, &role_len, &tn);
        if (g == 0 && strlen(role) != role_len) g = 3;
        if (g != 0) {
            rc = bad(reason, LD_BAD_FIELD, msg, msglen, "messages[%zu].role: %s%s", i,
                     g == 1 ? "missing" : g == 2 ? "expected string, got " : "contains NUL", tn);
            break;
        }
        g = get_str(m, "content", &msgs[i].content, &msgs[i].content_len, &tn);
        if (g != 0) {
            rc = bad(reason, LD_BAD_FIELD, msg, msglen, "messages[%zu].content: %s%s", i,
                     g == 1 ? "missing" : "expected string, got ", tn);
            break;
        }
        msgs[i].role = role;
        trained += strcmp(role, "assistant") == 0 && msgs[i].content_len > 0;
    }
    if (rc == 0 && !trained)
        rc = bad(reason, LD_BAD_EMPTY, msg, msglen, "no assistant message with content");
    if (rc == 0) rc = bt_chat_encode(cfg->tok, BT_CHAT_CHATML, msgs, (int)n, ids, mask);
    if (msgs != stack) free(msgs);
    return rc;
}

static int format_alpaca(const ld_format_cfg *cfg, const json_t *root, bt_ids *ids, bt_ids *mask,
                         int *reason, char *msg, size_t msglen) {
    const char *ins, *out, *in = "", *tn = "";
    size_t ins_n, out_n, in_n = 0;
    int g = get_str(root, "instruction", &ins, &ins_n, &tn);
    if (g) return bad(reason, LD_BAD_FIELD, msg, msglen, "\"instruction\": %s%s",
                      g == 1 ? "missing" : "expected string, got ", tn);
    g = get_str(root, "output", &out, &out_n, &tn);
    if (g) return bad(reason, LD_BAD_FIELD, msg, msglen, "\"output\": %s%s",
                      g == 1 ? "missing" : "expected string, got ", tn);
    json_t *iv = json_object_get(root, "input");
    if (iv && !json_is_null(iv)) {
        if (!json_is_string(iv))
            return bad(reason, LD_BAD_FIELD, msg, msglen, "\"input\": expected string, got %s",
                       type_name(iv));
        in = json_string_value(iv);
        in_n = json_string_length(iv);
    }
    if (out_n == 0) return bad(reason, LD_BAD_EMPTY, msg, msglen, "\"output\" is empty");
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
    int rc = bt_chat_encode(cfg->tok, BT_CHAT_CHATML, msgs, 2, ids, mask);
    free(user);
    return rc;
}

static int format_text(const ld_format_cfg *cfg, const json_t *root, bt_ids *ids, bt_ids *mask,
                       int *reason, char *msg, size_t msglen) {
    const char *key = cfg->text_field ? cfg->text_field : "text", *s, *tn = "";
    size_t n;
    int g = get_str(root, key, &s, &n, &tn);
    if (g) return bad(reason, LD_BAD_FIELD, msg, msglen, "\"%s\": %s%s", key,
                      g == 1 ? "missing" : "expected string, got ", tn);
    if (n == 0) return bad(reason, LD_BAD_EMPTY, msg, msglen, "\"%s\" is empty", key);
    size_t n0 = ids->n;
    int rc = bt_tokenize(cfg->tok, s, n, 0, ids);
    if (rc != BT_OK) return rc;
    int32_t eos = bt_tokenizer_eos(cfg->tok);
    if (eos >= 0) bt_ids_push(ids, eos);
    for (size_t i = n0; i < ids->n; i++) bt_ids_push(mask, 1);
    return 0;
}

int ld_format_line(const ld_format_cfg *cfg, const char *line, size_t len, bt_ids *ids,
                   bt_ids *mask, int *truncated, int *reason, char *msg, size_t msglen) {
    *truncated = 0;
    *reason = -1;
    if (msglen) msg[0] = 0;
    size_t badoff = ld_utf8_check((const uint8_t *)line, len);
    if (badoff != len)
        return bad(reason, LD_BAD_UTF8, msg, msglen, "invalid UTF-8 at byte %zu", badoff + 1);
    json_error_t jerr;
    json_t *root = json_loadb(line, len, JSON_ALLOW_NUL, &jerr);
    if (!root)
        return bad(reason, LD_BAD_JSON, msg, msglen, "column %d: %s", jerr.column, jerr.text);
    if (!json_is_object(root)) {
        int r = bad(reason, LD_BAD_JSON, msg, msglen, "expected an object, got %s", type_name(root));
        json_decref(root);
        return r;
    }
    size_t n0 = ids->n, m0 = mask->n;
    int rc;
    switch (cfg->format) {
    case LD_FMT_CHAT: rc = format_chat(cfg, root, ids, mask, reason, msg, msglen); break;
    case LD_FMT_ALPACA: rc = format_alpaca(cfg, root, ids, mask, reason, msg, msglen); break;
    case LD_FMT_TEXT: rc = format_text(cfg, root, ids, mask, reason, msg, msglen); break;
    default: rc = bt_fail(BT_ERR_INVALID, "format: unknown format %d", (int)cfg->format); break;
    }
    json_decref(root);
    if (rc == 0 && ids->n - n0 != mask->n - m0)
        rc = bt_fail(BT_ERR_FORMAT, "format: %zu ids but %zu mask entries", ids->n - n0, mask->n - m0);
    if (rc == 0 && cfg->format != LD_FMT_TEXT && cfg->T && ids->n - n0 > cfg->T) {
        ids->n = n0 + cfg->T;
        mask->n = m0 + cfg->T;
        *truncated = 1;
    }
    if (rc == 0) {
        int any = 0;
        for (size_t i = m0 + 1; i < mask->n && !any; i++) any = mask->v[i] != 0;
        if (!any) {
            *truncated = 0;
            if (cfg->T && ids->n - n0 >= cfg->T)
                rc = bad(reason, LD_BAD_EMPTY, msg, msglen,
                         "no tokens with loss within the first %u tokens", cfg->T);
            else
                rc = bad(reason, LD_BAD_EMPTY, msg, msglen, "no tokens with loss");
        }
    }
    if (rc != 0) {
        ids->n = n0;
        mask->n = m0;
    }
    return rc;
}
