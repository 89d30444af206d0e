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

/* A short JSON rendering of v for messages (at most 60 characters). */
static void render_short(const json_t *v, char *buf, size_t n) {
    char *s = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
    if (!s) snprintf(buf, n, "?");
    else if (strlen(s) > 60) snprintf(buf, n, "%.57s...", s);
    else snprintf(buf, n, "%s", s);
    free(s);
}

/* The refusal of value v for row k: "\"path\": expected <what>", or with BT_KEYTAB_GOT
 * "path: expected <what>, got <v>". */
static int fail_expected(const bt_key *k, const char *path, unsigned fl, const json_t *v) {
    char what[256], got[80];
    bt_keytab_what_ex(k, fl, what, sizeof what);
    if (!(fl & BT_KEYTAB_GOT)) return fail_key(path, "expected %s", what);
    render_short(v, got, sizeof got);
    return bt_fail(BT_ERR_INVALID, "%s: expected %s, got %s", path, what, got);
}

/* names[] as "\"a\", \"b\" or \"c\"" (or with BT_KEYTAB_GOT "one of \"a\", \"b\", \"c\""). */
static void names_text(const char *const *names, unsigned fl, char *buf, size_t cap) {
    size_t used = 0, n = 0;
    while (names[n]) n++;
    buf[0] = 0;
    if (fl & BT_KEYTAB_GOT) used = (size_t)snprintf(buf, cap, "one of ");
    for (size_t i = 0; i < n && used < cap; i++)
        used += (size_t)snprintf(buf + used, cap - used, "%s\"%s\"",
                                 i == 0 ? "" : (i + 1 == n && !(fl & BT_KEYTAB_GOT)) ? " or " : ", ", names[i]);
}

const char *bt_keytab_what_ex(const bt_key *k, unsigned fl, char *buf, size_t cap) {
    const int got = (fl & BT_KEYTAB_GOT) != 0;
    if (k->what) {
        snprintf(buf, cap, "%s", k->what);
        return buf;
    }
    switch (k->type) {
    case BT_KEY_INT:
        if (got && k->ihi >= INT32_MAX) snprintf(buf, cap, "an integer >= %" PRId64, k->ilo);
        else snprintf(buf, cap, "an integer in [%" PRId64 ", %" PRId64 "]", k->ilo, k->ihi);
        break;
    case BT_KEY_NUM:
        if (got && isinf(k->nhi)) snprintf(buf, cap, "a number %s %.15g", k->flags & BT_KEY_LO_OPEN ? ">" : ">=", k->nlo);
        else
            snprintf(buf, cap, "a number in %c%.15g, %.15g%c", k->flags & BT_KEY_LO_OPEN ? '(' : '[', k->nlo, k->nhi,
                     k->flags & BT_KEY_HI_OPEN ? ')' : ']');
        break;
    case BT_KEY_BOOL: snprintf(buf, cap, "true or false"); break;
    case BT_KEY_STR:
        if (k->names) names_text(k->names, fl, buf, cap);
        else if (k->ihi > 0) snprintf(buf, cap, "a string of %" PRId64 "..%" PRId64 " bytes", k->ilo, k->ihi);
        else snprintf(buf, cap, "a%s string", k->ilo > 0 ? " non-empty" : "");
        break;
    case BT_KEY_ENUM: names_text(k->names, fl, buf, cap); break;
    case BT_KEY_CUSTOM: snprintf(buf, cap, "see the meaning"); break;
    case BT_KEY_OBJ:
        snprintf(buf, cap, "%s", !(k->flags & BT_KEY_NULLABLE)     ? "an object"
                                 : (k->flags & BT_KEY_FALSE_NULL) ? "an object, null or false"
                                                                  : "an object or null");
        break;
    }
    return buf;
}

const char *bt_keytab_what(const bt_key *k, char *buf, size_t cap) { return bt_keytab_what_ex(k, 0, buf, cap); }

static int parse_int(const bt_key *k, json_t *v, void *dst, const char *path, unsigned fl) {
    json_int_t x;
    if (json_is_integer(v)) {
        x = json_integer_value(v);
    } else if ((fl & BT_KEYTAB_GOT) && json_is_real(v) && json_real_value(v) == floor(json_real_value(v)) &&
               fabs(json_real_value(v)) <= 9.0e15) {
        x = (json_int_t)json_real_value(v); /* 512.0: an integer written as a real */
    } else {
        return fail_expected(k, path, fl, v);
    }
    if (x < k->ilo || x > k->ihi || ((fl & BT_KEYTAB_GOT) && (x > 9000000000000000ll || x < -9000000000000000ll))) {
        if (fl & BT_KEYTAB_GOT) return fail_expected(k, path, fl, v);
        return fail_key(path, "%lld is out of range [%" PRId64 ", %" PRId64 "]", (long long)x, k->ilo, k->ihi);
    }
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

static int parse_num(const bt_key *k, json_t *v, void *dst, const char *path, unsigned fl) {
    double x = json_number_value(v);
    int lo_ok = k->flags & BT_KEY_LO_OPEN ? x > k->nlo : x >= k->nlo;
    int hi_ok = k->flags & BT_KEY_HI_OPEN ? x < k->nhi : x <= k->nhi;
    if (!json_is_number(v) || !lo_ok || !hi_ok) return fail_expected(k, path, fl, v);
    if (!(k->flags & BT_KEY_NO_FIELD)) memcpy(field(k, dst), &x, sizeof x);
    return BT_OK;
}

static int parse_str(const bt_key *k, json_t *v, void *dst, const char *path, unsigned fl) {
    char **f = field(k, dst);
    if (json_is_null(v) && (k->flags & BT_KEY_NULLABLE)) {
        if (!(k->flags & BT_KEY_NO_FIELD)) {
            free(*f);
            *f = NULL;
        }
        return BT_OK;
    }
    const char *s = json_string_value(v);
    size_t n = s ? json_string_length(v) : 0;
    if (!s || strlen(s) != n || (int64_t)n < k->ilo || (k->ihi > 0 && (int64_t)n > k->ihi))
        return fail_expected(k, path, fl, v);
    if (k->names) {
        int i = 0;
        while (k->names[i] && strcmp(s, k->names[i])) i++;
        if (!k->names[i]) return fail_expected(k, path, fl, v);
    }
    if (k->flags & BT_KEY_SAFE_TEXT) { /* names and paths reach terminals, log lines and metric labels */
        int32_t cp;
        size_t off = bt_text_unsafe(s, n, &cp);
        if (off < n)
            return fail_key(path, "holds a control character (%s%04X at byte %zu): names and paths may not hold control "
                            "or bidirectional-control characters", cp < 0 ? "byte 0x" : "U+",
                            (unsigned)(cp < 0 ? -cp - 1 : cp), off);
    }
    if (k->flags & BT_KEY_NO_FIELD) return BT_OK;
    free(*f);
    *f = bt_xstrdup(s);
    return BT_OK;
}

static int parse_enum(const bt_key *k, json_t *v, void *dst, const char *path, unsigned fl) {
    const char *s = json_string_value(v);
    for (int i = 0; s && k->names[i]; i++)
        if (!strcmp(s, k->names[i])) {
            int x = k->values ? k->values[i] : i;
            if (!(k->flags & BT_KEY_NO_FIELD)) memcpy(field(k, dst), &x, sizeof x);
            return BT_OK;
        }
    return fail_expected(k, path, fl, v);
}

/* Release what a section's fields own and zero them all (an optional section switched off). */
static void clear_section(const bt_key *tab, void *dst) {
    for (const bt_key *k = tab; k->name; k++) {
        if (k->alias || (k->flags & BT_KEY_NO_FIELD)) continue;
        if (k->type == BT_KEY_OBJ) {
            clear_section(k->sub, dst);
            continue;
        }
        if (k->type == BT_KEY_STR) free(*(char **)field(k, dst));
        else if (k->type == BT_KEY_CUSTOM && k->release) k->release(k, dst);
        memset(field(k, dst), 0, k->size);
    }
}

static int parse_obj(const bt_key *tab, json_t *o, void *dst, const char *prefix, unsigned fl, bt_keypath *bad);

/* One row's value; path: its full path. */
static int parse_row(const bt_key *k, json_t *v, void *dst, const char *path, bt_keypath *bad, unsigned fl) {
    int rc;
    switch (k->type) {
    case BT_KEY_INT: rc = parse_int(k, v, dst, path, fl); break;
    case BT_KEY_NUM: rc = parse_num(k, v, dst, path, fl); break;
    case BT_KEY_BOOL:
        if (!json_is_boolean(v)) return fail_expected(k, path, fl, v);
        if (!(k->flags & BT_KEY_NO_FIELD)) *(int *)field(k, dst) = json_is_true(v);
        rc = BT_OK;
        break;
    case BT_KEY_STR: rc = parse_str(k, v, dst, path, fl); break;
    case BT_KEY_ENUM: rc = parse_enum(k, v, dst, path, fl); break;
    case BT_KEY_CUSTOM: rc = k->parse(k, v, dst, path, bad); break;
    case BT_KEY_OBJ:
        if ((k->flags & BT_KEY_NULLABLE) && (json_is_null(v) || ((k->flags & BT_KEY_FALSE_NULL) && json_is_false(v)))) {
            clear_section(k->sub, dst);
            return BT_OK;
        }
        if (!json_is_object(v)) return fail_expected(k, path, fl, v);
        if ((k->flags & BT_KEY_NULLABLE) && (rc = bt_keytab_defaults(k->sub, dst))) return rc;
        rc = parse_obj(k->sub, v, dst, path, fl, bad);
        break;
    default: rc = bt_fail(BT_ERR_INVALID, "\"%s\": unknown key type %d", path, (int)k->type); break;
    }
    return rc;
}

int bt_keytab_parse_value(const bt_key *k, json_t *v, void *dst, const char *path, bt_keypath *bad) {
    bt_keypath scratch;
    if (!bad) bad = &scratch;
    snprintf(bad->s, sizeof bad->s, "%s", path);
    return parse_row(k, v, dst, path, bad, 0);
}

int bt_keytab_defaults(const bt_key *tab, void *dst) {
    for (const bt_key *k = tab; k->name; k++) {
        if (k->type == BT_KEY_OBJ && !k->alias) {
            int rc = k->flags & BT_KEY_NULLABLE ? BT_OK : bt_keytab_defaults(k->sub, dst);
            if (rc) return rc;
            continue;
        }
        if (!k->def) continue;
        json_error_t e;
        json_t *v = json_loads(k->def, JSON_DECODE_ANY, &e);
        if (!v) return bt_fail(BT_ERR_INVALID, "\"%s\": default %s is not JSON: %s", k->name, k->def, e.text);
        bt_keypath bad;
        snprintf(bad.s, sizeof bad.s, "%s", k->name);
        int rc = parse_row(k, v, dst, k->name, &bad, 0);
        json_decref(v);
        if (rc) return bt_fail(rc, "default of %s", bt_last_error());
    }
    return BT_OK;
}

const char *bt_keytab_names(const bt_key *tab, char *buf, size_t cap) {
    size_t used = 0;
    if (cap) buf[0] = 0;
    for (const bt_key *k = tab; k->name && used + 1 < cap; k++) {
        if (k->alias) continue; /* accepted, not advertised */
        int w = snprintf(buf + used, cap - used, "%s%s", used == 0 ? "" : ", ", k->name);
        if (w < 0) break;
        used += (size_t)w;
    }
    return buf;
}

static const bt_key *row_named(const bt_key *tab, const char *name, size_t n) {
    for (const bt_key *k = tab; k->name; k++)
        if (strlen(k->name) == n && !memcmp(k->name, name, n)) return k;
    return NULL;
}

const bt_key *bt_keytab_find(const bt_key *tab, const char *path) {
    for (;;) {
        size_t n = strcspn(path, ".");
        const bt_key *k = row_named(tab, path, n);
        if (k && k->alias) k = row_named(tab, k->alias, strlen(k->alias));
        if (!k || !path[n]) return k;
        if (k->type != BT_KEY_OBJ) return NULL;
        tab = k->sub;
        path += n + 1;
    }
}

/* The keys of object o through tab (prefix: o's path); then the required rows. */
static int parse_obj(const bt_key *tab, json_t *o, void *dst, const char *prefix, unsigned fl, bt_keypath *bad) {
    bt_keypath path;
    int rc = BT_OK;
    const char *key;
    json_t *v;
    json_object_foreach(o, key, v) {
        if ((fl & BT_KEYTAB_COMMENTS) && key[0] == '#') continue;
        key_path(&path, prefix, key);
        const bt_key *k = row_named(tab, key, strlen(key));
        snprintf(bad->s, sizeof bad->s, "%s", path.s);
        if (!k) {
            char known[1024];
            return bt_fail(BT_ERR_INVALID, "unknown key \"%s\" (known: %s)", path.s, bt_keytab_names(tab, known, sizeof known));
        }
        if (k->alias) {
            const bt_key *t = row_named(tab, k->alias, strlen(k->alias));
            if (!t) return bt_fail(BT_ERR_INVALID, "\"%s\": alias of a key the table has not (%s)", path.s, k->alias);
            if (json_object_get(o, t->name))
                return bt_fail(BT_ERR_INVALID, "%s: give %s or %s, not both (%s is the deprecated alias of %s)", path.s,
                               key, t->name, key, t->name);
            k = t;
        }
        if ((rc = parse_row(k, v, dst, path.s, bad, fl))) return rc;
        bad->s[0] = 0;
    }
    for (const bt_key *k = tab; k->name; k++) {
        if (k->type == BT_KEY_OBJ && !k->alias && !(k->flags & BT_KEY_NULLABLE) && !json_object_get(o, k->name)) {
            /* an absent section is an empty one: its required keys are missing */
            json_t *empty = json_object();
            key_path(&path, prefix, k->name);
            rc = parse_obj(k->sub, empty, dst, path.s, fl, bad);
            json_decref(empty);
            if (rc) return rc;
            continue;
        }
        if ((k->flags & BT_KEY_REQUIRED) && !json_object_get(o, k->name)) {
            key_path(bad, prefix, k->name);
            if (fl & BT_KEYTAB_GOT) {
                char what[256];
                return bt_fail(BT_ERR_INVALID, "%s: required key missing (expected %s)", bad->s,
                               bt_keytab_what_ex(k, fl, what, sizeof what));
            }
            return fail_key(bad->s, "required: %s", k->doc);
        }
    }
    return BT_OK;
}

int bt_keytab_parse(const bt_key *tab, json_t *o, void *dst, const char *origin, const char *prefix,
                    unsigned flags, bt_keypath *bad) {
    bt_keypath scratch;
    if (!bad) bad = &scratch;
    bad->s[0] = 0;
    int rc;
    if (!json_is_object(o)) {
        snprintf(bad->s, sizeof bad->s, "%s", prefix ? prefix : "");
        rc = prefix && *prefix ? fail_key(prefix, "expected an object") : bt_fail(BT_ERR_INVALID, "expected a JSON object");
    } else {
        rc = parse_obj(tab, o, dst, prefix, flags, bad);
    }
    if (rc && origin && *origin) rc = bt_fail(rc, "%s: %s", origin, bt_last_error());
    return rc;
}

void bt_keytab_free(const bt_key *tab, void *dst) {
    for (const bt_key *k = tab; k->name; k++) {
        if ((k->flags & BT_KEY_NO_FIELD) || k->alias) continue;
        if (k->type == BT_KEY_OBJ) {
            bt_keytab_free(k->sub, dst);
        } else if (k->type == BT_KEY_STR) {
            char **f = field(k, dst);
            free(*f);
            *f = NULL;
        } else if (k->type == BT_KEY_CUSTOM && k->release) {
            k->release(k, dst);
        }
    }
}

/* An optional section is off while the field of its first row is all zero bytes. */
static int section_off(const bt_key *k, const void *src) {
    const bt_key *first = k->sub;
    if (!(k->flags & BT_KEY_NULLABLE) || !first->name || first->type == BT_KEY_OBJ) return 0;
    const unsigned char *f = cfield(first, src);
    for (size_t i = 0; i < first->size; i++)
        if (f[i]) return 0;
    return 1;
}

json_t *bt_keytab_value(const bt_key *k, const void *src) {
    if ((k->flags & BT_KEY_NO_FIELD) || k->alias) return NULL;
    if (k->type == BT_KEY_OBJ) return section_off(k, src) ? json_null() : bt_keytab_dump(k->sub, src);
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
    case BT_KEY_OBJ: break; /* above */
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

/* text into f with '|' escaped (a Markdown table cell). */
static void md_cell(FILE *f, const char *text) {
    for (const char *p = text; *p; p++) {
        if (*p == '|') fputc('\\', f);
        fputc(*p, f);
    }
}

static void doc_rows(const bt_key *tab, const char *prefix, unsigned fl, FILE *f) {
    for (const bt_key *k = tab; k->name; k++) {
        char what[256], path[BT_KEY_PATH_MAX];
        snprintf(path, sizeof path, "%s%s", prefix ? prefix : "", k->name);
        fprintf(f, "| `%s` | ", path);
        if (k->alias) {
            fprintf(f, "deprecated alias of `%s%s` | | ", prefix ? prefix : "", k->alias);
            md_cell(f, k->doc);
            fputs(" |\n", f);
            continue;
        }
        md_cell(f, bt_keytab_what_ex(k, fl, what, sizeof what));
        fputs(" | ", f);
        if (k->def) {
            fputc('`', f);
            md_cell(f, k->def);
            fputc('`', f);
        } else {
            fputs(k->type == BT_KEY_OBJ && (k->flags & BT_KEY_NULLABLE) ? "`null`"
                  : (k->flags & BT_KEY_REQUIRED)                       ? "required"
                                                                       : "—",
                  f);
        }
        fputs(" | ", f);
        md_cell(f, k->doc);
        fprintf(f, "%s |\n", (k->flags & BT_KEY_NO_FIELD) ? " (checked here, used elsewhere)" : "");
        if (k->type == BT_KEY_OBJ) {
            char sub[BT_KEY_PATH_MAX + 2];
            snprintf(sub, sizeof sub, "%s.", path);
            doc_rows(k->sub, sub, fl, f);
        }
    }
}

void bt_keytab_doc_md_ex(const bt_key *tab, const char *prefix, unsigned flags, FILE *f) {
    fputs("| key | accepted values | default | meaning |\n|---|---|---|---|\n", f);
    doc_rows(tab, prefix, flags, f);
}

void bt_keytab_doc_md(const bt_key *tab, const char *prefix, FILE *f) { bt_keytab_doc_md_ex(tab, prefix, 0, f); }
