/* The merged Hugging Face directory of `trainer export --format safetensors`: weights (sharded as
 * transformers' save_pretrained shards them), config.json, generation_config.json and the
 * tokenizer files. See export.h (bt_export_safetensors_merged) for the layout and sources. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/atomic_io.h"
#include "common/bt_common.h"
#include "common/quant.h"
#include "common/safetensors.h"
#include "common/tokenizer.h"
#include "kernels/kernels.h"
#include "trainer/config.h"
#include "trainer/io/export.h"
#include "trainer/io/outputs.h"
#include "trainer/io/export_internal.h"

/* Special token ids for config.json / generation_config.json (-1 = none). */
typedef struct {
    int32_t bos, eos, pad, im_end;
} hf_ids;

/* text + "\n" written to path atomically (common/atomic_io.h). */
static int write_file(const char *path, const char *text) {
    bt_atomic_file af;
    int rc = bt_atomic_open(&af, path, "export");
    if (!rc && !(rc = bt_atomic_write(&af, text, strlen(text))) && !(rc = bt_atomic_write(&af, "\n", 1)))
        rc = bt_atomic_commit(&af);
    else bt_atomic_abort(&af);
    return rc;
}

/* Pretty JSON text of j (stolen) written to path. */
static int write_json(const char *path, json_t *j) {
    char *s = j ? json_dumps(j, JSON_INDENT(2) | JSON_REAL_PRECISION(10)) : NULL;
    json_decref(j);
    if (!s) return bt_fail(BT_ERR_NOMEM, "export: out of memory");
    int rc = write_file(path, s);
    free(s);
    return rc;
}

/* text written to dir/name. */
static int write_text(const char *dir, const char *name, const char *text) {
    char *path = NULL;
    if (asprintf(&path, "%s/%s", dir, name) < 0) return bt_fail(BT_ERR_NOMEM, "export: out of memory");
    int rc = write_file(path, text);
    free(path);
    return rc;
}

static int add_st(bt_st_writer *w, const char *name, const float *x, int64_t rows, int64_t cols,
                  int dtype) {
    int64_t shape[2] = {rows ? rows : cols, cols};
    int nd = rows ? 2 : 1;
    size_t n = (size_t)(rows ? rows : 1) * (size_t)cols;
    bt_st_dtype t = dtype == BT_EXPORT_F32 ? BT_ST_F32 : dtype == BT_EXPORT_F16 ? BT_ST_F16 : BT_ST_BF16;
    int rc;
    if (t == BT_ST_F32) rc = bt_st_w_tensor(w, name, t, nd, shape, x, n * 4);
    else {
        uint16_t *h = malloc(n * 2 + 1);
        if (!h) return bt_fail(BT_ERR_NOMEM, "export: out of memory");
        for (size_t i = 0; i < n; i++) h[i] = t == BT_ST_F16 ? bt_fp32_to_fp16(x[i]) : bt_fp32_to_bf16(x[i]);
        rc = bt_st_w_tensor(w, name, t, nd, shape, h, n * 2);
        free(h);
    }
    if (rc) return bt_fail(rc, "export: tensor %s: %s", name, bt_last_error_in("export"));
    return 0;
}

/* Shortest decimal that reads back as the same float (1e-05, not 9.99999975e-06). */
static json_t *json_float(float f) {
    char buf[48];
    for (int p = 1; p <= 9; p++) {
        snprintf(buf, sizeof buf, "%.*g", p, (double)f);
        if ((float)strtod(buf, NULL) == f) break;
    }
    return json_real(strtod(buf, NULL));
}

int bt_export_hf_rope(const bt_model *m, json_t **out, int *max_pos) {
    const bt_llama_hparams *hp = &m->hp;
    const int half = hp->head_dim / 2;
    json_t *rs = json_object();
    *out = NULL;
    *max_pos = hp->ctx;
    const int own_default = hp->rope_type == BT_ROPE_DEFAULT;
    if (own_default && hp->rope_ext == BT_ROPE_EXT_NONE) {
        json_decref(rs);
        *out = json_null();
        return 0;
    }
    if (own_default) { /* linear / yarn / dynamic exactly as transformers defines them */
        json_object_set_new(rs, "factor", json_float(hp->rope_ext_factor));
        if (hp->rope_ext == BT_ROPE_EXT_YARN) {
            /* max_position_embeddings = original_max_position_embeddings = the pre-YaRN context:
             * transformers 4.4x computes YaRN's correction range from max_position_embeddings,
             * 5.x from rope_scaling.original_max_position_embeddings; both then agree */
            json_object_set_new(rs, "original_max_position_embeddings",
                                json_integer(bt_export_orig_ctx(hp)));
            if (hp->rope_attn_factor > 0.f)
                json_object_set_new(rs, "attention_factor", json_float(hp->rope_attn_factor));
            if (hp->rope_yarn_beta_fast > 0.f)
                json_object_set_new(rs, "beta_fast", json_float(hp->rope_yarn_beta_fast));
            if (hp->rope_yarn_beta_slow > 0.f)
                json_object_set_new(rs, "beta_slow", json_float(hp->rope_yarn_beta_slow));
            *max_pos = bt_export_orig_ctx(hp);
        } else if (hp->rope_ext == BT_ROPE_EXT_DYNAMIC) {
            /* dynamic NTK scales relative to max_position_embeddings */
            *max_pos = bt_export_orig_ctx(hp);
        }
        json_object_set_new(rs, "rope_type", json_string(bt_rope_ext_name(hp->rope_ext)));
        if (hp->rope_ext == BT_ROPE_EXT_LINEAR) /* older readers look for "type" */
            json_object_set_new(rs, "type", json_string("linear"));
        *out = rs;
        return 0;
    }
    if (hp->rope_ext == BT_ROPE_EXT_NONE && !(hp->rope_attn_factor > 0.f)) {
        float f = hp->rope_factor, lo = hp->rope_low_freq_factor, hi = hp->rope_high_freq_factor;
        int ctx = hp->rope_orig_ctx;
        if (hp->rope_type == BT_ROPE_LLAMA3 || bt_export_llama3_from_freqs(m, &f, &lo, &hi, &ctx) == 0) {
            json_object_set_new(rs, "factor", json_float(f));
            json_object_set_new(rs, "high_freq_factor", json_float(hi));
            json_object_set_new(rs, "low_freq_factor", json_float(lo));
            json_object_set_new(rs, "original_max_position_embeddings", json_integer(ctx));
            json_object_set_new(rs, "rope_type", json_string("llama3"));
            *out = rs;
            return 0;
        }
    }
    if (hp->rope_ext == BT_ROPE_EXT_DYNAMIC) {
        json_decref(rs);
        return bt_fail(BT_ERR_UNSUPPORTED, "export: safetensors: dynamic NTK scaling on top of a "
                       "%s frequency table cannot be written as one transformers rope_scaling; "
                       "use context_extension.method \"linear\" or \"yarn\", or export gguf",
                       hp->rope_type == BT_ROPE_LLAMA3 ? "llama3" : "rope_freqs");
    }
    /* any other fixed table (llama3 / rope_freqs composed with linear or YaRN, or a table that is
     * not Llama 3.x): transformers' "longrope" with equal short and long factors gives exactly
     * inv_freq = 1 / (factor_i theta^(2i/D)) at every length, with an explicit attention factor */
    float dflt[512];
    if (half > 512 || !m->inv_freq ||
        bt_rope_inv_freq(dflt, hp->head_dim, hp->rope_theta, "default", 0.f, 0.f, 0.f, 0) != 0) {
        json_decref(rs);
        return bt_fail(BT_ERR_INVALID, "export: no RoPE table to write");
    }
    json_t *lf = json_array(), *sf = json_array();
    for (int i = 0; i < half; i++) {
        const double fi = (double)dflt[i] / (double)m->inv_freq[i];
        json_array_append_new(lf, json_real(fi));
        json_array_append_new(sf, json_real(fi));
    }
    const int orig = hp->rope_ext != BT_ROPE_EXT_NONE ? bt_export_orig_ctx(hp) : hp->ctx;
    json_object_set_new(rs, "attention_factor", json_float(bt_model_attn_factor(hp)));
    json_object_set_new(rs, "factor", json_float((float)((double)hp->ctx / orig)));
    json_object_set_new(rs, "long_factor", lf);
    json_object_set_new(rs, "original_max_position_embeddings", json_integer(orig));
    json_object_set_new(rs, "rope_type", json_string("longrope"));
    json_object_set_new(rs, "short_factor", sf);
    *out = rs;
    return 0;
}

/* 1 if every layer's linear `mod` has a bias, 0 if none has, -1 if mixed. */
static int bias_state(const bt_model *m, int mod) {
    int n = 0;
    for (int l = 0; l < m->hp.n_layer; l++) n += m->layers[l].lin[mod].bias != NULL;
    return n == 0 ? 0 : n == m->hp.n_layer ? 1 : -1;
}

/* config.json of a transformers 5.23 Gemma3ForCausalLM (model_type "gemma3_text", keys as its
 * save_pretrained writes them, e.g. tests/fixtures/hf/gemma3/hf/config.json): layer_types from
 * bt_model_layer_window, rope_parameters {full_attention: {rope_theta, rope_type "default" |
 * "linear" + factor}, sliding_attention: {rope_theta = the local base, "default"}},
 * query_pre_attn_scalar, sliding_window, hidden_activation gelu_pytorch_tanh, no softcapping.
 * RoPE scaling other than linear, or a frequency table, has no Gemma 3 config key:
 * BT_ERR_UNSUPPORTED. */
static int write_gemma3_config(const bt_model *m, const hf_ids *ids, int dtype, const char *path) {
    const bt_llama_hparams *hp = &m->hp;
    for (int mod = 0; mod < BT_MOD_N; mod++)
        if (bias_state(m, mod) != 0)
            return bt_fail(BT_ERR_UNSUPPORTED, "export: safetensors: Gemma 3 has no linear biases");
    if ((hp->rope_ext != BT_ROPE_EXT_NONE && hp->rope_ext != BT_ROPE_EXT_LINEAR) ||
        hp->rope_type != BT_ROPE_DEFAULT)
        return bt_fail(BT_ERR_UNSUPPORTED, "export: safetensors: Gemma 3's config knows linear "
                       "RoPE scaling only (rope_parameters.full_attention); this model has %s",
                       hp->rope_type != BT_ROPE_DEFAULT ? "a RoPE frequency table"
                                                        : bt_rope_ext_name(hp->rope_ext));
    const float qs = hp->attn_scalar > 0.f ? hp->attn_scalar : (float)hp->head_dim;
    if (qs != floorf(qs) || qs > 1e9f) /* Gemma3TextConfig.query_pre_attn_scalar: int */
        return bt_fail(BT_ERR_UNSUPPORTED, "export: safetensors: query_pre_attn_scalar %g is not "
                       "an integer, which Gemma3TextConfig requires", (double)qs);
    json_t *j = json_object(), *arch = json_array(), *lt = json_array();
    json_array_append_new(arch, json_string("Gemma3ForCausalLM"));
    for (int l = 0; l < hp->n_layer; l++)
        json_array_append_new(lt, json_string(bt_model_layer_window(hp, l) > 0 ? "sliding_attention"
                                                                                : "full_attention"));
    json_t *full = json_object(), *slid = json_object(), *rp = json_object();
    if (hp->rope_ext == BT_ROPE_EXT_LINEAR)
        json_object_set_new(full, "factor", json_float(hp->rope_ext_factor));
    json_object_set_new(full, "rope_theta", json_float(hp->rope_theta));
    json_object_set_new(full, "rope_type",
                        json_string(hp->rope_ext == BT_ROPE_EXT_LINEAR ? "linear" : "default"));
    json_object_set_new(slid, "rope_theta", json_float(hp->rope_local_theta > 0.f
                                                           ? hp->rope_local_theta
                                                           : hp->rope_theta));
    json_object_set_new(slid, "rope_type", json_string("default"));
    json_object_set_new(rp, "full_attention", full);
    json_object_set_new(rp, "sliding_attention", slid);
    json_object_set_new(j, "architectures", arch);
    json_object_set_new(j, "attention_bias", json_false());
    json_object_set_new(j, "attention_dropout", json_real(0.0));
    json_object_set_new(j, "attn_logit_softcapping", json_null());
    /* unknown ids are null: Gemma3TextConfig's defaults (bos 2, eos 1) are Gemma's vocabulary */
    json_object_set_new(j, "bos_token_id", ids->bos >= 0 ? json_integer(ids->bos) : json_null());
    json_object_set_new(j, "dtype", json_string(dtype == BT_EXPORT_F32   ? "float32"
                                                : dtype == BT_EXPORT_F16 ? "float16"
                                                                         : "bfloat16"));
    json_object_set_new(j, "eos_token_id", ids->eos >= 0 ? json_integer(ids->eos) : json_null());
    json_object_set_new(j, "final_logit_softcapping", json_null());
    json_object_set_new(j, "head_dim", json_integer(hp->head_dim));
    json_object_set_new(j, "hidden_activation", json_string("gelu_pytorch_tanh"));
    json_object_set_new(j, "hidden_size", json_integer(hp->d_model));
    json_object_set_new(j, "initializer_range", json_real(0.02));
    json_object_set_new(j, "intermediate_size", json_integer(hp->d_ff));
    json_object_set_new(j, "layer_types", lt);
    json_object_set_new(j, "max_position_embeddings", json_integer(hp->ctx));
    json_object_set_new(j, "model_type", json_string("gemma3_text"));
    json_object_set_new(j, "num_attention_heads", json_integer(hp->n_head));
    json_object_set_new(j, "num_hidden_layers", json_integer(hp->n_layer));
    json_object_set_new(j, "num_key_value_heads", json_integer(hp->n_kv_head));
    json_object_set_new(j, "pad_token_id", ids->pad >= 0 ? json_integer(ids->pad) : json_null());
    json_object_set_new(j, "query_pre_attn_scalar", json_integer((json_int_t)qs));
    json_object_set_new(j, "rms_norm_eps", json_float(hp->rms_eps));
    json_object_set_new(j, "rope_parameters", rp);
    json_object_set_new(j, "sliding_window", json_integer(hp->sliding_window));
    json_object_set_new(j, "tie_word_embeddings", json_boolean(m->tied));
    json_object_set_new(j, "use_bidirectional_attention", json_false());
    json_object_set_new(j, "use_cache", json_true());
    json_object_set_new(j, "vocab_size", json_integer(hp->vocab));
    return write_json(path, j);
}

/* config.json of a transformers LlamaForCausalLM (or Qwen2ForCausalLM when exactly q/k/v carry
 * biases, Qwen2's layout; Qwen3ForCausalLM for a QK-norm model, hp.qk_norm, with
 * attention_bias when q/k/v/o all carry biases) for the merged weights. */
static int write_hf_config(const bt_model *m, const hf_ids *ids, int dtype, const char *path) {
    const bt_llama_hparams *hp = &m->hp;
    if (hp->arch == BT_ARCH_GEMMA3) return write_gemma3_config(m, ids, dtype, path);
    int bq = bias_state(m, BT_MOD_Q), bk = bias_state(m, BT_MOD_K), bv = bias_state(m, BT_MOD_V),
        bo = bias_state(m, BT_MOD_O), bg = bias_state(m, BT_MOD_GATE),
        bu = bias_state(m, BT_MOD_UP), bd = bias_state(m, BT_MOD_DOWN);
    const int qwen3 = hp->qk_norm, phi3 = hp->arch == BT_ARCH_PHI3;
    int qwen2 = !qwen3 && !phi3 && bq == 1 && bk == 1 && bv == 1 && bo == 0 && bg == 0 && bu == 0 && bd == 0;
    int attn_bias = bq == 1 && bk == 1 && bv == 1 && bo == 1, mlp_bias = bg == 1 && bu == 1 && bd == 1;
    if (!qwen2 && (bq + bk + bv + bo != 0 && !attn_bias)) attn_bias = -1;
    if (bg + bu + bd != 0 && !mlp_bias) mlp_bias = -1;
    if (attn_bias < 0 || mlp_bias < 0 || (qwen3 && mlp_bias))
        return bt_fail(BT_ERR_UNSUPPORTED, "export: safetensors: the base's linear biases match "
                       "neither Llama (attention_bias / mlp_bias), Qwen2 (q/k/v) nor Qwen3 "
                       "(attention_bias)");
    if (phi3 && (bq || bk || bv || bo || bg || bu || bd))
        return bt_fail(BT_ERR_UNSUPPORTED, "export: safetensors: Phi-3 has no linear biases");
    /* a Llama-family base with a window is Mistral's (MistralForCausalLM, no biases): keep it */
    const int mistral = hp->arch == BT_ARCH_LLAMA && hp->sliding_window > 0 && !attn_bias && !mlp_bias;
    const char *archs = phi3      ? "Phi3ForCausalLM"
                        : qwen3   ? "Qwen3ForCausalLM"
                        : qwen2   ? "Qwen2ForCausalLM"
                        : mistral ? "MistralForCausalLM"
                                  : "LlamaForCausalLM";
    const char *mtype = phi3 ? "phi3" : qwen3 ? "qwen3" : qwen2 ? "qwen2" : mistral ? "mistral" : "llama";
    json_t *j = json_object();
    json_t *arch = json_array();
    json_array_append_new(arch, json_string(archs));
    json_object_set_new(j, "architectures", arch);
    if (!qwen2 && !phi3) json_object_set_new(j, "attention_bias", json_boolean(attn_bias));
    json_object_set_new(j, "attention_dropout", json_real(0.0));
    /* Phi3Config defaults bos 1 / eos 32000 / pad 32000 (Phi-3-mini's vocabulary): unknown ids
     * are written as null so a smaller vocabulary is not given out-of-range ones */
    if (ids->bos >= 0 || phi3)
        json_object_set_new(j, "bos_token_id", ids->bos >= 0 ? json_integer(ids->bos) : json_null());
    if (ids->eos >= 0 || phi3)
        json_object_set_new(j, "eos_token_id", ids->eos >= 0 ? json_integer(ids->eos) : json_null());
    json_object_set_new(j, "head_dim", json_integer(hp->head_dim));
    json_object_set_new(j, "hidden_act", json_string("silu"));
    json_object_set_new(j, "hidden_size", json_integer(hp->d_model));
    json_object_set_new(j, "initializer_range", json_real(0.02));
    json_object_set_new(j, "intermediate_size", json_integer(hp->d_ff));
    if (!qwen2 && !qwen3 && !phi3) json_object_set_new(j, "mlp_bias", json_boolean(mlp_bias));
    json_object_set_new(j, "model_type", json_string(mtype));
    json_object_set_new(j, "num_attention_heads", json_integer(hp->n_head));
    json_object_set_new(j, "num_hidden_layers", json_integer(hp->n_layer));
    json_object_set_new(j, "num_key_value_heads", json_integer(hp->n_kv_head));
    if (ids->pad >= 0 || phi3)
        json_object_set_new(j, "pad_token_id", ids->pad >= 0 ? json_integer(ids->pad) : json_null());
    if (!phi3) json_object_set_new(j, "pretraining_tp", json_integer(1));
    json_object_set_new(j, "rms_norm_eps", json_float(hp->rms_eps));
    json_t *rs = NULL;
    int max_pos = hp->ctx, rc;
    if ((rc = bt_export_hf_rope(m, &rs, &max_pos))) {
        json_decref(j);
        return rc;
    }
    json_object_set_new(j, "max_position_embeddings", json_integer(max_pos));
    if (phi3) /* Phi3Config (transformers 5.23): no rope scaling here, so the original context
               * is the context */
        json_object_set_new(j, "original_max_position_embeddings", json_integer(max_pos));
    if (phi3 || mistral) { /* the window as the base had it (null: none) */
        json_object_set_new(j, "sliding_window", hp->sliding_window > 0
                                                     ? json_integer(hp->sliding_window)
                                                     : json_null());
    }
    json_object_set_new(j, "rope_scaling", rs);
    json_object_set_new(j, "rope_theta", json_float(hp->rope_theta));
    json_object_set_new(j, "tie_word_embeddings", json_boolean(m->tied));
    json_object_set_new(j, "torch_dtype", json_string(dtype == BT_EXPORT_F32   ? "float32"
                                                      : dtype == BT_EXPORT_F16 ? "float16"
                                                                               : "bfloat16"));
    json_object_set_new(j, "use_cache", json_true());
    if (qwen2 || qwen3) json_object_set_new(j, "use_sliding_window", json_false());
    json_object_set_new(j, "vocab_size", json_integer(hp->vocab));
    return write_json(path, j);
}

/* ---- weights, sharded as transformers' save_pretrained does ---- */

enum { T_EMBED, T_WEIGHT, T_BIAS, T_NORM_IN, T_NORM_POST, T_NORM, T_LM_HEAD, T_QNORM, T_KNORM,
       T_FUSED, T_POST_ATTN, T_POST_FFN };

/* One tensor of the merged checkpoint: rows 0 = 1-D [cols]. minus1: written as x - 1 (a Gemma
 * norm: the model holds Gemma3RMSNorm's factor 1 + w, HF stores w). */
typedef struct {
    char name[96];
    int kind, layer, mod, shard, minus1;
    int64_t rows, cols;
    uint64_t nbytes;
} hf_tensor;

/* One dot-separated part of a tensor name as transformers' dot_natural_key sees it: digits only
 * -> (0, int); else the text without trailing digits, then those digits as an int if any. */
typedef struct {
    int cls, has_num;
    unsigned long long num;
    const char *text;
    size_t text_len;
} nat_part;

static const char *nat_next(const char *s, nat_part *p) {
    size_t len = strcspn(s, ".");
    size_t t = len;
    while (t > 0 && s[t - 1] >= '0' && s[t - 1] <= '9') t--;
    p->cls = len > 0 && t == 0 ? 0 : 1;
    p->has_num = t < len;
    p->num = 0;
    for (size_t i = t; i < len; i++) p->num = p->num * 10 + (unsigned long long)(s[i] - '0');
    p->text = s, p->text_len = t;
    return s[len] == '.' ? s + len + 1 : NULL;
}

static int nat_part_cmp(const nat_part *a, const nat_part *b) {
    if (a->cls != b->cls) return a->cls < b->cls ? -1 : 1;
    if (a->cls == 1) {
        size_t n = a->text_len < b->text_len ? a->text_len : b->text_len;
        int c = memcmp(a->text, b->text, n);
        if (c) return c < 0 ? -1 : 1;
        if (a->text_len != b->text_len) return a->text_len < b->text_len ? -1 : 1;
        if (a->has_num != b->has_num) return a->has_num ? 1 : -1; /* (1, t) < (1, t, n) */
        if (!a->has_num) return 0;
    }
    return a->num < b->num ? -1 : a->num > b->num;
}

/* qsort comparator of hf_tensor by name in transformers' dot_natural_key order
 * (transformers/core_model_loading.py, 5.x): parts compared left to right, a name that is a
 * prefix of another first. */
static int cmp_dot_natural(const void *va, const void *vb) {
    const char *a = ((const hf_tensor *)va)->name, *b = ((const hf_tensor *)vb)->name;
    while (a && b) {
        nat_part pa, pb;
        a = nat_next(a, &pa);
        b = nat_next(b, &pb);
        int c = nat_part_cmp(&pa, &pb);
        if (c) return c;
    }
    return a ? 1 : b ? -1 : 0;
}

/* The tensors of the merged checkpoint in the order save_pretrained walks them to cut shards:
 * transformers >= 5 (revert_weight_conversion in core_model_loading.py, applied by save_pretrained
 * with the default save_original_format=True) sorts the state dict by dot_natural_key first
 * ("model.layers.2.*" before "model.layers.10.*", and within a layer input_layernorm, mlp.*,
 * post_attention_layernorm, self_attn.*); 4.x walked module registration order instead. Checked
 * against transformers 5.23 save_pretrained by tests/reference/check_exports.py --hf-dir.
 * *out malloc'd. */
static int plan_tensors(const bt_model *m, int dtype, hf_tensor **out, int *n_out) {
    const bt_llama_hparams *hp = &m->hp;
    const size_t es = dtype == BT_EXPORT_F32 ? 4 : 2;
    const int gemma = hp->arch == BT_ARCH_GEMMA3;
    int cap = 3 + hp->n_layer * (2 * BT_MOD_N + 6), n = 0;
    hf_tensor *t = calloc((size_t)cap, sizeof *t);
    if (!t) return bt_fail(BT_ERR_NOMEM, "export: out of memory");
#define ADD(k, l, md, r, c, ...)                                                                    \
    do {                                                                                           \
        hf_tensor *x = &t[n++];                                                                    \
        x->kind = (k), x->layer = (l), x->mod = (md), x->rows = (r), x->cols = (c);                \
        x->minus1 = gemma && (k) != T_EMBED && (k) != T_WEIGHT && (k) != T_BIAS &&                 \
                    (k) != T_LM_HEAD && (k) != T_FUSED;                                             \
        x->nbytes = (uint64_t)((r) ? (r) : 1) * (uint64_t)(c) * es;                                \
        snprintf(x->name, sizeof x->name, __VA_ARGS__);                                            \
    } while (0)
    ADD(T_EMBED, -1, -1, hp->vocab, hp->d_model, "model.embed_tokens.weight");
    for (int l = 0; l < hp->n_layer; l++) {
        for (int mod = 0; mod < BT_MOD_N; mod++) {
            const bt_base_linear *b = &m->layers[l].lin[mod];
            const char *blk = mod <= BT_MOD_O ? "self_attn" : "mlp";
            const int nf = bt_export_fused_count(m, mod);
            if (nf == 0) continue; /* inside Phi-3's fused tensor, written at its first module */
            if (nf > 1) {          /* Phi3Attention.qkv_proj [Dq + 2 Dkv, D], Phi3MLP.gate_up_proj */
                int64_t rows = 0;
                for (int k = mod; k < mod + nf; k++) rows += m->layers[l].lin[k].rows;
                ADD(T_FUSED, l, mod, rows, b->cols, "model.layers.%d.%s.%s.weight", l, blk,
                    mod == BT_MOD_Q ? "qkv_proj" : "gate_up_proj");
                continue;          /* Phi-3 has no biases */
            }
            ADD(T_WEIGHT, l, mod, b->rows, b->cols, "model.layers.%d.%s.%s.weight", l, blk,
                bt_module_name(mod));
            if (b->bias)
                ADD(T_BIAS, l, mod, 0, b->rows, "model.layers.%d.%s.%s.bias", l, blk,
                    bt_module_name(mod));
        }
        ADD(T_NORM_IN, l, -1, 0, hp->d_model, "model.layers.%d.input_layernorm.weight", l);
        if (gemma) { /* Gemma3DecoderLayer: pre_feedforward_layernorm is the MLP input's norm
                      * (ffn_norm), post_attention / post_feedforward the sandwich norms */
            ADD(T_NORM_POST, l, -1, 0, hp->d_model, "model.layers.%d.pre_feedforward_layernorm.weight", l);
            ADD(T_POST_ATTN, l, -1, 0, hp->d_model, "model.layers.%d.post_attention_layernorm.weight", l);
            ADD(T_POST_FFN, l, -1, 0, hp->d_model, "model.layers.%d.post_feedforward_layernorm.weight", l);
        } else {
            ADD(T_NORM_POST, l, -1, 0, hp->d_model, "model.layers.%d.post_attention_layernorm.weight", l);
        }
        if (hp->qk_norm) { /* Qwen3Attention / Gemma3Attention q_norm / k_norm [head_dim] */
            ADD(T_QNORM, l, -1, 0, hp->head_dim, "model.layers.%d.self_attn.q_norm.weight", l);
            ADD(T_KNORM, l, -1, 0, hp->head_dim, "model.layers.%d.self_attn.k_norm.weight", l);
        }
    }
    ADD(T_NORM, -1, -1, 0, hp->d_model, "model.norm.weight");
    if (!m->tied) ADD(T_LM_HEAD, -1, -1, hp->vocab, hp->d_model, "lm_head.weight");
#undef ADD
    qsort(t, (size_t)n, sizeof *t, cmp_dot_natural);
    *out = t;
    *n_out = n;
    return 0;
}

/* huggingface_hub split_state_dict_into_shards_factory (serialization/_base.py), which
 * save_pretrained uses: walk the tensors in order; a tensor larger than max_shard_bytes gets a
 * shard of its own; otherwise a new shard starts when the tensor would push the current one past
 * the limit. Sets t[i].shard; returns the number of shards. */
static int assign_shards(hf_tensor *t, int n, uint64_t max_bytes) {
    int n_shards = 0, cur = -1;
    uint64_t cur_size = 0;
    for (int i = 0; i < n; i++) {
        if (t[i].nbytes > max_bytes) {
            t[i].shard = n_shards++; /* own shard, appended after the current one's start */
            continue;
        }
        if (cur < 0 || cur_size + t[i].nbytes > max_bytes) {
            cur = n_shards++;
            cur_size = 0;
        }
        t[i].shard = cur;
        cur_size += t[i].nbytes;
    }
    /* huggingface_hub appends a big tensor's own shard when met and the running shard when it
     * closes: renumber shards in that order */
    int *order = calloc((size_t)n_shards + 1, sizeof(int)), next = 0;
    if (!order) return -1;
    for (int s = 0; s < n_shards; s++) order[s] = -1;
    int open_shard = -1;
    for (int i = 0; i < n; i++) {
        int s = t[i].shard;
        if (t[i].nbytes > max_bytes) {
            order[s] = next++;
        } else if (s != open_shard) {
            if (open_shard >= 0) order[open_shard] = next++;
            open_shard = s;
        }
    }
    if (open_shard >= 0) order[open_shard] = next++;
    for (int i = 0; i < n; i++) t[i].shard = order[t[i].shard];
    free(order);
    return n_shards;
}

/* fp32 data of tensor x: the merged weight (in *scratch, grown as needed) or a pointer into the
 * model / adapter (LoRA+ embedding and norms replace the base's). */
static int tensor_data_raw(const bt_model *m, const bt_lora *lo, const hf_tensor *x,
                           float **scratch, size_t *cap, const float **data) {
    switch (x->kind) {
    case T_EMBED: *data = bt_lora_embed(lo, m); return 0;
    case T_BIAS: *data = m->layers[x->layer].lin[x->mod].bias; return 0;
    case T_NORM_IN: *data = bt_lora_norm(lo, m, x->layer, 0); return 0;
    case T_NORM_POST: *data = bt_lora_norm(lo, m, x->layer, 1); return 0;
    case T_NORM: *data = bt_lora_norm(lo, m, m->hp.n_layer, 0); return 0;
    case T_LM_HEAD: *data = bt_lora_lm_head(lo, m); return 0;
    case T_QNORM: *data = m->layers[x->layer].q_norm; return 0;
    case T_KNORM: *data = m->layers[x->layer].k_norm; return 0;
    case T_POST_ATTN: *data = m->layers[x->layer].post_attn_norm; return 0;
    case T_POST_FFN: *data = m->layers[x->layer].post_ffn_norm; return 0;
    default: break;
    }
    if (x->kind == T_FUSED) { /* q; k; v or gate; up, merged, stacked */
        float *f = NULL;
        int64_t rows = 0;
        int rc = bt_export_merged_fused(m, lo, x->layer, x->mod, &f, &rows);
        if (rc) return rc;
        free(*scratch);
        *scratch = f, *cap = (size_t)rows * (size_t)x->cols;
        *data = f;
        return 0;
    }
    size_t need = (size_t)x->rows * (size_t)x->cols;
    if (need > *cap) {
        float *p = realloc(*scratch, need * sizeof(float));
        if (!p) return bt_fail(BT_ERR_NOMEM, "export: out of memory");
        *scratch = p, *cap = need;
    }
    int rc = bt_export_merged_weight(m, lo, x->layer, x->mod, *scratch);
    *data = *scratch;
    return rc;
}

/* tensor_data_raw, then a Gemma norm (x->minus1, 1-D) turned back into HF's w = factor - 1 in
 * *scratch. */
static int tensor_data(const bt_model *m, const bt_lora *lo, const hf_tensor *x, float **scratch,
                       size_t *cap, const float **data) {
    int rc = tensor_data_raw(m, lo, x, scratch, cap, data);
    if (rc || !x->minus1) return rc;
    if (!*data) return bt_fail(BT_ERR_INVALID, "export: %s: the model lacks it", x->name);
    const float *src = *data;
    if ((size_t)x->cols > *cap) {
        float *p = realloc(*scratch, (size_t)x->cols * sizeof(float));
        if (!p) return bt_fail(BT_ERR_NOMEM, "export: out of memory");
        *scratch = p, *cap = (size_t)x->cols;
    }
    for (int64_t i = 0; i < x->cols; i++) (*scratch)[i] = src[i] - 1.0f;
    *data = *scratch;
    return 0;
}

static void shard_name(char *buf, size_t n, int shard, int n_shards) {
    if (n_shards == 1) snprintf(buf, n, "model.safetensors");
    else snprintf(buf, n, "model-%05d-of-%05d.safetensors", shard + 1, n_shards);
}

/* A weights file name this exporter may have written: model.safetensors,
 * model.safetensors.index.json or model-NNNNN-of-NNNNN.safetensors. */
static int weights_name(const char *s) {
    unsigned a, b;
    int end = 0;
    if (!strcmp(s, "model.safetensors") || !strcmp(s, "model.safetensors.index.json")) return 1;
    return strlen(s) == 32 && sscanf(s, "model-%5u-of-%5u.safetensors%n", &a, &b, &end) == 2 &&
           end == 32;
}

/* Remove weights files of an earlier export that this one did not write (as save_pretrained
 * cleans its folder): a stale model.safetensors would shadow the new index, stale shards would
 * lie beside it. */
static void remove_stale(const char *dir, int n_shards) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (!weights_name(e->d_name)) continue;
        int keep = n_shards > 1 && !strcmp(e->d_name, "model.safetensors.index.json");
        char nm[64];
        for (int s = 0; s < n_shards && !keep; s++) {
            shard_name(nm, sizeof nm, s, n_shards);
            keep = !strcmp(nm, e->d_name);
        }
        if (keep) continue;
        if (unlinkat(dirfd(d), e->d_name, 0) == 0)
            bt_log(BT_LOG_INFO, "export", "removed %s/%s left by an earlier export", dir, e->d_name);
    }
    closedir(d);
}

/* Writes the shards and, for more than one, model.safetensors.index.json ({"metadata":
 * {"total_size"}, "weight_map"} with sorted keys, as save_pretrained writes it). */
static int write_weights(const bt_model *m, const bt_lora *lo, int dtype, uint64_t max_bytes,
                         const char *dir, int *n_shards_out) {
    hf_tensor *t = NULL;
    int n = 0, rc = plan_tensors(m, dtype, &t, &n);
    if (rc) return rc;
    int n_shards = assign_shards(t, n, max_bytes);
    if (n_shards < 0) {
        free(t);
        return bt_fail(BT_ERR_NOMEM, "export: out of memory");
    }
    float *scratch = NULL;
    size_t cap = 0;
    char nm[64], *path = NULL;
    uint64_t total = 0;
    json_t *map = json_object();
    for (int s = 0; s < n_shards && !rc; s++) {
        bt_st_writer *w = bt_st_writer_new();
        if (!w || (rc = bt_st_w_metadata(w, "format", "pt"))) {
            if (!rc) rc = bt_fail(BT_ERR_NOMEM, "export: out of memory");
            bt_st_writer_free(w);
            break;
        }
        shard_name(nm, sizeof nm, s, n_shards);
        for (int i = 0; i < n && !rc; i++) {
            if (t[i].shard != s) continue;
            const float *x = NULL;
            if ((rc = tensor_data(m, lo, &t[i], &scratch, &cap, &x))) break;
            rc = add_st(w, t[i].name, x, t[i].rows, t[i].cols, dtype);
            json_object_set_new(map, t[i].name, json_string(nm));
            total += t[i].nbytes;
        }
        if (!rc && asprintf(&path, "%s/%s", dir, nm) < 0) {
            path = NULL;
            rc = bt_fail(BT_ERR_NOMEM, "export: out of memory");
        }
        if (!rc && (rc = bt_st_writer_write(w, path))) rc = bt_fail(rc, "export: %s", bt_last_error_in("export"));
        free(path);
        path = NULL;
        bt_st_writer_free(w); /* frees this shard's copies before the next one is built */
    }
    free(scratch);
    if (!rc && n_shards > 1) {
        if (asprintf(&path, "%s/model.safetensors.index.json", dir) < 0) {
            path = NULL;
            rc = bt_fail(BT_ERR_NOMEM, "export: out of memory");
        } else {
            json_t *idx = json_pack("{s:{s:I}, s:O}", "metadata", "total_size", (json_int_t)total,
                                    "weight_map", map);
            /* sorted keys (json.dumps(index, indent=2, sort_keys=True)) */
            char *s = idx ? json_dumps(idx, JSON_INDENT(2) | JSON_SORT_KEYS) : NULL;
            json_decref(idx);
            rc = s ? write_file(path, s) : bt_fail(BT_ERR_NOMEM, "export: out of memory");
            free(s);
        }
        free(path);
    }
    json_decref(map);
    if (!rc) remove_stale(dir, n_shards);
    free(t);
    *n_shards_out = n_shards;
    return rc;
}

/* ---- tokenizer and generation files ---- */

/* Files of a Hugging Face base directory carried over verbatim (when present). */
static const char *const k_hf_tok_files[] = {
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "chat_template.json", "vocab.json", "merges.txt", "added_tokens.json", "tokenizer.model",
    "generation_config.json", NULL};

#define HF_COPY_MAX (256u << 20) /* larger "tokenizer" files are not copied */

/* Copy src_dir/name to dst_dir/name atomically when it is a regular file (symlinks followed, as
 * Hugging Face cache snapshots are links to blobs). 1 = copied, 0 = absent, < 0 error. */
static int copy_file(const char *src_dir, const char *name, const char *dst_dir) {
    char *src = NULL, *dst = NULL;
    if (asprintf(&src, "%s/%s", src_dir, name) < 0) return bt_fail(BT_ERR_NOMEM, "export: out of memory");
    int fd = open(src, O_RDONLY | O_CLOEXEC), rc = 0;
    struct stat st;
    if (fd < 0) {
        rc = errno == ENOENT ? 0 : bt_fail(BT_ERR_IO, "export: %s: %s", src, strerror(errno));
        free(src);
        return rc;
    }
    char *buf = NULL;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || (uint64_t)st.st_size > HF_COPY_MAX) {
        rc = bt_fail(BT_ERR_IO, "export: %s: not a regular file of at most %u MiB", src,
                     HF_COPY_MAX >> 20);
    } else if (!(buf = malloc((size_t)st.st_size + 1)) || asprintf(&dst, "%s/%s", dst_dir, name) < 0) {
        dst = NULL;
        rc = bt_fail(BT_ERR_NOMEM, "export: out of memory");
    } else {
        size_t got = 0;
        while (got < (size_t)st.st_size) {
            ssize_t r = read(fd, buf + got, (size_t)st.st_size - got);
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) break;
            got += (size_t)r;
        }
        bt_atomic_file af;
        if (got != (size_t)st.st_size) rc = bt_fail(BT_ERR_IO, "export: read %s: short read", src);
        else if (!(rc = bt_atomic_open(&af, dst, "export"))) {
            if (!(rc = bt_atomic_write(&af, buf, got))) rc = bt_atomic_commit(&af);
            else bt_atomic_abort(&af);
        }
        if (!rc) rc = 1;
    }
    close(fd);
    free(buf);
    free(src);
    free(dst);
    return rc;
}

/* generation_config.json: bos / eos / pad ids; eos lists <|im_end|> too when it is a different
 * token (trainer generate stops at both, as chat models' own generation configs list them). */
static int write_generation_config(const char *dir, const hf_ids *ids) {
    json_t *j = json_object();
    if (ids->bos >= 0) json_object_set_new(j, "bos_token_id", json_integer(ids->bos));
    if (ids->eos >= 0 && ids->im_end >= 0 && ids->im_end != ids->eos)
        json_object_set_new(j, "eos_token_id", json_pack("[i, i]", ids->eos, ids->im_end));
    else if (ids->eos >= 0) json_object_set_new(j, "eos_token_id", json_integer(ids->eos));
    if (ids->pad >= 0) json_object_set_new(j, "pad_token_id", json_integer(ids->pad));
    char *path = NULL;
    if (asprintf(&path, "%s/generation_config.json", dir) < 0) {
        json_decref(j);
        return bt_fail(BT_ERR_NOMEM, "export: out of memory");
    }
    int rc = write_json(path, j);
    free(path);
    return rc;
}

/* A tokenizer.ggml.*_token_id the tokenizer could not be built for (-1 if absent or not an id). */
static int32_t gguf_id(const bt_gguf *g, const char *key) {
    int64_t v;
    return bt_gguf_get_i64(g, key, &v) == 0 && v >= 0 && v <= 0x7fffffff ? (int32_t)v : -1;
}

static void ids_of(const bt_tokenizer *t, hf_ids *ids) {
    ids->bos = bt_tokenizer_bos(t), ids->eos = bt_tokenizer_eos(t), ids->pad = bt_tokenizer_pad(t);
    ids->im_end = bt_tokenizer_find(t, "<|im_end|>");
}

/* The tokenizer files from the base GGUF (bt_tokenizer_hf_from_gguf) or copied from the base
 * directory, and generation_config.json; fills *ids. A base without a usable tokenizer gets a
 * warning naming the reason (the directory then loads as a model only). */
static int write_tokenizer(const bt_model *m, const bt_hf_export_opts *o, const char *dir,
                           hf_ids *ids) {
    bt_tokenizer *t = NULL;
    int rc = 0, have_gen = 0;
    if (o && o->base_gguf) {
        bt_hf_tokenizer_files f;
        if (bt_gguf_find_key(o->base_gguf, "tokenizer.ggml.model") < 0) {
            bt_log(BT_LOG_WARN, "export", "the base GGUF has no tokenizer (tokenizer.ggml.*): %s "
                   "gets no tokenizer files", dir);
        } else if (bt_tokenizer_hf_from_gguf(o->base_gguf, m->hp.ctx, &f) != 0) {
            /* the weights and config.json are still right: say why the tokenizer is missing */
            bt_log(BT_LOG_WARN, "export", "%s gets no tokenizer files: %s", dir, bt_last_error());
            ids->bos = gguf_id(o->base_gguf, "tokenizer.ggml.bos_token_id");
            ids->eos = gguf_id(o->base_gguf, "tokenizer.ggml.eos_token_id");
            ids->pad = gguf_id(o->base_gguf, "tokenizer.ggml.padding_token_id");
        } else {
            ids->bos = f.bos, ids->eos = f.eos, ids->pad = f.pad;
            if (!(rc = write_text(dir, "tokenizer.json", f.tokenizer_json)) &&
                !(rc = write_text(dir, "tokenizer_config.json", f.tokenizer_config_json)))
                rc = write_text(dir, "special_tokens_map.json", f.special_tokens_map_json);
            bt_hf_tokenizer_files_free(&f);
            if (!rc && (rc = bt_tokenizer_from_gguf(&t, o->base_gguf)) == 0) ids_of(t, ids);
        }
    } else if (o && o->base_dir) {
        int copied = 0;
        for (int i = 0; k_hf_tok_files[i] && rc >= 0; i++) {
            rc = copy_file(o->base_dir, k_hf_tok_files[i], dir);
            if (rc == 1) {
                copied++;
                if (!strcmp(k_hf_tok_files[i], "generation_config.json")) have_gen = 1;
            }
        }
        if (rc < 0) return rc;
        rc = 0;
        if (bt_tokenizer_load(&t, o->base_dir) == 0) ids_of(t, ids);
        else bt_log(BT_LOG_WARN, "export", "the base directory %s has no tokenizer we can read "
                    "(%s): %d tokenizer files copied as they are", o->base_dir, bt_last_error(),
                    copied - have_gen);
    }
    bt_tokenizer_free(t);
    if (!rc && !have_gen) rc = write_generation_config(dir, ids);
    return rc;
}

int bt_export_hf_owns(const char *name) {
    if (weights_name(name) || !strcmp(name, "config.json")) return 1;
    for (int i = 0; k_hf_tok_files[i]; i++)
        if (!strcmp(name, k_hf_tok_files[i])) return 1;
    return 0;
}

/* ---- the directory ---- */

int bt_export_safetensors_merged(const bt_model *m, const bt_lora *lo, int dtype,
                                 const bt_hf_export_opts *o, const char *out_dir) {
    if (dtype != BT_EXPORT_F32 && dtype != BT_EXPORT_F16 && dtype != BT_EXPORT_BF16)
        return bt_fail(BT_ERR_INVALID, "export: safetensors: dtype %s not supported (f32, f16, bf16)",
                       bt_export_dtype_name(dtype));
    if (m->base_dtype != BT_BASE_FP32 || !m->tok_embd)
        return bt_fail(BT_ERR_INVALID, "export: merging needs the fp32 base (base_dtype fp32)");
    uint64_t max_bytes = o && o->max_shard_bytes > 0 ? (uint64_t)o->max_shard_bytes
                                                     : BT_EXPORT_DEFAULT_SHARD_BYTES;
    int rc = bt_export_lora_matches(m, lo), n_shards = 0;
    /* a directory of ours, or a new one: written into, never a user's (trainer/io/outputs.h) */
    if (rc || (rc = bt_out_dir_check(out_dir, &bt_out_export, "export")) ||
        (rc = bt_mkdir_p(out_dir, "export")) || (rc = bt_out_dir_mark(out_dir, &bt_out_export, "export")))
        return rc;
    hf_ids ids = {-1, -1, -1, -1};
    char *path = NULL;
    if ((rc = write_weights(m, lo, dtype, max_bytes, out_dir, &n_shards))) return rc;
    if ((rc = write_tokenizer(m, o, out_dir, &ids))) return rc;
    /* the tokenizer and ids came from the base's mapping: a base changed under us fails here */
    if (o && o->base_gguf && (rc = bt_gguf_check(o->base_gguf, 0))) return bt_fail(rc, "export: %s", bt_last_error_in("export"));
    if (asprintf(&path, "%s/config.json", out_dir) < 0)
        return bt_fail(BT_ERR_NOMEM, "export: out of memory");
    rc = write_hf_config(m, &ids, dtype, path);
    free(path);
    if (!rc)
        bt_log(BT_LOG_INFO, "export", "%s: %d weight file%s (max shard %llu bytes)", out_dir,
               n_shards, n_shards == 1 ? "" : "s", (unsigned long long)max_bytes);
    return rc;
}

int bt_export_parse_size(const char *s, int64_t *out) {
    static const struct {
        const char *unit;
        double mult;
    } units[] = {{"", 1},          {"B", 1},           {"KB", 1e3},          {"MB", 1e6},
                 {"GB", 1e9},      {"TB", 1e12},       {"KIB", 1024.0},      {"MIB", 1048576.0},
                 {"GIB", 1073741824.0}, {"TIB", 1099511627776.0}};
    char *end = NULL;
    errno = 0;
    double v = s ? strtod(s, &end) : 0;
    if (s && end != s && errno == 0 && v > 0) {
        char u[8] = "";
        size_t k = 0;
        while (end[k] && k < sizeof u - 1) u[k] = (char)(end[k] >= 'a' && end[k] <= 'z' ? end[k] - 32 : end[k]), k++;
        if (!end[k])
            for (size_t i = 0; i < sizeof units / sizeof *units; i++)
                if (!strcmp(u, units[i].unit) && v * units[i].mult >= 1 && v * units[i].mult < 9.0e18) {
                    *out = (int64_t)(v * units[i].mult);
                    return 0;
                }
    }
    return bt_fail(BT_ERR_INVALID, "export: --max-shard-size \"%s\": expected a size such as 5GB, "
                   "500MB, 2GiB or a byte count", s ? s : "");
}
