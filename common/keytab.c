/* Declarative key tables (contract: common/keytab.h). */
#include "common/keytab.h"

#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "common/bt_vec.h"

static void *field(const bt_key *k, void *dst) { return (char *)dst + k->off; }
static const void *cfield(const bt_key *k, const void *src) { return (const char *)src + k->off; }

static void key_path(bt_keypath *p, const char *prefix, const char *name) {
    snprintf(p->s, sizeof p->s, "%s%s%s", prefix && *prefix ? prefix : "", prefix && *prefix ? "." : "", name);
}

static int fail_key(const char *path, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail_key(const char *path, const char *fmt, ...) {
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return bt_fail(BT_ERR_INVALID, "\"%s\": %s", path, msg);
}

const char *bt_keytab_what(const bt_key *k, char *buf, size_t cap) {
    switch (k->type) {
    case BT_KEY_INT: snprintf(buf, cap, "an integer in [%" PRId64 ", %" PRId64 "]", k->ilo, k->ihi); break;
    case BT_KEY_NUM:
        snprintf(buf, cap, "a number in %c%.15g, %.15g%c", k->flags & BT_KEY_LO_OPEN ? '(' : '[', k->nlo, k->nhi,
                 k->flags & BT_KEY_HI_OPEN ? ')' : ']');
        break;
    case BT_KEY_BOOL: snprintf(buf, cap, "true or false"); break;
    case BT_KEY_STR:
        if (k->ihi > 0) snprintf(buf, cap, "a string of %" PRId64 "..%" PRId64 " bytes", k->ilo, k->ihi);
        else snprintf(buf, cap, "a%s string", k->ilo > 0 ? " non-empty" : "");
        break;
    case BT_KEY_ENUM: {
        size_t used = 0, n = 0;
        while (k->names[n]) n++;
        buf[0] = 0;
        for (size_t i = 0; i < n && used < cap; i++)
            used += (size_t)snprintf(buf + used, cap - used, "%s\"%s\"", i == 0 ? "" : i + 1 == n ? " or " : ", ",
                                     k->names[i]);
        break;
    }
    case BT_KEY_CUSTOM: snprintf(buf, cap, "see the meaning"); break;
    }
    return buf;
}

static int parse_int(const bt_key *k, json_t *v, void *dst, const char *path) {
    char what[128];
    if (!json_is_integer(v)) return fail_key(path, "expected %s", bt_keytab_what(k, what, sizeof what));
    json_int_t x = json_integer_value(v);
    if (x < k->ilo || x > k->ihi)
        return fail_key(path, "%lld is out of range [%" PRId64 ", %" PRId64 "]", (long long)x, k->ilo, k->ihi);
    if (k->flags & BT_KEY_NO_FIELD) return BT_OK;
    if (k->size == 4) {
        uint32_t u = (uint32_t)(int64_t)x; /* in range: the same bits for int32_t and uint32_t */
        memcpy(field(k, dst), &u, 4);
    } else {
        int64_t s = (int64_t)x;
        memcpy(field(k, dst), &s, 8);
    }
    return BT_OK;
}

static int parse_num(const bt_key *k, json_t *v, void *dst, const char *path) {
    char what[128];
    double x = json_number_value(v);
    int lo_ok = k->flags & BT_KEY_LO_OPEN ? x > k->nlo : x >= k->nlo;
    int hi_ok = k->flags & BT_KEY_HI_OPEN ? x < k->nhi : x <= k->nhi;
    if (!json_is_number(v) || !lo_ok || !hi_ok) return fail_key(path, "expected %s", bt_keytab_what(k, what, sizeof what));
    if (!(k->flags & BT_KEY_NO_FIELD)) memcpy(field(k, dst), &x, sizeof x);
    return BT_OK;
}

static int parse_str(const bt_key *k, json_t *v, void *dst, const char *path) {
    char what[128];
    const char *s = json_string_value(v);
    size_t n = s ? json_string_length(v) : 0;
    if (!s || strlen(s) != n || (int64_t)n < k->ilo || (k->ihi > 0 && (int64_t)n > k->ihi))
        return fail_key(path, "expected %s", bt_keytab_what(k, what, sizeof what));
    if (k->flags & BT_KEY_SAFE_TEXT) { /* names and paths reach terminals, log lines and metric labels */
        int32_t cp;
        size_t off = bt_text_unsafe(s, n, &cp);
        if (off < n)
            return fail_key(path, "holds a control character (%s%04X at byte %zu): names and paths may not hold control "
                            "or bidirectional-control characters", cp < 0 ? "byte 0x" : "U+",
                            (unsigned)(cp < 0 ? -cp - 1 : cp), off);
    }
    if (k->flags & BT_KEY_NO_FIELD) return BT_OK;
    char **f = field(k, dst);
    free(*f);
    *f = bt_xstrdup(s);
    return BT_OK;
}

static int parse_enum(const bt_key *k, json_t *v, void *dst, const char *path) {
    char what[256];
    const char *s = json_string_value(v);
    for (int i = 0; s && k->names[i]; i++)
        if (!strcmp(s, k->names[i])) {
            int x = k->values ? k->values[i] : i;
            if (!(k->flags & BT_KEY_NO_FIELD)) memcpy(field(k, dst), &x, sizeof x);
            return BT_OK;
        }
    return fail_key(path, "expected %s", bt_keytab_what(k, what, sizeof what));
}

/* One row's value; path: its full path. */
static int parse_row(const bt_key *k, json_t *v, void *dst, const char *path, bt_keypath *bad) {
    int rc;
    switch (k->type) {
    case BT_KEY_INT: rc = parse_int(k, v, dst, path); break;
    case BT_KEY_NUM: rc = parse_num(k, v, dst, path); break;
    case BT_KEY_BOOL:
        if (!json_is_boolean(v)) return fail_key(path, "expected true or false");
        if (!(k->flags & BT_KEY_NO_FIELD)) *(int *)field(k, dst) = json_is_true(v);
        rc = BT_OK;
        break;
    case BT_KEY_STR: rc = parse_str(k, v, dst, path); break;
    case BT_KEY_ENUM: rc = parse_enum(k, v, dst, path); break;
    case BT_KEY_CUSTOM: rc = k->parse(k, v, dst, path, bad); break;
    default: rc = bt_fail(BT_ERR_INVALID, "\"%s\": unknown key type %d", path, (int)k->type); break;
    }
    return rc;
}

int bt_keytab_parse_value(const bt_key *k, json_t *v, void *dst, const char *path, bt_keypath *bad) {
    bt_keypath scratch;
    if (!bad) bad = &scratch;
    snprintf(bad->s, sizeof bad->s, "%s", path);
    return parse_row(k, v, dst, path, bad);
}

int bt_keytab_defaults(const bt_key *tab, void *dst) {
    for (const bt_key *k = tab; k->name; k++) {
        if (!k->def) continue;
        json_error_t e;
        json_t *v = json_loads(k->def, JSON_DECODE_ANY, &e);
        if (!v) return bt_fail(BT_ERR_INVALID, "\"%s\": default %s is not JSON: %s", k->name, k->def, e.text);
        bt_keypath bad;
        snprintf(bad.s, sizeof bad.s, "%s", k->name);
        int rc = parse_row(k, v, dst, k->name, &bad);
        json_decref(v);
        if (rc) return bt_fail(rc, "default of %s", bt_last_error());
    }
    return BT_OK;
}

const char *bt_keytab_names(const bt_key *tab, char *buf, size_t cap) {
    size_t used = 0;
    if (cap) buf[0] = 0;
    for (const bt_key *k = tab; k->name && used + 1 < cap; k++) {
        int w = snprintf(buf + used, cap - used, "%s%s", k == tab ? "" : ", ", k->name);
        if (w < 0) break;
        used += (size_t)w;
    }
    return buf;
}

int bt_keytab_parse(const bt_key *tab, json_t *o, void *dst, const char *origin, const char *prefix,
                    int allow_comments, bt_keypath *bad) {
    bt_keypath path, scratch;
    if (!bad) bad = &scratch;
    bad->s[0] = 0;
    int rc = BT_OK;
    if (!json_is_object(o)) {
        snprintf(bad->s, sizeof bad->s, "%s", prefix ? prefix : "");
        rc = prefix && *prefix ? fail_key(prefix, "expected an object") : bt_fail(BT_ERR_INVALID, "expected a JSON object");
    }
    const char *key;
    json_t *v;
    if (rc == BT_OK) json_object_foreach(o, key, v) {
        if (allow_comments && key[0] == '#') continue;
        key_path(&path, prefix, key);
        const bt_key *k = tab;
        while (k->name && strcmp(k->name, key)) k++;
        if (!k->name) {
            char known[1024];
            snprintf(bad->s, sizeof bad->s, "%s", path.s);
            rc = bt_fail(BT_ERR_INVALID, "unknown key \"%s\" (known: %s)", path.s, bt_keytab_names(tab, known, sizeof known));
            break;
        }
        snprintf(bad->s, sizeof bad->s, "%s", path.s);
        if ((rc = parse_row(k, v, dst, path.s, bad))) break;
        bad->s[0] = 0;
    }
    for (const bt_key *k = tab; rc == BT_OK && k->name; k++)
        if ((k->flags & BT_KEY_REQUIRED) && !json_object_get(o, k->name)) {
            key_path(bad, prefix, k->name);
            rc = fail_key(bad->s, "required: %s", k->doc);
        }
    if (rc && origin && *origin) rc = bt_fail(rc, "%s: %s", origin, bt_last_error());
    return rc;
}

void bt_keytab_free(const bt_key *tab, void *dst) {
    for (const bt_key *k = tab; k->name; k++) {
        if (k->flags & BT_KEY_NO_FIELD) continue;
        if (k->type == BT_KEY_STR) {
            char **f = field(k, dst);
            free(*f);
            *f = NULL;
        } else if (k->type == BT_KEY_CUSTOM && k->release) {
            k->release(k, dst);
        }
    }
}

json_t *bt_keytab_value(const bt_key *k, const void *src) {
    if (k->flags & BT_KEY_NO_FIELD) return NULL;
    const void *f = cfield(k, src);
    switch (k->type) {
    case BT_KEY_INT:
        if (k->size == 4) {
            if (k->ilo < 0) {
                int32_t x;
                memcpy(&x, f, 4);
                return json_integer(x);
            }
            uint32_t x;
            memcpy(&x, f, 4);
            return json_integer((json_int_t)x);
        } else {
            int64_t x;
            memcpy(&x, f, 8);
            return json_integer((json_int_t)x);
        }
    case BT_KEY_NUM: return json_real(*(const double *)f);
    case BT_KEY_BOOL: return json_boolean(*(const int *)f);
    case BT_KEY_STR: return *(char *const *)f ? json_string(*(char *const *)f) : json_null();
    case BT_KEY_ENUM: {
        int x = *(const int *)f;
        for (int i = 0; k->names[i]; i++)
            if ((k->values ? k->values[i] : i) == x) return json_string(k->names[i]);
        return json_integer(x);
    }
    case BT_KEY_CUSTOM: return k->dump ? k->dump(k, src) : NULL;
    }
    return NULL;
}

json_t *bt_keytab_dump(const bt_key *tab, const void *src) {
    json_t *o = json_object();
    for (const bt_key *k = tab; k->name; k++) {
        json_t *v = bt_keytab_value(k, src);
        if (v) json_object_set_new(o, k->name, v);
    }
    return o;
}

/* A value for a log line: strings bare, arrays comma-joined, null "(none)". */
static void render(json_t *v, bt_buf *b) {
    if (!v || json_is_null(v)) {
        bt_buf_str(b, "(none)");
    } else if (json_is_string(v)) {
        bt_buf_put(b, json_string_value(v), json_string_length(v));
    } else if (json_is_array(v)) {
        size_t i;
        json_t *x;
        if (json_array_size(v) == 0) bt_buf_str(b, "(none)");
        json_array_foreach(v, i, x) {
            if (i) bt_buf_str(b, ",");
            render(x, b);
        }
    } else {
        char *t = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
        bt_buf_str(b, t ? t : "?");
        free(t);
    }
}

int bt_keytab_diff(const bt_key *tab, const void *a, const void *b,
                   void (*fn)(const bt_key *k, const char *old_text, const char *new_text, void *ctx), void *ctx) {
    int d = 0;
    for (const bt_key *k = tab; k->name; k++) {
        json_t *va = bt_keytab_value(k, a), *vb = bt_keytab_value(k, b);
        if (va && vb && !json_equal(va, vb)) {
            bt_buf ta = {0}, tb = {0};
            render(va, &ta);
            render(vb, &tb);
            fn(k, ta.oom ? "?" : ta.p, tb.oom ? "?" : tb.p, ctx);
            free(ta.p);
            free(tb.p);
            d++;
        }
        json_decref(va);
        json_decref(vb);
    }
    return d;
}

void bt_keytab_doc_md(const bt_key *tab, const char *prefix, FILE *f) {
    fputs("| key | accepted values | default | meaning |\n|---|---|---|---|\n", f);
    for (const bt_key *k = tab; k->name; k++) {
        char what[256];
        fprintf(f, "| `%s%s` | %s | %s%s%s | %s%s |\n", prefix ? prefix : "", k->name, bt_keytab_what(k, what, sizeof what),
                k->def ? "`" : "", k->def ? k->def : (k->flags & BT_KEY_REQUIRED) ? "required" : "—",
                k->def ? "`" : "", k->doc, (k->flags & BT_KEY_NO_FIELD) ? " (checked here, used elsewhere)" : "");
    }
}
