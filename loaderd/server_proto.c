/* loaderd control protocol request parsing (contract: loaderd/server_proto.h). */
#include "loaderd/server_proto.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "loaderd/config.h"
#include "common/bt_common.h"
#include "common/bt_json.h"
#include "proto/client.h"

const char *ld_command_list(const ld_command *table, char *buf, size_t cap) {
    size_t used = 0;
    if (cap) buf[0] = 0;
    for (const ld_command *c = table; c && c->name && used + 1 < cap; c++) {
        int k = snprintf(buf + used, cap - used, "%s%s", c == table ? "" : ", ", c->name);
        if (k < 0) break;
        used += (size_t)k;
    }
    return buf;
}

static int bad(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int bad(const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return bt_fail(BT_ERR_INVALID, "%s", msg);
}

static int hexval(char ch) {
    if (ch >= '0' && ch <= '9') return ch - '0';
    if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F') return ch - 'A' + 10;
    return -1;
}

int ld_parse_detach(ld_request *r) {
    json_t *id = NULL;
    json_unpack_ex(r->root, NULL, 0, "{s?o}", "job_id", &id);
    if (!id || json_is_null(id)) return BT_OK;
    if (!json_is_integer(id) || json_integer_value(id) < 0 || json_integer_value(id) > (json_int_t)UINT32_MAX)
        return bad("\"job_id\": expected a non-negative integer");
    r->has_job_id = 1;
    r->job_id = (uint32_t)json_integer_value(id);
    return BT_OK;
}

int ld_parse_attach(ld_request *r) {
    json_t *jo = NULL, *rk = NULL, *ws = NULL, *rs = NULL, *run = NULL, *rw = NULL; /* the shape: all optional here */
    json_unpack_ex(r->root, NULL, 0, "{s?o, s?o, s?o, s?o, s?o, s?o}", "job", &jo, "rank", &rk, "world_size", &ws,
                   "resume", &rs, "run", &run, "resume_world", &rw);
    if (!json_is_object(jo)) return bad("\"job\": expected the job spec object");
    if (run && !json_is_null(run)) {
        const char *t = json_string_value(run);
        size_t n = t ? json_string_length(run) : 0;
        if (!t || n == 0 || n > LD_RUN_MAX || strspn(t, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                                     "0123456789._:-") != n)
            return bad("\"run\": expected 1 to %d characters of [A-Za-z0-9._:-]", LD_RUN_MAX);
        memcpy(r->run, t, n + 1);
    }
    if (rk && (!json_is_integer(rk) || json_integer_value(rk) < 0 || json_integer_value(rk) > 65535))
        return bad("\"rank\": expected an integer in [0, 65535]");
    if (ws && (!json_is_integer(ws) || json_integer_value(ws) < 1 || json_integer_value(ws) > 65536))
        return bad("\"world_size\": expected an integer in [1, 65536]");
    r->rank = rk ? (uint32_t)json_integer_value(rk) : 0;
    r->world = ws ? (uint32_t)json_integer_value(ws) : 1;
    if (r->rank >= r->world) return bad("\"rank\" %u must be below \"world_size\" %u", r->rank, r->world);
    if (rs && !json_is_null(rs)) {
        const char *hx = json_string_value(rs);
        if (!hx || json_string_length(rs) != 2 * BT_RESUME_STATE_BYTES)
            return bad("\"resume\": expected %u hex digits", 2 * BT_RESUME_STATE_BYTES);
        for (unsigned i = 0; i < BT_RESUME_STATE_BYTES; i++) {
            int hi = hexval(hx[2 * i]), lo = hexval(hx[2 * i + 1]);
            if (hi < 0 || lo < 0) return bad("\"resume\": not a hex string");
            r->resume[i] = (uint8_t)(hi << 4 | lo);
        }
        r->has_resume = 1;
    }
    if (rw && !json_is_null(rw)) {
        if (!json_is_integer(rw) || json_integer_value(rw) < 1 || json_integer_value(rw) > 65536)
            return bad("\"resume_world\": expected an integer in [1, 65536]");
        if (!r->has_resume) return bad("\"resume_world\" needs a \"resume\" state");
        r->resume_world = (uint32_t)json_integer_value(rw);
    }
    r->job = jo;
    return BT_OK;
}

/* a "base" string: 1..cap-1 bytes of [A-Za-z0-9_+.-] (shown on operators' terminals) */
static int base_token(json_t *v, char *dst, size_t cap) {
    const char *s = json_string_value(v);
    if (!s || json_string_length(v) < 1 || json_string_length(v) >= cap) return -1;
    for (size_t i = 0; i < json_string_length(v); i++) {
        const char ch = s[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
              ch == '_' || ch == '+' || ch == '.' || ch == '-'))
            return -1;
    }
    memcpy(dst, s, json_string_length(v) + 1);
    return 0;
}

#define BASE_SHAPE                                                                                            \
    "\"base\": expected {\"dtype\": 1-15 chars, \"types\": 1-63 chars (A-Z a-z 0-9 _ + . -), "                 \
    "\"bits_per_weight\": 0..64, \"bytes\": integer >= 0}"

/* "base": exactly four keys (json_unpack_ex with '!': a key more or less is refused, named by
 * jansson's message), then the values' ranges. */
static int parse_base(ld_request *r, json_t *b) {
    if (!b || json_is_null(b)) return BT_OK;
    json_t *dt = NULL, *ty = NULL;
    double bpw = 0;
    json_int_t by = 0;
    json_error_t e;
    if (json_unpack_ex(b, &e, 0, "{s:o, s:o, s:F, s:I !}", "dtype", &dt, "types", &ty, "bits_per_weight", &bpw,
                       "bytes", &by))
        return bad(BASE_SHAPE " (%s)", e.text);
    if (base_token(dt, r->base_dtype, sizeof r->base_dtype) || base_token(ty, r->base_types, sizeof r->base_types) ||
        !(bpw >= 0 && bpw <= 64) || by < 0 || by >= (json_int_t)1 << 53)
        return bad(BASE_SHAPE);
    r->base_bpw = bpw;
    r->base_bytes = (uint64_t)by;
    r->has_base = 1;
    return BT_OK;
}

int ld_parse_report(ld_request *r) {
    json_t *st = NULL, *lo = NULL, *tp = NULL, *base = NULL;
    json_unpack_ex(r->root, NULL, 0, "{s?o, s?o, s?o, s?o}", "step", &st, "loss", &lo, "tokens_per_s", &tp, "base",
                   &base);
    if (!json_is_integer(st) || json_integer_value(st) < 0)
        return bad("\"step\": expected a non-negative integer");
    if ((lo && !json_is_number(lo) && !json_is_null(lo)) || (tp && !json_is_number(tp) && !json_is_null(tp)))
        return bad("\"loss\" and \"tokens_per_s\": expected numbers (or null)");
    r->step = (uint64_t)json_integer_value(st);
    r->loss = json_is_number(lo) ? json_number_value(lo) : NAN;
    r->tokens_per_s = json_is_number(tp) ? json_number_value(tp) : NAN;
    if (parse_base(r, base)) return BT_ERR_INVALID;
    return ld_parse_detach(r); /* "job_id", as detach */
}

int ld_parse_ref_put(ld_request *r) {
    json_t *b = NULL, *v = NULL;
    json_unpack_ex(r->root, NULL, 0, "{s?o, s?o}", "base", &b, "values", &v);
    if (!json_is_string(b) || json_string_length(b) < 1 || json_string_length(b) > 128)
        return bad("\"base\": expected the job's ref_base (a string of 1..128 characters)");
    if (!json_is_array(v) || json_array_size(v) > LD_REF_PUT_MAX)
        return bad("\"values\": expected an array of at most %d [shard, line, side, logp] entries", LD_REF_PUT_MAX);
    r->ref_base = json_string_value(b);
    r->ref_values = v;
    return ld_parse_detach(r); /* "job_id", as detach */
}

/* Client-chosen text reaches operators' terminals (loaderctl status / jobs / metrics labels),
 * loaderd's log and other clients' error messages: every string and every key of a request must
 * be safe text (bt_text_unsafe: no control characters, no bidirectional controls, valid
 * UTF-8), whatever op it belongs to. where: the JSON path so far ("job.datasets[0].shards[2]",
 * in a buffer of cap bytes, len used). 0, or 1 with err naming the path and the character. */
static int unsafe_text(const char *what, const char *s, size_t n, const char *where) {
    int32_t cp;
    size_t off = bt_text_unsafe(s, n, &cp);
    if (off == n) return BT_OK;
    char ch[40];
    if (cp < 0) snprintf(ch, sizeof ch, "byte 0x%02x (not UTF-8)", (unsigned)(-cp - 1) & 0xFFu);
    else snprintf(ch, sizeof ch, "U+%04X", (unsigned)cp);
    return bad("%s%s%s holds a control character (%s at byte %zu): names, paths and other strings may not "
               "hold control or bidirectional-control characters", what, where[0] ? " " : "", where, ch, off);
}

static int check_text(json_t *v, char *where, size_t cap, size_t len) {
    if (json_is_string(v)) {
        char w[300];
        snprintf(w, sizeof w, "\"%s\"", where);
        return unsafe_text("request: string", json_string_value(v), json_string_length(v), w);
    }
    if (json_is_array(v)) {
        size_t i;
        json_t *x;
        json_array_foreach(v, i, x) {
            int k = snprintf(where + len, cap - len, "[%zu]", i);
            size_t l2 = len + (k > 0 && (size_t)k < cap - len ? (size_t)k : 0);
            if (check_text(x, where, cap, l2)) return BT_ERR_INVALID;
            where[len] = 0;
        }
        return 0;
    }
    if (json_is_object(v)) {
        const char *key;
        size_t klen;
        json_t *x;
        json_object_keylen_foreach(v, key, klen, x) {
            char w[300];
            snprintf(w, sizeof w, "inside \"%s\"", len ? where : "(the request)");
            if (unsafe_text("request: a key", key, klen, w)) return BT_ERR_INVALID;
            int k = snprintf(where + len, cap - len, "%s%s", len ? "." : "", key);
            size_t l2 = len + (k > 0 && (size_t)k < cap - len ? (size_t)k : 0);
            if (check_text(x, where, cap, l2)) return BT_ERR_INVALID;
            where[len] = 0;
        }
    }
    return 0;
}

int ld_request_parse(ld_request *r, const ld_command *table, const char *p, size_t n, unsigned max_depth) {
    memset(r, 0, sizeof *r);
    r->loss = r->tokens_per_s = NAN;
    if (!ld_json_depth_ok(p, n, max_depth)) return bad("request nested deeper than %u levels", max_depth);
    if (bt_json_loadb(&r->root, p, n, 0, "request")) return bad("%s", bt_last_error());
    if (!json_is_object(r->root)) return bad("request must be a JSON object");
    char where[256] = "";
    if (check_text(r->root, where, sizeof where, 0)) return BT_ERR_INVALID; /* before "op" is taken */
    json_t *v = json_object_get(r->root, "v");
    r->op_name = json_string_value(json_object_get(r->root, "op"));
    for (const ld_command *c = table; r->op_name && c->name && !r->cmd; c++)
        if (!strcmp(r->op_name, c->name)) r->cmd = c;
    char ops[256];
    if (!json_is_integer(v) || json_integer_value(v) != BT_PROTO_VERSION)
        return bad("unsupported or missing protocol version \"v\" (this loaderd speaks %d)", BT_PROTO_VERSION);
    if (!r->op_name) return bad("missing \"op\" (%s)", ld_command_list(table, ops, sizeof ops));
    if (!r->cmd) return bad("unknown op (%s)", ld_command_list(table, ops, sizeof ops));
    return r->cmd->parse ? r->cmd->parse(r) : BT_OK;
}

void ld_request_free(ld_request *r) {
    json_decref(r->root);
    r->root = NULL;
    r->job = NULL;
    r->op_name = NULL;
    r->cmd = NULL;
}
