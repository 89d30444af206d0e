/* Hugging Face model directories (config.json + safetensors, sharded or not, F32/F16/BF16 or
 * bitsandbytes 4-bit) and the GGUF-or-directory dispatch. See model.h.
 *
 * Semantics followed (transformers 4.46): LlamaForCausalLM / MistralForCausalLM /
 * Qwen2ForCausalLM modeling files (Qwen2Attention: q/k/v Linear(bias=True), o_proj bias=False;
 * LlamaAttention: bias=config.attention_bias on q/k/v/o; LlamaMLP: bias=config.mlp_bias), and
 * (transformers 5.23) Qwen3ForCausalLM (Qwen3Attention: q_norm / k_norm = Qwen3RMSNorm(head_dim)
 * on each head of q and k before RoPE; q/k/v/o bias=config.attention_bias) and Phi3ForCausalLM
 * (Phi3Attention: fused qkv_proj sliced q | k | v; Phi3MLP: fused gate_up_proj, gate, up =
 * chunk(2); no biases; rotate_half RoPE as Llama's HF layout),
 * LlamaLinearScalingRotaryEmbedding (position / factor), modeling_utils.py sharded loading
 * (model.safetensors.index.json "weight_map"), bitsandbytes QuantState.as_dict(packed=True)
 * (docs/formats/nf4.md §Checkpoint). */
#include "trainer/model/model.h"

#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/bt_common.h"
#include "common/bt_json.h"
#include "common/quant.h"
#include "common/safetensors.h"
#include "trainer/model/model_internal.h"

/* HF module path per linear, in BT_MOD_* order. */
static const char *const k_hf_lin[BT_MOD_N] = {
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj",    "mlp.up_proj",      "mlp.down_proj"};

/* ---------------------------------------------------------------- weight sources */

typedef struct {
    const char *dir;
    char *index_path;        /* NULL for a single model.safetensors */
    json_t *weight_map;      /* borrowed from index_json */
    json_t *index_json;
    bt_st_file **files;
    char **names;            /* file names relative to dir */
    int n_files;
} wsrc;

static void wsrc_close(wsrc *s) {
    for (int i = 0; i < s->n_files; i++) {
        bt_st_close(s->files[i]);
        free(s->names[i]);
    }
    free(s->files);
    free(s->names);
    free(s->index_path);
    json_decref(s->index_json);
    memset(s, 0, sizeof *s);
}

/* rc, or the error of the first weight file that changed while we read it (bt_st_check). */
static int wsrc_check(const wsrc *s, int rc) {
    for (int i = 0; i < s->n_files; i++) {
        int c = bt_st_check(s->files[i], BT_OK);
        if (c) return bt_fail(c, "model: %s", bt_last_error_in("model"));
    }
    return rc;
}

static char *path_join(const char *dir, const char *name) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = bt_xmalloc(n);
    snprintf(p, n, "%s/%s", dir, name);
    return p;
}

static int file_exists(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 && S_ISREG(st.st_mode);
}

static int wsrc_add(wsrc *s, const char *name) {
    for (int i = 0; i < s->n_files; i++)
        if (!strcmp(s->names[i], name)) return 0;
    if (!*name || strchr(name, '/') || !strcmp(name, ".") || !strcmp(name, ".."))
        return bt_fail(BT_ERR_FORMAT, "model: %s: weight_map names \"%s\", which is not a file "
                       "name inside the model directory", s->index_path, name);
    char *p = path_join(s->dir, name);
    bt_st_file *f = NULL;
    int rc = bt_st_open(&f, p);
    if (rc) {
        rc = bt_fail(rc == BT_ERR_IO && !file_exists(p) ? BT_ERR_NOTFOUND : rc,
                     "model: %s%s%s: %s", s->index_path ? s->index_path : "",
                     s->index_path ? ": shard " : "", name, bt_last_error());
        free(p);
        return rc;
    }
    free(p);
    s->files = bt_xrealloc(s->files, (size_t)(s->n_files + 1) * sizeof *s->files);
    s->names = bt_xrealloc(s->names, (size_t)(s->n_files + 1) * sizeof *s->names);
    s->files[s->n_files] = f;
    s->names[s->n_files] = bt_xstrdup(name);
    s->n_files++;
    return 0;
}

static int wsrc_open(wsrc *s, const char *dir) {
    memset(s, 0, sizeof *s);
    s->dir = dir;
    char *idx = path_join(dir, "model.safetensors.index.json");
    char *single = path_join(dir, "model.safetensors");
    int rc = 0;
    if (file_exists(idx)) {
        s->index_path = idx;
        idx = NULL;
        if ((rc = bt_json_load_file(&s->index_json, s->index_path, 0, 256u << 20))) {
            rc = bt_fail(rc, "model: %s", bt_last_error_in("model"));
            goto out;
        }
        s->weight_map = json_object_get(s->index_json, "weight_map");
        if (!json_is_object(s->weight_map)) {
            rc = bt_fail(BT_ERR_FORMAT, "model: %s: \"weight_map\" is missing or not an object",
                         s->index_path);
            goto out;
        }
        const char *key;
        json_t *v;
        json_object_foreach(s->weight_map, key, v) {
            if (!json_is_string(v)) {
                rc = bt_fail(BT_ERR_FORMAT, "model: %s: weight_map[\"%s\"] is not a string",
                             s->index_path, key);
                goto out;
            }
            if ((rc = wsrc_add(s, json_string_value(v)))) goto out;
        }
        if (s->n_files == 0) {
            rc = bt_fail(BT_ERR_FORMAT, "model: %s: weight_map is empty", s->index_path);
            goto out;
        }
    } else if (file_exists(single)) {
        rc = wsrc_add(s, "model.safetensors");
    } else {
        char *bin = path_join(dir, "pytorch_model.bin");
        int has_bin = file_exists(bin);
        free(bin);
        rc = bt_fail(has_bin ? BT_ERR_UNSUPPORTED : BT_ERR_NOTFOUND,
                     "model: %s: no model.safetensors or model.safetensors.index.json%s", dir,
                     has_bin ? " (pytorch_model.bin is not supported: convert it to safetensors)"
                             : "");
    }
out:
    free(idx);
    free(single);
    if (rc) wsrc_close(s);
    return rc;
}

/* Tensor `name` or NULL (no error) when the checkpoint does not have it; *err set when the
 * index names a shard that lacks it. */
static const bt_st_tensor *wsrc_find(const wsrc *s, const char *name, int *err) {
    *err = 0;
    if (!s->weight_map) return bt_st_find(s->files[0], name);
    const char *fn = json_string_value(json_object_get(s->weight_map, name));
    if (!fn) return NULL;
    for (int i = 0; i < s->n_files; i++)
        if (!strcmp(s->names[i], fn)) {
            const bt_st_tensor *t = bt_st_find(s->files[i], name);
            if (!t)
                *err = bt_fail(BT_ERR_FORMAT, "model: %s: weight_map puts %s in %s, which does not "
                               "contain it", s->index_path, name, fn);
            return t;
        }
    return NULL; /* unreachable: every mapped shard was opened */
}

static const char *wsrc_where(const wsrc *s) {
    return s->index_path ? s->index_path : s->names[0];
}

/* Tensor `name` of shape [rows, cols] (rows 0: 1-D [cols]) and dtype F32/F16/BF16 into *out
 * (borrowed from the mapping). Errors: BT_ERR_NOTFOUND, BT_ERR_FORMAT (shape), BT_ERR_UNSUPPORTED
 * (dtype), the index's (wsrc_find). */
static int find_checked(const wsrc *s, const char *name, int rows, int cols, const bt_st_tensor **out) {
    *out = NULL;
    int err;
    const bt_st_tensor *t = wsrc_find(s, name, &err);
    if (err) return err;
    if (!t)
        return bt_fail(BT_ERR_NOTFOUND, "model: %s/%s: missing tensor %s", s->dir, wsrc_where(s),
                       name);
    int want_dims = rows ? 2 : 1;
    if (t->n_dims != want_dims || (rows && t->shape[0] != rows) ||
        t->shape[want_dims - 1] != cols) {
        char got[160] = "";
        size_t o = 0;
        for (int i = 0; i < t->n_dims && o < sizeof got - 24; i++)
            o += (size_t)snprintf(got + o, sizeof got - o, "%s%lld", i ? ", " : "",
                                  (long long)t->shape[i]);
        if (rows)
            return bt_fail(BT_ERR_FORMAT, "model: %s: tensor %s has shape [%s], expected [%d, %d]",
                           s->dir, name, got, rows, cols);
        return bt_fail(BT_ERR_FORMAT, "model: %s: tensor %s has shape [%s], expected [%d]", s->dir,
                       name, got, cols);
    }
    if (t->dtype != BT_ST_F32 && t->dtype != BT_ST_F16 && t->dtype != BT_ST_BF16)
        return bt_fail(BT_ERR_UNSUPPORTED, "model: %s: tensor %s has dtype %s (supported: F32, "
                       "F16, BF16, and bitsandbytes 4-bit linears)", s->dir, name,
                       bt_st_dtype_name(t->dtype));
    *out = t;
    return 0;
}

/* Tensor `name` as new fp32 [rows, cols] (rows 0: 1-D [cols]); F32/F16/BF16. */
static int load_f32(const wsrc *s, const char *name, int rows, int cols, float **out) {
    *out = NULL;
    const bt_st_tensor *t;
    int rc = find_checked(s, name, rows, cols, &t);
    if (rc) return rc;
    int64_t n = (int64_t)(rows ? rows : 1) * cols;
    float *w = bt_aligned_alloc((size_t)n * sizeof(float));
    if (!w) return bt_fail(BT_ERR_NOMEM, "model: %s: out of memory for %s", s->dir, name);
    const uint8_t *src = t->data;
    const size_t es = bt_st_dtype_size(t->dtype);
    /* in chunks, each chunk's file pages given back once decoded (bt_model_drop_pages): the
     * resident set holds the fp32 copy, not the copy and the file's bytes (the embedding of a
     * large vocabulary: VmHWM) */
    const int64_t chunk = 1 << 18;
    for (int64_t c0 = 0; c0 < n; c0 += chunk) {
        const int64_t c1 = c0 + chunk < n ? c0 + chunk : n;
        if (t->dtype == BT_ST_F32) memcpy(w + c0, src + 4 * c0, (size_t)(c1 - c0) * 4);
        else
            for (int64_t i = c0; i < c1; i++) {
                uint16_t h;
                memcpy(&h, src + 2 * i, 2);
                w[i] = t->dtype == BT_ST_F16 ? bt_fp16_to_fp32(h) : bt_bf16_to_fp32(h);
            }
        bt_model_drop_pages(src + (size_t)c0 * es, (size_t)(c1 - c0) * es);
    }
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(w[i])) {
            free(w);
            return bt_fail(BT_ERR_FORMAT, "model: %s: tensor %s: non-finite value at element %lld",
                           s->dir, name, (long long)i);
        }
    *out = w;
    return 0;
}

/* Refuse weights of layers at or past num_hidden_layers (bt_model_layer_of): every tensor name of
 * the index's weight_map, or of the single file. */
static int wsrc_check_layers(const wsrc *s, int n_layer, const char *cpath) {
    int top = -1;
    if (s->weight_map) {
        const char *key;
        json_t *v;
        json_object_foreach(s->weight_map, key, v) {
            int l = bt_model_layer_of(key, "model.layers.");
            if (l > top) top = l;
        }
    } else {
        for (int i = 0; i < bt_st_n_tensors(s->files[0]); i++) {
            int l = bt_model_layer_of(bt_st_tensor_at(s->files[0], i)->name, "model.layers.");
            if (l > top) top = l;
        }
    }
    if (top < n_layer) return 0;
    return bt_fail(BT_ERR_FORMAT, "model: %s: num_hidden_layers is %d, but %s holds the weights of %d layers "
                   "(up to model.layers.%d.*): refusing to load part of the model (config.json or the weights "
                   "are wrong)", cpath, n_layer, wsrc_where(s), top + 1, top);
}

static int wsrc_has(const wsrc *s, const char *name) {
    int err;
    return wsrc_find(s, name, &err) != NULL || err;
}

/* dist.shard_base's row source for bt_model_nf4_cut_rows: row r of a linear is row r0 + r of
 * the F32 / F16 / BF16 safetensors tensor t (HF's own row order: no q/k permutation). */
typedef struct {
    const bt_st_tensor *t;
    int cols, r0;
} st_rows;

static int st_row(const void *ctx, int64_t r, float *out) {
    const st_rows *q = ctx;
    const size_t es = bt_st_dtype_size(q->t->dtype);
    const uint8_t *src = (const uint8_t *)q->t->data + (size_t)(q->r0 + r) * q->cols * es;
    if (q->t->dtype == BT_ST_F32) memcpy(out, src, (size_t)q->cols * 4);
    else
        for (int i = 0; i < q->cols; i++) {
            uint16_t h;
            memcpy(&h, src + 2 * i, 2);
            out[i] = q->t->dtype == BT_ST_F16 ? bt_fp16_to_fp32(h) : bt_bf16_to_fp32(h);
        }
    return 0;
}

/* Only rank sh->rank's NF4 groups of rows [r0, r0 + rows) of `<w>` [total, cols] (total 0: rows),
 * read from the mapped file a row at a time (model_internal.h bt_model_nf4_cut_rows). Errors:
 * those of find_checked and bt_model_nf4_cut_rows. */
static int cut_linear(const wsrc *s, bt_base_linear *l, const char *w, int total, int r0, int rows,
                      int cols, const bt_model_shard *sh) {
    const bt_st_tensor *t;
    int rc = find_checked(s, w, total ? total : rows, cols, &t);
    if (rc) return rc;
    const st_rows q = {t, cols, r0};
    const size_t es = bt_st_dtype_size(t->dtype);
    const bt_nf4_row_src src = {st_row, &q, (const uint8_t *)t->data + (size_t)r0 * cols * es,
                                (size_t)rows * cols * es, (int64_t)r0 * cols};
    return bt_model_nf4_cut_rows(l, &src, rows, cols, sh, s->dir, w);
}

/* One frozen linear `<prefix>.weight` (+ `<prefix>.bias` when with_bias). */
static int load_linear(const wsrc *s, bt_base_linear *l, const char *prefix, int rows, int cols,
                       int with_bias, int base_dtype, const bt_model_shard *sh) {
    char w[400], name[480];
    snprintf(w, sizeof w, "%s.weight", prefix);
    snprintf(name, sizeof name, "%s.quant_state.bitsandbytes__nf4", w);
    int bnb = wsrc_has(s, name);
    snprintf(name, sizeof name, "%s.quant_state.bitsandbytes__fp4", w);
    bnb |= wsrc_has(s, name);
    int rc;
    if (bnb) {
        bt_bnb_parts p;
        if ((rc = bt_bnb_read(&p, s->files, s->n_files, w, rows, cols, s->dir))) return rc;
        if (base_dtype == BT_BASE_NF4 && bt_bnb_direct_ok(&p, w, s->dir) == 0) {
            if ((rc = bt_bnb_to_nf4(&l->q, &p, rows, cols, w, s->dir))) return rc;
            l->rows = rows;
            l->cols = cols;
            l->is_nf4 = 1;
        } else {
            if (base_dtype == BT_BASE_NF4)
                bt_log(BT_LOG_WARN, "model", "%s; dequantising and re-quantising it to NF4 with "
                       "double quantisation (not bit-identical to the checkpoint)", bt_last_error());
            float *f = NULL;
            if ((rc = bt_bnb_dequant(&p, &f, w, s->dir))) return rc;
            if ((rc = bt_model_lin_set(l, f, rows, cols, base_dtype, w))) return rc;
        }
    } else if (sh && sh->world > 1) { /* dist.shard_base: only this rank's NF4 groups */
        if ((rc = cut_linear(s, l, w, 0, 0, rows, cols, sh))) return rc;
    } else {
        float *f = NULL;
        if ((rc = load_f32(s, w, rows, cols, &f))) return rc;
        if ((rc = bt_model_lin_set(l, f, rows, cols, base_dtype, w))) return rc;
    }
    if (with_bias) {
        snprintf(name, sizeof name, "%s.bias", prefix);
        if ((rc = load_f32(s, name, 0, rows, &l->bias))) return rc;
    }
    return 0;
}

/* Rows [r0, r0 + rows) of the fused frozen linear `<prefix>.weight` [total, cols] (Phi-3
 * self_attn.qkv_proj: q, k, v rows; mlp.gate_up_proj: gate rows then up rows, Phi3MLP's
 * chunk(2)) as one linear in base_dtype. No bias (Phi-3 has none). Errors: those of load_f32 (a
 * bitsandbytes-quantised fused tensor is refused there by its dtype), BT_ERR_NOMEM, those of
 * bt_model_lin_set. */
static int load_linear_part(const wsrc *s, bt_base_linear *l, const char *prefix, int total,
                            int r0, int rows, int cols, int base_dtype, const bt_model_shard *sh) {
    char w[400];
    snprintf(w, sizeof w, "%s.weight", prefix);
    if (sh && sh->world > 1) return cut_linear(s, l, w, total, r0, rows, cols, sh);
    float *f = NULL;
    int rc = load_f32(s, w, total, cols, &f);
    if (rc) return rc;
    float *part = bt_aligned_alloc((size_t)rows * cols * sizeof(float));
    if (part) memcpy(part, f + (size_t)r0 * cols, (size_t)rows * cols * sizeof(float));
    free(f);
    if (!part) return bt_fail(BT_ERR_NOMEM, "model: %s: out of memory for %s", s->dir, w);
    return bt_model_lin_set(l, part, rows, cols, base_dtype, w);
}

/* ---------------------------------------------------------------- config.json */

typedef struct {
    json_t *root;
    const char *path;
} cfgj;

static int cfg_int(const cfgj *c, const char *key, int required, int def, int *out) {
    json_t *v = json_object_get(c->root, key);
    if (!v || json_is_null(v)) {
        if (required)
            return bt_fail(BT_ERR_NOTFOUND, "model: %s: missing key \"%s\"", c->path, key);
        *out = def;
        return 0;
    }
    if (!json_is_integer(v) || json_integer_value(v) < 1 || json_integer_value(v) > INT_MAX)
        return bt_fail(BT_ERR_FORMAT, "model: %s: \"%s\" must be a positive integer", c->path, key);
    *out = (int)json_integer_value(v);
    return 0;
}

static int cfg_float(const cfgj *c, const char *key, int required, double def, float *out) {
    json_t *v = json_object_get(c->root, key);
    double d = def;
    if (!v || json_is_null(v)) {
        if (required)
            return bt_fail(BT_ERR_NOTFOUND, "model: %s: missing key \"%s\"", c->path, key);
    } else if (!bt_model_json_num(v, &d) || !isfinite(d) || !(d > 0)) {
        return bt_fail(BT_ERR_FORMAT, "model: %s: \"%s\" must be a number > 0", c->path, key);
    }
    *out = (float)d;
    return 0;
}

static int cfg_bool(const cfgj *c, const char *key, int def, int *out) {
    json_t *v = json_object_get(c->root, key);
    if (!v || json_is_null(v)) {
        *out = def;
        return 0;
    }
    if (!json_is_boolean(v))
        return bt_fail(BT_ERR_FORMAT, "model: %s: \"%s\" must be true or false", c->path, key);
    *out = json_is_true(v);
    return 0;
}

/* A number > 0 at rs[key] into *out (absent or null: *out untouched, returns 0; `required`: an
 * error). */
static int rs_num(const cfgj *c, json_t *rs, const char *key, int required, double *out) {
    json_t *v = json_object_get(rs, key);
    if (!v || json_is_null(v)) {
        if (!required) return 0;
        const char *ty = json_string_value(json_object_get(rs, "rope_type"));
        if (!ty) ty = json_string_value(json_object_get(rs, "type"));
        return bt_fail(BT_ERR_FORMAT, "model: %s: rope_scaling.%s: required for rope_type \"%s\"",
                       c->path, key, ty ? ty : "?");
    }
    if (!bt_model_json_num(v, out) || !isfinite(*out) || !(*out > 0))
        return bt_fail(BT_ERR_FORMAT, "model: %s: rope_scaling.%s must be a number > 0", c->path, key);
    return 0;
}

/* rope_scaling / rope_parameters, stage 1: the object itself (*rs = NULL when absent or null)
 * and the keys every kind shares: rope_theta inside it (transformers 5 moved it there; used only
 * when the top-level rope_theta is absent), partial_rotary_factor (must be 1), and the kind
 * (*ty: "rope_type", else the older "type"). Reads c; writes *rs, *ty, hp->rope_theta. Errors:
 * BT_ERR_FORMAT (not an object, rope_theta <= 0, no kind), BT_ERR_UNSUPPORTED (partial RoPE). */
static int rope_common(const cfgj *c, json_t **rs_out, const char **ty_out, bt_llama_hparams *hp) {
    *rs_out = NULL;
    *ty_out = NULL;
    json_t *rs = json_object_get(c->root, "rope_scaling");
    if (!rs || json_is_null(rs)) rs = json_object_get(c->root, "rope_parameters");
    if (!rs || json_is_null(rs)) return 0;
    if (!json_is_object(rs))
        return bt_fail(BT_ERR_FORMAT, "model: %s: \"rope_scaling\" must be null or an object", c->path);
    json_t *th = json_object_get(c->root, "rope_theta");
    double d;
    if ((!th || json_is_null(th)) && bt_model_json_num(json_object_get(rs, "rope_theta"), &d)) {
        if (!isfinite(d) || !(d > 0))
            return bt_fail(BT_ERR_FORMAT, "model: %s: rope_parameters.rope_theta must be > 0", c->path);
        hp->rope_theta = (float)d; /* transformers 5: rope_theta lives in rope_parameters */
    }
    double prf = 1.0;
    int rc;
    if ((rc = rs_num(c, rs, "partial_rotary_factor", 0, &prf))) return rc;
    if (prf != 1.0)
        return bt_fail(BT_ERR_UNSUPPORTED, "model: %s: partial_rotary_factor %g is not supported "
                       "(RoPE over the whole head)", c->path, prf);
    const char *ty = json_string_value(json_object_get(rs, "rope_type"));
    if (!ty) ty = json_string_value(json_object_get(rs, "type"));
    if (!ty)
        return bt_fail(BT_ERR_FORMAT, "model: %s: rope_scaling lacks \"rope_type\" / \"type\"",
                       c->path);
    *rs_out = rs;
    *ty_out = ty;
    return 0;
}

/* rope_type "llama3" (transformers _compute_llama3_parameters): factor, low_freq_factor,
 * high_freq_factor > low_freq_factor, original_max_position_embeddings (an integer), all four
 * required as _validate_llama3_parameters requires them, checked in that order. Writes
 * hp->rope_type = BT_ROPE_LLAMA3 and its four fields. Errors: BT_ERR_FORMAT naming the key. */
static int rope_llama3(const cfgj *c, json_t *rs, bt_llama_hparams *hp) {
    static const char *const keys[4] = {"factor", "low_freq_factor", "high_freq_factor",
                                        "original_max_position_embeddings"};
    double v[4];
    for (int i = 0; i < 4; i++) {
        json_t *x = json_object_get(rs, keys[i]);
        if (!x)
            return bt_fail(BT_ERR_FORMAT, "model: %s: rope_scaling type \"llama3\" lacks "
                           "\"%s\"", c->path, keys[i]);
        if (!bt_model_json_num(x, &v[i]) || !isfinite(v[i]) || !(v[i] > 0) ||
            (i == 3 && (v[i] != floor(v[i]) || v[i] > 1e9)))
            return bt_fail(BT_ERR_FORMAT, "model: %s: rope_scaling.%s must be a %s > 0",
                           c->path, keys[i], i == 3 ? "integer" : "number");
    }
    if (!(v[2] > v[1]))
        return bt_fail(BT_ERR_FORMAT, "model: %s: rope_scaling.high_freq_factor %g must "
                       "exceed low_freq_factor %g", c->path, v[2], v[1]);
    hp->rope_type = BT_ROPE_LLAMA3;
    hp->rope_factor = (float)v[0];
    hp->rope_low_freq_factor = (float)v[1];
    hp->rope_high_freq_factor = (float)v[2];
    hp->rope_orig_ctx = (int)v[3];
    return 0;
}

/* rope_type "longrope" with short_factor == long_factor (arrays of head_dim / 2 numbers > 0):
 * a fixed per-frequency table, as trainer export writes composite scalings. Writes
 * rope_freqs[0, head_dim / 2) (the table), hp->rope_type = BT_ROPE_FREQS and
 * hp->rope_attn_factor (attention_factor; default transformers' sqrt(1 + ln factor / ln
 * original), factor = max_position_embeddings / original_max_position_embeddings when absent;
 * 0 meaning 1). Errors: BT_ERR_FORMAT (array sizes, a factor not > 0, bad number keys),
 * BT_ERR_UNSUPPORTED (short_factor != long_factor: Phi-3's length-switched tables). */
static int rope_longrope(const cfgj *c, json_t *rs, bt_llama_hparams *hp, float *rope_freqs) {
    json_t *lf = json_object_get(rs, "long_factor"), *sf = json_object_get(rs, "short_factor");
    const size_t half = (size_t)hp->head_dim / 2;
    if (!json_is_array(lf) || !json_is_array(sf) || json_array_size(lf) != half ||
        json_array_size(sf) != half || half > 512)
        return bt_fail(BT_ERR_FORMAT, "model: %s: rope_scaling longrope needs short_factor and "
                       "long_factor arrays of head_dim / 2 = %zu numbers", c->path, half);
    for (size_t i = 0; i < half; i++) {
        double a, b;
        if (!bt_model_json_num(json_array_get(lf, i), &a) || !bt_model_json_num(json_array_get(sf, i), &b) ||
            !isfinite(a) || !(a > 0) || !isfinite(b) || !(b > 0))
            return bt_fail(BT_ERR_FORMAT, "model: %s: rope_scaling longrope factor %zu must be "
                           "a number > 0", c->path, i);
        if ((float)a != (float)b)
            return bt_fail(BT_ERR_UNSUPPORTED, "model: %s: rope_scaling longrope with "
                           "short_factor != long_factor switches tables with the sequence "
                           "length (Phi-3); only a fixed table is supported", c->path);
        rope_freqs[i] = (float)a;
    }
    double orig = hp->ctx, af = 0, f = 0;
    int rc;
    if ((rc = rs_num(c, rs, "original_max_position_embeddings", 0, &orig)) ||
        (rc = rs_num(c, rs, "factor", 0, &f)) || (rc = rs_num(c, rs, "attention_factor", 0, &af)))
        return rc;
    if (f == 0) f = hp->ctx / orig;
    if (af == 0) af = f <= 1.0 ? 1.0 : sqrt(1.0 + log(f) / log(orig));
    hp->rope_type = BT_ROPE_FREQS;
    hp->rope_attn_factor = af == 1.0 ? 0.f : (float)af;
    return 0;
}

/* The yarn keys over factor f (transformers _compute_yarn_parameters): *orig =
 * original_max_position_embeddings (an integer; *orig holds the default on entry),
 * attention_factor (or DeepSeek's mscale / mscale_all_dim ratio of get_mscale), beta_fast,
 * beta_slow (0: the defaults, bt_rope_inv_freq_yarn). Writes *orig, hp->rope_attn_factor,
 * hp->rope_yarn_beta_fast / _slow. Errors: BT_ERR_FORMAT (a key not a number > 0, orig not an
 * integer), BT_ERR_UNSUPPORTED (truncate false). */
static int rope_yarn(const cfgj *c, json_t *rs, double f, bt_llama_hparams *hp, double *orig) {
    double af = 0, ms = 0, msa = 0, bf = 0, bs = 0;
    json_t *tr = json_object_get(rs, "truncate");
    int rc;
    if ((rc = rs_num(c, rs, "original_max_position_embeddings", 0, orig)) ||
        (rc = rs_num(c, rs, "attention_factor", 0, &af)) || (rc = rs_num(c, rs, "mscale", 0, &ms)) ||
        (rc = rs_num(c, rs, "mscale_all_dim", 0, &msa)) || (rc = rs_num(c, rs, "beta_fast", 0, &bf)) ||
        (rc = rs_num(c, rs, "beta_slow", 0, &bs)))
        return rc;
    if (tr && json_is_false(tr))
        return bt_fail(BT_ERR_UNSUPPORTED, "model: %s: rope_scaling yarn with truncate false is "
                       "not supported", c->path);
    if (*orig != floor(*orig) || *orig > 1e9)
        return bt_fail(BT_ERR_FORMAT, "model: %s: rope_scaling.original_max_position_embeddings "
                       "must be an integer", c->path);
    if (af == 0 && ms > 0 && msa > 0) /* transformers get_mscale(factor, m) ratio (DeepSeek) */
        af = (f <= 1 ? 1.0 : 0.1 * ms * log(f) + 1.0) / (f <= 1 ? 1.0 : 0.1 * msa * log(f) + 1.0);
    hp->rope_attn_factor = (float)af;
    hp->rope_yarn_beta_fast = (float)bf;
    hp->rope_yarn_beta_slow = (float)bs;
    return 0;
}

/* rope_type "linear" | "dynamic" | "yarn" (bt_rope_ext_parse): a context extension over the
 * model's own table with the required "factor" > 0 (1: identity, nothing set). Writes
 * hp->rope_ext, rope_ext_factor; for dynamic / yarn rope_ext_orig_ctx (original context:
 * max_position_embeddings, or yarn's original_max_position_embeddings) and hp->ctx = original x
 * factor when that is larger. Errors: BT_ERR_UNSUPPORTED (another kind, the message lists the
 * supported ones), those of rs_num and rope_yarn. */
static int rope_extension(const cfgj *c, json_t *rs, const char *ty, bt_llama_hparams *hp) {
    int ext = bt_rope_ext_parse(ty), rc;
    if (ext < 0)
        return bt_fail(BT_ERR_UNSUPPORTED, "model: %s: rope_scaling type \"%s\" is not supported "
                       "(supported: default, linear, dynamic, yarn, llama3, longrope with a fixed "
                       "table)", c->path, ty);
    double f = 0;
    if ((rc = rs_num(c, rs, "factor", 1, &f))) return rc;
    if (f == 1.0) return 0;
    hp->rope_ext = ext;
    hp->rope_ext_factor = (float)f;
    if (ext == BT_ROPE_EXT_LINEAR) return 0;
    double orig = hp->ctx;
    if (ext == BT_ROPE_EXT_YARN && (rc = rope_yarn(c, rs, f, hp, &orig))) return rc;
    hp->rope_ext_orig_ctx = (int)orig;
    const double scaled = floor(orig * f + 0.5);
    if (scaled > hp->ctx && scaled < 1e9) hp->ctx = (int)scaled;
    return 0;
}

/* RoPE scaling: "rope_scaling" (transformers 4.x) or "rope_parameters" (transformers 5 writes it,
 * with rope_theta inside), with transformers' semantics per rope_type (modeling_rope_utils.py):
 *   default / null; linear {factor}; llama3 {factor, low_freq_factor, high_freq_factor,
 *   original_max_position_embeddings} (all required, _validate_llama3_parameters);
 *   yarn {factor, original_max_position_embeddings (default max_position_embeddings, the
 *   transformers 5 rule), attention_factor (or mscale / mscale_all_dim, DeepSeek), beta_fast,
 *   beta_slow}; dynamic {factor} over max_position_embeddings; longrope whose short_factor and
 *   long_factor are equal (a fixed per-frequency table, as trainer export writes composite
 *   scalings; rope_freqs gets it) with attention_factor (default sqrt(1 + ln factor / ln
 *   original), factor = max_position_embeddings / original when absent).
 * hp->ctx (max_position_embeddings) becomes the scaled context for yarn / dynamic (original x
 * factor) when that is larger. Reads c (hp->ctx, hp->head_dim set); writes hp's RoPE fields and,
 * for longrope, rope_freqs [head_dim / 2] (caller's buffer). Errors: those of rope_common, then
 * of the kind's helper (rope_llama3, rope_longrope, rope_extension). */
static int parse_rope(const cfgj *c, bt_llama_hparams *hp, float *rope_freqs) {
    json_t *rs;
    const char *ty;
    int rc = rope_common(c, &rs, &ty, hp);
    if (rc || !rs || !strcmp(ty, "default")) return rc;
    if (!strcmp(ty, "llama3")) return rope_llama3(c, rs, hp);
    if (!strcmp(ty, "longrope")) return rope_longrope(c, rs, hp, rope_freqs);
    return rope_extension(c, rs, ty, hp);
}

enum { ARCH_LLAMA, ARCH_MISTRAL, ARCH_QWEN2, ARCH_QWEN3, ARCH_PHI3, ARCH_GEMMA3 };

/* Phi-3's RoPE keys (transformers 5.23 Phi3Config: rope_parameters / rope_scaling "su" and
 * "yarn" are renamed "longrope", the only other kind it accepts being "default"; Phi3's
 * partial_rotary_factor may sit at the top level): only "default" with the whole head rotated.
 * Errors: BT_ERR_UNSUPPORTED naming the kind or the factor. */
static int phi3_rope_check(const cfgj *c) {
    double prf = 1.0;
    json_t *pv = json_object_get(c->root, "partial_rotary_factor");
    if (pv && !json_is_null(pv) && (!bt_model_json_num(pv, &prf) || prf != 1.0))
        return bt_fail(BT_ERR_UNSUPPORTED, "model: %s: Phi-3 partial_rotary_factor %g is not "
                       "supported (RoPE over the whole head only)", c->path, prf);
    json_t *rs = json_object_get(c->root, "rope_scaling");
    if (!rs || json_is_null(rs)) rs = json_object_get(c->root, "rope_parameters");
    if (!rs || json_is_null(rs) || !json_is_object(rs)) return 0; /* rope_common judges it */
    const char *ty = json_string_value(json_object_get(rs, "rope_type"));
    if (!ty) ty = json_string_value(json_object_get(rs, "type"));
    if (ty && strcmp(ty, "default") != 0)
        return bt_fail(BT_ERR_UNSUPPORTED, "model: %s: Phi-3 rope_scaling type \"%s\"%s is not "
                       "supported (Phi-3's \"su\" / \"longrope\" scaling switches factor tables "
                       "with the sequence length); use a model without rope_scaling (e.g. "
                       "Phi-3-mini-4k)", c->path, ty,
                       !strcmp(ty, "su") || !strcmp(ty, "yarn") ? " (transformers: \"longrope\")" : "");
    return 0;
}

/* Gemma 3's RoPE as transformers 5.23 Gemma3TextConfig.convert_rope_params_to_dict builds it:
 * rope_parameters {"full_attention": {...}, "sliding_attention": {...}} (transformers 5; a flat
 * object is taken as the global layers'), else the defaults {rope_type "default"} for both; a
 * "rope_scaling" object (transformers 4, e.g. google/gemma-3-4b-it's {"rope_type": "linear",
 * "factor": 8.0}) is merged over the global layers' set (dict.update: its keys win); a set without
 * rope_theta takes the top-level rope_theta (global, default 1e6) / rope_local_base_freq (local,
 * default 1e4). Each set's kind: "rope_type", else "type". The global layers take "default" or
 * "linear" (its "factor" required); the local layers "default" only: the scaling never reaches
 * them. Writes hp->rope_theta, rope_local_theta and, for a factor != 1, rope_ext LINEAR /
 * rope_ext_factor. Errors: BT_ERR_FORMAT (bad values), BT_ERR_UNSUPPORTED (another kind). */
static int gemma3_rope(const cfgj *c, bt_llama_hparams *hp) {
    double gth = 1000000.0, lth = 10000.0, factor = 1.0;
    const char *gty = "default", *lty = "default";
    json_t *v;
    if ((v = json_object_get(c->root, "rope_theta")) && !json_is_null(v) && !bt_model_json_num(v, &gth))
        return bt_fail(BT_ERR_FORMAT, "model: %s: rope_theta must be a number", c->path);
    if ((v = json_object_get(c->root, "rope_local_base_freq")) && !json_is_null(v) &&
        !bt_model_json_num(v, &lth))
        return bt_fail(BT_ERR_FORMAT, "model: %s: rope_local_base_freq must be a number", c->path);
    json_t *rp = json_object_get(c->root, "rope_parameters");
    if (rp && !json_is_null(rp) && !json_is_object(rp))
        return bt_fail(BT_ERR_FORMAT, "model: %s: rope_parameters must be null or an object", c->path);
    json_t *gs = json_is_object(rp) ? json_object_get(rp, "full_attention") : NULL;
    json_t *ls = json_is_object(rp) ? json_object_get(rp, "sliding_attention") : NULL;
    if (!gs && !ls && json_is_object(rp)) gs = rp; /* a flat rope_parameters: the global layers' */
    json_t *rs = json_object_get(c->root, "rope_scaling"), *merged = NULL;
    if (rs && !json_is_null(rs)) {
        if (!json_is_object(rs))
            return bt_fail(BT_ERR_FORMAT, "model: %s: rope_scaling must be null or an object", c->path);
        merged = json_is_object(gs) ? json_deep_copy(gs) : json_object();
        if (!merged || json_object_update(merged, rs) != 0) {
            json_decref(merged);
            return bt_fail(BT_ERR_NOMEM, "model: %s: out of memory (rope_scaling)", c->path);
        }
        gs = merged;
    }
    json_t *sets[2] = {gs, ls};
    int rc = 0;
    for (int i = 0; i < 2 && !rc; i++) {
        json_t *o = sets[i];
        if (!o || json_is_null(o)) continue;
        if (!json_is_object(o)) {
            rc = bt_fail(BT_ERR_FORMAT, "model: %s: Gemma 3 RoPE parameters must be objects", c->path);
            break;
        }
        const char *ty = json_string_value(json_object_get(o, "rope_type"));
        if (!ty) ty = json_string_value(json_object_get(o, "type"));
        json_t *th = json_object_get(o, "rope_theta");
        double t;
        if (th && !json_is_null(th)) {
            if (!bt_model_json_num(th, &t) || !(t > 0) || !isfinite(t)) {
                rc = bt_fail(BT_ERR_FORMAT, "model: %s: rope_theta must be a number > 0", c->path);
                break;
            }
            if (i == 0) gth = t;
            else lth = t;
        }
        if (i == 0) gty = ty ? ty : "default";
        else lty = ty ? ty : "default";
        if (i == 0 && !strcmp(gty, "linear")) rc = rs_num(c, o, "factor", 1, &factor);
    }
    /* the messages name gty / lty, which may point into merged: fail before freeing it */
    if (!rc && strcmp(gty, "default") != 0 && strcmp(gty, "linear") != 0)
        rc = bt_fail(BT_ERR_UNSUPPORTED, "model: %s: Gemma 3 global-layer rope_type \"%s\" is "
                     "not supported (default, linear)", c->path, gty);
    if (!rc && strcmp(lty, "default") != 0)
        rc = bt_fail(BT_ERR_UNSUPPORTED, "model: %s: Gemma 3 sliding-layer rope_type \"%s\" is "
                     "not supported (default)", c->path, lty);
    json_decref(merged);
    if (rc) return rc;
    if (!(gth > 0) || !(lth > 0) || !isfinite(gth) || !isfinite(lth))
        return bt_fail(BT_ERR_FORMAT, "model: %s: RoPE bases must be > 0", c->path);
    hp->rope_theta = (float)gth;
    hp->rope_local_theta = (float)lth;
    if (factor != 1.0) {
        hp->rope_ext = BT_ROPE_EXT_LINEAR;
        hp->rope_ext_factor = (float)factor;
    }
    return 0;
}

/* Gemma 3 text (transformers 5.23 Gemma3TextConfig / Gemma3ForCausalLM): hidden_activation (and
 * an older hidden_act) "gelu_pytorch_tanh" (GeGLU); query_pre_attn_scalar (256); sliding_window
 * (required) with layer_types ("sliding_attention" / "full_attention" per layer, which must follow
 * one period p: layer l global iff (l + 1) % p == 0, as Gemma3TextConfig builds it from
 * sliding_window_pattern, default 6) or sliding_window_pattern itself; RoPE as rope_parameters
 * {"full_attention": {rope_type, rope_theta, factor}, "sliding_attention": {rope_type,
 * rope_theta}} (transformers 5) or rope_theta (1e6) / rope_local_base_freq (1e4) / rope_scaling
 * (transformers 4): "default", or "linear" on the global layers (Gemma 3 4B+); the local layers
 * take plain "default". attn_logit_softcapping / final_logit_softcapping must be null (Gemma 3's;
 * Gemma 2's softcapping is not implemented), use_bidirectional_attention false. Fixed by the
 * architecture: QK-norm, the post-attention / post-FFN norms, embeddings times sqrt(hidden_size)
 * (Gemma3TextScaledWordEmbedding; fp32 here: the reference is the fp32 model). Errors:
 * BT_ERR_FORMAT (bad values), BT_ERR_NOTFOUND (sliding_window), BT_ERR_UNSUPPORTED (naming the
 * key). */
static int gemma3_config(const cfgj *c, bt_llama_hparams *hp) {
    static const char *const acts[2] = {"hidden_activation", "hidden_act"};
    for (int i = 0; i < 2; i++) {
        json_t *v = json_object_get(c->root, acts[i]);
        const char *s = json_string_value(v);
        if (v && !json_is_null(v) && (!s || strcmp(s, "gelu_pytorch_tanh") != 0))
            return bt_fail(BT_ERR_UNSUPPORTED, "model: %s: Gemma 3 %s \"%s\" is not supported "
                           "(gelu_pytorch_tanh)", c->path, acts[i], s ? s : "(not a string)");
    }
    static const char *const caps[2] = {"attn_logit_softcapping", "final_logit_softcapping"};
    for (int i = 0; i < 2; i++) {
        json_t *v = json_object_get(c->root, caps[i]);
        if (v && !json_is_null(v))
            return bt_fail(BT_ERR_UNSUPPORTED, "model: %s: %s is set: logit soft-capping (Gemma 2) "
                           "is not supported", c->path, caps[i]);
    }
    if (json_is_true(json_object_get(c->root, "use_bidirectional_attention")))
        return bt_fail(BT_ERR_UNSUPPORTED, "model: %s: use_bidirectional_attention true is not "
                       "supported (causal language models only)", c->path);
    int rc, pattern = 6;
    float qs = 256.f;
    if ((rc = cfg_float(c, "query_pre_attn_scalar", 0, 256.0, &qs)) ||
        (rc = cfg_int(c, "sliding_window", 1, 0, &hp->sliding_window)) ||
        (rc = cfg_int(c, "sliding_window_pattern", 0, 6, &pattern)))
        return rc;
    json_t *lt = json_object_get(c->root, "layer_types");
    if (json_is_array(lt)) {
        if ((int)json_array_size(lt) != hp->n_layer)
            return bt_fail(BT_ERR_FORMAT, "model: %s: layer_types has %zu entries for %d layers",
                           c->path, json_array_size(lt), hp->n_layer);
        int first_full = 0; /* the period: one past the first global layer (0: none) */
        for (int l = 0; l < hp->n_layer && !first_full; l++)
            if (!strcmp(json_string_value(json_array_get(lt, l)) ? json_string_value(json_array_get(lt, l)) : "", "full_attention"))
                first_full = l + 1;
        pattern = first_full;
        for (int l = 0; l < hp->n_layer; l++) {
            const char *ty = json_string_value(json_array_get(lt, l));
            const int full = pattern > 0 && (l + 1) % pattern == 0;
            if (!ty || strcmp(ty, full ? "full_attention" : "sliding_attention") != 0)
                return bt_fail(BT_ERR_UNSUPPORTED, "model: %s: layer_types[%d] is \"%s\": only a "
                               "periodic pattern (every p-th layer \"full_attention\", the others "
                               "\"sliding_attention\") is supported", c->path, l,
                               ty ? ty : "(not a string)");
        }
    } else if (lt && !json_is_null(lt)) {
        return bt_fail(BT_ERR_FORMAT, "model: %s: layer_types must be an array", c->path);
    }
    hp->swa_pattern = pattern;
    hp->attn_scalar = qs;
    hp->qk_norm = 1;
    hp->sandwich_norm = 1;
    hp->act = BT_ACT_GELU_TANH;
    hp->embed_scale = sqrtf((float)hp->d_model);
    hp->arch = BT_ARCH_GEMMA3;
    return gemma3_rope(c, hp);
}

/* Fill hp and the bias flags from config.json. */
static int parse_config(const cfgj *c, bt_llama_hparams *hp, int *tied, int *attn_bias_qkv,
                        int *attn_bias_o, int *mlp_bias, float *rope_freqs) {
    memset(hp, 0, sizeof *hp);
    const char *arch = NULL;
    json_t *archs = json_object_get(c->root, "architectures");
    if (json_is_array(archs) && json_array_size(archs) >= 1)
        arch = json_string_value(json_array_get(archs, 0));
    else if (archs && !json_is_null(archs))
        return bt_fail(BT_ERR_FORMAT, "model: %s: \"architectures\" must be a non-empty array of "
                       "strings", c->path);
    const char *mt = json_string_value(json_object_get(c->root, "model_type"));
    int a;
    if (arch ? !strcmp(arch, "LlamaForCausalLM") : mt && !strcmp(mt, "llama")) a = ARCH_LLAMA;
    else if (arch ? !strcmp(arch, "MistralForCausalLM") : mt && !strcmp(mt, "mistral"))
        a = ARCH_MISTRAL;
    else if (arch ? !strcmp(arch, "Qwen2ForCausalLM") : mt && !strcmp(mt, "qwen2")) a = ARCH_QWEN2;
    else if (arch ? !strcmp(arch, "Qwen3ForCausalLM") : mt && !strcmp(mt, "qwen3")) a = ARCH_QWEN3;
    else if (arch ? !strcmp(arch, "Phi3ForCausalLM") : mt && !strcmp(mt, "phi3")) a = ARCH_PHI3;
    else if (arch ? !strcmp(arch, "Gemma3ForCausalLM") : mt && !strcmp(mt, "gemma3_text"))
        a = ARCH_GEMMA3;
    else if (!arch && !mt)
        return bt_fail(BT_ERR_NOTFOUND, "model: %s: missing key \"architectures\"", c->path);
    else
        return bt_fail(BT_ERR_UNSUPPORTED, "model: %s: architecture \"%s\" is not supported "
                       "(supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
                       "Qwen3ForCausalLM, Phi3ForCausalLM, Gemma3ForCausalLM)",
                       c->path, arch ? arch : mt);
    int rc;
    if ((rc = cfg_int(c, "hidden_size", 1, 0, &hp->d_model)) ||
        (rc = cfg_int(c, "intermediate_size", 1, 0, &hp->d_ff)) ||
        (rc = cfg_int(c, "num_hidden_layers", 1, 0, &hp->n_layer)) ||
        (rc = cfg_int(c, "num_attention_heads", 1, 0, &hp->n_head)) ||
        (rc = cfg_int(c, "vocab_size", 1, 0, &hp->vocab)) ||
        (rc = cfg_float(c, "rms_norm_eps", 1, 0, &hp->rms_eps)) ||
        (rc = cfg_float(c, "rope_theta", 0, 10000.0, &hp->rope_theta)) ||
        (rc = cfg_int(c, "max_position_embeddings", 0, 2048, &hp->ctx)) ||
        (rc = cfg_int(c, "num_key_value_heads", 0, hp->n_head, &hp->n_kv_head)) ||
        (rc = cfg_int(c, "head_dim", 0, hp->d_model / hp->n_head, &hp->head_dim)) ||
        (rc = cfg_bool(c, "tie_word_embeddings", a == ARCH_GEMMA3, tied)))
        return rc;
    if (a == ARCH_GEMMA3) { /* its own activation, RoPE, window and norm keys */
        if ((rc = gemma3_config(c, hp))) return rc;
        return bt_model_check_hparams(hp, c->path, 1);
    }
    const char *act = json_string_value(json_object_get(c->root, "hidden_act"));
    json_t *actv = json_object_get(c->root, "hidden_act");
    if (actv && !json_is_null(actv) && (!act || strcmp(act, "silu") != 0))
        return bt_fail(BT_ERR_UNSUPPORTED, "model: %s: hidden_act \"%s\" is not supported (silu)",
                       c->path, act ? act : "(not a string)");
    *attn_bias_qkv = *attn_bias_o = *mlp_bias = 0;
    if (a == ARCH_LLAMA) {
        if ((rc = cfg_bool(c, "attention_bias", 0, attn_bias_qkv)) ||
            (rc = cfg_bool(c, "mlp_bias", 0, mlp_bias)))
            return rc;
        *attn_bias_o = *attn_bias_qkv;
    } else if (a == ARCH_PHI3) {
        /* Phi3Attention: qkv_proj / o_proj Linear(bias=False); Phi3MLP: gate_up_proj / down_proj
         * bias=False; sliding_window read below as Mistral's */
        hp->arch = BT_ARCH_PHI3;
        if ((rc = phi3_rope_check(c))) return rc;
    }
    if (a == ARCH_QWEN2 || a == ARCH_QWEN3) {
        /* Qwen2Attention: q/k/v bias=True; Qwen3Attention: bias=config.attention_bias on q/k/v/o
         * (false in every released Qwen3) and q_norm / k_norm (Qwen3RMSNorm(head_dim)) */
        int sw;
        hp->arch = a == ARCH_QWEN2 ? BT_ARCH_QWEN2 : BT_ARCH_QWEN3;
        hp->qk_norm = a == ARCH_QWEN3;
        if (a == ARCH_QWEN2) *attn_bias_qkv = 1;
        else if ((rc = cfg_bool(c, "attention_bias", 0, attn_bias_qkv))) return rc;
        else *attn_bias_o = *attn_bias_qkv;
        if ((rc = cfg_bool(c, "use_sliding_window", 0, &sw))) return rc;
        if (sw)
            return bt_fail(BT_ERR_UNSUPPORTED, "model: %s: use_sliding_window true is not "
                           "supported (attention is full causal)", c->path);
        /* transformers 5 layer_types: every layer must be "full_attention" here */
        json_t *lt = json_object_get(c->root, "layer_types");
        for (size_t i = 0; json_is_array(lt) && i < json_array_size(lt); i++) {
            const char *ty = json_string_value(json_array_get(lt, i));
            if (!ty || strcmp(ty, "full_attention") != 0)
                return bt_fail(BT_ERR_UNSUPPORTED, "model: %s: layer_types[%zu] is \"%s\": only "
                               "\"full_attention\" is supported (no sliding-window attention yet)",
                               c->path, i, ty ? ty : "(not a string)");
        }
    } else {
        /* MistralConfig / Phi3Config "sliding_window" (null = none): applied by the CPU step
         * and trainer/infer, checked against the rows run elsewhere (bt_model_check_window) */
        json_t *sw = json_object_get(c->root, "sliding_window");
        if (sw && !json_is_null(sw) && (!json_is_integer(sw) || json_integer_value(sw) < 1 ||
                                        json_integer_value(sw) > (1 << 30)))
            return bt_fail(BT_ERR_FORMAT, "model: %s: \"sliding_window\" must be null or an "
                           "integer in [1, 2^30]", c->path);
        if (json_is_integer(sw)) {
            hp->sliding_window = (int)json_integer_value(sw);
            bt_log(BT_LOG_INFO, "model", "%s: sliding_window %d (%s)", c->path, hp->sliding_window,
                   a == ARCH_PHI3 ? "Phi-3" : a == ARCH_MISTRAL ? "Mistral" : "Llama");
        }
    }
    if ((rc = parse_rope(c, hp, rope_freqs))) return rc;
    json_t *qc = json_object_get(c->root, "quantization_config");
    if (qc && !json_is_null(qc)) {
        const char *qm = json_string_value(json_object_get(qc, "quant_method"));
        json_t *l8 = json_object_get(qc, "load_in_8bit");
        if (!qm || strcmp(qm, "bitsandbytes") != 0 || json_is_true(l8))
            return bt_fail(BT_ERR_UNSUPPORTED, "model: %s: quantization_config %s%s is not "
                           "supported (only bitsandbytes 4-bit)", c->path,
                           qm ? qm : "(no quant_method)", json_is_true(l8) ? " 8-bit" : "");
    }
    return bt_model_check_hparams(hp, c->path, 1);
}

/* ---------------------------------------------------------------- loader */

/* w[i] = 1 + w[i] in fp32, as Gemma3RMSNorm's output * (1.0 + self.weight.float()) forms the
 * factor (and as convert_hf_to_gguf.py stores Gemma norms in a GGUF). */
static void norm_plus_one(float *w, int n) {
    for (int i = 0; w && i < n; i++) w[i] = 1.0f + w[i];
}

int bt_model_load_hf(bt_model *m, const char *dir, const bt_model_load_opts *opts_in) {
    return bt_model_load_hf_shard(m, dir, opts_in, NULL);
}

int bt_model_load_hf_shard(bt_model *m, const char *dir, const bt_model_load_opts *opts_in,
                           const bt_model_shard *sh) {
    memset(m, 0, sizeof *m);
    bt_model_load_opts opts_v = {BT_BASE_NF4, 0};
    if (opts_in) opts_v = *opts_in;
    const bt_model_load_opts *opts = &opts_v;
    if (!dir) return bt_fail(BT_ERR_INVALID, "model: NULL directory");
    if (opts_v.base_dtype == BT_BASE_AUTO) opts_v.base_dtype = BT_BASE_NF4;
    if (opts_v.base_dtype == BT_BASE_GGUF)
        return bt_fail(BT_ERR_INVALID, "model: %s is a Hugging Face directory: base_dtype \"gguf\" "
                       "keeps a GGUF file's own blocks and needs a .gguf model (use \"nf4\", "
                       "\"fp32\" or \"auto\")", dir);
    if (sh && (sh->world < 1 || sh->rank < 0 || sh->rank >= sh->world))
        return bt_fail(BT_ERR_INVALID, "model: %s: shard rank %d of %d ranks: the rank must be in "
                       "[0, ranks)", dir, sh->rank, sh->world);
    if (sh && sh->world > 1 && opts_v.base_dtype != BT_BASE_NF4)
        return bt_fail(BT_ERR_UNSUPPORTED, "model: %s: loading only this rank's shard of a Hugging "
                       "Face base (dist.shard_base) needs base_dtype nf4 (this rank's groups "
                       "quantised); an fp32 base is loaded whole, then cut", dir);
    char *cpath = path_join(dir, "config.json");
    cfgj c = {NULL, cpath};
    wsrc s;
    memset(&s, 0, sizeof s);
    int rc = file_exists(cpath) ? bt_json_load_file(&c.root, cpath, 0, 16u << 20) : BT_ERR_NOTFOUND;
    if (!c.root) {
        rc = rc != BT_ERR_NOTFOUND ? bt_fail(rc, "model: %s", bt_last_error_in("model"))
                                   : bt_fail(BT_ERR_NOTFOUND, "model: %s: missing (not a Hugging "
                                             "Face model directory?)", cpath);
        free(cpath);
        return rc;
    }
    if (!json_is_object(c.root)) {
        rc = bt_fail(BT_ERR_FORMAT, "model: %s: not a JSON object", cpath);
        goto fail;
    }
    int tied = 0, bqkv = 0, bo = 0, bmlp = 0;
    bt_llama_hparams *hp = &m->hp;
    float rope_freqs[512];
    if ((rc = parse_config(&c, hp, &tied, &bqkv, &bo, &bmlp, rope_freqs))) goto fail;
    if ((rc = bt_model_rope_init(m, rope_freqs))) {
        rc = bt_fail(rc, "model: %s: %s", cpath, bt_last_error_in("model"));
        goto fail;
    }
    if ((rc = wsrc_open(&s, dir)) || (rc = wsrc_check_layers(&s, hp->n_layer, cpath))) goto fail;
    m->base_dtype = opts->base_dtype;
    if ((rc = load_f32(&s, "model.embed_tokens.weight", hp->vocab, hp->d_model, &m->tok_embd)) ||
        (rc = load_f32(&s, "model.norm.weight", 0, hp->d_model, &m->output_norm)))
        goto fail;
    if (tied) {
        m->lm_head = m->tok_embd;
        m->tied = 1;
    } else {
        if (!wsrc_has(&s, "lm_head.weight")) {
            rc = bt_fail(BT_ERR_NOTFOUND, "model: %s: missing tensor lm_head.weight "
                         "(tie_word_embeddings is false)", dir);
            goto fail;
        }
        if ((rc = load_f32(&s, "lm_head.weight", hp->vocab, hp->d_model, &m->lm_head))) goto fail;
    }
    const int gemma = hp->arch == BT_ARCH_GEMMA3;
    if (gemma) norm_plus_one(m->output_norm, hp->d_model);
    m->layers = calloc((size_t)hp->n_layer, sizeof(bt_layer));
    if (!m->layers) {
        rc = bt_fail(BT_ERR_NOMEM, "model: out of memory");
        goto fail;
    }
    char name[160];
    for (int l = 0; l < hp->n_layer; l++) {
        bt_layer *L = &m->layers[l];
        snprintf(name, sizeof name, "model.layers.%d.input_layernorm.weight", l);
        if ((rc = load_f32(&s, name, 0, hp->d_model, &L->attn_norm))) goto fail;
        /* Gemma 3: post_attention_layernorm is the attention output's norm and
         * pre_feedforward_layernorm the MLP input's (Gemma3DecoderLayer) */
        snprintf(name, sizeof name, "model.layers.%d.%s.weight", l,
                 gemma ? "pre_feedforward_layernorm" : "post_attention_layernorm");
        if ((rc = load_f32(&s, name, 0, hp->d_model, &L->ffn_norm))) goto fail;
        if (hp->sandwich_norm) {
            snprintf(name, sizeof name, "model.layers.%d.post_attention_layernorm.weight", l);
            if ((rc = load_f32(&s, name, 0, hp->d_model, &L->post_attn_norm))) goto fail;
            snprintf(name, sizeof name, "model.layers.%d.post_feedforward_layernorm.weight", l);
            if ((rc = load_f32(&s, name, 0, hp->d_model, &L->post_ffn_norm))) goto fail;
        }
        if (hp->qk_norm) {
            snprintf(name, sizeof name, "model.layers.%d.self_attn.q_norm.weight", l);
            if ((rc = load_f32(&s, name, 0, hp->head_dim, &L->q_norm))) goto fail;
            snprintf(name, sizeof name, "model.layers.%d.self_attn.k_norm.weight", l);
            if ((rc = load_f32(&s, name, 0, hp->head_dim, &L->k_norm))) goto fail;
        }
        if (gemma) { /* Gemma3RMSNorm multiplies by (1 + w): hold the factor itself */
            float *nw[6] = {L->attn_norm, L->ffn_norm, L->post_attn_norm, L->post_ffn_norm,
                            L->q_norm, L->k_norm};
            for (int i = 0; i < 6; i++) norm_plus_one(nw[i], i < 4 ? hp->d_model : hp->head_dim);
        }
        for (int j = 0; j < BT_MOD_N; j++) {
            int rows, cols;
            bt_model_lin_shape(hp, j, &rows, &cols);
            int bias = j <= BT_MOD_V ? bqkv : j == BT_MOD_O ? bo : bmlp;
            if (hp->arch == BT_ARCH_PHI3 && j != BT_MOD_O && j != BT_MOD_DOWN) {
                /* Phi3Attention.qkv_proj [Dq + 2 Dkv, D], Phi3MLP.gate_up_proj [2 F, D] */
                const int Dq = hp->n_head * hp->head_dim, Dkv = hp->n_kv_head * hp->head_dim;
                const int qkv = j <= BT_MOD_V;
                snprintf(name, sizeof name, "model.layers.%d.%s", l,
                         qkv ? "self_attn.qkv_proj" : "mlp.gate_up_proj");
                const int total = qkv ? Dq + 2 * Dkv : 2 * hp->d_ff;
                const int r0 = j == BT_MOD_Q || j == BT_MOD_GATE ? 0
                             : j == BT_MOD_K                     ? Dq
                             : j == BT_MOD_V                     ? Dq + Dkv
                                                                 : hp->d_ff;
                if ((rc = load_linear_part(&s, &L->lin[j], name, total, r0, rows, cols,
                                           opts->base_dtype, sh)))
                    goto fail;
                continue;
            }
            snprintf(name, sizeof name, "model.layers.%d.%s", l, k_hf_lin[j]);
            if ((rc = load_linear(&s, &L->lin[j], name, rows, cols, bias, opts->base_dtype, sh)))
                goto fail;
        }
    }
    if ((rc = wsrc_check(&s, 0))) goto fail;
    wsrc_close(&s);
    json_decref(c.root);
    free(cpath);
    return 0;
fail:
    rc = wsrc_check(&s, rc);
    wsrc_close(&s);
    json_decref(c.root);
    free(cpath);
    bt_model_free(m);
    return rc;
}

int bt_model_load(bt_model *m, const char *path, const bt_model_load_opts *opts) {
    memset(m, 0, sizeof *m);
    if (!path) return bt_fail(BT_ERR_INVALID, "model: NULL path");
    struct stat st;
    if (stat(path, &st) != 0)
        return bt_fail(BT_ERR_IO, "model: %s: %s", path, strerror(errno));
    if (S_ISDIR(st.st_mode)) return bt_model_load_hf(m, path, opts);
    return bt_model_load_gguf(m, path, opts);
}

int bt_model_load_shard(bt_model *m, const char *path, const bt_model_load_opts *opts,
                        const bt_model_shard *shard) {
    memset(m, 0, sizeof *m);
    if (!path) return bt_fail(BT_ERR_INVALID, "model: NULL path");
    struct stat st;
    if (stat(path, &st) != 0)
        return bt_fail(BT_ERR_IO, "model: %s: %s", path, strerror(errno));
    if (S_ISDIR(st.st_mode)) return bt_model_load_hf_shard(m, path, opts, shard);
    return bt_model_load_gguf_shard(m, path, opts, shard);
}

int bt_model_resolve_base_dtype(const char *path, int base_dtype) {
    if (base_dtype != BT_BASE_AUTO) return base_dtype;
    struct stat st;
    if (path && stat(path, &st) == 0 && !S_ISDIR(st.st_mode)) return BT_BASE_GGUF;
    return BT_BASE_NF4;
}
