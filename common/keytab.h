/* BarqTrain common: declarative key tables, the one way a configuration object is read.
 *
 * A key table describes one JSON object (a configuration file, a job spec, a section of one;
 * YAML arrives as JSON through common/yaml_json.h) with one row per key: its name, its type and
 * range, its default, the field of the C struct it fills, and one line of documentation. The same
 * rows drive
 *   - parsing (bt_keytab_parse): every key of the object checked and stored; a key the table
 *     does not know is refused, listing the known ones;
 *   - defaults (bt_keytab_defaults): each row's default is JSON text parsed by the row itself, so
 *     a default can never disagree with the row's type or range, nor with the docs;
 *   - dumping and comparing (bt_keytab_dump, bt_keytab_diff): what a configuration holds, key by
 *     key, for logs and for writing it back;
 *   - the docs (bt_keytab_doc_md): a Markdown table of key, type/range, default, meaning.
 * Adding a key is adding a row. Errors carry the key as data: the failing key's full path
 * ("datasets[1].weight", "lora.r") is returned in a bt_keypath besides the message
 * (bt_last_error(), "<origin>: \"<path>\": ..."), so a caller can map it to a line of its file
 * without reading its own message.
 *
 * Used by loaderd's configuration file (loaderd/config.c) and job spec (loaderd/job.c); meant
 * for every configuration of BarqTrain (the trainer's job config is the next user). */
#ifndef BT_KEYTAB_H
#define BT_KEYTAB_H
#include <jansson.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef enum {
    BT_KEY_INT,    /* JSON integer in [ilo, ihi]; field: int32_t/uint32_t/int64_t/uint64_t (size 4 or 8) */
    BT_KEY_NUM,    /* JSON number in [nlo, nhi] (BT_KEY_LO_OPEN / HI_OPEN: strict); field: double */
    BT_KEY_BOOL,   /* true / false; field: int (0/1) */
    BT_KEY_STR,    /* string of ilo..ihi bytes (ihi 0: no limit), no NUL; field: char * (malloc'd,
                    * owned; bt_keytab_free); BT_KEY_SAFE_TEXT: no control characters either */
    BT_KEY_ENUM,   /* one of names[]; field: int, the name's index, or values[index] when given */
    BT_KEY_CUSTOM, /* parse() decides (lists, nested objects, resolved paths, ...) */
} bt_key_type;

enum {
    BT_KEY_REQUIRED = 1u << 0,  /* absent: refused ("\"<path>\": required: <doc>") */
    BT_KEY_LO_OPEN = 1u << 1,   /* BT_KEY_NUM: x > nlo */
    BT_KEY_HI_OPEN = 1u << 2,   /* BT_KEY_NUM: x < nhi */
    BT_KEY_SAFE_TEXT = 1u << 3, /* BT_KEY_STR: refuse control / bidi characters (bt_text_unsafe) */
    BT_KEY_NO_FIELD = 1u << 4,  /* checked, stored nowhere (a key another part reads) */
    BT_KEY_USER = 1u << 16,     /* and above: the user's own flags (e.g. "applies after a restart") */
};

typedef struct bt_key bt_key;

/* Path of a key within its document: "max_jobs", "datasets[1].weight", "lora.r". */
#define BT_KEY_PATH_MAX 160
typedef struct {
    char s[BT_KEY_PATH_MAX];
} bt_keypath;

struct bt_key {
    const char *name; /* the key; NULL ends a table */
    bt_key_type type;
    size_t off;       /* offsetof(struct, field) */
    size_t size;      /* sizeof the field (BT_KEY_INT: 4 or 8; BT_KEY_CUSTOM: the user's) */
    int64_t ilo, ihi; /* BT_KEY_INT range; BT_KEY_STR length range */
    double nlo, nhi;  /* BT_KEY_NUM range */
    const char *def;  /* default as JSON text ("8", "\"0660\"", "[]"), parsed by the row; NULL: none
                       * (the field keeps what the caller put there) */
    const char *const *names; /* BT_KEY_ENUM: the accepted strings, NULL-terminated */
    const int *values;        /* BT_KEY_ENUM: the value stored for names[i]; NULL: i */
    /* BT_KEY_CUSTOM: check v (never NULL) and store it into the struct at dst; `path` names the
     * key in messages. BT_OK, or a BT_ERR_* with bt_fail("\"<path>\": ...") (no origin: the table
     * adds it); *bad, when the message is about an element ("shards[3]", "datasets[1].weight"),
     * gets that element's path (else it is the key's). Any previous value of the field must be
     * replaced (and freed) by the new one. */
    int (*parse)(const bt_key *k, json_t *v, void *dst, const char *path, bt_keypath *bad);
    /* BT_KEY_CUSTOM: the field as JSON (new reference) for bt_keytab_dump / diff; NULL: not dumped */
    json_t *(*dump)(const bt_key *k, const void *src);
    /* BT_KEY_CUSTOM: free what the field owns and zero it (bt_keytab_free); NULL: nothing owned */
    void (*release)(const bt_key *k, void *dst);
    unsigned flags;
    const char *doc; /* one line: the meaning, units, what the default means when def is NULL */
};

/* Rows (T: the struct, f: its field). */
#define BT_KEY_I(key, T, f, lo, hi, dflt, flg, text)                                                       \
    {.name = key, .type = BT_KEY_INT, .off = offsetof(T, f), .size = sizeof(((T *)0)->f), .ilo = (lo),     \
     .ihi = (hi), .def = dflt, .flags = flg, .doc = text}
#define BT_KEY_N(key, T, f, lo, hi, dflt, flg, text)                                                       \
    {.name = key, .type = BT_KEY_NUM, .off = offsetof(T, f), .size = sizeof(double), .nlo = (lo), .nhi = (hi), \
     .def = dflt, .flags = flg, .doc = text}
#define BT_KEY_B(key, T, f, dflt, flg, text)                                                                \
    {.name = key, .type = BT_KEY_BOOL, .off = offsetof(T, f), .size = sizeof(int), .def = dflt, .flags = flg, \
     .doc = text}
#define BT_KEY_S(key, T, f, minlen, maxlen, dflt, flg, text)                                               \
    {.name = key, .type = BT_KEY_STR, .off = offsetof(T, f), .size = sizeof(char *), .ilo = (minlen),       \
     .ihi = (maxlen), .def = dflt, .flags = flg, .doc = text}
#define BT_KEY_E(key, T, f, nms, vals, dflt, flg, text)                                                    \
    {.name = key, .type = BT_KEY_ENUM, .off = offsetof(T, f), .size = sizeof(int), .def = dflt, .names = nms, \
     .values = vals, .flags = flg, .doc = text}
#define BT_KEY_C(key, T, f, fn, dumpfn, relfn, dflt, flg, text)                                             \
    {.name = key, .type = BT_KEY_CUSTOM, .off = offsetof(T, f), .size = sizeof(((T *)0)->f), .def = dflt,   \
     .parse = fn, .dump = dumpfn, .release = relfn, .flags = flg, .doc = text}
#define BT_KEY_END {.name = NULL}

/* Set every field of dst that has a default to it (rows with def NULL are left alone). BT_OK, or
 * the row's error for a default that does not parse (a bug in the table: tests run it). */
int bt_keytab_defaults(const bt_key *tab, void *dst);

/* Parse object o (anything else is refused) into dst: each key of o must be a row of tab (keys
 * starting with '#' excepted when allow_comments: documentation inside the file); each value is
 * checked and stored; then every BT_KEY_REQUIRED row must have been present. Keys not in o keep
 * what dst held (the defaults, when the caller applied them). prefix: the path of o in its
 * document ("" at the top, "datasets[1]") for messages and *bad.
 * BT_OK, or BT_ERR_INVALID (a custom row's own code) with bt_last_error() =
 * "<origin>: <message>" (origin NULL or "": the message alone), where the message names the key,
 * e.g. "\"seq_len\": 3 is out of range [16, 1048576]", "unknown key \"x\" (known: a, b)"; and
 * *bad (may be NULL) = the key's path. dst may hold partial results on error (bt_keytab_free). */
int bt_keytab_parse(const bt_key *tab, json_t *o, void *dst, const char *origin, const char *prefix,
                    int allow_comments, bt_keypath *bad);

/* One value v through row k alone (its checks, then stored into dst): for the elements of a list
 * or the entries of a map a custom row reads. path names it in messages (no origin added); *bad
 * (may be NULL) gets the path of a custom row's failing element. BT_OK or BT_ERR_INVALID. */
int bt_keytab_parse_value(const bt_key *k, json_t *v, void *dst, const char *path, bt_keypath *bad);

/* Free what dst's BT_KEY_STR and custom fields own and zero them. */
void bt_keytab_free(const bt_key *tab, void *dst);

/* The value of row k in src as JSON (new reference; NULL for a custom row without dump). */
json_t *bt_keytab_value(const bt_key *k, const void *src);
/* Every dumpable row of src as one JSON object {name: value} (new reference). */
json_t *bt_keytab_dump(const bt_key *tab, const void *src);
/* Call fn(k, old_text, new_text, ctx) for each row whose value differs between a and b (texts:
 * compact JSON, strings without quotes, arrays comma-joined, null as "(none)"). Returns the
 * number of differences. */
int bt_keytab_diff(const bt_key *tab, const void *a, const void *b,
                   void (*fn)(const bt_key *k, const char *old_text, const char *new_text, void *ctx), void *ctx);

/* The known keys of tab, comma-separated, into buf (cap bytes, truncated). Returns buf. */
const char *bt_keytab_names(const bt_key *tab, char *buf, size_t cap);
/* A row's accepted values in words ("an integer in [1, 256]", "one of \"chat\", \"text\"",
 * custom rows: "see below"), into buf. Returns buf. */
const char *bt_keytab_what(const bt_key *k, char *buf, size_t cap);
/* The table as Markdown rows "| `key` | accepted values | default | doc |" after a header
 * line, on f (prefix before each key, e.g. "datasets[]."). */
void bt_keytab_doc_md(const bt_key *tab, const char *prefix, FILE *f);

#endif
