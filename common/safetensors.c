/* safetensors reader and writer. See safetensors.h.
 * Format and validation rules: huggingface/safetensors README.md and safetensors/src/tensor.rs
 * (MAX_HEADER_SIZE = 100,000,000; tensors sorted by offsets must tile the data buffer exactly,
 * from 0 to its end, without gaps or overlap; END-BEGIN == numel * dtype size; duplicate keys
 * rejected). Writer: as safetensors/src/tensor.rs `prepare`: tensors ordered by descending dtype
 * size then name, header padded with spaces to a multiple of 8 bytes. JSON via jansson. */
#include "common/safetensors.h"

#include "common/atomic_io.h"
#include "common/bt_common.h"
#include "common/gguf.h"
#include "common/quant.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors reader assumes a little-endian host"
#endif

#define ST_MAX_HEADER 100000000ull /* safetensors/src/tensor.rs MAX_HEADER_SIZE */
#define ST_MAX_DIMS 8

static const struct {
    const char *name;
    size_t size;
} g_dtypes[] = {
    [BT_ST_F32] = {"F32", 4},  [BT_ST_F16] = {"F16", 2}, [BT_ST_BF16] = {"BF16", 2},
    [BT_ST_U8] = {"U8", 1},    [BT_ST_I8] = {"I8", 1},   [BT_ST_I32] = {"I32", 4},
    [BT_ST_I64] = {"I64", 8},  [BT_ST_F64] = {"F64", 8}, [BT_ST_BOOL] = {"BOOL", 1},
    [BT_ST_I16] = {"I16", 2},  [BT_ST_U16] = {"U16", 2}, [BT_ST_U32] = {"U32", 4},
    [BT_ST_U64] = {"U64", 8},
};
#define N_DTYPES ((int)(sizeof g_dtypes / sizeof g_dtypes[0]))

const char *bt_st_dtype_name(bt_st_dtype d) {
    return (int)d >= 0 && (int)d < N_DTYPES ? g_dtypes[d].name : "?";
}

size_t bt_st_dtype_size(bt_st_dtype d) {
    return (int)d >= 0 && (int)d < N_DTYPES ? g_dtypes[d].size : 0;
}

int bt_st_dtype_from_name(const char *name, bt_st_dtype *out) {
    for (int i = 0; name && i < N_DTYPES; i++)
        if (strcmp(g_dtypes[i].name, name) == 0) {
            *out = (bt_st_dtype)i;
            return BT_OK;
        }
    return bt_fail(BT_ERR_UNSUPPORTED, "safetensors: unsupported dtype '%s'", name ? name : "");
}

/* ---------------------------------------------------------------- reader */

struct bt_st_file {
    bt_map map;
    char *path;
    int n;
    bt_st_tensor *t;   /* in data-offset order */
    int *by_name;      /* indices sorted by name */
    int n_meta;
    char **meta_keys, **meta_vals;
};

static int cmp_name_idx(const void *a, const void *b, void *arg) {
    const bt_st_tensor *t = arg;
    return strcmp(t[*(const int *)a].name, t[*(const int *)b].name);
}

typedef struct {
    size_t begin, end;
    int idx;
} span;

static int cmp_span(const void *a, const void *b) {
    const span *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

void bt_st_close(bt_st_file *f) {
    if (!f) return;
    for (int i = 0; i < f->n; i++) free(f->t[i].name);
    for (int i = 0; i < f->n_meta; i++) {
        free(f->meta_keys[i]);
        free(f->meta_vals[i]);
    }
    free(f->meta_keys);
    free(f->meta_vals);
    free(f->t);
    free(f->by_name);
    bt_map_close(&f->map);
    free(f->path);
    free(f);
}

static int get_u64(json_t *v, uint64_t *out) {
    if (!json_is_integer(v) || json_integer_value(v) < 0) return -1;
    *out = (uint64_t)json_integer_value(v);
    return 0;
}

static int parse_tensor(bt_st_file *f, const char *name, json_t *info, size_t buf_size,
                        span *sp) {
    bt_st_tensor *t = &f->t[f->n];
    if (!json_is_object(info))
        return bt_fail(BT_ERR_FORMAT, "safetensors: %s: tensor '%s': entry is not an object",
                       f->path, name);
    json_t *dt = json_object_get(info, "dtype"), *shape = json_object_get(info, "shape"),
           *offs = json_object_get(info, "data_offsets");
    if (!json_is_string(dt) || !json_is_array(shape) || !json_is_array(offs) ||
        json_array_size(offs) != 2)
        return bt_fail(BT_ERR_FORMAT,
                       "safetensors: %s: tensor '%s': needs \"dtype\" (string), \"shape\" "
                       "(array) and \"data_offsets\" ([begin, end])",
                       f->path, name);
    int rc = bt_st_dtype_from_name(json_string_value(dt), &t->dtype);
    if (rc)
        return bt_fail(rc, "safetensors: %s: tensor '%s': unsupported dtype '%s'", f->path, name,
                       json_string_value(dt));
    size_t nd = json_array_size(shape);
    if (nd > ST_MAX_DIMS)
        return bt_fail(BT_ERR_UNSUPPORTED, "safetensors: %s: tensor '%s': %zu dims (max %d)",
                       f->path, name, nd, ST_MAX_DIMS);
    t->n_dims = (int)nd;
    uint64_t numel = 1, nbytes, b, e;
    for (size_t d = 0; d < nd; d++) {
        uint64_t v;
        if (get_u64(json_array_get(shape, d), &v) || v > (uint64_t)INT64_MAX ||
            __builtin_mul_overflow(numel, v, &numel))
            return bt_fail(BT_ERR_FORMAT,
                           "safetensors: %s: tensor '%s': shape[%zu] is not a non-negative "
                           "integer or the element count overflows",
                           f->path, name, d);
        t->shape[d] = (int64_t)v;
    }
    for (size_t d = nd; d < ST_MAX_DIMS; d++) t->shape[d] = 1;
    if (__builtin_mul_overflow(numel, (uint64_t)bt_st_dtype_size(t->dtype), &nbytes))
        return bt_fail(BT_ERR_FORMAT, "safetensors: %s: tensor '%s': byte size overflows",
                       f->path, name);
    if (get_u64(json_array_get(offs, 0), &b) || get_u64(json_array_get(offs, 1), &e) || b > e)
        return bt_fail(BT_ERR_FORMAT,
                       "safetensors: %s: tensor '%s': data_offsets must be integers 0 <= begin "
                       "<= end",
                       f->path, name);
    if (e > buf_size)
        return bt_fail(BT_ERR_RANGE,
                       "safetensors: %s: tensor '%s': data_offsets [%llu, %llu] exceed the %zu "
                       "byte data buffer",
                       f->path, name, (unsigned long long)b, (unsigned long long)e, buf_size);
    if (e - b != nbytes)
        return bt_fail(BT_ERR_FORMAT,
                       "safetensors: %s: tensor '%s': %llu bytes in data_offsets but shape x %s "
                       "needs %llu",
                       f->path, name, (unsigned long long)(e - b), bt_st_dtype_name(t->dtype),
                       (unsigned long long)nbytes);
    t->nbytes = (size_t)nbytes;
    sp->begin = (size_t)b;
    sp->end = (size_t)e;
    sp->idx = f->n;
    t->name = bt_xstrdup(name);
    f->n++;
    return BT_OK;
}

static int parse_metadata(bt_st_file *f, json_t *meta) {
    if (!json_is_object(meta))
        return bt_fail(BT_ERR_FORMAT, "safetensors: %s: __metadata__ is not an object", f->path);
    size_t n = json_object_size(meta);
    f->meta_keys = bt_xcalloc(n, sizeof(char *));
    f->meta_vals = bt_xcalloc(n, sizeof(char *));
    const char *k;
    json_t *v;
    json_object_foreach(meta, k, v) {
        if (!json_is_string(v))
            return bt_fail(BT_ERR_FORMAT, "safetensors: %s: __metadata__ value for '%s' is not a "
                           "string", f->path, k);
        f->meta_keys[f->n_meta] = bt_xstrdup(k);
        f->meta_vals[f->n_meta] = bt_xstrdup(json_string_value(v));
        f->n_meta++;
    }
    return BT_OK;
}

static int parse_header(bt_st_file *f) {
    const uint8_t *d = f->map.data;
    size_t size = f->map.size;
    if (size < 8)
        return bt_fail(BT_ERR_FORMAT, "safetensors: %s: file of %zu bytes is too short", f->path,
                       size);
    uint64_t hn;
    memcpy(&hn, d, 8);
    if (hn > ST_MAX_HEADER || hn > size - 8)
        return bt_fail(BT_ERR_FORMAT,
                       "safetensors: %s: header length %llu exceeds the file (%zu bytes) or the "
                       "100 MB limit",
                       f->path, (unsigned long long)hn, size);
    if (hn < 2 || d[8] != '{')
        return bt_fail(BT_ERR_FORMAT, "safetensors: %s: header is not a JSON object", f->path);
    json_error_t jerr;
    json_t *root = json_loadb((const char *)d + 8, (size_t)hn, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return bt_fail(BT_ERR_FORMAT, "safetensors: %s: header JSON: %s (line %d col %d)",
                       f->path, jerr.text, jerr.line, jerr.column);
    int rc = BT_OK;
    span *sp = NULL;
    if (!json_is_object(root)) {
        rc = bt_fail(BT_ERR_FORMAT, "safetensors: %s: header is not a JSON object", f->path);
        goto out;
    }
    size_t buf_size = size - 8 - (size_t)hn;
    size_t nkeys = json_object_size(root);
    if (nkeys > (size_t)INT32_MAX) {
        rc = bt_fail(BT_ERR_FORMAT, "safetensors: %s: too many tensors", f->path);
        goto out;
    }
    f->t = bt_xcalloc(nkeys, sizeof(bt_st_tensor));
    sp = bt_xcalloc(nkeys, sizeof(span));
    const char *k;
    json_t *v;
    json_object_foreach(root, k, v) {
        if (strcmp(k, "__metadata__") == 0) rc = parse_metadata(f, v);
        else rc = parse_tensor(f, k, v, buf_size, &sp[f->n]);
        if (rc) goto out;
    }
    /* tensors sorted by offset must tile [0, buf_size) exactly */
    qsort(sp, (size_t)f->n, sizeof(span), cmp_span);
    size_t expect = 0;
    for (int i = 0; i < f->n; i++) {
        if (sp[i].begin != expect) {
            rc = bt_fail(BT_ERR_FORMAT,
                         "safetensors: %s: tensor '%s' starts at %zu but the previous tensor ends "
                         "at %zu (overlap or gap)",
                         f->path, f->t[sp[i].idx].name, sp[i].begin, expect);
            goto out;
        }
        expect = sp[i].end;
    }
    if (expect != buf_size) {
        rc = bt_fail(BT_ERR_FORMAT,
                     "safetensors: %s: tensors cover %zu bytes but the data buffer has %zu",
                     f->path, expect, buf_size);
        goto out;
    }
    /* reorder the tensors into file order */
    bt_st_tensor *ordered = bt_xcalloc((size_t)(f->n ? f->n : 1), sizeof(bt_st_tensor));
    for (int i = 0; i < f->n; i++) {
        ordered[i] = f->t[sp[i].idx];
        ordered[i].data = d + 8 + hn + sp[i].begin;
    }
    free(f->t);
    f->t = ordered;
    f->by_name = bt_xcalloc((size_t)(f->n ? f->n : 1), sizeof(int));
    for (int i = 0; i < f->n; i++) f->by_name[i] = i;
    qsort_r(f->by_name, (size_t)f->n, sizeof(int), cmp_name_idx, f->t);
out:
    free(sp);
    json_decref(root);
    return rc;
}

int bt_st_open(bt_st_file **out, const char *path) {
    if (!out || !path) return bt_fail(BT_ERR_INVALID, "safetensors: open: NULL argument");
    *out = NULL;
    bt_st_file *f = bt_xcalloc(1, sizeof *f);
    f->path = bt_xstrdup(path);
    int rc = bt_map_open(&f->map, path);
    if (rc == BT_OK) rc = bt_st_check(f, parse_header(f));
    if (rc) {
        bt_st_close(f);
        return rc;
    }
    *out = f;
    return BT_OK;
}

int bt_st_check(const bt_st_file *f, int rc) {
    if (!f || !f->map.path) return rc;
    int c = bt_map_check(&f->map, BT_OK);
    return c ? bt_fail(c, "safetensors: %s", bt_last_error_in("safetensors")) : rc;
}

int bt_st_n_tensors(const bt_st_file *f) { return f ? f->n : 0; }

const bt_st_tensor *bt_st_tensor_at(const bt_st_file *f, int i) {
    if (!f || i < 0 || i >= f->n) return NULL;
    return &f->t[i];
}

const bt_st_tensor *bt_st_find(const bt_st_file *f, const char *name) {
    if (!f || !name) return NULL;
    int lo = 0, hi = f->n - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        int c = strcmp(f->t[f->by_name[mid]].name, name);
        if (c == 0) return &f->t[f->by_name[mid]];
        if (c < 0) lo = mid + 1;
        else hi = mid - 1;
    }
    return NULL;
}

const char *bt_st_metadata(const bt_st_file *f, const char *key) {
    if (!f || !key) return NULL;
    for (int i = 0; i < f->n_meta; i++)
        if (strcmp(f->meta_keys[i], key) == 0) return f->meta_vals[i];
    return NULL;
}

/* ---------------------------------------------------------------- writer */

typedef struct {
    char *name;
    bt_st_dtype dtype;
    int n_dims;
    int64_t shape[ST_MAX_DIMS];
    void *data;
    size_t nbytes;
} wtensor;

struct bt_st_writer {
    wtensor *t;
    int n, cap;
    json_t *meta;
};

bt_st_writer *bt_st_writer_new(void) {
    bt_st_writer *w = bt_xcalloc(1, sizeof *w);
    w->meta = json_object();
    if (!w->meta) {
        free(w);
        return NULL;
    }
    return w;
}

void bt_st_writer_free(bt_st_writer *w) {
    if (!w) return;
    for (int i = 0; i < w->n; i++) {
        free(w->t[i].name);
        free(w->t[i].data);
    }
    free(w->t);
    json_decref(w->meta);
    free(w);
}

int bt_st_w_metadata(bt_st_writer *w, const char *key, const char *value) {
    if (!w || !key || !value) return bt_fail(BT_ERR_INVALID, "safetensors writer: NULL argument");
    if (json_object_get(w->meta, key))
        return bt_fail(BT_ERR_INVALID, "safetensors writer: duplicate metadata key '%s'", key);
    json_t *s = json_string(value);
    if (!s || json_object_set_new(w->meta, key, s) != 0)
        return bt_fail(BT_ERR_INVALID,
                       "safetensors writer: metadata '%s': key/value must be valid UTF-8", key);
    return BT_OK;
}

int bt_st_w_tensor(bt_st_writer *w, const char *name, bt_st_dtype dtype, int n_dims,
                   const int64_t *shape, const void *data, size_t nbytes) {
    if (!w || !name || (n_dims > 0 && !shape) || (!data && nbytes))
        return bt_fail(BT_ERR_INVALID, "safetensors writer: NULL argument");
    if (!name[0] || strcmp(name, "__metadata__") == 0)
        return bt_fail(BT_ERR_INVALID, "safetensors writer: invalid tensor name '%s'", name);
    size_t es = bt_st_dtype_size(dtype);
    if (!es) return bt_fail(BT_ERR_INVALID, "safetensors writer: tensor '%s': bad dtype %d", name,
                            (int)dtype);
    if (n_dims < 0 || n_dims > ST_MAX_DIMS)
        return bt_fail(BT_ERR_INVALID, "safetensors writer: tensor '%s': n_dims %d (0..%d)", name,
                       n_dims, ST_MAX_DIMS);
    uint64_t numel = 1, want;
    for (int d = 0; d < n_dims; d++)
        if (shape[d] < 0 || __builtin_mul_overflow(numel, (uint64_t)shape[d], &numel))
            return bt_fail(BT_ERR_INVALID, "safetensors writer: tensor '%s': bad shape[%d] = %lld",
                           name, d, (long long)shape[d]);
    if (__builtin_mul_overflow(numel, (uint64_t)es, &want) || want != nbytes)
        return bt_fail(BT_ERR_INVALID,
                       "safetensors writer: tensor '%s': %zu bytes given, shape x %s needs %llu",
                       name, nbytes, bt_st_dtype_name(dtype), (unsigned long long)want);
    for (int i = 0; i < w->n; i++)
        if (strcmp(w->t[i].name, name) == 0)
            return bt_fail(BT_ERR_INVALID, "safetensors writer: duplicate tensor '%s'", name);
    int64_t bad_at = 0; /* no nan/inf ever reaches a file (issue 10 §4) */
    int gt = dtype == BT_ST_F32 ? BT_GGML_F32 : dtype == BT_ST_F16 ? BT_GGML_F16 : dtype == BT_ST_BF16 ? BT_GGML_BF16 : -1;
    int fin = 1;
    if (gt >= 0) fin = bt_ggml_all_finite(gt, data, nbytes, &bad_at) == 1;
    else if (dtype == BT_ST_F64)
        for (size_t i = 0; fin && i < nbytes / 8; i++) {
            double d;
            memcpy(&d, (const uint8_t *)data + 8 * i, 8);
            if (!isfinite(d)) {
                fin = 0;
                bad_at = (int64_t)i;
            }
        }
    if (!fin)
        return bt_fail(BT_ERR_INVALID, "safetensors writer: tensor '%s' (%s) holds a non-finite value (at "
                       "element %lld): refusing to write it", name, bt_st_dtype_name(dtype), (long long)bad_at);
    /* the name must be representable as a JSON key */
    json_t *probe = json_object();
    int bad = !probe || json_object_set_new(probe, name, json_null()) != 0;
    json_decref(probe);
    if (bad) return bt_fail(BT_ERR_INVALID, "safetensors writer: tensor name is not valid UTF-8");
    void *copy = malloc(nbytes ? nbytes : 1);
    if (!copy)
        return bt_fail(BT_ERR_NOMEM, "safetensors writer: tensor '%s': out of memory (%zu bytes)",
                       name, nbytes);
    if (nbytes) memcpy(copy, data, nbytes);
    if (w->n == w->cap) {
        w->cap = w->cap ? w->cap * 2 : 32;
        w->t = bt_xrealloc(w->t, (size_t)w->cap * sizeof(wtensor));
    }
    wtensor *t = &w->t[w->n++];
    t->name = bt_xstrdup(name);
    t->dtype = dtype;
    t->n_dims = n_dims;
    for (int d = 0; d < ST_MAX_DIMS; d++) t->shape[d] = d < n_dims ? shape[d] : 1;
    t->data = copy;
    t->nbytes = nbytes;
    return BT_OK;
}

/* safetensors/src/tensor.rs prepare(): descending dtype size (alignment), then name */
static int cmp_wtensor(const void *a, const void *b) {
    const wtensor *x = a, *y = b;
    size_t sx = bt_st_dtype_size(x->dtype), sy = bt_st_dtype_size(y->dtype);
    if (sx != sy) return sx > sy ? -1 : 1;
    return strcmp(x->name, y->name);
}

int bt_st_writer_write(bt_st_writer *w, const char *path) {
    if (!w || !path) return bt_fail(BT_ERR_INVALID, "safetensors writer: NULL argument");
    if (w->n > 1) qsort(w->t, (size_t)w->n, sizeof(wtensor), cmp_wtensor);
    json_t *root = json_object();
    if (!root) return bt_fail(BT_ERR_NOMEM, "safetensors writer: out of memory");
    if (json_object_size(w->meta) > 0) json_object_set(root, "__metadata__", w->meta);
    uint64_t off = 0;
    for (int i = 0; i < w->n; i++) {
        const wtensor *t = &w->t[i];
        json_t *shape = json_array();
        for (int d = 0; d < t->n_dims; d++) json_array_append_new(shape, json_integer(t->shape[d]));
        json_t *e = json_pack("{s:s, s:o, s:[I,I]}", "dtype", bt_st_dtype_name(t->dtype), "shape",
                              shape, "data_offsets", (json_int_t)off,
                              (json_int_t)(off + t->nbytes));
        if (!e || json_object_set_new(root, t->name, e) != 0) {
            json_decref(root);
            return bt_fail(BT_ERR_NOMEM, "safetensors writer: building header for '%s'", t->name);
        }
        off += t->nbytes;
    }
    char *js = json_dumps(root, JSON_COMPACT | JSON_SORT_KEYS);
    json_decref(root);
    if (!js) return bt_fail(BT_ERR_NOMEM, "safetensors writer: JSON encoding failed");
    size_t jl = strlen(js);
    size_t hn = (jl + 7) / 8 * 8;
    uint8_t *head = bt_xmalloc(8 + hn);
    uint64_t hn64 = hn;
    memcpy(head, &hn64, 8);
    memcpy(head + 8, js, jl);
    memset(head + 8 + jl, ' ', hn - jl);
    free(js);

    bt_atomic_file af;
    int rc = bt_atomic_open(&af, path, "safetensors writer");
    if (rc) goto out;
    if ((rc = bt_atomic_write(&af, head, 8 + hn))) goto fail;
    for (int i = 0; i < w->n; i++)
        if ((rc = bt_atomic_write(&af, w->t[i].data, w->t[i].nbytes))) goto fail;
    rc = bt_atomic_commit(&af);
    goto out;
fail:
    bt_atomic_abort(&af);
out:
    free(head);
    return rc;
}
