/* PEFT LoRA adapter loading. See adapter_load.h. */
#include "trainer/io/adapter_load.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/bt_common.h"
#include "common/bt_json.h"
#include "common/quant.h"
#include "common/safetensors.h"
#include "trainer/io/adapter.h"

static int mod_by_name(const char *s) {
    for (int i = 0; i < BT_MOD_N; i++)
        if (!strcmp(s, bt_module_name(i))) return i;
    return -1;
}

/* Phi-3's fused PEFT module names (trainer/model/lora.h): the bits of the group, else 0. */
static unsigned fused_by_name(const char *s) {
    if (!strcmp(s, "qkv_proj")) return (1u << BT_MOD_Q) | (1u << BT_MOD_K) | (1u << BT_MOD_V);
    if (!strcmp(s, "gate_up_proj")) return (1u << BT_MOD_GATE) | (1u << BT_MOD_UP);
    return 0;
}

/* "absent, null, or an empty object/array" */
static int empty_json(json_t *v) {
    return !v || json_is_null(v) || (json_is_object(v) && json_object_size(v) == 0) ||
           (json_is_array(v) && json_array_size(v) == 0);
}

/* LoRA+ modules_to_save entries (adapter.h): bit i = k_mts_names[i] */
enum { MTS_EMBED = 1u << 0, MTS_LM_HEAD = 1u << 1, MTS_IN_NORM = 1u << 2, MTS_POST_NORM = 1u << 3,
       MTS_NORM = 1u << 4, MTS_ANY_NORM = MTS_IN_NORM | MTS_POST_NORM | MTS_NORM };
static const char *const k_mts_names[] = {"embed_tokens", "lm_head", "input_layernorm",
                                          "post_attention_layernorm", "norm"};

static int parse_modules_to_save(json_t *v, const char *path, unsigned *mts) {
    *mts = 0;
    if (empty_json(v)) return 0;
    if (!json_is_array(v))
        return bt_fail(BT_ERR_FORMAT, "adapter: %s: modules_to_save must be a list or null", path);
    size_t i;
    json_t *e;
    json_array_foreach(v, i, e) {
        int k = -1;
        for (int j = 0; j < 5 && json_is_string(e); j++)
            if (!strcmp(json_string_value(e), k_mts_names[j])) k = j;
        if (k < 0)
            return bt_fail(BT_ERR_UNSUPPORTED, "adapter: %s: modules_to_save[%zu] \"%s\" is not "
                           "supported (LoRA+ trains embed_tokens, lm_head when tied to it, "
                           "input_layernorm, post_attention_layernorm, norm)", path, i,
                           json_is_string(e) ? json_string_value(e) : "?");
        *mts |= 1u << k;
    }
    return 0;
}

/* *fused_named: the bits of the fused module names target_modules lists (qkv_proj, gate_up_proj);
 * *plain_named: the bits of the plain names it lists */
static int parse_adapter_config(json_t *root, const char *path, unsigned *fused_named,
                                unsigned *plain_named, int *r, double *alpha,
                                double *dropout, unsigned *mask, int *rslora, unsigned *mts) {
    json_t *v = json_object_get(root, "peft_type");
    if (v && !json_is_null(v) && (!json_is_string(v) || strcmp(json_string_value(v), "LORA")))
        return bt_fail(BT_ERR_UNSUPPORTED, "adapter: %s: peft_type must be \"LORA\"", path);
    v = json_object_get(root, "r");
    if (!v) return bt_fail(BT_ERR_NOTFOUND, "adapter: %s: missing key \"r\"", path);
    /* the job config's limits (trainer/config.h BT_LORA_*): an adapter read from disk is held to
     * the same as one configured */
    if (!json_is_integer(v) || json_integer_value(v) < 1 || json_integer_value(v) > BT_LORA_R_MAX)
        return bt_fail(BT_ERR_FORMAT, "adapter: %s: \"r\" must be an integer in [1, %d] (as lora.r)", path,
                       BT_LORA_R_MAX);
    *r = (int)json_integer_value(v);
    v = json_object_get(root, "lora_alpha");
    if (!v) return bt_fail(BT_ERR_NOTFOUND, "adapter: %s: missing key \"lora_alpha\"", path);
    if (!json_is_number(v) || !(json_number_value(v) > 0) || !(json_number_value(v) <= BT_LORA_ALPHA_MAX)) {
        char got[64];
        if (json_is_number(v)) snprintf(got, sizeof got, "%g", json_number_value(v));
        else snprintf(got, sizeof got, "not a number");
        return bt_fail(BT_ERR_FORMAT, "adapter: %s: \"lora_alpha\" must be a number in (0, %g] (as "
                       "lora.lora_alpha), got %s", path, BT_LORA_ALPHA_MAX, got);
    }
    *alpha = json_number_value(v);
    v = json_object_get(root, "lora_dropout");
    *dropout = 0;
    if (v && !json_is_null(v)) {
        if (!json_is_number(v) || !(json_number_value(v) >= 0 && json_number_value(v) < 1))
            return bt_fail(BT_ERR_FORMAT, "adapter: %s: \"lora_dropout\" must be in [0, 1)", path);
        *dropout = json_number_value(v);
    }
    v = json_object_get(root, "bias");
    if (v && !json_is_null(v) && (!json_is_string(v) || strcmp(json_string_value(v), "none")))
        return bt_fail(BT_ERR_UNSUPPORTED, "adapter: %s: bias must be \"none\" (trained biases are "
                       "not supported)", path);
    static const char *const must_false[] = {"use_dora", "fan_in_fan_out"};
    for (size_t i = 0; i < sizeof must_false / sizeof *must_false; i++) {
        v = json_object_get(root, must_false[i]);
        if (v && !json_is_null(v) && !json_is_false(v))
            return bt_fail(BT_ERR_UNSUPPORTED, "adapter: %s: %s must be false", path,
                           must_false[i]);
    }
    static const char *const must_empty[] = {"layers_to_transform", "rank_pattern",
                                             "alpha_pattern"};
    for (size_t i = 0; i < sizeof must_empty / sizeof *must_empty; i++)
        if (!empty_json(json_object_get(root, must_empty[i])))
            return bt_fail(BT_ERR_UNSUPPORTED, "adapter: %s: %s must be null or empty", path,
                           must_empty[i]);
    int rc = parse_modules_to_save(json_object_get(root, "modules_to_save"), path, mts);
    if (rc) return rc;
    v = json_object_get(root, "use_rslora");
    *rslora = json_is_true(v);
    if (v && !json_is_null(v) && !json_is_boolean(v))
        return bt_fail(BT_ERR_FORMAT, "adapter: %s: use_rslora must be true or false", path);
    v = json_object_get(root, "target_modules");
    *mask = 0;
    *fused_named = *plain_named = 0;
    if (!v) return bt_fail(BT_ERR_NOTFOUND, "adapter: %s: missing key \"target_modules\"", path);
    if (json_is_string(v)) {
        const char *s = json_string_value(v);
        if (!strcmp(s, "all-linear")) *mask = (1u << BT_MOD_N) - 1;
        else if (mod_by_name(s) >= 0) *mask = *plain_named = 1u << mod_by_name(s);
        else if (fused_by_name(s)) *mask = *fused_named = fused_by_name(s);
        else
            return bt_fail(BT_ERR_UNSUPPORTED, "adapter: %s: target_modules \"%s\" (a regex?) is "
                           "not supported: list module names", path, s);
    } else if (json_is_array(v)) {
        size_t i;
        json_t *e;
        json_array_foreach(v, i, e) {
            int mod = json_is_string(e) ? mod_by_name(json_string_value(e)) : -1;
            unsigned fb = mod < 0 && json_is_string(e) ? fused_by_name(json_string_value(e)) : 0;
            if (fb) {
                *mask |= fb;
                *fused_named |= fb;
                continue;
            }
            if (mod < 0)
                return bt_fail(BT_ERR_UNSUPPORTED, "adapter: %s: target_modules[%zu] \"%s\" is not "
                               "one of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
                               "down_proj, qkv_proj, gate_up_proj", path, i,
                               json_is_string(e) ? json_string_value(e) : "?");
            *mask |= 1u << mod;
            *plain_named |= 1u << mod;
        }
    } else {
        return bt_fail(BT_ERR_FORMAT, "adapter: %s: target_modules must be a list or a string",
                       path);
    }
    if (!*mask) return bt_fail(BT_ERR_FORMAT, "adapter: %s: target_modules is empty", path);
    return 0;
}

/* Copy tensor t (F32/F16/BF16, shape [d0, d1], or [d1] when d0 == 0) into dst as fp32. */
static int read_mat(float *dst, const bt_st_tensor *t, int d0, int d1, const char *path) {
    int nd = d0 ? 2 : 1;
    if (!d0) d0 = 1;
    if (t->n_dims != nd || (nd == 2 && (t->shape[0] != d0 || t->shape[1] != d1)) ||
        (nd == 1 && t->shape[0] != d1)) {
        char got[64] = "", want[32];
        for (int i = 0; i < t->n_dims && i < 4; i++)
            snprintf(got + strlen(got), sizeof got - strlen(got), "%s%lld", i ? ", " : "",
                     (long long)t->shape[i]);
        if (nd == 2) snprintf(want, sizeof want, "[%d, %d]", d0, d1);
        else snprintf(want, sizeof want, "[%d]", d1);
        return bt_fail(BT_ERR_FORMAT, "adapter: %s: tensor %s has shape [%s%s], expected %s", path,
                       t->name, got, t->n_dims > 4 ? ", ..." : "", want);
    }
    int64_t n = (int64_t)d0 * d1;
    const uint8_t *src = t->data;
    if (t->dtype == BT_ST_F32) memcpy(dst, src, (size_t)n * 4);
    else if (t->dtype == BT_ST_F16 || t->dtype == BT_ST_BF16)
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, src + 2 * i, 2);
            dst[i] = t->dtype == BT_ST_F16 ? bt_fp16_to_fp32(h) : bt_bf16_to_fp32(h);
        }
    else
        return bt_fail(BT_ERR_UNSUPPORTED, "adapter: %s: tensor %s has dtype %s (F32, F16, BF16)",
                       path, t->name, bt_st_dtype_name(t->dtype));
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(dst[i]))
            return bt_fail(BT_ERR_FORMAT, "adapter: %s: tensor %s: non-finite value at element %lld",
                           path, t->name, (long long)i);
    return 0;
}

/* PEFT modules_to_save keys of the LoRA+ tensors (adapter.h). Norm `which`: 0 input_layernorm,
 * 1 post_attention_layernorm of layer l; l == n_layer: the final model.norm. */
#define KEY_EMBED "base_model.model.model.embed_tokens.weight"
#define KEY_LM_HEAD "base_model.model.lm_head.weight"
static void norm_key(char *buf, size_t n, int n_layer, int l, int which) {
    if (l == n_layer) snprintf(buf, n, "base_model.model.model.norm.weight");
    else snprintf(buf, n, "base_model.model.model.layers.%d.%s.weight", l,
                  which ? "post_attention_layernorm" : "input_layernorm");
}

/* 1 if `nm` is a tensor this adapter may hold (LoRA A/B of a targeted module, or a LoRA+ tensor
 * of its modules_to_save). */
static int known_tensor(const bt_lora *lo, unsigned mts, const char *nm) {
    char key[160];
    if (lo->embed && !strcmp(nm, KEY_EMBED)) return 1;
    if ((mts & MTS_LM_HEAD) && !strcmp(nm, KEY_LM_HEAD)) return 1;
    for (int l = 0; l < lo->n_layer; l++) {
        bt_lora_peft_mod u;
        for (int mod = 0; mod < BT_MOD_N; mod++)
            for (int isB = 0; isB < 2 && bt_lora_peft_get(lo, l, mod, &u); isB++) {
                bt_adapter_peft_key(key, sizeof key, l, &u, isB);
                if (!strcmp(key, nm)) return 1;
            }
        for (int which = 0; which < 2 && lo->norms; which++) {
            norm_key(key, sizeof key, lo->n_layer, l, which);
            if (!strcmp(key, nm)) return 1;
        }
    }
    norm_key(key, sizeof key, lo->n_layer, lo->n_layer, 0);
    return lo->norms && !strcmp(key, nm);
}

/* The LoRA+ tensors of modules_to_save `mts` into lo->embed / lo->norms (already holding the
 * base's values where the model has weights). *n_read counts the tensors read. */
static int load_dense(bt_lora *lo, const bt_model *m, unsigned mts, bt_st_file *f,
                      const char *wpath, int *n_read) {
    const int D = lo->d_model, V = lo->vocab;
    int rc = 0;
    if (lo->embed) {
        const bt_st_tensor *t = bt_st_find(f, KEY_EMBED);
        if (!t)
            return bt_fail(BT_ERR_NOTFOUND, "adapter: %s: missing tensor %s (modules_to_save lists "
                           "embed_tokens)", wpath, KEY_EMBED);
        if ((rc = read_mat(lo->embed, t, V, D, wpath))) return rc;
        (*n_read)++;
    }
    if (mts & MTS_LM_HEAD) { /* tied (checked by the caller): must be the embedding itself */
        const bt_st_tensor *t = bt_st_find(f, KEY_LM_HEAD);
        if (!t)
            return bt_fail(BT_ERR_NOTFOUND, "adapter: %s: missing tensor %s (modules_to_save lists "
                           "lm_head)", wpath, KEY_LM_HEAD);
        float *h = malloc((size_t)V * D * sizeof(float));
        if (!h) return bt_fail(BT_ERR_NOMEM, "adapter: out of memory");
        rc = read_mat(h, t, V, D, wpath);
        if (!rc && memcmp(h, lo->embed, (size_t)V * D * sizeof(float)) != 0)
            rc = bt_fail(BT_ERR_UNSUPPORTED, "adapter: %s: %s differs from %s: the base ties "
                         "lm_head to embed_tokens, so they cannot be trained apart", wpath,
                         KEY_LM_HEAD, KEY_EMBED);
        free(h);
        if (rc) return rc;
        (*n_read)++;
    }
    char key[160];
    for (int l = 0; lo->norms && l <= lo->n_layer; l++)
        for (int which = 0; which < (l == lo->n_layer ? 1 : 2); which++) {
            unsigned need = l == lo->n_layer ? MTS_NORM : which ? MTS_POST_NORM : MTS_IN_NORM;
            const bt_layer *L = l < lo->n_layer && m->layers ? &m->layers[l] : NULL;
            const float *base = l == lo->n_layer ? m->output_norm
                                : L ? (which ? L->ffn_norm : L->attn_norm) : NULL;
            norm_key(key, sizeof key, lo->n_layer, l, which);
            const bt_st_tensor *t = bt_st_find(f, key);
            if (!t) {
                /* PEFT matches modules_to_save by suffix, so a tensor of an unlisted norm is
                 * optional: it keeps the base's value, which a shape-only model lacks */
                if (!(mts & need) && base) continue;
                return bt_fail(BT_ERR_NOTFOUND, "adapter: %s: missing tensor %s (%s)", wpath, key,
                               mts & need ? "modules_to_save lists it"
                                          : "the base model's weights are not loaded to fill it");
            }
            if ((rc = read_mat(lo->norms + (size_t)(l == lo->n_layer ? 2 * l : 2 * l + which) * D,
                               t, 0, D, wpath)))
                return rc;
            (*n_read)++;
        }
    return 0;
}

int bt_lora_load_peft(bt_lora *lo, const bt_model *m, const char *dir) {
    memset(lo, 0, sizeof *lo);
    if (!dir || !m || !m->layers) return bt_fail(BT_ERR_INVALID, "adapter: NULL argument");
    size_t n = strlen(dir) + 32;
    char *cpath = bt_xmalloc(n), *wpath = bt_xmalloc(n);
    snprintf(cpath, n, "%s/adapter_config.json", dir);
    snprintf(wpath, n, "%s/adapter_model.safetensors", dir);
    bt_st_file *f = NULL;
    json_t *root = NULL;
    int rc;
    struct stat st;
    if (stat(cpath, &st) != 0) {
        rc = bt_fail(BT_ERR_NOTFOUND, "adapter: %s: missing (not a PEFT adapter directory?)", cpath);
        goto out;
    }
    if ((rc = bt_json_load_file(&root, cpath, 0, 16u << 20))) {
        rc = bt_fail(rc, "adapter: %s", bt_last_error_in("adapter"));
        goto out;
    }
    if (!json_is_object(root)) {
        rc = bt_fail(BT_ERR_FORMAT, "adapter: %s: not a JSON object", cpath);
        goto out;
    }
    int r = 0, rslora = 0;
    double alpha = 0, dropout = 0;
    unsigned mask = 0, mts = 0, fused_named = 0, plain_named = 0;
    if ((rc = parse_adapter_config(root, cpath, &fused_named, &plain_named, &r, &alpha, &dropout,
                                   &mask, &rslora, &mts)))
        goto out;
    /* qkv_proj / gate_up_proj exist in Phi-3 only, and there q/k/v/gate/up do not (PEFT finds
     * the modules by name: trainer/model/lora.h) */
    const unsigned parts = (1u << BT_MOD_Q) | (1u << BT_MOD_K) | (1u << BT_MOD_V) |
                           (1u << BT_MOD_GATE) | (1u << BT_MOD_UP);
    if (fused_named && m->hp.arch != BT_ARCH_PHI3) {
        rc = bt_fail(BT_ERR_UNSUPPORTED, "adapter: %s: target_modules names %s, Phi-3's fused "
                     "module, but the base is a %s model (separate q_proj, k_proj, v_proj, "
                     "gate_proj, up_proj): an adapter for another family", cpath,
                     (fused_named & (1u << BT_MOD_Q)) ? "qkv_proj" : "gate_up_proj",
                     bt_arch_name(m->hp.arch));
        goto out;
    }
    if ((plain_named & parts) && m->hp.arch == BT_ARCH_PHI3) {
        int bad = 0;
        while (!((plain_named & parts) & (1u << bad))) bad++;
        rc = bt_fail(BT_ERR_UNSUPPORTED, "adapter: %s: target_modules names %s, which a Phi-3 "
                     "base does not have (it fuses them into qkv_proj and gate_up_proj): an "
                     "adapter for another family", cpath, bt_module_name(bad));
        goto out;
    }
    if ((mts & MTS_LM_HEAD) && !m->tied) {
        rc = bt_fail(BT_ERR_UNSUPPORTED, "adapter: %s: modules_to_save lists lm_head, but the base's "
                     "lm_head is not tied to embed_tokens: a separately trained lm_head is not "
                     "supported (LoRA+ trains embed_tokens and the norms)", cpath);
        goto out;
    }
    if ((mts & MTS_LM_HEAD) && !(mts & MTS_EMBED)) {
        rc = bt_fail(BT_ERR_UNSUPPORTED, "adapter: %s: modules_to_save lists lm_head without "
                     "embed_tokens: the base ties them, so lm_head cannot be trained alone", cpath);
        goto out;
    }
    unsigned trainable = ((mts & MTS_EMBED) ? BT_TRAIN_EMBED : 0) |
                         ((mts & MTS_ANY_NORM) ? BT_TRAIN_NORM : 0);
    if ((rc = bt_st_open(&f, wpath))) {
        if (stat(wpath, &st) != 0)
            rc = bt_fail(BT_ERR_NOTFOUND, "adapter: %s: missing (adapter_model.bin is not "
                         "supported)", wpath);
        else rc = bt_fail(rc, "adapter: %s", bt_last_error_in("adapter"));
        goto out;
    }
    if (trainable && (m->hp.vocab < 1 || m->hp.d_model < 1)) {
        rc = bt_fail(BT_ERR_INVALID, "adapter: %s: the model's vocab / d_model are unknown, needed "
                     "for modules_to_save", cpath);
        goto out;
    }
    if ((rc = bt_lora_init(lo, m, r, alpha, dropout, mask, trainable, 0))) goto out;
    if (rslora) lo->scale = (float)(alpha / sqrt((double)r));
    char key[160];
    int expected = 0;
    for (int l = 0; l < lo->n_layer && !rc; l++)
        for (int mod = 0; mod < BT_MOD_N && !rc; mod++) {
            bt_lora_peft_mod u; /* Phi-3's fused groups: one A, the fused B */
            if (!bt_lora_peft_get(lo, l, mod, &u)) continue;
            for (int isB = 0; isB < 2 && !rc; isB++) {
                bt_adapter_peft_key(key, sizeof key, l, &u, isB);
                const bt_st_tensor *t = bt_st_find(f, key);
                if (!t) {
                    rc = bt_fail(BT_ERR_NOTFOUND, "adapter: %s: missing tensor %s", wpath, key);
                    break;
                }
                rc = isB ? read_mat(u.B, t, u.out, r, wpath) : read_mat(u.A, t, r, u.in, wpath);
                expected++;
            }
        }
    if (!rc && trainable) rc = load_dense(lo, m, mts, f, wpath, &expected);
    if (!rc && bt_st_n_tensors(f) != expected) {
        /* name the first tensor that is not one of ours */
        for (int i = 0; i < bt_st_n_tensors(f); i++) {
            const char *nm = bt_st_tensor_at(f, i)->name;
            if (!known_tensor(lo, mts, nm)) {
                rc = bt_fail(BT_ERR_FORMAT, "adapter: %s: unexpected tensor %s (layers %d, "
                             "target_modules mask %#x, modules_to_save %s)", wpath, nm, lo->n_layer,
                             mask, mts ? "as listed" : "none");
                break;
            }
        }
        if (!rc) /* every name is ours, so one appears twice */
            rc = bt_fail(BT_ERR_FORMAT, "adapter: %s: %d tensors, expected %d", wpath,
                         bt_st_n_tensors(f), expected);
    }
out:
    if (f && bt_st_check(f, 0)) rc = bt_fail(BT_ERR_IO, "adapter: %s", bt_last_error_in("adapter"));
    if (rc) bt_lora_free(lo);
    bt_st_close(f);
    json_decref(root);
    free(cpath);
    free(wpath);
    return rc;
}

int bt_adapter_context_extension(const char *dir, int *method, int *target_length) {
    *method = BT_ROPE_EXT_NONE;
    *target_length = 0;
    char *path = NULL;
    if (asprintf(&path, "%s/adapter_config.json", dir) < 0)
        return bt_fail(BT_ERR_NOMEM, "adapter: out of memory");
    json_t *root = NULL; /* read with a size limit, like every file read whole (issue 21 §11) */
    int rc = bt_json_load_file(&root, path, 0, 16u << 20);
    if (rc) {
        rc = bt_fail(rc, "adapter: %s", bt_last_error_in("adapter"));
    } else {
        json_t *n = json_object_get(root, "barqtrain_context_extension");
        if (n && !json_is_null(n)) {
            const char *meth = json_string_value(json_object_get(n, "method"));
            json_t *t = json_object_get(n, "target_length");
            int m = bt_rope_ext_parse(meth);
            json_int_t tl = json_is_integer(t) ? json_integer_value(t) : 0;
            if (!json_is_object(n) || m < 0 || tl < 2 || tl > (1 << 24))
                rc = bt_fail(BT_ERR_FORMAT, "adapter: %s: barqtrain_context_extension needs method "
                             "\"linear\", \"yarn\" or \"dynamic\" and an integer target_length in "
                             "[2, 16777216]", path);
            else {
                *method = m;
                *target_length = (int)tl;
            }
        }
    }
    json_decref(root);
    free(path);
    return rc;
}

int bt_adapter_apply_context(bt_model *m, const char *dir) {
    int method, target, rc;
    if ((rc = bt_adapter_context_extension(dir, &method, &target))) return rc;
    if (method == BT_ROPE_EXT_NONE) return 0;
    const int before = m->hp.ctx;
    if ((rc = bt_model_extend_context(m, method, target)))
        return bt_fail(rc, "adapter %s was trained with context_extension %s to %d: %s", dir,
                       bt_rope_ext_name(method), target, bt_last_error());
    if (m->ctx_extended)
        bt_log(BT_LOG_INFO, "adapter", "%s: the base's context is extended %d -> %d (%s RoPE "
               "scaling, factor %g) as the adapter was trained", dir, before, m->hp.ctx,
               bt_rope_ext_name(method), (double)m->hp.rope_ext_factor);
    return 0;
}
