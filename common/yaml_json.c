/* YAML <-> jansson trees. See yaml_json.h for the contract. */
#include "common/yaml_json.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <yaml.h>

#include "common/bt_common.h"
#include "common/bt_vec.h"

#define TAG_PREFIX "tag:yaml.org,2002:"

/* One open collection while parsing. */
typedef struct {
    json_t *node;  /* object or array (owned until attached to its parent) */
    char *path;    /* key path of this node ("" for the root) */
    char *key;     /* mapping: the pending key, NULL when a key is expected next */
    yaml_mark_t start; /* where the collection starts */
    char *anchor;  /* anchor of this collection, registered when it closes */
} frame;

typedef struct {
    char *name;
    json_t *node;
} anchor_t;

typedef struct {
    const char *origin;
    frame st[BT_YAML_MAX_DEPTH + 1];
    int depth;
    anchor_t *anchors;
    size_t n_anchors, cap_anchors;
    long nodes;
    json_t *root, *lines;
} ctx_t;

static int fail_at(const ctx_t *c, const yaml_mark_t *m, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int fail_at(const ctx_t *c, const yaml_mark_t *m, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return bt_fail(BT_ERR_FORMAT, "%s:%zu:%zu: %s", c->origin, m->line + 1, m->column + 1, msg);
}

/* ---- scalar resolution (YAML 1.2 core schema) ---- */

static int all_in(const char *s, const char *set) {
    if (!*s) return 0;
    for (; *s; s++)
        if (!strchr(set, *s)) return 0;
    return 1;
}

static int is_null(const char *s) {
    return !*s || !strcmp(s, "~") || !strcmp(s, "null") || !strcmp(s, "Null") || !strcmp(s, "NULL");
}

static int is_bool(const char *s, int *v) {
    if (!strcmp(s, "true") || !strcmp(s, "True") || !strcmp(s, "TRUE")) return *v = 1, 1;
    if (!strcmp(s, "false") || !strcmp(s, "False") || !strcmp(s, "FALSE")) return *v = 0, 1;
    return 0;
}

/* [-+]?[0-9]+ | 0o[0-7]+ | 0x[0-9a-fA-F]+ */
static int is_int(const char *s, int *base, const char **digits) {
    if (s[0] == '0' && s[1] == 'o') return *base = 8, *digits = s + 2, all_in(s + 2, "01234567");
    if (s[0] == '0' && s[1] == 'x')
        return *base = 16, *digits = s + 2, all_in(s + 2, "0123456789abcdefABCDEF");
    *base = 10, *digits = s;
    return all_in(s + (*s == '-' || *s == '+'), "0123456789");
}

/* [-+]? ( \.[0-9]+ | [0-9]+ ( \.[0-9]* )? ) ( [eE] [-+]? [0-9]+ )?  (integers excluded first) */
static int is_float(const char *s) {
    const char *p = s + (*s == '-' || *s == '+');
    int digits = 0;
    while (*p >= '0' && *p <= '9') p++, digits++;
    if (*p == '.') {
        p++;
        int frac = 0;
        while (*p >= '0' && *p <= '9') p++, frac++;
        if (!digits && !frac) return 0;
    } else if (!digits) {
        return 0;
    }
    if (*p == 'e' || *p == 'E') {
        p++;
        if (*p == '-' || *p == '+') p++;
        if (!(*p >= '0' && *p <= '9')) return 0;
        while (*p >= '0' && *p <= '9') p++;
    }
    return *p == 0;
}

static int is_special_float(const char *s) {
    const char *p = s + (*s == '-' || *s == '+');
    return !strcmp(p, ".inf") || !strcmp(p, ".Inf") || !strcmp(p, ".INF") || !strcmp(s, ".nan") ||
           !strcmp(s, ".NaN") || !strcmp(s, ".NAN");
}

/* The JSON value of a scalar event. */
static int resolve(const ctx_t *c, const yaml_event_t *e, json_t **out) {
    const char *s = (const char *)e->data.scalar.value;
    size_t len = e->data.scalar.length;
    const char *tag = (const char *)e->data.scalar.tag;
    const char *kind = NULL; /* "str", "int", "float", "bool", "null" or NULL = resolve */
    if (tag && !strcmp(tag, "!")) kind = "str"; /* non-specific tag: a quoted scalar */
    else if (tag && !strncmp(tag, TAG_PREFIX, strlen(TAG_PREFIX))) {
        kind = tag + strlen(TAG_PREFIX);
        if (strcmp(kind, "str") && strcmp(kind, "int") && strcmp(kind, "float") &&
            strcmp(kind, "bool") && strcmp(kind, "null"))
            return fail_at(c, &e->start_mark, "unsupported tag !!%s (str, int, float, bool, null)", kind);
    } else if (tag) {
        return fail_at(c, &e->start_mark, "unsupported tag %.60s", tag);
    }
    if (!kind && e->data.scalar.style != YAML_PLAIN_SCALAR_STYLE) kind = "str";
    if (strlen(s) != len) return fail_at(c, &e->start_mark, "NUL byte in a scalar");
    if (kind && !strcmp(kind, "str")) {
        *out = json_stringn(s, len);
        return *out ? 0 : fail_at(c, &e->start_mark, "scalar is not valid UTF-8");
    }
    int b, base;
    const char *digits;
    if ((!kind || !strcmp(kind, "null")) && is_null(s)) return *out = json_null(), 0;
    if ((!kind || !strcmp(kind, "bool")) && is_bool(s, &b)) return *out = json_boolean(b), 0;
    if ((!kind || !strcmp(kind, "int")) && is_int(s, &base, &digits)) {
        char *end;
        errno = 0;
        long long v = strtoll(digits, &end, base);
        if (errno == ERANGE || *end)
            return fail_at(c, &e->start_mark, "integer %.40s does not fit in 64 bits", s);
        return *out = json_integer(v), 0;
    }
    if ((!kind || !strcmp(kind, "float")) && (is_float(s) || is_int(s, &base, &digits))) {
        /* an integer form tagged !!float keeps its base: strtod reads 0x.. but not 0o.. */
        double v = is_int(s, &base, &digits) && base != 10 ? (double)strtoull(digits, NULL, base)
                                                           : strtod(s, NULL);
        if (!isfinite(v)) return fail_at(c, &e->start_mark, "number %.40s is out of range", s);
        return *out = json_real(v), 0;
    }
    if ((!kind || !strcmp(kind, "float")) && is_special_float(s))
        return fail_at(c, &e->start_mark, "%s: infinities and NaN have no JSON form", s);
    if (kind) return fail_at(c, &e->start_mark, "\"%.40s\" is not a valid !!%s", s, kind);
    *out = json_stringn(s, len);
    return *out ? 0 : fail_at(c, &e->start_mark, "scalar is not valid UTF-8");
}

/* ---- tree building ---- */

static long count_nodes(const json_t *j) {
    long n = 1;
    size_t i;
    const char *k;
    json_t *v;
    if (json_is_array(j)) json_array_foreach(j, i, v) n += count_nodes(v);
    else if (json_is_object(j)) json_object_foreach((json_t *)j, k, v) n += count_nodes(v);
    return n;
}

static int add_anchor(ctx_t *c, const char *name, json_t *node) {
    if (!name) return 0;
    if (c->n_anchors == c->cap_anchors) {
        size_t nc = c->cap_anchors ? 2 * c->cap_anchors : 8;
        anchor_t *p = realloc(c->anchors, nc * sizeof *p);
        if (!p) return bt_fail(BT_ERR_NOMEM, "yaml: out of memory");
        c->anchors = p, c->cap_anchors = nc;
    }
    c->anchors[c->n_anchors].name = bt_xstrdup(name);
    c->anchors[c->n_anchors++].node = json_incref(node);
    return 0;
}

static char *child_path(const frame *f, const char *key, size_t index) {
    char *p = NULL;
    int n = key ? asprintf(&p, "%s%s%s", f->path, *f->path ? "." : "", key)
                : asprintf(&p, "%s[%zu]", f->path, index);
    return n < 0 ? NULL : p;
}

/* Attach a finished node (stolen) to the open collection on top of the stack, or make it the
 * root. line: where the node started (for sequence items). */
static int attach(ctx_t *c, json_t *node, const yaml_mark_t *m) {
    if (c->depth == 0) {
        c->root = node;
        return 0;
    }
    frame *f = &c->st[c->depth - 1];
    if (json_is_array(f->node)) {
        char *p = child_path(f, NULL, json_array_size(f->node));
        if (p) json_object_set_new(c->lines, p, json_integer((json_int_t)m->line + 1));
        free(p);
        json_array_append_new(f->node, node);
        return 0;
    }
    int rc = json_object_set_new(f->node, f->key, node) ? bt_fail(BT_ERR_NOMEM, "yaml: out of memory") : 0;
    free(f->key);
    f->key = NULL;
    return rc;
}

/* A scalar (or alias) in key position of the mapping on top. */
static int take_key(ctx_t *c, const yaml_event_t *e, const char *text, size_t len) {
    frame *f = &c->st[c->depth - 1];
    if (strlen(text) != len) return fail_at(c, &e->start_mark, "NUL byte in a key");
    if (!strcmp(text, "<<"))
        return fail_at(c, &e->start_mark, "merge keys (<<) are not supported: write the keys out");
    char *p = child_path(f, text, 0);
    if (!p) return bt_fail(BT_ERR_NOMEM, "yaml: out of memory");
    if (json_object_get(f->node, text)) {
        json_t *first = json_object_get(c->lines, p);
        int rc = fail_at(c, &e->start_mark, "duplicate key \"%.80s\" (first at line %lld)", p,
                         first ? (long long)json_integer_value(first) : 0LL);
        free(p);
        return rc;
    }
    json_object_set_new(c->lines, p, json_integer((json_int_t)e->start_mark.line + 1));
    free(p);
    f->key = strndup(text, len);
    return f->key ? 0 : bt_fail(BT_ERR_NOMEM, "yaml: out of memory");
}

static int key_expected(const ctx_t *c) {
    return c->depth > 0 && json_is_object(c->st[c->depth - 1].node) && !c->st[c->depth - 1].key;
}

static int on_event(ctx_t *c, const yaml_event_t *e, int *docs) {
    switch (e->type) {
    case YAML_DOCUMENT_START_EVENT:
        if (++*docs > 1) return fail_at(c, &e->start_mark, "more than one YAML document");
        return 0;
    case YAML_SCALAR_EVENT: {
        if (key_expected(c))
            return take_key(c, e, (const char *)e->data.scalar.value, e->data.scalar.length);
        json_t *v = NULL;
        int rc = resolve(c, e, &v);
        if (rc) return rc;
        if (++c->nodes > BT_YAML_MAX_NODES) {
            json_decref(v);
            return fail_at(c, &e->start_mark, "more than %d values", BT_YAML_MAX_NODES);
        }
        if (e->data.scalar.anchor && (rc = add_anchor(c, (const char *)e->data.scalar.anchor, v))) {
            json_decref(v);
            return rc;
        }
        return attach(c, v, &e->start_mark);
    }
    case YAML_ALIAS_EVENT: {
        const char *name = (const char *)e->data.alias.anchor;
        json_t *src = NULL;
        for (size_t i = c->n_anchors; i-- > 0 && !src;)
            if (!strcmp(c->anchors[i].name, name)) src = c->anchors[i].node;
        if (!src) return fail_at(c, &e->start_mark, "unknown alias *%.60s", name);
        if (key_expected(c)) {
            if (!json_is_string(src)) return fail_at(c, &e->start_mark, "alias *%.60s as a key", name);
            return take_key(c, e, json_string_value(src), json_string_length(src));
        }
        c->nodes += count_nodes(src);
        if (c->nodes > BT_YAML_MAX_NODES)
            return fail_at(c, &e->start_mark, "aliases expand to more than %d values", BT_YAML_MAX_NODES);
        json_t *copy = json_deep_copy(src);
        if (!copy) return bt_fail(BT_ERR_NOMEM, "yaml: out of memory");
        return attach(c, copy, &e->start_mark);
    }
    case YAML_SEQUENCE_START_EVENT:
    case YAML_MAPPING_START_EVENT: {
        if (key_expected(c))
            return fail_at(c, &e->start_mark, "a mapping or sequence as a key is not supported");
        if (c->depth >= BT_YAML_MAX_DEPTH)
            return fail_at(c, &e->start_mark, "nesting deeper than %d levels", BT_YAML_MAX_DEPTH);
        if (++c->nodes > BT_YAML_MAX_NODES)
            return fail_at(c, &e->start_mark, "more than %d values", BT_YAML_MAX_NODES);
        const yaml_char_t *anchor = e->type == YAML_MAPPING_START_EVENT ? e->data.mapping_start.anchor
                                                                        : e->data.sequence_start.anchor;
        const yaml_char_t *tag = e->type == YAML_MAPPING_START_EVENT ? e->data.mapping_start.tag
                                                                     : e->data.sequence_start.tag;
        if (tag && strcmp((const char *)tag, e->type == YAML_MAPPING_START_EVENT ? TAG_PREFIX "map"
                                                                                 : TAG_PREFIX "seq"))
            return fail_at(c, &e->start_mark, "unsupported tag %.60s", (const char *)tag);
        frame *f = &c->st[c->depth];
        memset(f, 0, sizeof *f);
        if (c->depth == 0) f->path = bt_xstrdup("");
        else {
            frame *up = &c->st[c->depth - 1];
            f->path = json_is_array(up->node) ? child_path(up, NULL, json_array_size(up->node))
                                              : child_path(up, up->key, 0);
            if (!f->path) return bt_fail(BT_ERR_NOMEM, "yaml: out of memory");
        }
        f->node = e->type == YAML_MAPPING_START_EVENT ? json_object() : json_array();
        f->anchor = anchor ? bt_xstrdup((const char *)anchor) : NULL;
        f->start = e->start_mark;
        c->depth++;
        return f->node ? 0 : bt_fail(BT_ERR_NOMEM, "yaml: out of memory");
    }
    case YAML_SEQUENCE_END_EVENT:
    case YAML_MAPPING_END_EVENT: {
        frame *f = &c->st[--c->depth];
        json_t *node = f->node;
        yaml_mark_t start = f->start;
        int rc = add_anchor(c, f->anchor, node);
        free(f->path), free(f->key), free(f->anchor);
        memset(f, 0, sizeof *f);
        if (rc) {
            json_decref(node);
            return rc;
        }
        return attach(c, node, &start);
    }
    default:
        return 0;
    }
}

int bt_yaml_load(const char *text, size_t len, const char *origin, json_t **out, json_t **lines) {
    *out = NULL;
    if (lines) *lines = NULL;
    ctx_t c;
    memset(&c, 0, sizeof c);
    c.origin = origin ? origin : "<yaml>";
    c.lines = json_object();
    if (len >= 3 && !memcmp(text, "\xEF\xBB\xBF", 3)) text += 3, len -= 3;
    yaml_parser_t p;
    if (!yaml_parser_initialize(&p)) {
        json_decref(c.lines);
        return bt_fail(BT_ERR_NOMEM, "yaml: out of memory");
    }
    yaml_parser_set_input_string(&p, (const unsigned char *)text, len);
    yaml_parser_set_encoding(&p, YAML_UTF8_ENCODING);
    int rc = 0, docs = 0, done = 0;
    while (!rc && !done) {
        yaml_event_t e;
        if (!yaml_parser_parse(&p, &e)) {
            rc = bt_fail(BT_ERR_FORMAT, "%s:%zu:%zu: %s%s%s", c.origin, p.problem_mark.line + 1,
                         p.problem_mark.column + 1, p.problem ? p.problem : "YAML syntax error",
                         p.context ? " " : "", p.context ? p.context : "");
            break;
        }
        rc = on_event(&c, &e, &docs);
        done = e.type == YAML_STREAM_END_EVENT;
        yaml_event_delete(&e);
    }
    yaml_parser_delete(&p);
    while (c.depth > 0) {
        frame *f = &c.st[--c.depth];
        json_decref(f->node);
        free(f->path), free(f->key), free(f->anchor);
    }
    for (size_t i = 0; i < c.n_anchors; i++) free(c.anchors[i].name), json_decref(c.anchors[i].node);
    free(c.anchors);
    if (!rc && !json_is_object(c.root)) {
        yaml_mark_t m = {0, 0, 0};
        rc = fail_at(&c, &m, "expected a mapping (key: value lines) at the top level");
    }
    if (rc) {
        json_decref(c.root);
        json_decref(c.lines);
        return rc;
    }
    *out = c.root;
    if (lines) *lines = c.lines;
    else json_decref(c.lines);
    return 0;
}

/* ---- dump ---- */

/* The dump goes into a bt_buf (common/bt_vec.h): out of memory is checked once, at the end. */

static void indent(bt_buf *b, int n) {
    for (int i = 0; i < n; i++) bt_buf_put(b, " ", 1);
}

/* "# text" lines at `ind`, wrapped at ~96 columns on spaces. */
static void comment(bt_buf *b, const char *text, int ind) {
    const int width = 96 - ind - 2;
    const char *p = text;
    while (*p) {
        size_t n = strlen(p);
        size_t cut = n;
        if ((int)n > width) {
            cut = (size_t)width;
            while (cut > 0 && p[cut] != ' ') cut--;
            if (cut == 0) cut = (size_t)width;
        }
        indent(b, ind);
        bt_buf_str(b, "#");
        if (cut) bt_buf_str(b, " ");
        for (size_t i = 0; i < cut; i++) bt_buf_put(b, p[i] == '\n' ? " " : &p[i], 1);
        bt_buf_str(b, "\n");
        p += cut;
        while (*p == ' ') p++;
    }
}

/* A key as a plain scalar when that reads back as the same string, else JSON-quoted. */
static void key_text(bt_buf *b, const char *k) {
    int plain = (k[0] >= 'a' && k[0] <= 'z') || (k[0] >= 'A' && k[0] <= 'Z') || k[0] == '_';
    for (const char *p = k; *p && plain; p++)
        plain = (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ||
                *p == '_' || *p == '-' || *p == '.';
    int b_;
    if (plain && (is_null(k) || is_bool(k, &b_))) plain = 0;
    if (plain) {
        bt_buf_str(b, k);
        return;
    }
    json_t *s = json_string(k);
    char *q = s ? json_dumps(s, JSON_ENCODE_ANY) : NULL;
    if (q) bt_buf_str(b, q);
    else b->oom = 1;
    free(q);
    json_decref(s);
}

static void scalar(bt_buf *b, const json_t *v) {
    if (json_is_array(v)) {
        bt_buf_str(b, "[");
        for (size_t i = 0; i < json_array_size(v); i++) {
            if (i) bt_buf_str(b, ", ");
            scalar(b, json_array_get(v, i));
        }
        bt_buf_str(b, "]");
        return;
    }
    if (json_is_real(v)) { /* shortest form that reads back exactly, always with a '.' */
        char num[64];
        for (int p = 1; p <= 17; p++) {
            snprintf(num, sizeof num, "%.*g", p, json_real_value(v));
            if (strtod(num, NULL) == json_real_value(v)) break;
        }
        char *e = strpbrk(num, "eE");
        if (!strchr(num, '.')) {
            char tail[32] = "";
            if (e) snprintf(tail, sizeof tail, "%s", e), *e = 0;
            strncat(num, ".0", sizeof num - strlen(num) - 1);
            strncat(num, tail, sizeof num - strlen(num) - 1);
        }
        bt_buf_str(b, num);
        return;
    }
    char *s = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
    if (s) bt_buf_str(b, s);
    else b->oom = 1;
    free(s);
}

/* skip_doc: the object's own "#" comment was printed above its key already. */
static void dump_obj(bt_buf *b, const json_t *o, int ind, int skip_doc) {
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)o, k, v) {
        if (k[0] == '#') {
            if (json_is_string(v) && !(skip_doc && !k[1])) comment(b, json_string_value(v), ind);
            continue;
        }
        const json_t *doc = json_is_object(v) ? json_object_get(v, "#") : NULL;
        if (json_is_object(v) && ind == 0 && b->n > 0) bt_buf_str(b, "\n"); /* sections apart */
        if (json_is_string(doc)) comment(b, json_string_value(doc), ind);
        indent(b, ind);
        key_text(b, k);
        if (json_is_object(v) && json_object_size(v) > 0) {
            bt_buf_str(b, ":\n");
            dump_obj(b, v, ind + 2, 1);
        } else if (json_is_object(v)) {
            bt_buf_str(b, ": {}\n");
        } else {
            bt_buf_str(b, ": ");
            scalar(b, v);
            bt_buf_str(b, "\n");
        }
    }
}

char *bt_yaml_dump(const json_t *root) {
    if (!json_is_object(root)) return NULL;
    bt_buf b = {0};
    bt_buf_put(&b, "", 0);
    dump_obj(&b, root, 0, 0);
    if (!b.oom && b.n == 0) bt_buf_str(&b, "{}\n"); /* an empty mapping must still read back as one */
    if (b.oom) {
        free(b.p);
        return NULL;
    }
    return b.p;
}
