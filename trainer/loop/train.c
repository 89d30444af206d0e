/* The training run (`trainer train` / `trainer eval`), stage by stage. See train.h; the run's
 * state is a bt_run (trainer/loop/run.h), the step runs on the backend of cfg->device
 * (trainer/backend/backend.h), the held-out evaluation is trainer/loop/eval.c, the batch stream
 * trainer/loop/batches.c, stop requests and collectives trainer/loop/run.c. */
#include "trainer/loop/train.h"

#include <errno.h>
#include <math.h>
#include <omp.h>
#include <openssl/evp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>

#include "common/atomic_io.h"
#include "common/bt_common.h"
#include "proto/client.h"
#include "trainer/estimate.h"
#include "trainer/io/adapter.h"
#include "trainer/io/adapter_load.h"
#include "trainer/io/checkpoint.h"
#include "trainer/io/model_card.h"
#include "trainer/io/outputs.h"
#include "trainer/loop/run.h"
#include "trainer/model/rng.h"

/* A checkpoint of every rank's loader state `all` (gathered with the step), written by rank 0;
 * every rank learns whether it worked (collective). */
static int save_checkpoint(bt_run *r, int step, const uint8_t *all) {
    int rc = 0;
    if (r->dist.rank == 0) {
        rc = bt_backend_sync_lora(r->be, 1);
        if (!rc) rc = bt_checkpoint_save(r->cfg->checkpoint_dir, r->cfg, &r->model, &r->lora,
                                            step, all, r->dist.world);
    }
    return bt_run_agree(r, rc, "saving the checkpoint");
}

/* A run whose loss, gradient norm or parameters became non-finite at `step` (issue 10 §4):
 * nothing more is written (the writers refuse non-finite tensors anyway), so out_dir and
 * checkpoint_dir keep the last good saves. Returns BT_ERR_DIVERGED with the message (exit
 * status 3, trainer/main.c). */
static int diverged(const bt_train_config *cfg, int step, const char *what, double lr,
                    int adapter_step, int ck_step) {
    char saved[1024];
    int n = 0;
    if (adapter_step > 0)
        n = snprintf(saved, sizeof saved, "the adapter in %s is the one saved at step %d", cfg->out_dir,
                     adapter_step);
    else
        n = snprintf(saved, sizeof saved, "no adapter was saved by this run (%s is untouched)",
                     cfg->out_dir);
    if (cfg->checkpoint_every > 0 && n > 0 && (size_t)n < sizeof saved) {
        if (ck_step > 0)
            snprintf(saved + n, sizeof saved - (size_t)n, ", the checkpoint in %s is the one of step %d",
                     cfg->checkpoint_dir, ck_step);
        else
            snprintf(saved + n, sizeof saved - (size_t)n, ", no checkpoint was written by this run (%s is "
                     "untouched)", cfg->checkpoint_dir);
    }
    return bt_fail(BT_ERR_DIVERGED,
                   "training diverged at step %d: non-finite %s (learning rate %.3g): stopped without saving "
                   "anything of this step or later; %s. Lower optim.lr (now %g), raise optim.warmup_steps or "
                   "set optim.grad_clip, then resume from the last checkpoint or start again",
                   step, what, lr, saved, cfg->optim.lr);
}

void bt_fmt_duration(char *buf, size_t n, double s) {
    if (!(s >= 0) || s > 1e9) s = 0;
    long t = (long)(s + 0.5);
    if (t >= 3600) snprintf(buf, n, "%ldh%02ldm%02lds", t / 3600, t / 60 % 60, t % 60);
    else snprintf(buf, n, "%ldm%02lds", t / 60, t % 60);
}

double bt_peak_rss_mib(void) {
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0) return 0;
    return (double)ru.ru_maxrss / 1024.0; /* ru_maxrss is in KiB on Linux */
}



/* kernels/cpu keeps OpenBLAS at one thread and parallelises everything (GEMMs included) with
 * OpenMP (kernels/cpu/blas_par.c), so the OpenMP team size is the one knob. threads 0: the CPUs
 * Slurm gives the task (a node's other tasks must not be oversubscribed), else OpenMP's default. */
static void set_threads(int n) {
    char how[128];
    if (n <= 0 && (n = bt_dist_slurm_cpus(how, sizeof how)) > 0)
        bt_log(BT_LOG_INFO, "trainer", "threads: %d (%s)", n, how);
    if (n > 0) omp_set_num_threads(n);
}

/* --profile: the table on `out`, profile.json in the report directory. */
static int print_profile(const bt_train_config *cfg, const bt_prof *p, int step, double step_s,
                         const bt_backend *be, FILE *out) {
    char title[160];
    size_t held, peak;
    double ws = bt_backend_bytes(be) / 1048576.0, dev = -1;
    if (bt_backend_device_memory(be, &held, &peak)) dev = peak / 1048576.0;
    snprintf(title, sizeof title, "step %d, %d x %d tokens x grad_accum %d, %s%s", step,
             cfg->data.micro_batch_size, cfg->data.seq_len, cfg->grad_accum,
             cfg->device == BT_DEVICE_CUDA ? "cuda (CUDA events)" : "cpu",
             cfg->activation_checkpointing ? ", activation checkpointing" : "");
    if (bt_prof_print(p, out, title, step_s, ws, bt_peak_rss_mib(), dev) < 0 || fflush(out))
        return bt_fail(BT_ERR_IO, "profile: write: %s", strerror(errno));
    char *path = NULL;
    if (asprintf(&path, "%s/profile.json", cfg->report.dir) < 0)
        return bt_fail(BT_ERR_NOMEM, "out of memory");
    int rc = bt_prof_write_json(p, path, title, step_s);
    free(path);
    return rc;
}

/* An interrupted run keeps its last completed step: rank 0 saves the adapter and a checkpoint
 * (every rank's loader state after that step: all_done, gathered with it, so no collective is
 * needed now that the others may be gone) and writes where into saved. */
static int save_interrupted(bt_run *r, int step, const uint8_t *all_done, char *saved, size_t n) {
    const bt_train_config *cfg = r->cfg;
    int rc = bt_backend_sync_lora(r->be, 1);
    if (!rc) rc = bt_adapter_save(&r->lora, cfg->base_model_name_or_path, cfg->out_dir, NULL);
    if (rc) return rc;
    int ck = step < cfg->steps && strcmp(cfg->checkpoint_dir, cfg->out_dir) != 0;
    if (ck && (rc = bt_checkpoint_save(cfg->checkpoint_dir, cfg, &r->model, &r->lora, step,
                                          all_done, r->dist.world)))
        return rc;
    if (ck)
        snprintf(saved, n, "adapter saved to %s, checkpoint to %s (continue with --resume %s)",
                 cfg->out_dir, cfg->checkpoint_dir, cfg->checkpoint_dir);
    else
        snprintf(saved, n, "adapter saved to %s", cfg->out_dir);
    return 0;
}

/* r->id, 16 hex digits: the first 8 bytes of SHA-256 of the id rank 0 handed every rank (world
 * > 1: the same on all ranks, and no way back to the id), else 8 random bytes. */
static int run_id_init(bt_run *r) {
    uint8_t h[32];
    unsigned n = 0;
    if (r->dist.world > 1 ? EVP_Digest(r->dist_id, sizeof r->dist_id, h, &n, EVP_sha256(), NULL) != 1
                          : getrandom(h, 8, 0) != 8)
        return bt_fail(BT_ERR_IO, "cannot make the run's id");
    for (int i = 0; i < 8; i++) snprintf(r->id + 2 * i, 3, "%02x", h[i]);
    return 0;
}

/* Data-parallel start-up (trainer/parallel/dist.h): the job key, the rendezvous that checks every rank
 * runs this job and hands out rank 0's id (the backend's: reg->dist_unique_id), then the watchdog
 * on its connections. */
static int dist_start(bt_run *r) {
    const bt_train_config *cfg = r->cfg;
    const bt_backend_reg *reg = r->reg;
    char addr[256], src[300];
    int port = 0, rc;
    uint8_t key[BT_DIST_KEY_BYTES];
    if ((rc = bt_dist_master_resolve(&r->dist, cfg->dist.master_addr, cfg->dist.master_port, addr,
                                     sizeof addr, &port)) ||
        (rc = bt_dist_key_load(cfg->dist.secret_file, key, src, sizeof src)))
        return rc;
    char *dump = bt_config_dump(cfg);
    if (!dump) return bt_fail(BT_ERR_NOMEM, "out of memory");
    uint8_t digest[32];
    bt_dist_digest(dump, strlen(dump), digest);
    free(dump);
    if (r->dist.rank == 0 && (rc = reg->dist_unique_id(r->dist_id))) return rc;
    bt_log(BT_LOG_INFO, "trainer", "rank %d of %d (local rank %d, from %s): rendezvous at %s:%d, "
           "job secret from %s", r->dist.rank, r->dist.world, r->dist.local_rank, r->dist.source,
           addr, port, src);
    bt_dist_link *link = NULL;
    rc = bt_dist_rendezvous(addr, port, r->dist.rank, r->dist.world, digest, key, r->dist_id,
                            sizeof r->dist_id, cfg->dist.timeout_s, &link);
    memset(key, 0, sizeof key);
    if (rc) return rc;
    bt_dist_monitor_opts mo = {cfg->dist.heartbeat_timeout_s, cfg->dist.timeout_s, &bt_run_stop_sig};
    return bt_dist_monitor_start(&r->mon, link, &mo);
}

/* ---- bt_train_run, stage by stage ----------------------------------------------------------
 * One run's state (bt_run, trainer/loop/run.h), shared by its stages: rendezvous, the model, the
 * LoRA weights (fresh, an adapter to evaluate, or a checkpoint to resume), the backend, the
 * held-out evaluation before, the step loop, the final save and evaluation, the two ways a run
 * ends early (a stop request; the batch stream failing) and teardown. A stage returns 0 or an
 * error code; with an error it sets `end` to say which ending applies. */
static int run_end_with(bt_run *r, bt_run_end how, int rc) {
    r->end = how;
    return rc;
}

/* `trainer train`, before anything is allocated (issue 21 §7): the run's memory plan against what
 * this process may use (trainer/estimate.h bt_estimate_check_fits); --force only warns. */
static int check_memory(const bt_train_config *cfg) {
    bt_mem_limits l;
    bt_mem_limits_read(&l, NULL);
    int rc = bt_estimate_check_fits(cfg, cfg->threads > 0 ? cfg->threads : omp_get_max_threads(), &l);
    if (rc && cfg->force) {
        bt_log(BT_LOG_WARN, "trainer", "%s: starting anyway (--force)", bt_last_error());
        return 0;
    }
    return rc;
}

/* Stage 1. Rank and world from the launcher's environment, warnings and stale temporaries (rank
 * 0), the rendezvous and watchdog (world > 1: trainer/parallel/dist.h), the run id. */
static int run_rendezvous(bt_run *r) {
    const bt_train_config *cfg = r->cfg;
    int rc;
    if ((rc = bt_dist_env_resolve(&r->dist))) return rc;
    if (!r->eval_only && r->dist.rank == 0 && cfg->optim.warmup_steps > cfg->steps)
        bt_log(BT_LOG_WARN, "trainer", "optim.warmup_steps %d > steps %d: the learning rate never reaches "
               "optim.lr %g", cfg->optim.warmup_steps, cfg->steps, cfg->optim.lr);
    if (!r->eval_only && r->dist.rank == 0) { /* saves killed mid-write by an earlier run (SIGKILL) */
        bt_clean_stale_temps(cfg->out_dir, "trainer");
        if (cfg->checkpoint_every > 0 || cfg->resume_from)
            bt_clean_stale_temps(cfg->checkpoint_dir, "trainer");
        /* every destination, before anything is loaded: creatable, writable, and holding nothing
         * BarqTrain did not write (issue 21 §1, §2; trainer/io/outputs.h) */
        if ((rc = bt_train_check_outputs(cfg))) return rc;
    }
    if (!r->eval_only && (rc = check_memory(cfg))) return rc;
    if (r->dist.world > 1) {
        if (!r->reg->dist_unique_id) /* a backend without collectives: one process only */
            return bt_fail(BT_ERR_UNSUPPORTED, "%d processes (%s: rank %d): data-parallel training "
                           "all-reduces gradients with NCCL and needs device \"cuda\"", r->dist.world,
                           r->dist.source, r->dist.rank);
        if ((rc = dist_start(r))) return rc;
    }
    return run_id_init(r);
}

/* Stage 2. The base model (its own dtype: trainer/model/model.h), then the context extension. */
static int run_load_model(bt_run *r) {
    const bt_train_config *cfg = r->cfg;
    bt_model *m = &r->model;
    double t0 = bt_now();
    bt_model_load_opts lopts = {cfg->base_dtype, 0};
    /* dist.shard_base on W > 1 GPUs with a GGUF file (its blocks kept or quantised to NF4) or a
     * Hugging Face directory (quantised to NF4): this rank reads only its cut of every base linear
     * from the mapped file (NF4: quantises only its groups, with the whole matrix's offset), issue
     * 26, model.h bt_model_load_shard, so the node's host memory holds the base about once, not
     * once per rank. An fp32 base (and a bitsandbytes 4-bit linear) is still loaded whole and cut
     * on upload (docs/ARCHITECTURE.md §Parallel). */
    const int bd = bt_model_resolve_base_dtype(cfg->model, cfg->base_dtype);
    const int cut = cfg->device == BT_DEVICE_CUDA && cfg->dist.shard_base && r->dist.world > 1 &&
                    (bd == BT_BASE_GGUF || bd == BT_BASE_NF4);
    /* the cached reference log-probs are keyed by bt_model_ref_id, a hash of the base linears: a
     * rank that holds only its cut cannot compute it (the reference pass itself runs fine) */
    if (cut && cfg->pref_on && cfg->preference.precompute_ref_log_probs)
        return bt_fail(BT_ERR_UNSUPPORTED, "config: preference.precompute_ref_log_probs: with "
                       "dist.shard_base over %d ranks each rank reads only its cut of the base, so "
                       "the reference cache's key (the base's hash) cannot be computed; set "
                       "preference.precompute_ref_log_probs false (the reference is then computed every "
                       "step) or dist.shard_base false", r->dist.world);
    const bt_model_shard sh = {r->dist.rank, r->dist.world};
    int rc = cut ? bt_model_load_shard(m, cfg->model, &lopts, &sh)
                 : bt_model_load(m, cfg->model, &lopts);
    if (rc) return rc;
    if (cut)
        bt_log(BT_LOG_INFO, "trainer", "dist.shard_base: rank %d read only its 1/%d cut of the base "
               "linears from %s", r->dist.rank, r->dist.world, cfg->model);
    r->have_model = 1;
    bt_model_base_info(m, &r->binfo);
    bt_log(BT_LOG_INFO, "trainer",
           "model %s: %d layers, d_model %d, heads %d/%d, ffn %d, vocab %d%s, %.0f MiB, "
           "loaded in %.1f s; base linears %s (%s: %.2f bits per weight, %.1f MiB)",
           cfg->model, m->hp.n_layer, m->hp.d_model, m->hp.n_head, m->hp.n_kv_head,
           m->hp.d_ff, m->hp.vocab, m->tied ? ", tied embeddings" : "",
           bt_model_bytes(m) / 1048576.0, bt_now() - t0,
           bt_base_dtype_name(m->base_dtype),
           m->base_dtype == BT_BASE_GGUF ? r->binfo.types
           : m->base_dtype == BT_BASE_NF4 ? "re-quantised, double-quantised absmax"
                                          : "dequantised",
           r->binfo.bits_per_weight, r->binfo.bytes / 1048576.0);
    if (cfg->context_extension.target_length > 0) {
        const int ctx0 = m->hp.ctx;
        if ((rc = bt_model_extend_context(m, cfg->context_extension.method,
                                          cfg->context_extension.target_length)))
            return rc;
        bt_log(BT_LOG_INFO, "trainer", "context extension: %d -> %d tokens, %s RoPE scaling, "
               "factor %g%s", ctx0, m->hp.ctx, bt_rope_ext_name(m->hp.rope_ext),
               (double)m->hp.rope_ext_factor,
               m->ctx_extended ? "" : " (the model already carries it)");
    } else if (r->T > m->hp.ctx && m->hp.ctx > 0) {
        bt_log(BT_LOG_WARN, "trainer", "data.seq_len %d exceeds the model's context length %d: "
               "positions beyond it were never trained (set context_extension.target_length to "
               "extend the RoPE)", r->T, m->hp.ctx);
    }
    { /* Mistral / Phi-3 sliding_window: applied where the backend has windowed attention, else
       * full attention is exact only for rows within it */
        int64_t max_T = r->T;
        const char *what = "data.seq_len";
        for (int i = 0; i < cfg->eval.n_lengths; i++)
            if (cfg->eval.lengths[i] > max_T) max_T = cfg->eval.lengths[i], what = "eval.lengths";
        if ((rc = bt_model_check_window(m, max_T, what, r->reg->sliding_window))) return rc;
    }
    r->s2_group = bt_config_s2_group(cfg);
    if (r->s2_group > 0 && !r->eval_only)
        bt_log(BT_LOG_INFO, "trainer", "S2-Attn in training: groups of %d tokens (group_fraction "
               "%g of %d), half the heads shifted by %d; evaluation uses full attention", r->s2_group,
               cfg->s2_group_fraction, r->T, r->s2_group / 2);
    return 0;
}

/* Stage 3. The LoRA weights: fresh (seeded), the adapter `trainer eval --adapter` scores (its own
 * r, targets and context extension), or a checkpoint to resume or score (parameters, AdamW
 * moments, step and loader position). */
static int run_init_lora(bt_run *r) {
    const bt_train_config *cfg = r->cfg;
    bt_lora *lo = &r->lora;
    unsigned trainable = ((cfg->trainable_mask & (1u << BT_TRAINABLE_EMBED)) ? BT_TRAIN_EMBED : 0) |
                         ((cfg->trainable_mask & (1u << BT_TRAINABLE_NORM)) ? BT_TRAIN_NORM : 0);
    int rc = bt_lora_init(lo, &r->model, cfg->lora.r, cfg->lora.alpha, cfg->lora.dropout,
                             cfg->lora.target_mask, trainable, cfg->seed);
    if (rc) return rc;
    bt_log(BT_LOG_INFO, "trainer", "LoRA r %d alpha %g dropout %g: %lld trainable parameters%s",
           lo->r, lo->alpha, lo->dropout, (long long)lo->n_params,
           trainable ? " (LoRA+: with dense embed_tokens/norm weights)" : "");
    if (r->eval_only && cfg->eval_adapter) {
        bt_lora_free(lo);
        /* positions as the adapter was trained (its barqtrain_context_extension note), as
         * `trainer export` and `generate` apply it */
        if ((rc = bt_adapter_apply_context(&r->model, cfg->eval_adapter))) return rc;
        if ((rc = bt_lora_load_peft(lo, &r->model, cfg->eval_adapter))) return rc;
        bt_log(BT_LOG_INFO, "trainer", "evaluating adapter %s: r %d, alpha %g%s", cfg->eval_adapter,
               lo->r, lo->alpha, lo->trainable ? ", LoRA+ embed_tokens/norms" : "");
    }
    if (cfg->resume_from && !cfg->eval_adapter) {
        int64_t st = 0;
        int ck_steps = 0;
        if ((rc = bt_checkpoint_load_from(cfg->resume_from, cfg, &r->model, lo, &st, r->resume, &r->has_resume,
                                          &ck_steps, r->dist.rank, r->dist.world, &r->resume_world)))
            return rc;
        if (r->resume_world && !r->eval_only)
            bt_log(BT_LOG_INFO, "trainer", "checkpoint %s was written by %d rank(s), this run has %d: the data "
                   "continue at the same row (rank r of W takes rows r, r + W, ...; grad_accum %d x %d ranks keeps "
                   "the global batch)", cfg->resume_from, r->resume_world, r->dist.world, cfg->grad_accum,
                   r->dist.world);
        if (r->eval_only)
            bt_log(BT_LOG_INFO, "trainer", "evaluating checkpoint %s (step %lld)", cfg->resume_from,
                   (long long)st);
        else if (st > cfg->steps)
            return bt_fail(BT_ERR_INVALID, "checkpoint %s is at step %lld, past steps = %d",
                           cfg->resume_from, (long long)st, cfg->steps);
        r->start_step = (int)st;
        if (ck_steps != cfg->steps && !r->eval_only)
            bt_log(BT_LOG_WARN, "trainer", "checkpoint was written by a run of %d steps, this run "
                   "has %d: the learning-rate schedule follows %d", ck_steps, cfg->steps,
                   cfg->steps);
        if (!r->eval_only)
            bt_log(BT_LOG_INFO, "trainer", "resumed from %s at step %d", cfg->resume_from,
                   r->start_step);
    }
    r->done_steps = r->start_step;
    return 0;
}

/* Stage 4. The backend of cfg->device (trainer/backend/backend.h): the CPU step context or the GPU
 * trainer on this rank's device, with the stop check before every layer (and in every collective
 * wait, which the watchdog follows), S2-Attn, and the collectives between ranks. */
static int run_init_backend(bt_run *r) {
    bt_backend_params p = {
        .cfg = r->cfg,
        .model = &r->model,
        .lora = &r->lora,
        .max_M = r->M,
        .s2_group = r->s2_group,
        .rank = r->dist.rank,
        .world = r->dist.world,
        .local_rank = r->dist.local_rank,
        .dist_id = r->dist_id,
        .check = bt_run_stop_check,
        .collective = bt_run_on_collective,
        .hook_arg = r,
    };
    int rc = r->reg->init(&r->be, &p);
    if (rc || !r->cfg->pref_on) return rc;
    /* a preference objective: the backend's log-prob passes (keyed off its ops, not its name)
     * and the step's buffers */
    if (!bt_backend_has_logprobs(r->be))
        return bt_fail(BT_ERR_UNSUPPORTED, "objective \"%s\": device \"%s\" has no log-prob pass for "
                       "the preference losses yet; use device \"cpu\"", r->cfg->objective, r->reg->name);
    if ((rc = bt_pref_step_new(&r->pref, &r->cfg->pref, r->B, r->T, r->model.hp.vocab))) return rc;
    const bt_pref_params *pp = &r->cfg->pref;
    if (r->cfg->preference.precompute_ref_log_probs &&
        (pp->algo == BT_PREF_DPO || pp->algo == BT_PREF_KTO)) {
        const double t0 = bt_now();
        bt_model_ref_id(&r->model, r->ref_base);
        bt_log(BT_LOG_INFO, "trainer", "objective %s: loss_type %s%s, beta %g; reference: the base with "
               "the adapter disabled, its log-probs kept in loaderd's token cache as ref_base %s "
               "(identity in %.2f s)%s", r->cfg->objective, bt_pref_loss_type_name(pp->loss_type[0]),
               pp->n_loss_types > 1 ? " (+ more)" : "", pp->beta, r->ref_base, bt_now() - t0,
               pp->algo == BT_PREF_KTO ? "; KTO's KL sequences are computed every step" : "");
        return 0;
    }
    bt_log(BT_LOG_INFO, "trainer", "objective %s: loss_type %s%s, beta %g; reference: the base with "
           "the adapter disabled, computed every step", r->cfg->objective,
           bt_pref_loss_type_name(pp->loss_type[0]), pp->n_loss_types > 1 ? " (+ more)" : "", pp->beta);
    return 0;
}

/* The held-out evaluation (per length with eval.lengths; a preference objective's metrics into
 * r->pref_eval_m), into *loss / len. */
static int run_eval(bt_run *r, double *loss, bt_eval_length *len, int *cut) {
    if (r->pref) {
        int rc = bt_pref_run_eval(r, &r->pref_eval_m, &r->n_eval, cut);
        *loss = r->pref_eval_m.loss;
        return rc;
    }
    return r->by_len ? bt_eval_lengths(r, len, cut) : bt_eval_heldout(r, loss, &r->n_eval, cut);
}

/* Stage 5. The held-out evaluation before training (or the one of `trainer eval`). */
static int run_eval_before(bt_run *r) {
    if (r->cfg->eval.n_shards == 0) return 0;
    int rc = run_eval(r, &r->before, r->len_before, &r->eval_cut);
    r->pref_before = r->pref_eval_m;
    return rc ? run_end_with(r, r->eval_only ? RUN_END_DONE : RUN_END_STOP_OR_FAIL, rc) : 0;
}

/* `trainer eval`: print what stage 5 measured; a cut evaluation is an interrupted run. */
static int run_eval_only(bt_run *r) {
    const bt_train_config *cfg = r->cfg;
    FILE *out = r->out;
    if (cfg->eval.n_shards == 0)
        return bt_fail(BT_ERR_INVALID, "config: eval.shards: required for `trainer eval`");
    if (r->dist.rank == 0) {
        if (r->by_len) {
            if (r->eval_cut) fprintf(out, "held-out evaluation interrupted\n");
            bt_eval_print_lengths(out, r->len_before, NULL, cfg->eval.n_lengths);
        } else if (r->eval_cut && r->n_eval == 0)
            fprintf(out, "held-out loss (partial, interrupted): no batch evaluated\n");
        else if (r->pref)
            fprintf(out, "held-out %s loss%s: %.6f, rewards/accuracies %.4f, rewards/margins %.4f, "
                    "logps/chosen %.4f, logps/rejected %.4f, logps/accuracies %.4f, logps/margins "
                    "%.4f (%lld %s)\n", cfg->objective,
                    r->eval_cut ? " (partial, interrupted)" : "", r->before,
                    r->pref_before.rewards_accuracies, r->pref_before.rewards_margins,
                    r->pref_before.logps_chosen, r->pref_before.logps_rejected,
                    r->pref_before.logps_accuracies, r->pref_before.logps_margins, r->n_eval,
                    cfg->pref.algo == BT_PREF_KTO ? "examples" : "pairs");
        else
            fprintf(out, "held-out loss%s: %.6f, perplexity %.3f (%lld tokens%s%s)\n",
                    r->eval_cut ? " (partial, interrupted)" : "", r->before, exp(r->before),
                    r->n_eval,
                    cfg->eval_adapter ? "; adapter " : cfg->resume_from ? "; checkpoint " : "",
                    cfg->eval_adapter ? cfg->eval_adapter
                    : cfg->resume_from ? cfg->resume_from
                                       : "");
        fflush(out);
    }
    if (!r->eval_cut) return 0;
    int rc = bt_run_stop_error(r);
    if (rc == BT_ERR_CANCELLED)
        rc = bt_fail(rc, "%s: the held-out evaluation is partial", bt_last_error());
    return rc;
}

/* Stage 6. Before the first step: the run report (rank 0), the training stream from loaderd
 * (resumed where the checkpoint left it), the micro-batch copies, the schedule. */
static int run_begin_training(bt_run *r) {
    const bt_train_config *cfg = r->cfg;
    int rc;
    if (r->dist.rank == 0) {
        if ((rc = bt_report_open(&r->rep, cfg, r->start_step))) return rc;
        if (cfg->eval.n_shards > 0 && !(r->eval_cut && r->n_eval == 0) &&
            (rc = r->pref ? bt_report_eval_pref(r->rep, r->start_step, &r->pref_before, r->n_eval)
                          : bt_report_eval(r->rep, r->start_step, r->before, r->n_eval)))
            return rc;
    }
    if (r->eval_cut) return run_end_with(r, RUN_END_STOP_OR_FAIL, bt_run_stop_error(r));
    if ((rc = bt_run_attach(r, &r->cl, cfg, 0, r->has_resume ? r->resume : NULL))) return rc;
    /* loaderd shows the base this run trains against (loaderctl status): type and real size */
    bt_client_set_base(r->cl, bt_base_dtype_name(r->binfo.base_dtype), r->binfo.types,
                       r->binfo.bits_per_weight, r->binfo.bytes);
    r->mbs = calloc((size_t)cfg->grad_accum, sizeof(bt_mb_copy));
    r->all_done = calloc((size_t)r->dist.world, BT_RESUME_STATE_BYTES);
    r->all_next = calloc((size_t)r->dist.world, BT_RESUME_STATE_BYTES);
    if (!r->mbs || !r->all_done || !r->all_next) return bt_fail(BT_ERR_NOMEM, "out of memory");
    for (int i = 0; i < cfg->grad_accum; i++)
        if ((rc = bt_mb_alloc(&r->mbs[i], r->B, r->T))) return rc;
    r->sched = (bt_schedule){cfg->schedule, cfg->optim.lr, cfg->min_lr_ratio,
                             cfg->optim.warmup_steps, cfg->steps};
    r->train_t0 = bt_now();
    r->train_cpu0 = bt_cpu_s();
    r->end_step = cfg->stop_at_step > 0 ? cfg->stop_at_step : cfg->steps;
    r->last_loss = NAN;
    r->ck_step = -1;
    r->adapter_step = -1;
    /* --profile: the second step of the run (the first warms caches and pages), or the only one */
    r->prof_step = !cfg->profile ? -1
                   : r->end_step - r->start_step >= 2 ? r->start_step + 1
                                                      : r->start_step;
    return 0;
}

/* What one step gathered: labelled targets and real tokens over all ranks, this rank's real
 * tokens, the time spent waiting for loaderd. */
typedef struct {
    long long n_lab, n_real, n_real_local;
    double wait_s;
} step_batches;

/* Step, part 1. All micro-batches of the step: the loss is normalised by the labelled targets
 * over all of them (exact mean, independent of how tokens fall into micro-batches, and of how
 * rows fall onto ranks), so they are counted before any backward; then every rank's loader
 * state after this step (for checkpoints: see save_interrupted). */
static int step_gather(bt_run *r, int step, step_batches *sb) {
    const bt_train_config *cfg = r->cfg;
    long long n_lab = 0, n_real = 0;
    int got = 0; /* 0 ok, 1 end of stream, 2 stop request while waiting, <0 error */
    double wait_s = 0;
    bt_pref_counts pc = {0, 0}; /* a preference objective's records and NLL targets */
    for (int i = 0; i < cfg->grad_accum && got == 0; i++) {
        double tw = bt_now();
        got = bt_run_next_batch(r, r->cl, cfg, &r->mbs[i], "train");
        wait_s += bt_now() - tw;
        if (got) break;
        bt_microbatch mb;
        bt_mb_view(&r->mbs[i], r->B, r->T, &mb);
        int n = bt_shift_targets(NULL, &mb, r->model.hp.vocab);
        if (n < 0) {
            got = n;
            break;
        }
        n_lab += n;
        n_real += r->mbs[i].n_real;
        if (r->pref && (got = bt_pref_run_count(r, &r->mbs[i], &pc)) < 0) break;
    }
    if (got == 2) return run_end_with(r, RUN_END_STOP_OR_FAIL, bt_run_stop_error(r));
    if (got == 1)
        got = bt_fail(BT_ERR_CLOSED, "the training stream ended after step %d of %d%s", step,
                      cfg->steps, r->dist.world > 1 ? " (on this rank)" : "");
    sb->n_real_local = n_real;
    sb->wait_s = wait_s;
    /* ... over all ranks: counts, and whether any rank's stream failed */
    double st[5] = {(double)n_lab, (double)n_real, got < 0, pc.records, pc.nll_tokens};
    int rc = bt_run_dist_sum(r, st, 5);
    if (rc) return run_end_with(r, RUN_END_STOP_OR_FAIL, rc);
    sb->n_lab = (long long)st[0];
    /* a preference step is a mean over its records: none, no update */
    r->pref_global = (bt_pref_counts){st[3], st[4]};
    if (r->pref) sb->n_lab = (long long)st[3];
    sb->n_real = (long long)st[1];
    if (st[2] > 0) /* the batch stream failed (here or on another rank) */
        return run_end_with(r, RUN_END_FAILED,
                            got < 0 ? got
                                    : bt_fail(BT_ERR_CLOSED, "another rank could not get its "
                                              "batches for step %d (see its log)", step + 1));
    memcpy(r->resume, r->mbs[cfg->grad_accum - 1].resume, BT_RESUME_STATE_BYTES);
    r->has_resume = 1;
    r->resume_world = 0; /* this run's own state from now on */
    rc = bt_run_gather_resume(r, r->resume, r->all_next);
    return rc ? run_end_with(r, RUN_END_STOP_OR_FAIL, rc) : 0;
}

/* Step, part 2. Forward + backward of every micro-batch, gradients scaled by 1 / n_lab, summed
 * over ranks; *loss = the global mean loss (NAN without labelled targets). */
static int step_forward_backward(bt_run *r, int step, long long n_lab, double *loss) {
    const bt_train_config *cfg = r->cfg;
    int rc = bt_backend_zero_grad(r->be);
    if (rc) return rc;
    double loss_sum = 0;
    float gscale = n_lab > 0 ? (float)(1.0 / (double)n_lab) : 0.f;
    if (r->pref && n_lab > 0 && (rc = bt_pref_run_backward(r, step)))
        return run_end_with(r, RUN_END_STOP_OR_FAIL, rc);
    for (int i = 0; i < cfg->grad_accum && !r->pref; i++) {
        bt_microbatch mb;
        bt_mb_view(&r->mbs[i], r->B, r->T, &mb);
        r->at_mb = i + 1;
        /* the dropout key also depends on the rank: the ranks' rows are different rows */
        double ls;
        rc = bt_backend_step(r->be, &mb, 1, gscale, bt_run_drop_key(r, step, i), &ls, NULL);
        if (rc) return run_end_with(r, RUN_END_STOP_OR_FAIL, rc);
        loss_sum += ls;
    }
    if (r->hooks && r->hooks->after_backward) r->hooks->after_backward(r->hooks->arg, step + 1, &r->lora);
    /* sum of every rank's d(loss_sum / n_lab): the gradient of the global mean loss */
    if (r->dist.world > 1 && (rc = bt_backend_allreduce_grads(r->be)))
        return run_end_with(r, RUN_END_STOP_OR_FAIL, rc);
    if (r->pref) { /* the step's loss and TRL's metrics over every rank's records */
        r->pref_m.loss = NAN;
        if (n_lab > 0 && (rc = bt_pref_run_metrics(r, r->pref_kl, &r->pref_m, NULL)))
            return run_end_with(r, RUN_END_STOP_OR_FAIL, rc);
        *loss = r->pref_m.loss;
        return 0;
    }
    if ((rc = bt_run_dist_sum(r, &loss_sum, 1))) return run_end_with(r, RUN_END_STOP_OR_FAIL, rc);
    *loss = n_lab > 0 ? loss_sum / (double)n_lab : NAN;
    return 0;
}

/* Step, part 3. Clip + AdamW on the backend (every rank holds the same summed gradients, so every
 * rank computes the same norm and the same update; nothing is applied without labelled targets
 * or with a non-finite loss or norm). A non-finite loss, norm or parameter stops the run
 * (diverged). */
static int step_update(bt_run *r, int step, long long n_lab, double loss, double *lr_out,
                       double *gnorm_out) {
    const bt_train_config *cfg = r->cfg;
    double lr = bt_schedule_lr(&r->sched, step), gnorm = 0;
    int64_t bad = -1;
    *lr_out = lr;
    const bt_backend_update u = {cfg->optim.grad_clip,      (float)lr,
                                 (float)cfg->optim.beta1,   (float)cfg->optim.beta2,
                                 (float)cfg->optim.eps,     (float)cfg->optim.weight_decay,
                                 step + 1,                  n_lab == 0 || !isfinite(loss)};
    int rc = bt_backend_update_params(r->be, &u, &gnorm, &bad);
    if (rc) return rc;
    *gnorm_out = gnorm;
    if (n_lab == 0) {
        bt_log(BT_LOG_WARN, "trainer", "step %d: no labelled %s; update skipped", step + 1,
               r->pref ? "preference record" : "tokens");
        return 0;
    }
    if (!isfinite(gnorm) || !isfinite(loss)) {
        /* diverged: stop here, save nothing (every rank sees the same loss and norm) */
        char what[96];
        snprintf(what, sizeof what, "%s %g", !isfinite(loss) ? "loss" : "gradient norm",
                 !isfinite(loss) ? loss : gnorm);
        return diverged(cfg, step + 1, what, lr, r->adapter_step, r->ck_step);
    }
    if (bad >= 0) {
        char what[96];
        snprintf(what, sizeof what, "LoRA parameter %zu after the update", (size_t)bad);
        return diverged(cfg, step + 1, what, lr, r->adapter_step, r->ck_step);
    }
    return 0;
}

/* Step, part 4. The step is complete: progress (tokens/s of all ranks on the console, rank 0;
 * this rank's to loaderd), the run report, the profile table of a profiled step. */
static int step_record(bt_run *r, double ts, double loss, double lr, double gnorm,
                       const step_batches *sb) {
    const bt_train_config *cfg = r->cfg;
    const int done = r->done_steps;
    double now = bt_now(), dt = now - ts, el = now - r->train_t0;
    double tps = dt > 0 ? (double)sb->n_real / dt : 0;
    bt_client_report(r->cl, (uint64_t)done, loss, dt > 0 ? (double)sb->n_real_local / dt : 0);
    if (r->dist.rank == 0 &&
        (done % cfg->log_every == 0 || done == cfg->steps || done == r->end_step)) {
        char e1[24], e2[24];
        bt_fmt_duration(e1, sizeof e1, el);
        bt_fmt_duration(e2, sizeof e2, el / (done - r->start_step) * (r->end_step - done));
        char pm[160] = "";
        if (r->pref) bt_pref_short(pm, sizeof pm, cfg, &r->pref_m);
        if (r->pref && r->ref_base[0]) {
            size_t l = strlen(pm);
            snprintf(pm + l, sizeof pm - l, " | ref cached %lld/%lld", r->ref_hit_step,
                     r->ref_hit_step + r->ref_miss_step);
        }
        fprintf(r->out, "step %d/%d | loss %.4f%s | lr %.2e | %.0f tok/s | elapsed %s | eta %s\n",
                done, cfg->steps, loss, pm, lr, tps, e1, e2);
        fflush(r->out);
        /* full precision, for exact comparisons (resume tests) */
        bt_log(BT_LOG_DEBUG, "trainer", "step %d loss %.17g grad norm %.17g", done, loss, gnorm);
    }
    int rc;
    if (r->rep) {
        bt_step_metrics sm = {done, loss, lr, gnorm, sb->n_real, dt, sb->wait_s,
                              bt_peak_rss_mib(), -1, r->pref ? &r->pref_m : NULL};
        size_t held, peak;
        if (bt_backend_device_memory(r->be, &held, &peak)) sm.device_mib = held / 1048576.0;
        if ((rc = bt_report_step(r->rep, &sm))) return rc;
        r->rep_steps++;
    }
    if (r->prof) {
        bt_backend_set_profile(r->be, NULL);
        if (r->dist.rank == 0 && (rc = print_profile(cfg, r->prof, done, dt, r->be, r->out)))
            return rc;
        bt_prof_free(r->prof);
        r->prof = NULL;
    }
    return 0;
}

/* The adapter's model card (README.md beside it, rank 0) for what the run has done so far: a
 * failure is a warning (the adapter itself is saved). */
static void write_card(bt_run *r, double after) {
    const bt_model_card_result res = {r->done_steps, r->start_step, r->dist.world, r->last_loss,
                                      r->cfg->eval.n_shards > 0 && !r->by_len ? r->before : NAN,
                                      after, r->n_eval};
    if (bt_model_card_write(r->cfg->out_dir, r->cfg, &res))
        bt_log(BT_LOG_WARN, "trainer", "%s (the adapter is saved)", bt_last_error());
}

/* Step, part 5. Periodic saves: a checkpoint every checkpoint_every steps (and at stop_at_step),
 * the adapter every save_every steps (rank 0 writes, every rank agrees). */
static int step_save(bt_run *r) {
    const bt_train_config *cfg = r->cfg;
    const int done = r->done_steps;
    int rc = 0;
    if (cfg->checkpoint_every > 0 && done < cfg->steps &&
        (done % cfg->checkpoint_every == 0 || done == r->end_step)) {
        if ((rc = save_checkpoint(r, done, r->all_done)))
            return run_end_with(r, RUN_END_STOP_OR_FAIL, rc);
        if (r->dist.rank == 0)
            bt_log(BT_LOG_INFO, "trainer", "step %d: checkpoint saved to %s", done,
                   cfg->checkpoint_dir);
        r->ck_step = done;
    }
    if (cfg->save_every > 0 && done % cfg->save_every == 0 && done < cfg->steps) {
        if (r->dist.rank == 0) {
            rc = bt_backend_sync_lora(r->be, 0);
            if (!rc)
                rc = bt_adapter_save(&r->lora, cfg->base_model_name_or_path, cfg->out_dir,
                                        &r->model);
            if (!rc) {
                write_card(r, NAN);
                bt_log(BT_LOG_INFO, "trainer", "step %d: adapter saved to %s", done, cfg->out_dir);
            }
        }
        if ((rc = bt_run_agree(r, rc, "saving the adapter")))
            return run_end_with(r, RUN_END_STOP_OR_FAIL, rc);
        r->adapter_step = done;
    }
    return 0;
}

/* Step, part 6. The periodic held-out evaluation (eval.every steps; not after the last step,
 * which run_finish evaluates): every rank evaluates its share, rank 0 prints and reports it. A
 * stop request during it ends the run like one during a step (the step itself is complete). */
static int step_eval(bt_run *r) {
    const bt_train_config *cfg = r->cfg;
    const int done = r->done_steps;
    if (cfg->eval.every <= 0 || r->by_len || done % cfg->eval.every != 0 || done >= cfg->steps ||
        done >= r->end_step)
        return 0;
    double loss = NAN;
    long long n = 0;
    int cut = 0, rc;
    if (r->pref) {
        rc = bt_pref_run_eval(r, &r->pref_eval_m, &n, &cut);
        if (!rc && cut) rc = bt_run_stop_error(r);
        if (rc) return run_end_with(r, RUN_END_STOP_OR_FAIL, rc);
        char pm[96];
        bt_pref_short(pm, sizeof pm, cfg, &r->pref_eval_m);
        if (r->dist.rank == 0) {
            fprintf(r->out, "step %d/%d | held-out loss %.4f%s | %lld %s\n", done, cfg->steps,
                    r->pref_eval_m.loss, pm, n, cfg->pref.algo == BT_PREF_KTO ? "examples" : "pairs");
            fflush(r->out);
        }
        return r->rep ? bt_report_eval_pref(r->rep, done, &r->pref_eval_m, n) : 0;
    }
    rc = bt_eval_heldout(r, &loss, &n, &cut);
    if (!rc && cut) rc = bt_run_stop_error(r);
    if (rc) return run_end_with(r, RUN_END_STOP_OR_FAIL, rc);
    if (r->dist.rank == 0) {
        fprintf(r->out, "step %d/%d | held-out loss %.4f | perplexity %.2f | %lld tokens\n", done,
                cfg->steps, loss, exp(loss), n);
        fflush(r->out);
    }
    if (r->rep && (rc = bt_report_eval(r->rep, done, loss, n))) return rc;
    return 0;
}

/* Stage 7. One optimiser step. A stop request (a signal on any rank, relayed by the watchdog)
 * lands mid-step: every wait and every layer asks bt_run_stop_check, the step is dropped, and
 * run_interrupted keeps the last completed one. */
static int run_step(bt_run *r, int step) {
    double ts = bt_now();
    int rc;
    if ((rc = bt_run_stop_check(r))) return run_end_with(r, RUN_END_STOP_OR_FAIL, rc);
    if (step == r->prof_step) {
        if (!(r->prof = bt_prof_new())) return bt_fail(BT_ERR_NOMEM, "out of memory");
        bt_backend_set_profile(r->be, r->prof);
    }
    step_batches sb = {0};
    double loss = NAN, lr = 0, gnorm = 0;
    if ((rc = step_gather(r, step, &sb))) return rc;
    if ((rc = step_forward_backward(r, step, sb.n_lab, &loss))) return rc;
    if ((rc = step_update(r, step, sb.n_lab, loss, &lr, &gnorm))) return rc;
    r->done_steps = step + 1;
    r->at_mb = 0;
    uint8_t *swap = r->all_done;
    r->all_done = r->all_next;
    r->all_next = swap;
    r->last_loss = loss;
    if ((rc = step_record(r, ts, loss, lr, gnorm, &sb))) return rc;
    if ((rc = step_eval(r))) return rc;
    return step_save(r);
}

/* Stage 8. After the last step: the adapter (rank 0 writes, every rank agrees), the held-out
 * evaluation after training, the summary. */
static int run_finish(bt_run *r) {
    const bt_train_config *cfg = r->cfg;
    FILE *out = r->out;
    int rc = 0;
    if (r->end_step < cfg->steps)
        bt_log(BT_LOG_INFO, "trainer", "stopped after step %d of %d (stop_at_step)", r->done_steps,
               cfg->steps);
    bt_client_close(r->cl);
    r->cl = NULL;
    if (r->dist.rank == 0) {
        rc = bt_backend_sync_lora(r->be, 0);
        if (!rc)
            rc = bt_adapter_save(&r->lora, cfg->base_model_name_or_path, cfg->out_dir, &r->model);
    }
    if ((rc = bt_run_agree(r, rc, "saving the adapter"))) return run_end_with(r, RUN_END_STOP_OR_FAIL, rc);
    if (r->dist.rank == 0)
        bt_log(BT_LOG_INFO, "trainer", "%d steps in %.1f s (CPU %.1f s), last loss %.4f, peak RSS %.0f MiB",
               r->done_steps, bt_now() - r->train_t0, bt_cpu_s() - r->train_cpu0,
               r->last_loss, bt_peak_rss_mib());
    if (cfg->eval.n_shards > 0) {
        int cut = 0;
        if ((rc = run_eval(r, &r->after, r->len_after, &cut)))
            return run_end_with(r, RUN_END_STOP_OR_FAIL, rc);
        if (cut) { /* the training is complete and saved: only the evaluation was cut short */
            rc = bt_run_stop_error(r);
            return bt_fail(rc, "%s during the final held-out evaluation; adapter for step %d of "
                           "%d saved to %s", bt_last_error(), r->done_steps, cfg->steps,
                           cfg->out_dir);
        }
        if (r->by_len) {
            if (r->dist.rank == 0) bt_eval_print_lengths(out, r->len_before, r->len_after, cfg->eval.n_lengths);
        } else {
            if (r->rep && (rc = r->pref ? bt_report_eval_pref(r->rep, r->done_steps, &r->pref_eval_m, r->n_eval)
                                        : bt_report_eval(r->rep, r->done_steps, r->after, r->n_eval)))
                return rc;
            if (r->dist.rank == 0)
                fprintf(out, "held-out loss: before %.4f -> after %.4f (%+.1f%%)\n", r->before,
                        r->after, 100.0 * (r->after - r->before) / r->before);
            const int kto = cfg->pref.algo == BT_PREF_KTO;
            if (r->dist.rank == 0 && r->pref)
                fprintf(out, "held-out %s: before %.4f -> after %.4f; rewards/margins: before %.4f -> "
                        "after %.4f (%lld %s)\n", kto ? "kl" : "rewards/accuracies",
                        kto ? r->pref_before.kl : r->pref_before.rewards_accuracies,
                        kto ? r->pref_eval_m.kl : r->pref_eval_m.rewards_accuracies,
                        r->pref_before.rewards_margins, r->pref_eval_m.rewards_margins, r->n_eval,
                        kto ? "examples" : "pairs");
            if (r->dist.rank == 0 && r->pref && !kto) /* ours: the policy's own preference */
                fprintf(out, "held-out logps/accuracies (policy log-prob chosen > rejected): before "
                        "%.4f -> after %.4f (%+.1f points); logps/margins: before %.4f -> after %.4f "
                        "(%lld pairs)\n", r->pref_before.logps_accuracies,
                        r->pref_eval_m.logps_accuracies,
                        100.0 * (r->pref_eval_m.logps_accuracies - r->pref_before.logps_accuracies),
                        r->pref_before.logps_margins, r->pref_eval_m.logps_margins, r->n_eval);
        }
    }
    if (r->dist.rank == 0) {
        write_card(r, cfg->eval.n_shards > 0 && !r->by_len ? r->after : NAN);
        fprintf(out, "adapter: %s\n", cfg->out_dir);
        fflush(out);
    }
    return 0;
}

/* `trainer train`: stages 6 to 8. */
static int run_train(bt_run *r) {
    int rc = run_begin_training(r);
    for (int step = r->start_step; !rc && step < r->end_step; step++) rc = run_step(r, step);
    return rc ? rc : run_finish(r);
}

/* Early end: rc from a wait, a layer or a collective. A stop request (BT_ERR_CANCELLED) keeps the
 * last completed step: with several ranks every rank comes here (relayed), no collective is used
 * any more, and rank 0 alone saves. Any other rc is returned as it is. */
static int run_interrupted(bt_run *r, int rc) {
    const bt_train_config *cfg = r->cfg;
    if (rc != BT_ERR_CANCELLED) return rc;
    char why[600], saved[1200] = "";
    snprintf(why, sizeof why, "%s", bt_last_error());
    bt_client_close(r->cl);
    r->cl = NULL;
    const int done = r->done_steps;
    if (r->at_mb > 0)
        bt_log(BT_LOG_WARN, "trainer", "%s: stopping mid-step %d (in micro-batch %d of %d)", why,
               done + 1, r->at_mb, cfg->grad_accum);
    else
        bt_log(BT_LOG_WARN, "trainer", "%s: stopping before step %d's forward", why, done + 1);
    int src = 0;
    if (r->dist.rank == 0 && done > r->start_step)
        src = save_interrupted(r, done, r->all_done, saved, sizeof saved);
    if (src)
        return bt_fail(BT_ERR_IO, "%s after step %d; saving it failed: %s", why, done,
                       bt_last_error());
    if (r->dist.rank != 0)
        return bt_fail(BT_ERR_CANCELLED, "%s: stopped after step %d of %d (rank 0 saves)", why,
                       done, cfg->steps);
    if (done > r->start_step)
        return bt_fail(BT_ERR_CANCELLED, "%s: stopped after step %d of %d; %s", why, done,
                       cfg->steps, saved);
    return bt_fail(BT_ERR_CANCELLED, "%s before step %d completed: nothing new to save", why,
                   r->start_step + 1);
}

/* Early end: the batch stream failed after some steps: keep them (adapter + checkpoint); with
 * several ranks every rank comes here together (the step's first collective). Returns rc with
 * what was saved added to its message. */
static int run_stream_failed(bt_run *r, int rc) {
    const bt_train_config *cfg = r->cfg;
    const int done = r->done_steps;
    if (done <= r->start_step) return rc;
    char why[1024];
    snprintf(why, sizeof why, "%s", bt_last_error());
    bt_client_close(r->cl); /* first: its best-effort detach may overwrite bt_last_error */
    r->cl = NULL;
    int src = 0;
    if (r->dist.rank == 0) {
        src = bt_backend_sync_lora(r->be, 1);
        if (!src)
            src = bt_adapter_save(&r->lora, cfg->base_model_name_or_path, cfg->out_dir, &r->model);
    }
    src = bt_run_agree(r, src, "saving the adapter");
    if (!src && cfg->checkpoint_every > 0 && r->ck_step != done)
        src = save_checkpoint(r, done, r->all_done);
    if (src)
        return bt_fail(rc, "%s; saving step %d also failed: %s", why, done, bt_last_error());
    return bt_fail(rc, "%s; adapter for step %d of %d saved to %s%s%s", why, done, cfg->steps,
                   cfg->out_dir, cfg->checkpoint_every > 0 ? ", checkpoint to " : "",
                   cfg->checkpoint_every > 0 ? cfg->checkpoint_dir : "");
}

/* Teardown: the report (and its plot of what did run), buffers, the stream, the backend, the
 * LoRA weights and the model. */
static void run_teardown(bt_run *r, int rc) {
    if (r->ref_base[0]) /* this rank's, every evaluation included: each rank counts and puts its own */
        bt_log(BT_LOG_INFO, "trainer", "reference log-probs (rank %d): training %lld from loaderd's cache, "
               "%lld computed; held-out %lld cached, %lld computed; put: %lld accepted, %lld refused, "
               "%lld failed puts", r->dist.rank, r->ref_hit, r->ref_miss, r->ref_eval_hit,
               r->ref_eval_miss, r->ref_acc, r->ref_rej, r->ref_put_fail);
    bt_report_close(r->rep, r->cfg->report.plot && r->rep_steps > 0);
    bt_prof_free(r->prof);
    bt_pref_step_free(r->pref);
    r->pref = NULL;
    free(r->ref_pend);
    r->ref_pend = NULL;
    if (r->mbs)
        for (int i = 0; i < r->cfg->grad_accum; i++) bt_mb_free(&r->mbs[i]);
    free(r->mbs);
    free(r->all_done);
    free(r->all_next);
    bt_client_close(r->cl);
    if (rc == BT_ERR_CANCELLED) bt_backend_abort(r->be); /* peers may be gone */
    bt_backend_free(r->be);
    r->be = NULL;
    if (r->have_model) {
        bt_lora_free(&r->lora);
        bt_model_free(&r->model);
    }
}

/* Several ranks: the last word to the others through the watchdog (goodbye, or this rank's
 * error), keeping rc's message. Returns the run's final rc. */
static int run_farewell(bt_run *r, int rc) {
    if (!r->mon) return rc;
    char keep[1400];
    snprintf(keep, sizeof keep, "%s", bt_last_error());
    if (rc == 0 || rc == BT_ERR_CANCELLED) {
        int frc = bt_dist_monitor_finish(r->mon);
        if (!rc && frc) rc = frc;
        else bt_fail(rc, "%s", keep);
    } else {
        if (!bt_dist_monitor_check(r->mon)) bt_dist_monitor_fail(r->mon, keep); /* else known */
        bt_fail(rc, "%s", keep);
    }
    bt_dist_monitor_free(r->mon);
    r->mon = NULL;
    return rc;
}

int bt_train_run(const bt_train_config *cfg, int eval_only, FILE *out) {
    return bt_train_run_ex(cfg, eval_only, out, NULL);
}

int bt_train_run_ex(const bt_train_config *cfg, int eval_only, FILE *out, const bt_run_hooks *hooks) {
    const bt_backend_reg *reg;
    int rc = bt_backend_get(cfg->device, &reg); /* a device this trainer was built without */
    if (rc) return rc;
    set_threads(cfg->threads);
    bt_run_signals signals;
    bt_run_catch_signals(&signals);

    bt_run *r = calloc(1, sizeof *r);
    if (!r) {
        rc = bt_fail(BT_ERR_NOMEM, "out of memory");
        goto out;
    }
    r->cfg = cfg;
    r->hooks = hooks;
    r->reg = reg;
    r->eval_only = eval_only;
    r->out = out;
    r->dist = (bt_dist_env){0, 1, 0, "single"};
    r->B = cfg->data.micro_batch_size;
    r->T = cfg->data.seq_len;
    r->M = r->B * r->T;
    r->by_len = cfg->eval.n_lengths > 0;
    r->before = r->after = NAN;
    r->end = RUN_END_DONE;

    rc = run_rendezvous(r);
    if (!rc) rc = run_load_model(r);
    if (!rc) rc = run_init_lora(r);
    if (!rc) rc = run_init_backend(r);
    if (!rc) rc = run_eval_before(r);
    if (!rc) rc = eval_only ? run_eval_only(r) : run_train(r);
    if (rc && r->end == RUN_END_STOP_OR_FAIL) rc = run_interrupted(r, rc);
    else if (rc && r->end == RUN_END_FAILED) rc = run_stream_failed(r, rc);
    run_teardown(r, rc);
    rc = run_farewell(r, rc);
    free(r);
out:
    bt_run_restore_signals(&signals);
    return rc;
}
