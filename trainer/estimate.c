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

#define MIB 1048576.0
#define CE_ROWS 256 /* step.c CE_CHUNK_ROWS */

/* Linear shapes [rows=out, cols=in] of module `mod` (HF LlamaForCausalLM). */
static void lin_shape(const bt_llama_hparams *hp, int mod, int64_t *rows, int64_t *cols) {
    int64_t D = hp->d_model, Dq = (int64_t)hp->n_head * hp->head_dim,
            Dkv = (int64_t)hp->n_kv_head * hp->head_dim, F = hp->d_ff;
    switch (mod) {
    case BT_MOD_Q: *rows = Dq; *cols = D; break;
    case BT_MOD_K:
    case BT_MOD_V: *rows = Dkv; *cols = D; break;
    case BT_MOD_O: *rows = D; *cols = Dq; break;
    case BT_MOD_DOWN: *rows = D; *cols = F; break;
    default: *rows = F; *cols = D; break; /* gate, up */
    }
}

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
    bt_llama_hparams hp = em->hp;
    hp.head_dim = hp.d_model / hp.n_head;
    int64_t per_type[BT_GGML_TYPE_SLOTS] = {0};
    char name[96];
    for (int l = 0; l < hp.n_layer; l++)
        for (int mod = 0; mod < BT_MOD_N; mod++) {
            int64_t rows, cols;
            lin_shape(&hp, mod, &rows, &cols);
            const int64_t n = rows * cols;
            em->lin_weights += n;
            snprintf(name, sizeof name, "blk.%d.%s.weight", l, names[mod]);
            const bt_gguf_tensor *t = bt_gguf_find_tensor(g, name);
            if (!t) { /* the loader will refuse it; count it at fp32 */
                em->gguf_lin_bytes += (uint64_t)n * 4;
                em->gguf_lin_bytes_cuda += (uint64_t)n * 2;
                continue;
            }
            const int dense = t->type == BT_GGML_F32 || t->type == BT_GGML_F16 ||
                              t->type == BT_GGML_BF16;
            em->gguf_lin_bytes += t->nbytes;
            em->gguf_lin_bytes_cuda += dense ? (uint64_t)n * 2 : t->nbytes;
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
    if (bt_gguf_get_str(g, "general.architecture", &arch) != 0 || arch.len != 5 ||
        memcmp(arch.ptr, "llama", 5) != 0) {
        rc = bt_fail(BT_ERR_FORMAT, "estimate: %s: general.architecture is not \"llama\"", path);
        goto out;
    }
    if ((rc = gguf_int(g, path, "llama.block_count", 1, 0, &hp->n_layer)) ||
        (rc = gguf_int(g, path, "llama.embedding_length", 1, 0, &hp->d_model)) ||
        (rc = gguf_int(g, path, "llama.attention.head_count", 1, 0, &hp->n_head)) ||
        (rc = gguf_int(g, path, "llama.feed_forward_length", 1, 0, &hp->d_ff)) ||
        (rc = gguf_int(g, path, "llama.context_length", 0, 2048, &hp->ctx)))
        goto out;
    if ((rc = gguf_int(g, path, "llama.attention.head_count_kv", 0, hp->n_head, &hp->n_kv_head)))
        goto out;
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
    if (hp->n_head > 0 && hp->d_model % hp->n_head == 0) gguf_linears(em, g);
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
        (rc = json_int(j, path, "num_key_value_heads", 0, hp->n_head, &hp->n_kv_head))) {
        json_decref(j);
        return rc;
    }
    json_t *tw = json_object_get(j, "tie_word_embeddings");
    em->tied = tw ? json_is_true(tw) : 0;
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
        hp->vocab < 1 || hp->d_model % hp->n_head != 0)
        return bt_fail(BT_ERR_FORMAT, "estimate: %s: inconsistent hyper-parameters (layers %d, "
                       "d_model %d, heads %d/%d, ffn %d, vocab %d)", path, hp->n_layer, hp->d_model,
                       hp->n_head, hp->n_kv_head, hp->d_ff, hp->vocab);
    hp->head_dim = hp->d_model / hp->n_head;
    em->max_linear = 0;
    for (int mod = 0; mod < BT_MOD_N; mod++) {
        int64_t r, c;
        lin_shape(hp, mod, &r, &c);
        if (r * c > em->max_linear) em->max_linear = r * c;
    }
    return 0;
}

/* The base_dtype the trainer will hold the model's base in (bt_model_load's AUTO rule). */
static int est_base_dtype(const bt_est_model *em, const bt_train_config *cfg) {
    if (cfg->base_dtype != BT_BASE_AUTO) return cfg->base_dtype;
    return em->gguf ? BT_BASE_GGUF : BT_BASE_NF4;
}

/* The step context of M tokens (step.c bt_step_ctx_new): *acts (layer inputs and the kept
 * layer activations), *loss_ws (the CE chunk), and the other buffers' bytes as the result
 * (backward scratch, dropout copy, final norm, RoPE table; not the NF4 tiles). elem = 2 or 4. */
static double step_workspace(const bt_llama_hparams *hp, int n_mods, double r, double M, int ckpt,
                             int cuda, double *acts, double *loss_ws) {
    const double L = hp->n_layer, D = hp->d_model, V = hp->vocab, F = hp->d_ff;
    const double Dq = (double)hp->n_head * hp->head_dim, Dkv = (double)hp->n_kv_head * hp->head_dim;
    const double act = cuda ? 2.0 : 4.0;
    double per_layer_elems = M * D /* xn1 */ + M * Dq /* q */ + 2 * M * Dkv /* k, v */ +
                             M * Dq /* att */ + M * D /* x2 */ + M * D /* xn2 */ +
                             2 * M * F /* g, u */ + n_mods * M * r /* LoRA branch */;
    double per_layer_f32 = M * hp->n_head /* lse */ + 2 * M /* rstd1, rstd2 */;
    double kept = ckpt ? 1 : L;
    *acts = (L + 1) * M * D * act + kept * (per_layer_elems * act + per_layer_f32 * 4.0);
    if (cuda) *loss_ws = (double)CE_ROWS * V * (4.0 + 2.0) + M * 4.0 /* row_loss */;
    else *loss_ws = (double)bt_linear_ce_workspace_floats(CE_ROWS, hp->vocab) * 4.0;
    double wide = F > D ? F : D;
    if (Dq > wide) wide = Dq;
    double other_elems = M * D /* xf */ + M * F /* h */ + 4 * M * D /* dx dx2 dxn dtmp */ +
                         2 * M * Dq /* dq datt */ + 2 * M * Dkv /* dk dv */ + 3 * M * F /* dg du dh */ +
                         M * r /* das */ + M * wide /* xd */;
    return other_elems * act + M * 4.0 /* rstdf */ + hp->head_dim / 2 * 4.0 /* RoPE table */;
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
    const double L = hp->n_layer, D = hp->d_model, V = hp->vocab;
    const double Dq = (double)hp->n_head * hp->head_dim;
    const double M = (double)cfg->data.seq_len * cfg->data.micro_batch_size;
    const double r = cfg->lora.r;
    const int cuda = dev == BT_EST_CUDA;
    const double act = cuda ? 2.0 : 4.0; /* bytes per activation element */
    if (threads < 1) threads = 1;
    const int bd = est_base_dtype(em, cfg);

    /* base linears */
    int n_mods = 0;
    double lora_per_layer = 0;
    for (int mod = 0; mod < BT_MOD_N; mod++) {
        int64_t rows, cols;
        lin_shape(hp, mod, &rows, &cols);
        double n = (double)rows * cols;
        if (bd == BT_BASE_NF4) {
            double blocks = n / 64.0;
            b->base += L * (n / 2 + blocks + 4.0 * (double)(((int64_t)blocks + 255) / 256));
        } else if (bd != BT_BASE_GGUF) {
            b->base += L * n * (cuda ? 2.0 : 4.0);
        }
        if (cfg->lora.target_mask & (1u << mod)) {
            n_mods++;
            lora_per_layer += r * (double)(rows + cols);
        }
    }
    if (bd == BT_BASE_GGUF) /* the file's blocks, as read from its tensor table */
        b->base = (double)(cuda ? em->gguf_lin_bytes_cuda : em->gguf_lin_bytes);
    /* embedding / lm_head, norms */
    double wbytes = cuda ? 2.0 : 4.0;
    b->embed = V * D * wbytes * (em->tied ? 1 : 2);
    b->norms = (2 * L + 1) * D * wbytes;
    /* LoRA: master + grad + m + v (+ the bf16 compute copy on CUDA) */
    b->n_lora = (int64_t)(lora_per_layer * L);
    double per_param = cuda ? 18.0 : 16.0;
    b->lora = (double)b->n_lora * per_param;
    /* LoRA+ dense */
    double dense = 0;
    if (cfg->trainable_mask & (1u << BT_TRAINABLE_EMBED)) dense += V * D;
    if (cfg->trainable_mask & (1u << BT_TRAINABLE_NORM)) dense += (2 * L + 1) * D;
    b->n_dense = (int64_t)dense;
    b->dense = dense * per_param;
    if (cuda) b->dense -= dense * 2.0; /* the bf16 copy replaces the frozen one counted above */

    /* the step workspace (step.c bt_step_ctx_new): activations, loss chunk, other buffers */
    const double act_other = step_workspace(hp, n_mods, r, M, cfg->activation_checkpointing, cuda,
                                            &b->acts, &b->loss_ws);
    b->other = act_other + (double)cfg->grad_accum * (4 * M + 1) * 4.0 /* batch copies */ +
               M * 4.0 /* targets */;
    if ((bd == BT_BASE_NF4 || bd == BT_BASE_GGUF) && !cuda) {
        /* K of every NF4 / ggml GEMM is a linear's cols: d_model, d_ff or n_head * head_dim
         * (o_proj, larger than both with an explicit HF head_dim), as trainer/model/model.c
         * bt_model_scratch_floats sizes it */
        double K = hp->d_ff > hp->d_model ? hp->d_ff : hp->d_model;
        if (Dq > K) K = Dq;
        b->other += (double)threads * 128.0 /* kernels/cpu/cpu_math.h BT_TILE_ROWS */ * K * 4.0;
    }
    if (cuda) {
        b->other += (double)em->max_linear * 2.0; /* one dequantised bf16 base weight */
        b->other += M * hp->n_head * 4.0;         /* attention backward delta, fp32 */
        if (cfg->cuda_offload && cfg->activation_checkpointing) {
            /* the checkpointed layer inputs live in pinned host memory; three device buffers */
            b->host = (L + 1) * M * D * act;
            b->acts -= (L + 1 - 3) * M * D * act;
        }
    } else {
        /* attention (kernels/cpu/attention.c): per-thread score tiles (BQ x KT) and, in backward,
         * per-query-head dK/dV accumulators when Hq > Hkv; S^2-Attn changes none of it (it is
         * a segmentation of the same tiled kernel) */
        const double bq = 128, kt = 256;
        const double fwd = threads * (bq * kt + 2 * bq);
        double bwd = threads * (2 * bq * kt + bq);
        if (hp->n_head > hp->n_kv_head) bwd += 2.0 * M * Dq;
        b->attn = (fwd > bwd ? fwd : bwd) * 4.0;
    }
    /* held-out lengths longer than the micro-batch get a workspace of their own (train.c
     * bt_eval_lengths: a checkpointed step context of that many tokens) while the training one
     * stays allocated */
    int max_eval = 0;
    for (int i = 0; i < cfg->eval.n_lengths; i++)
        if (cfg->eval.lengths[i] > max_eval) max_eval = cfg->eval.lengths[i];
    if (!cuda && cfg->eval.n_shards > 0 && max_eval > M) {
        double ea, el;
        b->eval = step_workspace(hp, n_mods, r, max_eval, 1, 0, &ea, &el) + ea + el;
    }
    b->runtime = cuda ? BT_EST_CUDA_CONTEXT_MIB * MIB
                      : (BT_EST_RUNTIME_MIB + BT_EST_THREAD_MIB * threads) * MIB;
    /* adapter save: the writer's copy of every saved tensor (fp32 on both backends) */
    double saved = (double)b->n_lora + dense;
    if ((cfg->trainable_mask & (1u << BT_TRAINABLE_EMBED)) && em->tied) saved += V * D;
    b->save = saved * 4.0;
    b->total = b->base + b->embed + b->norms + b->lora + b->dense + b->acts + b->loss_ws +
               b->other + b->attn + b->eval + b->save + b->runtime;
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
    row(out, bl, c.base, g.base);
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
    row(out, "loss chunk workspace (256 rows x vocab)", c.loss_ws, g.loss_ws);
    row(out, "other workspace (backward, NF4 tiles, batches)", c.other, g.other);
    if (c.eval > 0) row(out, "held-out workspace (eval.lengths > micro-batch)", c.eval, g.eval);
    row(out, "adapter save buffer (safetensors writer copy)", c.save, g.save);
    row(out, "runtime (libraries, threads / CUDA context)", c.runtime, g.runtime);
    row(out, "total while training", c.total, g.total);
    fprintf(out, "  %-44s %10.1f MiB %14s\n", "CPU load-time peak (mapped file + model)",
            c.load_peak / MIB, "-");
    row(out, "peak", c.peak, g.peak);
    if (g.host > 0)
        fprintf(out, "  %-44s %14s %10.1f MiB\n", "pinned host memory (offloaded inputs)", "-",
                g.host / MIB);
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
