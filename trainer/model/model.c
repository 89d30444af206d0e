/* Frozen Llama base: GGUF loading (dequantise, un-permute Q/K, NF4-quantise; or keep the file's
 * own ggml blocks), random init. */
#include "trainer/model/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "common/gguf.h"
#include "common/quant.h"
#include "trainer/backend/plan.h"
#include "trainer/model/model_internal.h"
#include "trainer/model/rng.h"

/* GGUF tensor suffix per module, in BT_MOD_* order. */
static const char *const k_gguf_lin[BT_MOD_N] = {"attn_q",   "attn_k", "attn_v",  "attn_output",
                                                 "ffn_gate", "ffn_up", "ffn_down"};

bt_dims bt_dims_of(const bt_llama_hparams *hp) {
    bt_dims d;
    d.L = hp->n_layer;
    d.D = hp->d_model;
    d.Hq = hp->n_head;
    d.Hkv = hp->n_kv_head;
    d.hd = hp->head_dim;
    d.Dq = hp->n_head * hp->head_dim;
    d.Dkv = hp->n_kv_head * hp->head_dim;
    d.F = hp->d_ff;
    d.V = hp->vocab;
    return d;
}

void bt_dims_lin_shape(const bt_dims *d, int mod, int *rows, int *cols) {
    switch (mod) {
    case BT_MOD_Q: *rows = d->Dq, *cols = d->D; break;
    case BT_MOD_K:
    case BT_MOD_V: *rows = d->Dkv, *cols = d->D; break;
    case BT_MOD_O: *rows = d->D, *cols = d->Dq; break;
    case BT_MOD_GATE:
    case BT_MOD_UP: *rows = d->F, *cols = d->D; break;
    default: *rows = d->D, *cols = d->F; break; /* down */
    }
}

int64_t bt_dims_max_linear(const bt_dims *d) {
    int64_t mx = 0;
    for (int mod = 0; mod < BT_MOD_N; mod++) {
        int r, c;
        bt_dims_lin_shape(d, mod, &r, &c);
        if ((int64_t)r * c > mx) mx = (int64_t)r * c;
    }
    return mx;
}

int bt_dims_max_cols(const bt_dims *d) {
    int k = d->F > d->D ? d->F : d->D;
    return d->Dq > k ? d->Dq : k;
}

void bt_model_lin_shape(const bt_llama_hparams *hp, int mod, int *rows, int *cols) {
    const bt_dims d = bt_dims_of(hp);
    bt_dims_lin_shape(&d, mod, rows, cols);
}

int bt_model_check_hparams(const bt_llama_hparams *hp, const char *src, int head_dim_free) {
    if (hp->n_layer < 1 || hp->n_layer > 1024 || hp->d_model < 2 || hp->n_head < 1 ||
        hp->n_kv_head < 1 || hp->d_ff < 1 || hp->vocab < 2 || hp->d_model > (1 << 16) ||
        hp->d_ff > (1 << 18) || hp->vocab > (1 << 24))
        return bt_fail(BT_ERR_INVALID,
                       "model: %s: implausible hyper-parameters (layers %d, d_model %d, heads %d/%d,"
                       " ffn %d, vocab %d)",
                       src, hp->n_layer, hp->d_model, hp->n_head, hp->n_kv_head, hp->d_ff, hp->vocab);
    if (hp->n_head % hp->n_kv_head != 0)
        return bt_fail(BT_ERR_INVALID, "model: %s: head_count %d is not a multiple of head_count_kv %d",
                       src, hp->n_head, hp->n_kv_head);
    if (head_dim_free && (hp->head_dim < 2 || hp->head_dim > 1024 || hp->head_dim % 2 != 0 ||
                          (int64_t)hp->head_dim * hp->n_head > (1 << 16)))
        return bt_fail(BT_ERR_INVALID, "model: %s: head_dim %d must be even, in [2, 1024], and "
                       "head_dim x heads %d at most 65536", src, hp->head_dim, hp->n_head);
    if (!head_dim_free && (hp->head_dim * hp->n_head != hp->d_model || hp->head_dim % 2 != 0))
        return bt_fail(BT_ERR_INVALID,
                       "model: %s: head_dim %d x head_count %d must equal embedding_length %d "
                       "(and head_dim be even)",
                       src, hp->head_dim, hp->n_head, hp->d_model);
    if (!(hp->rope_theta > 0) || !(hp->rms_eps > 0) || !isfinite(hp->rope_theta) ||
        !isfinite(hp->rms_eps))
        return bt_fail(BT_ERR_INVALID, "model: %s: rope theta %g / rms eps %g must be > 0", src,
                       hp->rope_theta, hp->rms_eps);
    if (!(hp->rope_factor >= 0) || !isfinite(hp->rope_factor))
        return bt_fail(BT_ERR_INVALID, "model: %s: RoPE scaling factor %g must be > 0", src,
                       hp->rope_factor);
    return 0;
}

size_t bt_model_scratch_floats(const bt_model *m) {
    if (m->base_dtype != BT_BASE_NF4 && m->base_dtype != BT_BASE_GGUF) return 1;
    /* K of every NF4 / ggml GEMM is a linear's cols: d_model, d_ff, or n_head * head_dim (o_proj;
     * may exceed both with an explicit HF head_dim); both use the tiled driver's scratch */
    const bt_dims d = bt_dims_of(&m->hp);
    return bt_nf4_scratch_floats(bt_dims_max_cols(&d));
}

void bt_base_fwd(float *Y, const float *X, const bt_base_linear *l, int M, float beta,
                 float *scratch) {
    if (l->is_nf4) bt_nf4_linear_fwd(Y, X, &l->q, M, l->cols, l->rows, beta, scratch);
    else if (l->is_gguf) bt_ggml_linear_fwd(Y, X, &l->g, M, l->cols, l->rows, beta, scratch);
    else bt_linear_fwd(Y, X, l->w, M, l->cols, l->rows, beta);
    if (l->bias) {
        const float *b = l->bias;
        int N = l->rows;
#pragma omp parallel for schedule(static)
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++) Y[(size_t)i * N + j] += b[j];
    }
}

void bt_base_bwd_x(float *dX, const float *dY, const bt_base_linear *l, int M, float beta,
                   float *scratch) {
    if (l->is_nf4) bt_nf4_linear_bwd_x(dX, dY, &l->q, M, l->cols, l->rows, beta, scratch);
    else if (l->is_gguf) bt_ggml_linear_bwd_x(dX, dY, &l->g, M, l->cols, l->rows, beta, scratch);
    else bt_linear_bwd_x(dX, dY, l->w, M, l->cols, l->rows, beta);
}

static void lin_free(bt_base_linear *l) {
    if (l->is_nf4) bt_nf4_free(&l->q);
    if (l->is_gguf) bt_ggml_mat_free(&l->g);
    free(l->w);
    free(l->bias);
    memset(l, 0, sizeof *l);
}

void bt_model_free(bt_model *m) {
    if (!m) return;
    if (m->layers) {
        for (int i = 0; i < m->hp.n_layer; i++) {
            free(m->layers[i].attn_norm);
            free(m->layers[i].ffn_norm);
            free(m->layers[i].q_norm);
            free(m->layers[i].k_norm);
            free(m->layers[i].post_attn_norm);
            free(m->layers[i].post_ffn_norm);
            for (int j = 0; j < BT_MOD_N; j++) lin_free(&m->layers[i].lin[j]);
        }
        free(m->layers);
    }
    if (!m->tied) free(m->lm_head);
    free(m->tok_embd);
    free(m->output_norm);
    free(m->inv_freq);
    free(m->inv_freq_local);
    free(m->rope_freqs);
    memset(m, 0, sizeof *m);
}

int bt_model_layer_window(const bt_llama_hparams *hp, int l) {
    if (hp->sliding_window <= 0) return 0;
    if (hp->swa_pattern > 0 && (l + 1) % hp->swa_pattern == 0) return 0; /* a global layer */
    return hp->sliding_window;
}

const float *bt_model_layer_inv(const bt_model *m, int l, const float *global) {
    return m->inv_freq_local && bt_model_layer_window(&m->hp, l) > 0 ? m->inv_freq_local : global;
}

int bt_rope_ext_parse(const char *name) {
    if (!name) return -1;
    if (!strcmp(name, "linear")) return BT_ROPE_EXT_LINEAR;
    if (!strcmp(name, "yarn")) return BT_ROPE_EXT_YARN;
    if (!strcmp(name, "dynamic")) return BT_ROPE_EXT_DYNAMIC;
    return -1;
}

const char *bt_rope_ext_name(int ext) {
    static const char *const names[] = {"none", "linear", "yarn", "dynamic"};
    return ext >= 0 && ext <= BT_ROPE_EXT_DYNAMIC ? names[ext] : "?";
}

float bt_model_attn_factor(const bt_llama_hparams *hp) {
    if (hp->rope_ext == BT_ROPE_EXT_YARN)
        return bt_rope_yarn_attention_factor(hp->rope_ext_factor, hp->rope_attn_factor);
    return hp->rope_attn_factor > 0.f ? hp->rope_attn_factor : 1.0f; /* HF longrope's */
}

float bt_model_attn_scale(const bt_llama_hparams *hp) {
    /* Gemma's query_pre_attn_scalar (Gemma3Attention.scaling = query_pre_attn_scalar ** -0.5) */
    const float s = 1.0f / sqrtf(hp->attn_scalar > 0.f ? hp->attn_scalar : (float)hp->head_dim);
    const float a = bt_model_attn_factor(hp);
    return a == 1.0f ? s : s * (a * a);
}

/* The model's own table (default / llama3 / rope_freqs) into inv [D/2]. */
static int rope_own_table(const bt_llama_hparams *hp, const float *ff, float *inv) {
    const int D = hp->head_dim;
    int rc;
    if (hp->rope_type == BT_ROPE_LLAMA3)
        rc = bt_rope_inv_freq(inv, D, hp->rope_theta, "llama3", hp->rope_factor,
                              hp->rope_low_freq_factor, hp->rope_high_freq_factor,
                              hp->rope_orig_ctx);
    else if (hp->rope_type == BT_ROPE_DEFAULT || hp->rope_type == BT_ROPE_FREQS)
        rc = bt_rope_inv_freq(inv, D, hp->rope_theta, "default", 0.f, 0.f, 0.f, 0);
    else
        rc = bt_fail(BT_ERR_INVALID, "model: unknown RoPE type %d", hp->rope_type);
    if (!rc && hp->rope_type == BT_ROPE_FREQS)
        for (int i = 0; i < D / 2; i++)
            inv[i] = inv[i] / ff[i]; /* ggml_rope_ext: theta = pos * base^(-2i/D) / freq_factor */
    return rc;
}

static int rope_ext_check(const bt_llama_hparams *hp) {
    if (hp->rope_ext == BT_ROPE_EXT_NONE) return 0;
    if (hp->rope_ext < 0 || hp->rope_ext > BT_ROPE_EXT_DYNAMIC)
        return bt_fail(BT_ERR_INVALID, "model: unknown RoPE scaling %d", hp->rope_ext);
    if (!(hp->rope_ext_factor >= 1e-3f && hp->rope_ext_factor <= 1e6f))
        return bt_fail(BT_ERR_INVALID, "model: RoPE %s scaling factor %g is outside [0.001, 1e6]",
                       bt_rope_ext_name(hp->rope_ext), (double)hp->rope_ext_factor);
    if (hp->rope_ext != BT_ROPE_EXT_LINEAR && hp->rope_ext_orig_ctx < 1)
        return bt_fail(BT_ERR_INVALID, "model: RoPE %s scaling needs the original context length "
                       "(got %d)", bt_rope_ext_name(hp->rope_ext), hp->rope_ext_orig_ctx);
    return 0;
}

int bt_model_rope_init(bt_model *m, const float *rope_freqs) {
    const bt_llama_hparams *hp = &m->hp;
    const int D = hp->head_dim, half = D / 2;
    float *ff = NULL;
    if (D >= 2 && D % 2 == 0 && hp->rope_type == BT_ROPE_FREQS && rope_freqs) {
        if (!(ff = malloc((size_t)half * sizeof(float))))
            return bt_fail(BT_ERR_NOMEM, "model: out of memory (RoPE table)");
        memcpy(ff, rope_freqs, (size_t)half * sizeof(float)); /* rope_freqs may be m->rope_freqs */
    }
    free(m->inv_freq);
    free(m->inv_freq_local);
    free(m->rope_freqs);
    m->inv_freq = m->rope_freqs = m->inv_freq_local = NULL;
    if (D < 2 || D % 2 != 0)
        return bt_fail(BT_ERR_INVALID, "model: RoPE head_dim %d must be even and >= 2", D);
    if (hp->rope_type == BT_ROPE_FREQS && !ff)
        return bt_fail(BT_ERR_INVALID, "model: RoPE type rope_freqs needs the factor table");
    float *inv = malloc((size_t)half * sizeof(float));
    if (!inv) {
        free(ff);
        return bt_fail(BT_ERR_NOMEM, "model: out of memory (RoPE table)");
    }
    int rc = rope_ext_check(hp);
    for (int i = 0; ff && i < half && !rc; i++)
        if (!(ff[i] > 0.f) || !isfinite(ff[i]))
            rc = bt_fail(BT_ERR_INVALID, "model: RoPE frequency factor %d is %g (must be > 0)", i,
                         (double)ff[i]);
    if (!rc) rc = rope_own_table(hp, ff, inv);
    if (!rc && hp->rope_ext == BT_ROPE_EXT_LINEAR) {
        for (int i = 0; i < half; i++) inv[i] = inv[i] / hp->rope_ext_factor; /* inv_freq /= factor */
    } else if (!rc && hp->rope_ext == BT_ROPE_EXT_YARN) {
        if (hp->rope_type == BT_ROPE_DEFAULT) /* exactly transformers' yarn table */
            rc = bt_rope_inv_freq_yarn(inv, D, hp->rope_theta, hp->rope_ext_factor,
                                       hp->rope_ext_orig_ctx, hp->rope_yarn_beta_fast,
                                       hp->rope_yarn_beta_slow);
        else
            rc = bt_rope_yarn_mix(inv, D, hp->rope_theta, hp->rope_ext_factor,
                                  hp->rope_ext_orig_ctx, hp->rope_yarn_beta_fast,
                                  hp->rope_yarn_beta_slow);
    }
    float *loc = NULL; /* the local layers' own table: plain default with their base (Gemma 3:
                        * transformers' sliding_attention rope_parameters, llama.cpp's
                        * rope_freq_base_train_swa with freq_scale 1) */
    if (!rc && hp->rope_local_theta > 0.f) {
        if (!(loc = malloc((size_t)half * sizeof(float))))
            rc = bt_fail(BT_ERR_NOMEM, "model: out of memory (RoPE table)");
        else
            rc = bt_rope_inv_freq(loc, D, hp->rope_local_theta, "default", 0.f, 0.f, 0.f, 0);
    }
    if (rc) {
        free(inv);
        free(loc);
        free(ff);
        return rc;
    }
    m->inv_freq = inv;
    m->inv_freq_local = loc;
    m->rope_freqs = ff;
    return 0;
}

/* Bytes of one base linear's weight (no bias). */
static size_t lin_bytes(const bt_base_linear *l) {
    size_t n = l->is_nf4 && l->shard_world > 1 ? (size_t)l->q.n : (size_t)l->rows * l->cols; /* a cut: its part */
    if (l->is_nf4) return n / 2 + n / 64 + (n / 64 / 256 + 1) * 4;
    if (l->is_gguf) return bt_ggml_mat_bytes(&l->g);
    return n * 4;
}

int bt_model_rope_table(const bt_model *m, int64_t seq_len, float *out) {
    const bt_llama_hparams *hp = &m->hp;
    const int D = hp->head_dim, half = D / 2;
    if (!m->inv_freq || !out) return bt_fail(BT_ERR_INVALID, "model: no RoPE table");
    if (hp->rope_ext != BT_ROPE_EXT_DYNAMIC || seq_len <= hp->rope_ext_orig_ctx) {
        memcpy(out, m->inv_freq, (size_t)half * sizeof(float));
        return 0;
    }
    int rc = bt_rope_inv_freq_dynamic(out, D, hp->rope_theta, hp->rope_ext_factor,
                                      hp->rope_ext_orig_ctx, seq_len);
    if (rc || hp->rope_type == BT_ROPE_DEFAULT) return rc ? rc : 1;
    /* composed with a llama3 / rope_freqs table: every own frequency scaled as dynamic NTK scales
     * the default one */
    float dflt[512];
    if (half > 512) return bt_fail(BT_ERR_INVALID, "model: head_dim %d too large", D);
    if ((rc = bt_rope_inv_freq(dflt, D, hp->rope_theta, "default", 0.f, 0.f, 0.f, 0))) return rc;
    for (int i = 0; i < half; i++) out[i] = m->inv_freq[i] * (out[i] / dflt[i]);
    return 1;
}

int bt_model_extend_context(bt_model *m, int method, int target_length) {
    bt_llama_hparams *hp = &m->hp;
    if (method < BT_ROPE_EXT_LINEAR || method > BT_ROPE_EXT_DYNAMIC)
        return bt_fail(BT_ERR_INVALID, "config: context_extension.method: expected \"linear\", "
                       "\"yarn\" or \"dynamic\"");
    if (hp->rope_ext == method && hp->ctx == target_length) return 0; /* already extended so */
    if (!m->inv_freq) return bt_fail(BT_ERR_INVALID, "model: no RoPE table to extend");
    if (hp->rope_ext != BT_ROPE_EXT_NONE)
        return bt_fail(BT_ERR_INVALID, "config: context_extension: the model already has RoPE "
                       "scaling \"%s\" (factor %g, context %d); it cannot take a second one "
                       "(\"%s\" to %d): drop context_extension, or start from the unscaled base",
                       bt_rope_ext_name(hp->rope_ext), (double)hp->rope_ext_factor, hp->ctx,
                       bt_rope_ext_name(method), target_length);
    if (hp->ctx < 1 || target_length <= hp->ctx)
        return bt_fail(BT_ERR_INVALID, "config: context_extension.target_length: expected more "
                       "than the model's context length %d, got %d", hp->ctx, target_length);
    bt_llama_hparams old = *hp;
    hp->rope_ext = method;
    hp->rope_ext_factor = (float)((double)target_length / (double)hp->ctx);
    hp->rope_ext_orig_ctx = hp->ctx;
    hp->rope_yarn_beta_fast = hp->rope_yarn_beta_slow = 0.f;
    hp->rope_attn_factor = 0.f;
    hp->ctx = target_length;
    int rc = bt_model_rope_init(m, m->rope_freqs);
    if (rc) {
        *hp = old;
        if (bt_model_rope_init(m, m->rope_freqs) != 0) return rc; /* restore (cannot fail twice) */
        return rc;
    }
    m->ctx_extended = 1;
    return 0;
}

size_t bt_model_bytes(const bt_model *m) {
    size_t b = (size_t)m->hp.vocab * m->hp.d_model * 4 * (m->tied ? 1 : 2);
    b += (size_t)m->hp.d_model * 4 * (1 + 2 * (size_t)m->hp.n_layer);
    for (int i = 0; i < m->hp.n_layer; i++)
        for (int j = 0; j < BT_MOD_N; j++) {
            const bt_base_linear *l = &m->layers[i].lin[j];
            b += lin_bytes(l);
            if (l->bias) b += (size_t)l->rows * 4;
        }
    return b;
}

void bt_model_base_info(const bt_model *m, bt_base_info *out) {
    memset(out, 0, sizeof *out);
    out->base_dtype = m->base_dtype;
    int64_t per_type[BT_GGML_TYPE_SLOTS] = {0}; /* ggml weights per type */
    for (int i = 0; m->layers && i < m->hp.n_layer; i++)
        for (int j = 0; j < BT_MOD_N; j++) {
            const bt_base_linear *l = &m->layers[i].lin[j];
            const int64_t n = (int64_t)l->rows * l->cols;
            out->n_weights += n;
            out->bytes += lin_bytes(l);
            if (l->is_gguf && l->g.type >= 0 && l->g.type < BT_GGML_TYPE_SLOTS)
                per_type[l->g.type] += n;
        }
    out->bits_per_weight = out->n_weights ? 8.0 * (double)out->bytes / (double)out->n_weights : 0;
    if (m->base_dtype != BT_BASE_GGUF) {
        snprintf(out->types, sizeof out->types, "%s", bt_base_dtype_name(m->base_dtype));
        return;
    }
    bt_ggml_type_mix(per_type, out->types, sizeof out->types);
}

int bt_model_lin_set(bt_base_linear *l, float *w, int rows, int cols, int base_dtype,
                     const char *what) {
    l->rows = rows;
    l->cols = cols;
    if (base_dtype == BT_BASE_FP32) {
        l->w = w;
        l->is_nf4 = 0;
        return 0;
    }
    if (((int64_t)rows * cols) % BT_NF4_BLOCKSIZE != 0) {
        free(w);
        return bt_fail(BT_ERR_UNSUPPORTED, "model: %s: %d x %d elements is not a multiple of the NF4 "
                       "block size 64 (use base_dtype fp32)", what, rows, cols);
    }
    int rc = bt_nf4_quantize(&l->q, w, rows, cols);
    free(w);
    if (rc) return bt_fail(rc, "model: %s: NF4 quantisation failed: %s", what, bt_last_error_in("model"));
    l->is_nf4 = 1;
    return 0;
}

/* ---- GGUF ---- */

static int kv_int(const bt_gguf *g, const char *path, const char *key, int required, int64_t def,
                  int *out) {
    int64_t v;
    int rc = bt_gguf_get_i64(g, key, &v);
    if (rc == BT_ERR_NOTFOUND && !required) v = def;
    else if (rc == BT_ERR_NOTFOUND)
        return bt_fail(BT_ERR_NOTFOUND, "model: %s: missing metadata key %s", path, key);
    else if (rc) return bt_fail(rc, "model: %s: %s", path, bt_last_error_in("model"));
    if (v < 0 || v > 0x7fffffff)
        return bt_fail(BT_ERR_FORMAT, "model: %s: %s = %lld out of range", path, key, (long long)v);
    *out = (int)v;
    return 0;
}

static int kv_float(const bt_gguf *g, const char *path, const char *key, int required, double def,
                    float *out) {
    double v;
    int rc = bt_gguf_get_f64(g, key, &v);
    if (rc == BT_ERR_NOTFOUND && !required) v = def;
    else if (rc == BT_ERR_NOTFOUND)
        return bt_fail(BT_ERR_NOTFOUND, "model: %s: missing metadata key %s", path, key);
    else if (rc) return bt_fail(rc, "model: %s: %s", path, bt_last_error_in("model"));
    *out = (float)v;
    return 0;
}

/* Tensor `name` with logical PyTorch shape [rows, cols] (rows = 0: 1-D [cols]), a type with a
 * decoder and enough bytes, else an error naming the tensor. */
static int find_tensor_checked(const bt_gguf *g, const char *path, const char *name, int rows,
                               int cols, const bt_gguf_tensor **out) {
    *out = NULL;
    const bt_gguf_tensor *t = bt_gguf_find_tensor(g, name);
    if (!t) return bt_fail(BT_ERR_NOTFOUND, "model: %s: missing tensor %s", path, name);
    int want_dims = rows ? 2 : 1;
    uint64_t r = rows ? (uint64_t)rows : 1;
    if (t->n_dims != (uint32_t)want_dims || t->ne[0] != (uint64_t)cols || t->ne[1] != r ||
        t->ne[2] != 1 || t->ne[3] != 1)
        return bt_fail(BT_ERR_FORMAT,
                       "model: %s: tensor %s has shape (ne) [%llu, %llu, %llu, %llu] / %u dims, "
                       "expected [%d, %llu] (%d dims)",
                       path, name, (unsigned long long)t->ne[0], (unsigned long long)t->ne[1],
                       (unsigned long long)t->ne[2], (unsigned long long)t->ne[3], t->n_dims, cols,
                       (unsigned long long)r, want_dims);
    size_t row = bt_ggml_row_size(t->type, cols);
    if (row == 0 || !bt_ggml_can_dequantize(t->type))
        return bt_fail(BT_ERR_UNSUPPORTED,
                       "model: %s: tensor %s has ggml type %s (%d), which the trainer cannot decode "
                       "(supported, for every base_dtype: %s): convert the file to one of them, "
                       "e.g. with llama.cpp's llama-quantize", path, name,
                       bt_ggml_type_name(t->type), t->type, bt_ggml_decodable_types());
    if ((uint64_t)row * r > t->nbytes)
        return bt_fail(BT_ERR_FORMAT, "model: %s: tensor %s: %llu bytes, expected %llu", path, name,
                       (unsigned long long)t->nbytes, (unsigned long long)row * r);
    *out = t;
    return 0;
}

/* Dequantise tensor `name` of logical PyTorch shape [rows, cols] (rows = 0: 1-D [cols]) into a
 * new fp32 buffer. */
static int load_tensor(const bt_gguf *g, const char *path, const char *name, int rows, int cols,
                       float **out) {
    *out = NULL;
    const bt_gguf_tensor *t;
    int rc = find_tensor_checked(g, path, name, rows, cols, &t);
    if (rc) return rc;
    const int64_t n = (int64_t)(rows ? rows : 1) * cols;
    float *w = bt_aligned_alloc((size_t)n * sizeof(float));
    if (!w) return bt_fail(BT_ERR_NOMEM, "model: %s: out of memory for %s", path, name);
    rc = bt_ggml_dequantize(t->type, t->data, w, n);
    if (rc) {
        free(w);
        return bt_fail(rc, "model: %s: tensor %s: %s", path, name, bt_last_error_in("model"));
    }
    /* decoded: the tensor's file pages are given back, so the resident set keeps the fp32 copy,
     * not the copy and the file (model_internal.h bt_model_drop_pages) */
    bt_model_drop_pages(t->data, bt_ggml_row_size(t->type, n));
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(w[i])) {
            free(w);
            return bt_fail(BT_ERR_FORMAT, "model: %s: tensor %s: non-finite value at element %lld",
                           path, name, (long long)i);
        }
    *out = w;
    return 0;
}

/* Inverse of convert_hf_to_gguf.py LlamaModel.permute(w, n_head, n_head_kv):
 *   gguf = w.reshape(nh, 2, hd/2, cols).swapaxes(1, 2).reshape(rows, cols)
 * so gguf row h*hd + 2*i + j holds HF row h*hd + j*hd/2 + i. */
static int unpermute_rows(float *w, int nh, int hd, int cols) {
    size_t rowb = (size_t)cols * sizeof(float);
    float *tmp = malloc((size_t)hd * rowb);
    if (!tmp) return bt_fail(BT_ERR_NOMEM, "model: out of memory (un-permute)");
    int half = hd / 2;
    for (int h = 0; h < nh; h++) {
        float *base = w + (size_t)h * hd * cols;
        memcpy(tmp, base, (size_t)hd * rowb);
        for (int i = 0; i < half; i++)
            for (int j = 0; j < 2; j++)
                memcpy(base + (size_t)(j * half + i) * cols, tmp + (size_t)(2 * i + j) * cols, rowb);
    }
    free(tmp);
    return 0;
}

/* Linear `name` [rows, cols] kept in its own ggml blocks (BT_BASE_GGUF): rows copied in HF order
 * (for q/k, nh > 0: HF row h*hd + j*hd/2 + i is GGUF row h*hd + 2*i + j, the unpermute_rows map
 * applied to whole block rows, so no value changes), then every value decoded once to check it is
 * finite (the dequantised-base loaders check the same). total > 0: the tensor is a fused
 * [total, cols] one (Phi-3 attn_qkv / ffn_up) and the linear is its rows [r0, r0 + rows) (ggml
 * blocks never span rows, so a row range is a byte range); total 0: the whole tensor. */
static int load_linear_gguf(const bt_gguf *g, const char *path, const char *name, int rows,
                            int cols, int nh, int hd, int total, int r0, const bt_model_shard *sh,
                            bt_base_linear *l) {
    const bt_gguf_tensor *t;
    int rc = find_tensor_checked(g, path, name, total ? total : rows, cols, &t);
    if (rc) return rc;
    const size_t row_bytes = bt_ggml_row_size(t->type, cols);
    const uint8_t *src = (const uint8_t *)t->data + (size_t)r0 * row_bytes;
    /* this rank's HF rows [a, b) (dist.shard_base at load: bt_shard_cut_rows's cut), else all */
    int64_t a = 0, b = rows;
    if (sh && sh->world > 1) {
        const int64_t per = bt_shard_units(rows, sh->world);
        a = (int64_t)sh->rank * per < rows ? (int64_t)sh->rank * per : rows;
        b = a + per < rows ? a + per : rows;
        l->shard_rank = sh->rank;
        l->shard_world = sh->world;
        l->shard_r0 = a;
    }
    const int64_t nr = b - a;
    int32_t *perm = NULL;
    if (nr > 0 && nh > 0) { /* HF row a + i is file row perm[i] (unpermute_rows's map) */
        perm = malloc((size_t)nr * sizeof *perm);
        if (!perm) return bt_fail(BT_ERR_NOMEM, "model: out of memory (un-permute)");
        const int half = hd / 2;
        for (int64_t i = 0; i < nr; i++) {
            const int r = (int)(a + i);
            perm[i] = (r / hd) * hd + 2 * (r % hd % half) + (r % hd) / half;
        }
    }
    l->rows = rows;
    l->cols = cols;
    l->is_gguf = 1;
    if (nr == 0) { /* a rank past the end of a short matrix: padding only (plan.h) */
        memset(&l->g, 0, sizeof l->g);
        l->g.type = (int)t->type;
        l->g.cols = cols;
        l->g.row_bytes = row_bytes;
        return 0;
    }
    if (nr == rows) { /* the whole matrix: the permutation applied by bt_ggml_mat_init */
        rc = bt_ggml_mat_init(&l->g, t->type, nr, cols, src, perm);
    } else { /* a cut: its rows, then (q/k) each moved from its file row; whole block rows, exact */
        rc = bt_ggml_mat_init(&l->g, t->type, nr, cols, src + (size_t)a * row_bytes, NULL);
        for (int64_t i = 0; !rc && perm && i < nr; i++)
            memcpy(l->g.data + (size_t)i * row_bytes, src + (size_t)perm[i] * row_bytes, row_bytes);
    }
    free(perm);
    if (rc) return bt_fail(rc, "model: %s: tensor %s: %s", path, name, bt_last_error_in("model"));
    /* copied: the file pages of the linear's rows are given back (bt_model_drop_pages) */
    bt_model_drop_pages(src, (size_t)rows * row_bytes);
    float *buf = malloc((size_t)cols * sizeof(float));
    if (!buf) return bt_fail(BT_ERR_NOMEM, "model: out of memory (%s)", name);
    for (int64_t i = 0; i < nr && !rc; i++) {
        if ((rc = bt_ggml_mat_dequantize_rows(&l->g, i, 1, buf))) break;
        const int r = (int)(a + i);
        for (int c = 0; c < cols; c++)
            if (!isfinite(buf[c])) {
                /* report the element in the file's own (GGUF) order */
                const int fr = r0 + (nh > 0 ? (r / hd) * hd + 2 * (r % hd % (hd / 2)) +
                                                  (r % hd) / (hd / 2)
                                            : r);
                rc = bt_fail(BT_ERR_FORMAT, "model: %s: tensor %s: non-finite value at element "
                             "%lld", path, name, (long long)fr * cols + c);
                break;
            }
    }
    free(buf);
    return rc;
}

/* llama.rope.scaling.* (llama.cpp llama-model.cpp load_hparams; the keys convert_hf_to_gguf.py
 * writes): type "none" | "linear" (factor: freq_scale = 1 / factor) | "yarn" (factor,
 * original_context_length, attn_factor: llama.cpp's rope_yarn multiplies it by 1 + 0.1 ln factor,
 * so the HF attention_factor is their product; yarn_beta_fast / yarn_beta_slow, default 32 / 1).
 * Absent keys: no scaling. They compose with rope_freqs.weight as in ggml_rope_ext. */
int bt_model_gguf_rope_scaling(const bt_gguf *g, const char *path, bt_llama_hparams *hp) {
    if (bt_gguf_find_key(g, "llama.rope.scaling.type") < 0) return 0;
    bt_str st = {"", 0};
    if (bt_gguf_get_str(g, "llama.rope.scaling.type", &st) != 0)
        return bt_fail(BT_ERR_FORMAT, "model: %s: llama.rope.scaling.type is not a string", path);
    int ext = st.len == 6 && !memcmp(st.ptr, "linear", 6) ? BT_ROPE_EXT_LINEAR
              : st.len == 4 && !memcmp(st.ptr, "yarn", 4) ? BT_ROPE_EXT_YARN
              : st.len == 4 && !memcmp(st.ptr, "none", 4) ? BT_ROPE_EXT_NONE
                                                          : -1;
    if (ext < 0)
        return bt_fail(BT_ERR_UNSUPPORTED, "model: %s: llama.rope.scaling.type \"%.*s\" is not "
                       "supported (none, linear, yarn; Llama 3.1 scaling comes as "
                       "rope_freqs.weight)", path, (int)(st.len > 32 ? 32 : st.len), st.ptr);
    if (ext == BT_ROPE_EXT_NONE) return 0;
    int rc;
    float f = 0.f;
    if ((rc = kv_float(g, path, "llama.rope.scaling.factor", 1, 0, &f))) return rc;
    if (!(f > 0.f) || !isfinite(f))
        return bt_fail(BT_ERR_FORMAT, "model: %s: llama.rope.scaling.factor %g must be > 0", path,
                       (double)f);
    if (f == 1.f) return 0; /* identity */
    hp->rope_ext = ext;
    hp->rope_ext_factor = f;
    if (ext == BT_ROPE_EXT_YARN) {
        float af = 1.f, bf = 32.f, bs = 1.f;
        if ((rc = kv_int(g, path, "llama.rope.scaling.original_context_length", 0, hp->ctx,
                         &hp->rope_ext_orig_ctx)) ||
            (rc = kv_float(g, path, "llama.rope.scaling.attn_factor", 0, 1.0, &af)) ||
            (rc = kv_float(g, path, "llama.rope.scaling.yarn_beta_fast", 0, 32.0, &bf)) ||
            (rc = kv_float(g, path, "llama.rope.scaling.yarn_beta_slow", 0, 1.0, &bs)))
            return rc;
        if (!(af > 0.f) || !isfinite(af) || !(bf > 0.f) || !(bs > 0.f) || hp->rope_ext_orig_ctx < 1)
            return bt_fail(BT_ERR_FORMAT, "model: %s: llama.rope.scaling: attn_factor %g, "
                           "yarn_beta_fast %g, yarn_beta_slow %g must be > 0 and "
                           "original_context_length %d >= 1", path, (double)af, (double)bf,
                           (double)bs, hp->rope_ext_orig_ctx);
        hp->rope_yarn_beta_fast = bf;
        hp->rope_yarn_beta_slow = bs;
        hp->rope_attn_factor = af == 1.f ? 0.f : af * bt_rope_yarn_attention_factor(f, 0.f);
    }
    return 0;
}

int bt_model_check_window(const bt_model *m, int64_t max_T, const char *what, int has_window) {
    const int w = m->hp.sliding_window;
    if (w <= 0) return 0;
    const char *fam = m->hp.arch == BT_ARCH_PHI3     ? "Phi-3"
                      : m->hp.arch == BT_ARCH_GEMMA3 ? "Gemma 3"
                                                     : "Mistral";
    if (has_window) {
        if (max_T > w)
            bt_log(BT_LOG_INFO, "model", "%s sliding_window %d < %s %lld: sliding-window attention "
                   "on the layers that have it", fam, w, what, (long long)max_T);
        return 0;
    }
    if (max_T <= w) {
        bt_log(BT_LOG_INFO, "model", "%s sliding_window %d >= %s %lld: every causal pair is "
               "inside the window, so full causal attention is exact", fam, w, what,
               (long long)max_T);
        return 0;
    }
    return bt_fail(BT_ERR_UNSUPPORTED, "model: %s %lld exceeds the model's sliding_window %d (%s: "
                   "config.json \"sliding_window\"%s): this backend's attention has no window yet "
                   "(device \"cpu\" has), and full attention would differ from the model's beyond "
                   "%d tokens; set %s <= %d or use device \"cpu\"", what, (long long)max_T, w, fam,
                   m->hp.arch == BT_ARCH_PHI3 ? ", GGUF phi3.attention.sliding_window" : "", w,
                   what, w);
}

const char *bt_arch_name(int arch) {
    return arch == BT_ARCH_QWEN2 ? "qwen2" : arch == BT_ARCH_QWEN3 ? "qwen3"
         : arch == BT_ARCH_PHI3  ? "phi3"
         : arch == BT_ARCH_GEMMA3 ? "gemma3"
                                 : "llama";
}

/* Stage: general.architecture of `g` must be "llama", "qwen2", "qwen3" or "phi3" (llama.cpp
 * llama-arch.cpp LLM_ARCH_NAMES). Reads g; writes *arch (BT_ARCH_*). Errors: BT_ERR_NOTFOUND
 * (key missing), BT_ERR_FORMAT (not a string), BT_ERR_UNSUPPORTED (another architecture, named
 * in the message). */
static int gguf_check_arch(const bt_gguf *g, const char *path, int *arch_out) {
    bt_str arch;
    int rc = bt_gguf_get_str(g, "general.architecture", &arch);
    if (rc)
        return bt_fail(rc == BT_ERR_NOTFOUND ? BT_ERR_NOTFOUND : BT_ERR_FORMAT,
                       "model: %s: general.architecture: %s", path,
                       rc == BT_ERR_NOTFOUND ? "missing" : bt_last_error());
    for (int a = BT_ARCH_LLAMA; a <= BT_ARCH_GEMMA3; a++)
        if (arch.len == strlen(bt_arch_name(a)) && !memcmp(arch.ptr, bt_arch_name(a), arch.len)) {
            *arch_out = a;
            return 0;
        }
    return bt_fail(BT_ERR_UNSUPPORTED,
                   "model: %s: general.architecture is \"%.*s\"; the trainer supports \"llama\", "
                   "\"qwen2\", \"qwen3\", \"phi3\" and \"gemma3\"",
                   path, (int)(arch.len > 64 ? 64 : arch.len), arch.ptr);
}

/* Stage: the <arch>.* shape keys, <arch> = general.architecture (llama.cpp llama-model.cpp
 * load_hparams names and defaults: context_length 2048, rope.freq_base 10000, head_count_kv =
 * head_count, attention.key_length = attention.value_length = embedding_length / head_count,
 * rope.dimension_count = key_length) into hp; head_dim = key_length (convert_hf_to_gguf.py
 * TextModel.set_gguf_parameters writes key_length / value_length from HF head_dim, which Qwen3
 * sets apart from hidden_size / heads). Reads g; writes the shape fields of hp. Errors: those of
 * kv_int / kv_float (BT_ERR_NOTFOUND missing required key, BT_ERR_FORMAT bad value),
 * BT_ERR_FORMAT (head_count 0), BT_ERR_UNSUPPORTED (partial RoPE, value_length != key_length). */
static int gguf_shape_keys(const bt_gguf *g, const char *path, bt_llama_hparams *hp) {
    int rc, rope_dim = 0, v_len = 0;
    const char *a = bt_arch_name(hp->arch);
    char k[8][64];
    static const char *const sfx[8] = {"block_count", "embedding_length", "attention.head_count",
                                       "feed_forward_length", "context_length",
                                       "attention.layer_norm_rms_epsilon", "rope.freq_base",
                                       "attention.head_count_kv"};
    for (int i = 0; i < 8; i++) snprintf(k[i], sizeof k[i], "%s.%s", a, sfx[i]);
    if ((rc = kv_int(g, path, k[0], 1, 0, &hp->n_layer)) ||
        (rc = kv_int(g, path, k[1], 1, 0, &hp->d_model)) ||
        (rc = kv_int(g, path, k[2], 1, 0, &hp->n_head)) ||
        (rc = kv_int(g, path, k[3], 1, 0, &hp->d_ff)) ||
        (rc = kv_int(g, path, k[4], 0, 2048, &hp->ctx)) ||
        (rc = kv_float(g, path, k[5], 1, 0, &hp->rms_eps)) ||
        (rc = kv_float(g, path, k[6], 0, 10000.0, &hp->rope_theta)))
        return rc;
    if ((rc = kv_int(g, path, k[7], 0, hp->n_head, &hp->n_kv_head))) return rc;
    if (hp->n_head <= 0)
        return bt_fail(BT_ERR_FORMAT, "model: %s: %s is 0", path, k[2]);
    char kl[64], vl[64], rd[64];
    snprintf(kl, sizeof kl, "%s.attention.key_length", a);
    snprintf(vl, sizeof vl, "%s.attention.value_length", a);
    snprintf(rd, sizeof rd, "%s.rope.dimension_count", a);
    if ((rc = kv_int(g, path, kl, 0, hp->d_model / hp->n_head, &hp->head_dim)) ||
        (rc = kv_int(g, path, vl, 0, hp->head_dim, &v_len)))
        return rc;
    if (v_len != hp->head_dim)
        return bt_fail(BT_ERR_UNSUPPORTED, "model: %s: %s %d != %s %d is not supported", path, vl,
                       v_len, kl, hp->head_dim);
    if ((rc = kv_int(g, path, rd, 0, hp->head_dim, &rope_dim))) return rc;
    if (rope_dim != hp->head_dim)
        return bt_fail(BT_ERR_UNSUPPORTED,
                       "model: %s: %s %d != head_dim %d (partial RoPE is not supported)", path, rd,
                       rope_dim, hp->head_dim);
    return 0;
}

/* Stage: Gemma 3's own keys and fixed choices, as llama.cpp b4965 llama-model.cpp load_hparams
 * (LLM_ARCH_GEMMA3) and its gemma3 graph read them: gemma3.attention.sliding_window (required; the
 * window of the local layers), every 6th layer global (set_swa_pattern(6) / n_swa_pattern 6: not in
 * the file), local RoPE base 10000 with no scaling (rope_freq_base_train_swa), the softmax scale
 * 1/sqrt(key_length) (1/sqrt(embedding_length / head_count) for the 62-layer 27B, as llama.cpp's
 * f_attention_scale), embeddings times sqrt(embedding_length), QK-norm, the post-attention /
 * post-FFN norms and GeGLU with the tanh GELU; gemma3.rope.scaling.type "linear" (Gemma 3 4B+)
 * scales the global layers only. Norm weights are read as stored: convert_hf_to_gguf.py Gemma3Model
 * writes HF's w + 1 (transformers' GGUF loader, Gemma2TensorProcessor, subtracts 1 back), which is
 * what the trainer multiplies by. Reads g; writes hp. Errors: BT_ERR_NOTFOUND (no sliding_window),
 * BT_ERR_FORMAT (bad value), BT_ERR_UNSUPPORTED (another RoPE scaling). */
static int gemma3_hparams(const bt_gguf *g, const char *path, bt_llama_hparams *hp) {
    int rc;
    if ((rc = kv_int(g, path, "gemma3.attention.sliding_window", 1, 0, &hp->sliding_window)))
        return rc;
    if (hp->sliding_window < 1)
        return bt_fail(BT_ERR_FORMAT, "model: %s: gemma3.attention.sliding_window must be >= 1",
                       path);
    hp->swa_pattern = 6;
    hp->rope_local_theta = 10000.f;
    hp->sandwich_norm = 1;
    hp->act = BT_ACT_GELU_TANH;
    hp->embed_scale = sqrtf((float)hp->d_model);
    hp->attn_scalar = hp->n_layer == 62 ? (float)(hp->d_model / hp->n_head) : (float)hp->head_dim;
    bt_str v = {"", 0};
    if (bt_gguf_find_key(g, "gemma3.rope.scaling.type") < 0) return 0;
    if (bt_gguf_get_str(g, "gemma3.rope.scaling.type", &v) != 0)
        return bt_fail(BT_ERR_FORMAT, "model: %s: gemma3.rope.scaling.type is not a string", path);
    if (v.len == 4 && !memcmp(v.ptr, "none", 4)) return 0;
    if (!(v.len == 6 && !memcmp(v.ptr, "linear", 6)))
        return bt_fail(BT_ERR_UNSUPPORTED, "model: %s: gemma3.rope.scaling.type \"%.*s\" is not "
                       "supported (none, linear)", path, (int)(v.len > 32 ? 32 : v.len), v.ptr);
    float f = 0.f;
    if ((rc = kv_float(g, path, "gemma3.rope.scaling.factor", 1, 0, &f))) return rc;
    if (!(f > 0.f) || !isfinite(f))
        return bt_fail(BT_ERR_FORMAT, "model: %s: gemma3.rope.scaling.factor %g must be > 0", path,
                       (double)f);
    if (f != 1.f) {
        hp->rope_ext = BT_ROPE_EXT_LINEAR;
        hp->rope_ext_factor = f;
    }
    return 0;
}

/* Stage: every hyper-parameter: the shape keys, llama.rope.scaling.* (bt_model_gguf_rope_scaling),
 * rope_type BT_ROPE_FREQS when a rope_freqs.weight tensor exists, vocab = token_embd.weight
 * ne[1]; then bt_model_check_hparams. Reads g; writes hp. Errors: those of the stages named, in
 * that order; BT_ERR_NOTFOUND (no token_embd.weight); BT_ERR_INVALID (implausible values). */
static int gguf_hparams(const bt_gguf *g, const char *path, bt_llama_hparams *hp) {
    int rc;
    if ((rc = gguf_shape_keys(g, path, hp))) return rc;
    if (hp->arch == BT_ARCH_LLAMA && (rc = bt_model_gguf_rope_scaling(g, path, hp))) return rc;
    if (hp->arch == BT_ARCH_GEMMA3 && (rc = gemma3_hparams(g, path, hp))) return rc;
    if (hp->arch != BT_ARCH_LLAMA && hp->arch != BT_ARCH_GEMMA3) {
        /* <arch>.rope.scaling.* : only "none" / absent here */
        char st[64];
        snprintf(st, sizeof st, "%s.rope.scaling.type", bt_arch_name(hp->arch));
        bt_str v = {"", 0};
        if (bt_gguf_find_key(g, st) >= 0 &&
            (bt_gguf_get_str(g, st, &v) != 0 || v.len != 4 || memcmp(v.ptr, "none", 4) != 0))
            return bt_fail(BT_ERR_UNSUPPORTED, "model: %s: %s \"%.*s\": RoPE scaling is supported "
                           "for \"llama\" GGUFs only", path, st, (int)(v.len > 32 ? 32 : v.len),
                           v.ptr);
    }
    /* Phi-3 long-context files (convert_hf_to_gguf.py Phi3MiniModel.generate_extra_tensors for
     * rope_scaling type "longrope" / "su") carry the two factor tables llama.cpp switches between
     * by context length: not implemented here */
    if (hp->arch == BT_ARCH_PHI3) { /* Phi3MiniModel writes phi3.attention.sliding_window */
        int64_t sw = 0;
        if (bt_gguf_get_i64(g, "phi3.attention.sliding_window", &sw) == 0 && sw > 0) {
            if (sw > (1 << 30))
                return bt_fail(BT_ERR_FORMAT, "model: %s: phi3.attention.sliding_window %lld is "
                               "out of range", path, (long long)sw);
            hp->sliding_window = (int)sw;
            bt_log(BT_LOG_INFO, "model", "%s: phi3.attention.sliding_window %lld (Phi-3)", path,
                   (long long)sw);
        }
    }
    if (bt_gguf_find_tensor(g, "rope_factors_long.weight") ||
        bt_gguf_find_tensor(g, "rope_factors_short.weight"))
        return bt_fail(BT_ERR_UNSUPPORTED, "model: %s: rope_factors_long / rope_factors_short "
                       "tensors (Phi-3 \"longrope\" / \"su\" RoPE scaling, switched by context "
                       "length) are not supported; use a model without rope_scaling (e.g. "
                       "Phi-3-mini-4k)", path);
    if (bt_gguf_find_tensor(g, "rope_freqs.weight")) hp->rope_type = BT_ROPE_FREQS;
    const bt_gguf_tensor *emb = bt_gguf_find_tensor(g, "token_embd.weight");
    if (!emb) return bt_fail(BT_ERR_NOTFOUND, "model: %s: missing tensor token_embd.weight", path);
    hp->vocab = (int)(emb->ne[1] > 0x7fffffff ? 0 : emb->ne[1]);
    hp->qk_norm = hp->arch == BT_ARCH_QWEN3 || hp->arch == BT_ARCH_GEMMA3;
    /* Llama keeps head_dim = embedding_length / head_count; Qwen's key_length may differ (Phi-3:
     * llama.cpp LLM_ARCH_PHI3 uses NEOX RoPE, and Phi3MiniModel writes HF's q/k rows as-is) */
    return bt_model_check_hparams(hp, path, hp->arch != BT_ARCH_LLAMA);
}

/* Stage: the RoPE tables (bt_model_rope_init) from m->hp, with rope_freqs.weight [head_dim / 2]
 * (dequantised, finite) for BT_ROPE_FREQS. Reads g, m->hp; writes m->inv_freq / m->rope_freqs.
 * Errors: those of load_tensor; those of bt_model_rope_init (prefixed with the file and tensor
 * for a rope_freqs table). */
static int gguf_rope_setup(bt_model *m, const bt_gguf *g, const char *path) {
    if (m->hp.rope_type != BT_ROPE_FREQS) return bt_model_rope_init(m, NULL);
    float *ff = NULL;
    int rc = load_tensor(g, path, "rope_freqs.weight", 0, m->hp.head_dim / 2, &ff);
    if (rc) return rc;
    rc = bt_model_rope_init(m, ff);
    free(ff);
    if (rc) return bt_fail(rc, "model: %s: rope_freqs.weight: %s", path, bt_last_error_in("model"));
    return 0;
}

/* Stage: the tensors outside the blocks: token_embd [vocab, d_model], output_norm [d_model],
 * output [vocab, d_model] (absent: lm_head aliases tok_embd, m->tied = 1). Reads g, m->hp;
 * writes m->tok_embd, m->output_norm, m->lm_head, m->tied (owned by m). Errors: those of
 * load_tensor. */
static int gguf_globals(bt_model *m, const bt_gguf *g, const char *path) {
    const bt_llama_hparams *hp = &m->hp;
    int rc;
    if ((rc = load_tensor(g, path, "token_embd.weight", hp->vocab, hp->d_model, &m->tok_embd)) ||
        (rc = load_tensor(g, path, "output_norm.weight", 0, hp->d_model, &m->output_norm)))
        return rc;
    if (bt_gguf_find_tensor(g, "output.weight")) {
        if ((rc = load_tensor(g, path, "output.weight", hp->vocab, hp->d_model, &m->lm_head)))
            return rc;
        m->tied = 0;
    } else {
        m->lm_head = m->tok_embd;
        m->tied = 1;
    }
    return 0;
}

/* Stage: one block linear (module j, tensor `name`) into *l in opts->base_dtype: BT_BASE_GGUF
 * keeps the file's blocks (load_linear_gguf), fp32 / NF4 dequantise then bt_model_lin_set; q/k
 * rows un-permuted to HF order unless opts->keep_gguf_qk_order. Reads g; writes *l (owned by
 * the model). Errors: those of load_linear_gguf, load_tensor, unpermute_rows, bt_model_lin_set. */
static int gguf_linear(const bt_gguf *g, const char *path, const char *name,
                       const bt_llama_hparams *hp, int j, const bt_model_load_opts *opts,
                       const bt_model_shard *sh, int total, int r0, bt_base_linear *l) {
    int rows, cols, rc;
    bt_model_lin_shape(hp, j, &rows, &cols);
    /* only LlamaModel.permute()s q/k; Qwen2Model / Qwen3Model write HF's rows (NEOX RoPE) */
    const int qk = hp->arch == BT_ARCH_LLAMA && !opts->keep_gguf_qk_order &&
                   (j == BT_MOD_Q || j == BT_MOD_K);
    const int nh = !qk ? 0 : j == BT_MOD_Q ? hp->n_head : hp->n_kv_head;
    if (opts->base_dtype == BT_BASE_GGUF)
        return load_linear_gguf(g, path, name, rows, cols, nh, hp->head_dim, total, r0, sh, l);
    if (opts->base_dtype == BT_BASE_NF4 && sh && sh->world > 1) { /* only this rank's NF4 groups */
        const bt_gguf_tensor *t;
        if ((rc = find_tensor_checked(g, path, name, total ? total : rows, cols, &t))) return rc;
        return bt_model_nf4_cut(l, t, rows, cols, nh, hp->head_dim, r0, sh, path, name);
    }
    float *w;
    if ((rc = load_tensor(g, path, name, total ? total : rows, cols, &w))) return rc;
    if (total) { /* a fused tensor: keep rows [r0, r0 + rows) */
        float *part = bt_aligned_alloc((size_t)rows * cols * sizeof(float));
        if (part) memcpy(part, w + (size_t)r0 * cols, (size_t)rows * cols * sizeof(float));
        free(w);
        if (!part) return bt_fail(BT_ERR_NOMEM, "model: %s: out of memory for %s", path, name);
        w = part;
    }
    if (qk && (rc = unpermute_rows(w, nh, hp->head_dim, cols))) {
        free(w);
        return rc;
    }
    return bt_model_lin_set(l, w, rows, cols, opts->base_dtype, name);
}

/* Stage: blk.l.<module>.bias [rows] into l->bias when the file has it: required for q/k/v of
 * "qwen2" (llama.cpp llama-model.cpp LLM_ARCH_QWEN2 creates bq / bk / bv without
 * TENSOR_NOT_REQUIRED), optional otherwise (LLM_ARCH_LLAMA's are TENSOR_NOT_REQUIRED; a llama
 * q / k bias is un-permuted like its weight rows). Errors: BT_ERR_NOTFOUND (a qwen2 q/k/v bias
 * missing), those of load_tensor / unpermute_rows. */
static int gguf_bias(const bt_gguf *g, const char *path, const bt_llama_hparams *hp, int l, int j,
                     const bt_model_load_opts *opts, bt_base_linear *lin) {
    char name[96];
    snprintf(name, sizeof name, "blk.%d.%s.bias", l, k_gguf_lin[j]);
    const int need = hp->arch == BT_ARCH_QWEN2 && j <= BT_MOD_V;
    if (!need && !bt_gguf_find_tensor(g, name)) return 0;
    int rc = load_tensor(g, path, name, 0, lin->rows, &lin->bias);
    if (rc) return rc;
    if (hp->arch == BT_ARCH_LLAMA && !opts->keep_gguf_qk_order && (j == BT_MOD_Q || j == BT_MOD_K))
        rc = unpermute_rows(lin->bias, j == BT_MOD_Q ? hp->n_head : hp->n_kv_head, hp->head_dim, 1);
    return rc;
}

/* Stage: block l's tensors blk.l.{attn_norm, ffn_norm} [d_model], its seven linears (BT_MOD_*
 * order, k_gguf_lin names) with their biases (gguf_bias), and for Qwen3 attn_q_norm /
 * attn_k_norm [head_dim]. Reads g, m->hp; writes m->layers[l] (owned by m). Errors: those of
 * load_tensor and gguf_linear, the first in that order. */
static int gguf_layer(bt_model *m, const bt_gguf *g, const char *path, int l,
                      const bt_model_load_opts *opts, const bt_model_shard *sh) {
    const bt_llama_hparams *hp = &m->hp;
    bt_layer *L = &m->layers[l];
    char name[96];
    int rc;
    snprintf(name, sizeof name, "blk.%d.attn_norm.weight", l);
    if ((rc = load_tensor(g, path, name, 0, hp->d_model, &L->attn_norm))) return rc;
    snprintf(name, sizeof name, "blk.%d.ffn_norm.weight", l);
    if ((rc = load_tensor(g, path, name, 0, hp->d_model, &L->ffn_norm))) return rc;
    /* phi3 (llama.cpp llama-model.cpp LLM_ARCH_PHI3; gguf-py 0.19.0 tensor_mapping.py maps HF
     * self_attn.qkv_proj to MODEL_TENSOR.ATTN_QKV "blk.N.attn_qkv" and mlp.gate_up_proj to
     * MODEL_TENSOR.FFN_UP "blk.N.ffn_up"): attn_qkv [Dq + 2 Dkv, D] holds q, k, v rows in that
     * order (optional: llama.cpp falls back to attn_q / attn_k / attn_v), ffn_up [2 F, D] holds
     * gate rows then up rows (Phi3MLP: gate, up = gate_up.chunk(2); llama.cpp LLM_FFN_SWIGLU
     * with no gate tensor splits the same way); no ffn_gate tensor */
    const int phi3 = hp->arch == BT_ARCH_PHI3;
    char qkv[96];
    snprintf(qkv, sizeof qkv, "blk.%d.attn_qkv.weight", l);
    const int fused_qkv = phi3 && bt_gguf_find_tensor(g, qkv) != NULL;
    const int Dq = hp->n_head * hp->head_dim, Dkv = hp->n_kv_head * hp->head_dim;
    for (int j = 0; j < BT_MOD_N; j++) {
        int total = 0, r0 = 0;
        snprintf(name, sizeof name, "blk.%d.%s.weight", l, k_gguf_lin[j]);
        if (fused_qkv && j <= BT_MOD_V) {
            snprintf(name, sizeof name, "%s", qkv);
            total = Dq + 2 * Dkv;
            r0 = j == BT_MOD_Q ? 0 : j == BT_MOD_K ? Dq : Dq + Dkv;
        } else if (phi3 && (j == BT_MOD_GATE || j == BT_MOD_UP)) {
            snprintf(name, sizeof name, "blk.%d.ffn_up.weight", l);
            total = 2 * hp->d_ff;
            r0 = j == BT_MOD_GATE ? 0 : hp->d_ff;
        }
        if ((rc = gguf_linear(g, path, name, hp, j, opts, sh, total, r0, &L->lin[j]))) return rc;
        if (!total && (rc = gguf_bias(g, path, hp, l, j, opts, &L->lin[j]))) return rc;
    }
    if (phi3) { /* LLM_ARCH_PHI3 has no biases: refuse any rather than drop it */
        static const char *const fb[3] = {"attn_qkv", "ffn_up", "ffn_gate"};
        for (int i = 0; i < 3; i++) {
            snprintf(name, sizeof name, "blk.%d.%s.bias", l, fb[i]);
            if (bt_gguf_find_tensor(g, name))
                return bt_fail(BT_ERR_UNSUPPORTED, "model: %s: tensor %s: a phi3 bias is not "
                               "supported (llama.cpp's phi3 has none)", path, name);
        }
    }
    if (hp->sandwich_norm) { /* Gemma 3: post_attention_layernorm, post_feedforward_layernorm */
        snprintf(name, sizeof name, "blk.%d.post_attention_norm.weight", l);
        if ((rc = load_tensor(g, path, name, 0, hp->d_model, &L->post_attn_norm))) return rc;
        snprintf(name, sizeof name, "blk.%d.post_ffw_norm.weight", l);
        if ((rc = load_tensor(g, path, name, 0, hp->d_model, &L->post_ffn_norm))) return rc;
    }
    if (hp->qk_norm) { /* Qwen3 / Gemma 3: blk.N.attn_{q,k}_norm.weight [head_dim] */
        snprintf(name, sizeof name, "blk.%d.attn_q_norm.weight", l);
        if ((rc = load_tensor(g, path, name, 0, hp->head_dim, &L->q_norm))) return rc;
        snprintf(name, sizeof name, "blk.%d.attn_k_norm.weight", l);
        if ((rc = load_tensor(g, path, name, 0, hp->head_dim, &L->k_norm))) return rc;
    }
    return 0;
}

int bt_model_layer_of(const char *name, const char *prefix) {
    size_t n = strlen(prefix);
    if (strncmp(name, prefix, n) != 0) return -1;
    const char *p = name + n;
    long v = 0;
    int digits = 0;
    while (*p >= '0' && *p <= '9' && digits < 9) v = v * 10 + (*p++ - '0'), digits++;
    return digits && *p == '.' ? (int)v : -1;
}

/* Stage: m->layers [n_layer] allocated, then every block in order (gguf_layer). Refuses a file
 * holding blocks past llama.block_count (bt_model_layer_of). Writes m->layers (owned by m; a
 * partly filled array is freed by bt_model_free). Errors: BT_ERR_FORMAT, BT_ERR_NOMEM, those of
 * gguf_layer. */
static int gguf_layers(bt_model *m, const bt_gguf *g, const char *path,
                       const bt_model_load_opts *opts, const bt_model_shard *sh) {
    int top = -1;
    for (int64_t i = 0; i < bt_gguf_n_tensors(g); i++) {
        const bt_gguf_tensor *t = bt_gguf_tensor_at(g, i);
        char nm[96];
        snprintf(nm, sizeof nm, "%.*s", (int)(t->name.len < 95 ? t->name.len : 95), t->name.ptr);
        int l = bt_model_layer_of(nm, "blk.");
        if (l > top) top = l;
    }
    if (top >= m->hp.n_layer)
        return bt_fail(BT_ERR_FORMAT, "model: %s: %s.block_count is %d, but the file holds the tensors of %d "
                       "blocks (up to blk.%d.*): refusing to load part of the model (the header or the file is "
                       "wrong)", path, bt_arch_name(m->hp.arch), m->hp.n_layer, top + 1, top);
    m->layers = calloc((size_t)m->hp.n_layer, sizeof(bt_layer));
    if (!m->layers) return bt_fail(BT_ERR_NOMEM, "model: out of memory");
    int rc = 0;
    for (int l = 0; l < m->hp.n_layer && !rc; l++) rc = gguf_layer(m, g, path, l, opts, sh);
    return rc;
}

int bt_model_load_gguf(bt_model *m, const char *path, const bt_model_load_opts *opts_in) {
    return bt_model_load_gguf_shard(m, path, opts_in, NULL);
}

int bt_model_load_gguf_shard(bt_model *m, const char *path, const bt_model_load_opts *opts_in,
                             const bt_model_shard *sh) {
    memset(m, 0, sizeof *m);
    bt_model_load_opts opts = {BT_BASE_AUTO, 0};
    if (opts_in) opts = *opts_in;
    if (opts.base_dtype == BT_BASE_AUTO) opts.base_dtype = BT_BASE_GGUF;
    if (sh && (sh->world < 1 || sh->rank < 0 || sh->rank >= sh->world))
        return bt_fail(BT_ERR_INVALID, "model: %s: shard rank %d of %d ranks: the rank must be in "
                       "[0, ranks)", path, sh->rank, sh->world);
    if (sh && sh->world > 1 && opts.base_dtype != BT_BASE_GGUF && opts.base_dtype != BT_BASE_NF4)
        return bt_fail(BT_ERR_UNSUPPORTED, "model: %s: loading only this rank's shard of the base "
                       "(dist.shard_base) needs base_dtype gguf (the file's own blocks) or nf4 (this "
                       "rank's groups quantised); an fp32 base is loaded whole, then cut", path);
    bt_gguf *g = NULL;
    int rc = bt_gguf_open(&g, path);
    if (rc) return bt_fail(rc, "model: %s", bt_last_error_in("model"));
    if ((rc = gguf_check_arch(g, path, &m->hp.arch)) || (rc = gguf_hparams(g, path, &m->hp)))
        goto fail;
    m->base_dtype = opts.base_dtype;
    if ((rc = gguf_rope_setup(m, g, path)) || (rc = gguf_globals(m, g, path)) ||
        (rc = gguf_layers(m, g, path, &opts, sh)))
        goto fail;
    if ((rc = bt_gguf_check(g, 0))) {
        rc = bt_fail(rc, "model: %s", bt_last_error_in("model"));
        goto fail;
    }
    bt_gguf_close(g);
    return 0;
fail:
    /* the file changed under the mapping: what was read is void, the error says so */
    if (bt_gguf_check(g, 0)) rc = bt_fail(BT_ERR_IO, "model: %s", bt_last_error_in("model"));
    bt_gguf_close(g);
    bt_model_free(m);
    return rc;
}

/* ---- random ---- */

static float *rand_buf(bt_rng *r, size_t n, float mean, float std) {
    float *w = bt_aligned_alloc(n * sizeof(float));
    if (!w) return NULL;
    for (size_t i = 0; i < n; i++) w[i] = mean + std * bt_rng_normal(r);
    return w;
}

int bt_model_init_random(bt_model *m, const bt_llama_hparams *hp_in, int base_dtype, int tied,
                         uint64_t seed) {
    memset(m, 0, sizeof *m);
    m->hp = *hp_in;
    bt_llama_hparams *hp = &m->hp;
    int rc = bt_model_check_hparams(hp, "random", 0);
    if (rc) return rc;
    if (hp->rope_type == BT_ROPE_FREQS)
        return bt_fail(BT_ERR_INVALID, "model: random init: RoPE type rope_freqs needs a GGUF");
    if (base_dtype != BT_BASE_NF4 && base_dtype != BT_BASE_FP32)
        return bt_fail(BT_ERR_INVALID, "model: random init: base_dtype %s (random weights are fp32 "
                       "or NF4; bt_model_to_ggml makes ggml blocks of an fp32 model)",
                       bt_base_dtype_name(base_dtype));
    if ((rc = bt_model_rope_init(m, NULL))) return rc;
    m->base_dtype = base_dtype;
    bt_rng r;
    bt_rng_seed(&r, seed);
    size_t VD = (size_t)hp->vocab * hp->d_model;
    m->tok_embd = rand_buf(&r, VD, 0.f, 1.f);
    m->output_norm = rand_buf(&r, (size_t)hp->d_model, 1.f, 0.1f);
    m->tied = tied;
    m->lm_head = tied ? m->tok_embd : rand_buf(&r, VD, 0.f, 1.f / sqrtf((float)hp->d_model));
    m->layers = calloc((size_t)hp->n_layer, sizeof(bt_layer));
    if (!m->tok_embd || !m->output_norm || !m->lm_head || !m->layers) goto oom;
    for (int l = 0; l < hp->n_layer; l++) {
        bt_layer *L = &m->layers[l];
        L->attn_norm = rand_buf(&r, (size_t)hp->d_model, 1.f, 0.1f);
        L->ffn_norm = rand_buf(&r, (size_t)hp->d_model, 1.f, 0.1f);
        if (!L->attn_norm || !L->ffn_norm) goto oom;
        for (int j = 0; j < BT_MOD_N; j++) {
            int rows, cols;
            bt_model_lin_shape(hp, j, &rows, &cols);
            float *w = rand_buf(&r, (size_t)rows * cols, 0.f, 1.f / sqrtf((float)cols));
            if (!w) goto oom;
            if ((rc = bt_model_lin_set(&L->lin[j], w, rows, cols, base_dtype, "random"))) {
                bt_model_free(m);
                return rc;
            }
        }
    }
    return 0;
oom:
    bt_model_free(m);
    return bt_fail(BT_ERR_NOMEM, "model: out of memory (random init)");
}

int bt_model_to_ggml(bt_model *m, int type) {
    if (!m || m->base_dtype != BT_BASE_FP32 || !m->layers)
        return bt_fail(BT_ERR_INVALID, "model: bt_model_to_ggml needs an fp32 base");
    const int64_t blck = bt_ggml_block_elems(type);
    if (!bt_ggml_can_dequantize(type))
        return bt_fail(BT_ERR_UNSUPPORTED, "model: ggml type %s has no decoder",
                       bt_ggml_type_name(type));
    for (int i = 0; i < m->hp.n_layer; i++)
        for (int j = 0; j < BT_MOD_N; j++) {
            bt_base_linear *l = &m->layers[i].lin[j];
            if (blck < 1 || l->cols % blck != 0)
                return bt_fail(BT_ERR_INVALID, "model: layer %d %s: %d columns is not a multiple "
                               "of the %s block size %lld", i, bt_module_name(j), l->cols,
                               bt_ggml_type_name(type), (long long)blck);
        }
    m->base_dtype = BT_BASE_GGUF; /* scratch sizing and exports follow the converted linears */
    for (int i = 0; i < m->hp.n_layer; i++)
        for (int j = 0; j < BT_MOD_N; j++) {
            bt_base_linear *l = &m->layers[i].lin[j];
            if (l->is_nf4 || l->is_gguf || !l->w) continue;
            const size_t bytes = bt_ggml_row_size(type, l->cols) * (size_t)l->rows;
            uint8_t *blocks = malloc(bytes ? bytes : 1);
            if (!blocks) return bt_fail(BT_ERR_NOMEM, "model: out of memory (to ggml)");
            int rc = bt_ggml_quantize(type, l->w, blocks, (int64_t)l->rows * l->cols);
            if (!rc) rc = bt_ggml_mat_init(&l->g, type, l->rows, l->cols, blocks, NULL);
            free(blocks);
            if (rc) return rc;
            free(l->w);
            l->w = NULL;
            l->is_gguf = 1;
        }
    return 0;
}
