/* GGUF v2/v3 reader and writer. See gguf.h.
 * Format: ggml-org/ggml docs/gguf.md; limits as in ggml/src/gguf.cpp (GGML_MAX_DIMS = 4,
 * GGML_MAX_NAME = 64 including the NUL, GGUF_DEFAULT_ALIGNMENT = 32, alignment a power of two
 * stored as u32). Every count and length is checked against the bytes that remain before
 * anything is allocated, so a hostile header cannot make us allocate more than a small multiple
 * of the file size. */
#include "common/gguf.h"

#include "common/atomic_io.h"
#include "common/bt_common.h"
#include "common/bt_vec.h"
#include "common/quant.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "GGUF reader assumes a little-endian host"
#endif

#define GGUF_MAGIC "GGUF"
#define GGUF_DEFAULT_ALIGNMENT 32u
#define GGUF_MAX_NAME 63u       /* ggml GGML_MAX_NAME = 64 bytes including the NUL */
#define GGUF_MAX_KEY 65535u     /* gguf.md: keys are at most 2^16-1 bytes */
#define GGUF_MAX_ARRAY_DEPTH 4  /* nested arrays: our own limit against stack exhaustion */

/* ---------------------------------------------------------------- name index (open addressing) */

/* Entries start with a bt_str (gkv.key, bt_gguf_tensor.name), so the index only needs a base
 * pointer and a stride. */
typedef struct {
    int64_t *slots; /* -1 = empty */
    uint64_t mask;
} name_index;

static uint64_t str_hash(const char *p, uint64_t n) { return bt_fnv1a64(BT_FNV64_INIT, p, n); }

static const bt_str *idx_name(const void *base, size_t stride, int64_t i) {
    return (const bt_str *)((const char *)base + (size_t)i * stride);
}

/* Builds the index of n entries. Returns the index (>= 0) of the first duplicate's second
 * occurrence, -1 if none, -2 on allocation failure. */
static int64_t index_build(name_index *ix, const void *base, size_t stride, int64_t n) {
    uint64_t cap = 16;
    while (cap < (uint64_t)n * 2) cap <<= 1;
    ix->slots = malloc(cap * sizeof(int64_t));
    if (!ix->slots) return -2;
    memset(ix->slots, 0xFF, cap * sizeof(int64_t));
    ix->mask = cap - 1;
    for (int64_t i = 0; i < n; i++) {
        const bt_str *s = idx_name(base, stride, i);
        uint64_t h = str_hash(s->ptr, s->len) & ix->mask;
        while (ix->slots[h] >= 0) {
            const bt_str *o = idx_name(base, stride, ix->slots[h]);
            if (o->len == s->len && memcmp(o->ptr, s->ptr, s->len) == 0) return i;
            h = (h + 1) & ix->mask;
        }
        ix->slots[h] = i;
    }
    return -1;
}

static int64_t index_find(const name_index *ix, const void *base, size_t stride, const char *key) {
    if (!ix->slots || !key) return -1;
    uint64_t len = strlen(key);
    uint64_t h = str_hash(key, len) & ix->mask;
    while (ix->slots[h] >= 0) {
        const bt_str *o = idx_name(base, stride, ix->slots[h]);
        if (o->len == len && memcmp(o->ptr, key, len) == 0) return ix->slots[h];
        h = (h + 1) & ix->mask;
    }
    return -1;
}

/* ---------------------------------------------------------------- reader */

typedef struct {
    bt_str key;             /* must stay first (name_index) */
    bt_gguf_vtype type;
    bt_gguf_vtype arr_type; /* ARRAY only */
    uint64_t arr_n;         /* ARRAY only */
    size_t rec_off;         /* start of the record (key length field) */
    size_t val_off;         /* value bytes; for arrays the first element */
    size_t end_off;         /* one past the record */
} gkv;

struct bt_gguf {
    bt_map map; /* zero when opened from a buffer */
    const uint8_t *buf;
    size_t size;
    char *name;
    uint32_t version;
    uint64_t alignment;
    size_t data_off;
    int64_t n_kv;
    gkv *kv;
    int64_t n_tensors;
    bt_gguf_tensor *t;
    name_index kix, tix;
};

typedef struct {
    const uint8_t *b;
    size_t size, off;
    const char *name;
} cursor;

static size_t left(const cursor *c) { return c->size - c->off; }

static int need(cursor *c, uint64_t n, const char *what) {
    if (n > left(c))
        return bt_fail(BT_ERR_FORMAT,
                       "gguf: %s: truncated: %s needs %llu bytes at offset %zu but only %zu remain",
                       c->name, what, (unsigned long long)n, c->off, left(c));
    return BT_OK;
}

static int rd_u32(cursor *c, uint32_t *v, const char *what) {
    int rc = need(c, 4, what);
    if (rc) return rc;
    memcpy(v, c->b + c->off, 4);
    c->off += 4;
    return BT_OK;
}

static int rd_u64(cursor *c, uint64_t *v, const char *what) {
    int rc = need(c, 8, what);
    if (rc) return rc;
    memcpy(v, c->b + c->off, 8);
    c->off += 8;
    return BT_OK;
}

static int rd_str(cursor *c, bt_str *s, const char *what) {
    uint64_t len;
    int rc = rd_u64(c, &len, what);
    if (rc) return rc;
    if (len > left(c))
        return bt_fail(BT_ERR_FORMAT,
                       "gguf: %s: %s has length %llu at offset %zu but only %zu bytes remain",
                       c->name, what, (unsigned long long)len, c->off - 8, left(c));
    s->ptr = (const char *)c->b + c->off;
    s->len = len;
    c->off += len;
    return BT_OK;
}

/* Size of a fixed-size value type, 0 for STRING/ARRAY/unknown. */
static size_t vtype_size(uint32_t t) {
    switch (t) {
    case BT_GGUF_U8: case BT_GGUF_I8: case BT_GGUF_BOOL: return 1;
    case BT_GGUF_U16: case BT_GGUF_I16: return 2;
    case BT_GGUF_U32: case BT_GGUF_I32: case BT_GGUF_F32: return 4;
    case BT_GGUF_U64: case BT_GGUF_I64: case BT_GGUF_F64: return 8;
    default: return 0;
    }
}

static int vtype_known(uint32_t t) { return t <= BT_GGUF_F64; }

#define KEYF "'%.*s'"
#define KEYA(k) (int)((k).len > 200 ? 200 : (k).len), (k).ptr

/* Skips one value of type t at the cursor, validating lengths (and bool bytes). */
static int skip_value(cursor *c, uint32_t t, int depth, bt_str key) {
    size_t sz = vtype_size(t);
    int rc;
    if (sz) {
        if ((rc = need(c, sz, "metadata value"))) return rc;
        if (t == BT_GGUF_BOOL && c->b[c->off] > 1)
            return bt_fail(BT_ERR_FORMAT, "gguf: %s: key " KEYF ": bool value %u is not 0 or 1",
                           c->name, KEYA(key), c->b[c->off]);
        c->off += sz;
        return BT_OK;
    }
    if (t == BT_GGUF_STRING) {
        bt_str s;
        return rd_str(c, &s, "string value");
    }
    if (t != BT_GGUF_ARRAY)
        return bt_fail(BT_ERR_FORMAT, "gguf: %s: key " KEYF ": unknown value type %u", c->name,
                       KEYA(key), t);
    if (depth >= GGUF_MAX_ARRAY_DEPTH)
        return bt_fail(BT_ERR_UNSUPPORTED, "gguf: %s: key " KEYF ": arrays nested deeper than %d",
                       c->name, KEYA(key), GGUF_MAX_ARRAY_DEPTH);
    uint32_t et;
    uint64_t n;
    if ((rc = rd_u32(c, &et, "array element type")) || (rc = rd_u64(c, &n, "array length")))
        return rc;
    if (!vtype_known(et))
        return bt_fail(BT_ERR_FORMAT, "gguf: %s: key " KEYF ": unknown array element type %u",
                       c->name, KEYA(key), et);
    size_t esz = vtype_size(et);
    /* smallest encoding of one element: fixed size, 8 (string length), 12 (nested header) */
    size_t min_el = esz ? esz : et == BT_GGUF_STRING ? 8 : 12;
    if (n > left(c) / min_el)
        return bt_fail(BT_ERR_FORMAT,
                       "gguf: %s: key " KEYF ": array of %llu elements cannot fit in the %zu "
                       "bytes that remain",
                       c->name, KEYA(key), (unsigned long long)n, left(c));
    if (esz) {
        if (et == BT_GGUF_BOOL)
            for (uint64_t i = 0; i < n; i++)
                if (c->b[c->off + i] > 1)
                    return bt_fail(BT_ERR_FORMAT,
                                   "gguf: %s: key " KEYF ": bool element %llu is %u (not 0/1)",
                                   c->name, KEYA(key), (unsigned long long)i, c->b[c->off + i]);
        c->off += (size_t)n * esz;
        return BT_OK;
    }
    for (uint64_t i = 0; i < n; i++)
        if ((rc = skip_value(c, et, depth + 1, key))) return rc;
    return BT_OK;
}

static int parse_kvs(bt_gguf *g, cursor *c) {
    int rc;
    for (int64_t i = 0; i < g->n_kv; i++) {
        gkv *kv = &g->kv[i];
        kv->rec_off = c->off;
        if ((rc = rd_str(c, &kv->key, "metadata key"))) return rc;
        if (kv->key.len == 0 || kv->key.len > GGUF_MAX_KEY)
            return bt_fail(BT_ERR_FORMAT, "gguf: %s: metadata key #%lld has length %llu (1..%u)",
                           g->name, (long long)i, (unsigned long long)kv->key.len, GGUF_MAX_KEY);
        if (memchr(kv->key.ptr, 0, kv->key.len))
            return bt_fail(BT_ERR_FORMAT, "gguf: %s: metadata key #%lld contains a NUL byte",
                           g->name, (long long)i);
        uint32_t t;
        if ((rc = rd_u32(c, &t, "value type"))) return rc;
        if (!vtype_known(t))
            return bt_fail(BT_ERR_FORMAT, "gguf: %s: key " KEYF ": unknown value type %u", g->name,
                           KEYA(kv->key), t);
        kv->type = (bt_gguf_vtype)t;
        size_t start = c->off;
        if ((rc = skip_value(c, t, 0, kv->key))) return rc;
        kv->val_off = start;
        if (t == BT_GGUF_ARRAY) {
            uint32_t et;
            memcpy(&et, c->b + start, 4);
            memcpy(&kv->arr_n, c->b + start + 4, 8);
            kv->arr_type = (bt_gguf_vtype)et;
            kv->val_off = start + 12;
        }
        kv->end_off = c->off;
    }
    int64_t dup = index_build(&g->kix, g->kv, sizeof(gkv), g->n_kv);
    if (dup == -2) return bt_fail(BT_ERR_NOMEM, "gguf: %s: out of memory (key index)", g->name);
    if (dup >= 0)
        return bt_fail(BT_ERR_FORMAT, "gguf: %s: duplicate metadata key " KEYF, g->name,
                       KEYA(g->kv[dup].key));
    return BT_OK;
}

static int parse_alignment(bt_gguf *g) {
    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    int64_t i = bt_gguf_find_key(g, "general.alignment");
    if (i < 0) return BT_OK;
    if (g->kv[i].type != BT_GGUF_U32)
        return bt_fail(BT_ERR_FORMAT, "gguf: %s: general.alignment has value type %d, want u32",
                       g->name, (int)g->kv[i].type);
    uint32_t a;
    memcpy(&a, g->buf + g->kv[i].val_off, 4);
    if (a == 0 || (a & (a - 1)) != 0)
        return bt_fail(BT_ERR_FORMAT, "gguf: %s: general.alignment = %u is not a power of two",
                       g->name, a);
    g->alignment = a;
    return BT_OK;
}

static int parse_tensor_info(bt_gguf *g, cursor *c, int64_t i) {
    bt_gguf_tensor *t = &g->t[i];
    int rc;
    if ((rc = rd_str(c, &t->name, "tensor name"))) return rc;
    if (t->name.len == 0 || t->name.len > GGUF_MAX_NAME)
        return bt_fail(BT_ERR_FORMAT, "gguf: %s: tensor #%lld name length %llu (want 1..%u)",
                       g->name, (long long)i, (unsigned long long)t->name.len, GGUF_MAX_NAME);
    if (memchr(t->name.ptr, 0, t->name.len))
        return bt_fail(BT_ERR_FORMAT, "gguf: %s: tensor #%lld name contains a NUL byte", g->name,
                       (long long)i);
    if ((rc = rd_u32(c, &t->n_dims, "tensor n_dims"))) return rc;
    if (t->n_dims < 1 || t->n_dims > 4)
        return bt_fail(BT_ERR_FORMAT, "gguf: %s: tensor " KEYF ": n_dims = %u (want 1..4)",
                       g->name, KEYA(t->name), t->n_dims);
    uint64_t numel = 1;
    for (uint32_t d = 0; d < 4; d++) {
        t->ne[d] = 1;
        if (d < t->n_dims && (rc = rd_u64(c, &t->ne[d], "tensor dimension"))) return rc;
        if (t->ne[d] == 0 || t->ne[d] > (uint64_t)INT64_MAX ||
            __builtin_mul_overflow(numel, t->ne[d], &numel) || numel > (uint64_t)INT64_MAX)
            return bt_fail(BT_ERR_FORMAT,
                           "gguf: %s: tensor " KEYF ": dimension %u = %llu is zero or overflows",
                           g->name, KEYA(t->name), d, (unsigned long long)t->ne[d]);
    }
    uint32_t type;
    if ((rc = rd_u32(c, &type, "tensor type"))) return rc;
    if (type > 1000 || bt_ggml_block_bytes((int)type) == 0)
        return bt_fail(BT_ERR_UNSUPPORTED, "gguf: %s: tensor " KEYF ": unknown ggml type %u",
                       g->name, KEYA(t->name), type);
    t->type = (int)type;
    if ((rc = rd_u64(c, &t->offset, "tensor offset"))) return rc;
    int64_t blck = bt_ggml_block_elems(t->type);
    if (t->ne[0] % (uint64_t)blck != 0)
        return bt_fail(BT_ERR_FORMAT,
                       "gguf: %s: tensor " KEYF ": ne[0] = %llu is not a multiple of the %s block "
                       "size %lld",
                       g->name, KEYA(t->name), (unsigned long long)t->ne[0],
                       bt_ggml_type_name(t->type), (long long)blck);
    uint64_t row = bt_ggml_row_size(t->type, (int64_t)t->ne[0]);
    uint64_t rows = t->ne[1] * t->ne[2] * t->ne[3]; /* <= numel, no overflow */
    if (row == 0 || __builtin_mul_overflow(row, rows, &t->nbytes))
        return bt_fail(BT_ERR_FORMAT, "gguf: %s: tensor " KEYF ": byte size overflows", g->name,
                       KEYA(t->name));
    return BT_OK;
}

static int cmp_offset(const void *a, const void *b, void *arg) {
    const bt_gguf_tensor *t = arg;
    uint64_t x = t[*(const int64_t *)a].offset, y = t[*(const int64_t *)b].offset;
    return x < y ? -1 : x > y;
}

static int check_layout(bt_gguf *g) {
    uint64_t data_size = g->size > g->data_off ? g->size - g->data_off : 0;
    for (int64_t i = 0; i < g->n_tensors; i++) {
        bt_gguf_tensor *t = &g->t[i];
        if (t->offset % g->alignment != 0)
            return bt_fail(BT_ERR_FORMAT,
                           "gguf: %s: tensor " KEYF ": offset %llu is not a multiple of the "
                           "alignment %llu",
                           g->name, KEYA(t->name), (unsigned long long)t->offset,
                           (unsigned long long)g->alignment);
        if (t->offset > data_size || t->nbytes > data_size - t->offset)
            return bt_fail(BT_ERR_RANGE,
                           "gguf: %s: tensor " KEYF ": bytes [%llu, +%llu) lie outside the data "
                           "section (%llu bytes at file offset %zu)",
                           g->name, KEYA(t->name), (unsigned long long)t->offset,
                           (unsigned long long)t->nbytes, (unsigned long long)data_size,
                           g->data_off);
        t->data = g->buf + g->data_off + t->offset;
    }
    if (g->n_tensors < 2) return BT_OK;
    int64_t *order = malloc((size_t)g->n_tensors * sizeof(int64_t));
    if (!order) return bt_fail(BT_ERR_NOMEM, "gguf: %s: out of memory", g->name);
    for (int64_t i = 0; i < g->n_tensors; i++) order[i] = i;
    qsort_r(order, (size_t)g->n_tensors, sizeof(int64_t), cmp_offset, g->t);
    int rc = BT_OK;
    for (int64_t k = 1; k < g->n_tensors; k++) {
        const bt_gguf_tensor *a = &g->t[order[k - 1]], *b = &g->t[order[k]];
        if (a->offset + a->nbytes > b->offset) {
            rc = bt_fail(BT_ERR_FORMAT,
                         "gguf: %s: tensors " KEYF " [%llu, %llu) and " KEYF
                         " (offset %llu) overlap",
                         g->name, KEYA(a->name), (unsigned long long)a->offset,
                         (unsigned long long)(a->offset + a->nbytes), KEYA(b->name),
                         (unsigned long long)b->offset);
            break;
        }
    }
    free(order);
    return rc;
}

static int parse(bt_gguf *g) {
    cursor c = {g->buf, g->size, 0, g->name};
    int rc;
    if (g->size < 4 || memcmp(g->buf, GGUF_MAGIC, 4) != 0)
        return bt_fail(BT_ERR_FORMAT, "gguf: %s: bad magic (not a GGUF file)", g->name);
    c.off = 4;
    if ((rc = rd_u32(&c, &g->version, "version"))) return rc;
    if (g->version == 0x03000000u || g->version == 0x02000000u)
        return bt_fail(BT_ERR_UNSUPPORTED, "gguf: %s: big-endian GGUF is not supported", g->name);
    if (g->version != 2 && g->version != 3)
        return bt_fail(BT_ERR_UNSUPPORTED, "gguf: %s: version %u (want 2 or 3)", g->name,
                       g->version);
    uint64_t nt, nkv;
    if ((rc = rd_u64(&c, &nt, "tensor count")) || (rc = rd_u64(&c, &nkv, "metadata kv count")))
        return rc;
    /* a KV needs >= 8+1+4+1 bytes, a tensor info >= 8+1+4+8+4+8 bytes */
    if (nkv > left(&c) / 14 || nt > left(&c) / 33 || nkv * 14 + nt * 33 > left(&c))
        return bt_fail(BT_ERR_FORMAT,
                       "gguf: %s: header claims %llu tensors and %llu metadata pairs, which cannot "
                       "fit in the %zu bytes that remain",
                       g->name, (unsigned long long)nt, (unsigned long long)nkv, left(&c));
    g->n_kv = (int64_t)nkv;
    g->n_tensors = (int64_t)nt;
    g->kv = calloc(nkv ? nkv : 1, sizeof(gkv));
    if (!g->kv) return bt_fail(BT_ERR_NOMEM, "gguf: %s: out of memory (%llu kv)", g->name,
                               (unsigned long long)nkv);
    if ((rc = parse_kvs(g, &c))) return rc;
    if ((rc = parse_alignment(g))) return rc;
    if (nt > left(&c) / 33)
        return bt_fail(BT_ERR_FORMAT, "gguf: %s: %llu tensor infos cannot fit in %zu bytes",
                       g->name, (unsigned long long)nt, left(&c));
    g->t = calloc(nt ? nt : 1, sizeof(bt_gguf_tensor));
    if (!g->t) return bt_fail(BT_ERR_NOMEM, "gguf: %s: out of memory", g->name);
    for (int64_t i = 0; i < g->n_tensors; i++)
        if ((rc = parse_tensor_info(g, &c, i))) return rc;
    int64_t dup = index_build(&g->tix, g->t, sizeof(bt_gguf_tensor), g->n_tensors);
    if (dup == -2) return bt_fail(BT_ERR_NOMEM, "gguf: %s: out of memory (tensor index)", g->name);
    if (dup >= 0)
        return bt_fail(BT_ERR_FORMAT, "gguf: %s: duplicate tensor name " KEYF, g->name,
                       KEYA(g->t[dup].name));
    /* data section starts at the next multiple of the alignment */
    uint64_t rem = c.off % g->alignment;
    g->data_off = c.off + (rem ? g->alignment - rem : 0);
    if (g->n_tensors > 0 && g->data_off > g->size)
        return bt_fail(BT_ERR_FORMAT, "gguf: %s: truncated before the tensor data section",
                       g->name);
    return check_layout(g);
}

static int open_common(bt_gguf **out, bt_gguf *g, const char *name) {
    g->name = bt_xstrdup(name ? name : "<buffer>");
    int rc = bt_gguf_check(g, parse(g)); /* a file cut while we parsed: that is the error */
    if (rc) {
        bt_gguf_close(g);
        return rc;
    }
    *out = g;
    return BT_OK;
}

int bt_gguf_open(bt_gguf **out, const char *path) {
    if (!out || !path) return bt_fail(BT_ERR_INVALID, "gguf: open: NULL argument");
    *out = NULL;
    bt_gguf *g = bt_xcalloc(1, sizeof *g);
    int rc = bt_map_open(&g->map, path);
    if (rc) {
        free(g);
        return rc;
    }
    g->buf = g->map.data;
    g->size = g->map.size;
    return open_common(out, g, path);
}

int bt_gguf_open_buffer(bt_gguf **out, const void *data, size_t size, const char *name) {
    if (!out || (!data && size)) return bt_fail(BT_ERR_INVALID, "gguf: open_buffer: NULL argument");
    *out = NULL;
    bt_gguf *g = bt_xcalloc(1, sizeof *g);
    g->buf = data;
    g->size = size;
    return open_common(out, g, name);
}

int bt_gguf_check(const bt_gguf *g, int rc) {
    if (!g || !g->map.path) return rc;
    int c = bt_map_check(&g->map, BT_OK);
    return c ? bt_fail(c, "gguf: %s", bt_last_error_in("gguf")) : rc;
}

void bt_gguf_close(bt_gguf *g) {
    if (!g) return;
    bt_map_close(&g->map);
    free(g->kix.slots);
    free(g->tix.slots);
    free(g->kv);
    free(g->t);
    free(g->name);
    free(g);
}

uint32_t bt_gguf_version(const bt_gguf *g) { return g->version; }
uint64_t bt_gguf_alignment(const bt_gguf *g) { return g->alignment; }
int64_t bt_gguf_n_kv(const bt_gguf *g) { return g->n_kv; }
uint64_t bt_gguf_data_offset(const bt_gguf *g) { return g->data_off; }

bt_str bt_gguf_key_at(const bt_gguf *g, int64_t i) {
    if (!g || i < 0 || i >= g->n_kv) return (bt_str){NULL, 0};
    return g->kv[i].key;
}

int64_t bt_gguf_find_key(const bt_gguf *g, const char *key) {
    if (!g) return -1;
    return index_find(&g->kix, g->kv, sizeof(gkv), key);
}

bt_gguf_vtype bt_gguf_kv_type(const bt_gguf *g, int64_t i, bt_gguf_vtype *arr_type,
                              uint64_t *arr_n) {
    if (!g || i < 0 || i >= g->n_kv) return (bt_gguf_vtype)-1;
    const gkv *kv = &g->kv[i];
    if (arr_type) *arr_type = kv->type == BT_GGUF_ARRAY ? kv->arr_type : (bt_gguf_vtype)-1;
    if (arr_n) *arr_n = kv->type == BT_GGUF_ARRAY ? kv->arr_n : 0;
    return kv->type;
}

static int lookup(const bt_gguf *g, const char *key, const gkv **kv) {
    if (!g || !key) return bt_fail(BT_ERR_INVALID, "gguf: NULL argument");
    int64_t i = bt_gguf_find_key(g, key);
    if (i < 0) return bt_fail(BT_ERR_NOTFOUND, "gguf: %s: key '%s' not found", g->name, key);
    *kv = &g->kv[i];
    return BT_OK;
}

/* Reads an integer of vtype t at p into *neg / *mag (sign and magnitude). 0 if not integer. */
static int read_int(const uint8_t *p, bt_gguf_vtype t, int *neg, uint64_t *mag) {
    int64_t s = 0;
    uint64_t u = 0;
    int is_signed = 0;
    switch (t) {
    case BT_GGUF_U8: u = p[0]; break;
    case BT_GGUF_I8: { int8_t v; memcpy(&v, p, 1); s = v; is_signed = 1; } break;
    case BT_GGUF_U16: { uint16_t v; memcpy(&v, p, 2); u = v; } break;
    case BT_GGUF_I16: { int16_t v; memcpy(&v, p, 2); s = v; is_signed = 1; } break;
    case BT_GGUF_U32: { uint32_t v; memcpy(&v, p, 4); u = v; } break;
    case BT_GGUF_I32: { int32_t v; memcpy(&v, p, 4); s = v; is_signed = 1; } break;
    case BT_GGUF_U64: memcpy(&u, p, 8); break;
    case BT_GGUF_I64: memcpy(&s, p, 8); is_signed = 1; break;
    default: return 0;
    }
    if (is_signed) {
        *neg = s < 0;
        *mag = s < 0 ? (uint64_t)0 - (uint64_t)s : (uint64_t)s;
    } else {
        *neg = 0;
        *mag = u;
    }
    return 1;
}

int bt_gguf_get_u64(const bt_gguf *g, const char *key, uint64_t *out) {
    const gkv *kv = NULL;
    int rc = lookup(g, key, &kv), neg;
    if (rc) return rc;
    uint64_t mag;
    if (!read_int(g->buf + kv->val_off, kv->type, &neg, &mag))
        return bt_fail(BT_ERR_FORMAT, "gguf: %s: key '%s' has value type %d, not an integer",
                       g->name, key, (int)kv->type);
    if (neg)
        return bt_fail(BT_ERR_RANGE, "gguf: %s: key '%s' is negative (-%llu), want unsigned",
                       g->name, key, (unsigned long long)mag);
    *out = mag;
    return BT_OK;
}

int bt_gguf_get_i64(const bt_gguf *g, const char *key, int64_t *out) {
    const gkv *kv = NULL;
    int rc = lookup(g, key, &kv), neg;
    if (rc) return rc;
    uint64_t mag;
    if (!read_int(g->buf + kv->val_off, kv->type, &neg, &mag))
        return bt_fail(BT_ERR_FORMAT, "gguf: %s: key '%s' has value type %d, not an integer",
                       g->name, key, (int)kv->type);
    if ((!neg && mag > (uint64_t)INT64_MAX) || (neg && mag > (uint64_t)INT64_MAX + 1))
        return bt_fail(BT_ERR_RANGE, "gguf: %s: key '%s' = %s%llu does not fit in int64", g->name,
                       key, neg ? "-" : "", (unsigned long long)mag);
    *out = neg ? (int64_t)(0 - mag) : (int64_t)mag;
    return BT_OK;
}

int bt_gguf_get_f64(const bt_gguf *g, const char *key, double *out) {
    const gkv *kv = NULL;
    int rc = lookup(g, key, &kv);
    if (rc) return rc;
    if (kv->type == BT_GGUF_F32) {
        float f;
        memcpy(&f, g->buf + kv->val_off, 4);
        *out = f;
    } else if (kv->type == BT_GGUF_F64) {
        memcpy(out, g->buf + kv->val_off, 8);
    } else {
        return bt_fail(BT_ERR_FORMAT, "gguf: %s: key '%s' has value type %d, not f32/f64",
                       g->name, key, (int)kv->type);
    }
    return BT_OK;
}

int bt_gguf_get_bool(const bt_gguf *g, const char *key, int *out) {
    const gkv *kv = NULL;
    int rc = lookup(g, key, &kv);
    if (rc) return rc;
    if (kv->type != BT_GGUF_BOOL)
        return bt_fail(BT_ERR_FORMAT, "gguf: %s: key '%s' has value type %d, not bool", g->name,
                       key, (int)kv->type);
    *out = g->buf[kv->val_off] != 0;
    return BT_OK;
}

int bt_gguf_get_str(const bt_gguf *g, const char *key, bt_str *out) {
    const gkv *kv = NULL;
    int rc = lookup(g, key, &kv);
    if (rc) return rc;
    if (kv->type != BT_GGUF_STRING)
        return bt_fail(BT_ERR_FORMAT, "gguf: %s: key '%s' has value type %d, not string",
                       g->name, key, (int)kv->type);
    memcpy(&out->len, g->buf + kv->val_off, 8);
    out->ptr = (const char *)g->buf + kv->val_off + 8;
    return BT_OK;
}

int bt_gguf_get_str_arr(const bt_gguf *g, const char *key, bt_str **out, uint64_t *n) {
    const gkv *kv = NULL;
    int rc = lookup(g, key, &kv);
    if (rc) return rc;
    if (kv->type != BT_GGUF_ARRAY || kv->arr_type != BT_GGUF_STRING)
        return bt_fail(BT_ERR_FORMAT, "gguf: %s: key '%s' is not an array of strings", g->name,
                       key);
    bt_str *v = malloc((kv->arr_n ? kv->arr_n : 1) * sizeof(bt_str));
    if (!v) return bt_fail(BT_ERR_NOMEM, "gguf: %s: key '%s': out of memory", g->name, key);
    size_t off = kv->val_off; /* validated by parse */
    for (uint64_t i = 0; i < kv->arr_n; i++) {
        memcpy(&v[i].len, g->buf + off, 8);
        v[i].ptr = (const char *)g->buf + off + 8;
        off += 8 + v[i].len;
    }
    *out = v;
    *n = kv->arr_n;
    return BT_OK;
}

int bt_gguf_get_num_arr(const bt_gguf *g, const char *key, bt_gguf_vtype *elem_type,
                        const void **data, uint64_t *n) {
    const gkv *kv = NULL;
    int rc = lookup(g, key, &kv);
    if (rc) return rc;
    if (kv->type != BT_GGUF_ARRAY || vtype_size(kv->arr_type) == 0)
        return bt_fail(BT_ERR_FORMAT, "gguf: %s: key '%s' is not an array of numbers", g->name,
                       key);
    if (elem_type) *elem_type = kv->arr_type;
    *data = g->buf + kv->val_off;
    *n = kv->arr_n;
    return BT_OK;
}

int64_t bt_gguf_n_tensors(const bt_gguf *g) { return g->n_tensors; }

const bt_gguf_tensor *bt_gguf_tensor_at(const bt_gguf *g, int64_t i) {
    if (!g || i < 0 || i >= g->n_tensors) return NULL;
    return &g->t[i];
}

const bt_gguf_tensor *bt_gguf_find_tensor(const bt_gguf *g, const char *name) {
    if (!g) return NULL;
    int64_t i = index_find(&g->tix, g->t, sizeof(bt_gguf_tensor), name);
    return i < 0 ? NULL : &g->t[i];
}

/* ---------------------------------------------------------------- writer */

typedef struct {
    char *name;
    int type;
    uint32_t n_dims;
    uint64_t ne[4];
    void *data;
    uint64_t nbytes;
} wtensor;

struct bt_gguf_writer {
    uint8_t *kv;     /* serialized KV records */
    size_t kv_len, kv_cap;
    char **keys;
    int64_t n_kv, cap_keys;
    wtensor *t;
    int64_t n_t, cap_t;
    uint64_t alignment;
};

bt_gguf_writer *bt_gguf_writer_new(void) {
    bt_gguf_writer *w = bt_xcalloc(1, sizeof *w);
    w->alignment = GGUF_DEFAULT_ALIGNMENT;
    return w;
}

void bt_gguf_writer_free(bt_gguf_writer *w) {
    if (!w) return;
    for (int64_t i = 0; i < w->n_kv; i++) free(w->keys[i]);
    for (int64_t i = 0; i < w->n_t; i++) {
        free(w->t[i].name);
        free(w->t[i].data);
    }
    free(w->keys);
    free(w->t);
    free(w->kv);
    free(w);
}

static void put(bt_gguf_writer *w, const void *p, size_t n) {
    w->kv = bt_vec_xgrow(w->kv, &w->kv_cap, w->kv_len + n, 1);
    memcpy(w->kv + w->kv_len, p, n);
    w->kv_len += n;
}
static void put_u32(bt_gguf_writer *w, uint32_t v) { put(w, &v, 4); }
static void put_u64(bt_gguf_writer *w, uint64_t v) { put(w, &v, 8); }

/* Validates the key and starts a record "key, type". */
static int begin_kv(bt_gguf_writer *w, const char *key, bt_gguf_vtype type) {
    if (!w || !key) return bt_fail(BT_ERR_INVALID, "gguf writer: NULL argument");
    size_t len = strlen(key);
    if (len == 0 || len > GGUF_MAX_KEY)
        return bt_fail(BT_ERR_INVALID, "gguf writer: key length %zu (want 1..%u)", len,
                       GGUF_MAX_KEY);
    for (int64_t i = 0; i < w->n_kv; i++)
        if (strcmp(w->keys[i], key) == 0)
            return bt_fail(BT_ERR_INVALID, "gguf writer: duplicate key '%s'", key);
    if (w->n_kv == w->cap_keys) {
        w->cap_keys = w->cap_keys ? w->cap_keys * 2 : 32;
        w->keys = bt_xrealloc(w->keys, (size_t)w->cap_keys * sizeof(char *));
    }
    w->keys[w->n_kv++] = bt_xstrdup(key);
    put_u64(w, len);
    put(w, key, len);
    put_u32(w, (uint32_t)type);
    return BT_OK;
}

static int check_alignment_key(bt_gguf_writer *w, const char *key, bt_gguf_vtype type,
                               const void *val) {
    if (strcmp(key, "general.alignment") != 0) return BT_OK;
    uint32_t a = 0;
    if (type == BT_GGUF_U32) memcpy(&a, val, 4);
    if (type != BT_GGUF_U32 || a == 0 || (a & (a - 1)) != 0)
        return bt_fail(BT_ERR_INVALID, "gguf writer: general.alignment must be a u32 power of two");
    w->alignment = a;
    return BT_OK;
}

int bt_gguf_w_scalar(bt_gguf_writer *w, const char *key, bt_gguf_vtype type, const void *value) {
    size_t sz = vtype_size(type);
    if (!sz || !value)
        return bt_fail(BT_ERR_INVALID, "gguf writer: key '%s': type %d is not a fixed-size scalar",
                       key ? key : "?", (int)type);
    if (type == BT_GGUF_BOOL && *(const uint8_t *)value > 1)
        return bt_fail(BT_ERR_INVALID, "gguf writer: key '%s': bool must be 0 or 1", key);
    int rc;
    if (key && (rc = check_alignment_key(w, key, type, value))) return rc;
    if ((rc = begin_kv(w, key, type))) return rc;
    put(w, value, sz);
    return BT_OK;
}

int bt_gguf_w_u32(bt_gguf_writer *w, const char *key, uint32_t v) {
    return bt_gguf_w_scalar(w, key, BT_GGUF_U32, &v);
}
int bt_gguf_w_i32(bt_gguf_writer *w, const char *key, int32_t v) {
    return bt_gguf_w_scalar(w, key, BT_GGUF_I32, &v);
}
int bt_gguf_w_u64(bt_gguf_writer *w, const char *key, uint64_t v) {
    return bt_gguf_w_scalar(w, key, BT_GGUF_U64, &v);
}
int bt_gguf_w_f32(bt_gguf_writer *w, const char *key, float v) {
    return bt_gguf_w_scalar(w, key, BT_GGUF_F32, &v);
}
int bt_gguf_w_bool(bt_gguf_writer *w, const char *key, int v) {
    uint8_t b = v ? 1 : 0;
    return bt_gguf_w_scalar(w, key, BT_GGUF_BOOL, &b);
}

int bt_gguf_w_str(bt_gguf_writer *w, const char *key, const char *s, uint64_t len) {
    if (!s && len) return bt_fail(BT_ERR_INVALID, "gguf writer: key '%s': NULL string", key);
    int rc = begin_kv(w, key, BT_GGUF_STRING);
    if (rc) return rc;
    put_u64(w, len);
    if (len) put(w, s, (size_t)len);
    return BT_OK;
}

int bt_gguf_w_str_arr(bt_gguf_writer *w, const char *key, const bt_str *v, uint64_t n) {
    if (n && !v) return bt_fail(BT_ERR_INVALID, "gguf writer: key '%s': NULL array", key);
    for (uint64_t i = 0; i < n; i++)
        if (!v[i].ptr && v[i].len)
            return bt_fail(BT_ERR_INVALID, "gguf writer: key '%s': NULL string %llu", key,
                           (unsigned long long)i);
    int rc = begin_kv(w, key, BT_GGUF_ARRAY);
    if (rc) return rc;
    put_u32(w, BT_GGUF_STRING);
    put_u64(w, n);
    for (uint64_t i = 0; i < n; i++) {
        put_u64(w, v[i].len);
        if (v[i].len) put(w, v[i].ptr, (size_t)v[i].len);
    }
    return BT_OK;
}

int bt_gguf_w_num_arr(bt_gguf_writer *w, const char *key, bt_gguf_vtype elem_type,
                      const void *data, uint64_t n) {
    size_t sz = vtype_size(elem_type);
    if (!sz)
        return bt_fail(BT_ERR_INVALID, "gguf writer: key '%s': element type %d is not numeric",
                       key ? key : "?", (int)elem_type);
    if (n && !data) return bt_fail(BT_ERR_INVALID, "gguf writer: key '%s': NULL data", key);
    if (n > (SIZE_MAX / 2) / sz) return bt_fail(BT_ERR_INVALID, "gguf writer: array too long");
    if (elem_type == BT_GGUF_BOOL)
        for (uint64_t i = 0; i < n; i++)
            if (((const uint8_t *)data)[i] > 1)
                return bt_fail(BT_ERR_INVALID, "gguf writer: key '%s': bool must be 0 or 1", key);
    int rc = begin_kv(w, key, BT_GGUF_ARRAY);
    if (rc) return rc;
    put_u32(w, (uint32_t)elem_type);
    put_u64(w, n);
    if (n) put(w, data, (size_t)n * sz);
    return BT_OK;
}

int bt_gguf_w_copy_kv(bt_gguf_writer *w, const bt_gguf *src, const char *key) {
    if (!w || !src || !key) return bt_fail(BT_ERR_INVALID, "gguf writer: NULL argument");
    int64_t i = bt_gguf_find_key(src, key);
    if (i < 0)
        return bt_fail(BT_ERR_NOTFOUND, "gguf writer: key '%s' not in %s", key, src->name);
    const gkv *kv = &src->kv[i];
    int rc;
    if ((rc = check_alignment_key(w, key, kv->type, src->buf + kv->val_off))) return rc;
    size_t before = w->kv_len;
    if ((rc = begin_kv(w, key, kv->type))) return rc;
    w->kv_len = before; /* keep the key bookkeeping, copy the record bytes verbatim */
    put(w, src->buf + kv->rec_off, kv->end_off - kv->rec_off);
    return BT_OK;
}

int bt_gguf_w_tensor(bt_gguf_writer *w, const char *name, int type, uint32_t n_dims,
                     const uint64_t *ne, const void *data, uint64_t nbytes) {
    if (!w || !name || !ne || (!data && nbytes))
        return bt_fail(BT_ERR_INVALID, "gguf writer: NULL argument");
    size_t len = strlen(name);
    if (len == 0 || len > GGUF_MAX_NAME)
        return bt_fail(BT_ERR_INVALID, "gguf writer: tensor name '%s' length %zu (want 1..%u)",
                       name, len, GGUF_MAX_NAME);
    if (n_dims < 1 || n_dims > 4)
        return bt_fail(BT_ERR_INVALID, "gguf writer: tensor '%s': n_dims %u (want 1..4)", name,
                       n_dims);
    if (bt_ggml_block_bytes(type) == 0)
        return bt_fail(BT_ERR_UNSUPPORTED, "gguf writer: tensor '%s': unknown ggml type %d", name,
                       type);
    uint64_t numel = 1, e[4] = {1, 1, 1, 1};
    for (uint32_t d = 0; d < n_dims; d++) {
        e[d] = ne[d];
        if (ne[d] == 0 || ne[d] > (uint64_t)INT64_MAX ||
            __builtin_mul_overflow(numel, ne[d], &numel) || numel > (uint64_t)INT64_MAX)
            return bt_fail(BT_ERR_INVALID, "gguf writer: tensor '%s': bad dimension %u = %llu",
                           name, d, (unsigned long long)ne[d]);
    }
    uint64_t row = bt_ggml_row_size(type, (int64_t)e[0]), want;
    if (row == 0 || __builtin_mul_overflow(row, e[1] * e[2] * e[3], &want) || want != nbytes)
        return bt_fail(BT_ERR_INVALID,
                       "gguf writer: tensor '%s': %llu bytes given, %s [%llu,%llu,%llu,%llu] "
                       "needs %llu (ne[0] must be a multiple of the block size)",
                       name, (unsigned long long)nbytes, bt_ggml_type_name(type),
                       (unsigned long long)e[0], (unsigned long long)e[1],
                       (unsigned long long)e[2], (unsigned long long)e[3],
                       (unsigned long long)(row ? want : 0));
    for (int64_t i = 0; i < w->n_t; i++)
        if (strcmp(w->t[i].name, name) == 0)
            return bt_fail(BT_ERR_INVALID, "gguf writer: duplicate tensor '%s'", name);
    int64_t bad_at = 0; /* no nan/inf ever reaches a file (issue 10 §4); every type our exporters
                         * write is checked; the few bt_ggml_all_finite cannot read (IQ*, TQ*:
                         * -1) are only ever copied from an input file, so they pass as they are */
    if (bt_ggml_all_finite(type, data, (size_t)nbytes, &bad_at) == 0)
        return bt_fail(BT_ERR_INVALID, "gguf writer: tensor '%s' (%s) holds a non-finite value (at element "
                       "%lld): refusing to write it", name, bt_ggml_type_name(type), (long long)bad_at);
    void *copy = malloc(nbytes ? (size_t)nbytes : 1);
    if (!copy)
        return bt_fail(BT_ERR_NOMEM, "gguf writer: tensor '%s': out of memory (%llu bytes)", name,
                       (unsigned long long)nbytes);
    if (nbytes) memcpy(copy, data, (size_t)nbytes);
    if (w->n_t == w->cap_t) {
        w->cap_t = w->cap_t ? w->cap_t * 2 : 64;
        w->t = bt_xrealloc(w->t, (size_t)w->cap_t * sizeof(wtensor));
    }
    wtensor *t = &w->t[w->n_t++];
    t->name = bt_xstrdup(name);
    t->type = type;
    t->n_dims = n_dims;
    memcpy(t->ne, e, sizeof e);
    t->data = copy;
    t->nbytes = nbytes;
    return BT_OK;
}

static int write_zeros(bt_atomic_file *af, uint64_t n) {
    static const uint8_t zeros[4096];
    int rc = BT_OK;
    while (n && rc == BT_OK) {
        size_t k = n > sizeof zeros ? sizeof zeros : (size_t)n;
        rc = bt_atomic_write(af, zeros, k);
        n -= k;
    }
    return rc;
}

static uint64_t pad_to(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

int bt_gguf_writer_write(bt_gguf_writer *w, const char *path) {
    if (!w || !path) return bt_fail(BT_ERR_INVALID, "gguf writer: NULL argument");
    /* header + KVs + tensor infos, built in a second buffer */
    bt_gguf_writer h = {0};
    put(&h, GGUF_MAGIC, 4);
    put_u32(&h, 3);
    put_u64(&h, (uint64_t)w->n_t);
    put_u64(&h, (uint64_t)w->n_kv);
    if (w->kv_len) put(&h, w->kv, w->kv_len);
    uint64_t off = 0;
    for (int64_t i = 0; i < w->n_t; i++) {
        const wtensor *t = &w->t[i];
        size_t len = strlen(t->name);
        put_u64(&h, len);
        put(&h, t->name, len);
        put_u32(&h, t->n_dims);
        for (uint32_t d = 0; d < t->n_dims; d++) put_u64(&h, t->ne[d]);
        put_u32(&h, (uint32_t)t->type);
        put_u64(&h, off);
        off = pad_to(off + t->nbytes, w->alignment);
    }
    bt_atomic_file af;
    int rc = bt_atomic_open(&af, path, "gguf writer");
    if (rc) goto out;
    uint64_t hpad = pad_to(h.kv_len, w->alignment) - h.kv_len;
    if ((rc = bt_atomic_write(&af, h.kv, h.kv_len)) || (rc = write_zeros(&af, hpad))) goto fail;
    for (int64_t i = 0; i < w->n_t; i++) {
        const wtensor *t = &w->t[i];
        if ((rc = bt_atomic_write(&af, t->data, (size_t)t->nbytes))) goto fail;
        uint64_t p = pad_to(t->nbytes, w->alignment) - t->nbytes;
        if ((rc = write_zeros(&af, p))) goto fail;
    }
    rc = bt_atomic_commit(&af);
    goto out;
fail:
    bt_atomic_abort(&af);
out:
    free(h.kv);
    return rc;
}
