/* `trainer export`: PEFT adapter, llama.cpp LoRA GGUF, merged GGUF, merged safetensors. See
 * export.h for the formats and their sources. */
#include "trainer/io/export.h"

#include <getopt.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/atomic_io.h"
#include "common/bt_common.h"
#include "common/bt_json.h"
#include "common/gguf.h"
#include "common/quant.h"
#include "common/safetensors.h"
#include "trainer/io/adapter.h"
#include "trainer/io/adapter_load.h"
#include "trainer/config.h"
#include "trainer/io/export_internal.h"
#include "trainer/io/outputs.h"
#include "trainer/model/model_internal.h"

static int gguf_rope_keys(bt_gguf_writer *w, const bt_model *m, int note);

/* GGUF and Hugging Face tensor names per module, in BT_MOD_* order. */
static const char *const k_gguf_lin[BT_MOD_N] = {"attn_q",   "attn_k", "attn_v",  "attn_output",
                                                 "ffn_gate", "ffn_up", "ffn_down"};

int bt_export_format_parse(const char *s, int *out) {
    static const char *const names[] = {"peft", "gguf-lora", "gguf", "safetensors"};
    for (int i = 0; i < 4; i++)
        if (s && !strcmp(s, names[i])) return *out = i, 0;
    return bt_fail(BT_ERR_INVALID, "export: unknown format \"%s\" (peft, gguf-lora, gguf, safetensors)",
                   s ? s : "");
}

int bt_export_dtype_parse(const char *s, int *out) {
    static const char *const names[] = {"f32", "f16", "bf16", "q8_0"};
    for (int i = 0; i < 4; i++)
        if (s && !strcmp(s, names[i])) return *out = i, 0;
    return bt_fail(BT_ERR_INVALID, "export: unknown dtype \"%s\" (f32, f16, bf16, q8_0)", s ? s : "");
}

const char *bt_export_dtype_name(int d) {
    static const char *const names[] = {"f32", "f16", "bf16", "q8_0"};
    return d >= 0 && d < 4 ? names[d] : "?";
}

/* base_model_name_or_path of a PEFT adapter directory (malloc'd; "" when absent or null). The
 * weights themselves are loaded by trainer/io/adapter_load.h bt_lora_load_peft. */
static char *peft_base_name(const char *dir) {
    char *p = NULL, *out = NULL;
    if (asprintf(&p, "%s/adapter_config.json", dir) < 0) return bt_xstrdup("");
    json_t *j = NULL;
    bt_json_load_file(&j, p, 0, 16u << 20); /* errors: the name stays "" (the weights load says why) */
    const json_t *v = j ? json_object_get(j, "base_model_name_or_path") : NULL;
    out = bt_xstrdup(json_is_string(v) ? json_string_value(v) : "");
    json_decref(j);
    free(p);
    return out;
}

/* ---- layout helpers ---- */

int bt_export_permute_rows(float *dst, const float *src, int n_head, int rows, int cols) {
    if (n_head < 1 || rows < 0 || cols < 0 || rows % (2 * n_head) != 0)
        return bt_fail(BT_ERR_INVALID, "export: permute: %d rows is not a multiple of 2 x %d heads",
                       rows, n_head);
    int hd = rows / n_head, half = hd / 2;
    size_t rowb = (size_t)cols * sizeof(float);
    for (int h = 0; h < n_head; h++)
        for (int i = 0; i < half; i++)
            for (int j = 0; j < 2; j++)
                memcpy(dst + ((size_t)h * hd + 2 * i + j) * cols,
                       src + ((size_t)h * hd + j * half + i) * cols, rowb);
    return 0;
}

int bt_export_lora_matches(const bt_model *m, const bt_lora *lo) {
    if (!lo) return 0;
    if (lo->n_layer != m->hp.n_layer || !lo->mods)
        return bt_fail(BT_ERR_INVALID, "export: adapter has %d layers, the base %d", lo->n_layer,
                       m->hp.n_layer);
    if (((lo->embed || lo->norms) && lo->d_model != m->hp.d_model) ||
        (lo->embed && (lo->vocab != m->hp.vocab || lo->tied != m->tied)))
        return bt_fail(BT_ERR_INVALID, "export: the adapter's LoRA+ embedding / norms (vocab %d, "
                       "d_model %d%s) do not fit the base (vocab %d, d_model %d%s)", lo->vocab,
                       lo->d_model, lo->tied ? ", tied" : "", m->hp.vocab, m->hp.d_model,
                       m->tied ? ", tied" : "");
    for (int l = 0; l < lo->n_layer; l++)
        for (int mod = 0; mod < BT_MOD_N; mod++) {
            const bt_lora_mod *md = bt_lora_get(lo, l, mod);
            const bt_base_linear *b = &m->layers[l].lin[mod];
            if (md && (md->out != b->rows || md->in != b->cols))
                return bt_fail(BT_ERR_INVALID, "export: adapter layer %d %s is [%d, %d], the base "
                               "[%d, %d]", l, bt_module_name(mod), md->out, md->in, b->rows, b->cols);
        }
    return 0;
}

int bt_export_merged_weight(const bt_model *m, const bt_lora *lo, int layer, int mod, float *out) {
    if (layer < 0 || layer >= m->hp.n_layer || mod < 0 || mod >= BT_MOD_N)
        return bt_fail(BT_ERR_INVALID, "export: no linear (%d, %d)", layer, mod);
    const bt_base_linear *b = &m->layers[layer].lin[mod];
    if (b->is_nf4 || !b->w)
        return bt_fail(BT_ERR_INVALID, "export: merging needs the fp32 base (base_dtype fp32)");
    const int rows = b->rows, cols = b->cols;
    const bt_lora_mod *md = lo ? bt_lora_get(lo, layer, mod) : NULL;
    if (md && (md->out != rows || md->in != cols))
        return bt_fail(BT_ERR_INVALID, "export: adapter layer %d %s is [%d, %d], the base [%d, %d]",
                       layer, bt_module_name(mod), md->out, md->in, rows, cols);
    if (!md) {
        memcpy(out, b->w, (size_t)rows * cols * sizeof(float));
        return 0;
    }
    /* PEFT Linear.merge: W += (B @ A) * scaling; delta accumulated over k ascending in fp32. */
    const int r = lo->r;
    const float scale = lo->scale;
    int oom = 0;
#pragma omp parallel reduction(| : oom)
    {
        float *acc = malloc((size_t)cols * sizeof(float));
        if (!acc) oom = 1;
#pragma omp for schedule(static)
        for (int o = 0; o < rows; o++) {
            if (!acc) continue;
            memset(acc, 0, (size_t)cols * sizeof(float));
            for (int k = 0; k < r; k++) {
                const float bk = md->B[(size_t)o * r + k];
                const float *a = md->A + (size_t)k * cols;
                for (int c = 0; c < cols; c++) acc[c] += bk * a[c];
            }
            const float *w = b->w + (size_t)o * cols;
            float *y = out + (size_t)o * cols;
            for (int c = 0; c < cols; c++) y[c] = w[c] + acc[c] * scale;
        }
        free(acc);
    }
    if (oom) return bt_fail(BT_ERR_NOMEM, "export: out of memory (merge)");
    return 0;
}

int bt_export_fused_count(const bt_model *m, int mod) {
    if (m->hp.arch != BT_ARCH_PHI3) return 1;
    return mod == BT_MOD_Q ? 3 : mod == BT_MOD_GATE ? 2 : (mod <= BT_MOD_V || mod == BT_MOD_UP) ? 0 : 1;
}

int bt_export_merged_fused(const bt_model *m, const bt_lora *lo, int layer, int mod, float **out,
                           int64_t *rows) {
    const int nf = bt_export_fused_count(m, mod);
    if (nf < 1 || layer < 0 || layer >= m->hp.n_layer)
        return bt_fail(BT_ERR_INVALID, "export: no fused linear at (%d, %d)", layer, mod);
    int64_t n = 0, r = 0;
    for (int k = mod; k < mod + nf; k++) {
        n += (int64_t)m->layers[layer].lin[k].rows * m->layers[layer].lin[k].cols;
        r += m->layers[layer].lin[k].rows;
    }
    float *x = malloc((size_t)n * sizeof(float));
    if (!x) return bt_fail(BT_ERR_NOMEM, "export: out of memory");
    int64_t off = 0;
    for (int k = mod; k < mod + nf; k++) {
        int rc = bt_export_merged_weight(m, lo, layer, k, x + off);
        if (rc) {
            free(x);
            return rc;
        }
        off += (int64_t)m->layers[layer].lin[k].rows * m->layers[layer].lin[k].cols;
    }
    *out = x;
    *rows = r;
    return 0;
}

/* Encode rows x cols fp32 (row-major) as GGUF `dtype`: F32/F16/BF16, or Q8_0 when cols is a
 * multiple of 32 (else F16, as convert_hf_to_gguf.py falls back). *buf malloc'd. */
static int encode_gguf(const float *w, int64_t rows, int64_t cols, int dtype, int *type, void **buf,
                       size_t *nbytes) {
    int t = dtype == BT_EXPORT_F32    ? BT_GGML_F32
            : dtype == BT_EXPORT_BF16 ? BT_GGML_BF16
            : dtype == BT_EXPORT_Q8_0 && cols % 32 == 0 ? BT_GGML_Q8_0
                                                         : BT_GGML_F16;
    int64_t n = rows * cols;
    size_t nb = bt_ggml_row_size(t, cols) * (size_t)rows;
    void *b = malloc(nb ? nb : 1);
    if (!b) return bt_fail(BT_ERR_NOMEM, "export: out of memory (%zu bytes)", nb);
    if (t == BT_GGML_F32) memcpy(b, w, nb);
    else if (t == BT_GGML_Q8_0) {
        int rc = bt_q8_0_quantize(w, b, n);
        if (rc) {
            free(b);
            return rc;
        }
    } else {
        uint16_t *h = b;
        for (int64_t i = 0; i < n; i++) h[i] = t == BT_GGML_F16 ? bt_fp32_to_fp16(w[i]) : bt_fp32_to_bf16(w[i]);
    }
    *type = t;
    *buf = b;
    *nbytes = nb;
    return 0;
}

/* Add a 2-D [rows, cols] (ne = {cols, rows}) or 1-D [cols] (rows = 0, always F32) tensor. */
static int add_gguf(bt_gguf_writer *w, const char *name, const float *x, int64_t rows, int64_t cols,
                    int dtype) {
    uint64_t ne[2] = {(uint64_t)cols, (uint64_t)(rows ? rows : 1)};
    int t = 0;
    void *b = NULL;
    size_t nb = 0;
    int rc = encode_gguf(x, rows ? rows : 1, cols, rows ? dtype : BT_EXPORT_F32, &t, &b, &nb);
    if (rc) return rc;
    rc = bt_gguf_w_tensor(w, name, t, rows ? 2 : 1, ne, b, nb);
    free(b);
    if (rc) return bt_fail(rc, "export: tensor %s: %s", name, bt_last_error_in("export"));
    return 0;
}

/* LLAMA_FTYPE (llama.h / gguf-py LlamaFileType) for an export dtype. */
static uint32_t file_type(int dtype) {
    switch (dtype) {
    case BT_EXPORT_F32: return 0;
    case BT_EXPORT_F16: return 1;
    case BT_EXPORT_Q8_0: return 7;
    default: return 32; /* MOSTLY_BF16 */
    }
}

/* The lora_alpha that gives the adapter's scale with the plain alpha / r rule (equal to lo->alpha
 * unless the adapter was rsLoRA, scale = alpha / sqrt(r)): llama.cpp and the written PEFT config
 * both use scale = alpha / r. */
static float plain_alpha(const bt_lora *lo) {
    float a = lo->alpha;
    return lo->scale == a / (float)lo->r ? a : lo->scale * (float)lo->r;
}

/* ---- gguf-lora ---- */

int bt_export_gguf_lora(const bt_model *m, const bt_lora *lo, int dtype, const char *out) {
    if (!lo) return bt_fail(BT_ERR_INVALID, "export: gguf-lora needs an adapter");
    if (lo->trainable)
        return bt_fail(BT_ERR_UNSUPPORTED, "export: gguf-lora cannot carry a LoRA+ adapter's trained "
                       "%s%s%s (llama.cpp LoRA GGUFs hold lora_a / lora_b pairs only: "
                       "convert_lora_to_gguf.py rejects embeddings and llama.cpp's adapter loader "
                       "skips norm vectors); export --format gguf or safetensors (merged) or peft",
                       lo->embed ? "embed_tokens" : "", lo->embed && lo->norms ? " and " : "",
                       lo->norms ? "norm weights" : "");
    if (dtype < BT_EXPORT_F32 || dtype > BT_EXPORT_Q8_0)
        return bt_fail(BT_ERR_INVALID, "export: gguf-lora: bad dtype %d", dtype);
    int rc = bt_export_lora_matches(m, lo);
    if (rc) return rc;
    bt_gguf_writer *w = bt_gguf_writer_new();
    if (!w) return bt_fail(BT_ERR_NOMEM, "export: out of memory");
    float *perm = NULL;
    /* llama.cpp refuses an adapter whose general.architecture is not the model's
     * (llama-adapter.cpp); q/k rows are permuted for "llama" only (convert_hf_to_gguf.py
     * LlamaModel.permute; Qwen2Model / Qwen3Model keep HF's rows) */
    const char *an = bt_arch_name(m->hp.arch);
    if ((rc = bt_gguf_w_str(w, "general.architecture", an, strlen(an))) ||
        (rc = bt_gguf_w_str(w, "general.type", "adapter", 7)) ||
        (rc = bt_gguf_w_str(w, "general.name", "BarqTrain LoRA", 14)) ||
        (rc = bt_gguf_w_u32(w, "general.file_type", file_type(dtype))) ||
        (rc = bt_gguf_w_u32(w, "general.quantization_version", 2)) ||
        (rc = bt_gguf_w_str(w, BT_EXPORT_GGUF_MARK_KEY, "gguf-lora", 9)) ||
        (rc = bt_gguf_w_str(w, "adapter.type", "lora", 4)) ||
        (rc = bt_gguf_w_f32(w, "adapter.lora.alpha", plain_alpha(lo))) ||
        (m->ctx_extended && (rc = gguf_rope_keys(w, m, 1))))
        goto out;
    char name[96];
    /* one lora_a / lora_b pair per PEFT module; Phi-3's fused qkv_proj / gate_up_proj go to
     * blk.N.attn_qkv / blk.N.ffn_up, the fused tensors llama.cpp's phi3 graph multiplies
     * (convert_lora_to_gguf.py maps PEFT names through Phi3MiniModel, which keeps them fused:
     * gguf-py TensorNameMap ATTN_QKV / FFN_UP) */
    for (int l = 0; l < lo->n_layer && !rc; l++)
        for (int mod = 0; mod < BT_MOD_N && !rc; mod++) {
            bt_lora_peft_mod u;
            if (!bt_lora_peft_get(lo, l, mod, &u)) continue;
            snprintf(name, sizeof name, "blk.%d.%s.weight.lora_a", l, u.gguf);
            if ((rc = add_gguf(w, name, u.A, lo->r, u.in, dtype))) break;
            const float *b = u.B;
            if ((mod == BT_MOD_Q || mod == BT_MOD_K) && m->hp.arch == BT_ARCH_LLAMA) {
                free(perm);
                perm = malloc((size_t)u.out * lo->r * sizeof(float));
                if (!perm) {
                    rc = bt_fail(BT_ERR_NOMEM, "export: out of memory");
                    break;
                }
                int nh = mod == BT_MOD_Q ? m->hp.n_head : m->hp.n_kv_head;
                if ((rc = bt_export_permute_rows(perm, u.B, nh, u.out, lo->r))) break;
                b = perm;
            }
            snprintf(name, sizeof name, "blk.%d.%s.weight.lora_b", l, u.gguf);
            rc = add_gguf(w, name, b, u.out, lo->r, dtype);
        }
    if (!rc && (rc = bt_gguf_writer_write(w, out))) rc = bt_fail(rc, "export: %s", bt_last_error_in("export"));
out:
    free(perm);
    bt_gguf_writer_free(w);
    return rc;
}

/* ---- merged GGUF ---- */

/* Keys written from the model (never copied from the base). */
static const char *const k_own_keys[] = {
    "general.architecture", "general.type", "general.file_type", "general.quantization_version",
    "general.alignment", BT_EXPORT_GGUF_MARK_KEY, "llama.block_count", "llama.context_length", "llama.embedding_length",
    "llama.feed_forward_length", "llama.attention.head_count", "llama.attention.head_count_kv",
    "llama.rope.dimension_count", "llama.rope.freq_base", "llama.attention.layer_norm_rms_epsilon",
    "llama.vocab_size", "llama.attention.key_length", "llama.attention.value_length",
    "llama.rope.scaling.type", "llama.rope.scaling.factor", "llama.rope.scaling.original_context_length",
    "llama.rope.scaling.attn_factor", "llama.rope.scaling.yarn_beta_fast",
    "llama.rope.scaling.yarn_beta_slow", "llama.rope.scaling.finetuned",
    "llama.attention.sliding_window"};

int bt_export_orig_ctx(const bt_llama_hparams *hp) {
    if (hp->rope_ext_orig_ctx > 0) return hp->rope_ext_orig_ctx;
    return (int)lround((double)hp->ctx / (hp->rope_ext_factor > 0.f ? hp->rope_ext_factor : 1.f));
}

/* llama.rope.scaling.* for the model's context scaling, as llama.cpp reads them (llama-model.cpp
 * load_hparams; convert_hf_to_gguf.py writes the same keys): linear {factor,
 * original_context_length}; yarn {factor, original_context_length, attn_factor = the HF attention
 * factor / (1 + 0.1 ln factor), because llama.cpp's rope_yarn multiplies that in itself,
 * yarn_beta_fast / yarn_beta_slow when not 32 / 1}. Dynamic NTK has no llama.cpp equivalent: a
 * model GGUF refuses it (BT_ERR_UNSUPPORTED); a LoRA GGUF (`note` != 0: keys llama.cpp ignores in
 * adapters, describing the base the adapter was trained on) records it as type "dynamic". With
 * `note`, llama.context_length is written too. Nothing is written without scaling. */
static int gguf_rope_keys(bt_gguf_writer *w, const bt_model *m, int note) {
    const bt_llama_hparams *hp = &m->hp;
    if (hp->rope_ext == BT_ROPE_EXT_NONE) return 0;
    if (hp->rope_ext == BT_ROPE_EXT_DYNAMIC && !note)
        return bt_fail(BT_ERR_UNSUPPORTED, "export: gguf: dynamic NTK RoPE scaling has no llama.cpp "
                       "equivalent (llama.rope.scaling.type knows none, linear, yarn); export "
                       "safetensors, or train with context_extension.method \"yarn\" or \"linear\"");
    const char *ty = bt_rope_ext_name(hp->rope_ext);
    int rc;
    if ((rc = bt_gguf_w_str(w, "llama.rope.scaling.type", ty, strlen(ty))) ||
        (rc = bt_gguf_w_f32(w, "llama.rope.scaling.factor", hp->rope_ext_factor)) ||
        (rc = bt_gguf_w_u32(w, "llama.rope.scaling.original_context_length",
                            (uint32_t)bt_export_orig_ctx(hp))) ||
        (note && (rc = bt_gguf_w_u32(w, "llama.context_length", (uint32_t)hp->ctx))))
        return rc;
    if (hp->rope_ext != BT_ROPE_EXT_YARN) return 0;
    const float af = bt_rope_yarn_attention_factor(hp->rope_ext_factor, hp->rope_attn_factor) /
                     bt_rope_yarn_attention_factor(hp->rope_ext_factor, 0.f);
    if ((rc = bt_gguf_w_f32(w, "llama.rope.scaling.attn_factor", af))) return rc;
    if (hp->rope_yarn_beta_fast > 0.f && hp->rope_yarn_beta_fast != 32.f &&
        (rc = bt_gguf_w_f32(w, "llama.rope.scaling.yarn_beta_fast", hp->rope_yarn_beta_fast)))
        return rc;
    if (hp->rope_yarn_beta_slow > 0.f && hp->rope_yarn_beta_slow != 1.f &&
        (rc = bt_gguf_w_f32(w, "llama.rope.scaling.yarn_beta_slow", hp->rope_yarn_beta_slow)))
        return rc;
    return 0;
}

/* llama.cpp's rope_freqs.weight for Llama 3.1 scaling: convert_hf_to_gguf.py LlamaModel
 * generate_extra_tensors, evaluated in fp32 as torch does it there (freq a 0-dim fp32 tensor,
 * `scalar / tensor` = reciprocal * scalar, Python scalars rounded to fp32 where they meet a
 * tensor): wavelen = 2 pi / freq; < ctx / high -> 1, > ctx / low -> factor, else
 * 1 / ((1 - smooth) / factor + smooth), smooth = (ctx / wavelen - low) / (high - low). ff [D/2]. */
static void llama3_freq_factors(float *ff, int D, float theta, float factor, float low, float high,
                                int ctx) {
    const float lo_wl = (float)((double)ctx / (double)low), hi_wl = (float)((double)ctx / (double)high);
    const float den = (float)((double)high - (double)low);
    for (int i = 0; i < D / 2; i++) {
        const float freq = 1.0f / powf(theta, (float)(2 * i) / (float)D);
        const float wavelen = (1.0f / freq) * (float)(2.0 * M_PI);
        if (wavelen < hi_wl) ff[i] = 1.0f;
        else if (wavelen > lo_wl) ff[i] = factor;
        else {
            const float smooth = ((1.0f / wavelen) * (float)ctx - low) / den;
            ff[i] = 1.0f / ((1.0f - smooth) / factor + smooth);
        }
    }
}

/* rope_freqs.weight to write for the model (*ff malloc'd [head_dim/2]), or *ff = NULL when the
 * model has no frequency scaling. */
static int gguf_rope_freqs(const bt_model *m, float **ff) {
    const bt_llama_hparams *hp = &m->hp;
    *ff = NULL;
    if (hp->rope_type != BT_ROPE_LLAMA3 && hp->rope_type != BT_ROPE_FREQS) return 0;
    if (hp->rope_type == BT_ROPE_FREQS && !m->rope_freqs)
        return bt_fail(BT_ERR_INVALID, "export: the model lacks its rope_freqs table");
    float *f = malloc((size_t)(hp->head_dim / 2) * sizeof(float));
    if (!f) return bt_fail(BT_ERR_NOMEM, "export: out of memory");
    if (hp->rope_type == BT_ROPE_FREQS)
        memcpy(f, m->rope_freqs, (size_t)(hp->head_dim / 2) * sizeof(float));
    else
        llama3_freq_factors(f, hp->head_dim, hp->rope_theta, hp->rope_factor,
                            hp->rope_low_freq_factor, hp->rope_high_freq_factor, hp->rope_orig_ctx);
    *ff = f;
    return 0;
}

/* HF rope_scaling "llama3" parameters behind a GGUF rope_freqs table: Llama 3.x's low 1, high 4,
 * original context 8192 (convert_hf_to_gguf.py's defaults) and factor = the largest factor, if
 * llama3_freq_factors reproduces the table with them (rel. 1e-6); else BT_ERR_UNSUPPORTED. */
int bt_export_llama3_from_freqs(const bt_model *m, float *factor, float *low, float *high, int *ctx) {
    const int half = m->hp.head_dim / 2;
    float mx = 0.f, *f = malloc((size_t)half * sizeof(float));
    if (!f) return bt_fail(BT_ERR_NOMEM, "export: out of memory");
    for (int i = 0; i < half; i++) mx = fmaxf(mx, m->rope_freqs[i]);
    llama3_freq_factors(f, m->hp.head_dim, m->hp.rope_theta, mx, 1.f, 4.f, 8192);
    int ok = 1;
    for (int i = 0; i < half; i++)
        if (fabsf(f[i] - m->rope_freqs[i]) > 1e-6f * m->rope_freqs[i]) ok = 0;
    free(f);
    if (!ok)
        return bt_fail(BT_ERR_UNSUPPORTED, "export: safetensors: the GGUF's rope_freqs.weight is "
                       "not Llama 3.x scaling (factor %g, low 1, high 4, original context 8192), "
                       "so config.json cannot express it", (double)mx);
    *factor = mx, *low = 1.f, *high = 4.f, *ctx = 8192;
    return 0;
}

static int own_key(const char *k, size_t n) {
    for (size_t i = 0; i < sizeof k_own_keys / sizeof *k_own_keys; i++)
        if (strlen(k_own_keys[i]) == n && !memcmp(k_own_keys[i], k, n)) return 1;
    /* "qwen2.<x>" / "qwen3.<x>" / "phi3.<x>" / "gemma3.<x>" of such a base: ours when
     * "llama.<x>" is */
    for (int a = BT_ARCH_QWEN2; a <= BT_ARCH_GEMMA3; a++) {
        const size_t an = strlen(bt_arch_name(a));
        if (n > an + 1 && n < 120 && !memcmp(k, bt_arch_name(a), an) && k[an] == '.') {
            char ll[128];
            snprintf(ll, sizeof ll, "llama.%.*s", (int)(n - an - 1), k + an + 1);
            return own_key(ll, strlen(ll));
        }
    }
    return 0;
}

/* Bias of (layer, mod) in GGUF row order (a 1-column matrix, permuted like the weight rows, as
 * convert_hf_to_gguf.py permutes q_proj.bias / k_proj.bias). *out malloc'd. */
static int bias_gguf_order(const bt_model *m, int l, int mod, float **out) {
    const bt_base_linear *b = &m->layers[l].lin[mod];
    float *x = malloc((size_t)b->rows * sizeof(float));
    if (!x) return bt_fail(BT_ERR_NOMEM, "export: out of memory");
    int rc = 0;
    if ((mod == BT_MOD_Q || mod == BT_MOD_K) && m->hp.arch == BT_ARCH_LLAMA)
        rc = bt_export_permute_rows(x, b->bias, mod == BT_MOD_Q ? m->hp.n_head : m->hp.n_kv_head,
                                    b->rows, 1);
    else memcpy(x, b->bias, (size_t)b->rows * sizeof(float));
    if (rc) {
        free(x);
        return rc;
    }
    *out = x;
    return 0;
}

/* 0 if a merged gemma3 GGUF can say everything hp holds, as llama.cpp's gemma3 loader
 * (llama-model.cpp load_hparams LLM_ARCH_GEMMA3) reads it: every 6th layer global
 * (set_swa_pattern(6)), local RoPE base 10000 unscaled, softmax scale 1/sqrt(key_length) (the
 * 62-layer 27B: 1/sqrt(embedding_length / head_count)), RoPE scaling linear or none. Otherwise
 * BT_ERR_UNSUPPORTED naming the value (export --format safetensors keeps it). */
static int gemma3_gguf_expressible(const bt_llama_hparams *hp) {
    const float scalar = hp->n_layer == 62 ? (float)(hp->d_model / hp->n_head) : (float)hp->head_dim;
    const char *what = hp->sliding_window < 1              ? "no sliding window"
                       : hp->swa_pattern != 6              ? "a global layer period other than 6"
                       : hp->rope_local_theta != 10000.f  ? "a local RoPE base other than 10000"
                       : (hp->attn_scalar > 0.f ? hp->attn_scalar : (float)hp->head_dim) != scalar
                           ? "a query_pre_attn_scalar other than llama.cpp's"
                       : hp->rope_ext != BT_ROPE_EXT_NONE && hp->rope_ext != BT_ROPE_EXT_LINEAR
                           ? "RoPE scaling other than linear"
                       : hp->rope_type != BT_ROPE_DEFAULT ? "a RoPE frequency table"
                                                          : NULL;
    if (what)
        return bt_fail(BT_ERR_UNSUPPORTED, "export: gguf: this Gemma 3 model has %s, which a "
                       "gemma3 GGUF cannot express (llama.cpp fixes it); export --format "
                       "safetensors", what);
    return 0;
}

/* Merged weight of (layer, mod) in GGUF row order (Q/K re-permuted). *out malloc'd. */
static int merged_gguf_order(const bt_model *m, const bt_lora *lo, int l, int mod, float **out) {
    const bt_base_linear *b = &m->layers[l].lin[mod];
    size_t n = (size_t)b->rows * b->cols;
    float *w = malloc(n * sizeof(float)), *p = NULL;
    if (!w) return bt_fail(BT_ERR_NOMEM, "export: out of memory");
    int rc = bt_export_merged_weight(m, lo, l, mod, w);
    if (!rc && (mod == BT_MOD_Q || mod == BT_MOD_K) && m->hp.arch == BT_ARCH_LLAMA) {
        p = malloc(n * sizeof(float));
        if (!p) rc = bt_fail(BT_ERR_NOMEM, "export: out of memory");
        else rc = bt_export_permute_rows(p, w, mod == BT_MOD_Q ? m->hp.n_head : m->hp.n_kv_head,
                                         b->rows, b->cols);
        free(w);
        w = p;
    }
    if (rc) {
        free(w);
        return rc;
    }
    *out = w;
    return 0;
}

int bt_export_gguf_merged(const bt_model *m, const bt_lora *lo, const bt_gguf *base, int dtype,
                          const char *out) {
    if (dtype < BT_EXPORT_F32 || dtype > BT_EXPORT_Q8_0)
        return bt_fail(BT_ERR_INVALID, "export: gguf: bad dtype %d", dtype);
    if (m->base_dtype != BT_BASE_FP32 || !m->tok_embd)
        return bt_fail(BT_ERR_INVALID, "export: merging needs the fp32 base (base_dtype fp32)");
    int rc = bt_export_lora_matches(m, lo);
    if (rc) return rc;
    const bt_llama_hparams *hp = &m->hp;
    if (hp->arch == BT_ARCH_GEMMA3 && (rc = gemma3_gguf_expressible(hp))) return rc;
    bt_gguf_writer *w = bt_gguf_writer_new();
    if (!w) return bt_fail(BT_ERR_NOMEM, "export: out of memory");
    /* <arch>.* keys, <arch> = the model's family ("llama", "qwen2", "qwen3": what
     * convert_hf_to_gguf.py writes for it, so llama.cpp builds the same graph) */
    const char *an = bt_arch_name(hp->arch);
    char kk[12][64];
    static const char *const sfx[12] = {"block_count", "context_length", "embedding_length",
                                        "feed_forward_length", "attention.head_count",
                                        "attention.head_count_kv", "rope.dimension_count",
                                        "rope.freq_base", "attention.layer_norm_rms_epsilon",
                                        "vocab_size", "attention.key_length",
                                        "attention.value_length"};
    for (int i = 0; i < 12; i++) snprintf(kk[i], sizeof kk[i], "%s.%s", an, sfx[i]);
    if ((rc = bt_gguf_w_str(w, "general.architecture", an, strlen(an))) ||
        (rc = bt_gguf_w_str(w, "general.type", "model", 5)) ||
        (rc = bt_gguf_w_u32(w, "general.file_type", file_type(dtype))) ||
        (rc = bt_gguf_w_u32(w, "general.quantization_version", 2)) ||
        (rc = bt_gguf_w_str(w, BT_EXPORT_GGUF_MARK_KEY, "gguf", 4)) ||
        (rc = bt_gguf_w_u32(w, kk[0], (uint32_t)hp->n_layer)) ||
        (rc = bt_gguf_w_u32(w, kk[1], (uint32_t)hp->ctx)) ||
        (rc = bt_gguf_w_u32(w, kk[2], (uint32_t)hp->d_model)) ||
        (rc = bt_gguf_w_u32(w, kk[3], (uint32_t)hp->d_ff)) ||
        (rc = bt_gguf_w_u32(w, kk[4], (uint32_t)hp->n_head)) ||
        (rc = bt_gguf_w_u32(w, kk[5], (uint32_t)hp->n_kv_head)) ||
        (rc = bt_gguf_w_u32(w, kk[6], (uint32_t)hp->head_dim)) ||
        (rc = bt_gguf_w_f32(w, kk[7], hp->rope_theta)) ||
        (rc = bt_gguf_w_f32(w, kk[8], hp->rms_eps)) ||
        (rc = bt_gguf_w_u32(w, kk[9], (uint32_t)hp->vocab)))
        goto out;
    if ((hp->head_dim * hp->n_head != hp->d_model || hp->arch == BT_ARCH_GEMMA3) &&
        /* llama.cpp: n_embd_head_k / _v (convert_hf_to_gguf.py Gemma3Model always writes them) */
        ((rc = bt_gguf_w_u32(w, kk[10], (uint32_t)hp->head_dim)) ||
         (rc = bt_gguf_w_u32(w, kk[11], (uint32_t)hp->head_dim))))
        goto out;
    if (hp->arch == BT_ARCH_GEMMA3) {
        /* convert_hf_to_gguf.py Gemma3Model.set_gguf_parameters: the local layers' window, and
         * a linear rope_scaling (global layers only) as type + factor */
        char k1[64], k2[64], k3[64];
        snprintf(k1, sizeof k1, "%s.attention.sliding_window", an);
        snprintf(k2, sizeof k2, "%s.rope.scaling.type", an);
        snprintf(k3, sizeof k3, "%s.rope.scaling.factor", an);
        if ((rc = bt_gguf_w_u32(w, k1, (uint32_t)hp->sliding_window)) ||
            (hp->rope_ext == BT_ROPE_EXT_LINEAR &&
             ((rc = bt_gguf_w_str(w, k2, "linear", 6)) ||
              (rc = bt_gguf_w_f32(w, k3, hp->rope_ext_factor)))))
            goto out;
    } else if (hp->arch != BT_ARCH_LLAMA && (hp->rope_ext || hp->rope_type != BT_ROPE_DEFAULT)) {
        rc = bt_fail(BT_ERR_UNSUPPORTED, "export: gguf: RoPE scaling of a %s model has no GGUF "
                     "keys here (only \"llama\" GGUFs carry them); export --format safetensors",
                     an);
        goto out;
    }
    if (hp->arch != BT_ARCH_GEMMA3 && (rc = gguf_rope_keys(w, m, 0))) goto out;
    if (hp->arch == BT_ARCH_PHI3) {
        /* convert_hf_to_gguf.py Phi3MiniModel.set_gguf_parameters writes both; llama.cpp's phi3
         * loader (llama-model.cpp load_hparams) refuses a file without the sliding window
         * unless its layer count / context match a known Phi-3 */
        char k1[64], k2[64];
        snprintf(k1, sizeof k1, "%s.rope.scaling.original_context_length", an);
        snprintf(k2, sizeof k2, "%s.attention.sliding_window", an);
        if ((rc = bt_gguf_w_u32(w, k1, (uint32_t)hp->ctx)) ||
            (rc = bt_gguf_w_u32(w, k2, (uint32_t)hp->sliding_window)))
            goto out;
    }
    if (base) { /* tokenizer.*, general.name, ... verbatim, in the base's order */
        int64_t nkv = bt_gguf_n_kv(base);
        for (int64_t i = 0; i < nkv && !rc; i++) {
            bt_str k = bt_gguf_key_at(base, i);
            if (!k.ptr || own_key(k.ptr, k.len)) continue;
            char *key = strndup(k.ptr, k.len);
            if (!key) {
                rc = bt_fail(BT_ERR_NOMEM, "export: out of memory");
                break;
            }
            if ((rc = bt_gguf_w_copy_kv(w, base, key)))
                rc = bt_fail(rc, "export: copy KV %s: %s", key, bt_last_error_in("export"));
            free(key);
        }
        if (rc) goto out;
    }
    if ((!base || bt_gguf_find_key(base, "general.name") < 0) && /* transformers' reader needs it */
        (rc = bt_gguf_w_str(w, "general.name", "BarqTrain merged", 16)))
        goto out;
    {   /* Llama 3.1 scaling as llama.cpp stores it (convert_hf_to_gguf.py writes it first) */
        float *ff;
        if ((rc = gguf_rope_freqs(m, &ff))) goto out;
        if (ff) rc = add_gguf(w, "rope_freqs.weight", ff, 0, hp->head_dim / 2, dtype);
        free(ff);
        if (rc) goto out;
    }
    /* LoRA+ adapters replace the embedding (and a tied lm_head with it) and the norms */
    if ((rc = add_gguf(w, "token_embd.weight", bt_lora_embed(lo, m), hp->vocab, hp->d_model, dtype)))
        goto out;
    char name[96];
    for (int l = 0; l < hp->n_layer && !rc; l++) {
        const bt_layer *L = &m->layers[l];
        snprintf(name, sizeof name, "blk.%d.attn_norm.weight", l);
        if ((rc = add_gguf(w, name, bt_lora_norm(lo, m, l, 0), 0, hp->d_model, dtype))) break;
        if (hp->sandwich_norm) { /* Gemma 3: stored as HF's 1 + w, the factor we hold */
            snprintf(name, sizeof name, "blk.%d.post_attention_norm.weight", l);
            if ((rc = add_gguf(w, name, L->post_attn_norm, 0, hp->d_model, dtype))) break;
            snprintf(name, sizeof name, "blk.%d.post_ffw_norm.weight", l);
            if ((rc = add_gguf(w, name, L->post_ffn_norm, 0, hp->d_model, dtype))) break;
        }
        if (hp->qk_norm) { /* Qwen3 / Gemma 3: blk.N.attn_{q,k}_norm.weight [head_dim] (frozen) */
            snprintf(name, sizeof name, "blk.%d.attn_q_norm.weight", l);
            if ((rc = add_gguf(w, name, L->q_norm, 0, hp->head_dim, dtype))) break;
            snprintf(name, sizeof name, "blk.%d.attn_k_norm.weight", l);
            if ((rc = add_gguf(w, name, L->k_norm, 0, hp->head_dim, dtype))) break;
        }
        for (int mod = 0; mod < BT_MOD_N && !rc; mod++) {
            if (mod == BT_MOD_GATE) {
                snprintf(name, sizeof name, "blk.%d.ffn_norm.weight", l);
                if ((rc = add_gguf(w, name, bt_lora_norm(lo, m, l, 1), 0, hp->d_model, dtype))) break;
            }
            float *x = NULL;
            int nf = bt_export_fused_count(m, mod);
            if (nf == 0) continue; /* inside a fused tensor written at its first module */
            if (nf > 1) { /* Phi-3: blk.N.attn_qkv [q; k; v] and blk.N.ffn_up [gate; up] */
                int64_t rows = 0;
                if ((rc = bt_export_merged_fused(m, lo, l, mod, &x, &rows))) break;
                snprintf(name, sizeof name, "blk.%d.%s.weight", l,
                         mod == BT_MOD_Q ? "attn_qkv" : "ffn_up");
                rc = add_gguf(w, name, x, rows, L->lin[mod].cols, dtype);
                free(x);
                continue; /* Phi-3 has no biases (the loaders refuse them) */
            }
            if ((rc = merged_gguf_order(m, lo, l, mod, &x))) break;
            snprintf(name, sizeof name, "blk.%d.%s.weight", l, k_gguf_lin[mod]);
            rc = add_gguf(w, name, x, L->lin[mod].rows, L->lin[mod].cols, dtype);
            free(x);
            if (rc || !L->lin[mod].bias) continue;
            if ((rc = bias_gguf_order(m, l, mod, &x))) break;
            snprintf(name, sizeof name, "blk.%d.%s.bias", l, k_gguf_lin[mod]);
            rc = add_gguf(w, name, x, 0, L->lin[mod].rows, dtype);
            free(x);
        }
    }
    if (!rc) rc = add_gguf(w, "output_norm.weight", bt_lora_norm(lo, m, hp->n_layer, 0), 0, hp->d_model,
                           dtype);
    if (!rc && !m->tied)
        rc = add_gguf(w, "output.weight", bt_lora_lm_head(lo, m), hp->vocab, hp->d_model, dtype);
    if (base) rc = bt_gguf_check(base, rc); /* the metadata copied from it is what was there */
    if (!rc && (rc = bt_gguf_writer_write(w, out))) rc = bt_fail(rc, "export: %s", bt_last_error_in("export"));
out:
    bt_gguf_writer_free(w);
    return rc;
}

/* ---- driver ---- */

/* A model holding only hyper-parameters and linear shapes (no weights), read from the GGUF's
 * llama.* keys and its blk.0 linear tensors: all that the adapter-only formats need. */
static int shape_model(bt_model *m, const bt_gguf *g, const char *path) {
    memset(m, 0, sizeof *m);
    int64_t v[5];
    static const char *const sfx[5] = {"block_count", "embedding_length", "attention.head_count",
                                       "feed_forward_length", "attention.head_count_kv"};
    char keys[5][64], kctx[64], ktheta[64];
    bt_str arch;
    int fam = -1;
    if (bt_gguf_get_str(g, "general.architecture", &arch) == 0)
        for (int a = BT_ARCH_LLAMA; a <= BT_ARCH_GEMMA3 && fam < 0; a++)
            if (arch.len == strlen(bt_arch_name(a)) && !memcmp(arch.ptr, bt_arch_name(a), arch.len))
                fam = a;
    if (fam < 0)
        return bt_fail(BT_ERR_UNSUPPORTED, "export: %s: general.architecture is not \"llama\", "
                       "\"qwen2\", \"qwen3\", \"phi3\" or \"gemma3\"", path);
    for (int i = 0; i < 5; i++) snprintf(keys[i], sizeof keys[i], "%s.%s", bt_arch_name(fam), sfx[i]);
    snprintf(kctx, sizeof kctx, "%s.context_length", bt_arch_name(fam));
    snprintf(ktheta, sizeof ktheta, "%s.rope.freq_base", bt_arch_name(fam));
    m->hp.arch = fam;
    m->hp.qk_norm = fam == BT_ARCH_QWEN3 || fam == BT_ARCH_GEMMA3;
    for (int i = 0; i < 5; i++) {
        int rc = bt_gguf_get_i64(g, keys[i], &v[i]);
        if (rc == BT_ERR_NOTFOUND && i == 4) v[4] = v[2];
        else if (rc) return bt_fail(rc, "export: %s: %s: %s", path, keys[i],
                                    rc == BT_ERR_NOTFOUND ? "missing" : bt_last_error());
        if (v[i] < 1 || v[i] > (1 << 20))
            return bt_fail(BT_ERR_FORMAT, "export: %s: %s = %lld out of range", path, keys[i],
                           (long long)v[i]);
    }
    bt_llama_hparams *hp = &m->hp;
    hp->n_layer = (int)v[0], hp->d_model = (int)v[1], hp->n_head = (int)v[2], hp->d_ff = (int)v[3];
    hp->n_kv_head = (int)v[4];
    if (hp->n_head % hp->n_kv_head)
        return bt_fail(BT_ERR_FORMAT, "export: %s: inconsistent head counts", path);
    m->base_dtype = BT_BASE_FP32;
    m->layers = calloc((size_t)hp->n_layer, sizeof(bt_layer));
    if (!m->layers) return bt_fail(BT_ERR_NOMEM, "export: out of memory");
    /* phi3 (model.c gguf_layer): blk.0.attn_qkv [(n_head + 2 n_kv_head) head_dim rows] and
     * blk.0.ffn_up [2 d_ff rows] fused; attn_q / attn_k / attn_v when attn_qkv is absent */
    const int phi3_qkv = fam == BT_ARCH_PHI3 && bt_gguf_find_tensor(g, "blk.0.attn_qkv.weight");
    for (int mod = 0; mod < BT_MOD_N; mod++) {
        char name[64];
        const int fq = phi3_qkv && mod <= BT_MOD_V;
        const int fu = fam == BT_ARCH_PHI3 && (mod == BT_MOD_GATE || mod == BT_MOD_UP);
        snprintf(name, sizeof name, "blk.0.%s.weight",
                 fq ? "attn_qkv" : fu ? "ffn_up" : k_gguf_lin[mod]);
        const bt_gguf_tensor *t = bt_gguf_find_tensor(g, name);
        if (!t || t->n_dims != 2 || t->ne[0] > (1u << 20) || t->ne[1] > (1u << 20)) {
            bt_model_free(m);
            return bt_fail(BT_ERR_FORMAT, "export: %s: tensor %s missing or not 2-D", path, name);
        }
        int rows = (int)t->ne[1];
        if (fq) {
            const int hd = rows / (hp->n_head + 2 * hp->n_kv_head);
            rows = (mod == BT_MOD_Q ? hp->n_head : hp->n_kv_head) * hd;
        } else if (fu)
            rows /= 2;
        for (int l = 0; l < hp->n_layer; l++)
            m->layers[l].lin[mod].rows = rows, m->layers[l].lin[mod].cols = (int)t->ne[0];
    }
    /* vocab and tying, for a LoRA+ adapter's embedding (token_embd ne = {d_model, vocab}); vocab
     * stays 0 (bt_lora_load_peft then refuses modules_to_save) when the tensor is unusable */
    const bt_gguf_tensor *te = bt_gguf_find_tensor(g, "token_embd.weight");
    if (te && te->n_dims == 2 && te->ne[0] == (uint64_t)hp->d_model && te->ne[1] >= 1 &&
        te->ne[1] <= (1u << 24))
        hp->vocab = (int)te->ne[1];
    m->tied = bt_gguf_find_tensor(g, "output.weight") == NULL;
    const bt_base_linear *q = &m->layers[0].lin[BT_MOD_Q], *k = &m->layers[0].lin[BT_MOD_K];
    hp->head_dim = q->rows / hp->n_head; /* may differ from d_model / n_head */
    if (hp->head_dim < 2 || hp->head_dim % 2 || q->rows != hp->n_head * hp->head_dim ||
        k->rows != hp->n_kv_head * hp->head_dim) {
        bt_model_free(m);
        return bt_fail(BT_ERR_FORMAT, "export: %s: attn_q/attn_k rows do not match the head counts",
                       path);
    }
    /* RoPE (for an adapter trained with a context extension, whose keys the LoRA GGUF records) */
    int64_t ctx = 2048;
    double theta = 10000.0;
    if (bt_gguf_get_i64(g, kctx, &ctx) == 0 && (ctx < 1 || ctx > (1 << 30))) ctx = 2048;
    if (bt_gguf_get_f64(g, ktheta, &theta) == 0 && !(theta > 0)) theta = 10000.0;
    hp->ctx = (int)ctx;
    hp->rope_theta = (float)theta;
    int rc = fam == BT_ARCH_LLAMA ? bt_model_gguf_rope_scaling(g, path, hp) : 0;
    const bt_gguf_tensor *rf = bt_gguf_find_tensor(g, "rope_freqs.weight");
    float *ff = NULL;
    if (!rc && rf) {
        if (rf->type != BT_GGML_F32 || rf->ne[0] != (uint64_t)(hp->head_dim / 2) ||
            rf->nbytes < (uint64_t)(hp->head_dim / 2) * 4)
            rc = bt_fail(BT_ERR_FORMAT, "export: %s: rope_freqs.weight is not F32 [head_dim/2]", path);
        else if (!(ff = malloc((size_t)(hp->head_dim / 2) * sizeof(float))))
            rc = bt_fail(BT_ERR_NOMEM, "export: out of memory");
        else {
            memcpy(ff, rf->data, (size_t)(hp->head_dim / 2) * sizeof(float));
            hp->rope_type = BT_ROPE_FREQS;
        }
    }
    if (!rc) rc = bt_model_rope_init(m, ff);
    free(ff);
    if (rc) bt_model_free(m);
    return rc;
}

int bt_export_run(const bt_export_opts *o) {
    int dtype = o->dtype;
    if (dtype < 0) dtype = o->format == BT_EXPORT_PEFT || o->format == BT_EXPORT_GGUF_LORA
                               ? BT_EXPORT_F32 : BT_EXPORT_F16;
    if (o->format == BT_EXPORT_PEFT && dtype != BT_EXPORT_F32)
        return bt_fail(BT_ERR_INVALID, "export: the peft format is written in f32 only");
    if (o->format == BT_EXPORT_SAFETENSORS && dtype == BT_EXPORT_Q8_0)
        return bt_fail(BT_ERR_INVALID, "export: safetensors: q8_0 is not supported (f32, f16, bf16)");
    bt_gguf *g = NULL;
    bt_model m;
    memset(&m, 0, sizeof m);
    bt_lora lo;
    memset(&lo, 0, sizeof lo);
    char *base_name = NULL;
    int merged = o->format == BT_EXPORT_GGUF || o->format == BT_EXPORT_SAFETENSORS, rc;
    bt_model_load_opts lopt = {BT_BASE_FP32, 0};
    struct stat st;
    if (!o->model || !o->adapter || !o->out)
        return bt_fail(BT_ERR_INVALID, "export: model, adapter and out are required");
    bt_clean_stale_temps(o->out, "export"); /* an earlier export killed mid-write */
    /* the destination, before anything is loaded: never a file or directory BarqTrain did not
     * write, and one that can be written (trainer/io/outputs.h) */
    rc = o->format == BT_EXPORT_PEFT          ? bt_out_dir_check(o->out, &bt_out_adapter, "export")
         : o->format == BT_EXPORT_SAFETENSORS ? bt_out_dir_check(o->out, &bt_out_export, "export")
                                              : bt_out_file_check(o->out, bt_out_gguf_is_ours, "export");
    if (rc) return rc;
    if (stat(o->model, &st) != 0)
        return bt_fail(BT_ERR_IO, "export: %s: %s", o->model, strerror(errno));
    if (S_ISDIR(st.st_mode)) { /* Hugging Face directory: no GGUF metadata to carry over */
        if ((rc = bt_model_load(&m, o->model, &lopt))) goto out;
        if (o->format == BT_EXPORT_GGUF)
            bt_log(BT_LOG_WARN, "export", "%s is a Hugging Face directory: the merged GGUF gets no "
                   "tokenizer.* metadata (llama.cpp needs it; export from the GGUF base instead)",
                   o->model);
    } else {
        if ((rc = bt_gguf_open(&g, o->model))) {
            rc = bt_fail(rc, "export: %s", bt_last_error_in("export"));
            goto out;
        }
        rc = merged ? bt_model_load_gguf(&m, o->model, &lopt) : shape_model(&m, g, o->model);
        if (rc) goto out;
    }
    if ((rc = bt_lora_load_peft(&lo, &m, o->adapter))) goto out;
    /* an adapter trained with a context extension: the export carries it */
    if ((rc = bt_adapter_apply_context(&m, o->adapter))) goto out;
    base_name = peft_base_name(o->adapter);
    switch (o->format) {
    case BT_EXPORT_PEFT: { /* rsLoRA is normalised to the plain alpha / r rule */
        bt_lora plain = lo;
        plain.alpha = plain_alpha(&lo);
        rc = bt_adapter_save(&plain, base_name, o->out, &m);
        break;
    }
    case BT_EXPORT_GGUF_LORA: rc = bt_export_gguf_lora(&m, &lo, dtype, o->out); break;
    case BT_EXPORT_GGUF: rc = bt_export_gguf_merged(&m, &lo, g, dtype, o->out); break;
    case BT_EXPORT_SAFETENSORS: {
        bt_hf_export_opts ho = {g, g ? NULL : o->model, o->max_shard_bytes};
        rc = bt_export_safetensors_merged(&m, &lo, dtype, &ho, o->out);
        break;
    }
    default: rc = bt_fail(BT_ERR_INVALID, "export: bad format %d", o->format);
    }
    if (!rc) {
        int nmod = 0;
        for (int mod = 0; mod < BT_MOD_N; mod++) nmod += (lo.target_mask >> mod) & 1;
        bt_log(BT_LOG_INFO, "export", "wrote %s (%s) to %s: %d layers x %d modules, r %d, alpha %g%s%s",
               o->format == BT_EXPORT_PEFT ? "peft" : o->format == BT_EXPORT_GGUF_LORA ? "gguf-lora"
               : o->format == BT_EXPORT_GGUF ? "gguf" : "safetensors",
               bt_export_dtype_name(dtype), o->out, lo.n_layer, nmod, lo.r, (double)lo.alpha,
               lo.embed ? ", LoRA+ embed_tokens" : "", lo.norms ? ", LoRA+ norms" : "");
    }
out:
    if (g && bt_gguf_check(g, 0)) rc = bt_fail(BT_ERR_IO, "export: %s", bt_last_error_in("export"));
    free(base_name);
    bt_lora_free(&lo);
    bt_model_free(&m);
    bt_gguf_close(g);
    return rc;
}

const char *bt_export_usage(void) {
    return "usage: trainer export --model BASE.gguf|HF_DIR --adapter ADAPTER_DIR\n"
           "                      --format peft|gguf-lora|gguf|safetensors --out PATH\n"
           "                      [--dtype f32|f16|bf16|q8_0] [--max-shard-size SIZE]\n"
           "  peft         normalised PEFT adapter directory (f32)\n"
           "  gguf-lora    llama.cpp LoRA adapter .gguf (f32 default; f16, bf16, q8_0)\n"
           "  gguf         base + adapter merged, full .gguf of the base's family (llama, qwen2, qwen3,\n"
           "               phi3; f16 default; f32, bf16, q8_0)\n"
           "  safetensors  merged Hugging Face Llama/Mistral/Qwen2/Qwen3/Phi3ForCausalLM directory\n"
           "               (f16 default; f32, bf16):\n"
           "               weights (sharded past --max-shard-size, default 5GB, as save_pretrained),\n"
           "               config.json, generation_config.json, tokenizer.json,\n"
           "               tokenizer_config.json (chat template), special_tokens_map.json\n";
}

int bt_export_main(int argc, char **argv) {
    bt_export_opts o = {NULL, NULL, NULL, -1, -1, 0};
    const char *fmt = NULL, *dt = NULL, *shard = NULL;
    static const struct option opts[] = {
        {"help", no_argument, NULL, 'h'},      {"model", required_argument, NULL, 0},
        {"adapter", required_argument, NULL, 1}, {"format", required_argument, NULL, 2},
        {"out", required_argument, NULL, 3},   {"dtype", required_argument, NULL, 4},
        {"max-shard-size", required_argument, NULL, 5}, {NULL, 0, NULL, 0},
    };
    const char **dst[] = {&o.model, &o.adapter, &fmt, &o.out, &dt, &shard}; /* by the options' values */
    optind = 0;
    opterr = 0;
    int c;
    while ((c = getopt_long(argc, argv, "+:h", opts, NULL)) != -1) {
        if (c == 'h') {
            fputs(bt_export_usage(), stdout);
            return 0;
        }
        if (c < 0 || c > 5) { /* an unknown option, or one without its value */
            fprintf(stderr, "trainer export: unexpected argument \"%s\"\n%s", argv[optind - 1], bt_export_usage());
            return 2;
        }
        *dst[c] = optarg;
    }
    if (optind < argc) {
        fprintf(stderr, "trainer export: unexpected argument \"%s\"\n%s", argv[optind], bt_export_usage());
        return 2;
    }
    if (!o.model || !o.adapter || !fmt || !o.out || !*o.model || !*o.adapter || !*o.out) {
        fprintf(stderr, "trainer export: --model, --adapter, --format and --out are required\n%s",
                bt_export_usage());
        return 2;
    }
    if (bt_export_format_parse(fmt, &o.format) || (dt && bt_export_dtype_parse(dt, &o.dtype)) ||
        (shard && bt_export_parse_size(shard, &o.max_shard_bytes))) {
        fprintf(stderr, "trainer %s\n", bt_last_error());
        return 2;
    }
    if (shard && o.format != BT_EXPORT_SAFETENSORS) { /* a setting it would ignore */
        fprintf(stderr, "trainer export: --max-shard-size applies to --format safetensors only\n");
        return 2;
    }
    int rc = bt_export_run(&o);
    if (rc) {
        fprintf(stderr, "trainer: %s\n", bt_last_error());
        return rc == BT_ERR_INVALID ? 2 : 1;
    }
    printf("export: %s -> %s\n", fmt, o.out);
    return 0;
}
