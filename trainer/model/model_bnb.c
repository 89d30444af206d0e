/* bitsandbytes 4-bit linears in Hugging Face safetensors checkpoints: read and validate the
 * pieces of QuantState.as_dict(packed=True) (docs/formats/nf4.md §Checkpoint), dequantise them,
 * or take NF4 blocks as they are (bt_nf4_from_bnb, model.h). Split out of model_hf.c, which
 * calls the stages through model_internal.h. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "common/bt_json.h"
#include "common/quant.h"
#include "common/safetensors.h"
#include "trainer/model/model.h"
#include "trainer/model/model_internal.h"

/* ---------------------------------------------------------------- bitsandbytes 4-bit */


static const bt_st_tensor *find_any(bt_st_file *const *files, int n_files, const char *name) {
    for (int i = 0; i < n_files; i++) {
        const bt_st_tensor *t = bt_st_find(files[i], name);
        if (t) return t;
    }
    return NULL;
}

static int64_t numel(const bt_st_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->n_dims; i++) n *= t->shape[i];
    return n;
}

/* Fetch `<w><suffix>` with the given dtype and element count (shape otherwise free). */
static int bnb_get(const bt_st_tensor **out, bt_st_file *const *files, int n_files,
                   const char *w, const char *suffix, bt_st_dtype dtype, int64_t count,
                   const char *path) {
    char name[512];
    snprintf(name, sizeof name, "%s%s", w, suffix);
    const bt_st_tensor *t = find_any(files, n_files, name);
    *out = t;
    if (!t)
        return bt_fail(BT_ERR_NOTFOUND, "model: %s: bitsandbytes tensor %s is missing", path, name);
    if (t->dtype != dtype)
        return bt_fail(BT_ERR_FORMAT, "model: %s: bitsandbytes tensor %s has dtype %s, expected %s",
                       path, name, bt_st_dtype_name(t->dtype), bt_st_dtype_name(dtype));
    if (count >= 0 && numel(t) != count)
        return bt_fail(BT_ERR_FORMAT, "model: %s: bitsandbytes tensor %s has %lld elements, "
                       "expected %lld", path, name, (long long)numel(t), (long long)count);
    return 0;
}

/* Read and validate every piece of the bnb checkpoint of weight `w` [rows, cols]. */
int bt_bnb_read(bt_bnb_parts *p, bt_st_file *const *files, int n_files, const char *w,
                    int64_t rows, int64_t cols, const char *path) {
    memset(p, 0, sizeof *p);
    p->n = rows * cols;
    const bt_st_tensor *t, *qs;
    char name[512];
    snprintf(name, sizeof name, "%s.quant_state.bitsandbytes__nf4", w);
    qs = find_any(files, n_files, name);
    if (!qs) {
        snprintf(name, sizeof name, "%s.quant_state.bitsandbytes__fp4", w);
        qs = find_any(files, n_files, name);
        p->fp4 = 1;
    }
    if (!qs)
        return bt_fail(BT_ERR_NOTFOUND, "model: %s: %s.quant_state.bitsandbytes__nf4 is missing",
                       path, w);
    if (qs->dtype != BT_ST_U8)
        return bt_fail(BT_ERR_FORMAT, "model: %s: %s has dtype %s, expected U8 (JSON bytes)", path,
                       name, bt_st_dtype_name(qs->dtype));
    json_t *js = NULL;
    if (bt_json_loadb(&js, qs->data, qs->nbytes, 0, name) || !json_is_object(js)) {
        const char *why = js ? "wrong type" : bt_last_error();
        int frc = bt_fail(BT_ERR_FORMAT, "model: %s: %s is not a JSON object (%s)", path, name, why);
        json_decref(js);
        return frc;
    }
    int rc = 0;
    double d;
    const char *qt = json_string_value(json_object_get(js, "quant_type"));
    json_t *shape = json_object_get(js, "shape");
    if (!qt || strcmp(qt, p->fp4 ? "fp4" : "nf4") != 0) {
        rc = bt_fail(BT_ERR_FORMAT, "model: %s: %s: quant_type is \"%s\", expected \"%s\"", path,
                     name, qt ? qt : "(missing)", p->fp4 ? "fp4" : "nf4");
        goto out;
    }
    if (!bt_model_json_num(json_object_get(js, "blocksize"), &d) || d < 16 || d > 4096 ||
        d != floor(d) || ((int)d & ((int)d - 1)) != 0) {
        rc = bt_fail(BT_ERR_FORMAT, "model: %s: %s: blocksize missing or not a power of two in "
                     "[16, 4096]", path, name);
        goto out;
    }
    p->blocksize = (int)d;
    if (!json_is_array(shape) || json_array_size(shape) != 2 ||
        json_integer_value(json_array_get(shape, 0)) != rows ||
        json_integer_value(json_array_get(shape, 1)) != cols) {
        char *s = shape ? json_dumps(shape, JSON_COMPACT | JSON_ENCODE_ANY) : NULL;
        rc = bt_fail(BT_ERR_FORMAT, "model: %s: %s: shape %s, expected [%lld, %lld]", path, name,
                     s ? s : "(missing)", (long long)rows, (long long)cols);
        free(s);
        goto out;
    }
    p->nb = (p->n + p->blocksize - 1) / p->blocksize;
    if ((rc = bnb_get(&t, files, n_files, w, "", BT_ST_U8, (p->n + 1) / 2, path))) goto out;
    p->packed = t->data;
    if ((rc = bnb_get(&t, files, n_files, w, ".quant_map", BT_ST_F32, 16, path))) goto out;
    memcpy(p->qmap, t->data, sizeof p->qmap);
    snprintf(name, sizeof name, "%s.absmax", w);
    t = find_any(files, n_files, name);
    if (!t) {
        rc = bt_fail(BT_ERR_NOTFOUND, "model: %s: bitsandbytes tensor %s is missing", path, name);
        goto out;
    }
    p->nested = t->dtype == BT_ST_U8;
    if ((rc = bnb_get(&t, files, n_files, w, ".absmax", p->nested ? BT_ST_U8 : BT_ST_F32, p->nb,
                      path)))
        goto out;
    p->absmax = t->data;
    if (p->nested) {
        if (!bt_model_json_num(json_object_get(js, "nested_blocksize"), &d) || d < 1 || d > 65536 ||
            d != floor(d)) {
            rc = bt_fail(BT_ERR_FORMAT, "model: %s: %s: nested_blocksize missing or invalid", path,
                         w);
            goto out;
        }
        p->nested_blocksize = (int)d;
        if (!bt_model_json_num(json_object_get(js, "nested_offset"), &d) || !isfinite(d)) {
            rc = bt_fail(BT_ERR_FORMAT, "model: %s: %s: nested_offset missing or not a finite "
                         "number", path, w);
            goto out;
        }
        p->offset = (float)d;
        p->n_nested = (p->nb + p->nested_blocksize - 1) / p->nested_blocksize;
        if ((rc = bnb_get(&t, files, n_files, w, ".nested_absmax", BT_ST_F32, p->n_nested, path)))
            goto out;
        p->nested_absmax = t->data;
        if ((rc = bnb_get(&t, files, n_files, w, ".nested_quant_map", BT_ST_F32, 256, path)))
            goto out;
        memcpy(p->nmap, t->data, sizeof p->nmap);
    }
out:
    json_decref(js);
    return rc;
}

static float ld_f32(const void *base, int64_t i) {
    float v;
    memcpy(&v, (const uint8_t *)base + i * 4, 4);
    return v;
}

/* Exact bitsandbytes dequantisation with the stored maps (functional.dequantize_4bit):
 * absmax[b] = nested ? nmap[q[b]] * nested_absmax[b / nbs] + offset : absmax_f32[b];
 * out[i] = qmap[nibble(i)] * absmax[i / blocksize], element 2j in the high nibble. */
int bt_bnb_dequant(const bt_bnb_parts *p, float **out, const char *w, const char *path) {
    float *am = malloc((size_t)p->nb * sizeof(float));
    float *o = bt_aligned_alloc((size_t)p->n * sizeof(float));
    if (!am || !o) {
        free(am);
        free(o);
        return bt_fail(BT_ERR_NOMEM, "model: %s: out of memory dequantising %s", path, w);
    }
    for (int64_t b = 0; b < p->nb; b++)
        am[b] = p->nested ? p->nmap[((const uint8_t *)p->absmax)[b]] *
                                    ld_f32(p->nested_absmax, b / p->nested_blocksize) +
                                p->offset
                          : ld_f32(p->absmax, b);
    for (int64_t i = 0; i < p->n; i++) {
        uint8_t byte = p->packed[i / 2];
        o[i] = p->qmap[(i & 1) ? (byte & 15) : (byte >> 4)] * am[i / p->blocksize];
    }
    free(am);
    for (int64_t i = 0; i < p->n; i++)
        if (!isfinite(o[i])) {
            free(o);
            return bt_fail(BT_ERR_FORMAT, "model: %s: %s: non-finite value at element %lld after "
                           "dequantisation", path, w, (long long)i);
        }
    *out = o;
    return 0;
}

/* Whether the checkpoint is exactly what bt_nf4 holds (and decodes with bt_nf4_code /
 * bt_dynamic_code8); on 0 the message says why not. */
int bt_bnb_direct_ok(const bt_bnb_parts *p, const char *w, const char *path) {
    if (p->fp4) return bt_fail(BT_ERR_UNSUPPORTED, "model: %s: %s: fp4 is not held as NF4", path, w);
    if (!p->nested)
        return bt_fail(BT_ERR_UNSUPPORTED, "model: %s: %s: no double quantisation (F32 absmax)",
                       path, w);
    if (p->blocksize != BT_NF4_BLOCKSIZE || p->nested_blocksize != BT_NF4_NESTED_BLOCKSIZE ||
        p->n % BT_NF4_BLOCKSIZE != 0)
        return bt_fail(BT_ERR_UNSUPPORTED, "model: %s: %s: blocksize %d / nested %d / %lld "
                       "elements (the NF4 base needs 64 / 256 / a multiple of 64)", path, w,
                       p->blocksize, p->nested_blocksize, (long long)p->n);
    for (int i = 0; i < 16; i++)
        if (p->qmap[i] != bt_nf4_code[i])
            return bt_fail(BT_ERR_UNSUPPORTED, "model: %s: %s.quant_map[%d] = %.9g differs from "
                           "the NF4 table (%.9g)", path, w, i, p->qmap[i], bt_nf4_code[i]);
    int code0_used = 0;
    for (int64_t b = 0; b < p->nb; b++) code0_used |= ((const uint8_t *)p->absmax)[b] == 0;
    for (int i = 0; i < 256; i++) {
        if (p->nmap[i] == bt_dynamic_code8(i)) continue;
        /* bnb's CPU quantize_blockwise overwrites code[0] with -1.0 in its cached map; harmless
         * when no block uses code 0 (tests/reference/README.md, NF4 CPU-path notes). */
        if (i == 0 && p->nmap[0] == -1.0f && !code0_used) continue;
        return bt_fail(BT_ERR_UNSUPPORTED, "model: %s: %s.nested_quant_map[%d] = %.9g differs "
                       "from the signed dynamic 8-bit map (%.9g)", path, w, i, p->nmap[i],
                       bt_dynamic_code8(i));
    }
    return 0;
}

int bt_bnb_to_nf4(bt_nf4 *q, const bt_bnb_parts *p, int64_t rows, int64_t cols, const char *w,
                      const char *path) {
    memset(q, 0, sizeof *q);
    q->n = p->n;
    q->rows = rows;
    q->cols = cols;
    q->packed = bt_aligned_alloc((size_t)p->n / 2);
    q->absmax_q = bt_aligned_alloc((size_t)p->nb);
    q->nested_absmax = bt_aligned_alloc((size_t)p->n_nested * sizeof(float));
    if (!q->packed || !q->absmax_q || !q->nested_absmax) {
        bt_nf4_free(q);
        return bt_fail(BT_ERR_NOMEM, "model: %s: out of memory for %s", path, w);
    }
    memcpy(q->packed, p->packed, (size_t)p->n / 2);
    memcpy(q->absmax_q, p->absmax, (size_t)p->nb);
    memcpy(q->nested_absmax, p->nested_absmax, (size_t)p->n_nested * sizeof(float));
    q->offset = p->offset;
    for (int64_t i = 0; i < p->n_nested; i++)
        if (!isfinite(q->nested_absmax[i])) {
            bt_nf4_free(q);
            return bt_fail(BT_ERR_FORMAT, "model: %s: %s.nested_absmax[%lld] is not finite", path,
                           w, (long long)i);
        }
    return 0;
}

int bt_nf4_from_bnb(bt_nf4 *q, struct bt_st_file *const *files, int n_files,
                    const char *weight_name, int64_t rows, int64_t cols, const char *path) {
    memset(q, 0, sizeof *q);
    if (!files || n_files < 1 || !weight_name || rows < 1 || cols < 1)
        return bt_fail(BT_ERR_INVALID, "model: bt_nf4_from_bnb: bad arguments");
    bt_bnb_parts p;
    int rc = bt_bnb_read(&p, files, n_files, weight_name, rows, cols, path);
    if (!rc) rc = bt_bnb_direct_ok(&p, weight_name, path);
    if (!rc) rc = bt_bnb_to_nf4(q, &p, rows, cols, weight_name, path);
    return rc;
}

