/* PEFT adapter writer. See adapter.h. */
#include "trainer/io/adapter.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/atomic_io.h"
#include "common/bt_common.h"
#include "common/out_dir.h"
#include "common/safetensors.h"
#include "trainer/io/export.h"
#include "trainer/io/outputs.h"

void bt_adapter_key(char *buf, size_t n, int layer, int mod, int is_B) {
    const char *blk = mod <= BT_MOD_O ? "self_attn" : "mlp";
    snprintf(buf, n, "base_model.model.model.layers.%d.%s.%s.lora_%c.weight", layer, blk,
             bt_module_name(mod), is_B ? 'B' : 'A');
}

void bt_adapter_peft_key(char *buf, size_t n, int layer, const bt_lora_peft_mod *u, int is_B) {
    const char *blk = u->first_mod <= BT_MOD_O ? "self_attn" : "mlp";
    snprintf(buf, n, "base_model.model.model.layers.%d.%s.%s.lora_%c.weight", layer, blk, u->name,
             is_B ? 'B' : 'A');
}

/* mkdir -p of every parent of `path` (not path itself). */
static int mkdir_parents(const char *path) {
    char *p = bt_xstrdup(path);
    for (char *s = p + 1; *s; s++) {
        if (*s != '/') continue;
        *s = 0;
        if (mkdir(p, 0755) != 0 && errno != EEXIST) {
            int e = errno;
            int rc = bt_fail(BT_ERR_IO, "adapter: mkdir %s: %s", p, strerror(e));
            free(p);
            return rc;
        }
        *s = '/';
    }
    free(p);
    return 0;
}

/* adapter_config.json "barqtrain_context_extension": the RoPE context extension the adapter was
 * trained with (see adapter.h). NULL when the model carries none from the job. */
static json_t *context_note(const bt_model *m) {
    if (!m || !m->ctx_extended) return NULL;
    const bt_llama_hparams *hp = &m->hp;
    json_t *rs = NULL;
    int max_pos = hp->ctx;
    json_t *n = json_object();
    json_object_set_new(n, "method", json_string(bt_rope_ext_name(hp->rope_ext)));
    json_object_set_new(n, "target_length", json_integer(hp->ctx));
    json_object_set_new(n, "original_length", json_integer(hp->rope_ext_orig_ctx));
    json_object_set_new(n, "factor", json_real(hp->rope_ext_factor));
    if (bt_export_hf_rope(m, &rs, &max_pos) == 0) { /* what transformers needs on the base */
        json_object_set_new(n, "rope_scaling", rs);
        json_object_set_new(n, "max_position_embeddings", json_integer(max_pos));
        json_object_set_new(n, "rope_theta", json_real(hp->rope_theta));
    }
    json_object_set_new(n, "note", json_string(
        "Trained by BarqTrain on the base with its RoPE context extended (context_extension). "
        "Load the base with these rope_scaling and max_position_embeddings (transformers 4: "
        "AutoModelForCausalLM.from_pretrained(base, rope_scaling=..., max_position_embeddings=...); "
        "transformers 5: rope_parameters = rope_scaling plus rope_theta) before applying the adapter; `trainer export` / `generate` apply it themselves and write "
        "it into merged exports. PEFT before 0.14 refuses unknown adapter_config keys: delete "
        "this one to load the adapter with those versions."));
    return n;
}

const char *const bt_adapter_config_keys[] = {
    "peft_type", "task_type", "base_model_name_or_path", "revision", "r", "lora_alpha", "lora_dropout",
    "target_modules", "bias", "fan_in_fan_out", "inference_mode", "init_lora_weights", "modules_to_save",
    "layers_to_transform", "layers_pattern", "rank_pattern", "alpha_pattern", "use_rslora", "use_dora", NULL};

static int write_config(const bt_lora *lo, const char *base_model, const char *path,
                        const bt_model *m) {
    json_t *tm = json_array();
    for (int mod = 0; mod < BT_MOD_N; mod++) {
        if (!(lo->target_mask & (1u << mod))) continue;
        const char *fn = lo->fused ? bt_lora_fused_name(BT_ARCH_PHI3, mod) : NULL;
        if (fn && mod != BT_MOD_Q && mod != BT_MOD_GATE) continue; /* listed at its first module */
        json_array_append_new(tm, json_string(fn ? fn : bt_module_name(mod)));
    }
    json_t *j = json_object();
    json_object_set_new(j, "peft_type", json_string("LORA"));
    json_object_set_new(j, "task_type", json_string("CAUSAL_LM"));
    json_object_set_new(j, "base_model_name_or_path", json_string(base_model));
    json_object_set_new(j, "revision", json_null());
    json_object_set_new(j, "r", json_integer(lo->r));
    /* lora_alpha: integral values are written as integers, as PEFT configs usually carry them. */
    if (lo->alpha == (float)(int64_t)lo->alpha)
        json_object_set_new(j, "lora_alpha", json_integer((json_int_t)lo->alpha));
    else
        json_object_set_new(j, "lora_alpha", json_real(lo->alpha));
    char dbuf[32]; /* the float's shortest decimal (0.05, not 0.0500000007) */
    snprintf(dbuf, sizeof dbuf, "%.7g", (double)lo->dropout);
    json_object_set_new(j, "lora_dropout", json_real(strtod(dbuf, NULL)));
    json_object_set_new(j, "target_modules", tm);
    json_object_set_new(j, "bias", json_string("none"));
    json_object_set_new(j, "fan_in_fan_out", json_false());
    json_object_set_new(j, "inference_mode", json_true());
    json_object_set_new(j, "init_lora_weights", json_true());
    json_t *mts = json_null(); /* LoRA+ dense modules (adapter.h) */
    if (lo->trainable) {
        mts = json_array();
        if (lo->trainable & BT_TRAIN_EMBED) {
            json_array_append_new(mts, json_string("embed_tokens"));
            if (lo->tied) json_array_append_new(mts, json_string("lm_head"));
        }
        if (lo->trainable & BT_TRAIN_NORM) {
            json_array_append_new(mts, json_string("input_layernorm"));
            json_array_append_new(mts, json_string("post_attention_layernorm"));
            json_array_append_new(mts, json_string("norm"));
        }
    }
    json_object_set_new(j, "modules_to_save", mts);
    json_object_set_new(j, "layers_to_transform", json_null());
    json_object_set_new(j, "layers_pattern", json_null());
    json_object_set_new(j, "rank_pattern", json_object());
    json_object_set_new(j, "alpha_pattern", json_object());
    json_object_set_new(j, "use_rslora", json_false());
    json_object_set_new(j, "use_dora", json_false());
    json_t *note = context_note(m);
    if (note) json_object_set_new(j, "barqtrain_context_extension", note);
    char *s = json_dumps(j, JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(10));
    json_decref(j);
    if (!s) return bt_fail(BT_ERR_NOMEM, "adapter: out of memory");
    int rc = 0;
    FILE *f = fopen(path, "wb");
    if (!f) rc = bt_fail(BT_ERR_IO, "adapter: create %s: %s", path, strerror(errno));
    else {
        size_t n = strlen(s);
        if (fwrite(s, 1, n, f) != n || fputc('\n', f) == EOF || fflush(f) != 0 ||
            fsync(fileno(f)) != 0)
            rc = bt_fail(BT_ERR_IO, "adapter: write %s: %s", path, strerror(errno));
        if (fclose(f) != 0 && rc == 0)
            rc = bt_fail(BT_ERR_IO, "adapter: close %s: %s", path, strerror(errno));
    }
    free(s);
    return rc;
}

static int write_weights(const bt_lora *lo, const char *path) {
    bt_st_writer *w = bt_st_writer_new();
    if (!w) return bt_fail(BT_ERR_NOMEM, "adapter: out of memory");
    int rc = bt_st_w_metadata(w, "format", "pt");
    char key[160];
    for (int l = 0; l < lo->n_layer && rc == 0; l++)
        for (int mod = 0; mod < BT_MOD_N && rc == 0; mod++) {
            bt_lora_peft_mod u; /* Phi-3's fused groups: one A, the fused B */
            if (!bt_lora_peft_get(lo, l, mod, &u)) continue;
            int64_t sa[2] = {lo->r, u.in}, sb[2] = {u.out, lo->r};
            bt_adapter_peft_key(key, sizeof key, l, &u, 0);
            rc = bt_st_w_tensor(w, key, BT_ST_F32, 2, sa, u.A, (size_t)lo->r * u.in * 4);
            if (rc) break;
            bt_adapter_peft_key(key, sizeof key, l, &u, 1);
            rc = bt_st_w_tensor(w, key, BT_ST_F32, 2, sb, u.B, (size_t)u.out * lo->r * 4);
        }
    /* LoRA+ dense modules, under PEFT's modules_to_save keys (get_peft_model_state_dict strips
     * "modules_to_save." and the adapter name: <module>.weight) */
    if (rc == 0 && lo->embed) {
        int64_t se[2] = {lo->vocab, lo->d_model};
        size_t nb = (size_t)lo->vocab * lo->d_model * 4;
        rc = bt_st_w_tensor(w, "base_model.model.model.embed_tokens.weight", BT_ST_F32, 2, se,
                            lo->embed, nb);
        if (rc == 0 && lo->tied)
            rc = bt_st_w_tensor(w, "base_model.model.lm_head.weight", BT_ST_F32, 2, se, lo->embed, nb);
    }
    for (int l = 0; rc == 0 && lo->norms && l <= lo->n_layer; l++) {
        int64_t sn[1] = {lo->d_model};
        size_t nb = (size_t)lo->d_model * 4;
        if (l == lo->n_layer) {
            rc = bt_st_w_tensor(w, "base_model.model.model.norm.weight", BT_ST_F32, 1, sn,
                                lo->norms + (size_t)2 * l * lo->d_model, nb);
            break;
        }
        snprintf(key, sizeof key, "base_model.model.model.layers.%d.input_layernorm.weight", l);
        rc = bt_st_w_tensor(w, key, BT_ST_F32, 1, sn, lo->norms + (size_t)2 * l * lo->d_model, nb);
        if (rc) break;
        snprintf(key, sizeof key, "base_model.model.model.layers.%d.post_attention_layernorm.weight",
                 l);
        rc = bt_st_w_tensor(w, key, BT_ST_F32, 1, sn, lo->norms + (size_t)(2 * l + 1) * lo->d_model,
                            nb);
    }
    if (rc == 0) rc = bt_st_writer_write(w, path);
    bt_st_writer_free(w);
    if (rc) return bt_fail(rc, "adapter: %s: %s", path, bt_last_error_in("adapter"));
    return 0;
}

int bt_adapter_save(const bt_lora *lo, const char *base_model_name_or_path, const char *dir,
                    const bt_model *m) {
    size_t n = strlen(dir);
    while (n > 1 && dir[n - 1] == '/') n--;
    char *d = strndup(dir, n);
    char *tmp = NULL, *p = NULL;
    int rc = 0, lock = -1;
    if (!d) return bt_fail(BT_ERR_NOMEM, "adapter: out of memory");
    /* never replace a directory BarqTrain did not write (common/out_dir.h): refused before any
     * file is written (bt_replace_dir checks again) */
    if ((rc = bt_out_dir_check(d, &bt_out_adapter, "adapter")) || (rc = mkdir_parents(d))) goto out;
    if (asprintf(&tmp, "%s.tmp-%d", d, (int)getpid()) < 0) {
        tmp = NULL;
        rc = bt_fail(BT_ERR_NOMEM, "adapter: out of memory");
        goto out;
    }
    if ((lock = bt_tmpdir_create(tmp, "adapter")) < 0) { /* locked: a save in progress */
        rc = BT_ERR_IO;
        goto out;
    }
    if ((rc = bt_out_dir_mark(tmp, &bt_out_adapter, "adapter"))) goto out; /* first: a leftover is ours */
    if (asprintf(&p, "%s/adapter_model.safetensors", tmp) < 0) {
        p = NULL;
        rc = bt_fail(BT_ERR_NOMEM, "adapter: out of memory");
        goto out;
    }
    if ((rc = write_weights(lo, p))) goto out;
    free(p);
    if (asprintf(&p, "%s/adapter_config.json", tmp) < 0) {
        p = NULL;
        rc = bt_fail(BT_ERR_NOMEM, "adapter: out of memory");
        goto out;
    }
    if ((rc = write_config(lo, base_model_name_or_path, p, m))) goto out;
    bt_test_pause_point(tmp); /* tests SIGKILL the save here (bt_common.h) */
    if ((rc = bt_fsync_path(tmp, 1, "adapter")) || (rc = bt_replace_dir(tmp, d, &bt_out_adapter, "adapter")))
        goto out;
    bt_fsync_parent(d, "adapter"); /* best effort: make the rename durable */
out:
    if (rc && tmp && lock >= 0) bt_rm_tree(tmp);
    if (lock >= 0) close(lock);
    free(p);
    free(tmp);
    free(d);
    return rc;
}
