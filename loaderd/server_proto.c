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

static const char *op_names[LD_OP_N] = {"hello", "attach", "detach", "report", "status", "jobs", "metrics", "drain", "reload"};

const char *ld_op_name(ld_op op) { return (unsigned)op < LD_OP_N ? op_names[op] : "?"; }

const char *ld_op_list(void) { return "hello, attach, detach, report, status, jobs, metrics, drain, reload"; }

static int bad(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int bad(char *err, size_t errlen, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
    return 1;
}

static int hexval(char ch) {
    if (ch >= '0' && ch <= '9') return ch - '0';
    if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F') return ch - 'A' + 10;
    return -1;
}

static int parse_job_id(ld_request *r, char *err, size_t errlen) {
    json_t *id = json_object_get(r->root, "job_id");
    if (!id || json_is_null(id)) return 0;
    if (!json_is_integer(id) || json_integer_value(id) < 0 || json_integer_value(id) > (json_int_t)UINT32_MAX)
        return bad(err, errlen, "\"job_id\": expected a non-negative integer");
    r->has_job_id = 1;
    r->job_id = (uint32_t)json_integer_value(id);
    return 0;
}

static int parse_attach(ld_request *r, char *err, size_t errlen) {
    json_t *jo = json_object_get(r->root, "job");
    json_t *rk = json_object_get(r->root, "rank"), *ws = json_object_get(r->root, "world_size");
    json_t *rs = json_object_get(r->root, "resume"), *run = json_object_get(r->root, "run");
    if (!json_is_object(jo)) return bad(err, errlen, "\"job\": expected the job spec object");
    if (run && !json_is_null(run)) {
        const char *t = json_string_value(run);
        size_t n = t ? json_string_length(run) : 0;
        if (!t || n == 0 || n > LD_RUN_MAX || strspn(t, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                                     "0123456789._:-") != n)
            return bad(err, errlen, "\"run\": expected 1 to %d characters of [A-Za-z0-9._:-]", LD_RUN_MAX);
        memcpy(r->run, t, n + 1);
    }
    if (rk && (!json_is_integer(rk) || json_integer_value(rk) < 0 || json_integer_value(rk) > 65535))
        return bad(err, errlen, "\"rank\": expected an integer in [0, 65535]");
    if (ws && (!json_is_integer(ws) || json_integer_value(ws) < 1 || json_integer_value(ws) > 65536))
        return bad(err, errlen, "\"world_size\": expected an integer in [1, 65536]");
    r->rank = rk ? (uint32_t)json_integer_value(rk) : 0;
    r->world = ws ? (uint32_t)json_integer_value(ws) : 1;
    if (r->rank >= r->world) return bad(err, errlen, "\"rank\" %u must be below \"world_size\" %u", r->rank, r->world);
    if (rs && !json_is_null(rs)) {
        const char *hx = json_string_value(rs);
        if (!hx || json_string_length(rs) != 2 * BT_RESUME_STATE_BYTES)
            return bad(err, errlen, "\"resume\": expected %u hex digits", 2 * BT_RESUME_STATE_BYTES);
        for (unsigned i = 0; i < BT_RESUME_STATE_BYTES; i++) {
            int hi = hexval(hx[2 * i]), lo = hexval(hx[2 * i + 1]);
            if (hi < 0 || lo < 0) return bad(err, errlen, "\"resume\": not a hex string");
            r->resume[i] = (uint8_t)(hi << 4 | lo);
        }
        r->has_resume = 1;
    }
    r->job = jo;
    return 0;
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

static int parse_base(ld_request *r, json_t *b, char *err, size_t errlen) {
    if (!b || json_is_null(b)) return 0;
    json_t *bpw = json_object_get(b, "bits_per_weight"), *by = json_object_get(b, "bytes");
    if (!json_is_object(b) || base_token(json_object_get(b, "dtype"), r->base_dtype, sizeof r->base_dtype) ||
        base_token(json_object_get(b, "types"), r->base_types, sizeof r->base_types) || !json_is_number(bpw) ||
        !(json_number_value(bpw) >= 0 && json_number_value(bpw) <= 64) || !json_is_integer(by) ||
        json_integer_value(by) < 0 || json_integer_value(by) >= (json_int_t)1 << 53)
        return bad(err, errlen, "\"base\": expected {\"dtype\": 1-15 chars, \"types\": 1-63 chars "
                   "(A-Z a-z 0-9 _ + . -), \"bits_per_weight\": 0..64, \"bytes\": integer >= 0}");
    r->base_bpw = json_number_value(bpw);
    r->base_bytes = (uint64_t)json_integer_value(by);
    r->has_base = 1;
    return 0;
}

static int parse_report(ld_request *r, char *err, size_t errlen) {
    json_t *st = json_object_get(r->root, "step"), *lo = json_object_get(r->root, "loss"),
           *tp = json_object_get(r->root, "tokens_per_s");
    if (!json_is_integer(st) || json_integer_value(st) < 0)
        return bad(err, errlen, "\"step\": expected a non-negative integer");
    if ((lo && !json_is_number(lo) && !json_is_null(lo)) || (tp && !json_is_number(tp) && !json_is_null(tp)))
        return bad(err, errlen, "\"loss\" and \"tokens_per_s\": expected numbers (or null)");
    r->step = (uint64_t)json_integer_value(st);
    r->loss = json_is_number(lo) ? json_number_value(lo) : NAN;
    r->tokens_per_s = json_is_number(tp) ? json_number_value(tp) : NAN;
    if (parse_base(r, json_object_get(r->root, "base"), err, errlen)) return 1;
    return parse_job_id(r, err, errlen);
}

/* Client-chosen text reaches operators' terminals (loaderctl status / jobs / metrics labels),
 * loaderd's log and other clients' error messages: every string and every key of a request must
 * be safe text (bt_text_unsafe: no control characters, no bidirectional controls, valid
 * UTF-8), whatever op it belongs to. where: the JSON path so far ("job.datasets[0].shards[2]",
 * in a buffer of cap bytes, len used). 0, or 1 with err naming the path and the character. */
static int unsafe_text(const char *what, const char *s, size_t n, const char *where, char *err, size_t errlen) {
    int32_t cp;
    size_t off = bt_text_unsafe(s, n, &cp);
    if (off == n) return 0;
    char ch[40];
    if (cp < 0) snprintf(ch, sizeof ch, "byte 0x%02x (not UTF-8)", (unsigned)(-cp - 1) & 0xFFu);
    else snprintf(ch, sizeof ch, "U+%04X", (unsigned)cp);
    return bad(err, errlen, "%s%s%s holds a control character (%s at byte %zu): names, paths and other strings may not "
               "hold control or bidirectional-control characters", what, where[0] ? " " : "", where, ch, off);
}

static int check_text(json_t *v, char *where, size_t cap, size_t len, char *err, size_t errlen) {
    if (json_is_string(v)) {
        char w[300];
        snprintf(w, sizeof w, "\"%s\"", where);
        return unsafe_text("request: string", json_string_value(v), json_string_length(v), w, err, errlen);
    }
    if (json_is_array(v)) {
        size_t i;
        json_t *x;
        json_array_foreach(v, i, x) {
            int k = snprintf(where + len, cap - len, "[%zu]", i);
            size_t l2 = len + (k > 0 && (size_t)k < cap - len ? (size_t)k : 0);
            if (check_text(x, where, cap, l2, err, errlen)) return 1;
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
            if (unsafe_text("request: a key", key, klen, w, err, errlen)) return 1;
            int k = snprintf(where + len, cap - len, "%s%s", len ? "." : "", key);
            size_t l2 = len + (k > 0 && (size_t)k < cap - len ? (size_t)k : 0);
            if (check_text(x, where, cap, l2, err, errlen)) return 1;
            where[len] = 0;
        }
    }
    return 0;
}

int ld_request_parse(ld_request *r, const char *p, size_t n, unsigned max_depth, char *err, size_t errlen) {
    memset(r, 0, sizeof *r);
    r->op = LD_OP_N;
    r->loss = r->tokens_per_s = NAN;
    if (errlen) err[0] = 0;
    if (!ld_json_depth_ok(p, n, max_depth)) return bad(err, errlen, "request nested deeper than %u levels", max_depth);
    if (bt_json_loadb(&r->root, p, n, 0, "request")) return bad(err, errlen, "%s", bt_last_error());
    if (!json_is_object(r->root)) return bad(err, errlen, "request must be a JSON object");
    char where[256] = "";
    if (check_text(r->root, where, sizeof where, 0, err, errlen)) return 1; /* before "op" is taken */
    json_t *v = json_object_get(r->root, "v");
    r->op_name = json_string_value(json_object_get(r->root, "op"));
    if (r->op_name)
        for (int i = 0; i < LD_OP_N; i++)
            if (!strcmp(r->op_name, op_names[i])) r->op = (ld_op)i;
    if (!json_is_integer(v) || json_integer_value(v) != BT_PROTO_VERSION)
        return bad(err, errlen, "unsupported or missing protocol version \"v\" (this loaderd speaks %d)",
                   BT_PROTO_VERSION);
    if (!r->op_name) return bad(err, errlen, "missing \"op\" (%s)", ld_op_list());
    switch (r->op) {
    case LD_OP_ATTACH: return parse_attach(r, err, errlen);
    case LD_OP_DETACH: return parse_job_id(r, err, errlen);
    case LD_OP_REPORT: return parse_report(r, err, errlen);
    case LD_OP_N: return bad(err, errlen, "unknown op (%s)", ld_op_list());
    default: return 0;
    }
}

void ld_request_free(ld_request *r) {
    json_decref(r->root);
    r->root = NULL;
    r->job = NULL;
    r->op_name = NULL;
}
