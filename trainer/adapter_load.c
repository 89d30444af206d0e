/* PEFT LoRA adapter loading. See adapter_load.h. */
#include "trainer/adapter_load.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/bt_common.h"
#include "common/quant.h"
#include "common/safetensors.h"
#include "trainer/adapter.h"

static int mod_by_name(const char *s) {
    for (int i = 0; i < BT_MOD_N; i++)
        if (!strcmp(s, bt_module_name(i))) return i;
    return -1;
}

/* "absent, null, or an empty object/array" */
static int empty_json(json_t *v) {
    return !v || json_is_null(v) || (json_is_object(v) && json_object_size(v) == 0) ||
           (json_is_array(v) && json_array_size(v) == 0);
}

static int parse_adapter_config(json_t *root, const char *path, int *r, double *alpha,
                                double *dropout, unsigned *mask, int *rslora) {
    json_t *v = json_object_get(root, "peft_type");
    if (v && !json_is_null(v) && (!json_is_string(v) || strcmp(json_string_value(v), "LORA")))
        return bt_fail(BT_ERR_UNSUPPORTED, "adapter: %s: peft_type must be \"LORA\"", path);
    v = json_object_get(root, "r");
    if (!v) return bt_fail(BT_ERR_NOTFOUND, "adapter: %s: missing key \"r\"", path);
    if (!json_is_integer(v) || json_integer_value(v) < 1 || json_integer_value(v) > 65536)
        return bt_fail(BT_ERR_FORMAT, "adapter: %s: \"r\" must be an integer in [1, 65536]", path);
    *r = (int)json_integer_value(v);
    v = json_object_get(root, "lora_alpha");
    if (!v) return bt_fail(BT_ERR_NOTFOUND, "adapter: %s: missing key \"lora_alpha\"", path);
    if (!json_is_number(v) || !(json_number_value(v) > 0) || !isfinite(json_number_value(v)))
        return bt_fail(BT_ERR_FORMAT, "adapter: %s: \"lora_alpha\" must be a number > 0", path);
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
                                             "alpha_pattern", "modules_to_save"};
    for (size_t i = 0; i < sizeof must_empty / sizeof *must_empty; i++)
        if (!empty_json(json_object_get(root, must_empty[i])))
            return bt_fail(BT_ERR_UNSUPPORTED, "adapter: %s: %s must be null or empty", path,
                           must_empty[i]);
    v = json_object_get(root, "use_rslora");
    *rslora = json_is_true(v);
    if (v && !json_is_null(v) && !json_is_boolean(v))
        return bt_fail(BT_ERR_FORMAT, "adapter: %s: use_rslora must be true or false", path);
    v = json_object_get(root, "target_modules");
    *mask = 0;
    if (!v) return bt_fail(BT_ERR_NOTFOUND, "adapter: %s: missing key \"target_modules\"", path);
    if (json_is_string(v)) {
        const char *s = json_string_value(v);
        if (!strcmp(s, "all-linear")) *mask = (1u << BT_MOD_N) - 1;
        else if (mod_by_name(s) >= 0) *mask = 1u << mod_by_name(s);
        else
            return bt_fail(BT_ERR_UNSUPPORTED, "adapter: %s: target_modules \"%s\" (a regex?) is "
                           "not supported: list module names", path, s);
    } else if (json_is_array(v)) {
        size_t i;
        json_t *e;
        json_array_foreach(v, i, e) {
            int mod = json_is_string(e) ? mod_by_name(json_string_value(e)) : -1;
            if (mod < 0)
                return bt_fail(BT_ERR_UNSUPPORTED, "adapter: %s: target_modules[%zu] \"%s\" is not "
                               "one of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
                               "down_proj", path, i, json_is_string(e) ? json_string_value(e) : "?");
            *mask |= 1u << mod;
        }
    } else {
        return bt_fail(BT_ERR_FORMAT, "adapter: %s: target_modules must be a list or a string",
                       path);
    }
    if (!*mask) return bt_fail(BT_ERR_FORMAT, "adapter: %s: target_modules is empty", path);
    return 0;
}

/* Copy tensor t (F32/F16/BF16, shape [d0, d1]) into dst as fp32. */
static int read_mat(float *dst, const bt_st_tensor *t, int d0, int d1, const char *path) {
    if (t->n_dims != 2 || t->shape[0] != d0 || t->shape[1] != d1)
        return bt_fail(BT_ERR_FORMAT, "adapter: %s: tensor %s has shape [%lld%s%lld], expected "
                       "[%d, %d]", path, t->name, (long long)(t->n_dims > 0 ? t->shape[0] : 0),
                       t->n_dims == 2 ? ", " : " ... ", (long long)(t->n_dims > 1 ? t->shape[1] : 0),
                       d0, d1);
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

int bt_lora_load_peft(bt_lora *lo, const bt_model *m, const char *dir) {
    memset(lo, 0, sizeof *lo);
    if (!dir || !m || !m->layers) return bt_fail(BT_ERR_INVALID, "adapter: NULL argument");
    size_t n = strlen(dir) + 32;
    char *cpath = bt_xmalloc(n), *wpath = bt_xmalloc(n);
    snprintf(cpath, n, "%s/adapter_config.json", dir);
    snprintf(wpath, n, "%s/adapter_model.safetensors", dir);
    bt_st_file *f = NULL;
    json_error_t je;
    json_t *root = json_load_file(cpath, 0, &je);
    int rc;
    struct stat st;
    if (!root) {
        rc = stat(cpath, &st) != 0
                 ? bt_fail(BT_ERR_NOTFOUND, "adapter: %s: missing (not a PEFT adapter directory?)",
                           cpath)
                 : bt_fail(BT_ERR_FORMAT, "adapter: %s: line %d: %s", cpath, je.line, je.text);
        goto out;
    }
    if (!json_is_object(root)) {
        rc = bt_fail(BT_ERR_FORMAT, "adapter: %s: not a JSON object", cpath);
        goto out;
    }
    int r = 0, rslora = 0;
    double alpha = 0, dropout = 0;
    unsigned mask = 0;
    if ((rc = parse_adapter_config(root, cpath, &r, &alpha, &dropout, &mask, &rslora))) goto out;
    if ((rc = bt_st_open(&f, wpath))) {
        if (stat(wpath, &st) != 0)
            rc = bt_fail(BT_ERR_NOTFOUND, "adapter: %s: missing (adapter_model.bin is not "
                         "supported)", wpath);
        else rc = bt_fail(rc, "adapter: %s", bt_last_error());
        goto out;
    }
    if ((rc = bt_lora_init(lo, m, r, alpha, dropout, mask, 0))) goto out;
    if (rslora) lo->scale = (float)(alpha / sqrt((double)r));
    char key[160];
    int expected = 0;
    for (int l = 0; l < lo->n_layer && !rc; l++)
        for (int mod = 0; mod < BT_MOD_N && !rc; mod++) {
            bt_lora_mod *md = &lo->mods[l * BT_MOD_N + mod];
            if (!md->A) continue;
            for (int isB = 0; isB < 2 && !rc; isB++) {
                bt_adapter_key(key, sizeof key, l, mod, isB);
                const bt_st_tensor *t = bt_st_find(f, key);
                if (!t) {
                    rc = bt_fail(BT_ERR_NOTFOUND, "adapter: %s: missing tensor %s", wpath, key);
                    break;
                }
                rc = isB ? read_mat(md->B, t, md->out, r, wpath) : read_mat(md->A, t, r, md->in, wpath);
                expected++;
            }
        }
    if (!rc && bt_st_n_tensors(f) != expected) {
        /* name the first tensor that is not one of ours */
        for (int i = 0; i < bt_st_n_tensors(f); i++) {
            const char *nm = bt_st_tensor_at(f, i)->name;
            int ours = 0;
            for (int l = 0; l < lo->n_layer && !ours; l++)
                for (int mod = 0; mod < BT_MOD_N && !ours; mod++)
                    for (int isB = 0; isB < 2 && !ours && bt_lora_get(lo, l, mod); isB++) {
                        bt_adapter_key(key, sizeof key, l, mod, isB);
                        ours = !strcmp(key, nm);
                    }
            if (!ours) {
                rc = bt_fail(BT_ERR_FORMAT, "adapter: %s: unexpected tensor %s (layers %d, "
                             "target_modules mask %#x)", wpath, nm, lo->n_layer, mask);
                break;
            }
        }
    }
out:
    if (rc) bt_lora_free(lo);
    bt_st_close(f);
    json_decref(root);
    free(cpath);
    free(wpath);
    return rc;
}
