/* Memory bill of a training job from the model's hyper-parameters. See estimate.h. */
#include "trainer/estimate.h"

#include <glob.h>
#include <jansson.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/bt_common.h"
#include "common/bt_json.h"
#include "common/gguf.h"
#include "common/quant.h"
#include "kernels/kernels.h"
#include "trainer/backend/plan.h"

#define MIB 1048576.0

static int gguf_int(const bt_gguf *g, const char *path, const char *key, int required, int64_t def,
                    int *out) {
    int64_t v;
    int rc = bt_gguf_get_i64(g, key, &v);
    if (rc == BT_ERR_NOTFOUND && !required) v = def;
    else if (rc == BT_ERR_NOTFOUND)
        return bt_fail(BT_ERR_NOTFOUND, "estimate: %s: missing metadata key %s", path, key);
    else if (rc) return bt_fail(rc, "estimate: %s: %s", path, bt_last_error_in("estimate"));
    if (v < 0 || v > 0x7fffffff)
        return bt_fail(BT_ERR_FORMAT, "estimate: %s: %s = %lld out of range", path, key, (long long)v);
    *out = (int)v;
    return 0;
}

/* The base linears of a GGUF as the file holds them: bytes, bytes on the GPU, types. */
static void gguf_linears(bt_est_model *em, const bt_gguf *g) {
    static const char *const names[BT_MOD_N] = {"attn_q",   "attn_k", "attn_v",  "attn_output",
                                                "ffn_gate", "ffn_up", "ffn_down"};
    const bt_dims d = bt_dims_of(&em->hp); /* head_dim set by read_gguf */
    int64_t per_type[BT_GGML_TYPE_SLOTS] = {0};
    char name[96];
    em->gguf_rows = d.L <= BT_EST_MAX_LAYERS;
    for (int l = 0; l < d.L; l++)
        for (int mod = 0; mod < BT_MOD_N; mod++) {
            int rows, cols;
            bt_dims_lin_shape(&d, mod, &rows, &cols);
            const int64_t n = (int64_t)rows * cols;
            em->lin_weights += n;
            snprintf(name, sizeof name, "blk.%d.%s.weight", l, names[mod]);
            const bt_gguf_tensor *t = bt_gguf_find_tensor(g, name);
            uint64_t row_cuda = (uint64_t)cols * 2; /* bf16 */
            if (!t) { /* the loader will refuse it; count it at fp32 */
                em->gguf_lin_bytes += (uint64_t)n * 4;
                em->gguf_lin_bytes_cuda += (uint64_t)n * 2;
                if (l < BT_EST_MAX_LAYERS) em->gguf_row_bytes[l][mod] = (uint32_t)row_cuda;
                continue;
            }
            const int dense = t->type == BT_GGML_F32 || t->type == BT_GGML_F16 ||
                              t->type == BT_GGML_BF16;
            em->gguf_lin_bytes += t->nbytes;
            em->gguf_lin_bytes_cuda += dense ? (uint64_t)n * 2 : t->nbytes;
            if (!dense && rows > 0) row_cuda = t->nbytes / (uint64_t)rows; /* whole blocks per row */
            if (l < BT_EST_MAX_LAYERS) em->gguf_row_bytes[l][mod] = (uint32_t)row_cuda;
            if (!dense) em->gguf_quant = 1;
            if (t->type >= 0 && t->type < BT_GGML_TYPE_SLOTS) per_type[t->type] += n;
        }
    bt_ggml_type_mix(per_type, em->gguf_types, sizeof em->gguf_types);
}

static int read_gguf(bt_est_model *em, const char *path) {
    bt_gguf *g = NULL;
    int rc = bt_gguf_open(&g, path);
    if (rc) return bt_fail(rc, "estimate: %s", bt_last_error_in("estimate"));
    bt_llama_hparams *hp = &em->hp;
    bt_str arch;
    /* the families bt_model_load_gguf reads (issue 24): keys under general.architecture's prefix */
    const char *an = NULL;
    if (bt_gguf_get_str(g, "general.architecture", &arch) == 0)
        for (int a = BT_ARCH_LLAMA; a <= BT_ARCH_GEMMA3 && !an; a++)
            if (arch.len == strlen(bt_arch_name(a)) && !memcmp(arch.ptr, bt_arch_name(a), arch.len)) {
                an = bt_arch_name(a);
                hp->arch = a;
            }
    if (!an) {
        rc = bt_fail(BT_ERR_FORMAT, "estimate: %s: general.architecture is not \"llama\", "
                     "\"qwen2\", \"qwen3\", \"phi3\" or \"gemma3\"", path);
        goto out;
    }
    char k[7][64];
    static const char *const sfx[7] = {"block_count", "embedding_length", "attention.head_count",
                                       "feed_forward_length", "context_length",
                                       "attention.head_count_kv", "attention.key_length"};
    for (int i = 0; i < 7; i++) snprintf(k[i], sizeof k[i], "%s.%s", an, sfx[i]);
    if ((rc = gguf_int(g, path, k[0], 1, 0, &hp->n_layer)) ||
        (rc = gguf_int(g, path, k[1], 1, 0, &hp->d_model)) ||
        (rc = gguf_int(g, path, k[2], 1, 0, &hp->n_head)) ||
        (rc = gguf_int(g, path, k[3], 1, 0, &hp->d_ff)) ||
        (rc = gguf_int(g, path, k[4], 0, 2048, &hp->ctx)))
        goto out;
    if ((rc = gguf_int(g, path, k[5], 0, hp->n_head, &hp->n_kv_head)))
        goto out;
    /* head_dim: key_length where the file gives it (Qwen3: not d_model / n_head), as
     * bt_model_load_gguf reads it; QK-norm buffers for Qwen3 */
    if ((rc = gguf_int(g, path, k[6], 0, 0, &hp->head_dim))) goto out;
    if (hp->head_dim == 0 && hp->n_head > 0 && hp->d_model % hp->n_head == 0)
        hp->head_dim = hp->d_model / hp->n_head;
    hp->qk_norm = !strcmp(an, "qwen3") || !strcmp(an, "gemma3");
    hp->sandwich_norm = !strcmp(an, "gemma3");
    const bt_gguf_tensor *emb = bt_gguf_find_tensor(g, "token_embd.weight");
    if (!emb || emb->ne[1] > 0x7fffffff) {
        rc = bt_fail(BT_ERR_NOTFOUND, "estimate: %s: missing tensor token_embd.weight", path);
        goto out;
    }
    hp->vocab = (int)emb->ne[1];
    em->tied = bt_gguf_find_tensor(g, "output.weight") == NULL;
    em->file_tensor_bytes = 0;
    for (int64_t i = 0; i < bt_gguf_n_tensors(g); i++)
        em->file_tensor_bytes += bt_gguf_tensor_at(g, i)->nbytes;
    em->gguf = 1;
    if (hp->n_head > 0 && hp->head_dim > 0) gguf_linears(em, g);
out:
    if (bt_gguf_check(g, 0)) rc = bt_fail(BT_ERR_IO, "estimate: %s", bt_last_error_in("estimate"));
    bt_gguf_close(g);
    return rc;
}

static int json_int(const json_t *j, const char *path, const char *key, int required, int def,
                    int *out) {
    json_t *v = json_object_get(j, key);
    if (!v) {
        if (required)
            return bt_fail(BT_ERR_NOTFOUND, "estimate: %s/config.json: missing key %s", path, key);
        *out = def;
        return 0;
    }
    if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > 0x7fffffff)
        return bt_fail(BT_ERR_FORMAT, "estimate: %s/config.json: %s: expected a non-negative integer",
                       path, key);
    *out = (int)json_integer_value(v);
    return 0;
}

static int read_hf(bt_est_model *em, const char *path) {
    char *cfgp = NULL;
    if (asprintf(&cfgp, "%s/config.json", path) < 0) return bt_fail(BT_ERR_NOMEM, "out of memory");
    json_t *j = NULL;
    int lrc = bt_json_load_file(&j, cfgp, 0, 16u << 20);
    free(cfgp);
    if (lrc) return bt_fail(lrc, "estimate: %s", bt_last_error_in("estimate"));
    if (!json_is_object(j)) {
        json_decref(j);
        return bt_fail(BT_ERR_FORMAT, "estimate: %s/config.json: not an object", path);
    }
    bt_llama_hparams *hp = &em->hp;
    int rc;
    if ((rc = json_int(j, path, "num_hidden_layers", 1, 0, &hp->n_layer)) ||
        (rc = json_int(j, path, "hidden_size", 1, 0, &hp->d_model)) ||
        (rc = json_int(j, path, "num_attention_heads", 1, 0, &hp->n_head)) ||
        (rc = json_int(j, path, "intermediate_size", 1, 0, &hp->d_ff)) ||
        (rc = json_int(j, path, "vocab_size", 1, 0, &hp->vocab)) ||
        (rc = json_int(j, path, "num_key_value_heads", 0, hp->n_head, &hp->n_kv_head)) ||
        (rc = json_int(j, path, "head_dim", 0, 0, &hp->head_dim))) {
        json_decref(j);
        return rc;
    }
    if (hp->head_dim == 0 && hp->n_head > 0 && hp->d_model % hp->n_head == 0)
        hp->head_dim = hp->d_model / hp->n_head;
    const json_t *ar = json_array_get(json_object_get(j, "architectures"), 0);
    const int gemma3 = json_is_string(ar) && !strcmp(json_string_value(ar), "Gemma3ForCausalLM");
    hp->qk_norm = gemma3 || (json_is_string(ar) && !strcmp(json_string_value(ar), "Qwen3ForCausalLM"));
    hp->sandwich_norm = gemma3;
    hp->arch = gemma3 ? BT_ARCH_GEMMA3
               : hp->qk_norm ? BT_ARCH_QWEN3
               : json_is_string(ar) && !strcmp(json_string_value(ar), "Phi3ForCausalLM") ? BT_ARCH_PHI3
               : json_is_string(ar) && !strcmp(json_string_value(ar), "Qwen2ForCausalLM") ? BT_ARCH_QWEN2
                                                                                       : BT_ARCH_LLAMA;
    json_t *tw = json_object_get(j, "tie_word_embeddings");
    em->tied = tw ? json_is_true(tw) : gemma3; /* Gemma3TextConfig ties by default */
    json_decref(j);
    char *pat = NULL;
    if (asprintf(&pat, "%s/*.safetensors", path) < 0) return bt_fail(BT_ERR_NOMEM, "out of memory");
    glob_t gl;
    em->file_tensor_bytes = 0;
    if (glob(pat, 0, NULL, &gl) == 0) {
        for (size_t i = 0; i < gl.gl_pathc; i++) {
            struct stat st;
            if (stat(gl.gl_pathv[i], &st) == 0) em->file_tensor_bytes += (uint64_t)st.st_size;
        }
        globfree(&gl);
    }
    free(pat);
    return 0;
}

int bt_est_model_read(bt_est_model *em, const char *path) {
    memset(em, 0, sizeof *em);
    struct stat st;
    if (stat(path, &st) != 0) return bt_fail(BT_ERR_IO, "estimate: model %s: cannot stat", path);
    int rc = S_ISDIR(st.st_mode) ? read_hf(em, path) : read_gguf(em, path);
    if (rc) return rc;
    bt_llama_hparams *hp = &em->hp;
    if (hp->n_layer < 1 || hp->d_model < 1 || hp->n_head < 1 || hp->n_kv_head < 1 || hp->d_ff < 1 ||
        hp->vocab < 1 || hp->head_dim < 2 || (hp->head_dim & 1))
        return bt_fail(BT_ERR_FORMAT, "estimate: %s: inconsistent hyper-parameters (layers %d, "
                       "d_model %d, heads %d/%d, head_dim %d, ffn %d, vocab %d)", path, hp->n_layer,
                       hp->d_model, hp->n_head, hp->n_kv_head, hp->head_dim, hp->d_ff, hp->vocab);
    const bt_dims d = bt_dims_of(hp);
    em->max_linear = bt_dims_max_linear(&d);
    return 0;
}

/* The base_dtype the trainer will hold the model's base in (bt_model_load's AUTO rule). */
static int est_base_dtype(const bt_est_model *em, const bt_train_config *cfg) {
    if (cfg->base_dtype != BT_BASE_AUTO) return cfg->base_dtype;
    return em->gguf ? BT_BASE_GGUF : BT_BASE_NF4;
}

/* dist.shard_base on the GPU with W ranks (plan.h's cut): *shard = this rank's bytes of every base
 * linear (ceil(units / W) units of each), *layer = the largest layer's base linears as
 * all-gathered (plan.h bt_shard_cut: W x that, padding and 256-byte alignment included). Units:
 * NF4 double-quantisation groups, GGUF rows (the file's blocks, F16/BF16/F32 as bf16 rows), bf16
 * rows of an fp32 base: the cut the GPU trainer makes (trainer/cuda/cuda_model.cu). */
static void est_shard(const bt_est_model *em, int bd, int W, double *shard, double *layer) {
    const bt_dims d = bt_dims_of(&em->hp);
    *shard = *layer = 0;
    for (int l = 0; l < d.L; l++) {
        double lb = 0;
        for (int mod = 0; mod < BT_MOD_N; mod++) {
            int rows, cols;
            bt_dims_lin_shape(&d, mod, &rows, &cols);
            bt_shard_cut cut;
            if (bd == BT_BASE_NF4) {
                bt_shard_cut_nf4(&cut, (int64_t)rows * cols, W);
            } else if (bd == BT_BASE_GGUF) {
                const double rb = em->gguf_rows ? em->gguf_row_bytes[l][mod]
                                                : (double)em->gguf_lin_bytes_cuda / ((double)d.L * BT_MOD_N * rows);
                bt_shard_cut_rows(&cut, rows, (int64_t)rb, W);
            } else {
                bt_shard_cut_rows(&cut, rows, (int64_t)cols * 2, W); /* bf16 */
            }
            *shard += (double)bt_shard_cut_bytes(&cut);
            lb += (double)bt_shard_cut_gathered(&cut, W);
        }
        if (lb > *layer) *layer = lb;
        /* NF4 and fp32 layers are all alike */
        if (bd != BT_BASE_GGUF && d.L > 1) {
            *shard *= d.L;
            break;
        }
    }
}

/* The memory plan of the step context the job's backend `dev` allocates for M tokens
 * (trainer/backend/plan.h; the same options bt_step_ctx_new and the GPU trainer derive from the
 * model, its LoRA and the run). n_params: LoRA + LoRA+ parameters. */
static void est_plan(const bt_est_model *em, const bt_train_config *cfg, int dev, int threads,
                     int M, int ckpt, int64_t n_params, int64_t gather_bytes, bt_plan *p) {
    const bt_dims d = bt_dims_of(&em->hp);
    const int bd = est_base_dtype(em, cfg);
    bt_plan_opts o;
    memset(&o, 0, sizeof o);
    o.backend = dev == BT_EST_CUDA ? BT_PLAN_CUDA : BT_PLAN_CPU;
    o.max_M = M;
    o.checkpointing = ckpt;
    o.r = cfg->lora.r;
    o.target_mask = cfg->lora.target_mask;
    o.threads = threads;
    o.qk_norm = em->hp.qk_norm;
    o.sandwich_norm = em->hp.sandwich_norm;
    /* a GGUF base of F16 / BF16 / F32 linears is dense on the GPU (bf16): no dequantisation */
    o.quant_base =
        bd == BT_BASE_NF4 || (bd == BT_BASE_GGUF && (dev == BT_EST_CPU || em->gguf_quant));
    o.n_params = n_params > 0 ? n_params : 1;
    o.trainable_norms = (cfg->trainable_mask & (1u << BT_TRAINABLE_NORM)) != 0;
    o.fused_quant = cfg->cuda_base_matmul == BT_CUDA_BASE_FUSED;
    o.max_linear = em->max_linear;
    o.offload = cfg->cuda_offload && ckpt;
    o.rope_table = 1; /* bt_model_rope_init: every model the trainer runs has its table */
    o.rope_dynamic = cfg->context_extension.method == BT_ROPE_EXT_DYNAMIC;
    o.gather_bytes = dev == BT_EST_CUDA ? gather_bytes : 0;
    o.preference = cfg->pref_on;
    if (bt_plan_step(p, &d, &o)) memset(p, 0, sizeof *p); /* the config checks refuse it first */
}

/* Largest multiple of 64 in [lo_T, hi_T] whose peak fits (0 if none); peak is monotone in T for a
 * fixed checkpointing setting. */
static int search_T(const bt_est_model *em, bt_train_config *c, int dev, int threads, double bytes,
                    int lo_T, int hi_T) {
    int lo = (lo_T + 63) / 64 - 1, hi = hi_T / 64; /* k = T / 64; lo = "none yet" */
    while (lo < hi) {
        const int mid = lo + (hi - lo + 1) / 2;
        c->data.seq_len = mid * 64;
        bt_mem_bill b;
        bt_estimate_bill(em, c, dev, threads, &b);
        if (b.peak <= bytes) lo = mid;
        else hi = mid - 1;
    }
    return lo * 64 >= lo_T ? lo * 64 : 0;
}

int bt_estimate_max_seq_len(const bt_est_model *em, const bt_train_config *cfg, int dev, int threads,
                            double bytes) {
    bt_train_config c = *cfg;
    const int top = (1 << 24) / (cfg->data.micro_batch_size > 0 ? cfg->data.micro_batch_size : 1);
    if (!cfg->checkpointing_auto) return search_T(em, &c, dev, threads, bytes, 64, top);
    /* "auto": without checkpointing below the threshold, with it from there on */
    c.activation_checkpointing = 1;
    int best = search_T(em, &c, dev, threads, bytes, cfg->checkpointing_min_seq_len, top);
    if (best) return best;
    c.activation_checkpointing = 0;
    return search_T(em, &c, dev, threads, bytes, 64, cfg->checkpointing_min_seq_len - 1);
}

void bt_estimate_bill(const bt_est_model *em, const bt_train_config *cfg, int dev, int threads,
                      bt_mem_bill *b) {
    memset(b, 0, sizeof *b);
    const bt_llama_hparams *hp = &em->hp;
    const bt_dims d = bt_dims_of(hp);
    const double L = d.L, D = d.D, V = d.V;
    const int M = cfg->data.seq_len * cfg->data.micro_batch_size;
    const double r = cfg->lora.r;
    const int cuda = dev == BT_EST_CUDA;
    if (threads < 1) threads = 1;
    const int bd = est_base_dtype(em, cfg);

    /* base linears */
    double lora_per_layer = 0;
    for (int mod = 0; mod < BT_MOD_N; mod++) {
        int rows, cols;
        bt_dims_lin_shape(&d, mod, &rows, &cols);
        double n = (double)rows * cols;
        if (bd == BT_BASE_NF4) {
            double blocks = n / 64.0;
            b->base += L * (n / 2 + blocks + 4.0 * (double)(((int64_t)blocks + 255) / 256));
        } else if (bd != BT_BASE_GGUF) {
            b->base += L * n * (cuda ? 2.0 : 4.0);
        }
        if (cfg->lora.target_mask & (1u << mod)) {
            /* Phi-3's fused qkv_proj / gate_up_proj share one lora_A (trainer/model/lora.h): the
             * k / v / up parts add their B rows only */
            const int shared_a = em->hp.arch == BT_ARCH_PHI3 &&
                                 (mod == BT_MOD_K || mod == BT_MOD_V || mod == BT_MOD_UP);
            lora_per_layer += r * (double)(rows + (shared_a ? 0 : cols));
        }
    }
    if (bd == BT_BASE_GGUF) /* the file's blocks, as read from its tensor table */
        b->base = (double)(cuda ? em->gguf_lin_bytes_cuda : em->gguf_lin_bytes);
    /* dist.shard_base: this rank's shards; the two gathered layers are step buffers (the plan) */
    b->world = cfg->world_size > 1 ? cfg->world_size : 1;
    b->sharded = cuda && cfg->dist.shard_base && b->world > 1;
    double gather_layer = 0;
    if (b->sharded) est_shard(em, bd, b->world, &b->base, &gather_layer);
    /* embedding / lm_head (bf16 on the GPU), norms (fp32 on both: trainer/cuda/cuda_model.cu) */
    b->embed = V * D * (cuda ? 2.0 : 4.0) * (em->tied ? 1 : 2);
    b->norms = (2 * L + 1) * D * 4.0;
    b->n_lora = (int64_t)(lora_per_layer * L);
    double dense = 0; /* LoRA+ */
    if (cfg->trainable_mask & (1u << BT_TRAINABLE_EMBED)) dense += V * D;
    if (cfg->trainable_mask & (1u << BT_TRAINABLE_NORM)) dense += (2 * L + 1) * D;
    b->n_dense = (int64_t)dense;

    /* the step context: its memory plan (trainer/backend/plan.h), exactly what bt_step_ctx_new
     * or the GPU trainer allocates */
    bt_plan p;
    est_plan(em, cfg, dev, threads, M, cfg->activation_checkpointing, b->n_lora + b->n_dense,
             (int64_t)gather_layer, &p);
    b->step = (double)bt_plan_bytes(&p, -1);
    b->acts = (double)bt_plan_bytes(&p, BT_PG_ACTS);
    b->loss_ws = (double)bt_plan_bytes(&p, BT_PG_LOSS);
    b->other = (double)(bt_plan_bytes(&p, BT_PG_WORK) + bt_plan_bytes(&p, BT_PG_BATCH) +
                        bt_plan_bytes(&p, BT_PG_OPTIM));
    b->host = (double)bt_plan_bytes(&p, BT_PG_HOST);
    b->gather = (double)bt_plan_bytes(&p, BT_PG_GATHER);
    if (cfg->pref_on) { /* the preference step's host buffers (trainer/loop/pref_step.c) */
        bt_plan pp;
        if (bt_plan_pref(&pp, M, cfg->pref.algo == BT_PREF_KTO) == 0) b->pref = (double)bt_plan_bytes(&pp, BT_PG_PREF);
    }
    if (cuda) {
        /* LoRA (+ LoRA+): fp32 master, grad, m, v and the bf16 compute copy, in the plan */
        const double per_param = (double)bt_plan_bytes(&p, BT_PG_LORA) /
                                 (double)(b->n_lora + b->n_dense > 0 ? b->n_lora + b->n_dense : 1);
        b->lora = (double)b->n_lora * per_param;
        b->dense = dense * per_param;
    } else {
        /* trainer/model/lora.c params + grads, trainer/loop/optim.c AdamW m + v */
        b->lora = (double)b->n_lora * 16.0;
        b->dense = dense * 16.0;
        /* the run's copies of the micro-batches of one optimiser step (trainer/loop/batches.c) */
        b->other += (double)cfg->grad_accum * (4.0 * M + 1) * 4.0;
        /* attention (kernels/cpu/attention.c): per-thread score tiles (BQ x KT) and, in backward,
         * per-query-head dK/dV accumulators when Hq > Hkv; S^2-Attn changes none of it (it is
         * a segmentation of the same tiled kernel) */
        const double bq = 128, kt = 256;
        const double fwd = threads * (bq * kt + 2 * bq);
        double bwd = threads * (2 * bq * kt + bq);
        if (d.Hq > d.Hkv) bwd += 2.0 * M * d.Dq;
        b->attn = (fwd > bwd ? fwd : bwd) * 4.0;
        /* held-out lengths longer than the micro-batch get a step context of their own
         * (backend_cpu.c eval_workspace: checkpointed, that many tokens) while the training one
         * stays allocated */
        int max_eval = 0;
        for (int i = 0; i < cfg->eval.n_lengths; i++)
            if (cfg->eval.lengths[i] > max_eval) max_eval = cfg->eval.lengths[i];
        if (cfg->eval.n_shards > 0 && max_eval > M) {
            bt_plan e;
            est_plan(em, cfg, dev, threads, max_eval, 1, b->n_lora + b->n_dense, 0, &e);
            b->eval = (double)bt_plan_bytes(&e, -1);
        }
    }
    b->runtime = cuda ? BT_EST_CUDA_CONTEXT_MIB * MIB
                      : (BT_EST_RUNTIME_MIB + BT_EST_THREAD_MIB * threads) * MIB;
    /* adapter save: the writer's copy of every saved tensor (fp32 on both backends) */
    double saved = (double)b->n_lora + dense;
    if ((cfg->trainable_mask & (1u << BT_TRAINABLE_EMBED)) && em->tied) saved += V * D;
    /* on CUDA the adapter is copied back to the host LoRA state and written from there: host
     * memory, not in the device bill */
    b->save = cuda ? 0.0 : saved * 4.0;
    b->total = b->base + b->gather + b->embed + b->norms + b->lora + b->dense + b->acts + b->loss_ws +
               b->other + b->attn + b->eval + b->save + b->runtime + (cuda ? 0.0 : b->pref);
    if (!cuda) {
        /* loading: the mapped file's tensor pages + the model built so far + one fp32 matrix in
         * flight (plus its NF4 copy; a GGUF base copies blocks and needs no fp32 matrix) + the
         * runtime */
        b->load_peak = (double)em->file_tensor_bytes + b->base + b->embed + b->norms +
                       (bd == BT_BASE_GGUF ? 0.0 : (double)em->max_linear * 4.0) + b->runtime;
    }
    b->peak = b->total > b->load_peak ? b->total : b->load_peak;
}

static void row(FILE *out, const char *name, double a, double c) {
    fprintf(out, "  %-44s %10.1f MiB %10.1f MiB\n", name, a / MIB, c / MIB);
}

int bt_estimate_print(const bt_train_config *cfg, double fit_gib, FILE *out) {
    bt_est_model em;
    int rc = bt_est_model_read(&em, cfg->model);
    if (rc) return rc;
    int threads = cfg->threads > 0 ? cfg->threads : omp_get_max_threads();
    bt_mem_bill c, g;
    bt_estimate_bill(&em, cfg, BT_EST_CPU, threads, &c);
    bt_estimate_bill(&em, cfg, BT_EST_CUDA, threads, &g);
    const bt_llama_hparams *hp = &em.hp;
    const int bd = est_base_dtype(&em, cfg);
    if (bd == BT_BASE_GGUF && !em.gguf)
        return bt_fail(BT_ERR_INVALID, "estimate: base_dtype \"gguf\" needs a .gguf model; %s is "
                       "a Hugging Face directory", cfg->model);
    fprintf(out, "memory estimate: model %s (%d layers, d_model %d, heads %d/%d, ffn %d, vocab %d%s)\n",
            cfg->model, hp->n_layer, hp->d_model, hp->n_head, hp->n_kv_head, hp->d_ff, hp->vocab,
            em.tied ? ", tied embeddings" : "");
    fprintf(out, "  micro-batch %d x %d = %d tokens, grad_accum %d, LoRA r %d (%lld params)%s%s\n",
            cfg->data.micro_batch_size, cfg->data.seq_len,
            cfg->data.micro_batch_size * cfg->data.seq_len, cfg->grad_accum, cfg->lora.r,
            (long long)c.n_lora, c.n_dense ? ", LoRA+" : "",
            cfg->activation_checkpointing
                ? (cfg->checkpointing_auto ? ", activation checkpointing (auto)"
                                           : ", activation checkpointing")
                : "");
    if (c.n_dense) fprintf(out, "  LoRA+ dense parameters: %lld\n", (long long)c.n_dense);
    if (cfg->context_extension.target_length > 0) {
        static const char *const meth[] = {"none", "linear", "yarn", "dynamic"};
        fprintf(out, "  context extension: %s to %d tokens (RoPE only: no memory of its own)\n",
                meth[cfg->context_extension.method], cfg->context_extension.target_length);
    }
    const int G = bt_config_s2_group(cfg);
    if (G > 0) {
        /* causal attention work ~ T^2 / 2 per head; S^2 groups of G: ~ T G / 2 (half the heads
         * shifted, the same up to the edges) */
        const double T = cfg->data.seq_len, frac = G >= T ? 1.0 : (double)G / T;
        fprintf(out, "  S2-Attn groups of %d tokens: attention work x %.2f of full attention in "
                "training (the same memory: the kernels are tiled either way)\n", G, frac);
    }
    fprintf(out, "  %-44s %14s %14s\n", "", "CPU (fp32)", "CUDA (bf16)");
    char bl[512];
    const double nw = em.gguf ? (double)em.lin_weights : 0;
    if (bd == BT_BASE_GGUF)
        snprintf(bl, sizeof bl, "base linears (GGUF %s, %.2f bits/weight)", em.gguf_types,
                 nw > 0 ? 8.0 * (double)em.gguf_lin_bytes / nw : 0.0);
    else if (bd == BT_BASE_NF4)
        snprintf(bl, sizeof bl, "base linears (NF4, %.2f bits/weight)", 4.0 + 8.0 / 64 + 32.0 / 64 / 256);
    else
        snprintf(bl, sizeof bl, "base linears (fp32 / bf16)");
    if (cfg->dist.shard_base && !g.sharded)
        fprintf(out, "  dist.shard_base: the bill of one rank holding the whole base; --world-size W gives one "
                "rank's of W, --gpus-for GiB the W that fits\n");
    if (g.sharded) {
        fprintf(out, "  dist.shard_base over %d ranks: the CUDA column is one rank's (its 1/%d shard of the "
                "base linears)\n", g.world, g.world);
        const size_t n = strlen(bl) < 40 ? strlen(bl) : 40;
        snprintf(bl + n, sizeof bl - n, "; CUDA: 1/%d", g.world);
    }
    row(out, bl, c.base, g.base);
    if (g.sharded) row(out, "all-gathered base layers (2: running, next)", 0, g.gather);
    row(out, em.tied ? "embedding (tied lm_head)" : "embedding + lm_head", c.embed, g.embed);
    row(out, "norms", c.norms, g.norms);
    row(out, "LoRA params + grads + AdamW m, v", c.lora, g.lora);
    row(out, "LoRA+ embed/norm params + grads + m, v", c.dense, g.dense);
    char an[64];
    snprintf(an, sizeof an, "activations (%s)",
             cfg->activation_checkpointing ? (g.host > 0 ? "checkpointed; GPU: offloaded"
                                                         : "checkpointed: 1 layer kept")
                                           : "all layers kept");
    row(out, an, c.acts, g.acts);
    row(out, "attention scratch (tiles, GQA dK/dV)", c.attn, g.attn);
    row(out, "loss chunk workspace (CE rows x vocab)", c.loss_ws, g.loss_ws);
    row(out, "other workspace (backward, NF4 tiles, batches)", c.other, g.other);
    if (c.eval > 0) row(out, "held-out workspace (eval.lengths > micro-batch)", c.eval, g.eval);
    if (c.pref > 0) /* host memory on both: in the CPU total only */
        fprintf(out, "  %-44s %10.1f MiB %14s\n", "preference step buffers (host)", c.pref / MIB, "-");
    row(out, "adapter save buffer (safetensors writer copy)", c.save, g.save);
    row(out, "runtime (libraries, threads / CUDA context)", c.runtime, g.runtime);
    row(out, "total while training", c.total, g.total);
    fprintf(out, "  %-44s %10.1f MiB %14s\n", "CPU load-time peak (mapped file + model)",
            c.load_peak / MIB, "-");
    row(out, "peak", c.peak, g.peak);
    if (g.host > 0)
        fprintf(out, "  %-44s %14s %10.1f MiB\n", "pinned host memory (offloaded inputs)", "-",
                g.host / MIB);
    if (g.pref > 0)
        fprintf(out, "  %-44s %14s %10.1f MiB\n", "host memory (preference step buffers)", "-",
                g.pref / MIB);
    if (fit_gib > 0) {
        const double bytes = fit_gib * 1024.0 * MIB;
        const int tc = bt_estimate_max_seq_len(&em, cfg, BT_EST_CPU, threads, bytes);
        const int tg = bt_estimate_max_seq_len(&em, cfg, BT_EST_CUDA, threads, bytes);
        fprintf(out, "longest seq_len for %g GiB (micro-batch %d, %s): CPU %d tokens, CUDA %d "
                "tokens\n", fit_gib, cfg->data.micro_batch_size,
                cfg->checkpointing_auto ? "checkpointing auto"
                : cfg->activation_checkpointing ? "checkpointing" : "no checkpointing", tc, tg);
    }
    return 0;
}

int bt_estimate_gpus_for(const bt_est_model *em, const bt_train_config *cfg, int threads, double bytes,
                         bt_mem_bill *b) {
    bt_train_config c = *cfg;
    c.dist.shard_base = 1;
    bt_mem_bill tmp;
    if (!b) b = &tmp;
    for (int W = 1; W <= BT_EST_MAX_WORLD; W++) {
        c.world_size = W;
        bt_estimate_bill(em, &c, BT_EST_CUDA, threads, b);
        if (b->peak <= bytes) return W;
    }
    return 0;
}

int bt_estimate_print_gpus_for(const bt_train_config *cfg, double gpu_gib, FILE *out) {
    bt_est_model em;
    int rc = bt_est_model_read(&em, cfg->model);
    if (rc) return rc;
    const int threads = cfg->threads > 0 ? cfg->threads : omp_get_max_threads();
    const double bytes = gpu_gib * 1024.0 * MIB;
    bt_mem_bill b;
    const int W = bt_estimate_gpus_for(&em, cfg, threads, bytes, &b);
    const int bd = est_base_dtype(&em, cfg);
    fprintf(out, "GPUs of %g GiB for %s (%s base, micro-batch %d x %d tokens per rank, LoRA r %d, %s), "
            "dist.shard_base: per-rank CUDA bill\n", gpu_gib, cfg->model,
            bd == BT_BASE_GGUF ? "GGUF" : bd == BT_BASE_NF4 ? "NF4" : "bf16", cfg->data.micro_batch_size,
            cfg->data.seq_len, cfg->lora.r,
            cfg->activation_checkpointing ? (cfg->cuda_offload ? "checkpointing, offloaded" : "checkpointing")
                                          : "no checkpointing");
    fprintf(out, "  %4s %16s %16s %16s %16s\n", "W", "base shard", "gathered layers", "rest per rank",
            "total per rank");
    const int last = W ? W : BT_EST_MAX_WORLD;
    bt_train_config c = *cfg;
    c.dist.shard_base = 1;
    for (int w = 1; w <= last; w = w < 8 ? w + 1 : (w * 2 < last ? w * 2 : (w == last ? w + 1 : last))) {
        c.world_size = w;
        bt_mem_bill x;
        bt_estimate_bill(&em, &c, BT_EST_CUDA, threads, &x);
        fprintf(out, "  %4d %12.1f MiB %12.1f MiB %12.1f MiB %12.1f MiB%s\n", w, x.base / MIB, x.gather / MIB,
                (x.peak - x.base - x.gather) / MIB, x.peak / MIB, x.peak <= bytes ? "  fits" : "");
    }
    if (W)
        fprintf(out, "%d GPU%s of %g GiB fit%s this job (%.1f of %.1f GiB per rank)\n", W, W > 1 ? "s" : "",
                gpu_gib, W > 1 ? "" : "s", b.peak / (1024.0 * MIB), gpu_gib);
    else
        fprintf(out, "no W up to %d fits %g GiB GPUs: with the base sharded %d ways a rank still needs %.1f GiB, "
                "%.1f GiB of it besides the base (LoRA state %.1f GiB, activations and workspace %.1f GiB): "
                "lower lora.r, data.seq_len or data.micro_batch_size, or set activation_checkpointing / "
                "cuda.offload_checkpoints\n", BT_EST_MAX_WORLD, gpu_gib, BT_EST_MAX_WORLD,
                b.peak / (1024.0 * MIB), (b.peak - b.base - b.gather) / (1024.0 * MIB),
                (b.lora + b.dense) / (1024.0 * MIB), (b.acts + b.loss_ws + b.other) / (1024.0 * MIB));
    return 0;
}

/* ---- does the run fit (train's check before it allocates) ---- */

typedef struct {
    double bytes;
    const char *what, *change;
} bill_item;

int bt_estimate_check_fits(const bt_train_config *cfg, int threads, const bt_mem_limits *l) {
    const char *which;
    const double limit = bt_mem_limit_min(l, &which);
    if (limit < 0) return 0;
    bt_est_model em;
    if (bt_est_model_read(&em, cfg->model)) return 0; /* the model loader says why */
    bt_mem_bill b, g;
    bt_estimate_bill(&em, cfg, BT_EST_CPU, threads, &b);
    const int cuda = cfg->device == BT_DEVICE_CUDA;
    double need = b.peak;
    if (cuda) {
        bt_estimate_bill(&em, cfg, BT_EST_CUDA, threads, &g);
        need = b.load_peak + g.host;
    }
    if (need <= limit) {
        bt_log(BT_LOG_INFO, "trainer", "memory: this run needs about %.2f GiB of host memory (trainer estimate), "
               "%.2f GiB may be used (%s)", need / (1024.0 * MIB), limit / (1024.0 * MIB), which);
        return 0;
    }
    /* the two largest items of the bill, with the setting that shrinks each */
    char lora_what[96], lora_change[96];
    snprintf(lora_what, sizeof lora_what, "LoRA r %d parameters, gradients and AdamW moments", cfg->lora.r);
    snprintf(lora_change, sizeof lora_change, "lower lora.r (now %d) or lora.target_modules", cfg->lora.r);
    bill_item it[] = {
        {b.lora + b.dense, lora_what, lora_change},
        {b.acts + b.attn + b.other + b.loss_ws, "activations and workspace",
         "lower data.micro_batch_size or data.seq_len, or set activation_checkpointing true"},
        {b.base + b.embed + b.norms, "the base model", "use base_dtype \"nf4\" or \"gguf\" (a 4-bit base)"},
        {b.load_peak > b.total ? b.load_peak : 0, "loading (the mapped file + the model)",
         "use a smaller or pre-quantised model file"},
        {b.eval, "held-out evaluation at long eval.lengths", "drop the longest eval.lengths"},
    };
    const int n = (int)(sizeof it / sizeof it[0]);
    int i1 = 0, i2 = 1;
    for (int i = 0; i < n; i++)
        if (it[i].bytes > it[i1].bytes) i1 = i;
    if (i2 == i1) i2 = 0;
    for (int i = 0; i < n; i++)
        if (i != i1 && it[i].bytes > it[i2].bytes) i2 = i;
    char lim[800];
    bt_mem_limits_describe(l, lim, sizeof lim);
    return bt_fail(BT_ERR_NOMEM,
                   "memory: this run needs about %.1f GiB%s (trainer estimate's bill: %s %.1f GiB, %s %.1f GiB), "
                   "more than the %.1f GiB this process may use (%s; %s): %s, or %s (`trainer estimate --config "
                   "JOB` itemises the bill); `trainer train --force` tries anyway",
                   need / (1024.0 * MIB), cuda ? " of host memory" : "", it[i1].what, it[i1].bytes / (1024.0 * MIB),
                   it[i2].what, it[i2].bytes / (1024.0 * MIB), limit / (1024.0 * MIB), which, lim, it[i1].change,
                   it[i2].change);
}
